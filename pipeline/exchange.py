"""Redundancy-free memory exchange with fixed capacities, capturable in a CUDA graph.

Rank r owns the memory, mailbox and last-update time of the vertices v with
``owner[v] == r`` (a :class:`~sven.models.memory.MemoryState` shard whose row
``local[v]`` holds v) and their static node features. Per batch:

* :meth:`FixedExchange.fetch`: each node a rank's share of the batch reads is requested
  once from its owner (one ``all_to_all_single`` of ids) and its row comes back once
  (one of rows); local nodes are read from the shard directly.
* :meth:`FixedExchange.push`: each node the share writes is sent once to its owner (one
  ``all_to_all_single`` of id + row); an owner keeps the row of the latest event when
  several ranks write one node (the keys are global-event based, so distinct).

Every collective has split sizes fixed before training: rank r sends at most
``fetch[r][q]`` requests and ``push[r][q]`` write rows to q in one batch
(:class:`Capacities`, the largest counts of an exact replay of the batches). Buffers are
padded to those sizes; nothing reads a device value on the host or sizes a tensor from
data, so the whole exchange is captured with the rest of the step. Padding is not
counted: the byte counters (:class:`CommCounter`) add the valid rows on the device and
are read once per epoch. A batch that needs more than a capacity is recorded in
:attr:`FixedExchange.overflow` (the step stops the run, naming the capacity).

:class:`LocalExchange` is the trivial exchange of one process without a process group.
Both are an :class:`~sven.pipeline.exchange_api.Exchange` (defined, with
:class:`LocalExchange`, in :mod:`sven.pipeline.exchange_api` and importable from here):
the step is built with one and never asks which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from sven.models.memory import (
    DenseUpdate,
    EarlyRows,
    MemoryRows,
    MemoryState,
    winner_rows,
)
from sven.pipeline.batch import Batch
from sven.pipeline.dedupe import dedupe_fixed
from sven.pipeline.exchange_api import (
    Exchange,
    FetchPlan,
    Group,
    LocalExchange,
    read_occurrences,
)
from sven.pipeline.wire import COUNTERS, ID_BYTES, Capacities, CapacityError, CommCounter, RowCodec

__all__ = ["Exchange", "FetchPlan", "FixedExchange", "LocalExchange", "read_occurrences"]


@dataclass
class _Splits:
    """One kind of step's split sizes and send offsets on this rank."""

    fetch_send: list[int]
    fetch_recv: list[int]
    push_send: list[int]
    push_recv: list[int]
    fetch_cap: torch.Tensor
    fetch_off: torch.Tensor
    push_cap: torch.Tensor
    push_off: torch.Tensor


