"""pytreeio.model.rules._ieee: division, square root and powers rounded as IEEE 754 / libm round them,
under jax.jit, on whichever backend runs the tests (CPU here, CUDA on a GPU machine)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pytreeio.model.rules import _ieee

F32 = np.float32
BACKEND = jax.default_backend()


def _normal_f32(rng: np.random.Generator, n: int, low: float, high: float) -> np.ndarray:
    """Random float32 magnitudes spread log-uniformly over [10^low, 10^high], random signs."""
    mag = 10.0 ** rng.uniform(low, high, n)
    return (mag * rng.choice([-1.0, 1.0], n)).astype(F32)


def _bits(x: object) -> np.ndarray:
    return np.asarray(x, F32).view(np.int32)


def test_division_is_correctly_rounded() -> None:
    rng = np.random.default_rng(0)
    a = _normal_f32(rng, 1 << 15, -12, 12)
    b = _normal_f32(rng, 1 << 15, -12, 12)
    assert np.array_equal(_bits(jax.jit(_ieee.div)(a, b)), _bits(a / b))
    # a divisor that is one traced scalar (XLA would multiply by its reciprocal)
    s = jnp.asarray(F32(0.271))
    assert np.array_equal(_bits(jax.jit(_ieee.div)(a, s)), _bits(a / F32(0.271)))
    # a Python number promotes to the array's dtype, as with jnp
    one_over = jax.jit(lambda x: _ieee.div(1, x))(b)
    assert one_over.dtype == jnp.float32
    assert np.array_equal(_bits(one_over), _bits(F32(1) / b))


def test_square_root_is_correctly_rounded_and_safe_to_divide_by() -> None:
    rng = np.random.default_rng(1)
    x = np.abs(_normal_f32(rng, 1 << 15, -30, 30))
    y = _normal_f32(rng, 1 << 15, -10, 10)
    assert np.array_equal(_bits(jax.jit(_ieee.sqrt)(x)), _bits(np.sqrt(x)))
    # a / sqrt(b) is not turned into a * rsqrt(b); one result feeds the next exactly
    got = jax.jit(lambda p, q: _ieee.div(p, _ieee.sqrt(q)))(y, x)
    assert np.array_equal(_bits(got), _bits(y / np.sqrt(x)))


def test_power_is_float64_rounded_once() -> None:
    t = np.arange(1, 3001, dtype=F32)
    for beta in (0.9, 0.999, 0.8, 0.99, 0.9999):
        b = F32(beta)
        want = np.array([F32(math.pow(float(b), float(n))) for n in t], F32)
        got = jax.jit(lambda n, b=b: _ieee.power(b, n))(t)
        normal = want >= np.finfo(F32).tiny  # XLA's CPU backend flushes subnormals to zero
        assert np.array_equal(_bits(got)[normal], _bits(want)[normal]), beta


def test_libm_powf_gives_the_bias_corrections_of_c_powf() -> None:
    """``1 - beta**t`` as a C program computing ``powf`` in float32 gets it, for the first
    2000 steps (CPU: powf's own bits; GPU: the float64 power rounded, see _ieee)."""
    t = np.arange(1, 2001, dtype=F32)
    one = F32(1)
    for beta in (0.9, 0.999, 0.8, 0.99, 0.95):
        b = F32(beta)
        powf = np.array([b**n for n in t], F32)  # numpy's float32 scalar power: C powf
        got = np.asarray(jax.jit(lambda n, b=b: _ieee.libm_powf(b, n))(t))
        assert np.array_equal(_bits(one - got), _bits(one - powf)), beta
        if BACKEND == "cpu":
            normal = powf >= np.finfo(F32).tiny
            assert np.array_equal(_bits(got)[normal], _bits(powf)[normal]), beta


@pytest.mark.skipif(BACKEND != "cpu", reason="what runs on CPU")
def test_cpu_runs_the_native_float32_operations() -> None:
    x = jnp.ones(16, jnp.float32)
    for fn in (_ieee.div, lambda p, q: _ieee.div(p, _ieee.sqrt(q))):
        hlo = jax.jit(fn).lower(x, x).compile().as_text()
        assert "f64" not in hlo and "conditional" not in hlo


def test_integer_operands_are_refused() -> None:
    with pytest.raises(TypeError, match="floating"):
        _ieee.div(jnp.arange(3), 2)
