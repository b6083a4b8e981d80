"""The process group: joining the job (:func:`init_distributed`), this rank's device,
and the :class:`DistContext` that holds the group's lifetime.

Everything else in Sven sees only a :class:`DistContext` and the small helpers of
:mod:`sven.distributed.collectives`; a rank that hangs or dies becomes a
:class:`~sven.distributed.collectives.DistError` that names it
(:func:`~sven.distributed.collectives.barrier_or_die`, the heartbeats of
:mod:`sven.distributed.liveness`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from sven.distributed.collectives import barrier_or_die
from sven.distributed.errors import DistError
from sven.distributed.launcher import LaunchInfo, detect_launcher
from sven.distributed.liveness import (
    _DONE,
    _EXIT,
    _FAILED,
    _RUN,
    Diagnosis,
    Liveness,
    _start_liveness,
)
from sven.distributed.rendezvous import _mpi_rendezvous, free_port
from sven.errors import ConfigError, first_line

# torch's own default: long enough for rank 0 to finish a checkpoint or an
# evaluation while the others wait at the next collective.
DEFAULT_TIMEOUT_S = 1800.0
#: Under NCCL the process group waits this much longer than ``timeout_s``, so that the
#: heartbeat watchdog (``Liveness.watch``), which names the dead rank, acts before
#: NCCL's own watchdog aborts the process.
NCCL_GRACE_S = 60.0


def existing_devices() -> list[str]:
    """The devices this process can use: ``cpu`` and ``cuda:0`` .. ``cuda:n-1``."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(f"cuda:{i}" for i in range(n))]


