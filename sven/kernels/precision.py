"""The precision of the float32 products inside Sven's Triton kernels."""

from __future__ import annotations

import torch

__all__ = ["tf32_dots"]


def tf32_dots(x: torch.Tensor) -> bool:
    """Whether a kernel's float32 ``tl.dot`` on ``x`` runs on TF32 tensor cores.

    The kernels follow cuBLAS's setting (``torch.backends.cuda.matmul.allow_tf32``, set
    by ``train.matmul_precision``), so that one setting decides every float32 matrix
    product of a step, and ``highest`` keeps IEEE float32 products throughout. Inputs
    on the CPU (Triton's interpreter) run IEEE products.

    Args:
        x: A float tensor the kernel multiplies.
    """
    return x.dtype == torch.float32 and x.is_cuda and torch.backends.cuda.matmul.allow_tf32
