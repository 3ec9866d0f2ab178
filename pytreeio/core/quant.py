"""Quantisation by one jit-compiled kernel, and output buckets.

jax is imported on first use, never at ``import pytreeio``.

Quantisation
------------
`quantise` turns float values into ``i8``/``i16``/``i32`` with an
integer scale ``Q``, as bullet does: ``q = trunc(Q*x)`` computed in float64,
or, with ``round=True``, ``Q*x`` rounded half away from zero (Rust's
``f64::round``).  Two jit-compiled kernels do it: a range check from the
input's minimum and maximum (one variadic reduction; see
`_range_kernel` for why that is exact), then the elementwise values.
A jax array on an accelerator is quantised whole where it lives.  Values in
host memory (numpy, or jax on the CPU) are fed to the same kernels in
blocks of `BLOCK` values, the last one padded with zeros to a power of
two: a model's tensors of many sizes then share a few compiled shapes
instead of one compile each, and the blocks run on XLA's CPU threads while
earlier ones are copied out.  A transpose (bullet's ``"transpose"``) is
applied to the 1-4 byte result on the host (`pytreeio.core.transpose`).

Writers that stream (bullet's ``quantised.bin``) split the two:
`check_quantisable` checks the range before anything is written, and
`quantise_async` dispatches the values (jax computes asynchronously)
while earlier bytes are written; `Pending.result` takes them, bit for
bit `quantise`'s.

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

float64 needs jax's x64 mode.  The kernels are compiled and called inside
``jax.enable_x64(True)``, a *thread-local* context: nothing changes for the
caller's own jax code or other threads, and the caller's arrays keep their
dtypes (float32 in, integers out).  The kernels move 4 bytes in and 1-4
bytes out per element and are bound by memory bandwidth, so slow float64
units cost little.

Every value whose ``q`` does not fit the integer type, and every NaN or
infinity, makes `quantise` raise
`pytreeio.core.errors.QuantisationError` naming the tensor, the (first)
element index and its value; the error carries them as ``tensor``,
``index`` (flat), ``position`` (per axis) and ``value`` attributes.

Output buckets
--------------
A layer with ``N`` output buckets of ``out`` outputs each is a Flax-style
``(in, N*out)`` kernel (bullet's column-major ``N*out x in`` matrix, byte for
byte); `to_buckets` gives the ``(N, out, in)`` layout in which each
bucket is contiguous (what bullet's ``transpose`` writes), and
`from_buckets` goes back.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

import numpy as np

from pytreeio.core import dtypes
from pytreeio.core.errors import QuantisationError
from pytreeio.core.threads import cores, pool, share
from pytreeio.core.transpose import copy_transposed, transpose, transpose_to_device

__all__ = [
    "transpose",
    "copy_transposed",
    "on_cpu",
    "transpose_to_device",
    "INT_TYPES",
    "quantise",
    "check_quantisable",
    "quantise_async",
    "Pending",
    "dequantise",
    "quantisation_error",
    "to_buckets",
    "from_buckets",
]

#: The integer targets of `quantise`, by bullet's names.
INT_TYPES: dict[str, np.dtype[Any]] = {
    "i8": np.dtype("<i1"),
    "i16": np.dtype("<i2"),
    "i32": np.dtype("<i4"),
}

_T = TypeVar("_T")

#: Values per kernel call for host memory (4 MiB of float32).
BLOCK = 1 << 20
#: The smallest padded block: smaller arrays share one compiled shape.
_MIN_BLOCK = 1 << 12


def on_cpu() -> bool:
    """Whether jax's default backend is the CPU (jax is imported to ask)."""
    import jax

    return bool(jax.default_backend() == "cpu")


# --------------------------------------------------------------------------
# the kernels
# --------------------------------------------------------------------------


def _int_type(name: str) -> np.dtype[Any]:
    try:
        return INT_TYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown integer type {name!r}; known: {sorted(INT_TYPES)}") from None


def _bounds(type_name: str) -> tuple[float, float]:
    info = np.iinfo(INT_TYPES[type_name])
    return float(info.min), float(info.max)


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
def _values_kernel(type_name: str, round_: bool) -> Callable[[Any, Any], Any]:
    """``(x f32, scale f64) -> q`` for values `_range_kernel` passed.

    Clamped to the type's range first, so the float-to-int conversion (which
    truncates towards zero) is always defined; it equals ``_rounded`` for
    every input that passes the check.
    """
    import jax
    import jax.numpy as jnp

    lo, hi = _bounds(type_name)
    wide = jnp.int64 if type_name == "i32" else jnp.int32  # holds lo - 1 .. hi + 1
    out_dtype = INT_TYPES[type_name].type

    def values(x: Any, scale: Any) -> Any:
        v = jnp.clip(x.astype(jnp.float64) * scale, lo, hi)
        t = v.astype(wide)
        if round_:
            frac = v - t.astype(jnp.float64)  # exact
            t = t + (frac >= 0.5).astype(wide) - (frac <= -0.5).astype(wide)
        return jnp.clip(t, int(lo), int(hi)).astype(out_dtype)

    return jax.jit(values)


