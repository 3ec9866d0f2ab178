"""pytreeio.containers.npy: numpy-identical .npy/.npz writing and bounded, hostile-safe reading."""

from __future__ import annotations

import io
import random
import struct
import zlib

import numpy as np
import pytest

from pytreeio.containers import npy
from pytreeio.containers import zip as zipfmt
from pytreeio.core.binary import BufferSource, as_memoryview
from pytreeio.core.errors import EncodeError, FormatError


def ours(items: dict) -> bytes:
    return b"".join(bytes(as_memoryview(c)) for c in npy.encode_npz(items.items()))


def numpy_savez(items: dict) -> bytes:
    f = io.BytesIO()
    np.savez(f, **items)
    return f.getvalue()


CASES = {
    "netcl-like": {
        "0:weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "0:bias": np.zeros(4, np.float32),
        "__netcl_meta__": np.array('{"type": "Sequential"}', dtype=np.str_),
    },
    "dtypes": {
        "f8": np.linspace(0, 1, 7),
        "f2": np.ones((2, 3), np.float16),
        "i1": np.arange(-3, 3, dtype=np.int8),
        "u8": np.arange(5, dtype=np.uint64),
        "b": np.array([True, False]),
        "c": np.ones(3, np.complex64),
        "be": np.arange(4, dtype=">f4"),
        "U": np.array(["ab", "c"]),
        "S": np.array([b"xyz"]),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 3), np.float32),
    },
    "layouts": {
        "fortran": np.asfortranarray(np.arange(15.0).reshape(3, 5)),
        "strided": np.arange(20)[::3],
        "long_shape": np.zeros((1,) * 40),
        "big_dim": np.zeros((123456, 1), np.uint8),
    },
    "unicode-name": {"é/ü": np.ones(2)},
    "empty-archive": {},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_encode_npz_is_byte_identical_to_np_savez(name: str) -> None:
    items = CASES[name]
    data = ours(items)
    assert data == numpy_savez(items)
    back = npy.read_npz(data)
    assert list(back) == list(items)
    for k, v in items.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        assert sorted(z.files) == sorted(items)


def test_read_npz_is_zero_copy_for_stored_members() -> None:
    data = bytearray(ours({"a": np.arange(100, dtype=np.float32)}))
    arr = npy.read_npz(memoryview(data), verify_crc=False)["a"]
    assert not arr.flags.owndata
    assert np.shares_memory(arr, np.frombuffer(data, np.uint8))


def test_read_compressed_npz_and_inspect_headers_only() -> None:
    f = io.BytesIO()
    items = {"a": np.arange(1000.0), "b": np.ones((3, 3), np.float32)}
    np.savez_compressed(f, **items)
    back = npy.read_npz(f.getvalue())
    for k, v in items.items():
        np.testing.assert_array_equal(back[k], v)
    src = BufferSource(f.getvalue())
    infos = npy.inspect_npz(src)
    assert [(k, h.shape, h.dtype.str) for k, h, _ in infos] == [
        ("a", (1000,), "<f8"),
        ("b", (3, 3), "<f4"),
    ]


def test_inspect_reads_only_headers() -> None:
    data = ours({"big": np.zeros(1 << 20, np.float32), "small": np.ones(3)})
    src = BufferSource(data)
    infos = npy.inspect_npz(src)
    assert [k for k, _, _ in infos] == ["big", "small"]
    assert src.bytes_read < 64 * 1024


def test_npy_header_matches_numpy_for_many_shapes() -> None:
    for shape in [(), (0,), (1,), (7, 3), (10**12,), (2,) * 30]:
        for fortran in (False, True):
            f = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                f, {"descr": "<f4", "fortran_order": fortran, "shape": shape}
            )
            # numpy's public 1.0 writer lacks the growth padding; compare with np.save instead
            ours_h = npy.npy_header(np.float32, shape, fortran)
            assert ours_h[:6] == b"\x93NUMPY" and len(ours_h) % 64 == 0
    a = np.zeros((4, 5), np.float32)
    f = io.BytesIO()
    np.save(f, a)
    assert f.getvalue()[:128] == npy.npy_header(np.float32, (4, 5))


