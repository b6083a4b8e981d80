"""PyTorch reference implementations of Sven's hot paths.

These functions are the specification: the CPU path runs them directly, and the Triton
kernels are tested against them (forward and backward). Keep them simple and exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from sven.kernels.backend import backend_for
from sven.kernels.sums import linear


def take_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` along the first dimension, for an index of any shape.

    On CUDA the gather runs as an embedding lookup: its backward sums the gradients of
    repeated rows by sorting them into segments, in parallel and deterministically,
    while advanced indexing's backward (``index_put_`` with accumulation) walks the
    repeats of one row serially. Fixed-size batches repeat rows a lot (every masked
    neighbour slot points at the one scratch slot), which made that backward the
    largest kernel of a TGN step on CUDA (docs/performance.md, "Where a step's time
    goes").

    Args:
        table: (U, D) rows.
        idx: (...) int64 positions in [0, U).

    Returns:
        (..., D).
    """
    if table.is_cuda and table.dim() == 2 and table.requires_grad:
        return F.embedding(idx, table)
    return table[idx]


def masked_rows(table: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows of a feature table per neighbour slot, zero where masked.

    Args:
        table: (E, F) features (the events' edge features).
        rows: (R, K) int row of each slot (any valid row where masked).
        mask: (R, K) bool validity.

    Returns:
        (R, K, F) in the table's dtype.
    """
    return table[rows] * mask[..., None].to(table.dtype)


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the valid neighbour slots.

    Args:
        scores: (R, H, K) attention logits.
        mask: (R, K) bool validity.

    Returns:
        (R, H, K) weights, and (R,) whether the row has any valid slot. A fully masked
        row gets uniform weights (its scores would be all -inf, whose softmax is NaN);
        callers zero its output.
    """
    has_any = mask.any(dim=1)
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    scores = torch.where(has_any[:, None, None], scores, torch.zeros_like(scores))
    return torch.softmax(scores, dim=-1), has_any


def temporal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Multi-head attention of one query per root over its K sampled neighbours.

    Args:
        q: (R, H, D) queries, one per root.
        k: (R, K, H, D) keys of the root's neighbours.
        v: (R, K, H, D) values of the root's neighbours.
        mask: (R, K) bool, True where the neighbour slot is valid.

    Returns:
        (R, H * D) attention output; rows with no valid neighbour are zero (not NaN),
        so roots without history contribute only through the skip connection.
    """
    r, h, d = q.shape
    attn, has_any = _masked_softmax(torch.einsum("rhd,rkhd->rhk", q, k) / (d**0.5), mask)
    out = torch.einsum("rhk,rkhd->rhd", attn, v)
    out = out * has_any[:, None, None].to(out.dtype)
    return out.reshape(r, h * d)


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
    """:func:`temporal_attention_fused` with the slot projections factored out.

    The time (and edge) block of a key enters the scores only through ``q . (W te)``,
    which equals ``(W^T q) . te``; the values enter the output only through
    ``sum_k a_k W te_k = W sum_k a_k te_k``. So instead of projecting every neighbour
    slot (R K slots times T inputs times 2 O outputs), this projects the R queries
    backwards and the R attention-weighted sums forwards (R H T D each): about 8x fewer
    multiply-adds for TGN's dims, and no (R, K, 2 O) key/value tensor. The result is
    the same function; only the rounding differs (tests compare with the reference).

    Args:
        q: (R, H, D) queries.
        kv_node: (U, 2 O) per-node key/value projections (O = H * D), keys first.
        nbr_pos: (R, K) int row of each neighbour in ``kv_node`` (any valid row where
            masked).
        dt: (R, K) time since each neighbour event.
        mask: (R, K) bool, True where the slot is valid.
        time_w: (T,) time-encoding frequencies.
        time_b: (T,) time-encoding phases.
        w_kv_time: (2 O, T) projection of the time encoding (no bias).
        edge_feat: (R, K, d_e) neighbour event features, or None; with ``edge_rows``
            the (E, d_e) table they are rows of.
        w_kv_edge: (2 O, d_e) their projection (no bias), or None.
        edge_rows: (R, K) int row of ``edge_feat`` of each slot, or None.
        q_rows: (R,) int row of ``q`` of each root, where ``q`` (Q, H, D) holds rows
            that roots share; None: ``q`` is (R, H, D).

    Returns:
        (R, O) attention output; zero rows where no slot is valid.
    """
    if q_rows is not None:
        q = q.index_select(0, q_rows)
    if edge_rows is not None and edge_feat is not None:
        edge_feat = masked_rows(edge_feat, edge_rows, mask)
    r, h, d = q.shape
    o, k = h * d, nbr_pos.shape[1]
    dt = dt.to(time_w.dtype)[..., None]
    te = torch.cos(torch.addcmul(time_b, dt, time_w)).to(kv_node.dtype)
    slots = [(te, w_kv_time)]
    if edge_feat is not None and w_kv_edge is not None:
        slots.append((edge_feat.to(kv_node.dtype), w_kv_edge))
    # Keys and values gathered per (root, head) as (R, H, K, D), so that the scores and
    # the weighted sums are plain batched matmuls without layout copies; gathered apart,
    # because slicing one gathered (R, K, 2 O) tensor costs a full-size fill per slice
    # in the backward.
    rows = (nbr_pos[:, None, :] * h + torch.arange(h, device=nbr_pos.device)[:, None]).reshape(-1)
    k_node = kv_node[:, :o].reshape(-1, d).index_select(0, rows).view(r, h, k, d)
    v_node = kv_node[:, o:].reshape(-1, d).index_select(0, rows).view(r, h, k, d)
    scores = torch.matmul(q[:, :, None, :], k_node.transpose(-1, -2)).squeeze(2)
    for f, w in slots:
        # (R, H, F): each query carried back through the key block of W.
        qf = torch.einsum("rhd,hdf->rhf", q, w[:o].view(h, d, -1))
        scores = scores + torch.einsum("rhf,rkf->rhk", qf, f)
    attn, has_any = _masked_softmax(scores / (d**0.5), mask)
    out = torch.matmul(attn[:, :, None, :], v_node).squeeze(2)
    for f, w in slots:
        # The attention-weighted slot features, then the value block of W once per root.
        fa = torch.einsum("rhk,rkf->rhf", attn, f)
        out = out + torch.einsum("rhf,hdf->rhd", fa, w[o:].view(h, d, -1))
    out = out * has_any[:, None, None].to(out.dtype)
    return out.reshape(r, o)


def gru_cell(
    x: torch.Tensor,
    h: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
) -> torch.Tensor:
    """GRU cell, same equations and weight layout as ``torch.nn.GRUCell``.

    Args:
        x: (U, I) inputs.
        h: (U, Hd) previous hidden state.
        w_ih: (3 Hd, I) input weights (reset, update, new gates).
        w_hh: (3 Hd, Hd) hidden weights.
        b_ih: (3 Hd,) or None.
        b_hh: (3 Hd,) or None.

    Returns:
        (U, Hd) the new hidden state.
    """
    gi = F.linear(x, w_ih, b_ih)
    gh = F.linear(h, w_hh, b_hh)
    i_r, i_z, i_n = gi.chunk(3, dim=1)
    h_r, h_z, h_n = gh.chunk(3, dim=1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * n + z * h


def rnn_cell(
    x: torch.Tensor,
    h: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
) -> torch.Tensor:
    """Elman RNN cell with tanh, as ``torch.nn.RNNCell``.

    Args:
        x: (U, I) inputs.
        h: (U, Hd) previous hidden state.
        w_ih: (Hd, I), w_hh: (Hd, Hd), b_ih, b_hh: (Hd,) or None.

    Returns:
        (U, Hd) the new hidden state.
    """
    return torch.tanh(F.linear(x, w_ih, b_ih) + F.linear(h, w_hh, b_hh))


def recurrent_update(
    mail: torch.Tensor,
    mail_ts: torch.Tensor,
    last_update: torch.Tensor,
    has_mail: torch.Tensor,
    h: torch.Tensor,
    time_w: torch.Tensor,
    time_b: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    cell: str = "gru",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory updater of TGN/JODIE/DyRep/APAN: pending mail applied with a cell.

    The cell's input is ``[mail, cos(dt time_w + time_b)]`` with ``dt = mail_ts -
    last_update`` (in ``h``'s dtype, encoded in ``time_w``'s); rows without mail keep
    their state and last update time.

    Args:
        mail: (U, M) pending mail (or the message built from it).
        mail_ts: (U,) its time.
        last_update: (U,) the time of each row's state.
        has_mail: (U,) bool, whether the row has pending mail.
        h: (U, Hd) the stored state.
        time_w: (T,) time-encoding frequencies.
        time_b: (T,) time-encoding phases.
        w_ih: (G Hd, M + T) input weights (G = 3 for the GRU, 1 for the RNN).
        w_hh: (G Hd, Hd) hidden weights.
        b_ih: (G Hd,) or None.
        b_hh: (G Hd,) or None.
        cell: "gru" or "rnn".

    Returns:
        (U, Hd) the updated state, and (U,) its last update time.
    """
    dt = (mail_ts - last_update).to(h.dtype)
    te = torch.cos(dt.to(time_w.dtype)[..., None] * time_w + time_b)
    x = torch.cat([mail, te.to(mail.dtype)], dim=1)
    new = (gru_cell if cell == "gru" else rnn_cell)(x, h, w_ih, w_hh, b_ih, b_hh)
    return torch.where(has_mail[:, None], new, h), torch.where(has_mail, mail_ts, last_update)


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
    attention: Callable[..., torch.Tensor] | None = None,
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Temporal attention whose keys and values are built from per-node projections.

    The key/value row of neighbour slot (r, k) is
    ``kv_node[nbr_pos[r, k]] + cos(dt[r, k] * time_w + time_b) @ w_kv_time.T
    (+ kv_edge[r, k])``, keys in its first O columns and values in the last O; then
    :func:`temporal_attention`. This is TGN's W [h; e; te] split by blocks, so that the
    node block is projected once per unique node.

    Args:
        q: (R, H, D) queries.
        kv_node: (U, 2 O) per-node key/value projections (O = H * D), keys first.
        nbr_pos: (R, K) int row of each neighbour in ``kv_node`` (any valid row where
            masked).
        dt: (R, K) time since each neighbour event.
        mask: (R, K) bool, True where the slot is valid.
        time_w: (T,) time-encoding frequencies.
        time_b: (T,) time-encoding phases.
        w_kv_time: (2 O, T) projection of the time encoding (no bias).
        kv_edge: (R, K, 2 O) edge contributions, or None.
        attention: The attention over the built keys and values, with
            :func:`temporal_attention`'s arguments; that function by default (the
            dispatch passes its own choice, so that the projections stay on cuBLAS
            while the masked softmax runs as one Triton kernel).
        rows: How ``kv_node``'s rows are read at ``nbr_pos`` (``rows(kv_node,
            nbr_pos)``, (R, K, 2 O)): :func:`take_rows` by default; the model passes a
            gather whose backward reuses the batch's de-duplication
            (:mod:`sven.kernels.triton_gather`).

    Returns:
        (R, O) attention output; zero rows where no slot is valid.
    """
    r, h, d = q.shape
    k = nbr_pos.shape[1]
    # The encoding in the frequencies' dtype, the projection in the model dtype.
    # One kernel for dt w + b (the same values: with the default phases of zero exactly).
    te = torch.cos(torch.addcmul(time_b, dt.to(time_w.dtype)[..., None], time_w))
    te = te.to(kv_node.dtype)
    kv_rows = (rows or take_rows)(kv_node, nbr_pos)
    if backend_for(te, "param_grads") == "triton":
        # The weight gradient in one launch (sums.linear).
        kv = kv_rows + linear(te, w_kv_time, None)
    else:
        # The rows added in the product's epilogue: one kernel, not a GEMM and a sum.
        o2 = kv_rows.shape[-1]
        kv = torch.addmm(kv_rows.reshape(-1, o2), te.reshape(-1, te.shape[-1]), w_kv_time.t())
        kv = kv.view(kv_rows.shape)
    if kv_edge is not None:
        kv = kv + kv_edge
    key, val = kv.chunk(2, dim=2)
    attention = attention or temporal_attention
    return attention(q, key.reshape(r, k, h, d), val.reshape(r, k, h, d), mask)


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
    """TGN's link scorer over a batch's root embeddings: for a source s and a candidate
    c, ``w_out . relu(W_src s + b_src + W_dst c + b_dst) + b_out``.

    Args:
        h: (R, D) root embeddings in the batch layout ``[src (B), dst (B), neg[:, 0] (B),
            ..., neg[:, n-1] (B)]``, R = (2 + n) B.
        b: B, the events.
        w_src: (D2, D), b_src: (D2,): the source projection.
        w_dst: (D2, D), b_dst: (D2,): the candidate projection.
        w_out: (1, D2), b_out: (1,): the output layer.

    Returns:
        (B,) logits of the positive pairs and (B, n) of the negatives.
    """
    n = h.shape[0] // b - 2
    # One split, not three slices: its backward is one concatenation where each slice's
    # would zero a full-size gradient and add them up.
    h_src, h_dst, h_rest = torch.split(h, [b, b, h.shape[0] - 2 * b])
    h_neg = h_rest.view(n, b, -1).transpose(0, 1)

    def score(s: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        z = torch.relu(F.linear(s, w_src, b_src) + F.linear(c, w_dst, b_dst))
        return F.linear(z, w_out, b_out).squeeze(-1)

    return score(h_src, h_dst), score(h_src[:, None, :].expand(-1, n, -1), h_neg)


def relu_norm(
    x: torch.Tensor,
    node: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """The attention layer's output where its projection is split into a per-root and
    a per-node half: ``LayerNorm(ReLU(x + node[rows]))`` over the last dimension.

    Args:
        x: (R, O) per-root terms.
        node: (U, O) per-node terms.
        rows: (R,) int row of ``node`` of each root.
        weight: (O,) the norm's scale.
        bias: (O,) the norm's shift.
        eps: added to the variance.

    Returns:
        (R, O) in x's dtype.
    """
    y = torch.relu(x + node.index_select(0, rows))
    return F.layer_norm(y, (x.shape[1],), weight, bias, eps)
