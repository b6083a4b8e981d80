"""The step of one rank, for every world size: its parts, composed once at build time.

:class:`Step` puts together, from the config and the run's components:

* the **batch source** (:mod:`sven.engine.batches`): this rank's share of each global
  batch, padded to a static capacity on a fixed-shape step; its selection, negatives,
  sampling, de-duplication and the plan of its node-state rows;
* the **prefetch ring** of depth D: the batch of step i + D built (on a side stream)
  during step i (:class:`~sven.engine.batches.Ring`, or
  :class:`~sven.engine.batches.Inline` at depth 0);
* the **exchange**, where node state lives: the whole state of one process
  (:class:`~sven.pipeline.exchange.LocalExchange`) or the owners' shards across P ranks
  (:class:`~sven.pipeline.exchange.FixedExchange`); the step's body never knows which;
* the **capture** (:class:`~sven.engine.capture.StepGraph`): one CUDA graph per ring
  position, replayed for every batch;
* the **capacities** of the exchange (:mod:`sven.engine.capacities`);
* **evaluation** (:class:`~sven.engine.evaluation.Evaluation`) on the same parts.

The body of a training step (:func:`~sven.engine.body.train_step`):

    select -> negatives -> sample -> dedupe -> exchange.plan (ids to owners)
    -> exchange.fetch (rows) -> forward / backward -> exchange.push (write-back, on a
    side stream) -> gradient all-reduce (one flat bucket) -> optimizer -> join.

On a padded, fixed-capacity batch nothing in the step synchronises with the host and no
shape depends on the data, so the whole of it, collectives included, is captured. With
m micro-batches a share is split into m parts that read the rows of one fetch and sum
their gradients; the write-back of batch i overlaps its backward, all-reduce and
optimizer (staleness 0), or is committed after batch i + 1's read (staleness 1).
Staleness 0 gives the synchronous result for every D and m.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from sven.engine.batches import BatchInputs, BatchSource, Shares, batch_bounds, ring
from sven.engine.body import StepInput, encode_step, train_step
from sven.engine.capacities import capacity_planner, plan_epoch_slots
from sven.engine.capture import StepGraph, determinism
from sven.engine.evaluation import Evaluation
from sven.engine.spec import RunSpec
from sven.models import MemoryModel, MemoryState
from sven.models.copyahead import CopyAhead, external_events
from sven.pipeline.exchange_api import Exchange
from sven.pipeline.wire import Capacities

if TYPE_CHECKING:
    from sven.distributed.grads import Gradients

__all__ = ["Step", "StepStatus"]


class StepStatus:
    """A finished step's stop votes and exchange overflows, read without stalling.

    Several ranks sum their stop votes in the gradient all-reduce; the summed vote and
    the exchange's overflow flags are recorded on the device inside the step. On CUDA
    they are copied to the host after the step and read one step late (the host never
    waits for the step in flight); on CPU the step just run is read.

    Args:
        device: Where the step runs.
        active: Whether gradients cross ranks (several ranks or a launcher); else the
            status is always (0, 0, 0).
    """

    def __init__(self, device: torch.device, active: bool) -> None:
        self.device, self.active = device, active
        #: [summed stop votes, fetch overflow, push overflow] of the last step, written
        #: by the gradients (:meth:`~sven.distributed.grads.Gradients.record`).
        self.value = torch.zeros(3, dtype=torch.float64, device=device)
        pin = device.type == "cuda"
        # Two host copies on CUDA: step i's lands while step i - 1's is read.
        self._host = [torch.zeros(3, dtype=torch.float64, pin_memory=pin) for _ in "ab"]
        self._events: list[Any] = [None, None]
        self.steps = 0

    def after_step(self) -> None:
        """After a step was queued: on CUDA its status starts on its way to the host."""
        self.steps += 1
        if self.device.type != "cuda" or not self.active:
            return
        k = self.steps % 2
        self._host[k].copy_(self.value, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[k] = ev

    def read(self) -> tuple[int, int, int]:
        """(summed stop votes, fetch overflow, push overflow) of a finished step: on CPU
        the step just run; on CUDA the one before it. (0, 0, 0) when inactive."""
        if not self.active:
            return 0, 0, 0
        if self.device.type == "cuda":
            k = (self.steps - 1) % 2
            ev = self._events[k]
            if ev is None:
                return 0, 0, 0
            ev.synchronize()
            vals = self._host[k].tolist()
            self._events[k] = None
        else:
            vals = self.value.tolist()
        return round(vals[0]), int(vals[1]), int(vals[2])


#: Devices where ``train.compile`` compiles (tests add the CPU, with a cheap backend).
COMPILE_DEVICES = ("cuda",)
#: Torch's compiler backend for ``train.compile`` (tests swap it).
COMPILE_BACKEND: Any = "inductor"


def _compiled(
    model: MemoryModel, compiles: bool, dev: torch.device, log: Callable[[str], None]
) -> Any:
    """The model the training step calls: compiled on CUDA where ``train.compile``
    (:mod:`sven.engine.compiled`: once per machine, with a fallback)."""
    if compiles and dev.type in COMPILE_DEVICES:
        from sven.engine.compiled import CompiledModel, use_compile_cache
        from sven.pipeline.negatives import register_compiled_ops

        # The cache first: registering the ops may make torch set its default one.
        log(f"sven: train.compile: compiled kernels kept in {use_compile_cache(dev)}")
        register_compiled_ops()
        # Fixed shapes: one compilation serves every training batch. The batch
        # selection stays eager (its hashes are Triton kernels already).
        return CompiledModel(model, log, backend=COMPILE_BACKEND)
    if compiles:
        log("sven: train.compile applies on CUDA; the CPU step runs eagerly")
    return model


class Step:
    """The step of one rank, for every world size: its parts, its captured graphs, and
    the epoch-level calls the run loop makes (train a batch, evaluate a split).

    On CUDA, and on CPU with a process group, every batch has a static capacity and
    its inputs live in 0-d device tensors refilled in place, so one captured graph per
    prefetch-ring position serves every training batch and one more every evaluation
    batch. On CPU without a process group the same functions run eagerly on exact-size
    batches (``torch.unique`` de-duplication, which computes less than fixed slots
    there).

    Args:
        cfg: The run's config (``train``, ``eval``, ``dist`` sections).
        spec: How the run runs (:class:`~sven.engine.spec.RunSpec`: fixed shapes, graph
            mode, prefetch depth, micro-batches, staleness), decided once.
        data: The run's :class:`~sven.engine.data.Data` (event tables, splits, owners).
        model: The model.
        optimizer: Its optimizer.
        memory: This rank's node state (the whole state on one process).
        exchange: The exchange (trivial on one process without a process group).
        grads: How gradients are zeroed and summed (the bucket on several ranks or
            under a launcher).
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
        spec: RunSpec,
        data: Any,
        model: MemoryModel,
        optimizer: torch.optim.Optimizer,
        memory: MemoryState,
        exchange: Exchange,
        grads: Gradients,
        plan_group: Any,
        timeline: Any,
        log: Callable[[str], None],
        progress: Callable[[str, int], Any] | None = None,
    ) -> None:
        tc, dev = cfg.train, spec.device
        self.cfg, self.spec, self.data, self.model_ref = cfg, spec, data, model
        self.optimizer, self.memory, self.exchange = optimizer, memory, exchange
        self.grads, self.plan_group, self.timeline = grads, plan_group, timeline
        self.device = dev
        #: Whether batches built ahead read their rows too (:func:`reads_ahead`).
        self.read_ahead = reads_ahead(spec.depth, memory, exchange)
        if self.read_ahead:
            copy = ahead_engine(dev) == "copy"
            memory.track_writes(copy=copy)
            how = (
                "gathered by a host thread and copied over by the copy engine"
                if copy
                else "read on the prefetch stream"
            )
            log(
                f"sven: node state in pinned host memory: a batch's rows are {how}, a "
                "step ahead, and refreshed where written since"
            )
        self.model: Any = _compiled(model, tc.compile, dev, log)
        self.shares = Shares(data, spec)
        # The current batch's inputs (with its prediction count) and those of the
        # training batch built ahead.
        self.inp = BatchInputs(spec.fixed_shapes, dev, extra={"npred": torch.float64})
        self.inp.fill(npred=1.0)
        self.ahead = BatchInputs(spec.fixed_shapes, dev)
        self.source = BatchSource(data.tables, model, tc.seed, self.shares, exchange, spec)
        self.ring = ring(spec.depth, dev, lambda: determinism(dev))
        self.planner = capacity_planner(
            spec, self.source, self.ahead, model, memory.dtype, tc.batch_size
        )
        self.status = StepStatus(dev, grads.crosses_ranks)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        self.evaluation = Evaluation(
            cfg=cfg,
            spec=spec,
            data=data,
            # The model itself: evaluation's no-grad passes would compile it again.
            model=model,
            model_ref=model,
            source=self.source,
            planner=self.planner,
            node_state=self._node_state,
            plan_group=plan_group,
            log=log,
            progress=progress,
        )
        self.train_graphs = self._train_graphs(log)

    # The pipeline's settings, as the run's description resolved them.
    depth = property(lambda self: self.spec.depth, doc="Prefetch depth D.")
    micro_batches = property(lambda self: self.spec.micro_batches, doc="Parts of a share.")
    staleness = property(lambda self: self.spec.staleness, doc="Steps a write-back is held.")
    graph_mode = property(lambda self: self.spec.graph_mode, doc="How the step runs.")
    capacity = property(lambda self: self.spec.capacity, doc="Events of a share, or None.")

    def _train_graphs(self, log: Callable[[str], None]) -> list[StepGraph]:
        """One training graph per prefetch-ring position, over the state a step
        changes (put back after a capture's warm-up)."""

        def state() -> list[torch.Tensor]:
            return (
                [p.data for p in self.model_ref.parameters()]
                + self._node_state()
                + [self.loss_sum, self.status.value, *self.ring.tensors()]
                + self.grads.tensors()
            )

        return [
            StepGraph(
                self._train_fn(k),
                mode=self.graph_mode,
                device=self.device,
                state=state,
                optimizer=self.optimizer,
                log=log,
                quiet=self.memory.writes_to_scratch,
            )
            for k in range(self.depth + 1)
        ]

    def _node_state(self) -> list[torch.Tensor]:
        """The tensors a step changes besides parameters and its own, that a capture's
        warm-up must put back: the exchange's (its counters, the write log). Node state
        itself is not among them: the warm-up writes only its scratch row
        (:meth:`~sven.models.memory.MemoryState.writes_to_scratch`), so no copy as large
        as the state is made at each capture."""
        return self.exchange.state_tensors()

    @property
    def train_graph(self) -> StepGraph:
        """The training graph of the first ring position (tests read ``captured``)."""
        return self.train_graphs[0]

    # -------------------------------------------------------------- train
    def _build_train(
        self,
        inp: BatchInputs,
        group: Any = None,
        lap: Callable[[str], None] | None = None,
        pos: int = 0,
    ) -> StepInput:
        return self.source.build(
            inp,
            self.cfg.train.num_neg,
            "train",
            micro=self.micro_batches,
            group=group,
            lap=lap,
            # Built ahead of its step: the exchange reads its rows now where it tracks
            # writes.
            read_ahead=self.depth > 0,
            ahead_key=("train", pos),
        )

    def _train_fn(self, k: int) -> Callable[[], None]:
        # Depth 0 builds the batch being trained; depth D the one D ahead, on the
        # prefetch's process group.
        inp, group = (self.inp, None) if self.depth == 0 else (self.ahead, self.plan_group)

        def fn() -> None:
            with determinism(self.device):
                lap = None if self.device.type == "cuda" else self.timeline.lap
                item = self.ring.take(k, lambda p: self._build_train(inp, group, lap, p))
                loss = train_step(
                    self.model,
                    self.optimizer,
                    self.exchange,
                    item,
                    self.inp["npred"],
                    lap=lap,
                    grads=self.grads,
                )
                self.loss_sum += loss
                self.grads.record(
                    self.exchange.counter.value, self.status.value, self.exchange.overflow
                )
                self.ring.join()

        return fn

    @property
    def copier(self) -> CopyAhead | None:
        """The host thread reading training rows ahead for the copy engine, or None."""
        return self.memory.copier if self.read_ahead else None

    def _global(self, i: int) -> tuple[int, int]:
        """Global event range of training batch i (empty past the split's end)."""
        return batch_bounds(*self.data.ranges["train"], self.cfg.train.batch_size, i)

    def start_epoch(self, epoch: int, first: int, last: int) -> None:
        """Builds the first D + 1 batches of ``first..last - 1`` into the prefetch ring."""
        self.ring.fill(
            self.ahead,
            self.shares,
            first,
            self._global,
            epoch,
            lambda p: self._build_train(self.ahead, self.plan_group, pos=p),
        )
        # Rows read by the fill are read again at their steps: whatever wrote the state
        # outside a commit before them (a load, which took the hot copies again) is seen.
        self.memory.invalidate(tables=False)
        if self.copier is not None:
            for p in range(self.depth + 1):
                self.copier.launch(("train", p))

    def train_batch(self, epoch: int, i: int, g_lo: int, g_hi: int, stop_vote: int = 0) -> None:
        """Queues the training step of global batch [g_lo, g_hi) (batch ``i``)."""
        npred = (g_hi - g_lo) * (1 + self.cfg.train.num_neg)
        self.shares.name(self.inp, g_lo, g_hi, epoch, npred=float(npred))
        self.grads.set_vote(stop_vote)
        d = self.depth
        if d:
            self.shares.name(self.ahead, *self._global(i + d), epoch)
        graph, copier = self.train_graphs[i % (d + 1)], self.copier
        if copier is not None:
            if graph.mode != "off" and graph.graph is None:
                # The capture's warm-up saves and puts back the ring's rows: no copy
                # may land in them meanwhile.
                copier.wait_all()
            copier.wait(("train", i % (d + 1)))
        graph()
        if copier is not None:
            # The ids of the batch just built ahead are on their way to the host.
            copier.launch(("train", (i + d) % (d + 1)))
        self.status.after_step()
        if self.device.type == "cuda":
            self.timeline.lap("step")

    def take_loss(self) -> float:
        """The summed mean losses of the steps since the last call (waits for them);
        also stops the run if a batch overflowed a capacity, and commits a write-back
        held for staleness 1 (a drained boundary)."""
        value = float(self.loss_sum)
        self.loss_sum.zero_()
        self.exchange.check()
        self.exchange.flush()
        return value

    def plan_capacities(self, epoch: int) -> Capacities:
        """Sets the training capacities from an exact replay of ``epoch``, grown by
        ``dist.capacity_slack`` for later epochs (whose draws differ), and the training
        node slots (:meth:`plan_train_slots`); called before the first epoch this
        process trains, ``epoch``."""
        lo, hi = self.data.ranges["train"]
        caps = self.planner.plan_train(
            lo,
            hi,
            epoch,
            self.cfg.train.num_neg,
            self.micro_batches,
            self.cfg.dist.capacity_slack,
        )
        self.plan_train_slots()
        return caps

    def plan_train_slots(self) -> None:
        """On a fixed-shape step of one process, the node slots of training: the most
        distinct nodes any batch of any of the ``train.epochs`` epochs reads, counted
        exactly from the ids each epoch's batches are built with, many batches at once
        (:func:`~sven.engine.capacities.plan_epoch_slots`; negatives and uniform
        draws depend on the epoch).

        The default slots hold every id a batch lists (B * (1 + n) roots and their
        neighbour slots), many times its distinct nodes, and every per-slot stage would
        compute on the empty ones. The slot count is part of the arithmetic: a weight
        gradient sums over the slots, and a GEMM's blocking of that sum follows its
        length. So the plan covers every epoch from the first, on a resumed run too,
        which then trains as the uninterrupted one to the last bit; and the whole
        split, whatever ``train.max_batches`` (the prefetch ring builds batches past
        the last one trained). An early stop trains fewer epochs than planned. Runs
        across ranks, and shares in micro-batches (one fetch for all of them), keep
        the default.
        """
        if not self.inp.fixed or self.spec.distributed or self.micro_batches > 1:
            return
        lo, hi = self.data.ranges["train"]
        tc = self.cfg.train
        u = plan_epoch_slots(self.source, tc.batch_size, lo, hi, tc.epochs, tc.num_neg)
        self.source.slots["train"] = u

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
        if mode not in self.exchange.capacities:
            # Measured on P ranks; one process has no capacity to set.
            self.planner.plan_passes(mode, [lambda: (lo, hi, stream, 0, None)])
        model = self.model_ref
        model.eval()
        b = self.cfg.train.batch_size
        inp = self.inp.copy()
        inp.fill(split_lo=lo, stream=stream)
        idx_all, h_all = [], []
        self.exchange.flush()
        with determinism(self.device):
            for start in range(lo, hi, b):
                self.shares.name(inp, start, min(start + b, hi), stream)
                item = self.source.build(inp, 0, mode)
                batch = item.micro[0]
                h = encode_step(model, self.exchange, item, mode)[: batch.size]
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


