"""The whole-tree fast path of ``restore`` agrees with the general walk, results and errors alike."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

from pytreeio import restore_fast, tree
from pytreeio.errors import MismatchError


@pytest.fixture(params=["orjson", "python"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both structure checks: orjson's text (when installed) and the plain Python walk."""
    if request.param == "orjson":
        pytest.importorskip("orjson")
        monkeypatch.setattr(restore_fast, "_DUMPS", [])
    else:
        monkeypatch.setattr(restore_fast, "_DUMPS", [None, 0])
    return str(request.param)


def _general(native: Any, like: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        m.setattr(tree, "same_plain_tree", lambda native, like: False)
        return tree.restore(native, like)


def _general_error(native: Any, like: Any, monkeypatch: pytest.MonkeyPatch) -> MismatchError:
    with monkeypatch.context() as m:
        m.setattr(tree, "same_plain_tree", lambda native, like: False)
        with pytest.raises(MismatchError) as info:
            tree.restore(native, like)
    return info.value


def _params(n: int = 5) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    return {
        "params": {
            f"layer{i}": {
                "kernel": rng.standard_normal((3, 4)).astype(np.float32),
                "bias": rng.standard_normal(4).astype(np.float16),
                "step": np.array(i, np.int64),
            }
            for i in range(n)
        },
        "empty": {},
        "top": np.arange(6, dtype=np.uint8).reshape(2, 3),
    }


def _copy(x: Any) -> Any:
    if type(x) is dict:
        return {k: _copy(v) for k, v in x.items()}
    return np.array(x, copy=True) if isinstance(x, np.ndarray) else x


def _assert_same(a: Any, b: Any) -> None:
    """Same structure, key order, leaf types and bytes."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    else:
        assert a == b


def test_matching_tree_is_returned_as_is(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    like = _params()
    native = _copy(like)
    assert restore_fast.same_plain_tree(native, like)
    out = tree.restore(native, like)
    assert out is native
    _assert_same(out, _general(_copy(like), like, monkeypatch))


def test_empty_trees(backend: str) -> None:
    assert restore_fast.same_plain_tree({}, {})
    assert tree.restore({"a": {}}, {"a": {}}) == {"a": {}}


def _mutations() -> list[tuple[str, Any]]:
    """(name, function changing the native copy) each of which the general walk refuses."""

    def shape(n: dict[str, Any]) -> None:
        n["params"]["layer2"]["kernel"] = np.zeros((4, 3), np.float32)

    def dtype(n: dict[str, Any]) -> None:
        n["params"]["layer3"]["bias"] = np.zeros(4, np.float32)

    def missing(n: dict[str, Any]) -> None:
        del n["params"]["layer1"]["step"]

    def extra(n: dict[str, Any]) -> None:
        n["params"]["layer1"]["more"] = np.zeros(2, np.float32)

    def none(n: dict[str, Any]) -> None:
        n["params"]["layer0"]["bias"] = None

    def leaf_for_dict(n: dict[str, Any]) -> None:
        n["params"]["layer4"] = np.zeros(3, np.float32)

    def dict_for_leaf(n: dict[str, Any]) -> None:
        n["top"] = {"x": np.zeros(3, np.float32)}

    def scalar(n: dict[str, Any]) -> None:
        n["params"]["layer0"]["step"] = 1.5

    def byte_order(n: dict[str, Any]) -> None:
        n["top"] = n["top"].astype(">u2")

    return [
        (f.__name__, f)
        for f in (shape, dtype, missing, extra, none, leaf_for_dict, dict_for_leaf, scalar)
    ] + [("byte_order", byte_order)]


@pytest.mark.parametrize(("name", "mutate"), _mutations())
def test_mismatch_gives_the_general_error(
    backend: str, name: str, mutate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    like = _params()
    native = _copy(like)
    mutate(native)
    assert not restore_fast.same_plain_tree(native, like)
    want = _general_error(_copy(native), like, monkeypatch)
    with pytest.raises(MismatchError) as info:
        tree.restore(native, like)
    assert str(info.value) == str(want)
    assert info.value.key_path == want.key_path


def _declined() -> list[tuple[str, Any, Any]]:
    """(name, native, like) pairs the fast path leaves to the general walk, which restores them."""
    a = np.arange(4, dtype=np.float32)
    nt = collections.namedtuple("nt", "mu nu")
    return [
        ("key order", {"b": a, "a": a}, {"a": a, "b": a}),
        ("tuple", {"t": (a, a)}, {"t": (a, a)}),
        ("list native", {"t": [a, a]}, {"t": (a, a)}),
        ("namedtuple", {"s": nt(a, a)}, {"s": nt(a, a)}),
        ("ordered dict", {"o": {"x": a}}, {"o": collections.OrderedDict(x=a)}),
        ("none leaves", {"n": None, "a": a}, {"n": None, "a": a}),
        ("python scalars", {"f": 1.0, "a": a}, {"f": 2.0, "a": a}),
        ("nan", {"f": float("nan"), "a": a}, {"f": float("nan"), "a": a}),
        ("numpy scalar", {"s": np.float32(1)}, {"s": np.float32(2)}),
        ("int keys", {1: a}, {1: a}),
        ("partial extra none", {"a": a, "z": None}, {"a": a}),
        ("key with :null", {"x:null": a}, {"x:null": a}),
        ("memmap-like subclass", {"m": a}, {"m": a.view(np.matrix)}),
    ]


@pytest.mark.parametrize(("name", "native", "like"), _declined(), ids=lambda x: x)
def test_declined_cases_match_the_general_walk(
    backend: str, name: str, native: Any, like: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name != "key with :null":  # orjson's check declines it, the Python walk need not
        assert not restore_fast.same_plain_tree(native, like)
    try:
        want = _general(native, like, monkeypatch)
    except MismatchError as exc:
        with pytest.raises(MismatchError) as info:
            tree.restore(native, like)
        assert str(info.value) == str(exc)
        return
    got = tree.restore(native, like)
    assert type(got) is type(want)
    assert list(got) == list(want)
    for k in want:
        assert type(got[k]) is type(want[k])
        if isinstance(want[k], np.ndarray):
            assert np.array_equal(got[k], want[k], equal_nan=True)


def test_key_order_follows_like(backend: str) -> None:
    a = np.arange(3, dtype=np.int32)
    out = tree.restore({"a": a, "b": a}, {"b": a, "a": a})
    assert list(out) == ["b", "a"]


def test_deep_tree_declines_without_recursion_error(backend: str) -> None:
    like: dict[str, Any] = {}
    cur = like
    for _ in range(400):
        cur["d"] = {}
        cur = cur["d"]
    cur["x"] = np.zeros(2, np.float32)
    assert restore_fast.same_plain_tree(like, like) in (True, False)


def test_jax_like_leaves_are_placed(backend: str) -> None:
    jax = pytest.importorskip("jax")
    like = {"w": jax.numpy.zeros(3, np.float32)}
    native = {"w": np.ones(3, np.float32)}
    assert not restore_fast.same_plain_tree(native, like)
    out = tree.restore(native, like)
    assert isinstance(out["w"], jax.Array)
    assert np.array_equal(np.asarray(out["w"]), native["w"])
