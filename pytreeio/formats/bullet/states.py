"""Training states keyed by bullet's own tensor ids, as a JAX NNUE is usually written::

    {"params": {"l0w": w0, "l0b": b0, "l1w": w1, "l1b": b1},
     "opt_state": optax.adamw(...).init(params),   # optional
     "step": 5}                                     # optional

``save(..., format="bullet")`` takes such a tree and ``load(..., like=...)`` fills one.

``params``: dicts (string keys) whose leaves are float32 arrays, as bullet
stores them (``l{k}w`` is ``(in, out)``).  A leaf's tensor id is its key path
joined with nothing between the keys: ``{"l0w": w}`` and ``{"l0": {"w": w}}``
both hold ``l0w``.  Lists, non-string keys and two paths joining to one id
are refused.  (Flax ``Dense_N`` trees go through `.models` instead.)

``opt_state``: an optax state, read by `pytreeio.model.optim.extract`.
``adam``/``adamw`` (weight-decay ``mask=`` included): ``mu`` goes to
``optimiser_state/momentum.bin`` and ``nu`` to ``velocity.bin`` by id, like the weights in
``weights.bin``.  A plain ``sgd`` state holds nothing.  Other optimizers (sgd
with momentum, adagrad, ...), ``optax.masked`` moments and
``inject_hyperparams`` hyperparameters raise `ConversionError`, because the files have
no place for them.

The step count: bullet's AdamW keeps none, because its update has no bias correction.
optax's ``count`` (or ``step`` when there is no optimizer count; the two must agree)
goes on every tensor's line of ``optimiser_state/step.txt`` (``id,step``: RAdam's and
Ranger's file, which AdamW ignores), as the common model form does.  A checkpoint
without step.txt (bullet's own) is loaded with ``step=``.

On load, ``like``'s structure is kept and its leaves say the shapes and dtypes.  Records
store no shapes, so a tensor read as 1-D (a weight without a bias to give its
outputs, or an id that is not a layer's) takes ``like``'s shape when the counts
agree.  If ``like`` lacks a tensor that the file holds, the load is refused unless
``partial=True``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from pytreeio.core.errors import ConversionError, EncodeError, MismatchError
from pytreeio.core.tree import LazyLeaf, allows_extra, describe_leaf, key_string, restore
from pytreeio.formats.bullet.layout import is_int, model_order, valid_id
from pytreeio.formats.bullet.models import FORMAT_NAME, _model_step

_KEYS = frozenset({"params", "opt_state", "step"})

Path = tuple[str, ...]
Fail = Callable[[str, str], Exception]


class State(NamedTuple):
    params: Mapping[str, Any]
    opt_state: Any
    step: Any


def parts(tree: Any, fail: Fail | None = None) -> State | None:
    """The parts of a training state keyed by tensor ids, or None when ``tree`` is not one.

    With ``fail``, a state with keys besides ``params``, ``opt_state`` and ``step`` raises
    ``fail(reason, key)`` naming the first of them (without, it is not a state).
    """
    from pytreeio.model.form import is_flax_tree

    if not isinstance(tree, Mapping) or "params" not in tree:
        return None
    params = tree["params"]
    if not isinstance(params, Mapping) or is_flax_tree(params):
        return None
    extra = sorted(map(str, set(tree) - _KEYS))
    if extra:
        if fail is None:
            return None
        raise fail(
            f"a bullet training state holds params, opt_state and step only, not {extra}",
            extra[0],
        )
    return State(params, tree.get("opt_state"), tree.get("step"))


def encode_error(reason: str, where: str) -> Exception:
    return EncodeError(reason, key_path=where)


def mismatch(reason: str, where: str) -> Exception:
    return MismatchError(reason, key_path=where)


def tensor_ids(params: Mapping[str, Any], fail: Fail) -> list[tuple[Path, str, Any]]:
    """``(key path, tensor id, leaf)`` of every leaf of ``params``. The id is the key path
    joined with no separator. Ids must be valid and unique."""
    out: list[tuple[Path, str, Any]] = []
    seen: dict[str, Path] = {}

    def walk(node: Mapping[Any, Any], path: Path) -> None:
        for key, child in node.items():
            where = key_string(("params", *path, key))
            if not isinstance(key, str):
                why = f"params are dicts keyed by (parts of) tensor ids; found the key {key!r}"
                raise fail(why, where)
            if isinstance(child, Mapping):
                walk(child, (*path, key))
                continue
            if isinstance(child, list | tuple) or child is None:
                what = "None" if child is None else type(child).__name__
                why = f"params are dicts of arrays keyed by tensor id; found a {what}"
                raise fail(why, where)
            rid = "".join((*path, key))
            if not valid_id(rid):
                raise fail(f"{rid!r} is not a bullet tensor id (printable ASCII)", where)
            if rid in seen:
                other = key_string(("params", *seen[rid]))
                raise fail(f"{where!r} and {other!r} both name tensor {rid!r}", where)
            seen[rid] = (*path, key)
            out.append(((*path, key), rid, child))

    walk(params, ())
    if not out:
        raise fail("params holds no tensor", "params")
    return out


def _step_of(value: Any) -> int:
    arr = np.asarray(value)
    if arr.shape != () or arr.dtype.kind not in "iu" or int(arr) < 0:
        why = f"the step is a non-negative integer, found {describe_leaf(value)}"
        raise EncodeError(why, key_path="step")
    return int(arr)


def _within_opt_state(exc: MismatchError) -> MismatchError:
    """``exc`` with its key path, one within the optimizer state, under ``opt_state``
    (paths into optim's own arguments -- slots, count, order -- are left as they are)."""
    where = exc.key_path
    if where is not None and where not in ("count", "order") and not where.startswith("slots/"):
        exc.key_path = "opt_state" + (f"/{where}" if where else "")
    return exc


def _cannot_hold(what: str, why: str) -> ConversionError:
    return ConversionError(f"format {FORMAT_NAME!r} cannot hold: {what} ({why})", what=[what])


def to_native(
    tree: Any, meta: Mapping[str, Any] | None
) -> tuple[dict[str, dict[str, Any]], Mapping[str, Any] | None]:
    """The native tree (``weights``, ``momentum``, ``velocity`` by id) and meta (``steps``
    added) of a training state keyed by tensor ids."""
    from pytreeio.model import optim

    state = parts(tree)
    assert state is not None
    flat = tensor_ids(state.params, encode_error)
    weights = {rid: leaf for _, rid, leaf in flat}
    native: dict[str, dict[str, Any]] = {"weights": weights}
    count = None
    if state.opt_state is not None:
        ids = [rid for _, rid, _ in flat]
        try:
            opt = optim.extract(state.opt_state, state.params, order=[p for p, _, _ in flat])
        except MismatchError as exc:
            raise _within_opt_state(exc) from None
        if opt.hyperparams:
            names = sorted(opt.hyperparams)
            why = "bullet's files hold tensors and step counts only"
            raise _cannot_hold(f"hyperparameters {names} (inject_hyperparams)", why)
        if opt.kind in ("adam", "adamw"):
            mu, nu = opt.slots["mu"], opt.slots["nu"]
            masked = [rid for rid, m, n in zip(ids, mu, nu) if m is None or n is None]
            if masked:
                why = "momentum.bin and velocity.bin hold every tensor"
                raise _cannot_hold(f"moments masked out for tensors {masked}", why)
            native["momentum"] = dict(zip(ids, mu))
            native["velocity"] = dict(zip(ids, nu))
        elif opt.kind != "sgd":
            why = "bullet keeps AdamW's two moments, momentum.bin and velocity.bin:"
            why += " save an optax adam or adamw state"
            raise _cannot_hold(f"optimizer state {opt.kind} (slots {sorted(opt.slots)})", why)
        count = opt.count
    step = None if state.step is None else _step_of(state.step)
    if step is not None and count is not None and step != count:
        why = f"step {step} differs from the optimizer's count {count}; bullet keeps one"
        raise EncodeError(why, key_path="step")
    n = count if count is not None else step
    if n is None:
        return native, meta
    if meta is not None and not isinstance(meta, Mapping):
        raise EncodeError("meta must be a dict", key_path="meta")
    steps = {rid: n for rid in model_order(weights)}
    given = (meta or {}).get("steps")
    if given is not None and (not isinstance(given, Mapping) or dict(given) != steps):
        why = f"meta['steps'] contradicts the step count {n} of the tree"
        raise EncodeError(why, key_path="meta.steps")
    return native, {**(meta or {}), "steps": steps}


def _shaped(value: Any, like: Any) -> Any:
    """``value`` in ``like``'s shape when the records could not tell it (a 1-D read)."""
    want, have = tuple(getattr(like, "shape", ())), tuple(getattr(value, "shape", ()))
    if have == want or len(have) != 1 or not hasattr(like, "shape") or math.prod(want) != have[0]:
        return value
    if isinstance(value, LazyLeaf):
        value = value.read()
    return np.asarray(value).reshape(want)


def _nested(flat: Sequence[tuple[Path, str, Any]], values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, rid, leaf in flat:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _shaped(values[rid], leaf)
    return out


def restore_state(native: Any, meta: Mapping[str, Any], like: Any, step: int | None) -> Any:
    """A native tree in the structure of the training state ``like`` (see the module docstring)."""
    state = parts(like)
    assert state is not None
    weights = native.get("weights") if isinstance(native, Mapping) else None
    if not isinstance(weights, Mapping):
        raise MismatchError("the checkpoint holds no weights", key_path="weights", found=None)
    flat = tensor_ids(state.params, mismatch)
    ids = [rid for _, rid, _ in flat]
    for path, rid, leaf in flat:
        if rid not in weights:
            raise MismatchError(
                f"the checkpoint has no tensor {rid!r}",
                key_path=key_string(("params", *path)),
                expected=describe_leaf(leaf),
                found="nothing",
            )
    known = set(ids)
    extra = [rid for rid in model_order(weights) if rid not in known]
    if extra and not allows_extra():
        why = f"the checkpoint has tensor {extra[0]!r}, which `like`'s params lack"
        why += " (load with partial=True to leave it out)"
        raise MismatchError(why, key_path=f"weights/{extra[0]}", found=extra)
    if step is not None and (not is_int(step) or step < 0):
        raise MismatchError("step must be a non-negative integer", key_path="step", found=step)
    out: dict[str, Any] = {}
    count = _model_step(meta, ids, None if step is None else int(step))
    for key in like:
        if key == "params":
            out[key] = restore(_nested(flat, weights), state.params, path=("params",))
        elif key == "opt_state":
            out[key] = None if state.opt_state is None else _opt_state(native, flat, state, count)
        else:
            if count is None:
                raise MismatchError("the file holds no step count", key_path="step", found=None)
            out[key] = restore(count, state.step, path=("step",))
    return out


def _opt_state(native: Mapping[str, Any], flat: Any, state: State, count: int | None) -> Any:
    from pytreeio.model import optim

    order = [path for path, _, _ in flat]
    if native.get("momentum") is not None:
        moments = {
            slot: [_shaped(native[part][rid], leaf) for _, rid, leaf in flat]
            for slot, part in (("mu", "momentum"), ("nu", "velocity"))
        }
        opt = optim.OptState("adamw", {}, count, moments)
        try:
            return optim.rebuild(opt, state.opt_state, state.params, order=order)
        except MismatchError as exc:
            raise _within_opt_state(exc) from None
    # no moments: only a state that holds none (plain sgd, with or without a count) fits
    for n in dict.fromkeys((count, None)):
        try:
            empty = optim.OptState("sgd", {}, n, {})
            return optim.rebuild(empty, state.opt_state, state.params, order=order)
        except MismatchError:
            continue
    raise MismatchError(
        "the file holds no optimizer state (no optimiser_state/momentum.bin, velocity.bin)",
        key_path="opt_state",
        expected=optim.describe(state.opt_state),
        found="nothing",
    )
