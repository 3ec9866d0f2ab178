"""All file-system access of pytreeio: atomic writes and bounded reads.

Writes: a temporary file (or directory) is created next to the destination,
written chunk by chunk straight from the arrays' buffers, fsync'd, renamed
over the destination, and the parent directory fsync'd.  A failure at any
point removes the temporary and leaves the previous checkpoint untouched.
Directories are swapped in with ``renameat2(RENAME_EXCHANGE)`` where the
kernel has it, so readers see either the old or the new directory.

Reads: a whole file is read with ``readinto`` into one preallocated,
uninitialised buffer (arrays decoded from it are views, so the data is
copied exactly once, from the page cache); ``mmap=True`` maps it instead.
Header-only reads (``inspect``) go through :class:`FileSource`, which
``pread``\\ s just the ranges a format asks for.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap as _mmap
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .binary import Buffer, ByteSource, as_memoryview
from .registry import Encoded

__all__ = [
    "write_atomic",
    "write_file_atomic",
    "write_dir_atomic",
    "read_file",
    "FileSource",
    "FileSet",
]

# Linux caps a single write() at just under 2 GiB; stay well below it.
_MAX_WRITE = 1 << 30
_TMP_MARK = ".pytreeio-tmp-"


def _tmp_name(dest: Path) -> Path:
    return dest.parent / f".{dest.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def _write_chunks(fd: int, chunks: tuple[Buffer, ...] | list[Buffer]) -> None:
    for chunk in chunks:
        view = as_memoryview(chunk)
        n = len(view)
        pos = 0
        while pos < n:
            pos += os.write(fd, view[pos : pos + _MAX_WRITE])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new_file(path: Path, encoded: Encoded, durable: bool, mode: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        _write_chunks(fd, encoded.chunks)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(
    path: str | os.PathLike[str], encoded: Encoded, *, durable: bool = True
) -> None:
    """Write a single-file encoding to ``path`` atomically."""
    dest = Path(path)
    if dest.is_dir():
        raise IsADirectoryError(errno.EISDIR, "cannot replace a directory with a file", str(dest))
    try:  # a replaced checkpoint keeps its permission bits
        mode: int | None = os.stat(dest).st_mode & 0o7777
    except FileNotFoundError:
        mode = None
    tmp = _tmp_name(dest)
    try:
        _write_new_file(tmp, encoded, durable, mode)
        os.replace(tmp, dest)
    except BaseException:
        _remove_quietly(tmp)
        raise
    if durable:
        _fsync_dir(dest.parent)


def _populate_dir(root: Path, encoded: Encoded, durable: bool) -> None:
    assert encoded.files is not None
    made: set[Path] = {root}
    for rel, sub in encoded.files.items():
        target = root.joinpath(*rel.split("/"))
        if root not in target.parents or ".." in rel.split("/"):
            raise ValueError(f"refusing to write {rel!r} outside the checkpoint directory")
        if target.parent not in made:
            target.parent.mkdir(parents=True, exist_ok=True)
            made.add(target.parent)
        _write_new_file(target, sub, durable)
    if durable:
        for d in sorted(made, key=lambda p: len(p.parts), reverse=True):
            _fsync_dir(d)


def _renameat2_exchange() -> Any:
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return None
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2: Any = None
_renameat2_checked = False


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False if the platform cannot."""
    global _renameat2, _renameat2_checked
    if not _renameat2_checked:
        _renameat2 = _renameat2_exchange()
        _renameat2_checked = True
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_dir_atomic(
    path: str | os.PathLike[str], encoded: Encoded, *, durable: bool = True
) -> None:
    """Write a directory encoding, replacing any existing directory as a whole."""
    dest = Path(path)
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "cannot replace a file with a directory", str(dest))
    tmp = _tmp_name(dest)
    try:
        tmp.mkdir()
        _populate_dir(tmp, encoded, durable)
        if dest.exists():
            if _exchange(tmp, dest):
                # tmp now holds the previous checkpoint
                if durable:
                    _fsync_dir(dest.parent)
                shutil.rmtree(tmp, ignore_errors=True)
                return
            # No atomic exchange: move the old directory aside first.  A crash
            # between the two renames leaves the old checkpoint at `old`.
            old = _tmp_name(dest)
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    except BaseException:
        _remove_quietly(tmp)
        raise
    if durable:
        _fsync_dir(dest.parent)


def write_atomic(
    path: str | os.PathLike[str],
    encoded: Encoded,
    *,
    layout: str,
    locate: Any = None,
    durable: bool = True,
) -> None:
    """Write ``encoded`` in the given layout (see :mod:`pytreeio.registry`)."""
    if layout == "file":
        if encoded.files is not None:
            raise TypeError("a single-file format returned a multi-file encoding")
        write_file_atomic(path, encoded, durable=durable)
    elif layout == "dir":
        write_dir_atomic(path, encoded, durable=durable)
    elif layout == "files":
        if encoded.files is None or locate is None:
            raise TypeError("a multi-file format needs files and locate()")
        roles = locate(Path(path))
        unknown = set(encoded.files) - set(roles)
        if unknown:
            raise ValueError(f"encoding has files for unknown roles {sorted(unknown)}")
        # Each file is atomic on its own; the order is the format's (data before sidecars).
        for role, sub in encoded.files.items():
            write_file_atomic(roles[role], sub, durable=durable)
    else:
        raise ValueError(f"unknown layout {layout!r}")


