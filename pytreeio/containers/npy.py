"""Bounded reading and numpy-identical writing of ``.npy`` arrays and ``.npz`` archives.

Nothing here calls ``np.load``/``np.savez``: hostile files are parsed with
`pytreeio.core.binary.Reader`, every size is checked against the bytes that
exist before anything is allocated, and pickles are never unpickled (object
dtypes are refused outright).

``.npy`` (all integers little-endian)::

    offset  size  field
    0       6     magic  b"\\x93NUMPY"
    6       1     major version (1, 2 or 3)
    7       1     minor version (0)
    8       2|4   header length H (u16 for 1.0, u32 for 2.0 and 3.0)
    10|12   H     header: a Python dict literal, latin-1 (utf-8 for 3.0),
                  ``{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }``
                  padded with spaces and a final ``\\n`` so that the data starts
                  at a multiple of 64 bytes from the magic
    ...     n     data, C order (or Fortran order when ``fortran_order``)

numpy pads the header with 21 minus ``len(repr(shape[0]))`` spare spaces before
the alignment padding; `npy_header` does too (byte-identical to ``np.save``).

``.npz`` is a ZIP archive (`pytreeio.containers.zip`) of ``<name>.npy``
members as ``np.savez`` writes it.  Member CRC-32s are verified unless asked
not to; headers are at most `MAX_HEADER_LEN` bytes, plain dtypes only,
shapes checked before numpy sees them.
"""

from __future__ import annotations

import ast
import functools
import math
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytreeio.containers import zip as _zip
from pytreeio.core.binary import (
    Buffer,
    BufferSource,
    ByteSource,
    Reader,
    Slot,
    Streamed,
    check_shape,
)
from pytreeio.core.errors import EncodeError, FormatError

__all__ = [
    "NpyHeader",
    "parse_npy_header",
    "array_after_header",
    "read_npy",
    "npy_header",
    "encode_npy",
    "read_npz",
    "inspect_npz",
    "npz_slots",
    "encode_npz",
]

MAGIC = b"\x93NUMPY"
ARRAY_ALIGN = 64
GROWTH_AXIS_MAX_DIGITS = 21
#: numpy refuses longer headers unless pickles are allowed; so do we (they are never legitimate).
MAX_HEADER_LEN = 10000
#: dtype kinds that hold plain bytes (no pickles, no Python objects, no opaque voids).
_PLAIN_KINDS = frozenset("biufcUS")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_DIM = r"(?:0|[1-9][0-9]{0,18})"  # longer numbers take the general path
_CANONICAL_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[A-Za-z][A-Za-z0-9]*)', 'fortran_order': (True|False), "
    rf"'shape': \(((?:{_DIM}, )*(?:{_DIM},?)?)\), \}}[ ]*\n?"
)


