"""The public functions: save, load, inspect, verify, convert, encode, decode.

This module only dispatches: it picks a format (by name, suffix or sniffing
the probes :mod:`pytreeio.io` builds), routes each option to the format
function that declares it, sends model-shaped trees through the common model
form (:mod:`pytreeio.model`), and hands bytes to :mod:`pytreeio.io`.  It knows
nothing about any particular format.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from . import io, registry
from .binary import BufferSource, as_memoryview
from .errors import (
    FormatError,
    MismatchError,
    PytreeioWarning,
    UnknownFormatError,
)
from .registry import Encoded, Format, Info

__all__ = [
    "save",
    "load",
    "load_with_meta",
    "inspect",
    "inspect_buffer",
    "verify",
    "convert",
    "convert_buffer",
    "encode",
    "decode",
    "formats",
]

PathLike = str | os.PathLike[str]
T = TypeVar("T")


def formats() -> dict[str, Format]:
    """All registered formats, by name."""
    return registry.formats()


# --------------------------------------------------------------------------
# choosing a format
# --------------------------------------------------------------------------


def _format_for_save(path: PathLike, format: str | Format | None) -> Format:
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


def _format_for_load(path: PathLike, format: str | Format | None) -> Format:
    if format is not None:
        return registry.get(format, path=path)
    seen: list[registry.Probe] = []
    made: dict[Path, registry.Probe] = {}  # the file's own probe, made once for every layout

    def probe_for(layout: registry.Layout) -> registry.Probe:
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
    fmt = registry.for_suffix(path) if Path(path).is_file() else None
    if fmt is None:
        raise UnknownFormatError(
            "the content matches no registered format; pass format=", path=os.fspath(path)
        )
    return fmt


# --------------------------------------------------------------------------
# options and errors
# --------------------------------------------------------------------------


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


def _after_pending_saves(path: PathLike) -> None:
    """Wait for the background saves (:mod:`pytreeio.async_save`) to ``path`` made so far."""
    pending = sys.modules.get("pytreeio.async_save")  # none were made if it was never imported
    if pending is not None:
        pending.wait_for(path)


def _deliver_deferred(encoded: Encoded) -> None:
    """Raise (strict) or warn about the errors of a save that partly succeeded, after the write."""
    for exc in encoded.deferred:
        if encoded.strict:
            raise exc
        warnings.warn(str(exc), PytreeioWarning, stacklevel=3)


# --------------------------------------------------------------------------
# trees <-> encodings, through the common model form where it applies
# --------------------------------------------------------------------------


def _call(fn: Any, fmt: Format, options: Mapping[str, Any], *args: Any, **fixed: Any) -> Any:
    return fn(*args, **fixed, **fmt.options_for(fn, options))


def _encode(
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
    from . import keys
    from . import model as model_mod

    fmt.check_options(options, "save")
    keys.refuse(model if model is not None else tree, fmt.name)  # typed PRNG keys: named, early
    opts = dict(options)
    layers = opts.pop("layers", None)
    out_meta: dict[str, Any] | None = dict(meta) if meta is not None else None
    shape = model_mod.model_like_shape(tree) if model is None and fmt.is_model_format else None
    if shape is not None:
        hint = layers if layers is not None else model_mod.layer_list(meta)
        params = tree

        def through_model() -> tuple[Any, Any]:
            nonlocal model
            model = model_mod.model_of(params, layers=hint)
            return _from_model(fmt, model, opts, out_meta, lossy)

        if shape == "flax" and not _takes(fmt.encode, "model"):  # a kept save has no Model
            from . import model_plans  # the same save as a training run's last one, kept

            documents = (opts, layers, out_meta, lossy)
            tree, out_meta = model_plans.save(fmt, params, documents, through_model)
        else:
            tree, out_meta = through_model()
    elif model is None and layers is not None:
        raise TypeError(
            f"layers= describes a Flax model, and this tree is not one (format {fmt.name!r} "
            "takes its native tree as is)"
        )
    elif model is not None:
        tree, out_meta = _from_model(fmt, model, opts, out_meta, lossy)
    converted = shape is not None or model is not None  # tree and meta are from_model's
    if out_meta and not fmt.accepts_meta:
        warnings.warn(
            f"format {fmt.name!r} cannot store meta; dropping {sorted(out_meta)}",
            PytreeioWarning,
            stacklevel=3,
        )
        out_meta = None
    enc_fixed: dict[str, Any] = {"meta": out_meta}
    if model is not None and _takes(fmt.encode, "model"):  # the tree is from_model's: checked
        enc_fixed["model"] = model
    if converted and _takes(fmt.encode, "checked"):
        enc_fixed["checked"] = True
    if _takes(fmt.encode, "dest"):
        enc_fixed["dest"] = os.fspath(dest) if dest is not None else None
    return _call(fmt.encode, fmt, opts, tree, **enc_fixed)


def _from_model(
    fmt: Format, model: Any, opts: Mapping[str, Any], meta: dict[str, Any] | None, lossy: bool
) -> tuple[Any, Any]:
    """``fmt.from_model(model, ...)``: the native tree and meta document of ``model``."""
    assert fmt.from_model is not None
    fixed: dict[str, Any] = {"meta": meta}
    if _takes(fmt.from_model, "lossy"):
        fixed["lossy"] = lossy
    return _call(fmt.from_model, fmt, opts, model, **fixed)


def _takes(fn: Any, name: str) -> bool:
    import inspect as _inspect

    try:
        return name in _inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _restore(
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
    from . import model as model_mod
    from .conversion import carried
    from .tree import allows_extra

    shape = model_mod.model_like_shape(like)
    if shape is not None:
        # a model format, or a generic file carrying one's native tree (see pytreeio.conversion)
        source, source_meta = (fmt, meta) if fmt.is_model_format else carried(fmt, meta)
        if source.is_model_format:
            to_model = source.to_model
            assert to_model is not None

            def through_model() -> Any:
                fixed = {"like": like} if _takes(to_model, "like") else {}
                model = _call(to_model, source, options, native, source_meta, **fixed)
                return model_mod.restore_model(model, like)

            if shape != "flax":
                return through_model()
            from . import model_plans  # the same restore as a training run's last one, kept

            return model_plans.restore(
                (fmt, source), native, meta, like, options, allows_extra(), through_model
            )
    return _call(fmt.restore, fmt, options, native, meta, like)


def _as_source(data: Any) -> Any:
    """A buffer, or a mapping of them, from an :class:`Encoded`, a buffer or a mapping of either."""
    if isinstance(data, Encoded):
        if data.files is not None:
            return {k: _as_source(v) for k, v in data.files.items()}
        if len(data.chunks) == 1:
            return as_memoryview(data.chunks[0])
        return memoryview(data.tobytes())
    if isinstance(data, Mapping):
        return {
            k: _as_source(v) if isinstance(v, Encoded) else as_memoryview(v)
            for k, v in data.items()
        }
    return as_memoryview(data)


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------


def encode(
    tree: Any,
    format: str | Format,
    *,
    meta: Mapping[str, Any] | None = None,
    dest: PathLike | None = None,
    **options: Any,
) -> Encoded:
    """Encode ``tree`` in ``format`` without touching the file system.

    ``dest`` is the path the bytes are meant for, for formats that record it
    (cl-waffe2 writes it into ``parameters.json``); nothing is written there.
    """
    return _encode(registry.get(format), tree, meta, options, dest)


def decode(
    data: Any, format: str | Format, *, like: Any = None, partial: bool = False, **options: Any
) -> Any:
    """Decode an :class:`Encoded` or a buffer (a mapping of them for multi-file formats).

    Returns the native tree, or the tree restored into ``like``'s structure
    (``partial=True``: ``like`` may name only some of the entries, as for :func:`load`).
    """
    from .tree import partial_restore

    fmt = registry.get(format)
    fmt.check_options(options, "load")
    native, meta = _call(fmt.decode, fmt, options, _as_source(data))
    if like is None:
        return native
    with partial_restore(partial):
        return _restore(fmt, native, meta, like, options)


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
      path: destination file (or directory, or sibling-file stem, by format).
      tree: the format's native tree, or for model formats a model-shaped
        tree (a Flax params tree, ``{'params', 'opt_state'}``, a TrainState);
        never modified.
      format: format name; by default chosen from the suffix of ``path``.
      meta: the format's non-tensor information (see each format's docs).
      durable: fsync the files and their directory (default).  ``False``
        keeps the atomic rename but skips the fsyncs.
      **options: the format's save options (``pytreeio formats`` lists them);
        model formats also take ``layers=[...]`` (the layer list of a Flax
        tree, activations included).  An option the format does not take
        raises ``TypeError``.
    """
    fmt = _format_for_save(path, format)
    encoded = _encode(fmt, tree, meta, options, path)
    _after_pending_saves(path)  # saves to one destination land in the order they were made
    io.write_atomic(path, encoded, fmt.layout, durable=durable)
    _deliver_deferred(encoded)


