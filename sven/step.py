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
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from sven.components import EVAL_STREAM, EvalResult, eval_result
from sven.models import MemoryModel, MemoryState
from sven.models.base import ModelOutput
from sven.pipeline.batch import Batch
from sven.pipeline.eval_negatives import protocol_order
from sven.startup import set_deterministic

if TYPE_CHECKING:
    from sven.trainer import Trainer

__all__ = [
    "SingleProcessStep",
    "StepGraph",
    "eval_step",
    "masked_bce",
    "no_uninitialized_fill",
    "torch_determinism_off",
    "train_step",
    "undone",
]


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
    # sven.startup's setter: torch's own imports its compiler at the first step.
    set_deterministic(False)
    try:
        yield
    finally:
        set_deterministic(was, warn_only=warn)


@contextlib.contextmanager
def no_uninitialized_fill() -> Iterator[None]:
    """Keeps deterministic algorithms but stops torch filling every new tensor.

    With ``torch.use_deterministic_algorithms(True)`` torch also writes NaN into every
    tensor it allocates uninitialized, so that a read of uninitialized memory cannot
    differ between runs. The step never reads memory it has not written (on CUDA it
    runs with the whole mode off, and the GPU test finds two runs bitwise equal), so
    on CPU the fill is pure cost: 1 ms of a 20 ms TGN step at batch 200, one thread
    (most of it the fill of index_select's gathered keys and values).
    """
    fill = torch.utils.deterministic
    was = fill.fill_uninitialized_memory
    fill.fill_uninitialized_memory = False
    try:
        yield
    finally:
        fill.fill_uninitialized_memory = was


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
        #: Seconds of the capture's warm-up runs (cuBLAS, Triton kernels compiled or
        #: loaded from the disk cache) and of the capture itself; 0 until captured.
        self.warmup_s = 0.0
        self.capture_s = 0.0

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
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # The warm-up runs real steps (and a failed capture may run part of one): the
        # state is put back as it was, so the first replay continues where the eager
        # run would (tested on CPU through rehearse()).
        with undone(self.state, self.optimizer):
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            self.warmup_s = time.perf_counter() - t0
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.fn()
            torch.cuda.synchronize()
            self.capture_s = time.perf_counter() - t0 - self.warmup_s
        self.graph = graph
        self.captured = True

    def rehearse(self) -> None:
        """The warm-up of a capture without the capture: ``warmup`` eager runs, then the
        state put back (:func:`undone`). On any device; afterwards the state must be
        exactly as before (the CPU tests check parameters, optimizer and memory)."""
        with undone(self.state, self.optimizer):
            for _ in range(self.warmup):
                self.fn()


@contextlib.contextmanager
def undone(
    state: Callable[[], list[torch.Tensor]], optimizer: torch.optim.Optimizer | None = None
) -> Iterator[None]:
    """Runs the ``with`` block, then puts back in place the tensors ``state()`` lists and
    the optimizer's state (state the block created goes to zero: Adam's initial state).

    Args:
        state: The tensors the block may modify (parameters, memory, accumulators).
        optimizer: Its state is restored too, or None.
    """
    saved = [t.detach().clone() for t in state()]
    opt_saved = _optimizer_tensors(optimizer)
    try:
        yield
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        with torch.no_grad():
            for t, s in zip(state(), saved, strict=True):
                t.copy_(s)
            _restore_optimizer(optimizer, opt_saved)


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


