"""msgpack slots and inspect where no file-sized map can be made (an address-space limit).

``slots`` lays the framing out in an anonymous map of the file's size and
``inspect`` maps the file; under ``ulimit -v`` below the file's size both
fail with ENOMEM, and a compact copy of the framing (array payloads cut out,
placeholders in their place) is parsed instead.  Its results must be the
normal path's: the same slots and entries for valid files, a pytreeio error
at the same file offset for broken ones (both paths are fed the fuzzer's
mutations).
"""

from __future__ import annotations

import errno
import random
from pathlib import Path
from typing import Any

import fuzz
import numpy as np
import pytest
from conftest import assert_same_tree

import pytreeio as ptio
from pytreeio import io
from pytreeio.fmt import msgpack as mp
from pytreeio.registry import Slot


def _no_map(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOMEM, "Cannot allocate memory")


def both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """``(normal, compact)`` results of slots and inspect of ``path`` (or the error raised)."""

    def run() -> Any:
        try:
            with io.FileSource(path) as src:
                return "ok", slot_fields(mp.slots(src).tree), mp.inspect(src).entries
        except ptio.PytreeioError as exc:
            return "refused", type(exc).__name__, getattr(exc, "offset", None)

    normal = run()
    with monkeypatch.context() as m:
        m.setattr(mp._Sparse, "__init__", _no_map)
        m.setattr(io.FileSource, "view", _no_map)
        compact = run()
    return normal, compact


def slot_fields(tree: Any) -> Any:
    if isinstance(tree, Slot):
        return (tree.key, tree.offset, tree.nbytes, tree.shape, str(tree.dtype), tree.fortran)
    if isinstance(tree, dict):
        return {k: slot_fields(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [slot_fields(v) for v in tree]
    return tree


def trees() -> list[Any]:
    rng = np.random.default_rng(5)
    return [
        {"params": {"w": rng.normal(size=(30, 20)).astype(np.float32), "b": np.arange(20)}},
        {"a": [np.float16(1.5), np.int8(-3), 2.5, "s", None, b"xy", 3 + 4j], "e": np.zeros(0)},
        {"big": np.arange(5000, dtype=np.float64), "deep": {"x": {"y": {"z": np.ones(3)}}}},
    ]


@pytest.mark.parametrize("index", range(3))
def test_the_compact_parse_gives_the_same_slots_and_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    path = tmp_path / "t.msgpack"
    tree = trees()[index]
    ptio.save(path, tree)
    normal, compact = both(path, monkeypatch)
    assert normal[0] == "ok" and isinstance(normal[1], dict)
    assert compact == normal
    chunked = tmp_path / "c.msgpack"  # flax's chunked arrays: their parts read as one
    ptio.save(chunked, tree, chunk_bytes=1000)
    normal, compact = both(chunked, monkeypatch)
    assert compact == normal
    with monkeypatch.context() as m:  # and a lazy view reads the arrays from the placeholders
        m.setattr(mp._Sparse, "__init__", _no_map)
        with ptio.open(chunked) as view:
            lazy = view.load()
    with ptio.open(chunked) as view:
        assert_same_tree(lazy, view.load())


def test_broken_files_fail_alike_in_both_parses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(11)
    seeds = [mp.encode(t).tobytes() for t in trees()]
    outcomes = {"ok": 0, "refused": 0, "same offset": 0}
    for i in range(300):
        data, _ = fuzz.mutate(rng.choice(seeds), rng)
        path = tmp_path / f"m{i}.msgpack"
        path.write_bytes(data)  # type: ignore[arg-type]
        normal, compact = both(path, monkeypatch)
        outcomes[normal[0]] += 1
        if normal[0] == "ok":
            assert compact == normal, i
        else:  # the same kind of error; its offset where both parsers meet it
            assert compact[:2] == normal[:2], (i, normal, compact)
            outcomes["same offset"] += compact == normal
    print(outcomes)
    assert outcomes["ok"] and outcomes["refused"]
    assert outcomes["same offset"] >= 0.9 * outcomes["refused"]  # 228 of 234 when written


def test_a_foreign_extension_with_the_placeholder_code_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.msgpack"
    path.write_bytes(b"\x81\xa1a\xd6\x7e\x00\x00\x00\x00")  # {'a': fixext4 of code 126}
    normal, compact = both(path, monkeypatch)
    assert normal == compact == ("refused", "FormatError", 4)