@cache
def _range_kernel(type_name: str, round_: bool) -> Callable[[Any, Any], Any]:
    """``(x f32, scale f64) -> ok``: False when any value's ``q`` does not fit.

    ``q`` is a monotonic function of ``x`` (the float64 product rounds
    monotonically, trunc and round too), so every ``q`` fits iff ``q(min x)``
    and ``q(max x)`` do; a NaN anywhere makes both NaN (XLA's min/max
    propagate NaN) and an infinity makes one infinite, and neither fits.
    That replaces a per-element flag and an ``argmax`` over it, which XLA on
    CPU runs about three times slower than the values.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    lo, hi = _bounds(type_name)

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
def _first_bad_kernel(type_name: str, round_: bool) -> Callable[[Any, Any], Any]:
    """``(x, scale) -> index of the first element whose q does not fit`` (-1 if none).

    Only run once a check failed, to name the element; elementwise, from the
    same ``_rounded``.
    """
    import jax
    import jax.numpy as jnp

    lo, hi = _bounds(type_name)

    def first_bad(x: Any, scale: Any) -> Any:
        t = _rounded(x.astype(jnp.float64) * scale, round_)
        bad = jnp.logical_not((t >= lo) & (t <= hi)).reshape(-1)
        return jnp.where(jnp.any(bad), jnp.argmax(bad), -1)

    return jax.jit(first_bad)


# --------------------------------------------------------------------------
# quantisation
# --------------------------------------------------------------------------


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


def _checked_args(x: Any, scale: Any, type_name: str, name: str) -> Any:
    _int_type(type_name)
    if isinstance(scale, bool) or not isinstance(scale, int | np.integer):
        raise ValueError(f"{name}: the scale must be an integer, found {scale!r}")
    return _as_float32(x, name)


def _blocks(x32: Any) -> list[tuple[int, int, Any]] | None:
    """``(start, count, values)`` pieces of flat host ``x32`` for the kernels; None off the CPU.

    A jax array on an accelerator is quantised whole, where it lives (None).
    Host memory comes in `BLOCK`-value pieces, the last padded with
    zeros (which always fit) to a power of two of at least `_MIN_BLOCK`.
    """
    if _is_jax_array(x32):
        if not on_cpu():
            return None
        x32 = np.asarray(x32)  # CPU memory: no copy
    flat = x32.reshape(-1)
    pieces = []
    for start in range(0, flat.size, BLOCK):
        piece = flat[start : start + BLOCK]
        n = piece.size
        padded = max(_MIN_BLOCK, 1 << (n - 1).bit_length())
        if padded != n:
            piece = np.concatenate([piece, np.zeros(padded - n, np.float32)])
        pieces.append((start, n, piece))
    return pieces


def _on_blocks(
    fn: Callable[[tuple[int, int, Any]], _T], blocks: list[tuple[int, int, Any]]
) -> list[_T]:
    """``fn`` of every block, on this thread and the pool's (XLA's CPU kernels release the GIL)."""
    import jax

    def one(block: tuple[int, int, Any]) -> _T:
        with jax.enable_x64(True):  # thread-local: entered on each thread
            return fn(block)

    return share(pool(), cores(), one, blocks)


def _quantisation_error(
    x: Any, index: int, scale: int, type_name: str, round_: bool, name: str
) -> QuantisationError:
    shape = tuple(int(d) for d in x.shape)
    value = float(np.asarray(x).reshape(-1)[index])
    where = tuple(int(i) for i in np.unravel_index(index, shape)) if shape else ()
    product = np.float64(value) * np.float64(scale)
    info = np.iinfo(INT_TYPES[type_name])
    how = "rounded" if round_ else "truncated"
    shown = str(np.float32(value))  # the shortest repr of the float32 value
    return QuantisationError(
        f"{name}: element {index} {list(where)} = {shown} does not fit {type_name} "
        f"at scale {scale}: {shown} * {scale} = {float(product)!r} ({how}) is outside "
        f"[{info.min}, {info.max}]"
        + (" (not a finite number)" if not np.isfinite(product) else ""),
        tensor=name,
        index=index,
        position=where,
        value=value,
    )


def check_quantisable(
    x: Any, scale: int, type_name: str, *, round: bool = False, name: str = "tensor"
) -> Any:
    """Raise `QuantisationError` as `quantise` would; return ``x`` as float32.

    Runs only the range check (one reduction over ``x``); pair it with
    `quantise_async` to compute the values later.
    """
    x32 = _checked_args(x, scale, type_name, name)
    if x32.size == 0:
        return x32
    args = (type_name, bool(round))
    scale64 = np.float64(int(scale))

    def first_bad(block: tuple[int, int, Any]) -> int:
        """The flat index of the block's first value that does not fit, or -1."""
        start, _, piece = block
        if bool(_range_kernel(*args)(piece, scale64)):
            return -1
        return start + max(0, int(_first_bad_kernel(*args)(piece, scale64)))

    blocks = _blocks(x32)
    bad = [i for i in _on_blocks(first_bad, blocks or [(0, x32.size, x32)]) if i >= 0]
    if bad:
        raise _quantisation_error(x32, bad[0], int(scale), *args, name)
    return x32


