"""Kept conversions (pytreeio.model_plans): a load into, or a save of, a Flax params tree of a
layout mapped before gives exactly what the full path through the common model form gives."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import model, model_plans
from pytreeio.errors import MismatchError, PytreeioWarning

MODEL_FORMATS = {
    "netcl-params": "m.npz",
    "netcl": "m.npz",
    "netcl-checkpoint": "ck",
    "datacode": "m.nn",
    "bullet": "b",
    "waffe2": "w",
}


def _tree(n: int = 12) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    return {
        "params": {
            f"Dense_{i}": {
                "kernel": rng.standard_normal((3, 4), dtype=np.float32),
                "bias": rng.standard_normal(4, dtype=np.float32),
            }
            if i % 2 == 0
            else {
                "kernel": rng.standard_normal((4, 3), dtype=np.float32),
                "bias": rng.standard_normal(3, dtype=np.float32),
            }
            for i in range(n)
        }
    }


def _flat(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flat(v, f"{prefix}/{k}")]
    return [(prefix, tree)]


def _assert_same(got: Any, want: Any) -> None:
    """Same nesting (key order too), and leaves of the same kind, layout and bits."""
    g, w = _flat(got), _flat(want)
    assert [k for k, _ in g] == [k for k, _ in w]
    for (k, a), (_, b) in zip(g, w):
        assert type(a) is type(b), k
        assert (a.shape, a.dtype, a.strides) == (b.shape, b.dtype, b.strides), k
        assert a.tobytes() == b.tobytes(), k


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except MismatchError as exc:
        return ("error", type(exc), exc.key_path)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the full path (``model.restore_model``)."""
    calls: list[int] = []
    full = model.restore_model

    def counting(m: Any, like: Any) -> Any:
        calls.append(1)
        return full(m, like)

    monkeypatch.setattr(model, "restore_model", counting)
    return calls


@pytest.mark.parametrize("fmt", MODEL_FORMATS)
def test_a_kept_restore_is_the_full_restore(tmp_path: Path, fmt: str, counted: list[int]) -> None:
    tree = _tree()
    path = tmp_path / MODEL_FORMATS[fmt]
    ptio.save(path, tree, format=fmt)
    ptio.forget_layouts()
    full = ptio.load(path, format=fmt, like=tree)
    again = ptio.load(path, format=fmt, like=tree)  # the second restore of a layout keeps it
    assert counted == [1, 1]
    kept = [ptio.load(path, format=fmt, like=tree) for _ in range(3)]
    assert counted == [1, 1], "the restores after the second are the kept one"
    _assert_same(again, full)
    for got in kept:
        _assert_same(got, full)
        assert got is not tree and got["params"] is not tree["params"]
    assert kept[0]["params"] is not kept[1]["params"]  # fresh containers every time
    _assert_same(tree, _tree())  # like untouched


def test_transposed_arrays_are_kept_as_views(tmp_path: Path) -> None:
    """cl-waffe2 stores kernels transposed: the kept restore makes the same views."""
    tree = _tree()
    ptio.save(tmp_path / "w", tree, format="waffe2")
    ptio.forget_layouts()
    full = ptio.load(tmp_path / "w", format="waffe2", like=tree)
    ptio.load(tmp_path / "w", format="waffe2", like=tree)
    kept = ptio.load(tmp_path / "w", format="waffe2", like=tree)
    _assert_same(kept, full)
    views = [v for plan in model_plans._RESTORES.values() for v in plan.views]
    assert {how for _, how, _ in views} == {"", "transpose"}
    assert not kept["params"]["Dense_0"]["kernel"].flags.c_contiguous


