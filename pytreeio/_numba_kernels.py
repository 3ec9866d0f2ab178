"""The numba source of :mod:`pytreeio.kernels` (importing this module imports numba).

Every kernel is compiled on first call without the GIL and cached on disk
where a cache can be written (see :func:`_jit`).
"""

from __future__ import annotations

import warnings
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

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


# The float64 kernels: the definition element by element, for any scale.  The range
# check is `lo <= t <= hi` on the float64 result (NaN fails it), counted in the same
# loop; the store goes through i32 (the narrow conversions do not vectorise), so
# values that do not fit are stored as arbitrary values.


@_inline
def _trunc64(x: Any, out: Any, scale: float, lo: float, hi: float) -> int:
    bad = 0
    for i in range(x.size):
        t = _q_trunc(x[i], scale)
        bad += not ((t >= lo) & (t <= hi))
        out[i] = np.int32(t)
    return bad


@_inline
def _round64(x: Any, out: Any, scale: float, lo: float, hi: float) -> int:
    bad = 0
    for i in range(x.size):
        t = _q_round(x[i], scale)
        bad += not ((t >= lo) & (t <= hi))
        out[i] = np.int32(t)
    return bad


@_jit
def quantise_trunc(x: Any, out: Any, scale: float, lo: float, hi: float) -> int:
    return _trunc64(x, out, scale, lo, hi)


@_jit
def quantise_round(x: Any, out: Any, scale: float, lo: float, hi: float) -> int:
    return _round64(x, out, scale, lo, hi)


# The float32 kernels, for integer scales 0 < Q < 2**24 (a float32; see
# pytreeio.quant_host for why float32 is exact there).  With p = fl32(Q*x) and
# t = trunc(p), the sign of a remainder such as Q*x - t is exact in
# fma(x, Q, -t) (one rounding, which keeps the sign and zero):
#   * trunc(Q*x) == t, except when p is an integer the real product lies short
#     of (Q*x - t has the opposite sign of x): then t - sign(x);
#   * Q*x rounded half away from zero is t + 1 if Q*x - t >= 0.5, t - 1 if
#     Q*x - t <= -0.5, else t (where t = p overshoots, |Q*x - t| < 0.25 and t
#     is the answer anyway).  f itself cannot decide `>= 0.5` (a remainder just
#     below it may round to 0.5): the sign of fma(x, Q, -(t + 0.5)) can (t + 0.5
#     is exact).
# This holds while |p| <= 2**22 (every integer and half-integer up to it is a
# float32); larger products, NaN and inf come out with |q| >= 2**22 (cvttps2dq
# gives INT_MIN for NaN and overflow).  Each chunk keeps the min and max of its
# int32 results instead of counting (no 64-bit widening in the vector loop):
# a chunk whose extremes leave [max(lo, -LIMIT), min(hi, LIMIT)] is redone by
# the float64 loop, which counts exactly.  Every step vectorises (ymm, no
# branch in the loop).

#: float32 values per chunk of the float32 kernels: 16 KB of input, 8 KB of i16 output (in L1).
CHUNK = 4096

#: The largest |q| the float32 kernels accept without redoing a chunk in float64.
F32_LIMIT = float(2**22 - 1)

_HALF = np.float32(0.5)
_ONE = np.float32(1.0)


