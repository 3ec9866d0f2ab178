"""Format ``msgpack``: flax.serialization's msgpack state dicts, byte for byte.

The file is one msgpack object (big-endian framing), the flax *state dict*
of the tree: dicts with ``str(key)`` keys; lists, tuples and NamedTuples as
maps (``'0'``, ``'1'``, ... or field names); ``None`` as nil; Python
scalars as msgpack scalars.  Arrays are msgpack extension objects:

==========  ==========================================================
ext code    payload (itself msgpack)
==========  ==========================================================
1 ndarray   ``[shape: array of uint, dtype name: str, data: bin]``
            (C order, native = little-endian byte order)
2 complex   ``[real: float64, imag: float64]`` (Python ``complex``)
3 npscalar  as ndarray, 0-d; decodes to a numpy scalar
==========  ==========================================================

Arrays larger than ``chunk_bytes`` (2**30, flax's ``MAX_CHUNK_SIZE``) are
written as ``{'__msgpack_chunked_array__': True, 'shape': {'0': d0, ...},
'chunks': {'0': flat_chunk_0, ...}}`` with ``chunk_bytes // itemsize``
elements per chunk, as flax does.

Typed PRNG keys (``jax.random.key``) are written as ``{'__msgpack_prng_key__':
True, 'impl': 'threefry2x32', 'data': <uint32 key data>}`` and read back as
keys; flax reads that map as it is.  NNX Variables are written as their
values (`pytreeio.core.nnx`).  A file without keys is what flax writes.

Arrays are written from their own buffers (sharded and streamed ones as
deferred chunks); ``decode`` returns views of the bytes; ``inspect`` and
``slots`` read the framing alone.  Reading is bounded: nesting depth, the
number of containers (`CONTAINER_COST`), shapes and every length.
``inspect`` lists at most `LIST_LIMIT` scalars per container and
`SCALAR_BUDGET` per file, counting the rest in
``Info.meta["unlisted_scalars"]``.  With no magic number, ``sniff`` only guesses weakly.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np

from pytreeio.core import dtypes, keys, nnx, shards
from pytreeio.core.binary import (
    ByteSource,
    Reader,
    Slot,
    Slots,
    Streamed,
    Writer,
    as_memoryview,
    check_shape,
)
from pytreeio.core.errors import EncodeError, FormatError
from pytreeio.core.records import FILE, WEAK, Decoded, Encoded, Entry, Format, Info, Probe
from pytreeio.core.tree import is_jax_array, is_namedtuple, key_string, namedtuple_fields
from pytreeio.formats.registry import register

__all__ = ["FORMAT", "encode", "decode", "inspect", "sniff", "MAX_CHUNK_BYTES"]

#: flax.serialization.MAX_CHUNK_SIZE: arrays above this many bytes are chunked.
MAX_CHUNK_BYTES = 2**30
_CHUNKED = "__msgpack_chunked_array__"
#: The map a typed PRNG key is written as (see the module doc).
_PRNG_KEY = "__msgpack_prng_key__"
_MARKERS = (_CHUNKED, _PRNG_KEY)
_EXT_NDARRAY, _EXT_COMPLEX, _EXT_NPSCALAR = 1, 2, 3
_MAX_DEPTH = 200  # each level costs two Python frames; flax trees are rarely 20 deep
#: Bytes of Python objects one map or array costs at most; the file may hold
#: ``(size + 64 MiB) / CONTAINER_COST`` of them (a 2 MB file of two million empty
#: arrays would otherwise cost 130 MB).  Real state dicts hold a few per array.
CONTAINER_COST = 64
_CONTAINER_ALLOWANCE = 64 * 1024 * 1024
#: inspect lists the scalars of containers with at most this many children ...
LIST_LIMIT = 64
#: ... and at most this many scalars per file; the others are counted.
SCALAR_BUDGET = 4096
_SCALARS = (bool, int, float, str, bytes, complex, type(None))
_packb = msgpack.packb


# --------------------------------------------------------------------------
# encoding
# --------------------------------------------------------------------------


def _container_header(n: int, small: int, b16: int, b32: int) -> bytes:
    if n < 16:
        return bytes((small | n,))
    if n < 0x10000:
        return bytes((b16,)) + n.to_bytes(2, "big")
    return bytes((b32,)) + n.to_bytes(4, "big")


def _map_header(n: int) -> bytes:
    return _container_header(n, 0x80, 0xDE, 0xDF)


def _bin_header(n: int) -> bytes:
    if n < 0x100:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    if n < 0x100000000:
        return b"\xc6" + n.to_bytes(4, "big")
    raise EncodeError(f"array of {n} bytes exceeds msgpack's 4 GiB limit; lower chunk_bytes")


_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}


def _ext_header(code: int, n: int) -> bytes:
    """The extension header msgpack itself would write for ``n`` payload bytes."""
    fixed = _FIXEXT.get(n)
    if fixed is not None:
        return bytes((fixed, code))
    if n < 0x100:
        return bytes((0xC7, n, code))
    if n < 0x10000:
        return b"\xc8" + n.to_bytes(2, "big") + bytes((code,))
    if n < 0x100000000:
        return b"\xc9" + n.to_bytes(4, "big") + bytes((code,))
    raise EncodeError(f"extension payload of {n} bytes exceeds msgpack's 4 GiB limit")


@functools.cache
def _packed_dtype_name(dt: np.dtype[Any]) -> bytes:
    return _packb(dt.name)


def _array_head(shape: tuple[int, ...], dt: np.dtype[Any], nbytes: int, code: int) -> bytes:
    """The extension header and ``[shape, dtype, bin header]`` that precede an array's bytes."""
    head = b"\x93" + _packb(shape) + _packed_dtype_name(dt) + _bin_header(nbytes)
    return _ext_header(code, len(head) + nbytes) + head


