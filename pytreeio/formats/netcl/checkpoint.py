"""netcl training checkpoints and raw parameter files.

``netcl-checkpoint`` - ``netcl.io.checkpoint.save_checkpoint``::

    <p>.npz    (".npz" appended unless <p> ends with it) an np.savez archive of the
               parameters named p0, p1, ... in model.parameters() order (or given names)
    <p>.json   (<p> with its last suffix replaced) json.dumps of
               {"optim_state": {...}, "config": {...}}; AdamW/Adam state
               {"t": int, "moments": [[m, v], ...]}, SGD {"velocity": [...]},
               arrays as nested lists of numbers (float32 widened to float64: exact)

  The pair is written under one lock and journal (readers see the old or the
  new pair).  Native tree: ``{'params': {name: array}, 'optim_state': {...},
  'config': {...}}``, moments as arrays (the parameter's dtype when exact,
  else float64); ``t``/``moments`` are optax Adam's ``count``/``mu``,``nu``,
  ``velocity`` sgd-momentum's ``trace``.

``netcl-params`` - ``save_params``: the bare ``.npz`` at ``<p>`` (or
``<p>.npz``).  Restoring into a list reports a missing name as
`NetclMissingParamError` (also a ``KeyError``) and a wrong shape as
`NetclShapeMismatchError` (a ``ValueError``), with netcl's wording.

Both store parameters only: a Flax tree maps onto ``p0, p1, ...`` through the
common model form, whose layers are read off the shapes (or given with
``layers=``); netcl's array orientation is `pytreeio.formats.netcl.naming`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pytreeio.containers import npy
from pytreeio.core import dtypes, jsonsafe
from pytreeio.core.binary import ByteSource, Slots, as_memoryview
from pytreeio.core.errors import (
    ConversionError,
    EncodeError,
    FormatError,
    MismatchError,
)
from pytreeio.core.records import STRUCTURE, Decoded, Encoded, Entry, Format, Info, Probe, Siblings
from pytreeio.formats.netcl.errors import NetclMissingParamError, NetclShapeMismatchError
from pytreeio.formats.netcl.naming import META_KEY, check_types, host, read_npz, to_common, to_netcl
from pytreeio.formats.registry import register
from pytreeio.model.form import Model, refuse_or_warn, training_state

__all__ = ["CHECKPOINT", "PARAMS", "NetclMissingParamError", "NetclShapeMismatchError"]

_ADAM_KINDS = ("adam", "adamw")
CHECKPOINT_NAME = "netcl-checkpoint"


# --------------------------------------------------------------------------
# parameters p0, p1, ... <-> the common form
# --------------------------------------------------------------------------


def _npz_path(path: Path) -> Path:
    s = os.fspath(path)
    return Path(s if s.endswith(".npz") else s + ".npz")


def _ordered(params: Mapping[str, Any], names: Sequence[str] | None) -> list[Any]:
    """The parameter arrays in netcl's order: ``names``, else p0, p1, ..., else file order."""
    if names is None:
        default = [f"p{i}" for i in range(len(params))]
        names = default if set(default) == set(params) else list(params)
    missing = [n for n in names if n not in params]
    if missing:
        raise NetclMissingParamError(
            f"missing param {missing[0]} in checkpoint", key_path=missing[0]
        )
    return [params[n] for n in names]


def _param_arrays(model: Model) -> list[np.ndarray]:
    return [host(to_netcl(a), f"p{j}") for j, (_, _, a) in enumerate(model.params)]


def _stats(model: Model) -> list[str]:
    """BatchNorm running statistics, which netcl checkpoints (``model.parameters()``) do not hold."""
    return [
        f"layer {i} ({la.type}).{k} (BatchNorm statistics; the 'netcl' model format holds them)"
        for i, la in enumerate(model.layers)
        for k in la.spec.stats
        if k in la.arrays
    ]


