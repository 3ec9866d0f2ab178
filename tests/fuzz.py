"""A structure-aware mutation fuzzer for pytreeio's formats.

Usage from tests::

    report = fuzz_format("msgpack", seeds=[blob, ...], n=200, rng_seed=0)
    assert not report.failures, report.summary()

and from the command line (``nox -s fuzz`` runs this)::

    python tests/fuzz.py [FORMAT ...] [-n N] [--seed S] [--timeout SECONDS]

(every registered format when none is named).  For each of ``n`` inputs the
fuzzer picks a seed, applies one to three mutations, and runs it through the
stages of the public functions (see :func:`_run_one`):

* ``sniff`` -- the sniffing of ``ptio.load(path)``: the input placed at a
  path in an in-memory file system, probes built by
  :func:`pytreeio.io.probe_buffer` (what :func:`pytreeio.io.probe` builds from
  disk) and every registered format's ``sniff`` called, then
  ``registry.best_match``;
* ``decode`` (with the seed's load options, see :class:`Seed`) and
  ``restore`` into a ``like`` tree built from the seed's own decoding -- the
  two halves of ``pytreeio.decode(data, fmt, like=like)``;
* ``inspect`` (``pytreeio.api.inspect_encoded``);
* ``slots`` -- what ``ptio.open`` and streaming conversions rest on: the
  format's ``slots`` and every slot read, which must give ``decode``'s tree bit
  for bit where ``decode`` accepted the input (see :func:`_slots`);
* ``verify`` -- what ``ptio.verify`` adds: decode with ``verify=True`` where
  the format takes it (safetensors' per-tensor checksums, bullet's quantised
  copy), a directory's manifest (``pytreeio-sum.json``, checked on the
  buffers) and the NaN/inf count of the tree;
* ``to_model`` -- for model formats a restore into the seed's model as flax
  variables (``load(like=flax tree)``), for the others ``to_model`` itself;

asserting that nothing but a :class:`pytreeio.PytreeioError` escapes, that
the input's stages together answer within ``timeout`` seconds (a hang guard:
``signal.setitimer``, main thread only; inputs whose time bound is longer get
twice that), that their peak memory grows by at most the input's size +
64 MiB -- both what tracemalloc sees (traced only while they run) and the
peak resident set size (Linux ``VmHWM``, reset per input; this also sees
memory of C libraries) -- and that their time is linear in the input's
size: at most :data:`TIME_BASE` (0.25 s) + :data:`TIME_PER_BYTE` (200 ns)
per byte of CPU time (``time.process_time``, so that other work on a shared
machine does not count) -- an input over it runs twice more, untraced, and
fails ("time:over") only when every run was over (machine noise).  Any other
exception, a timeout, too much memory or time is a failure: the input is
saved under a temporary directory and reported with the stage, the
exception and the mutations that produced it.  The report keeps the worst
memory ratios (traced and RSS) and the worst time ratio (seconds / bound).
Every seed runs through all stages once, untimed, before fuzzing, so that
lazy imports (jax) never happen under the alarm.

Inputs are ``bytes`` for single-file formats and ``Mapping[str, bytes]``
(role or relative path -> content) for sibling and directory formats, so a
format added later plugs in by giving seeds (see :func:`default_seeds`).  A
mapping gets one change per input: one member (a kind of member first --
``.npy``, JSON, tagged records, other -- then a member of that kind) mutated
one to three times, or a member dropped, emptied, renamed, swapped with
another, or an unknown one added.

Mutations are chosen by what the bytes look like, not by format name, so
new formats get structure-aware mutations for the containers they share:

* everywhere: truncation at a random offset, bit flips, random bytes,
  inserted / removed / duplicated runs;
* length and count fields, each set to 0, 1, all-ones, the top bit,
  "negative" (``2**bits - k``), off-by-one and doubled: the Tiny Llama
  header and record dims, the safetensors header length, every msgpack
  length/count, the ZIP local/central/end-record sizes, counts and offsets
  and each ``.npy`` header length, any u32/u64 that precedes a JSON
  document and equals its length, DataCode's version, JSON length, tensor
  count and every record's name length, ndim and dims, and bullet's record
  counts (rows and cols in the older variant);
* JSON documents (a whole file, the safetensors header, JSON held in its
  string values, any framed document): a node replaced by a value of the
  wrong type, a meaningful word (a keyword, a dtype or kind name, a reserved
  key), a huge or non-finite number, deep nesting, bad UTF-8, a duplicated
  or removed key; the enclosing length field is fixed up so the mutation
  reaches the parser;
* msgpack objects (flax state dicts): a node, a map key or an extension's
  payload replaced by a value of another type (arrays, maps, ext arrays);
* DataCode files (``DATACODE``): tensor records renamed (other indices,
  parts, non-UTF-8, overlong), swapped, duplicated, dropped, truncated,
  reshaped (data kept consistent or not), trailing bytes; the architecture
  edited (layer types, feature counts of any type, the layer list, the
  reserved key, ``training``, ``device``) with the JSON length kept;
* ``.npy`` files: shape (empty, off by one, beyond numpy, too many dims, not
  a tuple), descr (other, byte-swapped, object, zero-sized, structured),
  fortran_order, whole headers, versions, data short or long, the header
  length consistent (numpy's padding) or lying;
* bullet's tagged records (``id\\n``, u64 count, f32s): lying counts,
  truncation at each part, ids garbled / duplicated / without newline,
  records reordered, duplicated, dropped, added, resized consistently, and
  the older rows/cols variant for one record or all (dims with a zero);
  ``step.txt`` lines: malformed, signed, non-ASCII digits, huge, unknown
  ids, duplicates, CRLF, many lines;
* cl-waffe2's ``parameters.json``: path strings escaping the directory
  (absolute, ``..``, other basenames, missing or reserved files, NUL), keys
  (type specifiers with huge bounds, other prefixes and part counts), numbers
  beyond their type, the two spellings of ``n``, entries dropped or
  reordered; a layer list's args and types and a sidecar's shapes and
  counters (pytreeio's ``pytreeio-waffe2.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import struct
import sys
import tempfile
import time
import traceback
import tracemalloc
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from pytreeio.core import binary, records  # noqa: E402
from pytreeio.core.binary import BufferSource  # noqa: E402
from pytreeio.core.errors import PytreeioError  # noqa: E402
from pytreeio.engine import dispatch  # noqa: E402
from pytreeio.formats import registry  # noqa: E402

__all__ = [
    "Field",
    "Failure",
    "Seed",
    "FuzzReport",
    "fuzz_format",
    "mutate",
    "find_fields",
    "find_records",
    "default_seeds",
    "placed",
    "time_bound",
    "main",
]

Input = bytes | Mapping[str, bytes]


# --------------------------------------------------------------------------
# fields and documents found in the bytes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """An integer field at ``offset``: ``size`` bytes, ``order`` 'little' or 'big'."""

    offset: int
    size: int
    order: str = "little"
    label: str = ""


@dataclass(frozen=True)
class Document:
    """A JSON document at ``[start, end)``, with the field holding its length (if any).

    ``pad``: the framing pads the document to a multiple of 8 with spaces (safetensors).
    """

    start: int
    end: int
    length: Field | None = None
    pad: int = 1


_TL_MAGIC = b"MLLT"


def _tinyllama_fields(buf: bytes) -> list[Field]:
    from pytreeio.formats import tinyllama as tl

    fields = [Field(o, 4, label=f"header@{o}") for o in range(4, 36, 4)]
    try:
        cfg = tl._read_header(tl.Reader(buf))
        if tl.record_count(cfg) > 10_000:
            return fields
        for rec in tl._records(cfg):
            for k in range(len(rec.dims)):
                if rec.offset + 8 * k + 8 <= len(buf):
                    fields.append(Field(rec.offset + 8 * k, 8, label=f"{rec.field} dim {k}"))
    except PytreeioError:
        pass
    return fields


def _safetensors_parts(buf: bytes) -> tuple[list[Field], list[Document]]:
    n = int.from_bytes(buf[:8], "little")
    length = Field(0, 8, label="header length")
    if not 0 < n <= len(buf) - 8:
        return [length], []
    return [length], [Document(8, 8 + n, length, pad=8)]


def _zip_fields(buf: bytes) -> list[Field]:
    """Sizes, counts and offsets of every ZIP record, and each stored .npy header length."""
    out: list[Field] = []
    pos = buf.find(b"PK\x05\x06", max(0, len(buf) - 22 - 0xFFFF))
    if pos >= 0:
        out += [
            Field(pos + o, s, label=f"end@{o}")
            for o, s in ((8, 2), (10, 2), (12, 4), (16, 4), (20, 2))
        ]
    pos = buf.find(b"PK\x06\x06")
    if pos >= 0:
        out += [Field(pos + o, 8, label=f"end64@{o}") for o in (4, 24, 32, 40, 48)]
    pos = buf.find(b"PK\x06\x07")
    if pos >= 0:
        out.append(Field(pos + 8, 8, label="end64 locator offset"))
    for sig, layout in (
        (b"PK\x01\x02", ((20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (34, 2), (42, 4))),
        (b"PK\x03\x04", ((18, 4), (22, 4), (26, 2), (28, 2))),
    ):
        at = buf.find(sig)
        while at >= 0 and len(out) < 4000:
            out += [Field(at + o, s, label=f"{sig[2:]!r}@{o}") for o, s in layout]
            if sig == b"PK\x03\x04":
                nlen, elen = (
                    struct.unpack_from("<HH", buf, at + 26) if at + 30 <= len(buf) else (0, 0)
                )
                data = at + 30 + nlen + elen
                if buf[data : data + 6] == b"\x93NUMPY":
                    size = 2 if buf[data + 6 : data + 7] == b"\x01" else 4
                    out.append(Field(data + 8, size, label="npy header length"))
                # zip64 extra: u64 sizes
                if elen >= 20:
                    out += [
                        Field(at + 30 + nlen + 4, 8, label="zip64 size"),
                        Field(at + 30 + nlen + 12, 8, label="zip64 csize"),
                    ]
            at = buf.find(sig, at + 4)
    return out


def _msgpack_fields(buf: bytes, limit: int = 4000) -> list[Field]:
    """Every length/count field of a msgpack stream (and each fix-type byte), by walking it."""
    out: list[Field] = []
    pos, pending = 0, 1
    widths = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
    counts = {0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
    fixed = {
        0xCA: 4,
        0xCB: 8,
        0xCC: 1,
        0xCD: 2,
        0xCE: 4,
        0xCF: 8,
        0xD0: 1,
        0xD1: 2,
        0xD2: 4,
        0xD3: 8,
    }
    while pending and pos < len(buf) and len(out) < limit:
        b = buf[pos]
        pending -= 1
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            pos += 1
        elif b <= 0x8F:
            out.append(Field(pos, 1, "big", "fixmap"))
            pending += 2 * (b & 0x0F)
            pos += 1
        elif b <= 0x9F:
            out.append(Field(pos, 1, "big", "fixarray"))
            pending += b & 0x0F
            pos += 1
        elif b <= 0xBF:
            out.append(Field(pos, 1, "big", "fixstr"))
            pos += 1 + (b & 0x1F)
        elif b in widths:
            w = widths[b]
            n = int.from_bytes(buf[pos + 1 : pos + 1 + w], "big")
            out.append(Field(pos + 1, w, "big", f"len 0x{b:02x}"))
            pos += 1 + w + n + (1 if b in (0xC7, 0xC8, 0xC9) else 0)
            if b in (0xC7, 0xC8, 0xC9):  # the ext payload is msgpack too: walk it
                inner = _msgpack_fields(buf[pos - n : pos], 64)
                out += [Field(f.offset + pos - n, f.size, f.order, "ext " + f.label) for f in inner]
        elif 0xD4 <= b <= 0xD8:
            n = 1 << (b - 0xD4)
            inner = _msgpack_fields(buf[pos + 2 : pos + 2 + n], 64)
            out += [Field(f.offset + pos + 2, f.size, f.order, "fixext " + f.label) for f in inner]
            pos += 2 + n
        elif b in counts:
            w = counts[b]
            n = int.from_bytes(buf[pos + 1 : pos + 1 + w], "big")
            out.append(Field(pos + 1, w, "big", f"count 0x{b:02x}"))
            pending += n * (2 if b in (0xDE, 0xDF) else 1)
            pos += 1 + w
        elif b in fixed:
            pos += 1 + fixed[b]
        else:
            break
    return out


def _framed_documents(buf: bytes, limit: int = 4) -> list[Document]:
    """JSON documents preceded by a u32/u64 little-endian length equal to their size."""
    out: list[Document] = []
    at = buf.find(b"{")
    while at >= 0 and len(out) < limit and at < 1 << 16:
        for size in (8, 4):
            if at >= size:
                n = int.from_bytes(buf[at - size : at], "little")
                if 2 <= n <= len(buf) - at and _is_json(buf[at : at + n]):
                    out.append(Document(at, at + n, Field(at - size, size, label="json length")))
                    break
        at = buf.find(b"{", at + 1)
    return out


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return True


# DataCode .nn: DATACODE, u32 version, u32 JSON length, JSON, u32 count, tensor records
_DC_MAGIC = b"DATACODE"


@dataclass(frozen=True)
class _DcTensor:
    """A DataCode tensor record: ``[start, end)``, its name bytes, ndim and dims fields."""

    start: int  # the u32 name length
    name_end: int
    ndim_at: int
    dims: tuple[int, ...]
    end: int

    @property
    def name(self) -> tuple[int, int]:
        return self.start + 4, self.name_end


def _datacode_walk(buf: bytes, limit: int = 10_000) -> tuple[int | None, list[_DcTensor]]:
    """The tensor-count offset and the tensor records of a DataCode file, as far as they frame."""
    if len(buf) < 16:
        return None, []
    count_at = 16 + int.from_bytes(buf[12:16], "little")
    if count_at + 4 > len(buf):
        return None, []
    count = int.from_bytes(buf[count_at : count_at + 4], "little")
    pos, out = count_at + 4, list[_DcTensor]()
    while len(out) < min(count, limit) and pos + 4 <= len(buf):
        name_end = pos + 4 + int.from_bytes(buf[pos : pos + 4], "little")
        if name_end + 4 > len(buf):
            break
        ndim = int.from_bytes(buf[name_end : name_end + 4], "little")
        if ndim > 8 or name_end + 4 + 4 * ndim > len(buf):
            break
        dims = struct.unpack_from(f"<{ndim}I", buf, name_end + 4)
        end = name_end + 4 + 4 * ndim + 4 * math.prod(dims)
        if end > len(buf):
            break
        out.append(_DcTensor(pos, name_end, name_end, dims, end))
        pos = end
    return count_at, out


def _datacode_parts(buf: bytes) -> tuple[list[Field], list[Document]]:
    """Version, JSON length, tensor count and each record's name length, ndim and dims."""
    length = Field(12, 4, label="json length")
    fields = [Field(8, 4, label="version"), length]
    docs = []
    n = int.from_bytes(buf[12:16], "little")
    if 2 <= n <= len(buf) - 16 and _is_json(buf[16 : 16 + n]):
        docs.append(Document(16, 16 + n, length))
    count_at, tensors = _datacode_walk(buf)
    if count_at is not None:
        fields.append(Field(count_at, 4, label="tensor count"))
    for k, t in enumerate(tensors):
        fields.append(Field(t.start, 4, label=f"tensor {k} name length"))
        fields.append(Field(t.ndim_at, 4, label=f"tensor {k} ndim"))
        fields += [
            Field(t.ndim_at + 4 + 4 * i, 4, label=f"tensor {k} dim {i}") for i in range(len(t.dims))
        ]
    return fields, docs


