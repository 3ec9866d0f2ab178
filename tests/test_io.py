"""pytreeio.io: probes, consistent reads and crash-safe writes (see io's module docstring).

Each test names the guarantee it checks.  Real SIGKILLs and concurrent
processes are in ``test_crash.py``; here the states a kill can leave are
built directly (temporaries, a journal, half-done renames) and the failure
points are forced with monkeypatch.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import io
from pytreeio.core.errors import FormatError
from pytreeio.core.records import DIRECTORY, FILE, Encoded, Siblings
from pytreeio.io import atomic, probes, reads


def _pair(p: Path) -> dict[str, Path]:
    return {"npz": p.with_name(p.name + ".npz"), "json": p.with_name(p.name + ".json")}


SIB = Siblings(locate=_pair, roles=("npz", "json"), linked=("npz", "json"))
UNLINKED = Siblings(locate=_pair, roles=("npz", "json"))


def _enc(data: bytes) -> Encoded:
    return Encoded((data,))


def _pair_enc(npz: bytes, js: bytes) -> Encoded:
    return Encoded(files={"npz": _enc(npz), "json": _enc(js)})


def _leftovers(directory: Path) -> list[str]:
    """pytreeio temporaries and journals."""
    return sorted(
        n for n in os.listdir(directory) if ".pytreeio-tmp-" in n or n.endswith(".pytreeio-journal")
    )


def _read_pair(dest: Path, layout: Siblings = SIB) -> dict[str, bytes]:
    fs = io.open_source(dest, layout)
    try:
        return {k: bytes(v) for k, v in fs.items()}
    finally:
        fs.close()


# --------------------------------------------------------------------------
# failures leave the old checkpoint and no temporary
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["msgpack", "safetensors"])
def test_unserialisable_leaf_at_the_end_keeps_previous_file(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"ckpt.{fmt}"
    ptio.save(path, {"a": np.ones(3)}, format=fmt)
    before = path.read_bytes()
    with pytest.raises(ptio.EncodeError):
        ptio.save(path, {"a": np.zeros(1 << 16), "zz_last": object()}, format=fmt)
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("layout", ["file", "siblings", "dir"])
def test_write_failing_midway_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    dest = tmp_path / "ckpt"
    chunks = (b"x" * 100, b"y" * 100, b"z" * 100)
    if layout == "file":
        lay, old, new = FILE, _enc(b"old"), Encoded(chunks)
    elif layout == "siblings":
        lay, old, new = (
            SIB,
            _pair_enc(b"old", b"o"),
            Encoded(files={"npz": Encoded(chunks[:1]), "json": Encoded(chunks[1:])}),
        )
    else:
        lay, old = DIRECTORY, Encoded(files={"a": _enc(b"old")})
        new = Encoded(files={"a": Encoded(chunks[:2]), "b/c": Encoded(chunks[2:])})
    io.write_atomic(dest, old, lay)
    before = _snapshot(tmp_path)
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        io.write_atomic(dest, new, lay)
    monkeypatch.undo()
    assert _snapshot(tmp_path) == before
    assert _leftovers(tmp_path) == []


def _snapshot(directory: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            out[p.relative_to(directory).as_posix()] = p.read_bytes()
    return out


@pytest.mark.parametrize("layout", ["file", "siblings"])
def test_fsync_failure_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    dest = tmp_path / "ckpt"
    lay, old, new = (
        (FILE, _enc(b"old"), _enc(b"new"))
        if layout == "file"
        else (SIB, _pair_enc(b"old", b"o"), _pair_enc(b"new", b"n"))
    )
    io.write_atomic(dest, old, lay)
    before = _snapshot(tmp_path)

    def bad_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", bad_fsync)
    with pytest.raises(OSError):
        io.write_atomic(dest, new, lay)
    monkeypatch.undo()
    assert _snapshot(tmp_path) == before and _leftovers(tmp_path) == []


def test_durable_false_skips_every_fsync_but_is_still_atomic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    io.write_atomic(tmp_path / "a", _enc(b"a"), FILE, durable=False)
    io.write_atomic(tmp_path / "p", _pair_enc(b"n", b"j"), SIB, durable=False)
    io.write_atomic(tmp_path / "d", Encoded(files={"x/y": _enc(b"1")}), DIRECTORY, durable=False)
    io.write_atomic(tmp_path / "d", Encoded(files={"x/y": _enc(b"2")}), DIRECTORY, durable=False)
    assert synced == []
    io.write_atomic(tmp_path / "b", _enc(b"b"), FILE)
    assert len(synced) == 2  # the file and its directory
    synced.clear()
    io.write_atomic(tmp_path / "p", _pair_enc(b"n", b"j"), SIB)
    assert len(synced) == 5  # two files, the journal, the directory after it and after the renames
    assert _read_pair(tmp_path / "p") == {"npz": b"n", "json": b"j"}
    assert (tmp_path / "d" / "x" / "y").read_bytes() == b"2" and _leftovers(tmp_path) == []


def test_replacing_keeps_permission_bits(tmp_path: Path) -> None:
    f = tmp_path / "ckpt.msgpack"
    io.write_atomic(f, _enc(b"1"), FILE)
    os.chmod(f, 0o600)
    io.write_atomic(f, _enc(b"2"), FILE)
    assert (f.stat().st_mode & 0o777) == 0o600 and f.read_bytes() == b"2"
    io.write_atomic(tmp_path / "p", _pair_enc(b"1", b"1"), SIB)
    os.chmod(tmp_path / "p.json", 0o640)
    io.write_atomic(tmp_path / "p", _pair_enc(b"2", b"2"), SIB)
    assert (tmp_path / "p.json").stat().st_mode & 0o777 == 0o640


def test_large_chunks_are_written_in_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic, "_MAX_WRITE", 1000)
    data = np.arange(10000, dtype=np.uint8)
    io.write_file_atomic(tmp_path / "f", Encoded((memoryview(data),)))
    assert (tmp_path / "f").read_bytes() == data.tobytes()


def test_wrong_encodings_and_locate_results_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        io.write_atomic(tmp_path / "f", _pair_enc(b"", b""), FILE)
    with pytest.raises(TypeError):
        io.write_atomic(tmp_path / "f", _enc(b""), SIB)
    with pytest.raises(TypeError):
        io.write_atomic(tmp_path / "f", _enc(b""), DIRECTORY)
    with pytest.raises(ValueError, match="linked"):
        io.write_atomic(tmp_path / "f", Encoded(files={"npz": _enc(b"")}), SIB)
    with pytest.raises(ValueError, match="roles"):
        io.write_atomic(tmp_path / "f", Encoded(files={"zzz": _enc(b"")}), UNLINKED)
    apart = Siblings(
        locate=lambda p: {"a": p.parent / "x" / "a", "b": p.parent / "b"}, roles=("a", "b")
    )
    (tmp_path / "x").mkdir()
    with pytest.raises(ValueError, match="one directory"):
        io.write_atomic(tmp_path / "f", Encoded(files={"a": _enc(b""), "b": _enc(b"")}), apart)
    with pytest.raises(FileNotFoundError, match="No such directory"):
        io.write_atomic(tmp_path / "nope" / "f", _enc(b""), FILE)
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------
# directories
# --------------------------------------------------------------------------


def test_directory_writes_replace_the_whole_directory(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    io.write_dir_atomic(
        dest, Encoded(files={"raw.bin": Encoded((b"one",)), "opt/state.bin": Encoded((b"x",))})
    )
    assert (dest / "raw.bin").read_bytes() == b"one"
    assert (dest / "opt" / "state.bin").read_bytes() == b"x"
    io.write_dir_atomic(dest, Encoded(files={"raw.bin": Encoded((b"two",))}))
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == ["raw.bin"]
    assert (dest / "raw.bin").read_bytes() == b"two"
    assert _leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="outside"):
        io.write_dir_atomic(dest, Encoded(files={"../escape": Encoded((b"",))}))
    assert (dest / "raw.bin").read_bytes() == b"two" and not (tmp_path / "escape").exists()
    assert _leftovers(tmp_path) == []
    (tmp_path / "plain").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        io.write_atomic(tmp_path / "plain", Encoded(files={"a": _enc(b"")}), DIRECTORY)
    with pytest.raises(IsADirectoryError):
        io.write_atomic(dest, _enc(b""), FILE)


def test_renameat2_exchange_swaps_directories(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    if not atomic._exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this kernel/filesystem")
    assert (b / "x").read_text() == "from a" and not (a / "x").exists()


def test_directory_swap_without_renameat2_falls_back_to_two_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    dest = tmp_path / "ckpt"
    io.write_dir_atomic(dest, Encoded(files={"a.bin": Encoded((b"old",))}))
    io.write_dir_atomic(dest, Encoded(files={"b.bin": Encoded((b"new",))}))
    assert sorted(p.name for p in dest.iterdir()) == ["b.bin"]
    assert (dest / "b.bin").read_bytes() == b"new" and _leftovers(tmp_path) == []


def test_directory_fallback_rolls_back_when_the_second_rename_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "ckpt"
    io.write_dir_atomic(dest, Encoded(files={"a.bin": Encoded((b"old",))}))
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    real_rename = os.rename
    calls: list[tuple[str, str]] = []

    def rename(src: str, dst: str) -> None:
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:  # tmp -> dest, after dest -> old
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output"):
        io.write_dir_atomic(dest, Encoded(files={"b.bin": Encoded((b"new",))}))
    monkeypatch.undo()
    assert calls[0][0] == "ckpt" and calls[1][1] == "ckpt" and calls[2][1] == "ckpt"
    assert sorted(p.name for p in dest.iterdir()) == ["a.bin"]
    assert (dest / "a.bin").read_bytes() == b"old" and _leftovers(tmp_path) == []


def test_directory_fallback_that_cannot_roll_back_is_finished_by_the_next_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both renames back fail (as a kill between them would leave it): the journal completes it."""
    dest = tmp_path / "ckpt"
    io.write_dir_atomic(dest, Encoded(files={"a.bin": Encoded((b"old",))}))
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    real_rename = os.rename
    calls = {"n": 0}

    def rename(src: str, dst: str) -> None:
        calls["n"] += 1
        if calls["n"] >= 2:
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="half-way"):
        io.write_dir_atomic(dest, Encoded(files={"b.bin": Encoded((b"new",))}))
    monkeypatch.undo()
    assert not dest.exists() and (tmp_path / ".ckpt.pytreeio-journal").exists()
    with io.open_source(dest, DIRECTORY) as fs:
        assert {k: bytes(v) for k, v in fs.items()} == {"b.bin": b"new"}
    assert _leftovers(tmp_path) == []


