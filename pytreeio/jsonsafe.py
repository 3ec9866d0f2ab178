"""Bounded JSON parsing for documents read from files: the one place formats parse JSON.

Python's :mod:`json` parses hostile input into ``RecursionError`` (deep nesting),
``UnicodeDecodeError``, ``ValueError`` without a file offset, ``NaN``/``Infinity``
values that no JSON writer of ours emits, silently-merged duplicate keys, and
an unbounded number of Python objects.  :func:`loads` checks all of that and
raises only :class:`pytreeio.errors.FormatError`, naming the ``field`` and the
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
  (:func:`scan`, vectorised with numpy 1 MiB at a time).
* ``max_values``: the most values (an upper estimate: commas + opening
  brackets + 1, outside strings) the document may create; default
  ``(len(data) + 64 MiB) // 64``, so that parsing costs about the document's
  size plus 64 MiB.  Formats whose documents legitimately hold many numbers
  (optimizer moments as JSON lists) pass a larger, justified bound.
* ``allow_nan``: accept ``NaN``, ``Infinity``, ``-Infinity`` and numbers that
  overflow a double (``1e999``).  Off by default: strict JSON has none.
* ``allow_duplicates``: accept repeated object keys (the last wins, as in
  :mod:`json`).  Off by default: a second value for a key is ambiguous.

Integers longer than Python's 4300-digit conversion limit are a
:class:`FormatError` too.
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

from .binary import BadUtf8, utf8_text
from .errors import FormatError

__all__ = [
    "loads",
    "loads_again",
    "loads_counted",
    "orjson_loads",
    "loads_rows",
    "NumberRows",
    "scan",
    "Scan",
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
_BACKSLASH, _QUOTE, _COMMA, _COLON = 0x5C, 0x22, 0x2C, 0x3A
_OPEN = (0x5B, 0x7B)  # [ {
_CLOSE = (0x5D, 0x7D)  # ] }


class _Reject(Exception):
    """Raised inside the json hooks; turned into a FormatError by :func:`loads`."""

    def __init__(self, reason: str, token: bytes | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.token = token


class Scan:
    """What :func:`scan` found: nesting depth, values, object members (colons outside
    strings), and where the depth limit was crossed."""

    __slots__ = ("depth", "members", "too_deep_at", "values")

    def __init__(self) -> None:
        self.depth = 0
        self.values = 1
        self.members = 0
        self.too_deep_at: int | None = None


def scan(raw: bytes, max_depth: int | None = None) -> Scan:
    """Nesting depth and value count of a JSON text, without parsing it.

    Vectorised over 1 MiB chunks: a quote is a string delimiter unless an
    odd run of backslashes precedes it; brackets and commas count only
    outside strings.  Stops at the first bracket deeper than ``max_depth``
    (its byte position is ``too_deep_at``).  Malformed text gives some
    answer; the parser then reports what is wrong with it.
    """
    out = Scan()
    depth = 0
    in_string = False  # inside a string at the end of the previous chunk
    run = 0  # backslashes ending the previous chunk
    view = memoryview(raw)
    for start in range(0, len(raw), _CHUNK):
        a = np.frombuffer(view[start : start + _CHUNK], np.uint8)
        quote = a == _QUOTE
        run = _unescape(a, quote, run)
        # parity of the quotes up to each position: odd = inside a string
        inside = np.logical_xor.accumulate(quote)
        if in_string:
            np.logical_not(inside, out=inside)
        outside = ~inside
        opens = ((a == _OPEN[0]) | (a == _OPEN[1])) & outside
        closes = ((a == _CLOSE[0]) | (a == _CLOSE[1])) & outside
        out.values += int(np.count_nonzero(opens)) + int(np.count_nonzero((a == _COMMA) & outside))
        out.members += int(np.count_nonzero((a == _COLON) & outside))
        steps = opens.view(np.int8) - closes.view(np.int8)
        levels = np.cumsum(steps, dtype=np.int32)
        deepest = depth + int(levels.max())
        out.depth = max(out.depth, deepest)
        if max_depth is not None and deepest > max_depth:
            out.too_deep_at = start + int(np.argmax(levels > max_depth - depth))
            return out
        depth += int(levels[-1])
        in_string = bool(inside[-1])
    return out


def _unescape(a: np.ndarray, quote: np.ndarray, run: int) -> int:
    """Clear ``quote`` where an odd run of backslashes precedes; return the run ending ``a``."""
    bs = np.flatnonzero(a == _BACKSLASH)
    if len(bs) == 0:
        if run % 2:
            quote[0] = False
        return 0
    breaks = np.flatnonzero(np.diff(bs) != 1)
    first = bs[np.concatenate(([0], breaks + 1))]
    last = bs[np.concatenate((breaks, [len(bs) - 1]))]
    lengths = last - first + 1
    if first[0] == 0:
        lengths[0] += run  # the run began in the previous chunk
    elif run % 2:
        quote[0] = False
    after = last[lengths % 2 == 1] + 1
    quote[after[after < len(a)]] = False
    return int(lengths[-1]) if last[-1] == len(a) - 1 else 0


def max_depth_of(raw: bytes) -> int:
    """The deepest nesting of arrays/objects in a JSON text (brackets inside strings ignored)."""
    return scan(raw).depth


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
    """Parse one JSON document, bounded; every problem is a :class:`FormatError` (see the module doc)."""
    return _loads(
        data, path, field, offset, exact, max_depth, max_values, allow_nan, allow_duplicates, None
    )


def loads_again(data: bytes | str) -> Any:
    """A document that passed :func:`loads` (or :func:`loads_counted`) before, parsed again.

    For replays of kept layouts, where the very bytes were checked: ``orjson``
    (a dependency) reads them 3-5x as fast as :mod:`json` and to the same
    values, except integers of 19 digits or more (it reads those beyond 64
    bits as floats), so a text with such a run of digits goes to :mod:`json`.
    What else ``orjson`` refuses (a lone surrogate escape, a number out of
    range) goes there too.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if _LONG_RUN not in raw.translate(_DIGITS_AS_ZERO):
        loads = orjson_loads()
        if loads is not None:
            try:
                return loads(raw)
            except ValueError:  # orjson.JSONDecodeError
                pass
    return json.loads(data)


