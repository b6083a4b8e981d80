"""Compiling ahead (sven.kernels.ahead): a dry run of the step runs none of Sven's
kernels, yet completes and leaves the state as it found it.

On CPU the kernels run under Triton's interpreter (``SVEN_KERNELS=triton``, so every
function with a Triton kernel, opt-in ones included, is dry-run). During each
dry run new memory is filled with NaN and out-of-range integers: a function whose
Triton outputs index tensors and that did not return its reference in a dry run
stops the fit with an IndexError. On CUDA (``gpu``) a fit on an empty Triton cache
compiles its kernels ahead and ends with the same metrics as one that does not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sven.kernels import ahead
from tests.integration.test_safety import store as store  # the fixture

ROOT = Path(__file__).resolve().parents[2]

_REHEARSED_FIT = r"""
import json, sys, tempfile
from pathlib import Path

import torch
from triton.runtime.interpreter import InterpretedFunction

import sven
import sven.engine.spec as spec_module
from sven.engine import capture
from sven.kernels import ahead

# The fixed-shape step that CUDA captures, on the CPU.
spec_module.fixed_shapes = lambda device, distributed: True
BAD = {torch.int64: 2**62, torch.int32: 2**30, torch.int16: 2**14, torch.int8: 100,
       torch.uint8: 200, torch.bool: True}
counts = {"lookups": 0, "launches": 0, "dry_runs": 0, "state_kept": 0}
run = InterpretedFunction.run


def counted(self, *a, grid, warmup, **kw):
    if ahead.dry_running():
        counts["lookups" if warmup else "launches"] += 1
    return run(self, *a, grid=grid, warmup=warmup, **kw)


InterpretedFunction.run = counted
allocs = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}


