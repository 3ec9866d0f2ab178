"""Conversion between formats: the rules of the conversion matrix.

`pytreeio.convert` (files) and `pytreeio.convert_encoded` (buffers,
no file system) decode the source and hand its native tree and meta to
`convert_decoded`, the one code path both share.  It knows no format by
name: what a format can hold is read off its `pytreeio.core.records.Format`
record (``to_model``/``from_model``, ``accepts_meta``, ``keeps_meta``).

**Model formats** (netcl, netcl-checkpoint, netcl-params, DataCode, cl-waffe2,
bullet) convert through the common model form (`pytreeio.model.form`):
``to_model`` of the source, then ``from_model`` of the target.  The layer
list travels in `Model.layers` (netcl's
layer config, DataCode's layers, cl-waffe2's LinearLayer keys and
pytreeio's sidecar, bullet's ``l{k}w``/``l{k}b`` ids), the optimizer state in
`pytreeio.model.optim.OptState` (moments and count; hyperparameters where
the target has a place for them), and what a file holds beyond that
(DataCode's training stages, netcl-checkpoint's ``config``, bullet's log)
in `Model.extras`, which only its own
format can write back.

**Generic formats that keep meta** (safetensors, and any registered format
with ``accepts_meta`` and ``keeps_meta`` but no model functions) receive the
source's *native tree as is*, its meta, and the source format's name under
the reserved meta key `FORMAT_KEY` (``"pytreeio.format"``).  Nothing is
lost: converting out of such a file treats it as the named format (its
``to_model`` runs, as if the original file were converted), converting back
to the named format reproduces the original native tree and meta, and
``load(path, like=<model-shaped tree>)`` fills a Flax tree through the
named format's ``to_model``.  No format knows another: the API looks the
name up in the registry.

**Generic formats without meta** (msgpack) receive the model's Flax
variables (`pytreeio.model.form.flax_variables`: ``{'params': {'Dense_0':
...}}`` when the arrays alone determine the model, ``nn.Sequential``'s
``layers_N`` otherwise, plus ``'batch_stats'`` and ``'step'`` when present),
so that converting back works with ``layers=[...]``.  What could not come
back even then is refused: an optimizer state (msgpack has no place for its
kind and hyperparameters) and the format extras.

Optimizer **hyperparameters** (learning rate, betas, eps) are the optimizer's
configuration, not its state: they travel where the target has a place for
them (cl-waffe2's entries, safetensors) and are not refused where it has
none (netcl and bullet files never store them; the optimizer that resumes
supplies them).  ``adam`` and ``adamw`` hold the same data, so either goes
where the other fits, unless a recorded non-zero weight decay would be lost.
cl-waffe2 needs a learning rate the source may lack: pass
``hyperparams={'learning_rate': ...}``.

Parameter-free layers (ReLU, Flatten, ...) in a format that stores parameters
only (netcl-checkpoint, netcl-params, bullet, msgpack) are not refused: such
a format holds no layer list, and its reader supplies one with ``layers=``,
exactly as for a Flax params tree.  Everything else the target cannot hold
(layer types, BatchNorm statistics, an optimizer kind, a learning rate the
target needs and the source lacks, DataCode's training stages, a Tiny Llama
into a layered format, ...) is a `pytreeio.core.errors.ConversionError`
naming it, raised before any byte is written; ``lossy=True`` drops it with a
`pytreeio.core.errors.PytreeioWarning` listing exactly what was dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from pytreeio.core import records
from pytreeio.core.binary import Slot, Streamed
from pytreeio.core.errors import ConversionError, EncodeError, MismatchError, PytreeioWarning
from pytreeio.core.records import Encoded, Format
from pytreeio.engine.dispatch import FORMAT_KEY, call, carried, encode_tree, encoding_of
from pytreeio.formats import registry

__all__ = [
    "FORMAT_KEY",
    "carried",
    "split_options",
    "decode_options",
    "convert_decoded",
    "decode_model",
    "open_streamed",
]


def _possible_load_options(container: Format, wanted: Iterable[str]) -> frozenset[str]:
    """Load options a checkpoint of ``container`` may take, before it is decoded.

    A generic container may carry any model format's tree, so their load options count too:
    looked up only when ``wanted`` holds one that is not the container's own (listing every
    format reads the installed plug-ins' entry points, tens of milliseconds).
    """
    names = container.load_options
    if not container.is_model_format and not set(wanted) <= names:
        for fmt in registry.formats().values():
            if fmt.is_model_format:
                names |= fmt.load_options
    return names


def split_options(
    container: Format, source: Format | None, target: Format, options: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Route each option to the source's load functions and/or the target's save functions.

    ``source`` is the format whose tree ``container`` holds (see
    `carried`), or None before decoding (then any model format's load
    options are allowed for a generic container).  An option no function
    declares raises ``TypeError``.  Between two checkpoints of one format an
    option it takes both ways (DataCode's ``variant``) goes to the target.
    """
    load_names = (
        _possible_load_options(container, set(options) - target.save_options)
        if source is None
        else container.load_options | source.load_options
    )
    save_names = target.save_options
    unknown = sorted(set(options) - load_names - save_names)
    if unknown:
        src = repr(container.name if source is None or source is container else source.name)
        if source is None and load_names != container.load_options:
            src += " (with the model formats its files may carry)"
        raise TypeError(
            f"convert takes no option(s) {', '.join(unknown)}: format {src} loads with "
            f"{sorted(load_names) or 'none'}, format {target.name!r} saves with "
            f"{sorted(save_names) or 'none'}"
        )
    if source is target:  # one format both ways: an option it takes both ways is the target's
        load_names -= save_names
    return (
        {k: v for k, v in options.items() if k in load_names},
        {k: v for k, v in options.items() if k in save_names},
    )


