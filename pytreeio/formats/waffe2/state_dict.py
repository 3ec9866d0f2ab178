"""cl-waffe2 ``:wf2model`` directories (``specs/003``, FORMATS.md "cl-waffe2").

On disk, as ``(save-weights model "<p>" :wf2model [:optimizers t])`` writes it::

    <p>/parameters.json      one line of JSON, "<key>": "<p>/<key>.npy" for a tensor,
                             "<key>": 0.01 | 3 for a number, in reverse parameter
                             order, each parameter followed by its optimizer entries
                             (Adam: lr, eps, beta1, beta2, n, m, v; SGD: lr)
    <p>/<key>.npy            one per tensor (the ':' stays in the name): .npy 1.0,
                             1-D, the tensor's C order (LinearLayer weights
                             (out, in)), byte-identical to np.save of it flattened
    <p>/pytreeio-waffe2.json only where pytreeio had something cl-waffe2 has no place
                             for (shapes, layer list, step, SGD count); ignored,
                             with a warning, once parameters.json changed

Documents: `.document`; keys, NTH, numbers: `.keys`; the common
model form and its options (``layers``, ``naming``, ``optimizers``,
``hyperparams``): `.model`; ``strict``/``report``: `.restore`.

**Native tree**: the keys unflattened by their parts, without ``{type}``::

    {'param': {'linearlayer': {'0': {'weights': array, 'bias': array}, ...}},
     'optimizer': {'linearlayer': {'0': {'weights': {'adam': {'lr': 0.01, 'eps': 1e-07,
         'beta1': 0.9, 'beta2': 0.999, 'n': 3, 'm': array, 'v': array}}}}}}

Arrays are 1-D unless the sidecar gives their shapes.  **Meta**: ``{'keys':
[the file's keys, in order]}`` and the sidecar's ``layers``/``step``/``count``;
saving a tree with its meta writes the same bytes (``meta['keys']`` gives the
order and a ``double-float`` spelling).  **Save options** beyond the model's:
``save_dir`` (the ``<p>``; default the destination as passed), ``sidecar``
(default: when something would otherwise be lost), ``tensor_class``.

**Loading** is safer than cl-waffe2's loader, which opens every path as given:
a tensor is read from ``<dir>/<basename of its path>`` only, and a basename
that is not a file directly in the checkpoint is a `FormatError`;
``fortran_order`` arrays are refused, as cl-waffe2 refuses them.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from pytreeio.containers import npy
from pytreeio.core import dtypes
from pytreeio.core.binary import ByteSource, Deferred, Reader, Slot, Slots, Streamed, as_memoryview
from pytreeio.core.errors import EncodeError, FormatError
from pytreeio.core.records import DIRECTORY, STRUCTURE, Decoded, Encoded, Entry, Format, Info, Probe
from pytreeio.core.threads import cores, pool, share
from pytreeio.formats.registry import register
from pytreeio.formats.waffe2.document import (
    PARAMETERS,
    SIDECAR,
    Sidecar,
    check_meta,
    in_meta_order,
    insert,
    read_document,
    read_sidecar,
    sidecar_bytes,
    tensor_file,
    tree_items,
    write_document,
)
from pytreeio.formats.waffe2.keys import PARAM_PREFIXES
from pytreeio.formats.waffe2.model import LayerNaming as LayerNaming
from pytreeio.formats.waffe2.model import c_order, from_model, to_model
from pytreeio.formats.waffe2.restore import restore

#: Bytes of a transposed view copied into C order at a time, as its file is written.
_BAND_BYTES = 4 << 20


def _npy_chunks(arr: Any) -> list[Any]:
    """The ``.npy`` of ``arr`` flattened (1-D, C order).  A transposed view (a kernel in
    cl-waffe2's orientation) is copied into C order band by band as its file is written: a
    save holds a band per writing thread, never a transposed copy of a tensor."""
    if isinstance(arr, Streamed) or arr.flags.c_contiguous or not arr.size:
        return npy.encode_npy(arr.reshape(-1))
    step = max(1, _BAND_BYTES // (arr.nbytes // len(arr)))
    bands = [arr[i : i + step] for i in range(0, len(arr), step)]
    data = [Deferred(b.nbytes, functools.partial(_c_bytes, b)) for b in bands]
    return [npy.npy_header(arr.dtype, (int(arr.size),)), *data]


def _c_bytes(view: np.ndarray) -> Any:
    return c_order(view).reshape(-1).view(np.uint8)


def encode(
    tree: Any,
    *,
    meta: Mapping[str, Any] | None = None,
    dest: str | None = None,
    optimizers: bool | None = None,
    save_dir: str | None = None,
    sidecar: bool | None = None,
    tensor_class: str = "cputensor",
) -> Encoded:
    """A native tree as the files of a ``:wf2model`` directory (see the module docstring).

    ``dest`` is the destination exactly as the caller passed it; path strings
    are ``f"{save_dir or dest}/{key}.npy"`` (bare ``f"{key}.npy"`` when both are
    None).  ``optimizers=False`` leaves out every optimizer entry.
    """
    check_meta(meta)
    if not isinstance(tensor_class, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_\-]*", tensor_class):
        raise EncodeError(f"tensor_class {tensor_class!r} is not a lower-case class name")
    items, spelled = in_meta_order(meta, tree_items(tree))
    if optimizers is False:
        items = [e for e in items if e.prefix in PARAM_PREFIXES]
    prefix = save_dir if save_dir is not None else dest
    if prefix is not None and not isinstance(prefix, str):
        raise EncodeError(f"save_dir must be a string, not {type(prefix).__name__}")
    params_json, arrays, shapes = write_document(items, spelled, tensor_class, prefix)
    files = {PARAMETERS: Encoded(chunks=(params_json,))}
    files.update((name, Encoded(chunks=tuple(_npy_chunks(a)))) for name, a in arrays.items())
    keep = shapes or (
        meta and (meta.get("layers") or {meta.get("step"), meta.get("count")} != {None})
    )
    if sidecar or (sidecar is None and keep):
        files[SIDECAR] = Encoded(chunks=(sidecar_bytes(params_json, shapes, meta),))
    return Encoded(files=files)


def _documents(source: Any, text: Any) -> tuple[frozenset[str], list[Any], Sidecar]:
    """The directory's names, parameters.json's entries and the sidecar (``text(name)``: bytes)."""
    if not isinstance(source, Mapping):
        raise FormatError("a waffe2 checkpoint is a directory")
    names = frozenset(source)  # iterating reads nothing (`in source` may read the file)
    if PARAMETERS not in names:
        raise FormatError("no parameters.json in the directory", path=PARAMETERS)
    params_json = text(PARAMETERS)
    doc = read_document(params_json)
    side = read_sidecar(text(SIDECAR), params_json) if SIDECAR in names else None
    side = side or Sidecar({}, {})
    stray = sorted(set(side.shapes) - {raw for raw, _, v in doc if isinstance(v, str)})
    if stray:
        raise FormatError(
            f"names {stray[0]!r}, not a tensor of parameters.json", path=SIDECAR, field=stray[0]
        )
    return names, doc, side


def _npy_header(r: Reader, name: str) -> npy.NpyHeader:
    h = npy.parse_npy_header(r, "npy")
    if h.fortran_order:
        raise FormatError(
            "Fortran-order arrays are refused (cl-waffe2: 'Reading arrays in Fortran order "
            "is not yet supported')",
            path=name,
            field="npy.header.fortran_order",
            offset=10,
        )
    return h


def _read_tensor(buffer: Any, name: str) -> np.ndarray:
    r = Reader(as_memoryview(buffer), source=name)
    return npy.array_after_header(r, _npy_header(r, name), "npy")


def _fitted(
    shapes: Mapping[str, tuple[int, ...]], raw: str, shape: tuple[int, ...], count: int
) -> tuple[int, ...]:
    """A tensor's shape: the sidecar's (which must hold ``count`` elements), else ``shape``."""
    want = shapes.get(raw, shape)
    if math.prod(want) != count:
        raise FormatError(
            f"shape {list(want)} has {math.prod(want)} elements, the file {count}",
            path=SIDECAR,
            field=raw,
        )
    return tuple(want)


def decode(source: Mapping[str, Any]) -> Decoded:
    """The native tree and meta of a ``:wf2model`` directory's files (see the module docstring)."""
    names, doc, side = _documents(source, lambda name: bytes(as_memoryview(source[name])))
    paths = {raw: tensor_file(v, raw, names) for raw, _, v in doc if isinstance(v, str)}
    files = list(dict.fromkeys(paths.values()))  # each file read once, however many entries name it

    def read(name: str) -> Any:
        try:
            return _read_tensor(source[name], name)
        except Exception as exc:  # raised at the first entry naming the file, in order
            return exc

    # Files read side by side: one at a time reads at ~0.7x of the disk's speed.
    arrays = dict(zip(files, share(pool(), cores(), read, files), strict=True))
    native: dict[str, Any] = {}
    for raw, key, value in doc:
        if raw in paths:
            arr = arrays[paths[raw]]
            if isinstance(arr, Exception):
                raise arr
            shape = _fitted(side.shapes, raw, arr.shape, arr.size)
            value = arr if shape == arr.shape else arr.reshape(shape)
        insert(native, key.ident, value)
    return Decoded(native, {"keys": [raw for raw, _, _ in doc], **side.meta})


def _header(src: ByteSource, name: str) -> npy.NpyHeader:
    """A .npy file's header, read without its data; the size must fit the header exactly."""
    # numpy pads headers to 64 bytes: small arrays' headers end at byte 64 or 128
    first = src.read(0, min(src.size, 128), "npy.header")
    v1 = bytes(first[6:7]) == b"\x01"
    end = (10 if v1 else 12) + int.from_bytes(bytes(first[8 : 10 if v1 else 12]), "little")
    if end > len(first):
        first = src.read(0, min(end, src.size), "npy.header")
    h = _npy_header(Reader(first, source=name), name)
    if src.size != h.data_offset + h.nbytes:
        raise FormatError(
            f"file has {src.size} bytes, the header says {h.data_offset + h.nbytes}",
            path=name,
            field="npy.data",
            offset=h.data_offset,
        )
    return h


def _scan(
    source: Mapping[str, ByteSource], *, close: bool
) -> tuple[list[Any], dict[str, Any], dict[str, tuple[str, npy.NpyHeader, tuple[int, ...]]]]:
    """parameters.json's entries, the sidecar's meta, and each tensor entry's file, header and
    shape: the documents and .npy headers only.  ``close``: close each source once read (else
    the caller's sources stay open for the slots' reads)."""

    def read(name: str, fn: Any) -> Any:
        src = source[name]
        try:
            return fn(src)
        finally:
            if close and hasattr(src, "close"):
                src.close()

    names, doc, side = _documents(source, lambda n: read(n, lambda s: bytes(s.read(0, s.size, n))))
    headers: dict[str, npy.NpyHeader] = {}  # each file once, however many entries name it
    tensors = {}
    for raw, _, value in doc:
        if isinstance(value, str):
            name = tensor_file(value, raw, names)
            if name not in headers:
                headers[name] = read(name, lambda s, n=name: _header(s, n))
            h = headers[name]
            tensors[raw] = (name, h, _fitted(side.shapes, raw, h.shape, h.count))
    return doc, side.meta, tensors


def inspect(source: Mapping[str, ByteSource]) -> Info:
    """Entries (keys, shapes, dtypes) and the numbers of a ``:wf2model`` directory; .npy headers only."""
    doc, meta, tensors = _scan(source, close=True)
    entries = tuple(
        Entry(raw, shape, dtypes.name_of(h.dtype), h.nbytes)
        for raw, (_, h, shape) in tensors.items()
    )
    scalars = {raw: v for raw, _, v in doc if not isinstance(v, str)}
    return Info(format="waffe2", entries=entries, meta={"scalars": scalars, **meta})


def slots(source: Mapping[str, ByteSource]) -> Slots:
    """`decode`'s native tree with a `Slot` per tensor entry (its data after the
    .npy header); entries naming one file share its slot."""
    doc, meta, tensors = _scan(source, close=False)
    native: dict[str, Any] = {}
    for raw, key, value in doc:
        if raw in tensors:
            name, h, shape = tensors[raw]
            value = Slot(raw, h.data_offset, h.nbytes, shape, h.dtype, role=name)
        insert(native, key.ident, value)
    return Slots(native, {"keys": [raw for raw, _, _ in doc], **meta})


_KEY_HEAD = re.compile(rb'^\s*\{\s*"(?:missing_)?(?:param|optimizer):')


def sniff(probe: Probe) -> float:
    """A directory whose ``parameters.json`` opens with a cl-waffe2 state-dict key."""
    ok = probe.is_dir and PARAMETERS in (probe.names or ())
    return STRUCTURE if ok and _KEY_HEAD.match(probe.heads.get(PARAMETERS, b"")) else 0.0


FORMAT = register(
    Format(
        name="waffe2",
        description="cl-waffe2 :wf2model directory (parameters.json + one .npy per tensor)",
        suffixes=(".wf2model",),
        layout=DIRECTORY,
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=sniff,
        restore=restore,
        to_model=to_model,
        from_model=from_model,
        accepts_meta=True,
        keeps_meta=False,
        slots=slots,
        streams=True,
    )
)
