"""Kept conversions through the common model form: saves of, and loads into, Flax params trees.

A model format (netcl, DataCode, bullet, ...) maps a Flax params tree to its
native tree through the common :class:`~pytreeio.model.Model` form:
``load(path, like=params)`` runs the format's ``to_model`` (every layer
checked against its arrays), then ``Model.to_flax`` places each array in
``like``'s structure; ``save(path, params)`` runs ``model_of`` then the
format's ``from_model``.  A training run does the same mapping on every
checkpoint, about 2-4 µs a leaf each way.

The mapping's result depends on the format and the call's options and
documents (load options and meta; save options, ``layers``, ``meta`` and
``lossy``), on the structure of the source tree (the native tree of a load,
the params tree of a save) with its arrays' types, shapes, dtypes and
strides, on ``like``'s structure with its leaves' shapes and dtypes (a load)
and on whether the load is partial; of the arrays' values only where a check
reads them.  A mapping is kept (from the second call with equal inputs: a
one-off call pays only for the comparison) when it succeeded without a
warning and its result holds the source arrays themselves (or reshaped or
transposed views of them), every source array exactly once, and nothing else
but dicts and lists: then no value was turned into anything but itself.  A
later call whose inputs equal the kept one's in all of the above is that
result rebuilt around its own arrays.  Anything else (an optimizer state or
jax leaves, scalars, converted arrays, arrays left out, no ``orjson``) takes
the full path, which also words every error.

Structures are compared as ``orjson`` text, leaves written as ``null`` and
collected in order; a text whose ``null`` count differs from its leaves (a
``None`` or NaN in the tree) is not kept.  Plans hold shapes, names and
documents, never arrays, for trees of up to :data:`MAX_LEAVES` arrays.
"""

from __future__ import annotations

import io
import itertools
import operator
import pickle
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import warnings_made
from .layouts import Memo
from .plainkey import plain_key
from .restore_fast import dicts_only, orjson_dumps

__all__ = ["restore", "save"]

#: Plans are made for trees of at most this many arrays, whose texts and documents take at
#: most this many bytes: each plan stays within a few MB.
MAX_LEAVES = 1 << 14
MAX_KEY_BYTES = 2 << 20

_SOURCE_SPEC = operator.attrgetter("shape", "dtype", "strides")
_LIKE_SPEC = operator.attrgetter("shape", "dtype")

#: How a result's leaf is made of a source array (its index): as it is, reshaped, transposed.
_View = tuple[int, str, tuple[int, ...]]


@dataclass(frozen=True)
class _Inputs:
    """What a mapping's result depends on; ``key`` is the hashable part, the leaves' specs
    are compared apart (cheaper than hashing them)."""

    key: tuple[Any, ...]
    sources: list[Any]
    like: list[Any]
    like_text: bytes

    def specs(self) -> tuple[list[Any], list[Any]]:
        return list(map(_SOURCE_SPEC, self.sources)), list(map(_LIKE_SPEC, self.like))


def _structure(tree: Any) -> tuple[bytes, list[Any]] | None:
    """``tree``'s orjson text (leaves as ``null``) and its leaves in order, if all exact
    numpy arrays and no ``None``/NaN is in it; else None."""
    dumps, opts = orjson_dumps()
    if dumps is None:
        return None
    leaves: list[Any] = []
    try:
        text = dumps(tree, default=leaves.append, option=opts)
    except (TypeError, ValueError):  # non-str keys, nesting beyond orjson's limit, ...
        return None
    if text.count(b"null") != len(leaves) or {*map(type, leaves)} - {np.ndarray}:
        return None
    return text, leaves


def _inputs(
    kind: str, source: Any, like: Any, documents: tuple[Any, ...], fmt: Hashable
) -> _Inputs | None:
    """The inputs of a mapping of ``source`` (into ``like``'s structure, for a restore).

    The Flax side (``like`` of a restore, the params tree of a save) must be nested
    plain dicts of arrays; the other side any nesting of dicts and lists.
    """
    flax = source if like is None else like
    if type(flax) is not dict:
        return None
    like_text, like_leaves = b"", list[Any]()
    if like is not None:  # first: a template of jax arrays is refused before the file's tree
        found = _structure(like)
        if found is None:
            return None
        like_text, like_leaves = found
    found = _structure(source)
    if found is None:
        return None
    source_text, sources = found
    flax_text, flax_leaves = (source_text, sources) if like is None else (like_text, like_leaves)
    if not dicts_only(flax_text, flax_leaves):
        return None
    if len(sources) > MAX_LEAVES:
        return None
    keys = [k for k in map(plain_key, documents) if k is not None]
    size = len(source_text) + len(like_text) + sum(map(len, keys))
    if len(keys) != len(documents) or size > MAX_KEY_BYTES:
        return None
    key = (kind, fmt, *keys, source_text, like_text)
    return _Inputs(key, sources, like_leaves, like_text)


