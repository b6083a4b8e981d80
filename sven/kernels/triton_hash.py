"""Triton kernels for the counter hashes of :mod:`sven.pipeline.negatives`: one launch each.

In PyTorch every step of the 63-bit mix (mask, shift, xor, multiply) is its own
element-wise kernel, so one :func:`~sven.pipeline.negatives.hash_columns` costs about 25
launches (the mix of the stream keys, then the mix of every (draw, index) pair) and one
:func:`~sven.pipeline.negatives.draws_from_keys` about 14. The captured training step
is bound by its number of kernels (docs/performance.md), and these hashes (negatives,
root and node keys, dropout masks) were a quarter of them. Here each is one kernel with
the same arithmetic: int64 products wrap modulo 2**64 in Triton as in PyTorch, and every
shift sees a value whose sign bit is clear, so arithmetic and logical shifts agree. The
results are equal bit for bit (``tests/kernels/test_hash.py``).

Scalars (epoch, first draw) may be Python ints or 0-d int64 device tensors: the captured
step keeps its epoch and batch start in device scalars, read inside the kernel, so
nothing is copied from the host.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sven.kernels.strides import unaligned

__all__ = ["draws_from_keys", "dropout_scale", "hash_columns"]

_BLOCK = 1024
_MASK63 = (1 << 63) - 1


@triton.jit
def _mix(x):
    # splitmix64's finaliser on the non-negative half of int64 (as negatives.mix).
    m63: tl.constexpr = 0x7FFFFFFFFFFFFFFF
    x = x & m63
    x = ((x ^ (x >> 31)) * 0x5851F42D4C957F2D) & m63
    x = ((x ^ (x >> 29)) * 0x14057B7EF767814F) & m63
    x = (x ^ (x >> 32)) & m63
    return x


# Scalars stay runtime arguments: Triton would otherwise make a value of 1 a constant.
# An epoch or draw given as a 0-d tensor is read once: its address's alignment is no
# reason for another compiled variant (the step's epoch sits inside a larger buffer,
# the planner's is a tensor of its own).
@triton.jit(
    do_not_specialize=["epoch", "first_draw", "draw_offset", "seed_term", "B", "N", "C"],
    **unaligned("epoch", "first_draw"),
)
def _hash_columns_kernel(
    index_ptr, out_ptr, cand_ptr, epoch, first_draw, draw_offset, seed_term, B, N, C,
    EPOCH_PTR: tl.constexpr, DRAW_PTR: tl.constexpr, HAS_CAND: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # out is (num_draws, B) contiguous; element n is draw n // B of index n % B.
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    if EPOCH_PTR:
        e = tl.load(epoch).to(tl.int64)
    else:
        e = epoch.to(tl.int64)
    if DRAW_PTR:
        d0 = tl.load(first_draw).to(tl.int64) + draw_offset
    else:
        d0 = first_draw.to(tl.int64)
    j = n // B
    i = n % B
    # stream_key(seed, epoch, first_draw + j): the same sum modulo 2**64, then masked.
    key = _mix(e * 0x85EBCA77 + (d0 + j) * 0xC2B2AE3D + seed_term)
    idx = tl.load(index_ptr + i, mask=m, other=0).to(tl.int64)
    h = _mix(idx * 0x2545F4914F6CDD1D + key)
    if HAS_CAND:
        # The hash is non-negative: % is torch's remainder.
        h = tl.load(cand_ptr + h % C, mask=m, other=0)
    tl.store(out_ptr + n, h, mask=m)


@triton.jit(do_not_specialize=["W", "N"])
def _draws_kernel(keys_ptr, out_ptr, W, N, BLOCK: tl.constexpr):
    # out is (R, W) contiguous; element n is column n % W of key n // W.
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    key = tl.load(keys_ptr + n // W, mask=m, other=0).to(tl.int64)
    col = n % W + 1
    tl.store(out_ptr + n, _mix(key * 0x2545F4914F6CDD1D + col * 0x632BE59BD9B4E019), mask=m)


@triton.jit(do_not_specialize=["W", "N", "threshold"])
def _dropout_scale_kernel(keys_ptr, scale_ptr, out_ptr, W, N, threshold, BLOCK: tl.constexpr):
    # As _draws_kernel, then keep = (draw >> 10) >= threshold, where threshold is
    # ceil(p 2**53): the integer form of uniform_from_keys(...) >= p, exact.
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    key = tl.load(keys_ptr + n // W, mask=m, other=0).to(tl.int64)
    col = n % W + 1
    draw = _mix(key * 0x2545F4914F6CDD1D + col * 0x632BE59BD9B4E019)
    scale = tl.load(scale_ptr)
    out = tl.where((draw >> 10) >= threshold, scale, tl.zeros_like(scale))
    tl.store(out_ptr + n, out, mask=m)


# 1 / (1 - p) as a 0-d tensor per (p, dtype, device): made at the first call, which the
# captured step's eager warm-up makes, so that the capture copies nothing from the host.
_SCALES: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}


def dropout_scale(keys: torch.Tensor, width: int, p: float, dtype: torch.dtype) -> torch.Tensor:
    """:func:`sven.pipeline.negatives.dropout_scale` in one kernel; (R, width) ``dtype``."""
    keys = keys.to(torch.int64).contiguous()
    out = torch.empty(keys.numel(), width, dtype=dtype, device=keys.device)
    total = out.numel()
    if total == 0:
        return out
    cache = (float(p), dtype, keys.device)
    if cache not in _SCALES:
        _SCALES[cache] = (
            torch.tensor(1.0 / (1.0 - p), dtype=torch.float64).to(dtype).to(keys.device)
        )
    threshold = math.ceil(p * 2.0**53)
    _dropout_scale_kernel[(triton.cdiv(total, _BLOCK),)](
        keys, _SCALES[cache], out, width, total, threshold, BLOCK=_BLOCK
    )
    return out


def _scalar(x: int | torch.Tensor, device: torch.device) -> tuple[int | torch.Tensor, bool]:
    """A kernel argument and whether it is a pointer (a 0-d tensor on ``device``)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.device != device:
            raise ValueError(
                f"expected a 0-d tensor on {device}, got {tuple(x.shape)} on {x.device}"
            )
        return x.reshape(()).to(torch.int64), True
    # Wrapped into int64 as the reference's tensor arithmetic would.
    x = int(x) & ((1 << 64) - 1)
    return x - (1 << 64) if x >= 1 << 63 else x, False


