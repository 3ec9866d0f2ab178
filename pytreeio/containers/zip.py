"""Bounded reading and deterministic writing of ZIP archives (the container of ``.npz``).

Only what ``.npz`` files need: stored and deflated members, zip64, no
encryption, one disk.  All integers little-endian (APPNOTE 6.3.x)::

    per member, in order:
      local header   30 B  b"PK\\x03\\x04", version needed, flags, method (0 stored,
                           8 deflated), time, date, crc32, compressed size, size,
                           name length n, extra length e
                     n B   name (cp437, or utf-8 with flag 0x800)
                     e B   extra fields: (u16 tag, u16 length, body)...; tag 1 is the
                           zip64 field: the u64 values of the 32-bit fields set to
                           0xffffffff, in the order size, compressed size, header offset
      data               compressed-size bytes
    central directory, one record per member:
      46 B  b"PK\\x01\\x02", version made by, system, version needed, flags, method,
            time, date, crc32, compressed size, size, name length, extra length,
            comment length, disk start, internal attr, external attr, header offset
      then name, extra, comment
    [zip64 end record 56 B b"PK\\x06\\x06" + locator 20 B b"PK\\x06\\x07", when a count
     or offset overflows its 16/32-bit field]
    end record 22 B  b"PK\\x05\\x06", disk numbers, entry counts, directory size and
                     offset, comment length (then the comment, up to 65535 B)

Reading is bounded: every offset and size is checked before anything is read
or allocated; members may not overlap each other or the central directory
(how zip bombs reach ratios of millions); a deflated member's size must be
within `MAX_DEFLATE_RATIO` of its compressed size and, across members,
within the archive's size plus `INFLATE_ALLOWANCE`, and it is inflated
with a hard output limit.  Each stored member's CRC-32 is taken once
(`pytreeio.containers.crc`), when read and when written.

Writing (`encode_stored`) produces what ``np.savez`` writes (Python's
``zipfile``, ``force_zip64=True``, 1980-01-01 timestamps).
"""

from __future__ import annotations

import bisect
import functools
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from pytreeio.containers.crc import crc32
from pytreeio.core.binary import (
    Buffer,
    ByteSource,
    Deferred,
    Reader,
    Writer,
    as_memoryview,
    chunk_nbytes,
)
from pytreeio.core.errors import EncodeError, FormatError
from pytreeio.core.threads import cores, pool, share

__all__ = [
    "ZipMember",
    "check_member_name",
    "read_zip_directory",
    "member_names",
    "member_data",
    "check_crcs",
    "crc32_each",
    "read_archive",
    "RangeSource",
    "ARCHIVE_MIN",
    "member_prefix",
    "encode_stored",
    "STORED",
    "DEFLATED",
    "OVERLAP_MIN",
    "MAX_DEFLATE_RATIO",
    "INFLATE_ALLOWANCE",
]

#: deflate cannot expand by more than this factor, so a larger declared size is a lie.
MAX_DEFLATE_RATIO = 1032
#: Bytes an archive's deflated members may inflate to beyond the archive's own size.
INFLATE_ALLOWANCE = 64 * 1024 * 1024
#: How much central directory `member_names` reads at most (sniffing must stay cheap).
MAX_NAMES_BYTES = 16 * 1024 * 1024

STORED = 0
DEFLATED = 8

_LOCAL = struct.Struct("<4s2B4HL2L2H")  # 30 bytes
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # 46 bytes
_END = struct.Struct("<4s4H2LH")  # 22 bytes
_END64 = struct.Struct("<4sQ2H2L4Q")  # 56 bytes
_END64_LOC = struct.Struct("<4sLQL")  # 20 bytes
_EXTRA_HEAD = struct.Struct("<HH")
_ZIP64_LOCAL_EXTRA = struct.Struct("<HHQQ")

