"""netcl formats without netcl itself: byte layout, config inference, Flax mapping, optax resume."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pytreeio as ptio
from pytreeio.containers import npy
from pytreeio.core.errors import FormatError, MismatchError
from pytreeio.formats.netcl import checkpoint as nck
from pytreeio.formats.netcl import model_file as nc
from pytreeio.model.form import model_of

RNG = np.random.default_rng(0)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


MLP = [{"weight": f32(4, 8), "bias": f32(8)}, {}, {"weight": f32(8, 3), "bias": f32(3)}]
MLP_CONFIG = ["Linear", "ReLU", "Linear"]


def netcl_savez_reference(layers: list[dict], config: list[dict]) -> bytes:
    """What netcl's save_model does, step for step, with numpy."""
    arrays = {f"{i}:{k}": v for i, layer in enumerate(layers) for k, v in layer.items()}
    doc = {"type": "Sequential", "config": config, "version": 2, "format": "netcl.single-file"}
    arrays["__netcl_meta__"] = np.array(json.dumps(doc), dtype=np.str_)
    f = io.BytesIO()
    np.savez(f, **arrays)
    return f.getvalue()


def test_model_file_is_byte_identical_to_netcl_save_model(tmp_path: Path) -> None:
    p = tmp_path / "mlp.netcl"
    ptio.save(p, MLP, meta={"config": MLP_CONFIG})
    full = [
        {"type": "Linear", "args": {"in_features": 4, "out_features": 8, "bias": True}},
        {"type": "ReLU", "args": {}},
        {"type": "Linear", "args": {"in_features": 8, "out_features": 3, "bias": True}},
    ]
    assert p.read_bytes() == netcl_savez_reference(MLP, full)
    with zipfile.ZipFile(p) as z:
        names = [i.filename for i in z.infolist()]
        assert names[-1] == "__netcl_meta__.npy"
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    back = ptio.load(p)
    assert [sorted(layer) for layer in back] == [["bias", "weight"], [], ["bias", "weight"]]
    np.testing.assert_array_equal(back[0]["weight"], MLP[0]["weight"])
    assert ptio.inspect(p).meta["config"] == full
    # round trip: native tree + meta -> identical bytes
    native, meta = ptio.load_with_meta(p)
    q = tmp_path / "again.netcl"
    ptio.save(q, native, meta=meta)
    assert q.read_bytes() == p.read_bytes()


def test_config_inference_and_errors() -> None:
    only_params = [
        {"weight": f32(4, 8)},
        {"gamma": f32(8), "beta": f32(8), "running_mean": f32(8), "running_var": f32(8)},
    ]
    enc = nc.encode(only_params, meta=None)
    meta = nc.decode({"model": enc.files["model"].tobytes()}).meta
    assert meta["config"] == [
        {"type": "Linear", "args": {"in_features": 4, "out_features": 8, "bias": False}},
        {"type": "BatchNorm2d", "args": {"num_features": 8, "momentum": 0.1, "eps": 1e-05}},
    ]
    with pytest.raises(MismatchError, match="layer 1 has no parameters") as e:
        nc.encode(MLP, meta=None)
    assert "meta.config[1]" in str(e.value)
    with pytest.raises(MismatchError, match="shape"):
        nc.encode(
            MLP, meta={"config": [{"type": "Linear", "args": {"in_features": 5}}, "ReLU", "Linear"]}
        )
    with pytest.raises(MismatchError, match="unknown layer type"):
        nc.encode(MLP, meta={"config": ["Linear", "GELU", "Linear"]})
    with pytest.raises(MismatchError, match="unknown args"):
        nc.encode(MLP, meta={"config": ["Linear", {"type": "ReLU", "args": {"x": 1}}, "Linear"]})


