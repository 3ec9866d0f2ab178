"""Flax NNX states and typed PRNG keys in msgpack and safetensors (pytreeio.core.nnx, pytreeio.core.keys)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pytreeio as ptio
from pytreeio.core import keys, tree
from pytreeio.core.errors import EncodeError, FormatError, MismatchError

GENERIC = ("msgpack", "safetensors")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def key_bits(x: Any) -> tuple[str, str, tuple[int, ...], bytes]:
    """A typed key's (dtype, implementation, shape, key data bytes)."""
    assert keys.is_key(x), type(x)
    return (
        str(x.dtype),
        keys.impl_name(x),
        tuple(x.shape),
        np.asarray(jax.random.key_data(x)).tobytes(),
    )


def leaf_bits(x: Any) -> Any:
    if keys.is_key(x):
        return key_bits(x)
    a = np.asarray(x)
    return a.dtype.name, a.shape, a.tobytes()


def assert_tree_bits(a: Any, b: Any) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"{ta} != {tb}"
    assert [leaf_bits(x) for x in la] == [leaf_bits(y) for y in lb]


# --------------------------------------------------------------------------
# typed PRNG keys
# --------------------------------------------------------------------------


class Pair(NamedTuple):
    key: Any
    n: Any


def key_tree() -> dict[str, Any]:
    k = jax.random.key(42)
    return {
        "rng": k,
        "many": jax.random.split(k, 3),
        "grid": jax.random.split(jax.random.key(7), (2, 3)),
        "rbg": jax.random.key(1, impl="rbg"),
        "seq": [jax.random.key(3), (jax.random.key(4, impl="unsafe_rbg"),)],
        "pair": Pair(jax.random.key(5), np.int32(2)),
        "old": jax.random.PRNGKey(9),  # an old-style uint32[2] key: a plain array
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
    }


@pytest.mark.parametrize("fmt", GENERIC)
def test_keys_round_trip_as_keys_with_and_without_like(fmt: str, tmp_path: Path) -> None:
    t = key_tree()
    path = tmp_path / f"k.{fmt}"
    ptio.save(path, t)
    native = ptio.load(path)
    for name in ("rng", "many", "grid", "rbg"):
        assert key_bits(native[name]) == key_bits(t[name])
    assert key_bits(
        native["seq"]["1" if fmt == "msgpack" else 1]["0" if fmt == "msgpack" else 0]
    ) == (key_bits(t["seq"][1][0]))
    old = native["old"]
    assert not keys.is_key(old) and np.asarray(old).dtype == np.uint32
    # like: the real tree, and its jax.eval_shape (ShapeDtypeStruct keys)
    for like in (t, jax.eval_shape(lambda: t)):
        back = ptio.load(path, like=like)
        assert_tree_bits(back, t)
        assert isinstance(back["pair"], Pair)
    # like: a single key, and a key's ShapeDtypeStruct, at the root
    one = tmp_path / f"one.{fmt}"
    ptio.save(one, t["many"])
    for like in (t["many"], jax.ShapeDtypeStruct((3,), t["many"].dtype)):
        assert key_bits(ptio.load(one, like=like)) == key_bits(t["many"])
    # restored keys work as keys
    assert np.array_equal(
        jax.random.uniform(ptio.load(one)[1], (2,)), jax.random.uniform(t["many"][1], (2,))
    )


@pytest.mark.parametrize("fmt", GENERIC)
def test_key_mismatches_name_the_key_path(fmt: str) -> None:
    k = jax.random.key(0)
    enc = ptio.encode({"k": k, "old": jax.random.PRNGKey(0)}, format=fmt)
    bad_likes = {
        "k": (
            {
                "k": np.zeros(2, np.uint32),
                "old": jax.random.PRNGKey(0),
            },  # key data is no uint32 array
            {"k": jax.random.split(k, 2), "old": jax.random.PRNGKey(0)},  # shape
            {"k": jax.random.key(0, impl="rbg"), "old": jax.random.PRNGKey(0)},  # implementation
        ),
        "old": ({"k": k, "old": k},),  # a plain uint32[2] is not turned into a key
    }
    for where, likes in bad_likes.items():
        for like in likes:
            with pytest.raises(MismatchError) as e:
                ptio.decode(enc, format=fmt, like=like)
            assert e.value.key_path == where


