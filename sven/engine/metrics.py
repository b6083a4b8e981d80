"""Link-prediction metrics: AP, AUC-ROC and MRR, vectorized, with sklearn's tie rules.

AP equals ``sklearn.metrics.average_precision_score`` (step-wise precision-recall over
distinct thresholds) and AUC equals ``roc_auc_score`` (Mann-Whitney U with tied ranks
averaged); tests check both against sklearn. A NaN or infinite score makes every
metric NaN (reported as null): sorting would otherwise rank NaN scores somewhere and
a diverged model could read as a perfect one.
"""

from __future__ import annotations

import torch


def _to_host(*parts: torch.Tensor) -> list[torch.Tensor]:
    """The 1-D ``parts`` (one dtype) on the host, brought in one copy: each copy waits
    for the device, so a metric that needs several results waits once."""
    host = torch.cat(parts).cpu()
    return list(host.split([p.numel() for p in parts]))


def average_precision(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Average precision of binary ``labels`` (N,) ranked by ``scores`` (N,)."""
    s = scores.detach().to(torch.float64).flatten()
    y = labels.detach().to(torch.float64).flatten()
    n_pos = y.sum()
    # Checked on the host, where the terms go anyway.
    finite = torch.isfinite(s).all().to(torch.float64)
    order = torch.argsort(s, descending=True, stable=True)
    s, y = s[order], y[order]
    tp = torch.cumsum(y, 0)
    fp = torch.cumsum(1 - y, 0)
    # Only the last index of each run of equal scores is a threshold.
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]
    tp, fp = tp[last], fp[last]
    precision = tp / (tp + fp)
    recall = tp / n_pos
    d_recall = torch.diff(recall, prepend=recall.new_zeros(1))
    terms, n_pos, finite = _to_host(d_recall * precision, n_pos[None], finite[None])
    if n_pos.item() == 0 or not finite.item():
        return float("nan")
    # Summed on the host whatever the device: the sum's order decides its last bits,
    # and so scores on a GPU get the AP that the same scores get on the CPU.
    return float(terms.sum())


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of binary ``labels`` (N,) ranked by ``scores`` (N,)."""
    s = scores.detach().to(torch.float64).flatten()
    y = labels.detach().to(torch.bool).flatten()
    n_pos = int(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0 or not bool(torch.isfinite(s).all()):
        return float("nan")
    order = torch.argsort(s, stable=True)
    s_sorted = s[order]
    # Average rank of each run of ties: (first + last) / 2, 1-based.
    new_run = torch.ones_like(s_sorted, dtype=torch.bool)
    new_run[1:] = s_sorted[1:] != s_sorted[:-1]
    run_id = torch.cumsum(new_run.to(torch.int64), 0) - 1
    pos = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    first = torch.zeros(int(run_id[-1]) + 1, dtype=torch.float64).scatter_reduce(
        0, run_id, pos, reduce="amin", include_self=False
    )
    lastr = torch.zeros_like(first).scatter_reduce(
        0, run_id, pos, reduce="amax", include_self=False
    )
    ranks = torch.empty_like(s)
    ranks[order] = ((first + lastr) / 2)[run_id]
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def mrr(
    pos_scores: torch.Tensor, neg_scores: torch.Tensor, valid: torch.Tensor | None = None
) -> float:
    """Mean reciprocal rank of each positive among its negatives (TGB convention).

    The rank is 1 + #negatives strictly above + half the ties (TGB's mean of the
    optimistic and pessimistic ranks).

    The B x q comparisons run where the scores are (the run's device), in their own
    dtype (every comparison of two floats is exact); only the B ranks come to the host,
    where their mean is taken as it always was, so the result does not depend on the
    device.

    Args:
        pos_scores: (B,) score of each positive.
        neg_scores: (B, q) scores of its q negatives.
        valid: (B, q) bool, False for negatives that do not count (TGB's filtering of
            true edges, see ``sven.pipeline.eval_negatives.filtered_mrr_negatives``);
            None: all count.

    Returns:
        Mean over B of 1 / rank.
    """
    neg = neg_scores.detach()
    dtype = torch.promote_types(pos_scores.dtype, neg.dtype)
    neg = neg.to(dtype)
    pos = pos_scores.detach().to(device=neg.device, dtype=dtype)[:, None]
    keep = (
        torch.ones_like(neg, dtype=torch.bool)
        if valid is None
        else valid.to(device=neg.device, dtype=torch.bool)
    )
    finite = torch.isfinite(pos).all() & (torch.isfinite(neg) | ~keep).all()
    above = ((neg > pos) & keep).sum(1)
    ties = ((neg == pos) & keep).sum(1)
    above, ties, finite = _to_host(above, ties, finite.to(above.dtype)[None])
    if not finite.item():
        return float("nan")
    rank = 1 + above + 0.5 * ties
    return float((1.0 / rank).mean())


def link_metrics(pos: torch.Tensor, neg: torch.Tensor) -> tuple[float, float]:
    """AP and AUC of positives (B,) against negatives (B, n) or (B,)."""
    scores = torch.cat([pos.flatten(), neg.flatten()])
    labels = torch.cat([torch.ones(pos.numel()), torch.zeros(neg.numel())])
    return average_precision(scores, labels), roc_auc(scores, labels)


def batched_link_metrics(
    pos: torch.Tensor, neg: torch.Tensor, batch_size: int
) -> tuple[float, float]:
    """Mean over batches of :func:`link_metrics`, the batches computed together.

    Equal to the mean (``numpy.mean``) of ``link_metrics(pos[i:i+b], neg[i:i+b])`` over
    ``i = 0, b, 2b, ...`` to the last bit, in a fixed number of tensor operations
    instead of ~50 per batch: the full batches are the rows of one matrix, sorted row
    by row on the scores' device. Every step but one is exact integer or element-wise
    arithmetic, which the device does as the CPU does; AP's sum over a batch's
    thresholds is not associative, so those sums run on the host, one ``torch.sum``
    per batch over the same values in the same order as :func:`average_precision`.

    Args:
        pos: (n,) positive scores.
        neg: (n,) or (n, m) negative scores of each positive.
        batch_size: b, the events per batch (the last batch may be shorter).

    Returns:
        (mean AP, mean AUC); NaN for n = 0.
    """
    n = pos.numel()
    if n == 0:
        return float("nan"), float("nan")
    neg = neg.reshape(n, -1)
    b = int(batch_size)
    full = n // b
    terms: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    aucs: list[torch.Tensor] = []
    parts = []
    if full:
        parts.append((pos[: full * b].reshape(full, b), neg[: full * b].reshape(full, -1)))
    if full * b < n:
        parts.append((pos[full * b :].reshape(1, -1), neg[full * b :].reshape(1, -1)))
    for p, q in parts:
        # One row sort serves both metrics (the sort is most of their device time).
        s, y = _rows_sorted(p, q)
        t, c = _rows_ap_terms(s, y)
        terms.append(t)
        # Whole numbers, exact in float64: one dtype for the one copy.
        counts.append(c.to(torch.float64))
        aucs.append(_rows_auc(s, y, p.shape[1]))
    host = _to_host(*terms, *counts, *aucs)
    k = len(terms)
    sizes = torch.cat(host[k : 2 * k]).to(torch.int64).tolist()
    ap = [float(t.sum()) for t in torch.cat(host[:k]).split(sizes)]
    import numpy as np

    auc = torch.cat(host[2 * k :]).tolist()
    return float(np.mean(ap)), float(np.mean(auc))


def _rows_sorted(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's scores [positives, negatives] (R, L) in float64 and their labels,
    sorted by descending score, ties in input order (:func:`average_precision`'s)."""
    # The concatenation in the scores' dtype, then float64, as link_metrics does.
    s = torch.cat([p, q], 1).to(torch.float64)
    y = torch.cat([torch.ones_like(p), torch.zeros_like(q)], 1).to(torch.float64)
    s, order = torch.sort(s, dim=1, descending=True, stable=True)
    return s, torch.gather(y, 1, order)


def _rows_ap_terms(s: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The terms ``d_recall * precision`` of each row's thresholds, rows concatenated
    (T,), and the count of each row's thresholds (R,), from the rows sorted by
    :func:`_rows_sorted` (scores ``s`` and labels ``y``, both (R, L))."""
    rows, width = s.shape
    tp = torch.cumsum(y, 1)
    fp = torch.arange(1, width + 1, dtype=torch.float64, device=s.device) - tp
    last = torch.ones_like(s, dtype=torch.bool)
    last[:, :-1] = s[:, 1:] != s[:, :-1]
    n_pos = tp[:, -1:]
    precision = tp / (tp + fp)
    recall = tp / n_pos
    # d_recall between consecutive thresholds of a row, the first against 0.
    idx = torch.arange(width, device=s.device).expand(rows, -1)
    prev = torch.where(last, idx, -1)
    prev = torch.cummax(torch.cat([prev.new_full((rows, 1), -1), prev[:, :-1]], 1), 1).values
    prev_recall = torch.where(
        prev >= 0, torch.gather(recall, 1, prev.clamp_min(0)), torch.zeros_like(recall)
    )
    terms = (recall - prev_recall) * precision
    return terms[last], last.sum(1)


def _rows_auc(s: torch.Tensor, y: torch.Tensor, n_pos: int) -> torch.Tensor:
    """(R,) AUC of each row (:func:`roc_auc`: tied scores get their mean rank), from
    the rows sorted by :func:`_rows_sorted` (both (R, L)), each with ``n_pos``
    positives."""
    rows, width = s.shape
    # Run boundaries of equal scores in descending order: rank (ascending, 1-based) of
    # descending position j is width - j, so a run [a, e] has mean rank width - (a+e)/2.
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    end = torch.ones_like(s, dtype=torch.bool)
    end[:, :-1] = new[:, 1:]
    idx = torch.arange(width, device=s.device).expand(rows, -1)
    start = torch.cummax(torch.where(new, idx, 0), 1).values
    stop = torch.where(end, idx, width).flip(1).cummin(1).values.flip(1)
    ranks = width - (start + stop).to(torch.float64) / 2
    n_neg = width - n_pos
    u = (ranks * y).sum(1) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)
