"""pytreeio.model.optim: optax states <-> OptState, exact resume, build, strict mismatches."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, NamedTuple

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

from pytreeio.core.errors import FormatError, MismatchError  # noqa: E402
from pytreeio.model import optim  # noqa: E402
from pytreeio.model.optim import OptState  # noqa: E402

# --------------------------------------------------------------------------
# a small Dense-like params tree, deterministic gradients, a jitted step
# --------------------------------------------------------------------------

SHAPES = {
    "Dense_0": {"kernel": (3, 4), "bias": (4,)},
    "Dense_1": {"kernel": (4, 2), "bias": (2,)},
}


def make_params(shapes: Any = SHAPES) -> Any:
    out: dict[str, Any] = {}
    for i, (layer, leaves) in enumerate(shapes.items()):
        out[layer] = {}
        for j, (name, shape) in enumerate(leaves.items()):
            n = int(np.prod(shape))
            vals = np.linspace(-1.0, 1.0, n, dtype=np.float32).reshape(shape) * (i + j + 1) / 3
            out[layer][name] = jnp.asarray(vals)
    return out


PARAMS = make_params()
SCHEDULE = optax.linear_schedule(0.1, 0.01, 10)
MASK = {"Dense_0": {"kernel": True, "bias": False}, "Dense_1": {"kernel": True, "bias": False}}


@jax.jit
def _grads(params: Any, i: Any) -> Any:
    return jax.tree.map(lambda p: jnp.sin(p * 3.0 + i) + 0.1, params)


_apply = jax.jit(optax.apply_updates)


def train(opt: Any, params: Any, state: Any, start: int, n: int) -> tuple[Any, Any]:
    """``n`` steps from step ``start``; ``opt.update`` runs eagerly (its ops are cached
    across optimizers, which keeps this module fast), gradients and ``apply_updates`` jitted."""
    for i in range(start, start + n):
        updates, state = opt.update(_grads(params, jnp.float32(i)), state, params)
        params = _apply(params, updates)
    return params, state


def assert_bits(a: Any, b: Any) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"{ta} != {tb}"
    for i, (x, y) in enumerate(zip(la, lb)):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), i
        assert x.tobytes() == y.tobytes(), f"leaf {i} differs"


def host_copy(opt: OptState) -> OptState:
    """The OptState as a file would give it back: fresh numpy arrays, Python numbers."""
    return OptState(
        opt.kind,
        dict(opt.hyperparams),
        None if opt.count is None else int(opt.count),
        {
            k: [None if a is None else np.array(a, copy=True) for a in v]
            for k, v in opt.slots.items()
        },
    )


# --------------------------------------------------------------------------
# exact resume for every supported kind, plain / in a chain / under inject_hyperparams
# --------------------------------------------------------------------------

# name -> (optax factory, extra kwargs, expected kind, hyperparams for extract)
BASE = {
    "adam": (optax.adam, {}, "adam", None),
    "adamw": (optax.adamw, {"weight_decay": 0.05}, "adamw", None),
    "sgd": (optax.sgd, {}, "sgd", None),
    "momentum": (optax.sgd, {"momentum": 0.9}, "momentum", None),
    "nesterov": (optax.sgd, {"momentum": 0.9, "nesterov": True}, "nesterov", {"nesterov": True}),
    "adagrad": (optax.adagrad, {}, "adagrad", None),
    "rmsprop": (optax.rmsprop, {}, "rmsprop", None),
}
RMS_VARIANTS = {
    "rmsprop_centered": ({"centered": True}, {"mu", "nu"}, None),
    "rmsprop_momentum": ({"momentum": 0.5}, {"nu", "trace"}, None),
    "rmsprop_all": (
        {"centered": True, "momentum": 0.5, "nesterov": True, "bias_correction": True},
        {"mu", "nu", "trace"},
        3,
    ),
}
SLOTS = {
    "adam": {"mu", "nu"},
    "adamw": {"mu", "nu"},
    "sgd": set(),
    "momentum": {"trace"},
    "nesterov": {"trace"},
    "adagrad": {"sum_of_squares"},
    "rmsprop": {"nu"},
}


def _case(name: str, wrap: str) -> tuple[Any, str, Any]:
    factory, kw, kind, hp = BASE[name]
    if wrap == "plain":
        return factory(0.05, **kw), kind, hp
    if wrap == "chain":
        return optax.chain(optax.clip_by_global_norm(1.0), factory(0.05, **kw)), kind, hp
    return optax.inject_hyperparams(factory)(learning_rate=SCHEDULE, **kw), kind, hp


def check_exact_resume(opt: Any, kind: str, hp: Any = None, **extract_kw: Any) -> OptState:
    state0 = opt.init(PARAMS)
    p6, s6 = train(opt, PARAMS, state0, 0, 6)
    p3, s3 = train(opt, PARAMS, state0, 0, 3)
    got = optim.extract(s3, p3, hyperparams=hp, **extract_kw)
    assert got.kind == kind
    saved = host_copy(got)
    like = jax.eval_shape(opt.init, PARAMS)
    s3b = optim.rebuild(saved, like, PARAMS, order=extract_kw.get("order"))
    assert_bits(s3, s3b)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(s3b))
    p, s = train(opt, p3, s3b, 3, 3)
    assert_bits(p6, p)
    assert_bits(s6, s)
    return got


@pytest.mark.parametrize("wrap", ["plain", "chain", "inject"])
@pytest.mark.parametrize("name", list(BASE))
def test_exact_resume(name: str, wrap: str) -> None:
    opt, kind, hp = _case(name, wrap)
    got = check_exact_resume(opt, kind, hp)
    assert set(got.slots) == SLOTS[name]
    for values in got.slots.values():
        assert len(values) == 4
        assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in values)
    if wrap == "inject" or name in ("adam", "adamw"):
        assert got.count == 3
    else:
        assert got.count is None
    if wrap == "inject":  # hyperparameters come back from the state
        assert got.hyperparams["learning_rate"] == np.float32(SCHEDULE(2)).item()
        if name == "adam":
            assert got.hyperparams["b1"] == np.float32(0.9).item()
            assert got.hyperparams["b2"] == np.float32(0.999).item()
        if name == "adamw":
            assert got.hyperparams["weight_decay"] == np.float32(0.05).item()
        if name in ("momentum", "nesterov"):
            assert got.hyperparams["momentum"] == np.float32(0.9).item()
            assert "nesterov" not in got.hyperparams  # the kind says it


@pytest.mark.parametrize("name", list(RMS_VARIANTS))
def test_exact_resume_rmsprop_variants(name: str) -> None:
    kw, slots, count = RMS_VARIANTS[name]
    got = check_exact_resume(optax.rmsprop(0.01, **kw), "rmsprop")
    assert set(got.slots) == slots
    assert got.count == count
    assert got.hyperparams.get("centered", False) == kw.get("centered", False)
    assert got.hyperparams.get("bias_correction", False) == kw.get("bias_correction", False)


def test_exact_resume_adamw_with_mask() -> None:
    opt = optax.adamw(0.05, weight_decay=0.1, mask=MASK)
    got = check_exact_resume(opt, "adamw")
    assert all(v is not None for v in got.slots["mu"])  # the mask is the decay's, not adam's


def test_exact_resume_masked_and_scheduled() -> None:
    got = check_exact_resume(optax.masked(optax.adam(0.05), MASK), "adam")
    order = optim.default_order(PARAMS)
    for path, mu in zip(order, got.slots["mu"], strict=True):
        assert (mu is None) == (path[-1] == "bias")
    got = check_exact_resume(optax.sgd(SCHEDULE, momentum=0.9), "momentum")
    assert got.count == 3  # ScaleByScheduleState
    got = check_exact_resume(
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, mask=MASK),
        ),
        "adamw",
    )
    assert got.count == 3 and "weight_decay" in got.hyperparams


def test_jitted_step_and_real_like() -> None:
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(SCHEDULE))

    @jax.jit
    def step(p: Any, s: Any, i: Any) -> Any:
        u, s = opt.update(_grads(p, i), s, p)
        return optax.apply_updates(p, u), s

    p, s = PARAMS, opt.init(PARAMS)
    for i in range(3):
        p, s = step(p, s, jnp.float32(i))
    saved = host_copy(optim.extract(s, p))
    # like = a real state (jax arrays) and a numpy state: leaves come back as like's kind
    back = optim.rebuild(saved, opt.init(PARAMS), PARAMS)
    assert_bits(s, back)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(back))
    np_like = jax.tree.map(np.asarray, opt.init(PARAMS))
    back_np = optim.rebuild(saved, np_like, PARAMS)
    assert_bits(s, back_np)
    assert all(type(x) is np.ndarray for x in jax.tree_util.tree_leaves(back_np))
    p2, s2 = p, back
    for i in range(3, 5):
        p, s = step(p, s, jnp.float32(i))
        p2, s2 = step(p2, s2, jnp.float32(i))
    assert_bits((p, s), (p2, s2))


# --------------------------------------------------------------------------
# parameter order
# --------------------------------------------------------------------------


def _trained(opt: Any) -> Any:
    return train(opt, PARAMS, opt.init(PARAMS), 0, 2)[1]


def test_default_order_is_jax_leaf_order() -> None:
    assert optim.default_order(PARAMS) == [
        ("Dense_0", "bias"),
        ("Dense_0", "kernel"),
        ("Dense_1", "bias"),
        ("Dense_1", "kernel"),
    ]


def test_custom_order_places_slots() -> None:
    opt = optax.adam(0.05)
    state = _trained(opt)
    order = [("Dense_1", "kernel"), ("Dense_0", "kernel"), ("Dense_1", "bias"), ("Dense_0", "bias")]
    got = optim.extract(state, PARAMS, order=order)
    for (layer, leaf), mu, nu in zip(order, got.slots["mu"], got.slots["nu"], strict=True):
        assert mu.tobytes() == np.asarray(state[0].mu[layer][leaf]).tobytes()
        assert nu.tobytes() == np.asarray(state[0].nu[layer][leaf]).tobytes()
    like = jax.eval_shape(opt.init, PARAMS)
    assert_bits(state, optim.rebuild(host_copy(got), like, PARAMS, order=order))
    # lists and jax key entries are key paths too
    jax_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(PARAMS)[0]]
    by_jax = optim.extract(state, PARAMS, order=list(reversed(jax_paths)))
    rev = list(reversed(optim.default_order(PARAMS)))
    by_list = optim.extract(state, PARAMS, order=[list(p) for p in rev])
    for a, b in zip(by_jax.slots["mu"], by_list.slots["mu"], strict=True):
        assert a.tobytes() == b.tobytes()
    # slots in one order rebuilt with another: shapes no longer fit -> MismatchError
    with pytest.raises(MismatchError, match="shape or dtype"):
        optim.rebuild(host_copy(got), like, PARAMS)


@pytest.mark.parametrize(
    "order",
    [
        [("Dense_0", "kernel")],  # lacks parameters
        [(["Dense_0"], "kernel")],  # not keys
        [("Dense_0", "kernel")] * 4,  # duplicates
        [("Dense_0", "kernel"), ("Dense_0", "bias"), ("Dense_1", "kernel"), ("Dense_9", "w")],
        ["Dense_0/kernel", "Dense_0/bias", "Dense_1/kernel", "Dense_1/bias"],
        "Dense_0",
    ],
)
def test_bad_order(order: Any) -> None:
    state = _trained(optax.sgd(0.1, momentum=0.5))
    with pytest.raises(MismatchError):
        optim.extract(state, PARAMS, order=order)
    opt = optim.extract(state, PARAMS)
    with pytest.raises(MismatchError):
        optim.rebuild(
            opt, jax.eval_shape(optax.sgd(0.1, momentum=0.5).init, PARAMS), PARAMS, order=order
        )


# --------------------------------------------------------------------------
# hyperparameters
# --------------------------------------------------------------------------


def test_hyperparams_merge_and_conflicts() -> None:
    state = _trained(optax.inject_hyperparams(optax.adam)(learning_rate=0.5, b1=0.9))
    got = optim.extract(state, PARAMS, hyperparams={"b1": 0.9, "eps": 1e-8, "foo": 2})
    assert got.hyperparams["b1"] == np.float32(0.9).item()  # the state's value wins
    assert got.hyperparams["learning_rate"] == 0.5 and got.hyperparams["foo"] == 2
    assert all(type(v) in (float, int, bool) for v in got.hyperparams.values())
    with pytest.raises(MismatchError, match="b1"):
        optim.extract(state, PARAMS, hyperparams={"b1": 0.8})
    # plain optax states keep no hyperparameters: the caller's are recorded
    got = optim.extract(_trained(optax.adam(0.05)), PARAMS, hyperparams={"learning_rate": 0.05})
    assert got.hyperparams == {"learning_rate": 0.05}
    # contradictions between the given hyperparameters and the state
    with pytest.raises(MismatchError, match="weight_decay"):
        optim.extract(_trained(optax.adam(0.05)), PARAMS, hyperparams={"weight_decay": 0.1})
    with pytest.raises(MismatchError, match="momentum"):
        optim.extract(_trained(optax.sgd(0.05)), PARAMS, hyperparams={"momentum": 0.9})
    with pytest.raises(MismatchError, match="centered"):
        optim.extract(_trained(optax.rmsprop(0.05)), PARAMS, hyperparams={"centered": True})
    assert optim.extract(_trained(optax.sgd(0.05, momentum=0.9)), PARAMS).kind == "momentum"


def test_rebuild_sets_injected_hyperparams() -> None:
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.5)
    got = host_copy(optim.extract(_trained(opt), PARAMS))
    like = jax.eval_shape(opt.init, PARAMS)
    hp = dict(got.hyperparams, learning_rate=0.1, b2=0.75)  # not exact in float32: rounded
    back = optim.rebuild(OptState("adam", hp, got.count, got.slots), like, PARAMS)
    assert np.asarray(back.hyperparams["learning_rate"]) == np.float32(0.1)
    assert np.asarray(back.hyperparams["b2"]) == np.float32(0.75)
    assert back.count == 2 and back.inner_state[0].count == 2
    missing = {k: v for k, v in got.hyperparams.items() if k != "eps"}
    with pytest.raises(MismatchError, match="eps"):
        optim.rebuild(OptState("adam", missing, got.count, got.slots), like, PARAMS)
    with pytest.raises(MismatchError, match="not a number"):
        optim.rebuild(OptState("adam", dict(hp, b1="0.9"), got.count, got.slots), like, PARAMS)
    with pytest.raises(MismatchError, match="overflows"):
        optim.rebuild(OptState("adam", dict(hp, b1=1e300), got.count, got.slots), like, PARAMS)
    with pytest.raises(MismatchError, match="overflows"):
        optim.rebuild(OptState("adam", dict(hp, b1=10**400), got.count, got.slots), like, PARAMS)


# --------------------------------------------------------------------------
# mismatches: always MismatchError, naming the key path
# --------------------------------------------------------------------------


def _adam_saved() -> OptState:
    return host_copy(optim.extract(_trained(optax.adam(0.05)), PARAMS))


def _adam_like() -> Any:
    return jax.eval_shape(optax.adam(0.05).init, PARAMS)


@pytest.mark.parametrize(
    "opt",
    [optax.sgd(0.1, momentum=0.9), optax.sgd(0.1), optax.adagrad(0.1), optax.rmsprop(0.1)],
)
def test_kind_mismatch(opt: Any) -> None:
    with pytest.raises(MismatchError, match="kind 'adam'"):
        optim.rebuild(_adam_saved(), jax.eval_shape(opt.init, PARAMS), PARAMS)


def test_shared_layouts_fill_each_other() -> None:
    saved = _adam_saved()  # netcl cannot tell adam from adamw: either fills either
    like = jax.eval_shape(optax.adamw(0.05).init, PARAMS)
    back = optim.rebuild(OptState("adamw", {}, saved.count, saved.slots), like, PARAMS)
    assert int(back[0].count) == 2
    back = optim.rebuild(saved, like, PARAMS)
    mom = host_copy(optim.extract(_trained(optax.sgd(0.1, momentum=0.9)), PARAMS))
    like = jax.eval_shape(optax.sgd(0.1, momentum=0.9, nesterov=True).init, PARAMS)
    optim.rebuild(OptState("nesterov", {}, None, mom.slots), like, PARAMS)


def test_shape_and_dtype_mismatch() -> None:
    other = make_params({"Dense_0": {"kernel": (3, 5), "bias": (4,)}, "Dense_1": SHAPES["Dense_1"]})
    like = jax.eval_shape(optax.adam(0.05).init, other)
    with pytest.raises(MismatchError) as info:
        optim.rebuild(_adam_saved(), like, other)
    assert info.value.key_path == "[0]/mu/Dense_0/kernel"
    saved = _adam_saved()
    wide = {k: [a.astype(np.float64) for a in v] for k, v in saved.slots.items()}
    with pytest.raises(MismatchError, match="dtype"):
        optim.rebuild(OptState("adam", {}, saved.count, wide), _adam_like(), PARAMS)
    with pytest.raises(MismatchError):  # a count that does not fit int32
        optim.rebuild(OptState("adam", {}, 2**40, saved.slots), _adam_like(), PARAMS)


def test_missing_and_extra_parts() -> None:
    saved = _adam_saved()
    like = _adam_like()
    with pytest.raises(MismatchError, match="'nu'"):
        optim.rebuild(OptState("adam", {}, saved.count, {"mu": saved.slots["mu"]}), like, PARAMS)
    with pytest.raises(MismatchError, match="trace"):
        slots = dict(saved.slots, trace=saved.slots["mu"])
        optim.rebuild(OptState("adam", {}, saved.count, slots), like, PARAMS)
    with pytest.raises(MismatchError, match="step count"):
        optim.rebuild(OptState("adam", {}, None, saved.slots), like, PARAMS)
    with pytest.raises(MismatchError, match="3 entries"):
        slots = {k: v[:3] for k, v in saved.slots.items()}
        optim.rebuild(OptState("adam", {}, saved.count, slots), like, PARAMS)
    with pytest.raises(MismatchError, match="masked"):  # None (masked) where like wants an array
        slots = {k: [None, *v[1:]] for k, v in saved.slots.items()}
        optim.rebuild(OptState("adam", {}, saved.count, slots), like, PARAMS)
    masked_like = jax.eval_shape(optax.masked(optax.adam(0.05), MASK).init, PARAMS)
    with pytest.raises(MismatchError, match="masked"):  # an array where like is masked out
        optim.rebuild(saved, masked_like, PARAMS)
    # a step count on one side only
    sched_like = jax.eval_shape(optax.sgd(SCHEDULE).init, PARAMS)
    with pytest.raises(MismatchError, match="step count"):
        optim.rebuild(OptState("sgd", {}, None, {}), sched_like, PARAMS)
    with pytest.raises(MismatchError, match="step count"):
        optim.rebuild(
            OptState("sgd", {}, 3, {}), jax.eval_shape(optax.sgd(0.1).init, PARAMS), PARAMS
        )
    # params_like that is not the parameters
    with pytest.raises(MismatchError):
        optim.rebuild(saved, like, {"Dense_0": PARAMS["Dense_0"]})


class CountAndTrace(NamedTuple):
    count: Any
    trace: Any


class Counter(NamedTuple):
    count: Any


def test_unexpected_stateful_parts() -> None:
    two = optax.chain(optax.adam(0.05), optax.trace(0.9))
    with pytest.raises(MismatchError, match="more than one stateful") as info:
        optim.rebuild(_adam_saved(), jax.eval_shape(two.init, PARAMS), PARAMS)
    assert "TraceState" in str(info.value)
    with pytest.raises(MismatchError, match="more than one stateful"):
        optim.extract(two.init(PARAMS), PARAMS)
    # a look-alike NamedTuple with a `count` field: not an optax state
    odd = (CountAndTrace(jnp.zeros([], jnp.int32), PARAMS),)
    with pytest.raises(MismatchError, match="CountAndTrace"):
        optim.rebuild(_adam_saved(), odd, PARAMS)
    with pytest.raises(MismatchError, match="CountAndTrace"):
        optim.extract(odd, PARAMS)
    # a count-only state the file has no count for
    like = (*jax.eval_shape(optax.sgd(0.1, momentum=0.9).init, PARAMS), Counter(jnp.zeros([])))
    mom = host_copy(optim.extract(_trained(optax.sgd(0.1, momentum=0.9)), PARAMS))
    with pytest.raises(MismatchError, match="step count"):
        optim.rebuild(mom, like, PARAMS)


@pytest.mark.parametrize(
    "opt, state_type",
    [
        (optax.amsgrad(0.1), "ScaleByAmsgradState"),
        (optax.lion(0.1), "ScaleByLionState"),
        (optax.apply_if_finite(optax.adam(0.1), 3), "ApplyIfFiniteState"),
        (optax.MultiSteps(optax.adam(0.1), 2), "MultiStepsState"),
    ],
)
def test_unsupported_states(opt: Any, state_type: str) -> None:
    state = opt.init(PARAMS)
    with pytest.raises(MismatchError, match=state_type):
        optim.extract(state, PARAMS)
    with pytest.raises(MismatchError, match=state_type):
        optim.rebuild(_adam_saved(), jax.eval_shape(opt.init, PARAMS), PARAMS)


@pytest.mark.parametrize("bad", [None, "x", {}, {"a": 1}, 3, [1, 2]])
def test_non_array_leaves_in_like(bad: Any) -> None:
    saved = _adam_saved()
    adam, empty = _adam_like()
    mu = {"Dense_0": dict(adam.mu["Dense_0"], kernel=bad), "Dense_1": adam.mu["Dense_1"]}
    for like in [
        (adam._replace(count=bad), empty),
        (adam._replace(mu=mu), empty),
        (adam, bad),
        bad,
    ]:
        with pytest.raises(MismatchError):
            optim.rebuild(saved, like, PARAMS)


def test_bad_opt_state_values() -> None:
    saved = _adam_saved()
    like = _adam_like()
    for opt in [
        OptState("lamb", {}, 2, saved.slots),
        OptState("adam", [], 2, saved.slots),
        OptState("adam", {}, "2", saved.slots),
        OptState("adam", {}, True, saved.slots),
        OptState("adam", {}, 2, {"mu": "abc", "nu": saved.slots["nu"]}),
        OptState("adam", {}, 2, {"mu": [[1.0]] * 4, "nu": saved.slots["nu"]}),
        OptState("adam", {}, 2, [1]),
        "adam",
    ]:
        with pytest.raises(MismatchError):
            optim.rebuild(opt, like, PARAMS)  # type: ignore[arg-type]


def test_extract_needs_concrete_values() -> None:
    with pytest.raises(MismatchError, match="no values"):
        optim.extract(_adam_like(), PARAMS)
    with pytest.raises(MismatchError):
        optim.extract(_trained(optax.adam(0.1)), make_params({"Dense_0": SHAPES["Dense_0"]}))


# --------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------

# hyperparameters exact in float32, so inject_hyperparams' float32 arrays and optax's
# Python floats give the same bits
EXACT = {
    "sgd": ({"learning_rate": 0.5}, lambda: optax.sgd(0.5)),
    "momentum": (
        {"learning_rate": 0.25, "momentum": 0.5},
        lambda: optax.sgd(0.25, momentum=0.5),
    ),
    "nesterov": (
        {"learning_rate": 0.25, "momentum": 0.5},
        lambda: optax.sgd(0.25, momentum=0.5, nesterov=True),
    ),
    "adagrad": (
        {"learning_rate": 0.25, "initial_accumulator_value": 0.5, "eps": 0.125},
        lambda: optax.adagrad(0.25, initial_accumulator_value=0.5, eps=0.125),
    ),
    "rmsprop": (
        {"learning_rate": 0.25, "decay": 0.75, "eps": 0.125, "centered": True, "momentum": 0.5},
        lambda: optax.rmsprop(0.25, decay=0.75, eps=0.125, centered=True, momentum=0.5),
    ),
    "adam": (
        {"learning_rate": 0.25, "b1": 0.5, "b2": 0.75, "eps": 0.125},
        lambda: optax.adam(0.25, b1=0.5, b2=0.75, eps=0.125),
    ),
    "adamw": (
        {"learning_rate": 0.25, "b1": 0.5, "b2": 0.75, "eps": 0.125, "weight_decay": 0.25},
        lambda: optax.adamw(0.25, b1=0.5, b2=0.75, eps=0.125, weight_decay=0.25),
    ),
}


@pytest.mark.parametrize("kind", list(EXACT))
def test_build_matches_stock_optax(kind: str) -> None:
    hp, stock = EXACT[kind]
    built = optim.build(kind, hp)
    p1, s1 = train(built, PARAMS, built.init(PARAMS), 0, 3)
    p2, _ = train(stock(), PARAMS, stock().init(PARAMS), 0, 3)
    assert_bits(p1, p2)
    # the hyperparameters are visible in the state and the kind reads back
    got = optim.extract(s1, p1, hyperparams={"nesterov": True} if kind == "nesterov" else None)
    assert got.kind == kind
    for name, value in hp.items():
        if not isinstance(value, bool):
            assert got.hyperparams[name] == value
    # and build(kind, hyperparams) makes a `like` the OptState fills exactly
    again = optim.build(got.kind, got.hyperparams)
    back = optim.rebuild(host_copy(got), jax.eval_shape(again.init, PARAMS), PARAMS)
    assert_bits(s1, back)


def test_build_rounds_like_optax_otherwise() -> None:
    built = optim.build("adam", {"learning_rate": 0.01})
    p1, _ = train(built, PARAMS, built.init(PARAMS), 0, 3)
    p2, _ = train(optax.adam(0.01), PARAMS, optax.adam(0.01).init(PARAMS), 0, 3)
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kind, hp, match",
    [
        ("lamb", {"learning_rate": 0.1}, "unknown optimizer kind"),
        (3, {"learning_rate": 0.1}, "unknown optimizer kind"),
        ("adam", {}, "learning_rate"),
        ("momentum", {"learning_rate": 0.1}, "momentum"),
        ("nesterov", {"learning_rate": 0.1, "momentum": None}, "momentum"),
        ("sgd", {"learning_rate": 0.1, "momentum": 0.9}, "momentum"),
        ("adam", {"learning_rate": 0.1, "beta1": 0.9}, "beta1"),
        ("adam", {"learning_rate": 0.1, "weight_decay": 0.1}, "weight_decay"),
        ("momentum", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}, "nesterov"),
        ("adam", [("learning_rate", 0.1)], "mapping"),
    ],
)
def test_build_errors(kind: Any, hp: Any, match: str) -> None:
    with pytest.raises(MismatchError, match=match):
        optim.build(kind, hp)


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def test_describe() -> None:
    text = optim.describe(_trained(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))))
    assert text == "(EmptyState, (ScaleByAdamState(count, mu[4], nu[4]), EmptyState))"
    text = optim.describe(
        jax.eval_shape(optax.inject_hyperparams(optax.sgd)(SCHEDULE).init, PARAMS)
    )
    assert text.startswith("InjectStatefulHyperparamsState(count, hyperparams[learning_rate]")


def test_json_helpers_unchanged() -> None:
    assert optim.json_ready({"t": np.int32(3), 1: (np.ones(2, np.float32), jnp.zeros(1))}) == {
        "t": 3,
        "1": [[1.0, 1.0], [0.0]],
    }
    with pytest.raises(MismatchError):
        optim.json_ready(np.array(["a"]))
    arr = optim.nested_to_array([[1, 2], [3, 4]], (2, 2), "m")
    assert arr.dtype == np.float64 and arr.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    with pytest.raises(MismatchError):
        optim.nested_to_array([1, 2], (3,), "m")
    with pytest.raises(FormatError):
        optim.nested_to_array([[1], [2, 3]], (2, 2), "m")
    with pytest.raises(FormatError):
        optim.nested_to_array(["a"], (1,), "m")


def test_import_does_not_load_jax() -> None:
    code = "import sys, pytreeio.model.optim; assert 'jax' not in sys.modules and 'optax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
