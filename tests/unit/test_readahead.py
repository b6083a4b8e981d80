"""The write log behind rows read ahead (``sven.models.readahead``), on hand-built
numbers: which rows a read must read again."""

from __future__ import annotations

import torch

from sven.models.readahead import WriteLog


def _commit(log: WriteLog, rows: list[int], finish: bool = True) -> None:
    log.mark(torch.tensor(rows), log.next())
    if finish:
        log.finish()


def test_rows_written_by_a_commit_not_over_at_the_read_are_stale() -> None:
    log = WriteLog(6, torch.device("cpu"))
    assert log.stamp.tolist() == [-1] * 6 and int(log.counter) == 0
    nodes = torch.tensor([0, 1, 2, 3, 5, 5])
    # Nothing written since a read: nothing to read again.
    assert not log.stale(nodes, log.since()).any()
    _commit(log, [1, 2])  # commit 1, over
    since = log.since()  # a read after commit 1
    _commit(log, [3])  # commit 2, after the read
    assert log.stamp.tolist() == [-1, 1, 1, 2, -1, -1]
    assert int(since) == 2
    assert log.stale(nodes, since).tolist() == [False, False, False, True, False, False]
    # A commit still writing while rows are read: its rows are stale too.
    _commit(log, [0], finish=False)
    during = log.since()
    _commit(log, [5])
    assert log.stale(nodes, during).tolist() == [True, False, False, False, True, True]


def test_a_wholesale_change_makes_every_earlier_read_stale() -> None:
    log = WriteLog(4, torch.device("cpu"))
    _commit(log, [0])
    _commit(log, [1])
    before = log.since()
    log.invalidate()
    nodes = torch.arange(4)
    assert log.stale(nodes, before).all()
    # A read after the change, then a commit: only that commit's rows.
    after = log.since()
    _commit(log, [2])
    assert log.stale(nodes, after).tolist() == [False, False, True, False]
    assert [t.shape for t in log.tensors()] == [(4,), (1,), (1,), (1,)]
