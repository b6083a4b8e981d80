"""A run's folder: what Sven writes there, and the checks before it writes.

A run folder holds ``config.json``, ``metrics.jsonl``, ``summary.json``,
``checkpoints/``, ``best/`` and the optional ``tb/``, ``traces/``, ``logs/``, ``plots/``
(:data:`RUN_FILES`). :func:`prepare_out` refuses a folder that would mix two runs;
text files are replaced atomically (:func:`atomic_write_text`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sven.errors import ConfigError

__all__ = [
    "RUN_FILES",
    "atomic_write_text",
    "finite_or_none",
    "fmt",
    "is_run_folder",
    "prepare_out",
]


def atomic_write_text(text: str, path: Path) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename (a reader
    never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a Sven run: a ``config.json`` that a trainer wrote."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and {"data", "model", "train", "out"} <= set(cfg)


#: What a run writes into its folder (its manifest): ``train.overwrite=true`` deletes
#: these and refuses to run where anything else is there. ``plots`` is ``sven plot``'s.
RUN_FILES = frozenset(
    {"config.json", "metrics.jsonl", "summary.json", "checkpoints", "best", "tb", "traces"}
    | {"logs", "plots", "state"}
)


def _is_run_file(name: str) -> bool:
    # _atomic_write_text's temporaries (".summary.json.tmp-<pid>"), where it was killed.
    temp = name.startswith(".") and ".tmp-" in name and name[1:].split(".tmp-")[0] in RUN_FILES
    return name in RUN_FILES or temp


def prepare_out(
    out: Path, *, resume: bool, overwrite: bool, log: Callable[[str], None] = print
) -> None:
    """Checks (and with ``overwrite`` empties) the run folder before training writes.

    A missing or empty ``out`` is used as is. A non-empty one is refused unless it is
    a Sven run folder and ``resume`` (continue it) or ``overwrite`` (delete it first)
    is set, so that the checkpoints of two runs never mix. ``overwrite`` deletes only
    what a run writes (:data:`RUN_FILES`) and refuses, naming them, where the folder
    holds anything else.

    Raises:
        ConfigError: ``out`` may not be used; the message says what to do.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"out={out} is a file, not a folder")
    # On several ranks, this launch's own per-rank logs (``out/logs``, where
    # sven.distributed.native_log sends torch's C++ output) are there before the
    # trainer starts.
    # So are the node-state files of this run's disk tier (``out/state``), made when
    # the trainer was built.
    content = [p for p in out.iterdir() if p.name != "logs" and not _own_state(p)]
    if not content:
        return
    run = is_run_folder(out)
    if overwrite:
        if not run:
            raise ConfigError(
                f"out={out} is not empty and not a Sven run folder (no config.json of "
                "Sven's); train.overwrite=true only deletes a run folder: choose another out"
            )
        import shutil

        from sven.ownership import foreign_files, refuse_foreign

        foreign = foreign_files(out, _is_run_file)
        if foreign:
            raise ConfigError("out=" + refuse_foreign(out, foreign, "train.overwrite=true"))
        for p in content:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        log(f"train.overwrite: deleted the earlier run in {out}")
        return
    if resume:
        if not run:
            raise ConfigError(
                f"out={out} is not empty and not a Sven run folder: nothing to resume there"
            )
        return
    what = "an earlier run" if run else "files that are not a Sven run"
    raise ConfigError(
        f"out={out} already holds {what}; use another out, train.resume=true to continue "
        "it, or train.overwrite=true to replace it"
    )


def _own_state(p: Path) -> bool:
    from sven.models.storage import is_state_folder

    return p.name == "state" and p.is_dir() and is_state_folder(p)


def finite_or_none(d: dict[str, Any]) -> dict[str, Any]:
    """Replaces NaN/inf floats by None: JSON has no NaN, and None reads as "undefined"
    (e.g. inductive metrics of a split without inductive events)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def fmt(x: float | None) -> str:
    """A metric as printed: four decimals, or n/a."""
    return "n/a" if x is None else f"{x:.4f}"