# --------------------------------------------------------------------------
# .npy
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class NpyHeader:
    """A parsed ``.npy`` header: where the data starts and how much there is."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    fortran_order: bool
    version: tuple[int, int]
    data_offset: int  # from the start of the .npy bytes

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def _plain_dtype(descr: Any, r: Reader, field: str, offset: int) -> np.dtype[Any]:
    # Only simple string descriptors: lists (structured) and tuples (subarrays)
    # are refused before numpy sees them, so no field can smuggle an object.
    if not isinstance(descr, str):
        raise r.error(
            f"unsupported dtype descriptor {descr!r} (structured dtypes are not read)",
            field,
            offset,
        )
    try:
        dt = np.dtype(descr)
    except (TypeError, ValueError, SyntaxError, OverflowError, MemoryError) as exc:
        raise r.error(f"invalid dtype descriptor {descr!r:.80}: {exc}", field, offset) from None
    if dt.hasobject:
        raise r.error(
            f"object arrays are refused (descr {descr!r}); pickles are never loaded", field, offset
        )
    if dt.names is not None or dt.subdtype is not None or dt.kind not in _PLAIN_KINDS:
        raise r.error(f"unsupported dtype {descr!r}", field, offset)
    if dt.itemsize == 0:  # '<U0', '|S0': numpy cannot even view such data
        raise r.error(f"zero-sized dtype {descr!r}", field, offset)
    return dt


def _canonical_header(text: str) -> dict[str, Any] | None:
    """The dict of a header in numpy's own layout (what ``literal_eval`` gives, in one regular
    expression instead of tens of microseconds), else None."""
    m = _CANONICAL_HEADER.fullmatch(text)
    if m is None:
        return None
    descr, fortran, dims = m.groups()
    if dims and "," not in dims:  # "(5)" is an int, not a tuple: let the general path say so
        return None
    shape = tuple(int(x) for x in dims.split(",") if x.strip())
    return {"descr": descr, "fortran_order": fortran == "True", "shape": shape}


_AST_NODE = re.compile(r"<ast\.(\w+) object at 0x[0-9a-fA-F]+>")


def parse_npy_header(r: Reader, field: str = "npy") -> NpyHeader:
    """Read a ``.npy`` prefix and header dict at ``r``'s position, leaving it at the data."""
    begin = r.pos
    start = r.offset
    magic = bytes(r.bytes(len(MAGIC), f"{field}.magic"))
    if magic != MAGIC:
        raise r.error(f"not a .npy array (magic {magic!r})", f"{field}.magic", start)
    major = r.u8(f"{field}.version")
    minor = r.u8(f"{field}.version")
    if (major, minor) == (1, 0):
        hlen = r.u16(f"{field}.header_len")
        encoding = "latin1"
    elif (major, minor) in ((2, 0), (3, 0)):
        hlen = r.u32(f"{field}.header_len")
        encoding = "latin1" if major == 2 else "utf-8"
    else:
        raise r.error(f"unsupported .npy version {major}.{minor}", f"{field}.version", start + 6)
    hstart = r.offset
    if hlen > MAX_HEADER_LEN:
        raise r.error(
            f"header length {hlen} exceeds {MAX_HEADER_LEN}", f"{field}.header_len", hstart - 4
        )
    text = r.text(hlen, f"{field}.header", encoding)
    d = _canonical_header(text)
    if d is None:
        try:
            d = ast.literal_eval(text)
        except (
            ValueError, SyntaxError, TypeError, MemoryError, RecursionError, OverflowError
        ) as exc:  # fmt: skip
            # ast's message names a node by its address: worded stably, so the same bytes
            # always give the same error
            reason = _AST_NODE.sub(r"ast.\1", str(exc))
            raise r.error(
                f"header is not a Python literal: {reason}", f"{field}.header", hstart
            ) from None
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
        raise r.error(
            "header must be a dict with exactly 'descr', 'fortran_order', 'shape'",
            f"{field}.header",
            hstart,
        )
    shape = d["shape"]
    if not isinstance(shape, tuple) or not all(type(x) is int and x >= 0 for x in shape):
        raise r.error(f"invalid shape {shape!r:.80}", f"{field}.header.shape", hstart)
    if type(d["fortran_order"]) is not bool:
        raise r.error(
            f"invalid fortran_order {d['fortran_order']!r:.40}",
            f"{field}.header.fortran_order",
            hstart,
        )
    dtype = _plain_dtype(d["descr"], r, f"{field}.header.descr", hstart)
    check_shape(shape, dtype.itemsize, path=r.source, field=f"{field}.header.shape", offset=hstart)
    return NpyHeader(dtype, shape, d["fortran_order"], (major, minor), r.pos - begin)


def read_npy(
    buffer: Buffer, *, source: str | None = None, start: int = 0, field: str = "npy"
) -> np.ndarray:
    """The array in a whole ``.npy`` buffer, as a view of it (no copy).

    The data must fill the buffer exactly: a short buffer is truncated and
    trailing bytes are an error, both reported at their offset.
    """
    r = Reader(buffer, source=source, start=start)
    return array_after_header(r, parse_npy_header(r, field), field)


