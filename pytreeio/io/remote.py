"""Checkpoints in object storage: URLs (``s3://``, ``gs://``, ``memory://``, any fsspec protocol).

`location` turns a URL and ``storage_options`` into a `Url` (a ``str`` that carries its
fsspec file system); local paths (and ``file://`` URLs) stay paths, and fsspec is imported
only for URLs.  `probe`, `open_source`, `write_atomic` and `identity` are the local
functions' counterparts for a `Url`.

Object stores have no rename, so atomicity comes from objects that are written whole:

- a single-file checkpoint is one object (staged in a local temporary file, then one PUT
  or a multipart upload that the store publishes only when it completes);
- a directory checkpoint ``D`` or a linked sibling set (anchor ``A`` = its first linked
  role's object) is written as a version, then committed by one small object written last::

      D/.pytreeio-<version>/<relative path>        A's parent/.<A's name>.pytreeio-<version>/<file>
      D/.pytreeio-commit                           A's parent/.<A's name>.pytreeio-commit

  The commit object is JSON: ``{"pytreeio_commit": 1, "version": ..., "files": {name:
  {"size": n, "xxh3_64": hex}}}`` (names: relative paths, or the sibling files' names).
  A load reads the commit object, then only the files it names: a version without one
  (a save still running, or killed) is never read.  A directory of plain objects with no
  commit object (uploaded by another tool) is read as it is.

- Before committing, a save lists its version's files (all there, at their sizes).  The
  commit object also names the version it replaced (``previous``), kept for readers still
  reading it.  After committing, a save removes the version replaced two saves ago, its own
  version if another saver's commit landed after its own (and does not keep it), and versions
  left by dead saves: those of this host (host name and PID namespace) whose process is gone,
  and any whose newest object is older than `STALE_AFTER` by the store's clock.  Two concurrent savers each write a whole version; the
  checkpoint is the one whose commit object landed last.

Uploads are staged in the local temporary directory (it must hold the file, or a directory
checkpoint's files).  File systems that write in place rather than publishing an object
whole (sftp, hdfs, ...) get each file under a temporary name, then renamed.  Caching
wrappers (``simplecache::``) are refused: they would serve a stale commit object.

Reads are ranged GETs: a whole object in parallel blocks, a lazy view's tensor by its
range.  A single object replaced while it is read (its ETag changes) is `ChangedWhileOpen`,
as is a committed version removed meanwhile; whole loads then read it again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pytreeio.core.binary import ByteSource
from pytreeio.core.digest import stream_checksum
from pytreeio.core.errors import FormatError
from pytreeio.core.records import Directory, Encoded, File, Layout, Probe, Siblings
from pytreeio.io.atomic import _write_at, _write_chunks
from pytreeio.io.probes import _HEAD, _MAX_NAMES, _listing_probe, _probe_source, _probe_with
from pytreeio.io.reads import ChangedWhileOpen, Closing, FileSet, read_chunks

# "s3://", "gs://", chained "simplecache::s3://": a protocol, then "://" or "::"
_PROTOCOL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*(?=://|::)")
_COMMIT = ".pytreeio-commit"
_VERSION_MARK = ".pytreeio-"
_VERSION = re.compile(r"(\d{8}T\d{6}\.\d{6})Z-([A-Za-z0-9.]{1,80})-(\d{1,10})-([0-9a-f]{8})")
#: The largest file size a commit object may record (a sanity bound, 256 TiB).
_MAX_SIZE = 1 << 48
#: fsspec protocols that publish an uploaded object whole (the others are written in place:
#: their uploads go to a temporary name, then are renamed).
_OBJECT_STORES = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"}
)
#: Caching wrappers serve what they cached: commit objects and ETags would be stale.
_CACHING = frozenset({"simplecache", "filecache", "blockcache", "cached"})
#: An uncommitted version older than this is a dead save's, whoever wrote it.
STALE_AFTER = 24 * 3600.0
#: The largest commit object read (a directory of 10,000 files takes about 1 MB).
MAX_COMMIT_BYTES = 16 << 20
# Whole objects are fetched in ranged GETs of 16 to 64 MiB, eight at once (at most 512 MiB in
# flight beside the result): a stored object costs a request each, so fewer, larger ranges.
_BLOCK = 16 << 20
_MAX_BLOCK = 64 << 20
_BLOCKS_AT_ONCE = 8
#: A small read (a header field) fetches this much from its offset on, and the reads that
#: follow within it are served from that window: headers are parsed in many small reads.
_WINDOW = 64 << 10


class Url(str):
    """A URL with the fsspec file system it names: ``str(url)`` is the URL, for messages.

    Attributes:
      fs: the ``fsspec.AbstractFileSystem``.
      key: the path on ``fs`` (no protocol).
    """

    fs: Any
    key: str

    def __new__(cls, url: str, fs: Any, key: str) -> Url:
        self = super().__new__(cls, url)
        self.fs = fs
        self.key = key
        return self

    def at(self, key: str) -> Url:
        """The URL of another object on the same file system."""
        return Url(self.fs.unstrip_protocol(key), self.fs, key)

    def __truediv__(self, name: str) -> Url:
        """The URL of ``name`` below this one (as ``pathlib.Path`` joins)."""
        return self.at(f"{self.key.rstrip('/')}/{name}")


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL that fsspec serves (``file://`` URLs are local paths)."""
    if isinstance(path, Url):
        return True
    if not isinstance(path, str):
        return False
    m = _PROTOCOL.match(path)
    return m is not None and not (m.group().lower() == "file" and path[4:7] == "://")


