"""cl-waffe2 ``:wf2model`` directories (``specs/003``, FORMATS.md "cl-waffe2").

On disk, as ``(save-weights model "<p>" :wf2model [:optimizers t])`` writes it::

    <p>/
      parameters.json      one JSON object on one line, no spaces, no trailing
                           newline (written by the ``jonathan`` library):
                             "<key>": "<p>/<key>.npy"   a tensor: <p> exactly as
                                                        the caller passed it
                             "<key>": 0.01 | 3          a number: floats with ~F
                                                        (fixed, shortest digits that
                                                        read back as the same
                                                        single-float), integers plainly
                           entries in reverse parameter order, each parameter
                           followed by its optimizer entries (Adam: lr, eps,
                           beta1, beta2, n, m, v; SGD: lr)
      <key>.npy            one per tensor entry (the ':' stays in the file name):
                           .npy 1.0, 1-D of the element count, C order of the
                           tensor (LinearLayer weights are (out, in)) - byte-identical
                           to np.save of the flattened array
      pytreeio-waffe2.json only in directories pytreeio wrote with something to keep
                           that cl-waffe2 has no place for (cl-waffe2 never reads
                           it): {"format": "pytreeio/waffe2", "version": 1,
                           "parameters_sha256": <hex of parameters.json>,
                           "shapes": {key: [dims]}, "layers": [...],
                           "step": TrainState.step, "count": an SGD state's count}.
                           Ignored, with a warning, once parameters.json no longer
                           matches its hash (cl-waffe2 saved into the directory).

Keys (:mod:`pytreeio.formats.waffe2.keys`): ``param:{composite}.{nth}.{slot}`` and
``optimizer:{composite}.{nth}.{slot}.{optimizer}.{type}.{optslot}`` (and the
``missing_`` variants), NTH counted per (composite, slot) in parameter order.

**Native tree**: the keys unflattened by their parts, without ``{type}``::

    {'param': {'linearlayer': {'0': {'weights': array, 'bias': array}, ...}},
     'optimizer': {'linearlayer': {'0': {'weights': {'adam': {'lr': 0.01, 'eps': 1e-07,
         'beta1': 0.9, 'beta2': 0.999, 'n': 3, 'm': array, 'v': array}}}}}}

Arrays are 1-D as stored unless the sidecar gives their shapes.  Numbers are
Python ``int``/``float``.  **Meta**: ``{'keys': [the file's keys, in order]}``;
from pytreeio's sidecar also ``'layers'``, ``'step'`` and ``'count'``.  Saving a native
tree with that meta writes the same bytes: entries follow ``meta['keys']``
when it names exactly the tree's entries (else the tree's own order, each
parameter followed by its optimizer entries), and a float keeps the
``double-float`` spelling it had there.  Types are written as cl-waffe2 would:
``bit``/``(integer 0 4611686018427387903)``/``fixnum`` from the integer,
``single-float`` for floats, ``cputensor`` (``tensor_class=``) for arrays.

**Save options**: ``optimizers`` (``False`` writes parameters only, as
cl-waffe2's default; model-shaped trees default to ``False``, native trees are
written as given, a model converted from another checkpoint keeps its state),
``save_dir`` (the ``<p>`` written into path strings;
default: the destination exactly as passed), ``sidecar`` (``None``: when some
shape or layer list would otherwise be lost), ``tensor_class``, ``naming``
(composite/slot names per layer type, :class:`LayerNaming`), ``hyperparams``
(optimizer hyperparameters the optax state does not record).

**Loading** is safer than cl-waffe2's loader, which opens every path string
as given: each tensor is read as ``<dir>/<basename of its path string>``, a
file directly inside the checkpoint directory; the directory part of the
path (absolute, ``..``, another checkpoint) is never opened, a basename that
is not such a file (``..``, empty, a symlink leaving the directory, which
:mod:`pytreeio.io` never lists) is a :class:`FormatError`.  ``fortran_order``
arrays are refused, as cl-waffe2 refuses them.  ``n`` is read from either
spelling (``bit`` or ``(integer ...)``).

**Load options**: ``layers`` (cl-waffe2 stores no shapes: the layer list,
with in/out features, that ``to_model`` needs unless the sidecar has it; a
native-shaped ``like`` gives the shapes itself, element counts checked),
``naming``, ``strict`` and ``report``.  With ``strict=True`` (default) keys
missing from the file or left over raise :class:`MismatchError` listing them
by name; ``strict=False`` (cl-waffe2's behaviour) restores the rest, keeps
``like``'s value for a missing entry, warns, and fills the dict passed as
``report=`` with ``{'missing': [...], 'extra': [...]}`` (a model-shaped
``like`` cannot keep values, so missing parameters still raise there).
Element counts and dtypes (a ``<f8`` file into a float32 ``like``) must match.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from pytreeio import jsonsafe
from pytreeio.containers import npy
from pytreeio.core import dtypes
from pytreeio.core.binary import ByteSource, Deferred, Reader, Slot, Slots, Streamed, as_memoryview
from pytreeio.core.errors import (
    ConversionError,
    EncodeError,
    FormatError,
    MismatchError,
    PytreeioWarning,
)
from pytreeio.core.records import DIRECTORY, STRUCTURE, Decoded, Encoded, Entry, Format, Info, Probe
from pytreeio.core.tree import describe_leaf, is_array_leaf
from pytreeio.core.tree import restore as restore_leaf
from pytreeio.formats.registry import register
from pytreeio.formats.waffe2.keys import (
    OPTIMIZER_PREFIXES,
    PARAM_PREFIXES,
    StateDictKey,
    TypeSpec,
    assign_nth,
    format_lisp_float,
    jonathan_string,
    make_key,
    parse_state_dict_key,
    parse_type_specifier,
    type_of,
)
from pytreeio.model.form import (
    LAYERS,
    Layer,
    Model,
    entry_parts,
    is_flax_tree,
    is_model_like,
    layer_list,
    normalize_layers,
    refuse,
)

__all__ = [
    "FORMAT",
    "PARAMETERS",
    "SIDECAR",
    "LayerNaming",
    "NAMING",
    "encode",
    "decode",
    "inspect",
    "slots",
    "sniff",
    "restore",
    "to_model",
    "from_model",
]

PARAMETERS = "parameters.json"
SIDECAR = "pytreeio-waffe2.json"
_SIDECAR_FORMAT = "pytreeio/waffe2"
_MAX_NAME_BYTES = 255  # a file name on Linux file systems
_MAX_NDIM = 32

#: Adam's slots in the order cl-waffe2 writes them (``find-params`` order).
ADAM_SLOTS = ("lr", "eps", "beta1", "beta2", "n", "m", "v")
_ADAM_HYPER = {"lr": "learning_rate", "eps": "eps", "beta1": "b1", "beta2": "b2"}
#: optax.adam's defaults, for an optax state that records no hyperparameters.
_OPTAX_ADAM_DEFAULTS = {"b1": 0.9, "b2": 0.999, "eps": 1e-8}


# --------------------------------------------------------------------------
# layer naming: the common model form <-> cl-waffe2 composites and slots
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerNaming:
    """How one layer type of :data:`pytreeio.model.form.LAYERS` is named in a cl-waffe2 state dict.

    Attributes:
      composite: the composite (layer class) name, lower case (``linearlayer``).
      slots: Flax array name -> cl-waffe2 slot name, in parameter order
        (``{'kernel': 'weights', 'bias': 'bias'}``).  The first slot starts a
        layer when the layer list has to be read from the file's key order.
      axes: Flax array name -> the permutation from Flax orientation to
        cl-waffe2's (``{'kernel': (1, 0)}``: (in, out) -> (out, in)).
    """

    composite: str
    slots: Mapping[str, str]
    axes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


NAMING: dict[str, LayerNaming] = {
    "Linear": LayerNaming("linearlayer", {"kernel": "weights", "bias": "bias"}, {"kernel": (1, 0)}),
    # cl-waffe2's Conv2D: weight (out, in/groups, kh, kw), bias (out)
    "Conv2d": LayerNaming("conv2d", {"kernel": "weight", "bias": "bias"}, {"kernel": (3, 2, 0, 1)}),
}


def _namings(naming: Mapping[str, Any] | None) -> dict[str, LayerNaming]:
    """The default naming updated by the caller's (``LayerNaming`` or a dict of its fields)."""
    out = dict(NAMING)
    if naming is None:
        return out
    if not isinstance(naming, Mapping):
        raise MismatchError(
            "naming must map layer types to LayerNaming",
            key_path="naming",
            found=type(naming).__name__,
        )
    for ltype, value in naming.items():
        where = f"naming/{ltype}"
        if ltype not in LAYERS or not LAYERS[ltype].arrays:
            raise MismatchError(
                f"{ltype!r} is not a layer type with arrays",
                key_path=where,
                expected=sorted(t for t, s in LAYERS.items() if s.arrays),
            )
        if isinstance(value, Mapping):
            try:
                value = LayerNaming(
                    value["composite"], dict(value["slots"]), dict(value.get("axes") or {})
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise MismatchError(
                    f"needs 'composite' and 'slots' ({exc})", key_path=where
                ) from None
        if not isinstance(value, LayerNaming):
            raise MismatchError("must be a LayerNaming", key_path=where, found=type(value).__name__)
        _check_naming(ltype, value, where)
        out[ltype] = value
    return out


def _check_naming(ltype: str, nm: LayerNaming, where: str) -> None:
    names = [nm.composite, *nm.slots.values()]
    if not all(
        isinstance(n, str) and n and n == n.lower() and not set(n) & set(".:/ \0") for n in names
    ):
        raise MismatchError(
            "composite and slot names must be non-empty lower-case names without '.', ':', '/'",
            key_path=where,
            found=names,
        )
    for k, axes in nm.axes.items():
        if k not in nm.slots or sorted(axes) != list(range(len(axes))):
            raise MismatchError(
                f"axes[{k!r}] must be a permutation for one of the slots",
                key_path=where,
                found=axes,
            )
    unknown = [k for k in nm.slots if k not in LAYERS[ltype].arrays]
    if unknown or len(set(nm.slots.values())) != len(nm.slots):
        raise MismatchError(
            f"slots must map distinct names to {ltype} arrays {list(LAYERS[ltype].arrays)}",
            key_path=where,
            found=dict(nm.slots),
        )


def _composite_types(namings: Mapping[str, LayerNaming]) -> dict[str, str]:
    """composite name -> layer type (the first naming that uses it)."""
    out: dict[str, str] = {}
    for ltype, nm in namings.items():
        out.setdefault(nm.composite, ltype)
    return out


def _flax_shapes(ltype: str, args: Mapping[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """The Flax-orientation shape of each array of a layer, or None when its args do not say."""
    full = {k: args.get(k, d) for k, d in LAYERS[ltype].args}
    try:
        if ltype == "Linear":
            i, o = int(full["in_features"]), int(full["out_features"])
            return {"kernel": (i, o), "bias": (o,)}
        if ltype == "Conv2d":
            k, g = int(full["kernel_size"]), int(full["groups"])
            i, o = int(full["in_channels"]), int(full["out_channels"])
            return {"kernel": (k, k, i // g, o), "bias": (o,)}
        if ltype == "BatchNorm2d":
            n = int(full["num_features"])
            return dict.fromkeys(LAYERS[ltype].arrays, (n,))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):  # groups=0: args say nothing
        return None
    return {}


def _inverse(axes: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(axes))


def _to_stored(arr: Any, axes: Sequence[int] | None) -> Any:
    """A Flax-orientation array in cl-waffe2's orientation, on the host.

    A numpy array (or a jax array on a CPU backend, whose memory numpy
    shares) becomes a transposed *view*: :func:`encode` writes it band by
    band (:func:`_npy_chunks`), so a save never holds a transposed copy of
    the tree nor sends host memory to a device and back.  A jax array on an
    accelerator is transposed there by the jit transpose, then copied out.
    """
    from pytreeio.core import quant

    if isinstance(arr, Streamed):  # a conversion's: transposed when it is read
        return arr if axes is None or arr.ndim != len(axes) else arr.transpose(tuple(axes))
    if axes is None or np.ndim(arr) != len(axes):
        return np.asarray(arr)
    if isinstance(arr, np.ndarray) or quant.on_cpu():
        return np.asarray(arr).transpose(tuple(int(a) for a in axes))
    return quant.transpose(arr, axes)


def _c_order(arr: Any) -> Any:
    """A transposed view copied into C order (tiled, on the cores); anything else as it is.

    A streamed transposed view is copied when it is read.
    """
    from pytreeio.core.transpose import copy_transposed

    if isinstance(arr, Streamed):
        return arr.c_order()
    if not isinstance(arr, np.ndarray) or arr.flags.c_contiguous:
        return arr
    out = np.empty(arr.shape, arr.dtype)
    copy_transposed(arr, out)
    return out


def _array(value: Any) -> Any:
    """A native tree's array on the host; a :class:`~pytreeio.core.binary.Streamed` one stays unread."""
    return value if isinstance(value, Streamed) else np.asarray(value)


def _to_flax(
    arr: Any, stored_shape: tuple[int, ...] | None, axes: Sequence[int] | None, where: str
) -> Any:
    """A stored array (1-D, or already in its stored shape) in Flax orientation (a view)."""
    from pytreeio.core import quant

    if stored_shape is not None and tuple(arr.shape) != stored_shape:
        if arr.size != math.prod(stored_shape):
            raise MismatchError(
                "element count differs",
                key_path=where,
                expected=f"{math.prod(stored_shape)} elements {list(stored_shape)}",
                found=f"{arr.size} elements {list(arr.shape)}",
            )
        arr = arr.reshape(stored_shape)
    if axes is None or arr.ndim != len(axes):
        return arr
    if arr.dtype.isnative:
        # A transposed view, no copy: the values are the file's, and whoever needs C
        # order (an encoder, jax.device_put) pays one copy then, or none (a waffe2 save
        # of it writes its C-ordered memory as is).
        return arr.transpose(_inverse(axes))
    return quant.transpose(arr, _inverse(axes))  # byte-swapped: a native-order copy


# --------------------------------------------------------------------------
# the native tree as a list of entries
# --------------------------------------------------------------------------


class _Entry(NamedTuple):
    """One state-dict entry: prefix, the key parts without {type}, and its value."""

    prefix: str
    parts: tuple[str, ...]  # (composite, nth, slot) or (..., optimizer, optslot)
    value: Any

    @property
    def ident(self) -> tuple[str, ...]:
        return (self.prefix, *self.parts)

    @property
    def base(self) -> tuple[str, str, str]:
        return self.parts[0], self.parts[1], self.parts[2]


def _ident_of(key: StateDictKey) -> tuple[str, ...]:
    if key.is_param:
        return (key.prefix, *key.parts)
    c, n, s, opt, _type, slot = key.parts
    return (key.prefix, c, n, s, opt, slot)


def _name(part: Any, where: str) -> str:
    """A native-tree key as a key part: what cl-waffe2 could have written, else EncodeError."""
    if isinstance(part, int) and not isinstance(part, bool):
        part = str(part)
    if not isinstance(part, str) or not part or part != part.lower() or set(part) & set(".:/\0"):
        raise EncodeError(
            f"{part!r} cannot be a cl-waffe2 key part (lower-case, non-empty, no '.', ':', '/')",
            key_path=where,
        )
    return part


def _children(node: Any, where: str, depth_left: int) -> list[tuple[str, Any]]:
    if not isinstance(node, Mapping):
        want = "a dict" if depth_left else "a value"
        raise EncodeError(f"expected {want}, found {type(node).__name__}", key_path=where)
    return [(_name(k, f"{where}/{k}"), v) for k, v in node.items()]


def _leaves(
    node: Any, depth: int, where: str, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], Any]]:
    """``(parts, value)`` of a nested dict exactly ``depth`` levels deep, in its order."""
    if depth == 0:
        return [(path, node)]
    out = []
    for k, v in _children(node, where, depth):
        out.extend(_leaves(v, depth - 1, f"{where}/{k}", (*path, k)))
    return out


def _tree_entries(tree: Any) -> list[_Entry]:
    """The entries of a native tree in its own order: each parameter, then its optimizer entries."""
    if not isinstance(tree, Mapping):
        raise EncodeError(
            f"a waffe2 tree is a dict with keys {', '.join(PARAM_PREFIXES + OPTIMIZER_PREFIXES)} "
            f"(or a model-shaped tree), not a {type(tree).__name__}"
        )
    unknown = [k for k in tree if k not in PARAM_PREFIXES + OPTIMIZER_PREFIXES]
    if unknown:
        raise EncodeError(
            f"unknown top-level keys {unknown}: a waffe2 tree holds "
            f"{', '.join(PARAM_PREFIXES + OPTIMIZER_PREFIXES)}",
            key_path=str(unknown[0]),
        )
    out: list[_Entry] = []
    for pprefix, oprefix in zip(PARAM_PREFIXES, OPTIMIZER_PREFIXES, strict=True):
        params = [_Entry(pprefix, p, v) for p, v in _leaves(tree.get(pprefix, {}), 3, pprefix)]
        opts = [_Entry(oprefix, p, v) for p, v in _leaves(tree.get(oprefix, {}), 5, oprefix)]
        by_base: dict[tuple[str, str, str], list[_Entry]] = {}
        for e in opts:
            by_base.setdefault(e.base, []).append(e)
        for e in params:
            out.append(e)
            out.extend(by_base.pop(e.base, []))
        for rest in by_base.values():  # optimizer entries without their parameter (:weights nil)
            out.extend(rest)
    return out


# --------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------


def _meta_spellings(
    meta: Mapping[str, Any] | None, entries: list[_Entry]
) -> tuple[list[_Entry], dict[tuple[str, ...], str]]:
    """The entries in ``meta['keys']`` order (when it names exactly them) and its {type} spellings."""
    keys = meta.get("keys") if meta else None
    if not isinstance(keys, list | tuple):
        return entries, {}
    by_ident = {e.ident: e for e in entries}
    ordered: list[_Entry] = []
    seen: set[tuple[str, ...]] = set()
    spelled: dict[tuple[str, ...], str] = {}
    for key in keys:
        try:
            parsed = parse_state_dict_key(key)
        except FormatError:
            return entries, {}
        ident = _ident_of(parsed)
        if ident not in by_ident or ident in seen:
            return entries, {}
        seen.add(ident)
        ordered.append(by_ident[ident])
        if parsed.type is not None:
            spelled[ident] = parsed.type
    if len(ordered) != len(entries):
        return entries, {}
    return ordered, spelled


def _type_for(
    e: _Entry, spelled: Mapping[tuple[str, ...], str], tensor_class: str, where: str
) -> str:
    """The {type} part of an optimizer entry, as cl-waffe2 would compute it."""
    value = e.value
    old = spelled.get(e.ident)
    kind = None
    if old is not None:
        try:
            kind = parse_type_specifier(old).kind
        except FormatError:
            kind = None
    if is_array_leaf(value) and not isinstance(value, np.generic):
        return old if old is not None and kind == "tensor" else tensor_class
    if isinstance(value, float) and not isinstance(value, np.generic) and old and kind == "float":
        return old  # a double-float stays one
    try:
        return type_of(value)
    except EncodeError as exc:
        raise EncodeError(exc.reason, key_path=where) from None


def _number_text(value: Any, type_spec: str, where: str) -> str:
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        return str(int(value))
    try:
        return format_lisp_float(float(value), double=type_spec == "double-float")
    except (ValueError, TypeError, OverflowError) as exc:
        raise EncodeError(
            f"cannot write {value!r} as a cl-waffe2 number: {exc}", key_path=where
        ) from None


def _tensor_data(value: Any, where: str) -> Any:
    if not is_array_leaf(value) or isinstance(value, np.generic):
        raise EncodeError(
            f"a parameter must be an array, found {describe_leaf(value)}", key_path=where
        )
    if isinstance(value, Streamed):  # read when its file is written
        why = dtypes.check_plain(value.dtype)
        if why is not None:
            raise EncodeError(why, key_path=where)
        return value
    try:
        arr = np.asarray(value)
    except Exception as exc:  # a ShapeDtypeStruct or a tracer: no values to write
        raise EncodeError(
            f"this leaf has no values to write ({type(exc).__name__})", key_path=where
        ) from None
    why = dtypes.check_plain(arr.dtype)
    if why is not None:
        raise EncodeError(why, key_path=where)
    return dtypes.little_endian(arr)  # a strided view is written band by band, not copied whole


@dataclass
class _Written:
    """What encode builds before turning it into bytes."""

    pairs: list[tuple[str, str]] = field(default_factory=list)  # key, JSON value text
    files: dict[str, Any] = field(default_factory=dict)  # file name -> 1-D array
    shapes: dict[str, list[int]] = field(default_factory=dict)


def _sidecar_bytes(params_json: bytes, written: _Written, meta: Mapping[str, Any] | None) -> bytes:
    doc: dict[str, Any] = {
        "format": _SIDECAR_FORMAT,
        "version": 1,
        "parameters_sha256": hashlib.sha256(params_json).hexdigest(),
        "shapes": written.shapes,
    }
    if meta and meta.get("layers") is not None:
        doc["layers"] = _json_ready_layers(meta["layers"])
    for name in ("step", "count"):
        if meta and meta.get(name) is not None:
            doc[name] = int(meta[name])
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _json_ready_layers(layers: Any) -> list[Any]:
    entries = layer_list(layers)
    if entries is None:
        raise EncodeError("meta['layers'] must be a list of layer entries", key_path="meta/layers")
    out = []
    for i, entry in enumerate(entries):
        ltype, args, trainable = entry_parts(entry, i)
        item: dict[str, Any] = {"type": ltype, "args": dict(args)}
        if not trainable:
            item["trainable"] = False
        out.append(item)
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EncodeError(
            f"meta['layers'] is not JSON-ready: {exc}", key_path="meta/layers"
        ) from None
    return out


def _check_meta(meta: Mapping[str, Any] | None) -> None:
    if meta is None:
        return
    extra = sorted(set(meta) - {"keys", "layers", "step", "count"})
    if extra:
        raise EncodeError(
            f"cl-waffe2 has no place for meta {extra} (waffe2 meta holds 'keys', and "
            "'layers'/'step'/'count' kept in pytreeio's sidecar)",
            key_path="meta",
        )
    for name in ("step", "count"):
        value = meta.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | np.integer)
        ):
            raise EncodeError(f"meta[{name!r}] must be an integer", key_path=f"meta/{name}")


