"""pytreeio.quant: jit quantisation against a numpy float64 reference, buckets, transposes."""

from __future__ import annotations

import math
import subprocess
import sys
from fractions import Fraction

import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given

from pytreeio import quant
from pytreeio.errors import PytreeioError, QuantisationError

LIMITS = {name: np.iinfo(dt) for name, dt in quant.INT_TYPES.items()}


# --------------------------------------------------------------------------
# the reference: numpy float64, as bullet computes
# --------------------------------------------------------------------------


def reference(x: np.ndarray, scale: int, type_name: str, rnd: bool) -> tuple[np.ndarray, int]:
    """``(q, index of the first element that does not fit or -1)`` in float64 numpy."""
    with np.errstate(invalid="ignore"):  # NaN payloads, inf * 0
        v = x.astype(np.float64).reshape(-1) * np.float64(scale)
        q = np.sign(v) * np.floor(np.abs(v) + 0.5) if rnd else np.trunc(v)
        info = LIMITS[type_name]
        bad = ~((q >= info.min) & (q <= info.max))
    first = int(np.argmax(bad)) if bad.any() else -1
    out = np.where(bad, 0, q).astype(quant.INT_TYPES[type_name]).reshape(x.shape)
    return out, first


def exact(x: float, scale: int, rnd: bool) -> int:
    """trunc / round-half-away of the exact rational product (no floating point at all)."""
    v = Fraction(x) * scale
    if rnd:
        return int(math.copysign(math.floor(abs(v) + Fraction(1, 2)), v))
    return math.trunc(v)


def boundary_values(scale: int, type_name: str) -> np.ndarray:
    """float32 values at and around every edge that matters for ``scale`` and the type."""
    info = LIMITS[type_name]
    edges = [info.max, info.min, info.max + 1, info.min - 1, 0.5, -0.5, 1, -1, 1.5, -1.5]
    edges += [k + 0.5 for k in range(-3, 3)] + [info.max + 0.5, info.min - 0.5, info.max - 0.5]
    xs = []
    for e in edges:
        x = np.float32(e / scale)
        for _ in range(3):  # the neighbours on both sides
            xs.append(x)
            x = np.nextafter(x, np.float32(np.inf))
        x = np.float32(e / scale)
        for _ in range(3):
            x = np.nextafter(x, np.float32(-np.inf))
            xs.append(x)
    xs += [0.0, -0.0, 1e-45, -1e-45, 1e-38, np.float32(3.4e38)]
    return np.array(xs, np.float32)


# --------------------------------------------------------------------------
# spot values and errors (FORMATS.md)
# --------------------------------------------------------------------------


def test_spot_values_at_255() -> None:
    x = np.float32([0.5, -0.5, 1.98])
    assert quant.quantise(x, 255, "i16").tolist() == [127, -127, 504]
    assert quant.quantise(x, 255, "i16", round=True).tolist() == [128, -128, 505]


def test_overflow_names_tensor_index_and_value() -> None:
    x = np.zeros((3, 2), np.float32)
    x[2, 1] = 2.1
    with pytest.raises(QuantisationError) as info:
        quant.quantise(x, 16320, "i16", round=True, name="l1b")
    exc = info.value
    assert isinstance(exc, OverflowError) and isinstance(exc, PytreeioError)
    assert (exc.tensor, exc.index, exc.position) == ("l1b", 5, (2, 1))
    assert exc.value == float(np.float32(2.1))
    assert "l1b" in str(exc) and "element 5" in str(exc) and "2.1" in str(exc)
    assert "i16" in str(exc) and "16320" in str(exc)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_raise(bad: float) -> None:
    x = np.float32([0.0, 0.25, bad])
    with pytest.raises(QuantisationError) as info:
        quant.quantise(x, 1, "i32")
    assert info.value.index == 2
    assert "not a finite number" in str(info.value)


def test_first_bad_element_is_reported() -> None:
    x = np.float32([0.1, 300.0, -300.0, 1.0])
    with pytest.raises(QuantisationError) as info:
        quant.quantise(x, 1, "i8")
    assert info.value.index == 1


