"""The common model form that conversion between model formats runs through.

A `Model` is an ordered list of `Layer` values plus an optional
optimizer state (`pytreeio.model.optim.OptState`) aligned with its
parameters.  Every format that holds a layered model provides two pure
functions on its record, ``to_model(native, meta) -> Model`` and
``from_model(model) -> (native, meta)``; its naming convention and transposes
live there, written once.  Flax trees map onto a Model here, once, for every
format.

The layer vocabulary is `LAYERS` (each type's arguments with their
defaults, and its arrays).  Arrays are **in Flax orientation**: Linear
``kernel`` (in, out); Conv2d ``kernel`` HWIO (k, k, in/groups, out); biases
and BatchNorm2d's ``scale``, ``bias`` and statistics ``mean``, ``var`` (n,).

**Parameter order** (the order of ``model.params`` and of every optimizer
slot list): layer order, then the type's `LayerSpec.params` order
(kernel, bias; scale, bias).  BatchNorm statistics are not parameters.

**Flax trees** (``Model.from_flax`` / ``Model.to_flax``): a params tree or a
variables dict ``{'params': ..., 'batch_stats': ...}`` whose modules are
named ``Dense_N``/``Conv_N``/``BatchNorm_N`` (the N-th module of that kind,
so the layer list is needed to place parameter-free layers, unless all
modules are of one kind) or ``layers_N`` (``nn.Sequential``: N is the layer
position, activations included).

**Model-shaped trees** (what ``save`` accepts and ``load(like=...)`` fills for
every model format): a Flax params/variables tree; ``{'params': ...,
'opt_state': ...}`` (``'optim_state'`` is accepted as netcl's name, and a
``'step'`` entry is kept); a ``flax.training.train_state.TrainState``; each
possibly made of ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pytreeio.core.errors import ConversionError, MismatchError, PytreeioWarning
from pytreeio.core.tree import allows_extra, describe_leaf, restore
from pytreeio.model import optim

__all__ = [
    "LAYERS",
    "LayerSpec",
    "Layer",
    "Model",
    "REQUIRED",
    "layer_list",
    "entry_parts",
    "refuse",
    "normalize_layers",
    "is_flax_tree",
    "is_model_like",
    "model_of",
    "restore_model",
    "flax_names",
    "flax_variables",
    "lost_extras",
    "training_state",
    "refuse_or_warn",
]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: Marks an argument without a default.
REQUIRED: Any = _Required()


@dataclass(frozen=True)
class LayerSpec:
    """A layer type of the common vocabulary.

    Attributes:
      args: ``(name, default)`` in canonical order (`REQUIRED` for none).
      params: trainable arrays (Flax names) in parameter order.
      stats: non-trainable arrays (BatchNorm running statistics).
      flax: the Flax module base name (``Dense``), None for parameter-free layers.
    """

    args: tuple[tuple[str, Any], ...] = ()
    params: tuple[str, ...] = ()
    stats: tuple[str, ...] = ()
    flax: str | None = None

    @property
    def arrays(self) -> tuple[str, ...]:
        return self.params + self.stats

    @property
    def arg_set(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.args)

    @property
    def required(self) -> tuple[str, ...]:
        """The args without a default."""
        return tuple(k for k, d in self.args if d is REQUIRED)


LAYERS: dict[str, LayerSpec] = {
    "Linear": LayerSpec(
        (("in_features", REQUIRED), ("out_features", REQUIRED), ("bias", True)),
        ("kernel", "bias"),
        flax="Dense",
    ),
    "Conv2d": LayerSpec(
        (
            ("in_channels", REQUIRED),
            ("out_channels", REQUIRED),
            ("kernel_size", REQUIRED),
            ("stride", 1),
            ("pad", 0),
            ("bias", True),
            ("dilation", 1),
            ("groups", 1),
        ),
        ("kernel", "bias"),
        flax="Conv",
    ),
    "BatchNorm2d": LayerSpec(
        (("num_features", REQUIRED), ("momentum", 0.1), ("eps", 1e-5)),
        ("scale", "bias"),
        ("mean", "var"),
        flax="BatchNorm",
    ),
    "ReLU": LayerSpec(),
    "LeakyReLU": LayerSpec((("negative_slope", 0.01),)),
    "Sigmoid": LayerSpec(),
    "Tanh": LayerSpec(),
    "Softmax": LayerSpec(),
    "Flatten": LayerSpec(),
    "Dropout": LayerSpec((("p", 0.5), ("seed", None))),
    "MaxPool2d": LayerSpec((("kernel_size", 2), ("stride", 2))),
}

_FLAX_KIND = {spec.flax: name for name, spec in LAYERS.items() if spec.flax}
_FLAX_NAME = re.compile(r"\A(Dense|Conv|BatchNorm|layers)_(0|[1-9][0-9]{0,5})\Z")
#: Arguments that must be positive integers.
_POSITIVE_ARGS = frozenset(
    {"in_features", "out_features", "in_channels", "out_channels", "kernel_size"}
    | {"num_features", "groups", "stride", "dilation"}
)
#: Keys of a layer entry that describe it but are not arguments.
_ENTRY_NOTES = frozenset({"name", "trainable"})
#: Every key a ``{"type": T, "args": {...}}`` entry may have.
_ARGS_ENTRY_KEYS = _ENTRY_NOTES | {"type", "args"}


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(map(int, a.shape))


# --- layers ---


@dataclass(frozen=True)
class Layer:
    """One layer: its type, full arguments, arrays in Flax orientation, and whether it trains."""

    type: str
    args: Mapping[str, Any] = field(default_factory=dict)
    arrays: Mapping[str, Any] = field(default_factory=dict)
    trainable: bool = True

    @property
    def spec(self) -> LayerSpec:
        return LAYERS[self.type]

    @property
    def params(self) -> list[tuple[str, Any]]:
        """``(name, array)`` of the trainable arrays present, in parameter order."""
        return [(k, self.arrays[k]) for k in self.spec.params if k in self.arrays]

    def config(self) -> dict[str, Any]:
        """``{"type": T, "args": {...}}``, the layer's JSON-ready description."""
        return {"type": self.type, "args": dict(self.args)}