def _as_host_array(x: Any, path: tuple[Any, ...]) -> np.ndarray:
    arr = np.asarray(x)
    why = dtypes.check_plain(arr.dtype)
    if why is not None:
        raise EncodeError(why, key_path=key_string(path))
    return dtypes.c_order(arr)


class _Encoder:
    def __init__(self, chunk_bytes: int) -> None:
        self.w = Writer()
        self.chunk_bytes = chunk_bytes

    def ext_array(self, arr: np.ndarray, code: int) -> None:
        self.w.raw(_array_head(arr.shape, arr.dtype, arr.nbytes, code))
        self.w.array(arr)

    def chunk_map(self, shape: tuple[int, ...], itemsize: int, count: int) -> tuple[int, range]:
        """Write a chunked array's map up to its chunks: ``(elements per chunk, chunk starts)``."""
        per_chunk = max(1, int(self.chunk_bytes / itemsize))
        starts = range(0, count, per_chunk)
        dims = b"".join(_packb(str(i)) + _packb(d) for i, d in enumerate(shape))
        self.w.raw(
            _map_header(3) + _packb(_CHUNKED) + b"\xc3" + _packb("shape")
            + _map_header(len(shape)) + dims + _packb("chunks") + _map_header(len(starts))
        )  # fmt: skip
        return per_chunk, starts

    def chunked(self, arr: np.ndarray) -> None:
        per_chunk, starts = self.chunk_map(arr.shape, arr.dtype.itemsize, arr.size)
        flat = arr.reshape(-1)
        for i, s in enumerate(starts):
            self.w.raw(_packb(str(i)))
            self.ext_array(flat[s : s + per_chunk], _EXT_NDARRAY)

    def streamed(self, leaf: Streamed, path: tuple[Any, ...]) -> None:
        """An array whose bytes come later (a sharded jax array's shards, a streaming
        conversion's source): the framing from its shape and dtype, the data as deferred chunks."""
        why = dtypes.check_plain(leaf.dtype)
        if why is not None:
            raise EncodeError(why, key_path=key_string(path))
        dt, size = leaf.dtype.newbyteorder("<"), leaf.nbytes
        if size <= self.chunk_bytes:
            self.w.raw(_array_head(leaf.shape, dt, size, _EXT_NDARRAY))
            for c in leaf.chunks():
                self.w.deferred(c)
            return
        count = size // dt.itemsize
        per_chunk, starts = self.chunk_map(leaf.shape, dt.itemsize, count)
        for i, s in enumerate(starts):
            n = min(per_chunk, count - s)
            self.w.raw(_packb(str(i)) + _array_head((n,), dt, n * dt.itemsize, _EXT_NDARRAY))
            for c in leaf.chunks(None, s * dt.itemsize, (s + n) * dt.itemsize):
                self.w.deferred(c)

    def mapping(self, items: list[tuple[str, Any]], path: tuple[Any, ...], depth: int) -> None:
        self.w.raw(_map_header(len(items)))
        for k, v in items:
            self.w.raw(_packb(k))
            self.value(v, (*path, k), depth + 1)

    def value(self, x: Any, path: tuple[Any, ...], depth: int = 0) -> None:
        if depth > _MAX_DEPTH:
            raise EncodeError(
                f"tree is nested deeper than {_MAX_DEPTH} levels", key_path=key_string(path)
            )
        t = type(x)
        if t is np.ndarray or is_jax_array(x):
            if t is not np.ndarray and keys.is_key_dtype(x.dtype):
                self.prng_key(x, path, depth)
                return
            sharded = None if t is np.ndarray else shards.sharded_leaf(x, key_string(path))
            if sharded is not None:  # written shard by shard, never gathered
                self.streamed(sharded, path)
                return
            arr = _as_host_array(x, path)
            if arr.nbytes > self.chunk_bytes:
                self.chunked(arr)
            else:
                self.ext_array(arr, _EXT_NDARRAY)
        elif t is dict and all(type(k) is str for k in x):
            self.mapping(list(x.items()), path, depth)
        elif isinstance(x, Streamed):  # a streaming conversion's array: read when written
            self.streamed(x, path)
        elif x is None:
            self.w.raw(b"\xc0")
        elif isinstance(x, bool | int | float | str | bytes) and not isinstance(x, np.generic):
            try:
                self.w.raw(_packb(x))
            except (OverflowError, TypeError) as exc:
                raise EncodeError(str(exc), key_path=key_string(path)) from None
        elif isinstance(x, np.generic):
            self.ext_array(_as_host_array(x, path), _EXT_NPSCALAR)
        elif isinstance(x, complex):
            payload = _packb((x.real, x.imag))
            self.w.raw(_ext_header(_EXT_COMPLEX, len(payload)) + payload)
        elif isinstance(x, Mapping):
            items = []
            seen = set()
            for k, v in x.items():
                sk = str(k)
                if sk in seen:
                    raise EncodeError(
                        f"dict keys collide as strings: {sk!r}", key_path=key_string(path)
                    )
                seen.add(sk)
                items.append((sk, v))
            self.mapping(items, path, depth)
        elif is_namedtuple(x):
            self.mapping([(f, getattr(x, f)) for f in namedtuple_fields(x)], path, depth)
        elif isinstance(x, list | tuple):
            self.mapping([(str(i), v) for i, v in enumerate(x)], path, depth)
        elif isinstance(x, np.ndarray):  # ndarray subclasses
            self.value(np.asarray(x), path, depth)
        elif (inner := nnx.unwrap(x)) is not x:  # an NNX Variable: its value, no level of its own
            self.value(inner, path, depth)
        else:
            self.value(_state_dict_of(x, path), path, depth + 1)

    def prng_key(self, x: Any, path: tuple[Any, ...], depth: int) -> None:
        """A typed PRNG key as ``{_PRNG_KEY: True, 'impl': name, 'data': key data}``."""
        impl, data = keys.key_data(x, key_string(path))
        self.mapping([(_PRNG_KEY, True), ("impl", impl), ("data", data)], path, depth)


