"""cl-waffe2 ``:wf2model``: key grammar, ~F numbers, the format against cl-waffe2's own files."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import struct
import warnings
from pathlib import Path
from typing import Any

import flax.linen as nn
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import CONFORMANCE
from hypothesis import given

import pytreeio as ptio
from pytreeio.containers import npy
from pytreeio.core.binary import BufferSource
from pytreeio.core.errors import (
    ConversionError,
    EncodeError,
    FormatError,
    MismatchError,
    PytreeioError,
    PytreeioWarning,
)
from pytreeio.core.records import STRUCTURE, Probe
from pytreeio.formats.waffe2 import keys as wk
from pytreeio.formats.waffe2 import state_dict as w
from pytreeio.model import form as M

DIRS = [
    "tiny_untrained.wf2model",
    "tiny_adam3_opt.wf2model",
    "tiny_adam3_noopt.wf2model",
    "tiny_adam1_opt.wf2model",
    "tiny_sgd3_opt.wf2model",
    "tiny_sgd3_noopt.wf2model",
    "mid_nobias_sgd2_opt.wf2model",
]
#: The save path each directory was written with (NOTES.md: "exact save call").
SAVED_AS = {d: d for d in DIRS} | {"tiny_adam3_opt.wf2model": "./tiny_adam3_opt.wf2model"}
TINY = [
    {"type": "Linear", "in_features": 4, "out_features": 3},
    "Sigmoid",
    {"type": "Linear", "in_features": 3, "out_features": 2},
]
MID = [
    {"type": "Linear", "in_features": 4, "out_features": 3},
    {"type": "Linear", "in_features": 3, "out_features": 3, "bias": False},
    {"type": "Linear", "in_features": 3, "out_features": 2},
]


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def source_of(d: Path) -> dict[str, memoryview]:
    return {k: memoryview(v) for k, v in files_of(d).items()}


def encoded_files(enc: ptio.Encoded) -> dict[str, bytes]:
    assert enc.files is not None
    return {k: v.tobytes() for k, v in enc.files.items()}


def bits(text: str) -> np.ndarray:
    """float32 values from the hex bit patterns NOTES.md prints."""
    return np.array([int(b, 16) for b in text.split()], dtype=np.uint32).view(np.float32)


def same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


class MLP(nn.Module):
    """cl-waffe2's Tiny: Linear 4->3, sigmoid, Linear 3->2."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.sigmoid(nn.Dense(3)(x))  # modules are numbered in creation order
        return nn.Dense(2)(h)


