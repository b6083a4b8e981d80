"""APAN: Wang et al., "APAN: Asynchronous Propagation Attention Network for Real-time
Temporal Graph Embedding", SIGMOD 2021.

A mailbox of the M latest mails per node; the memory update attends over the mailbox
(query: the memory) and feeds the result to a GRU; the embedding is the memory. Each
event's mail is delivered to both endpoints and to their sampled neighbours.
"""

from __future__ import annotations

import torch
from torch import nn

from sven import kernels
from sven.models.base import MemoryModel, endpoint_keys, keyed_dropout, take_rows
from sven.models.memory import MemoryRows, RecurrentUpdater, TimeEncoding
from sven.pipeline.batch import Batch


class APAN(MemoryModel):
    """APAN with mailbox attention and neighbour mail delivery.

    Args:
        mailbox_size: M, mails kept per node.
        num_heads: Heads of the mailbox attention.
        dropout: Dropout on the aggregated message.
        **kwargs: See :class:`~sven.models.base.MemoryModel`.
    """

    sample_roots = "positive"
    read_neighbors = False
    deliver_to_neighbors = True

    def __init__(
        self, *, mailbox_size: int = 10, num_heads: int = 2, dropout: float = 0.1, **kwargs
    ) -> None:
        kwargs.setdefault("cell", "gru")
        super().__init__(**kwargs)
        d = self.memory_dim
        if d % num_heads:
            raise ValueError(f"memory dim {d} not divisible by {num_heads} heads")
        self.mailbox_size = mailbox_size
        self.num_heads = num_heads
        self.mail_time = TimeEncoding(self.time_dim)
        self.w_q = nn.Linear(d, d)
        self.w_kv = nn.Linear(self.mail_dim + self.time_dim, 2 * d)
        self.dropout = nn.Dropout(dropout)
        self.updater = RecurrentUpdater(self.updater.cell_type, d, self.time_dim, d)
        self.out = nn.Identity() if self.embed_dim == d else nn.Linear(d, self.embed_dim)

    def current_memory(self, batch: Batch, rows: MemoryRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Mailbox attention, then the GRU; returns memory (U, d) and last_update (U,)."""
        u, m, _ = rows.mail.shape
        age = (rows.mail_ts[:, :1] - rows.mail_ts).masked_fill(~rows.mail_valid, 0.0)
        dtype = rows.memory.dtype
        kv = self.w_kv(
            torch.cat([rows.mail.to(dtype), self.mail_time(age.to(dtype)).to(dtype)], dim=2)
        )
        key, val = kv.chunk(2, dim=2)
        h = self.num_heads
        q = self.w_q(rows.memory).view(u, h, -1)
        msg = kernels.temporal_attention(
            q, key.reshape(u, m, h, -1), val.reshape(u, m, h, -1), rows.mail_valid
        )
        # One row per node of the batch: keyed by (global batch, node).
        msg = keyed_dropout(msg, self.dropout.p, batch.node_key, self.training)
        return self.updater(rows, msg)

    def embed(self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor) -> torch.Tensor:
        """The (projected) memory of every root; (R, embed_dim)."""
        return self.out(take_rows(self.node_state(batch, memory), batch.root_pos))

    def mail_receivers(
        self, batch: Batch, mail_src: torch.Tensor, mail_dst: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Endpoints and their valid sampled neighbours; neighbours of a side get its mail."""
        recv, mails, ts, keys = super().mail_receivers(batch, mail_src, mail_dst)
        b = batch.size
        block = batch.block
        k = block.nbr.shape[1]
        # Fixed shapes: every neighbour slot is a candidate; masked slots (and padded
        # events) carry key -1 and write nothing.
        mask = block.mask[: 2 * b].reshape(-1)
        side_mail = torch.cat([mail_src, mail_dst]).repeat_interleave(k, dim=0)
        side_t = torch.cat([batch.t, batch.t]).repeat_interleave(k)
        side_key = endpoint_keys(batch, (2, 3)).repeat_interleave(k)
        side_key = torch.where(mask, side_key, torch.full_like(side_key, -1))
        return (
            torch.cat([recv, block.nbr[: 2 * b].reshape(-1)]),
            torch.cat([mails, side_mail]),
            torch.cat([ts, side_t]),
            torch.cat([keys, side_key]),
        )
