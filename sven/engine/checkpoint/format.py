"""What a checkpoint folder is made of: digests, ``.npy`` headers, safe readers, checks.

The layout itself (format 2, and format 1 that Sven still reads) is documented in
:mod:`sven.engine.checkpoint.writer`, which writes it.

Digests. A file's digest (format 2) is the sha256 of the concatenated sha256 digests of
its consecutive chunks of ``meta.json``'s ``chunk`` bytes (:data:`CHUNK`; a folder that
records none used :data:`LEGACY_CHUNK`), the last one shorter; an empty file has no
chunk. Each chunk's digest is computed by the thread that writes it, and again, in
parallel, by :func:`verify_folder`: a checkpoint of many gigabytes is neither read back
to be hashed when written, nor hashed by one thread when checked. Format 1 folders
recorded the plain sha256 of each file.

Chunk sums. A folder that records ``chunk`` also keeps, for each node-state file
``nodes/rank{r}/{field}.npy``, its chunks' raw digests in file order
(``sums/rank{r}/{field}.sums``, 32 bytes a chunk): the sha256 of that file is the ``.npy`` file's
digest, so a sums file that matches is as good as the file's digest, chunk by chunk.
A reader of a few rows then checks only the chunks it reads
(:class:`ChunkChecker`), and :func:`verify_folder` with ``lazy`` checks the sums files
instead of every byte of the node state.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sven.digest import sha256_file, sha256_range
from sven.errors import SvenError

#: The format :mod:`~sven.engine.checkpoint.writer` writes (``meta.json``'s ``format``).
FORMAT = 2
#: Bytes per digest chunk: what a reader of a few rows reads and hashes to check them.
CHUNK = 64 << 10
#: The chunk of format 2 folders whose ``meta.json`` records none.
LEGACY_CHUNK = 64 << 20
#: Bytes a writer or verifier thread takes at a time (a whole number of chunks).
WORK = 64 << 20
PREFIX = "step-"
#: The node-state fields of a checkpoint's shard (:class:`~sven.models.MemoryState`'s);
#: other names are written and read the same way.
NODE_DIR = "nodes"
#: The folder and suffix of the node-state files' chunk sums.
SUMS_DIR, SUMS = "sums", ".sums"
OWNER = "owner.npy"


def default_threads(threads: int = 0) -> int:
    """Writer and verifier threads: ``threads``, or (0) one per core up to 8."""
    return threads if threads > 0 else max(1, min(8, os.cpu_count() or 1))


def combine(chunk_digests: Iterable[bytes]) -> str:
    """A file's digest from its chunks' raw sha256 digests, in file order."""
    h = hashlib.sha256()
    for d in chunk_digests:
        h.update(d)
    return h.hexdigest()


def bytes_digest(data: bytes | memoryview) -> str:
    """The format-2 digest of a file whose content is ``data``."""
    mv = memoryview(data).cast("B")
    return combine(hashlib.sha256(mv[a : a + CHUNK]).digest() for a in range(0, len(mv), CHUNK))


def num_chunks(size: int, chunk: int = 0) -> int:
    """Digest chunks of ``chunk`` bytes (0: :data:`CHUNK`) of a file of ``size`` bytes."""
    return -(-size // (chunk or CHUNK))


def work_size(chunk: int = 0) -> int:
    """Bytes of a writer or verifier thread's task: :data:`WORK`, in whole chunks."""
    chunk = chunk or CHUNK
    return max(1, WORK // chunk) * chunk


class ChunkHasher:
    """The raw sha256 of each ``chunk``-byte chunk of bytes fed in file order from a
    chunk boundary (:meth:`update` in pieces of any size)."""

    def __init__(self, chunk: int = 0) -> None:
        self.chunk = chunk or CHUNK
        self.sums: list[bytes] = []
        self._h = hashlib.sha256()
        self._n = 0

    def update(self, data: Any) -> None:
        """Hashes the next bytes of the file."""
        mv = memoryview(data).cast("B")
        pos = 0
        while pos < len(mv):
            take = min(self.chunk - self._n, len(mv) - pos)
            self._h.update(mv[pos : pos + take])
            self._n += take
            pos += take
            if self._n == self.chunk:
                self.sums.append(self._h.digest())
                self._h, self._n = hashlib.sha256(), 0

    def finish(self) -> list[bytes]:
        """Every chunk's digest, the last (shorter) one included."""
        if self._n:
            self.sums.append(self._h.digest())
            self._h, self._n = hashlib.sha256(), 0
        return self.sums


def range_sums(path: str | Path, start: int, stop: int, chunk: int = 0) -> list[bytes]:
    """The raw sha256 of each chunk of bytes ``[start, stop)`` of a file (``start`` on a
    chunk boundary; a file shorter than ``stop`` gives the chunks it has)."""
    chunk = chunk or CHUNK
    if chunk > _READ:  # large chunks: one read buffer, not one chunk of memory
        return [
            bytes(sha256_range(path, a, min(a + chunk, stop)).digest())
            for a in range(start, stop, chunk)
        ]
    hasher = ChunkHasher(chunk)
    step = max(1, _READ // chunk) * chunk
    with open(path, "rb", buffering=0) as f:
        for a in range(start, stop, step):
            data = os.pread(f.fileno(), min(step, stop - a), a)
            hasher.update(data)
            if len(data) < min(step, stop - a):
                break
    return hasher.finish()


#: Bytes read at a time by :func:`range_sums`.
_READ = 8 << 20


def file_sums(paths: list[Path], threads: int = 0, chunk: int = 0) -> list[list[bytes]]:
    """Each file's chunk digests in file order, hashed in parallel."""
    work = work_size(chunk)
    tasks = [(i, a) for i, p in enumerate(paths) for a in range(0, p.stat().st_size, work)]
    with ThreadPoolExecutor(default_threads(threads), thread_name_prefix="sven-verify") as pool:
        done = list(pool.map(lambda ia: range_sums(paths[ia[0]], ia[1], ia[1] + work, chunk),
                             tasks))  # fmt: skip
    per: list[list[bytes]] = [[] for _ in paths]
    for (i, _), d in zip(tasks, done):
        per[i].extend(d)
    return per


def file_digests(paths: list[Path], threads: int = 0, chunk: int = 0) -> list[str]:
    """The format-2 digests of several files, their chunks hashed in parallel."""
    return [combine(s) for s in file_sums(paths, threads, chunk)]


def file_digest(path: str | Path, threads: int = 0, chunk: int = 0) -> str:
    """The format-2 digest of one file (what ``meta.json`` records for it)."""
    return file_digests([Path(path)], threads, chunk)[0]


def read_meta(folder: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json``; format 1 folders get ``"format": 1``."""
    meta = json.loads((Path(folder) / "meta.json").read_text())
    if not isinstance(meta, dict):
        raise ValueError("meta.json is not an object")
    meta.setdefault("format", 1)
    return meta


def chunk_of(meta: dict[str, Any]) -> int:
    """The digest chunk of a format-2 folder's files (:func:`read_meta`'s ``meta``)."""
    return int(meta.get("chunk", LEGACY_CHUNK))


def sums_rel(rel: str) -> str:
    """Where the chunk sums of node-state file ``rel`` (``nodes/rank0/memory.npy``) are:
    ``sums/rank0/memory.sums``."""
    return SUMS_DIR + rel[len(NODE_DIR) : -len(".npy")] + SUMS


def keeps_sums(meta: dict[str, Any], rel: str) -> bool:
    """Whether a folder keeps chunk sums for file ``rel`` (its node-state files, where
    ``meta.json`` records the chunk)."""
    return "chunk" in meta and rel.startswith(f"{NODE_DIR}/") and rel.endswith(".npy")


def read_sums(folder: Path, meta: dict[str, Any], rel: str) -> bytes | None:
    """The chunk sums of file ``rel`` where they are there and match both its digest in
    ``meta.json`` and its size; None otherwise (the file is then checked whole)."""
    if meta.get("format", 1) < 2 or not keeps_sums(meta, rel) or rel not in meta["files"]:
        return None
    try:
        data = (folder / sums_rel(rel)).read_bytes()
        size = (folder / rel).stat().st_size
    except OSError:
        return None
    if len(data) != 32 * num_chunks(size, chunk_of(meta)):
        return None
    return data if hashlib.sha256(data).hexdigest() == meta["files"][rel] else None


def verify_folder(folder: str | Path, threads: int = 0, lazy: bool = False) -> bool:
    """Whether a ``step-N`` folder is complete and every file matches its digest.

    Args:
        folder: The ``step-N`` folder.
        threads: Hashing threads (0: one per core, up to 8).
        lazy: A node-state file whose chunk sums match its digest and size is not read
            here: its reader checks the chunks it reads (:class:`ChunkChecker`). Every
            other file is hashed whole.
    """
    p = Path(folder)
    try:
        meta = read_meta(p)
        files = meta["files"]
        if "state.pt" not in files:
            return False
        names = sorted(files)
        if lazy:
            names = [n for n in names if read_sums(p, meta, n) is None]
        paths = [p / name for name in names]
        if meta["format"] >= 2:
            got = file_digests(paths, threads, chunk_of(meta))
        else:
            with ThreadPoolExecutor(default_threads(threads)) as pool:
                got = list(pool.map(sha256_file, paths))
        return all(g == files[n] for g, n in zip(got, names))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


class ChunkChecker:
    """Checks the chunks of one node-state file that a reader reads, each once, against
    its chunk sums (:func:`read_sums`); those holding the ``.npy`` header at once.

    Args:
        path: The ``.npy`` file.
        sums: Its chunk sums, matched against ``meta.json`` already.
        chunk: The folder's digest chunk in bytes.
        offset: Where its rows start (the header's length).
        row_bytes: Bytes of one row.
        threads: Hashing threads for many chunks at once (0: one per core, up to 8).

    Attributes:
        checked: (C,) bool, the chunks checked so far.

    Raises:
        SvenError: A chunk does not match its digest (one line, naming the file).
    """

    def __init__(
        self, path: Path, sums: bytes, chunk: int, offset: int, row_bytes: int, threads: int = 0
    ) -> None:
        self.path, self.sums, self.chunk = path, sums, chunk
        self.offset, self.row_bytes, self.threads = offset, row_bytes, threads
        self.checked = np.zeros(len(sums) // 32, dtype=bool)
        # A few chunks are read into this buffer one by one: a question's reads allocate
        # nothing; many are hashed in parallel.
        self._buf = memoryview(bytearray(min(chunk, _READ)))
        self._file = open(path, "rb", buffering=0)  # open while the checker lives
        self._lock = threading.Lock()  # the buffer and the flags: one reader at a time
        # The header's chunks, before any row is used.
        self.chunks(np.arange(min(max(1, num_chunks(offset, chunk)), self.checked.size)))

    def rows(self, rows: np.ndarray) -> None:
        """Checks the chunks that rows ``rows`` (n,) of the file lie in."""
        if rows.size == 0 or self.row_bytes == 0:
            return
        start = self.offset + np.asarray(rows, dtype=np.int64) * self.row_bytes
        first = start // self.chunk
        count = (start + self.row_bytes - 1) // self.chunk - first + 1
        # Each row's chunks first..last (one or two, unless a row is longer than a chunk).
        ends = np.cumsum(count)
        ks = np.repeat(first - (ends - count), count) + np.arange(int(ends[-1]))
        self.chunks(np.unique(ks))

    def chunks(self, ks: np.ndarray) -> None:
        """Checks chunks ``ks`` (ascending, distinct) not checked yet."""
        with self._lock:
            self._check(ks)

    def _check(self, ks: np.ndarray) -> None:
        todo = ks[~self.checked[ks]]
        if todo.size == 0:
            return
        if todo.size <= _SERIAL:
            for k in todo.tolist():
                self._compare(k, k + 1, [self._sum(k)])
            self.checked[todo] = True
            return
        # Runs of consecutive chunks, cut into tasks of at most a thread's work.
        per = max(1, work_size(self.chunk) // self.chunk)
        cut = np.flatnonzero((np.diff(todo) != 1) | (np.arange(1, todo.size) % per == 0)) + 1
        runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(todo, cut)]
        c = self.chunk

        def task(run: tuple[int, int]) -> list[bytes]:
            return range_sums(self.path, run[0] * c, run[1] * c, c)

        if len(runs) == 1:
            got = [task(runs[0])]
        else:
            with ThreadPoolExecutor(default_threads(self.threads)) as pool:
                got = list(pool.map(task, runs))
        for (a, b), sums in zip(runs, got):
            self._compare(a, b, sums)
        self.checked[todo] = True

    def _sum(self, k: int) -> bytes:
        """The raw sha256 of chunk ``k``, read into the checker's buffer."""
        h = hashlib.sha256()
        pos, stop = k * self.chunk, (k + 1) * self.chunk
        while pos < stop:
            n = os.preadv(self._file.fileno(), [self._buf[: stop - pos]], pos)
            if n <= 0:
                break
            h.update(self._buf[:n])
            pos += n
        return h.digest()

    def _compare(self, a: int, b: int, sums: list[bytes]) -> None:
        """Chunks ``a`` to ``b`` (exclusive) hashed to ``sums`` match the sums file."""
        if b"".join(sums) == self.sums[32 * a : 32 * b]:
            return
        want = self.sums[32 * a : 32 * b]
        k = a + next((i for i, g in enumerate(sums) if g != want[32 * i : 32 * (i + 1)]),
                     len(sums))  # fmt: skip
        c = self.chunk
        raise SvenError(
            f"{self.path}: corrupt checkpoint: bytes {k * c} to {(k + 1) * c} do not "
            "match their recorded digest"
        )


#: Chunks a :class:`ChunkChecker` checks one by one, in its thread; more, in parallel.
_SERIAL = 64


# ------------------------------------------------------------------------- .npy
def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype that holds a torch dtype's bytes unchanged.

    Raises:
        TypeError: numpy has no such dtype (bfloat16, float8...).
    """
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        raise TypeError(f"node state of dtype {dtype} cannot be written as .npy") from None


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header (format 1.0, padded to 64 bytes) of a C-order array."""
    buf = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, d)
    return buf.getvalue()


def open_npy(path: str | Path) -> np.ndarray:
    """A read-only memory map of an ``.npy`` file; no pickle, so no code runs."""
    return np.load(path, mmap_mode="r", allow_pickle=False)


# ------------------------------------------------------------------------ .pt
def serialise(obj: Any) -> bytes:
    """``torch.save`` to bytes (small states only: the node state goes to ``.npy``)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_file(
    path: str | Path, map_location: str | torch.device = "cpu", mmap: bool = False
) -> Any:
    """Loads one ``.pt`` checkpoint file without running code from it.

    Args:
        path: A ``.pt`` file of a checkpoint.
        map_location: Where tensors go.
        mmap: Map the file's tensors instead of reading them (a format 1 memory shard
            read in chunks).

    Raises:
        SvenError: The file is missing, truncated, not a checkpoint, or holds more
            than tensors and plain values (one line, naming the file).
    """
    try:
        # torch warns about files of other versions and layouts on the way; the error
        # below (or nothing) is what the user gets.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise SvenError(f"{path}: no such checkpoint file") from None
    except Exception as exc:  # pickle, zip and torch raise many kinds
        raise SvenError(f"{path}: {_unreadable(exc)}") from None


def _unreadable(exc: Exception) -> str:
    """Why torch could not load a file, as one whole sentence (torch's own message is
    a page of advice, with terminal escapes, to load it unsafely)."""
    text = str(exc)
    if "Weights only load failed" in text or "weights_only" in text:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        named = f" (it names {found.group(1)})" if found else ""
        return (
            f"not a Sven checkpoint: it holds more than tensors and plain values{named}; "
            "Sven never loads such a file, since loading it could run code from it."
        )
    first = re.sub(r"\x1b\[[0-9;]*m", "", (text.strip().splitlines() or [""])[0]).strip()
    first = first or type(exc).__name__
    if len(first) > 160:
        first = first[:157].rsplit(" ", 1)[0] + " ..."
    return f"not a readable Sven checkpoint (truncated or corrupt): {first.rstrip('.')}."


def warn(message: str) -> None:
    """A ``sven: warning:`` line on stderr (what the CLI prints, not a Python warning)."""
    print(f"sven: warning: {message}", file=sys.stderr, flush=True)


def fsync_dir(path: str | Path) -> None:
    """Makes a rename or a new entry in a folder durable (where the OS allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on folders; the rename is still atomic
    finally:
        os.close(fd)
