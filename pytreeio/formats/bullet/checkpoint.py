"""bullet checkpoints (the chess NNUE trainer): raw and quantised networks, optimiser state.

A directory; no file has a magic number, version or header; numbers are little-endian::

    raw.bin                      f32 values of the saved-format entries, in list order
    quantised.bin                the entries transformed and quantised, padded to 64 bytes
    optimiser_state/weights.bin  tagged records of every trainable tensor (`.records`)
    optimiser_state/momentum.bin tagged records (AdamW, RAdam, Ranger)
    optimiser_state/velocity.bin tagged records
    optimiser_state/slow.bin     tagged records (Ranger's lookahead), when present
    optimiser_state/step.txt     lines ``id,step`` (RAdam, Ranger; AdamW ignores it)
    log.txt                      lines ``superbatch,batch,loss``, no header row

An affine layer ``l{k}`` has weight ``l{k}w``, an ``out x in`` matrix stored
column-major, which as a numpy array is ``(in, out)`` in C order (a Flax
``Dense`` kernel), and bias ``l{k}b`` (``out``).  Records hold no shapes:
``l{k}b`` is 1-D, ``l{k}w`` ``(count/out, out)``, others 1-D unless the old
record variant or ``shapes=`` tells.

``meta["saved_format"]`` lays out raw.bin and quantised.bin (`.layout`,
`.network`); without it every tensor is an ``f32`` entry in model order.
A load reads neither file's data: with ``saved_format=`` it checks their sizes
and quantised.bin's padding, and ``check_quantised=True`` (or ``verify``)
compares the data into ``meta["quantisation_error"]``.  An empty
quantised.bin (bullet's when quantisation failed) reads as absent, with a
warning.  When quantisation fails on save, ``encode`` leaves quantised.bin out
and puts the `pytreeio.core.errors.QuantisationError` in
``Encoded.deferred``: the save writes the rest, then warns (raises if ``strict``).

Native tree ``{'weights': {id: f32 array}, 'momentum': ..., 'velocity': ...}``
(+ ``'slow'``; optimiser entries when their files exist); ``meta``:
``saved_format`` (when given), ``steps`` ``{id: step}``, ``log`` (log.txt's
text).  Models: `.models`.

Training states keyed by bullet's own tensor ids (`.states`)::

    {'params': {id: array}, 'opt_state': <optax adam/adamw state>, 'step': n}

``params`` may be nested: a leaf's id is its key path joined (``{'l0': {'w': ...}}``
is ``l0w``).  On save, ``mu``/``nu`` go to momentum.bin/velocity.bin by id and the
count to every line of step.txt.  A load with such a ``like`` restores them (count
from step.txt, or ``step=`` when the checkpoint has none).  Other optimizer states
raise `pytreeio.core.errors.ConversionError`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pytreeio.core.binary import BufferSource, ByteSource, Slot, Slots, as_memoryview
from pytreeio.core.errors import EncodeError, FormatError, MismatchError, QuantisationError
from pytreeio.core.records import (
    DIRECTORY,
    REPORT,
    STRUCTURE,
    Decoded,
    Encoded,
    Entry,
    Format,
    Info,
)
from pytreeio.core.tree import restore as tree_restore
from pytreeio.formats.bullet import layout, network, records, states
from pytreeio.formats.bullet.layout import (
    TRANSFORMS,
    TYPES,
    classic_layout,
    float_layout,
    model_order,
    output_bucket_layout,
    padding,
    register_transform,
    validate_saved_format,
)
from pytreeio.formats.bullet.models import FORMAT_NAME, from_model, to_model
from pytreeio.formats.bullet.network import QUANTISED, RAW
from pytreeio.formats.bullet.records import F32, STEP
from pytreeio.formats.registry import register

__all__ = [
    "FORMAT",
    "TYPES",
    "TRANSFORMS",
    "register_transform",
    "validate_saved_format",
    "classic_layout",
    "output_bucket_layout",
    "float_layout",
    "model_order",
    "padding",
    "encode",
    "decode",
    "inspect",
    "slots",
    "sniff",
    "to_model",
    "from_model",
    "raw_tensors",
    "quantised_tensors",
    "verify_quantised",
]

Layout = Sequence[Mapping[str, Any]]
Shapes = Mapping[str, Sequence[int]] | None
#: Native tree keys and the record files that hold them.
PARTS = {p: f"optimiser_state/{p}.bin" for p in ("weights", "momentum", "velocity", "slow")}
WEIGHTS, MOMENTUM, VELOCITY = PARTS["weights"], PARTS["momentum"], PARTS["velocity"]
LOG = "log.txt"
#: meta a save takes; reports a load adds are not stored, so re-saving loaded meta is fine.
_META = ("saved_format", "steps", "log", "quantisation_error", REPORT)


def _check_native(tree: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tree, Mapping) or "weights" not in tree:
        why = "a bullet checkpoint is {'weights': {id: array}, 'momentum': ..., 'velocity': ...}"
        why += " (+ 'slow'), a training state {'params': {id: array}, 'opt_state': ...}, or a"
        why += " model-shaped tree (common model form)"
        raise EncodeError(why, key_path="")
    extra = sorted(str(k) for k in tree if k not in PARTS)
    if extra:
        raise EncodeError(f"unknown entries {extra}; expected {sorted(PARTS)}", key_path=extra[0])
    if ("momentum" in tree) != ("velocity" in tree):
        missing = "velocity" if "momentum" in tree else "momentum"
        raise EncodeError("momentum and velocity are saved together", key_path=missing)
    out: dict[str, dict[str, Any]] = {}
    for part in (p for p in PARTS if tree.get(p) is not None):
        if not isinstance(tree[part], Mapping):
            raise EncodeError("expected a dict of arrays by tensor id", key_path=part)
        out[part] = {}
        for rid, leaf in tree[part].items():
            where = f"{part}/{rid}"
            if not isinstance(rid, str) or not layout.valid_id(rid):
                reason = f"tensor ids are 1-{layout.MAX_ID_BYTES} printable ASCII characters"
                raise EncodeError(f"{reason}, found {rid!r}", key_path=where)
            out[part][rid] = network.f32(leaf, where)
    weights = out["weights"]
    for part, arrays in out.items():
        for rid in model_order(sorted(set(weights) | set(arrays))):
            where = f"{part}/{rid}"
            if rid not in arrays:
                raise EncodeError(f"{part} lacks tensor {rid!r} of weights", key_path=where)
            if rid not in weights:
                raise EncodeError(f"{part} has tensor {rid!r}, which weights lacks", key_path=where)
            if arrays[rid].shape != weights[rid].shape:
                why = f"shape {arrays[rid].shape} differs from the weight's {weights[rid].shape}"
                raise EncodeError(why, key_path=where)
    return out


def _check_meta(meta: Any, ids: Mapping[str, Any]) -> tuple[list[layout.Spec], dict[str, int], str]:
    meta = {} if meta is None else meta
    if not isinstance(meta, Mapping):
        raise EncodeError("meta must be a dict", key_path="meta")
    extra = sorted(str(k) for k in meta if k not in _META)
    if extra:
        raise EncodeError(f"bullet has no place for meta {extra}", key_path=f"meta.{extra[0]}")
    if meta.get("saved_format") is None:
        specs = [layout.Spec(i) for i in model_order(ids)]
    else:
        specs = layout.specs(meta["saved_format"], ids)
    steps = meta.get("steps") or {}
    if not isinstance(steps, Mapping):
        raise EncodeError("meta['steps'] maps tensor ids to step counts", key_path="meta.steps")
    for rid, step in steps.items():
        if rid not in ids:
            why = f"steps names {rid!r}, which weights lacks"
            raise EncodeError(why, key_path=f"meta.steps.{rid}")
        if not layout.is_int(step) or int(step) < 0:
            why = f"a step is a non-negative integer, found {step!r}"
            raise EncodeError(why, key_path=f"meta.steps.{rid}")
    log = meta.get("log")
    if log is not None and not isinstance(log, str):
        raise EncodeError("meta['log'] is the text of log.txt", key_path="meta.log")
    return specs, {k: int(v) for k, v in steps.items()}, log or ""


def encode(tree: Any, *, meta: Mapping[str, Any] | None = None, strict: bool = False) -> Encoded:
    """The files of a checkpoint directory for a native tree; ``meta``: ``saved_format``
    (default: every tensor f32, model order), ``steps`` (``{id: step}``), ``log``; ``tree``
    may be a training state keyed by tensor ids (`.states`)."""
    if states.parts(tree, states.encode_error) is not None:
        tree, meta = states.to_native(tree, meta)
    native = _check_native(tree)
    weights = native["weights"]
    specs, steps, log = _check_meta(meta, weights)
    files = {RAW: Encoded(chunks=tuple(network.encode_raw(specs, weights)))}
    deferred: tuple[Exception, ...] = ()
    try:
        files[QUANTISED] = Encoded(chunks=tuple(network.encode_quantised(specs, weights)))
    except QuantisationError as exc:
        why = f"{exc}; quantised.bin was not written (raw.bin and the optimiser state were)"
        deferred = (QuantisationError(why),)
        deferred[0].__dict__.update(exc.__dict__)
    for part, arrays in native.items():
        files[PARTS[part]] = Encoded(chunks=tuple(records.encode(arrays)))
    if steps:
        files[STEP] = Encoded(chunks=(records.steps_text(steps),))
    files[LOG] = Encoded(chunks=(log.encode("utf-8"),))
    return Encoded(files=files, deferred=deferred, strict=bool(strict))


class _Files(dict):  # type: ignore[type-arg]
    """decode's files as byte sources, each opened on first use: raw.bin and quantised.bin,
    whose data a load does not return, through the caller's ranged reads where it has them
    (``io.FileSet.ranges``), the others as whole buffers."""

    def __init__(self, source: Mapping[str, Any], stack: contextlib.ExitStack) -> None:
        super().__init__()
        self.source, self.stack = source, stack

    def __contains__(self, file: object) -> bool:
        return file in self.source

    def __missing__(self, file: str) -> ByteSource:
        ranges = getattr(self.source, "ranges", None)
        ranged = ranges(file) if file in (RAW, QUANTISED) and callable(ranges) else None
        if ranged is not None:
            self[file] = self.stack.enter_context(ranged)
        else:
            self[file] = BufferSource(as_memoryview(self.source[file]), name=file)
        return self[file]


def decode(
    source: Mapping[str, Any],
    *,
    saved_format: Layout | None = None,
    shapes: Shapes = None,
    check_quantised: bool = False,
    verify: bool = False,
) -> Decoded:
    """A checkpoint directory's native tree and meta, from ``source`` (relative path -> buffer).

    ``saved_format``: raw.bin's and quantised.bin's layout, their sizes and padding then
    checked; ``shapes``: ``{id: shape}`` for what the records do not tell;
    ``check_quantised``: the largest error per entry of quantised.bin against raw.bin in
    ``meta["quantisation_error"]``; ``verify`` (``ptio.verify``): as ``check_quantised``
    with ``saved_format``, the report also under ``meta[pytreeio.core.records.REPORT]``.
    Arrays are views of the record files (of raw.bin without ``optimiser_state/``).
    """
    with contextlib.ExitStack() as stack:
        files = _Files(source, stack)
        options: dict[str, Any] = {"saved_format": saved_format, "shapes": shapes, "verify": verify}
        found = slots(files, check_quantised=check_quantised, **options)
        views: dict[str, memoryview] = {}

        def array(slot: Slot) -> np.ndarray:  # slots checked that the data lies in the file
            assert slot.role is not None
            if slot.role not in views:
                views[slot.role] = _whole(files, slot.role)
            return np.ndarray(slot.shape, F32, buffer=views[slot.role], offset=slot.offset)

        tree = {part: {k: array(s) for k, s in group.items()} for part, group in found.tree.items()}
    return Decoded(tree, found.meta)


def restore(native: Any, meta: dict[str, Any], like: Any, *, step: int | None = None) -> Any:
    """``native`` in ``like``'s structure: a training state keyed by tensor ids (`.states`;
    ``step``: its count where the checkpoint has no step.txt), else the native tree's own."""
    if states.parts(like, states.mismatch) is not None:
        return states.restore_state(native, meta, like, step)
    return tree_restore(native, like)


