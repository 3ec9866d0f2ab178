"""Tiled, multi-threaded transposes give numpy's ``.T.copy()`` bit for bit.

:func:`pytreeio.core.transpose.copy_transposed` splits large copies over the
cores, and cl-waffe2 saves write kernels through it band by band and load
them back as transposed views: every result is compared with numpy's own
transpose.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.core import transpose
from pytreeio.formats.waffe2 import state_dict as waffe2

DTYPES = ["<f4", ">f4", "<f8", ">f8", "<f2", "<i1", "<i2", ">i4", "<i8", "<u1", "|b1"]
SHAPES = [(1, 1), (1, 37), (37, 1), (17, 33), (33, 17), (300, 5), (5, 300), (513, 1031)]


def _random(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*shape, np.dtype(dtype).itemsize), dtype=np.uint8)
    if np.dtype(dtype).kind == "b":
        raw &= 1
    return raw.view(dtype).reshape(shape)


@pytest.fixture
def parallel_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split every copy over several threads, however small (the default waits for 1 MiB)."""
    monkeypatch.setattr(transpose, "_PARALLEL_MIN", 0)
    monkeypatch.setattr(transpose, "cores", lambda: 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("parallel", [True, False])
def test_copy_transposed_matches_numpy(
    shape: tuple[int, int], dtype: str, parallel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transpose, "_PARALLEL_MIN", 0 if parallel else 1 << 60)
    monkeypatch.setattr(transpose, "cores", lambda: 3)
    a = _random(shape, dtype)
    want = a.T.copy()
    out = np.zeros(a.T.shape, a.dtype)
    transpose.copy_transposed(a.T, out)
    assert out.tobytes() == want.tobytes()
    little = np.empty(a.T.shape, a.dtype.newbyteorder("<"))
    transpose.copy_transposed(a.T, little)  # a byte-order change on the way
    assert little.tobytes() == want.astype(little.dtype).tobytes()  # a byte swap keeps NaN bits


def test_copy_transposed_non_contiguous_sources(parallel_always: None) -> None:
    base = _random((90, 140), "<f4", seed=1)
    for view in (base[::3, 1::2].T, base[5:80, ::-1].T, base[::-2, 7:133].T):
        out = np.empty(view.shape, view.dtype)
        transpose.copy_transposed(view, out)
        assert out.tobytes() == view.copy().tobytes()


def test_copy_transposed_large_default_threshold() -> None:
    a = _random((700, 600), "<f4", seed=2)  # 1.6 MB: above the parallel threshold
    out = np.empty((600, 700), a.dtype)
    transpose.copy_transposed(a.T, out)
    assert out.tobytes() == a.T.copy().tobytes()


def test_copy_transposed_other_layouts_and_shape_check() -> None:
    a = _random((4, 5, 6), "<i2", seed=3)
    view = a.transpose(2, 0, 1)
    out = np.empty(view.shape, view.dtype)
    transpose.copy_transposed(view, out)
    assert out.tobytes() == view.copy().tobytes()
    with pytest.raises(ValueError):
        transpose.copy_transposed(a.T, np.empty((5, 5, 5), a.dtype))


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8", ">f8"])
@pytest.mark.parametrize(("n_in", "n_out"), [(1, 9), (9, 1), (257, 3), (3, 257), (1000, 33)])
def test_waffe2_banded_save_bytes_and_view_load(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    n_in: int,
    n_out: int,
    parallel_always: None,
) -> None:
    # bands of a few rows, not dividing the kernel: many deferred chunks per file
    monkeypatch.setattr(waffe2, "_BAND_BYTES", 7 * np.dtype(dtype).itemsize * n_out)
    params = {
        "params": {
            f"Dense_{i}": {
                "kernel": _random((n_in, n_out) if i == 0 else (n_out, n_in), dtype, seed=i),
                "bias": _random((n_out if i == 0 else n_in,), dtype, seed=10 + i),
            }
            for i in range(2)
        }
    }
    dest = tmp_path / "m.wf2model"
    ptio.save(dest, params, format="waffe2", layers=["Linear", "Linear"], durable=False)
    for i in range(2):
        kernel = params["params"][f"Dense_{i}"]["kernel"]
        data = (dest / f"param:linearlayer.{i}.weights.npy").read_bytes()
        ref = tmp_path / "ref.npy"
        np.save(ref, kernel.T.astype(kernel.dtype.newbyteorder("<")).reshape(-1))  # files are <
        assert data == ref.read_bytes()
    if np.dtype(dtype).byteorder == ">":
        return  # a like of a big-endian dtype is refused (byte order is part of the dtype)
    back = ptio.load(dest, like=params, format="waffe2")
    for name, layer in params["params"].items():
        for key, arr in layer.items():
            got = back["params"][name][key]
            assert got.shape == arr.shape and got.tobytes() == arr.tobytes()
    # a loaded (view) tree saves back without a transpose, to the same bytes
    again = tmp_path / "again.wf2model"
    ptio.save(again, back, format="waffe2", layers=["Linear", "Linear"], durable=False)
    for f in sorted(p.name for p in dest.iterdir()):
        assert (again / f).read_bytes() == (dest / f).read_bytes() or f.endswith(".json")


def test_waffe2_decode_reports_a_truncated_file_by_name(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    params = {
        "params": {
            f"Dense_{i}": {
                "kernel": rng.standard_normal((6, 6), dtype=np.float32),
                "bias": rng.standard_normal(6, dtype=np.float32),
            }
            for i in range(4)
        }
    }
    dest = tmp_path / "m.wf2model"
    ptio.save(dest, params, format="waffe2", layers=["Linear"] * 4)
    native, _ = ptio.load_with_meta(dest, format="waffe2")
    for i in range(4):
        got = native["param"]["linearlayer"][str(i)]["weights"]
        assert got.tobytes() == params["params"][f"Dense_{i}"]["kernel"].T.tobytes()
    # a truncated later file: its FormatError names it
    bad = dest / "param:linearlayer.2.bias.npy"
    bad.write_bytes(bad.read_bytes()[:-3])
    with pytest.raises(ptio.FormatError) as info:
        ptio.load(dest, format="waffe2")
    assert "param:linearlayer.2.bias.npy" in str(info.value)
