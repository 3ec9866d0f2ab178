"""Full disk, permissions, read-only and wrong-kind destinations through ``ptio.save``.

For a single file (safetensors), a sibling pair (netcl-checkpoint) and a
directory (waffe2, bullet): a save that cannot be completed raises a clear
error (an ``OSError`` naming the path), leaves the previous checkpoint
byte-for-byte as it was, leaves no temporary or journal behind, and a later
save that can succeed does.  Failures are simulated where the real condition
cannot be produced here (a full disk; permissions when running as root,
where ``chmod`` does not stop anything).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _tree(fmt: str, v: float) -> Any:
    def full(*shape: int) -> np.ndarray:
        return np.full(shape, v, np.float32)

    if fmt == "safetensors":
        return {"a": full(64, 64), "b": full(300)}
    if fmt == "netcl-checkpoint":
        return {
            "params": [full(16, 8), full(16)],
            "optim_state": {"t": int(v), "moments": [[full(16, 8)] * 2, [full(16)] * 2]},
        }
    if fmt == "waffe2":
        return {"param": {"linearlayer": {"0": {"weights": full(32, 16), "bias": full(32)}}}}
    if fmt == "bullet":
        part = {"l0w": full(768, 8), "l0b": full(8), "l1w": full(16, 1), "l1b": full(1)}
        return {"weights": {k: a / 64 for k, a in part.items()}, "momentum": part, "velocity": part}
    raise AssertionError(fmt)


FORMATS = ["safetensors", "netcl-checkpoint", "waffe2", "bullet"]
KIND = {"safetensors": "file", "netcl-checkpoint": "pair", "waffe2": "dir", "bullet": "dir"}


def _dest(tmp_path: Path, fmt: str) -> Path:
    return tmp_path / ("ckpt.safetensors" if fmt == "safetensors" else "ckpt")


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file below ``directory``, with its bytes."""
    out = {}
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            p = Path(dirpath) / name
            out[os.path.relpath(p, directory)] = p.read_bytes()
    return out


def _leftovers(directory: Path) -> list[str]:
    return sorted(
        os.path.relpath(Path(d) / n, directory)
        for d, dirs, files in os.walk(directory)
        for n in [*dirs, *files]
        if ".pytreeio-tmp-" in n or n.endswith(".pytreeio-journal")
    )


def _mentions_path(exc: BaseException, directory: Path) -> bool:
    text = " ".join(
        str(x) for x in (exc, getattr(exc, "filename", None), getattr(exc, "path", None))
    )
    return os.fspath(directory) in text


def _check_failed_save(
    exc: BaseException, tmp_path: Path, before: dict[str, bytes], fmt: str
) -> None:
    assert isinstance(exc, OSError | ptio.PytreeioError), repr(exc)
    assert _mentions_path(exc, tmp_path), repr(exc)
    assert _snapshot(tmp_path) == before, "the previous checkpoint changed"
    assert _leftovers(tmp_path) == []
    got = ptio.load(_dest(tmp_path, fmt), format=fmt)
    assert got is not None  # still loadable


