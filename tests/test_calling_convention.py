"""One calling convention across the public surface (``pytreeio.__all__``).

The path (and the tree, for saves) is positional; everything else is keyword-only, the
format is ``format=`` everywhere (``to=``/``from_=`` for conversions), and a stray
positional argument is a ``TypeError`` that says which keyword was meant.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import multihost
from pytreeio.diff import diff

#: What each public function takes positionally: its subject and nothing else.
POSITIONAL = {
    "save": ["path", "tree"],
    "save_async": ["path", "tree"],
    "load": ["path"],
    "load_with_meta": ["path"],
    "open": ["path"],
    "inspect": ["path"],
    "verify": ["path"],
    "convert": ["src", "dst"],
    "encode": ["tree"],
    "decode": ["data"],
    "decode_with_meta": ["data"],
    "inspect_encoded": ["data"],
    "convert_encoded": ["data"],
    "wait_saves": [],
    "list_formats": [],
    "register": ["fmt"],
    "flatten": ["tree"],
    "unflatten": ["flat"],
}
#: The file functions and their in-memory twins: same options, ``format`` named the same.
TWINS = {
    "load": "decode",
    "load_with_meta": "decode_with_meta",
    "inspect": "inspect_encoded",
    "convert": "convert_encoded",
    "save": "encode",
}


def _public_functions() -> dict[str, Any]:
    return {n: getattr(ptio, n) for n in ptio.__all__ if inspect.isfunction(getattr(ptio, n))}


def _kinds(func: Any) -> tuple[list[str], list[str]]:
    params = inspect.signature(func).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    return positional, keyword


def test_every_public_function_is_in_the_table() -> None:
    assert set(_public_functions()) == set(POSITIONAL)


@pytest.mark.parametrize("name", sorted(POSITIONAL))
def test_only_the_subject_is_positional(name: str) -> None:
    func = getattr(ptio, name)
    positional, keyword = _kinds(func)
    assert positional == POSITIONAL[name]
    assert not any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(func).parameters.values())
    if name in ("convert", "convert_encoded"):
        assert {"to", "from_"} <= set(keyword)
    elif positional and name not in ("register", "flatten", "unflatten"):
        assert "format" in keyword, name


def test_diff_and_the_lazy_view_follow_it_too() -> None:
    assert _kinds(diff)[0] == ["a", "b"]
    assert _kinds(ptio.Checkpoint.load)[0] == ["self"]


@pytest.mark.parametrize(("file_fn", "memory_fn"), sorted(TWINS.items()))
def test_in_memory_twins_take_the_same_options(file_fn: str, memory_fn: str) -> None:
    only_files = {"mmap", "durable", "dst", "storage_options"}  # no meaning without a file system
    only_memory = {"dest"}  # the path an encoding is meant for (cl-waffe2 records it)
    file_kw = set(_kinds(getattr(ptio, file_fn))[1]) - only_files
    memory_kw = set(_kinds(getattr(ptio, memory_fn))[1]) - only_memory
    assert file_kw == memory_kw


def test_a_format_name_in_place_of_a_keyword_says_pass_format(tmp_path: Path) -> None:
    path = tmp_path / "a.msgpack"
    tree = {"w": np.arange(3, dtype=np.float32)}
    ptio.save(path, tree, format="msgpack")
    with pytest.raises(TypeError, match=r"pass format='msgpack'"):
        ptio.load(path, "msgpack")
    with pytest.raises(TypeError, match=r"pass format='msgpack'"):
        ptio.save(path, tree, "msgpack")
    with pytest.raises(TypeError, match=r"pass format='msgpack'"):
        ptio.inspect(path, "msgpack")
    with pytest.raises(TypeError, match=r"pass format='msgpack'"):
        ptio.decode(ptio.encode(tree, format="msgpack"), "msgpack")
    with pytest.raises(TypeError, match=r"pass to='safetensors'"):
        ptio.convert(path, tmp_path / "b.safetensors", "safetensors")
    with pytest.raises(TypeError, match=r"as like="):
        ptio.load(path, tree)
    with ptio.open(path) as ck, pytest.raises(TypeError, match=r"as like="):
        ck.load(tree)
    # nothing was written by the refused calls: the file still holds the first save
    assert np.array_equal(ptio.load(path, like=tree)["w"], tree["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.msgpack"]


def test_the_wrapped_functions_keep_their_names_and_docs() -> None:
    for name, func in _public_functions().items():
        assert func.__name__ == name
        assert func.__doc__, name


def test_format_specific_errors_live_under_their_format() -> None:
    from pytreeio.formats.netcl import NetclMissingParamError, NetclShapeMismatchError

    assert not hasattr(ptio, "NetclMissingParamError")
    assert issubclass(NetclMissingParamError, ptio.MismatchError)
    assert issubclass(NetclMissingParamError, KeyError)
    assert issubclass(NetclShapeMismatchError, ptio.MismatchError)


def test_load_with_meta_and_decode_with_meta_agree(tmp_path: Path) -> None:
    tree = {"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 2), np.int8)}
    like = {"b": np.zeros((2, 2), np.int8)}
    path = tmp_path / "t.safetensors"
    ptio.save(path, tree, meta={"step": "7"})
    got, meta = ptio.load_with_meta(path, like=like, partial=True)
    enc = ptio.encode(tree, format="safetensors", meta={"step": "7"})
    got2, meta2 = ptio.decode_with_meta(enc, format="safetensors", like=like, partial=True)
    assert meta["step"] == meta2["step"] == "7"
    assert set(got) == set(got2) == {"b"}
    assert got["b"].tobytes() == got2["b"].tobytes() == tree["b"].tobytes()
    with pytest.raises(TypeError, match="pass like="):
        ptio.decode(enc, format="safetensors", partial=True)


def test_an_encoding_of_the_wrong_shape_for_its_layout_is_a_type_error() -> None:
    params = {"w": np.ones((2, 3), np.float32)}
    encoded = ptio.encode([{"weight": params["w"], "bias": np.ones(3, np.float32)}],
                          format="netcl", meta={"config": ["Linear"]})  # fmt: skip
    assert ptio.decode(encoded, format="netcl")[0]["weight"].tobytes() == params["w"].tobytes()
    with pytest.raises(TypeError, match=r"format 'netcl' decodes a mapping of .*'model'"):
        ptio.decode(b"\x00" * 64, format="netcl")  # one buffer for a format of several files
    with pytest.raises(TypeError, match=r"not the path 'w.msgpack': load\(path\) reads a file"):
        ptio.decode("w.msgpack", format="msgpack")
    with pytest.raises(TypeError, match=r"format 'msgpack' decodes one buffer"):
        ptio.inspect_encoded({"a": b"\x80"}, format="msgpack")


@pytest.mark.parametrize(
    "name", sorted(n for n, pos in POSITIONAL.items() if pos and n != "flatten")
)
def test_every_function_explains_a_stray_positional(name: str) -> None:
    func = getattr(ptio, name)
    subjects = [object()] * len(POSITIONAL[name])  # refused before any argument is looked at
    keywords = _kinds(func)[1]
    want = "pass format='msgpack'" if "format" in keywords else "pass to='msgpack'"
    if "format" not in keywords and "to" not in keywords:
        want = "by keyword"
    with pytest.raises(TypeError, match=want):
        func(*subjects, "msgpack")


def test_diff_and_save_in_parts_explain_it_too() -> None:
    with pytest.raises(TypeError, match="takes a and b positionally"):
        diff("a", "b", "msgpack")
    with pytest.raises(TypeError, match="pass format='msgpack'"):
        multihost.save_in_parts("p", {}, "msgpack")


def test_a_string_like_is_refused_with_advice(tmp_path: Path) -> None:
    path = tmp_path / "a.msgpack"
    tree = {"w": np.arange(3, dtype=np.float32)}
    ptio.save(path, tree)
    encoded = ptio.encode(tree, format="msgpack")
    calls = [
        lambda: ptio.load(path, like="msgpack"),
        lambda: ptio.load_with_meta(path, like="msgpack", partial=True),
        lambda: ptio.decode(encoded, format="msgpack", like="msgpack"),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"not the string 'msgpack'.*format="):
            call()
    with ptio.open(path) as ck, pytest.raises(TypeError, match="not the string"):
        ck.load(like="msgpack")
