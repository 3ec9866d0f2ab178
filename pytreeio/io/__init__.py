"""All file-system access of pytreeio: probes, reads, crash-safe writes.

Interface (what :mod:`pytreeio.api` calls): :func:`probe` (what sniffers look
at; never raises for missing or unreadable paths), :func:`open_source` (a
buffer, a :class:`FileSource` or a :class:`FileSet` to decode from) and
:func:`write_atomic`.

Writing
-------
A save holds an exclusive ``flock`` on ``.<name>.pytreeio-lock`` next to each
destination file (created once, never deleted; several taken in sorted path
order, so savers never deadlock).  Under it the save finishes the journal of a
save that died and removes that destination's temporaries left by dead saves
(no live save can own one), writes each file into a temporary
``.<name>.pytreeio-tmp-<pid>-<random>`` next to it (fsync'd with ``durable``),
then replaces the destination: a ``FILE`` by ``rename``; a ``Siblings`` set by
first writing a journal ``.<first>.pytreeio-journal`` listing
``[temporary, final]`` pairs (the commit point), then the renames; a
``DIRECTORY`` by ``renameat2(RENAME_EXCHANGE)`` of a temporary directory, or
without it under a journal, ``dest -> old`` then ``tmp -> dest`` (the first
undone if the second fails).  A failure before the commit point leaves the old
checkpoint untouched.  Replaced files keep their permission bits; a symlinked
destination is written through to its target; temporary names are cut to fit
``NAME_MAX``.  ``durable=False`` skips the fsyncs and nothing else.  Without
``flock`` (some network file systems) concurrent savers are not serialised.

Reading
-------
Readers of linked ``Siblings`` and of directories take a *shared* lock while
they open every file (an open descriptor keeps reading the file it opened), so
they never interleave with a save; a journal found then belongs to a dead save
and is rolled forward (or, in a read-only directory, its temporaries are read
instead).  Directories are read through a descriptor opened under the lock.
So after a kill at any moment a load sees the complete old or the complete new
set.

A whole file is read with ``preadv`` into one fresh, uninitialised buffer
(several threads for large files); arrays decoded from it are views.  A file
that another program truncates meanwhile is a :class:`FormatError` at the
first missing byte.  ``mmap=True`` maps files instead (opt-in: such a
truncation then kills the process with SIGBUS).  :class:`FileSource` reads
just the ranges a format asks for (``inspect``, lazy views, npz archives).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import mmap as _mmap
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from pytreeio.core.binary import Buffer, BufferSource, ByteSource, Deferred, as_memoryview
from pytreeio.core.errors import EncodeError, FormatError
from pytreeio.core.records import Directory, Encoded, File, Layout, Probe, Siblings
from pytreeio.core.threads import cores, pool, share

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "probe",
    "probe_buffer",
    "open_source",
    "write_atomic",
    "write_file_atomic",
    "write_dir_atomic",
    "read_file",
    "FileSource",
    "FileSet",
    "FilesOf",
    "ChangedWhileOpen",
    "identity",
    "walk",
    "read_chunks",
    "read_head",
    "file_in_parts",
    "PartWriter",
]

T = TypeVar("T")
_Set = TypeVar("_Set", bound="FileSet | FilesOf[Any]")

# Linux caps a single write() at just under 2 GiB; stay well below it.
_MAX_WRITE = 1 << 30
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

# -- names of pytreeio's own files next to a destination --------------------
_TMP_MARK = ".pytreeio-tmp-"
_LOCK_SUFFIX = ".pytreeio-lock"
_JOURNAL_SUFFIX = ".pytreeio-journal"
#: Any of them (tests, listings); a directory listing skips these names.
_OWN_FILE = re.compile(r"\.pytreeio-(?:tmp-\d+-[0-9a-f]{8}|lock|journal)\Z")
_NAME_MAX = 255
# ".", the mark, a pid of up to 10 digits, "-" and 8 hex digits fit in 40 bytes.
_NAME_BUDGET = _NAME_MAX - 40


def _short(name: str) -> str:
    """``name``, cut (with a hash of the whole) so that our names stay within NAME_MAX."""
    raw = os.fsencode(name)
    if len(raw) <= _NAME_BUDGET:
        return name
    import hashlib  # long names only (not imported with pytreeio: import time)

    digest = hashlib.sha256(raw).hexdigest()[:16]
    return f"{os.fsdecode(raw[: _NAME_BUDGET - 17])}~{digest}"


def _aux(dest: Path, suffix: str) -> Path:
    return dest.parent / f".{_short(dest.name)}{suffix}"


def _tmp_name(dest: Path) -> Path:
    return _aux(dest, f"{_TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}")


def _tmp_pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(f".{_short(name)}{_TMP_MARK}") + r"\d+-[0-9a-f]{8}\Z")


def _lock_path(dest: Path) -> Path:
    return _aux(dest, _LOCK_SUFFIX)


def _journal_path(dest: Path) -> Path:
    return _aux(dest, _JOURNAL_SUFFIX)


def _resolve(path: Path) -> Path:
    """The file a save to ``path`` writes: a symlink's target, else ``path`` in its real directory.

    Canonical, so that every process names the same lock file the same way.
    """
    if os.path.islink(path):
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path.parent)) / path.name


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def _write_chunks(fd: int, chunks: Sequence[Buffer]) -> None:
    """Write ``chunks`` in order; :class:`Deferred` ones are produced one at a time.

    A deferred chunk's buffer is dropped before the next is produced (a
    streamed conversion holds one tensor at a time); late ones are skipped,
    then produced and written at their offsets once everything else is written.
    """
    late: list[tuple[int, Deferred]] = []
    at = 0
    for chunk in chunks:
        if isinstance(chunk, Deferred):
            if chunk.late:
                late.append((at, chunk))
                at += chunk.nbytes
                os.lseek(fd, at, os.SEEK_SET)
                continue
            chunk = _produced(chunk)
        _write_at(fd, as_memoryview(chunk), None)
        at += len(as_memoryview(chunk))
        del chunk  # a produced tensor goes before the next is read
    for offset, deferred in late:
        _write_at(fd, as_memoryview(_produced(deferred)), offset)


def _produced(chunk: Deferred) -> Buffer:
    data = chunk.produce()
    n = len(as_memoryview(data))
    if n != chunk.nbytes:
        raise EncodeError(f"a deferred chunk produced {n} bytes where {chunk.nbytes} were declared")
    return data


def _write_at(fd: int, view: memoryview, offset: int | None) -> None:
    """All of ``view``, at the file position (``offset=None``) or with pwrite at ``offset``."""
    pos = 0
    while pos < len(view):
        part = view[pos : pos + _MAX_WRITE]
        pos += os.write(fd, part) if offset is None else os.pwrite(fd, part, offset + pos)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new_file(path: Path, encoded: Encoded, durable: bool, mode: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        _write_chunks(fd, encoded.chunks)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _mode_of(path: Path) -> int | None:
    """Permission bits of an existing file (a replaced checkpoint keeps them)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return None


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def _rename(src: Path, dst: Path) -> None:
    """One commit rename of a sibling set (a seam for the crash tests)."""
    os.replace(src, dst)


