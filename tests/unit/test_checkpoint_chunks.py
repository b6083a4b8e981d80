"""Chunk sums: a reader of a few rows of a checkpoint's node state checks only the chunks
it reads, and a corrupt byte is still refused wherever it is read; a resume checks
every byte; checkpoints without chunk sums (older ones) are checked whole.

The chunk is cut to 64 bytes here so that a node state of 200 rows spans many chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sven.engine.checkpoint import Checkpointer, find_checkpoint, load_node_state, verify_folder
from sven.engine.checkpoint import format as fmt
from sven.engine.checkpoint.load import NodeStateFiles
from sven.errors import SvenError

N = 200
C = 64  # bytes a chunk


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch) -> None:
    monkeypatch.setattr(fmt, "CHUNK", C)


def _state(n: int = N) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "memory": torch.randn(n, 4, generator=g),  # 16 bytes a row: 4 rows a chunk
        "last_update": torch.rand(n, generator=g, dtype=torch.float64),
        "mail_valid": torch.rand(n, 3, generator=g) > 0.5,
    }


def _empty(full: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros((n, *v.shape[1:]), dtype=v.dtype) for k, v in full.items()}


def _save(root: Path, step: int = 1, keep: int = 1) -> tuple[Checkpointer, Path]:
    ck = Checkpointer(root, keep_latest_k=keep)
    return ck, ck.save(step, {"x": step}, node_state=_state())


def _flip(path: Path, offset: int, mask: int = 0xFF) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def _row_offset(path: Path, row: int, row_bytes: int) -> int:
    return int(np.load(path, mmap_mode="r").offset) + row * row_bytes


def test_sums_files_are_the_digests_chunk_by_chunk(tmp_path) -> None:
    _, folder = _save(tmp_path / "ck")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["format"] == 2 and meta["chunk"] == C
    for k in _state():
        rel = f"nodes/rank0/{k}.npy"
        data = (folder / rel).read_bytes()
        sums = (folder / f"sums/rank0/{k}.sums").read_bytes()
        want = b"".join(hashlib.sha256(data[a : a + C]).digest() for a in range(0, len(data), C))
        assert sums == want and len(sums) == 32 * -(-len(data) // C)
        assert hashlib.sha256(sums).hexdigest() == meta["files"][rel]


def test_a_lazy_check_hashes_the_small_files_and_no_node_state(tmp_path, monkeypatch) -> None:
    _, folder = _save(tmp_path / "ck")
    hashed: list[str] = []
    real = fmt.file_sums

    def spy(paths, *a, **k):
        hashed.extend(str(p.relative_to(folder)) for p in paths)
        return real(paths, *a, **k)

    monkeypatch.setattr(fmt, "file_sums", spy)
    assert verify_folder(folder, lazy=True)
    assert sorted(hashed) == ["state.pt"]
    hashed.clear()
    assert verify_folder(folder)
    assert sorted(hashed) == ["nodes/rank0/last_update.npy", "nodes/rank0/mail_valid.npy",
                              "nodes/rank0/memory.npy", "state.pt"]  # fmt: skip


def test_rows_read_check_their_chunks_only_and_a_corrupt_one_is_refused(tmp_path) -> None:
    full = _state()
    _, folder = _save(tmp_path / "ck")
    mem = folder / "nodes/rank0/memory.npy"
    # A byte of row 150's memory flipped: the reader of rows 10 and 11 never sees it.
    _flip(mem, _row_offset(mem, 150, 16))
    assert find_checkpoint(folder, lazy=True) == folder
    files = NodeStateFiles(folder)
    got = load_node_state(folder, _empty(full, 2), torch.tensor([10, 11]), N, files=files)
    assert all(torch.equal(got[k], v[10:12]) for k, v in full.items())
    checker = files.checkers[0]["memory"]
    head = _row_offset(mem, 0, 16)
    # The header's two chunks, and the chunk rows 10 and 11 lie in; not the corrupt one.
    assert head == 2 * C
    want = {0, 1, (head + 10 * 16) // C, (head + 11 * 16 + 15) // C}
    assert len(want) == 3
    assert set(np.flatnonzero(checker.checked).tolist()) == want
    assert not checker.checked[(head + 150 * 16) // C]
    # Row 150 itself (or any row of its chunk): one line naming the file.
    with pytest.raises(SvenError) as err:
        load_node_state(folder, _empty(full, 1), torch.tensor([149]), N, files=files)
    assert str(err.value).startswith(f"{mem}: corrupt checkpoint: bytes ")
    assert "\n" not in str(err.value)
    # Reading the whole state at once meets it too.
    with pytest.raises(SvenError, match="corrupt checkpoint"):
        load_node_state(folder, _empty(full, N), torch.arange(N), N, files=NodeStateFiles(folder))
    # A full check (what a resume does) refuses the checkpoint outright.
    assert not verify_folder(folder)
    with pytest.raises(SvenError, match="corrupt or incomplete checkpoint"):
        find_checkpoint(folder)


def test_many_chunks_are_checked_in_parallel_the_same_way(tmp_path, monkeypatch) -> None:
    full = _state()
    _, folder = _save(tmp_path / "ck")
    monkeypatch.setattr(fmt, "_SERIAL", 2)  # more than 2 chunks: the threads' path
    monkeypatch.setattr(fmt, "WORK", 3 * C)  # runs of 3 chunks a task
    files = NodeStateFiles(folder)
    got = load_node_state(folder, _empty(full, N), torch.arange(N), N, files=files)
    assert all(torch.equal(got[k], v) for k, v in full.items())
    assert all(c.checked.all() for c in files.checkers[0].values())
    mask = folder / "nodes/rank0/mail_valid.npy"
    _flip(mask, os.path.getsize(mask) - 1)  # the last (short) chunk
    with pytest.raises(SvenError, match=r"mail_valid.npy: corrupt checkpoint"):
        load_node_state(folder, _empty(full, N), torch.arange(N), N, files=NodeStateFiles(folder))


def test_a_header_byte_is_checked_before_any_row(tmp_path) -> None:
    _, folder = _save(tmp_path / "ck")
    mem = folder / "nodes/rank0/memory.npy"
    head = _row_offset(mem, 0, 16)
    # A space of the header's padding made a tab (numpy reads the header the same),
    # in its second chunk: no row lies there.
    _flip(mem, head - 2, 0x20 ^ 0x09)
    assert (head - 2) // C == 1 and np.load(mem, mmap_mode="r").shape == (N, 4)
    with pytest.raises(SvenError, match=r"memory\.npy: corrupt checkpoint: bytes 64 to 128 "):
        NodeStateFiles(folder)


def test_a_resume_skips_a_checkpoint_corrupt_anywhere(tmp_path) -> None:
    ck, _ = _save(tmp_path / "ck", 1, keep=2)
    ck.save(2, {"x": 2}, node_state=_state())
    mem = ck.path(2) / "nodes/rank0/memory.npy"
    _flip(mem, _row_offset(mem, 199, 16))
    assert ck.latest(quiet=True) == 1
    assert ck.latest(quiet=True, lazy=True) == 2  # its reader refuses the chunk


def test_missing_or_stale_sums_mean_the_file_is_hashed_whole(tmp_path) -> None:
    full = _state()
    _, folder = _save(tmp_path / "ck")
    (folder / "sums/rank0/memory.sums").unlink()
    assert verify_folder(folder, lazy=True)
    files = NodeStateFiles(folder)
    assert sorted(files.checkers[0]) == ["last_update", "mail_valid"]
    got = load_node_state(folder, _empty(full, 3), torch.tensor([0, 5, 9]), N, files=files)
    assert torch.equal(got["memory"], full["memory"][[0, 5, 9]])
    # Without its sums, a corrupt byte anywhere in the file is found by the lazy check.
    _flip(
        folder / "nodes/rank0/memory.npy", _row_offset(folder / "nodes/rank0/memory.npy", 150, 16)
    )
    assert not verify_folder(folder, lazy=True)
    # A sums file that does not match the digest is not trusted either.
    _, other = _save(tmp_path / "ck2")
    _flip(other / "sums/rank0/last_update.sums", 0)
    assert verify_folder(other, lazy=True)
    assert "last_update" not in NodeStateFiles(other).checkers[0]


def test_a_checkpoint_without_chunk_sums_is_checked_whole(tmp_path) -> None:
    """A format 2 folder of an older Sven: 64 MiB chunks, no ``chunk`` in meta.json, no
    ``sums/``."""
    full = _state()
    _, folder = _save(tmp_path / "ck")
    meta = json.loads((folder / "meta.json").read_text())
    del meta["chunk"]
    for rel in meta["files"]:
        meta["files"][rel] = fmt.file_digest(folder / rel, chunk=fmt.LEGACY_CHUNK)
    shutil.rmtree(folder / "sums")
    (folder / "meta.json").write_text(json.dumps(meta))
    assert find_checkpoint(folder, lazy=True) == folder and verify_folder(folder)
    files = NodeStateFiles(folder)
    assert files.checkers == [{}]
    got = load_node_state(folder, _empty(full, N), torch.arange(N), N, files=files)
    assert all(torch.equal(got[k], v) for k, v in full.items())
    _flip(folder / "nodes/rank0/last_update.npy", 200)
    assert not verify_folder(folder, lazy=True)


def test_best_links_the_sums_with_the_node_state(tmp_path) -> None:
    root = tmp_path / "run"
    ck, folder = _save(root / "checkpoints")
    best = Checkpointer(root / "best")
    linked = best.save(1, {"x": 1}, link=ck.job(1))
    for k in _state():
        a, b = folder / f"sums/rank0/{k}.sums", linked / f"sums/rank0/{k}.sums"
        assert os.path.samefile(a, b)
    assert verify_folder(linked, lazy=True) and verify_folder(linked)
    assert sorted(NodeStateFiles(linked).checkers[0]) == sorted(_state())


def test_best_of_an_older_checkpoint_is_hashed_in_the_new_chunk(tmp_path, monkeypatch) -> None:
    root = tmp_path / "run"
    monkeypatch.setattr(fmt, "CHUNK", 4 * C)
    _, folder = _save(root / "checkpoints")
    monkeypatch.setattr(fmt, "CHUNK", C)
    linked = Checkpointer(root / "best").save(1, {"x": 1}, link=folder)
    meta = json.loads((linked / "meta.json").read_text())
    assert meta["chunk"] == C and verify_folder(linked)
    assert sorted(NodeStateFiles(linked).checkers[0]) == sorted(_state())
