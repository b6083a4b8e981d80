"""What a checkpoint folder is made of: digests, ``.npy`` headers, safe readers, checks.

The layout itself (format 2, and format 1 that Sven still reads) is documented in
:mod:`sven.engine.checkpoint.writer`, which writes it.

Digests. A file's digest (format 2) is the sha256 of the concatenated sha256 digests of
its consecutive :data:`CHUNK`-byte chunks (the last one shorter; an empty file has no
chunk). Each chunk's digest is computed by the thread that writes the chunk, and again,
in parallel, by :func:`verify_folder`: a checkpoint of many gigabytes is neither read back
to be hashed when written, nor hashed by one thread when checked. Format 1 folders
recorded the plain sha256 of each file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
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
#: Bytes per digest chunk: the unit of work of a writer thread and of verification.
CHUNK = 64 << 20
PREFIX = "step-"
#: The node-state fields of a checkpoint's shard (:class:`~sven.models.MemoryState`'s);
#: other names are written and read the same way.
NODE_DIR = "nodes"
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


def chunk_digest(path: str | Path, k: int) -> bytes:
    """The raw sha256 of chunk ``k`` of a file."""
    return bytes(sha256_range(path, k * CHUNK, (k + 1) * CHUNK).digest())


def num_chunks(size: int) -> int:
    """Digest chunks of a file of ``size`` bytes."""
    return -(-size // CHUNK)


def file_digests(paths: list[Path], threads: int = 0) -> list[str]:
    """The format-2 digests of several files, their chunks hashed in parallel."""
    tasks = [(i, k) for i, p in enumerate(paths) for k in range(num_chunks(p.stat().st_size))]
    with ThreadPoolExecutor(default_threads(threads), thread_name_prefix="sven-verify") as pool:
        done = list(pool.map(lambda ik: chunk_digest(paths[ik[0]], ik[1]), tasks))
    per: list[list[bytes]] = [[] for _ in paths]
    for (i, _), d in zip(tasks, done):
        per[i].append(d)
    return [combine(d) for d in per]


def file_digest(path: str | Path, threads: int = 0) -> str:
    """The format-2 digest of one file (what ``meta.json`` records for it)."""
    return file_digests([Path(path)], threads)[0]


def read_meta(folder: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json``; format 1 folders get ``"format": 1``."""
    meta = json.loads((Path(folder) / "meta.json").read_text())
    if not isinstance(meta, dict):
        raise ValueError("meta.json is not an object")
    meta.setdefault("format", 1)
    return meta


def verify_folder(folder: str | Path, threads: int = 0) -> bool:
    """Whether a ``step-N`` folder is complete and every file matches its digest."""
    p = Path(folder)
    try:
        meta = read_meta(p)
        files = meta["files"]
        if "state.pt" not in files:
            return False
        names = sorted(files)
        paths = [p / name for name in names]
        if meta["format"] >= 2:
            got = file_digests(paths, threads)
        else:
            with ThreadPoolExecutor(default_threads(threads)) as pool:
                got = list(pool.map(sha256_file, paths))
        return all(g == files[n] for g, n in zip(got, names))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


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
