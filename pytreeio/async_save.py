"""Saves that write in the background: `save_async` and `wait_saves`.

``save_async`` does on the caller's thread everything that can fail because
of the tree (choosing the format, checking options, encoding: an
`pytreeio.core.errors.EncodeError` raises before it returns) and takes a
snapshot of the bytes to write: jax arrays are fetched to the host (every
``copy_to_host_async`` is started before the first is waited for), and every
array buffer the encoding refers to is copied, numpy arrays included, so the
caller may change its tree as soon as the call returns.  The atomic write
and its fsyncs then run on a background thread; the returned
`SaveFuture`'s ``result()`` re-raises what the write raised.

Ordering: saves to one destination (async or `pytreeio.save`, same
resolved path) happen in the order they were made; each waits for the one
before it.  Across processes the destination's file lock serialises saves
as it does for synchronous ones.

Memory: each pending save holds its snapshot (about the tree's size) until it
is written.  Together they are bounded: a ``save_async`` whose snapshot would
take the bytes held by pending saves past ``max_pending_bytes`` (by default
`MAX_PENDING_BYTES`) waits, before copying anything, until enough of
them are written; one larger than the bound waits until none is pending, then
goes ahead alone.  So snapshots hold at most ``max(max_pending_bytes, the
largest snapshot)`` bytes, and a training loop that saves faster than the disk
writes slows down to the disk's pace instead of filling memory.

`wait_saves` waits for every pending save; it also runs at interpreter
exit, so a program that ends right after ``save_async`` still writes its last
checkpoint (a failure then is printed to stderr, nobody being left to see it).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import wait as _wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pytreeio import io
from pytreeio.core import shards
from pytreeio.core.binary import Deferred, as_memoryview
from pytreeio.core.calls import keywords_explained
from pytreeio.core.records import Encoded, Format
from pytreeio.core.threads import new_pool, pool
from pytreeio.engine import dispatch

if TYPE_CHECKING:  # not at run time: the module cannot be imported once the interpreter exits
    from concurrent.futures import ThreadPoolExecutor

__all__ = ["SaveFuture", "save_async", "wait_saves", "wait_for"]

PathLike = str | os.PathLike[str]

#: Background writers; saves to different destinations may overlap.
_WORKERS = 2
#: Snapshots at least this large are copied by several threads, in blocks.
_PARALLEL_COPY_MIN = 64 << 20
_COPY_BLOCK = 16 << 20
#: The default bound on the bytes that pending saves' snapshots hold (see the module docstring).
MAX_PENDING_BYTES = 4 << 30


class SaveFuture(Future[None]):
    """The pending write of `save_async`; ``result()`` re-raises its error.

    It cannot be cancelled.  A failure nobody has looked at (through ``result()`` or ``exception()``)
    is raised by `wait_saves`, and printed at interpreter exit.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._observed = False

    def result(self, timeout: float | None = None) -> None:
        self._observed = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._observed = True
        return super().exception(timeout)

    def cancel(self) -> bool:
        """Saves are not cancelled (a later save to the destination counts on this one)."""
        return False

    def _error(self) -> BaseException | None:
        """The error of a finished save, without counting as looking at it."""
        return super().exception(0)


_lock = threading.Lock()
_newest: dict[str, SaveFuture] = {}  # the last save submitted, per destination
_unsettled: set[SaveFuture] = set()  # running, or failed and not yet looked at
_executor: ThreadPoolExecutor | None = None
_room = threading.Condition(_lock)  # notified whenever a save's snapshot is released
_pending_bytes = 0  # held by the snapshots of saves not yet written


def _get_executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = new_pool(_WORKERS, "pytreeio-save")
        return _executor


def _dest_key(path: PathLike) -> str:
    """One name per destination however it is spelt (symlinks resolved, as io's locks do)."""
    if isinstance(path, io.Url):
        return str(path.at(path.key))  # one spelling per object: s3://b/k and s3://b/k/ alike
    p = Path(path)
    if os.path.islink(p):
        return os.path.realpath(p)
    return os.path.join(os.path.realpath(p.parent), p.name)


def wait_for(path: PathLike) -> None:
    """Wait until the saves to ``path`` submitted so far are written (errors stay theirs)."""
    if not _newest:  # the common case of a program that never saves asynchronously
        return
    with _lock:
        pending = _newest.get(_dest_key(path))
    if pending is not None:
        _wait([pending])


dispatch.wait_before_saving(wait_for)  # a plain save waits for the background ones first


