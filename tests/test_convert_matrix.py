"""The conversion matrix: every ordered pair of formats, with and without an optimizer state.

Each source checkpoint holds one small MLP (Linear 4->3, ReLU, Linear 3->2)
as faithfully as its format can: the layer list where the format has one
(netcl, DataCode, cl-waffe2's sidecar; safetensors carrying one of those),
an Adam state (count 3, moments mu/nu; learning rate where the format keeps
one) where the format holds one.  Every conversion between two of them,
through the pure :func:`pytreeio.convert_encoded`, either

* is **exact**: after converting, the target's common form has every
  parameter bit-identical, the layer types where both sides keep a layer
  list, and the moments and count bit-identical where both hold an
  optimizer state; or
* is **refused** with a :class:`~pytreeio.ConversionError` naming what does
  not fit, and then with ``lossy=True`` either exact for what remains (with a
  :class:`~pytreeio.PytreeioWarning` listing what was dropped) or still
  refused (a Tiny Llama is no layered model, whatever is dropped).

The expected outcome of every cell is derived from what each format holds
(:data:`HOLDS_OPT`, :data:`LAYERED`, ...), so the table documents the rules.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tinyllama_data import random_tree

import pytreeio as ptio
from pytreeio.engine import conversion as C
from pytreeio.model.form import Model

LR = 1e-3
COUNT = 3
LAYERS3 = ["Linear", "ReLU", "Linear"]
TYPES3 = ["Linear", "ReLU", "Linear"]
# A node of the matrix: a format name, or a format with save options (DataCode's later variant).
NODES = [
    "msgpack",
    "safetensors",
    "tinyllama",
    "netcl",
    "netcl-checkpoint",
    "netcl-params",
    "datacode",
    "datacode:later",
    "waffe2",
    "bullet",
]
#: Formats that hold an optimizer state (moments and count).
HOLDS_OPT = {"safetensors", "netcl-checkpoint", "waffe2", "bullet"}
#: Nodes whose source checkpoint keeps the layer list (activations included).
KEEPS_LAYERS = {"netcl", "datacode", "datacode:later", "waffe2", "safetensors"}
#: Formats that hold no layered model.
NOT_LAYERED = {"tinyllama"}
#: Formats that take anything as is (no model functions).
GENERIC = {"msgpack", "safetensors"}
TL_CONFIG = {
    "d_model": 8,
    "n_layers": 1,
    "n_heads": 2,
    "ffn_hidden_dim": 16,
    "max_seq_len": 4,
    "vocab_size": 5,
    "dropout": 0.0,
}


def fmt_of(node: str) -> str:
    return node.split(":")[0]


def save_options(node: str) -> dict[str, Any]:
    return {"variant": "later"} if node == "datacode:later" else {}


# --------------------------------------------------------------------------
# the reference model and the source checkpoints
# --------------------------------------------------------------------------


@functools.cache
def reference() -> tuple[dict[str, Any], Any]:
    """The MLP's Flax params and an ``inject_hyperparams(adam)`` state after three steps."""
    import jax
    import optax

    rng = np.random.default_rng(11)

    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    params = {
        "Dense_0": {"kernel": f32(4, 3), "bias": f32(3)},
        "Dense_1": {"kernel": f32(3, 2), "bias": f32(2)},
    }
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=LR)
    state = opt.init(params)
    for _ in range(COUNT):
        grads = jax.tree_util.tree_map(lambda a: f32(*a.shape), params)
        _, state = opt.update(grads, state, params)
    state = jax.tree_util.tree_map(np.asarray, state)
    return params, state


def reference_params() -> list[np.ndarray]:
    params, _ = reference()
    return [params[m][k] for m in ("Dense_0", "Dense_1") for k in ("kernel", "bias")]


def reference_moments() -> dict[str, list[np.ndarray]]:
    params, state = reference()
    adam = state.inner_state[0]
    return {
        slot: [np.asarray(getattr(adam, slot)[m][k]) for m in params for k in ("kernel", "bias")]
        for slot in ("mu", "nu")
    }


def files(enc: ptio.Encoded) -> Any:
    """An encoding as ``convert_encoded`` takes it: bytes, or relative path -> bytes."""
    if enc.files is not None:
        return {k: v.tobytes() for k, v in enc.files.items()}
    return enc.tobytes()


