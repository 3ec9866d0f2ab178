"""Key paths: flattening, canonical key strings and restoring into ``like``.

Canonical key strings join one component per level with ``/``:

=================  ===============  =========================================
tree level         component        example
=================  ===============  =========================================
``str`` dict key   the key          ``params/Dense_0/kernel``
NamedTuple field   the field name   ``[0]/mu/w``  (optax ``ScaleByAdamState``)
list/tuple index   ``[i]``          ``layers/[3]/wq``
``int`` dict key   ``#i``           ``vocab/#-1``
=================  ===============  =========================================

Inside a ``str`` component ``\\`` and ``/`` are escaped as ``\\\\`` and ``\\/``,
a leading ``[`` or ``#`` as ``\\[`` and ``\\#``, and the empty string is
``\\_``; so every string maps to exactly one path and back.  The root leaf
of a tree that is a single array has the empty key ``""``.

The traversal handles dicts (and other ``Mapping``\\ s), lists, tuples,
NamedTuples and ``None`` itself; other pytree node types (flax struct
dataclasses, ...) are walked through jax's registry when jax is already
imported.  jax is never imported by this module.

Flax NNX ``Variable``\\ s are transparent (`pytreeio.core.nnx`): they add no
component, leaves are their values, and `restore` rebuilds them from
``like``.  Typed PRNG keys (`pytreeio.core.keys`) are leaves; `restore`
checks them by shape and PRNG implementation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

from pytreeio.core import keys as prng_keys
from pytreeio.core import nnx
from pytreeio.core.calls import keywords_explained
from pytreeio.core.errors import EncodeError, MismatchError

__all__ = [
    "flatten",
    "unflatten",
    "restore",
    "key_string",
    "parse_key_string",
    "iter_leaves",
    "is_array_leaf",
    "describe_leaf",
    "MISSING",
    "node_children",
    "is_namedtuple",
    "namedtuple_fields",
    "is_jax_array",
    "LazyLeaf",
    "partial_restore",
    "allows_extra",
    "map_leaves",
]

Component = str | int | tuple[str, int]  # str key, int dict key, ("[", index) for sequences

SEP = "/"


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: Marks an entry that the file does not hold (used while restoring).
MISSING: Any = _Missing()


class LazyLeaf:
    """A leaf of a native tree whose value is read only when `restore` places it.

    Lazy views (`pytreeio.lazy`) put these in the native tree they hand to a
    format's ``restore``; ``shape`` and ``dtype`` describe the stored array, and
    `read` returns exactly what ``decode`` would have put there.
    """

    shape: tuple[int, ...]
    dtype: Any

    def read(self) -> Any:
        raise NotImplementedError

    def place(self, like: Any, key: str) -> Any:
        """This leaf as a jax array on ``like``'s sharding over several devices, each device's
        slice read on its own; None when it can only be read whole (see `pytreeio.core.shards`)."""
        return None


# Partial restores: entries of the file that `like` lacks are skipped, not refused.
# A context variable rather than a parameter, so that the restore functions of
# formats (which call restore() themselves) need no new argument to honour it.
_PARTIAL: ContextVar[bool] = ContextVar("pytreeio_partial_restore", default=False)


@contextmanager
def partial_restore(enabled: bool = True) -> Iterator[None]:
    """Within this block `restore` (and model restores) ignore file entries ``like`` lacks."""
    token = _PARTIAL.set(enabled)
    try:
        yield
    finally:
        _PARTIAL.reset(token)


def allows_extra() -> bool:
    """Whether a restore may leave out file entries that ``like`` lacks (a partial restore)."""
    return _PARTIAL.get()


# --------------------------------------------------------------------------
# canonical key strings
# --------------------------------------------------------------------------


def _escape(name: str) -> str:
    if name == "":
        return "\\_"
    out = name.replace("\\", "\\\\").replace(SEP, "\\" + SEP)
    if out[0] in "[#":
        out = "\\" + out
    return out


def component_string(c: Component) -> str:
    """The canonical string of one path component."""
    if type(c) is str and c and c[0] not in "[#\\" and "/" not in c and "\\" not in c:
        return c
    if isinstance(c, tuple):
        return f"[{c[1]}]"
    if isinstance(c, bool):
        raise TypeError(f"bool dict keys are not supported in key paths: {c!r}")
    if isinstance(c, int):
        return f"#{c}"
    return _escape(c)


def key_string(path: Sequence[Component]) -> str:
    """The canonical key string of a path of components."""
    return SEP.join(component_string(c) for c in path)


def parse_key_string(key: str) -> tuple[Component, ...]:
    """Inverse of `key_string`; raises ``ValueError`` for malformed keys."""
    if key == "":
        return ()
    parts: list[str] = []
    raw: list[bool] = []  # whether the part began with an escape (so is a plain str)
    cur: list[str] = []
    escaped_start = False
    i = 0
    n = len(key)
    while i < n:
        ch = key[i]
        if ch == "\\":
            if i + 1 >= n:
                raise ValueError(f"dangling escape at the end of key {key!r}")
            nxt = key[i + 1]
            if nxt == "_" and not cur and (i + 2 == n or key[i + 2] == SEP):
                escaped_start = True
                cur.append("")
            elif nxt in ("\\", SEP, "[", "#"):
                if not cur:
                    escaped_start = True
                cur.append(nxt)
            else:
                raise ValueError(f"unknown escape '\\{nxt}' in key {key!r}")
            i += 2
            continue
        if ch == SEP:
            parts.append("".join(cur))
            raw.append(escaped_start)
            cur, escaped_start = [], False
        else:
            cur.append(ch)
        i += 1
    parts.append("".join(cur))
    raw.append(escaped_start)
    out: list[Component] = []
    for text, plain in zip(parts, raw, strict=True):
        if plain:
            out.append(text)
        elif text == "":
            raise ValueError(f"empty component in key {key!r} (write an empty name as \\_)")
        elif text[0] == "[":
            if text[-1] != "]" or not _is_int(text[1:-1]) or text[1] == "-":
                raise ValueError(f"bad sequence index {text!r} in key {key!r}")
            out.append(("[", int(text[1:-1])))
        elif text[0] == "#":
            if not _is_int(text[1:]):
                raise ValueError(f"bad int key {text!r} in key {key!r}")
            out.append(int(text[1:]))
        else:
            out.append(text)
    return tuple(out)


def _is_int(text: str) -> bool:
    body = text[1:] if text.startswith("-") else text
    return body.isdigit() and body.isascii() and (body == "0" or not body.startswith("0"))


# --------------------------------------------------------------------------
# traversal
# --------------------------------------------------------------------------

_SCALAR_TYPES = (bool, int, float, complex, str, bytes)


def is_array_leaf(x: Any) -> bool:
    """True for numpy arrays/scalars, jax arrays and ``jax.ShapeDtypeStruct``."""
    if isinstance(x, np.ndarray | np.generic):
        return True
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, Mapping)


def is_namedtuple(x: Any) -> bool:
    """True for instances of ``typing.NamedTuple``/``collections.namedtuple`` classes."""
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def namedtuple_fields(nt: Any) -> list[str]:
    """The field names of a NamedTuple instance."""
    return list(type(nt)._fields)


def is_jax_array(x: Any) -> bool:
    """True for a ``jax.Array``; never imports jax (nothing can be one unless it is loaded)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def _path_keys(d: Mapping[Any, Any]) -> list[Any]:
    """``d``'s keys in path order, every one checked to form a path component first."""
    keys = _sorted_keys(d)
    for k in keys:
        if isinstance(k, bool) or not isinstance(k, str | int):
            raise TypeError(
                f"dict keys must be str or int to form key paths, got {type(k).__name__} {k!r}"
            )
    return keys