def decode_options(container: Format, target: Format, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options for decoding the source (see `split_options` for one format both ways)."""
    names = container.load_options
    if container is target:
        names -= target.save_options
    return {k: v for k, v in options.items() if k in names}


# --------------------------------------------------------------------------
# the conversion
# --------------------------------------------------------------------------


def _read_model(source: Format, native: Any, meta: Any, load_opts: Mapping[str, Any]) -> Any:

    assert source.to_model is not None
    model = call(source.to_model, source, load_opts, native, meta)
    return model.replace(origin=source.name)


def _write_model(
    target: Format,
    model: Any,
    meta: Mapping[str, Any] | None,
    save_opts: Mapping[str, Any],
    dest: Any,
    lossy: bool,
) -> Encoded:
    """``model`` encoded by ``target.from_model``; its extras refused or dropped as well."""
    from pytreeio.model.form import lost_extras, refuse_or_warn

    lost = lost_extras(model, target.name)
    try:
        encoded = encode_tree(target, None, meta, save_opts, dest, lossy=lossy, model=model)
    except ConversionError as exc:
        if lost and not lossy:
            raise ConversionError(
                f"{exc.reason}; and it cannot hold {', '.join(lost)}", what=[*exc.what, *lost]
            ) from exc
        raise
    except EncodeError as exc:
        raise ConversionError(
            f"format {target.name!r} cannot hold this {model.origin or 'model'}: {exc}",
            what=[exc.key_path or ""],
        ) from exc
    refuse_or_warn(lost, target.name, lossy)
    return encoded


def _flax_form(model: Any, target: Format, lossy: bool) -> Any:
    """The model's Flax variables for a generic format without meta; what cannot come back refused."""
    from pytreeio.model.form import flax_variables, lost_extras, refuse_or_warn

    problems = []
    opt = model.opt_state
    if opt is not None:
        problems.append(f"optimizer state ({opt.kind})")
    problems += lost_extras(model, target.name)
    refuse_or_warn(
        problems,
        target.name,
        lossy,
        hint=" (it keeps the model's Flax variables and step only; safetensors keeps everything)",
    )
    variables = flax_variables(model)
    if model.step is None:
        return variables
    inner = variables if "batch_stats" in variables else variables["params"]
    return {"params": inner, "step": int(model.step)}


def _encode_as_is(
    source: Format,
    target: Format,
    native: Any,
    src_meta: Any,
    meta: Mapping[str, Any] | None,
    explicit_meta: bool,
    save_opts: Mapping[str, Any],
    dest: Any,
    lossy: bool,
) -> Encoded:
    """The source's native tree encoded by the target as it is."""

    out_meta = dict(meta) if meta else None
    if out_meta and not target.accepts_meta and not explicit_meta:
        out_meta = None  # the source's own meta has no place in the target: nothing the caller gave
        if source.keeps_meta and src_meta:
            if not lossy:
                raise ConversionError(
                    f"format {target.name!r} cannot store the source's meta {sorted(src_meta)}; "
                    "pass lossy=True to drop it",
                    what=[f"meta.{k}" for k in sorted(src_meta)],
                )
            warnings.warn(
                f"dropping the source's meta {sorted(src_meta)}: format {target.name!r} cannot "
                "store it",
                PytreeioWarning,
                stacklevel=4,
            )
    # a native tree of its own format that does not match is the source's fault, not the target's
    refused = EncodeError if source is target else (EncodeError, MismatchError)
    return _encode_or_refuse(source, target, native, out_meta, save_opts, dest, lossy, refused)


def _encode_or_refuse(
    source: Format,
    target: Format,
    tree: Any,
    meta: Mapping[str, Any] | None,
    save_opts: Mapping[str, Any],
    dest: Any,
    lossy: bool,
    refused: type[Exception] | tuple[type[Exception], ...] = EncodeError,
) -> Encoded:
    """The target's encoding of ``tree``; what it cannot hold is a `ConversionError`."""
    try:
        return encode_tree(target, tree, meta, save_opts, dest, lossy=lossy)
    except refused as exc:
        raise ConversionError(
            f"format {target.name!r} cannot hold this {source.name} checkpoint: {exc}",
            what=[getattr(exc, "key_path", None) or ""],
        ) from exc


def convert_decoded(
    container: Format,
    target: Format,
    native: Any,
    meta: Any,
    *,
    options: Mapping[str, Any],
    out_meta: Mapping[str, Any] | None = None,
    dest: Any = None,
    lossy: bool = False,
) -> Encoded:
    """The target's encoding of a decoded checkpoint of ``container`` (see the module docstring).

    ``out_meta`` is the meta the caller gave (None: carry the source's);
    ``options`` go to the source's load functions and the target's save
    functions that declare them.  Pure: nothing is read or written.
    """
    from pytreeio.model import form as model_mod

    source, src_meta = carried(container, meta)
    load_opts, save_opts = split_options(container, source, target, options)
    explicit = out_meta is not None
    meta_out = dict(out_meta) if out_meta is not None else src_meta
    if source is target:
        return _encode_as_is(
            source, target, native, src_meta, meta_out, explicit, save_opts, dest, lossy
        )
    if source.is_model_format:
        if target.is_model_format:
            model = _read_model(source, native, src_meta, load_opts)
            return _write_model(target, model, out_meta, save_opts, dest, lossy)
        if target.accepts_meta and target.keeps_meta:
            # carry the native tree: nothing is lost, and it converts onward as the source would
            kept = {**(meta_out or {}), FORMAT_KEY: source.name}
            return _encode_as_is(
                source, target, native, src_meta, kept, True, save_opts, dest, lossy
            )
        model = _read_model(source, native, src_meta, load_opts)
        tree = _flax_form(model, target, lossy)
        return _encode_as_is(source, target, tree, {}, out_meta, explicit, save_opts, dest, lossy)
    if target.is_model_format and model_mod.is_model_like(native):
        # a Flax tree: through the common form (``layers=`` gives what the tree lacks)
        return _encode_or_refuse(source, target, native, meta_out, save_opts, dest, lossy)
    return _encode_as_is(
        source, target, native, src_meta, meta_out, explicit, save_opts, dest, lossy
    )


# --------------------------------------------------------------------------
# streaming: tensor by tensor, never the whole checkpoint in memory
# --------------------------------------------------------------------------

#: Slots smaller than this are read when the conversion is planned (scalars, biases):
#: streaming them saves nothing.
STREAM_MIN_BYTES = 1 << 16


def _streamed_tree(tree: Any, source: Any) -> Any:
    """``tree`` with each large plain slot a `Streamed` leaf and every other slot read."""
    from pytreeio.core.tree import is_namedtuple

    if isinstance(tree, Slot):
        if tree.convert is not None or tree.nbytes < STREAM_MIN_BYTES:
            return tree.read(source)
        if tree.fortran and len(tree.shape) > 1:
            # column-major bytes are the C-order bytes of the reversed shape: a transposed view,
            # which a writer storing Fortran order (.npy) writes as it is
            reader = None if tree.reader is None else functools.partial(_reversed, tree.reader)
            stored = dataclasses.replace(tree, shape=tree.shape[::-1], fortran=False, reader=reader)
            return Streamed(stored, source).transpose()
        return Streamed(tree, source)
    if isinstance(tree, Mapping):
        items = [(k, _streamed_tree(v, source)) for k, v in tree.items()]
        cls: Any = type(tree)
        return dict(items) if cls is dict else cls(items)
    if is_namedtuple(tree):
        return type(tree)(*(_streamed_tree(v, source) for v in tree))
    if isinstance(tree, list | tuple):
        return type(tree)(_streamed_tree(v, source) for v in tree)
    return tree


def _reversed(reader: Any, source: Any) -> Any:
    """A column-major array's reader as the reader of its C-ordered transpose."""
    import numpy as np

    return np.ascontiguousarray(reader(source).T)


def open_streamed(
    path: str | os.PathLike[str], container: Format, target: Format, options: Mapping[str, Any]
) -> tuple[Any, Any, Any] | None:
    """``(native tree with Streamed leaves, meta, open source)`` for a conversion that streams.

    A conversion streams when the source format has ``slots`` that take every
    load option given and the target's encoder takes `Streamed` leaves
    (``Format.streams``).  The native tree goes to the target as it is
    (one format both ways, a generic target) or through the common model form, whose transposes,
    reshapes and casts of a streamed array are views made when it is read
    (`Streamed.transpose`).  Each tensor is then read when the writer
    reaches it and dropped after: peak memory is about the largest tensor
    (twice, where it is transposed) plus the headers.
    None when it does not stream (the caller decodes the whole checkpoint);
    the caller closes the source after writing.
    """
    from pytreeio import io

    if container.slots is None or not target.streams:
        return None
    if set(options) - records.declared_options(container.slots):
        return None  # an option only decode understands: decode
    source = io.open_source(path, container.layout, headers=True)
    try:
        found = call(container.slots, container, options, source)
        return _streamed_tree(found.tree, source), found.meta, source
    except BaseException:
        source.close()
        raise


# --------------------------------------------------------------------------
# any checkpoint in the common form
# --------------------------------------------------------------------------


def decode_model(data: Any, format: str | Format, *, layers: Any = None, **options: Any) -> Any:
    """The `pytreeio.model.form.Model` of an encoded checkpoint of any format (pure).

    Model formats (and generic files carrying one, see `FORMAT_KEY`)
    go through their ``to_model``; a generic file holding a Flax tree through
    `pytreeio.model.form.model_of` (``layers=`` places the parameter-free
    layers).  A checkpoint that holds no layered model (a Tiny Llama) is a
    `ConversionError`.
    """
    from pytreeio.model.form import is_model_like, model_of

    container = registry.get(format)
    if layers is not None:
        options = {**options, "layers": layers}
    load_names = _possible_load_options(container, set(options) - {"layers"}) | {"layers"}
    unknown = sorted(set(options) - load_names)
    if unknown:
        raise TypeError(f"format {container.name!r} takes no load option(s) {', '.join(unknown)}")
    native, meta = call(container.decode, container, options, encoding_of(container, data))
    source, meta = carried(container, meta)
    if source.is_model_format:
        if "layers" in options and "layers" not in source.load_options:
            raise TypeError(f"format {source.name!r} reads its layer list from the file")
        return _read_model(source, native, meta, options)
    if is_model_like(native):
        return model_of(native, layers=options.get("layers"))
    raise ConversionError(
        f"this {container.name} checkpoint holds no layered model (found {type(native).__name__}"
        f"{' with keys ' + str(sorted(map(str, native))[:6]) if isinstance(native, Mapping) else ''})",
        what=[container.name],
    )
