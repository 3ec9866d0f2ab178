"""pytreeio formats inside orbax's ``CheckpointManager`` (the ``pytreeio[orbax]`` extra).

Orbax coordinates checkpoints: step numbering, retention (``max_to_keep``,
keep-best by a metric), background saving and the atomic commit of each
step directory.  `PytreeioHandler` is an orbax checkpoint handler
that writes one item of a step in any pytreeio format; the args
`PytreeioSave` and `PytreeioRestore` select it, so::

    mngr.save(step, args=ocp.args.Composite(state=PytreeioSave(tree, format="msgpack")))
    mngr.restore(step, args=ocp.args.Composite(state=PytreeioRestore(like=abstract_tree)))

(or the same args without ``Composite`` for a manager of one item).

Inside the item directory orbax gives the handler (a temporary directory
that orbax renames into place once every item is written) the handler
writes::

    checkpoint<suffix>   the checkpoint, named after its format's first suffix
                         (a file, a directory for waffe2/bullet, a sibling
                         pair for netcl-checkpoint)
    pytreeio.json        {"version": 1, "format": ..., "layout": "single", "path": ...}

and nothing else of its own (pytreeio's saves lock the directory itself and leave no lock
files); orbax may add its own markers, such as ``commit_success.txt`` on some file systems.

``pytreeio.json`` is the item's metadata: restore reads the format from it,
and ``CheckpointManager.item_metadata(step)`` returns the checkpoint's
`pytreeio.Info` (headers only).

Saving is split in two phases, as orbax's own handlers do.  On the caller's
thread (``mngr.save`` blocks for this): the tree is encoded and every buffer
the encoding borrows is copied to host memory of its own (jax arrays fetched
from their devices, all transfers started before the first is waited for),
so the training loop may donate or overwrite its arrays as soon as ``save``
returns.  In orbax's background commit thread: the bytes are written with
pytreeio's atomic, fsync'd writes.  An error of the tree (``EncodeError``, an
option the format does not take) is raised through orbax's commit, like a
write error: from ``wait_until_finished()`` (or the next ``save``) with async
checkpointing, from ``save`` without; the step is not committed.

An item of fully addressable arrays is written by the primary process
alone.  An item holding arrays sharded across the processes of a job is
written by every process into the one checkpoint file
(`pytreeio.multihost.prepare_in_parts`): on the caller's thread every process
encodes the tree, copies the shards it writes (replica 0 of each block) to
host memory, and the processes agree on the file's layout; in the commit
each writes its shards and process 0 the rest, the safetensors
checksums and ``pytreeio.json``.  The processes talk through
`OrbaxCoordinator` (orbax's signalling: the ``jax.distributed`` key-value
store and barriers, no device collectives, so the commit thread may use it
while the training loop runs its own).  A failure in any process raises
`pytreeio.multihost.PartsError` in every process, where any save error is
raised, and orbax commits no step.  The file is byte for byte what one
process writes of the gathered arrays.  Restoring onto
``jax.ShapeDtypeStruct`` leaves with a sharding reads in each process the
slices its devices hold (see `pytreeio.load`).

The metadata's ``layout`` field: a ``"single"`` item is one checkpoint,
written by the primary or in parts (the bytes are the same); another layout
(one file per process, say) gets its own value and writer, and restore
refuses layouts it does not know.  The item directory may be in object storage
(an ``etils.epath`` URL; fsspec's configuration gives its options): every file is then one
object, and a save in parts uploads each process's ranges for process 0 to merge.

This module imports orbax; ``import pytreeio`` does not import it.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint import future as ocp_future

from pytreeio import api, async_save, io, multihost
from pytreeio.core.errors import FormatError
from pytreeio.core.jsonsafe import loads as json_loads
from pytreeio.core.records import FILE, Encoded, Format, Info
from pytreeio.engine import dispatch
from pytreeio.formats import registry

__all__ = [
    "METADATA_NAME",
    "OrbaxCoordinator",
    "PytreeioHandler",
    "PytreeioRestore",
    "PytreeioSave",
    "checkpoint_name",
]

#: The item metadata file written next to the checkpoint.
METADATA_NAME = "pytreeio.json"
_METADATA_VERSION = 1
#: The one layout written so far (see the module docstring).
_SINGLE = "single"
_STEM = "checkpoint"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def checkpoint_name(fmt: str | Format) -> str:
    """The fixed name of the checkpoint inside an item directory: ``checkpoint`` + first suffix."""
    f = registry.get(fmt)
    return _STEM + (f.suffixes[0] if f.suffixes else "")


# --------------------------------------------------------------------------
# args
# --------------------------------------------------------------------------


@dataclasses.dataclass
class PytreeioSave(ocp.args.CheckpointArgs):
    """Save ``item`` in a pytreeio format.

    Attributes:
      item: the tree (any pytree for msgpack/safetensors; for model formats
        the shapes they accept: a Flax params tree, ``{'params', 'opt_state'}``,
        a TrainState).
      format: a registered format name.
      meta: the format's meta document (see ``pytreeio.save``).
      durable: fsync the files written (default), as ``pytreeio.save``.
      options: the format's save options, e.g. ``{"optimizers": True}`` for
        waffe2; one the format does not take raises ``TypeError``.
    """

    item: Any
    format: str = "safetensors"
    meta: Mapping[str, Any] | None = None
    durable: bool = True
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PytreeioRestore(ocp.args.CheckpointArgs):
    """Restore an item saved with `PytreeioSave`.

    Attributes:
      like: the structure to restore into (concrete arrays or
        ``jax.ShapeDtypeStruct`` leaves, e.g. from ``jax.eval_shape``; leaves
        with a ``sharding`` come back on it).  ``None``: the format's native
        tree.  Shapes and dtypes must match (``MismatchError``).
      format: overrides the format recorded in the item's metadata.
      mmap: map the file instead of reading it (see ``pytreeio.load``).
      verify: check checksums before returning (see ``pytreeio.load``).
      options: the format's load options, e.g. ``{"layers": [...]}``.
    """

    like: Any = None
    format: str | None = None
    mmap: bool = False
    verify: bool = False
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------
# the blocking phase: encode and take a snapshot of the bytes
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A save whose bytes are ready and owned: all that is left is writing them."""

    fmt: Format
    name: str
    encoded: Encoded
    durable: bool