def array_after_header(r: Reader, h: NpyHeader, field: str = "npy") -> np.ndarray:
    """The array of header ``h`` (just parsed from ``r``), a view of the rest of ``r``'s
    buffer, which it must fill exactly (as `read_npy`)."""
    data_at = r.offset
    if h.nbytes != r.remaining:
        what = "truncated" if h.nbytes > r.remaining else "trailing bytes"
        raise r.error(
            f"{what}: shape {h.shape} of {h.dtype.str} needs {h.nbytes} data bytes, "
            f"{r.remaining} present",
            f"{field}.data",
            data_at,
        )
    return _array_at(h, r.view, r.pos)


def _array_at(h: NpyHeader, buffer: Buffer, offset: int) -> np.ndarray:
    """The array ``h`` describes, a view of ``buffer`` at ``offset`` (its bytes all there)."""
    # The header's shape passed check_shape when it was parsed: numpy can take it as it is.
    if h.fortran_order and len(h.shape) > 1:
        return np.ndarray(h.shape[::-1], h.dtype, buffer=buffer, offset=offset).transpose()
    return np.ndarray(h.shape, h.dtype, buffer=buffer, offset=offset)


def _descr(dtype: np.dtype[Any]) -> str:
    if (
        dtype.hasobject
        or dtype.names is not None
        or dtype.subdtype is not None
        or dtype.kind not in _PLAIN_KINDS
    ):
        raise EncodeError(f"dtype {dtype} cannot be stored without pickling; refused")
    return dtype.str


def npy_header(dtype: Any, shape: tuple[int, ...], fortran_order: bool = False) -> bytes:
    """The ``.npy`` prefix and header numpy writes for an array of this kind.

    Version 1.0 unless the header needs more than 65535 bytes (then 2.0),
    exactly as ``numpy.lib.format`` guesses it.
    """
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    return _make_npy_header(_descr(dt), tuple(map(int, shape)), bool(fortran_order))


@functools.lru_cache(maxsize=1024)  # a pure function of its key: a model's layers share a few
def _make_npy_header(descr: str, shape: tuple[int, ...], fortran_order: bool) -> bytes:
    text = f"{{'descr': {descr!r}, 'fortran_order': {fortran_order!r}, 'shape': {shape!r}, }}"
    if shape:
        text += " " * (GROWTH_AXIS_MAX_DIGITS - len(repr(shape[-1 if fortran_order else 0])))
    raw = text.encode("latin1")
    hlen = len(raw) + 1
    for major, size_struct in ((1, _U16), (2, _U32)):
        prefix_len = len(MAGIC) + 2 + size_struct.size
        pad = ARRAY_ALIGN - ((prefix_len + hlen) % ARRAY_ALIGN)
        if major == 2 or hlen + pad <= 0xFFFF:
            return (
                MAGIC + bytes((major, 0)) + size_struct.pack(hlen + pad) + raw + b" " * pad + b"\n"
            )
    raise AssertionError("unreachable")


def _array_layout(arr: Any) -> tuple[np.ndarray, bool]:
    """``(array whose C-order bytes are the .npy data, fortran_order)``, no copy if possible."""
    a = np.asarray(arr)
    if a.flags.c_contiguous:
        return a, False
    if a.flags.f_contiguous:
        return a.T, True  # a.T is C-contiguous and holds the bytes in Fortran order
    return np.ascontiguousarray(a), False


def _streamed_layout(arr: Streamed) -> tuple[Streamed, bool]:
    """`_array_layout` for a streamed array: C order if C-contiguous, Fortran order if
    Fortran-contiguous (judged on axes longer than 1; the base's bytes), else a C-order copy."""
    base, axes = arr.transposition()
    moved = [a for a in axes if base.shape[a] != 1]
    if arr.size == 0 or moved == sorted(moved):
        return base, False
    if moved == sorted(moved, reverse=True):
        return base, True
    return arr, False


