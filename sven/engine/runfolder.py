"""What a run folder holds, at every depth: the manifest ``train.overwrite`` checks.

A run (``sven train``, link prediction or node classification) writes only the names
below; ``train.overwrite=true`` deletes an earlier run only where everything under it,
to the last file of every checkpoint, is one of them, and otherwise refuses before
deleting anything, naming what is not (:func:`sven.ownership.foreign_paths`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sven.outputs import foreign_outputs

__all__ = ["CHECKPOINT_FOLDER", "RUN_MANIFEST"]

# One checkpoint (sven.engine.checkpoint): rank 0's state, one memory shard per rank,
# meta.json; a checkpoint being written also holds each rank's sums file.
_STEP: dict[str, Any] = {
    r"state\.pt": None,
    r"memory-rank\d+\.pt": None,
    r"meta\.json": None,
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
}
# Node classification: the link-prediction run trained first, and the folder of the
# encoder's replay (its per-rank logs), each a run folder of its own.
RUN_MANIFEST["encoder"] = RUN_MANIFEST
RUN_MANIFEST["encoder-replay"] = RUN_MANIFEST
