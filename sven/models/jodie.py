"""JODIE: Kumar, Zhang & Leskovec, "Predicting Dynamic Embedding Trajectory in Temporal
Interaction Networks", KDD 2019.

RNN memory and the time-projection embedding h(t) = m * (1 + w * dt), dt the time since
the node's memory was last updated (scaled by the training data's time-gap std).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sven.models.base import MemoryModel, take_rows
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
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.time_scale = float(time_scale)
        self.time_proj = nn.Linear(1, self.memory_dim)
        nn.init.normal_(self.time_proj.weight, 0.0, 1.0 / self.memory_dim**0.5)
        nn.init.zeros_(self.time_proj.bias)
        self.out = (
            nn.Identity()
            if self.embed_dim == self.memory_dim
            else nn.Linear(self.memory_dim, self.embed_dim)
        )

    def embed(self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor) -> torch.Tensor:
        """Time-projected memory of every root; (R, embed_dim)."""
        z = take_rows(self.node_state(batch, memory), batch.root_pos)
        dt = (batch.root_t - last_update[batch.root_pos]) / self.time_scale
        return self.out(z * (1 + self.time_proj(dt.to(z.dtype)[:, None])))