def encode_npy(arr: Any) -> list[Any]:
    """The ``.npy`` bytes numpy would write for ``arr``, as chunks (data not copied; a
    streamed array's as deferred chunks)."""
    if isinstance(arr, Streamed):
        stored, fortran = _streamed_layout(arr)
        dtype = arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
        return [npy_header(dtype, arr.shape, fortran), *(stored.chunks() if arr.nbytes else ())]
    if type(arr) is np.ndarray and arr.flags.c_contiguous:  # most arrays: no conversions
        header = npy_header(arr.dtype, arr.shape, False)
        if not arr.nbytes:
            return [header]
        try:
            return [header, memoryview(arr).cast("B")]  # type: ignore[arg-type]  # a third of reshape + view's cost
        except (TypeError, ValueError):  # datetimes have no buffer format
            return [header, arr.reshape(-1).view(np.uint8)]
    data, fortran = _array_layout(arr)
    chunks: list[Buffer] = [npy_header(data.dtype, np.asarray(arr).shape, fortran)]
    if data.nbytes:
        chunks.append(data.reshape(-1).view(np.uint8))
    return chunks


# --------------------------------------------------------------------------
# .npz
# --------------------------------------------------------------------------


def _member_origin(source: ByteSource, m: _zip.ZipMember) -> tuple[str | None, int]:
    """``(name, offset)`` errors in a member's bytes report: stored members report file
    offsets, inflated ones offsets within the member."""
    if m.method == _zip.STORED:
        return source.name, m.data_offset
    return f"{source.name or '<buffer>'}:{m.name}", 0


def _member_reader(source: ByteSource, m: _zip.ZipMember, data: memoryview) -> Reader:
    where, start = _member_origin(source, m)
    return Reader(data, source=where, start=start)


def _array_name(m: _zip.ZipMember, source: ByteSource) -> str:
    if not m.name.endswith(".npy"):
        raise FormatError(
            f"member {m.name!r} is not a .npy array",
            path=source.name,
            field="zip.name",
            offset=m.header_offset,
        )
    return m.name[: -len(".npy")]


