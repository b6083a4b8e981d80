"""The one training and evaluation step, for every world size, and its CUDA-graph capture.

``train_step`` and ``eval_step`` take their components explicitly (model, optimizer,
exchange, batch) and keep nothing between calls: the trainer's loop owns epochs,
logging and checkpoints. :class:`Step` drives them for one rank:

    select (the rank's share of a global batch, padded to a static capacity)
    -> negatives -> sample -> dedupe into fixed slots -> exchange.plan (ids to owners)
    -> exchange.fetch (rows back) -> forward / backward -> exchange.push (write-back,
    on a side stream) -> gradient all-reduce (one flat bucket) -> optimizer -> join.

One process without a process group is the same step with a trivial exchange
(:class:`~sven.pipeline.exchange.LocalExchange`); P ranks, or one rank under a
launcher, use :class:`~sven.pipeline.exchange.FixedExchange`, whose collectives have
fixed split sizes. On a padded, fixed-capacity batch nothing in the step synchronises
with the host and no shape depends on the data, so :class:`StepGraph` captures the
whole of it, collectives included, as one CUDA graph and replays it, which removes the
per-kernel launch cost that bounds a small temporal-GNN step.

The pipeline (``pipeline.*``): with prefetch depth D the batch of step i + D (its
selection, sampling, de-duplication and id exchange, none of which reads memory or
parameters) is built on a side stream during step i into a ring of D + 1 batches (one
captured graph per ring position); with m micro-batches a share is split into m parts
that read the memory of one fetch and sum their gradients; the write-back of batch i
overlaps its backward, all-reduce and optimizer (staleness 0), or is committed after
batch i + 1's read (staleness 1). Staleness 0 gives the synchronous result for every D
and m.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from sven.engine.components import EVAL_STREAM, EvalResult, eval_result
from sven.engine.startup import set_deterministic
from sven.models import MemoryModel, MemoryState
from sven.models.base import ModelOutput
from sven.models.memory import DenseUpdate, MemoryRows
from sven.pipeline.batch import Batch
from sven.pipeline.dedupe import dedupe_fixed
from sven.pipeline.eval_negatives import protocol_order
from sven.pipeline.exchange import (
    Capacities,
    FetchPlan,
    FixedExchange,
    LocalExchange,
    read_occurrences,
)

if TYPE_CHECKING:
    from sven.distributed.grads import GradBucket

__all__ = [
    "Step",
    "StepGraph",
    "StepInput",
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
    # sven.engine.startup's setter: torch's own imports its compiler at the first step.
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
    # BCE with logits is softplus(-x) against label 1 and softplus(x) against label 0:
    # one softplus over both columns, a few kernels each way where two general BCE
    # losses (label fills, stable log-sum-exp) ran about 28 in a step bound by its
    # kernel count. softplus returns x itself past x = 20, where log1p(exp(-x)) < 3e-9.
    loss = F.softplus(torch.cat([-out.pos[:, None], out.neg], 1))
    if valid is not None:
        # A product, not indexing: padded rows are finite (they repeat a real event),
        # and the shape stays fixed.
        loss = loss * valid.to(loss.dtype)[:, None]
    return loss.sum()


@dataclass
class StepInput:
    """One rank's share of a global batch, built (and its ids planned) before its step.

    Attributes:
        micro: The m micro-batches of the share (one when not split).
        plan: Where the rows come from: the exchange's plan of the share's distinct
            nodes (several ranks), their ids (one process), or None (``micro[0]``
            is fetched as it is).
        at: Per micro-batch, (U_j,) positions of its nodes among the planned nodes, or
            None when there is one micro-batch.
    """

    micro: list[Batch]
    plan: FetchPlan | torch.Tensor | None = None
    at: list[torch.Tensor] | None = None


def train_step(
    model: MemoryModel,
    optimizer: torch.optim.Optimizer,
    exchange: LocalExchange | FixedExchange | MemoryState,
    batch: Batch | StepInput,
    num_predictions: float | torch.Tensor,
    lap: Callable[[str], None] | None = None,
    *,
    grads: GradBucket | None = None,
    vote: torch.Tensor | None = None,
) -> torch.Tensor:
    """One optimisation step of one rank: read, forward, backward, all-reduce, step,
    write back.

    Args:
        model: The model (put in training mode here).
        optimizer: Its optimizer.
        exchange: Where memory rows come from and go to (a ``MemoryState`` is the
            whole memory of one process).
        batch: The rank's share of the batch, or its micro-batches with their plan;
            padded events (``batch.valid``) count for nothing.
        num_predictions: Predictions of the whole global batch's real events,
            B * (1 + n); a float or a 0-d device tensor. Every rank divides by it, so
            the ranks' gradients sum to the one-process gradient.
        lap: Called with the name of each stage as it ends (``row_fetch``,
            ``compute``, ``grad_allreduce``, ``optimizer``, ``write_back``;
            :class:`sven.engine.timeline.Timeline`); None inside a captured graph, which a
            lap would break.
        grads: The gradient bucket on several ranks (None: gradients stay local).
        vote: () this rank's stop vote, summed with the gradients (with ``grads``).

    Returns:
        () the global batch's mean loss (summed over ranks), detached, on the device
        (not read back).
    """
    lap = lap or _no_lap
    ex = LocalExchange(exchange) if isinstance(exchange, MemoryState) else exchange
    inp = batch if isinstance(batch, StepInput) else StepInput([batch])
    model.train()
    if grads is None:
        optimizer.zero_grad(set_to_none=True)
    else:
        grads.zero()
    fetched = ex.fetch(inp.plan if inp.plan is not None else inp.micro[0], "train")
    lap("row_fetch")
    loss_sum: torch.Tensor | float = 0.0
    dense: list[DenseUpdate] = []
    last = len(inp.micro) - 1
    for j, mb in enumerate(inp.micro):
        rows = fetched if inp.at is None else _take_rows(fetched, inp.at[j])
        if rows.node_feat is not None:
            # A copy of the batch: the built one stays as built (a prefetch ring
            # refills it in place).
            mb = dataclasses.replace(mb, node_feat=rows.node_feat)
        out = model(mb, rows)
        loss = masked_bce(out, mb.valid) / num_predictions
        dense.append(out.dense)
        if j == last:
            # The write-back needs only the forward's detached values: it goes out now
            # and overlaps the backward, the all-reduce and the optimizer.
            ex.push(dense[0] if len(dense) == 1 else _cat_dense(dense), "train")
            lap("write_back")
        loss.backward()
        loss_sum = loss.detach() if j == 0 else loss_sum + loss.detach()
    lap("compute")
    total = torch.as_tensor(loss_sum)
    if grads is not None:
        if vote is None:
            vote = torch.zeros((), dtype=grads.flat.dtype, device=grads.flat.device)
        total, _ = grads.all_reduce(total, vote)
        lap("grad_allreduce")
    optimizer.step()
    lap("optimizer")
    ex.wait()
    lap("write_back")
    return total.detach()


def _fields(obj: object) -> list[Any]:
    # Not dataclasses.astuple: it deep-copies every tensor.
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]


def _take_rows(rows: MemoryRows, at: torch.Tensor) -> MemoryRows:
    return MemoryRows(*[None if x is None else x[at] for x in _fields(rows)])


def _cat_dense(parts: list[DenseUpdate]) -> DenseUpdate:
    """The micro-batches' write-back candidates as one batch's (a node written by
    several micro-batches keeps its last event's row: the keys decide)."""
    return DenseUpdate(*[torch.cat(col) for col in zip(*[_fields(p) for p in parts])])


def _no_lap(stage: str) -> None:
    pass


@torch.no_grad()
def eval_step(
    model: MemoryModel,
    exchange: LocalExchange | FixedExchange | MemoryState,
    batch: Batch,
    *,
    plan: FetchPlan | torch.Tensor | None = None,
    mode: str = "eval",
) -> ModelOutput:
    """Scores a batch without gradients and writes its memory update (synchronously).

    Args:
        model: The model (put in evaluation mode here).
        exchange: Where memory rows come from and go to (a ``MemoryState``: the whole
            memory of one process).
        batch: The batch.
        plan: Its rows' plan, made beforehand (:class:`StepInput`), or None.
        mode: Whose exchange capacities (an evaluation width's).

    Returns:
        The model output (logits of every slot, padded ones included).
    """
    ex = LocalExchange(exchange) if isinstance(exchange, MemoryState) else exchange
    model.eval()
    rows = ex.fetch(batch if plan is None else plan, mode)
    if rows.node_feat is not None:
        batch = dataclasses.replace(batch, node_feat=rows.node_feat)
    out = model(batch, rows)
    ex.push(out.dense, mode)
    ex.wait()
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


def _copy_tree(dst: Any, src: Any) -> None:
    """Copies a built batch (dataclasses, lists and tensors) into one of the same
    shapes, in place: one multi-tensor copy per dtype and device, a few kernels where a
    copy per tensor was one each (27 in TGN's prefetched step)."""
    groups: dict[tuple[torch.dtype, torch.device], tuple[list, list]] = {}
    for a, b in _tensor_pairs(dst, src):
        to, frm = groups.setdefault((a.dtype, a.device), ([], []))
        to.append(a)
        frm.append(b)
    for to, frm in groups.values():
        torch._foreach_copy_(to, frm)


def _tensor_pairs(dst: Any, src: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The tensors of two trees of the same structure, pairwise (None leaves skipped)."""
    if isinstance(dst, torch.Tensor):
        yield dst, src
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src, strict=True):
            yield from _tensor_pairs(a, b)
    elif dataclasses.is_dataclass(dst) and not isinstance(dst, type):
        for a, b in zip(_fields(dst), _fields(src), strict=True):
            yield from _tensor_pairs(a, b)


def _batch_bounds(lo: int, hi: int, b: int, i: int) -> tuple[int, int]:
    """Events of batch i of size b in [lo, hi) (empty past ``hi``)."""
    return min(lo + i * b, hi), min(lo + (i + 1) * b, hi)


def _tree_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tree_tensors(x)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for x in _fields(obj) for t in _tree_tensors(x)]
    return []


class Step:
    """The step of one rank, for every world size: its inputs, its captured graphs, and
    the epoch-level calls the trainer makes (train a batch, evaluate a split).

    On CUDA, and on CPU with a process group, every batch has a static capacity (a
    rank's share of a global batch padded to the largest share of any batch) and its
    inputs (event range, random stream, prediction count, stop vote) live in 0-d device
    tensors refilled in place, so one captured graph per prefetch-ring position serves
    every training batch and one more every evaluation batch. On CPU without a process
    group the same functions run eagerly on exact-size batches (``torch.unique``
    de-duplication, which computes less than fixed slots there).

    Args:
        cfg: The run's config (``train``, ``eval``, ``pipeline``, ``dist`` sections).
        data: The run's :class:`~sven.engine.components.Data` (event tables, splits, owners).
        model: The model.
        optimizer: Its optimizer.
        memory: This rank's memory (the whole memory on one process).
        exchange: The exchange (trivial on one process without a process group).
        grads: The gradient bucket (several ranks or a launcher), or None.
        plan_group: Process group of prefetched id exchanges (its own communicator:
            they run on a side stream beside the step's collectives), or None.
        timeline: The rank's :class:`~sven.engine.timeline.Timeline`.
        log: Where notices go.
        progress: ``progress(split, events)`` -> a bar with ``update(n)`` and
            ``close()`` for an evaluation pass, or None for none.
    """

    def __init__(
        self,
        *,
        cfg: Any,
        data: Any,
        model: MemoryModel,
        optimizer: torch.optim.Optimizer,
        memory: MemoryState,
        exchange: LocalExchange | FixedExchange,
        grads: GradBucket | None,
        plan_group: Any,
        timeline: Any,
        log: Callable[[str], None],
        progress: Callable[[str, int], Any] | None = None,
    ) -> None:
        tc, pc, dev = cfg.train, cfg.pipeline, data.device
        self.cfg, self.data, self.model_ref = cfg, data, model
        self.optimizer, self.memory, self.exchange = optimizer, memory, exchange
        self.grads, self.plan_group, self.timeline = grads, plan_group, timeline
        self.device = dev
        self.tables = data.tables
        self.distributed = exchange.distributed
        self.fixed = dev.type == "cuda" or self.distributed
        self.rank, self.world_size = data.rank, data.world_size
        self.model: Any = model
        if tc.compile and dev.type == "cuda":
            from sven.pipeline.negatives import register_compiled_ops

            register_compiled_ops()
            # Fixed shapes: one compilation per mode (train, eval) serves every batch.
            # The batch selection stays eager (its hashes are Triton kernels already).
            self.model = torch.compile(model, dynamic=False)
        elif tc.compile:
            log("sven: train.compile applies on CUDA; the CPU step runs eagerly")
        self.order: torch.Tensor | None = None
        self._order_host: np.ndarray | None = None
        if self.distributed:
            self._rank_events(data)
            self.capacity: int | None = self._share_capacity(data, tc.batch_size)
        else:
            self.capacity = tc.batch_size if self.fixed else None
        # The pipeline's knobs act on fixed-shape steps (an exact-size eager step has
        # nothing to overlap and a share of no fixed size to split).
        self.depth = int(pc.prefetch) if self.fixed else 0
        m = 1 if pc.micro_batches == "auto" else int(pc.micro_batches)
        if not self.fixed or self.capacity is None:
            m = 1
        self.micro_batches = max(1, min(m, self.capacity or 1))
        self.staleness = pc.staleness if self.distributed else 0
        # The current batch's inputs (with its prediction count) and those of the
        # training and evaluation batches built ahead.
        self.inp = self._batch_inputs()
        self.inp["npred"] = torch.ones((), dtype=torch.float64, device=dev) if self.fixed else 1.0
        self.ahead = self._batch_inputs()
        fdt = memory.dtype
        self.vote = torch.zeros((), dtype=fdt, device=dev)
        #: [summed stop votes, fetch overflow, push overflow] of the last step, on the
        #: device; read (one step late on CUDA) by :meth:`status`.
        self._status = torch.zeros(3, dtype=torch.float64, device=dev)
        pin = dev.type == "cuda"
        # Two host copies on CUDA: step i's lands while step i - 1's is read.
        self._status_host = [torch.zeros(3, dtype=torch.float64, pin_memory=pin) for _ in "ab"]
        self._status_events: list[Any] = [None, None]
        self._steps = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        # Evaluation negatives: one column per protocol the split reports (test: all of
        # them, with eval.all_protocols), then the MRR negatives; drawn once per split
        # into a table the captured step reads. One graph per width: scoring val at
        # test's width would score columns no metric reads.
        ec = cfg.eval
        self.protocols = protocol_order(ec.negatives, ec.all_protocols)
        self._neg_cache: dict[str, torch.Tensor] = {}
        self._evals: dict[int, tuple[torch.Tensor, torch.Tensor, list[StepGraph]]] = {}
        self._ring: list[StepInput | None] = [None] * (self.depth + 1)
        # The evaluation's prefetch ring, one per width (its batches have that width's
        # negatives), and the inputs of the batch it builds ahead.
        self._eval_rings: dict[int, list[StepInput | None]] = {}
        self.eval_ahead = self._batch_inputs()
        self._side: Any = None
        if self.fixed and dev.type == "cuda" and self.depth:
            self._side = torch.cuda.Stream(dev)
        self._log = log
        self.progress = progress or (lambda split, n: _NoBar())

        def state() -> list[torch.Tensor]:
            ring = [t for item in self._ring for t in _tree_tensors(item)]
            return (
                [p.data for p in model.parameters()]
                + list(memory.full.values())
                + exchange.state_tensors()
                + [self.loss_sum, self._status, *ring]
                + ([grads.flat] if grads is not None else [])
            )

        self.train_graphs = [
            StepGraph(
                self._train_fn(k),
                mode=tc.cuda_graph,
                device=dev,
                state=state,
                optimizer=optimizer,
                log=log,
            )
            for k in range(self.depth + 1)
        ]

    # ------------------------------------------------------------- layout
    def _rank_events(self, data: Any) -> None:
        """This rank's events in time order (every split), and a filler entry."""
        mine = (data.assign == self.rank).nonzero().squeeze(1)
        self._order_host = mine.cpu().numpy()
        filler = mine[-1:] if mine.numel() else mine.new_zeros(1)
        self.order = torch.cat([mine, filler])

    def _share_capacity(self, data: Any, b: int) -> int:
        """The largest share any rank has of any global batch of any split (from the
        assignment, which every rank holds: the same number everywhere)."""
        assign = data.assign.cpu().numpy()
        p, most = self.world_size, 1
        for lo, hi in data.ranges.values():
            if hi <= lo:
                continue
            batch = (np.arange(lo, hi) - lo) // b
            per = np.bincount(batch * p + assign[lo:hi], minlength=(batch[-1] + 1) * p)
            most = max(most, int(per.max()))
        return most

    def _share(self, g_lo: int, g_hi: int) -> tuple[int, int]:
        """Where a global batch's share of this rank lies in ``order``."""
        if self._order_host is None:
            return g_lo, g_hi
        a, z = np.searchsorted(self._order_host, [g_lo, g_hi])
        return int(a), int(z)

    @property
    def train_graph(self) -> StepGraph:
        """The training graph of the first ring position (tests read ``captured``)."""
        return self.train_graphs[0]

    # ------------------------------------------------------------- inputs
    def _batch_inputs(self) -> dict[str, Any]:
        """A batch's inputs (its share's range in ``order``, global start, random
        stream, split start): 0-d device tensors refilled in place on the fixed step,
        which a captured graph reads, plain numbers on the exact-size one."""
        names = ("start", "stop", "gstart", "stream", "split_lo")
        if self.fixed:
            return {k: torch.zeros((), dtype=torch.int64, device=self.device) for k in names}
        return dict.fromkeys(names, 0)

    def _fill(self, target: dict[str, Any], **values: float) -> None:
        for k, v in values.items():
            if self.fixed:
                target[k].fill_(v)
            else:
                target[k] = v

    def _set_batch(self, target: dict[str, Any], g_lo: int, g_hi: int, stream: int) -> None:
        lo, hi = self._share(g_lo, g_hi)
        self._fill(target, start=lo, stop=hi, gstart=g_lo, stream=stream)

    def _determinism(self) -> contextlib.AbstractContextManager[None]:
        """The CUDA step runs with torch's deterministic mode off, the CPU step with it
        on but without the fill of new tensors (both: see the functions)."""
        return torch_determinism_off() if self.device.type == "cuda" else no_uninitialized_fill()

    # -------------------------------------------------------------- build
    def _select(
        self,
        inp: dict[str, Any],
        num_neg: int,
        start: Any,
        stop: Any,
        capacity: int | None,
        neg_table: torch.Tensor | None = None,
    ) -> Batch:
        from sven.pipeline.stages import select_batch

        return select_batch(
            self.tables,
            start,
            stop,
            inp["stream"],
            seed=self.cfg.train.seed,
            num_neg=num_neg,
            sample_roots=self.model_ref.sample_roots,
            read_neighbors=self.model_ref.read_neighbors,
            capacity=capacity,
            neg_table=neg_table,
            table_lo=inp["split_lo"],
            order=self.order,
            batch_start=inp["gstart"],
        )

    def _select_share(
        self, inp: dict[str, Any], num_neg: int, neg_table: torch.Tensor | None, micro: int
    ) -> list[Batch]:
        """The share named by ``inp``, whole or as ``micro`` parts of equal capacity
        that its events fill in order."""
        start, stop = inp["start"], inp["stop"]
        if micro == 1:
            return [self._select(inp, num_neg, start, stop, self.capacity, neg_table)]
        c = -(-self.capacity // micro)
        return [
            self._select(
                inp,
                num_neg,
                torch.minimum(start + j * c, stop),
                torch.minimum(start + (j + 1) * c, stop),
                c,
                neg_table,
            )
            for j in range(micro)
        ]

    def _build(
        self,
        inp: dict[str, Any],
        num_neg: int,
        mode: str,
        neg_table: torch.Tensor | None = None,
        micro: int = 1,
        group: Any = None,
        lap: Callable[[str], None] | None = None,
    ) -> StepInput:
        """A share's micro-batches and the plan of its rows (reads no memory); ``lap``
        ends the ``sample`` and ``id_exchange`` stages (eager runs)."""
        lap = lap or _no_lap
        batches = self._select_share(inp, num_neg, neg_table, micro)
        lap("sample")
        if not self.distributed and micro == 1:
            return StepInput(batches)
        at = None
        if micro == 1:
            nodes, occ = batches[0].nodes, read_occurrences(batches[0])
        else:
            # One fetch for the whole share: each node is read once, by whichever
            # micro-batch needs it, so the bytes are those of the unsplit share.
            cat = torch.cat([mb.nodes for mb in batches])
            nodes, inverse = dedupe_fixed(cat, self.tables.num_nodes)
            at = list(torch.split(inverse, [mb.nodes.shape[0] for mb in batches]))
            occ = torch.zeros_like(nodes)
            for mb, pos in zip(batches, at):
                occ.index_add_(0, pos, read_occurrences(mb))
        if not self.distributed:
            return StepInput(batches, nodes, at)
        plan = self.exchange.plan(nodes, occ, mode, group=group)
        lap("id_exchange")
        return StepInput(batches, plan, at)

    def _put(self, k: int, item: StepInput, ring: list[StepInput | None] | None = None) -> None:
        """Stores a built batch in position k of a ring (the training one by default),
        in place once the position exists, so that a captured graph finds it where it
        was."""
        ring = self._ring if ring is None else ring
        if ring[k] is None or not self.fixed:
            ring[k] = item
        else:
            _copy_tree(ring[k], item)

    def _build_ahead(
        self, k: int, ring: list[StepInput | None], build: Callable[[], StepInput]
    ) -> StepInput:
        """Builds the batch D ahead of ring position k into its position, on the side
        stream, and returns position k's batch (built D steps before)."""
        d = self.depth
        with self._ahead_stream():
            self._put((k + d) % (d + 1), build(), ring)
        return ring[k]  # type: ignore[return-value]

    def _fill_ring(
        self,
        ring: list[StepInput | None],
        inputs: dict[str, Any],
        first: int,
        bounds: Callable[[int], tuple[int, int]],
        stream: int,
        build: Callable[[], StepInput],
    ) -> None:
        """Builds batches ``first..first + D`` (batch i's global events ``bounds(i)``)
        into ring positions i mod (D + 1): every position, the one the step of
        ``first`` builds too, so that the ring has all its tensors before a graph is
        captured."""
        d = self.depth
        with self._determinism():
            for i in range(first, first + d + 1):
                self._set_batch(inputs, *bounds(i), stream)
                self._put(i % (d + 1), build(), ring)

    @contextlib.contextmanager
    def _ahead_stream(self) -> Iterator[None]:
        """Where a batch ahead is built: on CUDA a side stream that starts after the
        work queued so far (it reads no memory or parameter, so it runs beside the
        step's compute); elsewhere the current stream."""
        if self._side is None:
            yield
            return
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            yield

    # -------------------------------------------------------------- steps
    def _train_fn(self, k: int) -> Callable[[], None]:
        d, tc = self.depth, self.cfg.train

        def fn() -> None:
            with self._determinism():
                lap = None if self.device.type == "cuda" else self.timeline.lap
                if d == 0:
                    item = self._build(
                        self.inp, tc.num_neg, "train", micro=self.micro_batches, lap=lap
                    )
                else:
                    item = self._build_ahead(k, self._ring, lambda: self._build_train(lap))
                loss = train_step(
                    self.model,
                    self.optimizer,
                    self.exchange,
                    item,
                    self.inp["npred"],
                    lap=lap,
                    grads=self.grads,
                    vote=self.vote,
                )
                self.loss_sum += loss
                if self.grads is not None:
                    n = self.grads.numel
                    ov = self.exchange.overflow.to(torch.float64)
                    self._status.copy_(torch.cat([self.grads.flat[n + 1 : n + 2].double(), ov]))
                if d and self._side is not None:
                    torch.cuda.current_stream().wait_stream(self._side)

        return fn

    def _build_train(self, lap: Callable[[str], None] | None = None) -> StepInput:
        """The training batch named by ``ahead``, built ahead of its step."""
        return self._build(
            self.ahead,
            self.cfg.train.num_neg,
            "train",
            micro=self.micro_batches,
            group=self.plan_group,
            lap=lap,
        )

    def start_epoch(self, epoch: int, first: int, last: int) -> None:
        """Builds the first D + 1 batches of ``first..last - 1`` into the prefetch ring."""
        if self.depth:
            self._fill_ring(self._ring, self.ahead, first, self._global, epoch, self._build_train)

    def _global(self, i: int) -> tuple[int, int]:
        """Global event range of training batch i (empty past the split's end)."""
        return _batch_bounds(*self.data.ranges["train"], self.cfg.train.batch_size, i)

    def train_batch(self, epoch: int, i: int, g_lo: int, g_hi: int, stop_vote: int = 0) -> None:
        """Queues the training step of global batch [g_lo, g_hi) (batch ``i``)."""
        npred = (g_hi - g_lo) * (1 + self.cfg.train.num_neg)
        self._set_batch(self.inp, g_lo, g_hi, epoch)
        self._fill(self.inp, npred=float(npred))
        if self.grads is not None:
            self.vote.fill_(float(stop_vote))
        d = self.depth
        if d:
            self._set_batch(self.ahead, *self._global(i + d), epoch)
        self.train_graphs[i % (d + 1)]()
        self._steps += 1
        if self.device.type == "cuda":
            self.timeline.lap("step")
            if self.grads is not None:
                k = self._steps % 2
                self._status_host[k].copy_(self._status, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                self._status_events[k] = ev

    def status(self) -> tuple[int, int, int]:
        """(summed stop votes, fetch overflow, push overflow) of a finished step: on CPU
        the step just run; on CUDA the one before it (read without waiting for the
        step in flight). (0, 0, 0) without a gradient bucket."""
        if self.grads is None:
            return 0, 0, 0
        if self.device.type == "cuda":
            k = (self._steps - 1) % 2
            ev = self._status_events[k]
            if ev is None:
                return 0, 0, 0
            ev.synchronize()
            vals = self._status_host[k].tolist()
            self._status_events[k] = None
        else:
            vals = self._status.tolist()
        return round(vals[0]), int(vals[1]), int(vals[2])

    def take_loss(self) -> float:
        """The summed mean losses of the steps since the last call (waits for them);
        also stops the run if a batch overflowed a capacity, and commits a write-back
        held for staleness 1 (a drained boundary)."""
        value = float(self.loss_sum)
        self.loss_sum.zero_()
        self.exchange.check()
        self.exchange.flush()
        return value

    # ------------------------------------------------------------- capacities
    @torch.no_grad()
    def measure(
        self,
        split: str,
        stream: int,
        num_neg: int,
        neg_table: torch.Tensor | None = None,
        micro: int = 1,
    ) -> tuple[list[int], list[int]]:
        """This rank's most rows requested from / written to each rank in any batch of
        a split, by an exact replay of the step's own batch construction.

        Returns:
            (fetch (P,), push (P,)) per-peer maxima (0 towards itself).
        """
        lo, hi = self.data.ranges[split]
        return self.measure_range(lo, hi, stream, num_neg, neg_table, micro)

    @torch.no_grad()
    def measure_range(
        self,
        lo: int,
        hi: int,
        stream: int,
        num_neg: int,
        neg_table: torch.Tensor | None = None,
        micro: int = 1,
    ) -> tuple[list[int], list[int]]:
        """:meth:`measure` over the global batches of events [lo, hi) from ``lo``."""
        p, r = self.world_size, self.rank
        fetch = torch.zeros(p, dtype=torch.int64, device=self.device)
        push = torch.zeros(p, dtype=torch.int64, device=self.device)
        b = self.cfg.train.batch_size
        owner = self.exchange._owner_ext
        inp = {k: v.clone() for k, v in self.ahead.items()}
        self._fill(inp, split_lo=lo, stream=stream)
        with self._determinism():
            for start in range(lo, hi, b):
                self._set_batch(inp, start, min(start + b, hi), stream)
                reads, writes = [], []
                for mb in self._select_share(inp, num_neg, neg_table, micro):
                    reads.append(mb.nodes[read_occurrences(mb) > 0])
                    zeros = torch.zeros(mb.size, 1, dtype=self.memory.dtype, device=self.device)
                    recv, _, _, keys = self.model_ref.mail_receivers(mb, zeros, zeros)
                    writes.append(recv[keys >= 0])
                for ids, acc in ((reads, fetch), (writes, push)):
                    own = owner[torch.unique(torch.cat(ids))]
                    cnt = torch.bincount(own[own != r], minlength=p + 1)[:p]
                    torch.maximum(acc, cnt, out=acc)
        fetch[r] = push[r] = 0
        return fetch.tolist(), push.tolist()

    def _gather_matrix(self, row: list[int]) -> list[list[int]]:
        import torch.distributed as dist

        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        allr = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(allr, mine, group=self.exchange.group)
        return torch.stack(allr).tolist()

    def _replayed(self, counts: Callable[[], tuple[list[int], list[int]]]) -> Capacities:
        """Capacities from this rank's replayed per-peer maxima (``counts()``, run only
        where there are peers), gathered into P x P matrices on every rank."""
        if self.world_size == 1:
            return Capacities(self.capacity or 0, [[0]], [[0]])
        f, w = counts()
        return Capacities(self.capacity, self._gather_matrix(f), self._gather_matrix(w))

    def plan_capacities(self, epoch: int) -> Capacities:
        """Sets the training capacities from an exact replay of ``epoch``, grown by
        ``dist.capacity_slack`` for later epochs (whose draws differ)."""
        if not self.distributed:
            return Capacities(self.capacity or 0, [[0]], [[0]])
        caps = self._replayed(
            lambda: self.measure("train", epoch, self.cfg.train.num_neg, micro=self.micro_batches)
        )
        if self.world_size > 1:
            caps = caps.grown(self.cfg.dist.capacity_slack)
        self.exchange.set_capacities("train", caps)
        return caps

    def _plan_eval_capacities(self, w: int) -> None:
        """The capacities of the evaluation step of width ``w``, exact: its negatives
        are fixed by the seed (a replay of every split of that width)."""
        if not self.distributed:
            return

        def counts() -> tuple[list[int], list[int]]:
            f, wr = [0] * self.world_size, [0] * self.world_size
            neg_table = self._evals[w][0]
            for split, (lo, hi) in self.data.ranges.items():
                if split == "train" or hi <= lo or self.split_width(split) != w:
                    continue
                neg_table[: hi - lo].copy_(self._negatives(split))
                fs, ws = self.measure(split, EVAL_STREAM[split], w, neg_table)
                f = [max(a, c) for a, c in zip(f, fs)]
                wr = [max(a, c) for a, c in zip(wr, ws)]
            return f, wr

        self.exchange.set_capacities(f"eval{w}", self._replayed(counts))

    # ------------------------------------------------------------ encode
    @torch.no_grad()
    def encode(self, lo: int, hi: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Walks events [lo, hi) through the model's encoder without gradients,
        committing memory, in global batches of ``train.batch_size`` from ``lo``
        (evaluation's layout): the same selection, exchange and write-back as the step,
        eagerly (a replay for predictions and node classification).

        On several ranks each rank encodes its share, so every rank must call it with
        the same range; the capacities of the range's batches come from its replay.

        Returns:
            This rank's real events (n,) int64 and the embeddings (n, embed_dim) of
            their sources at their times, from the memory before the batch.
        """
        mode = f"encode{lo}-{hi}-{stream}"
        if self.distributed and mode not in self.exchange.capacities:
            caps = self._replayed(lambda: self.measure_range(lo, hi, stream, 0))
            self.exchange.set_capacities(mode, caps)
        model = self.model_ref
        model.eval()
        b = self.cfg.train.batch_size
        inp = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.inp.items()}
        self._fill(inp, split_lo=lo, stream=stream)
        idx_all, h_all = [], []
        self.exchange.flush()
        with self._determinism():
            for start in range(lo, hi, b):
                self._set_batch(inp, start, min(start + b, hi), stream)
                item = self._build(inp, 0, mode)
                batch = item.micro[0]
                rows = self.exchange.fetch(item.plan if item.plan is not None else batch, mode)
                if rows.node_feat is not None:
                    batch = dataclasses.replace(batch, node_feat=rows.node_feat)
                h, dense = model.encode(batch, rows)
                self.exchange.push(dense, mode)
                self.exchange.wait()
                h = h[: batch.size]
                if batch.valid is not None:
                    idx_all.append(batch.index[batch.valid])
                    h_all.append(h[batch.valid])
                else:
                    idx_all.append(batch.index)
                    h_all.append(h)
        self.exchange.check()
        if not idx_all:
            empty = torch.zeros(0, model.embed_dim, dtype=self.memory.dtype, device=self.device)
            return torch.zeros(0, dtype=torch.int64, device=self.device), empty
        return torch.cat(idx_all), torch.cat(h_all)

    # -------------------------------------------------------------- eval
    def _eval_fn(
        self, k: int, neg_table: torch.Tensor, scores_out: torch.Tensor
    ) -> Callable[[], None]:
        """The evaluation step of ring position k at the width of ``neg_table``: with
        prefetch depth D it builds the batch D ahead on the side stream into the
        width's ring, as the training step does, and scores the one built before."""
        d, w = self.depth, neg_table.shape[1]
        mode = f"eval{w}"
        build = functools.partial(self._build_eval, neg_table)

        def fn() -> None:
            with self._determinism():
                if d == 0:
                    item = self._build(self.inp, w, mode, neg_table)
                else:
                    item = self._build_ahead(k, self._eval_rings[w], build)
                batch = item.micro[0]
                out = eval_step(self.model, self.exchange, batch, plan=item.plan, mode=mode)
                scores = torch.cat([out.pos[:, None], out.neg], 1).to(scores_out.dtype)
                rows = batch.index - self.inp["split_lo"]
                if batch.valid is not None:
                    rows = torch.where(batch.valid, rows, scores_out.shape[0] - 1)
                # Padded events all write the scratch row; real ones distinct rows.
                scores_out.index_copy_(0, rows, scores)
                if d and self._side is not None:
                    torch.cuda.current_stream().wait_stream(self._side)

        return fn

    def _build_eval(self, neg_table: torch.Tensor) -> StepInput:
        """The evaluation batch named by ``eval_ahead`` at the width of ``neg_table``,
        built ahead of its step."""
        w = neg_table.shape[1]
        return self._build(self.eval_ahead, w, f"eval{w}", neg_table, group=self.plan_group)

    def split_protocols(self, split: str) -> list[str]:
        """The protocols ``split`` scores: all on test, ``eval.negatives`` elsewhere."""
        return self.protocols if split == "test" else self.protocols[:1]

    def split_width(self, split: str) -> int:
        """Negatives scored per event of ``split``: its protocols, then the MRR ones."""
        return len(self.split_protocols(split)) + self.data.mrr_negatives

    def eval_graph(self, split: str) -> tuple[torch.Tensor, torch.Tensor, list[StepGraph]]:
        """The negatives table (rows, width), scores (rows, 1 + width) and evaluation
        graphs (one per prefetch-ring position) of ``split``'s width, made at the first
        pass of that width (each split of a width fits its rows, plus a scratch row),
        with its exchange capacities."""
        w = self.split_width(split)
        if w not in self._evals:
            rows = 1 + max(
                hi - lo for s, (lo, hi) in self.data.ranges.items() if self.split_width(s) == w
            )
            dev, fdt = self.device, self.memory.dtype
            neg = torch.zeros(rows, w, dtype=torch.int64, device=dev)
            scores = torch.zeros(rows, 1 + w, dtype=fdt, device=dev)
            ring: list[StepInput | None] = [None] * (self.depth + 1)
            self._eval_rings[w] = ring

            def state() -> list[torch.Tensor]:
                return [
                    *self.memory.full.values(),
                    *self.exchange.state_tensors(),
                    scores,
                    *[t for item in ring for t in _tree_tensors(item)],
                ]

            graphs = [
                StepGraph(
                    self._eval_fn(k, neg, scores),
                    mode=self.cfg.train.cuda_graph,
                    device=dev,
                    state=state,
                    log=self._log,
                )
                for k in range(self.depth + 1)
            ]
            self._evals[w] = (neg, scores, graphs)
            self._plan_eval_capacities(w)
        return self._evals[w]

    def _negatives(self, split: str) -> torch.Tensor:
        """(n, width) evaluation negatives of a split, drawn once and kept (they are fixed
        by the seed): the protocol columns, then the MRR negatives."""
        if split not in self._neg_cache:
            protocols = self.split_protocols(split)
            self._neg_cache[split] = self.data.eval_negative_table(split, protocols, len(protocols))
        return self._neg_cache[split]

    def evaluate(self, split: str) -> EvalResult:
        """Walks a split through the evaluation step (every rank scores its share);
        returns all scores, on every rank."""
        d = self.data
        lo, hi = d.ranges[split]
        b, q = self.cfg.train.batch_size, d.mrr_width(split)
        self.exchange.flush()
        negs = self._negatives(split)
        neg_table, scores_out, graphs = self.eval_graph(split)
        neg_table[: hi - lo].copy_(negs)
        stream, depth, w = EVAL_STREAM[split], self.depth, neg_table.shape[1]
        self._fill(self.inp, split_lo=lo, stream=stream)
        self._fill(self.eval_ahead, split_lo=lo, stream=stream)
        if self.distributed:
            # Each event is scored by one rank; the others' rows stay zero, so a sum
            # over ranks assembles the table.
            scores_out.zero_()

        def bounds(i: int) -> tuple[int, int]:
            return _batch_bounds(lo, hi, b, i)

        if depth:
            build = functools.partial(self._build_eval, neg_table)
            self._fill_ring(self._eval_rings[w], self.eval_ahead, 0, bounds, stream, build)
        bar = self.progress(split, hi - lo)
        for i in range(len(range(lo, hi, b))):
            g_lo, g_hi = bounds(i)
            self._set_batch(self.inp, g_lo, g_hi, stream)
            if depth:
                self._set_batch(self.eval_ahead, *bounds(i + depth), stream)
            graphs[i % (depth + 1)]()
            bar.update(g_hi - g_lo)
        bar.close()
        table = scores_out[: hi - lo]
        if self.distributed and self.world_size > 1:
            import torch.distributed as dist

            table = table.clone()
            dist.all_reduce(table, group=self.exchange.group)
        self.exchange.check()
        scores = table.cpu()
        protocols = self.split_protocols(split)
        n_p = len(protocols)
        valid = None
        if q:
            idx = torch.arange(lo, hi, device=self.device)
            valid = d.mrr_valid(split, idx, negs[:, n_p:])
        return eval_result(scores, protocols, n_p, q, valid)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
