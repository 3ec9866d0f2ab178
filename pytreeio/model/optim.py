"""optax optimizer states <-> a format-neutral `OptState`.

Formats keep optimizer state in their own conventions (netcl ``{"t", "moments"}``,
cl-waffe2 ``m``/``v``/``n``, bullet ``momentum.bin``/``velocity.bin``) and map
it to and from `OptState`; this module maps `OptState` to and
from optax.  Kinds, the optax state each is read from, and its slots:

- ``sgd``: no core state (only ``EmptyState`` parts); no slots.
- ``momentum``/``nesterov``: ``TraceState``; slot ``trace``.  Both have the
  same state (``inject_hyperparams`` keeps the flag static), so it reads as
  ``momentum`` unless `extract` is given ``hyperparams={"nesterov": True}``.
- ``adagrad``: ``ScaleByRssState``; slot ``sum_of_squares``.
- ``rmsprop``: ``ScaleByRmsState``, or ``ScaleByRStdDevState`` when centered
  (slot ``mu`` too); their ``...WithCountState`` with ``bias_correction``;
  ``optax.rmsprop(momentum=...)`` adds a ``TraceState`` later in the same
  chain (slot ``trace``).  Slot ``nu``.
- ``adam``/``adamw``: ``ScaleByAdamState``; slots ``mu``, ``nu``; step count.
  ``optax.adamw`` chains two stateless steps after it (``add_decayed_weights``:
  an ``EmptyState``, or a ``MaskedState`` around one with ``mask=``; then the
  learning rate), ``optax.adam`` one; hand-written chains are read by that
  rule, and a ``weight_decay`` hyperparameter on an ``adam`` state is refused.
  NAdam has Adam's state: pass ``hyperparams={"nesterov": True}`` to record it.

``adam``/``adamw`` and ``momentum``/``nesterov`` hold the same data, so
`rebuild` fills either state from either kind (netcl does not tell them
apart; the update rule is the caller's optimizer's).

``count`` is the step count: every step counter in the state (the core
state's, schedules', ``inject_hyperparams``') must agree; ``None`` when the
state has none.

The core state may sit anywhere in chains, under ``inject_hyperparams``
(numeric hyperparameters are read from it), with schedules, and under
``optax.masked`` (masked-out parameters have ``None`` slots).  Stateless
parts are ignored.  Any other state with data (``ScaleByAmsgradState``,
``MultiStepsState``, a second core state, ...) is a
`pytreeio.core.errors.MismatchError` naming its type and key path:
nothing is dropped silently.

Slots are lists in *parameter order*: ``order`` is a sequence of key paths
into the params tree, by default jax's leaf order; ``slots[name][i]`` is the
slot leaf of parameter ``order[i]``.  jax and optax are imported on first use.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pytreeio.core.binary import Streamed
from pytreeio.core.errors import FormatError, MismatchError
from pytreeio.core.tree import describe_leaf, is_array_leaf, is_namedtuple, key_string, restore

# The original systems' own update rules as optax transformations, so a foreign
# checkpoint resumes under the rule it was trained with (jax is imported when one is built).
from pytreeio.model.rules.bullet import bullet_adamw
from pytreeio.model.rules.datacode import datacode_optimizer
from pytreeio.model.rules.waffe2 import waffe2_adam

__all__ = [
    "bullet_adamw",
    "datacode_optimizer",
    "waffe2_adam",
    "OptState",
    "KINDS",
    "extract",
    "rebuild",
    "build",
    "describe",
    "default_order",
    "json_ready",
    "nested_to_array",
]

#: The optimizer kinds an `OptState` can hold.
KINDS = ("sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam", "adamw")

KeyPath = tuple[Any, ...]
Path = tuple[Any, ...]  # components as pytreeio.core.tree.key_string takes them


@dataclass(frozen=True, eq=False)
class OptState:
    """An optimizer state, independent of optax's chain layout and of any file format.

    Attributes:
      kind: one of `KINDS`.
      hyperparams: optax argument names -> values (``learning_rate``, ``b1``,
        ``b2``, ``eps``, ``eps_root``, ``weight_decay``, ``momentum``,
        ``decay``, ``initial_accumulator_value``, ...; flags such as
        ``centered``/``bias_correction``/``nesterov`` as bools).  Numbers are
        Python ``float``/``int``.
      count: the step count, or ``None`` for a state without one.
      slots: per-parameter state in parameter order: adam/adamw ``mu``,
        ``nu``; momentum/nesterov ``trace``; adagrad ``sum_of_squares``;
        rmsprop ``nu`` (+ ``mu`` centered, + ``trace`` with momentum).
        ``None`` marks a parameter masked out by ``optax.masked``.

    ``eq=False``: the arrays make field-wise ``==`` ambiguous.
    """

    kind: str
    hyperparams: dict[str, Any] = field(default_factory=dict)
    count: int | None = None
    slots: dict[str, list[np.ndarray | None]] = field(default_factory=dict)


# --- recognising optax state types: by name, module and fields (robust to where optax
# defines them, never confused with a user's look-alike) ---

# optax state type -> (kind, slot fields, whether it has a step count)
_CORE: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "ScaleByAdamState": ("adam", ("mu", "nu"), True),
    "TraceState": ("momentum", ("trace",), False),
    "ScaleByRssState": ("adagrad", ("sum_of_squares",), False),
    "ScaleByRmsState": ("rmsprop", ("nu",), False),
    "ScaleByRmsWithCountState": ("rmsprop", ("nu",), True),
    "ScaleByRStdDevState": ("rmsprop", ("mu", "nu"), False),
    "ScaleByRStdDevWithCountState": ("rmsprop", ("mu", "nu"), True),
}
_INJECT = ("InjectHyperparamsState", "InjectStatefulHyperparamsState")


def _is_optax(node: Any) -> bool:
    return type(node).__module__.startswith("optax")


def _fields(node: Any) -> tuple[str, ...]:
    return tuple(type(node)._fields)


def _core_spec(node: Any) -> tuple[str, tuple[str, ...], bool] | None:
    spec = _CORE.get(type(node).__name__)
    if spec is None or not _is_optax(node):
        return None
    want = (("count",) if spec[2] else ()) + spec[1]
    return spec if _fields(node) == want else None


def _is_inject(node: Any) -> bool:
    return (
        type(node).__name__ in _INJECT
        and _is_optax(node)
        and {"count", "hyperparams", "inner_state"} <= set(_fields(node))
        and set(_fields(node)) <= {"count", "hyperparams", "hyperparams_states", "inner_state"}
    )


def _is_masked(node: Any) -> bool:
    return (
        type(node).__name__ == "MaskedState"
        and _is_optax(node)
        and _fields(node) == ("inner_state",)
    )


def _is_masked_node(x: Any) -> bool:
    return type(x).__name__ == "MaskedNode" and _is_optax(x)


def _is_count_only(node: Any) -> bool:
    return _fields(node) == ("count",)


def _leafless(node: Any) -> bool:
    import jax

    return not jax.tree_util.tree_leaves(node)


# --- scanning a state: the core state(s), step counts, injected hyperparameters ---


@dataclass
class _Core:
    path: Path
    node: Any
    kind: str
    slot_fields: tuple[str, ...]
    has_count: bool
    ctx: tuple[Sequence[Any], int] | None  # the chain tuple holding it, and its index


@dataclass
class _Scan:
    cores: list[_Core] = field(default_factory=list)
    counts: list[tuple[Path, Any]] = field(default_factory=list)
    injected: list[tuple[Path, Mapping[Any, Any]]] = field(default_factory=list)
    unsupported: list[tuple[Path, Any]] = field(default_factory=list)


def _scan(node: Any, path: Path, ctx: tuple[Sequence[Any], int] | None, out: _Scan) -> None:
    if is_namedtuple(node):
        spec = _core_spec(node)
        if spec is not None:
            out.cores.append(_Core(path, node, spec[0], spec[1], spec[2], ctx))
            if spec[2]:
                out.counts.append(((*path, "count"), node.count))
            return
        if _is_inject(node):
            out.counts.append(((*path, "count"), node.count))
            if isinstance(node.hyperparams, Mapping):
                out.injected.append(((*path, "hyperparams"), node.hyperparams))
            else:
                out.unsupported.append(((*path, "hyperparams"), node.hyperparams))
            states = getattr(node, "hyperparams_states", None)
            if isinstance(states, Mapping):
                for k, s in states.items():
                    _scan(s, (*path, "hyperparams_states", k), None, out)
            elif states is not None:
                out.unsupported.append(((*path, "hyperparams_states"), states))
            _scan(node.inner_state, (*path, "inner_state"), None, out)
            return
        if _is_masked(node):
            _scan(node.inner_state, (*path, "inner_state"), None, out)
            return
        if _is_count_only(node):
            out.counts.append(((*path, "count"), node.count))
            return
        if not _fields(node) or _leafless(node):
            return  # EmptyState and other states that hold nothing
        out.unsupported.append((path, node))
        return
    if isinstance(node, tuple | list):
        for i, child in enumerate(node):
            _scan(child, (*path, ("[", i)), (node, i), out)
        return
    out.unsupported.append((path, node))


def _where(path: Path) -> str:
    return key_string(path) or "<root>"


def _decay_follows(ctx: tuple[Sequence[Any], int] | None) -> bool:
    """Whether the chain around a ScaleByAdamState is adamw's (see the module docstring)."""
    if ctx is None:
        return False
    chain, i = ctx
    rest = list(chain[i + 1 :])
    if len(rest) < 2:
        return False
    decay, lr = rest[0], rest[1]
    if not is_namedtuple(decay) or not is_namedtuple(lr):
        return False
    decay_ok = not _fields(decay) or (_is_masked(decay) and _leafless(decay.inner_state))
    lr_ok = not _fields(lr) or _is_count_only(lr)
    return decay_ok and lr_ok


