"""Compact node ids: the distinct raw ids of a stream and their numbering 0..N-1.

:class:`DistinctValues` collects the sorted distinct ids of a stream of chunks;
:class:`IdSpace` numbers one id space (all nodes, or one side of a bipartite graph)
and maps raw ids to compact ones, chunk by chunk. Both are vectorized: no Python set
or dict holds node ids.
"""

from __future__ import annotations

import numpy as np

from sven.datasets.layout import INT32_LIMIT

__all__ = ["DistinctValues", "IdSpace", "unique_sorted"]


def unique_sorted(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` by sorting.

    numpy 2's hash-based ``np.unique`` is an order of magnitude slower than a sort on
    the integer id columns seen here (docs/data.md, "Memory and speed").
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


class IdSpace:
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
                dtype = np.int32 if base + self.n < INT32_LIMIT else np.int64
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
