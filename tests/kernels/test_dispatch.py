"""The kernel dispatch: which backend a call takes, read once from the environment."""

from __future__ import annotations

import pytest
import torch

from sven import kernels


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch):
    monkeypatch.delenv("SVEN_KERNELS", raising=False)
    kernels.reset_backend()
    yield
    kernels.reset_backend()


def _attention_args(device="cpu"):
    q = torch.randn(3, 2, 4, device=device, requires_grad=True)
    k = torch.randn(3, 5, 2, 4, device=device)
    mask = torch.ones(3, 5, dtype=torch.bool, device=device)
    return q, k, k, mask


def test_auto_runs_the_reference_on_cpu() -> None:
    assert kernels.backend_for(torch.zeros(1)) == "reference"
    out = kernels.temporal_attention(*_attention_args())
    assert "_TemporalAttention" not in type(out.grad_fn).__name__


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("SVEN_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.temporal_attention(*_attention_args())


def test_forced_triton_under_the_interpreter(monkeypatch, device) -> None:
    monkeypatch.setenv("SVEN_KERNELS", "triton")
    args = _attention_args(device)
    assert kernels.backend_for(args[0]) == "triton"
    out = kernels.temporal_attention(*args)
    assert type(out.grad_fn).__name__ == "_TemporalAttentionBackward"
    torch.testing.assert_close(out, kernels.reference.temporal_attention(*args))


def test_choice_is_cached_until_reset(monkeypatch) -> None:
    t = torch.zeros(1)
    monkeypatch.setenv("SVEN_KERNELS", "reference")
    assert kernels.backend_for(t) == "reference"
    monkeypatch.setenv("SVEN_KERNELS", "bogus")
    assert kernels.backend_for(t) == "reference"  # not re-read
    kernels.reset_backend()
    with pytest.raises(ValueError, match="bogus"):
        kernels.backend_for(t)


@pytest.mark.gpu
def test_triton_on_cuda_when_asked_and_reference_can_be_forced(monkeypatch, cuda) -> None:
    args = _attention_args(cuda)
    # auto: the reference for an unnamed call and the cells; Triton for the functions
    # measured faster in the captured step (kernels.AUTO_TRITON, see the module).
    assert kernels.backend_for(args[0]) == "reference"
    assert kernels.backend_for(args[0], "gru_cell") == "reference"
    assert kernels.backend_for(args[0], "temporal_attention") == "triton"
    assert kernels.backend_for(args[0], "recurrent_update") == "triton"
    assert kernels.backend_for(args[0], "adam_step") == "triton"
    monkeypatch.setenv("SVEN_KERNELS", "triton")
    kernels.reset_backend()
    assert kernels.backend_for(args[0]) == "triton"
    assert type(kernels.temporal_attention(*args).grad_fn).__name__ == (
        "_TemporalAttentionBackward"
    )
    monkeypatch.setenv("SVEN_KERNELS", "reference")
    kernels.reset_backend()
    assert kernels.backend_for(args[0]) == "reference"


def test_per_function_choice_overrides_the_mode(monkeypatch, device) -> None:
    """``SVEN_KERNELS=reference,recurrent_update=triton``: only the updater takes Triton
    (its autograd Function), the cells and the attention keep the reference."""
    monkeypatch.setenv("SVEN_KERNELS", "reference, recurrent_update=triton")
    h = torch.zeros(2, 4, device=device)
    assert kernels.backend_for(h, "recurrent_update") == "triton"
    assert kernels.backend_for(h, "gru_cell") == "reference"
    assert kernels.backend_for(h) == "reference"
    w = torch.randn(12, 7, device=device, requires_grad=True)
    t = torch.ones(2, dtype=torch.float64, device=device)
    has = torch.tensor([True, False], device=device)
    tw, tb = torch.ones(2, device=device), torch.zeros(2, device=device)
    mail = torch.randn(2, 5, device=device)
    w_hh = torch.randn(12, 4, device=device)
    mem, _ = kernels.recurrent_update(mail, t, t, has, h, tw, tb, w, w_hh, None, None, cell="gru")
    assert type(mem.grad_fn).__name__ == "_RecurrentUpdateBackward"
    out = kernels.gru_cell(torch.randn(2, 7, device=device), h, w, w_hh, None, None)
    assert "_GRUCell" not in type(out.grad_fn).__name__


@pytest.mark.parametrize(
    "value", ["fast", "triton,reference", "auto,gru=triton", "auto,gru_cell=fast"]
)
def test_bad_choices_name_the_accepted_ones(monkeypatch, value) -> None:
    monkeypatch.setenv("SVEN_KERNELS", value)
    with pytest.raises(ValueError, match="SVEN_KERNELS"):
        kernels.backend_for(torch.zeros(1))


def test_fused_attention_reference_runs_the_chosen_core(monkeypatch, device) -> None:
    """``temporal_attention=triton`` alone: the fused attention keeps the reference's
    projections and gather, and its masked softmax runs as the Triton kernel."""
    monkeypatch.setenv("SVEN_KERNELS", "reference,temporal_attention=triton")
    gen = torch.Generator().manual_seed(1)
    r, k, h, d, t, u = 5, 4, 2, 8, 6, 7

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    nbr = torch.randint(0, u, (r, k), generator=gen).to(device)
    mask = (torch.rand(r, k, generator=gen) < 0.7).to(device)
    mask[0] = False
    args = (randn(r, h, d).requires_grad_(), randn(u, 2 * h * d), nbr, randn(r, k).abs(), mask)
    args += (randn(t), randn(t), randn(2 * h * d, t) / 3)
    out = kernels.temporal_attention_fused(*args)
    assert type(out.grad_fn).__name__ == "_TemporalAttentionBackward"
    want = kernels.reference.temporal_attention_fused(*args)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
