"""Flax NNX variables as transparent wrappers in key paths.

``nnx.state(model)``, the states of ``nnx.split(model)`` and
``nnx.state(optimizer)`` are ``nnx.State`` mappings whose leaves are
``nnx.Variable`` objects (``Param``, ``BatchStat``, ``RngKey``, the
optimizer's ``OptArray``/``OptState``, ...; ``VariableState`` in older flax).
jax flattens a Variable to one child, its value, with the variable type and
metadata as static data.  pytreeio treats a Variable as **transparent**: it
adds no component to key paths and files hold its value only, so
``nnx.state(model)`` is stored exactly as ``nnx.to_pure_dict(state)`` would be
(``l1/kernel``, not ``l1/kernel/value``).  A State is walked as jax walks
it (its nested levels are plain dicts, with int keys for ``nnx.List``
positions), so restoring rebuilds exactly ``like``'s structure.  Loading with
``like=`` a State
(real, or from ``nnx.eval_shape`` / ``jax.eval_shape``) rebuilds every
Variable from ``like``'s (type and metadata come from ``like``); without
``like`` the pure dict comes back, which
``nnx.replace_by_pure_dict(abstract_state, tree)`` also accepts.

flax is never imported here: a Variable can only exist once flax loaded it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["variable_types", "is_state", "variable_parts", "unwrap", "strip_value"]

_cache: tuple[Any, tuple[type, ...]] = (None, ())


def variable_types() -> tuple[type, ...]:
    """The NNX Variable classes loaded so far (``Variable``, and ``VariableState`` where distinct)."""
    global _cache
    mod = sys.modules.get("flax.nnx.variablelib")
    if mod is None:
        return ()
    if _cache[0] is mod:
        return _cache[1]
    found: list[type] = []
    names = vars(mod)  # not getattr: flax warns on access of the removed VariableState alias
    for name in ("Variable", "VariableState"):
        cls = names.get(name)
        if isinstance(cls, type) and not any(issubclass(cls, c) for c in found):
            found.append(cls)
    _cache = (mod, tuple(found))
    return _cache[1]


def is_state(x: Any) -> bool:
    """True for an ``nnx.State`` (walked through jax's registry: its nested levels are plain dicts)."""
    mod = sys.modules.get("flax.nnx.statelib")
    cls = vars(mod).get("State") if mod is not None else None
    return isinstance(cls, type) and isinstance(x, cls)


def variable_parts(x: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """``(value, wrap)`` of an NNX Variable (``wrap(v)`` is a Variable like ``x`` holding ``v``); None otherwise."""
    types = variable_types()
    if not types or not isinstance(x, types):
        return None
    import jax

    children, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    if len(children) != 1:  # not the one-child node flax registers: leave it to jax's registry
        return None

    def wrap(value: Any) -> Any:
        return jax.tree_util.tree_unflatten(treedef, [value])

    return children[0], wrap


def unwrap(x: Any) -> Any:
    """The value an NNX Variable holds; anything else as it is."""
    parts = variable_parts(x)
    return x if parts is None else parts[0]


def strip_value(native: Any) -> Any:
    """A file's entry for a Variable: its value, also where the file spelled it ``{'value': v}``.

    (jax's key paths name the value ``.value``; trees flattened that way
    nest each Variable's value one level deeper.)
    """
    if isinstance(native, Mapping) and len(native) == 1 and "value" in native:
        return native["value"]
    return native
