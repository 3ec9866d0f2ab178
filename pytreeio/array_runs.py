"""Many arrays on one buffer made at once, as the rows of strided arrays.

A replay plan (:mod:`pytreeio.skeleton`) knows where every array of a buffer
lies.  numpy makes one array on a buffer in about 0.6 µs (``np.ndarray`` with
``buffer=``, or ``frombuffer`` and ``reshape``), which is most of what a
replayed load of small tensors costs.  Arrays of one dtype, shape and memory
order at equal spacing are the rows of one strided array, and ``list()`` of
that array yields them at about 0.1 µs each.  A model's tensors fall into such
runs: each layer's kernel lies as far from the last layer's as the layer's
size (until a name grows a digit).

A row is a view of the strided array, itself a view of the buffer: the same
bytes, flags (read-only, aligned, contiguous) and lifetime as an array made on
the buffer directly.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ArrayRuns", "Spec"]

#: Where an array lies and what it is: (byte offset, dtype, shape, Fortran order).
Spec = tuple[int, np.dtype[Any], tuple[int, ...], bool]


@dataclass(frozen=True)
class _Run:
    offset: int  # of the first row
    spacing: int  # bytes from one row to the next (0: a run of one)
    count: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]  # a row's
    strides: tuple[int, ...]  # a row's


class ArrayRuns:
    """How to make the arrays of ``specs``, in their order, on any buffer laid out alike.

    Made once per plan; :meth:`build` is the per-load step.  The buffer must
    hold every spec's bytes (the plan's checks see to it).
    """

    def __init__(self, specs: Sequence[Spec]) -> None:
        runs: list[tuple[_Run, list[int]]] = []
        open_runs: dict[tuple[Any, ...], tuple[list[Any], list[int]]] = {}  # [offset, spacing]
        for i, (offset, dtype, shape, fortran) in enumerate(specs):
            strides = _strides(shape, dtype.itemsize, fortran)
            if not shape or 0 in shape:  # 0-d rows would be scalars; empty ones need no run
                runs.append((_Run(offset, 0, 1, dtype, shape, strides), [i]))
                continue
            kind = (dtype, shape, strides)
            found = open_runs.get(kind)
            if found is not None:
                (first, spacing), members = found
                if spacing == 0 and offset > first:
                    found[0][1] = offset - first
                    members.append(i)
                    continue
                if spacing and offset == first + spacing * len(members):
                    members.append(i)
                    continue
                runs.append((self._closed(found, kind), members))
            open_runs[kind] = ([offset, 0], [i])
        runs.extend((self._closed(found, kind), found[1]) for kind, found in open_runs.items())
        self._runs = tuple(run for run, _ in runs)
        self.count = len(specs)
        made_at = [0] * self.count  # where each spec's array lands in build()'s made list
        for at, i in enumerate(i for _, members in runs for i in members):
            made_at[i] = at
        self._order: Callable[[list[Any]], Any] | None = (
            None if made_at == list(range(self.count)) else operator.itemgetter(*made_at)
        )

    @staticmethod
    def _closed(found: tuple[list[Any], list[int]], kind: tuple[Any, ...]) -> _Run:
        (first, spacing), members = found
        dtype, shape, strides = kind
        return _Run(first, spacing, len(members), dtype, shape, strides)

    def build(self, buffer: Any) -> list[np.ndarray]:
        """The arrays on ``buffer`` (anything numpy takes as ``buffer=``), in spec order."""
        made: list[np.ndarray] = []
        ndarray = np.ndarray
        for r in self._runs:
            if r.count == 1:
                made.append(ndarray(r.shape, r.dtype, buffer, r.offset, r.strides))
            else:
                rows = ndarray(
                    (r.count, *r.shape), r.dtype, buffer, r.offset, (r.spacing, *r.strides)
                )
                made.extend(rows)
        return made if self._order is None else list(self._order(made))


def _strides(shape: tuple[int, ...], itemsize: int, fortran: bool) -> tuple[int, ...]:
    """The strides of a contiguous array of ``shape`` in C (or Fortran) order."""
    out = []
    step = itemsize
    for dim in reversed(shape) if not fortran else shape:
        out.append(step)
        step *= max(dim, 1)
    return tuple(reversed(out)) if not fortran else tuple(out)
