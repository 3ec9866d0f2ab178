"""Sharded ``jax.Array``\\ s as leaves: saved shard by shard, loaded device by device.

**Saving.**  A ``jax.Array`` leaf partitioned over several devices is never
gathered (no ``np.asarray`` of the global array, no device-side gather): the
safetensors and msgpack encoders take it as a `ShardedLeaf`, a
`pytreeio.core.binary.Streamed` leaf whose bytes come from its shards,
and emit `ShardChunk`\\ s, `pytreeio.core.binary.Deferred` chunks
that io produces one at a time.  The array is cut into *bands* of rows
(along axis 0) at the shards' boundaries and at most `BAND_BYTES` each:
a band that lies inside one shard (sharding along the leading axis) is that
shard's own host buffer, written as it is; other bands are assembled from the
shards they cross in a buffer of the band's size.  Replicated shards are
written once (replica 0).  Every shard of an array is copied to host
(``copy_to_host_async`` for all, then each waited for) when its first band is
written and released after its last, so host memory peaks at about one array.

**Loading.**  ``pytreeio.load(path, like=...)`` with ``like`` leaves that carry
a sharding over several devices reads each distinct device slice straight from
the file with the format's ``slots`` (`read_region`): a C-order slice is
a set of contiguous byte runs, each ``pread`` into the host buffer that goes
to the device; runs shorter than a page are read in windows.  Replicas of a
slice are read once (`place`).

Saves in parts from several processes (`pytreeio.multihost`) set
`IN_PARTS` while they encode.  jax is imported only by the functions that need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np

from pytreeio.core import keys
from pytreeio.core.binary import Deferred, Slot, Streamed
from pytreeio.core.errors import EncodeError, MismatchError
from pytreeio.core.tree import describe_leaf

#: The most bytes one band of a sharded array takes on the host while it is written.
BAND_BYTES = 64 << 20
#: Runs shorter than this are read in windows rather than one ``pread`` each.
_PAGE = 4096
_WINDOW = 4 << 20

#: Set while a save in parts encodes: arrays whose shards lie partly in other
#: processes are then placeholders for this process's byte ranges.  The value is the
#: set of devices whose shards this process writes (`ADDRESSABLE`: all it can address).
IN_PARTS: ContextVar[Any] = ContextVar("pytreeio_in_parts", default=None)
ADDRESSABLE = "addressable"

Region = tuple[tuple[int, int], ...]

# --------------------------------------------------------------------------
# geometry: slices of a C-order array
# --------------------------------------------------------------------------


def region_of(index: Sequence[slice], shape: Sequence[int]) -> Region:
    """``((start, stop), ...)`` per axis of a shard's index (jax's tuple of slices)."""
    out: list[tuple[int, int]] = []
    for axis, n in enumerate(shape):
        s = index[axis] if axis < len(index) else slice(None)
        start, stop, step = s.indices(int(n))
        if step != 1:
            raise ValueError(f"a shard index with step {step} is not a block")
        out.append((start, max(start, stop)))
    return tuple(out)


def region_size(region: Region) -> int:
    return math.prod(b - a for a, b in region)


def c_runs(shape: Sequence[int], itemsize: int, region: Region) -> tuple[np.ndarray, int]:
    """Where ``region`` lies in the C-order bytes of an array of ``shape``.

    Returns ``(offsets, run)``: the byte offset of each contiguous run in the
    array (in C order of the region, so run ``j`` is bytes ``[j * run, (j+1) *
    run)`` of the region's own C-order buffer) and the runs' common length.
    """
    if region_size(region) == 0:
        return np.zeros(0, dtype=np.int64), 0
    # k: the last axis the region does not span fully; the axes after it are whole
    k = len(shape) - 1
    while k >= 0 and region[k] == (0, shape[k]):
        k -= 1
    if k < 0:
        return np.zeros(1, dtype=np.int64), math.prod(shape) * itemsize
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    run = (region[k][1] - region[k][0]) * strides[k] * itemsize
    offsets = np.array([region[k][0] * strides[k]], dtype=np.int64)
    for axis in range(k - 1, -1, -1):  # outer axes, innermost first
        a, b = region[axis]
        offsets = (np.arange(a, b, dtype=np.int64)[:, None] * strides[axis] + offsets).reshape(-1)
    return offsets * itemsize, run


# --------------------------------------------------------------------------
# saving: sharded leaves
# --------------------------------------------------------------------------


def is_sharded(x: Any) -> bool:
    """A ``jax.Array`` split over devices (not one whole copy per device): saved by shards."""
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(x, jax.Array):
        return False
    try:
        return not x.sharding.is_fully_replicated or not x.is_fully_addressable
    except Exception:  # tracers, deleted arrays: the ordinary path reports them
        return False


def on_accelerator(x: Any) -> bool:
    """A ``jax.Array`` held whole on one accelerator device (a GPU, a TPU): not host memory."""
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(x, jax.Array):
        return False
    try:
        (device,) = x.sharding.device_set
    except Exception:  # several devices, tracers, deleted arrays
        return False
    return bool(device.platform != "cpu")


def start_host_copies(tree: Any) -> None:
    """Start the device-to-host copy of every whole, accelerator-held jax array in ``tree`` at once.

    For a caller about to take every array to the host (``save_async``'s
    snapshot): the transfers overlap instead of running one after another.
    Arrays split over devices start their shards' copies when their first
    band is taken; CPU arrays are host memory already.
    """
    jax = sys.modules.get("jax")
    if jax is None:  # no jax imported: the tree holds no jax arrays
        return
    for leaf in jax.tree_util.tree_leaves(tree):
        if on_accelerator(leaf) and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            with contextlib.suppress(Exception):  # deleted or donated: encoding reports it
                leaf.copy_to_host_async()


def sharded_leaf(x: Any, key: str) -> ShardedLeaf | None:
    """The `ShardedLeaf` an encoder writes for ``x``, or None for other leaves.

    Arrays split over devices, and arrays held whole on an accelerator: the
    host copy of such an array starts when its leaf is made (an encoder makes
    them all before writing) and is awaited only when its bytes are written,
    so later transfers overlap earlier writes.
    """
    # In a save in parts an unsharded array is written by the primary alone, as ever:
    # every process holds its own copy, and only one may write its bytes.
    if not (is_sharded(x) or (on_accelerator(x) and IN_PARTS.get() is None)):
        return None
    if keys.is_key_dtype(x.dtype):
        return None  # typed PRNG keys go through their key data (a small array)
    return ShardedLeaf(x, key)


@dataclasses.dataclass(frozen=True)
class ShardChunk(Deferred):
    """A `Deferred` holding bytes ``[start, stop)`` of a sharded leaf's C-order data.

    ``seen`` is called with the bytes when they are produced (checksums); a
    save in parts calls it with the bytes read back from the file instead.
    ``owned``: the bytes produced are a host copy of device memory that
    nothing writes to (jax's read-only copy of an accelerator array), so a
    snapshot (``save_async``) may keep them instead of copying them again.
    """

    leaf: Any = None
    start: int = 0
    stop: int = 0
    seen: Callable[[np.ndarray], None] | None = None
    owned: bool = False


class ShardedLeaf(Streamed):
    """A sharded ``jax.Array`` as an encoder sees it: shape, dtype, nbytes and chunks of its bytes."""

    __slots__ = (
        "_array",
        "_blocks",
        "_host",
        "_key",
        "_left",
        "_owned",
        "_pieces",
        "_rows",
        "_whole",
    )

    def __init__(self, array: Any, key: str = "") -> None:
        dtype = np.dtype(array.dtype)
        self.slot = None  # type: ignore[assignment]  # read from shards, not from a file
        self.source = None
        self.shape = tuple(int(d) for d in array.shape)
        self.dtype = dtype if dtype.isnative else dtype.newbyteorder("=")
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._array = array
        self._key = key
        self._host: list[tuple[Region, np.ndarray]] | None = None
        self._left = 0
        seen: set[Region] = set()
        pieces: list[tuple[Region, Any]] = []
        mine = IN_PARTS.get()
        for shard in array.addressable_shards:
            if mine is not None and (
                shard.replica_id != 0 or (mine != ADDRESSABLE and shard.device not in mine)
            ):
                continue  # in parts, each block is written by the holder of its replica 0
            region = region_of(shard.index, self.shape)
            if region not in seen:
                seen.add(region)
                pieces.append((region, shard))
        if mine is None and sum(region_size(r) for r, _ in pieces) != math.prod(self.shape):
            raise EncodeError(
                "the array's shards lie partly in other processes: save it from every process "
                "with pytreeio.multihost.save_in_parts",
                key_path=key,
            )
        self._pieces = pieces
        # one device holds it all: its host copy is the array's own (started here,
        # or by start_host_copies), not a second transfer through a shard's view
        self._whole = len(pieces) == 1 and len(array.sharding.device_set) == 1
        self._owned = self._whole and _host_copy_is_private(array)
        if self._whole:  # started now, while the encoder goes on: awaited when written
            with contextlib.suppress(Exception):  # deleted or donated: reported when read
                array.copy_to_host_async()
        self._blocks = {
            region_of(index, self.shape)
            for index in array.sharding.devices_indices_map(self.shape).values()
        }
        rows = self.shape[0] if self.shape else 1
        self._rows = rows

    # -- what this process holds ------------------------------------------
    def local_pieces(self) -> list[tuple[Region, Any]]:
        """``(region, shard)`` of each block this process writes (replica 0 in a save in parts)."""
        return list(self._pieces)

    def _host_pieces(self) -> list[tuple[Region, np.ndarray]]:
        if self._host is None and self._whole:
            self._host = [(self._pieces[0][0], host_array(self._array))]
        elif self._host is None:
            for _, shard in self._pieces:  # every transfer started before the first is awaited
                shard.data.copy_to_host_async()
            self._host = [(r, host_array(s.data)) for r, s in self._pieces]
        return self._host

    # -- bands of rows -----------------------------------------------------
    def _row_bytes(self) -> int:
        return self.nbytes // self._rows if self._rows else 0

    def bands(self) -> list[tuple[int, int]]:
        """Row ranges ``[r0, r1)`` along axis 0: cut at shard boundaries, each at most BAND_BYTES."""
        rows = self._rows
        if not self.shape:
            return [(0, 1)]
        cuts = {0, rows}
        for region in self._blocks:  # every process's blocks: all cut the same bands
            cuts.update(region[0])
        per = max(1, BAND_BYTES // self._row_bytes()) if self._row_bytes() else max(rows, 1)
        edges = sorted(c for c in cuts if 0 <= c <= rows)
        return [
            (s, min(b, s + per)) for a, b in itertools.pairwise(edges) for s in range(a, b, per)
        ]

    def band(self, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` as a C-contiguous array: a shard's own buffer when one holds them all."""
        host = self._host_pieces()
        if not self.shape:
            return np.ascontiguousarray(host[0][1])
        whole_rest = tuple((0, n) for n in self.shape[1:])
        for region, arr in host:
            (a, b), rest = region[0], region[1:]
            if a <= r0 and r1 <= b and rest == whole_rest:
                return np.ascontiguousarray(arr[r0 - a : r1 - a])
        out = np.empty((r1 - r0, *self.shape[1:]), dtype=self.dtype)
        for region, arr in host:
            (a, b), rest = region[0], region[1:]
            lo, hi = max(r0, a), min(r1, b)
            if lo < hi:
                dst = (slice(lo - r0, hi - r0), *(slice(s, e) for s, e in rest))
                out[dst] = arr[lo - a : hi - a]
        return out

    def chunks(
        self,
        seen: Callable[[np.ndarray], None] | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[Deferred, ...]:
        """Bytes ``[start, stop)`` of the C-order data as `ShardChunk`\\ s, in order."""
        stop = self.nbytes if stop is None else stop
        row = self._row_bytes() if self.shape else self.nbytes
        out: list[Deferred] = []
        for r0, r1 in self.bands():
            b0, b1 = r0 * row, r1 * row
            lo, hi = max(b0, start), min(b1, stop)
            if lo < hi:
                produce = _BandProducer(self, r0, r1, lo - b0, hi - b0, seen)
                out.append(
                    ShardChunk(
                        hi - lo,
                        produce,
                        leaf=self,
                        start=lo,
                        stop=hi,
                        seen=seen,
                        owned=self._owned,
                    )
                )
        if not out:  # no bytes: still one chunk, so that checksums see the (empty) data
            produce = _BandProducer(self, 0, 0, 0, 0, seen)
            out.append(ShardChunk(0, produce, leaf=self, start=start, stop=start, seen=seen))
        self._left += len(out)
        return tuple(out)

    def _produced(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self._host = None  # the last band is out: let the host copies go

    # -- Streamed -----------------------------------------------------------
    def read(self) -> Any:
        """The whole array on the host, assembled from the shards (for encoders that need it)."""
        out = np.empty(self.shape, dtype=self.dtype)
        for region, arr in self._host_pieces():
            out[tuple(slice(a, b) for a, b in region)] = arr
        self._host = None
        return out

    def chunk(self, seen: Callable[[Any], None] | None = None) -> Deferred:
        """The data as one chunk (the whole array assembled when written)."""

        def produce() -> Any:
            arr = self.read()
            if seen is not None:
                seen(arr)
            return arr.reshape(-1).view(np.uint8).data if arr.size else b""

        return Deferred(self.nbytes, produce)

    def __repr__(self) -> str:
        return f"ShardedLeaf({self._key!r}, {self.shape}, {self.dtype}, {len(self._pieces)} blocks)"


class _BandProducer:
    """``produce`` of a `ShardChunk`: bytes ``[lo, hi)`` of rows ``[r0, r1)``."""

    __slots__ = ("hi", "leaf", "lo", "r0", "r1", "seen")

    def __init__(
        self,
        leaf: ShardedLeaf,
        r0: int,
        r1: int,
        lo: int,
        hi: int,
        seen: Callable[[np.ndarray], None] | None,
    ) -> None:
        self.leaf, self.r0, self.r1, self.lo, self.hi, self.seen = leaf, r0, r1, lo, hi, seen

    def __call__(self) -> Any:
        try:
            if self.hi == self.lo:
                data = np.zeros(0, dtype=np.uint8)
            else:
                band = self.leaf.band(self.r0, self.r1)
                data = band.reshape(-1).view(np.uint8)[self.lo : self.hi]
            if self.seen is not None:
                self.seen(data)
            return data.data
        finally:
            self.leaf._produced()


def _host_copy_is_private(array: Any) -> bool:
    """Whether ``np.asarray(array)`` is a copy jax made and never writes (not a CPU device buffer).

    A CPU array's host view is its device buffer, which a donation may reuse.
    """
    return all(d.platform != "cpu" for d in array.sharding.device_set)


def host_array(data: Any) -> np.ndarray:
    """A single-device array's host copy, C-contiguous in native byte order."""
    arr = np.asarray(data)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


# --------------------------------------------------------------------------
# loading: each device's slice
# --------------------------------------------------------------------------


def _spans_devices(leaf: Any) -> bool:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or not hasattr(sharding, "addressable_devices_indices_map"):
        return False
    try:
        return len(sharding.device_set) > 1
    except Exception:
        return False


def wants_slices(like: Any) -> bool:
    """Whether ``like`` has a leaf with a sharding over several devices (read slice by slice)."""
    jax = sys.modules.get("jax")
    if jax is None or like is None:
        return False
    try:
        leaves = jax.tree_util.tree_leaves(like)
    except Exception:
        return False
    return any(_spans_devices(leaf) for leaf in leaves)


def read_region(slot: Slot, source: Any, region: Region) -> np.ndarray | None:
    """The block ``region`` of a slot's array, reading only its bytes; None when the slot is
    not one plain stored range (a chunked, quantised or converted entry)."""

    if (
        slot.reader is not None
        or slot.convert is not None
        or slot.fortran
        or (slot.stored is not None and tuple(slot.stored) != tuple(slot.shape))
    ):
        return None
    src = slot.source_of(source)
    shape = tuple(slot.shape)
    dtype = slot.check_size(src, shape)
    out = np.empty(tuple(b - a for a, b in region), dtype=dtype)
    flat = out.reshape(-1).view(np.uint8)
    offsets, run = c_runs(shape, dtype.itemsize, region)
    if run >= _PAGE or len(offsets) <= 1:
        for j, off in enumerate(offsets.tolist()):
            _read_into(src, slot.offset + off, flat[j * run : (j + 1) * run], slot.key)
    else:
        _read_small_runs(src, slot, offsets, run, flat)
    if not dtype.isnative:
        out = out.astype(dtype.newbyteorder("="))
    return out


def _read_small_runs(src: Any, slot: Slot, offsets: np.ndarray, run: int, flat: np.ndarray) -> None:
    """Runs shorter than a page: read spans of up to _WINDOW bytes, copy the runs out."""
    offs = offsets.tolist()
    j = 0
    while j < len(offs):
        first = offs[j]
        k = j + 1
        while k < len(offs) and offs[k] + run - first <= _WINDOW:
            k += 1
        span = offs[k - 1] + run - first
        window = np.frombuffer(src.read(slot.offset + first, span, slot.key), dtype=np.uint8)
        for i in range(j, k):
            at = offs[i] - first
            flat[i * run : (i + 1) * run] = window[at : at + run]
        j = k


def _read_into(src: Any, offset: int, out: np.ndarray, field: str) -> None:
    fill = getattr(src, "read_into", None)
    if fill is not None:
        fill(offset, out.data, field)
    else:
        out[:] = np.frombuffer(src.read(offset, len(out), field), dtype=np.uint8)


def place(leaf: Any, like: Any, key: str) -> Any:
    """A lazy leaf (`pytreeio.core.tree.LazyLeaf`) as a jax array on ``like``'s sharding,
    each distinct device slice read on its own; None when the leaf cannot be read in parts."""
    shape = tuple(int(d) for d in like.shape)
    if np.dtype(leaf.dtype).newbyteorder("=") != np.dtype(like.dtype):
        # the ordinary path decides: a stored Python scalar (a step counter) may still fit
        # the template exactly; an array of another dtype is a MismatchError there
        return None
    if tuple(leaf.shape) != shape:
        raise MismatchError(
            "shape or dtype differs",
            key_path=key,
            expected=describe_leaf(like),
            found=describe_leaf(leaf),
        )
    read = getattr(leaf, "read_region", None)
    if read is None:
        return None
    import jax

    sharding = like.sharding
    blocks: dict[Region, Any] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        region = region_of(index, shape)
        block = blocks.get(region)
        if block is None:
            block = read(region)
            if block is None:
                return None
            blocks[region] = block
        arrays.append(jax.device_put(block, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
