"""The optimizer of a run: Adam with this run's device flags (fused, capturable)."""

from __future__ import annotations

from typing import Any

import torch

from sven.engine.startup import lean_adam, undecorated

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
        a graph break, keeping what it does in eager mode (gradients off)."""
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
