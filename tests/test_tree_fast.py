"""The whole-tree fast path of ``restore`` agrees with the general walk, results and errors alike."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
from conftest import assert_same_tree

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
        m.setattr(tree, "fast_restore", lambda native, like, convert: None)
        return tree.restore(native, like)


def _general_error(native: Any, like: Any, monkeypatch: pytest.MonkeyPatch) -> MismatchError:
    with monkeypatch.context() as m:
        m.setattr(tree, "fast_restore", lambda native, like, convert: None)
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


def test_matching_tree_is_returned_as_is(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    like = _params()
    native = _copy(like)
    assert restore_fast.same_plain_tree(native, like)
    out = tree.restore(native, like)
    assert out is native
    assert_same_tree(out, _general(_copy(like), like, monkeypatch))


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


# --------------------------------------------------------------------------
# jax templates: one batched transfer, the same result as the general walk's per-leaf ones
# --------------------------------------------------------------------------


def _jax_like(jax: Any, like: Any, kind: str) -> Any:
    """``like`` with jax leaves: arrays, ShapeDtypeStructs (with/without sharding), or mixed."""
    dev = jax.devices()[0]

    def leaf(path: Any, x: np.ndarray) -> Any:
        if kind == "array":
            return jax.device_put(x, dev)
        if kind == "weak":  # a weak-typed template: the result is not weak (a plain transfer)
            return jax.numpy.asarray(x) if x.ndim else jax.numpy.asarray(x.item())
        if kind == "struct":
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        if kind == "struct_sharded":
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(dev)
            )
        # mixed: numpy, arrays and structs side by side (the groups are put apart)
        choice = len(path) % 3
        if choice == 0:
            return x
        return jax.device_put(x, dev) if choice == 1 else jax.ShapeDtypeStruct(x.shape, x.dtype)

    def walk(x: Any, path: str) -> Any:  # keeps the key order (jax's tree_map sorts it)
        if type(x) is dict:
            return {k: walk(v, f"{path}/{k}") for k, v in x.items()}
        return leaf(path, x)

    return walk(like, "")


def _params32() -> dict[str, Any]:
    """:func:`_params` with int32 steps (jax without x64 has no int64 arrays)."""
    out = _params()
    for layer in out["params"].values():
        layer["step"] = layer["step"].astype(np.int32)
    return out


def _assert_same_placed(jax: Any, got: Any, want: Any) -> None:
    """Same nesting, key order, leaf kinds, bytes, dtype, weak type, sharding, committed-ness."""
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_same_placed(jax, got[k], want[k])
        return
    assert type(got) is type(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    if isinstance(want, jax.Array):
        assert got.sharding == want.sharding
        assert got.committed == want.committed
        assert got.weak_type == want.weak_type


@pytest.mark.parametrize("kind", ["array", "weak", "struct", "struct_sharded", "mixed"])
def test_jax_like_fast_path_matches_the_general_walk(
    backend: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    jax = pytest.importorskip("jax")
    base = _params32()
    base["params"]["layer1"]["bf16"] = np.arange(5, dtype=np.float32).astype(jax.numpy.bfloat16)
    like = _jax_like(jax, base, kind)
    native = _copy(base)
    calls: list[int] = []
    real = jax.device_put

    def counting(x: Any, *args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(x, *args, **kw)

    monkeypatch.setattr(jax, "device_put", counting)
    got = tree.restore(native, like)
    assert len(calls) <= 2  # batched: one call per group, not one per leaf
    want = _general(_copy(base), like, monkeypatch)
    _assert_same_placed(jax, got, want)
    assert got is not native and list(got["params"]) == list(like["params"])


def test_jax_like_convert_false_gives_the_native_arrays(backend: str) -> None:
    jax = pytest.importorskip("jax")
    like = _jax_like(jax, _params32(), "array")
    native = _copy(_params32())
    out = tree.restore(native, like, convert=False)
    assert out is native  # the general walk's leaves too: numpy, unconverted


@pytest.mark.parametrize(("name", "mutate"), _mutations())
def test_jax_like_mismatch_gives_the_general_error(
    backend: str, name: str, mutate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    jax = pytest.importorskip("jax")
    like = _jax_like(jax, _params32(), "array")
    native = _copy(_params32())
    mutate(native)
    assert restore_fast.fast_restore(native, like, True) is None
    want = _general_error(_copy(native), like, monkeypatch)
    with pytest.raises(MismatchError) as info:
        tree.restore(native, like)
    assert str(info.value) == str(want)
    assert info.value.key_path == want.key_path


def test_jax_like_failed_transfer_fails_at_the_key_like_the_general_walk(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    jax = pytest.importorskip("jax")
    like = _jax_like(jax, _params32(), "array")
    native = _copy(_params32())
    real = jax.device_put

    def refuse_bias(x: Any, *args: Any, **kw: Any) -> Any:
        # the batched call (a list) and the general walk's call for one float16 leaf fail
        if isinstance(x, list) or (isinstance(x, np.ndarray) and x.dtype == np.float16):
            raise RuntimeError("no room on the device")
        return real(x, *args, **kw)

    monkeypatch.setattr(jax, "device_put", refuse_bias)
    assert restore_fast.fast_restore(_copy(_params32()), like, True) is None
    with pytest.raises(RuntimeError, match="no room"):
        tree.restore(native, like)


def test_jax_like_prng_keys_and_tracers_take_the_general_walk(backend: str) -> None:
    jax = pytest.importorskip("jax")
    key = jax.random.key(3)
    like = {"k": key, "w": jax.numpy.zeros(2, np.float32)}
    stored = jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)))  # as decode gives
    native = {"k": stored, "w": np.ones(2, np.float32)}
    assert restore_fast.fast_restore(native, like, True) is None
    # a key template over a numpy leaf of its key data: declined too (the walk refuses it)
    raw = {"k": np.asarray(jax.random.key_data(key)), "w": np.ones(2, np.float32)}
    assert restore_fast.fast_restore(raw, like, True) is None
    out = tree.restore(native, like)
    assert out["k"].dtype == key.dtype
    assert np.array_equal(jax.random.key_data(out["k"]), jax.random.key_data(key))

    seen: list[Any] = []

    def traced(x: Any) -> Any:
        seen.append(restore_fast.fast_restore({"w": np.ones(2, np.float32)}, {"w": x}, True))
        return x

    jax.jit(traced)(jax.numpy.zeros(2, np.float32))
    assert seen == [None]


def _reversed(x: Any) -> Any:
    """``x`` with every dict's keys in reverse order (the same nesting otherwise)."""
    if type(x) is dict:
        return {k: _reversed(x[k]) for k in reversed(list(x))}
    return x


