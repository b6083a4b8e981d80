"""Whether a checkpoint was made from the store a command reads it with.

Every command that reads a store with something made from another (eval, predict,
embed, resume, node classification) compares the checkpoint's recorded store identity
(:mod:`sven.datasets.identity`) with the store's: a mismatch is one line naming both,
unless the user asks to apply the model to another store of the same id space, and the
output then says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sven.errors import SvenError

if TYPE_CHECKING:
    from sven.engine.data import Data

__all__ = ["check_same_data", "check_store_first"]


def check_same_data(
    state: dict[str, Any],
    data: Data,
    where: str | Path,
    *,
    other_store: bool = False,
) -> str | None:
    """Stops when a checkpoint was trained on another event store than ``data``.

    Compared: the store's fingerprint (:mod:`sven.datasets.identity`), where the
    checkpoint recorded one; else, for a checkpoint of an older Sven, the node and
    event counts and the split ranges it recorded (a model's memory rows are per node,
    and replay walks the events by index).

    Args:
        state: The checkpoint's ``state.pt``.
        data: The run's data component, on the store given now.
        where: The checkpoint, for the message.
        other_store: Applying the model to another store is meant (``--other-store``):
            accepted where the model's feature widths fit it.

    Returns:
        The line that says a model is applied to another store, or None.

    Raises:
        SvenError: One line naming both stores.
    """
    from sven.datasets.identity import store_identity

    d = state.get("data", {})
    recorded = d.get("store")
    note = _identity(state, store_identity(data.events), where, other_store)
    if (recorded or {}).get("fingerprint"):
        return note
    saved = (d.get("num_nodes"), d.get("num_events"))
    here = (data.num_nodes, int(data.src.numel()))
    ranges = d.get("ranges")
    mine = {s: list(r) for s, r in data.ranges.items()}
    # Checkpoints written before the event count was recorded are judged by the rest.
    same = all(a is None or a == b for a, b in zip(saved, here))
    if not same or (ranges is not None and ranges != mine):
        path = state.get("config", {}).get("data", {}).get("path") or "the built-in data"
        both = (
            f"{where} was trained on another dataset ({saved[0]} nodes, {saved[1]} events, "
            f"from {path}) than {data.cfg.data.path or 'the built-in data'} ({here[0]} nodes, "
            f"{here[1]} events)"
        )
        if other_store:
            return f"{both}; applied to it as --other-store asks"
        raise SvenError(f"{both}; give the store it was trained on")
    return None


def _identity(
    state: dict[str, Any], current: dict[str, Any], where: str | Path, other_store: bool
) -> str | None:
    """The fingerprint half of :func:`check_same_data`: a note, None, or SvenError."""
    from sven.datasets.identity import identity_problem

    problem, note = identity_problem(
        state.get("data", {}).get("store"), current, str(where), verb="was trained on",
        allow_other=other_store, flag="--other-store",
    )  # fmt: skip
    if problem is not None:
        raise SvenError(problem)
    return note


def check_store_first(
    state: dict[str, Any], config: Any, where: str | Path, *, other_store: bool = False
) -> None:
    """:func:`check_same_data`'s fingerprint check before any work: from the store's
    ``meta.json`` alone, before a trainer loads, verifies and tabulates the store.

    Args:
        state: The checkpoint's ``state.pt``.
        config: The :class:`~sven.config.Config` the trainer will run (its
            ``data.path`` is the store given); without one, or where the store cannot
            be read yet, the trainer's own checks speak.
        where: The checkpoint, for the message.
        other_store: As in :func:`check_same_data` (the note comes from there).

    Raises:
        SvenError: One line naming both stores.
    """
    import json

    from sven.datasets.identity import identity_of

    path = config.data.path
    if not path:
        return
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(meta, dict):
        _identity(state, identity_of(meta, path), where, other_store)
