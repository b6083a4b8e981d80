"""Hot-path kernels with one dispatch point.

``temporal_attention``, ``gru_cell`` and ``rnn_cell`` run the PyTorch reference in
:mod:`sven.kernels.reference` (the CPU path and the test oracle). Triton kernels, when
present in ``sven.kernels.triton_ops``, are picked on CUDA tensors; the environment
variable ``SVEN_KERNELS=reference`` forces the reference everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from sven.kernels import reference

__all__ = ["backend_for", "gru_cell", "rnn_cell", "temporal_attention"]


def _triton_ops() -> Any | None:
    if os.environ.get("SVEN_KERNELS", "auto") == "reference":
        return None
    try:
        from sven.kernels import triton_ops  # type: ignore[attr-defined]
    except ImportError:
        return None
    return triton_ops


def backend_for(t: torch.Tensor) -> str:
    """Names the backend a call on tensor ``t`` dispatches to ("triton" or "reference")."""
    ops = _triton_ops()
    return "triton" if (ops is not None and t.is_cuda) else "reference"


def _dispatch(name: str) -> Callable[..., torch.Tensor]:
    ref = getattr(reference, name)

    def call(*args: torch.Tensor) -> torch.Tensor:
        ops = _triton_ops()
        if ops is not None and args[0].is_cuda and hasattr(ops, name):
            return getattr(ops, name)(*args)
        return ref(*args)

    call.__name__ = name
    call.__doc__ = ref.__doc__
    return call


temporal_attention = _dispatch("temporal_attention")
gru_cell = _dispatch("gru_cell")
rnn_cell = _dispatch("rnn_cell")
