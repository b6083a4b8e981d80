"""Triton kernels for the GRU and RNN memory cells: fused gate math, GEMMs on cuBLAS.

The input and hidden GEMMs stay on cuBLAS (``F.linear``, bias folded in); what the
kernels fuse is the elementwise tail, about ten kernels forward and more backward in
eager PyTorch: one kernel turns the two GEMM outputs and h into h', one turns dh' into
the gate gradients. The backward then gets every weight, bias and input gradient from
those gate gradients with GEMMs and column sums. Math in fp32 whatever the input dtype.
Under autocast the GEMMs autocast as ``F.linear`` would, and the backward's GEMMs run
under the forward's autocast state.
Same equations and weight layout as ``torch.nn.GRUCell`` / ``torch.nn.RNNCell``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["gru_cell", "rnn_cell"]

_BLOCK = 1024


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # (1 - e) / (1 + e) with e = exp(-2|x|) never overflows; near 0, where 1 - e cancels,
    # the odd series (error below 1e-9 relative for |x| < 0.05) keeps fp32 precision.
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0)))
    return tl.where(a < 0.05, small, tl.where(x < 0.0, -t, t))


@triton.jit
def _gru_gates(gi_ptr, gh_ptr, row, col, m, Hd, s_gi, s_gh):
    """Pre-activations of one block of (row, col): r, z, n and the hidden part of n."""
    gi = gi_ptr + row * s_gi + col
    gh = gh_ptr + row * s_gh + col
    i_r = tl.load(gi, mask=m, other=0.0).to(tl.float32)
    i_z = tl.load(gi + Hd, mask=m, other=0.0).to(tl.float32)
    i_n = tl.load(gi + 2 * Hd, mask=m, other=0.0).to(tl.float32)
    h_r = tl.load(gh, mask=m, other=0.0).to(tl.float32)
    h_z = tl.load(gh + Hd, mask=m, other=0.0).to(tl.float32)
    h_n = tl.load(gh + 2 * Hd, mask=m, other=0.0).to(tl.float32)
    r = _sigmoid(i_r + h_r)
    z = _sigmoid(i_z + h_z)
    n = _tanh(i_n + r * h_n)
    return r, z, n, h_n


@triton.jit
def _gru_fwd_kernel(gi_ptr, gh_ptr, h_ptr, out_ptr, N, Hd, s_gi, s_gh, s_h, BLOCK: tl.constexpr):
    # out is (U, Hd) contiguous; gi, gh (U, 3 Hd) with unit column stride.
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < N
    row = idx // Hd
    col = idx % Hd
    _, z, n, _ = _gru_gates(gi_ptr, gh_ptr, row, col, m, Hd, s_gi, s_gh)
    h = tl.load(h_ptr + row * s_h + col, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, ((1.0 - z) * n + z * h).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gru_bwd_kernel(
    gi_ptr, gh_ptr, h_ptr, dout_ptr, dgi_ptr, dgh_ptr, dh_ptr,
    N, Hd, s_gi, s_gh, s_h, s_do,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # dgi, dgh (U, 3 Hd) and dh (U, Hd) contiguous.
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < N
    row = idx // Hd
    col = idx % Hd
    r, z, n, h_n = _gru_gates(gi_ptr, gh_ptr, row, col, m, Hd, s_gi, s_gh)
    h = tl.load(h_ptr + row * s_h + col, mask=m, other=0.0).to(tl.float32)
    g = tl.load(dout_ptr + row * s_do + col, mask=m, other=0.0).to(tl.float32)
    d_n = g * (1.0 - z) * (1.0 - n * n)
    d_z = g * (h - n) * z * (1.0 - z)
    d_r = d_n * h_n * r * (1.0 - r)
    base = row * 3 * Hd + col
    ty = dgi_ptr.dtype.element_ty
    tl.store(dgi_ptr + base, d_r.to(ty), mask=m)
    tl.store(dgi_ptr + base + Hd, d_z.to(ty), mask=m)
    tl.store(dgi_ptr + base + 2 * Hd, d_n.to(ty), mask=m)
    tl.store(dgh_ptr + base, d_r.to(ty), mask=m)
    tl.store(dgh_ptr + base + Hd, d_z.to(ty), mask=m)
    tl.store(dgh_ptr + base + 2 * Hd, (d_n * r).to(ty), mask=m)
    tl.store(dh_ptr + idx, (g * z).to(dh_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rnn_fwd_kernel(gi_ptr, gh_ptr, out_ptr, N, Hd, s_gi, s_gh, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < N
    row = idx // Hd
    col = idx % Hd
    a = tl.load(gi_ptr + row * s_gi + col, mask=m, other=0.0).to(tl.float32)
    b = tl.load(gh_ptr + row * s_gh + col, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, _tanh(a + b).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rnn_bwd_kernel(
    gi_ptr, gh_ptr, dout_ptr, dpre_ptr, N, Hd, s_gi, s_gh, s_do, BLOCK: tl.constexpr
):
    # tanh' from the fp32 pre-activation, not from the rounded output: near saturation a
    # bf16 output is 1 or 1 - 2^-8, so 1 - y^2 computed from it is 0 or 2^-7 whatever
    # the true slope (the reference's bf16 autograd has that error; this kernel not).
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < N
    row = idx // Hd
    col = idx % Hd
    a = tl.load(gi_ptr + row * s_gi + col, mask=m, other=0.0).to(tl.float32)
    b = tl.load(gh_ptr + row * s_gh + col, mask=m, other=0.0).to(tl.float32)
    y = _tanh(a + b)
    g = tl.load(dout_ptr + row * s_do + col, mask=m, other=0.0).to(tl.float32)
    tl.store(dpre_ptr + idx, (g * (1.0 - y * y)).to(dpre_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    # The kernels take a row stride and assume unit column stride.
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def _linear_grads(ctx, d_gi, d_gh, dh_direct):
    """(dx, dh, dw_ih, dw_hh, db_ih, db_hh) from the pre-activation gradients."""
    x, h, w_ih, w_hh = ctx.saved_tensors[:4]
    need = ctx.needs_input_grad
    dx = d_gi @ w_ih if need[0] else None
    dh = None
    if need[1]:
        dh = d_gh @ w_hh
        if dh_direct is not None:
            dh = dh + dh_direct
    dw_ih = d_gi.t() @ x if need[2] else None
    dw_hh = d_gh.t() @ h if need[3] else None
    db_ih = d_gi.sum(0) if need[4] else None
    db_hh = d_gh.sum(0) if need[5] else None
    return dx, dh, dw_ih, dw_hh, db_ih, db_hh


class _GRUCell(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, h, w_ih, w_hh, b_ih, b_hh):  # type: ignore[override]
        gi = F.linear(x, w_ih, b_ih)
        gh = F.linear(h, w_hh, b_hh)
        hs = _rows(h)
        u, hd = h.shape
        # The blend with h promotes as the reference's (an fp32 state under autocast).
        out = torch.empty(u, hd, device=h.device, dtype=torch.promote_types(gi.dtype, h.dtype))
        if out.numel():
            _gru_fwd_kernel[_grid(out.numel())](
                gi, gh, hs, out, out.numel(), hd, gi.stride(0), gh.stride(0), hs.stride(0),
                BLOCK=_BLOCK,
            )  # fmt: skip
        # The GEMM outputs are kept: the backward recomputes the gates from them.
        ctx.save_for_backward(x, h, w_ih, w_hh, gi, gh, hs)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):  # type: ignore[override]
        gi, gh, hs = ctx.saved_tensors[4:]
        dout = _rows(dout)
        u, hd = hs.shape
        d_gi = torch.empty_like(gi)
        d_gh = torch.empty_like(gi)
        dh_direct = torch.empty(u, hd, device=gi.device, dtype=gi.dtype)
        if dh_direct.numel():
            _gru_bwd_kernel[_grid(dh_direct.numel())](
                gi, gh, hs, dout, d_gi, d_gh, dh_direct, dh_direct.numel(), hd,
                gi.stride(0), gh.stride(0), hs.stride(0), dout.stride(0), BLOCK=_BLOCK,
            )  # fmt: skip
        return _linear_grads(ctx, d_gi, d_gh, dh_direct)


class _RNNCell(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, h, w_ih, w_hh, b_ih, b_hh):  # type: ignore[override]
        gi = F.linear(x, w_ih, b_ih)
        gh = F.linear(h, w_hh, b_hh)
        out = torch.empty(gi.shape, device=gi.device, dtype=gi.dtype)
        if out.numel():
            _rnn_fwd_kernel[_grid(out.numel())](
                gi, gh, out, out.numel(), out.shape[1], gi.stride(0), gh.stride(0),
                BLOCK=_BLOCK,
            )  # fmt: skip
        ctx.save_for_backward(x, h, w_ih, w_hh, gi, gh)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):  # type: ignore[override]
        gi, gh = ctx.saved_tensors[4:]
        dout = _rows(dout)
        d_pre = torch.empty(gi.shape, device=gi.device, dtype=gi.dtype)
        if d_pre.numel():
            _rnn_bwd_kernel[_grid(d_pre.numel())](
                gi, gh, dout, d_pre, d_pre.numel(), d_pre.shape[1],
                gi.stride(0), gh.stride(0), dout.stride(0), BLOCK=_BLOCK,
            )  # fmt: skip
        return _linear_grads(ctx, d_pre, d_pre, None)


def gru_cell(
    x: torch.Tensor,
    h: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
) -> torch.Tensor:
    """GRU cell with fused gate math (Triton).

    Arguments, shapes and result as :func:`sven.kernels.reference.gru_cell`
    (``torch.nn.GRUCell``'s equations and weight layout).
    """
    return _GRUCell.apply(x, h, w_ih, w_hh, b_ih, b_hh)


def rnn_cell(
    x: torch.Tensor,
    h: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
) -> torch.Tensor:
    """Elman tanh cell with fused gate math (Triton).

    Arguments, shapes and result as :func:`sven.kernels.reference.rnn_cell`.
    """
    return _RNNCell.apply(x, h, w_ih, w_hh, b_ih, b_hh)
