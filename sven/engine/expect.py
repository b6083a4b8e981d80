"""What a long run says about its length: a hint at the start, an estimate after epoch 0.

A preset of 100 epochs on a real dataset runs for hours on a CPU; without a word, a
first-time user cannot tell a long run from a stuck one. :func:`start_hint` speaks
before the first step (on a CPU, where epochs times events is large), and
:func:`epoch_estimate` after the first whole epoch a process runs, from its measured time,
whenever the rest of the run is more than a few minutes.
"""

from __future__ import annotations

__all__ = ["LONG_CPU_EVENTS", "epoch_estimate", "start_hint"]

#: Training events (epochs x events per epoch) from which a CPU run is called long:
#: about ten minutes or more at the rate of a CPU (docs/accuracy.md has the wall times
#: of CPU runs).
LONG_CPU_EVENTS = 2_000_000
# The rest of a run that is worth an estimate, seconds.
_SAY_FROM_S = 120.0


def _duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.4 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def start_hint(device: str, epochs: int, events_per_epoch: int) -> str | None:
    """The line a long CPU run says before its first step, or None.

    Args:
        device: The run's device type (``"cpu"``, ``"cuda"``).
        epochs: ``train.epochs``.
        events_per_epoch: Training events of one epoch (``train.max_batches`` applied).
    """
    if device != "cpu" or epochs * events_per_epoch < LONG_CPU_EVENTS:
        return None
    return (
        f"expect a long run: up to {epochs} epochs of {events_per_epoch:,} training events "
        "on the CPU (tens of minutes to hours); an estimate follows the first epoch. "
        "train.epochs=N shortens it, a GPU (train.device=cuda) speeds it up"
    )


def epoch_estimate(epoch: int, epoch_s: float, epochs_left: int, patience: int) -> str | None:
    """The line after the first whole epoch a process ran: how long the rest may take, or None.

    Args:
        epoch: The epoch just finished.
        epoch_s: Its seconds, training and validation.
        epochs_left: Epochs still to run at most (``train.epochs - epoch - 1``).
        patience: ``train.patience`` (0: no early stopping).
    """
    rest = epoch_s * epochs_left
    if epochs_left <= 0 or rest < _SAY_FROM_S:
        return None
    early = f"; early stopping (train.patience={patience}) may end it sooner" if patience else ""
    return (
        f"epoch {epoch} took {_duration(epoch_s)} with validation: the {epochs_left} epochs "
        f"left take up to {_duration(rest)}{early}"
    )
