"""Which process may write a folder, and which files in it are Sven's.

Three pieces, shared by every command that writes a run folder, an event store or a
partition:

- :func:`lock_folder`: an advisory lock (``fcntl.flock``) of a folder for one writer
  at a time. The lock file sits beside the folder, ``PARENT/.NAME.sven-lock`` (inside
  it, ``NAME/.sven-lock``, where the parent is not writable), so that it outlives the
  renames by which a store or a partition is replaced. It holds the holder's pid,
  host and command, which the refusal of a second writer names. The OS drops the lock
  when its process dies, however it dies; the file is removed on release.
- :func:`foreign_files` / :func:`foreign_paths`: what in a folder Sven did not write
  (its manifest is the names a writer produces, at the top or at every depth), so
  that an overwrite removes only Sven's files and refuses, naming the others, when
  there are any.
- :func:`make_partial` / :func:`sweep_partials`: the hidden ``.NAME.partial-*``
  folder a store or a partition is written into before its rename into place. It
  holds a marker file locked by its writer from birth, so that a later run into the
  same parent removes the partial folders of writers that died (SIGKILL, power loss)
  and never one whose writer is alive; :func:`stop_on_sigterm` turns SIGTERM into an
  exception, so that the writer's cleanup runs as on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from sven.errors import SvenError, Terminated

__all__ = [
    "FolderBusy",
    "FolderLock",
    "foreign_files",
    "foreign_paths",
    "json_keys",
    "lock_folder",
    "make_partial",
    "publish_partial",
    "stop_on_sigterm",
    "sven_folder",
    "sweep_partials",
]

LOCK_SUFFIX = ".sven-lock"
INNER_LOCK = ".sven-lock"
PARTIAL = ".partial-"
MARKER = ".sven-partial"

# A contended lock is tried again for this long before the folder counts as busy:
# a sweep (sweep_partials) holds a dead writer's lock file for an instant.
_RETRY_S = 0.3


class FolderBusy(SvenError):
    """Another live process holds the folder's lock (exit code 1)."""


def _abs(folder: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(folder))


def lock_path(folder: str | os.PathLike[str]) -> Path:
    """The lock file of ``folder``: ``PARENT/.NAME.sven-lock``."""
    f = _abs(folder)
    return f.parent / f".{f.name}{LOCK_SUFFIX}"


