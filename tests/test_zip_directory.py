"""The ZIP central directory: names as stored (utf-8 and cp437), zip64 fields, located faults."""

from __future__ import annotations

import io
import zipfile

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


@pytest.mark.parametrize(
    "names",
    [
        [f"p{i}.npy" for i in range(50)],
        ["0:weight.npy", "0:bias.npy", "__netcl_meta__.npy"],
        ["gewicht-ü.npy", "日本.npy"],  # utf-8 flagged names
    ],
)
def test_member_names_in_directory_order(names: list[str]) -> None:
    data = _archive(names)
    assert zipfmt.member_names(BufferSource(data)) == tuple(names)
    assert [m.name for m in zipfmt.read_zip_directory(BufferSource(data))] == names


def test_cp437_names_decode() -> None:
    data = bytearray(_archive(["xy.npy"]))
    for at in (30, data.index(b"PK\x01\x02") + 46):  # local and central copies of the name
        data[at] = 0x81  # 'ü' in cp437, no utf-8 flag
    assert zipfmt.member_names(BufferSource(bytes(data))) == ("üy.npy",)
    assert [m.name for m in zipfmt.read_zip_directory(BufferSource(bytes(data)))] == ["üy.npy"]


def test_zip64_central_fields_are_read_from_the_extra_field() -> None:
    data = _archive(["a.npy", "b.npy"], force_zip64=True)
    members = zipfmt.read_zip_directory(BufferSource(data))
    assert [m.name for m in members] == ["a.npy", "b.npy"]
    raw = bytearray(data)
    cd = raw.index(b"PK\x01\x02")
    raw[cd + 20 : cd + 24] = b"\xff\xff\xff\xff"  # compressed size: "see the zip64 extra field"
    with pytest.raises(FormatError, match="zip64 extra field missing") as err:
        zipfmt.read_zip_directory(BufferSource(bytes(raw), name="a.zip"))
    assert err.value.path == "a.zip" and err.value.offset is not None


@pytest.mark.parametrize(
    "damage",
    ["signature", "name length", "trailing bytes", "bad utf-8"],
)
def test_directory_faults_are_located(damage: str) -> None:
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
    with pytest.raises(FormatError) as err:
        zipfmt.read_zip_directory(src)
    assert err.value.path == "a.zip" and err.value.field and err.value.field.startswith("zip.")
    assert err.value.offset is not None