def _decode_path(
    path: PathLike,
    format: str | Format | None,
    mmap: bool,
    options: Mapping[str, Any],
    *,
    own_arrays: bool = True,
) -> tuple[Format, Any, dict[str, Any]]:
    """Decode the checkpoint at ``path``: mapped (``mmap``), or with arrays of their own
    (``own_arrays``: large files' arrays read one by one, :mod:`pytreeio.mapped_load`), or
    with every file read into one buffer."""
    fmt = _format_for_load(path, format)
    fmt.check_options(options, "load")
    return _reopening(lambda: _decode_opened(path, fmt, mmap, options, own_arrays))


#: Times in all that a load or inspect opens a checkpoint that changed while it was read.
_OPENS = 3


def _reopening(read: Callable[[], T]) -> T:
    """``read()``, run again while the checkpoint it reads is replaced under it.

    A directory's files beyond the first few are opened when they are read, relative
    to the directory opened: a save that replaces the checkpoint meanwhile removes them
    (:class:`pytreeio.io.ChangedWhileOpen`).  Opening it again reads the new one whole.
    """
    for _ in range(_OPENS - 1):
        try:
            return read()
        except io.ChangedWhileOpen:
            continue
    return read()


def _decode_opened(
    path: PathLike, fmt: Format, mmap: bool, options: Mapping[str, Any], own_arrays: bool
) -> tuple[Format, Any, dict[str, Any]]:
    if mmap or not own_arrays:
        source = io.open_source(path, fmt.layout, mmap=mmap)
        try:
            with _errors_located(path, source):
                native, meta = _call(fmt.decode, fmt, options, source)
        finally:
            _close(source)  # descriptors only: the buffers and maps read stay valid
        return fmt, native, meta
    from .mapped_load import decode_path

    opened = io.open_source(path, fmt.layout, headers=True)
    try:
        with _errors_located(path, opened):
            native, meta = decode_path(opened, lambda data: _call(fmt.decode, fmt, options, data))
    finally:
        _close(opened)
    return fmt, native, meta