def _sorted_keys(d: Mapping[Any, Any]) -> list[Any]:
    keys = list(d.keys())
    try:
        return sorted(keys)
    except TypeError:  # mixed key types: keep insertion order
        return keys


Children = tuple[list[tuple[Component, Any]], Callable[[list[Any]], Any]]


def node_children(node: Any) -> Children | None:
    """One level of ``node``: ``(component, child)`` pairs and a rebuild function; None for a leaf."""
    if node is None:
        return [], lambda _: None
    if isinstance(node, (np.ndarray | np.generic, _SCALAR_TYPES)):
        return None
    if isinstance(node, Mapping):
        if type(node) is not dict and nnx.is_state(node):
            return _jax_children(node)
        keys = _path_keys(node)
        cls = type(node)

        def rebuild_mapping(values: list[Any], keys: list[Any] = keys, cls: Any = cls) -> Any:
            d = dict(zip(keys, values, strict=True))
            if cls is dict:
                return d
            try:
                return cls(d)
            except Exception:
                return d

        return [(k, node[k]) for k in keys], rebuild_mapping
    if is_namedtuple(node):
        nt: Any = type(node)

        def rebuild_namedtuple(values: list[Any]) -> Any:
            return nt(*values)

        return [(f, getattr(node, f)) for f in nt._fields], rebuild_namedtuple
    if isinstance(node, list | tuple):
        seq_cls: Any = type(node)

        def rebuild_sequence(values: list[Any]) -> Any:
            return seq_cls(values)

        return [(("[", i), x) for i, x in enumerate(node)], rebuild_sequence
    var = nnx.variable_parts(node)
    if var is not None:
        return _variable_children(*var)
    if hasattr(node, "shape") and hasattr(node, "dtype"):
        return None
    return _jax_children(node)