def test_msgpack_key_convention_and_flax_compatibility() -> None:
    k = jax.random.key(3)
    data = ptio.encode({"a": np.ones(2, np.float32), "k": k}, format="msgpack").tobytes()
    # flax reads the key as the documented map (it has no convention of its own)
    raw = flax.serialization.msgpack_restore(data)
    assert set(raw["k"]) == {"__msgpack_prng_key__", "impl", "data"}
    assert raw["k"]["__msgpack_prng_key__"] is True and raw["k"]["impl"] == "threefry2x32"
    np.testing.assert_array_equal(raw["k"]["data"], np.asarray(jax.random.key_data(k)))
    # inspect lists the key as one entry
    info = ptio.inspect_encoded(data, format="msgpack")
    by_key = {e.name: e for e in info.entries}
    assert by_key["k"].dtype == "key<threefry2x32>" and tuple(by_key["k"].shape) == ()
    # trees without keys stay exactly what flax writes
    plain = {"a": np.ones(2, np.float32), "b": {"c": np.arange(3)}}
    assert ptio.encode(plain, format="msgpack").tobytes() == flax.serialization.to_bytes(plain)


def test_safetensors_key_is_a_u32_tensor_with_its_implementation_recorded() -> None:
    import json

    k = jax.random.split(jax.random.key(3), 4)
    data = ptio.encode({"k": k}, format="safetensors").tobytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    assert header["k"]["dtype"] == "U32" and header["k"]["shape"] == [4, 2]
    structure = json.loads(header["__metadata__"]["pytreeio.tree"])
    assert structure == {"dict": [["k", {"leaf": "k", "key": "threefry2x32"}]]}
    # other readers see the key data
    from safetensors.numpy import load

    np.testing.assert_array_equal(load(data)["k"], np.asarray(jax.random.key_data(k)))


def _msgpack_with(marker: dict[str, Any]) -> bytes:
    import msgpack

    def ext(a: np.ndarray) -> Any:
        return msgpack.ExtType(
            1, msgpack.packb((a.shape, a.dtype.name, a.tobytes()), use_bin_type=True)
        )

    body = {k: ext(v) if isinstance(v, np.ndarray) else v for k, v in marker.items()}
    return msgpack.packb({"k": body}, use_bin_type=True)


GOOD = {"__msgpack_prng_key__": True, "impl": "threefry2x32", "data": np.zeros(2, np.uint32)}


@pytest.mark.parametrize(
    ("marker", "in_header"),
    [
        ({**GOOD, "impl": "no-such-prng"}, False),  # only decoding asks jax about the name
        ({**GOOD, "data": np.zeros(3, np.uint32)}, False),  # threefry needs (..., 2)
        ({**GOOD, "impl": 3}, True),
        ({**GOOD, "data": np.zeros(2, np.int32)}, True),
        ({**GOOD, "data": np.zeros((), np.uint32)}, True),
        ({**GOOD, "extra": 1}, True),
        ({**GOOD, "__msgpack_prng_key__": 1}, True),
        ({"__msgpack_prng_key__": True, "impl": "threefry2x32"}, True),
    ],
)
def test_malformed_msgpack_keys_are_format_errors(marker: dict[str, Any], in_header: bool) -> None:
    data = _msgpack_with(marker)
    with pytest.raises(FormatError) as e:
        ptio.decode(data, format="msgpack")
    assert e.value.field == "k"
    if in_header:
        with pytest.raises(FormatError):
            ptio.inspect_encoded(data, format="msgpack")
    else:
        (entry,) = ptio.inspect_encoded(data, format="msgpack").entries
        assert entry.dtype.startswith("key<")


