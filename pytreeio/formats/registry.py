"""The registry of formats: :func:`register`, lookup by name, suffix and sniffed content.

The registry names no format module until it is first consulted: then it imports
the built-in ones (:data:`BUILTIN`), which call :func:`register`, so
``import pytreeio`` stays cheap.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Iterator

from pytreeio.core.errors import UnknownFormatError
from pytreeio.core.records import Directory, File, Format, Layout, Probe, Siblings, declared_options

__all__ = [
    "BUILTIN",
    "register",
    "unregister",
    "get",
    "formats",
    "for_suffix",
    "best_match",
    "iter_formats",
]

#: The modules that register the built-in formats, in sniffing order (ties go to the first).
BUILTIN: tuple[str, ...] = (
    "pytreeio.formats.safetensors",
    "pytreeio.formats.tinyllama",
    "pytreeio.formats.netcl.model_file",
    "pytreeio.formats.netcl.checkpoint",
    "pytreeio.formats.datacode.nn",
    "pytreeio.formats.waffe2.state_dict",
    "pytreeio.formats.bullet.checkpoint",
    "pytreeio.formats.msgpack",
)

_REGISTRY: dict[str, Format] = {}
_builtins_loaded = False
_builtins_loading = False
# Threads that consult the registry first must wait until every built-in format is registered.
_builtins_lock = threading.RLock()


def _load_builtins() -> None:
    global _builtins_loaded, _builtins_loading
    if _builtins_loaded:
        return
    with _builtins_lock:
        if _builtins_loaded or _builtins_loading:  # (a format module consulting the registry)
            return
        _builtins_loading = True
        try:
            for module in BUILTIN:
                importlib.import_module(module)
        finally:
            _builtins_loaded = True
            _builtins_loading = False


def register(fmt: Format, *, replace: bool = False) -> Format:
    """Add ``fmt`` to the registry under ``fmt.name`` and return it.

    Checks that every function declares its options by name (no ``**kwargs``),
    so that a misspelt option is a ``TypeError`` rather than silently ignored.
    """
    if not isinstance(fmt, Format):
        raise TypeError(f"register() takes a pytreeio.Format, not {type(fmt).__name__}")
    if not isinstance(fmt.layout, File | Siblings | Directory):
        raise TypeError(f"format {fmt.name!r}: layout must be FILE, Siblings(...) or DIRECTORY")
    for fn in (fmt.encode, fmt.decode, fmt.restore, fmt.to_model, fmt.from_model, fmt.slots):
        declared_options(fn)  # raises for **kwargs
    if not replace and fmt.name in _REGISTRY and _REGISTRY[fmt.name] is not fmt:
        raise ValueError(f"a format named {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format (tests and user plug-ins that re-register)."""
    _REGISTRY.pop(name, None)


def formats() -> dict[str, Format]:
    """All registered formats, by name."""
    _load_builtins()
    return dict(_REGISTRY)


def get(name: str | Format, *, path: str | os.PathLike[str] | None = None) -> Format:
    """The format called ``name`` (a :class:`Format` is returned as is)."""
    if isinstance(name, Format):
        return name
    _load_builtins()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownFormatError(
            f"unknown format {name!r}; known formats: {known}",
            path=os.fspath(path) if path is not None else None,
        ) from None


def for_suffix(path: str | os.PathLike[str]) -> Format | None:
    """The single format whose suffix ends ``path``, or None (unknown or ambiguous)."""
    _load_builtins()
    name = os.fspath(path).lower()
    hits = [f for f in _REGISTRY.values() if any(name.endswith(s) for s in f.suffixes)]
    if not hits:
        return None
    longest = max(max(len(s) for s in f.suffixes if name.endswith(s)) for f in hits)
    best = [f for f in hits if any(name.endswith(s) and len(s) == longest for s in f.suffixes)]
    return best[0] if len(best) == 1 else None


def best_match(probe_for: Callable[[Layout], Probe]) -> Format | None:
    """The format whose ``sniff`` scores highest on the probe io built for its layout.

    ``probe_for(layout)`` is called once per distinct layout.  A sniffer that
    raises is treated as "not this format": sniffing must never turn a load
    into a crash.  Ties go to the format registered first.
    """
    _load_builtins()
    probes: dict[Layout, Probe] = {}
    best: tuple[float, Format] | None = None
    for fmt in _REGISTRY.values():
        if fmt.layout not in probes:
            probes[fmt.layout] = probe_for(fmt.layout)
        try:
            score = float(fmt.sniff(probes[fmt.layout]))
        except Exception:
            continue
        if score > 0 and (best is None or score > best[0]):
            best = (score, fmt)
    return best[1] if best else None


def iter_formats() -> Iterator[Format]:
    _load_builtins()
    yield from _REGISTRY.values()