_SIG_LOCAL = b"PK\x03\x04"
_SIG_CENTRAL = b"PK\x01\x02"
_SIG_END = b"PK\x05\x06"
_SIG_END64 = b"PK\x06\x06"
_SIG_END64_LOC = b"PK\x06\x07"
_ZIP64_LIMIT = (1 << 31) - 1  # Python's zipfile switches to zip64 fields past this
_ZIP_FILECOUNT_LIMIT = (1 << 16) - 1
_ZIP64_VERSION = 45
_FLAG_ENCRYPTED = 0x1
_FLAG_UTF8 = 0x800
_EXTERNAL_ATTR = 0o600 << 16
_DOSDATE_1980 = (0 << 9) | (1 << 5) | 1
_MAX_COMMENT = 0xFFFF
_INFLATE_STEP = 1 << 16  # compressed bytes fed to zlib at a time when only a prefix is wanted
_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")
#: One name component of word characters, ``:``, ``-`` and ``.``: safe unless ``.`` or ``..``.
_PLAIN_NAME = re.compile(r"[\w:.\-]+", re.ASCII)


def _error(source: ByteSource, reason: str, field: str, offset: int | None) -> FormatError:
    return FormatError(reason, path=source.name, field=field, offset=offset)


def check_member_name(name: str, *, source: str | None = None, offset: int | None = None) -> None:
    """Refuse archive member names that could address anything outside the archive."""
    if _PLAIN_NAME.fullmatch(name) is not None and name not in (".", ".."):
        return  # the names nearly every archive holds (``0:weight.npy``), in one match
    bad = (
        not name
        or "\x00" in name
        or "\\" in name
        or name[0] == "/"
        or (name[1:2] == ":" and _DRIVE.match(name) is not None)
        or ("." in name and any(part in ("..", ".") for part in name.split("/")))
    )
    if bad:
        raise FormatError(
            f"unsafe member name {name!r}", path=source, field="zip.name", offset=offset
        )


class ZipMember(NamedTuple):
    """One member of a ZIP archive, from its central record and local header."""

    name: str
    method: int
    crc: int
    compressed_size: int
    size: int
    header_offset: int
    data_offset: int

    @property
    def end(self) -> int:
        """Offset just past the member's data."""
        return self.data_offset + self.compressed_size


# --------------------------------------------------------------------------
# end records and central directory
# --------------------------------------------------------------------------


class _Directory(NamedTuple):
    """Where the central directory is, from the end records."""

    entries: int
    offset: int
    size: int
    end_at: int  # the directory must end here (end record or zip64 record)


def _find_end(source: ByteSource) -> tuple[int, tuple[Any, ...]]:
    size = source.size
    if size < _END.size:
        raise _error(source, f"truncated: {size} bytes cannot hold a ZIP end record", "zip.end", 0)
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
    raise _error(
        source, "no ZIP end-of-central-directory record (not a ZIP, or truncated)", "zip.end", size
    )


def _zip64_end(source: ByteSource, end_at: int) -> _Directory | None:
    """The directory as the zip64 end record gives it, if the archive has one."""
    loc_at = end_at - _END64_LOC.size
    if loc_at < 0:
        return None
    r = source.reader(loc_at, _END64_LOC.size, "zip64.locator")
    sig, disk, rec_at, disks = r.struct(_END64_LOC, "zip64.locator")
    if sig != _SIG_END64_LOC:
        return None
    if disk != 0 or disks != 1:
        raise _error(source, "multi-disk archives are not supported", "zip64.locator", loc_at)
    if rec_at + _END64.size > loc_at:
        raise _error(
            source,
            f"zip64 end record offset {rec_at} lies past its locator",
            "zip64.locator",
            loc_at + 8,
        )
    r = source.reader(rec_at, _END64.size, "zip64.end")
    sig, _rec_size, _made, _need, disk, cd_disk, n_disk, n_total, cd_size, cd_offset = r.struct(
        _END64, "zip64.end"
    )
    if sig != _SIG_END64:
        raise _error(source, "bad zip64 end record signature", "zip64.end", rec_at)
    if disk != 0 or cd_disk != 0 or n_disk != n_total:
        raise _error(source, "multi-disk archives are not supported", "zip64.end", rec_at)
    return _Directory(n_total, cd_offset, cd_size, rec_at)


