"""Arrays made in runs are the arrays made one by one: bytes, shape, strides, flags, order.

:class:`pytreeio.array_runs.ArrayRuns` makes the arrays of a replay plan as
rows of strided arrays; every replayed load of the npz formats, msgpack,
safetensors and DataCode goes through it.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from pytreeio.array_runs import ArrayRuns, Spec

_DTYPES = [np.dtype(d) for d in ("<f4", ">f4", "<i2", "|u1", "<f8", "<c8", "|b1")]


def _one_by_one(spec: Spec, buffer: Any) -> np.ndarray:
    offset, dtype, shape, fortran = spec
    if fortran:
        return np.ndarray(shape[::-1], dtype, buffer=buffer, offset=offset).T
    return np.ndarray(shape, dtype, buffer=buffer, offset=offset)


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert type(a) is np.ndarray
    assert (a.shape, a.dtype, a.strides) == (b.shape, b.dtype, b.strides)
    assert a.tobytes(order="A") == b.tobytes(order="A")
    assert a.__array_interface__["data"] == b.__array_interface__["data"]
    for flag in ("C_CONTIGUOUS", "F_CONTIGUOUS", "WRITEABLE", "ALIGNED", "OWNDATA"):
        assert a.flags[flag] == b.flags[flag], flag


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[Spec], int]:
    """Specs of a file of interleaved kinds, some at equal spacing, some not, some 0-d/empty."""
    kinds = draw(
        st.lists(
            st.tuples(
                st.sampled_from(_DTYPES),
                st.lists(st.integers(0, 5), max_size=3).map(tuple),
                st.booleans(),
            ),
            min_size=1,
            max_size=4,
        )
    )
    specs: list[Spec] = []
    at = draw(st.integers(0, 9))
    for _ in range(draw(st.integers(1, 40))):
        dtype, shape, fortran = kinds[draw(st.integers(0, len(kinds) - 1))]
        specs.append((at, dtype, shape, fortran))
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        at += size + draw(st.sampled_from([0, 0, 3, 16, draw(st.integers(0, 50))]))
    if draw(st.booleans()):  # out of file order: runs close and open again
        order = draw(st.permutations(range(len(specs))))
        specs = [specs[i] for i in order]
    return specs, at


@settings(max_examples=300, deadline=None)
@given(layout=_layouts(), writable=st.booleans())
def test_arrays_in_runs_are_the_arrays_made_one_by_one(
    layout: tuple[list[Spec], int], writable: bool
) -> None:
    specs, size = layout
    raw = np.random.default_rng(size).integers(0, 256, size + 8, dtype=np.uint8).tobytes()
    buffer = memoryview(bytearray(raw) if writable else raw)
    runs = ArrayRuns(specs)
    made = runs.build(buffer)
    assert len(made) == len(specs) == runs.count
    for spec, arr in zip(specs, made):
        _same(arr, _one_by_one(spec, buffer))


def test_a_models_layers_make_a_run_per_kind_and_name_length() -> None:
    specs: list[Spec] = []
    at = 0
    f4 = np.dtype("<f4")
    for i in range(200):
        for name, shape in (("kernel", (8, 8)), ("bias", (8,))):
            at += len(f"layer{i}.{name}") + 40  # a header whose name grows a digit at 10, 100
            specs.append((at, f4, shape, False))
            at += 4 * int(np.prod(shape))
    runs = ArrayRuns(specs)
    assert len(runs._runs) == 6  # kernels and biases, each in 1-, 2- and 3-digit names
    buffer = memoryview(bytearray(at))
    for spec, arr in zip(specs, runs.build(buffer)):
        _same(arr, _one_by_one(spec, buffer))


def test_rows_share_the_buffer_and_keep_it_alive() -> None:
    data = bytearray(range(64))
    f4 = np.dtype("<u4")
    made = ArrayRuns([(0, f4, (2,), False), (16, f4, (2,), False), (32, f4, (2,), False)])
    arrays = made.build(memoryview(data))
    del data
    np.testing.assert_array_equal(arrays[2], np.arange(32, 40, dtype=np.uint8).view("<u4"))
    arrays[0][0] = 7
    assert arrays[0][0] == 7


@pytest.mark.parametrize("shape", [(), (0,), (3, 0)])
def test_zero_d_and_empty_arrays_are_arrays(shape: tuple[int, ...]) -> None:
    f8 = np.dtype("<f8")
    specs: list[Spec] = [(0, f8, shape, False), (8, f8, shape, False), (16, f8, shape, False)]
    buffer = memoryview(bytearray(32))
    for spec, arr in zip(specs, ArrayRuns(specs).build(buffer)):
        _same(arr, _one_by_one(spec, buffer))
