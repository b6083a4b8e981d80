"""The cosine of a float32 argument inside a Triton kernel, without libdevice's slow path.

``tl.cos`` is libdevice's ``cosf``: for ``|x|`` above 105,615 it reduces the argument
with the Payne-Hanek method, a loop over a table of the bits of 2/pi in local memory,
many times the cost of its fast path. The time encoding cos(dt w + b) meets such
arguments all the time: with TGN's frequencies (w from 1 down to 1e-9) a time gap of
more than about 1.2 days gives one at w = 1, and most neighbour slots of a batch have
one. In a warp one such lane makes every lane wait for it.

:func:`cos32` reduces the float32 argument by 2 pi in float64 (one multiply-add for the
quotient, a floor, one fused multiply-add for the remainder: the fp64 constant's own
error times the quotient stays below 1e-6 up to ``|x|`` = 1e10), then takes ``cosf`` of
the remainder (at most pi in size: its fast path). Against the correctly rounded
cosine of the same float32 argument the error is that of rounding the remainder to
float32, below 2.4e-7, and ``cosf``'s own. Beyond 1e10 the argument goes to ``cosf``
unreduced.

``SVEN_TRITON_COS=libdevice`` (read once, at import) makes :func:`cos32` plain
``tl.cos``, to time one against the other.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["REDUCED", "cos32"]

#: Whether :func:`cos32` reduces in float64 (``SVEN_TRITON_COS`` other than
#: ``libdevice``).
REDUCED = os.environ.get("SVEN_TRITON_COS", "reduced").strip().lower() != "libdevice"
_REDUCED = tl.constexpr(REDUCED)


@triton.jit
def cos32(x):
    """cos(x) of a float32 block, in float32 (see the module's docstring)."""
    if _REDUCED:
        xd = x.to(tl.float64)
        # The constants as float64 tensors: a bare Python float would enter as float32.
        k = tl.floor(xd * tl.full([], 0.15915494309189535, tl.float64) + 0.5)
        r = xd - k * tl.full([], 6.283185307179586, tl.float64)
        r = tl.where(tl.abs(xd) < 1.0e10, r, xd)
        return tl.cos(r.to(tl.float32))
    else:
        return tl.cos(x)
