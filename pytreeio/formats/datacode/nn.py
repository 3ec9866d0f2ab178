"""DataCode ``.nn`` model files (Rust; ``specs/001``, FORMATS.md "DataCode").

Byte layout (all integers little-endian)::

    offset  size      field
    0       8         magic  b"DATACODE"
    8       4         u32 version = 1
    12      4         u32 J, the JSON length
    16      J         the architecture document: UTF-8 JSON written by
                      serde_json::to_string (compact, keys sorted, see
                      pytreeio.core.serde_json) - {"device", "layers", "training"}
    16+J    4         u32 tensor count = 2 x (number of Linear layers)
    then per tensor, weight then bias of each Linear in network order:
            4         u32 name length L
            L         name, UTF-8: "layer<N>.weight" | "layer<N>.bias"
            4         u32 ndim
            4*ndim    u32 dims
            4*prod    f32 data, C order
    (nothing after the last tensor)

Two on-disk variants share version 1:

=========== ======================================== ============== ==============
variant     tensor ``layer<N>`` / JSON Linear names  weight dims    bias dims
=========== ======================================== ============== ==============
``seed``    N = position among all layers            ``[in, out]``  ``[1, out]`` or
            (ReLU at 1 makes the next Linear 2)                     ``[out]``
``later``   N = position among Linear layers only;   ``[out, in]``  ``[out]``
            activations keep their position in JSON                (``[1, out]``
            names, so two layers can share a name                   read too)
=========== ======================================== ============== ==============

The conformance files are the later variant.  Reading decides the variant
from the file: whether the tensor indices are Linear positions or the
Linear-only count, and the orientation of any non-square weight; a file both
readings fit (only square weights and Linear-only layers) reads as ``seed``.
``decode(..., variant="seed"|"later")`` overrides the detection (and then
must fit).  Writing uses ``variant=`` if given, else the variant recorded in
``meta`` by a previous load, else ``seed``.

Native tree: ``{'layer<p>': {'weight': (in, out), 'bias': (out,)}}`` with
``p`` the position among all layers (the seed naming), whatever the variant.
Meta: the JSON document as parsed (floats stay floats, integers ints) plus
`FILE_KEY`: ``{"variant": "seed"|"later", "bias_2d": ["layer0", ...]}``
naming the native layers whose bias the file stores as ``[1, out]``.  The
writer consumes that key (it is not written into the JSON), so saving a
loaded native tree with its meta reproduces the file byte for byte.  Without
``bias_2d`` (or with one recorded for the other variant) biases are written
as that variant's DataCode writes them: ``[1, out]`` in the seed variant
(DataCode 2.1.0's ``save`` always does), ``[out]`` in the later one; a bias
given as ``(1, out)`` is written ``[1, out]`` in either.

Validation is stricter than DataCode's (which ignores trailing bytes and
never compares tensors with the architecture): magic, version, UTF-8, strict
JSON (nesting at most 128), layer types and chained feature counts, tensor
names, indices, count and shapes, duplicates, trailing bytes; every length
is checked before it is used.  Errors name the file, the field (tensor name
or JSON path; JSON fields point at the document's first byte) and the offset.
"""

from __future__ import annotations

import math
import re
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytreeio.core import jsonsafe, serde_json
from pytreeio.core.binary import BufferSource, ByteSource, Slot, Slots, Streamed, Writer
from pytreeio.core.errors import (
    ConversionError,
    EncodeError,
    FormatError,
    MismatchError,
    PytreeioWarning,
)
from pytreeio.core.records import FILE, MAGIC, Decoded, Encoded, Entry, Format, Info, Probe
from pytreeio.formats.registry import register
from pytreeio.model.form import Layer, Model, entry_parts, layer_list

__all__ = [
    "FORMAT",
    "FILE_KEY",
    "MAGIC_BYTES",
    "TYPES",
    "VARIANTS",
    "encode",
    "decode",
    "inspect",
    "slots",
    "sniff",
    "to_model",
    "from_model",
    "empty_training",
    "tensor_names",
    "layer_names",
]

MAGIC_BYTES = b"DATACODE"
VERSION = 1
_HEADER = 16
#: The layer types DataCode knows (its loader refuses others).
TYPES = ("Linear", "ReLU", "Sigmoid", "Tanh", "Softmax", "Flatten")
VARIANTS = ("seed", "later")
FORMAT_NAME = "datacode"
#: The meta key (never written into the JSON) recording how the file was laid out.
FILE_KEY = "_datacode_file"
#: DataCode names are ``layer<N>.weight``; longer names are refused before they are read.
_MAX_NAME = 64
_MAX_DIM = (1 << 32) - 1
_TENSOR_NAME = re.compile(r"\Alayer(0|[1-9][0-9]{0,9})\.(weight|bias)\Z")
_F32 = np.dtype("<f4")
_U32 = struct.Struct("<I")
#: A tensor's dims by their count.
_DIMS = {1: struct.Struct("<I"), 2: struct.Struct("<2I")}
_JSON_DEPTH = serde_json.MAX_DEPTH

Fail = Callable[[str, str], Exception]