def _variable_children(value: Any, wrap: Callable[[Any], Any]) -> Children | None:
    """An NNX Variable is transparent: its value's children, rebuilt inside a Variable like it."""
    kids = node_children(value)
    if kids is None:
        return None  # a leaf: iter_leaves yields the value, restore rebuilds the Variable
    pairs, rebuild = kids

    def rebuild_variable(values: list[Any]) -> Any:
        return wrap(rebuild(values))

    return pairs, rebuild_variable


def _jax_children(node: Any) -> Children | None:
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    tu = jax.tree_util
    pairs, treedef = tu.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    if treedef.num_nodes == 1 and len(pairs) == 1 and pairs[0][1] is node:
        return None  # a leaf to jax too
    out: list[Component] = []
    for path, _child in pairs:
        (entry,) = path
        if isinstance(entry, tu.GetAttrKey):
            out.append(entry.name)
        elif isinstance(entry, tu.DictKey):
            out.append(entry.key if isinstance(entry.key, int | str) else str(entry.key))
        elif isinstance(entry, tu.SequenceKey):
            out.append(("[", entry.idx))
        else:  # FlattenedIndexKey and unknown entries
            out.append(("[", getattr(entry, "key", len(out))))
    return list(zip(out, [c for _, c in pairs], strict=True)), treedef.unflatten


def iter_leaves(
    tree: Any, prefix: tuple[Component, ...] = ()
) -> Iterator[tuple[tuple[Component, ...], Any]]:
    """``(path, leaf)`` pairs in canonical order; ``None`` and empty containers yield nothing."""
    kids = node_children(tree)
    if kids is None:
        yield prefix, nnx.unwrap(tree)
        return
    for comp, child in kids[0]:
        yield from iter_leaves(child, (*prefix, comp))


def leaf_values(tree: Any) -> Iterator[Any]:
    """The leaves `iter_leaves` yields, without their paths and in no set order.

    For questions about the leaves alone ("is any a PRNG key?"): plain dicts,
    lists, tuples and numpy arrays are walked without building paths or
    checking keys (~10x faster); anything else goes through
    `node_children` as `iter_leaves` does.
    """
    stack = [tree]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is np.ndarray:
            yield node
        elif kind is dict:
            stack.extend(node.values())
        elif kind is list or kind is tuple:
            stack.extend(node)
        elif node is not None:
            kids = node_children(node)
            if kids is None:
                yield nnx.unwrap(node)
            else:
                stack.extend(child for _, child in kids[0])


#: Types `node_children` always finds to be leaves, which `flatten` takes as
#: they are (their instances are not NNX Variables); modules add their leaf records.
_LEAF_TYPES: set[type] = {*_SCALAR_TYPES, np.float32, np.float64, np.int32, np.int64, np.bool_}


