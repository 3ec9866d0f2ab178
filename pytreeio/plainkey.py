"""Exact keys of plain data, for memos of work that is a pure function of it.

A training run saves and loads the same structure again and again: its layer
list, its architecture document.  Work that depends on such a value alone
(checking a layer list, writing a document as text) is kept by a key of the
value; two values may share the result only when they are the same plain data
of the same types, so the key is a pickle that only plain data can make.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["plain_key"]


class _NotPlain(Exception):
    pass


class _PlainPickler(pickle.Pickler):
    """Pickles plain data only: exact dicts, lists, tuples, strs, numbers, bools and None.

    The C pickler handles those itself and asks ``reducer_override`` about anything
    else (subclasses included), which refuses: equal pickles then mean equal values
    of the same types (``True`` is not ``1``, a tuple not a list, ``-0.0`` not ``0.0``).
    """

    def reducer_override(self, obj: Any) -> Any:
        raise _NotPlain


def plain_key(value: Any) -> bytes | None:
    """Bytes equal for two values exactly when they are equal plain data of the same types
    (nested exact dicts, lists, tuples, strs, ints, floats, bools, None); None for anything else."""
    buf = io.BytesIO()
    try:
        _PlainPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except (_NotPlain, pickle.PicklingError, RecursionError, TypeError, ValueError):
        return None
    return buf.getvalue()
