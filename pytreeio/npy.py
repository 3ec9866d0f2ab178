"""Bounded reading and numpy-identical writing of ``.npy`` arrays and ``.npz`` archives.

Nothing here calls ``np.load``/``np.savez``: hostile files are parsed with
:class:`pytreeio.binary.Reader`, every size is checked against the bytes that
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
the alignment padding (so headers can grow in place); :func:`npy_header`
reproduces that, so its output is byte-identical to ``np.save``.

``.npz`` is a ZIP archive of ``<name>.npy`` members as ``np.savez`` writes it
(Python's ``zipfile`` with ``force_zip64=True``, stored, timestamp fixed at
1980-01-01 00:00:00, so the bytes are deterministic)::

    per member, in insertion order:
      local header   30 B  b"PK\\x03\\x04", version 45, flags 0, method 0 (stored),
                           time 0, date 0x0021, crc32, sizes 0xffffffff 0xffffffff,
                           name length, extra length 20
                     name  b"<key>.npy" (ascii, or utf-8 with flag 0x800)
                     20 B  zip64 extra: id 1, length 16, u64 size, u64 compressed size
      data               the .npy bytes
    central directory, one 46 B record + name per member: version made by 45 /
      system 3 (unix), version needed 45, crc, 32-bit sizes, external attributes
      0o600 << 16, offset of the local header (zip64 extra only past 2**31 - 1)
    [zip64 end record 56 B + locator 20 B, only when offsets or counts overflow]
    end record 22 B  b"PK\\x05\\x06", entry counts, directory size and offset

Readers accept stored and deflated members (with the declared size checked
against the deflate ratio limit before inflating) and verify each member's
CRC-32 unless asked not to.
"""

from __future__ import annotations

import ast
import re
import struct
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .binary import Buffer, BufferSource, ByteSource, Reader, Writer, as_memoryview
from .errors import EncodeError, FormatError

__all__ = [
    "NpyHeader",
    "ZipMember",
    "parse_npy_header",
    "read_npy",
    "npy_header",
    "encode_npy",
    "read_zip_directory",
    "member_data",
    "read_npz",
    "inspect_npz",
    "encode_npz",
    "check_member_name",
]

MAGIC = b"\x93NUMPY"
ARRAY_ALIGN = 64
GROWTH_AXIS_MAX_DIGITS = 21
#: numpy refuses longer headers unless pickles are allowed; so do we (they are never legitimate).
MAX_HEADER_LEN = 10000
#: deflate cannot expand by more than this factor, so a larger declared size is a lie.
MAX_DEFLATE_RATIO = 1032
#: dtype kinds that hold plain bytes (no pickles, no Python objects, no opaque voids).
_PLAIN_KINDS = frozenset("biufcUS")

# ZIP layouts (APPNOTE 6.3): fixed-width parts only, names/extras follow.
_LOCAL = struct.Struct("<4s2B4HL2L2H")  # 30 bytes
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # 46 bytes
_END = struct.Struct("<4s4H2LH")  # 22 bytes
_END64 = struct.Struct("<4sQ2H2L4Q")  # 56 bytes
_END64_LOC = struct.Struct("<4sLQL")  # 20 bytes
_EXTRA_HEAD = struct.Struct("<HH")
_ZIP64_LOCAL_EXTRA = struct.Struct("<HHQQ")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")

_SIG_LOCAL = b"PK\x03\x04"
_SIG_CENTRAL = b"PK\x01\x02"
_SIG_END = b"PK\x05\x06"
_SIG_END64 = b"PK\x06\x06"
_SIG_END64_LOC = b"PK\x06\x07"
_ZIP64_LIMIT = (1 << 31) - 1  # Python's zipfile switches to zip64 fields past this
_ZIP_FILECOUNT_LIMIT = (1 << 16) - 1
_ZIP64_VERSION = 45
_DEFAULT_VERSION = 20
_FLAG_ENCRYPTED = 0x1
_FLAG_UTF8 = 0x800
_STORED = 0
_DEFLATED = 8
_EXTERNAL_ATTR = 0o600 << 16
_DOSDATE_1980 = (0 << 9) | (1 << 5) | 1
_MAX_COMMENT = 0xFFFF


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
        n = 1
        for d in self.shape:
            n *= d
        return n

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
    except (TypeError, ValueError, SyntaxError) as exc:
        raise r.error(f"invalid dtype descriptor {descr!r}: {exc}", field, offset) from None
    if dt.hasobject:
        raise r.error(
            f"object arrays are refused (descr {descr!r}); pickles are never loaded", field, offset
        )
    if dt.names is not None or dt.subdtype is not None or dt.kind not in _PLAIN_KINDS:
        raise r.error(f"unsupported dtype {descr!r}", field, offset)
    return dt


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
    try:
        d = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
        raise r.error(f"header is not a Python literal: {exc}", f"{field}.header", hstart) from None
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
        raise r.error(
            "header must be a dict with exactly 'descr', 'fortran_order', 'shape'",
            f"{field}.header",
            hstart,
        )
    shape = d["shape"]
    if not isinstance(shape, tuple) or not all(type(x) is int and x >= 0 for x in shape):
        raise r.error(f"invalid shape {shape!r}", f"{field}.header.shape", hstart)
    if type(d["fortran_order"]) is not bool:
        raise r.error(
            f"invalid fortran_order {d['fortran_order']!r}", f"{field}.header.fortran_order", hstart
        )
    dtype = _plain_dtype(d["descr"], r, f"{field}.header.descr", hstart)
    return NpyHeader(dtype, shape, d["fortran_order"], (major, minor), r.pos - begin)


