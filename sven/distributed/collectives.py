"""Collectives that fail with a name: a barrier that names the missing ranks (raising
:class:`~sven.distributed.errors.DistError`, importable from here too), and the small
helpers every module uses (no-ops without a process group).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from sven.distributed.errors import DistError
from sven.errors import first_line

__all__ = [
    "BarrierContext",
    "DistError",
    "allreduce_sum_",
    "barrier_or_die",
    "broadcast_object",
    "is_main",
]


class BarrierContext(Protocol):
    """What :func:`barrier_or_die` reads of a process group's context
    (:class:`~sven.distributed.process_group.DistContext` is one)."""

    distributed: bool
    rank: int
    timeout_s: float
    health_group: Any

    def record_failure(self, ranks: Sequence[int]) -> None: ...

    def label(self, rank: int) -> str: ...

    def diagnose_failure(self) -> Any: ...


def _missing_ranks(message: str) -> list[int]:
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    return [int(r) for r in m.group(1).replace(",", " ").split()] if m else []


def barrier_or_die(ctx: BarrierContext, what: str, timeout_s: float | None = None) -> None:
    """Waits for every rank; raises a DistError naming those that did not come.

    Rank 0 collects all ranks (gloo's ``monitored_barrier`` with ``wait_all_ranks``),
    which names the missing ones; the other ranks wait for rank 0's release and, when
    it does not come, name the ranks whose heartbeats say they are gone
    (:meth:`DistContext.diagnose_failure`), else rank 0. After a failure the process
    group is destroyed: tear down and exit.

    Args:
        ctx: The context from :func:`init_distributed`.
        what: Where the program is, for the message (e.g. ``"epoch 3 batch 10"``).
        timeout_s: How long to wait (default: the context's collective timeout).

    Raises:
        DistError: E.g. ``rank 1 did not answer within 30 s (at 'epoch 3 batch 10')``.
    """
    if not ctx.distributed:
        return
    wait = ctx.timeout_s if timeout_s is None else timeout_s
    try:
        dist.monitored_barrier(
            group=ctx.health_group, timeout=timedelta(seconds=wait), wait_all_ranks=True
        )
    except RuntimeError as err:
        missing = _missing_ranks(str(err))
        if missing:
            ctx.record_failure(missing)
            labels = [ctx.label(r) for r in missing]
            if labels == [f"rank {r}" for r in missing]:
                labels = [
                    ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
                ]
            who = ", ".join(labels)
            msg = f"{who} did not answer within {wait:g} s (at {what!r})"
        elif (diag := ctx.diagnose_failure()).ranks:
            # Only rank 0's monitored_barrier sees who is missing; the others ask the
            # heartbeats rather than blame rank 0 for not releasing them.
            missing = list(diag.ranks)
            msg = f"{diag.reason} (at {what!r}, a barrier of {wait:g} s)"
        elif ctx.rank != 0:
            missing = [0]
            msg = (
                f"rank 0 did not release the barrier within {wait:g} s (at {what!r}): it "
                "hung or died, or found another rank missing and names it in its own error "
                f"(rank {ctx.rank}: {first_line(err)})"
            )
        else:
            msg = f"barrier at {what!r} failed on rank 0: {first_line(err)}"
        raise DistError(msg, ranks=missing, what=what) from err


def is_main() -> bool:
    """Whether this process is rank 0 (True without a process group)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def allreduce_sum_(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sums ``tensor`` over all ranks in place and returns it."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (small objects: configs, paths)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
