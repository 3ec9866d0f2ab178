"""save_async: background writes that snapshot the tree, keep per-destination order, report errors."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import async_save, io
from pytreeio.io import atomic


def _tree(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "dense": {
                "kernel": rng.standard_normal((64, 32), dtype=np.float32),
                "bias": rng.standard_normal(32).astype(np.float16),
            },
            "big": rng.integers(0, 2**31, size=300_000, dtype=np.int64),
        },
        "step": 7,
        "ids": [np.arange(5, dtype=np.uint8), None],
    }


def _assert_same(a: Any, b: Any) -> None:
    fa, fb = ptio.flatten(a), ptio.flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = fa[k], fb[k]
        if isinstance(x, np.ndarray | np.generic) or isinstance(y, np.ndarray | np.generic):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert x.tobytes() == y.tobytes(), k
        else:
            assert x == y, k


@pytest.mark.parametrize("suffix", [".msgpack", ".safetensors"])
def test_result_is_bit_exact_and_same_bytes_as_save(tmp_path: Path, suffix: str) -> None:
    tree = _tree()
    fut = ptio.save_async(tmp_path / f"a{suffix}", tree)
    assert isinstance(fut, ptio.SaveFuture)
    assert fut.result() is None
    ptio.save(tmp_path / f"s{suffix}", tree)
    assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"s{suffix}").read_bytes()
    _assert_same(ptio.load(tmp_path / f"a{suffix}", like=tree), tree)


def test_caller_may_mutate_arrays_right_after_the_call(tmp_path: Path) -> None:
    tree = _tree()
    expected = {
        "params": {
            "dense": {k: v.copy() for k, v in tree["params"]["dense"].items()},
            "big": tree["params"]["big"].copy(),
        },
        "step": 7,
        "ids": [tree["ids"][0].copy(), None],
    }
    # Hold the destination's lock so the background write cannot start before we mutate.
    dest = tmp_path / "m.msgpack"
    with atomic._saving([atomic.resolve(dest)], durable=False):
        fut = ptio.save_async(dest, tree)
        tree["params"]["dense"]["kernel"][:] = 0
        tree["params"]["big"] += 1
        tree["ids"][0][:] = 255
        assert not fut.done()
    fut.result()
    _assert_same(ptio.load(dest, like=expected), expected)


def test_saves_to_one_destination_land_in_order(tmp_path: Path) -> None:
    dest = tmp_path / "o.safetensors"
    trees = [{"x": np.full(200_000, i, dtype=np.int32)} for i in range(4)]
    with atomic._saving([atomic.resolve(dest)], durable=False):  # all four queue up behind the lock
        futures = [ptio.save_async(dest, t, durable=False) for t in trees]
    for f in futures:
        f.result()
    assert ptio.load(dest)["x"][0] == 3


def test_sync_save_waits_for_pending_async_save(tmp_path: Path) -> None:
    dest = tmp_path / "w.msgpack"
    release = threading.Event()
    holder_ready = threading.Event()

    def hold_lock() -> None:
        with atomic._saving([atomic.resolve(dest)], durable=False):
            holder_ready.set()
            release.wait(10)

    holder = threading.Thread(target=hold_lock)
    holder.start()
    holder_ready.wait(10)
    fut = ptio.save_async(dest, {"v": np.array([1])})
    release.set()
    holder.join()
    ptio.save(dest, {"v": np.array([2])})  # must land after the async one
    assert fut.done()
    assert ptio.load(dest)["v"][0] == 2


def test_a_different_spelling_of_the_destination_is_the_same_destination(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    dest = tmp_path / "sub" / "c.msgpack"
    other = tmp_path / "sub" / ".." / "sub" / "c.msgpack"
    assert async_save._dest_key(dest) == async_save._dest_key(other)


def test_encode_error_raises_before_returning(tmp_path: Path) -> None:
    with pytest.raises(ptio.EncodeError):
        ptio.save_async(tmp_path / "bad.safetensors", {"c": 1 + 2j})
    with pytest.raises(TypeError):
        ptio.save_async(tmp_path / "bad.msgpack", {"x": np.zeros(2)}, no_such_option=1)
    assert not list(tmp_path.iterdir())


def test_io_error_surfaces_through_the_future(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        missing = tmp_path / "no" / "such" / "dir" / "x.msgpack"  # root ignores permissions
        fut = ptio.save_async(missing, {"x": np.zeros(3)})
        with pytest.raises(FileNotFoundError):
            fut.result()
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        fut = ptio.save_async(ro / "x.msgpack", {"x": np.zeros(3)})
        with pytest.raises(PermissionError):
            fut.result()
    finally:
        ro.chmod(0o700)


def test_unlooked_at_failure_is_raised_by_wait_saves(tmp_path: Path) -> None:
    ptio.wait_saves()
    ptio.save_async(tmp_path / "nowhere" / "x.msgpack", {"x": np.zeros(1)})
    with pytest.raises(FileNotFoundError):
        ptio.wait_saves()
    ptio.wait_saves()  # reported once


def test_failure_seen_through_result_is_not_raised_again(tmp_path: Path) -> None:
    ptio.wait_saves()
    fut = ptio.save_async(tmp_path / "nowhere" / "x.msgpack", {"x": np.zeros(1)})
    assert isinstance(fut.exception(), FileNotFoundError)
    ptio.wait_saves()


def test_load_after_result_sees_the_new_file(tmp_path: Path) -> None:
    dest = tmp_path / "n.msgpack"
    ptio.save(dest, {"a": np.zeros(4, np.float32)})
    fut = ptio.save_async(dest, {"a": np.ones(4, np.float32)})
    fut.result()
    np.testing.assert_array_equal(ptio.load(dest)["a"], np.ones(4, np.float32))


def test_sibling_and_directory_layouts(tmp_path: Path) -> None:
    # Multi-file encodings are snapshotted file by file.
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    fmt = ptio.list_formats()["msgpack"]
    encoded = ptio.encode(tree, format=fmt)
    snap = async_save._snapshot(ptio.Encoded(files={"a": encoded, "b": encoded}))
    assert snap.files is not None
    assert snap.files["a"].tobytes() == encoded.tobytes() == snap.files["b"].tobytes()
    tree["w"][:] = -1
    assert snap.files["a"].tobytes() != ptio.encode(tree, format=fmt).tobytes()


def test_cannot_be_cancelled(tmp_path: Path) -> None:
    dest = tmp_path / "k.msgpack"
    with atomic._saving([atomic.resolve(dest)], durable=False):
        fut = ptio.save_async(dest, {"x": np.zeros(2)})
        assert fut.cancel() is False
    fut.result()
    assert dest.exists()


def test_program_ending_right_after_save_async_still_writes(tmp_path: Path) -> None:
    dest = tmp_path / "exit.msgpack"
    code = (
        "import numpy as np, pytreeio as ptio, sys\n"
        f"ptio.save_async({str(dest)!r}, {{'x': np.arange(1_000_000)}})\n"
        "sys.exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    np.testing.assert_array_equal(ptio.load(dest)["x"], np.arange(1_000_000))


def test_jax_arrays(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    tree = {
        "w": jnp.arange(1000, dtype=jnp.float32).reshape(10, 100),
        "b": jnp.ones(7, dtype=jnp.bfloat16),
        "key": jax.random.key(3),
        "n": 3,
    }
    for suffix in (".msgpack", ".safetensors"):
        dest = tmp_path / f"j{suffix}"
        ptio.save_async(dest, tree).result()
        out = ptio.load(dest, like=tree)
        assert isinstance(out["w"], jax.Array)
        np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(tree["w"]))
        assert out["b"].dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(out["key"])),
            np.asarray(jax.random.key_data(tree["key"])),
        )
        assert out["n"] == 3


def test_write_error_surfaces_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    dest = tmp_path / "full.msgpack"
    ptio.save(dest, {"x": np.zeros(3)})
    before = dest.read_bytes()

    def disk_full(fd: int, chunks: Any, *_: Any) -> None:  # (fd, chunks, writeback)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "_write_chunks", disk_full)
    fut = ptio.save_async(dest, {"x": np.ones(3)})
    with pytest.raises(OSError) as info:
        fut.result()
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == os.fspath(dest)
    assert dest.read_bytes() == before


def test_snapshot_copied_in_blocks_on_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(async_save, "_PARALLEL_COPY_MIN", 0)
    monkeypatch.setattr(async_save, "_COPY_BLOCK", 4096 + 7)  # blocks straddle the arrays
    tree = _tree(3)
    encoded = ptio.encode(tree, format="safetensors")
    snap = async_save._snapshot(encoded)
    assert snap.tobytes() == encoded.tobytes()
    dest = tmp_path / "blocks.safetensors"
    ptio.save_async(dest, tree).result()
    assert dest.read_bytes() == encoded.tobytes()


# --------------------------------------------------------------------------
# encodings with deferred chunks (streamed tensors, a late checksum header)
# --------------------------------------------------------------------------


def test_deferred_chunks_are_produced_before_returning(tmp_path: Path) -> None:
    """Streamed leaves (read from an open file when written) and safetensors' late header:
    the file is ``save``'s, bit for bit, although the source changes right after the call."""
    from pytreeio.core.binary import Deferred, Slot, Streamed
    from pytreeio.core.records import FILE
    from pytreeio.core.tree import map_leaves
    from pytreeio.formats import safetensors

    tree = _tree(5)
    src_path = tmp_path / "src.safetensors"
    ptio.save(src_path, tree)
    ptio.save(tmp_path / "want.safetensors", tree)
    source = io.open_source(src_path, FILE, headers=True)
    try:
        slots = safetensors.slots(source)

        def stream(leaf: Any) -> Any:  # as a streaming convert does: large plain slots
            if not isinstance(leaf, Slot):
                return leaf
            return Streamed(leaf, source) if leaf.convert is None else leaf.read(source)

        streamed = map_leaves(stream, slots.tree)
        encoded = ptio.encode(streamed, format="safetensors")
        assert any(isinstance(c, Deferred) and c.late for c in encoded.chunks)
        assert sum(isinstance(c, Deferred) and not c.late for c in encoded.chunks) >= 3
        fut = ptio.save_async(tmp_path / "a.safetensors", streamed)
        # the source's bytes change under the open descriptor once the call has returned
        size = src_path.stat().st_size
        with open(src_path, "r+b") as f:
            f.seek(size // 2)
            f.write(b"\xa5" * (size - size // 2))
        fut.result()
    finally:
        source.close()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "want.safetensors").read_bytes()
    ptio.verify(tmp_path / "a.safetensors")  # the late header's checksums are the data's


def test_snapshot_of_a_deferred_chunk_of_the_wrong_size_is_an_encode_error() -> None:
    from pytreeio.core.binary import Deferred

    bad = ptio.Encoded(chunks=(b"head", Deferred(5, lambda: b"four")))
    with pytest.raises(ptio.EncodeError, match="4 bytes where 5"):
        async_save._snapshot(bad)
    assert async_save.pending_bytes() == 0


# --------------------------------------------------------------------------
# the bound on memory held by pending saves
# --------------------------------------------------------------------------


def _gated_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make every background write wait for the returned event (the disk is 'slow')."""
    gate = threading.Event()
    real = io.write_atomic

    def slow(*args: Any, **kwargs: Any) -> None:
        assert gate.wait(60), "the test never opened the gate"
        real(*args, **kwargs)

    monkeypatch.setattr(io, "write_atomic", slow)
    return gate


def test_pending_snapshots_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _gated_writes(monkeypatch)
    trees = [{"x": np.full(100_000, i, np.float64)} for i in range(3)]  # 800 kB each
    size = ptio.encode(trees[0], format="msgpack").nbytes
    limit = 2 * size + 1000  # room for two snapshots, not three
    futures = [
        ptio.save_async(tmp_path / f"{i}.msgpack", trees[i], max_pending_bytes=limit)
        for i in range(2)
    ]
    assert async_save.pending_bytes() == 2 * size
    third: list[ptio.SaveFuture] = []
    caller = threading.Thread(
        target=lambda: third.append(
            ptio.save_async(tmp_path / "2.msgpack", trees[2], max_pending_bytes=limit)
        )
    )
    caller.start()
    caller.join(0.5)
    assert caller.is_alive() and not third  # waits: a third snapshot would pass the bound
    assert async_save.pending_bytes() == 2 * size
    gate.set()  # the disk catches up: the earlier saves finish, the third goes ahead
    caller.join(60)
    assert not caller.is_alive() and len(third) == 1
    for fut in [*futures, *third]:
        fut.result()
    ptio.wait_saves()
    assert async_save.pending_bytes() == 0
    for i in range(3):
        np.testing.assert_array_equal(ptio.load(tmp_path / f"{i}.msgpack")["x"], trees[i]["x"])


def test_a_snapshot_larger_than_the_bound_waits_until_nothing_is_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _gated_writes(monkeypatch)
    small = ptio.save_async(tmp_path / "s.msgpack", {"x": np.ones(10)}, max_pending_bytes=0)
    done = threading.Event()

    def big() -> None:
        ptio.save_async(tmp_path / "b.msgpack", {"x": np.zeros(1000)}, max_pending_bytes=10)
        done.set()

    caller = threading.Thread(target=big)
    caller.start()
    assert not done.wait(0.5)  # the small save is pending: the large one waits
    gate.set()
    assert done.wait(60)
    caller.join(60)
    small.result()
    ptio.wait_saves()
    assert ptio.load(tmp_path / "b.msgpack")["x"].shape == (1000,)
    assert async_save.pending_bytes() == 0


def test_failed_writes_and_encodings_release_their_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ptio.EncodeError):
        ptio.save_async(tmp_path / "bad.msgpack", {"x": object()})
    fut = ptio.save_async(tmp_path / "missing" / "a.msgpack", {"x": np.ones(1000)})
    with pytest.raises(OSError):
        fut.result()
    ptio.wait_saves()
    assert async_save.pending_bytes() == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_max_pending_bytes_is_checked(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="max_pending_bytes"):
        ptio.save_async(tmp_path / "a.msgpack", {"x": np.ones(3)}, max_pending_bytes=bad)
    assert not (tmp_path / "a.msgpack").exists()


@pytest.mark.parametrize(
    ("fmt", "dest"),
    [
        ("netcl-params", "params.npz"),
        ("netcl-checkpoint", "ckpt"),
        ("safetensors", "t.safetensors"),
    ],
)
def test_checksums_taken_on_other_threads_are_of_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, dest: str
) -> None:
    # A header recording checksums is written after the data, the checksums taken on pool
    # threads meanwhile. Such headers are made before save_async returns: hashed any later,
    # they would hash arrays the caller has changed since (a file that fails its own check).
    from pytreeio.core import digest
    from pytreeio.formats import safetensors as st

    monkeypatch.setattr(st, "_HASH_WHILE_WRITING", 0)
    real_background = digest.checksums_in_background
    monkeypatch.setattr(  # hashed only when waited for
        digest,
        "checksums_in_background",
        lambda arrays: lambda: {name: digest.array_checksum(a) for name, a in arrays},
    )
    assert real_background is not digest.checksums_in_background
    monkeypatch.setattr(
        "pytreeio.containers.zip.OVERLAP_MIN", 0
    )  # every member hashed while written
    kernel = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    tree = {"params": {"Dense_0": {"kernel": kernel, "bias": np.ones(48, np.float32)}}}
    want = {"params": {"Dense_0": {k: np.array(v) for k, v in tree["params"]["Dense_0"].items()}}}
    fut = ptio.save_async(tmp_path / dest, tree, format=fmt)
    kernel[:] = -1.0  # the caller's arrays change once the call returns
    fut.result()
    options = {"verify": True} if fmt == "safetensors" else {}  # npz: CRC-32 checked anyway
    back = ptio.load(tmp_path / dest, like=want, format=fmt, **options)
    for key, value in ptio.flatten(want).items():
        assert np.array_equal(ptio.flatten(back)[key], value), key
