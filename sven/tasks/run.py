"""The run a task takes: the public parts and services of a built trainer.

A task (link prediction, node classification, predictions) uses a built run through
these members only, never the trainer's private ones. :class:`Run` is a protocol, so a
task names no trainer class: :class:`~sven.engine.trainer.Trainer` is one (it imports
the task it runs; the task does not import it back, not even for its types).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from tqdm import tqdm

    from sven.config import Config
    from sven.distributed.process_group import DistContext
    from sven.engine.checkpoint import Checkpointer, RunCheckpoints, Snapshot
    from sven.engine.data import Data
    from sven.engine.evaluation import EvalResult
    from sven.engine.loop import StopSignals, TrainingState
    from sven.engine.plan import Plan
    from sven.engine.spec import RunSpec
    from sven.engine.startup import StartupClock
    from sven.engine.step import Step
    from sven.engine.tblog import EpochLog
    from sven.engine.timeline import StepProfiler, Timeline
    from sven.models import MemoryModel, MemoryState
    from sven.pipeline.exchange_api import Exchange

__all__ = ["Run"]


class Run(Protocol):
    """A built run: its parts, and the barrier, agreement and logging it offers.

    The parts: the config, this process's place among the ranks, the data, the model,
    this rank's node state and the exchange over it, the step (with its evaluation),
    the run's checkpoints, the timeline and profiler, the start-up clock, the stop
    signals and the step hooks.
    """

    cfg: Config
    ctx: DistContext
    rank: int
    world_size: int
    #: How the run runs, decided once (device, ranks, fixed shapes, tier, pipeline).
    spec: RunSpec
    device: torch.device
    dtype: torch.dtype
    out: Path
    data: Data
    plan: Plan
    model: MemoryModel
    memory: MemoryState
    exchange: Exchange
    step: Step
    checkpoints: RunCheckpoints
    timeline: Timeline
    profiler: StepProfiler | None
    startup: StartupClock
    signals: StopSignals
    epoch_log: EpochLog
    hooks: dict[str, list[Callable[[Any], None]]]
    #: The communication the cost model predicts (P ranks), or None.
    predicted_comm: dict[str, Any] | None
    #: Where the run is, for failure messages.
    where: str
    #: The open progress bar, closed if the run ends on an error.
    bar: tqdm | None

    @property
    def ranges(self) -> dict[str, tuple[int, int]]:
        """Split -> [lo, hi) event range."""
        ...

    @property
    def mrr_negatives(self) -> int:
        """MRR negatives per event (0: no MRR)."""
        ...

    def log(self, msg: str, force: bool = False) -> None:
        """A line on rank 0's stderr, unless quiet (``force``: regardless)."""
        ...

    def barrier(self, what: str) -> None:
        """Waits for every rank; a rank that does not come is named (``what``: where)."""
        ...

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        ...

    def claim_out(self) -> None:
        """Rank 0 locks and checks the run folder; every rank learns the verdict."""
        ...

    def num_batches(self, split: str) -> int:
        """Number of global batches of a split."""
        ...

    def evaluate(self, split: str) -> EvalResult:
        """Walks a split without gradients, updating node state; returns its scores."""
        ...

    def split_metrics(self, split: str, res: EvalResult) -> dict[str, float]:
        """A split's metrics from its scores."""
        ...

    def progress_bar(self, desc: str, events: int, initial: int = 0) -> tqdm:
        """A progress bar over ``events`` events on rank 0."""
        ...

    def first_step_done(self, t_step: float, bar: tqdm) -> None:
        """Ends the start-up clock at the end of the first training step."""
        ...

    def state_dict(self, training: TrainingState) -> Snapshot:
        """A resumable checkpoint of this rank, with ``training``."""
        ...

    def load_state_dict(self, snap: Snapshot, where: str = "checkpoint") -> None:
        """Loads a checkpoint into the parts."""
        ...

    def load_checkpoint(self, ck: Checkpointer, step: int) -> dict[str, Any]:
        """Loads checkpoint ``step`` of ``ck`` into the parts; returns rank 0's state."""
        ...