def test_keys_in_another_order_give_the_general_walks_result(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template whose dicts list their keys in another order (jax.tree_util.tree_map sorts
    them) takes the fast path too, when orjson is there; the result follows like's order."""
    native = _params()
    like = _reversed(_copy(native))
    want = _general(native, like, monkeypatch)
    got = tree.restore(native, like)
    assert_same_tree(got, want)
    assert list(got["params"]) == list(like["params"]) != list(native["params"])
    for name, layer in got["params"].items():  # the native arrays themselves, as the walk gives
        for k, arr in layer.items():
            assert arr is native["params"][name][k]


@pytest.mark.parametrize("kind", ["array", "struct"])
def test_jax_like_keys_in_another_order_are_placed_in_one_batch(
    backend: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    jax = pytest.importorskip("jax")
    base = _params32()
    like = _reversed(_jax_like(jax, base, kind))
    calls: list[int] = []
    real = jax.device_put

    def counting(x: Any, *args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(x, *args, **kw)

    want = _general(_copy(base), like, monkeypatch)
    monkeypatch.setattr(jax, "device_put", counting)
    got = tree.restore(_copy(base), like)
    if backend == "orjson":
        assert len(calls) <= 2  # batched: one call per group, not one per leaf
    _assert_same_placed(jax, got, want)


@pytest.mark.parametrize(("name", "mutate"), _mutations())
def test_keys_in_another_order_with_a_mismatch_give_the_general_error(
    backend: str, name: str, mutate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    like = _reversed(_params())
    native = _copy(_params())
    mutate(native)
    want = _general_error(native, like, monkeypatch)
    with pytest.raises(MismatchError) as info:
        tree.restore(native, like)
    assert str(info.value) == str(want), name