def _kept(key: tuple[Any, ...]) -> bool:
    """Whether a plan for ``key`` may be made now: its second successful call, not a first."""
    if _SEEN.pop(hash(key), None) is not None:
        return True
    _SEEN.keep(hash(key), True)
    return False


#: Hashes of keys mapped once: a plan is made by the second call of a key.
_SEEN: Memo[int, bool] = Memo(64)


# --------------------------------------------------------------------------
# loads into a Flax params tree
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _RestorePlan:
    specs: tuple[list[Any], list[Any]]
    #: the native array (and how it is viewed) of each of ``like``'s leaves, in order
    views: list[_View]
    #: the native arrays in ``like``'s leaf order, where every view is the array itself
    order: Callable[[list[Any]], Any] | None
    nesting: _Nest


#: Kept restores by ("restore", format, meta, options, partial, native text, like text).
_RESTORES: Memo[tuple[Any, ...], _RestorePlan] = Memo(8)


def restore(
    fmt: Hashable,
    native: Any,
    meta: Any,
    like: Any,
    options: Mapping[str, Any],
    partial: bool,
    full: Callable[[], Any],
) -> Any:
    """``full()`` (the restore through the common model form), or its kept equal.

    ``fmt`` is the format (its functions, not only its name: a format registered
    again is another); ``like`` must be a Flax params tree or variables dict (the
    caller checks).
    """
    inputs = _inputs("restore", native, like, (meta, dict(options), partial), fmt)
    if inputs is None:
        return full()
    plan = _RESTORES.get(inputs.key)
    if plan is not None and inputs.specs() == plan.specs:
        arrays = inputs.sources
        leaves = plan.order(arrays) if plan.order else _made(arrays, plan.views)
        return _built(plan.nesting, iter(leaves))
    warned = warnings_made()
    result = full()
    if warnings_made() != warned or not _kept(inputs.key):
        return result
    found = _structure(result)
    if found is not None and found[0] == inputs.like_text:
        views = _views(found[1], inputs.sources)
        if views is not None:
            _RESTORES.keep(inputs.key, _restore_plan(inputs, views, like))
    return result


def _restore_plan(inputs: _Inputs, views: list[_View], like: dict[str, Any]) -> _RestorePlan:
    order = None
    if all(how == "" for _, how, _ in views):
        js = [j for j, _, _ in views]  # a permutation of two or more (else it is the identity)
        order = _as_list if js == list(range(len(js))) else operator.itemgetter(*js)
    return _RestorePlan(inputs.specs(), views, order, _nesting(like))


def _as_list(leaves: list[Any]) -> list[Any]:
    return leaves


# ``like``'s nesting of dicts, to rebuild with other leaves: a dict of leaves alone is its
# keys; a dict of those (a params tree's modules) is its (key, keys) pairs; anything else
# its (key, nesting or None for a leaf) members.
_Nest = tuple[str, Any]


def _nesting(tree: dict[str, Any]) -> _Nest:
    inner = [type(v) is dict for v in tree.values()]
    if not any(inner):
        return "leaves", tuple(tree)
    if all(inner) and not any(type(x) is dict for v in tree.values() for x in v.values()):
        return "modules", [(k, tuple(v)) for k, v in tree.items()]
    return "mixed", [(k, _nesting(v) if type(v) is dict else None) for k, v in tree.items()]


def _built(nest: _Nest, leaves: Any) -> dict[str, Any]:
    """The nesting filled with the next of ``leaves`` at each leaf, in order."""
    kind, parts = nest
    if kind == "leaves":
        return dict(zip(parts, leaves))  # zip takes from `leaves` only while keys remain
    if kind == "modules":
        return {k: dict(zip(keys, leaves)) for k, keys in parts}
    return {k: next(leaves) if n is None else _built(n, leaves) for k, n in parts}


# --------------------------------------------------------------------------
# saves of a Flax params tree
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _SavePlan:
    specs: tuple[list[Any], list[Any]]
    #: the params array (and how it is viewed) of each of the native tree's leaves, in order
    views: list[_View]
    #: the native tree pickled, its leaves as persistent ids (their positions)
    native: bytes
    #: ``from_model``'s meta document, pickled (plain data: a fresh copy every time)
    meta: bytes


#: Kept saves by ("save", format, options, layers, meta, lossy, params text).
_SAVES: Memo[tuple[Any, ...], _SavePlan] = Memo(8)


