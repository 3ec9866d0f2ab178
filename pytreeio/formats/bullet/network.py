"""bullet's network files, laid out by the saved format (`.layout`)::

    raw.bin        each entry's values as f32, in list order, untransformed; no header, no padding
    quantised.bin  each entry transformed and quantised on its own, in list order, then padded
                   to a multiple of 64 bytes with b"bullet" repeated (zeros before 2024-03)

Every integer entry is range-checked (`pytreeio.core.quant`) before a byte is
written, so that a value that does not fit leaves quantised.bin out whole; the values
are computed as the file is written.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pytreeio.core import quant
from pytreeio.core.binary import ByteSource, Deferred, Streamed, Writer, as_memoryview
from pytreeio.core.errors import EncodeError, FormatError, PytreeioWarning
from pytreeio.formats.bullet.layout import TRANSFORMS, TYPES, Spec, padding
from pytreeio.formats.bullet.records import F32

RAW = "raw.bin"
QUANTISED = "quantised.bin"


def f32(value: Any, key: str) -> Any:
    """A leaf as a C-order little-endian float32 array (float16/bfloat16 widen exactly; nothing
    else is cast).  A `pytreeio.core.binary.Streamed` leaf (a conversion's) stays one."""
    if type(value) is np.ndarray and value.dtype == F32 and value.flags.c_contiguous:
        return value
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise EncodeError(f"expected a float32 array, found {type(value).__name__}", key_path=key)
    try:
        arr = value if isinstance(value, Streamed) else np.asarray(value)
    except Exception as exc:
        why = f"this leaf has no values to write ({type(exc).__name__})"
        raise EncodeError(why, key_path=key) from None
    if arr.dtype.name == "float32":
        return arr if isinstance(arr, Streamed) else np.ascontiguousarray(arr, dtype=F32)
    if arr.dtype.name in ("float16", "bfloat16"):
        return arr.astype(F32)
    why = f"bullet stores float32 values; found {arr.dtype.name} (convert it explicitly)"
    raise EncodeError(why, key_path=key)


def transformed(
    spec: Spec, array: Any, tensors: Mapping[str, Any], fuse_last: bool = False
) -> tuple[Any, bool]:
    """``array`` after the entry's transforms; with ``fuse_last`` a trailing 2-D transpose is
    left to the quantiser (it then moves 1-4 byte integers instead of float32 values)."""
    steps = list(spec.transforms)
    fused = fuse_last and steps[-1:] == ["transpose"] and array.ndim == 2
    for name in steps[: -1 if fused else None]:
        before = array.size
        result = TRANSFORMS[name](array, tensors)
        where = f"saved_format ({spec.id})"
        try:
            array = f32(result, spec.id)
        except EncodeError:
            found = getattr(result, "dtype", type(result).__name__)
            why = f"transform {name!r} must return float32 values, found {found}"
            raise EncodeError(why, key_path=where) from None
        if array.size != before:
            why = f"transform {name!r} changed the number of elements from {before} to {array.size}"
            raise EncodeError(why, key_path=where)
    return array, fused


def encode_raw(specs: Sequence[Spec], weights: Mapping[str, Any]) -> list[Any]:
    w = Writer()
    w.extend([weights[spec.id] for spec in specs], F32)
    return w.finish()


def _quantised(x32: Any, spec: Spec, fused: bool) -> np.ndarray:
    assert spec.scale is not None
    q = quant.quantise_async(x32, spec.scale, spec.type, round=spec.round, transpose=fused)
    return q.result().reshape(-1).view(np.uint8)


def encode_quantised(specs: Sequence[Spec], weights: Mapping[str, Any]) -> list[Any]:
    """quantised.bin's chunks, or the first entry's QuantisationError before any is made."""
    w = Writer()
    for spec in specs:
        arr, fused = transformed(spec, weights[spec.id], weights, fuse_last=spec.type != "f32")
        if spec.scale is None:
            w.array(arr, F32)
            continue
        x32 = quant.check_quantisable(arr, spec.scale, spec.type, round=spec.round, name=spec.id)
        if x32.size:
            make = functools.partial(_quantised, x32, spec, fused)
            w.deferred(Deferred(int(x32.size) * TYPES[spec.type].itemsize, make))
    w.raw(padding(w.nbytes))
    return w.finish()


def check_raw(size: int, specs: Sequence[Spec], counts: Mapping[str, int]) -> None:
    """raw.bin's size against the saved format."""
    want = 4 * sum(counts[s.id] for s in specs)
    if size != want:
        why = (
            f"raw.bin holds {size} bytes; the saved format lists {want} ({len(specs)} f32 entries)"
        )
        raise FormatError(why, path=RAW, offset=min(size, want))


def check_quantised(src: ByteSource, specs: Sequence[Spec], counts: Mapping[str, int]) -> bool:
    """quantised.bin's size and padding (the only bytes read) against the saved format.

    False, with a warning, for an empty file where data is due: bullet creates the file
    before quantising, so a save whose values did not fit leaves it empty.
    """
    data = sum(counts[s.id] * TYPES[s.type].itemsize for s in specs)
    want = data + len(padding(data))
    if src.size == 0 < want:
        why = "quantised.bin is empty (bullet leaves it so when quantisation failed on save)"
        warnings.warn(f"{why}; read as absent", PytreeioWarning, stacklevel=2)
        return False
    if src.size != want:
        why = f"quantised.bin holds {src.size} bytes; the saved format gives {data} bytes of data"
        why += f" + {want - data} of padding = {want}"
        raise FormatError(why, path=QUANTISED, offset=min(src.size, want))
    pad = bytes(src.read(data, want - data, "padding"))
    if pad != padding(data) and pad != bytes(len(pad)):
        at = data + next(i for i, (a, b) in enumerate(zip(pad, padding(data))) if a != b)
        why = "the padding is neither bullet's pattern nor zeros"
        raise FormatError(why, path=QUANTISED, field="padding", offset=at)
    return True


def entry_arrays(
    buf: Any, specs: Sequence[Spec], counts: Mapping[str, int], quantised: bool
) -> dict[str, np.ndarray]:
    """Each entry's values as written (flat), from raw.bin or quantised.bin (sizes checked)."""
    view = as_memoryview(buf)
    out = {}
    pos = 0
    for spec in specs:
        dtype = TYPES[spec.type] if quantised else F32
        out[spec.id] = np.frombuffer(view, dtype=dtype, count=counts[spec.id], offset=pos)
        pos += counts[spec.id] * dtype.itemsize
    return out


def quantisation_report(
    q_buf: Any,
    raw: Mapping[str, np.ndarray],
    specs: Sequence[Spec],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, float]:
    """The largest ``|q/scale - x|`` per entry, ``x`` raw.bin's values transformed."""
    qs = entry_arrays(q_buf, specs, {k: math.prod(v) for k, v in shapes.items()}, quantised=True)
    report = {}
    for spec in specs:
        want, _ = transformed(spec, raw[spec.id].reshape(shapes[spec.id]), raw)
        report[spec.id] = quant.quantisation_error(qs[spec.id], spec.scale or 1, want)
    return report
