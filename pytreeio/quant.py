"""Jit-compiled layout transforms and quantisation.

jax is imported on first use, never at ``import pytreeio``.  Work runs where
its input lives: a jax array is transformed by a kernel compiled once per
(shape, dtype, static arguments) on its device (an accelerator when present),
a numpy array on the host (never sent to an accelerator and back: on an H100
machine that round trip cost more than the host computation, and jax takes
no big-endian arrays).  Results come back as numpy arrays because they are
about to be written to a file.

Quantisation
------------
:func:`quantise` turns float values into ``i8``/``i16``/``i32`` with an
integer scale ``Q``, as bullet does: ``q = trunc(Q*x)`` computed in float64,
or, with ``round=True``, ``Q*x`` rounded half away from zero (Rust's
``f64::round``).  One jit-compiled kernel scales, rounds or truncates,
casts and (optionally) transposes in one elementwise loop, and checks the
range from the input's minimum and maximum (one variadic reduction; see
``_quantise_kernel`` for why that is exact).  A transpose is a second kernel
on the 1-4 byte result: fused into the elementwise loop it is slower on
every backend measured (on CPU XLA emits it element by element, about 20x
slower; on an H100 the fused kernel ran at 318 GB/s of input, the kernel then
a separate transpose at 698 GB/s).  When jax computes on the
CPU, or is given a numpy array, :func:`quantise` and :func:`quantise_async`
do not call jax at all:
:mod:`pytreeio.quant_host` computes the same bits with numpy in cache-sized
blocks on every core (float32 where that is provably exact, the range check
in the same pass, no copy of the input into jax's buffers) and the 1-4 byte
result is transposed by :func:`~pytreeio.transpose.copy_transposed`.
Measured on a loaded 2-core CPU (``tests/bench/bench_quant.py``, 64M
elements, i16, rounded, interleaved): 2.3x the jit kernel's throughput from
numpy to numpy (4x truncating), 1.7x with the transpose.

Writers that stream (bullet's ``quantised.bin``) split the two:
:func:`check_quantisable` checks the range before anything is written (on
the host for numpy input: a block-wise min/max on every core reads it once,
with no copy into jax's buffers), and :func:`quantise_async` dispatches the
elementwise work (the jit kernel, or on the CPU the host blocks on a
background thread), which computes while earlier bytes are being written;
the values are the same bits as :func:`quantise`'s.  On the host,
:func:`quantise_bands` streams many arrays instead: bands of about 1 MB
computed on a thread of their own ahead of the writer, in reused buffers
(:class:`pytreeio.quant_host.Bands`).

Why float64, not float32: ``fl32(Q*x)`` rounds, and the rounding crosses
integer (and half-integer) boundaries.  At ``Q=255`` the float32
``x=1.0078431`` gives ``Q*x = 256.99999988...`` exactly, which float32 rounds
up to 257.0, so a float32 ``trunc`` answers 257 where bullet answers 256;
16,256 of the float32 values in ``[2**-8, 128]`` differ that way at ``Q=255``
(and, rounding, even at ``Q=64``: ``x=0.0078124995``).
``tests/test_quant.py`` keeps such counterexamples.  In float64 the product
of a float32 (24-bit significand) and a scale below ``2**29`` is exact, so the
kernel computes the exact ``trunc``/``round`` of the real product; for larger
``i32`` scales it computes what bullet computes (the float64 product, then
``trunc``/``round``), which is the definition.  ``v - trunc(v)`` is exact in
binary floating point, so the rounding step never suffers the
``0.49999999999999994 + 0.5 == 1.0`` error of ``floor(v + 0.5)``.

float64 needs jax's x64 mode.  The kernel is compiled and called inside
``jax.enable_x64(True)``, a *thread-local* context: nothing changes for the
caller's own jax code or other threads, and the caller's arrays keep their
dtypes (float32 in, integers out).  On accelerators with slow float64 units
this costs little: the kernel moves 4 bytes in and 1-4 bytes out per element
and is bound by memory bandwidth.  (Proving float32 exact would need an
error-free product, ``TwoProduct``, and integer fix-ups per element; float64
is simpler and is bullet's own definition.)

Every value whose ``q`` does not fit the integer type, and every NaN or
infinity, makes :func:`quantise` raise
:class:`~pytreeio.errors.QuantisationError` naming the tensor, the (first)
element index and its value; the error carries them as ``tensor``,
``index`` (flat), ``position`` (per axis) and ``value`` attributes.

Output buckets
--------------
A layer with ``N`` output buckets of ``out`` outputs each is a Flax-style
``(in, N*out)`` kernel (bullet's column-major ``N*out x in`` matrix, byte for
byte); :func:`to_buckets` gives the ``(N, out, in)`` layout in which each
bucket is contiguous (what bullet's ``transpose`` writes), and
:func:`from_buckets` goes back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dtypes, quant_host
from .errors import QuantisationError
from .pools import new_pool
from .transpose import copy_transposed

if TYPE_CHECKING:  # not at run time: the module cannot be imported once the interpreter exits
    from concurrent.futures import ThreadPoolExecutor

__all__ = [
    "transpose",
    "copy_transposed",
    "on_cpu",
    "transpose_to_device",
    "INT_TYPES",
    "quantise",
    "check_quantisable",
    "quantise_async",
    "quantise_bands",
    "Pending",
    "dequantise",
    "quantisation_error",
    "to_buckets",
    "from_buckets",
]

#: The integer targets of :func:`quantise`, by bullet's names.
INT_TYPES: dict[str, np.dtype[Any]] = {
    "i8": np.dtype("<i1"),
    "i16": np.dtype("<i2"),
    "i32": np.dtype("<i4"),
}


# --------------------------------------------------------------------------
# transposes
# --------------------------------------------------------------------------


@cache
def _jit_transpose(axes: tuple[int, ...]) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x: jnp.transpose(x, axes))


def transpose_to_device(x: Any, axes: Sequence[int]) -> Any:
    """``x.transpose(axes)`` as a jax array, computed by a jit-compiled kernel."""
    return _jit_transpose(tuple(int(a) for a in axes))(x)


def transpose(x: Any, axes: Sequence[int]) -> np.ndarray:
    """``x.transpose(axes)`` as a C-contiguous numpy array.

    Arrays of 0 or 1 dimensions, identity permutations and views whose
    transpose is already C-contiguous are returned without a copy.  A numpy
    array is transposed on the host (tiled copies on the cores,
    :func:`copy_transposed`; a big-endian one comes back little-endian)
    whatever device jax computes on: a trip to an accelerator and back costs
    more than the copy, and jax takes no big-endian arrays.  A jax array is
    transposed by a jit-compiled kernel where it lives.  A numpy transpose
    never imports jax.
    """
    axes = tuple(int(a) for a in axes)
    arr = x if isinstance(x, np.ndarray) else None
    if axes == tuple(range(len(axes))):
        return dtypes.c_order(np.asarray(x))
    if arr is not None:
        view = arr.transpose(axes)
        if arr.size == 0 or (view.flags.c_contiguous and view.dtype.byteorder in "=|<"):
            return dtypes.c_order(view)
        little = view.dtype.newbyteorder("<") if view.dtype.byteorder == ">" else view.dtype
        out = np.empty(view.shape, little)
        copy_transposed(view, out)
        return out
    return np.asarray(transpose_to_device(x, axes))


def on_cpu() -> bool:
    """Whether jax's default backend is the CPU (jax is imported to ask)."""
    import jax

    return bool(jax.default_backend() == "cpu")