def test_all_layer_types_round_trip() -> None:
    layers = [
        {"weight": f32(4, 3, 3, 3), "bias": f32(4)},
        {"gamma": f32(4), "beta": f32(4), "running_mean": f32(4), "running_var": f32(4)},
        {}, {}, {}, {}, {}, {}, {},
        {"weight": f32(16, 5), "bias": f32(5)},
    ]  # fmt: skip
    config = [
        {"type": "Conv2d", "args": {"pad": 1}}, "BatchNorm2d", "ReLU", "MaxPool2d",
        {"type": "LeakyReLU", "args": {"negative_slope": 0.2}}, "Sigmoid", "Tanh", "Flatten",
        {"type": "Dropout", "args": {"p": 0.3, "seed": 1}}, "Linear",
    ]  # fmt: skip
    raw = nc.encode(layers, meta={"config": config}).files["model"].tobytes()
    tree, meta = nc.decode({"model": raw})
    assert [c["type"] for c in meta["config"]] == [
        "Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "LeakyReLU", "Sigmoid", "Tanh", "Flatten", "Dropout", "Linear",
    ]  # fmt: skip
    assert meta["config"][0]["args"] == {
        "in_channels": 3, "out_channels": 4, "kernel_size": 3, "stride": 1, "pad": 1, "bias": True,
        "dilation": 1, "groups": 1,
    }  # fmt: skip
    assert meta["config"][8]["args"] == {"p": 0.3, "seed": 1}
    for a, b in zip(tree, layers):
        assert list(a) == list(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_legacy_pair_and_netcl_fallback(tmp_path: Path) -> None:
    raw = nc.encode(MLP, meta={"config": MLP_CONFIG}).files["model"].tobytes()
    _tree, meta = nc.decode({"model": raw})
    stem = tmp_path / "legacy"
    arrays = {f"{i}:{k}": v for i, layer in enumerate(MLP) for k, v in layer.items()}
    np.savez(str(stem) + ".npz", **arrays)
    legacy_meta = {
        "type": "Sequential",
        "version": 1,
        "layers": [{"type": c["type"], **c["args"]} for c in meta["config"]],
    }
    Path(str(stem) + ".json").write_text(json.dumps(legacy_meta))
    back = ptio.load(stem)
    np.testing.assert_array_equal(back[2]["weight"], MLP[2]["weight"])
    assert ptio.load_with_meta(stem)[1]["version"] == 1
    fb = tmp_path / "fallback"
    Path(str(fb) + ".netcl").write_bytes(raw)
    np.testing.assert_array_equal(ptio.load(fb)[0]["bias"], MLP[0]["bias"])


def test_model_file_hostile_content() -> None:
    bad_meta = {
        "0:weight": np.ones((2, 2), np.float32),
        "__netcl_meta__": np.array("{not json", dtype=np.str_),
    }
    f = io.BytesIO()
    np.savez(f, **bad_meta)
    with pytest.raises(FormatError, match="JSON"):
        nc.decode({"model": f.getvalue()})
    f = io.BytesIO()
    np.savez(f, **{"0:weight": np.ones((2, 2), np.float32)})
    with pytest.raises(FormatError, match="missing NetCL metadata"):
        nc.decode({"model": f.getvalue()})
    doc = {
        "type": "Sequential",
        "config": [{"type": "Linear", "args": {"in_features": 3, "out_features": 2}}],
    }
    f = io.BytesIO()
    np.savez(
        f, **{"0:weight": np.ones((2, 2), np.float32), "__netcl_meta__": np.array(json.dumps(doc))}
    )
    with pytest.raises(FormatError, match="shape"):
        nc.decode({"model": f.getvalue()})
    raw = nc.encode(MLP, meta={"config": MLP_CONFIG}).files["model"].tobytes()
    for n in range(0, len(raw), 7):
        with pytest.raises(FormatError):
            nc.decode({"model": raw[:n]})


# --------------------------------------------------------------------------
# Flax
# --------------------------------------------------------------------------


def _flax_cnn() -> tuple[dict, list]:
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
            x = nn.Conv(4, (3, 3), padding=1)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.relu(x)
            x = x.reshape((x.shape[0], -1))
            return nn.Dense(5)(x)

    variables = CNN().init(jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 3)))
    config = [{"type": "Conv2d", "args": {"pad": 1}}, "BatchNorm2d", "ReLU", "Flatten", "Linear"]
    return jax.tree.map(np.asarray, dict(variables)), config