def _whole(source: Mapping[str, ByteSource], file: str) -> memoryview:
    src = source[file]
    return src.read(0, src.size, file)


def _record_slots(
    source: Mapping[str, ByteSource], part: str, shapes: Any, counts: Mapping[str, int] | None
) -> tuple[dict[str, Slot], Mapping[str, int]]:
    """A record file's slots, in model order, and its value counts; a state file (``counts``,
    weights.bin's) must hold exactly the tensors of weights.bin, with their counts."""
    file = PARTS[part]
    have = {r.id: r for r in records.walk(source[file], file)}
    if counts is None:
        counts = {rid: r.count for rid, r in have.items()}
        shapes = records.infer_shapes(list(have.values()), shapes)
    for rid in model_order(sorted(set(have) | set(counts))):
        if rid not in have:
            raise FormatError(f"no record for tensor {rid!r} of weights.bin", path=file, field=rid)
        why = f"holds {have[rid].count} values, weights.bin {counts.get(rid)}"
        if rid not in counts or have[rid].count != counts[rid]:
            why = why if rid in counts else "is not in weights.bin"
            at = have[rid].offset
            raise FormatError(f"record {rid!r} {why}", path=file, field=rid, offset=at)
    slots = {}
    for rid in model_order(have):
        r = have[rid]
        slots[rid] = Slot(f"{part}/{rid}", r.offset, 4 * r.count, shapes[rid], F32, role=file)
    return slots, counts


