"""npz reads replayed from a plan give exactly what the reader gives, and only where it would.

:mod:`pytreeio.npz_plans` rebuilds the arrays of an in-memory archive whose
bytes outside the array data and CRC-32 fields equal those of one read
before.  Every test compares a replayed read with the reader's own result
for the same bytes, with no plans (arrays: names, order, dtypes, shapes,
strides, bytes, writeability; errors: type, message and location), and checks
that the plan is used only where nothing but data differs.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import bytes_changed, skeleton_flips, swapped
from hypothesis import given, settings

import pytreeio as ptio
from pytreeio import npy, npz_plans
from pytreeio import zip as zipmod
from pytreeio.errors import FormatError, PytreeioError
from pytreeio.layouts import Memo
from pytreeio.skeleton import Shelf


@pytest.fixture(autouse=True)
def no_plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(npz_plans, "_PLANS", Shelf(npz_plans.MAX_PLANS))
    yield


def _items(seed: int = 0, layers: int = 24) -> list[tuple[str, Any]]:
    rng = np.random.default_rng(seed)
    items: list[tuple[str, Any]] = []
    for i in range(layers):
        items.append((f"p{2 * i}", rng.standard_normal((3 + i % 4, 5), dtype=np.float32)))
        items.append((f"p{2 * i + 1}", rng.standard_normal(5).astype(np.float64)))
    items.append(("fortran", np.asfortranarray(rng.standard_normal((3, 4)))))
    items.append(("empty", np.zeros((0, 3), np.float32)))
    items.append(("scalar", np.int64(7)))
    items.append(("text", np.array("a meta document")))
    return items


def _archive(items: list[tuple[str, Any]]) -> bytes:
    return b"".join(bytes(c) for c in npy.encode_npz(items))


def _read(data: bytes, **kw: Any) -> dict[str, np.ndarray]:
    return npy.read_npz(memoryview(bytearray(data)), **kw)


def _outcome(data: bytes, **kw: Any) -> Any:
    try:
        arrays = _read(data, **kw)
    except PytreeioError as exc:
        return (type(exc), str(exc), exc.__dict__)
    return [
        (k, a.dtype.str, a.shape, a.strides, a.flags.writeable, a.tobytes())
        for k, a in arrays.items()
    ]


def _parsed(data: bytes, **kw: Any) -> Any:
    """What the reader itself gives (no plan to replay)."""
    with swapped(npz_plans, "_PLANS", Shelf(npz_plans.MAX_PLANS)):
        return _outcome(data, **kw)


def _learnt(data: bytes) -> npz_plans.Plan:
    _read(data)
    _read(data)  # learnt at the second read of an archive of this length
    assert len(npz_plans._PLANS.plans) == 1
    return npz_plans._PLANS.plans[0]


def test_first_read_learns_nothing_second_learns_third_replays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = _archive(_items())
    _read(data)
    assert npz_plans._PLANS.plans == []  # a one-off load pays nothing for a plan
    _read(data)
    assert len(npz_plans._PLANS.plans) == 1
    calls: list[int] = []
    walk = zipmod.read_zip_directory
    monkeypatch.setattr(zipmod, "read_zip_directory", lambda *a: calls.append(1) or walk(*a))
    replayed = _outcome(data)
    assert not calls  # replayed: no walk of the directory
    assert replayed == _parsed(data)


def test_other_values_same_structure_are_replayed_with_the_new_values() -> None:
    _learnt(_archive(_items(seed=0)))
    data = _archive(_items(seed=1))
    assert npz_plans.replay(memoryview(bytearray(data))) is not None
    assert _outcome(data) == _parsed(data)


@pytest.mark.parametrize(
    "change",
    [
        lambda items: [("q0", items[0][1]), *items[1:]],  # a name of the same length
        lambda items: [("p0", items[0][1].reshape(5, -1)), *items[1:]],  # same bytes, shape
        lambda items: [("p0", items[0][1].view(np.int32)), *items[1:]],  # same bytes, dtype
    ],
)
def test_a_different_skeleton_is_read(change: Any) -> None:
    _learnt(_archive(_items()))
    data = _archive(change(_items()))
    assert len(data) == len(_archive(_items()))  # same length: only the bytes tell
    assert npz_plans.replay(memoryview(bytearray(data))) is None
    assert _outcome(data) == _parsed(data)


def test_random_skeleton_byte_flips_are_read_or_refused_as_the_reader_does() -> None:
    data = _archive(_items())
    plan = _learnt(data)
    for bad in skeleton_flips(data, plan.skeleton.positions, 150, 0x5A):
        assert npz_plans.replay(memoryview(bad)) is None
        assert _outcome(bytes(bad)) == _parsed(bytes(bad))


def test_data_changed_without_its_crc_is_refused_as_the_reader_does() -> None:
    data = _archive(_items())
    plan = _learnt(data)
    name, (_, stop) = plan.names[3], plan.spans[3]
    bad = bytearray(data)
    bad[stop - 1] ^= 0xFF  # the last byte of the member: its array's data
    assert npz_plans.replay(memoryview(bad)) is None
    with pytest.raises(FormatError, match="CRC-32 mismatch") as caught:
        _read(bytes(bad))
    assert caught.value.field == f"zip.member[{name}.npy]"
    assert _outcome(bytes(bad)) == _parsed(bytes(bad))
    # unchecked, the data is what is read, replayed or not
    assert npz_plans.replay(memoryview(bad), verify_crc=False) is not None
    assert _outcome(bytes(bad), verify_crc=False) == _parsed(bytes(bad), verify_crc=False)


def test_data_changed_with_its_central_crc_is_replayed() -> None:
    data = _archive(_items())
    plan = _learnt(data)
    start, stop = plan.spans[5]
    good = bytearray(data)
    good[stop - 1] ^= 0x01
    crc_at = int(plan.crc_at[4 * 5])
    struct.pack_into("<I", good, crc_at, zlib.crc32(good[start:stop]))
    assert npz_plans.replay(memoryview(good)) is not None
    assert _outcome(bytes(good)) == _parsed(bytes(good))


def test_the_local_crc_field_is_ignored_by_both() -> None:
    data = _archive(_items())
    plan = _learnt(data)
    members = zipmod.read_zip_directory(zipmod.BufferSource(data))
    odd = bytearray(data)
    odd[members[2].header_offset + 14] ^= 0xFF  # the reader checks the central record's CRC
    assert npz_plans.replay(memoryview(odd)) is not None
    assert _outcome(bytes(odd)) == _parsed(bytes(odd))
    assert plan is npz_plans._PLANS.plans[0]


def test_replayed_arrays_are_fresh_views_of_the_new_buffer() -> None:
    data = _archive(_items())
    _learnt(data)
    buf = bytearray(data)
    assert npz_plans.replay(memoryview(buf)) is not None  # the reads below are replayed
    a = npy.read_npz(memoryview(buf))
    b = npy.read_npz(memoryview(buf))
    assert a is not b
    a.clear()
    assert "p0" in b
    assert np.shares_memory(b["p0"], np.frombuffer(buf, np.uint8))
    assert b["fortran"].flags.f_contiguous and not b["fortran"].flags.c_contiguous


def test_small_and_deflated_archives_are_not_learnt(tmp_path: Path) -> None:
    small = _archive(_items(layers=4))
    for _ in range(3):
        _read(small)
    path = tmp_path / "c.npz"
    np.savez_compressed(path, **{f"a{i}": np.arange(i + 1) for i in range(40)})
    deflated = path.read_bytes()
    for _ in range(3):
        _read(deflated)
    assert npz_plans._PLANS.plans == []
    assert _outcome(small) == _parsed(small)
    assert _outcome(deflated) == _parsed(deflated)


def test_plans_are_bounded_and_loads_through_the_api_use_them(tmp_path: Path) -> None:
    for n in range(npz_plans.MAX_PLANS + 2):
        longer = _archive([*_items(), ("extra", np.ones(n + 1, np.float32))])
        _read(longer)
        _read(longer)
    assert len(npz_plans._PLANS.plans) == npz_plans.MAX_PLANS
    tree = {"params": {f"Dense_{i}": {"kernel": np.ones((2, 3), np.float32) * i,
                                      "bias": np.arange(3, dtype=np.float32)} for i in range(20)}}  # fmt: skip
    path = tmp_path / "m.npz"
    ptio.save(path, tree, format="netcl")
    first = ptio.load(path, like=tree)
    ptio.load(path, like=tree)
    tree["params"]["Dense_3"]["bias"] = np.full(3, 9, np.float32)
    ptio.save(path, tree, format="netcl")  # same framing, new data
    assert npz_plans.replay(memoryview(path.read_bytes())) is not None
    again = ptio.load(path, like=tree)
    assert np.array_equal(again["params"]["Dense_3"]["bias"], np.full(3, 9, np.float32))
    assert np.array_equal(
        again["params"]["Dense_2"]["kernel"], first["params"]["Dense_2"]["kernel"]
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_mutated_archives_read_as_the_reader_reads_them(data: st.DataObject) -> None:
    whole = _archive(_items())
    _learnt(whole)
    mutated = bytes_changed(whole, data, [0, 1, 0x7F, 0x80, 0xFF])
    for verify_crc in (True, False):
        assert _outcome(mutated, verify_crc=verify_crc) == _parsed(mutated, verify_crc=verify_crc)


# --------------------------------------------------------------------------
# writing through a plan: the bytes the writer writes
# --------------------------------------------------------------------------


@pytest.fixture
def no_write_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(npz_plans, "_WRITE_PLANS", Memo(npz_plans.MAX_PLANS))
    monkeypatch.setattr(npz_plans, "_WRITTEN", Memo(4 * npz_plans.MAX_PLANS))


def _written(items: list[tuple[str, Any]]) -> tuple[list[Any], bytes]:
    chunks = npy.encode_npz(items)
    return chunks, b"".join(bytes(c) for c in chunks)


def _writer_bytes(items: list[tuple[str, Any]]) -> bytes:
    """What the writer itself writes (no plan)."""
    plans, written = npz_plans._WRITE_PLANS, npz_plans._WRITTEN
    npz_plans._WRITE_PLANS, npz_plans._WRITTEN = Memo(4), Memo(16)
    try:
        return b"".join(bytes(c) for c in npy.encode_npz(items))
    finally:
        npz_plans._WRITE_PLANS, npz_plans._WRITTEN = plans, written


@pytest.mark.usefixtures("no_write_plans")
def test_third_write_of_a_layout_goes_through_the_plan_and_writes_the_same_bytes(
    tmp_path: Path,
) -> None:
    _written(_items(seed=0))
    assert npz_plans._WRITE_PLANS == {}  # a one-off save pays nothing for a plan
    _written(_items(seed=0))
    assert len(npz_plans._WRITE_PLANS) == 1
    for seed in (1, 2):
        items = _items(seed=seed)
        chunks, data = _written(items)
        assert len(chunks) == 1 and isinstance(chunks[0], bytearray)  # the plan's one copy
        assert data == _writer_bytes(items)
        path = tmp_path / f"{seed}.npz"
        path.write_bytes(data)
        with np.load(path) as loaded:  # numpy reads it, CRC-32s checked by zipfile
            for name, value in items:
                assert np.array_equal(loaded[name], np.asarray(value))
        import zipfile

        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None


@pytest.mark.usefixtures("no_write_plans")
def test_another_layout_is_written_by_the_writer() -> None:
    items = _items()
    _written(items)
    _written(items)
    changes = [
        [("q0", items[0][1]), *items[1:]],  # a name
        [("p0", items[0][1].reshape(5, -1)), *items[1:]],  # a shape, same bytes
        [("p0", items[0][1].astype(np.float64)), *items[1:]],  # a dtype
        [*items, ("extra", np.ones(2, np.float32))],  # one more member
    ]
    for other in changes:
        _, data = _written(other)
        assert data == _writer_bytes(other)


@pytest.mark.usefixtures("no_write_plans")
def test_archives_of_large_arrays_are_not_planned() -> None:
    items = [(f"a{i}", np.full(2048, i, np.float32)) for i in range(40)]  # 8 KiB each
    for _ in range(3):
        _, data = _written(items)
    assert npz_plans._WRITE_PLANS == {}
    assert data == _writer_bytes(items)


@pytest.mark.usefixtures("no_write_plans")
def test_saves_through_the_api_round_trip_through_the_plan(tmp_path: Path) -> None:
    tree = {"params": {f"Dense_{i}": {"kernel": np.full((2, 3), i, np.float32),
                                      "bias": np.arange(3, dtype=np.float32)} for i in range(20)}}  # fmt: skip
    for fmt in ("netcl", "netcl-params"):
        path = tmp_path / f"{fmt}.npz"
        for step in range(4):
            tree["params"]["Dense_5"]["bias"] = np.full(3, step, np.float32)
            ptio.save(path, tree, format=fmt)
            assert path.read_bytes() == _writer_bytes(
                [(k, v) for k, v in npy.read_npz(path.read_bytes()).items()]
            )
            again = ptio.load(path, like=tree)
            assert np.array_equal(again["params"]["Dense_5"]["bias"], np.full(3, step, np.float32))