def load(
    path: PathLike,
    like: Any = None,
    *,
    format: str | Format | None = None,
    mmap: bool = False,
    verify: bool = False,
    partial: bool = False,
    **options: Any,
) -> Any:
    """Load a checkpoint.

    Args:
      path: the file, directory or sibling-file stem.
      like: a pytree (arrays or ``jax.ShapeDtypeStruct``) whose structure,
        shapes and dtypes the result must have; leaves come back as the same
        kind (numpy, jax arrays on ``like``'s sharding, Python scalars).
        Model formats also fill model-shaped ``like`` trees (a Flax params
        tree, ``{'params', 'opt_state'}``, a TrainState).  Without it, the
        format's native tree is returned.  ``like`` is never modified.
      format: format name; by default sniffed from the content.
      mmap: map the file instead of reading it; arrays are then read-only
        views of the mapping.
      verify: check the checkpoint's checksums before returning it: the
        per-tensor checksums of pytreeio's safetensors files and the
        manifest (:mod:`pytreeio.checksum`) when there is one.  Off by
        default: a plain load hashes nothing.
      partial: restore only the entries ``like`` names (a subtree: the
        file may hold more; an entry of ``like`` the file lacks is still a
        :class:`MismatchError`).  Formats with a ``slots`` function read only
        those entries' bytes (see :func:`pytreeio.open`).
      **options: the format's load options; others raise ``TypeError``.

    Raises:
      FormatError: the bytes are malformed (names the file, field, offset),
        or with ``verify`` a checksum does not match (names the tensor or file).
      MismatchError: the file and ``like`` disagree (names the key path).
    """
    from .tree import partial_restore

    if partial and like is None:
        raise TypeError("partial=True restores the entries `like` names: pass like=")
    if partial and not verify:
        from .lazy import load_partial

        return load_partial(path, like, format=format, mmap=mmap, options=options)
    if not verify and _sharded(like):
        from .sharding import load_sliced  # each device's slice read from the file on its own

        sliced = load_sliced(path, like, format=format, options=options)
        if sliced is not None:
            return sliced
    if verify:
        fmt, native, meta = _decode_verified(path, format, mmap, options)
    else:
        fmt, native, meta = _decode_path(path, format, mmap, options)
    if like is None:
        return native
    with _errors_located(path), partial_restore(partial):
        return _restore(fmt, native, meta, like, options)


