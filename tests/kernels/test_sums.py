"""Column sums on cuBLAS (``sven.kernels.sums.column_sum``) against ``x.sum(0)``."""

from __future__ import annotations

import pytest
import torch

from sven.kernels.sums import column_sum


def test_column_sum_off_cuda_is_the_sum() -> None:
    x = torch.randn(37, 5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(column_sum(x), x.sum(0))
    assert torch.equal(column_sum(x.t()), x.t().sum(0))


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n"), [(1, 1), (2, 40_000), (400, 100), (6600, 300)])
def test_column_sum_on_cuda(cuda: str, m: int, n: int) -> None:
    """IEEE float32 sums (the ones vector keeps TF32 out) within float32's rounding, also
    of a transposed view, also with TF32 on."""
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m)).to(cuda)
    want = x.double().sum(0).float()
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        got = column_sum(x)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * m**0.5)
    torch.testing.assert_close(column_sum(x.t().contiguous().t()), want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_column_sum_in_a_captured_graph(cuda: str) -> None:
    """A length first seen while capturing takes ``x.sum(0)``; one seen before is the
    cuBLAS product in the graph; both replay to the right sums."""
    x = torch.zeros(123, 7, device=cuda)
    y = torch.zeros(77, 7, device=cuda)
    column_sum(y)  # y's length seen eagerly: its ones exist before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sx, sy = column_sum(x), column_sum(y)
    x.copy_(torch.arange(123 * 7, dtype=torch.float32, device=cuda).view(123, 7))
    y.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(sx, x.sum(0))
    assert torch.equal(sy, torch.full((7,), 154.0, device=cuda))


@pytest.mark.parametrize("grad", [True, False])
def test_linear_is_f_linear(device: str, grad: bool) -> None:
    """``linear`` gives ``F.linear``'s output and gradients (bit for bit off CUDA, within
    float32's rounding on CUDA), with and without autograd."""
    from sven.kernels.sums import linear

    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(*s, generator=gen).to(device) for s in ((50, 7), (4, 7), (4,))]
    xs = [x.requires_grad_(grad) for x in xs]
    g = torch.randn(50, 4, generator=gen).to(device)
    got = linear(*xs)
    want = torch.nn.functional.linear(*xs)

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        if device == "cpu":
            return torch.equal(a, b)
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    assert close(got, want)
    if grad:
        for a, b in zip(torch.autograd.grad(got, xs, g), torch.autograd.grad(want, xs, g)):
            assert close(a, b), (a - b).abs().max()
