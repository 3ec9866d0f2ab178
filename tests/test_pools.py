"""pytreeio.pools: one lazily made pool per use, sized by the process's cores."""

from __future__ import annotations

import os
import threading

from pytreeio import crc, io, pools, transpose


def test_lazy_pool_is_made_once_with_its_size_and_names() -> None:
    made: list[int] = []

    def size() -> int:
        made.append(1)
        return 3

    lazy = pools.LazyPool("pytreeio-test", size)
    assert made == []  # nothing until the first use
    pool = lazy.get()
    assert lazy.get() is pool and made == [1] and pool._max_workers == 3
    names = set(pool.map(lambda _: threading.current_thread().name, range(6)))
    assert names and all(n.startswith("pytreeio-test") for n in names)
    lazy._forget()  # what a forked child does
    assert lazy.get() is not pool
    pool.shutdown()


def test_cores_follow_the_affinity_and_every_per_core_pool_uses_them() -> None:
    n = pools.cores()
    assert 1 <= n <= pools.MAX_THREADS
    if hasattr(os, "sched_getaffinity"):
        assert n == min(pools.MAX_THREADS, len(os.sched_getaffinity(0)))
    assert transpose.threads() == crc.threads() == n
    assert transpose.pool()._max_workers == crc.pool()._max_workers == n
    assert io._get_pool()._max_workers == 4  # the reads: page faults in parallel