def read_npy(
    buffer: Buffer, *, source: str | None = None, start: int = 0, field: str = "npy"
) -> np.ndarray:
    """The array in a whole ``.npy`` buffer, as a view of it (no copy).

    The data must fill the buffer exactly: a short buffer is truncated and
    trailing bytes are an error, both reported at their offset.
    """
    r = Reader(buffer, source=source, start=start)
    h = parse_npy_header(r, field)
    data_at = r.offset
    if h.nbytes != r.remaining:
        what = "truncated" if h.nbytes > r.remaining else "trailing bytes"
        raise r.error(
            f"{what}: shape {h.shape} of {h.dtype.str} needs {h.nbytes} data bytes, "
            f"{r.remaining} present",
            f"{field}.data",
            data_at,
        )
    if h.fortran_order and len(h.shape) > 1:
        arr = r.array(h.dtype, h.shape[::-1], f"{field}.data").transpose()
    else:
        arr = r.array(h.dtype, h.shape, f"{field}.data")
    return arr


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
    dt = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    text = f"{{'descr': {_descr(dt)!r}, 'fortran_order': {fortran_order!r}, 'shape': {shape!r}, }}"
    if shape:
        text += " " * (GROWTH_AXIS_MAX_DIGITS - len(repr(shape[-1 if fortran_order else 0])))
    raw = text.encode("latin1")
    hlen = len(raw) + 1
    for major, size_struct in ((1, _U16), (2, _U32)):
        prefix_len = len(MAGIC) + 2 + size_struct.size
        pad = ARRAY_ALIGN - ((prefix_len + hlen) % ARRAY_ALIGN)
        if major == 2 or hlen + pad <= 0xFFFF:
            w = Writer()
            w.raw(MAGIC)
            w.u8(major)
            w.u8(0)
            w.struct(size_struct, hlen + pad)
            w.raw(raw)
            w.raw(b" " * pad + b"\n")
            return b"".join(as_memoryview(c) for c in w.finish())
    raise AssertionError("unreachable")


def _array_layout(arr: Any) -> tuple[np.ndarray, bool]:
    """``(array whose C-order bytes are the .npy data, fortran_order)`` without copying if possible."""
    a = np.asarray(arr)
    if a.flags.c_contiguous:
        return a, False
    if a.flags.f_contiguous:
        return a.T, True  # a.T is C-contiguous and holds the bytes in Fortran order
    return np.ascontiguousarray(a), False


def encode_npy(arr: Any) -> list[Buffer]:
    """The ``.npy`` bytes numpy would write for ``arr``, as chunks (data not copied)."""
    data, fortran = _array_layout(arr)
    chunks: list[Buffer] = [npy_header(data.dtype, np.asarray(arr).shape, fortran)]
    if data.nbytes:
        chunks.append(data.reshape(-1).view(np.uint8))
    return chunks


# --------------------------------------------------------------------------
# ZIP
# --------------------------------------------------------------------------


_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


def check_member_name(name: str, *, source: str | None = None, offset: int | None = None) -> None:
    """Refuse archive member names that could address anything outside the archive."""
    bad = (
        not name
        or "\x00" in name
        or "\\" in name
        or name.startswith("/")
        or _DRIVE.match(name) is not None
        or any(part in ("..", ".") for part in name.split("/"))
    )
    if bad:
        raise FormatError(
            f"unsafe member name {name!r}", path=source, field="zip.name", offset=offset
        )


