"""The per-leaf fast paths of safetensors decoding and of restoring into `like`.

Each fast path hands anything unusual to the strict path; these tests check
that what the strict path refuses is still refused when the fast path could
have been fooled (repeated keys hidden by colons in strings or ``\\u``
escapes), and that the common trees still round-trip bit for bit.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.core import jsonsafe
from pytreeio.core.binary import BufferSource
from pytreeio.formats import safetensors as fmt_st


def _blob(header: str, data: bytes) -> bytes:
    text = header.encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _pytreeio_blob(entries: str, tree: str, data: bytes, meta: str | None = None) -> bytes:
    md: dict[str, str] = {"format": "pytreeio", "pytreeio.version": "1", "pytreeio.tree": tree}
    if meta is not None:
        md["pytreeio.meta"] = meta
    return _blob("{" + f'"__metadata__":{json.dumps(md)},' + entries + "}", data)


ESC = "\\u003a"  # a colon, escaped


def _entry(name: str, begin: int) -> str:
    return f'"{name}":{{"dtype":"F32","shape":[1],"data_offsets":[{begin},{begin + 4}]}}'


def test_colons_in_names_keys_strings_and_meta_round_trip(tmp_path: Path) -> None:
    tree = {
        "a:b": {"c::d": np.arange(3, dtype=np.float32), "url": "http://x:80/y"},
        "plain": [np.ones((2, 2), np.int64), "s"],
    }
    path = tmp_path / "t.safetensors"
    ptio.save(path, tree, meta={"note": "k:v", "n": {"x:y": 1}})
    back, meta = ptio.load_with_meta(path)
    assert meta == {"note": "k:v", "n": {"x:y": 1}}
    assert back["a:b"]["url"] == "http://x:80/y" and back["plain"][1] == "s"
    assert back["a:b"]["c::d"].tobytes() == tree["a:b"]["c::d"].tobytes()
    assert (
        back["plain"][0].dtype == np.int64
        and back["plain"][0].tobytes() == np.ones(4).astype(np.int64).tobytes()
    )
    like = ptio.load(path, like=tree)
    assert like["a:b"]["c::d"].tobytes() == tree["a:b"]["c::d"].tobytes()


def test_repeated_tensor_hidden_by_a_colon_in_a_name_is_refused() -> None:
    # The second "w" would replace the first; a name with one colon more than the
    # count needs does not make up for the lost member.
    entries = f"{_entry('w', 0)},{_entry('w', 4)}"
    blob = _blob("{" + entries + "}", b"\0" * 8)
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.decode(blob)
    entries = f"{_entry('w', 0)},{_entry('x:', 4)},{_entry('x:', 8)}"
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.decode(_blob("{" + entries + "}", b"\0" * 12))


def test_repeated_key_hidden_by_unicode_escaped_colons_is_refused() -> None:
    # Four escaped colons in a name parse as four colons the text does not show:
    # without the escape check they would balance the four members (the entry and
    # its three fields) that the repeated key drops.
    entries = f'{_entry("w", 0)},{_entry("w", 4)},"n{4 * ESC}":' + (
        '{"dtype":"F32","shape":[1],"data_offsets":[8,12]}'
    )
    blob = _blob("{" + entries + "}", b"\0" * 12)
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.decode(blob)
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.slots(BufferSource(blob))


def test_repeated_key_in_the_structure_document_is_refused_around_colon_keys() -> None:
    tree = '{"dict":[["k:1",{"leaf":"w"}]],"dict":[["k:1",{"leaf":"w"}]]}'
    blob = _pytreeio_blob(_entry("w", 0), tree, b"\0" * 4)
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.decode(blob)
    # A leaf object with a repeated "kind": the first would be silently dropped.
    tree = '{"leaf":"w","kind":"float","kind":"float"}'
    md = {"format": "pytreeio", "pytreeio.version": "1", "pytreeio.tree": tree}
    entry = '"w":{"dtype":"F64","shape":[],"data_offsets":[0,8]}'
    blob = _blob("{" + f'"__metadata__":{json.dumps(md)},' + entry + "}", b"\0" * 8)
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.decode(blob)


def test_header_out_of_offset_order_still_loads() -> None:
    # Other tools need not list tensors in data order: the strict path checks coverage.
    entries = f"{_entry('b', 4)},{_entry('a', 0)}"
    data = np.array([1.0, 2.0], np.float32).tobytes()
    out = fmt_st.decode(_blob("{" + entries + "}", data)).tree
    assert out["a"].tolist() == [1.0] and out["b"].tolist() == [2.0]
    with pytest.raises(ptio.FormatError, match="hole"):
        fmt_st.decode(_blob("{" + f"{_entry('b', 8)},{_entry('a', 0)}" + "}", data + data))


def test_unaligned_foreign_tensor_is_read_through_its_own_view() -> None:
    entries = (
        '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        '"b":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}'
    )
    data = b"\x07" + np.array([1.5, -2.0], np.float32).tobytes()
    out = fmt_st.decode(_blob("{" + entries + "}", data)).tree
    assert out["a"].tolist() == [7] and out["b"].tolist() == [1.5, -2.0]


def test_nan_in_a_header_is_refused_precisely() -> None:
    entries = '"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}'
    with pytest.raises(ptio.FormatError) as e:
        fmt_st.decode(_blob("{" + entries + "}", b"\0" * 4))
    assert e.value.field == "header"


def test_restore_names_the_key_and_keeps_like_order(tmp_path: Path) -> None:
    tree = {"p": {f"m{i}": {"w": np.full(4, i, np.float32)} for i in range(5)}}
    path = tmp_path / "t.safetensors"
    ptio.save(path, tree)
    like = {"p": {f"m{i}": {"w": np.zeros(4, np.float32)} for i in reversed(range(5))}}
    back = ptio.load(path, like=like)
    assert list(back["p"]) == list(like["p"])
    assert all(back["p"][f"m{i}"]["w"].tolist() == [i] * 4 for i in range(5))
    bad = {"p": {**like["p"], "m3": {"w": np.zeros(5, np.float32)}}}
    with pytest.raises(ptio.MismatchError) as e:
        ptio.load(path, like=bad)
    assert e.value.key_path == "p/m3/w"
    missing = {"p": {**like["p"], "m9": {"w": np.zeros(4, np.float32)}}}
    with pytest.raises(ptio.MismatchError) as e:
        ptio.load(path, like=missing)
    assert e.value.key_path == "p/m9"
    fewer = {"p": {k: v for k, v in like["p"].items() if k != "m2"}}
    with pytest.raises(ptio.MismatchError, match="m2"):
        ptio.load(path, like=fewer)


def test_restore_into_int_keyed_dicts_goes_the_general_way(tmp_path: Path) -> None:
    tree = {"p": {0: np.arange(2, dtype=np.float32), 1: {"w": np.ones(1, np.float32)}}}
    path = tmp_path / "t.msgpack"
    ptio.save(path, tree)
    back = ptio.load(path, like=tree)
    assert set(back["p"]) == {0, 1} and back["p"][0].tolist() == [0.0, 1.0]


# --------------------------------------------------------------------------
# the optional orjson header parser and its stdlib fallback
# --------------------------------------------------------------------------


@pytest.fixture(params=["orjson", "json"])
def json_parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with orjson (when installed) and with the stdlib fallback."""
    if request.param == "orjson":
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(jsonsafe, "orjson", None)
    return str(request.param)


