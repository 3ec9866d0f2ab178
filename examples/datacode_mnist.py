"""Load DataCode's trained MNIST MLP (``model_mnist.nn``) into a Flax model and run it.

DataCode (a Rust ML library) wrote ``model_mnist.nn``: a 784-128-10 MLP with a
ReLU, stored in its later on-disk variant (weights ``[out, in]``).  pytreeio
reads it straight into the parameters of an ``nn.Sequential`` Flax model
(kernels ``(in, out)``), and this script checks the Flax forward pass on a few
synthetic inputs against a plain numpy forward pass over the file's own
weights, and shows the training stage the file records.

    python examples/datacode_mnist.py [--file path/to/model_mnist.nn]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np

import pytreeio as ptio

DEFAULT = Path(__file__).resolve().parents[1].parent / "shared/conformance/datacode/model_mnist.nn"


def numpy_forward(native: dict, meta: dict, x: np.ndarray) -> np.ndarray:
    """The MLP as the file describes it, layer by layer, in float32 numpy."""
    acts = {
        "ReLU": lambda h: np.maximum(h, 0),
        "Sigmoid": lambda h: 1 / (1 + np.exp(-h)),
        "Tanh": np.tanh,
        "Flatten": lambda h: h.reshape(h.shape[0], -1),
    }
    h = x
    for i, layer in enumerate(meta["layers"]):
        if layer["type"] == "Linear":
            p = native[f"layer{i}"]
            h = h @ p["weight"] + p["bias"]
        elif layer["type"] == "Softmax":
            e = np.exp(h - h.max(axis=-1, keepdims=True))
            h = e / e.sum(axis=-1, keepdims=True)
        else:
            h = acts[layer["type"]](h)
    return h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=DEFAULT, help="a DataCode .nn file")
    args = parser.parse_args()

    native, meta = ptio.load_with_meta(args.file)
    sizes = [layer["in_features"] for layer in meta["layers"] if layer["type"] == "Linear"]
    model = nn.Sequential([nn.Dense(128), nn.relu, nn.Dense(10)])
    like = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, sizes[0]), np.float32))
    params = ptio.load(args.file, like=like["params"])

    x = np.random.default_rng(0).random((8, sizes[0]), dtype=np.float32)
    # full float32 products: on GPUs jax's default precision multiplies in TF32 (10-bit
    # significands), about 5e-3 off here, which is not what the file's numbers say
    with jax.default_matmul_precision("highest"):
        flax_out = np.asarray(jax.jit(model.apply)({"params": params}, x))
    numpy_out = numpy_forward(native, meta, x)
    diff = float(np.max(np.abs(flax_out - numpy_out)))

    stage = meta["training"]["stages"][-1]
    print(f"file: {args.file.name} ({meta['_datacode_file']['variant']} variant)")
    print("layers:", " -> ".join(layer["type"] for layer in meta["layers"]))
    print(
        f"trained: {stage['epochs']} epochs of {stage['optimizer_type']} "
        f"{stage['optimizer_params']}, loss {stage['loss']}, "
        f"final accuracy {stage['accuracy_history'][-1]:.4f}"
    )
    print("predicted classes:", flax_out.argmax(axis=-1).tolist())
    ok = diff <= 1e-4 * max(1.0, float(np.max(np.abs(numpy_out))))
    print(f"max |flax - numpy| = {diff:.3g}; match = {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