def save(
    fmt: Hashable,
    params: Any,
    documents: tuple[Any, ...],
    full: Callable[[], tuple[Any, Any]],
) -> tuple[Any, Any]:
    """``full()`` (``(native, meta)`` of ``from_model(model_of(params))``), or its kept equal.

    ``fmt`` is the format; ``params`` must be a Flax params tree or variables dict (the caller checks);
    ``documents`` is everything else the mapping depends on, plain data.
    """
    inputs = _inputs("save", params, None, documents, fmt)
    if inputs is None:
        return full()
    plan = _SAVES.get(inputs.key)
    if plan is not None and inputs.specs() == plan.specs:
        leaves = _made(inputs.sources, plan.views)
        return _Unpickler(plan.native, leaves).load(), pickle.loads(plan.meta)
    warned = warnings_made()
    native, meta = full()
    if warnings_made() == warned and _kept(inputs.key):
        kept = _save_plan(inputs, native, meta)
        if kept is not None:
            _SAVES.keep(inputs.key, kept)
    return native, meta


def _save_plan(inputs: _Inputs, native: Any, meta: Any) -> _SavePlan | None:
    meta_bytes = plain_key(meta)
    if meta_bytes is None or not _containers_only(native):
        return None
    leaves: list[Any] = []
    buf = io.BytesIO()
    _LeafPickler(buf, leaves).dump(native)
    views = _views(leaves, inputs.sources)
    if views is None:
        return None
    return _SavePlan(inputs.specs(), views, buf.getvalue(), meta_bytes)


def _containers_only(tree: Any, depth: int = 0) -> bool:
    """Whether ``tree`` is dicts with str keys, lists and tuples of exact numpy arrays."""
    if type(tree) is np.ndarray:
        return True
    if depth > 64:
        return False
    if type(tree) is dict:
        return all(type(k) is str for k in tree) and all(
            _containers_only(v, depth + 1) for v in tree.values()
        )
    if type(tree) in (list, tuple):
        return all(_containers_only(v, depth + 1) for v in tree)
    return False


class _LeafPickler(pickle.Pickler):
    """Pickles a tree with its arrays as their positions in ``leaves`` (appended in order)."""

    def __init__(self, file: io.BytesIO, leaves: list[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.leaves = leaves

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is np.ndarray:
            self.leaves.append(obj)
            return len(self.leaves) - 1
        return None


class _Unpickler(pickle.Unpickler):
    """A :class:`_LeafPickler`'s tree with other arrays in the leaves' places."""

    def __init__(self, data: bytes, leaves: list[Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.leaves = leaves

    def persistent_load(self, pid: Any) -> Any:
        return self.leaves[pid]


# --------------------------------------------------------------------------
# results as views of the source arrays
# --------------------------------------------------------------------------


def _made(sources: list[Any], views: list[_View]) -> list[Any]:
    out = []
    for j, how, arg in views:
        a = sources[j]
        out.append(a if how == "" else a.reshape(arg) if how == "reshape" else a.transpose(arg))
    return out


def _views(leaves: list[Any], sources: list[Any]) -> list[_View] | None:
    """How each of ``leaves`` is made of a source array, each source array once; or None."""
    if len(leaves) != len(sources):
        return None
    by_id = {id(a): j for j, a in enumerate(sources)}
    by_data: dict[int, list[int]] = {}  # made when first needed: a view of a source array
    views: list[_View] = []
    for out in leaves:
        if type(out) is not np.ndarray:
            return None
        same = by_id.get(id(out))
        if same is None and not by_data:
            for j, a in enumerate(sources):
                by_data.setdefault(_address(a), []).append(j)
        view = (same, "", ()) if same is not None else _view_of(out, sources, by_data)
        if view is None:
            return None
        views.append(view)
    if len({j for j, _, _ in views}) != len(sources):
        return None
    return views


def _view_of(out: np.ndarray, sources: list[Any], by_data: dict[int, list[int]]) -> _View | None:
    """``out`` as a reshape or transpose of one source array it views, or None."""
    for j in by_data.get(_address(out), ()):
        a = sources[j]
        if out.base is None or a.dtype != out.dtype or a.size != out.size:
            continue
        candidates: list[_View] = [(j, "reshape", out.shape)]
        if a.ndim == out.ndim <= 4:
            candidates += [(j, "transpose", p) for p in itertools.permutations(range(a.ndim))]
        for view in candidates:
            try:
                made = _made(sources, [view])[0]
            except ValueError:  # a reshape that needs a copy
                continue
            if made.shape == out.shape and made.strides == out.strides and not made.flags.owndata:
                return view
    return None


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])
