"""pytreeio.crc: parallel CRC-32 equals zlib's over the whole bytes, with either backend."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from pytreeio import crc


def _blob(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("n1,n2", [(0, 0), (0, 5), (5, 0), (1, 1), (3, 1000), (4096, 70001)])
def test_combine_matches_crc_of_concatenation(n1: int, n2: int) -> None:
    a, b = _blob(n1, 1), _blob(n2, 2)
    want = zlib.crc32(a + b)
    assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want
    assert crc._gf2_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want


def test_gf2_combine_agrees_with_backend_for_large_lengths() -> None:
    rnd = random.Random(7)
    for _ in range(50):
        c1, c2, n = (
            rnd.getrandbits(32),
            rnd.getrandbits(32),
            rnd.getrandbits(rnd.choice([8, 33, 62])),
        )
        assert crc._gf2_combine(c1, c2, n) == crc.combine(c1, c2, n)


def test_crc32_continues_like_zlib() -> None:
    data = _blob(100_003)
    assert crc.crc32(data) == zlib.crc32(data)
    assert crc.crc32(data[500:], crc.crc32(data[:500])) == zlib.crc32(data)
    assert crc.crc32(np.frombuffer(data[:100_000], np.float32)) == zlib.crc32(data[:100_000])


@pytest.mark.parametrize("piece", [7, 1 << 12, crc.PIECE])
def test_crc32_many_splits_and_recombines(monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    monkeypatch.setattr(crc, "PIECE", piece)
    monkeypatch.setattr(crc, "_PARALLEL_MIN", 1)  # the thread pool, even for small inputs
    items = [
        [],
        [b""],
        [_blob(1)],
        [_blob(10, 3), memoryview(_blob(100_000, 4)), np.arange(5000, dtype=np.float64)],
        [bytearray(_blob(3 * piece + 1, 5))],
    ]
    want = [
        zlib.crc32(b"".join(bytes(memoryview(c).cast("B")) for c in chunks)) for chunks in items
    ]
    assert crc.crc32_many(items) == want


def test_zlib_fallback_gives_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    data = [[_blob(crc.PIECE * 2 + 3, 9)], [_blob(17, 10)]]
    fast = crc.crc32_many(data)
    monkeypatch.setattr(crc, "_backend", lambda: (zlib.crc32, crc._gf2_combine))
    assert crc.crc32_many(data) == fast == [zlib.crc32(d[0]) for d in data]


def test_pool_works_in_a_forked_child(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    monkeypatch.setattr(crc, "_PARALLEL_MIN", 1)
    data = [[_blob(3 * crc.PIECE + 5, 11)]]
    want = crc.crc32_many(data)  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(crc.crc32_many, (data,)).get(timeout=60) == want


@pytest.mark.parametrize("parallel", [False, True])
def test_crc32_start_equals_zlib_over_the_chunks(
    monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    if parallel:  # pieces of 1000 bytes on the pool
        monkeypatch.setattr(crc, "PIECE", 1000)
        monkeypatch.setattr(crc, "_PARALLEL_MIN", 1)
    chunks = [_blob(n, seed) for seed, n in enumerate([0, 1, 999, 1000, 4321, 17])]
    pending = crc.crc32_start(chunks)
    assert pending() == zlib.crc32(b"".join(chunks))
    assert pending() == zlib.crc32(b"".join(chunks))  # may be asked again
    assert crc.crc32_start([])() == 0


def test_combine_all_of_pieces() -> None:
    blobs = [_blob(n, n) for n in (5, 0, 300, 1)]
    parts = [(zlib.crc32(b), len(b)) for b in blobs]
    assert crc.combine_all(parts) == zlib.crc32(b"".join(blobs))
    assert crc.combine_all([]) == 0
