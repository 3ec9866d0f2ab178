"""Compiled (numba) loops for host quantisation and transposes; numba is optional and imported lazily.

numpy needs ~15 passes over a cache-sized block to quantise it and copies a
transposed view with strided loads; a compiled loop does either in one pass.
The kernels (:mod:`pytreeio._numba_kernels`) are single-threaded and release
the GIL: callers split the work over :func:`pytreeio.transpose.pool` (numba's
own ``parallel=True`` threading layer aborts when several Python threads
launch kernels at once, as concurrent saves do).

Quantisation gives :func:`pytreeio.quant.quantise`'s definition bit for bit
(the float64 product ``Q*x``, ``trunc`` or rounding half away from zero, the
range check ``lo <= t <= hi`` on that result, NaN failing it) in one pass:
for scales below ``2**24`` in float32 with an FMA remainder deciding the
integer and half-integer products (twice the SIMD width of float64, which
the float64 loop needs per element), redoing in float64 the 4096-value
chunks that hold a value float32 cannot place (beyond ``2**22 - 1`` or
outside the type, NaN, inf); other scales in float64 throughout.  Values
that do not fit are stored as arbitrary values.  :func:`quantise_transposed`
does the same on a band of columns of a matrix, written as rows of the
transposed result in the same pass, and :func:`min_max` takes a range
check's extremes in one integer pass.

:func:`available` is false, and callers keep their numpy paths, when numba
does not import, when ``PYTREEIO_NO_NUMBA=1`` is set, or when loading the
kernels failed once.  Compiled code is cached on disk: ``__pycache__`` next
to the kernels' module when it is writable, else numba's user cache directory
(``NUMBA_CACHE_DIR`` when set); where none can be written they are compiled
in memory, once per process.  Only arrays of at least :data:`MIN_BYTES` take
these paths, and only once the kernels have been loaded on a background
thread (:func:`use`), so no save waits for numba's import.
"""

from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType
from typing import Any

import numpy as np

from .pools import Warming

__all__ = [
    "MIN_BYTES",
    "available",
    "use",
    "ready",
    "quantise",
    "quantise_transposed",
    "transposed_scratch",
    "min_max",
    "transposable",
    "transpose",
]

#: Arrays smaller than this stay on the numpy paths: the first call in a
#: process imports numba (~0.5 s) and loads (or, the first time, compiles:
#: ~1 s per kernel and type) the kernel, which a small save should not pay.
MIN_BYTES = 2 << 20

_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def enabled() -> bool:
    """Whether the compiled kernels may be used (``PYTREEIO_NO_NUMBA=1`` forces numpy)."""
    return os.environ.get("PYTREEIO_NO_NUMBA", "") in ("", "0") and not _failed


def available() -> bool:
    """Whether the compiled kernels are enabled and numba imports (imports it on first call)."""
    return enabled() and _load() is not None


def use(nbytes: int) -> bool:
    """Whether an array of ``nbytes`` should go through the compiled kernels; never waits.

    The first large array starts loading numba and the kernels on a
    background thread (import ~0.5 s, first kernel ~0.7 s even from the disk
    cache) and is done by numpy meanwhile, as is every one until they are ready.
    """
    if nbytes < MIN_BYTES or not enabled():
        return False
    if _module is not None:
        return True
    _warming.start()
    return False


def ready(timeout: float | None = None) -> bool:
    """Load the kernels now, as the first large array would, and wait up to ``timeout`` seconds.

    Returns whether they are in use.  For a process that wants the one-time
    cost (numba's import and code generator: about a second and ~120 MB
    resident) paid before a timed or memory-bounded step rather than during it.
    """
    if not enabled():
        return False
    _warming.wait(timeout)
    return _module is not None


def _load_and_run() -> None:
    """Load the kernels and run one (numba's code generator starts on the first call)."""
    global _module
    with _lock:
        if _module is not None or _failed:
            return
    k = _load_module()
    if k is not None:
        try:
            k.quantise_round32(np.zeros(1, np.float32), np.zeros(1, np.int16), 1.0, 0.0, 0.0)
        except Exception:  # a broken numba: leave the numpy paths in charge
            return
    with _lock:
        _module = k


_warming = Warming(_load_and_run, "pytreeio-kernels")


def _load() -> ModuleType | None:
    global _module
    if _module is not None or _failed:
        return _module
    k = _load_module()
    with _lock:
        if _module is None:
            _module = k
    return _module


def _load_module() -> ModuleType | None:
    global _failed
    try:  # the import lock makes concurrent first imports wait for one another
        return importlib.import_module(f"{__package__}._numba_kernels")
    except Exception:  # numba missing or broken: the numpy paths do the work
        with _lock:
            _failed = True
        return None