def wait_saves(*, timeout: float | None = None) -> None:
    """Wait for every pending `save_async`; raise the first failure nobody has seen.

    Raises ``TimeoutError`` if saves are still running after ``timeout`` seconds.
    """
    with _lock:
        futures = list(_unsettled)
    _, running = _wait(futures, timeout=timeout)
    if running:
        raise TimeoutError(f"{len(running)} save(s) still running after {timeout} s")
    errors = [e for f in futures if not f._observed and (e := f._error()) is not None]
    with _lock:
        _unsettled.difference_update(futures)
    for f in futures:
        f._observed = True
    if errors:
        if len(errors) > 1:
            errors[0].add_note(f"({len(errors) - 1} other background save(s) failed too)")
        raise errors[0]


def _snapshot(encoded: Encoded) -> Encoded:
    """``encoded`` with every buffer it borrows copied into memory of its own.

    ``bytes`` chunks are immutable and kept; the rest (views of the caller's
    arrays, or of host copies of jax arrays) are copied into one allocation
    per file.  `pytreeio.core.binary.Deferred` chunks (the shards of an
    array spread over several devices, streamed tensors) read the caller's
    arrays, so they are produced now, in file order (checksums of streamed
    data are taken as it comes), each copied into the allocation and dropped
    before the next; ``late`` ones (a header recording checksums of the data
    before it) are produced last, before this returns, and written last.
    ``owned`` ones (the chunks of an array on an accelerator, whose host copy
    nothing writes to) are produced now and kept as they are: the
    device-to-host transfer is the snapshot's only copy.
    The orbax handler takes its snapshots with this too.
    """
    if encoded.files is not None:
        files = {k: _snapshot(v) for k, v in encoded.files.items()}
        return Encoded(files=files, deferred=encoded.deferred, strict=encoded.strict)
    # per chunk: kept as is (None), or its size in the allocation
    sizes: list[int | None] = []
    views: list[memoryview | None] = []
    for c in encoded.chunks:
        if type(c) is bytes or (isinstance(c, Deferred) and (c.late or _owned(c))):
            sizes.append(None)
            views.append(None)
        elif isinstance(c, Deferred):
            sizes.append(c.nbytes)
            views.append(None)
        else:
            borrowed = as_memoryview(c)
            sizes.append(len(borrowed))
            views.append(borrowed)
    store = np.empty(sum(n for n in sizes if n is not None), dtype=np.uint8)  # uninitialised
    chunks: list[Any] = []
    copies: list[tuple[memoryview, int]] = []
    pos = 0
    for chunk, size, view in zip(encoded.chunks, sizes, views):
        if size is None:
            chunks.append(as_memoryview(io._produced(chunk)) if _owned(chunk) else chunk)
            continue
        if view is not None:
            copies.append((view, pos))
        else:  # a Deferred: its bytes now, then they go
            data = as_memoryview(io._produced(chunk))  # checked against its declared size
            store[pos : pos + size] = np.frombuffer(data, dtype=np.uint8)
            del data
        chunks.append(store.data[pos : pos + size])
        pos += size
    _copy_into(store, copies)
    # Late chunks (headers recording checksums) are produced now too, once everything
    # before them is: what they record may be computed from the caller's arrays (hashed
    # on other threads while the snapshot copies them), which may change once this returns.
    chunks = [_frozen(c) if isinstance(c, Deferred) and c.late else c for c in chunks]
    return Encoded(chunks=tuple(chunks), deferred=encoded.deferred, strict=encoded.strict)


def _frozen(chunk: Deferred) -> Deferred:
    """A late chunk with its bytes produced now (still written last, at its place)."""
    data = bytes(as_memoryview(io._produced(chunk)))
    return Deferred(chunk.nbytes, functools.partial(bytes, data), late=True)


def _owned(chunk: Any) -> bool:
    """A chunk of jax's read-only host copy of an accelerator array: kept, not copied."""
    return isinstance(chunk, shards.ShardChunk) and chunk.owned and not chunk.late


def _copy_into(store: np.ndarray, copies: list[tuple[memoryview, int]]) -> None:
    """Copy each view to its offset in ``store``; large snapshots in blocks on io's read pool.

    Filling fresh memory costs a page fault per page, which one thread pays
    serially; the blocks let the cores share it (as io's parallel reads do).
    """
    blocks = [
        (view[i : i + _COPY_BLOCK], at + i)
        for view, at in copies
        for i in range(0, len(view), _COPY_BLOCK)
    ]

    def copy(block: tuple[memoryview, int]) -> None:
        view, at = block
        store[at : at + len(view)] = np.frombuffer(view, dtype=np.uint8)

    if len(store) < _PARALLEL_COPY_MIN:
        for block in blocks:
            copy(block)
        return
    for _ in pool().map(copy, blocks):  # re-raises the first failure
        pass


