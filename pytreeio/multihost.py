"""Saves in parts: one checkpoint file written by every process of a job (`save_in_parts`).

Sharded arrays as leaves (saved shard by shard, loaded device by device) are
`pytreeio.core.shards`; this module adds the protocol between processes.

Every process encodes the tree
with its sharded leaves as placeholders, which fixes the whole file's layout
from the global shapes alone; the processes check that their layouts agree.
The primary process (index 0) then creates the temporary file at its full
size under the lock on the destination's directory (`pytreeio.io.file_in_parts`); each
process ``pwrite``\\ s the byte ranges of the shards it holds (replica 0 only)
and the primary everything else; after a barrier the primary reads back the
sharded data to finish checksums recorded in a header (safetensors), writes
that header, fsyncs and renames the file over the destination: readers see
the old or the new checkpoint, never a mix.  Formats whose files cannot be
written in parts are written by the primary alone when every array is fully
held there, and refused otherwise.  The processes talk through a
`Coordinator` (``exchange``: every process's message to every
process); `JaxCoordinator` uses ``jax.distributed``, tests pass
threads (`thread_group`).

`prepare_in_parts` (encode, agree on the layout) and `PartsSave.write` are
the two halves of `save_in_parts`, for a caller that writes later on another
thread (the orbax handler, in orbax's background commit): with ``snapshot``
the first copies what this process will write to host memory of its own.

jax is imported only by the functions that need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from pytreeio.core.binary import Deferred
from pytreeio.core.calls import keywords_explained
from pytreeio.core.errors import EncodeError, PytreeioError
from pytreeio.core.records import Encoded
from pytreeio.core.shards import (
    ADDRESSABLE,
    IN_PARTS,
    Region,
    ShardChunk,
    ShardedLeaf,
    c_runs,
    host_array,
)

__all__ = [
    "Coordinator",
    "JaxCoordinator",
    "PartsError",
    "PartsSave",
    "prepare_in_parts",
    "save_in_parts",
    "thread_group",
]

#: The longest message a coordinator passes (a temporary file's path, a digest, an error).
MAX_MESSAGE = 8192


class PartsError(PytreeioError):
    """A save in parts failed in some process; every process raises it, naming which and why.

    Attributes:
      path: the destination.
    """

    def __init__(self, reason: str, *, path: str | None = None) -> None:
        self.reason = reason
        self.path = path
        super().__init__(reason)

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason


# --------------------------------------------------------------------------
# several processes
# --------------------------------------------------------------------------


class Coordinator(Protocol):
    """How the processes of one save talk: ``exchange`` is a barrier that also carries a message.

    ``exchange(tag, message)`` returns every process's message, by process
    index, once every process has called it with the same ``tag``.  A
    coordinator may also have ``devices``: the devices whose shards its
    process writes (by default every device it can address; threads standing
    for processes in one process name theirs).
    """

    process_index: int
    process_count: int

    def exchange(self, tag: str, message: str) -> list[str]: ...


class JaxCoordinator:
    """A `Coordinator` over ``jax.distributed`` (messages go through a small all-gather)."""

    def __init__(self) -> None:
        import jax

        self.process_index = jax.process_index()
        self.process_count = jax.process_count()

    def exchange(self, tag: str, message: str) -> list[str]:
        from jax.experimental import multihost_utils

        data = message.encode("utf-8", "surrogateescape")[:MAX_MESSAGE]
        buf = np.zeros(MAX_MESSAGE + 4, dtype=np.uint8)
        buf[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
        buf[4 : 4 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(self.process_count, -1)
        out = []
        for row in rows:
            n = int.from_bytes(bytes(row[:4]), "little")
            out.append(bytes(row[4 : 4 + n]).decode("utf-8", "surrogateescape"))
        return out


class _Alone:
    """The coordinator of a single process."""

    process_index = 0
    process_count = 1

    def exchange(self, tag: str, message: str) -> list[str]:
        return [message]


class _ThreadCoordinator:
    """One of `thread_group`'s coordinators."""

    def __init__(
        self, index: int, count: int, shared: dict[str, Any], timeout: float, devices: Any
    ) -> None:
        self.process_index = index
        self.process_count = count
        self.devices = devices
        self._shared = shared
        self._timeout = timeout

    def exchange(self, tag: str, message: str) -> list[str]:
        shared = self._shared
        with shared["lock"]:
            box = shared["boxes"].setdefault(tag, {})
            box[self.process_index] = message
        shared["barrier"].wait(self._timeout)
        out = [box[i] for i in range(self.process_count)]
        shared["barrier"].wait(self._timeout)  # nobody reuses the tag before all have read
        return out


