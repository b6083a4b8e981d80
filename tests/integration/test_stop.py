"""SIGTERM and SIGUSR1 stop training after a step, with a checkpoint; resuming is exact.

Preemption and ``scancel`` send SIGTERM, SLURM's ``--signal=USR1@N`` warns before the
time limit. ``Trainer.fit`` turns either into a flag; the ranks agree on it through the
gradient all-reduce, so they all stop after the same step, write the sharded
checkpoint there and exit with code 75. ``train.checkpoint_every`` is set far beyond
an epoch, so the only mid-epoch checkpoint is the one the signal caused.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

import sven
from sven.cli import main
from sven.engine.checkpoint import Checkpointer
from sven.errors import Stopped
from tests.integration.slurm_cluster import (  # noqa: F401 - fixtures
    free_port,
    metrics,
    reference_fixture,
    run_checked,
    start_rank,
    sven_env,
    tiny_overrides,
    tiny_store_fixture,
    torchrun_cmd,
)

# Only epoch ends checkpoint by themselves (an epoch of the tiny run has 14 batches).
NO_PERIODIC = "train.checkpoint_every=1000"
SUMMARY_KEYS = ("val_ap", "val_auc", "test_ap", "test_auc", "best_epoch", "epochs_run")


def _signal_at(at: int, signum: int):
    """A ``before_step`` hook that sends this process ``signum`` before the ``at``-th step."""
    calls = 0

    def hook(trainer: sven.Trainer) -> None:
        nonlocal calls
        calls += 1
        if calls == at:
            os.kill(os.getpid(), signum)

    return hook


@pytest.fixture(scope="module")
def uninterrupted(tiny_store, tmp_path_factory) -> dict:
    """The summary of one uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return sven.Trainer(None, tiny_overrides(tiny_store, f"out={out}", NO_PERIODIC)).fit()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_signal_stops_after_the_step_with_a_checkpoint(
    signum: int, tiny_store, uninterrupted, tmp_path
) -> None:
    before = signal.getsignal(signum)
    trainer = sven.Trainer(None, tiny_overrides(tiny_store, f"out={tmp_path}", NO_PERIODIC))
    trainer.add_hook("before_step", _signal_at(20, signum))
    with pytest.raises(Stopped) as stopped:
        trainer.fit()
    assert signal.getsignal(signum) == before, "fit() did not put the old handler back"
    err = stopped.value
    # The 20th step is batch 5 of epoch 1 (14 batches an epoch, plus one step per epoch end).
    ck = Checkpointer(tmp_path / "checkpoints")
    assert ck.steps() == [15, 21] and ck.latest() == 21
    assert ck.load(21)["cursor"] == {"epoch": 1, "next_batch": 6}
    name = signal.Signals(signum).name
    assert err.exit_code == 75 and err.signal_name == name and not err.quiet
    assert str(err) == (
        f"stopped by {name} at epoch 1 step 21 (batch 6 of 14); checkpoint {ck.path(21)}; "
        "rerun with train.resume=true"
    )
    assert not (tmp_path / "summary.json").exists()

    resumed = sven.Trainer(
        None, tiny_overrides(tiny_store, f"out={tmp_path}", NO_PERIODIC, "train.resume=true")
    ).fit()
    assert {k: resumed[k] for k in SUMMARY_KEYS} == {k: uninterrupted[k] for k in SUMMARY_KEYS}