# --------------------------------------------------------------------------
# the JSON document
# --------------------------------------------------------------------------


def _serde_problem(value: Any) -> str | None:
    """What serde_json could not hold in a parsed document: integers beyond i64/u64, lone surrogates."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return "a string holds a lone surrogate escape (\\ud800-\\udfff)"
        elif type(node) is int and not -(1 << 63) <= node <= (1 << 64) - 1:
            return f"integer {str(node)[:40]} is outside the i64/u64 range"
        elif isinstance(node, dict):
            stack.extend(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def _parse_json(raw: memoryview, *, path: str | None, field: str, offset: int) -> Any:
    """The JSON document in ``raw`` (file offset ``offset``): `pytreeio.core.jsonsafe.loads`
    (UTF-8, syntax, no duplicate keys or NaN, nesting at most 128) plus serde_json's limits."""
    value = jsonsafe.loads(raw, path=path, field=field, offset=offset, max_depth=_JSON_DEPTH)
    problem = _serde_problem(value)
    if problem is not None:
        raise FormatError(f"invalid JSON: {problem}", path=path, field=field, offset=offset)
    return value


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 3x
class _LayerSpec:
    """One entry of ``layers``: its type, and for Linear its feature counts."""

    type: str
    in_features: int = 0
    out_features: int = 0
    trainable: bool = True


def _is_count(v: Any) -> bool:
    return type(v) is int and 1 <= v <= _MAX_DIM


def _check_layer(entry: Any, i: int, fail: Fail) -> _LayerSpec:
    if not isinstance(entry, dict):
        raise fail(f"a layer entry must be an object, found {type(entry).__name__}", f"layers[{i}]")
    ltype = entry.get("type")
    if not isinstance(ltype, str) or ltype not in TYPES:
        raise fail(
            f"unknown layer type {str(ltype)[:80]!r}; DataCode knows {list(TYPES)}",
            f"layers[{i}].type",
        )
    if "name" in entry and not isinstance(entry["name"], str):
        raise fail("name must be a string", f"layers[{i}].name")
    if ltype != "Linear":
        return _LayerSpec(ltype)
    in_f, out_f = entry.get("in_features"), entry.get("out_features")
    for key, value in (("in_features", in_f), ("out_features", out_f)):
        if not _is_count(value):
            raise fail(
                f"{key} must be an integer in [1, 2**32), found {str(value)[:40]}",
                f"layers[{i}].{key}",
            )
    trainable = entry.get("trainable", True)
    if type(trainable) is not bool:
        raise fail("trainable must be true or false", f"layers[{i}].trainable")
    return _LayerSpec("Linear", entry["in_features"], entry["out_features"], trainable)


def _check_doc(doc: Any, fail: Fail) -> list[_LayerSpec]:
    """The layers of an architecture document, after checking its structure."""
    if not isinstance(doc, dict):
        raise fail(f"the document must be a JSON object, found {type(doc).__name__}", "")
    if FILE_KEY in doc:
        raise fail(f"{FILE_KEY!r} is reserved for pytreeio", FILE_KEY)
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise fail("the document has no 'layers' list", "layers")
    specs = [_check_layer(entry, i, fail) for i, entry in enumerate(layers)]
    previous: tuple[int, int] | None = None
    for i, spec in enumerate(specs):
        if spec.type != "Linear":
            continue
        if previous is not None and spec.in_features != specs[previous[0]].out_features:
            raise fail(
                f"in_features {spec.in_features} does not match out_features "
                f"{specs[previous[0]].out_features} of layers[{previous[0]}]",
                f"layers[{i}].in_features",
            )
        previous = (i, spec.in_features)
    if "device" in doc and not isinstance(doc["device"], str):
        raise fail("device must be a string", "device")
    training = doc.get("training")
    if training is not None:
        if not isinstance(training, dict):
            raise fail("training must be an object", "training")
        stages = training.get("stages")
        if stages is not None and not (
            isinstance(stages, list) and all(isinstance(s, dict) for s in stages)
        ):
            raise fail("training.stages must be a list of objects", "training.stages")
    return specs


def _format_fail(path: str | None, offset: int) -> Fail:
    def fail(reason: str, where: str) -> Exception:
        return FormatError(
            reason, path=path, field=f"json.{where}" if where else "json", offset=offset
        )

    return fail


def _meta_fail(reason: str, where: str) -> Exception:
    return MismatchError(reason, key_path=f"meta.{where}" if where else "meta")


def empty_training() -> dict[str, Any]:
    """The ``training`` object of an untrained model, as DataCode writes it."""
    return {
        "stages": [],
        "epochs": None,
        "loss": None,
        "optimizer": None,
        "loss_history": None,
        "accuracy_history": None,
        "val_loss_history": None,
        "val_accuracy_history": None,
    }


# --------------------------------------------------------------------------
# names and variants
# --------------------------------------------------------------------------


def _linear_positions(types: Sequence[str]) -> list[int]:
    return [i for i, t in enumerate(types) if t == "Linear"]


