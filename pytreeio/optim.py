"""optax optimizer states <-> the optimizer conventions of checkpoint formats.

netcl (``netcl.optim``), in netcl parameter order ``p0, p1, ...``::

    AdamW / Adam   {"t": int, "moments": [[m0, v0], [m1, v1], ...]}
    SGD            {"velocity": [v0, v1, ...]}

``m``/``v`` are optax ``ScaleByAdamState.mu``/``nu`` and ``t`` its ``count``;
``velocity`` is ``TraceState.trace`` (optax's ``trace`` accumulates
``g + momentum * v`` exactly like netcl's SGD).  In JSON the arrays are
nested lists of Python floats: a float32 widened to float64 prints and parses
back exactly, so the round trip is lossless.

Other states in an optax chain must be empty (``EmptyState``) or carry only a
step ``count`` (``ScaleByScheduleState``), which equals ``t``; anything else
cannot be expressed in netcl's state and is refused rather than dropped.

jax and optax are imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import FormatError, MismatchError
from .tree import is_namedtuple, restore

__all__ = ["to_netcl", "from_netcl", "json_ready", "nested_to_array"]

Flatten = Callable[[Any], list[Any]]
Unflatten = Callable[[list[np.ndarray], Any, str], Any]


def _leaves(tree: Any) -> list[Any]:
    import jax

    return list(jax.tree_util.tree_leaves(tree))


def _default_flatten(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in _leaves(tree)]


def _default_unflatten(arrays: list[np.ndarray], like: Any, what: str) -> Any:
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(like)
    if len(leaves) != len(arrays):
        raise MismatchError(
            f"{what}: the checkpoint has {len(arrays)} tensors, the optimizer state {len(leaves)}",
            key_path=what,
            expected=len(leaves),
            found=len(arrays),
        )
    out = [
        restore(np.asarray(a, dtype=np.dtype(leaf.dtype)), leaf, path=(what, i))
        for i, (a, leaf) in enumerate(zip(arrays, leaves))
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def _walk(state: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every NamedTuple state in an optax (possibly nested) chain, with its position."""
    if is_namedtuple(state):
        return [(path, state)]
    if isinstance(state, tuple | list):
        out = []
        for i, s in enumerate(state):
            out.extend(_walk(s, (*path, i)))
        return out
    raise MismatchError(
        f"not an optax state: {type(state).__name__}",
        key_path="/".join(map(str, path)) or "optim_state",
    )


def _kind(s: Any) -> str:
    import optax

    if isinstance(s, optax.ScaleByAdamState):
        return "adam"
    if isinstance(s, optax.TraceState):
        return "trace"
    if not _leaves(s):
        return "empty"
    if set(s._fields) == {"count"}:
        return "count"
    return "other"


def _classify(opt_state: Any) -> tuple[str, list[tuple[tuple[Any, ...], Any, str]]]:
    parts = [(p, s, _kind(s)) for p, s in _walk(opt_state)]
    kinds = [k for _, _, k in parts]
    others = [f"{type(s).__name__} at {p}" for p, s, k in parts if k == "other"]
    if others:
        raise MismatchError(
            f"optimizer state parts netcl cannot hold: {', '.join(others)}", key_path="optim_state"
        )
    if kinds.count("adam") == 1 and "trace" not in kinds:
        return "adam", parts
    if kinds.count("trace") == 1 and "adam" not in kinds and "count" not in kinds:
        return "sgd", parts
    raise MismatchError(
        "netcl's optimizer state holds exactly one Adam/AdamW (ScaleByAdamState) or one "
        f"SGD-with-momentum (TraceState); this state has {kinds}",
        key_path="optim_state",
    )


def to_netcl(opt_state: Any, *, flatten: Flatten | None = None) -> dict[str, Any]:
    """netcl's optimizer state dict for an optax adam/adamw or sgd-with-momentum state.

    Args:
      opt_state: the optax state (the chain tuple as ``optimizer.init`` returns it).
      flatten: maps a params-shaped tree (``mu``, ``nu``, ``trace``) to its
        arrays in netcl parameter order and layout; default: jax leaf order.

    Returns ``{"t": int, "moments": [[m, v], ...]}`` or ``{"velocity": [...]}``
    with numpy arrays (see :func:`json_ready` for the JSON form).
    """
    flat = flatten or _default_flatten
    kind, parts = _classify(opt_state)
    if kind == "adam":
        (s,) = [s for _, s, k in parts if k == "adam"]
        ms = flat(s.mu)
        vs = flat(s.nu)
        return {
            "t": int(np.asarray(s.count)),
            "moments": [[np.asarray(m), np.asarray(v)] for m, v in zip(ms, vs)],
        }
    (s,) = [s for _, s, k in parts if k == "trace"]
    return {"velocity": [np.asarray(v) for v in flat(s.trace)]}


def nested_to_array(value: Any, shape: Sequence[int], where: str) -> np.ndarray:
    """A JSON nested list of numbers as a float64 array of ``shape`` (strictly checked)."""
    try:
        arr = np.array(value)
    except (ValueError, TypeError, OverflowError) as exc:
        raise FormatError(
            f"{where}: not a rectangular list of numbers ({exc})", field=where
        ) from None
    if arr.dtype.kind not in "fiu" or (arr.size == 0 and tuple(shape) != arr.shape):
        raise FormatError(f"{where}: expected numbers, found {arr.dtype} values", field=where)
    if arr.shape != tuple(shape):
        raise MismatchError(
            f"{where}: shape differs", key_path=where, expected=tuple(shape), found=arr.shape
        )
    return arr.astype(np.float64)


