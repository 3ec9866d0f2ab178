"""Tiny Llama decodes replayed from a plan give exactly what the reader gives, and only where it would.

A weights file whose header and dims fields equal those of a file decoded
before (its skeleton, :mod:`pytreeio.skeleton`) has that file's records at
the same places.  Each test compares a replayed decode with the reader's own
result for the same bytes (the tree's nesting and key order; every array's
dtype, shape, strides, flags and bytes; the config; errors: type, message,
location).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import skeleton_flips
from tinyllama_data import random_tree

from pytreeio.errors import PytreeioError
from pytreeio.fmt import tinyllama as tl
from pytreeio.skeleton import Shelf

CONFIG = {
    "d_model": 4,
    "n_layers": 4,
    "n_heads": 2,
    "ffn_hidden_dim": 6,
    "max_seq_len": 3,
    "vocab_size": 5,
    "dropout": 0.25,
}


@pytest.fixture(autouse=True)
def no_plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(tl, "_PLANS", Shelf(4))
    yield


def _file(seed: int = 0, cfg: dict[str, Any] = CONFIG) -> bytes:
    meta = {"config": {"n_heads": cfg["n_heads"], "dropout": cfg["dropout"]}}
    return tl.encode(random_tree(cfg, seed=seed), meta=meta).tobytes()


def _shape_of(tree: Any) -> Any:
    """The nesting, key order and every array's kind (bytes included)."""
    if type(tree) is dict:
        return [(k, _shape_of(v)) for k, v in tree.items()]
    if type(tree) is list:
        return [_shape_of(v) for v in tree]
    flags = tuple(tree.flags[f] for f in ("C_CONTIGUOUS", "WRITEABLE", "ALIGNED", "OWNDATA"))
    return (type(tree), tree.dtype.str, tree.shape, tree.strides, flags, tree.tobytes())


def _outcome(data: bytes) -> Any:
    try:
        native, meta = tl.decode(memoryview(bytearray(data)))
    except PytreeioError as exc:
        return (type(exc), str(exc), exc.__dict__)
    return _shape_of(native), meta


def _parsed(data: bytes) -> Any:
    """What the reader itself gives (no plan to replay)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tl, "_PLANS", Shelf(4))
        return _outcome(data)


def test_first_decode_learns_nothing_second_learns_third_replays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = _file()
    want = _parsed(data)
    assert _outcome(data) == want
    assert tl._PLANS.plans == []  # a one-off load pays for no plan
    assert _outcome(data) == want
    assert len(tl._PLANS.plans) == 1
    walked: list[Any] = []
    monkeypatch.setattr(tl, "_records", lambda cfg: walked.append(cfg) or iter(()))
    assert _outcome(data) == want  # replayed: no record walked
    assert not walked


def test_other_values_of_the_same_config_are_replayed_with_the_new_values() -> None:
    for _ in range(2):
        _outcome(_file(0))
    other = _file(7)
    assert tl._PLANS.find(memoryview(bytearray(other))) is not None
    assert _outcome(other) == _parsed(other)


def test_another_config_of_the_same_size_is_parsed() -> None:
    for _ in range(2):
        _outcome(_file())
    other = _file(cfg={**CONFIG, "dropout": 0.5})  # same size, another header
    assert tl._PLANS.find(memoryview(bytearray(other))) is None
    assert _outcome(other) == _parsed(other)


def test_every_skeleton_byte_flip_is_read_or_refused_as_the_reader_does() -> None:
    data = _file()
    for _ in range(2):
        _outcome(data)
    plan = tl._PLANS.plans[0]
    for bad in skeleton_flips(data, plan.skeleton.positions, 120, 0x21):
        assert tl._PLANS.find(memoryview(bad)) is None
        assert _outcome(bytes(bad)) == _parsed(bytes(bad))


def test_replayed_trees_are_fresh_and_arrays_are_views_of_the_buffer() -> None:
    data = bytearray(_file())
    for _ in range(2):
        tl.decode(memoryview(data))
    a, _ = tl.decode(memoryview(data))
    a["layers"].clear()
    b, _ = tl.decode(memoryview(data))
    assert len(b["layers"]) == CONFIG["n_layers"]
    b["layers"][0]["wq"][0, 0] = np.float32(123.0)
    assert tl.decode(memoryview(data))[0]["layers"][0]["wq"][0, 0] == np.float32(123.0)
