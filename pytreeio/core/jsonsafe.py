"""Bounded JSON parsing for documents read from files: the one place formats parse JSON.

Python's `json` parses hostile input into ``RecursionError`` (deep nesting),
``UnicodeDecodeError``, ``ValueError`` without a file offset, ``NaN``/``Infinity``
values that no JSON writer of ours emits, silently-merged duplicate keys, and
an unbounded number of Python objects.  `loads` checks all of that and
raises only `pytreeio.core.errors.FormatError`, naming the ``field`` and the
byte ``offset`` in the file.

API::

    loads(data, *, path=None, field=None, offset=0, exact=True,
          max_depth=MAX_DEPTH, max_values=None,
          allow_nan=False, allow_duplicates=False) -> Any

* ``data``: ``bytes``/``bytearray``/``memoryview`` (UTF-8, decoded strictly)
  or ``str``.
* ``path``, ``field``: the file and the field the document is, for errors.
* ``offset``: file offset of ``data[0]``.  With ``exact=True`` (the document
  is a contiguous byte range of the file) errors report ``offset`` plus the
  byte position of the problem; with ``exact=False`` (e.g. a JSON document
  held in a JSON string value, whose bytes are escaped in the file) they
  report ``offset`` itself and give the position within the document in the
  message.
* ``max_depth``: the most nested arrays/objects (``[[1]]`` is depth 2).  It is
  checked on the raw bytes *before* parsing, in time linear in the size
  (`scan`, vectorised with numpy 1 MiB at a time).
* ``max_values``: the most values (an upper estimate: commas + opening
  brackets + 1, outside strings) the document may create; default
  ``(len(data) + 64 MiB) // 64``, so that parsing costs about the document's
  size plus 64 MiB.  Formats whose documents legitimately hold many numbers
  (optimizer moments as JSON lists) pass a larger, justified bound.
* ``allow_nan``: accept ``NaN``, ``Infinity``, ``-Infinity`` and numbers that
  overflow a double (``1e999``).  Off by default: strict JSON has none.
* ``allow_duplicates``: accept repeated object keys (the last wins, as in
  `json`).  Off by default: a second value for a key is ambiguous.

Integers longer than Python's 4300-digit conversion limit are a
`FormatError` too.

Within the bounds, ``orjson`` (a dependency) parses a document 3-5x as fast
as `json`, to the same values; what it cannot vouch for (a repeated key,
which it drops silently; an integer of 19 digits or more, which it may read
as a float; anything it refuses) is parsed by `json` with checking
hooks, which also says what is wrong with a bad document.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

from pytreeio.core.binary import BadUtf8, utf8_text
from pytreeio.core.errors import FormatError

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency
    orjson = None  # type: ignore[assignment]

__all__ = [
    "loads",
    "loads_rows",
    "NumberRows",
    "scan",
    "max_depth_of",
    "MAX_DEPTH",
    "DEFAULT_ALLOWANCE",
]

#: Default nesting limit: far above any legitimate document, far below the interpreter's stack.
MAX_DEPTH = 128
#: Memory a document may cost beyond its own size (bytes), for the default ``max_values``.
DEFAULT_ALLOWANCE = 64 * 1024 * 1024
#: Bytes a parsed value costs at most (an empty dict is 64, a float 24 plus its slot).
_BYTES_PER_VALUE = 64

# Error path only: finds a NaN/Infinity literal outside strings.
_CONSTANT = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\Z)|(-?Infinity|NaN)', re.DOTALL)
_CHUNK = 1 << 20
_QUOTE, _COMMA, _COLON, _BACKSLASH = 0x22, 0x2C, 0x3A, 0x5C
#: Per byte: +1 for [ and {, -1 for ] and }.
_STEP = np.zeros(256, np.int8)
_STEP[[0x5B, 0x7B]] = 1
_STEP[[0x5D, 0x7D]] = -1
#: Every digit as b"0", every other byte as b" ": a run of 19 digits is _LONG_RUN.
_DIGITS_AS_ZERO = bytes(48 if 48 <= i < 58 else 32 for i in range(256))
_LONG_RUN = b"0" * 19


class _Reject(Exception):
    """Raised inside the json hooks; turned into a FormatError by `loads`."""

    def __init__(self, reason: str, token: bytes | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.token = token


def scan(raw: bytes, max_depth: int | None = None) -> tuple[int, int, int | None]:
    """``(depth, values, too_deep_at)`` of a JSON text, without parsing it.

    ``values`` is an upper estimate (commas and opening brackets outside
    strings, plus one); ``too_deep_at`` is the byte position of the first
    bracket deeper than ``max_depth``, where the scan stops (else None).
    Pairs of backslashes are string content: they are blanked first, keeping
    every byte's position (``replace`` works left to right, so a run pairs up
    as a JSON reader pairs it).  Then a quote is a delimiter unless a
    backslash precedes it, and a bracket or comma is outside strings when an
    even number of delimiters precede it.  Vectorised over 1 MiB chunks, on
    the delimiters, brackets and commas alone.  Malformed text gives some
    answer; the parser then reports what is wrong with it.
    """
    if b"\\\\" in raw:
        raw = raw.replace(b"\\\\", b"__")
    depth = deepest = 0
    values = 1
    in_string = 0  # 1 when a string is open at the end of the previous chunk
    for start in range(0, len(raw), _CHUNK):
        a = np.frombuffer(raw, np.uint8, min(_CHUNK, len(raw) - start), start)
        quote = a == _QUOTE
        quote[1:] &= a[:-1] != _BACKSLASH
        if start and raw[start - 1] == _BACKSLASH:
            quote[0] = False
        low = a | 0x20  # [ and ] as { and }
        at = np.flatnonzero(quote | (low == 0x7B) | (low == 0x7D) | (a == _COMMA))
        b = a[at]
        parity = np.cumsum(quote[at].view(np.int8), dtype=np.int8) & 1  # wraps: parity kept
        outside = parity == in_string
        steps = _STEP[b] * outside
        values += int(np.count_nonzero(steps > 0)) + int(np.count_nonzero(outside & (b == _COMMA)))
        levels = np.cumsum(steps, dtype=np.int32)
        if not len(levels):
            continue
        in_string ^= int(parity[-1])
        top = depth + int(levels.max())
        if max_depth is not None and top > max_depth:
            return top, values, start + int(at[np.argmax(levels > max_depth - depth)])
        deepest = max(deepest, top)
        depth += int(levels[-1])
    return deepest, values, None


def _count(raw: bytes, byte: int) -> int:
    return int(np.count_nonzero(np.frombuffer(raw, np.uint8) == byte))


def max_depth_of(raw: bytes) -> int:
    """The deepest nesting of arrays/objects in a JSON text (brackets inside strings ignored)."""
    return scan(raw)[0]


def _constant_offset(raw: bytes, token: bytes | None) -> int | None:
    """Position of the first non-finite literal (or ``token``) outside strings (error path only)."""
    if token is not None:
        for m in re.finditer(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\Z)|' + re.escape(token), raw):
            if not m.group().startswith(b'"'):
                return m.start()
        return None
    for m in _CONSTANT.finditer(raw):
        if m.group(1):
            return m.start()
    return None


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Reject(f"number {text[:40]} overflows a double", text.encode())
    return value


def _no_constants(name: str) -> Any:
    raise _Reject(f"{name} is not a JSON number (NaN and Infinity are not allowed here)")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Reject(f"duplicate key {k!r:.80}")
            seen.add(k)
    return out


def _decoder(allow_nan: bool, allow_duplicates: bool) -> json.JSONDecoder:
    kwargs: dict[str, Any] = {}
    if not allow_nan:
        kwargs["parse_float"] = _finite_float
        kwargs["parse_constant"] = _no_constants
    if not allow_duplicates:
        kwargs["object_pairs_hook"] = _unique
    return json.JSONDecoder(**kwargs)


def _fast(raw: bytes, allow_duplicates: bool) -> tuple[Any] | None:
    """``(document,)`` where ``orjson`` reads ``raw`` to what `json` reads; else None.

    A repeated key is the one difference left to rule out, as ``orjson`` keeps
    the last value silently.  Every object member has one colon outside
    strings, and the only escape that makes a colon is ``\\u003a``: without
    one, the text and the document written out again hold equally many colons
    exactly when no member was dropped.
    """
    if orjson is None or _LONG_RUN in raw.translate(_DIGITS_AS_ZERO):
        return None
    try:
        doc = orjson.loads(raw)
        if allow_duplicates or (
            b"\\u003a" not in raw
            and b"\\u003A" not in raw
            and _count(raw, _COLON) == _count(orjson.dumps(doc), _COLON)
        ):
            return (doc,)
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):  # e.g. NaN; nesting beyond 255
        pass
    return None


def loads(
    data: bytes | bytearray | memoryview | str,
    *,
    path: str | None = None,
    field: str | None = None,
    offset: int = 0,
    exact: bool = True,
    max_depth: int = MAX_DEPTH,
    max_values: int | None = None,
    allow_nan: bool = False,
    allow_duplicates: bool = False,
) -> Any:
    """Parse one JSON document, bounded; every problem is a `FormatError` (see the module doc)."""
    return _loads(
        data, path, field, offset, exact, max_depth, max_values, allow_nan, allow_duplicates
    )


def _loads(
    data: bytes | bytearray | memoryview | str,
    path: str | None,
    field: str | None,
    offset: int,
    exact: bool,
    max_depth: int,
    max_values: int | None,
    allow_nan: bool,
    allow_duplicates: bool,
    where: Callable[[int], int] | None = None,
    extra_values: int = 0,
) -> Any:

    def fail(reason: str, pos: int | None = None) -> FormatError:
        if pos is not None and where is not None:
            pos = where(pos)
        if pos is None:
            return FormatError(reason, path=path, field=field, offset=offset)
        if exact:
            return FormatError(reason, path=path, field=field, offset=offset + pos)
        return FormatError(
            f"{reason} (at byte {pos} of the document)", path=path, field=field, offset=offset
        )

    if isinstance(data, str):
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates from a \ud800-style escape upstream
            raise fail(f"invalid unicode: {exc.reason}", exc.start) from None
    else:
        raw = _whole_bytes(data)

    if max_values is None:
        max_values = (len(raw) + DEFAULT_ALLOWANCE) // _BYTES_PER_VALUE
    _, values, too_deep_at = scan(raw, max_depth)
    if too_deep_at is not None:
        raise fail(f"nesting deeper than {max_depth} levels", too_deep_at)
    if values + extra_values > max_values:
        raise fail(
            f"document holds about {values + extra_values:,} values, more than the limit of {max_values:,}"
        )
    fast = _fast(raw, allow_duplicates)
    if fast is not None:
        return fast[0]

    if isinstance(data, str):
        text = data
    else:
        try:
            text = utf8_text(raw)
        except BadUtf8 as exc:
            raise fail(f"invalid utf-8: {exc.reason}", exc.start) from None
    try:
        return _decoder(allow_nan, allow_duplicates).decode(text)
    except json.JSONDecodeError as exc:
        pos = len(text[: exc.pos].encode("utf-8"))
        raise fail(f"invalid JSON: {exc.msg}", pos) from None
    except _Reject as exc:
        pos = None
        if "duplicate" not in exc.reason:
            pos = _constant_offset(raw, exc.token)
        raise fail(exc.reason, pos) from None
    except (ValueError, RecursionError, MemoryError) as exc:  # e.g. int beyond 4300 digits
        raise fail(f"invalid JSON: {type(exc).__name__}: {str(exc)[:120]}") from None


# --------------------------------------------------------------------------
# documents of long number lists (optimizer moments as JSON)
# --------------------------------------------------------------------------

# A string (skipped whole, so brackets inside strings are never rows), or a row: an
# innermost array of number characters only.  One character class: ~400 MB/s, where a
# pattern of strict JSON numbers ran at 40.  The numbers are checked when parsed.
_STRING_OR_ROW = re.compile(rb'"(?:[^"\\]|\\.)*"|(\[[-+.eE0-9 \t\n\r,]*\])', re.DOTALL)
#: Numbers parsed at once: their Python floats (~2 MB) are transient.  Measured on 16M
#: moments: 2.4 s and +6 MB over the arrays, against 3.2 s and +94 MB for batches of 1M.
_PARSE_BATCH = 1 << 16


class NumberRows:
    """The number rows `loads_rows` cut out of a document, by marker.

    Each row (an innermost array of JSON numbers) stands in the parsed
    document as a unique marker string; `resolve` puts rows back into
    a part of it, as float64 arrays (what a caller that stacks them into an
    array wants: 8 bytes a number instead of a Python float's 32) or as the
    lists `json` would have made.
    """

    def __init__(
        self,
        raw: bytes,
        spans: list[tuple[int, int]],
        prefix: str,
        path: str | None,
        field: str | None,
        offset: int,
    ) -> None:
        self._raw = raw
        self._spans = spans
        self._prefix = prefix
        self._path = path
        self._field = field
        self._offset = offset

    def _error(self, reason: str, i: int, at: int = 0) -> FormatError:
        return FormatError(
            reason, path=self._path, field=self._field, offset=self._offset + self._spans[i][0] + at
        )

    def _index(self, value: Any) -> int | None:
        if isinstance(value, str) and value.startswith(self._prefix):
            return int(value[len(self._prefix) :])
        return None

    def resolve(self, value: Any, *, arrays: bool) -> Any:
        """``value`` (a part of the document) with its rows put back."""
        found: list[int] = []
        self._collect(value, found)
        if not found:
            return value
        rows = self._arrays(found) if arrays else {i: self._list(i) for i in found}
        return self._put(value, rows)

    def _collect(self, value: Any, out: list[int]) -> None:
        i = self._index(value)
        if i is not None:
            out.append(i)
        elif isinstance(value, dict):
            for v in value.values():
                self._collect(v, out)
        elif isinstance(value, list):
            for v in value:
                self._collect(v, out)

    def _put(self, value: Any, rows: dict[int, Any]) -> Any:
        i = self._index(value)
        if i is not None:
            return rows[i]
        if isinstance(value, dict):
            return {k: self._put(v, rows) for k, v in value.items()}
        if isinstance(value, list):
            return [self._put(v, rows) for v in value]
        return value

    def _list(self, i: int) -> list[Any]:
        """Row ``i`` as `json` makes it (strictly checked: a bad row raises here)."""
        start, end = self._spans[i]
        text = self._raw[start:end].decode("ascii")
        try:
            return list(_decoder(False, False).decode(text))
        except json.JSONDecodeError as exc:
            raise self._error(f"invalid JSON in a list of numbers: {exc.msg}", i, exc.pos) from None
        except (_Reject, ValueError) as exc:  # an overflowing number, an int beyond 4300 digits
            raise self._error(str(exc)[:120], i) from None

    def _arrays(self, indices: list[int]) -> dict[int, np.ndarray]:
        out: dict[int, np.ndarray] = {}
        batch: list[tuple[int, int]] = []
        size = 0
        for i in indices:
            start, end = self._spans[i]
            n = self._raw.count(b",", start, end) + 1
            if n == 1 and not self._raw[start + 1 : end - 1].strip(b" \t\n\r"):
                out[i] = np.zeros(0, np.float64)
                continue
            batch.append((i, n))
            size += n
            if size >= _PARSE_BATCH:
                self._parse(batch, out)
                batch, size = [], 0
        self._parse(batch, out)
        return out

    def _parse(self, batch: list[tuple[int, int]], out: dict[int, np.ndarray]) -> None:
        if not batch:
            return
        values = self._fast(batch)
        if values is None:  # a row orjson refuses (or no orjson): each as json reads it
            for i, _ in batch:
                out[i] = self._as_array(self._list(i), i)
            return
        at = 0
        for i, n in batch:
            out[i] = values[at : at + n]
            at += n

    def _fast(self, batch: list[tuple[int, int]]) -> np.ndarray | None:
        """The batch's numbers in one flat float64 array, or None where orjson cannot say."""
        if orjson is None:  # pragma: no cover - orjson is a dependency
            return None
        text = b",".join(self._raw[self._spans[i][0] + 1 : self._spans[i][1] - 1] for i, _ in batch)
        try:
            # strict RFC 8259 numbers, correctly rounded; out-of-range ones are refused
            return np.array(orjson.loads(b"[" + text + b"]"), dtype=np.float64)
        except (orjson.JSONDecodeError, ValueError, OverflowError):
            return None

    def _as_array(self, values: list[Any], i: int) -> np.ndarray:
        try:
            arr = np.array(values, dtype=np.float64)
        except OverflowError:
            raise self._error("a number of this row overflows a double", i) from None
        if not np.isfinite(arr).all():
            raise self._error("a number of this row overflows a double", i)
        return arr


def _whole_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """``data`` as bytes, without a copy where it is a view of a whole bytes object."""
    if isinstance(data, bytes):
        return data
    if (
        isinstance(data, memoryview)
        and isinstance(data.obj, bytes)
        and data.nbytes == len(data.obj)
    ):
        return data.obj
    return bytes(data)


def loads_rows(
    data: bytes | bytearray | memoryview,
    *,
    path: str | None = None,
    field: str | None = None,
    offset: int = 0,
    max_depth: int = MAX_DEPTH,
    max_values: int | None = None,
) -> tuple[Any, NumberRows]:
    """`loads` for a document that holds long lists of numbers (optimizer moments).

    Every innermost array of number characters (a *row*) is cut out before
    parsing and stands in the result as a marker string; the returned
    `NumberRows` puts rows back into the parts the caller names, as
    float64 arrays or as `json`'s lists, and checks their numbers
    strictly then (a row never resolved is never checked).  The rest is parsed
    and checked exactly as `loads` checks a document (depth, values,
    duplicate keys, NaN, UTF-8), with errors at their offsets in ``data``.  A
    row resolved as an array costs 8 bytes a number, not a Python float's 32
    plus its slot; its numbers are Python floats only while their batch is
    parsed.
    """
    raw = _whole_bytes(data)
    pieces: list[bytes] = []
    spans: list[tuple[int, int]] = []
    # (position in the skeleton, position in raw) where each piece of the skeleton starts
    starts_skel: list[int] = [0]
    starts_raw: list[int] = [0]
    prefix = "\x00" + secrets.token_hex(8) + ":"
    marker = prefix.replace("\x00", "\\u0000")
    numbers = 0
    last = skel = 0
    for m in _STRING_OR_ROW.finditer(raw):
        start, end = m.span(1)
        if start < 0:
            continue
        text = f'"{marker}{len(spans)}"'.encode()
        pieces.append(raw[last:start])
        pieces.append(text)
        skel += start - last + len(text)
        starts_skel.append(skel)
        starts_raw.append(end)
        spans.append((start, end))
        numbers += raw.count(b",", start, end) + 1
        last = end
    pieces.append(raw[last:])
    skeleton = b"".join(pieces)
    del pieces

    def where(pos: int) -> int:
        k = bisect.bisect_right(starts_skel, pos) - 1
        base = starts_raw[k]
        return base + (pos - starts_skel[k])

    depth = max_depth - 1 if spans else max_depth  # a row is one level below its marker
    doc = _loads(
        skeleton, path, field, offset, True, depth, max_values, False, False, where, numbers
    )
    rows = NumberRows(raw, spans, prefix, path, field, offset)
    return doc, rows
