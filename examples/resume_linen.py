"""Checkpoint a Flax Linen + optax training loop and resume it bit-exactly, in any format.

    python examples/resume_linen.py [--format FORMAT] [--dir DIR] [--steps N]

Trains a small MLP for N steps, saves ``{'params', 'opt_state', 'step'}``,
loads it in a fresh structure made by ``jax.eval_shape`` (nothing real is
needed to load), trains N more steps, and checks the result against 2N
uninterrupted steps bit for bit: parameters, optimizer moments, step.

The formats that hold an optimizer state each get one they can hold:
msgpack, safetensors and netcl-checkpoint a ``clip_by_global_norm`` +
AdamW chain; bullet plain AdamW; cl-waffe2 Adam (under
``optax.inject_hyperparams``, so its learning rate is stored too).
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

#: format -> (optimizer, save options)
SETUPS: dict[str, tuple[Any, dict[str, Any]]] = {
    "safetensors": (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)), {}),
    "msgpack": (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)), {}),
    "netcl-checkpoint": (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)), {}),
    "bullet": (optax.adamw(3e-3), {}),
    "waffe2": (optax.inject_hyperparams(optax.adam)(learning_rate=3e-3), {"optimizers": True}),
}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.relu(nn.Dense(32)(x))  # Dense_0, then Dense_1: modules named in network order
        return nn.Dense(1)(h)


def same_bits(a: Any, b: Any) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="safetensors", choices=sorted(SETUPS))
    parser.add_argument(
        "--dir", default=None, help="where the checkpoint goes (default: a temp dir)"
    )
    parser.add_argument(
        "--steps", type=int, default=20, help="steps before and after the checkpoint"
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    data = np.random.default_rng(0).normal(size=(256, 8)).astype(np.float32)
    x = jnp.asarray(data)
    y = jnp.asarray(np.sin(data[:, :1] * 2.0) + 0.1 * data[:, 1:2])
    model = MLP()
    tx, options = SETUPS[args.format]

    @jax.jit
    def step(state: dict[str, Any]) -> tuple[dict[str, Any], jax.Array]:
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
        )(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    def train(state: dict[str, Any], n: int, label: str) -> dict[str, Any]:
        losses = []
        for _ in range(n):
            state, loss = step(state)
            losses.append(float(loss))
        print(
            f"{label:>9}: steps {int(state['step']) - n + 1}..{int(state['step'])}  loss "
            f"{losses[0]:.5f} -> {losses[-1]:.5f}"
        )
        return state

    @jax.jit  # one compilation instead of one per initialiser
    def fresh() -> dict[str, Any]:
        params = model.init(jax.random.key(1), x[:1])["params"]
        return {"params": params, "opt_state": tx.init(params), "step": jnp.asarray(0, jnp.int32)}

    middle = train(fresh(), args.steps, "first")
    reference = train(middle, args.steps, "straight")

    out = Path(args.dir or tempfile.mkdtemp(prefix="pytreeio-resume-"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"linen_step_{int(middle['step'])}"
    ptio.save(path, middle, format=args.format, **options)
    print(f"saved {args.format} checkpoint at {path}")

    # A new process would do just this: shapes from jax.eval_shape, values from the file.
    restored = ptio.load(path, like=jax.eval_shape(fresh), format=args.format)
    resumed = train(restored, args.steps, "resumed")
    exact = same_bits(resumed, reference)
    print(f"bit-exact resume: {exact}")
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
