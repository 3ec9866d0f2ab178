"""A structure-aware mutation fuzzer for pytreeio's formats.

Usage from tests::

    report = fuzz_format("msgpack", seeds=[blob, ...], n=200, rng_seed=0)
    assert not report.failures, report.summary()

and from the command line (``nox -s fuzz`` runs this)::

    python tests/fuzz.py [FORMAT ...] [-n N] [--seed S] [--timeout SECONDS]

For each of ``n`` inputs the fuzzer picks a seed, applies one to three
mutations, and calls the format's pure functions -- ``decode``, ``inspect``
(on :class:`pytreeio.binary.BufferSource`\\ s), ``restore`` into a ``like``
tree built from the seed's own decoding, and ``to_model`` where the format
has one -- asserting that nothing but a :class:`pytreeio.PytreeioError`
escapes and that no call outlives a per-input deadline (``signal.setitimer``,
main thread only).  Any other exception, or a timeout, is a failure: the
input is saved under a temporary directory and reported with the stage, the
exception and the mutations that produced it.

Inputs are ``bytes`` for single-file formats and ``Mapping[str, bytes]``
(role or relative path -> content) for sibling and directory formats, so a
format added later plugs in by giving seeds (see :func:`default_seeds`).

Mutations are chosen by what the bytes look like, not by format name, so
new formats get structure-aware mutations for the containers they share:

* everywhere: truncation at a random offset, bit flips, random bytes,
  inserted / removed / duplicated runs;
* length and count fields, each set to 0, 1, all-ones, the top bit,
  "negative" (``2**bits - k``), off-by-one and doubled: the Tiny Llama
  header and record dims, the safetensors header length, every msgpack
  length/count, the ZIP local/central/end-record sizes, counts and offsets
  and each ``.npy`` header length, and any u32/u64 that precedes a JSON
  document and equals its length (DataCode-style framing);
* JSON documents (a whole file, the safetensors header, JSON held in its
  string values, any framed document): a node replaced by a value of the
  wrong type, a meaningful word (a keyword, a dtype or kind name, a reserved
  key), a huge or non-finite number, deep nesting, bad UTF-8, a duplicated
  or removed key; the enclosing length field is fixed up so the mutation
  reaches the parser;
* msgpack objects (flax state dicts): a node, a map key or an extension's
  payload replaced by a value of another type (arrays, maps, ext arrays);
* multi-file inputs: a role's content mutated as above, a role dropped,
  emptied, swapped with another, or an unknown one added.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import struct
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from pytreeio import registry  # noqa: E402
from pytreeio.binary import BufferSource  # noqa: E402
from pytreeio.errors import PytreeioError  # noqa: E402

__all__ = [
    "Field",
    "Failure",
    "FuzzReport",
    "fuzz_format",
    "mutate",
    "find_fields",
    "default_seeds",
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
    from pytreeio.fmt import tinyllama as tl

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


def find_fields(buf: bytes) -> tuple[list[Field], list[Document]]:
    """Length/count fields and JSON documents in ``buf``, recognised from its content."""
    if buf[:4] in (_TL_MAGIC, b"TLLM"):
        return _tinyllama_fields(buf), []
    if buf[:4] == b"PK\x03\x04" or buf[-22:-18] == b"PK\x05\x06":
        return _zip_fields(buf), []
    stripped = buf.lstrip()
    if stripped[:1] in (b"{", b"[") and _is_json(buf):
        return [], [Document(0, len(buf))]
    if len(buf) > 9 and buf[8:9] == b"{":
        fields, docs = _safetensors_parts(buf)
        if docs:
            return fields, docs
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
        buf[f.offset : f.offset + f.size] = (value & ((1 << (8 * f.size)) - 1)).to_bytes(
            f.size, f.order
        )  # type: ignore[arg-type]


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
    return rng.choice(
        [*_WRONG, *_WORDS, b"\xff", msgpack.ExtType(1, array), msgpack.ExtType(2, b"\x92"),
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


def _looks_msgpack(buf: bytes) -> bool:
    return bool(buf) and (0x80 <= buf[0] <= 0x8F or buf[0] in (0xDE, 0xDF))


def _mutate_file(buf: bytes, rng: random.Random) -> tuple[bytes, str]:
    fields, docs = find_fields(buf)
    r = rng.random()
    if docs and r < 0.45:
        return _mutate_document(buf, rng, rng.choice(docs))
    if not docs and r < 0.35 and _looks_msgpack(buf):
        return mutate_msgpack(buf, rng)
    if r < 0.75:
        return _mutate_field(buf, rng, fields)
    return _mutate_bytes(buf, rng)


def mutate(data: Input, rng: random.Random) -> tuple[Input, list[str]]:
    """One to three mutations of a seed (bytes, or a mapping of role -> bytes)."""
    how: list[str] = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if isinstance(data, Mapping):
            files = dict(data)
            r = rng.random()
            if not files or r < 0.8:
                role = rng.choice(sorted(files)) if files else "x"
                files[role], what = _mutate_file(files.get(role, b""), rng)
                how.append(f"{role}: {what}")
            elif r < 0.85 and len(files) > 1:
                role = rng.choice(sorted(files))
                del files[role]
                how.append(f"drop {role}")
            elif r < 0.9:
                role = rng.choice(sorted(files))
                files[role] = b""
                how.append(f"empty {role}")
            elif r < 0.95 and len(files) > 1:
                a, b = rng.sample(sorted(files), 2)
                files[a], files[b] = files[b], files[a]
                how.append(f"swap {a} {b}")
            else:
                files["unexpected.bin"] = b"\0" * 8
                how.append("add unexpected.bin")
            data = files
        else:
            data, what = _mutate_file(data, rng)
            how.append(what)
    return data, how


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that no decoder's ``except Exception`` eats it."""


