"""Triton kernels for masked multi-head temporal attention (one query per root).

Two entry points, each a pair of ``@triton.jit`` kernels (forward, backward), a launch
function, an ``autograd.Function`` and a thin functional wrapper:

- :func:`temporal_attention`: q (R, H, D) against K keys/values per root, as
  :func:`sven.kernels.reference.temporal_attention`.
- :func:`temporal_attention_fused`: the TGN layer's key/value construction widened into
  the kernel: the neighbour gather from per-node projections, the time encoding
  cos(dt * w + b) and its projection, and optional edge contributions, as
  :func:`sven.kernels.reference.temporal_attention_fused`.

Evaluation's factored attention is :mod:`sven.kernels.triton_factored`.

One program handles one (root, head): the K x D tile of keys and values lives in
registers, padded to powers of two and masked, so K and D may be any size (the tile
must fit: K * D up to a few thousand elements). Arithmetic is fp32 whatever the input
dtype; outputs and gradients come back in the input dtype. The launch functions do no
host synchronisation and allocate only shape-dependent buffers, so they can be captured
in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sven.kernels.precision import tf32_dots
from sven.kernels.triton_trig import cos32

__all__ = ["temporal_attention", "temporal_attention_fused"]


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


# -- shared jit helpers ------------------------------------------------------------------


@triton.jit
def _softmax_valid(s, valid):
    """Softmax over the valid slots of s (BLOCK_K,); all zeros where none is valid."""
    s = tl.where(valid, s, float("-inf"))
    mx = tl.max(s, axis=0)
    # A fully masked row has max -inf; any finite shift keeps exp() at 0 there.
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    p = tl.where(valid, tl.exp(s - mx), 0.0)
    den = tl.sum(p, axis=0)
    return p / tl.where(den > 0.0, den, 1.0)


@triton.jit
def _attn_grads(q, k, v, p, do, scale):
    """Gradients of out = sum_k p_k v_k, p = softmax(scale * k.q) for one (root, head).

    Returns dq (BLOCK_D,), dk and dv (BLOCK_K, BLOCK_D); zero where p is zero.
    """
    dp = tl.sum(v * do[None, :], axis=1)
    delta = tl.sum(p * dp, axis=0)
    ds = p * (dp - delta)
    dq = tl.sum(ds[:, None] * k, axis=0) * scale
    dk = ds[:, None] * q[None, :] * scale
    dv = p[:, None] * do[None, :]
    return dq, dk, dv


# -- plain attention -----------------------------------------------------------------------


@triton.jit
def _attn_head(
    q_ptr, k_ptr, v_ptr, m_ptr, r, h, ok, od, K, D, scale,
    sq_r, sq_h, sq_d,
    sk_r, sk_k, sk_h, sk_d,
    sv_r, sv_k, sv_h, sv_d,
    sm_r, sm_k,
):  # fmt: skip
    """Loads head h of root r in fp32; returns q (BLOCK_D,), k, v (BLOCK_K, BLOCK_D), p."""
    dm = od < D
    valid = tl.load(m_ptr + r * sm_r + ok * sm_k, mask=ok < K, other=0) != 0
    tile = valid[:, None] & dm[None, :]
    q = tl.load(q_ptr + r * sq_r + h * sq_h + od * sq_d, mask=dm, other=0.0).to(tl.float32)
    k = tl.load(
        k_ptr + r * sk_r + ok[:, None] * sk_k + h * sk_h + od[None, :] * sk_d,
        mask=tile, other=0.0,
    ).to(tl.float32)  # fmt: skip
    v = tl.load(
        v_ptr + r * sv_r + ok[:, None] * sv_k + h * sv_h + od[None, :] * sv_d,
        mask=tile, other=0.0,
    ).to(tl.float32)  # fmt: skip
    p = _softmax_valid(tl.sum(k * q[None, :], axis=1) * scale, valid)
    return q, k, v, p


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, K, D, scale,
    sq_r, sq_h, sq_d, sk_r, sk_k, sk_h, sk_d, sv_r, sv_k, sv_h, sv_d, sm_r, sm_k,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # out is (R, H * D) contiguous.
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    nh = tl.num_programs(1)
    od = tl.arange(0, BLOCK_D)
    _, _, v, p = _attn_head(
        q_ptr, k_ptr, v_ptr, m_ptr, r, h, tl.arange(0, BLOCK_K), od, K, D, scale,
        sq_r, sq_h, sq_d, sk_r, sk_k, sk_h, sk_d, sv_r, sv_k, sv_h, sv_d, sm_r, sm_k,
    )  # fmt: skip
    out = tl.sum(p[:, None] * v, axis=0)
    tl.store(o_ptr + (r * nh + h) * D + od, out.to(o_ptr.dtype.element_ty), mask=od < D)


@triton.jit
def _attn_bwd_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr, K, D, scale,
    sq_r, sq_h, sq_d, sk_r, sk_k, sk_h, sk_d, sv_r, sv_k, sv_h, sv_d, sm_r, sm_k,
    sdo_r, sdo_c,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # dq is (R, H, D) and dk, dv (R, K, H, D), all contiguous.
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    nh = tl.num_programs(1)
    ok = tl.arange(0, BLOCK_K)
    od = tl.arange(0, BLOCK_D)
    dm = od < D
    q, k, v, p = _attn_head(
        q_ptr, k_ptr, v_ptr, m_ptr, r, h, ok, od, K, D, scale,
        sq_r, sq_h, sq_d, sk_r, sk_k, sk_h, sk_d, sv_r, sv_k, sv_h, sv_d, sm_r, sm_k,
    )  # fmt: skip
    do = tl.load(do_ptr + r * sdo_r + (h * D + od) * sdo_c, mask=dm, other=0.0).to(tl.float32)
    dq, dk, dv = _attn_grads(q, k, v, p, do, scale)
    tl.store(dq_ptr + (r * nh + h) * D + od, dq.to(dq_ptr.dtype.element_ty), mask=dm)
    # Every slot below K is written (zeros where masked): the buffers come uninitialised.
    off = ((r * K + ok[:, None]) * nh + h) * D + od[None, :]
    out_tile = (ok < K)[:, None] & dm[None, :]
    tl.store(dk_ptr + off, dk.to(dk_ptr.dtype.element_ty), mask=out_tile)
    tl.store(dv_ptr + off, dv.to(dv_ptr.dtype.element_ty), mask=out_tile)


def _mask_u8(mask: torch.Tensor) -> torch.Tensor:
    # Same storage, one byte per flag: Triton loads it as an integer.
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


class _TemporalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask):  # type: ignore[override]
        r, h, d = q.shape
        kk = k.shape[1]
        m8 = _mask_u8(mask)
        out = torch.empty(r, h * d, device=q.device, dtype=q.dtype)
        scale = 1.0 / (d**0.5)
        if r > 0:
            _attn_fwd_kernel[(r, h)](
                q, k, v, m8, out, kk, d, scale,
                *q.stride(), *k.stride(), *v.stride(), *m8.stride(),
                BLOCK_K=_pow2(kk), BLOCK_D=_pow2(d),
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, m8)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, m8 = ctx.saved_tensors
        r, h, d = q.shape
        kk = k.shape[1]
        dq = torch.empty(r, h, d, device=q.device, dtype=q.dtype)
        dk = torch.empty(r, kk, h, d, device=q.device, dtype=k.dtype)
        dv = torch.empty(r, kk, h, d, device=q.device, dtype=v.dtype)
        if r > 0:
            _attn_bwd_kernel[(r, h)](
                q, k, v, m8, dout, dq, dk, dv, kk, d, ctx.scale,
                *q.stride(), *k.stride(), *v.stride(), *m8.stride(), *dout.stride(),
                BLOCK_K=_pow2(kk), BLOCK_D=_pow2(d),
            )  # fmt: skip
        return dq, dk, dv, None


def temporal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Masked multi-head attention of one query per root over its K neighbours (Triton).

    Same contract as :func:`sven.kernels.reference.temporal_attention`; inputs may be
    strided views (no copies are made).

    Args:
        q: (R, H, D) queries.
        k: (R, K, H, D) keys.
        v: (R, K, H, D) values.
        mask: (R, K) bool, True where the slot is valid.

    Returns:
        (R, H * D) in q's dtype; zero rows (and zero gradients) where no slot is valid.
    """
    return _TemporalAttention.apply(q, k, v, mask)


