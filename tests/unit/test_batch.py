"""Batches (sven.pipeline.batch): a fixed-slot batch built for evaluation, whose ids may
be counted rather than sorted, is the training build's batch without its sort."""

from __future__ import annotations

import pytest
import torch

from sven.models import MODELS, MemoryState, build_model
from sven.pipeline.batch import make_batch
from sven.pipeline.sampler import TCSR, TemporalSampler

# 8 events on 6 nodes; node 5 never appears in an event. N = 6 is the padding id.
SRC = torch.tensor([0, 1, 0, 2, 1, 3, 4, 0])
DST = torch.tensor([1, 2, 2, 3, 0, 0, 1, 3])
T = torch.tensor([1.0, 2.0, 2.0, 3.0, 4.0, 5.0, 5.0, 6.0], dtype=torch.float64)
N = 6


def _fixed_batch(model, for_grad: bool):
    sampler = None
    if model.sample_roots != "none":
        sampler = TemporalSampler(TCSR.from_events(SRC, DST, T, N), [3], "recent")
    lo, hi = 4, 8
    neg = torch.tensor([[5, 2], [3, 5], [0, 1], [5, 5]])
    return make_batch(
        torch.arange(lo, hi), SRC[lo:hi], DST[lo:hi], T[lo:hi], neg,
        sampler=sampler, sample_roots=model.sample_roots,
        read_neighbors=model.read_neighbors, pad_node=N, rng=(0, 0, lo),
        for_grad=for_grad,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_evaluation_batch_is_the_training_batch_without_its_sort(name: str) -> None:
    kw = dict(memory_dim=4, time_dim=3, embed_dim=4)
    if name in ("tgn", "apan"):
        kw.update(num_heads=2, dropout=0.0)
    model = build_model(name, **kw).double().eval()
    train, ev = _fixed_batch(model, True), _fixed_batch(model, False)
    assert train.runs is not None and ev.runs is None
    # 4 events x 4 roots, each with 3 neighbour slots at most: 64 ids of 7 possible,
    # so the evaluation build counts them.
    assert torch.equal(ev.nodes, train.nodes) and torch.equal(ev.root_pos, train.root_pos)
    if train.nbr_pos is None:
        assert ev.nbr_pos is None
    else:
        assert torch.equal(ev.nbr_pos, train.nbr_pos)
    torch.manual_seed(0)
    state = MemoryState(N, 4, model.mail_dim, model.mailbox_size, dtype=torch.float64)
    state.memory.normal_()
    state.mail.normal_()
    state.mail_valid.fill_(True)
    state.mail_ts.fill_(0.5)
    with torch.no_grad():
        want = model(train, state.gather(train.nodes))
        got = model(ev, state.gather(ev.nodes))
    assert torch.equal(got.pos, want.pos) and torch.equal(got.neg, want.neg)
