"""``parameters.json`` and pytreeio's sidecar, written and read.

``parameters.json`` is one line of JSON as ``jonathan`` writes it (no spaces,
no trailing newline, only ``\\n \\r \\t \\" \\\\`` escaped):
``"<key>": "<p>/<key>.npy"`` for a tensor, ``"<key>": 0.01 | 3`` for a number.
``pytreeio-waffe2.json`` is compact JSON: ``{"format": "pytreeio/waffe2",
"version": 1, "parameters_sha256": <hex>, "shapes": {key: [dims]}}`` with
``"layers"``, ``"step"`` and ``"count"`` when there are any.  Reading checks
every entry; each failure is a `FormatError` naming the file and key.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from pytreeio.core import dtypes, jsonsafe
from pytreeio.core.binary import Streamed, as_memoryview
from pytreeio.core.errors import EncodeError, FormatError, PytreeioWarning
from pytreeio.core.tree import describe_leaf, is_array_leaf
from pytreeio.formats.waffe2.keys import (
    OPTIMIZER_PREFIXES,
    PARAM_PREFIXES,
    StateDictKey,
    format_lisp_float,
    jonathan_string,
    make_key,
    parse_state_dict_key,
    parse_type_specifier,
    type_of,
)
from pytreeio.model.form import entry_parts, layer_list

PARAMETERS = "parameters.json"
SIDECAR = "pytreeio-waffe2.json"
_SIDECAR_FORMAT = "pytreeio/waffe2"
_MAX_NAME_BYTES = 255  # a file name on Linux file systems
_MAX_NDIM = 32
_PREFIXES = PARAM_PREFIXES + OPTIMIZER_PREFIXES


class Item(NamedTuple):
    """One entry of a native tree: prefix, the key parts without ``{type}``, and its value."""

    prefix: str
    parts: tuple[str, ...]  # (composite, nth, slot) or (..., optimizer, optslot)
    value: Any

    @property
    def ident(self) -> tuple[str, ...]:
        return (self.prefix, *self.parts)


def _children(node: Any, where: str, depth_left: int) -> list[tuple[str, Any]]:
    if not isinstance(node, Mapping):
        want = "a dict" if depth_left else "a value"
        raise EncodeError(f"expected {want}, found {type(node).__name__}", key_path=where)
    out = []
    for k, v in node.items():
        part = str(k) if isinstance(k, int) and not isinstance(k, bool) else k
        if not (
            isinstance(part, str) and part == part.lower() and re.fullmatch(r"[^.:/\0]+", part)
        ):
            raise EncodeError(
                f"{part!r} cannot be a cl-waffe2 key part (lower-case, non-empty, no '.', ':', '/')",
                key_path=f"{where}/{k}",
            )
        out.append((part, v))
    return out


def leaves(
    node: Any, depth: int, where: str, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], Any]]:
    """``(parts, value)`` of a nested dict exactly ``depth`` levels deep, in its order."""
    if depth == 0:
        return [(path, node)]
    out = []
    for k, v in _children(node, where, depth):
        out.extend(leaves(v, depth - 1, f"{where}/{k}", (*path, k)))
    return out


def tree_items(tree: Any) -> list[Item]:
    """A native tree's entries in its own order: each parameter, then its optimizer entries."""
    if not isinstance(tree, Mapping):
        raise EncodeError(
            f"a waffe2 tree is a dict with keys {', '.join(_PREFIXES)} "
            f"(or a model-shaped tree), not a {type(tree).__name__}"
        )
    unknown = [k for k in tree if k not in _PREFIXES]
    if unknown:
        raise EncodeError(
            f"unknown top-level keys {unknown}: a waffe2 tree holds {', '.join(_PREFIXES)}",
            key_path=str(unknown[0]),
        )
    out: list[Item] = []
    for pprefix, oprefix in zip(PARAM_PREFIXES, OPTIMIZER_PREFIXES, strict=True):
        params = leaves(tree.get(pprefix, {}), 3, pprefix)
        by_base: dict[tuple[str, ...], list[Item]] = {}
        for p, v in leaves(tree.get(oprefix, {}), 5, oprefix):
            by_base.setdefault(p[:3], []).append(Item(oprefix, p, v))
        for p, v in params:
            out += [Item(pprefix, p, v), *by_base.pop(p, ())]
        # optimizer entries without their parameter (:weights nil)
        out += [e for rest in by_base.values() for e in rest]
    return out


def check_meta(meta: Mapping[str, Any] | None) -> None:
    extra = sorted(set(meta or ()) - {"keys", "layers", "step", "count"})
    if extra:
        raise EncodeError(
            f"cl-waffe2 has no place for meta {extra} (waffe2 meta holds 'keys', and "
            "'layers'/'step'/'count' kept in pytreeio's sidecar)",
            key_path="meta",
        )
    for name in ("step", "count"):
        value = (meta or {}).get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | np.integer)
        ):
            raise EncodeError(f"meta[{name!r}] must be an integer", key_path=f"meta/{name}")


