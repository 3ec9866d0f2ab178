"""Sharded-array checks that need 8 CPU devices, run in a subprocess by :mod:`tests.test_sharding`.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before jax
initialises its backend; the main test processes already run jax with one
device, so each case runs here, in a fresh interpreter::

    python tests/sharding_cases.py CASE [CASE ...]

prints ``PASS CASE`` or the traceback of each and exits non-zero if any failed.
jax is imported only in :func:`main`, after the flag is set.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from thread_group import run_threads  # noqa: E402  (tests/ is sys.path[0] for a script)

DEVICES = 8
#: The thread group's exchange timeout and each thread's join limit (8 devices start slowly).
LIMITS: dict[str, float] = {"timeout": 120, "join": 180}
CASES: dict[str, Callable[[Path], None]] = {}


def case(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    CASES[fn.__name__] = fn
    return fn


def mesh() -> Any:
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))


def named(spec: tuple[Any, ...]) -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh(), P(*spec))


#: (name, shape, dtype, partition spec over the 4 x 2 mesh ("x", "y"))
LAYOUTS: list[tuple[str, tuple[int, ...], Any, tuple[Any, ...]]] = [
    ("rows_2d", (64, 48), np.float32, ("x", "y")),  # 2-D mesh over both axes
    ("rows", (64, 48), np.float32, ("x",)),  # leading axis, replicated over "y"
    ("cols", (16, 40), np.int32, (None, "y")),  # second axis only
    ("transposed", (32, 24), ml_dtypes.bfloat16, ("y", "x")),
    ("flat8", (64,), np.int8, (("x", "y"),)),  # 1-D over all 8 devices
    ("cube", (4, 8, 6), np.uint16, (None, "x", "y")),  # inner axes
    ("replicated", (8, 8), np.float32, ()),  # fully replicated: the ordinary path
    ("flags", (16, 8), np.bool_, ("x", "y")),
]


def host_value(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    arr = raw.view(dt).reshape(shape)
    if dt.kind == "f" or dt == np.dtype(ml_dtypes.bfloat16):
        arr = np.where(np.isfinite(arr.astype(np.float32)), arr, 0).astype(dt)
    return arr


def trees() -> tuple[dict[str, Any], dict[str, Any]]:
    """The same values as sharded jax arrays and as numpy arrays."""
    import jax

    sharded: dict[str, Any] = {}
    whole: dict[str, Any] = {}
    for i, (name, shape, dtype, spec) in enumerate(LAYOUTS):
        value = host_value(shape, dtype, i)
        whole[name] = value
        sharded[name] = jax.device_put(value, named(spec))
    for tree in (sharded, whole):
        tree["meta"] = {"step": 3, "lr": 0.5, "bias": np.arange(5, dtype=np.float32)}
    return sharded, whole


@contextmanager
def no_gather() -> Iterator[None]:
    """Fail if any array spanning several devices is converted to numpy as a whole."""
    import jax

    cls = type(jax.device_put(np.zeros(2), jax.devices()[0]))
    original = cls.__array__

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(self.sharding.device_set) > 1 and not self.sharding.is_fully_replicated:
            raise AssertionError(f"gathered a sharded array {self.shape} {self.sharding}")
        return original(self, *args, **kwargs)

    cls.__array__ = guarded
    try:
        yield
    finally:
        cls.__array__ = original


@contextmanager
def counting_reads() -> Iterator[dict[str, list[int]]]:
    """Sizes of the reads of checkpoint files: ``into`` (straight into a slice's buffer) and
    ``range`` (headers, framing, whole entries)."""
    from pytreeio import io

    sizes: dict[str, list[int]] = {"into": [], "range": []}
    read_into, read = io.FileSource.read_into, io.FileSource._read

    def counted_into(self: Any, offset: int, out: memoryview, field: str) -> None:
        sizes["into"].append(len(out))
        read_into(self, offset, out, field)

    def counted(self: Any, offset: int, n: int) -> memoryview:
        sizes["range"].append(n)
        return read(self, offset, n)

    io.FileSource.read_into = counted_into  # type: ignore[method-assign]
    io.FileSource._read = counted  # type: ignore[method-assign]
    try:
        yield sizes
    finally:
        io.FileSource.read_into = read_into  # type: ignore[method-assign]
        io.FileSource._read = read  # type: ignore[method-assign]


def assert_placed(result: Any, value: np.ndarray, sharding: Any) -> None:
    assert result.sharding == sharding, (result.sharding, sharding)
    assert result.dtype == value.dtype and result.shape == value.shape
    for shard in result.addressable_shards:
        assert np.asarray(shard.data).tobytes() == value[shard.index].tobytes(), shard.index


# --------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------


@case
def save_bytes_identical(tmp: Path) -> None:
    """Every layout, every format option: the same bytes as saving the numpy values."""
    import pytreeio as ptio
    from pytreeio.core import shards

    sharded, whole = trees()
    runs = [
        ("safetensors", {}),
        ("safetensors", {"checksum": False}),
        ("msgpack", {}),
        ("msgpack", {"chunk_bytes": 100}),  # flax's chunked arrays, cut inside bands
    ]
    default = shards.BAND_BYTES
    for band in (default, 64):  # 64: bands of a few rows, assembled across shards
        shards.BAND_BYTES = band
        try:
            check_runs(tmp, sharded, whole, runs, band)
        finally:
            shards.BAND_BYTES = default
    ptio.verify(tmp / "sharded.safetensors")  # the checksums recorded from the bands hold


def check_runs(tmp: Path, sharded: Any, whole: Any, runs: list[Any], band: int) -> None:
    """Save ``sharded`` (never gathered) and ``whole`` with each (format, options): same bytes."""
    import pytreeio as ptio

    for fmt, options in runs:
        with no_gather():
            ptio.save(tmp / f"sharded.{fmt}", sharded, format=fmt, **options)
        ptio.save(tmp / f"whole.{fmt}", whole, format=fmt, **options)
        a = (tmp / f"sharded.{fmt}").read_bytes()
        b = (tmp / f"whole.{fmt}").read_bytes()
        assert a == b, (fmt, options, band)
        with no_gather():
            enc = ptio.encode(sharded, format=fmt, **options)
            assert enc.tobytes() == b, (fmt, options, band, "encode")


@case
def save_streams_shard_buffers(tmp: Path) -> None:
    """Leading-axis shards are written from their own buffers, one chunk per shard."""
    import jax

    import pytreeio as ptio
    from pytreeio.core.shards import ShardChunk

    value = host_value((64, 256), np.float32, 1)
    arr = jax.device_put(value, named((("x", "y"),)))
    enc = ptio.encode({"w": arr}, format="safetensors", checksum=False)
    parts = [c for c in enc.chunks if isinstance(c, ShardChunk)]
    assert [c.nbytes for c in parts] == [value.nbytes // 8] * 8, [c.nbytes for c in parts][:9]
    buffers = {np.asarray(s.data).ctypes.data for s in arr.addressable_shards}
    for c in parts:
        produced = np.frombuffer(c.produce(), dtype=np.uint8)
        assert produced.ctypes.data in buffers  # the shard's own host buffer: no copy
    # a 2-D mesh layout is assembled band by band: one band per row block
    arr2 = jax.device_put(value, named(("x", "y")))
    enc2 = ptio.encode({"w": arr2}, format="safetensors", checksum=False)
    parts2 = [c for c in enc2.chunks if isinstance(c, ShardChunk)]
    assert [c.nbytes for c in parts2] == [value.nbytes // 4] * 4


@case
def load_reads_own_slices(tmp: Path) -> None:
    """Each distinct device slice is read once, straight from the file; bit-exact values."""
    import jax

    import pytreeio as ptio

    value = host_value((64, 4096), np.float32, 2)  # 1 MiB; runs of at least 8 KiB
    ptio.save(tmp / "w.safetensors", {"w": value, "b": np.arange(3.0)}, format="safetensors")
    ptio.save(tmp / "w.msgpack", {"w": value, "b": np.arange(3.0)}, format="msgpack")
    header = 8 + int.from_bytes((tmp / "w.safetensors").read_bytes()[:8], "little")
    specs = [("x", "y"), ("x",), (None, "y"), (("x", "y"),), ("y", "x")]
    for spec in specs:
        sh = named(spec)
        blocks = {
            tuple((s.start, s.stop) for s in idx)
            for idx in sh.devices_indices_map(value.shape).values()
        }
        block_bytes = value.nbytes // len(blocks)
        like = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sh), "b": np.zeros(3)}
        with counting_reads() as sizes:
            out = ptio.load(tmp / "w.safetensors", like=like, format="safetensors")
        assert_placed(out["w"], value, sh)
        assert np.array_equal(out["b"], np.arange(3.0))
        # each distinct block is read once (replicas too), straight into its buffer:
        # bytes read per block = the block's bytes; beyond them only the header and "b"
        assert sum(sizes["into"]) == len(blocks) * block_bytes == value.nbytes, spec
        assert sum(sizes["range"]) <= header + 8 + 24, (spec, sizes["range"])
        with counting_reads() as sizes:
            out = ptio.load(tmp / "w.msgpack", like=like, format="msgpack")
        assert_placed(out["w"], value, sh)
        assert sum(sizes["into"]) == value.nbytes, spec
        # the framing is read in 64 KiB windows around each array header
        assert sum(sizes["range"]) <= 3 * (64 << 10), (spec, sizes["range"])
    # a partial load and a lazy view place slices the same way
    sh = named(("x", "y"))
    like_w = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sh)}
    out = ptio.load(tmp / "w.safetensors", like=like_w, partial=True)
    assert_placed(out["w"], value, sh)
    with ptio.open(tmp / "w.safetensors") as ck:
        assert_placed(ck.load(like=like_w)["w"], value, sh)
    # small runs (narrow columns) are read in windows: still exact
    narrow = host_value((256, 16), np.int16, 3)
    ptio.save(tmp / "n.safetensors", {"n": narrow})
    sh = named((None, ("x", "y")))
    out = ptio.load(
        tmp / "n.safetensors",
        like={"n": jax.ShapeDtypeStruct(narrow.shape, narrow.dtype, sharding=sh)},
    )
    assert_placed(out["n"], narrow, sh)


@case
def load_round_trip_all_layouts(tmp: Path) -> None:
    """Sharded save -> sharded load, every layout and format: bit-exact, on the right shardings."""
    import jax

    import pytreeio as ptio

    sharded, whole = trees()
    like = jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        sharded,
    )
    # a step counter stored as a Python int, restored into a replicated int32 template
    like["meta"] = {**like["meta"], "step": jax.ShapeDtypeStruct((), np.int32, sharding=named(()))}
    for fmt in ("safetensors", "msgpack"):
        ptio.save(tmp / f"t.{fmt}", sharded, format=fmt)
        out = ptio.load(tmp / f"t.{fmt}", like=like)
        for name, _shape, _dtype, spec in LAYOUTS:
            assert_placed(out[name], whole[name], named(spec))
        step = out["meta"]["step"]
        assert step.dtype == np.int32 and int(step) == 3 and step.sharding == named(())
        assert out["meta"]["lr"] == 0.5


@case
def load_mismatch_names_key(tmp: Path) -> None:
    """A sharded like whose global shape or dtype differs raises MismatchError naming the key."""
    import jax

    import pytreeio as ptio
    from pytreeio.core.errors import MismatchError

    value = host_value((64, 48), np.float32, 4)
    ptio.save(tmp / "m.safetensors", {"params": {"w": value}})
    sh = named(("x", "y"))
    for shape, dtype in (((64, 40), np.float32), ((64, 48), np.int32), ((48, 64), np.float32)):
        like = {"params": {"w": jax.ShapeDtypeStruct(shape, dtype, sharding=sh)}}
        try:
            ptio.load(tmp / "m.safetensors", like=like)
        except MismatchError as exc:
            assert exc.key_path == "params/w", exc.key_path
            assert "float32[64, 48]" in str(exc), str(exc)
        else:
            raise AssertionError(f"no MismatchError for {shape} {dtype}")


@case
def save_async_snapshots_shards(tmp: Path) -> None:
    """save_async of sharded arrays (deferred shard chunks, safetensors' late checksum header):
    the bytes of ``save``, though every array is deleted and its memory reused once it returns."""
    import jax

    import pytreeio as ptio
    from pytreeio.core.binary import Deferred

    for fmt in ("safetensors", "msgpack"):
        sharded, whole = trees()
        chunks = ptio.encode(sharded, format=fmt).chunks
        assert any(isinstance(c, Deferred) and not c.late for c in chunks), fmt
        ptio.save(tmp / f"want.{fmt}", whole, format=fmt)
        with no_gather():
            fut = ptio.save_async(tmp / f"async.{fmt}", sharded, format=fmt)
        for name, leaf in sharded.items():  # the training loop donates its arrays...
            if isinstance(leaf, jax.Array):
                leaf.delete()
                # ...and fills the devices with new ones, likely where the old shards were
                _, shape, dtype, spec = next(x for x in LAYOUTS if x[0] == name)
                jax.device_put(np.zeros(shape, dtype), named(spec)).block_until_ready()
        sharded["meta"]["bias"][:] = -1.0
        fut.result()
        got = (tmp / f"async.{fmt}").read_bytes()
        assert got == (tmp / f"want.{fmt}").read_bytes(), fmt
    ptio.verify(tmp / "async.safetensors")


@case
def threads_save_in_parts(tmp: Path) -> None:
    """Two "processes" (threads, each holding 4 devices) write one file in parts."""
    import jax

    import pytreeio as ptio
    from pytreeio import multihost
    from pytreeio.core.errors import PytreeioError

    sharded, whole = trees()
    devices = jax.devices()
    halves = [set(devices[:4]), set(devices[4:])]
    for fmt in ("safetensors", "msgpack"):
        dest = tmp / f"p.{fmt}"
        ptio.save(tmp / f"w.{fmt}", whole, format=fmt)
        written = run_threads(
            2,
            lambda coord, dest=dest, fmt=fmt: multihost.save_in_parts(
                dest, sharded, format=fmt, coordinator=coord
            ),
            halves,
            **LIMITS,
        )
        assert written == [None, None], written
        assert dest.read_bytes() == (tmp / f"w.{fmt}").read_bytes(), fmt
    ptio.verify(tmp / "p.safetensors")
    leftovers = [p.name for p in tmp.iterdir() if "pytreeio-tmp" in p.name]
    assert not leftovers, leftovers

    # one process fails (its tree cannot be encoded): both raise, the old file stays
    before = (tmp / "p.safetensors").read_bytes()
    bad = {**sharded, "meta": {"oops": object()}}
    results = run_threads(
        2,
        lambda coord: multihost.save_in_parts(
            tmp / "p.safetensors",
            bad if coord.process_index == 1 else sharded,
            coordinator=coord,
        ),
        halves,
        **LIMITS,
    )
    for r in results:
        assert isinstance(r, multihost.PartsError), r
        assert "process 1" in str(r) and "EncodeError" in str(r), str(r)
        assert isinstance(r, PytreeioError)
    assert (tmp / "p.safetensors").read_bytes() == before

    # the processes disagree on the layout (different shapes): refused before writing
    other = {**sharded, "rows": jax.device_put(np.zeros((64, 40), np.float32), named(("x",)))}
    results = run_threads(
        2,
        lambda coord: multihost.save_in_parts(
            tmp / "p.safetensors",
            other if coord.process_index == 1 else sharded,
            coordinator=coord,
        ),
        halves,
        **LIMITS,
    )
    assert all(isinstance(r, multihost.PartsError) and "layout" in str(r) for r in results)
    assert (tmp / "p.safetensors").read_bytes() == before


def main(names: list[str]) -> int:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    )
    import jax

    assert jax.device_count() == DEVICES, jax.devices()
    failed = 0
    for name in names or list(CASES):
        with tempfile.TemporaryDirectory() as d:
            try:
                CASES[name](Path(d))
            except BaseException:
                failed += 1
                print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
            else:
                print(f"PASS {name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
