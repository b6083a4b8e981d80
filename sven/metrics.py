"""Link-prediction metrics: AP, AUC-ROC and MRR, vectorized, with sklearn's tie rules.

AP equals ``sklearn.metrics.average_precision_score`` (step-wise precision-recall over
distinct thresholds) and AUC equals ``roc_auc_score`` (Mann-Whitney U with tied ranks
averaged); tests check both against sklearn. A NaN or infinite score makes every
metric NaN (reported as null): sorting would otherwise rank NaN scores somewhere and
a diverged model could read as a perfect one.
"""

from __future__ import annotations

import torch


def average_precision(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Average precision of binary ``labels`` (N,) ranked by ``scores`` (N,)."""
    s = scores.detach().to(torch.float64).flatten()
    y = labels.detach().to(torch.float64).flatten()
    n_pos = y.sum()
    if n_pos == 0 or not bool(torch.isfinite(s).all()):
        return float("nan")
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
    return float((d_recall * precision).sum())


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

    Args:
        pos_scores: (B,) score of each positive.
        neg_scores: (B, q) scores of its q negatives.
        valid: (B, q) bool, False for negatives that do not count (TGB's filtering of
            true edges, see ``sven.pipeline.eval_negatives.filtered_mrr_negatives``);
            None: all count.

    Returns:
        Mean over B of 1 / rank.
    """
    pos = pos_scores.detach().to(torch.float64)[:, None]
    neg = neg_scores.detach().to(torch.float64)
    keep = torch.ones_like(neg, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    if not (bool(torch.isfinite(pos).all()) and bool(torch.isfinite(neg[keep]).all())):
        return float("nan")
    rank = 1 + ((neg > pos) & keep).sum(1) + 0.5 * ((neg == pos) & keep).sum(1)
    return float((1.0 / rank).mean())


def link_metrics(pos: torch.Tensor, neg: torch.Tensor) -> tuple[float, float]:
    """AP and AUC of positives (B,) against negatives (B, n) or (B,)."""
    scores = torch.cat([pos.flatten(), neg.flatten()])
    labels = torch.cat([torch.ones(pos.numel()), torch.zeros(neg.numel())])
    return average_precision(scores, labels), roc_auc(scores, labels)