def in_meta_order(
    meta: Mapping[str, Any] | None, items: list[Item]
) -> tuple[list[Item], dict[tuple[str, ...], str]]:
    """``items`` in ``meta['keys']`` order (when it names exactly them), and its {type} spellings."""
    keys = meta.get("keys") if meta else None
    if not isinstance(keys, list | tuple):
        return items, {}
    try:
        parsed = [parse_state_dict_key(k) for k in keys]
    except FormatError:
        return items, {}
    by_ident = {e.ident: e for e in items}
    idents = [k.ident for k in parsed]
    if len(set(idents)) != len(idents) or set(idents) != set(by_ident):
        return items, {}
    spelled = {k.ident: k.type for k in parsed if k.type is not None}
    return [by_ident[i] for i in idents], spelled


def _is_tensor(value: Any) -> bool:
    return is_array_leaf(value) and not isinstance(value, np.generic)


def _type_for(
    e: Item, spelled: Mapping[tuple[str, ...], str], tensor_class: str, where: str
) -> str:
    """The {type} part of an optimizer entry, as cl-waffe2 would compute it."""
    old = spelled.get(e.ident)
    try:
        kind = parse_type_specifier(old).kind if old is not None else None
    except FormatError:
        kind = None
    if _is_tensor(e.value):
        return old if old is not None and kind == "tensor" else tensor_class
    if type(e.value) is float and kind == "float" and old:
        return old  # a double-float stays one
    try:
        return type_of(e.value)
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
    if not _is_tensor(value):
        raise EncodeError(
            f"a parameter must be an array, found {describe_leaf(value)}", key_path=where
        )
    if not isinstance(value, Streamed):  # a conversion's: read when its file is written
        try:
            value = np.asarray(value)
        except Exception as exc:  # a ShapeDtypeStruct or a tracer: no values to write
            raise EncodeError(
                f"this leaf has no values to write ({type(exc).__name__})", key_path=where
            ) from None
    why = dtypes.check_plain(value.dtype)
    if why is not None:
        raise EncodeError(why, key_path=where)
    return value if isinstance(value, Streamed) else dtypes.little_endian(value)


