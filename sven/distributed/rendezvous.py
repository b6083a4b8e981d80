"""The rendezvous address where the launcher does not give one: this host's addresses,
a free port, and the MPI probe by which every rank finds an address of rank 0's host
that it reaches (:func:`_mpi_rendezvous`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading

from sven.distributed.errors import DistError
from sven.distributed.launcher import LaunchInfo, _import_mpi


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
