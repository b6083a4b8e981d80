"""The canonical on-disk event store: one directory, one ``.npy`` file per column.

Every later stage (partitioning, sampling, training) reads events through
:class:`TemporalEvents`, which memory-maps the columns so that datasets larger than
RAM work. Stores are written either from arrays in memory (:func:`write_events`) or
streamed chunk by chunk from a raw file (:class:`StoreWriter`); both go through the
same writer, so both produce byte-identical stores for the same events.

The layout is fixed by ``docs/contracts.md`` and documented in :class:`StoreWriter`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sven.errors import ConfigError, DataError, SvenError
from sven.ownership import (
    discard_partial,
    foreign_files,
    lock_folder,
    make_partial,
    publish_partial,
    refuse_foreign,
    report_swept,
    sweep_partials,
)

if TYPE_CHECKING:
    from torch_geometric.data import TemporalData

__all__ = [
    "FORMAT_VERSION",
    "SPLITS",
    "DistinctValues",
    "StoreWriter",
    "TemporalEvents",
    "check_target",
    "describe_replaced",
    "is_store",
    "iter_ranges",
    "open_verified_store",
    "refuse_existing_negatives",
    "sha256_file",
    "verify_checksums",
    "write_eval_negatives",
    "write_events",
]

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")
#: Splits that may carry fixed evaluation negatives (``neg_<split>.npy``).
NEG_SPLITS = ("val", "test")
# Events per chunk when streaming columns: 2^21 int64 values are 16 MiB, small enough
# that a handful of columns in flight stay far below the memory bound, large enough
# that numpy's per-call overhead is noise.
CHUNK_EVENTS = 1 << 21
# Bytes of event rows sorted in memory at once; unsorted inputs larger than this are
# sorted out of core by time buckets (see StoreWriter._sorted_stream).
SORT_BUDGET_BYTES = 1 << 30
_INT64_MAX = np.iinfo(np.int64).max
_INT32_LIMIT = 2**31


def iter_ranges(n: int, chunk: int = CHUNK_EVENTS) -> Iterator[tuple[int, int]]:
    """Yields half-open ``(start, stop)`` ranges that tile ``[0, n)`` in steps of ``chunk``."""
    for start in range(0, n, chunk):
        yield start, min(start + chunk, n)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks into one reused buffer.

    The GIL is released while the blocks are read and hashed, so several files hash in
    parallel threads (:func:`verify_checksums`).
    """
    h = hashlib.sha256()
    buf = bytearray(1 << 23)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def sorted_quantile(t: np.ndarray, q: float) -> float:
    """``np.quantile(t, q)`` (linear method) for a sorted array, reading two elements.

    numpy's quantile partitions a full copy of the input; on a memory-mapped column of
    10^9 events that is 8 GB. For sorted input the answer only needs the two order
    statistics around the virtual index, and interpolating them with numpy's own
    quantile on a 2-element array reproduces its rounding bit for bit.

    Args:
        t: (E,) non-decreasing values, E >= 1 (may be a memmap).
        q: Quantile in [0, 1].
    """
    h = (t.shape[0] - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, t.shape[0] - 1)
    pair = np.array([t[lo], t[hi]], dtype=np.float64)
    return float(np.quantile(pair, h - lo))


