"""Memory-based temporal GNN models (TGN, JODIE, APAN, DyRep) and their building blocks.

:func:`model_class` is the one place that maps a model name to its class;
:func:`build_model` builds one from constructor arguments, :func:`model_from_config` from
the ``model`` config section and the data's facts (:meth:`MemoryModel.from_config`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sven.models.apan import APAN
from sven.models.base import LinkDecoder, MemoryModel, ModelOutput, time_gap_scale
from sven.models.dyrep import DyRep
from sven.models.jodie import JODIE
from sven.models.memory import MemoryRows, MemoryState, MemoryUpdate
from sven.models.tgn import TGN

if TYPE_CHECKING:
    from sven.config import ModelConfig

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
    "model_class",
    "model_from_config",
    "time_gap_scale",
]


def model_class(name: str) -> type[MemoryModel]:
    """The class of a model name ("tgn", "jodie", "apan", "dyrep"; any case)."""
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None


def build_model(name: str, **kwargs: Any) -> MemoryModel:
    """Instantiates a model by name ("tgn", "jodie", "apan", "dyrep")."""
    return model_class(name)(**kwargs)


def model_from_config(model_cfg: ModelConfig, **data_facts: Any) -> MemoryModel:
    """The model of ``model_cfg.name`` from its config (see :meth:`MemoryModel.from_config`)."""
    return model_class(model_cfg.name).from_config(model_cfg, **data_facts)