@dataclass(frozen=True)
class ZipMember:
    """One member of a ZIP archive, from its central record and local header."""

    name: str
    method: int
    crc: int
    compressed_size: int
    size: int
    header_offset: int
    data_offset: int


def _find_end(source: ByteSource) -> tuple[int, tuple[Any, ...]]:
    size = source.size
    if size < _END.size:
        raise FormatError(
            f"truncated: {size} bytes cannot hold a ZIP end record",
            path=source.name,
            field="zip.end",
            offset=0,
        )
    # The common case (no archive comment) costs one 22-byte read.
    last = bytes(source.read(size - _END.size, _END.size, "zip.end"))
    if last[:4] == _SIG_END:
        rec = Reader(last, source=source.name, start=size - _END.size).struct(_END, "zip.end")
        if rec[7] == 0:
            return size - _END.size, rec
    tail_len = min(size, _END.size + _MAX_COMMENT)
    tail_at = size - tail_len
    tail = bytes(source.read(tail_at, tail_len, "zip.end"))
    pos = tail.rfind(_SIG_END)
    while pos >= 0:
        if pos + _END.size <= len(tail):
            rec = Reader(
                tail[pos : pos + _END.size], source=source.name, start=tail_at + pos
            ).struct(_END, "zip.end")
            if pos + _END.size + rec[7] == len(tail):
                return tail_at + pos, rec
        pos = tail.rfind(_SIG_END, 0, pos)
    raise FormatError(
        "no ZIP end-of-central-directory record (not a .npz, or truncated)",
        path=source.name,
        field="zip.end",
        offset=size,
    )


def _zip64_end(source: ByteSource, end_at: int) -> tuple[int, int, int, int] | None:
    """``(count, cd_size, cd_offset, record_offset)`` from a zip64 end record, if present."""
    loc_at = end_at - _END64_LOC.size
    if loc_at < 0:
        return None
    r = source.reader(loc_at, _END64_LOC.size, "zip64.locator")
    sig, disk, rec_at, disks = r.struct(_END64_LOC, "zip64.locator")
    if sig != _SIG_END64_LOC:
        return None
    if disk != 0 or disks != 1:
        raise FormatError(
            "multi-disk archives are not supported",
            path=source.name,
            field="zip64.locator",
            offset=loc_at,
        )
    if rec_at + _END64.size > loc_at:
        raise FormatError(
            f"zip64 end record offset {rec_at} lies past its locator",
            path=source.name,
            field="zip64.locator",
            offset=loc_at + 8,
        )
    r = source.reader(rec_at, _END64.size, "zip64.end")
    sig, _rec_size, _made, _need, disk, cd_disk, n_disk, n_total, cd_size, cd_offset = r.struct(
        _END64, "zip64.end"
    )
    if sig != _SIG_END64:
        raise FormatError(
            "bad zip64 end record signature", path=source.name, field="zip64.end", offset=rec_at
        )
    if disk != 0 or cd_disk != 0 or n_disk != n_total:
        raise FormatError(
            "multi-disk archives are not supported",
            path=source.name,
            field="zip64.end",
            offset=rec_at,
        )
    return n_total, cd_size, cd_offset, rec_at


def _zip64_extra(
    extra: memoryview, need: list[str], values: dict[str, int], r: Reader, at: int
) -> None:
    """Fill the 0xffffffff fields ``need`` (in APPNOTE order) from a zip64 extra field."""
    er = Reader(extra, source=r.source, start=at)
    while er.remaining >= _EXTRA_HEAD.size:
        tag, n = er.struct(_EXTRA_HEAD, "zip.extra")
        body = er.bytes(n, "zip.extra")
        if tag != 1:
            continue
        br = Reader(body, source=r.source, start=er.offset - n)
        for key in need:
            values[key] = br.u64(f"zip64.{key}")
        return
    if need:
        raise r.error(f"zip64 extra field missing for {', '.join(need)}", "zip.extra", at)


