"""Hostile input: one small hand-made file per class of escape found by the audit.

Every case here raised a non-pytreeio exception (numpy's ``ValueError``,
``OverflowError``, ``RecursionError``, ``IndexError``, ...) or cost far more
than its size before the fixes.  The decoders are called through their pure
functions, so the tests do not depend on the API or the I/O layer.  Memory is
measured with ``tracemalloc`` (peak bytes allocated during the call, the input
itself excluded) against the guarantee: about the input's size + 64 MiB.
"""

from __future__ import annotations

import collections
import json
import signal
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import numpy as np
import pytest

from pytreeio.containers import npy
from pytreeio.containers import zip as zipfmt
from pytreeio.core.binary import BufferSource, ByteSource, Reader
from pytreeio.core.errors import FormatError, MismatchError, PytreeioError
from pytreeio.core.tree import restore
from pytreeio.formats import msgpack as fmt_msgpack
from pytreeio.formats import safetensors as fmt_st
from pytreeio.formats import tinyllama as tl

MiB = 1024 * 1024
ALLOWANCE = 64 * MiB


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """A safety net against hangs (the bounds asserted are structural, not timing)."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def peak_bytes(call: Callable[[], Any]) -> tuple[int, Any]:
    """Peak bytes allocated while ``call`` runs, and its result or the exception it raised."""
    tracemalloc.start()
    try:
        try:
            result = call()
        except Exception as exc:
            return tracemalloc.get_traced_memory()[1], exc
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def pytreeio_error(call: Callable[[], Any]) -> PytreeioError:
    """Run ``call``; it must raise a pytreeio error (anything else fails the test as is)."""
    with time_limit(20), pytest.raises(PytreeioError) as info:
        call()
    return info.value


def format_error(call: Callable[[], Any]) -> FormatError:
    err = pytreeio_error(call)
    assert isinstance(err, FormatError), repr(err)
    assert err.field is not None and err.offset is not None, repr(err)
    return err


def npy_bytes(header: str, data: bytes = b"") -> bytes:
    raw = header.encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(raw)) + raw + data


def zip_of(members: dict[str, bytes]) -> bytes:
    """A stored ZIP archive as Python's zipfile writes it."""
    import io
    import zipfile

    f = io.BytesIO()
    with zipfile.ZipFile(f, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return f.getvalue()


def npy_header(descr: str, shape: tuple[int, ...]) -> str:
    return f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"


def safetensors_bytes(header: dict[str, Any], data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def pytreeio_safetensors(tree_doc: str, meta: str | None = None, **tensors: Any) -> bytes:
    """A safetensors file carrying a hand-written ``pytreeio.tree`` document."""
    md = {"format": "pytreeio", "pytreeio.version": "1", "pytreeio.tree": tree_doc}
    if meta is not None:
        md["pytreeio.meta"] = meta
    header: dict[str, Any] = {"__metadata__": md}
    data = b""
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        code = {"float64": "F64", "int64": "I64", "float32": "F32", "bool": "BOOL"}[arr.dtype.name]
        header[name] = {
            "dtype": code,
            "shape": list(arr.shape),
            "data_offsets": [len(data), len(data) + arr.nbytes],
        }
        data += arr.tobytes()
    return safetensors_bytes(header, data)


def msgpack_ext_array(shape: list[int], dtype: str = "float32", data: bytes = b"") -> Any:
    payload = msgpack.packb([shape, dtype, data], use_bin_type=True)
    return msgpack.ExtType(1, payload)


def tinyllama_header(
    d: int, n_layers: int, h: int = 1, f: int = 1, s: int = 1, v: int = 1
) -> bytes:
    return struct.pack("<II6if", tl.MAGIC, tl.VERSION, d, n_layers, h, f, s, v, 0.0)


# --------------------------------------------------------------------------
# shapes numpy cannot take: too many dimensions, zero next to huge, zero itemsize
# --------------------------------------------------------------------------

TOO_MANY_DIMS = (1,) * 65
ZERO_BY_HUGE = [(0, 2**63), (0, 2**40, 2**40), (0, 2**62, 2**62)]


@pytest.mark.parametrize("shape", [TOO_MANY_DIMS, *ZERO_BY_HUGE])
def test_reader_array_refuses_shapes_numpy_cannot_take(shape: tuple[int, ...]) -> None:
    format_error(lambda: Reader(b"\0" * 8).array("<f4", shape, "x"))


@pytest.mark.parametrize("descr", ["<U0", "|S0"])
def test_reader_array_refuses_zero_itemsize(descr: str) -> None:
    format_error(lambda: Reader(b"\0" * 8).array(descr, (3,), "x"))


@pytest.mark.parametrize(
    ("descr", "shape"),
    [("<f4", TOO_MANY_DIMS), *[("<f4", s) for s in ZERO_BY_HUGE], ("<U0", (1,)), ("|S0", (2,))],
)
def test_npy_header_shapes_and_dtypes(descr: str, shape: tuple[int, ...]) -> None:
    member = npy_bytes(npy_header(descr, shape), b"\0" * 4)
    format_error(lambda: npy.read_npy(member))
    # the same member inside an archive, through read_npz and inspect_npz
    bad = zip_of({"x.npy": member})
    format_error(lambda: npy.read_npz(bad))
    format_error(lambda: npy.inspect_npz(BufferSource(bad)))


@pytest.mark.parametrize("shape", [list(TOO_MANY_DIMS), *[list(s) for s in ZERO_BY_HUGE[:2]]])
def test_safetensors_shapes_numpy_cannot_take(shape: list[int]) -> None:
    blob = safetensors_bytes(
        {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 if 0 not in shape else 0]}},
        b"\0" * (4 if 0 not in shape else 0),
    )
    format_error(lambda: fmt_st.decode(blob))
    format_error(lambda: fmt_st.inspect(BufferSource(blob)))


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [0, 2**40, 2**40], [1] * 65])
def test_msgpack_shapes_numpy_cannot_take(shape: list[int]) -> None:
    data = b"" if 0 in shape else b"\0" * 4
    blob = msgpack.packb({"a": msgpack_ext_array(shape, "float32", data)}, use_bin_type=True)
    format_error(lambda: fmt_msgpack.decode(blob))
    format_error(lambda: fmt_msgpack.inspect(BufferSource(blob)))


