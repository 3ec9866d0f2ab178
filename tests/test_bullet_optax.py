"""bullet checkpoints of JAX NNUEs keyed by bullet's own tensor ids, with their optax state.

``{'params': {'l0w': ..., 'l0b': ..., 'l1w': ..., 'l1b': ...}, 'opt_state': optax.adamw(...).init(...)}``
saves to bullet's files (mu -> momentum.bin, nu -> velocity.bin, the count -> step.txt) and
resumes bit for bit.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_bits_equal
from test_bullet import like_of

import pytreeio as ptio
from pytreeio.core.errors import ConversionError, EncodeError, MismatchError
from pytreeio.formats.bullet import checkpoint as B

QA, QB = 255, 64
INPUTS, HIDDEN = 64, 8  # (64 -> 8) x 2 -> 1: the feature transformer feeds both perspectives
IDS = ["l0w", "l0b", "l1w", "l1b"]


def nnue_params(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "l0w": jnp.asarray(rng.uniform(-0.3, 0.3, (INPUTS, HIDDEN)), jnp.float32),
        "l0b": jnp.asarray(rng.uniform(-0.1, 0.1, HIDDEN), jnp.float32),
        "l1w": jnp.asarray(rng.uniform(-0.3, 0.3, (2 * HIDDEN, 1)), jnp.float32),
        "l1b": jnp.zeros(1, jnp.float32),
    }


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{'l0': {'w': ..., 'b': ...}, ...}``: the ids as key paths."""
    out: dict[str, dict[str, Any]] = {}
    for rid, a in flat.items():
        out.setdefault(rid[:-1], {})[rid[-1]] = a
    return out


def flat_of(params: dict[str, Any]) -> dict[str, Any]:
    if "l0w" in params:
        return params
    return {layer + name: a for layer, group in params.items() for name, a in group.items()}