def dense_params(sizes: list[tuple[int, int, bool]], seed: int = 0) -> dict[str, Any]:
    """The params ``MLP().init`` makes (``Dense_N`` with kernel (in, out)), from numpy.

    Flax's eager init compiles every op on its own (seconds); the structure is
    all these tests need, and ``MLP().apply`` uses the values.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for i, (n_in, n_out, bias) in enumerate(sizes):
        layer = {"kernel": jnp.asarray(rng.uniform(-1, 1, (n_in, n_out)).astype(np.float32))}
        if bias:
            layer["bias"] = jnp.asarray(rng.uniform(-0.5, 0.5, n_out).astype(np.float32))
        out[f"Dense_{i}"] = layer
    return out


def tiny_params() -> dict[str, Any]:
    return dense_params([(4, 3, True), (3, 2, True)])


def mid_params(seed: int = 0) -> dict[str, Any]:
    return dense_params([(4, 3, True), (3, 3, False), (3, 2, True)], seed)


# --------------------------------------------------------------------------
# key grammar
# --------------------------------------------------------------------------


def all_conformance_keys(conformance: Path) -> list[str]:
    out = []
    for d in DIRS:
        doc = json.loads((conformance / "waffe2" / d / "parameters.json").read_bytes())
        out.extend(doc)
    return out


def test_every_conformance_key_parses_and_rebuilds(conformance: Path) -> None:
    keys = all_conformance_keys(conformance)
    assert "optimizer:linearlayer.0.bias.adam.(integer 0 4611686018427387903).n" in keys
    for key in keys:
        k = wk.parse_state_dict_key(key)
        assert str(k) == key
        assert wk.make_key(k.prefix, *k.parts) == key
        if k.prefix == "param":
            assert wk.param_key(*k.parts) == key
        else:
            assert wk.optimizer_key(*k.parts) == key


def test_parse_returns_prefix_and_parts_as_cl_waffe2() -> None:
    k = wk.parse_state_dict_key("param:linearlayer.0.bias")
    assert k == ("param", ("linearlayer", "0", "bias"))
    assert (k.keyword, k.composite, k.nth, k.slot, k.optimizer) == (
        ":PARAM",
        "linearlayer",
        "0",
        "bias",
        None,
    )
    k = wk.parse_state_dict_key("missing_optimizer:?12.nth3.name4.adam.single-float.lr")
    assert k.keyword == ":MISSING-OPTIMIZER"
    assert k.parts == ("?12", "nth3", "name4", "adam", "single-float", "lr")
    assert (k.optimizer, k.type, k.optslot) == ("adam", "single-float", "lr")
    assert wk.parse_state_dict_key("missing_param:a.b.c").keyword == ":MISSING-PARAM"
    # cl-ppcre:split drops trailing empty strings, so these parse as cl-waffe2 parses them
    assert wk.parse_state_dict_key("param:linearlayer.0.bias:").parts == (
        "linearlayer",
        "0",
        "bias",
    )
    assert wk.parse_state_dict_key("param:linearlayer.0.bias..").parts == (
        "linearlayer",
        "0",
        "bias",
    )
    assert wk.parse_state_dict_key("param:a..b").parts == ("a", "", "b")


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("linearlayer.0.bias", "no ':'"),
        ("", "no ':'"),
        ("param:linearlayer:0.bias", "2 ':'"),
        ("param::linearlayer.0.bias", "2 ':'"),
        (":linearlayer.0.bias", "unknown prefix"),
        ("params:linearlayer.0.bias", "unknown prefix"),
        ("PARAM:linearlayer.0.bias", "unknown prefix"),
        ("missing-param:a.b.c", "unknown prefix"),
        ("param:", "nothing after"),
        ("param::", "nothing after"),
        ("param:linearlayer.0", "2 parts"),
        ("param:linearlayer.0.bias.x", "4 parts"),
        ("missing_param:a.b", "2 parts"),
        ("optimizer:linearlayer.0.bias.adam.single-float", "5 parts"),
        ("optimizer:linearlayer.0.bias.adam.single-float.lr.x", "7 parts"),
        ("optimizer:linearlayer.0.bias", "3 parts"),
        ("missing_optimizer:a.b.c.d.e", "5 parts"),
    ],
)
def test_parse_rejections(key: str, why: str) -> None:
    with pytest.raises(FormatError, match=why):
        wk.parse_state_dict_key(key)


def test_builders_all_prefixes() -> None:
    assert wk.param_key("LinearLayer", 0, "WEIGHTS") == "param:linearlayer.0.weights"
    assert (
        wk.param_key("linearlayer", 1, "bias", missing=True) == "missing_param:linearlayer.1.bias"
    )
    assert (
        wk.optimizer_key("linearlayer", 2, "bias", "ADAM", wk.integer_type(3), "N")
        == "optimizer:linearlayer.2.bias.adam.(integer 0 4611686018427387903).n"
    )
    assert (
        wk.optimizer_key("c", 0, "s", "sgd", "single-float", "lr", missing=True)
        == "missing_optimizer:c.0.s.sgd.single-float.lr"
    )
    for bad in [("a.b", 0, "s"), ("a", 0, "s:t"), ("", 0, "s"), ("a", True, "s"), ("a", 0, "x/y")]:
        with pytest.raises(EncodeError):
            wk.param_key(*bad)
    with pytest.raises(EncodeError, match="unknown state-dict prefix"):
        wk.make_key("params", "a", 0, "b")
    with pytest.raises(EncodeError, match="6 parts"):
        wk.make_key("optimizer", "a", 0, "b")


NAMES = st.text(alphabet="abcxyz019-_?", min_size=1, max_size=8)


@given(
    prefix=st.sampled_from(wk.PREFIXES),
    parts=st.lists(NAMES, min_size=6, max_size=6),
    nth=st.integers(0, 10**6),
)
def test_key_round_trip(prefix: str, parts: list[str], nth: int) -> None:
    n = 3 if prefix in wk.PARAM_PREFIXES else 6
    chosen = [parts[0], nth, *parts[1 : n - 1]]
    key = wk.make_key(prefix, *chosen)
    k = wk.parse_state_dict_key(key)
    assert k.prefix == prefix
    assert k.parts == tuple(str(p) for p in chosen)


def test_nth_counts_per_composite_and_slot() -> None:
    mid = [("linearlayer", s) for s in ("weights", "bias", "weights", "weights", "bias")]
    assert wk.assign_nth(mid) == [0, 0, 1, 2, 1]
    mixed = [("linearlayer", "weights"), ("conv2d", "weight"), ("linearlayer", "weights")]
    assert wk.assign_nth(mixed) == [0, 0, 1]


def test_type_specifiers() -> None:
    mpf = wk.MOST_POSITIVE_FIXNUM
    assert mpf == 4611686018427387903
    assert [wk.type_of(v) for v in (0, 1, 2, 3, mpf)] == ["bit", "bit"] + [
        "(integer 0 4611686018427387903)"
    ] * 3
    assert wk.type_of(-1) == wk.type_of(wk.MOST_NEGATIVE_FIXNUM) == "fixnum"
    assert wk.type_of(mpf + 1) == "(integer 4611686018427387904)"
    assert wk.type_of(wk.MOST_NEGATIVE_FIXNUM - 1) == "(integer * -4611686018427387905)"
    assert wk.type_of(0.5) == wk.type_of(np.float32(0.5)) == "single-float"
    assert wk.type_of(np.float64(0.5)) == wk.type_of(0.5, float_type="double-float")
    assert wk.type_of(np.float64(0.5)) == "double-float"
    assert wk.type_of(np.zeros(3)) == "cputensor"
    assert wk.type_of(jnp.zeros(3), tensor_class="lisptensor") == "lisptensor"
    for bad in (True, np.float16(1), "x", None):
        with pytest.raises(EncodeError):
            wk.type_of(bad)
    for n in (0, 1, 2, 5, -3, mpf, mpf + 1, -(2**70)):
        spec = wk.parse_type_specifier(wk.integer_type(n))
        assert spec.kind == "integer" and spec.admits(n)
    assert not wk.parse_type_specifier("bit").admits(2)
    assert not wk.parse_type_specifier("(integer 0 4611686018427387903)").admits(-1)
    assert not wk.parse_type_specifier("fixnum").admits(2**62)
    assert wk.parse_type_specifier("single-float").admits(1)
    assert not wk.parse_type_specifier("single-float").admits(True)
    assert wk.parse_type_specifier("cputensor") == ("tensor", "cputensor", None, None)
    for bad in ("(unsigned-byte 8)", "(integer a b)", "two words", ""):
        with pytest.raises(FormatError):
            wk.parse_type_specifier(bad)


# --------------------------------------------------------------------------
# the ~F printer and jonathan's strings
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "double", "text"),
    [
        (0.01, False, "0.01"),
        (1e-7, False, "0.0000001"),
        (0.9, False, "0.9"),
        (0.999, False, "0.999"),
        (0.1, False, "0.1"),
        (1.0, False, "1.0"),
        (0.0, False, "0.0"),
        (-0.0, False, "-0.0"),
        (-0.5, False, "-0.5"),
        (1e10, False, "10000000000.0"),
        (123456789.0, False, "123456790.0"),
        (1e-8, False, "0.00000001"),
        (1.5e-45, False, "0.000000000000000000000000000000000000000000001"),
        (0.1, True, "0.1"),
        (123456789.0, True, "123456789.0"),
        (float(np.float32(0.9)), True, "0.8999999761581421"),
    ],
)
def test_lisp_float_known_values(x: float, double: bool, text: str) -> None:
    assert wk.format_lisp_float(x, double=double) == text


@pytest.mark.parametrize("x", [math.nan, math.inf, -math.inf, 1e39])
def test_lisp_float_refuses_what_json_cannot_hold(x: float) -> None:
    with pytest.raises(ValueError):
        wk.format_lisp_float(x)


def _significant(text: str) -> str:
    return text.lstrip("-").replace(".", "").strip("0") or "0"


@given(st.integers(0, 2**32 - 1))
def test_lisp_float_single_is_fixed_shortest_and_exact(pattern: int) -> None:
    v = np.array([pattern], dtype=np.uint32).view(np.float32)[0]
    if not np.isfinite(v):
        return
    text = wk.format_lisp_float(float(v))
    assert "e" not in text and "E" not in text
    assert text.lstrip("-").count(".") == 1 and text[-1].isdigit()
    back = np.float32(float(text))
    assert back.tobytes() == v.tobytes()
    k = len(_significant(text))
    if k > 1:  # the nearest decimal of one digit fewer does not read back as v
        shorter = np.float32(float(f"{float(v):.{k - 2}e}"))
        assert shorter.tobytes() != v.tobytes()


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_lisp_float_double_reads_back(x: float) -> None:
    text = wk.format_lisp_float(x, double=True)
    assert "e" not in text and struct.pack("<d", float(text)) == struct.pack("<d", x)


def test_jonathan_string_escapes_only_five_characters() -> None:
    assert wk.jonathan_string('a"b\\c\nd\re\tf/g é') == '"a\\"b\\\\c\\nd\\re\\tf/g é"'


# --------------------------------------------------------------------------
# reading cl-waffe2's files
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", DIRS)
def test_load_equals_npy_data_and_json(conformance: Path, name: str) -> None:
    d = conformance / "waffe2" / name
    native, meta = w.decode(source_of(d))
    doc = json.loads((d / "parameters.json").read_bytes())
    assert meta == {"keys": list(doc)}
    for key, value in doc.items():
        k = wk.parse_state_dict_key(key)
        parts = k.parts if k.is_param else (*k.parts[:4], k.parts[5])
        node: Any = native[k.prefix]
        for p in parts:
            node = node[p]
        if isinstance(value, str):
            assert same_bits(node, np.load(d / f"{key}.npy"))
            assert node.ndim == 1
        else:
            assert node == value and type(node) is type(value)


def test_values_match_notes(conformance: Path) -> None:
    root = conformance / "waffe2"
    b, _ = w.decode(source_of(root / "tiny_adam1_opt.wf2model"))
    bias = b["param"]["linearlayer"]["0"]["bias"]
    assert same_bits(bias, bits("3E7CF39E 3E602F34 BD9F9BED"))
    adam = b["optimizer"]["linearlayer"]["0"]["bias"]["adam"]
    assert adam["n"] == 1 and adam["lr"] == 0.01 and adam["eps"] == 1e-7
    assert (adam["beta1"], adam["beta2"]) == (0.9, 0.999)
    assert same_bits(adam["m"], bits("3BA21C2D 3B77C65A BAC507BD"))
    assert same_bits(adam["v"], bits("36243EEA 35BFD93B 3472A0A0"))
    a, _ = w.decode(source_of(root / "tiny_adam3_opt.wf2model"))
    assert a["optimizer"]["linearlayer"]["1"]["weights"]["adam"]["n"] == 3  # (integer ...) spelling
    assert same_bits(
        a["param"]["linearlayer"]["1"]["weights"],
        bits("3E81E360 BF082167 3F2718FB 3EB037AC BF0F5B59 3F7355A0"),
    )
    d, _ = w.decode(source_of(root / "mid_nobias_sgd2_opt.wf2model"))
    assert sorted(d["param"]["linearlayer"]) == ["0", "1", "2"]
    assert sorted(d["param"]["linearlayer"]["2"]) == ["weights"]
    assert same_bits(d["param"]["linearlayer"]["1"]["bias"], bits("BA626D40 3F10EA99"))
    assert d["optimizer"]["linearlayer"]["2"]["weights"] == {"sgd": {"lr": 0.1}}


@pytest.mark.parametrize("name", DIRS)
def test_rewrite_is_byte_identical(conformance: Path, name: str) -> None:
    d = conformance / "waffe2" / name
    native, meta = w.decode(source_of(d))
    enc = w.encode(native, meta=meta, dest=SAVED_AS[name])
    assert encoded_files(enc) == files_of(d)


@pytest.mark.parametrize("name", DIRS)
def test_save_under_the_same_relative_path_is_byte_identical(
    conformance: Path, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = conformance / "waffe2" / name
    native, meta = ptio.load_with_meta(d)
    monkeypatch.chdir(tmp_path)  # cl-waffe2 saved relative to the folder holding the dirs
    ptio.save(SAVED_AS[name], native, format="waffe2", meta=meta)
    assert files_of(tmp_path / name) == files_of(d)
    assert ptio.inspect(name).format == "waffe2"  # sniffed


def test_tree_order_without_meta(conformance: Path) -> None:
    root = conformance / "waffe2"
    tiny = root / "tiny_adam3_opt.wf2model"
    native, _ = w.decode(source_of(tiny))
    assert encoded_files(w.encode(native, dest="./tiny_adam3_opt.wf2model")) == files_of(tiny)
    # Mid's file order interleaves layers (1.bias, 2.weights, 1.weights): only meta keeps it
    mid = root / "mid_nobias_sgd2_opt.wf2model"
    native, meta = w.decode(source_of(mid))
    loose = encoded_files(w.encode(native, dest="mid_nobias_sgd2_opt.wf2model"))
    assert loose != files_of(mid) and sorted(loose) == sorted(files_of(mid))
    assert encoded_files(w.encode(native, meta=meta, dest=mid.name)) == files_of(mid)
    # meta that no longer names exactly the tree's entries is ignored
    del native["param"]["linearlayer"]["2"]
    del native["optimizer"]["linearlayer"]["2"]
    out = json.loads(encoded_files(w.encode(native, meta=meta, dest="m"))["parameters.json"])
    assert list(out)[:2] == [
        "param:linearlayer.1.bias",
        "optimizer:linearlayer.1.bias.sgd.single-float.lr",
    ]


def test_n_is_read_from_either_spelling_and_written_as_cl_waffe2(conformance: Path) -> None:
    d = conformance / "waffe2" / "tiny_adam1_opt.wf2model"
    src = source_of(d)
    text = bytes(src["parameters.json"]).decode()
    src["parameters.json"] = memoryview(
        text.replace("adam.bit.n", "adam.(integer 0 4611686018427387903).n").encode()
    )
    native, meta = w.decode(src)
    assert native["optimizer"]["linearlayer"]["0"]["weights"]["adam"]["n"] == 1
    # written back as cl-waffe2 would: (type-of 1) is BIT
    assert encoded_files(w.encode(native, meta=meta, dest=d.name)) == files_of(d)
    native["optimizer"]["linearlayer"]["0"]["weights"]["adam"]["n"] = 7
    doc = json.loads(encoded_files(w.encode(native, dest="x"))["parameters.json"])
    assert doc["optimizer:linearlayer.0.weights.adam.(integer 0 4611686018427387903).n"] == 7
    assert doc["optimizer:linearlayer.0.bias.adam.bit.n"] == 1


def test_double_float_spelling_is_kept(conformance: Path) -> None:
    d = conformance / "waffe2" / "tiny_sgd3_opt.wf2model"
    src = source_of(d)
    raw = bytes(src["parameters.json"]).replace(b"single-float", b"double-float")
    src["parameters.json"] = memoryview(raw)
    native, meta = w.decode(src)
    assert encoded_files(w.encode(native, meta=meta, dest=d.name))["parameters.json"] == raw
    native["optimizer"]["linearlayer"]["0"]["bias"]["sgd"]["lr"] = float(np.float32(0.3))
    text = encoded_files(w.encode(native, meta=meta, dest="x"))["parameters.json"].decode()
    assert '"optimizer:linearlayer.0.bias.sgd.double-float.lr":0.30000001192092896' in text


# --------------------------------------------------------------------------
# loading into like trees
# --------------------------------------------------------------------------


def test_native_like_takes_shapes_from_like(conformance: Path) -> None:
    d = conformance / "waffe2" / "tiny_sgd3_opt.wf2model"
    native, meta = w.decode(source_of(d))
    like = {
        "param": {
            "linearlayer": {
                "0": {"weights": np.zeros((3, 4), np.float32), "bias": np.zeros(3, np.float32)},
                "1": {"weights": jnp.zeros((2, 3)), "bias": np.zeros(2, np.float32)},
            }
        },
        "optimizer": {"linearlayer": {"0": {"bias": {"sgd": {"lr": 0.0}}}}},
    }
    with pytest.raises(
        MismatchError, match=re.escape("optimizer:linearlayer.0.weights.sgd.single-float.lr")
    ):
        w.restore(native, meta, like)
    report: dict[str, Any] = {}
    with pytest.warns(PytreeioWarning, match="in the file but not in"):
        out = w.restore(native, meta, like, strict=False, report=report)
    assert report["missing"] == []
    assert len(report["extra"]) == 3
    w0 = out["param"]["linearlayer"]["0"]["weights"]
    assert w0.shape == (3, 4) and same_bits(
        w0.reshape(-1), native["param"]["linearlayer"]["0"]["weights"]
    )
    assert isinstance(out["param"]["linearlayer"]["1"]["weights"], jax.Array)
    assert out["optimizer"]["linearlayer"]["0"]["bias"]["sgd"]["lr"] == 0.1
    # through the API, options routed to restore
    with pytest.warns(PytreeioWarning):
        got = ptio.load(d, like=like, strict=False, report=report)
    assert got["param"]["linearlayer"]["0"]["weights"].shape == (3, 4)


@pytest.mark.parametrize("sidecar", [False, True])
def test_partial_loads(conformance: Path, tmp_path: Path, sidecar: bool) -> None:
    """partial=True restores the entries `like` names (1-D files into 2-D likes, read lazily)."""
    d = conformance / "waffe2" / "tiny_adam3_opt.wf2model"
    native, _ = w.decode(source_of(d))
    if sidecar:  # pytreeio's own directory: the files carry their shapes
        d = tmp_path / "m.wf2model"
        ptio.save(d, tiny_params(), format="waffe2", layers=TINY)
        native, _ = w.decode(source_of(d))
    layer0 = native["param"]["linearlayer"]["0"]
    like = {"param": {"linearlayer": {"0": {"weights": np.zeros((3, 4), np.float32)}}}}
    with pytest.raises(MismatchError, match="in the file but not in"):
        ptio.load(d, like=like, format="waffe2")
    got = ptio.load(d, like=like, format="waffe2", partial=True)
    assert same_bits(got["param"]["linearlayer"]["0"]["weights"], layer0["weights"].reshape(3, 4))
    full = ptio.load(d, like=native, format="waffe2", partial=True)
    assert all(same_bits(full["param"]["linearlayer"]["0"][k], a) for k, a in layer0.items())
    if not sidecar:
        lr = {"optimizer": {"linearlayer": {"1": {"bias": {"adam": {"lr": 0.0, "n": 0}}}}}}
        opt = ptio.load(d, like=lr, format="waffe2", partial=True)
        assert opt["optimizer"]["linearlayer"]["1"]["bias"]["adam"] == {"lr": 0.01, "n": 3}
    with pytest.raises(MismatchError, match="element count"):
        ptio.load(d, like={"param": {"linearlayer": {"0": {"bias": np.zeros(4, np.float32)}}}},
                  format="waffe2", partial=True)  # fmt: skip
    model = ptio.load(d, like={"params": {"Dense_0": tiny_params()["Dense_0"]}}, partial=True)
    assert same_bits(model["params"]["Dense_0"]["bias"], layer0["bias"])


def test_element_count_dtype_and_fortran_mismatches(conformance: Path, tmp_path: Path) -> None:
    d = conformance / "waffe2" / "tiny_untrained.wf2model"
    native, meta = w.decode(source_of(d))
    good = {
        "param": {
            "linearlayer": {
                k: {s: np.zeros(np.shape(a), np.float32) for s, a in v.items()}
                for k, v in native["param"]["linearlayer"].items()
            }
        }
    }
    w.restore(native, meta, good)
    bad = {"param": {"linearlayer": {k: dict(v) for k, v in good["param"]["linearlayer"].items()}}}
    bad["param"]["linearlayer"]["0"]["weights"] = np.zeros((4, 4), np.float32)
    with pytest.raises(MismatchError, match="element count"):
        w.restore(native, meta, bad)
    with pytest.raises(MismatchError, match="element count"):
        w.to_model(
            native, meta, layers=[{"type": "Linear", "in_features": 5, "out_features": 3}, TINY[2]]
        )
    # a float64 file into a float32 like (cl-waffe2: "Dtype : FLOAT <- DOUBLE")
    src = source_of(d)
    f8 = np.load(d / "param:linearlayer.0.bias.npy").astype(np.float64)
    src["param:linearlayer.0.bias.npy"] = memoryview(b"".join(bytes(c) for c in npy.encode_npy(f8)))
    native8, meta8 = w.decode(src)
    with pytest.raises(MismatchError, match="dtype differs"):
        w.restore(native8, meta8, good)
    with pytest.raises(MismatchError, match="differs"):
        M.restore_model(w.to_model(native8, meta8, layers=TINY), tiny_params())
    # fortran_order True is refused, even for 1-D data
    header = npy.npy_header(np.float32, (3,), fortran_order=True)
    src["param:linearlayer.0.bias.npy"] = memoryview(header + np.zeros(3, np.float32).tobytes())
    with pytest.raises(FormatError, match="Fortran"):
        w.decode(src)
    f2 = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    src["param:linearlayer.0.bias.npy"] = memoryview(b"".join(bytes(c) for c in npy.encode_npy(f2)))
    with pytest.raises(FormatError, match="Fortran"):
        w.decode(src)
    with pytest.raises(FormatError, match="Fortran"):
        ptio.inspect_encoded(src, format="waffe2")


def test_missing_keys_strict_and_lenient(conformance: Path) -> None:
    d = conformance / "waffe2" / "tiny_untrained.wf2model"
    src = source_of(d)
    doc = json.loads(bytes(src["parameters.json"]))
    del doc["param:linearlayer.1.bias"]
    src["parameters.json"] = memoryview(json.dumps(doc, separators=(",", ":")).encode())
    native, meta = w.decode(src)
    full, fmeta = w.decode(source_of(d))
    like = jax.tree.map(lambda a: np.full(a.shape, 7, a.dtype), full)
    with pytest.raises(
        MismatchError, match=r"missing from the file: \['param:linearlayer.1.bias'\]"
    ):
        w.restore(native, meta, like)
    report: dict[str, Any] = {}
    with pytest.warns(PytreeioWarning, match=re.escape("param:linearlayer.1.bias")):
        out = w.restore(native, meta, like, strict=False, report=report)
    assert report == {"missing": ["param:linearlayer.1.bias"], "extra": []}
    assert out["param"]["linearlayer"]["1"]["bias"] is like["param"]["linearlayer"]["1"]["bias"]
    assert same_bits(
        out["param"]["linearlayer"]["0"]["bias"], full["param"]["linearlayer"]["0"]["bias"]
    )
    # a model cannot lack an array: missing parameters raise even when lenient
    for strict in (True, False):
        with pytest.raises(MismatchError, match=re.escape("param:linearlayer.1.bias")):
            w.to_model(native, meta, layers=TINY, strict=strict)
    # extra keys: the file has a layer the layer list lacks
    with pytest.raises(MismatchError, match="in the file but not in the layer list"):
        w.to_model(full, fmeta, layers=TINY[:1])
    report = {}
    with pytest.warns(PytreeioWarning):
        model = w.to_model(full, fmeta, layers=TINY[:1], strict=False, report=report)
    assert sorted(report["extra"]) == ["param:linearlayer.1.bias", "param:linearlayer.1.weights"]
    assert len(model.layers) == 1


@pytest.mark.parametrize(
    ("name", "count"), [("tiny_adam1_opt.wf2model", 1), ("tiny_adam3_opt.wf2model", 3)]
)
def test_adam_state_loads_into_optax(conformance: Path, name: str, count: int) -> None:
    d = conformance / "waffe2" / name
    native, _ = w.decode(source_of(d))
    params = tiny_params()
    for opt in (optax.adam(1e-3), optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)):
        like = {"params": params, "opt_state": opt.init(params)}
        out = ptio.load(d, like=like, layers=TINY)
        injected = hasattr(out["opt_state"], "hyperparams")
        adam = out["opt_state"].inner_state[0] if injected else out["opt_state"][0]
        assert int(adam.count) == count
        lin = native["param"]["linearlayer"]
        adam_file = native["optimizer"]["linearlayer"]
        kernel = np.asarray(out["params"]["Dense_0"]["kernel"])
        assert kernel.shape == (4, 3) and same_bits(kernel.T.reshape(-1), lin["0"]["weights"])
        assert same_bits(
            np.asarray(adam.mu["Dense_1"]["kernel"]).T.reshape(-1),
            adam_file["1"]["weights"]["adam"]["m"],
        )
        assert same_bits(
            np.asarray(adam.nu["Dense_1"]["bias"]), adam_file["1"]["bias"]["adam"]["v"]
        )
        if injected:
            hp = out["opt_state"].hyperparams
            assert float(hp["learning_rate"]) == np.float32(0.01)
            assert float(hp["eps"]) == np.float32(1e-7)
            assert int(out["opt_state"].count) == count


def test_sgd_state_loads_into_optax(conformance: Path) -> None:
    d = conformance / "waffe2" / "mid_nobias_sgd2_opt.wf2model"
    params = mid_params()
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    with pytest.raises(MismatchError, match="step count"):  # cl-waffe2's SGD keeps none
        ptio.load(d, like={"params": params, "opt_state": opt.init(params)}, layers=MID)
    model = w.to_model(*w.decode(source_of(d)), layers=MID)
    assert model.opt_state.kind == "sgd" and model.opt_state.hyperparams == {"learning_rate": 0.1}
    out = ptio.load(
        d, like={"params": params, "opt_state": optax.sgd(0.5).init(params)}, layers=MID
    )
    assert "bias" not in out["params"]["Dense_1"]
    # linearlayer.1.bias belongs to the third layer
    native, _ = w.decode(source_of(d))
    assert same_bits(out["params"]["Dense_2"]["bias"], native["param"]["linearlayer"]["1"]["bias"])
    assert out["params"]["Dense_1"]["kernel"].shape == (3, 3)


def test_model_like_gives_the_shapes(conformance: Path) -> None:
    d = conformance / "waffe2" / "tiny_adam3_opt.wf2model"
    native, meta = w.decode(source_of(d))
    params = tiny_params()
    like = {"params": params, "opt_state": optax.adam(0.01).init(params)}
    with pytest.raises(MismatchError, match="stores no shapes"):
        w.to_model(native, meta)
    model = w.to_model(native, meta, like=like)  # shapes from like: no layers= needed
    out = M.restore_model(model, like)
    assert int(out["opt_state"][0].count) == 3


def test_api_load_into_model_like_without_layers(conformance: Path) -> None:
    params = tiny_params()
    like = {"params": params, "opt_state": optax.adam(0.01).init(params)}
    out = ptio.load(conformance / "waffe2" / "tiny_adam3_opt.wf2model", like=like)
    assert int(out["opt_state"][0].count) == 3


# --------------------------------------------------------------------------
# writing from Flax and optax
# --------------------------------------------------------------------------


def conformance_flax_state(native: dict[str, Any]) -> dict[str, Any]:
    """The Flax params of a Tiny conformance file (kernels (in, out))."""
    lin = native["param"]["linearlayer"]
    return {
        f"Dense_{i}": {
            "kernel": jnp.asarray(lin[str(i)]["weights"].reshape(o, n).T),
            "bias": jnp.asarray(lin[str(i)]["bias"]),
        }
        for i, (n, o) in enumerate([(4, 3), (3, 2)])
    }


def test_flax_adam_state_writes_cl_waffe2_bytes(conformance: Path) -> None:
    d = conformance / "waffe2" / "tiny_adam3_opt.wf2model"
    native, _ = w.decode(source_of(d))
    params = conformance_flax_state(native)
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.01, eps=1e-7)
    state = opt.init(params)
    adam = native["optimizer"]["linearlayer"]
    slot = lambda name: {  # noqa: E731
        f"Dense_{i}": {
            "kernel": jnp.asarray(adam[str(i)]["weights"]["adam"][name].reshape(o, n).T),
            "bias": jnp.asarray(adam[str(i)]["bias"]["adam"][name]),
        }
        for i, (n, o) in enumerate([(4, 3), (3, 2)])
    }
    inner = state.inner_state[0]._replace(count=jnp.int32(3), mu=slot("m"), nu=slot("v"))
    state = state._replace(count=jnp.int32(3), inner_state=(inner, *state.inner_state[1:]))
    enc = ptio.encode(
        {"params": params, "opt_state": state},
        format="waffe2",
        dest="./tiny_adam3_opt.wf2model",
        optimizers=True,
        sidecar=False,
    )
    assert encoded_files(enc) == files_of(d)
    # without optimizers=True (cl-waffe2's default) only the parameters, with a warning
    with pytest.warns(PytreeioWarning, match="optimizers=False"):
        enc = ptio.encode(
            {"params": params, "opt_state": state},
            format="waffe2",
            dest="tiny_adam3_noopt.wf2model",
            sidecar=False,
        )
    assert encoded_files(enc) == files_of(conformance / "waffe2" / "tiny_adam3_noopt.wf2model")


def test_flax_sgd_and_no_bias_layer_write_cl_waffe2_bytes(conformance: Path) -> None:
    d = conformance / "waffe2" / "mid_nobias_sgd2_opt.wf2model"
    native, _ = w.decode(source_of(d))
    lin = native["param"]["linearlayer"]
    params = {
        "Dense_0": {"kernel": lin["0"]["weights"].reshape(3, 4).T, "bias": lin["0"]["bias"]},
        "Dense_1": {"kernel": lin["1"]["weights"].reshape(3, 3).T},
        "Dense_2": {"kernel": lin["2"]["weights"].reshape(2, 3).T, "bias": lin["1"]["bias"]},
    }
    opt = optax.sgd(0.1)
    enc = ptio.encode(
        {"params": params, "opt_state": opt.init(params)},
        format="waffe2",
        dest=d.name,
        optimizers=True,
        sidecar=False,
        hyperparams={"learning_rate": 0.1},
    )
    assert encoded_files(enc) == files_of(d)


def test_nth_from_flax_with_and_without_bias() -> None:
    params = mid_params(1)
    native, meta = w.from_model(M.model_of(params))
    assert meta["keys"] == [
        "param:linearlayer.1.bias",
        "param:linearlayer.2.weights",
        "param:linearlayer.1.weights",
        "param:linearlayer.0.bias",
        "param:linearlayer.0.weights",
    ]
    lin = native["param"]["linearlayer"]
    assert lin["2"]["weights"].shape == (2, 3)  # LinearLayer weights are (out, in)
    assert same_bits(lin["2"]["weights"], np.asarray(params["Dense_2"]["kernel"]).T)
    assert same_bits(lin["1"]["bias"], params["Dense_2"]["bias"])
    assert sorted(lin["1"]) == ["bias", "weights"] and sorted(lin["2"]) == ["weights"]
    tiny = tiny_params()
    native, meta = w.from_model(M.model_of(tiny))
    assert sorted(native["param"]["linearlayer"]) == ["0", "1"]
    assert meta["keys"][0] == "param:linearlayer.1.bias"


def train_step(opt: Any) -> Any:
    """One jitted training step of the Tiny MLP with ``opt`` (compiled once per test)."""
    x = jnp.linspace(-1, 1, 32).reshape(8, 4)
    y = jnp.sin(jnp.arange(16.0)).reshape(8, 2)

    def loss(p: Any) -> Any:
        return jnp.mean((MLP().apply({"params": p}, x) - y) ** 2)

    @jax.jit
    def step(state: dict[str, Any]) -> dict[str, Any]:
        grads = jax.grad(loss)(state["params"])
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    return step


def flax_train(step: Any, steps: int, state: dict[str, Any]) -> dict[str, Any]:
    for _ in range(steps):
        state = step(state)
    return state


@pytest.mark.parametrize("how", ["inject", "given", "waffe2_adam", "sgd"])
def test_exact_resume_through_waffe2(how: str, tmp_path: Path) -> None:
    from pytreeio.model.rules.waffe2 import waffe2_adam

    params = tiny_params()
    options: dict[str, Any] = {"optimizers": True}
    if how == "inject":
        opt = optax.inject_hyperparams(optax.adam)(learning_rate=3e-2)
    elif how == "given":
        opt = optax.adam(3e-2)
        options["hyperparams"] = {"learning_rate": 3e-2}
    elif how == "sgd":  # cl-waffe2's SGD keeps no count: pytreeio's sidecar keeps optax's
        opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    else:
        opt = waffe2_adam(lr=3e-2)
    start = {"params": params, "opt_state": opt.init(params)}
    step = train_step(opt)
    straight = flax_train(step, 6, start)
    half = flax_train(step, 3, start)
    path = tmp_path / "run.wf2model"
    ptio.save(path, half, **options)  # the suffix picks the format
    assert (path / w.SIDECAR).exists()
    like = jax.eval_shape(lambda: start)
    resumed = flax_train(step, 3, ptio.load(path, like=like))
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        assert same_bits(a, b)


def test_train_state_round_trip(tmp_path: Path) -> None:
    from flax.training import train_state

    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    state = train_state.TrainState.create(apply_fn=MLP().apply, params=tiny_params(), tx=tx)
    state = state.replace(step=4, opt_state=jax.tree.map(lambda x: x, state.opt_state))
    path = tmp_path / "ts.wf2model"
    ptio.save(path, state, optimizers=True)
    back = ptio.load(path, like=state)
    assert int(back.step) == 4
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(back.params), strict=True):
        assert same_bits(a, b)
    doc = json.loads((path / "parameters.json").read_bytes())
    assert doc["optimizer:linearlayer.0.weights.adam.bit.n"] == 0
    assert json.loads((path / w.SIDECAR).read_bytes())["step"] == 4


def test_sidecar_keeps_shapes_layers_and_step(tmp_path: Path) -> None:
    params = tiny_params()
    path = tmp_path / "m.wf2model"
    ptio.save(path, params, layers=["Linear", "Sigmoid", "Linear"])
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted(
        ["parameters.json", w.SIDECAR]
        + [f"param:linearlayer.{i}.{s}.npy" for i in (0, 1) for s in ("weights", "bias")]
    )
    text = (path / "parameters.json").read_text()
    assert text.startswith(
        '{"param:linearlayer.1.bias":"' + str(path) + "/param:linearlayer.1.bias.npy"
    )
    flat = np.load(path / "param:linearlayer.0.weights.npy")
    assert same_bits(flat, np.asarray(params["Dense_0"]["kernel"]).T.reshape(-1))
    native, meta = ptio.load_with_meta(path)
    assert native["param"]["linearlayer"]["0"]["weights"].shape == (3, 4)
    assert [e["type"] for e in meta["layers"]] == ["Linear", "Sigmoid", "Linear"]
    back = ptio.load(path, like=params)  # the sidecar gives the shapes
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        assert same_bits(a, b)
    info = ptio.inspect(path)
    assert dict((e.name, e.shape) for e in info.entries)["param:linearlayer.0.weights"] == (3, 4)
    # a parameters.json rewritten since (cl-waffe2 saving into the directory): sidecar ignored
    (path / "parameters.json").write_text(text.replace(str(path), "elsewhere"))
    with pytest.warns(PytreeioWarning, match="stale"):
        native, meta = ptio.load_with_meta(path)
    assert native["param"]["linearlayer"]["0"]["weights"].shape == (12,)
    assert "layers" not in meta
    # TrainState-like step survives
    model = M.model_of(params).replace(step=5)
    native, meta = w.from_model(model)
    enc = w.encode(native, meta=meta, dest="s")
    assert w.decode({k: memoryview(v) for k, v in encoded_files(enc).items()}).meta["step"] == 5


def test_malformed_sidecar(tmp_path: Path) -> None:
    enc = ptio.encode(tiny_params(), format="waffe2", dest="x")
    files = encoded_files(enc)
    doc = json.loads(files[w.SIDECAR])
    for change in (
        {"format": "other"},
        {"shapes": {"param:linearlayer.0.weights": [5, 5]}},
        {"shapes": {"param:nothing.0.x": [1]}},
        {"shapes": {"param:linearlayer.0.weights": "3x4"}},
        {"layers": {"a": 1}},
        {"step": -1},
    ):
        bad = dict(files)
        bad[w.SIDECAR] = json.dumps({**doc, **change}).encode()
        with pytest.raises(FormatError):
            w.decode({k: memoryview(v) for k, v in bad.items()})


def test_optimizer_conversions() -> None:
    params = tiny_params()
    plain = {"params": params, "opt_state": optax.adam(1e-2).init(params)}
    with pytest.raises(ConversionError, match="learning rate"):
        ptio.encode(plain, format="waffe2", optimizers=True)
    doc = json.loads(
        encoded_files(
            ptio.encode(
                plain, format="waffe2", optimizers=True, hyperparams={"learning_rate": 1e-2}
            )
        )["parameters.json"]
    )
    assert doc["optimizer:linearlayer.0.bias.adam.single-float.eps"] == 1e-8  # optax's default
    assert doc["optimizer:linearlayer.0.bias.adam.bit.n"] == 0
    with pytest.raises(MismatchError, match="learning_rate"):
        ptio.encode(
            {
                "params": params,
                "opt_state": optax.inject_hyperparams(optax.adam)(learning_rate=0.1).init(params),
            },
            format="waffe2",
            optimizers=True,
            hyperparams={"learning_rate": 0.2},
        )
    momentum = {"params": params, "opt_state": optax.sgd(0.1, momentum=0.9).init(params)}
    with pytest.raises(ConversionError, match="momentum"):
        ptio.encode(momentum, format="waffe2", optimizers=True, hyperparams={"learning_rate": 0.1})
    with pytest.warns(PytreeioWarning, match="dropping"):
        native, _ = w.from_model(M.model_of(momentum), optimizers=True, lossy=True)
    assert "optimizer" not in native


def test_other_layer_types_and_custom_naming() -> None:
    conv = M.Model(
        (
            M.Layer(
                "Conv2d",
                {"in_channels": 2, "out_channels": 4, "kernel_size": 3},
                {
                    "kernel": np.arange(72, dtype=np.float32).reshape(3, 3, 2, 4),
                    "bias": np.ones(4, np.float32),
                },
            ),
            M.Layer("ReLU"),
        )
    )
    native, meta = w.from_model(conv)
    stored = native["param"]["conv2d"]["0"]["weight"]
    assert stored.shape == (4, 2, 3, 3)  # cl-waffe2's Conv2D weight: (out, in/groups, kh, kw)
    enc = w.encode(native, meta=meta, dest="c")
    back_native, back_meta = w.decode({k: memoryview(v) for k, v in encoded_files(enc).items()})
    model = w.to_model(back_native, back_meta)
    assert [la.type for la in model.layers] == ["Conv2d", "ReLU"]
    assert same_bits(model.layers[0].arrays["kernel"], conv.layers[0].arrays["kernel"])
    naming = {"Linear": w.LayerNaming("dense", {"kernel": "w", "bias": "b"}, {"kernel": (1, 0)})}
    native, meta = w.from_model(M.model_of(tiny_params()), naming=naming)
    assert meta["keys"][0] == "param:dense.1.b"
    enc = w.encode(native, meta=meta, dest="d", sidecar=False)
    n2, m2 = w.decode({k: memoryview(v) for k, v in encoded_files(enc).items()})
    with pytest.raises(MismatchError, match="unknown composite 'dense'"):
        w.to_model(n2, m2, layers=None)
    model = w.to_model(
        n2,
        m2,
        layers=TINY,
        naming={
            "Linear": {
                "composite": "dense",
                "slots": {"kernel": "w", "bias": "b"},
                "axes": {"kernel": (1, 0)},
            }
        },
    )
    assert model.layers[2].arrays["kernel"].shape == (3, 2)
    bn = M.Model(
        (
            M.Layer(
                "BatchNorm2d",
                {"num_features": 2},
                {"scale": np.ones(2), "bias": np.zeros(2), "mean": np.zeros(2), "var": np.ones(2)},
            ),
        )
    )
    with pytest.raises(ConversionError, match="BatchNorm2d"):
        w.from_model(bn)
    with pytest.raises(MismatchError):
        w.from_model(bn, naming={"Linear": w.LayerNaming("Bad.Name", {"kernel": "w"})})


def test_encode_options_and_errors() -> None:
    tree = {"param": {"linearlayer": {"0": {"bias": np.ones(2, np.float32)}}}}
    doc = lambda enc: encoded_files(enc)["parameters.json"].decode()  # noqa: E731
    assert doc(w.encode(tree)) == '{"param:linearlayer.0.bias":"param:linearlayer.0.bias.npy"}'
    assert '"x///param:linearlayer.0.bias.npy"' in doc(w.encode(tree, dest="x//"))
    assert doc(w.encode(tree, dest="x/")).endswith('"x//param:linearlayer.0.bias.npy"}')
    assert '"/abs/p/param' in doc(w.encode(tree, dest="rel", save_dir="/abs/p"))
    opt_tree = {**tree, "optimizer": {"linearlayer": {"0": {"bias": {"sgd": {"lr": 0.5}}}}}}
    assert "optimizer" not in doc(w.encode(opt_tree, optimizers=False))
    assert '"optimizer:linearlayer.0.bias.sgd.single-float.lr":0.5' in doc(w.encode(opt_tree))
    assert ".lisptensor." in doc(
        w.encode(
            {**tree, "optimizer": {"linearlayer": {"0": {"bias": {"adam": {"m": np.zeros(2)}}}}}},
            tensor_class="lisptensor",
        )
    )
    bad_trees = [
        [np.zeros(2)],
        {"params": {}},
        {"param": {"linearlayer": {"0": np.zeros(2)}}},
        {"param": {"LinearLayer": {"0": {"bias": np.zeros(2)}}}},
        {"param": {"linear.layer": {"0": {"bias": np.zeros(2)}}}},
        {"param": {"linearlayer": {"0": {"bias": 1.0}}}},
        {"param": {"linearlayer": {"0": {"bias": np.array(["a"])}}}},
        {"optimizer": {"c": {"0": {"s": {"sgd": {"lr": float("nan")}}}}}},
        {"optimizer": {"c": {"0": {"s": {"sgd": {"lr": True}}}}}},
        {"optimizer": {"c": {"0": {"s": {"sgd": {"lr": "fast"}}}}}},
    ]
    for bad in bad_trees:
        with pytest.raises(EncodeError):
            w.encode(bad)
    with pytest.raises(EncodeError, match="no place for meta"):
        w.encode(tree, meta={"note": 1})
    with pytest.raises(EncodeError, match="control character"):
        w.encode(tree, dest="a\x01b")
    with pytest.raises(EncodeError, match="tensor_class"):
        w.encode(tree, tensor_class="Bad Class")
    with pytest.raises(TypeError):
        ptio.encode(tree, format="waffe2", no_such_option=1)


def test_sniff() -> None:
    def probe(head: bytes, names: set[str] | None = None) -> Probe:
        names = {"parameters.json", "x.npy"} if names is None else names
        return Probe(
            path=Path("d"), kind="dir", names=frozenset(names), heads={"parameters.json": head}
        )

    assert w.sniff(probe(b'{"param:linearlayer.1.bias":"d/p.npy"}')) == STRUCTURE
    assert w.sniff(probe(b'{\n  "optimizer:a.0.b.sgd.single-float.lr": 0.1}')) == STRUCTURE
    assert w.sniff(probe(b'{"missing_param:a.b.c":"x"}')) == STRUCTURE
    assert w.sniff(probe(b'{"config": {}}')) == 0
    assert w.sniff(probe(b'{"param:x"}', names={"other.json"})) == 0
    assert w.sniff(Probe(path=Path("f"), kind="file", head=b'{"param:a.0.b":"x"}')) == 0


def test_inspect_reads_headers(conformance: Path) -> None:
    info = ptio.inspect(conformance / "waffe2" / "tiny_adam3_opt.wf2model")
    assert info.format == "waffe2" and len(info.entries) == 12
    e = info.entries[0]
    assert (e.name, e.shape, e.dtype, e.nbytes) == ("param:linearlayer.1.bias", (2,), "float32", 8)
    scalars = info.meta["scalars"]
    assert scalars["optimizer:linearlayer.0.bias.adam.(integer 0 4611686018427387903).n"] == 3
    assert scalars["optimizer:linearlayer.0.bias.adam.single-float.lr"] == 0.01
    d = conformance / "waffe2" / "tiny_sgd3_opt.wf2model"
    sources = {k: BufferSource(v, name=k) for k, v in files_of(d).items()}
    w.inspect(sources)
    for name, src in sources.items():  # the .npy files: their 128-byte headers only
        assert src.bytes_read == (src.size if name == "parameters.json" else 128), name
    buf = ptio.inspect_encoded(source_of(d), format="waffe2")
    assert [x.name for x in buf.entries][:2] == [
        "param:linearlayer.1.bias",
        "param:linearlayer.1.weights",
    ]


# --------------------------------------------------------------------------
# hostile input
# --------------------------------------------------------------------------


def hostile_dir(root: Path, path_string: str, *, symlink_to: Path | None = None) -> Path:
    d = root / "ckpt.wf2model"
    d.mkdir()
    (d / "parameters.json").write_text(json.dumps({"param:linearlayer.0.bias": path_string}))
    if symlink_to is not None:
        os.symlink(symlink_to, d / "param:linearlayer.0.bias.npy")
    return d


@pytest.mark.parametrize(
    "kind",
    ["absolute", "dotdot", "inner_dotdot", "symlink", "basename_dotdot", "empty", "trailing_slash"],
)
def test_paths_leaving_the_directory_are_never_opened(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.npy"
    np.save(secret, np.arange(3, dtype=np.float32))
    root = tmp_path / "models"
    root.mkdir()
    strings = {
        "absolute": str(secret),
        "dotdot": "../outside/secret.npy",
        "inner_dotdot": "ckpt.wf2model/../../outside/secret.npy",
        "symlink": "ckpt.wf2model/param:linearlayer.0.bias.npy",
        "basename_dotdot": "ckpt.wf2model/..",
        "empty": "",
        "trailing_slash": "ckpt.wf2model/",
    }
    d = hostile_dir(root, strings[kind], symlink_to=secret if kind == "symlink" else None)
    opened: list[str] = []
    real_open = os.open

    def spy(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    monkeypatch.chdir(root)
    for call in (
        lambda: ptio.load(d),
        lambda: ptio.load(d, format="waffe2"),
        lambda: ptio.inspect(d, format="waffe2"),
    ):
        with pytest.raises(FormatError):
            call()
    assert not any(Path(p).name == "secret.npy" or "outside" in p for p in opened), opened
    # pure decode: a name that is not one of the directory's files
    with pytest.raises(FormatError, match=r"not a file of the checkpoint|does not name a file"):
        w.decode({"parameters.json": memoryview((d / "parameters.json").read_bytes())})


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"[]",
        b'{"param:linearlayer.0.bias":null}',
        b'{"param:linearlayer.0.bias":1.0}',
        b'{"param:linearlayer.0.bias":"p.npy","param:linearlayer.0.bias":"p.npy"}',
        b'{"linearlayer.0.bias":"p.npy"}',
        b'{"optimizer:a.0.b.sgd.single-float.lr":"p.npy"}',
        b'{"optimizer:a.0.b.sgd.cputensor.lr":0.1}',
        b'{"optimizer:a.0.b.adam.bit.n":5}',
        b'{"optimizer:a.0.b.adam.bit.n":1,"optimizer:a.0.b.adam.(integer 0 4611686018427387903).n":1}',
        b'{"optimizer:a.0.b.sgd.single-float.lr":NaN}',
        b'{"optimizer:a.0.b.sgd.single-float.lr":1e999}',
        b'{"optimizer:a.0.b.sgd.(unsigned-byte 8).lr":1}',
        b"[" * 100000,
        b'{"param:a.0.b":"p.npy"',
        b"\xff\xfe",
    ],
)
def test_malformed_parameters_json(text: bytes) -> None:
    src = {
        "parameters.json": memoryview(text),
        "p.npy": memoryview(b"".join(bytes(c) for c in npy.encode_npy(np.zeros(2, np.float32)))),
    }
    with pytest.raises(FormatError):
        w.decode(src)
    with pytest.raises(FormatError):
        ptio.inspect_encoded(src, format="waffe2")


class CountingSource(dict):  # type: ignore[type-arg]
    """A file mapping that counts reads of each file."""

    def __init__(self, files: dict[str, memoryview]) -> None:
        super().__init__(files)
        self.reads: dict[str, int] = {}

    def __getitem__(self, name: str) -> Any:
        self.reads[name] = self.reads.get(name, 0) + 1
        return super().__getitem__(name)


def test_many_entries_naming_one_file_read_it_once() -> None:
    data = memoryview(b"".join(bytes(c) for c in npy.encode_npy(np.zeros(1000, np.float32))))
    doc = {f"param:linearlayer.{i}.bias": "x/big.npy" for i in range(500)}
    src = CountingSource({"parameters.json": memoryview(json.dumps(doc).encode()), "big.npy": data})
    native, _ = w.decode(src)
    assert len(native["param"]["linearlayer"]) == 500 and src.reads["big.npy"] == 1
    src.reads.clear()
    info = w.inspect({k: BufferSource(v, name=k) for k, v in dict(src).items()})
    assert len(info.entries) == 500


def test_no_parameters_json() -> None:
    with pytest.raises(FormatError, match=r"no parameters\.json"):
        w.decode({})


@functools.cache
def pytreeio_written() -> dict[str, bytes]:
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    state = {"params": tiny_params(), "opt_state": tx.init(tiny_params())}
    return encoded_files(ptio.encode(state, format="waffe2", dest="p", optimizers=True))


@given(data=st.data())
def test_truncated_and_mutated_files_raise_only_pytreeio_errors(data: st.DataObject) -> None:
    if data.draw(st.booleans()):
        files = files_of(CONFORMANCE / "waffe2" / "tiny_adam3_opt.wf2model")  # no fixtures here
    else:
        files = dict(pytreeio_written())  # with a sidecar
    name = data.draw(st.sampled_from(sorted(files)))
    raw = bytearray(files[name])
    op = data.draw(st.sampled_from(["truncate", "flip", "insert"]))
    at = data.draw(st.integers(0, max(len(raw) - 1, 0)))
    if op == "truncate":
        raw = raw[:at]
    elif op == "flip":
        raw[at] = data.draw(st.integers(0, 255))
    else:
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    files[name] = bytes(raw)
    src = {k: memoryview(v) for k, v in files.items()}
    for call in (lambda: w.decode(src), lambda: ptio.inspect_encoded(src, format="waffe2")):
        with contextlib.suppress(PytreeioError):
            call()
    try:
        native, meta = w.decode(src)
        w.to_model(native, meta, layers=TINY)
    except PytreeioError:
        pass


def test_registered() -> None:
    fmt = ptio.list_formats()["waffe2"]
    assert fmt.is_model_format and fmt.layout == ptio.DIRECTORY and fmt.suffixes == (".wf2model",)
    assert {
        "optimizers",
        "save_dir",
        "sidecar",
        "tensor_class",
        "naming",
        "hyperparams",
        "layers",
    } <= fmt.save_options
    assert {"layers", "naming", "strict", "report"} <= fmt.load_options
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert w.FORMAT is fmt


def test_files_read_side_by_side_report_a_bad_file_at_its_own_entry(tmp_path: Path) -> None:
    """Tensor files are read side by side; a damaged one among them is reported by name, and
    every file before it loads as written."""
    params = dense_params([(3, 3, True)] * 60)  # 120 tensor files
    d = tmp_path / "m.wf2model"
    ptio.save(d, params, format="waffe2")
    back = ptio.load(d, like=params)
    assert all(same_bits(back[k][n], params[k][n]) for k in params for n in params[k])
    names = sorted(p.name for p in d.iterdir() if p.suffix == ".npy")
    assert len(names) == 120
    victim = d / names[61]
    victim.write_bytes(b"\x93NUMPX" + victim.read_bytes()[6:])  # wrong magic
    with pytest.raises(FormatError) as err:
        ptio.load(d, like=params)
    assert str(err.value.path).endswith(names[61]) and "magic" in (err.value.field or "")


def test_integer_type_specifiers_are_whole_texts() -> None:
    from pytreeio.formats.waffe2 import keys as waffe2_keys

    assert waffe2_keys.parse_type_specifier("(integer 0 3)").kind == "integer"
    with pytest.raises(FormatError, match="unknown type specifier"):
        waffe2_keys.parse_type_specifier("(integer 0 3)\n")
