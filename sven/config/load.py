"""Configs in and out: a YAML preset with ``key=value`` overrides (:func:`load_config`),
the resolved config as JSON (:func:`dump_config`), and what may differ when a run
resumes (:data:`RESUME_MAY_CHANGE`, :func:`config_differences`).

Overrides address fields by dotted path (``train.batch_size=600``) and are parsed
with YAML scalar rules.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import yaml

from sven.config.schema import Config
from sven.errors import ConfigError

#: Keys whose value may differ between a checkpoint's config and the config that
#: resumes it: how long and how verbosely to go on, where and on how many threads to
#: run and with which kernels, and how to treat the folders; none of them changes what
#: the model computes (a device, a compiled model or TF32 products change its rounding,
#: not its function or its state's layout).
RESUME_MAY_CHANGE = frozenset(
    {
        "train.epochs",
        "train.patience",
        "train.resume",
        "train.overwrite",
        "train.checkpoint_every",
        "train.keep_latest_k",
        "train.checkpoint_async",
        "train.checkpoint_threads",
        "state.device",
        "state.gpu_budget_gb",
        "state.host_budget_gb",
        "state.path",
        "train.device",
        "train.threads",
        "train.compile",
        "train.matmul_precision",
        "nc.epochs",
        "nc.patience",
        "data.verify",
        "dist.timeout_s",
        "dist.backend",
        "pipeline.prefetch",
        "pipeline.micro_batches",
        "quiet",
        "profile",
        "log.profile_start",
        "log.profile_steps",
        "out",
    }
)


def config_differences(saved: dict[str, Any], current: Config) -> list[str]:
    """The dotted keys whose values differ between a checkpoint's config and ``current``.

    Keys in :data:`RESUME_MAY_CHANGE` are ignored. A key the checkpoint lacks (it was
    written before the key existed) takes its default; a key this version does not
    know counts as different.

    Args:
        saved: The ``config`` dict stored in a checkpoint.
        current: The config of the run that resumes it.

    Returns:
        Sorted ``key (saved -> current)`` strings; empty when the configs agree.
    """
    try:
        saved = Config.from_dict(saved).to_dict()
    except ConfigError:
        pass  # keys of another version: compared as they are
    a, b = _flatten(saved), _flatten(current.to_dict())
    for flat in (a, b):
        # The same store named relative or absolute is the same store.
        if flat.get("data.path"):
            flat["data.path"] = os.path.realpath(str(flat["data.path"]))
    out = []
    for key in sorted(set(a) | set(b)):
        if key in RESUME_MAY_CHANGE:
            continue
        if a.get(key, "<missing>") != b.get(key, "<missing>"):
            out.append(f"{key} ({a.get(key, '<missing>')!r} -> {b.get(key, '<missing>')!r})")
    return out


#: What a checkpoint fixes: the model (its kind and widths, which its weights have)
#: and the task. A command that evaluates or applies a saved model cannot change them.
CHECKPOINT_FIXES = ("model.", "task")


def checkpoint_fixed(saved: Config, current: Config) -> list[str]:
    """The keys a checkpoint fixes (:data:`CHECKPOINT_FIXES`) whose values differ.

    Args:
        saved: The checkpoint's config.
        current: The config with the command's overrides.

    Returns:
        Sorted ``key (saved -> current)`` strings; empty when none differs.
    """
    a, b = _flatten(saved.to_dict()), _flatten(current.to_dict())
    return [
        f"{k} ({a[k]!r} -> {b.get(k)!r})"
        for k in sorted(a)
        if k.startswith(CHECKPOINT_FIXES) and a[k] != b.get(k)
    ]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    cur[keys[-1]] = value


#: The config's sections (the top-level keys whose value is a mapping of keys).
_SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if isinstance(f.default_factory, type))


def _kind(value: Any) -> str:
    kinds = {
        list: "a list",
        str: "a string",
        int: "a number",
        float: "a number",
        bool: "true/false",
    }
    return kinds.get(type(value), type(value).__name__)


def _yaml_problem(path: Path, exc: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: the file, line and column, and what is wrong."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
    context, at = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    extra = f" ({context} at line {at.line + 1})" if context and at else ""
    return f"{where}: invalid YAML: {problem}{extra}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads a YAML preset (optional) and applies ``key=value`` overrides.

    Args:
        path: YAML file with sections data/model/train and top-level out/quiet.
        overrides: Dotted ``key=value`` strings; values parse as YAML scalars.

    Returns:
        The validated config.
    """
    d: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            d = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(_yaml_problem(p, exc)) from None
        if not isinstance(d, dict):
            raise ConfigError(
                f"{p}: the top level must be a mapping of sections (data:, model:, "
                f"train:, ...), got {_kind(d)}"
            )
        for name in _SECTIONS:
            if d.get(name) is not None and not isinstance(d[name], dict):
                # Named here, with its file: an override into it would blame itself.
                raise ConfigError(
                    f"{p}: section {name}: must be a mapping of keys ({name}: then "
                    f"indented key: value lines), got {_kind(d[name])}"
                )
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(d, key.strip(), value)
    return Config.from_dict(d)


def config_overrides(cfg: Config, overrides: list[str]) -> list[str]:
    """Flattens a config into dotted ``key=value`` overrides, followed by ``overrides``
    (which therefore win): a config with some fields changed, for :func:`load_config`."""
    flat: list[str] = []

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat.append(f"{prefix}{k}={json.dumps(v)}")

    walk(cfg.to_dict(), "")
    return flat + list(overrides)


def as_config(
    config: Config | dict[str, Any] | str | Path | None, overrides: list[str] | None = None
) -> Config:
    """The config of a run given as a Config, a dict of sections, a YAML path or None
    (the defaults), with ``overrides`` applied."""
    if isinstance(config, Config):
        return config if not overrides else load_config(None, config_overrides(config, overrides))
    if isinstance(config, dict):
        cfg = Config.from_dict(config)
        return load_config(None, config_overrides(cfg, overrides)) if overrides else cfg
    return load_config(config, overrides)


def dump_config(cfg: Config, path: str | Path) -> None:
    """Writes the resolved config as JSON (exactly what the run used)."""
    Path(path).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