# copy_transposed (tiled, multi-threaded host copies) lives in pytreeio.transpose


# --------------------------------------------------------------------------
# quantisation
# --------------------------------------------------------------------------


def _int_type(name: str) -> np.dtype[Any]:
    try:
        return INT_TYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown integer type {name!r}; known: {sorted(INT_TYPES)}") from None


def _rounded(v: Any, round_: bool) -> Any:
    """trunc(v), or v rounded half away from zero, for any float64 v (NaN and inf stay so).

    ``v - trunc(v)`` is exact, so ties are detected exactly (``floor(v + 0.5)``
    would round 0.49999999999999994 up).
    """
    import jax.numpy as jnp

    t = jnp.trunc(v)
    if round_:
        t = t + jnp.where(jnp.abs(v - t) >= 0.5, jnp.sign(v), 0.0)
    return t


@cache
def _values_kernel(type_name: str, round_: bool) -> Any:
    """The elementwise part of :func:`_quantise_kernel` alone: ``(x f32, scale f64) -> q``.

    The same expression, so the same bits; for values already checked by
    :func:`_range_kernel` (:func:`quantise_async`).  XLA on CPU emits the fused
    kernel as these two loops anyway.
    """
    import jax

    return jax.jit(_values_fn(type_name, round_))


def _values_fn(type_name: str, round_: bool) -> Callable[[Any, Any], Any]:
    """The traced expression of ``q`` both jit kernels share (so both give the same bits)."""
    import jax.numpy as jnp

    info = np.iinfo(INT_TYPES[type_name])
    lo, hi = float(info.min), float(info.max)
    wide = jnp.int64 if type_name == "i32" else jnp.int32  # holds lo - 1 .. hi + 1
    out_dtype = INT_TYPES[type_name].type

    def values(x: Any, scale: Any) -> Any:
        v = jnp.clip(x.astype(jnp.float64) * scale, lo, hi)
        t = v.astype(wide)
        if round_:
            frac = v - t.astype(jnp.float64)  # exact
            t = t + (frac >= 0.5).astype(wide) - (frac <= -0.5).astype(wide)
        return jnp.clip(t, int(lo), int(hi)).astype(out_dtype)

    return values