@functools.cache
def source(node: str, with_opt: bool) -> Any:
    """The MLP (with its Adam state) in ``node``'s format, or None where it cannot hold the state."""
    params, state = reference()
    fmt = fmt_of(node)
    tree: Any = {"params": params, "opt_state": state} if with_opt else params
    if fmt == "tinyllama":
        if with_opt:
            return None
        meta = {"config": {"n_heads": TL_CONFIG["n_heads"], "dropout": TL_CONFIG["dropout"]}}
        return files(ptio.encode(random_tree(TL_CONFIG), format="tinyllama", meta=meta))
    if fmt == "msgpack":
        if with_opt:
            return None  # a Flax tree's optax state: not a model state convert can read back
        return files(ptio.encode({"params": sequential(params)}, format="msgpack"))
    if fmt == "safetensors":
        if with_opt:  # what converting a cl-waffe2 checkpoint gives: its native tree, carried
            return files(
                ptio.convert_encoded(source("waffe2", True), from_="waffe2", to="safetensors")
            )
        return files(ptio.encode({"params": sequential(params)}, format="safetensors"))
    if with_opt and fmt not in HOLDS_OPT:
        return None
    options: dict[str, Any] = dict(save_options(node))
    if fmt in ("netcl", "datacode", "waffe2"):
        options["layers"] = LAYERS3
    if fmt == "waffe2" and with_opt:
        options["optimizers"] = True
    return files(ptio.encode(tree, format=fmt, **options))


def sequential(params: dict[str, Any]) -> dict[str, Any]:
    """The params as ``nn.Sequential`` names them (the ReLU at position 1)."""
    return {"layers_0": params["Dense_0"], "layers_2": params["Dense_1"]}


# --------------------------------------------------------------------------
# expected outcomes
# --------------------------------------------------------------------------


def expected(src: str, dst: str, with_opt: bool) -> str:
    """``exact``, ``lossy`` (refused; exact for what remains with lossy=True) or ``never``."""
    s, t = fmt_of(src), fmt_of(dst)
    if s == t and src == dst:
        return "exact"
    if s in NOT_LAYERED or t in NOT_LAYERED:
        if s == "tinyllama" and t == "safetensors":
            return "exact"
        if s == "tinyllama" and t == "msgpack":
            return "lossy"  # msgpack has no place for the config
        return "never"
    if with_opt and t not in HOLDS_OPT:
        return "lossy"
    return "exact"


def conversion_options(src: str, dst: str, with_opt: bool) -> dict[str, Any]:
    s, t = fmt_of(src), fmt_of(dst)
    target = ptio.list_formats()[t]
    options = dict(save_options(dst))
    if s in GENERIC and not with_opt and target.is_model_format:
        options["layers"] = LAYERS3  # a Flax tree has no activations: layers= places them
    if t == "waffe2" and with_opt:
        options["hyperparams"] = {"learning_rate": LR}  # netcl and bullet keep no learning rate
    return options


def read_back(node: str, data: Any, like_source: str) -> Model:
    """The common form of an encoded checkpoint (``layers=`` for Flax trees with activation gaps)."""
    fmt = fmt_of(node)
    if fmt in GENERIC:
        try:
            return C.decode_model(data, fmt)
        except ptio.MismatchError:
            return C.decode_model(data, fmt, layers=LAYERS3)
    return C.decode_model(data, fmt)


def param_bits(model: Model) -> list[tuple[tuple[int, ...], str, bytes]]:
    return [
        (np.shape(a), np.asarray(a).dtype.str, np.asarray(a).tobytes()) for _, _, a in model.params
    ]


def expected_bits() -> list[tuple[tuple[int, ...], str, bytes]]:
    return [(a.shape, a.dtype.str, a.tobytes()) for a in reference_params()]


