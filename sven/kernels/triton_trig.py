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

``SVEN_TRITON_COS`` (read once, at import) chooses another way, to time one against
the other: ``libdevice`` makes :func:`cos32` plain ``tl.cos``; ``poly`` (an opt-in
until timed) reduces as above but with 2 pi as the sum of two float64 constants (exact
to about 1e-15 up to ``|x|`` = 1e15; past it the result is only held within [-1, 1]),
then takes the cosine without ``cosf``, as sin(pi/2 - |r|): the float64 remainder's
complement rounded once to float32 (within pi/2), then its Taylor polynomial to the
13th power (truncation below 7e-10). That is fewer instructions than ``cosf``'s fast
path with its quadrant logic, for the factored evaluation kernel, which is bound by
issuing instructions. Against the correctly rounded cosine the error is the float32
rounding of the complement (below 6e-8) and the polynomial's float32 arithmetic.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["MODE", "MODES", "REDUCED", "cos32"]

#: The ways :func:`cos32` may compute (``SVEN_TRITON_COS``; the module's docstring).
MODES = ("reduced", "libdevice", "poly")
#: This process's way (``SVEN_TRITON_COS``, default ``reduced``).
MODE = os.environ.get("SVEN_TRITON_COS", "reduced").strip().lower()
if MODE not in MODES:
    raise ValueError(f"SVEN_TRITON_COS must be one of {', '.join(MODES)}, got {MODE!r}")
#: Whether :func:`cos32` reduces in float64 (``SVEN_TRITON_COS`` other than
#: ``libdevice``).
REDUCED = MODE != "libdevice"
_REDUCED = tl.constexpr(REDUCED)
_POLY = tl.constexpr(MODE == "poly")


@triton.jit
def _turns(xd):
    """The nearest whole number of turns (2 pi) to the float64 block ``xd``."""
    # The constants as float64 tensors: a bare Python float would enter as float32.
    return tl.floor(xd * tl.full([], 0.15915494309189535, tl.float64) + 0.5)


@triton.jit
def _cos_poly(x):
    """cos(x) of a float32 block without libdevice (``SVEN_TRITON_COS=poly``)."""
    xd = x.to(tl.float64)
    k = _turns(xd)
    # 2 pi = hi + lo: the second product takes back the first constant's error, so the
    # remainder holds for any quotient a float64 counts exactly.
    r = tl.fma(-k, tl.full([], 6.283185307179586, tl.float64), xd)
    r = tl.fma(-k, tl.full([], 2.4492935982947064e-16, tl.float64), r)
    # cos(r) = sin(pi/2 - |r|), |pi/2 - |r|| <= pi/2.
    s = (tl.full([], 1.5707963267948966, tl.float64) - tl.abs(r)).to(tl.float32)
    # Past 1e15 the quotient is no longer exact and the remainder not within pi: held
    # to the polynomial's range, the result stays in [-1, 1] (not the cosine there).
    s = tl.minimum(tl.maximum(s, -1.5707963267948966), 1.5707963267948966)
    s2 = s * s
    p = 1.6059043836821613e-10
    p = p * s2 - 2.505210838544172e-08
    p = p * s2 + 2.7557319223985893e-06
    p = p * s2 - 0.0001984126984126984
    p = p * s2 + 0.008333333333333333
    p = p * s2 - 0.16666666666666666
    return s + s * (s2 * p)


@triton.jit
def cos32(x):
    """cos(x) of a float32 block, in float32 (see the module's docstring)."""
    if _POLY:
        return _cos_poly(x)
    elif _REDUCED:
        xd = x.to(tl.float64)
        k = _turns(xd)
        r = xd - k * tl.full([], 6.283185307179586, tl.float64)
        r = tl.where(tl.abs(xd) < 1.0e10, r, xd)
        return tl.cos(r.to(tl.float32))
    else:
        return tl.cos(x)
