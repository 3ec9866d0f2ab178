"""The fast paths of quantisation and transposes give exactly what the plain ones give.

``quant.transpose`` copies numpy arrays on the host in tiles
(``copy_transposed``), cl-waffe2 writes transposed views band by band, and
bullet checks ranges on the host and computes quantised values
asynchronously (``check_quantisable`` + ``quantise_async``): every result is
compared bit for bit with numpy's own transpose or with ``quant.quantise``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import quant
from pytreeio.errors import QuantisationError
from pytreeio.fmt import waffe2


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((37, 5), "<f4"),
        ((5, 37), "<f4"),
        ((64, 48), "<f2"),
        ((33, 17), ">f4"),
        ((1, 9), "<f8"),
        ((300, 260), "<i2"),
        ((0, 4), "<f4"),
    ],
)
def test_host_transpose_matches_numpy(shape: tuple[int, int], dtype: str) -> None:
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    t = quant.transpose(a, (1, 0))
    assert t.flags.c_contiguous and t.dtype.byteorder in "=|<"
    assert t.shape == a.T.shape and t.tobytes() == np.ascontiguousarray(a.T, t.dtype).tobytes()


def test_copy_transposed_nd_and_strided() -> None:
    a = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    view = a.transpose(3, 2, 0, 1)
    out = np.empty(view.shape, np.float32)
    quant.copy_transposed(view, out)
    assert np.array_equal(out, view)
    b = np.arange(40 * 30, dtype=np.float32).reshape(40, 30)[::2, ::3].T
    out2 = np.empty(b.shape, np.float32)
    quant.copy_transposed(b, out2)
    assert np.array_equal(out2, b)


@pytest.mark.parametrize("type_name", ["i8", "i16", "i32"])
@pytest.mark.parametrize("round_", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
def test_async_quantise_is_quantise(type_name: str, round_: bool, transpose: bool) -> None:
    rng = np.random.default_rng(2)
    x = rng.uniform(-0.45, 0.45, (24, 40)).astype(np.float32)
    x[0, 0] = 0.5 / 255  # a tie at scale 255
    x[1, 1] = -0.5 / 255
    want = quant.quantise(x, 255, type_name, round=round_, transpose=transpose)
    x32 = quant.check_quantisable(x, 255, type_name, round=round_)
    got = quant.quantise_async(x32, 255, type_name, round=round_, transpose=transpose).result()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf, 200.0, -200.0])
def test_check_quantisable_raises_as_quantise(bad: float) -> None:
    x = np.zeros((3, 4), np.float32)
    x[2, 1] = bad
    with pytest.raises(QuantisationError) as want:
        quant.quantise(x, 255, "i8")
    with pytest.raises(QuantisationError) as got:
        quant.check_quantisable(x, 255, "i8")
    assert str(got.value) == str(want.value)
    assert got.value.index == want.value.index == 9


def test_range_edges_match_the_kernel() -> None:
    # 127.5/255 rounds to 128 (out of i8), truncates to 127 (fits)
    x = np.array([127.5 / 255, -128.49 / 255], np.float32)
    for round_ in (False, True):
        try:
            quant.quantise(x, 255, "i8", round=round_)
            fits = True
        except QuantisationError:
            fits = False
        try:
            quant.check_quantisable(x, 255, "i8", round=round_)
            fits_host = True
        except QuantisationError:
            fits_host = False
        assert fits == fits_host


def test_waffe2_transposed_views_write_numpys_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    # wider than one band so a kernel spans several deferred chunks
    rows = waffe2._BAND_BYTES // (4 * 64) + 7
    params = {
        "params": {
            "Dense_0": {
                "kernel": rng.standard_normal((rows, 64), dtype=np.float32),
                "bias": rng.standard_normal(64, dtype=np.float32),
            },
            "Dense_1": {
                "kernel": rng.standard_normal((64, 3), dtype=np.float32),
                "bias": rng.standard_normal(3, dtype=np.float32),
            },
        }
    }
    dest = tmp_path / "m.wf2model"
    ptio.save(dest, params, format="waffe2", layers=["Linear", "Linear"])
    for k in ("0", "1"):
        kernel = params["params"][f"Dense_{k}"]["kernel"]
        data = (dest / f"param:linearlayer.{k}.weights.npy").read_bytes()
        assert data == _npy_bytes(np.ascontiguousarray(kernel.T).reshape(-1), tmp_path)
    back = ptio.load(dest, like=params)
    for name, layer in params["params"].items():
        for key, arr in layer.items():
            got = back["params"][name][key]
            # kernels come back as transposed views of the file's C-order data
            assert got.shape == arr.shape and got.tobytes() == arr.tobytes()


def _npy_bytes(arr: np.ndarray, tmp: Path) -> bytes:
    p = tmp / "ref.npy"
    np.save(p, arr)
    return p.read_bytes()


def test_bullet_quantised_file_is_quantise(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    w0 = rng.uniform(-1, 1, (96, 40)).astype(np.float32)
    b0 = rng.uniform(-1, 1, 40).astype(np.float32)
    tree = {"weights": {"l0w": w0, "l0b": b0}}
    layout = [
        {"id": "l0w", "transforms": ["transpose"], "type": "i16", "scale": 255, "round": True},
        {"id": "l0b", "transforms": [], "type": "i32", "scale": 255 * 64},
    ]
    dest = tmp_path / "ckpt"
    ptio.save(dest, tree, format="bullet", meta={"saved_format": layout})
    want = quant.quantise(w0, 255, "i16", round=True, transpose=True).tobytes()
    want += quant.quantise(b0, 255 * 64, "i32").tobytes()
    from pytreeio.fmt.bullet import padding

    want += padding(len(want))
    assert (dest / "quantised.bin").read_bytes() == want
    encoded = ptio.encode(tree, "bullet", meta={"saved_format": layout})
    assert encoded.files is not None
    q = encoded.files["quantised.bin"]
    assert q.tobytes() == want and q.tobytes() == want  # produced twice: the same bytes