def _fma32_typer(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``a*b + c`` with one rounding (llvm.fma: the FMA instruction, or libm's fmaf)."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fnty = ir.FunctionType(f32, [f32, f32, f32])
        return builder.call(
            cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.f32"), args
        )

    return types.float32(types.float32, types.float32, types.float32), codegen


_fma32: Any = intrinsic(_fma32_typer)


@_inline
def _t32(xi: Any, q: Any) -> Any:
    t = np.trunc(xi * q)
    f = _fma32(xi, q, -t)
    return np.int32(t - np.copysign(_ONE, xi) if f * xi < 0 else t)


@_inline
def _r32(xi: Any, q: Any) -> Any:
    ti = np.int32(xi * q)  # cvttps2dq: trunc(p)
    t = np.float32(ti)
    up = _fma32(xi, q, -(t + _HALF)) >= 0  # Q*x - t >= 0.5, decided on an exact sign
    down = _fma32(xi, q, -(t - _HALF)) <= 0
    return np.int32(ti + np.int32(up) - np.int32(down))


@_inline
def _trunc32(x: Any, out: Any, q: Any) -> tuple[Any, Any]:
    lo = np.int32(2**31 - 1)
    hi = np.int32(-(2**31))
    for i in range(x.size):
        r = _t32(x[i], q)
        lo = min(lo, r)
        hi = max(hi, r)
        out[i] = r
    return lo, hi


@_inline
def _round32(x: Any, out: Any, q: Any) -> tuple[Any, Any]:
    lo = np.int32(2**31 - 1)
    hi = np.int32(-(2**31))
    for i in range(x.size):
        r = _r32(x[i], q)
        lo = min(lo, r)
        hi = max(hi, r)
        out[i] = r
    return lo, hi


@_inline
def _f32_chunks(x: Any, out: Any, scale: float, lo: float, hi: float, round_: bool) -> int:
    """The float32 loop chunk by chunk; a chunk holding a value it cannot place is redone in float64."""
    q = np.float32(scale)
    lo32, hi32 = max(lo, -F32_LIMIT), min(hi, F32_LIMIT)
    bad = 0
    for c in range(0, x.size, CHUNK):
        xc, oc = x[c : c + CHUNK], out[c : c + CHUNK]
        a, b = _round32(xc, oc, q) if round_ else _trunc32(xc, oc, q)
        if a < lo32 or b > hi32:
            bad += _round64(xc, oc, scale, lo, hi) if round_ else _trunc64(xc, oc, scale, lo, hi)
    return bad


@_jit
def quantise_trunc32(x: Any, out: Any, scale: float, lo: float, hi: float) -> int:
    return _f32_chunks(x, out, scale, lo, hi, False)


@_jit
def quantise_round32(x: Any, out: Any, scale: float, lo: float, hi: float) -> int:
    return _f32_chunks(x, out, scale, lo, hi, True)


@_jit
def quantise_columns(
    x: Any, c0: int, c1: int, out: Any, scale: float, lo: float, hi: float, round_: bool
) -> int:
    """Quantise columns ``c0:c1`` of the 2-D C-order ``x`` into the 2-D ``out`` (C order), row by row.

    The band of a transposed result: each row's values are contiguous, so the
    vectorised loops above do every row (inlined: no call per row).
    """
    bad = 0
    f32 = 0.0 < scale < 16777216.0  # kernels.F32_SCALES
    for r in range(x.shape[0]):
        xr, o = x[r, c0:c1], out[r]
        if f32:
            bad += _f32_chunks(xr, o, scale, lo, hi, round_)
        elif round_:
            bad += _round64(xr, o, scale, lo, hi)
        else:
            bad += _trunc64(xr, o, scale, lo, hi)
    return bad


# Range checks read every value once: integer min/max reductions over the
# float32 bits, which vectorise (float min/max reductions do not without
# fast-math, which would drop NaN).  As int32, non-negative floats order as
# their bits; as uint32, negative floats order by magnitude above every
# non-negative one.  The min and max of both views give the float extremes
# (pytreeio.kernels.min_max), NaNs included: their bits lie beyond the
# infinities'.


@_jit
def min_max_bits(bits: Any, ubits: Any) -> tuple[Any, Any, Any, Any]:
    """Min and max of ``bits`` (int32) and of ``ubits`` (uint32), two views of the same float32 values."""
    a = np.int32(2**31 - 1)
    b = np.int32(-(2**31))
    c = np.uint32(2**32 - 1)
    d = np.uint32(0)
    for i in range(bits.size):
        s = bits[i]
        u = ubits[i]
        a = min(a, s)
        b = max(b, s)
        c = min(c, u)
        d = max(d, u)
    return a, b, c, d


#: Lanes of the register-block transpose per element width in bits: one 32-byte
#: row of 2-8 byte values (a ymm register), 16x16 blocks of bytes (xmm rows).
BLOCK = {8: 16, 16: 16, 32: 8, 64: 4}

#: Rows of ``out`` per tile (callers split work on multiples of it; a multiple
#: of twice every :data:`BLOCK`).  A tile is TILE destination rows by 2n
#: columns (n = :data:`BLOCK`), done in 2n x 2n pieces of four register blocks
#: going down the tile: each piece reads whole 64-byte lines of 2n source rows
#: (for 2- to 8-byte values) and writes whole lines of 2n destination rows, and
#: the 2n source rows stream on through the tile.  With the power-of-two row
#: strides of real weights, a square tile puts all its source lines in one
#: cache set; this tall, narrow shape measured fastest (3.2 GB/s against 2.2 for
#: 256 x n tiles of single blocks, f32 2048 x 2048, one core).
TILE = 512


def _lane_masks(n: int, lane: int) -> tuple[list[int], list[int]]:
    """Interleaves of two n-element vectors within each ``lane``-element lane: low halves, high halves.

    The unpack instructions (``vpunpckl*``/``vpunpckh*``): no value crosses a
    128-bit lane, which costs 1-2 cycles per shuffle on every AVX2 core, where
    a cross-lane interleave (``vperm2i128``) costs 3 on some (AMD Zen 1).
    """
    lo, hi = [], []
    for base in range(0, n, lane):
        lo += [k for p in range(lane // 2) for k in (base + p, n + base + p)]
        hi += [k for p in range(lane // 2, lane) for k in (base + p, n + base + p)]
    return lo, hi


def _block_intrinsic(stream: bool, wide: int = 1) -> Any:
    """The register block below; ``stream``: its stores non-temporal (16-byte aligned rows only).

    ``wide``: blocks side by side in the result (``out[i:i+n, j:j+wide*n]``).
    """

    def typer(typingctx: Any, a: Any, out: Any, j: Any, i: Any) -> Any:
        """``out[i:i+n, j:j+n] = a[j:j+n, i:i+n].T`` (n = :data:`BLOCK`) in vector registers.

        With L = n/2 values per 128-bit lane (n for bytes: one xmm row), the
        block is four L x L quadrants.  Register k holds row k of the upper
        quadrant in its low lane and row k + L of the lower one in its high
        lane (two 16-byte loads); log2(L) rounds of in-lane interleaves of
        registers L/2 apart transpose both lanes at once, and register k is
        then row k of the result (the upper quadrant's column k beside the
        lower one's): one 32-byte store, or two 16-byte non-temporal ones.
        The right-hand quadrants likewise give rows L...n-1.  Both arrays'
        rows must be contiguous (unit inner stride); nothing is checked.
        """
        if not (
            isinstance(a, types.Array)
            and isinstance(out, types.Array)
            and a.dtype == out.dtype
            and isinstance(a.dtype, types.Integer)
            and int(getattr(a.dtype, "bitwidth", 0)) in BLOCK
        ):
            return None
        bits = int(a.dtype.bitwidth)  # type: ignore[attr-defined]
        n = BLOCK[bits]
        lane = min(n, 128 // bits)  # values per 128-bit lane
        halves = n // lane  # 128-bit lanes per row: 2 (ymm), 1 for bytes (xmm)
        lo, hi = _lane_masks(n, lane)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            av, ov, jv, iv = args
            src = context.make_array(sig.args[0])(context, builder, av)
            dst = context.make_array(sig.args[1])(context, builder, ov)
            i64, i32 = ir.IntType(64), ir.IntType(32)
            elem = ir.IntType(bits)
            vp = ir.VectorType(elem, n).as_pointer()
            hp = ir.VectorType(elem, lane).as_pointer()
            bytep = ir.IntType(8).as_pointer()
            ss = cgutils.unpack_tuple(builder, src.strides, 2)[0]
            ds = cgutils.unpack_tuple(builder, dst.strides, 2)[0]
            size = ir.Constant(i64, bits // 8)
            s0 = builder.add(builder.mul(jv, ss), builder.mul(iv, size))
            d0 = builder.add(builder.mul(iv, ds), builder.mul(jv, size))
            sbase = builder.gep(builder.bitcast(src.data, bytep), [s0])
            dbase = builder.gep(builder.bitcast(dst.data, bytep), [d0])

            def mask(values: list[int]) -> Any:
                return ir.Constant(ir.VectorType(i32, len(values)), values)

            mlo, mhi = mask(lo), mask(hi)
            nontemporal = builder.module.add_metadata([ir.Constant(i32, 1)])

            def load(row: int, col: int) -> Any:
                at = builder.add(builder.mul(ss, ir.Constant(i64, row)), ir.Constant(i64, col))
                return builder.load(builder.bitcast(builder.gep(sbase, [at]), hp), align=1)

            def store(value: Any, row: int, col: int) -> None:
                at = builder.add(
                    builder.mul(ds, ir.Constant(i64, row)), ir.Constant(i64, col * (bits // 8))
                )
                ptr = builder.gep(dbase, [at])
                if not stream:
                    builder.store(value, builder.bitcast(ptr, vp), align=1)
                    return
                for h in range(halves):
                    part = value
                    if halves > 1:
                        part = builder.shuffle_vector(
                            value, value, mask(list(range(h * lane, (h + 1) * lane)))
                        )
                    at = builder.gep(ptr, [ir.Constant(i64, 16 * h)])
                    st = builder.store(part, builder.bitcast(at, hp), align=16)
                    st.set_metadata("nontemporal", nontemporal)

            def quadrant(c: int, first: int) -> list[Any]:
                """Rows c*lane ... c*lane + lane - 1 of the block of source rows first ... first+n-1."""
                col = c * 16
                if halves == 1:
                    rows = [load(first + k, col) for k in range(n)]
                else:
                    both = mask(list(range(n)))
                    rows = [
                        builder.shuffle_vector(
                            load(first + k, col), load(first + k + lane, col), both
                        )
                        for k in range(lane)
                    ]
                half = lane // 2
                for _ in range(lane.bit_length() - 1):
                    nxt = []
                    for r in range(half):
                        nxt.append(builder.shuffle_vector(rows[r], rows[r + half], mlo))
                        nxt.append(builder.shuffle_vector(rows[r], rows[r + half], mhi))
                    rows = nxt
                return rows

            for c in range(halves):  # the upper rows of the result, then the lower ones
                # Side by side blocks are stored row by row: each destination line is
                # written whole before the next (one line open, not ``wide`` of them).
                blocks = [quadrant(c, b * n) for b in range(wide)]
                for r in range(lane):
                    for b in range(wide):
                        store(blocks[b][r], c * lane + r, b * n)
            return context.get_dummy_value()

        return types.void(a, out, types.int64, types.int64), codegen

    name = ("_block_stream" if stream else "_block") + ("2" if wide == 2 else "") + "_typer"
    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


_block: Any = _block_intrinsic(False)
_block_stream: Any = _block_intrinsic(True)
_block2: Any = _block_intrinsic(False, 2)
_block2_stream: Any = _block_intrinsic(True, 2)


def _fence_typer(typingctx: Any) -> Any:
    """A full memory fence (mfence on x86): orders the non-temporal stores before it."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


_fence: Any = intrinsic(_fence_typer)


@_inline
def _edge(a: Any, out: Any, i0: int, i1: int, j0: int, j1: int) -> None:
    for i in range(i0, i1):
        for j in range(j0, j1):
            out[i, j] = a[j, i]


@_jit
def transpose_rows(a: Any, out: Any, start: int, stop: int, n: int) -> None:
    """``out[i, j] = a[j, i]`` for the rows ``i`` of ``out`` in ``[start, stop)``.

    ``n`` is :data:`BLOCK` for the element width.  Where ``a``'s rows are
    contiguous, whole tiles go in n x n register blocks (vector loads,
    shuffles, vector stores), four at a time where a 2n x 2n piece fits; the
    rest, and strided sources, element by element.
    """
    cols = out.shape[1]
    if a.strides[1] != a.itemsize or out.strides[1] != out.itemsize:
        _edge(a, out, start, stop, 0, cols)
        return
    # Pieces in tall tiles where both row strides are multiples of 4 KiB (the
    # cache-set conflicts of power-of-two widths); elsewhere single blocks in
    # tiles twice as tall measured faster (one core, 4000 x 16000: u16 4.0
    # GB/s against 3.6 at half the height, u32 4.5 against 4.1).
    pieces = a.strides[0] % 4096 == 0 and out.strides[0] % 4096 == 0
    m = 2 * n if pieces else n
    # Side-by-side blocks write each out line whole before the next; single blocks go
    # down the tile twice, a half line each time, the line kept in L2 in between.
    # That second visit misses where out's rows lie (within a line of) a multiple of
    # 4 KiB apart (their lines crowd a few cache sets), and costs nothing to avoid
    # where a's rows are close (reading 2n of them at once touches a few KiB); elsewhere
    # reading 2n rows of a at once costs more than it saves.  Measured on one core:
    # f32 2048 x 32 8.5 GB/s against 3.9, u32 2048 x 2056 3.4 against 2.4, f32 2047 x
    # 2047 3.4 against 2.7; u32 4000 x 1000 3.6 against 4.8 (hence not there).
    near = out.strides[0] % 4096
    wide = a.strides[0] <= 512 or near <= 64 or near >= 4096 - 64
    height = TILE if pieces else 2 * TILE
    for i0 in range(start, stop, height):
        i1 = min(i0 + height, stop)
        bi = i0 + (i1 - i0) // n * n  # rows of whole blocks
        mi = i0 + (i1 - i0) // m * m  # rows of whole pieces
        for j0 in range(0, cols, 2 * n):
            j1 = min(j0 + 2 * n, cols)
            if m > n and j1 - j0 == m:
                if wide:
                    for ib in range(i0, mi, m):
                        _block2(a, out, j0, ib)
                        _block2(a, out, j0, ib + n)
                    for ib in range(mi, bi, n):
                        _block2(a, out, j0, ib)
                else:
                    for ib in range(i0, mi, m):
                        _block(a, out, j0, ib)
                        _block(a, out, j0 + n, ib)
                        _block(a, out, j0, ib + n)
                        _block(a, out, j0 + n, ib + n)
                    for ib in range(mi, bi, n):
                        _block(a, out, j0, ib)
                        _block(a, out, j0 + n, ib)
                bj = j1
            else:
                bj = j0 + (j1 - j0) // n * n
                if wide and bj - j0 == 2 * n:
                    for ib in range(i0, bi, n):
                        _block2(a, out, j0, ib)
                else:
                    for jb in range(j0, bj, n):
                        for ib in range(i0, bi, n):
                            _block(a, out, jb, ib)
            _edge(a, out, bi, i1, j0, j1)
            _edge(a, out, i0, bi, bj, j1)


# Quantising into a transposed result fuses the two steps through an L2-sized
# scratch: a tile of Q_ROWS rows by Q_COLS columns of x is quantised row by
# row (contiguous reads of Q_COLS values, which the prefetchers follow), then
# transposed out of the scratch in register blocks.  Transposing x itself
# would read Q_ROWS lines a row stride apart, which with power-of-two widths
# all fall in one cache set; the quantised tile is read back from L2 instead.
# Measured on one core (f32 4096 x 16384 to i16): 2.9 GB/s of input against
# 1.9 for quantising columns into a band and transposing it afterwards, and
# 3.5 with non-temporal stores where the destination's rows start on cache
# lines (no read-for-ownership of each destination line; 5.7 GB/s on two
# cores, 0.5x memcpy).  Misaligned rows take plain stores: a non-temporal
# store to part of a line costs more than it saves.

#: Rows of x per tile of :func:`quantise_transposed` (a multiple of every :data:`BLOCK`).
Q_ROWS = 128

#: Columns of x per tile (4 KB of float32 per row read).
Q_COLS = 1024


@_jit
def quantise_transposed(
    x: Any,
    c0: int,
    c1: int,
    out: Any,
    scratch: Any,
    scale: float,
    lo: float,
    hi: float,
    round_: bool,
    stream: bool,
) -> int:
    """``out[c - c0, r] = q(x[r, c])`` for the columns ``c0 <= c < c1`` of the 2-D float32 ``x``.

    Rows ``c0:c1`` of the quantised transpose of ``x``, into the 2-D ``out``
    (``(c1 - c0, rows)``, rows contiguous); returns how many values do not
    fit, as :func:`quantise_columns`.  ``scratch`` is a 1-D array of ``out``'s
    dtype of at least ``Q_ROWS * Q_COLS`` values.  ``stream``: write
    ``out`` with non-temporal stores (its address and row stride must be
    multiples of 16 bytes), for results not read again soon.
    """
    rows = x.shape[0]
    n = 16 if out.itemsize <= 2 else 32 // out.itemsize  # BLOCK by element width
    bad = 0
    for j0 in range(0, rows, Q_ROWS):
        j1 = min(j0 + Q_ROWS, rows)
        w = j1 - j0
        bw = w // n * n
        for i0 in range(c0, c1, Q_COLS):
            i1 = min(i0 + Q_COLS, c1)
            h = i1 - i0
            bh = h // n * n
            tile = scratch[: w * h].reshape(w, h)  # C order: the quantising loops vectorise
            bad += quantise_columns(x[j0:j1], i0, i1, tile, scale, lo, hi, round_)
            o = out[i0 - c0 : i1 - c0, j0:j1]  # o[i, j] = tile[j, i]
            bw2 = w // (2 * n) * (2 * n)
            for ib in range(0, bh, n):
                # side-by-side blocks: each line of o written whole (one open at a time)
                for jb in range(0, bw2, 2 * n):
                    if stream:
                        _block2_stream(tile, o, jb, ib)
                    else:
                        _block2(tile, o, jb, ib)
                for jb in range(bw2, bw, n):
                    if stream:
                        _block_stream(tile, o, jb, ib)
                    else:
                        _block(tile, o, jb, ib)
            _edge(tile, o, bh, h, 0, w)
            _edge(tile, o, 0, bh, bw, w)
    if stream:
        _fence()
    return bad
