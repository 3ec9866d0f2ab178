"""The numba source of :mod:`pytreeio.kernels` (importing this module imports numba).

Every kernel is compiled on first call without the GIL and cached on disk
where a cache can be written (see :func:`_jit`).
"""

from __future__ import annotations

import warnings
from typing import Any

import numba
import numpy as np

#: Tile edge of the transposing kernels (a multiple of 4): a 32x32 tile of
#: 8-byte values and its output (16 KB) stay in L1, whatever the row strides.
TILE = 32

#: The largest double below 0.5 (see :func:`_q_round`).
_BELOW_HALF = 0.49999999999999994


def _jit(fn: Any) -> Any:
    """``fn`` compiled without the GIL, cached on disk where a cache can be written."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a cache that cannot be written is not an error
            return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # "no locator available": read-only install and no user cache dir
        return numba.njit(nogil=True)(fn)


_inline = numba.njit(nogil=True, inline="always")


@_inline
def _q_trunc(x: float, scale: float) -> float:
    return np.trunc(np.float64(x) * scale)


@_inline
def _q_round(x: float, scale: float) -> float:
    # trunc(v + copysign(0.5 - 2**-54, v)) is v rounded half away from zero for every
    # double (with 0.5 itself, v = 0.5 - 2**-54 would become 1): one add, no select
    v = np.float64(x) * scale
    return np.trunc(v + np.copysign(_BELOW_HALF, v))


# The range check is `lo <= t <= hi` on the float64 result (NaN fails it), counted in
# the same loop; the store goes through i32 (the narrow conversions do not vectorise),
# so values that do not fit are stored as arbitrary values.


@_jit
def quantise_trunc(x: Any, out: Any, scale: float, lo: float, hi: float) -> int:
    bad = 0
    for i in range(x.size):
        t = _q_trunc(x[i], scale)
        bad += not ((t >= lo) & (t <= hi))
        out[i] = np.int32(t)
    return bad


@_jit
def quantise_round(x: Any, out: Any, scale: float, lo: float, hi: float) -> int:
    bad = 0
    for i in range(x.size):
        t = _q_round(x[i], scale)
        bad += not ((t >= lo) & (t <= hi))
        out[i] = np.int32(t)
    return bad


@_inline
def _edge(a: Any, out: Any, i0: int, i1: int, j0: int, j1: int) -> None:
    for i in range(i0, i1):
        for j in range(j0, j1):
            out[i, j] = a[j, i]


@_jit
def transpose_rows(a: Any, out: Any, start: int, stop: int) -> None:
    """``out[i, j] = a[j, i]`` for the rows ``i`` of ``out`` in ``[start, stop)``.

    Whole tiles go in 4x4 blocks (four short row loads, four short row
    stores): about twice a plain tiled loop.
    """
    cols = out.shape[1]
    for i0 in range(start, stop, TILE):
        i1 = min(i0 + TILE, stop)
        for j0 in range(0, cols, TILE):
            j1 = min(j0 + TILE, cols)
            if i1 - i0 < TILE or j1 - j0 < TILE:
                _edge(a, out, i0, i1, j0, j1)
                continue
            for ib in range(i0, i1, 4):
                for jb in range(j0, j1, 4):
                    for i in range(ib, ib + 4):
                        for j in range(jb, jb + 4):
                            out[i, j] = a[j, i]
