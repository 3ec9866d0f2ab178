"""The ZIP central directory's two readers: the one-pass parse of well-formed directories and
the checked walk that locates faults must read the same records, and the fast one must hand
every directory with anything unusual in it to the checked one."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pytreeio.containers import zip as zipfmt
from pytreeio.core.binary import BufferSource
from pytreeio.core.errors import FormatError


def _archive(names: list[str], *, force_zip64: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for i, name in enumerate(names):
            with z.open(name, "w", force_zip64=force_zip64) as f:
                f.write(np.arange(i + 3, dtype=np.float32).tobytes())
    return buf.getvalue()


def _records(data: bytes, fast: bool) -> list[tuple[object, ...]]:
    src = BufferSource(data, name="a.zip")
    d = zipfmt._directory(src)
    r = src.reader(d.offset, d.size, "zip.central")
    recs = zipfmt._well_formed_records(r, d.count) if fast else list(zipfmt._checked_records(r, d))
    assert recs is not None
    return [(c.index, c.at, c.raw_name, c.name, c.flags, c.method, c.values) for c in recs]


@pytest.mark.parametrize(
    "names",
    [
        [f"p{i}.npy" for i in range(50)],
        ["0:weight.npy", "0:bias.npy", "__netcl_meta__.npy"],
        ["gewicht-ü.npy", "日本.npy"],  # utf-8 flagged names
    ],
)
def test_fast_and_checked_readers_agree(names: list[str]) -> None:
    data = _archive(names)
    assert _records(data, fast=True) == _records(data, fast=False)
    assert zipfmt.member_names(BufferSource(data)) == tuple(names)


def test_cp437_names_decode_alike() -> None:
    data = bytearray(_archive(["xy.npy"]))
    for at in (30, data.index(b"PK\x01\x02") + 46):  # local and central copies of the name
        data[at] = 0x81  # 'ü' in cp437, no utf-8 flag
    assert _records(bytes(data), fast=True) == _records(bytes(data), fast=False)
    assert zipfmt.member_names(BufferSource(bytes(data))) == ("üy.npy",)


def test_zip64_records_take_the_checked_walk() -> None:
    data = _archive(["a.npy", "b.npy"], force_zip64=True)
    src = BufferSource(data)
    d = zipfmt._directory(src)
    # zipfile writes zip64 sizes only in the local header here; force one central field too
    members = zipfmt.read_zip_directory(src)
    assert [m.name for m in members] == ["a.npy", "b.npy"]
    raw = bytearray(data)
    cd = raw.index(b"PK\x01\x02")
    raw[cd + 20 : cd + 24] = b"\xff\xff\xff\xff"  # compressed size: "see the zip64 extra field"
    r = BufferSource(bytes(raw)).reader(d.offset, d.size, "zip.central")
    assert zipfmt._well_formed_records(r, d.count) is None
    with pytest.raises(FormatError, match="zip64 extra field missing") as err:
        zipfmt.read_zip_directory(BufferSource(bytes(raw), name="a.zip"))
    assert err.value.path == "a.zip" and err.value.offset is not None


@pytest.mark.parametrize(
    "damage",
    ["signature", "name length", "trailing bytes", "bad utf-8"],
)
def test_faults_are_reported_by_the_checked_walk(damage: str) -> None:
    data = bytearray(_archive(["a.npy", "b.npy", "c.npy"]))
    second = data.index(b"PK\x01\x02", data.index(b"PK\x01\x02") + 1)
    if damage == "signature":
        data[second : second + 4] = b"PK\x09\x09"
    elif damage == "name length":
        data[second + 28 : second + 30] = (60000).to_bytes(2, "little")
    elif damage == "trailing bytes":
        end = data.index(b"PK\x05\x06")
        data[end:end] = b"\x00" * 5  # the directory grows 5 bytes the end record does not count
        size_at = end + 5 + 12
        size = int.from_bytes(data[size_at : size_at + 4], "little") + 5
        data[size_at : size_at + 4] = size.to_bytes(4, "little")
    else:
        data[second + 8 : second + 10] = (0x800).to_bytes(2, "little")  # utf-8 flag
        data[second + 46] = 0xFF
    src = BufferSource(bytes(data), name="a.zip")
    d = zipfmt._directory(src)
    r = src.reader(d.offset, d.size, "zip.central")
    assert zipfmt._well_formed_records(r, d.count) is None
    with pytest.raises(FormatError) as err:
        zipfmt.read_zip_directory(src)
    assert err.value.path == "a.zip" and err.value.field and err.value.field.startswith("zip.")
    assert err.value.offset is not None


def test_prefixes_read_with_the_local_headers_are_the_members_first_bytes(tmp_path: Path) -> None:
    """What inspect takes from the local header's read is exactly member_prefix's bytes, for
    stored members of every size; deflated members and a file source's reads are covered too."""
    from pytreeio.io import FileSource

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for i, n in enumerate([0, 5, 127, 128, 129, 4000]):
            z.writestr(zipfile.ZipInfo(f"s{i}.npy"), bytes(range(256)) * (n // 256 + 1))
        z.writestr(zipfile.ZipInfo("tiny.npy"), b"ab")
        z.writestr("packed.npy", b"x" * 5000, compress_type=zipfile.ZIP_DEFLATED)
    (tmp_path / "a.zip").write_bytes(buf.getvalue())
    for src in (BufferSource(buf.getvalue()), FileSource(tmp_path / "a.zip")):
        members, prefixes = zipfmt.read_zip_directory_with_prefixes(src, 128)
        assert members == zipfmt.read_zip_directory(src)
        assert "packed.npy" not in prefixes
        for m in members:
            if m.name in prefixes:
                assert bytes(prefixes[m.name]) == bytes(zipfmt.member_prefix(src, m, 128)), m.name
        assert {m.name for m in members if m.method == zipfmt.STORED} <= set(prefixes)