@functools.cache
def batch(seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both perspectives' sparse features and targets (numpy: constants of the traced step)."""
    rng = np.random.default_rng(seed)
    stm = (rng.random((32, INPUTS)) < 0.1).astype(np.float32)
    nstm = (rng.random((32, INPUTS)) < 0.1).astype(np.float32)
    return stm, nstm, rng.uniform(-1, 1, (32, 1)).astype(np.float32)


def loss(params: Any) -> Any:
    p = flat_of(params)
    stm, nstm, target = batch()
    acc = jnp.concatenate([stm @ p["l0w"] + p["l0b"], nstm @ p["l0w"] + p["l0b"]], axis=1)
    out = jnp.clip(acc, 0.0, 1.0) @ p["l1w"] + p["l1b"]  # CReLU, then the output layer
    return jnp.mean((jax.nn.sigmoid(out) - jax.nn.sigmoid(target)) ** 2)


def trainer(tx: Any) -> Any:
    @jax.jit
    def step(params: Any, opt_state: Any) -> tuple[Any, Any]:
        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def train(state: dict[str, Any], n: int) -> dict[str, Any]:
        params, opt_state = state["params"], state["opt_state"]
        for _ in range(n):
            params, opt_state = step(params, opt_state)
        return {"params": params, "opt_state": opt_state}

    return train


def adam_state(opt_state: Any) -> Any:
    return opt_state[0]  # adam's and adamw's chain start with ScaleByAdamState


def record(rid: str, values: Any) -> bytes:
    """One tagged record, built by hand from FORMATS.md."""
    values = np.asarray(values, "<f4").reshape(-1)
    return rid.encode() + b"\n" + struct.pack("<Q", values.size) + values.tobytes()


def dir_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def record_file(tensors: dict[str, Any]) -> bytes:
    return b"".join(record(rid, tensors[rid]) for rid in sorted(tensors))  # sorted by id


# --------------------------------------------------------------------------
# bit-exact resumes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["flat", "nested"])
def test_adamw_resume_five_plus_five_is_bit_exact(tmp_path: Path, shape: str) -> None:
    params = nnue_params() if shape == "flat" else nested(nnue_params())
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    train = trainer(tx)
    start = {"params": params, "opt_state": tx.init(params)}
    reference = train(start, 10)
    middle = train(start, 5)
    layout = B.classic_layout([QA, QB])
    ptio.save(tmp_path / "nnue-5", middle, format="bullet", meta={"saved_format": layout})
    restored = ptio.load(tmp_path / "nnue-5", like=like_of(tx, params))
    assert_bits_equal(restored, middle)
    assert int(adam_state(restored["opt_state"]).count) == 5
    resumed = train(restored, 5)
    assert_bits_equal(resumed, reference)
    assert int(adam_state(resumed["opt_state"]).count) == 10


def test_adam_resume_is_bit_exact(tmp_path: Path) -> None:
    params = nnue_params(seed=3)
    tx = optax.adam(3e-3)
    train = trainer(tx)
    start = {"params": params, "opt_state": tx.init(params)}
    reference = train(start, 10)
    middle = train(start, 5)
    ptio.save(tmp_path / "ck", middle, format="bullet")  # no saved_format: every tensor f32
    restored = ptio.load(tmp_path / "ck", like=like_of(tx, params))
    assert_bits_equal(restored, middle)
    assert_bits_equal(train(restored, 5), reference)
    # numpy leaves in `like` come back as numpy
    np_like = jax.tree_util.tree_map(np.asarray, middle)
    assert_bits_equal(ptio.load(tmp_path / "ck", like=np_like), middle)


def test_lazy_view_restores_the_same(tmp_path: Path) -> None:
    params = nnue_params()
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    middle = trainer(tx)({"params": params, "opt_state": tx.init(params)}, 3)
    ptio.save(tmp_path / "ck", middle, format="bullet")
    with ptio.open(tmp_path / "ck", format="bullet") as ck:
        assert_bits_equal(ck.load(like=like_of(tx, params)), middle)


# --------------------------------------------------------------------------
# the files on disk are bullet's
# --------------------------------------------------------------------------


def test_files_hold_params_and_moments_by_id(tmp_path: Path) -> None:
    params = nested(nnue_params())
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    middle = trainer(tx)({"params": params, "opt_state": tx.init(params)}, 5)
    layout = B.classic_layout([QA, QB])
    ck = tmp_path / "nnue-5"
    ptio.save(ck, middle, format="bullet", meta={"saved_format": layout})
    weights = {k: np.asarray(v) for k, v in flat_of(middle["params"]).items()}
    mu = {k: np.asarray(v) for k, v in flat_of(adam_state(middle["opt_state"]).mu).items()}
    nu = {k: np.asarray(v) for k, v in flat_of(adam_state(middle["opt_state"]).nu).items()}
    assert set(weights) == set(IDS)

    native, meta = ptio.load_with_meta(ck, format="bullet")
    assert set(native) == {"weights", "momentum", "velocity"}
    for part, want in (("weights", weights), ("momentum", mu), ("velocity", nu)):
        assert set(native[part]) == set(IDS)
        for rid in IDS:
            got = np.asarray(native[part][rid])
            assert got.shape == want[rid].shape, (part, rid)
            assert np.array_equal(got.view(np.uint32), want[rid].view(np.uint32)), (part, rid)
    assert meta["steps"] == {rid: 5 for rid in IDS}

    state = ck / "optimiser_state"
    assert (state / "weights.bin").read_bytes() == record_file(weights)
    assert (state / "momentum.bin").read_bytes() == record_file(mu)
    assert (state / "velocity.bin").read_bytes() == record_file(nu)
    assert (state / "step.txt").read_text() == "".join(f"{r},5\n" for r in sorted(IDS))
    # raw.bin: the saved-format entries as f32, in list order; quantised.bin as bullet writes it
    raw = b"".join(weights[e["id"]].astype("<f4").tobytes() for e in layout)
    assert (ck / "raw.bin").read_bytes() == raw
    assert (ck / "quantised.bin").stat().st_size % 64 == 0
    q = B.quantised_tensors(dir_files(ck), layout)
    assert q["l0w"].dtype == np.int16
    x = weights["l0w"].astype(np.float64) * QA
    assert np.array_equal(q["l0w"], np.sign(x) * np.floor(np.abs(x) + 0.5))  # half away from 0


def test_flat_and_nested_params_write_the_same_bytes(tmp_path: Path) -> None:
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    flat = nnue_params()
    a = trainer(tx)({"params": flat, "opt_state": tx.init(flat)}, 2)
    b = trainer(tx)({"params": nested(flat), "opt_state": tx.init(nested(flat))}, 2)
    ptio.save(tmp_path / "a", a, format="bullet")
    ptio.save(tmp_path / "b", b, format="bullet")
    for name in ("weights", "momentum", "velocity", "step"):
        suffix = "txt" if name == "step" else "bin"
        f = f"optimiser_state/{name}.{suffix}"
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    # a checkpoint saved from nested params restores into flat ones, and back
    assert_bits_equal(ptio.load(tmp_path / "b", like=like_of(tx, flat)), a)
    assert_bits_equal(ptio.load(tmp_path / "a", like=like_of(tx, nested(flat))), b)


# --------------------------------------------------------------------------
# the step count
# --------------------------------------------------------------------------


def test_count_lives_in_step_txt(tmp_path: Path) -> None:
    params = nnue_params()
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    middle = trainer(tx)({"params": params, "opt_state": tx.init(params)}, 5)
    ck = tmp_path / "ck"
    ptio.save(ck, {**middle, "step": 5}, format="bullet")
    restored = ptio.load(ck, like={**like_of(tx, params), "step": 0})
    assert restored["step"] == 5
    # bullet's own AdamW writes no step.txt: the count then comes from step=
    (ck / "optimiser_state" / "step.txt").unlink()
    with pytest.raises(MismatchError, match="step count"):
        ptio.load(ck, like=like_of(tx, params))
    restored = ptio.load(ck, like=like_of(tx, params), step=5)
    assert_bits_equal(restored, middle)
    with pytest.raises(EncodeError, match="step 4 differs"):
        ptio.save(tmp_path / "bad", {**middle, "step": 4}, format="bullet")


def test_params_alone_and_missing_state(tmp_path: Path) -> None:
    params = nnue_params()
    tx = optax.adam(1e-3)
    ptio.save(tmp_path / "w", {"params": params}, format="bullet")
    assert not (tmp_path / "w" / "optimiser_state" / "momentum.bin").exists()
    assert_bits_equal(ptio.load(tmp_path / "w", like={"params": params}), {"params": params})
    with pytest.raises(MismatchError, match="no optimizer state"):
        ptio.load(tmp_path / "w", like=like_of(tx, params))
    # a like lacking a tensor of the file: refused, unless partial
    three = {k: v for k, v in params.items() if k != "l1b"}
    with pytest.raises(MismatchError, match="l1b"):
        ptio.load(tmp_path / "w", like={"params": three})
    got = ptio.load(tmp_path / "w", like={"params": three}, partial=True)
    assert set(got["params"]) == set(three)
    # a like with a tensor the file lacks
    more = {**params, "l2w": params["l1w"]}
    with pytest.raises(MismatchError, match="l2w"):
        ptio.load(tmp_path / "w", like={"params": more})


# --------------------------------------------------------------------------
# what bullet cannot hold
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tx", "match"),
    [
        (optax.sgd(0.1, momentum=0.9), "momentum"),
        (optax.adagrad(0.1), "adagrad"),
        (
            optax.masked(optax.adam(1e-3), {"l0w": True, "l0b": False, "l1w": True, "l1b": True}),
            "l0b",
        ),
        (optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), "learning_rate"),
    ],
    ids=["sgd-momentum", "adagrad", "masked-adam", "injected-hyperparams"],
)
def test_refuses_optimizer_states_bullet_cannot_hold(tmp_path: Path, tx: Any, match: str) -> None:
    params = nnue_params()
    with pytest.raises(ConversionError, match=match) as info:
        ptio.save(
            tmp_path / "ck", {"params": params, "opt_state": tx.init(params)}, format="bullet"
        )
    assert "bullet" in str(info.value)
    assert not (tmp_path / "ck").exists()


