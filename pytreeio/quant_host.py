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
float32 with an FMA remainder where exact, float64 elsewhere; a transposed
result in one fused pass, :func:`pytreeio.kernels.quantise_transposed`;
about three times as fast); ``PYTREEIO_NO_NUMBA=1`` keeps the numpy blocks.

:class:`Bands` streams quantisation ahead of a file writer (bullet's
quantised.bin): bands of about :data:`BAND_BYTES`, each computed on one
thread (a producer thread of its own, or the writer when it would otherwise
wait), into a bounded set of reused buffers.  A transposed array's bands are
rows of its transpose: the input's columns, quantised and transposed in
tiles (the fused kernel), or by numpy quantised row by row and then
transposed as 1-4 byte values, which is cheaper than transposing float32.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import kernels
from .pools import start_daemon
from .transpose import copy_transposed, pool, threads

__all__ = ["BLOCK", "quantise", "min_max", "BandJob", "Bands"]

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
    """One thread's block buffers (allocated once per call and thread) for blocks of up to ``n`` values."""

    def __init__(self, n: int = BLOCK) -> None:
        self.n = min(n, BLOCK)  # a small array's call allocates no ~0.6 MB it does not use
        self.p = np.empty(self.n, np.float32)
        self.t = np.empty(self.n, np.float32)
        self.flags = np.empty(self.n, np.bool_)
        self._wide: tuple[np.ndarray, np.ndarray] | None = None

    def wide(self) -> tuple[np.ndarray, np.ndarray]:
        if self._wide is None:
            self._wide = (np.empty(self.n, np.float64), np.empty(self.n, np.float64))
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
    if len(los) == 1:  # one block (every small array): no array of the extremes to build
        return float(los[0]), float(his[0])
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
    if transpose_:
        return _compiled_transposed(x, scale, dtype, round_)
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
    return out, lo, hi


#: Columns of the input (rows of a transposed result) per share of the compiled
#: kernel's work: its tile width, less where that would leave a core idle.
_TRANSPOSED_COLUMNS = 1024