def _pick_device(device: str | torch.device, info: LaunchInfo) -> torch.device:
    """This rank's device: ``auto`` is CUDA where available, and plain ``cuda`` (or
    ``auto`` on a GPU node) is ``cuda:<local_rank>``, one GPU per rank.

    Raises:
        ConfigError: A device that is not a device name, or that this machine lacks
            (the message lists the devices that exist).
    """
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"train.device={device}: not a device; use auto, cpu, cuda or cuda:N "
            f"(this machine has {', '.join(existing_devices())})"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"train.device={device}: Sven runs on cpu or cuda, not {dev.type}")
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available() or (
        dev.index is not None and dev.index >= torch.cuda.device_count()
    ):
        raise ConfigError(
            f"train.device={device}, but this machine has only {', '.join(existing_devices())}"
        )
    if dev.index is not None:
        return dev
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
        liveness: This rank's heartbeat in the rendezvous store (None on one process,
            or where the rendezvous is not a TCPStore).
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
    liveness: Liveness | None = field(default=None, repr=False)
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
            if self.info.master_from:
                line += f" ({self.info.master_from})"
        return line

    def barrier(self, what: str, timeout_s: float | None = None) -> None:
        """:func:`barrier_or_die` on this context."""
        barrier_or_die(self, what, timeout_s)

    def label(self, rank: int) -> str:
        """``"rank R"``, with its node where the job spans several (for messages)."""
        lv = self.liveness
        if lv is None:
            return f"rank {rank}"
        if rank not in lv.nodes:
            lv.read_nodes()
        return lv.label(rank)

    def set_step(self, step: int) -> None:
        """Records the training step this rank starts, for its heartbeat (no I/O)."""
        if self.liveness is not None:
            self.liveness.step = step

    def diagnose_failure(self) -> Diagnosis:
        """After a collective failed: who is missing, from the ranks' heartbeats.

        Says "failed" in this rank's heartbeat (so the others do not name it), destroys
        the process group this context created (which breaks the collectives that other
        survivors wait in, so that they find out now rather than at their timeout),
        reads the heartbeats for a few intervals (:meth:`Liveness.diagnose`) and posts
        the verdict. Takes about ``2.5 * heartbeat_interval(timeout_s)`` seconds.

        Returns:
            The diagnosis (empty without heartbeats).
        """
        lv = self.liveness
        if lv is not None:
            lv.mark(_FAILED)
        self._abort_group()
        if lv is None:
            return Diagnosis()
        diag = lv.diagnose()
        lv.mark(_DONE, diag.ranks)
        return diag

    def _on_stall(self, diag: Diagnosis, seconds: float) -> None:
        """Ends a rank blocked by a dead peer (heartbeat thread; see Liveness.watch)."""
        step = self.liveness.step if self.liveness is not None else -1
        print(
            f"sven: error: rank {self.rank}: no progress for {seconds:.0f} s at step {step} "
            f"(a {self.backend} collective did not complete); {diag.reason}. The last "
            "complete checkpoint is intact: rerun with train.resume=true",
            file=sys.stderr,
            flush=True,
        )
        # The main thread is blocked in the device runtime: nothing but an exit ends it.
        os._exit(DistError.exit_code)

    def record_failure(self, ranks: Sequence[int]) -> None:
        """Posts a verdict found otherwise (e.g. by ``monitored_barrier``) and aborts."""
        if self.liveness is not None:
            self.liveness.mark(_DONE, ranks)
        self._abort_group()

    def _abort_group(self) -> None:
        if self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass  # already broken; the exit that follows frees what is left

    def teardown(self) -> None:
        """Destroys the process group this context created; safe to call twice.

        Stops the heartbeat. The rank hosting the rendezvous store first waits (a few
        seconds at most) until the other ranks are done with that store: after a
        failure, until they know its verdict; else until they wrote their last beat.
        Also puts back the env:// variables that :func:`init_distributed` set, so a
        later launch detection in this process is not misled by them.
        """
        lv = self.liveness
        if lv is not None and lv.state == _RUN:
            # Before the group goes: a rank that fails on it then reads that this one
            # left rather than that it hangs.
            lv.mark(_EXIT)
        self._abort_group()
        self._owns_group = False
        if lv is not None:
            lv.linger(skip=lv.blame)
            lv.stop()
            self.liveness = None
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
    library that reads them), pins ``cuda:<local_rank>`` under NCCL (whose default
    group also carries gloo for CPU tensors, see :func:`group_backend`), and under NCCL
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
    backend = _check_backend(backend, dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_available() and dist.is_initialized():
        return _adopt_group(info, dev, timeout_s)
    if info.world_size == 1 and not force_group:
        return _context("none", info, dev, timeout_s, owns=False)
    if not dist.is_available():
        raise DistError("this build of torch has no torch.distributed")
    info = _with_rendezvous(info)
    saved = _join_group(backend, info, dev, timeout_s)
    # monitored_barrier, which names missing ranks, exists only in gloo.
    timeout = timedelta(seconds=timeout_s)
    health = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    ctx = _context(backend, info, dev, timeout_s, owns=True, health=health, saved=saved)
    ctx.liveness = _start_liveness(info.rank, info.world_size, timeout_s)
    if backend == "nccl" and ctx.liveness is not None:
        # A dead peer blocks an NCCL rank in a host sync, out of Python's reach, until
        # NCCL's watchdog aborts it (NCCL_GRACE_S after the timeout) without naming
        # anyone; the heartbeat thread names the rank and ends it first.
        ctx.liveness.watch(timeout_s, ctx._on_stall)
    return ctx


def _check_backend(backend: str, dev: torch.device) -> str:
    """The backend ``backend`` means on ``dev``: ``"auto"`` is NCCL on CUDA, gloo
    otherwise.

    Raises:
        DistError: An unknown backend, or NCCL on a device that is not CUDA.
    """
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend not in ("nccl", "gloo"):
        raise DistError(f"unknown backend {backend!r}; expected 'auto', 'nccl' or 'gloo'")
    if backend == "nccl" and dev.type != "cuda":
        raise DistError(f"backend 'nccl' needs a CUDA device, got {dev}")
    return backend


def _context(
    backend: str,
    info: LaunchInfo,
    dev: torch.device,
    timeout_s: float,
    *,
    owns: bool,
    health: dist.ProcessGroup | None = None,
    saved: dict[str, str | None] | None = None,
) -> DistContext:
    """The context of this rank as ``info`` describes it.

    Args:
        backend: The group's backend, ``"none"`` without a group.
        info: The launch.
        dev: This rank's device.
        timeout_s: Timeout of every collective, seconds.
        owns: Whether the context made the group (and so ends it on teardown).
        health: The gloo group for :func:`barrier_or_die`, where the group is not gloo.
        saved: The environment variables the rendezvous set, as they were before.
    """
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


def _adopt_group(info: LaunchInfo, dev: torch.device, timeout_s: float) -> DistContext:
    """The context over a process group that exists already (a test harness made it),
    which teardown leaves alone.

    Raises:
        DistError: The group's rank or size is not the launcher's.
    """
    if (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
        raise DistError(
            f"a process group exists as rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"but the launcher says rank {info.rank} of {info.world_size}"
        )
    existing = dist.get_backend()
    timeout = timedelta(seconds=timeout_s)
    health = dist.new_group(backend="gloo", timeout=timeout) if existing != "gloo" else None
    ctx = _context(existing, info, dev, timeout_s, owns=False, health=health)
    ctx.liveness = _start_liveness(info.rank, info.world_size, timeout_s)
    return ctx


def _with_rendezvous(info: LaunchInfo) -> LaunchInfo:
    """``info`` with the rendezvous address: the launch's own, the one MPI ranks agree
    on, or a free local port for a world of one.

    Raises:
        DistError: A multi-rank launch without ``MASTER_ADDR``/``MASTER_PORT``.
    """
    if info.master_addr is not None and info.master_port is not None:
        return info
    if info.launcher == "mpi":
        return _mpi_rendezvous(info)
    if info.world_size == 1:
        return dataclasses.replace(info, master_addr="127.0.0.1", master_port=free_port())
    raise DistError(
        f"{info.launcher}: rank {info.rank} of {info.world_size} without "
        "MASTER_ADDR/MASTER_PORT; export both to every rank"
    )


def _rendezvous_host(info: LaunchInfo) -> str:
    """``host:port`` of the rendezvous (and where it came from), for messages.

    Raises:
        DistError: The host does not resolve.
    """
    where = f"{info.master_addr}:{info.master_port}"
    if info.master_from:
        where += f" ({info.master_from})"
    try:
        socket.getaddrinfo(info.master_addr, info.master_port, type=socket.SOCK_STREAM)
    except OSError as err:
        # The store client would retry a name that does not resolve until the timeout.
        raise DistError(
            f"rank {info.rank} of {info.world_size} ({info.launcher}): the rendezvous host "
            f"{where} does not resolve ({err.strerror or err}); export MASTER_ADDR, an "
            "address of rank 0's node that every node reaches"
        ) from None
    return where


def _join_group(
    backend: str, info: LaunchInfo, dev: torch.device, timeout_s: float
) -> dict[str, str | None]:
    """Creates the default process group through the env:// rendezvous.

    Sets the launch variables in ``os.environ`` first (and puts them back on failure).

    Returns:
        Those variables as they were before, for teardown to put back.

    Raises:
        DistError: The host does not resolve, or the rendezvous did not complete within
            ``timeout_s``.
    """
    where = _rendezvous_host(info)
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
            group_backend(backend),
            init_method="env://",
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout + timedelta(seconds=NCCL_GRACE_S) if backend == "nccl" else timeout,
            device_id=dev if backend == "nccl" else None,
        )
    except (RuntimeError, ValueError) as err:  # DistStoreError and friends are RuntimeErrors
        _restore_env(saved)
        raise DistError(
            f"rank {info.rank} of {info.world_size} ({info.launcher}) could not join the "
            f"rendezvous at {where} within {timeout_s:g} s: {first_line(err)}"
        ) from err
    return saved


def group_backend(backend: str) -> str:
    """The backend string of the default process group for ``backend``.

    NCCL moves CUDA tensors only: a collective on a CPU tensor (rank 0's partition
    arrays, a counter built on the host) fails in a group that is NCCL alone ("No
    backend type associated with device type cpu"). Under NCCL the group therefore
    carries gloo for CPU tensors too, and each collective goes where its tensor lives;
    object collectives (``broadcast_object_list``) then travel through gloo without a
    round trip through the GPU.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