@pytest.mark.parametrize(
    ("node", "tensor"),
    [
        ({"leaf": "k", "key": "no-such-prng"}, np.zeros(2, np.uint32)),
        ({"leaf": "k", "key": None}, np.zeros(2, np.uint32)),
        ({"leaf": "k", "key": "threefry2x32"}, np.zeros(3, np.uint32)),
        ({"leaf": "k", "key": "threefry2x32"}, np.zeros(2, np.int32)),
        ({"leaf": "k", "key": "threefry2x32", "kind": "int"}, np.zeros(2, np.uint32)),
    ],
)
def test_malformed_safetensors_keys_are_format_errors(
    node: dict[str, Any], tensor: np.ndarray
) -> None:
    import json

    from safetensors.numpy import save

    meta = {
        "format": "pytreeio",
        "pytreeio.version": "1",
        "pytreeio.tree": json.dumps({"dict": [["k", node]]}),
    }
    data = save({"k": tensor}, metadata=meta)
    with pytest.raises(FormatError):
        ptio.decode(data, format="safetensors")


NOT_KEYS = sorted(set(ptio.list_formats()) - keys.HOLDS_KEYS)


@pytest.mark.parametrize("fmt", NOT_KEYS)
def test_refuse_names_the_key_path_for_formats_without_keys(fmt: str) -> None:
    k = jax.random.key(0)
    state = nnx.State({"w": nnx.Param(jnp.ones(2)), "rngs": {"key": nnx.RngKey(k)}})
    for t, where in (
        ({"params": {"Dense_0": {"kernel": jnp.ones((2, 2))}}, "rng": k}, "rng"),
        ([np.ones(2), {"a": (k,)}], "[1]/a/[0]"),
        (state, "rngs/key"),
        (k, "<root>"),
    ):
        with pytest.raises(EncodeError) as e:
            tree.refuse_keys(t, fmt)
        assert e.value.key_path == where
        assert "PRNG key" in str(e.value)
    for fmt_ok in keys.HOLDS_KEYS:
        tree.refuse_keys({"k": k}, fmt_ok)  # nothing to refuse
    tree.refuse_keys({"old": jax.random.PRNGKey(0)}, fmt)  # old-style keys are arrays


def test_refuse_looks_into_a_model() -> None:
    from pytreeio.model.form import model_of

    k = jax.random.key(0)
    model = model_of(
        {"Dense_0": {"kernel": jax.random.split(k, 6).reshape(2, 3), "bias": jnp.ones(3)}}
    )
    with pytest.raises(EncodeError) as e:
        tree.refuse_keys(model, "netcl")
    assert e.value.key_path == "layers[0].kernel"


@pytest.mark.parametrize("fmt", NOT_KEYS)
def test_formats_without_keys_refuse_a_key_leaf_with_an_encode_error(
    fmt: str, tmp_path: Path
) -> None:
    """Saving a key into a format that cannot hold keys fails before writing, naming the key
    (the API calls ``tree.refuse_keys`` before any format sees the tree)."""
    k = jax.random.key(0)
    params = {"Dense_0": {"kernel": jax.random.split(k, 12).reshape(3, 4), "bias": jnp.zeros(4)}}
    for t, where in (
        (params, ("Dense_0/kernel", "layers[0].kernel")),  # a model-shaped tree
        ({"weights": {"l0w": k}}, ("weights/l0w",)),  # a native-looking tree
    ):
        with pytest.raises(EncodeError, match="PRNG key") as e:
            ptio.save(tmp_path / "x", t, format=fmt)
        assert e.value.key_path in where
        assert not any(tmp_path.iterdir())


