"""The link scorer of all four models as one Triton kernel each way.

:func:`link_decoder` computes what :func:`sven.kernels.reference.link_decoder` computes:
for every (source, candidate) pair of a batch, ``w_out . relu(W_src s + b_src + W_dst c
+ b_dst) + b_out``. The reference runs two scorers (positives, negatives) of three
linear layers each, several kernels per layer each way (docs/kernels.md counts them);
here the source projection is one GEMM per event (not one per pair: 100 MRR negatives
per event repeat it 100 times in the reference), and everything after it one kernel:

- forward: ``A = h_src W_src^T + b_src`` (cuBLAS), then one program per block of pairs
  computes ``z = relu(A[s] + x W_dst^T + b_dst)`` in output chunks (``tl.dot`` in IEEE
  float32), keeps z for the backward and reduces ``z . w_out + b_out``;
- backward: one kernel gives ``dz = g w_out [z > 0]`` and ``dx = dz W_dst``, then a
  column sum and a GEMM the source's gradient, and :func:`param_grads` the parameters'
  (three GEMMs and two sums; one launch with ``param_grads=triton``), deterministically
  (no atomics).

A pair is a row of ``h[B:]`` (the batch layout ``[src, dst, neg[:, 0], ...]`` puts the
candidates of column j at rows ``(j + 1) B ...``): no gather, no copy of the candidates.
The launches allocate only shape-dependent buffers and never synchronise with the host,
so a CUDA graph captures them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sven.kernels.precision import tf32_dots
from sven.kernels.sums import column_sum, param_grads

__all__ = ["link_decoder"]

# Rows (pairs) per program and the tiles of the products: 16 x 32 blocks keep a program
# in registers and give a batch of 200 events and one negative 25 programs.
_BLOCK_M = 16
_BLOCK_K = 32
_BLOCK_O = 32

#: Pairs from which the forward takes :data:`WIDE_TILE`: TGB's one-vs-many evaluation
#: (100 MRR negatives at batch 200: 20,200 pairs), not a training batch.
WIDE_PAIRS = 4096
#: The forward's (BLOCK_M, BLOCK_K, BLOCK_O, warps) over a wide batch: 16-row blocks
#: reload the candidates' rows once per 32 outputs and the weights once per 16 rows;
#: 64 rows by every output (D2 up to 128) read each once per program, on 8 warps (a
#: 64 x 128 tile on 4 warps holds 64 accumulators a thread; docs/performance.md has
#: the A/B). ``SVEN_DECODER_TILE=MxKxO:W`` sets another for every batch size.
WIDE_TILE = (64, 32, 128, 8)


def _forward_tile(m: int) -> tuple[int, int, int, int]:
    """The forward's (BLOCK_M, BLOCK_K, BLOCK_O, warps) over ``m`` pairs."""
    env = os.environ.get("SVEN_DECODER_TILE", "")
    if env:
        try:
            blocks, warps = env.split(":")
            bm, bk, bo = (int(x) for x in blocks.split("x"))
            tile = (bm, bk, bo, int(warps))
        except ValueError:
            tile = (0, 0, 0, 0)
        if not all(x >= 1 and x & (x - 1) == 0 for x in tile) or min(tile[:3]) < 16:
            raise ValueError(
                f"SVEN_DECODER_TILE must be MxKxO:W, powers of two, blocks of at least 16 "
                f"(e.g. 64x32x128:4), got {env!r}"
            )
        return tile
    return WIDE_TILE if m >= WIDE_PAIRS else (_BLOCK_M, _BLOCK_K, _BLOCK_O, 4)


