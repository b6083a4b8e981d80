"""Where a rank's training time goes: per-stage times of each epoch, and a Chrome trace.

A :class:`Timeline` splits the training loop of one rank into consecutive stages with
*laps*: ``timeline.lap(name)`` ends the stage ``name``, which began at the previous
lap (or at :meth:`Timeline.begin`). A lap is one line where the stage ends, so the
step functions need no re-indentation, and the stages of an epoch cover the time
from ``begin`` to the last lap without gaps or overlaps. Laps outside training
(between :meth:`Timeline.pause` and the next ``begin``: evaluation, checkpoints) are
ignored.

On CPU a lap reads ``time.perf_counter``. On CUDA it records a CUDA event on the
current stream and nothing is read until :meth:`Timeline.epoch_totals`, once per
epoch (after the epoch's last step was waited for anyway): no host sync per stage. A
stage's time is then the device-timeline time between two events, which includes
the host work between them where the stream was idle.

Stages (:data:`STAGES`): ``sample`` (batch build: events, negatives, neighbours,
de-duplication), ``id_exchange`` (the ids sent to their owners), ``row_fetch``
(memory rows read), ``compute`` (forward and backward), ``grad_allreduce``,
``optimizer``, ``write_back`` (memory update committed or pushed to the owners),
``wait`` (the rest of the loop: hooks, the stop vote, waiting for the device at
the epoch's end) and ``step``: one CUDA process runs the whole step as one captured
graph, which a lap would break, so there the step is one stage.

:class:`StepProfiler` records a bounded window of training steps with
``torch.profiler`` and writes it as a Chrome trace (``chrome://tracing``, Perfetto).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

#: Every stage a lap may name, in the order of a step.
STAGES = (
    "sample",
    "id_exchange",
    "row_fetch",
    "compute",
    "grad_allreduce",
    "optimizer",
    "write_back",
    "wait",
    "step",
)


# Pending CUDA events are folded into the totals (those already complete, without
# waiting) every this many laps, so that a long epoch does not hold millions of events.
_FOLD_EVERY = 4096


class Timeline:
    """Per-stage times of one rank's training loop, summed over an epoch.

    Args:
        device: The rank's device; CUDA events on CUDA, ``perf_counter`` otherwise.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._totals = dict.fromkeys(STAGES, 0.0)
        # CUDA: (stage, start event, end event) not yet added to the totals.
        self._pending: list[tuple[str, Any, Any]] = []
        self._mark: Any = None  # the last lap's time (float) or event; None: paused

    @property
    def active(self) -> bool:
        """Whether laps count (between :meth:`begin` and :meth:`pause`)."""
        return self._mark is not None

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        """Starts (or restarts) lapping: the next stage begins now."""
        self._mark = self._now()

    def pause(self) -> None:
        """Stops lapping until the next :meth:`begin` (the time between counts nowhere)."""
        self._mark = None

    def lap(self, stage: str) -> None:
        """Ends stage ``stage`` (one of :data:`STAGES`): it ran since the previous lap.

        A no-op while paused (evaluation reads rows through the same functions).
        """
        if self._mark is None:
            return
        if stage not in self._totals:
            raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
        now = self._now()
        if self.cuda:
            self._pending.append((stage, self._mark, now))
            if len(self._pending) >= _FOLD_EVERY:
                self._fold(block=False)
        else:
            self._totals[stage] += now - self._mark
        self._mark = now

    def epoch_totals(self) -> dict[str, float]:
        """Seconds per stage since the last call, every stage of :data:`STAGES`; resets.

        Pauses lapping. On CUDA waits for the last recorded event (the epoch's steps
        were waited for already) and reads every event pair once.
        """
        self.pause()
        self._fold(block=True)
        out, self._totals = self._totals, dict.fromkeys(STAGES, 0.0)
        return out

    def _fold(self, block: bool) -> None:
        """Adds the pending event pairs that completed (all of them with ``block``,
        which waits for the last) to the totals and drops them."""
        if not self._pending:
            return
        if block:
            self._pending[-1][2].synchronize()
        done = 0
        for stage, start, end in self._pending:
            if not block and not end.query():
                break  # events complete in stream order: the rest are later
            self._totals[stage] += start.elapsed_time(end) / 1000.0
            done += 1
        del self._pending[:done]


def timeline_line(per_rank: torch.Tensor, epoch_s: torch.Tensor) -> dict[str, Any]:
    """The ``metrics.jsonl`` keys of a gathered timeline.

    Args:
        per_rank: (P, len(STAGES)) seconds of each rank in each stage.
        epoch_s: (P,) each rank's training time of the epoch (the wall time of the
            ``events_per_s`` key; after a resume mid-epoch, this run's part), seconds.

    Returns:
        ``stage_<name>_s_per_rank`` (P seconds) for every stage some rank spent time
        in, ``timeline_stages_s_per_rank`` (their sum per rank, at most the epoch) and
        ``timeline_epoch_s_per_rank``.
    """
    line: dict[str, Any] = {}
    for i, name in enumerate(STAGES):
        col = per_rank[:, i]
        if bool((col > 0).any()):
            line[f"stage_{name}_s_per_rank"] = [round(float(v), 6) for v in col]
    line["timeline_stages_s_per_rank"] = [round(float(v), 6) for v in per_rank.sum(1)]
    line["timeline_epoch_s_per_rank"] = [round(float(v), 6) for v in epoch_s]
    return line


class StepProfiler:
    """``torch.profiler`` over training steps ``[start, start + steps)`` of the first
    epoch it sees, exported as a Chrome trace.

    Args:
        path: The trace file (``<out>/traces/rank<R>.json``); its folder is created.
        device: The rank's device (CUDA activity is recorded on CUDA).
        start: The first profiled step (0-based, within the epoch).
        steps: How many steps to record.
    """

    def __init__(self, path: Path, device: torch.device, start: int, steps: int) -> None:
        self.path = Path(path)
        self.device = device
        self.start = start
        self.steps = steps
        self._prof: Any = None
        self._range: Any = None
        self.done = False

    def fit(self, first: int, last: int) -> None:
        """Moves the window into an epoch of steps ``[first, last)`` where it would
        miss it (a short epoch, a resumed one), so that a trace is always written."""
        if self.done:
            return
        self.start = max(first, min(self.start, last - self.steps))

    def before(self, step: int) -> None:
        """Called before training step ``step`` of the epoch."""
        if self.done:
            return
        from torch.profiler import ProfilerActivity, profile, record_function

        if self._prof is None:
            if step != self.start:
                return
            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=acts)
            self._prof.start()
        # A named range around each step, so that the trace shows where steps begin.
        self._range = record_function(f"sven_step#{step}")
        self._range.__enter__()

    def after(self, step: int) -> None:
        """Called after training step ``step``; closes the window after its last step."""
        if self._prof is None:
            return
        self._end_range()
        self._prof.step()
        if step + 1 >= self.start + self.steps:
            self.close()

    def _end_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def close(self) -> None:
        """Stops and writes the trace of the steps recorded so far (none: no file)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        self._end_range()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        self.done = True
