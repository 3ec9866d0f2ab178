"""bullet's saved format: the entries of ``raw.bin``/``quantised.bin``, their checks and builders.

An entry, in file order, is data (bullet keeps no layout on disk)::

    {"id": "l0w", "transforms": [], "type": "i16", "scale": 255, "round": true}

In ``raw.bin`` every entry is its ``count x f32`` values, untransformed; in
``quantised.bin`` its values after ``transforms``, as ``type`` (``f32``, or
``i8``/``i16``/``i32`` at integer ``scale``, truncated or with ``round``
half away from zero), then `padding` up to a multiple of 64 bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pytreeio.core import quant
from pytreeio.core.binary import Streamed
from pytreeio.core.errors import MismatchError

PAD_PATTERN = b"bullet"
ALIGN = 64
MAX_ID_BYTES = 1024

#: Saved-format types and their little-endian dtypes.
TYPES: dict[str, np.dtype[Any]] = {"f32": np.dtype("<f4"), **quant.INT_TYPES}
#: The largest scale bullet's multiplier holds per target (QuantTarget::I8/I16 take an i16).
SCALE_MAX = {"i8": 2**15 - 1, "i16": 2**15 - 1, "i32": 2**31 - 1}
_ENTRY_KEYS = frozenset({"id", "transforms", "type", "scale", "round"})
LAYER_ID = re.compile(r"\Al(0|[1-9][0-9]{0,5})([wb])\Z")


def is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def valid_id(s: str) -> bool:
    # str.isprintable() of ASCII text is exactly " " to "~"
    return 0 < len(s) <= MAX_ID_BYTES and s.isascii() and s.isprintable()


def padding(n: int) -> bytes:
    """The bytes bullet appends to ``n`` bytes of quantised data: up to a multiple of 64, ``b"bullet"`` repeated."""
    k = -n % ALIGN
    return (PAD_PATTERN * (k // len(PAD_PATTERN) + 1))[:k]


#: A transform: ``fn(array, tensors) -> array`` with as many float32 elements.
Transform = Callable[[np.ndarray, Mapping[str, np.ndarray]], Any]


def _transpose(array: Any, tensors: Mapping[str, np.ndarray]) -> Any:
    # A vector is an out x 1 matrix: transposing it leaves its bytes as they are.
    if array.ndim != 2:
        return array
    return array.transpose(1, 0) if isinstance(array, Streamed) else quant.transpose(array, (1, 0))


#: Transforms by name; ``"transpose"`` is built in.
TRANSFORMS: dict[str, Transform] = {"transpose": _transpose}


def register_transform(name: str, fn: Transform, *, replace: bool = False) -> None:
    """Make ``fn`` usable as ``"transforms": [name]`` in saved-format entries.

    ``fn(array, tensors)`` gets the entry's current array (the ``(in, out)``
    weight, or what earlier transforms made of it) and every tensor by id
    (read-only: bullet's transforms merge tensors, e.g. a factoriser into
    ``l0w``), and returns as many float32 values.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a transform name must be a non-empty string, found {name!r}")
    if not callable(fn):
        raise TypeError(f"transform {name!r} must be callable")
    if name in TRANSFORMS and not replace:
        raise ValueError(f"a transform named {name!r} is already registered")
    TRANSFORMS[name] = fn


@dataclass(frozen=True)
class Spec:
    """A validated saved-format entry."""

    id: str
    transforms: tuple[str, ...] = ()
    type: str = "f32"
    scale: int | None = None
    round: bool = False

    def to_json(self) -> dict[str, Any]:
        out = {**asdict(self), "transforms": list(self.transforms)}  # in field order
        if self.scale is None:
            del out["scale"]
        return out


