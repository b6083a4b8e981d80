"""TGN: Rossi et al., "Temporal Graph Networks for Deep Learning on Dynamic Graphs",
ICML 2020 GRL workshop (arXiv:2006.10637).

GRU memory, identity message, last-mail aggregation, and one layer of temporal graph
attention over the K most recent neighbours as the embedding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sven.models.base import MemoryModel, TemporalAttentionLayer
from sven.pipeline.batch import Batch

if TYPE_CHECKING:
    from sven.config import ModelConfig


class TGN(MemoryModel):
    """TGN with a one-layer temporal attention embedding.

    Args:
        num_heads: Attention heads (2 in the paper).
        dropout: Dropout in the attention layer.
        **kwargs: See :class:`~sven.models.base.MemoryModel`.
    """

    sample_roots = "all"
    read_neighbors = True

    @classmethod
    def config_kwargs(cls, model_cfg: ModelConfig, **facts: Any) -> dict[str, Any]:
        """The base class's keyword arguments, and the attention's heads and dropout."""
        kwargs = super().config_kwargs(model_cfg, **facts)
        kwargs.update(
            num_heads=model_cfg.num_heads,
            dropout=model_cfg.dropout,
            attention_form=model_cfg.attention_form,
        )
        return kwargs

    def __init__(
        self,
        *,
        num_heads: int = 2,
        dropout: float = 0.1,
        attention_form: str = "auto",
        **kwargs,
    ) -> None:
        kwargs.setdefault("cell", "gru")
        super().__init__(**kwargs)
        self.attn = TemporalAttentionLayer(
            self.memory_dim,
            self.edge_dim,
            self.time_dim,
            self.embed_dim,
            num_heads,
            dropout,
            form=attention_form,
        )

    def embed(self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor) -> torch.Tensor:
        """Attention of every root over its sampled neighbours; (R, embed_dim)."""
        z = self.node_state(batch, memory)
        block = batch.block
        dt = block.age
        if dt is None:
            dt = torch.where(block.mask, batch.root_t[:, None] - block.ts.to(torch.float64), 0.0)
        feat, rows = batch.neighbour_edges()
        return self.attn(
            z,
            batch.root_pos,
            batch.nbr_pos,
            dt,
            block.mask,
            feat,
            batch.root_key,
            rows,
            runs=batch.runs,
        )