def _raw_slots(
    source: Mapping[str, ByteSource], specs: list[layout.Spec] | None, shapes: Any
) -> dict[str, Slot]:
    """The weights of a checkpoint without optimiser_state/ (an exported network), in raw.bin
    as ``saved_format`` and ``shapes`` lay them out."""
    specs = specs if isinstance(shapes, Mapping) else None
    if RAW not in source or specs is None or any(s.id not in shapes for s in specs):
        why = "no optimiser_state/weights.bin: bullet loads checkpoints from optimiser_state/; to"
        why += " read the network from raw.bin alone pass saved_format= and shapes= for every entry"
        raise FormatError(why, path=WEIGHTS)
    dims = records.given_shapes(shapes)
    counts = {s.id: math.prod(dims[s.id]) for s in specs}
    records.given_shapes(shapes, counts)  # names no other tensor
    network.check_raw(source[RAW].size, specs, counts)
    out, pos = {}, 0
    for rid, n in counts.items():
        out[rid] = Slot(f"weights/{rid}", pos, 4 * n, dims[rid], F32, role=RAW)
        pos += 4 * n
    return {rid: out[rid] for rid in model_order(out)}


def slots(
    source: Mapping[str, ByteSource],
    *,
    saved_format: Layout | None = None,
    shapes: Shapes = None,
    check_quantised: bool = False,
    verify: bool = False,
) -> Slots:
    """`decode`'s native tree with a `Slot` per array, reading record headers only.

    step.txt and log.txt (meta) are read whole; raw.bin and quantised.bin only
    to compare them (``check_quantised``, or ``verify`` with ``saved_format``).
    """
    check_quantised = check_quantised or (verify and saved_format is not None)
    if saved_format is None and check_quantised:
        why = "check_quantised needs the layout: pass saved_format="
        raise MismatchError(why, key_path="saved_format", found=None)
    specs = layout.specs(saved_format) if saved_format is not None else None
    tree: dict[str, dict[str, Slot]] = {}
    meta: dict[str, Any] = {}
    if WEIGHTS in source:
        tree["weights"], counts = _record_slots(source, "weights", shapes, None)
        all_shapes = {rid: s.shape for rid, s in tree["weights"].items()}
        for part in ("momentum", "velocity", "slow"):
            if PARTS[part] in source:
                tree[part], _ = _record_slots(source, part, all_shapes, counts)
        if ("momentum" in tree) != ("velocity" in tree):
            have, lack = (MOMENTUM, VELOCITY) if "momentum" in tree else (VELOCITY, MOMENTUM)
            raise FormatError(f"{have} without {lack}", path=lack)
        if STEP in source:
            meta["steps"] = records.parse_steps(_whole(source, STEP), counts)
    else:
        tree["weights"] = _raw_slots(source, specs, shapes)
    if LOG in source:
        meta["log"] = records.text(_whole(source, LOG), LOG)
    if specs is None:
        return Slots(tree, meta)
    shaped = {rid: s.shape for rid, s in tree["weights"].items()}
    sizes = {rid: math.prod(shape) for rid, shape in shaped.items()}
    layout.specs(saved_format, sizes)  # every id must be a tensor
    meta["saved_format"] = [s.to_json() for s in specs]
    if RAW in source:
        network.check_raw(source[RAW].size, specs, sizes)
    has_q = QUANTISED in source and network.check_quantised(source[QUANTISED], specs, sizes)
    if check_quantised:
        if not has_q:
            why = "no quantised.bin to check (quantisation failed when the checkpoint was saved?)"
            raise FormatError(why, path=QUANTISED)
        raw = {rid: s.read(source) for rid, s in tree["weights"].items()}
        if RAW in source:
            flat = network.entry_arrays(_whole(source, RAW), specs, sizes, quantised=False)
            raw.update({rid: a.reshape(shaped[rid]) for rid, a in flat.items()})
        report = network.quantisation_report(_whole(source, QUANTISED), raw, specs, shaped)
        meta["quantisation_error"] = report
        if verify:
            meta[REPORT] = {"quantisation_error": report}
    return Slots(tree, meta)