def _named_items(params: Any, names: Sequence[str] | None) -> list[tuple[str, np.ndarray]]:
    if isinstance(params, Mapping):
        if names is not None:
            raise MismatchError(
                "names= applies to a list; a dict already names its arrays", key_path="params"
            )
        items = [(str(k), v) for k, v in params.items()]
    elif isinstance(params, list | tuple):
        names = [f"p{i}" for i in range(len(params))] if names is None else list(names)
        if len(names) != len(params):
            raise MismatchError(
                f"{len(names)} names for {len(params)} parameters",
                key_path="names",
                expected=len(params),
                found=len(names),
            )
        items = list(zip(names, params))
    else:
        raise MismatchError(
            "params must be a dict of named arrays or a list",
            key_path="params",
            found=type(params).__name__,
        )
    return [(n, host(a, f"params.{n}")) for n, a in items]


def _restore_named(
    arrays: Mapping[str, Any], like: Any, names: Sequence[str] | None, what: str
) -> Any:
    """Named arrays into a list ``like`` (netcl's checks and wording) or a dict ``like``."""
    from pytreeio.core.tree import allows_extra, restore

    prefix = (what,) if what else ()
    if isinstance(like, Mapping):
        return restore(dict(arrays), like, path=prefix)
    if not isinstance(like, list | tuple):
        raise MismatchError(
            "like must be a list of arrays, a dict or a Flax tree",
            key_path=what,
            found=type(like).__name__,
        )
    names = [f"p{i}" for i in range(len(like))] if names is None else list(names)
    if len(names) != len(like):
        raise MismatchError(f"{len(names)} names for {len(like)} parameters", key_path="names")
    values = []
    for i, (n, lk) in enumerate(zip(names, like)):
        want = tuple(getattr(lk, "shape", ()))
        if n not in arrays:
            raise NetclMissingParamError(
                f"missing param {n} in checkpoint", key_path=n, expected=want, found="nothing"
            )
        got = tuple(arrays[n].shape)
        if got != want:
            raise NetclShapeMismatchError(
                f"shape mismatch for {n}: ckpt {got} vs param {want}",
                key_path=n,
                expected=want,
                found=got,
            )
        values.append(restore(arrays[n], lk, path=(*prefix, i)))
    extra = sorted(set(arrays) - set(names))
    if extra and not allows_extra():  # a partial load leaves them in the file
        raise MismatchError(f"the file has arrays that `like` lacks: {extra[:10]}", key_path=what)
    return type(like)(values) if isinstance(like, tuple) else values


def _npz_entries(source: ByteSource) -> tuple[Entry, ...]:
    return tuple(
        Entry(k, h.shape, dtypes.name_of(h.dtype), h.nbytes) for k, h, _ in npy.inspect_npz(source)
    )


def _plain_npz(probe: Probe | None) -> bool:
    members = probe.members if probe is not None else None
    return members is not None and f"{META_KEY}.npy" not in members


# --------------------------------------------------------------------------
# netcl-params
# --------------------------------------------------------------------------


def _params_role(source: Mapping[str, Any]) -> str:
    for role in ("path", "npz"):
        if role in source:
            return role
    raise FormatError("no parameter .npz", field="npz")


def _params_source(source: Mapping[str, Any]) -> tuple[Any, str]:
    role = _params_role(source)
    return source[role], role


def _decode_params(source: Mapping[str, Any], *, verify_crc: bool = True) -> Decoded:
    return Decoded(read_npz(source, _params_role(source), verify_crc), {})


def _encode_params(tree: Any, *, meta: Any = None, names: Sequence[str] | None = None) -> Encoded:
    items = _named_items(tree, names)
    return Encoded(files={"npz": Encoded(chunks=tuple(npy.encode_npz(items, overlap=True)))})


def _restore_params(
    native: Any, meta: Mapping[str, Any], like: Any, *, names: Sequence[str] | None = None
) -> Any:
    return _restore_named(native, like, names, "")


