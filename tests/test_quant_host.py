"""pytreeio.quant on the host (numpy blocks, float32 where exact; compiled kernels) against the float64 definition."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pytreeio import quant, quant_host
from pytreeio.errors import QuantisationError

CASES = [
    ("i8", 127),
    ("i8", 64),
    ("i16", 255),
    ("i16", 64),
    ("i16", 16320),
    ("i16", 2**24 - 1),  # the largest float32-exact scale
    ("i16", 2**24 + 1),  # not a float32: float64 throughout
    ("i32", 255),
    ("i32", 255 * 64 * 64),
    ("i32", 2**31 - 1),
]


def definition(x: np.ndarray, scale: int, type_name: str, rnd: bool) -> tuple[np.ndarray, bool]:
    """``(q, every value fits)``: the float64 product, trunc or half-away rounding (exact steps)."""
    with np.errstate(all="ignore"):
        v = x.astype(np.float64) * np.float64(scale)
        t = np.trunc(v)
        if rnd:
            t += np.where(np.abs(v - t) >= 0.5, np.sign(v), 0.0)
        info = np.iinfo(quant.INT_TYPES[type_name])
        fits = (t >= info.min) & (t <= info.max)
        return np.where(fits, t, 0).astype(quant.INT_TYPES[type_name]), bool(fits.all())


def adversarial(scale: int, type_name: str) -> np.ndarray:
    """float32 values whose product lies on, or one ulp off, every integer and half-integer edge."""
    info = np.iinfo(quant.INT_TYPES[type_name])
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


def fitting(x: np.ndarray, scale: int, type_name: str, rnd: bool) -> np.ndarray:
    """``x`` with every value that does not fit replaced by 0."""
    with np.errstate(all="ignore"):
        v = x.astype(np.float64) * scale
        t = np.trunc(v)
        if rnd:
            t += np.where(np.abs(v - t) >= 0.5, np.sign(v), 0.0)
    info = np.iinfo(quant.INT_TYPES[type_name])
    return np.where((t >= info.min) & (t <= info.max), x, np.float32(0))


# every test on the numpy path and on the compiled kernels (at every size)
pytestmark = pytest.mark.usefixtures("kernel_backend")


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 64 values, threads from 2 blocks on: every path on small arrays."""
    monkeypatch.setattr(quant_host, "BLOCK", 64)
    monkeypatch.setattr(quant_host, "_COMPILED_BLOCK", 64)
    monkeypatch.setattr(quant_host, "_PARALLEL_BLOCKS", 2)


def test_numpy_input_runs_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # whatever jax computes on (an accelerator too), numpy values never go to a jax kernel
    def no_kernel(*args: object) -> None:
        raise AssertionError("a jax kernel was called for numpy input")

    for kernel in ("_quantise_kernel", "_values_kernel", "_range_kernel"):
        monkeypatch.setattr(quant, kernel, no_kernel)
    monkeypatch.setattr(quant, "on_cpu", lambda: False)  # as on a GPU machine
    x = np.float32([0.5, 1.0, -0.5])
    assert quant.quantise_async(x, 255, "i16").result().tolist() == [127, 255, -127]
    assert quant.quantise(x, 255, "i16", round=True).tolist() == [128, 255, -128]
    bands = quant.quantise_bands([(x, 255, "i16", False, False)])
    assert bands is not None and bands.take(0).view("<i2").tolist() == [127, 255, -127]


