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

The structure document (``pytreeio.core.tree``), one JSON value per tree node::

    null                                       None
    {"leaf": name[, "kind": k]}                the tensor ``name``; k = "int", "float",
                                               "bool" (a Python scalar, 0-d int64 /
                                               float64 / bool tensor) or "npscalar"
    {"leaf": name, "key": impl}                a typed PRNG key (``jax.random.key``):
                                               ``name`` holds its U32 key data, ``impl``
                                               is jax's implementation name
    {"str": text}                              a string leaf
    {"dict": [[key, node], ...][, "node": c]}  a dict (str or int keys); c names a
                                               custom pytree node kept as a dict
    {"list": [node, ...]}, {"tuple": [...]}    a list, a tuple
    {"namedtuple": name, "fields": [...], "items": [node, ...]}

Reading is bounded: every JSON document goes through `pytreeio.core.jsonsafe.loads`
(depth, value count, NaN, duplicate keys), trees nest at most
`MAX_TREE_DEPTH` levels, shapes are checked with
`pytreeio.core.binary.check_shape`, namedtuple names must be identifiers that
are not keywords, at most `MAX_NAMEDTUPLE_CLASSES` distinct namedtuple
classes are created per file, and a scalar's kind must match its tensor's dtype.

Flax NNX Variables are stored as their values (see `pytreeio.core.nnx`), so
``nnx.state(model)`` is stored as its pure dict and restored into ``like``'s
Variables.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import keyword
import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from pytreeio.core import dtypes, jsonsafe, keys, nnx, shards
from pytreeio.core.binary import ByteSource, Deferred, Reader, Slot, Slots, Streamed, check_shape
from pytreeio.core.errors import EncodeError, FormatError
from pytreeio.core.records import (
    FILE,
    MAGIC,
    STRUCTURE,
    Decoded,
    Encoded,
    Entry,
    Format,
    Info,
    Probe,
)
from pytreeio.core.tree import (
    component_string,
    is_jax_array,
    is_namedtuple,
    namedtuple_fields,
    node_children,
)
from pytreeio.formats.registry import register

__all__ = [
    "FORMAT",
    "encode",
    "decode",
    "inspect",
    "sniff",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "MAX_TREE_DEPTH",
]

FORMAT_VERSION = "1"
#: The safetensors specification's limit on the JSON header.
MAX_HEADER_BYTES = 100_000_000
#: The deepest tree the structure document may describe (each level is up to 3 JSON levels).
MAX_TREE_DEPTH = 100
#: Distinct namedtuple classes one file may make ``decode`` create (each costs ~1 KiB).
MAX_NAMEDTUPLE_CLASSES = 4096
#: The deepest ``meta`` document (JSON nesting) that is written and read.
MAX_META_DEPTH = jsonsafe.MAX_DEPTH
_TREE_JSON_DEPTH = 3 * MAX_TREE_DEPTH + 2
_HEADER_JSON_DEPTH = 8  # {name: {"shape": [...]}} is 3 deep; __metadata__ values are strings
_META = "__metadata__"
_TREE_KEY = "pytreeio.tree"
_META_KEY = "pytreeio.meta"
_VERSION_KEY = "pytreeio.version"
_SUM_KEY = "pytreeio.xxh3_64"
#: A streamed tensor's checksum until it is read (checksums are 16 hex digits).
_PENDING = "0" * 16

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
_DTYPE_BY_CODE = {
    code: dt for code, name in _CODE_TO_NAME.items() if (dt := dtypes.by_name(name)) is not None
}


# --------------------------------------------------------------------------
# encoding
# --------------------------------------------------------------------------


