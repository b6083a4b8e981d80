"""sven.ownership: folder locks, manifests and partial folders, between real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sven.ownership import (
    FolderBusy,
    discard_partial,
    foreign_files,
    foreign_paths,
    lock_folder,
    lock_path,
    make_partial,
    publish_partial,
    stop_on_sigterm,
    sweep_partials,
)

# Holds a lock (or a partial folder) of argv[1], says so, and waits for stdin to close.
_HOLDER = """
import sys
from sven.ownership import lock_folder, make_partial
held = lock_folder(sys.argv[1], "the test's holder") if sys.argv[2] == "lock" else None
part = make_partial(sys.argv[1]) if sys.argv[2] == "partial" else None
print(part or "held", flush=True)
sys.stdin.read()
"""


def _hold(folder: Path, what: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder), what],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def test_a_second_process_is_refused_until_the_holder_dies(tmp_path) -> None:
    folder = tmp_path / "run"
    proc, _ = _hold(folder, "lock")
    try:
        with pytest.raises(FolderBusy) as err:
            lock_folder(folder, "sven train")
        assert f"{folder} is in use by pid {proc.pid}" in str(err.value)
        assert "(the test's holder, since" in str(err.value)
    finally:
        proc.kill()
        proc.wait()
    # Killed: its lock file is still there, but nobody holds it.
    assert lock_path(folder).is_file()
    with lock_folder(folder, "sven train") as lock:
        assert lock.path == tmp_path / ".run.sven-lock"
    assert not lock_path(folder).exists()


def test_the_lock_is_reentrant_within_a_process(tmp_path) -> None:
    outer = lock_folder(tmp_path / "s", "outer")
    inner = lock_folder(tmp_path / "s", "inner")
    assert inner is outer
    inner.release()
    assert lock_path(tmp_path / "s").is_file()  # still held by the outer user
    outer.release()
    assert not lock_path(tmp_path / "s").exists()
    outer.release()  # a second release is a no-op


def test_sweep_removes_only_dead_writers_partials(tmp_path) -> None:
    live, live_dir = _hold(tmp_path / "a", "partial")
    dead, dead_dir = _hold(tmp_path / "b", "partial")
    dead.kill()
    dead.wait()
    stale, _ = _hold(tmp_path / "c", "lock")
    stale.kill()
    stale.wait()
    # A user's folder that merely looks like one: no marker, never touched.
    lookalike = tmp_path / ".d.partial-mine"
    lookalike.mkdir()
    mine = make_partial(tmp_path / "e")
    try:
        assert sweep_partials(tmp_path) == [Path(dead_dir)]
        assert Path(live_dir).is_dir() and lookalike.is_dir() and mine.is_dir()
        assert not (tmp_path / ".c.sven-lock").exists()
    finally:
        live.stdin.close()
        live.wait()
        discard_partial(mine)
    # The live writer is gone now (exit without cleanup): its folder is swept too.
    assert sweep_partials(tmp_path) == [Path(live_dir)]


def test_publish_replaces_the_target_and_leaves_no_marker(tmp_path) -> None:
    target = tmp_path / "store"
    target.mkdir()
    (target / "old.npy").write_text("old")
    tmp = make_partial(target)
    (tmp / "new.npy").write_text("new")
    publish_partial(tmp, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    assert sorted(p.name for p in target.iterdir()) == ["new.npy"]


def test_foreign_files_are_those_outside_the_manifest(tmp_path) -> None:
    for name in ("meta.json", "src.npy", "notes.txt", ".sven-lock"):
        (tmp_path / name).write_text("")
    assert foreign_files(tmp_path, {"meta.json", "src.npy"}.__contains__) == ["notes.txt"]


def test_foreign_paths_walk_every_depth_the_manifest_describes(tmp_path) -> None:
    step = {r"state\.pt": None, r"memory-rank\d+\.pt": None}
    manifest = {
        r"config\.json": None,
        r"checkpoints": {r"step-\d+": step},
        r"plots": lambda folder: sorted(p.name for p in folder.iterdir() if p.suffix != ".png"),
    }
    for name in ("config.json", "checkpoints/step-1/state.pt", "checkpoints/step-1/memory-rank0.pt",
                 "plots/training.png", ".sven-lock"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert foreign_paths(tmp_path, manifest) == []
    (tmp_path / "checkpoints" / "step-1" / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints" / "mine").mkdir()
    (tmp_path / "checkpoints" / "mine" / "deep.txt").write_text("mine")
    (tmp_path / "plots" / "paper.pdf").write_text("mine")
    # A file where the manifest has a folder, a folder where it has a file, a link.
    (tmp_path / "checkpoints" / "step-2").write_text("")
    (tmp_path / "checkpoints" / "step-1" / "memory-rank1.pt").mkdir()
    (tmp_path / "checkpoints" / "step-3").symlink_to(tmp_path / "checkpoints" / "step-1")
    assert foreign_paths(tmp_path, manifest) == [
        "checkpoints/mine",
        "checkpoints/step-1/memory-rank1.pt",
        "checkpoints/step-1/notes.txt",
        "checkpoints/step-2",
        "checkpoints/step-3",
        "plots/paper.pdf",
    ]


def test_sigterm_after_a_partial_is_made_removes_it_whatever_line_it_cut(tmp_path) -> None:
    # The signal lands after the folder exists but before any writer's cleanup block
    # holds it (a constructor's later lines, the gap before a ``try``): the block's own
    # exit removes it.
    import signal

    from sven.errors import Terminated

    with pytest.raises(Terminated):
        with stop_on_sigterm(tmp_path / "a"):
            make_partial(tmp_path / "a")
            # Delivered to this thread, its handler run before the call returns.
            signal.raise_signal(signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []
    # A partial made before the block is not the block's to remove.
    kept = make_partial(tmp_path / "b")
    with pytest.raises(Terminated):
        with stop_on_sigterm(tmp_path / "c"):
            signal.raise_signal(signal.SIGTERM)
    assert list(tmp_path.iterdir()) == [kept]
    discard_partial(kept)


def test_a_partial_interrupted_while_being_made_is_removed(tmp_path, monkeypatch) -> None:
    import fcntl

    def cut(fd: int, op: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fcntl, "flock", cut)
    with pytest.raises(KeyboardInterrupt):
        make_partial(tmp_path / "a")
    assert list(tmp_path.iterdir()) == []
