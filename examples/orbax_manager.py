"""Checkpoint a training run with orbax's CheckpointManager, in a pytreeio format.

    python examples/orbax_manager.py [--dir DIR] [--format safetensors|msgpack|netcl-checkpoint]

Orbax numbers the steps, keeps the two best checkpoints by loss, saves in
the background and commits each step atomically; pytreeio
writes the item in the chosen format (``pytreeio.orbax``).  The run trains a
small MLP with Adam for 12 steps, saving every 3, then starts over as a new
process would: a fresh manager, the latest step restored into the shapes of
the state (``jax.eval_shape``), 8 more steps, checked bit for bit against 20
uninterrupted steps.  Needs ``pip install 'pytreeio[orbax]'``.
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
import orbax.checkpoint as ocp

from pytreeio.orbax import PytreeioRestore, PytreeioSave


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.relu(nn.Dense(32)(x))  # Dense_0: modules are named in call order
        return nn.Dense(1)(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument(
        "--format", default="safetensors", choices=["safetensors", "msgpack", "netcl-checkpoint"]
    )
    args = parser.parse_args()

    x = jax.random.normal(jax.random.PRNGKey(0), (256, 8))
    y = jnp.sin(x[:, :1] * 2.0)
    model = MLP()
    # AdamW: a kind netcl's checkpoints hold too, so every --format resumes exactly
    tx = optax.adamw(1e-2, weight_decay=1e-4)

    def loss_fn(params: Any) -> jax.Array:
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    @jax.jit
    def train_step(state: dict[str, Any]) -> tuple[dict[str, Any], jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }, loss

    params = model.init(jax.random.PRNGKey(1), x)["params"]
    start = {"params": params, "opt_state": tx.init(params)}

    reference = start
    for _ in range(20):
        reference, _ = train_step(reference)

    root = Path(args.dir or tempfile.mkdtemp(prefix="pytreeio-orbax-")) / "ckpts"
    options = ocp.CheckpointManagerOptions(
        max_to_keep=2,
        save_interval_steps=3,
        best_fn=lambda metrics: metrics["loss"],
        best_mode="min",
        keep_checkpoints_without_metrics=False,
    )
    state = start
    with ocp.CheckpointManager(root, options=options) as mngr:
        for step in range(1, 13):
            state, loss = train_step(state)
            # returns at once: the bytes are copied, the write runs in the background
            mngr.save(
                step,
                args=ocp.args.Composite(state=PytreeioSave(state, format=args.format)),
                metrics={"loss": float(loss)},
            )
        mngr.wait_until_finished()
        print(f"kept steps {mngr.all_steps()}, best {mngr.best_step()}")
        print(mngr.item_metadata(mngr.latest_step()).state)

    # a new process: the format comes from the item's metadata, the shapes from eval_shape
    with ocp.CheckpointManager(root, options=options) as mngr:
        at = mngr.latest_step()
        like = jax.eval_shape(lambda: start)
        state = mngr.restore(at, args=ocp.args.Composite(state=PytreeioRestore(like=like))).state
    for _ in range(at, 20):
        state, _ = train_step(state)
    same = all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True)
    )
    print(f"resumed at step {at} -> 20 ({args.format}): bit-exact = {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
