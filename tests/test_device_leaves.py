"""Arrays held on an accelerator: saved as streamed leaves whose transfers overlap the writes.

The suite runs on CPU, so these tests make jax CPU arrays count as
accelerator-held (``shards.on_accelerator``) and check that the path such
arrays take on a GPU writes the same bytes as the ordinary one, takes each
array's own host copy (one transfer, started when the array is encoded and
awaited when it is written) and leaves the caller's tree as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bits_equal

import pytreeio as ptio
from pytreeio import multihost
from pytreeio.core import shards


@pytest.fixture
def as_if_on_gpu(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """jax arrays count as accelerator-held; returns the streamed leaves the encoders make."""
    made: list[Any] = []
    real_leaf = shards.sharded_leaf

    def on_accelerator(x: Any) -> bool:
        return isinstance(x, jax.Array) and len(x.sharding.device_set) == 1

    def sharded_leaf(x: Any, key: str) -> Any:
        leaf = real_leaf(x, key)
        if leaf is not None:
            made.append(leaf)
        return leaf

    monkeypatch.setattr(shards, "on_accelerator", on_accelerator)
    monkeypatch.setattr(shards, "sharded_leaf", sharded_leaf)
    return made


def _on_host(tree: Any) -> Any:
    """``tree`` with numpy arrays for jax ones, dict order kept (tree_map sorts keys)."""
    if isinstance(tree, dict):
        return {k: _on_host(v) for k, v in tree.items()}
    return np.asarray(tree) if isinstance(tree, jax.Array) else tree


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "params": {
            "dense": {
                "kernel": jnp.asarray(rng.standard_normal((300, 70), np.float32)),
                "bias": jnp.asarray(rng.standard_normal(70, np.float32)),
            },
            "embed": jnp.asarray(rng.integers(-9, 9, (5, 3, 4), dtype=np.int32)),
            "scalar": jnp.float32(2.5),
            "half": jnp.asarray(rng.standard_normal(33).astype(np.float16)),
        },
        "step": 7,
    }


@pytest.mark.parametrize("suffix", [".safetensors", ".msgpack"])
def test_accelerator_leaves_write_the_bytes_of_host_leaves(
    suffix: str, tmp_path: Path, as_if_on_gpu: list[Any]
) -> None:
    tree = _tree()
    host = _on_host(tree)
    ptio.save(tmp_path / f"device{suffix}", tree)
    # every array streamed whole, its transfer started when encoded, taken when written
    assert len(as_if_on_gpu) == 5 and all(leaf._whole for leaf in as_if_on_gpu)
    as_if_on_gpu.clear()
    ptio.save(tmp_path / f"host{suffix}", host)
    assert as_if_on_gpu == []
    assert (tmp_path / f"device{suffix}").read_bytes() == (tmp_path / f"host{suffix}").read_bytes()
    assert_bits_equal(ptio.load(tmp_path / f"device{suffix}", like=host), host)


def test_a_whole_array_is_one_piece_taken_from_the_array_itself(as_if_on_gpu: list[Any]) -> None:
    x = jnp.arange(4096 * 3, dtype=jnp.float32).reshape(4096, 3)
    leaf = shards.sharded_leaf(x, "x")
    assert leaf is not None and leaf._whole
    chunks = leaf.chunks()
    data = b"".join(bytes(c.produce()) for c in chunks)
    assert data == np.asarray(x).tobytes()
    assert leaf._host is None  # released after the last band


def test_cpu_arrays_and_numpy_stay_on_the_ordinary_path() -> None:
    on_cpu = jax.device_put(jnp.ones(3), jax.devices("cpu")[0])  # a GPU machine has a CPU too
    assert not shards.on_accelerator(on_cpu)
    assert not shards.on_accelerator(np.ones(3))
    assert shards.sharded_leaf(on_cpu, "x") is None
    shards.start_host_copies({"a": on_cpu, "b": np.ones(2), "c": 1})  # nothing to start


def test_save_async_of_accelerator_leaves(tmp_path: Path, as_if_on_gpu: list[Any]) -> None:
    tree = _tree()
    expected = _on_host(tree)
    ptio.save_async(tmp_path / "a.safetensors", tree).result()
    assert len(as_if_on_gpu) == 5
    assert_bits_equal(ptio.load(tmp_path / "a.safetensors", like=expected), expected)


def test_save_in_parts_writes_accelerator_arrays_from_the_primary(
    tmp_path: Path, as_if_on_gpu: list[Any]
) -> None:
    # each process holds its own copy of an unsharded array: only the primary writes it
    from thread_group import run_threads

    tree = _tree()
    dest = tmp_path / "ckpt.safetensors"
    results = run_threads(2, lambda c: multihost.save_in_parts(dest, tree, coordinator=c))
    assert results == [None, None] and as_if_on_gpu == []
    ptio.save(tmp_path / "plain.safetensors", _on_host(tree))
    assert dest.read_bytes() == (tmp_path / "plain.safetensors").read_bytes()


def test_a_snapshot_keeps_the_host_copies_of_accelerator_arrays(
    tmp_path: Path, as_if_on_gpu: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # jax's host copy of an accelerator array is read-only: save_async's snapshot keeps it
    # instead of copying it again (the transfer is the only copy)
    from pytreeio import async_save
    from pytreeio.formats import safetensors as st

    monkeypatch.setattr(shards, "_host_copy_is_private", lambda array: True)
    tree = _tree()
    snap = async_save._snapshot(st.encode(tree))
    kernel = np.asarray(tree["params"]["dense"]["kernel"])
    kept = [
        c
        for c in snap.chunks
        if isinstance(c, memoryview) and np.shares_memory(np.frombuffer(c, np.uint8), kernel)
    ]
    assert len(kept) == 1 and bytes(kept[0]) == kernel.tobytes()
    ptio.save_async(tmp_path / "a.safetensors", tree).result()
    ptio.save(tmp_path / "b.safetensors", _on_host(tree))
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_a_snapshot_copies_what_is_not_private(as_if_on_gpu: list[Any]) -> None:
    # a CPU array's host view is its device buffer (a donation may reuse it): copied
    from pytreeio import async_save
    from pytreeio.formats import safetensors as st

    tree = jax.device_put(_tree(), jax.devices("cpu")[0])  # on the CPU on any machine
    snap = async_save._snapshot(st.encode(tree))
    kernel = np.asarray(tree["params"]["dense"]["kernel"])
    assert not any(
        isinstance(c, memoryview) and np.shares_memory(np.frombuffer(c, np.uint8), kernel)
        for c in snap.chunks
    )
