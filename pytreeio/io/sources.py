"""What a format decodes from: `open_source` opens a checkpoint's files as one save's.

A ``FILE`` is read whole (one rename replaces it: no lock needed).  Linked ``Siblings`` and
directories are opened under the shared lock of `pytreeio.io.atomic`, after rolling
forward a save that died, so that what is read is the complete old or the complete new set.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pytreeio.core.errors import FormatError
from pytreeio.core.records import Directory, File, Layout, Siblings
from pytreeio.io.atomic import read_locked, resolve
from pytreeio.io.reads import FileSet, FileSource, open_regular, read_file, release


def _not_found(path: Path, looked_for: Iterable[Path] = ()) -> FileNotFoundError:
    names = [os.fspath(p) for p in looked_for]
    if not names or names == [os.fspath(path)]:
        return FileNotFoundError(errno.ENOENT, "No such file or directory", os.fspath(path))
    listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    return FileNotFoundError(
        errno.ENOENT, f"No such file or directory (looked for {listed})", os.fspath(path)
    )


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
    dest = resolve(p)

    def opener(subst: Mapping[Path, Path]) -> FileSet:
        try:
            return FileSet.directory(subst.get(dest, p), mmap=mmap, headers=headers)
        except FileNotFoundError:
            raise _not_found(p) from None
        except NotADirectoryError:
            raise FormatError("is a file, not a directory", path=os.fspath(p)) from None

    return read_locked([dest], opener)


def _open_siblings(p: Path, layout: Siblings, mmap: bool, headers: bool) -> FileSet:
    located = {role: Path(rp) for role, rp in layout.locate(p).items()}

    def opener(subst: Mapping[Path, Path]) -> FileSet:
        fds: dict[str, int] = {}
        try:
            for role, rp in located.items():
                fd = open_regular(subst.get(resolve(rp), rp) if subst else rp)
                if fd is not None:
                    fds[role] = fd
        except BaseException:
            release(fds.values())
            raise
        return FileSet({r: located[r] for r in fds}, mmap=mmap, headers=headers, fds=fds)

    if layout.linked:
        found = read_locked([resolve(rp) for rp in located.values()], opener)
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

    ``FILE``: the file's bytes (a `FileSource` with ``headers``).  ``DIRECTORY``: a
    `FileSet` of the files below ``path``.  ``Siblings``: a `FileSet` of the
    located roles that exist, opened together (linked roles under the shared lock, after
    rolling forward a save that died), so they are one save's files.

    Raises:
      FileNotFoundError: nothing there (naming every file looked for), or a symlink loop
        (``errno`` ``ELOOP``, naming the link).
      FormatError: a directory where a file is expected, or the reverse.
    """
    p = Path(path)
    try:
        if isinstance(layout, File):
            return _open_file(p, mmap, headers)
        if isinstance(layout, Directory):
            return _open_dir(p, mmap, headers)
        if isinstance(layout, Siblings):
            return _open_siblings(p, layout, mmap, headers)
    except OSError as exc:
        if exc.errno != errno.ELOOP or isinstance(exc, FileNotFoundError):
            raise
        # a symlink loop has no file at its end: what sniffing (which finds nothing) says
        raise FileNotFoundError(
            errno.ELOOP,
            "Too many levels of symbolic links (a symlink loop: no file at its end)",
            exc.filename if exc.filename is not None else os.fspath(p),
        ) from None
    raise TypeError(f"unknown layout {layout!r}")
