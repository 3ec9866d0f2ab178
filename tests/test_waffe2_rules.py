"""cl-waffe2's Adam as an optax transformation (``pytreeio.model.rules.waffe2.waffe2_adam``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pytreeio as ptio
from pytreeio.model import optim
from pytreeio.model.rules.waffe2 import scale_by_waffe2_adam, waffe2_adam

F32 = np.float32


def reference_adam(
    p: np.ndarray,
    grads: list[np.ndarray],
    *,
    lr: float = 1e-3,
    eps: float = 1e-7,
    beta1: float = 0.9,
    beta2: float = 0.999,
    m: np.ndarray | None = None,
    v: np.ndarray | None = None,
    n: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cl-waffe2's adam.lisp in float32 numpy, operation for operation.

    ``beta^n`` as SBCL computes ``(expt single-float fixnum)``: in double-float,
    rounded to single.
    """
    lr32, eps32, b1, b2 = F32(lr), F32(eps), F32(beta1), F32(beta2)
    m = np.zeros_like(p) if m is None else m.copy()
    v = np.zeros_like(p) if v is None else v.copy()
    p = p.copy()
    one = F32(1)
    for g in grads:
        n += 1
        lr_t = lr32 * (np.sqrt(one - F32(np.float64(b2) ** n)) / (one - F32(np.float64(b1) ** n)))
        m = m + (g - m) * (one - b1)
        v = v + (one - b2) * (g * g - v)
        p = p - (m * lr_t) / (eps32 + np.sqrt(v))
    return p, m, v


def ulps(a: Any, b: Any) -> int:
    x = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    y = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    # map the sign-magnitude bit patterns onto a monotonic integer line
    x = np.where(x < 0, -(x & 0x7FFFFFFF), x)
    y = np.where(y < 0, -(y & 0x7FFFFFFF), y)
    return int(np.max(np.abs(x - y))) if x.size else 0


def run(opt: Any, params: Any, grads: list[Any]) -> tuple[Any, Any]:
    state = opt.init(params)

    @jax.jit
    def step(params: Any, state: Any, g: Any) -> tuple[Any, Any]:
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads:
        params, state = step(params, state, g)
    return params, state


@pytest.mark.parametrize(
    "hyper",
    [
        {},
        {"lr": 1e-2},
        {"lr": 0.05, "eps": 1e-5, "beta1": 0.8, "beta2": 0.99},
    ],
)
def test_matches_float32_reference_bit_for_bit(hyper: dict[str, float]) -> None:
    rng = np.random.default_rng(0)
    shapes = {"w": (5, 7), "b": (7,), "s": ()}
    p0 = {k: rng.standard_normal(s).astype(F32) for k, s in shapes.items()}
    steps = 12
    grads = [
        {k: rng.standard_normal(s).astype(F32) for k, s in shapes.items()} for _ in range(steps)
    ]
    params, state = run(waffe2_adam(**hyper), jax.tree.map(jnp.asarray, p0), grads)
    inner = state.inner_state
    assert int(state.count) == int(inner.count) == steps
    for k in shapes:
        p, m, v = reference_adam(p0[k], [g[k] for g in grads], **hyper)
        assert ulps(params[k], p) == 0, k
        assert ulps(inner.mu[k], m) == 0, k
        assert ulps(inner.nu[k], v) == 0, k


def test_first_step_uses_n_equal_1() -> None:
    p0 = jnp.asarray([1.0, -2.0, 3.0], jnp.float32)
    g = jnp.asarray([0.5, 0.25, -1.0], jnp.float32)
    opt = scale_by_waffe2_adam(1e-2, 0.9, 0.999, 1e-7)
    state = opt.init(p0)
    assert int(state.count) == 0
    updates, state = jax.jit(opt.update)(g, state)
    assert int(state.count) == 1
    # n = 1: lr_t = lr * sqrt(1 - b2) / (1 - b1); m = 0.1 g; v = 0.001 g^2
    p, m, v = reference_adam(np.asarray(p0), [np.asarray(g)], lr=1e-2)
    assert ulps(p0 + updates, p) == 0
    assert ulps(state.mu, m) == 0 and ulps(state.nu, v) == 0


