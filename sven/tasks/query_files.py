"""The files of ``sven predict`` and ``sven embed``: questions read, answers written.

:func:`read_pairs` reads the pairs a user asks scores of (csv or parquet, columns src,
dst, t); :func:`write_table` writes a command's answers (csv, parquet, or an array as
.npy) atomically. Both are re-exported by :mod:`sven.tasks.predict`, where
:class:`~sven.tasks.predict.Predictor` answers the questions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sven.errors import DataError

__all__ = ["read_pairs", "write_table"]


def read_pairs(path: str | Path) -> Any:
    """A csv or parquet table with columns src, dst, t (a pandas DataFrame).

    Raises:
        DataError: Unreadable, or a column missing.
    """
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise DataError("no such file", p)
    try:
        if p.suffix == ".parquet":
            df = pd.read_parquet(p)
        else:
            df = pd.read_csv(p, dtype={"src": str, "dst": str})
    except Exception as exc:  # pandas and pyarrow raise many kinds
        raise DataError(f"not a readable csv or parquet table: {exc}", p) from None
    missing = [c for c in ("src", "dst", "t") if c not in df.columns]
    if missing:
        raise DataError(
            f"missing column(s) {', '.join(missing)}; the table needs src, dst, t "
            f"(it has {', '.join(map(str, df.columns))})",
            p,
        )
    t = pd.to_numeric(df["t"], errors="coerce")
    if t.isna().any():
        row = int(np.flatnonzero(t.isna().to_numpy())[0])
        raise DataError(f"row {row}: t is not a number ({df['t'].iloc[row]!r})", p)
    df["t"] = t
    return df


def write_table(df: Any, path: str | Path, *, overwrite: bool = True) -> None:
    """Writes a DataFrame as csv or parquet, or an array as .npy (by the suffix),
    atomically (:func:`sven.outputs.atomic_output`): a temporary file beside it, renamed
    into place, so a failure leaves no half-written output.

    Args:
        df: A DataFrame (.csv, .parquet) or an array (.npy).
        path: The output file.
        overwrite: Replace an existing file; False refuses one that appeared since the
            command checked its ``--out``.
    """
    from sven.outputs import atomic_output

    p = Path(path)
    if not p.parent.is_dir():
        raise DataError("the output folder does not exist", p.parent)
    with atomic_output(p, overwrite=overwrite) as tmp:
        if p.suffix == ".parquet":
            df.to_parquet(tmp, index=False)
        elif p.suffix == ".npy":
            with open(tmp, "wb") as f:
                np.save(f, df)
        else:
            df.to_csv(tmp, index=False)
