"""Triton kernel for evaluation's factored temporal attention (forward only).

:func:`temporal_attention_factored` computes
:func:`sven.kernels.reference.temporal_attention_factored`: the queries carried back
through the key blocks of the time (and edge) projections, then one kernel that gathers
each neighbour's node key and value, builds cos(dt w + b) in registers and attends, then
the attention-weighted slot features forward through the value blocks.

One program per root holds every head at once. Each slot's time encoding (its cosines
of large arguments are costly) is built once and stays in registers (BLOCK_T holds all
of T) for both uses: the scores, then the weighted sums. Every gather whose address is
known is issued before any arithmetic waits on one. The edge rows are read in chunks
of BLOCK_E columns, twice (scores, then weighted sums; the second read hits the cache),
so that rows of any width fit. Operands: qt (R, H, T) and qe (R, H, E), the queries
carried back through the key blocks of the time and edge projections, possibly a
per-head product's (H, R, F) output seen as (R, H, F) (strides sqt_*, sqe_*; columns
contiguous); outputs: the attention over the node values o (R, H, D) and the
attention-weighted slot features ft (R, H, T), fe (R, H, E), all contiguous. Edge
features: ef (R, K, E), or with EDGE_ROWS the (events, E) table whose row er[r, k] each
slot reads. With Q_ROWS, root r reads row qr[r] of the queries and their products (one
row per node: roots of one node share it), else row r.

The default kernel is :func:`_factored_split_kernel` (:data:`FACTORED_KERNEL`): a
root's K slots in two power-of-two tiles (ten as eight and two) rather than one padded
to sixteen, on 2 warps. ``SVEN_FACTORED_KERNEL=tiles`` runs :func:`_factored_fwd_kernel`
(one tile of slots, the earlier default) and ``SVEN_FACTORED_KERNEL=dot``
:func:`_factored_dot_kernel`: the same program per root, its sums over slots and columns
as matrix products (``tl.dot``, on TF32 tensor cores where cuBLAS's setting allows
them) on (slots, heads) tiles rather than broadcasts and reductions on (slots, heads,
columns) ones.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sven.kernels.precision import tf32_dots
from sven.kernels.triton_attention import _mask_u8, _pow2, _softmax_valid
from sven.kernels.triton_trig import cos32

__all__ = ["temporal_attention_factored"]


@triton.jit
def _slot_feat(
    r, ok, valid, oc, cm, f_ptr, dt_ptr, tw_ptr, tb_ptr, f_at, sf_c, sdt_r, sdt_k, read,
    IS_TIME: tl.constexpr,
):  # fmt: skip
    """One chunk (BLOCK_K, BLOCK_C) of root r's slot features, fp32, 0 where masked: the
    time encoding cos(dt w + b) computed here, or edge features read (each slot's row
    at offset ``f_at`` (BLOCK_K,) of ``f_ptr``); the gaps read where ``read``."""
    tile = valid[:, None] & cm[None, :]
    if IS_TIME:
        dt = tl.load(dt_ptr + r * sdt_r + ok * sdt_k, mask=read, other=0.0).to(tl.float32)
        w = tl.load(tw_ptr + oc, mask=cm, other=0.0).to(tl.float32)
        b = tl.load(tb_ptr + oc, mask=cm, other=0.0).to(tl.float32)
        f = cos32(dt[:, None] * w[None, :] + b[None, :])
    else:
        f = tl.load(f_ptr + f_at[:, None] + oc[None, :] * sf_c, mask=tile, other=0.0)
    return tl.where(tile, f.to(tl.float32), 0.0)


@triton.jit
def _query_row(r, qr_ptr, Q_ROWS: tl.constexpr):
    """Root r's row of the queries: row ``qr[r]`` with Q_ROWS, else row r."""
    if Q_ROWS:
        return tl.load(qr_ptr + r).to(tl.int64)
    else:
        return r


@triton.jit
def _slots(
    r, m_ptr, pos_ptr, K, sm_r, sm_k, sp_r, sp_k,
    K0: tl.constexpr, EAGER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Root r's slots K0 .. K0 + BLOCK - 1 (BLOCK,), their flags (slots from K on are
    masked), which of them to read, and their neighbours' rows (int64)."""
    ok = K0 + tl.arange(0, BLOCK)
    valid = tl.load(m_ptr + r * sm_r + ok * sm_k, mask=ok < K, other=0) != 0
    # EAGER: a slot's row and gap are read whatever its flag (a masked slot names a
    # valid row, and its gap's encoding is zeroed), so they need not wait for it.
    read = (ok < K) if EAGER else valid
    nbr = tl.load(pos_ptr + r * sp_r + ok * sp_k, mask=read, other=0).to(tl.int64)
    return ok, valid, read, nbr


