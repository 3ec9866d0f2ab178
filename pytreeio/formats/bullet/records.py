"""bullet's tagged-record files (``optimiser_state/*.bin``), the shapes of their tensors, step.txt.

A record, matched by id (never by position)::

    id       ASCII bytes, no newline (pytreeio: printable, at most 1024 bytes)
    0x0A
    count    u64         (the older variant: rows u64, cols u64; rows x cols values)
    values   count x f32

A file is all one variant.  ``step.txt`` is lines ``id,step``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytreeio.core.binary import BadUtf8, ByteSource, Writer, check_shape, utf8_text
from pytreeio.core.errors import FormatError, MismatchError
from pytreeio.formats.bullet.layout import LAYER_ID, MAX_ID_BYTES, is_int, valid_id

STEP = "optimiser_state/step.txt"
F32 = np.dtype("<f4")
_U64 = struct.Struct("<Q")


@dataclass(slots=True)
class Record:
    id: str
    count: int
    dims: tuple[int, int] | None  # (rows, cols) of the old variant
    offset: int  # of the first value


def _walk_variant(src: ByteSource, file: str, old: bool) -> list[Record]:
    def bad(reason: str, field: str, at: int) -> FormatError:
        return FormatError(reason, path=file, field=field, offset=at)

    records: list[Record] = []
    seen: set[str] = set()
    pos = 0
    while pos < src.size:
        # ids are short: a small first read keeps a header walk from reading the data after them
        for n in (min(32, src.size - pos), min(MAX_ID_BYTES + 1, src.size - pos)):
            head = bytes(src.read(pos, n, "record id"))
            if (end := head.find(b"\n")) >= 0:
                break
        if end < 0:
            raise bad(f"no newline ends the record id within {n} bytes", "record id", pos)
        rid = head[:end].decode("ascii", "replace")  # a replaced byte is not ASCII: invalid
        if not valid_id(rid):
            why = f"ids are 1-{MAX_ID_BYTES} printable ASCII characters"
            raise bad(f"invalid record id {head[: min(end, 40)]!r}: {why}", "record id", pos)
        pos += end + 1
        if rid in seen:
            raise bad(f"record {rid!r} appears twice", rid, pos)
        seen.add(rid)
        dims = None
        if old:
            r = src.reader(pos, 16, f"{rid} rows, cols")
            dims = r.u64(f"{rid} rows"), r.u64(f"{rid} cols")
            # a zero dimension leaves the other unchecked by the size test below
            check_shape(dims[::-1], 4, path=file, field=f"{rid} rows, cols", offset=pos)
            count, pos = dims[0] * dims[1], pos + 16
        else:
            count, pos = src.reader(pos, 8, f"{rid} count").u64(f"{rid} count"), pos + 8
        if count * 4 > src.size - pos:  # checked before anything is read or allocated
            why = f"record {rid!r} declares {count} values ({count * 4} bytes)"
            raise bad(f"{why}; only {src.size - pos} remain", rid, pos)
        records.append(Record(rid, count, dims, pos))
        pos += count * 4
    return records


def walk(src: ByteSource, file: str) -> list[Record]:
    """The records of a tagged-record file, current variant first, then the old rows/cols one."""
    try:
        return _walk_variant(src, file, old=False)
    except FormatError as first:
        try:
            return _walk_variant(src, file, old=True)
        except FormatError:
            first.reason += " (nor does the file read as the older rows/cols variant)"
            first.args = (first.reason,)
            raise first from None


def encode(tensors: Mapping[str, Any]) -> list[Any]:
    """A record file of ``tensors`` (float32 arrays), sorted by id as current bullet writes."""
    parts: list[Any] = []
    for rid in sorted(tensors):
        arr = tensors[rid]
        parts += (b"%b\n%b" % (rid.encode("ascii"), _U64.pack(int(arr.size))), arr)
    w = Writer()
    w.extend(parts, F32)
    return w.finish()


def given_shapes(
    shapes: Any, counts: Mapping[str, int] | None = None
) -> dict[str, tuple[int, ...]]:
    """The ``shapes=`` option (an int is a 1-D shape), checked against ``counts`` when given."""
    if shapes is None:
        return {}
    if not isinstance(shapes, Mapping):
        found = type(shapes).__name__
        raise MismatchError("shapes must map tensor ids to shapes", key_path="shapes", found=found)
    out = {}
    for rid, shape in shapes.items():
        where = f"shapes/{rid}"
        if counts is not None and rid not in counts:
            reason = f"shapes names {rid!r}, which the checkpoint does not hold"
            raise MismatchError(reason, key_path=where, expected=sorted(counts)[:20], found=rid)
        dims = (shape,) if is_int(shape) else shape
        if not isinstance(dims, tuple | list) or not all(is_int(d) and d >= 0 for d in dims):
            reason = "a shape is a tuple of non-negative integers"
            raise MismatchError(reason, key_path=where, found=shape)
        out[rid] = tuple(int(d) for d in dims)
        if counts is not None and math.prod(out[rid]) != counts[rid]:
            reason = f"{rid} holds {counts[rid]} values"
            raise MismatchError(reason, key_path=where, expected=counts[rid], found=out[rid])
    return out


def infer_shapes(records: list[Record], shapes: Any = None) -> dict[str, tuple[int, ...]]:
    """Every tensor's array shape: ``shapes=``, else ``l{k}b`` 1-D, ``l{k}w`` ``(count/out, out)``
    with ``out`` the size of ``l{k}b``, the old variant's ``(cols, rows)``, else 1-D."""
    counts = {r.id: r.count for r in records}
    out = given_shapes(shapes, counts)
    for r in records:
        m = LAYER_ID.match(r.id)
        if r.id in out:
            continue
        if m and m.group(2) == "b":
            out[r.id] = (r.count,)
        elif r.dims is not None:
            rows, cols = r.dims
            out[r.id] = (rows,) if cols == 1 and not m else (cols, rows)
        elif m and (n_out := counts.get(f"l{m.group(1)}b")) and r.count % n_out == 0:
            out[r.id] = (r.count // n_out, n_out)
        else:
            out[r.id] = (r.count,)
    return out


def text(buf: Any, file: str) -> str:
    try:
        return utf8_text(buf)
    except BadUtf8 as exc:
        raise FormatError(f"invalid UTF-8: {exc.reason}", path=file, offset=exc.start) from None


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` one at a time (a final newline ends the last one): a file of
    millions of lines costs no list of them when its second line is bad."""
    pos = 0
    while pos < len(text):
        end = text.find("\n", pos)
        if end < 0:
            end = len(text)
        yield text[pos:end]
        pos = end + 1


def parse_steps(buf: Any, known: Mapping[str, Any]) -> dict[str, int]:
    """step.txt's ``{id: step}``; every id must be one of ``known``."""
    steps: dict[str, int] = {}
    offset = 0
    for n, line in enumerate(_lines(text(buf, STEP)), 1):
        body = line.removesuffix("\r")
        rid, comma, value = body.rpartition(",")
        where = f"line {n}"
        # int() of thousands of digits raises; 2**63 has 19
        digits = comma and value.isascii() and value.isdigit() and len(value) <= 19
        if not digits or int(value) >= 2**63:
            reason, field = f"expected 'id,step', found {body[:60]!r}", where
        elif rid not in known:
            reason, field = f"unknown id {rid[:60]!r} (weights.bin has no such tensor)", rid
        elif rid in steps:
            reason, field = f"id {rid!r} listed twice", rid
        else:
            steps[rid] = int(value)
            offset += len(line.encode()) + 1
            continue
        raise FormatError(f"{where}: {reason}", path=STEP, field=field, offset=offset)
    return steps


def steps_text(steps: Mapping[str, int]) -> bytes:
    return "".join(f"{rid},{steps[rid]}\n" for rid in sorted(steps)).encode("ascii")
