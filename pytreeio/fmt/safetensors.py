"""Format ``safetensors``: the safetensors file layout, carrying any pytree.

=========  =============  =================================================
offset     size           content
=========  =============  =================================================
0          8              u64 N: length of the JSON header
8          N              JSON object, padded with spaces to a multiple of 8
8 + N      rest           tensor data, C order, little-endian
=========  =============  =================================================

The header maps each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets relative to the data section, which they must
cover exactly: no holes, no overlaps) plus an optional ``"__metadata__"``
object of string values.  Names are pytreeio canonical key strings.  The
tree structure (dict/list/tuple/NamedTuple/None, int keys, Python scalars,
string leaves) is kept as JSON in ``__metadata__["pytreeio.tree"]`` and the
caller's meta in ``__metadata__["pytreeio.meta"]``, so a tree round-trips
with or without ``like``.  Files written by other tools load as a flat
``{name: array}`` dict with their ``__metadata__`` as meta.

Tensors are laid out by decreasing item size so that every tensor starts
at an offset aligned to its dtype.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import dtypes
from ..binary import ByteSource, Reader, Writer
from ..errors import EncodeError, FormatError
from ..registry import Decoded, Encoded, Entry, Format, Info, Probe, register
from ..tree import (
    component_string,
    is_jax_array,
    is_namedtuple,
    namedtuple_fields,
    node_children,
)

__all__ = ["FORMAT", "encode", "decode", "inspect", "FORMAT_VERSION", "MAX_HEADER_BYTES"]

FORMAT_VERSION = "1"
#: The safetensors specification's limit on the JSON header.
MAX_HEADER_BYTES = 100_000_000
_META = "__metadata__"
_TREE_KEY = "pytreeio.tree"
_META_KEY = "pytreeio.meta"
_VERSION_KEY = "pytreeio.version"

_CODE_TO_NAME = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_NAME_TO_CODE = {v: k for k, v in _CODE_TO_NAME.items()}


# --------------------------------------------------------------------------
# encoding
# --------------------------------------------------------------------------


class _Collector:
    def __init__(self) -> None:
        self.tensors: list[tuple[str, np.ndarray]] = []

    def add(self, name: str, arr: np.ndarray, kind: str | None) -> dict[str, Any]:
        if name == _META:
            raise EncodeError(f"the key {_META!r} is reserved by safetensors", key_path=name)
        if _code_of(arr.dtype) is None:
            raise EncodeError(f"safetensors cannot store dtype {arr.dtype.name}", key_path=name)
        self.tensors.append((name, dtypes.c_order(arr)))
        node: dict[str, Any] = {"leaf": name}
        if kind:
            node["kind"] = kind
        return node

    def structure(self, x: Any, key: str = "") -> Any:
        if isinstance(x, np.ndarray) or is_jax_array(x):
            return self.add(key, np.asarray(x), None)
        if x is None:
            return None
        if isinstance(x, bool):
            return self.add(key, np.array(x), "bool")
        if isinstance(x, int):
            if not -(2**63) <= x < 2**63:
                raise EncodeError(f"int {x} does not fit int64", key_path=key)
            return self.add(key, np.array(x, dtype=np.int64), "int")
        if isinstance(x, float):
            return self.add(key, np.array(x, dtype=np.float64), "float")
        if isinstance(x, str):
            return {"str": x}
        if isinstance(x, np.generic):
            return self.add(key, np.asarray(x), "npscalar")
        if isinstance(x, complex | bytes):
            raise EncodeError(f"safetensors cannot store a {type(x).__name__}", key_path=key)
        kids = node_children(x)
        if kids is None:
            raise EncodeError(
                f"cannot store a leaf of type {type(x).__module__}.{type(x).__qualname__}",
                key_path=key,
            )
        pairs = kids[0]
        if isinstance(x, Mapping):
            return {"dict": [[k, self.structure(v, _child_key(key, k))] for k, v in pairs]}
        if is_namedtuple(x):
            return {
                "namedtuple": type(x).__name__,
                "fields": namedtuple_fields(x),
                "items": [self.structure(v, _child_key(key, k)) for k, v in pairs],
            }
        if isinstance(x, list):
            return {"list": [self.structure(v, _child_key(key, k)) for k, v in pairs]}
        if isinstance(x, tuple):
            return {"tuple": [self.structure(v, _child_key(key, k)) for k, v in pairs]}
        # other registered pytree nodes are kept as dicts of their children
        cls = f"{type(x).__module__}.{type(x).__qualname__}"
        return {
            "dict": [
                [k if not isinstance(k, tuple) else k[1], self.structure(v, _child_key(key, k))]
                for k, v in pairs
            ],
            "node": cls,
        }


def _child_key(parent: str, comp: Any) -> str:
    """The canonical key of a child, from its parent's key (root: "")."""
    text = component_string(comp)
    return f"{parent}/{text}" if parent else text


