"""The training step on several ranks, pipelined: prefetch, micro-batches, async write-back.

Per global batch, each rank trains on its share of the events (see
:class:`~sven.trainer.Trainer`). :class:`RankStep` splits that step in two:

* :meth:`RankStep.prepare` (run ahead by :class:`~sven.pipeline.prefetch.Prefetcher`,
  ``pipeline.prefetch`` batches deep): negatives, neighbour sampling, de-duplication
  and the id plan of the memory exchange, for each of the m micro-batches. The node ids
  of the whole share are de-duplicated once; each node is planned with the first
  micro-batch that reads it, so the bytes are those of the unsplit batch.
* :meth:`RankStep.run`: the row fetch of micro-batch j + 1 (asynchronous) while
  micro-batch j computes its loss and gradients; all micro-batches read the memory as
  it was before the batch. Then one push of the whole batch's write-back (the
  last-occurrence selection over all micro-batches), sent asynchronously while the
  gradients are all-reduced and the optimizer steps; with ``pipeline.staleness=0`` the
  next batch waits for it before its first fetch.

With staleness 0 the result equals the synchronous step for every prefetch depth and m
(up to the order of floating-point gradient sums).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sven.models.memory import DenseUpdate, MemoryRows
from sven.pipeline.prefetch import Prefetcher, SideStream
from sven.step import masked_bce, no_uninitialized_fill

if TYPE_CHECKING:
    from sven.pipeline.batch import Batch
    from sven.pipeline.memory_exchange import Plan, PushHandle
    from sven.trainer import Trainer

__all__ = ["RankStep", "StepInput", "naive_writes", "read_occurrences"]

#: The micro-batch counts ``pipeline.micro_batches=auto`` chooses from.
AUTO_CANDIDATES = (1, 2, 4)
#: Steps timed per candidate.
AUTO_STEPS = 3


def read_occurrences(batch: Batch) -> torch.Tensor:
    """(U,) how often each of ``batch.nodes`` is read (as a root or a neighbour)."""
    pos = batch.root_pos
    if batch.nbr_pos is not None:
        pos = torch.cat([pos, batch.nbr_pos[batch.block.mask]])
    return torch.bincount(pos, minlength=batch.nodes.numel())


def naive_writes(tr: Trainer, batch: Batch) -> int:
    """Rows a write-back without de-duplication would send: one per remote occurrence
    among the written endpoints (and the neighbour slots mail is delivered to)."""
    written = [batch.src, batch.dst]
    if tr.model.deliver_to_neighbors and batch.block is not None:
        b = batch.size
        written.append(batch.block.nbr[: 2 * b][batch.block.mask[: 2 * b]])
    return int((tr.owner[torch.cat(written)] != tr.rank).sum())


@dataclass
class StepInput:
    """One rank's share of a global batch, prepared ahead of its step.

    Attributes:
        index: The batch's number in its epoch.
        num_predictions: Predictions of the whole global batch, B * (1 + n).
        micro: The m micro-batches (None where a micro-batch has no events).
        plans: m parts of the id plan; part j holds the nodes first read by micro-batch j.
        rows_at: Per micro-batch, (U_j,) positions of its nodes in the concatenated
            rows of parts 0..j (None where empty).
        naive_write: :func:`naive_writes` of the whole share.
        event: CUDA event that ends the preparation on the side stream, or None.
    """

    index: int
    num_predictions: int
    micro: list[Batch | None]
    plans: list[Plan]
    rows_at: list[torch.Tensor | None]
    naive_write: int
    event: object = None


class RankStep:
    """The multi-rank training step with the ``pipeline`` section's knobs.

    Args:
        tr: The trainer (its exchange, model, optimizer, event tables).
        plan_group: Process group for the id plans (made at start, same ranks as the
            default group), so that the prefetch thread's collectives never interleave
            with the main thread's.
    """

    def __init__(self, tr: Trainer, plan_group: dist.ProcessGroup) -> None:
        pc = tr.cfg.pipeline
        self.tr = tr
        self.plan_group = plan_group
        self.depth = pc.prefetch
        self.staleness = pc.staleness
        self.auto = pc.micro_batches == "auto"
        #: m in use (auto: 1 until profiled).
        self.micro_batches = 1 if self.auto else int(pc.micro_batches)
        #: auto's measured step time per m in seconds (max over ranks), once profiled.
        self.profile: dict[int, float] | None = None
        self.side = SideStream(tr.device)
        self._prefetch: Prefetcher | None = None
        self._pending: PushHandle | None = None

    # ------------------------------------------------------------ preparation
    def _descriptors(self, epoch: int, first: int, last: int) -> Iterator[tuple]:
        lo, hi = self.tr.ranges["train"]
        b = self.tr.cfg.train.batch_size
        for i in range(first, last):
            yield epoch, i, lo + i * b, min(lo + (i + 1) * b, hi), self.micro_batches

    def prepare(self, desc: tuple) -> StepInput:
        """Builds a share's micro-batches and id plans (no memory value is read).

        Args:
            desc: (epoch, batch number, first event, stop event, m).
        """
        out, event = self.side.run(lambda: self._prepare(*desc))
        out.event = event
        return out

    def _prepare(self, epoch: int, i: int, g_lo: int, g_hi: int, m: int) -> StepInput:
        tr = self.tr
        num_neg = tr.cfg.train.num_neg
        idx = tr.data.event_index(g_lo, g_hi)
        micro = [
            tr.data.batch(c, g_lo, epoch, num_neg) if c.numel() else None
            for c in torch.tensor_split(idx, m)
        ]
        dev = tr.device
        sets = [mb.nodes for mb in micro if mb is not None]
        union = torch.unique(torch.cat(sets)) if sets else torch.zeros(0, dtype=torch.int64)
        union = union.to(dev)
        u = union.numel()
        first = torch.full((u,), m, dtype=torch.int64, device=dev)
        occ = torch.zeros(u, dtype=torch.int64, device=dev)
        upos: list[torch.Tensor | None] = []
        naive_write = 0
        for j, mb in enumerate(micro):
            if mb is None:
                upos.append(None)
                continue
            p = torch.searchsorted(union, mb.nodes)
            first.scatter_reduce_(0, p, torch.full_like(p, j), "amin")
            occ.index_add_(0, p, read_occurrences(mb))
            upos.append(p)
            naive_write += naive_writes(tr, mb)
        # Rows arrive part by part, ordered by (first reader, id): a node's row sits at
        # its rank in that order, which micro-batch j finds in the parts 0..j.
        order = torch.argsort(first, stable=True)
        at = torch.empty_like(order)
        at[order] = torch.arange(u, device=dev)
        plans = []
        for j in range(m):
            part = first == j
            plans.append(tr.exchange.plan(union[part], occ[part], group=self.plan_group))
        return StepInput(
            index=i,
            num_predictions=(g_hi - g_lo) * (1 + num_neg),
            micro=micro,
            plans=plans,
            rows_at=[None if p is None else at[p] for p in upos],
            naive_write=naive_write,
        )

    # ------------------------------------------------------------------ epoch
    def start_epoch(self, epoch: int, first: int, last: int) -> None:
        """Starts preparing the batches ``first..last - 1`` of ``epoch``."""
        self.close()
        self._prefetch = Prefetcher(
            self._descriptors(epoch, first, last),
            self.prepare,
            self.depth,
            join_timeout_s=self.tr.cfg.dist.timeout_s + 10.0,
        )

    def close(self, finish: bool = True) -> None:
        """Stops the prefetch thread (see :meth:`Prefetcher.close`); idempotent."""
        if self._prefetch is not None:
            pf, self._prefetch = self._prefetch, None
            pf.close(finish)

    @property
    def prefetcher(self) -> Prefetcher | None:
        """The running prefetcher, if any (tests read its ``high_water``)."""
        return self._prefetch

    # ------------------------------------------------------------------- step
    def step(self, i: int) -> float:
        """Trains batch ``i`` of the started epoch; returns the global batch's mean loss."""
        item = next(self._prefetch)
        if item.index != i:
            raise RuntimeError(f"prefetched batch {item.index} where batch {i} was due")
        # Deterministic algorithms stay on; only torch's NaN fill of new tensors is
        # skipped, as in the one-process step (sven.step.no_uninitialized_fill).
        with no_uninitialized_fill():
            return self.run(item)

    def run(self, item: StepInput) -> float:
        """One optimisation step on a prepared share (see the module docstring)."""
        tr, ex = self.tr, self.tr.exchange
        lap = tr.timeline.lap
        # Waiting for the prepared batch: its build and id plan ran ahead in the prefetch
        # thread (with prefetch=0, here), so what is left of them is this wait.
        lap("sample")
        lap("id_exchange")
        if item.event is not None:
            self.side.hand_over(_tensors(item), item.event)
        tr.model.train()
        tr.optimizer.zero_grad(set_to_none=True)
        if self.staleness == 0:
            # The previous write-back must be in the shards before they serve a read.
            self.drain()
            lap("write_back")
        m = len(item.plans)
        handles = [ex.fetch(item.plans[0], async_op=True)]
        fetched: MemoryRows | None = None
        dense: list[DenseUpdate] = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=tr.device)
        for j in range(m):
            if j + 1 < m:
                handles.append(ex.fetch(item.plans[j + 1], async_op=True))
            part = handles[j].wait()
            fetched = part if fetched is None else _cat_rows(fetched, part)
            lap("row_fetch")
            mb = item.micro[j]
            if mb is None:
                continue
            rows = _take_rows(fetched, item.rows_at[j])
            if rows.node_feat is not None:
                mb.node_feat = rows.node_feat
            out = tr.model(mb, rows)
            # Divided by the whole global batch's count, so that the ranks' and the
            # micro-batches' gradients sum to the one-process gradient.
            loss = masked_bce(out, mb.valid) / item.num_predictions
            loss.backward()
            loss_sum = loss_sum + loss.detach().to(torch.float64)
            dense.append(out.dense)
            lap("compute")
        if self.staleness == 1:
            # This batch has read: now the previous write-back may land.
            self.drain()
        update = _cat_dense(dense).compact() if dense else tr._empty_update()
        self._pending = ex.push(update, item.naive_write, async_op=True)
        lap("write_back")
        loss_sum = tr._allreduce_grads(loss_sum)
        lap("grad_allreduce")
        tr.optimizer.step()
        lap("optimizer")
        return float(loss_sum)

    def drain(self) -> None:
        """Waits for the pending write-back and commits it to this rank's shard."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()

    # --------------------------------------------------------------- auto m
    def choose_micro_batches(self, epoch: int, first: int, last: int) -> int:
        """``micro_batches=auto``: times each candidate m on the same first batches,
        restores the state, and keeps the m whose slowest rank was fastest.

        Every rank takes the same decision (the times are maxed over ranks), as the
        number of collectives per step depends on m.
        """
        tr = self.tr
        steps = min(AUTO_STEPS, last - first)
        if steps <= 0:
            self.profile = {}
            return self.micro_batches
        saved = self._snapshot()
        times = []
        for m in AUTO_CANDIDATES:
            self.micro_batches = m
            took = []
            for desc in self._descriptors(epoch, first, first + steps):
                t0 = time.perf_counter()
                item = self.prepare(desc)
                if self.depth:
                    # Prefetched: its preparation is off the step's critical path.
                    t0 = time.perf_counter()
                self.run(item)
                self.drain()
                if tr.device.type == "cuda":
                    torch.cuda.synchronize(tr.device)
                took.append(time.perf_counter() - t0)
            times.append(statistics.median(took))
            self._restore(saved)
        agreed = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        self.profile = dict(zip(AUTO_CANDIDATES, agreed.tolist()))
        self.micro_batches = AUTO_CANDIDATES[int(torch.argmin(agreed))]
        shown = ", ".join(f"m={m}: {1e3 * s:.1f} ms" for m, s in self.profile.items())
        tr._log(
            f"pipeline.micro_batches=auto: step time {shown} (median of {steps}, slowest "
            f"rank); chose m={self.micro_batches}"
        )
        return self.micro_batches

    def _snapshot(self) -> dict[str, Any]:
        tr = self.tr
        return {
            "model": {k: v.clone() for k, v in tr.model.state_dict().items()},
            "optimizer": copy.deepcopy(tr.optimizer.state_dict()),
            "memory": {k: v.clone() for k, v in tr.memory.state_dict().items()},
            "counter": tr.exchange.state_dict(),
            "rng": tr._rng_state(),
        }

    def _restore(self, s: dict[str, Any]) -> None:
        tr = self.tr
        tr.model.load_state_dict(s["model"])
        tr.optimizer.load_state_dict(copy.deepcopy(s["optimizer"]))
        tr.memory.load_state_dict(s["memory"])
        tr.exchange.load_state_dict(s["counter"])
        tr._set_rng_state(s["rng"])
        # The profile's gradient all-reduces carried stop votes; a signal still counts
        # at the next real step (its flag is kept).
        tr._stop_votes = None


def _fields(obj: object) -> list[Any]:
    # Not dataclasses.astuple: it deep-copies every tensor.
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]


def _cat_rows(a: MemoryRows, b: MemoryRows) -> MemoryRows:
    return MemoryRows(
        *[None if x is None else torch.cat([x, y]) for x, y in zip(_fields(a), _fields(b))]
    )


def _take_rows(rows: MemoryRows, at: torch.Tensor) -> MemoryRows:
    return MemoryRows(*[None if x is None else x[at] for x in _fields(rows)])


def _cat_dense(parts: list[DenseUpdate]) -> DenseUpdate:
    """The micro-batches' write-back candidates as one batch's (compacted once, so a
    node written by several micro-batches keeps its last event's row)."""
    return DenseUpdate(*[torch.cat(col) for col in zip(*[_fields(p) for p in parts])])


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor reachable through dataclass fields and lists (for record_stream)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for x in _fields(obj):
            yield from _tensors(x)
