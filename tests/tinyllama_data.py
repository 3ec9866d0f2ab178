"""Synthetic Tiny Llama native trees, shared by the tests and the benchmark."""

from __future__ import annotations

from typing import Any

import numpy as np


def random_tree(cfg: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """A native ``tinyllama`` tree for ``cfg`` with N(0, 0.02) float32 values everywhere."""
    rng = np.random.default_rng(seed)
    d, f, s, v = cfg["d_model"], cfg["ffn_hidden_dim"], cfg["max_seq_len"], cfg["vocab_size"]

    def arr(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    layers = [
        {
            "wq": arr(d, d),
            "wk": arr(d, d),
            "wv": arr(d, d),
            "wo": arr(d, d),
            "w1": arr(d, f),
            "b1": arr(f),
            "w2": arr(f, d),
            "b2": arr(d),
            "ln1": {"scale": arr(d), "bias": arr(d)},
            "ln2": {"scale": arr(d), "bias": arr(d)},
        }
        for _ in range(cfg["n_layers"])
    ]
    return {
        "tok_embedding": arr(v, d),
        "pos_embedding": arr(s, d),
        "layers": layers,
        "output": arr(d, v),
    }
