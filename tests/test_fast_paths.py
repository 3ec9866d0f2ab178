"""The fast paths of quantisation and transposes give exactly what the plain ones give.

``quant.transpose`` copies numpy arrays on the host in tiles
(``copy_transposed``), cl-waffe2 writes transposed views band by band, and
bullet checks ranges on the host and computes quantised values
asynchronously (``check_quantisable`` + ``quantise_async``): every result is
compared bit for bit with numpy's own transpose or with ``quant.quantise``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

import pytreeio as ptio
from pytreeio.core import quant
from pytreeio.core.binary import BufferSource, ByteSource
from pytreeio.core.errors import PytreeioError, QuantisationError
from pytreeio.formats.waffe2 import state_dict as waffe2


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
    from pytreeio.formats.bullet.checkpoint import padding

    want += padding(len(want))
    assert (dest / "quantised.bin").read_bytes() == want
    encoded = ptio.encode(tree, format="bullet", meta={"saved_format": layout})
    assert encoded.files is not None
    q = encoded.files["quantised.bin"]
    assert q.tobytes() == want and q.tobytes() == want  # produced twice: the same bytes


# --------------------------------------------------------------------------
# bullet: quantised.bin of many small entries, and its errors
# --------------------------------------------------------------------------


def _many_small_entries() -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """Small tensors of every kind in runs and alone, f32 and large entries between them,
    with ties, integral products and the type's edges among the values."""
    rng = np.random.default_rng(5)
    weights: dict[str, np.ndarray] = {}
    layout: list[dict[str, Any]] = []
    kinds = [("i16", 255, True)] * 5 + [("i8", 64, False)] * 3 + [("i32", 255 * 64, True)] * 4
    kinds += [("f32", None, False), ("i16", 255, True), ("i16", 255, False), ("i16", 255, True)]
    for k, (ttype, scale, rnd) in enumerate(kinds * 3):
        shape = [(3, 5), (7,), (0,), (4, 2), (6, 6)][k % 5]
        x = rng.uniform(-0.45, 0.45, shape).astype(np.float32)
        if x.size:
            x.reshape(-1)[0] = 0.5 / 255  # a tie at scale 255
            x.reshape(-1)[-1] = 1 / 64  # an integral product at scale 64
        weights[f"t{k}"] = x
        entry: dict[str, Any] = {"id": f"t{k}", "type": ttype, "round": rnd}
        if scale is not None:
            entry["scale"] = scale
        entry["transforms"] = ["transpose"] if k % 4 == 1 else []
        layout.append(entry)
    weights["big"] = rng.uniform(-0.45, 0.45, (160, 130)).astype(np.float32)  # above the run size
    layout.insert(7, {"id": "big", "transforms": [], "type": "i16", "scale": 255, "round": True})
    return weights, layout


def _quantised_one_by_one(weights: dict[str, np.ndarray], layout: list[dict[str, Any]]) -> bytes:
    from pytreeio.formats.bullet import checkpoint as bullet

    want = b""
    for e in layout:
        x = weights[str(e["id"])]
        if e["type"] == "f32":
            want += np.ascontiguousarray(x.T if e["transforms"] else x, "<f4").tobytes()
            continue
        flip = bool(e["transforms"]) and x.ndim == 2
        want += quant.quantise(
            x,
            int(e["scale"]),
            str(e["type"]),
            round=bool(e["round"]),
            transpose=flip,
        ).tobytes()
    return want + bullet.padding(len(want))


def test_bullet_many_small_entries_are_quantised_one_by_one() -> None:
    from pytreeio.formats.bullet import checkpoint as bullet

    weights, layout = _many_small_entries()
    encoded = bullet.encode({"weights": weights}, meta={"saved_format": layout})
    assert not encoded.deferred
    assert encoded.files["quantised.bin"].tobytes() == _quantised_one_by_one(weights, layout)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 200.0, -200.0])