def encode(
    tree: Any,
    *,
    meta: Mapping[str, Any] | None = None,
    dest: str | None = None,
    optimizers: bool | None = None,
    save_dir: str | None = None,
    sidecar: bool | None = None,
    tensor_class: str = "cputensor",
) -> Encoded:
    """A native tree as the files of a ``:wf2model`` directory (see the module docstring).

    ``dest`` is the destination exactly as the caller passed it; path strings
    are ``f"{save_dir or dest}/{key}.npy"`` (bare ``f"{key}.npy"`` when both are
    None).  ``optimizers=False`` leaves out every optimizer entry.
    """
    _check_meta(meta)
    if not isinstance(tensor_class, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_\-]*", tensor_class):
        raise EncodeError(f"tensor_class {tensor_class!r} is not a lower-case class name")
    entries = _tree_entries(tree)
    entries, spelled = _meta_spellings(meta, entries)
    if optimizers is False:
        entries = [e for e in entries if e.prefix in PARAM_PREFIXES]
    prefix = save_dir if save_dir is not None else dest
    if prefix is not None and not isinstance(prefix, str):
        raise EncodeError(f"save_dir must be a string, not {type(prefix).__name__}")
    written = _Written()
    for e in entries:
        _write_entry(e, spelled, tensor_class, prefix, written)
    _check_text(written.pairs)
    body = "{" + ",".join(f"{jonathan_string(k)}:{v}" for k, v in written.pairs) + "}"
    params_json = body.encode("utf-8", "surrogatepass")
    files: dict[str, Encoded] = {PARAMETERS: Encoded(chunks=(params_json,))}
    bands = _Bands()
    for name, arr in written.files.items():
        files[name] = Encoded(chunks=_npy_chunks(arr, bands))
    keep = bool(written.shapes) or bool(
        meta
        and (meta.get("layers") or meta.get("step") is not None or meta.get("count") is not None)
    )
    if sidecar or (sidecar is None and keep):
        files[SIDECAR] = Encoded(chunks=(_sidecar_bytes(params_json, written, meta),))
    return Encoded(files=files)


