"""npz archives read from files (CRC-32 once per member) and written with hashes taken while writing."""

from __future__ import annotations

import io as _io
import itertools
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.containers import npy
from pytreeio.containers import zip as zipfmt
from pytreeio.core.binary import BufferSource, Deferred, as_memoryview
from pytreeio.core.errors import FormatError
from pytreeio.core.records import Encoded
from pytreeio.io import FileSource, write_file_atomic


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces, pool jobs and thresholds a few hundred bytes large, so small files take every path."""
    monkeypatch.setattr(zipfmt, "_READ_PIECE", 700)
    monkeypatch.setattr(zipfmt, "ARCHIVE_MIN", 1)
    monkeypatch.setattr(zipfmt, "OVERLAP_MIN", 1000)
    monkeypatch.setattr(zipfmt, "OWN_MEMBER_MIN", 1000)  # "big" and "wide" get buffers of their own
    monkeypatch.setattr(zipfmt, "_PARALLEL_MIN", 1)


def _items() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "big": rng.standard_normal(1500).astype(np.float32),  # several pieces, unaligned
        "empty": np.zeros((0, 3), np.float32),
        "odd": rng.integers(0, 255, 333, dtype=np.uint8),
        "scalar": np.array(2.5),
        "wide": rng.standard_normal((7, 91)),
    }


def _savez(items: dict[str, np.ndarray], compressed: bool = False) -> bytes:
    f = _io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(f, **items)
    return f.getvalue()


def _file(tmp_path: Path, data: bytes, name: str = "a.npz") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _read(path: Path, **kw: object) -> dict[str, np.ndarray]:
    with FileSource(path) as fs:
        return npy.read_npz(fs, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# load: read into the members' buffers, then hash each member once
# --------------------------------------------------------------------------


@pytest.mark.parametrize("compressed", [False, True])
def test_fused_read_equals_the_buffer_read(
    small_pieces: None, tmp_path: Path, compressed: bool
) -> None:
    items = _items()
    data = _savez(items, compressed)
    back = _read(_file(tmp_path, data))
    assert list(back) == list(items)
    for k, v in items.items():
        assert back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes()
        assert back[k].tobytes() == npy.read_npz(data)[k].tobytes()


def test_a_flipped_byte_in_any_piece_of_any_member_is_caught(
    small_pieces: None, tmp_path: Path
) -> None:
    items = _items()
    data = _savez(items)
    members = zipfmt.read_zip_directory(BufferSource(data))
    big = next(m for m in members if m.name == "big.npy")
    assert big.size > 5 * zipfmt._READ_PIECE / 2  # the member spans several pieces
    flips = [m.data_offset + m.size - 1 for m in members if m.size]
    flips += list(range(big.data_offset, big.end, 97))  # every piece of the big member
    for at in flips:
        bad = bytearray(data)
        bad[at] ^= 0x10
        path = _file(tmp_path, bytes(bad), "bad.npz")
        owner = next(m for m in members if m.data_offset <= at < m.end)
        with pytest.raises(FormatError) as info:
            _read(path)
        err = info.value
        assert "CRC-32 mismatch" in err.reason
        assert (err.path, err.field, err.offset) == (
            str(path),
            f"zip.member[{owner.name}]",
            owner.data_offset,
        )
        if at >= owner.data_offset + 128:  # past the .npy header: unchecked, the read succeeds
            name = owner.name[: -len(".npy")]
            assert _read(path, verify_crc=False)[name].shape == items[name].shape


def test_the_first_bad_member_in_directory_order_is_named(
    small_pieces: None, tmp_path: Path
) -> None:
    data = bytearray(_savez(_items()))
    members = zipfmt.read_zip_directory(BufferSource(bytes(data)))
    for m in members[1:]:
        data[m.end - 1] ^= 1
    with pytest.raises(FormatError) as info:
        _read(_file(tmp_path, bytes(data)))
    assert info.value.field == f"zip.member[{members[1].name}]"


def _central_crc_offset(data: bytes, name: str) -> int:
    """Where the central directory records ``name``'s CRC-32."""
    at = zipfmt._directory(BufferSource(data)).offset
    while True:
        nlen, elen, clen = (
            int.from_bytes(data[at + i : at + i + 2], "little") for i in (28, 30, 32)
        )
        if data[at + 46 : at + 46 + nlen] == name.encode():
            return at + 16
        at += 46 + nlen + elen + clen


