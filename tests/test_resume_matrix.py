"""Exact resume: N steps, save, load into ``jax.eval_shape`` of the state, M steps == N+M steps.

One small Flax Linen MLP and one jit-compiled step per optimizer; every
format that can hold an optimizer state is checked with the optimizers it can
hold:

================= ================================================= ==================
format            optimizers                                        result
================= ================================================= ==================
msgpack           adam, adamw, sgd, sgd+momentum, nesterov,         bit-exact
safetensors       adagrad, rmsprop (+momentum, centered),
                  clip_by_global_norm chain, schedules,
                  inject_hyperparams with schedules; TrainState
netcl-checkpoint  adamw, sgd+momentum (+ TrainState)                bit-exact
waffe2            adam, sgd (inject_hyperparams), waffe2_adam       bit-exact
                  (+ TrainState); saved with ``optimizers=True``
bullet            adamw, bullet_adamw (+ TrainState)                bit-exact
datacode          hyperparameters only                              rebuilt optimizer
                                                                    equal, state fresh
================= ================================================= ==================

The example ``resume_linen.py`` runs here too (``resume_nnx.py`` in test_nnx_keys.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import pytreeio as ptio
from pytreeio.core.errors import MismatchError
from pytreeio.formats.datacode import training as dc_training
from pytreeio.formats.datacode.nn import empty_training
from pytreeio.model import optim
from pytreeio.model.rules import datacode as dc_rules
from pytreeio.model.rules.bullet import bullet_adamw
from pytreeio.model.rules.waffe2 import waffe2_adam

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
N, M = 3, 2


class MLP(nn.Module):
    """Dense_0 (4 -> 8), ReLU, Dense_1 (8 -> 3): modules named in network order."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.relu(nn.Dense(8)(x))
        return nn.Dense(3)(h)


MODEL = MLP()
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(16, 4)), jnp.float32)
Y = jnp.asarray(np.sin(_rng.normal(size=(16, 3))), jnp.float32)
PARAMS = jax.tree.map(
    jnp.asarray,
    {
        "Dense_0": {
            "kernel": _rng.normal(0, 0.5, (4, 8)).astype(np.float32),
            "bias": _rng.normal(0, 0.1, 8).astype(np.float32),
        },
        "Dense_1": {
            "kernel": _rng.normal(0, 0.5, (8, 3)).astype(np.float32),
            "bias": _rng.normal(0, 0.1, 3).astype(np.float32),
        },
    },
)


def _loss(params: Any) -> jax.Array:
    return jnp.mean((MODEL.apply({"params": params}, X) - Y) ** 2)


def trainer(tx: optax.GradientTransformation) -> Any:
    """``train(state, n)`` on ``{'params', 'opt_state', 'step'}``; one compiled step."""

    @jax.jit
    def step(state: dict[str, Any]) -> dict[str, Any]:
        grads = jax.grad(_loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }

    def train(state: dict[str, Any], n: int) -> dict[str, Any]:
        for _ in range(n):
            state = step(state)
        return state

    return train


def start_of(tx: optax.GradientTransformation) -> dict[str, Any]:
    return {"params": PARAMS, "opt_state": tx.init(PARAMS), "step": jnp.asarray(0, jnp.int32)}