def _directory(source: ByteSource) -> _Directory:
    """Locate and sanity-check the central directory (reads only the end records)."""
    end_at, end = _find_end(source)
    _sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, _clen = end
    found = _zip64_end(source, end_at)
    if found is None:
        if disk != 0 or cd_disk != 0 or n_disk != n_total:
            raise _error(source, "multi-disk archives are not supported", "zip.end", end_at)
        found = _Directory(n_total, cd_offset, cd_size, end_at)
    if found.offset + found.size != found.end_at:
        raise _error(
            source,
            f"central directory [{found.offset}, +{found.size}) does not end at the end record "
            f"({found.end_at})",
            "zip.end.cd_offset",
            end_at,
        )
    if found.entries * _CENTRAL.size > found.size:
        raise _error(
            source,
            f"{found.entries} entries cannot fit in a {found.size}-byte central directory",
            "zip.end.count",
            end_at,
        )
    return found


class _Central(NamedTuple):
    """One central-directory record, decoded (its zip64 fields filled in)."""

    number: int
    at: int
    raw_name: bytes
    name: str
    flags: int
    method: int
    values: dict[str, int]

    @property
    def field(self) -> str:
        return f"zip.central[{self.number}]"


def _central_records(source: ByteSource, d: _Directory) -> Iterator[_Central]:
    """Each central record in order, names decoded, zip64 fields filled in; the first fault
    raises, located, when the caller reaches it."""
    r = source.reader(d.offset, d.size, "zip.central")
    for i in range(d.entries):
        at, field = r.offset, f"zip.central[{i}]"
        (sig, _made, _system, _need, _res, flags, method, _time, _date, crc, csize, usize,
         nlen, elen, clen, disk_start, _iattr, _eattr, hoff) = r.struct(_CENTRAL, field)  # fmt: skip
        if sig != _SIG_CENTRAL:
            raise r.error("bad central directory signature", field, at)
        raw_name = bytes(r.bytes(nlen, f"{field}.name"))
        extra = r.bytes(elen, f"{field}.extra")
        r.skip(clen, f"{field}.comment")
        name = _decode_name(raw_name, flags, r, f"{field}.name", at + _CENTRAL.size)
        values = {"crc": crc, "size": usize, "compressed_size": csize, "header_offset": hoff}
        need = [k for k in ("size", "compressed_size", "header_offset") if values[k] == 0xFFFFFFFF]
        if disk_start == 0xFFFF:
            need.append("disk")
        if need:
            _zip64_extra(extra, need, values, r, at + _CENTRAL.size + nlen)
        yield _Central(i, at, raw_name, name, flags, method, values)
    if r.remaining:
        raise r.error(
            f"{r.remaining} unexpected bytes after {d.entries} central records", "zip.central"
        )


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
    raise r.error(f"zip64 extra field missing for {', '.join(need)}", "zip.extra", at)


def _decode_name(raw: bytes, flags: int, r: Reader, field: str, at: int) -> str:
    try:
        return raw.decode("utf-8" if flags & _FLAG_UTF8 else "cp437")
    except UnicodeDecodeError as exc:
        raise r.error(
            f"member name is not valid utf-8: {exc.reason}", field, at + exc.start
        ) from None


def member_names(source: ByteSource, *, max_bytes: int = MAX_NAMES_BYTES) -> tuple[str, ...]:
    """The member names as stored, in directory order, for sniffing: only the end records and
    at most ``max_bytes`` of central directory are read (names are not validated here)."""
    d = _directory(source)
    if d.size > max_bytes:
        raise _error(
            source,
            f"central directory of {d.size:,} bytes exceeds the {max_bytes:,} read for names",
            "zip.central",
            d.offset,
        )
    return tuple(rec.name for rec in _central_records(source, d))