def _state_dict_of(x: Any, path: tuple[Any, ...]) -> Any:
    """A custom node's state dict: flax's registry first, then jax's pytree registry."""
    ser = sys.modules.get("flax.serialization")
    if ser is not None:
        sd = ser.to_state_dict(x)
        if sd is not x:
            return sd
    from pytreeio.core.tree import component_string, node_children

    kids = node_children(x) if "jax" in sys.modules else None
    if kids is None:
        raise EncodeError(
            f"cannot store a leaf of type {type(x).__module__}.{type(x).__qualname__}",
            key_path=key_string(path),
        )
    return {
        (c if isinstance(c, str) else str(c[1]) if isinstance(c, tuple) else component_string(c)): v
        for c, v in kids[0]
    }


def encode(
    tree: Any,
    *,
    meta: Mapping[str, Any] | None = None,
    chunk_bytes: int = MAX_CHUNK_BYTES,
) -> Encoded:
    """The flax state-dict msgpack encoding of ``tree`` (array buffers referenced, not copied).

    Args:
      chunk_bytes: arrays above this size are split as flax splits them;
        leave it at flax's 2**30 unless testing.
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise TypeError(f"chunk_bytes must be an int, got {type(chunk_bytes).__name__}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if meta:
        warnings.warn(
            f"the msgpack format cannot store meta; dropping {sorted(meta)}", stacklevel=3
        )
    enc = _Encoder(chunk_bytes)
    enc.value(tree, ())
    return Encoded(chunks=tuple(enc.w.finish()))


# --------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------


class _ArrayHeader:
    """An array whose data ``inspect`` and ``slots`` skip: payload ``offset``, the ``parts``
    of a flax chunked array, ``npscalar`` for ext type 3."""

    __slots__ = ("dtype", "nbytes", "npscalar", "offset", "parts", "shape")

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        nbytes: int,
        offset: int = -1,
        parts: tuple[_ArrayHeader, ...] | None = None,
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.offset = offset
        self.parts = parts
        self.npscalar = False


class _Indexed(dict):  # type: ignore[type-arg]
    """A msgpack array as ``inspect`` keeps it: only the listed children, by index."""


#: What a summarised container becomes when nothing in it is listed (the parent drops it).
_NOTHING: Any = object()


_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}
_NUMBERS = dict(
    zip(
        range(0xCA, 0xD4),
        (Reader.be_f32, Reader.be_f64, Reader.u8, Reader.be_u16, Reader.be_u32, Reader.be_u64,
         Reader.be_i8, Reader.be_i16, Reader.be_i32, Reader.be_i64),
    )
)  # fmt: skip
#: Type bytes followed by a length: how the length is read, and what follows.
_SIZED = {
    b: (length, kind)
    for kind, first in (("bin", 0xC4), ("ext", 0xC7), ("str", 0xD9))
    for b, length in zip(range(first, first + 3), (Reader.u8, Reader.be_u16, Reader.be_u32))
} | {
    b: (length, kind)
    for kind, first in (("array", 0xDC), ("map", 0xDE))
    for b, length in zip(range(first, first + 2), (Reader.be_u16, Reader.be_u32))
}


class _Parser:
    """Bounded msgpack parser producing flax's ``msgpack_restore`` values.

    ``placeholders``: the array headers a compact buffer's placeholders stand
    for (`_Compactor`); ``summarise`` (inspect) keeps only what
    `_entries` lists; ``marked``: where each chunked-array or key map was read.
    """

    def __init__(
        self,
        r: Reader,
        *,
        summarise: bool = False,
        placeholders: list[_ArrayHeader] | None = None,
        file_size: int | None = None,
    ) -> None:
        self.r = r
        self.summarise = summarise
        self.placeholders = placeholders
        self.listed = 0
        self.unlisted = 0
        self.marked: dict[int, int] = {}
        # Maps and arrays cost 60+ bytes each but only 1 byte of file: the file pays for them.
        self.size = len(r.view) if file_size is None else file_size
        self.containers_left = (self.size + _CONTAINER_ALLOWANCE) // CONTAINER_COST

    def value(self, depth: int, field: str) -> Any:
        r = self.r
        at = r.pos
        b = r.u8(field)
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if b <= 0x8F:
            return self.map(b & 0x0F, depth, field)
        if b <= 0x9F:
            return self.array(b & 0x0F, depth, field)
        if b <= 0xBF:
            return r.text(b & 0x1F, field)
        if b in _CONSTANTS:
            return _CONSTANTS[b]
        if b in _NUMBERS:
            return _NUMBERS[b](r, field)
        if 0xD4 <= b <= 0xD8:
            return self.ext(1 << (b - 0xD4), field, depth)
        if b not in _SIZED:
            raise r.error(f"invalid msgpack type byte 0x{b:02x}", field, r.start + at)
        length, kind = _SIZED[b]
        n = length(r, field)
        if kind == "bin":
            return bytes(r.bytes(n, field))
        if kind == "str":
            return r.text(n, field)
        if kind == "ext":
            return self.ext(n, field, depth)
        return self.array(n, depth, field) if kind == "array" else self.map(n, depth, field)

    def _deeper(self, depth: int, field: str) -> int:
        """Enter a container: bounded in depth and in number (see CONTAINER_COST)."""
        if depth >= _MAX_DEPTH:
            raise self.r.error(f"nesting deeper than {_MAX_DEPTH} levels", field)
        self.containers_left -= 1
        if self.containers_left < 0:
            raise self.r.error(
                f"more maps and arrays than a file of {self.size:,} bytes may hold "
                f"(each costs about {CONTAINER_COST} bytes of Python objects)",
                field,
            )
        return depth + 1

    def _keep(self, child: Any, n: int) -> bool:
        """Summarising: whether a container of ``n`` children stores ``child``."""
        if child is _NOTHING:
            return False
        if type(child) in _SCALARS:
            if n <= LIST_LIMIT and self.listed < SCALAR_BUDGET:
                self.listed += 1
                return True
            self.unlisted += 1
            return False
        return True

    def array(self, n: int, depth: int, field: str) -> Any:
        depth = self._deeper(depth, field)
        # Each element takes at least one byte: a lying count fails on truncation
        # after at most `remaining` iterations, never by allocating.
        summarise = self.summarise
        items: Any = _Indexed() if summarise else []
        for i in range(n):
            child = self.value(depth, f"{field}[{i}]")
            if not summarise:
                items.append(child)
            elif self._keep(child, n):
                items[i] = child
        return items if items or not summarise else _NOTHING

    def map(self, n: int, depth: int, field: str) -> Any:
        depth = self._deeper(depth, field)
        r = self.r
        at = r.start + r.pos
        out: dict[Any, Any] = {}
        summarise = self.summarise
        view, end = r.view, len(r.view)
        try:
            for i in range(n):
                item = _fast_item(view, r.pos, end)
                if item is not None and item[0] not in out and item[0] not in _MARKERS:
                    key, value, r.pos = item
                    if not self.summarise or self._keep(value, n):
                        out[key] = value
                    continue
                key_at = r.start + r.pos
                key = self.value(depth, field)
                if isinstance(key, dict | list | np.ndarray | _ArrayHeader) or key is _NOTHING:
                    raise r.error("map key is not a scalar", field, key_at)
                if key in out:
                    raise r.error(f"duplicate map key {key!r:.80}", field, key_at)
                if i == 0 and key in _MARKERS:
                    self.summarise = False  # a chunked array or a key is kept whole: one entry
                child = key if type(key) is str else str(key)
                value = self.value(depth, f"{field}/{child}" if field else child)
                if not self.summarise or self._keep(value, n):
                    out[key] = value
        finally:
            self.summarise = summarise
        if _CHUNKED in out or _PRNG_KEY in out:
            self.marked[id(out)] = at
        if summarise and not out:
            return _NOTHING  # nothing to list: the parent keeps no object for it
        return out

    def ext(self, n: int, field: str, depth: int) -> Any:
        r = self.r
        code = r.u8(field)
        if code == _PLACEHOLDER and self.placeholders is not None and n == 4:
            return self.placeholders[r.be_u32(field)]  # an array header read by _Compactor
        body = r.sub(n, field)
        if code in (_EXT_NDARRAY, _EXT_NPSCALAR):
            arr = self.ndarray(body, field)
            if code == _EXT_NPSCALAR:
                if arr.shape != ():
                    raise body.error(f"numpy scalar with shape {arr.shape}", field, body.start)
                return arr[()]
            return arr
        if code == _EXT_COMPLEX:
            inner = _Parser(body).value(depth + 1, field)
            if (
                not isinstance(inner, list)
                or len(inner) != 2
                or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in inner)
            ):
                raise body.error("complex extension is not [real, imag]", field, body.start)
            body.expect_end(field)
            try:
                return complex(inner[0], inner[1])
            except OverflowError:  # an int part beyond a double's range
                raise body.error("complex part out of range", field, body.start) from None
        raise r.error(f"unknown msgpack extension type {code}", field, body.start - 1)

    def ndarray(self, body: Reader, field: str) -> Any:
        shape, dt, _ = self.array_header(body, field)
        arr = body.array(dt, shape, field)
        body.expect_end(field)
        return arr

    def array_header(self, body: Reader, field: str) -> tuple[tuple[int, ...], np.dtype[Any], int]:
        """``[shape, dtype name, bin header]`` of any spelling, each part checked."""
        start = body.offset
        head = body.u8(field)
        if head != 0x93:
            raise body.error(
                "array extension is not a 3-element [shape, dtype, data]", field, start
            )
        sub = _Parser(body)
        shape_at = body.offset
        shape = sub.value(_MAX_DEPTH - 2, field)
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise body.error(f"bad array shape {shape!r:.80}", field, shape_at)
        dtype_at = body.offset
        name = sub.value(_MAX_DEPTH - 2, field)
        if isinstance(name, bytes):
            name = name.decode("ascii", "replace")
        found = dtypes.by_name(name) if isinstance(name, str) else None
        if found is None:
            raise body.error(f"unsupported array dtype {name!r:.80}", field, dtype_at)
        dt = found
        count = check_shape(shape, dt.itemsize, path=body.source, field=field, offset=shape_at)
        bin_at = body.offset
        tag = body.u8(field)
        if tag == 0xC4:
            n = body.u8(field)
        elif tag == 0xC5:
            n = body.be_u16(field)
        elif tag == 0xC6:
            n = body.be_u32(field)
        else:
            raise body.error("array data is not a msgpack bin", field, bin_at)
        expected = count * dt.itemsize
        if n != expected:
            raise body.error(
                f"array data has {n} bytes, shape {tuple(shape)} of {dt.name} needs {expected}",
                field,
                bin_at,
            )
        return tuple(shape), dt, n


_DTYPE_BY_FIXSTR: dict[bytes, np.dtype[Any]] = {
    bytes((0xA0 | len(name),)) + name.encode(): dt
    for name in dtypes.NAMES
    if len(name) < 32 and (dt := dtypes.by_name(name)) is not None
}
_BIN_WIDTH = {0xC4: 1, 0xC5: 2, 0xC6: 4}


# key (32) + ext header (6) + [ and its dims (1 + 1 + 15 * 5) + dtype name (32) + bin header (5)
_ITEM_WINDOW = 32 + 6 + 2 + 15 * 5 + 32 + 5


def _fast_item(view: memoryview, p: int, end: int) -> tuple[str, np.ndarray, int] | None:
    """``(key, array, next pos)`` for a map item spelled as every state-dict leaf is, else None.

    A fixstr key, then an ext 8/16/32 of code 1 holding ``[uint dims, fixstr
    dtype, bin]`` whose lengths agree, no zero dimension; anything else
    (malformed input included) goes to the general parser, which locates errors.
    """
    # Indexing a bytes copy of the framing is much cheaper than indexing a memoryview.
    h = view[p : p + _ITEM_WINDOW].tobytes()
    v = h[0] - 0x9F if h else 0  # where the value starts: after a fixstr key
    if not 1 <= v <= 32 or v + 8 > len(h):
        return None
    b = h[v]
    if b == 0xC8:
        q = v + 3
        stop = q + 1 + (h[v + 1] << 8 | h[v + 2])
    elif b == 0xC7:
        q = v + 2
        stop = q + 1 + h[v + 1]
    elif b == 0xC9:
        q = v + 5
        stop = q + 1 + int.from_bytes(h[v + 1 : q], "big")
    else:
        return None
    if h[q] != _EXT_NDARRAY or h[q + 1] != 0x93 or p + stop > end:
        return None
    limit = min(stop, len(h))
    ndim = h[q + 2] - 0x90
    if not 0 <= ndim <= 15:
        return None
    s = q + 3
    dims = []
    for _ in range(ndim):
        # near the limit only a one-byte dim is taken (the widest takes 5 bytes)
        if s + 5 > limit and (s >= limit or h[s] > 0x7F):
            return None
        c = h[s]
        if c <= 0x7F:
            dims.append(c)
            s += 1
        elif c == 0xCD:
            dims.append(h[s + 1] << 8 | h[s + 2])
            s += 3
        elif c == 0xCE:
            dims.append(int.from_bytes(h[s + 1 : s + 5], "big"))
            s += 5
        elif c == 0xCC:
            dims.append(h[s + 1])
            s += 2
        else:
            return None
    if s >= limit:
        return None
    name_end = s + 1 + h[s] - 0xA0
    if not s < name_end <= s + 32 or name_end >= limit:
        return None
    dt = _DTYPE_BY_FIXSTR.get(h[s:name_end])
    w = _BIN_WIDTH.get(h[name_end])
    s = name_end + 1 + (w or 0)
    if dt is None or w is None or s > limit:
        return None
    nbytes = int.from_bytes(h[name_end + 1 : s], "big")
    count = math.prod(dims)
    # dims < 2**32 and nbytes < 2**32: a non-zero count that matches is a valid array.
    if s + nbytes != stop or count == 0 or count * dt.itemsize != nbytes:
        return None
    try:
        key = h[1:v].decode()
    except UnicodeDecodeError:
        return None
    arr = np.frombuffer(view, dt, count, p + s)
    return key, (arr if ndim == 1 else arr.reshape(dims)), p + stop


def _indexed(node: Any, what: str, fail: Any) -> list[Any]:
    """The values of a flax ``{'0': a, '1': b, ...}`` map, in index order."""
    if type(node) is not dict:
        raise fail(f"'{what}' must be a map keyed '0'..'n-1', found {type(node).__name__}")
    try:
        return [node[str(i)] for i in range(len(node))]
    except KeyError:
        raise fail(f"'{what}' must be a map keyed '0'..'n-1'") from None


def _unchunk_one(node: dict[str, Any], fail: Any) -> Any:
    """The array a flax chunked-array map holds (every part checked before numpy sees it)."""
    if set(node) != {_CHUNKED, "shape", "chunks"}:
        raise fail(f"malformed chunked array: keys {sorted(map(str, node))!r:.80}")
    shape = tuple(_indexed(node["shape"], "shape", fail))
    chunks = _indexed(node["chunks"], "chunks", fail)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise fail(f"malformed chunked array shape {shape!r:.80}")
    if not chunks or not all(
        isinstance(c, np.ndarray | _ArrayHeader) and len(c.shape) == 1 for c in chunks
    ):
        raise fail("chunked array chunks must be 1-D arrays")
    dt = chunks[0].dtype
    if any(c.dtype != dt for c in chunks):
        raise fail("chunked array chunks differ in dtype")
    try:
        count = check_shape(shape, dt.itemsize)
    except Exception as exc:  # FormatError without location: relocate it below
        raise fail(f"chunked array: {getattr(exc, 'reason', exc)}") from None
    total = sum(c.shape[0] for c in chunks)
    if total != count:
        raise fail(f"chunked array holds {total} elements, shape {shape} needs {count}")
    if isinstance(chunks[0], _ArrayHeader):
        return _ArrayHeader(shape, dt, total * dt.itemsize, chunks[0].offset, tuple(chunks))
    return np.concatenate(chunks).reshape(shape)


class _KeyHeader:
    """A typed PRNG key as ``inspect`` sees it (its data skipped)."""

    __slots__ = ("data", "impl", "nbytes", "shape")

    def __init__(
        self, impl: str, shape: tuple[int, ...], nbytes: int, data: _ArrayHeader | None = None
    ) -> None:
        self.impl = impl
        self.shape = shape
        self.nbytes = nbytes
        self.data = data


def _prng_key_one(node: dict[str, Any], fail: Any) -> Any:
    """The typed key a PRNG key map holds (a `_KeyHeader` when the data was skipped)."""
    if set(node) != {_PRNG_KEY, "impl", "data"} or node[_PRNG_KEY] is not True:
        raise fail(f"malformed PRNG key: keys {sorted(map(str, node))!r:.80}")
    impl, data = node["impl"], node["data"]
    if isinstance(data, _ArrayHeader):
        if not isinstance(impl, str) or not impl:
            raise fail(f"a PRNG key's implementation must be a name, found {impl!r:.60}")
        if data.dtype != np.dtype(np.uint32) or not data.shape:
            raise fail(f"PRNG key data must be a uint32 array, found {data.dtype.name}")
        # jax's implementations all have one-dimensional key data (threefry: 2 words)
        return _KeyHeader(impl, data.shape[:-1], data.nbytes, data)
    return keys.wrap(data, impl, fail)


def _unchunk(node: Any, parser: _Parser, field: str) -> Any:
    """Replace flax's chunked-array maps with the arrays they hold (top-down, as flax does),
    then PRNG key maps with the keys they hold (their data may be chunked)."""
    if not isinstance(node, dict):
        return node
    at = parser.marked.get(id(node))

    def fail(reason: str) -> Any:
        return parser.r.error(reason, field or "<root>", at)

    if _CHUNKED in node:
        return _unchunk_one(node, fail)
    for k, v in node.items():
        if isinstance(v, dict):
            node[k] = _unchunk(v, parser, f"{field}/{k}" if field else str(k))
    if _PRNG_KEY in node:
        return _prng_key_one(node, fail)
    return node


def _parse(
    view: Any,
    *,
    summarise: bool = False,
    source: str | None = None,
    placeholders: list[_ArrayHeader] | None = None,
    file_size: int | None = None,
) -> Any:
    r = Reader(view, source=source)
    if r.remaining == 0:
        raise r.error("empty file", "msgpack object", 0)
    parser = _Parser(r, summarise=summarise, placeholders=placeholders, file_size=file_size)
    tree = parser.value(0, "")
    r.expect_end("end of msgpack object")
    if not parser.marked:  # no chunked array or key map anywhere: nothing to replace
        return tree, parser.unlisted
    return _unchunk(tree, parser, ""), parser.unlisted


def decode(buffer: Any) -> Decoded:
    """The state dict in ``buffer`` (arrays are views of it), as ``flax.serialization.msgpack_restore`` gives it."""
    tree, _ = _parse(as_memoryview(buffer))
    return Decoded(tree, {})


def _entries(node: Any, path: tuple[Any, ...], out: list[Entry]) -> None:
    if isinstance(node, _Indexed):
        for i, v in node.items():
            _entries(v, (*path, ("[", i)), out)
    elif isinstance(node, dict):
        for k, v in node.items():
            _entries(v, (*path, k if isinstance(k, str) else str(k)), out)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _entries(v, (*path, ("[", i)), out)
    elif isinstance(node, _ArrayHeader):
        out.append(Entry(key_string(path), node.shape, node.dtype.name, node.nbytes))
    elif isinstance(node, _KeyHeader):
        out.append(Entry(key_string(path), node.shape, f"key<{node.impl}>", node.nbytes))
    elif node is not None and node is not _NOTHING:
        out.append(Entry(key_string(path), (), type(node).__name__, 0))


def inspect(source: ByteSource) -> Info:
    """Entries (arrays; Python scalars by type name) without reading array data."""
    tree, unlisted = _parse_compact(source, summarise=True)
    entries: list[Entry] = []
    _entries(tree, (), entries)
    meta = {"unlisted_scalars": unlisted} if unlisted else {}
    return Info(format="msgpack", entries=tuple(entries), meta=meta)


# --------------------------------------------------------------------------
# inspect and slots: the framing alone, array payloads never read
# --------------------------------------------------------------------------

# The framing is copied into a compact buffer: every array extension is cut
# out, its header parsed and checked here by the parser's own
# ``array_header`` on the file's bytes, and a fixext4 placeholder holding its
# index left in its place.  The validating parser then runs on the compact
# buffer; its error offsets are mapped back to the file's.

#: Bytes read at a time while walking the framing.
_WINDOW = 1 << 16
#: An ndarray extension's ``[shape, dtype, bin header]`` is far shorter than this.
_ARRAY_HEAD = 4096
_BLOB_WIDTH = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_EXT_WIDTH = {0xC7: 1, 0xC8: 2, 0xC9: 4}
#: The sizes of fixed-width numbers by type byte (float 32, 64; uint 8..64; int 8..64).
_FIXED_SIZE = dict(zip(range(0xCA, 0xD4), (4, 8, 1, 2, 4, 8, 1, 2, 4, 8)))
_COUNT_WIDTH = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _walk_framing(sp: _Compactor) -> None:
    """Read the framing of the msgpack object into ``sp``, skipping array payloads.

    Not a validator: it stops at anything it does not follow, and the parser
    reports the error at the same offset with the real bytes in place.
    """
    pos = 0
    pending = [1]  # values left to read at each open level
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        b = sp.uint(pos, 1)
        if b is None:
            break
        count: int | None = None
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            size = 1
        elif b <= 0x8F:
            size, count = 1, 2 * (b & 0x0F)
        elif b <= 0x9F:
            size, count = 1, b & 0x0F
        elif b <= 0xBF:
            size = 1 + (b & 0x1F)
        elif b in _FIXED_SIZE:
            size = 1 + _FIXED_SIZE[b]
        elif b in _BLOB_WIDTH:
            w = _BLOB_WIDTH[b]
            n = sp.uint(pos + 1, w)
            if n is None:
                break
            size = 1 + w + n
        elif b in _EXT_WIDTH or 0xD4 <= b <= 0xD8:
            w = _EXT_WIDTH.get(b, 0)
            n = sp.uint(pos + 1, w) if w else 1 << (b - 0xD4)
            code = sp.uint(pos + 1 + w, 1)
            if n is None or code is None or not sp.ext(pos, pos + 2 + w, n, code):
                break
            pos += 2 + w + n
            continue
        elif b in _COUNT_WIDTH:
            w, per = _COUNT_WIDTH[b]
            n = sp.uint(pos + 1, w)
            if n is None:
                break
            size, count = 1 + w, per * n
        else:
            break  # 0xC1: the parser reports it
        if not sp.keep(pos, size):
            break
        pos += size
        if count is not None:
            if len(pending) > _MAX_DEPTH + 2:
                break
            pending.append(count)
    sp.stop(pos)


#: The extension code of a placeholder (an unknown code in real files: refused there).
_PLACEHOLDER = 0x7E


class _Compactor:
    """The framing of a msgpack file with its array payloads cut out (see above), for
    `_walk_framing`."""

    def __init__(self, source: ByteSource) -> None:
        self.source = source
        self.size = source.size
        self.name = source.name
        self.start = 0  # the window of the file last read, at this offset
        self.data = b""
        self.out = bytearray()
        self.end = 0  # the file offset after the last byte copied or cut out
        self.heads: list[_ArrayHeader] = []
        self.segments: list[tuple[int, int]] = [(0, 0)]  # (compact, file) offsets of each run

    def get(self, pos: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``pos`` (fewer where the file ends), a window read at a time."""
        end = min(pos + n, self.size)
        if pos >= end:
            return b""
        if not (self.start <= pos and end <= self.start + len(self.data)):
            self.start = pos
            want = max(end - pos, _WINDOW)
            self.data = bytes(self.source.read(pos, min(want, self.size - pos), "msgpack"))
        return self.data[pos - self.start : end - self.start]

    def uint(self, pos: int, width: int) -> int | None:
        raw = self.get(pos, width)
        return int.from_bytes(raw, "big") if len(raw) == width else None

    def keep(self, pos: int, n: int) -> bool:
        raw = self.get(pos, n)
        self.out += raw
        self.end = pos + len(raw)
        return len(raw) == n

    def ext(self, pos: int, body: int, n: int, code: int) -> bool:
        if code == _PLACEHOLDER:
            raise FormatError(
                f"unknown msgpack extension type {code}",
                path=self.name,
                field="msgpack",
                offset=body - 1,
            )
        if code not in (_EXT_NDARRAY, _EXT_NPSCALAR) or body + n > self.size:
            return self.keep(pos, body - pos + n)
        # the array: its header checked here, the whole extension becomes a placeholder
        r = Reader(self.get(body, min(n, _ARRAY_HEAD)), source=self.name, start=body)
        shape, dt, nbytes = _Parser(r).array_header(r, "msgpack")
        at = r.offset
        if at - body + nbytes != n:
            raise FormatError(
                f"array extension of {n} bytes holds {at - body} bytes of header and "
                f"{nbytes} of data",
                path=self.name,
                field="msgpack",
                offset=body,
            )
        h = _ArrayHeader(shape, dt, nbytes, at)
        if code == _EXT_NPSCALAR:
            if shape != ():
                raise FormatError(
                    f"numpy scalar with shape {shape}", path=self.name, field="msgpack", offset=body
                )
            h.npscalar = True
        self.out += b"\xd6" + bytes((_PLACEHOLDER,)) + len(self.heads).to_bytes(4, "big")
        self.heads.append(h)
        self.end = body + n
        self.segments.append((len(self.out), self.end))
        return True

    def stop(self, pos: int) -> None:
        # where the walk stopped: the parser meets the real bytes there
        start = max(pos, self.end)
        self.keep(start, pos + 64 - start)

    def file_offset(self, offset: int) -> int:
        """The file offset of a compact buffer's offset."""
        i = bisect.bisect_right(self.segments, (offset, math.inf)) - 1
        compact, file = self.segments[max(i, 0)]
        return file + offset - compact


