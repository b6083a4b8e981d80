"""``sven train`` unchanged under ``mpirun`` (OpenMPI) and ``torchrun``: same metrics.

Both launch 2 gloo ranks of one tiny configuration; rank 0 alone reports the launcher
and backend it detected. The torchrun run is the session's shared reference.
"""

from __future__ import annotations

import shutil

import pytest

from tests.integration.slurm_cluster import (  # noqa: F401 - fixtures
    VENV_BIN,
    metrics,
    reference_fixture,
    run_checked,
    tiny_overrides,
    tiny_store_fixture,
)

pytestmark = pytest.mark.dist


def test_torchrun_reports_launcher_and_backend_once(reference) -> None:
    # Each rank prints its own result line, but only rank 0 the detected launch.
    assert reference.stderr.count("launcher=torchrun backend=gloo world_size=2") == 1, (
        reference.stderr
    )


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (OpenMPI) not installed")
def test_mpirun_matches_torchrun(tiny_store, reference, tmp_path) -> None:
    # Without MASTER_ADDR/MASTER_PORT sven.distributed agrees on them through mpi4py.
    pytest.importorskip("mpi4py")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    over = tiny_overrides(tiny_store, f"out={tmp_path}", "quiet=false")
    cmd += [str(VENV_BIN / "sven"), "train", *over]
    done = run_checked(cmd)
    assert done.stderr.count("launcher=mpi backend=gloo world_size=2 device=cpu") == 1, done.stderr
    assert metrics(tmp_path) == reference.metrics