# .npy (cl-waffe2's tensors): magic, version, header length, header dict, data
_NPY_MAGIC = b"\x93NUMPY"


def _npy_parts(buf: bytes) -> tuple[int, int, int]:
    """``(size of the header length field, header start, header end)`` of a .npy buffer."""
    size = 2 if buf[6:7] == b"\x01" else 4
    start = 8 + size
    return size, start, start + int.from_bytes(buf[8:start], "little")


# bullet's tagged records: id, 0x0A, u64 count (older: u64 rows, u64 cols), count x f32
@dataclass(frozen=True)
class _Record:
    """A tagged record: the id at ``[start, newline)``, its count field(s), its data up to ``end``."""

    start: int
    newline: int
    old: bool  # rows, cols instead of count
    end: int

    @property
    def count_at(self) -> int:
        return self.newline + 1

    @property
    def data(self) -> int:
        return self.newline + (17 if self.old else 9)


def _records_walk(buf: bytes, old: bool, limit: int = 10_000) -> list[_Record]:
    out: list[_Record] = []
    pos = 0
    while pos < len(buf) and len(out) < limit:
        newline = buf.find(b"\n", pos, pos + 1025)
        if newline <= pos or not all(0x20 <= c <= 0x7E for c in buf[pos:newline]):
            break
        width = 16 if old else 8
        if newline + 1 + width > len(buf):
            break
        if old:
            rows, cols = struct.unpack_from("<QQ", buf, newline + 1)
            count = rows * cols
        else:
            count = struct.unpack_from("<Q", buf, newline + 1)[0]
        end = newline + 1 + width + 4 * count
        if end > len(buf):
            break
        out.append(_Record(pos, newline, old, end))
        pos = end
    return out


def find_records(buf: bytes) -> list[_Record]:
    """bullet's tagged records at the start of ``buf`` (the variant that frames more of it)."""
    best: list[_Record] = []
    for old in (False, True):
        recs = _records_walk(buf, old)
        if recs and (not best or recs[-1].end > best[-1].end):
            best = recs
    return best


def _record_fields(records: Sequence[_Record]) -> list[Field]:
    out = []
    for r in records:
        ident = f"record@{r.start}"
        if r.old:
            out += [
                Field(r.count_at, 8, label=f"{ident} rows"),
                Field(r.count_at + 8, 8, label=f"{ident} cols"),
            ]
        else:
            out.append(Field(r.count_at, 8, label=f"{ident} count"))
    return out


_STEP_LINE = re.compile(rb"[ -+\--~]+,[0-9]+\r?")


def _is_step_text(buf: bytes) -> bool:
    """Lines ``id,step`` (bullet's step.txt)."""
    if not _STEP_LINE.match(buf[:1100]) or len(buf) > 1 << 20:
        return False
    lines = buf.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return bool(lines) and len(lines) <= 10_000 and all(_STEP_LINE.fullmatch(x) for x in lines)


_WF2_KEY = re.compile(r"(?:missing_)?(?:param|optimizer):")


def _wf2_document(buf: bytes) -> dict[str, Any] | None:
    """A cl-waffe2 parameters.json (an object whose first key is a state-dict key), else None."""
    if buf.lstrip()[:1] != b"{":
        return None
    try:
        doc = json.loads(buf)
    except (ValueError, RecursionError):
        return None
    if isinstance(doc, dict) and doc and _WF2_KEY.match(next(iter(doc))):
        return doc
    return None


def find_fields(buf: bytes) -> tuple[list[Field], list[Document]]:
    """Length/count fields and JSON documents in ``buf``, recognised from its content."""
    if buf[:4] in (_TL_MAGIC, b"TLLM"):
        return _tinyllama_fields(buf), []
    if buf[:4] == b"PK\x03\x04" or buf[-22:-18] == b"PK\x05\x06":
        return _zip_fields(buf), []
    if buf[:8] == _DC_MAGIC:
        return _datacode_parts(buf)
    if buf[:6] == _NPY_MAGIC and len(buf) >= 10:
        size = _npy_parts(buf)[0]
        return [Field(8, size, label="npy header length")], []
    stripped = buf.lstrip()
    if stripped[:1] in (b"{", b"[") and _is_json(buf):
        return [], [Document(0, len(buf))]
    if len(buf) > 9 and buf[8:9] == b"{":
        fields, docs = _safetensors_parts(buf)
        if docs:
            return fields, docs
    records = find_records(buf)
    if records:
        return _record_fields(records), []
    framed = _framed_documents(buf)
    if framed:
        return [d.length for d in framed if d.length is not None], framed
    return _msgpack_fields(buf), []


# --------------------------------------------------------------------------
# mutations
# --------------------------------------------------------------------------


def _field_values(old: int, size: int, rng: random.Random) -> int:
    top = (1 << (8 * size)) - 1
    choices = [
        0,
        1,
        top,
        top - 1,
        1 << (8 * size - 1),
        (1 << (8 * size - 1)) - 1,
        old + 1,
        old - 1,
        old * 2,
        top - old,
        rng.randrange(top + 1),
    ]
    return rng.choice(choices) & top


def _set_field(buf: bytearray, f: Field, value: int) -> None:
    if f.offset + f.size <= len(buf):
        order: Any = f.order
        buf[f.offset : f.offset + f.size] = (value & ((1 << (8 * f.size)) - 1)).to_bytes(
            f.size, order
        )


def _mutate_field(buf: bytes, rng: random.Random, fields: Sequence[Field]) -> tuple[bytes, str]:
    if not fields:
        size = rng.choice((2, 4, 8))
        off = rng.randrange(max(1, len(buf) - size + 1))
        fields = [Field(off - off % size, size, rng.choice(("little", "big")), "random")]
    f = rng.choice(fields)
    if f.offset + f.size > len(buf):
        return buf, "field out of range"
    old = int.from_bytes(buf[f.offset : f.offset + f.size], f.order)  # type: ignore[arg-type]
    new = _field_values(old, f.size, rng)
    out = bytearray(buf)
    _set_field(out, f, new)
    return bytes(out), f"field {f.label or f.offset}@{f.offset} {old}->{new}"


