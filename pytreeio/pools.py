"""Process-wide thread pools for GIL-releasing work: created on first use, new in a forked child.

Each pool (copies and transposes, CRC hashes, parallel reads) is a
:class:`LazyPool`; :func:`cores` is how many threads the per-core pools get.
A forked child inherits a pool object but none of its threads, so jobs sent
to it would wait forever: every pool forgets itself after a fork and the
child's first job starts a new one.

Every pool comes from :func:`new_pool`: once the interpreter has begun to exit (an
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
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["LazyPool", "cores", "exiting", "new_pool", "start_daemon"]


def exiting() -> bool:
    """Whether the interpreter has begun to exit (``concurrent.futures`` takes no new jobs)."""
    futures_thread = sys.modules.get("concurrent.futures.thread")
    return bool(
        getattr(futures_thread, "_shutdown", False) or getattr(threading, "_SHUTTING_DOWN", False)
    )


def start_daemon(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread | None:
    """A started daemon thread running ``target(*args)``, or None where none can start.

    Python 3.12 refuses new threads from ``atexit`` handlers, and an
    address-space limit (``ulimit -v``) may leave no room for one; callers then
    do the work on their own thread.
    """
    if exiting():
        return None
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # exiting, or no thread can start (address-space or thread limits)
        return None
    return thread


def new_pool(workers: int, prefix: str = "") -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose jobs run on the caller's thread once the interpreter exits.

    Made while the interpreter exits (``concurrent.futures.thread`` can no
    longer even be imported then), it is an :class:`_Inline` executor.
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
                if exiting():  # no threads start now: jobs run on the caller's thread
                    return new_pool(1)
                self._pool = new_pool(self._size(), self._prefix)
            return self._pool

    def _forget(self) -> None:
        # the parent's lock may have been held by one of its threads at the fork
        self._pool, self._lock = None, threading.Lock()
