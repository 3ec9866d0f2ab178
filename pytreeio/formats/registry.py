"""The registry of formats: `register`, lookup by name, suffix and sniffed content.

The registry names no format module until it is first consulted: then it imports
the built-in ones (`BUILTIN`), which call `register`, so
``import pytreeio`` stays cheap.

Installed distributions add formats through the entry-point group ``pytreeio.formats``
(`GROUP`): each entry point names a `Format` record, or a function of no arguments
that returns one, and its name must be the format's name.  Plug-ins extend the built-in and
registered formats and never override them:

* a name is looked up among plug-ins only when no built-in or registered format has it (a
  plug-in named like a built-in is never used; one named like a registered format gives way);
* a path's suffix selects a plug-in only when no built-in or registered format claims it;
* sniffing asks the plug-ins only when no built-in or registered format recognises the content,
  so a plug-in never takes a file a built-in claims;
* a plug-in that fails to load (import error, not a Format, a name that differs, two
  distributions claiming one name) is left out of listings and sniffing with a
  `PytreeioWarning`, and asked for by name raises `UnknownFormatError` saying why.

A plug-in once loaded is remembered, as a registered format is (and its module stays imported);
one that cannot be used is not, so a fixed install is seen at the next look.  The entry points
(10-30 ms to read) are read afresh, never cached, and only when what is loaded does not answer:
a name, a suffix or content no loaded format knows, and every listing; never at import nor for
a built-in's name, suffix or file.  Loaded plug-ins are asked before the entry points are read,
so of two plug-ins claiming one suffix or file the loaded one is used.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from pytreeio.core.calls import keywords_explained
from pytreeio.core.errors import PytreeioWarning, UnknownFormatError
from pytreeio.core.records import Directory, File, Format, Layout, Probe, Siblings, declared_options

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = [
    "BUILTIN",
    "GROUP",
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

#: The entry-point group through which installed distributions add formats.
GROUP = "pytreeio.formats"

_REGISTRY: dict[str, Format] = {}
#: Plug-ins loaded from their entry points, remembered as registered formats are (see
#: the module docstring); a registered format of the same name takes precedence.
_PLUGINS: dict[str, Format] = {}
_LOADING: set[str] = set()  # the plug-ins being loaded now
_LOCK = threading.RLock()  # re-entrant: a plug-in's own code may call the registry as it loads


def _import_builtin(name: str) -> None:
    """Import the module that registers the built-in format ``name`` (if it is one)."""
    if name in BUILTIN and name not in _REGISTRY:
        importlib.import_module(BUILTIN[name][0])


def _order(fmt: Format) -> tuple[int, str]:
    """Built-in formats in `BUILTIN` order, then the others by name, so the order never
    depends on what a process used first."""
    return _RANK.get(fmt.name, len(_RANK)), fmt.name


def _known() -> list[Format]:
    """The built-in and registered formats (no plug-ins), in `_order`."""
    for name in BUILTIN:
        _import_builtin(name)
    return sorted(_REGISTRY.values(), key=_order)


def _all() -> list[Format]:
    """Every format, plug-ins included (the entry points read now), in `_order`."""
    return sorted([*_known(), *_plugins()], key=_order)


def _check(fmt: Format) -> None:
    """Raise ``TypeError`` unless ``fmt`` is a well-formed `Format`."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register() takes a pytreeio.Format, not {type(fmt).__name__}")
    if not isinstance(fmt.layout, File | Siblings | Directory):
        raise TypeError(f"format {fmt.name!r}: layout must be FILE, Siblings(...) or DIRECTORY")
    for fn in (fmt.encode, fmt.decode, fmt.restore, fmt.to_model, fmt.from_model, fmt.slots):
        declared_options(fn)  # raises for **kwargs


