"""Which launcher started this process, and what it says: pure functions of the environment.

``sven train`` is the same command on one process and under ``torchrun``, ``srun``
(SLURM) or ``mpirun``/``mpiexec``; :func:`detect_launcher` reads which of them started
the process and returns a :class:`LaunchInfo` (rank, world, local rank, the
rendezvous address where known). :mod:`sven.distributed.process_group` then brings up
``torch.distributed`` from it.

Launchers, in order of precedence:

- ``torchrun`` (or any env:// setup): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
- ``mpi``: OpenMPI (``OMPI_COMM_WORLD_*``), MVAPICH2 (``MV2_COMM_WORLD_*``),
  MPICH/Hydra and Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
  ``MPI_LOCALNRANKS``), PMIx (``PMIX_RANK``). The rendezvous address comes from
  ``MASTER_ADDR``/``MASTER_PORT`` where exported, else rank 0 broadcasts its
  addresses and a free port through mpi4py and every rank uses the first address at
  which it reaches rank 0 (:mod:`sven.distributed.rendezvous`).
- ``slurm``: a task of an ``srun`` step (``SLURM_STEP_ID``, ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``); the master is
  the first node of the step's node list, at its ``NodeAddr`` (``scontrol show node``:
  a node's name need not resolve), the port ``10000 + job_id % 20000``, both
  overridable by ``MASTER_ADDR``/``MASTER_PORT`` (:mod:`sven.distributed.slurm`).
- ``single`` otherwise.

MPI variables win over SLURM ones because ``mpirun`` inside an ``sbatch`` script
inherits the batch step's ``SLURM_PROCID`` (0 on every rank); when both describe the
same ranks (``srun --mpi=pmix``) the launch is reported as ``slurm``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sven.distributed.errors import DistError
from sven.distributed.slurm import expand_tasks_per_node, slurm_hosts, slurm_node_addr, slurm_port
from sven.extras import install_hint

LAUNCHERS = ("torchrun", "slurm", "mpi", "single")
# srun step ids at or above this are Slurm's special steps (batch script, extern,
# interactive shell of salloc), whose processes are not tasks of a launch.
_SLURM_SPECIAL_STEP = 0xFFFFFFF0


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process about the job.

    Attributes:
        launcher: One of ``"torchrun"``, ``"slurm"``, ``"mpi"``, ``"single"``.
        rank: Global rank, 0..world_size-1.
        world_size: Number of processes in the job.
        local_rank: Rank among the processes on this node (picks the GPU).
        local_world_size: Number of processes on this node.
        master_addr: Host of the rendezvous (rank 0's node); None where it is not
            known yet (MPI without ``MASTER_ADDR``: agreed on through mpi4py).
        master_port: Port of the rendezvous, or None like ``master_addr``.
        master_from: Where ``master_addr`` came from, for the log, e.g.
            ``"MASTER_ADDR"`` or ``"NodeAddr of n1"``.
        nodes: The job's hosts in order (SLURM: the step's expanded node list).
        node_rank: Index of this process's node among ``nodes`` (0 where unknown).
        job_id: The scheduler's job id (SLURM), else None.
        flavor: Which variables were read, e.g. ``"OpenMPI"`` or ``"srun step 0"``.
    """

    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    master_from: str = ""
    nodes: tuple[str, ...] = ()
    node_rank: int = 0
    job_id: str | None = None
    flavor: str = ""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise DistError(f"unknown launcher {self.launcher!r}; expected one of {LAUNCHERS}")
        # Inconsistent variables (a stale RANK exported in a shell profile, say) would
        # otherwise surface as a rendezvous that waits for ranks that never come.
        if not 0 <= self.rank < self.world_size:
            raise DistError(
                f"{self.launcher} ({self.flavor or 'environment'}): rank {self.rank} is "
                f"outside world size {self.world_size}"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise DistError(
                f"{self.launcher} ({self.flavor or 'environment'}): local rank "
                f"{self.local_rank} is outside local world size {self.local_world_size}"
            )


def _env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """Reads an integer variable; a missing one gives ``default`` or a DistError."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise DistError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistError(f"environment variable {name}={raw!r} is not an integer") from None


def _master(environ: Mapping[str, str]) -> tuple[str | None, int | None, str]:
    """``MASTER_ADDR``, ``MASTER_PORT`` (None where unset) and where the address came from."""
    addr = environ.get("MASTER_ADDR") or None
    port = _env_int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None
    return addr, port, "MASTER_ADDR" if addr else ""


def _srun_step(environ: Mapping[str, str]) -> str | None:
    """The step id when this process is a task of an ``srun`` step, else None.

    ``SLURM_NTASKS`` and even ``SLURM_PROCID`` are also set in the shell of ``salloc``
    and in an ``sbatch`` script, where ``sven train`` typed by hand is one process.
    """
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    if step is None or "SLURM_PROCID" not in environ:
        return None
    if step.isdigit() and int(step) < _SLURM_SPECIAL_STEP:
        return step
    return None


def _from_slurm(environ: Mapping[str, str], step: str) -> LaunchInfo:
    world = _env_int(environ, "SLURM_STEP_NUM_TASKS", _env_int(environ, "SLURM_NTASKS", 1))
    spec = next(
        (
            environ[k]
            for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if environ.get(k)
        ),
        "",
    )
    nodes = tuple(slurm_hosts(spec)) if spec else ()
    node_rank = _env_int(environ, "SLURM_NODEID", 0)
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if per_node:
        counts = expand_tasks_per_node(per_node)
        if node_rank >= len(counts):
            raise DistError(f"SLURM_NODEID={node_rank} but tasks per node is {per_node!r}")
        local_world = counts[node_rank]
    elif environ.get("SLURM_NTASKS_PER_NODE"):
        local_world = _env_int(environ, "SLURM_NTASKS_PER_NODE")
    elif len(nodes) <= 1:
        local_world = world
    else:
        raise DistError("SLURM_STEP_TASKS_PER_NODE is not set on a multi-node step")
    job_id = environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID"))
    addr, port, source = _master(environ)
    if addr is None and nodes:
        # With the default block distribution task 0 runs on the step's first node.
        addr, source = slurm_node_addr(nodes[0], environ)
    if port is None and job_id is not None:
        port = slurm_port(job_id)
    if addr is None or port is None:
        raise DistError(
            "srun step without SLURM_STEP_NODELIST/SLURM_JOB_ID; set MASTER_ADDR and MASTER_PORT"
        )
    return LaunchInfo(
        launcher="slurm",
        rank=_env_int(environ, "SLURM_PROCID"),
        world_size=world,
        local_rank=_env_int(environ, "SLURM_LOCALID", 0),
        local_world_size=local_world,
        master_addr=addr,
        master_port=port,
        master_from=source,
        nodes=nodes,
        node_rank=node_rank,
        job_id=job_id,
        flavor=f"srun step {step}",
    )


# (flavor, rank, size, local rank, local size) variables of each MPI implementation.
_MPI_VARS = (
    (
        "OpenMPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        "MVAPICH2",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    ("MPICH/Intel MPI (Hydra)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIx", "PMIX_RANK", None, None, None),
)


def _mpi_env(environ: Mapping[str, str]) -> tuple[str, list[int | None]] | None:
    """The first MPI implementation whose rank variable is set, and what it exports."""
    for flavor, *names in _MPI_VARS:
        if environ.get(names[0]):
            values = [
                _env_int(environ, n) if n is not None and environ.get(n) else None for n in names
            ]
            return flavor, values
    return None


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise DistError(
            "launched by an MPI launcher without MASTER_ADDR/MASTER_PORT (and, with PMIx, "
            "without the world size), which Sven then learns through mpi4py, but mpi4py is "
            f"not installed: {install_hint('mpi')}, or export MASTER_ADDR and MASTER_PORT "
            "to every rank (mpirun -x MASTER_ADDR -x MASTER_PORT)"
        ) from err
    return MPI


def _mpi_world() -> tuple[int, int, int, int]:
    """(rank, size, local rank, local size) from mpi4py, for launchers that export less."""
    mpi = _import_mpi()
    comm = mpi.COMM_WORLD
    node = comm.Split_type(mpi.COMM_TYPE_SHARED)
    try:
        return comm.Get_rank(), comm.Get_size(), node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _from_mpi(environ: Mapping[str, str], flavor: str, values: list[int | None]) -> LaunchInfo:
    # Only PMIx alone leaves something out; then ask MPI itself rather than guess.
    asked = _mpi_world() if None in values else (0, 0, 0, 0)
    rank, world, local_rank, local_world = (w if v is None else v for v, w in zip(values, asked))
    addr, port, source = _master(environ)
    if addr is not None and port is None:
        port = 29500  # torch's default, as torchrun would use
    return LaunchInfo(
        launcher="mpi",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=addr,
        master_port=port,
        master_from=source,
        flavor=flavor,
    )


def _from_torchrun(environ: Mapping[str, str]) -> LaunchInfo:
    rank = _env_int(environ, "RANK")
    world = _env_int(environ, "WORLD_SIZE")
    addr, port, source = _master(environ)
    return LaunchInfo(
        launcher="torchrun",
        rank=rank,
        world_size=world,
        # A hand-made env:// setup often exports only RANK and WORLD_SIZE: one node.
        local_rank=_env_int(environ, "LOCAL_RANK", rank),
        local_world_size=_env_int(environ, "LOCAL_WORLD_SIZE", world),
        master_addr=addr,
        master_port=port,
        master_from=source,
        node_rank=_env_int(environ, "GROUP_RANK", 0),
        flavor="torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env://",
    )


def detect_launcher(environ: Mapping[str, str] = os.environ) -> LaunchInfo:
    """Reads which launcher started this process, and its rank, from the environment.

    Only PMIx without other variables makes this touch MPI (through mpi4py), since PMIx
    exports the rank but not the world size.

    Args:
        environ: The environment to read (``os.environ`` by default).

    Returns:
        The launch; ``launcher="single"`` with rank 0 of 1 when nothing launched us.

    Raises:
        DistError: The variables are malformed or contradict each other.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    mpi = _mpi_env(environ)
    step = _srun_step(environ)
    if step is not None:
        slurm = _from_slurm(environ, step)
        if mpi is None:
            return slurm
        rank, world = mpi[1][0], mpi[1][1]
        if rank == slurm.rank and world in (None, slurm.world_size):
            return slurm  # srun --mpi=pmi2/pmix: the same ranks, srun is the launcher
    if mpi is not None:
        return _from_mpi(environ, *mpi)
    return LaunchInfo(launcher="single")