def read_zip_directory(source: ByteSource) -> list[ZipMember]:
    """The members, validated (names, local headers, no overlaps), in directory order."""
    d = _directory(source)
    members: list[ZipMember] = []
    seen: set[str] = set()
    for rec in _central_records(source, d):
        name_at = rec.at + _CENTRAL.size
        check_member_name(rec.name, source=source.name, offset=name_at)
        if rec.name in seen:
            raise _error(source, f"duplicate member {rec.name!r}", f"{rec.field}.name", name_at)
        seen.add(rec.name)
        if rec.flags & _FLAG_ENCRYPTED:
            raise _error(
                source, f"member {rec.name!r} is encrypted", f"{rec.field}.flags", rec.at + 8
            )
        if rec.method not in (STORED, DEFLATED):
            raise _error(
                source,
                f"member {rec.name!r} uses unsupported compression method {rec.method}",
                f"{rec.field}.method",
                rec.at + 10,
            )
        members.append(_local(source, rec, d.offset))
    _check_no_overlap(source, members)
    return members


def _check_no_overlap(source: ByteSource, members: Sequence[ZipMember]) -> None:
    """Refuse members whose [local header, end of data) ranges overlap (zip-bomb layouts)."""
    end = 0
    previous = None
    for m in sorted(members, key=lambda m: m.header_offset):
        if m.header_offset < end:
            raise _error(
                source,
                f"member {m.name!r} at {m.header_offset} overlaps member {previous!r} "
                f"(which ends at {end})",
                f"zip.local[{m.name}]",
                m.header_offset,
            )
        end = m.end
        previous = m.name


def _local(source: ByteSource, rec: _Central, cd_offset: int) -> ZipMember:
    """The member ``rec``'s local header gives, checked."""
    name, values = rec.name, rec.values
    hoff = values["header_offset"]
    field = f"zip.local[{name}]"
    if hoff + _LOCAL.size > cd_offset:
        raise _error(
            source,
            f"local header offset {hoff} of {name!r} lies past the central directory ({cd_offset})",
            f"{rec.field}.offset",
            hoff,
        )
    n = _LOCAL.size + len(rec.raw_name)  # the header and the name it should hold, in one read
    head = source.read(hoff, n if hoff + n <= cd_offset else _LOCAL.size, field)
    if len(head) < _LOCAL.size:  # a source never returns less than asked; this keeps it checked
        raise _error(source, "truncated local header", field, hoff)
    sig, _need, _res, _flags, lmethod, _t, _d, _crc, _cs, _us, nlen, elen = _LOCAL.unpack_from(head)
    if sig != _SIG_LOCAL:
        raise _error(source, f"bad local header signature for {name!r}", field, hoff)
    if lmethod != rec.method:
        raise _error(
            source,
            f"local header of {name!r} says method {lmethod}, central directory {rec.method}",
            field,
            hoff + 8,
        )
    name_at = hoff + _LOCAL.size
    if name_at + nlen > cd_offset:
        raise _error(
            source, f"local header of {name!r} runs past the central directory", field, hoff
        )
    if len(head) >= _LOCAL.size + nlen:
        local_name = bytes(head[_LOCAL.size : _LOCAL.size + nlen])
    else:
        local_name = bytes(source.read(name_at, nlen, f"{field}.name"))
    if local_name != rec.raw_name:
        raise _error(
            source,
            f"local header name differs from the central directory's {name!r}",
            f"{field}.name",
            name_at,
        )
    data_at = name_at + nlen + elen
    csize, size = values["compressed_size"], values["size"]
    if data_at + csize > cd_offset:
        raise _error(
            source,
            f"member {name!r} data [{data_at}, +{csize}) runs past the central directory at "
            f"{cd_offset}",
            f"{field}.data",
            data_at,
        )
    if rec.method == STORED and csize != size:
        raise _error(
            source,
            f"stored member {name!r} has compressed size {csize} != size {size}",
            f"{rec.field}.size",
            hoff,
        )
    if rec.method == DEFLATED and size > max(csize, 1) * MAX_DEFLATE_RATIO:
        raise _error(
            source,
            f"member {name!r} claims {size} bytes from {csize} deflated bytes (impossible ratio)",
            f"{rec.field}.size",
            hoff,
        )
    return ZipMember(name, rec.method, values["crc"], csize, size, hoff, data_at)


# --------------------------------------------------------------------------
# member data
# --------------------------------------------------------------------------


def default_max_inflated(source: ByteSource) -> int:
    """The inflation allowance of an archive: its own size plus `INFLATE_ALLOWANCE`."""
    return source.size + INFLATE_ALLOWANCE