def test_cli_says_where_it_stopped_and_exits_75(tiny_store, tmp_path, monkeypatch, capsys) -> None:
    init = sven.Trainer.__init__

    def init_with_hook(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.add_hook("before_step", _signal_at(3, signal.SIGTERM))

    monkeypatch.setattr(sven.Trainer, "__init__", init_with_hook)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        rc = main(["train", *tiny_overrides(tiny_store, f"out={tmp_path}", NO_PERIODIC)])
    finally:
        for s, handler in saved.items():  # the CLI ignores both on its way out
            signal.signal(s, handler)
    err = capsys.readouterr().err
    assert rc == 75, err
    lines = [x for x in err.splitlines() if x.startswith("sven:")]
    assert lines == [
        f"sven: stopped by SIGTERM at epoch 0 step 3 (batch 3 of 14); checkpoint "
        f"{tmp_path / 'checkpoints' / 'step-000000003'}; rerun with train.resume=true"
    ], err


def _wait_for(path: Path, procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a rank exited before {path.name} appeared")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path} after {timeout:g} s")
        time.sleep(0.02)


@pytest.mark.dist
def test_two_ranks_signalled_apart_stop_together_and_resume_exactly(
    tiny_store, reference, tmp_path
) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_store, f"out={out}", NO_PERIODIC, "dist.timeout_s=60")
    port = free_port()
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    procs = [start_rank(r, 2, port, ["train", *overrides], logs[r]) for r in (0, 1)]
    try:
        # Rank 0 rewrites metrics.jsonl after the start barrier, which both ranks pass
        # inside fit(): both have their handlers by then.
        _wait_for(out / "metrics.jsonl", procs, timeout=180)
        # As scancel does, but not at the same instant: rank 1 first.
        procs[1].send_signal(signal.SIGTERM)
        time.sleep(0.2)
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)
        rcs = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [log.read_text(errors="replace") for log in logs]
    assert rcs == [75, 75], outputs
    assert all("Traceback" not in o for o in outputs), outputs
    # Rank 0 speaks for both; rank 1 says nothing.
    said = [x for x in outputs[0].splitlines() if x.startswith("sven:")]
    assert len(said) == 1 and said[0].startswith("sven: stopped by SIGTERM at epoch "), outputs[0]
    assert "stopped by" not in outputs[1], outputs[1]

    # Both shards at one step (the checkpoint would not commit otherwise), mid-epoch:
    # newer than any epoch-end checkpoint.
    ck = Checkpointer(out / "checkpoints")
    step = ck.latest()
    assert step is not None and ck.verify(step)
    shards = {f"rank{r}.pt" for r in (0, 1)} | {f"nodes/rank{r}/memory.npy" for r in (0, 1)}
    assert set(ck.meta(step)["files"]) >= shards
    cursor = torch.load(ck.path(step) / "state.pt", weights_only=False)["cursor"]
    assert cursor["next_batch"] > 0, cursor
    assert f"checkpoint {ck.path(step)};" in said[0]
    assert not (out / "summary.json").exists()

    cmd = [*torchrun_cmd(), "train", *overrides, "train.resume=true", "quiet=false"]
    done = run_checked(cmd, env=sven_env())
    assert f"resumed from {ck.path(step)}" in done.stderr, done.stderr
    assert metrics(out) == reference.metrics


def test_a_resumed_run_estimates_after_its_first_whole_epoch(
    tiny_store, tmp_path, monkeypatch
) -> None:
    """Stopped in epoch 0, the resumed process measures epoch 1, the first it runs whole."""
    import sven.tasks.link as link

    asked: list[int] = []
    monkeypatch.setattr(link, "epoch_estimate", lambda epoch, *a: asked.append(epoch))
    trainer = sven.Trainer(None, tiny_overrides(tiny_store, f"out={tmp_path}", NO_PERIODIC))
    trainer.add_hook("before_step", _signal_at(3, signal.SIGTERM))
    with pytest.raises(Stopped):
        trainer.fit()
    assert asked == []  # stopped before its first epoch ended
    sven.Trainer(
        None, tiny_overrides(tiny_store, f"out={tmp_path}", NO_PERIODIC, "train.resume=true")
    ).fit()
    assert asked == [1]
    # A run from the start measures its epoch 0.
    asked.clear()
    sven.Trainer(None, tiny_overrides(tiny_store, f"out={tmp_path / 'fresh'}")).fit()
    assert asked == [0]
