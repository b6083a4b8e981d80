"""DyRep: Trivedi et al., "DyRep: Learning Representations over Dynamic Graphs", ICLR 2019.

RNN memory; the embedding is the memory itself; the mail of event (u, v) for u carries
the attention-aggregated memory of v's temporal neighbours (the "structural" term of
the paper), and symmetrically for v.

With ``time_projection`` the embedding is instead the memory projected by the time
since its last update, h = m (1 + w dt) (JODIE's projection, as in Sven's APAN). This is
not in the paper nor in DyGLib: there the embedding is frozen between a node's events,
so a node silent for months scores like one active an hour ago. On CollegeMsg, whose
test-period random negatives are mostly long-silent nodes, that put test AP far under
val AP; with the projection test AP is above val AP (docs/accuracy.md, "CPU
experiments", DyRep).

Mails are stored detached (as in TGN/TGL), so parameters used only inside a mail would
never receive a gradient; the aggregation is therefore parameter-free scaled
dot-product attention with the other node's memory as query.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sven import kernels
from sven.models.base import MemoryModel, TimeProjection, take_rows
from sven.pipeline.batch import Batch

if TYPE_CHECKING:
    from sven.config import ModelConfig


class DyRep(MemoryModel):
    """DyRep with attention-aggregated neighbour messages.

    Args:
        time_projection: Embed as m (1 + w dt) instead of m.
        time_scale: Divides dt before the projection (the trainer passes the training
            data's time-gap std, as for JODIE).
        **kwargs: See :class:`~sven.models.base.MemoryModel`.
    """

    sample_roots = "positive"
    read_neighbors = True

    @classmethod
    def config_kwargs(cls, model_cfg: ModelConfig, **facts: Any) -> dict[str, Any]:
        """The base class's keyword arguments, and the time projection when configured."""
        kwargs = super().config_kwargs(model_cfg, **facts)
        if model_cfg.time_projection:
            kwargs["time_projection"] = True
            kwargs["time_scale"] = cls._time_scale(facts.get("train_events"))
        return kwargs

    def __init__(self, *, time_projection: bool = False, time_scale: float = 1.0, **kwargs) -> None:
        kwargs.setdefault("cell", "rnn")
        super().__init__(**kwargs)
        self.time_proj = TimeProjection(self.memory_dim, time_scale) if time_projection else None
        self.out = (
            nn.Identity()
            if self.embed_dim == self.memory_dim
            else nn.Linear(self.memory_dim, self.embed_dim)
        )

    def embed(self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor) -> torch.Tensor:
        """The memory of every root, time-projected if enabled; (R, embed_dim)."""
        z = take_rows(self.node_state(batch, memory), batch.root_pos)
        if self.time_proj is not None:
            z = self.time_proj.project(z, batch.root_t - last_update[batch.root_pos])
        return self.out(z)

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
        self, batch: Batch, memory: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The other endpoint's structural aggregate (attention over its neighbours;
        ``own`` is not used)."""
        b = batch.size
        return self._structural(batch, memory, b, 2 * b), self._structural(batch, memory, 0, b)