def _core_of(scan: _Scan, what: str) -> tuple[str, dict[str, tuple[Path, Any]], dict[str, bool]]:
    """(kind, {slot name: (path, params-shaped tree)}, structural flags) of a scanned state."""
    if scan.unsupported:
        path, node = scan.unsupported[0]
        name = type(node).__name__ if node is not None else "None"
        raise MismatchError(
            f"{what}: pytreeio cannot map this optimizer state part: {name}"
            + (f" ({describe(node)})" if is_namedtuple(node) else ""),
            key_path=_where(path),
            expected="an optax state of " + ", ".join(KINDS),
            found=name,
        )
    cores = scan.cores
    if not cores:
        return "sgd", {}, {}
    flags: dict[str, bool] = {}
    main = cores[0]
    trace: _Core | None = None
    if len(cores) == 2:
        a, b = cores
        if (
            a.kind == "rmsprop"
            and b.kind == "momentum"
            and a.ctx is not None
            and b.ctx is not None
            and a.ctx[0] is b.ctx[0]
            and a.ctx[1] < b.ctx[1]
        ):
            trace = b  # optax.rmsprop(momentum=...): chain(scale_by_rms, lr, trace)
    if len(cores) > 2 or (len(cores) == 2 and trace is None):
        names = [f"{type(c.node).__name__} at {_where(c.path)}" for c in cores]
        raise MismatchError(
            f"{what}: more than one stateful transformation ({', '.join(names)}); "
            "an OptState holds one optimizer",
            key_path=_where(cores[1].path),
            expected=f"only {type(cores[0].node).__name__}",
            found=type(cores[1].node).__name__,
        )
    slots = {f: ((*main.path, f), getattr(main.node, f)) for f in main.slot_fields}
    kind = main.kind
    if kind == "adam" and _decay_follows(main.ctx):
        kind = "adamw"
    if kind == "rmsprop":
        if "mu" in main.slot_fields:
            flags["centered"] = True
        if main.has_count:
            flags["bias_correction"] = True
        if trace is not None:
            slots["trace"] = ((*trace.path, "trace"), trace.node.trace)
    return kind, slots, flags


