"""Host transposes: a strided (transposed) numpy view copied into C order, tiled, on the cores.

numpy copies a transposed 2-D view element by element in the destination's
order, one cache miss per element.  :func:`copy_transposed` copies bands of
:data:`_TILE` source rows instead (whole cache lines read, ``_TILE``
consecutive values written per destination row), and numpy releases the GIL
in array copies, so a large copy is split into row ranges done at the same
time on :func:`pool` (one thread per core).  Every element is copied, never
computed: the result is bit-identical to ``view.copy()``.

:class:`Pipeline` runs a sequence of such copies ahead of a consumer (a file
writer): while band ``i`` is written, bands ``i+1 ... i+depth`` are copied on
the pool (and by the writer itself rather than wait for one), so at most
``depth + 1`` bands exist at a time.

Where numba is installed, large same-dtype 2-D copies go through a compiled
kernel of vector register blocks instead (:mod:`pytreeio.kernels`, about 2.5x
the numpy tiles; ``PYTREEIO_NO_NUMBA=1`` keeps the numpy tiles).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from . import kernels
from .pools import LazyPool, cores, cores_taken

if TYPE_CHECKING:  # not at run time: the module cannot be imported once the interpreter exits
    from concurrent.futures import ThreadPoolExecutor

__all__ = ["copy_transposed", "pool", "threads", "Pipeline"]

#: Rows of the source copied per step: 16 float32 values are one 64-byte cache
#: line of each destination row.
_TILE = 16

#: Below this many bytes a copy stays on the calling thread (a pool hand-off
#: costs more than it saves).
_PARALLEL_MIN = 1 << 20

_POOL = LazyPool("pytreeio-copy")


def threads() -> int:
    """Worker threads of :func:`pool`: the cores this process may run on (at most 8)."""
    return cores()


def pool() -> ThreadPoolExecutor:
    """The process-wide pool for GIL-releasing copies and reads (created on first use)."""
    return _POOL.get()


def _tiles(src: np.ndarray, dst: np.ndarray, start: int, stop: int) -> None:
    for i in range(start, stop, _TILE):
        j = min(i + _TILE, stop)
        dst[i:j] = src[i:j]


def copy_transposed(
    view: np.ndarray, out: np.ndarray, *, parallel: bool = True, array_nbytes: int | None = None
) -> None:
    """``out[...] = view`` for a C-contiguous ``out`` and a strided (transposed) ``view``.

    A 2-D view whose columns are closer in memory than its rows is copied in
    tiles, split over :func:`pool`'s threads when it is large and
    ``parallel`` (the calling thread does one share; a caller that already
    runs on the pool passes ``parallel=False``).  Other layouts go through
    ``np.copyto``.  ``out`` may differ from ``view`` in byte order only.
    ``array_nbytes``: the bytes of the whole array when ``view`` is one band
    of it (the compiled kernel is worth loading for a large array's small bands).
    """
    if view.shape != out.shape:
        raise ValueError(f"shapes differ: {view.shape} into {out.shape}")
    if not (view.ndim == 2 and view.shape[1] > 0 and abs(view.strides[0]) < abs(view.strides[1])):
        np.copyto(out, view, casting="equiv")
        return
    parts = threads() if parallel and view.nbytes >= _PARALLEL_MIN else 1
    whole = view.nbytes if array_nbytes is None else array_nbytes
    if kernels.transposable(view, out) and kernels.use(whole):
        _compiled(view, out, parts)
        return
    src, dst = view.T, out.T  # src rows are (nearly) contiguous runs of the source
    rows = src.shape[0]
    if parts <= 1 or rows < 2 * _TILE:
        _tiles(src, dst, 0, rows)
        return
    share = -(-rows // parts // _TILE) * _TILE
    bounds = [(s, min(s + share, rows)) for s in range(0, rows, share)]
    jobs = [pool().submit(_tiles, src, dst, s, e) for s, e in bounds[1:]]
    try:
        _tiles(src, dst, *bounds[0])
    finally:
        for job in jobs:  # none may write into `out` once we return
            job.result()


def _compiled(view: np.ndarray, out: np.ndarray, parts: int) -> None:
    """:func:`copy_transposed` by the compiled kernel, rows of ``out`` split over ``parts`` threads."""
    rows = out.shape[0]
    tile = kernels.tile()
    share = max(tile, -(-rows // parts // tile) * tile)
    bounds = [(s, min(s + share, rows)) for s in range(0, rows, share)]
    jobs = [pool().submit(kernels.transpose, view, out, s, e) for s, e in bounds[1:]]
    try:
        kernels.transpose(view, out, *bounds[0])
    finally:
        for job in jobs:  # none may write into `out` once we return
            job.result()


class Pipeline:
    """Buffers produced in order by ``makers``, made ahead of their turn by pool workers.

    ``take(i)`` returns maker ``i``'s result, after letting makers up to
    ``i + depth`` start; nothing starts before the first ``take``.  Up to
    ``workers`` jobs on :func:`pool` make them in order (default: one per
    core but the consumer's, at most 4: a transposing maker runs at about
    half a page-cache writer's speed, so two can fall behind one writer on a
    many-core machine; measured 0.57x of a raw write with two on a 16-core
    host), and at most ``depth`` (default ``4 * workers``, at most 8) are made
    ahead of the consumer.
    A consumer whose buffer is still being made does not wait idle: it makes
    the next buffer no worker has started, so a writer that writes faster
    than one core makes buffers keeps every core busy to the end.  A
    consumer that takes out of order, or again, still gets the right buffer
    (made on demand); a maker's exception comes out of the ``take`` of its index.
    A consumer inside :func:`pytreeio.pools.taking_cores` (one of several file
    writers, a thread per core) makes each buffer itself when it takes it:
    there is no idle core to make it ahead on.
    """

    def __init__(
        self,
        makers: Sequence[Callable[[], Any]],
        depth: int | None = None,
        workers: int | None = None,
    ) -> None:
        self._makers = list(makers)
        self._workers = max(1, min(4, threads() - 1)) if workers is None else max(1, workers)
        # bounded: each buffer made ahead is memory a save holds beyond the tree
        self._depth = min(8, 4 * self._workers) if depth is None else max(1, depth)
        self._jobs: dict[int, Future[Any]] = {}  # claimed (made or being made), not yet taken
        self._next = 0  # the first maker not yet claimed
        self._limit = 0  # makers below this may be claimed
        self._active = 0  # worker jobs on the pool
        self._lock = threading.Lock()

    def take(self, i: int) -> Any:
        ahead = not cores_taken()  # inside taking_cores no core is idle: nothing made ahead
        start = 0
        with self._lock:
            job = self._jobs.pop(i, None)
            if ahead:
                if job is None and i >= self._next:
                    self._next = i + 1  # made here, now; any skipped are made when taken
                self._limit = max(self._limit, min(len(self._makers), i + 1 + self._depth))
                start = max(0, min(self._workers - self._active, self._limit - self._next))
                self._active += start
        for _ in range(start):
            pool().submit(self._work)
        if job is None:  # not claimed ahead (the first take, or out of order): made here
            return self._makers[i]()
        while ahead and not job.done():
            with self._lock:
                claimed = self._claim()
            if claimed is None:
                break  # nothing else to make: wait for it
            self._run(*claimed)
        return job.result()

    def _claim(self) -> tuple[int, Future[Any]] | None:
        """The next maker allowed to start and the future of its result (under ``_lock``)."""
        if self._next >= self._limit:
            return None
        k = self._next
        self._next += 1
        job: Future[Any] = Future()
        self._jobs[k] = job
        return k, job

    def _run(self, k: int, job: Future[Any]) -> None:
        try:
            result = self._makers[k]()
        except BaseException as exc:
            job.set_exception(exc)  # comes out of take(k)
            if not isinstance(exc, Exception):
                raise  # an interrupt also stops the thread it hit
            return
        job.set_result(result)

    def _work(self) -> None:
        """One pool worker: make buffers in order until none may start yet."""
        while True:
            with self._lock:
                claimed = self._claim()
                if claimed is None:
                    self._active -= 1
                    return
            try:
                self._run(*claimed)
            except BaseException:
                with self._lock:
                    self._active -= 1
                raise
