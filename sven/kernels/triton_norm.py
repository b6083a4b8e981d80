"""Triton kernel for the attention layer's output in a wide evaluation batch.

:func:`relu_norm` computes :func:`sven.kernels.reference.relu_norm`,
``LayerNorm(ReLU(x + node[rows]))``: the per-root half of the output projection ``x``,
the per-node half gathered by each root's node row, the activation and the layer norm.
Unfused, these are four passes over (R, O) (the gather, the sum, the activation and the
norm, which reads its input twice); here one program reads a block of roots' rows once,
keeps them in registers, and writes the result once. Forward only: where a gradient is
needed, the reference runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["relu_norm"]

#: Rows of a program's block; the widest row a program holds is NORM_MAX_WIDTH.
_ROWS = 16
_WARPS = 4
#: The widest row held in registers; wider ones take the reference.
NORM_MAX_WIDTH = 4096


@triton.jit
def _relu_norm_kernel(
    x_ptr, n_ptr, rows_ptr, w_ptr, b_ptr, o_ptr, R, C, eps, sx_r, sx_c, sn_r, sn_c,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # fp32 statistics whatever the dtype; the variance as the mean of squared
    # deviations (two passes over registers, not E[x^2] - E[x]^2, which cancels).
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    oc = tl.arange(0, BLOCK_C)
    rm = rr < R
    cm = oc < C
    tile = rm[:, None] & cm[None, :]
    r64 = rr.to(tl.int64)
    node = tl.load(rows_ptr + r64, mask=rm, other=0).to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * sx_r + oc[None, :] * sx_c, mask=tile, other=0.0)
    n = tl.load(n_ptr + node[:, None] * sn_r + oc[None, :] * sn_c, mask=tile, other=0.0)
    y = tl.maximum(x.to(tl.float32) + n.to(tl.float32), 0.0)
    mean = tl.sum(y, axis=1) / C
    dev = tl.where(tile, y - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(dev * dev, axis=1) / C + eps)
    w = tl.load(w_ptr + oc, mask=cm, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + oc, mask=cm, other=0.0).to(tl.float32)
    out = dev * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(o_ptr + r64[:, None] * C + oc[None, :], out.to(o_ptr.dtype.element_ty), mask=tile)


def relu_norm(
    x: torch.Tensor,
    node: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``LayerNorm(ReLU(x + node[rows]))`` as one kernel (Triton), forward only.

    Same contract as :func:`sven.kernels.reference.relu_norm`; the reference runs where a
    gradient is needed and for rows wider than :data:`NORM_MAX_WIDTH`.

    Returns:
        (R, O) in x's dtype, from x (R, O), node (U, O), rows (R,), weight and bias (O,).
    """
    from sven.kernels import reference

    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, node, weight, bias))
    r, o = x.shape
    if grad or o > NORM_MAX_WIDTH:
        return reference.relu_norm(x, node, rows, weight, bias, eps)
    out = torch.empty(r, o, device=x.device, dtype=x.dtype)
    if r > 0:
        _relu_norm_kernel[(triton.cdiv(r, _ROWS),)](
            x, node, rows, weight, bias, out, r, o, float(eps), *x.stride(), *node.stride(),
            BLOCK_R=_ROWS, BLOCK_C=triton.next_power_of_2(o), num_warps=_WARPS,
        )  # fmt: skip
    return out
