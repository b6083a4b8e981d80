"""The parameter gradients of linear layers, weight and bias together, in one Triton kernel.

For a layer ``y = x W^T + b`` with output gradient ``g``, the backward needs
``dW = g^T x`` and ``db = g.sum(0)``. cuBLAS runs the first as a GEMM that it splits
along the long reduction (the batch's rows, thousands) into a product and a reduction
kernel, and the second as a matrix-vector product: three kernels per layer. Here one
launch computes both, for up to three layers at once (a backward that has several, as
the memory cell's input and hidden weights):

- weight programs: each owns a ``BLOCK_N x BLOCK_M`` tile of one ``dW`` and walks all
  K rows in order, ``tl.dot`` on TF32 tensor cores or in IEEE float32 as the run's
  matmul precision says (:func:`sven.kernels.precision.tf32_dots`);
- bias programs: each owns ``BLOCK_B`` columns of one ``g`` and sums them over all K
  rows in order, in float32.

Every output element is written by one program after a fixed sequence of additions:
the results repeat bit for bit (no atomics, no split of K across programs). The launch
allocates only shape-dependent buffers and never synchronises, so a CUDA graph captures
it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sven.kernels.precision import tf32_dots

__all__ = ["param_grads"]

# Rows of K per step of every program: 64 rows of a 32-wide tile are 8 KiB a operand,
# three steps in flight (num_stages) stay well within shared memory.
_BLOCK_K = 64
# Columns of g per bias program.
_BLOCK_B = 32
# Weight tiles (BLOCK_N, BLOCK_M), largest first: the launch takes the largest that
# still gives every SM a program, since a program's time grows with K (no split of the
# reduction) and with its tile's width (the rows of g and x it reads per step).
_TILES = ((32, 64), (32, 32), (16, 32), (16, 16))
# Warps per program and the loads in flight (benchmarks/bench_param_grads.py --sweep
# times the alternatives).
_NUM_WARPS, _NUM_STAGES = 4, 3
_MAX_PROBLEMS = 3
_SMS: dict[torch.device, int] = {}
#: A layer: (x (K, M), g (K, N) or (K,), weight gradient wanted, bias gradient wanted).
Problem = tuple[torch.Tensor, torch.Tensor, bool, bool]


@triton.jit
def _weight_tile(
    t, x_ptr, g_ptr, dw_ptr, K, M, N, sx, sg,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TF32: tl.constexpr,
):  # fmt: skip
    """Tile ``t`` of ``dW = g^T x`` (N, M), row-major over tiles of M."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    rn = (t // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (t % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    nm = rn < N
    mm = rm < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        # g^T's tile (BLOCK_N, BLOCK_K), read from g's rows; x's (BLOCK_K, BLOCK_M).
        gt = tl.load(g_ptr + kk[None, :] * sg + rn[:, None], mask=nm[:, None] & km[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        xt = tl.load(x_ptr + kk[:, None] * sx + rm[None, :], mask=km[:, None] & mm[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        if TF32:
            acc += tl.dot(gt, xt, input_precision="tf32")
        else:
            acc += tl.dot(gt, xt, input_precision="ieee")
    out = dw_ptr + rn[:, None] * M + rm[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=nm[:, None] & mm[None, :])


@triton.jit
def _bias_block(t, g_ptr, db_ptr, K, N, sg, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns ``t BLOCK_B ...`` of ``db = g.sum(0)``: each lane of the tile adds its
    rows in order, then one tree over the tile's rows."""
    rn = t * BLOCK_B + tl.arange(0, BLOCK_B)
    nm = rn < N
    acc = tl.zeros([BLOCK_K, BLOCK_B], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        m = (kk < K)[:, None] & nm[None, :]
        acc += tl.load(g_ptr + kk[:, None] * sg + rn[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(db_ptr + rn, tl.sum(acc, axis=0).to(db_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _param_grads_kernel(
    x0_ptr, g0_ptr, dw0_ptr, db0_ptr, K0, M0, N0, sx0, sg0, W0, P0,
    x1_ptr, g1_ptr, dw1_ptr, db1_ptr, K1, M1, N1, sx1, sg1, W1, P1,
    x2_ptr, g2_ptr, dw2_ptr, db2_ptr, K2, M2, N2, sx2, sg2, W2,
    NUM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr, TF32: tl.constexpr,
):  # fmt: skip
    # Layer p owns P_p consecutive programs (W_p weight tiles, then its bias blocks);
    # NUM layers are real, the others' arguments unused. The program picks its layer's
    # arguments, then runs the one copy of the loops: a copy per layer would hold its
    # own pipeline buffers in shared memory, and fewer programs would fit on an SM.
    t = tl.program_id(0)
    x_ptr, g_ptr, dw_ptr, db_ptr = x0_ptr, g0_ptr, dw0_ptr, db0_ptr
    K, M, N, sx, sg, W = K0, M0, N0, sx0, sg0, W0
    if NUM > 1:
        if t >= P0:
            t -= P0
            x_ptr, g_ptr, dw_ptr, db_ptr = x1_ptr, g1_ptr, dw1_ptr, db1_ptr
            K, M, N, sx, sg, W = K1, M1, N1, sx1, sg1, W1
            if NUM > 2:
                if t >= P1:
                    t -= P1
                    x_ptr, g_ptr, dw_ptr, db_ptr = x2_ptr, g2_ptr, dw2_ptr, db2_ptr
                    K, M, N, sx, sg, W = K2, M2, N2, sx2, sg2, W2
    if t < W:
        _weight_tile(t, x_ptr, g_ptr, dw_ptr, K, M, N, sx, sg, BLOCK_N, BLOCK_M, BLOCK_K, TF32)
    else:
        _bias_block(t - W, g_ptr, db_ptr, K, N, sg, BLOCK_B, BLOCK_K)


def _rows(t: torch.Tensor) -> torch.Tensor:
    # The kernel takes a row stride and assumes unit column stride.
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: an H100's count, so that it runs the GPU's tiles
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _tile(shapes: list[tuple[int, int, bool]], sms: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_M) for layers whose ``dW`` are (N, M) (and wanted or not)."""
    for bn, bm in _TILES:
        tiles = sum(triton.cdiv(n, bn) * triton.cdiv(m, bm) for n, m, w in shapes if w)
        if tiles >= sms:
            return bn, bm
    return _TILES[-1]


def _launch(problems: list[Problem]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """One launch for layers whose x share a dtype and whose g share one."""
    args, outs, shapes = [], [], []
    tf32 = True
    for x, g, weight, bias in problems:
        g2 = _rows(g[:, None] if g.dim() == 1 else g)
        x = _rows(x)
        (k, m), n = x.shape, g2.shape[1]
        if max(k * x.stride(0), k * g2.stride(0)) >= 2**31:
            raise ValueError(f"param_grads: x {tuple(x.shape)}, g {tuple(g2.shape)} pass int32")
        dw = torch.empty(n, m, dtype=torch.promote_types(x.dtype, g.dtype), device=g.device)
        db = torch.empty(n, dtype=g.dtype, device=g.device)
        shapes.append((n, m, weight))
        tf32 = tf32 and tf32_dots(x) and tf32_dots(g2)
        args.append([x, g2, dw, db, k, m, n, x.stride(0), g2.stride(0)])
        outs.append((dw if weight else None, db if bias else None))
    bn, bm = _tile(shapes, _sm_count(problems[0][1].device))
    total = 0
    for a, (n, m, weight), (_, _, _, bias) in zip(args, shapes, problems, strict=True):
        w_tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm) if weight else 0
        progs = w_tiles + (triton.cdiv(n, _BLOCK_B) if bias else 0)
        a += [w_tiles, progs]
        total += progs
    num = len(args)
    args += [args[0]] * (_MAX_PROBLEMS - num)
    flat = [v for a in args for v in a][:-1]  # the last layer's program count is implied
    if total:
        _param_grads_kernel[(total,)](
            *flat, NUM=num, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=_BLOCK_K, BLOCK_B=_BLOCK_B,
            TF32=tf32, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
        )  # fmt: skip
    return outs


def param_grads(problems: list[Problem]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """``(g^T x, g.sum(0))`` of up to three linear layers in one launch.

    Args:
        problems: ``(x, g, weight, bias)`` per layer: its input x (K, M), its output's
            gradient g (K, N), or (K,) for a one-output layer, and which of the two
            gradients are wanted. Floating dtypes, all on one device; layers whose
            dtypes differ from the first's take a launch of their own.

    Returns:
        Per layer ``(dW, db)``: dW (N, M) in the promoted dtype of x and g, or (1, M) for
        a 1-D g; db (N,) in g's dtype, or (1,) for a 1-D g; None where not wanted.
    """
    if not 0 < len(problems) <= _MAX_PROBLEMS:
        raise ValueError(f"param_grads takes 1 to {_MAX_PROBLEMS} layers, got {len(problems)}")
    # The kernel's pointers take one element type per role across its layers.
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (x, g, _, _) in enumerate(problems):
        groups.setdefault((x.dtype, g.dtype), []).append(i)
    outs: list = [None] * len(problems)
    for idx in groups.values():
        for i, out in zip(idx, _launch([problems[i] for i in idx]), strict=True):
            outs[i] = out
    return outs
