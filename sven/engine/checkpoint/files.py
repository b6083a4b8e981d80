"""Writing the files of a checkpoint: ``.npy`` files in parallel chunks, small files.

A node-state field is written as one ``.npy`` file created at its full size; a pool of
threads then writes it in pieces of :func:`~sven.engine.checkpoint.format.work_size`
bytes, each ``os.pwrite`` at its offset straight from the tensor's memory (CPU, pinned, or a memory
map), or, for a CUDA tensor, through a pinned buffer of a few megabytes per thread on a
side stream: never a full second copy in host memory. Each thread hashes what it writes,
chunk by chunk (hashlib releases the GIL on large buffers), so nothing is read back to be
hashed; a node-state file's chunk sums are written with it
(:mod:`~sven.engine.checkpoint.format`).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sven.engine.capture import CUDA_SIDE_WORK
from sven.engine.checkpoint import format as fmt
from sven.engine.checkpoint.format import (
    NODE_DIR,
    ChunkHasher,
    bytes_digest,
    combine,
    default_threads,
    npy_header,
    numpy_dtype,
    sums_rel,
    work_size,
)

__all__ = [
    "Npy",
    "WriterPool",
    "check_room",
    "create_npy",
    "narrow_owner",
    "sync_and_drop",
    "write_file",
    "write_npys",
]

#: Free space a checkpoint leaves on its file system (for the run's other files).
_MARGIN = 16 << 20
#: Bytes a thread copies from a CUDA tensor at a time (its pinned buffer).
_BOUNCE = 16 << 20
_local = threading.local()


class WriterPool:
    """The threads that write and hash node-state chunks, shared by a run's folders.

    Args:
        threads: Number of threads (0: one per core, up to 8).
    """

    def __init__(self, threads: int = 0) -> None:
        self.threads = default_threads(threads)
        self._ex: Any = None
        self._lock = threading.Lock()

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """``[fn(x) for x in items]``, run by the pool's threads."""
        if len(items) <= 1:
            return [fn(x) for x in items]
        with self._lock:
            if self._ex is None:
                from concurrent.futures import ThreadPoolExecutor

                self._ex = ThreadPoolExecutor(self.threads, thread_name_prefix="sven-ckpt")
            ex = self._ex
        return list(ex.map(fn, items))

    def close(self) -> None:
        """Ends the threads (a later :meth:`map` starts new ones)."""
        with self._lock:
            ex, self._ex = self._ex, None
        if ex is not None:
            ex.shutdown(wait=True)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], offset + done)


@dataclass
class Npy:
    """One ``.npy`` file being written: its header, its source bytes, its descriptor."""

    rel: str
    header: bytes
    src: torch.Tensor  # (bytes,) uint8 view of a contiguous tensor
    size: int
    fd: int
    folder: Path
    deferred: bool = False  # written by the commit thread (from a device snapshot)