def thread_group(
    count: int, devices: Sequence[Any] | None = None, timeout: float = 60.0
) -> list[Coordinator]:
    """``count`` coordinators for threads that stand for processes of one job.

    ``devices[i]``: the devices "process" ``i`` holds (each writes the shards
    of its own); by default each writes every addressable shard.
    """
    shared: dict[str, Any] = {
        "lock": threading.Lock(),
        "boxes": {},
        "barrier": threading.Barrier(count),
    }
    return [
        _ThreadCoordinator(i, count, shared, timeout, None if devices is None else devices[i])
        for i in range(count)
    ]


def default_coordinator() -> Coordinator:
    """`JaxCoordinator` in a multi-process jax job, else a single process's."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.process_count() > 1:
        return JaxCoordinator()
    return _Alone()


@dataclasses.dataclass
class _Plan:
    """Where an encoding's chunks lie in the file."""

    size: int
    plain: list[tuple[int, Any]]  # written by the primary
    parts: list[tuple[int, ShardChunk]]  # sharded bytes: written by the processes holding them
    late: list[tuple[int, Deferred]]  # headers written last (checksums of the data)
    #: host copies of this process's blocks, by leaf (`snapshot`); None: taken while writing
    held: dict[int, list[tuple[Region, np.ndarray]]] | None = None

    def digest(self) -> str:
        """What every process must agree on: the size and where each sharded leaf's bytes go."""
        h = hashlib.sha256(str(self.size).encode())
        for off, c in self.parts:
            leaf = c.leaf
            h.update(f"{off}:{leaf.shape}:{leaf.dtype.str}:{c.start}:{c.stop};".encode())
        for off, d in self.late:
            h.update(f"late {off}:{d.nbytes};".encode())
        return h.hexdigest()

    def leaves(self) -> list[tuple[ShardedLeaf, list[tuple[int, int, int]]]]:
        """Each sharded leaf, in file order, with its segments ``(start, stop, file offset)``."""
        out: dict[int, tuple[ShardedLeaf, list[tuple[int, int, int]]]] = {}
        for off, c in self.parts:
            out.setdefault(id(c.leaf), (c.leaf, []))[1].append((c.start, c.stop, off))
        return list(out.values())

    def snapshot(self, primary: bool) -> None:
        """Copy what this process writes to host memory of its own: the tree may change after.

        Its blocks (every device-to-host transfer started before the first is
        awaited; a CPU shard's host view is its device buffer, which a donation
        may reuse, so it is copied) and, on the primary, the plain chunks.
        """
        from pytreeio.core.binary import as_memoryview

        leaves = [leaf for leaf, _ in self.leaves()]
        for leaf in leaves:
            for _, shard in leaf.local_pieces():
                shard.data.copy_to_host_async()
        self.held = {
            id(leaf): [(r, _private(host_array(s.data), s.device)) for r, s in leaf.local_pieces()]
            for leaf in leaves
        }
        # (the others never write the plain chunks: no reference to the tree is kept)
        self.plain = [
            (off, bytes(as_memoryview(c.produce() if isinstance(c, Deferred) else c)))
            for off, c in (self.plain if primary else [])
        ]


def _private(host: np.ndarray, device: Any) -> np.ndarray:
    return host.copy() if device.platform == "cpu" else host


def _plan(encoded: Encoded) -> _Plan:
    from pytreeio.core.binary import chunk_nbytes

    plain, parts, late = [], [], []
    at = 0
    for c in encoded.chunks:
        if isinstance(c, ShardChunk):
            parts.append((at, c))
        elif isinstance(c, Deferred) and c.late:
            late.append((at, c))
        else:
            plain.append((at, c))
        at += chunk_nbytes(c)
    return _Plan(at, plain, parts, late)


