"""netcl (``pip install netcl==0.4.4``) model files, as ``netcl.io.save_model`` writes them.

Byte layout: an uncompressed ``.npz`` byte-identical to ``np.savez`` (see
`pytreeio.containers.npy` and `pytreeio.containers.zip`), members in this order::

    "<i>:<key>.npy"        each array of layer i's state dict, in layer order and
                           state-dict order (Linear/Conv2d: weight, bias;
                           BatchNorm2d: gamma, beta, running_mean, running_var);
                           i counts every layer, parameter-free ones too
    "__netcl_meta__.npy"   last: 0-d '<U' array holding json.dumps (default
                           separators) of {"type": "Sequential", "config": [...],
                           "version": 2, "format": "netcl.single-file"}

Config entries are ``{"type": T, "args": {...}}`` with the args of
`pytreeio.model.form.LAYERS` (netcl knows every type there but Softmax);
array names and orientation are netcl's (`pytreeio.formats.netcl.naming`).

Loading follows netcl's lookup order among the files that exist: ``<path>``;
else the legacy pair ``<path>.json`` (meta, ``"version": 1``, ``"config"`` or
the older ``"layers": [{"type": T, **args}]``) + ``<path>.npz`` (the arrays);
else ``<path>.netcl``.  Saving always writes the single file at ``<path>``.

Native tree: a list with one dict of netcl-named arrays per layer
(``[{'weight', 'bias'}, {}, ...]``); meta: the meta document.  A Flax tree
saves and loads through the common model form (``to_model``/``from_model``).
Training checkpoints and raw parameters are in `pytreeio.formats.netcl.checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pytreeio.containers import npy
from pytreeio.containers import zip as zipfmt
from pytreeio.core import dtypes, jsonsafe
from pytreeio.core.binary import ByteSource, Slot, Slots, as_memoryview
from pytreeio.core.errors import FormatError, MismatchError
from pytreeio.core.records import STRUCTURE, Decoded, Encoded, Entry, Format, Info, Probe, Siblings
from pytreeio.formats.netcl.naming import (
    META_KEY,
    NAMES,
    NETCL_TYPES,
    check_types,
    host,
    layer_to_common,
    read_npz,
    to_netcl,
)
from pytreeio.formats.registry import register
from pytreeio.model.form import (
    LAYERS,
    Model,
    layer_list,
    normalize_layers,
    refuse_or_warn,
    training_state,
)

__all__ = ["META_KEY", "NETCL_TYPES", "MODEL"]

# The whole name (fullmatch, DOTALL): netcl looks members up as f"{idx}:{key}" exactly, so a
# name with a trailing newline is another name, not the array's ("$" would allow the newline).
_MEMBER = re.compile(r"(0|[1-9][0-9]{0,8}):(.+)", re.DOTALL)


def _meta_document(text: Any, name: str, field: str) -> dict[str, Any]:
    meta = jsonsafe.loads(text, path=name, field=field)
    if not isinstance(meta, dict):
        raise FormatError("meta must be a JSON object", path=name, field=field)
    if meta.get("type") != "Sequential":
        found = str(meta.get("type"))[:80]
        raise FormatError(
            f"only Sequential models are supported, found type {found!r}",
            path=name,
            field=f"{field}.type",
        )
    return meta


def _file_entries(meta: Mapping[str, Any], name: str) -> list[dict[str, Any]]:
    """The layer entries the meta document states, checked as netcl would build them."""
    config, where = meta.get("config"), f"{META_KEY}.config"
    if config is None and "layers" in meta:  # legacy: [{"type": T, **args}]
        config, where = meta["layers"], "meta.layers"
        if not isinstance(config, list) or not all(isinstance(m, dict) for m in config):
            raise FormatError("legacy 'layers' must be a list of objects", path=name, field=where)
        config = [
            {"type": m.get("type"), "args": {k: v for k, v in m.items() if k != "type"}}
            for m in config
        ]
    if not isinstance(config, list):
        raise FormatError("meta has no 'config' list", path=name, field=where)
    out = []
    for i, entry in enumerate(config):
        field = f"{where}[{i}]"
        if not isinstance(entry, dict) or "type" not in entry:
            raise FormatError("a layer entry must be an object with 'type'", path=name, field=field)
        ltype = entry["type"]
        if not isinstance(ltype, str) or ltype not in NETCL_TYPES:
            raise FormatError(
                f"unknown layer type {str(ltype)[:80]!r}", path=name, field=f"{field}.type"
            )
        args = entry.get("args") if entry.get("args") is not None else {}
        if not isinstance(args, dict):
            raise FormatError("args must be an object", path=name, field=f"{field}.args")
        spec = LAYERS[ltype]
        missing = [k for k in spec.required if k not in args]
        unknown = (
            [] if args.keys() <= spec.arg_set else sorted(map(str, args.keys() - spec.arg_set))
        )
        if missing or unknown:
            what = f"missing required arg {missing[0]!r}" if missing else f"unknown args {unknown}"
            raise FormatError(f"{ltype} is {what}", path=name, field=f"{field}.args")
        out.append({"type": ltype, "args": args})
    return out


def _split_members(arrays: Mapping[str, Any], n_layers: int, name: str) -> list[dict[str, Any]]:
    layers: list[dict[str, Any]] = [{} for _ in range(n_layers)]
    for key, arr in arrays.items():
        if key == META_KEY:
            continue
        field = f"{key[:80]}.npy"
        m = _MEMBER.fullmatch(key)
        if m is None:
            raise FormatError(
                f"member {key[:80]!r} is not named '<layer>:<key>'", path=name, field=field
            )
        i = int(m.group(1))
        if i >= n_layers:
            raise FormatError(
                f"member refers to layer {i}, the config has {n_layers}", path=name, field=field
            )
        layers[i][m.group(2)] = arr
    return layers


def _meta_from_npz(arrays: Mapping[str, np.ndarray], name: str) -> dict[str, Any]:
    return _meta_document(_meta_text(arrays, name), name, META_KEY)


def _meta_text(arrays: Mapping[str, np.ndarray], name: str) -> str:
    if META_KEY not in arrays:
        raise FormatError(
            f"model file is missing NetCL metadata ({META_KEY})", path=name, field=META_KEY
        )
    m = arrays[META_KEY]
    if m.shape != () or m.dtype.kind != "U":
        raise FormatError(
            f"{META_KEY} must be a 0-d unicode array, found {m.dtype}{list(m.shape)}",
            path=name,
            field=META_KEY,
        )
    try:
        return str(m.item())
    except (ValueError, UnicodeError) as exc:
        raise FormatError(
            f"{META_KEY} holds invalid text: {exc}", path=name, field=META_KEY
        ) from None


def _role(source: Mapping[str, Any]) -> str:
    """netcl's lookup order among the files present: the path, the legacy pair, ``<path>.netcl``."""
    if "model" in source:
        return "model"
    if "legacy_json" in source and "legacy_npz" in source:
        return "legacy"
    if "netcl" in source:
        return "netcl"
    raise FormatError(f"no netcl model file among {sorted(source)}", field="model")