#: Every digit as b"0", every other byte as b" ": a run of 19 digits is _LONG_RUN.
_DIGITS_AS_ZERO = bytes(48 if 48 <= i < 58 else 32 for i in range(256))
_LONG_RUN = b"0" * 19
_ORJSON: list[Any] = []


def orjson_loads() -> Any:
    """``orjson.loads`` when ``orjson`` (a dependency) imports, else None (stdlib json then).

    It parses 3-5x as fast as :mod:`json`.  Its results differ from
    :mod:`json`'s only where callers look anyway: it refuses NaN, lone
    surrogate escapes and invalid UTF-8, and reads an integer beyond 64 bits
    as a float (a shape, offset or dict key check refuses it; :func:`loads_again`
    sends such texts to :mod:`json`).  Imported on first use, looked up once.
    """
    if not _ORJSON:
        try:
            import orjson
        except ImportError:  # pragma: no cover - orjson is a dependency
            _ORJSON.append(None)
        else:
            _ORJSON.append(orjson.loads)
    return _ORJSON[0]


def loads_counted(
    data: bytes | bytearray | memoryview | str,
    *,
    path: str | None = None,
    field: str | None = None,
    offset: int = 0,
    exact: bool = True,
    max_depth: int = MAX_DEPTH,
    max_values: int | None = None,
) -> tuple[Any, int]:
    """:func:`loads` without the per-object duplicate-key hook, for large documents.

    Returns ``(document, members)``: ``members`` is the number of object
    members (``"key": value`` pairs) in the text.  A repeated key makes the
    parsed objects hold fewer entries than that, so a caller that sums
    ``len(obj)`` over distinct objects of the document and finds less than
    ``members`` must parse it again with :func:`loads` (which reports the
    duplicate, if there is one).  Equality proves there is none.  Everything
    else (depth, value count, NaN, utf-8) is checked as :func:`loads` checks it.
    """
    counted: list[int] = []
    doc = _loads(data, path, field, offset, exact, max_depth, max_values, False, True, counted)
    return doc, counted[0]


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
    counted: list[int] | None,
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
        text = data
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates from a \ud800-style escape upstream
            raise fail(f"invalid unicode: {exc.reason}", exc.start) from None
    else:
        raw = bytes(data)
        try:
            text = utf8_text(raw)
        except BadUtf8 as exc:
            raise fail(f"invalid utf-8: {exc.reason}", exc.start) from None

    if max_values is None:
        max_values = (len(raw) + DEFAULT_ALLOWANCE) // _BYTES_PER_VALUE
    found = scan(raw, max_depth)
    if found.too_deep_at is not None:
        raise fail(f"nesting deeper than {max_depth} levels", found.too_deep_at)
    if found.values + extra_values > max_values:
        raise fail(
            f"document holds about {found.values + extra_values:,} values, more than the limit of {max_values:,}"
        )
    if counted is not None:
        counted.append(found.members)

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
    """The number rows :func:`loads_rows` cut out of a document, by marker.

    Each row (an innermost array of JSON numbers) stands in the parsed
    document as a unique marker string; :meth:`resolve` puts rows back into
    a part of it, as float64 arrays (what a caller that stacks them into an
    array wants: 8 bytes a number instead of a Python float's 32) or as the
    lists :mod:`json` would have made.
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
        """Row ``i`` as :mod:`json` makes it (strictly checked: a bad row raises here)."""
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
        try:
            import orjson
        except ImportError:  # pragma: no cover - orjson is a dependency
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
    """:func:`loads` for a document that holds long lists of numbers (optimizer moments).

    Every innermost array of number characters (a *row*) is cut out before
    parsing and stands in the result as a marker string; the returned
    :class:`NumberRows` puts rows back into the parts the caller names, as
    float64 arrays or as :mod:`json`'s lists, and checks their numbers
    strictly then (a row never resolved is never checked).  The rest is parsed
    and checked exactly as :func:`loads` checks a document (depth, values,
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
        skeleton, path, field, offset, True, depth, max_values, False, False, None, where, numbers
    )
    rows = NumberRows(raw, spans, prefix, path, field, offset)
    return doc, rows
