"""safetensors' plain-nesting fast path builds exactly the tree the structure document's rebuild does."""

from __future__ import annotations

import collections
import json
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.errors import FormatError
from pytreeio.fmt import safetensors as st


def _encoded(tree: Any) -> bytes:
    return ptio.encode(tree, format="safetensors").tobytes()


def _general(data: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        m.setattr(st, "_plain_nesting", lambda text, arrays: None)
        return st.decode(data).tree


def _assert_same(a: Any, b: Any) -> None:
    if hasattr(type(a), "_fields"):  # each decode makes its own namedtuple class
        assert type(a)._fields == type(b)._fields and type(a).__name__ == type(b).__name__
    else:
        assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
        assert a == b


def _taken(data: bytes) -> bool:
    """Whether the fast path builds this file's tree."""
    header = st._read_header(st.Reader(data), len(data))
    arrays = st._views(memoryview(data), 8 + header.n, header.entries)
    return st._plain_nesting(header.metadata[st._TREE_KEY], arrays) is not None


PLAIN = {
    "params": {
        "b-c": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
        "b": {"bias": np.arange(3, dtype=np.float16), "w": np.ones((3, 1), np.float64)},
        "a": {"deep": {"x": {"y": np.array(5, np.int8)}}},
    },
    "top": np.arange(4, dtype=np.uint8),
    "a:b c": np.zeros(2, np.int32),
}


def test_plain_tree_takes_the_fast_path_and_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _encoded(PLAIN)
    assert _taken(data)  # mixed item sizes: header order differs from the tree's
    _assert_same(st.decode(data).tree, _general(data, monkeypatch))


@pytest.mark.parametrize(
    "tree",
    [
        {"a": [np.zeros(2, np.float32)]},
        {"a": (np.zeros(2, np.float32),)},
        {"a": collections.namedtuple("nt", "x")(np.zeros(2, np.float32))},
        {"a": None, "b": np.zeros(2, np.float32)},
        {"a": 1.5, "b": np.zeros(2, np.float32)},
        {"a": "text", "b": np.zeros(2, np.float32)},
        {"a": {}, "b": np.zeros(2, np.float32)},
        {"[x": np.zeros(2, np.float32)},
        {"#x": np.zeros(2, np.float32)},
        {"": np.zeros(2, np.float32)},
        {"a/b": np.zeros(2, np.float32)},
        {'q"uote': np.zeros(2, np.float32)},
        {"naïve": np.zeros(2, np.float32)},
        {"tab\there": np.zeros(2, np.float32)},
        {3: np.zeros(2, np.float32), 1: np.zeros(1, np.float32)},
        np.zeros(3, np.float32),
    ],
    ids=repr,
)
def test_other_trees_decline_and_still_round_trip(
    tree: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _encoded(tree)
    assert not _taken(data)
    _assert_same(st.decode(data).tree, _general(data, monkeypatch))


def _rewrite_tree_doc(data: bytes, change: Any) -> bytes:
    """``data`` with its structure document replaced by ``change(document)``."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    doc = json.loads(header["__metadata__"][st._TREE_KEY])
    header["__metadata__"][st._TREE_KEY] = json.dumps(change(doc), separators=(",", ":"))
    header["__metadata__"].pop(st._SUM_KEY, None)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


def test_a_document_nesting_names_differently_is_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _encoded({"a": {"x": np.zeros(2, np.float32)}, "b": np.ones(2, np.float32)})

    def swap(doc: Any) -> Any:  # the keys no longer spell the names
        (ka, va), (kb, vb) = doc["dict"]
        return {"dict": [[kb, va], [ka, vb]]}

    changed = _rewrite_tree_doc(data, swap)
    assert not _taken(changed)
    tree = st.decode(changed).tree
    assert list(tree) == ["b", "a"] and tree["a"].tolist() == [1.0, 1.0]
    assert tree["b"]["x"].tolist() == [0.0, 0.0]


def test_a_document_leaving_a_tensor_out_is_still_refused() -> None:
    data = _encoded({"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)})
    changed = _rewrite_tree_doc(data, lambda doc: {"dict": doc["dict"][:1]})
    with pytest.raises(FormatError, match="not referenced"):
        st.decode(changed)


def test_too_deep_names_are_left_to_the_rebuild() -> None:
    names = {"/".join(["d"] * (st.MAX_TREE_DEPTH + 1)): np.zeros(1, np.float32)}
    assert st._plain_nesting("", names) is None