def _variants(tree: dict[str, Any]) -> dict[str, Any]:
    """``like`` trees that differ from ``tree`` in one way each."""
    p = tree["params"]

    def with_module(name: str, module: Any) -> dict[str, Any]:
        return {"params": {**p, name: module}}

    out: dict[str, Any] = {
        "shape": with_module("Dense_3", {**p["Dense_3"], "bias": np.zeros(5, np.float32)}),
        "dtype": with_module("Dense_1", {**p["Dense_1"], "kernel": p["Dense_1"]["kernel"].astype(np.float64)}),
        "order": {"params": dict(reversed(p.items()))},
        "leaf order": with_module("Dense_2", {"bias": p["Dense_2"]["bias"], "kernel": p["Dense_2"]["kernel"]}),
        "missing module": {"params": {k: v for k, v in p.items() if k != "Dense_5"}},
        "missing leaf": with_module("Dense_4", {"kernel": p["Dense_4"]["kernel"]}),
        "extra module": with_module("Dense_99", p["Dense_0"]),
        "extra leaf": with_module("Dense_0", {**p["Dense_0"], "scale": p["Dense_0"]["bias"]}),
        "renamed": {"params": {k.replace("Dense", "layers"): v for k, v in p.items()}},
        "variables": {"params": p, "batch_stats": {}},
        "bare params": p,
        "scalar leaf": with_module("Dense_6", {**p["Dense_6"], "bias": 0.0}),
        "none leaf": with_module("Dense_6", {**p["Dense_6"], "bias": None}),
        "list module": with_module("Dense_7", [p["Dense_7"]["kernel"], p["Dense_7"]["bias"]]),
        "f-order leaf": with_module(
            "Dense_8", {**p["Dense_8"], "kernel": np.asfortranarray(p["Dense_8"]["kernel"])}
        ),
    }  # fmt: skip
    import jax

    out["jax leaf"] = with_module("Dense_2", {**p["Dense_2"], "bias": jax.numpy.asarray(p["Dense_2"]["bias"])})  # fmt: skip
    return out


@pytest.mark.parametrize("fmt", ["netcl-params", "datacode", "waffe2"])
@pytest.mark.parametrize("partial", [False, True])
def test_every_other_like_gets_what_the_full_path_gives(
    tmp_path: Path, fmt: str, partial: bool
) -> None:
    tree = _tree()
    path = tmp_path / MODEL_FORMATS[fmt]
    ptio.save(path, tree, format=fmt)
    for name, like in _variants(tree).items():

        def load(like: Any = like) -> Any:
            return ptio.load(path, format=fmt, like=like, partial=partial)

        ptio.forget_layouts()
        want = _outcome(load)
        for _ in range(3):  # the tree's own restore kept, then this like's (from the second)
            ptio.load(path, format=fmt, like=tree)
            got = _outcome(load)
            if isinstance(want, tuple):
                assert got == want, name
            else:
                assert not isinstance(got, tuple), (name, got)
                assert [k for k, _ in _flat(got)] == [k for k, _ in _flat(want)], name
                for (k, a), (_, b) in zip(_flat(got), _flat(want)):
                    assert type(a) is type(b) and np.array_equal(np.asarray(a), np.asarray(b)), k


def _leaves(n: int) -> list[np.ndarray]:
    return [np.full((2, 3), i, np.float32) for i in range(n)]


def _like(native: list[np.ndarray]) -> dict[str, Any]:
    return {"params": {f"Dense_{i}": {"kernel": a.copy()} for i, a in enumerate(native)}}


def _placed(native: list[np.ndarray]) -> Callable[[], Any]:
    return lambda: {"params": {f"Dense_{i}": {"kernel": a} for i, a in enumerate(native)}}


def _learn(args: tuple[Any, ...], full: Callable[[], Any]) -> None:
    """Restore twice: a plan is kept from the second restore of a key."""
    for _ in range(2):
        model_plans.restore(*args, full)


def _refused() -> Any:
    raise AssertionError("the full path was taken")


