"""The reader interface: a raw input read as a stream of :class:`EventChunk`.

:class:`RawReader` is what every format implements and what
:func:`~sven.datasets.readers.convert` drives; :class:`TextReader` is its driver for
delimited text, which parses blocks (:class:`~sven.datasets.delimited.DelimitedText`)
and leaves each format to turn a parsed block into an :class:`EventChunk`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sven.datasets.delimited import DelimitedText
from sven.datasets.fields import Where
from sven.digest import sha256_file
from sven.errors import DataError

__all__ = ["EventChunk", "RawReader", "TextReader", "dataset_name", "header_index"]


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


@dataclass
class RawReader:
    """A raw input, read as a stream of :class:`EventChunk`.

    Attributes:
        path: The main input file.
        format: One of ``FORMATS``.
        name: Dataset name derived from the file name.
        writer_options: Keyword arguments for :class:`~sven.datasets.store.StoreWriter`
            that this format implies (``bipartite``, ``num_nodes``, ``node_feat``,
            ``id_map``...).
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


def dataset_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".xz", ".bz2", ".csv", ".txt", ".tsv", ".parquet", ".pq"):
        name = name.removesuffix(suffix)
    return name or path.resolve().name


class TextReader(RawReader):
    """Shared driver: subclasses turn a parsed frame into an EventChunk."""

    def __init__(self, path: Path, fmt: str, text: DelimitedText, **kwargs: Any) -> None:
        super().__init__(path=path, format=fmt, name=dataset_name(path), **kwargs)
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
            return self._chunk(frame, Where(self.path, lines))
        except DataError as exc:
            err = exc
        while err.line is not None:
            row = int(np.searchsorted(lines, err.line))
            if row == 0:
                break
            frame, lines = frame.iloc[:row], lines[:row]
            try:
                self._chunk(frame, Where(self.path, lines))
                break
            except DataError as exc:
                err = exc
        raise err

    def _chunk(self, frame: pd.DataFrame, where: Where) -> EventChunk:
        raise NotImplementedError


def header_index(header: list[str], names: Sequence[str], path: Path, what: str) -> int:
    lowered = [h.lower() for h in header]
    for name in names:
        if name.lower() in lowered:
            return lowered.index(name.lower())
    raise DataError(
        f"no {what} column (looked for {', '.join(names)}; header is {','.join(header)})",
        path,
        1,
    )
