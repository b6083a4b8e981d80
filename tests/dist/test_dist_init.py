"""sven.distributed on real processes: gloo init, failures that name ranks, torchrun and mpirun.

Also tests the rank runner itself: a failing or hung rank must show in the failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from sven.distributed.collectives import (
    DistError,
    allreduce_sum_,
    barrier_or_die,
    broadcast_object,
    is_main,
)
from sven.distributed.process_group import init_distributed
from tests.dist.launch import RankFailure, free_port, run_ranks

pytestmark = pytest.mark.dist


def _init_and_reduce(rank: int, world_size: int) -> dict[str, object]:
    with init_distributed(timeout_s=30, device="cpu") as ctx:
        total = allreduce_sum_(torch.tensor([rank + 1.0]))
        out = {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "launcher": ctx.launcher,
            "backend": ctx.backend,
            "describe": ctx.describe(),
            "sum": total.item(),
            "main": is_main(),
            "broadcast": broadcast_object(f"from rank {rank}"),
        }
        barrier_or_die(ctx, "after all_reduce", timeout_s=30)
    out["group_destroyed"] = not dist.is_initialized()
    return out


def test_two_gloo_ranks_init_and_all_reduce() -> None:
    results = run_ranks(_init_and_reduce, 2, backend=None, timeout=60)
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["world_size"] == 2
        assert (res["launcher"], res["backend"]) == ("torchrun", "gloo")
        assert res["sum"] == 3.0
        assert res["main"] == (rank == 0)
        assert res["broadcast"] == "from rank 0"
        assert res["group_destroyed"]
    assert results[0]["describe"].startswith(
        "launcher=torchrun backend=gloo world_size=2 device=cpu master=127.0.0.1:"
    )


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 is left waiting for rank 1, as in a real failure


def test_run_ranks_shows_the_failing_ranks_traceback() -> None:
    with pytest.raises(RankFailure) as err:
        run_ranks(_rank1_raises, 2, timeout=60)
    message = str(err.value)
    assert "===== rank 1: raised:" in message
    assert "Traceback (most recent call last)" in message
    assert "in _rank1_raises" in message and "ValueError: boom on rank 1" in message
    # Rank 0 is reported too: its barrier failed, or it was killed while waiting.
    assert "===== rank 0:" in message and set(err.value.reports) == {0, 1}


def _rank1_hangs(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(120)
    return rank


def test_run_ranks_kills_and_names_a_hung_rank() -> None:
    # The timeout covers the ranks' start (importing torch) on a busy machine too.
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_ranks(_rank1_hangs, 2, backend=None, timeout=15)
    assert time.monotonic() - start < 40
    assert err.value.hung == [1] and set(err.value.reports) == {1}
    assert "rank 1 hung" in str(err.value).splitlines()[0]
    assert "in _rank1_hangs" in err.value.reports[1]  # faulthandler's dump of its stack


def _rank2_late(rank: int, world_size: int) -> tuple[str, tuple[int, ...]] | None:
    ctx = init_distributed(timeout_s=30, device="cpu")
    try:
        if rank == 2:
            time.sleep(4)  # hangs past the barrier's timeout, without crashing
            return None
        try:
            barrier_or_die(ctx, "epoch 3 batch 10", timeout_s=2)
        except DistError as exc:
            return str(exc), exc.ranks
        return "passed", ()
    finally:
        ctx.teardown()


def test_barrier_names_the_rank_that_did_not_answer() -> None:
    start = time.monotonic()
    results = run_ranks(_rank2_late, 3, backend=None, timeout=60)
    assert results[0] == ("rank 2 did not answer within 2 s (at 'epoch 3 batch 10')", (2,))
    # Rank 1 waits for rank 0's release, which never comes; the heartbeats tell it that
    # rank 0 is alive and has found rank 2 missing, and rank 2 (alive, then gone) is
    # the one it names, not rank 0.
    message, ranks = results[1]
    assert ranks == (2,) and message.startswith("rank 2 "), message
    assert "'epoch 3 batch 10'" in message
    assert time.monotonic() - start < 40


def _clean_env() -> dict[str, str]:
    """This environment without any launcher's variables, so the one under test is seen."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    prefixes = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC")
    env = {k: v for k, v in os.environ.items() if k not in launch and not k.startswith(prefixes)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _check_self_check_output(out: str, launcher: str) -> None:
    assert f"launcher={launcher} backend=gloo world_size=2 device=cpu" in out
    for rank in (0, 1):
        line = f"rank={rank} world_size=2 local_rank={rank} local_world_size=2 launcher={launcher}"
        assert line in out
    assert out.count("allreduce=3") == 2


def test_torchrun_launch() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), "-m", "sven.distributed", "--timeout-s", "30"]
    done = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    _check_self_check_output(done.stdout, "torchrun")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (OpenMPI) not installed")
def test_mpirun_launch() -> None:
    pytest.importorskip("mpi4py")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    cmd += [sys.executable, "-m", "sven.distributed", "--timeout-s", "30"]
    done = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    _check_self_check_output(done.stdout, "mpi")
