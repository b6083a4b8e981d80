"""sven.dist, the old home of sven.distributed's names, keeps working."""

from __future__ import annotations

import subprocess
import sys

import pytest

import sven.dist as sdist
from sven.distributed import collectives, launch, liveness


def test_every_name_is_the_packages_own() -> None:
    for name in sdist.__all__:
        homes = [m for m in (launch, liveness, collectives) if name in vars(m)]
        assert homes, name
        assert getattr(sdist, name) is getattr(homes[0], name), name
    # Private helpers that tests patch or call through sven.dist are there too.
    assert sdist._pick_device is launch._pick_device
    assert sdist._first_line is collectives._first_line
    assert sdist._start_liveness is liveness._start_liveness


def test_a_patch_through_sven_dist_reaches_the_code_and_is_undone() -> None:
    original = launch.slurm_node_addr
    mp = pytest.MonkeyPatch()
    mp.setattr(sdist, "slurm_node_addr", lambda node, environ: (node, f"node name {node}"))
    assert launch.slurm_node_addr is sdist.slurm_node_addr is not original
    mp.undo()
    assert launch.slurm_node_addr is original and sdist.slurm_node_addr is original
    # A name that several modules import is set in each of them.
    mp.setattr(sdist, "_first_line", lambda err: "patched")
    assert liveness._first_line(ValueError("x")) == "patched"
    assert launch._first_line(ValueError("x")) == "patched"
    mp.undo()
    assert liveness._first_line(ValueError("x\ny")) == "x"


def test_python_m_sven_dist_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sven.dist", "--help"], capture_output=True, text=True, check=True
    )
    assert "python -m sven.dist" in out.stdout and "--timeout-s" in out.stdout
    # One process: no group, one line per rank, exit 0.
    env = {"PATH": "/usr/bin:/bin"}
    one = subprocess.run(
        [sys.executable, "-m", "sven.dist", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert one.returncode == 0, one.stderr
    assert "rank=0 world_size=1" in one.stdout and "allreduce=1" in one.stdout