def hash_columns(
    seed: int,
    epoch: int | torch.Tensor,
    index: torch.Tensor,
    first_draw: int | torch.Tensor,
    num_draws: int,
    *,
    draw_offset: int = 0,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`sven.pipeline.negatives.hash_columns` in one kernel; (num_draws, B) int64.

    Args:
        seed, epoch, index, first_draw, num_draws: As the reference's.
        draw_offset: Added to ``first_draw`` (in the kernel where that is a tensor).
        candidates: (C,) int64, or None: each hash h becomes ``candidates[h % C]``
            (``negatives.sample_negatives``'s draw) in the same kernel.
    """
    index = index.to(torch.int64).contiguous()
    b = index.numel()
    out = torch.empty(num_draws, b, dtype=torch.int64, device=index.device)
    total = num_draws * b
    if total == 0:
        return out
    e, e_ptr = _scalar(epoch, index.device)
    if not isinstance(first_draw, torch.Tensor):
        first_draw, draw_offset = first_draw + draw_offset, 0
    d, d_ptr = _scalar(first_draw, index.device)
    off, _ = _scalar(draw_offset, index.device)
    seed_term = (seed * 0x9E3779B1) & _MASK63
    cand = index if candidates is None else candidates.to(torch.int64).contiguous()
    grid = (triton.cdiv(total, _BLOCK),)
    _hash_columns_kernel[grid](
        index, out, cand, e, d, off, seed_term, b, total, cand.numel(),
        EPOCH_PTR=e_ptr, DRAW_PTR=d_ptr, HAS_CAND=candidates is not None, BLOCK=_BLOCK,
    )  # fmt: skip
    return out


def draws_from_keys(keys: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`sven.pipeline.negatives.draws_from_keys` in one kernel; (R, width) int64."""
    keys = keys.to(torch.int64).contiguous()
    out = torch.empty(keys.numel(), width, dtype=torch.int64, device=keys.device)
    total = out.numel()
    if total == 0:
        return out
    _draws_kernel[(triton.cdiv(total, _BLOCK),)](keys, out, width, total, BLOCK=_BLOCK)
    return out