def test_a_plan_is_used_only_for_equal_inputs() -> None:
    ptio.forget_layouts()
    native = _leaves(4)
    like = _like(native)
    _learn(("f", {"w": native}, {"m": 1}, like, {"o": 1}, False), _placed(native))
    again = _leaves(4)
    got = model_plans.restore("f", {"w": again}, {"m": 1}, like, {"o": 1}, False, _refused)
    assert [m["kernel"] for m in got["params"].values()] == again  # the new arrays, in place
    assert all(a is b for a, b in zip((m["kernel"] for m in got["params"].values()), again))
    changed: dict[str, tuple[Any, ...]] = {
        "format": ("g", {"w": again}, {"m": 1}, like, {"o": 1}, False),
        "meta": ("f", {"w": again}, {"m": 2}, like, {"o": 1}, False),
        "meta type": ("f", {"w": again}, {"m": True}, like, {"o": 1}, False),
        "options": ("f", {"w": again}, {"m": 1}, like, {"o": 2}, False),
        "partial": ("f", {"w": again}, {"m": 1}, like, {"o": 1}, True),
        "native nesting": ("f", {"v": again}, {"m": 1}, like, {"o": 1}, False),
        "native dtype": ("f", {"w": [a.astype(np.float64) for a in again]}, {"m": 1}, like, {"o": 1}, False),
        "native strides": ("f", {"w": [np.asfortranarray(a) for a in again]}, {"m": 1}, like, {"o": 1}, False),
        "native shape": ("f", {"w": [a.reshape(3, 2) for a in again]}, {"m": 1}, like, {"o": 1}, False),
        "native None": ("f", {"w": [*again[:3], None]}, {"m": 1}, like, {"o": 1}, False),
        "like shape": ("f", {"w": again}, {"m": 1}, _like([a.reshape(3, 2) for a in again]), {"o": 1}, False),
        "like dtype": ("f", {"w": again}, {"m": 1}, _like([a.astype(np.int32) for a in again]), {"o": 1}, False),
    }  # fmt: skip
    for name, args in changed.items():
        calls: list[int] = []

        def full(calls: list[int] = calls) -> Any:
            calls.append(1)
            return "full"

        assert model_plans.restore(*args, full) == "full", name
        assert calls == [1], name


def test_kept_only_when_the_result_is_the_native_arrays_each_once() -> None:
    native = _leaves(3)
    like = _like(native)
    results: dict[str, Callable[[], Any]] = {
        "copies": lambda: {"params": {f"Dense_{i}": {"kernel": a.copy()} for i, a in enumerate(native)}},
        "one twice": lambda: {"params": {f"Dense_{i}": {"kernel": native[0]} for i in range(3)}},
        "other nesting": lambda: {"params": {f"Dense_{i}": a for i, a in enumerate(native)}},
        "a converted array": _placed([*native[:2], native[2].astype(np.float64)]),
        "a slice": _placed([*native[:2], native[2][:, :2]]),
    }  # fmt: skip
    for name, result in results.items():
        ptio.forget_layouts()
        _learn(("f", native, {}, like, {}, False), result)
        assert not model_plans._RESTORES, name
    ptio.forget_layouts()
    _learn(("f", [*native, _leaves(1)[0]], {}, like, {}, False), _placed(native))
    assert not model_plans._RESTORES, "a native array unused"
    model_plans.restore("f", native, {}, like, {}, False, _placed(native))
    assert not model_plans._RESTORES, "kept from the second restore"
    model_plans.restore("f", native, {}, like, {}, False, _placed(native))
    assert model_plans._RESTORES


def test_views_are_made_again_from_the_new_arrays() -> None:
    ptio.forget_layouts()
    native = [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.float32)]
    like = {
        "Dense_0": {"kernel": np.zeros((3, 2), np.float32), "bias": np.zeros((2, 2), np.float32)}
    }

    def full() -> Any:
        return {"Dense_0": {"kernel": native[0].T, "bias": native[1].reshape(2, 2)}}

    _learn(("f", native, {}, like, {}, False), full)
    again = [native[0] + 10, native[1] + 10]
    got = model_plans.restore("f", again, {}, like, {}, False, _refused)
    np.testing.assert_array_equal(got["Dense_0"]["kernel"], again[0].T)
    np.testing.assert_array_equal(got["Dense_0"]["bias"], again[1].reshape(2, 2))
    assert np.shares_memory(got["Dense_0"]["kernel"], again[0])
    assert np.shares_memory(got["Dense_0"]["bias"], again[1])


def test_a_failed_restore_is_not_kept() -> None:
    ptio.forget_layouts()
    native = _leaves(2)

    def fails() -> Any:
        raise MismatchError("no", key_path="params/Dense_0")

    with pytest.raises(MismatchError):
        model_plans.restore("f", native, {}, _like(native), {}, False, fails)
    with pytest.raises(MismatchError):
        model_plans.restore("f", native, {}, _like(native), {}, False, fails)
    assert not model_plans._RESTORES
    with pytest.raises(MismatchError):  # and the next one is not served from anything
        model_plans.restore("f", native, {}, _like(native), {}, False, fails)


