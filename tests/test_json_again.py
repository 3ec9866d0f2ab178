"""``jsonsafe.loads_again``: a checked document parsed again fast, to what :mod:`json` reads."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytreeio import jsonsafe


def _typed(value: Any) -> Any:
    """``value`` with every scalar's type (and a float's bits) made part of equality."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, float):
        return ("float", value.hex() if not math.isnan(value) else "nan")
    return (type(value).__name__, value)


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_DOCS = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_DOCS, st.booleans(), st.booleans())
def test_what_json_reads(doc: Any, as_bytes: bool, ascii_only: bool) -> None:
    text = json.dumps(doc, ensure_ascii=ascii_only)
    data = text.encode("utf-8", "surrogatepass") if as_bytes else text
    assert _typed(jsonsafe.loads_again(data)) == _typed(json.loads(data))


@pytest.mark.parametrize(
    "text",
    [
        "123456789012345678901234",  # beyond 64 bits: an int, not orjson's float
        "-9223372036854775809",
        "[18446744073709551616, 1]",
        '{"a": 1e400}',  # json's inf; orjson refuses it
        '"\\ud800"',  # a lone surrogate escape
        '{"a": 1, "a": 2}',
        "12345678901234567890.5",
        ' {"k": [-0.0, 0, -0]} ',
    ],
)
def test_the_texts_orjson_reads_otherwise(text: str) -> None:
    for data in (text, text.encode("utf-8")):
        assert _typed(jsonsafe.loads_again(data)) == _typed(json.loads(data))
