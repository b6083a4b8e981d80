"""Deterministic negative sampling.

A negative is a pure function of (seed, epoch, global event index, draw j): it does not
depend on the batch size, the number of ranks, or the order in which batches are
processed. That is what lets P ranks reproduce the one-process run exactly and lets an
interrupted run resume on the same negatives.
"""

from __future__ import annotations

import torch

_MASK63 = (1 << 63) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 63-bit avalanche mix (splitmix64's finaliser restricted to non-negative int64).

    Torch has no uint64 arithmetic on every device, so the state is kept in the
    non-negative half of int64; shifts are logical because the sign bit stays clear.
    """
    x = x & _MASK63
    x = (x ^ (x >> 31)) * 0x5851F42D4C957F2D & _MASK63
    x = (x ^ (x >> 29)) * 0x14057B7EF767814F & _MASK63
    x = (x ^ (x >> 32)) & _MASK63
    return x


def hash_counter(seed: int, epoch: int, index: torch.Tensor, draw: int = 0) -> torch.Tensor:
    """Hashes (seed, epoch, index, draw) into non-negative int64 values.

    Args:
        seed: Run seed.
        epoch: Epoch number (or a split-specific stream id for evaluation).
        index: (B,) int64 global event indices.
        draw: Which of several draws per event.

    Returns:
        (B,) int64 values uniform in [0, 2**63).
    """
    key_int = (seed * 0x9E3779B1 + epoch * 0x85EBCA77 + draw * 0xC2B2AE3D) & _MASK63
    key = _mix(torch.tensor([key_int], dtype=torch.int64))
    return _mix(index.to(torch.int64) * 0x2545F4914F6CDD1D + key.to(index.device))


def sample_negatives(
    seed: int,
    epoch: int,
    event_index: torch.Tensor,
    candidates: torch.Tensor,
    num_neg: int = 1,
) -> torch.Tensor:
    """Draws negative destinations uniformly from ``candidates``.

    Args:
        seed: Run seed.
        epoch: Epoch number; evaluation uses a fixed stream so every run sees the same
            evaluation negatives.
        event_index: (B,) int64 global event indices of the positive events.
        candidates: (C,) int64 node ids to draw from (the nodes that occur as
            destinations), on the device of the result.
        num_neg: Negatives per event.

    Returns:
        (B, num_neg) int64 node ids.
    """
    if candidates.numel() == 0:
        raise ValueError("no candidate nodes to draw negatives from")
    cols = [
        candidates[hash_counter(seed, epoch, event_index, j) % candidates.numel()]
        for j in range(num_neg)
    ]
    return torch.stack(cols, dim=1)
