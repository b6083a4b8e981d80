"""Deterministic randomness: negatives, and the keys of uniform sampling and dropout.

A negative is a pure function of (seed, epoch, global event index, draw j): it does not
depend on the batch size, the number of ranks, or the order in which batches are
processed. That is what lets P ranks reproduce the one-process run exactly and lets an
interrupted run resume on the same negatives.

The same counter hash keys every other random choice of a training step: each root
(event, slot) gets a key for its uniform neighbour draws and its dropout mask
(``root_keys``), and each node read by a global batch a key for its dropout mask
(``node_keys``). Whichever rank processes an event, it draws the same numbers as one
process would.
"""

from __future__ import annotations

import torch

_MASK63 = (1 << 63) - 1


def mix(x: torch.Tensor) -> torch.Tensor:
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
    key = mix(torch.tensor([key_int], dtype=torch.int64))
    return mix(index.to(torch.int64) * 0x2545F4914F6CDD1D + key.to(index.device))


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


#: Draw numbers of ``hash_counter`` used by root keys and node keys; negatives use
#: draws 0..n-1, far below these.
_ROOT_DRAW = 1 << 24
_NODE_DRAW = 1 << 25


def root_keys(seed: int, stream: int, index: torch.Tensor, slots: int) -> torch.Tensor:
    """Random keys of a batch's roots, fixed by (seed, stream, event, slot).

    Args:
        seed: Run seed.
        stream: Epoch (training) or evaluation stream id.
        index: (B,) int64 global event indices.
        slots: Roots per event (2 + negatives).

    Returns:
        (slots * B,) int64 in [0, 2**63), laid out like the roots (slot-major).
    """
    return torch.cat([hash_counter(seed, stream, index, _ROOT_DRAW + j) for j in range(slots)])


def node_keys(seed: int, stream: int, batch_start: int, nodes: torch.Tensor) -> torch.Tensor:
    """Random keys of the nodes a global batch reads, fixed by (seed, stream, batch, node).

    Args:
        seed: Run seed.
        stream: Epoch (training) or evaluation stream id.
        batch_start: Global index of the global batch's first event; a node's key
            changes from batch to batch.
        nodes: (U,) int64 node ids.

    Returns:
        (U,) int64 in [0, 2**63).
    """
    return hash_counter(seed, stream, nodes, _NODE_DRAW + batch_start)


def draws_from_keys(keys: torch.Tensor, width: int) -> torch.Tensor:
    """``width`` independent draws per key, uniform integers in [0, 2**63).

    Args:
        keys: (R,) int64 keys.
        width: Draws per key.

    Returns:
        (R, width) int64.
    """
    col = torch.arange(1, width + 1, dtype=torch.int64, device=keys.device)
    return mix(keys[:, None] * 0x2545F4914F6CDD1D + col * 0x632BE59BD9B4E019)


def uniform_from_keys(keys: torch.Tensor, width: int) -> torch.Tensor:
    """``width`` independent uniform numbers in [0, 1) per key.

    Args:
        keys: (R,) int64 keys.
        width: Numbers per key.

    Returns:
        (R, width) float64.
    """
    # The top 53 of the 63 bits: a float64 holds them exactly.
    return (draws_from_keys(keys, width) >> 10).to(torch.float64) * (1.0 / (1 << 53))
