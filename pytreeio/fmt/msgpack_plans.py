"""Replay of a msgpack state dict whose every byte but the array payloads was seen before.

A training run saves and loads the same structure again and again: the same
keys, shapes and dtypes, only the array payloads differ.  Parsing is a pure
function of the bytes, so a file whose bytes outside the payloads (its
*skeleton*: maps, keys, ext and bin headers, shapes, dtype names) equal a
file parsed before, and whose length is the same, parses to the same tree
with the same payload offsets.  :func:`learn` records such a tree as a
:class:`Plan` (the skeleton bytes, and per leaf its offset, dtype and shape);
:func:`replay` gathers the skeleton bytes of a new buffer in one numpy
indexing, compares them with the plan's and, on an exact match, builds the
tree from the plan: the per-leaf Python walk of the framing is skipped
(about 3x less time per leaf).  Any difference, even of one byte, sends the
buffer to the parser, which also reports every error; payload bytes are
never interpreted by either.

Only plain trees are learnt: nested ``dict``\\ s with ``str`` keys whose
leaves are arrays viewing the buffer (C order, in file order, disjoint) or
immutable scalars; a few plans are kept per process (the most recent).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Plan", "learn", "replay"]

#: Trees with fewer array leaves parse fast enough: no plan.
MIN_LEAVES = 32
#: Skeletons larger than this are not kept (memory: 5 bytes per skeleton byte, so at most
#: about 5 MiB per plan; 1 MiB of skeleton is some 20,000 leaves).
MAX_SKELETON = 1 << 20
#: Plans kept at most (the most recently learnt first; one per buffer length).
MAX_PLANS = 4

_SCALARS = (int, float, bool, str, bytes, type(None))


@dataclass(frozen=True)
class Plan:
    """A learnt tree: skeleton positions and bytes, and how to rebuild the tree."""

    length: int
    positions: np.ndarray  # int32/int64 offsets of the skeleton's bytes
    skeleton: np.ndarray  # uint8, the bytes at `positions`
    template: Any  # dict of key -> template; leaves ("a", offset, dtype, count, shape) or ("c", v)


_PLANS: list[Plan] = []
_LOCK = threading.Lock()


def replay(view: memoryview) -> Any:
    """The tree of ``view`` built from a plan whose skeleton it matches, or None."""
    plans = _PLANS  # read once: learn() replaces the list, never changes it
    if not plans:
        return None
    n = len(view)
    for plan in plans:
        if plan.length != n:
            continue
        data = np.frombuffer(view, dtype=np.uint8)
        if np.array_equal(data[plan.positions], plan.skeleton):
            return _build(plan.template, view)
    return None


def _build(template: dict[str, Any], view: memoryview) -> dict[str, Any]:
    out: dict[str, Any] = {}
    frombuffer = np.frombuffer
    for key, t in template.items():
        if type(t) is dict:
            out[key] = _build(t, view)
        elif t[0] == "a":
            arr = frombuffer(view, t[2], t[3], t[1])
            out[key] = arr if t[4] is None else arr.reshape(t[4])
        else:
            out[key] = t[1]
    return out


def learn(view: memoryview, tree: Any) -> None:
    """Record ``tree``, just parsed from ``view``, as a plan (when it is a plain tree)."""
    if type(tree) is not dict:
        return
    data = np.frombuffer(view, dtype=np.uint8)
    base = data.ctypes.data
    n = data.nbytes
    spans: list[tuple[int, int]] = []
    template = _template(tree, base, n, spans)
    if template is None or len(spans) < MIN_LEAVES:
        return
    starts = np.fromiter((s for s, _ in spans), dtype=np.int64, count=len(spans))
    stops = np.fromiter((e for _, e in spans), dtype=np.int64, count=len(spans))
    if np.any(starts[1:] < stops[:-1]):  # not in file order, or overlapping: not learnt
        return
    # the skeleton is the gaps between payloads (sized before anything file-sized is made)
    gap_starts = np.concatenate(([0], stops))
    gap_stops = np.concatenate((starts, [n]))
    if int((gap_stops - gap_starts).sum()) > MAX_SKELETON:
        return
    index = np.int32 if n < 2**31 else np.int64
    positions = np.concatenate(
        [np.arange(a, b, dtype=index) for a, b in zip(gap_starts.tolist(), gap_stops.tolist())]
    )
    plan = Plan(n, positions, data[positions].copy(), template)
    with _LOCK:
        global _PLANS
        _PLANS = [plan, *(p for p in _PLANS if p.length != n)][:MAX_PLANS]


def _template(
    node: dict[Any, Any], base: int, n: int, spans: list[tuple[int, int]]
) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if type(key) is not str:
            return None
        if type(value) is dict:
            sub = _template(value, base, n, spans)
            if sub is None:
                return None
            out[key] = sub
        elif type(value) is np.ndarray:
            leaf = _array(value, base, n)
            if leaf is None:
                return None
            spans.append((leaf[1], leaf[1] + value.nbytes))
            out[key] = leaf
        elif type(value) in _SCALARS:
            out[key] = ("c", value)
        else:
            return None
    return out


def _array(arr: np.ndarray, base: int, n: int) -> tuple[Any, ...] | None:
    """``("a", offset, dtype, count, shape or None)`` of a C-order view of the buffer, or None."""
    if not arr.flags.c_contiguous or arr.size == 0 or arr.dtype.hasobject:
        return None
    offset = arr.ctypes.data - base
    if not 0 <= offset <= n - arr.nbytes:
        return None
    return ("a", offset, arr.dtype, arr.size, None if arr.ndim == 1 else arr.shape)