#: Bytes of one band of a strided array's data, copied into C order when it is written.
_BAND_BYTES = 4 << 20


class _Bands:
    """The band copies of every strided array of one encoding, each made when the writer takes it.

    Bands are numbered in file order, and copied by
    :func:`~pytreeio.core.transpose.copy_transposed` (on the cores).  Their
    buffers are recycled: a consumer of :class:`~pytreeio.core.binary.Deferred` chunks is done with one
    chunk's bytes when it asks for the next, so the band a thread was given
    before is free for a band still to be made once that thread asks again
    (threads writing different files at once keep theirs).  A fresh buffer
    per band costs its page faults and the kernel's zeroing of every page:
    measured 3.6 against 4.6 GB/s per core for the copies of 4 MiB bands.
    """

    def __init__(self) -> None:
        self.makers: list[Any] = []
        self._free: list[np.ndarray] = []  # byte buffers no band uses
        self._given: dict[int, np.ndarray] = {}  # the buffer each consuming thread has now
        self._lock = threading.Lock()

    def add(self, part: np.ndarray | Callable[[], np.ndarray], nbytes: int) -> Deferred:
        """A band of ``nbytes``: ``part`` (a strided view, or a function making it) copied in C order."""
        from pytreeio.core.transpose import copy_transposed

        def make() -> Any:
            view = part if isinstance(part, np.ndarray) else part()
            store = self._buffer(nbytes)
            out = store[:nbytes].view(view.dtype).reshape(view.shape)
            try:
                copy_transposed(view, out)
            except BaseException:
                self._release(store)
                raise
            return store

        index = len(self.makers)
        self.makers.append(make)
        return Deferred(nbytes, lambda: self._take(index, nbytes))

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A free buffer of at least ``nbytes`` (a new one when none is)."""
        with self._lock:
            for i, store in enumerate(self._free):
                if store.nbytes >= nbytes:
                    return self._free.pop(i)
        # uninitialised: the copy writes every byte the band is given
        return np.empty(nbytes, dtype=np.uint8)

    def _release(self, store: np.ndarray) -> None:
        with self._lock:
            self._free.append(store)

    def _take(self, index: int, nbytes: int) -> Any:
        consumer = threading.get_ident()
        given = self._given.pop(consumer, None)
        if given is not None:  # this consumer is done with the band it had
            self._release(given)
        store = self.makers[index]()
        self._given[consumer] = store
        return store[:nbytes]


def _npy_chunks(arr: Any, bands: _Bands) -> tuple[Any, ...]:
    """The ``.npy`` of ``arr`` flattened (1-D, C order), its data streamed from the array.

    A C-contiguous array is written from its own memory, a
    :class:`~pytreeio.core.binary.Streamed` one as it is read.  A strided one (a
    transposed view) is copied into C order band by band as the file is
    written (:class:`~pytreeio.core.binary.Deferred` chunks of about
    :data:`_BAND_BYTES`, made by ``bands``): no transposed copy of the
    whole array exists.
    """
    if isinstance(arr, Streamed):
        return _streamed_npy_chunks(arr, bands)
    if arr.flags.c_contiguous or arr.ndim == 0:
        return tuple(npy.encode_npy(arr.reshape(-1)))
    return _banded(arr, arr.dtype, lambda i, j: arr[i:j], bands)


def _banded(
    arr: Any, dtype: np.dtype[Any], rows_of: Callable[[int, int], Any], bands: _Bands
) -> tuple[Any, ...]:
    """The 1-D ``.npy`` of ``arr``: its header, then rows ``rows_of(i, j)`` copied in bands.

    Bands are whole rows, about :data:`_BAND_BYTES` each; ``dtype`` is the
    stored (little-endian) dtype.
    """
    rows = int(arr.shape[0])
    row_bytes = arr.nbytes // rows
    step = max(1, _BAND_BYTES // max(1, row_bytes))
    spans = [(i, min(i + step, rows)) for i in range(0, rows, step)]
    return (
        npy.npy_header(dtype, (int(arr.size),)),
        *(bands.add(rows_of(i, j), (j - i) * row_bytes) for i, j in spans),
    )


def _streamed_npy_chunks(arr: Streamed, bands: _Bands) -> tuple[Any, ...]:
    """:func:`_npy_chunks` of a conversion's streamed array.

    A transposed view of a larger array is read once (its base, as stored in
    the source) and copied into C order band by band, as an in-memory view
    is: the file being written holds the array read and a few bands, not a
    transposed copy of it as well.  Anything else is read whole when written.
    """
    base, axes = arr.transposition()
    if base is arr or arr.nbytes <= _BAND_BYTES or sys.byteorder != "little":
        return tuple(npy.encode_npy(arr.reshape(-1)))
    read = _SharedRead(base, axes)
    return _banded(arr, arr.dtype.newbyteorder("<"), read.rows, bands)


class _SharedRead:
    """One read of a streamed array shared by the bands cut from it, dropped after the last."""

    def __init__(self, source: Streamed, axes: tuple[int, ...]) -> None:
        self.source = source
        self.axes = axes
        self.uses = 0
        self._array: np.ndarray | None = None
        self._lock = threading.Lock()

    def rows(self, start: int, stop: int) -> Callable[[], np.ndarray]:
        """A band's maker: rows ``[start, stop)`` of the transposed array (one more use)."""
        self.uses += 1
        return functools.partial(self.band, start, stop)

    def band(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of the array read, transposed (a strided view)."""
        with self._lock:
            if self._array is None:
                self._array = self.source.read()
            arr = self._array
            self.uses -= 1
            if self.uses <= 0:
                self._array = None  # the band's view keeps it alive until copied
        return arr.transpose(self.axes)[start:stop]


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _check_text(pairs: Sequence[tuple[str, str]]) -> None:
    """Refuse control characters jonathan would write raw (the JSON would not parse back)."""
    for key, value in pairs:
        if _CONTROL.search(key) or _CONTROL.search(value):
            raise EncodeError(
                "a key or path holds a control character, which would make parameters.json "
                "invalid JSON",
                key_path=key,
            )


def _write_entry(
    e: _Entry,
    spelled: Mapping[tuple[str, ...], str],
    tensor_class: str,
    prefix: str | None,
    out: _Written,
) -> None:
    where = "/".join(e.ident)
    if e.prefix in PARAM_PREFIXES:
        key = make_key(e.prefix, *e.parts)
        is_tensor = True
    else:
        c, n, s, opt, slot = e.parts
        type_spec = _type_for(e, spelled, tensor_class, where)
        key = make_key(e.prefix, c, n, s, opt, type_spec, slot)
        is_tensor = is_array_leaf(e.value) and not isinstance(e.value, np.generic)
    if not is_tensor:
        out.pairs.append((key, _number_text(e.value, type_spec, where)))
        return
    arr = _tensor_data(e.value, where)
    name = f"{key}.npy"
    if len(name.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES or name in (
        PARAMETERS,
        SIDECAR,
    ):
        raise EncodeError(f"file name {name!r} is too long or reserved", key_path=where)
    out.files[name] = arr
    if arr.ndim != 1:
        out.shapes[key] = [int(d) for d in arr.shape]
    path = name if prefix is None else f"{prefix}/{name}"
    out.pairs.append((key, jonathan_string(path)))


# --------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------


def _load_json(data: Any, name: str) -> Any:
    """JSON text -> Python values (dicts keep the file's order); every failure a FormatError.

    Duplicate keys, NaN/Infinity, deep nesting and raw control characters are
    refused (:mod:`pytreeio.jsonsafe`); cl-waffe2 never writes any of them for
    the keys and paths it makes.
    """
    return jsonsafe.loads(as_memoryview(data), path=name)


def _document(data: Any) -> list[tuple[str, Any]]:
    doc = _load_json(data, PARAMETERS)
    if not isinstance(doc, dict):
        raise FormatError("parameters.json must hold one JSON object", path=PARAMETERS, offset=0)
    for key, value in doc.items():
        ok = isinstance(value, str) or (
            isinstance(value, int | float) and not isinstance(value, bool)
        )
        if not ok:
            raise FormatError(
                f"a value must be a path string or a number, found {type(value).__name__}",
                path=PARAMETERS,
                field=key,
            )
    return list(doc.items())


def _parse_key(key: str) -> StateDictKey:
    try:
        return parse_state_dict_key(key)
    except FormatError as exc:
        raise FormatError(exc.reason, path=PARAMETERS, field=exc.field) from None


def tensor_file(path_string: str, key: str, names: Any) -> str:
    """The file a tensor entry is read from: the basename of its path string, inside the directory.

    ``names`` are the directory's files (relative POSIX paths).  The
    directory part of ``path_string`` is never used; a basename that is not a
    top-level file of the checkpoint is a :class:`FormatError`.
    """
    name = path_string.rsplit("/", 1)[-1]
    if name in ("", ".", "..") or "\0" in name:
        raise FormatError(f"path {path_string!r} does not name a file", path=PARAMETERS, field=key)
    if name not in names:
        raise FormatError(
            f"path {path_string!r}: {name!r} is not a file of the checkpoint directory "
            "(pytreeio reads <dir>/<basename> only and never opens the path itself)",
            path=PARAMETERS,
            field=key,
        )
    return name


def _read_tensor(source: Mapping[str, Any], name: str) -> np.ndarray:
    buf = as_memoryview(source[name])
    r = Reader(buf, source=name)
    h = npy.parse_npy_header(r, "npy")
    if h.fortran_order:
        raise FormatError(
            "Fortran-order arrays are refused (cl-waffe2: 'Reading arrays in Fortran order "
            "is not yet supported')",
            path=name,
            field="npy.header.fortran_order",
            offset=10,
        )
    return npy.array_after_header(r, h, "npy")


def _check_number(key: StateDictKey, value: Any, raw: str) -> Any:
    if key.is_param:
        raise FormatError(
            "a parameter must be a tensor path, found a number", path=PARAMETERS, field=raw
        )
    spec = _type_spec(key, raw)
    if spec.kind == "tensor" or not spec.admits(value):
        raise FormatError(f"{value!r} is not of type {spec.name}", path=PARAMETERS, field=raw)
    return float(value) if spec.kind == "float" else value


def _type_spec(key: StateDictKey, raw: str) -> TypeSpec:
    assert key.type is not None
    try:
        return parse_type_specifier(key.type)
    except FormatError as exc:
        raise FormatError(exc.reason, path=PARAMETERS, field=raw) from None


def _checked(doc: list[tuple[str, Any]]) -> list[tuple[str, StateDictKey, Any]]:
    """Every entry parsed and checked: tensors hold path strings, numbers fit their {type}.

    Numbers come back converted (a float type's integer as a float); no two
    entries may name the same thing (``bit.n`` and ``(integer ...).n``).
    """
    out = []
    seen: set[tuple[str, ...]] = set()
    for raw, value in doc:
        key = _parse_key(raw)
        if isinstance(value, str):
            if not key.is_param and _type_spec(key, raw).kind != "tensor":
                raise FormatError(
                    f"type {key.type} holds a number, found a path", path=PARAMETERS, field=raw
                )
        else:
            value = _check_number(key, value, raw)
        ident = _ident_of(key)
        if ident in seen:
            raise FormatError(
                f"{raw!r} repeats an entry already read under another spelling",
                path=PARAMETERS,
                field=raw,
            )
        seen.add(ident)
        out.append((raw, key, value))
    return out


def _insert(native: dict[str, Any], key: StateDictKey, value: Any, raw: str) -> None:
    node = native.setdefault(key.prefix, {})
    parts = _ident_of(key)[1:]
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    if parts[-1] in node:
        raise FormatError(
            f"{raw!r} repeats an entry already read under another spelling",
            path=PARAMETERS,
            field=raw,
        )
    node[parts[-1]] = value


class _Sidecar(NamedTuple):
    shapes: dict[str, tuple[int, ...]]
    layers: list[Any] | None
    counters: dict[str, int]  # "step" (TrainState.step), "count" (an SGD state's step count)


def _read_sidecar(data: Any, params_json: bytes) -> _Sidecar | None:
    """pytreeio's sidecar, or None when it no longer belongs to this parameters.json."""
    doc = _load_json(data, SIDECAR)

    def bad(reason: str, where: str) -> FormatError:
        return FormatError(reason, path=SIDECAR, field=where)

    if not isinstance(doc, dict):
        raise bad("must hold one JSON object", "")
    d = doc
    if d.get("format") != _SIDECAR_FORMAT or d.get("version") != 1:
        raise bad(f"not a {_SIDECAR_FORMAT} version 1 document", "format")
    if d.get("parameters_sha256") != hashlib.sha256(params_json).hexdigest():
        # parameters.json was rewritten since (cl-waffe2 saving into the same
        # directory leaves our file behind): its shapes may no longer apply.
        warnings.warn(
            f"{SIDECAR} is stale (parameters.json changed since pytreeio wrote it); ignored",
            PytreeioWarning,
            stacklevel=4,
        )
        return None
    shapes_doc = d.get("shapes")
    if not isinstance(shapes_doc, dict):
        raise bad("'shapes' must be an object", "shapes")
    shapes = {}
    for key, dims in shapes_doc.items():
        ok = (
            isinstance(dims, list)
            and len(dims) <= _MAX_NDIM
            and all(type(x) is int and 0 <= x < 2**62 for x in dims)
        )
        if not ok:
            raise bad(f"shape {dims!r} is not a list of dimensions", f"shapes/{key}")
        shapes[key] = tuple(dims)
    layers = d.get("layers")
    if layers is not None and not isinstance(layers, list):
        raise bad("'layers' must be a list", "layers")
    counters = {}
    for name in ("step", "count"):
        value = d.get(name)
        if value is not None and (type(value) is not int or value < 0):
            raise bad(f"{name!r} must be a non-negative integer", name)
        if value is not None:
            counters[name] = value
    return _Sidecar(shapes, layers, counters)


def decode(source: Mapping[str, Any]) -> Decoded:
    """The native tree and meta of a ``:wf2model`` directory's files (see the module docstring)."""
    if not isinstance(source, Mapping):
        raise FormatError("a waffe2 checkpoint is a directory")
    names = frozenset(source)  # iterating reads nothing (`in source` may read the file)
    if PARAMETERS not in names:
        raise FormatError("no parameters.json in the directory", path=PARAMETERS)
    params_json = bytes(as_memoryview(source[PARAMETERS]))
    doc = _document(params_json)
    side = _read_sidecar(source[SIDECAR], params_json) if SIDECAR in names else None
    native: dict[str, Any] = {}
    tensors: dict[str, tuple[StateDictKey, np.ndarray]] = {}
    checked = _checked(doc)
    read = _ReadAhead(source, _files_named(checked, names))
    try:
        for raw, key, value in checked:
            if isinstance(value, str):
                value = read.get(tensor_file(value, raw, names))
                tensors[raw] = key, value
            _insert(native, key, value, raw)
    finally:
        read.close()
    meta: dict[str, Any] = {"keys": [k for k, _ in doc]}
    if side is not None:
        _apply_shapes(native, tensors, side.shapes)
        if side.layers is not None:
            meta["layers"] = side.layers
        meta.update(side.counters)
    return Decoded(native, meta)


def _files_named(checked: Sequence[tuple[str, StateDictKey, Any]], names: Any) -> list[str]:
    """The tensor files the entries name, in order, up to the first bad path (raised in turn)."""
    out: dict[str, None] = {}  # ordered and unique
    for raw, _, value in checked:
        if isinstance(value, str):
            try:
                out[tensor_file(value, raw, names)] = None
            except FormatError:
                break
    return list(out)


class _ReadAhead:
    """The tensor files of a directory read (and parsed) on the pool while earlier ones are used.

    One file at a time reads below the disk's speed (~0.7x of two readers);
    reading them side by side gets it.  Each file is read once, however many
    entries name it; errors come out at the entry that names the file.  A
    job reads a run of consecutive files, about :data:`_JOBS_PER_THREAD` jobs
    per pool thread: a hand-off to the pool costs more than reading a small
    file, and thousands of them would cost more than the reads.
    """

    def __init__(self, source: Mapping[str, Any], names: Sequence[str]) -> None:
        self._source = source
        self._done: dict[str, np.ndarray | Exception] = {}
        self._jobs: dict[str, Any] = {}  # file name -> the job reading its run
        self._runs: list[Any] = []
        if len(names) > 1:
            from pytreeio.core.threads import cores, pool

            workers = pool()
            per_job = max(1, len(names) // (cores() * _JOBS_PER_THREAD))
            for at in range(0, len(names), per_job):
                run = names[at : at + per_job]
                job = workers.submit(_read_run, source, run)
                self._runs.append(job)
                self._jobs.update(dict.fromkeys(run, job))

    def get(self, name: str) -> np.ndarray:
        value = self._done.get(name)
        if value is None:
            job = self._jobs.pop(name, None)
            if job is None:
                value = self._done[name] = _read_tensor(self._source, name)
            else:  # the whole run is done: take all of it (its errors too)
                self._done.update(job.result())
                value = self._done[name]
        if isinstance(value, Exception):
            raise value
        return value

    def close(self) -> None:
        """Wait for reads still running (the source may be closed once decode returns)."""
        for job in self._runs:
            job.cancel()
        for job in self._runs:
            if not job.cancelled():
                job.exception()
        self._jobs = {}
        self._runs = []


#: Read-ahead jobs per pool thread (see :class:`_ReadAhead`).
_JOBS_PER_THREAD = 8


def _read_run(source: Mapping[str, Any], names: Sequence[str]) -> dict[str, np.ndarray | Exception]:
    """The tensors of ``names``, in order; a file that fails gives its error in its place.

    The error is raised by :meth:`_ReadAhead.get` for the entry that names
    that file, so a bad file later in a run does not hide the good ones before it.
    """
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = _read_tensor(source, name)
        except Exception as exc:  # re-raised where the file is asked for
            out[name] = exc
    return out


def _apply_shapes(
    native: dict[str, Any],
    tensors: Mapping[str, tuple[StateDictKey, np.ndarray]],
    shapes: Mapping[str, tuple[int, ...]],
) -> None:
    """Reshape the tensors the sidecar gives shapes of (``tensors``: key text -> (key, array)),
    in their places in ``native``."""
    for raw, shape in shapes.items():
        if raw not in tensors:
            raise FormatError(
                f"names {raw!r}, not a tensor of parameters.json", path=SIDECAR, field=raw
            )
        key, arr = tensors[raw]
        if math.prod(shape) != arr.size:
            raise FormatError(
                f"shape {list(shape)} has {math.prod(shape)} elements, the file {arr.size}",
                path=SIDECAR,
                field=raw,
            )
        node = native[key.prefix]
        parts = _ident_of(key)[1:]
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = arr.reshape(shape)


# --------------------------------------------------------------------------
# inspect and sniff
# --------------------------------------------------------------------------


def _header(src: ByteSource, name: str) -> npy.NpyHeader:
    """A .npy file's header, read without its data; the size must fit the header exactly."""
    # numpy pads headers to 64 bytes: small arrays' headers end at byte 64 or 128
    first = src.read(0, min(src.size, 128), "npy.header")
    r = Reader(first, source=name)
    if len(first) >= 10 and bytes(first[6:8]) == b"\x01\x00":
        hlen = 10 + int.from_bytes(bytes(first[8:10]), "little")
    elif len(first) >= 12:
        hlen = 12 + int.from_bytes(bytes(first[8:12]), "little")
    else:
        hlen = len(first)
    if hlen > len(first):
        r = Reader(src.read(0, min(hlen, src.size), "npy.header"), source=name)
    h = npy.parse_npy_header(r, "npy")
    if h.fortran_order:
        raise FormatError(
            "Fortran-order arrays are refused", path=name, field="npy.header.fortran_order"
        )
    if src.size != h.data_offset + h.nbytes:
        raise FormatError(
            f"file has {src.size} bytes, the header says {h.data_offset + h.nbytes}",
            path=name,
            field="npy.data",
            offset=h.data_offset,
        )
    return h


def inspect(source: Mapping[str, ByteSource]) -> Info:
    """Entries (keys, shapes, dtypes) and the numbers of a ``:wf2model`` directory; .npy headers only."""
    names = frozenset(source)
    if PARAMETERS not in names:
        raise FormatError("no parameters.json in the directory", path=PARAMETERS)
    psrc = source[PARAMETERS]
    try:
        params_json = bytes(psrc.read(0, psrc.size, "parameters.json"))
    finally:
        _close(psrc)
    doc = _document(params_json)
    side = None
    if SIDECAR in names:
        ssrc = source[SIDECAR]
        try:
            side = _read_sidecar(ssrc.read(0, ssrc.size, SIDECAR), params_json)
        finally:
            _close(ssrc)
    shapes = side.shapes if side else {}
    entries = []
    scalars: dict[str, Any] = {}
    headers: dict[str, npy.NpyHeader] = {}  # each file once, however many entries name it
    for raw, _key, value in _checked(doc):
        if not isinstance(value, str):
            scalars[raw] = value
            continue
        name = tensor_file(value, raw, names)
        if name not in headers:
            src = source[name]
            try:
                headers[name] = _header(src, name)
            finally:
                _close(src)
        h = headers[name]
        shape = shapes.get(raw, h.shape)
        if math.prod(shape) != h.count:
            raise FormatError(
                f"sidecar shape {list(shape)} does not fit {h.count} elements",
                path=SIDECAR,
                field=raw,
            )
        entries.append(Entry(raw, tuple(shape), dtypes.name_of(h.dtype), h.nbytes))
    stray = sorted(set(shapes) - {e.name for e in entries})
    if stray:
        raise FormatError(
            f"names {stray[0]!r}, not a tensor of parameters.json", path=SIDECAR, field=stray[0]
        )
    meta: dict[str, Any] = {"scalars": scalars}
    if side is not None and side.layers is not None:
        meta["layers"] = side.layers
    if side is not None:
        meta.update(side.counters)
    return Info(format="waffe2", entries=tuple(entries), meta=meta)


def _close(src: Any) -> None:
    close = getattr(src, "close", None)
    if close is not None:
        close()


def _text_of(source: Mapping[str, ByteSource], name: str) -> bytes:
    """A small JSON file's bytes (parameters.json, the sidecar)."""
    src = source[name]
    return bytes(src.read(0, src.size, name))


def slots(source: Mapping[str, ByteSource]) -> Slots:
    """:func:`decode`'s native tree with a :class:`Slot` per tensor entry (one per .npy file).

    Reads parameters.json, the sidecar and each .npy header; a slot's data
    starts after its file's header.  Entries naming one file share its slot.
    """
    if not isinstance(source, Mapping):
        raise FormatError("a waffe2 checkpoint is a directory")
    names = frozenset(source)
    if PARAMETERS not in names:
        raise FormatError("no parameters.json in the directory", path=PARAMETERS)
    params_json = _text_of(source, PARAMETERS)
    doc = _document(params_json)
    side = _read_sidecar(_text_of(source, SIDECAR), params_json) if SIDECAR in names else None
    shapes = side.shapes if side is not None else {}
    native: dict[str, Any] = {}
    headers: dict[str, npy.NpyHeader] = {}  # each file once, however many entries name it
    tensors: set[str] = set()
    for raw, key, value in _checked(doc):
        if isinstance(value, str):
            name = tensor_file(value, raw, names)
            if name not in headers:
                # not closed: the caller's sources stay open for the slots' reads
                headers[name] = _header(source[name], name)
            h = headers[name]
            shape = shapes.get(raw, h.shape)
            if math.prod(shape) != h.count:
                raise FormatError(
                    f"shape {list(shape)} has {math.prod(shape)} elements, the file {h.count}",
                    path=SIDECAR,
                    field=raw,
                )
            value = Slot(raw, h.data_offset, h.nbytes, tuple(shape), h.dtype, role=name)
            tensors.add(raw)
        _insert(native, key, value, raw)
    stray = sorted(set(shapes) - tensors)
    if stray:
        raise FormatError(
            f"names {stray[0]!r}, not a tensor of parameters.json", path=SIDECAR, field=stray[0]
        )
    meta: dict[str, Any] = {"keys": [k for k, _ in doc]}
    if side is not None:
        if side.layers is not None:
            meta["layers"] = side.layers
        meta.update(side.counters)
    return Slots(native, meta)


_KEY_HEAD = re.compile(rb'^\s*\{\s*"(?:missing_)?(?:param|optimizer):')


def sniff(probe: Probe) -> float:
    """A directory whose ``parameters.json`` opens with a cl-waffe2 state-dict key."""
    if not probe.is_dir or not probe.names or PARAMETERS not in probe.names:
        return 0.0
    head = probe.heads.get(PARAMETERS, b"")
    return STRUCTURE if _KEY_HEAD.match(head) else 0.0


# --------------------------------------------------------------------------
# restore into a native-shaped like
# --------------------------------------------------------------------------


def _report_name(path: tuple[str, ...], value: Any) -> str:
    """The state-dict key of a native path (optimizer keys with the type of ``value``)."""
    if len(path) == 4:
        return f"{path[0]}:{'.'.join(path[1:])}"
    if len(path) == 6:
        try:
            spec = (
                type_of(value)
                if not is_array_leaf(value) or isinstance(value, np.generic)
                else "cputensor"
            )
        except EncodeError:
            spec = "?"
        c, n, s, opt, slot = path[1:]
        return f"{path[0]}:{c}.{n}.{s}.{opt}.{spec}.{slot}"
    return "/".join(path)


def _leaf_paths(node: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(node, Mapping):
        out = []
        for k, v in node.items():
            out.extend(_leaf_paths(v, (*path, str(k))))
        return out
    return [(path, node)]


class _Outcome:
    def __init__(self) -> None:
        self.missing: list[str] = []
        self.extra: list[str] = []


def _restore_node(native: Any, like: Any, path: tuple[str, ...], out: _Outcome) -> Any:
    if isinstance(like, Mapping):
        if not isinstance(native, Mapping):
            if native is None:
                out.missing.extend(_report_name(p, v) for p, v in _leaf_paths(like, path))
                return like
            raise MismatchError(
                "the file has a value where `like` has a subtree",
                key_path="/".join(path),
                expected="a dict",
                found=describe_leaf(native),
            )
        result = {}
        for k, child in like.items():
            result[k] = _restore_node(native.get(str(k)), child, (*path, str(k)), out)
        wanted = {str(x) for x in like}
        for k, v in native.items():
            if k not in wanted:
                out.extra.extend(_report_name(p, x) for p, x in _leaf_paths(v, (*path, k)))
        return result if type(like) is dict else type(like)(result)  # type: ignore[call-arg]
    if native is None:
        out.missing.append(_report_name(path, like))
        return like
    if isinstance(native, Mapping):
        raise MismatchError(
            "the file has a subtree where `like` has a leaf",
            key_path="/".join(path),
            expected=describe_leaf(like),
            found="a dict",
        )
    return _restore_value(native, like, path)


def _restore_value(native: Any, like: Any, path: tuple[str, ...]) -> Any:
    where = _report_name(path, native)
    if is_array_leaf(native) and not isinstance(native, np.generic):
        if not is_array_leaf(like):
            raise MismatchError(
                "the file holds an array here",
                key_path=where,
                expected=describe_leaf(like),
                found=describe_leaf(native),
            )
        if np.dtype(like.dtype) != native.dtype:
            raise MismatchError(
                "dtype differs",
                key_path=where,
                expected=describe_leaf(like),
                found=describe_leaf(native),
            )
        want = tuple(like.shape)
        if math.prod(want) != native.size:
            raise MismatchError(
                "element count differs",
                key_path=where,
                expected=f"{math.prod(want)} elements {list(want)}",
                found=f"{native.size} elements {list(native.shape)}",
            )
        return restore_leaf(native.reshape(want), like, path=(where,))
    if is_array_leaf(like) and tuple(like.shape) == () and np.dtype(like.dtype).kind == "f":
        # cl-waffe2's numbers are single-floats: rounding into a float like is expected.
        return restore_leaf(np.asarray(native, dtype=like.dtype), like, path=(where,))
    return restore_leaf(native, like, path=(where,))


def _settle(out: _Outcome, strict: bool, report: Any, what: str) -> None:
    """Raise (strict) or warn about missing and extra keys; fill ``report``."""
    if report is not None:
        if not isinstance(report, dict):
            raise TypeError(f"report must be a dict to fill, not {type(report).__name__}")
        report["missing"] = list(out.missing)
        report["extra"] = list(out.extra)
    if not out.missing and not out.extra:
        return
    parts = []
    if out.missing:
        parts.append(f"missing from the file: {out.missing}")
    if out.extra:
        parts.append(f"in the file but not in {what}: {out.extra}")
    text = "; ".join(parts)
    if strict:
        raise MismatchError(
            text + " (strict=False loads the rest, as cl-waffe2 does)",
            key_path=(out.missing or out.extra)[0],
            expected=out.missing or None,
            found=out.extra or None,
        )
    warnings.warn(f"waffe2: {text}", PytreeioWarning, stacklevel=4)


def restore(
    native: Any,
    meta: Mapping[str, Any],
    like: Any,
    *,
    strict: bool = True,
    report: dict[str, Any] | None = None,
) -> Any:
    """The native tree in the structure of a native-shaped ``like`` (shapes and kinds from ``like``).

    Arrays must have ``like``'s element count and dtype; they take its shape.
    Missing and extra keys: see the module docstring (``strict``, ``report``).
    """
    del meta
    out = _Outcome()
    result = _restore_node(native, like, (), out)
    _settle(out, strict, report, "`like`")
    return result


# --------------------------------------------------------------------------
# the common model form
# --------------------------------------------------------------------------


class _Slot(NamedTuple):
    """One parameter of the model as cl-waffe2 names it."""

    layer: int
    array: str  # Flax name
    composite: str
    slot: str
    nth: int

    @property
    def parts(self) -> tuple[str, str, str]:
        return self.composite, str(self.nth), self.slot

    @property
    def key(self) -> str:
        return make_key("param", *self.parts)


def _plan(
    types_arrays: Sequence[tuple[str, Sequence[str]]], namings: Mapping[str, LayerNaming]
) -> list[_Slot]:
    """The cl-waffe2 name of every parameter, given each layer's type and arrays in parameter order."""
    raw = []
    for i, (ltype, names) in enumerate(types_arrays):
        nm = namings.get(ltype)
        for k in names:
            if nm is None or k not in nm.slots:
                raise ConversionError(
                    f"cl-waffe2 has no name for the {k!r} array of layer {i} ({ltype}); "
                    "pass naming={...}",
                    what=[f"layer {i} ({ltype})"],
                )
            raw.append((i, k, nm.composite, nm.slots[k]))
    nths = assign_nth((c, s) for _, _, c, s in raw)
    return [_Slot(i, k, c, s, n) for (i, k, c, s), n in zip(raw, nths, strict=True)]


def _expected_arrays(ltype: str, args: Mapping[str, Any]) -> list[str]:
    """The trainable arrays a layer of these args has, in parameter order."""
    spec = LAYERS[ltype]
    bias = args.get("bias", dict(spec.args).get("bias", True))
    return [
        k
        for k in spec.params
        if not (k == "bias" and bias is False and ltype in ("Linear", "Conv2d"))
    ]


def _entries_given(layers: Any, like: Any, meta: Mapping[str, Any]) -> list[Any] | None:
    """The layer list from the ``layers`` option, the sidecar, or a model-shaped ``like``.

    A ``like`` also completes a ``layers`` list that names types only (the
    activations between the layers come from the list, the sizes from ``like``).
    """
    given = layer_list(layers) if layers is not None else None
    if given is None and meta.get("layers") is not None:
        return layer_list(meta["layers"])
    if like is not None and is_model_like(like):
        if not isinstance(like, Mapping):
            params = like.params  # a TrainState
        elif is_flax_tree(like):
            params = like  # a params tree or variables dict
        else:
            params = like["params"]  # {'params': ..., 'opt_state': ...}
        # shapes: arrays or ShapeDtypeStructs
        return Model.from_flax(params, given).config()
    return given


def _file_param_order(
    native: Mapping[str, Any], meta: Mapping[str, Any]
) -> list[tuple[str, str, str]]:
    """The file's parameters in parameter order: ``meta['keys']`` reversed, else nth-major."""
    have = [p for p, _ in _leaves(native.get("param", {}), 3, "param")]
    keys = meta.get("keys")
    if isinstance(keys, list):
        order: list[tuple[str, ...]] = []
        for raw in reversed(keys):
            try:
                k = parse_state_dict_key(raw)
            except FormatError:
                order = []
                break
            if k.prefix == "param":
                order.append(k.parts)
        if sorted(order) == sorted(have) and len(set(order)) == len(order):
            return [(p[0], p[1], p[2]) for p in order]
    composites = {c for c, _, _ in have}
    counts: dict[tuple[str, str], int] = {}
    for c, _, s in have:
        counts[(c, s)] = counts.get((c, s), 0) + 1
    if len(composites) == 1 and len(set(counts.values())) == 1:
        slots_order = list(dict.fromkeys(s for _, _, s in have))
        nths = sorted({n for _, n, _ in have}, key=lambda n: (len(n), n))
        c = next(iter(composites))
        return [(c, n, s) for n in nths for s in slots_order]
    raise MismatchError(
        "the parameter order (which bias belongs to which layer) cannot be told from this tree; "
        "pass layers=[...]",
        key_path="layers",
    )


def _layers_from_file(
    order: list[tuple[str, str, str]], namings: Mapping[str, LayerNaming]
) -> list[tuple[str, dict[str, tuple[str, str, str]]]]:
    """Group parameters (in parameter order) into layers: a layer's first slot starts it."""
    by_composite = _composite_types(namings)
    layers: list[tuple[str, dict[str, tuple[str, str, str]]]] = []
    for c, n, s in order:
        ltype = by_composite.get(c)
        if ltype is None:
            raise MismatchError(
                f"unknown composite {c!r}: pass naming={{layer type: LayerNaming({c!r}, ...)}}",
                key_path=make_key("param", c, n, s),
            )
        nm = namings[ltype]
        flax = {v: k for k, v in nm.slots.items()}.get(s)
        if flax is None:
            raise MismatchError(
                f"{c} has no slot {s!r} in the naming {dict(nm.slots)}",
                key_path=make_key("param", c, n, s),
            )
        first = next(iter(nm.slots))
        if flax == first or not layers or layers[-1][0] != ltype or flax in layers[-1][1]:
            if flax != first:
                raise MismatchError(
                    f"{s!r} does not follow a {nm.slots[first]!r} of its layer; pass layers=[...]",
                    key_path=make_key("param", c, n, s),
                )
            layers.append((ltype, {}))
        layers[-1][1][flax] = (c, n, s)
    return layers


def _lookup(native: Mapping[str, Any], prefix: str, parts: Sequence[str]) -> Any:
    node: Any = native.get(prefix)
    for p in parts:
        if not isinstance(node, Mapping) or p not in node:
            return None
        node = node[p]
    return node


def to_model(
    native: Any,
    meta: Mapping[str, Any],
    *,
    layers: Any = None,
    naming: Mapping[str, Any] | None = None,
    strict: bool = True,
    report: dict[str, Any] | None = None,
    like: Any = None,
) -> Model:
    """The common model form of a waffe2 native tree.

    The layer list comes from ``layers`` (entries with their in/out features:
    cl-waffe2 stores no shapes), else pytreeio's sidecar, else a model-shaped
    ``like``; without any, it is read from the file's key order and the arrays
    must already have their shapes.  Adam and SGD optimizer entries become an
    :class:`~pytreeio.model.optim.OptState` (``adam``: ``lr``/``eps``/``beta1``/
    ``beta2``/``n``/``m``/``v`` -> ``learning_rate``/``eps``/``b1``/``b2``/
    count/``mu``/``nu``; ``sgd``: ``lr``).
    """
    if not isinstance(native, Mapping):
        raise MismatchError("not a waffe2 native tree", key_path="", found=type(native).__name__)
    meta = meta or {}
    namings = _namings(naming)
    entries = _entries_given(layers, like, meta)
    out = _Outcome()
    if entries is not None:
        per_layer, plan = _arrays_by_layers(native, entries, namings, out)
    else:
        per_layer, plan, entries = _arrays_from_file(native, meta, namings)
    _extra_params(native, plan, out)
    if out.missing:
        # A model cannot hold a layer without its arrays: missing parameters raise even
        # when strict=False (restore into a native-shaped like keeps like's values instead).
        _settle(out, True, report, "the layer list")
    _settle(out, strict, report, "the layer list")
    if like is None:
        # A model for another format's encoder: C order (encoders write memory order as is);
        # restoring into `like` keeps the transposed views (no copy).
        per_layer = [{k: _c_order(v) for k, v in arrays.items()} for arrays in per_layer]
    model_layers = normalize_layers(entries, per_layer)
    count = meta.get("count")
    opt = _opt_state(native, plan, model_layers, namings, count if isinstance(count, int) else None)
    if opt is not None and like is None:
        slots = {k: [_c_order(a) for a in v] for k, v in opt.slots.items()}
        opt = dataclasses.replace(opt, slots=slots)
    step = meta.get("step")
    return Model(tuple(model_layers), opt, step if isinstance(step, int) else None)


def _arrays_by_layers(
    native: Mapping[str, Any], entries: list[Any], namings: Mapping[str, LayerNaming], out: _Outcome
) -> tuple[list[dict[str, Any]], list[_Slot]]:
    parsed = [entry_parts(e, i) for i, e in enumerate(entries)]
    plan = _plan([(t, _expected_arrays(t, a)) for t, a, _ in parsed], namings)
    per_layer: list[dict[str, Any]] = [{} for _ in entries]
    for s in plan:
        value = _lookup(native, "param", s.parts)
        if value is None:
            out.missing.append(s.key)
            continue
        if not is_array_leaf(value):
            raise MismatchError("expected an array", key_path=s.key, found=describe_leaf(value))
        ltype, args, _ = parsed[s.layer]
        per_layer[s.layer][s.array] = _flax_array(value, ltype, args, s, namings)
    return per_layer, plan


def _flax_array(
    value: Any, ltype: str, args: Mapping[str, Any], s: _Slot, namings: Mapping[str, LayerNaming]
) -> Any:
    arr = _array(value)
    axes = namings[ltype].axes.get(s.array)
    shapes = _flax_shapes(ltype, args) or {}
    want = shapes.get(s.array)
    stored = tuple(want[i] for i in axes) if want is not None and axes else want
    if want is None and axes is not None and arr.ndim != len(axes):
        raise MismatchError(
            f"cl-waffe2 stores no shapes: layer {s.layer} ({ltype}) needs its sizes in "
            "layers=[...] (e.g. in_features/out_features)",
            key_path=s.key,
            found=f"{arr.size} elements",
        )
    return _to_flax(arr, stored, axes, s.key)


def _arrays_from_file(
    native: Mapping[str, Any], meta: Mapping[str, Any], namings: Mapping[str, LayerNaming]
) -> tuple[list[dict[str, Any]], list[_Slot], list[Any]]:
    order = _file_param_order(native, meta)
    grouped = _layers_from_file(order, namings)
    plan = _plan([(t, list(arrs)) for t, arrs in grouped], namings)
    per_layer: list[dict[str, Any]] = []
    for i, (ltype, arrs) in enumerate(grouped):
        layer: dict[str, Any] = {}
        for flax, parts in arrs.items():
            value = _array(_lookup(native, "param", parts))
            axes = namings[ltype].axes.get(flax)
            if axes is not None and value.ndim != len(axes):
                raise MismatchError(
                    f"cl-waffe2 stores no shapes: pass layers=[...] with the sizes of layer {i} "
                    f"({ltype}), or load into a native-shaped like",
                    key_path=make_key("param", *parts),
                    found=f"{value.size} elements",
                )
            layer[flax] = _to_flax(value, None, axes, make_key("param", *parts))
        per_layer.append(layer)
    return per_layer, plan, [t for t, _ in grouped]


def _extra_params(native: Mapping[str, Any], plan: list[_Slot], out: _Outcome) -> None:
    used = {("param", *s.parts) for s in plan}
    for prefix in PARAM_PREFIXES:
        for parts, _ in _leaves(native.get(prefix, {}), 3, prefix):
            if (prefix, *parts) not in used:
                out.extra.append(make_key(prefix, *parts))
    bases = {s.parts for s in plan}
    for prefix in OPTIMIZER_PREFIXES:
        for parts, value in _leaves(native.get(prefix, {}), 5, prefix):
            if prefix == "missing_optimizer" or tuple(parts[:3]) not in bases:
                out.extra.append(_report_name((prefix, *parts), value))


def _opt_state(
    native: Mapping[str, Any],
    plan: list[_Slot],
    layers: list[Layer],
    namings: Mapping[str, LayerNaming],
    count: int | None = None,
) -> Any:
    """The OptState of the optimizer entries of ``plan``'s parameters (None when there are none).

    ``count`` is the sidecar's step count of an SGD state (cl-waffe2 keeps none).
    """
    from pytreeio.model.optim import OptState

    found = [(_lookup(native, "optimizer", s.parts), s) for s in plan]
    have = [(o, s) for o, s in found if o]
    if not have:
        return None
    if len(have) != len(plan):
        lacking = [s.key for o, s in found if not o]
        warnings.warn(
            f"waffe2: optimizer entries only for some parameters (none for {lacking}); "
            "no optimizer state loaded",
            PytreeioWarning,
            stacklevel=3,
        )
        return None
    names = {name for o, _ in have for name in o}
    if len(names) != 1 or not all(len(o) == 1 for o, _ in have):
        raise MismatchError(
            f"the parameters have different optimizers {sorted(names)}", key_path="optimizer"
        )
    kind = names.pop()
    if kind not in ("adam", "sgd"):
        warnings.warn(
            f"waffe2: optimizer {kind!r} has no optax counterpart here; no optimizer state loaded",
            PytreeioWarning,
            stacklevel=3,
        )
        return None
    wanted = ADAM_SLOTS if kind == "adam" else ("lr",)
    scalars: dict[str, Any] = {}
    mu: list[Any] = []
    nu: list[Any] = []
    for o, s in have:
        slots = o[kind]
        where = make_key("optimizer", *s.parts, kind, "?", "?").rsplit(".", 2)[0]
        if set(slots) != set(wanted):
            raise MismatchError(
                f"{kind} entries of {s.key} are {sorted(slots)}",
                key_path=where,
                expected=list(wanted),
                found=sorted(slots),
            )
        for name in wanted:
            if name in ("m", "v"):
                continue
            v = slots[name]
            if name in scalars and scalars[name] != v:
                raise MismatchError(
                    f"{kind} {name!r} differs between parameters ({scalars[name]!r} and {v!r}); "
                    "an optax state holds one value",
                    key_path=f"{where}.{name}",
                )
            scalars[name] = v
        if kind == "adam":
            layer = layers[s.layer]
            param = layer.arrays[s.array]
            axes = namings[layer.type].axes.get(s.array)
            stored = tuple(param.shape[i] for i in axes) if axes else tuple(param.shape)
            for name, dest in (("m", mu), ("v", nu)):
                arr = slots[name]
                if not is_array_leaf(arr):
                    raise MismatchError(
                        "expected an array", key_path=f"{where}.{name}", found=describe_leaf(arr)
                    )
                dest.append(_to_flax(_array(arr), stored, axes, f"{where}.{name}"))
    if kind == "sgd":
        # cl-waffe2's SGD keeps no step count; pytreeio's sidecar may hold optax's.
        return OptState("sgd", {"learning_rate": float(scalars["lr"])}, count, {})
    n = scalars["n"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise MismatchError("n must be a non-negative integer", key_path="optimizer n", found=n)
    hp = {_ADAM_HYPER[k]: float(scalars[k]) for k in ("lr", "eps", "beta1", "beta2")}
    hp["eps_root"] = 0.0  # cl-waffe2's Adam has none (optax's default)
    return OptState("adam", hp, n, {"mu": mu, "nu": nu})


def _same_number(a: Any, b: Any) -> bool:
    """Equal as cl-waffe2's single-floats (an injected value is already rounded to float32)."""
    try:
        return float(np.float32(a)) == float(np.float32(b))
    except (TypeError, ValueError, OverflowError):
        return a == b


def _merged_hyperparams(opt: Any, given: Mapping[str, Any] | None) -> dict[str, Any]:
    if given is not None and not isinstance(given, Mapping):
        raise MismatchError(
            "hyperparams must be a mapping", key_path="hyperparams", found=type(given).__name__
        )
    hp = dict(opt.hyperparams)
    for name, value in (given or {}).items():
        if name in hp and not _same_number(hp[name], value):
            raise MismatchError(
                f"hyperparameter {name!r} given as {value!r}, the optimizer state holds {hp[name]!r}",
                key_path=f"hyperparams/{name}",
                expected=hp[name],
                found=value,
            )
        hp.setdefault(name, value)
    return hp


def _optimizer_problems(opt: Any, hp: Mapping[str, Any]) -> list[str]:
    """What of an optimizer state cl-waffe2's Adam/SGD entries cannot hold.

    ``adamw`` holds Adam's data (``mu``, ``nu``, count): it is written as
    cl-waffe2's Adam unless a non-zero ``weight_decay`` is recorded, which
    cl-waffe2's Adam has no place for.
    """
    if opt.kind not in ("adam", "adamw", "sgd"):
        return [f"optimizer state ({opt.kind}; cl-waffe2 formats hold adam and sgd)"]
    out = []
    if opt.kind == "adamw" and hp.get("weight_decay"):
        out.append(f"adamw weight_decay={hp['weight_decay']} (cl-waffe2's Adam has none)")
    if "learning_rate" not in hp:
        out.append(
            "the learning rate (cl-waffe2 stores one and the optimizer state does not record "
            "it: pass hyperparams={'learning_rate': ...} or use optax.inject_hyperparams)"
        )
    if hp.get("eps_root"):
        out.append(f"adam eps_root={hp['eps_root']} (cl-waffe2 has none)")
    if hp.get("nesterov"):
        out.append("nesterov adam (cl-waffe2 has none)")
    if any(v is None for slot in opt.slots.values() for v in slot):
        out.append("masked optimizer slots (cl-waffe2 keeps an optimizer per parameter)")
    return out


def from_model(
    model: Model,
    meta: Mapping[str, Any] | None = None,
    *,
    lossy: bool = False,
    optimizers: bool | None = None,
    naming: Mapping[str, Any] | None = None,
    hyperparams: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model as a waffe2 native tree (+ meta with the key order and layer list).

    Kernels are transposed to cl-waffe2's orientation (numpy arrays on a CPU
    backend as views, copied band by band when written; others by a jit
    transpose).  With
    ``optimizers=True`` an ``adam`` or ``sgd`` optimizer state (``adamw``
    without a recorded weight decay: Adam's data) is written as cl-waffe2's
    entries; hyperparameters come from the state (``inject_hyperparams``, a
    converted checkpoint) or ``hyperparams``; Adam's b1/b2/eps default to
    optax.adam's when neither gives them, the learning rate is required.
    ``optimizers=False`` leaves the state out, with a warning when there is
    one.  The default (None) is cl-waffe2's ``False`` for a Flax tree being
    saved, and ``True`` for a model converted from another checkpoint
    (``model.origin`` set): a conversion drops nothing silently.
    """
    _check_meta(meta)  # its keys/layers/step/count are recomputed from the model
    if optimizers is None:
        optimizers = model.origin is not None
    namings = _namings(naming)
    problems = []
    for i, layer in enumerate(model.layers):
        nm = namings.get(layer.type)
        unnamed = sorted(k for k in layer.arrays if nm is None or k not in nm.slots)
        if unnamed:
            problems.append(f"layer {i} ({layer.type}) arrays {unnamed}")
    kept = [
        (j, i, k, a)
        for j, (i, k, a) in enumerate(model.params)
        if model.layers[i].type in namings and k in namings[model.layers[i].type].slots
    ]
    opt = model.opt_state
    hp: dict[str, Any] = {}
    opt_problems: list[str] = []
    if opt is not None and optimizers:
        hp = _merged_hyperparams(opt, hyperparams)
        opt_problems = _optimizer_problems(opt, hp)
    if problems or opt_problems:
        if not lossy:
            refuse(problems + opt_problems, "waffe2")
        dropped = ", ".join(problems + opt_problems)
        warnings.warn(f"waffe2: dropping {dropped}", PytreeioWarning, stacklevel=4)
        if opt_problems:
            opt = None
    if opt is not None and not optimizers:
        warnings.warn(
            "waffe2: the optimizer state is not written (optimizers=False, cl-waffe2's default); "
            "pass optimizers=True to keep it",
            PytreeioWarning,
            stacklevel=4,
        )
        opt = None
    raw = [(i, k, namings[model.layers[i].type]) for _, i, k, _ in kept]
    nths = assign_nth((nm.composite, nm.slots[k]) for i, k, nm in raw)
    plan = [
        _Slot(i, k, nm.composite, nm.slots[k], n) for (i, k, nm), n in zip(raw, nths, strict=True)
    ]
    native: dict[str, Any] = {"param": {}}
    keys_by_param: list[list[str]] = []
    for (j, i, k, arr), s in zip(kept, plan, strict=True):
        nm = namings[model.layers[i].type]
        stored = _to_stored(arr, nm.axes.get(k))
        native["param"].setdefault(s.composite, {}).setdefault(str(s.nth), {})[s.slot] = stored
        keys = [s.key]
        if opt is not None:
            keys += _opt_entries(native, opt, hp, j, s, nm.axes.get(k))
        keys_by_param.append(keys)
    out_meta: dict[str, Any] = {
        # cl-waffe2 pushes parameters onto a list, so its file lists them last first.
        "keys": [key for keys in reversed(keys_by_param) for key in keys],
        "layers": model.config(),
    }
    if model.step is not None:
        out_meta["step"] = int(model.step)
    if opt is not None and opt.kind == "sgd" and opt.count is not None:
        out_meta["count"] = int(opt.count)  # cl-waffe2's SGD has no place for it
    return native, out_meta


def _opt_entries(
    native: dict[str, Any], opt: Any, hp: Mapping[str, Any], j: int, s: _Slot, axes: Any
) -> list[str]:
    """Add parameter ``j``'s optimizer entries to ``native``; return their keys in cl-waffe2's order."""
    name = "sgd" if opt.kind == "sgd" else "adam"  # adamw: Adam's data (see _optimizer_problems)
    if opt.kind == "sgd":
        values: dict[str, Any] = {"lr": float(hp["learning_rate"])}
    else:
        full = {**_OPTAX_ADAM_DEFAULTS, **hp}
        values = {
            "lr": float(full["learning_rate"]),
            "eps": float(full["eps"]),
            "beta1": float(full["b1"]),
            "beta2": float(full["b2"]),
            "n": int(opt.count),
            "m": _to_stored(opt.slots["mu"][j], axes),
            "v": _to_stored(opt.slots["nu"][j], axes),
        }
    node = native.setdefault("optimizer", {}).setdefault(s.composite, {})
    node.setdefault(str(s.nth), {})[s.slot] = {name: values}
    return [make_key("optimizer", *s.parts, name, type_of(v), slot) for slot, v in values.items()]


FORMAT = register(
    Format(
        name="waffe2",
        description="cl-waffe2 :wf2model directory (parameters.json + one .npy per tensor)",
        suffixes=(".wf2model",),
        layout=DIRECTORY,
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=sniff,
        restore=restore,
        to_model=to_model,
        from_model=from_model,
        accepts_meta=True,
        keeps_meta=False,
        slots=slots,
        streams=True,
    )
)
