"""Output files of a command: whole or absent, never over an input, never over a file
of the user's without ``--overwrite``.

Every command that writes a file the user names (``sven predict``/``sven embed``
``--out``, ``sven plot``'s PNGs) goes through this module:

- :func:`check_output`, before any work: an existing file is refused unless
  ``--overwrite``; a file the command reads (``--pairs``, ``@FILE`` ids) or a path inside
  a folder it reads (the event store, the checkpoint) is refused even with it, and so
  is one inside any folder Sven owns (a store, a partition, a checkpoint, a run's
  ``best/`` or ``checkpoints/``: :func:`sven.ownership.sven_folder`); a folder where a
  file is expected, or a missing parent folder, is one line.
- :func:`check_output_folder`, the same for a folder of outputs (``sven plot --out``):
  a file there that Sven did not write is refused unless ``--overwrite``. What Sven
  wrote into a folder is recorded in the folder's manifest, ``.sven-outputs.json``
  (:func:`record_outputs`: each file's sha256), so that re-plotting replaces Sven's
  own figures and an overwrite of the run or partition holding them removes only those
  (:func:`foreign_outputs`).
- :func:`atomic_output`: the file is written under a hidden temporary name beside its
  place and renamed into place at the end, so a failure (or Ctrl-C) leaves no
  half-written output and the old file, if any, stays as it was; without
  ``overwrite``, the rename cannot replace a file that appeared meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from sven.digest import sha256_file
from sven.errors import ConfigError, DataError, SvenError
from sven.ownership import sven_folder

__all__ = [
    "LEGACY_FIGURES",
    "MANIFEST",
    "atomic_output",
    "check_output",
    "check_output_folder",
    "foreign_outputs",
    "record_outputs",
]

#: The manifest of a folder of outputs: ``{"files": {name: sha256}}``.
MANIFEST = ".sven-outputs.json"
#: The figures ``sven plot`` wrote into a run's or a partition's ``plots/`` before it
#: kept a manifest there: Sven's in such a folder without one.
LEGACY_FIGURES = ("training.png", "comm_per_rank.png", "stage_times.png", "partition.png")
# atomic_output's temporaries: ".NAME.tmp-<pid>".
_TEMP = re.compile(r"\..+\.tmp-\d+")

PathLike = str | os.PathLike[str]


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (symlinks resolved)."""
    a, b = path.resolve(), folder.resolve()
    return a == b or b in a.parents


def check_output(
    path: PathLike,
    *,
    overwrite: bool,
    inputs: Iterable[PathLike] = (),
    suffixes: tuple[str, ...] = (),
    option: str = "--out",
) -> Path:
    """Checks, before any work, that a command may write its output file at ``path``.

    Args:
        path: The output file.
        overwrite: Whether an existing file may be replaced (``--overwrite``).
        inputs: What the command reads: files (never written over) and folders (no
            output inside them: a store or a checkpoint holds only Sven's files).
        suffixes: The allowed name endings, e.g. ``(".csv", ".parquet")``; empty: any.
        option: The option naming the output, for the messages.

    Returns:
        ``path`` as a Path.

    Raises:
        ConfigError: A name with another suffix.
        DataError: The folder it goes into does not exist.
        SvenError: ``path`` is an input, lies inside an input folder, is a folder, or
            exists and ``overwrite`` is False.
    """
    p = Path(path)
    if suffixes and p.suffix not in suffixes:
        raise ConfigError(f"{option} {p}: the name must end in {', '.join(suffixes)}")
    for item in inputs:
        src = Path(item)
        if not src.exists():
            continue
        if src.is_dir() and _inside(p, src):
            raise SvenError(
                f"{option} {p} lies inside {src}, which this command reads; choose another {option}"
            )
        if p.exists() and not src.is_dir() and os.path.samefile(p, src):
            raise SvenError(
                f"{option} {p} is {src}, which this command reads; choose another {option}"
            )
    if p.is_dir():
        raise SvenError(f"{option} {p} is a folder; give a file name")
    owner = sven_folder(p.parent)
    if owner is not None:
        # Sven's own folders hold only what Sven writes there: a file of the user's
        # would stop their next overwrite, or pass for one of Sven's.
        raise SvenError(
            f"{option} {p} lies inside {owner}, which holds only Sven's files; choose "
            f"another {option}"
        )
    if not p.parent.is_dir():
        raise DataError("the output folder does not exist", p.parent)
    if (p.exists() or p.is_symlink()) and not overwrite:
        raise SvenError(f"{option} {p} already exists; pass --overwrite to replace it")
    return p


