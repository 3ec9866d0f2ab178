"""bullet checkpoints (the chess NNUE trainer): raw and quantised networks, optimiser state.

A checkpoint is a directory; no file carries a magic number, version or
header, and all numbers are little-endian::

    <dir>/raw.bin                      f32 values of the saved-format entries, in list order,
                                       untransformed, no header, no padding
    <dir>/quantised.bin                every entry transformed and quantised on its own,
                                       concatenated in list order, then padded to a
                                       multiple of 64 bytes
    <dir>/optimiser_state/weights.bin  tagged records of every trainable tensor
    <dir>/optimiser_state/momentum.bin tagged records (AdamW, RAdam, Ranger)
    <dir>/optimiser_state/velocity.bin tagged records
    <dir>/optimiser_state/step.txt     lines ``id,step`` (RAdam, Ranger; AdamW ignores it)
    <dir>/optimiser_state/slow.bin     tagged records (Ranger's lookahead), when present
    <dir>/log.txt                      lines ``superbatch,batch,loss``, no header row

Tagged record (records are matched by id, never by position; pytreeio writes
them sorted by id, as current bullet does)::

    id       ASCII bytes, no newline (pytreeio: printable, at most 1024 bytes)
    0x0A
    count    u64
    values   count x f32

The older variant wrote ``rows u64, cols u64`` instead of ``count`` (``rows
x cols`` values); it is read, never written.  A file is all one variant.

Tensors: an affine layer ``l{k}`` has weight ``l{k}w``, an ``out x in``
matrix stored column-major (element ``(r, c)`` at ``c*rows + r``), and bias
``l{k}b`` (``out``).  As a numpy array the weight is ``(in, out)`` in C
order: the same bytes, and the orientation of a Flax ``Dense`` kernel.
Records hold no shapes, so :func:`decode` infers them: ``l{k}b`` is 1-D,
``l{k}w`` is ``(count/out, out)`` with ``out`` the size of ``l{k}b``; other
tensors are 1-D unless the old variant gave rows and cols or ``shapes=``
names them.

Worked example, (768->128)x2->1, every entry i16, rounded, QA=255, QB=64
(:func:`classic_layout` ``([255, 64])``): 98,689 parameters; ``raw.bin``
394,756 B; ``quantised.bin`` 197,378 B of data + 62 B of padding
(``b"bulletbullet...bu"``) = 197,440 B, with ``l0w`` at [0, 196608), ``l0b``
[196608, 196864), ``l1w`` [196864, 197376), ``l1b`` (scale 255*64 = 16320)
[197376, 197378); ``weights.bin`` 394,804 B.

Saved format
------------
``meta["saved_format"]`` lists the entries of ``raw.bin``/``quantised.bin``
in file order, as data::

    {"id": "l0w", "transforms": [], "type": "i16", "scale": 255, "round": true}

``type`` is ``f32``, ``i8``, ``i16`` or ``i32``; ``scale`` an integer that
fits bullet's multiplier (i16 for i8/i16 targets, i32 for i32), absent for
``f32``; ``round`` (default false) rounds half away from zero instead of
truncating; ``transforms`` (default ``[]``) is applied in order to the
``(in, out)`` array before quantisation: ``"transpose"`` (row-major ``out x
in``; each output bucket contiguous) or a name given to
:func:`register_transform`.  :func:`classic_layout` and
:func:`output_bucket_layout` build the usual lists; without a list every
tensor is an ``f32`` entry in model order (:func:`float_layout`).

bullet keeps no description of the layout on disk, so ``decode`` checks
``raw.bin`` and ``quantised.bin`` (sizes, offsets, padding: bullet's pattern
or, from files written before 2024-03, zeros) only when ``saved_format=`` is
passed; ``check_quantised=True`` also dequantises ``quantised.bin`` and puts
the largest error against ``raw.bin`` per entry into
``meta["quantisation_error"]`` (:func:`verify_quantised`).

When quantisation fails (a value does not fit, or is NaN/inf) ``encode``
returns the other files without ``quantised.bin`` and the
:class:`~pytreeio.core.errors.QuantisationError` in ``Encoded.deferred``: the save
writes the directory (an older ``quantised.bin`` goes with the old directory)
and then warns, or raises with ``strict=True``.

Native tree and meta
--------------------
``{'weights': {id: f32 array}, 'momentum': {...}, 'velocity': {...}}`` (+
``'slow'``; the optimiser entries only when their files exist); ``meta``:
``saved_format`` (when given), ``steps`` ``{id: step}`` (step.txt), ``log``
(the text of log.txt).  Models: ``l{k}w``/``l{k}b`` are the kernel and bias
of Linear layer ``k``; an optax ``adam``/``adamw`` state maps ``mu`` to
``momentum.bin`` and ``nu`` to ``velocity.bin`` by id, its ``count`` to
every line of ``step.txt``.
"""

from __future__ import annotations

import contextlib
import math
import re
import struct
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytreeio.core import quant
from pytreeio.core.binary import (
    BadUtf8,
    BufferSource,
    ByteSource,
    Deferred,
    Slot,
    Slots,
    Streamed,
    Writer,
    as_memoryview,
    check_shape,
    utf8_text,
)
from pytreeio.core.errors import (
    ConversionError,
    EncodeError,
    FormatError,
    MismatchError,
    PytreeioWarning,
    QuantisationError,
)
from pytreeio.core.records import (
    DIRECTORY,
    REPORT,
    STRUCTURE,
    Decoded,
    Encoded,
    Entry,
    Format,
    Info,
)
from pytreeio.formats.registry import register
from pytreeio.model.form import Layer, Model

__all__ = [
    "FORMAT",
    "TYPES",
    "TRANSFORMS",
    "register_transform",
    "validate_saved_format",
    "classic_layout",
    "output_bucket_layout",
    "float_layout",
    "model_order",
    "padding",
    "encode",
    "decode",
    "inspect",
    "slots",
    "sniff",
    "to_model",
    "from_model",
    "raw_tensors",
    "quantised_tensors",
    "verify_quantised",
]

RAW = "raw.bin"
QUANTISED = "quantised.bin"
WEIGHTS = "optimiser_state/weights.bin"
MOMENTUM = "optimiser_state/momentum.bin"
VELOCITY = "optimiser_state/velocity.bin"
SLOW = "optimiser_state/slow.bin"
STEP = "optimiser_state/step.txt"
LOG = "log.txt"
FORMAT_NAME = "bullet"

#: Native tree keys and the record files that hold them.
_RECORD_FILES = {"weights": WEIGHTS, "momentum": MOMENTUM, "velocity": VELOCITY, "slow": SLOW}

PAD_PATTERN = b"bullet"
ALIGN = 64
MAX_ID_BYTES = 1024
_ID_PROBE = 32

#: Saved-format types and their little-endian dtypes.
TYPES: dict[str, np.dtype[Any]] = {"f32": np.dtype("<f4"), **quant.INT_TYPES}
#: The largest scale bullet's multiplier holds per target (QuantTarget::I8/I16 take an i16).
_SCALE_MAX = {"i8": 2**15 - 1, "i16": 2**15 - 1, "i32": 2**31 - 1}
_ENTRY_KEYS = frozenset({"id", "transforms", "type", "scale", "round"})
_LAYER_ID = re.compile(r"\Al(0|[1-9][0-9]{0,5})([wb])\Z")
_F32 = np.dtype("<f4")
_U64 = struct.Struct("<Q")


# --------------------------------------------------------------------------
# transforms
# --------------------------------------------------------------------------

#: A transform: ``fn(array, tensors) -> array`` with as many float32 elements.
Transform = Callable[[np.ndarray, Mapping[str, np.ndarray]], Any]


