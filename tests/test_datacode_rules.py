"""DataCode's optimizers as optax transformations, against float32 numpy versions of its rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pytreeio.core.errors import MismatchError
from pytreeio.core.serde_json import widen_f32
from pytreeio.formats.datacode import nn as dc
from pytreeio.formats.datacode import training as training
from pytreeio.model import optim
from pytreeio.model.rules import datacode as rules

f32 = np.float32
ONE = f32(1)
STEPS = 3
# One set of shapes everywhere: op-by-op runs compile each primitive once per shape.
SHAPES = {"w": (8, 4), "b": (4,)}


# --------------------------------------------------------------------------
# DataCode's rules in float32 numpy, one operation at a time (the table)
# --------------------------------------------------------------------------


def _sgd(p: np.ndarray, g: np.ndarray, s: dict, hp: dict, t: int) -> np.ndarray:
    return p - g * hp["lr"]


def _momentum(p: np.ndarray, g: np.ndarray, s: dict, hp: dict, t: int) -> np.ndarray:
    s["v"] = hp["beta"] * s.get("v", np.zeros_like(p)) + (ONE - hp["beta"]) * g
    return p - s["v"] * hp["lr"]


def _nag(p: np.ndarray, g: np.ndarray, s: dict, hp: dict, t: int) -> np.ndarray:
    s["v"] = hp["beta"] * s.get("v", np.zeros_like(p)) + hp["lr"] * g
    return p - s["v"]


def _adagrad(p: np.ndarray, g: np.ndarray, s: dict, hp: dict, t: int) -> np.ndarray:
    s["G"] = s.get("G", np.zeros_like(p)) + g * g
    return p - (hp["lr"] / np.sqrt(s["G"] + hp["epsilon"])) * g


def _rmsprop(p: np.ndarray, g: np.ndarray, s: dict, hp: dict, t: int) -> np.ndarray:
    s["E"] = hp["gamma"] * s.get("E", np.zeros_like(p)) + (ONE - hp["gamma"]) * (g * g)
    return p - (hp["lr"] / np.sqrt(s["E"] + hp["epsilon"])) * g


def _moments(p: np.ndarray, g: np.ndarray, s: dict, hp: dict, t: int) -> tuple[Any, Any]:
    b1, b2 = hp["beta1"], hp["beta2"]
    s["m"] = b1 * s.get("m", np.zeros_like(p)) + (ONE - b1) * g
    s["v"] = b2 * s.get("v", np.zeros_like(p)) + (ONE - b2) * (g * g)
    return s["m"] / (ONE - b1 ** f32(t)), s["v"] / (ONE - b2 ** f32(t))


def _adam(p: np.ndarray, g: np.ndarray, s: dict, hp: dict, t: int) -> np.ndarray:
    m_hat, v_hat = _moments(p, g, s, hp, t)
    return p - (hp["lr"] * m_hat) / (np.sqrt(v_hat) + hp["epsilon"])


def _adamw(p: np.ndarray, g: np.ndarray, s: dict, hp: dict, t: int) -> np.ndarray:
    m_hat, v_hat = _moments(p, g, s, hp, t)
    return p - hp["lr"] * (m_hat / (np.sqrt(v_hat) + hp["epsilon"]) + hp["weight_decay"] * p)


REFERENCE: dict[str, Callable[..., np.ndarray]] = {
    "SGD": _sgd,
    "Momentum": _momentum,
    "NAG": _nag,
    "Adagrad": _adagrad,
    "RMSprop": _rmsprop,
    "Adam": _adam,
    "AdamW": _adamw,
}
PARAMS = {
    "SGD": {"lr": 0.1},
    "Momentum": {"lr": 0.05, "beta": 0.8},
    "NAG": {"lr": 0.05, "beta": 0.9},
    "Adagrad": {"lr": 0.01},
    "RMSprop": {"lr": 0.001, "gamma": 0.99, "epsilon": 1e-7},
    "Adam": {"lr": 0.001},
    "AdamW": {"lr": 0.001, "weight_decay": 0.05},
}


def ulps(a: Any, b: np.ndarray) -> int:
    x = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    y = b.view(np.int32).astype(np.int64)
    x = np.where(x < 0, np.int64(-(2**31)) - x, x)  # a monotone integer line across zero
    y = np.where(y < 0, np.int64(-(2**31)) - y, y)
    return int(np.abs(x - y).max())


def _problem(seed: int) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(shape).astype(f32) for k, shape in SHAPES.items()}
    grads = [
        {k: (rng.standard_normal(v.shape) * 0.5).astype(f32) for k, v in params.items()}
        for _ in range(STEPS)
    ]
    return params, grads


def _run(opt: Any, params: dict, grads: list[dict], jit: bool) -> dict[str, np.ndarray]:
    def step(p: Any, s: Any, g: Any) -> Any:
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(step) if jit else step
    p = {k: jnp.asarray(v) for k, v in params.items()}
    s = opt.init(p)
    for g in grads:
        p, s = run(p, s, {k: jnp.asarray(v) for k, v in g.items()})
    return {k: np.asarray(v) for k, v in p.items()}


def _stage(otype: str, params: dict | None = None, loss: str = "mse") -> dict:
    return {
        "optimizer_type": otype,
        "optimizer_params": PARAMS[otype] if params is None else params,
        "loss": loss,
        "epochs": 1,
    }


@pytest.mark.parametrize("jit", [False, True], ids=["op-by-op", "jit"])
@pytest.mark.parametrize("otype", list(REFERENCE))
def test_rule_matches_datacode_bit_for_bit(otype: str, jit: bool) -> None:
    stage = _stage(otype)
    _, hp = rules.hyperparams(stage)
    params, grads = _problem(list(REFERENCE).index(otype))
    want = {}
    for k, p in params.items():
        state: dict = {}
        for t, g in enumerate(grads, 1):
            p = REFERENCE[otype](p, g[k], state, {n: f32(v) for n, v in hp.items()}, t)
        want[k] = p
    got = _run(rules.datacode_optimizer(stage), params, grads, jit)
    for k in params:
        assert got[k].dtype == np.float32
        assert ulps(got[k], want[k]) == 0, (otype, k, ulps(got[k], want[k]))


STOCK = {
    "SGD": lambda hp: optax.sgd(hp["lr"]),
    "Momentum": lambda hp: optax.chain(optax.ema(hp["beta"], debias=False), optax.scale(-hp["lr"])),
    "NAG": lambda hp: optax.chain(
        optax.scale(hp["lr"]), optax.trace(hp["beta"]), optax.scale(-1.0)
    ),
}


@pytest.mark.parametrize("otype", list(STOCK))
def test_table_rows_equal_their_stock_optax_chain_op_by_op(otype: str) -> None:
    _, hp = rules.hyperparams(_stage(otype))
    params, grads = _problem(3)
    ours = _run(rules.datacode_optimizer(_stage(otype)), params, grads, jit=False)
    stock = _run(STOCK[otype]({k: jnp.asarray(v) for k, v in hp.items()}), params, grads, jit=False)
    for k in params:
        assert ours[k].tobytes() == stock[k].tobytes()


def test_stock_adamw_differs_only_by_xla_division() -> None:
    _, hp = rules.hyperparams(_stage("AdamW"))
    h = {k: jnp.asarray(v) for k, v in hp.items()}
    stock = optax.adamw(
        h["lr"], h["beta1"], h["beta2"], h["epsilon"], weight_decay=h["weight_decay"]
    )
    params, grads = _problem(4)
    ours = _run(rules.datacode_optimizer(_stage("AdamW")), params, grads, jit=False)
    theirs = _run(stock, params, grads, jit=False)
    for k in params:
        assert ulps(ours[k], theirs[k]) <= 8


def test_betas_are_float32_arrays() -> None:
    opt = rules.datacode_optimizer(_stage("Adam"))
    state = opt.init({"w": jnp.zeros(3)})
    for name in ("lr", "beta1", "beta2", "epsilon"):
        value = state.hyperparams[name]
        assert value.dtype == jnp.float32 and value.shape == ()
    assert float(state.hyperparams["beta2"]) == float(f32(0.999))
    # 1 - beta in f32 is not the f64 difference rounded to f32:
    assert ONE - f32(0.999) != f32(1 - 0.999)


def test_defaults_fill_missing_parameters() -> None:
    for otype, spec in rules.OPTIMIZERS.items():
        _, hp = rules.hyperparams({"optimizer_type": otype, "optimizer_params": {"lr": 0.5}})
        for name, default in spec.items():
            assert hp[name] == f32(0.5 if default is None else default)
    _, hp = rules.hyperparams({"optimizer_type": "RMSprop", "optimizer_params": {"lr": 1}})
    assert hp["gamma"] == f32(0.9) and hp["epsilon"] == f32(1e-8)


@pytest.mark.parametrize("otype", list(rules.OPTIMIZERS))
def test_hyperparameters_survive_a_stage_record(otype: str) -> None:
    written = {
        name: widen_f32(0.003) if name == "lr" else value
        for name, value in {
            **{k: v for k, v in rules.OPTIMIZERS[otype].items() if v},
            "lr": 0,
        }.items()
    }
    if otype == "RMSprop":
        written["gamma"] = 0.99
    stage = {**_stage(otype, written), "loss": "cross_entropy"}
    params = {"Dense_0": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4)}}
    opt = rules.datacode_optimizer(stage)
    state = opt.init(params)
    _, state = opt.update(jax.tree.map(jnp.ones_like, params), state, params)
    record = training.stage_record(state, params, epochs=1, loss="cross_entropy")
    assert record["optimizer_type"] == otype
    assert record["optimizer_params"] == written
    assert record["trainable_params"] == 16 and record["frozen_params"] == 0
    again = rules.datacode_optimizer(record).init(params).hyperparams
    for name, value in state.hyperparams.items():
        assert float(again[name]) == float(value)


@pytest.mark.parametrize("loss", rules.LOSSES)
def test_every_seed_loss_name_is_accepted(loss: str) -> None:
    rules.datacode_optimizer(_stage("SGD", loss=loss))
    params = {"Dense_0": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros(2)}}
    state = rules.datacode_optimizer(_stage("SGD")).init(params)
    assert training.stage_record(state, params, epochs=0, loss=loss)["loss"] == loss


def test_refusals_name_what_is_wrong() -> None:
    with pytest.raises(MismatchError, match="'hinge'") as info:
        rules.datacode_optimizer(_stage("SGD", loss="hinge"))
    assert info.value.key_path == "stage.loss"
    with pytest.raises(MismatchError, match="'LBFGS'") as info:
        rules.datacode_optimizer({**_stage("SGD"), "optimizer_type": "LBFGS"})
    assert info.value.key_path == "stage.optimizer_type"
    with pytest.raises(MismatchError, match="momentum") as info:
        rules.datacode_optimizer(_stage("SGD", {"lr": 0.1, "momentum": 0.9}))
    with pytest.raises(MismatchError, match="needs 'lr'") as info:
        rules.datacode_optimizer(_stage("Adam", {}))
    assert info.value.key_path == "stage.optimizer_params.lr"
    with pytest.raises(MismatchError, match="number"):
        rules.datacode_optimizer(_stage("SGD", {"lr": "fast"}))
    with pytest.raises(MismatchError, match="no training stage"):
        rules.datacode_optimizer({"layers": [], "training": dc.empty_training()})
    with pytest.raises(MismatchError, match="only with"):
        rules.datacode_optimizer(_stage("Momentum"), variant="later")
    params = {"Dense_0": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros(2)}}
    state = rules.datacode_optimizer(_stage("SGD")).init(params)
    with pytest.raises(MismatchError, match="'hinge'"):
        training.stage_record(state, params, epochs=1, loss="hinge")


def test_a_document_uses_its_last_stage(conformance: Any) -> None:
    data = (conformance / "datacode/model_mnist.nn").read_bytes()
    native, meta = dc.decode(memoryview(data))
    opt = rules.datacode_optimizer(meta, variant="later")
    state = opt.init(native)
    assert float(state.hyperparams["lr"]) == float(f32(0.001))
    assert set(state.hyperparams) == {"lr", "beta1", "beta2", "epsilon"}
    seed = rules.datacode_optimizer(meta, stage=0)
    assert seed.init(native).inner_state.count == 0


# --------------------------------------------------------------------------
# the later release: per-tensor clip, non-finite skip
# --------------------------------------------------------------------------


def _clip_reference(g: np.ndarray) -> np.ndarray:
    total = f32(0)
    for v in g.reshape(-1):  # DataCode sums sequentially in f32
        total = f32(total + v * v)
    norm = np.sqrt(total)
    return g * (ONE / norm) if norm > 1 else g


@pytest.mark.parametrize("jit", [False, True], ids=["op-by-op", "jit"])
def test_later_release_clips_each_tensor(jit: bool) -> None:
    rng = np.random.default_rng(5)
    params = {k: rng.standard_normal(shape).astype(f32) for k, shape in SHAPES.items()}
    # "w" has norm about 17 and is clipped; "b" has norm 0.2 and is not.
    grads = [
        {"w": rng.standard_normal(SHAPES["w"]).astype(f32) * f32(3), "b": np.full(4, f32(0.1))}
    ]
    sgd = _run(rules.datacode_optimizer(_stage("SGD"), variant="later"), params, grads, jit)
    lr = f32(PARAMS["SGD"]["lr"])
    for k in params:
        want = params[k] + _clip_reference(grads[0][k]) * -lr
        assert ulps(sgd[k], want) <= 2, k
    _, hp = rules.hyperparams(_stage("Adam"))
    h = {k: f32(v) for k, v in hp.items()}
    adam = _run(rules.datacode_optimizer(_stage("Adam"), variant="later"), params, grads, jit)
    for k in params:
        g = _clip_reference(grads[0][k])
        m = (ONE - h["beta1"]) * g
        v = (ONE - h["beta2"]) * (g * g)
        m_hat, v_hat = m / (ONE - h["beta1"]), v / (ONE - h["beta2"])
        want = params[k] + (m_hat / (np.sqrt(v_hat) + h["epsilon"])) * -h["lr"]
        assert ulps(adam[k], want) <= 2, k


def test_later_release_skips_non_finite_tensors() -> None:
    params = {"a": jnp.ones(4), "b": jnp.full(4, -0.0)}
    opt = rules.datacode_optimizer(_stage("Adam"), variant="later")
    state = opt.init(params)
    bad = {"a": jnp.array([1.0, jnp.nan, 0.0, 0.0]), "b": jnp.ones(4)}
    updates, state = opt.update(bad, state, params)
    new = optax.apply_updates(params, updates)
    assert np.asarray(new["a"]).tobytes() == np.asarray(params["a"]).tobytes()
    assert not np.array_equal(np.asarray(new["b"]), np.asarray(params["b"]))
    assert int(state.inner_state.count) == 1
    assert not np.asarray(state.inner_state.mu["a"]).any()
    assert np.asarray(state.inner_state.mu["b"]).all()
    # A step whose result would not be finite is skipped as well.
    huge = {"a": jnp.full(4, 3e38), "b": jnp.ones(4)}
    sgd = rules.datacode_optimizer(_stage("SGD", {"lr": 3e38}), variant="later")
    updates, _ = sgd.update({"a": jnp.full(4, -0.5), "b": jnp.zeros(4)}, sgd.init(huge), huge)
    assert (
        np.asarray(optax.apply_updates(huge, updates)["a"]).tobytes()
        == np.asarray(huge["a"]).tobytes()
    )


# --------------------------------------------------------------------------
# pytreeio.model.optim's vocabulary and stage records
# --------------------------------------------------------------------------


def test_optim_state_maps_to_stock_kinds() -> None:
    kinds = {
        "SGD": "sgd",
        "Momentum": "momentum",
        "NAG": "momentum",
        "Adagrad": "adagrad",
        "RMSprop": "rmsprop",
        "Adam": "adam",
        "AdamW": "adamw",
    }
    for otype, kind in kinds.items():
        state = training.optim_state(_stage(otype))
        assert state.kind == kind and state.slots == {} and state.count is None
        assert state.hyperparams["learning_rate"] > 0
        opt = optim.build(state.kind, state.hyperparams)
        opt.init({"w": jnp.zeros(2)})
    momentum = training.optim_state(_stage("Momentum"))
    assert momentum.hyperparams["learning_rate"] == pytest.approx(0.05 * 0.2, rel=1e-6)


def test_stage_record_from_stock_optax_and_layers() -> None:
    params = {
        "layers_0": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4)},
        "layers_2": {"kernel": jnp.zeros((4, 2)), "bias": jnp.zeros(2)},
    }
    layers = [dc.TYPES[0], "ReLU", {"type": "Linear", "trainable": False}]
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=0.001, b1=0.9, b2=0.999)
    record = training.stage_record(
        adam.init(params),
        params,
        epochs=2,
        loss="categorical_cross_entropy",
        layers=layers,
        loss_history=np.array([0.5, 0.25], np.float32),
        accuracy_history=[0.1, 0.2],
        val_loss_history=None,
        variant="later",
    )
    assert record["optimizer_type"] == "Adam"
    assert record["optimizer_params"] == {
        "lr": widen_f32(0.001),
        "beta1": 0.9,
        "beta2": 0.999,
        "epsilon": 1e-8,
    }
    assert (record["trainable_params"], record["frozen_params"]) == (16, 10)
    assert record["frozen_layers"] == ["layer1"]  # the later variant's Linear-only name
    assert record["accuracy_history"] == [widen_f32(0.1), widen_f32(0.2)]
    assert record["lr_history"] is None
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    nag = training.stage_record(sgd.init(params), params, epochs=1, loss="mse", layers=layers)
    assert nag["optimizer_type"] == "NAG" and nag["optimizer_params"]["beta"] == 0.9
    assert "lr_history" not in nag
    with pytest.raises(MismatchError, match="inject_hyperparams"):
        training.stage_record(
            optax.adam(0.1).init(params), params, epochs=1, loss="mse", layers=layers
        )


def test_with_stage_writes_a_file_that_rewrites_exactly() -> None:
    params = {
        "layers_0": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)},
        "layers_2": {"kernel": jnp.ones((4, 2)), "bias": jnp.zeros(2)},
    }
    layers = ["Linear", "ReLU", "Linear"]
    native = {"layer0": {"weight": np.ones((3, 4), f32), "bias": np.zeros(4, f32)}}
    native["layer2"] = {"weight": np.ones((4, 2), f32), "bias": np.zeros(2, f32)}
    meta: dict = {"layers": layers}
    for i, otype in enumerate(rules.OPTIMIZERS):
        opt = rules.datacode_optimizer(_stage(otype))
        state = opt.init(params)
        record = training.stage_record(
            state, params, epochs=i, loss=rules.LOSSES[i % 5], layers=layers, loss_history=[0.1] * i
        )
        meta = training.with_stage(meta, record)
    assert len(meta["training"]["stages"]) == len(rules.OPTIMIZERS)
    assert meta["training"]["optimizer"] == "AdamW" and meta["training"]["epochs"] == 6
    data = dc.encode(native, meta=meta).tobytes()
    tree, back = dc.decode(memoryview(data))
    assert dc.encode(tree, meta=back).tobytes() == data
    for _ in range(rules.MAX_STAGES):
        meta = training.with_stage(meta, record)
    assert len(meta["training"]["stages"]) == rules.MAX_STAGES