def location(path: Any, storage_options: Mapping[str, Any] | None = None) -> Any:
    """``path`` as the io functions take it: a `Url` for URLs, else the local path itself.

    ``storage_options`` go to the fsspec file system (credentials, ``endpoint_url``...);
    fsspec's configuration and environment variables (``FSSPEC_S3_ENDPOINT_URL``) apply too.
    """
    if isinstance(path, Url):
        return path
    if isinstance(path, os.PathLike) and not isinstance(path, Path):
        path = os.fspath(path)  # an etils or universal-pathlib path: its URL
    if isinstance(path, str) and path[:17].lower() == "file://localhost/":
        path = path[16:]
    if isinstance(path, str) and path[:7].lower() == "file://" and "::" not in path:
        path = path[7:]  # a local file: the local code, with its renames and locks
    elif is_url(path):
        try:
            from fsspec.core import url_to_fs
        except ImportError:
            raise ImportError(
                f"{path}: URLs need fsspec and the protocol's file system: "
                "pip install 'pytreeio[cloud]'"
            ) from None
        cached = sorted(_CACHING & {p.lower() for p in re.findall(r"([A-Za-z0-9+.\-]+)::", path)})
        if cached:
            raise ValueError(
                f"{path}: {cached[0]}:: serves what it cached, so a newer commit or a replaced "
                "object would go unseen; read the store itself"
            )
        try:
            fs, key = url_to_fs(path, **dict(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise ValueError(f"{path}: cannot open this URL's file system: {exc}") from exc
        return Url(path, fs, key)
    if storage_options:
        raise TypeError(
            "storage_options= configures the file system of a URL (s3://, gs://, ...); "
            f"{os.fspath(path)!r} is a local path"
        )
    return path


@contextlib.contextmanager
def _storage_errors(url: str) -> Iterator[None]:
    """The store's failures as ``OSError`` naming the URL (a missing object stays
    ``FileNotFoundError``; a network or permission failure from any fsspec backend)."""
    try:
        yield
    except (FormatError, ChangedWhileOpen, TypeError, AttributeError, AssertionError):
        raise  # ours, or a bug: never dressed up as a storage failure
    except FileNotFoundError as exc:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", url) from exc
    except OSError as exc:
        raise OSError(exc.errno or errno.EIO, exc.strerror or str(exc), url) from exc
    except Exception as exc:  # botocore, aiohttp, google-auth: whatever the backend raises
        raise OSError(errno.EIO, f"object storage: {type(exc).__name__}: {exc}", url) from exc


# --------------------------------------------------------------------------
# reading objects
# --------------------------------------------------------------------------


def _info(url: Url, key: str) -> dict[str, Any] | None:
    """The object (or prefix: ``type`` ``"directory"``) at ``key``; None where nothing is."""
    url.fs.invalidate_cache(key)  # what another process wrote since: never a listing cached
    try:
        with _storage_errors(url.at(key)):
            return dict(url.fs.info(key))
    except FileNotFoundError:
        return None


#: Where fsspec back-ends report when an object was written (S3, local/sftp, GCS, memory).
_TIME_KEYS = ("LastModified", "mtime", "updated", "created")


def _stamp(info: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a new write of an object changes (``ETag`` where the store gives one)."""
    tag = next((info[k] for k in ("ETag", "etag", "md5Hash", "generation") if k in info), None)
    when = next((info[k] for k in _TIME_KEYS if k in info), 0)
    return (info.get("size"), tag, str(when))


def _fetch(url: Url, key: str, offset: int, out: memoryview, field: str) -> None:
    """Fill ``out`` with the object's bytes at ``offset``: ranged GETs, several at once."""
    n = len(out)
    if n == 0:  # a GET of no bytes is an error (S3: 416) or the whole object
        return
    block = min(_MAX_BLOCK, max(_BLOCK, -(-n // _BLOCKS_AT_ONCE)))
    starts = list(range(offset, offset + n, block)) or [offset]
    fs = url.fs
    for first in range(0, len(starts), _BLOCKS_AT_ONCE):
        batch = starts[first : first + _BLOCKS_AT_ONCE]
        ends = [min(s + block, offset + n) for s in batch]
        with _storage_errors(url.at(key)):
            if len(batch) == 1:
                parts = [fs.cat_file(key, start=batch[0], end=ends[0])]
            else:
                parts = fs.cat_ranges([key] * len(batch), batch, ends, on_error="raise")
        for start, end, part in zip(batch, ends, parts, strict=True):
            if len(part) != end - start:
                raise FormatError(
                    f"truncated while being read: wanted {end - start} bytes, got {len(part)} "
                    "(replaced or shortened meanwhile?)",
                    path=url.at(key),
                    field=field,
                    offset=start,
                )
            out[start - offset : end - offset] = part


class RemoteSource(Closing, ByteSource):
    """A `ByteSource` over one object, read by ranged GETs.

    A read smaller than ``window`` fetches ``window`` bytes from its offset, and serves the
    reads that follow within them (a header parsed field by field costs one request).

    ``stamp``: the object's `_stamp` when opened; each read then checks that the object was
    not replaced meanwhile (one HEAD).  None for a committed version's files, which are never
    rewritten (a removed one is `ChangedWhileOpen`).
    """

    def __init__(
        self,
        url: Url,
        key: str,
        size: int,
        stamp: tuple[Any, ...] | None,
        *,
        window: int = _WINDOW,
    ) -> None:
        self.name = url.at(key)
        self._url = url
        self._key = key
        self.size = size
        self._stamp = stamp
        self._window = memoryview(b"")
        self._window_at = 0
        self._window_size = window
        self.bytes_read = 0

    def read(self, offset: int, n: int, field: str) -> memoryview:
        self._check_range(offset, n, field)
        view = np.empty(n, dtype=np.uint8).data  # uninitialised: no zero-fill
        self._fill(offset, view, field)
        return view

    def read_into(self, offset: int, out: memoryview, field: str) -> None:
        self._check_range(offset, len(out), field)
        self._fill(offset, out.cast("B"), field)

    def read_scattered(self, offset: int, buffers: Sequence[memoryview], field: str) -> None:
        """Fill ``buffers`` one after another from ``offset``: small neighbours share one
        ranged read (through a buffer of at most `_BLOCK` bytes), large ones are read into."""
        self._check_range(offset, sum(len(b) for b in buffers), field)
        at, k = offset, 0
        while k < len(buffers):
            group, n = [buffers[k]], len(buffers[k])
            while k + len(group) < len(buffers) and n + len(buffers[k + len(group)]) <= _BLOCK:
                n += len(buffers[k + len(group)])
                group.append(buffers[k + len(group)])
            if len(group) == 1:
                self._fill(at, group[0].cast("B"), field)
            else:
                span = np.empty(n, dtype=np.uint8).data
                self._fill(at, span, field)
                pos = 0
                for b in group:
                    b.cast("B")[:] = span[pos : pos + len(b)]
                    pos += len(b)
            at += n
            k += len(group)

    def _fill(self, offset: int, out: memoryview, field: str) -> None:
        n = len(out)
        if n < self._window_size:
            at = offset - self._window_at
            if not (at >= 0 and at + n <= len(self._window)):
                window = np.empty(min(self._window_size, self.size - offset), np.uint8).data
                self._window = memoryview(b"")  # kept only once fetched and checked
                self._fetch(offset, window, field)
                self._window, self._window_at, at = window, offset, 0
            out[:] = self._window[at : at + n]
            self.bytes_read += n
            return
        self._fetch(offset, out, field)
        self.bytes_read += n

    def _fetch(self, offset: int, out: memoryview, field: str) -> None:
        try:
            _fetch(self._url, self._key, offset, out, field)
        except FileNotFoundError:
            raise ChangedWhileOpen(
                errno.ENOENT, "gone since the checkpoint was opened (a concurrent save?)", self.name
            ) from None
        if self._stamp is not None:
            info = _info(self._url, self._key)
            if info is None or _stamp(info) != self._stamp:
                raise ChangedWhileOpen(
                    errno.ESTALE, "replaced while it was read (a concurrent save?)", self.name
                )

    def close(self) -> None:
        pass  # no descriptors: each read is its own request


def _object(url: Url, key: str) -> RemoteSource:
    """The object at ``key``, checked on every read (a single object may be replaced)."""
    info = _info(url, key)
    if info is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", url.at(key))
    if info.get("type") == "directory":
        raise FormatError("is a directory, not a file", path=url.at(key))
    return RemoteSource(url, key, int(info["size"]), _stamp(info))


# --------------------------------------------------------------------------
# versions and their commit objects
# --------------------------------------------------------------------------


def _parent(key: str) -> tuple[str, str]:
    head, _, name = key.rstrip("/").rpartition("/")
    return head, name


def _names_of(anchor: str, directory: bool) -> tuple[str, str]:
    """``(commit object key, prefix of version keys)`` of a directory or a linked set."""
    if directory:
        base = anchor.rstrip("/") + "/"
        return base + _COMMIT, base + _VERSION_MARK
    head, name = _parent(anchor)
    base = f"{head}/.{name}"
    return base + _COMMIT, base + _VERSION_MARK


def _read_commit(url: Url, anchor: str, directory: bool) -> dict[str, Any] | None:
    """The commit object of ``anchor`` (None if there is none), checked."""
    commit_key, _ = _names_of(anchor, directory)
    info = _info(url, commit_key)
    if info is None or info.get("type") == "directory":
        return None
    where = url.at(commit_key)
    if int(info["size"]) > MAX_COMMIT_BYTES:
        raise FormatError(f"larger than {MAX_COMMIT_BYTES} bytes", path=where, field="commit")
    try:
        with _storage_errors(where):
            raw = url.fs.cat_file(commit_key)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"not a JSON document: {exc}", path=where, field="commit") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    version = doc.get("version") if isinstance(doc, dict) else None
    if (
        not isinstance(files, dict)
        or not isinstance(version, str)
        or _VERSION.fullmatch(version) is None
        or not (doc.get("previous") is None or _VERSION.fullmatch(str(doc["previous"])))
        or not all(_safe_name(n) and _entry_ok(e) for n, e in files.items())
    ):
        raise FormatError(
            "not a pytreeio commit object (version, and files with sizes)",
            path=where,
            field="commit",
        )
    return doc


def _safe_name(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and all(p not in ("", ".", "..") for p in parts) and "\\" not in name


def _entry_ok(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and type(entry.get("size")) is int  # not a bool
        and 0 <= entry["size"] <= _MAX_SIZE
        and isinstance(entry.get("xxh3_64"), str)
    )


def _committed(url: Url, anchor: str, directory: bool) -> dict[str, tuple[str, int]] | None:
    """``{name: (object key, size)}`` of the committed version, or None without a commit."""
    doc = _read_commit(url, anchor, directory)
    if doc is None:
        return None
    _, prefix = _names_of(anchor, directory)
    base = f"{prefix}{doc['version']}/"
    return {name: (base + name, e["size"]) for name, e in doc["files"].items()}


def _plain_listing(url: Url, root: str, limit: int | None = None) -> dict[str, tuple[str, int]]:
    """``{relative path: (key, size)}`` of plain objects below ``root`` (pytreeio's own left
    out; at most ``limit``)."""
    url.fs.invalidate_cache(root)
    base = root.rstrip("/") + "/"
    try:
        with _storage_errors(url.at(root)):
            found = url.fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    out: dict[str, tuple[str, int]] = {}
    for key, info in sorted(found.items()):
        rel = key[len(base) :] if key.startswith(base) else None
        if rel and info.get("type") == "file" and _VERSION_MARK not in rel:
            out[rel] = (key, int(info.get("size") or 0))
        if limit is not None and len(out) >= limit:
            break
    return out


def _directory_files(url: Url, limit: int | None = None) -> tuple[dict[str, tuple[str, int]], bool]:
    """``(files, committed)`` of a directory: its committed version's, or its plain objects."""
    committed = _committed(url, url.key, True)
    if committed is not None:
        return committed, True
    return _plain_listing(url, url.key, limit), False


# --------------------------------------------------------------------------
# probes and sources
# --------------------------------------------------------------------------


def _linked_keys(url: Url, layout: Siblings) -> tuple[dict[str, str], str | None]:
    """``({role: key}, anchor)`` of a sibling layout's files at ``url`` (anchor: linked sets)."""
    located = {r: Path(p).as_posix() for r, p in layout.locate(Path(url.key)).items()}
    anchor = next((located[r] for r in layout.linked if r in located), None)
    return located, anchor


def probe(url: Url, layout: Layout, *, made: dict[Path, Probe] | None = None) -> Probe:
    """`pytreeio.io.probe` of a URL (never raises for missing objects; bounded reads)."""
    memo = {} if made is None else made
    virtual: dict[str, str] = {}  # a linked role's name -> its committed object
    if isinstance(layout, Siblings) and layout.linked:
        located, anchor = _linked_keys(url, layout)
        committed = _committed(url, anchor, False) if anchor else None
        for role_key in located.values():
            entry = (committed or {}).get(_parent(role_key)[1])
            if entry is not None:
                virtual[role_key] = entry[0]

    def probe_file(p: Path) -> Probe:
        real = Path(virtual.get(p.as_posix(), p.as_posix()))
        found = memo.get(real)
        if found is None:
            found = memo[real] = _probe_object(url, real.as_posix())
        return found if real == p else Probe(p, **_fields(found))

    def probe_dir(p: Path) -> Probe:
        alone = probe_file(p)
        if alone.kind == "file":  # an object is no directory: no listing needed
            return alone
        files, _ = _directory_files(url.at(p.as_posix()), _MAX_NAMES)
        if not files:
            return alone

        def head_of(name: str) -> bytes | None:
            key, size = files[name]
            with contextlib.suppress(OSError, FormatError):
                return bytes(RemoteSource(url, key, size, None).read(0, min(_HEAD, size), "head"))
            return None

        return _listing_probe(p, list(files), head_of)

    return _probe_with(Path(url.key), layout, probe_file, probe_dir)


def _fields(probe: Probe) -> dict[str, Any]:
    return {k: getattr(probe, k) for k in ("kind", "head", "size", "members", "names", "heads")}


def _probe_object(url: Url, key: str) -> Probe:
    p = Path(key)
    try:
        info = _info(url, key)
    except OSError:
        return Probe(p, kind="missing")
    if info is None:
        return Probe(p, kind="missing")
    if info.get("type") == "directory":
        return Probe(p, kind="dir")
    try:
        source = RemoteSource(url, key, int(info["size"]), _stamp(info), window=0)
        return _probe_source(p, source)
    except (OSError, FormatError):
        return Probe(p, kind="file", size=int(info.get("size") or 0))


class RemoteFiles(FileSet):
    """A `pytreeio.io.FileSet` of objects: names -> keys, each read on access."""

    def __init__(
        self,
        url: Url,
        files: Mapping[str, tuple[str, int]],
        *,
        headers: bool,
        root: str | None = None,
        checked: bool = False,
    ) -> None:
        super().__init__({n: url.at(k) for n, (k, _) in files.items()}, headers=headers, root=root)
        self._url = url
        self._files = dict(files)
        self._checked = checked

    def _source(self, name: str) -> RemoteSource:
        key, size = self._files[name]
        try:
            found = _object(self._url, key)
        except FileNotFoundError:
            raise ChangedWhileOpen(
                errno.ENOENT,
                "gone since the checkpoint was opened (replaced by a concurrent save?)",
                self._url.at(key),
            ) from None
        if self._checked:  # plain objects: each may be replaced, so each read is checked
            return found
        if found.size != size:  # never allocate what a commit object claims unchecked
            raise FormatError(
                f"the commit object records {size} bytes, the object has {found.size}",
                path=self._url.at(key),
                field="size",
            )
        return RemoteSource(self._url, key, size, None)  # a version's files are never rewritten

    def __getitem__(self, name: str) -> Any:
        src = self._source(name)
        return src if self._headers else src.read(0, src.size, "file")

    def ranges(self, name: str) -> RemoteSource:
        return self._source(name)


def open_source(url: Url, layout: Layout, *, mmap: bool = False, headers: bool = False) -> Any:
    """`pytreeio.io.open_source` of a URL: an object's bytes (a `RemoteSource` with
    ``headers``), or a `RemoteFiles` of a directory's or a sibling set's committed files.
    ``mmap`` maps local files only: objects are always read into fresh memory."""
    del mmap
    if isinstance(layout, File):
        src = _object(url, url.key)
        return src if headers else src.read(0, src.size, "file")
    if isinstance(layout, Directory):
        files, committed = _directory_files(url)
        if not files:
            info = _info(url, url.key)
            if info is not None and info.get("type") != "directory":
                raise FormatError("is a file, not a directory", path=url)
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", url)
        root = url.rstrip("/") + "/"
        return RemoteFiles(url, files, headers=headers, root=root, checked=not committed)
    if isinstance(layout, Siblings):
        return _open_siblings(url, layout, headers)
    raise TypeError(f"unknown layout {layout!r}")


def _open_siblings(url: Url, layout: Siblings, headers: bool) -> RemoteFiles:
    located, anchor = _linked_keys(url, layout)
    committed = _committed(url, anchor, False) if anchor else None
    found: dict[str, tuple[str, int]] = {}
    for role, key in located.items():
        if committed is not None and role in layout.linked:
            entry = committed.get(_parent(key)[1])
            if entry is not None:
                found[role] = entry
            continue
        info = _info(url, key)
        if info is not None and info.get("type") != "directory":
            found[role] = (key, int(info["size"]))
    if not found:
        listed = " and ".join(url.at(k) for k in located.values())
        raise FileNotFoundError(
            errno.ENOENT, f"No such file or directory (looked for {listed})", url
        )
    half = [r for r in layout.linked if r in located and r not in found]
    if half and any(r in found for r in layout.linked):
        raise FileNotFoundError(
            errno.ENOENT,
            f"No such file or directory: half a linked set (no {', '.join(half)})",
            url,
        )
    return RemoteFiles(url, found, headers=headers, checked=committed is None)


def identity(url: Url, layout: Layout) -> tuple[Any, ...]:
    """What a save changes: the commit object (directories, linked sets) or the objects."""
    try:
        if isinstance(layout, Directory):
            return (_read_commit(url, url.key, True),)
        keys = [url.key]
        if isinstance(layout, Siblings):
            located, anchor = _linked_keys(url, layout)
            if anchor is not None:
                return (_read_commit(url, anchor, False),)
            keys = list(located.values())
        return tuple(_stamp(i) if (i := _info(url, k)) else None for k in keys)
    except (OSError, FormatError):
        return ()


# --------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------


def _stage(path: str, encoded: Encoded, digest: bool) -> dict[str, Any]:
    """Write ``encoded`` to the local file ``path`` (late chunks at their offsets); its size
    and, with ``digest``, xxh3 checksum."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _write_chunks(fd, encoded.chunks)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return {"size": size, "xxh3_64": stream_checksum(read_chunks(path))[1] if digest else ""}


def _put(url: Url, items: Mapping[str, Encoded], digest: bool = False) -> dict[str, Any]:
    """Write each ``{key: encoded}`` as one object: staged in a local temporary directory,
    then uploaded, all at once (the store publishes each object whole when its upload
    completes).  ``{key: entry}``: sizes and, with ``digest``, checksums."""
    with tempfile.TemporaryDirectory(prefix="pytreeio-upload-") as staging:
        local = {key: os.path.join(staging, str(i)) for i, key in enumerate(items)}
        entries = {key: _stage(local[key], enc, digest) for key, enc in items.items()}
        keys = list(items)
        protocols = url.fs.protocol if isinstance(url.fs.protocol, tuple) else (url.fs.protocol,)
        in_place = not _OBJECT_STORES & set(protocols)
        # a file system that writes in place (sftp, hdfs, ...): upload aside, then rename
        targets = [_aside(k) for k in keys] if in_place else keys
        with _storage_errors(url.at(keys[0]) if len(keys) == 1 else url):
            if len(keys) == 1:
                url.fs.put_file(local[keys[0]], targets[0])
            elif keys:
                url.fs.put([local[k] for k in keys], targets)
            if in_place:
                for aside, key in zip(targets, keys, strict=True):
                    url.fs.mv(aside, key)
    return entries


def _aside(key: str) -> str:
    head, name = _parent(key)
    return f"{head}/.{name}.pytreeio-tmp-{os.getpid()}-{os.urandom(4).hex()}"


def _new_version() -> str:
    t = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}"
    return f"{stamp}Z-{_host()}-{os.getpid()}-{os.urandom(4).hex()}"


def _host() -> str:
    """This host, as version names spell it: the host name and, where there is one, the PID
    namespace (containers sharing a host name do not share process numbers)."""
    host = re.sub(r"[^A-Za-z0-9.]+", ".", socket.gethostname())[:64].strip(".") or "host"
    with contextlib.suppress(OSError):
        host += f".ns{os.stat('/proc/self/ns/pid').st_ino}"
    return host


def _write_version(
    url: Url, anchor: str, directory: bool, files: Mapping[str, Encoded], names: Mapping[str, str]
) -> None:
    """Write ``files`` (as ``names[file]``) as a new version of ``anchor``, commit it, tidy up."""
    commit_key, prefix = _names_of(anchor, directory)
    before = _read_commit_quietly(url, anchor, directory)
    version = _new_version()
    base = f"{prefix}{version}/"
    try:
        put = _put(url, {base + names[n]: enc for n, enc in files.items()}, digest=True)
        entries = {names[n]: put[base + names[n]] for n in files}
        _check_uploaded(url, base, entries)
    except BaseException:
        _remove(url, base)
        raise
    previous = before["version"] if before else None  # kept for readers still reading it
    doc = {"pytreeio_commit": 1, "version": version, "previous": previous, "files": entries}
    try:
        with _storage_errors(url.at(commit_key)):  # the commit point: one small PUT
            url.fs.pipe_file(commit_key, json.dumps(doc, indent=1).encode())
    except BaseException:
        # The PUT may have landed all the same (a timeout after the store took it): the
        # version goes only if the commit object does not name it.
        now = _read_commit_quietly(url, anchor, directory)
        if now is not None and now.get("version") != version:
            _remove(url, base)
        raise
    now = _read_commit_quietly(url, anchor, directory)
    keep = {now["version"], now.get("previous")} if now else {version, previous}
    retired = {before.get("previous")} if before else set()  # replaced two saves ago
    _tidy(url, prefix, keep=keep, remove=retired | {version})


def _check_uploaded(url: Url, base: str, entries: Mapping[str, Any]) -> None:
    """Refuse to commit a version whose files are not all there, at their sizes."""
    url.fs.invalidate_cache(base.rstrip("/"))
    with _storage_errors(url.at(base)):
        found = url.fs.find(base, detail=True)
    sizes = {k[len(base) :]: int(i.get("size") or 0) for k, i in found.items()}
    missing = [n for n, e in entries.items() if sizes.get(n) != e["size"]]
    if missing:
        raise OSError(
            errno.EIO, f"uploaded, then not found whole: {', '.join(missing[:3])}", url.at(base)
        )


def _read_commit_quietly(url: Url, anchor: str, directory: bool) -> dict[str, Any] | None:
    try:
        return _read_commit(url, anchor, directory)
    except (OSError, FormatError):
        return None


def _tidy(url: Url, prefix: str, *, keep: set[Any], remove: set[Any]) -> None:
    """Remove the versions of ``prefix`` that no reader or save needs (see the module
    docstring): those in ``remove`` and dead saves' (this host's whose process is gone, and
    any whose newest object is older than `STALE_AFTER` by the store's clock); never those
    in ``keep`` (the committed version and the one it replaced)."""
    head, _ = _parent(prefix)
    mark = prefix[len(head) + 1 :]
    url.fs.invalidate_cache(head)
    try:
        entries = url.fs.ls(head, detail=False)
    except Exception:  # nothing to tidy, or not listable: the next save tries again
        return
    host = _host()
    for entry in entries:
        name = _parent(entry)[1]
        version = name[len(mark) :] if name.startswith(mark) else ""
        m = _VERSION.fullmatch(version)
        if m is None or version in keep:
            continue
        try:
            pid = int(m.group(3))
            dead = (
                version in remove
                or (m.group(2) == host and pid != os.getpid() and not _alive(pid))
                or _idle_for(url, f"{head}/{name}") > STALE_AFTER
            )
        except Exception:  # an entry it cannot judge stays; the others are still tidied
            continue
        if dead:
            _remove(url, f"{head}/{name}/")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process (alive), or not a pid here
        return True
    return True


def _idle_for(url: Url, prefix: str) -> float:
    """Seconds since the newest object below ``prefix`` was written, by the store's clock
    (0 where the store gives no times: never stale)."""
    found = url.fs.find(prefix, detail=True)
    times = [_seconds(i) for i in found.values()]
    known = [t for t in times if t is not None]
    if not known or len(known) != len(times):
        return 0.0
    return time.time() - max(known)


def _seconds(info: Mapping[str, Any]) -> float | None:
    import datetime

    for k in _TIME_KEYS:
        v = info.get(k)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return None


def _remove(url: Url, prefix: str) -> None:
    with contextlib.suppress(Exception):  # best effort: a later save removes what is left
        url.fs.rm(prefix.rstrip("/"), recursive=True)


def write_atomic(url: Url, encoded: Encoded, layout: Layout) -> None:
    """`pytreeio.io.write_atomic` to a URL (see the module docstring for the protocol)."""
    if isinstance(layout, File):
        if encoded.files is not None:
            raise TypeError("a single-file format returned a multi-file encoding")
        _put(url, {url.key: encoded})
        return
    if encoded.files is None:
        raise TypeError("a multi-file format returned a single-file encoding")
    if isinstance(layout, Directory):
        for rel in encoded.files:
            if not _safe_name(rel):
                raise ValueError(f"{url}: the encoding names the file {rel!r}")
        _write_version(url, url.key, True, encoded.files, {n: n for n in encoded.files})
        return
    if not isinstance(layout, Siblings):
        raise TypeError(f"unknown layout {layout!r}")
    located, anchor = _linked_keys(url, layout)
    unknown = sorted(set(encoded.files) - set(located))
    if unknown:
        raise ValueError(f"the encoding has files for roles {unknown} that locate() lacks")
    if anchor is None:  # files of their own, each replaced whole (as on a local disk)
        _put(url, {located[role]: enc for role, enc in encoded.files.items()})
        return
    names = {role: _parent(located[role])[1] for role in encoded.files}
    _write_version(url, anchor, False, encoded.files, names)


def commit_record(
    url: Url, layout: Layout
) -> tuple[str, dict[str, tuple[int, str]], dict[str, str]] | None:
    """``(commit object's URL, {name: (size, xxh3)}, {name: key})`` of the committed version
    of a directory or linked set at ``url``; None for other layouts or without a commit."""
    if isinstance(layout, Directory):
        anchor, directory = url.key, True
    elif isinstance(layout, Siblings) and (anchor_ := _linked_keys(url, layout)[1]):
        anchor, directory = anchor_, False
    else:
        return None
    doc = _read_commit(url, anchor, directory)
    if doc is None:
        return None
    commit_key, prefix = _names_of(anchor, directory)
    base = f"{prefix}{doc['version']}/"
    recorded = {n: (e["size"], e["xxh3_64"]) for n, e in doc["files"].items()}
    return url.at(commit_key), recorded, {n: base + n for n in recorded}


def checksum(url: Url, key: str) -> tuple[int, str]:
    """``(size, xxh3_64)`` of the object at ``key``, read in blocks (bounded memory)."""
    src = _object(url, key)
    step = _BLOCK * _BLOCKS_AT_ONCE
    return stream_checksum(
        src.read(at, min(step, src.size - at), "file") for at in range(0, src.size, step)
    )


# --------------------------------------------------------------------------
# one object written by several processes (pytreeio.multihost)
# --------------------------------------------------------------------------

#: The objects this process assembles: the parts prefix -> the local file parts are merged into.
_ASSEMBLING: dict[str, str] = {}


@contextlib.contextmanager
def file_in_parts(url: Url, size: int) -> Iterator[str]:
    """`pytreeio.io.file_in_parts` for an object: yields the key prefix under which writers
    upload their parts (`PartWriter`).  This process, the lead, merges them into a local file of
    ``size`` bytes; when the block exits normally the file is uploaded as one object (old or new
    object, never a mix); either way the parts are removed."""
    head, name = _parent(url.key)
    prefix = f"{head}/.{name}.pytreeio-parts-{_new_version()}/"
    with tempfile.TemporaryDirectory(prefix="pytreeio-parts-") as staging:
        local = os.path.join(staging, name or "object")
        with open(local, "wb") as f:
            f.truncate(size)
        _ASSEMBLING[prefix] = local
        try:
            yield prefix
            _merge(url, prefix, local)
            with _storage_errors(url):
                url.fs.put_file(local, url.key)
        finally:
            del _ASSEMBLING[prefix]
            _remove(url, prefix)


def _merge(url: Url, prefix: str, local: str) -> None:
    """Write every complete part under ``prefix`` (its index uploaded) into ``local``."""
    url.fs.invalidate_cache(prefix.rstrip("/"))
    with _storage_errors(url.at(prefix)):
        try:
            keys = sorted(url.fs.find(prefix))
        except FileNotFoundError:
            keys = []
    size = os.path.getsize(local)
    fd = os.open(local, os.O_RDWR)
    try:
        for index_key in (k for k in keys if k.endswith(".index")):
            data_key = index_key[: -len(".index")] + ".data"
            where = url.at(index_key)
            with _storage_errors(where):
                index = json.loads(url.fs.cat_file(index_key))
            at = 0
            source = _object(url, data_key)
            for offset, n in index:
                if not (offset >= 0 and offset + n <= size and at + n <= source.size):
                    raise FormatError("a part lies outside the object", path=where, offset=offset)
                for done in range(0, n, _MAX_BLOCK):
                    piece = source.read(at + done, min(_MAX_BLOCK, n - done), "part")
                    os.pwrite(fd, piece, offset + done)
                at += n
            _remove(url, index_key)
            _remove(url, data_key)
    finally:
        os.close(fd)


class PartWriter(Closing):
    """One writer of an object written in parts (`file_in_parts`), at offsets.

    The lead writes into its local file; another process collects its writes in a local
    temporary and uploads them when closed, data first and then an index of their offsets.
    ``read_at`` reads back what the lead's file holds (every part uploaded by then merged in).
    """

    def __init__(self, url: Url, prefix: str) -> None:
        self._url = url
        self._lead = _ASSEMBLING.get(prefix)
        self._key = f"{prefix}{_new_version()}"
        self._ranges: list[tuple[int, int]] = []
        self._staging: tempfile.TemporaryDirectory[str] | None = None
        if self._lead is not None:
            _merge(url, prefix, self._lead)
            self._fd = os.open(self._lead, os.O_RDWR)
        else:
            self._staging = tempfile.TemporaryDirectory(prefix="pytreeio-part-")
            self._fd = os.open(os.path.join(self._staging.name, "data"), os.O_RDWR | os.O_CREAT)

    def write_at(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        if self._lead is not None:
            _write_at(self._fd, view, offset)
            return
        self._ranges.append((offset, len(view)))
        _write_at(self._fd, view, None)

    def read_at(self, offset: int, n: int) -> memoryview:
        if self._lead is None:
            raise TypeError("only the process leading a save in parts reads it back")
        view = np.empty(n, dtype=np.uint8).data
        got = os.preadv(self._fd, [view], offset)
        if got != n:
            raise FormatError("shorter than its parts", path=self._url, offset=offset + got)
        return view

    def close(self, *, durable: bool = False) -> None:
        del durable  # an object store keeps what it has acknowledged
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        if self._staging is None:
            return
        try:
            if self._ranges:
                data = os.path.join(self._staging.name, "data")
                with _storage_errors(self._url.at(self._key)):
                    self._url.fs.put_file(data, self._key + ".data")
                    self._url.fs.pipe_file(self._key + ".index", json.dumps(self._ranges).encode())
        finally:
            self._staging.cleanup()


def read_head(url: Url, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of a small object."""
    src = _object(url, url.key)
    return bytes(src.read(0, min(src.size, limit + 1), "file"))