@cache
def _range_kernel(type_name: str, round_: bool) -> Any:
    """The range check of :func:`_quantise_kernel` alone: ``(x f32, scale f64) -> ok``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    info = np.iinfo(INT_TYPES[type_name])
    lo, hi = float(info.min), float(info.max)

    def check(x: Any, scale: Any) -> Any:
        smallest, largest = lax.reduce(
            (x, x),
            (np.float32(np.inf), np.float32(-np.inf)),
            lambda a, b: (lax.min(a[0], b[0]), lax.max(a[1], b[1])),
            tuple(range(x.ndim)),
        )
        q_lo = _rounded(smallest.astype(jnp.float64) * scale, round_)
        q_hi = _rounded(largest.astype(jnp.float64) * scale, round_)
        return (q_lo >= lo) & (q_hi <= hi)  # False for NaN

    return jax.jit(check)


@cache
def _quantise_kernel(type_name: str, round_: bool) -> Any:
    """The fused kernel ``(x f32, scale f64) -> (q, ok)``; ``ok`` is False when any value does not fit.

    Range check: ``q`` is a monotonic function of ``x`` (the float64 product
    rounds monotonically, trunc and round too), so every ``q`` fits iff
    ``q(min x)`` and ``q(max x)`` do; a NaN anywhere makes both NaN (XLA's
    min/max propagate NaN) and an infinity makes one infinite, and neither
    fits.  That replaces a per-element flag and an ``argmax`` over it, which
    XLA on CPU runs about three times slower than the whole rest of the
    kernel.  Values are then computed by a plain conversion: clamped to the
    type's range first, so the float-to-int conversion (which truncates
    towards zero) is always defined, and it equals ``_rounded`` for every
    input that passes the check.

    Compiled under x64 (see the module docstring); jax caches one executable
    per input shape.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    info = np.iinfo(INT_TYPES[type_name])
    lo, hi = float(info.min), float(info.max)
    values = _values_fn(type_name, round_)

    def kernel(x: Any, scale: Any) -> tuple[Any, Any]:
        q = values(x, scale)
        axes = tuple(range(x.ndim))
        smallest, largest = lax.reduce(
            (x, x),
            (np.float32(np.inf), np.float32(-np.inf)),
            lambda a, b: (lax.min(a[0], b[0]), lax.max(a[1], b[1])),
            axes,
        )
        q_lo = _rounded(smallest.astype(jnp.float64) * scale, round_)
        q_hi = _rounded(largest.astype(jnp.float64) * scale, round_)
        return q, (q_lo >= lo) & (q_hi <= hi)  # False for NaN

    return jax.jit(kernel)


