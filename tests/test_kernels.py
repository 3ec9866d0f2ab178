"""The compiled kernels (pytreeio.kernels): exact rounding, dispatch, the switch, lazy import, caches."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pytreeio import kernels, quant, quant_host, transpose
from pytreeio.pools import Warming

needs_numba = pytest.mark.skipif(not kernels.available(), reason="numba is not installed")
ROOT = Path(__file__).resolve().parents[1]


def half_away(v: np.ndarray) -> np.ndarray:
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= 0.5, np.sign(v), 0.0)


@needs_numba
def test_round_half_away_on_every_edge_double() -> None:
    from pytreeio import _numba_kernels as nk

    # each half-integer and integer edge, and the doubles 1-3 ulps either side of it
    edges = np.concatenate([np.arange(-6, 6.5, 0.5), [2.0**22 + 0.5, 2.0**31 - 0.5, 2.0**51 + 0.5]])
    vs = [edges]
    up, down = edges.copy(), edges.copy()
    for _ in range(3):
        up, down = np.nextafter(up, np.inf), np.nextafter(down, -np.inf)
        vs += [up, down]
    v = np.concatenate([*vs, [0.5 - 2.0**-54, -(0.5 - 2.0**-54), 0.0, -0.0, 2.0**53 - 1]])
    got = np.array([nk._q_round(float(e), 1.0) for e in v])
    assert np.array_equal(got, half_away(v))
    got_t = np.array([nk._q_trunc(float(e), 1.0) for e in v])
    assert np.array_equal(got_t, np.trunc(v))


@needs_numba
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32])
@pytest.mark.parametrize("rnd", [False, True])
def test_kernels_count_what_does_not_fit(dtype: type, rnd: bool) -> None:
    info = np.iinfo(dtype)
    x = np.float32([0.0, 1.5, -2.5, info.max + 0.49, info.min - 0.49, np.nan, np.inf, -np.inf])
    x = np.concatenate([x, np.float32([info.max + 1.0, info.min - 1.0])])
    out = np.empty(x.size, dtype)
    with np.errstate(invalid="ignore"):
        v = x.astype(np.float64)
        want = half_away(v) if rnd else np.trunc(v)
        fits = (want >= info.min) & (want <= info.max)
    assert kernels.quantise(x, out, 1, rnd) == int((~fits).sum())
    assert np.array_equal(out[fits], want[fits].astype(dtype))


@needs_numba
@pytest.mark.parametrize("dtype", ["<f4", ">f8", "<i2", "|u1", "|b1", "<c8"])
def test_transpose_every_itemsize_and_odd_ranges(dtype: str) -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (70, 45 * np.dtype(dtype).itemsize), dtype=np.uint8).view(dtype)
    if np.dtype(dtype).kind == "b":
        a = a.view(np.uint8) & 1
        a = a.view(dtype)
    out = np.zeros(a.shape[::-1], a.dtype)
    assert kernels.transposable(a.T, out)
    for start, stop in ((0, 7), (7, 40), (40, 45)):  # ranges not on tile edges
        kernels.transpose(a.T, out, start, stop)
    assert out.tobytes() == a.T.copy().tobytes()
    strided = a[::2, ::-3].T  # any strides
    out2 = np.empty(strided.shape, a.dtype)
    kernels.transpose(strided, out2, 0, out2.shape[0])
    assert out2.tobytes() == strided.copy().tobytes()


@needs_numba
@pytest.mark.parametrize("bits", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize(
    "shape", [(1, 1), (1, 300), (300, 1), (16, 16), (33, 17), (17, 530), (530, 47), (512, 272)]
)
def test_register_blocks_and_edges_give_numpy_bits(bits: type, shape: tuple[int, int]) -> None:
    """Whole register blocks, partial tiles, 1-row/1-col and ranges off the tile grid."""
    from pytreeio import _numba_kernels as nk

    a = np.random.default_rng(shape[0]).integers(0, np.iinfo(bits).max, shape, dtype=bits)
    want = a.T.copy()
    rows = a.shape[1]
    cuts = sorted({0, rows, *(c for c in (3, 8, nk.TILE + 5, rows // 2) if c < rows)})
    out = np.zeros(want.shape, a.dtype)
    for start, stop in itertools.pairwise(cuts):
        kernels.transpose(a.T, out, start, stop)
    assert out.tobytes() == want.tobytes()
    # a source whose rows are contiguous but not adjacent (a column slice), and a
    # destination band: blocks read with the source's row stride
    sub = a[:, 1:]
    out2 = np.full(sub.T.shape, 7, a.dtype)
    kernels.transpose(sub.T, out2, 0, out2.shape[0])
    assert out2.tobytes() == sub.T.copy().tobytes()


@needs_numba
@pytest.mark.parametrize("bits", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_pieces_on_4k_strides_give_numpy_bits(bits: type) -> None:
    """Row strides of whole 4 KiB (power-of-two widths) take the 2n x 2n pieces: same bits.

    Row ranges off the piece and tile grid, and a destination wider than the
    last whole piece (a column slice of a 4 KiB-stride array), cover the edges.
    """
    from pytreeio import _numba_kernels as nk

    side = 4096 // np.dtype(bits).itemsize
    rng = np.random.default_rng(5)
    a = rng.integers(0, np.iinfo(bits).max, (side, side), dtype=bits)
    want = a.T.copy()
    out = np.zeros(want.shape, a.dtype)
    inner = (5, nk.TILE // 2 - 3, nk.TILE - 3, nk.TILE + 2 * nk.BLOCK[8 * a.itemsize] + 1)
    cuts = sorted({0, side, *(c for c in inner if c < side)})
    for start, stop in itertools.pairwise(cuts):
        kernels.transpose(a.T, out, start, stop)
    assert out.tobytes() == want.tobytes()
    sub = a[: side - 3, :]  # out rows keep the 4 KiB stride, its width ends mid-piece
    out2 = np.zeros((side, side), a.dtype)[:, : side - 3]
    kernels.transpose(sub.T, out2, 0, side)
    assert out2.tobytes() == sub.T.copy().tobytes()


@needs_numba
def test_register_block_is_a_transpose_for_every_width() -> None:
    """The shuffle network alone, on one block of each width: every lane lands once."""
    from pytreeio import _numba_kernels as nk

    for nbits, n in nk.BLOCK.items():
        dtype = np.dtype(f"u{nbits // 8}")
        a = (np.arange(n * n, dtype=np.uint64) % 251).astype(dtype).reshape(n, n)
        out = np.zeros((n, n), dtype)
        nk.transpose_rows(a, out, 0, n, n)
        assert np.array_equal(out, a.T), nbits


@needs_numba
def test_streaming_and_side_by_side_register_blocks_give_the_same_bits() -> None:
    """Every block width, plain and non-temporal (16-byte stores on 64-byte aligned rows), one
    block and two side by side (``out[i:i+n, j:j+2n]``): nothing written outside its block."""
    from pytreeio import _numba_kernels as nk

    @nk.numba.njit
    def one(a: np.ndarray, out: np.ndarray) -> None:
        nk._block_stream(a, out, 0, 0)
        nk._fence()

    @nk.numba.njit
    def two(a: np.ndarray, out: np.ndarray, stream: bool) -> None:
        if stream:
            nk._block2_stream(a, out, 0, 0)
            nk._fence()
        else:
            nk._block2(a, out, 0, 0)

    for nbits, n in nk.BLOCK.items():
        dtype = np.dtype(f"u{nbits // 8}")
        a = (np.arange(2 * n * n, dtype=np.uint64) % 251).astype(dtype).reshape(2 * n, n)
        rows = quant_host.aligned_empty(n * 128).view(dtype).reshape(n, -1)
        rows[:] = 0
        one(a[:n], rows)
        assert np.array_equal(rows[:, :n], a[:n].T) and not rows[:, n:].any(), nbits
        for stream in (False, True):
            rows[:] = 0
            two(a, rows, stream)
            assert np.array_equal(rows[:, : 2 * n], a.T), (nbits, stream)
            assert not rows[:, 2 * n :].any(), (nbits, stream)


@needs_numba
@pytest.mark.parametrize("bits", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_side_by_side_and_single_blocks_both_give_numpy_bits(bits: type) -> None:
    """Sources whose rows are close (side-by-side blocks), far apart with out's rows within a
    line of a 4 KiB multiple apart (side by side), and far apart elsewhere (single blocks)."""
    size = np.dtype(bits).itemsize
    rng = np.random.default_rng(size)
    for shape in (
        (700, 96 // size + 1),  # a's rows close: side by side
        (8192 // size + 1, 640 // size + 3),  # out's rows 8 KiB + one value apart
        (8192 // size - 1, 640 // size + 3),  # ... and one value short of it
        (3000 // size + 5, 1000 // size + 7),  # neither: single blocks
    ):
        a = rng.integers(0, np.iinfo(bits).max, shape, dtype=bits)
        out = np.zeros(a.T.shape, a.dtype)
        half = out.shape[0] // 2
        kernels.transpose(a.T, out, 0, half)
        kernels.transpose(a.T, out, half, out.shape[0])
        assert out.tobytes() == a.T.copy().tobytes(), shape


@needs_numba
@pytest.mark.parametrize("type_name,scale", [("i8", 100), ("i16", 255), ("i32", 2**20 + 1)])
@pytest.mark.parametrize("rnd", [False, True])
@pytest.mark.parametrize("aligned", [False, True])
def test_fused_transposed_quantisation_gives_the_definition(
    type_name: str, scale: int, rnd: bool, aligned: bool
) -> None:
    """Tiles cut at every edge: rows past one tile and off the register blocks, columns past one
    tile, bands starting mid-tile; streamed (64-byte rows) or plain stores; values out of range counted."""
    from pytreeio import _numba_kernels as nk

    dtype = np.dtype(quant.INT_TYPES[type_name])
    # 57 rows past a tile: side-by-side blocks, then a single block (57 % 2n >= n for every
    # width), then single values; 2*128 rows: 64-byte multiples
    rows = nk.Q_ROWS + 57 if not aligned else 2 * nk.Q_ROWS
    cols = nk.Q_COLS + 300
    rng = np.random.default_rng(scale)
    info = np.iinfo(dtype)
    x = (rng.uniform(info.min, info.max, (rows, cols)) / scale).astype(np.float32)
    x[rng.random(x.shape) < 0.01] = np.float32(0.5 / scale)  # ties
    v = x.astype(np.float64) * scale
    want = half_away(v) if rnd else np.trunc(v)
    fits = (want >= info.min) & (want <= info.max)
    x[~fits] = 0.0
    want[~fits] = 0.0
    bad = [(5, 7), (rows - 1, cols - 1), (nk.Q_ROWS, nk.Q_COLS)]
    for r, c in bad:
        x[r, c] = np.nan if r == 5 else np.float32(info.max * 1.01 / scale)
    out = quant_host.aligned_empty(x.size * dtype.itemsize).view(dtype).reshape(cols, rows)
    scratch = kernels.transposed_scratch(dtype)
    cuts = [0, 5, nk.Q_COLS - 3, nk.Q_COLS + 17, cols]
    counted = 0
    for c0, c1 in itertools.pairwise(cuts):
        counted += kernels.quantise_transposed(x, c0, c1, out[c0:c1], scratch, scale, rnd)
    assert counted == len(bad)
    got = out.T.astype(np.float64)
    for r, c in bad:
        got[r, c] = want[r, c] = 0.0
    assert np.array_equal(got, want)


def test_bands_of_a_large_array_take_the_kernel_its_size_calls_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """copy_transposed's ``array_nbytes``: a small band of a large array asks for the kernel by
    the array's size (a cl-waffe2 band of 1 MiB of a 16 MiB kernel), not its own."""
    from pytreeio import transpose

    asked: list[int] = []
    monkeypatch.setattr(kernels, "use", lambda n: asked.append(n) or False)
    a = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    band = a.T[:5]
    out = np.empty(band.shape, band.dtype)
    transpose.copy_transposed(band, out, parallel=False, array_nbytes=16 << 20)
    transpose.copy_transposed(band, out, parallel=False)
    assert asked == [16 << 20, band.nbytes]
    assert np.array_equal(out, a.T[:5])


