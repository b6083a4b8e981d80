"""Multi-node launches on one machine, each against the single-node 2-rank run.

A two-node SLURM cluster (fixture ``slurm2``: ``slurmd -N n1`` and ``-N n2``, node
names that resolve nowhere, ``NodeAddr=127.0.0.1``) runs ``slurm/train.sbatch`` on
two nodes, survives the loss of one of them mid-run, and runs the preparation and
partitioning scripts. Without SLURM, two ``torchrun`` agents (``--nnodes 2``) and
``mpirun`` over a two-host hostfile launch the same run. Every training launch must
end with the metrics of the shared 2-rank ``torchrun`` reference.

The times asked of a multi-node run (job start to first step; survivor exit after a
node loss) are printed; ``pytest -s`` shows them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.slurm_cluster import (  # noqa: F401 - fixtures
    CPP_DUMP,
    VENV_BIN,
    Cluster,
    free_port,
    job_log,
    metrics,
    reference_fixture,
    run_checked,
    sbatch,
    sven_env,
    temp_cluster,
    tiny_overrides,
    tiny_store_fixture,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.dist

# One task on each of the two nodes, CPU ranks over gloo.
TWO_NODES = ("--gpus-per-node=0", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1")
# Both nodes for a one-task script (whose header asks for one node, one task).
TWO_NODE_SCRIPT = ("--nodes=2", "--ntasks=2", "--cpus-per-task=1")
# Collective timeout of the node-loss run, and what a survivor may take beyond it on
# a loaded 2-core machine (diagnosis, teardown, exit).
TIMEOUT_S = 20
EXIT_SLACK_S = 25
# The progress bar reaches its first step: "epoch 0:   7%|...| 1/14 [".
# The bar counts events, with tqdm's unit scaling ("600/1.40k [").
FIRST_STEP = re.compile(r"epoch \d+:[^\r\n]*\| *[1-9][\d.]*[kM]?/[\d.]+[kM]? \[")


@pytest.fixture(scope="module", name="slurm2")
def slurm2_fixture() -> Iterator[Cluster]:
    """A two-node SLURM cluster on this machine for the module (down after 10 s)."""
    with temp_cluster(nodes=2, slurmd_timeout=10) as cluster:
        yield cluster


def comparable(out: Path) -> dict:
    """A run's summary.json without the timings, which no two runs share."""
    summary = json.loads((out / "summary.json").read_text())
    # Seconds (wall, start-up and its phases, evaluation, checkpoints, capture) and rates.
    return {
        k: v
        for k, v in summary.items()
        if not (k.endswith("_s") or k.endswith("_per_s") or k.startswith("startup_"))
    }


def sven_lines(text: str) -> list[str]:
    """The ``sven:`` lines of a log (a progress bar ends in ``\\r``, not a newline)."""
    return [line for line in re.split(r"[\r\n]", text) if line.startswith("sven:")]


def pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def wait_running(cluster: Cluster, job: str, workdir: Path, timeout: float = 120) -> float:
    """Waits until ``job`` runs; returns when that was seen (``time.monotonic``)."""
    info = cluster.wait_state(job, ["RUNNING", "COMPLETED", "FAILED", "CANCELLED"], timeout)
    assert info["JobState"] == "RUNNING", f"{info}\n{job_log(workdir, job)}"
    return time.monotonic()


# ---------------------------------------------------------------------------
# SLURM, two nodes
# ---------------------------------------------------------------------------


@pytest.mark.slurm
def test_srun_self_check_meets_at_the_first_nodes_address(slurm2, tmp_path) -> None:
    # No MASTER_ADDR: sven.distributed finds n1's NodeAddr, since the name n1 resolves nowhere.
    cmd = ["srun", "--nodes=2", "--ntasks=2", str(VENV_BIN / "python"), "-m", "sven.distributed"]
    done = run_checked(
        [*cmd, "--device", "cpu", "--timeout-s", "60"], env=sven_env(slurm2.env), cwd=tmp_path
    )
    assert "master=127.0.0.1:" in done.stdout and "(NodeAddr of n1)" in done.stdout, done.stdout
    ranks = sorted(line for line in done.stdout.splitlines() if line.startswith("rank="))
    assert len(ranks) == 2, done.stdout
    for r, line in enumerate(ranks):
        assert f"rank={r} world_size=2 local_rank=0 local_world_size=1 " in line, line
        assert "launcher=slurm" in line and "allreduce=3" in line, line


