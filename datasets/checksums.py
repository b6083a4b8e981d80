"""Checksums of a store's files: the sha256 each column has in ``meta.json``.

The writer records them (:func:`~sven.digest.sha256_file`); :func:`verify_checksums` recomputes
every one, so that a byte changed on disk after the store was written is found
(``sven data verify``, and every command that opens a store to read it through
:func:`~sven.datasets.store.open_verified_store`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sven.datasets.layout import load_meta
from sven.digest import sha256_file
from sven.errors import DataError

__all__ = ["sha256_file", "verify_checksums"]

#: Bytes a hashing thread must have to pay for its start (tens of ms of hashing).
_BYTES_PER_THREAD = 8 << 20


def verify_checksums(path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> int:
    """Recomputes the sha256 of every ``.npy`` file of a store and compares with meta.json.

    Args:
        path: The store directory.
        meta: Its parsed ``meta.json`` (read here when None).

    Returns:
        The number of files checked.

    Raises:
        DataError: On a missing file, a file that meta.json does not list, or a mismatch.
    """
    path = Path(path)
    if meta is None:
        meta = load_meta(path)
    sums = meta["checksums"]
    on_disk = sorted(p.stem for p in path.glob("*.npy"))
    for col in on_disk:
        if col not in sums:
            raise DataError("not listed in meta.json's checksums", path / f"{col}.npy")
    files = {col: path / f"{col}.npy" for col in sums}
    for file in files.values():
        if not file.is_file():
            raise DataError(f"missing column file {file.name}", path)
    # Every byte is hashed on every call, whatever ran before: no cache of verified
    # files (a same-size rewrite can keep size, name and mtime). The files hash in
    # parallel threads, so the wall time is that of the largest file; a small store
    # (under _BYTES_PER_THREAD; docs/data.md has the timings) hashes in this thread,
    # where starting threads would cost more than they save.
    size = sum(file.stat().st_size for file in files.values())
    workers = max(1, min(len(files), os.cpu_count() or 1, 8, size // _BYTES_PER_THREAD))
    if workers > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            got = dict(zip(files, pool.map(sha256_file, files.values()), strict=True))
    else:
        got = {col: sha256_file(file) for col, file in files.items()}
    for col, digest in sums.items():
        if got[col] != digest:
            raise DataError(
                "checksum mismatch: the file changed after it was written "
                "(re-create the store with `sven data convert`)",
                files[col],
            )
    return len(sums)
