"""Formats as values: the :class:`Format` record, layouts, probes and the registry.

A format is a small immutable record of pure functions (like optax's
``GradientTransformation``).  Format modules build one and call
:func:`register`.  The registry names no format: the first time it is
consulted it asks :func:`pytreeio.fmt.load` to import the built-in format
modules, which register themselves, so ``import pytreeio`` stays cheap.

Layouts are values (:data:`FILE`, :class:`Siblings`, :data:`DIRECTORY`):

* ``FILE``      - one file; ``decode``/``inspect`` receive a buffer.
* ``Siblings``  - files next to each other (``<p>.npz`` + ``<p>.json``);
  ``layout.locate(path)`` maps roles to paths, and ``decode``/``inspect``
  receive a ``Mapping[role, buffer]`` of those that exist.
* ``DIRECTORY`` - a directory; they receive a ``Mapping[str, buffer]`` of the
  files below it (relative POSIX paths), read lazily on access.

``encode`` returns an :class:`Encoded`: a list of chunks for ``FILE``, or
``files`` (role or relative path -> :class:`Encoded`) for the other layouts.

Sniffing: :mod:`pytreeio.io` builds a :class:`Probe` of a path for a layout
(head bytes, size, ZIP member names, a directory's listing, the probes of the
sibling files); a format's ``sniff(probe)`` returns a score, 0 meaning "not
this format".  The highest score wins (:data:`MAGIC` for a magic number,
:data:`STRUCTURE` for a recognised structure, :data:`WEAK` for a guess).

Options are declared by the functions that take them: the keyword-only
parameters of ``encode``/``from_model`` are save options, those of
``decode``/``restore``/``to_model`` load options.  :meth:`Format.split_options`
routes each option to the functions that declare it, and an option no function
declares raises ``TypeError``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from .binary import Buffer, as_memoryview
from .errors import UnknownFormatError
from .tree import register_leaf_type

__all__ = [
    "Format",
    "Encoded",
    "Decoded",
    "Entry",
    "Info",
    "Probe",
    "Slot",
    "Slots",
    "Deferred",
    "Streamed",
    "Derived",
    "Layout",
    "File",
    "Siblings",
    "Directory",
    "FILE",
    "DIRECTORY",
    "MAGIC",
    "STRUCTURE",
    "WEAK",
    "register",
    "get",
    "formats",
    "for_suffix",
    "best_match",
]

#: Meta key under which a ``decode`` called with ``verify=True`` reports what its checks
#: found beyond "no error" (bullet: the quantisation error per tensor); ``ptio.verify``
#: merges it into the returned :class:`Info`'s meta.
REPORT = "pytreeio.report"

#: Sniff scores: a magic number matched, a structure recognised, a weak guess.
MAGIC = 100.0
STRUCTURE = 50.0
WEAK = 1.0


# --------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class File:
    """A checkpoint that is one file."""

    kind: Literal["file"] = "file"


@dataclass(frozen=True)
class Directory:
    """A checkpoint that is a directory of files (written and swapped in as a whole)."""

    kind: Literal["dir"] = "dir"


@dataclass(frozen=True)
class Siblings:
    """A checkpoint made of files next to each other, e.g. ``<p>.npz`` + ``<p>.json``.

    Attributes:
      locate: ``locate(path) -> {role: path}`` of the files that make up the
        checkpoint at ``path`` (existing or to be written).  Pure: it only
        computes names (netcl's lookup order is decided from the probe).
      roles: every role ``locate`` can return, in writing order.
      linked: the roles that are written and read as one set: io saves them
        under one lock with a journal and reads them under a shared lock, so a
        reader sees the complete old or the complete new set (see :mod:`pytreeio.io`).
    """

    locate: Callable[[Path], Mapping[str, Path]]
    roles: tuple[str, ...]
    linked: tuple[str, ...] = ()
    kind: Literal["siblings"] = "siblings"


Layout = File | Siblings | Directory

FILE = File()
DIRECTORY = Directory()


@dataclass(frozen=True)
class Probe:
    """What sniffing sees of a path, built by :func:`pytreeio.io.probe` (sniffers never open files).

    Attributes:
      path: the path as given.
      kind: ``"file"``, ``"dir"`` or ``"missing"``.
      head: the first bytes of a file (up to 4 KiB).
      size: a file's size in bytes.
      members: a ZIP file's member names (None when the file is not a ZIP).
      names: a directory's files (relative POSIX paths; None for non-directories).
      heads: the first bytes of a directory's small top-level text files
        (``*.json``, ``*.txt``), by name.
      siblings: for a :class:`Siblings` layout, the probe of each located
        role whose file exists.
    """

    path: Path
    kind: Literal["file", "dir", "missing"] = "file"
    head: bytes = b""
    size: int = 0
    members: tuple[str, ...] | None = None
    names: frozenset[str] | None = None
    heads: Mapping[str, bytes] = field(default_factory=dict)
    siblings: Mapping[str, Probe] = field(default_factory=dict)

    @property
    def is_dir(self) -> bool:
        return self.kind == "dir"

    @property
    def is_file(self) -> bool:
        return self.kind == "file"


# --------------------------------------------------------------------------
# values passed between formats, the API and io
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoded:
    """The output of a format's ``encode``: bytes not yet written anywhere.

    ``chunks`` reference the caller's arrays where possible (no copies);
    ``files`` holds one :class:`Encoded` per file for multi-file layouts.
    ``deferred`` holds errors of a save that partly succeeded (bullet writes
    ``raw.bin`` when quantisation overflows): the API writes what is here,
    then raises them (``strict``) or warns.
    """

    chunks: tuple[Buffer, ...] = ()
    files: Mapping[str, Encoded] | None = None
    deferred: tuple[Exception, ...] = ()
    strict: bool = False

    @property
    def is_multi_file(self) -> bool:
        return self.files is not None

    @property
    def nbytes(self) -> int:
        if self.files is not None:
            return sum(f.nbytes for f in self.files.values())
        return sum(chunk_nbytes(c) for c in self.chunks)

    def tobytes(self) -> bytes:
        """The whole single-file encoding as one ``bytes`` (copies; for tests and small trees).

        :class:`Deferred` chunks are produced here, late ones last, as io writes them.
        """
        if self.files is not None:
            raise TypeError("a multi-file encoding has no single byte string; use .files")
        parts: list[bytes | None] = [None] * len(self.chunks)
        for late in (False, True):
            for i, c in enumerate(self.chunks):
                if not isinstance(c, Deferred):
                    parts[i] = bytes(as_memoryview(c))
                elif c.late == late:
                    parts[i] = bytes(as_memoryview(c.produce()))
        return b"".join(p or b"" for p in parts)

    def __bytes__(self) -> bytes:
        return self.tobytes()


class Decoded(NamedTuple):
    """A format's ``decode`` result: its native tree and its meta document."""

    tree: Any
    meta: dict[str, Any]


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint as :func:`pytreeio.inspect` reports it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class Info:
    """What a checkpoint holds, read from its headers only."""

    format: str
    entries: tuple[Entry, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    @property
    def nbytes(self) -> int:
        """Total tensor bytes."""
        return sum(e.nbytes for e in self.entries)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "nbytes": self.nbytes,
            "entries": [e.to_json() for e in self.entries],
            "meta": self.meta,
        }

    def __str__(self) -> str:
        head = f"{self.path}: " if self.path else ""
        lines = [f"{head}format {self.format}, {len(self.entries)} entries, {_human(self.nbytes)}"]
        if self.entries:
            w_name = max(len(e.name) for e in self.entries)
            w_shape = max(len(str(list(e.shape))) for e in self.entries)
            w_dtype = max(len(e.dtype) for e in self.entries)
            for e in self.entries:
                lines.append(
                    f"  {e.name:<{w_name}}  {list(e.shape)!s:<{w_shape}}  "
                    f"{e.dtype:<{w_dtype}}  {e.nbytes:>12,d} B"
                )
        if self.meta:
            lines.append("  meta:")
            lines.extend("    " + line for line in _meta_lines(self.meta))
        return "\n".join(lines)


#: Lines of meta that ``str(info)`` shows; ``to_json()`` (``inspect --json``) has all of it.
_META_LINES = 60


def _meta_lines(meta: Mapping[str, Any]) -> list[str]:
    """The meta document as indented JSON, number lists folded onto one line, capped."""
    text = json.dumps(meta, sort_keys=True, indent=2, default=str)
    lines: list[str] = []
    folding = False  # the last line is an open list of numbers
    for line in text.splitlines():
        item = line.strip()
        if folding and _is_number(item.rstrip(",")):
            if len(lines[-1]) < 160:
                lines[-1] += " " + item
            elif not lines[-1].endswith("..."):
                lines[-1] += " ..."
            continue
        if folding and item.rstrip(",") == "]":
            lines[-1] += " " + item
            folding = False
            continue
        folding = item.endswith("[")
        lines.append(line)
    if len(lines) > _META_LINES:
        more = len(lines) - _META_LINES
        lines = [*lines[:_META_LINES], f"... ({more} more lines: --json shows all)"]
    return lines


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------
# lazy reads: where each entry's bytes lie
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where one array of a native tree lies in a checkpoint's bytes (for lazy, partial reads).

    A format's ``slots`` function returns the native tree with every array leaf replaced
    by one of these; :meth:`read` then produces exactly the array ``decode``
    would have put there (same dtype, shape and bits), touching only that
    entry's bytes.

    Attributes:
      key: the entry's name as ``inspect`` reports it (for errors and views).
      offset: byte offset of the stored data in its file.
      nbytes: stored size in bytes (``read`` reads exactly this many).
      shape: the array's shape as decode returns it.
      dtype: the stored dtype (byte order included); the result is this
        dtype converted to native byte order when it differs.
      role: for multi-file layouts the key of the file in the source mapping
        (a sibling role or a directory's relative path); None for ``FILE``.
      fortran: the data is stored column-major (read as ``order="F"``, returned
        C-contiguous).
      convert: for entries that are not one plain stored range (a quantised
        tensor, an assembled or transposed value, a Python or numpy scalar, a
        typed PRNG key), applied to the array read from ``(offset, nbytes,
        dtype, stored shape)`` -- ``stored`` is then the stored shape and
        ``shape`` the result's.  Its result is what ``read`` returns.
      stored: the stored shape when ``convert`` changes it (else ``shape``).
      reader: for entries that cannot be read as one range at all (a
        compressed ZIP member, a chunked array, a record whose framing is
        checked as decode checks it), ``reader(source) -> value`` replaces the
        range read; it receives the entry's file source and must raise only
        :class:`pytreeio.errors.PytreeioError` for bad bytes; ``convert``, when
        set too, is applied to its result.  ``offset`` and ``nbytes`` then
        describe the range it reads (for reports).
    """

    key: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: Any
    role: str | None = None
    fortran: bool = False
    convert: Callable[[Any], Any] | None = None
    stored: tuple[int, ...] | None = None
    reader: Callable[[Any], Any] | None = None

    def source_of(self, source: Any) -> Any:
        """This entry's :class:`pytreeio.binary.ByteSource` in ``source`` (one, or a mapping)."""
        return source if self.role is None else source[self.role]

    def check_size(self, src: Any, shape: Sequence[int]) -> Any:
        """The numpy dtype, once ``shape`` of it is checked to fill exactly :attr:`nbytes`.

        A slots function's bug or a lying header it let through is a
        :class:`~pytreeio.errors.FormatError` naming the entry, never numpy's ValueError.
        """
        import numpy as np

        from .binary import check_shape
        from .errors import FormatError

        dtype = np.dtype(self.dtype)
        count = check_shape(shape, dtype.itemsize, path=src.name, field=self.key)
        if count * dtype.itemsize != self.nbytes:
            raise FormatError(
                f"{self.nbytes} stored bytes, shape {tuple(shape)} of {dtype.name} needs "
                f"{count * dtype.itemsize}",
                path=src.name,
                field=self.key,
                offset=self.offset,
            )
        return dtype

    def read(self, source: Any) -> Any:
        """The entry's array, read from ``source`` (a ByteSource or a mapping of them)."""
        import numpy as np

        src = self.source_of(source)
        if self.reader is not None:
            arr = self.reader(src)
            if self.convert is not None:
                arr = self.convert(arr)
        else:
            shape = self.stored if self.stored is not None else self.shape
            dtype = self.check_size(src, shape)
            raw = src.read(self.offset, self.nbytes, self.key)
            arr = np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if self.fortran else "C")
            if not dtype.isnative:
                arr = arr.astype(dtype.newbyteorder("="))
            if not arr.flags.c_contiguous:  # (ascontiguousarray would make 0-d arrays 1-d)
                arr = arr.copy(order="C")
            if self.convert is not None:
                arr = self.convert(arr)
        # Results own their memory: never a read-only view of a buffer the source may reuse.
        if isinstance(arr, np.ndarray) and not arr.flags.writeable:
            arr = arr.copy()
        return arr


register_leaf_type(Slot)  # flatten takes a slots tree's leaves as they are


@dataclass(frozen=True)
class Slots:
    """What a format's ``slots(source, *, <load options>)`` returns.

    ``tree`` is the native tree ``decode`` would return with every array leaf
    replaced by its :class:`Slot` (other leaves -- scalars, strings, None --
    as decode returns them); ``meta`` is decode's meta.  Reading every slot
    and putting the arrays in place gives ``decode``'s result bit for bit, in
    native byte order (where decode keeps a stored big-endian dtype, the
    slot's array holds the same values byte-swapped to native).
    """

    tree: Any
    meta: dict[str, Any]


# --------------------------------------------------------------------------
# streaming: arrays read when they are written
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Deferred:
    """A chunk of an :class:`Encoded` whose bytes are produced only when it is written.

    ``produce()`` returns exactly ``nbytes`` bytes (any buffer); :mod:`pytreeio.io`
    calls it once, writes the result and drops it before the next chunk, so an
    encoding of :class:`Streamed` arrays holds at most one of them at a time per
    file being written (a large directory's files are written by one thread per
    core, each producing its own file's chunks, in order).
    A consumer must be done with a result before the same thread produces the
    next chunk of the same encoding: an encoder may then reuse the buffer
    (cl-waffe2's bands do; bullet's once any next band is taken).  A
    ``late`` chunk (a header recording checksums of the data behind it) is
    produced after every other chunk of its file and written at its place.
    """

    nbytes: int
    produce: Callable[[], Buffer]
    late: bool = False


class Streamed:
    """An array leaf of a checkpoint being converted, read when its bytes are written.

    A streaming conversion (:mod:`pytreeio.conversion`) hands a target whose
    :class:`Format` has ``streams=True`` the source's native tree with these
    in place of its large arrays.  The encoder takes ``shape``, ``dtype``
    (native byte order) and ``nbytes`` for its headers and emits
    :meth:`chunks` for the data: little-endian bytes, as every format
    pytreeio writes stores them.
    """

    __slots__ = ("_held", "_pending", "dtype", "nbytes", "shape", "slot", "source")

    def __init__(self, slot: Slot, source: Any) -> None:
        import numpy as np

        dtype = np.dtype(slot.dtype)
        self.slot = slot
        self.source = source
        self.shape = tuple(int(d) for d in slot.shape)
        self.dtype = dtype if dtype.isnative else dtype.newbyteorder("=")
        self.nbytes = self.dtype.itemsize * math.prod(self.shape)
        self._held: Any = None
        self._pending = 0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    # Views computed when read, so the common model form's transposes, reshapes and
    # casts (``to_model``/``from_model``) pass a streamed array on without reading it.

    def transpose(self, *axes: Any) -> Streamed:
        """This array with its axes permuted (numpy's ``transpose``), read in C order."""
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], Sequence)):
            axes = tuple(axes[0]) if axes[0] is not None else ()
        perm = tuple(int(a) % max(1, self.ndim) for a in axes) or tuple(range(self.ndim))[::-1]
        if sorted(perm) != list(range(self.ndim)):
            raise ValueError(f"axes {axes} do not permute {self.ndim} dimensions")
        if perm == tuple(range(self.ndim)):
            return self
        base, first = self.transposition()
        if base is not self:  # a transpose of a transpose: one, or none
            return base.transpose(tuple(first[a] for a in perm))
        shape = tuple(self.shape[a] for a in perm)
        return Derived(self, functools.partial(_transposed, axes=perm), shape, self.dtype)

    @property
    def T(self) -> Streamed:
        return self.transpose()

    def transposition(self) -> tuple[Streamed, tuple[int, ...]]:
        """``(base, axes)`` with this array ``base.transpose(axes)``; ``(self, identity)`` if no transpose.

        Writers of layouts with a Fortran order (``.npy``) store a reversed
        transpose as its base's bytes, as numpy stores a transposed view.
        """
        if isinstance(self, Derived) and getattr(self.fn, "func", None) is _transposed:
            return self.base, self.fn.keywords["axes"]  # type: ignore[attr-defined]
        return self, tuple(range(self.ndim))

    def c_order(self) -> Streamed:
        """This array as a C-order copy of it is stored: a transposed view no longer is.

        (:meth:`transposition` then finds no transpose, so a ``.npy`` writer
        stores it in C order, as it stores a numpy array copied into C order.)
        """
        if self.transposition()[0] is self:
            return self
        return Derived(self, _same, self.shape, self.dtype)

    def reshape(self, *shape: Any) -> Streamed:
        """This array's C-order data in another shape (one ``-1`` allowed)."""
        if len(shape) == 1 and isinstance(shape[0], Sequence):
            shape = tuple(shape[0])
        dims = [int(d) for d in shape]
        if dims.count(-1) == 1:
            known = -math.prod(dims)  # the product of the other dimensions
            dims[dims.index(-1)] = self.size // known if known else 0
        new = tuple(dims)
        if math.prod(new) != self.size or any(d < 0 for d in new):
            raise ValueError(f"cannot reshape {self.shape} into {tuple(shape)}")
        if new == self.shape:
            return self
        return Derived(self, functools.partial(_reshaped, shape=new), new, self.dtype)

    def astype(self, dtype: Any, copy: bool = True) -> Streamed:
        """This array cast to ``dtype`` (numpy's ``astype``), when read."""
        import numpy as np

        want = np.dtype(dtype)
        if want == self.dtype:
            return self
        base, axes = self.transposition()
        if base is not self:  # cast, then transpose: numpy's astype keeps a transposed layout
            return base.astype(want).transpose(axes)
        return Derived(self, functools.partial(_cast, dtype=want), self.shape, want)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        # Code that needs the values (a check, a quantiser) gets them: read here, whole.
        arr = self.read()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def read(self) -> Any:
        """The array, as ``decode`` would have returned it (C-contiguous, native byte order)."""
        import numpy as np

        from .errors import FormatError

        arr = self.slot.read(self.source)
        if not (
            isinstance(arr, np.ndarray)
            and arr.shape == self.shape
            and arr.dtype == self.dtype
            and arr.flags.c_contiguous
        ):
            raise FormatError(
                f"read {type(arr).__name__} {getattr(arr, 'shape', '')} "
                f"{getattr(arr, 'dtype', '')}, its slot said {self.shape} {self.dtype}",
                field=self.slot.key,
                offset=self.slot.offset,
            )
        return arr

    def _little_bytes(self, seen: Callable[[Any], None] | None) -> Any:
        """The array read, ``seen`` called on it, as a flat little-endian uint8 array."""
        arr = self.read()
        if seen is not None:
            seen(arr)
        if sys.byteorder != "little" and arr.dtype.itemsize > 1:
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return arr.reshape(-1).view("u1")

    def chunk(self, seen: Callable[[Any], None] | None = None) -> Deferred:
        """The data as one :class:`Deferred` chunk; ``seen(array)`` is called on the read (checksums)."""
        return Deferred(self.nbytes, lambda: self._little_bytes(seen).data)

    def chunks(
        self,
        seen: Callable[[Any], None] | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[Deferred, ...]:
        """Bytes ``[start, stop)`` of the C-order data as :class:`Deferred` chunks, in order.

        The whole array is one chunk; ``seen`` gets its bytes in order (one
        array here; a sharded array's bands in :mod:`pytreeio.sharding`).
        Pieces of it (an encoder that splits a large array into records,
        msgpack beyond 1 GiB) share one read: the first piece produced reads
        the array, which is dropped once every piece asked for is produced.
        """
        stop = self.nbytes if stop is None else stop
        if start == 0 and stop == self.nbytes:
            return (self.chunk(seen),)
        self._pending += 1

        def produce() -> Any:
            if self._held is None:
                self._held = self._little_bytes(seen)
            data = self._held[start:stop].data
            self._pending -= 1
            if self._pending <= 0:
                self._held = None
            return data

        return (Deferred(stop - start, produce),)

    def __repr__(self) -> str:
        return f"Streamed({self.slot.key!r}, {self.shape}, {self.dtype})"


class Derived(Streamed):
    """A :class:`Streamed` array computed from another one when read (a transpose, a cast).

    ``fn(base.read())`` must return an array of ``shape`` and ``dtype``; it is
    returned C-contiguous.  Made by :meth:`Streamed.transpose`,
    :meth:`~Streamed.reshape` and :meth:`~Streamed.astype`.
    """

    __slots__ = ("base", "fn")

    def __init__(self, base: Streamed, fn: Callable[[Any], Any], shape: Any, dtype: Any) -> None:
        import numpy as np

        dt = np.dtype(dtype)
        self.base = base
        self.fn = fn
        self.slot = base.slot
        self.source = base.source
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dt if dt.isnative else dt.newbyteorder("=")
        self.nbytes = self.size * self.dtype.itemsize
        self._held = None
        self._pending = 0

    def read(self) -> Any:
        import numpy as np

        arr = np.ascontiguousarray(self.fn(self.base.read()))
        if arr.shape != self.shape or arr.dtype != self.dtype:  # pragma: no cover - a bad fn
            raise AssertionError(f"{self!r} read {arr.shape} {arr.dtype}")
        return arr

    def __repr__(self) -> str:
        return f"Derived({self.base!r} -> {self.shape}, {self.dtype})"


def _transposed(arr: Any, axes: tuple[int, ...]) -> Any:
    import numpy as np

    from .transpose import copy_transposed

    view = arr.transpose(axes)
    out = np.empty(view.shape, view.dtype)
    copy_transposed(view, out)
    return out


def _same(arr: Any) -> Any:
    return arr


def _reshaped(arr: Any, shape: tuple[int, ...]) -> Any:
    return arr.reshape(shape)


def _cast(arr: Any, dtype: Any) -> Any:
    return arr.astype(dtype)


def chunk_nbytes(chunk: Any) -> int:
    """The length of one chunk of an :class:`Encoded` (a buffer or a :class:`Deferred`)."""
    return chunk.nbytes if isinstance(chunk, Deferred) else len(as_memoryview(chunk))


# --------------------------------------------------------------------------
# the Format record
# --------------------------------------------------------------------------


def _structural_restore(native: Any, meta: dict[str, Any], like: Any) -> Any:
    from .tree import restore

    return restore(native, like)


# Parameters the API passes itself; never user options.
_POSITIONAL = frozenset(
    {"tree", "native", "meta", "like", "source", "model", "checked", "dest", "lossy"}
)


#: declared_options by function: every load and save asks (an inspect.signature costs ~25 us).
_DECLARED: dict[Any, frozenset[str]] = {}
_DECLARED_MAX = 1024


def declared_options(fn: Callable[..., Any] | None) -> frozenset[str]:
    """The keyword options ``fn`` declares (keyword-only or keyword parameters, minus the API's)."""
    if fn is None:
        return frozenset()
    try:
        return _DECLARED[fn]
    except (KeyError, TypeError):  # TypeError: an unhashable callable, never cached
        pass
    names = _declared_options(fn)
    if len(_DECLARED) < _DECLARED_MAX:
        with contextlib.suppress(TypeError):
            _DECLARED[fn] = names
    return names


def _declared_options(fn: Callable[..., Any]) -> frozenset[str]:
    try:
        import inspect as _inspect  # at registration, not at import (import time)

        sig = _inspect.signature(fn)
    except (TypeError, ValueError):
        return frozenset()
    names = set()
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            raise TypeError(
                f"{getattr(fn, '__qualname__', fn)} takes **{p.name}: a format function must "
                "declare each option it accepts by name"
            )
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in _POSITIONAL:
            if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD:
                continue  # a positional argument, not an option
            names.add(p.name)
    return frozenset(names)


def takes_dest(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (an ``encode``) wants the destination path as the caller gave it."""
    try:
        import inspect as _inspect

        return "dest" in _inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class Format(NamedTuple):
    """A checkpoint format: a record of pure functions plus how it sits on disk.

    Attributes:
      name: registry name, e.g. ``"msgpack"``.
      description: one line for ``pytreeio formats``.
      suffixes: file suffixes that select this format on save (``".msgpack"``).
      layout: :data:`FILE`, a :class:`Siblings` value or :data:`DIRECTORY`.
      encode: ``encode(tree, *, meta=None, [dest=None,] [model=None,] [checked=False,]
        <save options>) -> Encoded``; takes the native tree (and the common shapes
        it documents).  One that declares ``model`` is given the
        :class:`~pytreeio.model.Model` when ``tree`` and ``meta`` are what
        ``from_model`` made of it, and may skip checking them again; one that
        declares ``checked`` is told so with ``checked=True`` (also when the
        mapping was kept from an earlier save of the same inputs:
        :mod:`pytreeio.model_plans`, which the ``model`` parameter rules out).
      decode: ``decode(source, *, <load options>) -> Decoded`` (native tree, meta).
      inspect: ``inspect(source) -> Info`` touching only headers; ``source``
        is a :class:`pytreeio.binary.ByteSource` (a mapping of them for
        multi-file layouts) whose ``read(offset, n, field)`` is bounded.
      sniff: ``sniff(probe) -> float``; 0 when the content is not this format.
      restore: ``restore(native, meta, like, *, <load options>) -> tree``:
        the native tree in the structure of a native-shaped ``like``.
        Defaults to structural matching by key path.  (Model-shaped ``like``
        trees go through ``to_model`` instead; see :mod:`pytreeio.model`.)
      to_model: ``to_model(native, meta, *, <load options>) -> Model`` for
        formats that hold a layered model; None for the others.
      from_model: ``from_model(model, *, <save options>) -> (native, meta)``.
      accepts_meta: ``encode`` uses the caller's ``meta``.
      keeps_meta: the ``meta`` given on save comes back from ``decode``.
      slots: ``slots(source, *, <load options>) -> Slots`` for lazy and partial
        loads (``pytreeio.open``): where each native array lies, read from
        headers only (``source`` as for ``inspect``); None when the format
        has none (lazy views then decode the whole checkpoint once).
      streams: ``encode`` takes :class:`Streamed` array leaves (headers from
        their shapes and dtypes) and emits :class:`Deferred` chunks for their
        data, so conversions into this format stream tensor by tensor.
    """

    name: str
    description: str
    suffixes: tuple[str, ...]
    layout: Layout
    encode: Callable[..., Encoded]
    decode: Callable[..., Decoded]
    inspect: Callable[..., Info]
    sniff: Callable[[Probe], float]
    restore: Callable[..., Any] = _structural_restore
    to_model: Callable[..., Any] | None = None
    from_model: Callable[..., Any] | None = None
    accepts_meta: bool = True
    keeps_meta: bool = True
    slots: Callable[..., Slots] | None = None
    streams: bool = False

    @property
    def is_model_format(self) -> bool:
        return self.to_model is not None and self.from_model is not None

    @property
    def save_options(self) -> frozenset[str]:
        """Options ``save``/``encode`` accept (model formats also take ``layers``)."""
        extra = frozenset({"layers"}) if self.is_model_format else frozenset()
        return declared_options(self.encode) | declared_options(self.from_model) | extra

    @property
    def load_options(self) -> frozenset[str]:
        """Options ``load``/``decode`` accept."""
        return (
            declared_options(self.decode)
            | declared_options(self.restore)
            | declared_options(self.to_model)
            | declared_options(self.slots)
        )

    def check_options(self, options: Mapping[str, Any], direction: str) -> None:
        """Raise ``TypeError`` for options this format does not take in ``direction``."""
        accepted = self.save_options if direction == "save" else self.load_options
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise TypeError(
                f"format {self.name!r} takes no {direction} option(s) {', '.join(unknown)} "
                f"(accepted: {', '.join(sorted(accepted)) or 'none'})"
            )

    def options_for(
        self, fn: Callable[..., Any] | None, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The subset of ``options`` that ``fn`` declares."""
        names = declared_options(fn)
        return {k: v for k, v in options.items() if k in names}


_REGISTRY: dict[str, Format] = {}
_builtins_loaded = False
_builtins_loading = False
# Threads that consult the registry first must wait until every built-in format is registered.
_builtins_lock = threading.RLock()


def _load_builtins() -> None:
    global _builtins_loaded, _builtins_loading
    if _builtins_loaded:
        return
    with _builtins_lock:
        if _builtins_loaded or _builtins_loading:  # (a format module consulting the registry)
            return
        _builtins_loading = True
        try:
            from .fmt import load  # the format package lists its modules; they call register()

            load()
        finally:
            _builtins_loaded = True
            _builtins_loading = False


def register(fmt: Format, *, replace: bool = False) -> Format:
    """Add ``fmt`` to the registry under ``fmt.name`` and return it.

    Checks that every function declares its options by name (no ``**kwargs``),
    so that a misspelt option is a ``TypeError`` rather than silently ignored.
    """
    if not isinstance(fmt, Format):
        raise TypeError(f"register() takes a pytreeio.Format, not {type(fmt).__name__}")
    if not isinstance(fmt.layout, File | Siblings | Directory):
        raise TypeError(f"format {fmt.name!r}: layout must be FILE, Siblings(...) or DIRECTORY")
    for fn in (fmt.encode, fmt.decode, fmt.restore, fmt.to_model, fmt.from_model, fmt.slots):
        declared_options(fn)  # raises for **kwargs
    if not replace and fmt.name in _REGISTRY and _REGISTRY[fmt.name] is not fmt:
        raise ValueError(f"a format named {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format (tests and user plug-ins that re-register)."""
    _REGISTRY.pop(name, None)


def formats() -> dict[str, Format]:
    """All registered formats, by name."""
    _load_builtins()
    return dict(_REGISTRY)


def get(name: str | Format, *, path: str | os.PathLike[str] | None = None) -> Format:
    """The format called ``name`` (a :class:`Format` is returned as is)."""
    if isinstance(name, Format):
        return name
    _load_builtins()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownFormatError(
            f"unknown format {name!r}; known formats: {known}",
            path=os.fspath(path) if path is not None else None,
        ) from None


def for_suffix(path: str | os.PathLike[str]) -> Format | None:
    """The single format whose suffix ends ``path``, or None (unknown or ambiguous)."""
    _load_builtins()
    name = os.fspath(path).lower()
    hits = [f for f in _REGISTRY.values() if any(name.endswith(s) for s in f.suffixes)]
    if not hits:
        return None
    longest = max(max(len(s) for s in f.suffixes if name.endswith(s)) for f in hits)
    best = [f for f in hits if any(name.endswith(s) and len(s) == longest for s in f.suffixes)]
    return best[0] if len(best) == 1 else None


def best_match(probe_for: Callable[[Layout], Probe]) -> Format | None:
    """The format whose ``sniff`` scores highest on the probe io built for its layout.

    ``probe_for(layout)`` is called once per distinct layout.  A sniffer that
    raises is treated as "not this format": sniffing must never turn a load
    into a crash.  Ties go to the format registered first.
    """
    _load_builtins()
    probes: dict[Layout, Probe] = {}
    best: tuple[float, Format] | None = None
    for fmt in _REGISTRY.values():
        if fmt.layout not in probes:
            probes[fmt.layout] = probe_for(fmt.layout)
        try:
            score = float(fmt.sniff(probes[fmt.layout]))
        except Exception:
            continue
        if score > 0 and (best is None or score > best[0]):
            best = (score, fmt)
    return best[1] if best else None


def iter_formats() -> Iterator[Format]:
    _load_builtins()
    yield from _REGISTRY.values()