class SingleProcessStep:
    """The one-process step: device-resident event tables, the pure step functions of
    :mod:`sven.step`, and their CUDA-graph capture.

    On CUDA every batch has the configured capacity (the last one padded) and its inputs
    (event range, random streams, prediction count) live in 0-d device tensors refilled
    in place, so one captured graph serves every training batch and another every
    evaluation batch. On CPU the same functions run eagerly on exact-size batches
    (``torch.unique`` de-duplication, which computes less than fixed slots there).
    """

    def __init__(self, tr: Trainer) -> None:
        self.tr = tr
        tc, dev = tr.cfg.train, tr.device
        self.tables = tr.tables
        self.fixed = dev.type == "cuda"
        self.capacity = tc.batch_size if self.fixed else None
        from sven.pipeline.stages import select_batch

        self.select: Callable[..., Batch] = select_batch
        self.model: Any = tr.model
        if tc.compile and self.fixed:
            # Fixed shapes: one compilation serves every batch. The batch selection
            # stays eager: inductor cannot yet emit its 64-bit hash constants.
            self.model = torch.compile(tr.model, dynamic=False)
        names = ("start", "stop", "stream", "mrr_stream", "split_lo")
        self.inp: dict[str, Any]
        if self.fixed:
            self.inp = {k: torch.zeros((), dtype=torch.int64, device=dev) for k in names}
            self.inp["npred"] = torch.ones((), dtype=torch.float64, device=dev)
        else:
            self.inp = {**dict.fromkeys(names, 0), "npred": 1.0}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        # Evaluation negatives: one column per protocol the split reports (test: all of
        # them, with eval.all_protocols), then the MRR negatives; drawn once per split
        # into a table the captured step reads. One graph per width: scoring val at
        # test's width would score columns no metric reads (with all protocols, 2 of
        # val's 5 roots per event).
        ec = tr.cfg.eval
        self.protocols = protocol_order(ec.negatives, ec.all_protocols)
        self._neg_cache: dict[str, torch.Tensor] = {}
        self._valid_cache: dict[str, torch.Tensor] = {}
        self._evals: dict[int, tuple[torch.Tensor, torch.Tensor, StepGraph]] = {}

        def memory_state() -> list[torch.Tensor]:
            return list(tr.memory.full.values())

        log = lambda msg: tr._log(msg, force=True)  # noqa: E731
        self._memory_state, self._graph_log = memory_state, log
        self.train_graph = StepGraph(
            self._train,
            mode=tc.cuda_graph,
            device=dev,
            state=lambda: (
                [p.data for p in tr.model.parameters()] + memory_state() + [self.loss_sum]
            ),
            optimizer=tr.optimizer,
            log=log,
        )

    def _set(self, **values: float) -> None:
        for k, v in values.items():
            if self.fixed:
                self.inp[k].fill_(v)
            else:
                self.inp[k] = v

    def _batch(self, num_neg: int, neg_table: torch.Tensor | None = None) -> Batch:
        tr, inp = self.tr, self.inp
        return self.select(
            self.tables,
            inp["start"],
            inp["stop"],
            inp["stream"],
            seed=tr.cfg.train.seed,
            num_neg=num_neg,
            sample_roots=tr.model.sample_roots,
            read_neighbors=tr.model.read_neighbors,
            capacity=self.capacity,
            neg_table=neg_table,
            table_lo=inp["split_lo"],
        )

    def _determinism(self) -> contextlib.AbstractContextManager[None]:
        """The captured CUDA step runs with torch's deterministic mode off, the eager
        step with it on but without the fill of new tensors (both: see the functions)."""
        return torch_determinism_off() if self.fixed else no_uninitialized_fill()

    def _train(self) -> None:
        tr = self.tr
        with self._determinism():
            batch = self._batch(tr.cfg.train.num_neg)
            # Eager (CPU): a lap per stage; a captured graph is timed as one "step".
            lap = None if self.fixed else tr.timeline.lap
            if lap is not None:
                lap("sample")
            loss = train_step(
                self.model, tr.optimizer, tr.memory, batch, self.inp["npred"], lap=lap
            )
            self.loss_sum += loss

    def _eval(self, neg_table: torch.Tensor, scores_out: torch.Tensor) -> None:
        tr = self.tr
        with self._determinism():
            batch = self._batch(neg_table.shape[1], neg_table)
            out = eval_step(self.model, tr.memory, batch)
            scores = torch.cat([out.pos[:, None], out.neg], 1).to(scores_out.dtype)
            rows = batch.index - self.inp["split_lo"]
            if batch.valid is not None:
                rows = torch.where(batch.valid, rows, scores_out.shape[0] - 1)
            # Padded events all write the scratch row; real ones distinct rows.
            scores_out.index_copy_(0, rows, scores)

    def split_protocols(self, split: str) -> list[str]:
        """The protocols ``split`` scores: all on test, ``eval.negatives`` elsewhere."""
        return self.protocols if split == "test" else self.protocols[:1]

    def eval_graph(self, split: str) -> tuple[torch.Tensor, torch.Tensor, StepGraph]:
        """The negatives table (rows, width), scores (rows, 1 + width) and evaluation
        graph of ``split``'s width, made at the first pass of that width (each split
        of a width fits its rows, plus a scratch row)."""
        tr = self.tr

        def width(s: str) -> int:
            return len(self.split_protocols(s)) + tr.mrr_negatives

        w = width(split)
        if w not in self._evals:
            rows = max(hi - lo for s, (lo, hi) in tr.ranges.items() if width(s) == w) + 1
            dev = tr.device
            neg = torch.zeros(rows, w, dtype=torch.int64, device=dev)
            scores = torch.zeros(rows, 1 + w, dtype=tr.dtype, device=dev)
            graph = StepGraph(
                lambda: self._eval(neg, scores),
                mode=tr.cfg.train.cuda_graph,
                device=dev,
                state=lambda: [*self._memory_state(), scores],
                log=self._graph_log,
            )
            self._evals[w] = (neg, scores, graph)
        return self._evals[w]

    def train_batch(self, epoch: int, lo: int, hi: int) -> None:
        """Queues the training step of global batch [lo, hi) of ``epoch``."""
        npred = (hi - lo) * (1 + self.tr.cfg.train.num_neg)
        self._set(start=lo, stop=hi, stream=epoch, npred=float(npred))
        self.train_graph()
        if self.fixed:
            self.tr.timeline.lap("step")

    def take_loss(self) -> float:
        """The summed mean losses of the steps since the last call (waits for them)."""
        value = float(self.loss_sum)
        self.loss_sum.zero_()
        return value

    def _negatives(self, split: str) -> torch.Tensor:
        """(n, width) evaluation negatives of a split, drawn once and kept (they are fixed
        by the seed): the protocol columns, then the MRR negatives."""
        if split not in self._neg_cache:
            protocols = self.split_protocols(split)
            self._neg_cache[split] = self.tr.data.eval_negative_table(
                split, protocols, len(protocols)
            )
        return self._neg_cache[split]

    def evaluate(self, split: str) -> EvalResult:
        """Walks a split through the evaluation step; returns all scores."""
        tr, d = self.tr, self.tr.data
        lo, hi = d.ranges[split]
        b, q = tr.cfg.train.batch_size, d.mrr_width(split)
        negs = self._negatives(split)
        neg_table, scores_out, graph = self.eval_graph(split)
        neg_table[: hi - lo].copy_(negs)
        self._set(split_lo=lo, stream=EVAL_STREAM[split])
        bar = tr.progress_bar(split, hi - lo)
        for start in range(lo, hi, b):
            self._set(start=start, stop=min(start + b, hi))
            graph()
            bar.update(min(start + b, hi) - start)
        bar.close()
        scores = scores_out[: hi - lo].cpu()
        protocols = self.split_protocols(split)
        n_p = len(protocols)
        valid = None
        if q:
            # Fixed by the seed like the negatives: TGB's filter runs once per split.
            if split not in self._valid_cache:
                idx = torch.arange(lo, hi, device=tr.device)
                self._valid_cache[split] = d.mrr_valid(split, idx, negs[:, n_p:])
            valid = self._valid_cache[split]
        return eval_result(scores, protocols, n_p, q, valid)
