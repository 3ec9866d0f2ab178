"""The array dtypes pytreeio reads and writes, by the names formats use.

Only plain numeric and boolean dtypes are accepted from files: object,
structured and string dtypes never are, so no file can make numpy unpickle
or interpret anything.  ``bfloat16`` and the float8 types come from
``ml_dtypes`` (a small numpy extension that jax itself depends on).
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["by_name", "NAMES", "check_plain", "little_endian", "c_order"]


def _little(name: str) -> np.dtype[Any]:
    """numpy's own instance where native order is little-endian: comparing it is an identity test.

    (``newbyteorder`` makes a new dtype object even when the order is unchanged,
    and dtype equality between distinct objects costs ~0.3 us: a
    ``load(like=...)`` compares every leaf's.)
    """
    dtype = np.dtype(name)
    if dtype.byteorder == "|" or (dtype.byteorder == "=" and sys.byteorder == "little"):
        return dtype
    return dtype.newbyteorder("<")


_DTYPES: dict[str, np.dtype[Any]] = {
    name: _little(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
_DTYPES["bool"] = np.dtype(np.bool_)
_DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
_DTYPES["float8_e4m3fn"] = np.dtype(ml_dtypes.float8_e4m3fn)
_DTYPES["float8_e5m2"] = np.dtype(ml_dtypes.float8_e5m2)

_PLAIN: frozenset[np.dtype[Any]] = frozenset(_DTYPES.values())

#: The accepted dtype names.
NAMES: frozenset[str] = frozenset(_DTYPES)


#: ``dtype.name`` by dtype: numpy computes the name in Python (~3 us), and an inspect of
#: thousands of tensors asks it for each.
_NAMES: dict[np.dtype[Any], str] = {}


def name_of(dtype: np.dtype[Any]) -> str:
    """``dtype.name``, remembered per dtype."""
    name = _NAMES.get(dtype)
    if name is None:
        name = dtype.name
        if len(_NAMES) < 1024:
            _NAMES[dtype] = name
    return name


def by_name(name: str) -> np.dtype[Any] | None:
    """The little-endian dtype called ``name`` (numpy's ``dtype.name``), or None."""
    return _DTYPES.get(name)


def check_plain(dtype: np.dtype[Any]) -> str | None:
    """Why ``dtype`` cannot be stored (object, structured, unknown), or None if it can."""
    if dtype in _PLAIN:
        return None
    if dtype.hasobject:
        return "object arrays cannot be stored"
    if dtype.fields is not None:
        return "structured arrays cannot be stored"
    if dtype.name not in _DTYPES:
        return f"dtype {dtype.name!r} is not supported"
    return None


def little_endian(arr: np.ndarray) -> np.ndarray:
    """``arr`` in little-endian byte order (a view when it already is)."""
    if arr.dtype.byteorder == ">":
        return arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def c_order(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a C-contiguous little-endian array of the same shape (0-d stays 0-d; no copy if it already is)."""
    arr = little_endian(arr)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")
