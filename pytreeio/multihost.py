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

jax is imported only by the functions that need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from pytreeio.core.binary import Deferred
from pytreeio.core.calls import keywords_explained
from pytreeio.core.errors import EncodeError, PytreeioError
from pytreeio.core.records import Encoded
from pytreeio.core.shards import ADDRESSABLE, IN_PARTS, ShardChunk, ShardedLeaf, c_runs, host_array

__all__ = [
    "Coordinator",
    "JaxCoordinator",
    "PartsError",
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

    def digest(self) -> str:
        """What every process must agree on: the size and where each sharded leaf's bytes go."""
        h = hashlib.sha256(str(self.size).encode())
        for off, c in self.parts:
            leaf = c.leaf
            h.update(f"{off}:{leaf.shape}:{leaf.dtype.str}:{c.start}:{c.stop};".encode())
        for off, d in self.late:
            h.update(f"late {off}:{d.nbytes};".encode())
        return h.hexdigest()


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
    said = coord.exchange(tag, mine)
    failed = [(i, m) for i, m in enumerate(said) if not m.startswith("ok ")]
    if failed:
        if error is not None and not isinstance(error, Exception):
            raise error  # KeyboardInterrupt and the like, after telling the others
        why = "; ".join(f"process {i}: {m.removeprefix('error ')}" for i, m in failed)
        raise PartsError(f"a save in parts failed ({tag}): {why}", path=path) from error
    return [m[3:] for m in said]


def _write_own_shards(out: Any, plan: _Plan) -> int:
    """Write the blocks this process holds into their byte ranges; returns bytes written."""
    segments: dict[int, list[tuple[int, int, int]]] = {}  # leaf -> (start, stop, file offset)
    leaves: dict[int, ShardedLeaf] = {}
    for off, c in plan.parts:
        segments.setdefault(id(c.leaf), []).append((c.start, c.stop, off))
        leaves[id(c.leaf)] = c.leaf
    order = list(leaves)
    written = 0

    def start_copies(i: int) -> None:
        if i < len(order):
            for _, shard in leaves[order[i]].local_pieces():
                shard.data.copy_to_host_async()

    start_copies(0)
    for i, lid in enumerate(order):
        start_copies(i + 1)  # the next leaf's transfers overlap this leaf's writes
        leaf, segs = leaves[lid], segments[lid]
        for region, shard in leaf.local_pieces():
            host = host_array(shard.data).reshape(-1).view(np.uint8)
            offsets, run = c_runs(leaf.shape, leaf.dtype.itemsize, region)
            for j, off in enumerate(offsets.tolist()):
                for s0, s1, file_off in segs:
                    lo, hi = max(off, s0), min(off + run, s1)
                    if lo < hi:
                        src = host[j * run + (lo - off) : j * run + (hi - off)]
                        out.write_at(file_off + (lo - s0), src.data)
                        written += hi - lo
            del host
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
    **options: Any,
) -> None:
    """Save a tree of arrays sharded over the processes of a job into one file; call it in every process.

    Each process writes the byte ranges of the shards it holds (replica 0 of
    each block), the primary (process 0) everything else; see the module
    docstring for the protocol.  ``coordinator`` defaults to
    `JaxCoordinator` in a multi-process jax job.  Every process
    returns when the checkpoint is in place, or raises `PartsError`
    naming the process that failed (the destination keeps its old content).
    """
    from pytreeio import io
    from pytreeio.core.records import File
    from pytreeio.engine import dispatch

    coord = coordinator if coordinator is not None else default_coordinator()
    where = os.fspath(path)
    primary = coord.process_index == 0
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
        else:
            plan = _plan(encoded)
    except BaseException as exc:
        error = exc
    _agree(coord, "encode", error, where)

    if plan is None:  # a format written whole: the primary writes, the others wait
        assert fmt is not None
        error = None
        if primary:
            try:
                dispatch.save_tree(path, fmt, tree, meta, options, durable=durable)
            except BaseException as exc:
                error = exc
        _agree(coord, "write", error, where)
        return

    layouts = coord.exchange("layout", plan.digest())
    if len(set(layouts)) != 1:
        raise PartsError(
            "the processes encode different layouts (trees or options differ): "
            + ", ".join(f"process {i}: {d[:12]}" for i, d in enumerate(layouts)),
            path=where,
        )
    with contextlib.ExitStack() as stack:
        tmp = ""
        error = None
        if primary:
            try:
                tmp = os.fspath(stack.enter_context(io.file_in_parts(path, plan.size, durable)))
            except BaseException as exc:
                error = exc
        tmp = _agree(coord, "create", error, where, tmp)[0]
        error = None
        try:
            out = io.PartWriter(tmp)
            try:
                _write_own_shards(out, plan)
                if primary:
                    _write_plain(out, plan)
            finally:
                # (the primary's fsync at commit covers its own writes)
                out.close(durable=durable and not primary)
        except BaseException as exc:
            error = exc
        try:
            _agree(coord, "write", error, where)
        except BaseException:
            stack.close()  # the primary drops the temporary: the old checkpoint stays
            raise
        error = None
        if primary:
            try:
                with io.PartWriter(tmp) as out:
                    _finish_late(out, plan)
                stack.close()  # fsync and rename over the destination
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
