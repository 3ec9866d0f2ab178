"""The trees the benchmark saves and the per-format cases (what to save, how to load it).

One layered float32 model serves every format that can hold it: a Flax MLP
(``Dense_0`` ... ``Dense_{L-1}``, square kernels and biases, no activations),
``{"params": ...}``, 2 leaves per layer, so 32 layers make the reference's 64
leaves.  msgpack, safetensors and the peers save exactly this tree; the
layered-model formats (netcl, netcl-checkpoint, netcl-params, DataCode,
cl-waffe2, bullet) save it through their model mapping.  Tiny Llama holds only
its own architecture, so it gets a random Tiny Llama of about the same bytes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared test data
from tinyllama_data import random_tree as tinyllama_tree

LEAVES_PER_LAYER = 2
REFERENCE_LAYERS = 32  # 64 leaves, as the reference measurement


def _filled(shape: tuple[int, ...], block: np.ndarray, offset: int) -> np.ndarray:
    """A fresh array of ``shape`` tiled from ``block`` (fast: memcpy, not a random generator)."""
    out = np.empty(math.prod(shape), np.float32)
    n = out.size
    pos = 0
    while pos < n:
        take = min(n - pos, block.size - offset)
        out[pos : pos + take] = block[offset : offset + take]
        pos += take
        offset = 0
    return out.reshape(shape)


def mlp_tree(total_bytes: int, layers: int = REFERENCE_LAYERS, seed: int = 0) -> dict[str, Any]:
    """``{"params": {"Dense_i": {"kernel": (W, W), "bias": (W,)}}}`` of about ``total_bytes``.

    Values are N(0, 1) float32 (every one fits bullet's i16 quantisation at
    scale 255); each leaf starts at another place of one random block.
    """
    width = max(2, int(math.sqrt(total_bytes / layers / 4)))
    rng = np.random.default_rng(seed)
    block = rng.standard_normal(1 << 20, dtype=np.float32)
    params = {}
    for i in range(layers):
        params[f"Dense_{i}"] = {
            "kernel": _filled((width, width), block, (i * 7919) % block.size),
            "bias": _filled((width,), block, (i * 104729) % block.size),
        }
    return {"params": params}


def tinyllama_config(total_bytes: int) -> dict[str, Any]:
    """A Tiny Llama config whose file is about ``total_bytes`` (at least one layer)."""
    if total_bytes >= 256 << 20:
        base = {"d_model": 512, "n_heads": 8, "ffn_hidden_dim": 2048, "max_seq_len": 1024}
        vocab = 32000
    elif total_bytes >= 16 << 20:
        base = {"d_model": 256, "n_heads": 8, "ffn_hidden_dim": 1024, "max_seq_len": 512}
        vocab = 8000
    else:
        base = {"d_model": 32, "n_heads": 4, "ffn_hidden_dim": 128, "max_seq_len": 64}
        vocab = 512
    d, f, s = base["d_model"], base["ffn_hidden_dim"], base["max_seq_len"]
    fixed = 4 * (2 * vocab * d + s * d)
    per_layer = 4 * (4 * d * d + 2 * d * f + f + 5 * d)
    layers = max(1, round((total_bytes - fixed) / per_layer))
    return {**base, "n_layers": layers, "vocab_size": vocab, "dropout": 0.0}


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The array leaves of nested dicts and lists by ``/``-joined path (no pytreeio needed)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree} if hasattr(tree, "nbytes") and hasattr(tree, "shape") else {}
    out: dict[str, Any] = {}
    for k, v in items:
        out |= flat(v, f"{prefix}/{k}" if prefix else str(k))
    return out


def tree_nbytes(tree: Any) -> int:
    return sum(int(v.nbytes) for v in flat(tree).values())


def quantised_layout(tree: dict[str, Any]) -> list[dict[str, Any]]:
    """bullet's saved-format list for the MLP: every entry i16, scale 255, rounded."""
    return [
        {"id": f"l{i}{part}", "transforms": [], "type": "i16", "scale": 255, "round": True}
        for i in range(len(tree["params"]))
        for part in ("w", "b")
    ]


