"""APAN: Wang et al., "APAN: Asynchronous Propagation Attention Network for Real-time
Temporal Graph Embedding", SIGMOD 2021.

A mailbox of the M latest mails per node. When a node is read, its memory attends over
the mailbox (query: the memory; keys and values: each mail with the encoding of its age
at the time of the read), and the memory becomes ReLU(W LayerNorm(attention + memory)),
as in TGL's APAN. Each event's mail is delivered to both endpoints and to their sampled
neighbours.

The embedding is the memory projected by the time since the node's own last event,
h = m * (1 + w dt) (JODIE's projection; TGL's ``time_transform: JODIE``, whose dt is
the time since the node's memory was last written, ``mem_ts``). Without it the
embedding is frozen between a node's updates, so a node silent for two months scores
like one active an hour ago. On CollegeMsg, where the test period's random negatives
are mostly long-silent nodes, that made test AP fall far under val AP and decay with
time; with the projection test AP is at or above val AP. The dt is not the age of the
newest mail: mail delivered by a neighbour's event would make a silent node look
active, and test AP lower (docs/accuracy.md, "APAN: the val/test gap", has both
ablations).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sven import kernels
from sven.models.base import (
    MemoryModel,
    TimeProjection,
    endpoint_keys,
    keyed_dropout,
)
from sven.models.memory import DenseUpdate, MemoryRows
from sven.models.updaters import TimeEncoding
from sven.pipeline import constants
from sven.pipeline.batch import Batch

if TYPE_CHECKING:
    from sven.config import ModelConfig


def first_occurrences(nbr: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The valid neighbour slots whose node is not in an earlier valid slot of its row.

    A node sampled twice for one side (uniform sampling draws with replacement, and the
    most recent list repeats a neighbour of several events) would be two write-back
    candidates with the same node and the same key. The write-back's contract is one
    winner per node (distinct keys): with a tie both win, and with a mail queue (M > 1)
    the Triton commit would shift that row twice at once, a race. The duplicates carry
    the same mail, so keeping the first is the same write.

    Args:
        nbr: (R, k) int64 sampled neighbours.
        mask: (R, k) bool valid slots.

    Returns:
        (R, k) bool: ``mask`` without the repeats of a node within a row.
    """
    k = nbr.shape[1]
    dev = nbr.device
    # Invalid slots get ids of their own (-1 - slot), which match nothing.
    own = constants.values(tuple(range(-1, -k - 1, -1)), torch.int64, dev)
    ids = torch.where(mask, nbr, own)
    earlier = constants.values(
        tuple(j < i for i in range(k) for j in range(k)), torch.bool, dev
    ).view(k, k)
    repeat = ((ids[:, :, None] == ids[:, None, :]) & earlier).any(-1)
    return mask & ~repeat


