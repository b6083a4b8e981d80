"""A trained model put back to work: its run reopened, its stream replayed through it.

Node classification (:mod:`sven.tasks.nodeclass`) and predictions (:mod:`sven.tasks.predict`) both
start from a link-prediction checkpoint and need the memory as the model would have it
at some point of the stream. The memory is a function of the parameters and of the
events seen, in batches: :func:`open_run` rebuilds the run's components around the
checkpoint's model (a :class:`~sven.engine.trainer.Trainer` that is never fit, so the data,
partition, memory and, on several ranks, the memory exchange are the run's own), and
:func:`encode_events` walks events through :meth:`MemoryModel.encode
<sven.models.base.MemoryModel.encode>` the way evaluation walks them: in global batches,
each rank its share, reading and committing memory through the trainer's read/commit
path. A checkpoint also holds the memory at one point of the stream, its own;
:func:`checkpoint_position` says which point (what predictions answer from without a
replay).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sven.engine.checkpoint import find_checkpoint, load_file
from sven.engine.evaluation import EVAL_STREAM
from sven.engine.store_check import check_same_data, check_store_first
from sven.errors import SvenError

if TYPE_CHECKING:
    from sven.config import Config
    from sven.engine.trainer import Trainer

__all__ = [
    "checkpoint_position",
    "encode_events",
    "open_run",
    "read_checkpoint",
    "run_config",
    "split_stream",
]


def read_checkpoint(
    path: str | Path, _depth: int = 0, *, lazy: bool = False
) -> tuple[Path, dict[str, Any]]:
    """The verified ``step-N`` folder a user's path stands for, and its ``state.pt``.

    A node-classification run with a frozen encoder stands for its encoder's checkpoint.
    ``lazy``: its node-state chunks are left to their reader (:func:`find_checkpoint`).

    Raises:
        SvenError: No checkpoint there, a corrupt one, or one without a config.
    """
    folder = find_checkpoint(path, lazy=lazy)
    state = load_file(folder / "state.pt")
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise SvenError(f"{folder / 'state.pt'}: not a Sven checkpoint (no config in it)")
    if "model" not in state and isinstance(state.get("encoder"), str) and _depth < 2:
        # A node-classification run with a frozen encoder: the model is its encoder's.
        return read_checkpoint(state["encoder"], _depth + 1, lazy=lazy)
    if "model" not in state:
        raise SvenError(f"{folder / 'state.pt'}: holds no model")
    return folder, state


def run_config(
    checkpoint: str | Path,
    overrides: list[str] | None = None,
    *,
    other_store: bool = False,
    lazy: bool = False,
) -> tuple[Path, dict[str, Any], Config]:
    """The checkpoint a user's path stands for, its state, and the config of a command
    that reuses it: the run's recorded config with ``overrides``, its paths absolute,
    its store's identity checked against the checkpoint's (from ``meta.json``, before
    anything is read).

    Args:
        checkpoint: A run folder (its best model) or a ``step-N`` folder.
        overrides: Dotted overrides on the checkpoint's config (``data.path``,
            ``train.device``...).
        other_store: Accept a store other than the one the model was trained on.
        lazy: Leave the node-state chunks to their reader (:func:`find_checkpoint`):
            for answers from a few rows of the checkpoint's node state.

    Returns:
        The ``step-N`` folder, its ``state.pt`` and the config.

    Raises:
        SvenError: No usable checkpoint, or one trained on other data.
    """
    from sven.config.load import as_config
    from sven.config.paths import command_config, recorded_config
    from sven.distributed.launcher import detect_launcher

    folder, state = read_checkpoint(checkpoint, lazy=lazy)
    # The run's paths as its run meant them, from wherever this command runs.
    cfg = recorded_config(state, folder, detect_launcher(os.environ).world_size)
    # The replay runs the model's encoder eagerly (Step.encode, never the compiled
    # model): a checkpoint trained with train.compile would only import torch's
    # compiler for nothing.
    extra = ["train.resume=false", "quiet=true", "train.compile=false", *(overrides or [])]
    cfg = command_config(as_config(cfg, extra), writes=False)
    check_store_first(state, cfg, folder, other_store=other_store)
    return folder, state, cfg


def open_run(
    checkpoint: str | Path,
    overrides: list[str] | None = None,
    *,
    other_store: bool = False,
    log: Callable[[str], None] | None = None,
) -> tuple[Trainer, Path, dict[str, Any]]:
    """A trainer of the checkpoint's config, holding the checkpoint's model.

    The memory starts empty (replay builds it); nothing is written to the run folder.
    The trainer holds the run's whole node state and event tables (what a replay
    walks); answers from the checkpoint's node state need neither
    (:class:`sven.tasks.stored.StoredRun`).

    Args:
        checkpoint: A run folder (its best model) or a ``step-N`` folder.
        overrides: Dotted overrides on the checkpoint's config (``data.path``,
            ``train.device``...).
        other_store: Accept a store other than the one the model was trained on
            (:func:`check_same_data`); ``log`` says so.
        log: Where the line about another store goes (stderr by default).

    Returns:
        The trainer, the checkpoint folder and its state.

    Raises:
        SvenError: No usable checkpoint, or one trained on other data.
    """
    from sven.engine.trainer import Trainer

    folder, state, cfg = run_config(checkpoint, overrides, other_store=other_store)
    tr = Trainer(cfg, purpose="replay")
    note = check_same_data(state, tr.data, folder, other_store=other_store)
    if note is not None:
        (log or _note)(note)
    tr.model.load_state_dict(state["model"])
    tr.model.eval()
    return tr, folder, state


def _note(msg: str) -> None:
    print(f"sven: note: {msg}", file=sys.stderr, flush=True)


def encode_events(tr: Trainer, lo: int, hi: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Walks events [lo, hi) through the model without gradients, committing memory.

    In global batches of ``train.batch_size`` from ``lo`` (evaluation's layout); on P
    ranks each rank encodes its share and memory moves through the exchange, so every
    rank must call this with the same range.

    Args:
        tr: The trainer (:func:`open_run`); its memory is advanced.
        lo: First event.
        hi: One past the last.
        stream: Random stream of the batches (:data:`EVAL_STREAM` of the split).

    Returns:
        This rank's events (n,) int64 and the embeddings (n, embed_dim) of their
        sources at their times, from the memory before the batch (what the link
        decoder scores).
    """
    # The step's own selection, exchange and write-back (sven.engine.step.Step.encode).
    return tr.step.encode(lo, hi, stream)