@dataclass
class FormatCase:
    """How one format saves and loads the benchmark's tree.

    ``dest`` is relative to the case's own directory (everything in it is the
    checkpoint); ``load_files`` names the files a load reads when it reads
    fewer than all of them (the raw read baselines read the same files);
    ``npz``: the files are zip archives whose members' CRC-32 a load checks.
    """

    name: str
    format: str
    layout: str  # "file", "siblings" or "directory"
    dest: str
    tree: str = "mlp"  # "mlp" or "tinyllama"
    save_options: dict[str, Any] = field(default_factory=dict)
    load_options: dict[str, Any] = field(default_factory=dict)
    meta: Callable[[Any], Any] | None = None
    load_files: list[str] | None = None
    npz: bool = False


def format_cases(layers: int = REFERENCE_LAYERS) -> list[FormatCase]:
    linear = ["Linear"] * layers
    return [
        FormatCase("msgpack", "msgpack", "file", "tree.msgpack"),
        FormatCase("safetensors", "safetensors", "file", "tree.safetensors"),
        FormatCase(
            "tinyllama",
            "tinyllama",
            "file",
            "weights.bin",
            tree="tinyllama",
            meta=lambda cfg: {"config": {"n_heads": cfg["n_heads"], "dropout": cfg["dropout"]}},
        ),
        FormatCase(
            "netcl", "netcl", "file", "model.netcl", save_options={"layers": linear}, npz=True
        ),
        FormatCase("netcl-checkpoint", "netcl-checkpoint", "siblings", "ckpt", npz=True),
        FormatCase("netcl-params", "netcl-params", "file", "params.npz", npz=True),
        FormatCase("datacode", "datacode", "file", "model.nn", save_options={"layers": linear}),
        FormatCase(
            "waffe2", "waffe2", "directory", "ckpt.wf2model", save_options={"layers": linear}
        ),
        # a load needs the tagged records of optimiser_state/weights.bin (raw.bin is what
        # engines read; quantised.bin is checked only when the layout is given)
        FormatCase(
            "bullet",
            "bullet",
            "directory",
            "ckpt",
            load_files=["optimiser_state/weights.bin", "log.txt"],
        ),
    ]


def save_kwargs(case: FormatCase, trees: dict[str, Any], configs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``ptio.save`` for ``case`` (format, options, meta)."""
    kwargs: dict[str, Any] = {"format": case.format, **case.save_options}
    if case.meta is not None:
        kwargs["meta"] = case.meta(
            configs["tinyllama"] if case.tree == "tinyllama" else trees[case.tree]
        )
    return kwargs


def build_trees(
    total_bytes: int, layers: int = REFERENCE_LAYERS
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trees by kind, configs by kind) for a run of ``total_bytes``."""
    cfg = tinyllama_config(total_bytes)
    return {"mlp": mlp_tree(total_bytes, layers), "tinyllama": tinyllama_tree(cfg)}, {
        "tinyllama": cfg
    }


def many_leaves_tree(leaves: int) -> dict[str, Any]:
    """The per-leaf cost tree: ``leaves // 2`` Linear layers of an 8x8 kernel and 8 biases.

    A layered model, so that every format (the model formats too) saves the
    same tree; values are N(0, 1) float32, within bullet's i16 quantisation.
    """
    block = np.random.default_rng(1).standard_normal(1 << 12, dtype=np.float32)
    return {
        "params": {
            f"Dense_{i}": {
                "kernel": _filled((8, 8), block, (i * 61) % block.size),
                "bias": _filled((8,), block, (i * 67) % block.size),
            }
            for i in range(max(1, leaves // 2))
        }
    }


#: Leaves per Tiny Llama layer (wq, wk, wv, wo, w1, b1, w2, b2, ln1 and ln2 scale and bias).
TINYLLAMA_LAYER_LEAVES = 12


def many_leaves_tinyllama(leaves: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tree, config) of a Tiny Llama model of about ``leaves`` leaves of 8 to 64 float32."""
    cfg = {"d_model": 8, "n_heads": 1, "ffn_hidden_dim": 8, "max_seq_len": 8, "vocab_size": 8}
    cfg |= {"n_layers": max(1, (leaves - 3) // TINYLLAMA_LAYER_LEAVES), "dropout": 0.0}
    return tinyllama_tree(cfg), cfg
