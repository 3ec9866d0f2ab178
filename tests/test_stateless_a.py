"""Stateless reads of msgpack, safetensors and tinyllama: a load depends on the file's bytes alone.

A file is loaded five times in this process, then overwritten by a file of
the same length with other values (and, where the format allows, other
shapes, dtypes or config); the next load must equal, bit for bit, what a
fresh process reads from it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tinyllama_data import random_tree

import pytreeio as ptio
from pytreeio.formats import tinyllama as tl

# Prints the loaded tree and meta as JSON: per leaf its key, type, dtype, shape and bytes.
_DUMP = """
import json, sys
import numpy as np
import pytreeio as ptio

def describe(tree, meta):
    leaves = []
    for k, v in ptio.flatten(tree).items():
        a = np.asarray(v)
        leaves.append([k, type(v).__name__, a.dtype.str, list(a.shape), a.tobytes().hex()])
    return json.dumps([leaves, meta], sort_keys=True, default=repr)
"""


def _describe(tree: Any, meta: Any) -> str:
    scope: dict[str, Any] = {}
    exec(_DUMP, scope)
    return scope["describe"](tree, meta)  # type: ignore[no-any-return]


def _load(path: Path, fmt: str) -> str:
    tree, meta = ptio.load_with_meta(path, format=fmt)
    return _describe(tree, meta)


def _fresh(path: Path, fmt: str) -> str:
    code = _DUMP + "tree, meta = ptio.load_with_meta(sys.argv[1], format=sys.argv[2])\n"
    code += "print(describe(tree, meta))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(path), fmt], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _check(path: Path, fmt: str, first: bytes, others: list[bytes]) -> None:
    path.write_bytes(first)
    seen = [_load(path, fmt) for _ in range(5)]
    assert all(s == seen[0] for s in seen)
    for other in others:
        assert len(other) == len(first) and other != first
        path.write_bytes(other)
        assert _load(path, fmt) == _fresh(path, fmt)


def _kernels(dtype: str, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {f"m{i}": {"w": (rng.standard_normal(shape) * 100).astype(dtype)} for i in range(40)}


def _both(fmt: str) -> list[bytes]:
    """A file, one of other values, and one of other shapes and dtypes, all of one length."""
    trees = [
        _kernels("float32", (4, 8), 0),
        _kernels("float32", (4, 8), 1),
        _kernels("float64", (4, 4), 2),  # 128 bytes per array as before; names as long
    ]
    return [ptio.encode(t, format=fmt).tobytes() for t in trees]


@pytest.mark.parametrize("fmt", ["msgpack", "safetensors"])
def test_a_file_of_the_same_length_loads_as_a_fresh_process_reads_it(
    tmp_path: Path, fmt: str
) -> None:
    first, *others = _both(fmt)
    _check(tmp_path / f"t.{fmt}", fmt, first, others)


def test_tinyllama_file_of_the_same_length_loads_as_a_fresh_process_reads_it(
    tmp_path: Path,
) -> None:
    cfg = {"d_model": 8, "n_layers": 2, "n_heads": 2, "ffn_hidden_dim": 16, "dropout": 0.0}
    # vocab and sequence length traded: 4D(V + S + V) bytes of embeddings either way
    a = {**cfg, "vocab_size": 8, "max_seq_len": 4}
    b = {**cfg, "vocab_size": 6, "max_seq_len": 8}
    assert tl.file_size(a) == tl.file_size(b)

    def blob(c: dict[str, Any], seed: int) -> bytes:
        meta = {"config": {"n_heads": c["n_heads"], "dropout": c["dropout"]}}
        return tl.encode(random_tree(c, seed), meta=meta).tobytes()

    _check(tmp_path / "weights.bin", "tinyllama", blob(a, 0), [blob(a, 1), blob(b, 2)])