def read_zip_directory(source: ByteSource) -> list[ZipMember]:
    """The members of the ZIP archive in ``source``, validated, in central-directory order.

    Reads only the end records, the central directory and each local header.
    Member ranges are checked to lie inside the archive before the directory
    start; names are checked with :func:`check_member_name` and for duplicates.
    """
    end_at, end = _find_end(source)
    _sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, _clen = end
    dir_end = end_at
    z64 = _zip64_end(source, end_at)
    if z64 is not None:
        n_total, cd_size, cd_offset, dir_end = z64
    elif disk != 0 or cd_disk != 0 or n_disk != n_total:
        raise FormatError(
            "multi-disk archives are not supported",
            path=source.name,
            field="zip.end",
            offset=end_at,
        )
    if cd_offset + cd_size != dir_end:
        raise FormatError(
            f"central directory [{cd_offset}, +{cd_size}) does not end at the end record ({dir_end})",
            path=source.name,
            field="zip.end.cd_offset",
            offset=end_at,
        )
    if n_total * _CENTRAL.size > cd_size:
        raise FormatError(
            f"{n_total} entries cannot fit in a {cd_size}-byte central directory",
            path=source.name,
            field="zip.end.count",
            offset=end_at,
        )
    r = source.reader(cd_offset, cd_size, "zip.central")
    members: list[ZipMember] = []
    seen: set[str] = set()
    for i in range(n_total):
        at = r.offset
        field = f"zip.central[{i}]"
        (sig, _made, _system, _need, _res, flags, method, _time, _date, crc, csize, usize,
         nlen, elen, clen, disk_start, _iattr, _eattr, hoff) = r.struct(_CENTRAL, field)  # fmt: skip
        if sig != _SIG_CENTRAL:
            raise r.error("bad central directory signature", field, at)
        raw_name = bytes(r.bytes(nlen, f"{field}.name"))
        extra = r.bytes(elen, f"{field}.extra")
        r.skip(clen, f"{field}.comment")
        name = _decode_name(raw_name, flags, r, f"{field}.name", at + _CENTRAL.size)
        check_member_name(name, source=source.name, offset=at + _CENTRAL.size)
        if name in seen:
            raise r.error(f"duplicate member {name!r}", f"{field}.name", at + _CENTRAL.size)
        seen.add(name)
        if flags & _FLAG_ENCRYPTED:
            raise r.error(f"member {name!r} is encrypted", f"{field}.flags", at + 8)
        if method not in (_STORED, _DEFLATED):
            raise r.error(
                f"member {name!r} uses unsupported compression method {method}",
                f"{field}.method",
                at + 10,
            )
        values = {"size": usize, "compressed_size": csize, "header_offset": hoff}
        need = [k for k in ("size", "compressed_size", "header_offset") if values[k] == 0xFFFFFFFF]
        if disk_start == 0xFFFF:
            need.append("disk")
        if need:
            _zip64_extra(extra, need, values, r, at + _CENTRAL.size + nlen)
        members.append(_local(source, name, raw_name, method, crc, values, cd_offset, i))
    if r.remaining:
        raise r.error(
            f"{r.remaining} unexpected bytes after {n_total} central records", "zip.central"
        )
    return members


def _decode_name(raw: bytes, flags: int, r: Reader, field: str, at: int) -> str:
    try:
        return raw.decode("utf-8" if flags & _FLAG_UTF8 else "cp437")
    except UnicodeDecodeError as exc:
        raise r.error(
            f"member name is not valid utf-8: {exc.reason}", field, at + exc.start
        ) from None


def _local(
    source: ByteSource,
    name: str,
    raw_name: bytes,
    method: int,
    crc: int,
    values: Mapping[str, int],
    cd_offset: int,
    index: int,
) -> ZipMember:
    hoff = values["header_offset"]
    field = f"zip.local[{name}]"
    if hoff + _LOCAL.size > cd_offset:
        raise FormatError(
            f"local header offset {hoff} of {name!r} lies past the central directory ({cd_offset})",
            path=source.name,
            field=f"zip.central[{index}].offset",
            offset=hoff,
        )
    r = source.reader(hoff, _LOCAL.size, field)
    sig, _need, _res, _flags, lmethod, _t, _d, _crc, _cs, _us, nlen, elen = r.struct(_LOCAL, field)
    if sig != _SIG_LOCAL:
        raise r.error(f"bad local header signature for {name!r}", field, hoff)
    if lmethod != method:
        raise r.error(
            f"local header of {name!r} says method {lmethod}, central directory {method}",
            field,
            hoff + 8,
        )
    name_at = hoff + _LOCAL.size
    if name_at + nlen > cd_offset:
        raise FormatError(
            f"local header of {name!r} runs past the central directory",
            path=source.name,
            field=field,
            offset=hoff,
        )
    if bytes(source.read(name_at, nlen, f"{field}.name")) != raw_name:
        raise FormatError(
            f"local header name differs from the central directory's {name!r}",
            path=source.name,
            field=f"{field}.name",
            offset=name_at,
        )
    data_at = name_at + nlen + elen
    csize = values["compressed_size"]
    if data_at + csize > cd_offset:
        raise FormatError(
            f"member {name!r} data [{data_at}, +{csize}) runs past the central directory at {cd_offset}",
            path=source.name,
            field=f"{field}.data",
            offset=data_at,
        )
    if method == _STORED and csize != values["size"]:
        raise FormatError(
            f"stored member {name!r} has compressed size {csize} != size {values['size']}",
            path=source.name,
            field=f"zip.central[{index}].size",
            offset=hoff,
        )
    if method == _DEFLATED and values["size"] > max(csize, 1) * MAX_DEFLATE_RATIO:
        raise FormatError(
            f"member {name!r} claims {values['size']} bytes from {csize} deflated bytes (impossible ratio)",
            path=source.name,
            field=f"zip.central[{index}].size",
            offset=hoff,
        )
    return ZipMember(name, method, crc, csize, values["size"], hoff, data_at)


