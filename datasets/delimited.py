"""Delimited text read in blocks of whole lines: the parsing core of the text readers.

The (optionally gzip/xz/bz2 compressed) file is read in blocks of whole lines, every
byte hashed on the way (the source's sha256); each block's fields are counted per line
with vectorized byte scans, so that a wrong column count is reported with its physical
line number, and the block is then parsed by pandas' C parser
(:class:`DelimitedText`). Nothing is held for the whole file.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import io
import lzma
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pandas as pd

from sven.errors import DataError

__all__ = ["BLOCK_BYTES", "DelimitedText", "open_bytes"]

# Decompressed bytes parsed per block: large enough that pandas' per-call overhead
# vanishes, small enough that a block and its parsed columns are a few hundred MB.
BLOCK_BYTES = 16 << 20
_MAGIC: tuple[tuple[bytes, Any], ...] = (
    (b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f)),
    (b"\xfd7zXZ\x00", lzma.LZMAFile),
    (b"BZh", bz2.BZ2File),
)
# Field separators of whitespace-separated text, as pandas' C tokenizer splits them
# (space, tab; CR and LF end lines), as a byte lookup table: one pass per block.
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[[9, 10, 13, 32]] = True


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


def open_bytes(path: Path) -> tuple[BinaryIO, _HashingReader]:
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


class DelimitedText:
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
        self._stream, self._hash = open_bytes(path)
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
