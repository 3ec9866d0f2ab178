"""Formats as values: the :class:`Format` record and the registry of formats.

A format is a small immutable record of pure functions (like optax's
``GradientTransformation``).  Format modules build one and call
:func:`register`; the built-in modules are imported lazily the first time the
registry is consulted, so ``import pytreeio`` stays cheap.

Layouts:

* ``"file"``  - one file; ``decode``/``inspect`` receive a buffer.
* ``"dir"``   - a directory; they receive a ``Mapping[str, buffer]`` of the
  files below it (relative POSIX paths), read lazily on access.
* ``"files"`` - sibling files (``<p>.npz`` + ``<p>.json``); ``locate(path)``
  maps roles to paths and they receive a ``Mapping[role, buffer]`` of those
  that exist.

``encode`` returns an :class:`Encoded`: a list of chunks for ``"file"``, or
``files`` (relative path or role -> :class:`Encoded`) for the other layouts.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from .binary import Buffer, as_memoryview
from .errors import UnknownFormatError

__all__ = [
    "Format",
    "Encoded",
    "Decoded",
    "Entry",
    "Info",
    "Probe",
    "register",
    "get",
    "formats",
    "for_suffix",
    "sniff",
]

Layout = Literal["file", "dir", "files"]

#: Modules under ``pytreeio.fmt`` that register the built-in formats.
BUILTIN_MODULES: tuple[str, ...] = (
    "safetensors",
    "tinyllama",
    "netcl",
    "msgpack",
)


@dataclass(frozen=True)
class Encoded:
    """The output of a format's ``encode``: bytes not yet written anywhere.

    ``chunks`` reference the caller's arrays where possible (no copies);
    ``files`` holds one :class:`Encoded` per file for multi-file layouts.
    """

    chunks: tuple[Buffer, ...] = ()
    files: Mapping[str, Encoded] | None = None

    @property
    def is_multi_file(self) -> bool:
        return self.files is not None

    @property
    def nbytes(self) -> int:
        if self.files is not None:
            return sum(f.nbytes for f in self.files.values())
        return sum(len(as_memoryview(c)) for c in self.chunks)

    def tobytes(self) -> bytes:
        """The whole single-file encoding as one ``bytes`` (copies; for tests and small trees)."""
        if self.files is not None:
            raise TypeError("a multi-file encoding has no single byte string; use .files")
        return b"".join(as_memoryview(c) for c in self.chunks)

    def __bytes__(self) -> bytes:
        return self.tobytes()


class Decoded(NamedTuple):
    """A format's ``decode`` result: its native tree and its meta document."""

    tree: Any
    meta: dict[str, Any]


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint as :func:`pytreeio.inspect` reports it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class Info:
    """What a checkpoint holds, read from its headers only."""

    format: str
    entries: tuple[Entry, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    @property
    def nbytes(self) -> int:
        """Total tensor bytes."""
        return sum(e.nbytes for e in self.entries)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "nbytes": self.nbytes,
            "entries": [e.to_json() for e in self.entries],
            "meta": self.meta,
        }

    def __str__(self) -> str:
        head = f"{self.path}: " if self.path else ""
        lines = [f"{head}format {self.format}, {len(self.entries)} entries, {_human(self.nbytes)}"]
        if self.entries:
            w_name = max(len(e.name) for e in self.entries)
            w_shape = max(len(str(list(e.shape))) for e in self.entries)
            w_dtype = max(len(e.dtype) for e in self.entries)
            for e in self.entries:
                lines.append(
                    f"  {e.name:<{w_name}}  {list(e.shape)!s:<{w_shape}}  "
                    f"{e.dtype:<{w_dtype}}  {e.nbytes:>12,d} B"
                )
        if self.meta:
            text = json.dumps(self.meta, sort_keys=True, default=str)
            if len(text) > 400:
                text = text[:400] + "..."
            lines.append(f"  meta: {text}")
        return "\n".join(lines)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Probe:
    """What sniffing sees of a path: the first bytes of a file, or a directory's file names."""

    path: Path
    head: bytes = b""
    size: int = 0
    names: frozenset[str] | None = None  # relative POSIX paths of a directory's files

    @property
    def is_dir(self) -> bool:
        return self.names is not None