@pytest.mark.parametrize("where", [0, 2, 3])
def test_bullet_run_errors_name_the_entry(bad: float, where: int) -> None:
    """A value that does not fit fails its run; the error is the entry's own check's."""
    from pytreeio.formats.bullet import checkpoint as bullet

    weights = {f"t{k}": np.full((2, 3), 0.25, np.float32) for k in range(5)}
    weights[f"t{where}"][1, 2] = bad
    weights["t4"][0, 1] = 300.0  # a later entry fails too: the first one is reported
    layout = [
        {"id": f"t{k}", "transforms": ["transpose"] if k == 2 else [], "type": "i8", "scale": 64}
        for k in range(5)
    ]
    (got,) = bullet.encode({"weights": weights}, meta={"saved_format": layout}).deferred
    with pytest.raises(QuantisationError) as want:
        quant.check_quantisable(weights[f"t{where}"], 64, "i8", name=f"t{where}")
    assert str(got).startswith(str(want.value))
    assert (got.tensor, got.index, got.position) == (f"t{where}", 5, (1, 2))


def test_bullet_run_error_comes_before_a_later_transform_error() -> None:
    from pytreeio.core.errors import EncodeError
    from pytreeio.formats.bullet import checkpoint as bullet

    bullet.register_transform("_test_wrong_size", lambda a, _: a.reshape(-1)[:1], replace=True)
    weights = {"a": np.float32([0.1, 9.0]), "b": np.float32([0.1]), "c": np.float32([0.1, 0.2])}
    layout = [
        {"id": "a", "type": "i8", "scale": 64},
        {"id": "b", "type": "i8", "scale": 64},
        {"id": "c", "type": "i8", "scale": 64, "transforms": ["_test_wrong_size"]},
    ]
    (got,) = bullet.encode({"weights": weights}, meta={"saved_format": layout}).deferred
    assert got.tensor == "a"
    weights["a"][1] = 0.5
    with pytest.raises(EncodeError, match="changed the number of elements"):
        bullet.encode({"weights": weights}, meta={"saved_format": layout})


# --------------------------------------------------------------------------
# Writer.extend: the bytes of raw()/array() one by one
# --------------------------------------------------------------------------


def test_writer_extend_is_raw_and_array() -> None:
    from pytreeio.core.binary import Writer

    rng = np.random.default_rng(6)
    small = rng.standard_normal((3, 4), dtype=np.float32)
    parts = [
        b"head",
        small,
        rng.standard_normal(2000, dtype=np.float32),  # referenced, not joined
        b"x" * 5000,
        np.asfortranarray(rng.standard_normal((5, 3), dtype=np.float32)),
        small.astype(">f4"),
        rng.standard_normal(6),  # float64: cast
        np.zeros(0, np.float32),
        small[:, ::2],
        b"",
        small,
    ]
    one_by_one = Writer()
    for p in parts:
        one_by_one.raw(p) if type(p) is bytes else one_by_one.array(p, "<f4")
    joined = Writer()
    joined.extend(parts, "<f4")
    want = b"".join(bytes(c) for c in one_by_one.finish())
    assert joined.nbytes == len(want)
    assert b"".join(bytes(c) for c in joined.finish()) == want


# --------------------------------------------------------------------------
# record walks: in memory (one unpack per record) or field by field, the same
# --------------------------------------------------------------------------


class _FieldByField(ByteSource):
    """A source that is not a BufferSource: formats read it field by field."""

    def __init__(self, data: bytes, name: str | None = None) -> None:
        self._data, self.name, self.size, self.bytes_read = data, name, len(data), 0

    def _read(self, offset: int, n: int) -> memoryview:
        return memoryview(self._data)[offset : offset + n]


def _outcome(read: Callable[[], object]) -> object:
    try:
        return read()
    except PytreeioError as exc:
        return (type(exc), str(exc), exc.__dict__)


def _same_either_way(read: Callable[[ByteSource], object], data: bytes, name: str) -> None:
    assert _outcome(lambda: read(BufferSource(data, name))) == _outcome(
        lambda: read(_FieldByField(data, name))
    )


def _mutated(data: bytes, draw: st.DataObject) -> bytes:
    buf = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        pos = draw.draw(st.integers(0, len(buf) - 1))
        buf[pos] = draw.draw(st.sampled_from([0, 1, 10, 0x20, 0x7F, 0x80, 0xFF, buf[pos] ^ 1]))
    return bytes(buf[: draw.draw(st.integers(0, len(buf)))])


def _bullet_inspect(src: ByteSource) -> object:
    from pytreeio.formats.bullet import checkpoint as bullet

    return bullet.inspect({_WEIGHTS: src}).entries


