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
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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


# ---------------------------------------------------------------------------
# Liveness: heartbeats in the rendezvous store, read after a failure
# ---------------------------------------------------------------------------

# Rank states a heartbeat carries. "failed": saw a collective fail, is finding out who
# is missing; "done": posted its verdict; "exit": tore down without having seen a
# failure (a rank that raised an error of its own, or left early).
_RUN, _FAILED, _DONE, _EXIT = "run", "failed", "done", "exit"


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat as stored under ``sven/liveness/<attempt>/<rank>``.

    Attributes:
        step: The training step the rank last started (:meth:`DistContext.set_step`).
        wall: The rank's wall clock (``time.time()``) when it wrote this beat.
        seq: Beats written so far; it advances every interval while the process lives.
        state: ``"run"``, ``"failed"``, ``"done"`` or ``"exit"``.
        blame: The ranks this rank found missing (its verdict, with ``"done"``).
        seen: The ``seq`` of the store host's beat this rank read last (-1: none).
        node: The node the rank runs on (SLURM's node name, else the host name), so
            that an error can say where a lost rank was; empty where unknown.
    """

    step: int
    wall: float
    seq: int
    state: str = _RUN
    blame: tuple[int, ...] = ()
    seen: int = -1
    node: str = ""

    def encode(self) -> str:
        """The stored text: ``"<step> <wall> <seq> <state> <blame,...|-> <seen> <node|->"``."""
        blame = ",".join(map(str, self.blame)) or "-"
        node = "".join(self.node.split()) or "-"
        return f"{self.step} {self.wall:.3f} {self.seq} {self.state} {blame} {self.seen} {node}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Beat:
        """Parses :meth:`encode`'s text."""
        text = raw.decode() if isinstance(raw, bytes) else raw
        step, wall, seq, state, blame, seen, node = text.split()
        ranks = () if blame == "-" else tuple(int(r) for r in blame.split(","))
        return cls(
            int(step), float(wall), int(seq), state, ranks, int(seen), "" if node == "-" else node
        )


@dataclass(frozen=True)
class Diagnosis:
    """Who is missing after a collective failed, as far as the heartbeats tell.

    Attributes:
        ranks: The ranks found dead, hung or gone (empty: none could be named).
        reason: One clause per rank, e.g. ``"rank 2 died or hung (no heartbeat for
            24 s; last at step 40)"``; empty when ``ranks`` is.
    """

    ranks: tuple[int, ...] = ()
    reason: str = ""


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between two heartbeats: ``min(2, timeout_s / 5)``.

    Short enough that a diagnosis (a few intervals) fits well inside the collective
    timeout, long enough to cost nothing (one small store write per interval).
    """
    return min(2.0, timeout_s / 5.0)


class Liveness:
    """A daemon thread writing this rank's :class:`Beat` to the rendezvous store.

    The store is the TCPStore of the process group's rendezvous: hosted by rank 0
    under a plain env:// launch (srun, mpirun, a hand-made one), by the torchrun agent
    under torchrun. Every rank can reach it as long as its host lives, and the host
    is the one thing a reader that cannot reach it needs to name. The main thread
    only sets :attr:`step` (an int attribute; no collective, no I/O); the thread
    writes on its own connection every ``interval_s`` and whenever the state changes.

    After a collective failed, :meth:`diagnose` reads every rank's beats for a few
    intervals and names the ranks whose beats stopped (dead, or frozen by SIGSTOP),
    that left, or that are alive but behind the others' step (hung in Python).

    Each beat also reads the host rank's beat (one key), so that its verdict is known
    here even when the host has ended before this rank could ask: a rank waiting in
    ``monitored_barrier`` for rank 0's release learns that rank 0 failed only when
    rank 0's process exits, taking the store with it.

    Args:
        rank: This rank.
        world_size: Number of ranks.
        host: The store's host.
        port: The store's port.
        host_rank: The rank whose process hosts the store, or None (torchrun's agent).
        interval_s: Seconds between beats.
        prefix: Key prefix (one per start of the job, so a restarted torchrun attempt
            does not read the beats of the previous one).
        server: On the host rank, the store object; holding it keeps the server up
            after the process group is destroyed, while the others still read.
        clock: Monotonic seconds for the diagnosis window and the stall watchdog.
        sleep: Waits between two reads of the diagnosis. Tests pass a clock that
            advances only in ``sleep`` (which also writes the peers' beats), so that
            their verdicts do not depend on how loaded the machine is.
        node: The node this rank runs on, carried in its beats (:attr:`Beat.node`).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        *,
        host_rank: int | None,
        interval_s: float,
        prefix: str = "sven/liveness",
        server: Any = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        node: str = "",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.port = port
        self.host_rank = host_rank
        self.interval_s = interval_s
        self.prefix = prefix
        self.step = 0
        self.state = _RUN
        self.blame: tuple[int, ...] = ()
        self.store_error: str | None = None
        self.host_beat: Beat | None = None
        self.node = node
        # Rank -> node, from the beats read so far (for the messages, see label()).
        self.nodes: dict[int, str] = {rank: node} if node else {}
        self._server = server
        self._clock = clock
        self._sleep = sleep
        # seq of this (host) rank's first beat that carried its verdict.
        self._verdict_seq: int | None = None
        self._seq = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # (stall seconds, callback) of :meth:`watch`, or None.
        self._stall: tuple[float, Callable[[Diagnosis, float], None]] | None = None

    def watch(self, stall_s: float, on_stall: Callable[[Diagnosis, float], None]) -> None:
        """Has the heartbeat thread act when this rank stops making progress.

        For backends where a dead peer leaves this rank blocked outside Python: under
        NCCL a collective that never completes blocks the next host sync, and NCCL's
        own watchdog later ends the process with an abort that names nobody. When
        :attr:`step` has not changed for ``stall_s`` seconds, the thread diagnoses;
        if that names a rank, it posts the verdict and calls ``on_stall(diagnosis,
        seconds stalled)``, which should end the process. Ranks that are slow together
        (a long evaluation, a checkpoint) are named by nobody and go on.

        Args:
            stall_s: Seconds without a new step before the thread looks.
            on_stall: Called from the heartbeat thread with the diagnosis.
        """
        self._stall = (stall_s, on_stall)

    def _check_stall(self, progress: list[float | int], diagnose: Callable[[], Diagnosis]) -> bool:
        """One watchdog look (heartbeat thread); ``progress`` is ``[step, since]``.

        Args:
            progress: The step last seen and since when (monotonic), updated here.
            diagnose: Who to blame once stalled (the heartbeats, or the lost store).

        Returns:
            True when ``on_stall`` was called (the thread then ends).
        """
        if self._stall is None or self.state != _RUN:
            return False
        now = self._clock()
        if self.step != progress[0]:
            progress[0], progress[1] = self.step, now
            return False
        if now - progress[1] <= self._stall[0]:
            return False
        diag = diagnose()
        if not diag.ranks:
            progress[1] = self._clock()
            return False
        self.state, self.blame = _DONE, diag.ranks
        if self.store_error is None:
            self._post_verdict()
            self.linger(skip=diag.ranks)
        self._stall[1](diag, self._clock() - progress[1])
        return True

    def _post_verdict(self) -> None:
        """Writes this rank's ``done`` beat with its verdict, from the calling thread."""
        try:
            client = self._connect(max(2 * self.interval_s, 1.0))
            beat = Beat(self.step, time.time(), self._seq, _DONE, self.blame, node=self.node)
            client.set(self.key(self.rank), beat.encode())
            self._verdict_seq = self._seq
            self._seq += 1
        except RuntimeError:
            pass  # the store is gone: nobody can read a verdict anyway

    @property
    def window_s(self) -> float:
        """How long :meth:`diagnose` watches for beats: a live rank writes twice in it."""
        return 2.5 * self.interval_s + 0.5

    def key(self, rank: int) -> str:
        """The store key of ``rank``'s beat."""
        return f"{self.prefix}/{rank}"

    def _connect(self, timeout_s: float) -> dist.TCPStore:
        return dist.TCPStore(
            self.host,
            self.port,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def start(self) -> None:
        """Starts the heartbeat thread (it writes its first beat at once)."""
        self._thread = threading.Thread(target=self._run, name="sven-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        progress: list[float | int] = [self.step, self._clock()]
        try:
            client = self._connect(max(2 * self.interval_s, 1.0))
            host_key = None
            if self.host_rank is not None and self.host_rank != self.rank:
                host_key = self.key(self.host_rank)
            while True:
                stopping = self._stop.is_set()
                seen = -1 if self.host_beat is None else self.host_beat.seq
                state = self.state
                beat = Beat(self.step, time.time(), self._seq, state, self.blame, seen, self.node)
                client.set(self.key(self.rank), beat.encode())
                if state == _DONE and self._verdict_seq is None:
                    self._verdict_seq = self._seq
                self._seq += 1
                if host_key is not None and client.check([host_key]):
                    self.host_beat = Beat.decode(client.get(host_key))
                    self._note_node(self.host_rank, self.host_beat)
                if stopping or self._check_stall(progress, lambda: self.diagnose(failed=False)):
                    return
                self._wake.wait(self.interval_s)
                self._wake.clear()
        except RuntimeError as err:  # DistStoreError, DistNetworkError
            # The store's host is gone: the job is failing anyway, and retrying would
            # only fill the log with the store client's warnings.
            self.store_error = _first_line(err)
        # Watching, the thread still ends a rank that stalls with its store gone.
        lost = self.store_error or ""
        while self._stall is not None and self.state == _RUN and not self._stop.is_set():
            if self._check_stall(progress, lambda: self._store_gone(lost)):
                return
            self._stop.wait(self.interval_s)

    def mark(self, state: str, blame: Sequence[int] = ()) -> None:
        """Sets this rank's state (and verdict) and has the thread write it now."""
        self.state, self.blame = state, tuple(blame)
        self._wake.set()

    def stop(self) -> None:
        """Writes a last beat (state ``"exit"`` unless a failure was seen) and joins."""
        if self.state == _RUN:
            self.state = _EXIT
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            # Bounded: a frozen store host would otherwise hold the exit up.
            self._thread.join(timeout=max(2 * self.interval_s, 1.0) + 1.0)
            self._thread = None
        self._server = None

    def _read(self, client: dist.TCPStore) -> dict[int, Beat | None]:
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [self.key(r) for r in others]
        if client.check(keys):
            present = dict(zip(others, client.multi_get(keys)))
        else:
            present = {r: client.get(k) for r, k in zip(others, keys) if client.check([k])}
        beats = {r: Beat.decode(present[r]) if r in present else None for r in others}
        for r, b in beats.items():
            self._note_node(r, b)
        return beats

    def _note_node(self, rank: int | None, beat: Beat | None) -> None:
        if rank is not None and beat is not None and beat.node:
            self.nodes[rank] = beat.node

    def label(self, rank: int) -> str:
        """``"rank R"``, with ``" (node N)"`` where the job spans several nodes.

        Only the nodes of the beats read so far are known; a job whose known ranks
        all run on one node names none.
        """
        node = self.nodes.get(rank)
        if node and len(set(self.nodes.values())) > 1:
            return f"rank {rank} (node {node})"
        return f"rank {rank}"

    def read_nodes(self) -> None:
        """Reads every rank's beat once, to learn their nodes (for :meth:`label`)."""
        if self.store_error is not None:
            return
        try:
            self._read(self._connect(min(self.window_s, 5.0)))
        except RuntimeError:
            pass  # the store is gone: the labels keep what was known

    def _store_gone(self, err: BaseException | str) -> Diagnosis:
        text = err if isinstance(err, str) else _first_line(err)
        where = f"{self.host}:{self.port}"
        if self.host_rank is None:
            return Diagnosis((), f"the rendezvous store at {where} does not answer ({text})")
        if self.host_rank == self.rank:
            return Diagnosis()
        host = self.host_beat
        if host is not None and host.state == _DONE:
            # The host posted a verdict, then ended (as it does after a failure).
            ranks = tuple(r for r in host.blame if r != self.rank)
            if ranks:
                return Diagnosis(
                    ranks,
                    "; ".join(
                        f"{self.label(r)} did not answer ({self.label(self.host_rank)} says)"
                        for r in ranks
                    ),
                )
        return Diagnosis(
            (self.host_rank,),
            f"{self.label(self.host_rank)} died or hung (the rendezvous store it hosts at {where} "
            "does not answer)",
        )

    def diagnose(self, failed: bool = True) -> Diagnosis:
        """Names the ranks that are gone, from their beats over :attr:`window_s`.

        A rank is named when its beats stop advancing (dead, or frozen), when it is
        missing or has left (state ``"exit"``), or when it is alive but its step is
        behind the highest one (hung in Python); a rank that saw the failure itself
        is a survivor. Without such a rank, the verdicts the other survivors posted
        are used, then (``failed``: a collective is known to have failed) the live
        ranks that never saw the failure.

        Args:
            failed: Whether a collective failed; the watchdog, which only sees a
                stall, passes False so that live ranks stalled alike are not named.

        Returns:
            The diagnosis; an unreachable store names its host rank.
        """
        if self.store_error is not None:
            # The heartbeat thread already lost the store (its host closed it).
            return self._store_gone(self.store_error)
        try:
            # A plain connect first: the store client retries a refused connection until
            # its timeout, logging a stack trace on every try.
            with socket.create_connection((self.host, self.port), timeout=2.0):
                pass
        except OSError as err:
            return self._store_gone(str(err))
        try:
            client = self._connect(min(self.window_s, 5.0))
            first = self._read(client)
            deadline = self._clock() + self.window_s
            cur = first
            while self._clock() < deadline:
                # A survivor says so at once; a dead rank only by the silence of a window.
                if all(b is not None and b.state != _RUN for b in cur.values()):
                    break
                self._sleep(min(0.25, self.interval_s / 2))
                cur = self._read(client)
        except RuntimeError as err:
            return self._store_gone(err)
        now = time.time()

        def alive(r: int, b: Beat) -> bool:
            # A survivor says so; a rank still running proves it lives by a new beat.
            if b.state in (_FAILED, _DONE):
                return True
            before = first[r]
            return b.state == _RUN and before is not None and b.seq != before.seq

        live = {r: b for r, b in cur.items() if b is not None and alive(r, b)}
        top = max([self.step, *(b.step for b in live.values())])
        named: dict[int, str] = {}
        for r, b in cur.items():
            if b is None:
                named[r] = f"{self.label(r)} died or hung (it never wrote a heartbeat)"
            elif b.state == _EXIT:
                named[r] = f"{self.label(r)} left the job (its process ended; see its log)"
            elif r not in live:
                age = max(now - b.wall, 0.0)
                named[r] = (
                    f"{self.label(r)} died or hung (no heartbeat for {age:.0f} s; last at "
                    f"step {b.step})"
                )
            elif b.state == _RUN and b.step < top:
                named[r] = (
                    f"{self.label(r)} hung (alive, but at step {b.step} while others reached {top})"
                )
        if not named:
            # Nothing to see from here (e.g. the missing rank came back): trust a survivor
            # that saw more, then the live ranks that never saw the failure.
            for q, b in cur.items():
                if b is not None and b.state == _DONE:
                    for r in b.blame:
                        if r != self.rank:
                            named.setdefault(
                                r, f"{self.label(r)} did not answer ({self.label(q)} says)"
                            )
        if not named and failed:
            named = {
                r: f"{self.label(r)} did not answer (alive, but it did not see the failure: hung?)"
                for r, b in live.items()
                if b.state == _RUN
            }
        ranks = tuple(sorted(named))
        return Diagnosis(ranks, "; ".join(named[r] for r in ranks))

    def linger(self, skip: Sequence[int] = ()) -> None:
        """On the store's host: waits until the other ranks are done with the store.

        The store ends with this process. After a failure the survivors' diagnosis
        reads it, and exiting at once would make them name this rank instead of the
        missing one: wait until each has posted its verdict or read this rank's. At a
        normal end, wait until each has written its last beat, so that none of their
        heartbeat threads meets a closed store. Two diagnosis windows at most.
        """
        if self.host_rank != self.rank or self._server is None:
            return
        others = [r for r in range(self.world_size) if r != self.rank and r not in skip]
        deadline = time.monotonic() + 2 * self.window_s + 2.0
        failed = self.state in (_FAILED, _DONE)

        def informed(b: Beat | None) -> bool:
            if b is None:
                return False
            mine = self._verdict_seq
            if b.state in (_DONE, _EXIT):
                return True
            return failed and mine is not None and b.seen >= mine

        try:
            client = self._connect(min(self.window_s, 5.0))
            while time.monotonic() < deadline:
                beats = self._read(client)
                if all(informed(beats[r]) for r in others):
                    return
                time.sleep(0.1)
        except RuntimeError:
            return


def _store_address() -> tuple[str, int, Any] | None:
    """(host, port, store) of the default group's rendezvous TCPStore, if it is one."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    return store.host, int(store.port), store


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    """The node this process runs on: SLURM's name for it, else the short host name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _start_liveness(rank: int, world_size: int, timeout_s: float) -> Liveness | None:
    """A started :class:`Liveness` on the default group's store, or None without one."""
    if world_size < 2:
        return None
    found = _store_address()
    if found is None:
        return None
    host, port, store = found
    # torchrun's workers join the agent's store (TORCHELASTIC_USE_AGENT_STORE); every
    # other env:// rendezvous runs the store's server inside rank 0.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host_rank = None if agent else 0
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    live = Liveness(
        rank,
        world_size,
        host,
        port,
        host_rank=host_rank,
        interval_s=heartbeat_interval(timeout_s),
        prefix=f"sven/liveness/{attempt}",
        server=store if host_rank == rank else None,
        node=node_name(),
    )
    live.start()
    return live


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


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _missing_ranks(message: str) -> list[int]:
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    return [int(r) for r in m.group(1).replace(",", " ").split()] if m else []


def barrier_or_die(ctx: DistContext, what: str, timeout_s: float | None = None) -> None:
    """Waits for every rank; raises a DistError naming those that did not come.

    Rank 0 collects all ranks (gloo's ``monitored_barrier`` with ``wait_all_ranks``),
    which names the missing ones; the other ranks wait for rank 0's release and, when
    it does not come, name the ranks whose heartbeats say they are gone
    (:meth:`DistContext.diagnose_failure`), else rank 0. After a failure the process
    group is destroyed: tear down and exit.

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
            ctx.record_failure(missing)
            labels = [ctx.label(r) for r in missing]
            if labels == [f"rank {r}" for r in missing]:
                labels = [
                    ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
                ]
            who = ", ".join(labels)
            msg = f"{who} did not answer within {wait:g} s (at {what!r})"
        elif (diag := ctx.diagnose_failure()).ranks:
            # Only rank 0's monitored_barrier sees who is missing; the others ask the
            # heartbeats rather than blame rank 0 for not releasing them.
            missing = list(diag.ranks)
            msg = f"{diag.reason} (at {what!r}, a barrier of {wait:g} s)"
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


if __name__ == "__main__":
    sys.exit(main())