def decode(
    source: Mapping[str, Any], *, verify_crc: bool = True, allow_missing: bool = False
) -> Decoded:
    """The per-layer arrays and the meta document; ``allow_missing`` accepts absent arrays (as netcl)."""
    role = _role(source)
    if role == "legacy":
        meta = _meta_document(bytes(as_memoryview(source["legacy_json"])), "legacy_json", "json")
        name = "legacy_npz"
        arrays = read_npz(source, name, verify_crc)
    else:
        name = role
        arrays = read_npz(source, role, verify_crc)
        meta = _meta_from_npz(arrays, role)
    entries = _file_entries(meta, name)
    layers = _split_members(arrays, len(entries), name)
    return Decoded(_checked_layers(entries, layers, name, allow_missing), meta)


def _checked_layers(
    entries: list[dict[str, Any]],
    layers: list[dict[str, Any]],
    name: str,
    allow_missing: bool,
    shaped: Callable[[Any], np.ndarray] = lambda a: a,
) -> list[dict[str, Any]]:
    """Each layer's members checked against its config entry, trimmed to the layer's names.

    ``shaped`` gives the array (or a stand-in of its shape and dtype) a member's value
    stands for: `slots` checks slots exactly as `decode` checks arrays.
    """

    for i, (entry, arrs) in enumerate(zip(entries, layers)):
        try:
            one = layer_to_common(entry["type"], {k: shaped(v) for k, v in arrs.items()}, f"[{i}]")
            if not allow_missing:
                normalize_layers([entry], [one])
        except MismatchError as exc:
            raise FormatError(exc.reason, path=name, field=f"{META_KEY}.config[{i}]") from None
    for i, (entry, arrs) in enumerate(zip(entries, layers)):
        layers[i] = {k: arrs[k] for k in NAMES.get(entry["type"], {}).values() if k in arrs}
    return layers