def _check_parent(dest: Path) -> None:
    if not os.path.isdir(dest.parent):
        raise FileNotFoundError(
            errno.ENOENT, "No such directory to save into", os.fspath(dest.parent)
        )


# --------------------------------------------------------------------------
# locks
# --------------------------------------------------------------------------

_RETRIES = 20


def _open_lock(path: Path, create: bool) -> int | None:
    """A descriptor of the lock file, or None (absent and not created, or not openable)."""
    if fcntl is None:
        return None
    if create:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o666)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
    try:
        return os.open(path, os.O_RDONLY | _O_CLOEXEC)
    except OSError:
        return None


def _flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op)
        return True
    except OSError as exc:  # no flock on this file system: go on unserialised
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            return False
        raise


def _release(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)  # closing the last descriptor drops the flock


def _lock_all(dests: Iterable[Path], *, exclusive: bool) -> tuple[list[int], list[Path]]:
    """flock the lock files of ``dests`` in sorted order; (held fds, lock files that are absent).

    Exclusive locks create their lock files; shared ones only open existing ones.
    """
    held: list[int] = []
    absent: list[Path] = []
    op = 0 if fcntl is None else fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        for lock in sorted({_lock_path(d) for d in dests}, key=os.fspath):
            fd = _open_lock(lock, create=exclusive)
            if fd is None:
                absent.append(lock)
                continue
            held.append(fd)
            _flock(fd, op)
    except BaseException:
        _release(held)
        raise
    return held, absent


# --------------------------------------------------------------------------
# journals
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Journal:
    """A committed multi-rename: ``(src, dst, aside)`` names in ``directory``, then removals."""

    path: Path
    renames: tuple[tuple[str, str, str | None], ...]
    removes: tuple[str, ...]

    @property
    def directory(self) -> Path:
        return self.path.parent

    @property
    def dests(self) -> set[Path]:
        return {self.directory / dst for _src, dst, _aside in self.renames}

    def substitutes(self) -> dict[Path, Path]:
        """Where the new content of each destination is while the renames are unfinished."""
        out = {}
        for src, dst, _aside in self.renames:
            if os.path.lexists(self.directory / src):
                out[self.directory / dst] = self.directory / src
        return out


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name


def _read_journal(path: Path) -> _Journal | None:
    """The journal at ``path`` if it is one pytreeio wrote (strictly checked), else None.

    Only renames of our own temporaries over the names they were made for, in
    the journal's directory, are accepted: a planted journal can do nothing else.
    """
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 20))
        if not isinstance(doc, dict) or doc.get("pytreeio") != "journal" or doc.get("version") != 1:
            return None
        renames = []
        for entry in doc["renames"]:
            src, dst, aside = entry
            if not (_plain_name(src) and _plain_name(dst)):
                return None
            pattern = _tmp_pattern(dst)
            if not pattern.match(src) or (aside is not None and not pattern.match(aside)):
                return None
            renames.append((src, dst, aside))
        if not renames or path.name != f".{_short(renames[0][1])}{_JOURNAL_SUFFIX}":
            return None
        patterns = [_tmp_pattern(dst) for _s, dst, _a in renames]
        removes = tuple(doc["remove"])
        if not all(_plain_name(r) and any(p.match(r) for p in patterns) for r in removes):
            return None
        return _Journal(path, tuple(renames), removes)
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None


def _write_journal(
    dest: Path,
    renames: Sequence[tuple[Path, Path, Path | None]],
    removes: Sequence[Path],
    durable: bool,
) -> Path:
    """Atomically create the journal of a save to ``dest``: the commit point."""
    doc = {
        "pytreeio": "journal",
        "version": 1,
        "renames": [[s.name, d.name, a.name if a is not None else None] for s, d, a in renames],
        "remove": [r.name for r in removes],
    }
    path = _journal_path(dest)
    tmp = _tmp_name(dest)
    try:
        _write_new_file(tmp, Encoded((json.dumps(doc).encode(),)), durable)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    if durable:
        _fsync_dir(dest.parent)
    return path


def _apply_journal(journal: _Journal, durable: bool = True) -> None:
    """Finish a journal's renames (idempotent; caller holds the exclusive locks)."""
    d = journal.directory
    for src, dst, aside in journal.renames:
        if not os.path.lexists(d / src):
            continue  # already renamed
        if aside is not None and os.path.lexists(d / dst):
            os.rename(d / dst, d / aside)
        os.replace(d / src, d / dst)
    if durable:
        _fsync_dir(d)
    for name in journal.removes:
        _remove_quietly(d / name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal.path)