def test_a_restore_that_warned_is_not_kept() -> None:
    ptio.forget_layouts()
    native = _leaves(2)

    def warns() -> Any:
        warnings.warn("dropping something", PytreeioWarning, stacklevel=2)
        return _placed(native)()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # filtered out, still made: a repeat must make it again
        for _ in range(3):
            model_plans.restore("f", native, {}, _like(native), {}, False, warns)
    assert not model_plans._RESTORES


# --------------------------------------------------------------------------
# saves
# --------------------------------------------------------------------------


def _files(path: Path) -> dict[str, bytes]:
    if path.is_dir():
        return {
            str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
        }
    siblings = sorted(path.parent.glob(path.name + "*"))
    return {p.name: p.read_bytes() for p in siblings}


@pytest.fixture
def modelled(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the full save path (``model.model_of``)."""
    calls: list[int] = []
    full = model.model_of

    def counting(tree: Any, **kw: Any) -> Any:
        calls.append(1)
        return full(tree, **kw)

    monkeypatch.setattr(model, "model_of", counting)
    return calls


SAVED_FORMATS = list(MODEL_FORMATS)


@pytest.mark.parametrize("fmt", SAVED_FORMATS)
def test_a_kept_save_writes_the_full_saves_bytes(
    tmp_path: Path, fmt: str, modelled: list[int]
) -> None:
    tree = _tree()
    path = tmp_path / MODEL_FORMATS[fmt]  # one path: cl-waffe2 writes it into its files
    ptio.forget_layouts()
    ptio.save(path, tree, format=fmt)
    want = _files(path)
    for _ in range(4):
        ptio.save(path, tree, format=fmt)
        assert _files(path) == want
    assert modelled == [1, 1], "the saves after the second are the kept one"
    other = _tree()  # new arrays, new values: the kept plan places them
    for module in other["params"].values():
        module["kernel"] = module["kernel"] + 1
    ptio.save(path, other, format=fmt)
    kept = _files(path)
    assert kept != want
    ptio.forget_layouts()
    ptio.save(path, other, format=fmt)
    assert _files(path) == kept
    assert modelled == [1, 1, 1]


@pytest.mark.parametrize("fmt", ["netcl-params", "netcl", "datacode", "bullet"])
def test_every_other_tree_saves_as_the_full_path_saves_it(tmp_path: Path, fmt: str) -> None:
    tree = _tree()
    dest = MODEL_FORMATS[fmt]
    for name, other in _variants(tree).items():
        full, kept = tmp_path / name / "full", tmp_path / name / "kept"
        full.mkdir(parents=True)
        kept.mkdir()

        def save(to: Path, other: Any = other) -> Any:
            try:
                ptio.save(to / dest, other, format=fmt)
            except (MismatchError, TypeError, ValueError) as exc:
                return type(exc), str(exc)
            return _files(to / dest)

        ptio.forget_layouts()
        want = save(full)
        for _ in range(3):  # the tree's own save kept, then this tree's (from the second)
            ptio.save(kept / dest, tree, format=fmt)
            assert save(kept) == want, name


def test_a_save_plan_is_used_only_for_equal_documents() -> None:
    ptio.forget_layouts()
    arrays = _leaves(3)
    params = _like(arrays)
    native = {"w": arrays}
    docs = ({"o": 1}, None, {"m": [1, 2]}, False)

    def full() -> Any:
        flat = [m["kernel"] for m in params["params"].values()]
        return {"w": flat}, {"made": [1]}

    for _ in range(2):
        model_plans.save("f", params, docs, full)
    again = _like(_leaves(3))
    got, meta = model_plans.save("f", again, docs, _refused)
    assert all(a is b for a, b in zip(got["w"], (m["kernel"] for m in again["params"].values())))
    assert meta == {"made": [1]}
    meta["made"].append(2)  # the caller's copy: the kept document is not touched
    assert model_plans.save("f", again, docs, _refused)[1] == {"made": [1]}
    assert native["w"] is arrays
    for changed in (
        ({"o": 2}, None, {"m": [1, 2]}, False),
        ({"o": 1}, [{"type": "Linear"}], {"m": [1, 2]}, False),
        ({"o": 1}, None, {"m": [1, 2.0]}, False),
        ({"o": 1}, None, {"m": [1, 2]}, True),
    ):
        assert model_plans.save("f", again, changed, lambda: ("full", None)) == ("full", None)


def test_plans_hold_no_arrays(tmp_path: Path) -> None:
    ptio.forget_layouts()
    tree = _tree()
    for _ in range(3):
        ptio.save(tmp_path / "m.nn", tree, format="datacode")
        loaded = ptio.load(tmp_path / "m.nn", like=tree)
    assert model_plans._SAVES and model_plans._RESTORES
    refs = [weakref.ref(a) for m in tree["params"].values() for a in m.values()]
    refs += [weakref.ref(a) for m in loaded["params"].values() for a in m.values()]
    del tree, loaded
    gc.collect()
    assert all(r() is None for r in refs)


def test_no_plans_for_trees_beyond_the_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    native = _leaves(4)
    params = _like(native)
    flat = [m["kernel"] for m in params["params"].values()]

    def both() -> None:
        _learn(("f", native, {}, _like(native), {}, False), _placed(native))
        for _ in range(2):
            model_plans.save("f", params, (None,), lambda: ({"w": flat}, {}))

    for bound, value in (("MAX_LEAVES", 3), ("MAX_KEY_BYTES", 64)):
        ptio.forget_layouts()
        with monkeypatch.context() as m:
            m.setattr(model_plans, bound, value)
            both()
            assert not model_plans._RESTORES and not model_plans._SAVES, bound
        both()
        assert model_plans._RESTORES and model_plans._SAVES


def test_an_encoder_taking_the_model_gets_no_kept_save(tmp_path: Path) -> None:
    """A format whose encode declares ``model`` is given the Model every save: none is kept."""
    from pytreeio import registry

    netcl = registry.get("netcl")
    seen: list[Any] = []

    def encode(tree: Any, *, meta: Any = None, model: Any = None) -> Any:
        seen.append(model)
        return netcl.encode(tree, meta=meta, checked=model is not None)

    fmt = netcl._replace(name="netcl-with-model", encode=encode)
    tree = _tree()
    ptio.forget_layouts()
    for _ in range(3):
        ptio.save(tmp_path / "m.npz", tree, format=fmt)
    assert len(seen) == 3 and all(isinstance(m, model.Model) for m in seen)
    assert not model_plans._SAVES


# --------------------------------------------------------------------------
# jax templates: placed in one batch
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["array", "struct"])
@pytest.mark.parametrize("fmt", ["datacode", "netcl-params"])
def test_jax_templates_of_model_formats_are_placed_in_one_batch(
    tmp_path: Path, fmt: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model format's load into jax templates places every array in one batched transfer,
    exactly where a transfer per leaf puts it (and per leaf again if the batch fails)."""
    jax = pytest.importorskip("jax")
    from pytreeio import restore_fast

    tree = _tree()
    path = tmp_path / MODEL_FORMATS[fmt]
    ptio.save(path, tree, format=fmt)

    def template(a: np.ndarray) -> Any:
        return jax.numpy.asarray(a) if kind == "array" else jax.ShapeDtypeStruct(a.shape, a.dtype)

    like = jax.tree_util.tree_map(template, tree)  # sorted keys: another order than the file's
    with monkeypatch.context() as m:
        m.setattr(model._Placing, "takes", lambda self, a, v: False)
        want = ptio.load(path, format=fmt, like=like)
    calls: list[int] = []
    real = jax.device_put

    def counting(x: Any, *args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(x, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(jax, "device_put", counting)
        got = ptio.load(path, format=fmt, like=like)
    assert len(calls) == 1
    with monkeypatch.context() as m:
        m.setattr(restore_fast, "placed", lambda arrays, likes: None)  # a failed batch
        one_by_one = ptio.load(path, format=fmt, like=like)
    for result in (got, one_by_one):
        g, w = _flat(result), _flat(want)
        assert [k for k, _ in g] == [k for k, _ in w]
        for (k, a), (_, b) in zip(g, w):
            assert type(a) is type(b) and a.sharding == b.sharding, k
            assert a.dtype == b.dtype and a.shape == b.shape, k
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), k
