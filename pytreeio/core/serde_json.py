"""JSON text exactly as Rust's ``serde_json::to_string`` writes a ``serde_json::Value``.

Formats written by Rust programs (DataCode's ``.nn``) embed JSON produced by
``serde_json``; rewriting such a file byte for byte needs the same text:

* compact: no spaces, no trailing newline;
* object keys sorted at every level (``serde_json::Map`` is a ``BTreeMap``:
  byte order of the UTF-8 keys, which is code-point order);
* strings: UTF-8 as is; ``"`` and ``\\`` escaped; control characters below
  U+0020 as ``\\b \\t \\n \\f \\r`` or ``\\u00xx`` (lower-case hex); nothing
  else escaped (not ``/``, not U+007F, not non-ASCII);
* integers plainly (``i64``/``u64`` range);
* floats as the ``ryu`` crate's ``format_finite``: the shortest digits that
  round-trip the ``f64``, then ``1.0`` for integral values below ``1e16``,
  fixed notation while the decimal exponent is in ``[-5, 15]``, otherwise
  ``1e-8``/``2.5e-6``/``1e16``/``1.2345678901234568e17`` (no ``+``, no
  zero padding); ``-0.0`` keeps its sign; NaN and infinities are ``null``.

Python's ``repr(float)`` yields the same shortest round-trip digits as
``ryu`` (both pick the closest of the shortest candidates), so only the
layout differs; `format_float` re-lays them out.  ``f32`` values that
Rust widened to ``f64`` before printing (``0.001f32`` appears as
``0.0010000000474974513``) are produced by `widen_f32`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pytreeio.core.errors import EncodeError

__all__ = ["dumps", "dump_bytes", "format_float", "widen_f32", "MAX_DEPTH"]

#: serde_json refuses to parse deeper nesting (its recursion limit); we refuse to write it.
MAX_DEPTH = 128
_I64_MIN = -(1 << 63)
_U64_MAX = (1 << 64) - 1

_SHORT_ESCAPES = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r"}
# str.translate table: every character serde_json escapes.
_ESCAPES: dict[int, str] = {c: _SHORT_ESCAPES.get(c, f"\\u{c:04x}") for c in range(0x20)}
_ESCAPES[ord('"')] = '\\"'
_ESCAPES[ord("\\")] = "\\\\"


def widen_f32(x: Any) -> float:
    """``x`` rounded to ``f32`` and widened back to a Python float, as Rust's ``f32 as f64``."""
    return float(np.float32(x))


def _shortest_digits(x: float) -> tuple[str, int]:
    """``(digits, kk)`` with ``abs(x) == 0.<digits> * 10**kk``, digits shortest round-trip, no zero ends."""
    text = repr(abs(x))
    mantissa, _, exp = text.partition("e")
    whole, _, frac = mantissa.partition(".")
    every = whole + frac
    digits = every.lstrip("0")
    # Each leading zero ("0.000ddd") moves the decimal point one place left.
    kk = len(whole) + (int(exp) if exp else 0) - (len(every) - len(digits))
    return digits.rstrip("0"), kk


def format_float(x: float) -> str:
    """``x`` as serde_json prints an ``f64`` (``null`` for NaN and infinities)."""
    if not math.isfinite(x):
        return "null"
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    if x == 0:
        return sign + "0.0"
    digits, kk = _shortest_digits(x)
    length = len(digits)
    k = kk - length  # value = digits * 10**k
    if k >= 0 and kk <= 16:  # integral: 1234e7 -> 12340000000.0
        return f"{sign}{digits}{'0' * k}.0"
    if 0 < kk <= 16:  # 1234e-2 -> 12.34
        return f"{sign}{digits[:kk]}.{digits[kk:]}"
    if -5 < kk <= 0:  # 1234e-6 -> 0.001234
        return f"{sign}0.{'0' * -kk}{digits}"
    if length == 1:  # 1e30
        return f"{sign}{digits}e{kk - 1}"
    return f"{sign}{digits[0]}.{digits[1:]}e{kk - 1}"  # 1234e30 -> 1.234e33


def _string(s: str) -> str:
    # printable text holds no control character: only '"' and '\\' could need escaping
    if s.isprintable() and '"' not in s and "\\" not in s:
        return '"' + s + '"'
    return '"' + s.translate(_ESCAPES) + '"'


def _scalar(value: Any, where: str) -> str | None:
    """The JSON text of a scalar, or None when ``value`` is a container."""
    kind = type(value)
    if kind is str:  # the common kinds first, by exact type
        return _string(value)
    if kind is int and _I64_MIN <= value <= _U64_MAX:
        return str(value)
    if value is None:
        return "null"
    if value is True or value is False or isinstance(value, np.bool_):
        return "true" if value else "false"
    if isinstance(value, int | np.integer):
        v = int(value)
        if not _I64_MIN <= v <= _U64_MAX:
            raise EncodeError(f"integer {v} is outside serde_json's i64/u64 range", key_path=where)
        return str(v)
    if isinstance(value, float | np.floating):
        return format_float(float(value))
    if isinstance(value, str):
        return _string(value)
    return None


def _write(value: Any, out: list[str], where: str, depth: int) -> None:
    text = _scalar(value, where)
    if text is not None:
        out.append(text)
        return
    if depth >= MAX_DEPTH:
        raise EncodeError(f"nesting deeper than {MAX_DEPTH} levels", key_path=where)
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise EncodeError(
                f"JSON object keys must be strings, found {type(bad[0]).__name__} {bad[0]!r}",
                key_path=where,
            )
        out.append("{")
        for i, key in enumerate(sorted(value)):
            if i:
                out.append(",")
            out.append(_string(key))
            out.append(":")
            _item(value[key], out, where, key, depth + 1)
        out.append("}")
        return
    if isinstance(value, list | tuple):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _item(item, out, where, i, depth + 1)
        out.append("]")
        return
    if isinstance(value, np.ndarray) and value.ndim == 0:
        _write(value.item(), out, where, depth)
        return
    raise EncodeError(f"{type(value).__name__} has no JSON form", key_path=where)


def _item(value: Any, out: list[str], parent: str, key: str | int, depth: int) -> None:
    """``value``, member ``key`` of the container at ``parent``: its key path is built only
    for a container or an error (most members are scalars)."""
    try:
        text = _scalar(value, "")
    except EncodeError:
        text = _scalar(value, _path(parent, key))  # raises again, naming the member
    if text is not None:
        out.append(text)
    else:
        _write(value, out, _path(parent, key), depth)


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def dumps(value: Any) -> str:
    """The text ``serde_json::to_string`` writes for ``value`` (dicts, lists, tuples, str, numbers, bools, None).

    Raises `EncodeError` naming the key path for keys that are not
    strings, integers outside ``i64``/``u64``, nesting deeper than
    `MAX_DEPTH`, and values with no JSON form.
    """
    out: list[str] = []
    _write(value, out, "", 0)
    return "".join(out)


def dump_bytes(value: Any) -> bytes:
    """`dumps` as UTF-8 bytes (a lone surrogate, which Rust strings cannot hold, is an `EncodeError`)."""
    text = dumps(value)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EncodeError(
            f"a string holds a lone surrogate U+{ord(text[exc.start]):04X}, which UTF-8 cannot encode",
            key_path=None,
        ) from None
