"""The cheap checks on a load's path: numpy-only templates, and each file probed once per sniff."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import api, io, registry
from pytreeio.restore_fast import host_only

# --------------------------------------------------------------------------
# host_only: a template holding no jax array skips jax's flatten
# --------------------------------------------------------------------------


@dataclasses.dataclass
class _Box:
    w: Any


class _Sub(dict):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    "tree",
    [
        {"a": {"b": np.zeros(2)}, "c": np.ones(3, np.int8)},
        {"a": [np.zeros(2), (np.ones(1),)], "n": None, "s": "x", "i": 3, "f": 1.5},
        {},
        [],
        np.zeros(2),  # a bare array
    ],
    ids=repr,
)
def test_numpy_only_templates_are_recognised(tree: Any) -> None:
    assert host_only(tree)


@pytest.mark.parametrize(
    "tree",
    [
        {"a": np.float32(1)},  # a numpy scalar is not an array
        {"a": np.zeros(2).view(np.matrix)},  # nor is a subclass
        {1: np.zeros(2)},  # keys orjson does not write
        {"a": _Box(np.zeros(2))},  # a dataclass (a pytree node or a leaf: unknown)
        {"a": _Sub(w=np.zeros(2))},
        {"a": collections.OrderedDict(w=np.zeros(2))},
        {"a": object()},
    ],
    ids=[
        "npscalar",
        "subclass",
        "int-key",
        "dataclass",
        "dict-subclass",
        "ordered",
        "object",
    ],
)
def test_anything_else_is_unknown(tree: Any) -> None:
    assert not host_only(tree)


def test_jax_templates_still_ask_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    jax = pytest.importorskip("jax")
    asked: list[Any] = []
    from pytreeio import sharding

    def wants_slices(like: Any) -> bool:
        asked.append(like)
        return False

    monkeypatch.setattr(sharding, "wants_slices", wants_slices)
    plain = {"a": np.zeros(2)}
    assert not api._sharded(plain) and asked == []
    on_device = {"a": jax.numpy.zeros(2)}
    assert not api._sharded(on_device) and asked == [on_device]
    struct = {"a": jax.ShapeDtypeStruct((2,), np.float32)}
    assert not api._sharded(struct) and asked[-1] is struct


def test_loads_into_numpy_templates_are_unchanged_with_jax_loaded(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    tree = {"p": {f"m{i}": {"w": np.full(3, i, np.float32)} for i in range(5)}}
    for fmt in ("safetensors", "msgpack"):
        path = tmp_path / f"t.{fmt}"
        ptio.save(path, tree)
        back = ptio.load(path, like=tree)
        assert list(back["p"]) == list(tree["p"])
        assert all(back["p"][k]["w"].tobytes() == v["w"].tobytes() for k, v in tree["p"].items())


# --------------------------------------------------------------------------
# io.probe(made=): one probe of the file for every layout, the same probes
# --------------------------------------------------------------------------


def _layouts() -> list[registry.Layout]:
    out: list[registry.Layout] = []
    for fmt in registry.iter_formats():
        if fmt.layout not in out:
            out.append(fmt.layout)
    return out


@pytest.mark.parametrize("what", ["file", "dir", "missing", "npz"])
def test_shared_probes_equal_fresh_ones(what: str, tmp_path: Path) -> None:
    tree = {"w": np.arange(4, dtype=np.float32)}
    if what == "file":
        path = tmp_path / "t.safetensors"
        ptio.save(path, tree)
    elif what == "dir":
        path = tmp_path / "d"
        path.mkdir()
        (path / "a.json").write_text("{}")
    elif what == "npz":
        path = tmp_path / "ckpt.npz"
        np.savez(path, w=tree["w"])
        (tmp_path / "ckpt.json").write_text("{}")
    else:
        path = tmp_path / "nope"
    made: dict[Path, registry.Probe] = {}
    for layout in _layouts():
        assert io.probe(path, layout, made=made) == io.probe(path, layout)
    assert all(p.kind in {"file", "missing", "dir"} for p in made.values())


def test_sniffing_probes_the_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.safetensors"
    ptio.save(path, {"w": np.zeros(2, np.float32)})
    calls: list[Path] = []
    real = io._probe_file

    def counted(p: Path) -> registry.Probe:
        calls.append(p)
        return real(p)

    monkeypatch.setattr(io, "_probe_file", counted)
    assert api._format_for_load(path, None).name == "safetensors"
    assert calls.count(Path(path)) == 1
