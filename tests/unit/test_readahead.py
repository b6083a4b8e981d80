"""The write log behind rows read ahead (``sven.models.readahead``), on hand-built
numbers: which rows a read at a counter value must read again."""

from __future__ import annotations

import torch

from sven.models.readahead import WriteLog


def test_rows_stamped_at_or_after_the_read_are_stale() -> None:
    log = WriteLog(6, torch.device("cpu"))
    assert log.stamp.tolist() == [-1] * 6 and int(log.counter) == 0
    nodes = torch.tensor([0, 1, 2, 3, 5, 5])
    # A new log counts as changed wholesale: a read at 0 reads every row again.
    assert log.stale(nodes, log.counter.clone()).all()
    log.mark(torch.tensor([1, 2]), log.next())  # commit 1 writes rows 1 and 2
    since = log.counter.clone()  # a read after commit 1 (which may still be writing)
    log.mark(torch.tensor([3]), log.next())  # commit 2 writes row 3
    assert log.stamp.tolist() == [-1, 1, 1, 2, -1, -1]
    assert log.stale(nodes, since).tolist() == [False, True, True, True, False, False]
    # A read after commit 2: only row 3 (commit 2's) is read again.
    assert (
        log.stale(nodes, log.counter.clone()).tolist() == [False, False, False, True] + [False] * 2
    )


def test_a_wholesale_change_makes_every_earlier_read_stale() -> None:
    log = WriteLog(4, torch.device("cpu"))
    log.mark(torch.tensor([0]), log.next())
    log.mark(torch.tensor([1]), log.next())
    before = log.counter.clone()
    log.invalidate()
    nodes = torch.arange(4)
    assert log.stale(nodes, before).all()
    # A read after the change and a commit: only that commit's rows.
    log.mark(torch.tensor([2]), log.next())
    after = log.counter.clone()
    assert log.stale(nodes, after).tolist() == [False, False, True, False]
    assert [t.shape for t in log.tensors()] == [(4,), (1,), (1,)]
