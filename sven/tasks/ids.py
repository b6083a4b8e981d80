"""Raw ids and compact ones: the user's ids (as in the converted file) through the
event store's id map, per side on a bipartite store."""

from __future__ import annotations

from typing import Any

import numpy as np

from sven.errors import ConfigError

__all__ = ["IdMaps"]


class IdMaps:
    """Raw id <-> compact id through the store's id map, per side on a bipartite store."""

    def __init__(self, events: Any) -> None:
        self.id_map = np.asarray(events.id_map)
        n = self.id_map.size
        u = events.num_src_nodes if events.bipartite else None
        self.bipartite = u is not None
        self.sides = {"all": (0, n)} if u is None else {"src": (0, int(u)), "dst": (int(u), n)}
        self._sorted: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
        self._runs: dict[str, bool] = {}

    def _table(self, side: str) -> tuple[np.ndarray, np.ndarray | None, int]:
        """The side's raw ids ascending, the compact id (minus the side's first) of each
        (None: the id map is ascending already, searched where it lies, memory-mapped),
        and the side's first compact id."""
        lo, hi = self.sides[side]
        if side not in self._sorted:
            part = self.id_map[lo:hi]
            if _ascending(part):
                self._sorted[side] = (part, None)
            else:
                # An id map in first-appearance order: sorted once, N keys and N ids.
                order = np.argsort(part, kind="stable")
                self._sorted[side] = (part[order], order)
        return (*self._sorted[side], lo)

    def lookup(self, raw: np.ndarray, side: str) -> tuple[np.ndarray, np.ndarray]:
        if side not in ("auto", "src", "dst"):
            raise ConfigError(f"side must be auto, src or dst, got {side!r}")
        if not self.bipartite:
            side = "all"
        elif side == "auto":
            raise ConfigError(
                "this store is bipartite (sources and destinations number their ids "
                "separately): say which side the ids are on (--side src or --side dst)"
            )
        keys, order, offset = self._table(side)
        q = _as_keys(raw, keys.dtype)
        known = np.zeros(raw.size, dtype=bool)
        out = np.full(raw.size, -1, dtype=np.int64)
        valid = np.flatnonzero(q[1])
        if keys.size and valid.size:
            want = q[0][valid]
            if self._dense(side, keys):
                # Consecutive integers: an id's place is its distance from the first.
                pos_c = want.astype(np.int64) - int(keys[0])
                hit = (pos_c >= 0) & (pos_c < keys.size)
            else:
                pos = self._search(keys, want)
                pos_c = np.minimum(pos, keys.size - 1)
                hit = (pos < keys.size) & (keys[pos_c] == want)
            known[valid[hit]] = True
            out[valid[hit]] = offset + (pos_c[hit] if order is None else order[pos_c[hit]])
        return out, known

    def _search(self, keys: np.ndarray, q: np.ndarray) -> np.ndarray:
        """``np.searchsorted(keys, q)``, ``q`` searched for in ascending order then put
        back: random searches of a large memory-mapped id map each walk it from its
        middle, where ascending ones go on from where the last one ended."""
        by = np.argsort(q, kind="stable")
        pos = np.empty(q.size, dtype=np.int64)
        pos[by] = np.searchsorted(keys, q[by])
        return pos

    def _dense(self, side: str, keys: np.ndarray) -> bool:
        """Whether the side's ``keys`` are consecutive integers (checked once a side)."""
        if side not in self._runs:
            self._runs[side] = (
                keys.dtype.kind in "iu"
                and int(keys[-1]) - int(keys[0]) == keys.size - 1
                and _ascending(keys, strict=True)
            )
        return self._runs[side]

    def raw(self, compact: np.ndarray) -> np.ndarray:
        return self.id_map[compact]


#: Ids compared per chunk when checking that an id map is ascending.
_CHUNK = 1 << 16


def _ascending(ids: np.ndarray, strict: bool = False) -> bool:
    """Whether ``ids`` (a memory-mapped column) is non-decreasing (``strict``:
    increasing), a chunk at a time."""
    for a in range(0, ids.shape[0], _CHUNK):
        c = np.asarray(ids[max(a - 1, 0) : a + _CHUNK])
        # One chunk's flags at a time (a name kept across chunks would hold two).
        if c.size > 1 and not bool(np.all(c[1:] > c[:-1] if strict else c[1:] >= c[:-1])):
            return False
    return True


def _as_keys(raw: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The user's ids in the id map's dtype, and which of them could be converted."""
    raw = np.asarray(raw).reshape(-1)
    if dtype.kind in "iu":
        ok = np.ones(raw.size, dtype=bool)
        if raw.dtype.kind in "iu":
            return raw.astype(np.int64), ok
        if raw.dtype.kind in "OUS":
            # Text of integers (a csv's id column) parsed by numpy at once; anything else
            # (text of floats, numbers of other types) one by one below.
            try:
                return raw.astype(str).astype(np.int64), ok
            except (ValueError, TypeError, OverflowError):
                pass
        vals = np.zeros(raw.size, dtype=np.int64)
        for i, x in enumerate(raw):
            try:
                f = float(x)
                ok[i] = f.is_integer()
                vals[i] = int(f) if ok[i] else 0
            except (TypeError, ValueError):
                ok[i] = False
        return vals, ok
    return raw.astype(str), np.ones(raw.size, dtype=bool)