def _transpose(array: np.ndarray, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    # A vector is an out x 1 matrix: transposing it leaves its bytes as they are.
    if array.ndim != 2:
        return array
    return array.transpose(1, 0) if isinstance(array, Streamed) else quant.transpose(array, (1, 0))


#: Transforms by name; ``"transpose"`` is built in.
TRANSFORMS: dict[str, Transform] = {"transpose": _transpose}


def register_transform(name: str, fn: Transform, *, replace: bool = False) -> None:
    """Make ``fn`` usable as ``"transforms": [name]`` in saved-format entries.

    ``fn(array, tensors)`` receives the entry's current array (the ``(in,
    out)`` weight, or what earlier transforms made of it) and every tensor of
    the checkpoint by id (read-only; bullet's transforms merge tensors, e.g.
    a factoriser into ``l0w``), and returns a float32 array with the same
    number of elements (so that ``quantised.bin``'s size follows from the
    tensors alone).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a transform name must be a non-empty string, found {name!r}")
    if not callable(fn):
        raise TypeError(f"transform {name!r} must be callable")
    if name in TRANSFORMS and not replace:
        raise ValueError(f"a transform named {name!r} is already registered")
    TRANSFORMS[name] = fn


# --------------------------------------------------------------------------
# saved-format entries
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """A validated saved-format entry."""

    id: str
    transforms: tuple[str, ...]
    type: str
    scale: int | None
    round: bool

    @property
    def itemsize(self) -> int:
        return TYPES[self.type].itemsize

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "transforms": list(self.transforms),
            "type": self.type,
        }
        if self.scale is not None:
            out["scale"] = self.scale
        out["round"] = self.round
        return out


def _entry_error(i: int, entry_id: Any, field: str | None, reason: str, **kw: Any) -> MismatchError:
    who = f"saved_format[{i}]" + (f" ({entry_id})" if isinstance(entry_id, str) else "")
    return MismatchError(
        f"{who}: {reason}", key_path=f"saved_format[{i}]" + (f".{field}" if field else ""), **kw
    )


def _is_int(v: Any) -> bool:
    return type(v) is int or (
        isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)
    )


def _spec_of(i: int, entry: Any) -> _Spec:
    if type(entry) is not dict and not isinstance(entry, Mapping):
        raise _entry_error(i, None, None, "an entry must be a dict", found=type(entry).__name__)
    eid = entry.get("id")
    if not entry.keys() <= _ENTRY_KEYS:
        unknown = sorted(str(k) for k in entry if k not in _ENTRY_KEYS)
        raise _entry_error(i, eid, None, f"unknown keys {unknown}", expected=sorted(_ENTRY_KEYS))
    if not isinstance(eid, str) or not _valid_id(eid):
        raise _entry_error(
            i, None, "id", "the id must be a non-empty printable ASCII string", found=eid
        )
    ttype = entry.get("type")
    if not isinstance(ttype, str) or ttype not in TYPES:
        raise _entry_error(
            i, eid, "type", f"unknown type {ttype!r}", expected=sorted(TYPES), found=ttype
        )
    transforms = entry.get("transforms", [])
    if type(transforms) is not list and (
        isinstance(transforms, str) or not isinstance(transforms, Sequence)
    ):
        raise _entry_error(
            i, eid, "transforms", "transforms must be a list of names", found=transforms
        )
    for t in transforms:
        if not isinstance(t, str) or t not in TRANSFORMS:
            raise _entry_error(
                i,
                eid,
                "transforms",
                f"unknown transform {t!r}",
                expected=sorted(TRANSFORMS),
                found=t,
            )
    rnd = entry.get("round", False)
    if not isinstance(rnd, bool):
        raise _entry_error(i, eid, "round", "round must be true or false", found=rnd)
    scale = entry.get("scale")
    if ttype == "f32":
        if scale is not None:
            raise _entry_error(i, eid, "scale", "an f32 entry has no scale", found=scale)
        if rnd:
            raise _entry_error(i, eid, "round", "an f32 entry is not rounded", found=rnd)
    else:
        if scale is None:
            raise _entry_error(i, eid, "scale", f"an {ttype} entry needs an integer scale")
        if not _is_int(scale) or not 1 <= int(scale) <= _SCALE_MAX[ttype]:
            raise _entry_error(
                i,
                eid,
                "scale",
                f"the scale of an {ttype} entry must be an integer in [1, {_SCALE_MAX[ttype]}]",
                found=scale,
            )
        scale = int(scale)
    return _Spec(eid, tuple(transforms), ttype, scale, rnd)


def _specs(saved_format: Any, ids: Iterable[str] | None = None) -> list[_Spec]:
    if isinstance(saved_format, str | bytes | Mapping) or not isinstance(saved_format, Sequence):
        raise MismatchError(
            "saved_format must be a list of entries",
            key_path="saved_format",
            found=type(saved_format).__name__,
        )
    specs = [_spec_of(i, e) for i, e in enumerate(saved_format)]
    seen: dict[str, int] = {}
    for i, s in enumerate(specs):
        if s.id in seen:
            where = f"also saved_format[{seen[s.id]}]"
            raise _entry_error(i, s.id, "id", f"id listed twice ({where})")
        seen[s.id] = i
    if ids is not None:
        known = ids if isinstance(ids, Mapping | set | frozenset) else set(ids)
        for i, s in enumerate(specs):
            if s.id not in known:
                raise _entry_error(
                    i,
                    s.id,
                    "id",
                    f"unknown id {s.id!r}: the checkpoint has no such tensor",
                    expected=sorted(known)[:20],
                    found=s.id,
                )
    return specs


def validate_saved_format(
    saved_format: Any, ids: Iterable[str] | None = None
) -> list[dict[str, Any]]:
    """The normalised entries of ``saved_format`` (defaults filled in), checked.

    With ``ids``, every entry's id must be one of them.  Raises
    :class:`~pytreeio.core.errors.MismatchError` naming the entry (its index and id)
    and the field: unknown keys, types, transforms, a missing or
    out-of-range scale, a scale or rounding on an ``f32`` entry, duplicate or
    unknown ids.
    """
    return [s.to_json() for s in _specs(saved_format, ids)]


def _layer_types(types: Any, n: int) -> list[tuple[str, str]]:
    if isinstance(types, str):
        return [(types, types)] * n
    if isinstance(types, Sequence) and len(types) == n:
        out = []
        for t in types:
            if isinstance(t, str):
                out.append((t, t))
            elif isinstance(t, Sequence) and len(t) == 2 and all(isinstance(x, str) for x in t):
                out.append((t[0], t[1]))
            else:
                raise MismatchError(
                    "types: each layer's entry is a type or a (weight type, bias type) pair",
                    key_path="types",
                    found=t,
                )
        return out
    raise MismatchError(
        f"types must be a type name or one entry per layer ({n})", key_path="types", found=types
    )


def _layout_entry(
    eid: str, ttype: str, scale: int, rnd: bool, transforms: list[str]
) -> dict[str, Any]:
    if ttype not in TYPES:
        raise MismatchError(f"{eid}: unknown type {ttype!r}", key_path=eid, expected=sorted(TYPES))
    if ttype == "f32":
        return {"id": eid, "transforms": transforms, "type": "f32", "round": False}
    if scale > _SCALE_MAX[ttype]:
        raise MismatchError(
            f"{eid}: scale {scale} overflows bullet's {ttype} multiplier (at most {_SCALE_MAX[ttype]})",
            key_path=eid,
            expected=f"<= {_SCALE_MAX[ttype]}",
            found=scale,
        )
    return {"id": eid, "transforms": transforms, "type": ttype, "scale": scale, "round": rnd}


def classic_layout(
    scales: Sequence[int],
    *,
    types: str | Sequence[str | tuple[str, str]] = "i16",
    round: bool = True,
    transposed: Iterable[int] = (),
) -> list[dict[str, Any]]:
    """bullet's classic layout: ``l{k}w`` at ``scales[k]``, ``l{k}b`` at ``scales[0]*...*scales[k]``.

    ``scales`` has one integer per affine layer (``[QA, QB]`` for the usual
    two-layer net); a bias is added after the layer's matrix product, so its
    scale is the running product.  ``types`` is one type for every entry, or
    per layer a type or a ``(weight type, bias type)`` pair (``f32`` entries
    get no scale, but the running product goes on).  ``transposed`` lists
    layers whose weight gets ``"transpose"``.  A scale (or running product)
    that overflows bullet's multiplier for its type is an error naming the
    entry.
    """
    if isinstance(scales, str | bytes) or not isinstance(scales, Sequence) or not scales:
        raise MismatchError(
            "scales must be a non-empty list of integers", key_path="scales", found=scales
        )
    for k, q in enumerate(scales):
        if not _is_int(q) or int(q) < 1:
            raise MismatchError(
                f"scales[{k}] must be a positive integer", key_path=f"scales[{k}]", found=q
            )
    per_layer = _layer_types(types, len(scales))
    flip = {int(k) for k in transposed}
    bad = sorted(k for k in flip if not 0 <= k < len(scales))
    if bad:
        raise MismatchError(
            f"transposed names layers {bad} of {len(scales)}", key_path="transposed"
        )
    out: list[dict[str, Any]] = []
    product = 1
    for k, q in enumerate(scales):
        product *= int(q)
        wtype, btype = per_layer[k]
        out.append(
            _layout_entry(f"l{k}w", wtype, int(q), round, ["transpose"] if k in flip else [])
        )
        out.append(_layout_entry(f"l{k}b", btype, product, round, []))
    return out


def output_bucket_layout(
    scales: Sequence[int],
    *,
    bucketed: int | Iterable[int] | None = None,
    types: str | Sequence[str | tuple[str, str]] = "i16",
    round: bool = True,
) -> list[dict[str, Any]]:
    """:func:`classic_layout` with the bucketed layers' weights transposed (default: the last layer).

    A layer of ``N`` buckets of ``out`` outputs is an affine layer of
    ``N*out`` outputs; bullet's column-major matrix interleaves the buckets,
    and ``"transpose"`` writes it row-major, ``[bucket][out][in]``, so that
    each bucket's weights are contiguous.  Biases are bucket-contiguous
    already.
    """
    if bucketed is None:
        layers: Iterable[int] = (len(scales) - 1,)
    elif isinstance(bucketed, int):
        layers = (bucketed,)
    else:
        layers = bucketed
    return classic_layout(scales, types=types, round=round, transposed=layers)


def model_order(ids: Iterable[str]) -> list[str]:
    """``ids`` in model order: ``l0w, l0b, l1w, l1b, ...`` by layer number, then the others as given."""
    ids = list(ids)
    layered = []
    others = []
    for i in ids:
        m = _LAYER_ID.match(i)
        if m:
            layered.append((int(m.group(1)), m.group(2) == "b", i))
        else:
            others.append(i)
    return [i for _, _, i in sorted(layered)] + others


def float_layout(ids: Iterable[str]) -> list[dict[str, Any]]:
    """Every tensor as an untransformed ``f32`` entry, in :func:`model_order`."""
    return [{"id": i, "transforms": [], "type": "f32", "round": False} for i in model_order(ids)]


def _float_specs(ids: Iterable[str]) -> list[_Spec]:
    """:func:`float_layout` as validated entries (``ids`` already checked)."""
    return [_Spec(i, (), "f32", None, False) for i in model_order(ids)]


def padding(n: int) -> bytes:
    """The bytes bullet appends to ``n`` bytes of quantised data: up to a multiple of 64, ``b"bullet"`` repeated."""
    k = -n % ALIGN
    return (PAD_PATTERN * (k // len(PAD_PATTERN) + 1))[:k]


# --------------------------------------------------------------------------
# ids and tagged records
# --------------------------------------------------------------------------


def _valid_id(s: str) -> bool:
    # str.isprintable() of ASCII text is exactly " " to "~"
    return 0 < len(s) <= MAX_ID_BYTES and s.isascii() and s.isprintable()


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 3x
class _Record:
    id: str
    count: int
    dims: tuple[int, int] | None  # (rows, cols) of the old variant
    offset: int  # of the first value


def _read_id(src: ByteSource, pos: int, file: str) -> tuple[str, int]:
    """The id starting at ``pos`` and the offset after its newline."""
    # Ids are short: a small first read keeps a header walk from reading much of the
    # data that follows; only a long id needs the bounded second one.
    n = min(_ID_PROBE, src.size - pos)
    head = bytes(src.read(pos, n, "record id"))
    end = head.find(b"\n")
    if end < 0 and n < min(MAX_ID_BYTES + 1, src.size - pos):
        n = min(MAX_ID_BYTES + 1, src.size - pos)
        head = bytes(src.read(pos, n, "record id"))
        end = head.find(b"\n")
    if end < 0:
        raise FormatError(
            f"no newline ends the record id within {n} bytes",
            path=file,
            field="record id",
            offset=pos,
        )
    raw = head[:end]
    try:
        rid = raw.decode("ascii")
    except UnicodeDecodeError:
        rid = ""
    if not _valid_id(rid):
        raise FormatError(
            f"invalid record id {raw[:40]!r}: ids are 1-{MAX_ID_BYTES} printable ASCII characters",
            path=file,
            field="record id",
            offset=pos,
        )
    return rid, pos + end + 1


def _rest_of_record(src: ByteSource, rid: str, pos: int, file: str, old: bool) -> _Record:
    """Record ``rid`` from its count (at ``pos``, after the id), every field checked."""
    if old:
        r = src.reader(pos, 16, f"{rid} rows, cols")
        rows, cols = r.u64(f"{rid} rows"), r.u64(f"{rid} cols")
        # a zero dimension leaves the other unchecked by the size test below
        check_shape((cols, rows), 4, path=file, field=f"{rid} rows, cols", offset=pos)
        count, dims, pos = rows * cols, (rows, cols), pos + 16
    else:
        count, dims = src.reader(pos, 8, f"{rid} count").u64(f"{rid} count"), None
        pos += 8
    nbytes = count * 4
    if nbytes > src.size - pos:  # checked before anything is read or allocated
        raise FormatError(
            f"record {rid!r} declares {count} values ({nbytes} bytes); only {src.size - pos} remain",
            path=file,
            field=rid,
            offset=pos,
        )
    return _Record(rid, count, dims, pos)


def _walk_variant(src: ByteSource, file: str, old: bool) -> list[_Record]:
    records: list[_Record] = []
    seen: set[str] = set()
    pos = 0
    while pos < src.size:
        rid, after_id = _read_id(src, pos, file)
        if rid in seen:
            raise FormatError(
                f"record {rid!r} appears twice", path=file, field=rid, offset=after_id
            )
        seen.add(rid)
        rec = _rest_of_record(src, rid, after_id, file, old)
        records.append(rec)
        pos = rec.offset + rec.count * 4
    return records


def _walk_records(src: ByteSource, file: str) -> list[_Record]:
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


def _encode_records(tensors: Mapping[str, np.ndarray]) -> list[Any]:
    parts: list[Any] = []
    for rid in sorted(tensors):
        arr = tensors[rid]
        parts += (b"%b\n%b" % (rid.encode("ascii"), _U64.pack(int(arr.size))), arr)
    w = Writer()
    w.extend(parts, _F32)
    return w.finish()


# --------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------


def _as_shape(shape: Any, rid: str) -> tuple[int, ...]:
    """A ``shapes=`` value as a tuple of non-negative ints (an int is a 1-D shape)."""
    if _is_int(shape):
        shape = (shape,)
    if not isinstance(shape, tuple | list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise MismatchError(
            "a shape is a tuple of non-negative integers", key_path=f"shapes/{rid}", found=shape
        )
    return tuple(int(d) for d in shape)


def _check_shapes_option(shapes: Any, counts: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    if shapes is None:
        return {}
    if not isinstance(shapes, Mapping):
        raise MismatchError(
            "shapes must map tensor ids to shapes", key_path="shapes", found=type(shapes).__name__
        )
    out = {}
    for rid, shape in shapes.items():
        if rid not in counts:
            raise MismatchError(
                f"shapes names {rid!r}, which the checkpoint does not hold",
                key_path=f"shapes/{rid}",
                expected=sorted(counts)[:20],
                found=rid,
            )
        dims = _as_shape(shape, rid)
        if math.prod(dims) != counts[rid]:
            raise MismatchError(
                f"{rid} holds {counts[rid]} values",
                key_path=f"shapes/{rid}",
                expected=counts[rid],
                found=dims,
            )
        out[rid] = dims
    return out


def _infer_shapes(
    counts: Mapping[str, int], dims: Mapping[str, tuple[int, int] | None], shapes: Any = None
) -> dict[str, tuple[int, ...]]:
    """The array shape of every tensor (see the module docstring)."""
    given = _check_shapes_option(shapes, counts)
    out: dict[str, tuple[int, ...]] = {}
    for rid, count in counts.items():
        m = _LAYER_ID.match(rid)
        rc = dims.get(rid)
        if rid in given:
            out[rid] = given[rid]
        elif m and m.group(2) == "b":
            out[rid] = (count,)
        elif rc is not None:
            rows, cols = rc
            is_vector = cols == 1 and not (m and m.group(2) == "w")
            out[rid] = (rows,) if is_vector else (cols, rows)
        elif m:
            n_out = counts.get(f"l{m.group(1)}b")
            if n_out and count % n_out == 0:
                out[rid] = (count // n_out, n_out)
            else:
                out[rid] = (count,)
        else:
            out[rid] = (count,)
    return out


# --------------------------------------------------------------------------
# step.txt and log.txt
# --------------------------------------------------------------------------


def _text(buf: Any, file: str) -> str:
    try:
        return utf8_text(buf)
    except BadUtf8 as exc:
        raise FormatError(f"invalid UTF-8: {exc.reason}", path=file, offset=exc.start) from None


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` (split on ``\\n``, a final newline ends the last one), one at a
    time: a file of millions of lines costs no list of them when its second line is bad."""
    pos = 0
    while pos < len(text):
        end = text.find("\n", pos)
        if end < 0:
            yield text[pos:]
            return
        yield text[pos:end]
        pos = end + 1


def _parse_steps(buf: Any, ids: Iterable[str]) -> dict[str, int]:
    text = _text(buf, STEP)
    known = set(ids)
    steps: dict[str, int] = {}
    offset = 0
    for n, line in enumerate(_lines(text), 1):
        body = line[:-1] if line.endswith("\r") else line
        rid, comma, value = body.rpartition(",")
        where = f"line {n}"
        if (
            not comma
            or not value.isascii()
            or not value.isdigit()
            or len(value) > 19  # int() of thousands of digits raises; 2**63 has 19
            or int(value) >= 2**63
        ):
            raise FormatError(
                f"{where}: expected 'id,step', found {body[:60]!r}",
                path=STEP,
                field=where,
                offset=offset,
            )
        if rid not in known:
            raise FormatError(
                f"{where}: unknown id {rid[:60]!r} (weights.bin has no such tensor)",
                path=STEP,
                field=rid,
                offset=offset,
            )
        if rid in steps:
            raise FormatError(
                f"{where}: id {rid!r} listed twice", path=STEP, field=rid, offset=offset
            )
        steps[rid] = int(value)
        offset += len(line.encode()) + 1
    return steps


def _steps_text(steps: Mapping[str, int]) -> bytes:
    return "".join(f"{rid},{steps[rid]}\n" for rid in sorted(steps)).encode("ascii")


# --------------------------------------------------------------------------
# the native tree
# --------------------------------------------------------------------------


def _f32(value: Any, key: str) -> Any:
    """A leaf as a C-order little-endian float32 array (float16/bfloat16 widen exactly; nothing else is cast).

    A :class:`~pytreeio.core.binary.Streamed` leaf (a conversion's) stays one,
    read and widened when it is written.
    """
    if type(value) is np.ndarray and value.dtype == _F32 and value.flags.c_contiguous:
        return value  # the common case, as np.ascontiguousarray below returns it
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise EncodeError(f"expected a float32 array, found {type(value).__name__}", key_path=key)
    arr: Any = value
    if not isinstance(value, Streamed):
        try:
            arr = np.asarray(value)
        except Exception as exc:
            raise EncodeError(
                f"this leaf has no values to write ({type(exc).__name__})", key_path=key
            ) from None
    if arr.dtype == _F32 or arr.dtype == np.float32:
        return arr if isinstance(arr, Streamed) else np.ascontiguousarray(arr, dtype=_F32)
    if arr.dtype == np.float16 or arr.dtype.name == "bfloat16":
        return arr.astype(_F32)
    raise EncodeError(
        f"bullet stores float32 values; found {arr.dtype.name} (convert it explicitly)",
        key_path=key,
    )


def _check_native(tree: Any) -> dict[str, dict[str, np.ndarray]]:
    if not isinstance(tree, Mapping) or "weights" not in tree:
        raise EncodeError(
            "a bullet checkpoint is {'weights': {id: array}, 'momentum': ..., 'velocity': ...} "
            "(+ 'slow'); model-shaped trees go through the common model form",
            key_path="",
        )
    extra = sorted(str(k) for k in tree if k not in _RECORD_FILES)
    if extra:
        raise EncodeError(
            f"unknown entries {extra}; expected {sorted(_RECORD_FILES)}", key_path=extra[0]
        )
    if ("momentum" in tree) != ("velocity" in tree):
        missing = "velocity" if "momentum" in tree else "momentum"
        raise EncodeError("momentum and velocity are saved together", key_path=missing)
    out: dict[str, dict[str, np.ndarray]] = {}
    for part in _RECORD_FILES:
        if part not in tree or tree[part] is None:
            continue
        group = tree[part]
        if not isinstance(group, Mapping):
            raise EncodeError("expected a dict of arrays by tensor id", key_path=part)
        arrays = {}
        for rid, leaf in group.items():
            if not isinstance(rid, str) or not _valid_id(rid):
                raise EncodeError(
                    f"tensor ids are 1-{MAX_ID_BYTES} printable ASCII characters, found {rid!r}",
                    key_path=f"{part}/{rid}",
                )
            arrays[rid] = _f32(leaf, f"{part}/{rid}")
        out[part] = arrays
    weights = out["weights"]
    for part, arrays in out.items():
        if part == "weights":
            continue
        for rid in model_order(sorted(set(weights) | set(arrays))):
            if rid not in arrays:
                raise EncodeError(
                    f"{part} lacks tensor {rid!r} of weights", key_path=f"{part}/{rid}"
                )
            if rid not in weights:
                raise EncodeError(
                    f"{part} has tensor {rid!r}, which weights lacks", key_path=f"{part}/{rid}"
                )
            if arrays[rid].shape != weights[rid].shape:
                raise EncodeError(
                    f"shape {arrays[rid].shape} differs from the weight's {weights[rid].shape}",
                    key_path=f"{part}/{rid}",
                )
    return out


def _check_meta(
    meta: Any, ids: Mapping[str, Any]
) -> tuple[list[_Spec] | None, dict[str, int], str | None]:
    if meta is None:
        return None, {}, None
    if not isinstance(meta, Mapping):
        raise EncodeError("meta must be a dict", key_path="meta")
    # Reports a load adds (check_quantised) are not stored: re-saving loaded meta is fine.
    extra = sorted(
        str(k)
        for k in meta
        if k not in ("saved_format", "steps", "log", "quantisation_error", REPORT)
    )
    if extra:
        raise EncodeError(f"bullet has no place for meta {extra}", key_path=f"meta.{extra[0]}")
    specs = _specs(meta["saved_format"], ids) if meta.get("saved_format") is not None else None
    steps = meta.get("steps") or {}
    if not isinstance(steps, Mapping):
        raise EncodeError("meta['steps'] maps tensor ids to step counts", key_path="meta.steps")
    for rid, step in steps.items():
        if rid not in ids:
            raise EncodeError(
                f"steps names {rid!r}, which weights lacks", key_path=f"meta.steps.{rid}"
            )
        if not _is_int(step) or int(step) < 0:
            raise EncodeError(
                f"a step is a non-negative integer, found {step!r}", key_path=f"meta.steps.{rid}"
            )
    log = meta.get("log")
    if log is not None and not isinstance(log, str):
        raise EncodeError("meta['log'] is the text of log.txt", key_path="meta.log")
    return specs, {k: int(v) for k, v in steps.items()}, log


# --------------------------------------------------------------------------
# raw.bin and quantised.bin
# --------------------------------------------------------------------------


def _transformed(
    spec: _Spec, array: np.ndarray, tensors: Mapping[str, np.ndarray], fuse_last: bool
) -> tuple[np.ndarray, bool]:
    """``array`` after the entry's transforms; with ``fuse_last`` a trailing 2-D transpose is left to the caller."""
    if not spec.transforms:
        return array, False
    steps = list(spec.transforms)
    fused = fuse_last and bool(steps) and steps[-1] == "transpose" and array.ndim == 2
    if fused:
        steps.pop()
    for name in steps:
        before = array.size
        result = TRANSFORMS[name](array, tensors)
        try:
            array = _f32(result, spec.id)
        except EncodeError:
            raise EncodeError(
                f"transform {name!r} must return float32 values, found {getattr(result, 'dtype', type(result).__name__)}",
                key_path=f"saved_format ({spec.id})",
            ) from None
        if array.size != before:
            raise EncodeError(
                f"transform {name!r} changed the number of elements from {before} to {array.size}",
                key_path=f"saved_format ({spec.id})",
            )
    return array, fused


#: Quantisation kernels computing ahead of the entry being written (each holds its result).
_AHEAD = 2


class _Quantising:
    """quantised.bin's integer entries, computed (by jax, or the host's threads) while other bytes are written.

    Every entry's range is checked in :func:`_encode_quantised` (a failure
    leaves quantised.bin out before anything is written); the values are
    computed :data:`_AHEAD` entries ahead of the writer, so at most that many
    results are held, and the first ones compute while raw.bin is written.
    """

    def __init__(self, jobs: list[tuple[Any, _Spec, bool]]) -> None:
        self._jobs = jobs
        self._pending: dict[int, quant.Pending] = {}
        self._next = 0

    def _start(self, k: int) -> quant.Pending:
        x32, spec, fused = self._jobs[k]
        assert spec.scale is not None
        return quant.quantise_async(x32, spec.scale, spec.type, round=spec.round, transpose=fused)

    def start(self, upto: int) -> None:
        while self._next < min(upto, len(self._jobs)):
            self._pending[self._next] = self._start(self._next)
            self._next += 1

    def nbytes(self, k: int) -> int:
        x32, spec, _ = self._jobs[k]
        return int(x32.size) * spec.itemsize

    def take(self, k: int) -> Any:
        self.start(k + 1 + _AHEAD)
        pending = self._pending.pop(k, None)
        if pending is None:  # produced again (an encoding written twice): compute it anew
            pending = self._start(k)
        return pending.result().reshape(-1).view(np.uint8)


#: Integer entries of at most this many values are quantised together with their
#: neighbours of the same type, scale and rounding (:class:`_Run`).
_SMALL_VALUES = 1 << 14
#: The most values in one such run (its float32 copy stays in the caches).
_RUN_VALUES = 1 << 18


def _checked(arr: Any, spec: _Spec) -> Any:
    """``arr`` as float32 once every value fits the entry's type (else its QuantisationError)."""
    assert spec.scale is not None
    return quant.check_quantisable(arr, spec.scale, spec.type, round=spec.round, name=spec.id)


def _small(arr: Any) -> bool:
    return type(arr) is np.ndarray and arr.dtype == np.float32 and arr.size <= _SMALL_VALUES


class _Run:
    """Consecutive integer entries quantised as one array: small float32 ones of one type,
    scale and rounding together, any other alone.

    Quantisation is elementwise, so the quantised concatenation is each entry's
    values in file order, bit for bit: one range check and one job instead of
    a check and a dispatch per tensor, which cost ~100 times a tiny tensor's
    arithmetic.
    """

    __slots__ = ("entries", "size")

    def __init__(self) -> None:
        self.entries: list[tuple[Any, _Spec, bool]] = []  # (values, spec, fused transpose)
        self.size = 0

    def joins(self, arr: Any, spec: _Spec) -> bool:
        if not self.entries:
            return True
        first, last = self.entries[0], self.entries[-1][1]
        return (
            _small(arr)
            and _small(first[0])
            and self.size + arr.size <= _RUN_VALUES
            and (last.type, last.scale, last.round) == (spec.type, spec.scale, spec.round)
        )

    def add(self, arr: Any, spec: _Spec, fused: bool) -> None:
        self.entries.append((arr, spec, fused))
        self.size += arr.size

    def job(self) -> tuple[Any, _Spec, bool]:
        """The run as one range-checked job ``(x32, spec, fused)``; the run is emptied.

        When a value does not fit, the entries are checked one by one so that
        the error names the entry and element, as a check per entry would.
        """
        entries, self.entries, self.size = self.entries, [], 0
        if len(entries) == 1:
            arr, spec, fused = entries[0]
            return _checked(arr, spec), spec, fused
        # a fused transpose is applied to the float32 values (exact) before joining
        flat = np.concatenate([a.T if fused else a for a, _, fused in entries], axis=None)
        try:
            return _checked(flat, entries[0][1]), entries[0][1], False
        except QuantisationError:
            for arr, spec, _ in entries:
                _checked(arr, spec)
            raise


def _encode_quantised(specs: Sequence[_Spec], weights: Mapping[str, np.ndarray]) -> list[Any]:
    w = Writer()
    jobs: list[tuple[Any, _Spec, bool]] = []
    slots: list[Any] = []  # per entry or run: an f32 array, or the index of its quantisation job
    run = _Run()

    def end_run() -> None:
        if run.entries:
            slots.append(len(jobs))
            jobs.append(run.job())

    for spec in specs:
        try:
            arr, fused = _transformed(spec, weights[spec.id], weights, fuse_last=spec.type != "f32")
        except EncodeError:
            end_run()  # an earlier entry's quantisation error comes first, as entry by entry
            raise
        if spec.type == "f32":
            end_run()
            slots.append(arr)
            continue
        if isinstance(arr, Streamed):
            # checked before anything is written, then quantised ahead of the writer: held
            arr = arr.read()
        if not run.joins(arr, spec):
            end_run()
        run.add(arr, spec, fused)
    end_run()
    work = _Quantising(jobs)

    def entry(k: int) -> Iterator[Deferred]:
        n = work.nbytes(k)
        if n:
            yield Deferred(n, lambda: work.take(k))

    chunks = _write_entries(w, slots, entry)
    work.start(_AHEAD)
    return chunks


def _write_entries(
    w: Writer, slots: Sequence[Any], deferred: Callable[[int], Iterable[Deferred]]
) -> list[Any]:
    """quantised.bin's chunks: each slot's f32 array or its job's deferred chunks, then the padding."""
    arrays: list[Any] = []
    for slot in slots:
        if isinstance(slot, int):
            w.extend(arrays, _F32)
            arrays = []
            for chunk in deferred(slot):
                w.deferred(chunk)
        else:
            arrays.append(slot)
    w.extend(arrays, _F32)
    w.raw(padding(w.nbytes))
    return w.finish()


def _encode_raw(specs: Sequence[_Spec], weights: Mapping[str, np.ndarray]) -> list[Any]:
    w = Writer()
    w.extend([weights[spec.id] for spec in specs], _F32)
    return w.finish()


def _deferred(exc: QuantisationError) -> QuantisationError:
    out = QuantisationError(
        f"{exc}; quantised.bin was not written (raw.bin and the optimiser state were)"
    )
    out.__dict__.update(exc.__dict__)
    return out


def _check_raw(have: int, specs: Sequence[_Spec], sizes: Mapping[str, int]) -> None:
    """raw.bin's size (``have`` bytes) against the saved format."""
    want = 4 * sum(sizes[s.id] for s in specs)
    if have != want:
        raise FormatError(
            f"raw.bin holds {have} bytes; the saved format lists {want} ({len(specs)} f32 entries)",
            path=RAW,
            offset=min(have, want),
        )


def _check_quantised(src: ByteSource, specs: Sequence[_Spec], sizes: Mapping[str, int]) -> None:
    """quantised.bin's size and padding (the only bytes read) against the saved format."""
    data = sum(sizes[s.id] * s.itemsize for s in specs)
    want = data + len(padding(data))
    if src.size != want:
        raise FormatError(
            f"quantised.bin holds {src.size} bytes; the saved format gives {data} bytes of data "
            f"+ {want - data} of padding = {want}",
            path=QUANTISED,
            offset=min(src.size, want),
        )
    pad = bytes(src.read(data, want - data, "padding"))
    if pad != padding(data) and pad != bytes(len(pad)):
        first = next(i for i, (a, b) in enumerate(zip(pad, padding(data))) if a != b)
        raise FormatError(
            "the padding is neither bullet's pattern nor zeros",
            path=QUANTISED,
            field="padding",
            offset=data + first,
        )


def _entry_arrays(
    buf: Any, specs: Sequence[_Spec], sizes: Mapping[str, int], quantised: bool
) -> dict[str, np.ndarray]:
    """Each entry's values as written (flat), from raw.bin or quantised.bin (sizes already checked)."""
    view = as_memoryview(buf)
    out = {}
    pos = 0
    for spec in specs:
        dtype = TYPES[spec.type] if quantised else _F32
        n = sizes[spec.id]
        out[spec.id] = np.frombuffer(view, dtype=dtype, count=n, offset=pos)
        pos += n * dtype.itemsize
    return out


def _quantisation_report(
    q_buf: Any,
    raw: Mapping[str, np.ndarray],
    specs: Sequence[_Spec],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, float]:
    sizes = {k: math.prod(v) for k, v in shapes.items()}
    qs = _entry_arrays(q_buf, specs, sizes, quantised=True)
    report = {}
    for spec in specs:
        want, _ = _transformed(spec, raw[spec.id].reshape(shapes[spec.id]), raw, fuse_last=False)
        if spec.type == "f32":
            diff = np.abs(qs[spec.id].astype(np.float64) - want.reshape(-1).astype(np.float64))
            report[spec.id] = float(diff.max()) if diff.size else 0.0
        else:
            assert spec.scale is not None
            report[spec.id] = quant.quantisation_error(qs[spec.id], spec.scale, want)
    return report


# --------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------


def encode(tree: Any, *, meta: Mapping[str, Any] | None = None, strict: bool = False) -> Encoded:
    """The files of a bullet checkpoint directory for a native tree.

    ``meta``: ``saved_format`` (default: every tensor f32, model order),
    ``steps`` (``{id: step}`` for ``step.txt``), ``log`` (the text of
    ``log.txt``; empty when absent).  When quantisation fails the encoding
    has no ``quantised.bin`` and carries the error in ``deferred``: the save
    writes the rest, then warns, or raises with ``strict=True``.
    """
    native = _check_native(tree)
    weights = native["weights"]
    specs, steps, log = _check_meta(meta, weights)
    if specs is None:
        specs = _float_specs(weights)
    files: dict[str, Encoded] = {RAW: Encoded(chunks=tuple(_encode_raw(specs, weights)))}
    deferred: tuple[Exception, ...] = ()
    try:
        files[QUANTISED] = Encoded(chunks=tuple(_encode_quantised(specs, weights)))
    except QuantisationError as exc:
        deferred = (_deferred(exc),)
    for part, arrays in native.items():
        files[_RECORD_FILES[part]] = Encoded(chunks=tuple(_encode_records(arrays)))
    if steps:
        files[STEP] = Encoded(chunks=(_steps_text(steps),))
    files[LOG] = Encoded(chunks=((log or "").encode("utf-8"),))
    return Encoded(files=files, deferred=deferred, strict=bool(strict))


# --------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------


def _same_ids(file: str, records: Sequence[_Record], counts: Mapping[str, int]) -> None:
    """A state file holds exactly the tensors of weights.bin, with their counts."""
    have = {r.id: r for r in records}
    for rid in model_order(sorted(set(have) | set(counts))):
        if rid not in counts:
            raise FormatError(
                f"record {rid!r} is not in weights.bin",
                path=file,
                field=rid,
                offset=have[rid].offset,
            )
        if rid not in have:
            raise FormatError(f"no record for tensor {rid!r} of weights.bin", path=file, field=rid)
        if have[rid].count != counts[rid]:
            raise FormatError(
                f"record {rid!r} holds {have[rid].count} values, weights.bin {counts[rid]}",
                path=file,
                field=rid,
                offset=have[rid].offset,
            )


class _Files(Mapping[str, ByteSource]):
    """:func:`decode`'s files as byte sources for :func:`slots`.

    raw.bin and quantised.bin, whose data a load does not return, come through the
    caller's own reads where it has them (``ranges``, as an ``io.FileSet`` offers), so
    that only their sizes and padding are read; the other files as whole buffers.
    """

    def __init__(self, source: Mapping[str, Any], stack: contextlib.ExitStack) -> None:
        self._source = source
        self._stack = stack
        self._opened: dict[str, ByteSource] = {}

    def __getitem__(self, file: str) -> ByteSource:
        src = self._opened.get(file)
        if src is None:
            ranges = getattr(self._source, "ranges", None)
            ranged = ranges(file) if file in (RAW, QUANTISED) and callable(ranges) else None
            if ranged is not None:
                src = self._stack.enter_context(ranged)
            else:
                src = BufferSource(as_memoryview(self._source[file]), name=file)
            self._opened[file] = src
        return src

    def __contains__(self, file: object) -> bool:
        return file in self._source

    def __iter__(self) -> Iterator[str]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)