# -- fused: gather + time encoding + projection + attention ---------------------------------


@triton.jit
def _fused_kv(
    r, h, ok, od, valid, dm,
    kvn_ptr, pos_ptr, dt_ptr, tw_ptr, tb_ptr, wt_ptr, kve_ptr,
    D, OD, T,
    sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sw_o, sw_t, se_r, se_k, se_c,
    HAS_EDGE: tl.constexpr, BF16_DOT: tl.constexpr, TF32: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Keys and values (BLOCK_K, BLOCK_D) of head h of root r, in fp32; 0 where masked."""
    tile = valid[:, None] & dm[None, :]
    nbr = tl.load(pos_ptr + r * sp_r + ok * sp_k, mask=valid, other=0).to(tl.int64)
    ck = h * D + od
    cv = OD + h * D + od
    row = kvn_ptr + nbr[:, None] * sn_u
    key = tl.load(row + ck[None, :] * sn_c, mask=tile, other=0.0).to(tl.float32)
    val = tl.load(row + cv[None, :] * sn_c, mask=tile, other=0.0).to(tl.float32)
    if HAS_EDGE:
        erow = kve_ptr + r * se_r + ok[:, None] * se_k
        key += tl.load(erow + ck[None, :] * se_c, mask=tile, other=0.0).to(tl.float32)
        val += tl.load(erow + cv[None, :] * se_c, mask=tile, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + r * sdt_r + ok * sdt_k, mask=valid, other=0.0).to(tl.float32)
    for t0 in range(0, T, BLOCK_T):
        ot = t0 + tl.arange(0, BLOCK_T)
        tm = ot < T
        w = tl.load(tw_ptr + ot, mask=tm, other=0.0).to(tl.float32)
        b = tl.load(tb_ptr + ot, mask=tm, other=0.0).to(tl.float32)
        te = cos32(dt[:, None] * w[None, :] + b[None, :])
        te = tl.where(valid[:, None] & tm[None, :], te, 0.0)
        wtile = tm[:, None] & dm[None, :]
        wk = tl.load(wt_ptr + ck[None, :] * sw_o + ot[:, None] * sw_t, mask=wtile, other=0.0)
        wv = tl.load(wt_ptr + cv[None, :] * sw_o + ot[:, None] * sw_t, mask=wtile, other=0.0)
        if BF16_DOT:
            # As the reference: the encoding is rounded to the model dtype before the
            # projection, which accumulates in fp32. bf16 values are exact in tf32, so a
            # tf32 dot of the rounded operands is a bf16 dot (and the interpreter, whose
            # bf16 dot is wrong in triton 3.9, runs it in fp32).
            te = te.to(tl.bfloat16).to(tl.float32)
        if BF16_DOT or TF32:
            key += tl.dot(te, wk.to(tl.float32), input_precision="tf32")
            val += tl.dot(te, wv.to(tl.float32), input_precision="tf32")
        else:
            key += tl.dot(te, wk.to(tl.float32), input_precision="ieee")
            val += tl.dot(te, wv.to(tl.float32), input_precision="ieee")
    return key, val


@triton.jit
def _fused_fwd_kernel(
    q_ptr, kvn_ptr, pos_ptr, dt_ptr, m_ptr, tw_ptr, tb_ptr, wt_ptr, kve_ptr, o_ptr,
    K, D, OD, T, scale,
    sq_r, sq_h, sq_d,
    sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sm_r, sm_k, sw_o, sw_t, se_r, se_k, se_c,
    HAS_EDGE: tl.constexpr, BF16_DOT: tl.constexpr, TF32: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    od = tl.arange(0, BLOCK_D)
    dm = od < D
    valid = tl.load(m_ptr + r * sm_r + ok * sm_k, mask=ok < K, other=0) != 0
    key, val = _fused_kv(
        r, h, ok, od, valid, dm, kvn_ptr, pos_ptr, dt_ptr, tw_ptr, tb_ptr, wt_ptr, kve_ptr,
        D, OD, T, sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sw_o, sw_t, se_r, se_k, se_c,
        HAS_EDGE, BF16_DOT, TF32, BLOCK_K, BLOCK_D, BLOCK_T,
    )  # fmt: skip
    q = tl.load(q_ptr + r * sq_r + h * sq_h + od * sq_d, mask=dm, other=0.0).to(tl.float32)
    p = _softmax_valid(tl.sum(key * q[None, :], axis=1) * scale, valid)
    out = tl.sum(p[:, None] * val, axis=0)
    tl.store(o_ptr + r * OD + h * D + od, out.to(o_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _fused_bwd_kernel(
    q_ptr, kvn_ptr, pos_ptr, dt_ptr, m_ptr, tw_ptr, tb_ptr, wt_ptr, kve_ptr,
    do_ptr, dq_ptr, dkv_ptr,
    K, D, OD, T, scale,
    sq_r, sq_h, sq_d,
    sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sm_r, sm_k, sw_o, sw_t, se_r, se_k, se_c,
    sdo_r, sdo_c,
    HAS_EDGE: tl.constexpr, BF16_DOT: tl.constexpr, TF32: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    # dq is (R, H, D) contiguous; dkv (R, K, 2 O) fp32 contiguous: the gradient of each
    # neighbour slot's key/value row, the one tensor the weight and scatter grads need.
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    od = tl.arange(0, BLOCK_D)
    km = ok < K
    dm = od < D
    valid = tl.load(m_ptr + r * sm_r + ok * sm_k, mask=km, other=0) != 0
    key, val = _fused_kv(
        r, h, ok, od, valid, dm, kvn_ptr, pos_ptr, dt_ptr, tw_ptr, tb_ptr, wt_ptr, kve_ptr,
        D, OD, T, sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sw_o, sw_t, se_r, se_k, se_c,
        HAS_EDGE, BF16_DOT, TF32, BLOCK_K, BLOCK_D, BLOCK_T,
    )  # fmt: skip
    q = tl.load(q_ptr + r * sq_r + h * sq_h + od * sq_d, mask=dm, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + r * sdo_r + (h * D + od) * sdo_c, mask=dm, other=0.0).to(tl.float32)
    p = _softmax_valid(tl.sum(key * q[None, :], axis=1) * scale, valid)
    dq, dk, dv = _attn_grads(q, key, val, p, do, scale)
    tl.store(dq_ptr + r * OD + h * D + od, dq.to(dq_ptr.dtype.element_ty), mask=dm)
    row = dkv_ptr + (r * K + ok[:, None]) * (2 * OD)
    out_tile = km[:, None] & dm[None, :]
    tl.store(row + (h * D + od)[None, :], dk, mask=out_tile)
    tl.store(row + (OD + h * D + od)[None, :], dv, mask=out_tile)


def _fused_args(q, kv_node, nbr_pos, dt, m8, time_w, time_b, w_kv_time, kv_edge):
    _, h, d = q.shape
    kk = nbr_pos.shape[1]
    o = h * d
    t = time_w.shape[0]
    edge = kv_edge if kv_edge is not None else kv_node  # any pointer; unused
    se = kv_edge.stride() if kv_edge is not None else (0, 0, 0)
    tensors = [q, kv_node, nbr_pos, dt, m8, time_w, time_b, w_kv_time, edge]
    sizes = [kk, d, o, t, 1.0 / (d**0.5)]
    strides = [
        *q.stride(), *kv_node.stride(), *nbr_pos.stride(), *dt.stride(), *m8.stride(),
        *w_kv_time.stride(), *se,
    ]  # fmt: skip
    meta = {
        "HAS_EDGE": kv_edge is not None,
        "BF16_DOT": q.dtype == torch.bfloat16,
        "TF32": tf32_dots(q),
        "BLOCK_K": _pow2(kk, 16),
        "BLOCK_D": _pow2(d, 16),
        "BLOCK_T": min(_pow2(t, 16), 32),
    }
    return tensors, sizes, strides, meta


class _TemporalAttentionFused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv_node, nbr_pos, dt, mask, time_w, time_b, w_kv_time, kv_edge):  # type: ignore[override]
        r, h, d = q.shape
        m8 = _mask_u8(mask)
        tw, tb = time_w.contiguous(), time_b.contiguous()
        tensors, sizes, strides, meta = _fused_args(
            q, kv_node, nbr_pos, dt, m8, tw, tb, w_kv_time, kv_edge
        )
        out = torch.empty(r, h * d, device=q.device, dtype=q.dtype)
        if r > 0:
            _fused_fwd_kernel[(r, h)](*tensors, out, *sizes, *strides, **meta)
        ctx.save_for_backward(q, kv_node, nbr_pos, dt, m8, tw, tb, w_kv_time, kv_edge)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, kv_node, nbr_pos, dt, m8, tw, tb, w_kv_time, kv_edge = ctx.saved_tensors
        r, h, d = q.shape
        kk = nbr_pos.shape[1]
        o = h * d
        tensors, sizes, strides, meta = _fused_args(
            q, kv_node, nbr_pos, dt, m8, tw, tb, w_kv_time, kv_edge
        )
        dq = torch.empty(r, h, d, device=q.device, dtype=q.dtype)
        dkv = torch.empty(r, kk, 2 * o, device=q.device, dtype=torch.float32)
        if r > 0:
            _fused_bwd_kernel[(r, h)](
                *tensors, dout, dq, dkv, *sizes, *strides, *dout.stride(), **meta
            )
        grads = _fused_input_grads(
            ctx.needs_input_grad, dkv, kv_node, nbr_pos, dt, tw, tb, w_kv_time, kv_edge
        )
        return dq, *grads


def _fused_input_grads(need, dkv, kv_node, nbr_pos, dt, tw, tb, w_kv_time, kv_edge):
    """Grads of kv_node, nbr_pos, dt, mask, time_w, time_b, w_kv_time, kv_edge from the
    per-slot gradient dkv (R, K, 2 O) fp32; ``need`` is ctx.needs_input_grad."""
    flat = dkv.view(-1, dkv.shape[-1])
    d_node = d_tw = d_tb = d_wt = d_edge = None
    if need[1]:
        # The embedding backward sums each node's slots in sorted segments: parallel over
        # repeats (an index_add_ would use atomics, whose order varies between runs, or
        # under deterministic mode a sort that serialises the repeats of one row, and
        # fixed-size batches repeat the scratch row a lot). No host sync.
        d_node = torch.ops.aten.embedding_dense_backward(
            flat, nbr_pos.reshape(-1), kv_node.shape[0], -1, False
        ).to(kv_node.dtype)
    if need[5] or need[6] or need[7]:
        pre = dt.reshape(-1, 1).to(torch.float32) * tw.float() + tb.float()
        if need[7]:
            d_wt = (flat.t() @ torch.cos(pre)).to(w_kv_time.dtype)
        if need[5] or need[6]:
            d_pre = -(flat @ w_kv_time.float()) * torch.sin(pre)
            if need[5]:
                d_tw = (d_pre * dt.reshape(-1, 1).to(torch.float32)).sum(0).to(tw.dtype)
            if need[6]:
                d_tb = d_pre.sum(0).to(tb.dtype)
    if need[8]:
        d_edge = dkv.to(kv_edge.dtype)
    return d_node, None, None, None, d_tw, d_tb, d_wt, d_edge


def temporal_attention_fused(
    q: torch.Tensor,
    kv_node: torch.Tensor,
    nbr_pos: torch.Tensor,
    dt: torch.Tensor,
    mask: torch.Tensor,
    time_w: torch.Tensor,
    time_b: torch.Tensor,
    w_kv_time: torch.Tensor,
    kv_edge: torch.Tensor | None = None,
    rows: object = None,
) -> torch.Tensor:
    """Temporal attention with the key/value construction inside the kernel (Triton).

    Same contract as :func:`sven.kernels.reference.temporal_attention_fused`. The
    forward reads each neighbour's projection row, builds cos(dt * w + b) and its
    projection in registers and attends, never materialising the (R, K, 2 O) keys and
    values (``rows``, the reference's choice of row gather, is not used: the kernel reads
    the rows itself). The backward recomputes them, writes the per-slot gradient (R, K, 2 O) once
    and derives the grads of ``kv_node`` (a scatter-add over ``nbr_pos``),
    ``w_kv_time`` (one GEMM), ``kv_edge`` (that gradient itself) and, if they require
    grad, ``time_w`` and ``time_b``.

    Determinism: the scatter-add into ``kv_node``'s gradient is the embedding backward
    (indices sorted, each node's contributions summed as one segment in a fixed order),
    so results repeat bit for bit with or without torch's deterministic mode.

    Args:
        q: (R, H, D) queries.
        kv_node: (U, 2 O) per-node key/value projections (O = H * D), keys first.
        nbr_pos: (R, K) int row of each neighbour in ``kv_node`` (any valid row where
            masked).
        dt: (R, K) time since each neighbour event.
        mask: (R, K) bool validity.
        time_w: (T,) time-encoding frequencies.
        time_b: (T,) time-encoding phases.
        w_kv_time: (2 OD, T) projection of the time encoding.
        kv_edge: (R, K, 2 O) edge contributions, or None.

    Returns:
        (R, O) in q's dtype.
    """
    return _TemporalAttentionFused.apply(
        q, kv_node, nbr_pos, dt, mask, time_w, time_b, w_kv_time, kv_edge
    )