def _compiled_transposed(
    x: np.ndarray,
    scale: int,
    dtype: np.dtype[Any],
    round_: bool,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, float, float]:
    """The quantised transpose of 2-D ``x`` in one fused pass, bands of its rows on every core.

    Into ``out`` (C-contiguous, ``x``'s transposed shape, ``dtype``) when
    given, else into a new array aligned for non-temporal stores.
    """
    rows, cols = x.shape
    result = (
        aligned_empty(x.size * dtype.itemsize).view(dtype).reshape(cols, rows)
        if out is None
        else out
    )
    width = min(_TRANSPOSED_COLUMNS, -(-cols // _PARALLEL_BLOCKS) // 64 * 64 or 64)
    starts = range(0, cols, width)

    def work(share_: range) -> tuple[float, float]:
        scratch = kernels.transposed_scratch(dtype)
        bad = 0
        for i in share_:
            c0, c1 = starts[i], min(starts[i] + width, cols)
            bad += kernels.quantise_transposed(x, c0, c1, result[c0:c1], scratch, scale, round_)
        return (np.nan, np.nan) if bad else (0.0, 0.0)

    lo, hi = _run(len(starts), work)
    return result, lo, hi


def aligned_empty(nbytes: int, align: int = 64) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` starting at a multiple of ``align`` bytes.

    numpy aligns data to 16 bytes; the compiled transposes write whole
    64-byte cache lines with non-temporal stores only where rows start on one.
    """
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes]


def _blocks(
    x: np.ndarray, scale: int, dtype: np.dtype[Any], *, round_: bool, checked: bool
) -> tuple[np.ndarray, float, float]:
    """:func:`quantise` by numpy in blocks (no transpose)."""
    out = np.empty(x.shape, dtype)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    starts = range(0, flat_x.size, BLOCK)
    in_range = checked and dtype.itemsize < 4  # i8/i16 values that fit are below 2**22

    def work(share: range) -> tuple[float, float]:
        s = _Scratch(flat_x.size)
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
    """``(x.min(), x.max())`` of a C-contiguous array, block by block on every core (one read of memory).

    Large native float32 arrays go through the compiled kernel (one pass of
    integer min/max over the bits, about twice as fast as numpy's ``min`` and
    ``max`` per block).
    """
    flat = x.reshape(-1)
    n = flat.size
    compiled = x.dtype == np.dtype("=f4") and kernels.use(x.nbytes)
    if 0 < n <= BLOCK and not compiled:  # one block: on this thread, as _run would
        return float(flat.min()), float(flat.max())
    block = _COMPILED_BLOCK if compiled else BLOCK
    starts = range(0, n, block)

    def work(share: range) -> tuple[float, float]:
        blocks = [flat[starts[i] : starts[i] + block] for i in share]
        if compiled:
            pairs = [kernels.min_max(b) for b in blocks]
            return _extremes([p[0] for p in pairs], [p[1] for p in pairs])
        return _extremes([float(b.min()) for b in blocks], [float(b.max()) for b in blocks])

    return _run(len(starts), work)


# --------------------------------------------------------------------------
# bands: quantisation streamed ahead of a file writer
# --------------------------------------------------------------------------

#: Bytes of quantised output per band: large enough that a band's Python
#: overhead is small next to its work, small enough to stay in the caches
#: between the thread that computes it and the writer that copies it out.
BAND_BYTES = 1 << 20

#: Bytes of bands computed ahead of the writer (the buffers, reused).  While
#: the writer writes other files (bullet's raw.bin) one core fills them;
#: more would let that core do more of the work early, but bands computed
#: long before they are written are read back from memory rather than the
#: caches (measured: half the output ahead cost ~10% more CPU in all).
AHEAD_BYTES = 32 << 20

#: A transposed band's rows are a multiple of this where the band is wider
#: (whole tiles of the compiled transpose).
_BAND_ROWS = 256

#: Transposed bands are this many times :data:`BAND_BYTES`: a band reads a
#: piece of every row of the input, and pieces under ~4 KB (1024 float32)
#: read from memory at half speed (each is a new stream for the prefetcher).
#: Measured (4096 x 16384 f32 to i16, two threads): 2 -> 3.4 GB/s, 4 -> 4.4,
#: 8 -> 4.9, 16 -> 4.6.
_TRANSPOSED_WIDER = 8


@dataclass(frozen=True)
class BandJob:
    """One array to quantise: C-contiguous float32, already range-checked."""

    x: np.ndarray
    scale: int
    dtype: np.dtype[Any]
    round_: bool
    transpose_: bool = False


@dataclass(frozen=True)
class _Band:
    job: int
    start: int  # elements of the flat array, or (transposed) rows of the result
    stop: int
    nbytes: int


class _State:
    """What the producer thread and the consumer share (the consumer's object owns it)."""

    def __init__(self, jobs: Sequence[BandJob], bands: list[_Band], capacity: int) -> None:
        self.jobs = jobs
        self.bands = bands
        self.buffer_bytes = max((b.nbytes for b in bands), default=0)
        self.capacity = capacity  # buffers owned at most
        self.cond = threading.Condition()
        self.claimed = [False] * len(bands)
        self.next = 0  # no band below it is unclaimed
        self.done: dict[int, np.ndarray | BaseException] = {}
        self.free: list[np.ndarray] = []
        self.lent: list[np.ndarray] = []
        self.owned = 0
        self.closed = False
        self.scratch = threading.local()

    def claim(self) -> tuple[int, np.ndarray] | None:
        """The next unclaimed band and a buffer for it (holding the lock), or None."""
        while self.next < len(self.bands) and self.claimed[self.next]:
            self.next += 1
        if self.next == len(self.bands):
            return None
        buf = self.buffer()
        if buf is None:
            return None
        b = self.next
        self.claimed[b] = True
        self.next += 1
        return b, buf

    def buffer(self, force: bool = False) -> np.ndarray | None:
        """A free buffer, a new one while fewer than ``capacity`` exist (or ``force``), else None."""
        if self.free:
            return self.free.pop()
        if self.owned >= self.capacity and not force:
            return None
        self.owned += 1
        return np.empty(self.buffer_bytes, np.uint8)

    def recycle(self) -> None:
        """Buffers handed out that nobody references any more go back to the free list (lock held).

        The writer drops a band before it takes the next; a buffer still
        referenced elsewhere (a caller keeping the bytes) is left to its holder.
        """
        for _ in range(len(self.lent)):
            buf = self.lent.pop()
            if sys.getrefcount(buf) <= 2 and self.owned <= self.capacity:
                self.free.append(buf)  # referenced by this name and getrefcount's argument only
            else:
                self.owned -= 1
            del buf

    def compute(self, b: int, buf: np.ndarray) -> np.ndarray:
        """Band ``b`` into ``buf`` (any thread, no lock held); returns its bytes."""
        band = self.bands[b]
        job = self.jobs[band.job]
        out = buf[: band.nbytes].view(job.dtype)
        compiled = job.x.dtype == np.dtype("=f4") and kernels.use(job.x.nbytes)
        if job.transpose_:
            self._transposed(job, band, out, compiled)
        else:
            flat = job.x.reshape(-1)[band.start : band.stop]
            _into(flat, out, job.scale, job.round_, compiled)
        return buf[: band.nbytes]

    def _transposed(self, job: BandJob, band: _Band, out: np.ndarray, compiled: bool) -> None:
        """Rows ``start:stop`` of ``x.T`` quantised (columns of ``x``): fused, or quantised into scratch and transposed."""
        rows, width = job.x.shape[0], band.stop - band.start
        out = out.reshape(width, rows)
        if compiled:
            scratch = getattr(self.scratch, "tile", None)
            if scratch is None or scratch.dtype != job.dtype:
                scratch = self.scratch.tile = kernels.transposed_scratch(job.dtype)
            kernels.quantise_transposed(
                job.x, band.start, band.stop, out, scratch, job.scale, job.round_
            )
            return
        scratch = getattr(self.scratch, "buf", None)
        if scratch is None or scratch.nbytes < rows * width * job.dtype.itemsize:
            scratch = self.scratch.buf = np.empty(self.buffer_bytes, np.uint8)
        tmp = scratch[: rows * width * job.dtype.itemsize].view(job.dtype).reshape(rows, width)
        cols = np.ascontiguousarray(job.x[:, band.start : band.stop])
        _into(cols.reshape(-1), tmp.reshape(-1), job.scale, job.round_, False)
        copy_transposed(tmp.T, out, parallel=False)


def _into(x: np.ndarray, out: np.ndarray, scale: int, round_: bool, compiled: bool) -> None:
    """Quantise the 1-D ``x`` (values known to fit) into ``out`` on the calling thread."""
    if compiled:
        kernels.quantise(x, out, scale, round_)
        return
    s = _Scratch(x.size)
    in_range = out.dtype.itemsize < 4  # i8/i16 values that fit are below 2**22
    with np.errstate(all="ignore"):
        for at in range(0, x.size, BLOCK):
            _block(x[at : at + BLOCK], out[at : at + BLOCK], scale, round_, in_range, s)


def _produce(state: _State) -> None:
    """The producer thread: claims bands in order while buffers are free, until all are claimed."""
    while True:
        with state.cond:
            claim = None
            while not state.closed and (claim := state.claim()) is None:
                if state.next == len(state.bands):
                    return
                state.cond.wait()
            if claim is None:
                return
        b, buf = claim
        result: np.ndarray | BaseException
        try:
            result = state.compute(b, buf)
        except BaseException as exc:  # handed to the consumer, which raises it
            result = exc
        del buf
        with state.cond:
            state.done[b] = result
            state.cond.notify_all()
        del result


class Bands:
    """Quantised arrays in bands of about :data:`BAND_BYTES`, computed ahead of a writer.

    A thread of its own computes bands in order into at most
    :data:`AHEAD_BYTES` of buffers, which are reused: :meth:`take` of band
    ``k`` returns its bytes and gets back the buffer of the band taken before
    it (a writer drops a chunk before producing the next), so memory stays
    bounded and the pages are faulted in once.  When the writer takes a band
    that is not ready it computes bands itself rather than wait (both cores
    quantise while the writer would idle).  Values are :func:`quantise`'s, bit
    for bit: every element is computed on its own, bands only split the work.
    A transposed job's bands are rows of the transposed result: columns of
    the input quantised, then transposed as 1-4 byte values.
    """

    def __init__(
        self,
        jobs: Sequence[BandJob],
        *,
        band_bytes: int | None = None,
        ahead_bytes: int | None = None,
    ) -> None:
        band_bytes = BAND_BYTES if band_bytes is None else band_bytes
        bands: list[_Band] = []
        self.of_job: list[range] = []  # band indices of each job
        for j, job in enumerate(jobs):
            first = len(bands)
            size = job.dtype.itemsize
            if job.transpose_:
                rows, cols = job.x.shape
                wide = band_bytes * _TRANSPOSED_WIDER
                step = max(1, wide // max(1, rows * size))
                step = step // _BAND_ROWS * _BAND_ROWS or step
                bands += [
                    _Band(j, c, min(c + step, cols), (min(c + step, cols) - c) * rows * size)
                    for c in range(0, cols, step)
                ]
            else:
                n = job.x.size
                step = max(1, band_bytes // size)
                bands += [
                    _Band(j, at, min(at + step, n), (min(at + step, n) - at) * size)
                    for at in range(0, n, step)
                ]
            self.of_job.append(range(first, len(bands)))
        ahead_bytes = AHEAD_BYTES if ahead_bytes is None else ahead_bytes
        biggest = max((b.nbytes for b in bands), default=1)
        self._state = _State(list(jobs), bands, max(2, ahead_bytes // max(1, biggest)))
        self._taken = [False] * len(bands)
        self._left = len(bands)
        self._started = False

    def nbytes(self, band: int) -> int:
        return self._state.bands[band].nbytes

    def start(self) -> None:
        """Start computing ahead (on a thread that ends when every band is computed)."""
        if self._started or not self._state.bands:
            return
        self._started = True
        state = self._state
        # no thread once the interpreter exits: the taker then computes every band itself
        if start_daemon(_produce, "pytreeio-bands", state) is not None:
            weakref.finalize(self, _close, state)

    def take(self, b: int) -> np.ndarray:
        """Band ``b``'s bytes (uint8); the buffer is reused once the caller drops it."""
        state = self._state
        if self._taken[b]:  # produced again (an encoding written twice): compute it anew
            return state.compute(b, np.empty(state.bands[b].nbytes, np.uint8))
        self._taken[b] = True
        self._left -= 1
        self.start()
        with state.cond:
            state.recycle()
            state.cond.notify_all()
            try:
                return self._wait_or_help(b)
            finally:
                if not self._left:  # the last band: nothing will reuse the buffers
                    state.owned -= len(state.free)
                    state.free.clear()

    def _wait_or_help(self, b: int) -> np.ndarray:
        """Band ``b`` once computed; meanwhile this thread computes the next free bands (lock held)."""
        state = self._state
        while b not in state.done:
            if not state.claimed[b]:  # not started (taken out of order): computed here
                state.claimed[b] = True
                buf = state.buffer(force=True)
                assert buf is not None
                claim: tuple[int, np.ndarray] | None = (b, buf)
                del buf
            else:  # computing on the producer thread: help with the next band meanwhile
                claim = state.claim()
            if claim is None:
                state.cond.wait()
                continue
            state.cond.release()
            result: np.ndarray | BaseException
            try:
                result = state.compute(*claim)
            except BaseException as exc:
                result = exc
            finally:
                state.cond.acquire()
            state.done[claim[0]] = result
            state.cond.notify_all()
            del claim, result
        got = state.done.pop(b)
        if isinstance(got, BaseException):
            raise got
        state.lent.append(got.base if got.base is not None else got)
        return got


def _close(state: _State) -> None:
    """The consumer is gone: the producer stops claiming bands."""
    with state.cond:
        state.closed = True
        state.cond.notify_all()