@cache
def _first_bad_kernel(type_name: str, round_: bool) -> Any:
    """``(x, scale) -> index of the first element whose q does not fit`` (-1 if none).

    Only run once a check failed, to name the element; elementwise, from the
    same ``_rounded``.
    """
    import jax
    import jax.numpy as jnp

    info = np.iinfo(INT_TYPES[type_name])
    lo, hi = float(info.min), float(info.max)

    def first_bad(x: Any, scale: Any) -> Any:
        t = _rounded(x.astype(jnp.float64) * scale, round_)
        bad = jnp.logical_not((t >= lo) & (t <= hi)).reshape(-1)
        return jnp.where(jnp.any(bad), jnp.argmax(bad), -1)

    return jax.jit(first_bad)


def _is_jax_array(x: Any) -> bool:
    return type(x).__module__.startswith(("jax", "jaxlib"))


def _as_float32(x: Any, name: str) -> Any:
    """``x`` as float32 without losing a bit (float16/bfloat16 widen exactly); jax arrays stay on device."""
    if _is_jax_array(x) and np.dtype(x.dtype) == np.float32:
        return x
    arr = np.asarray(x)
    if arr.dtype == np.float32:
        return dtypes.c_order(arr)
    if arr.dtype in (np.dtype(np.float16), dtypes.by_name("bfloat16")):
        return arr.astype(np.float32)
    raise TypeError(
        f"{name}: quantisation takes float32 values (float16/bfloat16 widen exactly), "
        f"found {arr.dtype.name}"
    )


def _quantisation_error(
    x: Any, index: int, scale: int, type_name: str, round_: bool, name: str, shape: tuple[int, ...]
) -> QuantisationError:
    flat = np.asarray(x).reshape(-1)
    value = float(flat[index])
    where = tuple(int(i) for i in np.unravel_index(index, shape)) if shape else ()
    product = np.float64(value) * np.float64(scale)
    info = np.iinfo(INT_TYPES[type_name])
    how = "rounded" if round_ else "truncated"
    shown = str(np.float32(value))  # the shortest repr of the float32 value
    exc = QuantisationError(
        f"{name}: element {index} {list(where)} = {shown} does not fit {type_name} "
        f"at scale {scale}: {shown} * {scale} = {float(product)!r} ({how}) is outside "
        f"[{info.min}, {info.max}]"
        + (" (not a finite number)" if not np.isfinite(product) else ""),
        tensor=name,
        index=index,
        position=where,
        value=value,
    )
    return exc


def quantise(
    x: Any,
    scale: int,
    type_name: str,
    *,
    round: bool = False,
    transpose: bool = False,
    name: str = "tensor",
) -> np.ndarray:
    """``x`` quantised to ``type_name`` (``"i8"``, ``"i16"``, ``"i32"``) at integer ``scale``.

    ``q = trunc(scale*x)`` in float64, or rounded half away from zero with
    ``round=True``; with ``transpose=True`` a 2-D ``x`` comes back transposed
    (C order), in the same pass.  The result is a little-endian numpy array.

    Raises:
      QuantisationError: a value does not fit the type (or is NaN/inf); the
        message and the ``tensor``/``index``/``position``/``value``
        attributes name the first such element of ``x``.
    """
    import jax

    dtype = _int_type(type_name)
    if isinstance(scale, bool) or not isinstance(scale, int | np.integer):
        raise ValueError(f"{name}: the scale must be an integer, found {scale!r}")
    x32 = _as_float32(x, name)
    shape = tuple(int(d) for d in x32.shape)
    if transpose and len(shape) != 2:
        raise ValueError(f"{name}: transpose takes a 2-D array, found shape {shape}")
    if int(np.prod(shape, dtype=np.int64)) == 0:
        empty = np.zeros(shape, dtype)
        return empty.T.copy() if transpose else empty
    if isinstance(x32, np.ndarray) or on_cpu():
        return _quantise_host(x32, int(scale), type_name, bool(round), bool(transpose), name)
    kernel = _quantise_kernel(type_name, bool(round))
    scale64 = np.float64(int(scale))
    with jax.enable_x64(True):
        q, ok = kernel(x32, scale64)
        if not bool(ok):
            first = int(_first_bad_kernel(type_name, bool(round))(x32, scale64))
            first = max(first, 0)  # -1 cannot happen: both checks use _rounded
            raise _quantisation_error(x32, first, int(scale), type_name, bool(round), name, shape)
    if transpose:
        q = transpose_to_device(q, (1, 0))
    return dtypes.c_order(np.asarray(q))