def _prepare(args: PytreeioSave) -> _Pending:
    if not isinstance(args, PytreeioSave):
        raise TypeError(
            f"the pytreeio handler saves PytreeioSave args, not {type(args).__name__} "
            "(pass them as args=PytreeioSave(...))"
        )
    fmt = registry.get(args.format)
    name = checkpoint_name(fmt)
    # The destination recorded by formats that keep one (cl-waffe2) is the
    # item-relative name: the temporary directory orbax writes into is renamed.
    encoded = dispatch.encode_tree(fmt, args.item, args.meta, dict(args.options), name)
    # the snapshot save_async takes: borrowed buffers copied, deferred chunks produced now
    return _Pending(fmt, name, async_save._snapshot(encoded), args.durable)


# --------------------------------------------------------------------------
# the background phase: write
# --------------------------------------------------------------------------


def _write(directory: Path, pending: _Pending) -> None:
    io.write_atomic(
        directory / pending.name, pending.encoded, pending.fmt.layout, durable=pending.durable
    )
    _write_record(directory, pending.fmt, pending.name, pending.durable)
    dispatch.deliver_deferred(pending.encoded)


def _write_record(directory: Path, fmt: Format, name: str, durable: bool) -> None:
    record = {"version": _METADATA_VERSION, "format": fmt.name, "layout": _SINGLE, "path": name}
    # Written last: an item with a record has its checkpoint complete.
    doc = json.dumps(record, indent=1).encode()
    io.write_atomic(directory / METADATA_NAME, Encoded(chunks=(doc,)), FILE, durable=durable)


# --------------------------------------------------------------------------
# arrays that span processes: every process writes its shards (pytreeio.multihost)
# --------------------------------------------------------------------------

#: How long a process waits for the others at each step of a save in parts (as long as
#: orbax's own barriers wait by default).
_PARTS_TIMEOUT_S = 300
#: Numbers the saves in parts: the same sequence in every process, so each save's keys are new.
_parts_saves = itertools.count()


