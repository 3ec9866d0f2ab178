"""pytreeio.core.threads: lazily made pools sized by the process's cores, and share."""

from __future__ import annotations

import os
import threading

import pytest

from pytreeio.core import threads as pools


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
    assert pools.pool()._max_workers == n


def limit_threads(monkeypatch: pytest.MonkeyPatch, allowed: int) -> list[str]:
    """Thread.start succeeds ``allowed`` times, then fails as under ``ulimit -v``; names refused."""
    refused: list[str] = []
    start = threading.Thread.start
    left = [allowed]

    def limited(self: threading.Thread) -> None:
        if left[0] <= 0:
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        left[0] -= 1
        start(self)

    monkeypatch.setattr(threading.Thread, "start", limited)
    return refused


def test_jobs_run_once_on_the_caller_when_no_thread_can_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = limit_threads(monkeypatch, 0)
    pool = pools.new_pool(4, "pytreeio-test")
    runs: list[str] = []

    def job(i: int) -> int:
        runs.append(threading.current_thread().name)
        return i * i

    assert [pool.submit(job, i).result() for i in range(5)] == [0, 1, 4, 9, 16]
    assert runs == [threading.current_thread().name] * 5 and len(refused) == 5
    monkeypatch.undo()  # threads may start again: nothing queued earlier runs twice
    assert pool.submit(job, 5).result() == 25
    pool.shutdown(wait=True)
    assert len(runs) == 6


def test_jobs_go_to_the_threads_that_could_start(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = limit_threads(monkeypatch, 1)
    pool = pools.new_pool(4, "pytreeio-test")
    gate = threading.Event()
    runs: list[int] = []

    def job(i: int) -> int:
        gate.wait(5)  # the first job holds the one thread while the others queue
        runs.append(i)
        return i

    futures = [pool.submit(job, i) for i in range(6)]
    gate.set()
    assert [f.result(timeout=5) for f in futures] == list(range(6))
    assert sorted(runs) == list(range(6)) and refused  # each exactly once
    pool.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        pool.submit(job, 7)  # after shutdown: still an error


# -- share: jobs run by this thread and pool helpers --------------------------


def test_shared_jobs_run_once_each_in_order_of_results() -> None:
    pool = pools.pool()
    for workers in (2, pools.cores() + 1):
        assert pools.share(pool, workers, lambda j: j * j, list(range(100))) == [
            j * j for j in range(100)
        ]


def test_shared_jobs_finish_on_this_thread_when_the_pool_is_busy() -> None:
    import threading

    pool = pools.pool()
    release = threading.Event()
    busy = [pool.submit(release.wait) for _ in range(pools.cores())]
    try:
        # every pool thread blocked: the helpers never start, this thread does every job
        assert pools.share(pool, pools.cores() + 1, lambda j: j + 1, list(range(50))) == list(
            range(1, 51)
        )
    finally:
        release.set()
    assert all(f.result(timeout=10) for f in busy)


@pytest.mark.parametrize("failing", [0, 37])
def test_a_failed_job_stops_the_others_and_none_runs_after(failing: int) -> None:
    import threading
    import time

    ran: list[int] = []
    done = threading.Event()

    def job(j: int) -> int:
        if done.is_set():
            ran.append(-1)  # a job started after share returned
        if j == failing:
            raise OSError(f"job {j}")
        time.sleep(0.001)
        ran.append(j)
        return j

    with pytest.raises(OSError, match=f"job {failing}"):
        pools.share(pools.pool(), 2, job, list(range(200)))
    done.set()
    time.sleep(0.05)
    assert -1 not in ran and len(ran) < 199  # the jobs after the failure were not taken