class APAN(MemoryModel):
    """APAN with mailbox attention, neighbour mail delivery and time-projected embeddings.

    Args:
        mailbox_size: M, mails kept per node.
        num_heads: Heads of the mailbox attention.
        dropout: Dropout on the updated memory.
        time_scale: Divides the time since the node's last event before the projection
            (the trainer passes the training data's time-gap std, as for JODIE).
        **kwargs: See :class:`~sven.models.base.MemoryModel` (``cell`` and ``message``
            are not used: the mailbox attention is APAN's updater).
    """

    sample_roots = "positive"
    read_neighbors = False
    deliver_to_neighbors = True

    @classmethod
    def config_kwargs(cls, model_cfg: ModelConfig, **facts: Any) -> dict[str, Any]:
        """The base class's keyword arguments, heads, dropout, mailbox size, time scale."""
        kwargs = super().config_kwargs(model_cfg, **facts)
        kwargs.update(
            num_heads=model_cfg.num_heads,
            dropout=model_cfg.dropout,
            mailbox_size=model_cfg.mailbox_size,
            time_scale=cls._time_scale(facts.get("train_events")),
        )
        return kwargs

    def __init__(
        self,
        *,
        mailbox_size: int = 10,
        num_heads: int = 2,
        dropout: float = 0.1,
        time_scale: float = 1.0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        d = self.memory_dim
        if d % num_heads:
            raise ValueError(f"memory dim {d} not divisible by {num_heads} heads")
        self.mailbox_size = mailbox_size
        self.num_heads = num_heads
        # The mailbox attention replaces the recurrent cell of the base class.
        self.updater = None
        self.mail_time = TimeEncoding(self.time_dim)
        self.w_q = nn.Linear(d, d)
        self.w_kv = nn.Linear(self.mail_dim + self.time_dim, 2 * d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Linear(d, d)
        self.dropout = nn.Dropout(dropout)
        self.time_proj = TimeProjection(d, time_scale)
        self.out = nn.Identity() if self.embed_dim == d else nn.Linear(d, self.embed_dim)

    def encode(self, batch: Batch, rows: MemoryRows) -> tuple[torch.Tensor, DenseUpdate]:
        """The base class's encoding, with the memory computed once per root rather than
        per unique node.

        The mailbox is read at each root's own time (as TGL, whose memory rows are the
        roots). A per-node read time would be a reduction over the node's roots, which
        on several ranks sees only this rank's roots; per root, every rank computes
        what one process computes, and the written memory of a node is the row of its
        last event in the batch, read at that event's time.
        """
        rp = batch.root_pos
        per_root = dataclasses.replace(
            batch,
            nodes=batch.nodes[rp],
            root_pos=torch.arange(rp.numel(), device=rp.device),
            node_feat=None if batch.node_feat is None else batch.node_feat[rp],
            node_key=None if batch.node_key is None else batch.node_key[rp],
            # The slots are the roots now: the de-duplication's runs no longer apply.
            runs=None,
        )
        root_rows = MemoryRows(
            rows.memory[rp],
            rows.last_update[rp],
            rows.mail[rp],
            rows.mail_ts[rp],
            rows.mail_valid[rp],
            None if rows.node_feat is None else rows.node_feat[rp],
        )
        return super().encode(per_root, root_rows)

    def current_memory(self, batch: Batch, rows: MemoryRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Mailbox attention at the read time; returns memory (R, d), last_update (R,).

        Rows are the roots (see :meth:`forward`). Each mail's key carries its age at the
        root's time (TGL: root time minus mail time), not its age relative to the
        node's newest mail, which says nothing of how long the node has been silent.
        last_update is returned as stored: the time of the node's last event as an
        endpoint (see :meth:`write_back`), not of its newest mail.
        """
        u, m, _ = rows.mail.shape
        age = (batch.root_t[:, None] - rows.mail_ts).clamp_min(0.0)
        age = age.masked_fill(~rows.mail_valid, 0.0)
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
        new = self.mlp(self.norm(msg + rows.memory))
        # One row per node of the batch: keyed by (global batch, node).
        new = torch.relu(keyed_dropout(new, self.dropout.p, batch.node_key, self.training))
        has_mail = rows.mail_valid[:, 0]
        memory = torch.where(has_mail[:, None], new, rows.memory)
        return memory, rows.last_update

    def write_back(
        self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor
    ) -> DenseUpdate:
        """The base class's write-back, with each endpoint's last-update time set to its
        event's time (TGL's ``mem_ts``: when the memory was read and rewritten), so that
        the projection measures the node's own silence; ``last_update`` is not used.
        """
        return super().write_back(batch, memory, batch.root_t)

    def embed(self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor) -> torch.Tensor:
        """Memory projected by the time since the node's last event, h = m (1 + w dt); (R, d)."""
        z = self.out(self.node_state(batch, memory)[batch.root_pos])
        return self.time_proj.project(z, batch.root_t - last_update[batch.root_pos])

    def mail_receivers(
        self,
        batch: Batch,
        mail_src: torch.Tensor,
        mail_dst: torch.Tensor,
        endpoints: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Endpoints and their valid sampled neighbours; neighbours of a side get its mail."""
        recv, mails, ts, keys = super().mail_receivers(batch, mail_src, mail_dst, endpoints)
        b = batch.size
        block = batch.block
        k = block.nbr.shape[1]
        # Fixed shapes: every neighbour slot is a candidate; masked slots (and padded
        # events) carry key -1 and write nothing.
        mask = first_occurrences(block.nbr[: 2 * b], block.mask[: 2 * b]).reshape(-1)
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