def _no_restore(native: Any, meta: dict[str, Any], like: Any, **options: Any) -> Any:
    from .tree import restore

    return restore(native, like)


class Format(NamedTuple):
    """A checkpoint format: a record of pure functions plus how it sits on disk.

    Attributes:
      name: registry name, e.g. ``"msgpack"``.
      description: one line for ``pytreeio formats``.
      suffixes: file suffixes that select this format on save (``".msgpack"``).
      layout: ``"file"``, ``"dir"`` or ``"files"`` (see the module docstring).
      encode: ``encode(tree, *, meta=None, **options) -> Encoded``; accepts the
        native tree and the common layouts it documents.
      decode: ``decode(source, **options) -> Decoded`` (native tree, meta).
      inspect: ``inspect(source) -> Info`` touching only headers; ``source``
        is a :class:`pytreeio.binary.ByteSource` (or, for multi-file layouts,
        a mapping of them) whose ``read(offset, n, field)`` is bounded.
      sniff: ``sniff(probe) -> bool``; True when the content is this format.
      restore: ``restore(native, meta, like, **options) -> tree``: maps the
        native tree onto the caller's ``like`` (naming conventions, layout
        transposes).  Defaults to structural matching by key path.
      locate: for layout ``"files"``: ``locate(path) -> {role: path}`` of the
        files making up the checkpoint (existing or to be written).
      stores_meta: whether ``meta`` survives a save in this format.
      sniff_priority: formats with higher values are sniffed first; formats
        without a magic number (msgpack) use a negative value.
      load_options: the keyword options ``load``/``decode`` accept (passed to
        both ``decode`` and ``restore``); others raise ``TypeError``.  None
        leaves the checking to the format.
    """

    name: str
    description: str
    suffixes: tuple[str, ...]
    layout: Layout
    encode: Callable[..., Encoded]
    decode: Callable[..., Decoded]
    inspect: Callable[..., Info]
    sniff: Callable[[Probe], bool]
    restore: Callable[..., Any] = _no_restore
    locate: Callable[[Path], Mapping[str, Path]] | None = None
    stores_meta: bool = True
    sniff_priority: int = 0
    load_options: frozenset[str] | None = frozenset()


_REGISTRY: dict[str, Format] = {}
_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    for module in BUILTIN_MODULES:
        importlib.import_module(f"pytreeio.fmt.{module}")
    _builtins_loaded = True


def register(fmt: Format, *, replace: bool = False) -> Format:
    """Add ``fmt`` to the registry under ``fmt.name`` and return it."""
    if not replace and fmt.name in _REGISTRY and _REGISTRY[fmt.name] is not fmt:
        raise ValueError(f"a format named {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def formats() -> dict[str, Format]:
    """All registered formats, by name."""
    _load_builtins()
    return dict(_REGISTRY)


def get(name: str | Format) -> Format:
    """The format called ``name`` (a :class:`Format` is returned as is)."""
    if isinstance(name, Format):
        return name
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownFormatError(f"unknown format {name!r}; known formats: {known}") from None


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


def sniff(probe: Probe) -> Format | None:
    """The first registered format that recognises ``probe``'s content."""
    _load_builtins()
    for fmt in sorted(_REGISTRY.values(), key=lambda f: -f.sniff_priority):
        try:
            if fmt.sniff(probe):
                return fmt
        except Exception:  # a sniffer must never turn a load into a crash
            continue
    return None


def iter_formats() -> Iterator[Format]:
    _load_builtins()
    yield from _REGISTRY.values()


def names(fmts: Sequence[Format]) -> list[str]:
    return [f.name for f in fmts]