def _parse_compact(source: ByteSource, *, summarise: bool = False) -> Any:
    """`_parse` of the file's framing alone (see above)."""
    c = _Compactor(source)
    _walk_framing(c)
    try:
        return _parse(
            memoryview(c.out),
            summarise=summarise,
            source=source.name,
            placeholders=c.heads,
            file_size=source.size,
        )
    except FormatError as exc:
        if exc.offset is not None:
            exc.offset = c.file_offset(exc.offset)
        raise


def _read_parts(
    key: str, parts: tuple[_ArrayHeader, ...], shape: tuple[int, ...]
) -> Callable[[ByteSource], np.ndarray]:
    """A flax chunked array: its chunks read and joined, as ``decode`` joins them."""

    def read(src: ByteSource) -> np.ndarray:
        chunks = [np.frombuffer(src.read(p.offset, p.nbytes, key), dtype=p.dtype) for p in parts]
        return np.concatenate(chunks).reshape(shape)

    return read


def _slot_of(h: _ArrayHeader, key: str) -> Slot:
    if h.parts is not None:
        return Slot(
            key, h.offset, h.nbytes, h.shape, h.dtype, reader=_read_parts(key, h.parts, h.shape)
        )
    return Slot(key, h.offset, h.nbytes, h.shape, h.dtype, convert=_item if h.npscalar else None)


