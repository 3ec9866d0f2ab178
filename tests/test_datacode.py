"""DataCode ``.nn``: both variants, byte-exact rewrite, validation, hostile input, models."""

from __future__ import annotations

import contextlib
import json
import math
import struct
import subprocess
import sys
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

import pytreeio as ptio
from pytreeio import cli
from pytreeio.core.binary import BufferSource
from pytreeio.core.errors import (
    ConversionError,
    EncodeError,
    FormatError,
    MismatchError,
    PytreeioError,
    PytreeioWarning,
)
from pytreeio.core.serde_json import dump_bytes, widen_f32
from pytreeio.formats.datacode import nn as dc
from pytreeio.model.form import Layer, Model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ACTIVATIONS = ("ReLU", "Sigmoid", "Tanh", "Softmax", "Flatten")
LOSSES = (
    "cross_entropy",
    "sparse_cross_entropy",
    "categorical_cross_entropy",
    "binary_cross_entropy",
    "mse",
)
# Each optimizer type with the parameters the seed document lists, lr as DataCode's f32.
OPTIMIZER_PARAMS = {
    "SGD": {"lr": widen_f32(0.01)},
    "Momentum": {"lr": widen_f32(0.01), "beta": 0.9},
    "NAG": {"lr": widen_f32(0.01), "beta": 0.9},
    "Adagrad": {"lr": widen_f32(0.01), "epsilon": 1e-8},
    "RMSprop": {"lr": widen_f32(0.001), "gamma": 0.99, "epsilon": 1e-8},
    "Adam": {"lr": widen_f32(0.001), "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    "AdamW": {
        "lr": widen_f32(0.001),
        "beta1": 0.9,
        "beta2": 0.999,
        "epsilon": 1e-8,
        "weight_decay": 0.01,
    },
}


# --------------------------------------------------------------------------
# building files by hand (not with the encoder under test)
# --------------------------------------------------------------------------


def linear(name: str, n_in: int, n_out: int, trainable: bool = True) -> dict[str, Any]:
    return {
        "in_features": n_in,
        "name": name,
        "out_features": n_out,
        "trainable": trainable,
        "type": "Linear",
    }


def document(layers: list[dict[str, Any]], training: dict[str, Any] | None = None) -> dict:
    return {"device": "cpu", "layers": layers, "training": training or dc.empty_training()}


def raw_file(
    doc: Any,
    tensors: list[tuple[str, tuple[int, ...], Any]],
    *,
    magic: bytes = b"DATACODE",
    version: int = 1,
    count: int | None = None,
    json_bytes: bytes | None = None,
    tail: bytes = b"",
) -> bytes:
    """A .nn file assembled with struct: (name, dims, data or None for zeros) per tensor."""
    js = json_bytes if json_bytes is not None else dump_bytes(doc)
    out = bytearray(magic + struct.pack("<II", version, len(js)) + js)
    out += struct.pack("<I", len(tensors) if count is None else count)
    for name, dims, data in tensors:
        raw = name.encode()
        out += struct.pack("<I", len(raw)) + raw + struct.pack("<I", len(dims))
        out += struct.pack(f"<{len(dims)}I", *dims)
        n = math.prod(dims)
        out += np.zeros(n, "<f4").tobytes() if data is None else np.asarray(data, "<f4").tobytes()
    return bytes(out + tail)


BASE_LAYERS = [linear("layer0", 3, 4), {"name": "layer1", "type": "ReLU"}, linear("layer2", 4, 2)]
RNG = np.random.default_rng(7)
W0 = RNG.standard_normal((3, 4)).astype(np.float32)
B0 = RNG.standard_normal(4).astype(np.float32)
W2 = RNG.standard_normal((4, 2)).astype(np.float32)
B2 = RNG.standard_normal(2).astype(np.float32)


def base_tensors() -> list[tuple[str, tuple[int, ...], Any]]:
    return [
        ("layer0.weight", (3, 4), W0),
        ("layer0.bias", (4,), B0),
        ("layer2.weight", (4, 2), W2),
        ("layer2.bias", (1, 2), B2),
    ]


def base_file(**kw: Any) -> bytes:
    return raw_file(document(BASE_LAYERS), base_tensors(), **kw)


def json_len(data: bytes) -> int:
    return struct.unpack_from("<I", data, 12)[0]


def stage(otype: str, loss: str, epochs: int, *, val: bool, later: bool = False) -> dict:
    hist = [widen_f32(1.0 / (i + 2)) for i in range(epochs)]
    out = {
        "accuracy_history": [widen_f32(1 - h) for h in hist],
        "epochs": epochs,
        "frozen_layers": [],
        "frozen_params": 0,
        "loss": loss,
        "loss_history": hist,
        "optimizer_params": OPTIMIZER_PARAMS[otype],
        "optimizer_type": otype,
        "trainable_params": 22,
        "val_accuracy_history": hist if val else None,
        "val_loss_history": hist if val else None,
    }
    if later:
        out["lr_history"] = None
    return out


def trained(stages: list[dict]) -> dict:
    last = stages[-1]
    return {
        "stages": stages,
        "epochs": last["epochs"],
        "loss": last["loss"],
        "optimizer": last["optimizer_type"],
        "loss_history": last["loss_history"],
        "accuracy_history": last["accuracy_history"],
        "val_loss_history": last["val_loss_history"],
        "val_accuracy_history": last["val_accuracy_history"],
    }


def roundtrip(data: bytes, **load: Any) -> bytes:
    native, meta = dc.decode(memoryview(data), **load)
    return dc.encode(native, meta=meta).tobytes()


# --------------------------------------------------------------------------
# the real files
# --------------------------------------------------------------------------


