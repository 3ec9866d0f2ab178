"""pytreeio.core.quant: jit quantisation (whole, and host blocks) against float64 references, buckets, transposes."""

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

from pytreeio.core import quant
from pytreeio.core.errors import PytreeioError, QuantisationError

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
# host memory in blocks (padded to shared shapes) against the float64 definition
# --------------------------------------------------------------------------

HOST_CASES = [*CASES, ("i16", 2**24 - 1), ("i16", 2**24 + 1), ("i32", 255)]


def definition(x: np.ndarray, scale: int, type_name: str, rnd: bool) -> tuple[np.ndarray, bool]:
    """``(q, every value fits)``: the float64 product, trunc or half-away rounding (exact steps)."""
    with np.errstate(all="ignore"):
        v = x.astype(np.float64) * np.float64(scale)
        t = np.trunc(v)
        if rnd:
            t += np.where(np.abs(v - t) >= 0.5, np.sign(v), 0.0)
        info = LIMITS[type_name]
        fits = (t >= info.min) & (t <= info.max)
        return np.where(fits, t, 0).astype(quant.INT_TYPES[type_name]), bool(fits.all())


def fitting(x: np.ndarray, scale: int, type_name: str, rnd: bool) -> np.ndarray:
    """``x`` with every value that does not fit replaced by 0."""
    with np.errstate(all="ignore"):
        v = x.astype(np.float64) * scale
        t = np.trunc(v)
        if rnd:
            t += np.where(np.abs(v - t) >= 0.5, np.sign(v), 0.0)
    info = LIMITS[type_name]
    return np.where((t >= info.min) & (t <= info.max), x, np.float32(0))


def adversarial(scale: int, type_name: str) -> np.ndarray:
    """float32 values whose product lies on, or one ulp off, every integer and half-integer edge."""
    info = LIMITS[type_name]
    top = min(float(info.max), 2.0**24)
    ks = np.concatenate([np.arange(-40, 41), np.geomspace(1, top, 60), -np.geomspace(1, top, 60)])
    edges = np.concatenate([ks, ks + 0.5, [info.max, info.min, info.max + 0.5, info.min - 0.5]])
    centre = (edges / scale).astype(np.float32)
    xs = [centre]
    up, down = centre.copy(), centre.copy()
    for _ in range(3):
        up = np.nextafter(up, np.float32(np.inf))
        down = np.nextafter(down, np.float32(-np.inf))
        xs += [up, down]
    tiny = np.float32([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 1.1754942e-38])
    return np.concatenate([*xs, tiny])


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 64 values, padded to 16 or more: every path on small arrays."""
    monkeypatch.setattr(quant, "BLOCK", 64)
    monkeypatch.setattr(quant, "_MIN_BLOCK", 16)


@pytest.mark.parametrize("type_name,scale", HOST_CASES)
@pytest.mark.parametrize("rnd", [False, True])
@pytest.mark.parametrize("blocks", ["one", "many"])
def test_adversarial_against_definition(
    type_name: str, scale: int, rnd: bool, blocks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if blocks == "many":
        monkeypatch.setattr(quant, "BLOCK", 64)
        monkeypatch.setattr(quant, "_MIN_BLOCK", 16)
    x = fitting(adversarial(scale, type_name), scale, type_name, rnd)
    x = x[np.random.default_rng(scale).permutation(x.size)]  # edges spread over the blocks
    want, ok = definition(x, scale, type_name, rnd)
    assert ok
    assert np.array_equal(quant.quantise(x, scale, type_name, round=rnd), want)
    x2 = x[: x.size // 7 * 7].reshape(-1, 7)
    t = quant.quantise(x2, scale, type_name, round=rnd, transpose=True)
    assert t.flags.c_contiguous and np.array_equal(t, want[: x2.size].reshape(-1, 7).T)
    checked = quant.check_quantisable(x2, scale, type_name, round=rnd)
    q = quant.quantise_async(checked, scale, type_name, round=rnd, transpose=True).result()
    assert q.tobytes() == t.tobytes()


@pytest.mark.parametrize("type_name,scale", [("i8", 127), ("i16", 255), ("i32", 2**20 + 1)])
@pytest.mark.parametrize("rnd", [False, True])
def test_dense_bit_ranges(type_name: str, scale: int, rnd: bool) -> None:
    """Every float32 in 2**18-wide bit ranges at 1/Q, 0.5/Q and near the type's top."""
    info = LIMITS[type_name]
    xs = []
    for centre in (1 / scale, 0.5 / scale, 1.0078431, (info.max - 0.5) / scale):
        start = int(np.float32(centre).view(np.int32)) - (1 << 17)
        bits = np.arange(start, start + (1 << 18), dtype=np.int32)
        xs += [bits.view(np.float32), -bits.view(np.float32)]
    x = fitting(np.concatenate(xs), scale, type_name, rnd)
    want, _ = definition(x, scale, type_name, rnd)
    assert np.array_equal(quant.quantise(x, scale, type_name, round=rnd), want)