def member_data(
    source: ByteSource, m: ZipMember, *, verify_crc: bool = True, max_inflated: int | None = None
) -> memoryview:
    """A member's uncompressed bytes (a view of the source if stored); a deflated one may not
    exceed ``max_inflated`` (default: the archive's size plus `INFLATE_ALLOWANCE`)."""
    raw = source.read(m.data_offset, m.compressed_size, f"zip.member[{m.name}]")
    if m.method == DEFLATED:
        limit = default_max_inflated(source) if max_inflated is None else max_inflated
        if m.size > limit:
            raise _error(
                source,
                f"member {m.name!r} inflates to {m.size:,} bytes, beyond the {limit:,} this archive "
                f"may inflate to ({INFLATE_ALLOWANCE:,} bytes more than its size; pytreeio writes "
                "stored members)",
                f"zip.member[{m.name}]",
                m.header_offset,
            )
        data = _inflate(source, m, raw)
    else:
        data = raw
    if verify_crc:
        check_crcs(source, [(m, data)])
    return data


def check_crcs(source: ByteSource, members: Sequence[tuple[ZipMember, Buffer]]) -> None:
    """Check each ``(member, uncompressed bytes)`` against its CRC-32; the first mismatch raises."""
    found = crc32_each([data for _, data in members])
    for (m, _), value in zip(members, found):
        if value != m.crc:
            raise _crc_mismatch(source, m)


def crc32_each(items: Sequence[Buffer | Sequence[Buffer]]) -> list[int]:
    """The CRC-32 of each item (a buffer, or chunks hashed as one), several items on several
    threads, the largest first."""
    chunked = [[as_memoryview(c) for c in ([i] if _is_buffer(i) else i)] for i in items]
    sizes = [sum(len(c) for c in chunks) for chunks in chunked]

    def hashed(chunks: list[memoryview]) -> int:
        value = 0
        for c in chunks:
            value = crc32(c, value)
        return value

    if sum(sizes) < _PARALLEL_MIN or len(items) < 2:
        return [hashed(c) for c in chunked]
    order = sorted(range(len(items)), key=sizes.__getitem__, reverse=True)
    found = share(pool(), cores(), lambda i: hashed(chunked[i]), order)
    out = [0] * len(items)
    for i, value in zip(order, found):
        out[i] = value
    return out


def _is_buffer(item: Any) -> bool:
    return not isinstance(item, list | tuple)


def _crc_mismatch(source: ByteSource, m: ZipMember) -> FormatError:
    return _error(
        source,
        f"CRC-32 mismatch in member {m.name!r} (file corrupted)",
        f"zip.member[{m.name}]",
        m.data_offset,
    )


# --------------------------------------------------------------------------
# whole archives from files
# --------------------------------------------------------------------------

#: Archives at least this large are read by `read_archive` (smaller ones in one read).
ARCHIVE_MIN = 8 << 20
#: Bytes one ``preadv`` fills at most: the unit of work of the reading threads.
_READ_PIECE = 16 << 20
#: Stored members at least this large are read into buffers of their own.
OWN_MEMBER_MIN = 1 << 20
#: Below this many bytes in all, hashing on the calling thread beats a hand-off.
_PARALLEL_MIN = 8 << 20


class RangeSource(Protocol):
    """A file-backed source that reads ranges straight into a caller's buffers (``io.FileSource``)."""

    name: str | None
    size: int

    def read_scattered(self, offset: int, buffers: Sequence[memoryview], field: str) -> None: ...


