"""``relu_norm``, LayerNorm(ReLU(x + node[rows])): the reference by hand on a tiny case,
the Triton kernel (``sven.kernels.triton_norm``) against the reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from sven.kernels import reference


def _inputs(r: int, u: int, o: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(r, o, generator=g).to(dtype),
        torch.randn(u, o, generator=g).to(dtype),
        torch.randint(0, u, (r,), generator=g),
        (1 + torch.randn(o, generator=g) / 4).to(dtype),
        (torch.randn(o, generator=g) / 4).to(dtype),
    ]


def test_reference_by_hand() -> None:
    # Root 0 reads node 1: relu([1, -3] + [1, 1]) = [2, 0], mean 1, variance 1, so the
    # norm is [1, -1] (eps 0), scaled by [2, 3] and shifted by [0.5, 0]. Root 1 reads
    # node 0: relu([0, 0] + [4, 2]) = [4, 2], likewise [1, -1] normalised.
    x = torch.tensor([[1.0, -3.0], [0.0, 0.0]])
    node = torch.tensor([[4.0, 2.0], [1.0, 1.0]])
    out = reference.relu_norm(
        x, node, torch.tensor([1, 0]), torch.tensor([2.0, 3.0]), torch.tensor([0.5, 0.0]), 0.0
    )
    assert torch.equal(out, torch.tensor([[2.5, -3.0], [2.5, -3.0]]))


@pytest.mark.parametrize(
    "r,u,o,dtype",
    list(itertools.product((1, 17, 40), (1, 5), (3, 100), (torch.float32, torch.bfloat16))),
)
def test_triton_equals_reference(device: str, r: int, u: int, o: int, dtype) -> None:
    from sven.kernels import triton_norm

    x, node, rows, w, b = (t.to(device) for t in _inputs(r, u, o, dtype))
    want = reference.relu_norm(x.float(), node.float(), rows, w.float(), b.float())
    got = triton_norm.relu_norm(x, node, rows, w, b)
    assert got.dtype == dtype and got.shape == (r, o)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_triton_reads_strided_rows(device: str) -> None:
    # A column slice of a wider product, and node rows repeated (each root's own row):
    # the kernel reads them in place through their strides.
    from sven.kernels import triton_norm

    x, node, rows, w, b = (t.to(device) for t in _inputs(9, 4, 6, torch.float32, seed=1))
    wide = torch.randn(9, 14, device=device)
    wide[:, 3:9] = x
    got = triton_norm.relu_norm(wide[:, 3:9], node.t().contiguous().t(), rows, w, b)
    torch.testing.assert_close(got, reference.relu_norm(x, node, rows, w, b))


def test_gradient_takes_the_reference(device: str) -> None:
    from sven.kernels import triton_norm

    x, node, rows, w, b = (t.to(device) for t in _inputs(5, 3, 4, torch.float32))
    x.requires_grad_(True)
    out = triton_norm.relu_norm(x, node, rows, w, b)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_no_rows(device: str) -> None:
    from sven.kernels import triton_norm

    x, node, rows, w, b = (t.to(device) for t in _inputs(0, 3, 4, torch.float32))
    assert triton_norm.relu_norm(x, node, rows, w, b).shape == (0, 4)