class Pending:
    """A quantisation computing on the default device (or the host's threads); `result` waits for it."""

    __slots__ = ("_q", "_transpose", "nbytes", "shape")

    def __init__(self, q: Any, shape: tuple[int, ...], nbytes: int, transpose_: bool) -> None:
        self._q, self.nbytes, self._transpose = q, nbytes, transpose_
        self.shape = shape[::-1] if transpose_ else shape

    def result(self) -> np.ndarray:
        """The quantised values (C order, little-endian); the kernel's result is dropped."""
        from concurrent.futures import Future  # loaded with the first pool, not at import

        q, self._q = self._q, None
        if q is None:
            raise RuntimeError("a pending quantisation's result is taken once")
        q = np.asarray(q.result() if isinstance(q, Future) else q)
        if not self._transpose:
            return q.reshape(self.shape)
        out = np.empty(self.shape, q.dtype)
        copy_transposed(q.reshape(self.shape[::-1]).T, out)
        return out


def quantise_async(
    x32: Any, scale: int, type_name: str, *, round: bool = False, transpose: bool = False
) -> Pending:
    """Start quantising ``x32`` (float32, already `check_quantisable`); returns at once.

    jax dispatches a device's kernel asynchronously, and host blocks are
    computed by a job on the pool: the caller writes other bytes meanwhile
    and takes the values with `Pending.result`, bit for bit
    `quantise`'s.
    """
    import jax

    dtype = _int_type(type_name)
    shape = tuple(int(d) for d in x32.shape)
    if transpose and len(shape) != 2:
        raise ValueError(f"transpose takes a 2-D array, found shape {shape}")
    nbytes = int(x32.size) * dtype.itemsize
    if nbytes == 0:
        return Pending(np.zeros(shape, dtype), shape, 0, transpose)
    kernel = _values_kernel(type_name, bool(round))
    scale64 = np.float64(int(scale))
    blocks = _blocks(x32)
    if blocks is None:
        with jax.enable_x64(True):
            return Pending(kernel(x32, scale64), shape, nbytes, transpose)
    out = np.empty(x32.size, dtype)

    def fill(block: tuple[int, int, Any]) -> None:
        start, n, piece = block
        out[start : start + n] = np.asarray(kernel(piece, scale64))[:n]

    def compute() -> np.ndarray:
        _on_blocks(fill, blocks)
        return out

    return Pending(pool().submit(compute), shape, nbytes, transpose)


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
    (C order).  The result is a little-endian numpy array.

    Raises:
      QuantisationError: a value does not fit the type (or is NaN/inf); the
        message and the ``tensor``/``index``/``position``/``value``
        attributes name the first such element of ``x``.
    """
    x32 = _checked_args(x, scale, type_name, name)
    if transpose and x32.ndim != 2:
        raise ValueError(f"{name}: transpose takes a 2-D array, found shape {tuple(x32.shape)}")
    check_quantisable(x32, scale, type_name, round=round, name=name)
    return quantise_async(x32, scale, type_name, round=round, transpose=transpose).result()


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
    """The inverse of `to_buckets`: ``(N, out, in)`` to an ``(in, N*out)`` kernel."""
    shape = tuple(int(d) for d in np.shape(per_bucket))
    if len(shape) != 3:
        raise ValueError(f"expected (buckets, out, in), found shape {shape}")
    n, n_out, n_in = shape
    return transpose(np.asarray(per_bucket).reshape(n * n_out, n_in), (1, 0))
