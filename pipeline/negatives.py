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

from typing import Any

import torch

from sven import kernels
from sven.kernels import ahead
from sven.pipeline import constants

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


def stream_key(
    seed: int,
    epoch: int | torch.Tensor,
    draw: int | torch.Tensor = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The mixed key of a (seed, epoch, draw) stream, a 0-d int64 tensor.

    ``epoch`` and ``draw`` may be Python ints or 0-d int64 tensors on the device: the
    captured training step keeps its epoch and batch start in device scalars, so the key
    is computed there without a host round trip. Both give the same value: int64
    products wrap modulo 2**64, whose low 63 bits are those of the exact product.

    Args:
        seed: Run seed.
        epoch: Epoch number or evaluation stream id.
        draw: Which draw (negatives: 0..n-1; root and node keys: see below).
        device: Where the key lives when both are ints.

    Returns:
        () int64 in [0, 2**63).
    """
    if isinstance(epoch, torch.Tensor) or isinstance(draw, torch.Tensor):
        # Device arithmetic only with Python scalars as operands: no host tensor is
        # copied in, so the key can be computed inside a captured CUDA graph.
        const = (seed * 0x9E3779B1) & _MASK63
        parts = []
        for term, mult in ((epoch, 0x85EBCA77), (draw, 0xC2B2AE3D)):
            if isinstance(term, torch.Tensor):
                parts.append(term.to(torch.int64) * mult)
            else:
                const = (const + term * mult) & _MASK63
        return mix((sum(parts[1:], parts[0]) + const) & _MASK63)
    key_int = (seed * 0x9E3779B1 + epoch * 0x85EBCA77 + draw * 0xC2B2AE3D) & _MASK63
    return mix(torch.tensor(key_int, dtype=torch.int64, device=device))


def _device_epoch(epoch: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The epoch (or stream id) for the Triton hash as a kept 0-d int64 device tensor.

    The captured step passes its epoch as a device scalar; the planner and the
    evaluation tables pass Python ints, and an int argument is another compiled
    variant of the kernel (on an empty Triton cache, a compile each). One per value is
    kept: epochs and stream ids are few.
    """
    if isinstance(epoch, torch.Tensor):
        return epoch
    # Wrapped into int64 as the reference's tensor arithmetic would.
    e = int(epoch) & ((1 << 64) - 1)
    return constants.filled(e - (1 << 64) if e >= 1 << 63 else e, (), torch.int64, device)


def hash_columns(
    seed: int,
    epoch: int | torch.Tensor,
    index: torch.Tensor,
    first_draw: int | torch.Tensor,
    num_draws: int,
) -> torch.Tensor:
    """Hashes (seed, epoch, index, draw) for ``num_draws`` consecutive draws at once.

    Row j equals ``hash_counter(seed, epoch, index, first_draw + j)``; one chain of
    element-wise ops serves every draw (a few kernels instead of a few per draw), and
    nothing is copied from the host, so it can run inside a captured CUDA graph.

    Args:
        seed: Run seed.
        epoch: Epoch number or evaluation stream id (int or 0-d device tensor).
        index: (B,) int64 global event (or node) indices.
        first_draw: The first draw number (int or 0-d device tensor).
        num_draws: How many draws.

    Returns:
        (num_draws, B) int64 values uniform in [0, 2**63).
    """
    if kernels.hash_backend(index) == "triton":
        from sven.kernels import triton_hash

        epoch = _device_epoch(epoch, index.device)
        cols = triton_hash.hash_columns(seed, epoch, index, first_draw, num_draws)
        if not ahead.dry_running():
            return cols
    draw = torch.arange(num_draws, dtype=torch.int64, device=index.device) + first_draw
    key = stream_key(seed, epoch, draw)
    return mix(index.to(torch.int64)[None, :] * 0x2545F4914F6CDD1D + key[:, None])


def hash_counter(
    seed: int, epoch: int | torch.Tensor, index: torch.Tensor, draw: int | torch.Tensor = 0
) -> torch.Tensor:
    """Hashes (seed, epoch, index, draw) into non-negative int64 values.

    Args:
        seed: Run seed.
        epoch: Epoch number (or a split-specific stream id for evaluation); an int or a
            0-d int64 tensor on ``index``'s device.
        index: (B,) int64 global event indices.
        draw: Which of several draws per event; an int or a 0-d device tensor.

    Returns:
        (B,) int64 values uniform in [0, 2**63).
    """
    return hash_columns(seed, epoch, index, draw, 1)[0]


def sample_negatives(
    seed: int,
    epoch: int | torch.Tensor,
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
    if kernels.hash_backend(event_index) == "triton":
        from sven.kernels import triton_hash

        # The draw, its remainder and the candidates' gather in one kernel.
        epoch = _device_epoch(epoch, event_index.device)
        cols = triton_hash.hash_columns(seed, epoch, event_index, 0, num_neg, candidates=candidates)
        if not ahead.dry_running():
            return cols.t()
    draws = hash_columns(seed, epoch, event_index, 0, num_neg)
    return candidates[draws % candidates.numel()].t()


#: Draw numbers of ``hash_counter`` used by root keys and node keys; negatives use
#: draws 0..n-1, far below these.
_ROOT_DRAW = 1 << 24
_NODE_DRAW = 1 << 25


def root_keys(
    seed: int, stream: int | torch.Tensor, index: torch.Tensor, slots: int
) -> torch.Tensor:
    """Random keys of a batch's roots, fixed by (seed, stream, event, slot).

    Args:
        seed: Run seed.
        stream: Epoch (training) or evaluation stream id.
        index: (B,) int64 global event indices.
        slots: Roots per event (2 + negatives).

    Returns:
        (slots * B,) int64 in [0, 2**63), laid out like the roots (slot-major).
    """
    return hash_columns(seed, stream, index, _ROOT_DRAW, slots).reshape(-1)


def node_keys(
    seed: int, stream: int | torch.Tensor, batch_start: int | torch.Tensor, nodes: torch.Tensor
) -> torch.Tensor:
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
    if kernels.hash_backend(nodes) == "triton":
        from sven.kernels import triton_hash

        # The draw number's sum inside the kernel, not a kernel of its own.
        keys = triton_hash.hash_columns(seed, stream, nodes, batch_start, 1, draw_offset=_NODE_DRAW)
        if not ahead.dry_running():
            return keys[0]
    return hash_columns(seed, stream, nodes, _NODE_DRAW + batch_start, 1)[0]


def draws_from_keys(keys: torch.Tensor, width: int) -> torch.Tensor:
    """``width`` independent draws per key, uniform integers in [0, 2**63).

    Args:
        keys: (R,) int64 keys.
        width: Draws per key.

    Returns:
        (R, width) int64.
    """
    if kernels.hash_backend(keys) == "triton":
        from sven.kernels import triton_hash

        draws = triton_hash.draws_from_keys(keys, width)
        if not ahead.dry_running():
            return draws
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


def dropout_scale(keys: torch.Tensor, width: int, p: float, dtype: torch.dtype) -> torch.Tensor:
    """Keyed dropout's multiplier: 1 / (1 - p) where a draw keeps, 0 where it drops.

    Keeps where ``uniform_from_keys(keys, width) >= p``; ``x * dropout_scale(...)`` is
    dropout of x with the mask fixed by the keys.

    Args:
        keys: (R,) int64 keys.
        width: Columns per key.
        p: Drop probability in [0, 1).
        dtype: Floating dtype of the result (that of the input to drop from).

    Returns:
        (R, width) ``dtype``.
    """
    if _DROPOUT_OP is not None and torch.compiler.is_compiling():
        # Opaque to Inductor: it would fuse the int64 chain itself and emit the hash's
        # 64-bit constants as int32 (torch 2.11); the op runs the eager kernel.
        return _DROPOUT_OP(keys, width, p, dtype)
    if kernels.hash_backend(keys) == "triton":
        from sven.kernels import triton_hash

        return triton_hash.dropout_scale(keys, width, p, dtype)
    keep = uniform_from_keys(keys, width) >= p
    return keep.to(dtype) * (1.0 / (1.0 - p))


# sven::dropout_scale, the custom op compiled models call; registered by
# register_compiled_ops (a run without train.compile never defines it).
_DROPOUT_OP: Any = None


def register_compiled_ops() -> None:
    """Defines the custom op through which a ``torch.compile``'d model draws keyed dropout.

    Inside a compiled region :func:`dropout_scale` calls ``sven::dropout_scale``, an op
    whose body is the eager function (the Triton kernel on CUDA, the reference on CPU):
    Inductor keeps it as one opaque kernel call rather than tracing the hash, whose
    64-bit constants it emits into its own kernels as int32 (``Scalar
    7146057691288625177 is out of range for type int32``, torch 2.11).
    Idempotent; called before the first compilation.
    """
    global _DROPOUT_OP
    if _DROPOUT_OP is not None:
        return

    @torch.library.custom_op("sven::dropout_scale", mutates_args=())
    def op(keys: torch.Tensor, width: int, p: float, dtype: torch.dtype) -> torch.Tensor:
        return dropout_scale(keys, width, p, dtype)

    @op.register_fake
    def _(keys: torch.Tensor, width: int, p: float, dtype: torch.dtype) -> torch.Tensor:
        return keys.new_empty((keys.shape[0], width), dtype=dtype)

    _DROPOUT_OP = op
