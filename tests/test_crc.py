"""CRC-32 of members: one hash per member (ISA-L's or zlib's), equal to zlib's over the bytes."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from pytreeio.containers import crc
from pytreeio.containers import zip as zipfmt


def _blob(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_crc32_continues_like_zlib() -> None:
    data = _blob(100_003)
    assert crc.crc32(data) == zlib.crc32(data)
    assert crc.crc32(data[500:], crc.crc32(data[:500])) == zlib.crc32(data)
    assert crc.crc32(np.frombuffer(data[:100_000], np.float32)) == zlib.crc32(data[:100_000])
    assert crc.crc32(bytearray(data)) == crc.crc32(memoryview(data)) == zlib.crc32(data)


@pytest.mark.parametrize("parallel", [False, True])
def test_crc32_each_item_whole(monkeypatch: pytest.MonkeyPatch, parallel: bool) -> None:
    if parallel:
        monkeypatch.setattr(zipfmt, "_PARALLEL_MIN", 1)  # the pool, even for small inputs
    items = [
        b"",
        [],
        [b""],
        _blob(1),
        [_blob(10, 3), memoryview(_blob(100_000, 4)), np.arange(5000, dtype=np.float64)],
        bytearray(_blob(70_001, 5)),
    ]
    want = [
        zlib.crc32(b"".join(bytes(memoryview(c).cast("B")) for c in i))
        if isinstance(i, list)
        else zlib.crc32(i)
        for i in items
    ]
    assert zipfmt.crc32_each(items) == want


def test_pool_works_in_a_forked_child(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    monkeypatch.setattr(zipfmt, "_PARALLEL_MIN", 1)
    data = [_blob(30_005, 11), _blob(7, 12)]
    want = zipfmt.crc32_each(data)  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(zipfmt.crc32_each, (data,)).get(timeout=60) == want