_CODE_BY_DTYPE: dict[np.dtype[Any], str] = {}


def _code_of(dt: np.dtype[Any]) -> str | None:
    """The safetensors dtype code (``dtype.name`` is slow in numpy, so cache by dtype)."""
    code = _CODE_BY_DTYPE.get(dt)
    if code is None and not dt.hasobject and dt.fields is None:
        code = _NAME_TO_CODE.get(dt.name)
        if code is not None and dt.byteorder != ">":
            _CODE_BY_DTYPE[dt] = code
    return code


def encode(tree: Any, *, meta: Mapping[str, Any] | None = None, **options: Any) -> Encoded:
    """The safetensors encoding of any pytree (array buffers referenced, not copied)."""
    if options:
        raise TypeError(f"unknown safetensors options: {sorted(options)}")
    col = _Collector()
    structure = col.structure(tree)
    metadata = {
        "format": "pytreeio",
        _VERSION_KEY: FORMAT_VERSION,
        _TREE_KEY: json.dumps(structure, separators=(",", ":"), allow_nan=False),
    }
    if meta:
        try:
            metadata[_META_KEY] = json.dumps(dict(meta), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise EncodeError(f"meta is not JSON-serialisable: {exc}") from None
    # Largest items first keeps every tensor aligned to its dtype (the header is 8-aligned).
    order = sorted(range(len(col.tensors)), key=lambda i: -col.tensors[i][1].dtype.itemsize)
    header: dict[str, Any] = {_META: metadata}
    offset = 0
    for i in order:
        name, arr = col.tensors[i]
        header[name] = {
            "dtype": _code_of(arr.dtype),
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise EncodeError(
            f"header of {len(text)} bytes exceeds the safetensors limit of {MAX_HEADER_BYTES}"
        )
    w = Writer()
    w.u64(len(text))
    w.raw(text)
    for i in order:
        w.array(col.tensors[i][1])
    return Encoded(chunks=tuple(w.finish()))


# --------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


class _Header:
    def __init__(
        self,
        n: int,
        entries: dict[str, tuple[np.dtype[Any], tuple[int, ...], int, int]],
        metadata: dict[str, str],
    ) -> None:
        self.n = n
        self.entries = entries
        self.metadata = metadata


def _check_header_length(n: int, total: int, r: Reader) -> None:
    if n > MAX_HEADER_BYTES:
        raise r.error(
            f"header length {n} exceeds the safetensors limit of {MAX_HEADER_BYTES}",
            "header length",
            0,
        )
    if n > total - 8:
        raise r.error(
            f"header length {n} exceeds the {total - 8} bytes after it", "header length", 0
        )


def _read_header(r: Reader, total: int) -> _Header:
    """Parse and validate the header; ``r`` is positioned at offset 0 of the file."""
    n = r.u64("header length")
    _check_header_length(n, total, r)
    raw = r.bytes(n, "header")
    if n == 0 or raw[0] != ord("{"):
        raise r.error("header is not a JSON object", "header", 8)
    try:
        doc = json.loads(str(raw, "utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise r.error(f"header is not valid JSON: {exc}", "header", 8) from None
    if not isinstance(doc, dict):
        raise r.error("header is not a JSON object", "header", 8)
    metadata = doc.pop(_META, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise r.error("__metadata__ must map strings to strings", _META, 8)
    data_len = total - 8 - n
    entries: dict[str, tuple[np.dtype[Any], tuple[int, ...], int, int]] = {}
    for name, spec in doc.items():
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise r.error(f"tensor {name!r}: needs exactly dtype, shape, data_offsets", name, 8)
        dt = (
            dtypes.by_name(_CODE_TO_NAME.get(spec["dtype"], ""))
            if isinstance(spec["dtype"], str)
            else None
        )
        if dt is None:
            raise r.error(f"tensor {name!r}: unsupported dtype {spec['dtype']!r}", name, 8)
        shape = spec["shape"]
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise r.error(f"tensor {name!r}: bad shape {shape!r}", name, 8)
        offs = spec["data_offsets"]
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1] <= data_len
        ):
            raise r.error(
                f"tensor {name!r}: data_offsets {offs!r} outside the {data_len}-byte data section",
                name,
                8,
            )
        need = math.prod(shape) * dt.itemsize
        if offs[1] - offs[0] != need:
            raise r.error(
                f"tensor {name!r}: {offs[1] - offs[0]} data bytes, shape {tuple(shape)} of {dt.name} needs {need}",
                name,
                8 + n + offs[0],
            )
        entries[name] = (dt, tuple(shape), offs[0], offs[1])
    pos = 0
    for name, (_, _, b, e) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if b != pos:
            what = (
                "overlaps the previous tensor"
                if b < pos
                else f"leaves a hole of {b - pos} bytes before it"
            )
            raise r.error(f"tensor {name!r} {what}", name, 8 + n + b)
        pos = e
    if pos != data_len:
        raise r.error(
            f"{data_len - pos} data bytes are not covered by any tensor", "data", 8 + n + pos
        )
    return _Header(n, entries, metadata)


def _rebuild(node: Any, arrays: dict[str, np.ndarray], used: set[str], r: Reader) -> Any:
    def bad(why: str) -> FormatError:
        return r.error(f"{_TREE_KEY}: {why}", _TREE_KEY, 8)

    if node is None:
        return None
    if not isinstance(node, dict):
        raise bad(f"unexpected node {node!r:.60}")
    if "leaf" in node:
        name = node["leaf"]
        if not isinstance(name, str) or name not in arrays:
            raise bad(f"refers to a missing tensor {name!r:.60}")
        if name in used:
            raise bad(f"uses tensor {name!r} twice")
        used.add(name)
        arr = arrays[name]
        kind = node.get("kind")
        if kind is None:
            return arr
        if arr.shape != ():
            raise bad(f"scalar {name!r} has shape {arr.shape}")
        if kind == "npscalar":
            return arr[()]
        if kind in ("int", "float", "bool"):
            return {"int": int, "float": float, "bool": bool}[kind](arr[()].item())
        raise bad(f"unknown leaf kind {kind!r}")
    if "str" in node and isinstance(node["str"], str):
        return node["str"]
    if "dict" in node and isinstance(node["dict"], list):
        out: dict[Any, Any] = {}
        for item in node["dict"]:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or not isinstance(item[0], str | int)
                or isinstance(item[0], bool)
            ):
                raise bad("malformed dict entry")
            if item[0] in out:
                raise bad(f"duplicate dict key {item[0]!r}")
            out[item[0]] = _rebuild(item[1], arrays, used, r)
        return out
    if "list" in node and isinstance(node["list"], list):
        return [_rebuild(x, arrays, used, r) for x in node["list"]]
    if "tuple" in node and isinstance(node["tuple"], list):
        return tuple(_rebuild(x, arrays, used, r) for x in node["tuple"])
    if "namedtuple" in node:
        name, fields, items = node.get("namedtuple"), node.get("fields"), node.get("items")
        if (
            not isinstance(name, str)
            or not isinstance(fields, list)
            or not isinstance(items, list)
            or len(fields) != len(items)
            or not all(
                isinstance(f, str) and f.isidentifier() and not f.startswith("_") for f in fields
            )
            or len(set(fields)) != len(fields)
            or not name.isidentifier()
        ):
            raise bad("malformed namedtuple")
        cls = collections.namedtuple(name, fields)  # type: ignore[misc]
        return cls(*(_rebuild(x, arrays, used, r) for x in items))
    raise bad(f"unknown node {sorted(node)!r:.60}")


def decode(buffer: Any, **options: Any) -> Decoded:
    """The tree in a safetensors buffer (arrays are views of it)."""
    r = Reader(buffer)
    total = r.remaining
    header = _read_header(r, total)
    base = 8 + header.n
    arrays: dict[str, np.ndarray] = {}
    for name, (dt, shape, b, _e) in header.entries.items():
        r.pos = base + b
        arrays[name] = r.array(dt, shape, name)
    md = header.metadata
    if _TREE_KEY not in md:
        return Decoded(arrays, dict(md))
    if md.get(_VERSION_KEY) != FORMAT_VERSION:
        raise r.error(
            f"unsupported pytreeio layout version {md.get(_VERSION_KEY)!r}", _VERSION_KEY, 8
        )
    try:
        structure = json.loads(md[_TREE_KEY])
        meta = json.loads(md[_META_KEY]) if _META_KEY in md else {}
    except ValueError as exc:
        raise r.error(f"metadata is not valid JSON: {exc}", _TREE_KEY, 8) from None
    if not isinstance(meta, dict):
        raise r.error("pytreeio.meta is not a JSON object", _META_KEY, 8)
    used: set[str] = set()
    try:
        tree = _rebuild(structure, arrays, used, r)
    except RecursionError:
        raise r.error("tree structure nested too deeply", _TREE_KEY, 8) from None
    unused = sorted(set(arrays) - used)
    if unused:
        raise r.error(f"tensors not referenced by the tree structure: {unused[:5]}", _TREE_KEY, 8)
    return Decoded(tree, meta)


def inspect(source: ByteSource) -> Info:
    """Entries and meta from the header alone (8 + N bytes read)."""
    n = source.reader(0, 8, "header length").u64("header length")
    # Validate the length before reading N bytes, as _read_header does for whole files.
    _check_header_length(n, source.size, Reader(b"", source=source.name))
    head = source.read(0, 8 + n, "header")
    header = _read_header(Reader(head, source=source.name), source.size)
    entries = tuple(
        Entry(name, shape, dt.name, e - b)
        for name, (dt, shape, b, e) in sorted(header.entries.items(), key=lambda kv: kv[1][2])
    )
    md = header.metadata
    if _TREE_KEY not in md:
        return Info(format="safetensors", entries=entries, meta=dict(md))
    try:
        meta = json.loads(md[_META_KEY]) if _META_KEY in md else {}
    except ValueError:
        raise FormatError(
            "pytreeio.meta is not valid JSON", path=source.name, field=_META_KEY, offset=8
        ) from None
    return Info(format="safetensors", entries=entries, meta=meta if isinstance(meta, dict) else {})


def _sniff(probe: Probe) -> bool:
    if probe.is_dir or len(probe.head) < 9:
        return False
    n = int.from_bytes(probe.head[:8], "little")
    return 0 < n <= probe.size - 8 and probe.head[8:9] == b"{"


FORMAT = register(
    Format(
        name="safetensors",
        description="safetensors file; the pytree structure and meta kept in __metadata__",
        suffixes=(".safetensors",),
        layout="file",
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=_sniff,
    )
)
