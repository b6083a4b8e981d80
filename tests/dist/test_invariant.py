"""The distributed invariant: P ranks == one process, after every batch, in float64.

Each rank processes the events the partition assigns to it, reads and writes memory
through the owners, and sums gradients; parameters and memory must equal the
one-process run with the same global batch after every training batch, and the final
summaries must agree. With dropout and uniform neighbour sampling on: their draws are
keyed by event and batch, not by a generator, so every rank layout draws the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import sven
from tests.dist.launch import run_ranks

pytestmark = pytest.mark.dist

MODELS = ("tgn", "jodie", "apan", "dyrep")
STRATEGIES = ("hash", "minmax")
METRICS = ("val_ap", "val_auc", "test_ap", "test_auc", "test_ap_inductive", "test_auc_inductive")


def _overrides(store: str, out: str, model: str, strategy: str, *extra: str) -> list[str]:
    # DyRep as its preset runs it (time-projected embedding).
    if model == "dyrep":
        extra = ("model.time_projection=true", *extra)
    return [
        f"data.path={store}",
        f"out={out}",
        f"model.name={model}",
        f"dist.strategy={strategy}",
        "quiet=true",
        "train.epochs=1",
        "train.max_batches=24",
        "train.batch_size=50",
        "train.dtype=float64",
        "model.dropout=0.1",
        "model.sampling=uniform",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=4",
        "model.mailbox_size=3",
        "train.lr=0.0001",
        "dist.timeout_s=60",
        "train.threads=1",
        *extra,
    ]


def _record(tr: sven.Trainer) -> None:
    """Records (parameters, whole memory) after a training batch."""
    params = torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()]).clone()
    tr.records.append((params, _full_memory(tr)))


def _full_memory(tr: sven.Trainer) -> dict[str, torch.Tensor]:
    shard = {k: v.clone() for k, v in tr.memory.state_dict().items()}
    if tr.world_size == 1:
        return shard
    parts: list = [None] * tr.world_size
    dist.all_gather_object(parts, (tr.owned, shard))
    full = {}
    for k, v in shard.items():
        full[k] = torch.zeros((tr.num_nodes, *v.shape[1:]), dtype=v.dtype)
        for owned, sh in parts:
            full[k][owned] = sh[k]
    return full


def _train(store: str, out: str, model: str, strategy: str, *extra: str) -> tuple[list, dict]:
    tr = sven.Trainer(None, _overrides(store, out, model, strategy, *extra))
    tr.add_hook("after_step", _record)
    assert tr.model.node_proj is not None, "the store's node features are not used"
    if tr.world_size > 1:
        # Each rank holds the feature rows of its own vertices only.
        assert tr.node_feat is None
        assert tr.exchange.node_feat.shape == (tr.owned.numel(), 3)
    tr.records = []
    summary = tr.fit()
    return tr.records, summary


def _rank_main(rank: int, world_size: int, store: str, out: str, cases: list) -> dict | None:
    results = {}
    for model, strategy in cases:
        records, summary = _train(store, f"{out}/{model}-{strategy}", model, strategy)
        results[(model, strategy)] = (records, summary)
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A synthetic stream with edge features and static node features (which each
    rank holds only for the vertices it owns)."""
    from sven.datasets.store import TemporalEvents, write_events
    from sven.datasets.synth import generate

    tmp = tmp_path_factory.mktemp("inv")
    generate(tmp / "synth", events=2000, nodes=80, seed=3, edge_feat_dim=2)
    ev = TemporalEvents.load(tmp / "synth")
    feat = np.random.default_rng(0).standard_normal((ev.num_nodes, 3)).astype(np.float32)
    write_events(
        tmp / "store",
        np.asarray(ev.src),
        np.asarray(ev.dst),
        np.asarray(ev.t),
        edge_feat=np.asarray(ev.edge_feat),
        node_feat=feat,
    )
    return str(tmp / "store")


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ref")
    return {(m, s): _train(store, str(out / f"{m}-{s}"), m, s) for m in MODELS for s in ("hash",)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.all((a - b).abs() <= 1e-6 * torch.clamp(b.abs(), min=1.0)))


