"""Memory-based temporal GNN models (TGN, JODIE, APAN, DyRep) and their building blocks.

:data:`MODEL_NAMES` is the one list of model names (from :mod:`sven.models.names`,
which the config's ``model.name`` and ``sven partition --model`` read);
:func:`model_class` maps a name to its class, :func:`build_model` builds one from
constructor arguments, :func:`model_from_config` from the ``model`` config section and
the data's facts (:meth:`MemoryModel.from_config`).

The classes load on first use (PEP 562), so that reading the names, as the config and
``sven --help`` do, imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sven.models.names import MODEL_CLASSES, MODEL_NAMES

if TYPE_CHECKING:
    from sven.config import ModelConfig
    from sven.models.apan import APAN
    from sven.models.base import LinkDecoder, MemoryModel, ModelOutput, time_gap_scale
    from sven.models.dyrep import DyRep
    from sven.models.jodie import JODIE
    from sven.models.memory import MemoryRows, MemoryState, MemoryUpdate
    from sven.models.tgn import TGN

#: The package's public names -> the module that defines each.
_EXPORTS: dict[str, str] = {
    "TGN": "sven.models.tgn",
    "JODIE": "sven.models.jodie",
    "APAN": "sven.models.apan",
    "DyRep": "sven.models.dyrep",
    "LinkDecoder": "sven.models.base",
    "MemoryModel": "sven.models.base",
    "ModelOutput": "sven.models.base",
    "time_gap_scale": "sven.models.base",
    "MemoryRows": "sven.models.memory",
    "MemoryState": "sven.models.memory",
    "MemoryUpdate": "sven.models.memory",
}

__all__ = [
    "APAN",
    "JODIE",
    "MODELS",
    "MODEL_NAMES",
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


def __getattr__(name: str) -> Any:
    """Loads a class (or ``MODELS``, name -> class) on first use, then keeps it here."""
    if name == "MODELS":
        value: Any = {n: model_class(n) for n in MODEL_NAMES}
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def model_class(name: str) -> type[MemoryModel]:
    """The class of a model name (one of :data:`MODEL_NAMES`; any case)."""
    try:
        cls = MODEL_CLASSES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODEL_NAMES)}") from None
    return __getattr__(cls)  # type: ignore[no-any-return]


def build_model(name: str, **kwargs: Any) -> MemoryModel:
    """Instantiates a model by name (one of :data:`MODEL_NAMES`)."""
    return model_class(name)(**kwargs)


def model_from_config(model_cfg: ModelConfig, **data_facts: Any) -> MemoryModel:
    """The model of ``model_cfg.name`` from its config (see :meth:`MemoryModel.from_config`)."""
    return model_class(model_cfg.name).from_config(model_cfg, **data_facts)