# --- key paths and parameter order ---


def _entry_key(entry: Any) -> Any:
    """A jax key-path entry as a plain key (dict key, sequence index, attribute name)."""
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr) and type(entry).__module__.startswith("jax"):
            return getattr(entry, attr)
    return entry


def _entry_component(entry: Any) -> Any:
    """A jax key-path entry as a pytreeio key-path component (for messages and restore)."""
    name = type(entry).__name__
    if name == "SequenceKey":
        return ("[", entry.idx)
    if name == "FlattenedIndexKey":
        return ("[", entry.key)
    if name == "GetAttrKey":
        return entry.name
    key = getattr(entry, "key", entry)
    return key if isinstance(key, str | int) and not isinstance(key, bool) else str(key)


def _flat_with_paths(tree: Any) -> list[tuple[KeyPath, Path, Any]]:
    """``(plain key path, component path, leaf)`` with optax ``MaskedNode`` kept as a leaf."""
    import jax

    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_masked_node)
    return [
        (tuple(_entry_key(e) for e in p), tuple(_entry_component(e) for e in p), leaf)
        for p, leaf in pairs
    ]


def default_order(params: Any) -> list[KeyPath]:
    """The default parameter order: jax's leaf order of ``params``, as key paths."""
    return [k for k, _, _ in _flat_with_paths(params)]


def _resolve_order(order: Sequence[Any] | None, params: Any, what: str) -> list[KeyPath]:
    paths = default_order(params)
    if order is None:
        return paths
    if isinstance(order, str | bytes) or not isinstance(order, Sequence):
        raise MismatchError(
            f"{what}: order must be a sequence of key paths",
            key_path="order",
            expected="a list of tuples",
            found=type(order).__name__,
        )
    out: list[KeyPath] = []
    for i, p in enumerate(order):
        if not isinstance(p, tuple | list):
            raise MismatchError(
                f"{what}: order[{i}] is not a key path",
                key_path=f"order/[{i}]",
                expected="a tuple of keys",
                found=type(p).__name__,
            )
        key = tuple(_entry_key(e) for e in p)
        try:
            hash(key)
        except TypeError:
            raise MismatchError(
                f"{what}: order[{i}] holds something that is not a key",
                key_path=f"order/[{i}]",
                expected="str or int keys",
                found=repr(key),
            ) from None
        out.append(key)
    known, given = set(paths), set(out)
    problems = [f"names parameter {p!r} twice" for i, p in enumerate(out) if p in out[:i]]
    problems += [f"names {p!r}, which is not a parameter" for p in out if p not in known]
    problems += [f"lacks parameter {p!r}" for p in paths if p not in given]
    if problems:
        raise MismatchError(f"{what}: order {problems[0]}", key_path="order")
    return out