@keywords_explained
def register(fmt: Format, *, replace: bool = False) -> Format:
    """Add ``fmt`` to the registry under ``fmt.name`` and return it.

    Checks that every function declares its options by name (no ``**kwargs``),
    so that a misspelt option is a ``TypeError`` rather than silently ignored.
    A registered format takes precedence over an installed plug-in of the same name.
    """
    _check(fmt)
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
    """All formats, by name: built-in, registered and installed plug-ins (see `_all`)."""
    return {f.name: f for f in _all()}


def get(name: str | Format, *, path: str | os.PathLike[str] | None = None) -> Format:
    """The format called ``name`` (a `Format` is returned as is)."""
    if isinstance(name, Format):
        return name
    where = os.fspath(path) if path is not None else None
    if isinstance(name, str):
        _import_builtin(name)
        if name in _REGISTRY:
            return _REGISTRY[name]
        if name in _PLUGINS:
            return _PLUGINS[name]
        eps = None if name in BUILTIN else _entry_points().get(name)
        if eps:
            return _load(name, eps, path=where)
    known = ", ".join(sorted(formats()))
    raise UnknownFormatError(f"unknown format {name!r}; known formats: {known}", path=where)


def _longest(path: str, suffixes: dict[str, tuple[str, ...]]) -> list[str]:
    """The names whose suffix ending ``path`` is the longest (empty when none ends it)."""
    hits = {
        n: max(len(s) for s in sfx if path.endswith(s))
        for n, sfx in suffixes.items()
        if any(path.endswith(s) for s in sfx)
    }
    return [n for n, length in hits.items() if length == max(hits.values())]


def for_suffix(path: str | os.PathLike[str]) -> Format | None:
    """The single format whose suffix ends ``path``, or None (unknown or ambiguous).

    Plug-ins are asked only when no built-in or registered format claims the suffix, so a
    plug-in can neither take a built-in's suffix nor make it ambiguous.
    """
    name = os.fspath(path).lower()
    # a built-in's suffixes from the table until its module is imported; then from what is
    # registered (so an unregistered or renamed built-in no longer claims them)
    suffixes = {n: sfx for n, (module, sfx) in BUILTIN.items() if module not in sys.modules}
    suffixes.update((f.name, f.suffixes) for f in _REGISTRY.values())
    best = _longest(name, suffixes)
    if best:
        return get(best[0]) if len(best) == 1 else None
    for plugins in (_loaded, _plugins):  # the entry points are read only if no loaded one claims it
        found = {f.name: f for f in plugins()}
        best = _longest(name, {n: f.suffixes for n, f in found.items()})
        if best:
            return found[best[0]] if len(best) == 1 else None
    return None


def best_match(probe_for: Callable[[Layout], Probe]) -> Format | None:
    """The format whose ``sniff`` scores highest on the probe io built for its layout.

    ``probe_for(layout)`` is called once per distinct layout.  A sniffer that
    raises is treated as "not this format": sniffing must never turn a load
    into a crash.  The built-in and registered formats are asked first, then the
    loaded plug-ins, then (the entry points read) every plug-in; ties go to the
    format listed first by `formats`.
    """
    probes: dict[Layout, Probe] = {}

    def best(fmts: Iterable[Format]) -> Format | None:
        top: tuple[float, Format] | None = None
        for fmt in fmts:
            if fmt.layout not in probes:
                probes[fmt.layout] = probe_for(fmt.layout)
            try:
                score = float(fmt.sniff(probes[fmt.layout]))
            except Exception:
                continue
            if score > 0 and (top is None or score > top[0]):
                top = (score, fmt)
        return top[1] if top else None

    return best(_known()) or best(_loaded()) or best(_plugins())


def iter_formats() -> Iterator[Format]:
    yield from _all()


# --------------------------------------------------------------------------
# plug-ins: the entry points of GROUP
# --------------------------------------------------------------------------


def _loaded() -> list[Format]:
    """The plug-ins loaded so far that no registered format shadows, by name."""
    return [f for n, f in sorted(_PLUGINS.items()) if n not in _REGISTRY]