@pytest.mark.slurm
def test_train_job_on_two_nodes_matches_torchrun(slurm2, tiny_store, reference, tmp_path) -> None:
    out = tmp_path / "run"
    job, _ = sbatch(
        slurm2,
        "train.sbatch",
        *tiny_overrides(tiny_store, "quiet=false"),
        workdir=tmp_path,
        options=TWO_NODES,
        env={"SVEN_CPU": "1", "SVEN_OUT": str(out)},
    )
    started = wait_running(slurm2, job, tmp_path)
    first_step = None
    info = slurm2.job(job)
    while info.get("JobState") in ("RUNNING", "COMPLETING", "CONFIGURING"):
        if first_step is None and FIRST_STEP.search(job_log(tmp_path, job)):
            first_step = time.monotonic() - started
        time.sleep(0.1)
        info = slurm2.job(job)
    log = job_log(tmp_path, job)
    assert info.get("JobState") == "COMPLETED", f"{info}\n{log}"
    assert info["NodeList"] == "n[1-2]", info
    assert "rendezvous 127.0.0.1:" in log and "(NodeAddr of n1)" in log, log
    assert log.count("launcher=slurm backend=gloo world_size=2 device=cpu") == 1, log
    assert comparable(out) == comparable(reference.out)
    assert first_step is not None, log
    print(f"two-node job {job}: first step {first_step:.1f} s after the job started running")


@pytest.mark.slurm
def test_lost_node_survivor_names_it_and_the_requeued_job_resumes(
    slurm2, tiny_store, reference, tmp_path
) -> None:
    out = tmp_path / "run"
    job, _ = sbatch(
        slurm2,
        "train.sbatch",
        *tiny_overrides(tiny_store, "quiet=false", f"dist.timeout_s={TIMEOUT_S}"),
        workdir=tmp_path,
        options=TWO_NODES,
        env={"SVEN_CPU": "1", "SVEN_OUT": str(out)},
    )
    wait_for_checkpoint(slurm2, job, out)
    survivors = slurm2.job_pids(job, "n1")
    assert len(survivors) == 1, survivors
    # Power cut on n2: its slurmd, its step daemon and rank 1, all at once.
    assert slurm2.lose_node("n2", job), "no task of the job on n2"
    lost = time.monotonic()
    while pid_alive(survivors[0]) and time.monotonic() - lost < TIMEOUT_S + 120:
        time.sleep(0.05)
    survivor_s = time.monotonic() - lost
    assert not pid_alive(survivors[0]), f"rank 0 still runs {survivor_s:.0f} s after n2 was lost"

    # slurmctld declares n2 down (SlurmdTimeout) and requeues the job (--requeue);
    # n2 comes back (ReturnToService=2) and the job starts again on both nodes.
    deadline = time.monotonic() + 120
    while not slurm2.node_states().get("n2", "").startswith("down"):
        assert time.monotonic() < deadline, f"n2 not down: {slurm2.node_states()}"
        time.sleep(0.5)
    slurm2.start_slurmd("n2")
    info = slurm2.wait_state(job, ["COMPLETED", "FAILED", "CANCELLED"], timeout=300)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    assert int(info.get("Restarts", "0")) >= 1, info

    first_start, _, second_start = log.partition("train.sbatch: job " + job + " start 2")
    assert second_start, log
    lines = sven_lines(first_start)
    assert len(lines) == 1, log
    print(f"node n2 lost: rank 0 on n1 exited after {survivor_s:.1f} s: {lines[0]}")
    # The collective's failure ("rank 0: a collective failed ... rank 1 (node n2) died or
    # hung ...") or, if n2 went inside a checkpoint barrier, the barrier's.
    assert lines[0].startswith("sven: error:") and "rank 1 (node n2)" in lines[0], lines
    assert survivor_s < TIMEOUT_S + EXIT_SLACK_S, f"rank 0 took {survivor_s:.1f} s:\n{log}"
    assert not any(marker in log for marker in CPP_DUMP), log
    assert "resumed from" in second_start, log
    assert metrics(out) == reference.metrics