def _check(ref: tuple[list, dict], got: tuple[list, dict], label: str, batches: int = 24) -> None:
    ref_rec, ref_sum = ref
    rec, summ = got
    assert len(rec) == len(ref_rec) == batches, label
    for i, ((p, mem), (rp, rmem)) in enumerate(zip(rec, ref_rec)):
        assert _close(p, rp), f"{label}: parameters differ after batch {i}"
        for k in rmem:
            if rmem[k].dtype == torch.bool:
                assert torch.equal(mem[k], rmem[k]), f"{label}: {k} differs after batch {i}"
            else:
                assert _close(mem[k], rmem[k]), f"{label}: memory {k} differs after batch {i}"
    for key in METRICS:
        a, b = summ[key], ref_sum[key]
        assert (a is None and b is None) or a == pytest.approx(b, rel=1e-6, abs=1e-9), (label, key)


@pytest.mark.parametrize("world_size", [2, 4])
def test_p_ranks_equal_one_process(store, reference, tmp_path, world_size: int) -> None:
    cases = (
        [(m, s) for m in MODELS for s in STRATEGIES]
        if world_size == 2
        else [("tgn", "minmax"), ("apan", "hash")]
    )
    results = run_ranks(_rank_main, world_size, store, str(tmp_path), cases, timeout=900)[0]
    for (model, strategy), got in results.items():
        _check(reference[(model, "hash")], got, f"{model}/{strategy}/P={world_size}")
        summary = json.loads(Path(tmp_path, f"{model}-{strategy}", "summary.json").read_text())
        assert summary["world_size"] == world_size
        assert summary["comm_bytes"] > 0
        assert summary["comm_bytes_naive"] > 0
    np.testing.assert_equal(len(results), len(cases))


def _capacity_main(rank: int, world_size: int, store: str, out: str) -> dict | None:
    from sven.engine.comm import comm_report

    tr = sven.Trainer(
        None,
        _overrides(store, f"{out}/exact", "tgn", "minmax", "dist.capacity_slack=1.0"),
    )
    summary = tr.fit()
    # The cost model's own replay, per batch: rank r's distinct remote reads and writes
    # of a batch, all towards the one peer on two ranks.
    report = comm_report(tr.cfg, tr.data, tr.model, tr.exchange, per_batch=True)
    replay = {
        "fetch": report.batches.remote_reads.max(0).tolist(),
        "push": report.batches.remote_writes.max(0).tolist(),
    }
    # Fetch capacities half the replay's: the run must stop, naming the capacity, before
    # any result is written.
    small = sven.Trainer(None, _overrides(store, f"{out}/small", "tgn", "minmax"))
    plan = small.step.plan_capacities

    def shrunk(epoch: int):
        from sven.pipeline.wire import Capacities

        caps = plan(epoch)
        cut = [[max(c - 8, 0) // 2 for c in row] for row in caps.fetch]
        small.exchange.set_capacities("train", Capacities(caps.events, cut, caps.push))
        return caps

    small.step.plan_capacities = shrunk
    from sven.pipeline.wire import CapacityError

    try:
        small.fit()
        error = None
    except CapacityError as exc:
        error = str(exc)
    wrote = Path(out, "small", "summary.json").exists()
    if rank != 0:
        return None
    return {"caps": summary["exchange_capacities"], "replay": replay, "error": error,
            "wrote": wrote}  # fmt: skip


def test_capacities_come_from_the_replay_and_overflow_stops_the_run(store, tmp_path) -> None:
    res = run_ranks(_capacity_main, 2, store, str(tmp_path), timeout=900)[0]
    caps, replay = res["caps"], res["replay"]
    # Epoch 0 is the replayed epoch: each off-diagonal capacity is the cost model's
    # largest per-batch count plus the 8 rows of room (slack 1.0).
    for kind in ("fetch", "push"):
        for r in range(2):
            assert caps[kind][r][r] == 0
            assert caps[kind][r][1 - r] == replay[kind][r] + 8, (kind, r, caps, replay)
    assert caps["events"] >= 25  # the share of a batch of 50 on 2 ranks
    assert res["error"] is not None and "more fetch rows than the capacity" in res["error"]
    assert "dist.capacity_slack" in res["error"]
    assert not res["wrote"]
