"""Transposes: numpy views copied into C order on the host, jax arrays by a jit kernel where they live.

numpy copies a transposed 2-D view element by element in the destination's
order, one cache miss per element.  `copy_transposed` copies bands of
`_TILE` source rows instead (whole cache lines read, ``_TILE``
consecutive values written per destination row), 1.4-1.8x numpy's copy on
one core, and splits a large copy over `pytreeio.core.threads.pool` (numpy
releases the GIL in copies).  Every element is copied, never computed: the
result is bit-identical to ``view.copy()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np

from pytreeio.core import dtypes
from pytreeio.core.threads import cores, pool, share

__all__ = ["copy_transposed", "transpose", "transpose_to_device"]

#: Rows of the source copied per step: 16 float32 values are one 64-byte cache
#: line of each destination row.
_TILE = 16

#: Below this many bytes a copy stays on the calling thread (a pool hand-off
#: costs more than it saves).
_PARALLEL_MIN = 1 << 20


def _tiles(src: np.ndarray, dst: np.ndarray, span: tuple[int, int]) -> None:
    for i in range(span[0], span[1], _TILE):
        j = min(i + _TILE, span[1])
        dst[i:j] = src[i:j]


def copy_transposed(view: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = view`` for a C-contiguous ``out`` and a strided (transposed) ``view``.

    A 2-D view whose columns are closer in memory than its rows is copied in
    tiles, split over the pool when large; other layouts go through
    ``np.copyto``.  ``out`` may differ from ``view`` in byte order only.
    """
    if view.shape != out.shape:
        raise ValueError(f"shapes differ: {view.shape} into {out.shape}")
    if not (view.ndim == 2 and view.shape[1] > 0 and abs(view.strides[0]) < abs(view.strides[1])):
        np.copyto(out, view, casting="equiv")
        return
    src, dst = view.T, out.T  # src rows are (nearly) contiguous runs of the source
    rows = src.shape[0]
    parts = cores() if view.nbytes >= _PARALLEL_MIN else 1
    step = -(-rows // parts // _TILE) * _TILE
    spans = [(s, min(s + step, rows)) for s in range(0, rows, step)]
    share(pool(), len(spans), lambda span: _tiles(src, dst, span), spans)


@cache
def _jit_transpose(axes: tuple[int, ...]) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x: jnp.transpose(x, axes))


def transpose_to_device(x: Any, axes: Sequence[int]) -> Any:
    """``x.transpose(axes)`` as a jax array, computed by a jit-compiled kernel."""
    return _jit_transpose(tuple(int(a) for a in axes))(x)


def transpose(x: Any, axes: Sequence[int]) -> np.ndarray:
    """``x.transpose(axes)`` as a C-contiguous, native or little-endian numpy array.

    Identity permutations and views whose transpose is already C-contiguous
    come back without a copy.  A numpy array is transposed on the host
    (`copy_transposed`; a big-endian one comes back little-endian),
    never importing jax: a trip to an accelerator and back costs more than
    the copy, and jax takes no big-endian arrays.  A jax array is transposed
    by a jit-compiled kernel where it lives.
    """
    axes = tuple(int(a) for a in axes)
    if axes == tuple(range(len(axes))):
        return dtypes.c_order(np.asarray(x))
    if not isinstance(x, np.ndarray):
        return np.asarray(transpose_to_device(x, axes))
    view = x.transpose(axes)
    if x.size == 0 or (view.flags.c_contiguous and view.dtype.byteorder in "=|<"):
        return dtypes.c_order(view)
    out = np.empty(
        view.shape, view.dtype.newbyteorder("<") if view.dtype.byteorder == ">" else view.dtype
    )
    copy_transposed(view, out)
    return out
