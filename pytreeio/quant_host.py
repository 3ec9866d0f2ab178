"""Quantisation on the host: numpy in cache-sized blocks on every core, float32 where that is exact.

:func:`pytreeio.quant.quantise` defines ``q = trunc(Q*x)`` (or ``Q*x``
rounded half away from zero) on the float64 product.  When jax computes on
the CPU this module computes the same bits without jax: no copy of the input
into jax's buffers, and float32 arithmetic (twice the SIMD width of float64,
half the bytes) wherever it provably gives the float64 answer.

Why float32 is exact here (``Q`` an integer below ``2**24``, so a float32;
``|Q*x| < 2**22``, checked per block from its minimum and maximum):
``p = fl32(Q*x)`` is the float32 nearest to the real product.  ``trunc`` only
changes value at integers and half-away rounding only at half-integers, and
every integer and half-integer below ``2**22`` is a float32.  If one lay
strictly between ``Q*x`` and ``p`` it would be a float32 nearer to ``Q*x``
than ``p``; so ``trunc(Q*x) == trunc(p)`` unless ``p`` *is* an integer, and
``round(Q*x) == rint(p)`` unless ``p`` is a half-integer (``rint`` rounds
ties to even; elsewhere it agrees with half-away rounding).  Those elements,
rare in real data, are recomputed from the float64 product, which is exact
(a 24-bit significand times a 24-bit scale).  Blocks where the bound fails
(``i32`` with large values, huge scales, values out of range) are computed in
float64 throughout, as the definition says.  Flush-to-zero would not matter:
it only touches products far below 1, whose ``q`` is 0 either way.

One pass over memory: a block (:data:`BLOCK` values) is read into the cache
once and every step (min/max for the range check, scale, round, fix-ups,
cast) runs on it there; numpy releases the GIL in each step, so blocks go to
:func:`pytreeio.transpose.pool`'s threads.  (Transposes are left to
:func:`pytreeio.transpose.copy_transposed` on the 1-4 byte result: numpy
scaling a transposed tile, or casting into one, runs at a fifth of the speed.)

Where numba is installed, arrays of :data:`pytreeio.kernels.MIN_BYTES` or
more go through compiled kernels instead (one vectorised loop per element,
float32 with an FMA remainder where exact, float64 elsewhere, then the
compiled transpose; about three times as fast);
``PYTREEIO_NO_NUMBA=1`` keeps the numpy blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import kernels
from .transpose import copy_transposed, pool, threads

__all__ = ["BLOCK", "quantise", "min_max"]

#: float32 values per block: the block and its scratch arrays (~15 bytes per
#: value, ~1 MB) stay in the caches; large enough that the ~15 numpy calls
#: per block cost little next to the work.
BLOCK = 1 << 16

#: Below this many blocks the work stays on the calling thread.
_PARALLEL_BLOCKS = 4

#: Above this share of flagged elements a block is recomputed in float64 as a whole
#: (cheaper than the gather/scatter; an all-zero block flags everything when truncating).
_FIXUP_SHARE = 1 / 16

#: float32 is exact for |Q*x| below this (every integer and half-integer below it is a float32).
_F32_EXACT = float(2**22)


class _Scratch:
    """One thread's block buffers (allocated once per call and thread)."""

    def __init__(self) -> None:
        self.p = np.empty(BLOCK, np.float32)
        self.t = np.empty(BLOCK, np.float32)
        self.flags = np.empty(BLOCK, np.bool_)
        self._wide: tuple[np.ndarray, np.ndarray] | None = None

    def wide(self) -> tuple[np.ndarray, np.ndarray]:
        if self._wide is None:
            self._wide = (np.empty(BLOCK, np.float64), np.empty(BLOCK, np.float64))
        return self._wide


