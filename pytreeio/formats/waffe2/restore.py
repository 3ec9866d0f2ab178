"""A cl-waffe2 native tree restored into a native-shaped ``like``; the missing/extra report.

Arrays (stored 1-D) take ``like``'s shape when their element count and dtype
match.  ``strict=True`` raises `MismatchError` for keys missing from the
file or left over; ``strict=False`` (cl-waffe2's behaviour) keeps ``like``'s
value for a missing entry, warns and fills ``report``.  A partial load leaves
out the file's entries ``like`` does not name.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from pytreeio.core.errors import EncodeError, MismatchError, PytreeioWarning
from pytreeio.core.tree import LazyLeaf, allows_extra, describe_leaf, is_array_leaf
from pytreeio.core.tree import restore as restore_leaf
from pytreeio.formats.waffe2.keys import type_of


def report_name(path: tuple[str, ...], value: Any) -> str:
    """The state-dict key of a native path (optimizer keys with the type of ``value``)."""
    if len(path) == 4:
        return f"{path[0]}:{'.'.join(path[1:])}"
    if len(path) == 6:
        try:
            tensor = is_array_leaf(value) and not isinstance(value, np.generic)
            spec = "cputensor" if tensor else type_of(value)
        except EncodeError:
            spec = "?"
        c, n, s, opt, slot = path[1:]
        return f"{path[0]}:{c}.{n}.{s}.{opt}.{spec}.{slot}"
    return "/".join(path)


def _leaf_paths(node: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    if not isinstance(node, Mapping):
        return [(path, node)]
    return [x for k, v in node.items() for x in _leaf_paths(v, (*path, str(k)))]


class Outcome:
    """The keys a restore found missing from the file, and those the file has beyond ``like``."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.extra: list[str] = []


def settle(out: Outcome, strict: bool, report: Any, what: str) -> None:
    """Raise (strict) or warn about missing and extra keys; fill ``report``."""
    if report is not None:
        if not isinstance(report, dict):
            raise TypeError(f"report must be a dict to fill, not {type(report).__name__}")
        report.update(missing=list(out.missing), extra=list(out.extra))
    text = "; ".join(
        [f"missing from the file: {out.missing}"] * bool(out.missing)
        + [f"in the file but not in {what}: {out.extra}"] * bool(out.extra)
    )
    if text and strict:
        raise MismatchError(
            text + " (strict=False loads the rest, as cl-waffe2 does)",
            key_path=(out.missing or out.extra)[0],
            expected=out.missing or None,
            found=out.extra or None,
        )
    if text:
        warnings.warn(f"waffe2: {text}", PytreeioWarning, stacklevel=4)


def _restore_node(native: Any, like: Any, path: tuple[str, ...], out: Outcome) -> Any:
    if isinstance(like, Mapping):
        if native is None:
            out.missing.extend(report_name(p, v) for p, v in _leaf_paths(like, path))
            return like
        if not isinstance(native, Mapping):
            raise MismatchError(
                "the file has a value where `like` has a subtree",
                key_path="/".join(path),
                expected="a dict",
                found=describe_leaf(native),
            )
        result = {
            k: _restore_node(native.get(str(k)), v, (*path, str(k)), out) for k, v in like.items()
        }
        if not allows_extra():
            wanted = {str(x) for x in like}
            for k, v in native.items():
                if k not in wanted:
                    out.extra.extend(report_name(p, x) for p, x in _leaf_paths(v, (*path, k)))
        return result if type(like) is dict else type(like)(result)  # type: ignore[call-arg]
    if native is None:
        out.missing.append(report_name(path, like))
        return like
    if isinstance(native, Mapping):
        raise MismatchError(
            "the file has a subtree where `like` has a leaf",
            key_path="/".join(path),
            expected=describe_leaf(like),
            found="a dict",
        )
    return _restore_value(native, like, path)


def _restore_value(native: Any, like: Any, path: tuple[str, ...]) -> Any:
    where = report_name(path, native)
    if is_array_leaf(native) and not isinstance(native, np.generic):
        if not is_array_leaf(like) or np.dtype(like.dtype) != native.dtype:
            raise MismatchError(
                "dtype differs" if is_array_leaf(like) else "the file holds an array here",
                key_path=where,
                expected=describe_leaf(like),
                found=describe_leaf(native),
            )
        want, count = tuple(like.shape), math.prod(native.shape)  # a lazy leaf has no .size
        if math.prod(want) != count:
            raise MismatchError(
                "element count differs",
                key_path=where,
                expected=f"{math.prod(want)} elements {list(want)}",
                found=f"{count} elements {list(native.shape)}",
            )
        if tuple(native.shape) != want:
            native = (native.read() if isinstance(native, LazyLeaf) else native).reshape(want)
        return restore_leaf(native, like, path=(where,))
    if is_array_leaf(like) and tuple(like.shape) == () and np.dtype(like.dtype).kind == "f":
        # cl-waffe2's numbers are single-floats: rounding into a float like is expected.
        return restore_leaf(np.asarray(native, dtype=like.dtype), like, path=(where,))
    return restore_leaf(native, like, path=(where,))


def restore(
    native: Any,
    meta: Mapping[str, Any],
    like: Any,
    *,
    strict: bool = True,
    report: dict[str, Any] | None = None,
) -> Any:
    """The native tree in the structure of a native-shaped ``like`` (shapes and kinds from ``like``)."""
    del meta
    out = Outcome()
    result = _restore_node(native, like, (), out)
    settle(out, strict, report, "`like`")
    return result
