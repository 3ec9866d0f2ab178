"""DataCode decodes replayed from a plan give exactly what the reader gives, and only where it would.

A ``.nn`` file whose bytes outside its tensors' data equal those of a file
read before has that file's layout (:mod:`pytreeio.skeleton`).  Every test
compares a replayed decode with the reader's own result for the same bytes
(arrays: names, order, dtypes, shapes, strides, bytes; the document; errors:
type, message and location).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import bytes_changed, skeleton_flips, swapped
from hypothesis import given, settings

from pytreeio.errors import PytreeioError
from pytreeio.fmt import datacode
from pytreeio.layouts import Memo
from pytreeio.skeleton import Shelf


@pytest.fixture(autouse=True)
def no_plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(datacode, "_PLANS", Shelf(4))
    yield


def _file(seed: int = 0, n: int = 20, variant: str = "seed", width: int = 4) -> bytes:
    rng = np.random.default_rng(seed)
    tree = {
        f"layer{2 * i}": {
            "weight": rng.standard_normal((width, width), dtype=np.float32),
            "bias": rng.standard_normal(width, dtype=np.float32),
        }
        for i in range(n)
    }
    layers = ["Linear", "ReLU"] * n
    return datacode.encode(tree, meta={"layers": layers}, variant=variant).tobytes()


def _decode(data: bytes, **kw: Any) -> Any:
    return datacode.decode(memoryview(bytearray(data)), **kw)


def _outcome(data: bytes, **kw: Any) -> Any:
    try:
        native, meta = _decode(data, **kw)
    except PytreeioError as exc:
        return (type(exc), str(exc), exc.__dict__)
    arrays = [
        (name, k, a.dtype.str, a.shape, a.strides, a.tobytes())
        for name, layer in native.items()
        for k, a in layer.items()
    ]
    return arrays, meta


def _parsed(data: bytes, **kw: Any) -> Any:
    with swapped(datacode, "_PLANS", Shelf(4)):
        return _outcome(data, **kw)


def _learnt(data: bytes) -> Any:
    _decode(data)
    _decode(data)  # learnt at the second read of a file of this length
    assert len(datacode._PLANS.plans) == 1
    return datacode._PLANS.plans[0]


def test_first_read_learns_nothing_second_learns_third_replays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = _file()
    _decode(data)
    assert datacode._PLANS.plans == []
    _decode(data)
    assert len(datacode._PLANS.plans) == 1
    calls: list[int] = []
    read = datacode._read_layout
    monkeypatch.setattr(datacode, "_read_layout", lambda *a: calls.append(1) or read(*a))
    replayed = _outcome(data)
    assert not calls
    assert replayed == _parsed(data)


def test_later_variant_and_new_data_are_replayed_as_read() -> None:
    _learnt(_file(seed=0, variant="later"))
    data = _file(seed=1, variant="later")
    assert _outcome(data) == _parsed(data)
    native, meta = _decode(data)
    assert meta[datacode.FILE_KEY]["variant"] == "later"
    assert not native["layer0"]["weight"].flags.c_contiguous  # a transposed view, as read


def test_the_document_is_fresh_every_time() -> None:
    data = _file()
    _learnt(data)
    _, meta = _decode(data)
    meta["layers"][0]["in_features"] = 99
    meta["training"] = "changed"
    _, again = _decode(data)
    assert again["layers"][0]["in_features"] == 4 and again["training"] != "changed"


def test_a_different_skeleton_or_variant_is_read() -> None:
    data = _file()
    plan = _learnt(data)
    assert _outcome(data, variant="later") == _parsed(data, variant="later")  # a fault, named
    for bad in skeleton_flips(data, plan.skeleton.positions, 150, 0x5A):
        assert datacode._replayed(memoryview(bad), None) is None
        assert _outcome(bytes(bad)) == _parsed(bytes(bad))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_mutated_files_read_as_the_reader_reads_them(data: st.DataObject) -> None:
    whole = _file()
    _learnt(whole)
    mutated = bytes_changed(whole, data, [0, 1, 0x22, 0x7F, 0x80, 0xFF])
    assert _outcome(mutated) == _parsed(mutated)


def test_to_model_checks_a_layer_list_once_and_only_the_same_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytreeio.errors import MismatchError

    monkeypatch.setattr(datacode, "_CHECKED_DOCS", Memo(8))
    calls: list[int] = []
    check = datacode._check_doc
    monkeypatch.setattr(datacode, "_check_doc", lambda *a: calls.append(1) or check(*a))
    native, meta = _decode(_file())
    calls.clear()  # the read checked the document in its own way
    first = datacode.to_model(native, meta)
    again = datacode.to_model(native, meta)
    assert calls == [1]
    assert [(la.type, dict(la.args), la.trainable) for la in again.layers] == [
        (la.type, dict(la.args), la.trainable) for la in first.layers
    ]
    meta["layers"][0]["trainable"] = 1  # equal to True, but not a bool: checked, and refused
    with pytest.raises(MismatchError, match="trainable"):
        datacode.to_model(native, meta)
    assert calls == [1, 1]


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("device", 5, "device must be a string"),
        ("training", [], "training must be an object"),
        ("training", {"stages": "x"}, "training.stages"),
    ],
)
def test_a_kept_layer_list_does_not_skip_the_rest_of_the_document(
    monkeypatch: pytest.MonkeyPatch, field: str, value: object, problem: str
) -> None:
    from pytreeio.errors import MismatchError

    monkeypatch.setattr(datacode, "_CHECKED_DOCS", Memo(8))
    native, meta = _decode(_file())
    datacode.to_model(native, meta)  # the layer list checked, and kept
    bad = {**meta, field: value}
    with pytest.raises(MismatchError, match=problem):
        datacode.to_model(native, bad)
    with pytest.raises(MismatchError, match=problem):
        datacode.encode(native, meta=bad)