def _counting_writes(monkeypatch: pytest.MonkeyPatch, fail_at: int | None) -> list[int]:
    """Patch ``os.write`` (as io sees it): count calls, raise ENOSPC from call ``fail_at`` on."""
    real = os.write
    calls: list[int] = []

    def write(fd: int, data: Any) -> int:
        calls.append(fd)
        if fail_at is not None and len(calls) > fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_enospc_at_any_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    dest = _dest(tmp_path, fmt)
    ptio.save(dest, _tree(fmt, 1), format=fmt)
    with monkeypatch.context() as m:
        calls = _counting_writes(m, None)
        ptio.save(
            tmp_path / "probe" if fmt != "safetensors" else tmp_path / "probe.safetensors",
            _tree(fmt, 2),
            format=fmt,
        )
        total = len(calls)
    for p in list(tmp_path.iterdir()):
        if p.name.startswith(("probe", ".probe")):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert total >= 1
    before = _snapshot(tmp_path)
    ks = sorted({0, 1, total // 2, total - 2, total - 1} & set(range(total)))
    for k in ks:
        with monkeypatch.context() as m:
            _counting_writes(m, k)
            with pytest.raises(OSError) as info:
                ptio.save(dest, _tree(fmt, 2), format=fmt)
        assert info.value.errno == errno.ENOSPC or isinstance(info.value.__cause__, OSError)
        _check_failed_save(info.value, tmp_path, before, fmt)
    ptio.save(dest, _tree(fmt, 3), format=fmt)  # space again: the save goes through
    assert _leftovers(tmp_path) == []
    assert _snapshot(tmp_path) != before


@contextlib.contextmanager
def _denied(directory: Path, err: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing new can be created in ``directory`` (and, for EROFS, nothing opened for writing).

    EACCES for a non-root user is real (``chmod 0o555``); as root it is simulated.
    """
    if err == errno.EACCES and not ROOT:
        os.chmod(directory, 0o555)
        try:
            yield
        finally:
            os.chmod(directory, 0o755)
        return
    real_open, real_mkdir = os.open, os.mkdir
    inside = os.fspath(directory.resolve())

    def denied(path: Any) -> bool:
        p = os.fspath(path)
        return os.path.abspath(p).startswith(inside + os.sep)

    def fake_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        if dir_fd is None and denied(path):
            writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            creating = flags & os.O_CREAT and not os.path.lexists(path)
            if creating or (err == errno.EROFS and writing):
                raise OSError(err, os.strerror(err), os.fspath(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def fake_mkdir(path: Any, mode: int = 0o777, *, dir_fd: Any = None) -> None:
        if dir_fd is None and denied(path):
            raise OSError(err, os.strerror(err), os.fspath(path))
        real_mkdir(path, mode, dir_fd=dir_fd)

    with monkeypatch.context() as m:
        m.setattr(os, "open", fake_open)
        m.setattr(os, "mkdir", fake_mkdir)
        yield


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS], ids=["eacces", "erofs"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_unwritable_directory_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, err: int
) -> None:
    dest = _dest(tmp_path, fmt)
    ptio.save(dest, _tree(fmt, 1), format=fmt)
    before = _snapshot(tmp_path)
    with _denied(tmp_path, err, monkeypatch), pytest.raises(OSError) as info:
        ptio.save(dest, _tree(fmt, 2), format=fmt)
    assert info.value.errno == err
    _check_failed_save(info.value, tmp_path, before, fmt)
    ptio.save(dest, _tree(fmt, 3), format=fmt)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_first_save_into_an_unwritable_directory_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    with _denied(tmp_path, errno.EACCES, monkeypatch), pytest.raises(OSError) as info:
        ptio.save(_dest(tmp_path, fmt), _tree(fmt, 1), format=fmt)
    assert _mentions_path(info.value, tmp_path), repr(info.value)
    assert _snapshot(tmp_path) == {} and _leftovers(tmp_path) == []


def _wrong_kind(dest: Path, fmt: str) -> Path:
    """Put a thing of the wrong kind where ``fmt`` saves; return it."""
    if KIND[fmt] == "dir":
        dest.write_bytes(b"a file, not a checkpoint directory")
        return dest
    target = dest if fmt == "safetensors" else dest.with_name(dest.name + ".json")
    target.mkdir()
    (target / "inside.txt").write_bytes(b"keep me")
    return target


@pytest.mark.parametrize("fmt", FORMATS)
def test_existing_destination_of_the_wrong_kind_is_refused(tmp_path: Path, fmt: str) -> None:
    dest = _dest(tmp_path, fmt)
    target = _wrong_kind(dest, fmt)
    before = _snapshot(tmp_path)
    with pytest.raises((OSError, ptio.PytreeioError)) as info:
        ptio.save(dest, _tree(fmt, 1), format=fmt)
    assert _mentions_path(info.value, target), repr(info.value)
    assert _snapshot(tmp_path) == before
    assert _leftovers(tmp_path) == []
    assert target.is_dir() == (KIND[fmt] != "dir")


def test_a_read_only_file_is_replaced_whole_and_keeps_its_mode(tmp_path: Path) -> None:
    """rename() semantics: a 0o444 checkpoint in a writable directory is replaced atomically."""
    dest = _dest(tmp_path, "safetensors")
    ptio.save(dest, _tree("safetensors", 1), format="safetensors")
    os.chmod(dest, 0o444)
    ptio.save(dest, _tree("safetensors", 2), format="safetensors")
    assert os.stat(dest).st_mode & 0o777 == 0o444
    assert float(ptio.load(dest)["a"][0, 0]) == 2
    assert _leftovers(tmp_path) == []