def test_directory_reads_are_a_snapshot(tmp_path: Path) -> None:
    """Files are opened under the lock; a save swapping the directory later does not mix in."""
    dest = tmp_path / "ckpt"
    io.write_atomic(dest, Encoded(files={"a": _enc(b"1"), "s/b": _enc(b"1")}), DIRECTORY)
    fs = io.open_source(dest, DIRECTORY)
    io.write_atomic(dest, Encoded(files={"a": _enc(b"2"), "s/b": _enc(b"2")}), DIRECTORY)
    assert {k: bytes(v) for k, v in fs.items()} == {"a": b"1", "s/b": b"1"}
    fs.close()
    with io.open_source(dest, DIRECTORY, headers=True) as fs:
        src = fs["s/b"]
        assert isinstance(src, io.FileSource) and bytes(src.read(0, 1, "x")) == b"2"
        src.close()


def test_directory_beyond_the_eagerly_opened_files_reads_relative_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "_EAGER_OPEN", 1)
    dest = tmp_path / "ckpt"
    io.write_atomic(dest, Encoded(files={"a": _enc(b"1"), "b": _enc(b"1")}), DIRECTORY)
    with io.open_source(dest, DIRECTORY) as fs:
        assert len(fs._fds) == 1
        assert bytes(fs["b"]) == b"1"
        io.write_atomic(dest, Encoded(files={"a": _enc(b"2"), "b": _enc(b"2")}), DIRECTORY)
        # the directory read is gone: never the new file, a precise error instead
        with pytest.raises(FileNotFoundError) as e:
            fs["b"]
        assert e.value.filename == str(dest / "b")
        assert bytes(fs["a"]) == b"1"


