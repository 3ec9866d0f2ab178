"""The engine under the public functions: choosing a format, routing options, encoding trees
(through the common model form where it applies), restoring into ``like``, and decoding
the checkpoint at a path.

`pytreeio.api` and the other facades (lazy views, async saves, integrity checks,
saves in parts, conversion) are thin callers of these functions.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from pytreeio import io
from pytreeio.core import records, shards
from pytreeio.core.binary import as_memoryview
from pytreeio.core.errors import FormatError, MismatchError, PytreeioWarning, UnknownFormatError
from pytreeio.core.records import Encoded, File, Format, Siblings
from pytreeio.formats import registry

__all__ = [
    "FORMAT_KEY",
    "carried",
    "OPENS",
    "as_source",
    "encoding_of",
    "call",
    "close_source",
    "decode_path",
    "deliver_deferred",
    "encode_tree",
    "errors_located",
    "format_for_load",
    "format_for_save",
    "from_model_of",
    "reopening",
    "save_tree",
    "restore_tree",
    "takes",
]

PathLike = str | os.PathLike[str]
T = TypeVar("T")

# --------------------------------------------------------------------------
# choosing a format
# --------------------------------------------------------------------------


def format_for_save(path: PathLike, format: str | Format | None) -> Format:
    if format is not None:
        return registry.get(format, path=path)
    fmt = registry.for_suffix(path)
    if fmt is None:
        names = ", ".join(sorted(registry.formats()))
        raise UnknownFormatError(
            f"cannot tell the format from the suffix; pass format= (one of: {names})",
            path=os.fspath(path),
        )
    return fmt


def format_for_load(path: PathLike, format: str | Format | None) -> Format:
    if format is not None:
        return registry.get(format, path=path)
    seen: list[records.Probe] = []
    made: dict[Path, records.Probe] = {}  # the file's own probe, made once for every layout

    def probe_for(layout: records.Layout) -> records.Probe:
        probe = io.probe(path, layout, made=made)
        seen.append(probe)
        return probe

    fmt = registry.best_match(probe_for)
    if fmt is not None:
        return fmt
    if all(p.kind == "missing" and not p.siblings for p in seen):
        raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
    # Content unrecognised: a suffix still names the format, whose decoder
    # then says precisely what is wrong with the bytes.
    fmt = registry.for_suffix(path) if io.is_file(path) else None
    if fmt is None:
        raise UnknownFormatError(
            "the content matches no registered format; pass format=", path=os.fspath(path)
        )
    return fmt


# --------------------------------------------------------------------------
# options and errors
# --------------------------------------------------------------------------


@contextmanager
def errors_located(path: PathLike | None, source: Any = None) -> Iterator[None]:
    """Fill in the file of errors that pure functions raise without one."""
    try:
        yield
    except (FormatError, MismatchError) as exc:
        if path is not None:
            if exc.path is None:
                exc.path = os.fspath(path)
            elif isinstance(source, io.FileSet):  # a role or a directory's relative path
                exc.path = source.path_of(exc.path)
            elif not os.path.isabs(exc.path) and os.path.isdir(path):  # a directory's file
                exc.path = os.path.join(path, exc.path)
        raise


#: What a save waits for before it writes to a destination: `pytreeio.async_save` adds its
#: ``wait_for`` when imported, so that saves to one destination land in the order made.
_PENDING: list[Callable[[PathLike], None]] = []


def wait_before_saving(wait: Callable[[PathLike], None]) -> None:
    """Have every save to a path call ``wait(path)`` before it writes (once per ``wait``)."""
    if wait not in _PENDING:
        _PENDING.append(wait)


def after_pending_saves(path: PathLike) -> None:
    """Wait for the saves to ``path`` still pending elsewhere (see `wait_before_saving`)."""
    for wait in _PENDING:
        wait(path)


def deliver_deferred(encoded: Encoded) -> None:
    """Raise (strict) or warn about the errors of a save that partly succeeded, after the write."""
    for exc in encoded.deferred:
        if encoded.strict:
            raise exc
        warnings.warn(str(exc), PytreeioWarning, stacklevel=3)


# --------------------------------------------------------------------------
# trees <-> encodings, through the common model form where it applies
# --------------------------------------------------------------------------


def call(fn: Any, fmt: Format, options: Mapping[str, Any], *args: Any, **fixed: Any) -> Any:
    return fn(*args, **fixed, **fmt.options_for(fn, options))


def encode_tree(
    fmt: Format,
    tree: Any,
    meta: Mapping[str, Any] | None,
    options: Mapping[str, Any],
    dest: PathLike | None,
    *,
    lossy: bool = False,
    model: Any = None,
) -> Encoded:
    """Encode ``tree`` (or ``model``, already in the common form) in ``fmt``."""
    from pytreeio.core.tree import refuse_keys
    from pytreeio.model import form as model_mod

    fmt.check_options(options, "save")
    refuse_keys(model if model is not None else tree, fmt.name)  # typed PRNG keys: named, early
    if model is None:  # every accelerator array's copy to the host at once, not one by one
        shards.start_host_copies(tree)
    opts = dict(options)
    layers = opts.pop("layers", None)
    out_meta: dict[str, Any] | None = dict(meta) if meta is not None else None
    shape = model_mod.model_like_shape(tree) if model is None and fmt.is_model_format else None
    if shape is not None:
        hint = layers if layers is not None else model_mod.layer_list(meta)
        model = model_mod.model_of(tree, layers=hint)
        tree, out_meta = from_model_of(fmt, model, opts, out_meta, lossy)
    elif model is None and layers is not None:
        raise TypeError(
            f"layers= describes a Flax model, and this tree is not one (format {fmt.name!r} "
            "takes its native tree as is)"
        )
    elif model is not None:
        tree, out_meta = from_model_of(fmt, model, opts, out_meta, lossy)
    converted = shape is not None or model is not None  # tree and meta are from_model's
    if out_meta and not fmt.accepts_meta:
        warnings.warn(
            f"format {fmt.name!r} cannot store meta; dropping {sorted(out_meta)}",
            PytreeioWarning,
            stacklevel=3,
        )
        out_meta = None
    enc_fixed: dict[str, Any] = {"meta": out_meta}
    if model is not None and takes(fmt.encode, "model"):  # the tree is from_model's: checked
        enc_fixed["model"] = model
    if converted and takes(fmt.encode, "checked"):
        enc_fixed["checked"] = True
    if takes(fmt.encode, "dest"):
        enc_fixed["dest"] = os.fspath(dest) if dest is not None else None
    return call(fmt.encode, fmt, opts, tree, **enc_fixed)


def from_model_of(
    fmt: Format, model: Any, opts: Mapping[str, Any], meta: dict[str, Any] | None, lossy: bool
) -> tuple[Any, Any]:
    """``fmt.from_model(model, ...)``: the native tree and meta document of ``model``."""
    assert fmt.from_model is not None
    fixed: dict[str, Any] = {"meta": meta}
    if takes(fmt.from_model, "lossy"):
        fixed["lossy"] = lossy
    return call(fmt.from_model, fmt, opts, model, **fixed)


def takes(fn: Any, name: str) -> bool:
    import inspect as _inspect

    try:
        return name in _inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def restore_tree(
    fmt: Format, native: Any, meta: dict[str, Any], like: Any, options: Mapping[str, Any]
) -> Any:
    """``native`` in ``like``'s structure; a failure leaves nothing of the partial result alive."""
    try:
        return _restore_into(fmt, native, meta, like, options)
    except BaseException as exc:
        # The traceback keeps the finished frames, and their locals the arrays (device
        # buffers too) built before the failure: clear them, so a caller holding the
        # error holds none of the half-restored tree.
        traceback.clear_frames(exc.__traceback__)
        raise