def test_object_arrays_refused_on_write() -> None:
    with pytest.raises(EncodeError):
        npy.encode_npz([("x", np.array([object()], dtype=object))])


# --------------------------------------------------------------------------
# hostile input
# --------------------------------------------------------------------------

SMALL = {
    "0:weight": np.arange(6, dtype=np.float32).reshape(2, 3),
    "__netcl_meta__": np.array('{"a": 1}', dtype=np.str_),
}


def _must_fail(data: bytes) -> None:
    with pytest.raises(FormatError):
        npy.read_npz(data)


def test_truncation_at_every_offset_is_a_format_error() -> None:
    data = ours(SMALL)
    for n in range(len(data)):
        _must_fail(data[:n])


def test_random_byte_flips_raise_format_error_or_read_identically() -> None:
    data = ours(SMALL)
    rng = random.Random(1234)
    for _ in range(600):
        buf = bytearray(data)
        pos = rng.randrange(len(buf))
        buf[pos] ^= 1 << rng.randrange(8)
        try:
            back = npy.read_npz(bytes(buf))
        except FormatError:
            continue
        # only bytes the reader ignores by design (e.g. version-made-by) may change silently
        for k, v in SMALL.items():
            np.testing.assert_array_equal(back[k], v)


def test_every_single_byte_flip_in_data_is_caught_by_crc() -> None:
    data = ours({"a": np.arange(8, dtype=np.float32)})
    start = data.index(b"\x93NUMPY")
    for pos in range(start, start + 128 + 32):
        buf = bytearray(data)
        buf[pos] ^= 0x40
        _must_fail(bytes(buf))


def _central_offset(data: bytes) -> int:
    return data.rindex(b"PK\x01\x02")


def test_lying_sizes_in_local_and_central_headers() -> None:
    data = ours({"a": np.arange(8, dtype=np.float32)})
    cd = _central_offset(data)
    for field_at in (cd + 20, cd + 24):  # compressed size, uncompressed size
        buf = bytearray(data)
        struct.pack_into("<I", buf, field_at, 0x7FFFFFF0)
        _must_fail(bytes(buf))
    buf = bytearray(data)
    struct.pack_into("<I", buf, cd + 42, 0xFFFFFFF0)  # local header offset
    _must_fail(bytes(buf))
    buf = bytearray(data)
    struct.pack_into("<H", buf, 26, 0xFFFF)  # local name length
    _must_fail(bytes(buf))
    # end record claims more entries than exist
    buf = bytearray(data)
    struct.pack_into("<HH", buf, len(buf) - 22 + 8, 5000, 5000)
    _must_fail(bytes(buf))


def _npy_with_header(header: str, data: bytes = b"", version: int = 1) -> bytes:
    raw = header.encode("latin1")
    size = struct.pack("<H" if version == 1 else "<I", len(raw))
    return b"\x93NUMPY" + bytes([version, 0]) + size + raw + data


def _zip_of(member: bytes, name: str = "x.npy") -> bytes:
    f = io.BytesIO()
    import zipfile

    with zipfile.ZipFile(f, "w") as z:
        z.writestr(name, member)
    return f.getvalue()


@pytest.mark.parametrize(
    "header",
    [
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000, 1000000000), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }",
        "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
        "{'descr': [('a', '|O')], 'fortran_order': False, 'shape': (1,), }",
        "{'descr': '<f4,|O', 'fortran_order': False, 'shape': (1,), }",
        "{'descr': '<f4', 'fortran_order': 0, 'shape': (1,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'extra': 1}",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (True,), }",
        "__import__('os').system('true')",
        "(" * 200 + ")" * 200,
        "{'descr': 'not-a-dtype', 'fortran_order': False, 'shape': (1,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 5000 + ",), }",
    ],
)
def test_hostile_npy_headers(header: str) -> None:
    member = _npy_with_header(header, b"\0" * 16)
    _must_fail(_zip_of(member))
    with pytest.raises(FormatError):
        npy.read_npy(member)