# --------------------------------------------------------------------------
# sibling sets: lock, journal, roll-forward
# --------------------------------------------------------------------------


def test_saves_and_loads_leave_only_the_checkpoints_files(tmp_path: Path) -> None:
    """The lock is the directory's own flock: no lock file stays beside any layout."""
    for _ in range(2):
        io.write_atomic(tmp_path / "f", _enc(b"1"), FILE)
        io.write_atomic(tmp_path / "x", _pair_enc(b"npz1", b"json1"), SIB)
        io.write_atomic(tmp_path / "d", Encoded(files={"a/b": _enc(b"1")}), DIRECTORY)
    assert _read_pair(tmp_path / "x") == {"npz": b"npz1", "json": b"json1"}
    io.open_source(tmp_path / "d", DIRECTORY).close()
    assert sorted(os.listdir(tmp_path)) == ["d", "f", "x.json", "x.npz"]
    assert [p.name for p in (tmp_path / "d").rglob("*")] == ["a", "b"]


def _dead_save(dest: Path, npz: bytes, js: bytes, renamed: int) -> None:
    """The state a saver killed after committing and ``renamed`` renames leaves."""
    files = _pair(dest)
    temps = []
    for (_role, final), data in zip(files.items(), (npz, js)):
        tmp = atomic._tmp_name(atomic.resolve(final))
        tmp.write_bytes(data)
        temps.append((tmp, atomic.resolve(final), None))
    atomic._write_journal(atomic.resolve(files["npz"]), temps, durable=False)
    for tmp, final, _ in temps[:renamed]:
        os.replace(tmp, final)


@pytest.mark.parametrize("renamed", [0, 1, 2])
def test_a_dead_savers_journal_is_rolled_forward_by_the_next_load(
    tmp_path: Path, renamed: int
) -> None:
    dest = tmp_path / "x"
    io.write_atomic(dest, _pair_enc(b"old-npz", b"old-json"), SIB)
    _dead_save(dest, b"new-npz", b"new-json", renamed)
    assert _read_pair(dest) == {"npz": b"new-npz", "json": b"new-json"}
    assert _leftovers(tmp_path) == []


def test_a_dead_savers_journal_is_rolled_forward_by_the_next_save(tmp_path: Path) -> None:
    dest = tmp_path / "x"
    io.write_atomic(dest, _pair_enc(b"old-npz", b"old-json"), SIB)
    _dead_save(dest, b"new-npz", b"new-json", 1)
    io.write_atomic(dest, Encoded(files={"npz": _enc(b"3"), "json": _enc(b"3")}), SIB)
    assert _read_pair(dest) == {"npz": b"3", "json": b"3"} and _leftovers(tmp_path) == []


