"""The whole-tree fast path of :func:`pytreeio.tree.restore`: is the decoded tree already the result?

``load(path, like=state)`` of the same model is the common restore: the
decoded tree and ``like`` are nested str-keyed dicts in the same key order,
with numpy leaves of the same shapes and dtypes.  The decoded tree is then
exactly what the general walk would build, so it is returned as it is.

The check costs well under the general walk (which builds every container and
key path): both trees' structures are compared as one string each, written by
``orjson`` (optional) with the leaves collected in order by its ``default``
hook, and the leaves are compared in bulk.  Anything else (other containers,
``None``, scalars, jax arrays, a single difference) answers False, and the
general walk restores it and words any error.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

__all__ = ["same_plain_tree"]

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")

_DUMPS: list[Any] = []  # [orjson.dumps or None, its options], looked up on first use


def _dumps() -> list[Any]:
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
    like_leaves: list[Any] = []
    native_leaves: list[Any] = []
    dumps, opts = _dumps()
    if dumps is not None:
        try:
            text = dumps(like, default=like_leaves.append, option=opts)
            if text != dumps(native, default=native_leaves.append, option=opts):
                return False
        except (TypeError, ValueError):  # non-str keys, nesting beyond orjson's limit, ...
            return False
        # Every member's value must be a dict or a collected leaf (written as null by the
        # hook's None): each ':' is followed by '{' or 'null', and the nulls are exactly the
        # leaves, so the tree holds no None, NaN (also null), scalar or list.  A key holding
        # ':null' or ':{' only adds to both sides of a count and can only make it fail.
        nulls = text.count(b":null")
        if nulls != len(like_leaves) or text.count(b":") != nulls + text.count(b":{"):
            return False
    else:
        try:
            if not _collect(native, like, native_leaves, like_leaves):
                return False
        except RecursionError:  # the general walk reports what it finds that deep
            return False
    if len(native_leaves) != len(like_leaves):  # a None of `native` where `like` has a leaf
        return False
    kinds = {*map(type, like_leaves), *map(type, native_leaves)}
    if kinds and kinds != {np.ndarray}:
        return False
    return list(map(_SHAPE, like_leaves)) == list(map(_SHAPE, native_leaves)) and list(
        map(_DTYPE, like_leaves)
    ) == list(map(_DTYPE, native_leaves))


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