@pytest.mark.parametrize("type_name,scale", HOST_CASES)
@pytest.mark.parametrize("rnd", [False, True])
def test_random_bit_patterns(type_name: str, scale: int, rnd: bool, small_blocks: None) -> None:
    rng = np.random.default_rng(scale + rnd)
    x = rng.integers(0, 2**32, 20_000, dtype=np.uint32).view(np.float32)
    x = fitting(x, scale, type_name, rnd)  # NaN, inf and huge values become 0
    x[::3] = rng.uniform(-1, 1, x[::3].size).astype(np.float32) * np.float32(1000 / scale)
    x = fitting(x, scale, type_name, rnd)
    want, ok = definition(x, scale, type_name, rnd)
    assert ok
    assert np.array_equal(quant.quantise(x, scale, type_name, round=rnd), want)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e6, -1e6])
@pytest.mark.parametrize("where", [0, 200, 575])
def test_errors_name_the_first_element(bad: float, where: int, small_blocks: None) -> None:
    x = np.random.default_rng(2).uniform(-1, 1, 576).astype(np.float32)
    x[where] = bad
    x[where + 1 :: 97] = bad
    for call in (
        lambda: quant.quantise(x, 255, "i16", round=True, name="w"),
        lambda: quant.check_quantisable(x, 255, "i16", round=True, name="w"),
    ):
        with pytest.raises(QuantisationError) as info:
            call()
        assert (info.value.tensor, info.value.index) == ("w", where)


def test_sizes_share_a_few_compiled_shapes(small_blocks: None) -> None:
    # padded blocks: 1..300 values compile 16, 32 and 64 only, not one kernel per size
    kernel = quant._values_kernel("i8", True)
    before = kernel._cache_size()
    rng = np.random.default_rng(6)
    for n in range(1, 301):
        x = rng.uniform(-1, 1, n).astype(np.float32)
        assert np.array_equal(
            quant.quantise(x, 100, "i8", round=True), definition(x, 100, "i8", True)[0]
        )
    assert kernel._cache_size() - before <= 3


def test_jax_array_on_the_host() -> None:
    import jax.numpy as jnp

    x = np.random.default_rng(4).uniform(-3, 3, (50, 30)).astype(np.float32)
    want, _ = definition(x, 255, "i16", True)
    q = quant.quantise(jnp.asarray(x), 255, "i16", round=True, transpose=True)
    assert np.array_equal(q, want.T)


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
        "from pytreeio.core import quant\n"
        "x = np.arange(6 * 5, dtype='>f4').reshape(6, 5)\n"
        "y = quant.transpose(x, (1, 0))\n"
        "assert y.dtype == np.dtype('<f4') and y.flags.c_contiguous\n"
        "assert y.tobytes() == x.T.astype('<f4').tobytes()\n"
        "assert 'jax' not in sys.modules, 'jax imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
