"""The partition directory: writer, loader and checks.

Layout of a partition of an event store into P ranks (format version 1)::

    PART_DIR/
      meta.json            see below
      owner.npy            (N,) int32: owner rank of every vertex, in [0, P)
      assign.npy           (E,) int16 (int32 if P > 32767): rank of every event
      events_rank{r}.npy   (E_r,) int64: sorted global indices of the events with
                           assign == r, one file per rank r = 0..P-1

Every event of the store (train, val and test) is assigned, to the owner of its
source or of its destination; the cost report covers the training epoch.

``meta.json`` keys: ``format_version`` (1), ``strategy``, ``parts``, ``num_nodes``,
``num_events``, ``num_train_events``, ``batch_size``, ``k`` and ``num_neg`` (the
settings the cost model used), ``balance``, ``seed``, ``store`` (the event store's
``path``, ``name`` and its ``checksums`` of ``src``/``dst``/``t``, so that a partition
is never used with other data), ``checksums`` (``{file name: sha256}`` of every
``.npy`` above), ``timings`` (seconds per phase), ``sven_version``, ``report`` (the
cost report's summary, see ``CostReport.summary``) and ``per_rank`` (its per-rank
arrays, ``CostReport.to_dict()["per_rank"]``, which ``sven plot PART`` draws).

The directory is written next to its final place under a temporary name
(``.NAME.partial-*``, see :mod:`sven.ownership`) and renamed into place, so a reader
sees either nothing or a complete partition; one writer at a time holds its lock.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sven.digest import sha256_file
from sven.errors import DataError
from sven.ownership import (
    discard_partial,
    foreign_paths,
    lock_folder,
    make_partial,
    publish_partial,
    refuse_foreign,
)

__all__ = [
    "FORMAT_VERSION",
    "Partition",
    "check_matches",
    "check_target",
    "is_partition",
    "load_partition",
    "write_partition",
]

FORMAT_VERSION = 1


@dataclass
class Partition:
    """An owner map and an event assignment, with their metadata.

    Attributes:
        owner: (N,) int32 owner rank per vertex.
        assign: (E,) int16/int32 rank per event.
        meta: The contents of ``meta.json`` (empty before writing).
        events: Rank -> (E_r,) int64 sorted event indices; only the loaded ranks.
    """

    owner: np.ndarray
    assign: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    events: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def parts(self) -> int:
        """P."""
        if "parts" in self.meta:
            return int(self.meta["parts"])
        return int(self.owner.max()) + 1 if self.owner.size else 1


def _assign_dtype(parts: int) -> type[np.signedinteger]:
    """int16 for up to 32767 ranks, else int32."""
    return np.int16 if parts <= np.iinfo(np.int16).max else np.int32


def is_partition(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder whose ``meta.json`` is a partition's."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "parts" in meta and "format_version" in meta


def _manifest(part_dir: Path) -> dict[str, Any]:
    """What Sven writes into a partition folder, at every depth
    (:data:`sven.ownership.Manifest`): ``meta.json``, the files its checksums list, and
    ``sven plot``'s figures in ``plots`` (that folder's own manifest says which)."""
    from sven.outputs import foreign_outputs

    try:
        sums = json.loads((part_dir / "meta.json").read_text()).get("checksums")
    except (OSError, ValueError, AttributeError):
        sums = None
    names = ["meta.json", *(sums if isinstance(sums, dict) else ())]
    plots = functools.partial(foreign_outputs, legacy=True)
    return {**{re.escape(str(n)): None for n in names}, "plots": plots}


def check_target(
    out_dir: str | os.PathLike[str],
    overwrite: bool,
    inputs: tuple[str | os.PathLike[str], ...] = (),
) -> None:
    """Checks that a partition may be written at ``out_dir``; changes nothing.

    A missing or empty folder may be written if its parent can be; ``overwrite``
    replaces only a partition folder holding nothing but a partition's own files
    (``meta.json``, the ``.npy`` files its checksums list, the figures ``sven plot``
    wrote into ``plots``), never another folder or one holding ``inputs``.

    Raises:
        DataError: If the target may not be written.
    """
    out = Path(out_dir)
    for item in inputs:
        a, b = Path(item).resolve(), out.resolve()
        if a == b or b in a.parents:
            raise DataError(f"holds the input {item}; choose another --out", out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not overwrite:
            raise DataError("already exists (pass --overwrite to replace it)", out)
        if not is_partition(out):
            raise DataError(
                "not a partition folder (no meta.json of Sven's); --overwrite only replaces "
                "a partition: remove it yourself or choose another --out",
                out,
            )
        foreign = foreign_paths(out, _manifest(out))
        if foreign:
            raise DataError(refuse_foreign(out, foreign, "--overwrite"))
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise DataError(f"cannot create it: {parent} is not a writable folder", out)


def write_partition(
    out_dir: str | os.PathLike[str],
    owner: np.ndarray,
    assign: np.ndarray,
    meta: dict[str, Any],
    *,
    overwrite: bool = False,
) -> Partition:
    """Writes a partition directory atomically (see the module docstring for the layout).

    Args:
        out_dir: Target directory; its parent is created if needed.
        owner: (N,) owner per vertex, in [0, P).
        assign: (E,) rank per event, in [0, P).
        meta: At least ``parts``; ``format_version``, counts and ``checksums`` are
            filled in here.
        overwrite: Replace an existing partition directory (never another folder);
            otherwise an existing one is an error.

    Returns:
        The written partition (events of every rank loaded).

    Raises:
        DataError: If the target exists and ``overwrite`` is False, or the arrays are
            out of range.
    """
    out = Path(out_dir)
    parts = int(meta["parts"])
    owner = np.asarray(owner)
    assign = np.asarray(assign)
    if owner.size and (owner.min() < 0 or owner.max() >= parts):
        raise DataError(f"owner values outside [0, {parts})", out)
    if assign.size and (assign.min() < 0 or assign.max() >= parts):
        raise DataError(f"assign values outside [0, {parts})", out)
    with lock_folder(out, "writing a partition"):
        check_target(out, overwrite)
        out.parent.mkdir(parents=True, exist_ok=True)
        return _write(out, owner, assign, meta, parts, overwrite)


def _write(
    out: Path,
    owner: np.ndarray,
    assign: np.ndarray,
    meta: dict[str, Any],
    parts: int,
    overwrite: bool,
) -> Partition:
    tmp = make_partial(out)
    try:
        files = {
            "owner.npy": owner.astype(np.int32),
            "assign.npy": assign.astype(_assign_dtype(parts)),
        }
        # One stable sort by rank yields every rank's events in increasing order.
        order = np.argsort(files["assign.npy"], kind="stable")
        bounds = np.searchsorted(files["assign.npy"][order], np.arange(parts + 1))
        # argsort yields int64 indices: each rank's slice is its sorted event list.
        events = {r: order[bounds[r] : bounds[r + 1]] for r in range(parts)}
        for r, idx in events.items():
            files[f"events_rank{r}.npy"] = idx
        checksums = {}
        for name, arr in files.items():
            np.save(tmp / name, arr)
            checksums[name] = sha256_file(tmp / name)
        full = {
            "format_version": FORMAT_VERSION,
            **meta,
            "num_nodes": int(owner.shape[0]),
            "num_events": int(assign.shape[0]),
            "checksums": checksums,
        }
        with open(tmp / "meta.json", "w") as f:
            json.dump(full, f, indent=2, sort_keys=True)
            f.write("\n")
        # Checked again: the user may have put a file into the old one meanwhile.
        check_target(out, overwrite)
        publish_partial(tmp, out)
    except BaseException:
        discard_partial(tmp)
        raise
    return Partition(files["owner.npy"], files["assign.npy"], full, events)


def load_partition(
    part_dir: str | os.PathLike[str],
    rank: int | None = None,
    *,
    verify: bool = False,
    mmap: bool = True,
) -> Partition:
    """Loads a partition directory.

    Args:
        part_dir: The directory written by ``write_partition``.
        rank: Load this rank's event list only; None loads every rank's.
        verify: Check the sha256 of every file read against ``meta.json``.
        mmap: Memory-map ``owner.npy`` and ``assign.npy`` instead of reading them.

    Returns:
        The partition; ``events`` holds the requested ranks.

    Raises:
        DataError: On a missing or malformed directory, a version or checksum
            mismatch, or a rank out of range.
    """
    d = Path(part_dir)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        raise DataError("not a partition directory (no meta.json)", d)
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"meta.json is not valid JSON: {exc}", meta_path) from exc
    if not isinstance(meta, dict) or "parts" not in meta:
        if isinstance(meta, dict) and "num_events" in meta and "split" in meta:
            raise DataError(
                "an event store, not a partition (give the folder that `sven partition "
                "--out` wrote)",
                d,
            )
        raise DataError("not a partition directory (its meta.json has no parts)", d)
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}", meta_path
        )
    for key in ("parts", "num_nodes", "num_events"):
        if not isinstance(meta.get(key), int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise DataError(f"corrupt meta.json: {key} is {meta.get(key)!r}", meta_path)
    if not isinstance(meta.get("checksums"), dict):
        raise DataError("corrupt meta.json: no checksums", meta_path)
    parts = int(meta["parts"])
    if rank is not None and not 0 <= rank < parts:
        raise DataError(f"rank {rank} outside [0, {parts})", d)
    ranks = range(parts) if rank is None else [rank]
    names = ["owner.npy", "assign.npy", *(f"events_rank{r}.npy" for r in ranks)]
    for name in names:
        path = d / name
        if not path.is_file():
            raise DataError(f"missing {name}", d)
        if verify and sha256_file(path) != meta["checksums"].get(name):
            raise DataError(f"checksum mismatch for {name}", d)
    mode = "r" if mmap else None
    owner = np.load(d / "owner.npy", mmap_mode=mode)
    assign = np.load(d / "assign.npy", mmap_mode=mode)
    if owner.shape != (meta["num_nodes"],) or assign.shape != (meta["num_events"],):
        raise DataError("owner.npy or assign.npy does not match meta.json's counts", d)
    events = {r: np.load(d / f"events_rank{r}.npy", mmap_mode=mode) for r in ranks}
    return Partition(owner, assign, meta, events)


def check_matches(part: Partition, events: Any, part_dir: str | os.PathLike[str]) -> None:
    """Refuses a partition built for other data than ``events`` (an opened store).

    Compares the counts and the ``src``/``dst``/``t`` checksums the partition recorded
    (``meta["store"]``) with the store's, then its fingerprint where the partition
    recorded one (:mod:`sven.datasets.identity`); with the store verified
    (:func:`sven.datasets.store.open_verified_store`) those are its bytes.

    Raises:
        DataError: The partition was built for another store.
    """
    from sven.datasets.identity import identity_problem, store_identity

    recorded = part.meta.get("store") or {}
    current = {"num_events": int(events.num_events), "num_nodes": int(events.num_nodes)}
    for key, value in current.items():
        if recorded.get(key) is not None and recorded[key] != value:
            raise DataError(
                f"partition was built for a store with {key}={recorded[key]}, this one has {value}",
                part_dir,
            )
    sums = events.meta.get("checksums", {})
    for col, digest in (recorded.get("checksums") or {}).items():
        if sums.get(col) not in (None, digest):
            raise DataError(f"partition was built for other data ({col} differs)", part_dir)
    # The whole store's identity, where the partition recorded it (features and splits
    # too: one identity for everything made from a store).
    problem, _ = identity_problem(
        recorded, store_identity(events), "the partition",
        verb="was built for",
    )  # fmt: skip
    if problem is not None:
        raise DataError(problem, part_dir)
