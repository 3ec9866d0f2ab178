"""The registry of formats: :func:`register`, lookup by name, suffix and sniffed content.

The registry names no format module until it is first consulted: then it imports
the built-in ones (:data:`BUILTIN`), which call :func:`register`, so
``import pytreeio`` stays cheap.
"""

from __future__ import annotations

import importlib
import os
import sys
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

#: The built-in formats: name -> (the module that registers it, its suffixes), in sniffing
#: order (ties go to the first).  A call that names a format, or a path whose suffix names
#: one, imports that format's module alone; sniffing content imports them all.
BUILTIN: dict[str, tuple[str, tuple[str, ...]]] = {
    "safetensors": ("pytreeio.formats.safetensors", (".safetensors",)),
    "tinyllama": ("pytreeio.formats.tinyllama", ()),
    "netcl": ("pytreeio.formats.netcl.model_file", (".netcl",)),
    "netcl-checkpoint": ("pytreeio.formats.netcl.checkpoint", ()),
    "netcl-params": ("pytreeio.formats.netcl.checkpoint", ()),
    "datacode": ("pytreeio.formats.datacode.nn", (".nn",)),
    "waffe2": ("pytreeio.formats.waffe2.state_dict", (".wf2model",)),
    "bullet": ("pytreeio.formats.bullet.checkpoint", ()),
    "msgpack": ("pytreeio.formats.msgpack", (".msgpack", ".flax")),
}
_RANK = {name: i for i, name in enumerate(BUILTIN)}

_REGISTRY: dict[str, Format] = {}


def _import_builtin(name: str) -> None:
    """Import the module that registers the built-in format ``name`` (if it is one)."""
    if name in BUILTIN and name not in _REGISTRY:
        importlib.import_module(BUILTIN[name][0])


def _all() -> list[Format]:
    """Every format, built-in ones first in :data:`BUILTIN` order, then others as registered:
    the order never depends on which formats a process happened to use first."""
    for name in BUILTIN:
        _import_builtin(name)
    return sorted(_REGISTRY.values(), key=lambda f: _RANK.get(f.name, len(_RANK)))


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
    if fmt.name in BUILTIN and BUILTIN[fmt.name][0] not in sys.modules:
        _import_builtin(fmt.name)  # the built-in of that name first, so replace= means the same
    if not replace and fmt.name in _REGISTRY and _REGISTRY[fmt.name] is not fmt:
        raise ValueError(f"a format named {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format (tests and user plug-ins that re-register)."""
    _REGISTRY.pop(name, None)


def formats() -> dict[str, Format]:
    """All registered formats, by name."""
    return {f.name: f for f in _all()}


def get(name: str | Format, *, path: str | os.PathLike[str] | None = None) -> Format:
    """The format called ``name`` (a :class:`Format` is returned as is)."""
    if isinstance(name, Format):
        return name
    if isinstance(name, str):
        _import_builtin(name)
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(formats()))
        raise UnknownFormatError(
            f"unknown format {name!r}; known formats: {known}",
            path=os.fspath(path) if path is not None else None,
        ) from None


def for_suffix(path: str | os.PathLike[str]) -> Format | None:
    """The single format whose suffix ends ``path``, or None (unknown or ambiguous)."""
    name = os.fspath(path).lower()
    # a built-in's suffixes from the table until its module is imported; then from what is
    # registered (so an unregistered or renamed built-in no longer claims them)
    suffixes = {n: sfx for n, (module, sfx) in BUILTIN.items() if module not in sys.modules}
    suffixes.update((f.name, f.suffixes) for f in _REGISTRY.values())
    hits = {
        n: max(len(s) for s in sfx if name.endswith(s))
        for n, sfx in suffixes.items()
        if any(name.endswith(s) for s in sfx)
    }
    best = [n for n, length in hits.items() if length == max(hits.values())]
    return get(best[0]) if len(best) == 1 else None


def best_match(probe_for: Callable[[Layout], Probe]) -> Format | None:
    """The format whose ``sniff`` scores highest on the probe io built for its layout.

    ``probe_for(layout)`` is called once per distinct layout.  A sniffer that
    raises is treated as "not this format": sniffing must never turn a load
    into a crash.  Ties go to the format registered first.
    """
    probes: dict[Layout, Probe] = {}
    best: tuple[float, Format] | None = None
    for fmt in _all():
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
    yield from _all()
