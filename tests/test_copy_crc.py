"""The copy + CRC-32 kernel (pytreeio.copy_crc) against zlib, and the npz reads that use it."""

from __future__ import annotations

import io as _io
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytreeio import copy_crc, npy
from pytreeio import zip as zipfmt
from pytreeio.binary import BufferSource
from pytreeio.errors import FormatError
from pytreeio.io import FileSource
from pytreeio.pools import Warming


def _variants() -> list[Any]:
    """Both register widths this CPU can run (each compiled once for the module)."""
    try:
        features = copy_crc.cpu_features()
        narrow = copy_crc.build(wide=False)
    except (ImportError, RuntimeError):
        return []
    out = [pytest.param(narrow, id="128-bit")]
    if {"vpclmulqdq", "avx2"} <= features:
        out.append(pytest.param(copy_crc.build(wide=True), id="256-bit"))
    return out


VARIANTS = _variants()
needs_kernel = pytest.mark.skipif(not VARIANTS, reason="no copy + CRC-32 kernel on this machine")


def _copy(kernel: copy_crc.CopyCrc, data: bytes, value: int, src_skew: int, dst_skew: int) -> Any:
    src = np.frombuffer(bytes(src_skew) + data, np.uint8)[src_skew:]
    dst = np.full(len(data) + dst_skew + 8, 0xA5, np.uint8)
    crc = kernel(dst.ctypes.data + dst_skew, src.ctypes.data, len(data), value)
    return crc, dst


@needs_kernel
@pytest.mark.parametrize("kernel", VARIANTS)
@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3000),
    value=st.integers(0, 0xFFFFFFFF),
    src_skew=st.integers(0, 31),
    dst_skew=st.integers(0, 31),
)
def test_the_copy_and_its_crc_equal_zlibs(
    kernel: copy_crc.CopyCrc, data: bytes, value: int, src_skew: int, dst_skew: int
) -> None:
    crc, dst = _copy(kernel, data, value, src_skew, dst_skew)
    assert crc == zlib.crc32(data, value)
    n = len(data)
    assert dst[dst_skew : dst_skew + n].tobytes() == data
    # nothing written outside the destination
    assert (dst[:dst_skew] == 0xA5).all() and (dst[dst_skew + n :] == 0xA5).all()


@needs_kernel
@pytest.mark.parametrize("kernel", VARIANTS)
def test_every_length_around_the_blocks_and_a_large_copy(kernel: copy_crc.CopyCrc) -> None:
    rng = np.random.default_rng(3)
    for n in [*range(kernel.min_bytes * 3 + 40), 4096, 65535, (1 << 20) + 13]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        crc, dst = _copy(kernel, data, 0, n % 7, n % 5)
        assert crc == zlib.crc32(data), n
        assert dst[n % 5 : n % 5 + n].tobytes() == data


@needs_kernel
@pytest.mark.parametrize("kernel", VARIANTS)
def test_continuing_values_combine_as_zlibs(kernel: copy_crc.CopyCrc) -> None:
    data = np.random.default_rng(4).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    value = 0
    for a in range(0, len(data), 3001):
        value, _ = _copy(kernel, data[a : a + 3001], value, 0, 0)
    assert value == zlib.crc32(data)


def test_the_fold_constants_move_a_block_on() -> None:
    # x^(k) mod P for the 16-byte fold (Intel's paper lists them for the gzip polynomial)
    assert copy_crc._fold_constant(128) == (0x1751997D0, 0x0CCAA009E)
    assert copy_crc._fold_constant(512) == (0x154442BD4, 0x1C6E41596)


def test_the_kernel_is_off_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTREEIO_NO_NUMBA", "1")
    assert not copy_crc.enabled() and copy_crc.use(1 << 30) is None
    assert not copy_crc.ready(0)


def test_small_copies_never_ask_for_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    monkeypatch.setattr(copy_crc, "_kernel", None)
    monkeypatch.setattr(copy_crc, "_warming", Warming(lambda: built.append(1), "test-copy-crc"))
    assert copy_crc.use(copy_crc.MIN_BYTES - 1) is None and not copy_crc._warming.started
    assert copy_crc.use(copy_crc.MIN_BYTES) is None  # the build starts in the background
    assert copy_crc._warming.thread is not None
    copy_crc._warming.thread.join(10)
    assert built == [1]
    copy_crc.use(copy_crc.MIN_BYTES)
    assert built == [1]  # started once


