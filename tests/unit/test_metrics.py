"""The ranking metrics (sven.engine.metrics) against sklearn and by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from sven.engine.metrics import average_precision, mrr, roc_auc


def test_metrics_match_sklearn_with_ties() -> None:
    rng = np.random.default_rng(0)
    for i in range(40):
        n = int(rng.integers(2, 300))
        s = rng.integers(0, 6, n).astype(float) if i % 2 else rng.random(n)
        y = rng.integers(0, 2, n)
        if y.min() == y.max():
            continue
        assert average_precision(torch.tensor(s), torch.tensor(y)) == pytest.approx(
            average_precision_score(y, s), abs=1e-12
        )
        auc = roc_auc(torch.tensor(s), torch.tensor(y))
        assert auc == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_mrr_exact() -> None:
    pos = torch.tensor([3.0, 1.0])
    neg = torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 5.0]])
    # ranks: 1, and 1 + 2 (above) + 0.5 (tie) = 3.5
    assert mrr(pos, neg) == pytest.approx((1 + 1 / 3.5) / 2)


def test_mrr_filters_negatives_and_a_non_finite_counted_score_is_nan() -> None:
    pos = torch.tensor([3.0, 1.0])
    neg = torch.tensor([[4.0, 3.0, float("nan")], [2.0, 1.0, 5.0]])
    valid = torch.tensor([[False, True, False], [True, False, True]])
    # Row 0 counts only the tie (rank 1.5; its NaN is filtered out); row 1 has two
    # above (rank 3).
    assert mrr(pos, neg, valid) == pytest.approx((1 / 1.5 + 1 / 3) / 2)
    assert np.isnan(mrr(pos, neg))
    assert np.isnan(mrr(torch.tensor([float("inf"), 1.0]), neg, valid))


def test_ap_without_positives_or_with_a_non_finite_score_is_nan() -> None:
    s = torch.tensor([0.3, 0.1, 0.2])
    assert np.isnan(average_precision(s, torch.zeros(3)))
    assert np.isnan(average_precision(s[:0], torch.zeros(0)))
    assert np.isnan(average_precision(torch.tensor([0.3, float("inf"), 0.2]), torch.ones(3)))
    # One positive ranked second of three: AP = precision at its threshold = 1/2.
    assert average_precision(s, torch.tensor([0.0, 0.0, 1.0])) == 0.5
