"""``jsonsafe.loads`` reads what :mod:`json` reads, with ``orjson`` and without it.

``orjson`` parses the common case; these check that its results are
:mod:`json`'s to the type and bit, and that a repeated key, which it drops
silently, is still refused wherever it stands.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytreeio.core import jsonsafe
from pytreeio.core.errors import FormatError


@contextmanager
def parser(fast: bool) -> Iterator[None]:
    """``orjson`` first (when ``fast``), or :mod:`json` alone, as without ``orjson``."""
    if fast:
        pytest.importorskip("orjson")
        yield
    else:
        with mock.patch.object(jsonsafe, "orjson", None):
            yield


def _typed(value: Any) -> Any:
    """``value`` with every scalar's type (and a float's bits) made part of equality."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, float):
        return ("float", value.hex() if not math.isnan(value) else "nan")
    return (type(value).__name__, value)


_TEXT = st.text(st.characters(blacklist_categories=("Cs",))) | st.text(':\\"[]{},u0a\u00e9')
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
_DOCS = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_TEXT, inner, max_size=5),
    max_leaves=30,
)


@pytest.mark.parametrize("fast", [True, False])
@settings(max_examples=200, deadline=None)
@given(doc=_DOCS, as_bytes=st.booleans(), ascii_only=st.booleans())
def test_what_json_reads(fast: bool, doc: Any, as_bytes: bool, ascii_only: bool) -> None:
    text = json.dumps(doc, ensure_ascii=ascii_only)
    data = text.encode() if as_bytes else text
    with parser(fast):
        assert _typed(jsonsafe.loads(data)) == _typed(json.loads(data))


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    "text",
    [
        "123456789012345678901234",  # beyond 64 bits: an int, not orjson's float
        "-9223372036854775809",
        "[18446744073709551616, 1]",
        '"\\ud800"',  # a lone surrogate escape
        "12345678901234567890.5",
        ' {"k": [-0.0, 0, -0, 1e-400]} ',
        '{"\\u003a": "a:b", ":\\u003A": 1}',
    ],
)
def test_the_texts_orjson_reads_otherwise(fast: bool, text: str) -> None:
    with parser(fast):
        for data in (text, text.encode("utf-8")):
            assert _typed(jsonsafe.loads(data)) == _typed(json.loads(data))


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "a": 2}',
        '{"x": {"k": "a:b", "k": 1}}',
        '{"k": "::::", "k": 1}',
        '{"\\u003a": 1, ":": 2}',  # the same key, once escaped
        '{":": 1, "\\u003A": 2, "b": "\\\\u003a"}',
        '{"a": {"b": 1}, "a": {"b": 1}}',
        '[{"q": "\\"", "q": "x"}]',
        '{"a": 1, "b": {"c": ' + "[" * 200 + "]" * 200 + '}, "a": 1}',
    ],
)
def test_repeated_keys_are_refused(fast: bool, text: str) -> None:
    with parser(fast), pytest.raises(FormatError, match="duplicate") as err:
        jsonsafe.loads(text.encode(), path="d.json", field="doc", max_depth=300)
    assert err.value.path == "d.json" and err.value.field == "doc"


@pytest.mark.parametrize("fast", [True, False])
@settings(max_examples=200, deadline=None)
@given(
    obj=st.dictionaries(_TEXT, _SCALARS, min_size=1, max_size=5),
    other=_SCALARS,
    wraps=st.lists(st.sampled_from(["list", "dict"]), max_size=4),
)
def test_a_repeated_key_anywhere_is_refused(
    fast: bool, obj: dict[str, Any], other: Any, wraps: list[str]
) -> None:
    key = next(iter(obj))
    text = "{" + json.dumps(key) + ": " + json.dumps(other) + ", " + json.dumps(obj)[1:]
    for w in wraps:
        text = f"[1, {text}]" if w == "list" else f'{{"k:": "v", "w": {text}}}'
    with parser(fast), pytest.raises(FormatError, match="duplicate"):
        jsonsafe.loads(text)


@pytest.mark.parametrize("fast", [True, False])
def test_bounds_count_outside_strings_only(fast: bool) -> None:
    with parser(fast):
        assert jsonsafe.loads(json.dumps(["[{,"] * 10), max_values=12, max_depth=1)
        with pytest.raises(FormatError, match="values"):
            jsonsafe.loads(json.dumps([0] * 12), max_values=12)
        assert jsonsafe.max_depth_of(json.dumps(['\\"[', {"]\\\\": ['\\"', "{"]}]).encode()) == 3


def test_the_common_case_is_read_by_orjson_alone() -> None:
    pytest.importorskip("orjson")
    doc = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}, "t": '{"a:": [1]}'}
    with mock.patch.object(jsonsafe, "_decoder", side_effect=AssertionError("json used")):
        assert jsonsafe.loads(json.dumps(doc).encode()) == doc