class _Collector:
    """Walks the tree once: the structure document plus each tensor and its dtype code."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, np.ndarray | Streamed]] = []
        self.codes: list[str] = []

    def add(self, name: str, arr: np.ndarray | Streamed, kind: str | None) -> dict[str, Any]:
        if name == _META:
            raise EncodeError(f"the key {_META!r} is reserved by safetensors", key_path=name)
        code = _code_of(arr.dtype)
        if code is None:
            raise EncodeError(f"safetensors cannot store dtype {arr.dtype.name}", key_path=name)
        self.tensors.append((name, arr if isinstance(arr, Streamed) else dtypes.c_order(arr)))
        self.codes.append(code)
        node: dict[str, Any] = {"leaf": name}
        if kind:
            node["kind"] = kind
        return node

    def structure(self, x: Any, key: str = "", depth: int = 0) -> Any:
        # The two common nodes first, with the per-node work done inline (this runs once
        # per leaf and per dict): a plain ndarray and a plain dict of str keys.
        tx = type(x)
        if tx is np.ndarray and depth <= MAX_TREE_DEPTH:
            code = _CODE_BY_DTYPE.get(x.dtype)  # only native little-endian dtypes are cached
            if code is not None and x.flags.c_contiguous and key != _META:
                self.tensors.append((key, x))
                self.codes.append(code)
                return {"leaf": key}
            return self.add(key, x, None)
        if tx is dict and depth < MAX_TREE_DEPTH:
            names = list(x)
            if all(type(k) is str for k in names):
                names.sort()
                d = depth + 1
                items = []
                for k in names:
                    if k and k[0] not in "[#\\" and "/" not in k and "\\" not in k:
                        text = k
                    else:
                        text = component_string(k)
                    items.append([k, self.structure(x[k], f"{key}/{text}" if key else text, d)])
                return {"dict": items}
        return self._general(x, key, depth)

    def _general(self, x: Any, key: str, depth: int) -> Any:
        if depth > MAX_TREE_DEPTH:
            raise EncodeError(f"tree is nested deeper than {MAX_TREE_DEPTH} levels", key_path=key)
        if isinstance(x, np.ndarray):
            return self.add(key, np.asarray(x), None)
        if isinstance(x, Streamed):  # a streamed conversion's array: read when written
            return self.add(key, x, None)
        if is_jax_array(x):
            sharded = shards.sharded_leaf(x, key)
            if sharded is not None:  # written shard by shard, never gathered
                return self.add(key, sharded, None)
            if keys.is_key_dtype(x.dtype):
                impl, data = keys.key_data(x, key)
                node = self.add(key, data, None)
                node["key"] = impl
                return node
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
        inner = nnx.unwrap(x)
        if inner is not x:  # an NNX Variable: its value, no level of its own
            return self.structure(inner, key, depth)
        kids = node_children(x)
        if kids is None:
            raise EncodeError(
                f"cannot store a leaf of type {type(x).__module__}.{type(x).__qualname__}",
                key_path=key,
            )
        pairs = kids[0]
        d = depth + 1

        def sub(k: Any, v: Any) -> Any:
            return self.structure(v, _child_key(key, k), d)

        if isinstance(x, Mapping):
            return {"dict": [[k, sub(k, v)] for k, v in pairs]}
        if is_namedtuple(x):
            return {
                "namedtuple": type(x).__name__,
                "fields": namedtuple_fields(x),
                "items": [sub(k, v) for k, v in pairs],
            }
        if isinstance(x, list):
            return {"list": [sub(k, v) for k, v in pairs]}
        if isinstance(x, tuple):
            return {"tuple": [sub(k, v) for k, v in pairs]}
        # other registered pytree nodes are kept as dicts of their children
        cls = f"{type(x).__module__}.{type(x).__qualname__}"
        return {
            "dict": [[k if not isinstance(k, tuple) else k[1], sub(k, v)] for k, v in pairs],
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


def _meta_json(meta: Mapping[str, Any]) -> str:
    """The meta document as written, refused if ``decode`` would refuse it."""
    try:
        text = json.dumps(dict(meta), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise EncodeError(f"meta is not JSON-serialisable: {exc}") from None
    if jsonsafe.max_depth_of(text.encode("utf-8", "surrogatepass")) > MAX_META_DEPTH:
        raise EncodeError(f"meta is nested deeper than {MAX_META_DEPTH} levels")
    return text


def encode(tree: Any, *, meta: Mapping[str, Any] | None = None, checksum: bool = True) -> Encoded:
    """The safetensors encoding of any pytree (array buffers referenced, not copied).

    ``checksum`` (default on) records each tensor's xxh3_64 checksum, hashed
    from the array's own buffer, in ``__metadata__["pytreeio.xxh3_64"]``.
    """
    col = _Collector()
    structure = col.structure(tree)
    tensors, codes = col.tensors, col.codes
    metadata = {
        "format": "pytreeio",
        _VERSION_KEY: FORMAT_VERSION,
        _TREE_KEY: json.dumps(structure, separators=(",", ":"), allow_nan=False),
    }
    if meta:
        metadata[_META_KEY] = _meta_json(meta)
    # Largest items first keeps every tensor aligned to its dtype (the header is 8-aligned);
    # the sort is stable, so equal item sizes keep the tree's order.
    sizes = [arr.dtype.itemsize for _, arr in tensors]
    order = sorted(range(len(tensors)), key=sizes.__getitem__, reverse=True)
    streamed = any(isinstance(arr, Streamed) for _, arr in tensors)
    sums: dict[str, str] = {}
    hashed: Callable[[], dict[str, str]] | None = None
    if checksum and not streamed and sum(a.nbytes for _, a in tensors) >= _HASH_WHILE_WRITING:
        from pytreeio.core.digest import checksums_in_background

        # Large trees are hashed on the other cores while the data is written, and the
        # header, whose placeholders have the checksums' length, is written last.
        in_memory = [(tensors[i][0], cast(np.ndarray, tensors[i][1])) for i in order]
        hashed = checksums_in_background(in_memory)  # in the order they are written
        sums = dict.fromkeys((name for name, _ in tensors), _PENDING)
    elif checksum:
        from pytreeio.core.digest import array_checksum

        # A streamed tensor is hashed when it is read; until then a placeholder of the
        # same length holds its place, so the header's length is known up front.
        sums = {
            name: _PENDING if isinstance(arr, Streamed) else array_checksum(arr)
            for name, arr in tensors
        }
    # Each entry's JSON text, built once: the checksums alone change between a streamed
    # encoding's first and final header.
    dumps = json.encoder.encode_basestring  # what json.dumps(ensure_ascii=False) uses
    entries = []
    offset = 0
    for i in order:
        name, arr = tensors[i]
        nbytes = arr.nbytes
        shape = ",".join(map(str, arr.shape))
        entries.append(
            f'{dumps(name)}:{{"dtype":"{codes[i]}","shape":[{shape}],'
            f'"data_offsets":[{offset},{offset + nbytes}]}}'
        )
        offset += nbytes
    body = ",".join(entries)

    def header_text(sums: dict[str, str]) -> bytes:
        if checksum:
            metadata[_SUM_KEY] = json.dumps(sums, separators=(",", ":"), ensure_ascii=False)
        head = json.dumps({_META: metadata}, separators=(",", ":"), ensure_ascii=False)
        text = (f"{head[:-1]},{body}}}" if body else head).encode("utf-8")
        text += b" " * (-len(text) % 8)
        if len(text) > MAX_HEADER_BYTES:
            raise EncodeError(
                f"header of {len(text)} bytes exceeds the safetensors limit of {MAX_HEADER_BYTES}"
            )
        return text

    text = header_text(sums)
    if streamed or hashed is not None:
        return _streamed_encoding(col, order, text, sums if checksum else None, header_text, hashed)
    # Small tensors are packed into one buffer with the header (one write for many
    # leaves); large ones are referenced in place.
    chunks: list[Any] = []
    pending = bytearray(len(text).to_bytes(8, "little"))
    pending += text
    for i in order:
        a: Any = tensors[i][1]  # no Streamed here
        nbytes = a.nbytes
        if not nbytes:
            continue
        if nbytes < _PACK_BELOW:
            # numpy's own dtypes export their buffer; others (bfloat16) as bytes
            pending += a.data if a.dtype.isbuiltin == 1 else a.reshape(-1).view(np.uint8).data
        else:
            chunks.append(bytes(pending))
            pending = bytearray()
            chunks.append(a.reshape(-1).view(np.uint8).data)
    if pending:
        chunks.append(bytes(pending))
    return Encoded(chunks=tuple(chunks))


#: Tensors smaller than this are copied into one buffer with their neighbours.
_PACK_BELOW = 4096
#: Trees of at least this many tensor bytes are hashed while they are written.
_HASH_WHILE_WRITING = 32 << 20


def _streamed_encoding(
    col: _Collector,
    order: list[int],
    text: bytes,
    sums: dict[str, str] | None,
    header_text: Any,
    hashed: Callable[[], dict[str, str]] | None = None,
) -> Encoded:
    """Chunks of a tree with `Streamed` arrays: each read when written, the header last.

    With checksums, each streamed tensor is hashed as it is read and the header
    (same length: every checksum has 16 hex digits) is written after the data;
    ``hashed`` waits for the checksums of the in-memory arrays, hashed on other
    threads while they are written.
    """

    def hasher(name: str) -> Any:
        import xxhash  # the data may come in pieces (a sharded array's bands): hash as it comes

        state = xxhash.xxh3_64()

        def seen(arr: np.ndarray) -> None:
            assert sums is not None
            state.update(arr.reshape(-1).view(np.uint8).data)
            sums[name] = f"{state.intdigest():016x}"

        return seen

    chunks: list[Any] = []
    for i in order:
        name, arr = col.tensors[i]
        if isinstance(arr, Streamed):
            chunks.extend(arr.chunks(hasher(name) if sums is not None else None))
        elif arr.nbytes:
            chunks.append(arr.reshape(-1).view(np.uint8).data)
    size = len(text)

    def header() -> bytes:
        if hashed is not None and sums is not None:
            sums.update(hashed())
        final = header_text(sums) if sums is not None else text
        if len(final) != size or (sums is not None and _PENDING in sums.values()):
            raise EncodeError("a streamed tensor was not read before the header was written")
        return size.to_bytes(8, "little") + final

    return Encoded(chunks=(Deferred(8 + size, header, late=True), *chunks))


# --------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------


#: A header's tensors: name -> (dtype, shape, data start, data end).
_Entries = dict[str, tuple[np.dtype[Any], tuple[int, ...], int, int]]


@dataclasses.dataclass
class _Header:
    n: int  # the JSON header's length
    entries: _Entries
    metadata: dict[str, str]
    source: str | None


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


def _value_budget(total: int) -> int:
    """JSON values the header may hold: the file pays for them (about 64 bytes each)."""
    return (total + jsonsafe.DEFAULT_ALLOWANCE) // 64


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tensor(
    name: str, spec: Any, r: Reader, data_len: int, n: int
) -> tuple[np.dtype[Any], tuple[int, ...], int, int]:
    """One header entry, every field checked (shape before any arithmetic on it)."""
    # The common case in one go (this runs once per tensor): plain ints only (``type(x) is
    # int`` excludes bools), no zero dimension; anything else takes the checks below.
    if type(spec) is dict and len(spec) == 3:
        code = spec.get("dtype")
        dt = _DTYPE_BY_CODE.get(code) if type(code) is str else None  # lists are unhashable
        shape, offs = spec.get("shape"), spec.get("data_offsets")
        if dt is not None and type(shape) is list and type(offs) is list and len(offs) == 2:
            b, e = offs
            if type(b) is int and type(e) is int and 0 <= b <= e <= data_len:
                if len(shape) == 1:  # the commonest shape, without a generator
                    d0 = shape[0]
                    if type(d0) is int and 0 < d0 < 2**31 and d0 * dt.itemsize == e - b:
                        return dt, (d0,), b, e
                elif (
                    len(shape) <= 8
                    and all(type(d) is int and 0 < d < 2**31 for d in shape)
                    and math.prod(shape) * dt.itemsize == e - b
                ):
                    return dt, tuple(shape), b, e
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise r.error(f"tensor {name!r:.80}: needs exactly dtype, shape, data_offsets", name, 8)
    code = spec["dtype"]
    dt = dtypes.by_name(_CODE_TO_NAME.get(code, "")) if isinstance(code, str) else None
    if dt is None:
        raise r.error(f"tensor {name!r:.80}: unsupported dtype {code!r:.40}", name, 8)
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise r.error(f"tensor {name!r:.80}: bad shape {shape!r:.80}", name, 8)
    count = check_shape(shape, dt.itemsize, path=r.source, field=name, offset=8)
    offs = spec["data_offsets"]
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(_is_int(o) for o in offs)
        or not 0 <= offs[0] <= offs[1] <= data_len
    ):
        raise r.error(
            f"tensor {name!r:.80}: data_offsets {offs!r:.80} outside the {data_len}-byte "
            "data section",
            name,
            8,
        )
    need = count * dt.itemsize
    if offs[1] - offs[0] != need:
        raise r.error(
            f"tensor {name!r:.80}: {offs[1] - offs[0]} data bytes, shape {tuple(shape)} of "
            f"{dt.name} needs {need}",
            name,
            8 + n + offs[0],
        )
    return dt, tuple(shape), offs[0], offs[1]


def _read_header(r: Reader, total: int) -> _Header:
    """Parse and validate the header; ``r`` is positioned at offset 0 of the file."""
    n = r.u64("header length")
    _check_header_length(n, total, r)
    raw = r.bytes(n, "header")
    if n == 0 or raw[0] != ord("{"):
        raise r.error("header is not a JSON object", "header", 8)
    bounds: dict[str, Any] = {
        "path": r.source,
        "field": "header",
        "offset": 8,
        "max_depth": _HEADER_JSON_DEPTH,
        "max_values": _value_budget(total),
    }
    doc = jsonsafe.loads(raw, **bounds)
    if not isinstance(doc, dict):
        raise r.error("header is not a JSON object", "header", 8)
    metadata = doc.pop(_META, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise r.error("__metadata__ must map strings to strings", _META, 8)
    data_len = total - 8 - n
    entries = {name: _tensor(name, spec, r, data_len, n) for name, spec in doc.items()}
    pos = 0
    for name, (_, _, b, e) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if b != pos:
            what = (
                "overlaps the previous tensor"
                if b < pos
                else f"leaves a hole of {b - pos} bytes before it"
            )
            raise r.error(f"tensor {name!r:.80} {what}", name, 8 + n + b)
        pos = e
    if pos != data_len:
        raise r.error(
            f"{data_len - pos} data bytes are not covered by any tensor", "data", 8 + n + pos
        )
    return _Header(n, entries, metadata, r.source)


def _document(header: _Header, key: str, max_depth: int, total: int) -> Any:
    """A JSON document held in a ``__metadata__`` string (its bytes are escaped in the file)."""
    return jsonsafe.loads(
        header.metadata[key],
        path=header.source,
        field=key,
        offset=8,
        exact=False,
        max_depth=max_depth,
        max_values=_value_budget(total),
    )


def _check_layout_version(header: _Header) -> None:
    version = header.metadata.get(_VERSION_KEY)
    if version != FORMAT_VERSION:
        raise FormatError(
            f"unsupported pytreeio layout version {version!r:.40}",
            path=header.source,
            field=_VERSION_KEY,
            offset=8,
        )


def _user_meta(header: _Header, total: int) -> dict[str, Any]:
    if _META_KEY not in header.metadata:
        return {}
    meta = _document(header, _META_KEY, MAX_META_DEPTH, total)
    if not isinstance(meta, dict):
        raise FormatError(
            "pytreeio.meta is not a JSON object", path=header.source, field=_META_KEY, offset=8
        )
    return meta


# A scalar's kind and the dtype kinds its tensor may have (encode writes int64, float64, bool).
_KIND_DTYPES = {"int": "iu", "float": "f", "bool": "b"}
_KIND_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool}


class _Rebuilder:
    """Rebuilds the tree from the structure document; depth-bounded, every node checked."""

    def __init__(self, arrays: dict[str, np.ndarray], r: Reader) -> None:
        self.arrays = arrays
        self.used: set[str] = set()
        self.r = r
        self.classes: dict[tuple[str, tuple[str, ...]], Any] = {}

    def build(self, header: _Header, total: int) -> Any:
        """The tree the header's structure document describes, every node checked."""
        return self.node(_document(header, _TREE_KEY, _TREE_JSON_DEPTH, total))

    def bad(self, why: str) -> FormatError:
        return self.r.error(f"{_TREE_KEY}: {why}", _TREE_KEY, 8)

    def node(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_TREE_DEPTH:
            raise self.bad(f"tree nested deeper than {MAX_TREE_DEPTH} levels")
        if node is None:
            return None
        if not isinstance(node, dict):
            raise self.bad(f"unexpected node {node!r:.60}")
        d = depth + 1
        if "leaf" in node:
            return self.leaf(node)
        if "str" in node and isinstance(node["str"], str):
            return node["str"]
        if "dict" in node and isinstance(node["dict"], list):
            return self.mapping(node["dict"], d)
        if "list" in node and isinstance(node["list"], list):
            return [self.node(x, d) for x in node["list"]]
        if "tuple" in node and isinstance(node["tuple"], list):
            return tuple(self.node(x, d) for x in node["tuple"])
        if "namedtuple" in node:
            return self.namedtuple(node, d)
        raise self.bad(f"unknown node {sorted(node)!r:.60}")

    def leaf(self, node: dict[str, Any]) -> Any:
        arr, convert = self.resolve(node)
        return arr if convert is None else convert(arr)

    def resolve(self, node: dict[str, Any]) -> tuple[Any, Callable[[Any], Any] | None]:
        """The array (or slot) a leaf node names, checked, and how its value is made from it."""
        name = node["leaf"]
        if not isinstance(name, str) or name not in self.arrays:
            raise self.bad(f"refers to a missing tensor {name!r:.60}")
        if name in self.used:
            raise self.bad(f"uses tensor {name!r:.60} twice")
        self.used.add(name)
        item = self.arrays[name]
        kind = node.get("kind")
        if "key" in node:
            if kind is not None:
                raise self.bad(f"PRNG key {name!r:.60} has a scalar kind")
            impl, bad = node["key"], self.bad
            return item, lambda arr: keys.wrap(arr, impl, lambda why: bad(f"{name!r:.60}: {why}"))
        if kind is None:
            return item, None
        if tuple(item.shape) != ():
            raise self.bad(f"scalar {name!r:.60} has shape {tuple(item.shape)}")
        if kind == "npscalar":
            return item, _item
        if not isinstance(kind, str) or kind not in _KIND_DTYPES:
            raise self.bad(f"unknown leaf kind {kind!r:.40}")
        dtype = np.dtype(item.dtype)
        if dtype.kind not in _KIND_DTYPES[kind]:
            # e.g. an "int" scalar stored as a float64 NaN: int() would raise
            raise self.bad(f"{kind} scalar {name!r:.60} is stored as {dtype.name}")
        cls = _KIND_TYPES[kind]
        return item, lambda arr: cls(arr[()].item())

    def mapping(self, items: list[Any], depth: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for item in items:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or not isinstance(item[0], str | int)
                or isinstance(item[0], bool)
            ):
                raise self.bad("malformed dict entry")
            if item[0] in out:
                raise self.bad(f"duplicate dict key {item[0]!r:.60}")
            out[item[0]] = self.node(item[1], depth)
        return out

    def namedtuple(self, node: dict[str, Any], depth: int) -> Any:
        name, fields, items = node.get("namedtuple"), node.get("fields"), node.get("items")
        if (
            not isinstance(name, str)
            or not isinstance(fields, list)
            or not isinstance(items, list)
            or len(fields) != len(items)
            or not all(_field_name(f) for f in fields)
            or len(set(fields)) != len(fields)
            or not name.isidentifier()
            or keyword.iskeyword(name)
        ):
            raise self.bad(f"malformed namedtuple {name!r:.60}")
        cls = self.namedtuple_class(name, tuple(fields))
        return cls(*(self.node(x, depth) for x in items))

    def namedtuple_class(self, name: str, fields: tuple[str, ...]) -> Any:
        key = (name, fields)
        cls: Any = self.classes.get(key)
        if cls is None:
            if len(self.classes) >= MAX_NAMEDTUPLE_CLASSES:
                raise self.bad(f"more than {MAX_NAMEDTUPLE_CLASSES} distinct namedtuple types")
            try:
                cls = collections.namedtuple(name, fields)  # type: ignore[misc,no-redef]
            except (ValueError, TypeError, SyntaxError) as exc:
                raise self.bad(f"namedtuple {name!r:.60}: {exc}") from None
            self.classes[key] = cls
        return cls


def _field_name(f: Any) -> bool:
    """What ``collections.namedtuple`` accepts as a field name (without renaming)."""
    return (
        isinstance(f, str)
        and f.isidentifier()
        and not f.startswith("_")
        and not keyword.iskeyword(f)
    )


def _check_sums(header: _Header, r: Reader, total: int) -> None:
    """Compare each tensor's data with its recorded checksum (files without any: nothing)."""
    from pytreeio.core.digest import buffer_checksum

    sums = _recorded_sums(header, r, total)
    if sums is None:
        return
    base = 8 + header.n
    view = r.view
    for name, (_dt, _shape, b, e) in sorted(header.entries.items(), key=lambda kv: kv[1][2]):
        want = sums.get(name)
        if want is None:
            raise r.error(f"tensor {name!r:.80} has no checksum", name, base + b)
        found = buffer_checksum(view[base + b : base + e])
        if found != want:
            raise r.error(_corrupted(name, e - b, found, want), name, base + b)


def _recorded_sums(header: _Header, r: Reader, total: int) -> dict[str, str] | None:
    """The per-tensor checksums the header records (None: it records none), checked."""
    if _SUM_KEY not in header.metadata:
        return None
    sums = _document(header, _SUM_KEY, 2, total)
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise r.error(f"{_SUM_KEY} must map tensor names to checksums", _SUM_KEY, 8)
    unknown = sorted(set(sums) - set(header.entries))
    if unknown:
        raise r.error(f"{_SUM_KEY} names tensors the file lacks: {unknown[:5]}", _SUM_KEY, 8)
    return sums


def _corrupted(name: str, nbytes: int, found: str, want: str) -> str:
    return (
        f"tensor {name!r:.80}: data corrupted ({nbytes} bytes hash to "
        f"xxh3_64 {found}, recorded {want:.20})"
    )


def _checked_reader(slot: Slot, want: str | None) -> Any:
    """A slot ``reader`` that checks the tensor's stored bytes against its recorded checksum."""

    def read(src: ByteSource) -> np.ndarray:
        from pytreeio.core.digest import buffer_checksum

        if want is None:
            raise FormatError(
                f"tensor {slot.key!r:.80} has no checksum",
                path=src.name,
                field=slot.key,
                offset=slot.offset,
            )
        raw = src.read(slot.offset, slot.nbytes, slot.key)
        found = buffer_checksum(raw)
        if found != want:
            raise FormatError(
                _corrupted(slot.key, slot.nbytes, found, want),
                path=src.name,
                field=slot.key,
                offset=slot.offset,
            )
        # the shape and byte count were checked with the header (_read_header)
        return np.frombuffer(raw, dtype=slot.dtype).reshape(slot.shape)

    return read


def _views(view: memoryview, base: int, entries: _Entries) -> dict[str, np.ndarray]:
    """Each entry's array, a view of ``view`` (entries checked by `_read_header`)."""
    return {
        name: np.frombuffer(view, dt, (e - b) // dt.itemsize, base + b).reshape(shape)
        for name, (dt, shape, b, e) in entries.items()
    }


def decode(buffer: Any, *, verify: bool = False) -> Decoded:
    """The tree in a safetensors buffer (arrays are views of it).

    ``verify`` checks the per-tensor checksums pytreeio records (files from
    other tools have none); a mismatch is a `FormatError` whose
    ``field`` is the tensor's name and ``offset`` the start of its data.
    """
    r = Reader(buffer)
    total = r.remaining
    header = _read_header(r, total)
    if verify:
        _check_sums(header, r, total)
    base = 8 + header.n
    view = r.view
    # _read_header checked every shape and that each tensor's bytes lie in the data section
    arrays = _views(view, base, header.entries)
    md = header.metadata
    if _TREE_KEY not in md:
        return Decoded(arrays, dict(md))
    _check_layout_version(header)
    meta = _user_meta(header, total)
    rebuilder = _Rebuilder(arrays, r)
    tree = rebuilder.build(header, total)
    unused = sorted(set(arrays) - rebuilder.used)
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
    return Info(format="safetensors", entries=entries, meta=_user_meta(header, source.size))


class _SlotRebuilder(_Rebuilder):
    """The tree of `slots`: `Slot` leaves, each checked as ``decode`` checks the array."""

    def leaf(self, node: dict[str, Any]) -> Any:
        slot, convert = self.resolve(node)  # slots, not arrays, in self.arrays
        return slot if convert is None else dataclasses.replace(slot, convert=convert)


def _item(arr: np.ndarray) -> Any:
    return arr[()]


def slots(source: ByteSource, *, verify: bool = False) -> Slots:
    """Where each tensor lies, from the header alone (8 + N bytes read); see `Slot`.

    ``verify``: each slot checks its tensor's bytes against the checksum
    pytreeio recorded when it is read (as ``decode(verify=True)`` does for
    all of them; files from other tools record none and are read unchecked).
    """
    n = source.reader(0, 8, "header length").u64("header length")
    _check_header_length(n, source.size, Reader(b"", source=source.name))
    r = Reader(source.read(0, 8 + n, "header"), source=source.name)
    header = _read_header(r, source.size)
    base = 8 + header.n
    found = {
        name: Slot(name, base + b, e - b, shape, dt)
        for name, (dt, shape, b, e) in header.entries.items()
    }
    sums = _recorded_sums(header, r, source.size) if verify else None
    if sums is not None:
        found = {
            k: dataclasses.replace(s, reader=_checked_reader(s, sums.get(k)))
            for k, s in found.items()
        }
    md = header.metadata
    if _TREE_KEY not in md:
        return Slots(found, dict(md))
    _check_layout_version(header)
    meta = _user_meta(header, source.size)
    rebuilder = _SlotRebuilder(found, r)  # type: ignore[arg-type]  # slots, not arrays
    tree = rebuilder.build(header, source.size)
    unused = sorted(set(found) - rebuilder.used)
    if unused:
        raise r.error(f"tensors not referenced by the tree structure: {unused[:5]}", _TREE_KEY, 8)
    return Slots(tree, meta)


def sniff(probe: Probe) -> float:
    """A plausible header length followed by ``{`` (plus a header key in view: a near-certain match)."""
    head = probe.head
    if not probe.is_file or len(head) < 9:
        return 0.0
    n = int.from_bytes(head[:8], "little")
    if not (0 < n <= min(probe.size - 8, MAX_HEADER_BYTES) and head[8:9] == b"{"):
        return 0.0
    body = head[8 : 8 + n]
    return MAGIC if b'"data_offsets"' in body or b'"__metadata__"' in body else STRUCTURE


FORMAT = register(
    Format(
        name="safetensors",
        description="safetensors file; the pytree structure and meta kept in __metadata__",
        suffixes=(".safetensors",),
        layout=FILE,
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=sniff,
        slots=slots,
        streams=True,
    )
)
