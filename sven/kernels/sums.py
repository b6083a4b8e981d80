"""Column sums of the Triton kernels' backward passes (bias gradients) on cuBLAS.

``x.sum(0)`` over a (M, N) gradient with M in the thousands and N in the hundreds runs
as PyTorch's generic reduction, among the slowest small kernels of the step
(docs/performance.md has the timings); a matrix-vector product with a vector of ones
(``cublasSgemv``, never TF32) sums the same column in one pass. The vectors of ones are
made once per length, outside any CUDA graph capture (a capture only records a fill, so
a vector first made there would hold garbage until a replay): a length first seen while
capturing takes the sum.
"""

from __future__ import annotations

import torch

__all__ = ["column_sum", "linear"]

_ONES: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def column_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(0)`` for a 2-D ``x`` (M, N): (N,), on CUDA as ``x^T 1``.

    Off CUDA (Triton's interpreter) it is ``x.sum(0)`` itself.
    """
    if not x.is_cuda or x.dim() != 2 or x.dtype not in (torch.float32, torch.float64):
        return x.sum(0)
    key = (x.device, x.dtype, x.shape[0])
    ones = _ONES.get(key)
    if ones is None:
        if torch.cuda.is_current_stream_capturing():
            return x.sum(0)
        ones = _ONES[key] = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
    return torch.mv(x.t(), ones)


class _Linear(torch.autograd.Function):
    """``x w^T + b`` whose bias gradient is :func:`column_sum` (autograd's is the
    generic column reduction)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return torch.addmm(bias, x, weight.t())

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx = g @ weight if need[0] else None
        dw = g.t() @ x if need[1] else None
        db = column_sum(g) if need[2] else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; on CUDA, for a 2-D ``x`` with a bias, with the
    bias gradient on cuBLAS (:func:`column_sum`).

    Args:
        x: (M, K) inputs (any shape off that case).
        weight: (N, K).
        bias: (N,) or None.

    Returns:
        (M, N).
    """
    if (
        x.is_cuda
        and x.dim() == 2
        and bias is not None
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()  # Inductor fuses the bias gradient itself
    ):
        return _Linear.apply(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
