"""Adam's update of every parameter tensor in one launch of short programs (Triton).

torch's fused Adam on CUDA gives each block of 512 threads a chunk of up to 65,536
elements of one tensor: a model of a few hundred thousand parameters in a few dozen
tensors runs as a few dozen blocks, each walking its chunk in sequence, so the step
waits on one block's memory latency tens of times. Here every program updates
``BLOCK`` elements of one tensor: as many programs as the parameters need, each one
round of loads and stores.

The tensors are reached through a table of their addresses (parameter, gradient, first
and second moments, step count, and element count per tensor), so one kernel serves
any list of tensors. The arithmetic follows torch's fused kernel
(``aten/src/ATen/native/cuda/fused_adam_utils.cuh``): the moments' updates and the
denominator's epsilon in double precision (torch's hyper-parameters are doubles there),
the bias corrections from the step count on the device, the rest in float32 with IEEE
square root and division. The reference, the CPU path and the oracle, is
``torch.optim.Adam`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

__all__ = ["AdamTables", "adam_step"]

#: Elements per program.
BLOCK = 1024


@triton.jit
def _adam_kernel(table_ptr, blocks_ptr, hyper_ptr, BLOCK: tl.constexpr, DECAY: tl.constexpr):
    b = tl.program_id(0)
    t = tl.load(blocks_ptr + 2 * b)
    lo = tl.load(blocks_ptr + 2 * b + 1)
    row = table_ptr + t * 6
    p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    s_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    n = tl.load(row + 5)
    lr = tl.load(hyper_ptr)
    beta1 = tl.load(hyper_ptr + 1)
    beta2 = tl.load(hyper_ptr + 2)
    eps = tl.load(hyper_ptr + 3)
    decay = tl.load(hyper_ptr + 4)
    step = tl.load(s_ptr).to(tl.float64)
    # 1 - beta ** step, as exp2(step log2(beta)) (log2(beta) from the host, in double).
    bc1 = (1.0 - tl.exp2(step * tl.load(hyper_ptr + 5))).to(tl.float32)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.load(hyper_ptr + 6))).to(tl.float32)
    offs = lo + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    param = tl.load(p_ptr + offs, mask=mask, other=0.0)
    grad = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if DECAY:
        grad = (grad.to(tl.float64) + param.to(tl.float64) * decay).to(tl.float32)
    g64 = grad.to(tl.float64)
    m = (beta1 * m.to(tl.float64) + (1.0 - beta1) * g64).to(tl.float32)
    v = (beta2 * v.to(tl.float64) + (1.0 - beta2) * g64 * g64).to(tl.float32)
    step_size = (lr / bc1.to(tl.float64)).to(tl.float32)
    denom = (tl.div_rn(tl.sqrt_rn(v), bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
    param = param - tl.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, param, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


class AdamTables:
    """The device tables of one parameter list: which tensor and where each program
    starts (fixed by the element counts), the hyper-parameters, and the tensors'
    addresses (a gradient may move between eager steps: one table per set of
    addresses, the last :attr:`LIMIT` kept).

    Inside a CUDA graph capture the gradients live at the graph's own addresses, so
    their table is made there: written into a slot of a pinned staging buffer (made by
    the eager calls before, since pinning cannot be captured) and copied from it by
    the graph, at every replay the same contents. Such a table is read by that capture
    only (it holds its values once the graph has run) and kept as long as this object.
    """

    #: Eager address tables kept.
    LIMIT = 16
    #: Address tables captures can make.
    SLOTS = 8

    def __init__(self) -> None:
        self._fixed: dict[tuple, torch.Tensor] = {}
        self._eager: dict[tuple, torch.Tensor] = {}
        self._captured: dict[tuple, torch.Tensor] = {}
        self._staging: torch.Tensor | None = None
        self._staged = 0

    def blocks(self, numels: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
        """(programs, 2) int64: each program's tensor and first element; None inside a
        capture when no eager call made it."""

        def host() -> torch.Tensor:
            pairs = [(t, lo) for t, n in enumerate(numels) for lo in range(0, n, BLOCK)]
            return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)

        return self._fixed_table(("blocks", numels), host, device)

    def hyper(self, values: tuple[float, ...], device: torch.device) -> torch.Tensor | None:
        """(7,) float64: lr, beta1, beta2, eps, weight decay, log2(beta1), log2(beta2);
        None inside a capture when no eager call made it."""

        def host() -> torch.Tensor:
            lr, beta1, beta2, eps, decay = values
            logs = [math.log2(beta1), math.log2(beta2)]
            return torch.tensor([lr, beta1, beta2, eps, decay, *logs], dtype=torch.float64)

        return self._fixed_table(("hyper", *values), host, device)

    def addresses(self, rows: list[tuple[int, ...]], device: torch.device) -> torch.Tensor | None:
        """(tensors, 6) int64: the address table of ``rows``; None inside a capture when
        the staging buffer is missing or full."""
        key = tuple(x for r in rows for x in r)
        if _capturing(device):
            out = self._captured.get(key)
            return self._stage(key, len(rows), device) if out is None else out
        if device.type == "cuda" and self._staging is None:
            self._staging = torch.zeros((self.SLOTS, len(key)), dtype=torch.int64).pin_memory()
        out = self._eager.get(key)
        if out is None:
            if len(self._eager) >= self.LIMIT:
                del self._eager[next(iter(self._eager))]
            out = self._eager[key] = torch.tensor(rows, dtype=torch.int64).to(device)
        return out

    def _stage(self, key: tuple[int, ...], n: int, device: torch.device) -> torch.Tensor | None:
        """A captured copy of the table ``key`` (n rows) from the next staging slot."""
        staging = self._staging
        if staging is None or self._staged >= staging.shape[0] or len(key) > staging.shape[1]:
            return None
        slot = staging[self._staged, : len(key)]
        slot.copy_(torch.tensor(key, dtype=torch.int64))
        self._staged += 1
        out = torch.empty((n, len(key) // n), dtype=torch.int64, device=device)
        out.view(-1).copy_(slot, non_blocking=True)
        self._captured[key] = out
        return out

    def _fixed_table(
        self, key: tuple, host: Callable[[], torch.Tensor], device: torch.device
    ) -> torch.Tensor | None:
        out = self._fixed.get(key)
        if out is None and not _capturing(device):
            out = self._fixed[key] = host().to(device)
        return out


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def adam_step(
    tables: AdamTables,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> bool:
    """One Adam step (``torch.optim.Adam`` without amsgrad or maximize, float32) of
    every tensor in place, the step counts first (as torch's fused step does).

    Args:
        tables: The parameter list's cached tables.
        params: float32 contiguous parameters, all on one device.
        grads: Their gradients (same shapes, float32, contiguous).
        exp_avgs: First moments.
        exp_avg_sqs: Second moments.
        steps: () float32 step counts on the device.
        lr, beta1, beta2, eps, weight_decay: Adam's hyper-parameters.

    Returns:
        False, with nothing changed, inside a CUDA graph capture whose tables no eager
        call prepared (the caller then runs torch's step); True otherwise.
    """
    if not params:
        return True
    device = params[0].device
    rows = [
        (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), s.data_ptr(), p.numel())
        for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps)
    ]
    blocks = tables.blocks(tuple(p.numel() for p in params), device)
    hyper = tables.hyper((lr, beta1, beta2, eps, weight_decay), device)
    table = tables.addresses(rows, device)
    if blocks is None or hyper is None or table is None:
        return False
    torch._foreach_add_(steps, 1)
    _adam_kernel[(blocks.shape[0],)](
        table, blocks, hyper, BLOCK=BLOCK, DECAY=weight_decay != 0
    )  # fmt: skip
    return True