def _datacode_inspect(src: ByteSource) -> object:
    from pytreeio.formats.datacode import nn as datacode

    return datacode.inspect(src)


_WEIGHTS = "optimiser_state/weights.bin"


def _bullet_file() -> bytes:
    from pytreeio.formats.bullet import checkpoint as bullet

    weights = {"l0w": np.ones((3, 2), np.float32), "l0b": np.ones(2, np.float32)}
    weights["a_long_id_" + "x" * 40] = np.arange(3, dtype=np.float32)  # beyond the first probe
    return bullet.encode({"weights": weights}).files[_WEIGHTS].tobytes()


def _datacode_file() -> bytes:
    from pytreeio.formats.datacode import nn as datacode

    tree = {
        "layer0": {"weight": np.ones((3, 4), np.float32), "bias": np.ones(4, np.float32)},
        "layer2": {"weight": np.ones((4, 2), np.float32), "bias": np.ones((1, 2), np.float32)},
    }
    return datacode.encode(tree, meta={"layers": ["Linear", "ReLU", "Linear"]}).tobytes()


def _npz_read(src: ByteSource) -> object:
    from pytreeio.containers import npy

    return [(k, a.dtype.str, a.shape, a.tobytes()) for k, a in npy.read_npz(src).items()]


def _npz_file() -> bytes:
    from pytreeio.containers import npy

    items = [("a", np.ones((3, 2), np.float32)), ("b", np.arange(4, dtype=np.int16))]
    items += [("c", np.asfortranarray(np.ones((2, 3)))), ("d", np.float32(2.0))]
    return b"".join(bytes(c) for c in npy.encode_npz(items))


_READS = [
    (_bullet_inspect, _bullet_file, _WEIGHTS),
    (_datacode_inspect, _datacode_file, "m.nn"),
    (_npz_read, _npz_file, "m.npz"),
]


@pytest.mark.parametrize(("read", "make", "name"), _READS)
def test_truncated_headers_read_either_way(
    read: Callable[[ByteSource], object], make: Callable[[], bytes], name: str
) -> None:
    data = make()
    for n in range(len(data) + 1):
        _same_either_way(read, data[:n], name)


@pytest.mark.parametrize(("read", "make", "name"), _READS)
@given(data=st.data())
def test_mutated_headers_read_either_way(
    read: Callable[[ByteSource], object], make: Callable[[], bytes], name: str, data: st.DataObject
) -> None:
    _same_either_way(read, _mutated(make(), data), name)


# --------------------------------------------------------------------------
# DataCode's JSON: what serde_json cannot hold is still found
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (b'"\\ud800"', "lone surrogate"),
        (b"-9223372036854775809", "i64/u64"),  # 19 digits
        (b"18446744073709551616", "i64/u64"),
        (b'"a\\\\u"', None),  # an escaped backslash before a u: fine
        (b"1234567890123456789.5", None),  # a float of 19 digits: fine
    ],
)
def test_datacode_json_problems_are_found(value: bytes, problem: str | None) -> None:
    from pytreeio.core.errors import FormatError
    from pytreeio.core.serde_json import dump_bytes
    from pytreeio.formats.datacode import nn as datacode

    doc = dump_bytes({"device": "cpu", "layers": [], "training": None}).replace(
        b'"training":null', b'"training":null,"x":' + value
    )
    data = b"DATACODE" + struct.pack("<II", 1, len(doc)) + doc + struct.pack("<I", 0)
    if problem is None:
        datacode.decode(data)
    else:
        with pytest.raises(FormatError, match=problem):
            datacode.decode(data)


def test_serde_json_errors_name_the_member() -> None:
    from pytreeio.core.errors import EncodeError
    from pytreeio.core.serde_json import dumps

    with pytest.raises(EncodeError) as info:
        dumps({"a": [1, {"b": 2**64}]})
    assert info.value.key_path == "a[1].b"
    with pytest.raises(EncodeError) as info:
        dumps([0, -(2**63) - 1])
    assert info.value.key_path == "[1]"


# --------------------------------------------------------------------------
# npz: headers seen before are taken from the cache only when read_npy would agree
# --------------------------------------------------------------------------
