"""The whole-tree fast path of :func:`pytreeio.tree.restore` for plain dict trees.

``load(path, like=state)`` of the same model is the common restore: the
decoded tree and ``like`` are nested str-keyed dicts in the same key order,
with numpy leaves of the same shapes and dtypes.  The decoded tree is then
exactly what the general walk would build, so it is returned as it is.  When
``like``'s leaves are jax arrays or ``jax.ShapeDtypeStruct``\\ s instead, the
result is the same nesting with every leaf moved to its template's sharding,
and all the leaves go to jax in one batched ``jax.device_put``: the general
walk's per-leaf calls cost about twice as much (each ``device_put`` call has a
fixed dispatch cost).

The check costs well under the general walk (which builds every container and
key path): both trees' structures are compared as one string each, written by
``orjson`` (optional) with the leaves collected in order by its ``default``
hook, and the leaves are compared in bulk.  Where the strings differ only in
the order of each dict's keys (their key-sorted strings are equal: a template
made by ``jax.tree_util.tree_map`` or ``jax.eval_shape`` lists every dict's
keys sorted, the file the saved tree's order), the leaves are paired by key in
``like``'s order and the result is built in that order, as the general walk
builds it.  Anything else (other containers,
``None``, scalars, typed PRNG keys, a single difference, a failing transfer)
is left to the general walk, which restores it and words any error.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import numpy as np

__all__ = [
    "same_plain_tree",
    "fast_restore",
    "host_only",
    "orjson_dumps",
    "fill_like",
    "jax_template_kinds",
    "placed",
    "dicts_only",
]

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_SHARDING = operator.attrgetter("sharding")

_DUMPS: list[Any] = []  # [orjson.dumps or None, its options], looked up on first use


def orjson_dumps() -> list[Any]:
    """``[orjson.dumps, its options]`` for structure texts (leaves to ``default``), or
    ``[None, 0]`` without orjson."""
    if not _DUMPS:
        try:
            import orjson
        except ImportError:
            _DUMPS.extend((None, 0))
        else:
            # Subclasses of dict/str/int/list, dataclasses (flax struct nodes) and datetimes
            # go to `default` (so become leaves, which the leaf check refuses) instead of being
            # written like the builtin they resemble.
            opts = (
                orjson.OPT_PASSTHROUGH_SUBCLASS
                | orjson.OPT_PASSTHROUGH_DATACLASS
                | orjson.OPT_PASSTHROUGH_DATETIME
            )
            _DUMPS.extend((orjson.dumps, opts))
    return _DUMPS


def same_plain_tree(native: dict[Any, Any], like: dict[Any, Any]) -> bool:
    """Whether restoring ``native`` into ``like`` would rebuild ``native`` itself.

    True only for nested plain dicts with ``str`` keys, in the same order on
    both sides, whose leaves are all ``numpy.ndarray`` (exactly; not
    subclasses, scalars or ``None``) with equal shapes and dtypes.
    """
    leaves = _plain_leaves(native, like)
    if leaves is None:
        return False
    native_leaves, like_leaves = leaves
    kinds = {*map(type, like_leaves), *map(type, native_leaves)}
    return (not kinds or kinds == {np.ndarray}) and _same_specs(native_leaves, like_leaves)


def fast_restore(native: dict[Any, Any], like: dict[Any, Any], convert: bool) -> Any:
    """What :func:`pytreeio.tree.restore` returns for a plain dict tree, or None: not one.

    ``native`` itself where :func:`same_plain_tree` holds.  Where ``like``'s
    leaves are also jax arrays or ``jax.ShapeDtypeStruct``\\ s (not typed PRNG
    keys) of the native leaves' shapes and dtypes: ``like``'s nesting of the
    native arrays, each put where the general walk puts it
    (``jax.device_put(leaf, template.sharding)``: committed to a template
    array's sharding, uncommitted on the default device for a
    ``ShapeDtypeStruct`` without one), or the native arrays as they are when
    ``convert`` is false.  None sends the tree to the general walk, which also
    words every error.
    """
    leaves = _plain_leaves(native, like)
    reordered = False
    if leaves is None:
        # The same nesting with keys in another order (a template made by jax.tree_util.tree_map
        # or jax.eval_shape has each dict's keys sorted; the file keeps the saved tree's order).
        leaves = _reordered_leaves(native, like)
        if leaves is None:
            return None
        reordered = True
    native_leaves, like_leaves = leaves
    if {*map(type, native_leaves)} - {np.ndarray}:
        return None
    jax_kinds = {*map(type, like_leaves)} - {np.ndarray}
    if jax_kinds and not jax_template_kinds(jax_kinds):
        return None
    if not _same_specs(native_leaves, like_leaves):
        return None
    if not jax_kinds or not convert:
        return fill_like(like, iter(native_leaves)) if reordered else native
    # numpy dtypes only: a typed PRNG key's dtype is jax's own (the general walk wraps those)
    if not all(isinstance(dt, np.dtype) for dt in {*map(_DTYPE, like_leaves)}):
        return None
    done = placed(native_leaves, like_leaves)
    if done is None:
        return None
    return fill_like(like, iter(done))


def host_only(tree: Any) -> bool:
    """Whether ``tree`` surely holds no jax array; False: it may (or is not known).

    True when the containers are those ``orjson`` writes itself (plain dicts
    with str keys, lists, tuples) and every leaf a ``numpy.ndarray`` (exactly)
    or what ``orjson`` writes (Python scalars, strings, ``None``); anything
    else (jax arrays, dataclasses, other pytree nodes, subclasses) says False.
    Such a tree places nothing on devices; the check costs a tenth of jax's
    own flatten.
    """
    dumps, opts = orjson_dumps()
    if dumps is None:
        return False
    leaves: list[Any] = []
    try:
        dumps(tree, default=leaves.append, option=opts)
    except (TypeError, ValueError):  # non-str keys, nesting beyond orjson's limit, ...
        return False
    return {*map(type, leaves)} <= {np.ndarray}


def _plain_leaves(
    native: dict[Any, Any], like: dict[Any, Any]
) -> tuple[list[Any], list[Any]] | None:
    """Both trees' leaves in order, where both are the same nesting of str-keyed dicts."""
    like_leaves: list[Any] = []
    native_leaves: list[Any] = []
    dumps, opts = orjson_dumps()
    if dumps is not None:
        try:
            text = dumps(like, default=like_leaves.append, option=opts)
            if text != dumps(native, default=native_leaves.append, option=opts):
                return None
        except (TypeError, ValueError):  # non-str keys, nesting beyond orjson's limit, ...
            return None
        if not dicts_only(text, like_leaves):
            return None
    else:
        try:
            if not _collect(native, like, native_leaves, like_leaves):
                return None
        except RecursionError:  # the general walk reports what it finds that deep
            return None
    if len(native_leaves) != len(like_leaves):  # a None of `native` where `like` has a leaf
        return None
    return native_leaves, like_leaves


