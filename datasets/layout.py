"""What an event store on disk must be, and the checks that open one.

The format is documented where it is written, in
:class:`~sven.datasets.writer.StoreBuilder`. This module holds what every stage
agrees on: the format version, the split names, the chunking of every streaming pass
(:func:`iter_ranges`), the keys and types ``meta.json`` must have, the dtype and
shape of every column, and the checks
:meth:`~sven.datasets.store.TemporalEvents.load` runs on a store: ``meta.json``
(:func:`load_meta`), each column's header against its file size
(:func:`open_column`), dtypes and row counts (:func:`check_columns`) and, in one
streaming pass, id ranges, time order and split labels (:func:`check_column_values`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sven.errors import DataError

__all__ = [
    "CHUNK_EVENTS",
    "FORMAT_VERSION",
    "INT32_LIMIT",
    "NEG_SPLITS",
    "SPLITS",
    "check_column_values",
    "check_columns",
    "first_bad",
    "iter_ranges",
    "load_meta",
    "open_column",
]

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")
#: Splits that may carry fixed evaluation negatives (``neg_<split>.npy``).
NEG_SPLITS = ("val", "test")
# Events per chunk when streaming columns: 2^21 int64 values are 16 MiB, small enough
# that a handful of columns in flight stay far below the memory bound, large enough
# that numpy's per-call overhead is noise.
CHUNK_EVENTS = 1 << 21
#: Node counts from which ids are stored as int64 rather than int32.
INT32_LIMIT = 2**31


def iter_ranges(n: int, chunk: int = CHUNK_EVENTS) -> Iterator[tuple[int, int]]:
    """Yields half-open ``(start, stop)`` ranges that tile ``[0, n)`` in steps of ``chunk``."""
    for start in range(0, n, chunk):
        yield start, min(start + chunk, n)


def first_bad(mask: np.ndarray) -> int:
    """Index of the first True of a (n,) bool mask that has one."""
    return int(np.flatnonzero(mask)[0])


# meta.json keys every stage reads, with the JSON types they must have.
_META_KEYS: dict[str, tuple[type, ...]] = {
    "num_events": (int,),
    "num_nodes": (int,),
    "bipartite": (bool,),
    "split": (dict,),
    "checksums": (dict,),
}
# Allowed dtype kinds and dimensions of each column (see writer.StoreBuilder).
_COLUMN_SPEC: dict[str, tuple[tuple[str, ...], int]] = {
    "src": (("<i4", "<i8"), 1),
    "dst": (("<i4", "<i8"), 1),
    "t": (("<i8", "<f8"), 1),
    "split": (("|u1",), 1),
    "edge_feat": (("<f4",), 2),
    "node_feat": (("<f4",), 2),
    "label": (("<i8", "<f4"), 1),
    "id_map": (("<i8", "<U"), 1),
    "neg_val": (("<i8",), 2),
    "neg_test": (("<i8",), 2),
}


def load_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of a store, checked for the keys and types every stage reads."""
    meta_path = path / "meta.json"
    if not path.is_dir():
        raise DataError("not an event store (no such directory)", path)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError("not an event store (no meta.json)", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"corrupt meta.json: {exc}", meta_path) from None
    except OSError as exc:
        raise DataError(f"cannot read: {exc.strerror or exc}", meta_path) from None
    if not isinstance(meta, dict):
        raise DataError(
            f"corrupt meta.json: expected an object, got {type(meta).__name__}", meta_path
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"unsupported store format_version {meta.get('format_version')!r} "
            f"(this Sven reads {FORMAT_VERSION})",
            meta_path,
        )
    for key, types in _META_KEYS.items():
        if key not in meta:
            raise DataError(f"corrupt meta.json: missing key {key!r}", meta_path)
        if not isinstance(meta[key], types) or (int in types and isinstance(meta[key], bool)):
            raise DataError(f"corrupt meta.json: {key} is {meta[key]!r}", meta_path)
    if meta["num_events"] < 0 or meta["num_nodes"] < 0:
        raise DataError("corrupt meta.json: negative num_events or num_nodes", meta_path)
    counts = meta["split"].get("counts")
    if (
        not isinstance(counts, dict)
        or any(not isinstance(counts.get(s), int) or counts[s] < 0 for s in SPLITS)
        or sum(counts[s] for s in SPLITS) != meta["num_events"]
    ):
        raise DataError(
            f"corrupt meta.json: split counts {counts!r} do not add up to "
            f"num_events {meta['num_events']}",
            meta_path,
        )
    nsrc = meta.get("num_src_nodes")
    if nsrc is not None and (not isinstance(nsrc, int) or not 0 <= nsrc <= meta["num_nodes"]):
        raise DataError(f"corrupt meta.json: num_src_nodes is {nsrc!r}", meta_path)
    return meta


def open_column(file: Path, mmap: bool) -> np.ndarray:
    """Opens one ``.npy`` column after checking its header against its file size."""
    try:
        with open(file, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0}.get(
                version, np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read(f)
            offset = f.tell()
        size = file.stat().st_size
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as exc:
        raise DataError(f"corrupt .npy header: {exc}", file) from None
    if fortran or dtype.hasobject:
        raise DataError(f"unexpected array layout ({dtype}, fortran_order={fortran})", file)
    expect = offset + dtype.itemsize * math.prod(shape)
    if size != expect:
        what = "truncated" if size < expect else "has trailing bytes"
        raise DataError(f"{what}: {size} bytes, its header announces {expect}", file)
    try:
        return np.load(file, mmap_mode="r" if mmap else None)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"cannot read: {exc}", file) from None


