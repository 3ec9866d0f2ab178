"""Format safetensors: interoperability with the safetensors package, round trips, hostile input."""

from __future__ import annotations

import contextlib
import json
import random
import struct
from collections import namedtuple
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors.flax
import safetensors.numpy
from conftest import assert_bits_equal, trees
from hypothesis import given
from safetensors import safe_open

import pytreeio as ptio
from pytreeio.formats import safetensors as fmt_st


def _sample() -> dict[str, Any]:
    params = {
        "dense": {
            "kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
            "bias": np.ones(4, ml_dtypes.bfloat16),
        }
    }
    return {
        "params": params,
        "opt_state": optax.adam(1e-3).init(params),
        "layers": [np.int8(3), (np.zeros((0, 2), np.float16), None)],
        "ids": {3: np.arange(3, dtype=np.uint64), -1: np.array(True)},
        "step": 7,
        "lr": 1e-3,
        "on": False,
        "name": "a/b\\c",
    }


def test_safetensors_package_reads_pytreeio_files(tmp_path: Path) -> None:
    tree = _sample()
    path = tmp_path / "x.safetensors"
    ptio.save(path, tree, meta={"epoch": 2})
    flat = ptio.flatten(tree)
    with safe_open(str(path), framework="numpy") as f, safe_open(str(path), framework="flax") as fj:
        names = set(f.keys())
        assert names == {k for k, v in flat.items() if not isinstance(v, str)}
        for name in names:
            want = np.asarray(flat[name])
            # numpy has no bfloat16; the flax reader has it (but no int64 without x64)
            got = np.asarray(
                fj.get_tensor(name) if want.dtype == ml_dtypes.bfloat16 else f.get_tensor(name)
            )
            assert (
                got.dtype == want.dtype
                and got.shape == want.shape
                and got.tobytes() == want.tobytes()
            )
        md = f.metadata()
    assert md["format"] == "pytreeio" and json.loads(md["pytreeio.meta"]) == {"epoch": 2}


def test_pytreeio_reads_safetensors_package_files(tmp_path: Path) -> None:
    tensors = {
        "model.embed": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
        "model.norm": jnp.ones(3),
        "ids": jnp.arange(4, dtype=jnp.int32),
    }
    path = tmp_path / "hf.safetensors"
    safetensors.flax.save_file(tensors, str(path), metadata={"source": "elsewhere"})
    tree = ptio.load(path)
    assert set(tree) == set(tensors)
    for k, v in tensors.items():
        assert tree[k].dtype == v.dtype and np.asarray(v).tobytes() == tree[k].tobytes()
    info = ptio.inspect(path)
    assert info.meta == {"source": "elsewhere"} and info.nbytes == sum(
        np.asarray(v).nbytes for v in tensors.values()
    )
    # and the numpy flavour, byte for byte identical data section
    blob = safetensors.numpy.save({"a": np.arange(5, dtype=np.int64)})
    assert ptio.decode(blob, format="safetensors")["a"].tolist() == [0, 1, 2, 3, 4]


def test_round_trip_with_and_without_like() -> None:
    tree = _sample()
    blob = ptio.encode(tree, format="safetensors").tobytes()
    back = ptio.decode(blob, format="safetensors")
    assert (
        back["opt_state"][0]._fields == ("count", "mu", "nu")
        and type(back["opt_state"][0]).__name__ == "ScaleByAdamState"
    )
    assert (
        back["layers"][1][1] is None
        and isinstance(back["layers"][1], tuple)
        and back["name"] == "a/b\\c"
    )
    assert type(back["step"]) is int and type(back["lr"]) is float and back["on"] is False
    assert isinstance(back["layers"][0], np.int8)
    restored = ptio.decode(blob, format="safetensors", like=tree)
    assert type(restored["opt_state"][0]) is optax.ScaleByAdamState
    assert_bits_equal(tree, restored)


@given(trees())
def test_hypothesis_round_trip_bit_for_bit(tree: Any) -> None:
    blob = ptio.encode(tree, format="safetensors").tobytes()
    assert_bits_equal(tree, ptio.decode(blob, format="safetensors"))
    if tree is not None:
        assert_bits_equal(tree, ptio.decode(blob, format="safetensors", like=tree))


