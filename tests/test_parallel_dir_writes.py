"""Directories of several large files are written on one thread per core: same bytes, same atomicity.

:func:`pytreeio.io.atomic._populate_dir` hands the files of a large directory
encoding to :func:`pytreeio.core.threads.share` (largest first).  Thresholds are
lowered so that small trees take the parallel path.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import io
from pytreeio.core.binary import Deferred
from pytreeio.core.records import Encoded
from pytreeio.formats.waffe2 import state_dict as waffe2
from pytreeio.io import atomic


@pytest.fixture
def parallel_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every directory of two files or more written by three threads, however small."""
    monkeypatch.setattr(atomic, "_PARALLEL_DIR_MIN", 0)
    monkeypatch.setattr(atomic, "_PARALLEL_FILE_MIN", 0)
    monkeypatch.setattr(atomic, "cores", lambda: 3)


def _leftovers(root: Path) -> list[str]:
    """pytreeio temporaries and journals."""
    return sorted(
        p.name
        for p in root.iterdir()
        if ".pytreeio-tmp-" in p.name or ".pytreeio-journal" in p.name
    )


@pytest.mark.parametrize(
    ("sizes", "cores", "writers"),
    [
        ([100 << 20], 4, 1),  # one file: nothing to share
        ([50 << 20, 1 << 10, 1 << 10], 4, 1),  # one large file among small ones
        ([30 << 20, 30 << 20], 4, 1),  # under the directory threshold
        ([40 << 20, 40 << 20, 1], 4, 2),  # two large files: two writers
        ([40 << 20] * 6, 4, 4),  # at most one per core
        ([40 << 20] * 6, 1, 1),  # one core
    ],
)
def test_writers_are_one_per_core_for_several_large_files(
    monkeypatch: pytest.MonkeyPatch, sizes: list[int], cores: int, writers: int
) -> None:
    monkeypatch.setattr(atomic, "cores", lambda: cores)
    assert atomic._file_writers(sizes) == writers


def test_files_are_written_by_several_threads_largest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parallel_dirs: None
) -> None:
    monkeypatch.setattr(atomic, "cores", lambda: 2)  # two writers: the third file waits for one
    threads: dict[str, str] = {}
    started: list[str] = []
    gate = threading.Barrier(2, timeout=10)

    def chunk(name: str, data: bytes) -> Deferred:
        def produce() -> bytes:
            started.append(name)
            threads[name] = threading.current_thread().name
            if name in ("big", "middle"):
                gate.wait()  # the two largest are written at the same time
            return data

        return Deferred(len(data), produce)

    files = {
        "small": Encoded((chunk("small", b"s"),)),
        "big": Encoded((b"head", chunk("big", b"B" * 3000))),
        "sub/middle": Encoded((chunk("middle", b"m" * 2000),)),
    }
    dest = tmp_path / "ckpt"
    io.write_dir_atomic(dest, Encoded(files=files), durable=True)
    assert (dest / "big").read_bytes() == b"head" + b"B" * 3000
    assert (dest / "sub" / "middle").read_bytes() == b"m" * 2000
    assert (dest / "small").read_bytes() == b"s"
    assert set(started[:2]) == {"big", "middle"} and started[2] == "small"
    assert threads["big"] != threads["middle"]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("failing", ["big", "small"])
def test_a_failed_file_leaves_the_old_directory_and_no_temporary(
    tmp_path: Path, parallel_dirs: None, failing: str
) -> None:
    dest = tmp_path / "ckpt"
    io.write_dir_atomic(dest, Encoded(files={"big": Encoded((b"old",))}))

    def produce(name: str, n: int) -> bytes:
        if name == failing:
            raise OSError(f"disk full writing {name}")
        return b"x" * n

    files = {
        name: Encoded((Deferred(n, lambda name=name, n=n: produce(name, n)),))
        for name, n in (("big", 5000), ("middle", 3000), ("small", 10))
    }
    with pytest.raises(OSError, match=f"writing {failing}"):
        io.write_dir_atomic(dest, Encoded(files=files))
    assert sorted(p.name for p in dest.iterdir()) == ["big"]
    assert (dest / "big").read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("dtype", ["<f4", ">f8", "<i2"])
def test_waffe2_save_written_in_parallel_has_numpy_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parallel_dirs: None, dtype: str
) -> None:
    # bands of a few rows: every file many deferred chunks, made by the writing threads
    monkeypatch.setattr(waffe2, "_BAND_BYTES", 5 * np.dtype(dtype).itemsize * 41)
    rng = np.random.default_rng(3)
    shapes = [(29, 41), (41, 17), (17, 41), (41, 3)]
    params = {
        "params": {
            f"Dense_{i}": {
                "kernel": rng.integers(-100, 100, shape).astype(dtype),
                "bias": rng.integers(-100, 100, shape[1]).astype(dtype),
            }
            for i, shape in enumerate(shapes)
        }
    }
    dest = tmp_path / "m.wf2model"
    ptio.save(dest, params, format="waffe2", layers=["Linear"] * len(shapes), durable=False)
    for i in range(len(shapes)):
        kernel = params["params"][f"Dense_{i}"]["kernel"]
        data = (dest / f"param:linearlayer.{i}.weights.npy").read_bytes()
        ref = tmp_path / "ref.npy"
        np.save(ref, kernel.T.astype(kernel.dtype.newbyteorder("<")).reshape(-1))
        assert data == ref.read_bytes()
    assert _leftovers(tmp_path) == []
