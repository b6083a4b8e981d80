"""Triton temporal attention (plain and fused) against the reference, forward and backward."""

from __future__ import annotations

import itertools

import pytest
import torch

from sven.kernels import reference
from tests.kernels.grid import make_mask, tolerances

R_GRID = (1, 7, 33)
H_GRID = (1, 2)
D_GRID = (8, 50, 64)
K_GRID = (1, 5, 10, 16)
DTYPES = (torch.float32, torch.bfloat16)
FULL = list(itertools.product(R_GRID, H_GRID, D_GRID, K_GRID, DTYPES))
# Under the interpreter every program runs in Python: a few shapes that still cover odd
# sizes, K below and above the padded tile, masked rows and both dtypes.
SMALL = [
    (7, 2, 50, 5, torch.float32),
    (1, 1, 8, 1, torch.float32),
    (33, 1, 8, 16, torch.float32),
    (7, 2, 8, 10, torch.bfloat16),
]


def _attention_inputs(r, h, d, k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(r, h, d, generator=gen)
    # Keys and values as strided views of one (R, K, 2 H D) tensor, as the models pass them.
    kv = torch.randn(r, k, 2 * h * d, generator=gen)
    mask = make_mask(r, k, gen)
    dout = torch.randn(r, h * d, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, kv, dout)] + [mask.to(device)]


def check_attention(r, h, d, k, dtype, device):
    from sven.kernels import triton_attention

    q, kv, dout, mask = _attention_inputs(r, h, d, k, dtype, device)
    results = []
    for fn, cast in [
        (triton_attention.temporal_attention, dtype),
        (reference.temporal_attention, torch.float64),
    ]:
        qq = q.detach().to(cast).requires_grad_()
        kvv = kv.detach().to(cast).requires_grad_()
        key, val = kvv.chunk(2, dim=2)
        out = fn(qq, key.reshape(r, k, h, d), val.reshape(r, k, h, d), mask)
        out.backward(dout.to(cast))
        results.append((out, qq.grad, kvv.grad))
    tol = tolerances(dtype)
    for got, want in zip(results[0], results[1]):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **tol)
    out, dq, dkv = results[0]
    dead = ~mask.any(dim=1)
    assert not out.isnan().any()
    assert (out[dead] == 0).all() and (dq[dead] == 0).all()
    # Masked slots get no gradient.
    assert (dkv[~mask] == 0).all()


@pytest.mark.parametrize("r,h,d,k,dtype", SMALL)
def test_attention_small(r, h, d, k, dtype, device) -> None:
    check_attention(r, h, d, k, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("r,h,d,k,dtype", FULL)
def test_attention_grid(r, h, d, k, dtype, cuda) -> None:
    check_attention(r, h, d, k, dtype, cuda)


T_DIM = 20  # time-encoding width: not a power of two, and more than one BLOCK_T chunk


def check_fused(r, h, d, k, dtype, device, edge=True, train_time=False):
    from sven.kernels import triton_attention

    gen = torch.Generator().manual_seed(1)
    o, u = h * d, max(3, r // 2)
    q = torch.randn(r, h, d, generator=gen)
    kv_node = torch.randn(u, 2 * o, generator=gen)
    # Repeated rows: several slots read the same node, so its gradient is a sum.
    nbr_pos = torch.randint(0, u, (r, k), generator=gen)
    # Small dt keeps cos(dt * w + b) well conditioned, so fp32 rounding of the argument
    # (mul+add vs fma) stays below the tolerance.
    dt = torch.rand(r, k, generator=gen) * 10
    mask = make_mask(r, k, gen)
    time_w = 1.0 / 10 ** torch.linspace(0, 9, T_DIM)
    time_b = torch.rand(T_DIM, generator=gen)
    w_kv_time = torch.randn(2 * o, T_DIM, generator=gen) / T_DIM**0.5
    kv_edge = torch.randn(r, k, 2 * o, generator=gen) if edge else None
    dout = torch.randn(r, o, generator=gen)
    results = []
    for fn, cast in [
        (triton_attention.temporal_attention_fused, dtype),
        (reference.temporal_attention_fused, torch.float64),
    ]:
        tcast = torch.float64 if cast == torch.float64 else torch.float32
        leaves = [
            q.to(device, cast).clone().requires_grad_(),
            kv_node.to(device, cast).clone().requires_grad_(),
            time_w.to(device, tcast).clone().requires_grad_(train_time),
            time_b.to(device, tcast).clone().requires_grad_(train_time),
            w_kv_time.to(device, cast).clone().requires_grad_(),
            kv_edge.to(device, cast).clone().requires_grad_() if edge else None,
        ]
        qq, kvn, tw, tb, wt, ke = leaves
        out = fn(qq, kvn, nbr_pos.to(device), dt.to(device), mask.to(device), tw, tb, wt, ke)
        out.backward(dout.to(device, cast))
        results.append([out] + [x.grad for x in leaves if x is not None and x.requires_grad])
    tol = tolerances(dtype)
    for got, want in zip(results[0], results[1]):
        t = dict(tol)
        if dtype == torch.bfloat16:
            # Gradients that sum every slot (time_w, time_b, w_kv_time) add R * K terms
            # rounded to bf16; where they cancel, an element's relative error is large,
            # so compare against the largest element instead.
            t["atol"] = max(t["atol"], t["rtol"] * float(want.detach().abs().max()))
        torch.testing.assert_close(got.double(), want, **t)
    out = results[0][0]
    dead = ~mask.to(device).any(dim=1)
    assert not out.isnan().any() and (out[dead] == 0).all()


FUSED_SMALL = [
    (7, 2, 50, 5, torch.float32),
    (1, 1, 8, 1, torch.float32),
    (33, 1, 8, 16, torch.bfloat16),
]


@pytest.mark.parametrize("r,h,d,k,dtype", FUSED_SMALL)
def test_fused_small(r, h, d, k, dtype, device) -> None:
    check_fused(r, h, d, k, dtype, device)


def test_fused_no_edge_trainable_time(device) -> None:
    check_fused(7, 2, 8, 10, torch.float32, device, edge=False, train_time=True)


@pytest.mark.gpu
@pytest.mark.parametrize("r,h,d,k,dtype", FULL)
def test_fused_grid(r, h, d, k, dtype, cuda) -> None:
    check_fused(r, h, d, k, dtype, cuda, edge=(r + k) % 2 == 0, train_time=r == 7)


def test_no_roots(device) -> None:
    """R = 0 (an empty padded block): empty outputs and gradients, no launch."""
    from sven.kernels import triton_attention

    q = torch.zeros(0, 2, 8, device=device, requires_grad=True)
    kv = torch.zeros(0, 3, 2, 8, device=device, requires_grad=True)
    mask = torch.zeros(0, 3, dtype=torch.bool, device=device)
    out = triton_attention.temporal_attention(q, kv, kv, mask)
    out.sum().backward()
    assert out.shape == (0, 16) and q.grad.shape == q.shape
    kv_node = torch.randn(4, 32, device=device, requires_grad=True)
    w = torch.randn(32, 5, device=device, requires_grad=True)
    out = triton_attention.temporal_attention_fused(
        q, kv_node, torch.zeros(0, 3, dtype=torch.long, device=device),
        torch.zeros(0, 3, device=device), mask, torch.ones(5, device=device),
        torch.zeros(5, device=device), w,
    )  # fmt: skip
    out.sum().backward()
    assert out.shape == (0, 16)
    assert torch.equal(kv_node.grad, torch.zeros_like(kv_node))
    assert torch.equal(w.grad, torch.zeros_like(w))