def _kernels() -> ModuleType:
    k = _load()
    if k is None:
        raise RuntimeError("the compiled kernels are not available (check kernels.available())")
    return k


def _bounds(dtype: np.dtype[Any]) -> tuple[float, float]:
    info = np.iinfo(dtype)
    return float(info.min), float(info.max)


#: Integer scales below this are float32s: the float32 kernels take them (the float64 ones the rest).
F32_SCALES = 2**24


def quantise(x: np.ndarray, out: np.ndarray, scale: int, round_: bool) -> int:
    """Quantise 1-D float32 ``x`` into the 1-D integer array ``out``; returns how many values do not fit.

    Scales ``0 < scale < 2**24`` go through the float32 kernels (the same
    bits, chunks they cannot do exactly redone in float64), others through
    the float64 ones.
    """
    k = _kernels()
    if 0 < scale < F32_SCALES:
        kernel = k.quantise_round32 if round_ else k.quantise_trunc32
    else:
        kernel = k.quantise_round if round_ else k.quantise_trunc
    return int(kernel(x, out, float(scale), *_bounds(out.dtype)))


def quantise_transposed(
    x: np.ndarray,
    c0: int,
    c1: int,
    out: np.ndarray,
    scratch: np.ndarray,
    scale: int,
    round_: bool,
) -> int:
    """Rows ``c0:c1`` of the quantised transpose of ``x`` (2-D C-order float32); returns how many do not fit.

    ``out[c - c0, r] = q(x[r, c])``: ``out`` is ``(c1 - c0, rows)`` with
    contiguous rows; ``scratch`` is :func:`transposed_scratch` (one per
    thread).  One pass: tiles of ``x`` quantised into the scratch, transposed
    out of it.  Where ``out`` and its row stride are 64-byte aligned it is
    written with non-temporal stores (whole cache lines go to memory without
    being read first).
    """
    lo, hi = _bounds(out.dtype)
    k = _kernels()
    stream = out.ctypes.data % 64 == 0 and out.strides[0] % 64 == 0
    return int(
        k.quantise_transposed(
            x, int(c0), int(c1), out, scratch, float(scale), lo, hi, bool(round_), stream
        )
    )


def transposed_scratch(dtype: np.dtype[Any]) -> np.ndarray:
    """The scratch one thread's :func:`quantise_transposed` calls need: one tile of ``dtype`` (L2-sized)."""
    k = _kernels()
    return np.empty(k.Q_ROWS * k.Q_COLS, dtype)


def min_max(x: np.ndarray) -> tuple[float, float]:
    """``(x.min(), x.max())`` of a non-empty 1-D native float32 array in one pass; both NaN when it holds one."""
    a, b, c, d = _kernels().min_max_bits(x.view(np.int32), x.view(np.uint32))
    # b >= 0: a value with the sign bit clear exists, and b is the largest (a NaN above +inf);
    # d >= 2**31: one with it set exists, and d is the largest magnitude (a NaN below -inf)
    hi_bits = b if b >= 0 else c  # else every value is negative: the smallest magnitude
    lo_bits = d if d >= 2**31 else a  # else none is: the smallest non-negative
    pair = np.array([lo_bits, hi_bits], np.uint64).astype(np.uint32).view(np.float32)
    if np.isnan(pair).any():
        return np.nan, np.nan
    return float(pair[0]), float(pair[1])


#: Unsigned integer types by itemsize: every element type is copied as its bits.
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def transposable(view: np.ndarray, out: np.ndarray) -> bool:
    """Whether :func:`transpose` copies ``view`` into ``out`` (2-D, same dtype, 1-8 byte elements)."""
    return (
        view.ndim == 2
        and view.dtype == out.dtype
        and view.dtype.itemsize in _BITS
        and not view.dtype.hasobject
    )


def transpose(view: np.ndarray, out: np.ndarray, start: int, stop: int) -> None:
    """``out[start:stop] = view[start:stop]`` for a 2-D ``view`` (any strides) and C-contiguous ``out``.

    Rows ``start:stop`` of ``out`` should be a multiple of :func:`tile` rows
    apart for the fastest copy (any range is copied correctly).
    """
    bits = _BITS[view.dtype.itemsize]
    k = _kernels()
    lanes = k.BLOCK[8 * view.dtype.itemsize]
    k.transpose_rows(view.T.view(bits), out.view(bits), int(start), int(stop), lanes)


def tile() -> int:
    """Rows per tile of the transposing kernels (callers split work on multiples of it)."""
    return int(_kernels().TILE)