def tensor_names(types: Sequence[str], variant: str) -> list[tuple[int, str]]:
    """``(layer position, "layer<N>")`` of each Linear's tensors in ``variant``'s numbering."""
    positions = _linear_positions(types)
    if variant == "later":
        return [(p, f"layer{k}") for k, p in enumerate(positions)]
    return [(p, f"layer{p}") for p in positions]


def layer_names(types: Sequence[str], variant: str) -> list[str]:
    """The JSON ``name`` DataCode gives each layer in ``variant`` (later: Linear-only count for Linear)."""
    out = [f"layer{i}" for i in range(len(types))]
    if variant == "later":
        for k, p in enumerate(_linear_positions(types)):
            out[p] = f"layer{k}"
    return out


def _check_variant(variant: Any, where: str) -> str | None:
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"{where}: variant must be one of {VARIANTS} or None, not {variant!r}")
    return variant  # type: ignore[no-any-return]


# --------------------------------------------------------------------------
# reading the layout (headers only)
# --------------------------------------------------------------------------


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 3x
class _Tensor:
    """A tensor record's header: where it starts, its name, dims and where its data lies."""

    name: str
    index: int
    part: str
    dims: tuple[int, ...]
    offset: int
    data_offset: int

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.dims)


@dataclass(frozen=True)
class _Layout:
    doc: dict[str, Any]
    layers: list[_LayerSpec]
    tensors: list[_Tensor]
    variant: str
    by_position: dict[int, dict[str, _Tensor]]  # Linear position -> {"weight", "bias"}

    def meta(self) -> dict[str, Any]:
        bias_2d = [f"layer{p}" for p, t in self.by_position.items() if len(t["bias"].dims) == 2]
        return {**self.doc, FILE_KEY: {"variant": self.variant, "bias_2d": bias_2d}}


def _u32(src: ByteSource, offset: int, field: str) -> int:
    return src.reader(offset, 4, field).u32(field)


def _read_tensor(src: ByteSource, pos: int, i: int) -> _Tensor:
    where = f"tensor {i}"
    name_len = _u32(src, pos, f"{where} name length")
    if name_len > _MAX_NAME:
        raise FormatError(
            f"tensor name of {name_len} bytes; DataCode names are 'layer<N>.weight|bias'",
            path=src.name,
            field=f"{where} name length",
            offset=pos,
        )
    name = src.reader(pos + 4, name_len, f"{where} name").text(name_len, f"{where} name")
    m = _TENSOR_NAME.match(name)
    if m is None:
        raise FormatError(
            f"tensor name {name!r} is not 'layer<N>.weight' or 'layer<N>.bias'",
            path=src.name,
            field=f"{where} name",
            offset=pos + 4,
        )
    at = pos + 4 + name_len
    ndim = _u32(src, at, f"{name} ndim")
    if ndim not in (1, 2):
        raise FormatError(
            f"{name} has {ndim} dimensions; DataCode tensors have 1 or 2",
            path=src.name,
            field=f"{name} ndim",
            offset=at,
        )
    reader = src.reader(at + 4, 4 * ndim, f"{name} dims")
    dims = tuple(reader.u32(f"{name} dims") for _ in range(ndim))
    data_offset = at + 4 + 4 * ndim
    tensor = _Tensor(name, int(m.group(1)), m.group(2), dims, pos, data_offset)
    if data_offset + tensor.nbytes > src.size:
        raise FormatError(
            f"truncated: {name} {list(dims)} needs {tensor.nbytes} bytes of data, "
            f"only {src.size - data_offset} remain",
            path=src.name,
            field=f"{name} data",
            offset=data_offset,
        )
    return tensor


def _read_tensors(src: ByteSource, pos: int, count: int) -> list[_Tensor]:
    tensors: list[_Tensor] = []
    seen: set[str] = set()
    for i in range(count):
        tensor = _read_tensor(src, pos, i)
        if tensor.name in seen:
            raise FormatError(
                f"duplicate tensor {tensor.name}",
                path=src.name,
                field=tensor.name,
                offset=tensor.offset,
            )
        seen.add(tensor.name)
        tensors.append(tensor)
        pos = tensor.data_offset + tensor.nbytes
    if pos != src.size:
        raise FormatError(
            f"{src.size - pos} unexpected trailing bytes after the last tensor",
            path=src.name,
            field="end of file",
            offset=pos,
        )
    return tensors


def _fit(
    layers: list[_LayerSpec], tensors: list[_Tensor], variant: str
) -> tuple[dict[int, dict[str, _Tensor]], tuple[str, _Tensor, bool] | None]:
    """Place each tensor under ``variant``: ``(by Linear position, first problem or None)``;
    a problem is ``(reason, tensor, whether the names fit the variant's numbering)``."""
    types = [spec.type for spec in layers]
    positions = _linear_positions(types)
    by_position: dict[int, dict[str, _Tensor]] = {}
    for t in tensors:
        if variant == "seed":
            if t.index >= len(layers) or layers[t.index].type != "Linear":
                what = layers[t.index].type if t.index < len(layers) else "absent"
                return by_position, (f"layer {t.index} is not a Linear layer ({what})", t, False)
            pos = t.index
        else:
            if t.index >= len(positions):
                return by_position, (f"there are only {len(positions)} Linear layers", t, False)
            pos = positions[t.index]
        want = _shapes_fitting(layers[pos], t.part, variant)
        if t.dims not in want:
            label = "[out] or [1, out]" if t.part == "bias" else _WEIGHT_LABEL[variant]
            return by_position, (
                f"{t.name} has shape {list(t.dims)}; layers[{pos}] needs {list(want[0])} {label}",
                t,
                _numbering_fits(layers, tensors, variant),
            )
        by_position.setdefault(pos, {})[t.part] = t
    return by_position, None


