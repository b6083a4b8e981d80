"""The training loss over the link scores, as one kernel each way.

``sven.engine.body.masked_bce`` is the binary cross-entropy with logits of the positive
(label 1) and negative (label 0) scores of the real events, summed, then divided by
the global prediction count: on CUDA a negation, a concatenation, the softplus, the
mask's cast and product, a sum and a division forward, and as many backward, for a
few hundred scores. Here one program computes the sum and one the gradients:

    loss = sum_i valid_i (softplus(-pos_i) + sum_j softplus(neg_ij)) / denom
    d loss / d pos_i = -valid_i sigmoid(-pos_i) / denom
    d loss / d neg_ij = valid_i sigmoid(neg_ij) / denom

softplus(x) is x itself past x = 20, as in PyTorch. The reference, the CPU path and
the oracle, is ``masked_bce`` itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sven.kernels.strides import is_dense

__all__ = ["bce_loss"]

_ROWS = 128


@triton.jit
def _softplus(x):
    # log(1 + e^x) as PyTorch computes it: x past the threshold 20, log1p(e^x) below,
    # written so that neither branch overflows (e^x only where x <= 20).
    e = tl.exp(tl.minimum(x, 20.0))
    small = tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e))
    return tl.where(x > 20.0, x, small)


@triton.jit
def _sigmoid(x):
    # e^-|x| never overflows.
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _loss_fwd_kernel(
    pos_ptr, neg_ptr, valid_ptr, denom_ptr, out_ptr, B, N, s_pos, s_b, s_n,
    HAS_VALID: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    acc = tl.zeros([ROWS], tl.float32)
    cols = tl.arange(0, BN)
    for start in range(0, B, ROWS):
        rows = start + tl.arange(0, ROWS)
        rm = rows < B
        p = tl.load(pos_ptr + rows * s_pos, mask=rm, other=0.0).to(tl.float32)
        m2 = rm[:, None] & (cols < N)[None, :]
        n = tl.load(neg_ptr + rows[:, None] * s_b + cols[None, :] * s_n, mask=m2, other=0.0)
        row = _softplus(-p) + tl.sum(tl.where(m2, _softplus(n.to(tl.float32)), 0.0), axis=1)
        keep = rm
        if HAS_VALID:
            keep = keep & (tl.load(valid_ptr + rows, mask=rm, other=0) != 0)
        acc += tl.where(keep, row, 0.0)
    # The count in any dtype (the step's device scalar): converted here, not by a
    # kernel of its own.
    total = tl.sum(acc, axis=0) / tl.load(denom_ptr).to(tl.float32)
    tl.store(out_ptr, total)


@triton.jit
def _loss_bwd_kernel(
    pos_ptr, neg_ptr, valid_ptr, denom_ptr, g_ptr, dpos_ptr, dneg_ptr, B, N, s_pos, s_b, s_n,
    HAS_VALID: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    # dpos and dneg have pos's and neg's strides.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < B
    cols = tl.arange(0, BN)
    scale = tl.load(g_ptr) / tl.load(denom_ptr).to(tl.float32)
    w = tl.where(rm, scale, 0.0)
    if HAS_VALID:
        w = tl.where(tl.load(valid_ptr + rows, mask=rm, other=0) != 0, w, 0.0)
    p = tl.load(pos_ptr + rows * s_pos, mask=rm, other=0.0).to(tl.float32)
    tl.store(dpos_ptr + rows * s_pos, -w * _sigmoid(-p), mask=rm)
    m2 = rm[:, None] & (cols < N)[None, :]
    at = rows[:, None] * s_b + cols[None, :] * s_n
    n = tl.load(neg_ptr + at, mask=m2, other=0.0).to(tl.float32)
    tl.store(dneg_ptr + at, w[:, None] * _sigmoid(n), mask=m2)


def _valid_u8(valid: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    # A bool tensor read as bytes (no copy); a dummy pointer when there is no mask.
    return like if valid is None else valid.view(torch.uint8)


class _BCELoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pos, neg, valid, denom):
        # Read in place, whatever the strides (the decoder's negatives are a transposed
        # view): a copy would be a kernel each way. The gradients take the same strides.
        pos, neg = (x if is_dense(x) else x.contiguous() for x in (pos, neg))
        b, n = neg.shape
        out = torch.empty((), device=pos.device, dtype=torch.float32)
        v = _valid_u8(valid, pos)
        bn = max(2, triton.next_power_of_2(n))
        _loss_fwd_kernel[(1,)](
            pos, neg, v, denom, out, b, n, pos.stride(0), *neg.stride(),
            HAS_VALID=valid is not None, BN=bn, ROWS=_ROWS,
        )  # fmt: skip
        ctx.save_for_backward(pos, neg, v, denom)
        ctx.has_valid = valid is not None
        return out.to(pos.dtype)

    @staticmethod
    def backward(ctx, g):
        pos, neg, v, denom = ctx.saved_tensors
        b, n = neg.shape
        dpos = torch.empty_strided(pos.shape, pos.stride(), dtype=pos.dtype, device=pos.device)
        dneg = torch.empty_strided(neg.shape, neg.stride(), dtype=neg.dtype, device=neg.device)
        bn = max(2, triton.next_power_of_2(n))
        _loss_bwd_kernel[(triton.cdiv(b, _ROWS),)](
            pos, neg, v, denom, g.to(torch.float32).contiguous(), dpos, dneg, b, n,
            pos.stride(0), *neg.stride(),
            HAS_VALID=ctx.has_valid, BN=bn, ROWS=_ROWS,
        )  # fmt: skip
        return dpos, dneg, None, None


def bce_loss(
    pos: torch.Tensor,
    neg: torch.Tensor,
    valid: torch.Tensor | None,
    denom: float | torch.Tensor,
) -> torch.Tensor:
    """The summed BCE with logits of the real events' scores, divided by ``denom``.

    Args:
        pos: (B,) float32 logits of the positive events (label 1).
        neg: (B, n) float32 logits of their negatives (label 0).
        valid: (B,) bool real-event mask, or None (every event real).
        denom: The global prediction count: a float or a 0-d device tensor.

    Returns:
        () the loss, differentiable in ``pos`` and ``neg``.
    """
    if not isinstance(denom, torch.Tensor):
        denom = torch.full((), float(denom), device=pos.device, dtype=torch.float32)
    return _BCELoss.apply(pos, neg, valid, denom.reshape(()))
