"""The distributed error: a launch that cannot start, or a rank that did not answer.

Apart from the collectives so that the launcher, SLURM, rendezvous and process-group
modules raise it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence

from sven.errors import SvenError

__all__ = ["DistError"]


class DistError(SvenError):
    """A launch that cannot start, or a rank that did not answer in time.

    Attributes:
        ranks: Ranks found missing (empty where the failure does not say).
        what: Where the program was when it failed (e.g. ``"epoch 3 batch 10"``).
    """

    exit_code = 4

    def __init__(self, message: str, ranks: Sequence[int] = (), what: str = "") -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.what = what
