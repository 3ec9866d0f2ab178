"""bullet's AdamW as an optax transformation, against a float32 numpy implementation of bullet's rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pytreeio.model import optim
from pytreeio.model.rules.bullet import EPSILON, bullet_adamw

F32 = np.float32


def numpy_bullet_step(
    p: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    decay: float = 0.01,
    clip: float = 1.98,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bullet's AdamW, element by element, every operation rounded to float32 (numpy never fuses)."""
    lr_, b1, b2, one = F32(lr), F32(beta1), F32(beta2), F32(1)
    p = p * (one - F32(decay) * lr_)
    m = b1 * m + (one - b1) * g
    v = b2 * v + ((one - b2) * g) * g
    p = p - lr_ * m / (np.sqrt(v) + F32(EPSILON))
    p = np.clip(p, -F32(clip), F32(clip))
    return p, m, v


def params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "l0w": rng.normal(0, 0.5, (48, 16)).astype(F32),
        "l0b": rng.normal(0, 0.5, 16).astype(F32),
        "l1w": rng.normal(0, 1.2, (16, 1)).astype(F32),  # some beyond the clip
        "l1b": np.zeros(1, F32),
    }


def grads(rng: np.random.Generator, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: rng.normal(0, 0.05, v.shape).astype(F32) for k, v in like.items()}


@jax.jit
def _step_static(g, state, p):  # type: ignore[no-untyped-def]
    return _apply(_OPT, g, state, p)


def _apply(opt, g, state, p):  # type: ignore[no-untyped-def]
    u, state = opt.update(g, state, p)
    return optax.apply_updates(p, u), state, u


_OPT = bullet_adamw(0.01)


def test_state_is_optax_adamw_shaped() -> None:
    p = params()
    ours = bullet_adamw(0.001).init(p)
    theirs = optax.adamw(0.001).init(p)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    opt = optim.extract(ours, p)
    assert opt.kind == "adamw" and opt.count == 0 and set(opt.slots) == {"mu", "nu"}


def test_matches_numpy_over_several_steps() -> None:
    rng = np.random.default_rng(1)
    p0 = params()
    state = _OPT.init(p0)
    p = {k: jnp.asarray(v) for k, v in p0.items()}
    moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in p0.items()}
    exact = total = 0
    for _ in range(12):
        g = grads(rng, p0)
        prev = {k: np.asarray(v) for k, v in p.items()}
        p, state, u = _step_static(g, state, p)
        for k in p0:
            new, m, v = numpy_bullet_step(prev[k], g[k], *moments[k], lr=0.01)
            moments[k] = (m, v)
            # the moments are bullet's, bit for bit
            assert np.array_equal(np.asarray(state[0].mu[k]), m), k
            assert np.array_equal(np.asarray(state[0].nu[k]), v), k
            # the update is bullet's p_new - p in float32, bit for bit ...
            assert np.array_equal(np.asarray(u[k]), new - prev[k]), k
            # ... and optax's p + u is bullet's p_new within 2 ulp: of the weight, or of the
            # step where a weight comes close to zero (p + (p_new - p) rounds at that scale)
            got = np.asarray(p[k])
            scale = np.maximum(np.abs(new), np.abs(new - prev[k]))
            assert np.all(np.abs(got - new) <= 2 * np.spacing(scale)), k
            exact += int(np.sum(got == new))
            total += got.size
    assert exact / total > 0.99
    assert int(state[0].count) == 12


def test_clip_decay_and_schedule() -> None:
    p = {"w": np.array([1.979, -1.979, 0.5, 3.0], F32)}
    g = {"w": np.array([-1.0, 1.0, 0.0, 0.0], F32)}
    seen = []

    def schedule(count):  # type: ignore[no-untyped-def]
        seen.append(count)
        return 0.5

    opt = bullet_adamw(schedule, decay=0.0)
    u, state = jax.jit(opt.update)(g, opt.init(p), p)
    out = np.asarray(optax.apply_updates(p, u)["w"])
    assert out[0] == F32(1.98) and out[1] == F32(-1.98)  # clamped
    assert out[3] == F32(1.98)  # already beyond the clip: clamped without a gradient
    assert out[2] == F32(0.5)
    assert len(seen) == 1 and int(state[0].count) == 1
    # decay alone: p *= 1 - decay*lr
    opt = bullet_adamw(0.1, decay=0.5)
    u, _ = opt.update(
        {"w": np.zeros(1, F32)}, opt.init({"w": np.ones(1, F32)}), {"w": np.ones(1, F32)}
    )
    assert np.asarray(u["w"]).tolist() == [F32(1) - F32(0.5) * F32(0.1) - F32(1)]


def test_needs_params_and_works_under_inject_hyperparams() -> None:
    p = params()
    opt = bullet_adamw(0.01)
    with pytest.raises(ValueError, match="params"):
        opt.update(p, opt.init(p))
    injected = optax.inject_hyperparams(bullet_adamw)(lr=0.01, decay=0.01)
    state = injected.init(p)
    u, state = jax.jit(injected.update)(grads(np.random.default_rng(0), p), state, p)
    plain_u, _ = jax.jit(opt.update)(grads(np.random.default_rng(0), p), opt.init(p), p)
    for k in p:
        assert np.array_equal(np.asarray(u[k]), np.asarray(plain_u[k]))
    assert optim.extract(state, p).kind == "adamw"