def _agree(
    coord: Coordinator, tag: str, error: BaseException | None, path: str, payload: str = ""
) -> list[str]:
    """A barrier at which every process learns whether any failed (then all raise).

    Returns every process's ``payload`` (sent only by processes that did not fail).
    """
    mine = f"ok {payload}" if error is None else f"error {type(error).__name__}: {error}"
    try:
        said = coord.exchange(tag, mine)
    except Exception as exc:  # a process died or hangs: the coordinator timed out
        own = "" if error is None else f"; this process: {type(error).__name__}: {error}"
        raise PartsError(
            f"a save in parts failed ({tag}): the processes could not exchange "
            f"({type(exc).__name__}: {exc}){own}",
            path=path,
        ) from exc
    failed = [(i, m) for i, m in enumerate(said) if not m.startswith("ok ")]
    if failed:
        if error is not None and not isinstance(error, Exception):
            raise error  # KeyboardInterrupt and the like, after telling the others
        why = "; ".join(f"process {i}: {m.removeprefix('error ')}" for i, m in failed)
        raise PartsError(f"a save in parts failed ({tag}): {why}", path=path) from error
    return [m[3:] for m in said]


def _write_own_shards(out: Any, plan: _Plan) -> int:
    """Write the blocks this process holds into their byte ranges; returns bytes written."""
    leaves = plan.leaves()
    written = 0

    def start_copies(i: int) -> None:
        if plan.held is None and i < len(leaves):
            for _, shard in leaves[i][0].local_pieces():
                shard.data.copy_to_host_async()

    start_copies(0)
    for i, (leaf, segs) in enumerate(leaves):
        start_copies(i + 1)  # the next leaf's transfers overlap this leaf's writes
        if plan.held is not None:
            pieces = plan.held[id(leaf)]
        else:
            pieces = [(r, host_array(s.data)) for r, s in leaf.local_pieces()]
        for region, arr in pieces:
            host = arr.reshape(-1).view(np.uint8)
            offsets, run = c_runs(leaf.shape, leaf.dtype.itemsize, region)
            for j, off in enumerate(offsets.tolist()):
                for s0, s1, file_off in segs:
                    lo, hi = max(off, s0), min(off + run, s1)
                    if lo < hi:
                        src = host[j * run + (lo - off) : j * run + (hi - off)]
                        out.write_at(file_off + (lo - s0), src.data)
                        written += hi - lo
        del pieces
    return written


def _write_plain(out: Any, plan: _Plan) -> None:
    for off, c in plan.plain:
        data = c.produce() if isinstance(c, Deferred) else c
        out.write_at(off, data)


def _finish_late(out: Any, plan: _Plan) -> None:
    """Read the sharded bytes back for the headers' checksums, then write the headers."""
    from pytreeio.core.binary import as_memoryview

    if not plan.late:
        return
    for off, c in plan.parts:
        if c.seen is not None:
            c.seen(np.frombuffer(out.read_at(off, c.nbytes), dtype=np.uint8))
    for off, d in plan.late:
        data = d.produce()
        n = len(as_memoryview(data))
        if n != d.nbytes:
            raise EncodeError(f"a header produced {n} bytes where {d.nbytes} were declared")
        out.write_at(off, data)


