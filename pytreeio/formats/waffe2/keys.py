"""cl-waffe2's state-dict conventions as pure functions: keys, NTH, type specifiers, ``~F``.

Each mirrors a piece of cl-waffe2 (commit ``e83ab237``) or of SBCL x86-64, so
that the format writes what cl-waffe2 writes, byte for byte:

* **Keys** (``make-tensor-saved-name``): ``{prefix}:{part}.{part}...``, every
  part printed with ``~(~a~)`` (lower case).  ``param``/``missing_param``
  take 3 parts (composite, nth, slot), ``optimizer``/``missing_optimizer`` 6
  (composite, nth, slot, optimizer, type, optimizer slot).
  `parse_state_dict_key` splits as ``parse-state-dict-key`` does:
  ``cl-ppcre:split`` on ``:`` must give a known prefix and one rest, split on
  ``.``; ``cl-ppcre:split`` drops trailing empty strings (``param:a.0.b:``
  parses as ``param:a.0.b``).
* **NTH** (``make-state-dict-table``): one counter per (composite, slot), from
  0, in parameter order - not the layer index (`assign_nth`).
* **Type specifiers**: ``(type-of value)`` lower-cased (`type_of`):
  ``single-float``, ``double-float``; integers ``bit`` (0, 1),
  ``(integer 0 4611686018427387903)`` (2 .. most-positive-fixnum), ``fixnum``
  (negative fixnums), ``(integer 4611686018427387904)`` and
  ``(integer * -4611686018427387905)`` (bignums); a tensor's class name.
* **Numbers**: floats as ``(format nil "~f" x)``: fixed notation, the
  shortest digits that read back as the same float of its Lisp type
  (`format_lisp_float`); integers plainly.
* **JSON strings** as ``jonathan`` writes them: only newline, return, tab,
  ``"`` and ``\\`` escaped (`jonathan_string`).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from pytreeio.core.errors import EncodeError, FormatError

PARAM_PREFIXES = ("param", "missing_param")
OPTIMIZER_PREFIXES = ("optimizer", "missing_optimizer")
PREFIXES = PARAM_PREFIXES + OPTIMIZER_PREFIXES

#: SBCL x86-64 fixnums are 62-bit signed.
MOST_POSITIVE_FIXNUM = 2**62 - 1
MOST_NEGATIVE_FIXNUM = -(2**62)

_PARTS = {"param": 3, "missing_param": 3, "optimizer": 6, "missing_optimizer": 6}
_PART_NAMES = ("composite", "nth", "slot", "optimizer", "type", "optslot")


class _Key(NamedTuple):
    prefix: str
    parts: tuple[str, ...]


class StateDictKey(_Key):
    """A parsed state-dict key: its prefix as spelled, and the parts after it."""

    @property
    def keyword(self) -> str:
        """The keyword ``parse-state-dict-key`` returns, e.g. ``:MISSING-PARAM``."""
        return ":" + self.prefix.replace("_", "-", 1).upper()

    is_param = property(lambda self: self.prefix in PARAM_PREFIXES)
    composite = property(lambda self: self.parts[0])
    nth = property(lambda self: self.parts[1])
    slot = property(lambda self: self.parts[2])
    optimizer = property(lambda self: None if self.is_param else self.parts[3])
    type = property(lambda self: None if self.is_param else self.parts[4])
    optslot = property(lambda self: None if self.is_param else self.parts[5])

    @property
    def ident(self) -> tuple[str, ...]:
        """What the key names, without its ``{type}``: two spellings of one entry are equal."""
        return (self.prefix, *self.parts[:4], *self.parts[5:])

    def __str__(self) -> str:
        return f"{self.prefix}:{'.'.join(self.parts)}"


def _ppcre_split(text: str, sep: str) -> list[str]:
    """``(cl-ppcre:split sep text)``: ``str.split`` minus trailing empty strings."""
    parts = text.split(sep)
    while parts and parts[-1] == "":
        parts.pop()
    return parts


def parse_state_dict_key(key: str) -> StateDictKey:
    """Split a state-dict key as cl-waffe2's ``parse-state-dict-key`` does.

    Raises `FormatError` (``field`` = the key) for a key without exactly
    one ``:``, an unknown prefix, or the wrong number of parts (cl-waffe2
    binds missing parts to NIL and ignores extra ones).
    """
    if not isinstance(key, str):
        raise FormatError(f"a state-dict key must be a string, not {type(key).__name__}")
    shown = key if len(key) <= 200 else key[:200] + "..."  # messages stay small
    pieces = _ppcre_split(key, ":")
    if len(pieces) != 2:
        what = "no ':'" if ":" not in key else f"{key.count(':')} ':'"
        what = "nothing after its ':'" if ":" in key and len(pieces) < 2 else what
        raise FormatError(
            f"state-dict key {shown!r} has {what}; expected exactly one, as "
            "{prefix}:{composite}.{nth}.{slot}[...]",
            field=shown,
        )
    prefix, rest = pieces
    parts = tuple(_ppcre_split(rest, "."))
    want = _PARTS.get(prefix)
    if want is None:
        raise FormatError(
            f"state-dict key {shown!r} has unknown prefix {prefix[:200]!r}; "
            f"known: {', '.join(PREFIXES)}",
            field=shown,
        )
    if len(parts) != want:
        layout = ".".join("{" + n + "}" for n in _PART_NAMES[:want])
        raise FormatError(
            f"state-dict key {shown!r} has {len(parts)} parts after {prefix!r}, expected {want} "
            f"({layout})",
            field=shown,
        )
    return StateDictKey(prefix, parts)


_NOT_IN_PART = re.compile(r"[.:/\x00]")


def _lisp_name(part: Any, what: str) -> str:
    """A key part as ``~(~a~)`` prints it, refused when it would not parse back."""
    if isinstance(part, bool) or not isinstance(part, str | int | np.integer):
        raise EncodeError(f"{what} must be a string or an integer, not {type(part).__name__}")
    text = part.lower() if isinstance(part, str) else str(int(part))
    if not text or _NOT_IN_PART.search(text) is not None:
        raise EncodeError(
            f"{what} {part!r} cannot be a key part (empty, or holds '.', ':', '/' or NUL)"
        )
    return text


def make_key(prefix: str, *parts: Any) -> str:
    """A state-dict key as ``make-tensor-saved-name`` prints it (every part lower-cased)."""
    if prefix not in _PARTS:
        raise EncodeError(f"unknown state-dict prefix {prefix!r}; known: {', '.join(PREFIXES)}")
    if len(parts) != _PARTS[prefix]:
        raise EncodeError(f"a {prefix!r} key has {_PARTS[prefix]} parts, {len(parts)} given")
    names = [_lisp_name(p, n) for p, n in zip(parts, _PART_NAMES, strict=False)]
    return f"{prefix}:{'.'.join(names)}"


def param_key(*parts: Any, missing: bool = False) -> str:
    """``param:{composite}.{nth}.{slot}`` (``missing_param:`` with ``missing``)."""
    return make_key("missing_param" if missing else "param", *parts)


def optimizer_key(*parts: Any, missing: bool = False) -> str:
    """``optimizer:{composite}.{nth}.{slot}.{optimizer}.{type}.{optslot}`` (or ``missing_optimizer:``)."""
    return make_key("missing_optimizer" if missing else "optimizer", *parts)


def assign_nth(pairs: Iterable[tuple[str, str]]) -> list[int]:
    """The NTH of each ``(composite, slot)`` in parameter order: one counter per pair, from 0.

    Linear(bias) -> Linear(no bias) -> Linear(bias) gives weights 0, 1, 2 but
    biases 0 and 1 (the second belongs to the third layer).
    """
    counts: dict[tuple[str, str], int] = {}
    out = []
    for composite, slot in pairs:
        k = (composite.lower(), slot.lower())
        out.append(counts.get(k, 0))
        counts[k] = out[-1] + 1
    return out


#: The largest integer a float can hold (a JSON integer beyond it is no float's value).
_LARGEST_FLOAT_INT = int(sys.float_info.max)
_INTEGER_FORM = re.compile(r"\A\(integer (\*|-?[0-9]+)(?: (\*|-?[0-9]+))?\)\Z")


class TypeSpec(NamedTuple):
    """A parsed ``{type}`` part: ``kind`` is ``"float"``, ``"integer"`` or ``"tensor"``.

    ``lo``/``hi`` bound integers (None = unbounded); ``name`` is the spelling.
    """

    kind: str
    name: str
    lo: int | None = None
    hi: int | None = None

    def admits(self, value: Any) -> bool:
        """Whether a JSON number ``value`` is of this type (integers within bounds)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind == "float":
            return not isinstance(value, int) or abs(value) <= _LARGEST_FLOAT_INT
        if self.kind != "integer" or not isinstance(value, int):
            return False
        return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)


