"""Where a store may be written: the checks of ``--out`` and ``--overwrite``.

A store is written into a missing or empty folder, or replaces an existing event store
when asked to (:func:`check_target`), never an ordinary folder, a store beside which
the user keeps files of their own, or a folder that holds the command's input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sven.errors import SvenError
from sven.ownership import foreign_files, refuse_foreign

__all__ = ["check_target", "describe_replaced", "is_store", "store_manifest"]


def is_store(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder with a ``meta.json`` written by the store writer."""
    meta = _read_json_object(Path(path) / "meta.json")
    return meta is not None and "num_events" in meta and "checksums" in meta and "split" in meta


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None where it is missing or not an object."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (symlinks resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def store_manifest(meta: dict[str, Any]) -> set[str]:
    """The names a store's writers put in its folder: ``meta.json`` and the column
    files its checksums list."""
    sums = meta.get("checksums")
    return {"meta.json", *(f"{c}.npy" for c in (sums if isinstance(sums, dict) else ()))}


def _is_store_file(manifest: set[str], name: str) -> bool:
    # write_eval_negatives' temporaries (".neg_val.npy.<tag>", ".meta.json.<tag>"),
    # left where it was killed between its two renames.
    temp = name.startswith((".neg_", ".meta.json.")) and name.count(".") >= 3
    return name in manifest or temp


def check_target(
    out_dir: str | os.PathLike[str],
    overwrite: bool,
    inputs: tuple[str | os.PathLike[str], ...] = (),
) -> dict[str, Any] | None:
    """Checks that a store may be written at ``out_dir``; nothing is changed.

    A missing folder or an empty one may always be written. ``overwrite`` replaces
    only an event store (a folder whose ``meta.json`` is one of ours) that holds
    nothing but the store's own files (:func:`store_manifest`), never an ordinary
    folder or file, never a store beside which the user keeps files of their own,
    and never a folder that holds one of ``inputs``.

    Args:
        out_dir: The target directory.
        overwrite: Whether an existing store may be replaced.
        inputs: Paths the command reads (the raw input file).

    Returns:
        The ``meta.json`` of the store that will be replaced, or None.

    Raises:
        SvenError: If the target may not be written.
    """
    out = Path(out_dir)
    for item in inputs:
        if _inside(Path(item), out):
            raise SvenError(f"--out {out} holds the input {item}; choose another folder")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    if not overwrite:
        raise SvenError(f"{out} already exists; pass --overwrite to replace it")
    if not is_store(out):
        raise SvenError(
            f"{out} is not an event store (no meta.json of Sven's); --overwrite only "
            "replaces an event store: remove it yourself or choose another --out"
        )
    meta = _read_json_object(out / "meta.json") or {}
    manifest = store_manifest(meta)
    foreign = foreign_files(out, lambda name: _is_store_file(manifest, name))
    if foreign:
        raise SvenError(refuse_foreign(out, foreign, "--overwrite"))
    return meta


def describe_replaced(out_dir: str | os.PathLike[str], meta: dict[str, Any]) -> str:
    """The line a command prints after replacing the store ``meta`` at ``out_dir``."""
    return (
        f"replaced the event store {meta.get('name')!r} at {out_dir} "
        f"({meta.get('num_events', '?'):,} events)"
        if isinstance(meta.get("num_events"), int)
        else f"replaced the event store at {out_dir}"
    )
