"""Reading files: whole (`read_file`), by range (`FileSource`), as a checkpoint's
named set (`FileSet`), and walking a directory checkpoint (`walk`).

A whole file is read with ``preadv`` into one fresh, uninitialised buffer (several threads for
large files); arrays decoded from it are views.  A file that another program truncates meanwhile
is a `FormatError` at the first missing byte.  ``mmap=True`` maps files instead (opt-in:
such a truncation then kills the process with SIGBUS).  Nothing here locks:
`pytreeio.io.sources.open_source` opens a checkpoint's files consistently.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap as _mmap
import os
import re
import stat
import sys
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

import numpy as np

from pytreeio.core.binary import ByteSource
from pytreeio.core.errors import FormatError
from pytreeio.core.threads import cores, pool, share

_Set = TypeVar("_Set", bound="FileSet | FilesOf[Any]")

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_SUBDIR_FLAGS = os.O_RDONLY | O_DIRECTORY | O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)

#: pytreeio's own files beside a checkpoint (`pytreeio.io.atomic`'s temporaries and
#: journals; lock files of older versions): never part of a checkpoint.
_OWN_FILE = re.compile(r"\.pytreeio-(?:tmp-\d+-[0-9a-f]{8}|lock|journal)\Z")

# Ranges at least this large are read by several threads: filling fresh memory costs a page
# fault and a kernel zero-fill per page, which a single reader pays serially.
_PARALLEL_MIN = 64 << 20
_PARALLEL_BLOCK = 16 << 20
#: Buffers one ``preadv`` may fill (POSIX guarantees 16; Linux and macOS allow 1024).
IOV_MAX = 1024 if sys.platform.startswith(("linux", "darwin")) else 16
# Up to this many files of a directory are opened while the shared lock is held; the others
# are opened on access, relative to the directory's descriptor (never from one swapped in later).
_EAGER_OPEN = 128
#: Directory levels below a checkpoint's root that a walk descends (checkpoints use two or three).
MAX_DEPTH = 64


def release(fds: Iterable[int]) -> None:
    """Close ``fds`` (closing a lock's last descriptor drops the flock)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _read_range(fd: int, view: memoryview, offset: int, name: str, field: str) -> None:
    """Fill ``view`` from the file at ``offset``; a file ending first was truncated meanwhile."""
    pos, n = 0, len(view)
    while pos < n:
        got = os.preadv(fd, [view[pos:]], offset + pos)
        if got == 0:
            raise FormatError(
                f"truncated while being read: the file ends before the {n - pos} bytes wanted "
                "here (shortened by another program meanwhile?)",
                path=name,
                field=field,
                offset=offset + pos,
            )
        pos += got


def _read_ranges(fd: int, view: memoryview, offset: int, name: str, field: str) -> None:
    """`_read_range`, in blocks on several threads when ``view`` is large."""
    if len(view) < _PARALLEL_MIN:
        _read_range(fd, view, offset, name, field)
        return

    def block(start: int) -> None:
        _read_range(fd, view[start : start + _PARALLEL_BLOCK], offset + start, name, field)

    share(pool(), cores(), block, range(0, len(view), _PARALLEL_BLOCK))


def _read_fd(fd: int, name: str, mmap: bool) -> memoryview:
    """The whole file behind ``fd``: read once into fresh memory, or mapped read-only."""
    size = os.fstat(fd).st_size
    if mmap:
        return memoryview(_mmap.mmap(fd, 0, access=_mmap.ACCESS_READ) if size else b"")
    view = np.empty(size, dtype=np.uint8).data  # untouched pages (bytearray would zero them)
    _read_ranges(fd, view, 0, name, "file")
    return view


def read_file(path: str | os.PathLike[str], *, mmap: bool = False) -> memoryview:
    """The whole file as a memoryview: read once into fresh memory, or mapped read-only
    (``mmap``: a file truncated by another program meanwhile then raises SIGBUS when touched)."""
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY | O_CLOEXEC)
    try:
        return _read_fd(fd, p, mmap)
    finally:
        os.close(fd)


def read_chunks(path: str | os.PathLike[str], chunk: int = 16 << 20) -> Iterator[memoryview]:
    """A file's bytes in order, ``chunk`` at a time, through one reused buffer (bounded memory).

    Each view is valid until the next one is produced.
    """
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            yield view[:n]


def read_head(path: str | os.PathLike[str], limit: int) -> bytes:
    """At most ``limit + 1`` bytes of a small file (so the caller can tell it is too long)."""
    with open(path, "rb") as f:
        return f.read(limit + 1)