def _sharded(like: Any) -> bool:
    """Whether ``like`` places arrays over several devices (cheap when jax is not loaded)."""
    if like is None or "jax" not in sys.modules:
        return False
    from .restore_fast import host_only

    if host_only(like):  # the common numpy template, without jax's slower flatten
        return False
    from .sharding import wants_slices

    return wants_slices(like)


def load_with_meta(
    path: PathLike, *, format: str | Format | None = None, mmap: bool = False, **options: Any
) -> tuple[Any, dict[str, Any]]:
    """The native tree and the meta document of a checkpoint."""
    _, native, meta = _decode_path(path, format, mmap, options)
    return native, meta


def inspect(path: PathLike, format: str | Format | None = None) -> Info:
    """What a checkpoint holds (entries, shapes, dtypes, meta), reading headers only."""
    fmt = _format_for_load(path, format)

    def read() -> Info:
        source = io.open_source(path, fmt.layout, headers=True)
        try:
            with _errors_located(path, source):
                return fmt.inspect(source)
        finally:
            _close(source)

    info = _reopening(read)
    return Info(format=info.format, entries=info.entries, meta=info.meta, path=os.fspath(path))


def _close(source: Any) -> None:
    close = getattr(source, "close", None)
    if close is not None:
        close()


def inspect_buffer(data: Any, format: str | Format) -> Info:
    """:func:`inspect` for an in-memory single-file encoding."""
    fmt = registry.get(format)
    source = _as_source(data)
    if isinstance(source, Mapping):
        return fmt.inspect({k: BufferSource(v, name=k) for k, v in source.items()})
    return fmt.inspect(BufferSource(source))


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    to: str | Format,
    from_: str | Format | None = None,
    meta: Mapping[str, Any] | None = None,
    lossy: bool = False,
    durable: bool = True,
    **options: Any,
) -> None:
    """Re-encode the checkpoint at ``src`` as format ``to`` at ``dst``.

    Between model formats the checkpoint goes through the common model form
    (``to_model`` then ``from_model``): parameters bit for bit, the layer list
    translated, the optimizer state (moments and count) carried where the
    target holds one.  Into safetensors (a generic format that keeps meta) the
    source's native tree and meta go as they are, with the source format's
    name under the meta key ``"pytreeio.format"``, so the file converts
    onward as the source would; into msgpack the model's Flax variables go.
    The rules are in :mod:`pytreeio.conversion`; :func:`convert_buffer` is the
    same conversion on buffers.

    The source's meta is carried over unless ``meta`` is given.  Each option
    goes to the source's load functions and/or the target's save functions
    that declare it; an option neither declares raises ``TypeError``.  What
    the target cannot hold raises :class:`ConversionError` naming it, before
    anything is written; ``lossy=True`` drops it with a
    :class:`PytreeioWarning` listing what was dropped.
    """
    from . import conversion as conv

    target = registry.get(to, path=dst)
    container = _format_for_load(src, from_)
    conv.split_options(container, None, target, options)  # misspelt options fail before reading
    decode_opts = conv.decode_options(container, target, options)
    container.check_options(decode_opts, "load")
    # Tensor by tensor where the formats allow (pytreeio.conversion.open_streamed): each
    # array is read when the writer reaches it; otherwise the whole source is decoded.
    with _errors_located(src):
        streamed = conv.open_streamed(src, container, target, decode_opts)
    source = None
    if streamed is None:
        _, native, src_meta = _decode_path(src, container, False, decode_opts)
    else:
        native, src_meta, source = streamed
    try:
        with _errors_located(src, source):
            encoded = conv.convert_decoded(
                container,
                target,
                native,
                src_meta,
                options=options,
                out_meta=meta,
                dest=dst,
                lossy=lossy,
            )
            _after_pending_saves(dst)
            io.write_atomic(dst, encoded, target.layout, durable=durable)
    finally:
        if source is not None:
            _close(source)
    _deliver_deferred(encoded)


