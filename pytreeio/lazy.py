"""Lazy, partial reads of a checkpoint: `open` and the partial ``load``.

``pytreeio.open(path)`` returns a `Checkpoint`, a read-only mapping of
flattened native key -> array that reads each tensor's bytes only when it is
asked for.  It rests on a format's ``slots`` function (see
`pytreeio.core.binary.Slot`): where every array of the native tree lies,
found from the headers alone.  Formats without one decode the whole checkpoint
once, on first access to anything but `Checkpoint.info`.

The files are opened once, under the same shared lock and journal recovery as
``load`` (`pytreeio.io.open_source`), and the descriptors are held until
`Checkpoint.close`: a save that replaces the checkpoint meanwhile is not
seen, so a view never mixes an old file with a new one.

``open(path, verify=True)`` checks what the checkpoint records about the
bytes it reads (see `open` for what, per format).

``load(path, like=subtree, partial=True)`` goes through the same view: with a
``slots`` function and a native-shaped ``like`` only the entries ``like``
names are read.  Model-shaped ``like`` trees restored through a model format's
``to_model`` (and formats without ``slots``) decode the file mapped, then
restore the subtree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

from pytreeio import io
from pytreeio.core import shards
from pytreeio.core.binary import Slot
from pytreeio.core.calls import check_like, keywords_explained
from pytreeio.core.errors import FormatError, MismatchError
from pytreeio.core.records import Format, Info
from pytreeio.core.tree import (
    MISSING,
    LazyLeaf,
    flatten_named,
    key_string,
    map_leaves,
    parse_key_string,
    partial_restore,
)
from pytreeio.core.tree import _lookup as _child
from pytreeio.engine import dispatch

__all__ = ["open", "Checkpoint", "load_partial"]

PathLike = str | os.PathLike[str]

# Several tensors at least this large are read on a few threads at once
# (each pread releases the GIL); smaller ones cost less than the hand-off.
_PARALLEL_SLOT_BYTES = 4 << 20
_PARALLEL_SLOTS = 4


class _Sources(io.FilesOf[io.FileSet]):
    """One `pytreeio.io.FileSource` per file of a `pytreeio.io.FileSet`, kept open."""

    def __init__(self, files: io.FileSet) -> None:
        super().__init__(files)
        self._open: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        src = self._open.get(name)
        if src is None:
            src = self._open[name] = self._files[name]
        return src

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self._open.values())

    def close(self) -> None:
        for src in self._open.values():
            src.close()
        self._open = {}
        self._files.close()


class _Whole(io.FilesOf[_Sources]):
    """Whole-file buffers of held sources, read on access (what ``decode`` receives)."""

    def __getitem__(self, name: str) -> Any:
        src = self._files[name]
        return src.read(0, src.size, name)


class _Bound(LazyLeaf):
    """A slot with the source it reads from: a leaf that `pytreeio.core.tree.restore` reads."""

    __slots__ = ("_ck", "dtype", "shape", "slot")

    def __init__(self, slot: Slot, ck: Checkpoint) -> None:
        self.slot = slot
        self.shape = slot.shape
        self.dtype = slot.dtype
        self._ck = ck

    def read(self) -> Any:
        return self._ck._read(self.slot)

    def read_region(self, region: tuple[tuple[int, int], ...]) -> Any:
        self._ck._check_open()
        with self._ck._located():
            return shards.read_region(self.slot, self._ck._source, region)

    def place(self, like: Any, key: str) -> Any:
        return shards.place(self, like, key)


class Checkpoint(Mapping[str, Any]):
    """A lazy, read-only view of a checkpoint; see `open`.

    As a mapping: flattened native key (``params/Dense_0/kernel``, as
    `pytreeio.flatten` and ``inspect`` name them) -> the array, read
    when accessed (non-array leaves -- Python scalars, strings -- come as
    ``decode`` returns them).
    """

    def __init__(
        self,
        path: PathLike,
        format: str | Format | None,
        options: Mapping[str, Any],
        verify: bool = False,
    ):
        self.path = os.fspath(path)
        self._closed = True
        fmt = dispatch.format_for_load(path, format)
        fmt.check_options(options, "load")
        self._fmt = fmt
        #: Whether reads are checked (see `open`).
        self.verify = bool(verify)
        self._options = {**options, **_verify_options(fmt, options)} if verify else dict(options)
        opened = io.open_source(path, fmt.layout, headers=True)
        self._source: Any = _Sources(opened) if isinstance(opened, io.FileSet) else opened
        self._closed = False
        if verify:
            from pytreeio import integrity

            try:
                integrity.check_manifest(path, fmt)  # every file read once, if it has a manifest
            except BaseException:
                self.close()
                raise
        self._info: Info | None = None
        self._tree: Any = MISSING
        self._meta: dict[str, Any] = {}
        self._flat: dict[str, Any] | None = None
        if fmt.slots is not None:
            try:
                with self._located():
                    slots = dispatch.call(fmt.slots, fmt, self._options, self._source)
            except BaseException:
                self.close()
                raise
            self._tree, self._meta = slots.tree, dict(slots.meta)

    # -- errors and the file ------------------------------------------------
    @contextmanager
    def _located(self) -> Iterator[None]:
        """Name the file in errors that format functions raise without one (or with a role)."""
        try:
            yield
        except (FormatError, MismatchError) as exc:
            if exc.path is None:
                exc.path = self.path
            elif isinstance(self._source, _Sources):  # a role or a directory's relative path
                exc.path = self._source.path_of(exc.path)
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the checkpoint view of {self.path} is closed")

    def _native(self) -> Any:
        """The slot tree (or, for formats without ``slots``, the decoded tree: decoded once)."""
        self._check_open()
        if self._tree is MISSING:
            fmt = self._fmt
            data = self._source
            if isinstance(data, _Sources):
                data = _Whole(data)
            else:
                data = data.read(0, data.size, "file")
            with self._located():
                native, meta = dispatch.call(fmt.decode, fmt, self._options, data)
            self._tree, self._meta = native, dict(meta)
        return self._tree

    def _read(self, slot: Slot) -> Any:
        self._check_open()
        with self._located():
            return slot.read(self._source)

    # -- public -------------------------------------------------------------
    @property
    def format(self) -> str:
        """The format's registry name."""
        return self._fmt.name

    @property
    def info(self) -> Info:
        """What ``pytreeio.inspect`` reports (headers only)."""
        if self._info is None:
            self._check_open()
            with self._located():
                info = self._fmt.inspect(self._source)
            self._info = Info(info.format, info.entries, info.meta, self.path)
        return self._info

    @property
    def meta(self) -> dict[str, Any]:
        """The meta document ``load_with_meta`` returns."""
        self._native()
        return self._meta

    @property
    def bytes_read(self) -> int:
        """Bytes read from the files so far (headers and tensors)."""
        return int(getattr(self._source, "bytes_read", 0))

    def _entries(self) -> dict[str, Any]:
        if self._flat is None:
            self._flat = flatten_named(self._native())
        return self._flat

    def __getitem__(self, key: str) -> Any:
        entries = self._entries()
        if key not in entries:
            raise KeyError(_missing(key, entries))
        leaf = entries[key]
        return self._read(leaf) if isinstance(leaf, Slot) else leaf

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())

    def __contains__(self, key: object) -> bool:
        return key in self._entries()

    @keywords_explained
    def load(self, *, like: Any = None, prefix: str | None = None, partial: bool = True) -> Any:
        """The native subtree under ``prefix`` (all of it by default), read now.

        With ``like`` the subtree is restored into ``like``'s structure (as
        ``load`` does; ``like`` is never modified) and only the entries that
        end up in the result are read.  ``partial`` (default here) lets
        ``like`` name fewer entries than the subtree holds; an entry of
        ``like`` the file lacks is a `MismatchError` either way.
        """
        check_like(like)
        native = self._native()
        path: tuple[Any, ...] = ()
        if prefix:
            try:
                path = parse_key_string(prefix)
            except ValueError as exc:
                raise KeyError(f"malformed prefix {prefix!r}: {exc}") from None
            for depth, comp in enumerate(path):
                native = _child(native, comp)
                if native is MISSING:
                    raise KeyError(_missing(key_string(path[: depth + 1]), self._entries()))
        if like is None:
            return self._materialize(native)
        fmt, meta = self._fmt, self._meta
        with self._located(), partial_restore(partial):
            if self._needs_model(like):
                # to_model wants the whole native tree as arrays (decode's own result)
                return dispatch.restore_tree(
                    fmt, self._materialize(native), meta, like, self._options
                )
            lazy = map_leaves(lambda x: _Bound(x, self) if isinstance(x, Slot) else x, native)
            if prefix:
                from pytreeio.core.tree import restore

                return restore(lazy, like, path=path)
            return dispatch.restore_tree(fmt, lazy, meta, like, self._options)

    def _needs_model(self, like: Any) -> bool:
        from pytreeio.engine.dispatch import carried
        from pytreeio.model import form as model_mod

        if not model_mod.is_model_like(like):
            return False
        return carried(self._fmt, self._meta)[0].is_model_format

    def _materialize(self, native: Any) -> Any:
        """``native`` with every slot read (large ones on a few threads)."""
        slots: list[Slot] = []
        map_leaves(lambda x: slots.append(x) if isinstance(x, Slot) else None, native)
        if not slots:
            return native
        large = [s for s in slots if s.reader is None and s.nbytes >= _PARALLEL_SLOT_BYTES]
        done: dict[int, Any] = {}
        if len(large) > 1:
            from pytreeio.core.threads import new_pool

            with new_pool(min(_PARALLEL_SLOTS, len(large))) as pool:
                for slot, arr in zip(large, pool.map(self._read, large), strict=True):
                    done[id(slot)] = arr
        for slot in slots:
            if id(slot) not in done:
                done[id(slot)] = self._read(slot)
        return map_leaves(lambda x: done[id(x)] if isinstance(x, Slot) else x, native)

    def close(self) -> None:
        """Release the files (arrays already read stay valid)."""
        if not self._closed:
            self._closed = True
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<pytreeio.Checkpoint {self.path!r} ({self._fmt.name}, {state})>"