def _roll_forward(journal_path: Path) -> bool:
    """Finish the journal a dead saver left (exclusive locks on its files); False if we cannot."""
    journal = _read_journal(journal_path)
    if journal is None:
        return False
    try:
        held, _ = _lock_all(journal.dests, exclusive=True)
    except OSError:
        return False
    try:
        journal = _read_journal(journal_path)  # it may be gone, finished by someone else
        if journal is not None:
            _apply_journal(journal)
        return True
    except OSError:
        return False
    finally:
        _release(held)


def _clean_stale(dests: Sequence[Path]) -> None:
    """Remove temporaries of ``dests`` (caller holds their locks: none can be live)."""
    by_dir: dict[Path, list[re.Pattern[str]]] = {}
    for dest in dests:
        by_dir.setdefault(dest.parent, []).append(_tmp_pattern(dest.name))
    for directory, patterns in by_dir.items():
        try:
            with os.scandir(directory) as it:
                names = [e.name for e in it if e.name.startswith(".")]
        except OSError:
            continue
        for name in names:
            if any(p.match(name) for p in patterns):
                _remove_quietly(directory / name)


@contextlib.contextmanager
def _saving(dests: Sequence[Path], durable: bool) -> Iterator[None]:
    """Hold the exclusive locks of ``dests``, after recovering from dead saves to them."""
    extra: set[Path] = set()
    for _ in range(_RETRIES):
        held, _absent = _lock_all(set(dests) | extra, exclusive=True)
        try:
            journals: list[tuple[Path, _Journal | None]] = []
            for dest in dests:
                jp = _journal_path(dest)
                if os.path.lexists(jp):
                    journals.append((jp, _read_journal(jp)))
            need = set().union(*(j.dests for _p, j in journals if j is not None))
            if not need <= set(dests) | extra:
                extra |= need
                continue  # lock those files too, then look again
            for jp, journal in journals:
                if journal is None:
                    _remove_quietly(jp)  # not a journal of ours
                else:
                    _apply_journal(journal, durable)
            _clean_stale(dests)
            yield
            return
        finally:
            _release(held)
    raise OSError(errno.EAGAIN, "journals kept changing while locking", os.fspath(dests[0]))


def _read_locked(
    dests: Sequence[Path],
    opener: Callable[[Mapping[Path, Path]], T],
    discard: Callable[[T], None],
) -> T:
    """``opener(substitutes)`` under shared locks on ``dests``, after recovering dead saves.

    ``substitutes`` maps a destination to the temporary holding its new
    content when a dead save's journal could not be rolled forward.
    """
    rolled = False
    for _ in range(_RETRIES):
        held, absent = _lock_all(dests, exclusive=False)
        try:
            pending = [
                j
                for j in (_read_journal(_journal_path(d)) for d in dests if _journal_lexists(d))
                if j is not None
            ]
            if not pending or rolled:
                subst: dict[Path, Path] = {}
                for journal in pending:
                    subst.update(journal.substitutes())
                result = opener(subst)
                if any(os.path.lexists(lock) for lock in absent):
                    discard(result)  # a saver started meanwhile: open again, locked
                    continue
                return result
        finally:
            _release(held)
        rolled = True
        for journal in pending:
            _roll_forward(journal.path)
    raise OSError(errno.EAGAIN, "the checkpoint kept changing while it was opened", str(dests[0]))


def _journal_lexists(dest: Path) -> bool:
    return os.path.lexists(_journal_path(dest))


# --------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------


def _write_files(items: Sequence[tuple[Path, Encoded]], durable: bool) -> None:
    """Write one file or a sibling set (one directory) as one atomic step."""
    dests = [_resolve(Path(p)) for p, _ in items]
    if len(set(dests)) != len(dests):
        raise ValueError(f"two roles name the same file: {[os.fspath(d) for d in dests]}")
    if len({d.parent for d in dests}) > 1:
        raise ValueError(
            "sibling files must lie in one directory: " + ", ".join(os.fspath(d) for d in dests)
        )
    for dest in dests:
        if os.path.isdir(dest):
            raise IsADirectoryError(
                errno.EISDIR, "cannot replace a directory with a file", os.fspath(dest)
            )
    _check_parent(dests[0])
    parent = dests[0].parent
    with _saving(dests, durable):
        temps: list[Path] = []
        committed = False
        try:
            for dest, (_p, encoded) in zip(dests, items):
                if encoded.files is not None:
                    raise TypeError(f"{dest.name}: a file's encoding has files, not chunks")
                tmp = _tmp_name(dest)
                temps.append(tmp)
                _write_new_file(tmp, encoded, durable, _mode_of(dest))
            if len(dests) == 1:
                _rename(temps[0], dests[0])
            else:
                journal = _write_journal(
                    dests[0], [(t, d, None) for t, d in zip(temps, dests)], [], durable
                )
                committed = True
                for tmp, dest in zip(temps, dests):
                    _rename(tmp, dest)
                if durable:
                    _fsync_dir(parent)
                os.unlink(journal)
                return
        except BaseException:
            if committed:
                # Past the commit point the new set wins: finish it if we can
                # (otherwise the next load or save does).
                with contextlib.suppress(Exception):
                    j = _read_journal(_journal_path(dests[0]))
                    if j is not None:
                        _apply_journal(j, durable)
            else:
                for tmp in temps:
                    _remove_quietly(tmp)
                if len(dests) > 1:  # written, but its directory fsync failed: void now
                    _remove_quietly(_journal_path(dests[0]))
            raise
    if durable:
        _fsync_dir(parent)


def write_file_atomic(
    path: str | os.PathLike[str], encoded: Encoded, *, durable: bool = True
) -> None:
    """Write a single-file encoding to ``path`` atomically."""
    _write_files([(Path(path), encoded)], durable)