def _plugins() -> list[Format]:
    """Every usable plug-in, the entry points read now; those not loaded yet are loaded (and
    remembered), each that cannot be used is left out with a warning."""
    with _LOCK:  # a plug-in that lists the formats while it loads is left out, silently
        for name, eps in _entry_points().items():
            if name in BUILTIN:
                which = "; ".join(map(_describe, eps))
                _warn(
                    f"plug-in format {name!r} ({which}) is not used: a built-in format has that name"
                )
            elif name not in _REGISTRY and name not in _PLUGINS and name not in _LOADING:
                try:
                    _load(name, eps)
                except UnknownFormatError as exc:
                    _warn(f"{exc.reason}; it is left out")
        return _loaded()


def _entry_points() -> dict[str, list[EntryPoint]]:
    """The entry points of `GROUP` installed now, by name (read afresh each call)."""
    from importlib.metadata import entry_points  # here, not at import: it costs tens of ms

    found: dict[str, dict[str, EntryPoint]] = {}
    try:
        for ep in entry_points(group=GROUP):
            found.setdefault(ep.name, {}).setdefault(ep.value, ep)  # the same object twice: once
    except Exception as exc:  # unreadable metadata must not break the built-in formats
        _warn(f"cannot read the installed plug-in formats: {type(exc).__name__}: {exc}")
        return {}
    return {name: list(eps.values()) for name, eps in sorted(found.items())}


def _describe(ep: EntryPoint) -> str:
    try:
        dist = f"distribution {ep.dist.name} {ep.dist.version}" if ep.dist else "no distribution"
    except Exception:
        dist = "a distribution whose metadata cannot be read"
    return f"entry point '{ep.name} = {ep.value}' of {dist}"


def _warn(message: str) -> None:
    warnings.warn(message, PytreeioWarning, stacklevel=2)


def _load(name: str, eps: list[EntryPoint], *, path: str | None = None) -> Format:
    """Load plug-in ``name`` and remember it; `UnknownFormatError` says why it cannot be
    used (and nothing is remembered, so the next look tries again)."""
    with _LOCK:
        if name in _PLUGINS:  # another thread loaded it meanwhile
            return _PLUGINS[name]
        if name in _LOADING:  # its factory lists the formats, say: no endless recursion
            raise UnknownFormatError(
                f"plug-in format {name!r} was asked for while it was being loaded", path=path
            )
        _LOADING.add(name)
        try:
            _PLUGINS[name] = _import(name, eps, path)
        finally:
            _LOADING.discard(name)
        return _PLUGINS[name]


def _import(name: str, eps: list[EntryPoint], path: str | None) -> Format:
    """The checked format of plug-in ``name``'s entry point (see `_load`)."""

    def refuse(why: str) -> UnknownFormatError:
        return UnknownFormatError(f"plug-in format {name!r} {why}", path=path)

    if len(eps) > 1:
        which = "; ".join(map(_describe, eps))
        raise refuse(f"is provided by {len(eps)} entry points ({which}); uninstall all but one")
    what = f"({_describe(eps[0])})"
    try:
        obj = eps[0].load()
        fmt = obj() if callable(obj) and not isinstance(obj, Format) else obj
    except Exception as exc:
        raise refuse(f"{what} failed to load: {type(exc).__name__}: {exc}") from exc
    if not isinstance(fmt, Format):
        raise refuse(
            f"{what} {'names' if fmt is obj else 'returned'} an object of type "
            f"{type(fmt).__name__}: an entry point must name a pytreeio.Format or a function "
            "of no arguments that returns one"
        )
    if fmt.name != name:
        raise refuse(f"{what} is a Format named {fmt.name!r}: the two names must be the same")
    try:
        _check(fmt)
    except TypeError as exc:
        raise refuse(f"{what} is not a valid format: {exc}") from exc
    return fmt
