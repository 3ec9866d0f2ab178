"""Key paths: canonical strings, flatten/unflatten, restoring into `like`."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_bits_equal, keys, trees
from hypothesis import assume, given

import pytreeio as ptio
from pytreeio.core.tree import key_string, parse_key_string, restore

components = st.one_of(
    keys,
    st.integers(-(10**6), 10**6),
    st.integers(0, 10**6).map(lambda i: ("[", i)),
)


@given(st.lists(components, max_size=6))
def test_key_strings_round_trip(path: list[Any]) -> None:
    text = key_string(path)
    assert parse_key_string(text) == tuple(path)


@given(st.lists(components, min_size=1, max_size=4), st.lists(components, min_size=1, max_size=4))
def test_distinct_paths_have_distinct_keys(a: list[Any], b: list[Any]) -> None:
    if a != b:
        assert key_string(a) != key_string(b)


def test_key_string_examples() -> None:
    assert key_string(["params", "Dense_0", "kernel"]) == "params/Dense_0/kernel"
    assert key_string(["layers", ("[", 3), "wq"]) == "layers/[3]/wq"
    assert key_string(["vocab", -1]) == "vocab/#-1"
    assert key_string(["a/b", "[x]", "#1", ""]) == "a\\/b/\\[x]/\\#1/\\_"
    assert key_string([]) == ""


@pytest.mark.parametrize("bad", ["a/\\q", "a\\", "[x]", "[01]", "#1.5", "a//b", "[-1]"])
def test_malformed_key_strings_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_key_string(bad)


@given(trees())
def test_flatten_unflatten_with_like_is_identity(tree: Any) -> None:
    assume(tree is not None)  # like=None means "no template"
    flat = ptio.flatten(tree)
    assert_bits_equal(tree, ptio.unflatten(flat, like=tree))


def test_flatten_orders_like_jax() -> None:
    tree = {"b": [np.ones(1), np.zeros(2)], "a": {"y": np.ones(3), "x": np.ones(4)}}
    ours = list(ptio.flatten(tree).values())
    theirs = jax.tree_util.tree_leaves(tree)
    assert [a.shape for a in ours] == [b.shape for b in theirs]
    assert list(ptio.flatten(tree)) == ["a/x", "a/y", "b/[0]", "b/[1]"]


def test_unflatten_without_like_builds_dicts_and_lists() -> None:
    flat = {"a/[0]": 1, "a/[1]": 2, "b/#3": 4, "c\\/d": 5}
    assert ptio.unflatten(flat) == {"a": [1, 2], "b": {3: 4}, "c/d": 5}
    with pytest.raises(ValueError, match="indices"):
        ptio.unflatten({"a/[0]": 1, "a/[2]": 2})


def test_restore_optax_state_tuples_int_keys_none_and_shape_dtype_struct() -> None:
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3), "emb": {7: jnp.ones(1)}}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init(params)
    like = {"params": params, "opt": opt, "pair": (np.ones(2), [np.int32(1)]), "none": None, "n": 3}
    # A flax-style state dict: sequences and NamedTuples as str-keyed dicts.
    native = {
        "params": {
            "w": np.full((2, 3), 2.0, np.float32),
            "b": np.ones(3, np.float32),
            "emb": {"7": np.ones(1, np.float32)},
        },
        "opt": {
            "0": {},
            "1": {
                "0": {
                    "count": np.array(5, np.int32),
                    "mu": {
                        "w": np.ones((2, 3), np.float32),
                        "b": np.ones(3, np.float32),
                        "emb": {"7": np.ones(1, np.float32)},
                    },
                    "nu": {
                        "w": np.ones((2, 3), np.float32),
                        "b": np.ones(3, np.float32),
                        "emb": {"7": np.ones(1, np.float32)},
                    },
                },
                "1": {},
            },
        },
        "pair": {"0": np.full(2, 9.0), "1": {"0": np.int32(4)}},
        "none": None,
        "n": 11,
    }
    out = restore(native, like)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(like)
    assert isinstance(out["opt"][1][0], optax.ScaleByAdamState)
    assert int(out["opt"][1][0].count) == 5
    assert isinstance(out["params"]["w"], jax.Array)
    assert isinstance(out["pair"], tuple) and isinstance(out["pair"][1], list)
    assert isinstance(out["pair"][1][0], np.int32) and out["pair"][1][0] == 4
    assert out["none"] is None and out["n"] == 11 and type(out["n"]) is int
    # ShapeDtypeStruct templates from jax.eval_shape
    abstract = jax.eval_shape(lambda: like["params"])
    got = restore(native["params"], abstract)
    assert isinstance(got["w"], jax.Array) and float(got["w"][0, 0]) == 2.0


def test_mismatch_errors_name_the_key_path() -> None:
    like = {"a": {"w": np.zeros((2, 3), np.float32)}, "b": [np.zeros(1)]}
    with pytest.raises(ptio.MismatchError) as e:
        restore({"a": {"w": np.zeros((3, 2), np.float32)}, "b": [np.zeros(1)]}, like)
    assert (
        e.value.key_path == "a/w"
        and "float32[2, 3]" in str(e.value)
        and "float32[3, 2]" in str(e.value)
    )
    with pytest.raises(ptio.MismatchError, match="dtype") as e:
        restore({"a": {"w": np.zeros((2, 3), np.float64)}, "b": [np.zeros(1)]}, like)
    with pytest.raises(ptio.MismatchError, match="missing") as e:
        restore({"a": {}, "b": [np.zeros(1)]}, like)
    assert e.value.key_path == "a/w"
    with pytest.raises(ptio.MismatchError, match="lacks") as e:
        restore(
            {"a": {"w": np.zeros((2, 3), np.float32), "extra": np.ones(1)}, "b": [np.zeros(1)]},
            like,
        )
    assert e.value.key_path == "a"
    with pytest.raises(ptio.MismatchError) as e:
        restore({"a": {"w": np.zeros((2, 3), np.float32)}, "b": [np.zeros(1), np.zeros(1)]}, like)
    assert e.value.key_path == "b"


def test_restore_never_mutates_inputs_and_keeps_mapping_types() -> None:
    like = OrderedDict(a=np.zeros(2), b=np.zeros(1))
    native = {"a": np.ones(2), "b": np.ones(1)}
    snapshot = {k: v.copy() for k, v in native.items()}
    out = restore(native, like)
    assert type(out) is OrderedDict
    assert all(np.array_equal(native[k], snapshot[k]) for k in native)
    assert like["a"].sum() == 0


def test_flax_struct_dataclass_via_jax_registry() -> None:
    from flax.training import train_state

    params = {"w": jnp.ones(3)}
    state = train_state.TrainState.create(
        apply_fn=lambda *a: None, params=params, tx=optax.sgd(0.1, momentum=0.9)
    )
    flat = ptio.flatten(state)
    assert "params/w" in flat and "step" in flat
    back = ptio.unflatten(flat, like=state)
    assert type(back) is type(state) and np.array_equal(back.params["w"], params["w"])


def test_python_scalars_restore_into_zero_d_templates_only_when_exact() -> None:
    like = jax.eval_shape(lambda: {"step": 0, "lr": 0.5, "on": True})
    out = restore({"step": 50, "lr": 0.25, "on": False}, like)
    assert int(out["step"]) == 50 and out["step"].dtype == jnp.int32 and float(out["lr"]) == 0.25
    with pytest.raises(ptio.MismatchError, match="exactly") as e:
        restore({"step": 2**40, "lr": 0.25, "on": False}, like)
    assert e.value.key_path == "step"
    with pytest.raises(ptio.MismatchError, match="exactly"):
        restore({"step": 1, "lr": 0.1, "on": False}, like)  # 0.1 is not a float32
    with pytest.raises(ptio.MismatchError):
        restore({"step": 1.5, "lr": 0.25, "on": False}, like)
    with pytest.raises(ptio.MismatchError):
        restore({"a": 1}, {"a": np.zeros(2, np.int32)})  # only 0-d templates take scalars


def _ids(leaves: Any) -> list[int]:
    return sorted(id(x) for x in leaves)


@given(trees())
def test_leaf_values_are_the_leaves_iter_leaves_yields(tree: Any) -> None:
    from pytreeio.core.tree import iter_leaves, leaf_values

    assert _ids(leaf_values(tree)) == _ids(leaf for _, leaf in iter_leaves(tree))


def test_leaf_values_walk_every_kind_of_node() -> None:
    """Plain containers take the fast walk; the rest (namedtuples, mappings, jax nodes,
    optax states) go through node_children, with the same leaves as iter_leaves."""
    from pytreeio.core.tree import iter_leaves, leaf_values

    a, b, c = np.zeros(2), np.ones(3), np.float32(2.0)
    tree = {
        "plain": [a, (b, None), {}],
        "ordered": OrderedDict(x=c, y=[a]),
        "opt": optax.adam(1e-3).init({"w": jnp.zeros(3)}),
        "jax": jnp.arange(4),
        "scalar": 3,
    }
    assert _ids(leaf_values(tree)) == _ids(leaf for _, leaf in iter_leaves(tree))
    assert len(list(leaf_values(tree))) == len(list(iter_leaves(tree))) > 6


def test_a_typed_key_deep_in_plain_containers_is_still_refused(tmp_path: Any) -> None:
    tree = {
        "params": {"Dense_0": {"kernel": np.zeros((2, 2), np.float32)}},
        "rng": [jax.random.key(0)],
    }
    with pytest.raises(ptio.EncodeError, match="typed PRNG key") as err:
        ptio.save(tmp_path / "m.npz", tree, format="netcl-params")
    assert err.value.key_path == "rng/[0]"


def _flatten_by_paths(tree: Any) -> list[tuple[str, int]]:
    from pytreeio.core.tree import iter_leaves

    return [(key_string(path), id(leaf)) for path, leaf in iter_leaves(tree)]


@given(trees())
def test_flatten_keys_and_order_are_iter_leaves(tree: Any) -> None:
    from pytreeio.core.tree import flatten

    assert [(k, id(v)) for k, v in flatten(tree).items()] == _flatten_by_paths(tree)


def test_flatten_mixed_nodes_and_awkward_keys() -> None:
    """Plain containers walked directly, other nodes through iter_leaves beneath them, escaped
    and integer keys, a leaf at the root, and the same refusal of keys no path can name."""
    from pytreeio.core.binary import Slot
    from pytreeio.core.tree import flatten

    a = np.zeros(2)
    tree = {
        "a/b": [a, (a, None)],
        "#x": OrderedDict(z=a, y={"": a, 3: a}),
        "[0]": optax.adam(1e-3).init({"w": jnp.zeros(3)}),
        "\\\\": {"k": jnp.ones(2), "s": 1.5},
        7: [],
        "slots": [Slot("s", 0, 8, (2,), np.dtype("<f4")), np.float32(1), True, "text"],
    }
    assert [(k, id(v)) for k, v in flatten(tree).items()] == _flatten_by_paths(tree)
    assert list(flatten(a)) == [""] and list(flatten([a])) == ["[0]"]
    assert flatten(None) == {} and flatten({"e": {}}) == {}
    with pytest.raises(TypeError, match="dict keys must be str or int"):
        flatten({"ok": a, "bad": {True: a}})