@contextlib.contextmanager
def atomic_output(path: PathLike, *, overwrite: bool = True) -> Iterator[Path]:
    """Yields a temporary path beside ``path``; renames it into place when the block ends.

    On an exception (Ctrl-C included) the temporary file is removed and ``path`` is
    left as it was. Write through the yielded path with an explicit format where the
    writer guesses one from the suffix (the temporary name ends in ``.tmp-<pid>``).

    Args:
        path: The final file.
        overwrite: Replace a file at ``path``; False: a file that appeared there since
            the check (:func:`check_output`) is refused, not replaced.

    Raises:
        SvenError: ``overwrite`` is False and ``path`` exists by the time of the rename.
    """
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if overwrite:
            os.replace(tmp, p)
        else:
            try:
                # A hard link never replaces an existing name: no window between a
                # check and the rename.
                os.link(tmp, p)
            except FileExistsError:
                raise SvenError(f"{p} appeared meanwhile; nothing was written over it") from None
            except OSError:
                if p.exists():
                    raise SvenError(
                        f"{p} appeared meanwhile; nothing was written over it"
                    ) from None
                os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)


def _manifest(folder: Path) -> dict[str, str]:
    """``name -> sha256`` of what Sven wrote into ``folder`` (empty without a manifest)."""
    try:
        files = json.loads((folder / MANIFEST).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def _ours(folder: Path, name: str, manifest: dict[str, str] | None) -> bool:
    """Whether ``folder/name`` is a file Sven wrote and nobody changed since; with no
    manifest (None: a folder of an older Sven), whether it is a legacy figure."""
    p = folder / name
    if p.is_symlink() or not p.is_file():
        return False
    if manifest is None:
        return name in LEGACY_FIGURES
    if name not in manifest:
        return False
    try:
        return sha256_file(p) == manifest[name]
    except OSError:
        return False


def _manifest_or_legacy(folder: Path, legacy: bool) -> dict[str, str] | None:
    """The folder's manifest; None where it has none and ``legacy`` allows the old names."""
    if legacy and not (folder / MANIFEST).exists():
        return None
    return _manifest(folder)


def check_output_folder(
    folder: PathLike,
    names: Iterable[str],
    *,
    overwrite: bool,
    option: str = "--out",
    legacy: bool = False,
) -> Path:
    """Checks, before any work, that files ``names`` may be written into ``folder``.

    A missing folder is fine (its parents are created when writing). An existing file
    of one of the ``names`` is replaced only where Sven wrote it (the folder's
    manifest says so, with the same content) or with ``overwrite``.

    Args:
        folder: The folder of outputs.
        names: The files the command will write there.
        overwrite: Replace files that Sven did not write.
        option: The option naming the folder, for the messages.
        legacy: The folder is one of Sven's (a run's or a partition's ``plots``): where
            it has no manifest (an older Sven's), :data:`LEGACY_FIGURES` are Sven's.

    Raises:
        SvenError: ``folder`` is a file, or holds one of ``names`` that Sven did not
            write and ``overwrite`` is False (the message names them).
    """
    f = Path(folder)
    if f.exists() and not f.is_dir():
        raise SvenError(f"{option} {f} is a file, not a folder; give a folder for the figures")
    if not f.is_dir():
        return f
    manifest = _manifest_or_legacy(f, legacy)
    theirs = [
        n for n in names if ((f / n).exists() or (f / n).is_symlink()) and not _ours(f, n, manifest)
    ]
    if theirs and not overwrite:
        shown = ", ".join(theirs)
        raise SvenError(
            f"{f} already holds {shown}, not written by Sven; pass --overwrite to replace "
            f"{'it' if len(theirs) == 1 else 'them'}, or choose another {option}"
        )
    return f


def record_outputs(folder: PathLike, paths: Iterable[PathLike]) -> None:
    """Adds files Sven just wrote into ``folder`` to its manifest (with their sha256)."""
    f = Path(folder)
    manifest = _manifest(f)
    for path in paths:
        p = Path(path)
        manifest[p.name] = sha256_file(p)
    with atomic_output(f / MANIFEST) as tmp:
        tmp.write_text(json.dumps({"files": manifest}, indent=2, sort_keys=True) + "\n")


def foreign_outputs(folder: PathLike, *, legacy: bool = False) -> list[str]:
    """The names in a folder of outputs that Sven did not write (or that changed since).

    Sven's are its manifest, the files it lists with their recorded content, and the
    temporaries of :func:`atomic_output`; everything else (a folder too) is foreign.
    With ``legacy`` (a folder Sven owns) and no manifest, :data:`LEGACY_FIGURES` are
    Sven's.
    """
    f = Path(folder)
    manifest = _manifest_or_legacy(f, legacy)
    return sorted(
        p.name
        for p in f.iterdir()
        if p.name != MANIFEST and not _TEMP.fullmatch(p.name) and not _ours(f, p.name, manifest)
    )
