"""netcl's naming convention, shared by its model-file and checkpoint formats.

netcl names a layer's arrays as its state dict does and stores them in
PyTorch-like orientation; the common model form (`pytreeio.model.form`) uses
Flax names and orientation:

=========== ============================== ==================================
layer       netcl (orientation)            common form
=========== ============================== ==================================
Linear      weight (in, out), bias         kernel (in, out), bias
Conv2d      weight (out, in/groups, k, k)  kernel (k, k, in/groups, out) HWIO
BatchNorm2d gamma, beta, running_mean,     scale, bias, mean, var
            running_var
=========== ============================== ==================================

This module registers no format; it holds the mapping written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pytreeio.containers import npy
from pytreeio.core.binary import BufferSource, ByteSource, Streamed
from pytreeio.core.errors import ConversionError, EncodeError, MismatchError
from pytreeio.model.form import LAYERS, Model

__all__ = ["META_KEY", "NETCL_TYPES", "NAMES", "to_common", "to_netcl", "host", "check_types"]

META_KEY = "__netcl_meta__"
#: The layer types netcl 0.4.4 knows (the common vocabulary minus Softmax).
NETCL_TYPES = tuple(t for t in LAYERS if t != "Softmax")
#: netcl's array name for each common-form array name, per layer type, in netcl's order.
NAMES: dict[str, dict[str, str]] = {
    "Linear": {"kernel": "weight", "bias": "bias"},
    "Conv2d": {"kernel": "weight", "bias": "bias"},
    "BatchNorm2d": {
        "scale": "gamma",
        "bias": "beta",
        "mean": "running_mean",
        "var": "running_var",
    },
}
_HWIO_TO_OIHW = (3, 2, 0, 1)
_OIHW_TO_HWIO = (2, 3, 1, 0)


def to_common(arr: Any) -> Any:
    """A netcl array in the common orientation: 4-D OIHW conv weights become HWIO (a view).

    A numpy view of a numpy array, a view made when read of a
    `pytreeio.core.binary.Streamed` one.
    """
    if getattr(arr, "ndim", 0) == 4:
        if isinstance(arr, Streamed):
            return arr.transpose(_OIHW_TO_HWIO)
        return np.asarray(arr).transpose(_OIHW_TO_HWIO)
    return arr


def to_netcl(arr: Any) -> Any:
    """A common-form array in netcl orientation, C-contiguous.

    A 4-D kernel that came from `to_common` is a view whose transpose
    back is contiguous again (no copy); any other moves through the
    jit-compiled transpose.
    """
    if getattr(arr, "ndim", 0) != 4:
        return arr
    from pytreeio.core.transpose import transpose  # here: most arrays are not 4-D kernels

    if isinstance(arr, Streamed):  # transposed when read (back to the array read, if it came so)
        return arr.transpose(_HWIO_TO_OIHW)
    if isinstance(arr, np.ndarray):
        view = arr.transpose(_HWIO_TO_OIHW)
        if view.flags.c_contiguous:
            return view
    return transpose(arr, _HWIO_TO_OIHW)


#: netcl array name -> common-form name, per layer type (the inverse of `NAMES`).
_COMMON_NAMES = {t: {v: k for k, v in names.items()} for t, names in NAMES.items()}


def layer_to_common(ltype: str, arrays: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One layer's netcl-named arrays under common-form names and orientation."""
    names = _COMMON_NAMES.get(ltype, {})
    if arrays.keys() <= names.keys():
        return {names[k]: to_common(a) for k, a in arrays.items()}
    unknown = sorted(k for k in arrays if k not in names)
    if unknown:
        raise MismatchError(f"unexpected array(s) {unknown} for a {ltype} layer", key_path=where)
    return {names[k]: to_common(a) for k, a in arrays.items()}


def host(x: Any, where: str) -> Any:
    """``x`` as a numpy array ready to write, or `EncodeError` naming ``where``.

    A `pytreeio.core.binary.Streamed` array stays one: it is read when written.
    """
    if isinstance(x, Streamed):
        return x
    if hasattr(x, "shape") and not hasattr(x, "__array__"):
        raise EncodeError("cannot save an abstract array (ShapeDtypeStruct)", key_path=where)
    arr = np.asarray(x)
    if arr.dtype.hasobject:
        raise EncodeError("object arrays cannot be stored", key_path=where)
    return arr


def check_types(model: Model) -> None:
    """Raise `ConversionError` for layers netcl has no type for."""
    bad = [
        f"layer {i} ({la.type})" for i, la in enumerate(model.layers) if la.type not in NETCL_TYPES
    ]
    if bad:
        raise ConversionError(f"netcl has no layer type for: {', '.join(bad)}", what=bad)


def read_npz(source: Any, name: str, verify_crc: bool) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` of role ``name`` in ``source`` (a mapping of files or buffers).

    Files of an ``io.FileSet`` are read by `pytreeio.containers.npy.read_npz` itself,
    which takes the CRC-32s as it reads (one pass instead of a read and a hash).
    """
    ranges = getattr(source, "ranges", None)
    ranged = ranges(name) if callable(ranges) else None
    if ranged is not None:
        with ranged:
            return npy.read_npz(ranged, verify_crc=verify_crc)
    data = source[name]
    src = data if isinstance(data, ByteSource) else BufferSource(data, name=name)
    return npy.read_npz(src, verify_crc=verify_crc)