# --------------------------------------------------------------------------
# deep JSON: safetensors header, structure document, meta
# --------------------------------------------------------------------------

DEEP = 50_000


def test_deeply_nested_safetensors_header() -> None:
    text = b'{"a": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    blob = struct.pack("<Q", len(text)) + text
    err = format_error(lambda: fmt_st.decode(blob))
    assert "deeper" in err.reason and err.offset > 8
    format_error(lambda: fmt_st.inspect(BufferSource(blob)))


def test_deeply_nested_structure_document() -> None:
    blob = pytreeio_safetensors('{"list": ' * DEEP + "[]" + "}" * DEEP)
    format_error(lambda: fmt_st.decode(blob))
    blob = pytreeio_safetensors("[" * DEEP + "]" * DEEP)
    format_error(lambda: fmt_st.decode(blob))


def test_tree_depth_is_bounded_below_the_json_limit() -> None:
    # 150 tree levels are 300 JSON levels (within that limit) but deeper than MAX_TREE_DEPTH
    doc = '{"list": [' * 150 + "null" + "]}" * 150
    format_error(lambda: fmt_st.decode(pytreeio_safetensors(doc)))


def test_deeply_nested_meta_document() -> None:
    blob = pytreeio_safetensors("null", meta='{"a": ' + "[" * DEEP + "]" * DEEP + "}")
    format_error(lambda: fmt_st.decode(blob))
    format_error(lambda: fmt_st.inspect(BufferSource(blob)))


