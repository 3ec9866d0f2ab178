"""``Streamed`` views: transposes, reshapes and casts made when the array is read, as numpy's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.core.binary import Derived, Streamed
from pytreeio.engine import conversion


@pytest.fixture
def leaves(tmp_path: Path, every_slot_streams: None) -> Any:
    rng = np.random.default_rng(0)
    arrays = {
        "m": rng.standard_normal((5, 7)).astype(np.float32),
        "k": rng.standard_normal((3, 3, 4, 2)).astype(np.float32),
        "v": np.arange(12, dtype=np.int16),
    }
    ptio.save(tmp_path / "a.safetensors", arrays, checksum=False)
    fmt = ptio.list_formats()["safetensors"]
    native, _, source = conversion.open_streamed(tmp_path / "a.safetensors", fmt, fmt, {})
    yield arrays, native
    source.close()


def chunk_bytes(leaf: Streamed) -> bytes:
    return b"".join(bytes(c.produce()) for c in leaf.chunks())


def test_views_read_as_numpy_computes_them(leaves: Any) -> None:
    arrays, native = leaves
    m, k, v = native["m"], native["k"], native["v"]
    assert isinstance(m, Streamed) and m.size == 35 and m.ndim == 2
    cases = [
        (m.T, arrays["m"].T),
        (m.transpose(1, 0), arrays["m"].transpose(1, 0)),
        (k.transpose((3, 2, 0, 1)), arrays["k"].transpose(3, 2, 0, 1)),
        (k.transpose(-1, 0, 1, 2), arrays["k"].transpose(-1, 0, 1, 2)),
        (v.reshape(3, -1), arrays["v"].reshape(3, -1)),
        (v.reshape((2, 6)).T, arrays["v"].reshape(2, 6).T),
        (m.astype(np.float64), arrays["m"].astype(np.float64)),
        (m.T.astype(np.float16).reshape(-1), arrays["m"].T.astype(np.float16).reshape(-1)),
    ]
    for view, want in cases:
        assert isinstance(view, Derived)
        assert view.shape == want.shape and view.dtype == want.dtype
        assert view.nbytes == want.nbytes
        got = view.read()
        assert got.flags.c_contiguous and np.array_equal(got, want)
        assert (
            chunk_bytes(view)
            == np.ascontiguousarray(want).astype(want.dtype.newbyteorder("<")).tobytes()
        )
        assert np.array_equal(np.asarray(view), want)  # numpy's own conversion reads it whole
    assert np.asarray(m, dtype=np.float64).dtype == np.float64


def test_identity_views_are_the_leaf_itself(leaves: Any) -> None:
    _, native = leaves
    m = native["m"]
    assert m.transpose(0, 1) is m and m.reshape(5, 7) is m and m.astype(np.float32) is m


def test_bad_views_raise_as_numpy_does(leaves: Any) -> None:
    _, native = leaves
    with pytest.raises(ValueError):
        native["m"].transpose(0, 0)
    with pytest.raises(ValueError):
        native["m"].reshape(4, 9)
    with pytest.raises(ValueError):
        native["v"].reshape(5, -1)
