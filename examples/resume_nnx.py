"""Checkpoint a Flax NNX training loop (``nnx.Optimizer``, dropout RNG state) and resume it bit-exactly.

    python examples/resume_nnx.py [--format msgpack|safetensors] [--dir DIR] [--steps N]

Trains a small NNX MLP with dropout for N steps, saves ``nnx.state(model)``
and ``nnx.state(optimizer)`` directly (Variables, the optimizer's moments and
step, the dropout stream's typed PRNG key and counter), builds an abstract
model and optimizer with ``nnx.eval_shape`` (no real arrays), loads the file
into their states with ``like=`` and ``nnx.update``\\ s them, trains N more
steps, and checks everything against 2N uninterrupted steps bit for bit.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pytreeio as ptio


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))


def build() -> tuple[MLP, nnx.Optimizer]:
    model = MLP(nnx.Rngs(params=0, dropout=1))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def bits(tree: Any) -> list[bytes]:
    """Every leaf's bytes (typed PRNG keys by their key data)."""
    out = []
    for leaf in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf).tobytes())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="safetensors", choices=["safetensors", "msgpack"])
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

    @nnx.jit
    def step(model: MLP, optimizer: nnx.Optimizer) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def train(model: MLP, optimizer: nnx.Optimizer, n: int, label: str) -> None:
        losses = [float(step(model, optimizer)) for _ in range(n)]
        print(
            f"{label:>9}: steps {int(optimizer.step[...]) - n + 1}..{int(optimizer.step[...])}  "
            f"loss {losses[0]:.5f} -> {losses[-1]:.5f}"
        )

    model, optimizer = build()
    train(model, optimizer, args.steps, "first")
    checkpoint = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    out = Path(args.dir or tempfile.mkdtemp(prefix="pytreeio-resume-"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"nnx_step_{args.steps}.{args.format}"
    ptio.save(path, checkpoint)
    print(f"saved {args.format} checkpoint at {path}")

    reference = nnx.clone((model, optimizer))
    train(*reference, args.steps, "straight")

    # A new process would do just this: an abstract model and optimizer, values from the file.
    new_model, new_optimizer = nnx.eval_shape(build)
    like = {"model": nnx.state(new_model), "optimizer": nnx.state(new_optimizer)}
    restored = ptio.load(path, like=like)
    nnx.update(new_model, restored["model"])
    nnx.update(new_optimizer, restored["optimizer"])
    train(new_model, new_optimizer, args.steps, "resumed")

    exact = bits(nnx.state((new_model, new_optimizer))) == bits(nnx.state(reference))
    print(f"bit-exact resume: {exact}")
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
