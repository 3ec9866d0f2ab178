"""The records passed between formats, the API and io: layouts, probes, encodings, infos, and
the `Format` record itself.

A format is a small immutable record of pure functions (like optax's
``GradientTransformation``). Layouts are values (`FILE`, `Siblings`,
`DIRECTORY`):

* ``FILE``      - one file; ``decode``/``inspect`` receive a buffer.
* ``Siblings``  - files next to each other (``<p>.npz`` + ``<p>.json``);
  ``layout.locate(path)`` maps roles to paths, and ``decode``/``inspect``
  receive a ``Mapping[role, buffer]`` of those that exist.
* ``DIRECTORY`` - a directory; they receive a ``Mapping[str, buffer]`` of the
  files below it (relative POSIX paths), read lazily on access.

``encode`` returns an `Encoded`: a list of chunks for ``FILE``, or
``files`` (role or relative path -> `Encoded`) for the other layouts.

A format's ``sniff(probe)`` returns a score for a `Probe` (0: not this
format; `MAGIC` for a magic number, `STRUCTURE` for a recognised
structure, `WEAK` for a guess).

Options are declared by the functions that take them: the keyword-only
parameters of ``encode``/``from_model`` are save options, those of
``decode``/``restore``/``to_model`` load options; an option no function
declares raises ``TypeError``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pytreeio.core.binary import Buffer, Deferred, Slots, as_memoryview, chunk_nbytes

#: Meta key under which a ``decode`` called with ``verify=True`` reports what its checks
#: found beyond "no error" (bullet: the quantisation error per tensor); ``ptio.verify``
#: merges it into the returned `Info`'s meta.
REPORT = "pytreeio.report"

#: Sniff scores: a magic number matched, a structure recognised, a weak guess.
MAGIC = 100.0
STRUCTURE = 50.0
WEAK = 1.0


# --------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class File:
    """A checkpoint that is one file."""

    kind: Literal["file"] = "file"


@dataclass(frozen=True)
class Directory:
    """A checkpoint that is a directory of files (written and swapped in as a whole)."""

    kind: Literal["dir"] = "dir"


@dataclass(frozen=True)
class Siblings:
    """A checkpoint made of files next to each other, e.g. ``<p>.npz`` + ``<p>.json``.

    Attributes:
      locate: ``locate(path) -> {role: path}`` of the files that make up the
        checkpoint at ``path`` (existing or to be written).  Pure: it only
        computes names (netcl's lookup order is decided from the probe).
      roles: every role ``locate`` can return, in writing order.
      linked: the roles that are written and read as one set: io saves them
        under one lock with a journal and reads them under a shared lock, so a
        reader sees the complete old or the complete new set (see `pytreeio.io`).
    """

    locate: Callable[[Path], Mapping[str, Path]]
    roles: tuple[str, ...]
    linked: tuple[str, ...] = ()
    kind: Literal["siblings"] = "siblings"


Layout = File | Siblings | Directory

FILE = File()
DIRECTORY = Directory()


@dataclass(frozen=True)
class Probe:
    """What sniffing sees of a path, built by `pytreeio.io.probe` (sniffers never open files).

    Attributes:
      path: the path as given.
      kind: ``"file"``, ``"dir"`` or ``"missing"``.
      head: the first bytes of a file (up to 4 KiB).
      size: a file's size in bytes.
      members: a ZIP file's member names (None when the file is not a ZIP).
      names: a directory's files (relative POSIX paths; None for non-directories).
      heads: the first bytes of a directory's small top-level text files
        (``*.json``, ``*.txt``), by name.
      siblings: for a `Siblings` layout, the probe of each located
        role whose file exists.
    """

    path: Path
    kind: Literal["file", "dir", "missing"] = "file"
    head: bytes = b""
    size: int = 0
    members: tuple[str, ...] | None = None
    names: frozenset[str] | None = None
    heads: Mapping[str, bytes] = field(default_factory=dict)
    siblings: Mapping[str, Probe] = field(default_factory=dict)

    @property
    def is_dir(self) -> bool:
        return self.kind == "dir"

    @property
    def is_file(self) -> bool:
        return self.kind == "file"


# --------------------------------------------------------------------------
# values passed between formats, the API and io
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoded:
    """The output of a format's ``encode``: bytes not yet written anywhere.

    ``chunks`` reference the caller's arrays where possible (no copies);
    ``files`` holds one `Encoded` per file for multi-file layouts.
    ``deferred`` holds errors of a save that partly succeeded (bullet writes
    ``raw.bin`` when quantisation overflows): the API writes what is here,
    then raises them (``strict``) or warns.
    """

    chunks: tuple[Buffer, ...] = ()
    files: Mapping[str, Encoded] | None = None
    deferred: tuple[Exception, ...] = ()
    strict: bool = False

    @property
    def nbytes(self) -> int:
        if self.files is not None:
            return sum(f.nbytes for f in self.files.values())
        return sum(chunk_nbytes(c) for c in self.chunks)

    def tobytes(self) -> bytes:
        """The whole single-file encoding as one ``bytes`` (copies; for tests and small trees).

        `Deferred` chunks are produced here, late ones last, as io writes them.
        """
        if self.files is not None:
            raise TypeError("a multi-file encoding has no single byte string; use .files")
        parts: list[bytes | None] = [None] * len(self.chunks)
        for late in (False, True):
            for i, c in enumerate(self.chunks):
                if not isinstance(c, Deferred):
                    parts[i] = bytes(as_memoryview(c))
                elif c.late == late:
                    parts[i] = bytes(as_memoryview(c.produce()))
        return b"".join(p or b"" for p in parts)

    def __bytes__(self) -> bytes:
        return self.tobytes()


class Decoded(NamedTuple):
    """A format's ``decode`` result: its native tree and its meta document."""

    tree: Any
    meta: dict[str, Any]


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint as `pytreeio.inspect` reports it."""

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
            lines.append("  meta:")
            lines.extend("    " + line for line in _meta_lines(self.meta))
        return "\n".join(lines)


#: Lines of meta that ``str(info)`` shows; ``to_json()`` (``inspect --json``) has all of it.
_META_LINES = 60


def _meta_lines(meta: Mapping[str, Any]) -> list[str]:
    """The meta document as indented JSON, number lists folded onto one line, capped."""
    text = json.dumps(meta, sort_keys=True, indent=2, default=str)
    lines: list[str] = []
    folding = False  # the last line is an open list of numbers
    for line in text.splitlines():
        item = line.strip()
        if folding and _is_number(item.rstrip(",")):
            if len(lines[-1]) < 160:
                lines[-1] += " " + item
            elif not lines[-1].endswith("..."):
                lines[-1] += " ..."
            continue
        if folding and item.rstrip(",") == "]":
            lines[-1] += " " + item
            folding = False
            continue
        folding = item.endswith("[")
        lines.append(line)
    if len(lines) > _META_LINES:
        more = len(lines) - _META_LINES
        lines = [*lines[:_META_LINES], f"... ({more} more lines: --json shows all)"]
    return lines


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------
# the Format record
# --------------------------------------------------------------------------


def _structural_restore(native: Any, meta: dict[str, Any], like: Any) -> Any:
    from pytreeio.core.tree import restore

    return restore(native, like)


# Parameters the API passes itself; never user options.
_POSITIONAL = frozenset(
    {"tree", "native", "meta", "like", "source", "model", "checked", "dest", "lossy"}
)


#: declared_options by function: every load and save asks (an inspect.signature costs ~25 us).
_DECLARED: dict[Any, frozenset[str]] = {}
_DECLARED_MAX = 1024


def declared_options(fn: Callable[..., Any] | None) -> frozenset[str]:
    """The keyword options ``fn`` declares (keyword-only or keyword parameters, minus the API's)."""
    if fn is None:
        return frozenset()
    try:
        return _DECLARED[fn]
    except (KeyError, TypeError):  # TypeError: an unhashable callable, never cached
        pass
    names = _declared_options(fn)
    if len(_DECLARED) < _DECLARED_MAX:
        with contextlib.suppress(TypeError):
            _DECLARED[fn] = names
    return names


def _declared_options(fn: Callable[..., Any]) -> frozenset[str]:
    try:
        import inspect as _inspect  # at registration, not at import (import time)

        sig = _inspect.signature(fn)
    except (TypeError, ValueError):
        return frozenset()
    names = set()
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            raise TypeError(
                f"{getattr(fn, '__qualname__', fn)} takes **{p.name}: a format function must "
                "declare each option it accepts by name"
            )
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in _POSITIONAL:
            if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD:
                continue  # a positional argument, not an option
            names.add(p.name)
    return frozenset(names)


class Format(NamedTuple):
    """A checkpoint format: a record of pure functions plus how it sits on disk.

    Attributes:
      name: registry name, e.g. ``"msgpack"``.
      description: one line for ``pytreeio formats``.
      suffixes: file suffixes that select this format on save (``".msgpack"``).
      layout: `FILE`, a `Siblings` value or `DIRECTORY`.
      encode: ``encode(tree, *, meta=None, [dest=None,] [model=None,] [checked=False,]
        <save options>) -> Encoded``; takes the native tree (and the common shapes
        it documents).  One that declares ``model`` is given the
        `pytreeio.model.form.Model` when ``tree`` and ``meta`` are what
        ``from_model`` made of it, and may skip checking them again; one that
        declares ``checked`` is told so with ``checked=True``.
      decode: ``decode(source, *, <load options>) -> Decoded`` (native tree, meta).
      inspect: ``inspect(source) -> Info`` touching only headers; ``source``
        is a `pytreeio.core.binary.ByteSource` (a mapping of them for
        multi-file layouts) whose ``read(offset, n, field)`` is bounded.
      sniff: ``sniff(probe) -> float``; 0 when the content is not this format.
      restore: ``restore(native, meta, like, *, <load options>) -> tree``:
        the native tree in the structure of a native-shaped ``like``.
        Defaults to structural matching by key path.  (Model-shaped ``like``
        trees go through ``to_model`` instead; see `pytreeio.model.form`.)
      to_model: ``to_model(native, meta, *, <load options>) -> Model`` for
        formats that hold a layered model; None for the others.
      from_model: ``from_model(model, *, <save options>) -> (native, meta)``.
      accepts_meta: ``encode`` uses the caller's ``meta``.
      keeps_meta: the ``meta`` given on save comes back from ``decode``.
      slots: ``slots(source, *, <load options>) -> Slots`` for lazy and partial
        loads (``pytreeio.open``): where each native array lies, read from
        headers only (``source`` as for ``inspect``); None when the format
        has none (lazy views then decode the whole checkpoint once).
      streams: ``encode`` takes `Streamed` array leaves (headers from
        their shapes and dtypes) and emits `Deferred` chunks for their
        data, so conversions into this format stream tensor by tensor.
    """

    name: str
    description: str
    suffixes: tuple[str, ...]
    layout: Layout
    encode: Callable[..., Encoded]
    decode: Callable[..., Decoded]
    inspect: Callable[..., Info]
    sniff: Callable[[Probe], float]
    restore: Callable[..., Any] = _structural_restore
    to_model: Callable[..., Any] | None = None
    from_model: Callable[..., Any] | None = None
    accepts_meta: bool = True
    keeps_meta: bool = True
    slots: Callable[..., Slots] | None = None
    streams: bool = False

    @property
    def is_model_format(self) -> bool:
        return self.to_model is not None and self.from_model is not None

    @property
    def save_options(self) -> frozenset[str]:
        """Options ``save``/``encode`` accept (model formats also take ``layers``)."""
        extra = frozenset({"layers"}) if self.is_model_format else frozenset()
        return declared_options(self.encode) | declared_options(self.from_model) | extra

    @property
    def load_options(self) -> frozenset[str]:
        """Options ``load``/``decode`` accept."""
        return (
            declared_options(self.decode)
            | declared_options(self.restore)
            | declared_options(self.to_model)
            | declared_options(self.slots)
        )

    def check_options(self, options: Mapping[str, Any], direction: str) -> None:
        """Raise ``TypeError`` for options this format does not take in ``direction``."""
        accepted = self.save_options if direction == "save" else self.load_options
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise TypeError(
                f"format {self.name!r} takes no {direction} option(s) {', '.join(unknown)} "
                f"(accepted: {', '.join(sorted(accepted)) or 'none'})"
            )

    def options_for(
        self, fn: Callable[..., Any] | None, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The subset of ``options`` that ``fn`` declares."""
        names = declared_options(fn)
        return {k: v for k, v in options.items() if k in names}