@triton.jit
def _root_slots(
    r, qr_ptr, m_ptr, pos_ptr, K, sm_r, sm_k, sp_r, sp_k,
    Q_ROWS: tl.constexpr, EAGER: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Root r's row of the queries, its slots (BLOCK_K,), their flags, which of them to
    read, and their neighbours' rows (int64)."""
    ok, valid, read, nbr = _slots(r, m_ptr, pos_ptr, K, sm_r, sm_k, sp_r, sp_k, 0, EAGER,
                                  BLOCK_K)  # fmt: skip
    return _query_row(r, qr_ptr, Q_ROWS), ok, valid, read, nbr


@triton.jit
def _edge_at(r, ok, read, er_ptr, ser_r, ser_k, se_r, se_k, EDGE_ROWS: tl.constexpr):
    """Where each slot of root r reads its edge row (BLOCK_K,): a row of the table
    ``er`` names, or the slot's own."""
    if EDGE_ROWS:
        erow = tl.load(er_ptr + r * ser_r + ok * ser_k, mask=read, other=0).to(tl.int64)
        return erow * se_r
    else:
        return r * se_r + ok * se_k


@triton.jit
def _factored_fwd_kernel(
    q_ptr, qt_ptr, qe_ptr, kvn_ptr, pos_ptr, dt_ptr, m_ptr, tw_ptr, tb_ptr, ef_ptr, er_ptr,
    qr_ptr, o_ptr, ft_ptr, fe_ptr,
    K, H, D, OD, T, E, scale,
    sq_r, sq_h, sq_d, sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sm_r, sm_k, se_r, se_k, se_c,
    ser_r, ser_k, sqt_r, sqt_h, sqe_r, sqe_h,
    HAS_EDGE: tl.constexpr, EDGE_ROWS: tl.constexpr, Q_ROWS: tl.constexpr, EAGER: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    # One program per root, every head at once; operands: the module docstring.
    r = tl.program_id(0).to(tl.int64)
    qi, ok, valid, read, nbr = _root_slots(r, qr_ptr, m_ptr, pos_ptr, K, sm_r, sm_k, sp_r,
                                           sp_k, Q_ROWS, EAGER, BLOCK_K)  # fmt: skip
    oh = tl.arange(0, BLOCK_H)
    od = tl.arange(0, BLOCK_D)
    hm = oh < H
    hdm = hm[:, None] & (od < D)[None, :]
    hd = oh[:, None] * D + od[None, :]
    qrow = r * H + oh
    tile = valid[:, None, None] & hdm[None, :, :]
    row = kvn_ptr + nbr[:, None, None] * sn_u
    # Every gather whose address is known is issued here, before any arithmetic waits
    # on one: a program's loads are in flight together rather than one after another.
    key = tl.load(row + hd[None, :, :] * sn_c, mask=tile, other=0.0).to(tl.float32)
    val = tl.load(row + (OD + hd)[None, :, :] * sn_c, mask=tile, other=0.0).to(tl.float32)
    q_at = q_ptr + qi * sq_r + oh[:, None] * sq_h + od[None, :] * sq_d
    q = tl.load(q_at, mask=hdm, other=0.0).to(tl.float32)
    s = tl.sum(key * q[None, :, :], axis=2)
    ot = tl.arange(0, BLOCK_T)
    tm = hm[:, None] & (ot < T)[None, :]
    ftime = _slot_feat(r, ok, valid, ot, ot < T, ef_ptr, dt_ptr, tw_ptr, tb_ptr, ok, 0,
                       sdt_r, sdt_k, read, True)  # fmt: skip
    qt = tl.load(qt_ptr + qi * sqt_r + oh[:, None] * sqt_h + ot[None, :], mask=tm, other=0.0)
    s += tl.sum(ftime[:, None, :] * qt.to(tl.float32)[None, :, :], axis=2)
    if HAS_EDGE:
        oe = tl.arange(0, BLOCK_E)
        e_at = _edge_at(r, ok, read, er_ptr, ser_r, ser_k, se_r, se_k, EDGE_ROWS)
        for e0 in range(0, E, BLOCK_E):
            ec = e0 + oe
            fedge = _slot_feat(r, ok, valid, ec, ec < E, ef_ptr, dt_ptr, tw_ptr, tb_ptr, e_at,
                               se_c, 0, 0, read, False)  # fmt: skip
            em = hm[:, None] & (ec < E)[None, :]
            qe = tl.load(qe_ptr + qi * sqe_r + oh[:, None] * sqe_h + ec[None, :], mask=em,
                         other=0.0)  # fmt: skip
            s += tl.sum(fedge[:, None, :] * qe.to(tl.float32)[None, :, :], axis=2)
    p = _softmax_valid(s * scale, valid[:, None] & hm[None, :])
    out = tl.sum(p[:, :, None] * val, axis=0)
    tl.store(o_ptr + qrow[:, None] * D + od[None, :], out.to(o_ptr.dtype.element_ty), mask=hdm)
    # Distinct names for the time's and the edges' weighted sums: a name bound before a
    # loop and again inside it is a loop-carried value to Triton, of one fixed shape.
    wt = tl.sum(p[:, :, None] * ftime[:, None, :], axis=0)
    tl.store(ft_ptr + qrow[:, None] * T + ot[None, :], wt.to(ft_ptr.dtype.element_ty), mask=tm)
    if HAS_EDGE:
        for e0 in range(0, E, BLOCK_E):
            ec = e0 + oe
            fedge = _slot_feat(r, ok, valid, ec, ec < E, ef_ptr, dt_ptr, tw_ptr, tb_ptr, e_at,
                               se_c, 0, 0, read, False)  # fmt: skip
            em = hm[:, None] & (ec < E)[None, :]
            we = tl.sum(p[:, :, None] * fedge[:, None, :], axis=0)
            tl.store(fe_ptr + qrow[:, None] * E + ec[None, :], we.to(fe_ptr.dtype.element_ty),
                     mask=em)  # fmt: skip


@triton.jit
def _mm(a, b, TF32: tl.constexpr):
    """a @ b in float32, on TF32 tensor cores where ``TF32``."""
    if TF32:
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _factored_dot_kernel(
    q_ptr, qt_ptr, qe_ptr, kvn_ptr, pos_ptr, dt_ptr, m_ptr, tw_ptr, tb_ptr, ef_ptr, er_ptr,
    qr_ptr, o_ptr, ft_ptr, fe_ptr,
    K, H: tl.constexpr, D: tl.constexpr, OD: tl.constexpr, T, E, scale,
    sq_r, sq_h, sq_d, sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sm_r, sm_k, se_r, se_k, se_c,
    ser_r, ser_k, sqt_r, sqt_h, sqe_r, sqe_h,
    HAS_EDGE: tl.constexpr, EDGE_ROWS: tl.constexpr, Q_ROWS: tl.constexpr, EAGER: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_O: tl.constexpr, TF32: tl.constexpr, ROW_VEC: tl.constexpr,
):  # fmt: skip
    # _factored_fwd_kernel's function and operands, its sums over slots and columns as
    # matrix products (tl.dot) on (slots, heads) tiles: the wide batch's kernel is bound
    # by issuing instructions, and the 3-D tiles' broadcasts and cross-thread
    # reductions are most of them. Heads are padded to BLOCK_H >= 16 (a product's
    # smallest side); a node row's keys (and values) are one (slots, H D) tile, and the
    # query a block-diagonal (H D, heads) operand, so one product scores every head.
    # H and D are constants of the compile: a column's head is then a multiply and a
    # shift, not an integer division.
    r = tl.program_id(0).to(tl.int64)
    qi, ok, valid, read, nbr = _root_slots(r, qr_ptr, m_ptr, pos_ptr, K, sm_r, sm_k, sp_r,
                                           sp_k, Q_ROWS, EAGER, BLOCK_K)  # fmt: skip
    oh = tl.arange(0, BLOCK_H)
    hm = oh < H
    oc = tl.arange(0, BLOCK_O)
    cm = oc < OD
    ch = oc // D
    tile = valid[:, None] & cm[None, :]
    # Rows start at multiples of ROW_VEC elements (checked at the launch): the gathers
    # are then vector loads, a quarter of the load and address instructions.
    row = kvn_ptr + tl.multiple_of(nbr * sn_u, ROW_VEC)[:, None]
    key = tl.load(row + oc[None, :] * sn_c, mask=tile, other=0.0).to(tl.float32)
    val = tl.load(row + (OD + oc)[None, :] * sn_c, mask=tile, other=0.0).to(tl.float32)
    qf = tl.load(q_ptr + qi * sq_r + ch * sq_h + (oc - ch * D) * sq_d, mask=cm, other=0.0)
    qbd = tl.where(ch[:, None] == oh[None, :], qf.to(tl.float32)[:, None], 0.0)
    s = _mm(key, qbd, TF32)
    ot = tl.arange(0, BLOCK_T)
    tm = ot < T
    ftime = _slot_feat(r, ok, valid, ot, tm, ef_ptr, dt_ptr, tw_ptr, tb_ptr, ok, 0,
                       sdt_r, sdt_k, read, True)  # fmt: skip
    qt_at = qt_ptr + qi * sqt_r + oh[None, :] * sqt_h + ot[:, None]
    qt = tl.load(qt_at, mask=tm[:, None] & hm[None, :], other=0.0)
    s += _mm(ftime, qt.to(tl.float32), TF32)
    if HAS_EDGE:
        oe = tl.arange(0, BLOCK_E)
        e_at = _edge_at(r, ok, read, er_ptr, ser_r, ser_k, se_r, se_k, EDGE_ROWS)
        for e0 in range(0, E, BLOCK_E):
            ec = e0 + oe
            fedge = _slot_feat(r, ok, valid, ec, ec < E, ef_ptr, dt_ptr, tw_ptr, tb_ptr, e_at,
                               se_c, 0, 0, read, False)  # fmt: skip
            qe_at = qe_ptr + qi * sqe_r + oh[None, :] * sqe_h + ec[:, None]
            qe = tl.load(qe_at, mask=(ec < E)[:, None] & hm[None, :], other=0.0)
            s += _mm(fedge, qe.to(tl.float32), TF32)
    p = _softmax_valid(s * scale, valid[:, None] & hm[None, :])
    pt = tl.trans(p)
    # Every head's weights against every column; column c keeps its own head's row.
    ov = _mm(pt, val, TF32)
    out = tl.sum(tl.where(ch[None, :] == oh[:, None], ov, 0.0), axis=0)
    tl.store(o_ptr + r * OD + oc, out.to(o_ptr.dtype.element_ty), mask=cm)
    wt = _mm(pt, ftime, TF32)
    ft_at = ft_ptr + (r * H + oh[:, None]) * T + ot[None, :]
    tl.store(ft_at, wt.to(ft_ptr.dtype.element_ty), mask=hm[:, None] & tm[None, :])
    if HAS_EDGE:
        for e0 in range(0, E, BLOCK_E):
            ec = e0 + oe
            fedge = _slot_feat(r, ok, valid, ec, ec < E, ef_ptr, dt_ptr, tw_ptr, tb_ptr, e_at,
                               se_c, 0, 0, read, False)  # fmt: skip
            we = _mm(pt, fedge, TF32)
            fe_at = fe_ptr + (r * H + oh[:, None]) * E + ec[None, :]
            tl.store(fe_at, we.to(fe_ptr.dtype.element_ty), mask=hm[:, None] & (ec < E)[None, :])


@triton.jit
def _slot_chunk(
    r, qi, q, oh, hm, hdm, hd, qt_ptr, qe_ptr, kvn_ptr, pos_ptr, dt_ptr, m_ptr, tw_ptr, tb_ptr,
    ef_ptr, er_ptr, K, OD, T, E, sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sm_r, sm_k, se_r, se_k,
    se_c, ser_r, ser_k, sqt_r, sqt_h, sqe_r, sqe_h,
    HAS_EDGE: tl.constexpr, EDGE_ROWS: tl.constexpr, EAGER: tl.constexpr, K0: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Root r's slots K0 .. K0 + BLOCK - 1 (those below K): their flags (BLOCK,), edge
    rows' offsets, scores (BLOCK, BLOCK_H) before the scale, node values (BLOCK,
    BLOCK_H, BLOCK_D) and time encodings (BLOCK, BLOCK_T), as _factored_fwd_kernel
    computes them for all of a root's slots."""
    ok, valid, read, nbr = _slots(r, m_ptr, pos_ptr, K, sm_r, sm_k, sp_r, sp_k, K0, EAGER,
                                  BLOCK)  # fmt: skip
    tile = valid[:, None, None] & hdm[None, :, :]
    row = kvn_ptr + nbr[:, None, None] * sn_u
    key = tl.load(row + hd[None, :, :] * sn_c, mask=tile, other=0.0).to(tl.float32)
    val = tl.load(row + (OD + hd)[None, :, :] * sn_c, mask=tile, other=0.0).to(tl.float32)
    s = tl.sum(key * q[None, :, :], axis=2)
    ot = tl.arange(0, BLOCK_T)
    ftime = _slot_feat(r, ok, valid, ot, ot < T, ef_ptr, dt_ptr, tw_ptr, tb_ptr, ok, 0,
                       sdt_r, sdt_k, read, True)  # fmt: skip
    qt = tl.load(qt_ptr + qi * sqt_r + oh[:, None] * sqt_h + ot[None, :],
                 mask=hm[:, None] & (ot < T)[None, :], other=0.0)  # fmt: skip
    s += tl.sum(ftime[:, None, :] * qt.to(tl.float32)[None, :, :], axis=2)
    e_at = _edge_at(r, ok, read, er_ptr, ser_r, ser_k, se_r, se_k, EDGE_ROWS)
    if HAS_EDGE:
        oe = tl.arange(0, BLOCK_E)
        for e0 in range(0, E, BLOCK_E):
            ec = e0 + oe
            fedge = _slot_feat(r, ok, valid, ec, ec < E, ef_ptr, dt_ptr, tw_ptr, tb_ptr, e_at,
                               se_c, 0, 0, read, False)  # fmt: skip
            qe = tl.load(qe_ptr + qi * sqe_r + oh[:, None] * sqe_h + ec[None, :],
                         mask=hm[:, None] & (ec < E)[None, :], other=0.0)  # fmt: skip
            s += tl.sum(fedge[:, None, :] * qe.to(tl.float32)[None, :, :], axis=2)
    return ok, valid, read, e_at, s, val, ftime


@triton.jit
def _factored_split_kernel(
    q_ptr, qt_ptr, qe_ptr, kvn_ptr, pos_ptr, dt_ptr, m_ptr, tw_ptr, tb_ptr, ef_ptr, er_ptr,
    qr_ptr, o_ptr, ft_ptr, fe_ptr,
    K, H, D, OD, T, E, scale,
    sq_r, sq_h, sq_d, sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sm_r, sm_k, se_r, se_k, se_c,
    ser_r, ser_k, sqt_r, sqt_h, sqe_r, sqe_h,
    HAS_EDGE: tl.constexpr, EDGE_ROWS: tl.constexpr, Q_ROWS: tl.constexpr, EAGER: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_K2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    # _factored_fwd_kernel's function and operands, a root's K slots in two tiles of
    # powers of two, BLOCK_K + BLOCK_K2 >= K (ten slots: eight and two, where one tile
    # pads them to sixteen): every (slots, heads, columns) tile shrinks with the slots
    # padded, and the softmax and the weighted sums combine the two tiles.
    r = tl.program_id(0).to(tl.int64)
    qi = _query_row(r, qr_ptr, Q_ROWS)
    oh = tl.arange(0, BLOCK_H)
    od = tl.arange(0, BLOCK_D)
    hm = oh < H
    hdm = hm[:, None] & (od < D)[None, :]
    hd = oh[:, None] * D + od[None, :]
    q = tl.load(q_ptr + qi * sq_r + oh[:, None] * sq_h + od[None, :] * sq_d, mask=hdm,
                other=0.0).to(tl.float32)  # fmt: skip
    ka, va, ra, ea, sa, vala, fta = _slot_chunk(
        r, qi, q, oh, hm, hdm, hd, qt_ptr, qe_ptr, kvn_ptr, pos_ptr, dt_ptr, m_ptr, tw_ptr,
        tb_ptr, ef_ptr, er_ptr, K, OD, T, E, sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sm_r, sm_k,
        se_r, se_k, se_c, ser_r, ser_k, sqt_r, sqt_h, sqe_r, sqe_h, HAS_EDGE, EDGE_ROWS, EAGER,
        0, BLOCK_K, BLOCK_T, BLOCK_E,
    )  # fmt: skip
    kb, vb, rb, eb, sb, valb, ftb = _slot_chunk(
        r, qi, q, oh, hm, hdm, hd, qt_ptr, qe_ptr, kvn_ptr, pos_ptr, dt_ptr, m_ptr, tw_ptr,
        tb_ptr, ef_ptr, er_ptr, K, OD, T, E, sn_u, sn_c, sp_r, sp_k, sdt_r, sdt_k, sm_r, sm_k,
        se_r, se_k, se_c, ser_r, ser_k, sqt_r, sqt_h, sqe_r, sqe_h, HAS_EDGE, EDGE_ROWS, EAGER,
        BLOCK_K, BLOCK_K2, BLOCK_T, BLOCK_E,
    )  # fmt: skip
    # The softmax over both tiles' valid slots, every head.
    oka = va[:, None] & hm[None, :]
    okb = vb[:, None] & hm[None, :]
    sa = tl.where(oka, sa * scale, float("-inf"))
    sb = tl.where(okb, sb * scale, float("-inf"))
    mx = tl.maximum(tl.max(sa, axis=0), tl.max(sb, axis=0))
    # A root without a valid slot has max -inf; any finite shift keeps exp() at 0.
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    pa = tl.where(oka, tl.exp(sa - mx[None, :]), 0.0)
    pb = tl.where(okb, tl.exp(sb - mx[None, :]), 0.0)
    den = tl.sum(pa, axis=0) + tl.sum(pb, axis=0)
    den = tl.where(den > 0.0, den, 1.0)
    pa = pa / den[None, :]
    pb = pb / den[None, :]
    qrow = r * H + oh
    out = tl.sum(pa[:, :, None] * vala, axis=0) + tl.sum(pb[:, :, None] * valb, axis=0)
    tl.store(o_ptr + qrow[:, None] * D + od[None, :], out.to(o_ptr.dtype.element_ty), mask=hdm)
    ot = tl.arange(0, BLOCK_T)
    tm = hm[:, None] & (ot < T)[None, :]
    wt = tl.sum(pa[:, :, None] * fta[:, None, :], axis=0)
    wt += tl.sum(pb[:, :, None] * ftb[:, None, :], axis=0)
    tl.store(ft_ptr + qrow[:, None] * T + ot[None, :], wt.to(ft_ptr.dtype.element_ty), mask=tm)
    if HAS_EDGE:
        oe = tl.arange(0, BLOCK_E)
        for e0 in range(0, E, BLOCK_E):
            ec = e0 + oe
            fa = _slot_feat(r, ka, va, ec, ec < E, ef_ptr, dt_ptr, tw_ptr, tb_ptr, ea, se_c, 0,
                            0, ra, False)  # fmt: skip
            fb = _slot_feat(r, kb, vb, ec, ec < E, ef_ptr, dt_ptr, tw_ptr, tb_ptr, eb, se_c, 0,
                            0, rb, False)  # fmt: skip
            we = tl.sum(pa[:, :, None] * fa[:, None, :], axis=0)
            we += tl.sum(pb[:, :, None] * fb[:, None, :], axis=0)
            em = hm[:, None] & (ec < E)[None, :]
            tl.store(fe_ptr + qrow[:, None] * E + ec[None, :], we.to(fe_ptr.dtype.element_ty),
                     mask=em)  # fmt: skip


#: Warps of a factored-attention program (one root, every head), by kernel: the count
#: each ran fastest at on the MRR batch (docs/performance.md);
#: ``SVEN_FACTORED_WARPS`` sets another count (read at each launch, for A/B runs).
FACTORED_WARPS = {"tiles": 8, "dot": 4, "split": 2}
#: Edge feature columns a factored-attention program reads at a time;
#: ``SVEN_FACTORED_CHUNK`` sets another power of two.
FACTORED_EDGE_CHUNK = 64
#: Whether a program reads its slots' rows and gaps without waiting for their flags
#: (one dependent load fewer per root, a few masked bytes more); ``SVEN_FACTORED_EAGER``
#: (0 or 1) sets the other choice, for A/B runs.
FACTORED_EAGER = False
#: The factored-attention kernel: ``tiles`` (:func:`_factored_fwd_kernel`), ``dot``
#: (:func:`_factored_dot_kernel`) or ``split`` (:func:`_factored_split_kernel`);
#: ``SVEN_FACTORED_KERNEL`` sets another, for A/B runs. The split kernel timed fastest on
#: the MRR batch (docs/performance.md).
FACTORED_KERNEL = "split"
#: How the queries and the weighted sums cross the slot projections: ``blocks`` (one
#: GEMM each over block-diagonal weights) or ``bmm`` (a product per head);
#: ``SVEN_FACTORED_PRODUCTS`` sets the other, for A/B runs.
FACTORED_PRODUCTS = "blocks"
#: The widest time encoding a program holds in registers; wider ones take the
#: reference.
FACTORED_MAX_WIDTH = 256


def _factored_launch(e: int) -> dict[str, int | bool]:
    """The warps, edge columns per chunk (BLOCK_E) and index reads (EAGER) of a launch
    over ``e`` edge columns of the kernel launches run (:func:`_factored_kind`)."""
    warps = int(os.environ.get("SVEN_FACTORED_WARPS", FACTORED_WARPS[_factored_kind()]))
    chunk = int(os.environ.get("SVEN_FACTORED_CHUNK", FACTORED_EDGE_CHUNK))
    eager = os.environ.get("SVEN_FACTORED_EAGER", "1" if FACTORED_EAGER else "0")
    if warps not in (1, 2, 4, 8, 16) or chunk < 16 or chunk & (chunk - 1):
        raise ValueError(
            f"SVEN_FACTORED_WARPS must be 1, 2, 4, 8 or 16 and SVEN_FACTORED_CHUNK a power "
            f"of two of at least 16, got {warps} and {chunk}"
        )
    if eager not in ("0", "1"):
        raise ValueError(f"SVEN_FACTORED_EAGER must be 0 or 1, got {eager!r}")
    return {"num_warps": warps, "BLOCK_E": min(_pow2(e, 16), chunk), "EAGER": eager == "1"}


def _factored_kind() -> str:
    """The factored-attention kernel launches run: ``SVEN_FACTORED_KERNEL``, else
    :data:`FACTORED_KERNEL`."""
    kind = os.environ.get("SVEN_FACTORED_KERNEL", FACTORED_KERNEL)
    if kind not in FACTORED_WARPS:
        raise ValueError(f"SVEN_FACTORED_KERNEL must be tiles, dot or split, got {kind!r}")
    return kind


def _factored_kernel(
    q: torch.Tensor, kv_node: torch.Tensor, h: int, o: int, k: int = 16
) -> tuple[triton.JITFunction, dict]:
    """The factored-attention kernel a launch runs (:func:`_factored_kind`) and its own
    constants, for H = ``h`` heads of O = ``o`` columns, K = ``k`` >= 1 slots, queries
    ``q`` and node rows ``kv_node``."""
    kind = _factored_kind()
    if kind == "tiles":
        return _factored_fwd_kernel, {"BLOCK_H": _pow2(h)}
    if kind == "split":
        # K slots as a power of two at most K, and the rest rounded up to one.
        first = _pow2(k + 1) // 2
        return _factored_split_kernel, {
            "BLOCK_H": _pow2(h),
            "BLOCK_K": first,
            "BLOCK_K2": _pow2(max(k - first, 1)),
        }
    # A product's sides are at least 16.
    blocks = {"BLOCK_H": _pow2(h, 16), "BLOCK_O": _pow2(o, 16)}
    return _factored_dot_kernel, {**blocks, "TF32": tf32_dots(q), "ROW_VEC": _row_vec(kv_node, o)}


def _row_vec(kv_node: torch.Tensor, o: int) -> int:
    """The elements (4, 2 or 1) that every key and value slice of ``kv_node`` (U, 2 O)
    starts at a multiple of, in elements and in 16-byte-aligned addresses where 4."""
    bytes_ = kv_node.element_size()
    for vec in (4, 2):
        aligned = kv_node.data_ptr() % (vec * bytes_) == 0
        if aligned and kv_node.stride(1) == 1 and kv_node.stride(0) % vec == 0 and o % vec == 0:
            return vec
    return 1


def _columns_dense(x: torch.Tensor) -> torch.Tensor:
    # The queries through a projection come from a per-head product as an (H, R, F)
    # tensor seen as (R, H, F): the kernel reads it in place (no copy) where its
    # columns are contiguous.
    return x if x.stride(2) == 1 else x.contiguous()


def _by_blocks() -> bool:
    """Whether the per-head products are single GEMMs over block-diagonal weights
    (``SVEN_FACTORED_PRODUCTS=blocks``, the default) or batched per head (``bmm``)."""
    mode = os.environ.get("SVEN_FACTORED_PRODUCTS", FACTORED_PRODUCTS)
    if mode not in ("blocks", "bmm"):
        raise ValueError(f"SVEN_FACTORED_PRODUCTS must be blocks or bmm, got {mode!r}")
    return mode == "blocks"


def _head_blocks(w: torch.Tensor, h: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value blocks of a slot projection as block-diagonal matrices.

    With D = 50 a head's slice starts 200 bytes into a row, which no 16-byte-aligned
    GEMM kernel takes: the per-head products ran unaligned, and the values' came out
    (H, R, D) and needed an add and a copy. Over block-diagonal weights each is one
    aligned GEMM (its extra multiply-adds are by exact zeros) whose result has the
    layout the kernel and the output want.

    Args:
        w: (2 O, F) the projection of the slot features F (O = H * D), keys first.
        h: H.
        d: D.

    Returns:
        (O, H F) the key block, head h's (D, F) at rows h D, columns h F; (H F, O) the
        value block, head h's (F, D) at rows h F, columns h D (a transposed view).
    """
    f = w.shape[1]
    blocks = w.new_zeros(2, h, d, h, f)
    # The (d, f, h) diagonal of heads: one copy writes every head's block of both halves.
    blocks.diagonal(dim1=1, dim2=3).copy_(w.view(2, h, d, f).permute(0, 2, 3, 1))
    flat = blocks.view(2, h * d, h * f)
    return flat[0], flat[1].t()


def _queries_through(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (Q, H, D) carried back through the key block of ``w`` (2 O, F): (Q, H, F) with
    contiguous columns; and the value block as :func:`_head_blocks` gives it (None where
    the products are batched per head)."""
    _, h, d = q.shape
    f = w.shape[1]
    if not _by_blocks():
        return _columns_dense(torch.einsum("rhd,hdf->rhf", q, w[: h * d].view(h, d, f))), None
    key, value = _head_blocks(w, h, d)
    return (q.reshape(-1, h * d) @ key).view(-1, h, f), value


def _values_through(
    out: torch.Tensor, fa: torch.Tensor, w: torch.Tensor, value: torch.Tensor | None
) -> torch.Tensor:
    """``out`` (R, H, D) plus the attention-weighted features ``fa`` (R, H, F) carried
    forward through the value block of ``w`` (2 O, F); ``value`` as
    :func:`_queries_through` returns it."""
    r, h, d = out.shape
    f = w.shape[1]
    if value is None:
        return out + torch.einsum("rhf,hdf->rhd", fa, w[h * d :].view(h, d, f))
    return torch.addmm(out.view(r, h * d), fa.view(r, h * f), value).view(r, h, d)


def _edge_operands(
    q: torch.Tensor,
    edge_feat: torch.Tensor | None,
    w_kv_edge: torch.Tensor | None,
    edge_rows: torch.Tensor | None,
    qt: torch.Tensor,
    ft: torch.Tensor,
    roots: int,
) -> tuple[
    torch.Tensor | None,
    torch.Tensor,
    tuple[int, int, int],
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
]:
    """The factored kernel's edge operands (arguments as
    :func:`temporal_attention_factored`'s; ``qt``, ``ft`` stand for unused pointers;
    ``roots`` R, the rows of the outputs).

    Returns:
        w_edge (2 O, d_e) in q's dtype (None without edges); what the kernel reads edge
        features from: the (R, K, d_e) features in q's dtype, or the table in place
        (slot (r, k) reads row ``edge_rows[r, k]``, scaled by the first stride); its
        (root, slot, column) strides; qe (Q, H, d_e) the queries through the key block;
        fe (R, H, d_e) the output of the attention-weighted features; the value block
        as :func:`_queries_through` returns it.
    """
    if edge_feat is None or w_kv_edge is None:
        return None, qt, (0, 0, 0), qt, ft, None
    r, h = roots, q.shape[1]
    e = w_kv_edge.shape[1]
    w_edge = w_kv_edge.to(q.dtype)
    qe, value = _queries_through(q, w_edge)
    fe = torch.empty(r, h, e, device=q.device, dtype=q.dtype)
    if edge_rows is None:
        ef = edge_feat.to(q.dtype)
        return w_edge, ef, ef.stride(), qe, fe, value
    se = (edge_feat.stride(0), 0, edge_feat.stride(1))
    return w_edge, edge_feat, se, qe, fe, value


def _launch(
    q: torch.Tensor, qt: torch.Tensor, qe: torch.Tensor, kv_node: torch.Tensor,
    nbr_pos: torch.Tensor, dt: torch.Tensor, mask: torch.Tensor, time_w: torch.Tensor,
    time_b: torch.Tensor, ef: torch.Tensor, se: tuple[int, int, int],
    edge_rows: torch.Tensor | None, q_rows: torch.Tensor | None, out: torch.Tensor,
    ft: torch.Tensor, fe: torch.Tensor, e: int,
) -> None:  # fmt: skip
    """Runs the factored kernel (:func:`_factored_kernel`) over R = ``nbr_pos.shape[0]``
    > 0 roots into ``out`` (R, H, D), ``ft`` (R, H, T), ``fe`` (R, H, E); operands as
    :func:`_edge_operands` returns them, ``e`` the edge columns (0 without edges)."""
    (r, k), (_, h, d), t = nbr_pos.shape, q.shape, time_w.shape[0]
    rows, sr = (edge_rows, edge_rows.stride()) if edge_rows is not None else (nbr_pos, (0, 0))
    m8 = _mask_u8(mask)
    kernel, blocks = _factored_kernel(q, kv_node, h, h * d, max(k, 1))
    blocks = {"BLOCK_K": _pow2(k, 16), **blocks}
    kernel[(r,)](
        q, qt, qe, kv_node, nbr_pos, dt, m8, time_w.contiguous(), time_b.contiguous(), ef,
        rows, nbr_pos if q_rows is None else q_rows, out, ft, fe,
        k, h, d, h * d, t, e, 1.0 / (d**0.5),
        *q.stride(), *kv_node.stride(), *nbr_pos.stride(), *dt.stride(), *m8.stride(), *se,
        *sr, *qt.stride()[:2], *qe.stride()[:2],
        HAS_EDGE=e > 0, EDGE_ROWS=e > 0 and edge_rows is not None, Q_ROWS=q_rows is not None,
        BLOCK_D=_pow2(d, 16), BLOCK_T=_pow2(t, 16),
        **blocks, **_factored_launch(e),
    )  # fmt: skip


def temporal_attention_factored(
    q: torch.Tensor,
    kv_node: torch.Tensor,
    nbr_pos: torch.Tensor,
    dt: torch.Tensor,
    mask: torch.Tensor,
    time_w: torch.Tensor,
    time_b: torch.Tensor,
    w_kv_time: torch.Tensor,
    edge_feat: torch.Tensor | None = None,
    w_kv_edge: torch.Tensor | None = None,
    edge_rows: torch.Tensor | None = None,
    q_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The factored temporal attention's forward as one kernel (Triton), for evaluation.

    Same contract as :func:`sven.kernels.reference.temporal_attention_factored`: the
    queries are carried back through the key blocks of the time (and edge)
    projections and the attention-weighted slot features forward through the value
    blocks, each a GEMM over the roots; between them one kernel gathers each
    neighbour's node key and value, builds cos(dt w + b) in registers, and attends.
    No (R, K, T) or (R, K, 2 O) tensor is written: a wide evaluation batch (100 MRR
    negatives: 206,000 neighbour slots at batch 200) gathers its slots' rows once (edge
    rows by chunks, again from cache for the weighted sums). Forward only: the reference
    runs where a gradient is needed and for time encodings over :data:`FACTORED_MAX_WIDTH`.

    Args:
        q: (R, H, D) queries, or with ``q_rows`` (Q, H, D) rows that roots share.
        kv_node: (U, 2 O) per-node key/value projections (O = H * D), keys first.
        nbr_pos: (R, K) int row of each neighbour in ``kv_node`` (any valid row where
            masked).
        dt: (R, K) time since each neighbour event.
        mask: (R, K) bool validity.
        time_w: (T,) time-encoding frequencies.
        time_b: (T,) time-encoding phases.
        w_kv_time: (2 O, T) projection of the time encoding (no bias).
        edge_feat: (R, K, d_e) neighbour event features, or None; with ``edge_rows``
            the (E, d_e) table they are rows of, read in place (in its dtype).
        w_kv_edge: (2 O, d_e) their projection (no bias), or None.
        edge_rows: (R, K) int row of ``edge_feat`` of each slot (any row where masked),
            or None.
        q_rows: (R,) int row of ``q`` of each root, or None (root r's is row r). A wide
            batch lists each node many times (100 MRR negatives: 20,600 roots over a few
            thousand nodes); a query depends on the root's node alone, so its products
            with the key blocks are computed once per row of ``q``.

    Returns:
        (R, O) in q's dtype; zero rows where no slot is valid.
    """
    from sven.kernels import reference

    args = (q, kv_node, time_w, time_b, w_kv_time, edge_feat, w_kv_edge)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args)
    if grad or time_w.shape[0] > FACTORED_MAX_WIDTH:
        return reference.temporal_attention_factored(
            q, kv_node, nbr_pos, dt, mask, time_w, time_b, w_kv_time, *args[5:], edge_rows,
            q_rows,
        )  # fmt: skip
    r, (_, h, d) = nbr_pos.shape[0], q.shape
    o, t = h * d, time_w.shape[0]
    edge = edge_feat is not None and w_kv_edge is not None
    w_time = w_kv_time.to(q.dtype)
    qt, v_time = _queries_through(q, w_time)
    ft = torch.empty(r, h, t, device=q.device, dtype=q.dtype)
    out = torch.empty(r, h, d, device=q.device, dtype=q.dtype)
    w_edge, ef, se, qe, fe, v_edge = _edge_operands(q, edge_feat, w_kv_edge, edge_rows, qt, ft, r)
    e = int(w_kv_edge.shape[1]) if edge else 0
    if r > 0:
        _launch(q, qt, qe, kv_node, nbr_pos, dt, mask, time_w, time_b, ef, se, edge_rows,
                q_rows, out, ft, fe, e)  # fmt: skip
    out = _values_through(out, ft, w_time, v_time)
    if edge:
        out = _values_through(out, fe, w_edge, v_edge)
    return out.reshape(r, o)
