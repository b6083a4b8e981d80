"""A rank that dies or hangs mid-run: the survivor stops in time, nothing is lost.

Two ``sven train`` processes are started with the env:// variables (no launcher
agent, which would kill the survivor itself and hide how Sven behaves). Once the
first checkpoint is on disk, rank 1 is killed (SIGKILL) or frozen (SIGSTOP, a hang).
Rank 0 must exit non-zero within the collective timeout (``dist.timeout_s``); the
newest checkpoint must verify; a resumed run must end with the metrics of an
uninterrupted one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from sven.checkpoint import Checkpointer
from tests.integration.slurm_cluster import (  # noqa: F401 - fixtures
    VENV_BIN,
    free_port,
    metrics,
    reference_fixture,
    run_checked,
    sven_env,
    tiny_overrides,
    tiny_store_fixture,
    torchrun_cmd,
)

pytestmark = pytest.mark.dist

TIMEOUT_S = 20
# Beyond the timeout: the survivor's teardown and exit on a loaded 2-core machine.
EXIT_SLACK_S = 20


@dataclass
class Fault:
    """What happened to a 2-rank run whose rank 1 was killed or frozen."""

    out: Path
    how: str
    survivor_rc: int
    survivor_s: float
    survivor_stderr: str


def _start_rank(rank: int, port: int, overrides: list[str], log: Path) -> subprocess.Popen:
    env = sven_env()
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    with open(log, "w") as f:
        return subprocess.Popen(
            [str(VENV_BIN / "sven"), "train", *overrides],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )


def _wait_for_checkpoint(out: Path, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list((out / "checkpoints").glob("step-*")):
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a rank exited before the first checkpoint")
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint under {out} after {timeout:g} s")


def _fault(store: Path, out: Path, how: str) -> Fault:
    overrides = tiny_overrides(store, f"out={out}", f"dist.timeout_s={TIMEOUT_S}")
    port = free_port()
    logs = [out.parent / f"{out.name}-rank{r}.log" for r in (0, 1)]
    procs = [_start_rank(r, port, overrides, logs[r]) for r in (0, 1)]
    try:
        _wait_for_checkpoint(out, procs, timeout=180)
        os.kill(procs[1].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            rc = procs[0].wait(timeout=TIMEOUT_S + 120)
        except subprocess.TimeoutExpired:
            rc = None
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a stopped process
                p.wait()
    stderr = logs[0].read_text(errors="replace")
    assert rc is not None, f"rank 0 still running {elapsed:.0f} s after rank 1 {how}:\n{stderr}"
    assert not (out / "summary.json").exists(), "the run ended before rank 1 was stopped"
    return Fault(out, how, rc, elapsed, stderr)


@pytest.fixture(scope="module")
def killed(tiny_store, tmp_path_factory) -> Fault:
    """A run whose rank 1 was SIGKILLed after the first checkpoint."""
    return _fault(tiny_store, tmp_path_factory.mktemp("fault-kill") / "run", "kill")


@pytest.fixture(scope="module")
def hung(tiny_store, tmp_path_factory) -> Fault:
    """A run whose rank 1 was frozen (SIGSTOP) after the first checkpoint."""
    return _fault(tiny_store, tmp_path_factory.mktemp("fault-hang") / "run", "hang")


@pytest.fixture(params=["killed", "hung"])
def fault(request) -> Fault:
    return request.getfixturevalue(request.param)


def test_survivor_exits_non_zero_within_the_timeout(fault: Fault) -> None:
    assert fault.survivor_rc != 0, fault.survivor_stderr
    assert fault.survivor_s < TIMEOUT_S + EXIT_SLACK_S, (
        f"rank 0 took {fault.survivor_s:.1f} s after rank 1's {fault.how} "
        f"(dist.timeout_s={TIMEOUT_S}):\n{fault.survivor_stderr}"
    )


def test_survivor_names_the_missing_rank(fault: Fault) -> None:
    err = fault.survivor_stderr
    assert re.search(r"\brank 1\b", err) and "Traceback" not in err, err


def test_latest_checkpoint_verifies(fault: Fault) -> None:
    ck = Checkpointer(fault.out / "checkpoints")
    with warnings.catch_warnings():
        # A corrupt newest checkpoint would warn here and fall back to an older one.
        warnings.simplefilter("error")
        step = ck.latest()
    assert step is not None and ck.verify(step)


def test_resumed_run_ends_with_uninterrupted_metrics(killed: Fault, tiny_store, reference) -> None:
    cmd = [*torchrun_cmd(), "train"]
    cmd += tiny_overrides(tiny_store, f"out={killed.out}", "train.resume=true", "quiet=false")
    done = run_checked(cmd, env=sven_env())
    assert "resumed from" in done.stderr, done.stderr
    assert metrics(killed.out) == reference.metrics