def test_flax_cnn_maps_to_netcl_indices_and_back(tmp_path: Path) -> None:
    variables, config = _flax_cnn()
    variables["batch_stats"]["BatchNorm_0"]["mean"] = f32(4)
    p = tmp_path / "cnn.netcl"
    ptio.save(p, variables, format="netcl", meta={"config": config})
    native = ptio.load(p)
    kernel = variables["params"]["Conv_0"]["kernel"]
    np.testing.assert_array_equal(native[0]["weight"], kernel.transpose(3, 2, 0, 1))
    np.testing.assert_array_equal(
        native[1]["running_mean"], variables["batch_stats"]["BatchNorm_0"]["mean"]
    )
    np.testing.assert_array_equal(native[4]["weight"], variables["params"]["Dense_0"]["kernel"])
    back = ptio.load(p, like=variables)
    jax.tree.map(np.testing.assert_array_equal, back, variables)
    abstract = jax.eval_shape(lambda: variables)
    back2 = ptio.load(p, like=abstract)
    jax.tree.map(np.testing.assert_array_equal, back2, variables)
    with pytest.raises(MismatchError, match="batch_stats"):
        ptio.load(p, like=variables["params"])
    with pytest.raises(MismatchError, match="layer order"):
        ptio.save(tmp_path / "x.netcl", variables)


def test_flax_layers_n_naming(tmp_path: Path) -> None:
    params = {
        "layers_0": {"kernel": f32(4, 8), "bias": f32(8)},
        "layers_2": {"kernel": f32(8, 3), "bias": f32(3)},
    }
    p = tmp_path / "seq.netcl"
    with pytest.raises(MismatchError, match="layer 1 has no parameters"):
        ptio.save(p, params)
    ptio.save(p, {"params": params}, meta={"config": MLP_CONFIG})
    back = ptio.load(p, like={"params": params})
    jax.tree.map(np.testing.assert_array_equal, back, {"params": params})


# --------------------------------------------------------------------------
# checkpoints, raw params, optax exact resume
# --------------------------------------------------------------------------


def _loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    out = h @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]
    return jnp.mean((out - y) ** 2)


