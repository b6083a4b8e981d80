"""How a step's gradients are zeroed and summed: :class:`LocalGrads` on one process,
:class:`GradBucket` across P ranks, both a :class:`Gradients`, chosen once when the run
is built (the step never asks which).

The bucket holds the gradients of every parameter in one flat buffer, summed over ranks
in one all-reduce.

Each parameter's ``.grad`` is a view of the bucket (autograd accumulates into an
existing gradient in place), so the all-reduce needs no copy in or out, and it has a
fixed size: it is captured in the step's CUDA graph with the rest. Two extra elements
ride along: the batch's loss (summed over ranks for the log) and the ranks' stop votes,
so that no collective of their own is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GradBucket", "Gradients", "LocalGrads"]


#: Called with the name of each stage of a step as it ends.
Lap = Callable[[str], None]


def _no_lap(name: str) -> None:
    pass


class Gradients:
    """The gradients' part of a training step.

    Attributes:
        crosses_ranks: Whether gradients (and the stop votes with them) are summed over
            ranks.
        bytes_per_step: Bytes each rank sends per step for them.
    """

    crosses_ranks = False
    bytes_per_step = 0

    def zero(self) -> None:
        """Zeroes the gradients before a step's backward."""
        raise NotImplementedError

    def set_vote(self, vote: int) -> None:
        """This rank's stop vote for the next step (summed with the gradients)."""

    def reduce(self, loss: Tensor, vote: Tensor | None = None, lap: Lap = _no_lap) -> Tensor:
        """After the backward: the gradients summed as the optimizer needs them.

        Args:
            loss: () this rank's part of the batch's mean loss.
            vote: () this rank's stop vote; None: the one :meth:`set_vote` set.
            lap: Called with ``grad_allreduce`` when gradients crossed ranks.

        Returns:
            () the batch's mean loss, summed over ranks.
        """
        return loss

    def record(self, counter: torch.Tensor, status: torch.Tensor, overflow: torch.Tensor) -> None:
        """Inside the step, after it: counts the bytes sent into ``counter`` (the
        exchange's five byte counters) and writes [summed votes, overflows] into
        ``status`` (3,) float64."""

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a step modifies here (saved around a warm-up)."""
        return []


class LocalGrads(Gradients):
    """One process: the optimizer's own gradients, nothing to sum.

    Args:
        optimizer: Whose gradients a step zeroes (set to None).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def zero(self) -> None:
        """Drops the gradients (``set_to_none``: the backward allocates them)."""
        self.optimizer.zero_grad(set_to_none=True)


class GradBucket(Gradients):
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
        self.crosses_ranks = True
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
        #: () this rank's stop vote for the next step.
        self.vote = torch.zeros((), dtype=first.dtype, device=first.device)
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

    def set_vote(self, vote: int) -> None:
        """This rank's stop vote for the next step (summed with the gradients)."""
        self.vote.fill_(float(vote))

    def reduce(self, loss: Tensor, vote: Tensor | None = None, lap: Lap = _no_lap) -> Tensor:
        """Sums the gradients, the loss and the stop votes over the ranks (:meth:`all_reduce`).

        Returns:
            () the summed loss, a view of the bucket.
        """
        total, _ = self.all_reduce(loss, self.vote if vote is None else vote)
        lap("grad_allreduce")
        return total

    def record(self, counter: torch.Tensor, status: torch.Tensor, overflow: torch.Tensor) -> None:
        """Counts the all-reduce's bytes and records the summed vote and the overflows."""
        # What the gradient all-reduce sent (the exchange counts every byte that crosses
        # ranks, on the device).
        counter[3] += self.bytes_per_step
        n = self.numel
        status.copy_(torch.cat([self.flat[n + 1 : n + 2].double(), overflow.to(torch.float64)]))

    def tensors(self) -> list[torch.Tensor]:
        """The bucket (gradients, loss, votes)."""
        return [self.flat]