def check_columns(path: Path, meta: dict[str, Any], columns: dict[str, np.ndarray]) -> None:
    """Dtypes, dimensions and row counts of the columns against the format and meta."""
    E, N = meta["num_events"], meta["num_nodes"]
    rows = {"src": E, "dst": E, "t": E, "split": E, "edge_feat": E, "label": E}
    rows.update(node_feat=N, id_map=N)
    rows.update({f"neg_{s}": meta["split"]["counts"][s] for s in NEG_SPLITS})
    for col, arr in columns.items():
        file = path / f"{col}.npy"
        dtypes, ndim = _COLUMN_SPEC[col]
        descr = arr.dtype.str
        if not any(descr == d or (d == "<U" and descr.startswith("<U")) for d in dtypes):
            raise DataError(f"dtype {arr.dtype}, expected one of {', '.join(dtypes)}", file)
        if arr.ndim != ndim:
            raise DataError(f"shape {arr.shape}, expected {ndim} dimension(s)", file)
        if arr.shape[0] != rows[col]:
            raise DataError(f"{arr.shape[0]} rows, meta.json says {rows[col]}", file)
    if columns["src"].dtype != columns["dst"].dtype:
        raise DataError("src.npy and dst.npy differ in dtype", path)
    _check_negatives_meta(path, meta, columns)


def _check_negatives_meta(path: Path, meta: dict[str, Any], columns: dict[str, np.ndarray]) -> None:
    """``meta.json``'s ``eval_negatives`` names exactly the ``neg_<split>.npy`` files,
    with their widths."""
    info = meta.get("eval_negatives", {})
    if not isinstance(info, dict) or any(s not in NEG_SPLITS for s in info):
        raise DataError(f"corrupt meta.json: eval_negatives is {info!r}", path / "meta.json")
    for s in NEG_SPLITS:
        arr, entry = columns.get(f"neg_{s}"), info.get(s)
        if arr is None and entry is None:
            continue
        file = path / f"neg_{s}.npy"
        if arr is None:
            raise DataError(f"missing column file {file.name} (meta.json lists it)", path)
        if not isinstance(entry, dict) or entry.get("q") != arr.shape[1]:
            q = entry.get("q") if isinstance(entry, dict) else None
            raise DataError(f"{arr.shape[1]} negatives per event, meta.json says {q}", file)


def check_column_values(path: Path, meta: dict[str, Any], columns: dict[str, np.ndarray]) -> None:
    """Id ranges, time order and split labels, in one chunked pass per column."""
    N = meta["num_nodes"]
    for col in ("src", "dst"):
        a = columns[col]
        for start, stop in iter_ranges(a.shape[0]):
            chunk = a[start:stop]
            lo, hi = int(chunk.min()), int(chunk.max())
            if lo < 0 or hi >= N:
                i = start + first_bad((chunk < 0) | (chunk >= N))
                raise DataError(
                    f"row {i}: node id {int(a[i])} outside [0, {N}) (num_nodes in meta.json)",
                    path / f"{col}.npy",
                )
    t = columns["t"]
    prev = None
    for start, stop in iter_ranges(t.shape[0]):
        chunk = np.asarray(t[start:stop])
        if t.dtype.kind == "f" and not np.isfinite(chunk).all():
            i = start + first_bad(~np.isfinite(chunk))
            raise DataError(f"row {i}: time is {chunk[i - start]}", path / "t.npy")
        down = chunk[1:] < chunk[:-1]
        if prev is not None and chunk.size and chunk[0] < prev:
            raise DataError(f"row {start}: time goes backwards", path / "t.npy")
        if down.any():
            raise DataError(
                f"row {start + 1 + first_bad(down)}: time goes backwards", path / "t.npy"
            )
        if chunk.size:
            prev = chunk[-1]
    split = columns["split"]
    counts = meta["split"]["counts"]
    bounds = np.cumsum([0] + [counts[s] for s in SPLITS])
    for start, stop in iter_ranges(split.shape[0]):
        expect = np.searchsorted(bounds[1:], np.arange(start, stop), side="right")
        bad = np.asarray(split[start:stop]) != expect
        if bad.any():
            i = start + first_bad(bad)
            raise DataError(
                f"row {i}: split label {int(split[i])}, but meta.json's split counts say "
                f"{int(expect[i - start])}",
                path / "split.npy",
            )
    for s in NEG_SPLITS:
        neg = columns.get(f"neg_{s}")
        if neg is None:
            continue
        for start, stop in iter_ranges(neg.shape[0]):
            chunk = np.asarray(neg[start:stop])
            bad = (chunk < -1) | (chunk >= N)
            if bad.any():
                i, j = np.argwhere(bad)[0]
                raise DataError(
                    f"row {start + i}: negative {int(chunk[i, j])} outside [-1, {N})",
                    path / f"neg_{s}.npy",
                )
