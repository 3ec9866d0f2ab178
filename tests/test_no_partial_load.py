"""No partial effects on load: ``like`` is never modified and a failed load leaves nothing.

For msgpack, safetensors, netcl-checkpoint, waffe2 and bullet, ``ptio.load(...,
like=)`` is run on a good checkpoint, on one whose last tensor is corrupted,
and with a ``like`` whose last leaf does not match.  ``like`` (its containers,
which are mutable dicts and lists, the identity of every object in it and the
bytes of every numpy and jax leaf) must be exactly as before; a successful
load returns new containers; a failed one raises a ``PytreeioError``,
returns nothing, and leaves no jax array alive that was not alive before
(``gc`` + ``jax.live_arrays()``, on CPU).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pytreeio as ptio

FORMATS = ["msgpack", "safetensors", "netcl-checkpoint", "waffe2", "bullet"]


def _native(fmt: str, v: float) -> Any:
    def full(*shape: int) -> np.ndarray:
        return np.full(shape, v, np.float32)

    if fmt in ("msgpack", "safetensors"):
        return {"a": full(8, 4), "b": {"c": full(3), "d": full(5, 5)}, "z": full(16, 2)}
    if fmt == "netcl-checkpoint":
        return {
            "params": [full(16, 8), full(16)],
            "optim_state": {"t": int(v), "moments": [[full(16, 8)] * 2, [full(16)] * 2]},
        }
    if fmt == "waffe2":
        layers = {
            "0": {"weights": full(32, 16), "bias": full(32)},
            "1": {"weights": full(8, 32), "bias": full(8)},
        }
        return {"param": {"linearlayer": layers}}
    if fmt == "bullet":
        part = {"l0w": full(768, 8), "l0b": full(8), "l1w": full(16, 1), "l1b": full(1)}
        weights = {k: a / 64 for k, a in part.items()}
        return {"weights": weights, "momentum": dict(part), "velocity": dict(part)}
    raise AssertionError(fmt)


def _path(tmp_path: Path, fmt: str) -> Path:
    return tmp_path / {"msgpack": "c.msgpack", "safetensors": "c.safetensors"}.get(fmt, "c")


def _like(native: Any) -> Any:
    """``native`` with mutable containers and leaves alternating jax and numpy arrays."""
    count = [0]

    def leaf(x: Any) -> Any:
        count[0] += 1
        if isinstance(x, int):
            return jnp.asarray(x, jnp.int32)
        return jnp.asarray(x) if count[0] % 2 else np.array(x)

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return leaf(x)

    return walk(native)


def _snapshot(x: Any, path: str = "") -> list[tuple[Any, ...]]:
    """Every object of ``x`` with its identity, container contents and leaf bytes."""
    if isinstance(x, dict):
        out: list[tuple[Any, ...]] = [(path, "dict", id(x), tuple(x.keys()))]
        for k, v in x.items():
            out += _snapshot(v, f"{path}/{k}")
        return out
    if isinstance(x, list | tuple):
        out = [(path, type(x).__name__, id(x), len(x))]
        for i, v in enumerate(x):
            out += _snapshot(v, f"{path}[{i}]")
        return out
    a = np.asarray(x)
    return [(path, type(x).__name__, id(x), a.dtype.str, a.shape, a.tobytes())]


def _containers(x: Any) -> list[int]:
    if isinstance(x, dict):
        return [id(x), *(i for v in x.values() for i in _containers(v))]
    if isinstance(x, list | tuple):
        return [id(x), *(i for v in x for i in _containers(v))]
    return []


def _last_leaf_path(like: Any) -> list[Any]:
    paths, _ = jax.tree_util.tree_flatten_with_path(like)
    return [getattr(k, "key", getattr(k, "idx", None)) for k in paths[-1][0]]


def _set(tree: Any, keys: list[Any], value: Any) -> None:
    for k in keys[:-1]:
        tree = tree[k]
    tree[keys[-1]] = value


def _live() -> int:
    gc.collect()
    return len(jax.live_arrays())


def _corrupt_last_tensor(path: Path) -> None:
    """Cut the end off the file holding the last tensor (the largest file of a set)."""
    if path.is_dir():
        files = [Path(d) / n for d, _, ns in os.walk(path) for n in ns]
        target = max(files, key=lambda p: (p.stat().st_size, str(p)))
    elif path.exists():
        target = path
    else:
        target = path.with_name(path.name + ".npz")
    data = target.read_bytes()
    target.write_bytes(data[: len(data) - max(4, len(data) // 10)])


@pytest.fixture(autouse=True)
def _cpu() -> None:
    assert jax.default_backend() == "cpu" or os.environ.get("JAX_PLATFORMS") != "cpu"


@pytest.mark.parametrize("fmt", FORMATS)
def test_successful_load_leaves_like_untouched_and_returns_new_containers(
    tmp_path: Path, fmt: str
) -> None:
    p = _path(tmp_path, fmt)
    ptio.save(p, _native(fmt, 2), format=fmt)
    like = _like(_native(fmt, 1))
    before = _snapshot(like)
    out = ptio.load(p, like=like, format=fmt)
    assert _snapshot(like) == before
    assert not set(_containers(out)) & set(_containers(like))
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(like)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(_native(fmt, 2))):
        assert np.array_equal(np.asarray(got), np.asarray(want, np.asarray(got).dtype))


@pytest.mark.parametrize("failure", ["mismatch", "corrupt"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_failed_load_leaves_nothing(tmp_path: Path, fmt: str, failure: str) -> None:
    p = _path(tmp_path, fmt)
    ptio.save(p, _native(fmt, 2), format=fmt)
    like = _like(_native(fmt, 1))
    if failure == "mismatch":
        keys = _last_leaf_path(like)
        _set(like, keys, jnp.zeros((3, 7), jnp.float32))  # no leaf has this shape
    else:
        _corrupt_last_tensor(p)
    before = _snapshot(like)
    live = _live()
    result: Any = "untouched"
    try:
        result = ptio.load(p, like=like, format=fmt)
    except ptio.PytreeioError as exc:
        err: BaseException | None = exc
    else:
        err = None
    assert err is not None, f"the load succeeded: {jax.tree.map(np.shape, result)}"
    assert result == "untouched"
    del err
    assert _snapshot(like) == before
    assert _live() == live, "jax arrays made by the failed load are still referenced"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_caller_holding_the_error_holds_no_device_buffers(tmp_path: Path, fmt: str) -> None:
    """The exception's traceback keeps the failed load's frames: they must not keep arrays."""
    p = _path(tmp_path, fmt)
    ptio.save(p, _native(fmt, 2), format=fmt)
    like = _like(_native(fmt, 1))
    _set(like, _last_leaf_path(like), jnp.zeros((3, 7), jnp.float32))
    live = _live()
    with pytest.raises(ptio.PytreeioError) as info:
        ptio.load(p, like=like, format=fmt)
    assert info.value.__traceback__ is not None
    assert _live() == live, "the traceback of the error keeps jax arrays of the failed load"