def _spec(i: int, entry: Any, seen: dict[str, int], known: Any) -> Spec:
    eid = None  # named in errors once it is valid

    def bad(field: str | None, reason: str, **kw: Any) -> MismatchError:
        who = f"saved_format[{i}]" + (f" ({eid})" if eid else "")
        path = f"saved_format[{i}]" + (f".{field}" if field else "")
        return MismatchError(f"{who}: {reason}", key_path=path, **kw)

    if not isinstance(entry, Mapping):
        raise bad(None, "an entry must be a dict", found=type(entry).__name__)
    eid = entry.get("id") if isinstance(entry.get("id"), str) else None
    if not entry.keys() <= _ENTRY_KEYS:
        unknown = sorted(str(k) for k in entry if k not in _ENTRY_KEYS)
        raise bad(None, f"unknown keys {unknown}", expected=sorted(_ENTRY_KEYS))
    if eid is None or not valid_id(eid):
        found, eid = entry.get("id"), None
        raise bad("id", "the id must be a non-empty printable ASCII string", found=found)
    if eid in seen:
        raise bad("id", f"id listed twice (also saved_format[{seen[eid]}])")
    if known is not None and eid not in known:
        reason = f"unknown id {eid!r}: the checkpoint has no such tensor"
        raise bad("id", reason, expected=sorted(known)[:20], found=eid)
    seen[eid] = i
    ttype = entry.get("type")
    if not isinstance(ttype, str) or ttype not in TYPES:
        raise bad("type", f"unknown type {ttype!r}", expected=sorted(TYPES), found=ttype)
    transforms = entry.get("transforms", [])
    if isinstance(transforms, str) or not isinstance(transforms, Sequence):
        raise bad("transforms", "transforms must be a list of names", found=transforms)
    for t in transforms:
        if not isinstance(t, str) or t not in TRANSFORMS:
            expected = sorted(TRANSFORMS)
            raise bad("transforms", f"unknown transform {t!r}", expected=expected, found=t)
    rnd = entry.get("round", False)
    if not isinstance(rnd, bool):
        raise bad("round", "round must be true or false", found=rnd)
    scale = entry.get("scale")
    if ttype == "f32":
        if scale is not None:
            raise bad("scale", "an f32 entry has no scale", found=scale)
        if rnd:
            raise bad("round", "an f32 entry is not rounded", found=rnd)
    elif scale is None:
        raise bad("scale", f"an {ttype} entry needs an integer scale")
    elif not is_int(scale) or not 1 <= int(scale) <= SCALE_MAX[ttype]:
        reason = f"the scale of an {ttype} entry must be an integer in [1, {SCALE_MAX[ttype]}]"
        raise bad("scale", reason, found=scale)
    return Spec(eid, tuple(transforms), ttype, None if scale is None else int(scale), rnd)


def specs(saved_format: Any, ids: Iterable[str] | None = None) -> list[Spec]:
    """``saved_format`` checked (see `validate_saved_format`)."""
    if isinstance(saved_format, str | bytes | Mapping) or not isinstance(saved_format, Sequence):
        found = type(saved_format).__name__
        why = "saved_format must be a list of entries"
        raise MismatchError(why, key_path="saved_format", found=found)
    known = ids if ids is None or isinstance(ids, Mapping | set | frozenset) else set(ids)
    seen: dict[str, int] = {}
    return [_spec(i, e, seen, known) for i, e in enumerate(saved_format)]


def validate_saved_format(
    saved_format: Any, ids: Iterable[str] | None = None
) -> list[dict[str, Any]]:
    """The entries of ``saved_format`` with defaults filled in, each id one of ``ids`` if given.

    Raises `pytreeio.core.errors.MismatchError` naming the entry (index
    and id) and the field.
    """
    return [s.to_json() for s in specs(saved_format, ids)]


def _layer_types(types: Any, n: int) -> list[tuple[str, str]]:
    per_layer = [types] * n if isinstance(types, str) else types
    if not isinstance(per_layer, Sequence) or len(per_layer) != n:
        reason = f"types must be a type name or one entry per layer ({n})"
        raise MismatchError(reason, key_path="types", found=types)
    out = []
    for t in per_layer:
        pair = [t, t] if isinstance(t, str) else t
        if not isinstance(pair, Sequence) or [type(x) for x in pair] != [str, str]:
            reason = "types: each layer's entry is a type or a (weight type, bias type) pair"
            raise MismatchError(reason, key_path="types", found=t)
        out.append((pair[0], pair[1]))
    return out