@pytest.mark.parametrize(
    "meta", ['{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}', '{"a": 1e999}']
)
def test_non_finite_numbers_in_meta(meta: str) -> None:
    blob = pytreeio_safetensors("null", meta=meta)
    format_error(lambda: fmt_st.decode(blob))
    format_error(lambda: fmt_st.inspect(BufferSource(blob)))


def test_duplicate_keys_in_meta() -> None:
    blob = pytreeio_safetensors("null", meta='{"a": 1, "a": 2}')
    format_error(lambda: fmt_st.decode(blob))


def test_deep_trees_and_meta_are_refused_on_encode_too() -> None:
    from pytreeio.core.errors import EncodeError

    deep: Any = np.ones(1)
    for _ in range(fmt_st.MAX_TREE_DEPTH + 5):
        deep = [deep]
    with pytest.raises(EncodeError, match="deeper"):
        fmt_st.encode(deep)
    meta: Any = 1
    for _ in range(200):
        meta = {"m": meta}
    with pytest.raises(EncodeError, match="deeper"):
        fmt_st.encode({"a": np.ones(1)}, meta=meta)


# --------------------------------------------------------------------------
# namedtuples that collections.namedtuple refuses
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fields"),
    [("class", ["x"]), ("def", ["x"]), ("P", ["def"]), ("P", ["class", "x"]), ("P", ["_x"])],
)
def test_namedtuple_names_must_be_identifiers_and_not_keywords(
    name: str, fields: list[str]
) -> None:
    doc = json.dumps({"namedtuple": name, "fields": fields, "items": [None] * len(fields)})
    err = format_error(lambda: fmt_st.decode(pytreeio_safetensors(doc)))
    assert err.field == "pytreeio.tree"


def test_namedtuple_classes_are_bounded() -> None:
    n = fmt_st.MAX_NAMEDTUPLE_CLASSES + 1
    items = [{"namedtuple": f"T{i}", "fields": [], "items": []} for i in range(n)]
    doc = json.dumps({"list": items})
    err = format_error(lambda: fmt_st.decode(pytreeio_safetensors(doc)))
    assert "namedtuple" in err.reason


# --------------------------------------------------------------------------
# scalars whose kind and dtype disagree (NaN/inf in an int scalar)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1.5])
def test_int_scalar_stored_as_float(value: float) -> None:
    blob = pytreeio_safetensors('{"leaf": "x", "kind": "int"}', x=np.array(value))
    format_error(lambda: fmt_st.decode(blob))


def test_bool_scalar_stored_as_float_and_float_scalar_stored_as_bool() -> None:
    blob = pytreeio_safetensors('{"leaf": "x", "kind": "bool"}', x=np.array(2.0))
    format_error(lambda: fmt_st.decode(blob))
    blob = pytreeio_safetensors('{"leaf": "x", "kind": "float"}', x=np.array(True))
    format_error(lambda: fmt_st.decode(blob))


# --------------------------------------------------------------------------
# msgpack chunked arrays with fields of the wrong type
# --------------------------------------------------------------------------

CHUNK = msgpack_ext_array([2], "float32", b"\0" * 8)


@pytest.mark.parametrize(
    "chunked",
    [
        {"shape": msgpack_ext_array([1], "int64", b"\2" + b"\0" * 7), "chunks": {"0": CHUNK}},
        {"shape": {"0": 2}, "chunks": msgpack_ext_array([2], "float32", b"\0" * 8)},
        {"shape": [2], "chunks": {"0": CHUNK}},
        {"shape": {"0": 2}, "chunks": [CHUNK]},
        {"shape": "ab", "chunks": {"0": CHUNK}},
        {"shape": {"0": 2}, "chunks": {"0": 7}},
        {"shape": {"0": 2.5}, "chunks": {"0": CHUNK}},
        {"shape": {"0": 0, "1": 2**63}, "chunks": {"0": msgpack_ext_array([0], "float32")}},
        {"shape": {"1": 2}, "chunks": {"0": CHUNK}},
        {"shape": {"0": 2}},
    ],
)
def test_malformed_chunked_arrays(chunked: dict[str, Any]) -> None:
    blob = msgpack.packb({"w": {"__msgpack_chunked_array__": True, **chunked}}, use_bin_type=True)
    err = format_error(lambda: fmt_msgpack.decode(blob))
    assert "w" in err.field
    format_error(lambda: fmt_msgpack.inspect(BufferSource(blob)))