def decode(
    source: Mapping[str, Any],
    *,
    saved_format: Sequence[Mapping[str, Any]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    check_quantised: bool = False,
    verify: bool = False,
) -> Decoded:
    """A checkpoint directory's native tree and meta (see the module docstring).

    Args:
      source: relative path -> buffer, the files of the directory.
      saved_format: the layout of raw.bin/quantised.bin; when given, their
        sizes, offsets and padding are checked (bullet stores no layout).
      shapes: ``{id: shape}`` for tensors whose shape the records do not tell.
      check_quantised: dequantise quantised.bin and report the largest error
        against raw.bin per entry in ``meta["quantisation_error"]``.
      verify: check everything the file allows (``ptio.verify`` passes it): with
        ``saved_format``, as ``check_quantised``, the report also under
        ``meta[pytreeio.core.records.REPORT]``.

    Arrays are views of the files they are read from: the record files, or
    raw.bin for a checkpoint without ``optimiser_state/``.  raw.bin's and
    quantised.bin's data are read only when returned or compared.
    """
    with contextlib.ExitStack() as stack:
        files = _Files(source, stack)
        found = slots(
            files,
            saved_format=saved_format,
            shapes=shapes,
            check_quantised=check_quantised,
            verify=verify,
        )
        views: dict[str, memoryview] = {}

        def array(slot: Slot) -> np.ndarray:  # slots checked that the data lies in the file
            assert slot.role is not None
            if slot.role not in views:
                views[slot.role] = _whole(files, slot.role)
            return np.ndarray(slot.shape, _F32, buffer=views[slot.role], offset=slot.offset)

        native = {
            part: {rid: array(slot) for rid, slot in group.items()}
            for part, group in found.tree.items()
        }
    return Decoded(native, found.meta)


# --------------------------------------------------------------------------
# slots: where each array lies (headers only)
# --------------------------------------------------------------------------


def _whole(source: Mapping[str, ByteSource], file: str) -> memoryview:
    """A file's bytes, read whole."""
    src = source[file]
    return src.read(0, src.size, file)


def _record_slots(
    part: str, file: str, records: Sequence[_Record], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Slot]:
    by_id = {r.id: r for r in records}
    return {
        rid: Slot(f"{part}/{rid}", r.offset, 4 * r.count, shapes[rid], _F32, role=file)
        for rid, r in ((rid, by_id[rid]) for rid in model_order(by_id))
    }


def _raw_slots(
    source: Mapping[str, ByteSource], specs: list[_Spec] | None, shapes: Any
) -> dict[str, Slot]:
    """The weights of a checkpoint without optimiser_state/ (an exported network), in raw.bin
    as ``saved_format`` and ``shapes`` lay them out (checked against raw.bin's size)."""
    if (
        RAW not in source
        or specs is None
        or not isinstance(shapes, Mapping)
        or any(s.id not in shapes for s in specs)
    ):
        raise FormatError(
            "no optimiser_state/weights.bin: bullet loads checkpoints from optimiser_state/; to read "
            "the network from raw.bin alone pass saved_format= and shapes= for every entry",
            path=WEIGHTS,
        )
    counts = {s.id: math.prod(_as_shape(shapes[s.id], s.id)) for s in specs}
    dims = _check_shapes_option(shapes, counts)
    _check_raw(source[RAW].size, specs, counts)
    offsets = {}
    pos = 0
    for spec in specs:
        offsets[spec.id] = pos
        pos += 4 * counts[spec.id]
    return {
        rid: Slot(f"weights/{rid}", offsets[rid], 4 * counts[rid], dims[rid], _F32, role=RAW)
        for rid in model_order(counts)
    }


def slots(
    source: Mapping[str, ByteSource],
    *,
    saved_format: Sequence[Mapping[str, Any]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    check_quantised: bool = False,
    verify: bool = False,
) -> Slots:
    """:func:`decode`'s native tree with a :class:`Slot` per array, reading record headers only.

    Weights read as ``(in, out)`` in C order: bullet's column-major ``out x in``
    matrix is exactly those bytes.  step.txt and log.txt (meta) are read
    whole; with ``saved_format`` the sizes of raw.bin and quantised.bin and
    quantised.bin's padding are checked.  ``check_quantised`` (or ``verify``)
    compares the data itself, so it reads raw.bin and quantised.bin whole.
    """
    check_quantised = check_quantised or (verify and saved_format is not None)
    if saved_format is None and check_quantised:
        raise MismatchError(
            "check_quantised needs the layout: pass saved_format=",
            key_path="saved_format",
            found=None,
        )
    specs = _specs(saved_format) if saved_format is not None else None
    tree: dict[str, dict[str, Slot]] = {}
    meta: dict[str, Any] = {}
    if WEIGHTS in source:
        records = _walk_records(source[WEIGHTS], WEIGHTS)
        counts = {r.id: r.count for r in records}
        all_shapes = _infer_shapes(counts, {r.id: r.dims for r in records}, shapes)
        tree["weights"] = _record_slots("weights", WEIGHTS, records, all_shapes)
        for part in ("momentum", "velocity", "slow"):
            file = _RECORD_FILES[part]
            if file not in source:
                continue
            precs = _walk_records(source[file], file)
            _same_ids(file, precs, counts)
            tree[part] = _record_slots(part, file, precs, all_shapes)
        if ("momentum" in tree) != ("velocity" in tree):
            have, lack = (MOMENTUM, VELOCITY) if "momentum" in tree else (VELOCITY, MOMENTUM)
            raise FormatError(f"{have} without {lack}", path=lack)
        if STEP in source:
            meta["steps"] = _parse_steps(_whole(source, STEP), counts)
    else:
        tree["weights"] = _raw_slots(source, specs, shapes)
        all_shapes = {k: v.shape for k, v in tree["weights"].items()}
    if LOG in source:
        meta["log"] = _text(_whole(source, LOG), LOG)
    if specs is not None:
        sizes = {rid: math.prod(s.shape) for rid, s in tree["weights"].items()}
        _specs([s.to_json() for s in specs], sizes)  # every id must be a tensor
        meta["saved_format"] = [s.to_json() for s in specs]
        if RAW in source:
            _check_raw(source[RAW].size, specs, sizes)
        if QUANTISED in source:
            _check_quantised(source[QUANTISED], specs, sizes)
        if check_quantised:  # compares the data: raw.bin and quantised.bin read whole
            if QUANTISED not in source:
                raise FormatError(
                    "no quantised.bin to check (quantisation failed when the checkpoint was saved?)",
                    path=QUANTISED,
                )
            raw = {rid: s.read(source) for rid, s in tree["weights"].items()}
            if RAW in source:
                flat = _entry_arrays(_whole(source, RAW), specs, sizes, quantised=False)
                raw.update({rid: a.reshape(all_shapes[rid]) for rid, a in flat.items()})
            q_view = _whole(source, QUANTISED)
            meta["quantisation_error"] = _quantisation_report(q_view, raw, specs, all_shapes)
            if verify:
                meta[REPORT] = {"quantisation_error": meta["quantisation_error"]}
    return Slots(tree, meta)


# --------------------------------------------------------------------------
# reading the networks (inference, verification)
# --------------------------------------------------------------------------


def raw_tensors(
    source: Mapping[str, Any],
    saved_format: Sequence[Mapping[str, Any]],
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    """raw.bin's entries as float32 arrays in their native shapes (``(in, out)`` weights)."""
    native, meta = decode(source, saved_format=saved_format, shapes=shapes)
    specs = _specs(meta["saved_format"])
    if RAW not in source:
        raise FormatError("the checkpoint has no raw.bin", path=RAW)
    sizes = {rid: int(a.size) for rid, a in native["weights"].items()}
    flat = _entry_arrays(source[RAW], specs, sizes, quantised=False)
    return {rid: flat[rid].reshape(native["weights"][rid].shape) for rid in flat}


def quantised_tensors(
    source: Mapping[str, Any],
    saved_format: Sequence[Mapping[str, Any]],
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    """quantised.bin's entries as written: integer (or f32) arrays, transposed entries as ``(out, in)``.

    Shapes follow the entry's transforms (``"transpose"`` turns ``(in, out)``
    into ``(out, in)``); after other transforms the array is flat.
    """
    native, meta = decode(source, saved_format=saved_format, shapes=shapes)
    specs = _specs(meta["saved_format"])
    if QUANTISED not in source:
        raise FormatError("the checkpoint has no quantised.bin", path=QUANTISED)
    weights = native["weights"]
    sizes = {rid: int(a.size) for rid, a in weights.items()}
    flat = _entry_arrays(source[QUANTISED], specs, sizes, quantised=True)
    out = {}
    for spec in specs:
        shape: tuple[int, ...] = weights[spec.id].shape
        for t in spec.transforms:
            shape = shape[::-1] if t == "transpose" else (math.prod(shape),)
        out[spec.id] = flat[spec.id].reshape(shape)
    return out


def verify_quantised(
    source: Mapping[str, Any],
    saved_format: Sequence[Mapping[str, Any]],
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, float]:
    """The largest ``|q/scale - x|`` per entry of quantised.bin against raw.bin (``x`` transformed as the entry says).

    Every size, offset and padding byte is checked on the way (``decode``
    with ``check_quantised=True``).  An entry of a checkpoint written
    with rounding has errors of at most ``0.5/scale``, truncated ones below
    ``1/scale``.
    """
    _, meta = decode(source, saved_format=saved_format, shapes=shapes, check_quantised=True)
    return dict(meta["quantisation_error"])


# --------------------------------------------------------------------------
# inspect and sniff
# --------------------------------------------------------------------------


def inspect(source: Mapping[str, ByteSource]) -> Info:
    """Tensors (from the record headers only), file sizes of raw.bin/quantised.bin."""
    entries: list[Entry] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for part, file in _RECORD_FILES.items():
        if file not in source:
            continue
        records = {r.id: r for r in _walk_records(source[file], file)}
        if part == "weights":
            shapes = _infer_shapes(
                {r.id: r.count for r in records.values()}, {r.id: r.dims for r in records.values()}
            )
        for rid in model_order(records):
            count = records[rid].count
            shape = shapes.get(rid, (count,))
            if math.prod(shape) != count:
                shape = (count,)
            entries.append(Entry(f"{part}/{rid}", shape, "float32", 4 * count))
    meta: dict[str, Any] = {"files": sorted(str(k) for k in source)}
    for file in (RAW, QUANTISED):
        if file in source:
            meta[f"{file.split('.')[0]}_bytes"] = int(source[file].size)
    return Info(format="bullet", entries=tuple(entries), meta=meta)


def sniff(probe: Any) -> float:
    """A directory with ``optimiser_state/weights.bin``, or with ``raw.bin`` and ``quantised.bin``."""
    names = probe.names
    if not probe.is_dir or not names:
        return 0.0
    if WEIGHTS in names or (RAW in names and QUANTISED in names):
        return STRUCTURE
    return 0.0


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------


def _layer_ids(weights: Mapping[str, Any]) -> int:
    """The number of affine layers ``l0..l{n-1}``; every id must belong to one."""
    ks = set()
    for rid in weights:
        m = _LAYER_ID.match(rid)
        if m is None:
            raise MismatchError(
                f"tensor {rid!r} is not an affine layer's l{{k}}w/l{{k}}b, so the checkpoint is not an MLP",
                key_path=f"weights/{rid}",
                expected="l{k}w, l{k}b",
                found=rid,
            )
        ks.add(int(m.group(1)))
    n = max(ks) + 1 if ks else 0
    for k in range(n):
        if f"l{k}w" not in weights:
            raise MismatchError(
                f"layer {k} has no weight l{k}w", key_path=f"weights/l{k}w", found="nothing"
            )
    return n


def _model_step(meta: Mapping[str, Any], ids: Sequence[str], step: int | None) -> int | None:
    """The one step count of step.txt (every tensor listed, all equal), or ``step``."""
    steps = meta.get("steps")
    if not steps or not ids:
        return step
    for rid in ids:
        if rid not in steps:
            raise MismatchError(
                f"step.txt has no line for tensor {rid!r}", key_path=f"steps/{rid}", found="nothing"
            )
    first = ids[0]
    found = steps[first]
    for rid in ids:
        if steps[rid] != found:
            raise MismatchError(
                f"step.txt gives tensor {rid!r} step {steps[rid]}, {first!r} step {found}: "
                "an optax state has one step count",
                key_path=f"steps/{rid}",
                expected=found,
                found=steps[rid],
            )
    if step is not None and step != found:
        raise MismatchError(
            f"step={step} contradicts step.txt ({found})",
            key_path="step",
            expected=found,
            found=step,
        )
    return int(found)


def to_model(
    native: Any, meta: Mapping[str, Any], *, step: int | None = None, layers: Any = None
) -> Model:
    """An MLP of Linear layers (``l{k}w`` kernel ``(in, out)``, ``l{k}b`` bias) with its AdamW state.

    ``momentum``/``velocity`` become an ``adamw`` state's ``mu``/``nu``; its
    count comes from step.txt (every tensor must have the same step) or,
    when the checkpoint has none (bullet's AdamW writes none), from
    ``step=``.  Ranger's ``slow`` weights have no place in an optax state and
    are an error.  bullet keeps no architecture: ``layers=[...]`` gives the
    layer list (activations included) the Linear layers sit in.  A non-empty
    ``log`` and a ``saved_format`` are kept in ``model.extras['bullet']``.
    """
    from pytreeio.model.optim import OptState

    if not isinstance(native, Mapping) or not isinstance(native.get("weights"), Mapping):
        raise MismatchError(
            "a bullet native tree has 'weights'", key_path="weights", found=type(native).__name__
        )
    if native.get("slow"):
        raise MismatchError(
            "the checkpoint holds Ranger's lookahead weights (slow.bin), which an optax state has "
            "no place for; load the native tree instead",
            key_path="slow",
        )
    weights = native["weights"]
    n = _layer_ids(weights)
    linear = []
    order: list[str] = []
    for k in range(n):
        kernel, bias = weights[f"l{k}w"], weights.get(f"l{k}b")
        if np.ndim(kernel) != 2:
            raise MismatchError(
                f"l{k}w holds {np.size(kernel)} values but its shape is unknown (no l{k}b to tell "
                f"the output size); pass shapes={{'l{k}w': (in, out)}}",
                key_path=f"weights/l{k}w",
                found=tuple(np.shape(kernel)),
            )
        arrays = {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}
        args = {
            "in_features": int(kernel.shape[0]),
            "out_features": int(kernel.shape[1]),
            "bias": bias is not None,
        }
        if bias is not None and tuple(np.shape(bias)) != (kernel.shape[1],):
            raise MismatchError(
                f"l{k}b has shape {tuple(np.shape(bias))}, l{k}w has {kernel.shape[1]} outputs",
                key_path=f"weights/l{k}b",
                expected=(kernel.shape[1],),
                found=tuple(np.shape(bias)),
            )
        linear.append(Layer("Linear", args, arrays))
        order += [f"l{k}w"] + ([f"l{k}b"] if bias is not None else [])
    if step is not None and (not _is_int(step) or step < 0):
        raise MismatchError("step must be a non-negative integer", key_path="step", found=step)
    count = _model_step(meta, order, step)
    opt = None
    if native.get("momentum") is not None:
        slots = {}
        for slot, part in (("mu", "momentum"), ("nu", "velocity")):
            group = native.get(part) or {}
            missing = [rid for rid in order if rid not in group]
            if missing:
                raise MismatchError(
                    f"{part} has no tensor {missing[0]!r}", key_path=f"{part}/{missing[0]}"
                )
            slots[slot] = [group[rid] for rid in order]
        opt = OptState("adamw", {}, count, slots)
    if layers is not None:
        model_layers = Model.from_params([weights[rid] for rid in order], layers).layers
    else:
        model_layers = tuple(linear)
    extras = {k: meta[k] for k in ("saved_format", "log") if meta.get(k)}
    return Model(
        model_layers,
        opt_state=opt,
        step=count,
        extras={FORMAT_NAME: extras} if extras else {},
    )


def _drop(what: list[str], lossy: bool) -> None:
    if not what:
        return
    if not lossy:
        raise ConversionError(f"format 'bullet' cannot hold: {', '.join(what)}", what=what)
    warnings.warn(f"bullet: dropping {', '.join(what)}", PytreeioWarning, stacklevel=4)


def from_model(
    model: Model, meta: Mapping[str, Any] | None = None, *, lossy: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The native tree of an MLP: Linear layer ``k`` -> ``l{k}w`` (kernel) and ``l{k}b`` (bias).

    An ``adam``/``adamw`` state's ``mu``/``nu`` become momentum/velocity and
    its count every line of step.txt; an ``sgd`` state holds nothing.
    Parameter-free layers (ReLU, ...) are not refused: bullet's checkpoints
    hold no architecture, its reader supplies it (``layers=`` on loading).
    Layers with arrays other than Linear, frozen layers, other optimizers and
    masked slots raise :class:`ConversionError` unless ``lossy``, which drops
    them with a warning.  ``saved_format`` and ``log`` come from ``meta``,
    else from ``model.extras['bullet']``.
    """
    dropped = []
    weights: dict[str, Any] = {}
    ids: list[str] = []  # the tensors written, in parameter order
    param_ids: list[str | None] = []  # per parameter of the model: its id, None when dropped
    k = 0
    for i, layer in enumerate(model.layers):
        if not layer.arrays and not layer.spec.arrays:
            continue  # a parameter-free layer: architecture, which bullet's files never hold
        if layer.type != "Linear" or not layer.trainable:
            what = layer.type if layer.type != "Linear" else "frozen Linear"
            dropped.append(f"layer {i} ({what})")
            param_ids += [None] * len(layer.params)
            continue
        for name, array in layer.params:
            rid = f"l{k}{'w' if name == 'kernel' else 'b'}"
            weights[rid] = array
            ids.append(rid)
            param_ids.append(rid)
        k += 1
    tree: dict[str, Any] = {"weights": weights}
    kept = {**model.extras.get(FORMAT_NAME, {}), **(meta or {})}
    out_meta: dict[str, Any] = {key: kept[key] for key in ("saved_format", "log") if key in kept}
    opt = model.opt_state
    count = None
    if opt is not None:
        slots = opt.slots
        moments = ("mu" in slots and "nu" in slots) and not any(
            s is None for name in ("mu", "nu") for s in slots[name]
        )
        if opt.kind in ("adam", "adamw") and moments:
            tree["momentum"] = {rid: m for rid, m in zip(param_ids, slots["mu"]) if rid is not None}
            tree["velocity"] = {rid: v for rid, v in zip(param_ids, slots["nu"]) if rid is not None}
            count = opt.count
        elif opt.kind == "sgd":
            count = opt.count
        else:
            what = "masked" if opt.kind in ("adam", "adamw") else opt.kind
            dropped.append(f"optimizer state ({what})")
    if model.step is not None and count is not None and model.step != count:
        dropped.append(f"step {model.step} (the optimizer's count is {count})")
    _drop(dropped, lossy)
    step = count if count is not None else model.step
    if step is not None:
        out_meta["steps"] = {rid: int(step) for rid in ids}
    return tree, out_meta


FORMAT = register(
    Format(
        name=FORMAT_NAME,
        description="bullet (chess NNUE trainer) checkpoint directory: raw.bin, quantised.bin, optimiser_state/",
        suffixes=(),
        layout=DIRECTORY,
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=sniff,
        to_model=to_model,
        from_model=from_model,
        slots=slots,
        streams=True,
    )
)