def _item(arr: np.ndarray) -> Any:
    return arr[()]


def _key_slot(h: _KeyHeader, key: str, source: str | None) -> Slot:
    assert h.data is not None
    data, impl = _slot_of(h.data, key), h.impl

    def fail(reason: str) -> Exception:
        return FormatError(reason, path=source, field=key, offset=data.offset)

    inner = data.reader

    def wrap(arr: np.ndarray) -> Any:
        return keys.wrap(arr, impl, fail)

    if inner is None:
        return dataclasses.replace(data, convert=wrap)
    return dataclasses.replace(data, reader=lambda src: wrap(inner(src)))


def _as_slots(node: Any, path: tuple[Any, ...], source: str | None) -> Any:
    if isinstance(node, _ArrayHeader):
        return _slot_of(node, key_string(path))
    if isinstance(node, _KeyHeader):
        return _key_slot(node, key_string(path), source)
    if type(node) is dict:  # a key that is no str (msgpack's None, 1.5) is named by str()
        return {
            k: _as_slots(v, (*path, k if type(k) is str else str(k)), source)
            for k, v in node.items()
        }
    if type(node) is list:
        return [_as_slots(v, (*path, ("[", i)), source) for i, v in enumerate(node)]
    return node


def slots(source: ByteSource) -> Slots:
    """Where each array's payload lies (the framing is read as ``decode`` reads it)."""
    tree, _ = _parse_compact(source)
    return Slots(_as_slots(tree, (), source.name), {})


def sniff(probe: Probe) -> float:
    """A weak guess: a map whose first key is a string (every flax state dict), or an empty map."""
    head = probe.head
    if not probe.is_file or not head:
        return 0.0
    b = head[0]
    if b == 0x80:
        return WEAK if probe.size == 1 else 0.0
    key_at = 1 if 0x81 <= b <= 0x8F else 3 if b == 0xDE else 5 if b == 0xDF else None
    if key_at is None or len(head) <= key_at:
        return 0.0
    k = head[key_at]
    return WEAK if 0xA0 <= k <= 0xBF or k in (0xD9, 0xDA, 0xDB) else 0.0


FORMAT = register(
    Format(
        name="msgpack",
        description="flax.serialization msgpack state dict (to_bytes / msgpack_restore compatible)",
        suffixes=(".msgpack", ".flax"),
        layout=FILE,
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=sniff,
        accepts_meta=False,
        keeps_meta=False,
        slots=slots,
        streams=True,
    )
)