# --- extract ---


def _host(leaf: Any, path: Path, what: str) -> np.ndarray:
    if not is_array_leaf(leaf):
        raise MismatchError(
            f"{what}: expected an array",
            key_path=_where(path),
            expected="array",
            found=describe_leaf(leaf),
        )
    try:
        arr = np.asarray(leaf)
    except Exception:  # e.g. a ShapeDtypeStruct or a tracer: no values to read
        arr = np.empty((), object)
    if arr.dtype == object:
        raise MismatchError(
            f"{what}: this leaf has no values to read",
            key_path=_where(path),
            expected="a concrete array",
            found=describe_leaf(leaf),
        )
    return arr


def _scalar(value: Any, path: Path, what: str) -> Any:
    arr = _host(value, path, what) if is_array_leaf(value) else np.asarray(value)
    if arr.shape != () or arr.dtype.kind not in "biuf":
        raise MismatchError(
            f"{what}: expected a numeric scalar",
            key_path=_where(path),
            expected="a scalar",
            found=describe_leaf(value) if is_array_leaf(value) else type(value).__name__,
        )
    return arr[()].item()


def _slot_list(tree: Any, path: Path, order: list[KeyPath]) -> list[np.ndarray | None]:
    got = {key: (comp, leaf) for key, comp, leaf in _flat_with_paths(tree)}
    wanted = set(order)
    for key, (comp, leaf) in got.items():
        if key not in wanted:
            raise MismatchError(
                "the optimizer state has an entry that is not a parameter",
                key_path=_where((*path, *comp)),
                expected="a parameter path",
                found=describe_leaf(leaf),
            )
    for key in order:
        if key not in got:
            raise MismatchError(
                f"the optimizer state lacks parameter {key!r}",
                key_path=_where(path),
                expected=key,
                found="nothing",
            )
    return [
        None if _is_masked_node(leaf) else _host(leaf, (*path, *comp), "extract")
        for comp, leaf in (got[key] for key in order)
    ]


def _merge_hyperparams(scan: _Scan, given: Mapping[str, Any] | None) -> dict[str, Any]:
    found: dict[str, tuple[Any, np.dtype, Path]] = {}
    for base, hps in scan.injected:
        for name, value in hps.items():
            where = (*base, name)
            v = _scalar(value, where, "extract")
            dt = np.asarray(value).dtype if is_array_leaf(value) else np.asarray(v).dtype
            if name in found and found[name][0] != v:
                raise MismatchError(
                    f"hyperparameter {name!r} has two values in the state",
                    key_path=_where(where),
                    expected=found[name][0],
                    found=v,
                )
            found[name] = (v, np.dtype(dt), where)
    out = {name: v for name, (v, _, _) in found.items()}
    if given is None:
        return out
    if not isinstance(given, Mapping):
        raise MismatchError(
            "hyperparams must be a mapping", key_path="hyperparams", found=type(given).__name__
        )
    for name, value in given.items():
        if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.shape == ()):
            value = value.item()
        if name in found:
            sv, dt, where = found[name]
            try:
                same = np.asarray(value, dtype=dt)[()].item() == sv
            except (TypeError, ValueError, OverflowError):
                same = False
            if not same:
                raise MismatchError(
                    f"hyperparameter {name!r} given as {value!r}, but the state holds {sv!r}",
                    key_path=_where(where),
                    expected=sv,
                    found=value,
                )
            continue
        out[name] = value
    return out


def _check_counts(scan: _Scan) -> int | None:
    seen: list[tuple[Path, int]] = []
    for path, value in scan.counts:
        v = _scalar(value, path, "extract")
        if isinstance(v, bool) or not isinstance(v, int):
            raise MismatchError(
                "a step count must be an integer",
                key_path=_where(path),
                expected="int",
                found=describe_leaf(value),
            )
        if seen and v != seen[0][1]:
            first, count = seen[0]
            raise MismatchError(
                f"step counts disagree: {count} at {_where(first)!r}, {v} here",
                key_path=_where(path),
                expected=count,
                found=v,
            )
        seen.append((path, v))
    return seen[0][1] if seen else None


