"""Event store, raw-format readers, synthetic generator and the ``sven data`` CLI.

Installed as ``sven.datasets``; always import it under that name. From Python,
``sven.datasets.from_dataframe(df, out, src=..., dst=..., time=...)`` writes a store
from a pandas DataFrame.
"""

from __future__ import annotations

from typing import Any

#: Raw input formats of ``sven data convert`` (here, not in ``readers``: the CLI's
#: parser needs them without importing pandas).
FORMATS = ("snap", "snap-signed", "jodie", "dyglib", "tgl", "csv", "tgb", "parquet")

__all__ = ["FORMATS", "from_dataframe"]


def __getattr__(name: str) -> Any:
    # Lazy: `sven data ...` and `sven --help` must not import pandas for this.
    if name == "from_dataframe":
        from sven.datasets.frame import from_dataframe

        return from_dataframe
    raise AttributeError(f"module 'sven.datasets' has no attribute {name!r}")
