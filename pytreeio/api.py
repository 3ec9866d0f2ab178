"""The public functions: save, load, inspect, verify, convert, encode, decode.

Each is a thin call into the engine (`pytreeio.engine.dispatch`: choosing
a format, routing options, the common model form, restoring into ``like``) and
`pytreeio.io` (the files).  It knows nothing about any particular format.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, TypeVar

from pytreeio import io
from pytreeio.core import records
from pytreeio.core.binary import BufferSource
from pytreeio.core.calls import check_like, keywords_explained
from pytreeio.core.errors import (
    FormatError,
)
from pytreeio.core.records import Encoded, Format, Info
from pytreeio.engine import dispatch
from pytreeio.formats import registry

__all__ = [
    "save",
    "load",
    "load_with_meta",
    "inspect",
    "verify",
    "convert",
    "encode",
    "decode",
    "decode_with_meta",
    "inspect_encoded",
    "convert_encoded",
    "list_formats",
]

PathLike = str | os.PathLike[str]
T = TypeVar("T")


def list_formats() -> dict[str, Format]:
    """Every format pytreeio knows, by name: the built-in ones, those given to
    `register`, and installed plug-ins (entry-point group ``pytreeio.formats``)."""
    return registry.formats()


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------


@keywords_explained
def encode(
    tree: Any,
    *,
    format: str | Format,
    meta: Mapping[str, Any] | None = None,
    dest: PathLike | None = None,
    **options: Any,
) -> Encoded:
    """`save` without the file system: ``tree`` encoded in ``format``.

    Same tree, ``meta`` and options as `save`.  ``dest`` is the path the
    bytes are meant for, for formats that record it (cl-waffe2 writes it into
    ``parameters.json``); nothing is written there.  A single-file format's
    bytes are the ``Encoded``'s ``chunks`` (``tobytes()`` joins them); sibling and
    directory formats hold one ``Encoded`` per role or relative path in ``files``.
    """
    return dispatch.encode_tree(registry.get(format), tree, meta, options, dest)


@keywords_explained
def decode(
    data: Any,
    *,
    format: str | Format,
    like: Any = None,
    partial: bool = False,
    verify: bool = False,
    **options: Any,
) -> Any:
    """`load` without the file system: the tree an encoding holds.

    ``data`` is an `Encoded`, a buffer (``bytes``, ``memoryview``, a
    numpy array) for a single-file format, or a mapping role/relative path ->
    buffer for sibling and directory formats, as `encode` returns them.
    ``like``, ``partial``, ``verify`` and the options are those of `load`.
    """
    return decode_with_meta(
        data, format=format, like=like, partial=partial, verify=verify, **options
    )[0]


@keywords_explained
def decode_with_meta(
    data: Any,
    *,
    format: str | Format,
    like: Any = None,
    partial: bool = False,
    verify: bool = False,
    **options: Any,
) -> tuple[Any, dict[str, Any]]:
    """`decode`, and the meta document of the encoding (as `load_with_meta`)."""
    from pytreeio.core.tree import partial_restore

    _check_like(like, partial)
    fmt = registry.get(format)
    if verify and "verify" in fmt.load_options:
        options = {**options, "verify": True}
    fmt.check_options(options, "load")
    native, meta = dispatch.call(fmt.decode, fmt, options, dispatch.encoding_of(fmt, data))
    if like is None:
        return native, meta
    with partial_restore(partial):
        return dispatch.restore_tree(fmt, native, meta, like, options), meta


def _check_like(like: Any, partial: bool) -> None:
    check_like(like)
    if partial and like is None:
        raise TypeError("partial=True restores the entries `like` names: pass like=")


@keywords_explained
def save(
    path: PathLike,
    tree: Any,
    *,
    format: str | Format | None = None,
    meta: Mapping[str, Any] | None = None,
    durable: bool = True,
    storage_options: Mapping[str, Any] | None = None,
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
      storage_options: for a URL (``s3://``, ``gs://``, any fsspec protocol), options of
        its file system (credentials, ``endpoint_url``, ...); see `location`.
      **options: the format's save options (``pytreeio formats`` lists them);
        model formats also take ``layers=[...]`` (the layer list of a Flax
        tree, activations included).  An option the format does not take
        raises ``TypeError``.
    """
    path = io.location(path, storage_options)
    fmt = dispatch.format_for_save(path, format)
    dispatch.save_tree(path, fmt, tree, meta, options, durable=durable)