@pytest.mark.parametrize("parallel_min", [1, 1 << 40])
def test_empty_members_and_their_checksums(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, parallel_min: int
) -> None:
    monkeypatch.setattr(zipfmt, "_PARALLEL_MIN", parallel_min)  # the pool, and the calling thread
    data = b"".join(
        bytes(as_memoryview(c))
        for c in zipfmt.encode_stored([("e", [b""]), ("x", [b"hello"]), ("f", [])])
    )
    members, buf, checked = zipfmt.read_archive(FileSource(_file(tmp_path, data)))
    assert [m.size for m in members] == [0, 5, 0] and checked == {"e", "x", "f"}
    assert bytes(buf.read(members[1].data_offset, 5, "x")) == b"hello"
    # an empty member whose directory claims a non-zero CRC is corrupt
    bad = bytearray(data)
    at = _central_crc_offset(data, "e")
    bad[at : at + 4] = (1).to_bytes(4, "little")
    with pytest.raises(FormatError, match="CRC-32 mismatch in member 'e'"):
        zipfmt.read_archive(FileSource(_file(tmp_path, bytes(bad), "b.zip")))
    _, _, none = zipfmt.read_archive(
        FileSource(_file(tmp_path, bytes(bad), "c.zip")), verify_crc=False
    )
    assert none == set()


def test_deflated_members_are_checked_once_inflated(small_pieces: None, tmp_path: Path) -> None:
    items = _items()
    data = bytearray(_savez(items, compressed=True))
    members = zipfmt.read_zip_directory(BufferSource(bytes(data)))
    assert all(m.method == zipfmt.DEFLATED for m in members)
    m = next(m for m in members if m.name == "wide.npy")
    at = _central_crc_offset(bytes(data), m.name)
    data[at] ^= 0x01  # the recorded CRC, not the stream: it inflates fine, then fails the check
    with pytest.raises(FormatError, match=r"CRC-32 mismatch in member 'wide\.npy'"):
        _read(_file(tmp_path, bytes(data)))


def test_names_are_checked_before_the_data_is_read(tmp_path: Path) -> None:
    data = bytearray(
        b"".join(bytes(as_memoryview(c)) for c in zipfmt.encode_stored([("x.txt", [b"abc"])]))
    )
    data[data.index(b"abc")] ^= 1  # a bad CRC too: the name is what is reported
    with pytest.raises(FormatError, match=r"is not a \.npy array"):
        _read(_file(tmp_path, bytes(data)))


def test_a_file_shorter_than_its_directory_says_is_refused(tmp_path: Path) -> None:
    data = _savez(_items())
    path = _file(tmp_path, data)
    with FileSource(path) as fs:
        members = zipfmt.read_zip_directory(fs)
        path.write_bytes(data[: members[-1].end - 10])  # shrinks under the open descriptor
        with pytest.raises(FormatError) as info:
            zipfmt.read_archive(fs, members=members)
    assert info.value.path == str(path) and "truncated" in info.value.reason


@pytest.mark.parametrize("fmt", ["netcl-params", "netcl-checkpoint"])
def test_load_from_disk_names_the_file_of_a_corrupt_member(
    small_pieces: None, tmp_path: Path, fmt: str
) -> None:
    params = {"p0": np.arange(600, dtype=np.float32), "p1": np.ones((3, 4), np.float32)}
    tree: object = params if fmt == "netcl-params" else {"params": params}
    path = tmp_path / "ck.npz"
    ptio.save(path, tree, format=fmt)
    npz = path if path.exists() else tmp_path / "ck.npz"
    back = ptio.load(path, format=fmt)
    got = back if fmt == "netcl-params" else back["params"]
    assert all(np.array_equal(got[k], v) for k, v in params.items())
    data = bytearray(npz.read_bytes())
    m = zipfmt.read_zip_directory(BufferSource(bytes(data)))[0]
    data[m.data_offset + 200] ^= 4
    npz.write_bytes(bytes(data))
    for mmap in (False, True):
        with pytest.raises(FormatError) as info:
            ptio.load(path, format=fmt, mmap=mmap)
        assert info.value.path == str(npz)
        assert (info.value.field, info.value.offset) == (f"zip.member[{m.name}]", m.data_offset)