def member_data(source: ByteSource, m: ZipMember, *, verify_crc: bool = True) -> memoryview:
    """A member's uncompressed bytes: a view of the source for stored members."""
    raw = source.read(m.data_offset, m.compressed_size, f"zip.member[{m.name}]")
    if m.method == _DEFLATED:
        data = _inflate(raw, m.size, source.name, m)
    else:
        data = raw
    if verify_crc and zlib.crc32(data) != m.crc:
        raise FormatError(
            f"CRC-32 mismatch in member {m.name!r} (file corrupted)",
            path=source.name,
            field=f"zip.member[{m.name}]",
            offset=m.data_offset,
        )
    return data


def _inflate(
    raw: memoryview, size: int, path: str | None, m: ZipMember, limit: int | None = None
) -> memoryview:
    want = size if limit is None else min(size, limit)
    d = zlib.decompressobj(-15)
    try:
        out = d.decompress(raw, want + 1 if limit is None else want)
    except zlib.error as exc:
        raise FormatError(
            f"corrupt deflate stream in {m.name!r}: {exc}",
            path=path,
            field=f"zip.member[{m.name}]",
            offset=m.data_offset,
        ) from None
    if limit is None and (len(out) != size or not d.eof):
        raise FormatError(
            f"member {m.name!r} inflates to {'more' if len(out) > size else 'fewer'} than its declared {size} bytes",
            path=path,
            field=f"zip.member[{m.name}]",
            offset=m.data_offset,
        )
    return memoryview(out)


def _member_reader(source: ByteSource, m: ZipMember, data: memoryview) -> Reader:
    # Stored members report file offsets; inflated ones report offsets within the member.
    start = m.data_offset if m.method == _STORED else 0
    src = source.name if m.method == _STORED else f"{source.name or '<buffer>'}:{m.name}"
    return Reader(data, source=src, start=start)


def _array_name(m: ZipMember, source: ByteSource) -> str:
    if not m.name.endswith(".npy"):
        raise FormatError(
            f"member {m.name!r} is not a .npy array",
            path=source.name,
            field="zip.name",
            offset=m.header_offset,
        )
    return m.name[: -len(".npy")]


