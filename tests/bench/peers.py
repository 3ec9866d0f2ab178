"""The peer libraries, each as a save and a load of the benchmark's tree (numpy leaves).

Every peer writes into its own case directory (``dest`` inside it) and loads
into fresh arrays, with the tree as ``like`` where the library needs one.
A peer that is not installed is left out (:func:`available`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Peer:
    name: str
    module: str  # what must be importable
    dest: str
    save: Callable[[Path, Any], None]
    load: Callable[[Path, Any], Any]
    note: str = ""


def _flat(tree: Any) -> dict[str, np.ndarray]:
    import pytreeio as ptio

    return {k: np.asarray(v) for k, v in ptio.flatten(tree).items()}


def _write(path: Path, data: bytes, durable: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())


def flax_save(path: Path, tree: Any, durable: bool = False) -> None:
    from flax import serialization

    _write(path, serialization.to_bytes(tree), durable)


def flax_load(path: Path, like: Any) -> Any:
    from flax import serialization

    return serialization.from_bytes(like, path.read_bytes())


def safetensors_save(path: Path, tree: Any) -> None:
    from safetensors.numpy import save_file

    save_file(_flat(tree), str(path))


def safetensors_load(path: Path, like: Any) -> Any:
    from safetensors.numpy import load_file

    return load_file(str(path))


def savez_save(path: Path, tree: Any) -> None:
    np.savez(path, **_flat(tree))


def savez_load(path: Path, like: Any) -> Any:
    with np.load(path) as z:  # NpzFile reads members lazily: read them all
        return {k: z[k] for k in z.files}


def equinox_save(path: Path, tree: Any) -> None:
    import equinox as eqx

    eqx.tree_serialise_leaves(path, tree)


def equinox_load(path: Path, like: Any) -> Any:
    import equinox as eqx

    return eqx.tree_deserialise_leaves(path, like)


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

    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), like)
    return jax.block_until_ready(_checkpointer().restore(path.absolute(), abstract))


PEERS = [
    Peer("flax.serialization", "flax", "tree.msgpack", flax_save, flax_load, "to_bytes/from_bytes"),
    Peer("orbax", "orbax.checkpoint", "ckpt", orbax_save, orbax_load, "StandardCheckpointer"),
    Peer(
        "safetensors.numpy",
        "safetensors",
        "tree.safetensors",
        safetensors_save,
        safetensors_load,
        "save_file/load_file",
    ),
    Peer("np.savez", "numpy", "tree.npz", savez_save, savez_load, "np.savez/np.load"),
    Peer(
        "equinox",
        "equinox",
        "tree.eqx",
        equinox_save,
        equinox_load,
        "tree_serialise_leaves/tree_deserialise_leaves",
    ),
]


def available() -> list[Peer]:
    return [p for p in PEERS if importlib.util.find_spec(p.module.split(".")[0]) is not None]
