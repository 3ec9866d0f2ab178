"""msgpack loads replayed from a plan give exactly what the parser gives, and only on an exact skeleton.

:mod:`pytreeio.fmt.msgpack_plans` rebuilds a state dict whose bytes outside
the array payloads equal those of one parsed before.  Every test compares a
replayed tree with the parser's own result for the same bytes (structure,
key order, dtypes, shapes, values, flags), and checks that any byte of the
skeleton that differs sends the buffer to the parser.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_same_tree, skeleton_flips

import pytreeio as ptio
from pytreeio.errors import FormatError
from pytreeio.fmt import msgpack, msgpack_plans
from pytreeio.skeleton import Shelf


@pytest.fixture(autouse=True)
def no_plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(msgpack_plans, "_PLANS", Shelf(msgpack_plans.MAX_PLANS))
    yield


def _tree(seed: int = 0, step: int = 7) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    layers = {
        f"Dense_{i}": {
            "kernel": rng.standard_normal((3 + i % 4, 5), dtype=np.float32),
            "bias": rng.standard_normal(5).astype(np.float64 if i % 3 else np.float16),
        }
        for i in range(20)
    }
    layers["Embed_0"] = {"embedding": rng.standard_normal((4, 2, 3)).astype(ml_dtypes.bfloat16)}
    layers["counts"] = {"n": np.array(3, dtype=np.int64), "mask": rng.random(6) > 0.5}
    return {"params": layers, "step": step, "name": "run-1", "lr": 0.5, "none": None}


def _encoded(tree: Any) -> bytes:
    return ptio.encode(tree, format="msgpack").tobytes()


def _parsed(data: bytes) -> Any:
    tree, _ = msgpack._parse(memoryview(bytearray(data)), skip_data=False)
    return tree


def _identical(got: Any, want: Any) -> None:
    assert_same_tree(got, want, flags=True)


def _decode(data: bytes) -> Any:
    return msgpack.decode(memoryview(bytearray(data))).tree


def _learn(data: bytes) -> Any:
    """Decode twice: a plan is learnt from the second parse of a buffer's length on."""
    _decode(data)
    return _decode(data)


def test_a_one_off_decode_learns_nothing() -> None:
    data = _encoded(_tree())
    _identical(_decode(data), _parsed(data))
    assert msgpack_plans._PLANS.plans == []  # a one-off load pays for no plan
    _identical(_decode(data), _parsed(data))
    assert len(msgpack_plans._PLANS.plans) == 1


def test_second_decode_is_replayed_and_identical_to_the_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = _encoded(_tree())
    first = _learn(data)
    assert len(msgpack_plans._PLANS.plans) == 1  # learnt from the second parse
    calls = []
    parse = msgpack._parse
    monkeypatch.setattr(msgpack, "_parse", lambda *a, **k: calls.append(1) or parse(*a, **k))
    second = _decode(data)
    assert not calls  # replayed, not parsed
    _identical(second, _parsed(data))
    _identical(second, first)


def test_other_values_same_structure_are_replayed_with_the_new_values() -> None:
    _learn(_encoded(_tree(seed=0)))
    data = _encoded(_tree(seed=1))
    assert msgpack_plans.replay(memoryview(bytearray(data))) is not None
    _identical(_decode(data), _parsed(data))


@pytest.mark.parametrize(
    "other",
    [
        _tree(step=8),  # a scalar in the skeleton
        {**_tree(), "name": "run-2"},  # a string of the same length
        {**_tree(), "none": 0},  # None and 0 are one byte each
    ],
)
def test_a_different_skeleton_byte_is_parsed(other: dict[str, Any]) -> None:
    _learn(_encoded(_tree()))
    data = _encoded(other)
    assert len(data) == len(_encoded(_tree()))  # same length: only the bytes tell
    assert msgpack_plans.replay(memoryview(bytearray(data))) is None
    _identical(_decode(data), _parsed(data))


def test_random_skeleton_byte_flips_are_parsed_or_refused() -> None:
    data = _encoded(_tree())
    _learn(data)
    plan = msgpack_plans._PLANS.plans[0]
    for bad in skeleton_flips(data, plan.skeleton.positions, 200, 0x5A):
        assert msgpack_plans.replay(memoryview(bad)) is None
        try:
            want = _parsed(bytes(bad))
        except FormatError:
            with pytest.raises(FormatError):
                _decode(bytes(bad))
        else:
            _identical(_decode(bytes(bad)), want)


def test_payload_bytes_are_data_only() -> None:
    data = bytearray(_encoded(_tree()))
    _learn(bytes(data))
    plan = msgpack_plans._PLANS.plans[0]
    payload = np.setdiff1d(np.arange(len(data)), plan.skeleton.positions)
    data[int(payload[0])] ^= 0xFF
    _identical(_decode(bytes(data)), _parsed(bytes(data)))


def test_replayed_containers_are_fresh() -> None:
    data = _encoded(_tree())
    _learn(data)
    a = _decode(data)
    a["params"].clear()
    a["step"] = -1
    b = _decode(data)
    assert b["step"] == 7 and "Dense_0" in b["params"]


def test_small_and_non_plain_trees_are_not_learnt() -> None:
    small = {
        "params": {f"w{i}": np.ones(3, np.float32) for i in range(msgpack_plans.MIN_LEAVES - 1)}
    }
    _learn(_encoded(small))
    with_empty = {**_tree(), "empty": np.zeros((0, 3), np.float32)}  # no offset of its own
    _learn(_encoded(with_empty))
    assert msgpack_plans._PLANS.plans == []
    # a list is stored as flax does, a map keyed '0'..'n-1': a plain tree, learnt
    with_list = {**_tree(), "history": [1, 2, 3]}
    _learn(_encoded(with_list))
    assert len(msgpack_plans._PLANS.plans) == 1
    # and each decodes as the parser does, replayed or not
    for tree in (small, with_list, with_empty):
        data = _encoded(tree)
        _identical(_decode(data), _parsed(data))


def test_plans_are_bounded_and_loads_through_the_api_use_them(tmp_path: Any) -> None:
    for n in range(msgpack_plans.MAX_PLANS + 2):
        tree = _tree()
        tree["params"][f"extra_{n}"] = {"w": np.ones(n + 1, np.float32)}  # another length each
        _learn(_encoded(tree))
    assert len(msgpack_plans._PLANS.plans) == msgpack_plans.MAX_PLANS
    path = tmp_path / "t.msgpack"
    tree = _tree(seed=3)
    ptio.save(path, tree, format="msgpack")
    ptio.load(path)
    again = ptio.load(path, like=tree)
    _identical(again, _parsed(path.read_bytes()))


def test_learning_allocates_nothing_file_sized() -> None:
    # 40 leaves of 1 MiB: the plan is the skeleton (a few KB), never a mask of the file
    import tracemalloc

    tree = {"params": {f"w{i}": np.full(1 << 18, i, np.float32) for i in range(40)}}
    data = memoryview(bytearray(_encoded(tree)))
    msgpack.decode(data)  # the first parse of this length: nothing learnt
    tracemalloc.start()
    try:
        msgpack.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(msgpack_plans._PLANS.plans) == 1
    assert peak < (1 << 20), peak  # the file is 40 MiB
