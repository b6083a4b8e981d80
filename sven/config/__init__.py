"""Run configuration: nested keyword-only dataclasses, YAML presets, dotted overrides.

YAML files supply values only; every field is declared, typed and checked here, so no
untyped dict ever reaches model or trainer code. ``key=value`` overrides address fields
by dotted path (``train.batch_size=600``) and are parsed with YAML scalar rules.

- :mod:`sven.config.sections`: one dataclass per section (``DataConfig``,
  ``ModelConfig``, ``TrainConfig``, ...), each field with its type, default, docstring
  and checks. A new key goes here.
- :mod:`sven.config.schema`: :class:`Config`, the whole run; how a dict becomes one
  (:meth:`Config.from_dict`: types coerced, an unknown key named with the nearest valid
  one, :func:`suggest_key`), and the field reference (:func:`config_fields`,
  :func:`section_doc`) behind ``sven train --help`` and ``docs/config.md``.
- :mod:`sven.config.load`: :func:`load_config` (a preset and overrides),
  :func:`dump_config`, and the keys a resumed run may change
  (:data:`RESUME_MAY_CHANGE`, :func:`config_differences`).

Every public name is importable from ``sven.config`` itself.
"""

from sven.config.load import (
    CHECKPOINT_FIXES,
    RESUME_MAY_CHANGE,
    checkpoint_fixed,
    config_differences,
    dump_config,
    load_config,
)
from sven.config.schema import TASKS, Config, ConfigField, config_fields, section_doc, suggest_key
from sven.config.sections import (
    DataConfig,
    DistConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    NodeClassConfig,
    PipelineConfig,
    TrainConfig,
)
from sven.errors import ConfigError

__all__ = [
    "CHECKPOINT_FIXES",
    "RESUME_MAY_CHANGE",
    "TASKS",
    "Config",
    "ConfigError",
    "ConfigField",
    "DataConfig",
    "DistConfig",
    "EvalConfig",
    "LogConfig",
    "ModelConfig",
    "NodeClassConfig",
    "PipelineConfig",
    "TrainConfig",
    "checkpoint_fixed",
    "config_differences",
    "config_fields",
    "dump_config",
    "load_config",
    "section_doc",
    "suggest_key",
]
