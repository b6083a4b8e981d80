"""DyRep: Trivedi et al., "DyRep: Learning Representations over Dynamic Graphs", ICLR 2019.

RNN memory; the embedding is the memory itself; the mail of event (u, v) for u carries
the attention-aggregated memory of v's temporal neighbours (the "structural" term of
the paper), and symmetrically for v.

Mails are stored detached (as in TGN/TGL), so parameters used only inside a mail would
never receive a gradient; the aggregation is therefore parameter-free scaled
dot-product attention with the other node's memory as query.
"""

from __future__ import annotations

import torch
from torch import nn

from sven import kernels
from sven.models.base import MemoryModel, take_rows
from sven.pipeline.batch import Batch


class DyRep(MemoryModel):
    """DyRep with attention-aggregated neighbour messages.

    Args:
        **kwargs: See :class:`~sven.models.base.MemoryModel`.
    """

    sample_roots = "positive"
    read_neighbors = True

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("cell", "rnn")
        super().__init__(**kwargs)
        self.out = (
            nn.Identity()
            if self.embed_dim == self.memory_dim
            else nn.Linear(self.memory_dim, self.embed_dim)
        )

    def embed(self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor) -> torch.Tensor:
        """The (projected) memory of every root; (R, embed_dim)."""
        return self.out(take_rows(self.node_state(batch, memory), batch.root_pos))

    def _structural(self, batch: Batch, memory: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Attention of roots lo..hi over their neighbours' memory; (hi - lo, d_mem)."""
        block = batch.block
        mask = block.mask[lo:hi]
        q = take_rows(memory, batch.root_pos[lo:hi])
        kv = take_rows(memory, batch.nbr_pos[lo:hi]) * mask[..., None].to(memory.dtype)
        r, k = mask.shape
        return kernels.temporal_attention(
            q.view(r, 1, -1), kv.view(r, k, 1, -1), kv.view(r, k, 1, -1), mask
        )

    def other_endpoint(
        self, batch: Batch, memory: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The other endpoint's structural aggregate (attention over its neighbours)."""
        b = batch.size
        return self._structural(batch, memory, b, 2 * b), self._structural(batch, memory, 0, b)