def _verify_options(fmt: Format, options: Mapping[str, Any]) -> dict[str, Any]:
    """The load options that make ``fmt``'s ``slots``/``decode`` check what its files record."""
    out: dict[str, Any] = {}
    accepted = fmt.load_options
    if "verify" in accepted:  # safetensors' checksums, bullet's own checks
        out["verify"] = True
    if "verify_crc" in accepted:  # npz members' CRC-32 (the netcl formats)
        if options.get("verify_crc") is False:
            raise TypeError("verify=True checks the npz CRCs: it contradicts verify_crc=False")
        out["verify_crc"] = True
    return out


def _missing(key: str, entries: Mapping[str, Any]) -> str:
    import difflib

    near = difflib.get_close_matches(key, list(entries), n=5, cutoff=0.6)
    hint = f"; near: {', '.join(near)}" if near else ""
    return f"no entry {key!r} in the checkpoint ({len(entries)} entries{hint})"


@keywords_explained
def open(
    path: PathLike,
    *,
    format: str | Format | None = None,
    verify: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> Checkpoint:
    """A lazy view of the checkpoint at ``path`` (use as a context manager).

    ``format`` and ``options`` are those of ``load``.  Nothing but headers is
    read until a tensor is asked for: ``ck["params/Dense_0/kernel"]``,
    ``ck.load(like=subtree, prefix="params")``.  Formats with a ``slots``
    function (safetensors, msgpack, Tiny Llama, the netcl formats, and those
    whose modules add one) read only the requested tensors' bytes; the others
    decode the whole checkpoint on first access.

    ``verify=True`` checks what the checkpoint records about its bytes, as
    ``load(..., verify=True)`` does, for the bytes a view reads:

    * pytreeio's safetensors files: each tensor read is hashed and compared
      with its recorded xxh3_64 checksum (a sharded ``like`` then reads whole
      tensors, not just each device's slice: a checksum covers a whole
      tensor).  Files from other tools record none: nothing to compare.
    * npz members (netcl, netcl-checkpoint, netcl-params): each member read
      is read whole and its CRC-32 checked (these formats do so by default;
      ``verify=True`` refuses ``verify_crc=False``).
    * formats whose ``decode``/``slots`` take a ``verify`` option (bullet):
      it is passed on, with what it checks.
    * the checkpoint's manifest (`pytreeio.integrity`), if it has one:
      every file is hashed when the view opens (read once, whole).

    A mismatch raises `FormatError` naming the file, the tensor
    (``field``) and its data ``offset`` (a manifest mismatch: the file).
    A format that records nothing about its data (msgpack, Tiny Llama, ...
    with no manifest) has nothing more to check; its framing is checked on
    every read, with or without ``verify``.

    Raises as ``load`` does: ``FileNotFoundError``, `UnknownFormatError`,
    `FormatError` for malformed headers (tensor data is checked when read).

    A URL (``s3://``, ``gs://``, any fsspec protocol; ``storage_options`` configure its file
    system) is read by ranged GETs: the headers, then each tensor's bytes when it is asked for.
    """
    return Checkpoint(io.location(path, storage_options), format, options, verify)


def load_partial(
    path: PathLike,
    like: Any,
    *,
    format: str | Format | None = None,
    mmap: bool = False,
    options: Mapping[str, Any],
) -> tuple[Any, dict[str, Any]]:
    """``load_with_meta(path, like=like, partial=True)``: the entries ``like`` names, and the
    meta, reading only those entries where possible."""
    fmt = dispatch.format_for_load(path, format)
    if fmt.slots is not None:
        with Checkpoint(path, fmt, options) as ck:
            if not ck._needs_model(like):
                return ck.load(like=like, partial=True), ck.meta
    # model-shaped `like` (through to_model) or no slots: decode mapped, restore the subtree
    _, native, meta = dispatch.decode_path(path, fmt, True, options)
    with dispatch.errors_located(path), partial_restore(True):
        result = dispatch.restore_tree(fmt, native, meta, like, options)
    return (result if mmap else map_leaves(_owned, result)), meta


def _owned(leaf: Any) -> Any:
    """A leaf that does not keep the file's mapping alive (load without mmap owns its arrays)."""
    import numpy as np

    if isinstance(leaf, np.ndarray) and not leaf.flags.writeable:
        return leaf.copy()
    return leaf


def load_sliced(
    path: str | os.PathLike[str], like: Any, *, format: Any, options: Any
) -> tuple[Any, dict[str, Any]] | None:
    """``load_with_meta(path, like=like)`` for a ``like`` with sharded leaves: each device's slice
    read on its own through the format's slots; None when the format has none (or ``like`` is
    model-shaped)."""
    fmt = dispatch.format_for_load(path, format)
    if fmt.slots is None:
        return None
    with Checkpoint(path, fmt, options) as ck:
        if ck._needs_model(like):
            return None
        return ck.load(like=like, partial=False), ck.meta