def dicts_only(text: bytes, leaves: list[Any]) -> bool:
    """Whether an orjson ``text`` (leaves written as ``null``) is nested objects whose members
    are objects or the collected ``leaves``.

    Each ':' must be followed by '{' or 'null', and the nulls must be exactly the
    leaves: no None, NaN (also null), scalar or list.  A key holding ':null' or ':{'
    only adds to both sides of a count and can only make it fail.
    """
    nulls = text.count(b":null")
    return nulls == len(leaves) and text.count(b":") == nulls + text.count(b":{")


def _reordered_leaves(
    native: dict[Any, Any], like: dict[Any, Any]
) -> tuple[list[Any], list[Any]] | None:
    """Both trees' leaves in ``like``'s order, where they are the same nesting of str-keyed
    dicts up to the order of each dict's keys (their key-sorted texts are equal)."""
    dumps, opts = orjson_dumps()
    if dumps is None:
        return None
    import orjson

    like_leaves: list[Any] = []
    try:
        text = dumps(like, default=like_leaves.append, option=opts | orjson.OPT_SORT_KEYS)
        if text != dumps(native, default=_ignored, option=opts | orjson.OPT_SORT_KEYS):
            return None
    except (TypeError, ValueError):
        return None
    if not dicts_only(text, like_leaves):
        return None
    native_leaves: list[Any] = []
    like_leaves = []
    _by_key(native, like, native_leaves, like_leaves)
    return native_leaves, like_leaves