def test_not_transposable() -> None:
    a = np.zeros((3, 4), ">f4")
    assert not kernels.transposable(a.T, np.empty((4, 3), "<f4"))  # a byte swap: numpy's job
    assert not kernels.transposable(a.T.astype("c16"), np.empty((4, 3), "c16"))
    assert not kernels.transposable(np.zeros((2, 2), object), np.zeros((2, 2), object))


@needs_numba
def test_large_arrays_take_the_kernels_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_q, real_t = kernels.quantise, kernels.transpose
    monkeypatch.setattr(kernels, "quantise", lambda *a: calls.append("q") or real_q(*a))
    monkeypatch.setattr(kernels, "transpose", lambda *a: calls.append("t") or real_t(*a))
    monkeypatch.setattr(kernels, "MIN_BYTES", 1 << 16)
    small = np.ones((10, 10), np.float32)
    big = np.random.default_rng(1).uniform(-1, 1, (300, 100)).astype(np.float32)  # 120 kB
    quant.quantise(small, 255, "i16")
    transpose.copy_transposed(small.T, np.empty((10, 10), np.float32))
    assert calls == []
    q = quant.quantise(big, 255, "i16")
    out = np.empty((100, 300), np.float32)
    transpose.copy_transposed(big.T, out)
    assert "q" in calls and "t" in calls and out.tobytes() == big.T.copy().tobytes()
    calls.clear()
    monkeypatch.setenv("PYTREEIO_NO_NUMBA", "1")
    assert not kernels.available() and not kernels.use(1 << 30)
    assert np.array_equal(quant.quantise(big, 255, "i16"), q)
    transpose.copy_transposed(big.T, out)
    assert calls == []


