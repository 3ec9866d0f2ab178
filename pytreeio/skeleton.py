"""Skeletons: the bytes of a buffer outside its payloads, to replay a parse of the same framing.

A training run saves and loads the same structure again and again: the same
names, shapes and dtypes, only the array payloads differ.  Parsing is a pure
function of the bytes, so a buffer of the same length whose bytes outside the
payloads (its *skeleton*) equal those of a buffer parsed before parses to the
same structure with the payloads at the same offsets.  A format records what
its parse found as a plan carrying a :class:`Skeleton`; :class:`Shelf` keeps a
few plans per process and finds the one a new buffer matches, by comparing the
skeleton's bytes in one numpy gather.  Used by the msgpack state dicts
(:mod:`pytreeio.fmt.msgpack_plans`), the ``.npz`` archives
(:mod:`pytreeio.npz_plans`), DataCode files and bullet's record files; every
shelf registers with :func:`pytreeio.forget_layouts`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from .layouts import kept_by

__all__ = ["MAX_SKELETON", "Skeleton", "Shelf", "SeenLengths"]

#: Skeletons larger than this are not kept (memory: 5 bytes per skeleton byte, so at most
#: about 5 MiB per plan; 1 MiB of skeleton is some 4,000 to 20,000 leaves).
MAX_SKELETON = 1 << 20


@dataclass(frozen=True)
class Skeleton:
    """The bytes of a buffer of ``length`` bytes at ``positions`` (all but its payloads)."""

    length: int
    positions: np.ndarray  # int32/int64 offsets, ascending
    values: np.ndarray  # uint8, the bytes at `positions`

    @classmethod
    def of(cls, buffer: Any, starts: Any, stops: Any) -> Skeleton | None:
        """The skeleton of ``buffer`` (a flat byte buffer) around the payloads
        ``[starts[i], stops[i])`` (sequences of offsets).

        None where the payloads are not in order and disjoint, or the skeleton would
        exceed :data:`MAX_SKELETON` (it is sized before anything is allocated).
        """
        data = np.frombuffer(buffer, dtype=np.uint8)
        n = data.nbytes
        starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        if len(starts) and (
            np.any(starts[1:] < stops[:-1]) or np.any(stops < starts) or starts[0] < 0
            or stops[-1] > n
        ):  # fmt: skip
            return None
        gap_starts = np.concatenate(([0], stops))
        gap_stops = np.concatenate((starts, [n]))
        if int((gap_stops - gap_starts).sum()) > MAX_SKELETON:
            return None
        index = np.int32 if n < 2**31 else np.int64
        lengths = gap_stops - gap_starts
        # gap j's k-th byte is at gap_starts[j] + k: one arange shifted per gap, in one go
        shifts = (gap_starts - (np.cumsum(lengths) - lengths)).astype(index)
        positions = np.repeat(shifts, lengths) + np.arange(int(lengths.sum()), dtype=index)
        return cls(n, positions, data[positions].copy())

    def matches(self, data: np.ndarray) -> bool:
        """Whether ``data`` (uint8) has this length and these bytes outside the payloads."""
        return data.nbytes == self.length and np.array_equal(data[self.positions], self.values)


class _Plan(Protocol):
    @property
    def skeleton(self) -> Skeleton: ...


P = TypeVar("P", bound=_Plan)


class SeenLengths:
    """Buffer lengths parsed lately (a few dozen), to learn a structure from its second parse.

    A plan pays off from the second parse of a structure on; learning it at the
    first costs a one-off load (most loads) a second pass over its framing.
    Thread-safe; registers with :func:`pytreeio.forget_layouts`.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._lengths: dict[int, None] = {}  # oldest first
        kept_by(self.clear)

    def seen_before(self, length: int) -> bool:
        """Whether a buffer of ``length`` bytes was parsed lately (and note this one)."""
        with self._lock:
            seen = length in self._lengths
            self._lengths.pop(length, None)
            self._lengths[length] = None
            if len(self._lengths) > self.limit:
                del self._lengths[next(iter(self._lengths))]
        return seen

    def clear(self) -> None:
        with self._lock:
            self._lengths = {}


class Shelf(Generic[P]):
    """The plans a process keeps for one kind of buffer: the most recent first, one per length.

    Thread-safe: :meth:`keep` replaces :attr:`plans` under a lock, never changes the
    list in place, so a reader iterating it needs no lock.
    """

    def __init__(self, max_plans: int, min_items: int = 32) -> None:
        self.max_plans = max_plans
        self.min_items = min_items  # buffers of fewer tensors parse fast enough: no plan
        self.plans: list[P] = []
        self._lock = threading.Lock()
        self._seen = SeenLengths(4 * max_plans)
        kept_by(self.clear)

    def seen_before(self, length: int) -> bool:
        """Whether a buffer of ``length`` bytes was parsed lately (and note this one):
        see :class:`SeenLengths`."""
        return self._seen.seen_before(length)

    def learns(self, view: memoryview, items: int) -> bool:
        """Whether to learn a parse of ``view`` (of ``items`` tensors): enough of them, and
        from the second parse of a buffer of its length on (:meth:`seen_before`)."""
        return items >= self.min_items and self.seen_before(view.nbytes)

    def find(self, view: memoryview) -> P | None:
        """The plan whose skeleton ``view`` (a byte view) matches, or None."""
        plans = self.plans  # read once: keep() replaces the list
        n = view.nbytes
        for plan in plans:
            if plan.skeleton.length == n:
                data = np.frombuffer(view, dtype=np.uint8)
                return plan if plan.skeleton.matches(data) else None
        return None

    def keep(self, plan: P) -> None:
        """Add ``plan``, replacing one of its length and dropping the oldest past the bound."""
        n = plan.skeleton.length
        with self._lock:
            kept = [plan, *(p for p in self.plans if p.skeleton.length != n)]
            self.plans = kept[: self.max_plans]

    def clear(self) -> None:
        with self._lock:
            self.plans = []
        self._seen.clear()
