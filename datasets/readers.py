"""Readers for raw temporal-graph formats, streaming into the event store.

This module picks the reader of an input (:func:`detect_format`, :func:`open_reader`)
and streams it into a store (:func:`convert`). Every text reader works the same way:
the (optionally gzip/xz/bz2 compressed) file is read in blocks of whole lines; each
block's fields are counted per line with vectorized byte scans (so a wrong column
count is reported with its physical line number), then parsed by pandas' C parser
(:mod:`~sven.datasets.delimited`) and validated column by column
(:mod:`~sven.datasets.fields`). Nothing is ever held for the whole file except what
the store writer itself keeps, so files larger than RAM convert.

Formats (``FORMATS``), a module per family:

- ``snap``: ``SRC DST T`` whitespace separated, no header, ``#`` comment lines.
- ``snap-signed``: ``SRC,DST,RATING,T``, no header; the rating is a 1-dim edge feature.
- ``jodie``: ``user_id,item_id,timestamp,state_label[,f1..fd]`` with a header; the
  trailing columns are edge features; bipartite (items numbered after users).
  These three: :mod:`~sven.datasets.snap_jodie`.
- ``dyglib``: ``ml_<name>.csv`` (header ``,u,i,ts,label,idx``; 1-based ids, 0 is
  padding) with ``ml_<name>.npy`` edge and ``ml_<name>_node.npy`` node features.
- ``tgl``: TGL's ``edges.csv`` (``[,]src,dst,time,int_roll,ext_roll``) with optional
  ``edge_features.pt`` / ``node_features.pt``. These two:
  :mod:`~sven.datasets.dyglib_tgl`.
- ``csv`` / ``parquet``: generic, with a :class:`~sven.datasets.tables.ColumnMap`.
- ``tgb``: TGB's csv edge lists: ``csv`` with string ids allowed and TGB's column names
  recognised by default. These three: :mod:`~sven.datasets.tables`.

Line numbers in error messages are 1-based physical lines of the (decompressed)
file, the header included; parquet errors name the 1-based data row instead.
"""

from __future__ import annotations

import lzma
import os
import re
from pathlib import Path
from typing import Any

from sven.datasets import FORMATS
from sven.datasets.delimited import BLOCK_BYTES, open_bytes
from sven.datasets.dyglib_tgl import DyGLibReader, TGLReader
from sven.datasets.rawreader import RawReader
from sven.datasets.snap_jodie import JodieReader, SnapReader
from sven.datasets.store import StoreWriter, TemporalEvents
from sven.datasets.tables import ColumnMap, CsvReader, ParquetReader
from sven.datasets.target import check_target
from sven.errors import ConfigError, DataError

__all__ = ["convert", "detect_format", "open_reader"]


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
    number, line = _first_line(path)
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


def _first_line(path: Path) -> tuple[int, str]:
    """(line number, text) of the first line that is neither blank nor a ``#``
    comment; (0, "") where there is none."""
    stream, _ = open_bytes(path)
    try:
        head = stream.read(1 << 16)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise DataError(f"cannot decompress: {exc}", path) from None
    finally:
        stream.close()
    lines = head.decode("utf-8", "replace").lstrip("\ufeff").splitlines()
    return next(
        ((i + 1, s) for i, s in enumerate(lines) if s.strip() and not s.lstrip().startswith("#")),
        (0, ""),
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
        The reader; iterate :meth:`~sven.datasets.rawreader.RawReader.chunks` once.
    """
    path = Path(path)
    if fmt != "auto" and fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; choose from auto, {', '.join(FORMATS)}")
    path = _resolve_input(path, fmt)
    if fmt == "auto":
        fmt = detect_format(path)
        if fmt == "csv" and sep == ",":
            # A header of names apart by whitespace (`src dst t`): the file's
            # separator is whitespace, as detection read it.
            line = _first_line(path)[1]
            if "," not in line and len(line.split()) > 1:
                sep = "\\s+"
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
