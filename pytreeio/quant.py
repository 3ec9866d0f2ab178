"""Jit-compiled layout transforms and quantisation.

jax is imported on first use, never at ``import pytreeio``.  Every transform
is compiled once per (shape, dtype, static arguments) and runs on the default
JAX device (an accelerator when present); results come back as numpy arrays
because they are about to be written to a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np

from . import dtypes

__all__ = ["transpose", "transpose_to_device"]


@cache
def _jit_transpose(axes: tuple[int, ...]) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x: jnp.transpose(x, axes))


def transpose_to_device(x: Any, axes: Sequence[int]) -> Any:
    """``x.transpose(axes)`` as a jax array, computed by a jit-compiled kernel."""
    return _jit_transpose(tuple(int(a) for a in axes))(x)


def transpose(x: Any, axes: Sequence[int]) -> np.ndarray:
    """``x.transpose(axes)`` computed by a jit-compiled kernel, returned as a C-contiguous numpy array.

    Arrays of 0 or 1 dimensions, and identity permutations, are returned
    without a round trip through the device.
    """
    axes = tuple(int(a) for a in axes)
    arr = x if isinstance(x, np.ndarray) else None
    if axes == tuple(range(len(axes))):
        return dtypes.c_order(np.asarray(x))
    if arr is not None and arr.size == 0:
        return dtypes.c_order(arr.transpose(axes))
    return np.asarray(transpose_to_device(x, axes))
