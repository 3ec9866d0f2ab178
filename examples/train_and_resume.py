"""Checkpoint a Flax + optax training run and resume it bit-exactly.

    python examples/train_and_resume.py [--dir DIR] [--format msgpack|safetensors]

Trains a small MLP for 50 steps, saves {params, opt_state, step}, loads it
back into the same structure with ``like=`` (optax NamedTuples and all),
trains 50 more steps and checks the result against 100 uninterrupted steps.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pytreeio as ptio


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.gelu(nn.Dense(64)(x))
        return nn.Dense(1)(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--format", default="msgpack", choices=["msgpack", "safetensors"])
    args = parser.parse_args()

    x = jax.random.normal(jax.random.PRNGKey(0), (512, 16))
    y = jnp.cos(x[:, :1] * 3.0)
    model = MLP()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    @jax.jit
    def step(params: Any, opt_state: Any) -> tuple[Any, Any]:
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def train(state: dict[str, Any], n: int) -> dict[str, Any]:
        params, opt_state = state["params"], state["opt_state"]
        for _ in range(n):
            params, opt_state = step(params, opt_state)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + n}

    params = model.init(jax.random.PRNGKey(1), x)
    start = {"params": params, "opt_state": tx.init(params), "step": 0}
    middle = train(start, 50)
    reference = train(middle, 50)

    out = Path(args.dir or tempfile.mkdtemp(prefix="pytreeio-example-"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"step_{middle['step']}.{args.format}"
    ptio.save(path, middle)
    print(ptio.inspect(path))

    # `like` may be the real tree or just its shapes (jax.eval_shape), e.g. on a fresh process.
    restored = ptio.load(path, like=jax.eval_shape(lambda: start))
    resumed = train(restored, 50)
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference), strict=True)
    )
    print(f"resumed at step {restored['step']} -> {resumed['step']}: bit-exact = {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