def split_stream(split: str) -> int:
    """The random stream of a split's replay batches: evaluation's (uniform neighbour
    sampling is keyed by it; dropout is off), so that a replay draws what ``sven eval``
    draws."""
    return EVAL_STREAM[split]


def checkpoint_position(
    state: dict[str, Any], ranges: dict[str, tuple[int, ...]], batch_size: int
) -> int | None:
    """How many events of the stream a checkpoint's node state has folded in.

    The best model's state and an epoch's checkpoint are taken after validation (the
    end of the ``val`` split); a mid-epoch checkpoint after its last trained batch. (A
    run of ``train.max_batches`` trained on fewer events than the position says; its
    memory has still seen nothing after it.)

    Args:
        state: The checkpoint's ``state.pt`` (its ``memory_phase`` or ``cursor``).
        ranges: The data's split ranges, split -> (lo, hi) event indices.
        batch_size: The run's ``train.batch_size``.

    Returns:
        The position (events before it are in the memory), or None for a state that
        says nothing of where its memory is.
    """
    if state.get("memory_phase") == "val_end":
        return int(ranges["val"][1])
    cursor = state.get("cursor")
    if not isinstance(cursor, dict):
        return None
    epoch, nb = int(cursor.get("epoch", 0)), int(cursor.get("next_batch", 0))
    if nb == 0:
        return int(ranges["val"][1]) if epoch > 0 else 0
    lo, hi = ranges["train"]
    return int(min(hi, lo + nb * batch_size))