@dataclass
class Failure:
    """One input that made a format raise something other than a PytreeioError (or hang)."""

    index: int
    stage: str
    error: str
    mutations: list[str]
    saved: Path | None
    where: str

    def __str__(self) -> str:
        return (
            f"#{self.index} {self.stage}: {self.error}\n    at {self.where}\n"
            f"    mutations: {'; '.join(self.mutations)}\n    input: {self.saved}"
        )


@dataclass
class FuzzReport:
    """Counts per stage and outcome (``decode:ok``, ``inspect:FormatError``...), and failures."""

    format: str
    inputs: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)

    def summary(self) -> str:
        by_stage: dict[str, list[str]] = {}
        for key, count in sorted(self.outcomes.items()):
            stage, outcome = key.split(":", 1)
            by_stage.setdefault(stage, []).append(f"{outcome} {count}")
        lines = [f"{self.format}: {self.inputs} inputs, {len(self.failures)} failures"]
        lines += [f"  {stage}: {', '.join(parts)}" for stage, parts in by_stage.items()]
        lines += [f"  FAIL {f}" for f in self.failures[:10]]
        return "\n".join(lines)


def _sources(data: Input) -> Any:
    if isinstance(data, Mapping):
        return {k: BufferSource(v, name=k) for k, v in data.items()}
    return BufferSource(data)


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
            raise _Timeout(f"no answer within {self.seconds} s")

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
        path.mkdir()
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


def _run_one(
    fmt: registry.Format, data: Input, like: Any, deadline: float
) -> Iterator[tuple[str, BaseException | None]]:
    """Each stage's outcome for one input (None = returned normally)."""
    native = meta = None
    for stage in ("decode", "inspect", "restore", "to_model"):
        if stage in ("restore", "to_model") and native is None:
            continue
        if stage == "to_model" and getattr(fmt, "to_model", None) is None:
            continue
        try:
            with _Deadline(deadline):
                if stage == "decode":
                    native, meta = fmt.decode(data)
                elif stage == "inspect":
                    fmt.inspect(_sources(data))
                elif stage == "restore":
                    fmt.restore(native, meta, like)
                else:
                    fmt.to_model(native, meta)
        except (Exception, _Timeout) as exc:
            yield stage, exc
        else:
            yield stage, None