def _stand_in(slot: Slot) -> np.ndarray:
    """An array of the slot's shape and dtype that costs no memory, for the shape checks."""
    return np.broadcast_to(np.zeros((), slot.dtype), slot.shape)


def slots(
    source: Mapping[str, ByteSource], *, verify_crc: bool = True, allow_missing: bool = False
) -> Slots:
    """Where each array lies (ZIP directory, local and ``.npy`` headers); checked as ``decode`` checks."""
    role = _role(source)
    if role == "legacy":
        js = source["legacy_json"]
        meta = _meta_document(js.read(0, js.size, "json"), "legacy_json", "json")
        name = "legacy_npz"
        found = npy.npz_slots(source[name], role=name, verify_crc=verify_crc)
    else:
        name = role
        found = npy.npz_slots(source[role], role=role, verify_crc=verify_crc)
        held = {META_KEY: found[META_KEY].read(source)} if META_KEY in found else {}
        meta = _meta_from_npz(held, role)
    entries = _file_entries(meta, name)
    layers = _split_members(found, len(entries), name)
    return Slots(_checked_layers(entries, layers, name, allow_missing, _stand_in), meta)


def _native_layers(tree: Any) -> list[dict[str, Any]]:
    if not isinstance(tree, list | tuple):
        raise MismatchError(
            "netcl's native tree is a list with one dict of arrays per layer",
            key_path="",
            found=type(tree).__name__,
        )
    out = []
    for i, layer in enumerate(tree):
        layer = {} if layer is None else layer
        if not isinstance(layer, Mapping) or not all(isinstance(k, str) for k in layer):
            found = type(layer).__name__
            raise MismatchError(
                "each layer must be a dict of arrays", key_path=f"[{i}]", found=found
            )
        out.append(dict(layer))
    return out


def _guess_entry(layer: Mapping[str, Any], i: int) -> str:
    keys = set(layer)
    if keys and keys <= set(NAMES["BatchNorm2d"].values()):
        return "BatchNorm2d"
    ndim = getattr(layer.get("weight"), "ndim", 0)
    if "weight" in keys and keys <= {"weight", "bias"} and ndim in (2, 4):
        return "Linear" if ndim == 2 else "Conv2d"
    what = "has no parameters" if not keys else f"has arrays {sorted(keys)}"
    raise MismatchError(
        f"layer {i} {what}, so its type cannot be inferred; pass meta={{'config': [...]}} "
        "with an entry for every layer",
        key_path=f"meta.config[{i}]",
    )


def _model_of_native(native: Any, entries: list[Any] | None) -> Model:
    layers = _native_layers(native)
    if entries is None:
        entries = [_guess_entry(layer, i) for i, layer in enumerate(layers)]
    if len(entries) != len(layers):
        raise MismatchError(
            f"the layer config has {len(entries)} entries but the tree has {len(layers)} layers",
            key_path="meta.config",
            expected=len(layers),
            found=len(entries),
        )
    types = [
        e if isinstance(e, str) else e.get("type") if isinstance(e, Mapping) else e for e in entries
    ]
    common = []
    for i, (t, arrays) in enumerate(zip(types, layers)):
        if t not in NETCL_TYPES:
            raise MismatchError(
                f"unknown layer type {t!r}; netcl knows {list(NETCL_TYPES)}",
                key_path=f"meta.config[{i}].type",
            )
        common.append(layer_to_common(str(t), arrays, f"[{i}]"))
    return Model(tuple(normalize_layers(entries, common)))


def to_model(native: Any, meta: Mapping[str, Any]) -> Model:
    """The common form of a decoded model file."""
    return _model_of_native(native, _file_entries(meta, "meta"))


