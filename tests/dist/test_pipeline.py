"""The pipeline of the one step (prefetch D, micro-batches m, asynchronous write-back)
changes no result at staleness 0: parameters and memory equal the one-process run after
every batch, in float64, for every D in {0, 2} and m in {1, 2} on 2 and 4 ranks; an
exception in the prefetched build reaches the caller; SIGTERM stops at a step and the
stop checkpoint resumes exactly; staleness 1 runs and does change the results.

Each launch trains several cases in the same rank processes (a launch costs seconds).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest
import torch

import sven
from sven.errors import Stopped
from tests.dist.launch import run_ranks
from tests.dist.test_invariant import MODELS, _check, _train
from tests.dist.test_invariant import store as store  # the fixture
from tests.integration.test_stop import _signal_at

pytestmark = pytest.mark.dist

BATCHES = 12
PAIRS = [(d, m) for d in (0, 2) for m in (1, 2)]


def _threads() -> int:
    """Live threads, without tqdm's monitor (tqdm starts it with the first bar, for good)."""
    return sum(t.name != "tqdm_monitor" for t in threading.enumerate())


def _knobs(d: int, m: int | str, staleness: int = 0) -> tuple[str, ...]:
    return (
        f"train.max_batches={BATCHES}",
        f"pipeline.prefetch={d}",
        f"pipeline.micro_batches={m}",
        f"pipeline.staleness={staleness}",
    )


def _cases_main(rank: int, world_size: int, store: str, out: str, cases: list) -> dict | None:
    results = {}
    before = _threads()
    for model, strategy, d, m, s in cases:
        label = f"{model}-{strategy}-D{d}-m{m}-s{s}"
        records, summary = _train(store, f"{out}/{label}", model, strategy, *_knobs(d, m, s))
        # The step starts no thread.
        assert _threads() == before, threading.enumerate()
        results[(model, strategy, d, m, s)] = (records, summary)
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ref")
    return {m: _train(store, str(out / m), m, "hash", *_knobs(0, 1)) for m in MODELS}


@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_every_depth_and_micro_batches(store, reference, tmp_path, model) -> None:
    cases = [(model, "minmax", d, m, 0) for d, m in PAIRS]
    results = run_ranks(_cases_main, 2, store, str(tmp_path), cases, timeout=900)[0]
    for case, got in results.items():
        _check(reference[model], got, "/".join(map(str, case)), BATCHES)
        assert got[1]["pipeline_micro_batches"] == case[3]
        assert got[1]["pipeline_prefetch"] == case[2]


def test_four_ranks_subset(store, reference, tmp_path) -> None:
    cases = [("tgn", "hash", 2, 2, 0), ("apan", "minmax", 2, 1, 0), ("dyrep", "hash", 0, 2, 0)]
    results = run_ranks(_cases_main, 4, store, str(tmp_path), cases, timeout=900)[0]
    for case, got in results.items():
        _check(reference[case[0]], got, "/".join(map(str, case)), BATCHES)


def test_one_process_exact_step_ignores_the_pipeline(store, reference, tmp_path) -> None:
    # One CPU process without a process group runs the exact-size eager step, which has
    # nothing to overlap; the knobs must not change it.
    got = _train(store, str(tmp_path / "one"), "apan", "hash", *_knobs(2, 2))
    _check(reference["apan"], got, "apan/P=1", BATCHES)
    assert got[1]["pipeline_prefetch"] == 0 and got[1]["pipeline_micro_batches"] == 1


def test_one_rank_under_a_launcher_runs_the_p_rank_step(store, reference, tmp_path) -> None:
    # A process group of one: the fixed-capacity step with its collectives, prefetch and
    # micro-batches, as on many ranks; the same result as the plain process.
    cases = [("jodie", "minmax", 2, 2, 0)]
    (got,) = run_ranks(_cases_main, 1, store, str(tmp_path), cases, timeout=900)[0].values()
    _check(reference["jodie"], got, "jodie/P=1 launched", BATCHES)
    assert got[1]["pipeline_prefetch"] == 2 and got[1]["pipeline_micro_batches"] == 2
    assert got[1]["exchange_capacities"]["fetch"] == [[0]]