# --------------------------------------------------------------------------
# save: hash while writing
# --------------------------------------------------------------------------


def _joined(chunks: list[object]) -> bytes:
    return Encoded(chunks=tuple(chunks)).tobytes()  # type: ignore[arg-type]


def test_overlapped_encoding_is_byte_identical_to_np_savez(small_pieces: None) -> None:
    items = _items()
    chunks = npy.encode_npz(items.items(), overlap=True)
    assert any(isinstance(c, Deferred) and c.late for c in chunks)  # "big" and "wide" overlap
    assert any(isinstance(c, Deferred) and not c.late for c in chunks)
    assert _joined(chunks) == _savez(items)
    assert _joined(npy.encode_npz(items.items())) == _savez(items)  # the eager path too


def test_overlapped_archive_written_by_io_is_np_savez(small_pieces: None, tmp_path: Path) -> None:
    items = _items()
    path = tmp_path / "w.npz"
    write_file_atomic(path, Encoded(chunks=tuple(npy.encode_npz(items.items(), overlap=True))))
    assert path.read_bytes() == _savez(items)
    with np.load(path) as z:
        assert all(np.array_equal(z[k], v) for k, v in items.items())


def test_late_headers_hash_what_was_not_produced_yet(small_pieces: None) -> None:
    items = _items()
    chunks = npy.encode_npz(items.items(), overlap=True)
    # late chunks first: each header hashes its member's chunks itself
    parts = [c.produce() if isinstance(c, Deferred) and c.late else None for c in chunks]
    out = b"".join(
        bytes(
            as_memoryview(p if p is not None else (c.produce() if isinstance(c, Deferred) else c))
        )
        for c, p in zip(chunks, parts)
    )
    assert out == _savez(items)


def test_zip64_offsets_in_an_overlapped_central_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    # offsets past 2 GiB without writing them: the central directory's size must not depend on CRCs
    monkeypatch.setattr(zipfmt, "_ZIP64_LIMIT", 2000)
    monkeypatch.setattr(zipfmt, "OVERLAP_MIN", 1000)
    members = [(f"m{i}", [bytes(range(256)) * 5]) for i in range(4)]
    eager = b"".join(bytes(as_memoryview(c)) for c in zipfmt.encode_stored(members))
    assert _joined(zipfmt.encode_stored(members, overlap=True)) == eager
    got = zipfmt.read_zip_directory(BufferSource(eager))
    assert [m.crc for m in got] == [zlib.crc32(bytes(range(256)) * 5)] * 4


def test_async_save_snapshot_holds_the_checksums_of_what_it_copied(
    small_pieces: None, tmp_path: Path
) -> None:
    params = {"p0": np.arange(4000, dtype=np.float32), "p1": np.ones(300, np.float32)}
    expect = {k: v.copy() for k, v in params.items()}
    path = tmp_path / "a.npz"
    fut = ptio.save_async(path, params, format="netcl-params")
    params["p0"][:] = -1  # after the snapshot: neither the data nor its CRC may see this
    fut.result()
    back = ptio.load(path, format="netcl-params")
    assert all(np.array_equal(back[k], v) for k, v in expect.items())
    assert path.read_bytes() == _savez(expect)


