"""The one run loop of every task: epochs, early stopping, checkpoints, metrics, stop
signals, resume.

The loop is short and plain; what it drives is a :class:`Task` (link prediction,
:mod:`sven.tasks.link`; node classification, :mod:`sven.tasks.nodeclass`), whose
parts are built from the config and say what a checkpoint holds through their
``state_dict`` / ``load_state_dict``: a task hands the loop a
:class:`~sven.engine.checkpoint.Snapshot` of them with the :class:`TrainingState`
(where to resume, the loop's progress). Per epoch::

    begin_epoch -> train_batch (each batch; a periodic checkpoint or a stop signal
    after any) -> end_epoch (drain, validate: the epoch's metrics line) -> the line
    into metrics.jsonl -> the best model if it improved (else patience) -> the latest
    checkpoint

A stop signal (SIGTERM, SIGUSR1: :data:`STOP_SIGNALS`) stops after the current batch,
on every rank at the same batch, with a checkpoint (:class:`~sven.errors.Stopped`).
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sven.engine.checkpoint import RunCheckpoints, Snapshot
from sven.engine.run_folder import atomic_write_text, finite_or_none
from sven.errors import CheckpointError, Stopped, SvenError

__all__ = [
    "STOP_SIGNALS",
    "RunLoop",
    "StopSignals",
    "Task",
    "TrainingState",
    "end_run",
    "stop_from_votes",
    "stop_vote",
]

# Signals that stop training after the current step with a checkpoint: scancel and
# preemption send SIGTERM; SLURM's --signal=USR1@N warns N seconds before the time limit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def stop_vote(signum: int | None, world_size: int) -> int:
    """This rank's term of the summed stop vote: SIGTERM 1, SIGUSR1 ``world_size + 1``.

    A sum of P such terms still says whether any rank got each signal (see
    :func:`stop_from_votes`); exact in float32 up to P = 4095.
    """
    if signum is None:
        return 0
    return 1 if signum == signal.SIGTERM else world_size + 1


def stop_from_votes(total: int, world_size: int) -> int:
    """The signal to report from a summed vote (SIGTERM first), or 0 for none."""
    usr1, term = divmod(total, world_size + 1)
    if term:
        return int(signal.SIGTERM)
    return int(signal.SIGUSR1) if usr1 else 0


class StopSignals:
    """SIGTERM/SIGUSR1 set a flag while installed (:meth:`install` returns what puts the
    old handlers back); the step boundary where all ranks agree is the loop's.

    Only the main thread may install handlers; elsewhere (a run in a thread) signals
    keep their handlers and cannot stop the run.
    """

    def __init__(self) -> None:
        #: The first stop signal received, or None.
        self.received: int | None = None

    def install(self) -> Callable[[], None]:
        """Makes the stop signals set :attr:`received`; returns the restorer."""
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: object) -> None:
            if self.received is None:
                self.received = signum

        old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}

        def restore() -> None:
            for s, handler in old.items():
                # None: installed from C; the default is the closest we can put back.
                signal.signal(s, signal.SIG_DFL if handler is None else handler)

        return restore


@dataclass
class TrainingState:
    """Where a run resumes and the loop's progress, as a resumable checkpoint keeps them.

    Attributes:
        epoch: The epoch to resume in.
        next_batch: Its first batch not yet trained.
        progress: The loop's counters, history and early-stopping state, with the
            task's own keys (:func:`new_progress`).
    """

    epoch: int
    next_batch: int
    progress: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``cursor`` and ``progress``."""
        return {
            "cursor": {"epoch": self.epoch, "next_batch": self.next_batch},
            "progress": self.progress,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TrainingState:
        """The training state of a checkpoint's state (one written before the cursor
        existed resumes at the start of its ``epoch``)."""
        cursor = state.get("cursor") or {"epoch": int(state["epoch"]), "next_batch": 0}
        return cls(int(cursor["epoch"]), int(cursor["next_batch"]), state["progress"])


class Task(Protocol):
    """What a task gives the run loop. ``progress`` is the loop's dict of counters,
    history and early-stopping state (saved in every checkpoint), to which a task adds
    keys of its own."""

    #: Where training is (failure messages).
    where: str
    #: Whether the best model's node state is the latest checkpoint's, saved just
    #: before it (best/ then links those files).
    best_links_latest: bool

    def begin_epoch(self, epoch: int, first: int, progress: dict[str, Any]) -> int:
        """Readies epoch ``epoch`` from batch ``first``; returns its batch count."""

    def train_batch(self, epoch: int, i: int, progress: dict[str, Any]) -> None:
        """Trains batch ``i`` (queued: nothing need be read back)."""

    def stop_requested(self) -> int:
        """The stop signal all ranks agree on after the last batch, or 0."""

    def pause(self, progress: dict[str, Any]) -> dict[str, Any]:
        """Waits for the queued batches and stops the epoch's clock; returns
        ``progress`` as a checkpoint saves it mid-epoch."""

    def unpause(self) -> None:
        """Restarts the epoch's clock after a mid-epoch checkpoint."""

    def end_epoch(self, epoch: int, progress: dict[str, Any]) -> dict[str, Any]:
        """Ends an epoch's training and validates: the epoch's metrics line."""

    def improved(self, line: dict[str, Any], progress: dict[str, Any]) -> bool:
        """Whether the epoch improves on the best (updating the best in ``progress``)."""

    def state_dict(self, training: TrainingState) -> Snapshot:
        """A resumable checkpoint of this rank, with ``training``."""

    def load_state_dict(self, snap: Snapshot) -> None:
        """Loads a checkpoint of :meth:`state_dict`."""

    def best_state(self, epoch: int) -> Snapshot:
        """The best model of epoch ``epoch`` as a checkpoint (what test reloads)."""

    def describe(self, line: dict[str, Any]) -> str:
        """The epoch's line as the log prints it."""


def new_progress(**task: Any) -> dict[str, Any]:
    """The loop's progress at the start of a run, with a task's own keys."""
    return {
        "history": [],
        "best_epoch": -1,
        "bad_epochs": 0,
        "global_step": 0,
        "stopped": False,
        **task,
    }


class RunLoop:
    """Runs a task's epochs with early stopping, checkpoints, metrics and stop signals.

    Args:
        task: The task.
        checkpoints: The run's checkpoints (``latest`` and ``best``).
        out: The run folder (``metrics.jsonl`` there, written by the main rank).
        epochs: Epochs to run.
        patience: Epochs without improvement before stopping (0: never).
        checkpoint_every: A checkpoint every this many batches mid-epoch (0: none).
        main: Whether this is the rank that writes files.
        log: Where messages go.
        on_line: Called with each epoch's line (e.g. TensorBoard), on every rank.
        save: Writes a checkpoint (``save(ck, step, snapshot)``; the run measures and
            may survive a failed write).
        device: Where a loaded checkpoint's tensors go.
    """

    def __init__(
        self,
        task: Task,
        checkpoints: RunCheckpoints,
        *,
        out: Path,
        epochs: int,
        patience: int,
        checkpoint_every: int,
        main: bool,
        log: Callable[[str], None],
        on_line: Callable[[dict[str, Any]], None] | None = None,
        save: Callable[..., Any] | None = None,
        device: Any = "cpu",
    ) -> None:
        self.task, self.ck = task, checkpoints
        self.out, self.epochs, self.patience = out, epochs, patience
        self.checkpoint_every, self.main = checkpoint_every, main
        self._log = log
        self._on_line = on_line or (lambda line: None)
        self._save = save or checkpoints.save
        self.device = device
        #: The epoch whose best model is the live state (saved just now, nothing
        #: trained after it), or None.
        self.best_live: int | None = None

    def resume(self, progress: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
        """Loads the newest valid checkpoint; returns (progress, epoch, batch) to go on
        from (the given progress and 0, 0 where there is none)."""
        ck = self.ck
        step = ck.newest(ck.latest)
        if step is None:
            self._log(f"no checkpoint under {self.out}, starting fresh")
            return progress, 0, 0
        snap = ck.load(ck.latest, step, self.device)
        self.task.load_state_dict(snap)
        saved = TrainingState.from_state(snap.state)
        epoch, batch = saved.epoch, saved.next_batch
        self._log(f"resumed from {ck.latest.path(step)} (epoch {epoch}, batch {batch})")
        return {**progress, **saved.progress}, epoch, batch

    def run(
        self, progress: dict[str, Any], start_epoch: int = 0, start_batch: int = 0
    ) -> dict[str, Any]:
        """Runs epochs ``start_epoch..`` from batch ``start_batch``; returns the progress.

        Raises:
            Stopped: A stop signal arrived; its checkpoint is written.
        """
        task, ck = self.task, self.ck
        if self.main:
            # metrics.jsonl is rebuilt from the checkpointed history, so lines written
            # after the checkpoint by an interrupted run do not appear twice.
            atomic_write_text(
                "".join(json.dumps(h) + "\n" for h in progress["history"]),
                self.out / "metrics.jsonl",
            )
        for epoch in range(start_epoch, self.epochs):
            if progress["stopped"]:
                break
            self.best_live = None
            last = task.begin_epoch(epoch, start_batch, progress)
            for i in range(start_batch, last):
                task.train_batch(epoch, i, progress)
                progress["global_step"] += 1
                stop = task.stop_requested()
                due = bool(self.checkpoint_every) and (i + 1) % self.checkpoint_every == 0
                due = due and i + 1 < last
                if due or stop:
                    snap = task.pause(progress)
                    if due:
                        state = task.state_dict(TrainingState(epoch, i + 1, snap))
                        self._save(ck.latest, progress["global_step"], state)
                    task.unpause()
                    if stop:
                        raise self._stopped(stop, epoch, i + 1, last, snap, saved=due)
            start_batch = 0
            line = finite_or_none(task.end_epoch(epoch, progress))
            progress["history"].append(line)
            if self.main:
                with open(self.out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
            self._on_line(line)
            self._log(task.describe(line))
            is_best = task.improved(line, progress)
            if is_best:
                progress.update(best_epoch=epoch, bad_epochs=0)
            else:
                progress["bad_epochs"] += 1
                if self.patience and progress["bad_epochs"] >= self.patience:
                    progress["stopped"] = True
            progress["global_step"] += 1
            step = progress["global_step"]
            self._save(ck.latest, step, task.state_dict(TrainingState(epoch + 1, 0, progress)))
            if is_best:
                # The latest checkpoint just saved holds the best model's node state:
                # best/ links its files rather than writing them again.
                link = {"link_latest": step} if task.best_links_latest else {}
                self._save(ck.best, epoch, task.best_state(epoch), **link)
                # Test continues from this state, unless another epoch trains after it.
                self.best_live = epoch
        return progress

    def _stopped(
        self,
        signum: int,
        epoch: int,
        next_batch: int,
        last: int,
        progress: dict[str, Any],
        saved: bool,
    ) -> SvenError:
        """Writes the stop checkpoint (unless this batch's periodic one is it).

        Returns:
            The :class:`Stopped` to raise, which says where and what was written, or the
            :class:`CheckpointError` of a stop checkpoint that could not be written.
        """
        step = progress["global_step"]
        ck = self.ck
        if not saved:
            training = TrainingState(epoch, next_batch, progress)
            self._save(ck.latest, step, self.task.state_dict(training))
        ck.finish()
        name = signal.Signals(signum).name
        path = ck.latest.path(step)
        missing = ck.error_of(ck.latest, step)
        if missing is not None:
            # Not resumable from here: say so rather than "stopped with a checkpoint".
            err = CheckpointError(missing, checkpoint=path, step=step)
            err.quiet = not self.main
            return err
        return Stopped(
            f"stopped by {name} at epoch {epoch} step {step} (batch {next_batch} of {last}); "
            f"checkpoint {path}; rerun with train.resume=true",
            signal_name=name,
            checkpoint=path,
            quiet=not self.main,
        )


def end_run(
    ck: RunCheckpoints,
    summary: dict[str, Any],
    missing: list[str],
    *,
    out: Path,
    main: bool,
    say: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """A run's end, for every task: the checkpoints that could not be written go into
    the summary, ``summary.json`` is written (by the main rank), ``say`` reports it;
    then the run ends with the error of a missing checkpoint (exit code 5), if any.

    Raises:
        CheckpointError: A checkpoint could not be written (after the summary is).
    """
    if missing:
        summary["checkpoint_errors"] = missing
    if main:
        atomic_write_text(json.dumps(summary, indent=2) + "\n", out / "summary.json")
    say(summary)
    err = ck.missing_error(out / "summary.json")
    if err is not None:
        raise err
    return summary