def _holder(fd: int) -> str:
    """Who holds a lock, from the lock file's content."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another Sven process"
    since = time.strftime("%H:%M:%S", time.localtime(float(info.get("since", 0))))
    return f"pid {info['pid']} on {info.get('host', '?')} ({info.get('command')}, since {since})"


# Locks this process holds, by lock file: flock is per open file, so a second flock of
# the same file by the same process would refuse its own holder.
_held: dict[Path, FolderLock] = {}
_mutex = threading.Lock()


class FolderLock:
    """This process's lock of one folder (see :func:`lock_folder`).

    Attributes:
        folder: The folder locked.
        path: The lock file.
    """

    def __init__(self, folder: Path, path: Path, fd: int) -> None:
        self.folder, self.path, self._fd = folder, path, fd
        self._count = 1

    def release(self) -> None:
        """Drops the lock and removes the lock file; a no-op once released."""
        with _mutex:
            if self._fd < 0:
                return
            self._count -= 1
            if self._count > 0:
                return
            _held.pop(self.path, None)
            # Removed while still held: a process that opened the file meanwhile sees
            # on locking that it is no longer the one at this path, and tries again.
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _open_lock_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        # Another user's lock file: flock needs no write access.
        return os.open(path, os.O_RDONLY)


def _try_lock(path: Path) -> tuple[int, bool]:
    """Opens ``path`` and tries to lock it: (fd, True) held, (fd, False) busy, or
    (-1, False) when the file was replaced meanwhile (try again)."""
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return fd, False
    try:
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # its holder removed it after we opened it
        os.close(fd)
        return -1, False
    return fd, True


def lock_folder(folder: str | os.PathLike[str], command: str) -> FolderLock:
    """Takes the writer's lock of ``folder`` (which need not exist yet).

    Reentrant within a process: a second call for a folder this process holds returns
    the same lock, released when both have released it.

    Args:
        folder: The run folder, store or partition to write.
        command: What this process is, for the refusal of another (``"sven train"``).

    Returns:
        The lock; release it (or use it as a context manager) when done.

    Raises:
        FolderBusy: A live process holds it; the message names its pid, host, command.
    """
    f = _abs(folder)
    path = lock_path(f)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(_open_lock_file(path))  # the parent may be read-only
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not f.is_dir():
            raise SvenError(f"cannot create {f}: {exc.strerror or exc}") from None
        path = f / INNER_LOCK
    with _mutex:
        mine = _held.get(path)
        if mine is not None:
            mine._count += 1
            return mine
    end = time.monotonic() + _RETRY_S
    while True:
        try:
            fd, held = _try_lock(path)
        except OSError as exc:
            raise SvenError(f"cannot create {f}: {exc.strerror or exc}") from None
        if held:
            break
        if fd >= 0:
            if time.monotonic() >= end:
                who = _holder(fd)
                os.close(fd)
                raise FolderBusy(
                    f"{f} is in use by {who}; wait for it to finish, or stop it, or "
                    "choose another folder"
                )
            os.close(fd)
            time.sleep(0.02)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command}
    info["since"] = time.time()
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    lock = FolderLock(f, path, fd)
    with _mutex:
        _held[path] = lock
    return lock


def foreign_files(folder: str | os.PathLike[str], ours: Callable[[str], bool]) -> list[str]:
    """The names in ``folder`` that Sven did not write, sorted.

    Args:
        folder: An existing folder.
        ours: Whether a top-level name is one that Sven's writer of this kind of
            folder produces (its manifest).
    """
    return sorted(
        p.name for p in Path(folder).iterdir() if p.name != INNER_LOCK and not ours(p.name)
    )


#: What Sven writes into a folder it owns, at every depth: a full-match regular
#: expression of a name -> None (a file), a nested manifest (a folder whose content is
#: checked in turn), or a function ``folder -> foreign names`` (a folder with a manifest
#: of its own, such as ``plots``: :func:`sven.outputs.foreign_outputs`).
Manifest = Mapping[str, "Manifest | Callable[[Path], list[str]] | None"]
_NO_MATCH = object()


def foreign_paths(folder: str | os.PathLike[str], manifest: Manifest) -> list[str]:
    """The paths under ``folder`` that Sven did not write, relative and sorted.

    Walks the folder as deep as ``manifest`` describes it; a name that matches no
    pattern is foreign (and a folder of the user's is named, not entered), as is a
    file where the manifest has a folder, a folder where it has a file, and a symbolic
    link anywhere below the top (Sven writes none). The folder lock (``.sven-lock``)
    is never foreign.

    Args:
        folder: An existing folder.
        manifest: What Sven writes there (:data:`Manifest`).
    """
    root = Path(folder)
    out: list[str] = []

    def walk(d: Path, rules: Manifest, prefix: str) -> None:
        for p in sorted(d.iterdir()):
            rel = prefix + p.name
            if p.name == INNER_LOCK:
                continue
            rule = next((r for pat, r in rules.items() if re.fullmatch(pat, p.name)), _NO_MATCH)
            if rule is _NO_MATCH or p.is_symlink():
                out.append(rel)
            elif rule is None:
                if not p.is_file():
                    out.append(rel)
            elif not p.is_dir():
                out.append(rel)
            elif callable(rule):
                out.extend(f"{rel}/{name}" for name in rule(p))
            else:
                walk(p, rule, rel + "/")

    walk(root, manifest, "")
    return sorted(out)


def refuse_foreign(folder: str | os.PathLike[str], names: list[str], what: str) -> str:
    """The message refusing an overwrite of ``folder`` that holds ``names`` of the user."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"{folder} holds {shown}, not written by Sven; {what} removes only Sven's own "
        "files: move them away or choose another folder"
    )


# ------------------------------------------------------------ Sven's folders