_WRONG = [None, True, False, 0, -1, 2**64, -(2**63) - 1, 1.5, "", "x", [], {}, [1], {"": None}]
# strings that mean something somewhere: keywords and non-identifiers (namedtuple names),
# kinds and dtype names of other formats, names of reserved keys
_WORDS = ["class", "def", "None", "_x", "1a", "a-b", "int", "float", "bool", "npscalar", "leaf"]
_WORDS += ["float32", "object", "<U0", "|O", "__metadata__", "__msgpack_chunked_array__", "..", "/"]
_TEXT_VALUES = ["NaN", "Infinity", "-Infinity", "1e999", "-0", "1" + "0" * 400, "1e-400", "0.1e1"]


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    stack = [(path, doc)]
    while stack:
        p, node = stack.pop()
        yield p, node
        if isinstance(node, dict):
            stack.extend(((*p, k), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend(((*p, i), v) for i, v in enumerate(node))


def _dump(
    doc: Any, target: tuple[Any, ...], text: str, dup: bool, drop: bool, path: tuple[Any, ...] = ()
) -> str:
    """``doc`` as JSON with the node at ``target`` replaced by raw ``text`` (or its key duplicated/dropped)."""
    if path == target and not (dup or drop):
        return text
    if isinstance(doc, dict):
        parts = []
        for k, v in doc.items():
            child = (*path, k)
            if child == target and drop:
                continue
            item = json.dumps(k) + ":" + _dump(v, target, text, dup, drop, child)
            parts.append(item)
            if child == target and dup:
                parts.append(json.dumps(k) + ":" + text)
        return "{" + ",".join(parts) + "}"
    if isinstance(doc, list):
        items = []
        for i, v in enumerate(doc):
            child = (*path, i)
            if child == target and drop:
                continue
            items.append(_dump(v, target, text, dup, drop, child))
        return "[" + ",".join(items) + "]"
    return json.dumps(doc)


def mutate_json(raw: bytes, rng: random.Random, depth: int = 0) -> tuple[bytes, str]:
    """A structural mutation of a JSON document (bytes level when it does not parse)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return _mutate_bytes(raw, rng)
    nodes = list(_nodes(doc))
    path, node = rng.choice(nodes)
    # JSON held in a string (safetensors' pytreeio.tree): mutate inside it
    if isinstance(node, str) and node[:1] in ("{", "[") and depth < 2 and rng.random() < 0.6:
        inner, how = mutate_json(node.encode("utf-8", "surrogatepass"), rng, depth + 1)
        text = json.dumps(inner.decode("utf-8", "replace"))
        return _dump(doc, path, text, False, False).encode(), f"inner {path!r:.60}: {how}"
    kind = rng.randrange(8)
    if kind == 0:
        text, how = json.dumps(rng.choice(_WRONG)), "wrong type"
    elif kind == 7:
        text, how = json.dumps(rng.choice(_WORDS)), "word"
    elif kind == 1:
        text, how = rng.choice(_TEXT_VALUES), "odd number"
    elif kind == 2:
        k = rng.choice((200, 1000, 100_000))
        text, how = "[" * k + json.dumps(node) + "]" * k, f"nested {k}"
    elif kind == 3:
        out = _dump(doc, path, '"\udcff"', False, False).encode("utf-8", "surrogateescape")
        return out, f"bad utf-8 at {path!r:.60}"
    elif kind == 4 and path:
        return _dump(doc, path, json.dumps(node), True, False).encode(), f"duplicate {path!r:.60}"
    elif kind == 5 and path:
        return _dump(doc, path, "", False, True).encode(), f"drop {path!r:.60}"
    else:
        big = rng.choice((2**63, 2**64, -(2**63) - 1, 10**30, 2**31, -1))
        text, how = str(big), "huge int"
    return _dump(doc, path, text, False, False).encode(), f"{how} at {path!r:.60}"


def _msgpack_wrong(rng: random.Random) -> Any:
    import msgpack

    array = msgpack.packb([[2], "float32", b"\0" * 8], use_bin_type=True)
    packable = [w for w in _WRONG if not isinstance(w, int) or -(2**63) <= w < 2**64]
    return rng.choice(
        [*packable, 2**64 - 1, -(2**63), *_WORDS, b"\xff", msgpack.ExtType(1, array), msgpack.ExtType(2, b"\x92"),
         msgpack.ExtType(1, b""), msgpack.ExtType(99, b"x"), {"0": 1}, [[0], "float32", b""]]
    )  # fmt: skip


def mutate_msgpack(raw: bytes, rng: random.Random, depth: int = 0) -> tuple[bytes, str]:
    """A structural mutation of a msgpack object: a node (or an ext payload) of another type."""
    import msgpack

    try:
        doc = msgpack.unpackb(
            raw, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType, use_list=True
        )
    except Exception:  # anything msgpack refuses is mutated as bytes
        return _mutate_bytes(raw, rng)
    holders: list[tuple[Any, Any]] = []  # (container, key) of every node
    stack = [doc]
    while stack and len(holders) < 10_000:
        node = stack.pop()
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for k, v in items:
            holders.append((node, k))
            stack.append(v)
    if not holders:
        return msgpack.packb(_msgpack_wrong(rng), use_bin_type=True), "msgpack root replaced"
    container, key = rng.choice(holders)
    value = container[key]
    if isinstance(value, msgpack.ExtType) and depth < 2 and rng.random() < 0.5:
        payload, how = mutate_msgpack(value.data, rng, depth + 1)
        container[key] = msgpack.ExtType(value.code, payload)
        how = f"ext payload: {how}"
    elif isinstance(container, dict) and rng.random() < 0.2:
        new_key = rng.choice([1, None, 1.5, "", "0", "__msgpack_chunked_array__"])
        container[new_key] = container.pop(key)
        how = f"key {key!r:.40} -> {new_key!r}"
    else:
        container[key] = _msgpack_wrong(rng)
        how = f"msgpack node {key!r:.40} -> {container[key]!r:.40}"
    try:
        return msgpack.packb(doc, use_bin_type=True), how
    except Exception:  # e.g. an unpackable key: fall back to bytes
        return _mutate_bytes(raw, rng)


def _mutate_document(buf: bytes, rng: random.Random, d: Document) -> tuple[bytes, str]:
    new, how = mutate_json(buf[d.start : d.end], rng)
    if d.pad > 1:
        new += b" " * (-len(new) % d.pad)
    out = bytearray(buf[: d.start] + new + buf[d.end :])
    if d.length is not None and rng.random() < 0.9:  # mostly keep the framing consistent
        _set_field(out, d.length, len(new))
    return bytes(out), f"json {how}"


def _mutate_bytes(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    n = len(buf)
    kind = rng.randrange(6)
    if n == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16))), "random bytes"
    at = rng.randrange(n)
    if kind == 0:
        return buf[:at], f"truncate at {at}"
    if kind == 1:
        out = bytearray(buf)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(n)] ^= 1 << rng.randrange(8)
        return bytes(out), "bit flips"
    if kind == 2:
        out = bytearray(buf)
        out[at] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        return bytes(out), f"byte at {at}"
    if kind == 3:
        run = rng.choice(
            (b"\0", b"\xff", b"{", b"[", b'"', bytes([rng.randrange(256)]))
        ) * rng.choice((1, 3, 8, 64))
        return buf[:at] + run + buf[at:], f"insert {len(run)} at {at}"
    if kind == 4:
        k = rng.randint(1, min(64, n - at))
        return buf[:at] + buf[at + k :], f"remove {k} at {at}"
    k = rng.randint(1, min(64, n - at))
    return buf[:at] + buf[at : at + k] * 2 + buf[at + k :], f"duplicate {k} at {at}"


# --------------------------------------------------------------------------
# mutations of the newer containers: DataCode records, .npy, tagged records,
# step.txt lines, cl-waffe2 parameters.json
# --------------------------------------------------------------------------

#: Mutations that multiply content (many lines, many layers) stop growing it beyond this.
_GROW_LIMIT = 32 << 20


def _u32(v: int) -> bytes:
    return (v & 0xFFFFFFFF).to_bytes(4, "little")


def _dc_record(name: bytes, dims: Sequence[int], data: bytes) -> bytes:
    head = _u32(len(name)) + name + _u32(len(dims)) + b"".join(_u32(d) for d in dims)
    return head + data


def _dc_names(rng: random.Random, old: bytes) -> bytes:
    m = re.fullmatch(rb"layer(\d+)\.(weight|bias)", old)
    k, part = (int(m.group(1)), m.group(2)) if m else (0, b"weight")
    other = b"bias" if part == b"weight" else b"weight"
    return rng.choice(
        [
            b"layer%d.%s" % (k + 1, part), b"layer%d.%s" % (max(k - 1, 0), part),
            b"layer%d.%s" % (k, other), b"layer0%d.%s" % (k, part), b"layer-1.%s" % part,
            b"layer4294967296.%s" % part, b"layer99999999999.%s" % part,
            b"layer%d.Weight" % k, b"layer%d" % k, b"", b".", b"layer%d.%s\0" % (k, part),
            b"\xff\xfe" + old, old + b"\xc3", "layer%d.%s\u0661".encode() % (k, part),
            b"x" * 64, b"x" * 65, b"l" * 1000,
        ]
    )  # fmt: skip


def _mutate_datacode(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Record-level mutations of a DataCode file, and architecture edits of its JSON."""
    count_at, tensors = _datacode_walk(buf)
    kind = rng.randrange(8)
    if kind == 0 or count_at is None or not tensors:
        return _mutate_architecture(buf, rng)
    head, tail = buf[: count_at + 4], buf[tensors[-1].end :]
    records = [buf[t.start : t.end] for t in tensors]
    count = int.from_bytes(buf[count_at : count_at + 4], "little")
    k = rng.randrange(len(tensors))
    t = tensors[k]
    how = ""
    if kind == 1:
        a, b = t.name
        name = _dc_names(rng, buf[a:b])
        n = len(name) if rng.random() < 0.9 else rng.choice((len(name) + 1, 0, 0xFFFFFFFF))
        records[k] = _u32(n) + name + buf[b : t.end]
        how = f"rename tensor {k} {buf[a:b][:30]!r} -> {name[:30]!r} (length {n})"
    elif kind == 2 and len(records) > 1:
        i, j = rng.sample(range(len(records)), 2)
        records[i], records[j] = records[j], records[i]
        how = f"swap tensors {i} {j}"
    elif kind == 3:
        records.insert(k, records[k])
        if rng.random() < 0.5:
            count += 1
        how = f"duplicate tensor {k} (count {count})"
    elif kind == 4:
        del records[k]
        if rng.random() < 0.5:
            count -= 1
        how = f"drop tensor {k} (count {count})"
    elif kind == 5:
        a, b = t.name
        data = buf[t.ndim_at + 4 + 4 * len(t.dims) : t.end]
        n = len(data) // 4
        r, c = (*t.dims, 1, 1)[:2]
        dims = rng.choice(
            [
                (c, r), (n,), (1, n), (n, 1), (r, c, 1), (0,), (0, c), (), (r + 1, c), (r, c + 1),
                (max(r - 1, 0), c), (n + 1,), (0xFFFFFFFF, 0), (0, 0xFFFFFFFF), (1,) * 8,
            ]
        )  # fmt: skip
        want = 4 * math.prod(dims)
        if want <= 1 << 20 and rng.random() < 0.8:  # keep the data consistent with the dims
            data = (data + bytes(want))[:want]
        records[k] = _dc_record(buf[a:b], dims, data)
        how = f"tensor {k} dims {list(t.dims)} -> {list(dims)} ({len(data)} data bytes)"
    elif kind == 6:
        cut = rng.randrange(t.start, t.end + 1)
        records[k] = buf[t.start : cut]
        del records[k + 1 :]
        how = f"truncate inside tensor {k} at {cut}"
    else:
        tail += rng.choice((b"\0", b"\0" * 4, records[k][:4], records[k]))
        how = f"{len(tail)} trailing bytes"
    head = head[:count_at] + _u32(count)
    return head + b"".join(records) + tail, how or "datacode no-op"


_DC_TYPES = ["Linear", "ReLU", "Sigmoid", "Tanh", "Softmax", "Flatten", "Conv2d", "linear", ""]
_DC_COUNTS = [0, 1, -1, 2**32 - 1, 2**32, 2**64, 1.0, 1.5, "3", None, True, 10**400]


def _mutate_architecture(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    """An edit that means something to DataCode: layer types, feature counts, the layer list."""
    n = int.from_bytes(buf[12:16], "little")
    try:
        doc = json.loads(buf[16 : 16 + n])
    except (ValueError, RecursionError):
        return _mutate_bytes(buf, rng)
    layers = doc.get("layers") if isinstance(doc, dict) else None
    kind = rng.randrange(9)
    if not isinstance(layers, list) or not layers or not isinstance(doc, dict):
        kind = 8
    i = rng.randrange(len(layers)) if isinstance(layers, list) and layers else 0
    entry = layers[i] if isinstance(layers, list) and layers else None
    if kind == 0 and isinstance(entry, dict):
        entry["type"] = rng.choice(_DC_TYPES)
        how = f"layers[{i}].type = {entry['type']!r}"
    elif kind in (1, 2) and isinstance(entry, dict):
        key = rng.choice(("in_features", "out_features"))
        old = entry.get(key)
        entry[key] = rng.choice([*_DC_COUNTS, old + 1 if type(old) is int else 2])
        how = f"layers[{i}].{key} = {str(entry[key])[:30]}"
    elif kind == 3 and isinstance(entry, dict):
        key = rng.choice(("trainable", "name"))
        entry[key] = rng.choice([1, 0, None, "true", "layer9", "", ["x"]])
        how = f"layers[{i}].{key} = {entry[key]!r}"
    elif kind == 4 and isinstance(layers, list):
        what = rng.choice(("drop", "duplicate", "relu", "reverse", "many"))
        if what == "drop":
            del layers[i]
        elif what == "duplicate":
            layers.insert(i, layers[i])
        elif what == "relu":
            layers.insert(i, {"type": "ReLU", "name": f"layer{i}"})
        elif what == "reverse":
            layers.reverse()
        else:  # a mutant of a mutant stays below _GROW_LIMIT
            layers *= 500 if len(buf) * 500 <= _GROW_LIMIT else 2
        how = f"layers: {what} at {i}"
    elif kind == 5:
        doc["_datacode_file"] = rng.choice([{"variant": "later"}, None, "x"])
        how = "reserved key"
    elif kind == 6:
        doc["training"] = rng.choice(["x", [], {"stages": "x"}, {"stages": [1]}, {"stages": [{}]}])
        how = f"training = {doc['training']!r}"
    elif kind == 7:
        doc["device"] = rng.choice([1, None, "", "cuda", ["cpu"]])
        how = f"device = {doc['device']!r}"
    else:
        doc = rng.choice([[], "x", None, 1, {}, {"layers": {}}, {"layers": [[]]}])
        how = f"document = {doc!r}"
    text = json.dumps(doc, separators=(",", ":")).encode()
    return buf[:12] + _u32(len(text)) + text + buf[16 + n :], f"architecture {how}"


def _npy_shapes(n: int) -> list[str]:
    return [
        "()", "(0,)", f"({n + 1},)", f"({max(n - 1, 0)},)", f"({n}, 1)", f"(1, {n})",
        f"({2**63},)", f"({2**64},)", f"({2**62}, 0)", f"(0, {2**64})", f"(0, {2**63 - 1})",
        "(-1,)", "(1,)" if n != 1 else "(2,)", "(" + "1, " * 33 + ")", "(" + "1, " * 70 + ")",
        f"[{n}]", "(1.5,)", "(True,)", f"'{n}'", "None", f"({n}, {2**62})", "(" * 200 + ")" * 200,
        "1" * 5000,
    ]  # fmt: skip


_NPY_DESCRS = [
    "'<f8'", "'>f4'", "'<f2'", "'<i4'", "'|u1'", "'|b1'", "'<c8'", "'|O'", "'O'", "'<U0'",
    "'<U2'", "'|S0'", "'|V4'", "'<M8[s]'", "'<m8'", "'x'", "''", "[('a', '<f4')]",
    "('<f4', (2,))", "'<f4,<f4'", "None", "'<f16'", "'f4' * 1000", "b'<f4'", "'<f' + '4'",
]  # fmt: skip
_NPY_HEADERS = [
    "{}", "[]", "{'descr': '<f4'}", "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", "(" * 5000 + ")" * 5000, "1" * 5000,
    "{'descr': '<f4', 'descr': '<f8', 'fortran_order': False, 'shape': (2,)}", "\udcff",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} # \xe9", "__import__('os')",
]  # fmt: skip


def _mutate_npy(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Header-length, shape, descr, fortran_order, version and truncation mutations of a .npy."""
    _, start, end = _npy_parts(buf)
    header = buf[start:end].decode("latin-1").rstrip(" \n")
    data = buf[end:]
    m = re.search(r"'shape':\s*\(([0-9, ]*)\)", header)
    n = math.prod(int(x) for x in m.group(1).replace(" ", "").split(",") if x) if m else 1
    version = buf[6:8]
    kind = rng.randrange(7)
    if kind == 0:
        new = rng.choice(_npy_shapes(n))
        header, how = re.sub(r"'shape':\s*(\([^)]*\)|[^,}]*)", f"'shape': {new}", header), new
    elif kind == 1:
        new = rng.choice(_NPY_DESCRS)
        header, how = re.sub(r"'descr':\s*'[^']*'", f"'descr': {new}", header), new
    elif kind == 2:
        new = rng.choice(["True", "1", "'False'", "None", "0", "False or True"])
        header, how = re.sub(r"'fortran_order':\s*\w+", f"'fortran_order': {new}", header), new
        if new == "True" and rng.random() < 0.5:
            header = re.sub(r"'shape':\s*\(([0-9]+),\)", r"'shape': (1, \1)", header)
    elif kind == 3:
        header = rng.choice(_NPY_HEADERS)
        how = f"header {header[:30]!r}"
    elif kind == 4:
        version = rng.choice((b"\x02\x00", b"\x03\x00", b"\x00\x00", b"\x01\x01", b"\x09\x09"))
        how = f"version {version!r}"
        if rng.random() < 0.5:  # keep the old width of the length field: a lying layout
            return buf[:6] + version + buf[8:], f"version {version!r} only"
    elif kind == 5:
        cut = rng.choice((0, 1, 4, len(data) // 2, len(data))) if data else 0
        data = data[: len(data) - cut]
        how = f"data short by {cut}"
    else:
        data += rng.choice((b"\0", b"\0" * 4, data[:64]))
        how = "data with trailing bytes"
    width = 2 if version[:1] == b"\x01" else 4
    text = header.encode("utf-8" if version[:1] == b"\x03" else "latin-1", "surrogateescape")
    consistent = rng.random() < 0.9
    if consistent:  # numpy's padding: data 64-aligned, header ends in '\n'
        text += b" " * (-(8 + width + len(text) + 1) % 64) + b"\n"
    hlen = len(text) if consistent else rng.choice((0, len(text) + 1, len(text) - 1, 0xFFFF))
    prefix = buf[:6] + version + (hlen % (1 << (8 * width))).to_bytes(width, "little")
    return prefix + text + data, f"npy {how}" + ("" if consistent else f", header length {hlen}")


def _record_bytes(ident: bytes, values: bytes, dims: tuple[int, int] | None = None) -> bytes:
    if dims is None:
        return ident + b"\n" + struct.pack("<Q", len(values) // 4) + values
    return ident + b"\n" + struct.pack("<QQ", *dims) + values


_IDS = [
    b"", b"\0", b"\xff\xfe", b"\xc3\xa9", b"l0w\r", b"a" * 1024, b"a" * 1025, b"l0 w", b"l0w,1",
    b"l99999999w", b"l0W", b"l01w", b"l1000000w", b"l999999b", b"\x7f", b"l-1w", b"\tl0w", b"l0",
]  # fmt: skip


def _mutate_records(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Tagged-record mutations: lying counts, truncation, ids, order, the rows/cols variant."""
    records = find_records(buf)
    if not records:
        return _mutate_bytes(buf, rng)
    tail = buf[records[-1].end :]
    ids = [buf[r.start : r.newline] for r in records]
    values = [buf[r.data : r.end] for r in records]
    dims: list[tuple[int, int] | None] = [
        struct.unpack_from("<QQ", buf, r.count_at) if r.old else None for r in records
    ]
    k = rng.randrange(len(records))
    r = records[k]
    kind = rng.randrange(11)
    if kind == 0:  # a count that lies (the field mutation sets edge values too)
        count = len(values[k]) // 4
        new = rng.choice((0, 1, count + 1, max(count - 1, 0), 2 * count, 2**64 - 1, 2**62, 2**61))
        out = bytearray(buf)
        out[r.count_at : r.count_at + 8] = new.to_bytes(8, "little")
        return bytes(out), f"record {k} count {count} -> {new}"
    if kind == 1:
        at = rng.choice(
            (r.start, r.start + 1, r.newline, r.count_at, r.count_at + 4, r.data, (r.data + r.end) // 2, r.end - 1)
        )  # fmt: skip
        return buf[:at], f"truncate record {k} at {at}"
    if kind == 2:
        ids[k] = rng.choice([*_IDS, ids[rng.randrange(len(ids))], ids[k] + b"\n"])
        how = f"record {k} id -> {ids[k][:30]!r}"
    elif kind == 3:  # the newline gone: the id runs into the count
        return buf[: r.newline] + buf[r.newline + 1 :], f"record {k} id without newline"
    elif kind == 4:
        order = list(range(len(records)))
        rng.shuffle(order) if rng.random() < 0.5 else order.reverse()
        ids, values, dims = (
            [ids[i] for i in order],
            [values[i] for i in order],
            [dims[i] for i in order],
        )
        how = f"records reordered {order}"
    elif kind == 5:
        j = rng.randrange(len(records) + 1)
        ids.insert(j, ids[k])
        values.insert(j, values[k])
        dims.insert(j, dims[k])
        how = f"record {k} duplicated at {j}"
    elif kind == 6 and len(records) > 1:
        del ids[k], values[k], dims[k]
        how = f"record {k} dropped"
    elif kind == 7:
        ids.append(rng.choice((b"extra", b"l9w", b"l0x", b"slow")))
        values.append(bytes(4 * rng.choice((0, 1, 3))))
        dims.append(None if dims[k] is None else (len(values[-1]) // 4, 1))
        how = f"record {ids[-1]!r} added"
    elif kind == 8:  # a consistent count that disagrees with the other files
        n = len(values[k]) // 4
        new = rng.choice((0, 1, n + 1, max(n - 1, 0), 2 * n, n // 2))
        values[k] = (values[k] + bytes(4 * new))[: 4 * new]
        dims[k] = None if dims[k] is None else (new, 1)
        how = f"record {k} resized {n} -> {new}"
    elif kind == 9:  # the older rows/cols variant, for every record or for one
        every = rng.random() < 0.7
        pick = [
            lambda n: (n, 1), lambda n: (1, n), lambda n: (0, 2**64 - 1), lambda n: (2**63, 0),
            lambda n: (2**32, 2**32), lambda n: (n, 0), lambda n: (n + 1, 1),
            lambda n: (n // 2, 2) if n % 2 == 0 else (n, 1),
        ]  # fmt: skip
        shape = rng.choice(pick)
        for i in range(len(records)) if every else (k,):
            rows, cols = dims[i] = shape(len(values[i]) // 4)
            if rows * cols <= 1 << 20:  # the data follows the dims (else they lie)
                values[i] = (values[i] + bytes(4 * rows * cols))[: 4 * rows * cols]
        how = f"rows/cols variant ({'all' if every else k}): {dims[k]}"
    else:
        tail += rng.choice((b"\n", b"l0w", b"\0" * 3, buf[r.start : r.data]))
        how = f"{len(tail)} trailing bytes"
    body = b"".join(_record_bytes(i, v, d) for i, v, d in zip(ids, values, dims, strict=True))
    return body + tail, how


def _mutate_steps(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Garbage in step.txt: malformed, huge or duplicated lines, unknown ids, encodings."""
    lines = buf.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    ident = rng.choice(lines).rpartition(b",")[0] if lines else b"l0w"
    garbage = [
        b"", b",", ident, ident + b",", b",3", ident + b",-1", ident + b",+1", ident + b", 1",
        ident + b",1 ", ident + b",1.0", ident + b",1e3", ident + b",0x10", ident + "\u0663".encode(),
        ident + ",\u00b2".encode(), ident + b",9223372036854775807", ident + b",9223372036854775808",
        ident + b"," + b"9" * 19, ident + b"," + b"9" * 5000, b"unknown,1", ident + b",1,2",
        b"\0,1", ident + b"\r,1", "\ufeff".encode() + ident + b",1", ident + b",1\r\r",
        b"\xff," + b"1", ident + b",\xff",
    ]  # fmt: skip
    kind = rng.randrange(5)
    k = rng.randrange(len(lines) + 1)
    if kind == 0:
        lines.insert(k, rng.choice(garbage))
        how = f"line {k} inserted: {lines[k][:30]!r}"
    elif kind == 1 and lines:
        k = min(k, len(lines) - 1)
        lines[k] = rng.choice(garbage)
        how = f"line {k} replaced: {lines[k][:30]!r}"
    elif kind == 2 and lines:
        k = min(k, len(lines) - 1)
        lines.insert(k, lines[k])
        how = f"line {k} duplicated"
    elif kind == 3:
        return b"\r\n".join(lines) + rng.choice((b"", b"\r\n")), "CRLF"
    else:
        lines = lines * (1000 if len(buf) * 1000 <= _GROW_LIMIT else 2)
        how = f"{len(lines)} lines"
    return b"\n".join(lines) + rng.choice((b"\n", b"\n", b"")), how


_WF2_PATHS = [
    "/etc/passwd", "/{b}", "/tmp/other.wf2model/{b}", "../{b}", "../../../etc/passwd", "..", ".",
    "", "/", "{d}/", "{d}/..", "{d}/.", "{o}", "{d}/{o}", "missing.npy", "{d}/missing.npy",
    "parameters.json", "pytreeio-waffe2.json", "{b}\0", "\0", "C:\\x\\{b}", "..\\{b}", "x" * 300,
    "{B}", "./{b}", "{d}//{b}", "{d}/{b}/", "~/{b}", "{b}.npy", "sub/dir/{b}", "\udcff{b}",
]  # fmt: skip
_WF2_TYPES = [
    "bit", "fixnum", "single-float", "double-float", "cputensor", "(integer 0 4611686018427387903)",
    "(integer * *)", "(integer 5 1)", "(integer 0 " + "9" * 5000 + ")", "(integer -" + "9" * 5000 + ")",
    "(integer)", "(integer 0 1 2)", "(unsigned-byte 8)", "", " ", "single float", "(integer 4611686018427387904)",
]  # fmt: skip
_WF2_NUMBERS = [2, -1, 2**62, 2**62 - 1, 2**70, -(2**70), 1.5, 1e308, -0.0, 0, 10**400, 1e-320]


def _mutate_wf2(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    """cl-waffe2 parameters.json: path strings escaping the directory, keys, numbers, spellings."""
    doc = _wf2_document(buf)
    if doc is None:
        return _mutate_bytes(buf, rng)
    items = list(doc.items())
    paths = [i for i, (_, v) in enumerate(items) if isinstance(v, str)]
    k = rng.randrange(len(items))
    key, value = items[k]
    kind = rng.randrange(6)
    if kind in (0, 1) and paths:
        k = rng.choice(paths)
        key, value = items[k]
        d, _, b = value.rpartition("/")
        other = items[rng.choice(paths)][1].rpartition("/")[2]
        new = rng.choice(_WF2_PATHS).format(b=b, d=d, o=other, B=b.upper())
        items[k] = (key, new)
        how = f"path of {key[:40]!r} -> {new[:40]!r}"
    elif kind == 2:
        prefix, _, rest = key.partition(":")
        parts = rest.split(".")
        which = rng.randrange(6)
        if which in (0, 5) and len(parts) == 6:
            parts[4] = rng.choice(_WF2_TYPES)
        elif which == 1:
            parts[min(1, len(parts) - 1)] = rng.choice(
                ["-1", "x", "99999999999999999999", "00", "1" * 5000, ""]
            )
        elif which == 2:
            parts = rng.choice(
                [
                    parts[:-1],
                    [*parts, "x"],
                    [*parts[:2], "", *parts[3:]],
                    [p.upper() for p in parts],
                ]
            )
        elif which == 3:
            prefix = rng.choice(
                [
                    "params",
                    "PARAM",
                    "missing_param",
                    "optimizer",
                    "missing_optimizer",
                    "",
                    "param:x",
                ]
            )
        else:
            rest += rng.choice([":", "::", ".", ":x"])
            parts = rest.split(".")
        new_key = f"{prefix}:{'.'.join(parts)}"
        items[k] = (new_key, value)
        how = f"key {key[:40]!r} -> {new_key[:60]!r}"
    elif kind == 3:
        new_value: Any = rng.choice([*_WF2_NUMBERS, items[rng.choice(paths)][1] if paths else "x"])
        items[k] = (key, new_value)
        how = f"value of {key[:40]!r} -> {str(new_value)[:40]}"
    elif kind == 4:  # the same entry twice: the other spelling of n, or the same key
        spelled = key.replace("bit.n", "(integer 0 4611686018427387903).n")
        if spelled == key:
            spelled = key.replace("(integer 0 4611686018427387903).n", "bit.n")
        items.insert(k + 1, (spelled, value))
        text = "{" + ",".join(f"{json.dumps(a)}:{json.dumps(v)}" for a, v in items) + "}"
        return text.encode(
            "utf-8", "surrogatepass"
        ), f"entry {key[:40]!r} twice as {spelled[:40]!r}"
    else:
        what = rng.choice(("drop", "reverse", "shuffle"))
        if what == "drop":
            del items[k]
        elif what == "reverse":
            items.reverse()
        else:
            rng.shuffle(items)
        how = f"entries {what}"
    text = json.dumps(dict(items), separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass"), how


_ARG_VALUES = [0, -1, 1, 2, 2**40 + 1, 10**30, 1.5, 1e308, "3", None, True, False, [], {}]


def _layer_list(buf: bytes) -> tuple[dict[str, Any], list[Any]] | None:
    """A JSON object with a ``layers`` list of ``{"type", "args"}`` entries (pytreeio's sidecar)."""
    if buf.lstrip()[:1] != b"{":
        return None
    try:
        doc = json.loads(buf)
    except (ValueError, RecursionError):
        return None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if isinstance(layers, list) and any(isinstance(e, dict) and "args" in e for e in layers):
        return doc, layers
    return None


def _mutate_layer_list(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A layer list's args, types and length; a sidecar's shapes and counters."""
    found = _layer_list(buf)
    if found is None:
        return _mutate_bytes(buf, rng)
    doc, layers = found
    i = rng.randrange(len(layers))
    entry = layers[i]
    kind = rng.randrange(5)
    if kind in (0, 1) and isinstance(entry, dict) and isinstance(entry.get("args"), dict):
        args = entry["args"]
        key = rng.choice(
            [*args, "groups", "kernel_size", "in_features", "in_channels", "stride", "x"]
        )
        args[key] = rng.choice(_ARG_VALUES)
        how = f"layers[{i}].args.{key} = {str(args[key])[:30]}"
    elif kind == 2 and isinstance(entry, dict):
        entry["type"] = rng.choice(["Linear", "Conv2d", "BatchNorm2d", "ReLU", "x", None, 1])
        how = f"layers[{i}].type = {entry['type']!r}"
    elif kind == 3:
        what = rng.choice(("drop", "duplicate", "empty"))
        if what == "drop":
            del layers[i]
        elif what == "duplicate":
            layers.insert(i, layers[i])
        else:
            layers.clear()
        how = f"layers: {what} {i}"
    else:
        key = rng.choice(("shapes", "step", "count"))
        shapes = doc.get("shapes")
        if key == "shapes" and isinstance(shapes, dict) and shapes:
            name = rng.choice(sorted(shapes))
            shapes[name] = rng.choice([[], [0], [2**62], [2**61, 2], [-1], [1] * 40, [1.5], "x"])
            how = f"shapes[{name[:30]!r}] = {shapes[name]!r:.30}"
        else:
            doc[key] = rng.choice([0, -1, 2**63, 2**64, 1.5, "3", None, True])
            how = f"{key} = {doc[key]!r}"
    return json.dumps(doc, separators=(",", ":")).encode(), how


def _shaped(buf: bytes) -> list[Callable[[bytes, random.Random], tuple[bytes, str]]]:
    """The structure-aware mutators that apply to ``buf``, recognised from its content."""
    if buf[:4] in (_TL_MAGIC, b"TLLM", b"PK\x03\x04") or _looks_msgpack(buf):
        return []
    if buf[:8] == _DC_MAGIC:
        return [_mutate_datacode]
    if buf[:6] == _NPY_MAGIC and len(buf) >= 10:
        return [_mutate_npy]
    if buf.lstrip()[:1] == b"{":
        if _wf2_document(buf) is not None:
            return [_mutate_wf2]
        return [_mutate_layer_list] if _layer_list(buf) is not None else []
    if _is_step_text(buf):
        return [_mutate_steps]
    if find_records(buf):
        return [_mutate_records]
    return []


def _looks_msgpack(buf: bytes) -> bool:
    return bool(buf) and (0x80 <= buf[0] <= 0x8F or buf[0] in (0xDE, 0xDF))


def _mutate_file(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    shaped = _shaped(buf)
    if shaped and rng.random() < 0.45:
        return rng.choice(shaped)(buf, rng)
    fields, docs = find_fields(buf)
    r = rng.random()
    if docs and r < 0.45:
        return _mutate_document(buf, rng, rng.choice(docs))
    if not docs and r < 0.35 and _looks_msgpack(buf):
        return mutate_msgpack(buf, rng)
    if r < 0.75:
        return _mutate_field(buf, rng, fields)
    return _mutate_bytes(buf, rng)


def _member_kind(buf: bytes) -> str:
    if buf[:6] == _NPY_MAGIC:
        return "npy"
    if buf[:4] == b"PK\x03\x04":
        return "zip"
    if buf.lstrip()[:1] in (b"{", b"["):
        return "json"
    if find_records(buf):
        return "records"
    return "other"


def _mutate_mapping(data: Mapping[str, bytes], rng: random.Random) -> tuple[Input, list[str]]:
    """One member mutated (one to three times), or one change to the set of members."""
    files = dict(data)
    r = rng.random()
    if not files or r < 0.8:
        # a kind of member first (.npy, JSON, records...), so that the one parameters.json
        # of a directory of twelve .npy files gets its share
        kinds: dict[str, list[str]] = {}
        for name in sorted(files):
            kinds.setdefault(_member_kind(files[name]), []).append(name)
        role = rng.choice(kinds[rng.choice(sorted(kinds))]) if files else "x"
        content, how = files.get(role, b""), []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            content, what = _mutate_file(content, rng)
            how.append(f"{role}: {what}")
        files[role] = content
        return files, how
    role = rng.choice(sorted(files))
    if r < 0.84 and len(files) > 1:
        del files[role]
        return files, [f"drop {role}"]
    if r < 0.88:
        files[role] = b""
        return files, [f"empty {role}"]
    if r < 0.92 and len(files) > 1:
        a, b = rng.sample(sorted(files), 2)
        files[a], files[b] = files[b], files[a]
        return files, [f"swap {a} {b}"]
    if r < 0.96:
        new = rng.choice((role + ".bak", "sub/" + role, "../" + role, role.upper(), "/" + role))
        files[new] = files.pop(role)
        return files, [f"rename {role} {new}"]
    files["unexpected.bin"] = b"\0" * 8
    return files, ["add unexpected.bin"]


def mutate(data: Input, rng: random.Random) -> tuple[Input, list[str]]:
    """One to three mutations of a seed; of a mapping (role -> bytes), of one member."""
    if isinstance(data, Mapping):
        return _mutate_mapping(data, rng)
    how: list[str] = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        data, what = _mutate_file(data, rng)
        how.append(what)
    return data, how


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that no decoder's ``except Exception`` eats it."""


#: Memory an input may cost beyond its own size (DESIGN.md "Guarantees": input + 64 MB).
MEMORY_ALLOWANCE = 64 * 1024 * 1024


@dataclass(frozen=True)
class Seed:
    """A seed input and the load options ``decode`` is called with for it and its mutants
    (``saved_format=`` for bullet, ``variant=`` for DataCode); plain inputs take none."""

    data: Input
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Failure:
    """One input that made a format raise something other than a PytreeioError, hang, or
    use more memory than its size + :data:`MEMORY_ALLOWANCE`."""

    index: int
    stage: str
    error: str
    mutations: list[str]
    saved: Path | None
    where: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        opts = f"\n    decode options: {_short(self.options)}" if self.options else ""
        return (
            f"#{self.index} {self.stage}: {self.error}\n    at {self.where}\n"
            f"    mutations: {'; '.join(self.mutations)}{opts}\n    input: {self.saved}"
        )


def _short(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={str(v)[:60]}" for k, v in options.items())


@dataclass
class FuzzReport:
    """Counts per stage and outcome (``decode:ok``, ``inspect:FormatError``...), failures,
    and the worst memory and time of any one input.

    ``worst_memory_ratio`` is the largest ``peak growth / (input size + 64 MiB)``
    (above 1 is a failure); ``worst_memory`` that input's peak growth in bytes and
    ``worst_memory_input`` its size; ``worst_seconds`` the longest time one input
    took through all stages (the fastest of its runs), and ``worst_time_ratio``
    the largest ``seconds / time_bound(size)`` (above 1 is a failure),
    ``worst_time_input`` that input's size.  ``worst_rss_ratio``, ``worst_rss`` and
    ``worst_rss_input``: the same as the memory figures for the peak resident set
    size (Linux ``VmHWM``, reset per input), which also sees C libraries' memory.
    """

    format: str
    inputs: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    worst_memory_ratio: float = 0.0
    worst_memory: int = 0
    worst_memory_input: int = 0
    worst_seconds: float = 0.0
    worst_time_ratio: float = 0.0
    worst_time_input: int = 0
    worst_rss_ratio: float = 0.0
    worst_rss: int = 0
    worst_rss_input: int = 0

    def summary(self) -> str:
        by_stage: dict[str, list[str]] = {}
        for key, count in sorted(self.outcomes.items()):
            stage, outcome = key.split(":", 1)
            by_stage.setdefault(stage, []).append(f"{outcome} {count}")
        lines = [f"{self.format}: {self.inputs} inputs, {len(self.failures)} failures"]
        lines += [f"  {stage}: {', '.join(parts)}" for stage, parts in by_stage.items()]
        lines.append(
            f"  worst memory: {self.worst_memory_ratio:.4f} of the bound (peak growth "
            f"{self.worst_memory:,} B for a {self.worst_memory_input:,} B input); "
            f"worst time: {self.worst_time_ratio:.4f} of the bound "
            f"({TIME_BASE} s + {TIME_PER_BYTE * 1e9:.0f} ns/B; for a "
            f"{self.worst_time_input:,} B input), longest {self.worst_seconds:.3f} s per input"
        )
        lines.append(
            f"  worst peak RSS growth: {self.worst_rss_ratio:.4f} of the bound ({self.worst_rss:,} B "
            f"for a {self.worst_rss_input:,} B input)"
        )
        lines += [f"  FAIL {f}" for f in self.failures[:10]]
        return "\n".join(lines)


def _sources(data: Input) -> Any:
    if isinstance(data, Mapping):
        return {k: BufferSource(v, name=k) for k, v in data.items()}
    return BufferSource(data)


def _size(data: Input) -> int:
    if isinstance(data, Mapping):
        return sum(len(v) for v in data.values())
    return len(data)


def _host(tree: Any) -> Any:
    """A copy of a decoded tree that does not share memory with the input (used as ``like``)."""
    if isinstance(tree, np.ndarray):
        return np.array(tree)
    if isinstance(tree, dict):
        return {k: _host(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_host(v) for v in tree]
    if isinstance(tree, tuple):
        items = [_host(v) for v in tree]
        return type(tree)(*items) if hasattr(type(tree), "_fields") else tuple(items)
    return tree


class _Deadline:
    """``signal.setitimer`` around one call (main thread only)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        def expire(signum: int, frame: Any) -> None:
            raise _Timeout(f"no answer within {self.seconds:.3g} s")

        self.old = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.old)


def _save(data: Input, fmt_name: str, index: int, out_dir: list[Path]) -> Path:
    if not out_dir:
        out_dir.append(Path(tempfile.mkdtemp(prefix=f"pytreeio-fuzz-{fmt_name}-")))
    path = out_dir[0] / f"input-{index}"
    if isinstance(data, Mapping):
        path.mkdir(exist_ok=True)
        for role, content in data.items():
            safe = role.replace("/", "__").replace("\\", "__") or "_"
            (path / safe).write_bytes(content)
    else:
        path = path.with_suffix(".bin")
        path.write_bytes(data)
    return path


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    return f"{tb[-1].filename}:{tb[-1].lineno} in {tb[-1].name}" if tb else "?"


def placed(fmt: records.Format, data: Input) -> tuple[Path, dict[Path, bytes]]:
    """``(path, files)``: the input laid out where ``fmt``'s layout puts a checkpoint at
    ``path`` -- one file; a directory's members below it; each sibling role at the
    path its ``locate`` gives -- as an in-memory file system for
    :func:`pytreeio.io.probe_buffer`."""
    path = Path("/fuzz") / ("ckpt" + (fmt.suffixes[0] if fmt.suffixes else ""))
    files: dict[Path, bytes] = {}
    if isinstance(fmt.layout, records.Siblings):
        assert isinstance(data, Mapping)
        located = fmt.layout.locate(path)
        files = {Path(located[role]): blob for role, blob in data.items() if role in located}
    elif isinstance(data, Mapping):
        for rel, blob in data.items():
            # a mutated name may be empty, absolute or climb out (a walk never lists
            # such a name): that file lies elsewhere
            parts = Path(rel).parts
            inside = bool(parts) and not Path(rel).is_absolute() and ".." not in parts
            files[Path(path, rel) if inside else Path("/elsewhere", str(len(files)))] = blob
    else:
        files = {path: data}
    return path, files


def _sniff_all(fmt: records.Format, data: Input) -> records.Format | None:
    """The sniffing path of ``ptio.load(path)`` on the input as if it lay at a path.

    The input is placed in an in-memory file system (:func:`placed`), the
    probes are built by :func:`pytreeio.io.probe_buffer` exactly as
    :func:`pytreeio.io.probe` builds them from disk, and every registered
    format's ``sniff`` (and ``fmt``'s) is called on the probe for its layout.
    ``registry.best_match`` treats a raising sniffer as "not this format";
    here any exception escapes, so a sniffer that raises is a failure.  Then
    ``best_match`` itself runs (on the same probes); its answer is returned.
    """
    from pytreeio import io

    path, files = placed(fmt, data)
    probes: dict[records.Layout, records.Probe] = {}
    for other in [fmt, *(f for f in registry.iter_formats() if f is not fmt)]:
        if other.layout not in probes:
            probes[other.layout] = io.probe_buffer(path, files, other.layout)
        float(other.sniff(probes[other.layout]))
    return registry.best_match(
        lambda layout: probes.get(layout) or io.probe_buffer(path, files, layout)
    )


def _verify(fmt: records.Format, data: Input, native: Any, options: Mapping[str, Any]) -> None:
    """What ``ptio.verify`` does beyond a plain decode, on the buffers.

    The decode with ``verify=True`` where the format declares it (safetensors:
    every per-tensor checksum; bullet: the quantised copy checked against
    ``raw.bin``), the manifest check when a directory input holds one
    (:func:`pytreeio.integrity.check_manifest_buffers`), then the NaN/inf count
    of the decoded tree.
    """
    from pytreeio import integrity

    if "verify" in fmt.load_options:
        native, _meta = dispatch.call(
            fmt.decode, fmt, {**options, "verify": True}, dispatch.as_source(data)
        )
    if isinstance(fmt.layout, records.Directory) and isinstance(data, Mapping):
        manifest = data.get(integrity.MANIFEST_NAME)
        if manifest is not None:
            files = {k: v for k, v in data.items() if k != integrity.MANIFEST_NAME}
            integrity.check_manifest_buffers(manifest, files)
    if native is not None:
        integrity.nonfinite_counts(native)


def _slots(fmt: records.Format, data: Input, native: Any, options: Mapping[str, Any]) -> None:
    """What ``ptio.open`` and streaming conversions do: ``slots``, then every slot read.

    Where ``decode`` accepted the input too, the slots must read back
    ``decode``'s tree bit for bit (the :class:`pytreeio.core.binary.Slots`
    contract: in native byte order, where decode may keep a stored one); a
    difference is an AssertionError, so a failure.
    """
    import numpy as np

    from pytreeio.core.binary import BufferSource
    from pytreeio.core.tree import flatten_named, map_leaves

    if isinstance(data, Mapping):
        source: Any = {k: BufferSource(v, name=k) for k, v in data.items()}
    else:
        source = BufferSource(data, name="input")
    slots = dispatch.call(fmt.slots, fmt, options, source)
    read = map_leaves(lambda x: x.read(source) if isinstance(x, binary.Slot) else x, slots.tree)
    if native is None:
        return
    got, want = flatten_named(read), flatten_named(native)
    if list(got) != list(want):
        raise AssertionError(f"slots name {sorted(got)[:5]}..., decode {sorted(want)[:5]}...")
    for key, w in want.items():
        g = got[key]
        if isinstance(w, np.ndarray) or isinstance(g, np.ndarray):
            # slots give native byte order where decode may keep a stored '>f4' (Slot's contract)
            same = (
                isinstance(g, np.ndarray)
                and isinstance(w, np.ndarray)
                and g.dtype.newbyteorder("=") == w.dtype.newbyteorder("=")
                and g.shape == w.shape
                and g.astype(g.dtype.newbyteorder("=")).tobytes()
                == w.astype(w.dtype.newbyteorder("=")).tobytes()
            )
        else:
            same = type(g) is type(w) and repr(g) == repr(w)
        if not same:
            raise AssertionError(f"slot {key!r} reads {g!r:.80}, decode gives {w!r:.80}")


#: The stages of one input, in order (see :func:`_run_one`).
STAGES = ("sniff", "decode", "inspect", "slots", "verify", "restore", "to_model")


def _run_one(
    fmt: records.Format,
    data: Input,
    like: Any,
    deadline: float,
    options: Mapping[str, Any] | None = None,
    model_like: Any = None,
) -> Iterator[tuple[str, BaseException | None]]:
    """Each stage's outcome for one input (None = returned normally); ``deadline`` seconds
    for all the stages together.

    The stages follow the public functions: ``sniff`` (:func:`_sniff_all`);
    ``decode`` and ``restore`` are ``pytreeio.decode(data, fmt, like=like, **options)``
    split in two (the API's own option routing, source conversion and restore,
    so load(like=) is covered without decoding twice); ``inspect`` is
    ``pytreeio.api.inspect_encoded``; ``verify`` is :func:`_verify`; ``to_model``
    restores into the seed's model as flax variables (``load(like=flax tree)``:
    the format's ``to_model`` then :func:`pytreeio.model.form.restore_model`) for
    model formats, else calls ``to_model``.
    """
    from pytreeio import api

    opts = dict(options or {})
    native = meta = None
    end = time.monotonic() + deadline
    for stage in STAGES:
        if stage in ("restore", "to_model") and native is None:
            continue
        if stage == "verify" and native is None and "verify" not in fmt.load_options:
            continue  # nothing to check beyond the decode that failed
        if stage == "to_model" and getattr(fmt, "to_model", None) is None:
            continue
        if stage == "slots" and fmt.slots is None:
            continue
        left = end - time.monotonic()
        if left <= 0:
            yield stage, _Timeout(f"no time left of {deadline} s for this input")
            return
        try:
            with _Deadline(left) if math.isfinite(left) else contextlib.nullcontext():
                if stage == "sniff":
                    _sniff_all(fmt, data)
                elif stage == "decode":
                    native, meta = dispatch.call(fmt.decode, fmt, opts, dispatch.as_source(data))
                elif stage == "inspect":
                    api.inspect_encoded(data, format=fmt)
                elif stage == "slots":
                    _slots(fmt, data, native, opts)
                elif stage == "verify":
                    _verify(fmt, data, native, opts)
                elif stage == "restore":
                    assert meta is not None
                    dispatch.restore_tree(fmt, native, meta, like, opts)
                elif model_like is not None:
                    assert meta is not None
                    dispatch.restore_tree(fmt, native, meta, model_like, opts)
                else:
                    to_model: Any = fmt.to_model
                    dispatch.call(to_model, fmt, opts, native, meta)
        except _Timeout as exc:
            yield stage, exc
            return
        except Exception as exc:
            yield stage, exc
        else:
            yield stage, None


#: The time an input may take through all its stages: ``TIME_BASE`` seconds plus
#: ``TIME_PER_BYTE`` seconds per byte of input (linear in the size).  Generous: the
#: inputs here take milliseconds; a decoder that is quadratic in some count, or
#: that loops over a length field instead of the bytes, crosses it.
TIME_BASE = 0.25
TIME_PER_BYTE = 200e-9
#: Runs of an input over the time bound before it counts as "time:over" (machine noise).
TIME_RUNS = 3


def time_bound(size: int) -> float:
    """Seconds an input of ``size`` bytes may take through all stages."""
    return TIME_BASE + size * TIME_PER_BYTE


def _model_like(fmt: records.Format, native: Any, meta: dict[str, Any], options: Any) -> Any:
    """The seed's model as flax variables (a ``like`` for model restores), or None."""
    from pytreeio.model.form import flax_variables

    if not fmt.is_model_format or fmt.to_model is None:
        return None
    try:
        model = dispatch.call(fmt.to_model, fmt, options, native, meta)
        return _host(flax_variables(model))
    except PytreeioError:
        return None


def fuzz_format(
    fmt_name: str | records.Format,
    seeds: Sequence[Input | Seed],
    n: int,
    rng_seed: int,
    *,
    timeout: float = 2.0,
    save_dir: Path | None = None,
    progress: Callable[[FuzzReport], None] | None = None,
) -> FuzzReport:
    """Run ``n`` mutated inputs through ``fmt``'s pure functions; see the module doc.

    ``timeout`` bounds each input (all its stages together); the peak memory
    of each input (tracemalloc) may grow by at most its size + 64 MiB.
    ``progress(report)`` is called after every 10,000 inputs.
    """
    fmt = registry.get(fmt_name) if isinstance(fmt_name, str) else fmt_name
    if not seeds:
        raise ValueError(f"no seeds for {fmt.name}")
    plan = [s if isinstance(s, Seed) else Seed(s) for s in seeds]
    rng = random.Random(rng_seed)
    likes, models = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in plan:  # seeds must be valid: a bad seed is a test bug
            native, meta = fmt.decode(seed.data, **seed.options)
            likes.append(_host(native))
            models.append(_model_like(fmt, native, meta, seed.options))
        for seed, like, model in zip(plan, likes, models, strict=True):
            # every stage once, untimed: lazy imports (jax) happen here, not under the alarm
            for _stage, _exc in _run_one(fmt, seed.data, like, math.inf, seed.options, model):
                pass
    report = FuzzReport(fmt.name)
    out_dir: list[Path] = [save_dir] if save_dir is not None else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warnings (a stale sidecar...) are answers too
        for index in range(n):
            k = rng.randrange(len(plan))
            data, how = mutate(plan[k].data, rng)
            _fuzz_one(
                fmt, report, index, data, how, plan[k], (likes[k], models[k]), timeout, out_dir
            )
            if progress is not None and (index + 1) % 10_000 == 0:
                progress(report)
    return report


class _PeakMemory:
    """The peak of memory allocated (tracemalloc) inside the block, beyond what was before.

    Traces only the block when nothing traced before (tracing slows every
    allocation several times over; mutating needs none), else resets the
    running trace's peak.
    """

    def __enter__(self) -> _PeakMemory:
        self.own = not tracemalloc.is_tracing()
        if self.own:
            tracemalloc.start()
            self.base = 0
        else:
            self.base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
        self.rss = _PeakRss().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.growth = tracemalloc.get_traced_memory()[1] - self.base
        self.rss.__exit__()
        self.rss_growth = self.rss.growth
        if self.own:
            tracemalloc.stop()


class _PeakRss:
    """The peak resident set size inside the block beyond the RSS before it (Linux).

    Catches what tracemalloc cannot see (allocations of C libraries).  Writing
    ``5`` to ``/proc/self/clear_refs`` resets the kernel's high-water mark
    (``VmHWM``) to the current RSS; ``growth`` is ``VmHWM`` after the block
    minus ``VmRSS`` before it, or None where /proc offers neither.
    """

    _clear: int | None = None
    _status: int | None = None

    def __enter__(self) -> _PeakRss:
        self.growth: int | None = None
        self.before: int | None = None
        try:
            if _PeakRss._clear is None:
                _PeakRss._clear = os.open("/proc/self/clear_refs", os.O_WRONLY)
                _PeakRss._status = os.open("/proc/self/status", os.O_RDONLY)
            os.write(_PeakRss._clear, b"5")
            self.before = self._read("VmRSS")
        except OSError:
            self.before = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.before is not None:
            peak = self._read("VmHWM")
            self.growth = None if peak is None else max(0, peak - self.before)

    @staticmethod
    def _read(key: str) -> int | None:
        assert _PeakRss._status is not None
        text = os.pread(_PeakRss._status, 8192, 0)
        at = text.find(key.encode() + b":")
        if at < 0:
            return None
        return int(text[at + len(key) + 1 :].split()[0]) * 1024  # kB


def _fuzz_one(
    fmt: records.Format,
    report: FuzzReport,
    index: int,
    data: Input,
    how: list[str],
    seed: Seed,
    likes: tuple[Any, Any],
    timeout: float,
    out_dir: list[Path],
) -> None:
    report.inputs += 1
    bad: list[tuple[str, str, str]] = []  # (stage, error, where)
    outcomes: list[tuple[str, BaseException | None]] = []
    size = _size(data)
    bound = time_bound(size)
    # the alarm catches hangs; an input big enough to be allowed longer gets longer
    deadline = max(timeout, 2 * bound)
    like, model_like = likes
    started = time.process_time()
    with _PeakMemory() as memory:
        outcomes = list(_run_one(fmt, data, like, deadline, seed.options, model_like))
    seconds = time.process_time() - started
    for stage, exc in outcomes:
        if exc is None:
            report.outcomes[f"{stage}:ok"] += 1
            continue
        name = type(exc).__name__
        report.outcomes[f"{stage}:{name}"] += 1
        if not isinstance(exc, PytreeioError):
            bad.append((stage, f"{name}: {str(exc)[:200]}", _where(exc)))
    timed_out = any(isinstance(exc, _Timeout) for _, exc in outcomes)
    del outcomes
    # CPU time of this process, not wall time: other work on a shared machine does not
    # count.  The traced run is slower (tracemalloc): an input over the bound runs again
    # untraced
    runs = 1
    while seconds > bound and runs < TIME_RUNS and not timed_out:
        runs += 1
        started = time.process_time()
        for _ in _run_one(fmt, data, like, deadline, seed.options, model_like):
            pass
        seconds = min(seconds, time.process_time() - started)
    report.worst_seconds = max(report.worst_seconds, seconds)
    if seconds / bound > report.worst_time_ratio:
        report.worst_time_ratio, report.worst_time_input = seconds / bound, size
    if seconds > bound:
        report.outcomes["time:over"] += 1
        bad.append(("time", f"{seconds:.3f} s in each of {runs} runs > bound {bound:.3f} s", "?"))
    growth = memory.growth
    ratio = growth / (size + MEMORY_ALLOWANCE)
    if ratio > report.worst_memory_ratio:
        report.worst_memory_ratio, report.worst_memory = ratio, growth
        report.worst_memory_input = size
    if ratio > 1:
        report.outcomes["memory:over"] += 1
        bad.append(("memory", f"peak growth {growth:,} B > {size:,} B input + 64 MiB", "?"))
    rss = memory.rss_growth
    if rss is not None:
        rss_ratio = rss / (size + MEMORY_ALLOWANCE)
        if rss_ratio > report.worst_rss_ratio:
            report.worst_rss_ratio, report.worst_rss, report.worst_rss_input = rss_ratio, rss, size
        if rss_ratio > 1:
            report.outcomes["rss:over"] += 1
            bad.append(("rss", f"peak RSS growth {rss:,} B > {size:,} B input + 64 MiB", "?"))
    saved = _save(data, fmt.name, index, out_dir) if bad else None
    for stage, error, where in bad:
        report.failures.append(Failure(index, stage, error, how, saved, where, seed.options))


# --------------------------------------------------------------------------
# seeds for the built-in formats
# --------------------------------------------------------------------------

CONFORMANCE = REPO.parent / "shared" / "conformance"


def _files(encoded: Any) -> Input:
    if encoded.files is not None:
        return {role: e.tobytes() for role, e in encoded.files.items()}
    return encoded.tobytes()


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _msgpack_seeds(rng: np.random.Generator) -> list[Input]:
    from pytreeio.formats import msgpack as m

    trees: list[Any] = [
        {"params": {"w": _f32(rng, 2, 3), "b": _f32(rng, 3)}, "step": 3, "lr": 0.5, "on": True},
        {"a": [1, 2.5, None, "s", b"b", 1 + 2j], "n": np.int8(3), "e": {}, "z": np.zeros((0, 2))},
    ]
    seeds: list[Input] = [m.encode(t).tobytes() for t in trees]
    seeds.append(m.encode({"big": np.arange(40, dtype=np.float32)}, chunk_bytes=64).tobytes())
    return seeds


def _safetensors_seeds(rng: np.random.Generator) -> list[Input]:
    import collections

    from pytreeio.formats import safetensors as st

    P = collections.namedtuple("P", ["mu", "nu"])
    tree = {
        "params": {"w": _f32(rng, 2, 3), "b": np.arange(3, dtype=np.int64)},
        "opt": (P(_f32(rng, 3), _f32(rng, 3)), None),
        "step": 7,
        "lr": 0.25,
        "flag": False,
        "name": "run",
        "layers": [np.ones(2, np.uint8), np.float32(1.5)],
        5: np.zeros((0,), np.float16),
    }
    seeds: list[Input] = [st.encode(tree, meta={"epoch": 3, "tags": ["a", "b"]}).tobytes()]
    seeds.append(st.encode({"x": _f32(rng, 4)}).tobytes())
    plain = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    text = json.dumps(plain).encode()
    seeds.append(struct.pack("<Q", len(text)) + text + b"\0" * 8)  # a foreign file
    return seeds


def _tinyllama_seeds(rng: np.random.Generator, conformance: Path | None = None) -> list[Input]:
    from pytreeio.formats import tinyllama as tl

    cfg = {
        "d_model": 4,
        "n_layers": 2,
        "n_heads": 2,
        "ffn_hidden_dim": 6,
        "max_seq_len": 3,
        "vocab_size": 5,
    }
    d, f, s, v = 4, 6, 3, 5
    layer = {
        "wq": _f32(rng, d, d), "wk": _f32(rng, d, d), "wv": _f32(rng, d, d), "wo": _f32(rng, d, d),
        "w1": _f32(rng, d, f), "b1": _f32(rng, f), "w2": _f32(rng, f, d), "b2": _f32(rng, d),
        "ln1": {"scale": _f32(rng, d), "bias": _f32(rng, d)},
        "ln2": {"scale": _f32(rng, d), "bias": _f32(rng, d)},
    }  # fmt: skip
    tree = {
        "tok_embedding": _f32(rng, v, d),
        "pos_embedding": _f32(rng, s, d),
        "layers": [layer, layer],
        "output": _f32(rng, d, v),
    }
    seeds: list[Input] = [tl.encode(tree, meta={"config": {**cfg, "dropout": 0.1}}).tobytes()]
    real = (conformance or CONFORMANCE) / "tinyllama" / "weights.bin"
    if real.is_file():
        seeds.append(real.read_bytes())
    return seeds


def _netcl_seeds(name: str, rng: np.random.Generator) -> list[Input]:
    mlp = [
        {"weight": _f32(rng, 4, 8), "bias": _f32(rng, 8)},
        {},
        {"weight": _f32(rng, 8, 3), "bias": _f32(rng, 3)},
    ]
    if name == "netcl":
        from pytreeio.formats.netcl import model_file as netcl

        return [_files(netcl.MODEL.encode(mlp, meta={"config": ["Linear", "ReLU", "Linear"]}))]
    from pytreeio.formats.netcl import checkpoint as nck

    params = {"p0": _f32(rng, 4, 8), "p1": _f32(rng, 8)}
    if name == "netcl-params":
        return [_files(nck.PARAMS.encode(params))]
    state = {
        "t": 3,
        "moments": [
            [np.zeros((4, 8), np.float32), np.ones((4, 8), np.float32)],
            [np.zeros(8, np.float32), np.ones(8, np.float32)],
        ],
    }
    return [
        _files(
            nck.CHECKPOINT.encode({"params": params, "optim_state": state, "config": {"step": 3}})
        )
    ]


def _datacode_seeds(
    rng: np.random.Generator, conformance: Path | None = None
) -> list[Input | Seed]:
    from pytreeio.formats.datacode import nn as dc

    native = {
        "layer0": {"weight": _f32(rng, 4, 3), "bias": _f32(rng, 3)},
        "layer2": {"weight": _f32(rng, 3, 2), "bias": _f32(rng, 2)},
    }
    meta = {"layers": ["Linear", "ReLU", "Linear"]}
    seeds: list[Input | Seed] = [
        dc.encode(native, meta=meta, variant=v).tobytes() for v in dc.VARIANTS
    ]
    square = {"layer0": {"weight": _f32(rng, 2, 2), "bias": _f32(rng, 1, 2)}}  # bias [1, out]
    seeds.append(Seed(dc.encode(square, variant="later").tobytes(), {"variant": "later"}))
    for path in sorted(((conformance or CONFORMANCE) / "datacode").glob("*.nn")):
        seeds.append(path.read_bytes())
    return seeds


def _with_manifest(fmt_name: str, files: Mapping[str, bytes]) -> dict[str, bytes]:
    """A directory checkpoint with the manifest ``pytreeio checksum`` would write into it."""
    from pytreeio import integrity

    entries = {
        name: {"size": len(blob), integrity.ALGORITHM: integrity.buffer_checksum(blob)}
        for name, blob in files.items()
    }
    doc = {
        "pytreeio-sum": integrity.MANIFEST_VERSION,
        "algorithm": integrity.ALGORITHM,
        "format": fmt_name,
        "layout": "dir",
        "written": "2024-01-01T00:00:00Z",
        "files": entries,
    }
    text = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
    return {**files, integrity.MANIFEST_NAME: text}


def _directory(path: Path) -> dict[str, bytes]:
    """A checkpoint directory's files by relative POSIX path."""
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def _waffe2_seeds(rng: np.random.Generator, conformance: Path | None = None) -> list[Input | Seed]:
    from pytreeio.formats.waffe2 import state_dict as waffe2

    root = (conformance or CONFORMANCE) / "waffe2"
    seeds: list[Input | Seed] = [_directory(d) for d in sorted(root.glob("*.wf2model"))]

    def adam(*shape: int) -> dict[str, Any]:
        moments = {"m": _f32(rng, *shape), "v": np.abs(_f32(rng, *shape))}
        return {"adam": {"lr": 0.01, "eps": 1e-07, "beta1": 0.9, "beta2": 0.999, "n": 3, **moments}}

    params = {
        "0": {"weights": _f32(rng, 3, 4), "bias": _f32(rng, 3)},
        "1": {"weights": _f32(rng, 2, 3)},
    }
    opt = {"0": {"weights": adam(3, 4), "bias": adam(3)}, "1": {"weights": {"sgd": {"lr": 0.1}}}}
    tree = {"param": {"linearlayer": params}, "optimizer": {"linearlayer": opt}}
    # 2-D arrays: pytreeio's sidecar holds their shapes
    seeds.append(_files(waffe2.encode(tree, dest="ours.wf2model")))
    layers = [
        {"type": "Linear", "args": {"in_features": 4, "out_features": 3}},
        "Sigmoid",
        {"type": "Linear", "args": {"in_features": 3, "out_features": 2, "bias": False}},
    ]
    meta = {"layers": layers, "step": 3}
    seeds.append(
        _files(waffe2.encode(tree, meta=meta, save_dir="./ours.wf2model", optimizers=False))
    )
    # a grouped convolution: the sidecar's layer list gives the shapes to_model needs
    conv = {"0": {"weight": _f32(rng, 4, 2, 3, 3), "bias": _f32(rng, 4)}}
    args = {"in_channels": 4, "out_channels": 4, "kernel_size": 3, "groups": 2}
    meta = {"layers": [{"type": "Conv2d", "args": args}, "ReLU"], "count": 2}
    seeds.append(_files(waffe2.encode({"param": {"conv2d": conv}}, meta=meta)))
    ours = seeds[-1]
    assert isinstance(ours, dict)
    seeds.append(_with_manifest("waffe2", ours))  # what ``pytreeio checksum DIR`` adds
    return seeds


def _records_old(buf: bytes, shapes: Mapping[bytes, tuple[int, int]]) -> bytes:
    """A tagged-record file in the older rows/cols variant (``shapes``: id -> (rows, cols))."""
    out = []
    for r in find_records(buf):
        ident = buf[r.start : r.newline]
        values = buf[r.data : r.end]
        out.append(_record_bytes(ident, values, shapes.get(ident, (len(values) // 4, 1))))
    return b"".join(out)


def _bullet_seeds(rng: np.random.Generator) -> list[Input | Seed]:
    from pytreeio.formats.bullet import checkpoint as bullet

    w = {"l0w": _f32(rng, 6, 4), "l0b": _f32(rng, 4), "l1w": _f32(rng, 4, 2), "l1b": _f32(rng, 2)}
    moments = {
        "momentum": {k: _f32(rng, *v.shape) * 0.01 for k, v in w.items()},
        "velocity": {k: np.abs(_f32(rng, *v.shape)) * 0.01 for k, v in w.items()},
    }
    classic = bullet.classic_layout([255, 64])
    meta = {"saved_format": classic, "steps": dict.fromkeys(w, 3), "log": "1,1,0.5\n1,2,0.25\n"}
    full = _files(bullet.encode({"weights": w, **moments}, meta=meta))
    assert isinstance(full, dict) and bullet.QUANTISED in full
    no_quantised = {k: v for k, v in full.items() if k != bullet.QUANTISED}
    buckets = bullet.output_bucket_layout([127, 32], types="i8")
    ranger = {"weights": w, **moments, "slow": {k: v * 0.5 for k, v in w.items()}}
    plain = _files(bullet.encode({"weights": w}))  # every tensor f32, no moments
    assert isinstance(plain, dict)
    old = dict(plain)
    old[bullet.WEIGHTS] = _records_old(
        plain[bullet.WEIGHTS], {b"l0w": (4, 6), b"l0b": (4, 1), b"l1w": (2, 4), b"l1b": (2, 1)}
    )
    exported = {bullet.RAW: full[bullet.RAW], bullet.QUANTISED: full[bullet.QUANTISED]}
    shapes = {k: list(v.shape) for k, v in w.items()}
    return [
        Seed(full, {"saved_format": classic}),
        Seed(full, {"saved_format": classic, "check_quantised": True}),
        Seed(no_quantised, {"saved_format": classic}),
        Seed(
            _files(bullet.encode(ranger, meta={"saved_format": buckets})), {"saved_format": buckets}
        ),
        plain,
        old,
        Seed(exported, {"saved_format": classic, "shapes": shapes}),
        Seed(_with_manifest("bullet", full), {"saved_format": classic}),
    ]


def default_seeds(
    fmt_name: str, rng_seed: int = 0, conformance: Path | None = None
) -> list[Input | Seed]:
    """Seeds for a built-in format: files its encoder writes, plus the conformance
    files of ``conformance`` (default ``../shared/conformance``) when present.
    Seeds whose ``decode`` takes options (bullet's ``saved_format=``) are :class:`Seed`\\ s."""
    rng = np.random.default_rng(rng_seed)
    makers: dict[str, Callable[[np.random.Generator], list[Input]]] = {
        "msgpack": _msgpack_seeds,
        "safetensors": _safetensors_seeds,
    }
    if fmt_name == "tinyllama":
        return list(_tinyllama_seeds(rng, conformance))
    if fmt_name == "datacode":
        return _datacode_seeds(rng, conformance)
    if fmt_name == "waffe2":
        return _waffe2_seeds(rng, conformance)
    if fmt_name == "bullet":
        return _bullet_seeds(rng)
    if fmt_name in makers:
        return list(makers[fmt_name](rng))
    if fmt_name.startswith("netcl"):
        return list(_netcl_seeds(fmt_name, rng))
    raise KeyError(f"no default seeds for {fmt_name!r}; pass seeds to fuzz_format")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: fuzz the named formats (every registered one by default)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("formats", nargs="*", default=list(registry.formats()))
    parser.add_argument("-n", type=int, default=2000, help="inputs per format")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per input")
    args = parser.parse_args(argv)
    failed = 0
    for name in args.formats:
        started = time.monotonic()

        def progress(report: FuzzReport, started: float = started) -> None:
            print(
                f"{report.format}: {report.inputs} inputs, {len(report.failures)} failures, "
                f"{time.monotonic() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )

        report = fuzz_format(
            name, default_seeds(name), args.n, args.seed, timeout=args.timeout, progress=progress
        )
        print(report.summary(), flush=True)  # the first 10 failures in full
        if len(report.failures) > 10:
            saved = report.failures[0].saved
            print(
                f"  ... {len(report.failures) - 10} more, inputs under {saved.parent if saved else '?'}"
            )
        failed += len(report.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
