"""The common model form: Flax trees <-> Model, layer lists, model-shaped trees with optimizer state."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from pytreeio.core.errors import MismatchError
from pytreeio.model import form as M

RNG = np.random.default_rng(0)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(8)(x))
        return nn.Dense(3)(x)


def seq_mlp() -> nn.Sequential:
    return nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(4, (3, 3), padding=1)(x)
        x = nn.BatchNorm(use_running_average=True)(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(5)(x)


CNN_LAYERS = [{"type": "Conv2d", "args": {"pad": 1}}, "BatchNorm2d", "ReLU", "Flatten", "Linear"]


def _np(tree):  # type: ignore[no-untyped-def]
    return jax.tree.map(np.asarray, tree)


def test_dense_n_tree_maps_in_order_and_back() -> None:
    params = _np(MLP().init(jax.random.PRNGKey(0), jnp.ones((1, 4)))["params"])
    model = M.Model.from_flax(params)
    assert [la.type for la in model.layers] == ["Linear", "Linear"]
    assert model.layers[0].args == {"in_features": 4, "out_features": 8, "bias": True}
    assert [(i, k) for i, k, _ in model.params] == [
        (0, "kernel"),
        (0, "bias"),
        (1, "kernel"),
        (1, "bias"),
    ]
    with_relu = M.Model.from_flax(params, layers=["Linear", "ReLU", "Linear"])
    assert [la.type for la in with_relu.layers] == ["Linear", "ReLU", "Linear"]
    back = with_relu.to_flax(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert with_relu.param_paths(params) == [
        ("Dense_0", "kernel"), ("Dense_0", "bias"), ("Dense_1", "kernel"), ("Dense_1", "bias")
    ]  # fmt: skip


def test_sequential_layers_n_positions_count_activations() -> None:
    inner = _np(seq_mlp().init(jax.random.PRNGKey(0), jnp.ones((1, 4)))["params"])
    assert set(inner) == {"layers_0", "layers_2"}
    with pytest.raises(MismatchError, match="layer 1 has no parameters"):
        M.Model.from_flax(inner)
    model = M.Model.from_flax(inner, layers=["Linear", "ReLU", "Linear"])
    assert [la.type for la in model.layers] == ["Linear", "ReLU", "Linear"]
    assert set(model.to_flax(inner)) == {"layers_0", "layers_2"}


def test_cnn_with_batch_stats_and_layer_list() -> None:
    variables = _np(dict(CNN().init(jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 3)))))
    with pytest.raises(MismatchError, match="layer order"):
        M.Model.from_flax(variables)
    model = M.Model.from_flax(variables, layers=CNN_LAYERS)
    conv, bn = model.layers[0], model.layers[1]
    assert (
        conv.args["in_channels"] == 3 and conv.args["out_channels"] == 4 and conv.args["pad"] == 1
    )
    assert set(bn.arrays) == {"scale", "bias", "mean", "var"}
    # statistics are not parameters
    assert [(i, k) for i, k, _ in model.params] == [(0, "kernel"), (0, "bias"), (1, "scale"), (1, "bias"), (4, "kernel"), (4, "bias")]  # fmt: skip
    back = model.to_flax(variables)
    assert set(back) == {"params", "batch_stats"}
    with pytest.raises(MismatchError, match="batch_stats"):
        model.to_flax(variables["params"])  # the statistics would be lost


def test_layer_entries_in_every_spelling_and_their_errors() -> None:
    arrays = [{"kernel": f32(4, 8), "bias": f32(8)}, {}, {"kernel": f32(8, 3)}]
    entries = [
        {"type": "Linear", "args": {"in_features": 4}},
        "ReLU",
        {
            "name": "layer2",
            "type": "Linear",
            "in_features": 8,
            "out_features": 3,
            "bias": False,
            "trainable": False,
        },
    ]
    layers = M.normalize_layers(entries, arrays)
    assert layers[2].args == {"in_features": 8, "out_features": 3, "bias": False}
    assert layers[2].trainable is False
    bad = [
        ([{"type": "Lineer"}, "ReLU", "Linear"], "unknown layer type"),
        ([["Linear"], "ReLU", "Linear"], "type name or a dict"),
        ([{"type": "Linear", "args": {"in_features": 5}}, "ReLU", "Linear"], "shape"),
        ([{"type": "Linear", "args": {"wat": 1}}, "ReLU", "Linear"], "unknown args"),
        (["Linear", "ReLU"], "2 entries but the tree has 3"),
        (["Linear", "ReLU", {"type": "Linear", "args": {"bias": True, "in_features": 8, "out_features": 3}}], None),
    ]  # fmt: skip
    for entry_list, msg in bad:
        if msg is None:
            M.normalize_layers(
                entry_list, arrays
            )  # bias=True without a bias array: allowed (absent)
            continue
        with pytest.raises(MismatchError, match=msg):
            M.normalize_layers(entry_list, arrays)


def test_to_flax_checks_every_leaf_and_never_touches_like() -> None:
    params = _np(MLP().init(jax.random.PRNGKey(0), jnp.ones((1, 4)))["params"])
    model = M.Model.from_flax(params)
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    before = jax.tree.structure(like)
    out = model.to_flax(like)
    assert jax.tree.structure(like) == before
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(out))
    wrong = {
        **like,
        "Dense_1": {
            "kernel": jax.ShapeDtypeStruct((8, 4), np.float32),
            "bias": like["Dense_1"]["bias"],
        },
    }
    with pytest.raises(MismatchError, match="Dense_1/kernel"):
        model.to_flax(wrong)
    extra = {**like, "Dense_2": like["Dense_1"]}
    with pytest.raises(MismatchError):
        model.to_flax(extra)


def _trained(opt: optax.GradientTransformation):  # type: ignore[no-untyped-def]
    params = MLP().init(jax.random.PRNGKey(0), jnp.ones((1, 4)))["params"]
    state = opt.init(params)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.25), params)
    for _ in range(3):
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_model_shaped_trees_carry_the_optimizer_state_through_the_common_form() -> None:
    opt = optax.adamw(1e-2)
    params, state = _trained(opt)
    model = M.model_of({"params": params, "opt_state": state, "step": 3})
    assert model.opt_state is not None and model.opt_state.kind == "adamw"
    assert model.opt_state.count == 3 and model.step == 3
    np.testing.assert_array_equal(
        model.opt_state.slots["mu"][0], np.asarray(state[0].mu["Dense_0"]["kernel"])
    )
    like = jax.eval_shape(lambda: {"params": params, "opt_state": state, "step": 0})
    back = M.restore_model(model, like)
    for a, b in zip(jax.tree.leaves(back["opt_state"]), jax.tree.leaves(state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert back["step"] == 3
    # netcl's spelling of the state's key
    alt = M.restore_model(model, {"params": params, "optim_state": state})
    assert set(alt) == {"params", "optim_state"}
    with pytest.raises(MismatchError, match="no optimizer state"):
        M.restore_model(model.replace(opt_state=None), {"params": params, "opt_state": state})


def test_train_state_saves_and_restores_directly() -> None:
    opt = optax.adam(1e-2)
    params, state = _trained(opt)
    ts = train_state.TrainState(
        step=3, apply_fn=MLP().apply, params=params, tx=opt, opt_state=state
    )
    model = M.model_of(ts)
    assert model.step == 3
    fresh = train_state.TrainState.create(
        apply_fn=MLP().apply, params=jax.tree.map(jnp.zeros_like, params), tx=opt
    )
    back = M.restore_model(model, fresh)
    assert isinstance(back, train_state.TrainState) and back.step == 3
    for a, b in zip(
        jax.tree.leaves((back.params, back.opt_state)), jax.tree.leaves((params, state))
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_non_model_trees_are_recognised_as_such() -> None:
    assert not M.is_model_like({"w": f32(2)})
    assert not M.is_model_like([{"weight": f32(2, 2)}])
    assert not M.is_model_like({"params": {"p0": f32(2)}, "optim_state": {}})
    assert M.is_model_like({"Dense_0": {"kernel": f32(2, 2)}})
    assert M.is_model_like({"params": {"Dense_0": {"kernel": f32(2, 2)}}, "opt_state": ()})
    assert not M.is_model_like({"params": {"Dense_0": {"kernel": f32(2, 2)}}, "other": 1})


def test_alike_layers_are_settled_once_but_equal_looking_args_are_not_shared() -> None:
    """Layers of one type, args and shapes share their checked args; values that compare equal
    but differ (True and 1, -0.0 and 0.0) are each checked and kept as given."""
    k = np.zeros((2, 3), np.float32)
    b = np.zeros(3, np.float32)
    layers = M.normalize_layers(
        [{"type": "Linear"}, {"type": "Linear"}, {"type": "Dropout", "args": {"p": 0.0}},
         {"type": "Dropout", "args": {"p": -0.0}}],
        [{"kernel": k, "bias": b}, {"kernel": k, "bias": b}, {}, {}],
    )  # fmt: skip
    assert layers[0].args == layers[1].args == {"in_features": 2, "out_features": 3, "bias": True}
    assert layers[0].args is not layers[1].args  # each layer owns its args
    assert (
        math.copysign(1, layers[2].args["p"]) == 1 and math.copysign(1, layers[3].args["p"]) == -1
    )
    with pytest.raises(MismatchError, match="bias must be true or false"):
        M.normalize_layers(
            [{"type": "Linear", "args": {"bias": True}}, {"type": "Linear", "args": {"bias": 1}}],
            [{"kernel": k, "bias": b}, {"kernel": k, "bias": b}],
        )
    with pytest.raises(MismatchError, match="layer 2"):
        M.normalize_layers(
            ["Linear", "Linear", "Linear"],
            [{"kernel": k, "bias": b}, {"kernel": k, "bias": b}, {"kernel": k, "bias": b[:2]}],
        )


def _linear(n: int = 3, bias: object = True) -> tuple[list, list]:
    entries = [{"type": "Linear", "args": {"bias": bias}}, "ReLU"] * n
    arrays = [
        {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)}
        if i % 2 == 0
        else {}
        for i in range(2 * n)
    ]
    return entries, arrays


def test_normalize_layers_checks_every_call() -> None:
    entries, arrays = _linear()
    first = M.normalize_layers(entries, arrays)
    _, other = _linear()
    again = M.normalize_layers(entries, other)
    assert [(la.type, dict(la.args), la.trainable) for la in again] == [
        (la.type, dict(la.args), la.trainable) for la in first
    ]
    assert all(
        a is b for la, arrs in zip(again, other) for a, b in zip(la.arrays.values(), arrs.values())
    )
    again[0].args["in_features"] = 99  # a caller's change reaches no later model
    assert M.normalize_layers(entries, arrays)[0].args["in_features"] == 2
    with pytest.raises(MismatchError, match="bias must be true or false"):
        M.normalize_layers(_linear(bias=1)[0], arrays)  # 1 == True, but not a bool

    class Entry(dict):  # a dict subclass reads as the dict it is
        pass

    subclassed = [Entry(e) if isinstance(e, dict) else e for e in entries]
    assert M.normalize_layers(subclassed, arrays) == M.normalize_layers(entries, arrays)
    _, wrong = _linear()
    wrong[2]["bias"] = np.zeros(4, np.float32)
    with pytest.raises(MismatchError, match="layer 2"):
        M.normalize_layers(entries, wrong)


def test_flax_module_names_are_whole_names() -> None:
    from pytreeio.model import form as model_mod

    kernel = np.zeros((2, 2), np.float32)
    assert model_mod.is_flax_tree({"Dense_0": {"kernel": kernel}})
    for name in ("Dense_0\n", "Dense_0 ", "xDense_0", "Dense_01"):
        assert not model_mod.is_flax_tree({name: {"kernel": kernel}}), repr(name)
