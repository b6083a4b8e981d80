"""Readers for raw temporal-graph formats, streaming into the event store.

Every text reader works the same way: the (optionally gzip/xz/bz2 compressed)
file is read in blocks of whole lines; each block's fields are counted per line with
vectorized byte scans (so a wrong column count is reported with its physical line
number), then parsed by pandas' C parser and validated column by column. Nothing is
ever held for the whole file except what the store writer itself keeps, so files
larger than RAM convert.

Formats (``FORMATS``):

- ``snap``: ``SRC DST T`` whitespace separated, no header, ``#`` comment lines.
- ``snap-signed``: ``SRC,DST,RATING,T``, no header; the rating is a 1-dim edge feature.
- ``jodie``: ``user_id,item_id,timestamp,state_label[,f1..fd]`` with a header; the
  trailing columns are edge features; bipartite (items numbered after users).
- ``dyglib``: ``ml_<name>.csv`` (header ``,u,i,ts,label,idx``; 1-based ids, 0 is
  padding) with ``ml_<name>.npy`` edge and ``ml_<name>_node.npy`` node features.
- ``tgl``: TGL's ``edges.csv`` (``[,]src,dst,time,int_roll,ext_roll``) with optional
  ``edge_features.pt`` / ``node_features.pt``.
- ``csv`` / ``parquet``: generic, with a :class:`ColumnMap`.
- ``tgb``: TGB's csv edge lists: ``csv`` with string ids allowed and TGB's column names
  recognised by default.

Line numbers in error messages are 1-based physical lines of the (decompressed)
file, the header included; parquet errors name the 1-based data row instead.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import io
import lzma
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pandas as pd

from sven.datasets import FORMATS
from sven.datasets.checksums import sha256_file
from sven.datasets.store import StoreWriter, TemporalEvents
from sven.datasets.target import check_target
from sven.errors import ConfigError, DataError

__all__ = [
    "FORMATS",
    "ColumnMap",
    "EventChunk",
    "RawReader",
    "convert",
    "detect_format",
    "open_reader",
]

# Decompressed bytes parsed per block: large enough that pandas' per-call overhead
# vanishes, small enough that a block and its parsed columns are a few hundred MB.
BLOCK_BYTES = 16 << 20
_INT64_MAX = np.iinfo(np.int64).max
_NAN_INF = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}
_MAGIC: tuple[tuple[bytes, Any], ...] = (
    (b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f)),
    (b"\xfd7zXZ\x00", lzma.LZMAFile),
    (b"BZh", bz2.BZ2File),
)
# Field separators of whitespace-separated text, as pandas' C tokenizer splits them
# (space, tab; CR and LF end lines), as a byte lookup table: one pass per block.
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[[9, 10, 13, 32]] = True
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


@dataclass
class EventChunk:
    """A chunk of n events in input order.

    Attributes:
        src: (n,) int64 (or str) raw source ids.
        dst: (n,) int64 (or str) raw destination ids.
        t: (n,) int64 or float64 timestamps.
        edge_feat: (n, d_e) float32 or None.
        label: (n,) int64 or float32, or None.
    """

    src: np.ndarray
    dst: np.ndarray
    t: np.ndarray
    edge_feat: np.ndarray | None = None
    label: np.ndarray | None = None


# -- bytes: decompression, hashing, blocks of whole lines ------------------------------


class _HashingReader(io.RawIOBase):
    """Passes reads of a binary file through, hashing every byte (the source's sha256)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        if n:
            self.sha256.update(memoryview(b)[:n])
        return n or 0

    def drain(self) -> str:
        """Hashes whatever the decompressor left unread; returns the hex digest."""
        while block := self._f.read(1 << 23):
            self.sha256.update(block)
        return self.sha256.hexdigest()

    def close(self) -> None:
        self._f.close()
        super().close()


def _open_bytes(path: Path) -> tuple[BinaryIO, _HashingReader]:
    """Opens ``path`` for reading decompressed bytes, compression told by magic bytes."""
    try:
        raw = open(path, "rb")  # owned by the returned reader
    except OSError as exc:
        raise DataError(f"cannot open: {exc.strerror}", path) from None
    head = raw.read(6)
    raw.seek(0)
    hashed = _HashingReader(raw)
    buffered = io.BufferedReader(hashed, 1 << 20)
    for magic, opener in _MAGIC:
        if head.startswith(magic):
            return opener(buffered), hashed
    return buffered, hashed


def _read_blocks(stream: BinaryIO, path: Path, block_bytes: int) -> Iterator[bytes]:
    """Yields blocks of whole lines, each ending in ``\\n`` (one is added at EOF)."""
    carry = b""
    while True:
        try:
            data = stream.read(block_bytes)
        except (OSError, EOFError, lzma.LZMAError) as exc:
            raise DataError(f"cannot decompress: {exc}", path) from None
        if not data:
            if carry:
                yield carry if carry.endswith(b"\n") else carry + b"\n"
            return
        data = carry + data
        cut = data.rfind(b"\n")
        if cut < 0:  # a line longer than the block: keep reading
            carry = data
            continue
        carry = data[cut + 1 :]
        yield data[: cut + 1]


def _fail(reason: str, path: Path, unit: str, number: int) -> DataError:
    """A DataError at a line (text) or a row (parquet)."""
    if unit == "line":
        return DataError(reason, path, number)
    return DataError(f"row {number}: {reason}", path)


class _DelimitedText:
    """A delimited text file, parsed in blocks of whole lines.

    Args:
        path: The file (compressed or not).
        sep: ``","``-like single byte, or ``None`` for runs of whitespace.
        header: The first line names the columns.
        comments: Lines whose first field starts with ``#`` are skipped.
        ncols: Expected fields per line; None: those of the first data line.
        min_cols: With ``ncols`` None, the fewest fields a line may have.
        str_cols: Columns parsed as strings (string node ids).
        block_bytes: Decompressed bytes per block.
    """

    def __init__(
        self,
        path: Path,
        *,
        sep: str | None,
        header: bool,
        comments: bool = False,
        ncols: int | None = None,
        min_cols: int = 1,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        self.path = path
        self.sep = sep
        self.comments = comments
        self.ncols = ncols
        self.min_cols = min_cols
        self.str_cols: tuple[int, ...] = ()
        self._stream, self._hash = _open_bytes(path)
        self._blocks = _read_blocks(self._stream, path, block_bytes)
        self._first: bytes | None = next(self._blocks, None)
        if self._first is not None and self._first.startswith(b"\xef\xbb\xbf"):
            self._first = self._first[3:] or None  # a UTF-8 byte order mark
        self._next_line = 1
        self.header: list[str] | None = None
        if header:
            if self._first is None:
                raise DataError("empty file: no header and no events", path)
            cut = self._first.index(b"\n") + 1
            text = self._first[:cut].decode("utf-8", "replace").lstrip("\ufeff").rstrip("\r\n")
            self.header = [n.strip() for n in (text.split(sep) if sep else text.split())]
            self._first = self._first[cut:] or None
            self._next_line = 2
        self.sha256: str | None = None

    def blocks(self) -> Iterator[tuple[pd.DataFrame, np.ndarray]]:
        """Yields ``(frame, lines)``: parsed rows and their (n,) physical line numbers."""
        first_block = self._first
        self._first = None
        rows = 0
        try:
            blocks = self._blocks if first_block is None else _chain(first_block, self._blocks)
            for block in blocks:
                frame, lines, pending = self._parse(block)
                if frame is not None:
                    rows += len(frame)
                    # The lines before a bad column count go first: a bad value on
                    # one of them is the first error of the file.
                    yield frame, lines
                if pending is not None:
                    raise pending
            self.sha256 = self._hash.drain()
        finally:
            self._stream.close()
        if rows == 0:
            where = "no events after the header" if self.header is not None else "no events"
            raise DataError(f"empty file: {where}", self.path)

    def _parse(self, block: bytes) -> tuple[pd.DataFrame | None, np.ndarray, DataError | None]:
        """Parses a block; a line with a wrong field count ends it.

        Returns:
            The rows before any bad line (or None), their physical line numbers, and
            the error of the bad line (None if there is none), which the caller raises
            once the rows before it have been checked.
        """
        buf = np.frombuffer(block, dtype=np.uint8)
        nl = np.flatnonzero(buf == 10)
        first_line = self._next_line
        self._next_line += nl.size
        starts = np.concatenate([[0], nl[:-1] + 1])
        if self.sep is None:
            ws = _WHITESPACE[buf]
            field_starts = np.flatnonzero(~ws & np.concatenate([[True], ws[:-1]]))
            upto = np.searchsorted(field_starts, nl)  # fields starting before each newline
            first_field = np.concatenate([[0], upto[:-1]])
            counts = upto - first_field
            data = counts > 0
            if self.comments and field_starts.size:
                lead = buf[field_starts[np.minimum(first_field, field_starts.size - 1)]]
                data &= lead != ord("#")
        else:
            length = nl - starts
            blank = (length == 0) | ((length == 1) & (buf[starts] == 13))
            data = ~blank
            if self.comments:
                data &= buf[starts] != ord("#")
            seps = np.flatnonzero(buf == ord(self.sep))
            counts = np.diff(np.concatenate([[0], np.searchsorted(seps, nl)])) + 1
        if not data.any():
            return None, np.empty(0, dtype=np.int64), None
        if self.ncols is None:
            i = int(np.flatnonzero(data)[0])
            if counts[i] < self.min_cols:
                raise DataError(
                    f"expected at least {self.min_cols} columns, found {counts[i]}",
                    self.path,
                    first_line + i,
                )
            self.ncols = int(counts[i])
        wrong = data & (counts != self.ncols)
        pending = None
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            pending = DataError(
                f"expected {self.ncols} columns, found {counts[i]}", self.path, first_line + i
            )
            # Keep the lines before it: their values are checked first.
            nl, data = nl[:i], data[:i]
            buf = buf[: starts[i]]
            block = block[: starts[i]]
            if not data.any():
                return None, np.empty(0, dtype=np.int64), pending
        lines = first_line + np.flatnonzero(data)
        if not data.all():
            # Drop comment and blank lines so that pandas' row i is data line i.
            block = buf[np.repeat(data, np.diff(np.concatenate([[0], nl + 1])))].tobytes()
        frame = pd.read_csv(
            io.BytesIO(block),
            sep=self.sep if self.sep is not None else r"\s+",
            header=None,
            names=range(self.ncols),
            dtype={c: str for c in self.str_cols} or None,
            na_filter=False,
            quoting=csv.QUOTE_NONE,
            engine="c",
            low_memory=False,
            encoding_errors="replace",
        )
        return frame, lines, pending


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


# -- column validation -----------------------------------------------------------------


@dataclass
class _Where:
    """Locates row i of the current chunk in the input, for error messages."""

    path: Path
    numbers: np.ndarray
    unit: str = "line"

    def fail(self, i: int, reason: str) -> DataError:
        return _fail(reason, self.path, self.unit, int(self.numbers[i]))


def _numeric(col: pd.Series, what: str, where: _Where, *, time: bool = False) -> np.ndarray:
    """A column as a finite int or float array, or a DataError at its first bad value."""
    if isinstance(col.dtype, np.dtype) and col.dtype.kind in "iuf":
        arr = col.to_numpy()
    else:
        conv = pd.to_numeric(col, errors="coerce")
        bad = conv.isna().to_numpy()
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            text = str(col.iat[i])
            if text.strip().lower() in _NAN_INF:
                raise where.fail(i, f"{what} is {text.strip()!r} (NaN/inf)")
            if time:
                raise where.fail(i, f"unparseable time {text!r}")
            raise where.fail(i, f"non-numeric {what} {text!r}")
        arr = conv.to_numpy()
        if arr.dtype.kind not in "iuf":  # e.g. Python ints beyond uint64
            arr = arr.astype(np.float64)
    if arr.dtype.kind == "f":
        finite = np.isfinite(arr)
        if not finite.all():
            i = int(np.flatnonzero(~finite)[0])
            raise where.fail(i, f"{what} is {arr[i]} (NaN/inf)")
    return arr


def _ids(col: pd.Series, what: str, where: _Where, *, strings: bool = False) -> np.ndarray:
    """(n,) int64 non-negative node ids (or str when ``strings``)."""
    if strings:
        arr = col.to_numpy(dtype=str)
        empty = np.char.str_len(arr) == 0
        if empty.any():
            raise where.fail(int(np.flatnonzero(empty)[0]), f"empty {what} id")
        return arr
    arr = _numeric(col, f"{what} id", where)
    if arr.dtype.kind == "f":
        frac = arr != np.floor(arr)
        if frac.any():
            i = int(np.flatnonzero(frac)[0])
            raise where.fail(i, f"non-integer {what} id {arr[i]}")
    if arr.dtype.kind in "uf":
        over = arr > _INT64_MAX if arr.dtype.kind == "u" else arr >= 2.0**63
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise where.fail(i, f"{what} id {col.iat[i]} overflows int64")
        arr = arr.astype(np.int64)
    neg = arr < 0
    if neg.any():
        i = int(np.flatnonzero(neg)[0])
        raise where.fail(i, f"negative {what} id {arr[i]}")
    return arr


def _times(col: pd.Series, where: _Where) -> np.ndarray:
    """(n,) int64 or float64 finite timestamps."""
    arr = _numeric(col, "time", where, time=True)
    if arr.dtype.kind == "u":
        over = arr > _INT64_MAX
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise where.fail(i, f"time {col.iat[i]} overflows int64")
        return arr.astype(np.int64)
    return arr.astype(np.float64 if arr.dtype.kind == "f" else np.int64, copy=False)


def _floats(frame: pd.DataFrame, cols: Sequence[Any], what: str, where: _Where) -> np.ndarray:
    """(n, len(cols)) float32 from numeric columns."""
    out = np.empty((len(frame), len(cols)), dtype=np.float32)
    for j, c in enumerate(cols):
        out[:, j] = _numeric(frame[c], what, where)
    finite = np.isfinite(out)  # float64 values beyond float32's range became inf
    if not finite.all():
        i = int(np.flatnonzero(~finite.all(axis=1))[0])
        raise where.fail(i, f"{what} overflows float32")
    return out


def _labels(col: pd.Series, where: _Where) -> np.ndarray:
    arr = _numeric(col, "label", where)
    return arr.astype(np.float32) if arr.dtype.kind == "f" else arr.astype(np.int64)


# -- readers ---------------------------------------------------------------------------


@dataclass
class RawReader:
    """A raw input, read as a stream of :class:`EventChunk`.

    Attributes:
        path: The main input file.
        format: One of ``FORMATS``.
        name: Dataset name derived from the file name.
        writer_options: Keyword arguments for :class:`StoreWriter` that this format
            implies (``bipartite``, ``num_nodes``, ``node_feat``, ``id_map``...).
    """

    path: Path
    format: str
    name: str
    writer_options: dict[str, Any] = field(default_factory=dict)
    sha256: str | None = None

    def chunks(self) -> Iterator[EventChunk]:
        """Yields the events in input order."""
        raise NotImplementedError

    def check_complete(self, num_events: int) -> None:
        """Checks what can only be checked after the last chunk (feature row counts)."""

    def source(self) -> dict[str, Any]:
        """Provenance for ``meta.json``."""
        if self.sha256 is None:
            self.sha256 = sha256_file(self.path)
        return {"path": str(self.path.resolve()), "format": self.format, "sha256": self.sha256}


def _dataset_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".xz", ".bz2", ".csv", ".txt", ".tsv", ".parquet", ".pq"):
        name = name.removesuffix(suffix)
    return name or path.resolve().name


class _TextReader(RawReader):
    """Shared driver: subclasses turn a parsed frame into an EventChunk."""

    def __init__(self, path: Path, fmt: str, text: _DelimitedText, **kwargs: Any) -> None:
        super().__init__(path=path, format=fmt, name=_dataset_name(path), **kwargs)
        self.text = text

    def chunks(self) -> Iterator[EventChunk]:
        for frame, lines in self.text.blocks():
            yield self._first_error(frame, lines)
        self.sha256 = self.text.sha256

    def _first_error(self, frame: pd.DataFrame, lines: np.ndarray) -> EventChunk:
        """``_chunk``, but an error is always that of the earliest bad line.

        Columns are checked one after the other, so a failure in one column may hide
        a bad value on an earlier line in a column checked later. The rows before the
        failing line are checked again until they pass; each retry ends on an
        earlier line, so there are at most as many as there are column checks.
        """
        try:
            return self._chunk(frame, _Where(self.path, lines))
        except DataError as exc:
            err = exc
        while err.line is not None:
            row = int(np.searchsorted(lines, err.line))
            if row == 0:
                break
            frame, lines = frame.iloc[:row], lines[:row]
            try:
                self._chunk(frame, _Where(self.path, lines))
                break
            except DataError as exc:
                err = exc
        raise err

    def _chunk(self, frame: pd.DataFrame, where: _Where) -> EventChunk:
        raise NotImplementedError


class SnapReader(_TextReader):
    """SNAP temporal edge lists: ``SRC DST T`` (whitespace) or ``SRC,DST,RATING,T``."""

    def __init__(self, path: Path, *, signed: bool = False, block_bytes: int = BLOCK_BYTES):
        text = _DelimitedText(
            path,
            sep="," if signed else None,
            header=False,
            comments=True,
            ncols=4 if signed else 3,
            block_bytes=block_bytes,
        )
        super().__init__(path, "snap-signed" if signed else "snap", text)
        self.signed = signed

    def _chunk(self, frame: pd.DataFrame, where: _Where) -> EventChunk:
        return EventChunk(
            src=_ids(frame[0], "source", where),
            dst=_ids(frame[1], "destination", where),
            t=_times(frame[3 if self.signed else 2], where),
            edge_feat=_floats(frame, [2], "rating", where) if self.signed else None,
        )


class JodieReader(_TextReader):
    """JODIE csv: ``user_id,item_id,timestamp,state_label[,f1..fd]`` with a header.

    Users and items are separate id spaces (items numbered after users); a file
    whose item ids already follow the user ids (max user < min item, like the
    JODIE Wikipedia csv) is recognised by the store writer and
    not offset again.
    """

    def __init__(self, path: Path, *, block_bytes: int = BLOCK_BYTES) -> None:
        text = _DelimitedText(path, sep=",", header=True, min_cols=4, block_bytes=block_bytes)
        super().__init__(path, "jodie", text, writer_options={"bipartite": True})

    def _chunk(self, frame: pd.DataFrame, where: _Where) -> EventChunk:
        ncols = frame.shape[1]
        return EventChunk(
            src=_ids(frame[0], "user", where),
            dst=_ids(frame[1], "item", where),
            t=_times(frame[2], where),
            label=_labels(frame[3], where),
            edge_feat=_floats(frame, range(4, ncols), "feature", where) if ncols > 4 else None,
        )


def _header_index(header: list[str], names: Sequence[str], path: Path, what: str) -> int:
    lowered = [h.lower() for h in header]
    for name in names:
        if name.lower() in lowered:
            return lowered.index(name.lower())
    raise DataError(
        f"no {what} column (looked for {', '.join(names)}; header is {','.join(header)})",
        path,
        1,
    )


class DyGLibReader(_TextReader):
    """DyGLib's ``ml_<name>.csv`` with ``ml_<name>.npy`` and ``ml_<name>_node.npy``.

    Ids are 1-based (0 is DyGLib's padding) and are stored 0-based, with the
    original ids in ``id_map``. Feature row 0 of both ``.npy`` files is padding and
    dropped; edge features are looked up by the ``idx`` column.
    """

    def __init__(self, path: Path, *, block_bytes: int = BLOCK_BYTES) -> None:
        text = _DelimitedText(path, sep=",", header=True, block_bytes=block_bytes)
        assert text.header is not None
        text.ncols = len(text.header)
        stem = path.name
        for suffix in (".gz", ".xz", ".bz2"):
            stem = stem.removesuffix(suffix)
        stem = stem.removesuffix(".csv")
        self.cols = {
            key: _header_index(text.header, [key], path, key)
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

    def _chunk(self, frame: pd.DataFrame, where: _Where) -> EventChunk:
        c = self.cols
        src = _ids(frame[c["u"]], "source", where)
        dst = _ids(frame[c["i"]], "destination", where)
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
            idx = _ids(frame[c["idx"]], "idx", where)
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
            t=_times(frame[c["ts"]], where),
            label=_labels(frame[c["label"]], where),
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


class TGLReader(_TextReader):
    """TGL's ``edges.csv`` (``[,]src,dst,time,int_roll,ext_roll``) with optional
    ``edge_features.pt`` (E, d_e) and ``node_features.pt`` (N, d_n) beside it.

    Ids are 0-based; edge feature row i belongs to data row i. The roll columns
    (TGL's own split marks) are ignored: splits are recomputed by time quantiles.
    """

    def __init__(self, path: Path, *, block_bytes: int = BLOCK_BYTES) -> None:
        text = _DelimitedText(path, sep=",", header=True, block_bytes=block_bytes)
        assert text.header is not None
        text.ncols = len(text.header)
        self.cols = {
            key: _header_index(text.header, [key], path, key) for key in ("src", "dst", "time")
        }
        edge_path = path.with_name("edge_features.pt")
        node_path = path.with_name("node_features.pt")
        self.edge_path = edge_path if edge_path.exists() else None
        self.edge_feat = _load_pt(edge_path) if self.edge_path else None
        options = {"node_feat": _load_pt(node_path)} if node_path.exists() else {}
        super().__init__(path, "tgl", text, writer_options=options)
        self.name = path.resolve().parent.name
        self._offset = 0

    def _chunk(self, frame: pd.DataFrame, where: _Where) -> EventChunk:
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
            src=_ids(frame[c["src"]], "source", where),
            dst=_ids(frame[c["dst"]], "destination", where),
            t=_times(frame[c["time"]], where),
            edge_feat=edge_feat,
        )

    def check_complete(self, num_events: int) -> None:
        if self.edge_feat is not None and self.edge_feat.shape[0] != num_events:
            raise DataError(
                f"{self.edge_feat.shape[0]} edge feature rows for {num_events} events",
                self.edge_path,
            )


def _resolve(
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
            return _header_index(list(names), _DEFAULT_NAMES[key], path, key)
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


class CsvReader(_TextReader):
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
        text = _DelimitedText(path, sep=sep_byte, header=header, block_bytes=block_bytes)
        self.feature_tail: int | None = None
        if text.header is not None:
            if text.header and text.header[-1].lower() == _FEATURE_LIST:
                self.feature_tail = len(text.header) - 1
                text.min_cols = len(text.header) - 1
            else:
                text.ncols = len(text.header)
        self.cols = _resolve(text.header, columns, path)
        if string_ids:
            text.str_cols = (self.cols["src"], self.cols["dst"])
        options: dict[str, Any] = {"allow_string_ids": string_ids}
        if bipartite is not None:
            options["bipartite"] = bipartite
        super().__init__(path, fmt, text, writer_options=options)
        self.string_ids = string_ids

    def _chunk(self, frame: pd.DataFrame, where: _Where) -> EventChunk:
        c = self.cols
        feat_cols = list(c["feat"])
        if not feat_cols and self.feature_tail is not None:
            feat_cols = list(range(self.feature_tail, frame.shape[1]))
        return EventChunk(
            src=_ids(frame[c["src"]], "source", where, strings=self.string_ids),
            dst=_ids(frame[c["dst"]], "destination", where, strings=self.string_ids),
            t=_times(frame[c["time"]], where),
            edge_feat=_floats(frame, feat_cols, "feature", where) if feat_cols else None,
            label=None if c["label"] is None else _labels(frame[c["label"]], where),
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
        self.cols = _resolve(names, columns, path)
        self.names = names
        self.string_ids = string_ids
        self.batch_rows = batch_rows
        options: dict[str, Any] = {"allow_string_ids": string_ids}
        if bipartite is not None:
            options["bipartite"] = bipartite
        super().__init__(
            path=path, format="parquet", name=_dataset_name(path), writer_options=options
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
            where = _Where(self.path, np.arange(row, row + batch.num_rows), unit="row")
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
                src=_ids(df[c["src"]], "source", where, strings=self.string_ids),
                dst=_ids(df[c["dst"]], "destination", where, strings=self.string_ids),
                t=_times(df[c["time"]], where),
                edge_feat=_floats(df, c["feat"], "feature", where) if c["feat"] else None,
                label=None if c["label"] is None else _labels(df[c["label"]], where),
            )
            row += batch.num_rows
        if row == 1:
            raise DataError("empty file: no events", self.path)


# -- detection and the driver ----------------------------------------------------------


def _strip_compression(name: str) -> str:
    for suffix in (".gz", ".xz", ".bz2"):
        name = name.removesuffix(suffix)
    return name


def _resolve_input(path: Path, fmt: str) -> Path:
    """Directory inputs (TGL, DyGLib) -> their main file."""
    if not path.exists():
        raise DataError("no such file or directory", path)
    if not path.is_dir():
        return path
    if fmt in ("auto", "tgl") and (path / "edges.csv").exists():
        return path / "edges.csv"
    if fmt in ("auto", "dyglib"):
        found = sorted(p for p in path.glob("ml_*.csv*") if not p.name.endswith(".npy"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise DataError(
                f"several DyGLib tables ({', '.join(p.name for p in found)}); pass one", path
            )
    raise DataError(
        "cannot detect the format of this directory: expected edges.csv (TGL) "
        "or ml_<name>.csv (DyGLib)",
        path,
    )


def detect_format(path: str | os.PathLike[str]) -> str:
    """Guesses the format of a file or directory from its name and first line.

    Returns:
        One of ``FORMATS``.

    Raises:
        DataError: if nothing fits; the message says what was seen.
    """
    path = Path(path)
    if path.is_dir():
        path = _resolve_input(path, "auto")
    name = _strip_compression(path.name)
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if re.fullmatch(r"ml_.+\.csv", name):
        return "dyglib"
    stream, _ = _open_bytes(path)
    try:
        head = stream.read(1 << 16)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise DataError(f"cannot decompress: {exc}", path) from None
    finally:
        stream.close()
    lines = head.decode("utf-8", "replace").lstrip("\ufeff").splitlines()
    number, line = next(
        ((i + 1, s) for i, s in enumerate(lines) if s.strip() and not s.lstrip().startswith("#")),
        (0, ""),
    )
    if not line:
        raise DataError("empty file: no events", path)
    tokens = [s.strip() for s in (line.split(",") if "," in line else line.split())]
    if not all(_is_number(tok) for tok in tokens):
        names = [s.lower() for s in tokens]
        if names[:6] == ["", "u", "i", "ts", "label", "idx"]:
            return "dyglib"
        if len(names) >= 4 and names[0] in ("user_id", "u") and names[1] in ("item_id", "i"):
            return "jodie"
        if {"src", "dst", "time"} <= set(names) and ("ext_roll" in names or name == "edges.csv"):
            return "tgl"
        return "csv"
    if "," in line and len(tokens) == 4:
        return "snap-signed"
    if "," not in line and len(tokens) == 3:
        return "snap"
    raise DataError(
        f"cannot detect the format from {len(tokens)} headerless columns "
        f"({line.strip()[:60]!r}); pass --format",
        path,
        number,
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def open_reader(
    path: str | os.PathLike[str],
    fmt: str = "auto",
    *,
    columns: ColumnMap | None = None,
    sep: str = ",",
    header: bool = True,
    string_ids: bool = False,
    bipartite: bool | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> RawReader:
    """Opens a raw input for streaming.

    Args:
        path: A file, or a TGL / DyGLib dataset directory.
        fmt: One of ``FORMATS`` or ``"auto"``.
        columns: Column map for ``csv``, ``tgb`` and ``parquet``.
        sep: Field separator for ``csv``/``tgb`` (``"\\s+"`` for whitespace).
        header: Whether a ``csv``/``tgb`` file has a header line.
        string_ids: Allow string node ids (``csv``, ``parquet``; always on for ``tgb``).
        bipartite: Force separate source/destination id spaces (``csv``, ``parquet``).
        block_bytes: Decompressed bytes parsed at once.

    Returns:
        The reader; iterate :meth:`RawReader.chunks` once.
    """
    path = Path(path)
    if fmt != "auto" and fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; choose from auto, {', '.join(FORMATS)}")
    path = _resolve_input(path, fmt)
    if fmt == "auto":
        fmt = detect_format(path)
    cmap = columns or ColumnMap()
    tabular_only = cmap != ColumnMap() or string_ids or bipartite is not None
    if tabular_only and fmt not in ("csv", "tgb", "parquet"):
        raise ConfigError(
            f"a column map (--src/--dst/--time/--feat/--label), --string-ids and "
            f"--bipartite apply to csv, tgb and parquet input only; {path.name} is {fmt}"
        )
    if fmt in ("snap", "snap-signed"):
        return SnapReader(path, signed=fmt == "snap-signed", block_bytes=block_bytes)
    if fmt == "jodie":
        return JodieReader(path, block_bytes=block_bytes)
    if fmt == "dyglib":
        return DyGLibReader(path, block_bytes=block_bytes)
    if fmt == "tgl":
        return TGLReader(path, block_bytes=block_bytes)
    if fmt == "parquet":
        return ParquetReader(path, cmap, string_ids=string_ids, bipartite=bipartite)
    return CsvReader(
        path,
        cmap,
        fmt=fmt,
        sep=sep,
        header=header,
        string_ids=string_ids,
        bipartite=bipartite,
        block_bytes=block_bytes,
    )


def convert(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    fmt: str = "auto",
    *,
    name: str | None = None,
    val_frac: float = 0.15,
    test_frac: float = 0.15,
    overwrite: bool = False,
    **reader_options: Any,
) -> TemporalEvents:
    """Converts a raw input into an event store, streaming, atomically.

    Args:
        path: Raw input (file or dataset directory).
        out_dir: Store directory to create.
        fmt: One of ``FORMATS`` or ``"auto"``.
        name: Dataset name (default: from the input's file name).
        val_frac, test_frac: Chronological split fractions.
        overwrite: Replace an existing event store at ``out_dir`` (never another
            folder, nor one that holds ``path``).
        **reader_options: Passed to :func:`open_reader` (``columns``, ``sep``...).

    Returns:
        The new store. ``meta["sorted_on_ingest"]`` and ``meta["num_out_of_order"]``
        report whether the input had to be reordered.

    Raises:
        DataError: on bad input; nothing is left at ``out_dir``.
    """
    check_target(out_dir, overwrite, inputs=(path,))
    reader = open_reader(path, fmt, **reader_options)
    with StoreWriter(
        out_dir,
        name=name or reader.name,
        val_frac=val_frac,
        test_frac=test_frac,
        overwrite=overwrite,
        **reader.writer_options,
    ) as writer:
        try:
            for chunk in reader.chunks():
                writer.append(
                    chunk.src, chunk.dst, chunk.t, edge_feat=chunk.edge_feat, label=chunk.label
                )
            reader.check_complete(writer.num_events)
            writer.source = reader.source()
            return writer.close()
        except DataError as exc:
            if exc.path is not None:
                raise
            # The writer's own checks know event indices, not files: name the input.
            raise DataError(exc.reason, reader.path) from None