_WEIGHT_LABEL = {"seed": "[in, out]", "later": "[out, in]"}


def _shapes_fitting(spec: _LayerSpec, part: str, variant: str) -> tuple[tuple[int, ...], ...]:
    """The dims the file may give a Linear layer's ``part`` in ``variant`` (the usual one first)."""
    if part == "bias":
        return (spec.out_features,), (1, spec.out_features)
    if variant == "seed":
        return ((spec.in_features, spec.out_features),)
    return ((spec.out_features, spec.in_features),)


def _numbering_fits(layers: list[_LayerSpec], tensors: list[_Tensor], variant: str) -> bool:
    positions = _linear_positions([spec.type for spec in layers])
    allowed = set(positions) if variant == "seed" else set(range(len(positions)))
    return all(t.index in allowed for t in tensors)


def _choose_variant(
    src: ByteSource, layers: list[_LayerSpec], tensors: list[_Tensor], variant: str | None
) -> tuple[str, dict[int, dict[str, _Tensor]]]:
    """The variant the file is written in (``variant`` when given) and its tensors by Linear position."""
    candidates = [variant] if variant is not None else list(VARIANTS)
    fits: dict[str, dict[int, dict[str, _Tensor]]] = {}
    problems: dict[str, tuple[str, _Tensor, bool]] = {}
    for v in candidates:  # in VARIANTS order: the first that fits is the one chosen below
        placed, problem = _fit(layers, tensors, v)
        if problem is None:
            fits[v] = placed
            break
        problems[v] = problem
    for v in VARIANTS:  # both fit (square weights, Linear-only numbering): seed
        if v in fits:
            return v, fits[v]
    # Report the problem of the variant whose numbering fits, else of the one that got
    # furthest; seed first on a tie.
    ranked = sorted(
        problems.items(), key=lambda kv: (not kv[1][2], -tensors.index(kv[1][1]), kv[0] != "seed")
    )
    reason, tensor, _ = ranked[0][1]
    name = f" ({variant} variant)" if variant is not None else ""
    raise FormatError(f"{reason}{name}", path=src.name, field=tensor.name, offset=tensor.offset)


def _read_layout(src: ByteSource, variant: str | None = None) -> _Layout:
    magic = bytes(src.read(0, 8, "magic"))
    if magic != MAGIC_BYTES:
        raise FormatError(
            f"not a DataCode file: magic {magic!r}, expected {MAGIC_BYTES!r}",
            path=src.name,
            field="magic",
            offset=0,
        )
    version = _u32(src, 8, "version")
    if version != VERSION:
        raise FormatError(
            f"unsupported version {version}; DataCode writes {VERSION}",
            path=src.name,
            field="version",
            offset=8,
        )
    json_len = _u32(src, 12, "json length")
    raw = src.read(_HEADER, json_len, "json")
    doc = _parse_json(raw, path=src.name, field="json", offset=_HEADER)
    layers = _check_doc(doc, _format_fail(src.name, _HEADER))
    count_at = _HEADER + json_len
    count = _u32(src, count_at, "tensor count")
    n_linear = sum(spec.type == "Linear" for spec in layers)
    if count != 2 * n_linear:
        raise FormatError(
            f"tensor count {count}; the {n_linear} Linear layers need {2 * n_linear}",
            path=src.name,
            field="tensor count",
            offset=count_at,
        )
    tensors = _read_tensors(src, count_at + 4, count)
    chosen, by_position = _choose_variant(src, layers, tensors, variant)
    return _Layout(doc, layers, tensors, chosen, by_position)


def _source(source: Any) -> ByteSource:
    return source if isinstance(source, ByteSource) else BufferSource(source)


# --------------------------------------------------------------------------
# decode / inspect / sniff
# --------------------------------------------------------------------------


def decode(source: Any, *, variant: str | None = None) -> Decoded:
    """The native tree and meta of a ``.nn`` file (either variant; ``variant=`` forces one).

    Arrays are float32 views of ``source`` (no copy); later-variant weights
    are transposed views, ``(in, out)`` like the seed variant's.
    """
    _check_variant(variant, "decode")
    src = _source(source)
    found = slots(src, variant=variant)
    view = src.view()

    def array(slot: Slot) -> np.ndarray:  # the layout checked that the data lies within view
        if slot.fortran:
            return np.ndarray(slot.shape[::-1], _F32, buffer=view, offset=slot.offset).T
        return np.ndarray(slot.shape, _F32, buffer=view, offset=slot.offset)

    native = {k: {p: array(s) for p, s in parts.items()} for k, parts in found.tree.items()}
    return Decoded(native, found.meta)


