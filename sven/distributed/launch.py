"""Launchers and the process group: the only part of Sven that knows how it was started.

``sven train`` is the same command on one process and under ``torchrun``, ``srun``
(SLURM) or ``mpirun``/``mpiexec``; this module reads which of them started the process
(:func:`detect_launcher`), brings up ``torch.distributed`` accordingly
(:func:`init_distributed`) and turns a rank that hangs or dies into a
:class:`DistError` that names it (:func:`~sven.distributed.collectives.barrier_or_die`).
Everything else in Sven sees only a :class:`DistContext` and the small helpers of
:mod:`sven.distributed.collectives`.

Launchers, in order of precedence:

- ``torchrun`` (or any env:// setup): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
- ``mpi``: OpenMPI (``OMPI_COMM_WORLD_*``), MVAPICH2 (``MV2_COMM_WORLD_*``),
  MPICH/Hydra and Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
  ``MPI_LOCALNRANKS``), PMIx (``PMIX_RANK``). The rendezvous address comes from
  ``MASTER_ADDR``/``MASTER_PORT`` where exported, else rank 0 broadcasts its
  addresses and a free port through mpi4py and every rank uses the first address at
  which it reaches rank 0 (:func:`host_addresses`).
- ``slurm``: a task of an ``srun`` step (``SLURM_STEP_ID``, ``SLURM_PROCID``,
  ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``); the master is
  the first node of the step's node list, at its ``NodeAddr`` (``scontrol show node``:
  a node's name need not resolve), the port ``10000 + job_id % 20000``, both
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
import contextlib
import dataclasses
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sven.distributed.collectives import DistError, _first_line, allreduce_sum_, barrier_or_die
from sven.distributed.liveness import (
    _DONE,
    _EXIT,
    _FAILED,
    _RUN,
    Diagnosis,
    Liveness,
    _start_liveness,
)
from sven.errors import ConfigError, SvenError

LAUNCHERS = ("torchrun", "slurm", "mpi", "single")
# torch's own default: long enough for rank 0 to finish a checkpoint or an
# evaluation while the others wait at the next collective.
DEFAULT_TIMEOUT_S = 1800.0
#: Under NCCL the process group waits this much longer than ``timeout_s``, so that the
#: heartbeat watchdog (``Liveness.watch``), which names the dead rank, acts before
#: NCCL's own watchdog aborts the process.
NCCL_GRACE_S = 60.0
# srun step ids at or above this are Slurm's special steps (batch script, extern,
# interactive shell of salloc), whose processes are not tasks of a launch.
_SLURM_SPECIAL_STEP = 0xFFFFFFF0


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


def _node_aliases(environ: Mapping[str, str]) -> dict[str, str]:
    """Node name -> address from ``SLURM_NODE_ALIASES`` (``name:addr:host,...``).

    Slurm exports it where addresses are assigned at run time (cloud nodes), the one
    case where ``scontrol`` may not know them yet.
    """
    out = {}
    for item in environ.get("SLURM_NODE_ALIASES", "").split(","):
        # An IPv6 address comes in brackets: n1:[fd00::1]:n1.
        m = re.fullmatch(r"\s*([^:\s]+):(\[[^\]]+\]|[^:]+):.*", item)
        if m:
            out[m.group(1)] = m.group(2).strip("[]")
    return out


def slurm_node_addr(node: str, environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """The address that reaches a SLURM node, and where it was found.

    A node's name (what ``SLURM_JOB_NODELIST`` lists) need not resolve: clusters set
    ``NodeAddr`` where the name is not the address, and so does one machine running
    several ``slurmd -N``. Asks ``SLURM_NODE_ALIASES``, then ``scontrol show node``;
    the name itself is the answer where neither knows better.

    Args:
        node: The node's name, e.g. ``"n1"``.
        environ: The environment (for ``SLURM_NODE_ALIASES``).

    Returns:
        ``(address, source)``, e.g. ``("10.1.0.7", "NodeAddr of n1")`` or
        ``("n1", "node name n1")``.
    """
    alias = _node_aliases(environ).get(node)
    if alias:
        return alias, f"NodeAddr of {node} (SLURM_NODE_ALIASES)"
    if shutil.which("scontrol") is None:
        return node, f"node name {node} (no scontrol to ask for its NodeAddr)"
    try:
        done = subprocess.run(
            ["scontrol", "show", "node", "--oneliner", node],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return node, f"node name {node} (scontrol show node: {err})"
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", done.stdout)
    if done.returncode != 0 or m is None:
        why = (done.stderr.strip().splitlines() or ["no NodeAddr"])[-1]
        return node, f"node name {node} (scontrol show node: {why})"
    addr = m.group(1)
    # NodeAddr defaults to the name: then the name is all there is.
    return addr, f"node name {node}" if addr == node else f"NodeAddr of {node}"


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


def _interface_ipv4(name: str) -> str | None:
    """The IPv4 address of a network interface (Linux ``SIOCGIFADDR``), or None."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except (ImportError, OSError):
        return None  # no address, not Linux, or the interface went away