class FixedExchange(Exchange):
    """Fetches and pushes memory rows between owners over fixed-size buffers.

    Args:
        owner: (N,) int owner rank of every vertex (identical on all ranks).
        rank: This rank.
        world_size: P.
        shard: This rank's :class:`MemoryState`, one row per owned vertex.
        node_feat: (owned, d_n) static features of the owned vertices in shard order,
            or None; :meth:`fetch` then returns them in ``MemoryRows.node_feat``.
        group: Process group of the fetches and of the gradients (None: default).
        push_group: Process group of the write-back, which may run on a side stream
            beside the gradient all-reduce (a collective of its own communicator, so
            the two never interleave on one); None: ``group``.
        staleness: 0: a batch's write-back is committed before the step ends. 1: it is
            committed after the next batch's fetch, which reads the memory one batch
            late (deterministically).
    """

    distributed = True

    def __init__(
        self,
        owner: torch.Tensor,
        rank: int,
        world_size: int,
        shard: MemoryState,
        node_feat: torch.Tensor | None = None,
        group: dist.ProcessGroup | None = None,
        push_group: dist.ProcessGroup | None = None,
        staleness: int = 0,
    ) -> None:
        self.owner = owner.to(torch.int64)
        self.rank, self.world_size = rank, world_size
        self.group = group
        self.push_group = push_group if push_group is not None else group
        self.shard = shard
        self.staleness = staleness
        n = owner.numel()
        self.num_nodes = n
        dev = self.owner.device
        order = torch.argsort(self.owner, stable=True)
        counts = torch.bincount(self.owner, minlength=world_size)
        starts = torch.cumsum(counts, 0) - counts
        local = torch.empty(n, dtype=torch.int64, device=dev)
        local[order] = torch.arange(n, device=dev) - starts.repeat_interleave(counts)
        #: Row of each vertex inside its owner's shard.
        self.local = local
        #: Global ids of the vertices this rank owns, in shard order.
        self.owned = order[starts[rank] : starts[rank] + counts[rank]]
        if shard.num_nodes != self.owned.numel():
            raise ValueError(
                f"shard has {shard.num_nodes} rows but rank {rank} owns {self.owned.numel()}"
            )
        if node_feat is not None and node_feat.shape[0] != self.owned.numel():
            raise ValueError(
                f"node_feat has {node_feat.shape[0]} rows but rank {rank} owns {self.owned.numel()}"
            )
        # The padding id N (fixed-slot batches) has no owner (P) and reads the scratch row.
        self._owner_ext = torch.cat([self.owner, self.owner.new_full((1,), world_size)])
        self._local_ext = torch.cat([local, local.new_full((1,), shard.scratch)])
        self._ranks = torch.arange(world_size, device=dev)
        #: (owned, d_n) the owned vertices' features, or None.
        self.node_feat = node_feat
        self._feat_ext = None
        if node_feat is not None:
            # With a zero row for the scratch slot.
            self._feat_ext = torch.cat([node_feat, node_feat.new_zeros(1, node_feat.shape[1])])
        self.read_codec, self.write_codec, self._wire = _codecs(shard, node_feat)
        self.counter = CommCounter(dev)
        #: Largest excess over a capacity seen (fetch, push); > 0 means rows were
        #: dropped and the run must stop (:meth:`check`).
        self.overflow = torch.zeros(2, dtype=torch.int64, device=dev)
        # Winners over global ids: the per-node maximum key, -1 between calls.
        self._best = torch.full((n + 1,), -1, dtype=torch.int64, device=dev)
        self._splits: dict[str, _Splits] = {}
        self.capacities: dict[str, Capacities] = {}
        self._held: DenseUpdate | None = None

    def owners(self) -> torch.Tensor:
        """(N + 1,) int64 owner rank of every vertex, then P for the padding id N."""
        return self._owner_ext

    # ----------------------------------------------------------------- sizes
    def set_capacities(self, mode: str, caps: Capacities) -> None:
        """Fixes the split sizes of one kind of step ("train" or "eval")."""
        p, r, dev = self.world_size, self.rank, self.owner.device
        for name, m in (("fetch", caps.fetch), ("push", caps.push)):
            if len(m) != p or any(len(row) != p for row in m):
                raise ValueError(f"{name} capacities must be {p} x {p}")

        def offsets(sizes: list[int]) -> torch.Tensor:
            t = torch.tensor(sizes, dtype=torch.int64, device=dev)
            return torch.cumsum(t, 0) - t

        fs = [int(caps.fetch[r][q]) if q != r else 0 for q in range(p)]
        fr = [int(caps.fetch[q][r]) if q != r else 0 for q in range(p)]
        ps = [int(caps.push[r][q]) if q != r else 0 for q in range(p)]
        pr = [int(caps.push[q][r]) if q != r else 0 for q in range(p)]
        self._splits[mode] = _Splits(
            fs,
            fr,
            ps,
            pr,
            torch.tensor(fs, dtype=torch.int64, device=dev),
            offsets(fs),
            torch.tensor(ps, dtype=torch.int64, device=dev),
            offsets(ps),
        )
        self.capacities[mode] = caps

    def check(self) -> None:
        """Raises if a batch needed more than a capacity (reads the flag: a host sync).

        Raises:
            CapacityError: Naming the capacity that was too small.
        """
        fetch, push = self.overflow.tolist()
        if fetch > 0 or push > 0:
            kind = "fetch" if fetch > 0 else "push"
            excess = fetch if fetch > 0 else push
            caps = {m: getattr(c, kind)[self.rank] for m, c in self.capacities.items()}
            raise CapacityError(
                f"rank {self.rank}: a batch needed {excess} more {kind} rows than the "
                f"capacity {caps} (per peer) holds; no result of this run is valid. "
                "Raise dist.capacity_slack (the capacities come from an exact replay of "
                "the first epoch; later epochs draw other negatives)"
            )

    # ------------------------------------------------------------- routing
    def _route(
        self, own: torch.Tensor, use: torch.Tensor, cap: torch.Tensor, off: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slots in a send buffer grouped by destination rank.

        Args:
            own: (S,) destination rank of each item (P for none).
            use: (S,) bool, items to send.
            cap: (P,) capacity towards each rank.
            off: (P,) first slot of each rank's part.

        Returns:
            dest (S,): the slot of each sent item, or the dump slot ``cap.sum()`` for
            the rest; ok (S,): sent and within capacity; excess (): the largest
            count over a capacity (<= 0 when everything fits).
        """
        p = self.world_size
        q = own.clamp(max=p - 1)
        hot = (own[:, None] == self._ranks[None, :]) & use[:, None]
        # Position of each item among the items for the same rank, in slot order.
        rank_in = torch.cumsum(hot.to(torch.int64), 0).gather(1, q[:, None]).squeeze(1) - 1
        counts = hot.sum(0)
        ok = use & (rank_in < cap[q])
        total = cap.sum()
        dest = torch.where(ok, off[q] + rank_in, total)
        return dest, ok, (counts - cap).max()

    def _a2a(
        self,
        send: torch.Tensor,
        send_sizes: list[int],
        recv_sizes: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        recv = send.new_empty((sum(recv_sizes), *send.shape[1:]))
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
        return recv

    # --------------------------------------------------------------- fetch
    def plan(
        self, nodes: Tensor, occurrences: Tensor, mode: str = "train", group: Group = None
    ) -> FetchPlan:
        """Sends the ids of the remote nodes a batch reads to their owners, each once.

        Depends only on ids and ownership, never on memory values, so it can run ahead
        of the step (prefetch, on a side stream and a group of its own); its bytes are
        counted when the plan is fetched.

        Args:
            nodes: (U,) int64 distinct node ids in fixed slots (N: padding).
            occurrences: (U,) reads of each node by real events
                (:func:`read_occurrences`); a node read 0 times is not fetched.
            mode: Whose capacities ("train" or "eval").
            group: Process group of the id exchange (None: the fetch group).

        Returns:
            The plan, for :meth:`fetch`.
        """
        if self.world_size == 1:
            # No peer: nothing to plan (every row is local; see fetch).
            return FetchPlan(nodes, *([None] * 6))
        sp = self._splits[mode]
        needed = occurrences > 0
        own = self._owner_ext[nodes]
        mine = needed & (own == self.rank)
        remote = needed & (own != self.rank) & (own < self.world_size)
        dest, ok, excess = self._route(own, remote, sp.fetch_cap, sp.fetch_off)
        total = sum(sp.fetch_send)
        send = torch.full((total + 1,), -1, dtype=torch.int64, device=nodes.device)
        # Items beyond their capacity and unsent ones all land in the dump slot.
        send.scatter_(0, dest, torch.where(ok, nodes, -1))
        group = self.group if group is None else group
        req = self._a2a(send[:total], sp.fetch_send, sp.fetch_recv, group)
        naive = (occurrences * remote).sum()
        return FetchPlan(nodes, mine, ok, dest, req, naive, excess)

    def fetch(
        self,
        batch: Batch | FetchPlan | torch.Tensor,
        mode: str = "train",
        early: EarlyRows | None = None,
    ) -> MemoryRows:
        """The rows of a batch's nodes: local ones from the shard, remote ones from their
        owners, each node once; slots no real event reads get zero rows (``early`` is
        always None here: :meth:`read_ahead` reads nothing ahead across ranks).

        Every rank must call it for the same batch (it serves the others' requests from
        its shard as it is now). With staleness 1 the previous batch's write-back is
        committed after the read.

        Args:
            batch: The batch (planned here), or its :meth:`plan`.
            mode: Whose capacities ("train" or "eval").

        Returns:
            The rows aligned with the nodes (with ``node_feat`` when the exchange holds
            node features).
        """
        if self.world_size == 1:
            # A group of one: the trivial exchange (one owner, local rows = global ids),
            # so that a launched single rank runs the one-process step plus its
            # gradient all-reduce.
            nodes = batch if isinstance(batch, torch.Tensor) else batch.nodes
            rows = self.shard.gather(nodes)
            if self._feat_ext is not None:
                rows.node_feat = self._feat_ext[nodes]
            if self.staleness == 1 and mode == "train":
                self._commit_held()
            return rows
        if isinstance(batch, torch.Tensor):
            raise TypeError("across ranks a fetch takes the batch or its plan, not bare ids")
        plan = (
            batch
            if isinstance(batch, FetchPlan)
            else self.plan(batch.nodes, read_occurrences(batch), mode)
        )
        sp = self._splits[mode]
        total = sum(sp.fetch_send)
        asked = plan.req >= 0
        loc = torch.where(asked, self._local_ext[plan.req.clamp(min=0)], self.shard.scratch)
        packed = self.read_codec.pack(self._row_cols(loc))
        back = self._a2a(packed, sp.fetch_recv, sp.fetch_send, self.group)
        back = torch.cat([back, back.new_zeros(1, back.shape[1])])
        remote_cols = self.read_codec.unpack(back[torch.where(plan.ok, plan.dest, total)])
        mine = plan.mine
        local_cols = self._row_cols(
            torch.where(mine, self._local_ext[plan.nodes], self.shard.scratch)
        )
        cols = [
            torch.where(mine.view(-1, *([1] * (a.dim() - 1))), a, b)
            for a, b in zip(local_cols, remote_cols)
        ]
        rb = self.read_codec.row_bytes
        zero = torch.zeros((), dtype=torch.int64, device=mine.device)
        self.counter.value += torch.stack(
            [
                plan.ok.sum() * ID_BYTES,
                asked.sum() * rb,
                zero,
                zero,
                plan.naive * (ID_BYTES + rb),
            ]
        )
        self.overflow[0] = torch.maximum(self.overflow[0], plan.excess)
        if self.staleness == 1 and mode == "train":
            self._commit_held()
        return MemoryRows(*cols[:5], node_feat=cols[5] if len(cols) > 5 else None)

    def _row_cols(self, loc: torch.Tensor) -> list[torch.Tensor]:
        rows = self.shard.gather(loc)
        cols = [rows.memory, rows.last_update, rows.mail, rows.mail_ts, rows.mail_valid]
        if self._feat_ext is not None:
            cols.append(self._feat_ext[loc])
        return cols

    # ---------------------------------------------------------------- push
    def push(self, update: DenseUpdate, mode: str = "train") -> None:
        """Sends each node the share writes once to its owner; owners keep the latest.

        On CUDA the transfer and the commit run on a side stream (on the push group),
        so that they overlap whatever the caller does next (the backward, the gradient
        all-reduce, the optimizer); :meth:`wait` joins it. The write-back reads only
        detached values of the forward, never the parameters.
        """
        if update.key.is_cuda and self.world_size > 1:
            self._push_beside(lambda: self._push(update, mode), update)
        else:
            self._push(update, mode)

    def _push(self, update: DenseUpdate, mode: str) -> None:
        if self.world_size == 1:
            if self.staleness == 0 or mode != "train":
                self.shard.commit_dense(update)
            else:
                self._held = _copy_into(self._held, update)
            return
        sp = self._splits[mode]
        n, dev = self.num_nodes, update.key.device
        fdt = self.shard.dtype
        best = self._best
        # This rank's winner per node first (its latest event), so that each node
        # travels once.
        win_m = winner_rows(best, update.nodes, update.key, n) < n
        win_q = winner_rows(best, update.mail_nodes, update.mail_key, n) < n
        ids = torch.cat(
            [torch.where(win_m, update.nodes, n), torch.where(win_q, update.mail_nodes, n)]
        )
        slots, inv = dedupe_fixed(ids, n)
        s, p1 = ids.shape[0], update.nodes.shape[0]
        pm = torch.where(win_m, inv[:p1], s)
        pq = torch.where(win_q, inv[p1:], s)

        def put(idx: torch.Tensor, src: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full((s + 1, *src.shape[1:]), fill, dtype=src.dtype, device=dev)
            # Losers all go to the scratch slot s, dropped below.
            return out.index_copy_(0, idx, src)[:s]

        memory = put(pm, update.memory.detach().to(fdt), 0.0)
        last_update = put(pm, update.last_update.to(torch.float64), 0.0)
        key = put(pm, update.key, -1)
        has_mem = put(pm, win_m, False)
        mail = put(pq, update.mail.detach().to(fdt), 0.0)
        mail_ts = put(pq, update.mail_ts.to(torch.float64), 0.0)
        mail_key = put(pq, update.mail_key, -1)
        has_mail = put(pq, win_q, False)
        own = self._owner_ext[slots]
        mine = own == self.rank
        remote = (own != self.rank) & (own < self.world_size)
        dest, ok, excess = self._route(own, remote, sp.push_cap, sp.push_off)
        cols = [slots, memory, last_update, key, mail, mail_ts, mail_key, has_mem, has_mail]
        wire = self._wire.pack(cols)
        total = sum(sp.push_send)
        send = wire.new_zeros(total + 1, wire.shape[1])
        send.index_copy_(0, dest, wire)
        recv = self._a2a(send[:total], sp.push_send, sp.push_recv, self.push_group)
        got = self._wire.unpack(recv)
        # All-zero padding rows carry neither flag, so they write nothing.
        both = [torch.cat([a, b]) for a, b in zip(got, cols)]
        both[7] = torch.cat([got[7], has_mem & mine])
        both[8] = torch.cat([got[8], has_mail & mine])
        wb = self.write_codec.row_bytes
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        self.counter.value += torch.stack(
            [
                ok.sum() * ID_BYTES,
                zero,
                ok.sum() * wb,
                zero,
                ((update.mail_key >= 0) & (self._owner_ext[update.mail_nodes] != self.rank)).sum()
                * (ID_BYTES + wb),
            ]
        )
        self.overflow[1] = torch.maximum(self.overflow[1], excess)
        held = self._owned_update(both)
        if self.staleness == 0 or mode != "train":
            self.shard.commit_dense(held)
        else:
            self._held = _copy_into(self._held, held)

    def _owned_update(self, cols: list[torch.Tensor]) -> DenseUpdate:
        """The write-back of this rank's shard from the rows it received and its own
        (node id, memory, last update, key, mail, mail time, mail key, has memory, has
        mail): rows in shard order, a flag-less row to the scratch row with key -1."""
        nodes, memory, last_update, key, mail, mail_ts, mail_key, has_mem, has_mail = cols
        loc = self._local_ext[torch.where(has_mem | has_mail, nodes, self.num_nodes)]
        scratch = self.shard.scratch
        return DenseUpdate(
            nodes=torch.where(has_mem, loc, scratch),
            memory=memory,
            last_update=last_update,
            key=torch.where(has_mem, key, -1),
            mail_nodes=torch.where(has_mail, loc, scratch),
            mail=mail,
            mail_ts=mail_ts,
            mail_key=torch.where(has_mail, mail_key, -1),
        )

    def _commit_held(self) -> None:
        if self._held is not None:
            # Keys of -1 (nothing held) make this a no-op, so a captured graph can
            # always run it.
            self.shard.commit_dense(self._held)

    def flush(self) -> None:
        """Staleness 1: commits the held write-back now (at a drained boundary: the end
        of an epoch, a checkpoint, an evaluation), so that the shard is complete."""
        if self._held is not None:
            self._commit_held()
            self.drop_held()

    def drop_held(self) -> None:
        """Forgets a held write-back (its keys go to -1: it then writes nothing)."""
        if self._held is not None:
            self._held.key.fill_(-1)
            self._held.mail_key.fill_(-1)

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors a step modifies besides the shard (saved around a warm-up; a
        write-back held for staleness 1 is dropped after it instead)."""
        return [self.counter.value, self.overflow]

    def epoch_bytes(self) -> dict[str, Any]:
        """Every rank's bytes of the epoch so far, gathered on every rank (a collective).

        Returns:
            The ``comm_*`` fields of a ``metrics.jsonl`` line: totals, per-rank lists
            (exchange = ids + rows served + rows written; gradients apart; the naive
            volume) and the exchange's max/mean over ranks.
        """
        mine = self.counter.value.clone()
        allr = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(allr, mine, group=self.group)
        per = torch.stack(allr).cpu()
        exch = per[:, 0] + per[:, 1] + per[:, 2]
        total = exch + per[:, 3]
        return {
            "comm_bytes": int(total.sum()),
            "comm_bytes_exchange": int(exch.sum()),
            "comm_bytes_grads": int(per[:, 3].sum()),
            "comm_bytes_naive": int(per[:, 4].sum()),
            "comm_bytes_naive_per_rank": per[:, 4].tolist(),
            "comm_bytes_per_rank": total.tolist(),
            "comm_bytes_exchange_per_rank": exch.tolist(),
            "comm_bytes_max_rank": int(total.max()),
            "comm_max_over_mean": float(exch.max() / max(float(exch.float().mean()), 1.0)),
        }

    def state_dict(self) -> dict[str, int]:
        """The byte counters of the epoch so far (checkpoints are taken drained)."""
        return self.counter.read()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Sets the byte counters from :meth:`state_dict`."""
        for k in state:
            if k not in COUNTERS:
                raise KeyError(f"CommCounter has no counter {k!r}")
        self.counter.value.copy_(
            torch.tensor([int(state.get(k, 0)) for k in COUNTERS], dtype=torch.int64)
        )


def _codecs(
    shard: MemoryState, node_feat: torch.Tensor | None
) -> tuple[RowCodec, RowCodec, RowCodec]:
    """The row formats of the exchange: a read row (memory, last update, mail, mail
    times, mail validity, and the node's features where there are some), a write row
    and a write row on the wire (its node id in front, counted as ID_BYTES)."""
    m, d, dm = shard.mailbox_size, shard.memory_dim, shard.mail_dim
    fdt = shard.dtype
    read_specs = [
        ((d,), fdt),
        ((), torch.float64),
        ((m, dm), fdt),
        ((m,), torch.float64),
        ((m,), torch.bool),
    ]
    if node_feat is not None:
        read_specs.append(((node_feat.shape[1],), node_feat.dtype))
    # Write rows: memory, last update, its event key, mail, mail time, its event key,
    # and which of the two the row carries.
    write_specs = [
        ((d,), fdt),
        ((), torch.float64),
        ((), torch.int64),
        ((dm,), fdt),
        ((), torch.float64),
        ((), torch.int64),
        ((), torch.bool),
        ((), torch.bool),
    ]
    return RowCodec(read_specs), RowCodec(write_specs), RowCodec([((), torch.int64), *write_specs])


def _copy_into(held: DenseUpdate | None, new: DenseUpdate) -> DenseUpdate:
    """Keeps a write-back in buffers of fixed address (a captured graph refills them)."""
    if held is None:
        return DenseUpdate(*(t.clone() for t in vars(new).values()))
    for name, t in vars(new).items():
        getattr(held, name).copy_(t)
    return held
