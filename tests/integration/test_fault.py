"""A rank that dies or hangs mid-run: the survivors stop in time, name it, lose nothing.

``sven train`` processes are started with the env:// variables (no launcher agent,
which would kill the survivors itself and hide how Sven behaves). Once the first
checkpoint is on disk, one rank is killed (SIGKILL) or frozen (SIGSTOP, a hang): rank
1 of 2, rank 0 of 2 (which hosts the rendezvous store: the store is lost too), or rank
2 of 4 (which neither hosts the store nor is anyone's only peer). Every survivor must
exit non-zero within the collective timeout (``dist.timeout_s``) plus the few seconds
its diagnosis takes, and name that rank and no other as the one missing, in one
``sven:`` line without torch's C++ frame dumps; the newest checkpoint must verify; a
resumed run must end with the metrics of an uninterrupted one. A rank that cannot
join the rendezvous says so in one line too.
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

from sven.engine.checkpoint import Checkpointer
from tests.integration.slurm_cluster import (  # noqa: F401 - fixtures
    CPP_DUMP,
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

pytestmark = pytest.mark.dist

TIMEOUT_S = 20
# Beyond the timeout: the survivors' diagnosis (about 6 s: a few heartbeat intervals),
# teardown and exit on a loaded 2-core machine.
EXIT_SLACK_S = 20
# "rank 2 died or hung (...)", "rank 2 did not answer within 20 s", "rank 2 hung
# (alive, ...)", "rank 2 left the job": the clauses that name a missing rank (with
# "(node N)" after the rank where the job spans several nodes).
_CULPRIT = re.compile(r"\branks? ([\d, ]+?)(?: \(node [^)]*\))? (?:died|hung|left|did not answer)")


@dataclass
class Survivor:
    """One rank that was left running."""

    rank: int
    rc: int
    seconds: float
    output: str

    def culprits(self) -> set[int]:
        """The ranks its error message names as missing."""
        named: set[int] = set()
        for line in self.output.splitlines():
            if line.startswith("sven: error:"):
                for m in _CULPRIT.finditer(line):
                    named.update(int(r) for r in m.group(1).replace(",", " ").split())
        return named


@dataclass
class Fault:
    """What happened to a run one of whose ranks was killed or frozen."""

    out: Path
    how: str
    world_size: int
    victim: int
    survivors: list[Survivor]


def _wait_for_checkpoint(out: Path, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list((out / "checkpoints").glob("step-*")):
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a rank exited before the first checkpoint")
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint under {out} after {timeout:g} s")


def _fault(store: Path, out: Path, how: str, world_size: int, victim: int) -> Fault:
    overrides = tiny_overrides(store, f"out={out}", f"dist.timeout_s={TIMEOUT_S}")
    port = free_port()
    logs = [out.parent / f"{out.name}-rank{r}.log" for r in range(world_size)]
    procs = [
        start_rank(r, world_size, port, ["train", *overrides], logs[r]) for r in range(world_size)
    ]
    ended: dict[int, float] = {}
    try:
        # Four ranks starting on two cores take a while to reach their first checkpoint.
        _wait_for_checkpoint(out, procs, timeout=120 * world_size)
        os.kill(procs[victim].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        deadline = t0 + TIMEOUT_S + 120
        while len(ended) < world_size - 1 and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r != victim and r not in ended and p.poll() is not None:
                    ended[r] = time.monotonic() - t0
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a stopped process
                p.wait()
    survivors = []
    for r in range(world_size):
        if r == victim:
            continue
        output = logs[r].read_text(errors="replace")
        assert r in ended, (
            f"rank {r} still running {TIMEOUT_S + 120} s after rank {victim} {how}:\n{output}"
        )
        survivors.append(Survivor(r, procs[r].returncode, ended[r], output))
        # Shown with -s: how long the survivors took, for docs/distributed.md.
        print(f"{how} rank {victim} of {world_size}: rank {r} exited after {ended[r]:.1f} s")
    assert not (out / "summary.json").exists(), f"the run ended before rank {victim} was stopped"
    return Fault(out, how, world_size, victim, survivors)


def _fault_fixture(how: str, world_size: int, victim: int):
    @pytest.fixture(scope="module")
    def fixture(tiny_store, tmp_path_factory) -> Fault:
        tmp = tmp_path_factory.mktemp(f"fault-{how}-{world_size}")
        return _fault(tiny_store, tmp / "run", how, world_size, victim)

    fixture.__doc__ = f"A {world_size}-rank run whose rank {victim} got {how} after a checkpoint."
    return fixture


killed = _fault_fixture("kill", 2, 1)
hung = _fault_fixture("hang", 2, 1)
store_lost = _fault_fixture("kill", 2, 0)
killed4 = _fault_fixture("kill", 4, 2)
hung4 = _fault_fixture("hang", 4, 2)


@pytest.fixture(params=["killed", "hung", "store_lost", "killed4", "hung4"])
def fault(request) -> Fault:
    return request.getfixturevalue(request.param)


def test_survivors_exit_non_zero_within_the_timeout(fault: Fault) -> None:
    for s in fault.survivors:
        assert s.rc == 4, f"rank {s.rank} exited {s.rc}:\n{s.output}"
        assert s.seconds < TIMEOUT_S + EXIT_SLACK_S, (
            f"rank {s.rank} took {s.seconds:.1f} s after rank {fault.victim}'s {fault.how} "
            f"(dist.timeout_s={TIMEOUT_S}):\n{s.output}"
        )


def test_survivors_name_the_missing_rank_and_no_other(fault: Fault) -> None:
    for s in fault.survivors:
        assert s.culprits() == {fault.victim}, f"rank {s.rank}:\n{s.output}"
        assert "Traceback" not in s.output, s.output
        # One line; torch's own report of the broken connections is in logs/.
        assert sum(line.startswith("sven:") for line in s.output.splitlines()) == 1, s.output
        assert not any(marker in s.output for marker in CPP_DUMP), s.output


def test_latest_checkpoint_verifies(fault: Fault) -> None:
    ck = Checkpointer(fault.out / "checkpoints")
    with warnings.catch_warnings():
        # A corrupt newest checkpoint would warn here and fall back to an older one.
        warnings.simplefilter("error")
        step = ck.latest()
    assert step is not None and ck.verify(step)


def test_failed_rendezvous_is_one_line_with_the_details_in_a_log(tiny_store, tmp_path) -> None:
    # Rank 1 of 2 alone: nobody serves the rendezvous store at that port.
    out = tmp_path / "run"
    log = tmp_path / "rank1.out"
    overrides = tiny_overrides(tiny_store, f"out={out}", "dist.timeout_s=2")
    proc = start_rank(1, 2, free_port(), ["train", *overrides], log)
    assert proc.wait(timeout=120) == 4
    lines = log.read_text(errors="replace").splitlines()
    details = out / "logs" / "rank1.log"
    assert len(lines) == 1, lines
    assert lines[0].startswith("sven: error: rank 1 of 2 (torchrun) could not join the "), lines
    assert lines[0].endswith(f"(details: {details})"), lines
    assert "[c10d]" in details.read_text(errors="replace")


def test_resumed_run_ends_with_uninterrupted_metrics(killed: Fault, tiny_store, reference) -> None:
    cmd = [*torchrun_cmd(), "train"]
    cmd += tiny_overrides(tiny_store, f"out={killed.out}", "train.resume=true", "quiet=false")
    done = run_checked(cmd, env=sven_env())
    assert "resumed from" in done.stderr, done.stderr
    assert metrics(killed.out) == reference.metrics