def test_describe_leaf_and_flatten_handle_keys() -> None:
    k = jax.random.split(jax.random.key(0), 2)
    assert tree.describe_leaf(k) == "key<fry>[2]"
    assert tree.describe_leaf(jax.ShapeDtypeStruct((), k.dtype)) == "key<fry>[]"
    flat = ptio.flatten({"a": k})
    assert list(flat) == ["a"] and flat["a"] is k


# --------------------------------------------------------------------------
# Flax NNX
# --------------------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(3, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.drop(self.bn(nnx.relu(self.l1(x))))
        for b in self.blocks:
            h = b(h)
        return h


@nnx.jit  # one compilation for every initialiser (eagerly, each compiles on first use)
def make_net() -> Net:
    return Net(nnx.Rngs(params=0, dropout=1))


X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)


@nnx.jit
def apply(m: Net, x: jax.Array) -> jax.Array:
    """``m(x)`` compiled once per mode (eager NNX compiles every small op on first use)."""
    return m(x)


def trained_net() -> Net:
    """A Net whose params, batch statistics and dropout counter moved away from their init."""
    net = make_net()
    net.l1.kernel[...] = net.l1.kernel[...] * 1.5
    net.train()
    apply(net, X)  # updates BatchNorm statistics and the dropout RNG counter
    return net


@pytest.mark.parametrize("fmt", GENERIC)
def test_nnx_state_round_trips_into_abstract_states(fmt: str, tmp_path: Path) -> None:
    net = trained_net()
    state = nnx.state(net)
    saved = [leaf_bits(x) for x in jax.tree.leaves(state)]
    path = tmp_path / f"net.{fmt}"
    ptio.save(path, state)
    # like: nnx.eval_shape's abstract model state, and jax.eval_shape of the state
    for like in (
        nnx.state(nnx.eval_shape(make_net)),
        jax.eval_shape(lambda: nnx.state(make_net())),
    ):
        back = ptio.load(path, like=like)
        assert isinstance(back, nnx.State)
        assert type(back["l1"]["kernel"]) is nnx.Param
        assert type(back["bn"]["mean"]) is nnx.BatchStat
        assert type(back["drop"]["rngs"]["key"]) is nnx.RngKey
        assert jax.tree.structure(back) == jax.tree.structure(state)
        assert [leaf_bits(x) for x in jax.tree.leaves(back)] == saved
        # nnx.update into an abstract model and nnx.merge give identical outputs
        original = nnx.clone(net)
        abstract = nnx.eval_shape(make_net)
        nnx.update(abstract, back)
        merged = nnx.merge(nnx.graphdef(net), back)
        for m in (original, abstract, merged):
            m.eval()
        np.testing.assert_array_equal(apply(abstract, X), apply(original, X))
        np.testing.assert_array_equal(apply(merged, X), apply(original, X))
        for m in (original, abstract):  # dropout draws from the restored key and counter
            m.train()
        np.testing.assert_array_equal(apply(abstract, X), apply(original, X))


@pytest.mark.parametrize("fmt", GENERIC)
def test_nnx_state_is_stored_as_its_pure_dict(fmt: str) -> None:
    net = make_net()
    state = nnx.state(net, nnx.Param)
    pure = nnx.to_pure_dict(state)
    assert ptio.flatten(state).keys() == ptio.flatten(pure).keys()
    enc = ptio.encode(state, format=fmt)
    assert enc.tobytes() == ptio.encode(pure, format=fmt).tobytes()
    if fmt == "msgpack":  # exactly what flax writes for the pure dict
        assert enc.tobytes() == flax.serialization.to_bytes(pure)
    native = ptio.decode(enc, format=fmt)
    abstract = nnx.state(nnx.eval_shape(make_net), nnx.Param)
    nnx.replace_by_pure_dict(abstract, native)
    assert_tree_bits(abstract, state)