def _ignored(leaf: Any) -> None:
    return None


def _by_key(native: dict[Any, Any], like: dict[Any, Any], nl: list[Any], ll: list[Any]) -> None:
    """Leaves in ``like``'s order, each with the native leaf under the same keys (the sorted
    texts were equal: every key is there, every dict opposite a dict)."""
    for k, lv in like.items():
        if type(lv) is dict:
            _by_key(native[k], lv, nl, ll)
        else:
            ll.append(lv)
            nl.append(native[k])


def _same_specs(native_leaves: list[Any], like_leaves: list[Any]) -> bool:
    return list(map(_SHAPE, like_leaves)) == list(map(_SHAPE, native_leaves)) and list(
        map(_DTYPE, like_leaves)
    ) == list(map(_DTYPE, native_leaves))


def jax_template_kinds(kinds: set[type]) -> bool:
    """Whether every template leaf type is a concrete jax array or ``jax.ShapeDtypeStruct``.

    (Tracers are jax arrays too: the general walk sees to those.)  jax is loaded
    whenever a template holds one of them: nothing else can make them.
    """
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    for kind in kinds:
        if kind is not jax.ShapeDtypeStruct and (
            not issubclass(kind, jax.Array) or issubclass(kind, jax.core.Tracer)
        ):
            return False
    return True


def placed(native_leaves: list[Any], like_leaves: list[Any]) -> list[Any] | None:
    """Each native leaf as the kind its template is, the jax ones in batched transfers.

    None when a transfer fails: the general walk then fails at that leaf's key.
    """
    import jax

    out = list(native_leaves)
    ndarray = np.ndarray
    on_default: list[int] = []  # templates without a sharding: jax's default device
    placed: list[int] = []
    shardings: list[Any] = []
    for i, lv in enumerate(like_leaves):
        if type(lv) is ndarray:
            continue
        sharding = getattr(lv, "sharding", None)
        if sharding is None:
            on_default.append(i)
        else:
            placed.append(i)
            shardings.append(sharding)
    try:
        # One call per group: a None inside a list of shardings would read as an empty subtree.
        if placed:
            moved = jax.device_put([native_leaves[i] for i in placed], shardings)
            for i, arr in zip(placed, moved, strict=True):
                out[i] = arr
        if on_default:
            moved = jax.device_put([native_leaves[i] for i in on_default])
            for i, arr in zip(on_default, moved, strict=True):
                out[i] = arr
    except Exception:
        return None
    return out


def fill_like(like: dict[str, Any], leaves: Any) -> dict[str, Any]:
    """``like``'s nesting of dicts (its key order) with the next of ``leaves`` at each leaf."""
    return {k: fill_like(v, leaves) if type(v) is dict else next(leaves) for k, v in like.items()}


def _collect(native: dict[Any, Any], like: dict[Any, Any], nl: list[Any], ll: list[Any]) -> bool:
    """The structure check without ``orjson``: same str keys in the same order, dicts alike."""
    if list(native) != list(like):
        return False
    for k, lv in like.items():
        if type(k) is not str:
            return False
        nv = native[k]
        if type(lv) is dict:
            if type(nv) is not dict or not _collect(nv, lv, nl, ll):
                return False
        else:
            ll.append(lv)
            nl.append(nv)
    return True
