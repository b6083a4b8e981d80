"""Evaluation negatives of the historical and inductive protocols, and filtered MRR."""

from __future__ import annotations

import pytest
import torch

from sven.engine.metrics import mrr
from sven.pipeline.eval_negatives import EvalNegatives, filtered_mrr_negatives

# Events (index: src -> dst); the training split is events 0..3.
#   0: 0->1  1: 0->2  2: 1->2  3: 0->3 | 4: 0->4  5: 2->1  6: 0->1  7: 0->4  8: 0->2
SRC = torch.tensor([0, 0, 1, 0, 0, 2, 0, 0, 0])
DST = torch.tensor([1, 2, 2, 3, 4, 1, 1, 4, 2])
TRAIN_STOP = 4


def _sampler() -> EvalNegatives:
    return EvalNegatives(SRC, DST, 5, TRAIN_STOP, torch.unique(DST))


def _draws(protocol: str, event: int, start: int, stop: int, seeds: int = 60) -> set[int]:
    s = _sampler()
    idx = torch.tensor([event])
    return {int(s.draw(protocol, seed, 7, idx, start, stop)[0]) for seed in range(seeds)}


def test_historical_negatives_are_past_partners_not_in_the_batch() -> None:
    # Event 6 (0->1) in batch [6, 8): source 0 met 1, 2, 3, 4 before; (0,1) and (0,4)
    # are edges of the batch, so 2 and 3 are the eligible negatives.
    assert _draws("historical", 6, 6, 8) == {2, 3}
    # Event 8 (0->2) alone in its batch: 1, 3, 4 are eligible (2 is the batch's edge).
    assert _draws("historical", 8, 8, 9) == {1, 3, 4}


def test_inductive_negatives_are_partners_first_seen_after_training() -> None:
    # Event 8: among source 0's past partners only 4 was first met after training.
    assert _draws("inductive", 8, 8, 9) == {4}


def test_fallback_is_a_random_destination_that_is_not_a_batch_edge() -> None:
    # Event 6 in batch [6, 8): the only inductive pair (0,4) is an edge of the batch, so
    # the draw falls back to destinations other than 1 and 4.
    got = _draws("inductive", 6, 6, 8)
    assert got and got <= {2, 3}
    # Event 1: source 0 has no partner before batch [1, 2) at all.
    assert _draws("historical", 1, 1, 2) <= {1, 3, 4}


def test_draws_are_fixed_by_seed_and_stream() -> None:
    s = _sampler()
    idx = torch.arange(4, 9)
    a = s.draw("historical", 3, 11, idx, 4, 9)
    assert torch.equal(a, s.draw("historical", 3, 11, idx, 4, 9))
    others = [s.draw("historical", seed, 11, idx, 4, 9) for seed in range(4, 12)]
    assert any(not torch.equal(a, o) for o in others)


def test_unknown_protocol_is_rejected() -> None:
    with pytest.raises(ValueError, match="protocol"):
        _sampler().draw("random", 0, 0, torch.tensor([4]), 4, 5)


def test_filtered_mrr_drops_true_edges_of_the_same_instant() -> None:
    src = torch.tensor([0, 0, 1])
    dst = torch.tensor([1, 2, 2])
    t = torch.tensor([1.0, 1.0, 2.0])
    neg = torch.tensor([[2, 3, 1], [2, 0, 0]])
    valid = filtered_mrr_negatives(src, dst, t, torch.tensor([0, 2]), neg, 4)
    # (0,2,t=1) is an event, and 1 is the query's own destination; (1,2,t=2) likewise.
    assert valid.tolist() == [[False, True, False], [False, True, True]]
    # Chunks of one query give the same answer.
    one = filtered_mrr_negatives(src, dst, t, torch.tensor([0, 2]), neg, 4, chunk=1)
    assert torch.equal(one, valid)
    pos = torch.tensor([0.5, 0.1])
    scores = torch.tensor([[0.9, 0.7, 0.5], [0.2, 0.0, 0.0]])
    # Filtered: ranks 2 and 1. Unfiltered: 1 + 2 + 0.5 = 3.5 and 2.
    assert mrr(pos, scores, valid) == pytest.approx((1 / 2 + 1) / 2)
    assert mrr(pos, scores) == pytest.approx((1 / 3.5 + 1 / 2) / 2)
