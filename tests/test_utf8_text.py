"""binary.utf8_text: strict UTF-8 whose failure names the first bad byte and never copies its input.

A failed one-shot decode's ``UnicodeDecodeError`` holds a copy of all of its
input, so a large text file with one bad byte cost three times its size.
Large inputs are checked piece by piece first; the pieces are made tiny here
so that characters and bad bytes fall on every side of a piece boundary.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

import pytreeio as ptio
from pytreeio.core import binary


def _first_bad(data: bytes) -> tuple[str, int] | None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason, exc.start
    return None


CASES = [
    b"",
    b"plain ascii text\n" * 3,
    "caf\u00e9 \u20ac \U0001f600 done".encode(),
    b"abc\xffdef",
    b"\xe2\x82",  # a character cut off at the end
    "ab\u20ac".encode()[:-1] + b"xyz",  # cut off before more text
    b"abcdef\xc3\x28",  # a bad continuation byte
    b"\xed\xa0\x80 surrogate",  # an encoded surrogate
    b"x" * 13 + "\U0001f600".encode() + b"\x80",
]


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 1 << 20])
@pytest.mark.parametrize("data", CASES)
def test_same_text_or_same_first_bad_byte_as_a_one_shot_decode(
    monkeypatch: pytest.MonkeyPatch, data: bytes, piece: int
) -> None:
    monkeypatch.setattr(binary, "_UTF8_PIECE", piece)
    want = _first_bad(data)
    for buf in (data, bytearray(data), memoryview(data)):
        if want is None:
            assert binary.utf8_text(buf) == data.decode("utf-8")
        else:
            with pytest.raises(binary.BadUtf8) as info:
                binary.utf8_text(buf)
            assert (info.value.reason, info.value.start) == want, (data, piece)


def test_a_bad_byte_deep_in_a_large_text_costs_no_copy_of_it() -> None:
    data = bytearray(b"l0w,3\n" * (4 << 20))  # 24 MiB
    data[13_593_000] = 0xFF
    tracemalloc.start()
    try:
        with pytest.raises(binary.BadUtf8) as info:
            binary.utf8_text(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.start == 13_593_000
    # a piece or two (3 MiB measured), not the input again (a one-shot decode: 2x it)
    assert peak < 8 << 20


def test_bullet_text_files_and_json_documents_report_the_offset(tmp_path: Path) -> None:
    import numpy as np

    dest = tmp_path / "ckpt"
    weights = {"l0w": np.ones((3, 2), np.float32), "l0b": np.ones(2, np.float32)}
    tree = {"weights": weights, "momentum": weights, "velocity": weights}
    ptio.save(dest, tree, format="bullet", meta={"steps": {"l0w": 3, "l0b": 3}})
    step = dest / "optimiser_state" / "step.txt"
    good = step.read_bytes()
    step.write_bytes(good + b"\xff")
    with pytest.raises(ptio.FormatError) as info:
        ptio.load(dest, format="bullet")
    assert info.value.offset == len(good) and "step.txt" in str(info.value)
    from pytreeio.core import jsonsafe

    with pytest.raises(ptio.FormatError) as info:
        jsonsafe.loads(b'{"a": "\xc3("}', path="x.json", field="doc", offset=100)
    assert info.value.offset == 100 + 7  # the \xc3 that starts no character
