"""SNAP and JODIE edge lists: one event per line, the columns fixed by the format.

- ``snap``: ``SRC DST T`` whitespace separated, no header, ``#`` comment lines.
- ``snap-signed``: ``SRC,DST,RATING,T``, no header; the rating is a 1-dim edge feature.
- ``jodie``: ``user_id,item_id,timestamp,state_label[,f1..fd]`` with a header; the
  trailing columns are edge features; bipartite (items numbered after users).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from sven.datasets.delimited import BLOCK_BYTES, DelimitedText
from sven.datasets.fields import Where, parse_floats, parse_ids, parse_labels, parse_times
from sven.datasets.rawreader import EventChunk, TextReader

__all__ = ["JodieReader", "SnapReader"]


class SnapReader(TextReader):
    """SNAP temporal edge lists: ``SRC DST T`` (whitespace) or ``SRC,DST,RATING,T``."""

    def __init__(self, path: Path, *, signed: bool = False, block_bytes: int = BLOCK_BYTES):
        text = DelimitedText(
            path,
            sep="," if signed else None,
            header=False,
            comments=True,
            ncols=4 if signed else 3,
            block_bytes=block_bytes,
        )
        super().__init__(path, "snap-signed" if signed else "snap", text)
        self.signed = signed

    def _chunk(self, frame: pd.DataFrame, where: Where) -> EventChunk:
        return EventChunk(
            src=parse_ids(frame[0], "source", where),
            dst=parse_ids(frame[1], "destination", where),
            t=parse_times(frame[3 if self.signed else 2], where),
            edge_feat=parse_floats(frame, [2], "rating", where) if self.signed else None,
        )


class JodieReader(TextReader):
    """JODIE csv: ``user_id,item_id,timestamp,state_label[,f1..fd]`` with a header.

    Users and items are separate id spaces (items numbered after users); a file
    whose item ids already follow the user ids (max user < min item, like the
    JODIE Wikipedia csv) is recognised by the store writer and
    not offset again.
    """

    def __init__(self, path: Path, *, block_bytes: int = BLOCK_BYTES) -> None:
        text = DelimitedText(path, sep=",", header=True, min_cols=4, block_bytes=block_bytes)
        super().__init__(path, "jodie", text, writer_options={"bipartite": True})

    def _chunk(self, frame: pd.DataFrame, where: Where) -> EventChunk:
        ncols = frame.shape[1]
        return EventChunk(
            src=parse_ids(frame[0], "user", where),
            dst=parse_ids(frame[1], "item", where),
            t=parse_times(frame[2], where),
            label=parse_labels(frame[3], where),
            edge_feat=parse_floats(frame, range(4, ncols), "feature", where) if ncols > 4 else None,
        )