def test_tensors_are_aligned_to_their_itemsize() -> None:
    tree = {
        "a": np.ones(3, np.bool_),
        "b": np.ones(3, np.float64),
        "c": np.ones(1, np.int16),
        "d": np.ones(5, np.float32),
    }
    blob = ptio.encode(tree, format="safetensors").tobytes()
    n = struct.unpack("<Q", blob[:8])[0]
    assert n % 8 == 0
    header = json.loads(blob[8 : 8 + n])
    for name, arr in tree.items():
        assert (8 + n + header[name]["data_offsets"][0]) % arr.dtype.itemsize == 0


def test_inspect_reads_only_the_header(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    ptio.save(path, {"w": np.ones((512, 512), np.float32)}, meta={"k": "v"})
    from pytreeio.io import FileSource

    src = FileSource(path)
    info = fmt_st.inspect(src)
    assert src.bytes_read < 1024
    assert [(e.name, e.shape, e.dtype) for e in info.entries] == [("w", (512, 512), "float32")]
    assert info.meta == {"k": "v"}


# ---------------------------------------------------------------- hostile input


def _blob(header: dict[str, Any], data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    ("blob", "field"),
    [
        (struct.pack("<Q", 2**62) + b"{}", "header length"),
        (struct.pack("<Q", fmt_st.MAX_HEADER_BYTES + 1) + b"{" + b" " * 10, "header length"),
        (
            _blob(
                {"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}, b"\0" * 4
            ),
            "a",
        ),
        (_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "a"),
        (_blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "a"),
        (
            _blob(
                {
                    "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                },
                b"\0" * 4,
            ),
            "b",
        ),
        (_blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 6), "data"),
        (_blob({"a": {"dtype": "OBJ", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "a"),
        (_blob({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "a"),
        (_blob({"__metadata__": {"x": 1}}), "__metadata__"),
        (
            _blob(
                {
                    "__metadata__": {
                        "format": "pytreeio",
                        "pytreeio.version": "1",
                        "pytreeio.tree": '{"leaf": "zz"}',
                    }
                }
            ),
            "pytreeio.tree",
        ),
        (struct.pack("<Q", 4) + b"[1] ", "header"),
        (struct.pack("<Q", 8) + b'{"a":1,"a":2}'[:8], "header"),
    ],
)
def test_malformed_headers_raise_format_error(blob: bytes, field: str) -> None:
    with pytest.raises(ptio.FormatError) as e:
        ptio.decode(blob, format="safetensors")
    assert e.value.field == field and e.value.offset is not None


def test_truncation_at_every_offset_raises_format_error() -> None:
    blob = ptio.encode(
        {"w": np.arange(6, dtype=np.float32), "n": 2, "t": (np.ones(1, np.int8),)},
        format="safetensors",
    ).tobytes()
    for cut in range(len(blob)):
        with pytest.raises(ptio.FormatError):
            ptio.decode(blob[:cut], format="safetensors")


def test_random_byte_flips_raise_only_pytreeio_errors() -> None:
    blob = ptio.encode(
        {"w": np.arange(6, dtype=np.float32), "n": 2, "t": (np.ones(1, np.int8),)},
        format="safetensors",
    ).tobytes()
    rng = random.Random(99)
    for _ in range(2000):
        data = bytearray(blob)
        data[rng.randrange(len(data))] = rng.randrange(256)
        with contextlib.suppress(ptio.PytreeioError):
            ptio.decode(bytes(data), format="safetensors")


def test_unsupported_leaves_raise_encode_error() -> None:
    with pytest.raises(ptio.EncodeError, match="complex"):
        ptio.encode({"c": 1j}, format="safetensors")
    with pytest.raises(ptio.EncodeError) as e:
        ptio.encode({"a": [np.ones(2, np.complex64)]}, format="safetensors")
    assert e.value.key_path == "a/[0]"
    with pytest.raises(ptio.EncodeError, match="reserved"):
        ptio.encode({"__metadata__": np.ones(1)}, format="safetensors")


def test_namedtuple_without_like_keeps_name_and_fields() -> None:
    P = namedtuple("P", ["x", "y"])
    back = ptio.decode(ptio.encode(P(np.ones(1), 2), format="safetensors"), format="safetensors")
    assert type(back).__name__ == "P" and back.x.tolist() == [1.0] and back.y == 2


def test_registry_record_v2() -> None:
    from pytreeio.core.records import FILE, MAGIC, STRUCTURE, Probe

    fmt = fmt_st.FORMAT
    assert fmt.layout is FILE and fmt.accepts_meta and fmt.keeps_meta
    assert fmt.save_options == {"checksum"} and fmt.load_options == {"verify"}
    blob = ptio.encode({"w": np.ones(2)}, format="safetensors").tobytes()
    assert fmt.sniff(Probe(Path("x"), head=blob[:4096], size=len(blob))) == MAGIC
    other = struct.pack("<Q", 8) + b'{"a":1} ' + b"\0" * 8
    assert fmt.sniff(Probe(Path("x"), head=other, size=len(other))) == STRUCTURE
    assert fmt.sniff(Probe(Path("x"), head=struct.pack("<Q", 99) + b"{", size=20)) == 0
    assert fmt.sniff(Probe(Path("d"), kind="dir")) == 0


def test_json_documents_are_parsed_with_bounds() -> None:
    md = {
        "format": "pytreeio",
        "pytreeio.version": "1",
        "pytreeio.tree": '{"list": [null, null]}',
    }
    blob = _blob({"__metadata__": {**md, "pytreeio.meta": '{"a": [1, {"b": null}]}'}})
    tree, meta = fmt_st.decode(blob)
    assert tree == [None, None] and meta == {"a": [1, {"b": None}]}
    for bad in ('{"a": NaN}', '{"a": 1, "a": 2}', '{"a": ' + "[" * 500 + "]" * 500 + "}"):
        with pytest.raises(ptio.FormatError) as e:
            fmt_st.decode(_blob({"__metadata__": {**md, "pytreeio.meta": bad}}))
        assert e.value.field == "pytreeio.meta" and e.value.offset == 8


def _raw_blob(header: str, data: bytes) -> bytes:
    text = header.encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


_W = '"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
_W_TWICE = '"w":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}'
_DICT_TWICE = '{"dict":[["a",{"leaf":"w"}]],"dict":[["a",{"leaf":"w"}]]}'


@pytest.mark.parametrize(
    ("header", "tree"),
    [
        (f"{_W},{_W}", '{"leaf":"w"}'),  # a tensor named twice (the second would win)
        (_W_TWICE, '{"leaf":"w"}'),  # a field repeated inside a tensor entry
        (_W, '{"leaf":"w","leaf":"w"}'),  # repeated in the structure document: a leaf
        (_W, _DICT_TWICE),  # ... and a dict node
    ],
)
def test_repeated_json_keys_are_refused(header: str, tree: str) -> None:
    from pytreeio.core.binary import BufferSource

    def blob_of(header: str, tree: str) -> bytes:
        md = json.dumps({"format": "pytreeio", "pytreeio.version": "1", "pytreeio.tree": tree})
        return _raw_blob("{" + f'"__metadata__":{md},' + header + "}", b"\0" * 4)

    blob = blob_of(header, tree)
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.decode(blob)
    with pytest.raises(ptio.FormatError, match="duplicate"):
        fmt_st.slots(BufferSource(blob))
    assert fmt_st.decode(blob_of(_W, '{"leaf":"w"}')).tree.tolist() == [0.0]


def test_hashing_while_writing_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # large trees are hashed on other threads while written, the header last: same file
    from pytreeio.core.binary import Deferred

    rng = np.random.default_rng(4)
    tree = {
        "a": rng.standard_normal((300, 17)).astype(np.float32),
        "b": {"c": np.arange(5, dtype=np.int64), "empty": np.zeros((0, 3), np.float16)},
        "d": rng.standard_normal(33).astype(ml_dtypes.bfloat16),
        "e": np.float64(2.5),
        "f": [np.ones(7000, np.uint8), np.array(True)],
    }
    inline = fmt_st.encode(tree, meta={"x": 1})
    assert not any(isinstance(c, Deferred) for c in inline.chunks)  # a small tree: header first
    monkeypatch.setattr(fmt_st, "_HASH_WHILE_WRITING", 0)
    encoded = fmt_st.encode(tree, meta={"x": 1})
    assert any(isinstance(c, Deferred) and c.late for c in encoded.chunks)  # the header, last
    assert encoded.tobytes() == inline.tobytes()


def test_corrupted_data_is_refused_on_verify_naming_the_file(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    ptio.save(good, {"w": np.arange(40, dtype=np.float32)}, format="safetensors")
    ptio.load(good, verify=True)
    bad = tmp_path / "bad.safetensors"
    data = bytearray(good.read_bytes())
    data[-3] ^= 0xFF  # data only: the header is the good file's
    bad.write_bytes(bytes(data))
    with pytest.raises(ptio.FormatError, match="data corrupted") as caught:
        ptio.load(bad, verify=True)
    assert caught.value.path == str(bad)
