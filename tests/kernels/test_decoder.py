"""The fused link scorer (Triton) against the reference, forward and backward."""

from __future__ import annotations

import itertools

import pytest
import torch

from sven.kernels import reference

# (B, n, D): one event, odd sizes, the MRR width; D below, at and off the block sizes.
GRID = list(itertools.product((1, 7, 37), (1, 3, 101), (17, 100)))
# Under Triton's interpreter (CPU) a few of them: the whole grid runs on the GPU.
SMALL = [(1, 1, 17), (7, 3, 100), (37, 101, 17)]
NAMES = ["h", "w_src", "b_src", "w_dst", "b_dst", "w_out", "b_out"]


def _inputs(b: int, n: int, d: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(b * 1000 + n * 10 + d)
    xs = [
        torch.randn((2 + n) * b, d, generator=gen),
        torch.randn(d, d, generator=gen) / d**0.5,
        torch.randn(d, generator=gen),
        torch.randn(d, d, generator=gen) / d**0.5,
        torch.randn(d, generator=gen),
        torch.randn(1, d, generator=gen) / d**0.5,
        torch.randn(1, generator=gen),
    ]
    return [x.to(device).requires_grad_() for x in xs]


def _run(fn, xs: list[torch.Tensor], b: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    pos, neg = fn(xs[0], b, *xs[1:])
    gen = torch.Generator().manual_seed(7)
    gp = torch.randn(pos.shape, generator=gen).to(pos.device)
    gn = torch.randn(neg.shape, generator=gen).to(neg.device)
    grads = torch.autograd.grad((pos * gp).sum() + (neg * gn).sum(), xs)
    return pos, neg, grads


def _check(device: str, b: int, n: int, d: int, *, tf32: bool = False) -> None:
    from sven.kernels import triton_decoder

    xs = _inputs(b, n, d, device)
    # The reference in IEEE float32, the kernel with its products in the precision
    # asked for (TF32's 10-bit mantissas: a relative error near 1e-3 per product).
    ref = _run(reference.link_decoder, xs, b)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        got = _run(triton_decoder.link_decoder, xs, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert got[0].shape == (b,) and got[1].shape == (b, n)
    if tf32:
        # Element-wise bounds do not fit TF32's error on sums of cancelling terms: the
        # error of each whole tensor relative to its size, as TF32 is usually judged.
        # The gradients' bound is wider: a pre-activation within TF32's error of zero
        # flips its ReLU, which moves that pair's whole gradient (a wrong kernel still
        # errs by the tensor's size).
        for i, (name, g, r) in enumerate(
            zip(["pos", "neg", *NAMES], [*got[:2], *got[2]], [*ref[:2], *ref[2]])
        ):
            err = float((g - r).norm() / r.norm().clamp(min=1e-6))
            assert err < (1e-2 if i < 2 else 1e-1), f"{name}: relative error {err:.2e}"
        return
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    for name, g, r in zip(NAMES, got[2], ref[2]):
        # Sums over up to 3,800 pairs: the bound scales with the gradient's size.
        tol = 2e-5 * max(1.0, float(r.abs().max()))
        torch.testing.assert_close(g, r, rtol=1e-4, atol=tol, msg=f"d{name}")


@pytest.mark.parametrize(("b", "n", "d"), SMALL)
def test_link_decoder_matches_reference(device: str, b: int, n: int, d: int) -> None:
    _check(device, b, n, d)


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "n", "d"), GRID)
def test_link_decoder_grid(cuda: str, b: int, n: int, d: int) -> None:
    _check(cuda, b, n, d)


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "n", "d"), SMALL)
def test_link_decoder_tf32(cuda: str, b: int, n: int, d: int) -> None:
    """With TF32 on (``train.matmul_precision=high``, the default), the kernel's products
    run on tensor cores and stay within TF32's error of the IEEE reference."""
    _check(cuda, b, n, d, tf32=True)


def test_link_decoder_reference_is_the_module(device: str) -> None:
    """The model's scorer through the dispatch equals the reference on the CPU path
    bit for bit (the pinned metrics rest on it), and within float32 on Triton's."""
    from sven.models.base import LinkDecoder

    torch.manual_seed(0)
    dec = LinkDecoder(16).to(device)
    h = torch.randn(5 * 4, 16, device=device)
    pos, neg = dec.batch(h, 4)
    h_src, h_dst, h_rest = torch.split(h, [4, 4, 12])
    want_pos = dec(h_src, h_dst)
    want_neg = dec(h_src[:, None].expand(-1, 3, -1), h_rest.view(3, 4, 16).transpose(0, 1))
    if device == "cpu":
        assert torch.equal(pos, want_pos) and torch.equal(neg, want_neg)
    else:
        torch.testing.assert_close(pos, want_pos)
        torch.testing.assert_close(neg, want_neg)