def _remove_quietly(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError:
        pass


# --------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------


# Files at least this large are read by several threads: filling fresh memory
# costs a page fault and a kernel zero-fill per page, which a single reader
# pays serially (~20% below a read into already-touched memory).
_PARALLEL_MIN = 64 << 20
_PARALLEL_BLOCK = 16 << 20
_PARALLEL_THREADS = 4
_pool: ThreadPoolExecutor | None = None


def _read_range(
    fd: int, view: memoryview, start: int, stop: int, name: str, *, file_offset: int = 0
) -> None:
    """Fill ``view[start:stop]`` from the file at ``file_offset + start`` (pread: no shared seek)."""
    pos = start
    while pos < stop:
        n = os.preadv(fd, [view[pos:stop]], file_offset + pos)
        if n == 0:
            raise OSError(errno.EIO, f"file shrank while reading ({pos} of {stop} bytes)", name)
        pos += n


def read_file(path: str | os.PathLike[str], *, mmap: bool = False) -> memoryview:
    """The whole file as a memoryview: read once into fresh memory, or mapped read-only."""
    global _pool
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if mmap:
            if size == 0:
                return memoryview(b"")
            return memoryview(_mmap.mmap(fd, 0, access=_mmap.ACCESS_READ))
        # np.empty leaves the pages untouched until the reads fill them
        # (bytearray(size) would zero-fill them first).
        view = np.empty(size, dtype=np.uint8).data
        if size < _PARALLEL_MIN:
            _read_range(fd, view, 0, size, p)
            return view
        if _pool is None:
            _pool = ThreadPoolExecutor(_PARALLEL_THREADS, thread_name_prefix="pytreeio-read")
        jobs = [
            _pool.submit(_read_range, fd, view, start, min(start + _PARALLEL_BLOCK, size), p)
            for start in range(0, size, _PARALLEL_BLOCK)
        ]
        for job in jobs:
            job.result()
        return view
    finally:
        os.close(fd)


class FileSource(ByteSource):
    """A :class:`ByteSource` that ``pread``\\ s ranges of a file on demand."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.name = os.fspath(path)
        self._fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.size = os.fstat(self._fd).st_size
        self.bytes_read = 0

    def _read(self, offset: int, n: int) -> memoryview:
        view = memoryview(bytearray(n))
        _read_range(self._fd, view, 0, n, self.name or "", file_offset=offset)
        return view

    def view(self) -> memoryview:
        """The whole file mapped read-only (pages are read only when touched)."""
        if self.size == 0:
            return memoryview(b"")
        return memoryview(_mmap.mmap(self._fd, 0, access=_mmap.ACCESS_READ))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class FileSet(Mapping[str, Any]):
    """Named files of a checkpoint, read on access.

    Keys are a directory's relative POSIX paths (:meth:`directory`) or a
    multi-file format's roles (:meth:`existing`).  ``headers=True`` yields
    :class:`FileSource` objects instead of whole buffers (for ``inspect``).
    """

    def __init__(
        self, paths: Mapping[str, Path], *, mmap: bool = False, headers: bool = False
    ) -> None:
        self.paths = dict(paths)
        self._mmap = mmap
        self._headers = headers

    @classmethod
    def directory(
        cls, root: str | os.PathLike[str], *, mmap: bool = False, headers: bool = False
    ) -> FileSet:
        """The files below ``root``; symlinks pointing outside it are not followed."""
        base = Path(root)
        names = sorted(_walk(base))
        return cls({n: base.joinpath(*n.split("/")) for n in names}, mmap=mmap, headers=headers)

    @classmethod
    def existing(
        cls, roles: Mapping[str, Path], *, mmap: bool = False, headers: bool = False
    ) -> FileSet:
        """Those of a multi-file format's role paths that exist."""
        paths = {r: Path(p) for r, p in roles.items() if Path(p).is_file()}
        return cls(paths, mmap=mmap, headers=headers)

    def __getitem__(self, name: str) -> Any:
        path = self.paths[name]
        return FileSource(path) if self._headers else read_file(path, mmap=self._mmap)

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    def path_of(self, name: str) -> str:
        return str(self.paths[name])


def _walk(root: Path) -> Iterator[str]:
    base = root.resolve()
    for dirpath, _dirnames, filenames in os.walk(root):
        for fn in filenames:
            full = Path(dirpath) / fn
            if _TMP_MARK in fn:
                continue
            try:
                real = full.resolve()
            except OSError:
                continue
            if base not in real.parents:
                continue
            yield full.relative_to(root).as_posix()
