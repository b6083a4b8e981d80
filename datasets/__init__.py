"""Event store, raw-format readers, synthetic generator and the ``sven data`` CLI.

Installed as ``sven.datasets``; always import it under that name.
"""

#: Raw input formats of ``sven data convert`` (here, not in ``readers``: the CLI's
#: parser needs them without importing pandas).
FORMATS = ("snap", "snap-signed", "jodie", "dyglib", "tgl", "csv", "tgb", "parquet")