def _layout_entry(eid: str, ttype: str, scale: int, rnd: bool, flip: bool) -> dict[str, Any]:
    if ttype not in TYPES:
        raise MismatchError(f"{eid}: unknown type {ttype!r}", key_path=eid, expected=sorted(TYPES))
    most = SCALE_MAX.get(ttype, scale)
    if scale > most:
        reason = f"{eid}: scale {scale} overflows bullet's {ttype} multiplier (at most {most})"
        raise MismatchError(reason, key_path=eid, expected=f"<= {most}", found=scale)
    f32 = ttype == "f32"
    transforms = ("transpose",) if flip else ()
    return Spec(eid, transforms, ttype, None if f32 else scale, rnd and not f32).to_json()


def classic_layout(
    scales: Sequence[int],
    *,
    types: str | Sequence[str | tuple[str, str]] = "i16",
    round: bool = True,
    transposed: Iterable[int] = (),
) -> list[dict[str, Any]]:
    """bullet's classic layout: ``l{k}w`` at ``scales[k]``, ``l{k}b`` at ``scales[0]*...*scales[k]``.

    ``scales``: one integer per affine layer (``[QA, QB]``); a bias is added
    after the layer's product, so its scale is the running product.  ``types``:
    one for every entry, or per layer a type or ``(weight type, bias type)``.
    ``transposed``: layers whose weight gets ``"transpose"``.  A scale that
    overflows bullet's multiplier for its type is an error naming the entry.
    """
    if isinstance(scales, str | bytes) or not isinstance(scales, Sequence) or not scales:
        why = "scales must be a non-empty list of integers"
        raise MismatchError(why, key_path="scales", found=scales)
    for k, q in enumerate(scales):
        if not is_int(q) or int(q) < 1:
            reason = f"scales[{k}] must be a positive integer"
            raise MismatchError(reason, key_path=f"scales[{k}]", found=q)
    per_layer = _layer_types(types, len(scales))
    flip = {int(k) for k in transposed}
    bad = sorted(k for k in flip if not 0 <= k < len(scales))
    if bad:
        why = f"transposed names layers {bad} of {len(scales)}"
        raise MismatchError(why, key_path="transposed")
    out: list[dict[str, Any]] = []
    product = 1
    for k, q in enumerate(scales):
        product *= int(q)
        wtype, btype = per_layer[k]
        out.append(_layout_entry(f"l{k}w", wtype, int(q), round, k in flip))
        out.append(_layout_entry(f"l{k}b", btype, product, round, False))
    return out


def output_bucket_layout(
    scales: Sequence[int],
    *,
    bucketed: int | Iterable[int] | None = None,
    types: str | Sequence[str | tuple[str, str]] = "i16",
    round: bool = True,
) -> list[dict[str, Any]]:
    """`classic_layout` with the bucketed layers' weights transposed (default: the last).

    ``N`` buckets of ``out`` outputs are ``N*out`` outputs, which bullet's
    column-major matrix interleaves; ``"transpose"`` writes ``[bucket][out][in]``.
    """
    if bucketed is None:
        bucketed = len(scales) - 1
    layers = (bucketed,) if isinstance(bucketed, int) else bucketed
    return classic_layout(scales, types=types, round=round, transposed=layers)


def model_order(ids: Iterable[str]) -> list[str]:
    """``ids`` in model order: ``l0w, l0b, l1w, l1b, ...`` by layer number, then the others as given."""

    def key(i: str) -> tuple[int, int, bool]:
        m = LAYER_ID.match(i)
        return (0, int(m.group(1)), m.group(2) == "b") if m else (1, 0, False)

    return sorted(ids, key=key)


def float_layout(ids: Iterable[str]) -> list[dict[str, Any]]:
    """Every tensor as an untransformed ``f32`` entry, in `model_order`."""
    return [Spec(i).to_json() for i in model_order(ids)]