def json_keys(path: str | os.PathLike[str]) -> set[str]:
    """The top-level keys of the JSON object in ``path`` (empty: none, or not JSON)."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return set()
    return set(obj) if isinstance(obj, dict) else set()


#: What a run writes below its top (``sven.engine.run_folder.RUN_FILES`` less the
#: files, and less ``plots``, which keeps a manifest of outputs of its own).
_RUN_SUBFOLDERS = ("checkpoints", "best", "state", "tb", "traces", "logs", "encoder")


def sven_folder(path: str | os.PathLike[str]) -> str | None:
    """The folder Sven owns that ``path`` would lie in, described; None: none.

    Sven owns an event store, a partition, a checkpoint (``step-N``), the disk
    tier's node-state folder and a run's own sub-folders (``best/``,
    ``checkpoints/``, ...): a file of the user's there would stop the next overwrite
    of them, or be mistaken for one of Sven's. ``path`` itself and its ancestors
    are looked at (symbolic links resolved).
    """
    p = Path(os.path.abspath(path))
    for folder in [p, *p.parents]:
        folder = folder.resolve() if folder.exists() else folder
        meta = json_keys(folder / "meta.json")
        if {"num_events", "checksums", "split"} <= meta:
            return f"the event store {folder}"
        if {"parts", "format_version"} <= meta:
            return f"the partition {folder}"
        if (folder / "state.pt").is_file() and meta:
            return f"the checkpoint {folder}"
        if (folder / ".sven-state").is_file():
            return f"the node-state folder {folder}"
        if folder.name in _RUN_SUBFOLDERS and {"data", "model", "train", "out"} <= json_keys(
            folder.parent / "config.json"
        ):
            return f"{folder.name}/ of the run {folder.parent}"
    return None


# ------------------------------------------------------------ partial folders

_partials: dict[Path, int] = {}


def make_partial(target: str | os.PathLike[str]) -> Path:
    """Creates the hidden folder that ``target`` is written into, owned by this process.

    ``PARENT/.NAME.partial-<12 hex>``, holding a marker file that this process locks
    before the marker gets its name, so that a sweep never sees it unlocked while its
    writer lives. :func:`publish_partial` renames it into place; :func:`discard_partial`
    removes it.
    """
    t = _abs(target)
    tmp = t.parent / f".{t.name}{PARTIAL}{uuid.uuid4().hex[:12]}"
    # Known to this process before it exists: an exception raised at any line from here
    # on (SIGTERM's included, stop_on_sigterm) finds the folder and removes it.
    _partials[tmp] = -1
    try:
        tmp.mkdir()
    except FileExistsError:
        # Another's folder of the same name: never removed here.
        _partials.pop(tmp, None)
        raise
    except BaseException:
        discard_partial(tmp)
        raise
    try:
        new = tmp / f"{MARKER}.new"
        fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        _partials[tmp] = fd
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "target": str(t)}).encode(), 0)
        os.rename(new, tmp / MARKER)
    except BaseException:
        discard_partial(tmp)
        raise
    return tmp


def _forget_partial(tmp: Path) -> None:
    fd = _partials.pop(tmp, -1)
    if fd >= 0:
        os.close(fd)


def discard_partial(tmp: str | os.PathLike[str]) -> None:
    """Removes a partial folder of this process and drops its marker's lock."""
    tmp = Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    _forget_partial(tmp)


def publish_partial(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Renames a finished partial folder to ``final``, replacing what is there.

    An existing ``final`` (whose overwrite the caller has checked) is moved aside
    first, so that the new folder appears in one rename, and deleted once it has.
    """
    tmp, final = Path(tmp), Path(final)
    # The marker goes first, so the finished folder holds only what its writer wrote;
    # a sweep meanwhile sees no marker and leaves the folder alone.
    (tmp / MARKER).unlink(missing_ok=True)
    try:
        if final.exists() and (not final.is_dir() or any(final.iterdir())):
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(old, final)
                raise
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            # rename(2) replaces an empty directory atomically.
            os.rename(tmp, final)
    finally:
        _forget_partial(tmp)


def sweep_partials(parent: str | os.PathLike[str]) -> list[Path]:
    """Removes the partial folders under ``parent`` whose writers are dead.

    Only folders named ``.NAME.partial-*`` that hold Sven's marker file and whose
    marker no live process holds are removed; stale lock files (``.NAME.sven-lock``
    that nobody holds) go too.

    Returns:
        The folders removed.
    """
    p = Path(parent)
    removed: list[Path] = []
    try:
        entries = list(p.iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if name.startswith(".") and PARTIAL in name and entry not in _partials:
            if _dead(entry / MARKER, lambda e=entry: shutil.rmtree(e, ignore_errors=True)):
                removed.append(entry)
        elif name.startswith(".") and name.endswith(LOCK_SUFFIX) and entry.is_file():
            with _mutex:
                if entry in _held:
                    continue
            _dead(entry, lambda e=entry: e.unlink(missing_ok=True))
    return removed


def _dead(file: Path, remove: Callable[[], None]) -> bool:
    """Runs ``remove`` (holding ``file``'s lock) where no live process holds it."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        remove()
    finally:
        os.close(fd)
    return True


def report_swept(removed: Iterable[Path]) -> None:
    """One ``sven: warning:`` line per partial folder removed by a sweep."""
    for path in removed:
        print(f"sven: warning: removed {path}, left by an interrupted run", file=sys.stderr)


# ------------------------------------------------------------------ SIGTERM


@contextlib.contextmanager
def stop_on_sigterm(target: str | os.PathLike[str]) -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`~sven.errors.Terminated`.

    So a writer's cleanup (``except BaseException``, ``finally``) runs on SIGTERM as
    on Ctrl-C, and its partial output goes. Only the main thread can install a
    handler; elsewhere the block runs with the handlers as they are.

    Args:
        target: What the command writes, named in the message.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        # A second SIGTERM must not cut the cleanup that the first one started.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(
            f"stopped by SIGTERM; nothing was written at {target} (its partial output is removed)"
        )

    before = set(_partials)
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except BaseException:
        # The partial folders the block made and neither published nor removed: the
        # signal may have cut a line that no writer's cleanup covers (inside a
        # constructor after its folder was made, between a call and its ``try``).
        for tmp in [p for p in _partials if p not in before]:
            discard_partial(tmp)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)