class OrbaxCoordinator:
    """A `pytreeio.multihost.Coordinator` over orbax's multihost signalling.

    Each message goes through the key-value store of ``jax.distributed``
    (orbax's signalling client, which its commit futures use too); once an
    orbax barrier (``ocp.multihost.get_barrier_sync_fn``) says that every
    process has read them, each process deletes its own.  No device
    collectives: it may run on orbax's background commit thread while the
    training loop runs its own.  ``name`` is the same in every process and new
    for each save.
    """

    def __init__(self, name: str, *, timeout_s: int = _PARTS_TIMEOUT_S) -> None:
        import jax
        from orbax.checkpoint._src.futures import signaling_client

        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self._client = signaling_client.get_signaling_client()
        self._barrier = ocp.multihost.get_barrier_sync_fn()
        self._name = name
        self._timeout_s = timeout_s

    def exchange(self, tag: str, message: str) -> list[str]:
        key = f"{self._name}/{tag}"
        mine = f"{key}/{self.process_index}"
        # str on the wire: bytes that are not UTF-8 (a path's) travel as latin-1 characters
        self._client.key_value_set(
            mine, message.encode("utf-8", "surrogateescape").decode("latin-1")
        )
        said = [
            self._client.blocking_key_value_get(f"{key}/{i}", self._timeout_s)
            .encode("latin-1")
            .decode("utf-8", "surrogateescape")
            for i in range(self.process_count)
        ]
        self._barrier(key=f"{self._name}.{tag}.read", timeout_ms=self._timeout_s * 1000)
        self._client.key_value_delete(mine)
        return said


def _spans_processes(args: Any) -> bool:
    """Whether the item holds arrays whose shards lie partly in other processes."""
    return isinstance(args, PytreeioSave) and multihost._holds_foreign_shards(args.item)


def _prepare_parts(directory: Path, args: PytreeioSave) -> Callable[[], None]:
    """Encode and snapshot this process's parts (every process agrees); returns the write."""
    coordinator = OrbaxCoordinator(f"pytreeio_parts_{next(_parts_saves)}")
    fmt = registry.get(args.format)
    name = checkpoint_name(fmt)
    parts = multihost.prepare_in_parts(
        directory / name,
        args.item,
        format=fmt,
        coordinator=coordinator,
        meta=args.meta,
        durable=args.durable,
        snapshot=True,
        **args.options,
    )
    # the record is the primary's, written before the processes agree that the save succeeded
    finish = functools.partial(_write_record, directory, fmt, name, args.durable)
    return functools.partial(parts.write, finish=finish)


# --------------------------------------------------------------------------
# reading the record
# --------------------------------------------------------------------------


def _where(directory: Any) -> Any:
    """Orbax's item directory as pytreeio's io takes it: a local ``Path``, or a URL (an
    ``etils.epath`` path in object storage; fsspec's configuration gives its options)."""
    where = io.location(os.fspath(directory))
    return where if io.is_url(where) else Path(where)


def _read_record(directory: Path) -> dict[str, Any] | None:
    """The item's ``pytreeio.json``, checked; ``None`` when there is none."""
    path = directory / METADATA_NAME
    try:
        data = io.read_head(path, 1 << 16)
    except FileNotFoundError:
        return None
    where = os.fspath(path)
    if len(data) > 1 << 16:
        raise FormatError("the item record is larger than 64 KiB", path=where, offset=1 << 16)
    doc = json_loads(data, path=where)
    if not isinstance(doc, dict):
        raise FormatError("the item record is not a JSON object", path=where, offset=0)
    for key in ("version", "format", "layout", "path"):
        if key not in doc:
            raise FormatError(f"the item record has no {key!r}", path=where, field=key)
    if doc["version"] != _METADATA_VERSION:
        raise FormatError(
            f"item record version {doc['version']!r}; this pytreeio reads version "
            f"{_METADATA_VERSION}",
            path=where,
            field="version",
        )
    if doc["layout"] != _SINGLE:
        raise FormatError(
            f"item layout {doc['layout']!r} is not one this pytreeio reads ({_SINGLE!r})",
            path=where,
            field="layout",
        )
    name = doc["path"]
    # a plain name inside the item directory: a record never points elsewhere
    if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name) or ".." in name:
        raise FormatError(
            f"the item record names {name!r}, not a plain file name", path=where, field="path"
        )
    if not isinstance(doc["format"], str):
        raise FormatError("the item record's format is not a string", path=where, field="format")
    return doc


