"""Tensors that depend only on shapes and a device, made once and reused.

The captured step is bound by its number of kernels, and an ``arange`` or a filled
scalar is one each. A constant of a shape is made at its first use (the captured
step's eager warm-up makes every one of them) and kept, so that the step reads it
instead of launching its kernels. None is made while a CUDA graph is being captured:
a tensor made then would belong to the graph's private memory pool; such a call
computes its result without keeping it. Nor is one read or kept while ``torch.compile``
traces: the compiler folds the constant into its graph, and a guard on the cache's
contents would recompile the step once the cache has filled.

Callers never write into what these return.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["arange", "arange_mod", "filled", "values"]

#: At most this many constants are kept (the oldest are dropped first): a run has a
#: few batch shapes (training, each evaluation width), each with a few constants.
_LIMIT = 256
_CACHE: dict[tuple, torch.Tensor] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _kept(key: tuple, make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``make()``, made once per ``key`` outside a capture."""
    if torch.compiler.is_compiling():
        return make()
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    out = make()
    if not _capturing(device):
        if len(_CACHE) >= _LIMIT:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[key] = out
    return out


def arange(n: int, device: torch.device) -> torch.Tensor:
    """(n,) int64 ``0, 1, ..., n - 1`` on ``device``."""
    device = torch.device(device)
    return _kept(("arange", n, device), lambda: torch.arange(n, device=device), device)


def arange_mod(lo: int, hi: int, modulus: int, device: torch.device) -> torch.Tensor:
    """(hi - lo,) int64 ``arange(lo, hi) % modulus`` on ``device``."""
    device = torch.device(device)
    return _kept(
        ("arange_mod", lo, hi, modulus, device),
        lambda: torch.arange(lo, hi, device=device) % modulus,
        device,
    )


def filled(
    value: int | float, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A tensor of ``shape`` (``()`` for a scalar operand) holding ``value``."""
    device = torch.device(device)
    return _kept(
        ("filled", value, shape, dtype, device),
        lambda: torch.full(shape, value, dtype=dtype, device=device),
        device,
    )


def values(
    items: tuple[int | float, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(len(items),) ``items`` as a tensor on ``device``."""
    device = torch.device(device)
    return _kept(
        ("values", items, dtype, device),
        lambda: torch.tensor(items, dtype=dtype).to(device),
        device,
    )