# --------------------------------------------------------------------------
# restore: unknown template leaves, hostile native trees
# --------------------------------------------------------------------------


class Opaque:
    pass


def test_restore_refuses_like_leaves_of_unknown_types() -> None:
    err = pytreeio_error(lambda: restore({"a": {"b": np.ones(2)}}, {"a": {"b": Opaque()}}))
    assert isinstance(err, MismatchError) and err.key_path == "a/b"
    err = pytreeio_error(lambda: restore({"a": "text"}, {"a": object()}))
    assert isinstance(err, MismatchError) and err.key_path == "a"


P = collections.namedtuple("P", ["index", "count"])
Q = collections.namedtuple("Q", ["other"])


@pytest.mark.parametrize(
    ("native", "like"),
    [
        ("abc", {"a": np.ones(1)}),
        (Q(np.ones(1)), P(np.ones(1), np.ones(1))),  # methods named like the fields
        ({"a": {"index": np.ones(1)}}, {"a": P(np.ones(1), np.ones(1))}),
        ({"x": 10**400}, {"x": 0.5}),
        ({"x": [1, 2]}, {"x": {"y": 1}}),
        ([np.ones(1)], {"0": np.ones(1), "1": np.ones(1)}),
        ({"x": {"0": 1}}, {"x": (1, 2)}),
        ({"x": b"raw"}, {"x": "text"}),
        ({"x": np.ones((2, 2))}, {"x": 1.0}),
        (7, [np.ones(1)]),
        ({"x": bytearray(b"ab")}, {"x": {"y": np.ones(1)}}),
    ],
)
def test_restore_hostile_native_trees_raise_only_mismatch(native: Any, like: Any) -> None:
    err = pytreeio_error(lambda: restore(native, like))
    assert isinstance(err, MismatchError)


@pytest.mark.parametrize("native", ["abc", {"layers": "abc"}, {"layers": None}, [1, 2], None])
def test_tinyllama_restore_of_hostile_native_trees(native: Any) -> None:
    like = {"tok_embedding": np.ones((1, 1), np.float32), "layers_0": {"wq": np.ones((1, 1))}}
    pytreeio_error(lambda: tl.restore(native, {}, like))
    pytreeio_error(lambda: tl.restore(native, {}, {"params": like}))


# --------------------------------------------------------------------------
# bounded cost
# --------------------------------------------------------------------------


def deflated_member_zip(size: int) -> bytes:
    """A ZIP of one deflated ``x.npy`` whose content is ``size`` zero bytes after a header."""
    head = bytes(npy.npy_header(np.uint8, (size - 128,)))
    assert len(head) == 128
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    crc = zlib.crc32(head)
    parts = [comp.compress(head)]
    block = b"\0" * MiB
    left = size - len(head)
    while left:
        piece = block[: min(left, MiB)]
        crc = zlib.crc32(piece, crc)
        parts.append(comp.compress(piece))
        left -= len(piece)
    parts.append(comp.flush())
    data = b"".join(parts)
    name = b"x.npy"
    local = struct.pack(
        "<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0, 8, 0, 0x21, crc, len(data), size, len(name), 0
    )
    central = struct.pack(
        "<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, 8, 0, 0x21, crc, len(data), size,
        len(name), 0, 0, 0, 0, 0, 0,
    )  # fmt: skip
    body = local + name + data
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central) + len(name), len(body), 0)
    return body + central + name + end