def extract(
    opt_state: Any,
    params: Any,
    *,
    order: Sequence[Any] | None = None,
    hyperparams: Mapping[str, Any] | None = None,
) -> OptState:
    """The `OptState` of an optax optimizer state.

    Args:
      opt_state: what ``optimizer.init``/``update`` returned (concrete arrays).
      params: the parameters (or any tree of their structure, e.g. from
        ``jax.eval_shape``); only its key paths are used.
      order: key paths into ``params`` giving the parameter order of the slot
        lists (a permutation of all parameters); default `default_order`.
      hyperparams: hyperparameters the state does not show (``optax.adam(lr)``
        keeps none; ``inject_hyperparams`` the numeric ones, which must agree
        after rounding to their dtype).  ``nesterov`` is consumed: with a
        ``TraceState`` it makes the kind ``"nesterov"``.

    Raises `MismatchError` for states that cannot be mapped (see the
    module docstring), slot trees that do not match ``params``, disagreeing
    step counts and contradictory hyperparameters.
    """
    scan = _Scan()
    _scan(opt_state, (), None, scan)
    kind, trees, flags = _core_of(scan, "extract")
    keys = _resolve_order(order, params, "extract")
    hp = _merge_hyperparams(scan, hyperparams)
    count = _check_counts(scan)

    def refuse(name: str, why: str, expected: Any = None) -> MismatchError:
        return MismatchError(
            f"hyperparameter {name!r}{why}",
            key_path=f"hyperparams/{name}",
            expected=expected,
            found=hp.get(name),
        )

    for name, value in flags.items():
        if name in hp and bool(hp[name]) != value:
            raise refuse(name, f"={hp[name]!r} contradicts the state", value)
        hp[name] = value
    if kind == "rmsprop":
        for name in ("centered", "bias_correction"):
            if hp.get(name) and name not in flags:
                raise refuse(name, " is set but the rmsprop state lacks it", False)
        if hp.get("momentum") is not None and "trace" not in trees:
            raise refuse("momentum", " is set but the rmsprop state has no TraceState")
    if kind == "momentum":
        if hp.pop("nesterov", False):
            kind = "nesterov"
    elif kind == "sgd":
        if hp.get("momentum") is not None or hp.get("nesterov"):
            raise refuse("momentum", " is set but the state has no TraceState (plain sgd)")
        hp.pop("nesterov", None)
        hp.pop("momentum", None)
    if kind == "adam" and "weight_decay" in hp:
        raise refuse(
            "weight_decay",
            " is set but the state has no decoupled weight decay step after ScaleByAdamState "
            "(optax.adamw)",
        )

    slots = {name: _slot_list(tree, path, keys) for name, (path, tree) in trees.items()}
    return OptState(kind=kind, hyperparams=hp, count=count, slots=slots)


# --- rebuild ---


def _hyper_value(value: Any, like: Any, path: Path) -> Any:
    """A hyperparameter into ``like``'s leaf, rounded to its dtype as inject_hyperparams does."""
    scalar = is_array_leaf(like) and tuple(like.shape) == ()
    if isinstance(like, bool) or not (scalar or isinstance(like, int | float)):
        raise MismatchError(
            "`like` holds no scalar for this hyperparameter",
            key_path=_where(path),
            expected="a 0-d array or ShapeDtypeStruct",
            found=describe_leaf(like),
        )
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.shape == ()):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MismatchError(
            "hyperparameter is not a number",
            key_path=_where(path),
            expected=describe_leaf(like),
            found=type(value).__name__,
        )
    if not scalar or np.dtype(like.dtype).kind != "f":
        return restore(value, like, path=path)  # ints: exact values only
    dtype = np.dtype(like.dtype)
    try:
        with np.errstate(over="ignore"):
            arr = np.asarray(value, dtype=dtype)
        overflow = bool(np.isinf(arr)) and not np.isinf(value)
    except (OverflowError, ValueError, TypeError):
        overflow = True
    if overflow:
        raise MismatchError(
            f"hyperparameter {value!r} overflows {dtype}",
            key_path=_where(path),
            expected=describe_leaf(like),
            found=value,
        )
    return restore(arr, like, path=path)