def test_small_files_are_read_whole_and_still_checked(tmp_path: Path) -> None:
    path = tmp_path / "s.npz"
    ptio.save(path, {"p0": np.arange(50, dtype=np.float32)}, format="netcl-params")
    assert path.stat().st_size < zipfmt.ARCHIVE_MIN
    data = bytearray(path.read_bytes())
    m = zipfmt.read_zip_directory(BufferSource(bytes(data)))[0]
    data[m.end - 1] ^= 2
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError) as info:
        ptio.load(path, format="netcl-params")
    assert (info.value.path, info.value.field) == (str(path), "zip.member[p0.npy]")


def test_large_members_are_read_into_buffers_of_their_own(
    small_pieces: None, tmp_path: Path
) -> None:
    items = _items()
    out = _read(_file(tmp_path, _savez(items)))
    for k, v in items.items():
        assert out[k].dtype == v.dtype and out[k].tobytes() == v.tobytes()
    owners = {k: _owner(a) for k, a in out.items()}
    assert owners["big"] is not owners["wide"]
    assert owners["big"].nbytes < 7000 and owners["wide"].nbytes < 6000  # not the whole file
    assert owners["odd"] is owners["scalar"]  # small members: views of the common buffer
    between = len(_savez(items)) - out["big"].nbytes - out["wide"].nbytes
    assert owners["odd"].nbytes < between  # which holds only what the large members' data is not


def _owner(a: np.ndarray) -> np.ndarray:
    """The array that owns ``a``'s memory (through views and memoryviews)."""
    owner, obj = a, a.base
    while isinstance(obj, np.ndarray | memoryview):
        if isinstance(obj, np.ndarray):
            owner, obj = obj, obj.base
        else:
            obj = obj.obj
    return owner


def test_reads_across_segments_are_assembled() -> None:
    whole = np.arange(100, dtype=np.uint8)
    own = [(10, whole[10:30].copy().data), (60, whole[60:80].copy().data)]
    segments = zipfmt._covering(100, own)
    assert [(a, len(b)) for a, b in segments] == [(0, 10), (10, 20), (30, 30), (60, 20), (80, 20)]
    rest = [b for a, b in segments if a in (0, 30, 80)]
    assert all(b.obj is rest[0].obj for b in rest)  # the bytes between: one buffer of 60
    assert len(np.frombuffer(rest[0].obj, np.uint8)) == 60
    for a, b in segments:
        if b.obj is rest[0].obj:
            b[:] = whole[a : a + len(b)].tobytes()
    src = zipfmt._Segments(segments, name="f")
    assert src.size == 100
    for a, b in itertools.combinations(range(101), 2):
        assert bytes(src.read(a, b - a, "x")) == whole[a:b].tobytes(), (a, b)
        assert b"".join(src.targets(a, b)) == whole[a:b].tobytes()
    assert bytes(src.view()) == whole.tobytes()
    assert src.read(15, 5, "x").obj is own[0][1].obj  # within one segment: a view of its buffer
    with pytest.raises(FormatError):
        src.read(90, 11, "x")


def test_mutated_archives_read_from_files_as_from_bytes(small_pieces: None, tmp_path: Path) -> None:
    """The fused read with members in buffers of their own accepts and refuses what the
    in-memory reader does, with the same arrays or the same error."""
    import random

    from fuzz import mutate

    rng = random.Random(11)
    seeds = [_savez(_items()), _savez({"a": np.arange(600, dtype=np.float32)})]
    kinds: list[str] = []
    for i in range(150):
        data, _ = mutate(seeds[i % len(seeds)], rng)
        assert isinstance(data, bytes)
        path = _file(tmp_path, data, f"m{i}.npz")
        from_bytes = _outcome(npy.read_npz, BufferSource(data, name=str(path)))
        assert _outcome(_read, path) == from_bytes, i
        kinds.append(from_bytes[0])
    assert 10 < kinds.count("ok") < 140  # both kinds of outcome were compared


def _outcome(read: Any, source: Any) -> tuple[str, Any]:
    try:
        return "ok", {k: (v.dtype, v.shape, v.tobytes()) for k, v in read(source).items()}
    except FormatError as exc:
        return "error", str(exc)