def _exact(x: np.ndarray, scale64: np.float64, round_: bool) -> np.ndarray:
    """The definition on a few float32 values: float64 product, trunc or half-away rounding.

    For the flagged elements of the float32 path only: there ``Q < 2**24``
    (the product is exact) and ``0.5 <= |Q*x| < 2**22``, where ``v + 0.5``
    is exact too (at most 49 significant bits).
    """
    v = x.astype(np.float64) * scale64
    if round_:
        v += np.copysign(0.5, v)
    return np.trunc(v)


def _block_f64(
    src: np.ndarray, dst: np.ndarray, scale64: np.float64, round_: bool, s: _Scratch
) -> None:
    """The definition, in float64 throughout (any scale and value; garbage only where it would not fit)."""
    n = src.size
    v, t = (b[:n] for b in s.wide())
    flags = s.flags[:n]
    np.multiply(src, scale64, out=v)
    np.trunc(v, out=t)
    if round_:
        np.subtract(v, t, out=v)  # the fraction, exact
        np.greater_equal(v, 0.5, out=flags)
        np.add(t, flags, out=t)
        np.less_equal(v, -0.5, out=flags)
        np.subtract(t, flags, out=t)
    np.copyto(dst, t, casting="unsafe")


def _block(
    src: np.ndarray,
    dst: np.ndarray,
    scale: int,
    round_: bool,
    in_range: bool,
    s: _Scratch,
) -> tuple[float, float]:
    """Quantise one block into ``dst``; returns its (min, max) (NaN when it holds one).

    ``in_range``: the caller knows every ``|Q*x|`` is below :data:`_F32_EXACT`
    (checked before), so the min/max are not needed to pick the float32 path.
    """
    scale64 = np.float64(scale)
    if in_range:
        lo = hi = 0.0
        fast = abs(scale) < 2**24
    else:
        lo, hi = float(src.min()), float(src.max())
        # float64, exact for the scales that can take the float32 path (< 2**24)
        bound = max(abs(lo), abs(hi)) * abs(float(scale))
        fast = abs(scale) < 2**24 and bound < _F32_EXACT  # False for NaN
    if not fast:
        _block_f64(src, dst, scale64, round_, s)
        return lo, hi
    n = src.size
    p, t, flags = s.p[:n], s.t[:n], s.flags[:n]
    np.multiply(src, np.float32(scale), out=p)
    if round_:
        np.rint(p, out=t)
        np.subtract(p, t, out=p)  # p is not needed any more: |p - rint(p)| in its place
        np.abs(p, out=p)
        np.equal(p, 0.5, out=flags)  # ties of the float32 product
    else:
        np.trunc(p, out=t)
        np.equal(p, t, out=flags)  # integral float32 products (zeros included)
    n_flagged = int(np.count_nonzero(flags))
    if n_flagged > n * _FIXUP_SHARE:
        _block_f64(src, dst, scale64, round_, s)
        return lo, hi
    if n_flagged:
        where = np.flatnonzero(flags)
        t[where] = _exact(src[where], scale64, round_)
    np.copyto(dst, t, casting="unsafe")
    return lo, hi


def _chunks(n: int, parts: int) -> Iterator[range]:
    """``parts`` interleaved shares of ``range(n)`` (neighbouring blocks on different threads)."""
    for k in range(parts):
        yield range(k, n, parts)


def _run(n_blocks: int, work: Callable[[range], tuple[float, float]]) -> tuple[float, float]:
    """``work`` over shares of the blocks, on the pool and the calling thread; the overall (min, max)."""
    parts = threads() if n_blocks >= _PARALLEL_BLOCKS else 1
    shares = list(_chunks(n_blocks, parts))
    jobs = [pool().submit(work, share) for share in shares[1:]]
    results = []
    try:
        results.append(work(shares[0]))
    finally:
        for job in jobs:  # nobody may write into the output once we return
            results.append(job.result())
    return _extremes(*zip(*results))


def _extremes(los: Any, his: Any) -> tuple[float, float]:
    """The smallest of ``los`` and the largest of ``his``; NaN when any is (as numpy's min/max)."""
    if not len(los):
        return np.inf, -np.inf
    return float(np.min(los)), float(np.max(his))