def test_a_header_read_again_parses_the_same_and_errors_keep_their_offsets() -> None:
    ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"
    member = _npy_with_header(ok, struct.pack("<2f", 1, 2))
    data_at = len(member) - 8
    assert npy.read_npy(member).tolist() == [1.0, 2.0]
    assert npy.read_npy(member, start=7).tolist() == [1.0, 2.0]
    with pytest.raises(FormatError, match="truncated") as info:
        npy.read_npy(member[:-4], start=100)  # same header, too little data
    assert info.value.offset == 100 + data_at
    for cut in (9, 12, data_at - 1):  # the header itself cut short
        with pytest.raises(FormatError):
            npy.read_npy(member[:cut])
    bad = _npy_with_header(ok.replace("<f4", "<x9"), struct.pack("<2f", 1, 2))
    for _ in range(2):
        with pytest.raises(FormatError, match="dtype"):
            npy.read_npy(bad, start=5)


def test_npy_header_length_bound_and_versions() -> None:
    with pytest.raises(FormatError, match="header length"):
        npy.read_npy(b"\x93NUMPY\x02\x00" + struct.pack("<I", 0xFFFFFFF0))
    with pytest.raises(FormatError, match="version"):
        npy.read_npy(b"\x93NUMPY\x09\x00\x00\x00")
    ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"
    for v in (1, 2, 3):
        arr = npy.read_npy(_npy_with_header(ok, struct.pack("<2f", 1, 2), version=v))
        assert arr.tolist() == [1.0, 2.0]
    with pytest.raises(FormatError, match="trailing"):
        npy.read_npy(_npy_with_header(ok, b"\0" * 12))


@pytest.mark.parametrize(
    "name", ["../evil.npy", "/abs.npy", "a/../../b.npy", "C:\\x.npy", "a\\b.npy", "./x.npy"]
)
def test_unsafe_member_names(name: str) -> None:
    member = b"".join(bytes(as_memoryview(c)) for c in npy.encode_npy(np.ones(2)))
    _must_fail(_zip_of(member, name))


def test_duplicate_and_non_npy_members() -> None:
    member = b"".join(bytes(as_memoryview(c)) for c in npy.encode_npy(np.ones(2)))
    _must_fail(_zip_of(member, "notes.txt"))
    import warnings
    import zipfile

    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zipfile.ZipFile(f, "w") as z:
            z.writestr("x.npy", member)
            z.writestr("x.npy", member)
    with pytest.raises(FormatError, match="duplicate"):
        npy.read_npz(f.getvalue())


def test_deflate_bomb_declared_size_is_checked_before_inflating() -> None:
    f = io.BytesIO()
    np.savez_compressed(f, a=np.zeros(1000))
    data = bytearray(f.getvalue())
    cd = _central_offset(bytes(data))
    struct.pack_into("<I", data, cd + 24, 0x7FFFFFF0)  # uncompressed size: 2 GiB from ~40 bytes
    _must_fail(bytes(data))
    # a smaller lie is caught while inflating (bounded by the declared size)
    data = bytearray(f.getvalue())
    struct.pack_into("<I", data, cd + 24, 100)
    _must_fail(bytes(data))


def test_not_a_zip() -> None:
    for junk in (
        b"",
        b"PK",
        b"\x00" * 100,
        b"PK\x05\x06" + b"\x00" * 17,
        zlib.compress(b"x" * 100),
    ):
        _must_fail(junk)


# --------------------------------------------------------------------------
# pytreeio.containers.zip
# --------------------------------------------------------------------------


def test_member_names_reads_only_the_central_directory() -> None:

    data = ours({"a": np.zeros(1 << 16, np.float32), "b/c": np.ones(2), "é": np.ones(1)})
    src = BufferSource(data)
    assert zipfmt.member_names(src) == ("a.npy", "b/c.npy", "é.npy")
    assert src.bytes_read < 512
    with pytest.raises(FormatError, match="exceeds"):
        zipfmt.member_names(BufferSource(data), max_bytes=10)
    for junk in (b"", b"PK\x03\x04" + bytes(30), b"\0" * 100):
        with pytest.raises(FormatError):
            zipfmt.member_names(BufferSource(junk))
    # names are reported as stored, even unsafe ones (read_zip_directory refuses those)
    assert zipfmt.member_names(BufferSource(_zip_of(b"x", "../up.npy"))) == ("../up.npy",)


