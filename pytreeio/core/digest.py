"""Checksums of buffers and arrays: xxHash's XXH3 64-bit hash as 16 lower-case hex digits.

XXH3 hashes a numpy array's own buffer (no copy) at memory speed, several GB/s
per core; ``xxhash`` is imported only when a checksum is computed.  Manifests and
verification (`pytreeio.integrity`) and safetensors' per-tensor checksums use these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from pytreeio.core.threads import LazyPool

__all__ = [
    "ALGORITHM",
    "array_checksum",
    "buffer_checksum",
    "checksums_in_background",
    "stream_checksum",
]

ALGORITHM = "xxh3_64"


def buffer_checksum(data: Any) -> str:
    """The checksum of a bytes-like object (hashed in place)."""
    import xxhash  # only checksums need it

    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def stream_checksum(pieces: Iterable[Any]) -> tuple[int, str]:
    """``(size, checksum)`` of the bytes-like ``pieces`` taken one after another (a file read
    in chunks: bounded memory)."""
    import xxhash

    h = xxhash.xxh3_64()
    size = 0
    for piece in pieces:
        h.update(piece)
        size += len(memoryview(piece))
    return size, f"{h.intdigest():016x}"


def array_checksum(arr: np.ndarray) -> str:
    """The checksum of a C-contiguous array's bytes (its own buffer, no copy)."""
    if not arr.flags.c_contiguous:
        raise ValueError("array_checksum needs a C-contiguous array")
    # numpy's own dtypes export their buffer directly (one call per tensor: per-leaf
    # cost); others (bfloat16, float8) cannot, and are hashed through a byte view.
    data = arr if arr.dtype.isbuiltin == 1 else arr.reshape(-1).view(np.uint8)
    return buffer_checksum(data)


#: Threads that hash tensors while a writer writes them (xxhash releases the GIL).
_HASH_POOL = LazyPool("pytreeio-hash")
#: Arrays are hashed in batches of about this many bytes (one job each).
_HASH_BATCH = 4 << 20


def checksums_in_background(
    arrays: Sequence[tuple[str, np.ndarray]],
) -> Callable[[], dict[str, str]]:
    """Start hashing ``(name, array)`` pairs on every core; returns a function that waits for them.

    For a writer that records checksums in a header written after the data
    (safetensors): the arrays are hashed while their bytes are written instead
    of before.  Arrays are batched into jobs of about `_HASH_BATCH` bytes,
    in order; the function returns ``{name: checksum}`` (the first failure
    raises).  The caller must keep the arrays unchanged until it has waited.
    """
    batches: list[list[tuple[str, np.ndarray]]] = [[]]
    size = 0
    for name, arr in arrays:
        if size >= _HASH_BATCH:
            batches.append([])
            size = 0
        batches[-1].append((name, arr))
        size += arr.nbytes

    def job(batch: list[tuple[str, np.ndarray]]) -> list[tuple[str, str]]:
        return [(name, array_checksum(arr)) for name, arr in batch]

    pool = _HASH_POOL.get()
    futures = [pool.submit(job, batch) for batch in batches if batch]

    def wait() -> dict[str, str]:
        out: dict[str, str] = {}
        for f in futures:
            out.update(f.result())
        return out

    return wait