class _Filler:
    """Rebuilds ``like`` with the values of an `OptState`."""

    def __init__(self, opt: OptState, keys: list[KeyPath]) -> None:
        self.opt = opt
        self.index = {k: i for i, k in enumerate(keys)}
        self.n = len(keys)

    def count(self, like: Any, path: Path) -> Any:
        if not is_array_leaf(like):
            raise MismatchError(
                "`like` holds no array for the step count",
                key_path=_where(path),
                expected="a 0-d integer array or ShapeDtypeStruct",
                found=describe_leaf(like),
            )
        return restore(self.opt.count, like, path=path)

    def slot(self, name: str, like: Any, path: Path) -> Any:
        import jax

        values = self.opt.slots[name]
        pairs, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=_is_masked_node)
        out = []
        seen = set()
        for p, leaf in pairs:
            key = tuple(_entry_key(e) for e in p)
            where = (*path, *(_entry_component(e) for e in p))
            i = self.index.get(key)
            if i is None:
                raise MismatchError(
                    f"`like`'s {name} has an entry that is not a parameter",
                    key_path=_where(where),
                    expected="a parameter path",
                    found=describe_leaf(leaf),
                )
            seen.add(key)
            value = values[i]
            if _is_masked_node(leaf):
                if value is not None:
                    raise MismatchError(
                        "masked out in `like`, but the file holds an array here",
                        key_path=_where(where),
                        expected="MaskedNode",
                        found=describe_leaf(value),
                    )
                out.append(leaf)
                continue
            if value is None:
                raise MismatchError(
                    "the file holds no value here (masked out when it was saved)",
                    key_path=_where(where),
                    expected=describe_leaf(leaf),
                    found="None",
                )
            out.append(restore(value, leaf, path=where))
        if len(seen) != self.n:
            missing = next(k for k in self.index if k not in seen)
            raise MismatchError(
                f"`like`'s {name} lacks parameter {missing!r}",
                key_path=_where(path),
                expected=missing,
                found="nothing",
            )
        return jax.tree_util.tree_unflatten(treedef, out)

    def fill(self, node: Any, path: Path) -> Any:
        if is_namedtuple(node):
            spec = _core_spec(node)
            if spec is not None:
                new = {f: self.slot(f, getattr(node, f), (*path, f)) for f in spec[1]}
                if spec[2]:
                    new["count"] = self.count(node.count, (*path, "count"))
                return node._replace(**new)
            if _is_inject(node):
                hp_path = (*path, "hyperparams")
                hps = {}
                for name, leaf in node.hyperparams.items():
                    if name not in self.opt.hyperparams:
                        raise MismatchError(
                            f"the file has no value for hyperparameter {name!r}",
                            key_path=_where((*hp_path, name)),
                            expected=describe_leaf(leaf),
                            found="nothing",
                        )
                    hps[name] = _hyper_value(self.opt.hyperparams[name], leaf, (*hp_path, name))
                new = {
                    "count": self.count(node.count, (*path, "count")),
                    "hyperparams": _like_mapping(node.hyperparams, hps),
                    "inner_state": self.fill(node.inner_state, (*path, "inner_state")),
                }
                states = getattr(node, "hyperparams_states", None)
                if isinstance(states, Mapping):
                    new["hyperparams_states"] = {
                        k: self.fill(s, (*path, "hyperparams_states", k)) for k, s in states.items()
                    }
                return node._replace(**new)
            if _is_masked(node):
                return node._replace(
                    inner_state=self.fill(node.inner_state, (*path, "inner_state"))
                )
            if _is_count_only(node):
                return node._replace(count=self.count(node.count, (*path, "count")))
            return node  # stateless (checked by _scan before filling)
        assert isinstance(node, tuple | list)  # anything else fails _scan first
        return type(node)(self.fill(c, (*path, ("[", i))) for i, c in enumerate(node))


