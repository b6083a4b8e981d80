"""Column validation: a parsed column as a checked numpy array, or the first bad value.

Every reader turns its columns into arrays through these functions (node ids, times,
features, labels), so that a bad value is reported the same way in every format: a
``DataError`` naming the file and the physical line (text) or the data row (parquet)
of the first bad value (:class:`Where`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sven.errors import DataError

__all__ = ["Where", "parse_floats", "parse_ids", "parse_labels", "parse_times"]

_INT64_MAX = np.iinfo(np.int64).max
_NAN_INF = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


def _fail(reason: str, path: Path, unit: str, number: int) -> DataError:
    """A DataError at a line (text) or a row (parquet)."""
    if unit == "line":
        return DataError(reason, path, number)
    return DataError(f"row {number}: {reason}", path)


@dataclass
class Where:
    """Locates row i of the current chunk in the input, for error messages."""

    path: Path
    numbers: np.ndarray
    unit: str = "line"

    def fail(self, i: int, reason: str) -> DataError:
        return _fail(reason, self.path, self.unit, int(self.numbers[i]))


def _numeric(col: pd.Series, what: str, where: Where, *, time: bool = False) -> np.ndarray:
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


def parse_ids(col: pd.Series, what: str, where: Where, *, strings: bool = False) -> np.ndarray:
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


def parse_times(col: pd.Series, where: Where) -> np.ndarray:
    """(n,) int64 or float64 finite timestamps."""
    arr = _numeric(col, "time", where, time=True)
    if arr.dtype.kind == "u":
        over = arr > _INT64_MAX
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise where.fail(i, f"time {col.iat[i]} overflows int64")
        return arr.astype(np.int64)
    return arr.astype(np.float64 if arr.dtype.kind == "f" else np.int64, copy=False)


def parse_floats(frame: pd.DataFrame, cols: Sequence[Any], what: str, where: Where) -> np.ndarray:
    """(n, len(cols)) float32 from numeric columns."""
    out = np.empty((len(frame), len(cols)), dtype=np.float32)
    for j, c in enumerate(cols):
        out[:, j] = _numeric(frame[c], what, where)
    finite = np.isfinite(out)  # float64 values beyond float32's range became inf
    if not finite.all():
        i = int(np.flatnonzero(~finite.all(axis=1))[0])
        raise where.fail(i, f"{what} overflows float32")
    return out


def parse_labels(col: pd.Series, where: Where) -> np.ndarray:
    arr = _numeric(col, "label", where)
    return arr.astype(np.float32) if arr.dtype.kind == "f" else arr.astype(np.int64)
