"""Whole-checkpoint loads of large files that read every array into memory of its own.

A format's ``decode`` takes each file as one buffer and returns arrays that
are views of it.  For a large file that buffer is one fresh allocation as
large as the file, whose pages the kernel maps and zero-fills on every load
(on a 2-core VM, a 537 MB load spent about as long in that as in the copy
from the page cache), and every array of the tree then keeps the whole
allocation alive.  Arrays of their own cost less: up to glibc's mmap
threshold (32 MiB at most) the allocator hands back memory that earlier
arrays freed, already mapped.

So :func:`decode_path` gives ``decode`` each file of at least
:data:`MAP_MIN` bytes (:data:`MAP_MIN_IN_SET` for the files of a directory
or sibling set) mapped read-only, where it touches only the pages of the
headers it parses.  Every array of the result that lies in a mapping
(found in the native tree and the meta document: dicts, lists, tuples and
NamedTuples, rebuilt, never mutated) is then read, on the calling thread's
allocations, into a new array of the same dtype,
byte order, shape and memory order -- adjacent arrays and the bytes between
them in one ``preadv``, large ones in blocks on a few threads -- and each
mapping is closed.  ``decode`` is the same function on the same bytes: it
accepts and refuses exactly what it does on a buffer, and the arrays hold
the same bits.  Smaller files are read whole, as before.

Formats that read a file themselves with a check fused into the read (the
npz CRC-32s, through ``FileSet.ranges``: :func:`pytreeio.zip.read_archive`)
still do.  When a mapping cannot be
closed afterwards (something other than an array in those containers still
uses it, so the result could hold a read-only view) the files are decoded
again from whole buffers.

Like every mapped read, a file that another program truncates in place while
``decode`` parses its headers raises SIGBUS; pytreeio's saves replace files by
rename and never truncate one.
"""

from __future__ import annotations

import mmap as _mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import io
from .pools import cores, share

__all__ = ["decode_path", "MAP_MIN", "MAP_MIN_IN_SET"]

#: Files at least this large are mapped for ``decode`` and their arrays read one by one.
MAP_MIN = 32 << 20
#: The same for a directory's or sibling set's files: smaller, because a format may read
#: them on its own threads (cl-waffe2's read-ahead), whose allocations cannot reuse the
#: memory the calling thread's arrays freed; mapping one costs under 1% of reading 4 MiB.
MAP_MIN_IN_SET = 4 << 20
# Header bytes between two arrays that one preadv reads (into scratch) rather than skipping.
_GAP_MAX = 64 << 10
# Bytes one preadv fills at most: the unit of work of the reading threads.
_CALL_BYTES = 16 << 20
# Below this many bytes in all, reading on the calling thread beats a hand-off.
_PARALLEL_BYTES = 8 << 20

Decode = Callable[[Any], tuple[Any, Any]]


@dataclass
class _Map:
    """A file mapped for ``decode``: its source (kept open for the reads) and its address range."""

    source: io.FileSource
    mapping: _mmap.mmap
    start: int

    @property
    def stop(self) -> int:
        return self.start + self.source.size


@dataclass
class _Reads:
    """The files opened for one decode: whole buffers for small ones, mappings for large ones.

    ``whole``: every file read whole (the fallback).
    """

    whole: bool = False
    maps: list[_Map] = field(default_factory=list)
    opened: list[io.FileSource] = field(default_factory=list)

    def buffer(self, src: io.FileSource, name: str, map_min: int | None = None) -> memoryview:
        """``src``'s bytes for ``decode``: mapped when at least ``map_min`` bytes (default
        :data:`MAP_MIN`; tracked), else read whole."""
        if self.whole or src.size < (MAP_MIN if map_min is None else map_min):
            return src.read(0, src.size, name)
        try:
            mapping = src.mapping()
        except (OSError, ValueError):  # a file system that cannot map: read it
            return src.read(0, src.size, name)
        view = memoryview(mapping)
        start = np.frombuffer(view, np.uint8, 1).__array_interface__["data"][0]
        self.maps.append(_Map(src, mapping, start))
        return view

    def close_maps(self) -> bool:
        """Close every mapping; False if one is still used (its export count is not zero)."""
        closed = True
        for m in self.maps:
            try:
                m.mapping.close()
            except BufferError:
                closed = False
        return closed

    def close(self) -> None:
        """Close the sources opened (the caller's ``opened`` stays open); mappings stay valid."""
        for src in self.opened:
            src.close()
        self.opened = []