def check_exact(src: str, dst: str, with_opt: bool, out: Any, *, lossy: bool = False) -> None:
    s, t = fmt_of(src), fmt_of(dst)
    if s == "tinyllama":
        native = ptio.decode(out, format=t)
        original = ptio.decode(source(src, False), format="tinyllama")
        got = sorted(np.asarray(v).tobytes() for v in ptio.flatten(native).values())
        want = sorted(np.asarray(v).tobytes() for v in ptio.flatten(original).values())
        assert got == want
        return
    model = read_back(dst, out, src)
    assert param_bits(model) == expected_bits(), f"{src} -> {dst}: parameters differ"
    if src in KEEPS_LAYERS and dst in KEEPS_LAYERS and not (s == "safetensors" and not with_opt):
        assert [la.type for la in model.layers] == TYPES3, f"{src} -> {dst}: layer list"
    if with_opt and t in HOLDS_OPT and not lossy:
        opt = model.opt_state
        assert opt is not None, f"{src} -> {dst}: optimizer state lost"
        assert opt.kind in ("adam", "adamw") and opt.count == COUNT
        for slot, want in reference_moments().items():
            got = [np.asarray(a).tobytes() for a in opt.slots[slot]]
            assert got == [a.tobytes() for a in want], f"{src} -> {dst}: {slot} differs"
    elif lossy and with_opt:
        assert model.opt_state is None


CELLS = [
    (s, t, o)
    for o in (False, True)
    for s in NODES
    for t in NODES
    if not (o and fmt_of(s) not in HOLDS_OPT)  # a source that holds no optimizer state
]


