"""The training and evaluation step, apart from the loop, and its CUDA-graph capture.

``train_step`` and ``eval_step`` take their state explicitly (model, optimizer, memory,
batch) and keep nothing between calls: the trainer's loop owns epochs, logging and
checkpoints. On a padded, fixed-capacity batch (``pipeline.stages.select_batch`` with a
capacity) nothing in them synchronises with the host and no shape depends on the data,
so :class:`StepGraph` can capture the whole step (batch selection, negatives, sampling,
de-duplication, forward, backward, optimizer, write-back) as one CUDA graph and replay
it, which removes the per-kernel launch cost that bounds a small temporal-GNN step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from sven.models import MemoryModel, MemoryState
from sven.models.base import ModelOutput
from sven.pipeline.batch import Batch

__all__ = ["StepGraph", "eval_step", "masked_bce", "torch_determinism_off", "train_step"]


@contextlib.contextmanager
def torch_determinism_off(active: bool = True) -> Iterator[None]:
    """Turns ``torch.use_deterministic_algorithms`` off for the fixed-shape CUDA step.

    The step is deterministic by construction: repeated rows' gradients are summed by
    the embedding backward (sorted segments, see ``models.base.take_rows``), writes go
    to distinct rows (losers to a scratch row), winners are chosen by max-scatters, and
    duplicate slot writes store equal values. Torch's deterministic mode would add
    nothing to that but a fill of every new tensor and sort-based ``index_put_`` for
    every scatter (0.7 ms of a 2.0 ms TGN step on an H200). A GPU test checks that two
    runs give bitwise equal parameters.
    """
    if not active:
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def masked_bce(out: ModelOutput, valid: torch.Tensor | None) -> torch.Tensor:
    """Sum of the BCE of the positives (label 1) and negatives (label 0), real events only.

    Args:
        out: Logits (B,) and (B, n).
        valid: (B,) bool real-event mask, or None.

    Returns:
        () the summed loss (divide by the global prediction count for the mean).
    """
    lp = F.binary_cross_entropy_with_logits(out.pos, torch.ones_like(out.pos), reduction="none")
    ln = F.binary_cross_entropy_with_logits(out.neg, torch.zeros_like(out.neg), reduction="none")
    if valid is not None:
        # A product, not indexing: padded rows are finite (they repeat a real event),
        # and the shape stays fixed.
        lp = lp * valid.to(lp.dtype)
        ln = ln * valid.to(ln.dtype)[:, None]
    return lp.sum() + ln.sum()


def train_step(
    model: MemoryModel,
    optimizer: torch.optim.Optimizer,
    memory: MemoryState,
    batch: Batch,
    num_predictions: float | torch.Tensor,
    lap: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """One optimisation step on one process: read, forward, backward, step, write back.

    Args:
        model: The model (put in training mode here).
        optimizer: Its optimizer.
        memory: The whole memory (one process owns every node).
        batch: The batch; padded events (``batch.valid``) count for nothing.
        num_predictions: Predictions of the batch's real events, B * (1 + n); a float
            or a 0-d device tensor.
        lap: Called with the name of each stage as it ends (``row_fetch``,
            ``compute``, ``optimizer``, ``write_back``; :class:`sven.timeline.Timeline`);
            None inside a captured graph, which a lap would break.

    Returns:
        () the batch's mean loss, detached, on the device (not read back).
    """
    lap = lap or _no_lap
    model.train()
    optimizer.zero_grad(set_to_none=True)
    rows = memory.gather(batch.nodes)
    lap("row_fetch")
    out = model(batch, rows)
    loss = masked_bce(out, batch.valid) / num_predictions
    loss.backward()
    lap("compute")
    optimizer.step()
    lap("optimizer")
    memory.commit_dense(out.dense)
    lap("write_back")
    return loss.detach()


def _no_lap(stage: str) -> None:
    pass


@torch.no_grad()
def eval_step(model: MemoryModel, memory: MemoryState, batch: Batch) -> ModelOutput:
    """Scores a batch without gradients and writes its memory update.

    Returns:
        The model output (logits of every slot, padded ones included).
    """
    model.eval()
    out = model(batch, memory.gather(batch.nodes))
    memory.commit_dense(out.dense)
    return out


class StepGraph:
    """Runs a step function eagerly, or captured once as a CUDA graph and replayed.

    The function reads its inputs from tensors whose addresses do not change (the
    caller refills them in place before each call) and writes its results in place.
    Capture needs warm-up runs (lazy initialisation: optimizer state, cuBLAS handles,
    Triton compilation); they modify the state, so the tensors ``state()`` lists are
    saved before and restored after them, and the optimizer's state is put back in
    place (zeroed where the warm-up created it), so the first replay continues exactly
    where the eager run would.

    Args:
        fn: The step; no arguments, no return value.
        mode: "on" (capture, fail loudly), "off" (eager) or "auto" (capture on CUDA,
            fall back to eager with a notice if capture fails).
        device: Where the step runs; capture needs CUDA.
        state: Returns the tensors the step modifies (parameters, memory buffers,
            accumulators), restored after the warm-up.
        optimizer: Its state is restored after the warm-up too, or None.
        warmup: Eager runs before capture.
        log: Where notices go.
    """

    def __init__(
        self,
        fn: Callable[[], None],
        *,
        mode: str,
        device: torch.device,
        state: Callable[[], list[torch.Tensor]],
        optimizer: torch.optim.Optimizer | None = None,
        warmup: int = 2,
        log: Callable[[str], None] = print,
    ) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graph must be auto, on or off, got {mode!r}")
        if mode == "on" and device.type != "cuda":
            raise ValueError("train.cuda_graph=on needs a CUDA device")
        self.fn = fn
        self.mode = mode if device.type == "cuda" else "off"
        self.state = state
        self.optimizer = optimizer
        self.warmup = warmup
        self.log = log
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured = False

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        if self.mode == "off":
            self.fn()
            return
        try:
            self._capture()
        except Exception as exc:
            if self.mode == "on":
                raise
            self.log(f"sven: CUDA-graph capture failed ({type(exc).__name__}: {exc}); eager")
            self.mode = "off"
            self.graph = None
            self.fn()
            return
        self.graph.replay()  # type: ignore[union-attr]

    def _capture(self) -> None:
        saved = [t.detach().clone() for t in self.state()]
        opt_saved = _optimizer_tensors(self.optimizer)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.fn()
        finally:
            # The warm-up ran real steps (and a failed capture may have run part of
            # one): put the state back as it was.
            torch.cuda.synchronize()
            with torch.no_grad():
                for t, s in zip(self.state(), saved, strict=True):
                    t.copy_(s)
                _restore_optimizer(self.optimizer, opt_saved)
        self.graph = graph
        self.captured = True


def _optimizer_tensors(opt: torch.optim.Optimizer | None) -> dict[int, dict[str, Any]]:
    if opt is None:
        return {}
    return {
        id(p): {k: v.detach().clone() for k, v in st.items() if torch.is_tensor(v)}
        for p, st in opt.state.items()
    }


def _restore_optimizer(opt: torch.optim.Optimizer | None, saved: dict[int, dict[str, Any]]) -> None:
    """Puts optimizer state back in place; state the warm-up created goes to zero, which
    is Adam's initial state (zero moments, step 0)."""
    if opt is None:
        return
    for p, st in opt.state.items():
        old = saved.get(id(p), {})
        for k, v in st.items():
            if not torch.is_tensor(v):
                continue
            if k in old:
                v.copy_(old[k])
            else:
                v.zero_()
