"""A training run's checkpoints: the latest ones to resume from and the best model.

:class:`RunCheckpoints` is what the trainer (and node classification) talks to. It
splits a checkpoint into what :class:`~sven.engine.checkpoint.writer.Checkpointer`
writes (rank 0's state, each rank's small state, the node state, the owner map), keeps
the best model's node state as links of the latest checkpoint's, and turns a checkpoint
that could not be written into a recorded error instead of a crash: the run goes on,
and its end says which checkpoints are missing (:meth:`RunCheckpoints.finish`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sven.engine.checkpoint.files import WriterPool
from sven.engine.checkpoint.format import warn
from sven.engine.checkpoint.load import load_node_state, read_node_state, read_shard, read_state
from sven.engine.checkpoint.parts import Snapshot
from sven.engine.checkpoint.writer import Checkpointer
from sven.errors import CheckpointError


def room_on_device(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a copy of the CUDA tensors among ``tensors`` fits in the device's free
    memory, with a margin (what the training step has cached stays its own)."""
    cuda = [t for t in tensors.values() if t.is_cuda]
    if not cuda:
        return False
    need = sum(t.numel() * t.element_size() for t in cuda)
    free, _ = torch.cuda.mem_get_info(cuda[0].device)
    return free > need + need // 20 + (512 << 20)