def test_both_parsers_round_trip_and_refuse_repeated_keys(json_parser: str) -> None:
    tree = {"p": {f"m{i}": {"w": np.arange(i + 1, dtype=np.float32)} for i in range(4)}}
    back = fmt_st.decode(_bytes(tree)).tree
    assert all(back["p"][k]["w"].tobytes() == v["w"].tobytes() for k, v in tree["p"].items())
    entries = f"{_entry('w', 0)},{_entry('w', 4)}"
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.decode(_blob("{" + entries + "}", b"\0" * 8))
    nested = '{"dict":[["a",{"dict":[["k",{"leaf":"w"}]]}],["a",{"dict":[["k",{"leaf":"w"}]]}]]}'
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.decode(_pytreeio_blob(_entry("w", 0), nested, b"\0" * 4))


def test_int_keys_beyond_64_bits_load_exactly(json_parser: str, tmp_path: Path) -> None:
    # orjson reads such an int as a float: the rebuild refuses it and starts over strictly.
    big = 10**30 + 7
    tree = {big: {"w": np.ones(3, np.float32)}, -big: np.zeros(2, np.int8), 5: [1, "s:"]}
    path = tmp_path / "t.safetensors"
    ptio.save(path, tree)
    back = ptio.load(path)
    assert set(back) == {big, -big, 5} and type(next(iter(back))) is int
    assert back[big]["w"].tobytes() == tree[big]["w"].tobytes() and back[5] == [1, "s:"]


def test_nested_dict_fast_path_keeps_depth_and_order(json_parser: str) -> None:
    deep: dict[str, Any] = {"w": np.ones(1, np.float32)}
    for i in range(20):
        deep = {f"k{i}": deep, f"x{i}": np.full(1, i, np.int16)}
    back = fmt_st.decode(_bytes(deep)).tree
    assert list(back) == list(deep)
    node, want = back, deep
    for i in reversed(range(20)):
        assert node[f"x{i}"].tolist() == [i] and node[f"x{i}"].dtype == np.int16
        node, want = node[f"k{i}"], want[f"k{i}"]
    assert node["w"].tolist() == [1.0]
    # a nested dict past the depth bound is refused on the fast path too
    too_deep = '{"dict":[["a",' * 200 + '{"leaf":"w"}' + "]]}" * 200
    with pytest.raises(ptio.FormatError, match=r"deeper|nest"):
        fmt_st.decode(_pytreeio_blob(_entry("w", 0), too_deep, b"\0" * 4))


def _bytes(tree: Any) -> bytes:
    return b"".join(bytes(c) for c in ptio.encode(tree, format="safetensors").chunks)


@pytest.mark.parametrize("depth", [60, 900, 1000, 1020])
def test_a_structure_document_nested_past_the_interpreters_limit_is_a_format_error(
    depth: int, json_parser: str
) -> None:
    # orjson parses up to 1024 levels; a rebuild that reprs such a node in its error
    # message would recurse (found by the fuzzer): the strict parser must judge it.
    nested = "[" * depth + "]" * depth
    tree = '{"dict":[["w",' + nested + "]]}"
    blob = _pytreeio_blob(_entry("w", 0), tree, b"\0" * 4)
    with pytest.raises(ptio.FormatError) as err:
        ptio.decode(blob, format="safetensors")
    assert err.value.field == "pytreeio.tree" and err.value.offset is not None
