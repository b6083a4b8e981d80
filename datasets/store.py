"""The event store as every stage uses it: opened, read, and written.

A store is one directory with ``meta.json`` and one ``.npy`` file per column; its
layout is fixed by ``docs/contracts.md`` and documented in
:class:`~sven.datasets.writer.StoreBuilder`. Every later stage (partitioning,
sampling, training) reads events through :class:`TemporalEvents`, which memory-maps
the columns so that datasets larger than RAM work; a command that reads a store opens
it with :func:`open_verified_store`, which also compares every file with its checksum.
Stores are written either from arrays in memory (:func:`write_events`) or streamed
chunk by chunk from a raw file (:class:`StoreWriter`); both go through the same
writer, so both produce byte-identical stores for the same events.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sven.datasets.checksums import verify_checksums
from sven.datasets.layout import (
    NEG_SPLITS,
    SPLITS,
    check_column_values,
    check_columns,
    iter_ranges,
    load_meta,
    open_column,
)
from sven.datasets.writer import StoreBuilder
from sven.errors import DataError

if TYPE_CHECKING:
    from torch_geometric.data import TemporalData

__all__ = [
    "StoreWriter",
    "TemporalEvents",
    "open_verified_store",
    "verify_store",
    "write_events",
]


class StoreWriter(StoreBuilder):
    """Streams events into an event store directory; :meth:`close` opens the result.

    The format, the arguments, the memory bound and the atomicity are those of
    :class:`~sven.datasets.writer.StoreBuilder`.
    """

    def close(self) -> TemporalEvents:
        """Sorts, compacts, splits, checksums and renames the store into place.

        Returns:
            The finished store, loaded memory-mapped.
        """
        super().close()
        # Just written and checked value by value on append: the structure is enough.
        return TemporalEvents.load(self.out_dir, check_values=False)


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
        meta = load_meta(path)
        if verify:
            verify_checksums(path, meta)
        columns: dict[str, np.ndarray] = {}
        for col in cls._COLUMNS:
            file = path / f"{col}.npy"
            if not file.exists():
                if col in cls._OPTIONAL:
                    continue
                raise DataError(f"missing column file {file.name}", path)
            columns[col] = open_column(file, mmap)
        check_columns(path, meta, columns)
        if check_values:
            check_column_values(path, meta, columns)
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