def read_archive(
    source: RangeSource, *, verify_crc: bool = True, members: Sequence[ZipMember] | None = None
) -> tuple[Sequence[ZipMember], ByteSource, set[str]]:
    """The archive read into fresh memory on a few threads, stored members' CRC-32s checked.

    Stored members of at least `OWN_MEMBER_MIN` bytes get buffers of
    their own, the bytes between them one buffer.  Returns ``(members, bytes,
    checked)``: the file's bytes as a source whose member reads are views, and
    the names checked here (deflated ones are the caller's to check, inflated).
    """
    if members is None:
        members = read_zip_directory(source)  # type: ignore[arg-type]
    size = source.size
    own = sorted(
        (m.data_offset, np.empty(m.size, dtype=np.uint8).data)
        for m in members
        if m.method == STORED and m.size >= OWN_MEMBER_MIN
    )
    data = _Segments(_covering(size, own), name=source.name)

    def read(a: int) -> None:
        source.read_scattered(a, data.targets(a, min(size, a + _READ_PIECE)), "zip")

    pieces = range(0, size, _READ_PIECE)
    if len(pieces) > 1:
        share(pool(), cores(), read, pieces)
    else:
        for a in pieces:
            read(a)
    hashed = [m for m in members if verify_crc and m.method == STORED]
    check_crcs(
        data, [(m, data.read(m.data_offset, m.size, f"zip.member[{m.name}]")) for m in hashed]
    )
    return members, data, {m.name for m in hashed}


def _covering(size: int, own: list[tuple[int, memoryview]]) -> list[tuple[int, memoryview]]:
    """``own`` and, for the bytes between them, views of one buffer: the file's ``size`` bytes."""
    gaps: list[tuple[int, int]] = []
    pos = 0
    for start, buf in own:
        if start > pos:
            gaps.append((pos, start))
        pos = start + len(buf)
    if pos < size:
        gaps.append((pos, size))
    # uninitialised: the reads fill every byte
    rest = np.empty(sum(b - a for a, b in gaps), dtype=np.uint8).data
    out = list(own)
    k = 0
    for a, b in gaps:
        out.append((a, rest[k : k + b - a]))
        k += b - a
    out.sort(key=lambda seg: seg[0])
    return out


class _Segments(ByteSource):
    """A file's bytes in sorted ``(file offset, buffer)`` segments: a read within one is a view."""

    def __init__(self, segments: list[tuple[int, memoryview]], name: str | None) -> None:
        self._segments = segments
        self._starts = [start for start, _ in segments]
        self.name = name
        self.size = segments[-1][0] + len(segments[-1][1]) if segments else 0
        self.bytes_read = 0

    def targets(self, a: int, b: int) -> list[memoryview]:
        """The buffers that bytes ``a:b`` of the file go to, in file order."""
        out: list[memoryview] = []
        k = max(0, bisect.bisect_right(self._starts, a) - 1)
        pos = a
        while pos < b:
            start, buf = self._segments[k]
            stop = min(b, start + len(buf))
            if stop > pos:
                out.append(buf[pos - start : stop - start])
                pos = stop
            k += 1
        return out

    def _read(self, offset: int, n: int) -> memoryview:
        parts = self.targets(offset, offset + n)
        if len(parts) == 1:
            return parts[0]
        return memoryview(b"".join(parts))  # across an edge (only foreign readers ask)

    def view(self) -> memoryview:
        return self._read(0, self.size)


def _corrupt(source: ByteSource, m: ZipMember, exc: zlib.error) -> FormatError:
    field = f"zip.member[{m.name}]"
    return _error(source, f"corrupt deflate stream in {m.name!r}: {exc}", field, m.data_offset)


def _inflate(source: ByteSource, m: ZipMember, raw: memoryview) -> memoryview:
    """Inflate a whole member; exactly its declared size, never more."""
    d = zlib.decompressobj(-15)
    try:
        out = d.decompress(raw, m.size + 1)  # +1: a longer stream is detected, not allocated
    except zlib.error as exc:
        raise _corrupt(source, m, exc) from None
    if len(out) != m.size or not d.eof:
        what = "more" if len(out) > m.size else "fewer"
        raise _error(
            source,
            f"member {m.name!r} inflates to {what} than its declared {m.size} bytes",
            f"zip.member[{m.name}]",
            m.data_offset,
        )
    return memoryview(out)