def _to_dtype(arr64: np.ndarray, dtype: Any, where: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported just below
        out = arr64.astype(dtype)
    back = out.astype(np.float64)
    if not np.array_equal(back, arr64, equal_nan=True):
        raise MismatchError(
            f"{where}: values are not exactly representable as {np.dtype(dtype)}; refusing to round",
            key_path=where,
        )
    return out


def _convert(values: Any, like_tree: Any, flatten: Flatten, what: str) -> list[np.ndarray]:
    """JSON lists (or arrays) as arrays shaped like ``flatten(like_tree)`` (netcl layout)."""
    likes = flatten(like_tree)
    if not isinstance(values, list | tuple) or len(values) != len(likes):
        n = len(values) if isinstance(values, list | tuple) else type(values).__name__
        raise MismatchError(
            f"{what}: the checkpoint has {n} tensors, the parameters {len(likes)}",
            key_path=what,
            expected=len(likes),
            found=n,
        )
    out = []
    for i, (v, lk) in enumerate(zip(values, likes)):
        where = f"{what}[{i}]"
        arr = v if isinstance(v, np.ndarray) else nested_to_array(v, tuple(lk.shape), where)
        if tuple(arr.shape) != tuple(lk.shape):
            raise MismatchError(
                f"{where}: shape differs", key_path=where, expected=tuple(lk.shape), found=arr.shape
            )
        out.append(_to_dtype(np.asarray(arr), lk.dtype, where))
    return out


def from_netcl(
    state: Mapping[str, Any],
    like: Any,
    *,
    flatten: Flatten | None = None,
    unflatten: Unflatten | None = None,
) -> Any:
    """The optax state ``like`` describes, filled from netcl's optimizer state dict.

    Args:
      state: ``{"t", "moments"}`` or ``{"velocity"}`` (JSON lists or arrays).
      like: the optax state to rebuild (arrays or ``jax.ShapeDtypeStruct``).
      flatten: as in :func:`to_netcl`, applied to ``like``'s params-shaped
        trees to learn each tensor's netcl shape and dtype.
      unflatten: ``unflatten(arrays, like_tree, what)`` turns arrays in netcl
        order and layout back into a tree like ``like_tree``.
    """
    import jax

    flat = flatten or _default_flatten
    unflat = unflatten or _default_unflatten
    if not isinstance(state, Mapping):
        raise FormatError(
            f"optim_state must be an object, found {type(state).__name__}", field="optim_state"
        )
    kind, parts = _classify(like)
    new: dict[tuple[Any, ...], Any] = {}
    if kind == "adam":
        missing = [k for k in ("t", "moments") if k not in state]
        if missing:
            raise MismatchError(
                f"optim_state lacks {missing} for an Adam/AdamW optimizer", key_path="optim_state"
            )
        t = state["t"]
        if type(t) is not int or t < 0:
            raise FormatError(
                f"optim_state.t must be a non-negative integer, found {t!r}", field="optim_state.t"
            )
        pairs = state["moments"]
        if not isinstance(pairs, list | tuple) or not all(
            isinstance(p, list | tuple) and len(p) == 2 for p in pairs
        ):
            raise FormatError(
                "optim_state.moments must be a list of [m, v] pairs", field="optim_state.moments"
            )
        for path, s, k in parts:
            if k == "adam":
                ms = _convert([p[0] for p in pairs], s.mu, flat, "optim_state.moments.m")
                vs = _convert([p[1] for p in pairs], s.nu, flat, "optim_state.moments.v")
                count = restore(
                    np.asarray(t, dtype=np.dtype(s.count.dtype)), s.count, path=("optim_state", "t")
                )
                new[path] = s._replace(
                    count=count, mu=unflat(ms, s.mu, "mu"), nu=unflat(vs, s.nu, "nu")
                )
            elif k == "count":
                new[path] = s._replace(
                    count=restore(np.asarray(t, dtype=np.dtype(s.count.dtype)), s.count)
                )
    else:
        if "velocity" not in state:
            raise MismatchError(
                "optim_state lacks 'velocity' for an SGD-with-momentum optimizer",
                key_path="optim_state",
            )
        for path, s, k in parts:
            if k == "trace":
                vs = _convert(state["velocity"], s.trace, flat, "optim_state.velocity")
                new[path] = s._replace(trace=unflat(vs, s.trace, "trace"))

    def rebuild(node: Any, path: tuple[Any, ...]) -> Any:
        if path in new:
            return new[path]
        if is_namedtuple(node):
            return node
        if isinstance(node, tuple | list):
            return type(node)(rebuild(c, (*path, i)) for i, c in enumerate(node))
        return node

    del jax
    return rebuild(like, ())


def json_ready(value: Any) -> Any:
    """``value`` with numpy/jax arrays and scalars turned into JSON lists and numbers."""
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, np.ndarray | np.generic) or type(value).__module__.startswith(
        ("jax", "jaxlib")
    ):
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise MismatchError(
                f"cannot write a {arr.dtype} array as JSON numbers", key_path="optim_state"
            )
        return arr.tolist()
    return value