def _inferred_args(
    ltype: str, arrays: Mapping[str, Any], given: Mapping[str, Any]
) -> dict[str, Any]:
    """The args of a parameter layer that its (Flax-orientation) arrays determine."""
    if ltype == "Linear" and "kernel" in arrays:
        w = _shape(arrays["kernel"])
        if len(w) == 2:
            return {"in_features": w[0], "out_features": w[1], "bias": "bias" in arrays}
    if ltype == "Conv2d" and "kernel" in arrays:
        w = _shape(arrays["kernel"])
        if len(w) == 4:
            groups = given.get("groups", 1)
            groups = groups if type(groups) is int and groups > 0 else 1
            return {
                "in_channels": w[2] * groups,
                "out_channels": w[3],
                "kernel_size": w[0],
                "bias": "bias" in arrays,
            }
    if ltype == "BatchNorm2d":
        for k in ("scale", "bias", "mean", "var"):
            if k in arrays and len(_shape(arrays[k])) == 1:
                return {"num_features": _shape(arrays[k])[0]}
    return {}


def _guess_type(arrays: Mapping[str, Any]) -> str | None:
    keys = set(arrays)
    if keys and keys <= {"scale", "bias", "mean", "var"}:
        return "BatchNorm2d" if keys & {"scale", "mean", "var"} else None
    if "kernel" in keys and keys <= {"kernel", "bias"}:
        return {2: "Linear", 4: "Conv2d"}.get(len(_shape(arrays["kernel"])))
    return None


