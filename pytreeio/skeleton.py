"""Skeletons: the bytes of a buffer outside its payloads, to replay a parse of the same framing.

A training run saves and loads the same structure again and again: the same
names, shapes and dtypes, only the array payloads differ.  Parsing is a pure
function of the bytes, so a buffer of the same length whose bytes outside the
payloads (its *skeleton*) equal those of a buffer parsed before parses to the
same structure with the payloads at the same offsets.  A format records what
its parse found as a plan carrying a :class:`Skeleton`; :class:`Shelf` keeps a
few plans per process and finds the one a new buffer matches, by comparing the
skeleton's bytes in one numpy gather (or, where the skeleton is much of the
buffer, the whole buffer under a mask).  Used by the msgpack state dicts
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


#: A skeleton of at least a quarter of its buffer is kept as a byte mask over the whole
#: buffer: compared word by word in about 0.1 ns a buffer byte, against about 2 ns a
#: skeleton byte for a gather (2000 small npz members: 1.3 ms -> 0.09 ms), in at most
#: 8 bytes per skeleton byte where the gather form keeps 5.
_MASKED_MIN_SHARE = 4


@dataclass(frozen=True, eq=False)
class Skeleton:
    """The bytes of a buffer of ``length`` bytes outside its payloads.

    Kept in one of two forms (:meth:`of` picks): the skeleton bytes and their
    offsets, compared by a gather; or, where the skeleton is much of the
    buffer, a mask over every byte and the masked bytes, compared word by word.
    """

    length: int
    # gathered form: the offsets of the skeleton bytes (int32/int64, ascending), else None
    _offsets: np.ndarray | None
    # gathered form: the bytes at those offsets; masked form: the buffer & mask (uint8)
    _values: np.ndarray
    # masked form: 0xFF on skeleton bytes, 0 on payloads (uint8, ``length`` bytes), else None
    _mask: np.ndarray | None

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
        lengths = gap_stops - gap_starts
        total = int(lengths.sum())
        if total > MAX_SKELETON:
            return None
        if total * _MASKED_MIN_SHARE >= n:
            # runs of gap (skeleton) bytes and payload bytes, alternating
            runs = np.empty(2 * lengths.size - 1, np.int64)
            runs[0::2], runs[1::2] = lengths, stops - starts
            mask = np.repeat(np.resize(np.array([0xFF, 0], np.uint8), runs.size), runs)
            return cls(n, None, data & mask, mask)
        index = np.int32 if n < 2**31 else np.int64
        # gap j's k-th byte is at gap_starts[j] + k: one arange shifted per gap, in one go
        shifts = (gap_starts - (np.cumsum(lengths) - lengths)).astype(index)
        positions = np.repeat(shifts, lengths) + np.arange(total, dtype=index)
        return cls(n, positions, data[positions].copy(), None)

    @property
    def positions(self) -> np.ndarray:
        """The offsets of the skeleton bytes, ascending."""
        if self._offsets is not None:
            return self._offsets
        assert self._mask is not None
        return np.flatnonzero(self._mask)

    def matches(self, data: np.ndarray) -> bool:
        """Whether ``data`` (contiguous uint8) has this length and these bytes outside the payloads."""
        if data.nbytes != self.length:
            return False
        if self._mask is None:
            return np.array_equal(data[self._offsets], self._values)
        words = self.length & ~7  # the 8-byte words, then the last few bytes
        return np.array_equal(
            data[:words].view(np.uint64) & self._mask[:words].view(np.uint64),
            self._values[:words].view(np.uint64),
        ) and np.array_equal(data[words:] & self._mask[words:], self._values[words:])


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