def _params_to_model(
    native: Any, meta: Mapping[str, Any], *, names: Sequence[str] | None = None, layers: Any = None
) -> Model:
    return Model.from_params([to_common(a) for a in _ordered(native, names)], layers)


def _params_from_model(
    model: Model, meta: Mapping[str, Any] | None = None, *, lossy: bool = False
) -> tuple[Any, dict[str, Any]]:
    """``p0, p1, ...``; BatchNorm statistics, an optimizer state or step are refused unless ``lossy``.

    Parameter-free layers are not refused: the format holds no layer list
    (``layers=`` on loading supplies it).
    """
    check_types(model)
    problems = _stats(model) + training_state(model)
    refuse_or_warn(problems, "netcl-params", lossy, hint=" (netcl-checkpoint holds the state)")
    return _param_arrays(model), {}


def _inspect_params(source: Mapping[str, ByteSource]) -> Info:
    return Info("netcl-params", _npz_entries(_params_source(source)[0]), {})


def _locate_params(path: Path) -> dict[str, Path]:
    roles = {"npz": _npz_path(path)}
    if roles["npz"] != Path(path):
        roles["path"] = Path(path)
    return roles


def _sniff_params(probe: Probe) -> float:
    for role in ("path", "npz"):
        p = probe.siblings.get(role)
        if p is not None:
            ok = _plain_npz(p) and all(n.endswith(".npy") for n in p.members or ())
            return 10.0 if ok else 0.0
    return 0.0


# --------------------------------------------------------------------------
# netcl-checkpoint
# --------------------------------------------------------------------------


def _check_t(t: Any) -> int:
    if type(t) is not int or not 0 <= t < 1 << 63:
        raise FormatError(
            f"optim_state.t must be an integer in [0, 2**63), found {str(t)[:40]}",
            field="optim_state.t",
        )
    return t


def _slot_list(values: Any, params: list[Any], field: str) -> list[np.ndarray]:
    """Each JSON nested list shaped like its parameter: in the parameter's dtype when its
    numbers are exact in it, else float64 (exactness checked for all moments at once)."""
    if not isinstance(values, list) or len(values) != len(params):
        raise FormatError(f"{field} must be a list of {len(params)} entries", field=field)
    from pytreeio.model.optim import nested_to_array

    out: list[np.ndarray] = []
    narrow: dict[np.dtype[Any], list[int]] = {}  # float64 values to narrow, by the param's dtype
    borrowed = []  # rows of the parsed document taken as they are
    for i, (v, p) in enumerate(zip(values, params)):
        shape, dtype = tuple(p.shape), np.dtype(p.dtype)
        if isinstance(v, np.ndarray) and v.shape == shape and v.dtype == dtype:
            out.append(v)  # decoded already
            continue
        if type(v) is np.ndarray and v.dtype == np.float64 and v.shape == shape:
            out.append(v)  # a row the parser read as an array: narrowed (a copy) or copied below
            borrowed.append(i)
        else:
            out.append(nested_to_array(v, shape, f"{field}[{i}]"))
        if dtype.kind == "f":
            narrow.setdefault(dtype, []).append(i)
    for dtype, idx in narrow.items():
        _narrowed(out, idx, dtype)
    for i in borrowed:
        if out[i] is values[i]:  # not narrowed: never share the parsed document's arrays
            out[i] = values[i].copy()
    return out


