"""Integrity checks: checksums of buffers and files, manifests, NaN/inf reports.

Checksums are xxHash's XXH3 64-bit hash (``xxh3_64``, from the ``xxhash``
package, imported only when a checksum is computed), written as 16 lower-case
hex digits.  XXH3 hashes a numpy array's own buffer (no copy) at memory
speed, several GB/s per core.

**Per-tensor checksums (safetensors).**  `pytreeio.formats.safetensors`
records one checksum per tensor in ``__metadata__["pytreeio.xxh3_64"]`` while
encoding (a JSON object ``{tensor name: hex}``; ``checksum=False`` on save
leaves it out).  ``ptio.verify(path)`` and ``ptio.load(path, verify=True)``
check them and raise `pytreeio.core.errors.FormatError` with ``field`` =
the tensor's name and ``offset`` = the start of its data in the file.  Files
written by other tools carry none and are not checked; a plain ``load``
never hashes anything.

**Manifests (any format).**  Formats with no place for a checksum (Tiny
Llama, DataCode, bullet, cl-waffe2, ...) get a sidecar JSON document that the
original systems ignore, written on request by `write_manifest` (or
``pytreeio checksum PATH``):

* a single-file checkpoint ``model.bin``: ``model.bin.pytreeio-sum.json``
  next to it (a symlinked path is resolved: the sidecar sits next to the
  real file);
* a directory checkpoint (cl-waffe2, bullet): ``pytreeio-sum.json`` inside
  it.  A save swaps the whole directory in, so the next save drops the
  sidecar with the checkpoint it described: the new checkpoint has none
  until one is written again;
* a sibling-file checkpoint (netcl-checkpoint's ``ckpt.npz`` + ``ckpt.json``):
  ``<first file>.pytreeio-sum.json`` next to the first of its files.

The manifest records the size and checksum of every file of the checkpoint
(for a directory, every regular file below it except the manifest).
`check_manifest` (called by ``ptio.verify`` and ``ptio.load(...,
verify=True)`` when a manifest is present) raises ``FormatError`` naming the
file, and for directories the member (``field``), that is missing, added,
resized or changed, so a sidecar left stale by a later save of a single file
is detected, never trusted.  The manifest is written atomically with
`pytreeio.io.write_file_atomic`; reading it is bounded like any other
JSON document pytreeio reads.  A save racing a check can make the check
fail; it never makes it pass for bytes that were not recorded.

**NaN/inf report.**  `nonfinite_counts` counts NaNs and infinities of
every floating leaf of a tree, in chunks of `CHUNK_ELEMENTS` elements
(bounded extra memory); ``ptio.verify`` reports them as
``info.meta["nonfinite"] = {entry: {"nan": n, "inf": m}}`` for the entries
that have any.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pytreeio import io
from pytreeio.core import jsonsafe
from pytreeio.core.digest import ALGORITHM, array_checksum, buffer_checksum, stream_checksum
from pytreeio.core.errors import FormatError

__all__ = [
    "ALGORITHM",
    "MANIFEST_NAME",
    "SIDECAR_SUFFIX",
    "array_checksum",
    "buffer_checksum",
    "file_checksum",
    "manifest_path",
    "write_manifest",
    "check_manifest",
    "check_manifest_buffers",
    "parse_manifest",
    "nonfinite_counts",
]

#: The manifest inside a directory checkpoint.
MANIFEST_NAME = "pytreeio-sum.json"
#: Appended to a single file's name for its sidecar manifest.
SIDECAR_SUFFIX = ".pytreeio-sum.json"
MANIFEST_VERSION = 1
#: Elements examined at a time by `nonfinite_counts`.
CHUNK_ELEMENTS = 1 << 22
_READ_CHUNK = 16 << 20
#: The largest manifest read (a manifest is ~100 bytes per file).
MAX_MANIFEST_BYTES = 64 << 20


def file_checksum(path: str | os.PathLike[str]) -> tuple[int, str]:
    """``(size, checksum)`` of a file, read in 16 MiB chunks (bounded memory)."""
    return stream_checksum(io.read_chunks(path, _READ_CHUNK))


# --------------------------------------------------------------------------
# manifests
# --------------------------------------------------------------------------


def _layout_of(path: Path | io.Url, format: Any) -> Any:
    from pytreeio.engine import dispatch

    return dispatch.format_for_load(path, format)


def _members(path: Path, fmt: Any) -> tuple[Path, Path, dict[str, Path]]:
    """``(manifest path, base directory, {name: file})`` of the checkpoint at ``path``."""
    from pytreeio.core.records import Directory, Siblings

    layout = fmt.layout
    if isinstance(layout, Directory):
        root = path.resolve()
        if not root.is_dir():
            raise FormatError("is not a directory", path=os.fspath(path))

        # the files the format's decoder sees (pytreeio's locks and temporaries skipped)
        files = {rel: root / rel for rel in io.walk(root) if rel != MANIFEST_NAME}
        return root / MANIFEST_NAME, root, files
    if isinstance(layout, Siblings):
        located = [Path(p) for p in layout.locate(path).values()]
        existing = [p.resolve() for p in located if p.is_file()]
        if not existing:
            raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
        base = existing[0].parent
        files = {p.name: p for p in existing}
        return existing[0].with_name(existing[0].name + SIDECAR_SUFFIX), base, files
    real = path.resolve()
    if not real.is_file():
        raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
    return real.with_name(real.name + SIDECAR_SUFFIX), real.parent, {real.name: real}


def manifest_path(path: str | os.PathLike[str], format: Any = None) -> Path:
    """Where the manifest of the checkpoint at ``path`` is (whether or not it exists)."""
    p = Path(path)
    return _members(p, _layout_of(p, format))[0]


def write_manifest(path: str | os.PathLike[str], format: Any = None) -> Path:
    """Record the size and checksum of every file of the checkpoint at ``path``.

    ``format`` is sniffed when not given (it decides the layout: one file,
    sibling files or a directory).  The manifest is written atomically and
    its path returned.
    """
    from pytreeio.core.records import Encoded

    if io.is_url(path):
        raise TypeError(
            f"{path}: manifests are for local checkpoints; in object storage a directory's "
            "commit object records every file's size and checksum (ptio.verify checks them)"
        )
    p = Path(path)
    fmt = _layout_of(p, format)
    where, _, files = _members(p, fmt)
    entries = {}
    for name, full in files.items():
        size, digest = file_checksum(full)
        entries[name] = {"size": size, ALGORITHM: digest}
    doc = {
        "pytreeio-sum": MANIFEST_VERSION,
        "algorithm": ALGORITHM,
        "format": fmt.name,
        "layout": fmt.layout.kind,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": entries,
    }
    text = json.dumps(doc, indent=1, sort_keys=True).encode("utf-8") + b"\n"
    io.write_file_atomic(where, Encoded(chunks=(text,)))
    return where


def _read_manifest(where: Path) -> dict[str, tuple[int, str]]:
    return parse_manifest(io.read_head(where, MAX_MANIFEST_BYTES), os.fspath(where))


def parse_manifest(raw: bytes, name: str) -> dict[str, tuple[int, str]]:
    """``{file name: (size, checksum)}`` of the manifest document ``raw`` (read from ``name``)."""

    def bad(why: str) -> FormatError:
        return FormatError(f"malformed manifest: {why}", path=name, field="manifest")

    if len(raw) > MAX_MANIFEST_BYTES:
        raise bad(f"larger than {MAX_MANIFEST_BYTES} bytes")
    doc = jsonsafe.loads(
        raw, path=name, field="manifest", max_depth=8, max_values=(len(raw) + 4096) // 4
    )
    if not isinstance(doc, dict) or doc.get("pytreeio-sum") != MANIFEST_VERSION:
        raise bad(f"not a version {MANIFEST_VERSION} pytreeio manifest")
    if doc.get("algorithm") != ALGORITHM:
        raise bad(f"unsupported algorithm {doc.get('algorithm')!r:.40}")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise bad("'files' is not an object")
    out: dict[str, tuple[int, str]] = {}
    for fname, rec in files.items():
        size = rec.get("size") if isinstance(rec, dict) else None
        digest = rec.get(ALGORITHM) if isinstance(rec, dict) else None
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or size < 0
            or not isinstance(digest, str)
            or not fname
            or ".." in fname.split("/")
            or fname.startswith("/")
        ):
            raise bad(f"bad record for {fname!r:.80}")
        out[fname] = (size, digest)
    return out


def check_manifest(path: str | os.PathLike[str], format: Any = None) -> bool:
    """Check the checkpoint at ``path`` against its manifest, if it has one.

    Returns ``False`` when there is no manifest, ``True`` when every file
    matches.  Raises `FormatError` (``path`` = the file, ``field`` =
    its name in the manifest: a directory member's relative path) for a file
    that is missing, unrecorded, resized or changed, and for a malformed
    manifest.
    """
    if isinstance(path, io.Url):
        return _check_commit(path, format)
    p = Path(path)
    fmt = _layout_of(p, format)
    where, base, files = _members(p, fmt)
    if not where.is_file():
        return False
    recorded = _read_manifest(where)
    _compare(
        recorded,
        files,
        lambda name: file_checksum(files[name]),
        os.fspath(where),
        lambda name: os.fspath(files[name] if name in files else base / name),
    )
    return True


def _check_commit(url: io.Url, format: Any) -> bool:
    """`check_manifest` of a directory or linked set in object storage: its commit object
    records each file's size and checksum (`pytreeio.io.remote`)."""
    found = io.remote.commit_record(url, _layout_of(url, format).layout)
    if found is None:
        return False
    where, recorded, keys = found
    _compare(
        recorded, keys, lambda n: io.remote.checksum(url, keys[n]), where, lambda n: url.at(keys[n])
    )
    return True


def check_manifest_buffers(manifest: bytes, files: Mapping[str, Any], where: str = "") -> None:
    """`check_manifest` over buffers: ``manifest`` is the document, ``files`` the
    checkpoint's files by their names in it (for a directory, relative paths).

    Raises the same `FormatError` s, naming ``where`` as the manifest and
    each file by its name.
    """
    recorded = parse_manifest(manifest, where or MANIFEST_NAME)
    _compare(
        recorded,
        files,
        lambda name: (len(memoryview(files[name])), buffer_checksum(files[name])),
        where or MANIFEST_NAME,
        lambda name: name,
    )


def _compare(
    recorded: Mapping[str, tuple[int, str]],
    files: Iterable[str],
    measure: Callable[[str], tuple[int, str]],
    where: str,
    path_of: Callable[[str], str],
) -> None:
    """Raise for the first file missing, unrecorded, resized or changed (in name order)."""
    names = set(files)
    for name in sorted(set(recorded) - names):
        raise FormatError(
            f"missing: recorded in the manifest {where}", path=path_of(name), field=name
        )
    for name in sorted(names - set(recorded)):
        raise FormatError(
            f"not recorded in the manifest {where} (added after it was written)",
            path=path_of(name),
            field=name,
        )
    for name in sorted(names):
        size, digest = measure(name)
        want_size, want = recorded[name]
        if size != want_size:
            raise FormatError(
                f"changed since its manifest {where} was written: "
                f"{size} bytes, recorded {want_size} (stale manifest or truncated file)",
                path=path_of(name),
                field=name,
            )
        if digest != want:
            raise FormatError(
                f"changed since its manifest {where} was written: "
                f"{ALGORITHM} {digest}, recorded {want:.16}",
                path=path_of(name),
                field=name,
            )


# --------------------------------------------------------------------------
# NaN / inf
# --------------------------------------------------------------------------


def _floating(dt: np.dtype[Any]) -> bool:
    if dt.kind in "fc":
        return True
    # ml_dtypes' bfloat16 / float8 types are kind "V"
    try:
        import ml_dtypes

        ml_dtypes.finfo(dt)
    except (ValueError, TypeError, ImportError):
        return False
    return True


def _count(arr: np.ndarray) -> tuple[int, int]:
    flat = arr.reshape(-1)
    nan = inf = 0
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS]
        nan += int(np.count_nonzero(np.isnan(chunk)))
        inf += int(np.count_nonzero(np.isinf(chunk)))
    return nan, inf


def nonfinite_counts(tree: Any) -> dict[str, dict[str, int]]:
    """``{entry: {"nan": n, "inf": m}}`` for the floating leaves of ``tree`` that have any.

    Entries are canonical key strings (`pytreeio.flatten`); Python
    floats count as float64 scalars; other leaves are skipped.
    """
    from pytreeio.core.tree import flatten_named

    out: dict[str, dict[str, int]] = {}
    leaves = flatten_named(tree)
    for key, leaf in leaves.items():
        if isinstance(leaf, float):
            arr: Any = np.asarray(leaf, dtype=np.float64)
        elif isinstance(leaf, np.ndarray | np.generic) or hasattr(leaf, "__array__"):
            dt = getattr(leaf, "dtype", None)
            if dt is None or not _floating(np.dtype(dt)):
                continue
            try:
                arr = np.asarray(leaf)
            except (TypeError, ValueError):
                continue
        else:
            continue
        if not isinstance(arr, np.ndarray) or not _floating(arr.dtype):
            continue
        nan, inf = _count(arr)
        if nan or inf:
            out[key] = {"nan": nan, "inf": inf}
    return out
