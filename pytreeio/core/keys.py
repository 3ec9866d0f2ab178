"""Typed PRNG keys (``jax.random.key``): recognising, storing and restoring them.

A typed key array has a key dtype (``key<fry>`` for ``threefry2x32``); numpy
cannot hold it.  What a file stores is its **key data**
(``jax.random.key_data``: ``uint32`` with the implementation's trailing key
shape, ``(..., 2)`` for threefry) and the **implementation name**
(``threefry2x32``, ``rbg``, ``unsafe_rbg``, ...); loading wraps the data again
with ``jax.random.wrap_key_data``.  How each format records the name:

* ``msgpack``: the map ``{'__msgpack_prng_key__': True, 'impl': name,
  'data': <uint32 array>}`` in place of the key (the convention of flax's own
  ``__msgpack_chunked_array__``; flax has none for keys, and reads such a file
  as that plain map);
* ``safetensors``: the key data is an ordinary ``U32`` tensor, and its node in
  the structure document is ``{"leaf": name, "key": impl}``.

Every other format refuses a key leaf with an `pytreeio.core.errors.EncodeError`
naming its key path (`refuse`).  Old-style keys (``jax.random.PRNGKey``,
plain ``uint32[2]`` arrays) are ordinary arrays everywhere.

jax is never imported here: nothing can be a typed key unless jax is loaded,
and wrapping data read from a file imports it on first use.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from pytreeio.core.errors import EncodeError

__all__ = [
    "is_key",
    "is_key_dtype",
    "impl_name",
    "key_data",
    "wrap",
    "HOLDS_KEYS",
]

#: The formats that store typed keys as keys; every other one refuses them.
HOLDS_KEYS = frozenset({"msgpack", "safetensors"})


def is_key_dtype(dtype: Any) -> bool:
    """True for a jax PRNG key dtype (``key<fry>``); numpy dtypes never are."""
    if dtype is None or isinstance(dtype, np.dtype):
        return False
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def is_key(x: Any) -> bool:
    """True for a typed PRNG key array or a ``ShapeDtypeStruct`` of one."""
    return is_key_dtype(getattr(x, "dtype", None))


def impl_name(x: Any) -> str:
    """The name of a key's PRNG implementation (``threefry2x32``), for an array or a ShapeDtypeStruct."""
    impl = getattr(x.dtype, "_impl", None)
    name = getattr(impl, "name", None)
    if isinstance(name, str):
        return name
    import jax

    found = jax.random.key_impl(x)
    return found if isinstance(found, str) else str(found)


def key_data(x: Any, where: str) -> tuple[str, np.ndarray]:
    """``(implementation name, uint32 key data on the host)`` of a typed key array."""
    import jax

    name = impl_name(x)
    try:
        data = np.asarray(jax.random.key_data(x))
    except Exception as exc:  # a tracer or an abstract value: nothing to write
        raise EncodeError(
            f"this PRNG key has no values to write ({type(exc).__name__})", key_path=where
        ) from None
    return name, data


def wrap(data: Any, impl: Any, fail: Any) -> Any:
    """``jax.random.wrap_key_data(data, impl=impl)``; ``fail(reason)`` builds the error otherwise.

    ``data`` must be a ``uint32`` array whose trailing shape is the
    implementation's key shape, and ``impl`` a name jax knows.
    """
    if not isinstance(impl, str) or not impl:
        raise fail(f"a PRNG key's implementation must be a name, found {impl!r:.60}")
    dt = getattr(data, "dtype", None)
    if not isinstance(data, np.ndarray) or dt != np.dtype(np.uint32):
        found = np.dtype(dt).name if isinstance(dt, np.dtype) else type(data).__name__
        raise fail(f"PRNG key data must be a uint32 array, found {found}")
    import jax

    try:
        # A copy: jax on CPU may alias a numpy array, and a key must not keep the
        # buffer it was read from (the whole file) alive or mapped.
        arr: Any = np.array(data, copy=True)
        return jax.random.wrap_key_data(arr, impl=impl)
    except Exception as exc:  # unknown implementation, wrong trailing shape
        raise fail(f"cannot rebuild a {impl!r:.60} PRNG key: {exc}".split("\n")[0]) from None