@triton.jit
def _decoder_fwd_kernel(
    x_ptr, a_ptr, wd_ptr, bd_ptr, wo_ptr, bo_ptr, z_ptr, out_ptr,
    M, B, D, D2,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
    KEEP_Z: tl.constexpr, TF32: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < M
    src = rows % B
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for o0 in range(0, D2, BLOCK_O):
        oc = o0 + tl.arange(0, BLOCK_O)
        om = oc < D2
        # c = x W_dst^T over the output chunk, in blocks of the input dimension (small
        # tiles: the whole row block and weight chunk would not fit in registers).
        c = tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            kd = k0 + tl.arange(0, BLOCK_K)
            km = kd < D
            xm = rm[:, None] & km[None, :]
            x = tl.load(x_ptr + rows[:, None] * D + kd[None, :], mask=xm, other=0.0)
            wmask = km[:, None] & om[None, :]
            w = tl.load(wd_ptr + oc[None, :] * D + kd[:, None], mask=wmask, other=0.0)
            if TF32:
                c += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="tf32")
            else:
                c += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        tile = rm[:, None] & om[None, :]
        a = tl.load(a_ptr + src[:, None] * D2 + oc[None, :], mask=tile, other=0.0).to(tl.float32)
        bd = tl.load(bd_ptr + oc, mask=om, other=0.0).to(tl.float32)
        z = tl.maximum(a + c + bd[None, :], 0.0)
        if KEEP_Z:
            z_at = z_ptr + rows[:, None] * D2 + oc[None, :]
            tl.store(z_at, z.to(z_ptr.dtype.element_ty), mask=tile)
        wo = tl.load(wo_ptr + oc, mask=om, other=0.0).to(tl.float32)
        acc += tl.sum(z * wo[None, :], axis=1)
    out = acc + tl.load(bo_ptr).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rm)