def _narrowed(arrays: list[np.ndarray], idx: list[int], dtype: np.dtype[Any]) -> None:
    """``arrays[i]`` for ``i`` in ``idx`` as ``dtype`` where every number is exact in it."""
    wide = [arrays[i] for i in idx]
    flat = np.concatenate([a.ravel() for a in wide]) if len(wide) > 1 else wide[0].ravel()
    with np.errstate(over="ignore", invalid="ignore"):
        small = flat.astype(dtype)
    back = small.astype(np.float64)
    if not np.array_equal(back, flat, equal_nan=True):  # one by one: which ones are exact
        for i, a in zip(idx, wide):
            with np.errstate(over="ignore", invalid="ignore"):
                one = a.astype(dtype)
            if np.array_equal(one.astype(np.float64), a, equal_nan=True):
                arrays[i] = one
        return
    pos = 0
    for i, a in zip(idx, wide):
        arrays[i] = small[pos : pos + a.size].reshape(a.shape)
        pos += a.size


def _decode_optim_state(state: Any, params: list[Any]) -> dict[str, Any]:
    """netcl's optimizer dict with its moments as arrays shaped like the parameters."""
    if not isinstance(state, dict):
        raise FormatError(
            f"optim_state must be an object, found {type(state).__name__}", field="optim_state"
        )
    out = dict(state)
    if "moments" in state:
        pairs = state["moments"]
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in pairs
        ):
            raise FormatError(
                "optim_state.moments must be a list of [m, v] pairs", field="optim_state.moments"
            )
        ms = _slot_list([p[0] for p in pairs], params, "optim_state.moments.m")
        vs = _slot_list([p[1] for p in pairs], params, "optim_state.moments.v")
        out["moments"] = [[m, v] for m, v in zip(ms, vs)]
    if "t" in state:
        out["t"] = _check_t(state["t"])
    if "velocity" in state:
        out["velocity"] = _slot_list(state["velocity"], params, "optim_state.velocity")
    return out


def _opt_state_of(state: Mapping[str, Any]) -> Any:
    """The format-neutral state of netcl's optimizer dict (slots as stored), None when empty."""
    from pytreeio.model.optim import OptState

    if not state:
        return None
    if "moments" in state:
        if "t" not in state:
            raise FormatError("optim_state has moments but no t", field="optim_state.t")
        slots = {"mu": [m for m, _ in state["moments"]], "nu": [v for _, v in state["moments"]]}
        return OptState("adamw", {}, _check_t(state["t"]), slots)
    if "velocity" in state:
        return OptState("momentum", {}, None, {"trace": list(state["velocity"])})
    raise FormatError(
        f"optim_state has neither moments nor velocity: keys {sorted(map(str, state))[:10]}",
        field="optim_state",
    )


def _opt_problems(opt: Any) -> list[str]:
    """What of a format-neutral optimizer state netcl's optimizer dicts cannot hold."""
    if opt is None:
        return []
    if opt.kind not in (*_ADAM_KINDS, "momentum", "nesterov", "sgd"):
        return [f"optimizer state ({opt.kind}; netcl checkpoints hold AdamW/Adam or SGD state)"]
    out = []
    if any(a is None for slot in opt.slots.values() for a in slot):
        out.append(f"masked optimizer slots ({opt.kind}; netcl keeps state for every parameter)")
    if opt.kind not in _ADAM_KINDS and opt.count is not None:
        out.append(f"the optimizer's step count ({opt.count}; netcl's SGD keeps none)")
    return out


def _netcl_state_of(opt: Any, *, common: bool = True) -> dict[str, Any]:
    """netcl's optimizer dict for a format-neutral state; slots in common orientation if ``common``.

    A state netcl cannot hold (`_opt_problems`) is a `ConversionError`.
    """
    if opt is None:
        return {}
    problems = _opt_problems(opt)
    if problems:
        raise ConversionError(
            f"netcl checkpoints cannot hold: {', '.join(problems)}", what=problems
        )

    def netcl_order(name: str) -> list[np.ndarray]:
        slots = opt.slots[name]
        return [
            host(to_netcl(a) if common else a, f"optim_state.{name}[{j}]")
            for j, a in enumerate(slots)
        ]

    if opt.kind in _ADAM_KINDS:
        moments = [[m, v] for m, v in zip(netcl_order("mu"), netcl_order("nu"))]
        return {"t": int(opt.count or 0), "moments": moments}
    if opt.kind in ("momentum", "nesterov"):
        return {"velocity": netcl_order("trace")}
    return {}