def register_leaf_type(cls: type) -> None:
    """Have `flatten` take instances of ``cls`` as leaves without asking
    `node_children` (which must find them leaves too: an array record with ``shape`` and
    ``dtype`` that is no NNX Variable)."""
    _LEAF_TYPES.add(cls)


def flatten(tree: Any) -> dict[str, Any]:
    """``{canonical key string: leaf}`` in traversal order (dict keys sorted where sortable)."""
    out: dict[str, Any] = {}
    _flatten_into(tree, None, out)
    return out


def _flatten_into(node: Any, prefix: str | None, out: dict[str, Any]) -> None:
    """`flatten` below ``prefix`` (None at the root): the key strings and order of
    `iter_leaves`, with plain dicts, lists, tuples and numpy arrays walked directly
    (a path tuple per leaf and a generator per level cost ~5 us a leaf); any other node
    is taken apart by `node_children`, as `iter_leaves` does."""
    kind = type(node)
    if kind is dict:
        keys = _path_keys(node)
        for k, name in zip(keys, [component_string(k) for k in keys]):
            _flatten_into(node[k], _joined(prefix, name), out)
    elif kind is list or kind is tuple:
        for i, child in enumerate(node):
            _flatten_into(child, _joined(prefix, f"[{i}]"), out)
    elif kind is np.ndarray or kind in _LEAF_TYPES:
        out["" if prefix is None else prefix] = node
    elif node is not None:
        kids = node_children(node)
        if kids is None:
            out["" if prefix is None else prefix] = nnx.unwrap(node)
            return
        for comp, child in kids[0]:
            _flatten_into(child, _joined(prefix, component_string(comp)), out)


def _joined(prefix: str | None, name: str) -> str:
    return name if prefix is None else f"{prefix}{SEP}{name}"


def str_keys(tree: Any) -> Any:
    """``tree`` with every dict key that is not a str or int replaced by its ``str()``
    (suffixed ``#n`` where that collides), so that every leaf gets a key string."""
    if isinstance(tree, dict):
        out: dict[Any, Any] = {}
        for k, v in tree.items():
            name = k if isinstance(k, str | int) and not isinstance(k, bool) else str(k)
            while name in out or (name != k and name in tree):
                name = f"{name}#{len(out)}"
            out[name] = str_keys(v)
        return out
    if isinstance(tree, list):
        return [str_keys(v) for v in tree]
    if type(tree) is tuple:
        return tuple(str_keys(v) for v in tree)
    return tree


def flatten_named(tree: Any) -> dict[str, Any]:
    """`flatten`, where map keys that form no key path (msgpack's None, 1.5) are
    named by their ``str()`` (see `str_keys`) instead of refused."""
    try:
        return flatten(tree)
    except TypeError:
        return flatten(str_keys(tree))


def _nest(flat: Mapping[str, Any], *, dense: bool = True) -> Any:
    """Nested dicts/lists from canonical keys (lists where the level is ``[i]``).

    With ``dense=False`` a level whose indices have gaps (empty subtrees
    flatten to nothing) becomes a dict keyed by index, for `restore`.
    """
    if "" in flat:
        if len(flat) != 1:
            raise ValueError("a root leaf (key '') cannot be combined with other keys")
        return flat[""]
    root: dict[Any, Any] = {}
    for key, leaf in flat.items():
        path = parse_key_string(key)
        node = root
        for comp in path[:-1]:
            node = node.setdefault(comp, {})
            if not isinstance(node, dict):
                raise ValueError(f"key {key!r} descends into a leaf")
        if path[-1] in node:
            raise ValueError(f"key {key!r} is given twice or descends into a subtree")
        node[path[-1]] = leaf
    return _lists_from_index_dicts(root, dense)


def _lists_from_index_dicts(node: Any, dense: bool) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _lists_from_index_dicts(v, dense) for k, v in node.items()}
    idx = [k for k in items if isinstance(k, tuple)]
    if not idx:
        return items
    if len(idx) != len(items):
        raise ValueError("a level mixes sequence indices [i] with dict keys")
    positions = sorted(k[1] for k in idx)
    if positions != list(range(len(positions))):
        if not dense:
            return {k[1]: v for k, v in items.items()}
        raise ValueError(f"sequence indices are not 0..{len(positions) - 1}: {positions}")
    return [items[("[", i)] for i in range(len(positions))]


