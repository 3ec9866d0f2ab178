"""netcl (``pip install netcl==0.4.4``): model files, training checkpoints, raw parameters.

Three formats, all built on ``.npz`` archives (see :mod:`pytreeio.npy` for the
ZIP and ``.npy`` byte layout; they are byte-identical to ``np.savez``):

``netcl`` - a model file as ``netcl.io.save_model`` writes it::

    <path>                 uncompressed .npz, members in this order:
      "<i>:<key>.npy"        each array of layer i's state dict, in layer order and
                             state-dict order (Linear/Conv2d: weight, bias;
                             BatchNorm2d: gamma, beta, running_mean, running_var);
                             i counts every layer, parameter-free ones too
      "__netcl_meta__.npy"   last: 0-d '<U' array holding json.dumps (default
                             separators) of {"type": "Sequential", "config": [...],
                             "version": 2, "format": "netcl.single-file"}

  Layer config entries are ``{"type": T, "args": {...}}``, args in this order:

  =========== ============================================================ ===============================
  type        args (defaults)                                              arrays (shapes)
  =========== ============================================================ ===============================
  Linear      in_features, out_features, bias (true)                       weight (in, out), bias (out,)
  Conv2d      in_channels, out_channels, kernel_size, stride (1), pad (0), weight (out, in/groups, k, k),
              bias (true), dilation (1), groups (1)                        bias (out,)
  BatchNorm2d num_features, momentum (0.1), eps (1e-05)                    gamma, beta, running_mean,
                                                                           running_var (n,)
  LeakyReLU   negative_slope (0.01)
  Dropout     p (0.5), seed (null)
  MaxPool2d   kernel_size (2), stride (2)
  ReLU, Sigmoid, Tanh, Flatten: {}
  =========== ============================================================ ===============================

  Loading follows netcl's lookup order: ``<path>``; else the legacy pair
  ``<path>.json`` (meta, ``"version": 1``, ``"config"`` or the older
  ``"layers": [{"type": T, **args}]``) + ``<path>.npz`` (the arrays); else
  ``<path>.netcl``.  Saving always writes the single file at ``<path>``.

  Native tree: a list with one dict per layer, ``[{'weight', 'bias'}, {}, ...]``;
  meta: the meta document.  A Flax ``Dense_N``/``Conv_N``/``BatchNorm_N`` (or
  ``layers_N``) variables tree maps onto it with a layer config; Conv kernels
  move between Flax HWIO and netcl OIHW with a jit-compiled transpose.

``netcl-checkpoint`` - ``netcl.io.checkpoint.save_checkpoint``::

    <p>.npz    (".npz" appended unless <p> ends with it) parameters, names p0, p1, ...
               in model.parameters() order unless names are given
    <p>.json   (<p> with its last suffix replaced) json.dump of
               {"optim_state": {...}, "config": {...}}; AdamW state
               {"t": int, "moments": [[m, v], ...]}, SGD {"velocity": [...]}

``netcl-params`` - ``save_params``: the bare ``<p>.npz``.  Restoring reports a
missing name as :class:`NetclMissingParamError` (also a ``KeyError``) and a
wrong shape as :class:`NetclShapeMismatchError` (a ``ValueError``), with
netcl's wording.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import npy
from ..binary import BufferSource, ByteSource, as_memoryview
from ..errors import (
    EncodeError,
    FormatError,
    MismatchError,
    NetclMissingParamError,
    NetclShapeMismatchError,
)
from ..registry import Decoded, Encoded, Entry, Format, Info, Probe, register

__all__ = [
    "META_KEY",
    "LAYER_ARGS",
    "NetclMissingParamError",
    "NetclShapeMismatchError",
    "normalize_config",
    "flax_to_native",
    "native_to_flax",
    "param_slots",
    "MODEL",
    "CHECKPOINT",
    "PARAMS",
]

META_KEY = "__netcl_meta__"
_REQUIRED = object()

#: netcl 0.4.4's layer types: their config args in ``layer_to_config`` order, with ctor defaults.
LAYER_ARGS: dict[str, tuple[tuple[str, Any], ...]] = {
    "Conv2d": (
        ("in_channels", _REQUIRED),
        ("out_channels", _REQUIRED),
        ("kernel_size", _REQUIRED),
        ("stride", 1),
        ("pad", 0),
        ("bias", True),
        ("dilation", 1),
        ("groups", 1),
    ),
    "Linear": (("in_features", _REQUIRED), ("out_features", _REQUIRED), ("bias", True)),
    "BatchNorm2d": (("num_features", _REQUIRED), ("momentum", 0.1), ("eps", 1e-5)),
    "ReLU": (),
    "LeakyReLU": (("negative_slope", 0.01),),
    "Sigmoid": (),
    "Tanh": (),
    "Dropout": (("p", 0.5), ("seed", None)),
    "MaxPool2d": (("kernel_size", 2), ("stride", 2)),
    "Flatten": (),
}
#: state-dict arrays per layer type, in netcl's order (the order they are written).
LAYER_ARRAYS: dict[str, tuple[str, ...]] = {
    "Conv2d": ("weight", "bias"),
    "Linear": ("weight", "bias"),
    "BatchNorm2d": ("gamma", "beta", "running_mean", "running_var"),
}
#: netcl's trainable parameters per layer type (``model.parameters()`` order).
LAYER_PARAMS: dict[str, tuple[str, ...]] = {
    "Conv2d": ("weight", "bias"),
    "Linear": ("weight", "bias"),
    "BatchNorm2d": ("gamma", "beta"),
}

_MEMBER = re.compile(r"^(0|[1-9][0-9]*):(.+)$")


# --------------------------------------------------------------------------
# layer config
# --------------------------------------------------------------------------


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in a.shape)


def _inferred_args(
    ltype: str, arrays: Mapping[str, Any], given: Mapping[str, Any]
) -> dict[str, Any]:
    """The args of a parameter layer that its arrays' shapes determine."""
    if ltype == "Linear" and "weight" in arrays:
        w = _shape(arrays["weight"])
        if len(w) != 2:
            return {}
        return {"in_features": w[0], "out_features": w[1], "bias": "bias" in arrays}
    if ltype == "Conv2d" and "weight" in arrays:
        w = _shape(arrays["weight"])
        if len(w) != 4:
            return {}
        groups = given.get("groups", 1)
        groups = groups if isinstance(groups, int) and groups > 0 else 1
        return {
            "in_channels": w[1] * groups,
            "out_channels": w[0],
            "kernel_size": w[2],
            "bias": "bias" in arrays,
        }
    if ltype == "BatchNorm2d" and "gamma" in arrays:
        g = _shape(arrays["gamma"])
        return {"num_features": g[0]} if len(g) == 1 else {}
    return {}