def test_deflate_bomb_is_refused_within_the_memory_bound() -> None:
    archive = deflated_member_zip(200 * MiB)  # about 200 KB inflating 1000x
    assert len(archive) < MiB
    peak, exc = peak_bytes(lambda: npy.read_npz(archive))
    assert isinstance(exc, FormatError), repr(exc)
    assert "inflate" in exc.reason and exc.field is not None and exc.offset is not None
    assert peak < len(archive) + ALLOWANCE
    # a caller that trusts the file may allow more, and then it loads
    small = deflated_member_zip(4 * MiB)
    assert npy.read_npz(small)["x"].shape == (4 * MiB - 128,)


def stored_local(name: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(data)
    return (
        struct.pack(
            "<4s2B4HL2L2H",
            b"PK\x03\x04",
            20,
            0,
            0,
            0,
            0,
            0x21,
            crc,
            len(data),
            len(data),
            len(name),
            0,
        )
        + name
        + data
    )


def stored_central(name: bytes, data: bytes, offset: int) -> bytes:
    crc = zlib.crc32(data)
    return struct.pack(
        "<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, 0, 0, 0x21, crc, len(data), len(data),
        len(name), 0, 0, 0, 0, 0, offset,
    ) + name  # fmt: skip


def test_overlapping_members_are_refused() -> None:
    # member a's data is a complete local header + data of member b: both are valid
    # records, b lies inside a (the layout of overlapping-member zip bombs)
    b_data = b"".join(bytes(c) for c in npy.encode_npy(np.ones(4)))
    b_local = stored_local(b"b.npy", b_data)
    a_local = stored_local(b"a.npy", b_local)
    b_at = len(a_local) - len(b_local)
    central = stored_central(b"a.npy", b_local, 0) + stored_central(b"b.npy", b_data, b_at)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 2, 2, len(central), len(a_local), 0)
    archive = a_local + central + end
    err = format_error(lambda: npy.read_npz(archive))
    assert "overlap" in err.reason
    format_error(lambda: npy.inspect_npz(BufferSource(archive)))


def test_member_prefix_reads_only_what_it_needs() -> None:
    archive = deflated_member_zip(8 * MiB)
    src = BufferSource(archive)
    (m,) = zipfmt.read_zip_directory(src)
    before = src.bytes_read
    head = zipfmt.member_prefix(src, m, 128)
    assert bytes(head[:6]) == b"\x93NUMPY"
    assert src.bytes_read - before <= 64 * 1024
    (entry,) = npy.inspect_npz(src)
    assert entry[1].shape == (8 * MiB - 128,)


def test_msgpack_inspect_of_a_huge_array_of_small_ints() -> None:
    n = 500_000  # the audit's case was 2 million in 2 MB: 505 MB
    blob = msgpack.packb({"x": [i % 100 for i in range(n)]})
    with time_limit(60):
        peak, info = peak_bytes(lambda: fmt_msgpack.inspect(BufferSource(blob)))
    assert not isinstance(info, Exception), repr(info)
    assert peak < len(blob) + ALLOWANCE
    # structurally bounded: no entry (nor any object) per element, all of them counted
    assert len(info.entries) == 0 and info.meta == {"unlisted_scalars": n}


def test_msgpack_inspect_of_many_tiny_maps_is_bounded() -> None:
    blob = msgpack.packb({str(i): {"a": i % 100, "b": 1} for i in range(20_000)})
    with time_limit(60):
        peak, info = peak_bytes(lambda: fmt_msgpack.inspect(BufferSource(blob)))
    assert not isinstance(info, Exception), repr(info)
    assert peak < len(blob) + ALLOWANCE
    assert len(info.entries) <= fmt_msgpack.SCALAR_BUDGET
    assert len(info.entries) + info.meta["unlisted_scalars"] == 40_000


