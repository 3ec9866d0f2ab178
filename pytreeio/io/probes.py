"""What sniffing sees of a path (`probe`, `probe_buffer` for in-memory files), and
what a save changes of it (`identity`).  Probes never raise for missing or unreadable
paths, and read a bounded amount of any file."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pytreeio.core.binary import Buffer, BufferSource, ByteSource, as_memoryview
from pytreeio.core.errors import FormatError
from pytreeio.core.records import Directory, Layout, Probe, Siblings
from pytreeio.io.reads import _OWN_FILE, FileSource, _walk, open_regular

_HEAD = 4096
_MAX_MEMBERS = 65_536
_MAX_NAMES = 10_000
_MAX_HEADS = 32


def _zip_members(source: ByteSource) -> tuple[str, ...] | None:
    """A ZIP's member names (at most ``_MAX_MEMBERS``), or None when they cannot be read.

    `pytreeio.containers.zip.member_names` reads the end records and the central
    directory only (bounded); a hostile archive costs at most that.
    """
    from pytreeio.containers.zip import member_names

    try:
        return tuple(str(n) for n in member_names(source)[:_MAX_MEMBERS])
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
        fd = open_regular(path)
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
        if "/" not in name and name.lower().endswith((".json", ".txt")):
            head = head_of(name)
            if head is not None:
                heads[name] = head
    return Probe(path, kind="dir", names=frozenset(names), heads=heads)


def _disk_head(root: Path, name: str) -> bytes | None:
    try:
        fd = open_regular(root / name)
        if fd is None:
            return None
    except OSError:
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
    """`probe`'s choice of probes by layout, over any file system."""
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

    ``FILE``: kind, the first 4 KiB, the size, and the ZIP member names when the file starts
    with a ZIP local header.  ``DIRECTORY``: the relative POSIX names of the files below (at
    most 10,000; pytreeio's temporaries and symlinks leaving the directory skipped) and the
    first 4 KiB of up to 32 top-level ``*.json``/``*.txt`` files.  ``Siblings``: the FILE
    probe of ``path`` itself plus a FILE probe of each located role that is a file.

    ``made``: the FILE probes of one round of sniffing so far, by path, reused and filled
    (every layout probes ``path`` itself again otherwise: about 60 us each).
    """
    memo = {} if made is None else made

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
    """`probe` of ``path`` over an in-memory file system (for fuzzing the sniffers).

    ``files`` maps each file's path to its content; a directory exists where some file lies
    below it.  The probe is the one `probe` builds for the same files on disk (same
    heads, sizes, ZIP members, listings).
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


def identity(path: str | os.PathLike[str], layout: Layout) -> tuple[Any, ...]:
    """What a save changes of the checkpoint at ``path``: device, inode, size and mtime of
    each path ``layout`` names (a save renames new files or a new directory into place), None
    for one that is absent; empty when the layout cannot locate its files."""
    try:
        located = layout.locate(Path(path)).values() if isinstance(layout, Siblings) else [path]
    except Exception:  # a layout's own locate failing: nothing to compare
        return ()
    return tuple(_stamp(p) for p in located)


def _stamp(path: str | os.PathLike[str]) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
