"""The parameter gradients of the linear layers' backward passes.

:func:`param_grads` gives a layer's weight and bias gradients, ``g^T x`` and
``g.sum(0)``: with ``SVEN_KERNELS=...,param_grads=triton`` both (of up to three layers)
in one Triton launch (:mod:`sven.kernels.triton_grads`), else as below, a GEMM and a
column sum.

``x.sum(0)`` over a (M, N) gradient with M in the thousands and N in the hundreds runs
as PyTorch's generic reduction, among the slowest small kernels of the step
(docs/performance.md has the timings); a matrix-vector product with a vector of ones
(``cublasSgemv``, never TF32) sums the same column in one pass. The vectors of ones are
made once per length, outside any CUDA graph capture (a capture only records a fill, so
a vector first made there would hold garbage until a replay): a length first seen while
capturing takes the sum.
"""

from __future__ import annotations

import importlib

import torch

from sven.kernels.backend import backend_for

__all__ = ["column_sum", "linear", "param_grads"]

#: A layer's gradient problem: (x (K, M), g (K, N) or (K,), weight wanted, bias wanted).
Problem = tuple[torch.Tensor, torch.Tensor, bool, bool]

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


def param_grads(*problems: Problem) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Weight and bias gradients of up to three linear layers ``y = x W^T + b``.

    With ``param_grads=triton`` (``SVEN_KERNELS``, :func:`sven.kernels.backend_for` on
    the first g) one Triton launch computes them all (float64 excepted); else each is
    ``g^T x`` (a GEMM) and :func:`column_sum`, and for a 1-D g ``g[None] @ x`` and
    ``g.sum()``.

    Args:
        problems: ``(x, g, weight, bias)`` per layer: its input (K, M), its output's
            gradient (K, N), or (K,) for a layer of one output, and which gradients
            are wanted.

    Returns:
        Per layer ``(dW, db)``: (N, M) and (N,) (N = 1 for a 1-D g); None where not
        wanted.
    """
    # float64 keeps the GEMM: the kernel accumulates in float32.
    wide = any(t.dtype == torch.float64 for p in problems for t in p[:2])
    if not wide and backend_for(problems[0][1], "param_grads") == "triton":
        fused = importlib.import_module("sven.kernels.triton_grads").param_grads
        return fused(list(problems))
    out = []
    for x, g, weight, bias in problems:
        if g.dim() == 1:
            dw = g[None, :] @ x if weight else None
            db = g.sum().view(1) if bias else None
        else:
            dw = g.t() @ x if weight else None
            db = column_sum(g) if bias else None
        out.append((dw, db))
    return out


class _Linear(torch.autograd.Function):
    """``x w^T (+ b)`` whose parameter gradients are :func:`param_grads` (autograd's bias
    gradient is the generic column reduction)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx = g @ weight if need[0] else None
        dw = db = None
        if need[1] or need[2]:
            ((dw, db),) = param_grads((x, g, need[1], need[2]))
        return dx, dw, db


def _own_backward(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # With a bias on CUDA the bias gradient is worth a cuBLAS product (column_sum);
    # with param_grads=triton every layer's weight gradient is worth the one launch
    # (without a bias too: it spares cuBLAS's split of the long reduction).
    if x.is_cuda and x.dim() == 2 and bias is not None:
        return True
    return backend_for(x, "param_grads") == "triton"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, with the parameter gradients of :func:`param_grads`
    for a 2-D ``x`` with a bias on CUDA, and wherever ``param_grads`` runs Triton.

    Args:
        x: (..., K) inputs.
        weight: (N, K).
        bias: (N,) or None.

    Returns:
        (..., N).
    """
    if (
        x.dim() >= 2
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()  # Inductor fuses the bias gradient itself
        and _own_backward(x, bias)
    ):
        out = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias)