def _quantise_host(
    x32: Any, scale: int, type_name: str, round_: bool, transpose_: bool, name: str
) -> np.ndarray:
    """:func:`quantise` when jax computes on the CPU: numpy on every core, range checked in the same pass."""
    host = np.asarray(x32)  # a CPU jax array: no copy
    q, lo, hi = quant_host.quantise(
        host, scale, INT_TYPES[type_name], round_=round_, checked=False, transpose_=transpose_
    )
    if not _extremes_fit(lo, hi, np.float64(scale), type_name, round_):
        raise _first_error(host, scale, type_name, round_, name)
    return q


def _first_error(
    x32: Any, scale: int, type_name: str, round_: bool, name: str
) -> QuantisationError:
    """The error naming the first element that does not fit (a check has failed)."""
    import jax

    with jax.enable_x64(True):
        first = int(_first_bad_kernel(type_name, round_)(x32, np.float64(scale)))
    shape = tuple(int(d) for d in x32.shape)
    return _quantisation_error(x32, max(first, 0), scale, type_name, round_, name, shape)


#: The thread that runs :func:`quantise_async` jobs on the CPU, one after another (each
#: spreads its blocks over the cores; a job never waits on the pool it runs on).
_async_runner: ThreadPoolExecutor | None = None


def _runner() -> ThreadPoolExecutor:
    global _async_runner
    if _async_runner is None:
        _async_runner = new_pool(1, "pytreeio-quant")
    return _async_runner


def _forget_runner() -> None:
    global _async_runner
    _async_runner = None  # a forked child has none of its parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_runner)


class Pending:
    """A quantisation computing on the default device (or host threads); :meth:`result` waits for it."""

    __slots__ = ("_q", "nbytes", "shape")

    def __init__(self, q: Any, shape: tuple[int, ...], nbytes: int) -> None:
        self._q, self.shape, self.nbytes = q, shape, nbytes

    def result(self) -> np.ndarray:
        """The quantised values (C order, little-endian); the device result is dropped."""
        q, self._q = self._q, None
        if q is None:
            raise RuntimeError("a pending quantisation's result is taken once")
        if isinstance(q, Future):
            q = q.result()
        return dtypes.c_order(np.asarray(q))


def check_quantisable(
    x: Any, scale: int, type_name: str, *, round: bool = False, name: str = "tensor"
) -> Any:
    """Raise :class:`QuantisationError` as :func:`quantise` would; return ``x`` as float32.

    Runs only the range check (one reduction over ``x``); pair it with
    :func:`quantise_async` to compute the values later.
    """
    _int_type(type_name)
    if isinstance(scale, bool) or not isinstance(scale, int | np.integer):
        raise ValueError(f"{name}: the scale must be an integer, found {scale!r}")
    x32 = _as_float32(x, name)
    shape = tuple(int(d) for d in x32.shape)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return x32
    scale64 = np.float64(int(scale))
    if isinstance(x32, np.ndarray):  # on the host: no jax (nor its import) unless a value fails
        ok = _extremes_fit(*quant_host.min_max(x32), scale64, type_name, bool(round))
    else:
        import jax

        with jax.enable_x64(True):
            ok = bool(_range_kernel(type_name, bool(round))(x32, scale64))
    if not ok:
        raise _first_error(x32, int(scale), type_name, bool(round), name)
    return x32


def _extremes_fit(lo: float, hi: float, scale64: np.float64, type_name: str, round_: bool) -> bool:
    """:func:`_range_kernel` on the host, from the input's min and max (see ``_quantise_kernel``).

    The same arithmetic on two float64 scalars (a NaN min/max fails both
    comparisons, as in XLA).
    """
    info = np.iinfo(INT_TYPES[type_name])
    for value in (lo, hi):
        v = np.float64(value) * scale64
        t = np.trunc(v)
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, which fails below
            if round_ and abs(v - t) >= 0.5:
                t = t + np.sign(v)
        if not (info.min <= t <= info.max):
            return False
    return True


