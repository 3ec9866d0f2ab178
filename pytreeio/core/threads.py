"""Thread pools for GIL-releasing work (copies, hashes, reads): made on first use, new in a forked child.

Each pool is a `LazyPool`; `pool` is the shared one for copies
and reads, `cores` how many threads a per-core pool gets, and
`share` runs a list of jobs on the calling thread and a pool's.
A forked child inherits a pool object but none of its threads, so jobs sent
to it would wait forever: every pool forgets itself after a fork and the
child's first job starts a new one.

Every pool comes from `new_pool`: once the interpreter has begun to exit (an
``atexit`` handler that saves a last checkpoint), ``concurrent.futures``
takes no new jobs and starts no threads, so a job submitted then runs at
once on the submitting thread instead of failing.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from concurrent.futures import Executor, Future, ThreadPoolExecutor

__all__ = ["LazyPool", "cores", "exiting", "new_pool", "pool", "share"]

_T = TypeVar("_T")


def exiting() -> bool:
    """Whether the interpreter has begun to exit (``concurrent.futures`` takes no new jobs)."""
    futures_thread = sys.modules.get("concurrent.futures.thread")
    return bool(
        getattr(futures_thread, "_shutdown", False) or getattr(threading, "_SHUTTING_DOWN", False)
    )


def new_pool(workers: int, prefix: str = "") -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose jobs run on the caller's thread once the interpreter exits.

    Made while the interpreter exits (``concurrent.futures.thread`` can no
    longer even be imported then), it is an `_Inline` executor.
    """
    if exiting():
        return _inline_class()()  # type: ignore[return-value]
    return _pool_class()(workers, thread_name_prefix=prefix)


def _run_now(fn: Callable[..., Any], args: Any, kwargs: Any) -> Future[Any]:
    from concurrent.futures import Future  # concurrent.futures._base: importable at exit

    done: Future[Any] = Future()
    try:
        done.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # delivered through the future, as a pool would
        done.set_exception(exc)
    return done


@cache
def _pool_class() -> type[ThreadPoolExecutor]:
    # concurrent.futures (and the logging it imports) loads on the first pool, not at import
    from concurrent.futures import ThreadPoolExecutor

    class Pool(ThreadPoolExecutor):
        """Jobs run on the threads that could start: none at exit, or fewer than asked for
        where the process may not start more (an address-space limit such as ``ulimit -v``
        counts each thread's stack and malloc arena)."""

        def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
            if not exiting():
                try:
                    return super().submit(fn, *args, **kwargs)
                except RuntimeError:
                    if self._shutdown:  # type: ignore[attr-defined]  # submitted after shutdown()
                        raise
            return _run_now(fn, args, kwargs)

        def _adjust_thread_count(self) -> None:
            # called by submit, under its lock, after the job is queued
            try:
                super()._adjust_thread_count()  # type: ignore[misc]
            except RuntimeError:
                if self._threads:  # type: ignore[attr-defined]
                    return  # a thread could not start: the running ones take the job
                # None runs: take the job back (no thread started later may run it
                # again) and let submit run it on the caller's thread.
                with contextlib.suppress(queue.Empty):
                    while True:
                        self._work_queue.get_nowait()  # type: ignore[attr-defined]
                raise

    return Pool


@cache
def _inline_class() -> type:
    from concurrent.futures import Executor

    class _Inline(Executor):
        """Runs every job at once on the submitting thread (the interpreter is exiting)."""

        def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
            return _run_now(fn, args, kwargs)

    return _Inline


#: Per-core pools stop growing here: beyond it more threads only contend for memory bandwidth.
MAX_THREADS = 8


def cores() -> int:
    """The cores this process may run on (its CPU affinity where known), 1 to `MAX_THREADS`."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, n))


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``size()`` threads named ``prefix-N``, made by the first `get`."""

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
                if exiting():  # no threads start now: jobs run on the caller's thread
                    return new_pool(1)
                self._pool = new_pool(self._size(), self._prefix)
            return self._pool

    def _forget(self) -> None:
        # the parent's lock may have been held by one of its threads at the fork
        self._pool, self._lock = None, threading.Lock()


_POOL = LazyPool("pytreeio")


def pool() -> ThreadPoolExecutor:
    """The process-wide pool for GIL-releasing copies and reads (`cores` threads)."""
    return _POOL.get()


def share(pool: Executor, workers: int, fn: Callable[[Any], _T], jobs: Sequence[Any]) -> list[_T]:
    """``[fn(job) for job in jobs]``, run by this thread and ``workers - 1`` of the pool's threads.

    Each thread takes the next job as it frees up (one hand-off per thread,
    not per job, and no job queued behind a busy thread while another
    idles), this one included instead of waiting.  The first failure stops
    every thread from taking another job and is raised once none runs: no
    job still uses the caller's buffers when this returns or raises.
    """
    from concurrent.futures import wait

    results: list[Any] = [None] * len(jobs)
    order = iter(range(len(jobs)))  # next() on it is atomic under the GIL
    stop: list[bool] = []

    def work() -> None:
        try:
            for j in order:
                if stop:
                    return
                results[j] = fn(jobs[j])
        except BaseException:
            stop.append(True)
            raise

    helpers = [pool.submit(work) for _ in range(min(workers, len(jobs)) - 1)]
    try:
        work()
    finally:
        # A helper still queued behind other work on the pool has nothing left to do: it is
        # cancelled, and not waited for (a cancelled future counts as done only once a pool
        # thread dequeues it).
        wait([f for f in helpers if not f.cancel()])
    for f in helpers:
        if not f.cancelled():
            f.result()  # a helper's failure
    return results
