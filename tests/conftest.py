"""Shared fixtures, hypothesis strategies and comparison helpers."""

from __future__ import annotations

import contextlib
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest
from cloud_server import _moto_server, s3_endpoint, s3_options, s3_root  # noqa: F401 (S3 fixtures)
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("PYTREEIO_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")

REPO = Path(__file__).resolve().parents[1]
#: Real files written by the original systems; PYTREEIO_CONFORMANCE overrides the location.
CONFORMANCE = Path(os.environ.get("PYTREEIO_CONFORMANCE", REPO.parent / "shared" / "conformance"))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop the whole run once, naming the path, when the conformance files are missing.

    Conformance tests compare against bytes the original systems wrote; without
    them the suite would skip or error test by test and hide the real cause.
    """
    if not CONFORMANCE.is_dir():
        pytest.exit(
            f"conformance files not found at {CONFORMANCE}: the suite needs ../shared/conformance "
            "beside the repository (or PYTREEIO_CONFORMANCE pointing at it)",
            returncode=1,
        )


@pytest.fixture
def conformance() -> Path:
    """The directory of real files written by the original systems."""
    return CONFORMANCE


# --------------------------------------------------------------------------
# comparing trees bit for bit
# --------------------------------------------------------------------------


def assert_same_tree(a: Any, b: Any, *, flags: bool = False) -> None:
    """Strictly the same tree: exact container and leaf types, dict key order, array bytes.

    Stricter than :func:`assert_bits_equal` (which lets dict keys come in another
    order): for fast paths that must return what the general one returns.
    ``flags``: arrays also agree on being writeable.
    """
    assert type(a) is type(b), f"{type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_tree(a[k], b[k], flags=flags)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
        if flags:
            assert a.flags.writeable == b.flags.writeable
    else:
        assert a == b


def assert_bits_equal(a: Any, b: Any, path: str = "") -> None:
    """Same structure (container types, keys, order of sequences) and identical bytes in every leaf."""
    if (
        isinstance(a, np.ndarray | np.generic)
        or hasattr(a, "__jax_array__")
        or type(a).__module__.startswith("jax")
    ):
        a_arr, b_arr = np.asarray(a), np.asarray(b)
        assert type(np.asarray(b)) is np.ndarray, f"{path}: {type(b)}"
        assert a_arr.dtype == b_arr.dtype, f"{path}: dtype {a_arr.dtype} != {b_arr.dtype}"
        assert a_arr.shape == b_arr.shape, f"{path}: shape {a_arr.shape} != {b_arr.shape}"
        assert a_arr.tobytes() == b_arr.tobytes(), f"{path}: bytes differ"
        if isinstance(a, np.generic):
            assert isinstance(b, np.generic), f"{path}: numpy scalar came back as {type(b)}"
        return
    if isinstance(a, float):
        assert type(b) is float, f"{path}: {type(b)}"
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: {type(b)}"
        assert list(a.keys()) == list(b.keys()) or set(a) == set(b), (
            f"{path}: keys {list(a)} != {list(b)}"
        )
        for k in a:
            assert_bits_equal(a[k], b[k], f"{path}/{k}")
        return
    if isinstance(a, tuple) and hasattr(type(a), "_fields"):
        assert isinstance(b, tuple) and getattr(type(b), "_fields", None) == type(a)._fields, (
            f"{path}: {type(b)}"
        )
        assert type(a).__name__ == type(b).__name__
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bits_equal(x, y, f"{path}[{i}]")
        return
    if isinstance(a, list | tuple):
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bits_equal(x, y, f"{path}[{i}]")
        return
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    assert a == b, f"{path}: {a!r} != {b!r}"


# --------------------------------------------------------------------------
# hypothesis strategies
# --------------------------------------------------------------------------

DTYPES = [
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.int8),
    np.dtype(np.int16),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.uint8),
    np.dtype(np.uint16),
    np.dtype(np.uint32),
    np.dtype(np.uint64),
    np.dtype(np.bool_),
]


@st.composite
def arrays(draw: Any, dtypes: list[np.dtype[Any]] = DTYPES) -> np.ndarray:
    """Arrays of every supported dtype with arbitrary bit patterns (NaN payloads included)."""
    dt = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    n = math.prod(shape)
    if dt == np.bool_:
        return np.array(
            draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_
        ).reshape(shape)
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


keys = st.text(alphabet=st.sampled_from(list("ab/\\[]#_0-. é")), min_size=0, max_size=6)

python_scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)


def trees(leaves: Any = None, *, namedtuples: bool = True) -> Any:
    """Nested dicts/lists/tuples/NamedTuples of arrays, Python scalars and None."""
    from collections import namedtuple

    Pair = namedtuple("Pair", ["first", "second"])
    base = (
        leaves if leaves is not None else st.one_of(arrays(), arrays(), python_scalars, st.none())
    )

    def extend(children: Any) -> Any:
        options = [
            st.dictionaries(keys, children, max_size=4),
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
        ]
        if namedtuples:
            options.append(st.tuples(children, children).map(lambda t: Pair(*t)))
        return st.one_of(*options)

    return st.recursive(base, extend, max_leaves=12)


@pytest.fixture
def every_slot_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small test tensors streamed too (normally slots under 64 KiB are read up front)."""
    from pytreeio.engine import conversion

    monkeypatch.setattr(conversion, "STREAM_MIN_BYTES", 0)


def bytes_changed(data: bytes, draw: st.DataObject, values: list[int]) -> bytes:
    """``data`` with one to four bytes set to one of ``values`` (or their own value ^ 1)."""
    buf = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        pos = draw.draw(st.integers(0, len(buf) - 1))
        buf[pos] = draw.draw(st.sampled_from([*values, buf[pos] ^ 1]))
    return bytes(buf)


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` set to ``value`` within the block (a fresh plan store: no plan to replay)."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def skeleton_flips(data: bytes, positions: Any, count: int, xor: int) -> Iterator[bytearray]:
    """``data`` with one byte flipped (``^ xor``) at each of ``count`` of ``positions`` (a kept
    skeleton's), drawn with a fixed seed."""
    rng = np.random.default_rng(0)
    for pos in rng.choice(positions, size=count, replace=False):
        bad = bytearray(data)
        bad[int(pos)] ^= xor
        yield bad