def test_msgpack_container_bombs_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 million empty arrays in 2 MB would cost 130 MB of lists: the number of maps and
    # arrays is bounded by (size + allowance) / CONTAINER_COST.  The allowance is set
    # to 0 here so that a small file shows the bound (the default is 64 MiB).
    monkeypatch.setattr(fmt_msgpack, "_CONTAINER_ALLOWANCE", 0)
    n = 100_000
    blob = b"\x81\xa1x\xdd" + struct.pack(">I", n) + b"\x90" * n
    for call in (lambda: fmt_msgpack.decode(blob), lambda: fmt_msgpack.inspect(BufferSource(blob))):
        err = format_error(call)
        assert "maps and arrays" in err.reason
    tree = {"layer": [{"w": np.ones(4, np.float32), "b": np.zeros(4, np.float32)}] * 50}
    blob = fmt_msgpack.encode(tree).tobytes()
    assert len(fmt_msgpack.decode(blob).tree["layer"]) == 50


def test_msgpack_small_trees_still_list_every_scalar() -> None:
    blob = msgpack.packb({"step": 3, "lr": 0.5, "seq": {"0": 1, "1": 2}, "w": CHUNK})
    info = fmt_msgpack.inspect(BufferSource(blob))
    assert [e.name for e in info.entries] == ["step", "lr", "seq/0", "seq/1", "w"]
    assert info.meta == {}


def tinyllama_file(d: int, n_layers: int) -> bytes:
    """A well-formed weights file with every dimension ``d`` (and F = S = V = d)."""

    def mat(r: int, c: int) -> bytes:
        return struct.pack("<QQ", r, c) + b"\0" * (4 * r * c)

    def vec(n: int) -> bytes:
        return struct.pack("<Q", n) + b"\0" * (4 * n)

    layer = mat(d, d) * 4 + mat(d, d) + vec(d) + mat(d, d) + vec(d) + vec(d) * 4
    return b"".join(
        [
            tinyllama_header(d, n_layers, f=d, s=d, v=d),
            mat(d, d),
            mat(d, d),
            layer * n_layers,
            mat(d, d),
        ]
    )


def test_tinyllama_header_implying_too_many_records(monkeypatch: pytest.MonkeyPatch) -> None:
    data = tinyllama_file(1, 100_000)  # 19 MB, 1.2 million one-element tensors
    records = 0
    real = tl._records

    def counting(cfg: Any) -> Any:
        nonlocal records
        for rec in real(cfg):
            records += 1
            yield rec

    monkeypatch.setattr(tl, "_records", counting)
    peak, exc = peak_bytes(lambda: tl.decode(data))
    assert isinstance(exc, FormatError) and exc.field == "header.n_layers", repr(exc)
    assert peak < len(data) + ALLOWANCE
    peak, exc = peak_bytes(lambda: tl.inspect(BufferSource(data)))
    assert isinstance(exc, FormatError) and exc.field == "header.n_layers", repr(exc)
    assert records == 0  # refused from the header: no record was even enumerated


class SparseSource(ByteSource):
    """A huge file that is all zeros after its first bytes (like a sparse file)."""

    def __init__(self, head: bytes, size: int) -> None:
        self.head = head
        self.name = "sparse.bin"
        self.size = size
        self.bytes_read = 0

    def _read(self, offset: int, n: int) -> memoryview:
        if n > 1 << 20:
            raise AssertionError(f"read of {n} bytes: inspect must read headers only")
        out = bytearray(n)
        if offset < len(self.head):
            part = self.head[offset : offset + n]
            out[: len(part)] = part
        return memoryview(bytes(out))