def _network(source: Mapping[str, Any], saved_format: Any, shapes: Any, file: str) -> Any:
    """``(specs, weights, file's entries)`` of a checkpoint, its layout checked by decode."""
    native, meta = decode(source, saved_format=saved_format, shapes=shapes)
    specs = layout.specs(meta["saved_format"])
    counts = {rid: int(a.size) for rid, a in native["weights"].items()}
    buf = as_memoryview(source[file]) if file in source else b""
    if not buf and any(counts[s.id] for s in specs):  # absent, or quantised.bin empty
        raise FormatError(f"the checkpoint has no {file}", path=file)
    flat = network.entry_arrays(buf, specs, counts, quantised=file == QUANTISED)
    return specs, native["weights"], flat


def raw_tensors(
    source: Mapping[str, Any], saved_format: Layout, *, shapes: Shapes = None
) -> dict[str, np.ndarray]:
    """raw.bin's entries as float32 arrays in their native shapes (``(in, out)`` weights)."""
    _, weights, flat = _network(source, saved_format, shapes, RAW)
    return {rid: a.reshape(weights[rid].shape) for rid, a in flat.items()}


def quantised_tensors(
    source: Mapping[str, Any], saved_format: Layout, *, shapes: Shapes = None
) -> dict[str, np.ndarray]:
    """quantised.bin's entries as written: integer (or f32) arrays, shaped as the entry's
    transforms leave them (``"transpose"``: ``(out, in)``; after other transforms flat)."""
    specs, weights, flat = _network(source, saved_format, shapes, QUANTISED)
    out = {}
    for spec in specs:
        shape: tuple[int, ...] = weights[spec.id].shape
        for t in spec.transforms:
            shape = shape[::-1] if t == "transpose" else (math.prod(shape),)
        out[spec.id] = flat[spec.id].reshape(shape)
    return out


