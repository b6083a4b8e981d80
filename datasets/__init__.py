"""Event store, raw-format readers, synthetic generator and the ``sven data`` CLI.

Installed as ``sven.datasets``; always import it under that name. From Python,
``sven.datasets.from_dataframe(df, out, src=..., dst=..., time=...)`` writes a store
from a pandas DataFrame.

The event store, from what users call to what it is built on:

- ``store``: ``TemporalEvents`` (open and read a store), ``StoreWriter`` and
  ``write_events`` (write one), ``open_verified_store`` (open it checksummed).
- ``writer``: the on-disk format and ``StoreBuilder``, which streams events to disk.
- ``spool``, ``compact``, ``splits``: the writer's parts: column files and the time
  sort, compact node ids, the chronological split.
- ``layout``: the format's constants and the checks that open a store.
- ``checksums``: the sha256 of every column file, and their verification.
- ``target``: where a store may be written (``--out``, ``--overwrite``).
- ``negatives``: fixed evaluation negatives (TGB's files), added to a store.

Raw formats into a store:

- ``readers``: ``convert``, ``open_reader``, ``detect_format``: which reader, and the
  stream into a ``StoreWriter``.
- ``snap_jodie``, ``dyglib_tgl``, ``tables``: the readers, a module per family of
  formats (``tables`` also holds ``ColumnMap``, for csv, TGB and parquet).
- ``rawreader``: the interface they implement (``RawReader``, ``EventChunk``).
- ``delimited``: text read in blocks of whole lines, decompressed and hashed.
- ``fields``: a parsed column as a checked array, or the line of its first bad value.
- ``frame``: a pandas DataFrame into a store.

Around it:

- ``registry``: the public datasets ``sven data fetch`` knows (source, counts, sha256,
  licence, citation); ``fetch``: their download into the cache, verified, converted.
- ``synth``: the synthetic generator: its model, ``SynthParams``, the stream in chunks,
  its store and the cached default dataset; ``synth_stream``: the draw, block by block.
- ``info``: a store's statistics (``sven data info``).
- ``cli``: ``sven data ...``: fetch, convert, info, verify, negatives, synth.
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
