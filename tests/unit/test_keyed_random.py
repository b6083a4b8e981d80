"""Keyed randomness: dropout masks and root/node keys that depend on what a row is,
never on which rank computes it or on a generator's state."""

from __future__ import annotations

import pytest
import torch

from sven.models.base import keyed_dropout
from sven.pipeline.negatives import node_keys, root_keys, uniform_from_keys


def test_root_keys_follow_the_event_not_the_batch() -> None:
    index = torch.tensor([10, 11, 12])
    full = root_keys(0, 1, index, slots=3).view(3, 3)  # (slot, event)
    alone = root_keys(0, 1, index[1:2], slots=3).view(3, 1)
    assert torch.equal(full[:, 1:2], alone)
    # Every (event, slot) has its own key; another epoch or seed changes them all.
    assert full.unique().numel() == 9
    assert not torch.isin(root_keys(0, 2, index, 3), full.flatten()).any()
    assert not torch.isin(root_keys(1, 1, index, 3), full.flatten()).any()
    assert (full >= 0).all()


def test_node_keys_change_from_batch_to_batch() -> None:
    nodes = torch.tensor([3, 7, 9])
    a = node_keys(0, 0, 600, nodes)
    assert torch.equal(a[1:], node_keys(0, 0, 600, nodes[1:]))
    assert not torch.isin(node_keys(0, 0, 1200, nodes), a).any()


def test_uniform_from_keys_is_in_unit_interval_and_flat() -> None:
    u = uniform_from_keys(torch.arange(2000), 50)
    assert u.shape == (2000, 50) and u.dtype == torch.float64
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    # 10^5 draws: the mean is 0.5 within 5 standard deviations (0.0009 each).
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u.float(), bins=10, min=0.0, max=1.0)
    assert float((hist - 10_000).abs().max()) < 500


def test_keyed_dropout_masks_depend_on_the_row_key_alone() -> None:
    x = torch.ones(4, 200, dtype=torch.float64)
    keys = torch.tensor([5, 6, 7, 8])
    y = keyed_dropout(x, 0.25, keys, training=True)
    # Kept entries are scaled by exactly 1 / (1 - p); dropped ones are zero.
    assert set(y.unique().tolist()) <= {0.0, 1.0 / 0.75}
    # Row 2 alone, or the rows in another order, get the same masks.
    assert torch.equal(keyed_dropout(x[2:3], 0.25, keys[2:3], training=True), y[2:3])
    perm = torch.tensor([3, 1, 0, 2])
    assert torch.equal(keyed_dropout(x[perm], 0.25, keys[perm], training=True), y[perm])
    assert not torch.equal(y[0], y[1])
    # About p of the entries are dropped.
    assert (y == 0).double().mean().item() == pytest.approx(0.25, abs=0.05)


def test_keyed_dropout_is_identity_in_eval_or_without_p() -> None:
    x = torch.randn(3, 5)
    keys = torch.arange(3)
    assert keyed_dropout(x, 0.5, keys, training=False) is x
    assert keyed_dropout(x, 0.0, keys, training=True) is x


def test_keyed_dropout_passes_gradients_through_kept_entries() -> None:
    x = torch.ones(2, 64, requires_grad=True)
    y = keyed_dropout(x, 0.5, torch.tensor([1, 2]), training=True)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() * 2.0)


def test_compiled_keyed_dropout_keeps_the_hash_as_an_opaque_op() -> None:
    """Inside ``torch.compile`` keyed dropout's hash is the custom op
    ``sven::dropout_scale``: the traced graph (one graph, no breaks) calls the op
    instead of the hash's int64 chain, whose 64-bit constants Inductor emitted as int32
    on CUDA; compiled by Inductor, the function equals the eager one bit for bit."""
    from sven.pipeline.negatives import register_compiled_ops

    register_compiled_ops()
    x = torch.randn(37, 5, dtype=torch.float64)
    keys = torch.arange(37, dtype=torch.int64) * 7919
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    def drop(a: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(a, 0.25, k, True)

    want = drop(x, keys)
    torch.compile(drop, backend=backend, fullgraph=True)(x, keys)
    called = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("sven.dropout_scale" in t for t in called), called
    assert not any("bitwise" in t or "rshift" in t for t in called), called
    got = torch.compile(drop, dynamic=False)(x, keys)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
