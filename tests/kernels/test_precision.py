"""Which float32 products of the Triton kernels run on TF32 (sven.kernels.precision):
cuBLAS's setting decides, on CUDA float32 inputs only."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from sven.kernels.precision import tf32_dots


@contextmanager
def _tf32(on: bool) -> Iterator[None]:
    """cuBLAS's TF32 setting, as ``train.matmul_precision`` sets it, for a block."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_cpu_inputs_take_ieee_products_whatever_the_setting() -> None:
    with _tf32(True):
        assert not tf32_dots(torch.zeros(2, dtype=torch.float32))
        assert not tf32_dots(torch.zeros(2, dtype=torch.float16))


@pytest.mark.gpu
def test_cuda_float32_follows_cublas_setting() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.zeros(2, device="cuda")
    with _tf32(True):
        assert tf32_dots(x) and not tf32_dots(x.half())
    with _tf32(False):
        assert not tf32_dots(x)
