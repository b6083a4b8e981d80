"""Shapes, masks and tolerances shared by the kernel tests."""

from __future__ import annotations

import torch


def make_mask(r: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(r, k) validity with every kind of row: some fully masked, some full, the rest
    with random gaps (fewer valid slots than k)."""
    mask = torch.rand(r, k, generator=gen) < torch.rand(r, 1, generator=gen)
    if r > 1:
        mask[0] = False
        mask[-1] = True
    if r > 2:
        mask[1] = torch.arange(k) < max(1, k // 2)
    return mask


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances against a float64 reference."""
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
