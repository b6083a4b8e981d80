"""Checkpoint format 2 on tiny hand-built node states: exact round trips of every field
dtype on one and two ranks, reads into another number of ranks, digests, links, the
background commit, and failed writes that leave nothing behind.

Two ranks are two threads here, each with its own :class:`Checkpointer` on one folder
and a thread barrier: the ranks of a run share nothing but the folder and the barrier.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from sven.engine.checkpoint import (
    Checkpointer,
    RunCheckpoints,
    Snapshot,
    file_digest,
    find_checkpoint,
    load_node_state,
    read_state,
    verify_folder,
)
from sven.engine.checkpoint import format as fmt
from sven.engine.checkpoint import load as ckload
from sven.errors import CheckpointError, SvenError

N = 11


def _state(n: int, seed: int) -> dict[str, torch.Tensor]:
    """A node state of ``n`` rows with every dtype and rank MemoryState has."""
    g = torch.Generator().manual_seed(seed)
    return {
        "memory": torch.randn(n, 3, generator=g),
        "last_update": torch.rand(n, generator=g, dtype=torch.float64) * 1e9,
        "mail": torch.randn(n, 2, 4, generator=g),
        "mail_ts": torch.rand(n, 2, generator=g, dtype=torch.float64),
        "mail_valid": torch.rand(n, 2, generator=g) > 0.5,
    }


def _empty_like(full: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros((n, *v.shape[1:]), dtype=v.dtype) for k, v in full.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The owner map of N = 11 vertices on two ranks: not a range, not balanced.
OWNER = torch.tensor([1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1])


def _save_two_ranks(
    root: Path, full: dict[str, torch.Tensor], step: int = 5, owner: torch.Tensor = OWNER, **kw
) -> Path:
    """Each rank (a thread) writes the rows of the vertices it owns, in shard order."""
    barrier = threading.Barrier(2)
    errors: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        ck = Checkpointer(root, asynchronous=kw.get("asynchronous", False))
        rows = torch.nonzero(owner == r).flatten()
        node = kw.get("node_state", {}).get(r) or {k: v[rows] for k, v in full.items()}
        state = {"data": {"num_nodes": N}, "step": step}
        try:
            ck.save(
                step,
                state,
                {f"rank{r}": {"rank": r}},
                node_state=node,
                owner=owner if r == 0 else None,
                rank=r,
                world_size=2,
                barrier=lambda what: barrier.wait(timeout=60),
            )
            ck.wait()
        except BaseException as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[min(errors)]
    return Checkpointer(root).path(step)


def test_one_rank_round_trips_every_field_dtype_exactly(tmp_path) -> None:
    full = _state(N, 0)
    ck = Checkpointer(tmp_path / "ck")
    folder = ck.save(3, {"x": 1}, node_state=full)
    meta = ck.meta(3)
    assert meta["format"] == 2 and meta["world_size"] == 1
    assert meta["node_state"]["num_nodes"] == N and meta["node_state"]["rows"] == [N]
    assert meta["node_state"]["fields"]["mail"] == {"dtype": "float32", "row_shape": [2, 4]}
    assert meta["node_state"]["fields"]["mail_valid"]["dtype"] == "bool"
    # Plain .npy files that numpy reads without pickle.
    for k, v in full.items():
        a = np.load(folder / "nodes" / "rank0" / f"{k}.npy", mmap_mode="r", allow_pickle=False)
        assert torch.equal(torch.from_numpy(np.array(a)), v), k
    got = load_node_state(folder, _empty_like(full, N), torch.arange(N), num_nodes=N)
    assert _same(got, full)
    # Any subset, in any order.
    rows = torch.tensor([7, 0, 10, 3])
    sub = load_node_state(folder, _empty_like(full, 4), rows)
    assert _same(sub, {k: v[rows] for k, v in full.items()})
    assert verify_folder(folder)


def test_two_ranks_write_one_process_reads_each_vertex_row(tmp_path) -> None:
    full = _state(N, 1)
    folder = _save_two_ranks(tmp_path / "ck", full)
    meta = Checkpointer(tmp_path / "ck").meta(5)
    assert meta["node_state"]["rows"] == [4, 7]
    assert np.load(folder / "owner.npy").dtype == np.int8
    assert sorted(meta["files"]) == sorted(
        ["state.pt", "rank0.pt", "rank1.pt", "owner.npy"]
        + [f"nodes/rank{r}/{k}.npy" for r in (0, 1) for k in full]
    )
    # One process: every vertex, assembled from both shards.
    got = load_node_state(folder, _empty_like(full, N), torch.arange(N), num_nodes=N)
    assert _same(got, full)
    # Three "ranks" of another partition: each reads the vertices it owns now.
    new_owner = torch.arange(N) % 3
    for r in range(3):
        rows = torch.nonzero(new_owner == r).flatten()
        part = load_node_state(folder, _empty_like(full, rows.numel()), rows)
        assert _same(part, {k: v[rows] for k, v in full.items()}), r
    # The owner map is back in the data identity, as format 1 kept it.
    assert torch.equal(read_state(folder)["data"]["owner"], OWNER)


def test_reading_in_windows_and_pieces_is_the_same(tmp_path, monkeypatch) -> None:
    """Windows of 3 vertices and copies of one row at a time: what a 10^8-vertex read
    does at its scale, cut small enough to cross every boundary here."""
    full = _state(N, 2)
    folder = _save_two_ranks(tmp_path / "ck", full)
    monkeypatch.setattr(ckload, "_WINDOW", 3)
    monkeypatch.setattr(ckload, "_COPY_BYTES", 1)
    rows = torch.tensor([10, 2, 3, 9, 0, 5, 6])
    got = load_node_state(folder, _empty_like(full, rows.numel()), rows)
    assert _same(got, {k: v[rows] for k, v in full.items()})


def test_a_shard_of_no_rows_and_a_wrong_request(tmp_path) -> None:
    full = _state(N, 3)
    empty = {k: v[:0] for k, v in full.items()}
    # Rank 0 owns no vertex: its files hold no rows.
    ones = torch.ones(N, dtype=torch.int64)
    folder = _save_two_ranks(tmp_path / "ck", full, owner=ones, node_state={0: empty, 1: full})
    got = load_node_state(folder, _empty_like(full, N), torch.arange(N))
    assert _same(got, full)
    with pytest.raises(SvenError, match="holds the node state of 11 vertices; this run"):
        load_node_state(folder, _empty_like(full, N), torch.arange(N), num_nodes=12)
    wrong = _empty_like(full, N)
    wrong["memory"] = torch.zeros(N, 5)
    with pytest.raises(SvenError, match=r"field memory has rows of shape \(3,\)"):
        load_node_state(folder, wrong, torch.arange(N))


def test_digest_is_the_sha256_of_chunk_digests(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(fmt, "CHUNK", 100)  # bytes: a 11x3 float32 file has 3 chunks
    full = _state(N, 4)
    ck = Checkpointer(tmp_path / "ck")
    folder = ck.save(1, {"x": 2}, node_state=full)
    meta = ck.meta(1)
    for rel, digest in meta["files"].items():
        data = (folder / rel).read_bytes()
        chunks = [hashlib.sha256(data[a : a + 100]).digest() for a in range(0, len(data), 100)]
        assert digest == hashlib.sha256(b"".join(chunks)).hexdigest(), rel
        assert file_digest(folder / rel) == digest
    assert (folder / "nodes/rank0/memory.npy").stat().st_size > 200
    # One flipped byte in a node-state file: the checkpoint no longer verifies, and the
    # older one is used (with a warning line).
    ck2 = Checkpointer(tmp_path / "ck", keep_latest_k=3)
    ck2.save(2, {"x": 3}, node_state=full)
    f = ck2.path(2) / "nodes/rank0/mail.npy"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    assert not ck2.verify(2)
    assert ck2.latest(quiet=True) == 1
    with pytest.raises(SvenError, match="corrupt or incomplete checkpoint"):
        find_checkpoint(ck2.path(2))


def test_best_links_the_latest_files_and_outlives_its_pruning(tmp_path) -> None:
    cfg = _Cfg()
    run = RunCheckpoints(tmp_path / "run", 1, config=cfg, asynchronous=True)
    full = _state(N, 5)
    data = {"num_nodes": N}
    run.save(run.latest, 10, Snapshot({"data": data}, node_state=full, owner=torch.zeros(N)))
    run.save(run.best, 0, Snapshot({"data": data}, owner=torch.zeros(N)), link_latest=10)
    assert run.finish() == []
    latest, best = run.latest.path(10), run.best.path(0)
    for k in full:
        rel = f"nodes/rank0/{k}.npy"
        assert (latest / rel).stat().st_ino == (best / rel).stat().st_ino
        assert (best / rel).stat().st_nlink == 2
    assert run.best.meta(0)["node_state"] == run.latest.meta(10)["node_state"]
    # One process, one rank owning all: no owner.npy; read_state gives it back.
    assert not (latest / "owner.npy").exists()
    assert torch.equal(read_state(best)["data"]["owner"], torch.zeros(N, dtype=torch.int64))
    # The next latest checkpoint prunes step 10; best's files live on (one link each).
    run.save(run.latest, 11, Snapshot({"x": 0}, node_state=_state(N, 6)))
    run.finish()
    assert run.latest.steps() == [11]
    assert verify_folder(best) and (best / "nodes/rank0/memory.npy").stat().st_nlink == 1
    got = load_node_state(best, _empty_like(full, N), torch.arange(N))
    assert _same(got, full)


class _Cfg:
    """What RunCheckpoints needs of a config."""

    def to_dict(self) -> dict:
        return {"train": {"lr": 0.1}}


def test_the_commit_runs_in_the_background_and_keeps_the_snapshot(tmp_path) -> None:
    """The caller goes on (and changes the state) while the commit is held back; the
    checkpoint appears once it is released, holding the state as it was at save()."""
    ck = Checkpointer(tmp_path / "ck", asynchronous=True)
    held, go = threading.Event(), threading.Event()

    def hold(folder: Path) -> None:
        held.set()
        assert go.wait(timeout=60)

    ck.before_commit = hold
    live = _state(N, 7)
    snap = {k: v.clone() for k, v in live.items()}
    ck.save(4, {"step": 4}, node_state=live)
    assert held.wait(timeout=60)
    # The caller runs on: the state changes, and the checkpoint is not there yet.
    for v in live.values():
        v.zero_() if v.dtype != torch.bool else v.fill_(True)
    assert ck.steps() == [] and (tmp_path / "ck" / ".tmp-step-000000004").is_dir()
    go.set()
    ck.wait()
    assert ck.steps() == [4] and ck.verify(4)
    got = load_node_state(ck.path(4), _empty_like(snap, N), torch.arange(N))
    assert _same(got, snap)


def _no_partial(root: Path) -> None:
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp")]


def test_a_write_that_fails_midway_leaves_nothing_and_says_one_line(tmp_path, monkeypatch) -> None:
    ck = Checkpointer(tmp_path / "ck", asynchronous=True)
    ck.save(1, {"x": 1}, node_state=_state(N, 8))
    ck.wait()
    real = os.pwrite

    def full_disk(fd: int, data, offset: int) -> int:
        if offset > 0 and len(memoryview(data)) == N * 2 * 4 * 4:  # mail's rows
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    ck.save(2, {"x": 2}, node_state=_state(N, 9))
    with pytest.raises(CheckpointError) as info:
        ck.wait()
    msg = str(info.value)
    assert "\n" not in msg
    assert msg == (
        f"checkpoint {ck.path(2)} (step 2) was not written: No space left on device "
        f"(ENOSPC) writing nodes/rank0/mail.npy; the newest intact checkpoint is {ck.path(1)}"
    )
    assert info.value.exit_code == 5 and info.value.step == 2
    assert ck.steps() == [1] and ck.verify(1)
    _no_partial(ck.root)
    ck.wait()  # said once


def test_one_rank_failing_removes_every_ranks_part(tmp_path) -> None:
    full = _state(N, 10)
    rows1 = torch.nonzero(OWNER == 1).flatten()
    bad = {k: v[rows1] for k, v in full.items()}
    bad["memory"] = bad["memory"].to(torch.bfloat16)  # numpy has no bfloat16
    with pytest.raises(CheckpointError) as info:
        _save_two_ranks(tmp_path / "ck", full, node_state={1: bad})
    msg = str(info.value)
    assert "(step 5) was not written: rank 1: TypeError: node state of dtype torch.bfloat16" in msg
    assert msg.endswith(f"there is no older checkpoint under {tmp_path / 'ck'}")
    assert Checkpointer(tmp_path / "ck").steps() == []
    _no_partial(tmp_path / "ck")


def test_a_crashed_writers_temporary_folder_is_swept(tmp_path) -> None:
    root = tmp_path / "ck"
    (root / ".tmp-step-000000007" / "nodes" / "rank0").mkdir(parents=True)
    (root / ".tmp-step-000000007" / "state.pt").write_bytes(b"half")
    ck = Checkpointer(root)
    ck.save(8, {"x": 1})
    assert ck.steps() == [8]
    _no_partial(root)
    assert json.loads((ck.path(8) / "meta.json").read_text())["node_state"] is None


def test_a_checkpoint_that_cannot_fit_fails_before_filling_the_disk(tmp_path, monkeypatch) -> None:
    ck = Checkpointer(tmp_path / "ck")
    real = os.statvfs

    def nearly_full(path):
        st = real(path)
        # 17 MB free: less than the 16 MB margin plus the state's bytes.
        return os.statvfs_result((*st[:4], (17 << 20) // st.f_frsize, *st[5:]))

    monkeypatch.setattr(os, "statvfs", nearly_full)
    big = {"memory": torch.zeros(1 << 18, 4)}  # 4 MiB
    with pytest.raises(CheckpointError, match=r"No space left on device: 4\.2 MB to write, "):
        ck.save(1, {"x": 1}, node_state=big)
    assert ck.steps() == []
    _no_partial(ck.root)
    # What fits, is written.
    ck.save(2, {"x": 1}, node_state={"memory": torch.zeros(8, 4)})
    assert ck.steps() == [2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("snapshot", [True, False])
def test_a_cuda_state_is_written_as_it_was_at_save(tmp_path, monkeypatch, snapshot) -> None:
    """From a device snapshot (in the background) or through the pinned buffers (now):
    the rows as they were when save() returned, whatever the step does afterwards."""
    from sven.engine.checkpoint import files

    monkeypatch.setattr(files, "_BOUNCE", 1000)  # many pieces per chunk
    monkeypatch.setattr(fmt, "CHUNK", 4096)
    full = {k: v.cuda() for k, v in _state(5000, 11).items()}
    want = {k: v.cpu().clone() for k, v in full.items()}
    ck = Checkpointer(tmp_path / "ck", asynchronous=True)
    ck.save(1, {"x": 1}, node_state=full, device_snapshot=snapshot)
    for v in full.values():  # the next step, queued behind the snapshot
        v.zero_() if v.dtype != torch.bool else v.fill_(True)
    ck.wait()
    assert ck.verify(1)
    dest = _empty_like(want, 5000)
    dest = {k: v.cuda() for k, v in dest.items()}
    load_node_state(ck.path(1), dest, torch.arange(5000, device="cuda"))
    assert _same({k: v.cpu() for k, v in dest.items()}, want)
