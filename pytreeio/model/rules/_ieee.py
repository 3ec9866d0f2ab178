"""Correctly rounded division, square root and power for the rules, on every backend.

The foreign trainers divide and take square roots in float32 as IEEE 754
says: correctly rounded.  XLA's CPU backend does too, but its CUDA backend
uses faster approximations (measured on an H100 with jax 0.11: 29% of
random float32 quotients and 17% of square roots are an ulp or more off),
and the error survives the cancellation in ``p_new - p`` as hundreds of ulps.

On CUDA and ROCm these helpers therefore compute in float64 and round once to
the operands' dtype.  For float32 (or narrower) operands that is the correctly
rounded result: the float64 quotient or root is itself correctly rounded, and
rounding a correctly rounded result of ``/`` or ``sqrt`` again to a format of
p bits is innocuous when the wider one has at least 2p+2 bits (53 >= 2*24+2).
Elsewhere (CPU, where the native operation is already exact; TPU, which has
no float64) the native operation runs, so CPU code keeps its float32
arithmetic (a division by a broadcast scalar excepted, see `div`).
`jax.lax.platform_dependent` picks the branch when the computation is
lowered, so one traced function is exact on whichever device runs it.

The conversions are wrapped in a no-op ``nextafter(y, y)`` on both sides.
XLA's GPU compiler narrows ``f32(f64(a) / f64(b))`` back to its approximate
float32 division (measured: the plain widened division was exactly as wrong
as the native one), and it could drop a ``f32 -> f64`` convert directly
following a ``f64 -> f32`` one ("excess precision"), skipping the rounding
when one helper's result feeds the next; it sees through neither barrier.

Not covered: XLA's CPU backend flushes subnormal float32 results to zero
(the GPU one does not), which no per-operation barrier changes.

jax is imported when a helper is traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["div", "sqrt", "power", "libm_powf"]

_WIDE_PLATFORMS = ("cuda", "rocm")


def _x64() -> Any:
    """A context manager enabling float64 while tracing (``jax.enable_x64``; older jax: experimental)."""
    import jax

    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # older jax kept it in jax.experimental
        import importlib

        enable = importlib.import_module("jax.experimental").enable_x64
    return enable(True)


def _opaque(x: Any) -> Any:
    """``x`` itself, as a value XLA cannot trace back to the conversion that made it."""
    from jax import lax

    return lax.nextafter(x, x)


def _wide(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` evaluated in float64 on the arguments, rounded once to the first one's dtype."""

    def run(*args: Any) -> Any:
        import jax.numpy as jnp
        from jax import lax

        dtype = args[0].dtype
        if dtype == jnp.float64:
            return op(*args)
        with _x64():
            wide = [_opaque(lax.convert_element_type(a, jnp.float64)) for a in args]
            out = lax.convert_element_type(op(*wide), dtype)
        return _opaque(out)

    return run


def _dispatch(op: Callable[..., Any], args: tuple[Any, ...], wide_on: tuple[str, ...]) -> Any:
    import jax.numpy as jnp
    from jax import lax

    dtype = jnp.result_type(*args)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"expected floating-point operands, got {dtype}")
    args = tuple(jnp.broadcast_arrays(*(jnp.asarray(a, dtype) for a in args)))
    wide = _wide(op)
    return lax.platform_dependent(*args, default=op, **dict.fromkeys(wide_on, wide))


def div(a: Any, b: Any) -> Any:
    """``a / b`` correctly rounded (operands promoted and broadcast as jnp does).

    XLA turns a division by a broadcast scalar into a multiplication by its
    reciprocal, on every backend.  So such a division runs widened on CPU
    too: ``a * (1/s)`` in float64, rounded once, is still ``a / s``
    correctly rounded (its error, under 2^-52 relative, is smaller than the
    distance of any float32 quotient from a float32 rounding midpoint).
    """
    import numpy as np
    from jax import lax

    wide_on: tuple[str, ...] = _WIDE_PLATFORMS
    if np.size(b) < np.size(a):
        wide_on = ("cpu", *wide_on)
    return _dispatch(lax.div, (a, b), wide_on)


def _opaque_sqrt(x: Any) -> Any:
    from jax import lax

    # XLA rewrites a / sqrt(b) as a * rsqrt(b) (an approximation); behind a
    # no-op nextafter the root is a plain value it must divide by.
    return _opaque(lax.sqrt(x))


def sqrt(x: Any) -> Any:
    """``sqrt(x)`` correctly rounded in ``x``'s dtype, safe to divide by (no rsqrt rewrite)."""

    return _dispatch(_opaque_sqrt, (x,), _WIDE_PLATFORMS)


def libm_powf(base: Any, exponent: Any) -> Any:
    """``base ** exponent`` (promoted as jnp does) as a C ``powf`` computes it, as near as each backend allows.

    On CPU XLA's float32 ``pow`` gives the bits of glibc's ``powf`` (what
    Rust's ``f32::powf`` and numpy's float32 power call on Linux); checked
    for ``beta**t``, t up to 10^6, over the usual betas.  On CUDA/ROCm the
    native ``pow`` is another approximation, so there the power is computed
    in float64 and rounded, which is what ``powf`` returns except where
    ``powf`` itself is not correctly rounded (it is accurate to 0.82 ulp).
    """
    from jax import lax

    return _dispatch(lax.pow, (base, exponent), _WIDE_PLATFORMS)


def power(base: Any, exponent: Any) -> Any:
    """``base ** exponent`` computed in float64 and rounded once to the operands' dtype.

    This is how a system that raises a single-float in double precision gets
    ``beta^n`` (cl-waffe2 on SBCL), on CPU and GPU alike; TPU, lacking
    float64, uses its native power.
    """
    from jax import lax

    return _dispatch(lax.pow, (base, exponent), ("cpu", *_WIDE_PLATFORMS))