def member_prefix(source: ByteSource, m: ZipMember, n: int) -> memoryview:
    """Up to the first ``n`` uncompressed bytes of a member (no CRC check; a deflated one is
    inflated 64 KiB at a time until they are out)."""
    want = min(n, m.size)
    if m.method == STORED:
        return source.read(m.data_offset, want, f"zip.member[{m.name}]")
    d = zlib.decompressobj(-15)
    out = bytearray()
    pos = m.data_offset
    end = m.data_offset + m.compressed_size
    tail: bytes | memoryview = b""
    try:
        while len(out) < want and not d.eof:
            if not tail:
                if pos >= end:
                    break
                tail = source.read(pos, min(_INFLATE_STEP, end - pos), f"zip.member[{m.name}]")
                pos += len(tail)
            out += d.decompress(tail, want - len(out))
            tail = d.unconsumed_tail
    except zlib.error as exc:
        raise _corrupt(source, m, exc) from None
    return memoryview(bytes(out))


# --------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------


def _encode_name(name: str) -> tuple[bytes, int]:
    try:
        return name.encode("ascii"), 0
    except UnicodeEncodeError:
        return name.encode("utf-8"), _FLAG_UTF8


def encode_stored(
    members: Iterable[tuple[str, Sequence[Buffer]]], *, overlap: bool = False
) -> list[Any]:
    """A ZIP archive of stored members ``(name, chunks)``, as chunks (data referenced, not copied).

    Byte-identical to ``np.savez`` (Python's ``zipfile``, ``force_zip64=True``,
    1980-01-01 timestamps).  Bad or duplicate names are an `EncodeError`.
    Each member's CRC-32 goes in its local header, ahead of its data: taken
    here for plain buffers, or while the member is written (its header
    ``late``) for one with `pytreeio.core.binary.Deferred` chunks and,
    with ``overlap``, for one of at least `OVERLAP_MIN` bytes.
    """
    named: list[tuple[str, list[Any], int, bool]] = []
    seen: set[str] = set()
    for name, chunks in members:
        try:
            check_member_name(name)
        except FormatError as exc:
            raise EncodeError(exc.reason, key_path=name) from None
        if name in seen:
            raise EncodeError(f"duplicate member name {name!r}", key_path=name)
        seen.add(name)
        flat = [
            c if type(c) is bytes or isinstance(c, Deferred) else as_memoryview(c) for c in chunks
        ]
        size = sum(map(chunk_nbytes, flat))
        late = any(isinstance(c, Deferred) for c in flat) or (overlap and size >= OVERLAP_MIN)
        named.append((name, flat, size, late))
    eager = iter(crc32_each([chunks for _, chunks, _, late in named if not late]))
    hashing = _Hashing()
    w = Writer()
    central: list[tuple[bytes, int, int | Callable[[], int], int, int]] = []
    for name, chunks, size, late in named:
        raw_name, flags = _encode_name(name)
        offset = w.nbytes
        crc: int | Callable[[], int]
        if late:
            k = hashing.add(chunks)
            crc = functools.partial(hashing.crc, k)
            header = functools.partial(_local_header, raw_name, flags, crc, size)
            w.deferred(Deferred(len(_local_header(raw_name, flags, 0, size)), header, late=True))
            for i, c in enumerate(chunks):
                w.deferred(Deferred(chunk_nbytes(c), functools.partial(hashing.take, k, i)))
        else:
            crc = next(eager)
            if size < _SMALL_MEMBER:  # one small copy instead of a writer call per chunk
                w.raw(b"".join((_local_header(raw_name, flags, crc, size), *chunks)))
            else:
                w.raw(_local_header(raw_name, flags, crc, size))
                for c in chunks:
                    w.raw(c)
        central.append((raw_name, flags, crc, size, offset))
    if any(late for *_, late in named):
        cd_offset = w.nbytes
        cd_len = len(_central_bytes(central, cd_offset, resolve=False))
        w.deferred(Deferred(cd_len, functools.partial(_central_bytes, central, cd_offset)))
    else:
        w.raw(_central_bytes(central, w.nbytes))
    return w.finish()


#: Stored members smaller than this are copied into the archive's small-field bytes whole.
_SMALL_MEMBER = 4096

#: Members this large are hashed while they are written (``encode_stored(overlap=True)``).
OVERLAP_MIN = 8 << 20


