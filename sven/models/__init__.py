"""Memory-based temporal GNN models (TGN, JODIE, APAN, DyRep) and their building blocks.

:func:`build_model` is the one place that maps a model name to its class.
"""

from __future__ import annotations

from typing import Any

from sven.models.apan import APAN
from sven.models.base import LinkDecoder, MemoryModel, ModelOutput
from sven.models.dyrep import DyRep
from sven.models.jodie import JODIE
from sven.models.memory import MemoryRows, MemoryState, MemoryUpdate
from sven.models.tgn import TGN

MODELS: dict[str, type[MemoryModel]] = {"tgn": TGN, "jodie": JODIE, "apan": APAN, "dyrep": DyRep}

__all__ = [
    "APAN",
    "JODIE",
    "MODELS",
    "TGN",
    "DyRep",
    "LinkDecoder",
    "MemoryModel",
    "MemoryRows",
    "MemoryState",
    "MemoryUpdate",
    "ModelOutput",
    "build_model",
]


def build_model(name: str, **kwargs: Any) -> MemoryModel:
    """Instantiates a model by name ("tgn", "jodie", "apan", "dyrep")."""
    try:
        cls = MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
    return cls(**kwargs)