def integer_type(n: int) -> str:
    """``(type-of n)`` for an integer, lower-cased, as SBCL x86-64 returns it."""
    if n in (0, 1):
        return "bit"
    if 1 < n <= MOST_POSITIVE_FIXNUM:
        return f"(integer 0 {MOST_POSITIVE_FIXNUM})"
    if MOST_NEGATIVE_FIXNUM <= n < 0:
        return "fixnum"
    if n > MOST_POSITIVE_FIXNUM:
        return f"(integer {MOST_POSITIVE_FIXNUM + 1})"
    return f"(integer * {MOST_NEGATIVE_FIXNUM - 1})"


def type_of(
    value: Any, *, float_type: str = "single-float", tensor_class: str = "cputensor"
) -> str:
    """The ``{type}`` part cl-waffe2 would write for ``value``.

    ``np.float32`` is ``single-float``, ``np.float64`` ``double-float``; a
    Python float is ``float_type`` (Lisp reads ``1e-3`` as a single-float).
    """
    if isinstance(value, bool | np.bool_):
        raise EncodeError(f"cl-waffe2 has no type for the boolean {value!r}")
    if isinstance(value, int | np.integer):
        return integer_type(int(value))
    if isinstance(value, np.generic):
        names = {np.dtype(np.float32): "single-float", np.dtype(np.float64): "double-float"}
        if value.dtype in names:
            return names[value.dtype]
        raise EncodeError(f"cl-waffe2 has no type for a {value.dtype} scalar")
    if isinstance(value, float):
        return float_type
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return tensor_class
    raise EncodeError(f"cl-waffe2 has no type for a {type(value).__name__}")