@keywords_explained
def save_in_parts(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    format: str | Any = None,
    coordinator: Coordinator | None = None,
    meta: Any = None,
    durable: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> None:
    """Save a tree of arrays sharded over the processes of a job into one file; call it in every process.

    Each process writes the byte ranges of the shards it holds (replica 0 of
    each block), the primary (process 0) everything else; see the module
    docstring for the protocol.  ``coordinator`` defaults to
    `JaxCoordinator` in a multi-process jax job.  Every process
    returns when the checkpoint is in place, or raises `PartsError`
    naming the process that failed (the destination keeps its old content).

    ``path`` may be a URL (``storage_options`` configure its file system): each process then
    uploads its ranges, and process 0 merges them and uploads the object whole.
    """
    prepare_in_parts(
        path,
        tree,
        format=format,
        coordinator=coordinator,
        meta=meta,
        durable=durable,
        storage_options=storage_options,
        **options,
    ).write()


@keywords_explained
def prepare_in_parts(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    format: str | Any = None,
    coordinator: Coordinator | None = None,
    meta: Any = None,
    durable: bool = True,
    snapshot: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> PartsSave:
    """The first half of `save_in_parts`: encode, and agree on the layout; `PartsSave.write` writes.

    For a caller that writes later, on another thread (the orbax handler):
    ``snapshot`` copies to host memory now the bytes this process will write
    (its shards; on the primary the rest of the file too), so the tree may
    change or be donated once this returns; the formats written whole by the
    primary take no snapshot (``EncodeError``).  Errors are agreed as in
    `save_in_parts`: every process raises `PartsError` or none does.
    """
    from pytreeio import io
    from pytreeio.core.records import File
    from pytreeio.engine import dispatch

    path = io.location(path, storage_options)
    coord = coordinator if coordinator is not None else default_coordinator()
    where = os.fspath(path)
    plan: _Plan | None = None
    error: BaseException | None = None
    fmt = None
    try:
        fmt = dispatch.format_for_save(path, format)
        devices = getattr(coord, "devices", None)
        token = IN_PARTS.set(ADDRESSABLE if devices is None else frozenset(devices))
        try:
            encoded = dispatch.encode_tree(fmt, tree, meta, options, path)
        finally:
            IN_PARTS.reset(token)
        if not isinstance(fmt.layout, File) or encoded.files is not None:
            if _holds_foreign_shards(tree):
                raise EncodeError(
                    f"format {fmt.name!r} cannot be written in parts, and the tree holds arrays "
                    "whose shards lie in other processes"
                )
            if snapshot:
                raise EncodeError(f"format {fmt.name!r} is written whole: no snapshot in parts")
        else:
            plan = _plan(encoded)
            if snapshot:
                plan.snapshot(coord.process_index == 0)
    except BaseException as exc:
        error = exc
    # every process learns of any failure, and sends its layout (all must be the same)
    layouts = _agree(coord, "encode", error, where, plan.digest() if plan is not None else "")
    if len(set(layouts)) != 1:
        raise PartsError(
            "the processes encode different layouts (trees or options differ): "
            + ", ".join(f"process {i}: {d[:12] or 'whole'}" for i, d in enumerate(layouts)),
            path=where,
        )
    assert fmt is not None
    whole = None
    if plan is None:
        whole = functools.partial(dispatch.save_tree, path, fmt, tree, meta, options)
    return PartsSave(path, coord, durable, plan, whole)


@dataclasses.dataclass
class PartsSave:
    """A save in parts encoded by every process, on a layout they agree on (`prepare_in_parts`)."""

    path: str | os.PathLike[str]
    coordinator: Coordinator
    durable: bool
    plan: _Plan | None  # None: a format written whole, by the primary (`whole`)
    whole: Callable[..., None] | None

    def write(self, *, finish: Callable[[], None] | None = None) -> None:
        """Write this process's parts and put the checkpoint in place; call it in every process.

        ``finish``: run by the primary once the checkpoint is in place, before
        the processes agree that the save succeeded (so its failure, too,
        makes every process raise).
        """
        from pytreeio import io

        coord, plan, where = self.coordinator, self.plan, os.fspath(self.path)
        primary = coord.process_index == 0
        error: BaseException | None = None
        if plan is None:  # a format written whole: the primary writes, the others wait
            assert self.whole is not None
            if primary:
                try:
                    self.whole(durable=self.durable)
                    if finish is not None:
                        finish()
                except BaseException as exc:
                    error = exc
            _agree(coord, "write", error, where)
            return
        with contextlib.ExitStack() as stack:
            tmp = ""
            if primary:
                try:
                    tmp = os.fspath(
                        stack.enter_context(io.file_in_parts(self.path, plan.size, self.durable))
                    )
                except BaseException as exc:
                    error = exc
            tmp = _agree(coord, "create", error, where, tmp)[0]
            error = None
            try:
                out = io.part_writer(tmp, self.path)
                try:
                    _write_own_shards(out, plan)
                    if primary:
                        _write_plain(out, plan)
                finally:
                    # (the primary's fsync at commit covers its own writes)
                    out.close(durable=self.durable and not primary)
            except BaseException as exc:
                error = exc
            plan.held = None  # the snapshot is written: let it go
            try:
                _agree(coord, "write", error, where)
            except BaseException:
                stack.close()  # the primary drops the temporary: the old checkpoint stays
                raise
            error = None
            if primary:
                try:
                    with io.part_writer(tmp, self.path) as out:
                        _finish_late(out, plan)
                    stack.close()  # fsync and rename over the destination
                    if finish is not None:
                        finish()
                except BaseException as exc:
                    error = exc
            _agree(coord, "commit", error, where)


def _holds_foreign_shards(tree: Any) -> bool:
    """Whether some array of ``tree`` is not wholly held by this process."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    return any(
        isinstance(x, jax.Array) and not x.is_fully_addressable
        for x in jax.tree_util.tree_leaves(tree)
    )