@keywords_explained
def unflatten(flat: Mapping[str, Any], *, like: Any = None) -> Any:
    """Inverse of `flatten`.

    Without ``like`` the tree is rebuilt from the keys alone (``[i]`` levels
    become lists, everything else dicts).  With ``like`` it takes ``like``'s
    exact structure (tuples, NamedTuples, ``None``, custom nodes), and every
    leaf is checked against ``like``'s leaf (see `restore`).
    """
    if like is None:
        return _nest(flat)
    return restore(_nest(flat, dense=False), like)


# --------------------------------------------------------------------------
# restoring a native tree into the structure of `like`
# --------------------------------------------------------------------------


def describe_leaf(x: Any) -> str:
    """``float32[3, 4]``-style description of a leaf, for error messages."""
    if x is MISSING:
        return "nothing"
    if x is None:
        return "None"
    if prng_keys.is_key(x):
        return f"{x.dtype}{list(x.shape)}"
    if is_array_leaf(x):
        return f"{np.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


def _has_leaves(like: Any) -> bool:
    return next(iter_leaves(like), None) is not None if like is not None else False


def _lookup(native: Any, comp: Component) -> Any:
    """Child of ``native`` for ``comp``: tries the key itself and its string form (state dicts)."""
    if isinstance(native, Mapping):
        if isinstance(comp, tuple):
            for k in (comp[1], str(comp[1])):
                if k in native:
                    return native[k]
            return MISSING
        if comp in native:
            return native[comp]
        if isinstance(comp, int) and str(comp) in native:
            return native[str(comp)]
        return MISSING
    if is_namedtuple(native) and isinstance(comp, str):
        # Only real fields: getattr would also find methods (count, index, _asdict).
        return getattr(native, comp) if comp in type(native)._fields else MISSING
    if isinstance(native, list | tuple):
        if isinstance(comp, tuple):
            i = comp[1]
            return native[i] if 0 <= i < len(native) else MISSING
        return MISSING
    return MISSING


def _native_keys(native: Any) -> set[Any] | None:
    if isinstance(native, Mapping):
        return set(native.keys())
    if isinstance(native, list | tuple):
        return set(range(len(native)))
    return None


def _holds_data(native: Any, key: Any) -> bool:
    """Whether an entry the caller's ``like`` lacks would lose data if ignored."""
    value = native[key]
    if value is None:
        return False
    if isinstance(value, Mapping | list | tuple) and not is_namedtuple(value):
        return len(value) > 0
    return True


def _consumed_key(native: Any, comp: Component) -> Any:
    if isinstance(native, Mapping):
        if isinstance(comp, tuple):
            return comp[1] if comp[1] in native else str(comp[1])
        if comp in native:
            return comp
        return str(comp)
    if is_namedtuple(native) and isinstance(comp, str):
        return type(native)._fields.index(comp)
    if isinstance(comp, tuple):
        return comp[1]
    return comp


def restore(
    native: Any, like: Any, *, path: tuple[Component, ...] = (), convert: bool = True
) -> Any:
    """Rebuild ``like``'s structure from the ``native`` tree a format decoded.

    ``native`` may spell sequences as lists or as dicts keyed ``'0'``, ``'1'``
    (flax state dicts) and int keys as strings; ``like``'s structure wins.
    Every array leaf must match ``like``'s shape and dtype exactly (nothing is
    cast); entries ``like`` lacks or the file lacks raise `MismatchError`
    naming the key path.  Leaves come back as the kind ``like`` holds: numpy
    for numpy, jax arrays (on ``like``'s sharding) for jax arrays and
    ``ShapeDtypeStruct``, Python scalars for Python scalars.
    """
    return _restore(native, like, path, convert)