def fuzz_format(
    fmt_name: str | registry.Format,
    seeds: Sequence[Input],
    n: int,
    rng_seed: int,
    *,
    timeout: float = 2.0,
    save_dir: Path | None = None,
) -> FuzzReport:
    """Run ``n`` mutated inputs through ``fmt``'s pure functions; see the module doc."""
    fmt = registry.get(fmt_name) if isinstance(fmt_name, str) else fmt_name
    if not seeds:
        raise ValueError(f"no seeds for {fmt.name}")
    rng = random.Random(rng_seed)
    likes = []
    for seed in seeds:
        native, _meta = fmt.decode(seed)  # seeds must be valid: a bad seed is a test bug
        likes.append(_host(native))
    report = FuzzReport(fmt.name)
    out_dir: list[Path] = [save_dir] if save_dir is not None else []
    for index in range(n):
        k = rng.randrange(len(seeds))
        data, how = mutate(seeds[k], rng)
        report.inputs += 1
        for stage, exc in _run_one(fmt, data, likes[k], timeout):
            if exc is None:
                report.outcomes[f"{stage}:ok"] += 1
                continue
            name = type(exc).__name__
            report.outcomes[f"{stage}:{name}"] += 1
            if not isinstance(exc, PytreeioError):
                saved = _save(data, fmt.name, index, out_dir)
                report.failures.append(
                    Failure(index, stage, f"{name}: {str(exc)[:200]}", how, saved, _where(exc))
                )
    return report


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
    from pytreeio.fmt import msgpack as m

    trees: list[Any] = [
        {"params": {"w": _f32(rng, 2, 3), "b": _f32(rng, 3)}, "step": 3, "lr": 0.5, "on": True},
        {"a": [1, 2.5, None, "s", b"b", 1 + 2j], "n": np.int8(3), "e": {}, "z": np.zeros((0, 2))},
    ]
    seeds: list[Input] = [m.encode(t).tobytes() for t in trees]
    seeds.append(m.encode({"big": np.arange(40, dtype=np.float32)}, chunk_bytes=64).tobytes())
    return seeds


def _safetensors_seeds(rng: np.random.Generator) -> list[Input]:
    import collections

    from pytreeio.fmt import safetensors as st

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
    from pytreeio.fmt import tinyllama as tl

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
        from pytreeio.fmt import netcl

        return [_files(netcl.MODEL.encode(mlp, meta={"config": ["Linear", "ReLU", "Linear"]}))]
    from pytreeio.fmt import netcl_checkpoint as nck

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


def default_seeds(fmt_name: str, rng_seed: int = 0, conformance: Path | None = None) -> list[Input]:
    """Seeds for a built-in format: files its encoder writes, plus the conformance
    files of ``conformance`` (default ``../shared/conformance``) when present."""
    rng = np.random.default_rng(rng_seed)
    makers: dict[str, Callable[[np.random.Generator], list[Input]]] = {
        "msgpack": _msgpack_seeds,
        "safetensors": _safetensors_seeds,
    }
    if fmt_name == "tinyllama":
        return _tinyllama_seeds(rng, conformance)
    if fmt_name in makers:
        return makers[fmt_name](rng)
    if fmt_name.startswith("netcl"):
        return _netcl_seeds(fmt_name, rng)
    raise KeyError(f"no default seeds for {fmt_name!r}; pass seeds to fuzz_format")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: fuzz the named formats (all with default seeds by default)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "formats",
        nargs="*",
        default=[
            "msgpack",
            "safetensors",
            "tinyllama",
            "netcl",
            "netcl-checkpoint",
            "netcl-params",
        ],
    )
    parser.add_argument("-n", type=int, default=2000, help="inputs per format")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per input")
    args = parser.parse_args(argv)
    failed = 0
    for name in args.formats:
        report = fuzz_format(name, default_seeds(name), args.n, args.seed, timeout=args.timeout)
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