@contextlib.contextmanager
def file_in_parts(path: str | os.PathLike[str], size: int, durable: bool = True) -> Iterator[Path]:
    """A temporary of ``size`` bytes for a single-file checkpoint that several writers fill.

    Yields the temporary's path (next to the destination, under the
    destination's lock, after recovering from dead saves as every save does);
    writers open it and ``pwrite`` their ranges (:func:`pytreeio.multihost.save_in_parts`).
    When the block exits normally the file is fsync'd (``durable``) and renamed
    over ``path``; when it raises the temporary is removed and the old
    checkpoint stays.
    """
    dest = _resolve(Path(path))
    if os.path.isdir(dest):
        raise IsADirectoryError(
            errno.EISDIR, "cannot replace a directory with a file", os.fspath(dest)
        )
    _check_parent(dest)
    with _saving([dest], durable):
        tmp = _tmp_name(dest)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        try:
            try:
                mode = _mode_of(dest)
                if mode is not None:
                    os.fchmod(fd, mode)
                os.ftruncate(fd, size)
                yield tmp
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            _rename(tmp, dest)
        except BaseException:
            _remove_quietly(tmp)
            raise
    if durable:
        _fsync_dir(dest.parent)


class PartWriter:
    """One writer's descriptor of a :func:`file_in_parts` temporary, writing at offsets."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDWR | _O_CLOEXEC)

    def write_at(self, offset: int, data: Buffer) -> None:
        _write_at(self._fd, as_memoryview(data), offset)

    def read_at(self, offset: int, n: int) -> memoryview:
        """``n`` bytes written at ``offset`` (read back, e.g. to hash them)."""
        view = np.empty(n, dtype=np.uint8).data
        _read_range(self._fd, view, offset, self.path, "data")
        return view

    def close(self, *, durable: bool = False) -> None:
        """Close, fsync'ing first with ``durable`` (for file systems that flush per writer)."""
        if self._fd >= 0:
            try:
                if durable:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: A directory holding at least this many bytes, in at least two files of at least
#: :data:`_PARALLEL_FILE_MIN`, is written on one thread per core (a file each at a time).
#: Page-cache writes of different files run in parallel where one file's do not (the
#: kernel serialises writes to one inode).  Measured on 2 cores against one raw writer:
#: bullet's raw save 0.87x -> 1.35x, its quantised save 0.76x -> 0.98x; cl-waffe2's
#: (transposed weights, each band made by the writing thread, still in its cache when
#: written) 243 -> 228 ms for 537 MB: its transposes, not its writes, bound it.
_PARALLEL_DIR_MIN = 64 << 20
_PARALLEL_FILE_MIN = 4 << 20


def _populate_dir(root: Path, encoded: Encoded, durable: bool) -> None:
    """Write every file of ``encoded`` under ``root`` (a fresh directory), several at a time when large.

    Files are taken largest first by :func:`_file_writers` threads.  A
    streaming conversion into a directory then holds one tensor per writing
    thread instead of one in all.
    """
    assert encoded.files is not None
    made: set[Path] = {root}
    targets: list[tuple[Path, Encoded]] = []
    for rel, sub in encoded.files.items():
        target = root.joinpath(*rel.split("/"))
        if root not in target.parents or ".." in rel.split("/"):
            raise ValueError(f"refusing to write {rel!r} outside the checkpoint directory")
        if target.parent not in made:
            target.parent.mkdir(parents=True, exist_ok=True)
            made.add(target.parent)
        targets.append((target, sub))
    workers = _file_writers([sub.nbytes for _, sub in targets])
    if workers > 1:

        def write(item: tuple[Path, Encoded]) -> None:
            _write_new_file(item[0], item[1], durable)

        targets.sort(key=lambda t: t[1].nbytes, reverse=True)
        share(pool(), workers, write, targets)
    else:
        for target, sub in targets:
            _write_new_file(target, sub, durable)
    if durable:
        for d in sorted(made, key=lambda p: len(p.parts), reverse=True):
            _fsync_dir(d)


def _file_writers(sizes: Sequence[int]) -> int:
    """Threads to write files of ``sizes`` with: one per core when several files are large."""
    large = sum(1 for n in sizes if n >= _PARALLEL_FILE_MIN)
    if large < 2 or sum(sizes) < _PARALLEL_DIR_MIN:
        return 1
    return min(cores(), large)


def _renameat2_exchange() -> Any:
    import ctypes.util  # here, not at import: it costs more than the rest of pytreeio

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
    import ctypes

    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


def write_dir_atomic(
    path: str | os.PathLike[str], encoded: Encoded, *, durable: bool = True
) -> None:
    """Write a directory encoding, replacing any existing directory as a whole."""
    if encoded.files is None:
        raise TypeError("a directory format returned a single-file encoding")
    dest = _resolve(Path(path))
    if os.path.lexists(dest) and not os.path.isdir(dest):
        raise NotADirectoryError(
            errno.ENOTDIR, "cannot replace a file with a directory", os.fspath(dest)
        )
    _check_parent(dest)
    with _saving([dest], durable):
        tmp = _tmp_name(dest)
        try:
            tmp.mkdir()
            _populate_dir(tmp, encoded, durable)
            if not os.path.lexists(dest):
                os.rename(tmp, dest)
            else:
                mode = _mode_of(dest)
                if mode is not None:
                    os.chmod(tmp, mode)
                if _exchange(tmp, dest):
                    if durable:
                        _fsync_dir(dest.parent)
                    _remove_quietly(tmp)  # now the previous checkpoint
                    return
                _swap_without_exchange(tmp, dest, durable)
                return
        except _HalfSwapped:
            raise  # the journal needs tmp: the next load or save installs it
        except BaseException:
            _remove_quietly(tmp)
            raise
    if durable:
        _fsync_dir(dest.parent)


class _HalfSwapped(OSError):
    """A directory swap failed half-way and could not be undone; its journal finishes it."""