def conformance_files(conformance: Path) -> list[Path]:
    files = sorted((conformance / "datacode").glob("*.nn"))
    assert [f.name for f in files] == ["model_mnist.nn", "model_mnist_sh.nn"]
    return files


def test_conformance_files_load_with_weights_in_out(conformance: Path) -> None:
    for path in conformance_files(conformance):
        data = path.read_bytes()
        native, meta = dc.decode(memoryview(data))
        assert meta[dc.FILE_KEY] == {"variant": "later", "bias_2d": []}
        assert list(native) == ["layer0", "layer2"]
        assert native["layer0"]["weight"].shape == (784, 128)
        assert native["layer0"]["bias"].shape == (128,)
        assert native["layer2"]["weight"].shape == (128, 10)
        assert native["layer2"]["bias"].shape == (10,)
        # The file stores [out, in]: its first row is the first output unit's weights.
        first = 16 + json_len(data) + 4 + 4 + len("layer0.weight") + 4 + 8
        row = np.frombuffer(data, "<f4", 784, first)
        assert np.array_equal(native["layer0"]["weight"][:, 0], row)
        assert [la["name"] for la in meta["layers"]] == ["layer0", "layer1", "layer1"]


def test_conformance_rewrite_is_byte_identical(conformance: Path, tmp_path: Path) -> None:
    for path in conformance_files(conformance):
        data = path.read_bytes()
        assert roundtrip(data) == data
        native, meta = ptio.load_with_meta(path)
        out = tmp_path / path.name
        ptio.save(out, native, format="datacode", meta=meta)
        assert out.read_bytes() == data


def test_conformance_trained_stage(conformance: Path) -> None:
    _, meta = dc.decode(memoryview((conformance / "datacode/model_mnist.nn").read_bytes()))
    (stage_,) = meta["training"]["stages"]
    assert stage_["optimizer_type"] == "Adam" and stage_["epochs"] == 5
    assert stage_["optimizer_params"]["lr"] == widen_f32(0.001)
    assert stage_["lr_history"] is None
    _, sh = dc.decode(memoryview((conformance / "datacode/model_mnist_sh.nn").read_bytes()))
    assert sh["training"] == dc.empty_training()


def test_conformance_in_the_seed_variant_and_back(conformance: Path) -> None:
    data = (conformance / "datacode/model_mnist.nn").read_bytes()
    native, meta = dc.decode(memoryview(data))
    seed = dc.encode(native, meta=meta, variant="seed").tobytes()
    # biases [1, out], as DataCode 2.1.0 writes them: one more u32 dim per Linear layer
    assert len(seed) == len(data) + 2 * 4
    info = dc.inspect(BufferSource(seed))
    assert [(e.name, e.shape) for e in info.entries] == [
        ("layer0.weight", (784, 128)),
        ("layer0.bias", (1, 128)),
        ("layer2.weight", (128, 10)),
        ("layer2.bias", (1, 10)),
    ]
    native2, meta2 = dc.decode(memoryview(seed))
    assert meta2[dc.FILE_KEY]["variant"] == "seed"
    assert [la["name"] for la in meta2["layers"]] == ["layer0", "layer1", "layer2"]
    for k in native:
        for part in ("weight", "bias"):
            assert np.array_equal(native[k][part], native2[k][part])
    assert dc.encode(native2, meta=meta2, variant="later").tobytes() == data


def test_inspect_reads_headers_only(conformance: Path) -> None:
    data = (conformance / "datacode/model_mnist.nn").read_bytes()
    src = BufferSource(data)
    info = dc.inspect(src)
    assert src.bytes_read < 16 + json_len(data) + 200
    assert info.format == "datacode"
    assert [e.name for e in info.entries] == [
        "layer0.weight",
        "layer0.bias",
        "layer1.weight",
        "layer1.bias",
    ]
    assert info.entries[0].shape == (128, 784) and info.entries[0].dtype == "float32"
    assert info.nbytes == 4 * (784 * 128 + 128 + 128 * 10 + 10)
    assert info.meta["training"]["stages"][0]["optimizer_type"] == "Adam"