# --------------------------------------------------------------------------
# npz reads of large members: copied from the mapped file, hashed in the copy
# --------------------------------------------------------------------------


def _archive(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray], bytes]:
    rng = np.random.default_rng(5)
    items = {
        "a": rng.standard_normal((700, 300)).astype(np.float32),  # several pieces
        "small": rng.integers(0, 9, 50, dtype=np.int16),
        "b": rng.standard_normal(300_001),  # odd length: a tail after the last block
        "empty": np.zeros((0, 4), np.float32),
    }
    f = _io.BytesIO()
    np.savez(f, **items)
    path = tmp_path / "x.npz"
    path.write_bytes(f.getvalue())
    return path, items, f.getvalue()


@pytest.fixture
def kernel_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Archives of any size read by pieces of 256 KiB, the kernel ready; counts its copies."""
    if not copy_crc.ready():
        pytest.skip("no copy + CRC-32 kernel on this machine")
    monkeypatch.setattr(zipfmt, "FUSED_MIN", 1)
    monkeypatch.setattr(zipfmt, "_FUSED_PIECE", 256 << 10)
    calls: list[int] = []
    real = zipfmt._run_mapped

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(zipfmt, "_run_mapped", counted)
    return calls


def test_large_members_are_copied_by_the_kernel_bit_for_bit(
    kernel_reads: list[int], tmp_path: Path
) -> None:
    path, items, _ = _archive(tmp_path)
    with FileSource(path) as fs:
        back = npy.read_npz(fs)
    assert kernel_reads  # the mapped path ran
    for k, v in items.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert back[k].tobytes() == v.tobytes()
        assert back[k].flags.c_contiguous


def test_a_flipped_byte_in_a_copied_member_is_named(
    kernel_reads: list[int], tmp_path: Path
) -> None:
    path, _, data = _archive(tmp_path)
    members = zipfmt.read_zip_directory(BufferSource(data))
    for m in members:
        if not m.size:
            continue
        for at in (m.data_offset, m.data_offset + m.size // 2, m.end - 1):
            bad = bytearray(data)
            bad[at] ^= 0x40
            path.write_bytes(bytes(bad))
            with FileSource(path) as fs, pytest.raises(FormatError) as info:
                npy.read_npz(fs)
            err = info.value
            assert "CRC-32 mismatch" in err.reason
            assert (err.path, err.field, err.offset) == (
                str(path),
                f"zip.member[{m.name}]",
                m.data_offset,
            )


def test_a_source_that_cannot_be_mapped_is_read_as_before(
    kernel_reads: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, items, _ = _archive(tmp_path)

    def refuse(self: FileSource) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(FileSource, "mapping", refuse)
    with FileSource(path) as fs:
        back = npy.read_npz(fs)
    assert not kernel_reads
    assert all(back[k].tobytes() == v.tobytes() for k, v in items.items())


def test_copied_pages_leave_the_process_mapping_as_the_copy_goes(
    kernel_reads: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each piece's pages are dropped from the mapping once copied: a load's resident set
    # holds the arrays, not also the whole mapped file
    path, items, data = _archive(tmp_path)
    dropped: list[tuple[int, int]] = []
    real = zipfmt._unmap_pages

    def spy(base: int, a: int, b: int) -> None:
        dropped.append((a, b))
        real(base, a, b)

    monkeypatch.setattr(zipfmt, "_unmap_pages", spy)
    with FileSource(path) as fs:
        back = npy.read_npz(fs)
    assert sorted(dropped)[0][0] == 0 and max(b for _, b in dropped) == len(data)
    covered = 0
    for a, b in sorted(dropped):
        assert a <= covered  # no gap
        covered = max(covered, b)
    assert all(back[k].tobytes() == v.tobytes() for k, v in items.items())


def test_a_build_holds_numbas_compiler_lock_only_when_numba_is_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import contextlib
    import sys
    import types

    monkeypatch.delitem(sys.modules, "numba.core.compiler_lock", raising=False)
    assert isinstance(copy_crc._numba_compiling(), contextlib.nullcontext)  # numba not imported
    fake = types.ModuleType("numba.core.compiler_lock")
    lock = threading.RLock()
    fake.global_compiler_lock = lock  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "numba.core.compiler_lock", fake)
    assert copy_crc._numba_compiling() is lock
