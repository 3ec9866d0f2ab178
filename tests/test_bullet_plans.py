"""bullet record walks replayed from a plan give exactly what the walk gives, and only where it would.

A tagged-record file whose bytes outside its values equal those of a file
walked before has that file's records (:mod:`pytreeio.skeleton`).  Every test
compares a replayed walk with the walk itself on the same bytes (ids, counts,
dims, offsets; errors: type, message and location).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import bytes_changed, skeleton_flips, swapped
from hypothesis import given, settings

from pytreeio.binary import BufferSource
from pytreeio.errors import MismatchError, PytreeioError
from pytreeio.fmt import bullet
from pytreeio.skeleton import Shelf

_WEIGHTS = "optimiser_state/weights.bin"


@pytest.fixture(autouse=True)
def no_plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(bullet, "_RECORD_PLANS", Shelf(4))
    yield


def _file(seed: int = 0, n: int = 40) -> bytes:
    rng = np.random.default_rng(seed)
    weights = {f"l{i}w": rng.standard_normal((3, 2), dtype=np.float32) for i in range(n)}
    weights |= {f"l{i}b": rng.standard_normal(2, dtype=np.float32) for i in range(n)}
    return bullet.encode({"weights": weights}).files[_WEIGHTS].tobytes()


def _walk(data: bytes) -> Any:
    try:
        records = bullet._walk_records(BufferSource(bytearray(data), name=_WEIGHTS), _WEIGHTS)
    except PytreeioError as exc:
        return type(exc), str(exc), exc.__dict__
    return [(r.id, r.count, r.dims, r.offset) for r in records]


def _walked(data: bytes) -> Any:
    """The walk itself (no plan to replay)."""
    with swapped(bullet, "_RECORD_PLANS", Shelf(4)):
        return _walk(data)


def test_the_third_walk_of_a_layout_is_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _file()
    _walk(data)
    assert bullet._RECORD_PLANS.plans == []
    _walk(data)
    assert len(bullet._RECORD_PLANS.plans) == 1
    calls: list[int] = []
    walk = bullet._walk_variant
    monkeypatch.setattr(bullet, "_walk_variant", lambda *a, **k: calls.append(1) or walk(*a, **k))
    other = _file(seed=1)  # other values, the same layout
    replayed = _walk(other)
    assert not calls
    assert replayed == _walked(other)


def test_skeleton_changes_are_walked_as_the_walk_walks_them() -> None:
    data = _file()
    _walk(data)
    _walk(data)
    plan = bullet._RECORD_PLANS.plans[0]
    for bad in skeleton_flips(data, plan.skeleton.positions, 120, 0x21):
        assert bullet._RECORD_PLANS.find(memoryview(bad)) is None
        assert _walk(bytes(bad)) == _walked(bytes(bad))


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_mutated_files_walk_as_the_walk_walks_them(data: st.DataObject) -> None:
    whole = _file()
    _walk(whole)
    _walk(whole)
    mutated = bytes_changed(whole, data, [0, 0x0A, 0x20, 0x7F, 0x80, 0xFF])
    assert _walk(mutated) == _walked(mutated)


def _shaped(weights: dict[str, np.ndarray]) -> dict[str, Any]:
    files = bullet.encode({"weights": weights}).files
    native = bullet.decode({k: v.tobytes() for k, v in files.items()}).tree
    return {k: (a.shape, list(native["weights"]).index(k)) for k, a in native["weights"].items()}


def test_kept_shapes_and_order_are_those_of_each_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes and model order are kept by the records' ids, counts and dims: files that
    differ in any of them get their own, as without the memo."""
    rng = np.random.default_rng(3)
    variants = [
        {"l0w": (3, 2), "l0b": (2,), "l1w": (2, 4), "l1b": (4,)},
        {"l0w": (2, 3), "l0b": (3,), "l1w": (3, 4), "l1b": (4,)},  # same counts, other dims
        {"l1w": (2, 4), "l1b": (4,), "l0w": (3, 2), "l0b": (2,)},  # other file order
        {"l0w": (3, 2), "l0b": (2,), "l1w": (2, 4), "l1b": (4,), "extra": (5,)},
    ]
    trees = [{k: rng.standard_normal(s, dtype=np.float32) for k, s in v.items()} for v in variants]
    fresh = []
    for tree in trees:
        monkeypatch.setattr(bullet, "_SHAPES", bullet.Memo(8))
        fresh.append(_shaped(tree))
    for _ in range(2):  # kept from the first of each
        assert [_shaped(tree) for tree in trees] == fresh


def test_kept_layouts_are_checked_again_when_the_transforms_change() -> None:
    entry = [{"id": "l0w", "transforms": ["test-kept-transform"], "type": "f32"}]
    bullet.register_transform("test-kept-transform", lambda arr, tensors: arr)
    try:
        assert bullet.validate_saved_format(entry)[0]["transforms"] == ["test-kept-transform"]
        assert bullet.validate_saved_format(entry) == bullet.validate_saved_format(entry)
    finally:
        del bullet.TRANSFORMS["test-kept-transform"]
    with pytest.raises(MismatchError, match="unknown transform"):
        bullet.validate_saved_format(entry)


@pytest.mark.parametrize(
    "entry",
    [
        {"id": "l0w", "type": "i16", "scale": 255},
        {"id": "l0w", "type": "i16", "scale": 255.0},  # equal, not the same: refused
        {"id": "l0w", "type": "i16"},
        {"id": "l0w", "type": "f32", "round": 1},
        {"id": "l0w", "type": "f32", "round": True},
    ],
)
def test_kept_layouts_check_as_a_first_check(entry: dict[str, Any]) -> None:
    def outcome() -> Any:
        try:
            return bullet.validate_saved_format([entry])
        except MismatchError as exc:
            return str(exc)

    bullet._SPECS.clear()
    first = outcome()
    bullet.validate_saved_format([{"id": "l0w", "type": "i16", "scale": 255}])  # kept
    assert outcome() == first and outcome() == first
