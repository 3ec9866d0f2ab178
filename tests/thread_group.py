"""Threads standing for processes: ``fn(coordinator)`` on each member of a thread group.

Shared by ``tests/test_sharding.py`` (one device) and ``tests/sharding_cases.py``
(8 devices, run as a script in a subprocess: it imports this module from its
own directory, which Python puts first on ``sys.path``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


def run_threads(
    count: int,
    fn: Callable[[Any], None],
    devices: Sequence[Any] | None = None,
    *,
    timeout: float = 60,
    join: float = 120,
) -> list[Any]:
    """``fn(coordinator)`` on ``count`` threads; each one's exception, or None when it returned.

    ``devices`` (one set of jax devices per thread) and ``timeout`` go to
    :func:`pytreeio.multihost.thread_group`; each thread is given ``join``
    seconds to finish; one still running then gets a ``TimeoutError`` as its result.
    """
    from pytreeio import multihost

    coords = multihost.thread_group(count, devices, timeout=timeout)
    results: list[Any] = [None] * count

    def run(i: int) -> None:
        try:
            fn(coords[i])
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for i, t in enumerate(threads):
        t.join(join)
        if t.is_alive():
            results[i] = TimeoutError(f"thread {i} still running after {join} s")
    return results
