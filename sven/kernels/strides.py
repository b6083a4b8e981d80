"""What a tensor's strides say about its memory, for code that reads it in place."""

from __future__ import annotations

import torch

__all__ = ["is_dense"]


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel()`` consecutive slots, in some dim order
    (no gap, no overlap: a buffer of its strides holds it exactly, transposed or not)."""
    expected = 1
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s > 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True
