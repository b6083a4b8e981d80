"""Step-numbered, atomic, checksummed checkpoints, written by one rank or many, in the
background while training goes on.

Layout (format 2) under a root folder (``<out>/checkpoints`` or ``<out>/best``)::

    step-000000420/
        meta.json       {"format": 2, "step": 420, "world_size": P, "chunk": 65536,
                         "files": {relative path: digest},
                         "node_state": {"fields": {name: {"dtype": "float32",
                                                          "row_shape": [100]}},
                                        "num_nodes": N, "rows": [N_0, ..., N_{P-1}]},
                         "created": unix time}
        state.pt        rank 0: the small state (data identity without the owner map,
                        model, optimizer, evaluator, cursor, progress, config)
        rank0.pt        each rank's small state (exchange counters, RNG, rank, world size)
        rank1.pt
        owner.npy       (N,) owning rank of each vertex, in the smallest integer dtype
                        that holds P (absent when one rank owns every vertex)
        nodes/rank0/memory.npy, last_update.npy, mail.npy, mail_ts.npy, mail_valid.npy
                        rank r's rows of each node-state field, (N_r, *row_shape), in
                        shard order: the vertices with owner == r by ascending id
        sums/rank0/memory.sums, ...
                        each node-state file's chunk sums (its digest, chunk by chunk)
        nodes/rank1/...

``node_state`` is null in a checkpoint without node state (a node classifier's). The
``.pt`` files are read with ``torch.load(weights_only=True)`` and the ``.npy`` files with
``np.load(mmap_mode="r", allow_pickle=False)``: a checkpoint holds only tensors, arrays
and plain values, so loading one never runs code from it, whoever wrote it. The digests
are sha256 of ``chunk``-byte chunks (:mod:`~sven.engine.checkpoint.format`; 64 MiB in
folders that record no ``chunk``, which keep no ``sums/``). ``best/``'s
``nodes/``, ``sums/`` and ``owner.npy`` are hard links of the files of the latest checkpoint taken
at the same point (the node state is on disk once); a file system that refuses links
gets copies, with one warning.

Format 1 (Sven 0.1) had one ``memory-rank{r}.pt`` per rank (``{"memory": {field:
tensor}, "exchange", "rng", "rank", "world_size"}``), the owner map inside ``state.pt``,
plain sha256 digests and no ``format`` key; it is still read
(:mod:`~sven.engine.checkpoint.load`), never written.

How a checkpoint is written (:meth:`Checkpointer.save`, called by every rank):

1. Snapshot, the only part the caller waits for: the small states are serialised to
   bytes; the node-state tensors are either copied on their device (CUDA, when the
   caller says there is room: ``device_snapshot``) or written now into their ``.npy``
   files by a pool of threads, each ``os.pwrite``-ing 64 MiB pieces at their offsets
   and hashing what it writes (CUDA sources go through a small pinned buffer per
   thread): never a second full copy in host memory, nothing read back to be hashed.
2. Commit, in a background thread (``asynchronous``) or before ``save`` returns: the
   remaining writes, an fsync of each file, then ``done-rank{r}.json`` with the rank's
   digests. Rank 0's thread waits for every rank's (files on the shared folder: no
   collective from a thread), writes ``meta.json``, renames ``.tmp-step-N`` to
   ``step-N`` and prunes old steps. :meth:`Checkpointer.wait` joins it; the next save
   waits for it first, so one commit is in flight at a time.

A write that fails (disk full, a quota, a file-size limit) removes the temporary folder,
every rank's part of it, and :meth:`Checkpointer.wait` raises a
:class:`~sven.errors.CheckpointError` whose one line names the missing checkpoint, the
OS error and the newest intact one. ``.tmp-*`` folders left by a killed process are
removed by the next save.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sven.engine.capture import CUDA_SIDE_WORK
from sven.engine.checkpoint import format as fmt
from sven.engine.checkpoint.files import (
    Npy,
    WriterPool,
    check_room,
    create_npy,
    narrow_owner,
    sync_and_drop,
    write_file,
    write_npys,
)
from sven.engine.checkpoint.format import (
    FORMAT,
    NODE_DIR,
    OWNER,
    PREFIX,
    SUMS_DIR,
    combine,
    file_sums,
    fsync_dir,
    keeps_sums,
    load_file,
    numpy_dtype,
    read_meta,
    serialise,
    sums_rel,
    verify_folder,
    warn,
)
from sven.errors import CheckpointError

# The file system refused a hard link once already (the warning is said once a process).
_warned_copy: list[Path] = []


def why(exc: BaseException) -> str:
    """An error as a short clause: ``File too large (EFBIG) writing nodes/rank0/mail.npy``."""
    if isinstance(exc, _RankFailed):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        text = f"{exc.strerror or os.strerror(exc.errno)} ({name})"
        if exc.filename:
            text += f" writing {exc.filename}"
        return text
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class _RankFailed(Exception):
    """Another rank's part (or the checkpoint linked to) is missing; the reason is
    the message."""


@dataclass(eq=False)
class _Job:
    """One checkpoint on its way to disk, on one rank."""

    step: int
    final: Path
    tmp: Path
    rank: int
    world_size: int
    blobs: dict[str, bytes] = field(default_factory=dict)
    npy: list[Npy] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    node_meta: dict[str, Any] | None = None
    link: _Job | Path | None = None
    ready: Any = None  # CUDA event after which the node-state sources are final
    error: BaseException | None = None
    message: str = ""
    meta: dict[str, Any] | None = None
    thread: threading.Thread | None = None
    reported: bool = False
    timed_out: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    #: When save() began and when the commit ended (perf_counter seconds).
    started: float = 0.0
    finished: float = 0.0


class Checkpointer:
    """Saves and restores training state under one root folder (the format above).

    Args:
        root: Folder holding the ``step-N`` checkpoints.
        keep_latest_k: Number of checkpoints kept; older ones are deleted after a save.
        asynchronous: Commit in a background thread (:meth:`wait` joins it); otherwise
            :meth:`save` returns once the checkpoint is on disk.
        threads: Writer threads (0: one per core, up to 8), unless ``pool`` is given.
        timeout_s: How long rank 0 waits for the other ranks' parts of a checkpoint.
        pool: Writer threads shared with another checkpointer.

    Attributes:
        before_commit: Called with the checkpoint's folder by the commit thread before
            it writes anything (tracing; tests hold a commit back with it).
    """

    def __init__(
        self,
        root: str | Path,
        keep_latest_k: int = 2,
        *,
        asynchronous: bool = False,
        threads: int = 0,
        timeout_s: float = 600.0,
        pool: WriterPool | None = None,
    ) -> None:
        self.root = Path(root)
        self.keep_latest_k = keep_latest_k
        self.asynchronous = asynchronous
        self.timeout_s = timeout_s
        self.pool = pool or WriterPool(threads)
        self.before_commit: Callable[[Path], None] | None = None
        self._job: _Job | None = None
        self._cancel = threading.Event()

    def steps(self) -> list[int]:
        """Steps of the checkpoint folders on disk, ascending."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith(PREFIX):
                try:
                    out.append(int(p.name[len(PREFIX) :]))
                except ValueError:
                    continue
        return sorted(out)

    def path(self, step: int) -> Path:
        """Folder of the checkpoint at ``step``."""
        return self.root / f"{PREFIX}{step:09d}"

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        state: dict[str, Any] | None,
        files: dict[str, Any] | None = None,
        *,
        node_state: dict[str, torch.Tensor] | None = None,
        owner: torch.Tensor | None = None,
        link: _Job | Path | None = None,
        device_snapshot: bool = False,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[str], None] | None = None,
    ) -> Path:
        """Writes a checkpoint atomically; every rank calls it.

        Waits for the commit in flight first (and raises its error, if it failed,
        before starting this one).

        Args:
            step: Global step number (monotone over the run).
            state: Rank 0's ``state.pt`` content (ignored on other ranks).
            files: This rank's further ``name -> object`` files (saved as ``name.pt``).
            node_state: This rank's node state, ``field -> (N_r, ...)`` tensors on any
                device, written as ``nodes/rank{r}/{field}.npy``; None: none.
            owner: (N,) owning rank of each vertex (rank 0), written as ``owner.npy``.
            link: The checkpoint (a :meth:`job` of another checkpointer, or a folder)
                whose ``nodes/`` and ``owner.npy`` this one hard-links once that one is
                committed, instead of ``node_state`` and ``owner``.
            device_snapshot: Copy CUDA node state on its device and write it in the
                background (the caller has checked that there is room).
            rank: This rank.
            world_size: Number of ranks writing.
            barrier: Synchronises the ranks (required when ``world_size > 1``).

        Returns:
            The checkpoint folder (there once committed).

        Raises:
            CheckpointError: The previous commit failed, or (not ``asynchronous``) this
                one did; nothing of the failed one is left on disk.
        """
        if world_size > 1 and barrier is None:
            raise ValueError("a multi-rank checkpoint needs a barrier")
        self.wait()
        final = self.path(step)
        job = _Job(step, final, self.root / f".tmp-{final.name}", rank, world_size)
        job.started = time.perf_counter()
        if rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._sweep()
                job.tmp.mkdir()
                (job.tmp / NODE_DIR).mkdir()
            except OSError as exc:
                job.error = exc
        if barrier is not None:
            barrier(f"checkpoint {step}: folder")
        if job.error is None:
            try:
                self._snapshot(job, state, files, node_state, owner, link, device_snapshot)
            except Exception as exc:  # OSError above all; the commit reports it
                job.error = exc
        self._job = job
        self._cancel.clear()
        if self.asynchronous:
            job.thread = threading.Thread(
                target=self._commit, args=(job,), name=f"sven-commit-{final.name}"
            )
            job.thread.start()
        else:
            self._commit(job)
            self.wait()
        return final

    def job(self, step: int) -> _Job | Path:
        """What :meth:`save`'s ``link`` takes for checkpoint ``step``: the commit in
        flight (or just done) of that step, else its folder."""
        job = self._job
        return job if job is not None and job.step == step else self.path(step)

    def _snapshot(
        self,
        job: _Job,
        state: dict[str, Any] | None,
        files: dict[str, Any] | None,
        node_state: dict[str, torch.Tensor] | None,
        owner: torch.Tensor | None,
        link: _Job | Path | None,
        device_snapshot: bool,
    ) -> None:
        r = job.rank
        if r == 0:
            job.blobs["state.pt"] = serialise(state)
        for name, obj in (files or {}).items():
            job.blobs[f"{name}.pt"] = serialise(obj)
        job.link = link
        arrays: dict[str, torch.Tensor] = {}
        if node_state and link is None:
            os.mkdir(job.tmp / NODE_DIR / f"rank{r}")
            job.node_meta = {
                "fields": {
                    k: {"dtype": str(numpy_dtype(v.dtype)), "row_shape": list(v.shape[1:])}
                    for k, v in node_state.items()
                },
                "rows": int(next(iter(node_state.values())).shape[0]),
            }
            arrays.update({f"{NODE_DIR}/rank{r}/{k}.npy": v for k, v in node_state.items()})
        if r == 0 and owner is not None and link is None:
            arrays[OWNER] = narrow_owner(owner, job.world_size)
        need = sum(len(b) for b in job.blobs.values())
        check_room(job.tmp, need + sum(t.numel() * t.element_size() for t in arrays.values()))
        for rel, t in arrays.items():
            f = create_npy(job.tmp, rel, t)
            job.npy.append(f)
            if f.src.is_cuda and device_snapshot:
                # The copy is queued on the training stream: later steps cannot change
                # it, and the step does not wait for it.
                f.src, f.deferred = f.src.clone(), True
        cuda = [f.src.device for f in job.npy if f.src.is_cuda]
        if cuda:
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(cuda[0]))
        now = [f for f in job.npy if not f.deferred]
        job.digests.update(write_npys(self.pool, now, job.ready))

    # ---------------------------------------------------------------- commit
    def _commit(self, job: _Job) -> None:
        try:
            if job.error is not None:
                raise job.error
            if self.before_commit is not None:
                self.before_commit(job.final)
            mine = dict(job.digests)
            for rel, data in job.blobs.items():
                mine[rel] = write_file(job.tmp / rel, data)
            job.blobs.clear()
            later = [f for f in job.npy if f.deferred]
            mine.update(write_npys(self.pool, later, job.ready))
            self.pool.map(sync_and_drop, job.npy)
            part = {"files": mine, "node_state": job.node_meta}
            if job.rank != 0:
                self._done_file(job, part)
                return
            parts = {0: part, **self._await_ranks(job, fail_fast=True)}
            self._finish(job, parts)
        except BaseException as exc:
            job.error = exc
            self._clean_failed(job)
        finally:
            for f in job.npy:
                try:
                    os.close(f.fd)
                except OSError:
                    pass
            # The device snapshot's memory goes back now, and the event with it: not
            # while the run captures a graph (CUDA calls of this thread would spoil it).
            with CUDA_SIDE_WORK:
                job.npy.clear()
                job.ready = None
            job.blobs.clear()
            job.finished = time.perf_counter()
            job.done.set()

    def _done_file(self, job: _Job, part: dict[str, Any]) -> None:
        """A rank's report to rank 0: its files' digests (renamed into place whole)."""
        tmp = job.tmp / f"done-rank{job.rank}.json.part"
        write_file(tmp, json.dumps(part).encode())
        os.replace(tmp, job.tmp / f"done-rank{job.rank}.json")

    def _await_ranks(self, job: _Job, fail_fast: bool) -> dict[int, dict[str, Any]]:
        """The other ranks' reports, as they appear in the temporary folder.

        Raises:
            OSError: A rank reported a failure (its reason; ``fail_fast``), or did not
                report within ``timeout_s``.
        """
        parts: dict[int, dict[str, Any]] = {}
        waiting = set(range(1, job.world_size))
        failed: list[str] = []
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        while waiting:
            for r in sorted(waiting):
                bad = job.tmp / f"failed-rank{r}"
                done = job.tmp / f"done-rank{r}.json"
                if bad.exists():
                    try:
                        reason = bad.read_text().strip()
                    except OSError:
                        reason = ""
                    failed.append(f"rank {r}: {reason or 'its write failed (see its log)'}")
                    waiting.discard(r)
                elif done.exists():
                    parts[r] = json.loads(done.read_text())
                    waiting.discard(r)
            if failed and fail_fast:
                raise _RankFailed(failed[0])
            if not waiting:
                break
            if not job.tmp.is_dir():
                # Never made (rank 0 could not create it): nothing more can come.
                raise _RankFailed("the temporary folder is gone")
            if self._cancel.is_set():
                raise _RankFailed("the run ended before every rank had written its part")
            if time.monotonic() > deadline:
                job.timed_out = True
                raise _RankFailed(
                    f"rank {min(waiting)} did not write its part within {self.timeout_s:.0f} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        if failed:
            raise _RankFailed(failed[0])
        return parts

    def _finish(self, job: _Job, parts: dict[int, dict[str, Any]]) -> None:
        """Rank 0: links, ``meta.json``, the rename, pruning."""
        files: dict[str, str] = {}
        for r in sorted(parts):
            files.update(parts[r]["files"])
        nodes = [parts[r]["node_state"] for r in range(job.world_size)]
        node_state = None
        if any(n is not None for n in nodes):
            fields = next(n for n in nodes if n is not None)["fields"]
            rows = [0 if n is None else int(n["rows"]) for n in nodes]
            node_state = {"fields": fields, "num_nodes": sum(rows), "rows": rows}
        if job.link is not None:
            linked, node_state = self._link(job)
            files.update(linked)
        meta = {
            "format": FORMAT,
            "step": job.step,
            "world_size": job.world_size,
            "chunk": fmt.CHUNK,
            "files": files,
            "node_state": node_state,
            "created": time.time(),
        }
        for r in range(1, job.world_size):
            (job.tmp / f"done-rank{r}.json").unlink()
        write_file(job.tmp / "meta.json", json.dumps(meta, indent=2).encode())
        fsync_dir(job.tmp)
        if job.final.exists():
            shutil.rmtree(job.final)
        os.replace(job.tmp, job.final)
        fsync_dir(self.root)
        job.meta = meta
        self._prune()

    def _link(self, job: _Job) -> tuple[dict[str, str], dict[str, Any] | None]:
        """Hard-links the node state of ``job.link`` into ``job.tmp`` once committed."""
        src = job.link
        if isinstance(src, _Job):
            src.done.wait()
            if src.error is not None or src.meta is None:
                raise _RankFailed(f"its node state was to come from {src.final}, not written")
            folder, meta = src.final, src.meta
        else:
            folder, meta = Path(src), read_meta(src)
        out = {}
        # A folder of another digest chunk (an older Sven's) is hashed again in this one's.
        same = meta.get("format", 1) >= 2 and meta.get("chunk") == fmt.CHUNK
        for rel, digest in meta["files"].items():
            if not (rel == OWNER or rel.startswith(f"{NODE_DIR}/")):
                continue
            (job.tmp / rel).parent.mkdir(exist_ok=True)
            self._link_file(folder / rel, job.tmp / rel)
            if same:
                if keeps_sums(meta, rel):
                    (job.tmp / sums_rel(rel)).parent.mkdir(parents=True, exist_ok=True)
                    self._link_file(folder / sums_rel(rel), job.tmp / sums_rel(rel))
                out[rel] = digest
                continue
            sums = file_sums([job.tmp / rel], self.pool.threads)[0]
            if rel.startswith(f"{NODE_DIR}/"):
                (job.tmp / sums_rel(rel)).parent.mkdir(parents=True, exist_ok=True)
                write_file(job.tmp / sums_rel(rel), b"".join(sums))
            out[rel] = combine(sums)
        return out, meta.get("node_state")

    def _link_file(self, src: Path, dst: Path) -> None:
        """Hard-links ``src`` as ``dst``, or copies it where the file system refuses."""
        try:
            os.link(src, dst)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            if not _warned_copy:
                _warned_copy.append(self.root)
                warn(
                    f"{self.root}: the file system refuses hard links ({why(exc)}); "
                    "the best model's node state is copied, not linked"
                )
            shutil.copyfile(src, dst)

    def _clean_failed(self, job: _Job) -> None:
        """Removes every trace of a failed checkpoint and words its error."""
        exc = job.error
        assert exc is not None
        if job.rank == 0:
            if not job.timed_out:
                try:
                    # The other ranks may still be writing into the folder: it goes once
                    # each has finished (or given up), so that nothing is left behind.
                    self._await_ranks(job, fail_fast=False)
                except Exception:
                    pass
            shutil.rmtree(job.tmp, ignore_errors=True)
        else:
            for part in (NODE_DIR, SUMS_DIR):
                shutil.rmtree(job.tmp / part / f"rank{job.rank}", ignore_errors=True)
            for f in job.tmp.glob(f"rank{job.rank}.pt"):
                f.unlink(missing_ok=True)
            self._failed_file(job, why(exc))
        steps = [s for s in self.steps() if s != job.step]
        older = (
            f"the newest intact checkpoint is {self.path(steps[-1])}"
            if steps
            else f"there is no older checkpoint under {self.root}"
        )
        job.message = (
            f"checkpoint {job.final} (step {job.step}) was not written: {why(exc)}; {older}"
        )

    @staticmethod
    def _failed_file(job: _Job, reason: str) -> None:
        """Tells rank 0 that this rank's part failed (the reason where there is room)."""
        bad = job.tmp / f"failed-rank{job.rank}"
        part = job.tmp / f"failed-rank{job.rank}.part"
        try:
            part.write_text(reason)
            os.replace(part, bad)
        except OSError:
            try:
                part.unlink(missing_ok=True)
                os.close(os.open(bad, os.O_WRONLY | os.O_CREAT, 0o644))
            except OSError:
                pass  # the folder is gone: rank 0 has given up on it already

    def wait(self) -> None:
        """Waits for the commit in flight.

        Raises:
            CheckpointError: It failed (raised once; its files are removed).
        """
        job = self._job
        if job is None:
            return
        if job.thread is not None:
            job.thread.join()
        if job.error is not None and not job.reported:
            job.reported = True
            raise CheckpointError(job.message, checkpoint=job.final, step=job.step) from (
                job.error if isinstance(job.error, Exception) else None
            )

    def close(self, grace_s: float = 2.0) -> None:
        """Ends the commit in flight without raising (the run is ending on an error):
        after ``grace_s``, rank 0 stops waiting for ranks that may never come and
        removes the unfinished checkpoint; the older ones are intact."""
        job = self._job
        if job is not None and job.thread is not None:
            job.thread.join(timeout=grace_s)
            self._cancel.set()
            job.thread.join()

    def _sweep(self) -> None:
        """Removes temporary folders of checkpoints that never committed."""
        for p in self.root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep_latest_k]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    # ------------------------------------------------------------------ read
    def meta(self, step: int) -> dict[str, Any]:
        """The ``meta.json`` of a checkpoint."""
        return read_meta(self.path(step))

    def verify(self, step: int, lazy: bool = False) -> bool:
        """Whether the checkpoint at ``step`` is complete and matches its checksums
        (``lazy``: :func:`~sven.engine.checkpoint.format.verify_folder`'s)."""
        return verify_folder(self.path(step), self.pool.threads, lazy)

    def load(self, step: int, name: str = "state", map_location: str | torch.device = "cpu") -> Any:
        """Loads one ``.pt`` file of a checkpoint (verification is :meth:`latest`'s job)."""
        return load_file(self.path(step) / f"{name}.pt", map_location)

    def latest(self, quiet: bool = False, lazy: bool = False) -> int | None:
        """The newest checkpoint that verifies, skipping broken ones.

        Args:
            quiet: Say nothing; otherwise a ``sven: warning:`` line names the broken
                ones skipped, and what is used instead (an older one, or none).
            lazy: Leave the node-state chunks to their reader (:meth:`verify`).
        """
        bad = []
        for step in reversed(self.steps()):
            if self.verify(step, lazy):
                if bad and not quiet:
                    warn(
                        f"checkpoint {', '.join(bad)} is corrupt or incomplete; using the "
                        f"older {self.path(step)}"
                    )
                return step
            bad.append(str(self.path(step)))
        if bad and not quiet:
            warn(f"checkpoint {', '.join(bad)} is corrupt or incomplete, and there is no older one")
        return None

    def state_dict(self) -> dict[str, Any]:
        """The setting that is not on disk: how many checkpoints are kept.

        The checkpoints themselves are the folders under :attr:`root`.
        """
        return {"keep_latest_k": self.keep_latest_k}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sets what :meth:`state_dict` gave."""
        self.keep_latest_k = int(state["keep_latest_k"])