def _train(
    opt: optax.GradientTransformation, params: dict, state: optax.OptState, steps: int, start: int
) -> tuple:
    @jax.jit
    def step(params: dict, state: optax.OptState, i: jax.Array) -> tuple:
        key = jax.random.fold_in(jax.random.PRNGKey(1), i)
        x = jax.random.normal(key, (16, 4))
        y = jnp.sin(x[:, :3])
        grads = jax.grad(_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(start, start + steps):
        params, state = step(params, state, i)
    return params, state


@pytest.mark.parametrize(
    "opt",
    [
        optax.adamw(1e-2),
        optax.adam(3e-3),
        optax.sgd(1e-2, momentum=0.9),
        optax.adamw(optax.linear_schedule(1e-2, 1e-3, 20)),
    ],
    ids=["adamw", "adam", "sgd-momentum", "adamw-schedule"],
)
def test_exact_resume_through_netcl_checkpoint(
    tmp_path: Path, opt: optax.GradientTransformation
) -> None:
    params = {
        "Dense_0": {"kernel": jnp.asarray(f32(4, 8)), "bias": jnp.zeros(8)},
        "Dense_1": {"kernel": jnp.asarray(f32(8, 3)), "bias": jnp.zeros(3)},
    }
    state = opt.init(params)
    ref_p, ref_s = _train(opt, params, state, 10, 0)
    mid_p, mid_s = _train(opt, params, state, 6, 0)
    p = tmp_path / "ckpt" / "iter_6"
    p.parent.mkdir()
    ptio.save(
        p,
        {"params": mid_p, "optim_state": mid_s},
        format="netcl-checkpoint",
        meta={"config": {"step": 6}},
    )
    assert (tmp_path / "ckpt" / "iter_6.npz").is_file() and (
        tmp_path / "ckpt" / "iter_6.json"
    ).is_file()
    doc = json.loads((tmp_path / "ckpt" / "iter_6.json").read_text())
    assert list(doc) == ["optim_state", "config"]
    assert ("t" in doc["optim_state"]) != ("velocity" in doc["optim_state"])
    like = {"params": params, "optim_state": state}
    loaded = ptio.load(p, like=like, format="netcl-checkpoint")
    assert ptio.load_with_meta(p, format="netcl-checkpoint")[1]["config"] == {"step": 6}
    res_p, res_s = _train(opt, loaded["params"], loaded["optim_state"], 4, 6)
    for a, b in zip(jax.tree.leaves((res_p, res_s)), jax.tree.leaves((ref_p, ref_s))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    native = ptio.load(p, format="netcl-checkpoint")
    assert list(native["params"]) == ["p0", "p1", "p2", "p3"]


def test_conv_moments_are_transposed_like_the_kernel(tmp_path: Path) -> None:
    variables, config = _flax_cnn()
    params = variables["params"]
    opt = optax.adam(1e-3)
    state = opt.init(params)
    grads = jax.tree.map(lambda x: jnp.ones_like(x) * 0.5, params)
    _, state = opt.update(grads, state, params)
    p = tmp_path / "c"
    ptio.save(p, {"params": params, "optim_state": state}, format="netcl-checkpoint", layers=config)
    doc = json.loads(Path(str(p) + ".json").read_text())
    m0 = np.asarray(doc["optim_state"]["moments"][0][0], np.float32)
    np.testing.assert_array_equal(
        m0, np.asarray(state[0].mu["Conv_0"]["kernel"]).transpose(3, 2, 0, 1)
    )
    back = ptio.load(
        p, like={"params": params, "optim_state": state}, format="netcl-checkpoint", layers=config
    )
    for a, b in zip(jax.tree.leaves(back["optim_state"]), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_netcl_params_errors_have_netcl_wording(tmp_path: Path) -> None:
    p = tmp_path / "raw.npz"
    ptio.save(p, [f32(2, 3), f32(3)], format="netcl-params", names=["fc.weight", "fc.bias"])
    with np.load(p) as z:
        assert z.files == ["fc.weight", "fc.bias"]
    with pytest.raises(KeyError) as e:
        ptio.load(
            p, like=[np.zeros((2, 3), np.float32), np.zeros(3, np.float32)], format="netcl-params"
        )
    assert isinstance(e.value, nck.NetclMissingParamError) and isinstance(e.value, MismatchError)
    assert "missing param p0 in checkpoint" in str(e.value)
    with pytest.raises(
        ValueError, match=r"shape mismatch for fc.bias: ckpt \(3,\) vs param \(4,\)"
    ) as e2:
        ptio.load(
            p, like=[np.zeros((2, 3), np.float32), np.zeros(4, np.float32)], format="netcl-params",
            names=["fc.weight", "fc.bias"],
        )  # fmt: skip
    assert isinstance(e2.value, nck.NetclShapeMismatchError)
    back = ptio.load(
        p,
        like=[np.zeros((2, 3), np.float32), np.zeros(3, np.float32)],
        format="netcl-params",
        names=["fc.weight", "fc.bias"],
    )
    assert back[0].shape == (2, 3)


def test_checkpoint_json_hostile(tmp_path: Path) -> None:
    npz = nck._encode_params([f32(2)], meta=None).files["npz"].tobytes()
    for bad in (b"[1, 2]", b"{", b"\xff\xfe", b"[" * 100000):
        with pytest.raises(FormatError):
            nck._decode_checkpoint({"npz": npz, "json": bad})
    opt = optax.adam(1e-3)
    like = {"params": [np.zeros(2, np.float32)], "optim_state": opt.init([jnp.zeros(2)])}
    for state in (
        {"t": 1, "moments": [[["a", "b"], [0, 0]]]},
        {"t": -1, "moments": []},
        {"t": 1, "moments": [[[1e300, 0], [0, 0]]]},
    ):
        doc = json.dumps({"optim_state": state, "config": {}}).encode()
        with pytest.raises((FormatError, MismatchError)):
            native, meta = nck._decode_checkpoint({"npz": npz, "json": doc})
            nck._restore_checkpoint(native, meta, like)


# --------------------------------------------------------------------------
# hostile input found by the audit: only pytreeio errors
# --------------------------------------------------------------------------


def _npz_bytes(arrays: dict) -> bytes:
    f = io.BytesIO()
    np.savez(f, **arrays)
    return f.getvalue()


def _model_file(config: list, arrays: dict) -> bytes:
    doc = {"type": "Sequential", "config": config, "version": 2, "format": "netcl.single-file"}
    return _npz_bytes({**arrays, "__netcl_meta__": np.array(json.dumps(doc))})


def test_layer_type_that_is_not_a_string_is_a_format_error() -> None:
    raw = _model_file([{"type": ["Linear"], "args": {}}], {})
    with pytest.raises(FormatError, match="unknown layer type") as e:
        nc.decode({"model": raw})
    assert e.value.field == "__netcl_meta__.config[0].type"


def test_huge_layer_index_in_a_member_name_is_a_format_error() -> None:
    raw = _model_file([{"type": "ReLU"}], {"9" * 5000 + ":weight": np.ones(2, np.float32)})
    with pytest.raises(FormatError, match="not named"):
        nc.decode({"model": raw})


def test_inspect_of_a_legacy_pair_with_bad_utf8_is_a_format_error(tmp_path: Path) -> None:
    stem = tmp_path / "legacy"
    np.savez(str(stem) + ".npz", **{"0:weight": np.ones((2, 2), np.float32)})
    Path(str(stem) + ".json").write_bytes(b'{"type": "Sequential", "x": "\xff\xfe"}')
    with pytest.raises(FormatError) as e:
        ptio.inspect(stem, format="netcl")
    assert e.value.offset is not None


def test_step_count_beyond_the_like_dtype_is_a_mismatch_not_an_overflow(tmp_path: Path) -> None:
    params = {"Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
    opt = optax.adam(1e-3)
    state = opt.init(params)
    p = tmp_path / "c"
    ptio.save(p, {"params": params, "opt_state": state}, format="netcl-checkpoint")
    doc = json.loads(Path(str(p) + ".json").read_text())
    doc["optim_state"]["t"] = 2**31
    Path(str(p) + ".json").write_text(json.dumps(doc))
    with pytest.raises(MismatchError):
        ptio.load(p, like={"params": params, "opt_state": state}, format="netcl-checkpoint")
    doc["optim_state"]["t"] = 2**64
    Path(str(p) + ".json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"optim_state\.t"):
        ptio.load(p, format="netcl-checkpoint")


@pytest.mark.parametrize("bad_leaf", [None, {}, "x", 3.5])
def test_like_with_odd_leaves_is_a_mismatch(tmp_path: Path, bad_leaf: object) -> None:
    p = tmp_path / "c"
    ptio.save(p, {"params": [f32(2, 3), f32(3)]}, format="netcl-checkpoint")
    like = {"params": [np.zeros((2, 3), np.float32), bad_leaf]}
    with pytest.raises(ptio.PytreeioError):
        ptio.load(p, like=like, format="netcl-checkpoint")
    with pytest.raises(ptio.PytreeioError):
        ptio.load(p, like={"params": {"Dense_0": {"kernel": bad_leaf}}}, format="netcl-checkpoint")


def test_extra_like_leaves_in_a_checkpoint_are_refused_not_returned(tmp_path: Path) -> None:
    p = tmp_path / "c"
    ptio.save(
        p, {"params": [f32(2)], "optim_state": {}, "config": {"lr": 0.1}}, format="netcl-checkpoint"
    )
    like = {"params": [np.zeros(2, np.float32)], "optim_state": {"t": 0}, "config": {"lr": 0.0}}
    with pytest.raises(MismatchError):
        ptio.load(p, like=like, format="netcl-checkpoint")
    like2 = {"params": [np.zeros(2, np.float32)], "config": {"lr": 0.0, "momentum": 0.9}}
    with pytest.raises(MismatchError):
        ptio.load(p, like=like2, format="netcl-checkpoint")


def test_a_like_namedtuple_with_a_count_the_file_lacks_is_a_mismatch(tmp_path: Path) -> None:
    p = tmp_path / "c"
    params = {"Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
    opt = optax.sgd(0.1, momentum=0.9)
    ptio.save(p, {"params": params, "opt_state": opt.init(params)}, format="netcl-checkpoint")
    adam_like = optax.adam(1e-3).init(params)  # has a count; the SGD file has none
    with pytest.raises(MismatchError):
        ptio.load(p, like={"params": params, "opt_state": adam_like}, format="netcl-checkpoint")


def test_convert_passes_meta_that_save_would_store(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    ptio.save(src, {"params": {"p0": f32(2)}, "optim_state": {}, "config": {}})
    dst = tmp_path / "b"
    ptio.convert(src, dst, to="netcl-checkpoint", meta={"config": {"epochs": 3}})
    assert json.loads(Path(str(dst) + ".json").read_text())["config"] == {"epochs": 3}


def test_unknown_options_raise_type_error_on_save_load_and_convert(tmp_path: Path) -> None:
    p = tmp_path / "m.netcl"
    with pytest.raises(TypeError, match="verfy"):
        ptio.save(p, MLP, format="netcl", meta={"config": MLP_CONFIG}, verfy=1)
    ptio.save(p, MLP, format="netcl", meta={"config": MLP_CONFIG})
    with pytest.raises(TypeError, match="verfy"):
        ptio.load(p, verfy=1)
    with pytest.raises(TypeError, match="verfy"):
        ptio.convert(p, tmp_path / "x.safetensors", to="safetensors", verfy=1)
    ptio.convert(p, tmp_path / "x.safetensors", to="safetensors", verify_crc=False)


def test_checkpoint_moments_are_arrays_in_the_native_tree(tmp_path: Path) -> None:
    params = {"Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
    opt = optax.adamw(1e-3)
    state = opt.init(params)
    p = tmp_path / "c"
    ptio.save(p, {"params": params, "opt_state": state}, format="netcl-checkpoint")
    native = ptio.load(p, format="netcl-checkpoint")
    m, _v = native["optim_state"]["moments"][0]
    assert isinstance(m, np.ndarray) and m.shape == (2, 3) and m.dtype == np.float32
    st = tmp_path / "c.safetensors"
    ptio.convert(p, st, to="safetensors", from_="netcl-checkpoint")
    assert len(ptio.inspect(st).entries) == 2 + 4 + 1  # two params, two moment pairs, t


def test_a_bad_layer_in_a_file_is_named_among_alike_ones() -> None:
    # Alike layers are checked together; the one at fault is still the one named.
    layers = [{"weight": f32(4, 4), "bias": f32(4)} for _ in range(6)]
    enc = nc.encode(layers, meta=None)
    data = enc.files["model"].tobytes()
    native, meta = nc.decode({"model": data})
    meta["config"][3]["args"]["out_features"] = 5  # the same arrays, a config that lies
    items = [(f"{i}:{k}", a) for i, layer in enumerate(native) for k, a in layer.items()]
    items.append((nc.META_KEY, np.array(json.dumps(meta), dtype=np.str_)))
    raw = b"".join(bytes(c) for c in npy.encode_npz(items))
    with pytest.raises(FormatError) as e:
        nc.decode({"model": raw})
    assert e.value.field == "__netcl_meta__.config[3]"


def test_save_through_the_common_form_checks_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The API tells encode its tree came from from_model: no second round through the model.
    tree = {"params": {f"Dense_{i}": {"kernel": f32(3, 3), "bias": f32(3)} for i in range(3)}}
    model = model_of(tree)
    native, doc = nc.from_model(model)
    checked = nc.encode(native, meta=doc).files["model"].tobytes()
    calls: list[int] = []
    original = nc._model_of_native
    monkeypatch.setattr(nc, "_model_of_native", lambda *a: calls.append(1) or original(*a))
    ptio.save(tmp_path / "m.netcl", tree, format="netcl", durable=False)
    assert calls == []
    assert (tmp_path / "m.netcl").read_bytes() == checked
    assert nc.encode(native, meta=doc, checked=True).files["model"].tobytes() == checked


def _layers_file(config_out: int = 4, n: int = 6) -> bytes:
    layers = [{"weight": f32(4, 4), "bias": f32(4)} for _ in range(n)]
    raw = nc.encode(layers, meta=None).files["model"].tobytes()
    if config_out == 4:
        return raw
    native, meta = nc.decode({"model": raw})
    meta["config"][2]["args"]["out_features"] = config_out  # same length, a config that lies
    items = [(f"{i}:{k}", a) for i, layer in enumerate(native) for k, a in layer.items()]
    items.append((nc.META_KEY, np.array(json.dumps(meta), dtype=np.str_)))
    return b"".join(bytes(c) for c in npy.encode_npz(items))


def test_a_decode_checks_every_structure_again() -> None:
    raw = _layers_file()
    first = nc.decode({"model": raw})
    again = nc.decode({"model": raw})
    assert [list(layer) for layer in again.tree] == [list(layer) for layer in first.tree]
    for a, b in zip(first.tree, again.tree):
        for k in a:
            assert a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
    assert again.meta == first.meta and again.meta is not first.meta  # a fresh document
    # a meta text that differs (same length, same members) is checked, and its fault found
    with pytest.raises(FormatError) as e:
        nc.decode({"model": _layers_file(config_out=5)})
    assert e.value.field == "__netcl_meta__.config[2]"
    # a member of another shape under the same meta is checked too
    items = [(k, a) for k, a in npy.read_npz(raw).items()]
    items[0] = (items[0][0], f32(2, 8))
    with pytest.raises(FormatError, match="config"):
        nc.decode({"model": b"".join(bytes(c) for c in npy.encode_npz(items))})


def _slot_reference(value: object, like: np.ndarray) -> np.ndarray:
    """One moment as netcl-checkpoint reads it: the parameter's float dtype where exact."""
    arr = np.array(value, dtype=np.float64).reshape(like.shape)
    if like.dtype.kind == "f":
        with np.errstate(over="ignore", invalid="ignore"):
            narrow = arr.astype(like.dtype)
        if np.array_equal(narrow.astype(np.float64), arr, equal_nan=True):
            return narrow
    return arr


@pytest.mark.parametrize("seed", range(6))
def test_moments_are_narrowed_together_as_one_by_one(seed: int) -> None:
    """Moments exact in their parameter's dtype come back in it, the others as float64, whether
    read together or one by one; rows parsed as float64 arrays are not handed out themselves."""
    rng = np.random.default_rng(seed)
    params, values = [], []
    for i in range(12):
        dtype = rng.choice([np.float32, np.float16, np.float64, np.int32])
        shape = [(2, 3), (4,), (0,), (1, 1)][i % 4]
        params.append(np.zeros(shape, dtype))
        v = rng.standard_normal(shape).astype(np.float32).astype(np.float64)
        if v.size and rng.random() < 0.3:
            v.flat[0] = rng.choice([0.1, 1e300, np.nan, -0.0, np.inf])
        values.append(v if rng.random() < 0.5 else v.tolist())
    got = nck._slot_list(values, params, "optim_state.moments.m")
    for g, v, p in zip(got, values, params):
        want = _slot_reference(v, p)
        assert g.dtype == want.dtype and g.shape == want.shape
        assert g.tobytes() == want.tobytes()
        if isinstance(v, np.ndarray) and v.dtype != p.dtype:  # else decoded already: as it is
            assert not np.shares_memory(g, v)


def _with_members(members: list[tuple[str, np.ndarray]]) -> bytes:
    meta = {"type": "Sequential", "config": [{"type": "Linear", "args": {"in_features": 4, "out_features": 4, "bias": True}}], "version": 2, "format": "netcl.single-file"}  # fmt: skip
    items = [*members, (nc.META_KEY, np.array(json.dumps(meta), dtype=np.str_))]
    return b"".join(bytes(c) for c in npy.encode_npz(items))


def test_member_names_are_whole_names() -> None:
    """netcl looks a member up as f"{layer}:{name}" exactly: "0:weight\n" is another name (one
    no layer has: refused), never the weight (it was read as the weight, over the real one when
    it came second)."""
    weight, other, bias = f32(4, 4), f32(4, 4) + 1, f32(4)
    for members in (
        [("0:weight", weight), ("0:weight\n", other)],
        [("0:weight\n", other), ("0:weight", weight)],
        [("0:weight\n", other)],
    ):
        with pytest.raises(FormatError, match="unexpected array"):
            nc.decode({"model": _with_members([*members, ("0:bias", bias)])})
    got = nc.decode({"model": _with_members([("0:weight", weight), ("0:bias", bias)])}).tree
    assert got[0]["weight"].tobytes() == weight.tobytes()