#: How rows are read ahead with state in pinned host memory: ``"copy"`` (a host
#: thread gathers them, the copy engine moves them: sven.models.copyahead) or ``"sm"``
#: (a Triton gather over the host link, on the ring's stream). ``SVEN_READ_AHEAD``
#: picks one for A/B runs (``0`` turns reading ahead off). The SM gather is the
#: default: the copy engine timed slower on a GPU host (docs/scale.md).
AHEAD_ENGINE = "sm"


def ahead_engine(device: torch.device) -> str:
    """How rows are read ahead on ``device``: ``SVEN_READ_AHEAD`` (``copy`` or ``sm``;
    ``1`` or unset: :data:`AHEAD_ENGINE`); ``sm`` where this torch cannot record an
    event for the host from inside a captured graph.

    Raises:
        ValueError: On another value.
    """
    raw = os.environ.get("SVEN_READ_AHEAD", "1").strip().lower()
    engine = {"1": AHEAD_ENGINE, "": AHEAD_ENGINE}.get(raw, raw)
    if engine not in ("copy", "sm"):
        raise ValueError(f"SVEN_READ_AHEAD must be 0, 1, copy or sm, got {raw!r}")
    if engine == "copy" and device.type == "cuda" and not external_events():
        return "sm"
    return engine


def reads_ahead(depth: int, memory: MemoryState, exchange: Exchange) -> bool:
    """Whether a step's rows are read with its batch, on the prefetch ring's side
    stream (:mod:`sven.models.readahead`): with node state in pinned host memory, where
    the read crosses the host link, on one process, with a ring (depth >= 1).
    ``SVEN_READ_AHEAD=0`` turns it off (the A/B of ``benchmarks/gpu_session.sh``)."""
    if os.environ.get("SVEN_READ_AHEAD", "1") == "0":
        return False
    return bool(depth) and memory.storage.pinned and not exchange.distributed