def test_when_it_cannot_roll_forward_a_load_reads_the_journaled_temporaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E.g. a read-only directory: the new set is read from where the journal says it is."""
    dest = tmp_path / "x"
    io.write_atomic(dest, _pair_enc(b"old-npz", b"old-json"), SIB)
    _dead_save(dest, b"new-npz", b"new-json", 1)
    monkeypatch.setattr(atomic, "_roll_forward", lambda journal: False)
    fs = io.open_source(dest, SIB)
    assert {k: bytes(v) for k, v in fs.items()} == {"npz": b"new-npz", "json": b"new-json"}
    assert fs.path_of("json") == str(dest) + ".json"  # errors still name the real file
    fs.close()
    assert (tmp_path / ".x.npz.pytreeio-journal").exists()


def test_unlinked_siblings_are_opened_without_locks_or_journals(tmp_path: Path) -> None:
    dest = tmp_path / "x"
    (tmp_path / "x.npz").write_bytes(b"n")
    assert _read_pair(dest, UNLINKED) == {"npz": b"n"}
    assert sorted(os.listdir(tmp_path)) == ["x.npz"]  # a load creates nothing


def test_a_planted_journal_renames_nothing_and_the_next_save_drops_it(tmp_path: Path) -> None:
    dest = tmp_path / "x"
    io.write_atomic(dest, _pair_enc(b"n", b"j"), SIB)
    (tmp_path / "victim").write_bytes(b"keep")
    (tmp_path / ".victim2.pytreeio-tmp-1-00000000").write_bytes(b"evil")
    journal = tmp_path / ".x.npz.pytreeio-journal"
    for renames in (
        [["victim", "x.npz", None]],  # not a temporary of x.npz
        [["../victim", "x.npz", None]],
        [[".victim2.pytreeio-tmp-1-00000000", "victim2", None]],  # journal name mismatch
    ):
        journal.write_text(
            json.dumps({"pytreeio": "journal", "version": 1, "renames": renames, "remove": []})
        )
        assert _read_pair(dest) == {"npz": b"n", "json": b"j"}
        assert (tmp_path / "victim").read_bytes() == b"keep"
    journal.write_text("{not json")
    assert _read_pair(dest) == {"npz": b"n", "json": b"j"}
    io.write_atomic(dest, _pair_enc(b"n2", b"j2"), SIB)
    assert not journal.exists() and (tmp_path / "victim").read_bytes() == b"keep"


def test_failure_after_the_commit_point_finishes_the_new_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "x"
    io.write_atomic(dest, _pair_enc(b"old", b"old"), SIB)
    calls = {"n": 0}
    real = atomic._rename

    def rename(src: Path, dst: Path) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(atomic, "_rename", rename)
    with pytest.raises(KeyboardInterrupt):
        io.write_atomic(dest, _pair_enc(b"new", b"new"), SIB)
    monkeypatch.undo()
    assert _read_pair(dest) == {"npz": b"new", "json": b"new"} and _leftovers(tmp_path) == []


def test_a_saver_waits_for_the_lock_and_a_reader_for_the_saver(tmp_path: Path) -> None:
    dest = tmp_path / "x"
    io.write_atomic(dest, _pair_enc(b"1", b"1"), SIB)
    held = atomic._lock_dirs([tmp_path], exclusive=True)
    done = threading.Event()

    def save() -> None:
        io.write_atomic(dest, _pair_enc(b"2", b"2"), SIB)
        done.set()

    t = threading.Thread(target=save)
    t.start()
    time.sleep(0.3)
    assert not done.is_set() and (tmp_path / "x.npz").read_bytes() == b"1"
    got: list[dict[str, bytes]] = []
    r = threading.Thread(target=lambda: got.append(_read_pair(dest)))
    r.start()
    time.sleep(0.2)
    assert got == []  # the reader waits too
    reads.release(held)
    t.join(5)
    r.join(5)
    assert done.is_set() and got and got[0]["npz"] == got[0]["json"]
    assert _read_pair(dest) == {"npz": b"2", "json": b"2"}


def test_concurrent_saves_and_loads_in_threads_never_mix(tmp_path: Path) -> None:
    dest = tmp_path / "x"
    io.write_atomic(dest, _pair_enc(b"0" * 5000, b"0" * 100), SIB, durable=False)
    stop = threading.Event()
    errors: list[BaseException] = []

    def saver(tag: bytes) -> None:
        try:
            for _ in range(40):
                io.write_atomic(dest, _pair_enc(tag * 5000, tag * 100), SIB, durable=False)
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                got = _read_pair(dest)
                assert got["npz"] == got["npz"][:1] * 5000, "torn npz"
                assert got["json"] == got["npz"][:1] * 100, f"mixed pair {got['npz'][:1]!r}"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(t,)) for t in (b"A", b"B")]
    rd = threading.Thread(target=reader)
    rd.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stop.set()
    rd.join(30)
    assert errors == []
    assert _leftovers(tmp_path) == []


def _waffe2_tree(value: float, width: int) -> dict[str, Any]:
    return {
        "param": {
            "linearlayer": {
                str(i): {
                    "weights": np.full(width * 4, value, np.float32),
                    "bias": np.full(width, value, np.float32),
                }
                for i in range(3)
            }
        }
    }


def _values(tree: Any) -> set[float]:
    layers = tree["param"]["linearlayer"].values()
    return {float(v) for layer in layers for a in layer.values() for v in np.unique(a)}


@pytest.fixture
def lazy_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cl-waffe2 directory of which a FileSet opens one file up front, the rest on access."""
    monkeypatch.setattr(reads, "_EAGER_OPEN", 1)
    path = tmp_path / "m.wf2model"
    ptio.save(path, _waffe2_tree(1.0, 4), format="waffe2")
    return path