def quantise(
    x: np.ndarray,
    scale: int,
    dtype: np.dtype[Any],
    *,
    round_: bool,
    checked: bool,
    transpose_: bool = False,
) -> tuple[np.ndarray, float, float]:
    """``x`` (C-contiguous float32) quantised, in its shape (``transpose_``: 2-D, transposed).

    Returns ``(q, lo, hi)``, ``lo`` and ``hi`` the min and max of ``x`` (any
    values whose quantised fit matches every value's).  ``checked``: every
    value is known to fit ``dtype`` (no min/max is taken, and the returned
    ones are 0.0).  Otherwise the caller must check the returned min/max and
    discard ``q`` if they do not fit: where they do not, ``q`` holds
    arbitrary values.  Large arrays go through the compiled kernels when numba
    is installed (:mod:`pytreeio.kernels`; the same bits): they check every
    value and return ``(0.0, 0.0)`` when all fit, NaNs when one does not.
    """
    if x.dtype == np.dtype("=f4") and kernels.use(x.nbytes):
        return _compiled(x, scale, dtype, round_, transpose_)
    q, lo, hi = _blocks(x, scale, dtype, round_=round_, checked=checked)
    if transpose_:
        out = np.empty(q.shape[::-1], q.dtype)
        copy_transposed(q.T, out)
        q = out
    return q, lo, hi


#: float32 values per share of the compiled kernel's work (4 MB of input).
_COMPILED_BLOCK = 1 << 20


def _compiled(
    x: np.ndarray, scale: int, dtype: np.dtype[Any], round_: bool, transpose_: bool
) -> tuple[np.ndarray, float, float]:
    """:func:`quantise` by the compiled kernels, shares of the output on every core."""
    out = np.empty(x.shape, dtype)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    starts = range(0, flat_x.size, _COMPILED_BLOCK)

    def part(i: int) -> int:
        at = slice(starts[i], starts[i] + _COMPILED_BLOCK)
        return kernels.quantise(flat_x[at], flat_out[at], scale, round_)

    def work(share_: range) -> tuple[float, float]:
        bad = sum(part(i) for i in share_)
        return (np.nan, np.nan) if bad else (0.0, 0.0)

    lo, hi = _run(len(starts), work)
    if transpose_:  # a second pass (the compiled transpose): faster than a fused loop
        q = np.empty(out.shape[::-1], dtype)
        copy_transposed(out.T, q)
        out = q
    return out, lo, hi


def _blocks(
    x: np.ndarray, scale: int, dtype: np.dtype[Any], *, round_: bool, checked: bool
) -> tuple[np.ndarray, float, float]:
    """:func:`quantise` by numpy in blocks (no transpose)."""
    out = np.empty(x.shape, dtype)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    starts = range(0, flat_x.size, BLOCK)
    in_range = checked and dtype.itemsize < 4  # i8/i16 values that fit are below 2**22

    def work(share: range) -> tuple[float, float]:
        s = _Scratch()
        los, his = [], []
        with np.errstate(all="ignore"):  # thread-local; NaN/inf/overflow only where the check fails
            for i in share:
                at = slice(starts[i], starts[i] + BLOCK)
                lo, hi = _block(flat_x[at], flat_out[at], scale, round_, in_range, s)
                los.append(lo)
                his.append(hi)
        return _extremes(los, his)

    lo, hi = _run(len(starts), work)
    return out, lo, hi


def min_max(x: np.ndarray) -> tuple[float, float]:
    """``(x.min(), x.max())`` of a C-contiguous array, block by block on every core (one read of memory)."""
    flat = x.reshape(-1)
    n = flat.size
    starts = range(0, n, BLOCK)

    def work(share: range) -> tuple[float, float]:
        blocks = [flat[starts[i] : starts[i] + BLOCK] for i in share]
        return _extremes([float(b.min()) for b in blocks], [float(b.max()) for b in blocks])

    return _run(len(starts), work)
