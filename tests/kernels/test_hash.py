"""The one-kernel counter hashes (Triton) equal the PyTorch chains bit for bit.

Runs on CUDA where present, else under the Triton interpreter on CPU. The reference is
:mod:`sven.pipeline.negatives` with the hash backend forced to the reference.
"""

from __future__ import annotations

import pytest
import torch

from sven import kernels


def _forced(monkeypatch, mode: str):
    """Calls with ``SVEN_KERNELS=mode`` whatever the device."""

    def run(fn, *args):
        monkeypatch.setenv("SVEN_KERNELS", mode)
        kernels.reset_backend()
        try:
            return fn(*args)
        finally:
            monkeypatch.delenv("SVEN_KERNELS")
            kernels.reset_backend()

    return run


@pytest.fixture
def reference(monkeypatch):
    """Calls the PyTorch chains whatever the device (SVEN_KERNELS=reference)."""
    return _forced(monkeypatch, "reference")


@pytest.fixture
def triton_hashes(monkeypatch):
    """Calls with the hashes on Triton whatever the device (SVEN_KERNELS=triton)."""
    return _forced(monkeypatch, "triton")


def _index(n: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    # Event indices, node ids and large values near the int63 edge.
    small = torch.randint(0, 10**6, (n,), generator=gen)
    big = torch.randint(2**62, 2**63 - 1, (n,), generator=gen)
    return torch.where(torch.arange(n) % 3 == 0, big, small).to(device)


@pytest.mark.parametrize("n", [1, 7, 1000, 3001])
@pytest.mark.parametrize("num_draws", [1, 3])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_hash_columns_equals_the_reference(device, reference, n, num_draws, as_tensor) -> None:
    from sven.kernels import triton_hash
    from sven.pipeline import negatives

    index = _index(n, device)
    seed, epoch, first = 12345, 7, (1 << 25) + 600
    if as_tensor:
        # The captured step's device scalars.
        e = torch.tensor(epoch, device=device)
        f = torch.tensor(first, device=device)
    else:
        e, f = epoch, first
    want = reference(negatives.hash_columns, seed, e, index, f, num_draws)
    got = triton_hash.hash_columns(seed, e, index, f, num_draws)
    assert got.dtype == torch.int64 and got.shape == (num_draws, n)
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("seed", [0, 1, 2**40 + 3])
def test_hash_columns_seeds_and_draw_one(device, reference, seed) -> None:
    """Scalars equal to 0 or 1 (which Triton would otherwise specialise) and big seeds."""
    from sven.kernels import triton_hash
    from sven.pipeline import negatives

    index = _index(50, device)
    for epoch, first in [(0, 0), (1, 1), (2**21 + 1, 0)]:
        want = reference(negatives.hash_columns, seed, epoch, index, first, 2)
        assert torch.equal(triton_hash.hash_columns(seed, epoch, index, first, 2).cpu(), want.cpu())


@pytest.mark.parametrize("width", [1, 10, 100])
def test_draws_from_keys_equals_the_reference(device, reference, width) -> None:
    from sven.kernels import triton_hash
    from sven.pipeline import negatives

    keys = _index(333, device)
    want = reference(negatives.draws_from_keys, keys, width)
    got = triton_hash.draws_from_keys(keys, width)
    assert got.shape == (333, width)
    assert torch.equal(got.cpu(), want.cpu())


def test_empty_inputs(device) -> None:
    from sven.kernels import triton_hash

    empty = torch.zeros(0, dtype=torch.int64, device=device)
    assert triton_hash.hash_columns(0, 0, empty, 0, 3).shape == (3, 0)
    assert triton_hash.draws_from_keys(empty, 4).shape == (0, 4)


def test_a_scalar_on_another_device_is_refused(device) -> None:
    from sven.kernels import triton_hash

    index = torch.arange(4, device=device)
    with pytest.raises(ValueError, match="0-d tensor"):
        triton_hash.hash_columns(0, torch.tensor([1, 2], device=device), index, 0, 1)


def test_auto_hashes_with_triton_on_cuda_only(monkeypatch) -> None:
    monkeypatch.delenv("SVEN_KERNELS", raising=False)
    kernels.reset_backend()
    try:
        assert kernels.hash_backend(torch.zeros(1, dtype=torch.int64)) == "reference"
        if torch.cuda.is_available():
            pytest.importorskip("triton")
            assert kernels.hash_backend(torch.zeros(1, device="cuda")) == "triton"
    finally:
        kernels.reset_backend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.1, 0.5, 1 / 3])