@pytest.mark.parametrize(
    ("src", "dst", "with_opt"),
    CELLS,
    ids=[f"{s}->{t}{'+opt' if o else ''}" for s, t, o in CELLS],
)
def test_matrix(src: str, dst: str, with_opt: bool) -> None:
    data = source(src, with_opt)
    outcome = expected(src, dst, with_opt)
    options = conversion_options(src, dst, with_opt)
    convert = functools.partial(
        ptio.convert_encoded, data, from_=fmt_of(src), to=fmt_of(dst), **options
    )
    if outcome == "exact":
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing dropped, nothing to warn about
            out = convert()
        check_exact(src, dst, with_opt, files(out))
        return
    with pytest.raises(ptio.ConversionError) as refused:
        convert()
    assert refused.value.what, "a refusal names what does not fit"
    if outcome == "never":
        with pytest.raises(ptio.ConversionError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            convert(lossy=True)
        return
    with pytest.warns(ptio.PytreeioWarning, match="dropping") as dropped:
        out = convert(lossy=True)
    reported = " ".join(str(w.message) for w in dropped)
    for what in refused.value.what:
        assert what.split(" (")[0].split(".")[-1] in reported, (what, reported)
    check_exact(src, dst, with_opt, files(out), lossy=True)


@pytest.mark.parametrize("node", [n for n in NODES if fmt_of(n) not in NOT_LAYERED])
def test_reference_into_every_format(node: str) -> None:
    """The optimizer state goes where there is a place for it, and is refused elsewhere."""
    params, state = reference()
    fmt = fmt_of(node)
    tree = {"params": params, "opt_state": state}
    options = {**save_options(node), "optimizers": True} if fmt == "waffe2" else save_options(node)
    src = files(ptio.encode(tree, format="netcl-checkpoint"))
    if fmt in HOLDS_OPT:
        opts = {"hyperparams": {"learning_rate": LR}} if fmt == "waffe2" else {}
        out = ptio.convert_encoded(src, from_="netcl-checkpoint", to=fmt, **opts)
        assert C.decode_model(files(out), fmt).opt_state.count == COUNT
        if fmt != "safetensors":
            ptio.encode(tree, format=fmt, **options)  # a Flax training state saves as well
        return
    with pytest.raises(ptio.ConversionError, match="optimizer state") as refused:
        ptio.convert_encoded(src, from_="netcl-checkpoint", to=fmt, **save_options(node))
    assert any("optimizer state" in w for w in refused.value.what)


# --------------------------------------------------------------------------
# the chain of the issue, with files, and the CLI
# --------------------------------------------------------------------------


def test_chain_through_files_is_bit_exact(tmp_path: Path) -> None:
    """netcl-checkpoint -> bullet -> cl-waffe2 -> safetensors -> netcl-checkpoint."""
    params, state = reference()
    first = tmp_path / "ckpt"
    ptio.save(first, {"params": params, "opt_state": state}, format="netcl-checkpoint")
    ptio.convert(first, tmp_path / "run-3", to="bullet")
    # bullet keeps no learning rate; cl-waffe2 needs one
    with pytest.raises(ptio.ConversionError, match="learning rate"):
        ptio.convert(tmp_path / "run-3", tmp_path / "m.wf2model", to="waffe2")
    assert not (tmp_path / "m.wf2model").exists()
    ptio.convert(
        tmp_path / "run-3", tmp_path / "m.wf2model", to="waffe2", hyperparams={"learning_rate": LR}
    )
    ptio.convert(tmp_path / "m.wf2model", tmp_path / "m.safetensors", to="safetensors")
    ptio.convert(tmp_path / "m.safetensors", tmp_path / "back", to="netcl-checkpoint")
    assert (tmp_path / "back.npz").read_bytes() == (tmp_path / "ckpt.npz").read_bytes()
    assert (tmp_path / "back.json").read_bytes() == (tmp_path / "ckpt.json").read_bytes()
    # each step loads into the caller's structure, the safetensors one too
    import optax

    like = {"params": params, "opt_state": optax.adam(LR).init(params)}
    for path in ("run-3", "m.wf2model", "m.safetensors"):
        got = ptio.load(tmp_path / path, like=like)
        assert [np.asarray(a).tobytes() for a in ptio.flatten(got["params"]).values()] == [
            np.asarray(a).tobytes() for a in ptio.flatten(params).values()
        ]
        assert int(got["opt_state"][0].count) == COUNT


def test_cli_convert_lossy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pytreeio import cli

    params, state = reference()
    ptio.save(tmp_path / "ckpt", {"params": params, "opt_state": state}, format="netcl-checkpoint")
    argv = ["convert", str(tmp_path / "ckpt"), str(tmp_path / "m.nn"), "--to", "datacode"]
    assert cli.main(argv) == 1
    assert "optimizer state" in capsys.readouterr().err and not (tmp_path / "m.nn").exists()
    assert cli.main([*argv, "--lossy"]) == 0
    assert "optimizer state" in capsys.readouterr().err  # the warning lists what was dropped
    model = C.decode_model((tmp_path / "m.nn").read_bytes(), "datacode")
    assert param_bits(model) == expected_bits()


# --------------------------------------------------------------------------
# what travels through the generic formats, and what is refused
# --------------------------------------------------------------------------


def test_datacode_training_stages_are_refused_or_carried(conformance: Path, tmp_path: Path) -> None:
    src = conformance / "datacode" / "model_mnist.nn"
    with pytest.raises(ptio.ConversionError, match="datacode training") as refused:
        ptio.convert(src, tmp_path / "m.netcl", to="netcl")
    assert refused.value.what == ["datacode training"] and not (tmp_path / "m.netcl").exists()
    with pytest.warns(ptio.PytreeioWarning, match="dropping datacode training"):
        ptio.convert(src, tmp_path / "m.netcl", to="netcl", lossy=True)
    # safetensors keeps the whole document: back to DataCode byte for byte
    ptio.convert(src, tmp_path / "m.safetensors", to="safetensors")
    assert ptio.inspect(tmp_path / "m.safetensors").meta[C.FORMAT_KEY] == "datacode"
    ptio.convert(tmp_path / "m.safetensors", tmp_path / "back.nn", to="datacode")
    assert (tmp_path / "back.nn").read_bytes() == src.read_bytes()
    # ... and onward as the DataCode file would convert
    with pytest.raises(ptio.ConversionError, match="datacode training"):
        ptio.convert(tmp_path / "m.safetensors", tmp_path / "x.netcl", to="netcl")
    # msgpack has no place for it
    with pytest.raises(ptio.ConversionError, match="datacode training"):
        ptio.convert(src, tmp_path / "m.msgpack", to="msgpack")


def test_msgpack_gets_flax_variables_and_converts_back_with_layers(tmp_path: Path) -> None:
    params, _ = reference()
    ptio.save(tmp_path / "m.netcl", params, format="netcl", layers=LAYERS3)
    ptio.convert(tmp_path / "m.netcl", tmp_path / "m.msgpack", to="msgpack")
    native = ptio.load(tmp_path / "m.msgpack")
    assert sorted(native["params"]) == ["layers_0", "layers_2"]  # the ReLU keeps its place
    with pytest.raises(ptio.MismatchError, match="layers="):
        ptio.convert(tmp_path / "m.msgpack", tmp_path / "b.netcl", to="netcl")
    ptio.convert(tmp_path / "m.msgpack", tmp_path / "b.netcl", to="netcl", layers=LAYERS3)
    assert (tmp_path / "b.netcl").read_bytes() == (tmp_path / "m.netcl").read_bytes()
    # without activations the usual Flax names, read back without a layer list
    ptio.save(tmp_path / "p", params, format="netcl-params")
    ptio.convert(tmp_path / "p", tmp_path / "p.msgpack", to="msgpack", from_="netcl-params")
    assert sorted(ptio.load(tmp_path / "p.msgpack")["params"]) == ["Dense_0", "Dense_1"]
    got = ptio.load(tmp_path / "p.msgpack", like={"params": params})
    assert got["params"]["Dense_1"]["kernel"].tobytes() == params["Dense_1"]["kernel"].tobytes()


def test_what_does_not_fit_is_named() -> None:
    params, _ = reference()
    conv = {
        "Conv_0": {"kernel": np.ones((3, 3, 1, 2), np.float32), "bias": np.zeros(2, np.float32)}
    }
    netcl = files(ptio.encode(conv, format="netcl"))
    with pytest.raises(ptio.ConversionError, match=r"layer 0 \(Conv2d\)"):
        ptio.convert_encoded(netcl, from_="netcl", to="datacode")
    with pytest.raises(ptio.ConversionError, match=r"layer 0 \(Conv2d\)"):
        ptio.convert_encoded(netcl, from_="netcl", to="bullet")
    bn = {
        "params": {
            "BatchNorm_0": {"scale": np.ones(2, np.float32), "bias": np.zeros(2, np.float32)}
        },
        "batch_stats": {
            "BatchNorm_0": {"mean": np.ones(2, np.float32), "var": np.ones(2, np.float32)}
        },
    }
    with pytest.raises(ptio.ConversionError, match="BatchNorm statistics"):
        ptio.convert_encoded(
            files(ptio.encode(bn, format="netcl")), from_="netcl", to="netcl-checkpoint"
        )
    # Tiny Llama is no layered model, whatever is dropped
    tl = source("tinyllama", False)
    for target in ("netcl", "datacode", "waffe2", "bullet", "netcl-checkpoint"):
        with pytest.raises(ptio.ConversionError, match=target):
            ptio.convert_encoded(tl, from_="tinyllama", to=target, lossy=True)
    # netcl-checkpoint's config is information only it has a place for
    ck = ptio.encode(params, format="netcl-checkpoint", meta={"config": {"epochs": 3}})
    with pytest.raises(ptio.ConversionError, match="netcl-checkpoint config"):
        ptio.convert_encoded(files(ck), from_="netcl-checkpoint", to="bullet")
    out = ptio.convert_encoded(files(ck), from_="netcl-checkpoint", to="safetensors")
    back = ptio.convert_encoded(out, from_="safetensors", to="netcl-checkpoint")
    assert json.loads(back.files["json"].tobytes())["config"] == {"epochs": 3}


def test_convert_encoded_takes_options_like_convert() -> None:
    data = source("netcl", False)
    with pytest.raises(TypeError, match="verfy"):
        ptio.convert_encoded(data, from_="netcl", to="safetensors", verfy=1)
    out = ptio.convert_encoded(data, from_="netcl", to="datacode", variant="later")
    assert ptio.decode(out, format="datacode", like=None)["layer2"]["weight"].shape == (3, 2)
    _, meta = ptio.list_formats()["datacode"].decode(out.tobytes())
    assert meta["_datacode_file"]["variant"] == "later"


def test_convert_encoded_takes_encodings_and_carried_files_load_into_flax_trees() -> None:
    params, _ = reference()
    enc = ptio.encode(params, format="datacode", layers=LAYERS3)
    # an Encoded as encode returns it (single file or files) goes in as it is
    st = ptio.convert_encoded(enc, from_="datacode", to="safetensors")
    wf = ptio.convert_encoded(st, from_="safetensors", to="waffe2")
    back = ptio.convert_encoded(wf, from_="waffe2", to="datacode")
    assert back.tobytes() == enc.tobytes()
    # the safetensors file carries DataCode's tree, and fills a Flax tree as DataCode would
    assert ptio.decode(st, format="safetensors", like=params)["Dense_1"]["bias"].tobytes() == (
        params["Dense_1"]["bias"].tobytes()
    )
    native = ptio.decode(st, format="safetensors")
    assert sorted(native) == ["layer0", "layer2"]  # DataCode's native tree, as it was