def _held_state(opt: Any) -> Any:
    """What of ``opt`` netcl holds (after ``lossy`` accepted dropping the rest)."""
    if opt is None or not _opt_problems(opt):
        return opt
    if opt.kind in ("momentum", "nesterov", "sgd") and not any(
        a is None for slot in opt.slots.values() for a in slot
    ):
        return dataclasses.replace(opt, count=None)  # only the SGD step count is dropped
    return None


def _state_dict(state: Any, params: Any) -> Mapping[str, Any]:
    """netcl's optimizer dict as given, or made from an optax state over a params list."""
    from pytreeio.model.optim import extract

    if isinstance(state, Mapping):
        return state
    if not isinstance(params, list | tuple):
        raise MismatchError(
            "an optax optim_state needs params as a list in netcl's order (or a Flax params "
            "tree saved as {'params': ..., 'opt_state': ...})",
            key_path="optim_state",
            found=type(params).__name__,
        )
    return _netcl_state_of(extract(state, list(params)), common=False)


def _max_values(nbytes: int) -> int:
    """The sidecar holds the moments as JSON numbers, each at least two bytes (``0,``)."""
    return nbytes // 2 + 1024


def _sidecar(raw: Any, name: str) -> dict[str, Any]:
    """The JSON sidecar: its number rows (the moments) as float64 arrays (8 bytes a number, not a
    Python float's ~40), its config as JSON's."""
    doc, rows = jsonsafe.loads_rows(raw, path=name, field="json", max_values=_max_values(len(raw)))
    if not isinstance(doc, dict):
        raise FormatError("the sidecar must be a JSON object", path=name, field="json")
    return {k: rows.resolve(v, arrays=k == "optim_state") for k, v in doc.items()}


def _sidecar_state(doc: Mapping[str, Any], params: list[Any]) -> dict[str, Any]:
    """`_decode_optim_state` of the sidecar's ``optim_state``; its errors name the sidecar
    (the I/O layer puts the role's file in their place)."""
    try:
        return _decode_optim_state(doc.get("optim_state", {}), params)
    except FormatError as exc:
        if exc.path is None:
            exc.path = "json"
        raise


def _decode_checkpoint(source: Mapping[str, Any], *, verify_crc: bool = True) -> Decoded:
    if "npz" not in source:
        raise FormatError("no parameter .npz", field="npz")
    params = read_npz(source, "npz", verify_crc)
    doc = _sidecar(as_memoryview(source["json"]), "json") if "json" in source else {}
    config = doc.get("config", {})
    state = _sidecar_state(doc, list(params.values()))
    return Decoded({"params": params, "optim_state": state, "config": config}, {"config": config})


def _slots_checkpoint(source: Mapping[str, ByteSource], *, verify_crc: bool = True) -> Slots:
    """Parameters as slots of the ``.npz``; the JSON sidecar (the optimizer state) is read whole."""
    if "npz" not in source:
        raise FormatError("no parameter .npz", field="npz")
    params = npy.npz_slots(source["npz"], role="npz", verify_crc=verify_crc)
    doc: Any = {}
    if "json" in source:
        js = source["json"]
        doc = _sidecar(js.read(0, js.size, "json"), "json")
    config = doc.get("config", {})
    # the moments are shaped like the parameters: slots carry shape and dtype
    state = _sidecar_state(doc, list(params.values()))
    return Slots({"params": params, "optim_state": state, "config": config}, {"config": config})


def _slots_params(source: Mapping[str, ByteSource], *, verify_crc: bool = True) -> Slots:
    data, role = _params_source(source)
    return Slots(npy.npz_slots(data, role=role, verify_crc=verify_crc), {})


