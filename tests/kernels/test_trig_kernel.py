"""``cos32``: the time encoding's cosine in Triton, its argument reduced in float64.

Against the float64 cosine of the same float32 argument (exact in float64): the
arguments libdevice's ``cosf`` reduces on its slow path (above 105,615), those of its
fast path, the bounds of 2 pi, and beyond 1e10 where ``cos32`` hands the argument to
``cosf`` unreduced. On CUDA this is libdevice's ``cosf`` on the remainder; under the
interpreter numpy's.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from sven.kernels.triton_trig import cos32  # noqa: E402


@triton.jit
def _cos_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o, mask=o < n, other=0.0)
    tl.store(y_ptr + o, cos32(x), mask=o < n)


def _cos(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    _cos_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    return y


def _arguments(device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    # dt w for time gaps of seconds to a month and TGN's frequencies 1 .. 1e-9, as the
    # encoders compute them (float32 product); then the edges.
    dt = torch.rand(64, generator=gen, dtype=torch.float64) * 3e6
    w = 1.0 / 10 ** torch.linspace(0, 9, 100, dtype=torch.float64)
    x = (dt.float()[:, None] * w.float()[None, :]).reshape(-1)
    k = torch.arange(-3, 4, dtype=torch.float64)
    edges = torch.cat(
        [
            k * math.pi,
            k * math.pi / 2,
            torch.tensor([0.0, 105614.0, 105616.0, 2.0**23, 2.0**24 + 2, 3.0e6, 9.9e9]),
            -torch.tensor([105616.0, 3.0e6]),
            torch.tensor([2 * math.pi * 4e5, 2 * math.pi * 4e5 + math.pi]),
        ]
    ).float()
    return torch.cat([x, edges]).to(device)


def test_cos32_matches_the_cosine_of_its_float32_argument(device: str) -> None:
    x = _arguments(device)
    got = _cos(x).double().cpu()
    want = torch.cos(x.double().cpu())
    err = (got - want).abs().max().item()
    # Rounding the remainder to float32 (at most pi: 2**-23 half an ulp) and cosf's
    # own rounding.
    assert err < 4e-7, err
    assert got.dtype == torch.float64 and torch.isfinite(got).all()


def test_cos32_beyond_its_range_is_the_cosine_unreduced(device: str) -> None:
    # Above 1e10 the float64 constant's error times the quotient would pass 1e-6: the
    # argument goes to cosf as it is (its slow path), as tl.cos would take it.
    x = torch.tensor([1.0e10, 3.3e12, -7.5e15, 1.0e30], device=device)
    got = _cos(x).double().cpu()
    want = torch.cos(x.double().cpu())
    assert (got - want).abs().max().item() < 4e-7


def _with_cos(value: str | None, code: str) -> subprocess.CompletedProcess:
    """``code`` run in a fresh interpreter with ``SVEN_TRITON_COS=value`` (unset: None)."""
    env = {k: v for k, v in os.environ.items() if k != "SVEN_TRITON_COS"}
    if value is not None:
        env["SVEN_TRITON_COS"] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("value", "reduced"),
    [(None, True), ("libdevice", False), ("LibDevice ", False), ("reduced", True), ("poly", True)],
)
def test_the_switch_is_read_from_the_environment_at_import(value, reduced) -> None:
    out = _with_cos(value, "from sven.kernels.triton_trig import REDUCED; print(REDUCED)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(reduced)


def test_an_unknown_way_is_refused_at_import() -> None:
    out = _with_cos("fast", "import sven.kernels.triton_trig")
    assert out.returncode != 0 and "SVEN_TRITON_COS must be one of" in out.stderr


# The polynomial's checks in a process of their own: the way is fixed at import. On
# CUDA where present (the fused multiply-adds there), else under the interpreter.
_POLY_CHECK = """
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from tests.kernels import test_trig_kernel as t
from sven.kernels import triton_trig
assert triton_trig.MODE == "poly"
dev = "cuda" if torch.cuda.is_available() else "cpu"
x = t._arguments(dev)
far = torch.tensor([1.0e10, 3.3e12, -7.5e14], device=dev)
huge = torch.tensor([1.0e30, -3.0e20], device=dev)
errs = [(t._cos(v).double().cpu() - torch.cos(v.double().cpu())).abs().max().item()
        for v in (x, far)]
out = t._cos(huge).cpu()
print(errs[0], errs[1], bool(torch.isfinite(out).all() and (out.abs() <= 1).all()))
"""


def test_cos32_by_polynomial_matches_the_cosine_of_its_float32_argument(device: str) -> None:
    # SVEN_TRITON_COS=poly: within 4e-7 of the float64 cosine of the float32 argument
    # over the time encoding's arguments and the edges, up to 1e15 too; past the range
    # its quotient holds, finite and within [-1, 1].
    out = _with_cos("poly", _POLY_CHECK)
    assert out.returncode == 0, out.stderr[-3000:]
    near, far, bounded = out.stdout.split()
    assert float(near) < 4e-7 and float(far) < 4e-7, out.stdout
    assert bounded == "True"