def convert_buffer(
    data: Any,
    *,
    from_: str | Format,
    to: str | Format,
    meta: Mapping[str, Any] | None = None,
    lossy: bool = False,
    dest: PathLike | None = None,
    **options: Any,
) -> Encoded:
    """:func:`convert` without the file system: an encoding in ``from_`` -> an :class:`Encoded` in ``to``.

    ``data`` is ``bytes`` (or any buffer, or an :class:`Encoded`) for a
    single-file format, or a mapping of role/relative path -> buffer for
    sibling and directory formats (``{"npz": ..., "json": ...}``,
    ``{"raw.bin": ..., "optimiser_state/weights.bin": ...}``), as
    :func:`encode` returns them in ``Encoded.files``.  ``dest`` is the path
    the result is meant for (cl-waffe2 records it); nothing is written.  A
    partly failed encoding (bullet's quantisation) comes back with its
    errors in ``Encoded.deferred``.  Same rules, options and errors as
    :func:`convert`: it is the same code path.
    """
    from . import conversion as conv

    container = registry.get(from_)
    target = registry.get(to)
    conv.split_options(container, None, target, options)
    decode_opts = conv.decode_options(container, target, options)
    native, src_meta = _call(container.decode, container, decode_opts, _as_source(data))
    return conv.convert_decoded(
        container,
        target,
        native,
        src_meta,
        options=options,
        out_meta=meta,
        dest=dest,
        lossy=lossy,
    )


def _decode_verified(
    path: PathLike, format: str | Format | None, mmap: bool, options: Mapping[str, Any]
) -> tuple[Format, Any, dict[str, Any]]:
    """:func:`_decode_path` with the format's checksums checked, then the manifest if any."""
    from . import checksum

    fmt = _format_for_load(path, format)
    if "verify" in fmt.load_options:
        options = {**options, "verify": True}
    # one buffer per file: the checks read every byte anyway
    result = _decode_path(path, fmt, mmap, options, own_arrays=False)
    checksum.check_manifest(path, fmt)
    return result


def verify(path: PathLike, format: str | Format | None = None, **options: Any) -> Info:
    """Decode a whole checkpoint (every byte checked) and return its :class:`Info`.

    ``options`` are the format's load options.  Checksums are checked: the
    per-tensor ones of pytreeio's safetensors files and the checkpoint's
    manifest when it has one (:mod:`pytreeio.checksum`); a mismatch is a
    :class:`FormatError` naming the tensor (``field``, with its data
    ``offset``) or the file and directory member.  The returned meta
    reports NaNs and infinities of floating entries of the native tree as
    ``info.meta["nonfinite"] = {entry: {"nan": n, "inf": m}}`` (only entries
    that have any).  What a format's own checks report (its decode called with
    ``verify=True`` fills ``meta[registry.REPORT]``; bullet's largest
    quantisation error per tensor, given ``saved_format=``) is merged in too,
    e.g. ``info.meta["quantisation_error"]``.
    """
    fmt = _format_for_load(path, format)
    # Its decode, manifest check and inspect each open the checkpoint: a save meanwhile
    # could pair one version's checks with another's files or entries (a false "changed
    # since its manifest"). Such a mix is seen as the files' identities changing, and
    # verified again; a verdict on one unchanged checkpoint stands.
    for _ in range(_OPENS - 1):
        before = io.identity(path, fmt.layout)
        try:
            info = _verify_once(path, fmt, options)
        except (FormatError, io.ChangedWhileOpen):
            if io.identity(path, fmt.layout) == before:
                raise
            continue
        if io.identity(path, fmt.layout) == before:
            return info
    return _verify_once(path, fmt, options)


def _verify_once(path: PathLike, fmt: Format, options: Mapping[str, Any]) -> Info:
    from . import checksum

    _, native, meta = _decode_verified(path, fmt, False, options)
    nonfinite = checksum.nonfinite_counts(native)
    del native
    info = inspect(path, format=fmt)
    report = dict(meta.get(registry.REPORT) or {})
    if nonfinite:
        report["nonfinite"] = nonfinite
    return Info(info.format, info.entries, {**info.meta, **report}, info.path)
