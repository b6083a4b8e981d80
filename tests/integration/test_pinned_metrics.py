"""Today's exact metrics of a short CPU run on CollegeMsg, every model, pinned.

A refactoring of the engine (the step, its parts, the run loop, the checkpointer, the
node-state tiers) must leave every number of a run as it was, to the last digit. These
runs (one epoch of 30 batches of 200 events, then validation and test on the whole
splits, one thread) pin the loss and the metrics of each model on one process and on
two gloo ranks; ``pinned_metrics.json`` holds the values the engine gave before the
refactoring. Float32, as users run it, in one portable arithmetic: each run is a fresh process with
torch's AVX2 kernels and MKL's reproducible SSE2 path (:data:`PORTABLE`), which every
x86-64 machine computes alike; left to themselves they pick the widest the CPU has
(AVX-512 or AVX2, Intel's or AMD's code path) and the last digits move with the
machine CI happens to get. Regenerate the file with ``SVEN_REPIN=1`` only for a change
meant to alter results, and say so in its commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sven
from tests.dist.launch import run_ranks

MODELS = ("tgn", "jodie", "apan", "dyrep")
KEYS = ("train_loss", "val_ap", "val_auc", "test_ap", "test_auc", "test_ap_inductive")
PIN = Path(__file__).with_name("pinned_metrics.json")
ROOT = Path(__file__).resolve().parents[2]
#: The arithmetic of the pins: read by torch and MKL when they load, so every run is a
#: new process (two ranks inherit it from the test's environment).
PORTABLE = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}
_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def uci(shared_data, tmp_path_factory) -> str:
    from sven.datasets.readers import convert

    out = tmp_path_factory.mktemp("pin") / "collegemsg"
    convert(shared_data / "collegemsg" / "CollegeMsg.txt.gz", out)
    return str(out)


def _overrides(store: str, out: str, model: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        f"model.name={model}",
        "quiet=true",
        "train.epochs=1",
        "train.max_batches=30",
        "train.batch_size=200",
        "train.threads=1",
        "dist.timeout_s=120",
    ]


def _metrics(out: str, summary: dict) -> dict:
    line = json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[0])
    got = {k: summary[k] for k in KEYS if k in summary}
    got["train_loss"] = line["train_loss"]
    return got


def _rank_run(rank: int, world_size: int, store: str, out: str, model: str) -> dict:
    summary = sven.Trainer(None, _overrides(store, out, model)).fit()
    return _metrics(out, summary)


def _check(key: str, got: dict) -> None:
    if os.environ.get("SVEN_REPIN"):
        pins = json.loads(PIN.read_text()) if PIN.exists() else {}
        pins[key] = got
        PIN.write_text(json.dumps(pins, indent=2, sort_keys=True) + "\n")
        return
    want = json.loads(PIN.read_text())[key]
    # Exact: a float's repr round-trips through JSON.
    assert got == want, f"{key}: {got} != pinned {want}"


def _one_process(store: str, out: str, model: str) -> dict:
    code = (
        "import json, sys, sven\n"
        "from tests.integration.test_pinned_metrics import _metrics, _overrides\n"
        "s = sven.Trainer(None, _overrides(*sys.argv[1:4])).fit()\n"
        "print(json.dumps(_metrics(sys.argv[2], s)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER} | PORTABLE
    run = subprocess.run(
        [sys.executable, "-c", code, store, out, model],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", MODELS)
def test_one_process_metrics_are_pinned(uci: str, tmp_path: Path, model: str) -> None:
    _check(f"{model}/1", _one_process(uci, str(tmp_path / "run"), model))


@pytest.mark.dist
@pytest.mark.parametrize("model", MODELS)
def test_two_rank_metrics_are_pinned(
    uci: str, tmp_path: Path, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in PORTABLE.items():
        monkeypatch.setenv(key, value)
    out = str(tmp_path / "run")
    got = run_ranks(_rank_run, 2, uci, out, model, timeout=600)
    assert got[0] == got[1]
    _check(f"{model}/2", got[0])
