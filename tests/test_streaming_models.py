"""Streaming convert through the common model form: every cell of the conversion matrix.

Each source of :mod:`test_convert_matrix` is written to files and converted
with ``ptio.convert`` with every array streamed (read only when the target
writes it, transposed or cast when read); the result must be byte-identical to
the in-memory ``ptio.convert_buffer`` of the same cell, refusals included.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
from test_convert_matrix import CELLS, conversion_options, expected, fmt_of, source

import pytreeio as ptio
from pytreeio import conversion, io
from pytreeio.registry import Siblings, Streamed


@pytest.fixture(autouse=True)
def every_slot_streams() -> Any:
    old = conversion.STREAM_MIN_BYTES
    conversion.STREAM_MIN_BYTES = 0
    yield
    conversion.STREAM_MIN_BYTES = old


def write_source(data: Any, fmt: str, path: Path) -> Path:
    """The encoded source checkpoint as files at ``path``."""
    layout = ptio.formats()[fmt].layout
    if isinstance(data, bytes):
        path.write_bytes(data)
    elif isinstance(layout, Siblings):
        for role, p in layout.locate(path).items():
            if role in data:
                p.write_bytes(data[role])
    else:
        for name, content in data.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(content)
    return path


def files_of(path: Path, fmt: str) -> Any:
    layout = ptio.formats()[fmt].layout
    if isinstance(layout, Siblings):
        return {r: p.read_bytes() for r, p in layout.locate(path).items() if p.exists()}
    if path.is_dir():
        return {name: (path / name).read_bytes() for name in io.walk(path)}
    return path.read_bytes()


def encoded_files(enc: ptio.Encoded) -> Any:
    if enc.files is not None:
        return {k: v.tobytes() for k, v in enc.files.items()}
    return enc.tobytes()


def streams(src: Path, from_: str, to: str, options: dict[str, Any]) -> bool:
    container, target = ptio.formats()[from_], ptio.formats()[to]
    found = conversion.open_streamed(
        src, container, target, conversion.decode_options(container, target, options)
    )
    if found is None:
        return False
    found[2].close()
    return any(isinstance(v, Streamed) for v in ptio.flatten(found[0]).values())


@pytest.mark.parametrize(
    ("src", "dst", "with_opt"),
    CELLS,
    ids=[f"{s}->{t}{'+opt' if o else ''}" for s, t, o in CELLS],
)
def test_streamed_matrix_matches_in_memory(
    tmp_path: Path, src: str, dst: str, with_opt: bool
) -> None:
    data = source(src, with_opt)
    s, t = fmt_of(src), fmt_of(dst)
    path = write_source(data, s, tmp_path / ("src" if isinstance(data, bytes) else "srcdir"))
    out = tmp_path / "out"
    options = conversion_options(src, dst, with_opt)
    lossy = expected(src, dst, with_opt) != "exact"
    in_memory = functools.partial(
        ptio.convert_buffer, data, from_=s, to=t, dest=out, lossy=lossy, **options
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want = encoded_files(in_memory())
        except ptio.ConversionError as exc:
            with pytest.raises(ptio.ConversionError) as got:
                ptio.convert(path, out, from_=s, to=t, lossy=lossy, **options)
            assert got.value.what == exc.what
            return
        ptio.convert(path, out, from_=s, to=t, lossy=lossy, **options)
    assert files_of(out, t) == want
    if ptio.formats()[t].streams and ptio.formats()[s].slots is not None:
        assert streams(path, s, t, options)
