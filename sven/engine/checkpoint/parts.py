"""What a run hands its checkpointer: :class:`Snapshot`, one rank's checkpoint in the
pieces the format keeps apart, assembled by the run from its :class:`Stateful` parts.

The checkpointer (:class:`~sven.engine.checkpoint.run.RunCheckpoints`) writes and reads
these pieces and names no key of the run: which part is saved under which key, and
which of them is the node state or the owner map, is the run's to say.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["Snapshot", "Stateful"]


class Stateful(Protocol):
    """A part of a run whose state a checkpoint keeps."""

    def state_dict(self) -> dict[str, Any]:
        """The part's state: tensors and plain values only."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` gave."""
        ...


@dataclass
class Snapshot:
    """One rank's checkpoint (the layout is :mod:`~sven.engine.checkpoint.writer`'s).

    Attributes:
        state: Rank 0's small state (``state.pt``; the run's config is added when it
            is written). Every rank passes it; rank 0's is the one written.
        shard: This rank's small state (``rank{r}.pt``, with its rank and the world
            size added).
        node_state: This rank's node state, field -> (N_r, ...) tensor (``nodes/``),
            or None for a checkpoint without node state. Read back only when asked for
            whole (:meth:`~sven.engine.checkpoint.run.RunCheckpoints.load`).
        owner: (N,) owning rank of each vertex (``owner.npy``; not written where one
            rank owns every vertex), or None. On reading,
            :func:`~sven.engine.checkpoint.load.read_state` puts it back in the state
            where format 1 kept it, so a read snapshot has it there and None here.
    """

    state: dict[str, Any]
    shard: dict[str, Any] = field(default_factory=dict)
    node_state: dict[str, torch.Tensor] | None = None
    owner: torch.Tensor | None = None
