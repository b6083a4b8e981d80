"""Generic tables with a :class:`ColumnMap`: csv (and TGB's csv edge lists), parquet.

- ``csv`` / ``parquet``: which column holds what is given by a :class:`ColumnMap`, or
  found among common names (``src``/``source``/``u``..., ``dst``/``target``/``i``...,
  ``t``/``ts``/``time``...).
- ``tgb``: TGB's csv edge lists: ``csv`` with string ids allowed and TGB's column
  names recognised by default.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sven.datasets.delimited import BLOCK_BYTES, DelimitedText
from sven.datasets.fields import Where, parse_floats, parse_ids, parse_labels, parse_times
from sven.datasets.rawreader import EventChunk, RawReader, TextReader, dataset_name, header_index
from sven.errors import ConfigError, DataError

__all__ = ["ColumnMap", "CsvReader", "ParquetReader", "resolve_columns"]

# Column names recognised when no column map is given (generic csv/parquet, TGB).
_DEFAULT_NAMES = {
    "src": ("src", "source", "u", "user_id", "from", "sender", "src_id"),
    "dst": ("dst", "destination", "target", "i", "item_id", "to", "receiver", "dst_id"),
    "time": ("t", "ts", "time", "timestamp", "unix_time", "day"),
}
# TGB and JODIE headers name the trailing feature columns with one placeholder.
_FEATURE_LIST = "comma_separated_list_of_features"


@dataclass(frozen=True)
class ColumnMap:
    """Which columns of a generic table hold what.

    Names refer to the header; with ``header=False`` they are 0-based positions
    (``"0"``, ``"1"``...). Unset src/dst/time fall back to common names
    (``src``/``source``/``u``..., ``dst``/``target``/``i``..., ``t``/``ts``/``time``...).

    Attributes:
        src: Source id column.
        dst: Destination id column.
        time: Timestamp column.
        feat: Edge feature columns, in order.
        label: Per-event label column.
    """

    src: str | None = None
    dst: str | None = None
    time: str | None = None
    feat: tuple[str, ...] = ()
    label: str | None = None


def resolve_columns(
    names: Sequence[str] | None, cmap: ColumnMap, path: Path, *, allow_missing_names: bool = False
) -> dict[str, Any]:
    """Column keys (names, or positions without a header) for src/dst/time/feat/label."""

    def find(spec: str | None, key: str) -> Any:
        if names is None:  # no header: positions
            if spec is None:
                return {"src": 0, "dst": 1, "time": 2}[key]
            if not spec.isdigit():
                raise ConfigError(f"without a header, columns are positions; got {spec!r}")
            return int(spec)
        if spec is None:
            return header_index(list(names), _DEFAULT_NAMES[key], path, key)
        if spec not in names:
            if spec.isdigit() and int(spec) < len(names):
                return int(spec)
            raise DataError(f"no column {spec!r} (columns: {', '.join(names)})", path, 1)
        return list(names).index(spec)

    return {
        "src": find(cmap.src, "src"),
        "dst": find(cmap.dst, "dst"),
        "time": find(cmap.time, "time"),
        "feat": [find(f, "feat") for f in cmap.feat],
        "label": None if cmap.label is None else find(cmap.label, "label"),
    }


class CsvReader(TextReader):
    """A generic delimited table with a :class:`ColumnMap`; also TGB's edge lists.

    With ``fmt="tgb"``, string node ids are allowed and a header ending in TGB's
    (JODIE's) ``comma_separated_list_of_features`` placeholder takes every column
    from there on as edge features.
    """

    def __init__(
        self,
        path: Path,
        columns: ColumnMap,
        *,
        fmt: str = "csv",
        sep: str = ",",
        header: bool = True,
        string_ids: bool = False,
        bipartite: bool | None = None,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        sep = {"\\t": "\t", "tab": "\t", " ": "\\s+"}.get(sep, sep)
        if len(sep) != 1 and sep != "\\s+":
            raise ConfigError(f"separator must be one character, got {sep!r}")
        sep_byte = None if sep == "\\s+" else sep
        string_ids = string_ids or fmt == "tgb"
        text = DelimitedText(path, sep=sep_byte, header=header, block_bytes=block_bytes)
        self.feature_tail: int | None = None
        if text.header is not None:
            if text.header and text.header[-1].lower() == _FEATURE_LIST:
                self.feature_tail = len(text.header) - 1
                text.min_cols = len(text.header) - 1
            else:
                text.ncols = len(text.header)
        self.cols = resolve_columns(text.header, columns, path)
        if string_ids:
            text.str_cols = (self.cols["src"], self.cols["dst"])
        options: dict[str, Any] = {"allow_string_ids": string_ids}
        if bipartite is not None:
            options["bipartite"] = bipartite
        super().__init__(path, fmt, text, writer_options=options)
        self.string_ids = string_ids

    def _chunk(self, frame: pd.DataFrame, where: Where) -> EventChunk:
        c = self.cols
        feat_cols = list(c["feat"])
        if not feat_cols and self.feature_tail is not None:
            feat_cols = list(range(self.feature_tail, frame.shape[1]))
        return EventChunk(
            src=parse_ids(frame[c["src"]], "source", where, strings=self.string_ids),
            dst=parse_ids(frame[c["dst"]], "destination", where, strings=self.string_ids),
            t=parse_times(frame[c["time"]], where),
            edge_feat=parse_floats(frame, feat_cols, "feature", where) if feat_cols else None,
            label=None if c["label"] is None else parse_labels(frame[c["label"]], where),
        )


class ParquetReader(RawReader):
    """A parquet table with a :class:`ColumnMap`, read one row group batch at a time."""

    def __init__(
        self,
        path: Path,
        columns: ColumnMap,
        *,
        string_ids: bool = False,
        bipartite: bool | None = None,
        batch_rows: int = 1 << 20,
    ) -> None:
        import pyarrow.parquet as pq

        try:
            self.file = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError...
            raise DataError(f"cannot read parquet: {exc}", path) from None
        names = self.file.schema_arrow.names
        self.cols = resolve_columns(names, columns, path)
        self.names = names
        self.string_ids = string_ids
        self.batch_rows = batch_rows
        options: dict[str, Any] = {"allow_string_ids": string_ids}
        if bipartite is not None:
            options["bipartite"] = bipartite
        super().__init__(
            path=path, format="parquet", name=dataset_name(path), writer_options=options
        )

    def chunks(self) -> Iterator[EventChunk]:
        import pyarrow as pa

        c = self.cols
        keys = [c["src"], c["dst"], c["time"], *c["feat"]] + (
            [] if c["label"] is None else [c["label"]]
        )
        wanted = sorted({self.names[k] for k in keys})
        row = 1
        for batch in self.file.iter_batches(batch_size=self.batch_rows, columns=wanted):
            frame = {}
            where = Where(self.path, np.arange(row, row + batch.num_rows), unit="row")
            for name in wanted:
                arr = batch.column(name)
                if arr.null_count:
                    i = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
                    raise where.fail(i, f"missing value in column {name!r}")
                if pa.types.is_timestamp(arr.type) or pa.types.is_date(arr.type):
                    arr = arr.cast(pa.int64())
                frame[self.names.index(name)] = arr.to_pandas()
            df = pd.DataFrame(frame)
            yield EventChunk(
                src=parse_ids(df[c["src"]], "source", where, strings=self.string_ids),
                dst=parse_ids(df[c["dst"]], "destination", where, strings=self.string_ids),
                t=parse_times(df[c["time"]], where),
                edge_feat=parse_floats(df, c["feat"], "feature", where) if c["feat"] else None,
                label=None if c["label"] is None else parse_labels(df[c["label"]], where),
            )
            row += batch.num_rows
        if row == 1:
            raise DataError("empty file: no events", self.path)