def host_addresses() -> list[str]:
    """Addresses at which other hosts may reach this one, the likeliest first.

    The IPv4 addresses of its network interfaces other than loopback, then what its
    host name resolves to (which on many hosts is a loopback address, reachable from
    this host only), then the host name itself and ``127.0.0.1``.
    """
    found: list[str] = []
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        addr = _interface_ipv4(name)
        if addr and not addr.startswith("127."):
            found.append(addr)
    host = socket.gethostname()
    try:
        found += socket.gethostbyname_ex(host)[2]
    except OSError:
        pass
    found += [host, "127.0.0.1"]
    return list(dict.fromkeys(found))


def _reaches(addr: str, port: int, token: bytes, timeout_s: float = 2.0) -> bool:
    """Whether rank 0's probe listener answers at ``addr:port`` with ``token``."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s) as conn:
            got = b""
            while len(got) < len(token):
                chunk = conn.recv(len(token) - len(got))
                if not chunk:
                    break
                got += chunk
            return got == token
    except OSError:
        return False


def _mpi_rendezvous(info: LaunchInfo) -> LaunchInfo:
    """Fills in the master address and port: rank 0 offers, every rank probes.

    Rank 0 broadcasts its addresses (:func:`host_addresses`), a free port for the
    store and the port of a probe listener that answers with a random token; every
    rank takes the first address at which the token comes back. A host name alone
    is not enough: on another node it may not resolve, or resolve to that node's
    own loopback address.
    """
    comm = _import_mpi().COMM_WORLD
    rank = comm.Get_rank()
    listener = None
    payload = None
    if rank == 0:
        token = os.urandom(16)
        listener = socket.create_server(("", 0), backlog=128)
        listener.settimeout(0.2)
        stop = threading.Event()

        def answer() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except (TimeoutError, OSError):
                    continue
                with conn:
                    try:
                        conn.sendall(token)
                    except OSError:
                        pass

        thread = threading.Thread(target=answer, name="sven-probe", daemon=True)
        thread.start()
        payload = (host_addresses(), free_port(), listener.getsockname()[1], token)
    candidates, port, probe_port, token = comm.bcast(payload, root=0)
    try:
        if rank == 0:
            mine: str | None = candidates[0]
        else:
            mine = next((a for a in candidates if _reaches(a, probe_port, token)), None)
        chosen = comm.allgather(mine)
    finally:
        if listener is not None:
            stop.set()
            thread.join(timeout=5)
            listener.close()
    lost = [r for r, a in enumerate(chosen) if a is None]
    if lost:
        who = ("rank " if len(lost) == 1 else "ranks ") + ", ".join(map(str, lost))
        raise DistError(
            f"mpi: {who} reached rank 0 at none of its addresses {candidates}; export "
            "MASTER_ADDR (an address of rank 0's host that every rank reaches) and "
            "MASTER_PORT to every rank (mpirun -x MASTER_ADDR -x MASTER_PORT)"
        )
    if rank == 0:
        # Rank 0 reaches itself anywhere: take the address most ranks took, for the log.
        others = chosen[1:] or [mine]
        mine = max(dict.fromkeys(others), key=others.count)
    return dataclasses.replace(
        info, master_addr=mine, master_port=port, master_from="rank 0's address, probed"
    )


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
        ctx = context(existing, info, owns=False, health=health)
        ctx.liveness = _start_liveness(info.rank, info.world_size, timeout_s)
        return ctx
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
            f"rendezvous at {where} within {timeout_s:g} s: {_first_line(err)}"
        ) from err
    # monitored_barrier, which names missing ranks, exists only in gloo.
    health = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    ctx = context(backend, info, owns=True, health=health, saved=saved)
    ctx.liveness = _start_liveness(info.rank, info.world_size, timeout_s)
    if backend == "nccl" and ctx.liveness is not None:
        # A dead peer blocks an NCCL rank in a host sync, out of Python's reach, until
        # NCCL's watchdog aborts it (NCCL_GRACE_S after the timeout) without naming
        # anyone; the heartbeat thread names the rank and ends it first.
        ctx.liveness.watch(timeout_s, ctx._on_stall)
    return ctx


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


# ---------------------------------------------------------------------------
# Native output: a log file, not the terminal
# ---------------------------------------------------------------------------


@dataclass
class NativeLog:
    """Where :func:`native_stderr_to` sends native stderr; see :meth:`written`.

    Attributes:
        path: The log file.
        mark: Its size after this process's header line; -1 where it could not be
            opened (nothing is redirected then).
    """

    path: Path
    mark: int

    def written(self) -> bool:
        """Whether native code wrote anything since the header (never without a log)."""
        if self.mark < 0:
            return False
        try:
            return self.path.stat().st_size > self.mark
        except OSError:
            return False


@contextlib.contextmanager
def native_stderr_to(path: str | Path, header: str = "") -> Iterator[NativeLog]:
    """Sends what native code writes to stderr to ``path``; Python's ``sys.stderr`` stays.

    torch's C++ side (the TCPStore client, gloo, c10d) logs each failed connection to
    file descriptor 2, often with a dump of C++ frames: a failed rendezvous, a dead
    peer or a lost store would bury the one line that says what happened. Inside this
    context descriptor 2 is the log file (appended to, after a line with
    ``header``), while ``sys.stderr``, and with it Sven's messages, progress bars
    and Python tracebacks, still writes where stderr went before. A log that got
    nothing but the header is taken back on exit.

    The copy of the old stderr that ``sys.stderr`` wrote to inside the context stays
    open (one descriptor per use): objects that kept that stream, such as a progress
    bar, may still write to it afterwards.

    Args:
        path: The log file; its folder is created.
        header: Written first (with the time), e.g. ``"rank 1 of 2 on node n2"``.

    Yields:
        The log (:meth:`NativeLog.written` says whether it holds anything).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        start = path.stat().st_size if existed else 0
        line = f"== {datetime.now().isoformat(timespec='seconds')} pid {os.getpid()} {header}\n"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        # No log where it cannot be written (the run fails there later, saying why);
        # the C++ output then stays on the terminal.
        yield NativeLog(path, -1)
        return
    try:
        os.write(fd, line.encode())
        log = NativeLog(path, start + len(line.encode()))
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    before = sys.stderr
    sys.stderr = io.TextIOWrapper(
        io.FileIO(saved, "w", closefd=False),
        encoding=getattr(before, "encoding", None) or "utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    try:
        yield log
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        sys.stderr = before
        os.dup2(saved, 2)
        if not log.written():
            with contextlib.suppress(OSError):
                if existed:
                    os.truncate(path, start)
                else:
                    path.unlink()
                    # Only where empty: other ranks' logs may be in it.
                    path.parent.rmdir()


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
            # A host tensor too: under NCCL it must find the group's gloo side.
            host = allreduce_sum_(torch.full((1,), ctx.rank + 1.0))
            barrier_or_die(ctx, "sven.dist self-check")
            expected = ctx.world_size * (ctx.world_size + 1) / 2
            print(
                f"rank={ctx.rank} world_size={ctx.world_size} local_rank={ctx.local_rank} "
                f"local_world_size={ctx.local_world_size} launcher={ctx.launcher} "
                f"host={socket.gethostname()} allreduce={total.item():g}",
                flush=True,
            )
            return 0 if total.item() == host.item() == expected else 1
    except SvenError as err:
        print(f"sven.dist: error: {err}", file=sys.stderr)
        return err.exit_code