def from_model(
    model: Model, meta: Mapping[str, Any] | None = None, *, lossy: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """netcl's per-layer arrays and meta document for a model.

    A model file holds no optimizer state or step counter (that is
    netcl-checkpoint's) and no ``trainable`` flag: `ConversionError`
    unless ``lossy``, which drops them with a warning.  Layer types netcl
    lacks are always refused.
    """
    check_types(model)
    frozen = [
        f"layer {i} ({la.type}) trainable=false (netcl's config has no such flag)"
        for i, la in enumerate(model.layers)
        if not la.trainable
    ]
    refuse_or_warn(
        training_state(model) + frozen,
        "netcl",
        lossy,
        hint=" (a model file holds no training state; netcl-checkpoint does)",
    )
    native = []
    for i, la in enumerate(model.layers):
        names, layer = NAMES.get(la.type, {}), {}
        for k, a in la.arrays.items():
            a = to_netcl(a)
            if type(a) is not np.ndarray or a.dtype.hasobject:  # numpy ones are ready as they are
                a = host(a, f"[{i}].{names[k]}")
            layer[names[k]] = a
        native.append(layer)
    doc = {
        "type": "Sequential",
        "config": model.config(),
        "version": 2,
        "format": "netcl.single-file",
    }
    return native, doc


def encode(tree: Any, *, meta: Any = None, checked: bool = False) -> Encoded:
    """The model file for a native layer list; ``meta`` gives the layer config (partial entries allowed).

    ``checked``: ``tree`` and ``meta`` are what `from_model` made (the
    API says so on a save through the common form): they were checked when
    made, and are written as they are.
    """
    if checked and isinstance(tree, list) and isinstance(meta, dict):
        layers, doc = tree, meta
    else:
        if isinstance(meta, Mapping) and meta.get("type", "Sequential") != "Sequential":
            raise MismatchError(
                "netcl stores Sequential models only", key_path="meta.type", found=meta["type"]
            )
        given = layer_list(meta) if isinstance(meta, Mapping | list | tuple) else None
        layers, doc = from_model(_model_of_native(tree, given))
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError) as exc:
        raise MismatchError(
            f"layer config is not JSON-serialisable: {exc}", key_path="meta.config"
        ) from None
    items: list[tuple[str, Any]] = [
        (f"{i}:{k}", a) for i, layer in enumerate(layers) for k, a in layer.items()
    ]
    items.append((META_KEY, np.array(text, dtype=np.str_)))
    return Encoded(files={"model": Encoded(chunks=tuple(npy.encode_npz(items, overlap=True)))})


def inspect(source: Mapping[str, ByteSource]) -> Info:
    role = _role(source)
    npz_role = "legacy_npz" if role == "legacy" else role
    src = source[npz_role]
    entries = []
    meta: dict[str, Any] = {}
    for key, h, m in npy.inspect_npz(src):
        if key == META_KEY:
            data = zipfmt.member_data(src, m)
            arr = npy.read_npy(data, source=src.name, start=m.data_offset, field=f"{key}.npy")
            meta = _meta_from_npz({META_KEY: arr}, npz_role)
        else:
            entries.append(Entry(key, h.shape, dtypes.name_of(h.dtype), h.nbytes))
    if role == "legacy":
        js = source["legacy_json"]
        meta = _meta_document(js.read(0, js.size, "json"), js.name or "legacy_json", "json")
    elif not meta:
        raise FormatError(
            f"model file is missing NetCL metadata ({META_KEY})", path=npz_role, field=META_KEY
        )
    return Info("netcl", tuple(entries), meta)


def locate(path: Path) -> dict[str, Path]:
    s = os.fspath(path)
    return {
        "model": Path(path),
        "legacy_json": Path(s + ".json"),
        "legacy_npz": Path(s + ".npz"),
        "netcl": Path(s + ".netcl"),
    }


def _has_meta_member(probe: Probe | None) -> bool:
    return probe is not None and probe.members is not None and f"{META_KEY}.npy" in probe.members


def sniff(probe: Probe) -> float:
    sib = probe.siblings
    if "model" in sib:
        return STRUCTURE + 10 if _has_meta_member(sib["model"]) else 0.0
    legacy_json, legacy_npz = sib.get("legacy_json"), sib.get("legacy_npz")
    if legacy_json and legacy_npz and b'"Sequential"' in legacy_json.head:
        return STRUCTURE if legacy_npz.members is not None else 0.0
    return STRUCTURE if _has_meta_member(sib.get("netcl")) else 0.0


MODEL = register(
    Format(
        name="netcl",
        description="netcl 0.4.4 model file (.npz with __netcl_meta__; legacy .json+.npz pair read)",
        suffixes=(".netcl",),
        layout=Siblings(locate, roles=("model", "legacy_json", "legacy_npz", "netcl")),
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=sniff,
        to_model=to_model,
        slots=slots,
        from_model=from_model,
        streams=True,
    )
)
