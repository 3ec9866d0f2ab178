"""CRC-32 (the ZIP/zlib polynomial): ISA-L's when installed (several times faster), else zlib's.

Both release the GIL, so members hashed on several threads run in parallel.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from pytreeio.core.binary import Buffer, as_memoryview

__all__ = ["crc32"]

_crc32: Callable[[Buffer, int], int]
try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    _crc32 = zlib.crc32


def crc32(data: Buffer, value: int = 0) -> int:
    """CRC-32 of ``data`` continuing from ``value`` (as ``zlib.crc32``)."""
    return _crc32(data if type(data) is bytes else as_memoryview(data), value)
