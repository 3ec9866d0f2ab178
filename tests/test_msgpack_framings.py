"""The msgpack decoder's per-leaf paths: inline one-array maps and remembered framings.

Each path hands anything unusual to the general parser; these tests check
the common trees round-trip bit for bit against flax's own encoder, and that
a remembered framing never accepts what the general parser refuses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.fmt import msgpack as fmt_mp


def _bytes(tree: Any) -> bytes:
    return b"".join(bytes(c) for c in ptio.encode(tree, format="msgpack").chunks)


SHAPES = [(3,), (200,), (70000,), (2, 3), (300, 2), (1, 1, 1, 5), (2,) * 6]


@pytest.mark.parametrize("dtype", ["float32", "int8", "uint16", "float64", "bool"])
def test_modules_of_one_array_round_trip_as_flax_writes_them(dtype: str) -> None:
    rng = np.random.default_rng(0)
    tree = {
        "params": {
            f"m{i}": {"kernel": (rng.standard_normal(s) * 50).astype(dtype)}
            for i, s in enumerate(SHAPES * 2)  # each framing twice: parsed, then remembered
        }
    }
    blob = _bytes(tree)
    flax_ser = pytest.importorskip("flax.serialization")
    assert blob == flax_ser.to_bytes(tree)
    for _ in range(2):
        back = fmt_mp.decode(blob).tree
        for k, module in tree["params"].items():
            got, v = back["params"][k]["kernel"], module["kernel"]
            assert got.dtype == v.dtype and got.shape == v.shape
            assert got.tobytes() == v.tobytes()


def test_inspect_and_slots_take_the_same_paths(tmp_path: Any) -> None:
    tree = {"p": {f"m{i}": {"w": np.full((2, 3), i, np.float32)} for i in range(5)}}
    path = tmp_path / "t.msgpack"
    ptio.save(path, tree)
    info = ptio.inspect(path)
    assert sorted(e.name for e in info.entries) == [f"p/m{i}/w" for i in range(5)]
    assert all(e.shape == (2, 3) and e.dtype == "float32" for e in info.entries)
    back = ptio.load(path, like=tree, partial=True)
    assert back["p"]["m3"]["w"].tobytes() == tree["p"]["m3"]["w"].tobytes()


def test_repeated_keys_around_one_array_maps_are_refused() -> None:
    blob = _bytes({"a": {"w": np.ones(4, np.float32)}, "b": {"w": np.ones(4, np.float32)}})
    dup = blob.replace(b"\xa1b", b"\xa1a", 1)  # the outer keys now repeat
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_mp.decode(dup)
    inner = _bytes({"a": {"w": np.ones(4, np.float32), "v": np.ones(4, np.float32)}})
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_mp.decode(inner.replace(b"\xa1v", b"\xa1w", 1))


def test_a_remembered_framing_still_checks_the_file_end() -> None:
    blob = _bytes({"a": {"w": np.arange(64, dtype=np.float32)}})
    fmt_mp.decode(blob)  # the framing is now remembered
    for cut in (1, 100, 200):
        with pytest.raises(ptio.FormatError):
            fmt_mp.decode(blob[:-cut])


def test_markers_and_nested_maps_leave_the_inline_path() -> None:
    # A one-item map keyed by flax's chunked-array marker is not a module of one array.
    big = np.arange(40, dtype=np.float32)
    blob = b"".join(
        bytes(c) for c in ptio.encode({"m": {"w": big}}, format="msgpack", chunk_bytes=64).chunks
    )
    back = fmt_mp.decode(blob).tree
    assert back["m"]["w"].tobytes() == big.tobytes()
    nested = {"a": {"b": {"c": {"w": np.ones(2, np.int32)}}}, "s": {"x": 3}}
    back = fmt_mp.decode(_bytes(nested)).tree
    assert back["a"]["b"]["c"]["w"].tolist() == [1, 1] and back["s"] == {"x": 3}


def test_framing_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fmt_mp, "_FRAMINGS", {})
    monkeypatch.setattr(fmt_mp, "_FRAMING_LENGTHS", ())
    monkeypatch.setattr(fmt_mp, "_MAX_FRAMINGS", 8)
    tree = {f"m{i}": {"w": np.zeros((i + 1, 2), np.float32)} for i in range(30)}
    back = fmt_mp.decode(_bytes(tree)).tree
    assert all(back[f"m{i}"]["w"].shape == (i + 1, 2) for i in range(30))
    assert len(fmt_mp._FRAMINGS) == 8
    assert len(fmt_mp._FRAMING_LENGTHS) <= fmt_mp._MAX_LENGTHS
