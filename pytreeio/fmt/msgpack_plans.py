"""Replay of a msgpack state dict whose every byte but the array payloads was seen before.

A training run saves and loads the same structure again and again: the same
keys, shapes and dtypes, only the array payloads differ.  Parsing is a pure
function of the bytes, so a file whose bytes outside the payloads (its
*skeleton*: maps, keys, ext and bin headers, shapes, dtype names) equal a
file parsed before, and whose length is the same, parses to the same tree
with the same payload offsets.  :func:`learn` records such a tree as a
:class:`Plan` (the skeleton bytes, the tree's nesting and per array leaf its
offset, dtype and shape)
from the second parse of a buffer of its length on;
:func:`replay` compares the skeleton bytes of a new buffer with the plan's in
one numpy operation and, on an exact match, builds the tree from the plan, its
arrays made in runs (:mod:`pytreeio.array_runs`): the per-leaf Python walk of
the framing is skipped (about 6x less time per leaf).  Any difference, even of one byte, sends the
buffer to the parser, which also reports every error; payload bytes are
never interpreted by either.

Only plain trees are learnt: nested ``dict``\\ s with ``str`` keys whose
leaves are arrays viewing the buffer (C order, in file order, disjoint) or
immutable scalars; a few plans are kept per process (the most recent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..array_runs import ArrayRuns, Spec
from ..skeleton import Shelf, Skeleton

__all__ = ["Plan", "learn", "replay"]

#: Trees with fewer array leaves parse fast enough: no plan.
MIN_LEAVES = 32
#: Plans kept at most (the most recently learnt first; one per buffer length).
MAX_PLANS = 4

_SCALARS = (int, float, bool, str, bytes, type(None))


#: A template's array leaf: the next array the plan's runs make.
_ARRAY = ("a",)


@dataclass(frozen=True)
class Plan:
    """A learnt tree: its skeleton, and how to rebuild the tree."""

    skeleton: Skeleton
    template: Any  # dict of key -> template; leaves _ARRAY (in file order) or ("c", value)
    runs: ArrayRuns  # the array leaves, made on a buffer in one go


_PLANS: Shelf[Plan] = Shelf(MAX_PLANS)


def replay(view: memoryview) -> Any:
    """The tree of ``view`` built from a plan whose skeleton it matches, or None."""
    plan = _PLANS.find(view)
    return None if plan is None else _build(plan.template, iter(plan.runs.build(view)))


def _build(template: dict[str, Any], arrays: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, t in template.items():
        if type(t) is dict:
            out[key] = _build(t, arrays)
        elif t is _ARRAY:
            out[key] = next(arrays)
        else:
            out[key] = t[1]
    return out


def learn(view: memoryview, tree: Any) -> None:
    """Record ``tree``, just parsed from ``view``, as a plan (when it is a plain tree, and a
    buffer of its length was parsed lately: a one-off load does not pay for a plan)."""
    if type(tree) is not dict or not _PLANS.seen_before(view.nbytes):
        return
    data = np.frombuffer(view, dtype=np.uint8)
    specs: list[Spec] = []
    template = _template(tree, data.ctypes.data, data.nbytes, specs)
    if template is None or len(specs) < MIN_LEAVES:
        return
    starts = np.array([at for at, _, _, _ in specs], dtype=np.int64)
    stops = starts + np.array([_nbytes(s) for s in specs], dtype=np.int64)
    skeleton = Skeleton.of(view, starts, stops)  # None: out of file order, overlapping, too large
    if skeleton is not None:
        _PLANS.keep(Plan(skeleton, template, ArrayRuns(specs)))


def _nbytes(spec: Spec) -> int:
    _, dtype, shape, _ = spec
    return dtype.itemsize * int(np.prod(shape, dtype=np.int64))


def _template(node: dict[Any, Any], base: int, n: int, specs: list[Spec]) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if type(key) is not str:
            return None
        if type(value) is dict:
            sub = _template(value, base, n, specs)
            if sub is None:
                return None
            out[key] = sub
        elif type(value) is np.ndarray:
            spec = _array(value, base, n)
            if spec is None:
                return None
            specs.append(spec)
            out[key] = _ARRAY
        elif type(value) in _SCALARS:
            out[key] = ("c", value)
        else:
            return None
    return out


def _array(arr: np.ndarray, base: int, n: int) -> Spec | None:
    """The spec of a C-order view of the buffer, or None."""
    if not arr.flags.c_contiguous or arr.size == 0 or arr.dtype.hasobject:
        return None
    offset = arr.ctypes.data - base
    if not 0 <= offset <= n - arr.nbytes:
        return None
    return (offset, arr.dtype, arr.shape, False)