def _restore(native: Any, like: Any, path: tuple[Component, ...], convert: bool) -> Any:
    like_type = type(like)
    if like_type is np.ndarray:
        if type(native) is np.ndarray and native.shape == like.shape and native.dtype == like.dtype:
            return native
        return _restore_leaf(native, like, path, convert)
    if like_type is dict and type(native) is dict and _plain_keys(like):
        return _restore_plain_dict(native, like, path, convert)
    kids = node_children(like)
    if kids is None:
        var = nnx.variable_parts(like)
        if var is not None:  # an NNX Variable around a leaf: the file holds the value
            value_like, wrap = var
            return wrap(_restore_leaf(nnx.strip_value(native), value_like, path, convert))
        return _restore_leaf(native, like, path, convert)
    pairs, rebuild = kids
    if native is MISSING or native is None:
        if _has_leaves(like):
            raise MismatchError(
                "the file has no entry here",
                key_path=key_string(path),
                expected="a subtree",
                found=describe_leaf(native),
            )
        return (
            like
            if like is None
            else rebuild([_restore(MISSING, c, (*path, k), convert) for k, c in pairs])
        )
    if is_array_leaf(native) or isinstance(native, _SCALAR_TYPES):
        raise MismatchError(
            "the file has a leaf where a subtree is expected",
            key_path=key_string(path),
            expected=type(like).__name__,
            found=describe_leaf(native),
        )
    values: list[Any] = []
    consumed = set()
    try:
        for comp, child_like in pairs:
            child_native = _lookup(native, comp)
            if child_native is not MISSING:
                consumed.add(_consumed_key(native, comp))
            values.append(_restore(child_native, child_like, (*path, comp), convert))
        extra = {k for k in (_native_keys(native) or set()) - consumed if _holds_data(native, k)}
        _refuse_extra(extra, path)
    except BaseException:
        values.clear()  # the traceback keeps this frame: let go of the leaves made so far
        raise
    return rebuild(values)


def _refuse_extra(extra: set[Any], path: tuple[Component, ...]) -> None:
    """Raise for file entries the caller's ``like`` has no place for (they would be lost)."""
    if extra and not _PARTIAL.get():
        names = sorted(str(k) for k in extra)
        more = " ..." if len(names) > 10 else ""
        raise MismatchError(
            f"the file has entries that `like` lacks: {names[:10]}{more}", key_path=key_string(path)
        )


def _plain_keys(d: dict[Any, Any]) -> bool:
    # A loop, not all(genexpr): this runs once per dict of the tree, mostly on 1-3 keys.
    for k in d:  # noqa: SIM110
        if type(k) is not str:
            return False
    return True


def _restore_plain_dict(
    native: dict[Any, Any], like: dict[str, Any], path: tuple[Component, ...], convert: bool
) -> dict[str, Any]:
    """The common case (str-keyed dicts on both sides), keeping ``like``'s key order.

    The two commonest children are handled inline (this runs once per leaf): a numpy
    leaf the file matches exactly, and a nested str-keyed dict; the key path of a
    child is built only when it goes through `restore`.
    """
    out: dict[str, Any] = {}
    ndarray = np.ndarray
    try:
        for k, child_like in like.items():
            child = native.get(k, MISSING)
            tl = type(child_like)
            if tl is ndarray:
                if (
                    type(child) is ndarray
                    and child.shape == child_like.shape
                    and child.dtype == child_like.dtype
                ):
                    out[k] = child
                    continue
            elif tl is dict and type(child) is dict and _plain_keys(child_like):
                out[k] = _restore_plain_dict(child, child_like, (*path, k), convert)
                continue
            out[k] = _restore(child, child_like, (*path, k), convert)
        if len(native) != len(like):
            _refuse_extra({k for k in native if k not in like and _holds_data(native, k)}, path)
    except BaseException:
        out.clear()  # the traceback keeps this frame: let go of the leaves made so far
        raise
    return out