@pytest.mark.slurm
def test_prep_and_partition_jobs_on_two_nodes(slurm2, tiny_store, tmp_path) -> None:
    from sven.datasets.store import TemporalEvents
    from sven.partition.store import load_partition

    store, part = tmp_path / "store", tmp_path / "part"
    prep, _ = sbatch(
        slurm2,
        "prep.sbatch",
        *("synth", "--events", "2000", "--nodes", "80", "--seed", "0", "--out", str(store)),
        workdir=tmp_path,
        options=TWO_NODE_SCRIPT,
    )
    # The partition job reads what the prep job wrote: chained as in slurm/README.md.
    job, rc = sbatch(
        slurm2,
        "partition.sbatch",
        *(str(store), "--parts", "2", "--strategy", "minmax", "--out", str(part)),
        workdir=tmp_path,
        options=(*TWO_NODE_SCRIPT, f"--dependency=afterok:{prep}"),
        wait=True,
    )
    logs = job_log(tmp_path, prep) + job_log(tmp_path, job)
    assert rc == 0, logs
    # Each ran once, on the first node of its two.
    assert "prep.sbatch: job " + prep + " on n1 of n[1-2]: sven data synth" in logs, logs
    assert "partition.sbatch: job " + job + " on n1 of n[1-2]: sven partition" in logs, logs
    # The same store as the tiny one (same generator and seed), and a partition of it.
    got, want = TemporalEvents.load(store), TemporalEvents.load(tiny_store)
    assert got.meta["checksums"] == want.meta["checksums"]
    meta = json.loads((part / "meta.json").read_text())
    assert (meta["strategy"], meta["parts"]) == ("minmax", 2)
    # The partition records the checksums of the columns it read.
    assert "src" in meta["store"]["checksums"]
    assert meta["store"]["checksums"].items() <= want.meta["checksums"].items()
    assert load_partition(part, verify=True).owner.shape == (80,)


# ---------------------------------------------------------------------------
# Without SLURM: torchrun agents and mpirun hosts
# ---------------------------------------------------------------------------


def test_torchrun_two_agents_match_one_node(tiny_store, reference, tmp_path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    procs, logs = [], []
    for node in range(2):
        cmd = [str(VENV_BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(node)]
        cmd += ["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        cmd += ["--rdzv-id", f"sven-{os.getpid()}", "-m", "sven.cli", "train"]
        # quiet=false: quiet=true writes nothing but errors, and the launch line is checked.
        cmd += [*tiny_overrides(tiny_store, f"out={tmp_path / 'run'}"), "quiet=false"]
        logs.append(tmp_path / f"agent{node}.log")
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen(cmd, env=sven_env(), stdout=f, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(f.read_text(errors="replace") for f in logs)
    assert [p.returncode for p in procs] == [0, 0], text
    assert text.count("launcher=torchrun backend=gloo world_size=2") == 1, text
    assert metrics(tmp_path / "run") == reference.metrics


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (OpenMPI) not installed")
def test_mpirun_two_host_hostfile_matches_one_node(tiny_store, reference, tmp_path) -> None:
    # Hosts n1 and n2, reached through an ssh stand-in that runs the command here: each
    # is a node of its own to OpenMPI (one local rank each, an orted on each). Their
    # names resolve nowhere, so rank 0 must offer an address, not its host name.
    pytest.importorskip("mpi4py")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=1\nn2 slots=1\n")
    ssh = tmp_path / "ssh"
    # Each host gets its own OpenMPI session directory, as two machines have two /tmp:
    # two orteds sharing one here raced on it (a segfault in hwloc's shared-memory
    # topology write, or mkdir's "File exists"), about one launch in seven.
    ssh.write_text(
        "#!/bin/sh\n"
        "# ssh HOST COMMAND...: skip the options, give the host its own session\n"
        "# directory, run the command here.\n"
        "while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done\n"
        f'OMPI_MCA_orte_tmpdir_base="{tmp_path}/tmp-$1"; export OMPI_MCA_orte_tmpdir_base\n'
        'mkdir -p "$OMPI_MCA_orte_tmpdir_base"\n'
        'shift\nexec sh -c "$*"\n'
    )
    ssh.chmod(0o755)
    cmd = ["mpirun", "--allow-run-as-root", "--hostfile", str(hostfile), "-n", "2"]
    cmd += ["--mca", "plm_rsh_agent", str(ssh), "-x", "PATH", "-x", "OMP_NUM_THREADS"]
    # Its own out (tmp_path holds the hostfile), and the launch line printed.
    out = f"out={tmp_path / 'run'}"
    cmd += [str(VENV_BIN / "sven"), "train", *tiny_overrides(tiny_store, out), "quiet=false"]
    done = run_checked(cmd)
    assert done.stderr.count("launcher=mpi backend=gloo world_size=2 device=cpu") == 1, done.stderr
    assert "(rank 0's address, probed)" in done.stderr, done.stderr
    assert metrics(tmp_path / "run") == reference.metrics
