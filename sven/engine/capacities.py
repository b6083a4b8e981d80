"""The exchange's fixed sizes, from an exact replay of the step's own batch building.

On P ranks every collective of the step has split sizes fixed before training (so that
the step can be captured): rank r sends at most ``fetch[r][q]`` row requests and
``push[r][q]`` written rows to rank q in one batch. They are measured by building every
batch of a pass exactly as the step will (same selection, negatives, sampling and
de-duplication; :class:`~sven.engine.batches.BatchSource`) without touching node state,
counting each rank's distinct remote reads and writes per peer, and all-gathering the
maxima into P x P matrices. Training's grow by ``dist.capacity_slack`` (later epochs draw
other negatives); evaluation's are exact (its negatives are fixed by the seed). One
process has no peer to size buffers for: :class:`OneProcess` plans nothing
(:func:`capacity_planner` chooses, once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from sven.engine.batches import BatchInputs, BatchSource
from sven.engine.capture import determinism
from sven.engine.spec import RunSpec
from sven.models.base import endpoints
from sven.pipeline.exchange_api import read_occurrences
from sven.pipeline.wire import Capacities

__all__ = [
    "CapacityPlanner",
    "OneProcess",
    "Planner",
    "batch_node_counts",
    "capacity_planner",
    "plan_slots",
    "plan_slots_at_once",
]

Counts = tuple[list[int], list[int]]
#: (lo, hi, stream, num_neg, neg_table) of one replayed pass.
Pass = tuple[int, int, int, int, "torch.Tensor | None"]


class Planner:
    """What the step asks of the exchange's capacities: set those of training (from
    an epoch) and of a kind of pass (evaluation, encoding) before the first such step.

    Attributes:
        shares: The step's shares.
        dtype: Floating type of node state.
    """

    shares: Any
    dtype: torch.dtype

    def plan_train(
        self, lo: int, hi: int, epoch: int, num_neg: int, micro: int, slack: float
    ) -> Capacities:
        """Sets and returns the training capacities for ``epoch``'s batches of [lo, hi)."""
        raise NotImplementedError

    def plan_passes(self, mode: str, passes: list[Callable[[], Pass]]) -> None:
        """Sets the capacities of ``mode`` for every pass listed."""
        raise NotImplementedError


class CapacityPlanner(Planner):
    """Measures and sets the capacities of every kind of step of one rank.

    Args:
        source: The step's batch source (the replay builds batches with it).
        inputs: Batch inputs to copy for the replay (it never touches the step's).
        model: The model (its mail receivers: who a batch writes).
        dtype: Floating type of node state.
        batch_size: The global batch size B.
    """

    def __init__(
        self,
        source: BatchSource,
        inputs: BatchInputs,
        model: Any,
        dtype: torch.dtype,
        batch_size: int,
    ) -> None:
        self.source, self.inputs, self.model = source, inputs, model
        self.exchange = source.exchange
        self.shares = source.shares
        self.dtype, self.batch_size = dtype, batch_size
        self.rank, self.world_size = self.shares.rank, self.shares.world_size
        self.device = inputs.device

    @torch.no_grad()
    def measure_range(
        self,
        lo: int,
        hi: int,
        stream: int,
        num_neg: int,
        neg_table: torch.Tensor | None = None,
        micro: int = 1,
    ) -> Counts:
        """This rank's most rows requested from / written to each rank in any global
        batch of events [lo, hi) from ``lo``, by an exact replay of the batch building.

        Returns:
            (fetch (P,), push (P,)) per-peer maxima (0 towards itself).
        """
        p, r, dev = self.world_size, self.rank, self.device
        fetch = torch.zeros(p, dtype=torch.int64, device=dev)
        push = torch.zeros(p, dtype=torch.int64, device=dev)
        owner = self.exchange.owners()
        inp = self.inputs.copy()
        inp.fill(split_lo=lo, stream=stream)
        with determinism(dev):
            for start in range(lo, hi, self.batch_size):
                self.shares.name(inp, start, min(start + self.batch_size, hi), stream)
                reads, writes = [], []
                for mb in self.source.select_share(inp, num_neg, neg_table, micro):
                    reads.append(mb.nodes[read_occurrences(mb) > 0])
                    zeros = torch.zeros(mb.size, 1, dtype=self.dtype, device=dev)
                    recv, _, _, keys = self.model.mail_receivers(mb, zeros, zeros, endpoints(mb))
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

    def replayed(self, counts: Callable[[], Counts]) -> Capacities:
        """Capacities from this rank's replayed per-peer maxima (``counts()``, run only
        where there are peers), gathered into P x P matrices on every rank."""
        cap = self.shares.capacity
        if self.world_size == 1:
            return Capacities(cap or 0, [[0]], [[0]])
        f, w = counts()
        return Capacities(cap, self._gather_matrix(f), self._gather_matrix(w))  # type: ignore[arg-type]

    def plan_train(
        self, lo: int, hi: int, epoch: int, num_neg: int, micro: int, slack: float
    ) -> Capacities:
        """Sets the training capacities from an exact replay of ``epoch``'s batches of
        events [lo, hi), grown by ``slack`` for later epochs (whose draws differ)."""
        caps = self.replayed(lambda: self.measure_range(lo, hi, epoch, num_neg, micro=micro))
        if self.world_size > 1:
            caps = caps.grown(slack)
        self.exchange.set_capacities("train", caps)
        return caps

    def plan_passes(self, mode: str, passes: list[Callable[[], Pass]]) -> None:
        """Sets exact capacities for ``mode``, covering every pass listed: each callable
        readies its pass (fills its negatives table) and returns ``(lo, hi, stream,
        num_neg, neg_table)`` (the evaluation splits of one width, or one replayed
        range)."""

        def counts() -> Counts:
            f, w = [0] * self.world_size, [0] * self.world_size
            for ready in passes:
                fs, ws = self.measure_range(*ready())
                f = [max(a, c) for a, c in zip(f, fs)]
                w = [max(a, c) for a, c in zip(w, ws)]
            return f, w

        self.exchange.set_capacities(mode, self.replayed(counts))


