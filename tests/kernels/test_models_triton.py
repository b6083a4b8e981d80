"""All four models with the Triton kernels against the same models on the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sven import kernels
from sven.models import MODELS, MemoryState
from sven.pipeline.batch import FeatureTable
from tests.unit.test_models import N, _batch, _model


def _to(obj, device: str):
    """A batch (its nested dataclasses too: the neighbour block, the de-duplication's
    runs; and its feature table) on ``device``."""
    moved = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            moved[f.name] = v.to(device)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            # The sampled neighbours, the de-duplication's runs.
            moved[f.name] = _to(v, device)
        elif isinstance(v, FeatureTable):
            # The edge features, read in place by the attention.
            moved[f.name] = FeatureTable(v.rows.to(device))
    return dataclasses.replace(obj, **moved)


def _loss_and_grads(model, rows, batch, backend: str, monkeypatch):
    monkeypatch.setenv("SVEN_KERNELS", backend)
    kernels.reset_backend()
    try:
        model.zero_grad()
        out = model(batch, rows)
        loss = out.pos.sum() - out.neg.sum()
        loss.backward()
    finally:
        kernels.reset_backend()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_triton_matches_reference(name, device, monkeypatch) -> None:
    torch.manual_seed(0)
    model = _model(name, edge_dim=2, dtype=torch.float32).to(device)
    mem = MemoryState(N, 4, model.mail_dim, model.mailbox_size, device=device)
    ef = torch.randn(6, 2)
    neg = torch.tensor([[4, 3], [4, 2], [1, 4]])
    # A first batch leaves mail, so the second runs the memory cell on real inputs.
    first = _to(_batch(model, 0, 3, neg, ef), device)
    with torch.no_grad():
        mem.commit(model(first, mem.gather(first.nodes)).update)
    batch = _to(_batch(model, 3, 6, neg, ef), device)
    rows = mem.gather(batch.nodes)
    assert rows.mail_valid.any()
    ref = _loss_and_grads(model, rows, batch, "reference", monkeypatch)
    tri = _loss_and_grads(model, rows, batch, "triton", monkeypatch)
    torch.testing.assert_close(tri[0], ref[0], rtol=1e-5, atol=1e-5)
    assert len(tri[1]) == len(ref[1]) > 0
    for got, want in zip(tri[1], ref[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