def read_npz(source: ByteSource | Buffer, *, verify_crc: bool = True) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` archive, by name without ``.npy``, in archive order.

    Stored members come back as read-only views of ``source`` (no copy).
    """
    src = source if isinstance(source, ByteSource) else BufferSource(source)
    out: dict[str, np.ndarray] = {}
    for m in read_zip_directory(src):
        key = _array_name(m, src)
        data = member_data(src, m, verify_crc=verify_crc)
        r = _member_reader(src, m, data)
        out[key] = read_npy(r.view, source=r.source, start=r.start, field=f"{key}.npy")
    return out


def inspect_npz(source: ByteSource | Buffer) -> list[tuple[str, NpyHeader, ZipMember]]:
    """``(name, header, member)`` of every array, reading only the headers."""
    src = source if isinstance(source, ByteSource) else BufferSource(source)
    out = []
    for m in read_zip_directory(src):
        key = _array_name(m, src)
        if m.method == _STORED:
            # Most headers fit in 128 bytes; read the rest only when the length field says so.
            first = min(m.compressed_size, 128)
            r = src.reader(m.data_offset, first, f"{key}.npy")
            if first >= 12 and bytes(r.view[:6]) == MAGIC:
                length = Reader(r.view[8:12], source=src.name, start=m.data_offset + 8)
                field = f"{key}.npy header length"
                hlen = length.u16(field) + 10 if r.view[6] == 1 else length.u32(field) + 12
                if hlen > first:
                    want = min(m.compressed_size, hlen, 12 + MAX_HEADER_LEN)
                    r = src.reader(m.data_offset, want, f"{key}.npy")
        else:
            raw = src.read(m.data_offset, m.compressed_size, f"{key}.npy")
            data = _inflate(raw, m.size, src.name, m, limit=12 + MAX_HEADER_LEN)
            r = Reader(data, source=f"{src.name or '<buffer>'}:{m.name}")
        h = parse_npy_header(r, f"{key}.npy")
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


def _encode_name(name: str) -> tuple[bytes, int]:
    try:
        return name.encode("ascii"), 0
    except UnicodeEncodeError:
        return name.encode("utf-8"), _FLAG_UTF8


def encode_npz(items: Iterable[tuple[str, Any]]) -> list[Buffer]:
    """The bytes ``np.savez`` writes for these ``(name, array)`` pairs, as chunks.

    Byte-identical to ``np.savez(file, **dict(items))`` on a seekable file
    (Python's ``zipfile``, numpy's ``force_zip64=True``, fixed 1980 timestamp).
    Array data is referenced, not copied; each member's CRC-32 is computed here.
    """
    w = Writer()
    central: list[tuple[bytes, int, int, int, int]] = []
    seen: set[str] = set()
    for key, value in items:
        fname = f"{key}.npy"
        try:
            check_member_name(fname)
        except FormatError as exc:
            raise EncodeError(exc.reason, key_path=key) from None
        if fname in seen:
            raise EncodeError(f"duplicate array name {key!r}", key_path=key)
        seen.add(fname)
        try:
            chunks = encode_npy(value)
        except EncodeError as exc:
            raise EncodeError(exc.reason, key_path=key) from None
        size = sum(len(as_memoryview(c)) for c in chunks)
        crc = 0
        for c in chunks:
            crc = zlib.crc32(c, crc)
        raw_name, flags = _encode_name(fname)
        offset = w.nbytes
        w.struct(
            _LOCAL, _SIG_LOCAL, _ZIP64_VERSION, 0, flags, _STORED, 0, _DOSDATE_1980, crc,
            0xFFFFFFFF, 0xFFFFFFFF, len(raw_name), _ZIP64_LOCAL_EXTRA.size,
        )  # fmt: skip
        w.raw(raw_name)
        w.struct(_ZIP64_LOCAL_EXTRA, 1, 16, size, size)
        for c in chunks:
            w.raw(c)
        central.append((raw_name, flags, crc, size, offset))
    cd_offset = w.nbytes
    for raw_name, flags, crc, size, offset in central:
        extra: list[int] = []
        fsize = csize = size
        if size > _ZIP64_LIMIT:
            extra += [size, size]
            fsize = csize = 0xFFFFFFFF
        hoff = offset
        if offset > _ZIP64_LIMIT:
            extra.append(offset)
            hoff = 0xFFFFFFFF
        extra_len = _EXTRA_HEAD.size + 8 * len(extra) if extra else 0
        w.struct(
            _CENTRAL, _SIG_CENTRAL, _ZIP64_VERSION, 3, _ZIP64_VERSION, 0, flags, _STORED, 0,
            _DOSDATE_1980, crc, csize, fsize, len(raw_name), extra_len, 0, 0, 0,
            _EXTERNAL_ATTR, hoff,
        )  # fmt: skip
        w.raw(raw_name)
        if extra:  # zip64 extended information: tag 1, then the 64-bit values
            w.struct(_EXTRA_HEAD, 1, 8 * len(extra))
            for value in extra:
                w.u64(value)
    end_of_cd = w.nbytes
    count = len(central)
    cd_size = end_of_cd - cd_offset
    if count > _ZIP_FILECOUNT_LIMIT or cd_offset > _ZIP64_LIMIT or cd_size > _ZIP64_LIMIT:
        w.struct(_END64, _SIG_END64, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        w.struct(_END64_LOC, _SIG_END64_LOC, 0, end_of_cd, 1)
        count = min(count, 0xFFFF)
        cd_size = min(cd_size, 0xFFFFFFFF)
        cd_offset = min(cd_offset, 0xFFFFFFFF)
    w.struct(_END, _SIG_END, 0, 0, count, count, cd_size, cd_offset, 0)
    return w.finish()