@keywords_explained
def load(
    path: PathLike,
    *,
    like: Any = None,
    format: str | Format | None = None,
    mmap: bool = False,
    verify: bool = False,
    partial: bool = False,
    storage_options: Mapping[str, Any] | None = None,
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
        views of the mapping.  Opt-in: a file that another program
        truncates while it is mapped kills the process with SIGBUS when a
        missing page is touched (by the load or by the arrays later).  By
        default a load reads into fresh memory and a file truncated
        meanwhile is a `FormatError`.
      verify: check the checkpoint's checksums before returning it: the
        per-tensor checksums of pytreeio's safetensors files and the
        manifest (`pytreeio.integrity`) when there is one.  Off by
        default: a plain load hashes nothing.
      partial: restore only the entries ``like`` names (a subtree: the
        file may hold more; an entry of ``like`` the file lacks is still a
        `MismatchError`).  Formats with a ``slots`` function read only
        those entries' bytes (see `pytreeio.open`).
      storage_options: for a URL (``s3://``, ``gs://``, any fsspec protocol), options of
        its file system (credentials, ``endpoint_url``, ...).
      **options: the format's load options; others raise ``TypeError``.

    Raises:
      FormatError: the bytes are malformed (names the file, field, offset),
        or with ``verify`` a checksum does not match (names the tensor or file).
      MismatchError: the file and ``like`` disagree (names the key path).
    """
    return load_with_meta(
        path,
        like=like,
        format=format,
        mmap=mmap,
        verify=verify,
        partial=partial,
        storage_options=storage_options,
        **options,
    )[0]


@keywords_explained
def load_with_meta(
    path: PathLike,
    *,
    like: Any = None,
    format: str | Format | None = None,
    mmap: bool = False,
    verify: bool = False,
    partial: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> tuple[Any, dict[str, Any]]:
    """`load`, and the checkpoint's meta document: ``(tree, meta)``.

    The meta is the format's non-tensor information (what `save` took
    as ``meta``, and what the format reads from its files).
    """
    from pytreeio.core.tree import partial_restore

    _check_like(like, partial)
    path = io.location(path, storage_options)
    if partial and not verify:
        from pytreeio.lazy import load_partial

        return load_partial(path, like, format=format, mmap=mmap, options=options)
    if not verify and _sharded(like):
        from pytreeio.lazy import load_sliced  # each device's slice read from the file on its own

        sliced = load_sliced(path, like, format=format, options=options)
        if sliced is not None:
            return sliced
    if verify:
        fmt, native, meta = _decode_verified(path, format, mmap, options)
    else:
        fmt, native, meta = dispatch.decode_path(path, format, mmap, options)
    if like is None:
        return native, meta
    with dispatch.errors_located(path), partial_restore(partial):
        return dispatch.restore_tree(fmt, native, meta, like, options), meta


def _sharded(like: Any) -> bool:
    """Whether ``like`` places arrays over several devices (cheap when jax is not loaded)."""
    if like is None or "jax" not in sys.modules:
        return False
    from pytreeio.core.shards import wants_slices

    return wants_slices(like)


@keywords_explained
def inspect(
    path: PathLike,
    *,
    format: str | Format | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Info:
    """What a checkpoint holds (entries, shapes, dtypes, meta), reading headers only
    (ranged reads of an object in storage)."""
    path = io.location(path, storage_options)
    fmt = dispatch.format_for_load(path, format)

    def read() -> Info:
        source = io.open_source(path, fmt.layout, headers=True)
        try:
            with dispatch.errors_located(path, source):
                return fmt.inspect(source)
        finally:
            dispatch.close_source(source)

    info = dispatch.reopening(read)
    return Info(format=info.format, entries=info.entries, meta=info.meta, path=os.fspath(path))


@keywords_explained
def inspect_encoded(data: Any, *, format: str | Format) -> Info:
    """`inspect` without the file system (``data`` as for `decode`)."""
    fmt = registry.get(format)
    source = dispatch.encoding_of(fmt, data)
    if isinstance(source, Mapping):
        return fmt.inspect({k: BufferSource(v, name=k) for k, v in source.items()})
    return fmt.inspect(BufferSource(source))


@keywords_explained
def convert(
    src: PathLike,
    dst: PathLike,
    *,
    to: str | Format,
    from_: str | Format | None = None,
    meta: Mapping[str, Any] | None = None,
    lossy: bool = False,
    durable: bool = True,
    storage_options: Mapping[str, Any] | None = None,
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
    The rules are in `pytreeio.engine.conversion`; `convert_encoded` is the
    same conversion on encodings in memory.

    The source's meta is carried over unless ``meta`` is given.  Each option
    goes to the source's load functions and/or the target's save functions
    that declare it; an option neither declares raises ``TypeError``.  What
    the target cannot hold raises `ConversionError` naming it, before
    anything is written; ``lossy=True`` drops it with a
    `PytreeioWarning` listing what was dropped.

    ``src`` and ``dst`` may be URLs (``storage_options`` applies to both): tensors stream
    from one to the other within the same memory bound as between local files.
    """
    from pytreeio.engine import conversion as conv

    src = io.location(src, storage_options if io.is_url(src) else None)
    dst = io.location(dst, storage_options if io.is_url(dst) else None)
    if storage_options and not (io.is_url(src) or io.is_url(dst)):
        io.location(src, storage_options)  # the error: options for local paths
    target = registry.get(to, path=dst)
    container = dispatch.format_for_load(src, from_)
    conv.split_options(container, None, target, options)  # misspelt options fail before reading
    decode_opts = conv.decode_options(container, target, options)
    container.check_options(decode_opts, "load")
    # Tensor by tensor where the formats allow (pytreeio.engine.conversion.open_streamed): each
    # array is read when the writer reaches it; otherwise the whole source is decoded.
    with dispatch.errors_located(src):
        streamed = conv.open_streamed(src, container, target, decode_opts)
    source = None
    if streamed is None:
        _, native, src_meta = dispatch.decode_path(src, container, False, decode_opts)
    else:
        native, src_meta, source = streamed
    try:
        with dispatch.errors_located(src, source):
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
            dispatch.after_pending_saves(dst)
            io.write_atomic(dst, encoded, target.layout, durable=durable)
    finally:
        if source is not None:
            dispatch.close_source(source)
    dispatch.deliver_deferred(encoded)


@keywords_explained
def convert_encoded(
    data: Any,
    *,
    from_: str | Format,
    to: str | Format,
    meta: Mapping[str, Any] | None = None,
    lossy: bool = False,
    dest: PathLike | None = None,
    **options: Any,
) -> Encoded:
    """`convert` without the file system: an encoding in ``from_`` -> an `Encoded` in ``to``.

    ``data`` is ``bytes`` (or any buffer, or an `Encoded`) for a
    single-file format, or a mapping of role/relative path -> buffer for
    sibling and directory formats (``{"npz": ..., "json": ...}``,
    ``{"raw.bin": ..., "optimiser_state/weights.bin": ...}``), as
    `encode` returns them in ``Encoded.files``.  ``dest`` is the path
    the result is meant for (cl-waffe2 records it); nothing is written.  A
    partly failed encoding (bullet's quantisation) comes back with its
    errors in ``Encoded.deferred``.  Same rules, options and errors as
    `convert`: it is the same code path.
    """
    from pytreeio.engine import conversion as conv

    container = registry.get(from_)
    target = registry.get(to)
    conv.split_options(container, None, target, options)
    decode_opts = conv.decode_options(container, target, options)
    native, src_meta = dispatch.call(
        container.decode, container, decode_opts, dispatch.encoding_of(container, data)
    )
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
    """`dispatch.decode_path` with the format's checksums checked, then the manifest if any."""
    from pytreeio import integrity

    fmt = dispatch.format_for_load(path, format)
    if "verify" in fmt.load_options:
        options = {**options, "verify": True}
    result = dispatch.decode_path(path, fmt, mmap, options)
    integrity.check_manifest(path, fmt)
    return result


@keywords_explained
def verify(
    path: PathLike,
    *,
    format: str | Format | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> Info:
    """Decode a whole checkpoint (every byte checked) and return its `Info`.

    ``options`` are the format's load options.  Checksums are checked: the
    per-tensor ones of pytreeio's safetensors files and the checkpoint's
    manifest when it has one (`pytreeio.integrity`); a mismatch is a
    `FormatError` naming the tensor (``field``, with its data
    ``offset``) or the file and directory member.  The returned meta
    reports NaNs and infinities of floating entries of the native tree as
    ``info.meta["nonfinite"] = {entry: {"nan": n, "inf": m}}`` (only entries
    that have any).  What a format's own checks report (its decode called with
    ``verify=True`` fills ``meta[records.REPORT]``; bullet's largest
    quantisation error per tensor, given ``saved_format=``) is merged in too,
    e.g. ``info.meta["quantisation_error"]``.  A directory or sibling set in object
    storage is also checked against the sizes and checksums its commit object records.
    """
    path = io.location(path, storage_options)
    fmt = dispatch.format_for_load(path, format)
    # Its decode, manifest check and inspect each open the checkpoint: a save meanwhile
    # could pair one version's checks with another's files or entries (a false "changed
    # since its manifest"). Such a mix is seen as the files' identities changing, and
    # verified again; a verdict on one unchanged checkpoint stands.
    for _ in range(dispatch.OPENS - 1):
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
    from pytreeio import integrity

    _, native, meta = _decode_verified(path, fmt, False, options)
    nonfinite = integrity.nonfinite_counts(native)
    del native
    info = inspect(path, format=fmt)
    report = dict(meta.get(records.REPORT) or {})
    if nonfinite:
        report["nonfinite"] = nonfinite
    return Info(info.format, info.entries, {**info.meta, **report}, info.path)
