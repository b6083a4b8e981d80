"""The P-rank step captured on a real NCCL process group of one: its collectives inside
the CUDA graph, and the same parameters and memory as the eager step after 30 batches."""

from __future__ import annotations

import pytest
import torch

from tests.dist.launch import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.dist]

BATCHES = 30


def _overrides(store: str, out: str, graph: str, *extra: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        "model.name=tgn",
        "quiet=true",
        "train.epochs=1",
        f"train.max_batches={BATCHES}",
        "train.batch_size=100",
        "train.device=cuda",
        f"train.cuda_graph={graph}",
        "dist.timeout_s=120",
        *extra,
    ]


def _run(store: str, out: str, graph: str, *extra: str) -> tuple[list, dict, bool]:
    import sven

    tr = sven.Trainer(None, _overrides(store, out, graph, *extra))
    records: list = []

    def record(t: sven.Trainer) -> None:
        params = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
        records.append((params.cpu(), t.memory.memory.detach().cpu().clone()))

    tr.add_hook("after_step", record)
    summary = tr.fit()
    return records, summary, bool(tr.distributed)


def _main(rank: int, world_size: int, store: str, out: str) -> dict:
    res = {}
    for graph in ("off", "on"):
        for d in (0, 1):
            rec, summary, launched = _run(
                store, f"{out}/{graph}-{d}", graph, f"pipeline.prefetch={d}"
            )
            res[(graph, d)] = (rec, summary, launched)
    return res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_rank_step_of_one_equals_the_eager_one(tmp_path) -> None:
    from sven.datasets.synth import generate

    generate(tmp_path / "store", events=20_000, nodes=500, seed=1)
    res = run_ranks(_main, 1, str(tmp_path / "store"), str(tmp_path), timeout=600, backend=None)[0]
    ref, ref_summary, launched = res[("off", 0)]
    assert launched, "the launched rank ran without a process group"
    assert ref_summary["step_captured"] is False
    for key, (rec, summary, _) in res.items():
        assert summary["world_size"] == 1
        assert summary["step_captured"] is (key[0] == "on"), key
        assert len(rec) == len(ref) == BATCHES
        for i, ((p, m), (rp, rm)) in enumerate(zip(rec, ref)):
            # Same kernels in the same order: equal up to float32 rounding of
            # reductions whose order a graph may change (atomics in scatters).
            assert torch.allclose(p, rp, rtol=1e-5, atol=1e-6), (key, i)
            assert torch.allclose(m, rm, rtol=1e-5, atol=1e-5), (key, i)
        assert summary["test_ap"] == pytest.approx(ref_summary["test_ap"], abs=1e-4), key
