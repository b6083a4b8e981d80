"""The linear layers' parameter gradients in one Triton launch (``param_grads``) against
torch, and every backward that uses them against its ``param_grads=reference`` self."""

from __future__ import annotations

import pytest
import torch

# (K, M, N): K off the 64-row block (and 0, 1), M and N off the tiles; N = 0 is a 1-D g.
SHAPES = [(130, 33, 17), (1, 1, 1), (0, 5, 3), (70, 100, 0), (65, 40, 130)]
U32 = 2.0**-24


def _problem(k: int, m: int, n: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(k, m + 3, generator=gen)[:, 3:]  # a row stride past the width
    g = torch.randn(k, generator=gen) if n == 0 else torch.randn(k, n, generator=gen)
    return x.to(dtype), g.to(dtype)


def _bound(x: torch.Tensor, g: torch.Tensor, k: int, rel: float) -> tuple:
    """Per-element error bounds of dW and db: ``rel`` plus float32 summation's
    ``K u`` times the sums of the terms' magnitudes (any order of additions)."""
    g2 = (g[:, None] if g.dim() == 1 else g).double().abs()
    mag_w = g2.t() @ x.double().abs()
    return (rel + 2 * k * U32) * mag_w + 1e-30, 2 * k * U32 * g2.sum(0) + 1e-30


def _check(problems, outs, rel: float = 0.0) -> None:
    for (x, g, weight, bias), (dw, db) in zip(problems, outs, strict=True):
        k = x.shape[0]
        bw, bb = _bound(x, g, k, rel)
        g2 = (g[:, None] if g.dim() == 1 else g).double()
        if weight:
            assert dw.shape == (g2.shape[1], x.shape[1])
            assert dw.dtype == torch.promote_types(x.dtype, g.dtype)
            err = (dw.double() - g2.t() @ x.double()).abs()
            assert bool((err <= bw).all()), float((err / bw).max())
        else:
            assert dw is None
        if bias:
            assert db.shape == (g2.shape[1],) and db.dtype == g.dtype
            err = (db.double() - g2.sum(0)).abs()
            assert bool((err <= bb).all()), float((err / bb).max())
        else:
            assert db is None


@pytest.mark.parametrize("shape", SHAPES)
def test_one_layer_against_float64(device: str, shape) -> None:
    from sven.kernels.triton_grads import param_grads

    x, g = _problem(*shape, seed=sum(shape))
    problems = [(x.to(device), g.to(device), True, True)]
    _check(problems, param_grads(problems), rel=0.0 if device == "cpu" else 1e-7)


def test_three_layers_one_launch_and_flags(device: str) -> None:
    """The decoder's three layers (one without its bias, one of a single output) and the
    updater's (one wanting its bias alone); repeated, bit for bit equal."""
    from sven.kernels.triton_grads import param_grads

    layers = [_problem(200, 100, 100, 1), _problem(400, 100, 100, 2), _problem(400, 100, 0, 3)]
    flags = [(True, True), (True, False), (True, True)]
    problems = [(x.to(device), g.to(device), *f) for (x, g), f in zip(layers, flags)]
    first = param_grads(problems)
    _check(problems, first)
    again = param_grads(problems)
    for a, b in zip(first, again):
        for s, t in zip(a, b):
            assert (s is None and t is None) or torch.equal(s, t)
    problems[0] = (*problems[0][:2], False, True)
    _check(problems[:1], param_grads(problems[:1]))


def test_mixed_dtypes_take_separate_launches(device: str) -> None:
    """A bf16 layer beside a float32 one (pointers of one type per launch): each right,
    in its dtype (bf16 inputs, float32 sums, bf16 result)."""
    from sven.kernels.triton_grads import param_grads

    x1, g1 = _problem(90, 20, 30, 4)
    x2, g2 = _problem(90, 20, 30, 5, torch.bfloat16)
    problems = [
        (x1.to(device), g1.to(device), True, True),
        (x2.to(device), g2.to(device), True, True),
    ]
    (dw1, db1), (dw2, db2) = param_grads(problems)
    _check(problems[:1], [(dw1, db1)])
    assert dw2.dtype == db2.dtype == torch.bfloat16
    want = g2.double().t() @ x2.double()
    # One bf16 rounding of the result (the interpreter truncates: 2^-7).
    torch.testing.assert_close(dw2.double().cpu(), want, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(db2.double().cpu(), g2.double().sum(0), rtol=2**-7, atol=1e-6)


def test_too_many_layers_is_an_error() -> None:
    from sven.kernels.sums import param_grads as dispatched

    pytest.importorskip("triton")
    from sven.kernels.triton_grads import param_grads

    x, g = _problem(3, 2, 2, 0)
    with pytest.raises(ValueError, match="1 to 3 layers"):
        param_grads([(x, g, True, True)] * 4)
    # The reference (CPU, auto) is today's GEMM and column sum.
    ((dw, db),) = dispatched((x, g, True, True))
    assert torch.equal(dw, g.t() @ x) and torch.equal(db, g.sum(0))


def _grads(fn, leaves, use_kernel, backend: str, **others: str) -> list[torch.Tensor]:
    use_kernel("param_grads", backend, **others)
    xs = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(11)
    loss = sum((o * torch.randn(o.shape, generator=gen).to(o.device)).sum()
               for o in outs if o.is_floating_point() and o.requires_grad)  # fmt: skip
    return list(torch.autograd.grad(loss, xs, allow_unused=True))


def _same_grads(fn, leaves, use_kernel, **others: str) -> None:
    want = _grads(fn, leaves, use_kernel, "reference", **others)
    got = _grads(fn, leaves, use_kernel, "triton", **others)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None, i
            continue
        tol = 2e-5 * max(1.0, float(b.abs().max()))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=tol, msg=f"gradient {i}")


def test_projection_backward(device: str, use_kernel) -> None:
    from sven.kernels.sums import linear

    gen = torch.Generator().manual_seed(5)
    leaves = [torch.randn(*s, generator=gen).to(device) for s in ((150, 37), (19, 37), (19,))]
    _same_grads(linear, leaves, use_kernel)


def test_projection_without_bias_of_slots(device: str, use_kernel) -> None:
    """The attention's edge projection: (R, K, d) slots, no bias."""
    from sven.kernels.sums import linear

    gen = torch.Generator().manual_seed(8)
    leaves = [torch.randn(*s, generator=gen).to(device) for s in ((9, 7, 5), (12, 5))]
    _same_grads(lambda x, w: linear(x, w, None), leaves, use_kernel)


def test_fused_attention_reference_backward(device: str, use_kernel) -> None:
    """The time encoding's projection inside the fused attention's reference."""
    from sven.kernels import reference

    gen = torch.Generator().manual_seed(9)
    r, k, h, d, t, u = 6, 5, 2, 4, 3, 8
    leaves = [torch.randn(*s, generator=gen).to(device)
              for s in ((r, h, d), (u, 2 * h * d), (t,), (t,), (2 * h * d, t))]  # fmt: skip
    nbr = torch.randint(0, u, (r, k), generator=gen).to(device)
    dt = (torch.rand(r, k, generator=gen) * 5).to(device)
    mask = (torch.rand(r, k, generator=gen) < 0.7).to(device)

    def fn(q, kv_node, time_w, time_b, w_kv_time):
        return reference.temporal_attention_fused(
            q, kv_node, nbr, dt, mask, time_w, time_b, w_kv_time
        )

    _same_grads(fn, leaves, use_kernel)


@pytest.mark.parametrize("cell", ["gru", "rnn"])
def test_cell_backward(device: str, use_kernel, cell: str) -> None:
    from sven.kernels import triton_rnn

    fn = triton_rnn.gru_cell if cell == "gru" else triton_rnn.rnn_cell
    g = 3 if cell == "gru" else 1
    gen = torch.Generator().manual_seed(6)
    shapes = ((70, 13), (70, 10), (g * 10, 13), (g * 10, 10), (g * 10,), (g * 10,))
    leaves = [torch.randn(*s, generator=gen).to(device) * 0.5 for s in shapes]
    _same_grads(fn, leaves, use_kernel)


@pytest.mark.parametrize("cell", ["gru", "rnn"])
def test_updater_backward(device: str, use_kernel, cell: str) -> None:
    from sven.kernels import triton_rnn
    from tests.kernels.test_updater import _inputs

    ts, last, mask, grads, _ = _inputs(67, 13, 4, 10, cell, "some", True)
    names = ["mail", "h", "w_ih", "w_hh", "b_ih", "b_hh"]
    leaves = [grads[k].to(device) for k in names]
    fixed = [ts.to(device), last.to(device), mask.to(device)]
    tw, tb = grads["time_w"].to(device), grads["time_b"].to(device)

    def fn(mail, h, w_ih, w_hh, b_ih, b_hh):
        return triton_rnn.recurrent_update(mail, *fixed, h, tw, tb, w_ih, w_hh, b_ih, b_hh, cell)

    _same_grads(fn, leaves, use_kernel)


@pytest.mark.parametrize(("b", "n", "d"), [(7, 3, 100), (37, 1, 17)])
def test_link_decoder_backward(device: str, use_kernel, b: int, n: int, d: int) -> None:
    from sven.kernels import triton_decoder
    from tests.kernels.test_decoder import _inputs

    leaves = [t.detach() for t in _inputs(b, n, d, device)]

    def fn(h, *params):
        return triton_decoder.link_decoder(h, b, *params)

    _same_grads(fn, leaves, use_kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize(("k", "m", "n"), [(6600, 372, 100), (11000, 472, 300), (600, 200, 100)])
def test_step_shapes_on_the_gpu(cuda: str, tf32: bool, k: int, m: int, n: int) -> None:
    """The step's shapes: IEEE products within float32's summation bound, TF32 within
    its 10-bit mantissas'; bit for bit equal twice, also inside a captured graph."""
    from sven.kernels.triton_grads import param_grads

    x, g = _problem(k, m, n, k)
    problems = [(x.to(cuda), g.to(cuda), True, True), (x.to(cuda), g[:, 0].to(cuda), True, True)]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        first = param_grads(problems)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = param_grads(problems)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    # TF32 keeps 10 of the mantissa bits (rounded or cut: 2^-10 per operand at most).
    _check(problems, first, rel=2**-9 if tf32 else 0.0)
    for a, b in zip(first, captured):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    if tf32:
        # The run's precision is honoured: IEEE products give other bits.
        ieee = param_grads(problems)
        assert not torch.equal(ieee[0][0], first[0][0])
        assert torch.equal(ieee[0][1], first[0][1])  # the bias sums have no products
