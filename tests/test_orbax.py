"""pytreeio formats inside orbax's CheckpointManager (``pytreeio.orbax``).

Retention (``max_to_keep``, keep-best), restoring the latest and a given
step, async saving, item metadata and errors, in msgpack, safetensors and
two foreign formats (netcl-checkpoint with an optax AdamW state, cl-waffe2
with a Flax MLP and its Adam state); and a training loop resumed from a
restored step, bit for bit against an uninterrupted run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

ocp = pytest.importorskip("orbax.checkpoint")

import pytreeio as ptio  # noqa: E402
from pytreeio import async_save, io  # noqa: E402
from pytreeio.core.binary import Deferred  # noqa: E402
from pytreeio.core.errors import EncodeError, FormatError, MismatchError  # noqa: E402
from pytreeio.orbax import (  # noqa: E402
    METADATA_NAME,
    PytreeioHandler,
    PytreeioRestore,
    PytreeioSave,
    _prepare,
    _write,
    checkpoint_name,
)


class MLP(nn.Module):
    """Dense_0 (4 -> 8), ReLU, Dense_1 (8 -> 3)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.relu(nn.Dense(8)(x))  # Dense_0: modules are named in call order
        return nn.Dense(3)(h)


MODEL = MLP()
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.normal(size=(16, 4)), jnp.float32)
Y = jnp.asarray(np.sin(_rng.normal(size=(16, 3))), jnp.float32)
PARAMS = MODEL.init(jax.random.PRNGKey(0), X)["params"]

# one optimizer per format, each a kind the format holds
TX = {
    "msgpack": optax.adam(1e-2),
    "safetensors": optax.adam(1e-2),
    "netcl-checkpoint": optax.adamw(1e-2, weight_decay=1e-3),
    "waffe2": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}
OPTIONS: dict[str, dict[str, Any]] = {"waffe2": {"optimizers": True}}
FORMATS = list(TX)


def _trainer(tx: optax.GradientTransformation) -> Any:
    @jax.jit
    def step(state: dict[str, Any]) -> dict[str, Any]:
        grads = jax.grad(lambda p: jnp.mean((MODEL.apply({"params": p}, X) - Y) ** 2))(
            state["params"]
        )
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    return step


_TRAINERS = {fmt: _trainer(tx) for fmt, tx in TX.items()}


def _start(fmt: str) -> dict[str, Any]:
    return {"params": PARAMS, "opt_state": TX[fmt].init(PARAMS)}


