"""Vertex partitioning for vertex-owned memory, its on-disk format and cost model.

Installed as ``sven.partition``; always import it under that name.
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
    "CostReport": "cost",
    "RowBytes": "cost",
    "SampledCost": "cost",
    "comm_cost": "cost",
    "format_report": "cost",
    "recent_sampler": "cost",
    "row_bytes": "cost",
    "Partition": "store",
    "load_partition": "store",
    "write_partition": "store",
}

__all__ = sorted([*_EXPORTS, "STRATEGIES"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