def _swap_without_exchange(tmp: Path, dest: Path, durable: bool) -> None:
    """``dest -> old``, ``tmp -> dest`` under a journal; undo the first if the second fails."""
    old = _tmp_name(dest)
    journal = _write_journal(dest, [(tmp, dest, old)], [old], durable)
    try:
        os.rename(dest, old)
    except BaseException:
        os.unlink(journal)
        raise
    try:
        os.rename(tmp, dest)
    except BaseException:
        try:
            os.rename(old, dest)  # roll back: the old checkpoint is in place again
        except OSError as undo:
            raise _HalfSwapped(
                errno.EIO,
                "directory swap failed half-way and could not be undone; the next load or "
                "save of this path completes it",
                os.fspath(dest),
            ) from undo
        os.unlink(journal)
        raise
    if durable:
        _fsync_dir(dest.parent)
    os.unlink(journal)
    _remove_quietly(old)


def write_atomic(
    path: str | os.PathLike[str], encoded: Encoded, layout: Layout, *, durable: bool = True
) -> None:
    """Write ``encoded`` at ``path`` in ``layout`` (see the module docstring for the guarantees).

    Args:
      path: the destination as the caller gave it (a file, a directory, or
        the path ``layout.locate`` maps to sibling files).
      encoded: a format's output; ``chunks`` for ``FILE``, ``files`` otherwise
        (relative POSIX paths for ``DIRECTORY``, roles for ``Siblings``).
      layout: :data:`~pytreeio.core.records.FILE`, a
        :class:`~pytreeio.core.records.Siblings` value or
        :data:`~pytreeio.core.records.DIRECTORY`.
      durable: fsync files and directories; ``False`` keeps everything else.

    An ``OSError`` that names no file (``ENOSPC`` from a write, say) is
    re-raised naming ``path``.
    """
    try:
        _write_atomic(path, encoded, layout, durable)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), os.fspath(path)) from exc


def _write_atomic(
    path: str | os.PathLike[str], encoded: Encoded, layout: Layout, durable: bool
) -> None:
    if isinstance(layout, File):
        if encoded.files is not None:
            raise TypeError("a single-file format returned a multi-file encoding")
        _write_files([(Path(path), encoded)], durable)
    elif isinstance(layout, Directory):
        write_dir_atomic(path, encoded, durable=durable)
    elif isinstance(layout, Siblings):
        if encoded.files is None:
            raise TypeError("a sibling-files format returned a single-file encoding")
        located = {role: Path(p) for role, p in layout.locate(Path(path)).items()}
        unknown = sorted(set(encoded.files) - set(located))
        if unknown:
            raise ValueError(f"the encoding has files for roles {unknown} that locate() lacks")
        missing = sorted(set(layout.linked) - set(encoded.files))
        if missing:
            raise ValueError(f"linked role(s) {missing} missing from the encoding")
        order = [r for r in layout.roles if r in encoded.files]
        order += [r for r in encoded.files if r not in order]
        if order:
            _write_files([(located[r], encoded.files[r]) for r in order], durable)
    else:
        raise TypeError(f"unknown layout {layout!r}")


# --------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------


# Ranges at least this large are read by several threads: filling fresh memory
# costs a page fault and a kernel zero-fill per page, which a single reader
# pays serially.
_PARALLEL_MIN = 64 << 20
#: Buffers one ``preadv`` may fill (POSIX guarantees 16; Linux and macOS allow 1024).
IOV_MAX = 1024 if sys.platform.startswith(("linux", "darwin")) else 16
_PARALLEL_BLOCK = 16 << 20


def _read_range(fd: int, view: memoryview, offset: int, name: str, field: str) -> None:
    """Fill ``view`` from the file at ``offset`` (pread: no shared seek).

    A file that ends first was truncated by another program while it was read:
    a :class:`FormatError` at the first byte missing.
    """
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
    """:func:`_read_range`, in blocks on several threads when ``view`` is large."""
    size = len(view)
    if size < _PARALLEL_MIN:
        _read_range(fd, view, offset, name, field)
        return

    def block(start: int) -> None:
        part = view[start : start + _PARALLEL_BLOCK]
        _read_range(fd, part, offset + start, name, field)

    share(pool(), cores(), block, range(0, size, _PARALLEL_BLOCK))


def _read_fd(fd: int, name: str, mmap: bool) -> memoryview:
    """The whole file behind ``fd``: read once into fresh memory, or mapped read-only."""
    size = os.fstat(fd).st_size
    if mmap:
        if size == 0:
            return memoryview(b"")
        return memoryview(_mmap.mmap(fd, 0, access=_mmap.ACCESS_READ))
    # np.empty leaves the pages untouched until the reads fill them
    # (bytearray(size) would zero-fill them first).
    view = np.empty(size, dtype=np.uint8).data
    _read_ranges(fd, view, 0, name, "file")
    return view


def read_file(path: str | os.PathLike[str], *, mmap: bool = False) -> memoryview:
    """The whole file as a memoryview: read once into fresh memory, or mapped read-only
    (``mmap``: a file truncated by another program meanwhile then raises SIGBUS when touched)."""
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY | _O_CLOEXEC)
    try:
        return _read_fd(fd, p, mmap)
    finally:
        os.close(fd)


class FileSource(ByteSource):
    """A :class:`ByteSource` that ``pread``\\ s ranges of a file on demand (never maps it).

    ``fd``: an open descriptor of ``path`` to use (and close) instead of opening it.
    """

    def __init__(self, path: str | os.PathLike[str], *, fd: int | None = None) -> None:
        self.name = os.fspath(path)
        self._fd = -1
        self._fd = fd if fd is not None else os.open(self.name, os.O_RDONLY | _O_CLOEXEC)
        self.size = os.fstat(self._fd).st_size
        self.bytes_read = 0

    def _read(self, offset: int, n: int) -> memoryview:
        view = np.empty(n, dtype=np.uint8).data  # uninitialised: no zero-fill
        _read_ranges(self._fd, view, offset, self.name, "data")
        return view

    def read_into(self, offset: int, out: memoryview, field: str) -> None:
        """Fill ``out`` with the bytes at ``offset`` (``pread`` straight into the caller's buffer)."""
        n = len(out)
        self._check_range(offset, n, field)
        _read_ranges(self._fd, out.cast("B"), offset, self.name, field)
        self.bytes_read += n

    def _check_range(self, offset: int, n: int, field: str) -> None:
        if offset < 0 or offset + n > self.size:
            raise FormatError(
                f"truncated: needs {n} bytes at offset {offset}, file has {self.size}",
                path=self.name,
                field=field,
                offset=offset,
            )

    def read_scattered(self, offset: int, buffers: Sequence[memoryview], field: str) -> None:
        """Fill ``buffers`` one after another from the file at ``offset``, one ``preadv`` per
        :data:`IOV_MAX` buffers (a short read finishes buffer by buffer)."""
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

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# Up to this many files of a directory are opened while the shared lock is
# held; the others are opened on access, relative to the directory's
# descriptor (so never from a directory swapped in later).
_EAGER_OPEN = 128