def test_staleness_one_changes_results(store, reference, tmp_path) -> None:
    cases = [("tgn", "minmax", 2, 2, 1)]
    (got,) = run_ranks(_cases_main, 2, store, str(tmp_path), cases, timeout=900)[0].values()
    rec, ref_rec = got[0], reference["tgn"][0]
    assert len(rec) == BATCHES
    # Batch 0 reads the initial memory either way, so its update is the same; later
    # batches read the memory one batch late.
    assert torch.allclose(rec[0][0], ref_rec[0][0], rtol=1e-6, atol=0)
    assert not torch.allclose(rec[-1][0], ref_rec[-1][0], rtol=1e-6, atol=0)
    assert not torch.allclose(rec[-1][1]["memory"], ref_rec[-1][1]["memory"], rtol=1e-6)
    assert all(torch.isfinite(p).all() for p, _ in rec)


# --------------------------------------------------------------- clean stops
class _StageError(RuntimeError):
    pass


def _failing_stage_main(rank: int, world_size: int, store: str, out: str) -> str:
    before = _threads()
    tr = sven.Trainer(None, _overrides_for(store, out, 2))
    build = tr.step.source.build
    calls = []

    def broken(inp: Any, *args: object, **kwargs: object) -> object:
        # The ring's first D + 1 builds (batches 0-2) run when the epoch starts; step i
        # builds batch i + 2, so batch 5 is built in step 3.
        calls.append(int(inp["gstart"]))
        if len(calls) == 3 + 4:
            raise _StageError(f"build failed at event {calls[-1]}")
        return build(inp, *args, **kwargs)

    tr.step.source.build = broken
    steps = []
    tr.add_hook("after_step", lambda t: steps.append(1))
    msg = _fit_raising(tr, _StageError)
    assert len(steps) == 3, steps
    assert calls[-1] == 5 * 50, calls
    assert _threads() == before, threading.enumerate()
    return msg


def _fit_raising(tr: sven.Trainer, exc_type: type[BaseException]) -> str:
    """Runs ``fit``, which must raise ``exc_type``; returns the message."""
    with pytest.raises(exc_type) as info:
        tr.fit()
    return str(info.value)


def _overrides_for(store: str, out: str, d: int, *extra: str) -> list[str]:
    from tests.dist.test_invariant import _overrides

    return _overrides(
        store, out, "tgn", "minmax", "train.epochs=2", "train.checkpoint_every=1000", *_knobs(d, 2),
        *extra,
    )  # fmt: skip


def test_exception_in_a_prefetched_build_reaches_the_caller(store, tmp_path) -> None:
    msgs = run_ranks(_failing_stage_main, 2, store, str(tmp_path), timeout=300)
    assert msgs == ["build failed at event 250"] * 2


def _params(tr: sven.Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()])


def _sigterm_main(rank: int, world_size: int, store: str, out: str) -> dict | None:
    before = _threads()
    ref = sven.Trainer(None, _overrides_for(store, f"{out}/ref", 2))
    ref_summary = ref.fit()
    stopping = sven.Trainer(None, _overrides_for(store, f"{out}/run", 2))
    stopping.add_hook("before_step", _signal_at(7, signal.SIGTERM))
    where = _fit_raising(stopping, Stopped)
    assert _threads() == before, threading.enumerate()
    resumed = sven.Trainer(None, _overrides_for(store, f"{out}/run", 2, "train.resume=true"))
    res_summary = resumed.fit()
    assert torch.equal(_params(resumed), _params(ref))
    return {"where": where, "ref": ref_summary, "resumed": res_summary} if rank == 0 else None


def test_sigterm_stops_at_a_step_and_the_checkpoint_is_exact(store, tmp_path) -> None:
    res = run_ranks(_sigterm_main, 2, store, str(tmp_path), timeout=600)[0]
    assert "stopped by SIGTERM at epoch 0 step 7" in res["where"]
    for key in ("val_ap", "val_auc", "test_ap", "test_auc", "comm_bytes"):
        assert res["resumed"][key] == res["ref"][key], key
