"""The scripts in ``slurm/`` on a real single-node SLURM cluster (started by a fixture).

Training jobs run 2 CPU tasks over gloo (``SVEN_CPU=1``) on the tiny configuration
and must end with the metrics of a plain 2-rank ``torchrun`` run of it: straight
through, after ``scancel`` and a resubmission, and after a rank dies and the job
requeues itself. The preprocessing and partitioning scripts run their CLI.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from sven.datasets.store import TemporalEvents
from tests.integration.slurm_cluster import (  # noqa: F401 - fixtures
    VENV_BIN,
    Cluster,
    job_log,
    metrics,
    reference_fixture,
    sbatch,
    slurm_fixture,
    sven_env,
    tiny_overrides,
    tiny_store_fixture,
    wait_for_checkpoint,
)

# Multi-process too: `-m 'not dist'` leaves these out as well.
pytestmark = [pytest.mark.slurm, pytest.mark.dist]

# CPU mode on this one node, which may have no more than 2 CPUs: the header asks for
# 2 nodes x 4 GPUs, 8 CPUs per task.
CPU_JOB = ("--gpus-per-node=0", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1")
# The prep and partition headers ask for 4 and 8 CPUs.
ONE_CPU = ("--cpus-per-task=1",)


def train_job(
    cluster: Cluster, store: Path, out: Path, workdir: Path, *extra: str, wait: bool
) -> tuple[str, int]:
    # quiet=false: the log then says where a resumed run started from.
    return sbatch(
        cluster,
        "train.sbatch",
        *tiny_overrides(store, "quiet=false", *extra),
        workdir=workdir,
        options=CPU_JOB,
        env={"SVEN_CPU": "1", "SVEN_OUT": str(out)},
        wait=wait,
    )


def test_train_job_matches_torchrun(slurm, tiny_store, reference, tmp_path) -> None:
    out = tmp_path / "run"
    job, rc = train_job(slurm, tiny_store, out, tmp_path, wait=True)
    log = job_log(tmp_path, job)
    assert rc == 0, log
    # sven.distributed saw an srun step, and only rank 0 says so.
    assert log.count("launcher=slurm backend=gloo world_size=2 device=cpu") == 1, log
    assert metrics(out) == reference.metrics


def test_cancelled_job_resumes_when_resubmitted(slurm, tiny_store, reference, tmp_path) -> None:
    out = tmp_path / "run"
    first, _ = train_job(slurm, tiny_store, out, tmp_path, wait=False)
    wait_for_checkpoint(slurm, first, out)
    slurm.run("scancel", first)
    slurm.wait_state(first, ["CANCELLED"])
    assert not (out / "summary.json").exists(), "the job finished before scancel"

    second, rc = train_job(slurm, tiny_store, out, tmp_path, wait=True)
    log = job_log(tmp_path, second)
    assert rc == 0, log
    assert "resumed from" in log, log
    assert metrics(out) == reference.metrics


def test_failed_rank_requeues_the_job_which_resumes(slurm, tiny_store, reference, tmp_path) -> None:
    out = tmp_path / "run"
    job, _ = train_job(slurm, tiny_store, out, tmp_path, wait=False)
    wait_for_checkpoint(slurm, job, out)
    # PID JOBID STEPID LOCALID GLOBALID: the task of global rank 1 in step 0.
    rows = [r.split() for r in slurm.run("scontrol", "listpids", job).splitlines()[1:]]
    rank1 = [int(r[0]) for r in rows if r[2] == "0" and r[4] == "1"]
    assert rank1, rows
    os.kill(rank1[0], signal.SIGKILL)

    info = slurm.wait_state(job, ["COMPLETED", "FAILED", "CANCELLED"], timeout=300)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED", log
    assert info.get("Restarts") == "1", info
    assert "requeueing" in log and "resumed from" in log, log
    assert metrics(out) == reference.metrics


def test_time_limit_warning_checkpoints_and_requeues(
    slurm, tiny_store, reference, tmp_path
) -> None:
    # What --signal=B:USR1@300 does near the time limit: SIGUSR1 to the batch shell,
    # which passes it on to the ranks; they stop after one step with a checkpoint
    # (exit 75) and the job requeues itself and resumes from it.
    out = tmp_path / "run"
    job, _ = train_job(slurm, tiny_store, out, tmp_path, wait=False)
    wait_for_checkpoint(slurm, job, out)
    slurm.run("scancel", "--batch", "--signal=USR1", job)

    info = slurm.wait_state(job, ["COMPLETED", "FAILED", "CANCELLED"], timeout=300)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED", log
    assert info.get("Restarts") == "1", info
    assert "sven: stopped by SIGUSR1 at epoch" in log, log
    assert "stopped with a checkpoint (exit 75); requeueing" in log, log
    assert "resumed from" in log, log
    assert metrics(out) == reference.metrics


def test_gpu_mode_without_gpus_stops_at_once(slurm, tmp_path) -> None:
    job, rc = sbatch(
        slurm,
        "train.sbatch",
        workdir=tmp_path,
        options=CPU_JOB,
        env={"SVEN_CPU": "0"},
        wait=True,
    )
    log = job_log(tmp_path, job)
    assert rc == 2, log
    assert "no GPUs in this allocation" in log and "requeue" not in log, log


_LR_ERROR = "sven: error: train.lr: expected a number, got 'abc'"


def test_a_config_error_stops_the_job_before_its_ranks_start(slurm, tiny_store, tmp_path):
    out = tmp_path / "run"
    job, rc = train_job(slurm, tiny_store, out, tmp_path, "train.lr=abc", wait=True)
    log = job_log(tmp_path, job)
    # Sven's one line, once: the script checks the config before srun starts ranks.
    assert rc == 2 and log.count(_LR_ERROR) == 1, log
    assert "no rank started" in log and "requeue" not in log.replace("not requeued", ""), log
    assert "Traceback" not in log and "srun:" not in log, log
    assert not out.exists()


def test_a_config_error_under_srun_is_said_once(slurm, tmp_path) -> None:
    cmd = ["srun", "--nodes=1", "--ntasks=2", "--cpus-per-task=1", str(VENV_BIN / "sven")]
    cmd += ["train", "train.lr=abc", f"out={tmp_path / 'run'}"]
    done = subprocess.run(
        cmd, cwd=tmp_path, env=sven_env(slurm.env), capture_output=True, text=True, timeout=120
    )
    # Each task reads the same command line; rank 0 alone says what is wrong.
    assert done.returncode == 2, done.stderr
    assert done.stderr.count(_LR_ERROR) == 1 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_prep_job_converts_a_raw_file(slurm, tiny_store, tmp_path) -> None:
    ev = TemporalEvents.load(tiny_store)
    src, dst = ev.id_map[ev.src], ev.id_map[ev.dst]
    raw = tmp_path / "events.txt"
    raw.write_text("".join(f"{s} {d} {t}\n" for s, d, t in zip(src, dst, ev.t)))
    job, rc = sbatch(
        slurm,
        "prep.sbatch",
        "convert",
        str(raw),
        "--out",
        str(tmp_path / "store"),
        workdir=tmp_path,
        options=ONE_CPU,
        wait=True,
    )
    assert rc == 0, job_log(tmp_path, job)
    got = TemporalEvents.load(tmp_path / "store")
    np.testing.assert_array_equal(got.id_map[got.src], src)
    np.testing.assert_array_equal(got.id_map[got.dst], dst)
    np.testing.assert_array_equal(got.t, ev.t)


def test_partition_job_writes_a_partition(slurm, tiny_store, tmp_path) -> None:
    part = tmp_path / "part"
    job, rc = sbatch(
        slurm,
        "partition.sbatch",
        str(tiny_store),
        "--parts",
        "2",
        "--strategy",
        "hash",
        "--out",
        str(part),
        workdir=tmp_path,
        options=ONE_CPU,
        wait=True,
    )
    assert rc == 0, job_log(tmp_path, job)
    assert (part / "meta.json").is_file(), sorted(p.name for p in part.iterdir())