class ChangedWhileOpen(FileNotFoundError):
    """A file a :class:`FileSet` listed when it was opened is gone when read: the checkpoint
    was replaced or changed since (a save elsewhere removed the files of the one it replaced).

    :func:`pytreeio.load`, :func:`pytreeio.inspect` and :func:`pytreeio.verify` open the
    checkpoint again when they meet it (three times in all, then raise it); a lazy view
    (:func:`pytreeio.open`) holds every file it read a header of and never meets it there.
    """


class FileSet(Mapping[str, Any]):
    """Named files of a checkpoint, read on access.

    Keys are a directory's relative POSIX paths (:meth:`directory`) or a
    sibling layout's roles.  ``headers=True`` yields :class:`FileSource`
    objects instead of whole buffers (for ``inspect``).  Files may be held
    open (:func:`open_source` opens them while it holds the lock, so that a
    later save cannot mix into what is read); :meth:`close` releases them.
    """

    def __init__(
        self,
        paths: Mapping[str, str | os.PathLike[str]],
        *,
        mmap: bool = False,
        headers: bool = False,
        fds: Mapping[str, int] | None = None,
        dir_fd: int | None = None,
    ) -> None:
        # strings: a directory of thousands of files would spend more on Path objects
        self.paths = {k: os.fspath(v) for k, v in paths.items()}
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
        dir_fd = os.open(base, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        fds: dict[str, int] = {}
        try:
            if not stat.S_ISDIR(os.fstat(dir_fd).st_mode):  # no O_DIRECTORY on this platform
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", os.fspath(base))
            names = sorted(_walk(base, dir_fd=dir_fd))
            for name in names[:_EAGER_OPEN]:
                fd = _open_regular(name, dir_fd)
                if fd is not None:
                    fds[name] = fd
        except BaseException:
            _release([*fds.values(), dir_fd])
            raise
        prefix = os.path.join(base, "")  # the root and one separator: names are POSIX paths
        paths = {n: prefix + n for n in names}
        return cls(paths, mmap=mmap, headers=headers, fds=fds, dir_fd=dir_fd)

    def _own_fd(self, name: str) -> int:
        """A descriptor of file ``name`` of its own (the caller closes it)."""
        path = self.paths[name]
        fd = self._fds.get(name)
        if fd is not None:
            return os.dup(fd)
        if self._dir_fd is not None:
            return self._open_listed(name, path)
        return os.open(path, os.O_RDONLY | _O_CLOEXEC)

    def __getitem__(self, name: str) -> Any:
        if self._headers:
            return FileSource(self.paths[name], fd=self._own_fd(name))
        fd = self._own_fd(name)
        try:
            return _read_fd(fd, self.paths[name], self._mmap)
        finally:
            os.close(fd)

    def ranges(self, name: str) -> FileSource | None:
        """File ``name`` as a :class:`FileSource`, for a format that reads it itself (an npz
        archive into its members' buffers), or None where the set maps its files (``mmap``)."""
        return None if self._mmap else FileSource(self.paths[name], fd=self._own_fd(name))

    def _open_listed(self, name: str, path: str) -> int:
        """A descriptor of ``name``, a file the directory held when it was listed, opened
        relative to that directory (so never from one swapped in since)."""
        assert self._dir_fd is not None
        try:
            return os.open(name, os.O_RDONLY | _O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            raise ChangedWhileOpen(
                errno.ENOENT,
                "gone since the checkpoint was opened: it was replaced or changed meanwhile "
                "(a concurrent save?)",
                path,
            ) from None
        except OSError as exc:
            raise type(exc)(exc.errno, exc.strerror, path) from None

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the file
        return name in self.paths

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    def path_of(self, name: str) -> str:
        return self.paths[name]

    def close(self) -> None:
        """Close the files held open (buffers and maps already returned stay valid)."""
        fds = list(self._fds.values())
        if self._dir_fd is not None:
            fds.append(self._dir_fd)
        self._fds = {}
        self._dir_fd = None
        _release(fds)

    def __enter__(self) -> FileSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class FilesOf(Mapping[str, Any], Generic[_Set]):
    """A mapping over the files of a :class:`FileSet` (or of another ``FilesOf``) whose
    values subclasses choose (:meth:`__getitem__`); membership, names and paths are the set's."""

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


def identity(path: str | os.PathLike[str], layout: Layout) -> tuple[Any, ...]:
    """What a save changes of the checkpoint at ``path``: device, inode, size and mtime of
    each path ``layout`` names (a save renames new files or a new directory into place), None
    for one that is absent; empty when the layout cannot locate its files."""
    try:
        located = (
            list(layout.locate(Path(path)).values())
            if isinstance(layout, Siblings)
            else [Path(path)]
        )
    except Exception:  # a layout's own locate failing: nothing to compare
        return ()
    out: list[Any] = []
    for p in located:
        try:
            st = os.stat(p)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _open_regular(path: str | os.PathLike[str], dir_fd: int | None = None) -> int | None:
    """A descriptor of a regular file (never blocks on FIFOs); None if absent or not a file."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def walk(root: str | os.PathLike[str]) -> list[str]:
    """The files of a directory checkpoint as its decoder sees them (relative POSIX paths)."""
    return sorted(_walk(Path(root)))


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


def _walk(root: Path, *, dir_fd: int | None = None, limit: int | None = None) -> Iterator[str]:
    """Relative POSIX paths of the regular files below ``root``, skipping pytreeio's own files.

    ``root`` may itself be a symlink to a directory; below it, symlinked
    directories are not descended into and symlinked files count only when
    they resolve to a file inside ``root``.  ``dir_fd``: ``root`` already open.
    Each directory's files come sorted, then its subdirectories' (sorted, depth
    first).  Nesting deeper than :data:`MAX_DEPTH` is a :class:`FormatError`.
    """
    if dir_fd is None:
        fd = os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
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


#: Directory levels below a checkpoint's root that a walk descends (checkpoints use two or three).
MAX_DEPTH = 64
_SUBDIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def _below(fd: int, base: str, root: str, rel_dir: str, depth: int = 0) -> Iterator[str]:
    """:func:`_walk` of the open directory ``fd`` (``rel_dir`` below the root)."""
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

    File types come from the directory entries (``d_type``: no ``stat`` per file
    where the file system reports them).
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
    files.sort()
    dirs.sort()
    return files, dirs


# --------------------------------------------------------------------------
# probes
# --------------------------------------------------------------------------

_HEAD = 4096
_MAX_MEMBERS = 65_536
_MAX_NAMES = 10_000
_MAX_HEADS = 32


def _zip_members(source: ByteSource) -> tuple[str, ...] | None:
    """A ZIP's member names (at most ``_MAX_MEMBERS``), or None when they cannot be read.

    :func:`pytreeio.containers.zip.member_names` reads the end records and the central
    directory only (bounded); a hostile archive costs at most that.
    """
    from pytreeio.containers.zip import member_names

    try:
        names = member_names(source)
        return tuple(str(n) for n in names[:_MAX_MEMBERS])
    except Exception:
        return None


def _probe_source(path: Path, src: ByteSource) -> Probe:
    """The ``FILE`` probe of a readable file's content (on disk or in memory)."""
    head = bytes(src.read(0, min(_HEAD, src.size), "head")) if src.size else b""
    members = _zip_members(src) if head[:4] == b"PK\x03\x04" else None
    return Probe(path, kind="file", head=head, size=src.size, members=members)


def _probe_file(path: Path) -> Probe:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return Probe(path, kind="missing")
    if stat.S_ISDIR(st.st_mode):
        return Probe(path, kind="dir")
    if not stat.S_ISREG(st.st_mode):
        return Probe(path, kind="file", size=0)
    try:
        fd = _open_regular(path)
    except OSError:
        fd = None
    if fd is None:  # unreadable (or replaced meanwhile): what stat said, no bytes
        return Probe(path, kind="file", size=st.st_size)
    with FileSource(path, fd=fd) as src:
        return _probe_source(path, src)


def _listing_probe(
    path: Path, names: Sequence[str], head_of: Callable[[str], bytes | None]
) -> Probe:
    """The ``DIRECTORY`` probe of a listing; ``head_of(name)`` reads a file's first bytes."""
    heads: dict[str, bytes] = {}
    for name in names:
        if len(heads) >= _MAX_HEADS:
            break
        if "/" in name or not name.lower().endswith((".json", ".txt")):
            continue
        head = head_of(name)
        if head is not None:
            heads[name] = head
    return Probe(path, kind="dir", names=frozenset(names), heads=heads)


def _disk_head(root: Path, name: str) -> bytes | None:
    try:
        fd = _open_regular(root / name)
    except OSError:
        return None
    if fd is None:
        return None
    try:
        return os.pread(fd, _HEAD, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def _probe_dir(path: Path) -> Probe:
    if not os.path.isdir(path):
        return _probe_file(path)
    names: list[str] = []
    try:
        names.extend(_walk(path, limit=_MAX_NAMES))
    except OSError:  # unreadable: a directory all the same (opening it says why)
        return Probe(path, kind="dir", names=frozenset())
    except FormatError:  # nested too deep: sniffed by the names listed (opening it says why)
        pass
    return _listing_probe(path, names, lambda name: _disk_head(path, name))


def _probe_with(
    p: Path,
    layout: Layout,
    probe_file: Callable[[Path], Probe],
    probe_dir: Callable[[Path], Probe],
) -> Probe:
    """:func:`probe`'s choice of probes by layout, over any file system."""
    if isinstance(layout, Directory):
        return probe_dir(p)
    base = probe_file(p)
    if not isinstance(layout, Siblings):
        return base
    try:
        located = {role: Path(rp) for role, rp in layout.locate(p).items()}
    except (OSError, ValueError):
        located = {}
    siblings: dict[str, Probe] = {}
    for role, rp in located.items():
        sib = base if rp == p else probe_file(rp)
        if sib.kind == "file":
            siblings[role] = sib
    return replace(base, siblings=siblings)


def probe(
    path: str | os.PathLike[str], layout: Layout, *, made: dict[Path, Probe] | None = None
) -> Probe:
    """What sniffing sees of ``path`` for ``layout`` (never raises for missing/unreadable paths).

    ``FILE``: kind, the first 4 KiB, the size, and the ZIP member names when
    the file starts with a ZIP local header.  ``DIRECTORY``: the relative
    POSIX names of the files below (at most 10,000; pytreeio's temporaries
    and symlinks leaving the directory skipped) and the first 4 KiB of up to
    32 top-level ``*.json``/``*.txt`` files.  ``Siblings``: the FILE probe of
    ``path`` itself plus a FILE probe of each located role that is a file.

    ``made``: the FILE probes of one round of sniffing so far, by path, reused
    and filled (every layout probes ``path`` itself again otherwise: about
    60 us each).
    """
    if made is None:
        return _probe_with(Path(path), layout, _probe_file, _probe_dir)
    memo = made

    def probe_file(p: Path) -> Probe:
        found = memo.get(p)
        if found is None:
            found = memo[p] = _probe_file(p)
        return found

    def probe_dir(p: Path) -> Probe:
        return _probe_dir(p) if os.path.isdir(p) else probe_file(p)

    return _probe_with(Path(path), layout, probe_file, probe_dir)


def probe_buffer(
    path: str | os.PathLike[str], files: Mapping[str | os.PathLike[str], Buffer], layout: Layout
) -> Probe:
    """:func:`probe` of ``path`` over an in-memory file system (for fuzzing the sniffers).

    ``files`` maps each file's path to its content; a directory exists where
    some file lies below it.  The probe is the one :func:`probe` builds for
    the same files on disk (same heads, sizes, ZIP members, listings).
    """
    store = {Path(k).as_posix(): v for k, v in files.items()}

    def probe_file(p: Path) -> Probe:
        key = p.as_posix()
        if key in store:
            return _probe_source(p, BufferSource(store[key], name=os.fspath(p)))
        prefix = key.rstrip("/") + "/"
        if any(k.startswith(prefix) for k in store):
            return Probe(p, kind="dir")
        return Probe(p, kind="missing")

    def probe_dir(p: Path) -> Probe:
        prefix = p.as_posix().rstrip("/") + "/"
        below = [k[len(prefix) :] for k in store if k.startswith(prefix)]
        below = [n for n in below if not any(_OWN_FILE.search(part) for part in n.split("/"))]
        if not below:
            return probe_file(p)
        # the order of a top-down walk: a directory's files (sorted), then its subdirectories
        below.sort(key=lambda n: [(1, d) for d in n.split("/")[:-1]] + [(0, n.rsplit("/", 1)[-1])])
        names = below[:_MAX_NAMES]
        return _listing_probe(p, names, lambda n: bytes(as_memoryview(store[prefix + n])[:_HEAD]))

    return _probe_with(Path(path), layout, probe_file, probe_dir)


# --------------------------------------------------------------------------
# opening sources
# --------------------------------------------------------------------------


def _not_found(path: Path, looked_for: Iterable[Path] = ()) -> FileNotFoundError:
    names = [os.fspath(p) for p in looked_for]
    if not names or names == [os.fspath(path)]:
        return FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))
    listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    return FileNotFoundError(
        errno.ENOENT, f"No such file or directory (looked for {listed})", os.fspath(path)
    )


def _open_roles(
    located: Mapping[str, Path], subst: Mapping[Path, Path], mmap: bool, headers: bool
) -> FileSet:
    fds: dict[str, int] = {}
    paths: dict[str, Path] = {}
    try:
        for role, p in located.items():
            actual = subst.get(_resolve(p), p) if subst else p
            fd = _open_regular(actual)
            if fd is not None:
                fds[role] = fd
                paths[role] = p
    except BaseException:
        _release(fds.values())
        raise
    return FileSet(paths, mmap=mmap, headers=headers, fds=fds)


def _open_file(p: Path, mmap: bool, headers: bool) -> Any:
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise _not_found(p) from None
    if stat.S_ISDIR(st.st_mode):
        raise FormatError("is a directory, not a file", path=os.fspath(p))
    if not stat.S_ISREG(st.st_mode):
        raise FormatError("not a regular file", path=os.fspath(p))
    return FileSource(p) if headers else read_file(p, mmap=mmap)


def _open_dir(p: Path, mmap: bool, headers: bool) -> FileSet:
    dest = _resolve(p)

    def opener(subst: Mapping[Path, Path]) -> FileSet:
        root = subst.get(dest, p)
        try:
            return FileSet.directory(root, mmap=mmap, headers=headers)
        except FileNotFoundError:
            raise _not_found(p) from None
        except NotADirectoryError:
            raise FormatError("is a file, not a directory", path=os.fspath(p)) from None

    return _read_locked([dest], opener, FileSet.close)


def _open_siblings(p: Path, layout: Siblings, mmap: bool, headers: bool) -> FileSet:
    located = {role: Path(rp) for role, rp in layout.locate(p).items()}

    def opener(subst: Mapping[Path, Path]) -> FileSet:
        return _open_roles(located, subst, mmap, headers)

    if layout.linked:
        found = _read_locked([_resolve(rp) for rp in located.values()], opener, FileSet.close)
    else:
        found = opener({})
    if not len(found):
        raise _not_found(p, located.values())
    linked = [r for r in layout.linked if r in located]
    if any(r not in found for r in linked):  # half a set: never decode it
        found.close()
        present = [os.fspath(located[r]) for r in linked if r in found]
        err = _not_found(p, [located[r] for r in linked])
        err.strerror = f"{(err.strerror or '')[:-1]}; only {' and '.join(present)} exists)"
        raise err
    return found


def open_source(
    path: str | os.PathLike[str], layout: Layout, *, mmap: bool = False, headers: bool = False
) -> Any:
    """What a format's ``decode`` (or ``inspect``, ``headers=True``) reads from.

    ``FILE``: the file's bytes (a :class:`FileSource` with ``headers``).
    ``DIRECTORY``: a :class:`FileSet` of the files below ``path``.
    ``Siblings``: a :class:`FileSet` of the located roles that exist, opened
    together (linked roles under the shared lock, after rolling forward a
    save that died; see the module docstring), so they are one save's files.

    Raises:
      FileNotFoundError: nothing there (naming every file looked for).
      FormatError: a directory where a file is expected, or the reverse.
    """
    p = Path(path)
    if isinstance(layout, File):
        return _open_file(p, mmap, headers)
    if isinstance(layout, Directory):
        return _open_dir(p, mmap, headers)
    if isinstance(layout, Siblings):
        return _open_siblings(p, layout, mmap, headers)
    raise TypeError(f"unknown layout {layout!r}")
