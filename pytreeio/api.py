"""The public functions: save, load, inspect, convert, encode, decode.

This module only dispatches: it picks a format (by name, suffix or content),
hands buffers to the format's pure functions, and hands their output to
:mod:`pytreeio.io`.  It knows nothing about any particular format.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import io, registry
from .binary import BufferSource, as_memoryview
from .errors import FormatError, MismatchError, UnknownFormatError
from .registry import Encoded, Format, Info, Probe

__all__ = ["save", "load", "inspect", "convert", "encode", "decode", "formats", "verify"]

PathLike = str | os.PathLike[str]
_SNIFF_BYTES = 512


def formats() -> dict[str, Format]:
    """All registered formats, by name."""
    return registry.formats()


# --------------------------------------------------------------------------
# choosing a format
# --------------------------------------------------------------------------


def _format_for_save(path: PathLike, format: str | Format | None) -> Format:
    if format is not None:
        return registry.get(format)
    fmt = registry.for_suffix(path)
    if fmt is None:
        names = ", ".join(sorted(registry.formats()))
        raise UnknownFormatError(
            f"cannot tell the format of {os.fspath(path)!r} from its suffix; pass format= "
            f"(one of: {names})"
        )
    return fmt


def _probe(path: Path) -> Probe:
    if path.is_dir():
        return Probe(path, names=frozenset(io.FileSet.directory(path)))
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
        size = os.fstat(f.fileno()).st_size
    return Probe(path, head=head, size=size)


def _format_for_load(path: PathLike, format: str | Format | None) -> Format:
    if format is not None:
        return registry.get(format)
    p = Path(path)
    if p.exists():
        fmt = registry.sniff(_probe(p))
        if fmt is None:
            # Content unrecognised: a suffix still names the format, whose
            # decoder then says precisely what is wrong with the bytes.
            fmt = registry.for_suffix(p) if p.is_file() else None
        if fmt is None:
            raise UnknownFormatError(
                f"{os.fspath(path)}: content matches no registered format; pass format="
            )
        return fmt
    # Multi-file formats may be addressed by a stem that is not itself a file.
    for fmt in registry.iter_formats():
        if fmt.layout == "files" and fmt.locate is not None:
            roles = fmt.locate(p)
            if any(Path(r).is_file() for r in roles.values()) and fmt.sniff(Probe(p)):
                return fmt
    raise FileNotFoundError(2, "No such file or directory", os.fspath(path))


# --------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------


def _open_source(path: PathLike, fmt: Format, *, mmap: bool, headers: bool = False) -> Any:
    p = Path(path)
    if fmt.layout == "file":
        if p.is_dir():
            raise FormatError(
                f"format {fmt.name!r} is a single file, but this is a directory", path=str(p)
            )
        return io.FileSource(p) if headers else io.read_file(p, mmap=mmap)
    if fmt.layout == "dir":
        if not p.is_dir():
            if not p.exists():
                raise FileNotFoundError(2, "No such file or directory", str(p))
            raise FormatError(
                f"format {fmt.name!r} is a directory, but this is a file", path=str(p)
            )
        return io.FileSet.directory(p, mmap=mmap, headers=headers)
    assert fmt.locate is not None, f"format {fmt.name} has layout 'files' but no locate()"
    located = io.FileSet.existing(fmt.locate(p), mmap=mmap, headers=headers)
    if not len(located):
        raise FileNotFoundError(2, "No such file or directory", str(p))
    return located


def _check_load_options(fmt: Format, options: Mapping[str, Any]) -> None:
    if fmt.load_options is None:
        return
    unknown = sorted(set(options) - fmt.load_options)
    if unknown:
        accepted = ", ".join(sorted(fmt.load_options)) or "none"
        raise TypeError(
            f"format {fmt.name!r} does not take the load option(s) {', '.join(unknown)} "
            f"(accepted: {accepted})"
        )


@contextmanager
def _errors_located(path: PathLike | None, source: Any = None) -> Iterator[None]:
    """Fill in the file of errors that pure functions raise without one."""
    try:
        yield
    except (FormatError, MismatchError) as exc:
        if path is not None:
            if exc.path is None:
                exc.path = os.fspath(path)
            elif isinstance(source, io.FileSet) and exc.path in source:
                exc.path = source.path_of(exc.path)
        raise


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------


def encode(
    tree: Any, format: str | Format, *, meta: Mapping[str, Any] | None = None, **options: Any
) -> Encoded:
    """Encode ``tree`` in ``format`` without touching the file system."""
    fmt = registry.get(format)
    return fmt.encode(tree, meta=dict(meta) if meta is not None else None, **options)


def _as_source(data: Any, fmt: Format) -> Any:
    if isinstance(data, Encoded):
        if data.files is not None:
            return {k: memoryview(v.tobytes()) for k, v in data.files.items()}
        if len(data.chunks) == 1:
            return as_memoryview(data.chunks[0])
        return memoryview(data.tobytes())
    if isinstance(data, Mapping):
        return {k: as_memoryview(v) for k, v in data.items()}
    return as_memoryview(data)


def decode(data: Any, format: str | Format, *, like: Any = None, **options: Any) -> Any:
    """Decode an :class:`Encoded` or a buffer (a mapping of them for multi-file formats).

    Returns the native tree, or the tree restored into ``like``'s structure.
    """
    fmt = registry.get(format)
    _check_load_options(fmt, options)
    native, meta = fmt.decode(_as_source(data, fmt), **options)
    if like is None:
        return native
    return fmt.restore(native, meta, like, **options)


def save(
    path: PathLike,
    tree: Any,
    format: str | Format | None = None,
    *,
    meta: Mapping[str, Any] | None = None,
    durable: bool = True,
    **options: Any,
) -> None:
    """Save ``tree`` to ``path`` atomically.

    Args:
      path: destination file (or directory, for directory formats).
      tree: any pytree the format accepts; it is never modified.
      format: format name; by default chosen from the suffix of ``path``.
      meta: the format's non-tensor information (see each format's docs).
      durable: fsync the file and its directory (default).  ``False`` keeps
        the atomic rename but skips the fsyncs.
      **options: format-specific options.
    """
    fmt = _format_for_save(path, format)
    encoded = fmt.encode(tree, meta=dict(meta) if meta is not None else None, **options)
    io.write_atomic(path, encoded, layout=fmt.layout, locate=fmt.locate, durable=durable)


def _decode_path(
    path: PathLike, format: str | Format | None, mmap: bool, options: Mapping[str, Any]
) -> tuple[Format, Any, dict[str, Any]]:
    fmt = _format_for_load(path, format)
    _check_load_options(fmt, options)
    source = _open_source(path, fmt, mmap=mmap)
    with _errors_located(path, source):
        native, meta = fmt.decode(source, **options)
    return fmt, native, meta


def load(
    path: PathLike,
    like: Any = None,
    *,
    format: str | Format | None = None,
    mmap: bool = False,
    **options: Any,
) -> Any:
    """Load a checkpoint.

    Args:
      path: the file or directory.
      like: a pytree (arrays or ``jax.ShapeDtypeStruct``) whose structure,
        shapes and dtypes the result must have; leaves come back as the same
        kind (numpy, jax arrays on ``like``'s sharding, Python scalars).
        Without it, the format's native tree is returned.
      format: format name; by default sniffed from the content.
      mmap: map the file instead of reading it; arrays are then read-only
        views of the mapping.
      **options: format-specific options.

    Raises:
      FormatError: the bytes are malformed (names the file, field, offset).
      MismatchError: the file and ``like`` disagree (names the key path).
    """
    fmt, native, meta = _decode_path(path, format, mmap, options)
    if like is None:
        return native
    with _errors_located(path):
        return fmt.restore(native, meta, like, **options)


def load_with_meta(
    path: PathLike, *, format: str | Format | None = None, mmap: bool = False, **options: Any
) -> tuple[Any, dict[str, Any]]:
    """The native tree and the meta document of a checkpoint."""
    _, native, meta = _decode_path(path, format, mmap, options)
    return native, meta


def inspect(path: PathLike, format: str | Format | None = None) -> Info:
    """What a checkpoint holds (entries, shapes, dtypes, meta), reading headers only."""
    fmt = _format_for_load(path, format)
    source = _open_source(path, fmt, mmap=False, headers=True)
    try:
        with _errors_located(path, source):
            info = fmt.inspect(source)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    return Info(format=info.format, entries=info.entries, meta=info.meta, path=os.fspath(path))


def inspect_buffer(data: Any, format: str | Format) -> Info:
    """:func:`inspect` for an in-memory single-file encoding."""
    fmt = registry.get(format)
    return fmt.inspect(BufferSource(_as_source(data, fmt)))


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    to: str | Format,
    from_: str | Format | None = None,
    meta: Mapping[str, Any] | None = None,
    durable: bool = True,
    **options: Any,
) -> None:
    """Re-encode the checkpoint at ``src`` as ``to`` at ``dst``.

    The source's native tree is handed to the target format; its meta is
    carried over unless ``meta`` is given.  A target that cannot store meta
    drops it with a warning (never silently).
    """
    target = registry.get(to)
    _, native, src_meta = _decode_path(src, from_, False, {})
    out_meta = dict(meta) if meta is not None else src_meta
    if out_meta and not target.stores_meta:
        warnings.warn(
            f"format {target.name!r} cannot store meta; dropping {sorted(out_meta)}",
            stacklevel=2,
        )
        out_meta = {}
    encoded = target.encode(native, meta=out_meta or None, **options)
    io.write_atomic(dst, encoded, layout=target.layout, locate=target.locate, durable=durable)


def verify(path: PathLike, format: str | Format | None = None) -> Info:
    """Decode a whole checkpoint (every byte checked) and return its :class:`Info`."""
    load(path, format=format)
    return inspect(path, format=format)
