"""Streaming convert through the common model form: every cell of the conversion matrix.

Each source of :mod:`test_convert_matrix` is written to files and converted
with ``ptio.convert`` with every array streamed (read only when the target
writes it, transposed or cast when read); the result must be byte-identical to
the in-memory ``ptio.convert_encoded`` of the same cell, refusals included.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
from test_convert_matrix import CELLS, conversion_options, expected, files, fmt_of, source
from test_streaming_convert import files_of, streams

import pytreeio as ptio
from pytreeio.core.records import Siblings

pytestmark = pytest.mark.usefixtures("every_slot_streams")


def write_source(data: Any, fmt: str, path: Path) -> Path:
    """The encoded source checkpoint as files at ``path``."""
    layout = ptio.list_formats()[fmt].layout
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
        ptio.convert_encoded, data, from_=s, to=t, dest=out, lossy=lossy, **options
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want = files(in_memory())
        except ptio.ConversionError as exc:
            with pytest.raises(ptio.ConversionError) as got:
                ptio.convert(path, out, from_=s, to=t, lossy=lossy, **options)
            assert got.value.what == exc.what
            return
        ptio.convert(path, out, from_=s, to=t, lossy=lossy, **options)
    assert files_of(out, t) == want
    if ptio.list_formats()[t].streams and ptio.list_formats()[s].slots is not None:
        assert streams(path, s, t, **options)