def poisoned(alloc):
    def make(*a, **kw):
        t = alloc(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(BAD.get(t.dtype, 0))
    return make


call = capture.StepGraph.__call__


def dry_run_first(self):
    if not getattr(self, "_dry_run", False):
        self._dry_run = True
        before = [t.clone() for t in self.state()]
        with capture.undone(self.state, self.optimizer):
            for name, alloc in allocs.items():
                setattr(torch, name, poisoned(alloc))
            try:
                ahead.compile_ahead(self.fn)
            finally:
                for name, alloc in allocs.items():
                    setattr(torch, name, alloc)
        counts["dry_runs"] += 1
        counts["state_kept"] += all(
            torch.equal(a, b) for a, b in zip(before, self.state(), strict=True)
        )
    return call(self)


capture.StepGraph.__call__ = dry_run_first
with tempfile.TemporaryDirectory() as out:
    sven.Trainer(None, [f"out={out}", "quiet=true", *sys.argv[1:]]).fit()
    summary = json.loads((Path(out) / "summary.json").read_text())
print(json.dumps({**counts, "test_mrr": summary.get("test_mrr")}))
"""


def test_compiling_ahead_can_be_turned_off_and_is_off_outside_a_dry_run(monkeypatch) -> None:
    assert not ahead.dry_running()
    monkeypatch.setenv("SVEN_COMPILE_AHEAD", "0")
    assert not ahead.available()
    calls = []
    report = ahead.compile_ahead(lambda: calls.append(1))
    # Off: the step is not even dry-run.
    assert calls == [] and report.variants == 0


class _Kernel:
    """Stands for a JITFunction of Sven's (its module decides) with ``preload``."""

    def __init__(self, module: str, fail: bool = False) -> None:
        self.fn = type("fn", (), {"__module__": module, "__name__": "_k"})
        self.fail, self.loaded = fail, []

    def preload(self, data: str) -> None:
        if self.fail:
            raise ValueError("no such variant")
        self.loaded.append(data)


def _ask(kernel: _Kernel, data: str) -> bool | None:
    import triton

    hook = triton.knobs.runtime.jit_cache_hook
    info = type("info", (), {"jit_function": kernel})
    compile_info = {"specialization_data": data, "device": 0}
    return hook(key=data, repr="", fn=info, compile=compile_info, is_manual_warmup=True,
                already_compiled=False)  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_hook_records_sven_variants_and_the_pool_loads_each_once(monkeypatch) -> None:
    """The compile hook of a dry run skips and records Sven's variants (once each,
    however often asked), hands other kernels to the hook that was there before, and
    the pool preloads every recorded variant; a failed one is reported, not raised."""
    import triton

    asked = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kw: asked.append(kw))
    ours, broken, theirs = _Kernel("sven.kernels.x"), _Kernel("pipeline.y", True), _Kernel("lib")

    def step() -> None:
        assert _ask(ours, "a") is True and _ask(ours, "a") is True and _ask(ours, "b")
        assert _ask(broken, "c") is True
        assert _ask(theirs, "d") is None

    report = ahead.compile_ahead(step)
    assert sorted(ours.loaded) == ["a", "b"] and theirs.loaded == []
    assert report.variants == 3 and report.threads >= 1
    assert len(report.failed) == 1 and "no such variant" in report.failed[0]
    # The earlier hook saw the foreign kernel only, and is back in place.
    assert [kw["key"] for kw in asked] == ["d"]
    assert triton.knobs.runtime.jit_cache_hook is not None and not ahead.dry_running()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_a_dry_run_on_the_cpu_compiles_nothing_and_nests_never() -> None:
    """Under the interpreter there is nothing to compile: the step runs once as a
    dry run, nothing is recorded; a dry run inside another is an error."""
    seen = []

    def step() -> None:
        seen.append(ahead.dry_running())
        with pytest.raises(RuntimeError, match="already running"), ahead.dry_run():
            pass

    report = ahead.compile_ahead(step)
    assert seen == [True] and report.variants == 0 and not ahead.dry_running()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_a_dry_run_runs_no_kernel_and_keeps_the_state(store) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "SVEN_KERNELS": "triton", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _REHEARSED_FIT, f"data.path={store}", "model.name=tgn",
         "train.epochs=1", "train.batch_size=100", "model.num_neighbors=3", "model.memory_dim=16",
         "model.time_dim=16", "model.embed_dim=16",
         "train.cuda_graph=off", "eval.mrr_negatives=3", "eval.all_protocols=false"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    # Training's graph and each evaluation width's, each dry-run once.
    assert counts["dry_runs"] >= 2
    assert counts["state_kept"] == counts["dry_runs"]
    assert counts["lookups"] > 0 and counts["launches"] == 0
    assert counts["test_mrr"] is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_empty_cache_fit_compiles_ahead_and_ends_as_without(store, tmp_path: Path) -> None:
    """Two fits on empty Triton caches, with and without compiling ahead: the first
    compiles training's variants ahead, both compile the same variants, and both end
    with equal metrics. (Evaluation's graph here needs no variant training has not
    loaded: its dry run may find none missing, so its count is not asserted.)"""
    summaries = {}
    for flag in ("1", "0"):
        out = tmp_path / f"run-{flag}"
        env = {**os.environ, "SVEN_COMPILE_AHEAD": flag,
               "TRITON_CACHE_DIR": str(tmp_path / f"triton-{flag}")}  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "sven", "train", f"data.path={store}", f"out={out}",
             "train.epochs=2", "train.batch_size=50", "train.cuda_graph=on",
             "eval.mrr_negatives=3", "--quiet"],
            capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        summaries[flag] = json.loads((out / "summary.json").read_text())
    on, off = summaries["1"], summaries["0"]
    assert on["train_ahead_variants"] > 0
    assert off["train_ahead_variants"] == 0 and off["eval_ahead_variants"] == 0
    assert _variants(tmp_path / "triton-1") == _variants(tmp_path / "triton-0")
    for key in ("val_ap", "test_ap", "test_mrr"):
        assert on[key] == off[key], key


def _variants(cache: Path) -> list[str]:
    """The variants compiled into a Triton cache folder (``benchmarks/bench_ttr.py``'s
    count, by hash)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_ttr", ROOT / "benchmarks" / "bench_ttr.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod.compiled_variants(cache)
