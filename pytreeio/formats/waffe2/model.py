"""cl-waffe2 state dicts <-> the common model form (`pytreeio.model.form`).

Parameters are ``param:{composite}.{nth}.{slot}`` (`LayerNaming` per
layer type, option ``naming``), stored in cl-waffe2's orientation (LinearLayer
weights (out, in), Conv2D (out, in/groups, kh, kw)).  cl-waffe2 stores no
shapes: they come from the ``layers`` option (entries with their sizes),
pytreeio's sidecar or a model-shaped ``like``; else the arrays must have them
and the layers are read from the key order.  Adam's ``lr``/``eps``/``beta1``/
``beta2``/``n``/``m``/``v`` are optax's ``learning_rate``/``eps``/``b1``/``b2``/
count/``mu``/``nu``, SGD's ``lr`` its ``learning_rate``.  Saving: ``optimizers``
(cl-waffe2's default ``False`` for a Flax tree, ``True`` for a converted
model), ``hyperparams`` (what the optax state does not record).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from pytreeio.core.binary import Streamed
from pytreeio.core.errors import ConversionError, FormatError, MismatchError, PytreeioWarning
from pytreeio.core.transpose import copy_transposed, transpose
from pytreeio.core.tree import allows_extra, describe_leaf, is_array_leaf
from pytreeio.formats.waffe2.document import check_meta, insert, leaves
from pytreeio.formats.waffe2.keys import (
    OPTIMIZER_PREFIXES,
    PARAM_PREFIXES,
    assign_nth,
    make_key,
    parse_state_dict_key,
    type_of,
)
from pytreeio.formats.waffe2.restore import Outcome, report_name, settle
from pytreeio.model.form import (
    LAYERS,
    Layer,
    Model,
    entry_parts,
    is_flax_tree,
    is_model_like,
    layer_list,
    normalize_layers,
    refuse_or_warn,
)

#: Adam's slots in the order cl-waffe2 writes them (``find-params`` order).
ADAM_SLOTS = ("lr", "eps", "beta1", "beta2", "n", "m", "v")
_ADAM_HYPER = {"lr": "learning_rate", "eps": "eps", "beta1": "b1", "beta2": "b2"}
#: optax.adam's defaults, for an optax state that records no hyperparameters.
_OPTAX_ADAM_DEFAULTS = {"b1": 0.9, "b2": 0.999, "eps": 1e-8}


@dataclass(frozen=True)
class LayerNaming:
    """How one layer type of `pytreeio.model.form.LAYERS` is named in a cl-waffe2 state dict.

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
    if naming is not None and not isinstance(naming, Mapping):
        raise MismatchError(
            "naming must map layer types to LayerNaming", key_path="naming", found=naming
        )
    for ltype, nm in (naming or {}).items():
        try:
            if isinstance(nm, Mapping):
                nm = LayerNaming(nm["composite"], dict(nm["slots"]), dict(nm.get("axes") or {}))
            names = [nm.composite, *nm.slots.values()]
            ok = (
                bool(LAYERS[ltype].arrays)
                and all(n and n == n.lower() and not set(n) & set(".:/ \0") for n in names)
                and set(nm.slots) <= set(LAYERS[ltype].arrays)
                and len(set(nm.slots.values())) == len(nm.slots)
                and all(
                    k in nm.slots and sorted(a) == list(range(len(a))) for k, a in nm.axes.items()
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise MismatchError(
                "a LayerNaming for a layer type with arrays: a composite and distinct slot names "
                "(lower case, no '.', ':', '/') for its arrays, axes permuting a slot's axes",
                key_path=f"naming/{ltype}",
                found=nm,
            )
        out[ltype] = nm
    return out


def _flax_shapes(ltype: str, args: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The Flax-orientation shape of each array of a layer, as far as its args say."""
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
            return dict.fromkeys(LAYERS[ltype].arrays, (int(full["num_features"]),))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):  # groups=0: args say nothing
        pass
    return {}


def _to_stored(arr: Any, axes: Sequence[int] | None) -> Any:
    """A Flax-orientation array in cl-waffe2's orientation, on the host: a transposed view
    (copied into C order as its file is written), or for a jax array on an accelerator
    transposed there, then copied out."""
    from pytreeio.core import quant

    if isinstance(arr, Streamed):  # a conversion's: transposed when it is read
        return arr if axes is None or arr.ndim != len(axes) else arr.transpose(tuple(axes))
    if axes is None or np.ndim(arr) != len(axes):
        return np.asarray(arr)
    if isinstance(arr, np.ndarray) or quant.on_cpu():
        return np.asarray(arr).transpose(tuple(int(a) for a in axes))
    return transpose(arr, axes)


def c_order(arr: Any) -> Any:
    """A transposed view copied into C order; anything else as it is (a streamed one when read)."""
    if isinstance(arr, Streamed):
        return arr.c_order()
    if not isinstance(arr, np.ndarray) or arr.flags.c_contiguous:
        return arr
    out = np.empty(arr.shape, arr.dtype)
    copy_transposed(arr, out)
    return out


def _to_flax(
    arr: Any, stored_shape: tuple[int, ...] | None, axes: Sequence[int] | None, where: str
) -> Any:
    """A stored array (1-D, or already in its stored shape) in Flax orientation (a view)."""
    arr = arr if isinstance(arr, Streamed) else np.asarray(arr)
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
    inverse = tuple(int(i) for i in np.argsort(axes))
    if arr.dtype.isnative:
        # A view of the file's values: an encoder or jax.device_put copies it once, if at all.
        return arr.transpose(inverse)
    return transpose(arr, inverse)  # byte-swapped: a native-order copy


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
    return [_Slot(*r, n) for r, n in zip(raw, nths, strict=True)]


def _lookup(native: Mapping[str, Any], prefix: str, parts: Sequence[str]) -> Any:
    node: Any = native.get(prefix)
    for p in parts:
        if not isinstance(node, Mapping) or p not in node:
            return None
        node = node[p]
    return node


def _entries_given(layers: Any, like: Any, meta: Mapping[str, Any]) -> list[Any] | None:
    """The layer list from ``layers``, the sidecar, or a model-shaped ``like``.

    A ``like`` also completes a ``layers`` list that names types only (the
    activations from the list, the sizes from ``like``).
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
        return Model.from_flax(params, given).config()  # shapes: arrays or ShapeDtypeStructs
    return given


def _expected_arrays(ltype: str, args: Mapping[str, Any]) -> list[str]:
    """The trainable arrays a layer of these args has, in parameter order."""
    spec = LAYERS[ltype]
    no_bias = (
        ltype in ("Linear", "Conv2d") and args.get("bias", dict(spec.args).get("bias")) is False
    )
    return [k for k in spec.params if not (k == "bias" and no_bias)]


def _arrays_by_layers(
    native: Mapping[str, Any], entries: list[Any], namings: Mapping[str, LayerNaming], out: Outcome
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
        axes = namings[ltype].axes.get(s.array)
        want = _flax_shapes(ltype, args).get(s.array)
        if want is None and axes is not None and np.ndim(value) != len(axes):
            raise MismatchError(
                f"cl-waffe2 stores no shapes: layer {s.layer} ({ltype}) needs its sizes in "
                "layers=[...] (e.g. in_features/out_features), or load into a native-shaped like",
                key_path=s.key,
                found=f"{np.size(value)} elements",
            )
        stored = tuple(want[i] for i in axes) if want is not None and axes else want
        per_layer[s.layer][s.array] = _to_flax(value, stored, axes, s.key)
    return per_layer, plan


def _file_param_order(native: Mapping[str, Any], meta: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The file's parameters in parameter order: ``meta['keys']`` reversed, else nth-major."""
    have = [p for p, _ in leaves(native.get("param", {}), 3, "param")]
    keys = meta.get("keys")
    if isinstance(keys, list):
        try:
            order = [
                k.parts for k in map(parse_state_dict_key, reversed(keys)) if k.prefix == "param"
            ]
        except FormatError:
            order = []
        if sorted(order) == sorted(have) and len(set(order)) == len(order):
            return order
    composites = {c for c, _, _ in have}
    if len(composites) == 1 and len(set(Counter(s for _, _, s in have).values())) == 1:
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
    native: Mapping[str, Any], meta: Mapping[str, Any], namings: Mapping[str, LayerNaming]
) -> list[Any]:
    """The layer list read from the file's key order (a layer's first slot starts it): types,
    and whether a layer has a bias; the sizes come from the arrays (the sidecar's shapes)."""
    by_composite: dict[str, str] = {}
    for t, nm in namings.items():
        by_composite.setdefault(nm.composite, t)
    grouped: list[tuple[str, set[str]]] = []
    for parts in _file_param_order(native, meta):
        c, _, s = parts
        where = make_key("param", *parts)
        ltype = by_composite.get(c)
        if ltype is None:
            raise MismatchError(
                f"unknown composite {c!r}: pass naming={{layer type: LayerNaming({c!r}, ...)}}",
                key_path=where,
            )
        nm = namings[ltype]
        flax = {v: k for k, v in nm.slots.items()}.get(s)
        if flax is None:
            raise MismatchError(
                f"{c} has no slot {s!r} in the naming {dict(nm.slots)}", key_path=where
            )
        first = next(iter(nm.slots))
        if flax == first or not grouped or grouped[-1][0] != ltype or flax in grouped[-1][1]:
            if flax != first:
                raise MismatchError(
                    f"{s!r} does not follow a {nm.slots[first]!r} of its layer; pass layers=[...]",
                    key_path=where,
                )
            grouped.append((ltype, set()))
        grouped[-1][1].add(flax)
    return [
        {"type": t, "bias": "bias" in arrs} if t in ("Linear", "Conv2d") else t
        for t, arrs in grouped
    ]


def _extra_params(native: Mapping[str, Any], plan: list[_Slot], out: Outcome) -> None:
    used = {("param", *s.parts) for s in plan}
    for prefix in PARAM_PREFIXES:
        for parts, _ in leaves(native.get(prefix, {}), 3, prefix):
            if (prefix, *parts) not in used:
                out.extra.append(make_key(prefix, *parts))
    bases = {s.parts for s in plan}
    for prefix in OPTIMIZER_PREFIXES:
        for parts, value in leaves(native.get(prefix, {}), 5, prefix):
            if prefix == "missing_optimizer" or tuple(parts[:3]) not in bases:
                out.extra.append(report_name((prefix, *parts), value))


def _opt_state(
    native: Mapping[str, Any],
    plan: list[_Slot],
    layers: list[Layer],
    namings: Mapping[str, LayerNaming],
    count: int | None,
) -> Any:
    """The OptState of the optimizer entries of ``plan``'s parameters (None when there are none).

    ``count`` is the sidecar's step count of an SGD state (cl-waffe2 keeps none).
    """
    from pytreeio.model.optim import OptState

    found = [(_lookup(native, "optimizer", s.parts), s) for s in plan]
    lacking = [s.key for o, s in found if not o]
    if len(lacking) == len(plan):
        return None
    if lacking:
        warnings.warn(
            f"waffe2: optimizer entries only for some parameters (none for {lacking}); "
            "no optimizer state loaded",
            PytreeioWarning,
            stacklevel=3,
        )
        return None
    names = {name for o, _ in found for name in o}
    if len(names) != 1 or not all(len(o) == 1 for o, _ in found):
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
    moments: dict[str, list[Any]] = {"m": [], "v": []}
    for o, s in found:
        slots = o[kind]
        where = f"optimizer:{'.'.join(s.parts)}.{kind}"
        if set(slots) != set(wanted):
            raise MismatchError(
                f"{kind} entries of {s.key} are {sorted(slots)}",
                key_path=where,
                expected=list(wanted),
                found=sorted(slots),
            )
        for name in wanted:
            if name in moments:
                layer = layers[s.layer]
                axes = namings[layer.type].axes.get(s.array)
                shape = layer.arrays[s.array].shape
                stored = tuple(shape[i] for i in axes) if axes else tuple(shape)
                arr = slots[name]
                if not is_array_leaf(arr):
                    raise MismatchError(
                        "expected an array", key_path=f"{where}.{name}", found=describe_leaf(arr)
                    )
                moments[name].append(_to_flax(arr, stored, axes, f"{where}.{name}"))
            elif name in scalars and scalars[name] != slots[name]:
                raise MismatchError(
                    f"{kind} {name!r} differs between parameters ({scalars[name]!r} and "
                    f"{slots[name]!r}); an optax state holds one value",
                    key_path=f"{where}.{name}",
                )
            else:
                scalars[name] = slots[name]
    if kind == "sgd":  # cl-waffe2's SGD keeps no step count; pytreeio's sidecar may hold optax's
        return OptState("sgd", {"learning_rate": float(scalars["lr"])}, count, {})
    n = scalars["n"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise MismatchError("n must be a non-negative integer", key_path="optimizer n", found=n)
    hp = {_ADAM_HYPER[k]: float(scalars[k]) for k in ("lr", "eps", "beta1", "beta2")}
    hp["eps_root"] = 0.0  # cl-waffe2's Adam has none (optax's default)
    return OptState("adam", hp, n, {"mu": moments["m"], "nu": moments["v"]})


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
    """The common model form of a waffe2 native tree (see the module docstring).

    Missing parameters raise even with ``strict=False``: a model cannot hold a
    layer without its arrays (a native-shaped ``like`` keeps its values instead).
    """
    if not isinstance(native, Mapping):
        raise MismatchError("not a waffe2 native tree", key_path="", found=type(native).__name__)
    meta = meta or {}
    namings = _namings(naming)
    entries = _entries_given(layers, like, meta)
    if entries is None:
        entries = _layers_from_file(native, meta, namings)
    out = Outcome()
    per_layer, plan = _arrays_by_layers(native, entries, namings, out)
    if not allows_extra():  # a partial load leaves out what the layer list does not name
        _extra_params(native, plan, out)
    settle(out, strict or bool(out.missing), report, "the layer list")
    if like is None:
        # For another format's encoder, which writes memory order as is; a restore into
        # `like` keeps the transposed views.
        per_layer = [{k: c_order(v) for k, v in arrays.items()} for arrays in per_layer]
    model_layers = normalize_layers(entries, per_layer)
    count = meta.get("count")
    opt = _opt_state(native, plan, model_layers, namings, count if isinstance(count, int) else None)
    if opt is not None and like is None:
        opt = dataclasses.replace(
            opt, slots={k: [c_order(a) for a in v] for k, v in opt.slots.items()}
        )
    step = meta.get("step")
    return Model(tuple(model_layers), opt, step if isinstance(step, int) else None)


def _merged_hyperparams(opt: Any, given: Mapping[str, Any] | None) -> dict[str, Any]:
    if given is not None and not isinstance(given, Mapping):
        raise MismatchError("hyperparams must be a mapping", key_path="hyperparams", found=given)
    hp = dict(opt.hyperparams)
    for name, value in (given or {}).items():
        try:  # equal as cl-waffe2's single-floats (an injected value is already rounded)
            same = name not in hp or float(np.float32(hp[name])) == float(np.float32(value))
        except (TypeError, ValueError, OverflowError):
            same = hp[name] == value
        if not same:
            raise MismatchError(
                f"hyperparameter {name!r} given as {value!r}, the optimizer state holds "
                f"{hp[name]!r}",
                key_path=f"hyperparams/{name}",
                expected=hp[name],
                found=value,
            )
        hp.setdefault(name, value)
    return hp


def _optimizer_problems(opt: Any, hp: Mapping[str, Any]) -> list[str]:
    """What of an optimizer state cl-waffe2's Adam/SGD entries cannot hold.

    ``adamw`` holds Adam's data (``mu``, ``nu``, count): it is written as
    cl-waffe2's Adam unless a non-zero ``weight_decay`` is recorded.
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


def _opt_values(opt: Any, hp: Mapping[str, Any], j: int, axes: Any) -> dict[str, Any]:
    """Parameter ``j``'s optimizer entries in cl-waffe2's order (adamw: Adam's data)."""
    if opt.kind == "sgd":
        return {"lr": float(hp["learning_rate"])}
    full = {**_OPTAX_ADAM_DEFAULTS, **hp}
    return {
        "lr": float(full["learning_rate"]),
        "eps": float(full["eps"]),
        "beta1": float(full["b1"]),
        "beta2": float(full["b2"]),
        "n": int(opt.count),
        "m": _to_stored(opt.slots["mu"][j], axes),
        "v": _to_stored(opt.slots["nu"][j], axes),
    }


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

    With ``optimizers`` an ``adam`` or ``sgd`` state (``adamw`` without a
    recorded weight decay) is written as cl-waffe2's entries; Adam's b1/b2/eps
    default to optax.adam's, the learning rate is required.  Without, the
    state is left out with a warning.  The default (None) keeps the state of
    a model converted from another checkpoint: a conversion drops nothing silently.
    """
    check_meta(meta)  # its keys/layers/step/count are recomputed from the model
    if optimizers is None:
        optimizers = model.origin is not None
    namings = _namings(naming)
    problems, named = [], []
    for i, layer in enumerate(model.layers):
        slots = getattr(namings.get(layer.type), "slots", {})
        unnamed = sorted(k for k in layer.arrays if k not in slots)
        if unnamed:
            problems.append(f"layer {i} ({layer.type}) arrays {unnamed}")
        named.append([k for k, _ in layer.params if k in slots])
    opt = model.opt_state
    hp: dict[str, Any] = {}
    opt_problems: list[str] = []
    if opt is not None and optimizers:
        hp = _merged_hyperparams(opt, hyperparams)
        opt_problems = _optimizer_problems(opt, hp)
    refuse_or_warn(problems + opt_problems, "waffe2", lossy)
    if opt is not None and not optimizers:
        warnings.warn(
            "waffe2: the optimizer state is not written (optimizers=False, cl-waffe2's default); "
            "pass optimizers=True to keep it",
            PytreeioWarning,
            stacklevel=4,
        )
    if opt_problems or not optimizers:
        opt = None
    kept = [(j, i, k, a) for j, (i, k, a) in enumerate(model.params) if k in named[i]]
    plan = _plan([(layer.type, ks) for layer, ks in zip(model.layers, named, strict=True)], namings)
    native: dict[str, Any] = {"param": {}}
    keys_by_param: list[list[str]] = []
    for (j, i, k, arr), s in zip(kept, plan, strict=True):
        axes = namings[model.layers[i].type].axes.get(k)
        insert(native, ("param", *s.parts), _to_stored(arr, axes))
        keys_by_param.append([s.key])
        if opt is not None:
            name = "sgd" if opt.kind == "sgd" else "adam"
            values = _opt_values(opt, hp, j, axes)
            insert(native, ("optimizer", *s.parts, name), values)
            keys_by_param[-1] += [
                make_key("optimizer", *s.parts, name, type_of(v), n) for n, v in values.items()
            ]
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