def _restore_into(
    fmt: Format, native: Any, meta: dict[str, Any], like: Any, options: Mapping[str, Any]
) -> Any:
    from pytreeio.model import form as model_mod

    if model_mod.model_like_shape(like) is not None:
        # a model format, or a generic file carrying one's native tree (see pytreeio.engine.conversion)
        source, source_meta = (fmt, meta) if fmt.is_model_format else carried(fmt, meta)
        if source.is_model_format:
            to_model = source.to_model
            assert to_model is not None
            fixed = {"like": like} if takes(to_model, "like") else {}
            model = call(to_model, source, options, native, source_meta, **fixed)
            return model_mod.restore_model(model, like)
    return call(fmt.restore, fmt, options, native, meta, like)


#: The reserved meta key naming the format whose native tree a generic checkpoint carries.
FORMAT_KEY = "pytreeio.format"


def carried(fmt: Format, meta: Any) -> tuple[Format, Any]:
    """``(format, meta)`` of the tree a checkpoint of ``fmt`` holds.

    A generic checkpoint whose meta names a model format under
    `FORMAT_KEY` holds that format's native tree: the named format and
    the meta without the key.  Any other checkpoint holds its own format's tree.
    """
    if fmt.is_model_format or not isinstance(meta, Mapping) or FORMAT_KEY not in meta:
        return fmt, meta
    name = meta[FORMAT_KEY]
    inner = registry.get(name) if isinstance(name, str) else None
    if inner is None or not inner.is_model_format:
        raise MismatchError(
            f"meta[{FORMAT_KEY!r}] must name the model format whose native tree this is",
            key_path=f"meta/{FORMAT_KEY}",
            expected=sorted(n for n, f in registry.formats().items() if f.is_model_format),
            found=name,
        )
    return inner, {k: v for k, v in meta.items() if k != FORMAT_KEY}