def slots(source: ByteSource, *, variant: str | None = None) -> Slots:
    """Where each array of `decode`'s native tree lies, from the record headers only.

    Later-variant weights are stored ``(out, in)`` in C order: the same bytes
    as ``(in, out)`` in Fortran order, which is how their slots read them.
    """
    _check_variant(variant, "slots")
    layout = _read_layout(_source(source), variant)
    later = layout.variant == "later"
    tree: dict[str, dict[str, Slot]] = {}
    for pos, parts in sorted(layout.by_position.items()):
        w, b = parts["weight"], parts["bias"]
        tree[f"layer{pos}"] = {
            "weight": Slot(
                w.name,
                w.data_offset,
                w.nbytes,
                w.dims[::-1] if later else w.dims,
                _F32,
                fortran=later,
            ),
            "bias": Slot(b.name, b.data_offset, b.nbytes, (b.nbytes // 4,), _F32),
        }
    return Slots(tree, layout.meta())


def inspect(source: ByteSource) -> Info:
    """Layers, stages and tensors of a ``.nn`` file, reading only its headers and JSON."""
    layout = _read_layout(_source(source))
    entries = tuple(Entry(t.name, t.dims, "float32", t.nbytes) for t in layout.tensors)
    return Info("datacode", entries, layout.meta())


def sniff(probe: Probe) -> float:
    return MAGIC if probe.is_file and probe.head[:8] == MAGIC_BYTES else 0.0


# --------------------------------------------------------------------------
# the native tree against the architecture
# --------------------------------------------------------------------------


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(x, "shape", ()))


_WEIGHT_BIAS = frozenset({"weight", "bias"})


def _native_layers(tree: Any, layers: list[_LayerSpec]) -> dict[int, dict[str, Any]]:
    """The ``{weight, bias}`` of each Linear position, checked against the layer list."""
    if not isinstance(tree, Mapping):
        raise MismatchError(
            "a DataCode tree is {'layer<p>': {'weight', 'bias'}}",
            key_path="",
            found=type(tree).__name__,
        )
    positions = _linear_positions([spec.type for spec in layers])
    want = {f"layer{p}": p for p in positions}
    extra = [] if tree.keys() <= want.keys() else sorted(str(k) for k in tree if k not in want)
    if extra:
        raise MismatchError(
            f"the tree has {extra[:5]}, which are not Linear layers of the layer list",
            key_path=extra[0],
            expected=sorted(want),
        )
    out: dict[int, dict[str, Any]] = {}
    for key, p in want.items():
        if key not in tree:
            raise MismatchError(f"layers[{p}] is Linear but the tree has no {key!r}", key_path=key)
        node = tree[key]
        if not isinstance(node, Mapping) or node.keys() != _WEIGHT_BIAS:
            found = sorted(map(str, node)) if isinstance(node, Mapping) else type(node).__name__
            raise MismatchError(
                "a Linear layer is {'weight', 'bias'}",
                key_path=key,
                expected=["bias", "weight"],
                found=found,
            )
        spec = layers[p]
        w, b = _shape(node["weight"]), _shape(node["bias"])
        if w != (spec.in_features, spec.out_features):
            raise MismatchError(
                "weight shape differs from the layer's (in_features, out_features)",
                key_path=f"{key}/weight",
                expected=(spec.in_features, spec.out_features),
                found=w,
            )
        if b not in ((spec.out_features,), (1, spec.out_features)):
            raise MismatchError(
                "bias shape differs from the layer's (out_features,)",
                key_path=f"{key}/bias",
                expected=(spec.out_features,),
                found=b,
            )
        out[p] = {"weight": node["weight"], "bias": node["bias"]}
    return out


def _host_f32(x: Any, where: str) -> Any:
    """``x`` as a float32 numpy array (float16/bfloat16 widen exactly; anything else is refused)."""
    if type(x) is np.ndarray and x.dtype == np.float32:
        return x  # the common case
    if hasattr(x, "shape") and not hasattr(x, "__array__"):
        raise EncodeError("cannot save an abstract array (ShapeDtypeStruct)", key_path=where)
    arr = x if isinstance(x, Streamed) else np.asarray(x)  # a streamed one is read when written
    if arr.dtype == np.float32:
        return arr
    if arr.dtype.name in ("float16", "bfloat16"):
        return arr.astype(np.float32)
    raise EncodeError(
        f"DataCode stores float32; a {arr.dtype} array would be cast (convert it first)",
        key_path=where,
    )


# --------------------------------------------------------------------------
# the layer list on save
# --------------------------------------------------------------------------


def _record(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The `FILE_KEY` record of ``meta`` (checked), or an empty one."""
    rec = meta.get(FILE_KEY)
    if rec is None:
        return {}
    if (
        not isinstance(rec, Mapping)
        or rec.get("variant", "seed") not in VARIANTS
        or not isinstance(rec.get("bias_2d", []), list | tuple)
        or not all(isinstance(n, str) for n in rec.get("bias_2d", []))
    ):
        raise MismatchError(
            f"meta[{FILE_KEY!r}] must be {{'variant': 'seed'|'later', 'bias_2d': [names]}}",
            key_path=f"meta.{FILE_KEY}",
            found=rec,
        )
    return dict(rec)


def _is_datacode_entry(entry: Any) -> bool:
    return isinstance(entry, Mapping) and "type" in entry and "args" not in entry


def _entry(given: Any, i: int, name: str, shapes: Mapping[str, Any] | None) -> dict[str, Any]:
    """A DataCode layer entry from any accepted spelling; DataCode's own dicts are kept as they are."""
    if _is_datacode_entry(given) and given["type"] in TYPES:
        entry = dict(given)
    else:
        ltype, args, trainable = entry_parts(given, i)
        if ltype not in TYPES:
            raise EncodeError(f"DataCode has no {ltype} layer", key_path=f"layers[{i}]")
        entry = {"type": ltype}
        if ltype == "Linear":
            entry.update(
                {k: args[k] for k in ("in_features", "out_features") if k in args},
                trainable=trainable,
            )
            if args.get("bias", True) is not True:
                raise EncodeError(
                    "DataCode's Linear layers always have a bias", key_path=f"layers[{i}]"
                )
    entry.setdefault("name", name)
    if entry["type"] == "Linear":
        if shapes is not None and len(_shape(shapes.get("weight"))) == 2:
            in_f, out_f = _shape(shapes["weight"])
            entry.setdefault("in_features", in_f)
            entry.setdefault("out_features", out_f)
        entry.setdefault("trainable", True)
    return entry


def _types_of(entries: Sequence[Any]) -> list[str]:
    out = []
    for i, e in enumerate(entries):
        if _is_datacode_entry(e):
            out.append(str(e["type"]))
        else:
            out.append(entry_parts(e, i)[0])
    return out


def _renamed(entries: list[dict[str, Any]], types: list[str], old: str, new: str) -> None:
    """Give entries that carry ``old``'s canonical name ``new``'s (a save in another variant)."""
    if old == new:
        return
    for entry, was, now in zip(entries, layer_names(types, old), layer_names(types, new)):
        if entry.get("name") == was:
            entry["name"] = now


def _inferred_entries(tree: Any) -> list[Any]:
    """Without a layer list: a tree of ``layer0 .. layer<n-1>`` is n Linear layers."""
    keys = list(tree) if isinstance(tree, Mapping) else []
    if keys and sorted(keys, key=str) == sorted((f"layer{i}" for i in range(len(keys))), key=str):
        return ["Linear"] * len(keys)
    raise MismatchError(
        "cannot tell the layer list from the tree (activations leave gaps in the layer "
        "indices); pass meta={'layers': [...]} listing every layer",
        key_path="meta.layers",
    )


def _document(
    tree: Any, meta: Mapping[str, Any] | None, variant: str
) -> tuple[dict[str, Any], list[str] | None]:
    """The JSON document to write for ``tree`` (layer list completed, defaults filled) and its
    bias_2d (None: the variant's own)."""
    meta = {} if meta is None else meta
    if not isinstance(meta, Mapping):
        raise MismatchError("meta must be a mapping (the DataCode document)", key_path="meta")
    record = _record(meta)
    given = meta.get("layers")
    if given is None:
        given = _inferred_entries(tree)
    elif not isinstance(given, list | tuple):
        raise MismatchError("meta['layers'] must be a list", key_path="meta.layers")
    types = _types_of(given)
    names = layer_names(types, variant)
    nodes = tree if isinstance(tree, Mapping) else {}
    entries = [_entry(g, i, names[i], nodes.get(f"layer{i}")) for i, g in enumerate(given)]
    for i, entry in enumerate(entries):
        if entry["type"] == "Linear" and f"layer{i}" not in nodes:
            raise MismatchError(
                f"layers[{i}] is Linear but the tree has no 'layer{i}'", key_path=f"layer{i}"
            )
    _renamed(entries, types, record.get("variant", variant), variant)
    doc = {k: v for k, v in meta.items() if k != FILE_KEY}
    doc["layers"] = entries
    doc.setdefault("device", "cpu")
    doc.setdefault("training", empty_training())
    return doc, _bias_2d(record, variant)


def _bias_2d(record: Mapping[str, Any], variant: str) -> list[str] | None:
    """The layers whose bias ``record`` says a ``variant`` file stores as ``[1, out]``, or None
    where it says nothing for ``variant`` (then the variant's own writer's shape is used)."""
    if "bias_2d" not in record or record.get("variant", variant) != variant:
        return None
    return list(record["bias_2d"])


# --------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------


def _resolve_variant(variant: str | None, meta: Any) -> str:
    _check_variant(variant, "encode")
    if variant is not None:
        return variant
    if isinstance(meta, Mapping):
        return str(_record(meta).get("variant", "seed"))
    return "seed"


def encode(
    tree: Any, *, meta: Mapping[str, Any] | None = None, variant: str | None = None
) -> Encoded:
    """A ``.nn`` file of a native tree (float32 arrays referenced, not copied).

    ``meta``: the document as `decode` returns it; layer entries may be
    spelt as `pytreeio.model.form.entry_parts` accepts, missing fields
    come from the arrays, ``device`` defaults to ``"cpu"`` and ``training`` to
    the untrained one; without ``layers`` the tree is all Linear layers.
    ``variant``: default the one ``meta`` records, else ``"seed"`` (the other
    variant's canonical layer names are renamed).  Biases are ``[1, out]`` in the seed
    variant and ``[out]`` in the later one unless ``meta`` records ``bias_2d`` for the variant.
    """
    chosen = _resolve_variant(variant, meta)
    doc, bias_2d = _document(tree, meta, chosen)
    # DataCode 2.1.0 (the seed variant's last writer) saves every bias [1, out]; later ones [out]
    two_dims = set(bias_2d) if bias_2d is not None else None
    layers = _check_doc(doc, _meta_fail)
    arrays = _native_layers(tree, layers)
    try:
        text = serde_json.dump_bytes(doc)
    except EncodeError as exc:
        raise EncodeError(
            exc.reason, key_path=f"meta.{exc.key_path}" if exc.key_path else "meta"
        ) from None
    if len(text) > _MAX_DIM:
        raise EncodeError(
            f"the JSON document has {len(text)} bytes; u32 holds less", key_path="meta"
        )
    w = Writer()
    w.raw(MAGIC_BYTES)
    w.u32(VERSION)
    w.u32(len(text))
    w.raw(text)
    w.u32(2 * len(arrays))
    types = [spec.type for spec in layers]
    parts: list[Any] = []
    for pos, name in tensor_names(types, chosen):
        node = arrays[pos]
        weight = _host_f32(node["weight"], f"layer{pos}/weight")
        bias = _host_f32(node["bias"], f"layer{pos}/bias")
        out = layers[pos].out_features
        listed = chosen == "seed" if two_dims is None else f"layer{pos}" in two_dims
        bias_dims = (1, out) if bias.ndim == 2 or listed else (out,)
        parts += _tensor(f"{name}.weight", weight.T if chosen == "later" else weight)
        parts += _tensor(f"{name}.bias", bias.reshape(bias_dims))
    w.extend(parts, _F32)
    return Encoded(chunks=tuple(w.finish()))


def _tensor(name: str, arr: Any) -> tuple[bytes, Any]:
    """A tensor record: its header and its values (1 or 2 dims, checked against the layers)."""
    raw = name.encode("utf-8")
    dims = _DIMS[arr.ndim].pack(*map(int, arr.shape))
    return _U32.pack(len(raw)) + raw + _U32.pack(arr.ndim) + dims, arr


# --------------------------------------------------------------------------
# the common model form
# --------------------------------------------------------------------------


def to_model(native: Any, meta: Mapping[str, Any]) -> Model:
    """The common `Model` of a native tree and its document; what the document holds
    beyond the layers goes to ``model.extras['datacode']`` (refused elsewhere unless ``lossy``)."""
    if not isinstance(meta, Mapping):
        raise MismatchError("meta must be the DataCode document", key_path="meta")
    doc = {k: v for k, v in meta.items() if k != FILE_KEY}
    layers = _check_doc(doc, _meta_fail)
    arrays = _native_layers(native, layers)
    out = []
    for p, spec in enumerate(layers):
        if spec.type != "Linear":
            out.append(Layer(spec.type))
            continue
        bias = arrays[p]["bias"]
        if len(_shape(bias)) == 2:
            bias = bias.reshape(spec.out_features)
        args = {"in_features": spec.in_features, "out_features": spec.out_features, "bias": True}
        kernel = arrays[p]["weight"]
        out.append(Layer("Linear", args, {"kernel": kernel, "bias": bias}, spec.trainable))
    extras = _extras(doc, [spec.type for spec in layers], _record(meta).get("variant", "seed"))
    return Model(tuple(out), extras={FORMAT_NAME: extras} if extras else {})


def _extras(doc: Mapping[str, Any], types: list[str], variant: str) -> dict[str, Any]:
    """What the document holds beyond the layer list: training record, device, names, other keys.

    Only what carries information: an untrained ``training``, the ``cpu``
    device and DataCode's own layer names are what `from_model` writes
    anyway.
    """
    out: dict[str, Any] = {}
    training = doc.get("training")
    if (
        isinstance(training, Mapping) and any(v not in (None, [], {}) for v in training.values())
    ) or (training is not None and not isinstance(training, Mapping)):
        out["training"] = training
    if doc.get("device", "cpu") != "cpu":
        out["device"] = doc["device"]
    names = [entry.get("name") for entry in doc.get("layers", [])]
    if names != layer_names(types, variant) and any(n is not None for n in names):
        out["layer names"] = names
    for k, v in doc.items():
        if k not in ("layers", "training", "device"):
            out[k] = v
    return out


def _refuse_layers(model: Model, lossy: bool) -> None:
    bad = [f"layer {i} ({la.type})" for i, la in enumerate(model.layers) if la.type not in TYPES]
    if bad:
        raise ConversionError(
            f"DataCode has no layer type for: {', '.join(bad)} (it knows {', '.join(TYPES)})",
            what=bad,
        )
    no_bias = [
        f"layer {i} (Linear without bias)"
        for i, la in enumerate(model.layers)
        if la.type == "Linear" and "bias" not in la.arrays
    ]
    if no_bias and not lossy:
        raise ConversionError(
            f"DataCode's Linear layers always have a bias: {', '.join(no_bias)}; "
            "lossy=True writes zeros",
            what=no_bias,
        )
    if no_bias:
        warnings.warn(
            f"DataCode: writing zero biases for {', '.join(no_bias)}", PytreeioWarning, stacklevel=4
        )


def _drop_training_state(model: Model, lossy: bool) -> None:
    dropped = []
    if model.opt_state is not None:
        dropped.append(f"optimizer state ({model.opt_state.kind} moments)")
    if model.step is not None and (model.opt_state is None or model.opt_state.count != model.step):
        dropped.append("step counter")  # a step equal to the optimizer's count is part of its state
    if not dropped:
        return
    if not lossy:
        raise ConversionError(
            f"DataCode files hold no {' or '.join(dropped)} (only a stage's hyperparameters, "
            "see pytreeio.formats.datacode.training.stage_record); pass lossy=True to drop it",
            what=dropped,
        )
    warnings.warn(f"DataCode: dropping {', '.join(dropped)}", PytreeioWarning, stacklevel=4)


def _model_entry(layer: Layer, i: int, name: str, given: Any) -> dict[str, Any]:
    entry = dict(given) if _is_datacode_entry(given) and given.get("type") == layer.type else {}
    entry["type"] = layer.type
    entry.setdefault("name", name)
    if layer.type == "Linear":
        for key in ("in_features", "out_features"):
            if key in entry and entry[key] != layer.args[key]:
                raise MismatchError(
                    f"meta says {key}={entry[key]!r}, the model's arrays {layer.args[key]}",
                    key_path=f"meta.layers[{i}].{key}",
                )
            entry[key] = layer.args[key]
        entry["trainable"] = layer.trainable
    return entry


def from_model(
    model: Model,
    meta: Mapping[str, Any] | None = None,
    *,
    lossy: bool = False,
    variant: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A native tree and document for ``model``; ``meta`` (a DataCode document) supplies
    ``device``, ``training`` and layer names (its entries are kept where they match),
    and ``model.extras['datacode']`` (what `to_model` kept) what ``meta`` does not.

    Conv, BatchNorm, LeakyReLU, Dropout, MaxPool layers are a
    `ConversionError` naming them.  An optimizer state or step counter
    is one too (DataCode keeps hyperparameters only, in ``training.stages``),
    unless ``lossy=True``, which drops it with a warning.
    """
    chosen = _resolve_variant(variant, meta)
    meta = {} if meta is None else meta
    if not isinstance(meta, Mapping):
        raise MismatchError("meta must be a mapping (the DataCode document)", key_path="meta")
    kept = model.extras.get(FORMAT_NAME) or {}
    if kept and len(kept.get("layer names") or []) == len(model.layers):
        given_names = [{"name": n} if n is not None else {} for n in kept["layer names"]]
    else:
        given_names = []
    meta = {
        **{k: v for k, v in kept.items() if k != "layer names"},
        **meta,
    }
    _refuse_layers(model, lossy)
    _drop_training_state(model, lossy)
    given = layer_list(meta) or []
    if given and len(given) != len(model.layers):
        raise MismatchError(
            f"meta lists {len(given)} layers, the model has {len(model.layers)}",
            key_path="meta.layers",
        )
    types = [la.type for la in model.layers]
    names = layer_names(types, chosen)
    if not given and given_names:  # names kept from a DataCode file this model was read from
        given = [{**g, "type": t} for g, t in zip(given_names, types)]
    entries = [
        _model_entry(la, i, names[i], given[i] if given else None)
        for i, la in enumerate(model.layers)
    ]
    native: dict[str, Any] = {}
    for i, la in enumerate(model.layers):
        if la.type == "Linear":
            bias = la.arrays.get("bias")
            if bias is None:  # lossy: DataCode's Linear always adds a bias
                bias = np.zeros(la.args["out_features"], np.float32)
            native[f"layer{i}"] = {"weight": la.arrays["kernel"], "bias": bias}
    record = _record(meta)
    _renamed(entries, types, record.get("variant", chosen), chosen)
    linear = {f"layer{p}" for p in _linear_positions(types)}
    doc = {k: v for k, v in meta.items() if k not in ("layers", FILE_KEY)}
    doc["layers"] = entries
    doc.setdefault("device", "cpu")
    doc.setdefault("training", empty_training())
    doc[FILE_KEY] = {"variant": chosen}
    bias_2d = _bias_2d(record, chosen)
    if bias_2d is not None:  # else the variant's own writer's bias shape
        doc[FILE_KEY]["bias_2d"] = [n for n in bias_2d if n in linear]
    return native, doc


FORMAT = register(
    Format(
        name=FORMAT_NAME,
        description="DataCode .nn (Rust): DATACODE header, serde_json architecture, f32 tensors",
        suffixes=(".nn",),
        layout=FILE,
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