def open_regular(path: str | os.PathLike[str], dir_fd: int | None = None) -> int | None:
    """A descriptor of a regular file (never blocks on FIFOs); None if absent or not a file."""
    try:
        fd = os.open(path, os.O_RDONLY | O_CLOEXEC | _O_NONBLOCK, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


class Closing:
    """Closed by ``with`` and when collected (its descriptors are never leaked)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # try/except, not contextlib.suppress: at interpreter exit module globals may be None
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass


class FileSource(Closing, ByteSource):
    """A `ByteSource` that ``pread``\\ s ranges of a file on demand (never maps it).

    ``fd``: an open descriptor of ``path`` to use (and close) instead of opening it.
    """

    name: str

    def __init__(self, path: str | os.PathLike[str], *, fd: int | None = None) -> None:
        self.name = os.fspath(path)
        self._fd = -1
        self._fd = fd if fd is not None else os.open(self.name, os.O_RDONLY | O_CLOEXEC)
        self.size = os.fstat(self._fd).st_size
        self.bytes_read = 0

    def read(self, offset: int, n: int, field: str) -> memoryview:
        """``n`` bytes at ``offset``; a `FormatError` naming ``field`` (a tensor's name)
        if the file is shorter, or was shortened since it was opened."""
        self._check_range(offset, n, field)
        view = np.empty(n, dtype=np.uint8).data  # uninitialised: no zero-fill
        _read_ranges(self._fd, view, offset, self.name, field)
        self.bytes_read += n
        return view

    def read_into(self, offset: int, out: memoryview, field: str) -> None:
        """Fill ``out`` with the bytes at ``offset`` (``pread`` straight into the caller's buffer)."""
        self._check_range(offset, len(out), field)
        _read_ranges(self._fd, out.cast("B"), offset, self.name, field)
        self.bytes_read += len(out)

    def read_scattered(self, offset: int, buffers: Sequence[memoryview], field: str) -> None:
        """Fill ``buffers`` one after another from the file at ``offset``, one ``preadv`` per
        `IOV_MAX` buffers (a short read finishes buffer by buffer)."""
        n = sum(len(b) for b in buffers)
        self._check_range(offset, n, field)
        at = offset
        for k in range(0, len(buffers), IOV_MAX):
            batch = buffers[k : k + IOV_MAX]
            got = os.preadv(self._fd, batch, at)
            for b in batch:
                if got < len(b):
                    _read_range(self._fd, b[max(got, 0) :], at + max(got, 0), self.name, field)
                got -= len(b)
                at += len(b)
        self.bytes_read += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ChangedWhileOpen(FileNotFoundError):
    """A file a `FileSet` listed when it was opened is gone when read: the checkpoint
    was replaced or changed since (a save elsewhere removed the files of the one it replaced).

    `pytreeio.load`, `pytreeio.inspect` and `pytreeio.verify` open the
    checkpoint again when they meet it (three times in all, then raise it); a lazy view
    (`pytreeio.open`) holds every file it read a header of and never meets it there.
    """


class FileSet(Closing, Mapping[str, Any]):
    """Named files of a checkpoint, read on access.

    Keys are a directory's relative POSIX paths (`directory`) or a sibling layout's
    roles.  ``headers=True`` yields `FileSource` objects instead of whole buffers (for
    ``inspect``).  Files may be held open (``open_source`` opens them under the lock, so that
    a later save cannot mix into what is read); `close` releases them.
    """

    def __init__(
        self,
        paths: Mapping[str, str | os.PathLike[str]],
        *,
        mmap: bool = False,
        headers: bool = False,
        fds: Mapping[str, int] | None = None,
        dir_fd: int | None = None,
        root: str | None = None,
    ) -> None:
        # strings: a directory of thousands of files would spend more on Path objects
        self.paths = {k: os.fspath(v) for k, v in paths.items()}
        self._root = root
        self._mmap = mmap
        self._headers = headers
        self._fds: dict[str, int] = dict(fds or {})
        self._dir_fd = dir_fd

    @classmethod
    def directory(
        cls, root: str | os.PathLike[str], *, mmap: bool = False, headers: bool = False
    ) -> FileSet:
        """The files below ``root``; symlinks pointing outside it are not followed.

        Raises ``FileNotFoundError`` / ``NotADirectoryError`` for a missing root or a file.
        """
        base = Path(root)
        dir_fd = os.open(base, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        fds: dict[str, int] = {}
        try:
            if not stat.S_ISDIR(os.fstat(dir_fd).st_mode):  # no O_DIRECTORY on this platform
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", os.fspath(base))
            names = sorted(_walk(base, dir_fd=dir_fd))
            for name in names[:_EAGER_OPEN]:
                fd = open_regular(name, dir_fd)
                if fd is not None:
                    fds[name] = fd
        except BaseException:
            release([*fds.values(), dir_fd])
            raise
        prefix = os.path.join(base, "")  # the root and one separator: names are POSIX paths
        return cls(
            {n: prefix + n for n in names},
            mmap=mmap,
            headers=headers,
            fds=fds,
            dir_fd=dir_fd,
            root=prefix,
        )

    def _own_fd(self, name: str) -> int:
        """A descriptor of file ``name`` of its own (the caller closes it)."""
        path = self.paths[name]
        fd = self._fds.get(name)
        if fd is not None:
            return os.dup(fd)
        if self._dir_fd is None:
            return os.open(path, os.O_RDONLY | O_CLOEXEC)
        try:  # a file the directory held when it was listed, never one swapped in since
            return os.open(name, os.O_RDONLY | O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            raise ChangedWhileOpen(
                errno.ENOENT,
                "gone since the checkpoint was opened: it was replaced or changed meanwhile "
                "(a concurrent save?)",
                path,
            ) from None
        except OSError as exc:
            raise type(exc)(exc.errno, exc.strerror, path) from None

    def __getitem__(self, name: str) -> Any:
        if self._headers:
            return FileSource(self.paths[name], fd=self._own_fd(name))
        fd = self._own_fd(name)
        try:
            return _read_fd(fd, self.paths[name], self._mmap)
        finally:
            os.close(fd)

    def ranges(self, name: str) -> ByteSource | None:
        """File ``name`` as a `FileSource`, for a format that reads it itself (an npz
        archive into its members' buffers), or None where the set maps its files (``mmap``)."""
        return None if self._mmap else FileSource(self.paths[name], fd=self._own_fd(name))

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the file
        return name in self.paths

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    def path_of(self, name: str) -> str:
        """The path of file ``name``: listed, or (a directory's file it lacks) under its root."""
        if name in self.paths or self._root is None or os.path.isabs(name):
            return self.paths.get(name, name)
        return self._root + name

    def close(self) -> None:
        """Close the files held open (buffers and maps already returned stay valid)."""
        fds = list(self._fds.values())
        if self._dir_fd is not None:
            fds.append(self._dir_fd)
        self._fds = {}
        self._dir_fd = None
        release(fds)


class FilesOf(Mapping[str, Any], Generic[_Set]):
    """A mapping over the files of a `FileSet` (or of another ``FilesOf``) whose
    values subclasses choose (`__getitem__`); membership, names and paths are the set's."""

    def __init__(self, files: _Set) -> None:
        self._files = files

    def __getitem__(self, name: str) -> Any:
        raise NotImplementedError

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def path_of(self, name: str) -> str:
        return self._files.path_of(name)


def walk(root: str | os.PathLike[str]) -> list[str]:
    """The files of a directory checkpoint as its decoder sees them (relative POSIX paths)."""
    return sorted(_walk(Path(root)))


def _walk(root: Path, *, dir_fd: int | None = None, limit: int | None = None) -> Iterator[str]:
    """Relative POSIX paths of the regular files below ``root``, skipping pytreeio's own files.

    ``root`` may itself be a symlink to a directory; below it, symlinked directories are not
    descended into and symlinked files count only when they resolve to a file inside ``root``.
    ``dir_fd``: ``root`` already open.  Each directory's files come sorted, then its
    subdirectories' (sorted, depth first).  Nesting deeper than `MAX_DEPTH` is a
    `FormatError`.
    """
    if dir_fd is None:
        fd = os.open(root, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        try:
            yield from _walk(root, dir_fd=fd, limit=limit)
        finally:
            os.close(fd)
        return
    names = _below(dir_fd, os.path.realpath(root), os.fspath(root), "")
    try:
        yield from itertools.islice(names, limit)
    finally:
        names.close()  # the descriptors of a walk left halfway


def _below(fd: int, base: str, root: str, rel_dir: str, depth: int = 0) -> Generator[str]:
    """`_walk` of the open directory ``fd`` (``rel_dir`` below the root)."""
    files, dirs = _scan(fd, base, rel_dir)
    for name in files:
        yield rel_dir + name
    for name in dirs:
        try:  # O_NOFOLLOW: one swapped for a symlink since the scan is skipped
            sub = os.open(name, _SUBDIR_FLAGS, dir_fd=fd)
        except OSError:
            continue
        try:
            if depth >= MAX_DEPTH:
                raise FormatError(
                    f"directories nested deeper than {MAX_DEPTH} levels",
                    path=os.path.join(root, f"{rel_dir}{name}/"),
                )
            yield from _below(sub, base, root, f"{rel_dir}{name}/", depth + 1)
        finally:
            os.close(sub)


def _scan(fd: int, base: str, rel_dir: str) -> tuple[list[str], list[str]]:
    """(regular files, subdirectories) of the open directory ``fd``, sorted, own files left out.

    File types come from the directory entries (``d_type``: no ``stat`` per file where the
    file system reports them).
    """
    files: list[str] = []
    dirs: list[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            name = entry.name
            if _OWN_FILE.search(name):
                continue
            try:
                if entry.is_file(follow_symlinks=False):
                    files.append(name)
                elif entry.is_dir(follow_symlinks=False):
                    dirs.append(name)
                elif entry.is_symlink():
                    real = os.path.realpath(os.path.join(base, rel_dir, name))
                    if real.startswith(base + os.sep) and os.path.isfile(real):
                        files.append(name)
            except OSError:  # gone since the listing
                continue
    return sorted(files), sorted(dirs)