class RunCheckpoints:
    """A training run's checkpoints: the latest ones and the best model, on every rank.

    ``<out>/checkpoints`` keeps the newest ``keep_latest_k`` states to resume from;
    ``<out>/best`` the best model so far (one). Each checkpoint is one
    :class:`~sven.engine.checkpoint.parts.Snapshot` per rank: rank 0's state (with the
    run's config added), each rank's small shard (with its rank and the world size
    added), its node state and the owner map. What goes into them is the run's
    (assembled from its parts' state_dicts); this class writes, finds and reads them,
    names none of the run's keys, and refuses a checkpoint of another config.

    Args:
        out: The run folder.
        keep_latest_k: Resumable checkpoints kept.
        config: The run's :class:`~sven.config.Config`, saved with and compared to each
            checkpoint.
        rank: This rank.
        world_size: Number of ranks P.
        barrier: Synchronises the ranks (``barrier(what)``), needed when P > 1.
        agree: Rank 0's value on every rank (a no-op on one process).
        asynchronous: Commit checkpoints in the background (``train.checkpoint_async``).
        threads: Writer threads (``train.checkpoint_threads``; 0: one per core, up to 8).
        timeout_s: How long rank 0 waits for the other ranks' parts of a checkpoint.

    Attributes:
        errors: The checkpoints that could not be written so far, as
            ``{"checkpoint", "step", "error"}`` (the error is one line).
    """

    def __init__(
        self,
        out: str | Path,
        keep_latest_k: int,
        *,
        config: Any,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[str], None] | None = None,
        agree: Callable[[Any], Any] = lambda value: value,
        asynchronous: bool = False,
        threads: int = 0,
        timeout_s: float = 600.0,
    ) -> None:
        self.pool = pool = WriterPool(threads)
        opts = {"asynchronous": asynchronous, "timeout_s": timeout_s, "pool": pool}
        self.latest = Checkpointer(Path(out) / "checkpoints", keep_latest_k, **opts)
        self.best = Checkpointer(Path(out) / "best", 1, **opts)
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.barrier, self.agree = barrier, agree
        self.errors: list[dict[str, Any]] = []
        #: Each checkpoint written: which, its step, how long training waited for it
        #: (``stall_s``) and, once committed, how long it took to be on disk
        #: (``on_disk_s``), both from the start of the save.
        self.timings: list[dict[str, Any]] = []
        self._jobs: list[tuple[dict[str, Any], Any]] = []

    def save(
        self,
        ck: Checkpointer,
        step: int,
        snap: Snapshot,
        *,
        link_latest: int | None = None,
    ) -> Path:
        """Writes one checkpoint of ``ck`` (``latest`` or ``best``); every rank calls it.

        Returns once the snapshot is taken (the commit may go on in the background). A
        checkpoint that cannot be written is recorded in :attr:`errors` with a
        ``sven: warning:`` line, never raised: the run goes on.

        Args:
            ck: :attr:`latest` or :attr:`best`.
            step: Its step.
            snap: This rank's checkpoint.
            link_latest: The node state is the one of :attr:`latest`'s checkpoint at
                this step (saved just before, unchanged since): its files are linked,
                not written again; ``snap`` then has no node state.

        Returns:
            The checkpoint's folder (there once committed).
        """
        self._settle(ck)
        if ck is self.latest:
            # best/ may be linking the files of a latest checkpoint that pruning removes.
            self._settle(self.best)
        node, owner = snap.node_state, snap.owner
        state = {**snap.state, "config": self.config.to_dict()}
        if owner is not None and (self.rank != 0 or not (self.world_size > 1 or owner.any())):
            owner = None  # one rank owns everything: read_state puts it back
        link = None if link_latest is None else self.latest.job(link_latest)
        t0 = time.perf_counter()
        entry = {"kind": "latest" if ck is self.latest else "best", "step": step}
        small = {**snap.shard, "rank": self.rank, "world_size": self.world_size}
        try:
            return ck.save(
                step,
                state,
                {f"rank{self.rank}": small},
                node_state=node,
                owner=owner,
                link=link,
                device_snapshot=bool(node) and room_on_device(node),
                rank=self.rank,
                world_size=self.world_size,
                barrier=self.barrier,
            )
        except CheckpointError as err:
            self._record(err)
            return ck.path(step)
        finally:
            entry["stall_s"] = round(time.perf_counter() - t0, 4)
            self.timings.append(entry)
            job = ck.job(step)
            if not isinstance(job, Path):
                self._jobs.append((entry, job))

    def _settle(self, ck: Checkpointer, say: bool = True) -> None:
        """Waits for ``ck``'s commit in flight; records its failure (``say``: with a
        warning line, as the run goes on)."""
        try:
            ck.wait()
        except CheckpointError as err:
            self._record(err, say)

    def _record(self, err: CheckpointError, say: bool = True) -> None:
        self.errors.append({"checkpoint": err.checkpoint, "step": err.step, "error": str(err)})
        if say and self.rank == 0:
            warn(f"{err}; the run goes on without it")

    def finish(self) -> list[str]:
        """Waits for every commit in flight; the checkpoints that could not be written,
        as rank 0 saw them, on every rank (one line each; the caller says them)."""
        self._settle(self.latest, say=False)
        self._settle(self.best, say=False)
        for entry, job in self._jobs:
            if job.finished and job.error is None:
                entry["on_disk_s"] = round(job.finished - job.started, 4)
        self._jobs = []
        self.pool.close()  # no thread outlives the run (a later save starts them again)
        self.errors = self.agree(self.errors)
        return [e["error"] for e in self.errors]

    def missing_error(self, summary: Path) -> CheckpointError | None:
        """The error a run that finished without some checkpoints ends with (after
        :meth:`finish`; None: none is missing). One line: the first missing checkpoint
        and why, how many more, and where the metrics went; quiet on ranks other than 0.

        Args:
            summary: The run's ``summary.json``, written with ``checkpoint_errors``.
        """
        if not self.errors:
            return None
        first, more = self.errors[0], len(self.errors) - 1
        err = CheckpointError(
            f"{first['error']}{f' (and {more} more)' if more else ''}; the run's metrics "
            f"and checkpoint_errors are in {summary}",
            checkpoint=first["checkpoint"],
            step=first["step"],
        )
        err.quiet = self.rank != 0
        return err

    def error_of(self, ck: Checkpointer, step: int) -> str | None:
        """Why checkpoint ``step`` of ``ck`` could not be written (after :meth:`finish`;
        None: it was, or it was never asked for)."""
        where = str(ck.path(step))
        return next((e["error"] for e in self.errors if e["checkpoint"] == where), None)

    def close(self) -> None:
        """Ends the commits in flight (the run is ending on an error): joins them and
        the writer threads, raising nothing."""
        self.latest.close()
        self.best.close()
        self.pool.close()

    def newest(self, ck: Checkpointer) -> int | None:
        """The newest valid checkpoint of ``ck``, as judged by rank 0 for all ranks."""
        self._settle(ck)
        return self.agree(ck.latest() if self.rank == 0 else None)

    def load(
        self,
        ck: Checkpointer,
        step: int,
        map_location: str | torch.device = "cpu",
        node_state: bool = True,
    ) -> Snapshot:
        """This rank's snapshot of a checkpoint: rank 0's state and this rank's shard.

        Args:
            ck: :attr:`latest` or :attr:`best`.
            step: The checkpoint's step.
            map_location: Where tensors go.
            node_state: Read this rank's node state whole (small runs); without,
                :meth:`load_node_state` fills the run's own tensors in pieces.

        Raises:
            ConfigError: The checkpoint was written with another config.
        """
        self._settle(ck)
        folder = ck.path(step)
        state = read_state(folder, map_location)
        check_resume_config(state, self.config, folder, self.rank)
        snap = Snapshot(state, read_shard(folder, self.rank, map_location))
        if node_state:
            whole = read_node_state(folder, self.rank)
            if whole is not None:
                snap.node_state = {k: v.to(map_location) for k, v in whole.items()}
        return snap

    def load_node_state(
        self,
        ck: Checkpointer,
        step: int,
        dest: dict[str, torch.Tensor],
        rows: torch.Tensor,
        num_nodes: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Fills ``dest`` with the node state of the vertices ``rows`` of a checkpoint
        (:func:`~sven.engine.checkpoint.load.load_node_state`)."""
        return load_node_state(ck.path(step), dest, rows, num_nodes)

    def state_dict(self) -> dict[str, Any]:
        """The settings of both folders (the checkpoints themselves are on disk)."""
        return {"latest": self.latest.state_dict(), "best": self.best.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sets what :meth:`state_dict` gave."""
        self.latest.load_state_dict(state["latest"])
        self.best.load_state_dict(state["best"])


def check_resume_config(state: dict[str, Any], cfg: Any, where: Path, rank: int) -> None:
    """Stops a resume whose checkpoint was written with a different config.

    Raises:
        ConfigError: The keys that differ, quiet on ranks other than 0.
    """
    from sven.config import config_differences
    from sven.errors import ConfigError

    saved = state.get("config")
    if not isinstance(saved, dict):
        return
    diff = config_differences(saved, cfg)
    if diff:
        err = ConfigError(
            f"train.resume: {where} was written with another config; differing keys: "
            f"{', '.join(diff)}. Resume with the same settings, or use another out"
        )
        err.quiet = rank != 0
        raise err