def _restore_leaf(native: Any, like: Any, path: tuple[Component, ...], convert: bool) -> Any:
    if isinstance(native, LazyLeaf):
        if convert and _sharded_like(like):
            placed = native.place(like, key_string(path))  # each device's slice on its own
            if placed is not None:
                return placed
        native = native.read()  # only the leaves that end up in the result are read
    if native is MISSING:
        raise MismatchError(
            "missing from the file",
            key_path=key_string(path),
            expected=describe_leaf(like),
            found="nothing",
        )
    if prng_keys.is_key(like) or prng_keys.is_key(native):
        where = key_string(path)
        return _restore_key(native, like, where, place=convert)
    if is_array_leaf(like):
        if isinstance(native, bool | int | float) and tuple(like.shape) == ():
            # A Python scalar (msgpack, safetensors store them as such) into a 0-d
            # template, e.g. the step counter after jax.eval_shape: exact values only.
            native = _exact_scalar_array(native, like, path)
        if not is_array_leaf(native):
            raise MismatchError(
                "type differs",
                key_path=key_string(path),
                expected=describe_leaf(like),
                found=describe_leaf(native),
            )
        want_shape = tuple(like.shape)
        want_dtype = np.dtype(like.dtype)
        if tuple(native.shape) != want_shape or np.dtype(native.dtype) != want_dtype:
            raise MismatchError(
                "shape or dtype differs",
                key_path=key_string(path),
                expected=describe_leaf(like),
                found=describe_leaf(native),
            )
        return _as_kind_of(native, like) if convert else native
    if isinstance(like, _SCALAR_TYPES):
        return _restore_scalar(native, like, path)
    # A template leaf of a kind restore does not know would be silently replaced
    # by whatever the file holds; refuse it instead.
    raise MismatchError(
        f"`like` has a leaf of unsupported type {type(like).__module__}.{type(like).__qualname__} "
        "(leaves must be arrays, ShapeDtypeStructs, Python scalars or None)",
        key_path=key_string(path),
        expected="an array, ShapeDtypeStruct, Python scalar or None",
        found=describe_leaf(native),
    )


def _sharded_like(like: Any) -> bool:
    """A jax template leaf whose sharding spans several devices (not a typed PRNG key)."""
    sharding = getattr(like, "sharding", None)
    if sharding is None or prng_keys.is_key(like):
        return False
    try:
        return len(sharding.device_set) > 1
    except Exception:
        return False


def _restore_scalar(native: Any, like: Any, path: tuple[Component, ...]) -> Any:
    """A Python scalar of ``like``'s type from the file's scalar or 0-d array."""
    value = native
    if is_array_leaf(native) and tuple(native.shape) == ():
        value = np.asarray(native)[()].item()
    ok = isinstance(value, type(like)) or (
        isinstance(like, float) and isinstance(value, int) and not isinstance(value, bool)
    )
    if isinstance(like, int) and not isinstance(like, bool) and isinstance(value, bool):
        ok = False
    if ok:
        try:
            return type(like)(value)
        except (OverflowError, ValueError, TypeError):  # e.g. float(10**400)
            pass
    raise MismatchError(
        "type differs" if not ok else "the file's value does not fit the template's type",
        key_path=key_string(path),
        expected=type(like).__name__,
        found=describe_leaf(native),
    )


def _exact_scalar_array(
    value: bool | int | float, like: Any, path: tuple[Component, ...]
) -> np.ndarray:
    dtype = np.dtype(like.dtype)
    kind_ok = (
        (dtype.kind == "b" and isinstance(value, bool))
        or (dtype.kind in "iu" and isinstance(value, int) and not isinstance(value, bool))
        or (dtype.kind in "fc" and isinstance(value, float | int) and not isinstance(value, bool))
    )
    if kind_ok:
        try:
            with np.errstate(over="raise", invalid="raise"):
                arr = np.array(value, dtype=dtype)
        except (OverflowError, FloatingPointError, ValueError):
            arr = None
        if arr is not None and (arr.item() == value or (value != value and arr != arr)):
            return arr
    raise MismatchError(
        "the file's Python scalar does not fit the template exactly",
        key_path=key_string(path),
        expected=describe_leaf(like),
        found=f"{type(value).__name__} {value!r}",
    )