def test_link_decoder_without_gradients(device: str) -> None:
    """Scored without a backward (evaluation), the kernel keeps no activations and
    gives the same logits."""
    from sven.kernels import triton_decoder

    xs = [x.detach() for x in _inputs(7, 3, 17, device)]
    with torch.no_grad():
        got = triton_decoder.link_decoder(xs[0], 7, *xs[1:])
        want = reference.link_decoder(xs[0], 7, *xs[1:])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("b", "n", "d"), SMALL)
def test_link_decoder_scores_by_gemm_without_a_gradient(
    device: str, b: int, n: int, d: int, monkeypatch
) -> None:
    # SVEN_DECODER_WIDE=gemm: the scores without a gradient as cuBLAS products, equal
    # to the reference's within float32 rounding; with a gradient the kernel runs.
    from sven.kernels import triton_decoder

    xs = [x.detach() for x in _inputs(b, n, d, device)]
    calls = []
    monkeypatch.setattr(
        triton_decoder, "_scores_by_gemm",
        lambda *a, f=triton_decoder._scores_by_gemm: calls.append(1) or f(*a),
    )  # fmt: skip
    monkeypatch.setenv("SVEN_DECODER_WIDE", "gemm")
    params = [x.requires_grad_() for x in xs[1:]]  # a model's weights, under no_grad
    with torch.no_grad():
        want = reference.link_decoder(xs[0], b, *params)
        got = triton_decoder.link_decoder(xs[0], b, *params)
    assert calls == [1]
    assert got[0].shape == (b,) and got[1].shape == (b, n)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    _check(device, b, n, d)


def test_link_decoder_keeps_no_activations_without_a_gradient(device: str, monkeypatch) -> None:
    # Under no_grad (evaluation) the weights still require a gradient, but nothing
    # will run backward: the kernel writes no activations (KEEP_Z off).
    from sven.kernels import triton_decoder

    seen = []
    real = triton_decoder._decoder_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["KEEP_Z"])
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_decoder, "_decoder_fwd_kernel", Spy())
    xs = _inputs(7, 3, 17, device)
    with torch.no_grad():
        scored = triton_decoder.link_decoder(xs[0], 7, *xs[1:])
    trained = triton_decoder.link_decoder(xs[0], 7, *xs[1:])
    assert seen == [False, True]
    # The same scores either way, bit for bit: only the activations' store differs.
    assert all(torch.equal(a, b.detach()) for a, b in zip(scored, trained, strict=True))


@pytest.mark.parametrize("tile", ["64x32x128:4", "32x16x64:8", "16x32x32:4"])
@pytest.mark.parametrize(("b", "n", "d"), SMALL)
def test_link_decoder_forward_tiles(
    device: str, b: int, n: int, d: int, tile: str, monkeypatch
) -> None:
    # Every forward tile (SVEN_DECODER_TILE) scores as the reference, the wide batches'
    # one included, with rows and outputs off its block sizes; the backward unchanged.
    monkeypatch.setenv("SVEN_DECODER_TILE", tile)
    _check(device, b, n, d)


def test_link_decoder_takes_the_wide_tile_from_wide_pairs() -> None:
    from sven.kernels import triton_decoder as td

    assert td._forward_tile(td.WIDE_PAIRS) == td.WIDE_TILE
    assert td._forward_tile(td.WIDE_PAIRS - 1) == (td._BLOCK_M, td._BLOCK_K, td._BLOCK_O, 4)


@pytest.mark.parametrize("value", ["64x32:4", "64x32x100:4", "8x32x32:4", "64x32x128", "a:b"])
def test_link_decoder_refuses_a_bad_tile(value: str, monkeypatch) -> None:
    from sven.kernels import triton_decoder

    monkeypatch.setenv("SVEN_DECODER_TILE", value)
    with pytest.raises(ValueError, match="SVEN_DECODER_TILE"):
        triton_decoder._forward_tile(100)
