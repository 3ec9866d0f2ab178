"""Bounded little-endian reading and zero-copy writing of binary layouts.

This is the only module that unpacks fixed-width integers.  `Reader`
checks every length against the bytes that remain *before* anything is
allocated, so a hostile length field costs nothing but a `FormatError`
naming the field and the offset.  `Writer` collects small headers and
large array buffers as a list of chunks, so arrays are never copied on the way
to the file.

Shapes read from files are checked by `check_shape` before numpy sees
them: at most `MAX_NDIM` dimensions, no negative dimension, and the
product of the non-zero dimensions times the item size below
`MAX_ARRAY_BYTES` -- numpy itself raises ``ValueError`` for more
dimensions than it supports and for a shape like ``(0, 2**62, 2**62)``
(zero elements, but an overflowing nominal size), and zero-sized item types
(``<U0``, ``|S0``) cannot be viewed at all.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytreeio.core.errors import FormatError
from pytreeio.core.tree import register_leaf_type

__all__ = [
    "Reader",
    "Writer",
    "Buffer",
    "ByteSource",
    "BufferSource",
    "as_memoryview",
    "utf8_text",
    "BadUtf8",
    "check_shape",
    "MAX_NDIM",
    "MAX_ARRAY_BYTES",
]

#: Anything exposing the buffer protocol (bytes, bytearray, memoryview, mmap, ndarray).
Buffer = Any

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_F32 = struct.Struct("<f")
# Big-endian, for formats framed in network order (msgpack).
_BE_I8 = struct.Struct(">b")
_BE_U16 = struct.Struct(">H")
_BE_I16 = struct.Struct(">h")
_BE_U32 = struct.Struct(">I")
_BE_I32 = struct.Struct(">i")
_BE_U64 = struct.Struct(">Q")
_BE_I64 = struct.Struct(">q")
_BE_F32 = struct.Struct(">f")
_BE_F64 = struct.Struct(">d")


def _numpy_max_ndim() -> int:
    # numpy 2 allows 64 dimensions, numpy 1 allowed 32; ask rather than assume.
    for n in (64, 32):
        try:
            np.empty((1,) * n, np.uint8)
        except ValueError:
            continue
        return n
    return 32


#: The most dimensions an array read from a file may have (numpy's own limit).
MAX_NDIM = _numpy_max_ndim()
#: Bound on ``itemsize * product of the non-zero dimensions`` (numpy needs it below 2**63).
MAX_ARRAY_BYTES = 2**62
_FAST_DIM = 2**31


def check_shape(
    shape: Sequence[Any],
    itemsize: int,
    *,
    path: str | None = None,
    field: str | None = None,
    offset: int | None = None,
) -> int:
    """The element count of ``shape``, after checking that numpy can hold it.

    Raises `FormatError` (never numpy's ``ValueError``/``OverflowError``)
    for non-integer or negative dimensions, more than `MAX_NDIM` of
    them, a zero ``itemsize``, or a nominal size (zeros skipped, as numpy
    computes it) of `MAX_ARRAY_BYTES` or more.
    """

    # The common case first (a few plain positive ints): this runs once per tensor read.
    if (
        itemsize > 0
        and len(shape) <= 8
        and all(type(d) is int and 0 < d < _FAST_DIM for d in shape)
    ):
        count = math.prod(shape)
        if count * itemsize < MAX_ARRAY_BYTES:
            return count

    def bad(reason: str) -> FormatError:
        return FormatError(reason, path=path, field=field, offset=offset)

    if len(shape) > MAX_NDIM:
        raise bad(f"{len(shape)} dimensions exceed numpy's limit of {MAX_NDIM}")
    if itemsize <= 0:
        raise bad("zero-sized item type (e.g. '<U0', '|S0') cannot be read")
    count = 1
    nominal = itemsize
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int | np.integer):
            raise bad(f"dimension {d!r} in shape {tuple(shape)!r:.80} is not an integer")
        if d < 0:
            raise bad(f"negative dimension {d} in shape {tuple(shape)!r:.80}")
        count *= int(d)
        if d:
            nominal *= int(d)
            if nominal >= MAX_ARRAY_BYTES:
                raise bad(f"shape {tuple(shape)!r:.80} is too large for any array")
    return count


def as_memoryview(buffer: Buffer) -> memoryview:
    """A flat, byte-format memoryview of ``buffer`` (no copy)."""
    view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


#: Inputs larger than this are checked for UTF-8 in pieces of this size before the one decode
#: that makes their text: a failed decode's UnicodeDecodeError holds a copy of all its input.
_UTF8_PIECE = 1 << 20


class BadUtf8(ValueError):
    """Invalid UTF-8: ``reason`` (as ``UnicodeDecodeError`` gives it) at byte ``start``."""

    def __init__(self, reason: str, start: int) -> None:
        super().__init__(f"invalid UTF-8 at byte {start}: {reason}")
        self.reason = reason
        self.start = start


def utf8_text(data: Buffer) -> str:
    """``data`` decoded as UTF-8 (strict), or `BadUtf8` naming the first invalid byte.

    Peak memory is the text alone: a large input is first checked piece by
    piece (the exception of a failed one-shot decode would copy all of it),
    then decoded once.
    """
    view = as_memoryview(data)
    n = len(view)
    if n > _UTF8_PIECE:
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")()
        for start in range(0, n, _UTF8_PIECE):
            held = len(decoder.getstate()[0])  # a character's first bytes, from the last piece
            try:
                decoder.decode(view[start : start + _UTF8_PIECE], start + _UTF8_PIECE >= n)
            except UnicodeDecodeError as exc:
                raise BadUtf8(exc.reason, start - held + exc.start) from None
    try:
        return str(view, "utf-8")
    except UnicodeDecodeError as exc:
        raise BadUtf8(exc.reason, exc.start) from None


class Reader:
    """Sequential reader over a buffer, bounded by its length.

    Args:
      buffer: the bytes to read (not copied).
      source: name of the file or buffer, used in error messages.
      start: absolute offset of ``buffer[0]`` in the original file, so that
        offsets reported for a sub-buffer are offsets in the file.
    """

    __slots__ = ("pos", "source", "start", "view")

    def __init__(self, buffer: Buffer, *, source: str | None = None, start: int = 0) -> None:
        self.view = as_memoryview(buffer)
        self.pos = 0
        self.source = source
        self.start = start

    # -- bookkeeping -------------------------------------------------------
    @property
    def offset(self) -> int:
        """Absolute offset of the next byte to read."""
        return self.start + self.pos

    @property
    def remaining(self) -> int:
        return len(self.view) - self.pos

    def error(
        self, reason: str, field: str | None = None, offset: int | None = None
    ) -> FormatError:
        """A `FormatError` located at ``offset`` (default: the current one)."""
        return FormatError(
            reason, path=self.source, field=field, offset=self.offset if offset is None else offset
        )

    def need(self, n: int, field: str) -> None:
        """Raise unless ``n`` more bytes are available."""
        if n < 0:
            raise self.error(f"negative length {n}", field)
        if n > len(self.view) - self.pos:
            raise self.error(
                f"truncated: needs {n} bytes, only {len(self.view) - self.pos} remain", field
            )

    def skip(self, n: int, field: str) -> None:
        self.need(n, field)
        self.pos += n

    def expect_end(self, field: str = "end of file") -> None:
        if self.pos != len(self.view):
            raise self.error(f"{len(self.view) - self.pos} unexpected trailing bytes", field)

    # -- scalars -----------------------------------------------------------
    def _unpack(self, st: struct.Struct, field: str) -> Any:
        pos = self.pos
        if st.size > len(self.view) - pos:
            raise self.error(
                f"truncated: needs {st.size} bytes, only {len(self.view) - pos} remain", field
            )
        self.pos = pos + st.size
        return st.unpack_from(self.view, pos)[0]

    def u8(self, field: str) -> int:
        pos = self.pos
        if pos >= len(self.view):
            raise self.error("truncated: needs 1 byte, none remain", field)
        self.pos = pos + 1
        return self.view[pos]  # type: ignore[no-any-return]

    def u16(self, field: str) -> int:
        return int(self._unpack(_U16, field))

    def u32(self, field: str) -> int:
        return int(self._unpack(_U32, field))

    def i32(self, field: str) -> int:
        return int(self._unpack(_I32, field))

    def u64(self, field: str) -> int:
        return int(self._unpack(_U64, field))

    def f32(self, field: str) -> float:
        return float(self._unpack(_F32, field))

    def be_i8(self, field: str) -> int:
        return int(self._unpack(_BE_I8, field))

    def be_u16(self, field: str) -> int:
        return int(self._unpack(_BE_U16, field))

    def be_i16(self, field: str) -> int:
        return int(self._unpack(_BE_I16, field))

    def be_u32(self, field: str) -> int:
        return int(self._unpack(_BE_U32, field))

    def be_i32(self, field: str) -> int:
        return int(self._unpack(_BE_I32, field))

    def be_u64(self, field: str) -> int:
        return int(self._unpack(_BE_U64, field))

    def be_i64(self, field: str) -> int:
        return int(self._unpack(_BE_I64, field))

    def be_f32(self, field: str) -> float:
        return float(self._unpack(_BE_F32, field))

    def be_f64(self, field: str) -> float:
        return float(self._unpack(_BE_F64, field))

    def sub(self, n: int, field: str) -> Reader:
        """A reader over the next ``n`` bytes (consumed here), reporting file offsets."""
        start = self.offset
        return Reader(self.bytes(n, field), source=self.source, start=start)

    def struct(self, st: struct.Struct, field: str) -> tuple[Any, ...]:
        """Unpack a caller-defined fixed-size struct (e.g. a whole header)."""
        pos = self.pos
        if st.size > len(self.view) - pos:
            raise self.error(
                f"truncated: needs {st.size} bytes, only {len(self.view) - pos} remain", field
            )
        self.pos = pos + st.size
        return st.unpack_from(self.view, pos)

    # -- byte strings and arrays -------------------------------------------
    def bytes(self, n: int, field: str) -> memoryview:
        """The next ``n`` bytes as a view (no copy)."""
        self.need(n, field)
        pos = self.pos
        self.pos = pos + n
        return self.view[pos : pos + n]

    def text(self, n: int, field: str, encoding: str = "utf-8") -> str:
        start = self.offset
        raw = self.bytes(n, field)
        try:
            return utf8_text(raw) if encoding == "utf-8" else str(raw, encoding)
        except (BadUtf8, UnicodeDecodeError) as exc:
            raise self.error(
                f"invalid {encoding}: {exc.reason}", field, start + exc.start
            ) from None

    def array(self, dtype: Any, shape: Sequence[int], field: str) -> np.ndarray:
        """The next ``prod(shape)`` elements of ``dtype`` as an array view (no copy).

        The shape is checked with `check_shape` and the byte count
        against the remaining bytes before numpy sees either, so an absurd
        shape cannot trigger an allocation, an overflow or a numpy error.
        """
        dt = dtype if type(dtype) is np.dtype else np.dtype(dtype)
        count = check_shape(shape, dt.itemsize, path=self.source, field=field, offset=self.offset)
        nbytes = count * dt.itemsize
        pos = self.pos
        if nbytes > len(self.view) - pos:
            self.need(nbytes, field)  # raises, naming the field and offset
        self.pos = pos + nbytes
        # One ndarray object straight on the buffer (frombuffer + reshape makes two).
        dims = shape if type(shape) is tuple else tuple(shape)
        return np.ndarray(dims, dt, buffer=self.view, offset=pos)


#: Buffers shorter than this are copied into a writer's pending bytes; longer ones are referenced.
_SMALL_CHUNK = 4096


class Writer:
    """Collects an encoding as a list of chunks without copying array data.

    Small fields are packed into a pending ``bytearray``; arrays are appended
    as memoryviews of their own (C-contiguous) buffers.
    """

    __slots__ = ("_pending", "chunks", "nbytes")

    def __init__(self) -> None:
        self.chunks: list[Buffer] = []
        self._pending = bytearray()
        self.nbytes = 0

    def _flush(self) -> None:
        if self._pending:
            self.chunks.append(bytes(self._pending))
            self._pending = bytearray()

    def raw(self, data: Buffer) -> None:
        """Append bytes; large buffers are referenced, small ones copied."""
        if type(data) is bytes and len(data) < _SMALL_CHUNK:
            self._pending += data
            self.nbytes += len(data)
            return
        view = as_memoryview(data)
        n = len(view)
        if n >= _SMALL_CHUNK:
            self._flush()
            self.chunks.append(view)
        else:
            self._pending += view
        self.nbytes += n

    def deferred(self, chunk: Any) -> None:
        """Append a chunk produced only when written (a `pytreeio.core.binary.Deferred`)."""
        self._flush()
        self.chunks.append(chunk)
        self.nbytes += chunk.nbytes

    def u8(self, v: int) -> None:
        self._pending += _U8.pack(v)
        self.nbytes += 1

    def u32(self, v: int) -> None:
        self._pending += _U32.pack(v)
        self.nbytes += 4

    def i32(self, v: int) -> None:
        self._pending += _I32.pack(v)
        self.nbytes += 4

    def u64(self, v: int) -> None:
        self._pending += _U64.pack(v)
        self.nbytes += 8

    def f32(self, v: float) -> None:
        self._pending += _F32.pack(v)
        self.nbytes += 4

    def struct(self, st: struct.Struct, *values: Any) -> None:
        self._pending += st.pack(*values)
        self.nbytes += st.size

    def array(self, arr: np.ndarray, dtype: Any = None) -> None:
        """Append an array's bytes in C order as the given little-endian dtype.

        A C-contiguous little-endian array of the right dtype is referenced
        (or, under 4 KiB, packed with the small fields), never serialised.
        A `pytreeio.core.binary.Streamed` array (a conversion's) is
        appended as `pytreeio.core.binary.Deferred` chunks, read (and
        cast) when written.
        """
        if type(arr) is not np.ndarray and isinstance(arr, Streamed):
            s = arr if dtype is None else arr.astype(np.dtype(dtype).newbyteorder("="))
            for chunk in s.chunks() if s.nbytes else ():
                self.deferred(chunk)
            return
        a = arr if type(arr) is np.ndarray else np.asarray(arr)
        if dtype is not None and a.dtype == dtype and a.dtype.byteorder != ">":
            dtype = None  # already the little-endian dtype asked for: written as it is
        if dtype is None and a.dtype.byteorder != ">" and a.flags.c_contiguous and a.nbytes:
            try:  # the common case, ~3x faster than reshape/view/data
                view = memoryview(a).cast("B")  # type: ignore[arg-type]
            except (ValueError, TypeError, BufferError):  # dtypes the buffer protocol lacks
                pass
            else:
                self.raw(view)
                return
        if dtype is not None:
            want = np.dtype(dtype).newbyteorder("<")
            if a.dtype != want:
                a = a.astype(want)
        elif a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        if a.nbytes:
            self.raw(a.reshape(-1).view(np.uint8).data)

    def extend(self, parts: Iterable[Any], dtype: Any) -> None:
        """`raw` each ``bytes`` and `array` ``(part, dtype)`` each other part, in order.

        The same bytes as those calls; runs of small pieces (which they copy
        anyway) are joined in one copy instead, as the calls' overhead, not
        the copy, is what a file of many tiny tensors costs.
        """
        want = np.dtype(dtype).newbyteorder("<")
        joinable = want.kind in "biuf"  # dtypes the buffer protocol has
        run: list[Any] = []
        for part in parts:
            if type(part) is bytes:
                if len(part) < _SMALL_CHUNK:
                    run.append(part)
                    continue
            elif (
                joinable
                and type(part) is np.ndarray
                and part.nbytes < _SMALL_CHUNK
                and part.dtype == want
                and part.flags.c_contiguous
            ):
                run.append(part)
                continue
            if run:
                self.raw(b"".join(run))
                run = []
            if type(part) is bytes:
                self.raw(part)
            else:
                self.array(part, dtype)
        if run:
            self.raw(b"".join(run))

    def finish(self) -> list[Buffer]:
        """The chunks written so far (the writer may not be used afterwards)."""
        self._flush()
        return self.chunks


class ByteSource:
    """Random access to a file's bytes, for reading headers without the data.

    ``inspect`` functions receive one of these (or, for multi-file layouts, a
    mapping of them).  ``read`` checks the range against ``size`` and counts
    ``bytes_read`` so tests can prove that only headers were touched.
    """

    name: str | None
    size: int
    bytes_read: int

    def read(self, offset: int, n: int, field: str) -> memoryview:
        """``n`` bytes at ``offset``; `FormatError` if the file is shorter."""
        self._check_range(offset, n, field)
        data = self._read(offset, n)
        self.bytes_read += n
        return data

    def _check_range(self, offset: int, n: int, field: str) -> None:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise FormatError(
                f"truncated: needs {n} bytes at offset {offset}, file has {self.size}",
                path=self.name,
                field=field,
                offset=offset,
            )

    def reader(self, offset: int, n: int, field: str) -> Reader:
        """A `Reader` over ``n`` bytes at ``offset`` reporting file offsets."""
        return Reader(self.read(offset, n, field), source=self.name, start=offset)

    def view(self) -> memoryview:
        """The whole content as a buffer (a read-only map for files: pages load when touched)."""
        raise NotImplementedError

    def _read(self, offset: int, n: int) -> memoryview:
        raise NotImplementedError


class BufferSource(ByteSource):
    """A `ByteSource` over an in-memory buffer."""

    def __init__(self, buffer: Buffer, name: str | None = None) -> None:
        self._view = as_memoryview(buffer)
        self.name = name
        self.size = len(self._view)
        self.bytes_read = 0

    def _read(self, offset: int, n: int) -> memoryview:
        return self._view[offset : offset + n]

    def view(self) -> memoryview:
        return self._view


# --------------------------------------------------------------------------
# lazy reads: where each entry's bytes lie
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where one array of a native tree lies in a checkpoint's bytes (for lazy, partial reads).

    A format's ``slots`` function returns the native tree with every array leaf replaced
    by one of these; `read` then produces exactly the array ``decode``
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
        `pytreeio.core.errors.PytreeioError` for bad bytes; ``convert``, when
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
        """This entry's `pytreeio.core.binary.ByteSource` in ``source`` (one, or a mapping)."""
        return source if self.role is None else source[self.role]

    def check_size(self, src: Any, shape: Sequence[int]) -> Any:
        """The numpy dtype, once ``shape`` of it is checked to fill exactly `nbytes`.

        A slots function's bug or a lying header it let through is a
        `pytreeio.core.errors.FormatError` naming the entry, never numpy's ValueError.
        """
        import numpy as np

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
    replaced by its `Slot` (other leaves -- scalars, strings, None --
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
    """A chunk of an `Encoded` whose bytes are produced only when it is written.

    ``produce()`` returns exactly ``nbytes`` bytes (any buffer); `pytreeio.io`
    calls it once, writes the result and drops it before the next chunk, so an
    encoding of `Streamed` arrays holds at most one of them at a time per
    file being written (a large directory's files are written by one thread per
    core, each producing its own file's chunks, in order).
    A consumer must be done with a result before the same thread produces the
    next chunk of the same encoding: an encoder may then reuse the buffer
    (bullet's bands do once any next band is taken).  A
    ``late`` chunk (a header recording checksums of the data behind it) is
    produced after every other chunk of its file and written at its place.
    """

    nbytes: int
    produce: Callable[[], Buffer]
    late: bool = False


class Streamed:
    """An array leaf of a checkpoint being converted, read when its bytes are written.

    A streaming conversion (`pytreeio.engine.conversion`) hands a target whose
    `Format` has ``streams=True`` the source's native tree with these
    in place of its large arrays.  The encoder takes ``shape``, ``dtype``
    (native byte order) and ``nbytes`` for its headers and emits
    `chunks` for the data: little-endian bytes, as every format
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

        (`transposition` then finds no transpose, so a ``.npy`` writer
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
        """The data as one `Deferred` chunk; ``seen(array)`` is called on the read (checksums)."""
        return Deferred(self.nbytes, lambda: self._little_bytes(seen).data)

    def chunks(
        self,
        seen: Callable[[Any], None] | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[Deferred, ...]:
        """Bytes ``[start, stop)`` of the C-order data as `Deferred` chunks, in order.

        The whole array is one chunk; ``seen`` gets its bytes in order (one
        array here; a sharded array's bands in `pytreeio.multihost`).
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
    """A `Streamed` array computed from another one when read (a transpose, a cast).

    ``fn(base.read())`` must return an array of ``shape`` and ``dtype``; it is
    returned C-contiguous.  Made by `Streamed.transpose`,
    `Streamed.reshape` and `Streamed.astype`.
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

    from pytreeio.core.transpose import copy_transposed

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
    """The length of one chunk of an `Encoded` (a buffer or a `Deferred`)."""
    return chunk.nbytes if isinstance(chunk, Deferred) else len(as_memoryview(chunk))