def _guess_type(arrays: Mapping[str, Any]) -> str | None:
    keys = set(arrays)
    if keys and keys <= {"gamma", "beta", "running_mean", "running_var"}:
        return "BatchNorm2d"
    if "weight" in keys and keys <= {"weight", "bias"}:
        nd = len(_shape(arrays["weight"]))
        return {2: "Linear", 4: "Conv2d"}.get(nd)
    return None


def layer_problems(ltype: str, args: Mapping[str, Any], arrays: Mapping[str, Any]) -> list[str]:
    """What is inconsistent between a layer's config and its arrays (empty when fine)."""
    spec = dict(LAYER_ARGS[ltype])
    full = {k: args.get(k, d) for k, d in spec.items()}
    allowed = LAYER_ARRAYS.get(ltype, ())
    out = [f"unexpected array {k!r} for a {ltype} layer" for k in arrays if k not in allowed]
    if ltype in ("Linear", "Conv2d"):
        need = ["weight"] + (["bias"] if full["bias"] else [])
        if not full["bias"] and "bias" in arrays:
            out.append(f"{ltype} has bias=false but the arrays include 'bias'")
    else:
        need = list(allowed)
    out += [f"missing array {k!r} of a {ltype} layer" for k in need if k not in arrays]
    want: dict[str, tuple[int, ...]] = {}
    try:
        if ltype == "Linear":
            want = {
                "weight": (full["in_features"], full["out_features"]),
                "bias": (full["out_features"],),
            }
        elif ltype == "Conv2d":
            g = full["groups"]
            k = full["kernel_size"]
            want = {
                "weight": (full["out_channels"], full["in_channels"] // g, k, k),
                "bias": (full["out_channels"],),
            }
            if full["in_channels"] % g or full["out_channels"] % g:
                out.append(f"groups={g} must divide in_channels and out_channels")
        elif ltype == "BatchNorm2d":
            n = full["num_features"]
            want = {k: (n,) for k in allowed}
    except (TypeError, ZeroDivisionError) as exc:
        out.append(f"invalid {ltype} args {dict(args)}: {exc}")
    for k, shape in want.items():
        if k in arrays and _shape(arrays[k]) != tuple(shape):
            out.append(f"{k} has shape {_shape(arrays[k])}, the config says {tuple(shape)}")
    return out


def _entry_parts(entry: Any, index: int) -> tuple[str, dict[str, Any]]:
    where = f"meta.config[{index}]"
    args: dict[str, Any]
    if isinstance(entry, str):
        ltype, args = entry, {}
    elif isinstance(entry, Mapping):
        extra = set(entry) - {"type", "args"}
        if "type" not in entry or extra:
            raise MismatchError(
                f"a layer config is {{'type': T, 'args': {{...}}}}; found keys {sorted(map(str, entry))}",
                key_path=where,
            )
        ltype = entry["type"]
        args = entry.get("args") or {}
        if not isinstance(args, Mapping):
            raise MismatchError(
                "args must be an object", key_path=f"{where}.args", found=type(args).__name__
            )
        args = dict(args)
    else:
        raise MismatchError(
            "a layer config must be a dict or a type name", key_path=where, found=repr(entry)
        )
    if ltype not in LAYER_ARGS:
        raise MismatchError(
            f"unknown layer type {ltype!r}; netcl 0.4.4 knows {sorted(LAYER_ARGS)}",
            key_path=f"{where}.type",
        )
    return ltype, args


def normalize_config(
    config: Sequence[Any] | None, layers: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """netcl's full layer config for ``layers`` (one dict of arrays per layer).

    ``config`` entries may be partial (``"ReLU"``, ``{"type": "Linear"}``):
    args of parameter layers are inferred from shapes, the others get netcl's
    defaults.  Without a config, parameter layers are recognised from their
    arrays; a parameter-free layer cannot be, and is an error naming its index.
    """
    if config is not None and len(config) != len(layers):
        raise MismatchError(
            f"the layer config has {len(config)} entries but the tree has {len(layers)} layers",
            key_path="meta.config",
            expected=len(layers),
            found=len(config),
        )
    out = []
    for i, arrays in enumerate(layers):
        if config is not None:
            ltype, given = _entry_parts(config[i], i)
        else:
            guessed = _guess_type(arrays)
            if guessed is None:
                what = "has no parameters" if not arrays else f"has arrays {sorted(arrays)}"
                raise MismatchError(
                    f"layer {i} {what}, so its type cannot be inferred; pass "
                    "meta={'config': [...]} with an entry for every layer",
                    key_path=f"meta.config[{i}]",
                )
            ltype, given = guessed, {}
        spec = LAYER_ARGS[ltype]
        unknown = sorted(set(given) - {k for k, _ in spec})
        if unknown:
            raise MismatchError(
                f"unknown args {unknown} for {ltype}",
                key_path=f"meta.config[{i}].args",
                expected=[k for k, _ in spec],
            )
        inferred = _inferred_args(ltype, arrays, given)
        args: dict[str, Any] = {}
        for k, default in spec:
            if k in given:
                args[k] = given[k]
            elif k in inferred:
                args[k] = inferred[k]
            elif default is _REQUIRED:
                raise MismatchError(
                    f"{ltype} needs {k!r} (no array to infer it from)",
                    key_path=f"meta.config[{i}].args.{k}",
                )
            else:
                args[k] = default
        problems = layer_problems(ltype, args, arrays)
        if problems:
            raise MismatchError(f"layer {i} ({ltype}): {'; '.join(problems)}", key_path=f"[{i}]")
        out.append({"type": ltype, "args": args})
    return out


def _config_of_meta(meta: Any) -> list[Any] | None:
    """The layer config a caller's ``meta`` holds (document, legacy document or bare list)."""
    if meta is None:
        return None
    if isinstance(meta, list | tuple):
        return list(meta)
    if isinstance(meta, Mapping):
        if meta.get("type", "Sequential") != "Sequential":
            raise MismatchError(
                "netcl stores Sequential models only", key_path="meta.type", found=meta.get("type")
            )
        if "config" in meta and meta["config"] is not None:
            return list(meta["config"])
        if "layers" in meta:
            return _legacy_layers(meta["layers"])
        return None
    raise MismatchError(
        "meta must be the netcl meta document or a layer config list", found=type(meta).__name__
    )


def _legacy_layers(layers: Any) -> list[Any]:
    if not isinstance(layers, list) or not all(
        isinstance(m, Mapping) and "type" in m for m in layers
    ):
        raise FormatError(
            "legacy 'layers' must be a list of objects with 'type'", field="meta.layers"
        )
    return [
        {"type": m["type"], "args": {k: v for k, v in m.items() if k != "type"}} for m in layers
    ]


# --------------------------------------------------------------------------
# Flax mapping
# --------------------------------------------------------------------------

_FLAX_KIND = {"Dense": "Linear", "Conv": "Conv2d", "BatchNorm": "BatchNorm2d"}
_FLAX_NAME = re.compile(r"^(Dense|Conv|BatchNorm|layers)_(0|[1-9][0-9]*)$")
_HWIO_TO_OIHW = (3, 2, 0, 1)
_OIHW_TO_HWIO = (2, 3, 1, 0)


def _split_flax(tree: Any) -> tuple[Mapping[str, Any], Mapping[str, Any], bool] | None:
    """``(params, batch_stats, is_variables_dict)`` of a Flax tree, or None if it is not one."""
    if not isinstance(tree, Mapping) or not tree:
        return None
    if "params" in tree and isinstance(tree["params"], Mapping):
        if set(tree) - {"params", "batch_stats"}:
            return None
        params = tree["params"]
        stats = tree.get("batch_stats") or {}
        variables = True
    else:
        params, stats, variables = tree, {}, False
    if not params or not all(isinstance(k, str) and _FLAX_NAME.match(k) for k in params):
        return None
    return params, stats, variables


def is_flax_tree(tree: Any) -> bool:
    return _split_flax(tree) is not None


def _flax_index(
    names: Sequence[str], config: Sequence[Any] | None, order_only: bool = False
) -> dict[str, int]:
    """netcl layer index of every Flax module name.

    With ``order_only`` (parameter order for checkpoints, where activations do
    not matter) a tree of a single module kind is ordered by its numbers.
    """
    parsed = {n: _FLAX_NAME.match(n) for n in names}
    bases = {m.group(1) for m in parsed.values() if m}
    if "layers" in bases:
        if bases != {"layers"}:
            raise MismatchError(
                "mixing layers_N with Dense_N/Conv_N/BatchNorm_N names", key_path="params"
            )
        return {n: int(m.group(2)) for n, m in parsed.items() if m}
    if config is None and order_only and len(bases) == 1:
        return {n: int(m.group(2)) for n, m in parsed.items() if m}
    if config is None:
        raise MismatchError(
            "a Flax Dense_N/Conv_N/BatchNorm_N tree needs the layer order: pass "
            "meta={'config': [...]} listing every netcl layer (activations too)",
            key_path="meta.config",
        )
    types = [_entry_parts(e, i)[0] for i, e in enumerate(config)]
    out: dict[str, int] = {}
    for base, ltype in _FLAX_KIND.items():
        positions = [i for i, t in enumerate(types) if t == ltype]
        have = sorted(int(m.group(2)) for m in parsed.values() if m and m.group(1) == base)
        if have != list(range(len(positions))):
            raise MismatchError(
                f"the config has {len(positions)} {ltype} layers but the tree has {base} modules "
                f"{[f'{base}_{k}' for k in have]}",
                key_path="params",
                expected=[f"{base}_{k}" for k in range(len(positions))],
            )
        for k, i in enumerate(positions):
            out[f"{base}_{k}"] = i
    return out


def _module_kind(name: str, module: Mapping[str, Any], stats: Mapping[str, Any]) -> str:
    m = _FLAX_NAME.match(name)
    assert m is not None
    if m.group(1) != "layers":
        return _FLAX_KIND[m.group(1)]
    if "scale" in module or name in stats:
        return "BatchNorm2d"
    kernel = module.get("kernel")
    nd = len(kernel.shape) if kernel is not None else 0
    if nd in (2, 4):
        return "Linear" if nd == 2 else "Conv2d"
    raise MismatchError(
        f"cannot tell what layer {name} is", key_path=f"params/{name}", found=sorted(module)
    )


def _check_leaf_names(
    name: str, got: Mapping[str, Any], allowed: Sequence[str], where: str
) -> None:
    extra = sorted(set(got) - set(allowed))
    if extra:
        raise MismatchError(
            f"{name} has entries netcl has no place for: {extra}", key_path=f"{where}/{name}"
        )


def flax_to_native(tree: Any, config: Sequence[Any] | None) -> list[dict[str, Any]]:
    """netcl's per-layer arrays for a Flax params or variables tree (not yet normalised)."""
    from ..quant import transpose

    split = _split_flax(tree)
    if split is None:
        raise MismatchError("not a Flax Dense_N/Conv_N/BatchNorm_N/layers_N tree", key_path="")
    params, stats, _ = split
    index = _flax_index(list(params), config)
    n = len(config) if config is not None else max(index.values()) + 1
    layers: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, module in params.items():
        i = index[name]
        if i >= n:
            raise MismatchError(
                f"{name} is past the {n} layers of the config", key_path=f"params/{name}"
            )
        kind = _module_kind(name, module, stats)
        if kind == "BatchNorm2d":
            _check_leaf_names(name, module, ("scale", "bias"), "params")
            st = stats.get(name)
            if st is None:
                raise MismatchError(
                    f"{name} has no batch statistics; pass the variables dict "
                    "{'params': ..., 'batch_stats': ...}",
                    key_path=f"batch_stats/{name}",
                )
            _check_leaf_names(name, st, ("mean", "var"), "batch_stats")
            layers[i] = {
                "gamma": module["scale"],
                "beta": module["bias"],
                "running_mean": st["mean"],
                "running_var": st["var"],
            }
            continue
        _check_leaf_names(name, module, ("kernel", "bias"), "params")
        kernel = module["kernel"]
        weight = transpose(kernel, _HWIO_TO_OIHW) if kind == "Conv2d" else kernel
        layers[i] = {"weight": weight, **({"bias": module["bias"]} if "bias" in module else {})}
    extra = sorted(set(stats) - set(params))
    if extra:
        raise MismatchError(
            f"batch_stats for modules without params: {extra}", key_path="batch_stats"
        )
    if config is None:
        missing = [i for i in range(n) if not layers[i]]
        if missing:
            raise MismatchError(
                f"layer {missing[0]} has no parameters, so its type cannot be inferred; pass "
                "meta={'config': [...]} with an entry for every layer",
                key_path=f"meta.config[{missing[0]}]",
            )
    return layers


def native_to_flax(native: Sequence[Mapping[str, Any]], config: Sequence[Any], like: Any) -> Any:
    """The native layer list restored into a Flax params/variables tree shaped like ``like``."""
    from ..quant import transpose
    from ..tree import restore

    split = _split_flax(like)
    assert split is not None
    params_like, stats_like, variables = split
    index = _flax_index(list(params_like), config)
    used: set[tuple[int, str]] = set()

    def take(
        i: int, key: str, path: tuple[str, ...], like_leaf: Any, axes: tuple[int, ...] | None = None
    ) -> Any:
        layer = native[i] if i < len(native) else {}
        if key not in layer:
            raise MismatchError(
                f"netcl layer {i} has no {key!r} array",
                key_path="/".join(path),
                expected=_desc(like_leaf),
                found="nothing",
            )
        used.add((i, key))
        arr = layer[key]
        if axes is not None and len(_shape(arr)) == 4:
            arr = transpose(arr, axes)
        return restore(arr, like_leaf, path=path)

    out_params: dict[str, Any] = {}
    out_stats: dict[str, Any] = {}
    for name, module in params_like.items():
        i = index[name]
        kind = _module_kind(name, module, stats_like)
        if kind == "BatchNorm2d":
            _check_leaf_names(name, module, ("scale", "bias"), "params")
            names = {"scale": "gamma", "bias": "beta"}
            out_params[name] = {
                k: take(i, names[k], ("params", name, k), v) for k, v in module.items()
            }
            if name in stats_like:
                st = stats_like[name]
                _check_leaf_names(name, st, ("mean", "var"), "batch_stats")
                snames = {"mean": "running_mean", "var": "running_var"}
                out_stats[name] = {
                    k: take(i, snames[k], ("batch_stats", name, k), v) for k, v in st.items()
                }
            continue
        _check_leaf_names(name, module, ("kernel", "bias"), "params")
        axes = _OIHW_TO_HWIO if kind == "Conv2d" else None
        out_params[name] = {
            k: take(
                i,
                "weight" if k == "kernel" else "bias",
                ("params", name, k),
                v,
                axes if k == "kernel" else None,
            )
            for k, v in module.items()
        }
    left = sorted(f"{i}:{k}" for i, layer in enumerate(native) for k in layer if (i, k) not in used)
    if left:
        hint = (
            " (pass the variables dict with 'batch_stats')"
            if any("running_" in s for s in left)
            else ""
        )
        raise MismatchError(
            f"the file has arrays that `like` lacks: {left[:10]}{hint}", key_path=""
        )
    if variables:
        result: dict[str, Any] = {"params": out_params}
        if "batch_stats" in (like if isinstance(like, Mapping) else {}):
            result["batch_stats"] = out_stats
        return result
    return out_params


def _desc(x: Any) -> str:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    return f"{dtype}{list(shape)}" if shape is not None else type(x).__name__


def param_slots(
    tree: Any, config: Sequence[Any] | None
) -> list[tuple[tuple[str, ...], tuple[int, ...] | None]]:
    """The Flax key paths of netcl's trainable parameters, in ``model.parameters()`` order.

    Each slot is ``(key path, axes)``: ``axes`` turns the Flax array into
    netcl's layout (Conv kernels HWIO -> OIHW), None when they agree.
    """
    split = _split_flax(tree)
    if split is None:
        raise MismatchError("not a Flax Dense_N/Conv_N/BatchNorm_N/layers_N tree", key_path="")
    params, stats, variables = split
    index = _flax_index(list(params), config, order_only=True)
    prefix: tuple[str, ...] = ("params",) if variables else ()
    slots: list[tuple[int, int, tuple[str, ...], tuple[int, ...] | None]] = []
    for name, module in params.items():
        kind = _module_kind(name, module, stats)
        i = index[name]
        order: list[tuple[str, tuple[int, ...] | None]]
        if kind == "BatchNorm2d":
            order = [("scale", None), ("bias", None)]
        else:
            order = [("kernel", _HWIO_TO_OIHW if kind == "Conv2d" else None), ("bias", None)]
        for j, (leaf, axes) in enumerate(order):
            if leaf in module:
                slots.append((i, j, (*prefix, name, leaf), axes))
    slots.sort(key=lambda s: (s[0], s[1]))
    return [(path, axes) for _, _, path, axes in slots]


def _get(tree: Any, path: Sequence[str]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _flax_flatten(config: Sequence[Any] | None) -> Any:
    """A ``flatten`` for :mod:`pytreeio.optim`: params-shaped tree -> netcl-ordered arrays."""
    from ..quant import transpose

    def flatten(tree: Any) -> list[Any]:
        out: list[Any] = []
        for path, axes in param_slots(tree, config):
            leaf = _get(tree, path)
            if axes is not None and not hasattr(leaf, "__array__"):
                shape = tuple(leaf.shape[a] for a in axes)
                out.append(_Spec(shape, leaf.dtype))
            else:
                out.append(transpose(leaf, axes) if axes is not None else leaf)
        return out

    return flatten


class _Spec:
    """Shape and dtype of an array not at hand (a transposed ``ShapeDtypeStruct``)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape = shape
        self.dtype = dtype


def _flax_unflatten(config: Sequence[Any] | None) -> Any:
    from ..quant import transpose
    from ..tree import restore

    def unflatten(arrays: list[np.ndarray], like: Any, what: str) -> Any:
        slots = param_slots(like, config)
        if len(arrays) != len(slots):
            raise MismatchError(
                f"{what}: {len(arrays)} tensors for {len(slots)} parameters", key_path=what
            )
        out = _deep_dict_copy(like)
        for (path, axes), arr in zip(slots, arrays):
            leaf_like = _get(like, path)
            value = (
                transpose(arr, tuple(int(a) for a in np.argsort(axes))) if axes is not None else arr
            )
            _set(out, path, restore(value, leaf_like, path=(what, *path)))
        return out

    return unflatten


def _deep_dict_copy(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: _deep_dict_copy(v) for k, v in tree.items()}
    return tree


def _set(tree: Any, path: Sequence[str], value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


# --------------------------------------------------------------------------
# netcl model files
# --------------------------------------------------------------------------


def _source(buffer: Any, name: str) -> ByteSource:
    return buffer if isinstance(buffer, ByteSource) else BufferSource(buffer, name=name)


def _parse_meta_json(text: str, name: str, field: str) -> dict[str, Any]:
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"meta is not valid JSON: {exc}", path=name, field=field) from None
    if not isinstance(meta, dict):
        raise FormatError("meta must be a JSON object", path=name, field=field)
    if meta.get("type") != "Sequential":
        raise FormatError(
            f"only Sequential models are supported, found type {meta.get('type')!r}",
            path=name,
            field=f"{field}.type",
        )
    return meta


def _file_config(meta: Mapping[str, Any], name: str) -> list[tuple[str, dict[str, Any]]]:
    """``(type, args)`` per layer as the file states it, validated as netcl would build it."""
    config = meta.get("config")
    if config is None and "layers" in meta:
        try:
            config = _legacy_layers(meta["layers"])
        except FormatError as exc:
            exc.path = name
            raise
    if not isinstance(config, list):
        raise FormatError("meta has no 'config' list", path=name, field=f"{META_KEY}.config")
    out = []
    for i, entry in enumerate(config):
        field = f"{META_KEY}.config[{i}]"
        if not isinstance(entry, dict) or "type" not in entry:
            raise FormatError("layer entry must be an object with 'type'", path=name, field=field)
        ltype = entry["type"]
        if ltype not in LAYER_ARGS:
            raise FormatError(f"unknown layer type {ltype!r}", path=name, field=f"{field}.type")
        args = entry.get("args") or {}
        if not isinstance(args, dict):
            raise FormatError("args must be an object", path=name, field=f"{field}.args")
        for k, default in LAYER_ARGS[ltype]:
            if default is _REQUIRED and k not in args:
                raise FormatError(
                    f"{ltype} is missing required arg {k!r}", path=name, field=f"{field}.args"
                )
        out.append((ltype, args))
    return out


def _split_members(arrays: Mapping[str, Any], n_layers: int, name: str) -> list[dict[str, Any]]:
    layers: list[dict[str, Any]] = [{} for _ in range(n_layers)]
    for key, arr in arrays.items():
        if key == META_KEY:
            continue
        m = _MEMBER.match(key)
        if m is None:
            raise FormatError(
                f"member {key!r} is not named '<layer>:<key>'", path=name, field=f"{key}.npy"
            )
        i = int(m.group(1))
        if i >= n_layers:
            raise FormatError(
                f"member {key!r} refers to layer {i}, the config has {n_layers}",
                path=name,
                field=f"{key}.npy",
            )
        layers[i][m.group(2)] = arr
    return layers


def _validated_layers(
    config: list[tuple[str, dict[str, Any]]],
    layers: list[dict[str, Any]],
    name: str,
    allow_missing: bool,
) -> list[dict[str, Any]]:
    for i, ((ltype, args), arrays) in enumerate(zip(config, layers)):
        problems = layer_problems(ltype, args, arrays)
        if allow_missing:
            problems = [p for p in problems if not p.startswith("missing array")]
        if problems:
            raise FormatError(
                f"layer {i} ({ltype}): {'; '.join(problems)}",
                path=name,
                field=f"{META_KEY}.config[{i}]",
            )
        order = LAYER_ARRAYS.get(ltype, ())
        layers[i] = {k: arrays[k] for k in order if k in arrays}
    return layers


def _meta_from_npz(arrays: Mapping[str, np.ndarray], name: str) -> dict[str, Any]:
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
        text = str(m.item())
    except (ValueError, UnicodeError) as exc:
        raise FormatError(
            f"{META_KEY} holds invalid text: {exc}", path=name, field=META_KEY
        ) from None
    return _parse_meta_json(text, name, META_KEY)


def _decode_model(
    source: Mapping[str, Any], *, verify_crc: bool = True, allow_missing: bool = False, **_: Any
) -> Decoded:
    if "model" in source:
        role = "model"
    elif "legacy_json" in source and "legacy_npz" in source:
        role = "legacy"
    elif "netcl" in source:
        role = "netcl"
    else:
        raise FormatError(f"no netcl model file among {sorted(source)}", field="model")
    if role == "legacy":
        try:
            text = str(as_memoryview(source["legacy_json"]), "utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(
                f"invalid utf-8: {exc.reason}", path="legacy_json", offset=exc.start
            ) from None
        meta = _parse_meta_json(text, "legacy_json", "json")
        arrays = npy.read_npz(_source(source["legacy_npz"], "legacy_npz"), verify_crc=verify_crc)
        name = "legacy_npz"
    else:
        arrays = npy.read_npz(_source(source[role], role), verify_crc=verify_crc)
        meta = _meta_from_npz(arrays, role)
        name = role
    config = _file_config(meta, name)
    layers = _split_members(arrays, len(config), name)
    return Decoded(_validated_layers(config, layers, name, allow_missing), meta)


def _native_layers(tree: Any) -> list[dict[str, Any]] | None:
    if not isinstance(tree, list | tuple):
        return None
    out = []
    for i, layer in enumerate(tree):
        if layer is None:
            layer = {}
        if not isinstance(layer, Mapping) or not all(isinstance(k, str) for k in layer):
            raise MismatchError(
                "each layer must be a dict of arrays", key_path=f"[{i}]", found=type(layer).__name__
            )
        out.append(dict(layer))
    return out


def model_arrays(tree: Any, meta: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(layers, full config)`` for a native layer list or a Flax tree plus meta."""
    config = _config_of_meta(meta)
    layers = _native_layers(tree)
    if layers is None:
        if not is_flax_tree(tree):
            raise MismatchError(
                "netcl needs a list of per-layer dicts or a Flax Dense_N/Conv_N/BatchNorm_N tree",
                key_path="",
                found=type(tree).__name__,
            )
        layers = flax_to_native(tree, config)
    full = normalize_config(config, layers)
    ordered = [
        {k: layer[k] for k in LAYER_ARRAYS.get(c["type"], ()) if k in layer}
        for c, layer in zip(full, layers)
    ]
    return ordered, full


def _encode_model(tree: Any, *, meta: Any = None, **_: Any) -> Encoded:
    layers, config = model_arrays(tree, meta)
    doc = {"type": "Sequential", "config": config, "version": 2, "format": "netcl.single-file"}
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError) as exc:
        raise MismatchError(
            f"layer config is not JSON-serialisable: {exc}", key_path="meta.config"
        ) from None
    items: list[tuple[str, Any]] = []
    for i, layer in enumerate(layers):
        for k, arr in layer.items():
            items.append((f"{i}:{k}", _host(arr, f"[{i}].{k}")))
    items.append((META_KEY, np.array(text, dtype=np.str_)))
    return Encoded(files={"model": Encoded(chunks=tuple(npy.encode_npz(items)))})


def _host(x: Any, where: str) -> np.ndarray:
    if hasattr(x, "shape") and not hasattr(x, "__array__"):
        raise EncodeError("cannot save an abstract array (ShapeDtypeStruct)", key_path=where)
    arr = np.asarray(x)
    if arr.dtype.hasobject:
        raise EncodeError("object arrays cannot be stored", key_path=where)
    return arr


def _restore_model(native: Any, meta: Mapping[str, Any], like: Any, **_: Any) -> Any:
    if is_flax_tree(like):
        config = _config_of_meta(meta)
        assert config is not None
        return native_to_flax(native, config, like)
    from ..tree import restore

    return restore(native, like)


def _inspect_model(source: Mapping[str, ByteSource]) -> Info:
    if "model" in source:
        role, npz_role = "model", "model"
    elif "legacy_json" in source and "legacy_npz" in source:
        role, npz_role = "legacy", "legacy_npz"
    else:
        role, npz_role = "netcl", "netcl"
    src = source[npz_role]
    entries = []
    meta: dict[str, Any] = {}
    for key, h, m in npy.inspect_npz(src):
        if key == META_KEY:
            data = npy.member_data(src, m)
            arrays = {
                key: npy.read_npy(data, source=src.name, start=m.data_offset, field=f"{key}.npy")
            }
            meta = _meta_from_npz(arrays, npz_role)
            continue
        entries.append(Entry(key, h.shape, h.dtype.name, h.nbytes))
    if role == "legacy":
        js = source["legacy_json"]
        raw = js.read(0, js.size, "json")
        meta = _parse_meta_json(str(raw, "utf-8", errors="strict"), "legacy_json", "json")
    elif not meta:
        raise FormatError(
            f"model file is missing NetCL metadata ({META_KEY})", path=npz_role, field=META_KEY
        )
    return Info("netcl", tuple(entries), meta)


def _locate_model(path: Path) -> dict[str, Path]:
    p = Path(path)
    s = os.fspath(p)
    if p.exists():
        return {"model": p}
    if Path(s + ".json").exists() and Path(s + ".npz").exists():
        return {"model": p, "legacy_json": Path(s + ".json"), "legacy_npz": Path(s + ".npz")}
    if Path(s + ".netcl").exists():
        return {"model": p, "netcl": Path(s + ".netcl")}
    return {"model": p}


def _zip_members(path: Path) -> list[str]:
    from ..io import FileSource

    src = FileSource(path)
    try:
        return [m.name for m in npy.read_zip_directory(src)]
    finally:
        src.close()


def _sniff_model(probe: Probe) -> bool:
    if probe.is_dir:
        return False
    p = Path(probe.path)
    if probe.head:
        return probe.head[:4] == b"PK\x03\x04" and f"{META_KEY}.npy" in _zip_members(p)
    roles = _locate_model(p)
    if "legacy_json" in roles:
        with open(roles["legacy_json"], "rb") as f:
            head = f.read(4096)
        return b'"Sequential"' in head and _is_zip(roles["legacy_npz"])
    if "netcl" in roles:
        return f"{META_KEY}.npy" in _zip_members(roles["netcl"])
    return False


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


MODEL = register(
    Format(
        name="netcl",
        description="netcl 0.4.4 model file (.npz with __netcl_meta__; legacy .json+.npz pair read)",
        suffixes=(".netcl",),
        layout="files",
        encode=_encode_model,
        decode=_decode_model,
        inspect=_inspect_model,
        sniff=_sniff_model,
        restore=_restore_model,
        locate=_locate_model,
        load_options=frozenset({"verify_crc", "allow_missing"}),
    )
)


# --------------------------------------------------------------------------
# raw params and training checkpoints
# --------------------------------------------------------------------------


def _npz_path(path: Path) -> Path:
    s = os.fspath(path)
    return Path(s if s.endswith(".npz") else s + ".npz")


def _param_arrays(
    params: Any, names: Sequence[str] | None, config: Sequence[Any] | None
) -> list[tuple[str, Any]]:
    """``(name, netcl-layout array)`` in netcl parameter order."""
    from ..quant import transpose

    if is_flax_tree(params):
        _no_batch_stats(params)
        arrays = [
            transpose(_get(params, path), axes) if axes else _get(params, path)
            for path, axes in param_slots(params, config)
        ]
    elif isinstance(params, list | tuple):
        arrays = list(params)
    elif isinstance(params, Mapping):
        if names is not None:
            raise MismatchError(
                "names= applies to a list or Flax tree; a dict already names its arrays",
                key_path="params",
            )
        return [(str(k), v) for k, v in params.items()]
    else:
        raise MismatchError(
            "params must be a dict of named arrays, a list, or a Flax tree",
            key_path="params",
            found=type(params).__name__,
        )
    if names is None:
        names = [f"p{i}" for i in range(len(arrays))]
    names = list(names)
    if len(names) != len(arrays):
        raise MismatchError(
            f"{len(names)} names for {len(arrays)} parameters",
            key_path="names",
            expected=len(arrays),
            found=len(names),
        )
    return list(zip(names, arrays))


def _no_batch_stats(tree: Any) -> None:
    split = _split_flax(tree)
    if split is not None and split[1]:
        raise MismatchError(
            "netcl checkpoints hold model.parameters() only, not BatchNorm running statistics; "
            "pass variables['params'] (save the statistics with the 'netcl' model format)",
            key_path="batch_stats",
        )


def _encode_params(
    tree: Any, *, meta: Any = None, names: Sequence[str] | None = None, **_: Any
) -> Encoded:
    config = _config_of_meta(meta) if meta is not None else None
    items = [(n, _host(a, f"params.{n}")) for n, a in _param_arrays(tree, names, config)]
    return Encoded(files={"npz": Encoded(chunks=tuple(npy.encode_npz(items)))})


def _decode_params(source: Mapping[str, Any], *, verify_crc: bool = True, **_: Any) -> Decoded:
    if "npz" not in source:
        raise FormatError("no parameter .npz", field="npz")
    arrays = npy.read_npz(_source(source["npz"], "npz"), verify_crc=verify_crc)
    return Decoded(arrays, {})


def _restore_named(
    arrays: Mapping[str, Any],
    like: Any,
    names: Sequence[str] | None,
    config: Sequence[Any] | None,
    what: str,
) -> Any:
    """Named checkpoint arrays into ``like`` (a list, a Flax tree or a dict), netcl's checks first."""
    from ..quant import transpose
    from ..tree import restore

    if isinstance(like, Mapping) and not is_flax_tree(like):
        return restore(dict(arrays), like, path=(what,) if what else ())
    if is_flax_tree(like):
        _no_batch_stats(like)
        slots = param_slots(like, config)
        likes = [_get(like, path) for path, _ in slots]
    elif isinstance(like, list | tuple):
        slots = []
        likes = list(like)
    else:
        raise MismatchError(
            "like must be a list of arrays, a Flax tree or a dict",
            key_path=what,
            found=type(like).__name__,
        )
    names = [f"p{i}" for i in range(len(likes))] if names is None else list(names)
    values = []
    for i, (n, lk) in enumerate(zip(names, likes)):
        axes = slots[i][1] if slots else None
        want = tuple(lk.shape[a] for a in axes) if axes else tuple(lk.shape)
        if n not in arrays:
            raise NetclMissingParamError(
                f"missing param {n} in checkpoint", key_path=n, expected=want, found="nothing"
            )
        arr = arrays[n]
        if _shape(arr) != want:
            raise NetclShapeMismatchError(
                f"shape mismatch for {n}: ckpt {_shape(arr)} vs param {want}",
                key_path=n,
                expected=want,
                found=_shape(arr),
            )
        value = transpose(arr, tuple(int(a) for a in np.argsort(axes))) if axes else arr
        path = slots[i][0] if slots else (i,)
        values.append(restore(value, lk, path=(what, *path) if what else tuple(path)))
    if len(names) != len(likes):
        raise MismatchError(f"{len(names)} names for {len(likes)} parameters", key_path="names")
    extra = sorted(set(arrays) - set(names))
    if extra:
        raise MismatchError(f"the file has arrays that `like` lacks: {extra[:10]}", key_path=what)
    if slots:
        out = _deep_dict_copy(like)
        for (path, _), v in zip(slots, values):
            _set(out, path, v)
        return out
    return type(like)(values) if isinstance(like, tuple) else values


def _restore_params(
    native: Any,
    meta: Mapping[str, Any],
    like: Any,
    *,
    names: Sequence[str] | None = None,
    config: Any = None,
    **_: Any,
) -> Any:
    return _restore_named(native, like, names, _config_of_meta(config), "")


def _inspect_params(source: Mapping[str, ByteSource], fmt: str = "netcl-params") -> Info:
    entries = tuple(
        Entry(k, h.shape, h.dtype.name, h.nbytes) for k, h, _ in npy.inspect_npz(source["npz"])
    )
    return Info(fmt, entries, {})


def _locate_params(path: Path) -> dict[str, Path]:
    p = Path(path)
    if p.is_file():
        return {"npz": p}
    return {"npz": _npz_path(p)}


def _locate_checkpoint(path: Path) -> dict[str, Path]:
    p = Path(path)
    json_path = p.with_suffix(".json")
    return {"npz": _npz_path(p), "json": json_path}


def _sniff_params(probe: Probe) -> bool:
    if probe.is_dir or not probe.head:
        return False
    if probe.head[:4] != b"PK\x03\x04":
        return False
    names = _zip_members(Path(probe.path))
    return all(n.endswith(".npy") for n in names) and f"{META_KEY}.npy" not in names


def _sniff_checkpoint(probe: Probe) -> bool:
    if probe.is_dir:
        return False
    roles = _locate_checkpoint(Path(probe.path))
    npz_path, json_path = roles["npz"], roles["json"]
    if not (npz_path.is_file() and json_path.is_file()):
        return False
    if probe.head and Path(probe.path) not in (npz_path, json_path):
        return False
    with open(json_path, "rb") as f:
        head = f.read(64)
    return (
        head.startswith(b'{"optim_state"')
        and _is_zip(npz_path)
        and f"{META_KEY}.npy" not in _zip_members(npz_path)
    )


def _decode_checkpoint(source: Mapping[str, Any], *, verify_crc: bool = True, **_: Any) -> Decoded:
    params, _meta = _decode_params(source, verify_crc=verify_crc)
    doc: Any = {}
    if "json" in source:
        view = as_memoryview(source["json"])
        try:
            doc = json.loads(str(view, "utf-8"))
        except UnicodeDecodeError as exc:
            raise FormatError(
                f"invalid utf-8: {exc.reason}", path="json", offset=exc.start
            ) from None
        except (ValueError, RecursionError) as exc:
            raise FormatError(f"invalid JSON: {exc}", path="json") from None
        if not isinstance(doc, dict):
            raise FormatError("the sidecar must be a JSON object", path="json")
    tree = {
        "params": params,
        "optim_state": doc.get("optim_state", {}),
        "config": doc.get("config", {}),
    }
    return Decoded(tree, {"config": tree["config"]})


def _encode_checkpoint(
    tree: Any, *, meta: Any = None, names: Sequence[str] | None = None, layers: Any = None, **_: Any
) -> Encoded:
    from .. import optim

    if (
        not isinstance(tree, Mapping)
        or "params" not in tree
        or set(tree) - {"params", "optim_state", "config"}
    ):
        raise MismatchError(
            "a netcl checkpoint is {'params': ..., 'optim_state': ..., 'config': ...}", key_path=""
        )
    params = tree["params"]
    config = _config_of_meta(layers)
    if (
        config is None
        and isinstance(meta, Mapping)
        and ("layers" in meta or ("config" in meta and isinstance(meta.get("config"), list)))
    ):
        config = _config_of_meta(meta)
    named = _param_arrays(params, names, config)
    state = tree.get("optim_state")
    if state is None:
        state = {}
    elif not isinstance(state, Mapping):
        flatten = _flax_flatten(config) if is_flax_tree(params) else None
        state = optim.to_netcl(state, flatten=flatten)
    cfg = tree.get("config")
    if cfg is None and isinstance(meta, Mapping) and isinstance(meta.get("config"), Mapping):
        cfg = meta["config"]
    doc = {"optim_state": optim.json_ready(state), "config": optim.json_ready(cfg or {})}
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError) as exc:
        raise MismatchError(
            f"optim_state/config is not JSON-serialisable: {exc}", key_path=""
        ) from None
    items = [(n, _host(a, f"params.{n}")) for n, a in named]
    return Encoded(
        files={
            "npz": Encoded(chunks=tuple(npy.encode_npz(items))),
            "json": Encoded(chunks=(text.encode("utf-8"),)),
        }
    )


def _restore_checkpoint(
    native: Any,
    meta: Mapping[str, Any],
    like: Any,
    *,
    names: Sequence[str] | None = None,
    layers: Any = None,
    **_: Any,
) -> Any:
    from .. import optim

    if not isinstance(like, Mapping) or set(like) - {"params", "optim_state", "config"}:
        raise MismatchError(
            "like must be a dict with 'params' and optionally 'optim_state', 'config'", key_path=""
        )
    config = _config_of_meta(layers)
    out: dict[str, Any] = {}
    if "params" in like:
        out["params"] = _restore_named(native["params"], like["params"], names, config, "params")
    if "optim_state" in like:
        state_like = like["optim_state"]
        if isinstance(state_like, Mapping):
            out["optim_state"] = native["optim_state"]
        else:
            p_like = like.get("params")
            flatten = unflatten = None
            if is_flax_tree(p_like):
                flatten = _flax_flatten(config)
                unflatten = _flax_unflatten(config)
            out["optim_state"] = optim.from_netcl(
                native["optim_state"], state_like, flatten=flatten, unflatten=unflatten
            )
    if "config" in like:
        out["config"] = native["config"]
    return out


def _inspect_checkpoint(source: Mapping[str, ByteSource]) -> Info:
    info = _inspect_params(source, "netcl-checkpoint")
    meta: dict[str, Any] = {}
    if "json" in source:
        js = source["json"]
        try:
            doc = json.loads(str(js.read(0, js.size, "json"), "utf-8"))
        except (ValueError, RecursionError) as exc:
            raise FormatError(f"invalid JSON: {exc}", path=js.name, field="json") from None
        if isinstance(doc, dict):
            meta = {"config": doc.get("config", {})}
            st = doc.get("optim_state")
            if isinstance(st, dict):
                meta["optim_state_keys"] = sorted(st)
                if "t" in st:
                    meta["t"] = st["t"]
    return Info("netcl-checkpoint", info.entries, meta)


CHECKPOINT = register(
    Format(
        name="netcl-checkpoint",
        description="netcl training checkpoint: <p>.npz parameters + <p>.json optim_state/config",
        suffixes=(),
        layout="files",
        encode=_encode_checkpoint,
        decode=_decode_checkpoint,
        inspect=_inspect_checkpoint,
        sniff=_sniff_checkpoint,
        restore=_restore_checkpoint,
        locate=_locate_checkpoint,
        stores_meta=False,
        load_options=frozenset({"verify_crc", "names", "layers"}),
    )
)

PARAMS = register(
    Format(
        name="netcl-params",
        description="netcl raw parameter .npz (save_params/load_params)",
        suffixes=(),
        layout="files",
        encode=_encode_params,
        decode=_decode_params,
        inspect=_inspect_params,
        sniff=_sniff_params,
        restore=_restore_params,
        locate=_locate_params,
        stores_meta=False,
        sniff_priority=-1,  # any plain npz: after netcl-checkpoint, which needs its JSON sidecar
        load_options=frozenset({"verify_crc", "names", "config"}),
    )
)