def test_zip_module() -> None:
    stored = b"".join(
        bytes(as_memoryview(c)) for c in zipfmt.encode_stored([("x.txt", [b"hello"])])
    )
    import zipfile

    with zipfile.ZipFile(io.BytesIO(stored)) as z:
        assert z.read("x.txt") == b"hello" and z.testzip() is None
    (m,) = zipfmt.read_zip_directory(BufferSource(stored))
    assert bytes(zipfmt.member_data(BufferSource(stored), m)) == b"hello"
    with pytest.raises(EncodeError):
        zipfmt.encode_stored([("a", [b""]), ("a", [b""])])


def test_inflation_allowance_is_shared_by_all_members() -> None:
    f = io.BytesIO()
    np.savez_compressed(f, a=np.zeros(50_000), b=np.zeros(50_000))
    data = f.getvalue()
    back = npy.read_npz(data)
    assert back["a"].shape == (50_000,)
    # each member alone fits 500 kB; together they do not
    with pytest.raises(FormatError, match="inflates to"):
        npy.read_npz(data, max_inflated=500_000)


@pytest.mark.parametrize(
    "shape", [(), (0,), (1,), (7, 3), (10**12,), (2,) * 30, (10**18, 0), (0, 10**19)]
)
@pytest.mark.parametrize("descr", ["<f4", "|u1", ">i8", "<U7", "|S3", "|b1", "<c16"])
@pytest.mark.parametrize("fortran", [False, True])
def test_canonical_header_fast_path_agrees_with_literal_eval(
    shape: tuple[int, ...], descr: str, fortran: bool
) -> None:
    import ast

    text = npy.npy_header(descr, shape, fortran)[10:].decode("latin1")
    fast = npy._canonical_header(text)
    want = ast.literal_eval(text)
    if fast is not None:  # 20-digit dimensions take the general path
        assert fast == want and type(fast["shape"]) is tuple
    else:
        assert any(d >= 10**19 for d in shape)


@pytest.mark.parametrize(
    "text",
    [
        "{'descr': '<f4', 'fortran_order': False, 'shape': (5), }\n",  # an int, not a tuple
        "{'descr': '<f4', 'fortran_order': False, 'shape': (05,), }\n",
        "{'descr': '<f4', 'fortran_order': 0, 'shape': (5,), }\n",
        "{'shape': (5,), 'descr': '<f4', 'fortran_order': False, }\n",
        "{'descr': '<M8[ns]', 'fortran_order': False, 'shape': (5,), }\n",
    ],
)
def test_canonical_header_leaves_anything_unusual_to_the_general_path(text: str) -> None:
    assert npy._canonical_header(text) is None


def test_crc_mismatch_is_found_in_any_of_many_members() -> None:
    items = {f"a{i}": np.arange(i * 997, dtype=np.float32) for i in range(12)}
    data = ours(items)
    back = npy.read_npz(data)
    assert all(np.array_equal(back[k], v) for k, v in items.items())
    members = zipfmt.read_zip_directory(BufferSource(data))
    for m in (members[3], members[11]):
        bad = bytearray(data)
        bad[m.data_offset + m.size - 1] ^= 0x40
        with pytest.raises(FormatError, match=f"CRC-32 mismatch in member '{m.name}'"):
            npy.read_npz(bytes(bad))
        assert (
            npy.read_npz(bytes(bad), verify_crc=False)[m.name[:-4]].shape
            == items[m.name[:-4]].shape
        )


def test_a_header_that_is_not_a_literal_gives_the_same_error_every_time() -> None:
    header = b"{'descr': f4, 'fortran_order': False, 'shape': (2,), }"  # a name, not a string
    header += b" " * (63 - 10 - len(header)) + b"\n"
    data = npy.MAGIC + b"\x01\x00" + struct.pack("<H", len(header)) + header + bytes(8)
    messages = set()
    for _ in range(3):
        with pytest.raises(FormatError, match="not a Python literal") as caught:
            npy.read_npy(bytes(data))
        messages.add(str(caught.value))
    assert len(messages) == 1 and "0x" not in messages.pop()
