"""The Triton kernels inside CUDA-graph capture: no host syncs, replay equals eager."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.grid import make_mask

pytestmark = pytest.mark.gpu


def _problems(device: str):
    """name -> (function of the leaves, the leaves); other inputs are closed over."""
    from sven.kernels import triton_attention, triton_rnn

    gen = torch.Generator().manual_seed(3)
    r, k, h, d, t, u = 37, 10, 2, 50, 100, 29
    o = h * d
    mask = make_mask(r, k, gen).to(device)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    nbr = torch.randint(0, u, (r, k), generator=gen).to(device)
    dt = (torch.rand(r, k, generator=gen) * 10).to(device)
    tw = (1.0 / 10 ** torch.linspace(0, 9, t)).to(device)
    tb = torch.zeros(t, device=device)
    last = (torch.rand(u, generator=gen, dtype=torch.float64) * 100).to(device)
    ts = last + (torch.rand(u, generator=gen, dtype=torch.float64) * 10).to(device)
    has = (torch.rand(u, generator=gen) < 0.6).to(device)
    return {
        "updater": (
            lambda mail, h, *w: triton_rnn.recurrent_update(
                mail, ts, last, has, h, tw, tb, *w, cell="gru"
            )[0],
            [
                randn(u, 200),
                randn(u, 100),
                randn(300, 300) / 17,
                randn(300, 100) / 10,
                randn(300),
                randn(300),
            ],
        ),
        "attention": (
            lambda q, kv: triton_attention.temporal_attention(
                q, *(x.reshape(r, k, h, d) for x in kv.chunk(2, dim=2)), mask
            ),
            [randn(r, h, d), randn(r, k, 2 * o)],
        ),
        "fused": (
            lambda q, kvn, wt, ke: triton_attention.temporal_attention_fused(
                q, kvn, nbr, dt, mask, tw, tb, wt, ke
            ),
            [randn(r, h, d), randn(u, 2 * o), randn(2 * o, t) / 10, randn(r, k, 2 * o)],
        ),
        "gru": (
            triton_rnn.gru_cell,
            [
                randn(u, 300),
                randn(u, 100),
                randn(300, 300) / 17,
                randn(300, 100) / 10,
                randn(300),
                randn(300),
            ],
        ),
        "rnn": (
            triton_rnn.rnn_cell,
            [
                randn(u, 300),
                randn(u, 100),
                randn(100, 300) / 17,
                randn(100, 100) / 10,
                randn(100),
                randn(100),
            ],
        ),
    }


@pytest.mark.parametrize("name", ["attention", "fused", "gru", "rnn", "updater"])
def test_capture_and_replay_match_eager(name, cuda) -> None:
    fn, leaves = _problems(cuda)[name]
    leaves = [x.requires_grad_() for x in leaves]

    def step():
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, out.detach() * 0 + 1.0)
        return [out.detach(), *grads]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: compile the kernels outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    # New values in the same buffers: the replay must follow them.
    with torch.no_grad():
        for x in leaves:
            x.copy_(torch.randn_like(x) * x.std())
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_deterministic_mode_repeats_bitwise(cuda) -> None:
    fn, leaves = _problems(cuda)["fused"]
    # Only kv_node: the other gradients are GEMMs, which deterministic mode refuses
    # without CUBLAS_WORKSPACE_CONFIG.
    leaves[1].requires_grad_()
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            out = fn(*leaves)
            runs.append(torch.autograd.grad(out.sum(), leaves[1]))
    finally:
        torch.use_deterministic_algorithms(prev)
    assert torch.equal(runs[0][0], runs[1][0])
