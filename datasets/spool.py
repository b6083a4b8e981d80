"""Column files written chunk by chunk, and their stable sort by time.

The writer's bounded-memory storage. :class:`Spool` holds a column as it arrives, in
input order, in a headerless file whose dtype may still widen; :func:`sorted_stream`
reads the spooled columns back in stable time order, sorting out of core by time
buckets when they do not fit the sort budget; :class:`NpyAppender` writes a finished
``.npy`` column of known shape by appending chunks. None keeps more than a chunk (or
a bucket) in memory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sven.datasets.compact import unique_sorted
from sven.datasets.layout import iter_ranges

__all__ = ["NpyAppender", "Spool", "sorted_stream"]


class Spool:
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


class NpyAppender:
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


def sorted_stream(
    spools: dict[str, Spool], in_order: bool, sort_budget_bytes: int, spool_dir: Path
) -> Iterator[dict[str, np.ndarray]]:
    """Yields the spooled events in stable time order, in chunks of all columns.

    Args:
        spools: Column name -> its spool, every one of E rows; ``"t"`` among them.
        in_order: The events are in time order already: read them as they are.
        sort_budget_bytes: Event rows sorted in memory at once; more are first
            bucketed by time on disk, in ``spool_dir``, and sorted bucket by bucket.
        spool_dir: A scratch folder for the buckets.
    """
    E = spools["t"].rows
    if in_order:
        for start, stop in iter_ranges(E):
            yield {c: s.read(start, stop) for c, s in spools.items()}
        return
    row_bytes = sum(s.row_bytes for s in spools.values())
    num_buckets = max(1, math.ceil(E * row_bytes / sort_budget_bytes))
    if num_buckets == 1:
        buckets = [spools]
    else:
        buckets = _bucket_by_time(spools, num_buckets, spool_dir)
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


def _bucket_by_time(
    spools: dict[str, Spool], num_buckets: int, spool_dir: Path
) -> list[dict[str, Spool]]:
    """Splits the spooled events into time ranges of about ``sort_budget_bytes`` each.

    Pivots are quantiles of a strided sample of t. All events of one time land in
    one bucket and every bucket keeps input order, so sorting each bucket in turn
    gives the global stable order.
    """
    E = spools["t"].rows
    t_mm = np.memmap(spools["t"].path, dtype=spools["t"].dtype, mode="r", shape=(E,))
    step = max(1, E // (256 * num_buckets))
    sample = np.sort(np.array(t_mm[::step]))
    del t_mm
    pivots = unique_sorted(sample[(np.arange(1, num_buckets) * sample.size) // num_buckets])
    num_buckets = pivots.size + 1
    buckets = []
    for k in range(num_buckets):
        bdir = spool_dir / f"bucket{k}"
        bdir.mkdir()
        buckets.append({c: Spool(bdir / c, s.row_shape) for c, s in spools.items()})
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
