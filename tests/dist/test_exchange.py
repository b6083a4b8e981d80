"""The memory exchange split into plan / fetch / push: the same rows and bytes as the
one-call fetch, asynchronous fetches and pushes that change nothing until waited for,
and an id exchange on a group of its own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist.launch import run_ranks

pytestmark = pytest.mark.dist

N, D, M = 12, 3, 2


def _exchange(rank: int, world_size: int):
    from sven.models.memory import MemoryState
    from sven.pipeline.memory_exchange import MemoryExchange

    owner = torch.arange(N) % world_size
    owned = (owner == rank).nonzero().squeeze(1)
    shard = MemoryState(owned.numel(), D, 2 * D, M, dtype=torch.float64)
    # Every row holds its global id, so that a fetched row says where it came from.
    shard.memory[:] = owned[:, None].to(torch.float64) + torch.arange(D) / 10
    feat = owned[:, None].to(torch.float64) * torch.ones(1, 2)
    return MemoryExchange(owner, rank, world_size, shard, node_feat=feat)


def _update(nodes: torch.Tensor, base: int):
    from sven.models.memory import MemoryUpdate

    w = nodes.numel()
    keys = torch.arange(w) + base
    return MemoryUpdate(
        nodes=nodes,
        memory=torch.full((w, D), float(base)),
        last_update=torch.full((w,), float(base), dtype=torch.float64),
        key=keys,
        mail_nodes=nodes,
        mail=torch.full((w, 2 * D), float(base)),
        mail_ts=torch.full((w,), float(base), dtype=torch.float64),
        mail_key=keys,
    )


def _split_main(rank: int, world_size: int) -> dict:
    ex = _exchange(rank, world_size)
    side = dist.new_group(list(range(world_size)))
    nodes = torch.tensor([0, 3, 5, 7, 10, 11]) if rank == 0 else torch.tensor([1, 2, 3, 8, 11])
    occ = torch.arange(nodes.numel()) + 1

    whole = ex.fetch(nodes, occ)
    counted = dict(vars(ex.counter))
    ex.counter.reset()
    plan = ex.plan(nodes, occ, group=side)
    # Made ahead, nothing is counted until the plan is fetched.
    assert ex.counter.ids == ex.counter.read_rows == ex.counter.naive == 0
    split = ex.fetch(plan)
    assert vars(ex.counter) == counted
    handle = ex.fetch(ex.plan(nodes, occ, group=side), async_op=True)
    later = handle.wait()
    for rows in (split, later):
        for a, b in zip(vars(rows).values(), vars(whole).values()):
            assert torch.equal(a, b)
    assert torch.equal(whole.memory[:, 0], nodes.to(torch.float64))
    assert torch.equal(whole.node_feat[:, 0], nodes.to(torch.float64))

    # An asynchronous push changes no shard until it is waited for; a fetch issued
    # before the wait reads the old rows (what staleness 1 relies on).
    before = ex.shard.memory.clone()
    push = ex.push(
        _update(torch.tensor([2, 3]) if rank == 0 else torch.tensor([3, 4]), 100 * (rank + 1)),
        async_op=True,
    )
    assert torch.equal(ex.shard.memory, before)
    stale = ex.fetch(torch.tensor([2, 3, 4]))
    push.wait()
    push.wait()  # once only
    fresh = ex.fetch(torch.tensor([2, 3, 4]))
    return {"stale": stale.memory[:, 0].tolist(), "fresh": fresh.memory[:, 0].tolist()}


def test_plan_fetch_push_split() -> None:
    res = run_ranks(_split_main, 2, timeout=120)
    for r in res:
        assert r["stale"] == [2.0, 3.0, 4.0]
        # Node 3 is written by both ranks: rank 1's event key (200 > 101) is the later one.
        assert r["fresh"] == [100.0, 200.0, 200.0]
