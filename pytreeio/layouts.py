"""The layouts pytreeio keeps from earlier saves and loads, and :func:`forget_layouts`.

A training run saves and loads the same structure again and again, so work
that is a pure function of a checkpoint's framing is kept after the first
times: replay plans of file skeletons (:mod:`pytreeio.skeleton`: npz, msgpack,
DataCode, bullet records), safetensors headers, checked layer lists, written
JSON documents, model formats' mappings to and from Flax params trees
(:mod:`pytreeio.model_plans`).  Each is small and bounded (a few per kind, each at most a
few MB); :func:`forget_layouts` drops them all, to return the memory or to
measure a first load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["Memo", "forget_layouts", "kept_by"]

K = TypeVar("K")
V = TypeVar("V")

_FORGETTERS: list[Callable[[], None]] = []


def kept_by(forget: Callable[[], None]) -> None:
    """Register how to drop one kind of kept layout (each memo registers itself on import)."""
    _FORGETTERS.append(forget)


class Memo(dict[K, V]):
    """Work kept by key: at most ``limit`` entries (full, it starts again: what a process
    meets is few), dropped by :func:`forget_layouts`."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        kept_by(self.clear)

    def keep(self, key: K, value: V) -> None:
        if len(self) >= self.limit and key not in self:
            self.clear()
        self[key] = value


def forget_layouts() -> None:
    """Drop every layout kept from earlier saves and loads; later ones work them out again."""
    for forget in _FORGETTERS:
        forget()
