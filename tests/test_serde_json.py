"""pytreeio.core.serde_json writes JSON exactly as Rust's serde_json::to_string does."""

from __future__ import annotations

import json
import math
import re
import struct
from decimal import Decimal
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from pytreeio.core.errors import EncodeError
from pytreeio.core.serde_json import MAX_DEPTH, dump_bytes, dumps, format_float, widen_f32

# serde_json / ryu output for these f64 values (FORMATS.md and ryu's own test vectors).
KNOWN = [
    (1e-8, "1e-8"),
    (0.0010000000474974513, "0.0010000000474974513"),
    (1.0, "1.0"),
    (0.0, "0.0"),
    (-0.0, "-0.0"),
    (-1.5, "-1.5"),
    (0.1, "0.1"),
    (0.9, "0.9"),
    (0.999, "0.999"),
    (0.00001, "0.00001"),
    (0.000001, "1e-6"),
    (2.5e-6, "2.5e-6"),
    (123.456, "123.456"),
    (100.0, "100.0"),
    (1e15, "1000000000000000.0"),
    (9007199254740993.0, "9007199254740992.0"),
    (1e16, "1e16"),
    (1.2345678901234568e17, "1.2345678901234568e17"),
    (1234567890123456.8, "1234567890123456.8"),
    (1e21, "1e21"),
    (5e-324, "5e-324"),
    (1.7976931348623157e308, "1.7976931348623157e308"),
    (2.2250738585072014e-308, "2.2250738585072014e-308"),
    (0.37143418192863464, "0.37143418192863464"),
    (2.0**-24, "5.960464477539063e-8"),  # shortest is not the 16-digit rounding
    (562949953421312.8, "562949953421312.8"),  # ...312.75 exactly: halfway, rounds to even
    (math.nan, "null"),
    (math.inf, "null"),
    (-math.inf, "null"),
]


@pytest.mark.parametrize(("value", "text"), KNOWN)
def test_known_floats(value: float, text: str) -> None:
    assert format_float(value) == text


def _independent(x: float) -> str:
    """ryu's layout rebuilt from Decimal and the shortest round-tripping %e digits."""
    if x == 0:
        return "-0.0" if math.copysign(1, x) < 0 else "0.0"
    exact = Decimal(abs(x))
    for k in range(17):  # shortest digit count with a round-tripping candidate, closest wins
        near = Decimal(f"{abs(x):.{k}e}")
        step = Decimal(1).scaleb(near.adjusted() - k)
        fits = [c for c in (near - step, near, near + step) if float(c) == abs(x)]
        if fits:
            # the closest; on a tie (the exact value halfway) the even last digit, as ryu rounds
            best = min(fits, key=lambda c: (abs(c - exact), c.as_tuple().digits[-1] % 2))
            break
    _, digits, exp = best.normalize().as_tuple()
    d = "".join(map(str, digits))
    point = len(d) + int(exp)  # value = 0.d * 10**point
    head = "-" if x < 0 else ""
    if int(exp) >= 0 and point <= 16:
        return head + d + "0" * int(exp) + ".0"
    if 0 < point <= 16:
        return head + d[:point] + "." + d[point:]
    if -5 < point <= 0:
        return head + "0." + "0" * -point + d
    mant = d[0] + ("." + d[1:] if len(d) > 1 else "")
    return f"{head}{mant}e{point - 1}"


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_floats_match_an_independent_layout_and_round_trip(x: float) -> None:
    text = format_float(x)
    assert text == _independent(x)
    assert re.fullmatch(r"-?(\d+\.\d+|\d(\.\d+)?e-?[1-9]\d*)", text), text
    assert struct.pack("<d", float(text)) == struct.pack("<d", x)


@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_widened_f32_round_trips_through_the_text(x: float) -> None:
    wide = widen_f32(x)
    assert np.float32(float(format_float(wide))) == np.float32(x)


def test_widen_f32() -> None:
    assert format_float(widen_f32(0.001)) == "0.0010000000474974513"
    assert format_float(widen_f32(0.5)) == "0.5"


def test_compact_sorted_and_typed() -> None:
    doc = {"b": [1, 2.0, None, True, False], "a": {"z": -3, "y": 1e-8}, "A": "x"}
    assert dumps(doc) == '{"A":"x","a":{"y":1e-8,"z":-3},"b":[1,2.0,null,true,false]}'
    assert dumps((1, [])) == "[1,[]]"
    assert dumps({}) == "{}"


def test_keys_sort_by_code_point_like_utf8_bytes() -> None:
    keys = ["é", "z", "Z", "a", "\u00ff", "\u0100", "😀", "\uffff"]
    text = dumps(dict.fromkeys(keys, 0))
    order = [k for k in json.loads(text)]
    assert order == sorted(keys, key=lambda k: k.encode("utf-8"))


def test_string_escapes_as_serde_json() -> None:
    s = 'q"b\\s/\x00\x01\x08\t\n\x0b\x0c\r\x1f\x7f é😀'
    assert dumps(s) == '"q\\"b\\\\s/\\u0000\\u0001\\b\\t\\n\\u000b\\f\\r\\u001f\x7f é😀"'
    assert json.loads(dumps(s)) == s


def test_numpy_scalars() -> None:
    assert (
        dumps([np.float32(0.5), np.int64(3), np.bool_(True), np.array(2.0)]) == "[0.5,3,true,2.0]"
    )
    assert dumps(np.float32(0.001)) == "0.0010000000474974513"


def test_integer_range() -> None:
    assert dumps([-(2**63), 2**64 - 1]) == f"[{-(2**63)},{2**64 - 1}]"
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(EncodeError, match="i64/u64"):
            dumps({"x": [bad]})


def test_refusals_name_the_key_path() -> None:
    with pytest.raises(EncodeError) as info:
        dumps({"a": [{"b": object()}]})
    assert info.value.key_path == "a[0].b"
    with pytest.raises(EncodeError, match="keys must be strings"):
        dumps({1: 2})
    with pytest.raises(EncodeError, match="lone surrogate"):
        dump_bytes({"k": "\ud800"})
    deep: list = []
    node = deep
    for _ in range(MAX_DEPTH):
        node.append([])
        node = node[0]
    with pytest.raises(EncodeError, match="nesting"):
        dumps(deep)


def test_conformance_documents_are_rewritten_exactly(conformance: Path) -> None:
    for path in sorted((conformance / "datacode").glob("*.nn")):
        data = path.read_bytes()
        (length,) = struct.unpack_from("<I", data, 12)
        raw = data[16 : 16 + length]
        assert dump_bytes(json.loads(raw)) == raw, path.name
