"""Format msgpack: byte compatibility with flax.serialization, round trips, hostile input."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import flax.serialization as fser
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from conftest import DTYPES, arrays, assert_bits_equal, trees
from hypothesis import given

import pytreeio as ptio
from pytreeio.core.binary import BufferSource
from pytreeio.formats import msgpack as fmt_msgpack


def _sample_tree() -> dict[str, Any]:
    params = {
        "Dense_0": {
            "kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
            "bias": jnp.ones(4, jnp.bfloat16),
        }
    }
    return {
        "params": params,
        "opt_state": optax.adamw(1e-3).init(params),
        "step": 3,
        "lr": 0.1,
        "flag": True,
        "nothing": None,
        "scalar": np.float32(2.5),
        "empty": np.zeros((0, 3), np.int8),
        "zero_d": np.array(7, np.uint16),
        "complex": 1 + 2j,
        "seq": [np.int64(1), (np.uint16(7), np.bool_(True))],
        "name": "mlp",
        "blob": b"\x00\x01",
        "all_dtypes": {dt.name: np.arange(6).astype(dt).reshape(2, 3) for dt in DTYPES},
    }


def test_bytes_identical_to_flax_to_bytes() -> None:
    tree = _sample_tree()
    assert ptio.encode(tree, format="msgpack").tobytes() == fser.to_bytes(tree)


def test_flax_blob_loads_with_pytreeio(tmp_path: Path) -> None:
    tree = _sample_tree()
    path = tmp_path / "flax.msgpack"
    path.write_bytes(fser.to_bytes(tree))
    native = ptio.load(path)
    assert_bits_equal(fser.msgpack_restore(path.read_bytes()), native)
    restored = ptio.load(path, like=tree)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(tree)
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
    assert restored["params"]["Dense_0"]["bias"].dtype == jnp.bfloat16


def test_pytreeio_file_restores_with_flax(tmp_path: Path) -> None:
    tree = _sample_tree()
    path = tmp_path / "ours.msgpack"
    ptio.save(path, tree)
    restored = fser.from_bytes(tree, path.read_bytes())
    for a, b in zip(
        jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(restored), strict=True
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("threshold", [64, 100, 4096])
def test_chunking_matches_flax_both_ways(monkeypatch: pytest.MonkeyPatch, threshold: int) -> None:
    monkeypatch.setattr(fser, "MAX_CHUNK_SIZE", threshold)
    tree = {
        "big": np.arange(1000, dtype=np.float32).reshape(10, 100),
        "odd": np.arange(37, dtype=np.float64),
        "small": np.ones(3, np.int8),
        "nested": {"x": np.arange(300, dtype=np.int16).reshape(3, 10, 10)},
    }
    ours = ptio.encode(tree, format="msgpack", chunk_bytes=threshold).tobytes()
    assert ours == fser.to_bytes(tree)
    assert_bits_equal(tree, ptio.decode(fser.to_bytes(tree), format="msgpack"))
    info = ptio.inspect_encoded(ours, format="msgpack")
    assert {e.name: e.shape for e in info.entries}["big"] == (10, 100)


@given(trees(namedtuples=False))
def test_hypothesis_round_trip_bit_for_bit(tree: Any) -> None:
    blob = ptio.encode(tree, format="msgpack").tobytes()
    assert blob == fser.msgpack_serialize(fser.to_state_dict(tree), in_place=True)
    if tree is not None:
        assert_bits_equal(tree, ptio.decode(blob, format="msgpack", like=tree))


@given(arrays())
def test_every_dtype_and_shape_matches_flax(arr: np.ndarray) -> None:
    blob = ptio.encode({"a": arr}, format="msgpack").tobytes()
    assert blob == fser.to_bytes({"a": arr})
    assert_bits_equal({"a": arr}, ptio.decode(blob, format="msgpack"))


def test_save_streams_array_buffers_without_copies() -> None:
    big = np.arange(1 << 16, dtype=np.float32)
    enc = ptio.encode({"w": big}, format="msgpack")
    assert any(
        np.shares_memory(np.frombuffer(c, np.uint8), big)
        for c in enc.chunks
        if len(memoryview(c)) >= big.nbytes
    )


def test_loaded_arrays_are_views_of_one_read_buffer(tmp_path: Path) -> None:
    path = tmp_path / "x.msgpack"
    ptio.save(path, {"a": np.ones(1000, np.float32), "b": np.zeros(1000, np.float32)})
    out = ptio.load(path)
    assert out["a"].base is not None and out["b"].base is not None
    mm = ptio.load(path, mmap=True)
    assert not mm["a"].flags.writeable and mm["a"].sum() == 1000


def test_inspect_lists_entries_with_shapes_dtypes_and_sizes(tmp_path: Path) -> None:
    # msgpack interleaves headers and data, so inspect walks a read-only map of the file
    # and skips each array's bytes; that only header pages are touched is not asserted here.
    path = tmp_path / "x.msgpack"
    ptio.save(path, {"params": {"w": np.ones((256, 256), np.float32)}, "step": 5})
    info = ptio.inspect(path)
    assert info.format == "msgpack"
    assert [(e.name, e.shape, e.dtype, e.nbytes) for e in info.entries] == [
        ("params/w", (256, 256), "float32", 262144),
        ("step", (), "int", 0),
    ]


# ---------------------------------------------------------------- hostile input


def _small_valid() -> bytes:
    return fser.to_bytes(
        {
            "w": np.arange(6, dtype=np.float32).reshape(2, 3),
            "b": np.ones(2, ml_dtypes.bfloat16),
            "n": 3,
            "s": np.int8(1),
        }
    )


def test_truncation_at_every_offset_raises_format_error() -> None:
    blob = _small_valid()
    for cut in range(len(blob)):
        with pytest.raises(ptio.FormatError) as e:
            ptio.decode(blob[:cut], format="msgpack")
        assert e.value.offset is not None and e.value.offset <= cut


def test_random_byte_flips_raise_only_pytreeio_errors() -> None:
    blob = _small_valid()
    rng = random.Random(1234)
    for _ in range(3000):
        data = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        with contextlib.suppress(ptio.PytreeioError):
            ptio.decode(bytes(data), format="msgpack")


@pytest.mark.parametrize(
    ("blob", "field_part"),
    [
        (
            b"\x81\xa1a\xc7\x10\x01\x93\x91\xcf\xff\xff\xff\xff\xff\xff\xff\xff\xa7float32\xc4\x00",
            "a",
        ),  # absurd shape
        (b"\x81\xa1a\xdf\xff\xff\xff\xff", "a"),  # map claiming 4 billion entries
        (b"\x81\xa1a\xc6\x7f\xff\xff\xff", "a"),  # bin claiming 2 GiB
        (b"\x81\xa1a\xc7\x0e\x01\x93\x91\x01\xa6object\xc4\x04abcd", "a"),  # object dtype
        (b"\x82\xa1a\x01\xa1a\x02", ""),  # duplicate key
        (b"\x81\xa1a\xc1", "a"),  # never-used type byte
        (b"\x81\xa1a\x01\x00", "end"),  # trailing data
    ],
)
def test_lying_fields_raise_format_error_with_location(blob: bytes, field_part: str) -> None:
    with pytest.raises(ptio.FormatError) as e:
        ptio.decode(blob, format="msgpack")
    assert e.value.offset is not None
    assert field_part in (e.value.field or "")


def test_deep_nesting_is_bounded() -> None:
    blob = b"\x81\xa1a" * 10000 + b"\x01"
    with pytest.raises(ptio.FormatError, match="nesting"):
        ptio.decode(blob, format="msgpack")


def test_errors_from_files_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.msgpack"
    path.write_bytes(_small_valid()[:-3])
    with pytest.raises(ptio.FormatError) as e:
        ptio.load(path)
    assert e.value.path == str(path) and str(path) in str(e.value)


def test_unknown_options_and_meta_are_not_silent() -> None:
    with pytest.raises(TypeError):
        ptio.encode({"a": np.ones(1)}, format="msgpack", chunk_size=3)
    with pytest.warns(UserWarning, match="cannot store meta"):
        ptio.encode({"a": np.ones(1)}, format="msgpack", meta={"x": 1})


def test_unserialisable_leaf_names_its_path() -> None:
    with pytest.raises(ptio.EncodeError) as e:
        ptio.encode({"a": {"b": object()}}, format="msgpack")
    assert e.value.key_path == "a/b"
    with pytest.raises(ptio.EncodeError):
        ptio.encode({"a": np.array([object()])}, format="msgpack")


def test_module_constant_matches_flax() -> None:
    assert fmt_msgpack.MAX_CHUNK_BYTES == 2**30


def test_registry_record_v2() -> None:
    from pytreeio.core.records import FILE, WEAK, Probe

    fmt = fmt_msgpack.FORMAT
    assert fmt.layout is FILE and not fmt.accepts_meta and not fmt.keeps_meta
    assert fmt.save_options == {"chunk_bytes"} and fmt.load_options == set()
    blob = _small_valid()
    assert fmt.sniff(Probe(Path("x"), head=blob[:64], size=len(blob))) == WEAK
    assert fmt.sniff(Probe(Path("x"), head=b"\x80", size=1)) == WEAK
    assert fmt.sniff(Probe(Path("x"), head=b"\x92\x01\x02", size=3)) == 0
    assert fmt.sniff(Probe(Path("d"), kind="dir")) == 0
    with pytest.raises(ValueError):
        fmt_msgpack.encode({"a": np.ones(1)}, chunk_bytes=0)
    with pytest.raises(TypeError):
        fmt_msgpack.encode({"a": np.ones(1)}, chunk_bytes=1.5)


def test_inspect_summarises_huge_scalar_containers_but_lists_arrays() -> None:
    tree = {
        "w": np.ones(3, np.float32),
        "many": {str(i): i for i in range(fmt_msgpack.LIST_LIMIT + 1)},
        "few": {"0": 1, "1": 2.5},
    }
    info = fmt_msgpack.inspect(BufferSource(fser.to_bytes(tree)))
    names = [e.name for e in info.entries]
    assert names == ["w", "few/0", "few/1"]
    assert info.meta == {"unlisted_scalars": fmt_msgpack.LIST_LIMIT + 1}