def test_a_load_meeting_a_replaced_directory_reads_the_new_one_whole(
    lazy_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save between a load's opening of a directory and its reading of the files opened on
    access removes them: the load opens the checkpoint again, never mixes or fails."""
    real = io.open_source
    calls: list[int] = []

    def replaced_once(*args: Any, **kwargs: Any) -> Any:
        opened = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            ptio.save(lazy_dir, _waffe2_tree(2.0, 8), format="waffe2", durable=False)
        return opened

    monkeypatch.setattr(io, "open_source", replaced_once)
    got = ptio.load(lazy_dir, format="waffe2")
    assert len(calls) == 2 and _values(got) == {2.0}
    assert got["param"]["linearlayer"]["0"]["bias"].shape == (8,)

    def replaced_always(*args: Any, **kwargs: Any) -> Any:
        opened = real(*args, **kwargs)
        calls.append(1)
        ptio.save(lazy_dir, _waffe2_tree(float(len(calls)), 4), format="waffe2", durable=False)
        return opened

    calls.clear()
    monkeypatch.setattr(io, "open_source", replaced_always)
    with pytest.raises(io.ChangedWhileOpen, match="gone since the checkpoint was opened") as e:
        ptio.load(lazy_dir, format="waffe2")
    assert isinstance(e.value, FileNotFoundError) and str(lazy_dir) in str(e.value.filename)
    assert len(calls) == 3  # opened three times in all, then it gives up


def test_inspect_meeting_a_replaced_directory_reads_the_new_one(
    lazy_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = io.open_source
    opens: list[int] = []

    def opened_then_replaced(*args: Any, **kwargs: Any) -> Any:
        source = real(*args, **kwargs)
        opens.append(1)
        if len(opens) == 1:
            ptio.save(lazy_dir, _waffe2_tree(2.0, 8), format="waffe2", durable=False)
        return source

    monkeypatch.setattr(io, "open_source", opened_then_replaced)
    info = ptio.inspect(lazy_dir, format="waffe2")
    assert len(opens) == 2
    assert {e.shape for e in info.entries} == {(8,), (32,)}


def test_identity_changes_with_a_save_and_not_with_a_read(tmp_path: Path) -> None:
    dest = tmp_path / "x"
    assert io.identity(dest, SIB) == (None, None)  # neither sibling yet
    io.write_atomic(dest, _pair_enc(b"1", b"1"), SIB)
    first = io.identity(dest, SIB)
    assert None not in first and io.identity(dest, SIB) == first
    _read_pair(dest)
    assert io.identity(dest, SIB) == first  # reading changes nothing
    io.write_atomic(dest, _pair_enc(b"2", b"2"), SIB)
    assert io.identity(dest, SIB) != first  # new files renamed into place
    d = tmp_path / "d"
    io.write_atomic(d, Encoded(files={"a.bin": _enc(b"1")}), DIRECTORY)
    before = io.identity(d, DIRECTORY)
    io.write_atomic(d, Encoded(files={"a.bin": _enc(b"2")}), DIRECTORY)
    assert io.identity(d, DIRECTORY) != before  # another directory swapped in


def test_a_lazy_view_keeps_reading_the_directory_it_opened(lazy_dir: Path) -> None:
    """Its files are held open from its opening on: a save that replaces the checkpoint
    meanwhile does not change what it reads."""
    with ptio.open(lazy_dir, format="waffe2") as ckpt:
        ptio.save(lazy_dir, _waffe2_tree(2.0, 8), format="waffe2", durable=False)
        assert {float(v) for key in ckpt for v in np.unique(ckpt[key])} == {1.0}
    assert _values(ptio.load(lazy_dir, format="waffe2")) == {2.0}


# --------------------------------------------------------------------------
# stale temporaries, symlinks, long names
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["file", "siblings", "dir"])
def test_temporaries_of_dead_saves_are_removed_by_the_next_save(
    tmp_path: Path, layout: str
) -> None:
    dest = tmp_path / "ckpt"
    stale = [
        ".ckpt.pytreeio-tmp-12345-0badcafe",
        ".ckpt.npz.pytreeio-tmp-1-deadbeef",
        ".ckpt.json.pytreeio-tmp-99-00000000",
    ]
    keep = [
        ".other.pytreeio-tmp-1-deadbeef",  # another destination's
        ".ckpt.pytreeio-tmp-notours",  # not our pattern
        "ckpt.pytreeio-tmp-1-deadbeef",  # no leading dot
    ]
    for name in stale + keep:
        (tmp_path / name).write_bytes(b"x" * 10)
    (tmp_path / ".ckpt.pytreeio-tmp-7-11111111").mkdir()  # a dead directory save's tree
    (tmp_path / ".ckpt.pytreeio-tmp-7-11111111" / "raw.bin").write_bytes(b"x")
    if layout == "file":
        io.write_atomic(dest, _enc(b"new"), FILE)
        expect_gone = [stale[0], ".ckpt.pytreeio-tmp-7-11111111"]
    elif layout == "siblings":
        io.write_atomic(dest, _pair_enc(b"n", b"j"), SIB)
        expect_gone = stale[1:]
    else:
        io.write_atomic(dest, Encoded(files={"a": _enc(b"1")}), DIRECTORY)
        expect_gone = [stale[0], ".ckpt.pytreeio-tmp-7-11111111"]
    names = set(os.listdir(tmp_path))
    assert not names & set(expect_gone)
    assert set(keep) <= names


@pytest.mark.parametrize("layout", ["file", "siblings", "dir"])
def test_a_symlinked_destination_is_written_through(tmp_path: Path, layout: str) -> None:
    if layout == "file":
        (tmp_path / "ckpt_100").write_bytes(b"old")
        (tmp_path / "latest").symlink_to("ckpt_100")
        io.write_atomic(tmp_path / "latest", _enc(b"new"), FILE)
        assert (tmp_path / "ckpt_100").read_bytes() == b"new"
        assert bytes(io.open_source(tmp_path / "latest", FILE)) == b"new"
        links = ["latest"]
    elif layout == "siblings":
        io.write_atomic(tmp_path / "ckpt_100", _pair_enc(b"old", b"old"), SIB)
        (tmp_path / "latest.npz").symlink_to("ckpt_100.npz")
        (tmp_path / "latest.json").symlink_to(tmp_path / "ckpt_100.json")
        io.write_atomic(tmp_path / "latest", _pair_enc(b"new", b"new"), SIB)
        assert _read_pair(tmp_path / "ckpt_100") == {"npz": b"new", "json": b"new"}
        assert _read_pair(tmp_path / "latest") == {"npz": b"new", "json": b"new"}
        links = ["latest.npz", "latest.json"]
    else:
        io.write_atomic(tmp_path / "ckpt_100", Encoded(files={"a": _enc(b"old")}), DIRECTORY)
        (tmp_path / "latest").symlink_to("ckpt_100")
        io.write_atomic(tmp_path / "latest", Encoded(files={"b": _enc(b"new")}), DIRECTORY)
        assert sorted(os.listdir(tmp_path / "ckpt_100")) == ["b"]
        assert io.probe(tmp_path / "latest", DIRECTORY).names == {"b"}
        with io.open_source(tmp_path / "latest", DIRECTORY) as fs:
            assert {k: bytes(v) for k, v in fs.items()} == {"b": b"new"}
        links = ["latest"]
    for link in links:
        assert (tmp_path / link).is_symlink()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("name", ["n" * 250, "é" * 124 + "x"])
def test_temporary_names_stay_within_name_max(tmp_path: Path, name: str) -> None:
    assert len(os.fsencode(name + ".json")) in (254, 255)
    io.write_atomic(tmp_path / name, _enc(b"1"), FILE)
    io.write_atomic(tmp_path / name, _enc(b"2"), FILE)
    io.write_atomic(tmp_path / name, _pair_enc(b"3", b"3"), SIB)
    io.write_atomic(tmp_path / name, _pair_enc(b"4", b"4"), SIB)
    (tmp_path / name).unlink()
    io.write_atomic(tmp_path / name, Encoded(files={"a": _enc(b"5")}), DIRECTORY)
    io.write_atomic(tmp_path / name, Encoded(files={"a": _enc(b"6")}), DIRECTORY)
    assert _read_pair(tmp_path / name) == {"npz": b"4", "json": b"4"}
    assert all(len(os.fsencode(n)) <= 255 for n in os.listdir(tmp_path))
    long = atomic.resolve(tmp_path / name)
    for p in (atomic._tmp_name(long), atomic._journal_path(long)):
        assert len(os.fsencode(p.name)) <= 255
    assert atomic._tmp_pattern(long.name).match(atomic._tmp_name(long).name)
    # two long names that share their first 200 bytes still get different temporaries
    other = long.with_name(name[:-1] + "z")
    assert not atomic._tmp_pattern(other.name).match(atomic._tmp_name(long).name)
    stale = atomic._tmp_name(long)
    stale.write_bytes(b"x")
    io.write_atomic(tmp_path / name, Encoded(files={"a": _enc(b"7")}), DIRECTORY)
    assert not stale.exists() and _leftovers(tmp_path) == []


# --------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------


def test_file_source_counts_and_bounds_reads(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(bytes(range(100)))
    with io.FileSource(p) as src:
        assert bytes(src.read(10, 5, "x")) == bytes(range(10, 15))
        assert src.bytes_read == 5
        with pytest.raises(ptio.FormatError) as e:
            src.read(98, 5, "tail")
        assert e.value.field == "tail" and e.value.offset == 98 and e.value.path == str(p)


@pytest.mark.parametrize("parallel", [False, True])
def test_a_file_that_shrinks_while_read_is_a_format_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    if parallel:
        monkeypatch.setattr(reads, "_PARALLEL_MIN", 0)
        monkeypatch.setattr(reads, "_PARALLEL_BLOCK", 1000)
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 40)
    with io.FileSource(path) as src:
        os.truncate(path, 3000)  # another program, after the open
        assert bytes(src.read(10, 20, "head")) == bytes(range(10, 30))
        attempts = [
            lambda: src.read(0, 5000, "data"),
            lambda: src.read_into(2000, memoryview(bytearray(4000)), "w"),
            lambda: src.read_scattered(
                2500, [memoryview(bytearray(n)) for n in (100, 1000, 50)], "w"
            ),
        ]
        for read in attempts:
            with pytest.raises(FormatError) as info:
                read()
            err = info.value
            assert err.path == str(path) and "truncated" in err.reason
            # the first missing byte, or with blocks read in parallel, a later block's first
            assert err.offset == 3000 or (parallel and err.offset in (4000, 5000))
    fd = os.open(path, os.O_RDONLY)
    try:  # a whole-file read sized before the file shrank
        monkeypatch.setattr(
            os, "fstat", lambda fd: os.stat_result((0o100644, 0, 0, 1, 0, 0, 9000, 0, 0, 0))
        )
        with pytest.raises(FormatError, match="truncated") as info:
            reads._read_fd(fd, str(path), mmap=False)
        assert info.value.path == str(path)
        assert info.value.offset == 3000 or (
            parallel and info.value.offset in range(4000, 9000, 1000)
        )
    finally:
        os.close(fd)


def test_parallel_read_of_large_files_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "_PARALLEL_MIN", 0)
    monkeypatch.setattr(reads, "_PARALLEL_BLOCK", 4096 + 17)  # blocks that do not divide the size
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    assert bytes(io.read_file(tmp_path / "f")) == data
    assert bytes(io.open_source(tmp_path / "f", FILE)) == data
    assert bytes(io.read_file(tmp_path / "f", mmap=True)) == data


def test_parallel_read_waits_for_every_job_before_closing_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "_PARALLEL_MIN", 0)
    monkeypatch.setattr(reads, "_PARALLEL_BLOCK", 1000)
    (tmp_path / "f").write_bytes(b"x" * 8000)
    real = reads._read_range
    finished: list[int] = []
    failed: list[BaseException] = []
    closed: list[int] = []

    def read_range(fd: int, view: memoryview, offset: int, name: str, field: str) -> None:
        if offset == 0:
            raise OSError(errno.EIO, "Input/output error", name)
        time.sleep(0.05)
        try:
            real(fd, view, offset, name, field)
        except BaseException as exc:  # EBADF if the descriptor were closed under us
            failed.append(exc)
        finished.append(offset)

    real_close = os.close

    def close(fd: int) -> None:
        closed.append(len(finished))
        real_close(fd)

    monkeypatch.setattr(reads, "_read_range", read_range)
    monkeypatch.setattr(os, "close", close)
    with pytest.raises(OSError, match="Input/output"):
        io.read_file(tmp_path / "f")
    monkeypatch.undo()
    started = len(finished)
    time.sleep(0.3)
    assert len(finished) == started, "a job was still running after read_file returned"
    assert closed and closed[-1] == started and failed == []


def test_open_source_errors_name_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as e:
        io.open_source(tmp_path / "nope", FILE)
    assert e.value.filename == str(tmp_path / "nope")
    (tmp_path / "x.nn").write_bytes(b"something else")
    with pytest.raises(FileNotFoundError) as e:
        io.open_source(tmp_path / "x.nn", SIB)
    assert f"{tmp_path}/x.nn.npz and {tmp_path}/x.nn.json" in str(e.value)
    with pytest.raises(FileNotFoundError):
        io.open_source(tmp_path / "nodir", DIRECTORY)
    with pytest.raises(ptio.FormatError, match="is a file"):
        io.open_source(tmp_path / "x.nn", DIRECTORY)
    with pytest.raises(ptio.FormatError, match="is a directory"):
        io.open_source(tmp_path, FILE)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ptio.FormatError, match="not a regular file"):
        io.open_source(tmp_path / "fifo", FILE)


def test_half_a_linked_set_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_bytes(b"{}")
    with pytest.raises(FileNotFoundError) as e:
        io.open_source(tmp_path / "x", SIB)
    assert e.value.filename == str(tmp_path / "x")
    assert e.value.strerror == (
        f"No such file or directory (looked for {tmp_path}/x.npz and {tmp_path}/x.json; "
        f"only {tmp_path}/x.json exists)"
    )
    assert _read_pair(tmp_path / "x", UNLINKED) == {
        "json": b"{}"
    }  # unlinked roles: the format decides


def test_sibling_sources_open_the_existing_roles(tmp_path: Path) -> None:
    io.write_atomic(tmp_path / "x", _pair_enc(b"PK\x03\x04", b"{}"), SIB)
    with io.open_source(tmp_path / "x", SIB, headers=True) as fs:
        assert sorted(fs) == ["json", "npz"]
        src = fs["json"]
        assert isinstance(src, io.FileSource) and src.size == 2
        src.close()
    with io.open_source(tmp_path / "x", SIB, mmap=True) as fs:
        assert bytes(fs["npz"]) == b"PK\x03\x04"


# --------------------------------------------------------------------------
# probes
# --------------------------------------------------------------------------


def test_file_probe(tmp_path: Path) -> None:
    assert io.probe(tmp_path / "nope", FILE).kind == "missing"
    assert io.probe(tmp_path, FILE).kind == "dir"
    big = b"\x01" * 10_000
    (tmp_path / "f").write_bytes(big)
    pr = io.probe(tmp_path / "f", FILE)
    assert (pr.kind, pr.head, pr.size, pr.members) == ("file", big[:4096], 10_000, None)
    np.savez(tmp_path / "a.npz", w=np.ones(3), b=np.zeros(2))
    assert io.probe(tmp_path / "a.npz", FILE).members == ("w.npy", "b.npy")
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04" + b"\xff" * 100)
    pr = io.probe(tmp_path / "bad.npz", FILE)
    assert pr.head[:4] == b"PK\x03\x04" and pr.members is None
    os.mkfifo(tmp_path / "fifo")  # must not hang
    assert io.probe(tmp_path / "fifo", FILE).head == b""
    (tmp_path / "locked").write_bytes(b"secret")
    os.chmod(tmp_path / "locked", 0)
    pr = io.probe(tmp_path / "locked", FILE)
    assert pr.kind == "file" and pr.size == 6  # (root reads it anyway; others get no head)


def test_zip_member_names_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with zipfile.ZipFile(tmp_path / "many.zip", "w") as z:
        for i in range(20):
            z.writestr(f"m{i}.npy", b"")
    monkeypatch.setattr(probes, "_MAX_MEMBERS", 5)
    assert io.probe(tmp_path / "many.zip", FILE).members == tuple(f"m{i}.npy" for i in range(5))


def test_directory_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "ckpt"
    io.write_atomic(
        d,
        Encoded(
            files={
                "config.json": _enc(b'{"a": 1}'),
                "notes.TXT": _enc(b"hi"),
                "raw.bin": _enc(b"\0" * 5000),
                "sub/deep.json": _enc(b"{}"),
            }
        ),
        DIRECTORY,
    )
    (tmp_path / "outside.json").write_bytes(b"secret")
    (d / "leak.json").symlink_to(tmp_path / "outside.json")
    (d / "alias.bin").symlink_to("raw.bin")
    (d / "loop").symlink_to(tmp_path)  # a symlinked directory is not descended into
    (d / ".raw.bin.pytreeio-tmp-1-abcdef01").write_bytes(b"")
    (d / ".raw.bin.pytreeio-lock").write_bytes(b"")  # an older pytreeio's lock file
    pr = io.probe(d, DIRECTORY)
    assert pr.kind == "dir"
    assert pr.names == {"config.json", "notes.TXT", "raw.bin", "sub/deep.json", "alias.bin"}
    assert dict(pr.heads) == {"config.json": b'{"a": 1}', "notes.TXT": b"hi"}
    with io.open_source(d, DIRECTORY) as fs:
        assert set(fs) == pr.names and bytes(fs["alias.bin"]) == b"\0" * 5000
    monkeypatch.setattr(probes, "_MAX_NAMES", 2)
    monkeypatch.setattr(probes, "_MAX_HEADS", 1)
    pr = io.probe(d, DIRECTORY)
    assert pr.names is not None and len(pr.names) == 2 and len(pr.heads) <= 1
    assert io.probe(tmp_path / "nope", DIRECTORY).kind == "missing"
    fp = io.probe(tmp_path / "outside.json", DIRECTORY)
    assert fp.kind == "file" and fp.names is None and fp.head == b"secret"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_walk_order_special_files_descriptors_and_depth(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    for rel in ["b.bin", "a.bin", "z/2.bin", "z/1.bin", "y/x/deep.bin", "y/top.bin"]:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(b"x")
    os.mkfifo(d / "pipe")  # neither read nor waited on
    (d / "dangling").symlink_to(tmp_path / "missing")
    before = _open_fds()
    # each directory's files sorted, then its subdirectories' in order, depth first
    assert list(reads._walk(d)) == [
        "a.bin",
        "b.bin",
        "y/top.bin",
        "y/x/deep.bin",
        "z/1.bin",
        "z/2.bin",
    ]
    assert list(reads._walk(d, limit=3)) == ["a.bin", "b.bin", "y/top.bin"]
    stopped = reads._walk(d)
    assert [next(stopped), next(stopped), next(stopped)] == ["a.bin", "b.bin", "y/top.bin"]
    stopped.close()  # a walk left halfway closes the directories it holds
    assert io.walk(d) == sorted(io.walk(d))
    assert _open_fds() == before
    deep = d / "n"
    deep.mkdir()
    for _ in range(reads.MAX_DEPTH):
        deep = deep / "n"
        deep.mkdir()
    (deep / "leaf.bin").write_bytes(b"x")
    with pytest.raises(ptio.FormatError, match="nested deeper than"):
        list(reads._walk(d))
    assert _open_fds() == before
    # sniffing never raises: it goes by the names listed; opening says what is wrong
    assert io.probe(d, DIRECTORY).names == {"a.bin", "b.bin"}  # those before "n/"
    with pytest.raises(ptio.FormatError, match="nested deeper than") as e:
        ptio.load(d, format="waffe2")
    assert e.value.path is not None and "/n/n/" in e.value.path
    assert _open_fds() == before


def test_siblings_probe(tmp_path: Path) -> None:
    (tmp_path / "x.npz").write_bytes(b"PK\x03\x04junk")
    pr = io.probe(tmp_path / "x", SIB)
    assert pr.kind == "missing" and set(pr.siblings) == {"npz"}
    assert pr.siblings["npz"].head == b"PK\x03\x04junk" and pr.siblings["npz"].members is None
    self_located = Siblings(locate=lambda p: {"main": p, "side": p.with_suffix(".json")}, roles=())
    pr = io.probe(tmp_path / "x.npz", self_located)
    assert pr.kind == "file" and pr.siblings == {"main": pr.siblings["main"]}
    assert pr.siblings["main"].size == 8

    def broken(p: Path) -> dict[str, Path]:
        raise ValueError("no")

    assert io.probe(tmp_path / "x", Siblings(locate=broken, roles=())).siblings == {}