#: Characters jonathan writes raw, which would make parameters.json invalid JSON.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def write_document(
    items: list[Item],
    spelled: Mapping[tuple[str, ...], str],
    tensor_class: str,
    prefix: str | None,
) -> tuple[bytes, dict[str, Any], dict[str, list[int]]]:
    """``(parameters.json, {file name: array}, {key: shape of each array that is not 1-D})``."""
    pairs: list[tuple[str, str]] = []
    files: dict[str, Any] = {}
    shapes: dict[str, list[int]] = {}
    for e in items:
        where = "/".join(e.ident)
        if e.prefix in PARAM_PREFIXES:
            key, is_tensor = make_key(e.prefix, *e.parts), True
        else:
            type_spec = _type_for(e, spelled, tensor_class, where)
            key = make_key(e.prefix, *e.parts[:4], type_spec, e.parts[4])
            is_tensor = _is_tensor(e.value)
        if not is_tensor:
            pairs.append((key, _number_text(e.value, type_spec, where)))
            continue
        arr = _tensor_data(e.value, where)
        name = f"{key}.npy"
        if len(name.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES:
            raise EncodeError(f"file name {name!r} is too long", key_path=where)
        files[name] = arr
        if arr.ndim != 1:
            shapes[key] = [int(d) for d in arr.shape]
        pairs.append((key, jonathan_string(name if prefix is None else f"{prefix}/{name}")))
    for key, value in pairs:
        if _CONTROL.search(key) or _CONTROL.search(value):
            raise EncodeError(
                "a key or path holds a control character, which would make parameters.json "
                "invalid JSON",
                key_path=key,
            )
    body = "{" + ",".join(f"{jonathan_string(k)}:{v}" for k, v in pairs) + "}"
    return body.encode("utf-8", "surrogatepass"), files, shapes


def _json_ready_layers(layers: Any) -> list[Any]:
    entries = layer_list(layers)
    if entries is None:
        raise EncodeError("meta['layers'] must be a list of layer entries", key_path="meta/layers")
    out = []
    for i, entry in enumerate(entries):
        ltype, args, trainable = entry_parts(entry, i)
        out.append(
            {"type": ltype, "args": dict(args), **({} if trainable else {"trainable": False})}
        )
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EncodeError(
            f"meta['layers'] is not JSON-ready: {exc}", key_path="meta/layers"
        ) from None
    return out


def sidecar_bytes(
    params_json: bytes, shapes: Mapping[str, list[int]], meta: Mapping[str, Any] | None
) -> bytes:
    doc: dict[str, Any] = {
        "format": _SIDECAR_FORMAT,
        "version": 1,
        "parameters_sha256": hashlib.sha256(params_json).hexdigest(),
        "shapes": dict(shapes),
    }
    if meta and meta.get("layers") is not None:
        doc["layers"] = _json_ready_layers(meta["layers"])
    for name in ("step", "count"):
        if meta and meta.get(name) is not None:
            doc[name] = int(meta[name])
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _bad(reason: str, field: str | None) -> FormatError:
    return FormatError(reason, path=PARAMETERS, field=field)


def read_document(data: Any) -> list[tuple[str, StateDictKey, Any]]:
    """``parameters.json``'s entries ``(key text, parsed key, path string or number)``, checked.

    Tensors hold path strings and numbers fit their {type} (a float type's
    integer comes back a float); no two entries may name the same thing
    (``bit.n`` and ``(integer ...).n``).  JSON that cl-waffe2 never writes
    (duplicate keys, NaN, deep nesting, raw control characters) is refused.
    """
    doc = jsonsafe.loads(as_memoryview(data), path=PARAMETERS)
    if not isinstance(doc, dict):
        raise FormatError("parameters.json must hold one JSON object", path=PARAMETERS, offset=0)
    out = []
    seen: set[tuple[str, ...]] = set()
    for raw, value in doc.items():
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise _bad(
                f"a value must be a path string or a number, found {type(value).__name__}", raw
            )
        try:
            key = parse_state_dict_key(raw)
            spec = None if key.is_param else parse_type_specifier(key.type or "")
        except FormatError as exc:
            raise _bad(exc.reason, raw if exc.field == "type" else exc.field) from None
        if isinstance(value, str):
            if spec is not None and spec.kind != "tensor":
                raise _bad(f"type {key.type} holds a number, found a path", raw)
        elif spec is None:
            raise _bad("a parameter must be a tensor path, found a number", raw)
        elif spec.kind == "tensor" or not spec.admits(value):
            raise _bad(f"{value!r} is not of type {spec.name}", raw)
        elif spec.kind == "float":
            value = float(value)
        if key.ident in seen:
            raise _bad(f"{raw!r} repeats an entry already read under another spelling", raw)
        seen.add(key.ident)
        out.append((raw, key, value))
    return out


def insert(native: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Put ``value`` at ``path`` of a native tree, making the dicts on the way."""
    for p in path[:-1]:
        native = native.setdefault(p, {})
    native[path[-1]] = value


def tensor_file(path_string: str, key: str, names: Any) -> str:
    """The file a tensor entry is read from: the basename of its path string, in the directory.

    ``names`` are the directory's files.  The directory part of
    ``path_string`` is never used; a basename that is not a top-level file of
    the checkpoint is a `FormatError`.
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


class Sidecar(NamedTuple):
    shapes: dict[str, tuple[int, ...]]
    meta: dict[str, Any]  # "layers", "step" (TrainState.step), "count" (an SGD state's count)


def read_sidecar(data: Any, params_json: bytes) -> Sidecar | None:
    """pytreeio's sidecar, or None (with a warning) when it no longer belongs to this parameters.json."""
    doc = jsonsafe.loads(as_memoryview(data), path=SIDECAR)

    def bad(reason: str, where: str) -> FormatError:
        return FormatError(reason, path=SIDECAR, field=where)

    if not isinstance(doc, dict):
        raise bad("must hold one JSON object", "")
    if doc.get("format") != _SIDECAR_FORMAT or doc.get("version") != 1:
        raise bad(f"not a {_SIDECAR_FORMAT} version 1 document", "format")
    if doc.get("parameters_sha256") != hashlib.sha256(params_json).hexdigest():
        # cl-waffe2 saving into the directory leaves our file behind: its shapes may not apply
        warnings.warn(
            f"{SIDECAR} is stale (parameters.json changed since pytreeio wrote it); ignored",
            PytreeioWarning,
            stacklevel=4,
        )
        return None
    shapes_doc = doc.get("shapes")
    if not isinstance(shapes_doc, dict):
        raise bad("'shapes' must be an object", "shapes")
    shapes = {}
    for key, dims in shapes_doc.items():
        if not (
            isinstance(dims, list)
            and len(dims) <= _MAX_NDIM
            and all(type(x) is int and 0 <= x < 2**62 for x in dims)
        ):
            raise bad(f"shape {dims!r} is not a list of dimensions", f"shapes/{key}")
        shapes[key] = tuple(dims)
    meta = {k: doc[k] for k in ("layers", "step", "count") if doc.get(k) is not None}
    if not isinstance(meta.get("layers", []), list):
        raise bad("'layers' must be a list", "layers")
    for name in ("step", "count"):
        if name in meta and (type(meta[name]) is not int or meta[name] < 0):
            raise bad(f"{name!r} must be a non-negative integer", name)
    return Sidecar(shapes, meta)