def verify_quantised(
    source: Mapping[str, Any], saved_format: Layout, *, shapes: Shapes = None
) -> dict[str, float]:
    """The largest ``|q/scale - x|`` per entry of quantised.bin against raw.bin's ``x`` transformed,
    every size and padding byte checked on the way: at most ``0.5/scale`` rounded, below
    ``1/scale`` truncated."""
    _, meta = decode(source, saved_format=saved_format, shapes=shapes, check_quantised=True)
    return dict(meta["quantisation_error"])


def inspect(source: Mapping[str, ByteSource]) -> Info:
    """Tensors (from the record headers only), file sizes of raw.bin/quantised.bin."""
    entries: list[Entry] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for part, file in PARTS.items():
        if file in source:
            recs = {r.id: r for r in records.walk(source[file], file)}
            if part == "weights":
                shapes = records.infer_shapes(list(recs.values()))
            for rid in model_order(recs):
                count = recs[rid].count
                shape = shapes.get(rid, (count,))
                shape = shape if math.prod(shape) == count else (count,)
                entries.append(Entry(f"{part}/{rid}", shape, "float32", 4 * count))
    meta: dict[str, Any] = {"files": sorted(str(k) for k in source)}
    for file in (RAW, QUANTISED):
        if file in source:
            meta[f"{file.split('.')[0]}_bytes"] = int(source[file].size)
    return Info(format=FORMAT_NAME, entries=tuple(entries), meta=meta)


def sniff(probe: Any) -> float:
    """A directory with ``optimiser_state/weights.bin``, or with ``raw.bin`` and ``quantised.bin``."""
    names = probe.names
    if probe.is_dir and names and (WEIGHTS in names or (RAW in names and QUANTISED in names)):
        return STRUCTURE
    return 0.0


FORMAT = register(
    Format(
        name=FORMAT_NAME,
        description="bullet (chess NNUE trainer) checkpoint directory: raw.bin, quantised.bin, optimiser_state/",
        suffixes=(),
        layout=DIRECTORY,
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=sniff,
        restore=restore,
        to_model=to_model,
        from_model=from_model,
        slots=slots,
        streams=True,
    )
)