def create_npy(folder: Path, rel: str, t: torch.Tensor) -> Npy:
    """Creates ``folder/rel`` at its full size with its header; the rows come later."""
    src = t.detach()
    if not src.is_contiguous():
        src = src.contiguous()
    header = npy_header(numpy_dtype(src.dtype), tuple(src.shape))
    flat = src.reshape(-1).view(torch.uint8)
    size = len(header) + flat.numel()
    try:
        fd = os.open(folder / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _named(exc, rel) from exc
    try:
        _pwrite_all(fd, header, 0)
        # The full size at once: a file-size limit fails here (EFBIG), before any row.
        os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        raise _named(exc, rel) from exc
    return Npy(rel, header, flat, size, fd, folder)


def _bounce(device: torch.device) -> tuple[torch.Tensor, Any]:
    """This thread's pinned buffer and copy stream for ``device``."""
    key = f"bounce-{device}"
    got = getattr(_local, key, None)
    if got is None:
        got = (
            torch.empty(_BOUNCE, dtype=torch.uint8, pin_memory=True),
            torch.cuda.Stream(device),
        )
        setattr(_local, key, got)
    return got


def _write_piece(f: Npy, a: int, ready: Any) -> list[bytes]:
    """Writes bytes ``[a, a + work_size())`` of ``f`` and returns the raw sha256 of each
    of their chunks (runs on a pool thread)."""
    try:
        return _write_piece_of(f, a, ready)
    except OSError as exc:
        raise _named(exc, f.rel) from exc


def _write_piece_of(f: Npy, a: int, ready: Any) -> list[bytes]:
    b = min(a + work_size(), f.size)
    h = ChunkHasher(fmt.CHUNK)
    hl = len(f.header)
    if a < hl:
        h.update(f.header[a : min(b, hl)])
    lo, hi = max(a, hl) - hl, b - hl
    if lo >= hi:
        return h.finish()
    if not f.src.is_cuda:
        part = f.src[lo:hi].numpy()
        _pwrite_all(f.fd, part, hl + lo)
        h.update(part)
        return h.finish()
    with CUDA_SIDE_WORK:
        buf, stream = _bounce(f.src.device)
    for pos in range(lo, hi, _BOUNCE):
        n = min(_BOUNCE, hi - pos)
        # Not while the run captures a graph: the copy and its wait would invalidate it.
        with CUDA_SIDE_WORK:
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                buf[:n].copy_(f.src[pos : pos + n], non_blocking=True)
            stream.synchronize()
        part = buf[:n].numpy()
        _pwrite_all(f.fd, part, hl + pos)
        h.update(part)
    return h.finish()


def write_npys(pool: WriterPool, files: list[Npy], ready: Any) -> dict[str, str]:
    """Writes ``files`` piece by piece on the pool, and the chunk sums of the node-state
    ones next to them; returns their digests."""
    tasks = [(f, a) for f in files for a in range(0, f.size, work_size())]
    digests = pool.map(lambda fa: _write_piece(fa[0], fa[1], ready), tasks)
    per: dict[str, list[bytes]] = {f.rel: [] for f in files}
    for (f, _), d in zip(tasks, digests):
        per[f.rel].extend(d)
    for f in files:
        if f.rel.startswith(f"{NODE_DIR}/"):
            sums = f.folder / sums_rel(f.rel)
            sums.parent.mkdir(parents=True, exist_ok=True)
            write_file(sums, b"".join(per[f.rel]))
    return {rel: combine(ds) for rel, ds in per.items()}


def check_room(folder: Path, need: int) -> None:
    """Fails before writing when the file system has less free space than ``need`` bytes
    and a margin: a checkpoint that cannot fit does not fill the disk (the run still has
    its metrics and summary to write). Quotas are not seen here; their EDQUOT comes from
    the writes.

    Raises:
        OSError: ENOSPC, with both sizes.
    """
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if need + _MARGIN > free:
        raise OSError(
            errno.ENOSPC,
            f"{os.strerror(errno.ENOSPC)}: {_size(need)} to write, {_size(free)} free",
        )


def _size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


def sync_and_drop(f: Npy) -> None:
    """fsync a written ``.npy`` file and let the kernel drop its pages from the cache: a
    checkpoint of gigabytes should not evict what training reads (the event store, a
    memory-mapped node state)."""
    os.fsync(f.fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_file(path: Path, data: bytes) -> str:
    """Writes, fsyncs and returns the digest of a small file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            _pwrite_all(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _named(exc, path.name) from exc
    return bytes_digest(data)


def narrow_owner(owner: torch.Tensor, world_size: int) -> torch.Tensor:
    """The owner map in the smallest integer dtype that holds every rank."""
    for dt in (torch.int8, torch.int16, torch.int32):
        if world_size <= torch.iinfo(dt).max:
            # Narrowed where it lives: a GPU owner map crosses to the host at 1/8 its size.
            return owner.detach().to(dt).cpu()
    return owner.detach().cpu().to(torch.int64)


def _named(exc: OSError, rel: str) -> OSError:
    """``exc`` naming the checkpoint's file by its path inside the checkpoint."""
    return OSError(exc.errno, exc.strerror, rel) if exc.errno is not None else exc
