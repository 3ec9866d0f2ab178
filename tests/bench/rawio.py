"""Raw file I/O baselines shared by the benchmarks: what pytreeio is measured against."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_MAX_WRITE = 1 << 30  # Linux caps one write() just under 2 GiB


def raw_write(path: Path, buffers: Sequence[Any], durable: bool) -> None:
    """``write`` (+ ``fsync``) the buffers to ``path`` with no serialisation at all."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for b in buffers:
            view = memoryview(b).cast("B")
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos : pos + _MAX_WRITE])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def raw_readinto(path: Path, into: Any) -> None:
    """``readinto`` the whole file into a preallocated buffer."""
    with open(path, "rb", buffering=0) as f:
        view = memoryview(into).cast("B")
        pos = 0
        while pos < len(view):
            n = f.readinto(view[pos:])
            if not n:
                raise OSError(f"{path} is shorter than the buffer")
            pos += n
