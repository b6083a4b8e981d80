"""The fixed-capacity exchange on hand-built shards: each node's row fetched from its
owner once, padding slots and unread slots zero, the latest event winning a node written
by two ranks, exact byte counts of valid rows only, and a batch over a capacity recorded
and reported, naming the capacity, instead of silently dropping rows."""

from __future__ import annotations

import pytest
import torch

from tests.dist.launch import run_ranks

pytestmark = pytest.mark.dist

N, D, M = 12, 3, 2


def _exchange(rank: int, world_size: int, staleness: int = 0):
    from sven.models.memory import MemoryState
    from sven.pipeline.exchange import FixedExchange

    owner = torch.arange(N) % world_size
    owned = (owner == rank).nonzero().squeeze(1)
    shard = MemoryState(owned.numel(), D, 2 * D, M, dtype=torch.float64)
    # Every row holds its global id, so that a fetched row says where it came from.
    shard.memory[:] = owned[:, None].to(torch.float64) + torch.arange(D) / 10
    feat = owned[:, None].to(torch.float64) * torch.ones(1, 2)
    return FixedExchange(owner, rank, world_size, shard, node_feat=feat, staleness=staleness)


def _dense(nodes: list[int], base: int):
    from sven.models.memory import DenseUpdate

    w = len(nodes)
    keys = torch.arange(w) + base
    return DenseUpdate(
        nodes=torch.tensor(nodes),
        memory=torch.full((w, D), float(base), dtype=torch.float64),
        last_update=torch.full((w,), float(base), dtype=torch.float64),
        key=keys,
        mail_nodes=torch.tensor(nodes),
        mail=torch.full((w, 2 * D), float(base), dtype=torch.float64),
        mail_ts=torch.full((w,), float(base), dtype=torch.float64),
        mail_key=keys,
    )


def _caps(fetch: int, push: int, world_size: int):
    from sven.pipeline.wire import Capacities

    off = [[0 if r == q else fetch for q in range(world_size)] for r in range(world_size)]
    pw = [[0 if r == q else push for q in range(world_size)] for r in range(world_size)]
    return Capacities(8, off, pw)


def _fetch_push_main(rank: int, world_size: int) -> dict:
    from sven.pipeline.wire import ID_BYTES

    ex = _exchange(rank, world_size)
    ex.set_capacities("train", _caps(4, 4, world_size))
    # Slots as a fixed-slot batch has them: distinct ids, N in the padding slots. Node 5
    # is present but read by no real event (0 occurrences): it is not fetched.
    if rank == 0:
        nodes = torch.tensor([0, 3, 5, 7, 11, N, N])
        occ = torch.tensor([1, 2, 0, 1, 3, 0, 0])
    else:
        nodes = torch.tensor([1, 2, 3, 8, N])
        occ = torch.tensor([2, 1, 1, 1, 0])
    rows = ex.fetch(ex.plan(nodes, occ))
    counted = ex.counter.read()
    # Before any push: node 3 is written by both ranks; rank 1's keys (200..) are later.
    ex.push(_dense([2, 3] if rank == 0 else [3, 4], 100 * (rank + 1)))
    ex.wait()
    after = ex.fetch(ex.plan(torch.tensor([2, 3, 4, N]), torch.tensor([1, 1, 1, 0])))
    return {
        "memory": rows.memory[:, 0].tolist(),
        "feat": rows.node_feat[:, 0].tolist(),
        "counted": counted,
        "rb": ex.read_codec.row_bytes,
        "id": ID_BYTES,
        "after": after.memory[:, 0].tolist(),
        "mail_valid": after.mail_valid[:, 0].tolist(),
        "overflow": ex.overflow.tolist(),
    }


def test_fetch_and_push_over_fixed_buffers() -> None:
    r0, r1 = run_ranks(_fetch_push_main, 2, timeout=120)
    # Rank 0 owns the even nodes. Its odd nodes 3, 7, 11 come from rank 1; node 5 is
    # unread (zero row), padding slots zero.
    assert r0["memory"] == [0.0, 3.0, 0.0, 7.0, 11.0, 0.0, 0.0]
    assert r0["feat"] == [0.0, 3.0, 0.0, 7.0, 11.0, 0.0, 0.0]
    assert r1["memory"] == [1.0, 2.0, 3.0, 8.0, 0.0]
    rb, idb = r0["rb"], r0["id"]
    # Rank 0 requested 3 remote rows (ids out) and served rank 1's 2 (2 and 8); the
    # naive volume counts occurrences (3 + 1 + 2 reads... of its remote nodes).
    assert r0["counted"]["ids"] == 3 * idb
    assert r0["counted"]["read_rows"] == 2 * rb
    assert r0["counted"]["naive"] == (2 + 1 + 3) * (idb + rb)
    assert r1["counted"]["ids"] == 2 * idb
    assert r1["counted"]["read_rows"] == 3 * rb
    assert r1["counted"]["naive"] == (1 + 1) * (idb + rb)
    for r in (r0, r1):
        # Node 2: rank 0's write (100); node 3: rank 1's later event (200); node 4: 200.
        assert r["after"] == [100.0, 200.0, 200.0, 0.0]
        assert r["mail_valid"] == [True, True, True, False]
        assert max(r["overflow"]) <= 0


def _overflow_main(rank: int, world_size: int) -> str:
    from sven.pipeline.wire import CapacityError

    ex = _exchange(rank, world_size)
    # Room for one remote row per peer; rank 0 asks rank 1 for three.
    ex.set_capacities("train", _caps(1, 1, world_size))
    nodes = torch.tensor([1, 3, 5, N]) if rank == 0 else torch.tensor([0, N, N, N])
    occ = torch.tensor([1, 1, 1, 0]) if rank == 0 else torch.tensor([1, 0, 0, 0])
    rows = ex.fetch(ex.plan(nodes, occ))
    try:
        ex.check()
    except CapacityError as exc:
        return f"{rows.memory[:, 0].tolist()} | {exc}"
    return f"{rows.memory[:, 0].tolist()} | fits"


def test_a_batch_over_capacity_is_reported_naming_the_capacity() -> None:
    r0, r1 = run_ranks(_overflow_main, 2, timeout=120)
    # The first request fits; the two beyond the capacity are never served.
    assert r0.startswith("[1.0, 0.0, 0.0, 0.0] | rank 0: a batch needed 2 more fetch rows")
    assert "capacity {'train': [0, 1]}" in r0
    assert "dist.capacity_slack" in r0
    # Rank 1's one request fit (rank 0 stops the run: it raises at its next check).
    assert r1 == "[0.0, 0.0, 0.0, 0.0] | fits"


def _stale_main(rank: int, world_size: int) -> dict:
    ex = _exchange(rank, world_size, staleness=1)
    ex.set_capacities("train", _caps(4, 4, world_size))
    nodes, occ = torch.tensor([2, 3, 4]), torch.tensor([1, 1, 1])
    ex.push(_dense([2, 3] if rank == 0 else [3, 4], 100 * (rank + 1)))
    ex.wait()
    # Staleness 1: the next read sees the memory from before the write-back...
    stale = ex.fetch(ex.plan(nodes, occ))
    # ...and the one after it sees the write-back.
    fresh = ex.fetch(ex.plan(nodes, occ))
    return {"stale": stale.memory[:, 0].tolist(), "fresh": fresh.memory[:, 0].tolist()}


def test_staleness_one_reads_one_batch_late() -> None:
    for r in run_ranks(_stale_main, 2, timeout=120):
        assert r["stale"] == [2.0, 3.0, 4.0]
        assert r["fresh"] == [100.0, 200.0, 200.0]
