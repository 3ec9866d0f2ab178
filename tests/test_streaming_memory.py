"""Streaming convert into the model formats holds one tensor at a time, not the checkpoint.

Every model format (and a Flax tree in safetensors) is converted into every
model format with ``ptio.convert`` under :mod:`tracemalloc`, which sees
numpy's allocations: the peak must stay within a few tensors (one read, its
transposed copy where the orientations differ, one per writing thread), far
below the checkpoint, and the files must equal the in-memory
``ptio.convert_encoded``'s.  The ``.npz`` writer's late headers for streamed
members are checked against Python's ``zipfile`` directly.
"""

from __future__ import annotations

import io as pyio
import itertools
import tracemalloc
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_streaming_convert import files_of

import pytreeio as ptio
from pytreeio.containers import npy
from pytreeio.containers import zip as zipfmt
from pytreeio.core.binary import BufferSource, Deferred, Slot, Streamed
from pytreeio.core.errors import EncodeError
from pytreeio.core.records import Encoded

IN, OUT, LAYERS = 384, 256, 12  # 384 KiB kernels, 4.5 MiB in all
TENSOR = IN * OUT * 4
BOUND = 3 * TENSOR + (512 << 10)
MODEL_FORMATS = ["netcl", "netcl-checkpoint", "netcl-params", "datacode", "waffe2", "bullet"]
SOURCES = {  # format -> save options of the source written from the Flax tree
    "safetensors": None,
    "netcl": {},
    "netcl-params": {},
    "datacode": {"variant": "later"},  # (out, in) rows: read as a transposed view
    "waffe2": {},  # kernels stored (out, in)
    "bullet": {},
}
#: netcl written from the later-variant DataCode: its kernels are Fortran-order .npy members
FORTRAN_NETCL = "netcl:fortran"


def _params() -> dict[str, Any]:
    rng = np.random.default_rng(5)
    shapes = [(IN, OUT) if i % 2 == 0 else (OUT, IN) for i in range(LAYERS)]
    return {
        f"Dense_{i}": {
            "kernel": rng.standard_normal(shape).astype(np.float32),
            "bias": rng.standard_normal(shape[1]).astype(np.float32),
        }
        for i, shape in enumerate(shapes)
    }


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("streaming-memory")
    flax = root / "flax.safetensors"
    ptio.save(flax, {"params": _params()})
    out = {"safetensors": flax}
    for fmt, options in SOURCES.items():
        if options is not None:
            out[fmt] = root / f"src-{fmt}"
            ptio.convert(flax, out[fmt], to=fmt, **options)
    out[FORTRAN_NETCL] = root / "src-netcl-fortran"
    ptio.convert(out["datacode"], out[FORTRAN_NETCL], to="netcl")
    with np.load(out[FORTRAN_NETCL]) as z:
        assert np.isfortran(z["0:weight"])
    return out


def traced_peak(fn: Any) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("src", "dst"), list(itertools.product([*SOURCES, FORTRAN_NETCL], MODEL_FORMATS))
)
def test_convert_into_model_formats_holds_a_few_tensors(
    sources: dict[str, Path], tmp_path: Path, src: str, dst: str
) -> None:
    path, out = sources[src], tmp_path / "out"
    src = src.split(":")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # waffe2 sources warn of their layer list
        peak = traced_peak(lambda: ptio.convert(path, out, from_=src, to=dst, durable=False))
        want = ptio.convert_encoded(files_of(path, src), from_=src, to=dst, dest=out)
    assert peak < BOUND, f"peak {peak / 2**20:.1f} MiB for a {LAYERS * TENSOR / 2**20:.1f} MiB tree"
    assert LAYERS * TENSOR > 2 * BOUND  # the bound tells streaming from holding the checkpoint
    got = files_of(out, dst)
    assert got == (
        {k: v.tobytes() for k, v in want.files.items()} if want.files else want.tobytes()
    )


# --------------------------------------------------------------------------
# .npz members whose data is produced when written
# --------------------------------------------------------------------------


def _deferred_of(data: bytes, pieces: int = 3) -> list[Deferred]:
    cuts = np.linspace(0, len(data), pieces + 1).astype(int)
    return [
        Deferred(int(b - a), lambda a=a, b=b: memoryview(data)[a:b])
        for a, b in itertools.pairwise(cuts)
    ]


def test_streamed_members_match_zipfile() -> None:
    big = np.arange(300_000, dtype=np.uint8).tobytes()
    small = b"plain member"
    chunks = zipfmt.encode_stored([("a.npy", _deferred_of(big)), ("b.npy", [small])])
    assert any(isinstance(c, Deferred) and c.late for c in chunks)  # the CRC comes after the data
    got = Encoded(chunks=tuple(chunks)).tobytes()
    with zipfile.ZipFile(pyio.BytesIO(got)) as z:
        assert z.testzip() is None  # every CRC-32 right
        assert z.read("a.npy") == big and z.read("b.npy") == small
    want = zipfmt.encode_stored([("a.npy", [big]), ("b.npy", [small])])
    assert got == Encoded(chunks=tuple(want)).tobytes()


def test_streamed_member_of_wrong_length_is_an_encode_error() -> None:
    lying = Deferred(10, lambda: b"12345")
    chunks = zipfmt.encode_stored([("a.npy", [lying])])
    with pytest.raises(EncodeError, match="produced 5 bytes, 10 declared"):
        Encoded(chunks=tuple(chunks)).tobytes()


def test_fortran_order_is_kept_for_a_streamed_transposed_view() -> None:
    """A C-order record read as its transpose is written as numpy writes the transposed view."""
    stored = np.arange(12, dtype=np.float32).reshape(3, 4)
    base = Streamed(Slot("w", 0, stored.nbytes, (3, 4), np.float32), BufferSource(stored.tobytes()))
    views = [
        (base.T, stored.T),  # Fortran-contiguous: the record's bytes, fortran_order True
        (base, stored),
        (base.reshape(4, 3).T, stored.reshape(4, 3).T),
        (base.reshape(2, 3, 2).transpose(1, 0, 2), stored.reshape(2, 3, 2).transpose(1, 0, 2)),
        (base.reshape(1, 12).T, stored.reshape(1, 12).T),  # only a length-1 axis moves: C order
    ]
    for view, arr in views:
        buf = pyio.BytesIO()
        np.lib.format.write_array(buf, arr, allow_pickle=False)
        assert Encoded(chunks=tuple(npy.encode_npy(view))).tobytes() == buf.getvalue(), view
