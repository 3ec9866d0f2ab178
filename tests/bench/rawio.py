"""Raw file I/O baselines: what pytreeio is measured against.

Every baseline works on a *file set* (the files of one checkpoint, relative
paths and sizes), so a format is compared with raw I/O of exactly its own
bytes and layout.  Reads go into freshly allocated arrays, as a load must
(page faults and kernel zero-fill included); the best raw read of a machine
is the fastest of single-thread ``readinto``, multi-thread ``pread`` (into one
array per file, and into arrays of the sizes of the loaded tree's tensors: the
allocator recycles memory of up to 32 MiB from one read to the next, a larger
array is mapped and zero-filled afresh, so a tree's tensor sizes set this
floor) and ``mmap`` + copy.
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

_MAX_WRITE = 1 << 30  # Linux caps one write() just under 2 GiB
_PREAD_BLOCK = 16 << 20

FileSet = list[tuple[str, int]]  # (relative path, size)


def file_set(root: Path, only: Sequence[str] | None = None) -> FileSet:
    """The regular files under ``root`` (or ``root`` itself), lock files left out."""
    if root.is_file():
        return [(root.name, root.stat().st_size)]
    files = sorted(
        (p.relative_to(root).as_posix(), p.stat().st_size)
        for p in root.rglob("*")
        if p.is_file() and not p.name.endswith("-lock")
    )
    if only is not None:
        files = [f for f in files if f[0] in only]
    return files


def _paths(root: Path, files: FileSet) -> list[tuple[Path, int]]:
    if root.is_file():
        return [(root, files[0][1])]
    return [(root / rel, size) for rel, size in files]


def raw_write(root: Path, files: FileSet, sources: Sequence[Any], durable: bool) -> None:
    """Write files of the sizes in ``files`` under ``root`` from ``sources``, no encoding at all.

    The bytes come from ``sources`` (the tree's own arrays: resident memory of
    the same size a save reads) in turn, cycling when the files need more.
    """
    views = [memoryview(s).cast("B") for s in sources if memoryview(s).nbytes]
    k, at = 0, 0  # current source and position in it
    for rel, size in files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos = 0
            while pos < size:
                src = views[k]
                n = min(size - pos, len(src) - at, _MAX_WRITE)
                n = os.write(fd, src[at : at + n])
                pos += n
                at += n
                if at == len(src):
                    k, at = (k + 1) % len(views), 0
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)


def _fill(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from the file at ``offset``."""
    pos = 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], offset + pos)
        if n == 0:
            raise OSError(f"file shorter than {offset + len(view)} bytes")
        pos += n


def read_readinto(root: Path, files: FileSet) -> list[np.ndarray]:
    """One thread, one ``readinto`` per file into a fresh array."""
    out = []
    for path, size in _paths(root, files):
        buf = np.empty(size, np.uint8)
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf).cast("B")
            pos = 0
            while pos < size:
                n = f.readinto(view[pos:])
                if not n:
                    raise OSError(f"{path} is shorter than {size} bytes")
                pos += n
        out.append(buf)
    return out


def read_pread(root: Path, files: FileSet, threads: int = 2) -> list[np.ndarray]:
    """``threads`` threads ``pread`` 16 MiB blocks of every file into a fresh array per file."""
    return _pread_all(root, files, threads, array_bytes=None)


#: Bytes per array of :func:`read_pread_arrays`: the benchmark tree's mean tensor size
#: (bench_all sets it from the tree; 512 MiB in 64 leaves by default).
ARRAY_BYTES = 8 << 20


def read_pread_arrays(
    root: Path, files: FileSet, threads: int = 2, sizes: Sequence[int] | None = None
) -> list[np.ndarray]:
    """``threads`` threads ``pread`` every file into fresh arrays, as a load that gives each
    tensor an array of its own reads them: arrays of ``sizes`` bytes (the loaded tree's
    tensors, in order, repeated over the files' bytes), or of :data:`ARRAY_BYTES` each."""
    return _pread_all(root, files, threads, array_bytes=sizes or [ARRAY_BYTES])


def _pread_all(
    root: Path, files: FileSet, threads: int, array_bytes: Sequence[int] | None
) -> list[np.ndarray]:
    """Every file in fresh arrays of ``array_bytes`` each, in turn (None: one per file), read
    by ``threads`` threads in blocks of at most 16 MiB."""
    out = []
    fds = []
    jobs = []
    steps = itertools.cycle([max(1, n) for n in array_bytes] if array_bytes else [0])
    try:
        for path, size in _paths(root, files):
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            start = 0
            while start < size:
                step = next(steps) or size
                buf = np.empty(min(step, size - start), np.uint8)
                out.append(buf)
                view = memoryview(buf).cast("B")
                jobs += [
                    (fd, view[s : s + _PREAD_BLOCK], start + s)
                    for s in range(0, len(view), _PREAD_BLOCK)
                ]
                start += len(view)
            if size == 0:
                out.append(np.empty(0, np.uint8))
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(_fill, *job) for job in jobs]:
                f.result()
    finally:
        for fd in fds:
            os.close(fd)
    return out


def read_mmap_copy(root: Path, files: FileSet) -> list[np.ndarray]:
    """``mmap`` every file and copy it into a fresh array."""
    out = []
    for path, size in _paths(root, files):
        if size == 0:
            out.append(np.empty(0, np.uint8))
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            src = np.frombuffer(m, np.uint8)
            out.append(src.copy())
            del src
    return out


#: The raw reads raced against every load; the best of them is the machine's limit.
RAW_READS = {
    "readinto (1 thread)": read_readinto,
    "pread (2 threads)": read_pread,
    "pread into arrays (2 threads)": read_pread_arrays,
    "mmap + copy": read_mmap_copy,
}


# --------------------------------------------------------------------------
# a file per tensor: the floor of a format that stores each tensor in a file of its own
# --------------------------------------------------------------------------


def replace_dir_of_files(root: Path, arrays: Sequence[np.ndarray]) -> None:
    """What replacing a directory of one file per array costs with nothing else done.

    Each array's bytes go into a file of their own (``open``/``write``/``close``)
    in a new directory, which is swapped in for ``root`` by two renames; the
    replaced directory and its files are then removed.  No header, no manifest,
    no lock, no ``fsync``: the floor under an atomic save of such a format.
    """
    new, old = root.with_name(root.name + ".new"), root.with_name(root.name + ".old")
    os.mkdir(new)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for i, arr in enumerate(arrays):
        fd = os.open(new / f"{i}.bin", flags, 0o644)
        try:
            os.write(fd, memoryview(arr).cast("B"))
        finally:
            os.close(fd)
    had = root.exists()
    if had:
        os.rename(root, old)
    os.rename(new, root)
    if had:
        for name in os.listdir(old):
            os.unlink(old / name)
        os.rmdir(old)


def read_dir_of_files(root: Path) -> list[np.ndarray]:
    """Every file of ``root`` read into a fresh array of its own (``open``/``read``/``close``)."""
    out = []
    with os.scandir(root) as entries:
        names = [e.name for e in entries]
    for name in names:
        fd = os.open(root / name, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            buf = np.empty(size, np.uint8)
            _fill(fd, memoryview(buf), 0)
        finally:
            os.close(fd)
        out.append(buf)
    return out
