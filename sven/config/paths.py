"""Every path a config names, resolved once to what the user meant and checked before
any work.

The keys of :data:`PATH_KEYS` name files and folders. Given on the command line (or
in a preset), a relative one means a path under the folder the command runs in: the
trainer makes them absolute (:func:`absolute_paths`) before the run's ``config.json``
and checkpoints record them, so a run reused from another folder (``sven eval``,
``sven predict``, ``nc.encoder``) still finds its store. A run recorded by an older
Sven may hold relative paths; :func:`recorded_config` resolves them against the
run's own folder, or takes the store's absolute path that every checkpoint records.

:func:`check_paths` refuses a path of the wrong kind (a file where a folder goes, a
folder under one nobody may write, a partition that is not there) with one line and
exit code 2, before any store is read.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from sven.config.schema import Config
from sven.errors import ConfigError

__all__ = [
    "PATH_KEYS",
    "absolute_paths",
    "check_paths",
    "command_config",
    "recorded_config",
    "writable_folder",
]

#: The config's keys that name a path (``section.field``; ``out`` at the top level).
PATH_KEYS = ("out", "data.path", "state.path", "dist.partition", "nc.encoder")


def _get(cfg: Config, key: str) -> str:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return str(obj)


def _with(cfg: Config, values: dict[str, str]) -> Config:
    """A copy of ``cfg`` with the dotted keys ``values`` replaced (no checks re-run)."""
    top: dict[str, Any] = {}
    for key, value in values.items():
        section, _, name = key.rpartition(".")
        if not section:
            top[name] = value
            continue
        sec = top.get(section, getattr(cfg, section))
        top[section] = dataclasses.replace(sec, **{name: value})
    return dataclasses.replace(cfg, **top)


def absolute_paths(cfg: Config, base: str | os.PathLike[str] | None = None) -> Config:
    """``cfg`` with every relative path of :data:`PATH_KEYS` made absolute.

    Args:
        cfg: The config as given.
        base: What a relative path is relative to; None: the current folder.

    Returns:
        A config whose non-empty paths are absolute (symbolic links kept as written).
    """
    root = Path(base) if base is not None else Path.cwd()
    changed = {}
    for key in PATH_KEYS:
        value = _get(cfg, key)
        if value and not os.path.isabs(value):
            changed[key] = os.path.normpath(root / value)
    return _with(cfg, changed) if changed else cfg


def writable_folder(folder: str | os.PathLike[str], key: str) -> None:
    """Refuses a folder that a command cannot create or write into, before any work.

    ``folder`` need not exist: its nearest existing ancestor must be a folder this
    process may write into. An existing ``folder`` must be a folder.

    Args:
        folder: The folder to be written.
        key: The config key or option naming it, for the message.

    Raises:
        ConfigError: The path is a file, lies under a file, or under a folder that
            cannot be written (one line naming it).
    """
    p = Path(os.path.abspath(folder))
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{key}: {p} is a file, not a folder; give a folder")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}: {p} lies under {probe}, which is a file; give a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "" if probe == p else f" (under {probe})"
        raise ConfigError(f"{key}: {p} cannot be written{what}: permission denied")


def check_paths(cfg: Config, *, writes: bool = True) -> None:
    """Checks the kind of every path the config names, before any store is read.

    Args:
        cfg: The config (its paths resolved).
        writes: The command writes a run (``out``, and ``state.path`` for the disk
            tier); False for commands that write nothing (``sven eval``, predictions,
            ``--dry-run``), whose scratch goes to a temporary folder instead.

    Raises:
        ConfigError: One line naming the key and the problem.
    """
    data = cfg.data.path
    if data and os.path.exists(data) and not os.path.isdir(data):
        raise ConfigError(f"data.path: {data} is a file, not an event store (a folder)")
    part = cfg.dist.partition
    if part and not os.path.isdir(part):
        what = "is a file, not" if os.path.exists(part) else "is not"
        raise ConfigError(
            f"dist.partition: {part} {what} a partition folder (make one with `sven partition`)"
        )
    if not writes:
        return
    writable_folder(cfg.out, "out")
    if cfg.state.path and cfg.state.device in ("auto", "disk"):
        from sven.models.storage import check_state_folder

        writable_folder(cfg.state.path, "state.path")
        check_state_folder(Path(cfg.state.path))
        if os.path.abspath(cfg.state.path) == os.path.abspath(cfg.out):
            raise ConfigError(
                "state.path: the run folder itself cannot hold the node-state files; "
                "leave state.path empty (they go to <out>/state) or give a folder of their own"
            )


def command_config(cfg: Config, *, writes: bool = True) -> Config:
    """``cfg`` with its paths absolute (:func:`absolute_paths`) and checked
    (:func:`check_paths`): what every command does first.

    Under a launcher every rank finds the same; only rank 0 says so.

    Raises:
        ConfigError: A path of the wrong kind (quiet on ranks other than 0).
    """
    from sven.distributed.launcher import detect_launcher

    cfg = absolute_paths(cfg)
    try:
        check_paths(cfg, writes=writes)
    except ConfigError as err:
        err.quiet = detect_launcher(os.environ).rank != 0
        raise
    return cfg


def recorded_config(
    state: dict[str, Any], folder: str | os.PathLike[str], world_size: int = 1
) -> Config:
    """The config a checkpoint recorded, its paths resolved to what its run meant.

    A relative path was relative to the folder the run was started from, which the
    checkpoint does not name: ``data.path`` becomes the store's absolute path that the
    checkpoint records (its identity, :func:`sven.datasets.identity.store_identity`),
    where that store is there; any other relative path is taken relative to the run
    folder (the ``step-N`` folder's grand-parent), or to the current folder where
    only there it exists (an older run reused from where it was started).

    Args:
        state: The checkpoint's ``state.pt`` (its ``config`` and ``data``).
        folder: The ``step-N`` folder it was read from.
        world_size: The ranks of the command reusing it: on one process the run's
            ``dist.partition`` is dropped (one process needs none; a checkpoint of P
            ranks is read on any number of ranks).

    Returns:
        The config, every non-empty path absolute.
    """
    cfg = Config.from_dict(state["config"])
    data = state.get("data") if isinstance(state.get("data"), dict) else {}
    store = data.get("store") if isinstance(data.get("store"), dict) else {}
    recorded = store.get("path")
    changed = {}
    if (
        cfg.data.path
        and not os.path.isabs(cfg.data.path)
        and isinstance(recorded, str)
        and os.path.isabs(recorded)
        and os.path.isdir(recorded)
    ):
        changed["data.path"] = recorded
    if world_size == 1 and cfg.dist.partition:
        changed["dist.partition"] = ""
    run = Path(os.path.abspath(folder)).parent.parent
    for key in PATH_KEYS:
        value = changed.get(key, _get(cfg, key))
        if value and not os.path.isabs(value):
            # The run's folder first; the current one where only it has the path (a
            # run reused from where it was started, as before paths were recorded).
            there, here = os.path.normpath(run / value), os.path.abspath(value)
            changed[key] = here if not os.path.exists(there) and os.path.exists(here) else there
    return _with(cfg, changed) if changed else cfg
