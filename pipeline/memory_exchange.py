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

import math
from collections.abc import Callable
from dataclasses import dataclass

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
    def _exchange(
        self, send: torch.Tensor, send_counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """all_to_all of rows grouped by destination; returns received rows and counts."""
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        recv = send.new_empty((sum(rc), *send.shape[1:]))
        dist.all_to_all_single(recv, send, rc, sc, group=self.group)
        return recv, recv_counts

    def _remote_bytes(self, counts: torch.Tensor, row_bytes: int) -> int:
        c = counts.clone()
        c[self.rank] = 0
        return int(c.sum()) * row_bytes

    # -------------------------------------------------------------------- fetch
    def fetch(self, nodes: torch.Tensor, occurrences: torch.Tensor | None = None) -> MemoryRows:
        """Reads the rows of ``nodes`` from their owners, each node once.

        Args:
            nodes: (U,) int64 unique node ids.
            occurrences: (U,) how often each node occurs in the batch (for the naive
                volume); None counts each once.

        Returns:
            The rows, aligned with ``nodes`` (with ``node_feat`` when the exchange
            holds node features).
        """
        own = self.owner[nodes]
        order = torch.argsort(own, stable=True)
        send_ids = nodes[order]
        send_counts = torch.bincount(own, minlength=self.world_size)
        recv_ids, recv_counts = self._exchange(send_ids, send_counts)
        self.lap("id_exchange")
        local = self.local[recv_ids]
        rows = self.shard.gather(local)
        cols = [rows.memory, rows.last_update, rows.mail, rows.mail_ts, rows.mail_valid]
        if self.node_feat is not None:
            cols.append(self.node_feat[local])
        packed = self.read_codec.pack(cols)
        # Replies go back in the order the requests came, so the requester's counts
        # are the split sizes on both sides.
        back, _ = self._exchange(packed, recv_counts)
        self.counter.ids += self._remote_bytes(send_counts, ID_BYTES)
        self.counter.read_rows += self._remote_bytes(recv_counts, self.read_codec.row_bytes)
        if occurrences is not None:
            remote = own != self.rank
            self.counter.naive += int(occurrences[remote].sum()) * (
                ID_BYTES + self.read_codec.row_bytes
            )
        out = []
        for part in self.read_codec.unpack(back):
            full = torch.empty_like(part)
            full[order] = part
            out.append(full)
        return MemoryRows(*out)

    # --------------------------------------------------------------------- push
    def push(self, update: MemoryUpdate, naive_rows: int | None = None) -> None:
        """Sends each updated node to its owner once; owners keep the latest event's row.

        A node's new memory and new mail travel in one row with one id, whether it gets
        both (an endpoint) or only a mail (an APAN neighbour).

        Args:
            update: This rank's write-back (node ids global).
            naive_rows: Rows a scheme without per-batch de-duplication would send (one
                per remote positive occurrence), for the counter.
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
        ids, _ = self._exchange(nodes[order], counts)
        cols = [memory, last_update, key, mail, mail_ts, mail_key, has_mem, has_mail]
        rows, _ = self._exchange(self.write_codec.pack([c[order] for c in cols]), counts)
        memory, last_update, key, mail, mail_ts, mail_key, has_mem, has_mail = (
            self.write_codec.unpack(rows)
        )
        self.counter.ids += self._remote_bytes(counts, ID_BYTES)
        self.counter.write_rows += self._remote_bytes(counts, self.write_codec.row_bytes)
        if naive_rows is not None:
            self.counter.naive += naive_rows * (ID_BYTES + self.write_codec.row_bytes)
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