@pytest.mark.parametrize("type_name,scale", CASES)
@pytest.mark.parametrize("rnd", [False, True])
@pytest.mark.parametrize("blocks", ["one", "many"])
def test_adversarial_against_definition(
    type_name: str, scale: int, rnd: bool, blocks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if blocks == "many":
        monkeypatch.setattr(quant_host, "BLOCK", 64)
        monkeypatch.setattr(quant_host, "_COMPILED_BLOCK", 64)
        monkeypatch.setattr(quant_host, "_PARALLEL_BLOCKS", 2)
    x = fitting(adversarial(scale, type_name), scale, type_name, rnd)
    rng = np.random.default_rng(scale)
    x = x[rng.permutation(x.size)]  # flagged elements spread over the blocks
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
    info = np.iinfo(quant.INT_TYPES[type_name])
    xs = []
    for centre in (1 / scale, 0.5 / scale, 1.0078431, (info.max - 0.5) / scale):
        start = int(np.float32(centre).view(np.int32)) - (1 << 17)
        bits = np.arange(start, start + (1 << 18), dtype=np.int32)
        xs += [bits.view(np.float32), -bits.view(np.float32)]
    x = fitting(np.concatenate(xs), scale, type_name, rnd)
    want, _ = definition(x, scale, type_name, rnd)
    assert np.array_equal(quant.quantise(x, scale, type_name, round=rnd), want)


@pytest.mark.parametrize("type_name,scale", CASES)
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


@pytest.mark.parametrize("rnd", [False, True])
def test_float64_fallbacks(rnd: bool, small_blocks: None) -> None:
    # all-zero blocks (truncation flags every element), i32 blocks above 2**22, small ones
    x = np.zeros(64 * 9, np.float32)
    x[64:128] = np.float32(3e6) + np.arange(64, dtype=np.float32) * 0.25  # |Q*x| >= 2**22
    x[128:192] = np.float32(0.5)
    x[192:] = np.random.default_rng(1).uniform(-10, 10, x[192:].size).astype(np.float32)
    for type_name, scale in (("i32", 255), ("i32", 1), ("i16", 3)):
        y = fitting(x, scale, type_name, rnd)
        want, ok = definition(y, scale, type_name, rnd)
        assert ok
        assert np.array_equal(quant.quantise(y, scale, type_name, round=rnd), want)


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


def test_min_max() -> None:
    x = np.random.default_rng(3).standard_normal(300_000).astype(np.float32)
    assert quant_host.min_max(x) == (float(x.min()), float(x.max()))
    x[123_456] = np.nan
    lo, hi = quant_host.min_max(x)
    assert np.isnan(lo) and np.isnan(hi)


def test_jax_array_on_the_host() -> None:
    import jax.numpy as jnp

    x = np.random.default_rng(4).uniform(-3, 3, (50, 30)).astype(np.float32)
    want, _ = definition(x, 255, "i16", True)
    q = quant.quantise(jnp.asarray(x), 255, "i16", round=True, transpose=True)
    assert np.array_equal(q, want.T)


@pytest.mark.parametrize(
    "values",
    [
        [1.0, 2.0, 0.5],  # every sign bit clear
        [-1.0, -2.0, -0.5],  # every sign bit set
        [0.0, -0.0],
        [-0.0],
        [np.inf, -np.inf, 3.0],
        [-1e-45, 1e-45],
    ],
)
def test_min_max_signs(values: list[float]) -> None:
    """Both sign views of the compiled pass (int32 and uint32 bits) give the float extremes."""
    x = np.resize(np.float32(values), 70_000)
    assert quant_host.min_max(x) == (float(x.min()), float(x.max()))


@pytest.mark.parametrize("nan_bits", [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001])
@pytest.mark.parametrize("others", [[1.0, 2.0], [-1.0, -2.0], [-1.0, 2.0]])
def test_min_max_nan_of_either_sign(nan_bits: int, others: list[float]) -> None:
    x = np.resize(np.float32(others), 70_000)
    x.view(np.uint32)[40_000] = nan_bits
    lo, hi = quant_host.min_max(x)
    assert np.isnan(lo) and np.isnan(hi)


# --------------------------------------------------------------------------
# bands (quantisation streamed ahead of a writer)
# --------------------------------------------------------------------------

BAND_JOBS = [
    ((300, 170), "i16", 255, True, True),
    ((1000,), "i8", 64, False, False),
    ((64, 64), "i32", 255 * 64 * 64, True, True),
    ((17, 5), "i32", 2**24 + 1, False, True),  # not a float32 scale: float64 throughout
    ((0, 4), "i16", 3, True, True),
    ((5000,), "i16", 255, False, False),
    ((33, 1), "i16", 255, True, True),
]


def band_jobs() -> list[tuple[np.ndarray, int, str, bool, bool]]:
    rng = np.random.default_rng(5)
    out = []
    for shape, type_name, scale, rnd, transpose in BAND_JOBS:
        x = (rng.standard_normal(shape) * 0.4).astype(np.float32)
        x = fitting(x, scale, type_name, rnd)
        x[..., :1] = adversarial(scale, type_name)[: x[..., :1].size].reshape(x[..., :1].shape)
        out.append((fitting(x, scale, type_name, rnd), scale, type_name, rnd, transpose))
    return out


def bands_of(jobs: Any, band_bytes: int, ahead_bytes: int) -> quant_host.Bands:
    host = [quant_host.BandJob(x, s, quant.INT_TYPES[t], r, tr) for x, s, t, r, tr in jobs]
    return quant_host.Bands(host, band_bytes=band_bytes, ahead_bytes=ahead_bytes)


@pytest.mark.parametrize("band_bytes,ahead_bytes", [(64, 256), (1000, 3000), (1 << 20, 1 << 25)])
def test_bands_give_quantise_bits(band_bytes: int, ahead_bytes: int) -> None:
    jobs = band_jobs()
    bands = bands_of(jobs, band_bytes, ahead_bytes)
    bands.start()
    got = [bytes(bands.take(b)) for b in range(sum(len(r) for r in bands.of_job))]
    for j, (x, scale, type_name, rnd, transpose) in enumerate(jobs):
        want = quant.quantise(x, scale, type_name, round=rnd, transpose=transpose)
        have = b"".join(got[b] for b in bands.of_job[j])
        assert have == want.tobytes(), BAND_JOBS[j]
        assert [bands.nbytes(b) for b in bands.of_job[j]] == [len(got[b]) for b in bands.of_job[j]]


def test_bands_out_of_order_and_again() -> None:
    """Bands taken out of order, or a second time, come out the same (computed anew)."""
    jobs = band_jobs()
    bands = bands_of(jobs, 500, 2000)
    n = sum(len(r) for r in bands.of_job)
    order = [n - 1, 5, 3, *range(n), 7, n - 1]
    got = {}
    for b in order:
        data = bytes(bands.take(b))
        assert got.setdefault(b, data) == data
    reference = bands_of(jobs, 500, 2000)
    assert all(got[b] == bytes(reference.take(b)) for b in range(n))


def test_bands_reuse_a_bounded_set_of_buffers() -> None:
    jobs = band_jobs()
    bands = bands_of(jobs, 1000, 4000)
    state = bands._state
    n = sum(len(r) for r in bands.of_job)
    kept = bands.take(0)  # held by the caller: never reused, another buffer replaces it
    first = bytes(kept)
    seen = set()
    for b in range(1, n):
        view = bands.take(b)
        seen.add(view.base.__array_interface__["data"][0])
        assert state.owned <= state.capacity + 1
        del view
    assert len(seen) <= state.capacity + 1 < n
    assert bytes(kept) == first


def test_bands_start_without_a_writer_and_stop_when_dropped() -> None:
    import gc
    import threading

    bands = bands_of(band_jobs(), 64, 256)
    bands.start()
    state = bands._state
    del bands
    gc.collect()
    with state.cond:
        assert state.closed
    for t in threading.enumerate():
        if t.name == "pytreeio-bands":
            t.join(5)
    assert not any(t.name == "pytreeio-bands" and t.is_alive() for t in threading.enumerate())
