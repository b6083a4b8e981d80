"""JODIE: Kumar, Zhang & Leskovec, "Predicting Dynamic Embedding Trajectory in Temporal
Interaction Networks", KDD 2019.

RNN memory and the time-projection embedding h(t) = m * (1 + w * dt), dt the time since
the node's memory was last updated (scaled by the training data's time-gap std).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sven.models.base import MemoryModel, TimeProjection, take_rows
from sven.pipeline.batch import Batch

if TYPE_CHECKING:
    from sven.config import ModelConfig


class JODIE(MemoryModel):
    """JODIE with the time-projection embedding.

    Args:
        time_scale: Divides dt before the projection, so that the linear layer sees
            O(1) inputs whatever the time unit.
        **kwargs: See :class:`~sven.models.base.MemoryModel`.
    """

    @classmethod
    def config_kwargs(cls, model_cfg: ModelConfig, **facts: Any) -> dict[str, Any]:
        """The base class's keyword arguments and the time scale of the training events."""
        kwargs = super().config_kwargs(model_cfg, **facts)
        kwargs["time_scale"] = cls._time_scale(facts.get("train_events"))
        return kwargs

    def __init__(self, *, time_scale: float = 1.0, **kwargs) -> None:
        kwargs.setdefault("cell", "rnn")
        super().__init__(**kwargs)
        self.time_proj = TimeProjection(self.memory_dim, time_scale)
        self.out = (
            nn.Identity()
            if self.embed_dim == self.memory_dim
            else nn.Linear(self.memory_dim, self.embed_dim)
        )

    def embed(self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor) -> torch.Tensor:
        """Time-projected memory of every root; (R, embed_dim)."""
        z = take_rows(self.node_state(batch, memory), batch.root_pos)
        return self.out(self.time_proj.project(z, batch.root_t - last_update[batch.root_pos]))