def test_dropout_scale_equals_the_reference(device, reference, dtype, p) -> None:
    from sven.kernels import triton_hash
    from sven.pipeline import negatives

    keys = _index(257, device)
    want = reference(negatives.dropout_scale, keys, 100, p, dtype)
    got = triton_hash.dropout_scale(keys, 100, p, dtype)
    assert got.dtype == dtype and got.shape == (257, 100)
    assert torch.equal(got.cpu(), want.cpu())
    # It is dropout: about 1 - p of the entries kept, each scaled by 1 / (1 - p).
    kept = got != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.02
    assert torch.equal(got[kept].cpu(), torch.full((int(kept.sum()),), 1 / (1 - p), dtype=dtype))


def test_keyed_dropout_is_the_product_it_was() -> None:
    """``keyed_dropout`` through ``dropout_scale`` equals the product it replaced,
    forward and backward, bit for bit (float32, the reference path)."""
    from sven.models.base import keyed_dropout
    from sven.pipeline.negatives import uniform_from_keys

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 30, generator=g, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    keys = torch.randint(0, 2**62, (64,), generator=g)
    y = keyed_dropout(x, 0.1, keys, True)
    keep = uniform_from_keys(keys, 30) >= 0.1
    y2 = x2 * keep.to(x2.dtype) * (1.0 / (1.0 - 0.1))
    assert torch.equal(y, y2)
    w = torch.randn(64, 30, generator=g)
    (y * w).sum().backward()
    (y2 * w).sum().backward()
    assert torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("num_neg", [1, 4])
def test_negatives_gathered_in_the_kernel(device, reference, triton_hashes, as_tensor, num_neg):
    """sample_negatives: the draw, its remainder by an odd candidate count and the
    candidates' gather in one kernel give the reference's nodes."""
    from sven.pipeline import negatives

    index = _index(301, device)
    candidates = torch.tensor([5, 9, 2, 40, 7, 7, 13], device=device)
    epoch = torch.tensor(3, device=device) if as_tensor else 3
    args = (99, epoch, index, candidates, num_neg)
    want = reference(negatives.sample_negatives, *args)
    got = triton_hashes(negatives.sample_negatives, *args)
    assert got.shape == (301, num_neg) and torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("as_tensor", [False, True])
def test_node_keys_offset_in_the_kernel(device, reference, triton_hashes, as_tensor) -> None:
    """node_keys: the node draw's offset added to a device batch start inside the
    kernel gives the reference's keys."""
    from sven.pipeline import negatives

    nodes = _index(257, device)
    start = torch.tensor(1234, device=device) if as_tensor else 1234
    epoch = torch.tensor(2, device=device) if as_tensor else 2
    want = reference(negatives.node_keys, 7, epoch, start, nodes)
    got = triton_hashes(negatives.node_keys, 7, epoch, start, nodes)
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("epoch", [0, 1, 5, (1 << 64) - 3])
def test_an_int_epoch_runs_as_the_steps_device_scalar(
    device, reference, triton_hashes, epoch
) -> None:
    """The planner's and the evaluation tables' int epochs reach the Triton hash as a
    kept 0-d device tensor, the captured step's form (one compiled variant for both):
    the same values as the reference, for draws and negatives, and one tensor per value.
    An epoch past int63 wraps as the reference's int64 arithmetic does."""
    from sven.pipeline import negatives

    index = _index(301, device)
    cand = torch.arange(50, 90, device=device)
    for fn, args in (
        (negatives.hash_columns, (9, epoch, index, 4, 3)),
        (negatives.sample_negatives, (9, epoch, index, cand, 2)),
    ):
        assert torch.equal(triton_hashes(fn, *args), reference(fn, *args))
    kept = negatives._device_epoch(epoch, torch.device(device))
    assert kept.shape == () and kept.dtype == torch.int64 and kept.device.type == device
    assert kept is negatives._device_epoch(epoch, torch.device(device))