def assert_same_bits(a: Any, b: Any) -> None:
    """Same structure (optax NamedTuples included), dtypes, shapes and bytes in every leaf."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"{ta} != {tb}"
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), f"leaf {i}: {x.dtype}{x.shape} {y.dtype}"
        assert x.tobytes() == y.tobytes(), f"leaf {i} differs"


def _manager(directory: Path, **options: Any) -> Any:
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options))


# --------------------------------------------------------------------------
# retention and restore, in four formats
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_manager_keeps_last_two_and_restores_latest_and_given_step(
    fmt: str, tmp_path: Path
) -> None:
    step = _TRAINERS[fmt]
    state = _start(fmt)
    saved = {}
    # async saving is orbax's default; each save's write overlaps the next step
    with _manager(tmp_path, max_to_keep=2, enable_async_checkpointing=True) as mngr:
        for i in range(5):
            state = step(state)
            saved[i] = state
            args = PytreeioSave(state, format=fmt, options=OPTIONS.get(fmt, {}))
            assert mngr.save(i, args=ocp.args.Composite(state=args))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [3, 4]
        assert mngr.latest_step() == 4

    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["3", "4"]
    item = tmp_path / "4" / "state"
    record = json.loads((item / METADATA_NAME).read_text())
    assert record == {"version": 1, "format": fmt, "layout": "single", "path": checkpoint_name(fmt)}
    _assert_only_checkpoint_files(item)
    # the files are ordinary pytreeio checkpoints
    assert ptio.inspect(item / checkpoint_name(fmt), format=fmt).format == fmt

    # a fresh manager (a restarted process): no format argument, `like` of abstract leaves
    like = jax.eval_shape(lambda: _start(fmt))
    with _manager(tmp_path) as mngr:
        latest = mngr.restore(
            mngr.latest_step(), args=ocp.args.Composite(state=PytreeioRestore(like=like))
        )
        assert_same_bits(latest.state, saved[4])
        given = mngr.restore(3, args=ocp.args.Composite(state=PytreeioRestore(like=like)))
        assert_same_bits(given.state, saved[3])
        info = mngr.item_metadata(4).state
        assert info.format == fmt and info.nbytes > 0


def _assert_only_checkpoint_files(item: Path) -> None:
    """The item holds its checkpoint (file, sibling pair or directory) and the record: no locks."""
    # orbax's own commit marker aside (its CheckpointManager writes it on some file systems)
    names = sorted(p.name for p in item.iterdir() if p.name != "commit_success.txt")
    assert METADATA_NAME in names
    assert all(n == METADATA_NAME or n.startswith("checkpoint") for n in names), names
    stray = [p for p in item.rglob("*") if io.reads._OWN_FILE.search(p.name)]  # locks, temporaries
    assert not stray, stray


@pytest.mark.parametrize("use_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("fmt", ["safetensors", "netcl-checkpoint", "waffe2"])
def test_item_directory_holds_no_lock_files(fmt: str, use_async: bool, tmp_path: Path) -> None:
    state = _start(fmt)
    args = PytreeioSave(state, format=fmt, options=OPTIONS.get(fmt, {}))
    with _manager(tmp_path, enable_async_checkpointing=use_async) as mngr:
        mngr.save(0, args=ocp.args.Composite(state=args))
        mngr.wait_until_finished()
    item = tmp_path / "0" / "state"
    _assert_only_checkpoint_files(item)
    # a handler writing again into a directory it wrote before leaves none either
    PytreeioHandler().save(item, args)
    _assert_only_checkpoint_files(item)
    like = jax.eval_shape(lambda: _start(fmt))
    assert_same_bits(PytreeioHandler().restore(item, PytreeioRestore(like=like)), state)


def test_single_item_manager_without_composite(tmp_path: Path) -> None:
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int64(7), "tag": None}
    with _manager(tmp_path) as mngr:
        mngr.save(1, args=PytreeioSave(tree, format="msgpack"))
        mngr.wait_until_finished()
        restored = mngr.restore(1, args=PytreeioRestore(like=tree))
    assert restored["tag"] is None
    assert_same_bits(restored, tree)
    # a fresh manager restores the native tree with no args: orbax records the handler
    with _manager(tmp_path) as mngr:
        native = mngr.restore(1)
    assert_same_bits(native, tree)


def test_keep_best_by_metric_sync_manager(tmp_path: Path) -> None:
    losses = [5.0, 1.0, 4.0, 2.0, 3.0]
    options = {
        "max_to_keep": 2,
        "best_fn": lambda m: m["loss"],
        "best_mode": "min",
        "enable_async_checkpointing": False,
    }
    with _manager(tmp_path, **options) as mngr:
        for i, loss in enumerate(losses):
            tree = {"w": np.full(3, i, np.float32)}
            mngr.save(i, args=PytreeioSave(tree), metrics={"loss": loss})
        assert mngr.all_steps() == [1, 3]
        assert mngr.best_step() == 1
        best = mngr.restore(
            mngr.best_step(), args=PytreeioRestore(like={"w": np.zeros(3, np.float32)})
        )
    np.testing.assert_array_equal(best["w"], np.full(3, 1, np.float32))


def test_several_items_mix_pytreeio_and_orbax_handlers(tmp_path: Path) -> None:
    with _manager(tmp_path) as mngr:
        mngr.save(
            0,
            args=ocp.args.Composite(
                params=PytreeioSave(PARAMS, format="safetensors", meta={"run": "a"}),
                extra=ocp.args.JsonSave({"epoch": 3}),
            ),
        )
        mngr.wait_until_finished()
        out = mngr.restore(
            0,
            args=ocp.args.Composite(
                params=PytreeioRestore(like=jax.eval_shape(lambda: PARAMS)),
                extra=ocp.args.JsonRestore(),
            ),
        )
        assert mngr.item_metadata(0).params.meta["run"] == "a"
    assert out.extra == {"epoch": 3}
    assert_same_bits(out.params, PARAMS)


# --------------------------------------------------------------------------
# async saving: the bytes are the tree's as it was when save returned
# --------------------------------------------------------------------------


def test_prepare_takes_a_snapshot_the_caller_may_overwrite(tmp_path: Path) -> None:
    w = np.arange(8, dtype=np.float32)
    original = w.copy()
    pending = _prepare(PytreeioSave({"w": w, "k": jnp.ones(3)}, format="safetensors"))
    w[:] = -1.0  # the training loop moves on before the background write
    _write(tmp_path, pending)
    restored = ptio.load(tmp_path / "checkpoint.safetensors")
    np.testing.assert_array_equal(restored["w"], original)


def test_snapshot_produces_deferred_chunks_now_then_late_ones_written_last(
    tmp_path: Path,
) -> None:
    # a late chunk (a header recording checksums) may be computed from the caller's arrays:
    # produced in the snapshot, after the rest, and written at its place after the data
    data = np.arange(4, dtype=np.uint8)
    order: list[str] = []

    def shard() -> Any:
        order.append("shard")
        return data  # a view of the caller's array, as a device shard's host copy is

    def header() -> bytes:
        order.append("header")
        return b"HD"

    encoded = ptio.Encoded(
        chunks=(Deferred(2, header, late=True), Deferred(4, shard), memoryview(data))
    )
    owned = async_save._snapshot(encoded)
    assert order == ["shard", "header"]
    data[:] = 9  # the caller moves on
    io.write_atomic(tmp_path / "f", owned, ptio.FILE)
    assert order == ["shard", "header"]  # not produced again
    assert (tmp_path / "f").read_bytes() == b"HD" + bytes(range(4)) * 2
    with pytest.raises(EncodeError, match="declared"):
        async_save._snapshot(ptio.Encoded(chunks=(Deferred(3, shard),)))


def test_async_save_then_overwrite_then_wait(tmp_path: Path) -> None:
    arrays = [np.full(1 << 16, i, np.float32) for i in range(3)]
    with _manager(tmp_path, enable_async_checkpointing=True) as mngr:
        for i in range(3):
            buf = arrays[i]
            mngr.save(i, args=PytreeioSave({"buf": buf}, format="msgpack"))
            buf[:] = 99.0
        mngr.wait_until_finished()
        for i in range(3):
            got = mngr.restore(i, args=PytreeioRestore())
            np.testing.assert_array_equal(got["buf"], np.full(1 << 16, i, np.float32))


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("use_async", [True, False], ids=["async", "sync"])
def test_encode_error_raises_and_commits_nothing(use_async: bool, tmp_path: Path) -> None:
    with _manager(tmp_path, enable_async_checkpointing=use_async) as mngr:
        mngr.save(0, args=PytreeioSave({"w": np.ones(2, np.float32)}))
        mngr.wait_until_finished()
        # async: raised through orbax's commit, from wait_until_finished; sync: from save
        with pytest.raises(EncodeError, match="complex64"):
            mngr.save(1, args=PytreeioSave({"z": np.ones(2, np.complex64)}))
            mngr.wait_until_finished()
        with pytest.raises(TypeError, match="no save option"):
            mngr.save(2, args=PytreeioSave({"w": np.ones(2)}, options={"bogus": 1}))
            mngr.wait_until_finished()
        mngr.save(3, args=PytreeioSave({"w": np.zeros(2, np.float32)}))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 3]
        got = mngr.restore(3, args=PytreeioRestore())
    np.testing.assert_array_equal(got["w"], np.zeros(2, np.float32))


def test_corrupt_checkpoint_names_the_file(tmp_path: Path) -> None:
    with _manager(tmp_path) as mngr:
        mngr.save(0, args=PytreeioSave({"w": np.ones(64, np.float32)}))
        mngr.wait_until_finished()
    ckpt = tmp_path / "0" / "default" / "checkpoint.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:-10])
    with _manager(tmp_path) as mngr, pytest.raises(FormatError) as err:
        mngr.restore(0, args=PytreeioRestore())
    assert err.value.path == str(ckpt)


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({"version": 1, "format": "msgpack", "layout": "single", "path": "../x"}, "path"),
        ({"version": 1, "format": "msgpack", "layout": "per-process", "path": "c"}, "layout"),
        ({"version": 2, "format": "msgpack", "layout": "single", "path": "c"}, "version"),
        ({"version": 1, "layout": "single", "path": "c"}, "format"),
    ],
)
def test_bad_item_record_is_a_format_error(
    record: dict[str, Any], field: str, tmp_path: Path
) -> None:
    (tmp_path / METADATA_NAME).write_text(json.dumps(record))
    with pytest.raises(FormatError) as err:
        PytreeioHandler().restore(tmp_path, PytreeioRestore())
    assert err.value.field == field and err.value.path == str(tmp_path / METADATA_NAME)
    (tmp_path / METADATA_NAME).write_bytes(b'{"version": 1, "for')
    with pytest.raises(FormatError):
        PytreeioHandler().restore(tmp_path, PytreeioRestore())


def test_item_without_record_needs_a_format(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        PytreeioHandler().restore(tmp_path, PytreeioRestore())
    assert err.value.filename == str(tmp_path / METADATA_NAME)
    # a checkpoint put there by other means restores once its format is named
    ptio.save(tmp_path / "checkpoint.msgpack", {"w": np.ones(2, np.float32)})
    got = PytreeioHandler().restore(tmp_path, PytreeioRestore(format="msgpack"))
    np.testing.assert_array_equal(got["w"], np.ones(2, np.float32))


def test_mismatched_like_names_file_and_key(tmp_path: Path) -> None:
    with _manager(tmp_path) as mngr:
        mngr.save(0, args=PytreeioSave({"w": np.ones(3, np.float32)}, format="msgpack"))
        mngr.wait_until_finished()
        with pytest.raises(MismatchError) as err:
            mngr.restore(0, args=PytreeioRestore(like={"w": np.ones(4, np.float32)}))
    assert err.value.key_path == "w" and "checkpoint.msgpack" in str(err.value)


def test_restore_onto_a_sharding(tmp_path: Path) -> None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = {"w": jnp.arange(6, dtype=jnp.float32)}
    handler = PytreeioHandler()
    handler.save(tmp_path, PytreeioSave(tree, format="safetensors"))
    like = {"w": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=sharding)}
    out = handler.restore(tmp_path, PytreeioRestore(like=like))
    assert isinstance(out["w"], jax.Array) and out["w"].sharding == sharding
    assert_same_bits(out, tree)


# --------------------------------------------------------------------------
# resuming a training loop
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "netcl-checkpoint"])
def test_training_resumes_bit_exactly_from_a_restored_step(fmt: str, tmp_path: Path) -> None:
    step = _TRAINERS[fmt]
    reference = _start(fmt)
    for _ in range(6):
        reference = step(reference)

    state = _start(fmt)
    with _manager(tmp_path, max_to_keep=2, save_interval_steps=2) as mngr:
        for i in range(1, 5):  # "crashes" after step 4; steps 2 and 4 are saved
            state = step(state)
            mngr.save(i, args=ocp.args.Composite(state=PytreeioSave(state, format=fmt)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 4]

    with _manager(tmp_path) as mngr:  # a new process: only shapes of the state are known
        at = mngr.latest_step()
        like = jax.eval_shape(lambda: _start(fmt))
        state = mngr.restore(at, args=ocp.args.Composite(state=PytreeioRestore(like=like))).state
    for _ in range(at, 6):
        state = step(state)
    assert_same_bits(state, reference)


def test_import_pytreeio_does_not_import_orbax() -> None:
    code = "import sys, pytreeio; pytreeio.list_formats(); print('orbax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
