"""Gradients of every parameter in one flat buffer, summed over ranks in one all-reduce.

Each parameter's ``.grad`` is a view of the bucket (autograd accumulates into an
existing gradient in place), so the all-reduce needs no copy in or out, and it has a
fixed size: it is captured in the step's CUDA graph with the rest. Two extra elements
ride along: the batch's loss (summed over ranks for the log) and the ranks' stop votes,
so that no collective of their own is needed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["GradBucket"]


class GradBucket:
    """One flat gradient buffer for a model's parameters.

    Plain sum, not DDP's mean: each rank already divides its loss by the global
    prediction count. With fixed-shape batches every rank runs the same operations, so
    the same parameters get gradients everywhere; a parameter that gets none keeps a
    zero gradient, which leaves it (and Adam's moments) unchanged.

    Args:
        params: The parameters (one dtype and device).
        group: Process group of the all-reduce (None: the default group).
        world_size: P.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        group: dist.ProcessGroup | None,
        world_size: int,
    ) -> None:
        self.params = list(params)
        self.group = group
        self.world_size = world_size
        self.numel = sum(p.numel() for p in self.params)
        first = self.params[0]
        #: Gradients, then the loss, then the stop votes.
        self.flat = torch.zeros(self.numel + 2, dtype=first.dtype, device=first.device)
        self._views: list[torch.Tensor] = []
        off = 0
        for p in self.params:
            self._views.append(self.flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        self.attach()
        p_count = world_size
        #: Bytes each rank sends per all-reduce (ring: 2 (P - 1) / P of the buffer).
        self.bytes_per_step = (
            2 * (p_count - 1) * self.flat.numel() * self.flat.element_size() // p_count
        )

    def attach(self) -> None:
        """Points every ``.grad`` at its view (again, if something replaced it)."""
        for p, v in zip(self.params, self._views):
            if p.grad is not v:
                p.grad = v

    def zero(self) -> None:
        """Zeroes the gradients (one fill, instead of one per parameter)."""
        self.attach()
        self.flat.zero_()

    def all_reduce(
        self, loss: torch.Tensor, vote: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums the gradients, the loss and the stop votes over the ranks, in place.

        Args:
            loss: () this rank's part of the batch's mean loss.
            vote: () this rank's stop vote.

        Returns:
            The summed loss and the summed vote, 0-d views of the bucket.
        """
        n = self.numel
        self.flat[n].copy_(loss.detach())
        self.flat[n + 1].copy_(vote)
        dist.all_reduce(self.flat, group=self.group)
        return self.flat[n], self.flat[n + 1]
