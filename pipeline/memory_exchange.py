"""Redundancy-free memory exchange between ranks that own disjoint sets of vertices.

Rank r owns the memory, mailbox and last-update time of the vertices v with
``owner[v] == r``, stored as a :class:`~sven.models.memory.MemoryState` shard whose row
``local[v]`` holds v, and their static node features, if any (they travel with the
fetched rows, so no rank holds the whole feature table). Per batch,
:meth:`MemoryExchange.fetch` sends each unique node id a rank needs to its owner once
and receives its row once (two ``all_to_all_single`` calls with variable splits, plus
one for the split sizes); :meth:`MemoryExchange.push` sends each updated node once to
its owner, which keeps the update of the latest global event when several ranks update
the same node. The model code never calls a collective.

Rows travel as raw bytes so that float memory and float64 timestamps share one message
without a lossy cast. Every byte sent to another rank is counted in :class:`CommCounter`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sven.models.memory import MemoryRows, MemoryState, MemoryUpdate
from sven.pipeline.batch import last_occurrence

ID_BYTES = 8


@dataclass
class CommCounter:
    """Bytes this rank sent to other ranks, by kind (ids, memory rows, mail rows, grads).

    ``naive`` counts what a scheme without de-duplication would send: one request and one
    row per occurrence of a remote node in the batch, one row per remote update.
    """

    ids: int = 0
    read_rows: int = 0
    write_rows: int = 0
    grads: int = 0
    naive: int = 0

    def reset(self) -> None:
        """Zeroes every counter."""
        self.ids = self.read_rows = self.write_rows = self.grads = self.naive = 0


class _RowCodec:
    """Packs per-node tensors of mixed dtypes into uint8 rows and back."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.specs = specs
        self.numels = [math.prod(shape) for shape, _ in specs]
        self.sizes = [
            n * torch.empty((), dtype=dt).element_size() for n, (_, dt) in zip(self.numels, specs)
        ]
        self.row_bytes = sum(self.sizes)

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """(n, ...) tensors -> (n, row_bytes) uint8."""
        n = tensors[0].shape[0]
        parts = []
        for t, numel in zip(tensors, self.numels):
            flat = t.contiguous().reshape(n, numel)
            # Bool has no byte view guarantee across versions; convert explicitly.
            parts.append(flat.to(torch.uint8) if t.dtype == torch.bool else flat.view(torch.uint8))
        return torch.cat(parts, dim=1)

    def unpack(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """(n, row_bytes) uint8 -> the tensors, in spec order."""
        n = rows.shape[0]
        out, off = [], 0
        for (shape, dt), size in zip(self.specs, self.sizes):
            # A fresh 1-D buffer: a column slice of a one-row tensor keeps an odd stride
            # and storage offset, which a dtype view rejects.
            chunk = rows[:, off : off + size].reshape(-1).clone()
            off += size
            t = chunk.to(torch.bool) if dt == torch.bool else chunk.view(dt)
            out.append(t.reshape(n, *shape))
        return out


class MemoryExchange:
    """Fetches and pushes memory rows between owners.

    Args:
        owner: (N,) int owner rank of every vertex (identical on all ranks).
        rank: This rank.
        world_size: P.
        shard: This rank's :class:`MemoryState` with one row per owned vertex.
        group: Process group (None: the default group).
        node_feat: (owned, d_n) static features of the owned vertices in shard order
            (``owned``), or None; ``fetch`` then returns them in ``MemoryRows.node_feat``.
    """

    def __init__(
        self,
        owner: torch.Tensor,
        rank: int,
        world_size: int,
        shard: MemoryState,
        group: dist.ProcessGroup | None = None,
        node_feat: torch.Tensor | None = None,
    ) -> None:
        self.owner = owner.to(torch.int64)
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.shard = shard
        n = owner.numel()
        order = torch.argsort(self.owner, stable=True)
        counts = torch.bincount(self.owner, minlength=world_size)
        starts = torch.cumsum(counts, 0) - counts
        local = torch.empty(n, dtype=torch.int64, device=owner.device)
        local[order] = torch.arange(n, device=owner.device) - starts.repeat_interleave(counts)
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
        self.node_feat = node_feat
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
        self.read_codec = _RowCodec(read_specs)
        # Write rows: memory, last update, its event key, mail, mail time, its event
        # key, and which of the two the row carries.
        self.write_codec = _RowCodec(
            [
                ((d,), fdt),
                ((), torch.float64),
                ((), torch.int64),
                ((dm,), fdt),
                ((), torch.float64),
                ((), torch.int64),
                ((), torch.bool),
                ((), torch.bool),
            ]
        )
        self.counter = CommCounter()
        #: Called with "id_exchange" when a fetch's ids reached their owners
        #: (``sven.timeline.Timeline.lap``; the trainer sets it).
        self.lap: Callable[[str], None] = lambda stage: None

    # -------------------------------------------------------------- collectives
    def state_dict(self) -> dict[str, int]:
        """The byte counters of the epoch so far (:class:`CommCounter`'s fields).

        The shard is a component of its own and is saved apart; plans and handles in
        flight are not state (checkpoints are taken with the write-back drained).
        """
        return dataclasses.asdict(self.counter)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Sets the byte counters from :meth:`state_dict`."""
        for k, v in state.items():
            if not hasattr(self.counter, k):
                raise KeyError(f"CommCounter has no counter {k!r}")
            setattr(self.counter, k, int(v))

    def epoch_bytes(self) -> dict[str, Any]:
        """Every rank's bytes of the epoch so far, gathered on every rank (a collective).

        Returns:
            The ``comm_*`` fields of a ``metrics.jsonl`` line: totals, per-rank lists
            (exchange = ids + rows served + rows written; gradients apart; the naive
            volume) and the exchange's max/mean over ranks.
        """
        c = self.counter
        mine = torch.tensor(
            [c.ids, c.read_rows, c.write_rows, c.grads, c.naive],
            dtype=torch.int64,
            device=self.owner.device,
        )
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

    def _exchange(
        self,
        send: torch.Tensor,
        send_counts: torch.Tensor,
        group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """all_to_all of rows grouped by destination; returns received rows and counts."""
        group = self.group if group is None else group
        if send.is_cuda and dist.get_backend(group) == "gloo":
            # A host-side group (the prefetch thread's id plans beside NCCL).
            recv, counts = self._exchange(send.cpu(), send_counts.cpu(), group)
            return recv.to(send.device), counts.to(send.device)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        recv = send.new_empty((sum(rc), *send.shape[1:]))
        dist.all_to_all_single(recv, send, rc, sc, group=group)
        return recv, recv_counts

    def _remote_bytes(self, counts: torch.Tensor, row_bytes: int) -> int:
        c = counts.clone()
        c[self.rank] = 0
        return int(c.sum()) * row_bytes

    # -------------------------------------------------------------------- fetch
    def plan(
        self,
        nodes: torch.Tensor,
        occurrences: torch.Tensor | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> Plan:
        """Sends the ids of ``nodes`` to their owners (the id ``all_to_all``), each once.

        Depends only on the ids and the ownership, never on memory values, so it can run
        batches ahead (:mod:`sven.pipeline.prefetch`); its bytes are counted when the
        plan is fetched, so a plan made ahead and never used counts nothing.

        Args:
            nodes: (U,) int64 unique node ids.
            occurrences: (U,) how often each node occurs in the batch (for the naive
                volume); None counts each once.
            group: Process group of the id exchange (None: the exchange's group). A
                plan made in a background thread must use a group of its own, so that
                its collectives never interleave with the main thread's.

        Returns:
            The plan, for :meth:`fetch`.
        """
        own = self.owner[nodes]
        order = torch.argsort(own, stable=True)
        send_counts = torch.bincount(own, minlength=self.world_size)
        recv_ids, recv_counts = self._exchange(
            nodes[order], send_counts, self.group if group is None else group
        )
        naive = 0
        if occurrences is not None:
            naive = int(occurrences[own != self.rank].sum()) * (
                ID_BYTES + self.read_codec.row_bytes
            )
        self.lap("id_exchange")
        return Plan(nodes, order, send_counts, recv_counts, recv_ids, naive)

    def fetch(
        self,
        nodes: torch.Tensor | Plan,
        occurrences: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> MemoryRows | FetchHandle:
        """Reads the rows of a plan's nodes from their owners, each node once.

        Every rank serves the requests its plan received from the current shard (the
        rows are gathered when this is called), so all ranks must call it for the
        same batch.

        Args:
            nodes: A :class:`Plan`, or (U,) int64 unique node ids (then planned here,
                on the exchange's group).
            occurrences: With node ids: (U,) occurrences for the naive volume.
            async_op: Return a :class:`FetchHandle` whose ``wait()`` gives the rows,
                so that the row transfer overlaps other work.

        Returns:
            The rows, aligned with the plan's nodes (with ``node_feat`` when the
            exchange holds node features), or a handle to them.
        """
        plan = nodes if isinstance(nodes, Plan) else self.plan(nodes, occurrences)
        local = self.local[plan.recv_ids]
        rows = self.shard.gather(local)
        cols = [rows.memory, rows.last_update, rows.mail, rows.mail_ts, rows.mail_valid]
        if self.node_feat is not None:
            cols.append(self.node_feat[local])
        packed = self.read_codec.pack(cols)
        # Replies go back in the order the requests came, so the plan's counts are the
        # split sizes on both sides (no count exchange).
        sc, rc = plan.recv_counts.tolist(), plan.send_counts.tolist()
        back = packed.new_empty((sum(rc), packed.shape[1]))
        work = dist.all_to_all_single(back, packed, rc, sc, group=self.group, async_op=async_op)
        self.counter.ids += self._remote_bytes(plan.send_counts, ID_BYTES)
        self.counter.read_rows += self._remote_bytes(plan.recv_counts, self.read_codec.row_bytes)
        self.counter.naive += plan.naive
        handle = FetchHandle(self, plan, back, work)
        return handle if async_op else handle.wait()

    def _unpack_reply(self, plan: Plan, back: torch.Tensor) -> MemoryRows:
        out = []
        for part in self.read_codec.unpack(back):
            full = torch.empty_like(part)
            full[plan.order] = part
            out.append(full)
        return MemoryRows(*out)

    # --------------------------------------------------------------------- push
    def push(
        self, update: MemoryUpdate, naive_rows: int | None = None, async_op: bool = False
    ) -> PushHandle:
        """Sends each updated node to its owner once; owners keep the latest event's row.

        A node's new memory and new mail travel in one row with one id, whether it gets
        both (an endpoint) or only a mail (an APAN neighbour). The owners' shards change
        only in the handle's ``wait()``; every rank must wait for its push before it
        serves a fetch that must see the update.

        Args:
            update: This rank's write-back (node ids global).
            naive_rows: Rows a scheme without per-batch de-duplication would send (one
                per remote positive occurrence), for the counter.
            async_op: Send the ids and rows asynchronously; None of the shard changes
                until ``wait()``. False: the push is complete (committed) on return.

        Returns:
            The handle (already waited for unless ``async_op``).
        """
        nodes = torch.unique(torch.cat([update.nodes, update.mail_nodes]))
        w = nodes.numel()
        # Both lists are sorted and unique, so their rows sit at searchsorted positions.
        pm = torch.searchsorted(nodes, update.nodes)
        pl = torch.searchsorted(nodes, update.mail_nodes)
        dev, fdt = nodes.device, self.shard.dtype
        has_mem = torch.zeros(w, dtype=torch.bool, device=dev)
        has_mail = torch.zeros(w, dtype=torch.bool, device=dev)
        memory = torch.zeros(w, self.shard.memory_dim, dtype=fdt, device=dev)
        last_update = torch.zeros(w, dtype=torch.float64, device=dev)
        key = torch.zeros(w, dtype=torch.int64, device=dev)
        mail = torch.zeros(w, self.shard.mail_dim, dtype=fdt, device=dev)
        mail_ts = torch.zeros(w, dtype=torch.float64, device=dev)
        mail_key = torch.zeros(w, dtype=torch.int64, device=dev)
        has_mem[pm], memory[pm], last_update[pm], key[pm] = (
            True,
            update.memory.to(fdt),
            update.last_update,
            update.key,
        )
        has_mail[pl], mail[pl], mail_ts[pl], mail_key[pl] = (
            True,
            update.mail.to(fdt),
            update.mail_ts,
            update.mail_key,
        )

        own = self.owner[nodes]
        order = torch.argsort(own, stable=True)
        counts = torch.bincount(own, minlength=self.world_size)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        sc, rc = counts.tolist(), recv_counts.tolist()
        cols = [memory, last_update, key, mail, mail_ts, mail_key, has_mem, has_mail]
        send_ids = nodes[order]
        send_rows = self.write_codec.pack([c[order] for c in cols])
        ids = send_ids.new_empty(sum(rc))
        rows = send_rows.new_empty((sum(rc), send_rows.shape[1]))
        works = [
            dist.all_to_all_single(ids, send_ids, rc, sc, group=self.group, async_op=async_op),
            dist.all_to_all_single(rows, send_rows, rc, sc, group=self.group, async_op=async_op),
        ]
        self.counter.ids += self._remote_bytes(counts, ID_BYTES)
        self.counter.write_rows += self._remote_bytes(counts, self.write_codec.row_bytes)
        if naive_rows is not None:
            self.counter.naive += naive_rows * (ID_BYTES + self.write_codec.row_bytes)
        handle = PushHandle(self, ids, rows, works)
        if not async_op:
            handle.wait()
        return handle

    def _commit_received(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Commits the write rows this rank received as an owner."""
        memory, last_update, key, mail, mail_ts, mail_key, has_mem, has_mail = (
            self.write_codec.unpack(rows)
        )
        # Several ranks may update one node: keep the row of the latest event.
        u, p = last_occurrence(ids[has_mem], key[has_mem])
        mu, mp = last_occurrence(ids[has_mail], mail_key[has_mail])
        self.shard.commit(
            MemoryUpdate(
                nodes=self.local[u],
                memory=memory[has_mem][p],
                last_update=last_update[has_mem][p],
                key=key[has_mem][p],
                mail_nodes=self.local[mu],
                mail=mail[has_mail][mp],
                mail_ts=mail_ts[has_mail][mp],
                mail_key=mail_key[has_mail][mp],
            )
        )


@dataclass
class Plan:
    """Where a batch's nodes are read from: the outcome of the id exchange.

    Attributes:
        nodes: (U,) int64 the requested node ids.
        order: (U,) position in ``nodes`` of each request, grouped by owner.
        send_counts: (P,) requests sent to each owner.
        recv_counts: (P,) requests received from each rank.
        recv_ids: (sum(recv_counts),) int64 global ids this rank serves, by requester.
        naive: Bytes a scheme without de-duplication would move for this read.
    """

    nodes: torch.Tensor
    order: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    recv_ids: torch.Tensor
    naive: int = 0


class FetchHandle:
    """A row fetch in flight; ``wait()`` returns the :class:`MemoryRows`."""

    def __init__(
        self, exchange: MemoryExchange, plan: Plan, back: torch.Tensor, work: object
    ) -> None:
        self._exchange, self._plan, self._back, self._work = exchange, plan, back, work
        self._rows: MemoryRows | None = None

    def wait(self) -> MemoryRows:
        """Waits for the rows (once) and returns them aligned with the plan's nodes."""
        if self._rows is None:
            if self._work is not None:
                self._work.wait()
            self._rows = self._exchange._unpack_reply(self._plan, self._back)
            self._back = None
        return self._rows


class PushHandle:
    """A write-back in flight; ``wait()`` commits what this rank received as an owner."""

    def __init__(
        self, exchange: MemoryExchange, ids: torch.Tensor, rows: torch.Tensor, works: list
    ) -> None:
        self._exchange, self._ids, self._rows, self._works = exchange, ids, rows, works
        self.done = False

    def wait(self) -> None:
        """Waits for the transfer and commits the received rows into the shard (once)."""
        if self.done:
            return
        for w in self._works:
            if w is not None:
                w.wait()
        self.done = True
        self._exchange._commit_received(self._ids, self._rows)
        self._ids = self._rows = None