def unique_sorted(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` by sorting.

    numpy 2's hash-based ``np.unique`` is an order of magnitude slower than a sort on
    the integer id columns seen here (about 1 s against 35 ms for 1.4M int64).
    """
    s = np.sort(values, kind="stable")
    if s.size == 0:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


class DistinctValues:
    """The sorted distinct values of a stream of arrays, with bounded re-sorting.

    Small non-negative integers (below ``DENSE_LIMIT``, the common case for node ids)
    are marked in a bool array, one byte per possible value, which is a scatter
    instead of a sort per chunk. Otherwise each chunk is de-duplicated on arrival and
    pending chunks are merged into the running set once they outweigh it, so each
    value is re-sorted O(log chunks) times. No Python set or dict holds the values.
    """

    DENSE_LIMIT = 1 << 28

    def __init__(self) -> None:
        self._dense: np.ndarray | None = np.zeros(0, dtype=bool)
        self._merged: np.ndarray | None = None
        self._pending: list[np.ndarray] = []
        self._pending_size = 0

    def add(self, values: np.ndarray) -> None:
        """Adds the values of a (n,) array."""
        if values.size == 0:
            return
        if self._dense is not None:
            if (
                values.dtype.kind in "iu"
                and values.min() >= 0
                and (top := int(values.max())) < self.DENSE_LIMIT
            ):
                if top >= self._dense.size:
                    grown = np.zeros(
                        min(max(top + 1, 2 * self._dense.size), self.DENSE_LIMIT), bool
                    )
                    grown[: self._dense.size] = self._dense
                    self._dense = grown
                self._dense[values] = True
                return
            # Too large, negative or not integers: from here on, sort and merge.
            seen = np.flatnonzero(self._dense)
            self._dense = None
            if seen.size:
                self._pending.append(seen)
                self._pending_size += seen.size
        uniq = unique_sorted(values)
        self._pending.append(uniq)
        self._pending_size += uniq.size
        merged = 0 if self._merged is None else self._merged.size
        if self._pending_size > max(merged, 1 << 20):
            self._merge()

    def _merge(self) -> None:
        parts = ([] if self._merged is None else [self._merged]) + self._pending
        self._merged = unique_sorted(np.concatenate(parts)) if parts else None
        self._pending, self._pending_size = [], 0

    def result(self) -> np.ndarray:
        """Returns the (n,) sorted distinct values seen so far."""
        if self._dense is not None:
            return np.flatnonzero(self._dense)
        self._merge()
        return self._merged if self._merged is not None else np.empty(0, dtype=np.int64)


class _Spool:
    """An append-only headerless column file (C order) whose dtype may widen.

    Readers cannot know a column's final dtype up front (an integer time column may
    meet a fractional value in its last chunk; string ids get longer), so on a wider
    chunk the file is rewritten once, chunk by chunk, in the wider dtype.
    """

    def __init__(self, path: Path, row_shape: tuple[int, ...] = ()) -> None:
        self.path = path
        self.row_shape = row_shape
        self.dtype: np.dtype | None = None
        self.rows = 0
        self._f: Any = None

    @property
    def row_bytes(self) -> int:
        assert self.dtype is not None
        return self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))

    def append(self, arr: np.ndarray) -> None:
        if self.dtype is None:
            self.dtype = arr.dtype
            self._f = open(self.path, "wb")  # closed in finish()
        elif arr.dtype != self.dtype:
            wider = np.promote_types(self.dtype, arr.dtype)
            if wider != self.dtype:
                self._widen(wider)
        np.ascontiguousarray(arr, dtype=self.dtype).tofile(self._f)
        self.rows += arr.shape[0]

    def _widen(self, dtype: np.dtype) -> None:
        self.finish()
        tmp = self.path.with_name(self.path.name + ".widen")
        with open(tmp, "wb") as out:
            for start, stop in iter_ranges(self.rows):
                self.read(start, stop).astype(dtype).tofile(out)
        os.replace(tmp, self.path)
        self.dtype = np.dtype(dtype)
        self._f = open(self.path, "ab")  # closed in finish()

    def finish(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as an in-memory array of shape (stop - start, *row_shape)."""
        assert self.dtype is not None
        per_row = int(np.prod(self.row_shape, dtype=np.int64))
        # np.fromfile rather than a memmap: sequential reads of a private buffer keep
        # the resident set to the chunk, where touched memmap pages would accumulate.
        out = np.fromfile(
            self.path,
            dtype=self.dtype,
            count=(stop - start) * per_row,
            offset=start * self.row_bytes,
        )
        return out.reshape((stop - start, *self.row_shape))

    def remove(self) -> None:
        self.finish()
        self.path.unlink(missing_ok=True)


class _NpyAppender:
    """Writes a ``.npy`` file of known final shape by appending C-order chunks.

    A plain file write instead of ``open_memmap``: dirty memmap pages stay in the
    resident set until unmapped, so a 10^9-event column would count against RSS.
    """

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.shape = shape
        self._rows = 0
        self._f = open(path, "wb")  # closed in close()
        header = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": shape,
        }
        np.lib.format.write_array_header_1_0(self._f, header)

    def append(self, arr: np.ndarray) -> None:
        np.ascontiguousarray(arr, dtype=self.dtype).tofile(self._f)
        self._rows += arr.shape[0]

    def close(self) -> None:
        self._f.close()
        if self._rows != self.shape[0]:  # a bug in the writer, never bad input
            raise RuntimeError(f"{self.path}: wrote {self._rows} rows, expected {self.shape[0]}")


class _IdSpace:
    """Maps the raw ids of one id space to compact ids ``base .. base + n - 1``.

    A space is all nodes, or one side of a bipartite graph. Ids that already form
    the target range are kept (``identity``) or shifted (``shift``); otherwise they
    are numbered by first appearance in the time-sorted stream (``table``), which
    needs one pass over the sorted ids (:meth:`observe`) before :meth:`map` works.

    Raw ids are located among the sorted distinct ids through a direct lookup array
    when they are integers below ``LUT_LIMIT`` (4 bytes per possible id): a gather,
    where a binary search of random keys costs a cache miss per level, about 100x
    slower on millions of nodes. Other ids (strings, huge integers) are searched in
    sorted order, which keeps the binary searches cache-friendly.
    """

    LUT_LIMIT = 1 << 28
    _UNSEEN = np.iinfo(np.int64).max

    def __init__(self, uniques: np.ndarray, base: int, *, allow_shift: bool = False) -> None:
        self.uniques = uniques  # sorted; after finalize(): in compact order
        self.base = base
        self.n = int(uniques.size)
        self.delta = 0
        self.table: np.ndarray | None = None
        self.first: np.ndarray | None = None
        self._lut: np.ndarray | None = None
        self._lut_is_compact = False
        self._sorted = uniques
        numeric = uniques.dtype.kind == "i"
        if numeric and uniques[0] == base and uniques[-1] == base + self.n - 1:
            self.kind = "identity"
        elif numeric and allow_shift and uniques[0] == 0 and uniques[-1] == self.n - 1:
            self.kind, self.delta = "shift", base
        else:
            self.kind = "table"
            self.first = np.full(self.n, self._UNSEEN, dtype=np.int64)
            if numeric and uniques[-1] < self.LUT_LIMIT:
                # np.empty: only the entries of ids that occur are ever written or read,
                # so untouched pages of a sparse id range cost no memory.
                dtype = np.int32 if base + self.n < _INT32_LIMIT else np.int64
                self._lut = np.empty(int(uniques[-1]) + 1, dtype=dtype)
                self._lut[uniques] = np.arange(self.n)

    def _positions(self, raw: np.ndarray) -> np.ndarray:
        """Index of each raw id among the sorted distinct ids."""
        if self._lut is not None:
            return self._lut[raw]
        order = np.argsort(raw, kind="stable")
        pos = np.empty(raw.shape[0], dtype=np.int64)
        pos[order] = np.searchsorted(self._sorted, raw[order])
        return pos

    def observe(self, raw: np.ndarray, offset: int) -> None:
        """Records first appearances; ``raw`` (m,) is the next stretch of the sorted stream,
        whose first element is at stream position ``offset``."""
        assert self.first is not None
        # Positions seen before keep their (smaller) first position.
        np.minimum.at(self.first, self._positions(raw), offset + np.arange(raw.shape[0]))

    def prepare(self) -> None:
        """Turns the first appearances into the compact numbering; call before map()."""
        if self.kind != "table" or self.table is not None:
            return
        assert self.first is not None
        order = np.argsort(self.first, kind="stable")
        self.first = None
        self.table = np.empty(self.n, dtype=np.int64)
        self.table[order] = self.base + np.arange(self.n, dtype=np.int64)
        self.uniques = self._sorted[order]
        if self._lut is not None:
            self._lut[self._sorted] = self.table  # raw id -> compact id in one gather
            self._lut_is_compact = True

    def map(self, raw: np.ndarray) -> np.ndarray:
        """Compact ids (m,) int64 of raw ids (m,)."""
        if self.kind == "identity":
            return raw.astype(np.int64, copy=False)
        if self.kind == "shift":
            return raw.astype(np.int64, copy=False) + self.delta
        assert self.table is not None, "prepare() first"
        if self._lut_is_compact:
            return self._lut[raw].astype(np.int64, copy=False)
        return self.table[self._positions(raw)]

    @property
    def raw_ids(self) -> np.ndarray:
        """(n,) raw id of compact id ``base + i``."""
        return self.uniques


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


class StoreWriter:
    """Streams events into an event store directory with bounded memory.

    On-disk format (version 1), one directory::

        meta.json        counts, dims, time range, splits, source, checksums (below)
        src.npy          int32 (int64 if N >= 2^31), (E,)   compact source ids 0..N-1
        dst.npy          same dtype, (E,)                    compact destination ids
        t.npy            int64 or float64, (E,)              non-decreasing timestamps
        split.npy        uint8, (E,)                         0 train, 1 val, 2 test
        edge_feat.npy    float32, (E, d_e)                   optional
        node_feat.npy    float32, (N, d_n)                   optional
        label.npy        int64 or float32, (E,)              optional per-event label
        id_map.npy       int64 or unicode, (N,)              raw id of compact id i
        neg_val.npy      int64, (n_val, q)                   optional fixed MRR negatives
        neg_test.npy     int64, (n_test, q)                  of each event, -1 padded

    ``meta.json`` holds ``format_version`` (1), ``name``, ``num_events``, ``num_nodes``,
    ``bipartite``, ``num_src_nodes`` (bipartite: sources are ``0..num_src_nodes-1``,
    destinations after; else null), ``t_dtype``, ``t_min``, ``t_max``,
    ``edge_feat_dim``, ``node_feat_dim``, ``has_label``, ``split`` (``method``
    ``"time_quantile"``, ``fractions``, ``val_time``, ``test_time``, ``counts``),
    ``source``, ``sorted_on_ingest``, ``num_out_of_order`` and ``checksums``
    (sha256 of every ``.npy`` file). The writer never writes ``neg_<split>.npy``:
    :func:`write_eval_negatives` adds them to a finished store (``sven data
    negatives``) with ``meta.json``'s ``eval_negatives``
    (``{split: {"q", "source": {"path", "sha256"}}}``) and their checksums.

    Events are sorted by time with a stable sort, so events with equal times keep
    their input order; ``num_out_of_order`` counts the events whose time is earlier
    than that of the event just before them in the input (0 iff the input was
    sorted). Splits follow DyGLib:
    ``val_time, test_time = np.quantile(t, [1 - val - test, 1 - test])``; train is
    ``t <= val_time``, val ``val_time < t <= test_time``, test ``t > test_time``.

    Node ids: with ``num_nodes`` (or ``node_feat``) given, appended ids are already
    compact (``0 <= id < num_nodes``) and kept. Otherwise they are raw ids (non-negative
    integers, or strings) compacted at close: kept if they are exactly ``0..N-1``,
    else numbered by first appearance in the time-sorted stream (source before
    destination within an event). With ``bipartite=True`` sources and destinations
    are separate id spaces, numbered ``0..U-1`` and ``U..U+I-1``; destination ids
    that already start at U (already offset, as in JODIE's Wikipedia copy) are kept,
    ids ``0..I-1`` are shifted by U. In the bipartite case ``id_map`` holds each
    side's own raw ids.

    Memory: appended chunks go to temporary column files; closing streams them back
    in chunks. Resident memory is a few chunks plus, for raw-id compaction, about
    24 bytes per distinct node and, for integer ids below 2^28, 5 bytes per possible
    id (a seen-bitmap and a lookup table, touched only where ids occur), plus
    ``SORT_BUDGET_BYTES`` when the input is out of time order (larger inputs are
    bucketed by time on disk and sorted bucket by bucket).

    Atomicity: everything is written to a hidden temporary directory beside
    ``out_dir`` (``.NAME.partial-*``) and renamed into place at close; on any error
    (or on leaving the ``with`` block by an exception, SIGTERM included under
    :func:`sven.ownership.stop_on_sigterm`) the temporary directory is removed, so a
    failed conversion leaves nothing behind. One writer at a time: the writer holds
    ``out_dir``'s lock (:func:`sven.ownership.lock_folder`) from construction to
    close, and first removes the partial folders that dead writers left beside it.

    Args:
        out_dir: Target directory; must not exist (or be empty) unless ``overwrite``.
        name: Dataset name for ``meta.json`` (default: the directory name).
        num_nodes: Fixed node count; ids are then compact already.
        node_feat: (N, d_n) node features; implies ``num_nodes = N``.
        id_map: (N,) raw ids of the compact ids, with ``num_nodes`` fixed.
        raw_id_offset: Added to kept or compacted integer ids to get the raw ids
            stored in ``id_map`` (a reader that appends DyGLib's 1-based ids 0-based
            passes 1).
        bipartite: True: separate source/destination id spaces; False: not
            bipartite; None: bipartite iff every source id is below every
            destination id after compaction.
        allow_string_ids: Accept string node ids (compacted by first appearance).
        val_frac, test_frac: Chronological split fractions.
        source: Provenance for ``meta.json`` (may also be set as ``writer.source``
            before closing).
        overwrite: Replace an existing ``out_dir``.
        sort_budget_bytes: Memory for sorting out-of-order events in one piece.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        name: str | None = None,
        num_nodes: int | None = None,
        node_feat: np.ndarray | None = None,
        id_map: np.ndarray | None = None,
        raw_id_offset: int = 0,
        bipartite: bool | None = None,
        allow_string_ids: bool = False,
        val_frac: float = 0.15,
        test_frac: float = 0.15,
        source: dict[str, Any] | None = None,
        overwrite: bool = False,
        sort_budget_bytes: int = SORT_BUDGET_BYTES,
    ) -> None:
        if not (0 <= val_frac < 1 and 0 <= test_frac < 1 and val_frac + test_frac < 1):
            raise ConfigError(
                f"split fractions must satisfy 0 <= val, test and val + test < 1; "
                f"got val={val_frac}, test={test_frac}"
            )
        self.out_dir = Path(out_dir)
        _check_target(self.out_dir, overwrite)  # early, before the arguments' checks
        self.name = name or self.out_dir.name
        self.overwrite = overwrite
        self.val_frac, self.test_frac = float(val_frac), float(test_frac)
        self.source: dict[str, Any] = dict(source) if source else {"format": "arrays"}
        self.raw_id_offset = int(raw_id_offset)
        self.bipartite = bipartite
        self.allow_string_ids = allow_string_ids
        self.sort_budget_bytes = int(sort_budget_bytes)

        if node_feat is not None:
            if node_feat.ndim != 2:
                raise DataError(f"node features must be 2-D (N, d), got shape {node_feat.shape}")
            if num_nodes is not None and node_feat.shape[0] != num_nodes:
                raise DataError(f"{node_feat.shape[0]} node feature rows for {num_nodes} nodes")
            num_nodes = node_feat.shape[0]
        if id_map is not None:
            id_map = np.asarray(id_map)
            if num_nodes is None:
                num_nodes = id_map.shape[0]
            if id_map.shape != (num_nodes,):
                raise DataError(f"id_map has shape {id_map.shape}, expected ({num_nodes},)")
        self.num_nodes = None if num_nodes is None else int(num_nodes)
        self.node_feat = node_feat
        self.id_map = id_map

        # Everything below runs under the lock, released on any failure.
        self._lock = lock_folder(self.out_dir, "writing an event store")
        self._tmp: Path | None = None
        try:
            _check_target(self.out_dir, overwrite)
            report_swept(sweep_partials(self.out_dir.parent))
            self._tmp = make_partial(self.out_dir)
            self._spool_dir = self._tmp / "_spool"
            self._spool_dir.mkdir()
        except BaseException as exc:
            if self._tmp is not None:
                discard_partial(self._tmp)
            self._lock.release()
            if isinstance(exc, OSError):
                raise SvenError(
                    f"cannot create a folder beside {self.out_dir}: {exc.strerror or exc}"
                ) from None
            raise
        self._spools: dict[str, _Spool] = {
            "src": _Spool(self._spool_dir / "src"),
            "dst": _Spool(self._spool_dir / "dst"),
            "t": _Spool(self._spool_dir / "t"),
        }
        self._has_feat: bool | None = None
        self._has_label: bool | None = None
        self._ids_are_str: bool | None = None
        self._rows = 0
        self._t_last: Any = None
        self._num_out_of_order = 0
        self._distinct = {"src": DistinctValues(), "dst": DistinctValues()}
        self._closed = False

    @property
    def num_events(self) -> int:
        """Events appended so far."""
        return self._rows

    # -- appending -------------------------------------------------------------

    def append(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        t: np.ndarray,
        edge_feat: np.ndarray | None = None,
        label: np.ndarray | None = None,
    ) -> None:
        """Appends a chunk of n events, in input order.

        Args:
            src: (n,) source ids (non-negative integers, or strings if allowed).
            dst: (n,) destination ids.
            t: (n,) integer or float timestamps, finite.
            edge_feat: (n, d_e) or (n,) edge features; present in every chunk or none.
            label: (n,) integer or float labels; present in every chunk or none.

        Raises:
            DataError: on invalid values; the message names the event index.
        """
        if self._closed:
            raise RuntimeError("StoreWriter is closed")
        n = np.shape(src)[0] if np.ndim(src) else -1
        src = self._ids(src, "source", n)
        dst = self._ids(dst, "destination", n)
        t = self._times(t, n)
        edge_feat = self._optional(edge_feat, "edge features", n, "_has_feat")
        label = self._optional(label, "labels", n, "_has_label")
        if n == 0:
            return

        if self._t_last is None:
            self._t_last = t[0]
        # Places where time goes backwards, the previous chunk's last time carried in.
        self._num_out_of_order += int(np.count_nonzero(t[1:] < t[:-1])) + int(t[0] < self._t_last)
        self._t_last = t[-1]

        self._spools["src"].append(src)
        self._spools["dst"].append(dst)
        self._spools["t"].append(t)
        if edge_feat is not None:
            self._spools.setdefault(
                "edge_feat", _Spool(self._spool_dir / "edge_feat", edge_feat.shape[1:])
            ).append(edge_feat)
        if label is not None:
            self._spools.setdefault("label", _Spool(self._spool_dir / "label")).append(label)
        if self.num_nodes is None:
            if self.bipartite:
                self._distinct["src"].add(src)
                self._distinct["dst"].add(dst)
            else:
                self._distinct["src"].add(np.concatenate([src, dst]))
        self._rows += n

    def _where(self, i: int) -> str:
        return f"event {self._rows + i}"

    def _ids(self, ids: Any, what: str, n: int) -> np.ndarray:
        a = np.asarray(ids)
        if a.ndim != 1 or a.shape[0] != n:
            raise DataError(f"{what} ids have shape {a.shape}, expected ({n},)")
        if a.dtype.kind in "US" or (a.dtype.kind == "O" and self.allow_string_ids):
            if not self.allow_string_ids:
                raise DataError(f"{what} ids are strings; pass allow_string_ids=True")
            if self.num_nodes is not None:
                raise DataError("string ids need compaction; do not fix num_nodes")
            a = a.astype(str)
            is_str = True
        elif a.dtype.kind in "iu":
            if a.dtype.kind == "u" and a.size and a.max() > _INT64_MAX:
                i = _first_bad(a > _INT64_MAX)
                raise DataError(f"{self._where(i)}: {what} id {a[i]} overflows int64")
            a = a.astype(np.int64, copy=False)
            if a.size and a.min() < 0:
                i = _first_bad(a < 0)
                raise DataError(f"{self._where(i)}: negative {what} id {a[i]}")
            if self.num_nodes is not None and a.size and a.max() >= self.num_nodes:
                i = _first_bad(a >= self.num_nodes)
                raise DataError(
                    f"{self._where(i)}: {what} id {a[i]} out of range for {self.num_nodes} nodes"
                )
            is_str = False
        else:
            raise DataError(f"{what} ids must be integers, got dtype {a.dtype}")
        if self._ids_are_str is None:
            self._ids_are_str = is_str
        elif self._ids_are_str != is_str:
            raise DataError("node ids mix integers and strings across chunks")
        return a

    def _times(self, t: Any, n: int) -> np.ndarray:
        a = np.asarray(t)
        if a.ndim != 1 or a.shape[0] != n:
            raise DataError(f"times have shape {a.shape}, expected ({n},)")
        if a.dtype.kind in "iu":
            if a.dtype.kind == "u" and a.size and a.max() > _INT64_MAX:
                i = _first_bad(a > _INT64_MAX)
                raise DataError(f"{self._where(i)}: time {a[i]} overflows int64")
            return a.astype(np.int64, copy=False)
        if a.dtype.kind == "f":
            a = a.astype(np.float64, copy=False)
            if not np.isfinite(a).all():
                i = _first_bad(~np.isfinite(a))
                raise DataError(f"{self._where(i)}: time is {a[i]} (NaN/inf)")
            return a
        raise DataError(f"times must be numeric, got dtype {a.dtype}")

    def _optional(self, a: Any, what: str, n: int, flag: str) -> np.ndarray | None:
        present = a is not None
        seen = getattr(self, flag)
        if seen is None:
            setattr(self, flag, present)
        elif seen != present:
            raise DataError(f"{what} present in some chunks but not in others")
        if not present:
            return None
        a = np.asarray(a)
        if a.shape[:1] != (n,):
            raise DataError(f"{n} events but {a.shape[0] if a.ndim else 0} rows of {what}")
        if what == "labels":
            if a.ndim != 1:
                raise DataError(f"labels must be 1-D, got shape {a.shape}")
            if a.dtype.kind in "biu":
                return a.astype(np.int64, copy=False)
            if a.dtype.kind != "f":
                raise DataError(f"labels must be numeric, got dtype {a.dtype}")
            out = a.astype(np.float32)
        else:
            if a.ndim == 1:
                a = a[:, None]
            if a.ndim != 2:
                raise DataError(f"edge features must be (n, d), got shape {a.shape}")
            if a.dtype.kind not in "biuf":
                raise DataError(f"edge features must be numeric, got dtype {a.dtype}")
            spool = self._spools.get("edge_feat")
            if spool is not None and spool.row_shape != a.shape[1:]:
                raise DataError(
                    f"edge feature width {a.shape[1]} differs from earlier chunks "
                    f"({spool.row_shape[0]})"
                )
            out = a.astype(np.float32)
        # Checked after the cast: float64 values beyond float32's range become inf.
        bad = ~np.isfinite(out)
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(n, -1).any(axis=1))[0])
            raise DataError(f"{self._where(i)}: {what} contain NaN/inf")
        return out

    # -- closing ---------------------------------------------------------------

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()

    def abort(self) -> None:
        """Discards everything written so far."""
        self._closed = True
        try:
            for spool in self._spools.values():
                spool.finish()
        finally:
            discard_partial(self._tmp)
            self._lock.release()

    def close(self) -> TemporalEvents:
        """Sorts, compacts, splits, checksums and renames the store into place.

        Returns:
            The finished store, loaded memory-mapped.
        """
        if self._closed:
            raise RuntimeError("StoreWriter is closed")
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._lock.release()
        # Just written and checked value by value on append: the structure is enough.
        return TemporalEvents.load(self.out_dir, check_values=False)

    def _finish(self) -> None:
        E = self._rows
        if E == 0:
            raise DataError("no events")
        for spool in self._spools.values():
            spool.finish()
        spaces = self._id_spaces()
        in_order = self._num_out_of_order == 0

        # Pass 1: the time-sorted stream -> t, edge_feat, label; ids mapped directly
        # when their mapping is known, else spooled (sorted, raw) for pass 2.
        needs_table = any(s.kind == "table" for s in spaces.values())
        out = self._tmp
        t_spool = self._spools["t"]
        t_dtype = np.dtype(np.float64 if t_spool.dtype.kind == "f" else np.int64)
        N = self._final_num_nodes(spaces)
        id_dtype = np.dtype(np.int32 if N < _INT32_LIMIT else np.int64)
        writers = {"t": _NpyAppender(out / "t.npy", t_dtype, (E,))}
        if "edge_feat" in self._spools:
            shape = (E, *self._spools["edge_feat"].row_shape)
            writers["edge_feat"] = _NpyAppender(out / "edge_feat.npy", np.float32, shape)
        if "label" in self._spools:
            kind = self._spools["label"].dtype.kind
            dtype = np.float32 if kind == "f" else np.int64
            writers["label"] = _NpyAppender(out / "label.npy", dtype, (E,))
        id_writers = {c: _NpyAppender(out / f"{c}.npy", id_dtype, (E,)) for c in ("src", "dst")}
        if needs_table and not in_order:
            sorted_ids = {c: _Spool(self._spool_dir / f"sorted_{c}") for c in ("src", "dst")}
        else:
            sorted_ids = None
        extrema = {"src_max": -1, "dst_min": N}

        def write_ids(chunk: dict[str, np.ndarray]) -> None:
            for col, key in (("src", "src"), ("dst", "dst" if self.bipartite else "src")):
                compact = spaces[key].map(chunk[col]) if spaces else chunk[col]
                if col == "src":
                    extrema["src_max"] = max(extrema["src_max"], int(compact.max()))
                else:
                    extrema["dst_min"] = min(extrema["dst_min"], int(compact.min()))
                id_writers[col].append(compact)

        offset = 0
        for chunk in self._sorted_stream():
            n = chunk["t"].shape[0]
            for col, w in writers.items():
                w.append(chunk[col])
            if not needs_table:
                write_ids(chunk)
            else:
                if self.bipartite:
                    for col in ("src", "dst"):
                        if spaces[col].kind == "table":
                            spaces[col].observe(chunk[col], offset)
                else:
                    # Interleave so that within an event the source counts as first.
                    seq = np.empty(2 * n, dtype=chunk["src"].dtype)
                    seq[0::2], seq[1::2] = chunk["src"], chunk["dst"]
                    spaces["src"].observe(seq, 2 * offset)
                if sorted_ids is not None:
                    for col in ("src", "dst"):
                        sorted_ids[col].append(chunk[col])
            offset += n
        for w in writers.values():
            w.close()

        # Pass 2: the first-appearance numbering is complete; map the sorted raw ids.
        for space in spaces.values():
            space.prepare()
        if needs_table:
            source = sorted_ids if sorted_ids is not None else self._spools
            for spool in (source["src"], source["dst"]):
                spool.finish()
            for start, stop in iter_ranges(E):
                write_ids({c: source[c].read(start, stop) for c in ("src", "dst")})
        for w in id_writers.values():
            w.close()
        shutil.rmtree(self._spool_dir)

        id_map = self._id_map(spaces, N)
        np.save(out / "id_map.npy", id_map)
        if self.node_feat is not None:
            node_out = _NpyAppender(out / "node_feat.npy", np.float32, self.node_feat.shape)
            for start, stop in iter_ranges(N):
                rows = np.asarray(self.node_feat[start:stop], dtype=np.float32)
                if not np.isfinite(rows).all():
                    i = start + int(np.flatnonzero(~np.isfinite(rows).all(axis=1))[0])
                    raise DataError(f"node {i}: node features contain NaN/inf")
                node_out.append(rows)
            node_out.close()

        split_meta = self._write_split(E)
        bipartite, num_src = self._bipartite_result(spaces, extrema)
        t = np.load(out / "t.npy", mmap_mode="r")
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "num_events": E,
            "num_nodes": N,
            "bipartite": bipartite,
            "num_src_nodes": num_src,
            "t_dtype": str(t_dtype),
            "t_min": t[0].item(),
            "t_max": t[-1].item(),
            "edge_feat_dim": int(self._spools["edge_feat"].row_shape[0])
            if "edge_feat" in self._spools
            else 0,
            "node_feat_dim": 0 if self.node_feat is None else int(self.node_feat.shape[1]),
            "has_label": "label" in self._spools,
            "split": split_meta,
            "source": self.source,
            "sorted_on_ingest": not in_order,
            "num_out_of_order": self._num_out_of_order,
        }
        del t
        meta["checksums"] = {p.stem: sha256_file(p) for p in sorted(out.glob("*.npy"))}
        with open(out / "meta.json", "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        _publish(self._tmp, self.out_dir, self.overwrite)

    def _id_spaces(self) -> dict[str, _IdSpace]:
        """The id spaces to compact; empty when ids are compact already."""
        if self.num_nodes is not None:
            return {}
        if not self.bipartite:
            return {"src": _IdSpace(self._distinct["src"].result(), 0)}
        users = _IdSpace(self._distinct["src"].result(), 0)
        # Destination ids that already continue the source range (JODIE's offset
        # Wikipedia copy) are kept; 0-based ones are offset after the sources.
        items = _IdSpace(self._distinct["dst"].result(), users.n, allow_shift=True)
        return {"src": users, "dst": items}

    def _final_num_nodes(self, spaces: dict[str, _IdSpace]) -> int:
        if self.num_nodes is not None:
            return self.num_nodes
        return sum(s.n for s in spaces.values())

    def _id_map(self, spaces: dict[str, _IdSpace], N: int) -> np.ndarray:
        if self.id_map is not None:
            return self.id_map
        if not spaces:
            raw = np.arange(N, dtype=np.int64)
        else:
            raw = np.concatenate([s.raw_ids for s in spaces.values()])
        if raw.dtype.kind == "i" and self.raw_id_offset:
            raw = raw + self.raw_id_offset
        return raw

    def _bipartite_result(
        self, spaces: dict[str, _IdSpace], extrema: dict[str, int]
    ) -> tuple[bool, int | None]:
        if self.bipartite and spaces:
            return True, spaces["src"].n
        ordered = extrema["src_max"] < extrema["dst_min"]
        if self.bipartite and not ordered:
            raise DataError("declared bipartite, but a source id is not below every destination id")
        if self.bipartite is False or not ordered:
            return False, None
        return True, extrema["src_max"] + 1

    def _sorted_stream(self) -> Iterator[dict[str, np.ndarray]]:
        """Yields the events in stable time order, in chunks of all spooled columns."""
        spools = self._spools
        E = self._rows
        if self._num_out_of_order == 0:
            for start, stop in iter_ranges(E):
                yield {c: s.read(start, stop) for c, s in spools.items()}
            return
        row_bytes = sum(s.row_bytes for s in spools.values())
        num_buckets = max(1, math.ceil(E * row_bytes / self.sort_budget_bytes))
        if num_buckets == 1:
            buckets = [spools]
        else:
            buckets = self._bucket_by_time(num_buckets)
        for bucket in buckets:
            cols = {c: s.read(0, s.rows) for c, s in bucket.items()}
            if bucket is not spools:
                for s in bucket.values():
                    s.remove()
            # Stable: a bucket holds its events in input order, so equal times keep it.
            perm = np.argsort(cols["t"], kind="stable")
            for start, stop in iter_ranges(perm.shape[0]):
                idx = perm[start:stop]
                yield {c: v[idx] for c, v in cols.items()}
            del cols, perm

    def _bucket_by_time(self, num_buckets: int) -> list[dict[str, _Spool]]:
        """Splits the spooled events into time ranges of about ``sort_budget_bytes`` each.

        Pivots are quantiles of a strided sample of t. All events of one time land in
        one bucket and every bucket keeps input order, so sorting each bucket in turn
        gives the global stable order.
        """
        spools = self._spools
        E = self._rows
        t_mm = np.memmap(spools["t"].path, dtype=spools["t"].dtype, mode="r", shape=(E,))
        step = max(1, E // (256 * num_buckets))
        sample = np.sort(np.array(t_mm[::step]))
        del t_mm
        pivots = unique_sorted(sample[(np.arange(1, num_buckets) * sample.size) // num_buckets])
        num_buckets = pivots.size + 1
        buckets = []
        for k in range(num_buckets):
            bdir = self._spool_dir / f"bucket{k}"
            bdir.mkdir()
            buckets.append({c: _Spool(bdir / c, s.row_shape) for c, s in spools.items()})
        for start, stop in iter_ranges(E):
            cols = {c: s.read(start, stop) for c, s in spools.items()}
            which = np.searchsorted(pivots, cols["t"], side="right")
            order = np.argsort(which, kind="stable")
            bounds = np.searchsorted(which[order], np.arange(num_buckets + 1))
            for k in range(num_buckets):  # a loop over buckets, not events
                lo, hi = bounds[k], bounds[k + 1]
                if hi > lo:
                    sel = order[lo:hi]
                    for c, v in cols.items():
                        buckets[k][c].append(v[sel])
        for bucket in buckets:
            for s in bucket.values():
                s.finish()
        # The raw spools are no longer needed; free their disk space early.
        for s in spools.values():
            s.remove()
        return [b for b in buckets if b["t"].rows > 0]

    def _write_split(self, E: int) -> dict[str, Any]:
        t = np.load(self._tmp / "t.npy", mmap_mode="r")
        # Rounded so that the defaults give DyGLib's literal 0.70 / 0.85 quantiles.
        train_frac = round(1.0 - self.val_frac - self.test_frac, 12)
        val_time = sorted_quantile(t, train_frac)
        test_time = sorted_quantile(t, round(1.0 - self.test_frac, 12))
        n_train = _count_le(t, val_time)
        n_train_val = _count_le(t, test_time)
        del t
        split = _NpyAppender(self._tmp / "split.npy", np.uint8, (E,))
        bounds = np.array([n_train, n_train_val])
        for start, stop in iter_ranges(E):
            split.append(np.searchsorted(bounds, np.arange(start, stop), side="right"))
        split.close()
        return {
            "method": "time_quantile",
            "fractions": [train_frac, self.val_frac, self.test_frac],
            "val_time": val_time,
            "test_time": test_time,
            "counts": {
                "train": n_train,
                "val": n_train_val - n_train,
                "test": E - n_train_val,
            },
        }


def _count_le(t: np.ndarray, value: float) -> int:
    """Number of elements of sorted ``t`` that are <= ``value``, without upcasting ``t``.

    Searching an int64 memmap for a float would make numpy convert the whole column;
    for integer t, ``t <= v`` is ``t <= floor(v)``.
    """
    if t.dtype.kind == "f":
        return int(np.searchsorted(t, np.float64(value), side="right"))
    return int(np.searchsorted(t, np.int64(math.floor(value)), side="right"))


def is_store(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder with a ``meta.json`` written by :class:`StoreWriter`."""
    meta = _read_json_object(Path(path) / "meta.json")
    return meta is not None and "num_events" in meta and "checksums" in meta and "split" in meta


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None where it is missing or not an object."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (symlinks resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def store_manifest(meta: dict[str, Any]) -> set[str]:
    """The names a store's writers put in its folder: ``meta.json`` and the column
    files its checksums list."""
    sums = meta.get("checksums")
    return {"meta.json", *(f"{c}.npy" for c in (sums if isinstance(sums, dict) else ()))}


def _is_store_file(manifest: set[str], name: str) -> bool:
    # write_eval_negatives' temporaries (".neg_val.npy.<tag>", ".meta.json.<tag>"),
    # left where it was killed between its two renames.
    temp = name.startswith((".neg_", ".meta.json.")) and name.count(".") >= 3
    return name in manifest or temp


def check_target(
    out_dir: str | os.PathLike[str],
    overwrite: bool,
    inputs: tuple[str | os.PathLike[str], ...] = (),
) -> dict[str, Any] | None:
    """Checks that a store may be written at ``out_dir``; nothing is changed.

    A missing folder or an empty one may always be written. ``overwrite`` replaces
    only an event store (a folder whose ``meta.json`` is one of ours) that holds
    nothing but the store's own files (:func:`store_manifest`), never an ordinary
    folder or file, never a store beside which the user keeps files of their own,
    and never a folder that holds one of ``inputs``.

    Args:
        out_dir: The target directory.
        overwrite: Whether an existing store may be replaced.
        inputs: Paths the command reads (the raw input file).

    Returns:
        The ``meta.json`` of the store that will be replaced, or None.

    Raises:
        SvenError: If the target may not be written.
    """
    out = Path(out_dir)
    for item in inputs:
        if _inside(Path(item), out):
            raise SvenError(f"--out {out} holds the input {item}; choose another folder")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    if not overwrite:
        raise SvenError(f"{out} already exists; pass --overwrite to replace it")
    if not is_store(out):
        raise SvenError(
            f"{out} is not an event store (no meta.json of Sven's); --overwrite only "
            "replaces an event store: remove it yourself or choose another --out"
        )
    meta = _read_json_object(out / "meta.json") or {}
    manifest = store_manifest(meta)
    foreign = foreign_files(out, lambda name: _is_store_file(manifest, name))
    if foreign:
        raise SvenError(refuse_foreign(out, foreign, "--overwrite"))
    return meta


def describe_replaced(out_dir: str | os.PathLike[str], meta: dict[str, Any]) -> str:
    """The line a command prints after replacing the store ``meta`` at ``out_dir``."""
    return (
        f"replaced the event store {meta.get('name')!r} at {out_dir} "
        f"({meta.get('num_events', '?'):,} events)"
        if isinstance(meta.get("num_events"), int)
        else f"replaced the event store at {out_dir}"
    )


def _check_target(out_dir: Path, overwrite: bool) -> None:
    check_target(out_dir, overwrite)


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Renames the finished temporary store into place (checked again: the user may
    have put a file into the old store meanwhile)."""
    _check_target(out_dir, overwrite)
    publish_partial(tmp, out_dir)


def write_events(
    out_dir: str | os.PathLike[str],
    src: np.ndarray,
    dst: np.ndarray,
    t: np.ndarray,
    *,
    edge_feat: np.ndarray | None = None,
    node_feat: np.ndarray | None = None,
    label: np.ndarray | None = None,
    id_map: np.ndarray | None = None,
    **kwargs: Any,
) -> TemporalEvents:
    """Writes in-memory event arrays as an event store (atomically).

    Args:
        out_dir: Target directory.
        src: (E,) source ids: raw ids to compact, or compact ids when ``num_nodes``,
            ``node_feat`` or ``id_map`` fixes the node set.
        dst: (E,) destination ids, like ``src``.
        t: (E,) int or float timestamps, in any order (sorted stably on write).
        edge_feat: (E, d_e) edge features.
        node_feat: (N, d_n) node features, row i for node i; fixes ``num_nodes = N``.
        label: (E,) per-event labels.
        id_map: (N,) raw id of each compact id, when ids are compact already.
        **kwargs: Further :class:`StoreWriter` options (``name``, ``num_nodes``,
            ``bipartite``, ``val_frac``, ``test_frac``, ``source``, ``overwrite``...).

    Returns:
        The written store, loaded memory-mapped.
    """
    n = np.shape(src)[0] if np.ndim(src) else 0
    # Checked up front: inside the chunk loop a short column would be reported per chunk.
    if np.shape(dst)[:1] != (n,) or np.shape(t)[:1] != (n,):
        raise DataError(f"src, dst and t differ in length: {n}, {np.shape(dst)}, {np.shape(t)}")
    if edge_feat is not None and np.shape(edge_feat)[:1] != (n,):
        raise DataError(f"{n} events but {np.shape(edge_feat)[0]} rows of edge features")
    if label is not None and np.shape(label)[:1] != (n,):
        raise DataError(f"{n} events but {np.shape(label)[0]} labels")
    with StoreWriter(out_dir, node_feat=node_feat, id_map=id_map, **kwargs) as writer:
        for start, stop in iter_ranges(n):
            writer.append(
                src[start:stop],
                dst[start:stop],
                t[start:stop],
                edge_feat=None if edge_feat is None else edge_feat[start:stop],
                label=None if label is None else label[start:stop],
            )
        return writer.close()


# meta.json keys every stage reads, with the JSON types they must have.
_META_KEYS: dict[str, tuple[type, ...]] = {
    "num_events": (int,),
    "num_nodes": (int,),
    "bipartite": (bool,),
    "split": (dict,),
    "checksums": (dict,),
}
# Allowed dtype kinds and dimensions of each column (see StoreWriter).
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


def _load_meta(path: Path) -> dict[str, Any]:
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


def _open_column(file: Path, mmap: bool) -> np.ndarray:
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


def _check_columns(path: Path, meta: dict[str, Any], columns: dict[str, np.ndarray]) -> None:
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


def _check_values(path: Path, meta: dict[str, Any], columns: dict[str, np.ndarray]) -> None:
    """Id ranges, time order and split labels, in one chunked pass per column."""
    N = meta["num_nodes"]
    for col in ("src", "dst"):
        a = columns[col]
        for start, stop in iter_ranges(a.shape[0]):
            chunk = a[start:stop]
            lo, hi = int(chunk.min()), int(chunk.max())
            if lo < 0 or hi >= N:
                i = start + _first_bad((chunk < 0) | (chunk >= N))
                raise DataError(
                    f"row {i}: node id {int(a[i])} outside [0, {N}) (num_nodes in meta.json)",
                    path / f"{col}.npy",
                )
    t = columns["t"]
    prev = None
    for start, stop in iter_ranges(t.shape[0]):
        chunk = np.asarray(t[start:stop])
        if t.dtype.kind == "f" and not np.isfinite(chunk).all():
            i = start + _first_bad(~np.isfinite(chunk))
            raise DataError(f"row {i}: time is {chunk[i - start]}", path / "t.npy")
        down = chunk[1:] < chunk[:-1]
        if prev is not None and chunk.size and chunk[0] < prev:
            raise DataError(f"row {start}: time goes backwards", path / "t.npy")
        if down.any():
            raise DataError(
                f"row {start + 1 + _first_bad(down)}: time goes backwards", path / "t.npy"
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
            i = start + _first_bad(bad)
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


def refuse_existing_negatives(
    path: str | os.PathLike[str], meta: dict[str, Any], split: str
) -> None:
    """Raises SvenError when the store at ``path`` (``meta``) has negatives of ``split``."""
    if split in meta.get("eval_negatives", {}) or (Path(path) / f"neg_{split}.npy").exists():
        raise SvenError(f"{path} already has {split} negatives; pass --overwrite to replace them")


def write_eval_negatives(
    path: str | os.PathLike[str],
    split: str,
    negatives: np.ndarray,
    source: dict[str, Any],
    *,
    overwrite: bool = False,
) -> None:
    """Adds fixed evaluation negatives of one split to a finished store.

    Writes ``neg_<split>.npy`` and records its width, its ``source`` and its checksum
    in ``meta.json``; both files are replaced by a rename, the column first, so an
    interruption leaves at worst a column whose checksum ``sven data verify`` rejects.

    Args:
        path: The store directory.
        split: ``"val"`` or ``"test"``.
        negatives: (n_split, q) int64 compact destination ids, -1 where an event has
            fewer than q.
        source: Where they came from (``{"path", "sha256"}``), kept in ``meta.json``.
        overwrite: Replace negatives the split already has.

    Raises:
        SvenError: The split has negatives and ``overwrite`` is False.
        DataError: The array does not fit the store.
    """
    if split not in NEG_SPLITS:
        raise ValueError(f"split must be one of {NEG_SPLITS}, got {split!r}")
    path = Path(path)
    with lock_folder(path, "sven data negatives"):
        _write_eval_negatives(path, split, negatives, source, overwrite)


def _write_eval_negatives(
    path: Path, split: str, negatives: np.ndarray, source: dict[str, Any], overwrite: bool
) -> None:
    meta = _load_meta(path)
    file = path / f"neg_{split}.npy"
    if not overwrite:
        refuse_existing_negatives(path, meta, split)
    neg = np.ascontiguousarray(negatives, dtype=np.int64)
    n = int(meta["split"]["counts"][split])
    if neg.ndim != 2 or neg.shape[0] != n:
        raise DataError(f"{split} negatives of shape {neg.shape}, the split has {n} events", path)
    if neg.size and (neg.min() < -1 or neg.max() >= meta["num_nodes"]):
        raise DataError(f"{split} negatives outside [-1, {meta['num_nodes']})", path)
    tag = uuid.uuid4().hex[:12]
    tmp_col = path / f".{file.name}.{tag}"
    tmp_meta = path / f".meta.json.{tag}"
    try:
        with open(tmp_col, "wb") as f:  # a handle: np.save would append ".npy"
            np.save(f, neg, allow_pickle=False)
        meta.setdefault("eval_negatives", {})[split] = {"q": int(neg.shape[1]), "source": source}
        meta["checksums"][file.stem] = sha256_file(tmp_col)
        with open(tmp_meta, "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        os.replace(tmp_col, file)
        os.replace(tmp_meta, path / "meta.json")
    finally:
        for t in (tmp_col, tmp_meta):
            t.unlink(missing_ok=True)


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
        meta = _load_meta(path)
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
    # parallel threads, so the wall time is that of the largest file.
    workers = max(1, min(len(files), os.cpu_count() or 1, 8))
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


def open_verified_store(
    path: str | os.PathLike[str], *, verify: bool = True, hint: str = ""
) -> TemporalEvents:
    """Opens a store for a command that reads it: the one check every reader shares.

    The structure (headers, dtypes, shapes, byte counts), the values (id ranges, time
    order, split labels) and, with ``verify``, every file's sha256 against
    ``meta.json`` (:func:`verify_checksums`), so that a byte changed on disk is found
    before it partitions, trains or evaluates anything. Structure first: a truncated
    column is reported as truncated, not as a checksum mismatch.

    Args:
        path: The store directory.
        verify: Also compare the checksums (reads every byte once).
        hint: Added in parentheses to a checksum error (how to go on anyway).

    Returns:
        The store, memory-mapped.

    Raises:
        DataError: The store is damaged; the message names the file.
    """
    events = TemporalEvents.load(path)
    if verify:
        verify_store(events, hint)
    return events


def verify_store(events: TemporalEvents, hint: str = "") -> None:
    """The checksum half of :func:`open_verified_store`, for an opened store (a caller
    that times the two halves apart).

    Raises:
        DataError: A file's sha256 differs from ``meta.json``; ``hint`` in parentheses.
    """
    try:
        verify_checksums(events.path, events.meta)
    except DataError as exc:
        if not hint:
            raise
        raise DataError(f"{exc} ({hint})") from None


class TemporalEvents:
    """An event store, its columns memory-mapped (see :class:`StoreWriter` for the format).

    Attributes:
        path: The store directory.
        meta: The parsed ``meta.json``.
        src, dst: (E,) int32/int64 compact node ids.
        t: (E,) int64 or float64 non-decreasing timestamps.
        split: (E,) uint8, 0 train, 1 val, 2 test.
        edge_feat: (E, d_e) float32 or None.
        node_feat: (N, d_n) float32 or None.
        label: (E,) labels or None.
        id_map: (N,) raw id of each compact id.
        eval_negatives: ``"val"``/``"test"`` -> (n_split, q) int64 fixed MRR negatives
            of the split's events (-1 padded), for the splits that have them.
    """

    _COLUMNS = (
        "src",
        "dst",
        "t",
        "split",
        "edge_feat",
        "node_feat",
        "label",
        "id_map",
        "neg_val",
        "neg_test",
    )
    _OPTIONAL = ("edge_feat", "node_feat", "label", "neg_val", "neg_test")

    def __init__(self, path: Path, meta: dict[str, Any], columns: dict[str, np.ndarray]) -> None:
        self.path = path
        self.meta = meta
        self.src: np.ndarray = columns["src"]
        self.dst: np.ndarray = columns["dst"]
        self.t: np.ndarray = columns["t"]
        self.split: np.ndarray = columns["split"]
        self.edge_feat: np.ndarray | None = columns.get("edge_feat")
        self.node_feat: np.ndarray | None = columns.get("node_feat")
        self.label: np.ndarray | None = columns.get("label")
        self.id_map: np.ndarray = columns["id_map"]
        self.eval_negatives: dict[str, np.ndarray] = {
            s: columns[f"neg_{s}"] for s in NEG_SPLITS if f"neg_{s}" in columns
        }

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        mmap: bool = True,
        verify: bool = False,
        check_values: bool = True,
    ) -> TemporalEvents:
        """Opens a store, checking its structure.

        Always checked (cheap: no column is read): ``meta.json`` is an object with
        the keys every stage reads; every ``.npy`` has a valid header, the dtype and
        shape of the format, and exactly the bytes its header announces; row counts
        match ``meta.json``. With ``check_values`` (one streaming pass over the
        columns): node ids lie in ``[0, num_nodes)``, times do not decrease, and
        ``split.npy`` agrees with the split counts.

        Args:
            path: The store directory.
            mmap: Memory-map the columns (default); False reads them into memory.
            verify: Recompute every file's sha256 and compare with ``meta.json``
                (reads every byte; see :func:`verify_checksums`).
            check_values: Also check id ranges, time order and split labels.

        Raises:
            DataError: if the directory is not a valid store of a known version; the
                message names the file.
        """
        path = Path(path)
        meta = _load_meta(path)
        if verify:
            verify_checksums(path, meta)
        columns: dict[str, np.ndarray] = {}
        for col in cls._COLUMNS:
            file = path / f"{col}.npy"
            if not file.exists():
                if col in cls._OPTIONAL:
                    continue
                raise DataError(f"missing column file {file.name}", path)
            columns[col] = _open_column(file, mmap)
        _check_columns(path, meta, columns)
        if check_values:
            _check_values(path, meta, columns)
        return cls(path, meta, columns)

    @property
    def num_events(self) -> int:
        return int(self.meta["num_events"])

    @property
    def num_nodes(self) -> int:
        return int(self.meta["num_nodes"])

    @property
    def bipartite(self) -> bool:
        return bool(self.meta["bipartite"])

    @property
    def num_src_nodes(self) -> int | None:
        """Bipartite graphs: sources are ``0..num_src_nodes-1``; else None."""
        return self.meta.get("num_src_nodes")

    def __len__(self) -> int:
        return self.num_events

    def __repr__(self) -> str:
        return (
            f"TemporalEvents({str(self.path)!r}, events={self.num_events}, "
            f"nodes={self.num_nodes}, bipartite={self.bipartite})"
        )

    def split_range(self, split: str) -> tuple[int, int]:
        """Half-open event index range ``(start, stop)`` of ``"train"``, ``"val"`` or ``"test"``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        counts = self.meta["split"]["counts"]
        start = 0
        for name in SPLITS:
            stop = start + int(counts[name])
            if name == split:
                return start, stop
            start = stop
        raise AssertionError("unreachable")

    def seen_in(self, split: str = "train") -> np.ndarray:
        """(N,) bool: the nodes that occur in an event of ``split``."""
        seen = np.zeros(self.num_nodes, dtype=bool)
        start, stop = self.split_range(split)
        for lo, hi in iter_ranges(stop - start):
            seen[self.src[start + lo : start + hi]] = True
            seen[self.dst[start + lo : start + hi]] = True
        return seen

    def inductive_mask(self, split: str = "test") -> np.ndarray:
        """(n_split,) bool: events of ``split`` with an endpoint never seen in training."""
        seen = self.seen_in("train")
        start, stop = self.split_range(split)
        mask = np.empty(stop - start, dtype=bool)
        for lo, hi in iter_ranges(stop - start):  # chunks: the columns may not fit in RAM
            src = self.src[start + lo : start + hi]
            dst = self.dst[start + lo : start + hi]
            mask[lo:hi] = ~seen[src] | ~seen[dst]
        return mask

    def to_pyg(self) -> TemporalData:
        """Copies the events into a ``torch_geometric.data.TemporalData``.

        ``src``, ``dst``, ``t`` (int64 or float64), ``msg`` (edge features), ``y``
        (labels) and ``x`` (node features) as tensors; absent columns are left out.
        """
        import torch
        from torch_geometric.data import TemporalData

        def tensor(a: np.ndarray, dtype: Any = None) -> torch.Tensor:
            return torch.from_numpy(np.array(a, dtype=dtype))

        data = TemporalData(
            src=tensor(self.src, np.int64), dst=tensor(self.dst, np.int64), t=tensor(self.t)
        )
        if self.edge_feat is not None:
            data.msg = tensor(self.edge_feat)
        if self.label is not None:
            data.y = tensor(self.label)
        if self.node_feat is not None:
            data.x = tensor(self.node_feat)
        return data

    @classmethod
    def from_pyg(
        cls, data: TemporalData, out_dir: str | os.PathLike[str], **kwargs: Any
    ) -> TemporalEvents:
        """Writes a ``TemporalData`` (``src``, ``dst``, ``t``, optional ``msg``, ``y``,
        ``x``) as a store; ``kwargs`` go to :func:`write_events`.

        Node ids are taken as compact with ``num_nodes = max id + 1`` (PyG's own
        convention), or ``x.shape[0]`` when node features are present.
        """

        def array(key: str) -> np.ndarray | None:
            value = getattr(data, key, None)
            return None if value is None else value.detach().cpu().numpy()

        src, dst, t = array("src"), array("dst"), array("t")
        if src is None or dst is None or t is None:
            raise DataError("TemporalData needs src, dst and t")
        x = array("x")
        if x is None and "num_nodes" not in kwargs:
            kwargs["num_nodes"] = int(max(src.max(initial=-1), dst.max(initial=-1))) + 1
        kwargs.setdefault("source", {"format": "pyg"})
        return write_events(
            out_dir, src, dst, t, edge_feat=array("msg"), label=array("y"), node_feat=x, **kwargs
        )
