"""Vertex partitioning for vertex-owned memory, its on-disk format and cost model.

Installed as ``sven.partition``; always import it under that name. Its modules:

- ``api``: one call from an event store to a partition and its cost report.
- ``strategies``: the hash, range, LDG and METIS owners; ``minmax``: the min-max
  communication partitioner; ``graph``: the interaction graph they work on;
  ``assign``: every event to the owner of one of its endpoints.
- ``cost``: the exact replay of one epoch, counting what crosses ranks;
  ``access``: what a batch touches (roots, sampled neighbours; read or written);
  ``report``: the cost report, its bytes and its table.
- ``scaling``: events/s of P synchronous ranks from the per-batch counts.
- ``store``: the partition directory (format, writer, loader).
- ``cli``: ``sven partition``.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Strategy names accepted by ``sven partition --strategy`` (here, not in ``api``: the
#: CLI's parser needs them without importing the partitioners).
STRATEGIES = ("hash", "range", "ldg", "metis", "minmax")

# Public names and the submodule that defines each. Resolved on first use so that
# ``sven`` (whose CLI imports ``sven.partition.cli``) does not pay for METIS and the
# cost model on every command.
_EXPORTS = {
    "PartitionResult": "api",
    "partition_arrays": "api",
    "partition_store": "api",
    "evaluate_store": "api",
    "CostReport": "report",
    "RowBytes": "report",
    "SampledCost": "cost",
    "comm_cost": "cost",
    "format_report": "report",
    "recent_sampler": "access",
    "row_bytes": "report",
    "Partition": "store",
    "load_partition": "store",
    "write_partition": "store",
}

__all__ = sorted([*_EXPORTS, "STRATEGIES"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
