"""The timeline in metrics.jsonl and the Chrome trace of ``profile=true``, one process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import sven
from sven.datasets.store import write_events

# One process on CPU: the eager step laps every stage it has (no exchange, no
# all-reduce; "step" is the one stage of a captured CUDA graph).
ONE_PROCESS = {"wait", "sample", "row_fetch", "compute", "optimizer", "write_back"}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    rng = np.random.default_rng(1)
    e = 1200
    src, dst = rng.integers(0, 40, e), rng.integers(0, 40, e)
    t = np.sort(rng.integers(0, 50_000, e))
    out = tmp_path_factory.mktemp("store") / "tl"
    write_events(out, src, dst, t, name="tl")
    return str(out)


def check_timeline(out: Path, stages: set[str], ranks: int) -> list[dict]:
    """Asserts the timeline keys of every epoch line; returns the lines."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines
    for line in lines:
        got = {k[len("stage_") : -len("_s_per_rank")] for k in line if k.startswith("stage_")}
        assert got == stages
        per = np.array([line[f"stage_{s}_s_per_rank"] for s in sorted(stages)])
        assert per.shape == (len(stages), ranks)
        assert (per >= 0).all()
        total = np.asarray(line["timeline_stages_s_per_rank"])
        epoch = np.asarray(line["timeline_epoch_s_per_rank"])
        assert total.shape == epoch.shape == (ranks,)
        np.testing.assert_allclose(per.sum(0), total, atol=1e-5)
        # The stages cover the epoch's training loop, nothing outside it.
        assert (total <= epoch + 1e-5).all()
        assert (total > 0).all()
    return lines


def test_one_process_timeline_and_trace(store: str, tmp_path: Path) -> None:
    over = [
        f"data.path={store}",
        f"out={tmp_path}",
        "train.device=cpu",
        "quiet=true",
        "train.epochs=2",
        "train.batch_size=100",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=3",
        "profile=true",
        "log.profile_start=2",
        "log.profile_steps=3",
    ]
    tr = sven.Trainer(None, over)
    tr.fit()
    lines = check_timeline(tmp_path, ONE_PROCESS, 1)
    # The epoch time is the one events_per_s is measured over.
    lo, hi = tr.ranges["train"]
    events = hi - lo
    for line in lines:
        assert line["timeline_epoch_s_per_rank"][0] == pytest.approx(
            events / line["events_per_s"], rel=1e-4
        )
    trace = json.loads((tmp_path / "traces" / "rank0.json").read_text())
    names = {ev.get("name", "") for ev in trace["traceEvents"]}
    # Steps 2, 3 and 4 of the first epoch, each a named range.
    assert {n for n in names if n.startswith("sven_step#")} == {f"sven_step#{i}" for i in (2, 3, 4)}
    assert any(n.startswith("aten::") for n in names)
