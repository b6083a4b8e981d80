"""A run's folder: what Sven writes there, at every depth, and the checks before it
writes.

A run folder holds ``config.json``, ``metrics.jsonl``, ``summary.json``,
``checkpoints/``, ``best/`` and the optional ``tb/``, ``traces/``, ``logs/``, ``plots/``
(:data:`RUN_FILES`). :func:`prepare_out` refuses a folder that would mix two runs;
text files are replaced atomically (:func:`atomic_write_text`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from sven.errors import ConfigError
from sven.models.storage import STATE_MANIFEST, is_state_folder
from sven.outputs import foreign_outputs
from sven.ownership import json_keys

__all__ = [
    "CHECKPOINT_FOLDER",
    "RUN_FILES",
    "RUN_MANIFEST",
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
    return {"data", "model", "train", "out"} <= json_keys(Path(path) / "config.json")


#: What a run writes at the top of its folder: ``train.overwrite=true`` deletes these
#: and refuses to run where anything else is there, at any depth (the whole manifest is
#: :data:`RUN_MANIFEST`). ``plots`` is ``sven plot``'s.
RUN_FILES = frozenset(
    {"config.json", "metrics.jsonl", "summary.json", "checkpoints", "best", "tb", "traces"}
    | {"logs", "plots", "state"}
)


# One checkpoint (sven.engine.checkpoint, format 2): rank 0's state, each rank's small
# state, the owner map, each rank's node-state files and their chunk sums, meta.json;
# one being written also holds each rank's done or failed mark. Format 1 (Sven 0.1):
# one memory shard per rank and each rank's sums file.
_STEP: dict[str, Any] = {
    r"state\.pt": None,
    r"rank\d+\.pt": None,
    r"owner\.npy": None,
    r"nodes": {r"rank\d+": {r"\w+\.npy": None}},
    r"sums": {r"rank\d+": {r"\w+\.sums": None}},
    r"meta\.json": None,
    r"(?:done-rank\d+\.json(?:\.part)?|failed-rank\d+)": None,
    r"memory-rank\d+\.pt": None,
    r"sums-rank\d+\.json": None,
}

#: ``checkpoints/`` and ``best/``: ``step-N`` folders, and the hidden one being written.
CHECKPOINT_FOLDER: dict[str, Any] = {r"step-\d+": _STEP, r"\.tmp-step-\d+": _STEP}

#: Every name a run writes into its folder, as :data:`sven.ownership.Manifest`.
RUN_MANIFEST: dict[str, Any] = {
    r"config\.json": None,
    r"metrics\.jsonl": None,
    r"summary\.json": None,
    # The temporaries of an atomic write, where a run was killed between its two steps.
    r"\.(?:config\.json|metrics\.jsonl|summary\.json)\.tmp-\d+": None,
    r"checkpoints": CHECKPOINT_FOLDER,
    r"best": CHECKPOINT_FOLDER,
    # TensorBoard's event files (log.tensorboard=true).
    r"tb": {r"events\.out\.tfevents\..+": None},
    # Chrome traces (profile=true) and the ranks' native stderr under a launcher.
    r"traces": {r"rank\d+\.json": None},
    r"logs": {r"rank\d+\.log": None},
    # sven plot's figures: the folder's own manifest says which it wrote.
    r"plots": partial(foreign_outputs, legacy=True),
    # The disk tier's node-state files (state.device=disk): scratch, per rank.
    r"state": STATE_MANIFEST,
}
# Node classification: the link-prediction run trained first, and the folder of the
# encoder's replay (its per-rank logs), each a run folder of its own.
RUN_MANIFEST["encoder"] = RUN_MANIFEST
RUN_MANIFEST["encoder-replay"] = RUN_MANIFEST


def prepare_out(
    out: Path, *, resume: bool, overwrite: bool, log: Callable[[str], None] = print
) -> None:
    """Checks (and with ``overwrite`` empties) the run folder before training writes.

    A missing or empty ``out`` is used as is. A non-empty one is refused unless it is
    a Sven run folder and ``resume`` (continue it) or ``overwrite`` (delete it first)
    is set, so that the checkpoints of two runs never mix. ``overwrite`` deletes only
    what a run writes (:data:`RUN_MANIFEST`, at every depth:
    checkpoints, plots, logs, node-state files) and refuses before deleting anything,
    naming them, where the folder holds anything else.

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

        from sven.ownership import foreign_paths, refuse_foreign

        foreign = foreign_paths(out, RUN_MANIFEST)
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
    return p.name == "state" and p.is_dir() and is_state_folder(p)


def finite_or_none(d: dict[str, Any]) -> dict[str, Any]:
    """Replaces NaN/inf floats by None: JSON has no NaN, and None reads as "undefined"
    (e.g. inductive metrics of a split without inductive events)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def fmt(x: float | None) -> str:
    """A metric as printed: four decimals, or n/a."""
    return "n/a" if x is None else f"{x:.4f}"
