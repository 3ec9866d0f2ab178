"""safetensors' plain-nesting fast path: the document it writes from the names, and hostile ones.

The fast path builds the tree from the tensor names and writes its structure
document from that tree's compact JSON (see ``_nesting_document``); it must
take exactly the documents the general rebuild would build the same tree
from, whatever characters the keys hold, and leave every other document to
the rebuild (which reports it).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
from conftest import assert_same_tree

import pytreeio as ptio
from pytreeio import jsonsafe
from pytreeio.errors import FormatError
from pytreeio.fmt import safetensors as st


def _encoded(tree: Any) -> bytes:
    return ptio.encode(tree, format="safetensors").tobytes()


def _taken(data: bytes) -> bool:
    header = st._read_header(st.Reader(data), len(data))
    arrays = st._views(memoryview(data), 8 + header.n, header.entries)
    return st._plain_nesting(header.metadata[st._TREE_KEY], arrays) is not None


def _general(data: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        m.setattr(st, "_plain_nesting", lambda text, arrays: None)
        return st.decode(data).tree


def _arr(i: int, dt: Any = np.float32) -> np.ndarray:
    return np.full(2, i, dt)


# Keys spelling the JSON between two strings of the compact text (":{", ":", "},", "}")
# and other punctuation: the document is written from the strings, never confused by them.
PUNCTUATED = {
    ":{": {":": _arr(1), "}": _arr(2)},
    "},": {",": _arr(3), "}},": {"x": _arr(4, np.int8)}},
    "{": _arr(5, np.float64),
    "a:b,c}d{e": {"k:": _arr(6)},
    ",": {"]": _arr(7), "ok[": _arr(8)},
    "z": {"null": _arr(9), "false": _arr(10, np.uint16)},
}


def test_punctuated_keys_take_the_fast_path_and_match(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _encoded(PUNCTUATED)
    assert _taken(data)
    assert_same_tree(st.decode(data).tree, _general(data, monkeypatch))


@pytest.mark.parametrize("leaves", [1, 2, 3, 50])
@pytest.mark.parametrize("depth", [1, 2, 5])
def test_shapes_of_nesting_match_the_rebuild(
    leaves: int, depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(leaves * 10 + depth)
    tree: dict[str, Any] = {}
    for i in range(leaves):
        path = [f"k{rng.integers(3)}" for _ in range(rng.integers(1, depth + 1))]
        node = tree
        for c in path:
            nxt = node.get(c)
            if not isinstance(nxt, dict):
                if nxt is not None:
                    break
                nxt = node[c] = {}
            node = nxt
        else:
            node[f"leaf{i}"] = _arr(i, (np.float32, np.int16, np.float64)[i % 3])
    data = _encoded(tree)
    if tree:
        assert _taken(data)
    assert_same_tree(st.decode(data).tree, _general(data, monkeypatch))


def _blob(names: list[str], doc: Any) -> bytes:
    """A pytreeio file of one-float tensors ``names`` whose structure document is ``doc``."""
    md = {
        "format": "pytreeio",
        "pytreeio.version": "1",
        "pytreeio.tree": json.dumps(doc, separators=(",", ":")),
    }
    entries = ",".join(
        f'"{n}":{{"dtype":"F32","shape":[1],"data_offsets":[{4 * i},{4 * i + 4}]}}'
        for i, n in enumerate(names)
    )
    text = ("{" + f'"__metadata__":{json.dumps(md)},' + entries + "}").encode()
    text += b" " * (-len(text) % 8)
    data = np.arange(len(names), dtype=np.float32).tobytes()
    return struct.pack("<Q", len(text)) + text + data


def _leaf(name: str) -> dict[str, str]:
    return {"leaf": name}


def _dict(*items: Any) -> dict[str, Any]:
    return {"dict": [list(i) for i in items]}


@pytest.mark.parametrize(
    "doc",
    [
        # a leaf named for its parent's path: "a/b" is a leaf and a subtree at once
        _dict(("a", _dict(("b", _dict(("c", _leaf("a/b"))))))),
        _dict(("a", _dict(("b", _leaf("a/b/c"))))),
        _dict(("a", _dict(("b", _leaf("a/b")), ("b", _dict(("c", _leaf("a/b/c"))))))),
    ],
)
def test_a_leaf_and_a_subtree_under_one_key_are_left_to_the_rebuild(doc: Any) -> None:
    data = _blob(["a/b", "a/b/c"], doc)
    assert not _taken(data)
    with pytest.raises(FormatError) as err:
        st.decode(data)
    assert err.value.field is not None and err.value.offset is not None


def test_a_document_naming_the_tensors_in_another_order_is_rebuilt() -> None:
    # the same nesting with the two leaves' tensors swapped: not the names' own document
    doc = _dict(("a", _dict(("x", _leaf("b/y")))), ("b", _dict(("y", _leaf("a/x")))))
    data = _blob(["a/x", "b/y"], doc)
    assert not _taken(data)
    tree = st.decode(data).tree
    assert tree["a"]["x"].tolist() == [1.0] and tree["b"]["y"].tolist() == [0.0]


def test_names_that_cannot_nest_are_rebuilt_from_a_valid_document() -> None:
    doc = _dict(("a", _dict(("b", _leaf("a/b/c")), ("c", _leaf("a/b")))))
    data = _blob(["a/b", "a/b/c"], doc)
    assert not _taken(data)
    tree = st.decode(data).tree
    assert tree["a"]["b"].tolist() == [1.0] and tree["a"]["c"].tolist() == [0.0]


def test_the_names_own_document_is_taken() -> None:
    doc = _dict(("a", _dict(("x", _leaf("a/x")))), ("b", _dict(("y", _leaf("b/y")))))
    data = _blob(["a/x", "b/y"], doc)
    assert _taken(data)
    tree = st.decode(data).tree
    assert tree["a"]["x"].tolist() == [0.0] and tree["b"]["y"].tolist() == [1.0]


@pytest.mark.parametrize("json_lib", ["orjson", "json"])
def test_both_writers_of_the_compact_text_agree(
    json_lib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if json_lib == "orjson":
        pytest.importorskip("orjson")
        monkeypatch.setattr(jsonsafe, "_ORJSON", [])
    else:
        monkeypatch.setattr(jsonsafe, "_ORJSON", [None])
    data = _encoded(PUNCTUATED)
    assert _taken(data)
    assert_same_tree(st.decode(data).tree, _general(data, monkeypatch))
