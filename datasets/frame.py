"""Event stores from pandas DataFrames: ``sven.datasets.from_dataframe``.

The columns are checked like a csv file's (``sven data convert --format csv``): ids
must be non-negative integers or strings, times and features finite numbers; a bad
value raises a :class:`~sven.errors.DataError` that names its row (0-based, as in
``df.iloc``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sven.datasets.fields import Where, parse_floats, parse_ids, parse_labels, parse_times
from sven.datasets.layout import CHUNK_EVENTS, iter_ranges
from sven.datasets.store import StoreWriter, TemporalEvents
from sven.datasets.tables import ColumnMap, resolve_columns
from sven.errors import DataError

__all__ = ["from_dataframe"]

_WHAT = Path("DataFrame")


def from_dataframe(
    df: pd.DataFrame,
    out: str | os.PathLike[str],
    *,
    src: str | None = None,
    dst: str | None = None,
    time: str | None = None,
    feat: Sequence[str] = (),
    label: str | None = None,
    name: str | None = None,
    chunk: int = CHUNK_EVENTS,
    **kwargs: Any,
) -> TemporalEvents:
    """Writes the events of a DataFrame as an event store (atomically).

    Args:
        df: One row per event, in any order (sorted stably by time on write).
        out: Store directory to create.
        src: Source id column (default: the first of ``src``, ``source``, ``u``,
            ``user_id``...). Integer or string ids; they are compacted to 0..N-1.
        dst: Destination id column (default: ``dst``, ``destination``, ``i``,
            ``item_id``...).
        time: Timestamp column (default: ``t``, ``ts``, ``time``, ``timestamp``...);
            numbers, or datetimes (stored as seconds since the epoch: int64 when
            every time is a whole second, else float64).
        feat: Edge feature columns, in order: (E, len(feat)) float32.
        label: Per-event label column.
        name: Dataset name (default: the directory name).
        chunk: Rows converted at a time (memory, not content).
        **kwargs: Further :class:`~sven.datasets.store.StoreWriter` options
            (``bipartite``, ``val_frac``, ``test_frac``, ``node_feat``, ``overwrite``...).

    Returns:
        The written store, loaded memory-mapped.

    Example:
        >>> store = from_dataframe(df, "stores/mine", src="user", dst="item", time="ts")
    """
    names = [str(c) for c in df.columns]
    for given in (src, dst, time, *feat, label):
        if given is not None and given not in names:
            raise DataError(f"no column {given!r} (columns: {', '.join(names)})", _WHAT)
    cols = resolve_columns(names, ColumnMap(src, dst, time, tuple(feat), label), _WHAT)
    frame = df.set_axis(range(len(names)), axis=1)
    if pd.api.types.is_datetime64_any_dtype(frame[cols["time"]]):
        frame[cols["time"]] = _seconds(frame[cols["time"]])
    strings = {k: not pd.api.types.is_numeric_dtype(frame[cols[k]]) for k in ("src", "dst")}
    if strings["src"] != strings["dst"]:
        side = "source" if strings["src"] else "destination"
        raise DataError(f"{side} ids are strings but the other side's are numbers", _WHAT)
    kwargs.setdefault("allow_string_ids", strings["src"])
    kwargs.setdefault("source", {"format": "dataframe", "columns": names})
    with StoreWriter(out, name=name, **kwargs) as writer:
        for lo, hi in iter_ranges(len(frame), chunk):
            part = frame.iloc[lo:hi]
            where = Where(_WHAT, np.arange(lo, hi), unit="row")
            writer.append(
                parse_ids(part[cols["src"]], "source", where, strings=strings["src"]),
                parse_ids(part[cols["dst"]], "destination", where, strings=strings["dst"]),
                parse_times(part[cols["time"]], where),
                edge_feat=parse_floats(part, cols["feat"], "feature", where) if feat else None,
                label=None if label is None else parse_labels(part[cols["label"]], where),
            )
        return writer.close()


def _seconds(col: pd.Series) -> pd.Series:
    """Datetimes (naive, or aware and then taken in UTC) as seconds since the epoch."""
    ns = col.dt.as_unit("ns").astype("int64")
    if (ns % 10**9 == 0).all():
        return ns // 10**9
    return ns / 1e9
