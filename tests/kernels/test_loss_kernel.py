"""The training loss as one kernel each way (``sven.kernels.triton_loss``) against
``masked_bce``, the reference."""

from __future__ import annotations

import pytest
import torch

from sven.engine.body import masked_bce, mean_bce
from sven.models.base import ModelOutput


def _case(device: str, b: int, n: int, seed: int, spread: float):
    g = torch.Generator().manual_seed(seed)
    pos = (torch.randn(b, generator=g) * spread).to(device)
    neg = (torch.randn(b, n, generator=g) * spread).to(device)
    valid = (torch.rand(b, generator=g) < 0.8).to(device)
    return pos, neg, valid


@pytest.mark.parametrize(("b", "n"), [(1, 1), (7, 1), (200, 1), (301, 3), (600, 5)])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("spread", [1.0, 30.0])
@pytest.mark.parametrize("denom_dtype", [torch.float32, torch.float64])
def test_loss_and_grads_equal_masked_bce(device, use_kernel, b, n, masked, spread, denom_dtype):
    """Spread 30 puts scores past softplus's threshold (20) on both sides; the count
    in float64 (the step's device scalar) is converted inside the kernel."""
    pos, neg, valid = _case(device, b, n, seed=b + n, spread=spread)
    valid = valid if masked else None
    denom = torch.tensor(float(b * (1 + n)) * 1.5, device=device, dtype=denom_dtype)
    grads = {}
    for backend in ("reference", "triton"):
        use_kernel("bce_loss", backend)
        p, q = pos.clone().requires_grad_(True), neg.clone().requires_grad_(True)
        # The reference against the float32 count the kernel divides by.
        d = denom.to(torch.float32) if backend == "reference" else denom
        loss = mean_bce(ModelOutput(p, q, None), valid, d)
        loss.backward()
        grads[backend] = (loss.detach(), p.grad, q.grad)
    (l0, p0, q0), (l1, p1, q1) = grads["reference"], grads["triton"]
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(q1, q0, rtol=1e-6, atol=1e-9)
    if masked:
        assert (p1[~valid] == 0).all() and (q1[~valid] == 0).all()


def test_hand_built(device, use_kernel):
    """Two events, the second padded: softplus(-0) + softplus(0) = 2 ln 2 over 4."""
    use_kernel("bce_loss", "triton")
    pos = torch.tensor([0.0, 5.0], device=device, requires_grad=True)
    neg = torch.tensor([[0.0], [5.0]], device=device, requires_grad=True)
    loss = mean_bce(ModelOutput(pos, neg, None), torch.tensor([True, False], device=device), 4.0)
    loss.backward()
    loss = loss.detach()
    assert abs(loss.item() - 2 * 0.6931471805599453 / 4) < 1e-7
    assert pos.grad.tolist() == [-0.125, 0.0] and neg.grad.tolist() == [[0.125], [0.0]]
    want = masked_bce(ModelOutput(pos.detach(), neg.detach(), None), None)
    assert float(want) > float(loss)


@pytest.mark.parametrize(("b", "n"), [(7, 1), (200, 3), (301, 5)])
def test_scores_read_in_place_in_the_decoders_layout(device, use_kernel, b, n):
    """The link scorer's results are views of one vector: the negatives a transposed
    view (B, n) with strides (1, B). The loss reads them in place and writes their
    gradients with the same strides, so that the scorer's backward joins them without
    a copy; a view with gaps (every other column) is copied first, the same numbers.
    The loss within float32 rounding of the contiguous case, the gradients exactly."""
    use_kernel("bce_loss", "triton")
    pos, neg, valid = _case(device, b, n, seed=3, spread=3.0)
    flat = torch.cat([pos, neg.t().reshape(-1)]).requires_grad_(True)
    p, q = flat[:b], flat[b:].view(n, b).t()
    assert q.stride() == (1, b)
    got = mean_bce(ModelOutput(p, q, None), valid, 11.0)
    (dp, dq) = torch.autograd.grad(got, (p, q))
    assert dq.stride() == (1, b) and dp.stride() == (1,)
    p0, q0 = pos.clone().requires_grad_(True), neg.clone().requires_grad_(True)
    want = mean_bce(ModelOutput(p0, q0, None), valid, 11.0)
    want.backward()
    # The sum's order follows the layout Triton gives the load, which follows the
    # strides: on a GPU the two layouts may round the total differently (they did at
    # b=301 on the H200). The per-element gradients are exact.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert torch.equal(dp, p0.grad) and torch.equal(dq, q0.grad)
    wide = torch.cat([neg, neg], 1)[:, ::2]  # a gap between columns
    gapped = mean_bce(ModelOutput(pos, wide, None), valid, 11.0)
    assert torch.equal(gapped, want.detach())