@pytest.mark.parametrize("n_layers", [300_000, 2**31 - 1])
def test_tinyllama_inspect_of_a_sparse_file(n_layers: int) -> None:
    cfg = {
        "d_model": 1,
        "n_layers": n_layers,
        "ffn_hidden_dim": 1,
        "max_seq_len": 1,
        "vocab_size": 1,
    }
    src = SparseSource(tinyllama_header(1, n_layers), tl.file_size(cfg))
    with time_limit(20):
        peak, exc = peak_bytes(lambda: tl.inspect(src))
    assert isinstance(exc, FormatError) and exc.field == "header.n_layers", repr(exc)
    assert peak < ALLOWANCE and src.bytes_read <= 64


def test_tinyllama_real_files_are_far_inside_the_record_budget() -> None:
    data = tinyllama_file(8, 64)
    tree, meta = tl.decode(data)
    assert len(tree["layers"]) == 64 and meta["config"]["n_layers"] == 64


# --------------------------------------------------------------------------
# pytreeio.core.jsonsafe: the one JSON parser for documents read from files
# --------------------------------------------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pytreeio.core import jsonsafe  # noqa: E402

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{},:é\n'),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(alphabet='k"\\[{', max_size=3), children, max_size=3)
    ),
    max_leaves=20,
)


def true_depth(value: Any) -> int:
    if isinstance(value, dict | list):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max((true_depth(c) for c in children), default=0)
    return 0


@given(json_values)
def test_jsonsafe_scan_depth_matches_the_document(value: Any) -> None:
    raw = json.dumps(value).encode()
    assert jsonsafe.max_depth_of(raw) == true_depth(value)
    assert jsonsafe.loads(raw) == value


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_jsonsafe_scan_across_chunk_boundaries(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(jsonsafe, "_CHUNK", chunk)
    for value in ([], {"a": [1, [2, ['\\\\"[[']]]}, ["\\", '"', "[[[", {"]": "{"}], "\\" * 7 + '"'):
        raw = json.dumps(value).encode()
        assert jsonsafe.max_depth_of(raw) == true_depth(value), raw


def test_jsonsafe_errors_name_field_and_offset() -> None:
    def err(data: Any, **kw: Any) -> FormatError:
        with pytest.raises(FormatError) as e:
            jsonsafe.loads(data, path="f.json", field="doc", offset=100, **kw)
        assert e.value.path == "f.json" and e.value.field == "doc"
        return e.value

    # the object is level 1, so the 128th bracket (index 127) is the first too deep
    assert err(b'{"a": ' + b"[" * 200 + b"]" * 200 + b"}").offset == 100 + 6 + 127
    assert err(b'{"a": "\xff"}').offset == 100 + 7
    assert err(b'{"a" 1}').offset == 100 + 5
    assert err(b'{"a": NaN}').offset == 100 + 6
    assert err(b'{"s": "NaN", "a": -Infinity}').offset == 100 + 18
    assert err(b'{"a": 1e999}').offset == 100 + 6
    assert "duplicate" in err(b'{"a": 1, "a": 2}').reason
    assert "digits" in err(b"[" + b"9" * 5000 + b"]").reason
    assert "values" in err(b"[" + b"0," * 1000 + b"0]", max_values=100).reason
    assert "deeper" in err(b"[[[]]]", max_depth=2).reason
    inner = err('{"a": [1,}', exact=False)
    assert inner.offset == 100 and "byte 9" in str(inner)


def test_jsonsafe_accepts_what_strict_json_allows_and_opt_ins() -> None:
    assert jsonsafe.loads(b' {"a": [1, 2.5, "x\\"]"], "b": null} ') == {
        "a": [1, 2.5, 'x"]'],
        "b": None,
    }
    assert jsonsafe.loads("[1]") == [1]
    assert jsonsafe.loads(memoryview(b"[true]")) == [True]
    nan = jsonsafe.loads(b"[NaN]", allow_nan=True)[0]
    assert nan != nan
    assert jsonsafe.loads(b'{"a": 1, "a": 2}', allow_duplicates=True) == {"a": 2}
    assert jsonsafe.loads(b"[" * 128 + b"]" * 128) is not None  # exactly the default limit
