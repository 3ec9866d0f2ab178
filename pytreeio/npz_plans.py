"""Replay of an in-memory ``.npz`` archive whose framing was read before.

An archive of thousands of small arrays costs :func:`pytreeio.npy.read_npz`
a walk per member: its central record, local header, name and ``.npy`` header
are each parsed and checked.  Those bytes are a pure function of the names,
shapes and dtypes, which a training run keeps from save to save.  So after a
successful read of an archive of plain stored members, :func:`learn` records
its *skeleton* (:class:`pytreeio.skeleton.Skeleton`): every byte except

* each array's data (after its ``.npy`` header), and
* each member's CRC-32 fields, in its local header (offset 14, which the
  reader never consults: the central directory's value is the one checked)
  and in its central record (offset 16),

and per member where its bytes and its array lie.  :func:`replay` accepts a
buffer of the same length whose skeleton bytes are all equal, hashes every
member's bytes and compares each CRC-32 with its central record's (as the
reader does), and builds the arrays from the recorded headers.  Any
difference (one skeleton byte, one CRC) returns None and the reader parses
the buffer, reporting whatever is wrong; so replay accepts exactly the
buffers the reader accepts, and returns the same arrays.

Writing has its twin: an archive of small arrays whose members (names,
``.npy`` headers, sizes) are those of the archive written just before, for
the second time in a row, is kept as a :class:`WritePlan`, and later ones are
written as one copy of it with each array's bytes and CRC-32 in place
(:func:`planned_write`); a plan is kept only if it reproduces the writer's
bytes exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import crc as _crc
from .array_runs import ArrayRuns
from .binary import Buffer
from .layouts import Memo
from .skeleton import Shelf, Skeleton

if TYPE_CHECKING:
    from .npy import NpyHeader
    from .zip import ZipMember

__all__ = [
    "Plan",
    "WritePlan",
    "learn",
    "learn_write",
    "planned_write",
    "replay",
    "worth_learning",
    "worth_planning",
]

#: Archives with fewer members read fast enough: no plan.
MIN_MEMBERS = 32
#: Plans kept at most (the most recently learnt first; one per archive length).
MAX_PLANS = 4

#: Offsets of the CRC-32 field in a local header and in a central record.
_LOCAL_CRC, _CENTRAL_CRC = 14, 16


@dataclass(frozen=True)
class Plan:
    """A learnt archive: its skeleton, and per member where its bytes and its array lie."""

    skeleton: Skeleton
    spans: tuple[tuple[int, int], ...]  # each member's bytes, [start, stop): what its CRC covers
    crc_at: np.ndarray  # offsets of the central records' CRC-32 bytes, 4 per member, in order
    names: tuple[str, ...]  # the arrays' names, in archive order
    runs: ArrayRuns  # how to make the arrays on a buffer, in that order


_PLANS: Shelf[Plan] = Shelf(MAX_PLANS, MIN_MEMBERS)


def replay(view: memoryview, *, verify_crc: bool = True) -> dict[str, np.ndarray] | None:
    """``read_npz``'s arrays of ``view`` (views of it, by name in archive order), when a plan's
    skeleton matches it (and, with ``verify_crc``, every member's CRC-32 its central record);
    else None."""
    plan = _PLANS.find(view)
    if plan is None:
        return None
    if verify_crc:
        stored = np.frombuffer(view, dtype=np.uint8)[plan.crc_at].view("<u4")
        found = np.array(_crc.crc32_spans(view, plan.spans), dtype=np.uint32)
        if not np.array_equal(stored, found):
            return None  # the reader names the member
    return dict(zip(plan.names, plan.runs.build(view)))


def worth_learning(view: memoryview, members: int) -> bool:
    """Whether to learn a read of ``view`` of ``members`` members: from the second read of an
    archive of its length on (a one-off load pays nothing for a plan)."""
    return _PLANS.learns(view, members)


def learn(
    view: memoryview,
    members: Sequence[ZipMember],
    names: Sequence[str],
    headers: Sequence[NpyHeader | None],
    central_at: Sequence[int] | None,
) -> None:
    """Record a successful read of ``view``: its stored ``members`` (in archive order), their
    array ``names``, each member's ``.npy`` header (None: not learnt) and the offset of each
    member's central record (None: not learnt)."""
    if central_at is None or len(central_at) != len(members) or not members:
        return
    arrays: list[tuple[str, NpyHeader, int]] = []
    for m, name, h in zip(members, names, headers):
        if h is None or m.method != 0 or h.data_offset + h.nbytes != m.size:
            return
        arrays.append((name, h, m.data_offset + h.data_offset))
    local, central = _crc_fields(members, central_at)
    begin = np.array([m.data_offset for m in members], dtype=np.int64)
    end = begin + np.array([m.size for m in members], dtype=np.int64)
    data_at = np.array([at for _, _, at in arrays], dtype=np.int64)
    # per member its local CRC field then its array's data; then the central CRC fields
    starts = np.concatenate((np.column_stack((local, data_at)).ravel(), central))
    stops = np.concatenate((np.column_stack((local + 4, end)).ravel(), central + 4))
    skeleton = Skeleton.of(view, starts, stops)
    if skeleton is None:
        return
    spans = tuple(zip(begin.tolist(), end.tolist()))
    crc_at = (central[:, None] + np.arange(4)).ravel()
    runs = ArrayRuns([(at, h.dtype, h.shape, h.fortran_order) for _, h, at in arrays])
    names = tuple(name for name, _, _ in arrays)
    _PLANS.keep(Plan(skeleton, spans, crc_at, names, runs))


def _crc_fields(
    members: Sequence[ZipMember], central_at: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Where each member's CRC-32 field starts: in its local header, in its central record."""
    local = np.array([m.header_offset for m in members], dtype=np.int64) + _LOCAL_CRC
    return local, np.asarray(central_at, dtype=np.int64) + _CENTRAL_CRC


# --------------------------------------------------------------------------
# writing: the same archive layout with other data
# --------------------------------------------------------------------------

#: Archives whose members average at most this many bytes are written through a plan: the
#: archive is then built as one copy, which for small arrays costs less than a chunk each
#: (a large array's bytes are better referenced than copied).
MAX_PLANNED_MEAN = 4096
#: Archives of at most this many bytes are written through a plan.  A plan keeps a copy of
#: the archive (at most :data:`MAX_PLANS` of them are kept), and a save through it makes one.
MAX_PLANNED_ARCHIVE = 4 << 20

#: One member of an archive to write: (member name, its ``.npy`` header, its data's size).
Signature = tuple[tuple[str, bytes, int], ...]


@dataclass(frozen=True)
class WritePlan:
    """An archive written before: its bytes, and where each member's data and CRC-32s go."""

    signature: Signature
    template: bytes  # the archive as written, data and CRCs included (overwritten each time)
    data_at: tuple[int, ...]  # where each member's array data starts
    header_crcs: tuple[int, ...]  # the CRC-32 of each member's .npy header, continued by its data
    crc_index: np.ndarray  # (2 * members, 4): each member's local then central CRC-32 bytes

    def encode(self, data: Sequence[Buffer]) -> bytearray:
        """The archive with these arrays' bytes (in member order) in place of the template's."""
        out = bytearray(self.template)
        hash_ = _crc.raw_crc32()  # continues from a start value: header + data in one call
        crcs = []
        for at, start, d in zip(self.data_at, self.header_crcs, data):
            out[at : at + len(d)] = d
            crcs.append(hash_(d, start))
        values = np.array(crcs, dtype="<u4").view(np.uint8).reshape(-1, 4)
        np.frombuffer(out, dtype=np.uint8)[self.crc_index] = np.repeat(values, 2, axis=0)
        return out


_WRITE_PLANS: Memo[int, WritePlan] = Memo(MAX_PLANS)  # by member count: a run writes few
_WRITTEN: Memo[int, Signature] = Memo(4 * MAX_PLANS)  # the last signature written, by count


def planned_write(signature: Signature, data: Sequence[Buffer]) -> bytearray | None:
    """The archive of these members from the plan for ``signature``, or None (none yet)."""
    plan = _WRITE_PLANS.get(len(signature))
    if plan is None or plan.signature != signature:
        return None
    return plan.encode(data)


def worth_planning(signature: Signature) -> bool:
    """Whether to plan an archive of ``signature`` once written: the second time in a row one
    is written (a one-off save pays nothing for a plan)."""
    n = len(signature)
    total = sum(len(h) + size for _, h, size in signature)
    if n < MIN_MEMBERS or total > min(n * MAX_PLANNED_MEAN, MAX_PLANNED_ARCHIVE):
        return False
    seen = _WRITTEN.get(n) == signature
    _WRITTEN.keep(n, signature)
    return seen


def learn_write(signature: Signature, data: Sequence[Buffer], written: bytes) -> None:
    """Record ``written``, the archive of ``signature`` with ``data``, as a plan (if it replays)."""
    if len(written) > MAX_PLANNED_ARCHIVE:
        return
    from .binary import BufferSource
    from .zip import central_offsets, read_zip_directory

    source = BufferSource(written)
    members = read_zip_directory(source)
    central = central_offsets(source)
    if central is None or len(members) != len(signature):
        return
    local, cent = _crc_fields(members, central)
    starts = np.column_stack((local, cent)).ravel()  # member i's local, then central field
    plan = WritePlan(
        signature,
        bytes(written),
        tuple(m.data_offset + len(h) for m, (_, h, _) in zip(members, signature)),
        tuple(_crc.crc32(h) for _, h, _ in signature),
        starts[:, None] + np.arange(4),
    )
    if plan.encode(data) != written:  # the plan must write what the writer wrote
        return
    _WRITE_PLANS.keep(len(signature), plan)