def _like_mapping(like: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """``values`` as the mapping type of ``like`` (a plain dict where that type cannot be built)."""
    try:
        return type(like)(values)  # type: ignore[call-arg]
    except Exception:
        return values


def _check_opt(opt: Any) -> OptState:
    if not isinstance(opt, OptState) or opt.kind not in KINDS:
        raise MismatchError(
            "rebuild takes an OptState of a known kind",
            key_path="kind",
            expected=KINDS,
            found=getattr(opt, "kind", type(opt).__name__),
        )
    count, slots = opt.count, opt.slots
    for name, want, bad in (
        ("hyperparams", "a mapping", not isinstance(opt.hyperparams, Mapping)),
        (
            "count",
            "an int or None",
            count is not None
            and (isinstance(count, bool | np.bool_) or not isinstance(count, int | np.integer)),
        ),
        (
            "slots",
            "a mapping of lists of arrays",
            not isinstance(slots, Mapping)
            or any(
                isinstance(v, str | bytes) or not isinstance(v, Sequence) for v in slots.values()
            ),
        ),
    ):
        if bad:
            raise MismatchError(
                f"{name} must be {want}", key_path=name, found=type(getattr(opt, name)).__name__
            )
    return opt if count is None else replace(opt, count=int(count))


# kinds whose optax states hold the same data (the update rule is `like`'s to choose)
_LAYOUT = {"nesterov": "momentum", "adamw": "adam"}


def rebuild(
    opt: OptState, like: Any, params_like: Any, *, order: Sequence[Any] | None = None
) -> Any:
    """The optax state ``like`` describes, filled from ``opt``.

    Args:
      opt: the optimizer state to restore.
      like: the optax state to rebuild, typically ``jax.eval_shape(optimizer.init,
        params)`` (``ShapeDtypeStruct`` leaves) or a real state.  Its structure is
        kept exactly; leaves come back as its kind (jax arrays for jax arrays and
        ``ShapeDtypeStruct``, on their sharding; numpy for numpy).
      params_like: the parameters (or their ``eval_shape``); only key paths used.
      order: as in `extract`, for the slot lists of ``opt``.

    Every step count in ``like`` is set to ``opt.count``; injected
    hyperparameters are set from ``opt.hyperparams`` (each must be there;
    rounded to the state's dtype as ``inject_hyperparams`` rounds them).  Slot
    arrays must match ``like``'s shape and dtype exactly (nothing is cast).

    Raises `MismatchError` naming the key path for everything ``opt``
    cannot fill or ``like`` cannot hold: another layout, missing or extra
    slots, masked entries that differ, a step count on one side only, state
    parts pytreeio does not map, and leaves that are not arrays.
    """
    opt = _check_opt(opt)
    scan = _Scan()
    _scan(like, (), None, scan)
    kind, trees, _ = _core_of(scan, "like")
    if _LAYOUT.get(kind, kind) != _LAYOUT.get(opt.kind, opt.kind):
        raise MismatchError(
            f"the file holds an optimizer state of kind {opt.kind!r}, `like` one of kind "
            f"{kind!r} ({describe(like)})",
            key_path=_where(next(iter(trees.values()))[0][:-1]) if trees else "",
            expected=kind,
            found=opt.kind,
        )
    missing = [n for n in trees if n not in opt.slots]
    if missing:
        raise MismatchError(
            f"the file has no {missing[0]!r} slot for this {kind} state",
            key_path=_where(trees[missing[0]][0]),
            expected=sorted(trees),
            found=sorted(opt.slots),
        )
    extra = [n for n in opt.slots if n not in trees]
    if extra:
        raise MismatchError(
            f"`like` has no place for the file's {extra[0]!r} slot ({describe(like)})",
            key_path=f"slots/{extra[0]}",
            expected=sorted(trees),
            found=sorted(opt.slots),
        )
    if scan.counts and opt.count is None:
        raise MismatchError(
            "`like` has a step count but the file holds none",
            key_path=_where(scan.counts[0][0]),
            expected=describe_leaf(scan.counts[0][1]),
            found="None",
        )
    if not scan.counts and opt.count is not None:
        raise MismatchError(
            f"the file holds step count {opt.count}, which `like` has no place for "
            f"({describe(like)})",
            key_path="count",
            expected="None",
            found=opt.count,
        )
    keys = _resolve_order(order, params_like, "rebuild")
    for name in trees:
        if len(opt.slots[name]) != len(keys):
            raise MismatchError(
                f"the file's {name!r} slot has {len(opt.slots[name])} entries for "
                f"{len(keys)} parameters",
                key_path=f"slots/{name}",
                expected=len(keys),
                found=len(opt.slots[name]),
            )
    return _Filler(opt, keys).fill(like, ())


# --- build ---

_FACTORY = {"momentum": "sgd", "nesterov": "sgd"}  # the others: the optax function of that name
_STATIC = ("mask", "mu_dtype", "accumulator_dtype")


def build(kind: str, hyperparams: Mapping[str, Any] | None = None) -> Any:
    """The stock optax optimizer of ``kind`` with ``hyperparams``, under ``inject_hyperparams``.

    ``momentum``/``nesterov`` are ``optax.sgd(lr, momentum, nesterov=...)``, the
    others the optax function of that name, taking its argument names
    (``learning_rate``, and ``momentum`` for momentum/nesterov, are required).
    ``inject_hyperparams`` keeps the numeric hyperparameters in the state (as
    arrays of the params' dtype, so `extract` reads them back; flags are
    static): updates equal the unwrapped optimizer's up to that rounding.

    Raises `MismatchError` for an unknown kind, an unknown or missing
    hyperparameter, or one that contradicts the kind (momentum for ``sgd``).
    """
    import optax

    if not isinstance(kind, str) or kind not in KINDS:
        raise MismatchError(
            f"unknown optimizer kind {kind!r}", key_path="kind", expected=KINDS, found=kind
        )
    factory: Callable[..., Any] = getattr(optax, _FACTORY.get(kind, kind))
    params = inspect.signature(factory).parameters
    if hyperparams is not None and not isinstance(hyperparams, Mapping):
        raise MismatchError(
            "hyperparams must be a mapping",
            key_path="hyperparams",
            found=type(hyperparams).__name__,
        )

    def missing(name: str) -> MismatchError:
        return MismatchError(
            f"{kind}: missing hyperparameter {name!r}",
            key_path=f"hyperparams/{name}",
            expected="a number",
            found="nothing",
        )

    hp: dict[str, Any] = {}
    for name, value in (hyperparams or {}).items():
        if not isinstance(name, str) or name not in params:
            raise MismatchError(
                f"{kind}: unknown hyperparameter {name!r}",
                key_path=f"hyperparams/{name}",
                expected=sorted(params),
                found=name,
            )
        if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.shape == ()):
            value = value.item()
        hp[name] = value
    if kind in ("sgd", "momentum", "nesterov"):
        nesterov = hp.pop("nesterov", None)
        if kind == "sgd":
            if hp.get("momentum") is not None or nesterov:
                raise MismatchError(
                    "sgd: momentum given; use kind 'momentum' or 'nesterov'",
                    key_path="hyperparams/momentum",
                    expected=None,
                    found=hp.get("momentum", nesterov),
                )
            hp.pop("momentum", None)
        else:
            if hp.get("momentum") is None:
                raise missing("momentum")
            if nesterov is not None and bool(nesterov) != (kind == "nesterov"):
                raise MismatchError(
                    f"{kind}: nesterov={nesterov!r} contradicts the kind",
                    key_path="hyperparams/nesterov",
                    expected=kind == "nesterov",
                    found=nesterov,
                )
            hp["nesterov"] = kind == "nesterov"
    for name, p in params.items():
        if (
            p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            and name not in hp
        ):
            raise missing(name)
    static = [n for n, v in hp.items() if n in _STATIC or isinstance(v, bool)]
    return optax.inject_hyperparams(factory, static_args=static)(**hp)