def test_cli_inspect_shows_layers_stages_and_tensors(
    conformance: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = conformance / "datacode/model_mnist.nn"
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "format datacode, 4 entries" in out
    assert "layer0.weight  [128, 784]" in out and '"type": "ReLU"' in out
    assert cli.main(["inspect", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in doc["entries"]][-1] == "layer1.bias"
    assert [la["type"] for la in doc["meta"]["layers"]] == ["Linear", "ReLU", "Linear"]
    assert doc["meta"]["training"]["stages"][0]["loss"] == "cross_entropy"
    assert cli.main(["verify", str(path)]) == 0


def test_sniffed_by_magic(conformance: Path, tmp_path: Path) -> None:
    dest = tmp_path / "no_suffix"
    dest.write_bytes(base_file())
    assert ptio.inspect(dest).format == "datacode"
    assert set(ptio.load(dest)) == {"layer0", "layer2"}
    assert ptio.inspect(conformance / "datacode/model_mnist_sh.nn").format == "datacode"


# --------------------------------------------------------------------------
# the seed variant, byte for byte
# --------------------------------------------------------------------------

HANDWRITTEN_JSON = (
    b'{"device":"cpu","layers":[{"in_features":3,"name":"layer0","out_features":4,'
    b'"trainable":true,"type":"Linear"},{"name":"layer1","type":"Sigmoid"},{"in_features":4,'
    b'"name":"layer2","out_features":2,"trainable":false,"type":"Linear"}],"training":'
    b'{"accuracy_history":[0.5],"epochs":2,"loss":"mse","loss_history":[0.25,0.125],'
    b'"optimizer":"RMSprop","stages":[{"accuracy_history":[0.5],"epochs":2,"frozen_layers":'
    b'["layer2"],"frozen_params":10,"loss":"mse","loss_history":[0.25,0.125],'
    b'"optimizer_params":{"epsilon":1e-8,"gamma":0.99,"lr":0.0010000000474974513},'
    b'"optimizer_type":"RMSprop","trainable_params":16,"val_accuracy_history":null,'
    b'"val_loss_history":null}],"val_accuracy_history":null,"val_loss_history":null}}'
)


def test_handwritten_seed_file_is_rewritten_exactly() -> None:
    data = raw_file(None, base_tensors(), json_bytes=HANDWRITTEN_JSON)
    native, meta = dc.decode(memoryview(data))
    assert meta[dc.FILE_KEY] == {"variant": "seed", "bias_2d": ["layer2"]}
    assert native["layer2"]["bias"].shape == (2,)
    assert np.array_equal(native["layer0"]["weight"], W0)
    assert np.array_equal(native["layer2"]["bias"], B2)
    assert meta["training"]["stages"][0]["optimizer_params"]["epsilon"] == 1e-8
    assert dc.encode(native, meta=meta).tobytes() == data


@pytest.mark.parametrize("bias_2d", [(), ("layer0",), ("layer2",), ("layer0", "layer2")])
def test_seed_files_with_stages_optimizers_losses_and_null_histories(
    bias_2d: tuple[str, ...],
) -> None:
    stages = [
        stage(otype, LOSSES[i % len(LOSSES)], 1 + i % 3, val=i % 2 == 0)
        for i, otype in enumerate(OPTIMIZER_PARAMS)
    ]
    stages.append(stage("SGD", LOSSES[2], 0, val=False))  # empty histories
    tensors = base_tensors()
    tensors[1] = ("layer0.bias", (1, 4) if "layer0" in bias_2d else (4,), B0)
    tensors[3] = ("layer2.bias", (1, 2) if "layer2" in bias_2d else (2,), B2)
    data = raw_file(document(BASE_LAYERS, trained(stages)), tensors)
    native, meta = dc.decode(memoryview(data))
    assert meta[dc.FILE_KEY]["bias_2d"] == list(bias_2d)
    assert all(native[k]["bias"].ndim == 1 for k in native)
    types = [s["optimizer_type"] for s in meta["training"]["stages"]]
    assert types == [*OPTIMIZER_PARAMS, "SGD"]
    assert dc.encode(native, meta=meta).tobytes() == data


def test_bias_shape_follows_the_native_tree_too() -> None:
    tree = {
        "layer0": {"weight": W0, "bias": B0.reshape(1, 4)},
        "layer2": {"weight": W2, "bias": B2},
    }
    # in a variant (or with a record) that writes [out]: a (1, out) bias stays [1, out]
    for meta in (
        {"layers": ["Linear", "ReLU", "Linear"], dc.FILE_KEY: {"variant": "later"}},
        {"layers": ["Linear", "ReLU", "Linear"], dc.FILE_KEY: {"bias_2d": []}},
    ):
        data = dc.encode(tree, meta=meta).tobytes()
        assert dc.decode(memoryview(data)).meta[dc.FILE_KEY]["bias_2d"] == ["layer0"]


def test_encode_fills_a_partial_document() -> None:
    tree = {"layer0": {"weight": W0, "bias": B0}, "layer2": {"weight": W2, "bias": B2}}
    data = dc.encode(tree, meta={"layers": ["Linear", {"type": "Tanh"}, {"type": "Linear"}]})
    _, meta = dc.decode(memoryview(data.tobytes()))
    assert meta["layers"] == [
        linear("layer0", 3, 4),
        {"name": "layer1", "type": "Tanh"},
        linear("layer2", 4, 2),
    ]
    assert meta["device"] == "cpu" and meta["training"] == dc.empty_training()
    # Without a layer list, layer0..layer<n-1> are all Linear.
    chain = {"layer0": {"weight": W0, "bias": B0}, "layer1": {"weight": W0.T[:, :2], "bias": B2}}
    _, meta = dc.decode(memoryview(dc.encode(chain).tobytes()))
    assert [la["type"] for la in meta["layers"]] == ["Linear", "Linear"]


def test_json_text_is_serde_json(conformance: Path) -> None:
    data = base_file()
    js = data[16 : 16 + json_len(data)]
    assert js.startswith(b'{"device":"cpu","layers":[{"in_features":3,"name":"layer0"')
    assert b'"stages":[]' in js and b" " not in js
    doc = {**document(BASE_LAYERS), "x": [1e-8, 1.0, 0.001, float("nan"), -0.0, 1e16]}
    tree = {"layer0": {"weight": W0, "bias": B0}, "layer2": {"weight": W2, "bias": B2}}
    out = dc.encode(tree, meta=doc).tobytes()
    assert b'"x":[1e-8,1.0,0.001,null,-0.0,1e16]' in out


# --------------------------------------------------------------------------
# hypothesis: both variants round trip
# --------------------------------------------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def models(draw: Any) -> tuple[dict, dict, str]:
    n_linear = draw(st.integers(1, 3))
    feats = draw(st.lists(st.integers(1, 4), min_size=n_linear + 1, max_size=n_linear + 1))
    layers: list[dict[str, Any]] = []
    for k in range(n_linear):
        if draw(st.booleans()):
            layers.append({"type": draw(st.sampled_from(ACTIVATIONS))})
        layers.append(
            {
                "type": "Linear",
                "in_features": feats[k],
                "out_features": feats[k + 1],
                "trainable": draw(st.booleans()),
            }
        )
    if draw(st.booleans()):
        layers.append({"type": draw(st.sampled_from(ACTIVATIONS))})
    variant = draw(st.sampled_from(dc.VARIANTS))
    names = dc.layer_names([la["type"] for la in layers], variant)
    tree: dict[str, Any] = {}
    for i, la in enumerate(layers):
        la["name"] = names[i]
        if la["type"] == "Linear":
            n_in, n_out = la["in_features"], la["out_features"]
            w = draw(st.binary(min_size=4 * n_in * n_out, max_size=4 * n_in * n_out))
            b = draw(st.binary(min_size=4 * n_out, max_size=4 * n_out))
            tree[f"layer{i}"] = {
                "weight": np.frombuffer(w, "<f4").reshape(n_in, n_out),
                "bias": np.frombuffer(b, "<f4"),
            }
    bias_2d = draw(st.lists(st.sampled_from(sorted(tree)), unique=True))
    training = dc.empty_training()
    if draw(st.booleans()):
        n = draw(st.integers(0, 3))
        hist = st.lists(finite, max_size=n).map(list)
        stages = [
            {
                "epochs": n,
                "loss": draw(st.sampled_from(LOSSES)),
                "optimizer_type": otype,
                "optimizer_params": {k: draw(finite) for k in OPTIMIZER_PARAMS[otype]},
                "frozen_layers": [],
                "trainable_params": draw(st.integers(0, 2**64 - 1)),
                "frozen_params": 0,
                "loss_history": draw(hist),
                "accuracy_history": draw(hist),
                "val_loss_history": draw(st.none() | hist),
                "val_accuracy_history": draw(st.none() | hist),
            }
            for otype in draw(st.lists(st.sampled_from(list(OPTIMIZER_PARAMS)), max_size=3))
        ]
        training = trained(stages) if stages else {**training, "note": draw(st.text())}
    meta = {
        "device": draw(st.sampled_from(["cpu", "metal", "cuda", "auto"])),
        "layers": layers,
        "training": training,
        dc.FILE_KEY: {"variant": variant, "bias_2d": sorted(bias_2d)},
    }
    return tree, meta, variant


def _ambiguous(meta: dict) -> bool:
    types = [la["type"] for la in meta["layers"]]
    positions = [i for i, t in enumerate(types) if t == "Linear"]
    square = all(
        la["in_features"] == la["out_features"] for la in meta["layers"] if la["type"] == "Linear"
    )
    return positions == list(range(len(positions))) and square


@given(models())
def test_both_variants_round_trip(case: tuple[dict, dict, str]) -> None:
    tree, meta, variant = case
    data = dc.encode(tree, meta=meta).tobytes()
    native, back = dc.decode(memoryview(data), variant=variant)
    assert back == meta
    assert list(native) == list(tree)
    for k in tree:
        assert native[k]["weight"].tobytes() == np.ascontiguousarray(tree[k]["weight"]).tobytes()
        assert native[k]["bias"].tobytes() == tree[k]["bias"].tobytes()
    assert dc.encode(native, meta=back).tobytes() == data
    detected = dc.decode(memoryview(data)).meta[dc.FILE_KEY]["variant"]
    assert detected == ("seed" if _ambiguous(meta) else variant)
    info = dc.inspect(BufferSource(data))
    want = {**meta, dc.FILE_KEY: {**meta[dc.FILE_KEY], "variant": detected}}
    assert info.meta == want and len(info.entries) == 2 * len(tree)


def test_ambiguous_square_file_reads_as_seed_unless_told() -> None:
    w = np.arange(4, dtype=np.float32).reshape(2, 2)
    data = raw_file(
        document([linear("layer0", 2, 2)]),
        [("layer0.weight", (2, 2), w), ("layer0.bias", (2,), None)],
    )
    assert np.array_equal(dc.decode(memoryview(data)).tree["layer0"]["weight"], w)
    later = dc.decode(memoryview(data), variant="later")
    assert np.array_equal(later.tree["layer0"]["weight"], w.T)
    assert later.meta[dc.FILE_KEY]["variant"] == "later"
    assert roundtrip(data, variant="later") == data


def test_orientation_decides_when_names_cannot() -> None:
    layers = [linear("layer0", 3, 4), linear("layer1", 4, 2)]
    w0, w1 = W0, np.ones((4, 2), np.float32)
    tensors = [
        ("layer0.weight", (4, 3), w0.T),
        ("layer0.bias", (4,), None),
        ("layer1.weight", (2, 4), w1.T),
        ("layer1.bias", (2,), None),
    ]
    native, meta = dc.decode(memoryview(raw_file(document(layers), tensors)))
    assert meta[dc.FILE_KEY]["variant"] == "later"
    assert np.array_equal(native["layer0"]["weight"], w0)


# --------------------------------------------------------------------------
# validation: every rule, with its field and offset
# --------------------------------------------------------------------------


def _with(layers: list[dict] | None = None, **doc_changes: Any) -> dict:
    doc = document(layers if layers is not None else BASE_LAYERS)
    doc.update(doc_changes)
    return doc


def _tensors(**changes: tuple[str, tuple[int, ...], Any] | None) -> list:
    out = base_tensors()
    for index, value in changes.items():
        out[int(index[1:])] = value
    return [t for t in out if t is not None]


BASE_J = len(dump_bytes(document(BASE_LAYERS)))
T0 = 16 + BASE_J + 4  # the first tensor record
T1 = T0 + 4 + 13 + 4 + 8 + 48
T2 = T1 + 4 + 11 + 4 + 4 + 16
BASE_JSON = dump_bytes(document(BASE_LAYERS))
LAYER = [dict(la) for la in BASE_LAYERS]

CASES: list[tuple[str, Callable[[], bytes], str, int | None, str]] = [
    ("magic", lambda: base_file(magic=b"DATACODX"), "magic", 0, "not a DataCode file"),
    ("version", lambda: base_file(version=2), "version", 8, "unsupported version 2"),
    (
        "utf-8",
        lambda: raw_file(None, base_tensors(), json_bytes=BASE_JSON.replace(b"cpu", b"c\xffu")),
        "json",
        16 + BASE_JSON.index(b"cpu") + 1,
        "utf-8",
    ),
    (
        "syntax",
        lambda: raw_file(None, base_tensors(), json_bytes=BASE_JSON[:-1]),
        "json",
        None,
        "invalid JSON",
    ),
    (
        "duplicate key",
        lambda: raw_file(None, base_tensors(), json_bytes=BASE_JSON[:-1] + b',"device":"cpu"}'),
        "json",
        16,
        "duplicate key",
    ),
    (
        "NaN literal",
        lambda: raw_file(
            None, base_tensors(), json_bytes=BASE_JSON.replace(b'"epochs":null', b'"epochs":NaN')
        ),
        "json",
        16 + BASE_JSON.index(b'"epochs":null') + 9,
        "NaN",
    ),
    (
        "integer beyond u64",
        lambda: raw_file(
            None,
            base_tensors(),
            json_bytes=BASE_JSON.replace(b'"epochs":null', b'"epochs":18446744073709551616'),
        ),
        "json",
        16,
        "i64/u64",
    ),
    (
        "nesting",
        lambda: raw_file(
            None,
            base_tensors(),
            json_bytes=BASE_JSON[:-1] + b',"x":' + b"[" * 200 + b"]" * 200 + b"}",
        ),
        "json",
        None,
        "nesting",
    ),
    ("not an object", lambda: raw_file([1], []), "json", 16, "must be a JSON object"),
    ("no layers", lambda: raw_file({"device": "cpu"}, []), "json.layers", 16, "no 'layers'"),
    (
        "layer type",
        lambda: raw_file(_with([LAYER[0], {"type": "LeakyReLU"}, LAYER[2]]), base_tensors()),
        "json.layers[1].type",
        16,
        "LeakyReLU",
    ),
    (
        "in_features zero",
        lambda: raw_file(_with([{**LAYER[0], "in_features": 0}, *LAYER[1:]]), base_tensors()),
        "json.layers[0].in_features",
        16,
        "in_features",
    ),
    (
        "out_features bool",
        lambda: raw_file(_with([{**LAYER[0], "out_features": True}, *LAYER[1:]]), base_tensors()),
        "json.layers[0].out_features",
        16,
        "out_features",
    ),
    (
        "feature chain",
        lambda: raw_file(_with([*LAYER[:2], {**LAYER[2], "in_features": 5}]), base_tensors()),
        "json.layers[2].in_features",
        16,
        "does not match out_features 4",
    ),
    (
        "trainable",
        lambda: raw_file(_with([{**LAYER[0], "trainable": "yes"}, *LAYER[1:]]), base_tensors()),
        "json.layers[0].trainable",
        16,
        "trainable",
    ),
    (
        "reserved key",
        lambda: raw_file(_with(**{dc.FILE_KEY: {}}), base_tensors()),
        f"json.{dc.FILE_KEY}",
        16,
        "reserved",
    ),
    ("tensor count", lambda: base_file(count=3), "tensor count", 16 + BASE_J, "need 4"),
    (
        "tensor name",
        lambda: raw_file(_with(), _tensors(t0=("layer0.kernel", (3, 4), W0))),
        "tensor 0 name",
        T0 + 4,
        "layer0.kernel",
    ),
    (
        "leading zero",
        lambda: raw_file(_with(), _tensors(t0=("layer00.weight", (3, 4), W0))),
        "tensor 0 name",
        T0 + 4,
        "layer00.weight",
    ),
    (
        "trailing newline",  # a whole name: "$" would have let the newline through
        lambda: raw_file(_with(), _tensors(t0=("layer0.weight\n", (3, 4), W0))),
        "tensor 0 name",
        T0 + 4,
        "layer0.weight",
    ),
    (
        "layer index",
        lambda: raw_file(
            _with(),
            _tensors(t2=("layer3.weight", (4, 2), W2), t3=("layer3.bias", (2,), B2)),
        ),
        "layer3.weight",
        T2,
        "layer 3",
    ),
    (
        "weight shape",
        lambda: raw_file(_with(), _tensors(t0=("layer0.weight", (4, 3), W0))),
        "layer0.weight",
        T0,
        "needs [3, 4]",
    ),
    (
        "bias shape",
        lambda: raw_file(_with(), _tensors(t1=("layer0.bias", (4, 1), B0))),
        "layer0.bias",
        T1,
        "[out] or [1, out]",
    ),
    (
        "ndim",
        lambda: raw_file(_with(), _tensors(t0=("layer0.weight", (3, 4, 1), W0))),
        "layer0.weight ndim",
        T0 + 4 + 13,
        "3 dimensions",
    ),
    (
        "duplicate tensor",
        lambda: raw_file(_with(), _tensors(t1=("layer0.weight", (3, 4), W0))),
        "layer0.weight",
        T1,
        "duplicate tensor",
    ),
    (
        "trailing bytes",
        lambda: base_file(tail=b"\0\0\0"),
        "end of file",
        len(base_file()),
        "3 unexpected trailing bytes",
    ),
    (
        "mixed variants",
        lambda: raw_file(
            _with(),
            _tensors(t0=("layer0.weight", (4, 3), W0), t2=("layer2.weight", (2, 4), W2)),
        ),
        "layer0.weight",
        T0,
        "needs [3, 4]",
    ),
    ("empty", lambda: b"", "magic", 0, "truncated"),
]


@pytest.mark.parametrize(
    ("make", "field", "offset", "message"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_validation(
    make: Callable[[], bytes], field: str, offset: int | None, message: str
) -> None:
    data = make()
    for read in (lambda: dc.decode(memoryview(data)), lambda: dc.inspect(BufferSource(data))):
        with pytest.raises(FormatError) as info:
            read()
        assert info.value.field == field, info.value
        if offset is not None:
            assert info.value.offset == offset, info.value
        else:
            assert 16 <= info.value.offset <= 16 + json_len(data)
        assert message in str(info.value)


def test_explicit_variant_must_fit(conformance: Path) -> None:
    data = (conformance / "datacode/model_mnist_sh.nn").read_bytes()
    with pytest.raises(FormatError, match=r"seed variant") as info:
        dc.decode(memoryview(data), variant="seed")
    assert info.value.field == "layer0.weight"
    with pytest.raises(FormatError, match="later variant"):
        dc.decode(memoryview(base_file()), variant="later")
    with pytest.raises(ValueError, match="variant"):
        dc.decode(memoryview(data), variant="newest")
    with pytest.raises(TypeError, match="takes no load option"):
        ptio.load(conformance / "datacode/model_mnist_sh.nn", varient="seed")


def test_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.nn"
    path.write_bytes(base_file(tail=b"x"))
    with pytest.raises(FormatError) as info:
        ptio.load(path)
    assert info.value.path == str(path) and info.value.offset == len(base_file())
    with pytest.raises(FormatError) as info:
        ptio.inspect(path)
    assert info.value.path == str(path)


# --------------------------------------------------------------------------
# hostile input
# --------------------------------------------------------------------------


def _only_pytreeio_errors(data: bytes) -> None:
    for read in (lambda: dc.decode(memoryview(data)), lambda: dc.inspect(BufferSource(data))):
        with contextlib.suppress(PytreeioError):
            read()


def test_truncation_at_every_offset() -> None:
    data = raw_file(
        document(BASE_LAYERS, trained([stage("Adam", "mse", 2, val=True)])), base_tensors()
    )
    for n in range(len(data)):
        cut = data[:n]
        with pytest.raises(FormatError):
            dc.decode(memoryview(cut))
        with pytest.raises(FormatError):
            dc.inspect(BufferSource(cut))


def test_truncated_conformance_headers(conformance: Path) -> None:
    data = (conformance / "datacode/model_mnist.nn").read_bytes()
    head = 16 + json_len(data) + 60
    for n in [*range(0, head, 7), len(data) - 1, len(data) - 4000]:
        with pytest.raises(FormatError):
            dc.decode(memoryview(data[:n]))


def test_random_flips_raise_only_pytreeio_errors() -> None:
    data = raw_file(
        document(BASE_LAYERS, trained([stage("AdamW", "mse", 2, val=True)])), base_tensors()
    )
    rng = np.random.default_rng(0)
    for _ in range(1500):
        buf = bytearray(data)
        for pos in rng.integers(0, len(buf), rng.integers(1, 4)):
            buf[pos] = int(rng.integers(0, 256))
        _only_pytreeio_errors(bytes(buf))


@given(st.binary(max_size=64), st.integers(0, 400))
def test_arbitrary_bytes_after_the_magic(junk: bytes, cut: int) -> None:
    base = base_file()
    _only_pytreeio_errors(b"DATACODE" + junk)
    _only_pytreeio_errors(base[:cut] + junk + base[cut + len(junk) :])


def _cost(data: bytes) -> tuple[FormatError, int]:
    tracemalloc.start()
    try:
        with pytest.raises(FormatError) as info:
            dc.decode(memoryview(data))
        with pytest.raises(FormatError):
            dc.inspect(BufferSource(data))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return info.value, peak


def test_lying_lengths_allocate_nothing() -> None:
    base = base_file()
    j = json_len(base)
    cases = {
        "json length": (base[:12] + struct.pack("<I", 0xFFFFFFF0) + base[16:], "json"),
        "tensor count": (
            base[: 16 + j] + struct.pack("<I", 0xFFFFFFFF) + base[20 + j :],
            "tensor count",
        ),
        "name length": (
            base[:T0] + struct.pack("<I", 0xFFFFFFFF) + base[T0 + 4 :],
            "tensor 0 name length",
        ),
        "ndim": (
            base[: T0 + 17] + struct.pack("<I", 0xFFFFFFFF) + base[T0 + 21 :],
            "layer0.weight ndim",
        ),
    }
    for what, (data, field) in cases.items():
        exc, peak = _cost(data)
        assert exc.field == field, (what, exc)
        assert peak < 1 << 20, (what, peak)


def test_lying_dims_that_match_the_architecture() -> None:
    big = 0xFFFFFFFF
    layers = [linear("layer0", big, big)]
    data = raw_file(document(layers), [("layer0.weight", (big, big), [])], count=2)
    exc, peak = _cost(data)
    assert exc.field == "layer0.weight data" and "truncated" in exc.reason
    assert peak < 1 << 20


# --------------------------------------------------------------------------
# encode: what the tree and meta must hold
# --------------------------------------------------------------------------

TREE = {"layer0": {"weight": W0, "bias": B0}, "layer2": {"weight": W2, "bias": B2}}
META = {"layers": ["Linear", "ReLU", "Linear"]}


def test_encode_refusals() -> None:
    with pytest.raises(MismatchError, match="not Linear layers") as info:
        dc.encode({**TREE, "layer1": TREE["layer0"]}, meta=META)
    assert info.value.key_path == "layer1"
    with pytest.raises(MismatchError, match="no 'layer2'"):
        dc.encode({"layer0": TREE["layer0"]}, meta=META)
    with pytest.raises(MismatchError, match="weight shape") as info:
        dc.encode({**TREE, "layer2": {"weight": W2.T, "bias": B2}}, meta=document(BASE_LAYERS))
    assert info.value.key_path == "layer2/weight"
    with pytest.raises(MismatchError, match="pass meta"):
        dc.encode(TREE)
    with pytest.raises(EncodeError, match="float32") as info:
        dc.encode({**TREE, "layer0": {"weight": W0.astype(np.float64), "bias": B0}}, meta=META)
    assert info.value.key_path == "layer0/weight"
    with pytest.raises(EncodeError, match="no LeakyReLU"):
        dc.encode(TREE, meta={"layers": ["Linear", "LeakyReLU", "Linear"]})
    with pytest.raises(MismatchError, match=dc.FILE_KEY):
        dc.encode(TREE, meta={**META, dc.FILE_KEY: {"variant": "newest"}})
    with pytest.raises(EncodeError, match="i64/u64") as info:
        dc.encode(TREE, meta={**META, "training": {"epochs": 2**70}})
    assert info.value.key_path == "meta.training.epochs"
    with pytest.raises(MismatchError, match="in_features"):
        dc.encode(TREE, meta={"layers": [linear("l", 3, 4), "ReLU", linear("m", 5, 2)]})
    with pytest.raises(ValueError, match="variant"):
        dc.encode(TREE, meta=META, variant="v2")


def test_encode_widens_half_precision_and_keeps_float32_unshared() -> None:
    half = {"layer0": {"weight": W0.astype(np.float16), "bias": B0}, "layer2": TREE["layer2"]}
    native, _ = dc.decode(memoryview(dc.encode(half, meta=META).tobytes()))
    assert np.array_equal(native["layer0"]["weight"], W0.astype(np.float16).astype(np.float32))
    enc = dc.encode(TREE, meta=META)
    assert any(isinstance(c, memoryview) for c in enc.chunks) or enc.nbytes < 4096


def test_renaming_between_variants() -> None:
    data = dc.encode(TREE, meta=META, variant="later").tobytes()
    native, meta = dc.decode(memoryview(data))
    assert [la["name"] for la in meta["layers"]] == ["layer0", "layer1", "layer1"]
    seed = dc.encode(native, meta=meta, variant="seed").tobytes()
    assert [la["name"] for la in dc.decode(memoryview(seed)).meta["layers"]] == [
        "layer0",
        "layer1",
        "layer2",
    ]
    custom = {
        **META,
        "layers": [linear("in", 3, 4), {"type": "ReLU", "name": "act"}, linear("out", 4, 2)],
    }
    kept = dc.decode(memoryview(dc.encode(TREE, meta=custom, variant="later").tobytes())).meta
    assert [la["name"] for la in kept["layers"]] == ["in", "act", "out"]


# --------------------------------------------------------------------------
# the common model form and Flax
# --------------------------------------------------------------------------


def test_to_model_and_back() -> None:
    native, meta = dc.decode(memoryview(base_file()))
    model = dc.to_model(native, meta)
    assert [la.type for la in model.layers] == ["Linear", "ReLU", "Linear"]
    assert model.layers[2].arrays["kernel"].shape == (4, 2)
    assert model.layers[2].arrays["bias"].shape == (2,)
    assert model.opt_state is None
    tree, doc = dc.from_model(model, meta)
    assert dc.encode(tree, meta=doc).tobytes() == base_file()


def test_from_model_refuses_what_datacode_cannot_hold() -> None:
    kernel, bias = np.zeros((3, 4), np.float32), np.zeros(4, np.float32)
    dense = Layer(
        "Linear",
        {"in_features": 3, "out_features": 4, "bias": True},
        {"kernel": kernel, "bias": bias},
    )
    leaky = Model((dense, Layer("LeakyReLU", {"negative_slope": 0.01})))
    with pytest.raises(ConversionError, match=r"layer 1 \(LeakyReLU\)") as info:
        dc.from_model(leaky)
    assert info.value.what == ["layer 1 (LeakyReLU)"]
    conv = Layer("Conv2d", {"in_channels": 1, "out_channels": 1, "kernel_size": 1})
    with pytest.raises(ConversionError, match=r"layer 0 \(Conv2d\)"):
        dc.from_model(Model((conv, dense)))
    no_bias = Layer(
        "Linear", {"in_features": 3, "out_features": 4, "bias": False}, {"kernel": kernel}
    )
    with pytest.raises(ConversionError, match="always have a bias"):
        dc.from_model(Model((no_bias,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PytreeioWarning)
        tree, _ = dc.from_model(Model((no_bias,)), lossy=True)
    assert np.array_equal(tree["layer0"]["bias"], np.zeros(4, np.float32))
    with pytest.raises(ConversionError, match="step counter"):
        dc.from_model(Model((dense,), step=3))
    with pytest.warns(PytreeioWarning, match="step counter"):
        dc.from_model(Model((dense,), step=3), lossy=True)


def _flax_mlp(kind: str) -> tuple[Any, Any]:
    import flax.linen as nn
    import jax

    x = np.zeros((1, 3), np.float32)
    if kind == "sequential":
        model: Any = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    else:

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x: Any) -> Any:
                return nn.Dense(2)(nn.relu(nn.Dense(4)(x)))

        model = MLP()
    return model, model.init(jax.random.key(1), x)["params"]


@pytest.mark.parametrize("kind", ["sequential", "dense"])
def test_flax_round_trip(kind: str, tmp_path: Path) -> None:
    import jax

    _, params = _flax_mlp(kind)
    if kind == "dense":  # nn.Dense(2) was built first: Dense_0 is the output layer
        params = {"Dense_0": params["Dense_1"], "Dense_1": params["Dense_0"]}
    path = tmp_path / "mlp.nn"
    ptio.save(path, params, format="datacode", meta={"layers": ["Linear", "ReLU", "Linear"]})
    back = ptio.load(path, like=params)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    shapes = jax.eval_shape(lambda: params)
    back2 = ptio.load(path, like=shapes)
    assert jax.tree.structure(back2) == jax.tree.structure(params)
    _, meta = ptio.load_with_meta(path)
    assert meta["layers"][1] == {"name": "layer1", "type": "ReLU"}
    ptio.save(tmp_path / "later.nn", params, format="datacode", meta=META, variant="later")
    assert ptio.inspect(tmp_path / "later.nn").entries[0].shape == (4, 3)


def test_flax_round_trip_of_the_real_file(conformance: Path, tmp_path: Path) -> None:
    import flax.linen as nn
    import jax

    path = conformance / "datacode/model_mnist.nn"
    model = nn.Sequential([nn.Dense(128), nn.relu, nn.Dense(10)])
    like = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 784), np.float32))["params"]
    params = ptio.load(path, like=like)
    _, meta = ptio.load_with_meta(path)
    out = tmp_path / "again.nn"
    ptio.save(out, params, format="datacode", meta=meta)
    assert out.read_bytes() == path.read_bytes()


def test_flax_layer_the_file_cannot_hold(tmp_path: Path) -> None:
    _, params = _flax_mlp("sequential")
    with pytest.raises(ConversionError, match="LeakyReLU"):
        ptio.save(
            tmp_path / "x.nn",
            params,
            format="datacode",
            meta={"layers": ["Linear", "LeakyReLU", "Linear"]},
        )
    assert not (tmp_path / "x.nn").exists()


def test_optimizer_state_needs_lossy(tmp_path: Path) -> None:
    import optax

    _, params = _flax_mlp("sequential")
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
    with pytest.raises(ConversionError, match="optimizer state"):
        ptio.save(tmp_path / "x.nn", state, format="datacode", meta=META)


# --------------------------------------------------------------------------
# the example
# --------------------------------------------------------------------------


def test_example_datacode_mnist(conformance: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "datacode_mnist.py"),
            "--file",
            str(conformance / "datacode/model_mnist.nn"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "match = True" in done.stdout
    assert "Linear -> ReLU -> Linear" in done.stdout


def test_convert_through_another_model_format(conformance: Path, tmp_path: Path) -> None:
    src = conformance / "datacode/model_mnist.nn"
    # netcl has no place for the training record (stages, histories): refused unless lossy
    with pytest.raises(ConversionError, match="datacode training"):
        ptio.convert(src, tmp_path / "m.netcl", to="netcl")
    with pytest.warns(PytreeioWarning, match="dropping datacode training"):
        ptio.convert(src, tmp_path / "m.netcl", to="netcl", lossy=True)
    ptio.convert(tmp_path / "m.netcl", tmp_path / "back.nn", to="datacode", variant="later")
    native, meta = ptio.load_with_meta(tmp_path / "back.nn")
    original = ptio.load(src, variant="later")
    for k in original:
        for part in ("weight", "bias"):
            assert native[k][part].tobytes() == original[k][part].tobytes()
    assert [la["name"] for la in meta["layers"]] == ["layer0", "layer1", "layer1"]
    assert meta["training"] == dc.empty_training()  # stages live in DataCode's own meta only


def _layered_file(variant: str = "seed", n: int = 3, width: int = 4) -> bytes:
    rng = np.random.default_rng(0)
    tree = {
        f"layer{2 * i}": {
            "weight": rng.standard_normal((width, width), dtype=np.float32),
            "bias": rng.standard_normal(width, dtype=np.float32),
        }
        for i in range(n)
    }
    return dc.encode(tree, meta={"layers": ["Linear", "ReLU"] * n}, variant=variant).tobytes()


def test_later_variant_weights_are_transposed_views_and_documents_fresh() -> None:
    native, meta = dc.decode(memoryview(_layered_file("later")))
    assert meta[dc.FILE_KEY]["variant"] == "later"
    assert not native["layer0"]["weight"].flags.c_contiguous  # a transposed view, as read
    data = _layered_file()
    _, meta = dc.decode(memoryview(data))
    meta["layers"][0]["in_features"] = 99
    meta["training"] = "changed"
    _, again = dc.decode(memoryview(data))
    assert again["layers"][0]["in_features"] == 4 and again["training"] != "changed"


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("device", 5, "device must be a string"),
        ("training", [], "training must be an object"),
        ("training", {"stages": "x"}, "training.stages"),
        ("trainable", 1, "trainable"),  # equal to True, but not a bool
    ],
)
def test_to_model_and_encode_check_the_whole_document(
    field: str, value: object, problem: str
) -> None:
    native, meta = dc.decode(memoryview(_layered_file()))
    dc.to_model(native, meta)
    if field == "trainable":
        bad = {**meta, "layers": [{**meta["layers"][0], field: value}, *meta["layers"][1:]]}
    else:
        bad = {**meta, field: value}
    with pytest.raises(MismatchError, match=problem):
        dc.to_model(native, bad)
    with pytest.raises(MismatchError, match=problem):
        dc.encode(native, meta=bad)
