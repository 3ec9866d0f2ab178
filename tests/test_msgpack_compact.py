"""msgpack's header-only reads (``slots``, ``inspect``) agree with ``decode``.

Both copy the framing into a compact buffer (array payloads cut out,
placeholders in their place) and parse that; their results must be
``decode``'s: the same arrays for valid files, a pytreeio error at the same
file offset for broken ones (fed the fuzzer's mutations).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import fuzz
import numpy as np
import pytest
from conftest import assert_same_tree

import pytreeio as ptio
from pytreeio import io
from pytreeio.core.binary import Slot
from pytreeio.formats import msgpack as mp


def _arrays(tree: Any, path: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """Each array leaf of a decoded tree by its key: (shape, dtype name)."""
    if isinstance(tree, dict):
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for k, v in tree.items():
            out.update(_arrays(v, f"{path}/{k}" if path else str(k)))
        return out
    if isinstance(tree, list):
        return _arrays({f"[{i}]": v for i, v in enumerate(tree)}, path)
    if isinstance(tree, np.ndarray | np.generic):
        return {path: (tree.shape, tree.dtype.name)}
    return {}


def outcomes(path: Path) -> tuple[Any, Any]:
    """``(decode, header-only)`` results for ``path``: the arrays found, or the error raised."""

    def run(read: Any) -> Any:
        try:
            return "ok", read()
        except ptio.PytreeioError as exc:
            return "refused", type(exc).__name__, getattr(exc, "offset", None)

    def header_only() -> Any:
        with io.FileSource(path) as src:
            tree = mp.slots(src).tree
            entries = mp.inspect(src).entries
        found = {e.name: (e.shape, e.dtype) for e in entries}
        slots = {}

        def walk(node: Any) -> None:
            if isinstance(node, Slot):
                slots[node.key] = (node.shape, node.dtype.name)
            elif isinstance(node, dict | list):
                for v in node.values() if isinstance(node, dict) else node:
                    walk(v)

        walk(tree)
        assert {k: found.get(k) for k in slots} == slots
        return slots

    return run(lambda: _arrays(mp.decode(path.read_bytes()).tree)), run(header_only)


def trees() -> list[Any]:
    rng = np.random.default_rng(5)
    return [
        {"params": {"w": rng.normal(size=(30, 20)).astype(np.float32), "b": np.arange(20)}},
        {"a": [np.float16(1.5), np.int8(-3), 2.5, "s", None, b"xy", 3 + 4j], "e": np.zeros(0)},
        {"big": np.arange(5000, dtype=np.float64), "deep": {"x": {"y": {"z": np.ones(3)}}}},
    ]


@pytest.mark.parametrize("index", range(3))
def test_header_only_reads_find_the_arrays_decode_finds(tmp_path: Path, index: int) -> None:
    path = tmp_path / "t.msgpack"
    tree = trees()[index]
    ptio.save(path, tree)
    full, header = outcomes(path)
    assert full[0] == "ok" and full == header
    chunked = tmp_path / "c.msgpack"  # flax's chunked arrays: their parts read as one
    ptio.save(chunked, tree, chunk_bytes=1000)
    full, header = outcomes(chunked)
    assert full == header
    with ptio.open(chunked) as view:  # a lazy view reads the arrays from the slots
        lazy = view.load()
    full_tree = mp.decode(chunked.read_bytes()).tree
    assert_same_tree(lazy, {k: lazy_order(full_tree[k], lazy[k]) for k in lazy})


def lazy_order(full: Any, lazy: Any) -> Any:
    """``full`` with its dicts' keys in ``lazy``'s order."""
    if isinstance(full, dict):
        return {k: lazy_order(full[k], lazy[k]) for k in lazy}
    return full


def test_broken_files_fail_alike_in_both_reads(tmp_path: Path) -> None:
    rng = random.Random(11)
    seeds = [mp.encode(t).tobytes() for t in trees()]
    counts = {"ok": 0, "refused": 0, "same offset": 0}
    for i in range(300):
        data, _ = fuzz.mutate(rng.choice(seeds), rng)
        path = tmp_path / f"m{i}.msgpack"
        path.write_bytes(data)  # type: ignore[arg-type]
        full, header = outcomes(path)
        counts[full[0]] += 1
        if full[0] == "ok":
            assert header == full, i
        else:  # the same kind of error; its offset where both parsers meet it
            assert header[:2] == full[:2], (i, full, header)
            counts["same offset"] += header == full
    print(counts)
    assert counts["ok"] and counts["refused"]
    assert counts["same offset"] >= 0.9 * counts["refused"]


def test_a_foreign_extension_with_the_placeholder_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.msgpack"
    path.write_bytes(b"\x81\xa1a\xd6\x7e\x00\x00\x00\x00")  # {'a': fixext4 of code 126}
    full, header = outcomes(path)
    assert full == header == ("refused", "FormatError", 4)