# --- describe ---


def describe(opt_state: Any, _depth: int = 0) -> str:
    """A one-line sketch of an optax state's structure, for messages.

    ``(EmptyState, (ScaleByAdamState(count, mu[4], nu[4]), EmptyState))``:
    state types, their fields, and the number of leaves of params-shaped fields.
    """
    if _depth > 20:
        return "..."
    if is_namedtuple(opt_state):
        name = type(opt_state).__name__
        fields = _fields(opt_state)
        if not fields:
            return name
        parts = []
        for f in fields:
            v = getattr(opt_state, f)
            if f in ("inner_state",):
                parts.append(describe(v, _depth + 1))
            elif f == "hyperparams_states" and isinstance(v, Mapping):
                if v:
                    inner = ", ".join(f"{k}: {describe(s, _depth + 1)}" for k, s in v.items())
                    parts.append(f"{{{inner}}}")
            elif f == "hyperparams" and isinstance(v, Mapping):
                parts.append("hyperparams[" + ", ".join(map(str, v)) + "]")
            elif is_array_leaf(v):
                parts.append(f)
            else:
                parts.append(f"{f}[{_count_leaves(v)}]")
        return f"{name}({', '.join(parts)})"
    if isinstance(opt_state, tuple | list):
        inner = ", ".join(describe(s, _depth + 1) for s in opt_state)
        return f"({inner})" if isinstance(opt_state, tuple) else f"[{inner}]"
    return describe_leaf(opt_state)


def _count_leaves(tree: Any) -> int | str:
    try:
        return len(_flat_with_paths(tree))
    except Exception:
        return "?"


# --- JSON helpers shared by formats that keep optimizer state as JSON numbers ---


def _nested_shape(value: Any, where: str) -> tuple[int, ...]:
    """The shape of a nested list of numbers (or of equally shaped numeric arrays, the rows a
    JSON parser made), checked level by level before any array is built: handed to numpy,
    one string among the numbers would make an array of fixed-width strings, numbers x the
    string's length x 4 bytes (gigabytes from a file of kilobytes)."""
    shape: list[int] = []
    level = [value]
    while level:
        first = level[0]
        if all(type(v) is list for v in level):
            n = len(first)
            if any(len(v) != n for v in level):
                raise FormatError(f"{where}: not a rectangular list of numbers", field=where)
            shape.append(n)
            level = [x for v in level for x in v]
        elif all(isinstance(v, np.ndarray) for v in level):
            if any(v.dtype.kind not in "fiu" for v in level):
                bad = next(v.dtype for v in level if v.dtype.kind not in "fiu")
                raise FormatError(f"{where}: expected numbers, found {bad} values", field=where)
            if any(v.shape != first.shape for v in level):
                raise FormatError(f"{where}: not a rectangular list of numbers", field=where)
            return (*shape, *first.shape)
        else:
            for v in level:
                if not _is_number(v):
                    found = "lists and numbers mixed" if type(v) is list else describe_leaf(v)
                    raise FormatError(f"{where}: expected numbers, found {found}", field=where)
            return tuple(shape)
    return tuple(shape)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool | np.bool_):
        return False
    return isinstance(v, int | float | np.integer | np.floating)


def nested_to_array(value: Any, shape: Sequence[int], where: str) -> np.ndarray:
    """A JSON nested list of numbers as a float64 array of ``shape`` (strictly checked, its
    values' types before any array is built)."""
    found = _nested_shape(value, where)
    if found != tuple(shape):
        raise MismatchError(
            f"{where}: shape differs", key_path=where, expected=tuple(shape), found=found
        )
    try:
        arr = np.array(value)
    except (ValueError, TypeError, OverflowError) as exc:
        raise FormatError(
            f"{where}: not a rectangular list of numbers ({exc})", field=where
        ) from None
    if arr.dtype.kind not in "fiu":  # integers beyond int64 make an object array
        raise FormatError(f"{where}: expected numbers, found {arr.dtype} values", field=where)
    return arr.astype(np.float64)


def json_ready(value: Any) -> Any:
    """``value`` with numpy/jax arrays and scalars turned into JSON lists and numbers."""
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, np.ndarray | np.generic | Streamed) or type(value).__module__.startswith(
        ("jax", "jaxlib")
    ):
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise MismatchError(
                f"cannot write a {arr.dtype} array as JSON numbers", key_path="optim_state"
            )
        return arr.tolist()
    return value
