"""Writing an event store: the on-disk format, and the writer that streams it to disk.

:class:`StoreBuilder` documents the format (version 1) and does the work: it checks
each appended chunk, spools the columns to disk (:mod:`~sven.datasets.spool`), and on
closing sorts the events by time, compacts the node ids
(:mod:`~sven.datasets.compact`), writes the split, the checksums and ``meta.json`` and
renames the finished folder into place. Users write through its subclass
:class:`~sven.datasets.store.StoreWriter`, whose ``close`` returns the opened store, or
through :func:`~sven.datasets.store.write_events`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from sven.datasets.compact import DistinctValues, IdSpace
from sven.datasets.layout import FORMAT_VERSION, INT32_LIMIT, first_bad, iter_ranges
from sven.datasets.splits import write_split
from sven.datasets.spool import NpyAppender, Spool, sorted_stream
from sven.datasets.target import check_target
from sven.digest import sha256_file
from sven.errors import ConfigError, DataError, SvenError
from sven.ownership import (
    discard_partial,
    lock_folder,
    make_partial,
    publish_partial,
    report_swept,
    sweep_partials,
)

__all__ = ["SORT_BUDGET_BYTES", "StoreBuilder"]

# Bytes of event rows sorted in memory at once; unsorted inputs larger than this are
# sorted out of core by time buckets (see sven.datasets.spool.sorted_stream).
SORT_BUDGET_BYTES = 1 << 30
_INT64_MAX = np.iinfo(np.int64).max

_B = TypeVar("_B", bound="StoreBuilder")


class StoreBuilder:
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
    :func:`~sven.datasets.negatives.write_eval_negatives` adds them to a finished
    store (``sven data negatives``) with ``meta.json``'s ``eval_negatives``
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
        check_target(self.out_dir, overwrite)  # early, before the arguments' checks
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
            check_target(self.out_dir, overwrite)
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
        self._spools: dict[str, Spool] = {
            "src": Spool(self._spool_dir / "src"),
            "dst": Spool(self._spool_dir / "dst"),
            "t": Spool(self._spool_dir / "t"),
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
                "edge_feat", Spool(self._spool_dir / "edge_feat", edge_feat.shape[1:])
            ).append(edge_feat)
        if label is not None:
            self._spools.setdefault("label", Spool(self._spool_dir / "label")).append(label)
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
                i = first_bad(a > _INT64_MAX)
                raise DataError(f"{self._where(i)}: {what} id {a[i]} overflows int64")
            a = a.astype(np.int64, copy=False)
            if a.size and a.min() < 0:
                i = first_bad(a < 0)
                raise DataError(f"{self._where(i)}: negative {what} id {a[i]}")
            if self.num_nodes is not None and a.size and a.max() >= self.num_nodes:
                i = first_bad(a >= self.num_nodes)
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
                i = first_bad(a > _INT64_MAX)
                raise DataError(f"{self._where(i)}: time {a[i]} overflows int64")
            return a.astype(np.int64, copy=False)
        if a.dtype.kind == "f":
            a = a.astype(np.float64, copy=False)
            if not np.isfinite(a).all():
                i = first_bad(~np.isfinite(a))
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

    def __enter__(self: _B) -> _B:
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

    def close(self) -> None:
        """Sorts, compacts, splits, checksums and renames the store into place."""
        if self._closed:
            raise RuntimeError("StoreWriter is closed")
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._lock.release()

    def _finish(self) -> None:
        """Writes the store's files into the temporary folder and publishes it."""
        E = self._rows
        if E == 0:
            raise DataError("no events")
        for spool in self._spools.values():
            spool.finish()
        spaces = self._id_spaces()
        in_order = self._num_out_of_order == 0
        out = self._tmp
        t_dtype = np.dtype(np.float64 if self._spools["t"].dtype.kind == "f" else np.int64)
        N = self._final_num_nodes(spaces)
        columns = self._column_writers(t_dtype)
        ids = _IdColumns(out, E, N, spaces, self.bipartite)
        sorted_ids = self._write_sorted(spaces, in_order, columns, ids)
        self._write_table_ids(spaces, sorted_ids, ids)
        shutil.rmtree(self._spool_dir)
        np.save(out / "id_map.npy", self._id_map(spaces, N))
        if self.node_feat is not None:
            self._write_node_feat(N)
        meta = self._meta(N, t_dtype, spaces, ids.extrema)
        meta["checksums"] = {p.stem: sha256_file(p) for p in sorted(out.glob("*.npy"))}
        with open(out / "meta.json", "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        _publish(self._tmp, self.out_dir, self.overwrite)

    def _column_writers(self, t_dtype: np.dtype) -> dict[str, NpyAppender]:
        """The writers of the columns other than the ids: t, and edge_feat and label
        where the events have them."""
        E, out = self._rows, self._tmp
        writers = {"t": NpyAppender(out / "t.npy", t_dtype, (E,))}
        if "edge_feat" in self._spools:
            shape = (E, *self._spools["edge_feat"].row_shape)
            writers["edge_feat"] = NpyAppender(out / "edge_feat.npy", np.float32, shape)
        if "label" in self._spools:
            kind = self._spools["label"].dtype.kind
            dtype = np.float32 if kind == "f" else np.int64
            writers["label"] = NpyAppender(out / "label.npy", dtype, (E,))
        return writers

    def _write_sorted(
        self,
        spaces: dict[str, IdSpace],
        in_order: bool,
        columns: dict[str, NpyAppender],
        ids: _IdColumns,
    ) -> dict[str, Spool] | None:
        """Pass 1: the time-sorted stream into ``columns``, and into ``ids`` where the
        ids' mapping is known already.

        Where an id space numbers by first appearance (its mapping known only at the
        end), its ids are observed instead, and spooled (sorted, raw) for pass 2
        unless the input spools are in time order already.

        Returns:
            The spools of the sorted raw ids, or None where pass 2 needs none.
        """
        needs_table = any(s.kind == "table" for s in spaces.values())
        sorted_ids = None
        if needs_table and not in_order:
            sorted_ids = {c: Spool(self._spool_dir / f"sorted_{c}") for c in ("src", "dst")}
        offset = 0
        for chunk in sorted_stream(self._spools, in_order, self.sort_budget_bytes, self._spool_dir):
            n = chunk["t"].shape[0]
            for col, w in columns.items():
                w.append(chunk[col])
            if not needs_table:
                ids.write(chunk)
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
        for w in columns.values():
            w.close()
        return sorted_ids

    def _write_table_ids(
        self,
        spaces: dict[str, IdSpace],
        sorted_ids: dict[str, Spool] | None,
        ids: _IdColumns,
    ) -> None:
        """Pass 2: the first-appearance numbering is complete; maps the sorted raw ids
        (``sorted_ids``, or the input spools where those were in order)."""
        for space in spaces.values():
            space.prepare()
        if any(s.kind == "table" for s in spaces.values()):
            source = sorted_ids if sorted_ids is not None else self._spools
            for spool in (source["src"], source["dst"]):
                spool.finish()
            for start, stop in iter_ranges(self._rows):
                ids.write({c: source[c].read(start, stop) for c in ("src", "dst")})
        ids.close()

    def _write_node_feat(self, N: int) -> None:
        """Copies the (N, d_n) node features as float32, checking they are finite."""
        node_out = NpyAppender(self._tmp / "node_feat.npy", np.float32, self.node_feat.shape)
        for start, stop in iter_ranges(N):
            rows = np.asarray(self.node_feat[start:stop], dtype=np.float32)
            if not np.isfinite(rows).all():
                i = start + int(np.flatnonzero(~np.isfinite(rows).all(axis=1))[0])
                raise DataError(f"node {i}: node features contain NaN/inf")
            node_out.append(rows)
        node_out.close()

    def _meta(
        self, N: int, t_dtype: np.dtype, spaces: dict[str, IdSpace], extrema: dict[str, int]
    ) -> dict[str, Any]:
        """``meta.json`` but its checksums; writes the split on the way."""
        E, out = self._rows, self._tmp
        split_meta = write_split(out, E, self.val_frac, self.test_frac)
        bipartite, num_src = self._bipartite_result(spaces, extrema)
        t = np.load(out / "t.npy", mmap_mode="r")
        return {
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
            "sorted_on_ingest": self._num_out_of_order != 0,
            "num_out_of_order": self._num_out_of_order,
        }

    def _id_spaces(self) -> dict[str, IdSpace]:
        """The id spaces to compact; empty when ids are compact already."""
        if self.num_nodes is not None:
            return {}
        if not self.bipartite:
            return {"src": IdSpace(self._distinct["src"].result(), 0)}
        users = IdSpace(self._distinct["src"].result(), 0)
        # Destination ids that already continue the source range (JODIE's offset
        # Wikipedia copy) are kept; 0-based ones are offset after the sources.
        items = IdSpace(self._distinct["dst"].result(), users.n, allow_shift=True)
        return {"src": users, "dst": items}

    def _final_num_nodes(self, spaces: dict[str, IdSpace]) -> int:
        if self.num_nodes is not None:
            return self.num_nodes
        return sum(s.n for s in spaces.values())

    def _id_map(self, spaces: dict[str, IdSpace], N: int) -> np.ndarray:
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
        self, spaces: dict[str, IdSpace], extrema: dict[str, int]
    ) -> tuple[bool, int | None]:
        if self.bipartite and spaces:
            return True, spaces["src"].n
        ordered = extrema["src_max"] < extrema["dst_min"]
        if self.bipartite and not ordered:
            raise DataError("declared bipartite, but a source id is not below every destination id")
        if self.bipartite is False or not ordered:
            return False, None
        return True, extrema["src_max"] + 1