def test_float32_alone_would_differ() -> None:
    # fl32(255 * 1.0078431) rounds up to 257.0, although the product is 256.99999988...
    x = np.float32(1.0078431)
    assert np.trunc(np.float32(255) * x) == 257
    assert exact(float(x), 255, False) == 256
    assert quant.quantise(np.array([x]), 255, "i16").tolist() == [256]
    # and rounding: 64 * 0.0078124995 = 0.49999997; float32 x + 0.5 rounds to 1.0
    y = np.float32(0.0078124995)
    assert np.floor(np.float32(64) * y + np.float32(0.5)) == 1
    assert quant.quantise(np.array([y]), 64, "i16", round=True).tolist() == [0]


def test_x64_does_not_leak() -> None:
    import jax
    import jax.numpy as jnp

    quant.quantise(np.float32([0.25]), 255, "i16")
    assert not jax.config.jax_enable_x64
    assert jnp.zeros(2).dtype == jnp.float32


def test_input_dtypes() -> None:
    half = np.array([0.5, -0.25], np.float16)
    assert quant.quantise(half, 64, "i8").tolist() == [32, -16]
    bf = np.array([0.5], ml_dtypes.bfloat16)
    assert quant.quantise(bf, 64, "i8").tolist() == [32]
    with pytest.raises(TypeError, match="float64"):
        quant.quantise(np.array([0.5]), 64, "i8")
    with pytest.raises(ValueError, match="scale"):
        quant.quantise(np.float32([0.5]), 64.0, "i8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown integer type"):
        quant.quantise(np.float32([0.5]), 64, "i64")


def test_jax_input_and_empty() -> None:
    import jax.numpy as jnp

    assert quant.quantise(jnp.asarray([0.5], jnp.float32), 255, "i16").tolist() == [127]
    empty = quant.quantise(np.zeros((0, 3), np.float32), 255, "i16", transpose=True)
    assert empty.shape == (3, 0) and empty.dtype == np.int16


def test_little_endian_output() -> None:
    q = quant.quantise(np.float32([1.0]), 258, "i16")
    assert q.tobytes() == b"\x02\x01"


# --------------------------------------------------------------------------
# against the float64 reference
# --------------------------------------------------------------------------

CASES = [
    ("i8", 127),
    ("i8", 64),
    ("i16", 255),
    ("i16", 64),
    ("i16", 16320),
    ("i16", 32767),
    ("i32", 16320),
    ("i32", 255 * 64 * 64),
    ("i32", 2**31 - 1),
]


@pytest.mark.parametrize("type_name,scale", CASES)
@pytest.mark.parametrize("rnd", [False, True])
def test_boundaries_against_reference(type_name: str, scale: int, rnd: bool) -> None:
    xs = boundary_values(scale, type_name)
    want, first = reference(xs, scale, type_name, rnd)
    fits = np.array([reference(np.array([x]), scale, type_name, rnd)[1] < 0 for x in xs])
    # element by element: the kernel agrees with the reference on value and on overflow
    for x, ok, w in zip(xs, fits, want):
        if ok:
            got = quant.quantise(np.array([x]), scale, type_name, round=rnd)
            assert got.tolist() == [w], (x, scale, rnd)
            if scale < 2**29:  # float64 is exact there: the real product's trunc/round
                assert int(w) == exact(float(x), scale, rnd)
        else:
            with pytest.raises(QuantisationError):
                quant.quantise(np.array([x]), scale, type_name, round=rnd)
    assert first >= 0  # the edges include values that overflow


@pytest.mark.parametrize("type_name,scale", CASES)
@pytest.mark.parametrize("rnd", [False, True])
def test_random_data_against_reference(type_name: str, scale: int, rnd: bool) -> None:
    rng = np.random.default_rng(scale)
    info = LIMITS[type_name]
    limit = min(info.max / scale, 1e4)
    x = rng.uniform(-limit, limit, size=(97, 33)).astype(np.float32)
    # every kind of edge, and float32 values whose product lies just off an integer
    x.reshape(-1)[:20] = np.float32(np.arange(-10, 10) / scale)
    x.reshape(-1)[20:40] = np.nextafter(np.float32(np.arange(-10, 10) / scale), np.float32(1))
    x.reshape(-1)[40:60] = np.float32((np.arange(-10, 10) + 0.5) / scale)
    x = np.clip(x, -limit, limit)
    want, first = reference(x, scale, type_name, rnd)
    assert first < 0
    assert np.array_equal(quant.quantise(x, scale, type_name, round=rnd), want)
    t = quant.quantise(x, scale, type_name, round=rnd, transpose=True)
    assert t.flags.c_contiguous and np.array_equal(t, want.T)