class OneProcess(Planner):
    """The capacities of a run without a process group: every row is local, so there
    is nothing to measure or set.

    Args:
        shares: The step's shares (their capacity).
        dtype: Floating type of node state.
    """

    def __init__(self, shares: Any, dtype: torch.dtype) -> None:
        self.shares, self.dtype = shares, dtype

    def plan_train(
        self, lo: int, hi: int, epoch: int, num_neg: int, micro: int, slack: float
    ) -> Capacities:
        """The share's capacity (0 on the exact-size step) and no peer."""
        return Capacities(self.shares.capacity or 0, [[0]], [[0]])

    def plan_passes(self, mode: str, passes: list[Callable[[], Pass]]) -> None:
        """Nothing to set: no pass is replayed."""


@torch.no_grad()
def plan_slots(
    source: BatchSource, inputs: BatchInputs, batch_size: int, passes: list[Callable[[], Pass]]
) -> int:
    """Node slots that hold every batch of the passes listed: the most distinct nodes
    any of this rank's batches reads, plus one for the padding id, by an exact replay
    of their building (a fixed-shape step; the passes as :meth:`Planner.plan_passes`
    takes them, whose negatives are fixed by the seed).

    Without a plan a batch's slots hold every id it lists, up to the graph's N + 1: an
    evaluation batch with 100 MRR negatives lists many times more ids than it has
    distinct nodes, and every per-slot stage (the state gather and write-back, the
    memory updater, the node projections) would compute on the empty slots too.

    Args:
        source: The step's batch source (its shares and event tables).
        inputs: Batch inputs to copy for the replay (it never touches the step's).
        batch_size: The global batch size B.
        passes: Each callable readies its pass and returns ``(lo, hi, stream, num_neg,
            neg_table)``.

    Returns:
        U, one host read for all the passes. The batches a prefetch ring builds past a
        split's end repeat one event: U also holds one event's ids.
    """
    pad, b = source.tables.num_nodes, batch_size
    inp = inputs.copy()
    most = torch.zeros((), dtype=torch.int64, device=inputs.device)
    one_event = 1
    with determinism(inputs.device):
        for ready in passes:
            lo, hi, stream, num_neg, neg_table = ready()
            inp.fill(split_lo=lo, stream=stream)
            for start in range(lo, hi, b):
                source.shares.name(inp, start, min(start + b, hi), stream)
                for mb in source.select_share(inp, num_neg, neg_table, 1):
                    torch.maximum(most, (mb.nodes != pad).sum(), out=most)
                    nbrs = 0 if mb.nbr_pos is None else mb.nbr_pos.shape[1]
                    one_event = max(one_event, mb.root_pos.shape[0] // mb.size * (1 + nbrs))
    return max(int(most), one_event) + 1


#: Ids (roots and neighbour slots) :func:`plan_slots_at_once` builds at once: some
#: hundred megabytes of keys and the sampler's temporaries, on a graph of any size.
PLAN_IDS = 1 << 22
#: Up to this many node ids per id of a batch, :func:`plan_slots_at_once` counts a
#: batch's distinct ids in a table of every node (a pass over the ids and the table)
#: rather than by a sort; the table then holds at most ``DENSE_NODES * PLAN_IDS`` cells.
DENSE_NODES = 4


@torch.no_grad()
def plan_slots_at_once(
    source: BatchSource, batch_size: int, passes: list[Callable[[], Pass]]
) -> int:
    """:func:`plan_slots`'s U, computed for many batches at once.

    A batch's ids are a function of its events and the stream alone
    (:func:`~sven.pipeline.stages.event_ids`, which builds them as the batch does), so
    the ids of a run of consecutive batches are built in one go and counted per batch
    (:class:`_Runs`). A batch padded past the split's end repeats its last event, which
    adds no id.

    Args:
        source: The step's batch source of one process (its event tables, model and
            seed; its shares hold every event).
        batch_size: The global batch size B.
        passes: As :func:`plan_slots` takes them.

    Returns:
        U, as :func:`plan_slots` returns it; one host read.
    """
    most = torch.zeros((), dtype=torch.int64, device=source.tables.src.device)
    one_event = 1
    for ready in passes:
        lo, hi, stream, num_neg, neg_table = ready()
        width = num_neg if neg_table is None else neg_table.shape[1]
        runs = _Runs(source, batch_size, width)
        one_event = max(one_event, runs.one_event)
        for idx in runs.chunks(lo, hi):
            ids = runs.ids(idx, stream, num_neg, "all", neg_table, lo)
            torch.maximum(most, runs.most(runs.distinct(*ids)), out=most)
    return max(int(most), one_event) + 1


@torch.no_grad()
def plan_epoch_slots(
    source: BatchSource, batch_size: int, lo: int, hi: int, epochs: int, num_neg: int
) -> int:
    """:func:`plan_slots_at_once` of training's passes over events [lo, hi), one per
    epoch (its stream) of ``epochs``.

    With recent sampling, or none, the ids of the positive roots (src, dst and their
    sampled neighbours) are the same every epoch: each run of batches counts them once
    and adds each epoch's negatives and their neighbours. Uniform draws are keyed by
    the epoch: every id is then built per epoch.

    Returns:
        U, as :func:`plan_slots` returns it for these passes.
    """
    sampler = source.tables.sampler
    if sampler is not None and source.model.read_neighbors and sampler.strategy != "recent":
        passes = [lambda e=e: (lo, hi, e, num_neg, None) for e in range(epochs)]
        return plan_slots_at_once(source, batch_size, passes)
    runs = _Runs(source, batch_size, num_neg)
    most = torch.zeros((), dtype=torch.int64, device=source.tables.src.device)
    for idx in runs.chunks(lo, hi):
        fixed = runs.distinct(*runs.ids(idx, 0, num_neg, "positive"))
        for epoch in range(epochs):
            ids = runs.ids(idx, epoch, num_neg, "negative")
            torch.maximum(most, runs.most(runs.distinct(*ids, fixed)), out=most)
    return max(int(most), runs.one_event) + 1


@torch.no_grad()
def batch_node_counts(
    source: BatchSource, batch_size: int, lo: int, hi: int, epoch: int, num_neg: int
) -> torch.Tensor:
    """The distinct nodes each training batch of events [lo, hi) reads in ``epoch``
    (its roots, negatives and their sampled neighbours; the rows its node-state gather
    reads), counted as :func:`plan_epoch_slots` counts them for its maximum.

    Returns:
        (ceil((hi - lo) / batch_size),) int64, batch by batch from ``lo``.
    """
    runs = _Runs(source, batch_size, num_neg)
    out = [
        runs.counts(runs.distinct(*runs.ids(idx, epoch, num_neg, "all"))).to(torch.int64)
        for idx in runs.chunks(lo, hi)
    ]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


class _Runs:
    """Runs of consecutive batches, their ids and the distinct ones of each batch.

    Args:
        source: The step's batch source of one process.
        batch_size: The global batch size B.
        num_neg: Negatives per event (the width of an evaluation table).
    """

    def __init__(self, source: BatchSource, batch_size: int, num_neg: int) -> None:
        tables, model = source.tables, source.model
        self.source, self.b, self.pad = source, batch_size, tables.num_nodes
        read = tables.sampler is not None and model.read_neighbors
        k = tables.sampler.fanouts[0] if read else 0
        per_event = (2 + num_neg) * (1 + k)
        #: The ids of one event: a batch past the split's end repeats one.
        self.one_event = per_event
        # A table of every node per batch where it is not much larger than the ids: one
        # pass over the ids where a sort takes several.
        self.dense = self.pad + 1 <= DENSE_NODES * batch_size * per_event
        self.step = batch_size * max(1, PLAN_IDS // (batch_size * per_event))
        self.batches = 0

    def chunks(self, lo: int, hi: int) -> Iterator[torch.Tensor]:
        """The (M,) events of each run of batches of [lo, hi), from ``lo``."""
        for first in range(lo, hi, self.step):
            idx = torch.arange(
                first, min(first + self.step, hi), device=self.source.tables.src.device
            )
            self.batches = -(-idx.shape[0] // self.b)
            yield idx

    def ids(
        self,
        idx: torch.Tensor,
        stream: int,
        num_neg: int,
        part: str,
        neg_table: torch.Tensor | None = None,
        table_lo: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids of the events ``idx`` (``part`` of them:
        :func:`~sven.pipeline.stages.event_ids`) and the batch of each."""
        from sven.pipeline.stages import event_ids

        src, model = self.source, self.source.model
        ids, at = event_ids(
            src.tables, idx, stream, seed=src.seed, num_neg=num_neg,
            sample_roots=model.sample_roots, read_neighbors=model.read_neighbors,
            neg_table=neg_table, table_lo=table_lo, part=part,
        )  # fmt: skip
        return ids, at // self.b

    def distinct(
        self, ids: torch.Tensor, batch: torch.Tensor, fixed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The distinct (batch, id) pairs of (I,) ``ids`` and their (I,) batches, with
        those of ``fixed`` (an earlier result of the same run): a (batches * (N + 1),)
        bool table of them (dense), else their sorted keys ``batch * (N + 1) + id``."""
        key = batch * (self.pad + 1) + ids
        if self.dense:
            if fixed is None:
                seen = torch.zeros(
                    self.batches * (self.pad + 1), dtype=torch.bool, device=ids.device
                )
            else:
                seen = fixed.clone()
            seen[key] = True
            return seen
        if self.batches * (self.pad + 1) <= 2**31:
            # Half the radix passes of an int64 sort, for the same order.
            key = key.to(torch.int32)
        return torch.unique(key if fixed is None else torch.cat([fixed, key]))

    def most(self, distinct: torch.Tensor) -> torch.Tensor:
        """The most distinct ids other than the padding id of any batch of the run,
        from :meth:`distinct`'s result; a 0-d tensor."""
        return self.counts(distinct).max().to(torch.int64)

    def counts(self, distinct: torch.Tensor) -> torch.Tensor:
        """(batches,) distinct ids other than the padding id of each batch of the run,
        from :meth:`distinct`'s result."""
        n = self.pad + 1
        if self.dense:
            # Summed as bytes: a sum of booleans (or of a slice) costs several times more.
            table = distinct.view(torch.uint8).view(self.batches, n)
            return table.sum(1, dtype=torch.int32) - table[:, self.pad]
        keys = distinct.to(torch.int64)
        counts = torch.zeros(self.batches, dtype=torch.int64, device=keys.device)
        counts.index_add_(0, keys // n, (keys % n != self.pad).to(torch.int64))
        return counts


def capacity_planner(
    spec: RunSpec,
    source: BatchSource,
    inputs: BatchInputs,
    model: Any,
    dtype: torch.dtype,
    batch_size: int,
) -> Planner:
    """The step's capacity planner: the exact replay across ranks (under a process
    group), :class:`OneProcess` without one (arguments as :class:`CapacityPlanner`'s)."""
    if spec.distributed:
        return CapacityPlanner(source, inputs, model, dtype, batch_size)
    return OneProcess(source.shares, dtype)
