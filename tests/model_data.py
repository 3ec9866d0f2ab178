"""A small Flax-style MLP that several test modules save in many formats."""

from __future__ import annotations

import numpy as np

#: Its layer list, activation included (for formats that store one, and for ``layers=``).
MLP_LAYERS = ["Linear", "ReLU", "Linear"]


def mlp_params(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """``Dense_0`` (4 -> 8) and ``Dense_1`` (8 -> 3), float32, random."""
    rng = np.random.default_rng(seed)
    return {
        "Dense_0": {
            "kernel": rng.standard_normal((4, 8)).astype(np.float32),
            "bias": rng.standard_normal(8).astype(np.float32),
        },
        "Dense_1": {
            "kernel": rng.standard_normal((8, 3)).astype(np.float32),
            "bias": rng.standard_normal(3).astype(np.float32),
        },
    }