class _Hashing:
    """The CRC-32s of an archive's members hashed while they are written.

    The chunk the writer takes is hashed on the pool while it is written, and
    the next chunk is produced only once that hash is done: a streamed
    member's tensors are held one at a time however far behind the pool runs.
    """

    def __init__(self) -> None:
        self._chunks: list[Sequence[Any]] = []
        self._taken: list[int] = []
        self._values: list[int] = []
        self._job: tuple[int, Callable[[], int]] | None = None  # (member, result) in flight

    def add(self, chunks: Sequence[Any]) -> int:
        self._chunks.append(chunks)
        self._taken.append(0)
        self._values.append(0)
        return len(self._chunks) - 1

    def _settle(self) -> None:
        if self._job is not None:
            k, result = self._job
            self._job = None
            self._values[k] = result()

    def take(self, k: int, i: int) -> memoryview:
        """Chunk ``i`` of member ``k``, its hash started (chunks before it are hashed first)."""
        while self._taken[k] < i:
            self.take(k, self._taken[k])
        self._settle()
        view = _bytes_of(self._chunks[k][i])
        if i == self._taken[k]:  # (a chunk taken again, after a late header hashed it, is not)
            self._taken[k] += 1
            box, value = [view], self._values[k]  # box: no finished job keeps the tensor
            self._job = (k, pool().submit(lambda: crc32(box.pop(), value)).result)
        return view

    def crc(self, k: int) -> int:
        """Member ``k``'s CRC-32 (its chunks no writer took hashed now: a failed save)."""
        while self._taken[k] < len(self._chunks[k]):
            self.take(k, self._taken[k])
        self._settle()
        return self._values[k]


def _bytes_of(chunk: Any) -> memoryview:
    """A chunk's bytes (a `Deferred` one produced, its length checked)."""
    if not isinstance(chunk, Deferred):
        return as_memoryview(chunk)
    view = as_memoryview(chunk.produce())
    if view.nbytes != chunk.nbytes:
        raise EncodeError(
            f"a streamed member produced {view.nbytes} bytes, {chunk.nbytes} declared"
        )
    return view


def _local_header(raw_name: bytes, flags: int, crc: int | Callable[[], int], size: int) -> bytes:
    """A stored member's local header with numpy's zip64 extra field (sizes there)."""
    value = crc if isinstance(crc, int) else crc()
    fixed = _LOCAL.pack(
        _SIG_LOCAL, _ZIP64_VERSION, 0, flags, STORED, 0, _DOSDATE_1980, value,
        0xFFFFFFFF, 0xFFFFFFFF, len(raw_name), _ZIP64_LOCAL_EXTRA.size,
    )  # fmt: skip
    return fixed + raw_name + _ZIP64_LOCAL_EXTRA.pack(1, 16, size, size)


def _central_bytes(
    central: Sequence[tuple[bytes, int, int | Callable[[], int], int, int]],
    cd_offset: int,
    *,
    resolve: bool = True,
) -> bytes:
    """The central directory and end records (CRCs waited for unless ``resolve`` is false)."""
    w = Writer()
    w.nbytes = cd_offset  # offsets in the end records count from the start of the archive
    _write_central(
        w,
        [
            (n, f, c if isinstance(c, int) else c() if resolve else 0, s, o)
            for n, f, c, s, o in central
        ],
    )
    return b"".join(bytes(c) for c in w.finish())


def _write_central(w: Writer, central: list[tuple[bytes, int, int, int, int]]) -> None:
    cd_offset = w.nbytes
    records: list[bytes] = []  # joined once: an archive of small arrays has thousands
    pack = _CENTRAL.pack
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
        records.append(pack(
            _SIG_CENTRAL, _ZIP64_VERSION, 3, _ZIP64_VERSION, 0, flags, STORED, 0,
            _DOSDATE_1980, crc, csize, fsize, len(raw_name), extra_len, 0, 0, 0,
            _EXTERNAL_ATTR, hoff,
        ))  # fmt: skip
        records.append(raw_name)
        if extra:  # zip64 extended information: tag 1, then the 64-bit values
            records.append(struct.pack(f"<HH{len(extra)}Q", 1, 8 * len(extra), *extra))
    w.raw(b"".join(records))
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