def quantise_async(
    x32: Any, scale: int, type_name: str, *, round: bool = False, transpose: bool = False
) -> Pending:
    """Start quantising ``x32`` (float32, already :func:`check_quantisable`); returns at once.

    jax dispatches the kernel asynchronously: the caller writes other bytes
    meanwhile and takes the values with :meth:`Pending.result`, bit for bit
    :func:`quantise`'s.
    """
    import jax

    dtype = _int_type(type_name)
    shape = tuple(int(d) for d in x32.shape)
    if transpose and len(shape) != 2:
        raise ValueError(f"transpose takes a 2-D array, found shape {shape}")
    out_shape = shape[::-1] if transpose else shape
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return Pending(np.zeros(out_shape, dtype), out_shape, 0)
    if isinstance(x32, np.ndarray) or on_cpu():
        host = np.asarray(x32)

        def job() -> np.ndarray:
            return quant_host.quantise(
                host, int(scale), dtype, round_=bool(round), checked=True, transpose_=transpose
            )[0]

        return Pending(_runner().submit(job), out_shape, nbytes)
    with jax.enable_x64(True):
        q = _values_kernel(type_name, bool(round))(x32, np.float64(int(scale)))
    if transpose:
        q = transpose_to_device(q, (1, 0))
    return Pending(q, out_shape, nbytes)


def quantise_bands(
    jobs: Sequence[tuple[Any, int, str, bool, bool]],
) -> quant_host.Bands | None:
    """Host bands for ``(x32, scale, type, round, transpose)`` jobs (checked by :func:`check_quantisable`), or None.

    For a writer that streams many quantised arrays into one file: when
    every array is a numpy array (host memory, whatever device jax computes
    on) the values are computed in bands ahead of the writer on a thread of
    their own, in reused buffers (:class:`pytreeio.quant_host.Bands`), bit
    for bit :func:`quantise`'s.  None when some are jax arrays: the caller
    dispatches :func:`quantise_async` per array (where an array lives, an
    accelerator computes it whole).
    """
    if not all(isinstance(x, np.ndarray) for x, *_ in jobs):
        return None
    host = []
    for x32, scale, type_name, round_, transpose_ in jobs:
        dtype = _int_type(type_name)
        if transpose_ and x32.ndim != 2:
            raise ValueError(f"transpose takes a 2-D array, found shape {x32.shape}")
        host.append(
            quant_host.BandJob(
                dtypes.c_order(x32), int(scale), dtype, bool(round_), bool(transpose_)
            )
        )
    return quant_host.Bands(host)


def dequantise(q: Any, scale: int) -> np.ndarray:
    """``q / scale`` in float64 (exact for every i8/i16/i32 value and scale)."""
    return np.asarray(q).astype(np.float64) / np.float64(scale)


def quantisation_error(q: Any, scale: int, x: Any) -> float:
    """The largest ``|q/scale - x|`` (float64), 0.0 for empty arrays; NaN in ``x`` gives NaN."""
    q = np.asarray(q)
    x = np.asarray(x)
    if q.size != x.size:
        raise ValueError(f"{q.size} quantised values for {x.size} float values")
    if q.size == 0:
        return 0.0
    diff = dequantise(q.reshape(-1), scale) - x.reshape(-1).astype(np.float64)
    return float(np.max(np.abs(diff)))


# --------------------------------------------------------------------------
# output buckets
# --------------------------------------------------------------------------


def to_buckets(kernel: Any, buckets: int) -> np.ndarray:
    """An ``(in, N*out)`` kernel as ``(N, out, in)``: bucket ``b``'s weights contiguous.

    Byte for byte what bullet's ``transpose`` writes for a bucketed layer:
    its row-major ``N*out x in`` matrix.
    """
    shape = tuple(int(d) for d in np.shape(kernel))
    if len(shape) != 2 or buckets < 1 or shape[1] % buckets:
        raise ValueError(f"cannot split a kernel of shape {shape} into {buckets} output buckets")
    n_in, n_out = shape
    return transpose(kernel, (1, 0)).reshape(buckets, n_out // buckets, n_in)


def from_buckets(per_bucket: Any) -> np.ndarray:
    """The inverse of :func:`to_buckets`: ``(N, out, in)`` to an ``(in, N*out)`` kernel."""
    shape = tuple(int(d) for d in np.shape(per_bucket))
    if len(shape) != 3:
        raise ValueError(f"expected (buckets, out, in), found shape {shape}")
    n, n_out, n_in = shape
    return transpose(np.asarray(per_bucket).reshape(n * n_out, n_in), (1, 0))
