"""All file-system access of pytreeio: probes, reads and crash-safe writes.

- `pytreeio.io.probes`: what sniffing sees of a path (`probe`), and what a save
  changes of it (`identity`);
- `pytreeio.io.reads`: whole files, ranges (`FileSource`), sets of files
  (`FileSet`), directory walks;
- `pytreeio.io.sources`: `open_source`, a checkpoint's files as one save's;
- `pytreeio.io.atomic`: `write_atomic` and its lock and journal (old or new,
  never a mix, also under SIGKILL and concurrent savers).
"""

from pytreeio.io.atomic import (
    PartWriter,
    _produced,
    file_in_parts,
    write_atomic,
    write_dir_atomic,
    write_file_atomic,
)
from pytreeio.io.probes import identity, probe, probe_buffer
from pytreeio.io.reads import (
    ChangedWhileOpen,
    FileSet,
    FilesOf,
    FileSource,
    read_chunks,
    read_file,
    read_head,
    walk,
)
from pytreeio.io.sources import open_source

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
    "_produced",
]