def assert_same_bits(a: Any, b: Any) -> None:
    """Same tree structure (optax NamedTuples included) and identical bytes and dtypes in every leaf."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"{ta} != {tb}"
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, f"leaf {i}: {x.dtype}{x.shape} {y.dtype}"
        assert x.tobytes() == y.tobytes(), f"leaf {i} differs"


def resume_through(
    fmt: str, tx: optax.GradientTransformation, path: Path, **options: Any
) -> tuple[Any, Any]:
    """(N+M uninterrupted, N + save/load + M) final states for ``fmt``."""
    train = trainer(tx)
    start = start_of(tx)
    middle = train(start, N)
    reference = train(middle, M)
    ptio.save(path, middle, format=fmt, **options)
    restored = ptio.load(path, like=jax.eval_shape(lambda: start), format=fmt)
    assert_same_bits(restored, middle)
    return reference, train(restored, M)


# --------------------------------------------------------------------------
# the generic formats: every optimizer
# --------------------------------------------------------------------------

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-3),
    "sgd": lambda: optax.sgd(5e-2),
    "sgd-momentum": lambda: optax.sgd(5e-2, momentum=0.9),
    "nesterov": lambda: optax.sgd(5e-2, momentum=0.9, nesterov=True),
    "adagrad": lambda: optax.adagrad(5e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.5, centered=True),
    "clip-chain": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
    "schedule": lambda: optax.adam(optax.linear_schedule(1e-2, 1e-3, 4)),
    "inject-schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.cosine_decay_schedule(1e-2, 10), weight_decay=1e-3
    ),
    "inject-clip-chain": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.sgd)(
            learning_rate=optax.exponential_decay(5e-2, 2, 0.5), momentum=0.9
        ),
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_generic_formats_resume_exactly(name: str, tmp_path: Path) -> None:
    tx = OPTIMIZERS[name]()
    train = trainer(tx)
    start = start_of(tx)
    middle = train(start, N)
    reference = train(middle, M)
    like = jax.eval_shape(lambda: start)
    for fmt in ("msgpack", "safetensors"):
        path = tmp_path / f"ckpt.{fmt}"
        ptio.save(path, middle)
        restored = ptio.load(path, like=like)
        assert_same_bits(restored, middle)
        assert_same_bits(train(restored, M), reference)


def test_train_state_saves_and_restores_in_generic_formats(tmp_path: Path) -> None:
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=PARAMS, tx=tx)

    @jax.jit
    def step(s: train_state.TrainState) -> train_state.TrainState:
        return s.apply_gradients(grads=jax.grad(_loss)(s.params))

    def train(s: train_state.TrainState, n: int) -> train_state.TrainState:
        for _ in range(n):
            s = step(s)
        return s

    middle = train(state, N)
    reference = train(middle, M)
    like = jax.eval_shape(lambda: state)
    for fmt in ("msgpack", "safetensors"):
        path = tmp_path / f"ts.{fmt}"
        ptio.save(path, middle)
        restored = ptio.load(path, like=like)
        assert isinstance(restored, train_state.TrainState)
        assert restored.tx is tx and restored.apply_fn == MODEL.apply
        assert int(restored.step) == N
        assert_same_bits(train(restored, M), reference)


# --------------------------------------------------------------------------
# the foreign formats: the optimizers each can hold
# --------------------------------------------------------------------------

FOREIGN = {
    "netcl-checkpoint-adamw": ("netcl-checkpoint", lambda: optax.adamw(1e-2), {}),
    "netcl-checkpoint-sgd-momentum": (
        "netcl-checkpoint",
        lambda: optax.sgd(5e-2, momentum=0.9),
        {},
    ),
    "waffe2-adam": (
        "waffe2",
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        {"optimizers": True},
    ),
    "waffe2-sgd": (
        "waffe2",
        lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=5e-2),
        {"optimizers": True},
    ),
    # cl-waffe2's own Adam rule (pytreeio.model.rules.waffe2) resumes exactly too
    "waffe2-own-adam": ("waffe2", lambda: waffe2_adam(lr=1e-2), {"optimizers": True}),
    "bullet-adamw": ("bullet", lambda: optax.adamw(1e-2, weight_decay=1e-3), {}),
    # bullet's own AdamW rule (pytreeio.model.rules.bullet) keeps the same two moments
    "bullet-own-adamw": ("bullet", lambda: bullet_adamw(1e-2), {}),
}


@pytest.mark.parametrize("case", list(FOREIGN))
def test_foreign_formats_resume_exactly(case: str, tmp_path: Path) -> None:
    fmt, make, options = FOREIGN[case]
    tx = make()
    train = trainer(tx)
    start = start_of(tx)
    middle = train(start, N)
    reference = train(middle, M)
    path = tmp_path / "ckpt"
    state = {"params": middle["params"], "opt_state": middle["opt_state"]}
    ptio.save(path, state, format=fmt, **options)
    like = jax.eval_shape(lambda: {"params": start["params"], "opt_state": start["opt_state"]})
    restored = ptio.load(path, like=like, format=fmt)
    assert_same_bits(restored, state)
    resumed = train({**restored, "step": middle["step"]}, M)
    assert_same_bits(resumed, reference)


@pytest.mark.parametrize(
    ("fmt", "make", "options"),
    [
        ("netcl-checkpoint", lambda: optax.adamw(1e-2), {}),
        (
            "waffe2",
            lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
            {"optimizers": True},
        ),
        ("bullet", lambda: optax.adamw(1e-2), {}),
    ],
    ids=["netcl-checkpoint", "waffe2", "bullet"],
)
def test_train_state_through_foreign_formats(
    fmt: str, make: Any, options: dict[str, Any], tmp_path: Path
) -> None:
    tx = make()
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=PARAMS, tx=tx)

    @jax.jit
    def step(s: train_state.TrainState) -> train_state.TrainState:
        return s.apply_gradients(grads=jax.grad(_loss)(s.params))

    def train(s: train_state.TrainState, n: int) -> train_state.TrainState:
        for _ in range(n):
            s = step(s)
        return s

    middle = train(state, N)
    reference = train(middle, M)
    path = tmp_path / "ts"
    ptio.save(path, middle, format=fmt, **options)
    restored = ptio.load(path, like=jax.eval_shape(lambda: state), format=fmt)
    assert isinstance(restored, train_state.TrainState)
    assert int(restored.step) == N
    assert_same_bits(train(restored, M), reference)


# --------------------------------------------------------------------------
# DataCode: hyperparameters only
# --------------------------------------------------------------------------

DATACODE = {
    "adam": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=1e-2, b1=0.8, b2=0.99, eps=1e-7
    ),
    "adamw": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=1e-3),
    "sgd": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=5e-2),
    "rmsprop": lambda: optax.inject_hyperparams(optax.rmsprop)(
        learning_rate=5e-2, decay=0.95, eps=1e-6
    ),
    "datacode-adam": lambda: dc_rules.datacode_optimizer(
        {"optimizer_type": "Adam", "optimizer_params": {"lr": 0.01}, "loss": "mse"}
    ),
}


def _hyper_bits(state: Any) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in state.hyperparams.items()}


@pytest.mark.parametrize("name", list(DATACODE))
def test_datacode_keeps_hyperparameters_and_starts_fresh(name: str, tmp_path: Path) -> None:
    tx = DATACODE[name]()
    middle = trainer(tx)(start_of(tx), N)
    record = dc_training.stage_record(
        middle["opt_state"],
        middle["params"],
        epochs=1,
        loss="mse",
        loss_history=[0.5],
        accuracy_history=[0.0],
    )
    doc = {"layers": ["Linear", "ReLU", "Linear"], "device": "cpu", "training": empty_training()}
    path = tmp_path / "model.nn"
    ptio.save(path, middle["params"], meta=dc_training.with_stage(doc, record))
    # the file holds no moments: an optimizer state cannot be restored from it
    with pytest.raises(MismatchError, match="no optimizer state"):
        ptio.load(
            path, like=jax.eval_shape(lambda: {k: middle[k] for k in ("params", "opt_state")})
        )
    params = ptio.load(path, like=jax.eval_shape(lambda: PARAMS))
    assert_same_bits(params, middle["params"])
    _, meta = ptio.load_with_meta(path)
    # DataCode's own rule, with DataCode's parameter names ...
    rebuilt = dc_rules.datacode_optimizer(meta)
    fresh = rebuilt.init(params)
    # ... and the stock optax optimizer of the same kind (pytreeio.model.optim.build)
    stage = dc_training.optim_state(meta)
    stock = optim.build(stage.kind, stage.hyperparams).init(params)
    original = tx.init(PARAMS)
    if name == "datacode-adam":
        assert _hyper_bits(fresh) == _hyper_bits(original)
        assert_same_bits(fresh, original)
    else:
        assert _hyper_bits(stock) == _hyper_bits(original)
        assert_same_bits(stock, original)  # the state starts fresh: count 0, zero moments
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(fresh.inner_state))
    assert int(optim.extract(stock, params).count or 0) == 0


# --------------------------------------------------------------------------
# the examples
# --------------------------------------------------------------------------


def test_resume_linen_example_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "resume_linen.py"), "--dir", str(tmp_path), "--steps", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "bit-exact resume: True" in done.stdout