def encoding_of(fmt: Format, data: Any) -> Any:
    """``as_source(data)``, checked against ``fmt``'s layout: one buffer for a single-file
    format, a mapping (role or relative path -> buffer) for sibling and directory formats."""
    if isinstance(data, str | os.PathLike):
        raise TypeError(f"an encoding is bytes, not the path {data!r}: load(path) reads a file")
    source = as_source(data)
    several = not isinstance(fmt.layout, File)
    if several != isinstance(source, Mapping):
        if several:
            keys = fmt.layout.roles if isinstance(fmt.layout, Siblings) else "relative paths"
            want = f"a mapping of {keys} to buffers (as its encode(...).files)"
        else:
            want = "one buffer (bytes, a memoryview, an Encoded)"
        raise TypeError(f"format {fmt.name!r} decodes {want}, not a {type(data).__name__}")
    return source


def as_source(data: Any) -> Any:
    """A buffer, or a mapping of them, from an `Encoded`, a buffer or a mapping of either."""
    if isinstance(data, Encoded):
        if data.files is not None:
            return {k: as_source(v) for k, v in data.files.items()}
        if len(data.chunks) == 1:
            return as_memoryview(data.chunks[0])
        return memoryview(data.tobytes())
    if isinstance(data, Mapping):
        return {
            k: as_source(v) if isinstance(v, Encoded) else as_memoryview(v) for k, v in data.items()
        }
    return as_memoryview(data)


def save_tree(
    path: PathLike,
    fmt: Format,
    tree: Any,
    meta: Mapping[str, Any] | None,
    options: Mapping[str, Any],
    *,
    durable: bool,
) -> None:
    """Encode ``tree`` in ``fmt`` and write it to ``path`` atomically."""
    encoded = encode_tree(fmt, tree, meta, options, path)
    after_pending_saves(path)  # saves to one destination land in the order they were made
    io.write_atomic(path, encoded, fmt.layout, durable=durable)
    deliver_deferred(encoded)


def decode_path(
    path: PathLike,
    format: str | Format | None,
    mmap: bool,
    options: Mapping[str, Any],
) -> tuple[Format, Any, dict[str, Any]]:
    """Decode the checkpoint at ``path``: its files read into fresh memory, or mapped (``mmap``)."""
    fmt = format_for_load(path, format)
    fmt.check_options(options, "load")
    return reopening(lambda: _decode_opened(path, fmt, mmap, options))


#: Times in all that a load or inspect opens a checkpoint that changed while it was read.
OPENS = 3


def reopening(read: Callable[[], T]) -> T:
    """``read()``, run again while the checkpoint it reads is replaced under it.

    A directory's files beyond the first few are opened when they are read, relative
    to the directory opened: a save that replaces the checkpoint meanwhile removes them
    (`pytreeio.io.ChangedWhileOpen`).  Opening it again reads the new one whole.
    """
    for _ in range(OPENS - 1):
        try:
            return read()
        except io.ChangedWhileOpen:
            continue
    return read()


def _decode_opened(
    path: PathLike, fmt: Format, mmap: bool, options: Mapping[str, Any]
) -> tuple[Format, Any, dict[str, Any]]:
    source = io.open_source(path, fmt.layout, mmap=mmap)
    try:
        with errors_located(path, source):
            native, meta = call(fmt.decode, fmt, options, source)
    finally:
        close_source(source)  # descriptors only: the buffers and maps read stay valid
    return fmt, native, meta


def close_source(source: Any) -> None:
    close = getattr(source, "close", None)
    if close is not None:
        close()