def read_npz(
    source: ByteSource | Buffer, *, verify_crc: bool = True, max_inflated: int | None = None
) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` archive, by name without ``.npy``, in archive order.

    Stored members are views of ``source``, or of the buffers a large file is
    read into (`pytreeio.containers.zip.read_archive`).  Deflated members
    together inflate to at most ``max_inflated`` bytes (default: the archive's
    size plus `pytreeio.containers.zip.INFLATE_ALLOWANCE`).
    """
    src = source if isinstance(source, ByteSource) else BufferSource(source)
    allowance = _zip.default_max_inflated(src) if max_inflated is None else max_inflated
    checked: set[str] = set()
    ranged = callable(getattr(src, "read_into", None))
    if ranged and src.size < _zip.ARCHIVE_MIN:  # one read, then the directory from memory
        src, ranged = BufferSource(src.read(0, src.size, "zip"), name=src.name), False
    found: Sequence[_zip.ZipMember] = _zip.read_zip_directory(src)
    keys = [_array_name(m, src) for m in found]  # every name checked before the data is read
    if ranged:
        fused = _zip.read_archive(src, verify_crc=verify_crc, members=found)  # type: ignore[arg-type]
        found, src, checked = fused
    members: list[tuple[str, _zip.ZipMember, memoryview]] = []
    for key, m in zip(keys, found):
        data = _zip.member_data(src, m, verify_crc=False, max_inflated=allowance)
        if m.method == _zip.DEFLATED:
            allowance -= m.size
        members.append((key, m, data))
    if verify_crc:  # every member at once, on all cores, before any of them is parsed
        _zip.check_crcs(src, [(m, data) for _, m, data in members if m.name not in checked])
    out: dict[str, np.ndarray] = {}
    for key, m, data in members:
        where, start = _member_origin(src, m)
        out[key] = read_npy(data, source=where, start=start, field=f"{key}.npy")
    return out


#: Bytes of a member read for its ``.npy`` header (numpy pads most headers to 64 or 128).
_HEAD_PREFIX = 128


def _header_reader(src: ByteSource, m: _zip.ZipMember, key: str) -> Reader:
    """A reader over enough of a member for its ``.npy`` header (most fit in 128 bytes; more is
    read if the length field asks)."""
    first = _zip.member_prefix(src, m, _HEAD_PREFIX)
    if len(first) >= 12 and bytes(first[:6]) == MAGIC:
        length = Reader(first[8:12], source=src.name, start=m.data_offset + 8)
        field = f"{key}.npy header length"
        hlen = length.u16(field) + 10 if first[6] == 1 else length.u32(field) + 12
        if hlen > len(first):
            first = _zip.member_prefix(src, m, min(hlen, 12 + MAX_HEADER_LEN))
    return _member_reader(src, m, first)


def inspect_npz(source: ByteSource | Buffer) -> list[tuple[str, NpyHeader, _zip.ZipMember]]:
    """``(name, header, member)`` of every array, reading only the headers."""
    src = source if isinstance(source, ByteSource) else BufferSource(source)
    out = []
    for m in _zip.read_zip_directory(src):
        key = _array_name(m, src)
        h = parse_npy_header(_header_reader(src, m, key), f"{key}.npy")
        if h.data_offset + h.nbytes != m.size:
            raise FormatError(
                f"{key}: shape {h.shape} of {h.dtype.str} needs {h.data_offset + h.nbytes} bytes, "
                f"member holds {m.size}",
                path=src.name,
                field=f"{key}.npy.data",
                offset=m.data_offset + h.data_offset,
            )
        out.append((key, h, m))
    return out


def _member_array(m: _zip.ZipMember, key: str) -> Any:
    """A slot reader: one member inflated (or read) and CRC-checked, as `read_npz` does."""

    def read(src: ByteSource) -> np.ndarray:
        data = _zip.member_data(src, m, verify_crc=True)
        r = _member_reader(src, m, data)
        return read_npy(r.view, source=r.source, start=r.start, field=f"{key}.npy")

    return read


def npz_slots(
    source: ByteSource, *, role: str | None = None, verify_crc: bool = True
) -> dict[str, Any]:
    """Where each array of an ``.npz`` lies (`pytreeio.core.binary.Slot` by name), headers
    only.  With ``verify_crc``, and for deflated members, a slot reads and checks its whole
    member; ``role`` is the archive's key in a multi-file source."""
    out: dict[str, Any] = {}
    for key, h, m in inspect_npz(source):
        reader = None
        if verify_crc or m.method != _zip.STORED:
            reader = _member_array(m, key)
        out[key] = Slot(
            key,
            m.data_offset + h.data_offset,
            h.nbytes,
            h.shape,
            h.dtype,
            role=role,
            fortran=h.fortran_order and len(h.shape) > 1,
            reader=reader,
        )
    return out


def encode_npz(items: Iterable[tuple[str, Any]], *, overlap: bool = False) -> list[Any]:
    """The bytes ``np.savez`` writes for these ``(name, array)`` pairs, as chunks (data referenced;
    ``overlap``: large members hashed while written, `pytreeio.containers.zip.encode_stored`)."""

    members: list[tuple[str, list[Any]]] = []
    for key, value in items:
        try:
            chunks = encode_npy(value)
        except EncodeError as exc:
            raise EncodeError(exc.reason, key_path=key) from None
        members.append((f"{key}.npy", chunks))
    try:
        return _zip.encode_stored(members, overlap=overlap)
    except EncodeError as exc:
        where = (
            exc.key_path[: -len(".npy")]
            if exc.key_path and exc.key_path.endswith(".npy")
            else exc.key_path
        )
        raise EncodeError(exc.reason.replace("member name", "array name"), key_path=where) from None