@pytest.mark.parametrize("fmt", GENERIC)
def test_nnx_split_states_and_merge(fmt: str) -> None:
    net = trained_net()
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)
    enc = ptio.encode({"params": params, "rest": rest}, format=fmt)
    _, a_params, a_rest = nnx.split(nnx.eval_shape(make_net), nnx.Param, ...)
    back = ptio.decode(enc, format=fmt, like={"params": a_params, "rest": a_rest})
    merged = nnx.merge(graphdef, back["params"], back["rest"])
    net.eval()
    merged.eval()
    np.testing.assert_array_equal(apply(merged, X), apply(net, X))
    # a single split state on its own
    only = ptio.decode(ptio.encode(params, format=fmt), format=fmt, like=a_params)
    assert_tree_bits(only, params)


def _opt_step(tx: Any) -> Any:
    @nnx.jit
    def step(model: Net, optimizer: nnx.Optimizer) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(X) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return step


def test_nnx_optimizer_state_resumes_exactly(tmp_path: Path) -> None:
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))

    def build() -> tuple[Net, nnx.Optimizer]:
        m = make_net()
        return m, nnx.Optimizer(m, tx, wrt=nnx.Param)

    step = _opt_step(tx)
    model, opt = build()
    for _ in range(2):
        step(model, opt)
    reference = nnx.clone((model, opt))
    for _ in range(2):
        step(*reference)
    for fmt in GENERIC:
        path = tmp_path / f"opt.{fmt}"
        ptio.save(path, {"model": nnx.state(model), "opt": nnx.state(opt)})
        a_model, a_opt = nnx.eval_shape(build)
        back = ptio.load(path, like={"model": nnx.state(a_model), "opt": nnx.state(a_opt)})
        assert type(back["opt"]["step"]) is nnx.OptState
        nnx.update(a_model, back["model"])
        nnx.update(a_opt, back["opt"])
        for _ in range(2):
            step(a_model, a_opt)
        assert_tree_bits(nnx.state((a_model, a_opt)), nnx.state(reference))


def test_nnx_mismatches_name_the_path() -> None:
    net = make_net()
    enc = ptio.encode(nnx.state(net, nnx.Param), format="safetensors")
    like = nnx.state(nnx.eval_shape(make_net))  # also wants batch stats and RNG state
    with pytest.raises(MismatchError) as e:
        ptio.decode(enc, format="safetensors", like=like)
    assert e.value.key_path.startswith(("bn/mean", "bn/var", "drop/"))
    small = nnx.state(nnx.eval_shape(lambda: nnx.Linear(3, 4, rngs=nnx.Rngs(0))))
    enc = ptio.encode(nnx.state(nnx.Linear(3, 5, rngs=nnx.Rngs(0))), format="msgpack")
    with pytest.raises(MismatchError) as e:
        ptio.decode(enc, format="msgpack", like=small)
    assert e.value.key_path in ("bias", "kernel")


def test_nnx_value_level_spelling_is_accepted() -> None:
    """Files that name each Variable's value ``.../value`` (jax key paths) load too."""
    lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    state = nnx.state(lin)
    spelled = {k: {"value": np.asarray(v[...])} for k, v in state.items()}
    back = ptio.decode(ptio.encode(spelled, format="safetensors"), format="safetensors", like=state)
    assert_tree_bits(back, state)


def test_nnx_variables_are_transparent_in_key_paths() -> None:
    state = nnx.state(make_net())
    flat = ptio.flatten(state)
    assert "l1/kernel" in flat and "blocks/#1/bias" in flat and "drop/rngs/key" in flat
    assert not any(k.endswith("/value") for k in flat)
    assert keys.is_key(flat["drop/rngs/key"])
    rebuilt = ptio.unflatten(flat, like=state)
    assert isinstance(rebuilt, nnx.State) and type(rebuilt["l1"]["bias"]) is nnx.Param


def test_resume_nnx_example_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "resume_nnx.py"), "--dir", str(tmp_path), "--steps", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "bit-exact resume: True" in done.stdout