class _Files(io.FilesOf[io.FileSet]):
    """A :class:`pytreeio.io.FileSet` whose files ``decode`` receives through :class:`_Reads`."""

    def __init__(self, files: io.FileSet, reads: _Reads) -> None:
        super().__init__(files)
        self._reads = reads

    def __getitem__(self, name: str) -> Any:
        src = self._files[name]  # a FileSource of its own (headers=True)
        self._reads.opened.append(src)
        return self._reads.buffer(src, name, MAP_MIN_IN_SET)

    def ranges(self, name: str) -> io.FileSource | None:
        return self._files.ranges(name)


def decode_path(opened: Any, decode: Decode) -> tuple[Any, Any]:
    """``decode`` of the files ``opened`` (``io.open_source(..., headers=True)``), arrays owned.

    The caller closes ``opened``; the sources this opens are closed here.
    """
    reads = _Reads()
    try:
        result = _decode_mapped(opened, reads, decode)
    finally:
        reads.close_maps()  # after a failure: those no traceback holds
        reads.close()
    if result is not None:
        return result
    whole = _Reads(whole=True)  # a mapping was still in use: decode from whole buffers
    try:
        return decode(_sources(opened, whole))
    finally:
        whole.close()


def _sources(opened: Any, reads: _Reads) -> Any:
    if isinstance(opened, io.FileSet):
        return _Files(opened, reads)
    return reads.buffer(opened, "file")


def _decode_mapped(opened: Any, reads: _Reads, decode: Decode) -> tuple[Any, Any] | None:
    native, meta = decode(_sources(opened, reads))
    if not reads.maps:
        return native, meta
    owned = _Detacher(reads.maps).detach((native, dict(meta)))
    del native, meta  # the views: the mappings close only once nothing uses them
    return owned if reads.close_maps() else None


class _Detacher:
    """Copies of the arrays of a tree that lie in the mappings, read from their files."""

    def __init__(self, maps: list[_Map]) -> None:
        self._maps = maps
        self._done: dict[int, np.ndarray] = {}
        self._jobs: list[tuple[int, int, memoryview]] = []  # (map, file offset, destination)

    def detach(self, tree: Any) -> Any:
        out = self._rebuilt(tree)
        _read_all(self._maps, self._jobs)
        return out

    def _rebuilt(self, x: Any) -> Any:
        t = type(x)
        if t is dict:
            return {k: self._rebuilt(v) for k, v in x.items()}
        if t is list:
            return [self._rebuilt(v) for v in x]
        if t is tuple:
            return tuple(self._rebuilt(v) for v in x)
        if isinstance(x, np.ndarray):
            return self._own(x)
        if isinstance(x, tuple) and hasattr(t, "_make"):  # optax states are NamedTuples
            return t._make(self._rebuilt(v) for v in x)
        return x

    def _own(self, a: np.ndarray) -> np.ndarray:
        done = self._done.get(id(a))
        if done is not None:  # the same array twice stays one array
            return done
        addr = a.__array_interface__["data"][0]
        i = next((i for i, m in enumerate(self._maps) if m.start <= addr <= m.stop), None)
        if i is None:
            return a  # made by decode (converted values): its own already
        if a.nbytes and (a.flags.c_contiguous or a.flags.f_contiguous):
            out = np.empty_like(a, order="K")
            dest = out.ravel(order="K").view(np.uint8).data
            self._jobs.append((i, addr - self._maps[i].start, dest))
        else:  # strided views (none of pytreeio's decoders make one) and empty arrays
            out = a.copy(order="K")
        self._done[id(a)] = out
        return out


def _read_all(maps: list[_Map], jobs: list[tuple[int, int, memoryview]]) -> None:
    """Fill every job's destination from its file: adjacent ones per ``preadv``, on threads."""
    calls: list[tuple[int, int, list[memoryview]]] = []
    end = -1
    filled = 0
    total = 0
    for i, offset, dest in sorted(jobs, key=lambda j: (j[0], j[1])):
        n = len(dest)
        total += n
        if calls and calls[-1][0] == i:
            gap = offset - end
            bufs = calls[-1][2]
            if 0 <= gap <= _GAP_MAX and len(bufs) + 2 <= io.IOV_MAX and filled + n <= _CALL_BYTES:
                if gap:
                    bufs.append(memoryview(bytearray(gap)))
                bufs.append(dest)
                end, filled = offset + n, filled + gap + n
                continue
        last = 0
        for last in range(0, n, _CALL_BYTES):  # a large array: blocks the threads share
            calls.append((i, offset + last, [dest[last : last + _CALL_BYTES]]))
        end, filled = offset + n, n - last

    def run(call: tuple[int, int, list[memoryview]]) -> None:
        i, offset, bufs = call
        maps[i].source.read_scattered(offset, bufs, "data")

    if total < _PARALLEL_BYTES or len(calls) < 2:
        for c in calls:
            run(c)
    else:
        share(io.read_pool(), min(cores(), 4), run, calls)
