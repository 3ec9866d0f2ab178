"""CRC-32 (the ZIP/zlib polynomial) at memory speed: pieces hashed in parallel, then combined.

A ZIP member's CRC-32 is one sequential value over its bytes, yet it can be
computed in parallel: ``crc(A + B)`` follows from ``crc(A)``, ``crc(B)`` and
``len(B)`` alone (:func:`combine`).  :func:`crc32_many` splits every buffer
into pieces of at most :data:`PIECE` bytes, hashes the pieces on a thread pool
(the hash releases the GIL) and combines them per buffer; :func:`crc32_start`
does the same in the background while the caller goes on (writes the bytes).

The hash is ISA-L's carry-less-multiply CRC (``isal``, several times faster
than zlib's table-driven one); where that package cannot be installed, zlib's
``crc32`` with the combine computed here in GF(2) gives the same values.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .binary import Buffer, as_memoryview
from .pools import LazyPool, cores

if TYPE_CHECKING:  # not at run time: the module cannot be imported once the interpreter exits
    from concurrent.futures import ThreadPoolExecutor

__all__ = [
    "crc32",
    "raw_crc32",
    "combine",
    "crc32_many",
    "crc32_spans",
    "crc32_start",
    "combine_all",
    "pool",
    "threads",
    "PIECE",
]

#: Bytes hashed per task: large enough that scheduling costs nothing, small enough to spread.
PIECE = 4 << 20
#: Below this many bytes in all, hashing on the calling thread is faster than a hand-off.
_PARALLEL_MIN = 2 * PIECE
_POLY = 0xEDB88320  # CRC-32 polynomial, reflected

_POOL = LazyPool("pytreeio-crc")


@functools.cache
def _backend() -> tuple[Callable[..., int], Callable[[int, int, int], int]]:
    """``(crc32, combine)``: ISA-L's when installed, else zlib's hash and :func:`_gf2_combine`."""
    try:
        from isal import isal_zlib
    except ImportError:  # pragma: no cover - isal has wheels wherever pytreeio runs
        return zlib.crc32, _gf2_combine
    return isal_zlib.crc32, getattr(isal_zlib, "crc32_combine", _gf2_combine)


def crc32(data: Buffer, value: int = 0) -> int:
    """CRC-32 of ``data`` continuing from ``value`` (as ``zlib.crc32``), on this thread."""
    return _backend()[0](as_memoryview(data), value)


def raw_crc32() -> Callable[[Buffer, int], int]:
    """The CRC-32 function :func:`crc32` calls (``f(flat byte buffer, start)``), for loops
    over many small buffers that are byte views already."""
    return _backend()[0]


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    return _backend()[1](crc1, crc2, len2)


# --------------------------------------------------------------------------
# combining in GF(2), for when ISA-L is missing (zlib's crc32_combine is not exposed)
# --------------------------------------------------------------------------


def _times(matrix: Sequence[int], vec: int) -> int:
    """``matrix`` (32 columns as ints) times the bit vector ``vec``."""
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= matrix[i]
        vec >>= 1
        i += 1
    return out


def _square(matrix: Sequence[int]) -> list[int]:
    return [_times(matrix, col) for col in matrix]


@functools.cache
def _zero_operators() -> tuple[tuple[int, ...], ...]:
    """Operators that append 1, 2, 4, 8 ... zero bytes to a CRC register (squares of each other)."""
    one_bit = [_POLY] + [1 << i for i in range(31)]  # one zero bit appended
    op = _square(_square(_square(one_bit)))  # eight zero bits: one byte
    ops = []
    for _ in range(64):
        ops.append(tuple(op))
        op = _square(op)
    return tuple(ops)


def _gf2_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's ``crc32_combine``: shift ``crc1`` past ``len2`` zero bytes, then add ``crc2``."""
    if len2 <= 0:
        return crc1
    for op in _zero_operators():
        if not len2:
            break
        if len2 & 1:
            crc1 = _times(op, crc1)
        len2 >>= 1
    return crc1 ^ crc2


# --------------------------------------------------------------------------
# many buffers, in parallel
# --------------------------------------------------------------------------


def pool() -> ThreadPoolExecutor:
    """The thread pool the hashes run on (:func:`threads` of them), for work that hashes."""
    return _POOL.get()


def threads() -> int:
    """How many threads :func:`pool` has: one per core, up to eight."""
    return cores()


def _pieces(chunks: Sequence[Buffer]) -> list[memoryview]:
    out: list[memoryview] = []
    for chunk in chunks:
        view = as_memoryview(chunk)
        out.extend(view[i : i + PIECE] for i in range(0, len(view), PIECE))
    return out


def crc32_many(buffers: Sequence[Sequence[Buffer]]) -> list[int]:
    """The CRC-32 of each item of ``buffers``, an item being the concatenation of its chunks.

    Pieces of all items are hashed together on a thread pool, so a few large
    buffers and many small ones both keep every core busy.
    """
    hash_, comb = _backend()
    views = [[c if type(c) is bytes else as_memoryview(c) for c in chunks] for chunks in buffers]
    if sum(len(v) for vs in views for v in vs) < _PARALLEL_MIN:
        return [_sequential(vs) for vs in views]  # each hash continues the last: no combine
    items = [_pieces(vs) for vs in views]
    workers = pool()
    futures = [[workers.submit(hash_, p) for p in pieces] for pieces in items]
    results = [[f.result() for f in fs] for fs in futures]
    out: list[int] = []
    for pieces, crcs in zip(items, results):
        value = 0
        for piece, c in zip(pieces, crcs):
            value = comb(value, c, len(piece))
        out.append(value)
    return out


def crc32_spans(view: memoryview, spans: Sequence[tuple[int, int]]) -> list[int]:
    """The CRC-32 of each ``[start, stop)`` span of one buffer (:func:`crc32_many` of its slices)."""
    if sum(b - a for a, b in spans) < _PARALLEL_MIN:  # small: hashed here, one call per span
        hash_ = _backend()[0]
        return [hash_(view[a:b]) for a, b in spans]
    return crc32_many([(view[a:b],) for a, b in spans])


def combine_all(parts: Sequence[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive pieces given as ``(crc, length)`` in order."""
    comb = _backend()[1]
    value = 0
    for c, n in parts:
        value = comb(value, c, n)
    return value


def crc32_start(chunks: Sequence[Buffer]) -> Callable[[], int]:
    """Start hashing the concatenation of ``chunks``; the returned call waits for its CRC-32.

    One task on the thread pool hashes the chunks in order (the hash
    releases the GIL), so the caller can do other work on the same bytes
    meanwhile: a save writes a member's data while its checksum, which the
    header records, is taken.  One task, not one per piece: a single core
    hashes several times faster than a file is written, and every hand-off
    to a pool thread costs the caller a GIL switch.  Inputs below two pieces
    are hashed here and now.
    """
    views = [as_memoryview(c) for c in chunks]
    if sum(len(v) for v in views) < _PARALLEL_MIN:
        value = _sequential(views)
        return lambda: value
    future = pool().submit(_sequential, views)
    return future.result


def _sequential(views: Sequence[Buffer]) -> int:
    hash_ = _backend()[0]
    value = 0
    for v in views:
        value = hash_(v, value)
    return value