def parse_type_specifier(text: str) -> TypeSpec:
    """The meaning of a ``{type}`` part: a float type, an integer range, or a tensor class."""
    if text in ("single-float", "double-float"):
        return TypeSpec("float", text)
    if text == "bit":
        return TypeSpec("integer", text, 0, 1)
    if text == "fixnum":
        return TypeSpec("integer", text, MOST_NEGATIVE_FIXNUM, MOST_POSITIVE_FIXNUM)
    m = _INTEGER_FORM.match(text)
    if m:
        try:
            lo = None if m.group(1) == "*" else int(m.group(1))
            hi = None if m.group(2) in (None, "*") else int(m.group(2))
        except ValueError:  # beyond Python's int-from-string digit limit
            raise FormatError(
                f"type specifier {text[:60]!r}... has a bound of too many digits", field="type"
            ) from None
        return TypeSpec("integer", text, lo, hi)
    if text.startswith("(") or not text or any(c.isspace() for c in text):
        raise FormatError(f"unknown type specifier {text!r}", field="type")
    return TypeSpec("tensor", text)


def format_lisp_float(x: float, *, double: bool = False) -> str:
    """``(format nil "~f" x)`` for a single-float (with ``double``, a double-float) ``x``.

    Fixed notation with the shortest digits that read back as the same float
    of that precision: ``0.01``, ``0.0000001``, ``1.0``, ``-0.0``.  Raises
    ``ValueError`` for NaN and infinities (Lisp prints them unreadably, never
    as JSON numbers) and for doubles that overflow a single-float.
    """
    if not math.isfinite(float(x)):
        raise ValueError(f"{x!r} has no ~F form that JSON can hold")
    with np.errstate(over="ignore"):
        v = np.float64(x) if double else np.float32(x)
    if not np.isfinite(v):
        raise ValueError(f"{x!r} overflows a single-float")
    # Dragon4 in unique mode gives the shortest round-tripping digits, as SBCL's
    # flonum-to-digits does; trim='0' keeps the ".0" that ~F prints.
    return np.format_float_positional(v, unique=True, trim="0")


_JONATHAN_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\\": "\\\\"}
_NEEDS_ESCAPE = re.compile(r'[\n\r\t"\\]')


def jonathan_string(text: str) -> str:
    """``text`` as a JSON string the way ``jonathan`` writes it (other characters raw)."""
    return '"' + _NEEDS_ESCAPE.sub(lambda m: _JONATHAN_ESCAPES[m.group(0)], text) + '"'
