"""Raw file I/O: the baselines pytreeio is measured against, written as a user would write them.

Every baseline works on a *file set* (the files of one checkpoint, relative
paths and sizes), so a format is compared with raw I/O of exactly its own
bytes and layout.  Reads go into a fresh numpy array per file (its pages
faulted in and zeroed, as a load's are): one thread ``readinto``, or two
threads ``pread``-ing 16 MiB blocks.  Writes are plain ``write`` calls, with
``fsync`` of every file and its directory only when the save compared with
them is durable.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

_MAX_WRITE = 1 << 30  # Linux caps one write() just under 2 GiB
_BLOCK = 16 << 20

FileSet = list[tuple[str, int]]  # (relative path, size)


def file_set(root: Path, only: Sequence[str] | None = None) -> FileSet:
    """The regular files under ``root``, lock files left out (``only``: just these)."""
    files = sorted(
        (p.relative_to(root).as_posix(), p.stat().st_size)
        for p in root.rglob("*")
        if p.is_file() and not p.name.endswith("-lock")
    )
    return files if only is None else [f for f in files if f[0] in only]


def raw_write(root: Path, files: FileSet, sources: Sequence[Any], durable: bool) -> None:
    """Files of the sizes in ``files`` under ``root``, their bytes taken from ``sources`` in turn.

    ``sources`` are the tree's own arrays (resident memory of the size a save
    reads), cycled when the files need more.  ``durable``: each file is
    fsynced, then each directory written into.
    """
    views = [memoryview(s).cast("B") for s in sources if memoryview(s).nbytes]
    k, at = 0, 0  # current source and position in it
    dirs = set()
    for rel, size in files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        dirs.add(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos = 0
            while pos < size:
                n = os.write(fd, views[k][at : at + min(size - pos, _MAX_WRITE)])
                pos, at = pos + n, at + n
                if at == len(views[k]):
                    k, at = (k + 1) % len(views), 0
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    for d in sorted(dirs) if durable else ():
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fill(fd: int, view: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], offset + pos)
        if n == 0:
            raise OSError(f"file shorter than {offset + len(view)} bytes")
        pos += n


def read_readinto(root: Path, files: FileSet) -> list[np.ndarray]:
    """One thread, one ``readinto`` loop per file into a fresh array."""
    out = []
    for rel, size in files:
        buf = np.empty(size, np.uint8)
        view = memoryview(buf).cast("B")
        with open(root / rel, "rb", buffering=0) as f:
            pos = 0
            while pos < size:
                n = f.readinto(view[pos:])
                if not n:
                    raise OSError(f"{rel} is shorter than {size} bytes")
                pos += n
        out.append(buf)
    return out


def read_pread(root: Path, files: FileSet, threads: int = 2) -> list[np.ndarray]:
    """``threads`` threads ``pread`` 16 MiB blocks of every file into a fresh array per file."""
    out, fds, jobs = [], [], []
    try:
        for rel, size in files:
            fd = os.open(root / rel, os.O_RDONLY)
            fds.append(fd)
            buf = np.empty(size, np.uint8)
            out.append(buf)
            view = memoryview(buf).cast("B")
            jobs += [(fd, view[s : s + _BLOCK], s) for s in range(0, size, _BLOCK)]
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(_fill, *job) for job in jobs]:
                f.result()
    finally:
        for fd in fds:
            os.close(fd)
    return out


#: The raw reads raced against every load; the faster of the two is the baseline.
READS = {"readinto (1 thread)": read_readinto, "pread (2 threads)": read_pread}


def write_dir_of_files(root: Path, arrays: Sequence[np.ndarray]) -> None:
    """A directory of one file per array (the layout of a format storing a file per tensor)."""
    root.mkdir(parents=True)
    for i, arr in enumerate(arrays):
        (root / f"{i}.bin").write_bytes(memoryview(np.ascontiguousarray(arr)).cast("B"))


def read_dir_of_files(root: Path) -> list[np.ndarray]:
    """Every file of ``root`` read into a fresh array of its own (``open``/``pread``/``close``)."""
    out = []
    with os.scandir(root) as entries:
        names = [e.name for e in entries]
    for name in names:
        fd = os.open(root / name, os.O_RDONLY)
        try:
            buf = np.empty(os.fstat(fd).st_size, np.uint8)
            _fill(fd, memoryview(buf), 0)
        finally:
            os.close(fd)
        out.append(buf)
    return out
