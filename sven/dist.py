"""Launchers and the process group: the only module of Sven that knows how it was started.

``sven train`` is the same command on one process and under ``torchrun``, ``srun``
(SLURM) or ``mpirun``/``mpiexec``; this module reads which of them started the process
(:func:`detect_launcher`), brings up ``torch.distributed`` accordingly
(:func:`init_distributed`) and turns a rank that hangs or dies into a
:class:`DistError` that names it (:func:`barrier_or_die`). Everything else in Sven
sees only a :class:`DistContext` and the tiny collective helpers at the end.

Launchers, in order of precedence:

- ``torchrun`` (or any env:// setup): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
- ``mpi``: OpenMPI (``OMPI_COMM_WORLD_*``), MVAPICH2 (``MV2_COMM_WORLD_*``),
  MPICH/Hydra and Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
  ``MPI_LOCALNRANKS``), PMIx (``PMIX_RANK``). The rendezvous address comes from
  ``MASTER_ADDR``/``MASTER_PORT`` where exported, else rank 0 broadcasts its host
  name and a free port through mpi4py.
- ``slurm``: a task of an ``srun`` step (``SLURM_STEP_ID``, ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``); the master is
  the first host of the step's node list, the port ``10000 + job_id % 20000``, both
  overridable by ``MASTER_ADDR``/``MASTER_PORT``.
- ``single`` otherwise.

MPI variables win over SLURM ones because ``mpirun`` inside an ``sbatch`` script
inherits the batch step's ``SLURM_PROCID`` (0 on every rank); when both describe the
same ranks (``srun --mpi=pmix``) the launch is reported as ``slurm``.

``python -m sven.dist`` is a self-check of a launch: every rank joins, all-reduces
and prints one line (e.g. ``srun -n 4 python -m sven.dist``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sven.errors import SvenError

LAUNCHERS = ("torchrun", "slurm", "mpi", "single")
# torch's own default: long enough for rank 0 to finish a checkpoint or an
# evaluation while the others wait at the next collective.
DEFAULT_TIMEOUT_S = 1800.0
# srun step ids at or above this are Slurm's special steps (batch script, extern,
# interactive shell of salloc), whose processes are not tasks of a launch.
_SLURM_SPECIAL_STEP = 0xFFFFFFF0


class DistError(SvenError):
    """A launch that cannot start, or a rank that did not answer in time.

    Attributes:
        ranks: Ranks found missing (empty where the failure does not say).
        what: Where the program was when it failed (e.g. ``"epoch 3 batch 10"``).
    """

    exit_code = 4

    def __init__(self, message: str, ranks: Sequence[int] = (), what: str = "") -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.what = what


# ---------------------------------------------------------------------------
# Launcher detection (pure functions of the environment)
# ---------------------------------------------------------------------------


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


def _master(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = environ.get("MASTER_ADDR") or None
    port = _env_int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None
    return addr, port


def _split_top_level(spec: str) -> list[str]:
    """Splits a Slurm host list on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' at column {i}")
        elif ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("unbalanced '['")
    items.append(spec[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_host(item: str) -> list[str]:
    """Expands one host pattern; several bracket groups give their product."""
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        if "[" in item or "]" in item:
            raise ValueError(f"malformed host pattern {item!r}")
        return [item]
    prefix, body = item[: m.start()], m.group(1)
    suffixes = _expand_host(item[m.end() :])
    out = []
    for part in body.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"malformed range {part!r} in {item!r}")
        if not dash:
            values = [lo]
        else:
            if int(hi) < int(lo):
                raise ValueError(f"descending range {part!r} in {item!r}")
            # Slurm pads to the width of the lower bound: [01-10] -> 01..10, [8-10] -> 8..10.
            values = [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
        out.extend(prefix + v + s for v in values for s in suffixes)
    return out


def expand_hostlist(spec: str) -> list[str]:
    """Expands a Slurm host list such as ``"node[01-03,07],gpu5"``.

    Args:
        spec: The compressed list (``SLURM_JOB_NODELIST`` and friends).

    Returns:
        The host names in order, e.g. ``["node01", "node02", "node03", "node07", "gpu5"]``.

    Raises:
        ValueError: The list is malformed.
    """
    hosts: list[str] = []
    for item in _split_top_level(spec):
        hosts.extend(_expand_host(item))
    return hosts


def slurm_hosts(spec: str) -> list[str]:
    """Expands a Slurm host list, asking ``scontrol`` about forms the parser rejects."""
    try:
        return expand_hostlist(spec)
    except ValueError as err:
        if shutil.which("scontrol") is None:
            raise DistError(f"cannot parse SLURM node list {spec!r}: {err}") from None
        done = subprocess.run(
            ["scontrol", "show", "hostnames", spec], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not done.stdout.split():
            raise DistError(
                f"cannot parse SLURM node list {spec!r}: {err}; scontrol says: "
                f"{done.stderr.strip()}"
            ) from None
        return done.stdout.split()


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expands Slurm's tasks-per-node form, e.g. ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise DistError(f"cannot parse SLURM tasks per node {spec!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def slurm_port(job_id: int | str) -> int:
    """The rendezvous port of a SLURM job: ``10000 + job_id % 20000``.

    Every task computes it alone, and the range stays clear of the ephemeral ports
    (32768 and up) that the kernel hands out to outgoing connections.
    """
    return 10000 + int(job_id) % 20000


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
    addr, port = _master(environ)
    if addr is None:
        # With the default block distribution task 0 runs on the step's first node.
        addr = nodes[0] if nodes else None
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
            "not installed: pip install 'sven[mpi]', or export MASTER_ADDR and MASTER_PORT "
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
    addr, port = _master(environ)
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
        flavor=flavor,
    )


def _from_torchrun(environ: Mapping[str, str]) -> LaunchInfo:
    rank = _env_int(environ, "RANK")
    world = _env_int(environ, "WORLD_SIZE")
    addr, port = _master(environ)
    return LaunchInfo(
        launcher="torchrun",
        rank=rank,
        world_size=world,
        # A hand-made env:// setup often exports only RANK and WORLD_SIZE: one node.
        local_rank=_env_int(environ, "LOCAL_RANK", rank),
        local_world_size=_env_int(environ, "LOCAL_WORLD_SIZE", world),
        master_addr=addr,
        master_port=port,
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


# ---------------------------------------------------------------------------
# The process group
# ---------------------------------------------------------------------------


def free_port(host: str = "") -> int:
    """A TCP port that is free now on ``host`` (all interfaces by default).

    Another process may take it before it is bound again; rendezvous ports are bound
    within a second of this call, which makes that rare enough.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _mpi_rendezvous(info: LaunchInfo) -> LaunchInfo:
    """Fills in the master address and port: rank 0 picks them, MPI broadcasts them."""
    comm = _import_mpi().COMM_WORLD
    payload = None
    if comm.Get_rank() == 0:
        payload = (socket.gethostname(), free_port())
    addr, port = comm.bcast(payload, root=0)
    return dataclasses.replace(info, master_addr=addr, master_port=port)


def _pick_device(device: str | torch.device, info: LaunchInfo) -> torch.device:
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda" or dev.index is not None:
        return dev
    if not torch.cuda.is_available():
        raise DistError("device 'cuda' asked for, but CUDA is not available")
    count = torch.cuda.device_count()
    if count >= info.local_world_size:
        return torch.device("cuda", info.local_rank)
    if count == 1:
        # The scheduler bound one GPU to each task (srun --gpus-per-task=1).
        return torch.device("cuda", 0)
    raise DistError(
        f"{info.local_world_size} ranks on this node but {count} GPUs visible; Sven runs one "
        f"rank per GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
    )


@dataclass
class DistContext:
    """This process's place in the job, and the process group's lifetime.

    Use as a context manager so that the process group is destroyed however the body
    ends::

        with init_distributed() as ctx:
            if ctx.is_main:
                print(ctx.describe())

    Attributes:
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank on this node.
        local_world_size: Processes on this node.
        device: The device of this rank (``cuda:<local_rank>`` under NCCL).
        backend: ``"nccl"``, ``"gloo"``, or ``"none"`` when there is no process group.
        launcher: One of :data:`LAUNCHERS`.
        info: Everything the launcher said.
        timeout_s: Collective timeout of the process group, seconds.
        health_group: The gloo group for :func:`barrier_or_die` (None: the default
            group, which is gloo itself).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str
    info: LaunchInfo
    timeout_s: float = DEFAULT_TIMEOUT_S
    health_group: dist.ProcessGroup | None = None
    _owns_group: bool = field(default=False, repr=False)
    _saved_env: dict[str, str | None] = field(default_factory=dict, repr=False)

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one that prints and writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group exists (collectives do something)."""
        return self.backend != "none"

    def describe(self) -> str:
        """One line naming the launcher, backend and world, for rank 0 to print."""
        line = (
            f"launcher={self.launcher} backend={self.backend} world_size={self.world_size} "
            f"device={self.device.type}"
        )
        if self.distributed:
            line += f" master={self.info.master_addr}:{self.info.master_port}"
        return line

    def barrier(self, what: str, timeout_s: float | None = None) -> None:
        """:func:`barrier_or_die` on this context."""
        barrier_or_die(self, what, timeout_s)

    def teardown(self) -> None:
        """Destroys the process group this context created; safe to call twice.

        Also puts back the env:// variables that :func:`init_distributed` set, so a
        later launch detection in this process is not misled by them.
        """
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        _restore_env(self._saved_env)
        self._saved_env = {}

    def __enter__(self) -> DistContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


def _restore_env(saved: Mapping[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def init_distributed(
    backend: str = "auto",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: str | torch.device = "auto",
    force_group: bool = False,
    environ: Mapping[str, str] | None = None,
) -> DistContext:
    """Joins the job that the launcher started, or sets up a plain single process.

    Sets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` in ``os.environ`` for the env:// rendezvous (and for any
    library that reads them), pins ``cuda:<local_rank>`` under NCCL, and under NCCL
    also creates a gloo group for :func:`barrier_or_die`. If a process group already
    exists (a test harness made it), the context adopts it and leaves it alone on
    teardown.

    Args:
        backend: ``"auto"`` (NCCL on CUDA, gloo otherwise), ``"nccl"`` or ``"gloo"``.
        timeout_s: Timeout of the rendezvous and of every collective, seconds.
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a device.
        force_group: Create a process group even for a world of one process (which
            otherwise runs without one, exactly like a plain script).
        environ: Environment to read the launch from (``os.environ`` by default).

    Returns:
        The context; use it as a context manager or call :meth:`DistContext.teardown`.

    Raises:
        DistError: Bad launch variables, a backend that does not fit the device, or a
            rendezvous that did not complete within ``timeout_s``.
    """
    info = detect_launcher(os.environ if environ is None else environ)
    dev = _pick_device(device, info)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend not in ("nccl", "gloo"):
        raise DistError(f"unknown backend {backend!r}; expected 'auto', 'nccl' or 'gloo'")
    if backend == "nccl" and dev.type != "cuda":
        raise DistError(f"backend 'nccl' needs a CUDA device, got {dev}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    def context(
        backend: str,
        info: LaunchInfo,
        owns: bool,
        health: dist.ProcessGroup | None = None,
        saved: dict[str, str | None] | None = None,
    ) -> DistContext:
        return DistContext(
            rank=info.rank,
            world_size=info.world_size,
            local_rank=info.local_rank,
            local_world_size=info.local_world_size,
            device=dev,
            backend=backend,
            launcher=info.launcher,
            info=info,
            timeout_s=timeout_s,
            health_group=health,
            _owns_group=owns,
            _saved_env=saved or {},
        )

    if dist.is_available() and dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
            raise DistError(
                f"a process group exists as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but the launcher says rank {info.rank} of {info.world_size}"
            )
        existing = dist.get_backend()
        timeout = timedelta(seconds=timeout_s)
        health = dist.new_group(backend="gloo", timeout=timeout) if existing != "gloo" else None
        return context(existing, info, owns=False, health=health)
    if info.world_size == 1 and not force_group:
        return context("none", info, owns=False)
    if not dist.is_available():
        raise DistError("this build of torch has no torch.distributed")

    if info.master_addr is None or info.master_port is None:
        if info.launcher == "mpi":
            info = _mpi_rendezvous(info)
        elif info.world_size == 1:
            info = dataclasses.replace(info, master_addr="127.0.0.1", master_port=free_port())
        else:
            raise DistError(
                f"{info.launcher}: rank {info.rank} of {info.world_size} without "
                "MASTER_ADDR/MASTER_PORT; export both to every rank"
            )
    env = {
        "MASTER_ADDR": str(info.master_addr),
        "MASTER_PORT": str(info.master_port),
        "RANK": str(info.rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_world_size),
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    timeout = timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=dev if backend == "nccl" else None,
        )
    except (RuntimeError, ValueError) as err:  # DistStoreError and friends are RuntimeErrors
        _restore_env(saved)
        raise DistError(
            f"rank {info.rank} of {info.world_size} ({info.launcher}) could not join the "
            f"rendezvous at {info.master_addr}:{info.master_port} within {timeout_s:g} s: "
            f"{_first_line(err)}"
        ) from err
    # monitored_barrier, which names missing ranks, exists only in gloo.
    health = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return context(backend, info, owns=True, health=health, saved=saved)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _missing_ranks(message: str) -> list[int]:
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    return [int(r) for r in m.group(1).replace(",", " ").split()] if m else []


def barrier_or_die(ctx: DistContext, what: str, timeout_s: float | None = None) -> None:
    """Waits for every rank; raises a DistError naming those that did not come.

    Rank 0 collects all ranks (gloo's ``monitored_barrier`` with ``wait_all_ranks``);
    the other ranks wait for rank 0's release, so on them the error names rank 0.
    After a failure the process group is unusable: tear down and exit.

    Args:
        ctx: The context from :func:`init_distributed`.
        what: Where the program is, for the message (e.g. ``"epoch 3 batch 10"``).
        timeout_s: How long to wait (default: the context's collective timeout).

    Raises:
        DistError: E.g. ``rank 1 did not answer within 30 s (at 'epoch 3 batch 10')``.
    """
    if not ctx.distributed:
        return
    wait = ctx.timeout_s if timeout_s is None else timeout_s
    try:
        dist.monitored_barrier(
            group=ctx.health_group, timeout=timedelta(seconds=wait), wait_all_ranks=True
        )
    except RuntimeError as err:
        missing = _missing_ranks(str(err))
        if missing:
            who = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
            msg = f"{who} did not answer within {wait:g} s (at {what!r})"
        elif ctx.rank != 0:
            missing = [0]
            msg = (
                f"rank 0 did not release the barrier within {wait:g} s (at {what!r}): it "
                "hung or died, or found another rank missing and names it in its own error "
                f"(rank {ctx.rank}: {_first_line(err)})"
            )
        else:
            msg = f"barrier at {what!r} failed on rank 0: {_first_line(err)}"
        raise DistError(msg, ranks=missing, what=what) from err


# ---------------------------------------------------------------------------
# Small collective helpers (no-ops without a process group)
# ---------------------------------------------------------------------------


def is_main() -> bool:
    """Whether this process is rank 0 (True without a process group)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def allreduce_sum_(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sums ``tensor`` over all ranks in place and returns it."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (small objects: configs, paths)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Self-check of a launch: join, all-reduce, print one line per rank."""
    parser = argparse.ArgumentParser(prog="python -m sven.dist", description=main.__doc__)
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        with init_distributed(args.backend, timeout_s=args.timeout_s, device=args.device) as ctx:
            if ctx.is_main:
                print(ctx.describe(), flush=True)
            total = allreduce_sum_(torch.full((1,), ctx.rank + 1.0, device=ctx.device))
            barrier_or_die(ctx, "sven.dist self-check")
            expected = ctx.world_size * (ctx.world_size + 1) / 2
            print(
                f"rank={ctx.rank} world_size={ctx.world_size} local_rank={ctx.local_rank} "
                f"local_world_size={ctx.local_world_size} launcher={ctx.launcher} "
                f"host={socket.gethostname()} allreduce={total.item():g}",
                flush=True,
            )
            return 0 if total.item() == expected else 1
    except SvenError as err:
        print(f"sven.dist: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