@given(
    st.binary(min_size=4 * 40, max_size=4 * 40),  # one length: one compiled kernel per case
    st.sampled_from(CASES),
    st.booleans(),
)
def test_any_bit_pattern_against_reference(raw: bytes, case: tuple[str, int], rnd: bool) -> None:
    type_name, scale = case
    x = np.frombuffer(raw[: len(raw) // 4 * 4], "<f4").copy()
    want, first = reference(x, scale, type_name, rnd)
    if first < 0:
        assert np.array_equal(quant.quantise(x, scale, type_name, round=rnd), want)
    else:
        with pytest.raises(QuantisationError) as info:
            quant.quantise(x, scale, type_name, round=rnd)
        assert info.value.index == first


# --------------------------------------------------------------------------
# dequantisation, buckets, transposes
# --------------------------------------------------------------------------


def test_dequantise_and_error() -> None:
    x = np.float32([0.5, -0.5, 1.98])
    q = quant.quantise(x, 255, "i16", round=True)
    assert quant.dequantise(q, 255).tolist() == [128 / 255, -128 / 255, 505 / 255]
    err = quant.quantisation_error(q, 255, x)
    assert 0 < err <= 0.5 / 255
    assert quant.quantisation_error(np.zeros(0, np.int16), 255, np.zeros(0)) == 0.0
    with pytest.raises(ValueError):
        quant.quantisation_error(q, 255, x[:2])


def test_buckets() -> None:
    n_in, out, n = 5, 3, 4
    kernel = np.arange(n_in * n * out, dtype=np.float32).reshape(n_in, n * out)
    b = quant.to_buckets(kernel, n)
    assert b.shape == (n, out, n_in) and b.flags.c_contiguous
    for bucket in range(n):
        for o in range(out):
            assert np.array_equal(b[bucket, o], kernel[:, bucket * out + o])
    assert np.array_equal(quant.from_buckets(b), kernel)
    # the same bytes as bullet's transpose of the bucketed layer
    assert b.tobytes() == np.ascontiguousarray(kernel.T).tobytes()
    with pytest.raises(ValueError):
        quant.to_buckets(kernel, 5)


def test_transpose_api_kept() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert np.array_equal(quant.transpose(x, (1, 0)), x.T)
    assert np.asarray(quant.transpose_to_device(x, (1, 0))).shape == (4, 3)
    assert quant.transpose(np.arange(3), (0,)).tolist() == [0, 1, 2]


def test_device_and_host_transposes_agree() -> None:
    # a jax array is quantised by the jit kernel and transposed by a second one; a numpy
    # array on the host: both give the same bytes
    import jax

    x = np.random.default_rng(5).uniform(-2, 2, (37, 11)).astype(np.float32)
    on_device = quant.quantise(jax.device_put(x), 255, "i16", round=True, transpose=True)
    on_host = quant.quantise(x, 255, "i16", round=True, transpose=True)
    assert on_device.tobytes() == on_host.tobytes() and on_host.shape == (11, 37)


def test_a_numpy_transpose_does_not_import_jax() -> None:
    # Asking jax where it computes costs its import (a second or more); a numpy array is
    # transposed on the host unless jax is already in use.
    code = (
        "import sys, numpy as np\n"
        "from pytreeio import quant\n"
        "x = np.arange(6 * 5, dtype='>f4').reshape(6, 5)\n"
        "y = quant.transpose(x, (1, 0))\n"
        "assert y.dtype == np.dtype('<f4') and y.flags.c_contiguous\n"
        "assert y.tobytes() == x.T.astype('<f4').tobytes()\n"
        "assert 'jax' not in sys.modules, 'jax imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
