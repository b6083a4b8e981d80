"""Which rows the host tier keeps copies of (``sven.engine.data.most_active``) and how
many the plan allows (``state.hot_rows`` in ``sven.engine.plan.plan_run``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sven.config import load_config
from sven.engine.data import most_active
from sven.engine.plan import node_row_bytes, plan_run
from sven.errors import ConfigError
from sven.partition.graph import vertex_loads


def test_most_active_hand_built() -> None:
    src = torch.tensor([2, 2, 3, 4, 0, 2])
    dst = torch.tensor([3, 4, 2, 5, 2, 2])
    # Node 2 has six events, 3 and 4 two, 0 and 5 one, 1 none: ties by id.
    owned = torch.arange(6)
    assert most_active(src, dst, 6, owned, 10).tolist() == [2, 3, 4, 0, 5]
    assert most_active(src, dst, 6, owned, 2).tolist() == [2, 3]
    assert most_active(src, dst, 6, owned, 0).tolist() == []
    # Shard rows of a rank owning vertices 1, 3, 5: rows 1 (vertex 3) then 2 (vertex 5).
    assert most_active(src, dst, 6, torch.tensor([1, 3, 5]), 10).tolist() == [1, 2]
    # The counts are the partitioner's vertex loads.
    loads = vertex_loads(src.numpy(), dst.numpy(), 6)
    assert most_active(src, dst, 6, owned, 10).tolist() == [
        int(v) for v in np.argsort(-loads, kind="stable") if loads[v]
    ]


def _plan(monkeypatch, *over: str, free: int = 10**10, device: str = "cuda"):
    cfg = load_config(None, ["state.device=host", *over])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (free, free))
    return plan_run(
        cfg,
        num_events=1000,
        num_nodes=10**6,
        edge_dim=0,
        node_dim=0,
        mail_dim=200,
        mailbox_size=1,
        world_size=1,
        device=torch.device(device),
        writes=False,
    )


def test_plan_keeps_copies_as_far_as_half_the_gpu_budget_left(monkeypatch) -> None:
    row = node_row_bytes(100, 200, 1, 4)
    plan = _plan(monkeypatch)
    assert plan.tier == "host" and plan.hot_rows == 10**6
    copies = [i for i in plan.items if i.what == "hot node rows (copies)"]
    assert copies[0].gpu == (10**6 + 1) * row + 4 * (10**6 + 1)
    # A budget of 2 GB: half of what the other items leave, in whole rows.
    small = _plan(monkeypatch, "state.gpu_budget_gb=2")
    others = sum(i.gpu for i in small.items if i.what != "hot node rows (copies)")
    room = 2 * 10**9 - others - 4 * (10**6 + 1)
    assert small.hot_rows == room // 2 // row
    assert small.to_dict()["hot_rows_max"] == small.hot_rows
    assert small.shortfall() is None


def test_plan_hot_rows_settings(monkeypatch) -> None:
    assert _plan(monkeypatch, "state.hot_rows=0").hot_rows == 0
    assert _plan(monkeypatch, "state.hot_rows=1234").hot_rows == 1234
    assert _plan(monkeypatch, "state.hot_rows=5000000").hot_rows == 10**6
    # No copies in GPU memory on a CPU run unless a count is asked for.
    assert _plan(monkeypatch, device="cpu").hot_rows == 0
    cpu = _plan(monkeypatch, "state.hot_rows=10", device="cpu")
    assert cpu.hot_rows == 10
    assert [i.host > 0 for i in cpu.items if i.what == "hot node rows (copies)"] == [True]
    # The GPU tier keeps no copies.
    assert _plan(monkeypatch, "state.device=gpu").hot_rows == 0
    with pytest.raises(ConfigError, match=r"state\.hot_rows must be -1"):
        load_config(None, ["state.hot_rows=-2"])
