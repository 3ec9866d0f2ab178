"""The ``tinyllama`` format: conformance with the real file, strict validation, round trips."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tinyllama_data import random_tree

import pytreeio as ptio
from pytreeio.core.binary import BufferSource
from pytreeio.core.errors import EncodeError, FormatError, MismatchError
from pytreeio.core.records import FILE, MAGIC, Probe
from pytreeio.formats import registry
from pytreeio.formats import tinyllama as tl

CONFORMANCE = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "tinyllama"
WEIGHTS = CONFORMANCE / "weights.bin"

CONF_CONFIG = {
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 2,
    "ffn_hidden_dim": 128,
    "max_seq_len": 128,
    "vocab_size": 100,
    "dropout": float(np.float32(0.1)),
}
SMALL_CONFIG = {
    "d_model": 4,
    "n_layers": 2,
    "n_heads": 2,
    "ffn_hidden_dim": 6,
    "max_seq_len": 3,
    "vocab_size": 5,
    "dropout": 0.25,
}
HEADER_OFFSETS = {"d_model": 8, "n_layers": 12, "n_heads": 16, "ffn_hidden_dim": 20}
HEADER_OFFSETS.update({"max_seq_len": 24, "vocab_size": 28, "dropout": 32})


@pytest.fixture(scope="module")
def weights() -> bytes:
    if not WEIGHTS.exists():
        pytest.skip(f"conformance file missing: {WEIGHTS}")
    return WEIGHTS.read_bytes()


def meta_of(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"config": {"n_heads": cfg["n_heads"], "dropout": cfg["dropout"]}}


@pytest.fixture(scope="module")
def small() -> bytes:
    return tl.encode(random_tree(SMALL_CONFIG), meta=meta_of(SMALL_CONFIG)).tobytes()


def patched(data: bytes, offset: int, fmt: str, *values: Any) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, *values)
    return bytes(out)


def records(cfg: dict[str, Any]) -> list[Any]:
    return list(tl._records(cfg))


def map_arrays(fn: Any, tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: map_arrays(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_arrays(fn, v) for v in tree]
    return fn(tree)


def assert_trees_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    fa, fb = ptio.flatten(a), ptio.flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


# -- conformance --------------------------------------------------------------------


def test_conformance_header_and_tree(weights: bytes) -> None:
    assert len(weights) == 350_068
    assert weights[:4] == b"MLLT"
    assert tl.file_size(CONF_CONFIG) == 350_068
    tree, meta = tl.decode(weights)
    assert meta == {"config": CONF_CONFIG}
    assert tree["tok_embedding"].shape == (100, 64)
    assert tree["pos_embedding"].shape == (128, 64)
    assert tree["output"].shape == (64, 100)
    assert len(tree["layers"]) == 2
    layer = tree["layers"][1]
    assert {k: np.shape(v) for k, v in layer.items() if k[:2] != "ln"} == {
        "wq": (64, 64),
        "wk": (64, 64),
        "wv": (64, 64),
        "wo": (64, 64),
        "w1": (64, 128),
        "b1": (128,),
        "w2": (128, 64),
        "b2": (64,),
    }
    assert layer["ln2"]["bias"].shape == (64,)
    leaves = ptio.flatten(tree)
    assert len(leaves) == 27
    assert all(a.dtype == np.float32 for a in leaves.values())
    # the first float of the token embedding, as the hex dump shows it
    assert tree["tok_embedding"][0, 0] == np.frombuffer(bytes.fromhex("c2708a3c"), "<f4")[0]
    # the output projection is the last 25,600 bytes
    np.testing.assert_array_equal(
        tree["output"].reshape(-1), np.frombuffer(weights[-25_600:], "<f4")
    )


def test_conformance_arrays_are_views_of_the_buffer(weights: bytes) -> None:
    tree, _ = tl.decode(weights)
    base = np.frombuffer(weights, np.uint8)
    for key, arr in ptio.flatten(tree).items():
        assert np.shares_memory(arr, base), key


def test_conformance_resave_is_byte_identical(weights: bytes) -> None:
    tree, meta = tl.decode(weights)
    assert tl.encode(tree, meta=meta).tobytes() == weights
    # only the two fields that cannot be inferred, with a plain Python 0.1 for 0.1f
    assert tl.encode(tree, meta={"config": {"n_heads": 2, "dropout": 0.1}}).tobytes() == weights


def test_conformance_inspect_reads_header_only(weights: bytes) -> None:
    source = BufferSource(weights, name="weights.bin")
    info = tl.inspect(source)
    assert source.bytes_read < 1024
    assert source.bytes_read == 36
    assert info.format == "tinyllama"
    assert info.meta == {"config": CONF_CONFIG}
    assert len(info.entries) == 2 + 12 * 2 + 1
    names = [e.name for e in info.entries]
    assert names[:3] == ["tok_embedding", "pos_embedding", "layers/[0]/wq"]
    assert names[-1] == "output"
    assert "layers/[1]/ln2/bias" in names
    assert all(e.dtype == "float32" for e in info.entries)
    overhead = 36 + 16 * (2 + 1 + 2 * 6) + 8 * (2 * 6)
    assert info.nbytes == 350_068 - overhead
    by_name = {e.name: e for e in info.entries}
    assert by_name["layers/[1]/w1"].shape == (64, 128)
    assert by_name["layers/[1]/w1"].nbytes == 64 * 128 * 4
    # inspect and decode agree on names and shapes
    tree, _ = tl.decode(weights)
    assert {k: v.shape for k, v in ptio.flatten(tree).items()} == {
        e.name: e.shape for e in info.entries
    }


def test_sniff() -> None:
    assert tl.sniff(Probe(Path("w.bin"), head=b"MLLT\x01\x00\x00\x00")) == MAGIC
    assert tl.sniff(Probe(Path("w.bin"), head=b"TLLM\x00\x00\x00\x01")) == MAGIC
    assert tl.sniff(Probe(Path("w.bin"), head=b"\x89HDF")) == 0
    assert tl.sniff(Probe(Path("w.bin"), head=b"MLL")) == 0
    assert tl.sniff(Probe(Path("d"), kind="dir", names=frozenset({"MLLT"}))) == 0


def test_registered_without_claiming_bin() -> None:
    # (pytreeio.formats.registry, not ptio.formats: importing the pytreeio.fmt package
    # rebinds that attribute of pytreeio to the subpackage)
    fmt = registry.get("tinyllama")
    assert fmt.layout is FILE and fmt.accepts_meta and fmt.keeps_meta
    assert fmt.load_options == {"expected_config"} and fmt.save_options == {"cast"}
    assert ".bin" not in fmt.suffixes


# -- header validation ----------------------------------------------------------------


def test_wrong_magic(weights: bytes) -> None:
    with pytest.raises(FormatError) as exc:
        tl.decode(b"XXXX" + weights[4:])
    assert exc.value.field == "header.magic" and exc.value.offset == 0
    assert "MLLT" in str(exc.value) and "byte-swapped" not in str(exc.value)


def test_byte_swapped_magic_hint(weights: bytes) -> None:
    data = b"TLLM" + weights[4:]
    for call in (lambda: tl.decode(data), lambda: tl.inspect(BufferSource(data))):
        with pytest.raises(FormatError) as exc:
            call()
        assert exc.value.field == "header.magic" and exc.value.offset == 0
        assert "byte-swapped" in str(exc.value)


@pytest.mark.parametrize("version", [0, 2, 0x01000000])
def test_unsupported_version(weights: bytes, version: int) -> None:
    with pytest.raises(FormatError) as exc:
        tl.decode(patched(weights, 4, "<I", version))
    assert exc.value.field == "header.version" and exc.value.offset == 4
    assert str(version) in str(exc.value)


@pytest.mark.parametrize("name", [n for n in tl.CONFIG_FIELDS if n != "dropout"])
@pytest.mark.parametrize("value", [0, -1, -(2**31)])
def test_non_positive_config(weights: bytes, name: str, value: int) -> None:
    data = patched(weights, HEADER_OFFSETS[name], "<i", value)
    for call in (lambda: tl.decode(data), lambda: tl.inspect(BufferSource(data))):
        with pytest.raises(FormatError) as exc:
            call()
        assert exc.value.field == f"header.{name}"
        assert exc.value.offset == HEADER_OFFSETS[name]
        assert str(value) in str(exc.value)


@pytest.mark.parametrize("n_heads", [3, 5, 128])
def test_d_model_not_divisible_by_n_heads(weights: bytes, n_heads: int) -> None:
    with pytest.raises(FormatError) as exc:
        tl.decode(patched(weights, 16, "<i", n_heads))
    assert exc.value.field == "header.n_heads"
    assert "divisible" in str(exc.value)


@pytest.mark.parametrize("dropout", [float("nan"), float("inf"), -0.5, 1.5])
def test_bad_dropout(weights: bytes, dropout: float) -> None:
    with pytest.raises(FormatError) as exc:
        tl.decode(patched(weights, 32, "<f", dropout))
    assert exc.value.field == "header.dropout" and exc.value.offset == 32


@pytest.mark.parametrize("cut", range(36))
def test_truncated_header(weights: bytes, cut: int) -> None:
    for call in (lambda: tl.decode(weights[:cut]), lambda: tl.inspect(BufferSource(weights[:cut]))):
        with pytest.raises(FormatError) as exc:
            call()
        assert exc.value.field is not None and exc.value.field.startswith("header.")
        assert "truncated" in str(exc.value)


# -- records ---------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(27))
def test_every_record_dims_checked(weights: bytes, index: int) -> None:
    rec = records(CONF_CONFIG)[index]
    # Swap the dims of a matrix (same byte count, so the file size still matches);
    # a vector gets one more element.
    if len(rec.dims) == 2 and rec.dims[0] != rec.dims[1]:
        data = patched(weights, rec.offset, "<QQ", *rec.dims[::-1])
        found = list(rec.dims[::-1])
    else:
        data = patched(weights, rec.offset, "<Q", rec.dims[0] + 1)
        found = [rec.dims[0] + 1, *rec.dims[1:]]
    with pytest.raises(FormatError) as exc:
        tl.decode(data)
    assert exc.value.field == rec.field
    assert exc.value.offset == rec.offset
    assert f"expected {list(rec.dims)}, found {found}" in str(exc.value)


def test_layer_1_wq_dims_message(weights: bytes) -> None:
    rec = next(r for r in records(CONF_CONFIG) if r.field == "layer 1 Wq")
    data = patched(weights, rec.offset, "<QQ", 64, 32)
    with pytest.raises(FormatError) as exc:
        tl.decode(data)
    err = exc.value
    assert (err.field, err.offset) == ("layer 1 Wq", rec.offset)
    assert "expected [64, 64], found [64, 32]" in str(err)


def test_record_dims_named_even_when_the_size_differs() -> None:
    # A writer that really wrote layer 1 Wq as [4, 2]: the file is shorter than the
    # header implies; the error names the record, not just the size.
    tree = random_tree(SMALL_CONFIG)
    good = tl.encode(tree, meta=meta_of(SMALL_CONFIG)).tobytes()
    rec = next(r for r in records(SMALL_CONFIG) if r.field == "layer 1 Wq")
    bad = bytearray(good[: rec.offset])
    bad += struct.pack("<QQ", 4, 2) + tree["layers"][1]["wq"][:, :2].tobytes()
    bad += good[rec.end :]
    with pytest.raises(FormatError) as exc:
        tl.decode(bytes(bad))
    assert (exc.value.field, exc.value.offset) == ("layer 1 Wq", rec.offset)
    assert "expected [4, 4], found [4, 2]" in str(exc.value)


@pytest.mark.parametrize("lie", [2**62, 2**64 - 1, 2**32])
def test_lying_dimension_does_not_allocate(weights: bytes, lie: int) -> None:
    rec = records(CONF_CONFIG)[0]
    for offset in (rec.offset, rec.offset + 8):
        with pytest.raises(FormatError) as exc:
            tl.decode(patched(weights, offset, "<Q", lie))
        assert exc.value.field == "token embedding"


@pytest.mark.parametrize("name", ["n_layers", "vocab_size", "d_model"])
def test_huge_header_config_is_cheap(weights: bytes, name: str) -> None:
    data = patched(weights, HEADER_OFFSETS[name], "<i", 2**31 - 1)
    if name == "d_model":
        data = patched(data, 16, "<i", 1)  # keep d_model % n_heads == 0
    for call in (lambda: tl.decode(data), lambda: tl.inspect(BufferSource(data))):
        with pytest.raises(FormatError):
            call()


def test_truncation_at_every_offset(small: bytes) -> None:
    recs = records(SMALL_CONFIG)
    assert len(small) == tl.file_size(SMALL_CONFIG)
    for cut in range(len(small)):
        data = small[:cut]
        for call in (tl.decode, lambda d: tl.inspect(BufferSource(d))):
            try:
                call(data)
            except FormatError as err:
                if cut >= 36:
                    holder = next(r for r in recs if cut < r.end)
                    assert (err.field, err.offset) == (holder.field, cut), cut
                    assert "truncated" in str(err)
            else:
                pytest.fail(f"truncation at {cut} accepted")


@pytest.mark.parametrize("cut_from_end", [1, 3, 4, 100, 25_600, 25_601, 25_616, 25_617])
def test_truncated_conformance_file(weights: bytes, cut_from_end: int) -> None:
    data = weights[:-cut_from_end]
    expected_field = "output projection" if cut_from_end <= 25_616 else "layer 1 ln2 bias"
    for call in (lambda: tl.decode(data), lambda: tl.inspect(BufferSource(data))):
        with pytest.raises(FormatError) as exc:
            call()
        assert exc.value.field == expected_field
        assert exc.value.offset == len(data)
        assert "350,068" in str(exc.value)


@pytest.mark.parametrize("extra", [b"\x00", b"\x00" * 4, b"MLLT" * 100])
def test_trailing_data(weights: bytes, extra: bytes) -> None:
    data = weights + extra
    for call in (lambda: tl.decode(data), lambda: tl.inspect(BufferSource(data))):
        with pytest.raises(FormatError) as exc:
            call()
        assert exc.value.field == "end of file"
        assert exc.value.offset == 350_068
        assert f"{len(extra)} unexpected trailing bytes" in str(exc.value)


def test_size_checked_before_tensors(weights: bytes) -> None:
    # The header claims a larger vocabulary than the records hold.
    data = patched(weights, 28, "<i", 101)
    with pytest.raises(FormatError) as exc:
        tl.inspect(BufferSource(data))
    assert "truncated" in str(exc.value)
    with pytest.raises(FormatError) as exc:
        tl.decode(data)
    assert exc.value.field == "token embedding" and exc.value.offset == 36
    assert "expected [101, 64], found [100, 64]" in str(exc.value)


# -- expected config -----------------------------------------------------------------


def test_expected_config_matches(weights: bytes) -> None:
    tl.decode(weights, expected_config=CONF_CONFIG)
    tl.decode(weights, expected_config={**CONF_CONFIG, "dropout": 0.1})
    tl.decode(weights, expected_config={"d_model": 64})


@pytest.mark.parametrize("name", tl.CONFIG_FIELDS)
def test_expected_config_mismatch(weights: bytes, name: str) -> None:
    wrong = 0.5 if name == "dropout" else CONF_CONFIG[name] * 2
    with pytest.raises(MismatchError) as exc:
        tl.decode(weights, expected_config={**CONF_CONFIG, name: wrong})
    err = exc.value
    assert err.key_path == f"config.{name}"
    assert (err.expected, err.found) == (wrong, CONF_CONFIG[name])


def test_expected_config_unknown_field(weights: bytes) -> None:
    with pytest.raises(MismatchError):
        tl.decode(weights, expected_config={"hidden": 64})


# -- encode -----------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    d_heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3), (8, 4)]),
    n_layers=st.integers(1, 3),
    f=st.integers(1, 5),
    s=st.integers(1, 4),
    v=st.integers(1, 5),
    dropout=st.floats(0.0, 1.0, width=32),
)
def test_round_trip_property(
    d_heads: tuple[int, int], n_layers: int, f: int, s: int, v: int, dropout: float
) -> None:
    d, h = d_heads
    cfg = {"d_model": d, "n_layers": n_layers, "n_heads": h, "ffn_hidden_dim": f}
    cfg.update({"max_seq_len": s, "vocab_size": v, "dropout": dropout})
    tree = random_tree(cfg, seed=n_layers)
    data = tl.encode(tree, meta=meta_of(cfg)).tobytes()
    assert len(data) == tl.file_size(cfg)
    back, meta = tl.decode(data)
    assert meta == {"config": cfg}
    assert_trees_equal(back, tree)
    assert tl.encode(back, meta=meta).tobytes() == data
    info = tl.inspect(BufferSource(data))
    assert len(info.entries) == 2 + 12 * n_layers + 1


@pytest.mark.parametrize("dropout", [0.1, 0.3, 1 / 3, 1e-45, 0.0, 1.0, 0.9999999])
def test_dropout_is_stored_as_f32_exactly(dropout: float) -> None:
    cfg = {**SMALL_CONFIG, "dropout": dropout}
    data = tl.encode(random_tree(cfg), meta=meta_of(cfg)).tobytes()
    assert data[32:36] == struct.pack("<f", dropout)
    _, meta = tl.decode(data)
    assert meta["config"]["dropout"] == float(np.float32(dropout))
    again = tl.encode(random_tree(cfg), meta=meta).tobytes()
    assert again[32:36] == data[32:36]


def test_encode_references_arrays_without_copying() -> None:
    cfg = {**SMALL_CONFIG, "vocab_size": 64, "d_model": 32}
    tree = random_tree(cfg)
    chunks = tl.encode(tree, meta=meta_of(cfg)).chunks
    big = tree["tok_embedding"]  # 8 KiB: referenced, not copied
    assert any(np.shares_memory(np.frombuffer(c, np.uint8), big) for c in chunks)


@pytest.mark.parametrize("missing", ["n_heads", "dropout"])
def test_encode_requires_uninferable_fields(missing: str) -> None:
    meta = meta_of(SMALL_CONFIG)
    del meta["config"][missing]
    with pytest.raises(EncodeError) as exc:
        tl.encode(random_tree(SMALL_CONFIG), meta=meta)
    assert missing in str(exc.value)
    assert exc.value.key_path == f"meta/config/{missing}"
    with pytest.raises(EncodeError, match="n_heads"):
        tl.encode(random_tree(SMALL_CONFIG))


@pytest.mark.parametrize(
    ("name", "value"),
    [("d_model", 8), ("n_layers", 3), ("ffn_hidden_dim", 7), ("max_seq_len", 9), ("vocab_size", 4)],
)
def test_encode_meta_must_agree_with_shapes(name: str, value: int) -> None:
    meta = {"config": {**SMALL_CONFIG, name: value}}
    with pytest.raises(MismatchError) as exc:
        tl.encode(random_tree(SMALL_CONFIG), meta=meta)
    assert exc.value.key_path == f"meta/config/{name}"
    assert (exc.value.expected, exc.value.found) == (SMALL_CONFIG[name], value)


@pytest.mark.parametrize(
    "meta",
    [
        {"config": {"n_heads": 3, "dropout": 0.0}},
        {"config": {"n_heads": 0, "dropout": 0.0}},
        {"config": {"n_heads": 2, "dropout": 2.0}},
        {"config": {"n_heads": 2, "dropout": float("nan")}},
        {"config": {"n_heads": 2.0, "dropout": 0.0}},
        {"config": {"n_heads": 2, "dropout": 0.0, "rope": True}},
        {"config": {"n_heads": 2, "dropout": 0.0}, "extra": 1},
    ],
)
def test_encode_rejects_bad_meta(meta: dict[str, Any]) -> None:
    with pytest.raises(EncodeError):
        tl.encode(random_tree(SMALL_CONFIG), meta=meta)


def test_encode_rejects_wrong_shape_naming_key_path() -> None:
    tree = random_tree(SMALL_CONFIG)
    tree["layers"][1]["wq"] = np.zeros((4, 3), np.float32)
    with pytest.raises(EncodeError) as exc:
        tl.encode(tree, meta=meta_of(SMALL_CONFIG))
    assert exc.value.key_path == "layers/[1]/wq"
    assert "(4, 4)" in str(exc.value) and "(4, 3)" in str(exc.value)


def test_encode_rejects_missing_and_extra_entries() -> None:
    tree = random_tree(SMALL_CONFIG)
    del tree["layers"][0]["ln2"]["bias"]
    with pytest.raises(EncodeError) as exc:
        tl.encode(tree, meta=meta_of(SMALL_CONFIG))
    assert exc.value.key_path == "layers/[0]/ln2/bias"
    tree = random_tree(SMALL_CONFIG)
    tree["final_norm"] = np.ones(4, np.float32)
    with pytest.raises(EncodeError, match="final_norm"):
        tl.encode(tree, meta=meta_of(SMALL_CONFIG))
    tree = random_tree(SMALL_CONFIG)
    tree["layers"] = []
    with pytest.raises(EncodeError):
        tl.encode(tree, meta=meta_of(SMALL_CONFIG))


def test_encode_refuses_other_dtypes_unless_cast() -> None:
    tree = random_tree(SMALL_CONFIG)
    want = tl.encode(tree, meta=meta_of(SMALL_CONFIG)).tobytes()
    tree64 = map_arrays(lambda a: a.astype(np.float64), tree)
    with pytest.raises(EncodeError, match="cast=True"):
        tl.encode(tree64, meta=meta_of(SMALL_CONFIG))
    assert tl.encode(tree64, meta=meta_of(SMALL_CONFIG), cast=True).tobytes() == want
    tree["layers"][0]["b1"] = np.zeros(6, np.int32)
    with pytest.raises(EncodeError) as exc:
        tl.encode(tree, meta=meta_of(SMALL_CONFIG), cast=True)
    assert exc.value.key_path == "layers/[0]/b1"


def test_encode_big_endian_float32_is_not_a_cast() -> None:
    tree = random_tree(SMALL_CONFIG)
    want = tl.encode(tree, meta=meta_of(SMALL_CONFIG)).tobytes()
    swapped = map_arrays(lambda a: a.astype(">f4"), tree)
    assert tl.encode(swapped, meta=meta_of(SMALL_CONFIG)).tobytes() == want


def test_encode_accepts_flax_and_state_dict_layouts() -> None:
    tree = random_tree(SMALL_CONFIG)
    want = tl.encode(tree, meta=meta_of(SMALL_CONFIG)).tobytes()
    flax_params = {k: v for k, v in tree.items() if k != "layers"}
    flax_params.update({f"layers_{i}": layer for i, layer in enumerate(tree["layers"])})
    assert tl.encode({"params": flax_params}, meta=meta_of(SMALL_CONFIG)).tobytes() == want
    assert tl.encode(flax_params, meta=meta_of(SMALL_CONFIG)).tobytes() == want
    state_dict = {**tree, "layers": {str(i): x for i, x in enumerate(tree["layers"])}}
    assert tl.encode(state_dict, meta=meta_of(SMALL_CONFIG)).tobytes() == want
    with pytest.raises(EncodeError):
        tl.encode({"params": flax_params, "batch_stats": {}}, meta=meta_of(SMALL_CONFIG))
    gap = {k: v for k, v in flax_params.items() if k != "layers_0"}
    with pytest.raises(EncodeError):
        tl.encode(gap, meta=meta_of(SMALL_CONFIG))


def test_encode_does_not_mutate_the_tree() -> None:
    tree = random_tree(SMALL_CONFIG)
    before = map_arrays(np.copy, tree)
    tl.encode(tree, meta=meta_of(SMALL_CONFIG))
    assert_trees_equal(tree, before)


# -- restore -----------------------------------------------------------------------------


def test_restore_into_native_and_flax_layouts(small: bytes) -> None:
    native, meta = tl.decode(small)
    like_native = random_tree(SMALL_CONFIG, seed=9)
    assert_trees_equal(tl.restore(native, meta, like_native), native)
    flax_like = {k: v for k, v in like_native.items() if k != "layers"}
    flax_like.update({f"layers_{i}": x for i, x in enumerate(like_native["layers"])})
    out = tl.restore(native, meta, {"params": flax_like})
    assert set(out) == {"params"}
    np.testing.assert_array_equal(out["params"]["layers_1"]["w2"], native["layers"][1]["w2"])


def test_restore_mismatch_names_key_path(small: bytes) -> None:
    native, meta = tl.decode(small)
    like = random_tree(SMALL_CONFIG)
    like["layers"][1]["wq"] = np.zeros((4, 2), np.float32)
    with pytest.raises(MismatchError) as exc:
        tl.restore(native, meta, like)
    assert exc.value.key_path == "layers/[1]/wq"


# -- through the public API ----------------------------------------------------------------


def test_api_load_save_inspect_conformance(weights: bytes, tmp_path: Path) -> None:
    tree = ptio.load(WEIGHTS)  # sniffed from the content
    native, meta = ptio.load_with_meta(WEIGHTS)
    assert meta == {"config": CONF_CONFIG}
    out = tmp_path / "resaved.bin"
    ptio.save(out, tree, format="tinyllama", meta=meta)
    assert out.read_bytes() == weights
    info = ptio.inspect(WEIGHTS)
    assert info.format == "tinyllama" and len(info.entries) == 27
    assert info.meta == {"config": CONF_CONFIG}
    mapped = ptio.load(WEIGHTS, mmap=True, expected_config=CONF_CONFIG)
    assert_trees_equal(mapped, native)


def test_api_errors_name_the_file(weights: bytes, tmp_path: Path) -> None:
    bad = tmp_path / "cut.bin"
    bad.write_bytes(weights[:-10])
    with pytest.raises(FormatError) as exc:
        ptio.load(bad)
    assert exc.value.path == str(bad) and exc.value.field == "output projection"
    assert str(bad) in str(exc.value)
    swapped = tmp_path / "swapped.bin"
    swapped.write_bytes(b"TLLM" + weights[4:])
    with pytest.raises(FormatError, match="byte-swapped"):
        ptio.load(swapped)
    with pytest.raises(MismatchError):
        ptio.load(WEIGHTS, expected_config={"n_heads": 4})


def test_api_save_requires_format_for_bin(tmp_path: Path) -> None:
    with pytest.raises(ptio.UnknownFormatError):
        ptio.save(tmp_path / "w.bin", random_tree(SMALL_CONFIG), meta=meta_of(SMALL_CONFIG))