def layer_problems(ltype: str, args: Mapping[str, Any], arrays: Mapping[str, Any]) -> list[str]:
    """What is inconsistent between a layer's args and its arrays (empty when fine)."""
    spec = LAYERS[ltype]
    full = {k: args.get(k, d) for k, d in spec.args}
    out = [f"unexpected array {k!r} for a {ltype} layer" for k in arrays if k not in spec.arrays]
    if "bias" in full and spec.flax in ("Dense", "Conv"):
        if full["bias"] is not True and full["bias"] is not False:
            out.append(f"bias must be true or false, found {full['bias']!r}")
        if full["bias"] is False and "bias" in arrays:
            out.append(f"{ltype} has bias=false but the arrays include 'bias'")
    for k, v in full.items():
        if v is REQUIRED:
            out.append(f"{ltype} needs {k!r}")
        elif k in _POSITIVE_ARGS and (type(v) is not int or v < 1 or v > 1 << 40):
            out.append(f"{k} must be a positive integer, found {v!r}")
    if out:
        return out
    want: dict[str, tuple[int, ...]] = {}
    if ltype == "Linear":
        n_in, n_out = full["in_features"], full["out_features"]
        want = {"kernel": (n_in, n_out), "bias": (n_out,)}
    elif ltype == "Conv2d":
        g, k = full["groups"], full["kernel_size"]
        n_in, n_out = full["in_channels"], full["out_channels"]
        if n_in % g or n_out % g:
            out.append(f"groups={g} must divide in_channels and out_channels")
        want = {"kernel": (k, k, n_in // g, n_out), "bias": (n_out,)}
    elif ltype == "BatchNorm2d":
        want = {k: (full["num_features"],) for k in spec.arrays}
    for k, shape in want.items():
        if k in arrays and _shape(arrays[k]) != shape:
            out.append(f"{k} has shape {_shape(arrays[k])}, the layer's args say {shape}")
    return out


def entry_parts(entry: Any, index: int) -> tuple[str, dict[str, Any], bool]:
    """``(type, given args, trainable)`` of one layer-list entry in any accepted spelling."""
    if isinstance(entry, Layer):
        return entry.type, dict(entry.args), entry.trainable
    where = f"layers[{index}]"
    if isinstance(entry, str):
        entry = {"type": entry}
    if not isinstance(entry, Mapping):
        raise MismatchError(
            "a layer entry must be a type name or a dict",
            key_path=where,
            found=type(entry).__name__,
        )
    if "type" not in entry:
        raise MismatchError(
            "a layer entry needs a 'type'", key_path=where, found=sorted(map(str, entry))
        )
    ltype, trainable = entry["type"], entry.get("trainable", True)
    if "args" in entry:
        args = entry["args"] if entry["args"] is not None else {}
        if not entry.keys() <= _ARGS_ENTRY_KEYS or not isinstance(args, Mapping):
            raise MismatchError(
                "a layer entry is {'type': T, 'args': {...}} or {'type': T, <args>}",
                key_path=where,
                found=sorted(map(str, entry)),
            )
    else:
        args = {k: v for k, v in entry.items() if k != "type" and k not in _ENTRY_NOTES}
    if type(trainable) is not bool:
        raise MismatchError("trainable must be true or false", key_path=f"{where}.trainable")
    if not isinstance(ltype, str) or ltype not in LAYERS:
        raise MismatchError(
            f"unknown layer type {ltype!r}; known: {sorted(LAYERS)}",
            key_path=f"{where}.type",
        )
    unknown = [k for k in args if k not in LAYERS[ltype].arg_set]
    if unknown:
        raise MismatchError(
            f"unknown args {sorted(map(str, unknown))} for {ltype}",
            key_path=f"{where}.args",
            expected=[k for k, _ in LAYERS[ltype].args],
        )
    return ltype, dict(args), trainable


def layer_list(value: Any) -> list[Any] | None:
    """The layer list a caller's ``layers=``/``meta`` holds: a list, or a mapping's ``layers``/``config`` list."""
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, Mapping):
        for key in ("layers", "config"):
            if isinstance(value.get(key), list | tuple):
                return list(value[key])
        return None
    raise MismatchError("layers must be a list of layer entries", found=type(value).__name__)


def normalize_layers(
    entries: Sequence[Any] | None, arrays: Sequence[Mapping[str, Any]]
) -> list[Layer]:
    """Full `Layer` values for per-layer arrays (Flax orientation) and optional entries.

    Entries may be partial (``"ReLU"``, ``{"type": "Linear"}``): args of
    parameter layers are inferred from the arrays, others get defaults.
    Without entries, parameter layers are recognised from their arrays; a
    layer without arrays cannot be, and is an error naming its index.
    """
    if entries is not None and len(entries) != len(arrays):
        raise MismatchError(
            f"the layer list has {len(entries)} entries but the tree has {len(arrays)} layers",
            key_path="layers",
            expected=len(arrays),
            found=len(entries),
        )
    out = []
    for i, arrs in enumerate(arrays):
        if entries is not None:
            ltype, given, trainable = entry_parts(entries[i], i)
        else:
            guessed = _guess_type(arrs)
            if guessed is None:
                what = "has no parameters" if not arrs else f"has arrays {sorted(arrs)}"
                raise MismatchError(
                    f"layer {i} {what}, so its type cannot be inferred; pass layers=[...] "
                    "with an entry for every layer",
                    key_path=f"layers[{i}]",
                )
            ltype, given, trainable = guessed, {}, True
        inferred = _inferred_args(ltype, arrs, given)
        args = {k: given[k] if k in given else inferred.get(k, d) for k, d in LAYERS[ltype].args}
        problems = layer_problems(ltype, args, arrs)
        if problems:
            raise MismatchError(
                f"layer {i} ({ltype}): {'; '.join(problems)}", key_path=f"layers[{i}]"
            )
        ordered = {k: arrs[k] for k in LAYERS[ltype].arrays if k in arrs}
        out.append(Layer(ltype, args, ordered, trainable))
    return out


# --- the Model ---


@dataclass(frozen=True)
class Model:
    """A layered model in the common form.

    Attributes:
      layers: the layers in network order.
      opt_state: the optimizer state aligned with `params`, if any.
      step: a training step counter kept beside the parameters (TrainState.step).
      extras: what a format's file holds beyond the common form, by format name
        (``{"datacode": {"training": {...}}}``): only the format's own
        ``from_model`` writes it back; converting it elsewhere (except into a
        generic format keeping the native tree) needs ``lossy``.
      origin: the format the model was read from (set when converting), None
        for a caller's Flax tree: a format whose save of Flax trees is lossy by
        default (cl-waffe2 writes no optimizer entries unless asked) keeps
        everything of a converted model.
    """

    layers: tuple[Layer, ...]
    opt_state: Any = None  # pytreeio.model.optim.OptState
    step: int | None = None
    extras: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    origin: str | None = None

    @property
    def params(self) -> list[tuple[int, str, Any]]:
        """``(layer index, array name, array)`` of every trainable array, in parameter order."""
        return [(i, k, a) for i, layer in enumerate(self.layers) for k, a in layer.params]

    def config(self) -> list[dict[str, Any]]:
        """The layer list as ``[{"type": T, "args": {...}}, ...]``."""
        return [layer.config() for layer in self.layers]

    def replace(self, **changes: Any) -> Model:
        return replace(self, **changes)

    @classmethod
    def from_flax(cls, variables: Any, layers: Any = None) -> Model:
        """A Model from a Flax params tree or variables dict (``Dense_N``/``Conv_N``/``BatchNorm_N``/``layers_N``)."""
        params, stats, _ = _split_flax_or_raise(variables)
        entries = layer_list(layers)
        index = _flax_index(list(params), entries, exact=True)
        n = len(entries) if entries is not None else max(index.values()) + 1
        per_layer: list[dict[str, Any]] = [{} for _ in range(n)]
        for name, module in params.items():
            i = index[name]
            if i >= n:
                raise MismatchError(
                    f"{name} is past the {n} layers of the layer list", key_path=f"params/{name}"
                )
            kind = _module_kind(name, module, stats)
            spec = LAYERS[kind]
            _check_leaf_names(name, module, spec.params, "params")
            _check_arrays(module, f"params/{name}")
            per_layer[i] = dict(module)
            if spec.stats:
                st = stats.get(name)
                if st is not None:
                    _check_leaf_names(name, st, spec.stats, "batch_stats")
                    _check_arrays(st, f"batch_stats/{name}")
                    per_layer[i].update(st)
        extra = sorted(set(stats) - set(params))
        if extra:
            raise MismatchError(
                f"batch_stats for modules without params: {extra}", key_path="batch_stats"
            )
        return cls(tuple(normalize_layers(entries, per_layer)))

    @classmethod
    def from_params(cls, arrays: Sequence[Any], layers: Any = None) -> Model:
        """A Model from its trainable arrays alone, in parameter order and Flax orientation.

        For formats that store only the parameters (netcl's ``p0, p1, ...``).
        Without ``layers``, a 2-D kernel (and a following bias of its out
        size) reads as a Linear, a 4-D HWIO kernel (and bias) as a Conv2d, and
        two equal 1-D arrays as a BatchNorm2d; anything else needs ``layers``.
        """
        entries = layer_list(layers)
        if entries is None:
            return cls(tuple(normalize_layers(None, _inferred_layers(arrays))))
        per_layer = []
        pos = 0
        for i, entry in enumerate(entries):
            ltype, args, _ = entry_parts(entry, i)
            names = [
                k for k in LAYERS[ltype].params if not (k == "bias" and args.get("bias") is False)
            ]
            if pos + len(names) > len(arrays):
                raise MismatchError(
                    f"the layers take more than the {len(arrays)} parameters given",
                    key_path=f"layers[{i}]",
                )
            per_layer.append(dict(zip(names, arrays[pos : pos + len(names)])))
            pos += len(names)
        if pos != len(arrays):
            raise MismatchError(
                f"{len(arrays)} parameters, but the layers take {pos}", key_path="layers"
            )
        return cls(tuple(normalize_layers(entries, per_layer)))

    def to_flax(self, like: Any) -> Any:
        """This model's arrays in the structure of ``like`` (a Flax params tree or variables dict)."""
        params_like, stats_like, variables = _split_flax_or_raise(like)
        index = _flax_index(list(params_like), [layer.type for layer in self.layers])

        def take(i: int, key: str, path: tuple[str, ...], like_leaf: Any) -> Any:
            layer = self.layers[i] if i < len(self.layers) else None
            if layer is None or key not in layer.arrays:
                raise MismatchError(
                    f"layer {i} ({layer.type if layer else 'absent'}) has no {key!r} array",
                    key_path="/".join(path),
                    expected=describe_leaf(like_leaf),
                    found="nothing",
                )
            return restore(layer.arrays[key], like_leaf, path=path)

        out_params: dict[str, Any] = {}
        out_stats: dict[str, Any] = {}
        for name, module in params_like.items():
            i = index[name]
            kind = _module_kind(name, module, stats_like)
            if i < len(self.layers) and self.layers[i].type != kind:
                raise MismatchError(
                    f"{name} is a {kind} but layer {i} of the file is a {self.layers[i].type}",
                    key_path=f"params/{name}",
                )
            spec = LAYERS[kind]
            _check_leaf_names(name, module, spec.params, "params")
            out_params[name] = {k: take(i, k, ("params", name, k), v) for k, v in module.items()}
            if name in stats_like:
                st = stats_like[name]
                _check_leaf_names(name, st, spec.stats, "batch_stats")
                out_stats[name] = {
                    k: take(i, k, ("batch_stats", name, k), v) for k, v in st.items()
                }
        self._refuse_untaken(out_params, out_stats, index)
        if variables:
            result: dict[str, Any] = {"params": out_params}
            if isinstance(like, Mapping) and "batch_stats" in like:
                result["batch_stats"] = out_stats
            return result
        return out_params

    def _refuse_untaken(
        self, params: Mapping[str, Any], stats: Mapping[str, Any], index: Mapping[str, int]
    ) -> None:
        """Refuse arrays of the file that ``to_flax`` took no place for, unless a partial load."""
        used = {(index[name], k) for part in (params, stats) for name, m in part.items() for k in m}
        left = sorted(
            f"layers[{i}].{k}"
            for i, layer in enumerate(self.layers)
            for k in layer.arrays
            if (i, k) not in used
        )
        if left and not allows_extra():  # a partial load leaves them in the file
            hint = (
                " (pass the variables dict with 'batch_stats')"
                if any(s.endswith((".mean", ".var")) for s in left)
                else ""
            )
            raise MismatchError(
                f"the file has arrays that `like` lacks: {left[:10]}{hint}", key_path=""
            )

    def param_paths(self, params_like: Any) -> list[tuple[str, ...]]:
        """Key paths (into ``params_like``'s params tree) of `params`, in parameter order."""
        params = _split_flax_or_raise(params_like)[0]
        index = _flax_index(list(params), [layer.type for layer in self.layers])
        by_layer = {i: name for name, i in index.items()}
        out: list[tuple[str, ...]] = []
        for i, k, _ in self.params:
            name = by_layer.get(i)
            if name is None or k not in params[name]:
                raise MismatchError(
                    f"`like` has no place for parameter {k!r} of layer {i} ({self.layers[i].type})",
                    key_path=f"params/{name or f'<layer {i}>'}/{k}",
                )
            out.append((name, k))
        return out


def _inferred_layers(arrays: Sequence[Any]) -> list[dict[str, Any]]:
    """A parameter list's arrays grouped into layers by their shapes (see `Model.from_params`)."""
    per_layer: list[dict[str, Any]] = []
    i = 0
    while i < len(arrays):
        shape = _shape(arrays[i])
        nxt = _shape(arrays[i + 1]) if i + 1 < len(arrays) else None
        if len(shape) in (2, 4):
            names: tuple[str, ...] = ("kernel", "bias") if nxt == (shape[-1],) else ("kernel",)
        elif len(shape) == 1 and nxt == shape:
            names = ("scale", "bias")
        else:
            raise MismatchError(
                f"parameter {i} {shape} does not start a Linear, Conv2d or BatchNorm2d layer; "
                "pass layers=[...]",
                key_path=f"[{i}]",
            )
        per_layer.append(dict(zip(names, arrays[i : i + len(names)])))
        i += len(names)
    return per_layer


# --- Flax naming ---


def _flax_name(name: Any) -> tuple[str, int] | None:
    """``(base, index)`` of a Flax module name (``Dense_3`` -> ``("Dense", 3)``), else None."""
    if type(name) is not str:
        return None
    m = _FLAX_NAME.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def _split_flax(tree: Any) -> tuple[Mapping[str, Any], Mapping[str, Any], bool] | None:
    """``(params, batch_stats, is_variables_dict)`` of a Flax tree, or None if it is not one."""
    if not isinstance(tree, Mapping) or not tree:
        return None
    if "params" in tree and isinstance(tree["params"], Mapping):
        if set(tree) - {"params", "batch_stats"}:
            return None
        params = tree["params"]
        stats = tree.get("batch_stats") or {}
        if not isinstance(stats, Mapping):
            return None
        variables = True
    else:
        params, stats, variables = tree, {}, False
    if not params:
        return None
    if all(_flax_name(k) is not None and isinstance(m, Mapping) for k, m in params.items()):
        return params, stats, variables
    return None


def _split_flax_or_raise(tree: Any) -> tuple[Mapping[str, Any], Mapping[str, Any], bool]:
    split = _split_flax(tree)
    if split is None:
        raise MismatchError(
            "not a Flax params tree: modules must be named Dense_N, Conv_N, BatchNorm_N or layers_N",
            key_path="params",
            found=type(tree).__name__,
        )
    return split


def is_flax_tree(tree: Any) -> bool:
    """True for a Flax params tree or variables dict of ``Dense_N``/``Conv_N``/``BatchNorm_N``/``layers_N`` modules."""
    return _split_flax(tree) is not None


def _flax_index(
    names: Sequence[str], entries: Sequence[Any] | None, *, exact: bool = False
) -> dict[str, int]:
    """The layer index of every Flax module name; ``exact``: every layer of a kind has its module."""
    parsed = {n: _flax_name(n) for n in names}
    bases = {m[0] for m in parsed.values() if m}
    if "layers" in bases:
        if bases != {"layers"}:
            raise MismatchError(
                "mixing layers_N with Dense_N/Conv_N/BatchNorm_N names", key_path="params"
            )
        return {n: m[1] for n, m in parsed.items() if m}
    if entries is None:
        if len(bases) == 1:
            return {n: m[1] for n, m in parsed.items() if m}
        raise MismatchError(
            "a Flax tree with several module kinds (Dense_N, Conv_N, ...) needs the layer order: "
            "pass layers=[...] listing every layer (activations too)",
            key_path="layers",
        )
    types = [e if isinstance(e, str) else entry_parts(e, i)[0] for i, e in enumerate(entries)]
    out: dict[str, int] = {}
    for base, ltype in _FLAX_KIND.items():
        positions = [i for i, t in enumerate(types) if t == ltype]
        have = sorted(m[1] for m in parsed.values() if m and m[0] == base)
        if any(k >= len(positions) for k in have) or (
            exact and have != list(range(len(positions)))
        ):
            raise MismatchError(
                f"the model has {len(positions)} {ltype} layers but the tree has {base} modules "
                f"{[f'{base}_{k}' for k in have]}",
                key_path="params",
                expected=[f"{base}_{k}" for k in range(len(positions))],
            )
        for k in have:
            out[f"{base}_{k}"] = positions[k]
    return out


def _module_kind(name: str, module: Any, stats: Mapping[str, Any]) -> str:
    m = _flax_name(name)
    assert m is not None
    if m[0] != "layers":
        return _FLAX_KIND[m[0]]
    if "scale" in module or name in stats:
        return "BatchNorm2d"
    kernel: Any = module.get("kernel")
    nd = len(kernel.shape) if hasattr(kernel, "shape") else 0
    if nd in (2, 4):
        return "Linear" if nd == 2 else "Conv2d"
    raise MismatchError(
        f"cannot tell what layer {name} is",
        key_path=f"params/{name}",
        found=sorted(map(str, module)),
    )


def _check_arrays(module: Mapping[str, Any], where: str) -> None:
    """Every leaf of a module is an array (numpy, jax, or anything with a shape and dtype)."""
    for k, v in module.items():
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise MismatchError(
                "a model's parameters must be arrays",
                key_path=f"{where}/{k}",
                found=type(v).__name__,
            )


def _check_leaf_names(name: str, got: Any, allowed: Sequence[str], where: str) -> None:
    if not isinstance(got, Mapping):
        raise MismatchError(
            f"{name} must be a dict of arrays", key_path=f"{where}/{name}", found=type(got).__name__
        )
    extra = sorted(str(k) for k in set(got) - set(allowed))
    if extra:
        raise MismatchError(
            f"{name} has entries the common model form has no place for: {extra}",
            key_path=f"{where}/{name}",
        )


# --- model-shaped trees: params, {'params', 'opt_state'}, TrainState ---

_STATE_KEYS = ("opt_state", "optim_state")


@dataclass(frozen=True)
class _Parts:
    """A model-shaped tree taken apart (``shape``: see `model_like_shape`)."""

    shape: str
    params: Any
    opt_state: Any = None
    step: Any = None
    state_key: str | None = None


def _is_train_state(tree: Any) -> bool:
    return not isinstance(tree, Mapping) and all(
        hasattr(tree, a) for a in ("params", "opt_state", "step", "replace")
    )


def _parts(tree: Any) -> _Parts | None:
    if _is_train_state(tree):
        if not is_flax_tree(tree.params):
            return None
        return _Parts("train_state", tree.params, tree.opt_state, tree.step, "opt_state")
    if not isinstance(tree, Mapping):
        return None
    if is_flax_tree(tree):
        return _Parts("flax", tree)
    if "params" not in tree or not is_flax_tree(tree["params"]):
        return None
    rest = set(tree) - {"params", "step"}
    state_keys = [k for k in _STATE_KEYS if k in rest]
    if rest - set(state_keys) or len(state_keys) > 1:
        return None
    key = state_keys[0] if state_keys else None
    return _Parts("state", tree["params"], tree[key] if key else None, tree.get("step"), key)


def is_model_like(tree: Any) -> bool:
    """True for the model-shaped trees that every model format saves from and restores into."""
    return _parts(tree) is not None


def model_like_shape(tree: Any) -> str | None:
    """What model-shaped tree ``tree`` is: ``"flax"`` (a params tree or variables dict),
    ``"state"`` (``{'params', 'opt_state', 'step'}``), ``"train_state"``; None: not one."""
    parts = _parts(tree)
    return None if parts is None else parts.shape


def _slot_views(params: Any, model: Model) -> list[tuple[Any, list[tuple[str, ...]]]]:
    """``(tree, parameter paths)`` the optimizer may have been initialised on, likeliest first:
    a variables dict's ``params`` (usual), or the whole dict (slots then start with ``params``)."""
    if isinstance(params, Mapping) and "params" in params and isinstance(params["params"], Mapping):
        inner = params["params"]
        paths = model.param_paths(inner)
        return [(inner, paths), (params, [("params", *p) for p in paths])]
    return [(params, model.param_paths(params))]


def _on_slot_view(params: Any, model: Model, fn: Any) -> Any:
    """``fn(tree, order)`` on the first view of ``params`` the optimizer state fits."""
    first: MismatchError | None = None
    for tree, order in _slot_views(params, model):
        try:
            return fn(tree, order)
        except MismatchError as exc:
            first = first or exc
    assert first is not None
    raise first


def model_of(
    tree: Any, *, layers: Any = None, hyperparams: Mapping[str, Any] | None = None
) -> Model:
    """The `Model` of a model-shaped tree (its optimizer state and step included)."""
    parts = _parts(tree)
    if parts is None:
        raise MismatchError(
            "not a model-shaped tree: expected a Flax params tree, {'params': ..., 'opt_state': ...} "
            "or a TrainState",
            key_path="",
            found=type(tree).__name__,
        )
    model = Model.from_flax(parts.params, layers)
    if parts.opt_state is not None:
        state = _on_slot_view(
            parts.params,
            model,
            lambda tree, order: optim.extract(
                parts.opt_state, tree, order=order, hyperparams=hyperparams
            ),
        )
        model = model.replace(opt_state=state)
    if parts.step is not None:
        model = model.replace(step=_as_int(parts.step, "step"))
    return model


def _as_int(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    arr = np.asarray(value)
    if arr.shape != () or arr.dtype.kind not in "iu":
        raise MismatchError("must be an integer scalar", key_path=where, found=describe_leaf(arr))
    return int(arr)


def restore_model(model: Model, like: Any) -> Any:
    """``model`` in the structure of the model-shaped ``like`` (leaves checked, ``like`` untouched)."""
    parts = _parts(like)
    if parts is None:
        raise MismatchError(
            "like must be a Flax params tree, {'params': ..., 'opt_state': ...} or a TrainState",
            key_path="",
            found=type(like).__name__,
        )
    params = model.to_flax(parts.params)
    if parts.shape == "flax":
        return params
    state = None
    if parts.opt_state is not None:
        if model.opt_state is None:
            raise MismatchError(
                "the file holds no optimizer state",
                key_path=parts.state_key,
                expected="an optimizer state",
                found="nothing",
            )
        opt = model.opt_state
        state = _on_slot_view(
            parts.params,
            model,
            lambda tree, order: optim.rebuild(opt, parts.opt_state, tree, order=order),
        )
    step = None
    if parts.step is not None:
        value = model.step
        if value is None and model.opt_state is not None:
            value = model.opt_state.count
        if value is None:
            raise MismatchError("the file holds no step count", key_path="step", found="nothing")
        step = restore(_step_value(value, parts.step), parts.step, path=("step",))
    if parts.shape == "train_state":
        return like.replace(params=params, opt_state=state, step=step)
    out: dict[str, Any] = {"params": params}
    if parts.state_key is not None:
        out[parts.state_key] = state
    if "step" in like:
        out["step"] = step
    return out


def _step_value(value: int, like: Any) -> Any:
    if isinstance(like, int) and not isinstance(like, bool):
        return value
    return np.asarray(value, dtype=np.dtype(getattr(like, "dtype", np.int32)))


# --- a Model as a plain Flax tree (what conversion writes where no layer list fits) ---


def flax_names(model: Model) -> list[str | None]:
    """The Flax module name of every layer (None for a layer without arrays).

    ``Dense_N``/``Conv_N``/``BatchNorm_N`` when all layers have arrays and are
    of one kind (read back without a layer list), else ``nn.Sequential``'s
    ``layers_N`` with N the layer's position (``layers=[...]`` supplies the
    layers between them on the way back).
    """
    kinds = {layer.spec.flax for layer in model.layers}
    if None not in kinds and len(kinds) == 1:
        counts: dict[str, int] = {}
        out: list[str | None] = []
        for layer in model.layers:
            base = layer.spec.flax
            assert base is not None
            out.append(f"{base}_{counts.get(base, 0)}")
            counts[base] = counts.get(base, 0) + 1
        return out
    return [f"layers_{i}" if layer.spec.flax else None for i, layer in enumerate(model.layers)]


def flax_variables(model: Model) -> dict[str, Any]:
    """``{'params': {...}}`` (+ ``'batch_stats'``) of the model's arrays, named by `flax_names`.

    The inverse of `Model.from_flax` (given the layer list when the
    names are ``layers_N`` with gaps).  Arrays are the model's own, not copies.
    """
    params: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    for name, layer in zip(flax_names(model), model.layers):
        if name is None:
            continue
        params[name] = {k: a for k, a in layer.arrays.items() if k in layer.spec.params}
        held = {k: a for k, a in layer.arrays.items() if k in layer.spec.stats}
        if held:
            stats[name] = held
    out: dict[str, Any] = {"params": params}
    if stats:
        out["batch_stats"] = stats
    return out


def lost_extras(model: Model, target: str) -> list[str]:
    """The `Model.extras` that a ``target`` format other than their own cannot hold."""
    return [f"{fmt} {key}" for fmt, items in model.extras.items() if fmt != target for key in items]


def training_state(model: Model) -> list[str]:
    """The optimizer state and step counter of ``model``, described for a format that holds neither.

    A step equal to the optimizer's count is part of the optimizer state.
    """
    out = []
    opt = model.opt_state
    if opt is not None:
        out.append(f"optimizer state ({opt.kind})")
    if model.step is not None and (opt is None or opt.count != model.step):
        out.append(f"step counter ({model.step})")
    return out


def refuse_or_warn(problems: Sequence[str], target: str, lossy: bool, *, hint: str = "") -> None:
    """Raise `ConversionError` listing ``problems``, or with ``lossy`` warn that they are dropped.

    ``hint`` is appended to the error's reason (where the information would fit).
    """
    if not problems:
        return
    if not lossy:
        raise ConversionError(
            f"format {target!r} cannot hold: {', '.join(problems)}{hint}; pass lossy=True to "
            "drop it",
            what=list(problems),
        )
    warnings.warn(f"{target}: dropping {', '.join(problems)}", PytreeioWarning, stacklevel=4)


def refuse(problems: Sequence[str], target: str) -> None:
    """Raise `ConversionError` listing what ``target`` cannot hold."""
    if problems:
        raise ConversionError(
            f"format {target!r} cannot hold: {', '.join(problems)}", what=list(problems)
        )