def _checkpoint_to_model(
    native: Any, meta: Mapping[str, Any], *, names: Sequence[str] | None = None, layers: Any = None
) -> Model:
    """The parameters (layers read off their shapes, or ``layers=``) with the AdamW/SGD state.

    A non-empty ``config`` is kept in ``model.extras['netcl-checkpoint']``.
    """
    if not isinstance(native, Mapping) or "params" not in native:
        raise MismatchError(
            "a netcl checkpoint is {'params': ..., 'optim_state': ..., 'config': ...}", key_path=""
        )
    arrays = _ordered(native["params"], names)
    model = Model.from_params([to_common(a) for a in arrays], layers)
    state = _decode_optim_state(native.get("optim_state") or {}, arrays)
    opt = _opt_state_of(state)
    if opt is not None:
        slots = {k: [to_common(a) for a in v] for k, v in opt.slots.items()}
        model = model.replace(opt_state=dataclasses.replace(opt, slots=slots), step=opt.count)
    config = native.get("config")
    if config:
        model = model.replace(extras={CHECKPOINT_NAME: {"config": config}})
    return model


def _checkpoint_from_model(
    model: Model, meta: Mapping[str, Any] | None = None, *, lossy: bool = False
) -> tuple[Any, dict[str, Any]]:
    """``p0, p1, ...`` and netcl's optimizer dict (Adam/AdamW ``t``/``moments``, SGD ``velocity``).

    BatchNorm statistics, other optimizer kinds, masked slots, an SGD step
    count and a step counter other than Adam's ``t`` are refused unless
    ``lossy``.  Parameter-free layers are not refused: the checkpoint holds no
    layer list.  ``config`` comes from ``meta``, else from the model's extras.
    """
    check_types(model)
    opt = model.opt_state
    problems = _stats(model) + _opt_problems(opt)
    if model.step is not None and (
        opt is None or opt.kind not in _ADAM_KINDS or opt.count != model.step
    ):
        problems.append(f"step counter ({model.step})")
    refuse_or_warn(problems, CHECKPOINT_NAME, lossy)
    config = (meta or {}).get("config") or model.extras.get(CHECKPOINT_NAME, {}).get("config", {})
    tree = {
        "params": {f"p{j}": a for j, a in enumerate(_param_arrays(model))},
        "optim_state": _netcl_state_of(_held_state(opt)),
        "config": config if isinstance(config, Mapping) else {},
    }
    return tree, {}


def _encode_checkpoint(
    tree: Any, *, meta: Any = None, names: Sequence[str] | None = None
) -> Encoded:
    from pytreeio.model.optim import json_ready

    if (
        not isinstance(tree, Mapping)
        or "params" not in tree
        or set(tree) - {"params", "optim_state", "config"}
    ):
        raise MismatchError(
            "a netcl checkpoint is {'params': ..., 'optim_state': ..., 'config': ...}", key_path=""
        )
    state = _state_dict(tree.get("optim_state") or {}, tree["params"])
    config = tree.get("config") or {}
    given = meta.get("config") if isinstance(meta, Mapping) else None
    if isinstance(given, Mapping) and given:  # meta={"config": ...} as save and convert take it
        if config and config != given:
            raise MismatchError(
                "the tree's config and meta['config'] differ; pass one of them", key_path="config"
            )
        config = given
    try:
        text = json.dumps({"optim_state": json_ready(state), "config": json_ready(config or {})})
    except (TypeError, ValueError) as exc:
        raise EncodeError(
            f"optim_state/config is not JSON-serialisable: {exc}", key_path=""
        ) from None
    npz = Encoded(chunks=tuple(npy.encode_npz(_named_items(tree["params"], names), overlap=True)))
    return Encoded(files={"npz": npz, "json": Encoded(chunks=(text.encode("utf-8"),))})