@triton.jit
def _decoder_bwd_kernel(
    g_ptr, z_ptr, wd_ptr, wo_ptr, dz_ptr, dx_ptr,
    M, D, D2,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr,
    TF32: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < M
    kd = tl.arange(0, BLOCK_D)
    km = kd < D
    g = tl.load(g_ptr + rows, mask=rm, other=0.0).to(tl.float32)
    dx = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for o0 in range(0, D2, BLOCK_O):
        oc = o0 + tl.arange(0, BLOCK_O)
        om = oc < D2
        tile = rm[:, None] & om[None, :]
        z = tl.load(z_ptr + rows[:, None] * D2 + oc[None, :], mask=tile, other=0.0).to(tl.float32)
        wo = tl.load(wo_ptr + oc, mask=om, other=0.0).to(tl.float32)
        dz = tl.where(z > 0.0, g[:, None] * wo[None, :], 0.0)
        dz_at = dz_ptr + rows[:, None] * D2 + oc[None, :]
        tl.store(dz_at, dz.to(dz_ptr.dtype.element_ty), mask=tile)
        # W_dst chunk: (BLOCK_O, BLOCK_D).
        wmask = om[:, None] & km[None, :]
        w = tl.load(wd_ptr + oc[:, None] * D + kd[None, :], mask=wmask, other=0.0)
        if TF32:
            dx += tl.dot(dz, w.to(tl.float32), input_precision="tf32")
        else:
            dx += tl.dot(dz, w.to(tl.float32), input_precision="ieee")
    tl.store(dx_ptr + rows[:, None] * D + kd[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=rm[:, None] & km[None, :])  # fmt: skip


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _scores_by_gemm(
    x: torch.Tensor,
    a: torch.Tensor,
    b: int,
    w_dst: torch.Tensor,
    b_dst: torch.Tensor,
    w_out: torch.Tensor,
    b_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward without a gradient as cuBLAS products and two in-place passes
    (``SVEN_DECODER_WIDE=gemm``, an alternative to time in wide evaluation batches): x
    (M, D) the candidates, a (B, D2) the sources' projections; the candidates' product
    is one GEMM where the kernel tiles it in 16-row blocks. Returns as :meth:`forward`.
    """
    m, d2 = x.shape[0], w_dst.shape[0]
    z = torch.addmm(b_dst, x, w_dst.t()).view(m // b, b, d2).add_(a).relu_()
    out = torch.addmv(b_out.expand(m), z.view(m, d2), w_out.view(-1))
    return out[:b], out[b:].view(m // b - 1, b).t()


class _LinkDecoder(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        h: torch.Tensor,
        b: int,
        w_src: torch.Tensor,
        b_src: torch.Tensor,
        w_dst: torch.Tensor,
        b_dst: torch.Tensor,
        w_out: torch.Tensor,
        b_out: torch.Tensor,
        keep: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = h.contiguous()
        d, d2 = h.shape[1], w_dst.shape[0]
        h_src, x = h[:b], h[b:]
        m = x.shape[0]
        a = torch.addmm(b_src, h_src, w_src.t())
        # The activations are kept for a backward only (evaluation scores without them;
        # ``keep`` is decided by the caller: in here grad mode is always off, and
        # ctx.needs_input_grad holds whatever the mode outside).
        if not keep and os.environ.get("SVEN_DECODER_WIDE", "kernel") == "gemm":
            return _scores_by_gemm(x, a, b, w_dst, b_dst, w_out, b_out)
        z = torch.empty(m if keep else 0, d2, dtype=h.dtype, device=h.device)
        out = torch.empty(m, dtype=h.dtype, device=h.device)
        bm, bk, bo, warps = _forward_tile(m)
        _decoder_fwd_kernel[(triton.cdiv(m, bm),)](
            x, a, w_dst.contiguous(), b_dst, w_out.contiguous(), b_out, z, out,
            m, b, d, d2,
            BLOCK_M=bm, BLOCK_K=bk, BLOCK_O=bo, KEEP_Z=keep, TF32=tf32_dots(h),
            num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(h, z, w_src, w_dst, w_out)
        ctx.b = b
        # Both results are views of the one score vector, so that the backward gets
        # their gradients as they are and joins them in one kernel: slices taken after
        # the function would each zero a full-size gradient, then add them up.
        return out[:b], out[b:].view(m // b - 1, b).t()

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dpos: torch.Tensor, dneg: torch.Tensor
    ) -> tuple:
        h, z, w_src, w_dst, w_out = ctx.saved_tensors
        b = ctx.b
        # The scores' gradient in their layout [pos, neg[:, 0], neg[:, 1], ...]: one
        # concatenation (a free view of dneg where it has the scores' own strides, as
        # the Triton loss writes it).
        g = torch.cat([dpos.reshape(-1), dneg.t().reshape(-1)])
        m, d2 = z.shape
        d = h.shape[1]
        dz = torch.empty_like(z)
        dh = torch.empty_like(h)
        grid = (triton.cdiv(m, _BLOCK_M),)
        _decoder_bwd_kernel[grid](
            g, z, w_dst.contiguous(), w_out.contiguous(), dz, dh[b:],
            m, d, d2,
            BLOCK_M=_BLOCK_M, BLOCK_D=_block_d(d), BLOCK_O=_BLOCK_O, TF32=tf32_dots(g),
        )  # fmt: skip
        # The source projection is shared by a source's pairs: its gradient sums them.
        da = dz if m == b else column_sum(dz.view(m // b, b * d2)).view(b, d2)
        torch.mm(da, w_src, out=dh[:b])
        # Both biases add to every pair's pre-activation, so their gradients are one
        # sum: taken once, over da's b rows (autograd gives each parameter its copy).
        (dw_src, db), (dw_dst, _), (dw_out, db_out) = param_grads(
            (h[:b], da, True, True), (h[b:], dz, True, False), (z, g, True, True)
        )
        return dh, None, dw_src, db, dw_dst, db, dw_out.view_as(w_out), db_out, None


def link_decoder(
    h: torch.Tensor,
    b: int,
    w_src: torch.Tensor,
    b_src: torch.Tensor,
    w_dst: torch.Tensor,
    b_dst: torch.Tensor,
    w_out: torch.Tensor,
    b_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`sven.kernels.reference.link_decoder`: (B,) positive and (B, n) negative
    logits of the batch layout ``h`` (R, D), R = (2 + n) B."""
    args = (h, w_src, b_src, w_dst, b_dst, w_out, b_out)
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in args)
    return _LinkDecoder.apply(h, b, w_src, b_src, w_dst, b_dst, w_out, b_out, keep)
