"""Adam's step as one Triton launch (``sven.kernels.triton_adam``) against
``torch.optim.Adam``'s own step, the reference, through ``sven.engine.optim.Optimizer``."""

from __future__ import annotations

import pytest
import torch

from sven.engine.optim import Optimizer

# Tensors across the block boundary (1,024 elements), one element, and a matrix.
SHAPES = [(3000,), (1,), (1024,), (37, 29), (5, 1, 7)]


def _params(device: str, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], step: int, skip: int | None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(p.shape, generator=g).to(p.device) for p in params]
    return [None if i == skip else x for i, x in enumerate(out)]


def _run(use_kernel, backend: str, device: str, steps: int, decay: float, skip: int | None):
    use_kernel("adam_step", backend)
    params = _params(device)
    opt = Optimizer(params, lr=0.01, device=torch.device(device))
    for group in opt.param_groups:
        group["weight_decay"] = decay
    for step in range(steps):
        for p, g in zip(params, _grads(params, step, skip if step else None)):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("decay", [0.0, 0.01])
def test_steps_match_torch_adam(device: str, use_kernel, decay: float) -> None:
    """Five steps, the second tensor without a gradient after the first (its state and
    step count stay): parameters and moments within float32 rounding of torch's, step
    counts equal."""
    want, ref = _run(use_kernel, "reference", device, 5, decay, skip=1)
    got, tri = _run(use_kernel, "triton", device, 5, decay, skip=1)
    for i, (w, g) in enumerate(zip(want, got)):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-7, msg=f"param {i}")
        sw, sg = ref.state[w], tri.state[g]
        assert sg["step"].dtype == sw["step"].dtype and sg["step"].device == sw["step"].device
        assert float(sg["step"]) == float(sw["step"]) == (1.0 if i == 1 else 5.0)
        for name in ("exp_avg", "exp_avg_sq"):
            # torch's CUDA step leaves exp_avg up to 3e-7 from the double-precision
            # update (on the H200): a few float32 units in the last place.
            torch.testing.assert_close(sg[name], sw[name], rtol=2e-6, atol=1e-6)


def test_state_dict_continues_on_the_reference(device: str, use_kernel) -> None:
    """The kernel's state is Adam's: two kernel steps, saved, loaded into a reference
    optimizer, and a third step there, as three reference steps."""
    want, _ = _run(use_kernel, "reference", device, 3, 0.0, skip=None)
    got, tri = _run(use_kernel, "triton", device, 2, 0.0, skip=None)
    use_kernel("adam_step", "reference")
    opt = Optimizer(got, lr=0.01, device=torch.device(device))
    opt.load_state_dict(tri.state_dict())
    for p, g in zip(got, _grads(got, 2, None)):
        p.grad = g
    opt.step()
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-7)


def test_unsupported_groups_take_torch_step(device: str, use_kernel) -> None:
    """amsgrad (and so any setting the kernel lacks) runs torch's step: equal to the
    reference to the bit."""
    out = []
    for backend in ("reference", "triton"):
        use_kernel("adam_step", backend)
        params = _params(device)
        opt = Optimizer(params, lr=0.01, device=torch.device(device))
        opt.param_groups[0]["amsgrad"] = True
        for step in range(2):
            for p, g in zip(params, _grads(params, step, None)):
                p.grad = g
            opt.step()
        out.append(params)
    for w, g in zip(*out):
        assert torch.equal(w, g)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_step_with_graph_gradients(use_kernel) -> None:
    """The step in a CUDA graph whose backward allocates the gradients (as the captured
    training step's does): replays train as eager reference steps."""
    use_kernel("adam_step", "reference")
    torch.manual_seed(0)
    ref = torch.nn.Linear(300, 50).cuda()
    model = torch.nn.Linear(300, 50).cuda()
    model.load_state_dict(ref.state_dict())
    xs = [torch.randn(64, 300, device="cuda") for _ in range(6)]
    ropt = Optimizer(ref.parameters(), lr=0.01, device=torch.device("cuda"))
    for x in xs:
        ropt.zero_grad()
        ref(x).square().mean().backward()
        ropt.step()
    use_kernel("adam_step", "triton")
    opt = Optimizer(model.parameters(), lr=0.01, device=torch.device("cuda"))
    static_x = xs[0].clone()

    def step() -> None:
        opt.zero_grad()
        model(static_x).square().mean().backward()
        opt.step()

    step()  # eager: the tables and the pinned staging buffer
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for x in xs[1:]:
        static_x.copy_(x)
        graph.replay()
    torch.cuda.synchronize()
    assert len(opt._tables._captured) == 1
    for w, g in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