def test_numba_missing_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_failed", False)
    monkeypatch.setitem(sys.modules, "pytreeio._numba_kernels", None)  # import fails
    monkeypatch.setattr(kernels, "MIN_BYTES", 0)
    assert not kernels.available()
    x = np.float32([[0.5, -1.5], [2.25, 3.0]])
    assert quant.quantise(x, 2, "i8", round=True, transpose=True).tolist() == [[1, 5], [-3, 6]]
    q, lo, hi = quant_host.quantise(x, 2, np.dtype(np.int8), round_=True, checked=False)
    assert (lo, hi) == (-1.5, 3.0) and q.tolist() == [[1, -3], [5, 6]]


def test_import_does_not_load_numba() -> None:
    code = (
        "import sys, numpy as np, pytreeio\n"
        "from pytreeio import quant\n"
        "quant.quantise(np.ones((64, 64), np.float32), 255, 'i16', transpose=True)\n"
        "assert 'numba' not in sys.modules, 'numba imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@needs_numba
@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_install_still_works(tmp_path: Path) -> None:
    """No writable cache (package and NUMBA_CACHE_DIR read-only): compiled in memory, same bits."""
    pkg = tmp_path / "site" / "pytreeio"
    shutil.copytree(ROOT / "pytreeio", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    cache.mkdir()
    for path in [cache, *pkg.rglob("*"), pkg]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    _run_kernel_in(tmp_path / "site", {"NUMBA_CACHE_DIR": str(cache)})


@needs_numba
def test_no_cache_locator_still_works(tmp_path: Path) -> None:
    """numba finds no cache locator at all (as in a read-only install as non-root): no failure."""
    pkg = tmp_path / "site" / "pytreeio"
    shutil.copytree(ROOT / "pytreeio", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shim = tmp_path / "site" / "sitecustomize.py"
    shim.write_text(
        "from numba.core import caching\n"
        "caching._CacheImpl._locator_classes = []\n"  # every locator refuses
    )
    _run_kernel_in(tmp_path / "site", {})


def _run_kernel_in(site: Path, env: dict[str, str]) -> None:
    code = (
        "import numpy as np\n"
        "from pytreeio import kernels\n"
        "assert kernels.available()\n"
        "x = np.float32([0.5, -0.5, 1.25, 7.0])\n"
        "out = np.empty(4, np.int16)\n"
        "assert kernels.quantise(x, out, 2, True) == 0 and out.tolist() == [1, -1, 3, 14]\n"
    )
    full = {**os.environ, **env, "PYTHONPATH": str(site)}
    full.pop("PYTREEIO_NO_NUMBA", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=full, cwd=site)


@needs_numba
def test_first_large_array_does_not_wait_for_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_warming", Warming(kernels._load_and_run, "test-kernels"))
    assert not kernels.use(1 << 30)  # loading starts in the background; numpy does this one
    warming = kernels._warming.thread
    assert warming is not None
    warming.join(60)
    assert kernels.use(1 << 30) and not kernels.use(kernels.MIN_BYTES - 1)


def _definition(x: np.ndarray, scale: int, rnd: bool) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        v = x.astype(np.float64) * np.float64(scale)
        return half_away(v) if rnd else np.trunc(v)


def _on_every_edge(scale: int) -> np.ndarray:
    """float32 values whose product is, or is 1-2 ulps off, an integer or half-integer (up to 2**23)."""
    ks = np.concatenate([np.arange(-300, 300), np.geomspace(300, 2.0**23, 400).round()])
    ks = np.concatenate([ks, -ks])
    centre = (np.concatenate([ks, ks + 0.5]) / scale).astype(np.float32)
    return np.concatenate([centre, *_ulps_around(centre, 2)])


def _ulps_around(v: np.ndarray, steps: int) -> list[np.ndarray]:
    """``v`` moved 1 ... ``steps`` float32 ulps up, then 1 ... ``steps`` down."""
    out = []
    for direction in (np.inf, -np.inf):
        near = v
        for _ in range(steps):
            near = np.nextafter(near, np.float32(direction))
            out.append(near)
    return out


@needs_numba
@pytest.mark.parametrize("scale", [1, 3, 127, 255, 1000, 16320, 2**20 + 1, 2**24 - 1])
@pytest.mark.parametrize("rnd", [False, True])
@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_float32_kernels_on_integer_and_half_integer_products(
    scale: int, rnd: bool, dtype: type
) -> None:
    """The FMA fix-ups: exact, ties and one-ulp-off products, either side of 2**22/Q."""
    from pytreeio import _numba_kernels as nk

    x = _on_every_edge(scale)
    straddle = np.float32(2.0**22 / scale)
    near = [straddle, *_ulps_around(straddle, 4)]
    tiny = [0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 1.1754942e-38, 0.5 / scale, -0.5 / scale]
    x = np.concatenate([x, np.float32(near), -np.float32(near), np.float32(tiny)])
    x = x[np.random.default_rng(scale).permutation(x.size)]  # edge values in every chunk
    info = np.iinfo(dtype)
    want = _definition(x, scale, rnd)
    fits = (want >= info.min) & (want <= info.max)
    out = np.empty(x.size, dtype)
    kernel = nk.quantise_round32 if rnd else nk.quantise_trunc32
    assert kernel(x, out, float(scale), float(info.min), float(info.max)) == (~fits).sum()
    assert np.array_equal(out[fits], want[fits].astype(dtype))
    # the dispatcher picks the float32 kernels for these scales: the same bits
    out2 = np.empty(x.size, dtype)
    assert kernels.quantise(x, out2, scale, rnd) == (~fits).sum()
    assert np.array_equal(out2[fits], out[fits])


@needs_numba
@pytest.mark.parametrize("rnd", [False, True])
def test_float32_chunks_redone_in_float64(rnd: bool) -> None:
    """NaN, inf, values past 2**22 or out of the type: their chunk is exact, the count too."""
    from pytreeio import _numba_kernels as nk

    chunk = nk.CHUNK
    rng = np.random.default_rng(5)
    x = rng.uniform(-200, 200, chunk * 6 + 17).astype(np.float32)
    x[chunk * 1 + 5] = np.nan
    x[chunk * 2 + 7] = np.inf
    x[chunk * 2 + 8] = -np.inf
    x[chunk * 3 + 1] = np.float32(3e6)  # |Q*x| > 2**22: float64 for i32, out of range for i16
    x[chunk * 4 : chunk * 4 + 9] = np.float32(2.0**22 / 255)  # 2**22 itself
    x[-1] = -129.0
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        want = _definition(x, 255, rnd)
        fits = (want >= info.min) & (want <= info.max)
        out = np.empty(x.size, dtype)
        kernel = nk.quantise_round32 if rnd else nk.quantise_trunc32
        assert kernel(x, out, 255.0, float(info.min), float(info.max)) == (~fits).sum()
        assert np.array_equal(out[fits], want[fits].astype(dtype))


@needs_numba
@pytest.mark.parametrize("scale", [2**24, 2**24 + 1, 2**31 - 1, 0, -255])
def test_scales_outside_float32_take_the_float64_kernels(scale: int) -> None:
    x = np.float32([0.5, -0.5, 1.0 / 3, -2.5e-3, 7.0, 1e-30, -0.0])
    for rnd in (False, True):
        want = _definition(x, scale, rnd)
        fits = (want >= -(2**31)) & (want <= 2**31 - 1)
        out = np.empty(x.size, np.int32)
        assert kernels.quantise(x, out, scale, rnd) == (~fits).sum()
        assert np.array_equal(out[fits], want[fits].astype(np.int32))


def test_ready_loads_the_kernels_up_front_unless_switched_off() -> None:
    code = (
        "import sys, numpy as np\n"
        "from pytreeio import kernels\n"
        "ok = kernels.ready(timeout=120)\n"
        "print(ok, 'numba' in sys.modules, kernels.use(kernels.MIN_BYTES))\n"
    )
    env = {**os.environ, "PYTREEIO_NO_NUMBA": "1"}
    off = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, env=env, text=True, capture_output=True
    )
    assert off.stdout.split() == ["False", "False", "False"]
    if kernels.available():
        env["PYTREEIO_NO_NUMBA"] = "0"
        on = subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            cwd=ROOT,
            env=env,
            text=True,
            capture_output=True,
        )
        # once ready, the first large array takes the kernels (no background load to wait for)
        assert on.stdout.split() == ["True", "True", "True"]
