"""DyGLib and TGL datasets: an event table with its edge and node feature files beside it.

- ``dyglib``: ``ml_<name>.csv`` (header ``,u,i,ts,label,idx``; 1-based ids, 0 is
  padding) with ``ml_<name>.npy`` edge and ``ml_<name>_node.npy`` node features.
- ``tgl``: TGL's ``edges.csv`` (``[,]src,dst,time,int_roll,ext_roll``) with optional
  ``edge_features.pt`` / ``node_features.pt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sven.datasets.delimited import BLOCK_BYTES, DelimitedText
from sven.datasets.fields import Where, parse_ids, parse_labels, parse_times
from sven.datasets.rawreader import EventChunk, TextReader, header_index
from sven.errors import DataError

__all__ = ["DyGLibReader", "TGLReader"]


class DyGLibReader(TextReader):
    """DyGLib's ``ml_<name>.csv`` with ``ml_<name>.npy`` and ``ml_<name>_node.npy``.

    Ids are 1-based (0 is DyGLib's padding) and are stored 0-based, with the
    original ids in ``id_map``. Feature row 0 of both ``.npy`` files is padding and
    dropped; edge features are looked up by the ``idx`` column.
    """

    def __init__(self, path: Path, *, block_bytes: int = BLOCK_BYTES) -> None:
        text = DelimitedText(path, sep=",", header=True, block_bytes=block_bytes)
        assert text.header is not None
        text.ncols = len(text.header)
        stem = path.name
        for suffix in (".gz", ".xz", ".bz2"):
            stem = stem.removesuffix(suffix)
        stem = stem.removesuffix(".csv")
        self.cols = {
            key: header_index(text.header, [key], path, key)
            for key in ("u", "i", "ts", "label", "idx")
        }
        edge_path = path.with_name(stem + ".npy")
        node_path = path.with_name(stem + "_node.npy")
        self.edge_path = edge_path if edge_path.exists() else None
        self.edge_feat = _load_npy(edge_path) if self.edge_path else None
        options: dict[str, Any] = {}
        if node_path.exists():
            node_feat = _load_npy(node_path)
            if node_feat.ndim != 2 or node_feat.shape[0] < 2:
                raise DataError(
                    f"expected (N + 1, d) node features with a padding row 0, "
                    f"got shape {node_feat.shape}",
                    node_path,
                )
            num_nodes = node_feat.shape[0] - 1
            options = {
                "node_feat": node_feat[1:],
                "id_map": np.arange(1, num_nodes + 1, dtype=np.int64),
            }
            self.node_path: Path | None = node_path
        else:
            options = {"raw_id_offset": 1}
            self.node_path = None
        super().__init__(path, "dyglib", text, writer_options=options)
        self.name = stem.removeprefix("ml_")

    def _chunk(self, frame: pd.DataFrame, where: Where) -> EventChunk:
        c = self.cols
        src = parse_ids(frame[c["u"]], "source", where)
        dst = parse_ids(frame[c["i"]], "destination", where)
        for ids, what in ((src, "source"), (dst, "destination")):
            if (ids == 0).any():
                i = int(np.flatnonzero(ids == 0)[0])
                raise where.fail(i, f"{what} id 0 is DyGLib's padding id (ids are 1-based)")
        if self.node_path is not None:
            limit = self.writer_options["node_feat"].shape[0]
            over = np.maximum(src, dst) > limit
            if over.any():
                i = int(np.flatnonzero(over)[0])
                raise where.fail(
                    i,
                    f"node id {max(src[i], dst[i])} has no row in {self.node_path.name} "
                    f"({limit} nodes)",
                )
        edge_feat = None
        if self.edge_feat is not None:
            idx = parse_ids(frame[c["idx"]], "idx", where)
            bad = (idx == 0) | (idx >= self.edge_feat.shape[0])
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise where.fail(
                    i,
                    f"idx {idx[i]} has no row in {self.edge_path.name if self.edge_path else ''} "
                    f"({self.edge_feat.shape[0]} rows, row 0 padding)",
                )
            edge_feat = np.asarray(self.edge_feat[idx], dtype=np.float32)
        return EventChunk(
            src=src - 1,
            dst=dst - 1,
            t=parse_times(frame[c["ts"]], where),
            label=parse_labels(frame[c["label"]], where),
            edge_feat=edge_feat,
        )

    def check_complete(self, num_events: int) -> None:
        if self.edge_feat is not None and self.edge_feat.shape[0] != num_events + 1:
            raise DataError(
                f"{self.edge_feat.shape[0]} edge feature rows (with the padding row 0) "
                f"for {num_events} events; expected {num_events + 1}",
                self.edge_path,
            )


def _load_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read features: {exc}", path) from None
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2 or arr.dtype.kind not in "biuf":
        raise DataError(f"expected a 2-D numeric array, got {arr.dtype} {arr.shape}", path)
    return arr


def _load_pt(path: Path) -> np.ndarray:
    import torch

    try:
        try:
            # Memory-mapped, so that a large feature file is paged in chunk by chunk.
            tensor = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # files in torch's legacy (non-zip) format cannot be mapped
            tensor = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for bad files
        raise DataError(f"cannot read features: {exc}", path) from None
    if not isinstance(tensor, torch.Tensor):
        raise DataError(f"expected a tensor, found {type(tensor).__name__}", path)
    if tensor.ndim == 1:
        tensor = tensor[:, None]
    if tensor.ndim != 2 or tensor.is_complex():
        raise DataError(
            f"expected a 2-D real tensor, got {tensor.dtype} {tuple(tensor.shape)}", path
        )
    if tensor.dtype not in (torch.float32, torch.float64):
        tensor = tensor.float()  # numpy has no bfloat16
    return tensor.numpy()


class TGLReader(TextReader):
    """TGL's ``edges.csv`` (``[,]src,dst,time,int_roll,ext_roll``) with optional
    ``edge_features.pt`` (E, d_e) and ``node_features.pt`` (N, d_n) beside it.

    Ids are 0-based; edge feature row i belongs to data row i. The roll columns
    (TGL's own split marks) are ignored: splits are recomputed by time quantiles.
    """

    def __init__(self, path: Path, *, block_bytes: int = BLOCK_BYTES) -> None:
        text = DelimitedText(path, sep=",", header=True, block_bytes=block_bytes)
        assert text.header is not None
        text.ncols = len(text.header)
        self.cols = {
            key: header_index(text.header, [key], path, key) for key in ("src", "dst", "time")
        }
        edge_path = path.with_name("edge_features.pt")
        node_path = path.with_name("node_features.pt")
        self.edge_path = edge_path if edge_path.exists() else None
        self.edge_feat = _load_pt(edge_path) if self.edge_path else None
        options = {"node_feat": _load_pt(node_path)} if node_path.exists() else {}
        super().__init__(path, "tgl", text, writer_options=options)
        self.name = path.resolve().parent.name
        self._offset = 0

    def _chunk(self, frame: pd.DataFrame, where: Where) -> EventChunk:
        c = self.cols
        n = len(frame)
        edge_feat = None
        if self.edge_feat is not None:
            if self._offset + n > self.edge_feat.shape[0]:
                i = self.edge_feat.shape[0] - self._offset
                raise where.fail(
                    i, f"no row for this event in edge_features.pt ({self.edge_feat.shape[0]} rows)"
                )
            edge_feat = np.asarray(self.edge_feat[self._offset : self._offset + n], np.float32)
        self._offset += n
        return EventChunk(
            src=parse_ids(frame[c["src"]], "source", where),
            dst=parse_ids(frame[c["dst"]], "destination", where),
            t=parse_times(frame[c["time"]], where),
            edge_feat=edge_feat,
        )

    def check_complete(self, num_events: int) -> None:
        if self.edge_feat is not None and self.edge_feat.shape[0] != num_events:
            raise DataError(
                f"{self.edge_feat.shape[0]} edge feature rows for {num_events} events",
                self.edge_path,
            )
