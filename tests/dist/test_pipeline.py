"""The pipeline (prefetch D, micro-batches m, asynchronous write-back) changes no result
at staleness 0: parameters and memory equal the one-process run after every batch, in
float64, for every D in {0, 1, 3} and m in {1, 2, 4}; its thread stops cleanly on an
exception in a stage and on SIGTERM (the stop checkpoint still exact); staleness 1 runs
and does change the results.

Each launch trains several cases in the same rank processes (a launch costs seconds).
"""

from __future__ import annotations

import signal
import threading

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
PAIRS = [(d, m) for d in (0, 1, 3) for m in (1, 2, 4)]


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
        # The epoch's prefetch thread is gone once fit returns.
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


def test_four_ranks_subset(store, reference, tmp_path) -> None:
    cases = [("tgn", "hash", 3, 4, 0), ("apan", "minmax", 1, 2, 0), ("dyrep", "hash", 0, 4, 0)]
    results = run_ranks(_cases_main, 4, store, str(tmp_path), cases, timeout=900)[0]
    for case, got in results.items():
        _check(reference[case[0]], got, "/".join(map(str, case)), BATCHES)


def test_one_process_ignores_the_pipeline(store, reference, tmp_path) -> None:
    # One process runs its own step; the knobs must not change it.
    got = _train(store, str(tmp_path / "one"), "apan", "hash", *_knobs(3, 4))
    _check(reference["apan"], got, "apan/P=1", BATCHES)


def test_micro_batches_auto_profiles_and_stays_exact(store, reference, tmp_path) -> None:
    cases = [("jodie", "minmax", 2, "auto", 0)]
    (got,) = run_ranks(_cases_main, 2, store, str(tmp_path), cases, timeout=900)[0].values()
    _check(reference["jodie"], got, "jodie/auto", BATCHES)
    summary = got[1]
    assert summary["pipeline_micro_batches"] in (1, 2, 4)
    assert set(summary["pipeline_micro_batches_profile_s"]) == {"1", "2", "4"}
    profile = summary["pipeline_micro_batches_profile_s"]
    assert min(profile, key=profile.get) == str(summary["pipeline_micro_batches"])


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
    tr = sven.Trainer(None, _overrides_for(store, out, 3))
    prepare = tr.rank_step.prepare

    def broken(desc: tuple) -> object:
        if desc[1] == 5:
            raise _StageError(f"stage failed at batch {desc[1]}")
        return prepare(desc)

    tr.rank_step.prepare = broken
    steps = []
    tr.add_hook("after_step", lambda t: steps.append(1))
    msg = _fit_raising(tr, _StageError)
    assert len(steps) == 5, steps
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


def test_exception_in_a_stage_reaches_the_consumer(store, tmp_path) -> None:
    msgs = run_ranks(_failing_stage_main, 2, store, str(tmp_path), timeout=300)
    assert msgs == ["stage failed at batch 5"] * 2


def _params(tr: sven.Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()])


def _sigterm_main(rank: int, world_size: int, store: str, out: str) -> dict | None:
    before = _threads()
    ref = sven.Trainer(None, _overrides_for(store, f"{out}/ref", 3))
    ref_summary = ref.fit()
    stopping = sven.Trainer(None, _overrides_for(store, f"{out}/run", 3))
    stopping.add_hook("before_step", _signal_at(7, signal.SIGTERM))
    where = _fit_raising(stopping, Stopped)
    assert _threads() == before, threading.enumerate()
    resumed = sven.Trainer(None, _overrides_for(store, f"{out}/run", 3, "train.resume=true"))
    res_summary = resumed.fit()
    assert torch.equal(_params(resumed), _params(ref))
    return {"where": where, "ref": ref_summary, "resumed": res_summary} if rank == 0 else None


def test_sigterm_stops_the_thread_and_the_checkpoint_is_exact(store, tmp_path) -> None:
    res = run_ranks(_sigterm_main, 2, store, str(tmp_path), timeout=600)[0]
    assert "stopped by SIGTERM at epoch 0 step 7" in res["where"]
    for key in ("val_ap", "val_auc", "test_ap", "test_auc", "comm_bytes"):
        assert res["resumed"][key] == res["ref"][key], key