def _as_kind_of(arr: Any, like: Any) -> Any:
    """``arr`` as the kind of array ``like`` is (numpy, numpy scalar, jax array)."""
    if isinstance(like, np.generic):
        return np.asarray(arr)[()]
    if isinstance(like, np.ndarray):
        return np.asarray(arr)
    module = type(like).__module__
    if module.startswith("jax") or module.startswith("jaxlib"):
        import jax

        # device_put is a plain transfer; jnp.asarray would compile a conversion
        # for every new shape (~10 ms each on first use).
        return jax.device_put(arr, getattr(like, "sharding", None))
    return arr


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)`` (same node types; ``None`` kept).

    A plain dict with keys that form no key path (msgpack's None, 1.5) is
    mapped as it is, its keys in their order.
    """
    if type(tree) is dict and not all(
        isinstance(k, str | int) and not isinstance(k, bool) for k in tree
    ):
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    kids = node_children(tree)
    if kids is None:
        return fn(tree)
    pairs, rebuild = kids
    if tree is None:
        return None
    return rebuild([map_leaves(fn, child) for _, child in pairs])


# --------------------------------------------------------------------------
# typed PRNG keys
# --------------------------------------------------------------------------


def _restore_key(native: Any, like: Any, path: str, *, place: bool = True) -> Any:
    """The key ``native`` (a typed key a decoder rebuilt) checked against ``like`` (a key or its ShapeDtypeStruct).

    Shape and implementation must match exactly; a plain ``uint32`` array is
    not turned into a key (nor a key into one): that is a
    `MismatchError`, as any other type difference.  With ``place``
    the key goes to ``like``'s sharding when ``like`` is a jax value.
    """
    if not prng_keys.is_key(like) or not prng_keys.is_key(native):
        raise MismatchError(
            "type differs", key_path=path, expected=describe_leaf(like), found=describe_leaf(native)
        )
    if tuple(native.shape) != tuple(like.shape) or prng_keys.impl_name(
        native
    ) != prng_keys.impl_name(like):
        raise MismatchError(
            "shape or PRNG implementation differs",
            key_path=path,
            expected=f"{describe_leaf(like)} ({prng_keys.impl_name(like)})",
            found=f"{describe_leaf(native)} ({prng_keys.impl_name(native)})",
        )
    if place and type(like).__module__.startswith(("jax", "jaxlib")):
        import jax

        return jax.device_put(native, getattr(like, "sharding", None))
    return native


def first_key_path(tree: Any) -> str | None:
    """The canonical key path of the first typed PRNG key leaf in ``tree``, or None."""
    if "jax" not in sys.modules:
        return None
    try:
        if not any(
            type(leaf) is not np.ndarray and prng_keys.is_key(leaf) for leaf in leaf_values(tree)
        ):
            return None  # the usual answer, found without building every leaf's path
        for path, leaf in iter_leaves(tree):
            if prng_keys.is_key(leaf):
                return key_string(path) or "<root>"
    except TypeError:  # a tree pytreeio cannot walk (bool dict keys, ...): the format says why
        return None
    return None


def refuse_keys(tree: Any, format_name: str) -> None:
    """Raise `EncodeError` naming the first typed PRNG key in ``tree`` (for formats that cannot hold keys).

    ``tree`` may also be a `pytreeio.model.form.Model` (its layers' arrays
    and optimizer slots are looked at).
    """
    if format_name in prng_keys.HOLDS_KEYS or "jax" not in sys.modules:
        return
    where = _first_model_key(tree) if _is_model(tree) else first_key_path(tree)
    if where is not None:
        raise EncodeError(
            f"format {format_name!r} cannot store a typed PRNG key "
            "(jax.random.key); save it in msgpack or safetensors, or store "
            "jax.random.key_data(key) as a plain uint32 array",
            key_path=where,
        )


def _is_model(x: Any) -> bool:
    return type(x).__name__ == "Model" and type(x).__module__ == "pytreeio.model.form"


def _first_model_key(model: Any) -> str | None:
    for i, layer in enumerate(model.layers):
        for name, arr in layer.arrays.items():
            if prng_keys.is_key(arr):
                return f"layers[{i}].{name}"
    opt = model.opt_state
    if opt is not None:
        for slot, values in opt.slots.items():
            for j, arr in enumerate(values):
                if arr is not None and prng_keys.is_key(arr):
                    return f"opt_state.{slot}[{j}]"
    return None
