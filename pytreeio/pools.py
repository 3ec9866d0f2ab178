"""Process-wide thread pools for GIL-releasing work: created on first use, new in a forked child.

Each pool (copies and transposes, CRC hashes, parallel reads) is a
:class:`LazyPool`; :func:`cores` is how many threads the per-core pools get.
A forked child inherits a pool object but none of its threads, so jobs sent
to it would wait forever: every pool forgets itself after a fork and the
child's first job starts a new one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

__all__ = ["LazyPool", "cores"]

#: Per-core pools stop growing here: beyond it more threads only contend for memory bandwidth.
MAX_THREADS = 8


def cores() -> int:
    """The cores this process may run on (its CPU affinity where known), 1 to :data:`MAX_THREADS`."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, n))


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``size()`` threads named ``prefix-N``, made by the first :meth:`get`."""

    def __init__(self, prefix: str, size: Callable[[], int] = cores) -> None:
        self._prefix = prefix
        self._size = size
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self._size(), thread_name_prefix=self._prefix)
            return self._pool

    def _forget(self) -> None:
        # the parent's lock may have been held by one of its threads at the fork
        self._pool, self._lock = None, threading.Lock()
