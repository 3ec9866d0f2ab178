"""Load a checkpoint from each of the five original systems into a Flax model and run it.

    python examples/load_foreign.py [--conformance DIR] [--netcl FILE] [--bullet DIR]

- Tiny Llama ``weights.bin``  -> ``pytreeio.models.tinyllama`` (the original's semantics)
- DataCode ``.nn``            -> ``nn.Sequential([Dense, relu, Dense])``
- cl-waffe2 ``:wf2model``     -> a Flax MLP plus its optax Adam state (count included)
- netcl model file            -> a Flax MLP (``--netcl``; default: one netcl's own
                                 ``save_model`` would write, made here)
- bullet checkpoint           -> a Flax MLP (``--bullet``; default: one made here)

The real files come from ``../shared/conformance`` (``--conformance``).  Each
model is loaded with ``like=`` an abstract Flax tree (``jax.eval_shape``), so
every shape and dtype is checked, and run on a few inputs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pytreeio as ptio
from pytreeio.formats.bullet import checkpoint as bullet
from pytreeio.models import tinyllama as tl

HERE = Path(__file__).resolve().parent


def mlp(*sizes: int) -> nn.Sequential:
    """Dense -> relu -> Dense -> ... (nn.Sequential names them layers_0, layers_2, ...)."""
    layers: list = []
    for n in sizes:
        layers += [nn.Dense(n), nn.relu]
    return nn.Sequential(layers[:-1])


def abstract_params(model: nn.Module, n_in: int) -> dict:
    return jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, n_in)))["params"]


def tinyllama(conformance: Path) -> str:
    path = conformance / "tinyllama" / "weights.bin"
    config = tl.TinyLlamaConfig.from_meta(ptio.inspect(path).meta)
    params = ptio.load(path, like=tl.abstract_params(config))
    return f"tokens {tl.generate_greedy(params, config, [1, 5, 7], 4)}"


def datacode(conformance: Path) -> str:
    model = mlp(128, 10)
    params = ptio.load(
        conformance / "datacode" / "model_mnist.nn", like=abstract_params(model, 784)
    )
    x = jax.random.uniform(jax.random.PRNGKey(1), (3, 784))
    return f"MNIST digits {np.asarray(model.apply({'params': params}, x).argmax(-1)).tolist()}"


def waffe2(conformance: Path) -> str:
    model = mlp(3, 2)
    params = abstract_params(model, 4)
    opt = optax.adam(1e-3)
    like = {"params": params, "opt_state": jax.eval_shape(opt.init, params)}
    # cl-waffe2 stores no layer list: the activations between the LinearLayers come from us
    path = conformance / "waffe2" / "tiny_adam3_opt.wf2model"
    state = ptio.load(path, like=like, layers=["Linear", "ReLU", "Linear"])
    out = model.apply({"params": state["params"]}, jnp.ones((1, 4)))
    return (
        f"output {np.asarray(out).round(4).tolist()}, Adam count {int(state['opt_state'][0].count)}"
    )


def netcl(path: Path) -> str:
    model = mlp(16, 3)
    params = ptio.load(path, like=abstract_params(model, 8))
    return (
        f"output {np.asarray(model.apply({'params': params}, jnp.ones((1, 8)))).round(4).tolist()}"
    )


class NNUE(nn.Module):
    """A compact-style MLP: its modules are Dense_0, Dense_1 (the N-th Dense)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = jnp.clip(nn.Dense(16)(x), 0.0, 1.0)  # CReLU
        return nn.Dense(1)(hidden)


def bullet_mlp(path: Path) -> str:
    # bullet stores parameters only (l0w, l0b, l1w, l1b): Dense_N names map to the N-th layer
    model = NNUE()
    params = ptio.load(path, like=abstract_params(model, 32), format="bullet")
    return (
        f"output {np.asarray(model.apply({'params': params}, jnp.ones((1, 32)))).round(4).tolist()}"
    )


def made_here(out: Path) -> tuple[Path, Path]:
    """A netcl model file (byte-identical to netcl's save_model) and a bullet checkpoint."""
    rng = np.random.default_rng(0)
    netcl_layers = [
        {
            "weight": rng.standard_normal((8, 16)).astype(np.float32),
            "bias": np.zeros(16, np.float32),
        },
        {},
        {
            "weight": rng.standard_normal((16, 3)).astype(np.float32),
            "bias": np.zeros(3, np.float32),
        },
    ]
    netcl_path = out / "mlp.netcl"
    ptio.save(netcl_path, netcl_layers, meta={"config": ["Linear", "ReLU", "Linear"]})
    weights = {
        "l0w": (rng.standard_normal((32, 16)) * 0.1).astype(np.float32),
        "l0b": np.zeros(16, np.float32),
        "l1w": (rng.standard_normal((16, 1)) * 0.1).astype(np.float32),
        "l1b": np.zeros(1, np.float32),
    }
    bullet_path = out / "net-10"
    meta = {"saved_format": bullet.classic_layout([255, 64])}
    ptio.save(bullet_path, {"weights": weights}, format="bullet", meta=meta)
    return netcl_path, bullet_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--conformance", type=Path, default=HERE.parents[1] / "shared" / "conformance"
    )
    parser.add_argument("--netcl", type=Path, default=None)
    parser.add_argument("--bullet", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pytreeio-foreign-") as tmp:
        made_netcl, made_bullet = made_here(Path(tmp))
        for system, run in [
            ("Tiny Llama", lambda: tinyllama(args.conformance)),
            ("DataCode", lambda: datacode(args.conformance)),
            ("cl-waffe2", lambda: waffe2(args.conformance)),
            ("netcl", lambda: netcl(args.netcl or made_netcl)),
            ("bullet", lambda: bullet_mlp(args.bullet or made_bullet)),
        ]:
            print(f"{system:<10} loaded into Flax: {run()}")
    print("all 5 systems loaded")


if __name__ == "__main__":
    main()