def test_reference_reproduces_cl_waffe2_step(conformance: Path) -> None:
    """The rule above is cl-waffe2's: model B's first Adam step, bit for bit (NOTES.md)."""
    d = conformance / "waffe2" / "tiny_adam1_opt.wf2model"
    before = {  # model B untrained, float32 bits from NOTES.md
        "0.bias": "3E839872 3E6A6C6C BDB415B4",
        "0.weights": "BF68799D 3F22D626 BF02639F 3F1D1FB4 BED10478 3E200E8B 3EF383C0 3F469B6C "
        "BF6989A1 BEB2B922 3E35C0B6 BF4B2765",
        "1.bias": "3E083638 BE9C90BC",
        "1.weights": "3F819F3C 3F6862F5 BF1D32B8 3F8403C0 3E57D921 3E619B05",
    }
    native = ptio.load(d)
    for name, bits in before.items():
        nth, slot = name.split(".")
        p0 = np.array([int(b, 16) for b in bits.split()], dtype=np.uint32).view(F32)
        adam = native["optimizer"]["linearlayer"][nth][slot]["adam"]
        assert adam["n"] == 1
        # the parameter step of the rule (n = 1), fed the m and v cl-waffe2 saved:
        lr_t = F32(0.01) * (np.sqrt(F32(1) - F32(0.999)) / (F32(1) - F32(0.9)))
        p1 = p0 - (adam["m"] * lr_t) / (F32(1e-7) + np.sqrt(adam["v"]))
        expected = native["param"]["linearlayer"][nth][slot]
        assert p1.tobytes() == expected.tobytes(), name


def test_state_maps_to_adam_optstate_and_back() -> None:
    params = {"Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
    opt = waffe2_adam(lr=0.02)
    grads = [jax.tree.map(lambda a: a * 0.1, params)] * 2
    _, state = run(opt, params, grads)
    extracted = optim.extract(state, params)
    assert extracted.kind == "adam" and extracted.count == 2
    assert extracted.hyperparams["learning_rate"] == pytest.approx(0.02)
    assert extracted.hyperparams["eps"] == pytest.approx(1e-7)
    assert (extracted.hyperparams["b1"], extracted.hyperparams["b2"]) == pytest.approx((0.9, 0.999))
    rebuilt = optim.rebuild(extracted, jax.eval_shape(opt.init, params), params)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(rebuilt), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_continue_a_cl_waffe2_run(conformance: Path) -> None:
    """tiny_adam3_opt resumes under waffe2_adam with the file's n, m, v and hyperparameters."""
    d = conformance / "waffe2" / "tiny_adam3_opt.wf2model"
    rng = np.random.default_rng(1)
    params = {
        "Dense_0": {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(3)},
        "Dense_1": {"kernel": jnp.zeros((3, 2)), "bias": jnp.zeros(2)},
    }
    opt = waffe2_adam()  # cl-waffe2's defaults; the file's lr=0.01 replaces 1e-3
    layers = [
        {"type": "Linear", "in_features": 4, "out_features": 3},
        {"type": "Linear", "in_features": 3, "out_features": 2},
    ]
    state = ptio.load(d, like={"params": params, "opt_state": opt.init(params)}, layers=layers)
    assert int(state["opt_state"].count) == 3
    assert float(state["opt_state"].hyperparams["learning_rate"]) == F32(0.01)
    grads = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape).astype(F32)), params)
    new_params, new_state = run_from(opt, state["params"], state["opt_state"], grads)
    inner = state["opt_state"].inner_state
    for name in ("Dense_0", "Dense_1"):
        for slot in ("kernel", "bias"):
            p, m, v = reference_adam(
                np.asarray(state["params"][name][slot]),
                [np.asarray(grads[name][slot])],
                lr=0.01,
                m=np.asarray(inner.mu[name][slot]),
                v=np.asarray(inner.nu[name][slot]),
                n=3,
            )
            assert ulps(new_params[name][slot], p) == 0
            assert ulps(new_state.inner_state.mu[name][slot], m) == 0
            assert ulps(new_state.inner_state.nu[name][slot], v) == 0
    assert int(new_state.count) == 4


def run_from(opt: Any, params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    updates, state = jax.jit(opt.update)(grads, state, params)
    return optax.apply_updates(params, updates), state
