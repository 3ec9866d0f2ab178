"""``ptio.open(path, verify=True)``: what the checkpoint records about its bytes is checked on read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import integrity
from pytreeio.core import binary
from pytreeio.core.errors import FormatError


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "params": {
            "kernel": rng.standard_normal((32, 16)).astype(np.float32),
            "bias": rng.standard_normal(16).astype(np.float32),
        },
        "step": 3,
    }


def _slot(path: Path, key: str, **options: Any) -> binary.Slot:
    """Where ``key``'s bytes lie (an unverified view's slot)."""
    with ptio.open(path, **options) as ck:
        slot = ck._entries()[key]
    assert isinstance(slot, binary.Slot)
    return slot


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_safetensors_flipped_byte_names_file_tensor_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "ck.safetensors"
    tree = _tree()
    ptio.save(path, tree)
    slot = _slot(path, "params/kernel")
    _flip(path, slot.offset + 100)
    with ptio.open(path, verify=True) as ck:
        assert ck.verify
        with pytest.raises(FormatError) as info:
            ck["params/kernel"]
        np.testing.assert_array_equal(ck["params/bias"], tree["params"]["bias"])  # intact
        with pytest.raises(FormatError):  # a subtree load reads the tensor too
            ck.load(like={"kernel": tree["params"]["kernel"]}, prefix="params")
    err = info.value
    assert err.path == str(path)
    assert err.field == "params/kernel"
    assert err.offset == slot.offset
    assert "corrupted" in str(err)
    # without verify the flipped byte comes back unnoticed: the check is what verify adds
    with ptio.open(path) as ck:
        assert not np.array_equal(ck["params/kernel"], tree["params"]["kernel"])


def test_safetensors_verified_reads_are_bit_exact(tmp_path: Path) -> None:
    path = tmp_path / "ck.safetensors"
    tree = {**_tree(), "empty": np.zeros((0, 3), np.int8), "half": np.arange(5, dtype=np.float16)}
    ptio.save(path, tree)
    with ptio.open(path, verify=True) as ck:
        for key, want in ptio.flatten(tree).items():
            got = ck[key]
            if isinstance(want, np.ndarray):
                assert got.dtype == want.dtype and got.shape == want.shape
                assert got.tobytes() == want.tobytes(), key
                assert got.flags.writeable
            else:
                assert got == want
        restored = ck.load(like=tree)
    assert restored["step"] == 3
    assert restored["params"]["kernel"].tobytes() == tree["params"]["kernel"].tobytes()


def test_safetensors_partial_load_with_verify_checks_the_subtree(tmp_path: Path) -> None:
    path = tmp_path / "ck.safetensors"
    tree = _tree()
    ptio.save(path, tree)
    _flip(path, _slot(path, "params/bias").offset)
    like = {"params": {"kernel": tree["params"]["kernel"]}}
    with ptio.open(path, verify=True) as ck:
        got = ck.load(like=like)  # the corrupted tensor is not read
        assert got["params"]["kernel"].tobytes() == tree["params"]["kernel"].tobytes()
        with pytest.raises(FormatError, match="corrupted"):
            ck.load(like={"params": {"bias": tree["params"]["bias"]}})


def test_safetensors_from_other_tools_has_nothing_to_check(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    ptio.save(path, {"a": np.arange(6.0)}, checksum=False)
    _flip(path, _slot(path, "a").offset)
    with ptio.open(path, verify=True) as ck:
        assert ck["a"].shape == (6,)  # no checksum recorded: read as without verify


def test_npz_member_crc_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "p.npz"
    arrays = [np.arange(64, dtype=np.float32), np.ones((4, 4), np.float64)]
    ptio.save(path, arrays, format="netcl-params")
    slot = _slot(path, "p1", format="netcl-params", verify_crc=False)
    _flip(path, slot.offset + 8)
    with ptio.open(path, format="netcl-params", verify=True) as ck:
        np.testing.assert_array_equal(ck["p0"], arrays[0])
        with pytest.raises(FormatError) as info:
            ck["p1"]
    assert info.value.path == str(path)
    assert "CRC-32 mismatch" in str(info.value)
    assert info.value.field == "zip.member[p1.npy]"
    # the member's local header: the CRC covers the whole member, read whole
    assert info.value.offset is not None and info.value.offset < slot.offset
    with pytest.raises(TypeError, match="verify_crc"):
        ptio.open(path, format="netcl-params", verify=True, verify_crc=False)


def test_manifest_is_checked_when_the_view_opens(tmp_path: Path) -> None:
    path = tmp_path / "ck.msgpack"
    tree = _tree()
    ptio.save(path, tree)
    with ptio.open(path, verify=True) as ck:  # no manifest, no checksums: reads as usual
        np.testing.assert_array_equal(ck["params/bias"], tree["params"]["bias"])
    integrity.write_manifest(path)
    with ptio.open(path, verify=True) as ck:
        np.testing.assert_array_equal(ck["params/bias"], tree["params"]["bias"])
    _flip(path, _slot(path, "params/kernel").offset + 5)
    with pytest.raises(FormatError) as info:
        ptio.open(path, verify=True)
    assert info.value.path == str(path.resolve()) and "manifest" in str(info.value)
    with ptio.open(path) as ck:  # without verify the manifest is not read
        assert ck["params/kernel"].shape == (32, 16)


def test_verify_is_refused_where_load_refuses_options(tmp_path: Path) -> None:
    path = tmp_path / "ck.safetensors"
    ptio.save(path, _tree())
    with pytest.raises(TypeError, match="no load option"):
        ptio.open(path, verify=True, nonsense=1)
