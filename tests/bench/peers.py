"""The peer libraries, each as a save and a load of the benchmark's tree (numpy leaves).

A load with ``like=None`` needs no tree (what a first load in a fresh process
has): flax restores the msgpack state dict, orbax the saved structure.  A peer
that is not installed is left out (:func:`available`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cases import flat


@dataclass(frozen=True)
class Peer:
    name: str
    module: str  # imported before a load is timed
    dest: str
    layout: str
    save: Callable[[Path, Any], None]
    load: Callable[[Path, Any], Any]


def flax_save(path: Path, tree: Any, durable: bool = False) -> None:
    from flax import serialization

    with open(path, "wb") as f:
        f.write(serialization.to_bytes(tree))
        if durable:
            f.flush()
            os.fsync(f.fileno())


def flax_load(path: Path, like: Any) -> Any:
    from flax import serialization

    data = path.read_bytes()
    return (
        serialization.msgpack_restore(data)
        if like is None
        else serialization.from_bytes(like, data)
    )


def safetensors_save(path: Path, tree: Any) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v) for k, v in flat(tree).items()}, str(path))


def safetensors_load(path: Path, like: Any) -> Any:
    from safetensors.numpy import load_file

    return load_file(str(path))


_orbax: dict[str, Any] = {}


def _checkpointer() -> Any:
    if "ckptr" not in _orbax:
        import orbax.checkpoint as ocp

        _orbax["ckptr"] = ocp.StandardCheckpointer()
    return _orbax["ckptr"]


def orbax_save(path: Path, tree: Any) -> None:
    ckptr = _checkpointer()
    ckptr.save(path.absolute(), tree, force=True)
    ckptr.wait_until_finished()


def orbax_load(path: Path, like: Any) -> Any:
    import jax

    if like is None:
        return jax.block_until_ready(_checkpointer().restore(path.absolute()))
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), like)
    return jax.block_until_ready(_checkpointer().restore(path.absolute(), abstract))


PEERS = [
    Peer(
        "safetensors.numpy",
        "safetensors.numpy",
        "tree.safetensors",
        "file",
        safetensors_save,
        safetensors_load,
    ),
    Peer("flax.serialization", "flax.serialization", "tree.msgpack", "file", flax_save, flax_load),
    Peer("orbax", "orbax.checkpoint", "ckpt", "directory", orbax_save, orbax_load),
]


def available() -> list[Peer]:
    return [p for p in PEERS if importlib.util.find_spec(p.module.split(".")[0]) is not None]
