"""What a tensor's strides say about its memory, for code that reads it in place."""

from __future__ import annotations

import inspect

import torch

__all__ = ["is_dense", "unaligned"]


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


def unaligned(*names: str) -> dict[str, list[str]]:
    """``triton.jit``'s option not to specialise the pointers ``names`` on 16-byte
    alignment, where this Triton has it (it is newer than Triton 3.0, which torch 2.4
    brings); else no option. A pointer whose address's alignment differs between calls
    would otherwise be a compiled variant per alignment.

    Returns:
        Keyword arguments for ``triton.jit``.
    """
    import triton  # the kernels' modules only: a CPU run imports no Triton

    if "do_not_specialize_on_alignment" not in inspect.signature(triton.jit).parameters:
        return {}
    return {"do_not_specialize_on_alignment": list(names)}