def _restore_checkpoint(
    native: Any, meta: Mapping[str, Any], like: Any, *, names: Sequence[str] | None = None
) -> Any:
    """A native-shaped ``like``: params as a list or dict; optim_state as netcl's dict or an optax state."""
    from pytreeio.core.tree import restore
    from pytreeio.model.optim import rebuild

    if not isinstance(like, Mapping) or set(like) - {"params", "optim_state", "config"}:
        raise MismatchError(
            "like must be a dict with 'params' and optionally 'optim_state', 'config'", key_path=""
        )
    out: dict[str, Any] = {}
    if "params" in like:
        out["params"] = _restore_named(native["params"], like["params"], names, "params")
    if "optim_state" in like:
        state_like = like["optim_state"]
        if isinstance(state_like, Mapping):
            out["optim_state"] = restore(native["optim_state"], state_like, path=("optim_state",))
        else:  # an optax state over a params list or dict: parameters in jax leaf order
            opt = _opt_state_of(native["optim_state"])
            if opt is None:
                raise MismatchError(
                    "the file holds no optimizer state", key_path="optim_state", found="nothing"
                )
            out["optim_state"] = rebuild(opt, state_like, like.get("params"))
    if "config" in like:
        out["config"] = restore(native["config"], like["config"], path=("config",))
    return out


def _inspect_checkpoint(source: Mapping[str, ByteSource]) -> Info:
    if "npz" not in source:
        raise FormatError("no parameter .npz", field="npz")
    meta: dict[str, Any] = {}
    if "json" in source:
        js = source["json"]
        raw = js.read(0, js.size, "json")
        # the moments' rows stay cut out: inspect reads the config, t and the state's keys
        doc, rows = jsonsafe.loads_rows(
            raw, path=js.name, field="json", max_values=_max_values(js.size)
        )
        if isinstance(doc, dict):
            meta = {"config": rows.resolve(doc.get("config", {}), arrays=False)}
            state = doc.get("optim_state")
            if isinstance(state, dict):
                meta["optim_state_keys"] = sorted(str(k) for k in state)
                if "t" in state:
                    meta["t"] = state["t"]
    return Info("netcl-checkpoint", _npz_entries(source["npz"]), meta)


def _locate_checkpoint(path: Path) -> dict[str, Path]:
    return {"npz": _npz_path(path), "json": Path(path).with_suffix(".json")}


def _sniff_checkpoint(probe: Probe) -> float:
    npz, js = probe.siblings.get("npz"), probe.siblings.get("json")
    if npz is None or js is None:
        return 0.0
    if probe.kind == "file" and Path(probe.path) not in (npz.path, js.path):
        return 0.0  # the path is some other existing file
    ok = js.head.lstrip().startswith(b'{"optim_state"') and _plain_npz(npz)
    return STRUCTURE if ok else 0.0


CHECKPOINT = register(
    Format(
        name=CHECKPOINT_NAME,
        description="netcl training checkpoint: <p>.npz parameters + <p>.json optim_state/config",
        suffixes=(),
        layout=Siblings(_locate_checkpoint, roles=("npz", "json"), linked=("npz", "json")),
        encode=_encode_checkpoint,
        decode=_decode_checkpoint,
        inspect=_inspect_checkpoint,
        sniff=_sniff_checkpoint,
        restore=_restore_checkpoint,
        to_model=_checkpoint_to_model,
        slots=_slots_checkpoint,
        from_model=_checkpoint_from_model,
        keeps_meta=False,
        streams=True,
    )
)

PARAMS = register(
    Format(
        name="netcl-params",
        description="netcl raw parameter .npz (save_params/load_params)",
        suffixes=(),
        layout=Siblings(_locate_params, roles=("npz", "path")),
        encode=_encode_params,
        decode=_decode_params,
        inspect=_inspect_params,
        sniff=_sniff_params,
        restore=_restore_params,
        to_model=_params_to_model,
        slots=_slots_params,
        from_model=_params_from_model,
        accepts_meta=False,
        keeps_meta=False,
        streams=True,
    )
)