def _reserve(nbytes: int, limit: int) -> None:
    """Wait until a snapshot of ``nbytes`` fits under ``limit`` beside the pending ones; count it.

    One larger than ``limit`` waits until nothing is pending (it could never fit).
    """
    global _pending_bytes
    with _room:
        while _pending_bytes and _pending_bytes + nbytes > limit:
            _room.wait()
        _pending_bytes += nbytes


def _release_bytes(nbytes: int) -> None:
    global _pending_bytes
    with _room:
        _pending_bytes -= nbytes
        _room.notify_all()


def pending_bytes() -> int:
    """Bytes the snapshots of pending saves hold now (what ``max_pending_bytes`` bounds)."""
    with _lock:
        return _pending_bytes


def _write(
    future: SaveFuture,
    before: SaveFuture | None,
    path: PathLike,
    encoded: Encoded,
    fmt: Format,
    durable: bool,
    reserved: int,
) -> None:
    try:
        if before is not None:
            _wait([before])  # submitted earlier to a FIFO pool: already running or done
        future.set_running_or_notify_cancel()  # never cancelled: see SaveFuture.cancel
        io.write_atomic(path, encoded, fmt.layout, durable=durable)
        dispatch.deliver_deferred(encoded)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(None)
    finally:
        del encoded  # the snapshot goes now, not when the future does
        _release_bytes(reserved)
        with _lock:
            if _newest.get(future.path) is future:
                del _newest[future.path]
            if future._error() is None:
                _unsettled.discard(future)


@keywords_explained
def save_async(
    path: PathLike,
    tree: Any,
    *,
    format: str | Format | None = None,
    meta: Mapping[str, Any] | None = None,
    durable: bool = True,
    max_pending_bytes: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> SaveFuture:
    """`pytreeio.save` whose write and fsyncs run in the background.

    Returns once the tree is encoded and its bytes are copied (jax arrays
    fetched from their devices, numpy arrays copied): the caller may then
    modify or delete its arrays.  Errors of the tree itself (``EncodeError``,
    ``TypeError`` for an unknown option, ``UnknownFormatError``) raise here;
    errors of the write (``OSError``, a full disk) raise from the returned
    future's ``result()``.  Saves to the same destination, asynchronous or
    not, happen in the order they were made.  Same arguments as
    `pytreeio.save`, and:

    ``max_pending_bytes``: a bound on the memory the snapshots of pending
    saves hold (this one's included); ``None`` takes `MAX_PENDING_BYTES`
    (4 GiB).  When this save's snapshot would go past it, the call waits,
    after encoding and before copying anything, until enough earlier saves are
    written; a snapshot larger than the bound waits until no save is pending.
    ``0`` makes each call wait for every earlier save (one snapshot at a time).
    """
    path = io.location(path, storage_options)
    limit = MAX_PENDING_BYTES if max_pending_bytes is None else max_pending_bytes
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"max_pending_bytes must be an int >= 0, not {max_pending_bytes!r}")
    fmt = dispatch.format_for_save(path, format)
    encoded = dispatch.encode_tree(fmt, tree, meta, options, path)
    reserved = encoded.nbytes
    _reserve(reserved, limit)
    try:
        encoded = _snapshot(encoded)
    except BaseException:
        _release_bytes(reserved)
        raise
    key = _dest_key(path)
    future = SaveFuture(key)
    executor = _get_executor()
    with _lock:
        before = _newest.get(key)
        _newest[key] = future
        _unsettled.add(future)
    try:
        executor.submit(_write, future, before, path, encoded, fmt, durable, reserved)
    except BaseException:  # interpreter shutting down: nothing will run it
        _release_bytes(reserved)
        with _lock:
            _unsettled.discard(future)
            if _newest.get(key) is future:
                if before is not None:
                    _newest[key] = before
                else:
                    del _newest[key]
        raise
    return future


def _at_exit() -> None:
    try:
        wait_saves()
    except BaseException as exc:  # the program is over: stderr is all that is left
        print(f"pytreeio: a background save failed: {exc!r}", file=sys.stderr)


atexit.register(_at_exit)
