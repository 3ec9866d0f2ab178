"""All file-system access of pytreeio: probes, reads and crash-safe writes.

- `pytreeio.io.probes`: what sniffing sees of a path (`probe`), and what a save
  changes of it (`identity`);
- `pytreeio.io.reads`: whole files, ranges (`FileSource`), sets of files
  (`FileSet`), directory walks;
- `pytreeio.io.sources`: `open_source`, a checkpoint's files as one save's;
- `pytreeio.io.atomic`: `write_atomic` and its lock and journal (old or new,
  never a mix, also under SIGKILL and concurrent savers);
- `pytreeio.io.remote`: the same for URLs (object storage through fsspec): versions and
  commit objects instead of renames.

`location` turns what a caller passed into a local path or a `Url`; `probe`,
`open_source`, `write_atomic`, `identity` and `file_checksum` here take either.
"""

import os
from pathlib import Path
from typing import Any

from pytreeio.core.records import Encoded, File, Layout, Probe
from pytreeio.io import atomic, probes, reads, remote, sources
from pytreeio.io.atomic import (
    PartWriter,
    _produced,
    write_dir_atomic,
    write_file_atomic,
)
from pytreeio.io.probes import probe_buffer
from pytreeio.io.reads import (
    ChangedWhileOpen,
    FileSet,
    FilesOf,
    FileSource,
    read_chunks,
    read_file,
    walk,
)
from pytreeio.io.remote import Url, is_url, location

__all__ = [
    "Url",
    "is_url",
    "location",
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
    "is_file",
    "walk",
    "read_chunks",
    "read_head",
    "file_in_parts",
    "PartWriter",
    "part_writer",
    "_produced",
]


def probe(path: Any, layout: Layout, *, made: dict[Path, Probe] | None = None) -> Probe:
    """What sniffing sees of ``path`` (see `pytreeio.io.probes.probe`)."""
    if isinstance(path, Url):
        return remote.probe(path, layout, made=made)
    return probes.probe(path, layout, made=made)


def open_source(path: Any, layout: Layout, *, mmap: bool = False, headers: bool = False) -> Any:
    """What a format decodes from (see `pytreeio.io.sources.open_source`)."""
    if isinstance(path, Url):
        return remote.open_source(path, layout, mmap=mmap, headers=headers)
    return sources.open_source(path, layout, mmap=mmap, headers=headers)


def write_atomic(path: Any, encoded: Encoded, layout: Layout, *, durable: bool = True) -> None:
    """Write a checkpoint atomically (see `pytreeio.io.atomic.write_atomic`; an object store
    is durable once it answers, so ``durable`` changes nothing there)."""
    if isinstance(path, Url):
        remote.write_atomic(path, encoded, layout)
    else:
        atomic.write_atomic(path, encoded, layout, durable=durable)


def identity(path: Any, layout: Layout) -> tuple[Any, ...]:
    """What a save changes of the checkpoint at ``path`` (see `pytreeio.io.probes.identity`)."""
    if isinstance(path, Url):
        return remote.identity(path, layout)
    return probes.identity(path, layout)


def is_file(path: Any) -> bool:
    """Whether ``path`` is a file (an object, for a URL)."""
    if isinstance(path, Url):
        return remote.probe(path, File()).kind == "file"
    return os.path.isfile(path)


def read_head(path: Any, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of a small file or object (the caller tells it is too long)."""
    if isinstance(path, Url):
        return remote.read_head(path, limit)
    return reads.read_head(path, limit)


def file_in_parts(path: Any, size: int, durable: bool = True) -> Any:
    """A checkpoint file that several writers fill (see `pytreeio.io.atomic.file_in_parts`):
    a context manager yielding the name that `part_writer` opens."""
    if isinstance(path, Url):
        return remote.file_in_parts(path, size)
    return atomic.file_in_parts(path, size, durable)


def part_writer(name: str, dest: Any) -> Any:
    """A writer of the `file_in_parts` named ``name`` (as the lead passed it on) for ``dest``."""
    if isinstance(dest, Url):
        return remote.PartWriter(dest, name)
    return PartWriter(name)
