"""The optimizer of a run: Adam with this run's device flags (fused, capturable)."""

from __future__ import annotations

from typing import Any

import torch

from sven.engine.startup import lean_adam, undecorated
from sven.kernels.backend import backend_for

__all__ = ["Optimizer"]


class Optimizer(torch.optim.Adam):
    """Adam with this run's implementation flags: the fused kernel, on CUDA with its
    step count on the device (so the optimizer step can be captured in a CUDA graph).
    On CPU too the fused step is one C++ loop instead of a Python loop of small ops per
    parameter tensor (docs/performance.md, "On CPU", has the timings).

    Its state_dict is Adam's; :meth:`load_state_dict` accepts one saved by any run (CPU
    or GPU) and applies this run's flags.

    ``lean`` (the default, unless the run compiles): torch's ``step``, ``zero_grad``,
    ``add_param_group`` and ``state_dict`` run without the ``torch._dynamo`` wrappers
    torch puts around them for ``torch.compile``. Those wrappers import torch's
    compiler front end (and with it triton) at the first call, which took as long as
    importing torch itself; outside compilation they do nothing else, so the same code
    runs and the results are the same (:func:`sven.engine.startup.undecorated`).

    Args:
        params: The model's parameters.
        lr: Learning rate.
        device: Where the parameters live.
        lean: Call torch's methods without their compiler wrappers.
    """

    def __init__(self, params: Any, lr: float, device: torch.device, *, lean: bool = True) -> None:
        flags = {"cuda": {"fused": True, "capturable": True}, "cpu": {"fused": True}}
        self._flags = flags.get(device.type, {})
        self._lean = lean and lean_adam()
        self._tables: Any = None
        super().__init__(params, lr=lr, **self._flags)

    def _call(self, name: str, base: type, *args: Any) -> Any:
        if self._lean:
            return undecorated(getattr(base, name))(self, *args)
        return getattr(super(), name)(*args)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, without its compiler wrapper (``lean``)."""
        self._call("add_param_group", torch.optim.Optimizer, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, without its compiler wrapper (``lean``)."""
        self._call("zero_grad", torch.optim.Optimizer, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's, without its compiler wrapper (``lean``)."""
        return self._call("state_dict", torch.optim.Optimizer)

    def step(self, closure: Any = None) -> Any:
        """Adam's step; ``lean``: without the wrapper that imports ``torch._dynamo`` for
        a graph break, keeping what it does in eager mode (gradients off). On CUDA by
        default (``SVEN_KERNELS=...,adam_step=reference`` turns it off): one Triton
        launch for every tensor (:mod:`sven.kernels.triton_adam`) where it applies."""
        if closure is None and self._triton_step():
            return None
        if not self._lean:
            return super().step(closure)
        prev = torch.is_grad_enabled()
        torch.set_grad_enabled(self.defaults["differentiable"])
        try:
            return undecorated(torch.optim.Adam.step)(self, closure)
        finally:
            torch.set_grad_enabled(prev)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads Adam state saved by any run, with this run's flags."""
        for g in state_dict.get("param_groups", []):
            for k in ("fused", "capturable"):
                g[k] = self._flags.get(k, False)
        self._call("load_state_dict", torch.optim.Optimizer, state_dict)

    def _triton_step(self) -> bool:
        """Adam's step by :func:`sven.kernels.triton_adam.adam_step`, where chosen and
        where it applies: one parameter group of float32 contiguous tensors with dense
        gradients, no amsgrad, maximize or differentiable step, a float learning rate.
        Moments and step counts are made as torch's step makes them.

        Returns:
            Whether the step ran; False leaves every tensor as it was.
        """
        if len(self.param_groups) != 1:
            return False
        group = self.param_groups[0]
        if not group["params"] or backend_for(group["params"][0], "adam_step") != "triton":
            return False
        if group["amsgrad"] or group["maximize"] or group["differentiable"]:
            return False
        params = [p for p in group["params"] if p.grad is not None]
        dense = all(
            p.dtype == torch.float32
            and p.is_contiguous()
            and not p.grad.is_sparse
            and p.grad.dtype == torch.float32
            and p.grad.is_contiguous()
            for p in params
        )
        if not dense or isinstance(group["lr"], torch.Tensor):
            return False
        from sven.kernels.triton_adam import AdamTables, adam_step

        states = [self._adam_state(p) for p in params]
        if self._tables is None:
            self._tables = AdamTables()
        beta1, beta2 = group["betas"]
        with torch.no_grad():
            return adam_step(
                self._tables, params, [p.grad for p in params],
                [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states], lr=float(group["lr"]), beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            )  # fmt: skip

    def _adam_state(self, p: torch.Tensor) -> dict[str, Any]:
        """``p``'s Adam state, made as torch's fused step makes it (a float32 step count
        on the parameter's device, zero moments) where it has none yet."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
