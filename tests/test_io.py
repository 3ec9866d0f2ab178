"""Atomic saves: a failed save leaves the previous checkpoint and no temporary behind."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import io
from pytreeio.registry import Encoded


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".pytreeio-tmp-" in p.name)


@pytest.mark.parametrize("fmt", ["msgpack", "safetensors"])
def test_unserialisable_leaf_at_the_end_keeps_previous_file(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"ckpt.{fmt}"
    ptio.save(path, {"a": np.ones(3)}, format=fmt)
    before = path.read_bytes()
    with pytest.raises(ptio.EncodeError):
        ptio.save(path, {"a": np.zeros(1 << 16), "zz_last": object()}, format=fmt)
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_write_failing_midway_keeps_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.msgpack"
    ptio.save(path, {"a": np.ones(3)})
    before = path.read_bytes()
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(io.os, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        ptio.save(path, {"a": np.arange(10000.0), "b": np.arange(10000.0), "c": np.arange(10000.0)})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_fsync_failure_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    ptio.save(path, {"a": np.ones(3)})
    before = path.read_bytes()

    def bad_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(io.os, "fsync", bad_fsync)
    with pytest.raises(OSError):
        ptio.save(path, {"a": np.zeros(3)})
    monkeypatch.undo()
    assert path.read_bytes() == before and _leftovers(tmp_path) == []


def test_durable_false_skips_fsync_but_is_still_atomic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    monkeypatch.setattr(io.os, "fsync", lambda fd: synced.append(fd))
    ptio.save(tmp_path / "a.msgpack", {"a": np.ones(2)}, durable=False)
    assert synced == []
    ptio.save(tmp_path / "b.msgpack", {"a": np.ones(2)})
    assert len(synced) == 2  # the file and its directory


def test_directory_writes_replace_the_whole_directory(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    io.write_dir_atomic(
        dest, Encoded(files={"raw.bin": Encoded((b"one",)), "opt/state.bin": Encoded((b"x",))})
    )
    assert (dest / "raw.bin").read_bytes() == b"one" and (
        dest / "opt" / "state.bin"
    ).read_bytes() == b"x"
    io.write_dir_atomic(dest, Encoded(files={"raw.bin": Encoded((b"two",))}))
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == ["raw.bin"]
    assert (dest / "raw.bin").read_bytes() == b"two"
    assert _leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="outside"):
        io.write_dir_atomic(dest, Encoded(files={"../escape": Encoded((b"",))}))
    assert (dest / "raw.bin").read_bytes() == b"two" and not (tmp_path / "escape").exists()
    assert _leftovers(tmp_path) == []


def test_large_chunks_are_written_in_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(io, "_MAX_WRITE", 1000)
    data = np.arange(10000, dtype=np.uint8)
    io.write_file_atomic(tmp_path / "f", Encoded((memoryview(data),)))
    assert (tmp_path / "f").read_bytes() == data.tobytes()


def test_loading_never_mutates_like(tmp_path: Path) -> None:
    like = {"a": np.zeros(4, np.float32), "b": [np.zeros(2, np.int32)]}
    path = tmp_path / "x.msgpack"
    ptio.save(path, {"a": np.ones(4, np.float32), "b": [np.ones(2, np.int32)]})
    out = ptio.load(path, like=like)
    assert like["a"].sum() == 0 and like["b"][0].sum() == 0
    assert out["a"].sum() == 4
    bad = {"a": np.zeros(5, np.float32), "b": [np.zeros(2, np.int32)]}
    with pytest.raises(ptio.MismatchError):
        ptio.load(path, like=bad)
    assert bad["a"].sum() == 0


def test_file_source_counts_and_bounds_reads(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(bytes(range(100)))
    with io.FileSource(p) as src:
        assert bytes(src.read(10, 5, "x")) == bytes(range(10, 15))
        assert src.bytes_read == 5
        with pytest.raises(ptio.FormatError) as e:
            src.read(98, 5, "tail")
        assert e.value.field == "tail" and e.value.offset == 98 and e.value.path == str(p)


def test_parallel_read_of_large_files_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(io, "_PARALLEL_MIN", 0)
    monkeypatch.setattr(io, "_PARALLEL_BLOCK", 4096 + 17)  # blocks that do not divide the size
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    assert bytes(io.read_file(tmp_path / "f")) == data
    tree = {"w": np.arange(50_000, dtype=np.float32)}
    ptio.save(tmp_path / "t.msgpack", tree)
    assert ptio.load(tmp_path / "t.msgpack")["w"].tobytes() == tree["w"].tobytes()


def test_directory_swap_without_renameat2_falls_back_to_two_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(io, "_exchange", lambda a, b: False)
    dest = tmp_path / "ckpt"
    io.write_dir_atomic(dest, Encoded(files={"a.bin": Encoded((b"old",))}))
    io.write_dir_atomic(dest, Encoded(files={"b.bin": Encoded((b"new",))}))
    assert sorted(p.name for p in dest.iterdir()) == ["b.bin"]
    assert (dest / "b.bin").read_bytes() == b"new" and _leftovers(tmp_path) == []


def test_renameat2_exchange_swaps_directories(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    if not io._exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this kernel/filesystem")
    assert (b / "x").read_text() == "from a" and not (a / "x").exists()


def test_replacing_a_file_keeps_its_permissions(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.msgpack"
    ptio.save(path, {"a": np.ones(1)})
    os.chmod(path, 0o600)
    ptio.save(path, {"a": np.zeros(1)})
    assert (path.stat().st_mode & 0o777) == 0o600
    assert ptio.load(path)["a"].tolist() == [0.0]