def _locate(directory: Path, format: str | None) -> tuple[Path, str]:
    """The checkpoint path in an item directory and its format name."""
    record = _read_record(directory)
    if record is None:
        if format is None:
            raise FileNotFoundError(
                errno.ENOENT,
                "no pytreeio item record (not saved by the pytreeio handler?); "
                "pass PytreeioRestore(format=...)",
                os.fspath(directory / METADATA_NAME),
            )
        return directory / checkpoint_name(format), format
    return directory / record["path"], format if format is not None else record["format"]


# --------------------------------------------------------------------------
# the handler
# --------------------------------------------------------------------------


class PytreeioHandler(ocp.AsyncCheckpointHandler):
    """An orbax checkpoint handler that saves and restores one item in a pytreeio format.

    ``primary_host``: the process that writes an item of fully addressable
    arrays (the others encode nothing and write nothing).  An item holding
    arrays that span processes is written by every process, each its own
    shards, into the one file (`pytreeio.multihost.prepare_in_parts`, process 0
    leading, `OrbaxCoordinator` between the processes).
    """

    def __init__(self, *, primary_host: int = 0) -> None:
        self._primary_host = primary_host

    def _begin(self, directory: Path, args: PytreeioSave) -> Callable[[], None] | None:
        """The blocking phase; returns the write (None: this process writes nothing)."""
        import jax

        if _spans_processes(args):
            return _prepare_parts(directory, args)
        if jax.process_index() != self._primary_host:
            return None
        return functools.partial(_write, directory, _prepare(args))

    async def async_save(
        self, directory: Any, args: PytreeioSave
    ) -> list[ocp_future.Future] | None:
        """Encode and snapshot now; write (or raise the encoding's error) in orbax's commit."""
        try:
            write = self._begin(_where(directory), args)
        except Exception as exc:
            # Raised from the commit instead: orbax has begun this step (its
            # directory creation waits on signals) and an exception here would
            # leave that half-started; from the commit orbax abandons the step
            # and raises the error from ``wait_until_finished`` (or ``save``, sync).
            failure = exc

            async def fail() -> None:
                raise failure

            return [ocp_future.CommitFutureAwaitingContractedSignals(fail(), name="pytreeio_save")]
        if write is None:
            return None

        async def commit() -> None:
            write()

        # The future waits for orbax's signals (the step directory may be
        # created in the background) before the write starts.
        return [ocp_future.CommitFutureAwaitingContractedSignals(commit(), name="pytreeio_save")]

    def save(self, directory: Any, args: PytreeioSave) -> None:
        """Save synchronously (orbax's sync ``Checkpointer``: the directory exists already)."""
        write = self._begin(_where(directory), args)
        if write is not None:
            write()

    def restore(self, directory: Any, args: PytreeioRestore | None = None) -> Any:
        """The item in ``args.like``'s structure, or the format's native tree without one."""
        args = args if args is not None else PytreeioRestore()
        if not isinstance(args, PytreeioRestore):
            raise TypeError(
                f"the pytreeio handler restores PytreeioRestore args, not {type(args).__name__}"
            )
        path, fmt = _locate(_where(directory), args.format)
        return api.load(
            path, like=args.like, format=fmt, mmap=args.mmap, verify=args.verify, **args.options
        )

    def metadata(self, directory: Any) -> Info:
        """The checkpoint's `pytreeio.Info` (format, entries, meta): headers only."""
        path, fmt = _locate(_where(directory), None)
        return api.inspect(path, format=fmt)

    def finalize(self, directory: Any) -> None:
        """Nothing to do: each file was written atomically and fsync'd by its writer."""


ocp.args.register_with_handler(PytreeioHandler, for_save=True)(PytreeioSave)
ocp.args.register_with_handler(PytreeioHandler, for_restore=True)(PytreeioRestore)