def test_load_refuses_a_like_the_file_does_not_fit(tmp_path: Path) -> None:
    params = nnue_params()
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    ptio.save(tmp_path / "ck", {"params": params, "opt_state": tx.init(params)}, format="bullet")
    sgd = optax.sgd(0.1, momentum=0.9)
    with pytest.raises(MismatchError, match="kind 'adamw'") as info:
        ptio.load(tmp_path / "ck", like={"params": params, "opt_state": sgd.init(params)})
    assert info.value.key_path == "opt_state/[0]"
    flipped = {**params, "l0w": params["l0w"].T}  # bullet's l0w is (in, out)
    with pytest.raises(MismatchError, match="shape") as info:
        ptio.load(tmp_path / "ck", like=like_of(tx, flipped))
    assert info.value.key_path == "params/l0w"


def test_unmappable_optimizer_state_is_named_under_opt_state(tmp_path: Path) -> None:
    params = nnue_params()
    state = {"params": params, "opt_state": optax.amsgrad(1e-3).init(params)}
    with pytest.raises(MismatchError, match="ScaleByAmsgradState") as info:
        ptio.save(tmp_path / "ck", state, format="bullet")
    assert info.value.key_path == "opt_state/[0]"
    assert not (tmp_path / "ck").exists()


def test_refuses_params_that_are_not_ids(tmp_path: Path) -> None:
    params = nnue_params()
    clash = {"l0w": params["l0w"], "l0": {"w": params["l0w"]}}
    with pytest.raises(EncodeError, match="l0w") as info:
        ptio.save(tmp_path / "ck", {"params": clash}, format="bullet")
    assert info.value.key_path is not None and "l0" in info.value.key_path
    with pytest.raises(EncodeError, match="list"):
        ptio.save(tmp_path / "ck", {"params": {"l0": [params["l0w"]]}}, format="bullet")
    with pytest.raises(EncodeError, match="float32"):
        ptio.save(tmp_path / "ck", {"params": {"l0w": np.zeros(3, np.int32)}}, format="bullet")
    with pytest.raises(EncodeError):
        ptio.save(tmp_path / "ck", {"params": {}}, format="bullet")
    assert not (tmp_path / "ck").exists()


def test_a_key_besides_params_opt_state_and_step_is_named(tmp_path: Path) -> None:
    params = nnue_params()
    state = {"params": params, "opt_state": optax.adamw(1e-3).init(params)}
    with pytest.raises(EncodeError, match=r"not \['epoch'\]") as refused:
        ptio.save(tmp_path / "a", {**state, "epoch": 3}, format="bullet")
    assert refused.value.key_path == "epoch" and not (tmp_path / "a").exists()
    ptio.save(tmp_path / "b", state, format="bullet")
    with pytest.raises(MismatchError, match=r"not \['epoch'\]") as mismatch:
        ptio.load(tmp_path / "b", like={"params": params, "epoch": 0}, format="bullet")
    assert mismatch.value.key_path == "epoch"
