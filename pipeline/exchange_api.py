"""The exchange's one interface (:class:`Exchange`), the plan of a fetch and the
exchange of one process (:class:`LocalExchange`).

:class:`~sven.pipeline.exchange.FixedExchange`, the exchange across P ranks, is the
other :class:`Exchange`; a run builds one of the two and its step never asks which.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor

from sven.models.memory import DenseUpdate, EarlyRows, MemoryRows, MemoryState
from sven.pipeline.batch import Batch
from sven.pipeline.wire import Capacities, CommCounter

__all__ = ["Exchange", "FetchPlan", "Group", "LocalExchange", "read_occurrences"]

#: A process group, or None (the default group, or none at all); a string, so that
#: torch builds without ``torch.distributed`` import this module.
Group: TypeAlias = "dist.ProcessGroup | None"


def read_occurrences(batch: Batch) -> torch.Tensor:
    """(U,) how often each of ``batch.nodes`` is read by the batch's real events.

    Roots of padded events (``batch.valid`` False) and masked neighbour slots count
    nothing, so a node read only by padding is not needed: on several ranks it is not
    fetched (its row is zero; the padded event's results are masked anyway).
    """
    u = batch.nodes.shape[0]
    width = batch.root_pos.shape[0] // max(batch.size, 1)
    if batch.valid is None:
        root_w = torch.ones_like(batch.root_pos)
    else:
        root_w = batch.valid.to(torch.int64).repeat(width)
    occ = torch.zeros(u, dtype=torch.int64, device=batch.nodes.device)
    occ.index_add_(0, batch.root_pos, root_w)
    if batch.nbr_pos is not None:
        nb = batch.nbr_pos.shape[0]
        w = batch.block.mask[:nb].to(torch.int64) * root_w[:nb, None]
        occ.index_add_(0, batch.nbr_pos.reshape(-1), w.reshape(-1))
    return occ


class Exchange:
    """Where a step's node-state rows come from and go to: the one interface of the
    local exchange and the exchange across ranks.

    Attributes:
        distributed: Whether rows cross ranks (a process group is up).
        shard: This rank's node state (the whole state on one process).
        counter: Bytes that crossed ranks, counted on the device.
        overflow: (2,) int64 largest excess over the fetch and push capacities.
        group: Process group of the fetches (None: no group, or the default one).
        capacities: Per-peer capacities of each kind of step set so far (none locally).
    """

    distributed: bool
    shard: MemoryState
    counter: CommCounter
    overflow: torch.Tensor
    group: Group = None
    capacities: dict[str, Capacities]

    def owners(self) -> torch.Tensor:
        """(N + 1,) int64 owner rank of every vertex, then P for the padding id N."""
        raise NotImplementedError

    def set_capacities(self, mode: str, caps: Capacities) -> None:
        """Fixes the split sizes of one kind of step ("train", "eval"...)."""
        raise NotImplementedError

    def plan(
        self, nodes: Tensor, occurrences: Tensor, mode: str = "train", group: Group = None
    ) -> FetchPlan:
        """Where the rows of ``nodes`` (U,) come from, given how often real events read
        each (``occurrences`` (U,)); on one process every row is local and the plan only
        names the nodes (:meth:`~sven.pipeline.exchange.FixedExchange.plan` across ranks)."""
        return FetchPlan(nodes, *([None] * 6))

    def fetch(
        self,
        batch: Batch | FetchPlan | torch.Tensor,
        mode: str = "train",
        early: EarlyRows | None = None,
    ) -> MemoryRows:
        """The rows of a batch's nodes (U slots), the scratch row for padding slots
        (``early``: the same rows read ahead by :meth:`read_ahead`, made exact here)."""
        raise NotImplementedError

    def read_ahead(self, nodes: Tensor, key: Hashable | None = None) -> EarlyRows | None:
        """The rows of ``nodes`` (U,) read before their step (a prefetched batch's, on
        the ring's side stream), or None where this exchange reads them at the step
        (across ranks; or with the state beside the compute, where the read is
        cheap). ``key``: the ring position the batch goes to, where rows read by
        the copy engine need one (:meth:`MemoryState.read_ahead`)."""
        return None

    def push(self, update: DenseUpdate, mode: str = "train") -> None:
        """Writes a batch's write-back to the node state (each node's latest event)."""
        raise NotImplementedError

    # A write-back running beside the step (:meth:`_push_beside`), until :meth:`wait`.
    _side: torch.cuda.Stream | None = None
    _push_done: torch.cuda.Stream | None = None
    _pushed: DenseUpdate | None = None

    def _push_beside(self, commit: Callable[[], None], update: DenseUpdate) -> None:
        """Runs ``commit`` on a side stream that starts after the work queued so far,
        beside whatever the caller does next, until :meth:`wait` joins it."""
        cur = torch.cuda.current_stream()
        if self._side is None:
            self._side = torch.cuda.Stream(cur.device)
        self._side.wait_stream(cur)
        with torch.cuda.stream(self._side):
            commit()
        self._push_done = self._side
        # Held until the join: memory the step's stream frees (a micro-batches'
        # concatenation) could otherwise be given to the backward while the side stream
        # still reads it.
        self._pushed = update

    def wait(self) -> None:
        """Joins a write-back running beside the step, if any."""
        if self._push_done is not None:
            torch.cuda.current_stream().wait_stream(self._push_done)
            self._push_done = None
            self._pushed = None

    def check(self) -> None:
        """Raises if a batch needed more than a capacity."""

    def flush(self) -> None:
        """Commits a held write-back (staleness 1)."""

    def drop_held(self) -> None:
        """Forgets a held write-back."""

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors a step modifies besides the shard."""
        return []

    def epoch_bytes(self) -> dict[str, Any]:
        """The ``comm_*`` fields of the epoch so far (none without ranks)."""
        return {}

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps of the exchange (its byte counters across ranks;
        nothing without ranks)."""
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores :meth:`state_dict` (nothing to restore without ranks)."""


class LocalExchange(Exchange):
    """The exchange of one process without a process group: every row is local.

    Args:
        memory: The whole memory.
    """

    distributed = False

    def __init__(self, memory: MemoryState) -> None:
        self.shard = memory
        self.counter = CommCounter(memory.device)
        self.overflow = torch.zeros(2, dtype=torch.int64, device=memory.device)
        self.capacities = {}

    def owners(self) -> torch.Tensor:
        """Every vertex on rank 0; the padding id on rank 1."""
        n, dev = self.shard.num_nodes, self.shard.device
        return (torch.arange(n + 1, device=dev) == n).to(torch.int64)

    def set_capacities(self, mode: str, caps: Capacities) -> None:
        """Kept for the record: one process has no peer to size buffers for."""
        self.capacities[mode] = caps

    def fetch(
        self,
        batch: Batch | FetchPlan | torch.Tensor,
        mode: str = "train",
        early: EarlyRows | None = None,
    ) -> MemoryRows:
        """The rows of ``batch.nodes`` (or of the (U,) ids given), the scratch row for
        padding slots; from ``early`` (rows read ahead), refreshed, where given."""
        nodes = batch if isinstance(batch, torch.Tensor) else batch.nodes
        if early is not None:
            return self.shard.refresh(early, nodes)
        return self.shard.gather(nodes)

    def read_ahead(self, nodes: Tensor, key: Hashable | None = None) -> EarlyRows | None:
        """The rows of ``nodes`` read now (or, with the copy engine and a ``key``,
        requested), where the state tracks its writes
        (:meth:`MemoryState.track_writes`); else None."""
        return self.shard.read_ahead(nodes, key) if self.shard.log is not None else None

    def state_tensors(self) -> list[torch.Tensor]:
        """The state's record of writes, where it keeps one."""
        return self.shard.log.tensors() if self.shard.log is not None else []

    def push(self, update: DenseUpdate, mode: str = "train") -> None:
        """Commits the batch's write-back (fixed shapes: :meth:`MemoryState.commit_dense`).

        Where rows are read ahead (pinned host state: its writes cross the host link
        too) the commit runs on a side stream, beside whatever the caller does next
        (the backward, the optimizer), until :meth:`wait`. A row read ahead meanwhile
        is refreshed at its step.
        """
        if self.shard.log is None or not update.key.is_cuda:
            self.shard.commit_dense(update)
            return
        self._push_beside(lambda: self.shard.commit_dense(update), update)


@dataclass
class FetchPlan:
    """Where a batch's rows come from: the outcome of the id exchange.

    Attributes:
        nodes: (U,) the batch's node slots.
        mine: (U,) bool, read from this rank's shard.
        ok: (U,) bool, requested from another rank (within capacity).
        dest: (U,) slot of each request in the send buffer (the dump slot otherwise).
        req: (sum of received sizes,) int64 ids other ranks request from this one, -1
            in padding.
        naive: () remote reads a scheme without de-duplication would make.
        excess: () largest count over a capacity (<= 0 when everything fits).
    """

    nodes: torch.Tensor
    mine: torch.Tensor
    ok: torch.Tensor
    dest: torch.Tensor
    req: torch.Tensor
    naive: torch.Tensor
    excess: torch.Tensor
