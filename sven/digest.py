"""The one file-hash helper: sha256 over a file, or over a byte range of it.

Every digest Sven records goes through here: a store's column checksums
(``sven.datasets.checksums``), a partition folder's files (``sven.partition.store``),
a checkpoint's files (``sven.engine.checkpoint.format``, format 1 whole, format 2 per
chunk) and the manifest of what a run wrote (``sven.outputs``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

__all__ = ["sha256_file", "sha256_range"]

#: Bytes read at a time, into one buffer per thread (reused across calls).
_BLOCK = 8 << 20
_local = threading.local()


def _buffer() -> memoryview:
    """This thread's read buffer, made on its first use."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(_BLOCK))
    return buf


def sha256_range(path: str | os.PathLike[str], start: int = 0, stop: int | None = None) -> Any:
    """The sha256 state over bytes ``[start, stop)`` of a file (to its end when ``stop``
    is None or past the end).

    The GIL is released while blocks are read and hashed, so several files, or chunks of
    one, hash in parallel threads.

    Returns:
        A ``hashlib`` sha256 object: ``.hexdigest()`` or ``.digest()`` as the caller records.
    """
    h = hashlib.sha256()
    buf = _buffer()
    with open(path, "rb", buffering=0) as f:
        if start:
            f.seek(start)
        pos = start
        while stop is None or pos < stop:
            want = _BLOCK if stop is None else min(_BLOCK, stop - pos)
            n = f.readinto(buf[:want])
            if not n:
                break
            h.update(buf[:n])
            pos += n
    return h


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes."""
    return str(sha256_range(path).hexdigest())
