"""The whole run's :class:`Config`, how a nested dict becomes one, and its reference.

A dict (a YAML preset, overrides, a checkpoint's saved config) becomes a
:class:`Config` through :meth:`Config.from_dict`: every key must name a field (an
unknown one is refused with the nearest valid key, :func:`suggest_key`) and every
value is coerced to the field's type or refused. :func:`config_fields` and
:func:`section_doc` read the fields' docstrings for the help texts and
``docs/config.md``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from sven.config import sections
from sven.errors import ConfigError

TASKS = ("link_prediction", "node_classification")


@dataclass(kw_only=True)
class Config:
    """A whole run."""

    task: str = "link_prediction"
    """What ``sven train`` trains: link_prediction (future links; the default) or
    node_classification (per-event labels on top of a link-prediction model; the
    ``nc`` section)."""

    data: sections.DataConfig = field(default_factory=sections.DataConfig)
    model: sections.ModelConfig = field(default_factory=sections.ModelConfig)
    train: sections.TrainConfig = field(default_factory=sections.TrainConfig)
    eval: sections.EvalConfig = field(default_factory=sections.EvalConfig)
    dist: sections.DistConfig = field(default_factory=sections.DistConfig)
    pipeline: sections.PipelineConfig = field(default_factory=sections.PipelineConfig)
    state: sections.StateConfig = field(default_factory=sections.StateConfig)
    log: sections.LogConfig = field(default_factory=sections.LogConfig)
    nc: sections.NodeClassConfig = field(default_factory=sections.NodeClassConfig)
    out: str = "runs/default"
    """Output directory (metrics, summary, checkpoints)."""
    quiet: bool = False
    """No progress bar."""
    profile: bool = False
    """Write a Chrome trace of a few training steps per rank (``torch.profiler``) to
    ``<out>/traces/rank<R>.json``: steps ``log.profile_start`` to ``log.profile_start +
    log.profile_steps - 1`` of the first epoch; open it in ``chrome://tracing`` or
    https://ui.perfetto.dev. Every run records its per-stage times anyway
    (``stage_<name>_s_per_rank`` in ``metrics.jsonl``)."""

    def __post_init__(self) -> None:
        self.task = self.task.lower()
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (JSON/YAML serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """Builds a config from a nested dict, rejecting unknown keys."""
        return _build(cls, d, "")


def _build(cls: type, d: dict[str, Any], prefix: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {d!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in names:
            raise ConfigError(_unknown_key(prefix + key, value, sorted(names)))
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, typ, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(value: Any, typ: Any, name: str) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string.
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if typ is str:
        return "" if value is None else str(value)
    return value


@dataclass(frozen=True)
class ConfigField:
    """One leaf of the config, for help texts and the reference.

    Attributes:
        key: Dotted key, e.g. ``"train.epochs"``.
        type: Type name (``"int"``, ``"float"``, ``"str"``, ``"bool"``).
        default: The default value.
        doc: The docstring below the field in this module (empty if it has none).
    """

    key: str
    type: str
    default: Any
    doc: str


@functools.cache
def _docstrings() -> dict[str, dict[str, str]]:
    """``{class name: {"": class docstring, field: field docstring}}`` of the config's
    classes (:mod:`sven.config.sections` and :class:`Config` here).

    Field docstrings are the string literals right below each annotated field; Python
    keeps none of them at run time, so they are read from the source once.
    """
    try:
        trees = [ast.parse(inspect.getsource(m)) for m in (sections, sys.modules[__name__])]
    except OSError:  # installed without sources: help texts lose their docstrings only
        return {}
    out: dict[str, dict[str, str]] = {}
    for node in (node for tree in trees for node in tree.body):
        if not isinstance(node, ast.ClassDef):
            continue
        docs = {"": inspect.cleandoc(ast.get_docstring(node) or "")}
        for stmt, after in zip(node.body, node.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
        out[node.name] = docs
    return out


def section_doc(name: str) -> str:
    """The docstring of a config section (``"train"``), or of :class:`Config` for ``""``."""
    cls = get_type_hints(Config)[name] if name else Config
    return _docstrings().get(cls.__name__, {}).get("", "")


def config_fields(cls: type = Config, prefix: str = "") -> list[ConfigField]:
    """Every leaf of the config in declaration order, with its default and docstring.

    Args:
        cls: The dataclass to walk (the whole :class:`Config` by default).
        prefix: Dotted prefix of ``cls``'s fields.

    Returns:
        One :class:`ConfigField` per leaf, sections expanded in place.
    """
    hints = get_type_hints(cls)
    docs = _docstrings().get(cls.__name__, {})
    out: list[ConfigField] = []
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            out.extend(config_fields(typ, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        name = getattr(typ, "__name__", str(typ))
        out.append(ConfigField(prefix + f.name, name, default, docs.get(f.name, "")))
    return out


def suggest_key(key: str) -> str | None:
    """The valid config key nearest to a misspelt one, or None if none is close.

    Args:
        key: A dotted key that is not in the config, e.g. ``"train.epoch"``.

    Returns:
        The same field name in another section (``"epochs"`` -> ``"train.epochs"``),
        else the closest dotted key by :func:`difflib.get_close_matches`.
    """
    keys = [f.key for f in config_fields()]
    leaf = key.rsplit(".", 1)[-1]
    same = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if len(same) == 1:
        return same[0]
    core = [k for k in same if k.split(".", 1)[0] in ("data", "model", "train")]
    if len(core) == 1:
        # A name both a core section and a task's section have (epochs, lr): the core
        # one is what a key without its section most likely meant.
        return core[0]
    section, _, name = key.rpartition(".")
    inside = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    if section and inside:
        # A known section: compare the field names alone, so that the shared prefix
        # does not make any key of the section look close.
        close = difflib.get_close_matches(name, inside, n=1, cutoff=0.6)
        return f"{section}.{close[0]}" if close else None
    # Sections are suggested only for a top-level name ("trian" -> "train").
    sections = sorted({k.rsplit(".", 1)[0] for k in keys if "." in k}) if not section else []
    close = difflib.get_close_matches(key, keys + sections, n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_key(key: str, value: Any, known: list[str]) -> str:
    # A misspelt section ("trian: {epochs: 3}") is best named by its first full key.
    tried = [f"{key}.{k}" for k in value] if isinstance(value, dict) else []
    for cand in [*tried, key]:
        hint = suggest_key(cand)
        if hint is not None:
            return f"unknown config key {cand!r}; did you mean {hint!r}?"
    return f"unknown config key {key!r}; known here: {known} (all keys: sven config --reference)"