class _IdColumns:
    """The src and dst columns of compact ids, written chunk by chunk.

    Args:
        out: The store's folder.
        num_events: E.
        num_nodes: N; ids are int32 below 2^31 nodes, else int64.
        spaces: The id spaces that map raw ids to compact ones; empty where the ids
            are compact already.
        bipartite: Whether destinations have an id space of their own.

    Attributes:
        extrema: ``src_max``, the largest compact source id, and ``dst_min``, the
            smallest compact destination id, over the chunks written.
    """

    def __init__(
        self,
        out: Path,
        num_events: int,
        num_nodes: int,
        spaces: dict[str, IdSpace],
        bipartite: bool | None,
    ) -> None:
        dtype = np.dtype(np.int32 if num_nodes < INT32_LIMIT else np.int64)
        self._writers = {
            c: NpyAppender(out / f"{c}.npy", dtype, (num_events,)) for c in ("src", "dst")
        }
        self._spaces = spaces
        self._bipartite = bipartite
        self.extrema = {"src_max": -1, "dst_min": num_nodes}

    def write(self, chunk: dict[str, np.ndarray]) -> None:
        """Maps and appends a chunk's (n,) raw ``src`` and ``dst``."""
        for col, key in (("src", "src"), ("dst", "dst" if self._bipartite else "src")):
            compact = self._spaces[key].map(chunk[col]) if self._spaces else chunk[col]
            if col == "src":
                self.extrema["src_max"] = max(self.extrema["src_max"], int(compact.max()))
            else:
                self.extrema["dst_min"] = min(self.extrema["dst_min"], int(compact.min()))
            self._writers[col].append(compact)

    def close(self) -> None:
        """Finishes both files."""
        for w in self._writers.values():
            w.close()


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Renames the finished temporary store into place (checked again: the user may
    have put a file into the old store meanwhile)."""
    check_target(out_dir, overwrite)
    publish_partial(tmp, out_dir)
