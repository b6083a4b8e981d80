"""One identity for an event store: a fingerprint of its content, and its check.

Everything Sven makes from a store (a run and its checkpoints, a partition) records the
store's identity (:func:`store_identity`); every command that uses such a thing with a
store compares the two (:func:`identity_problem`) before any work, so that a model is
never scored, resumed or replayed on a store other than its own without a word.

The fingerprint is derived from what ``meta.json`` already records, so it costs no
read of the columns: a sha256 over the counts, the id layout and the per-column
sha256 (:class:`~sven.datasets.store.StoreWriter` writes them; each covers a column's
header, hence its dtype and shape, and every byte). A store rewritten in place with the
same path, size and shape but other events has other column checksums, hence another
fingerprint; a store converted again from the same input has the same one. Two
columns are no part of it, being targets that a task scores against rather than the
events a memory model learns from: the fixed evaluation negatives (``neg_<split>.npy``,
added later by ``sven data negatives``) and the per-event labels (``label.npy``, which
node classification predicts on top of an encoder trained without them; an encoder is
the same for a copy of its store with other labels).
Whether the columns still hold the bytes ``meta.json`` lists is the checksums' job
(``data.verify``, ``sven data verify``), not the fingerprint's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = ["fingerprint", "identity_of", "identity_problem", "store_identity"]

# Columns whose checksums are no part of the identity (see the module docstring).
_NOT_CONTENT = ("neg_", "label")
# meta.json keys of the identity besides the checksums.
_KEYS = ("num_events", "num_nodes", "bipartite", "num_src_nodes", "t_dtype")


def fingerprint(meta: dict[str, Any]) -> str:
    """The fingerprint of a store from its ``meta.json``: 16 hex digits.

    Args:
        meta: The store's parsed ``meta.json`` (``checksums`` and the counts).

    Returns:
        The first 16 hex digits of a sha256 over the identity's keys and the checksums
        of the event columns (the evaluation negatives and the labels excluded).
    """
    sums = meta.get("checksums") or {}
    content = {
        "checksums": {
            col: sums[col] for col in sorted(sums) if not str(col).startswith(_NOT_CONTENT)
        },
        **{key: meta.get(key) for key in _KEYS},
        "split": (meta.get("split") or {}).get("counts"),
    }
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def store_identity(events: Any) -> dict[str, Any]:
    """What a run, a checkpoint or a partition records of the store it was made from.

    Args:
        events: An opened store (:class:`~sven.datasets.store.TemporalEvents`).

    Returns:
        ``fingerprint``, ``name``, ``path`` (absolute), ``num_events``, ``num_nodes``,
        ``edge_feat_dim`` and ``node_feat_dim`` (what a model's input widths depend on).
    """
    return identity_of(events.meta, events.path)


def identity_of(meta: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """:func:`store_identity` from a store's ``meta.json`` and folder alone (no column
    opened): for a check before any work."""
    return {
        "fingerprint": fingerprint(meta),
        "name": meta.get("name"),
        "path": str(Path(path).absolute()),
        "num_events": int(meta.get("num_events", 0)),
        "num_nodes": int(meta.get("num_nodes", 0)),
        "edge_feat_dim": int(meta.get("edge_feat_dim") or 0),
        "node_feat_dim": int(meta.get("node_feat_dim") or 0),
    }


def _describe(ident: dict[str, Any]) -> str:
    """``PATH (E events, fingerprint F)``."""
    n = ident.get("num_events")
    counts = f"{n:,} events" if isinstance(n, int) else "? events"
    where = ident.get("path") or ident.get("name") or "?"
    return f"{where} ({counts}, fingerprint {ident.get('fingerprint')})"


def identity_problem(
    recorded: dict[str, Any] | None,
    current: dict[str, Any],
    made: str,
    *,
    verb: str = "was made from",
    allow_other: bool = False,
    flag: str = "",
) -> tuple[str | None, str | None]:
    """Compares the store something was made from with the store it is used with.

    Args:
        recorded: The :func:`store_identity` that ``made`` recorded; None or one without
            a fingerprint (made before Sven recorded one) passes: the caller's older
            checks (counts, partition) are all there is.
        current: The identity of the store given now.
        made: What was made from the store, for the message ("runs/x/best/step-3").
        verb: How it relates to its store ("was trained on", "was built for").
        allow_other: Another store is a real use here (a model applied to new data):
            accepted when the model's input widths fit it, with a note.
        flag: The option that allows another store, named in the refusal ("" where
            none does).

    Returns:
        ``(problem, note)``: a one-line refusal naming both stores, or None; and where
        another store is allowed and given, the line that says so, or None.
    """
    if not recorded or not recorded.get("fingerprint"):
        return None, None
    if recorded["fingerprint"] == current["fingerprint"]:
        return None, None
    both = f"{made} {verb} another dataset: {_describe(recorded)}, not {_describe(current)}"
    if not allow_other:
        hint = f", or pass {flag} to apply it to this store on purpose" if flag else ""
        return (
            f"{both} (that store changed since, or this is another one); give the store "
            f"it {verb}{hint}",
            None,
        )
    for key, what in (("edge_feat_dim", "edge"), ("node_feat_dim", "node")):
        a, b = recorded.get(key), current.get(key)
        if a is not None and b is not None and a != b:
            return (
                f"{both}, whose {what} features are {b}-dimensional where the model "
                f"takes {a}: a model applies only to a store of the same feature widths",
                None,
            )
    note = (
        f"{made} {verb} {_describe(recorded)}; applied to another store, "
        f"{_describe(current)}, as {f'{flag} asks' if flag else 'asked'}"
    )
    return None, note
