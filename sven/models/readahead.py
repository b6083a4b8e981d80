"""Rows read ahead of their step, and the record of writes that keeps them exact.

With node state in pinned host memory (``state.device=host`` on CUDA) a step's row
gather crosses the host link on the step's path. The prefetch ring already builds the
batch of step i + D during step i, on a side stream; reading that batch's rows there
too takes the gather off the step's path, but rows read so early miss whatever steps
i..i + D - 1 write after the read. A :class:`WriteLog` makes them exact:

* each commit takes a new number from a counter, bumped before it writes, stamps
  every row it writes with it, and once written sets ``done`` to it;
* rows read ahead (:class:`~sven.models.memory.EarlyRows`) carry ``done + 1`` read
  just before them (``since``);
* the step that uses them reads again, in place, the rows whose stamp is at least
  ``since`` (all of them when the state was replaced wholesale since: a reset, a load),
  before anything reads them.

Commits run one after another (each joined before the next starts). A row stamped
below ``since`` was last written by a commit that had finished before ``since`` was
read, so before the rows were read. A row written after the read, or by a commit
still writing while it was read, carries a number above ``done``: at least ``since``.
"""

from __future__ import annotations

import os

import torch

__all__ = ["AHEAD_PROGRAMS", "WriteLog", "ahead_programs"]

#: The most programs the read-ahead gather runs (0: one per block of rows, as the
#: step's own gather). Rows read ahead cross the host link beside the step: a full
#: grid of programs waiting on the link holds every SM, and the step's kernels beside
#: it slow down (docs/scale.md). ``SVEN_AHEAD_PROGRAMS`` sets another count (read at
#: each read-ahead, for A/B runs).
AHEAD_PROGRAMS = 0


def ahead_programs() -> int:
    """The read-ahead gather's program cap (``SVEN_AHEAD_PROGRAMS``, else
    :data:`AHEAD_PROGRAMS`).

    Raises:
        ValueError: On a value that is not a whole number of at least 0.
    """
    raw = os.environ.get("SVEN_AHEAD_PROGRAMS", str(AHEAD_PROGRAMS)).strip()
    if not raw.isdigit():
        raise ValueError(f"SVEN_AHEAD_PROGRAMS must be a whole number >= 0, got {raw!r}")
    return int(raw)


class WriteLog:
    """Which node-state rows each commit wrote, by number.

    Args:
        rows: N + 1 (the state's rows, the scratch row included).
        device: Where the stamps live: beside the step's kernels (GPU memory also
            when the state is in host memory: the check reads one stamp a row).

    Attributes:
        stamp: (N + 1,) int64 the number of the last commit that wrote each row, -1
            for none.
        counter: (1,) int64 the number of the last commit (or wholesale change).
        done: (1,) int64 the number of the last commit whose writes are over.
        wipe: (1,) int64 the number of the last wholesale change: rows read at or
            before it are all read again.
    """

    def __init__(self, rows: int, device: torch.device) -> None:
        self.stamp = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.done = torch.zeros(1, dtype=torch.int64, device=device)
        self.wipe = torch.zeros(1, dtype=torch.int64, device=device)

    def tensors(self) -> list[torch.Tensor]:
        """What a step changes here (a captured graph's warm-up puts them back)."""
        return [self.stamp, self.counter, self.done, self.wipe]

    def invalidate(self) -> None:
        """Every row read ahead until now is read again at its use (the state was
        replaced wholesale: a reset, a load, an assignment)."""
        self.counter.add_(1)
        self.wipe.copy_(self.counter)
        self.done.copy_(self.counter)

    def next(self) -> torch.Tensor:
        """Bumps the counter for a commit about to write; returns it, (1,)."""
        self.counter.add_(1)
        return self.counter

    def finish(self) -> None:
        """Marks the commit that took the last number as written (after its writes, in
        stream order)."""
        self.done.copy_(self.counter)

    def since(self) -> torch.Tensor:
        """(1,) what rows read now carry: the first number whose writes they may miss."""
        return self.done + 1

    def mark(self, rows: torch.Tensor, number: torch.Tensor) -> None:
        """Stamps ``rows`` (R,) int64 with ``number`` (1,), the commit's (reference path;
        the Triton commit stamps its winners itself)."""
        self.stamp.index_copy_(0, rows, number.expand(rows.shape[0]))

    def stale(self, nodes: torch.Tensor, since: torch.Tensor) -> torch.Tensor:
        """(U,) bool: which of the rows of ``nodes`` (U,) read at ``since`` (1,) must be
        read again."""
        return (self.stamp[nodes] >= since) | (self.wipe >= since)
