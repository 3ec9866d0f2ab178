"""Tiny Llama weight files (``weights.bin`` of the C++ Tiny Llama).

One file, no names: the records come in a fixed order that the header's config
determines completely.  All integers and floats are little-endian.

=======  ========================  =============================================
offset   field                     content
=======  ========================  =============================================
0        magic                     u32 ``0x544C4C4D``, i.e. the bytes ``MLLT``
4        version                   u32, 1
8        d_model (D)               i32 > 0
12       n_layers (L)              i32 > 0
16       n_heads (H)               i32 > 0, D % H == 0
20       ffn_hidden_dim (F)        i32 > 0
24       max_seq_len (S)           i32 > 0
28       vocab_size (V)            i32 > 0
32       dropout                   f32 (stored, unused by the model)
36       token embedding           matrix [V, D]
.        position embedding        matrix [S, D]
.        per layer l = 0..L-1:     Wq, Wk, Wv, Wo matrices [D, D];
                                   linear1 W matrix [D, F], linear1 bias vector
                                   [F]; linear2 W matrix [F, D], linear2 bias
                                   vector [D]; ln1 weight, ln1 bias, ln2 weight,
                                   ln2 bias vectors [D]
.        output projection         matrix [D, V]; then end of file
=======  ========================  =============================================

A matrix record is u64 rows, u64 cols, then rows*cols f32 in row-major order;
a vector record is u64 length, then length f32.  Every matrix is ``[in, out]``
(the model computes ``x @ W``).  The file size is therefore a function of the
header alone::

    36 + (16+4VD) + (16+4SD) + (16+4DV)
       + L * (4(16+4D²) + (16+4DF) + (8+4F) + (16+4FD) + (8+4D) + 4(8+4D))

The format author's document says the header is 24 bytes and the magic reads
"TLLM"; both are wrong (see FORMATS.md).  A file starting with "TLLM" was
written big-endian and is rejected with a hint saying so.

Native tree (``decode`` output, ``encode`` input)::

    {'tok_embedding': (V, D), 'pos_embedding': (S, D),
     'layers': [{'wq', 'wk', 'wv', 'wo': (D, D), 'w1': (D, F), 'b1': (F,),
                 'w2': (F, D), 'b2': (D,), 'ln1': {'scale', 'bias'},
                 'ln2': {'scale', 'bias'}: (D,)}, ...],
     'output': (D, V)}

meta = ``{'config': {d_model, n_layers, n_heads, ffn_hidden_dim, max_seq_len,
vocab_size, dropout}}``, ``dropout`` as the float32 stored (so it writes back
the same four bytes).  ``encode`` also accepts the Flax layout of
`pytreeio.models.tinyllama` (``layers_N`` keys, optional ``{'params':
...}``), and ``restore`` maps the native tree onto either layout.

Stricter than the original loader: every truncation is an error at the
offset where the file ends, ``d_model % n_heads`` must be 0, the file size
must equal the header's (checked before any record is read), and dropout
must be finite in [0, 1].  Each record costs a Python object, so the header
may imply at most ``(file size + 64 MiB) / RECORD_COST`` records (a small or
sparse file claiming millions of layers is refused from its header).  Layers
are numbered from 0 in messages.  Arrays must be float32 (``cast=True``
converts floating-point ones); streamed arrays are read, and cast, when written.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from pytreeio.core.binary import Buffer, ByteSource, Reader, Slot, Slots, Streamed, Writer
from pytreeio.core.errors import EncodeError, FormatError, MismatchError
from pytreeio.core.records import FILE, Decoded, Encoded, Entry, Format, Info, Probe
from pytreeio.core.records import MAGIC as MAGIC_SCORE
from pytreeio.core.tree import key_string
from pytreeio.formats.registry import register

__all__ = [
    "CONFIG_FIELDS",
    "FORMAT",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "RECORD_COST",
    "file_size",
    "record_count",
]

MAGIC = 0x544C4C4D
MAGIC_BYTES = b"MLLT"
_SWAPPED_MAGIC_BYTES = b"TLLM"
VERSION = 1
HEADER_SIZE = 36

#: The config fields in header order (all i32 except the trailing f32 dropout).
CONFIG_FIELDS: tuple[str, ...] = (
    "d_model",
    "n_layers",
    "n_heads",
    "ffn_hidden_dim",
    "max_seq_len",
    "vocab_size",
    "dropout",
)
_INT_FIELDS = CONFIG_FIELDS[:-1]
_I32_MAX = 2**31 - 1
#: Bytes of Python objects one record may cost (an array or an Entry, its dict slot, its name).
RECORD_COST = 512
#: Records any file may hold regardless of its size (64 MiB of them).
_RECORD_ALLOWANCE = 64 * 1024 * 1024
_RECORDS_PER_LAYER = 12

_LAYER_KEYS = ("wq", "wk", "wv", "wo", "w1", "b1", "w2", "b2", "ln1", "ln2")
_NORM_KEYS = ("scale", "bias")
_FLAX_LAYER = re.compile(r"layers_(0|[1-9][0-9]*)")


class _Record(NamedTuple):
    """One tensor record as the header says it must be."""

    field: str  # the name used in errors, e.g. "layer 1 Wq"
    path: tuple[str | int, ...]  # its key path in the native tree
    dims: tuple[int, ...]  # (rows, cols) for a matrix, (length,) for a vector
    offset: int  # absolute offset of the record's dims field

    @property
    def data_offset(self) -> int:
        return self.offset + 8 * len(self.dims)

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.dims)

    @property
    def end(self) -> int:
        return self.data_offset + self.nbytes


# -- the layout implied by a config -------------------------------------------


def _layer_layout(
    layer: int, d: int, f: int
) -> list[tuple[str, tuple[str | int, ...], tuple[int, ...]]]:
    p: tuple[str | int, ...] = ("layers", layer)
    name = f"layer {layer}"
    return [
        (f"{name} Wq", (*p, "wq"), (d, d)),
        (f"{name} Wk", (*p, "wk"), (d, d)),
        (f"{name} Wv", (*p, "wv"), (d, d)),
        (f"{name} Wo", (*p, "wo"), (d, d)),
        (f"{name} linear1 W", (*p, "w1"), (d, f)),
        (f"{name} linear1 bias", (*p, "b1"), (f,)),
        (f"{name} linear2 W", (*p, "w2"), (f, d)),
        (f"{name} linear2 bias", (*p, "b2"), (d,)),
        (f"{name} ln1 weight", (*p, "ln1", "scale"), (d,)),
        (f"{name} ln1 bias", (*p, "ln1", "bias"), (d,)),
        (f"{name} ln2 weight", (*p, "ln2", "scale"), (d,)),
        (f"{name} ln2 bias", (*p, "ln2", "bias"), (d,)),
    ]


def _records(cfg: Mapping[str, Any]) -> Iterator[_Record]:
    """The records in file order, lazily: a hostile n_layers costs nothing until iterated."""
    d, n_layers, f = cfg["d_model"], cfg["n_layers"], cfg["ffn_hidden_dim"]
    s, v = cfg["max_seq_len"], cfg["vocab_size"]
    offset = HEADER_SIZE

    def make(field: str, path: tuple[str | int, ...], dims: tuple[int, ...]) -> _Record:
        nonlocal offset
        rec = _Record(field, path, dims, offset)
        offset += 8 * len(dims) + 4 * math.prod(dims)  # rec.end, without three property calls
        return rec

    yield make("token embedding", ("tok_embedding",), (v, d))
    yield make("position embedding", ("pos_embedding",), (s, d))
    for layer in range(n_layers):
        for field, path, dims in _layer_layout(layer, d, f):
            yield make(field, path, dims)
    yield make("output projection", ("output",), (d, v))


def file_size(config: Mapping[str, Any]) -> int:
    """The exact size in bytes of a file with this config (computed, nothing allocated)."""
    d, n_layers, f = config["d_model"], config["n_layers"], config["ffn_hidden_dim"]
    s, v = config["max_seq_len"], config["vocab_size"]
    per_layer = 4 * (16 + 4 * d * d) + (16 + 4 * d * f) + (8 + 4 * f) + (16 + 4 * f * d)
    per_layer += (8 + 4 * d) + 4 * (8 + 4 * d)
    return (
        HEADER_SIZE + (16 + 4 * v * d) + (16 + 4 * s * d) + n_layers * per_layer + (16 + 4 * d * v)
    )


def record_count(config: Mapping[str, Any]) -> int:
    """The number of tensor records a file with this config holds."""
    return 3 + _RECORDS_PER_LAYER * config["n_layers"]


def _check_record_budget(cfg: Mapping[str, Any], size: int, source: str | None) -> None:
    """Refuse a header implying more records than the file pays for (see the module doc)."""
    n = record_count(cfg)
    if n * RECORD_COST > size + _RECORD_ALLOWANCE:
        raise FormatError(
            f"n_layers {cfg['n_layers']:,} implies {n:,} tensors; a file of {size:,} bytes may "
            f"hold at most {(size + _RECORD_ALLOWANCE) // RECORD_COST:,} (each costs about "
            f"{RECORD_COST} bytes of Python objects to load)",
            path=source,
            field="header.n_layers",
            offset=12,
        )


def _key_string(path: Sequence[str | int]) -> str:
    """The canonical key string (``layers/[1]/wq``) of a native-tree path."""
    return key_string([("[", p) if isinstance(p, int) else p for p in path])


# -- header ---------------------------------------------------------------------


def _f32(x: float) -> float:
    """``x`` rounded to float32, as the file stores it."""
    return float(np.float32(x))


def _read_header(r: Reader) -> dict[str, Any]:
    """Parse and validate the 36-byte header; returns the config."""
    if r.remaining >= 4 and bytes(r.view[r.pos : r.pos + 4]) == _SWAPPED_MAGIC_BYTES:
        raise r.error(
            "wrong magic: the file begins with 'TLLM', the byte-swapped (big-endian) magic; "
            "Tiny Llama files store the u32 0x544C4C4D little-endian and begin with 'MLLT'",
            "header.magic",
        )
    magic = r.u32("header.magic")
    if magic != MAGIC:
        raise r.error(
            f"wrong magic: expected 0x{MAGIC:08X} ('MLLT' on disk), found 0x{magic:08X} "
            f"({bytes(r.view[r.pos - 4 : r.pos])!r}); not a Tiny Llama weights file",
            "header.magic",
            r.offset - 4,
        )
    version = r.u32("header.version")
    if version != VERSION:
        raise r.error(
            f"unsupported version {version}; only version {VERSION} exists",
            "header.version",
            r.offset - 4,
        )
    cfg: dict[str, Any] = {}
    for name in _INT_FIELDS:
        value = r.i32(f"header.{name}")
        if value <= 0:
            raise r.error(
                f"{name} must be positive, found {value}",
                f"header.{name}",
                r.offset - 4,
            )
        cfg[name] = value
    dropout = r.f32("header.dropout")
    if not (0.0 <= dropout <= 1.0):  # also rejects NaN
        raise r.error(
            f"dropout must be a number in [0, 1], found {dropout}",
            "header.dropout",
            r.offset - 4,
        )
    cfg["dropout"] = dropout
    if cfg["d_model"] % cfg["n_heads"]:
        raise r.error(
            f"d_model {cfg['d_model']} is not divisible by n_heads {cfg['n_heads']}",
            "header.n_heads",
            16,
        )
    return cfg


def _check_expected(cfg: Mapping[str, Any], expected: Mapping[str, Any] | None) -> None:
    """Compare the file's config with the caller's, field by field (as the original loader)."""
    if expected is None:
        return
    if not isinstance(expected, Mapping):
        raise TypeError(f"expected_config must be a mapping, got {type(expected).__name__}")
    unknown = sorted(set(expected) - set(CONFIG_FIELDS))
    if unknown:
        raise MismatchError(
            f"unknown field(s) in expected_config: {', '.join(map(str, unknown))}",
            key_path="config",
            expected=list(CONFIG_FIELDS),
            found=unknown,
        )
    for name in CONFIG_FIELDS:
        if name not in expected:
            continue
        want = expected[name]
        if name == "dropout":
            same = _f32(want) == cfg[name]
        else:
            same = want == cfg[name]
        if not same:
            raise MismatchError(
                f"config {name} mismatch between the file and expected_config",
                key_path=f"config.{name}",
                expected=want,
                found=cfg[name],
            )


def _size_error(cfg: Mapping[str, Any], size: int, source: str | None) -> FormatError:
    """The error for a file whose size is not the one its header implies."""
    want = file_size(cfg)
    if size > want:
        return FormatError(
            f"{size - want} unexpected trailing bytes: the header implies a file of {want:,} "
            f"bytes, the file has {size:,}",
            path=source,
            field="end of file",
            offset=want,
        )
    for rec in _records(cfg):  # stops at the record holding the end of the file
        if size < rec.end:
            where = "dims" if size < rec.data_offset else "data"
            return FormatError(
                f"truncated: the file ends inside the {where} of {rec.field!r} "
                f"(record spans [{rec.offset}, {rec.end})); the header implies a file of "
                f"{want:,} bytes, the file has {size:,}",
                path=source,
                field=rec.field,
                offset=size,
            )
    raise AssertionError("unreachable: size < file_size but no record holds the end")


def _read_dims(r: Reader, rec: _Record) -> None:
    found = tuple(r.u64(rec.field) for _ in rec.dims)
    if found != rec.dims:
        kind = "matrix" if len(rec.dims) == 2 else "vector"
        raise r.error(
            f"{rec.field} {kind} dims mismatch: expected {list(rec.dims)}, found {list(found)}",
            rec.field,
            rec.offset,
        )


# -- decode / inspect -----------------------------------------------------------


def _set(tree: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    node: Any = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _empty_tree(n_layers: int) -> dict[str, Any]:
    layers: list[dict[str, Any]] = [{"ln1": {}, "ln2": {}} for _ in range(n_layers)]
    return {
        "tok_embedding": None,
        "pos_embedding": None,
        "layers": layers,
        "output": None,
    }


def decode(
    buffer: Buffer,
    *,
    expected_config: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> Decoded:
    """The native tree of a whole weights file (float32 views of ``buffer``); a field of
    ``expected_config`` (some of `CONFIG_FIELDS`) the file differs in is a `MismatchError`."""
    r = Reader(buffer, source=source)
    cfg = _read_header(r)
    _check_expected(cfg, expected_config)
    size = len(r.view)
    if size != file_size(cfg):
        # Before blaming the size, name the first record whose dims disagree with
        # the header: that is usually the real cause of a size difference.  Each
        # record spans at least 12 bytes, so this loop is bounded by the size.
        for rec in _records(cfg):
            if rec.data_offset > size:
                break
            r.pos = rec.offset
            _read_dims(r, rec)
        raise _size_error(cfg, size, source)
    _check_record_budget(cfg, size, source)
    tree = _empty_tree(cfg["n_layers"])
    # The size matches the header, so every record lies inside the file: its data is a view.
    for rec in _records(cfg):
        r.pos = rec.offset
        _read_dims(r, rec)
        _set(tree, rec.path, np.ndarray(rec.dims, _F32, buffer=r.view, offset=rec.data_offset))
    return Decoded(tree, {"config": cfg})


_F32 = np.dtype("<f4")


def inspect(source: ByteSource) -> Info:
    """Report config and every record from the 36-byte header and the file size alone."""
    head = source.reader(0, min(HEADER_SIZE, source.size), "header")
    cfg = _read_header(head)
    if source.size != file_size(cfg):
        raise _size_error(cfg, source.size, source.name)
    _check_record_budget(cfg, source.size, source.name)
    entries = tuple(
        Entry(_key_string(rec.path), rec.dims, "float32", rec.nbytes) for rec in _records(cfg)
    )
    return Info(format=FORMAT_NAME, entries=entries, meta={"config": cfg}, path=source.name)


def _record_reader(rec: _Record) -> Callable[[ByteSource], np.ndarray]:
    """Read one record (its dims fields checked as ``decode`` checks them, then its data)."""

    def read(src: ByteSource) -> np.ndarray:
        r = src.reader(rec.offset, rec.end - rec.offset, rec.field)
        _read_dims(r, rec)
        return r.array("<f4", rec.dims, rec.field)

    return read


def slots(source: ByteSource, *, expected_config: Mapping[str, Any] | None = None) -> Slots:
    """Where each record lies, computed from the 36-byte header and the file size."""
    head = source.reader(0, min(HEADER_SIZE, source.size), "header")
    cfg = _read_header(head)
    _check_expected(cfg, expected_config)
    if source.size != file_size(cfg):
        # As decode: name the first record whose dims disagree (only their dims are read).
        for rec in _records(cfg):
            if rec.data_offset > source.size:
                break
            _read_dims(source.reader(rec.offset, 8 * len(rec.dims), rec.field), rec)
        raise _size_error(cfg, source.size, source.name)
    _check_record_budget(cfg, source.size, source.name)
    tree = _empty_tree(cfg["n_layers"])
    for rec in _records(cfg):
        slot = Slot(
            _key_string(rec.path),
            rec.data_offset,
            rec.nbytes,
            rec.dims,
            _F32,
            reader=_record_reader(rec),
        )
        _set(tree, rec.path, slot)
    return Slots(tree, {"config": cfg})


def sniff(probe: Probe) -> float:
    """The magic number (the byte-swapped one too, so that decode's hint is reached)."""
    if probe.is_file and probe.head[:4] in (MAGIC_BYTES, _SWAPPED_MAGIC_BYTES):
        return MAGIC_SCORE
    return 0.0


# -- encode ---------------------------------------------------------------------


def _refuse(
    path: Sequence[str | int], reason: str, expected: Any = None, found: Any = None
) -> EncodeError:
    """The tree or meta cannot be written as a Tiny Llama file."""
    if expected is not None or found is not None:
        reason = f"{reason} (expected {expected}, found {found})"
    return EncodeError(reason, key_path=_key_string(path))


def _unwrap_params(tree: Any) -> Any:
    """Accept Flax variables ``{'params': {...}}`` as well as the bare tree."""
    if isinstance(tree, Mapping) and "params" in tree and "tok_embedding" not in tree:
        extra = sorted(str(k) for k in tree if k != "params")
        if extra:
            raise _refuse(
                (),
                "only the 'params' collection can be stored in a Tiny Llama file",
                "params",
                extra,
            )
        return tree["params"]
    return tree


def _layers_of(tree: Mapping[str, Any]) -> tuple[list[Any], set[str]]:
    """The layer subtrees in order, from a ``layers`` list (or '0','1',... dict) or ``layers_N`` keys."""
    flax_keys = {str(k): k for k in tree if _FLAX_LAYER.fullmatch(str(k))}
    if "layers" in tree:
        if flax_keys:
            raise _refuse(
                ("layers",),
                "both 'layers' and 'layers_N' keys present",
                "one of them",
                sorted(flax_keys),
            )
        layers = tree["layers"]
        if isinstance(layers, Mapping):
            # A list that went through a dict-only format (msgpack) comes back keyed '0', '1', ...
            keys = sorted(layers, key=lambda k: int(k) if str(k).isdigit() else -1)
            if [str(k) for k in keys] != [str(i) for i in range(len(keys))]:
                raise _refuse(
                    ("layers",),
                    "layer keys must be 0..n-1",
                    list(range(len(keys))),
                    keys,
                )
            return [layers[k] for k in keys], {"layers"}
        if isinstance(layers, Sequence) and not isinstance(layers, (str, bytes)):
            return list(layers), {"layers"}
        raise _refuse(
            ("layers",),
            "'layers' must be a list of layer dicts",
            "list",
            type(layers).__name__,
        )
    indices = sorted(int(k[len("layers_") :]) for k in flax_keys)
    if indices != list(range(len(indices))):
        raise _refuse(("layers",), "layers_N keys must be layers_0..layers_{n-1}", None, indices)
    return [tree[flax_keys[f"layers_{i}"]] for i in indices], set(flax_keys)


def _float32(leaf: Any, path: Sequence[str | int], cast: bool) -> np.ndarray | Streamed:
    """The leaf as float32: an array, or a streaming conversion's array read when written."""
    if leaf is None:
        raise _refuse(path, "missing array", "float32 array", None)
    streamed = isinstance(leaf, Streamed)
    arr = leaf if streamed else np.asarray(leaf)
    if arr.dtype.kind == "f" and arr.dtype.itemsize == 4:
        return arr
    # ml_dtypes' bfloat16 and float8 types are floating point without numpy's kind "f".
    floating = arr.dtype.kind == "f" or arr.dtype.name.startswith(("bfloat16", "float8"))
    if cast and floating:
        return arr.astype(np.float32)  # a streamed array's cast is made when it is read
    hint = "; pass cast=True to convert it to float32" if floating else ""
    raise _refuse(path, f"Tiny Llama stores float32 only{hint}", "float32", str(arr.dtype))


def _get(node: Any, key: str, path: Sequence[str | int]) -> Any:
    if not isinstance(node, Mapping):
        raise _refuse(path, "expected a dict", "dict", type(node).__name__)
    if key not in node:
        raise _refuse((*path, key), "missing entry", key, None)
    return node[key]


def _check_keys(node: Mapping[str, Any], allowed: Sequence[str], path: Sequence[str | int]) -> None:
    extra = sorted(str(k) for k in node if k not in allowed)
    if extra:
        raise _refuse(path, "entries that a Tiny Llama file cannot hold", sorted(allowed), extra)


def _config_for(
    tree: Mapping[str, Any],
    layers: list[Any],
    meta: Mapping[str, Any] | None,
    cast: bool,
) -> dict[str, Any]:
    """The header config: inferred from shapes where possible, the rest from ``meta``."""
    given: Mapping[str, Any] = {}
    if meta is not None:
        if not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a mapping, got {type(meta).__name__}")
        extra = sorted(str(k) for k in meta if k != "config")
        if extra:
            raise _refuse(("meta",), "unknown meta keys for tinyllama", ["config"], extra)
        given = meta.get("config") or {}
        if not isinstance(given, Mapping):
            raise TypeError(f"meta['config'] must be a mapping, got {type(given).__name__}")
        unknown = sorted(str(k) for k in given if k not in CONFIG_FIELDS)
        if unknown:
            raise _refuse(
                ("meta", "config"),
                "unknown config fields",
                list(CONFIG_FIELDS),
                unknown,
            )

    tok = _float32(_get(tree, "tok_embedding", ()), ("tok_embedding",), cast)
    pos = _float32(_get(tree, "pos_embedding", ()), ("pos_embedding",), cast)
    if tok.ndim != 2:
        raise _refuse(("tok_embedding",), "must be a [vocab, d_model] matrix", "2 dims", tok.shape)
    if pos.ndim != 2:
        raise _refuse(
            ("pos_embedding",),
            "must be a [max_seq_len, d_model] matrix",
            "2 dims",
            pos.shape,
        )
    if not layers:
        raise _refuse(("layers",), "a Tiny Llama model needs at least one layer", ">= 1", 0)
    w1 = _float32(_get(layers[0], "w1", ("layers", 0)), ("layers", 0, "w1"), cast)
    if w1.ndim != 2:
        raise _refuse(
            ("layers", 0, "w1"),
            "must be a [d_model, ffn_hidden_dim] matrix",
            "2 dims",
            w1.shape,
        )
    inferred = {
        "d_model": int(tok.shape[1]),
        "n_layers": len(layers),
        "ffn_hidden_dim": int(w1.shape[1]),
        "max_seq_len": int(pos.shape[0]),
        "vocab_size": int(tok.shape[0]),
    }
    cfg: dict[str, Any] = {}
    for name in CONFIG_FIELDS:
        if name in inferred:
            value = inferred[name]
            if name in given and given[name] != value:
                raise MismatchError(
                    f"meta config {name} disagrees with the array shapes",
                    key_path=_key_string(("meta", "config", name)),
                    expected=value,
                    found=given[name],
                )
        elif name in given and given[name] is not None:
            value = given[name]
        else:
            raise _refuse(
                ("meta", "config", name),
                f"missing required config field {name!r} (it cannot be inferred from the arrays); "
                f"pass meta={{'config': {{'{name}': ...}}}}",
            )
        cfg[name] = value

    for name in _INT_FIELDS:
        value = cfg[name]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise _refuse(
                ("meta", "config", name),
                f"{name} must be an int",
                "int",
                type(value).__name__,
            )
        if not 0 < int(value) <= _I32_MAX:
            raise _refuse(
                ("meta", "config", name),
                f"{name} must be in [1, 2**31-1]",
                "positive i32",
                value,
            )
        cfg[name] = int(value)
    if cfg["d_model"] % cfg["n_heads"]:
        raise _refuse(
            ("meta", "config", "n_heads"),
            f"d_model {cfg['d_model']} is not divisible by n_heads {cfg['n_heads']}",
            f"a divisor of {cfg['d_model']}",
            cfg["n_heads"],
        )
    dropout = cfg["dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.floating, np.integer)):
        raise _refuse(
            ("meta", "config", "dropout"),
            "dropout must be a number",
            "float",
            type(dropout).__name__,
        )
    if not 0.0 <= float(dropout) <= 1.0:
        raise _refuse(
            ("meta", "config", "dropout"),
            "dropout must be in [0, 1]",
            "[0, 1]",
            dropout,
        )
    cfg["dropout"] = _f32(float(dropout))
    return cfg


def encode(
    tree: Any,
    *,
    meta: Mapping[str, Any] | None = None,
    cast: bool = False,
) -> Encoded:
    """A native (or Flax-layout) tree's file, float32 arrays referenced; ``meta['config']`` needs
    ``n_heads`` and ``dropout`` (the rest, inferred from the shapes, must agree if given)."""
    tree = _unwrap_params(tree)
    if not isinstance(tree, Mapping):
        raise _refuse((), "a Tiny Llama tree must be a dict", "dict", type(tree).__name__)
    layers, layer_keys = _layers_of(tree)
    _check_keys(tree, ["tok_embedding", "pos_embedding", "output", *sorted(layer_keys)], ())
    cfg = _config_for(tree, layers, meta, cast)

    for i, layer in enumerate(layers):
        if not isinstance(layer, Mapping):
            raise _refuse(("layers", i), "expected a dict", "dict", type(layer).__name__)
        _check_keys(layer, _LAYER_KEYS, ("layers", i))
        for norm in ("ln1", "ln2"):
            sub = _get(layer, norm, ("layers", i))
            if not isinstance(sub, Mapping):
                raise _refuse(("layers", i, norm), "expected a dict", "dict", type(sub).__name__)
            _check_keys(sub, _NORM_KEYS, ("layers", i, norm))

    w = Writer()
    w.u32(MAGIC)
    w.u32(VERSION)
    for name in _INT_FIELDS:
        w.i32(cfg[name])
    w.f32(cfg["dropout"])
    root = {k: v for k, v in tree.items() if k not in layer_keys}
    root["layers"] = layers
    for rec in _records(cfg):
        node: Any = root
        for depth, key in enumerate(rec.path):
            if isinstance(key, int) or (type(node) is dict and key in node):
                node = node[key]  # the common case, without building the path for errors
            else:
                node = _get(node, key, rec.path[:depth])
        arr = _float32(node, rec.path, cast)
        if arr.shape != rec.dims:
            raise _refuse(rec.path, f"wrong shape for {rec.field}", rec.dims, arr.shape)
        for dim in rec.dims:
            w.u64(dim)
        if isinstance(arr, Streamed):
            for c in arr.chunks():
                w.deferred(c)
        else:
            w.array(arr)
    return Encoded(chunks=tuple(w.finish()))


# -- restore --------------------------------------------------------------------


def restore(native: Any, meta: Mapping[str, Any], like: Any) -> Any:
    """Map the native tree onto ``like``: the native layout or the Flax one, with or
    without a ``{'params': ...}`` wrapper.  Shapes and dtypes are checked by
    `pytreeio.core.tree.restore`."""
    from pytreeio.core.tree import restore as restore_tree

    inner = like
    wrapped = isinstance(like, Mapping) and "params" in like and "tok_embedding" not in like
    if wrapped:
        inner = like["params"]
    source = native
    if (
        isinstance(inner, Mapping)
        and "layers" not in inner
        and any(_FLAX_LAYER.fullmatch(str(k)) for k in inner)
    ):
        layers = native.get("layers") if isinstance(native, Mapping) else None
        if isinstance(layers, list):
            source = {k: v for k, v in native.items() if k != "layers"}
            for i, layer in enumerate(layers):
                source[f"layers_{i}"] = layer
    if wrapped:
        return restore_tree({"params": source}, like)
    return restore_tree(source, like)


FORMAT_NAME = "tinyllama"

FORMAT = register(
    Format(
        name=FORMAT_NAME,
        description="Tiny Llama weights.bin (C++): 36-byte MLLT header + f32 records",
        suffixes=(),
        layout=FILE,
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=sniff,
        restore=restore,
        slots=slots,
        streams=True,
    )
)
