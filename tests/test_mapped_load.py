"""Loads of large files that read each array into memory of its own (pytreeio.mapped_load).

The reference is the same format's ``decode`` on one whole-file buffer (what
every load did before, and ``verify`` still does): for every format's seeds and
mutants, a mapped load gives the same bits, types and nesting, or the same
error.  ``MAP_MIN`` is lowered so that the small test files take the mapped path.
"""

from __future__ import annotations

import gc
import mmap
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_bits_equal
from fuzz import Seed, default_seeds, mutate, placed

import pytreeio as ptio
from pytreeio import api, io, mapped_load, registry
from pytreeio.errors import PytreeioError
from pytreeio.registry import FILE, Decoded, Encoded, Format, Info

FORMATS = [
    "msgpack",
    "safetensors",
    "tinyllama",
    "datacode",
    "netcl",
    "netcl-checkpoint",
    "netcl-params",
    "bullet",
    "waffe2",
]


class _Counts(list[int]):
    """Loads that fell back to whole buffers (the list's items), and files mapped (``maps``)."""

    maps = 0


@pytest.fixture
def mapped(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Counts]:
    """Every file mapped; counts the mappings made and the loads that fell back."""
    monkeypatch.setattr(mapped_load, "MAP_MIN", 0)
    monkeypatch.setattr(mapped_load, "MAP_MIN_IN_SET", 0)
    counts = _Counts()
    real = mapped_load._decode_mapped
    real_mapping = io.FileSource.mapping

    def counted(*args: Any) -> Any:
        result = real(*args)
        if result is None:
            counts.append(1)
        return result

    def mapping(self: io.FileSource) -> mmap.mmap:
        counts.maps += 1
        return real_mapping(self)

    monkeypatch.setattr(mapped_load, "_decode_mapped", counted)
    monkeypatch.setattr(io.FileSource, "mapping", mapping)
    yield counts


def _written(fmt: Format, data: Any, root: Path) -> Path | None:
    """The input laid out on disk as ``fmt`` reads it at the returned path (None: it can't be)."""
    path, files = placed(fmt, data)
    for p, blob in files.items():
        try:
            rel = p.relative_to(path.parent)
        except ValueError:
            continue  # a mutant's member outside the checkpoint
        dest = root / rel
        if dest.exists() and dest.is_dir():
            return None
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(blob)
    target = root / path.name
    if isinstance(fmt.layout, registry.Directory):
        target.mkdir(exist_ok=True)
    return target


def _outcome(path: Path, fmt: Format, options: Mapping[str, Any], *, own: bool) -> Any:
    try:
        _, native, meta = api._decode_path(path, fmt, False, options, own_arrays=own)
    except PytreeioError as exc:
        return ("error", type(exc), str(exc))
    return ("ok", native, dict(meta))


def _assert_same_outcome(a: Any, b: Any) -> None:
    assert a[0] == b[0], (a, b)
    if a[0] == "error":
        assert a[1:] == b[1:]
    else:
        assert_bits_equal(a[1], b[1])
        assert_bits_equal(a[2], b[2])


def _arrays(tree: Any) -> Iterator[np.ndarray]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _arrays(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _arrays(v)
    elif isinstance(tree, np.ndarray):
        yield tree


def _mapped_base(a: np.ndarray) -> bool:
    """Whether ``a``'s memory belongs to a file mapping."""
    base: Any = a
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        if isinstance(base, memoryview):
            base = base.obj
        else:
            base = getattr(base, "base", None)
    return False


@pytest.mark.parametrize("name", FORMATS)
def test_seeds_load_as_from_one_buffer_with_arrays_of_their_own(
    name: str, tmp_path: Path, mapped: _Counts
) -> None:
    fmt = registry.get(name)
    for i, seed in enumerate(default_seeds(name)):
        s = seed if isinstance(seed, Seed) else Seed(seed)
        path = _written(fmt, s.data, tmp_path / f"seed{i}")
        assert path is not None
        whole = _outcome(path, fmt, s.options, own=False)
        own = _outcome(path, fmt, s.options, own=True)
        _assert_same_outcome(whole, own)
        if own[0] == "ok":
            for a in _arrays((own[1], own[2])):
                assert not _mapped_base(a)
                assert a.flags.writeable
    assert not mapped
    # netcl's .npz files are read by the archive reader itself (CRC-32s fused into the
    # read, large members into buffers of their own: test_zip_fused.py); nothing is mapped
    assert mapped.maps > 0 or name in ("netcl", "netcl-params")


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.filterwarnings("ignore::pytreeio.PytreeioWarning")
def test_mutants_load_or_fail_as_from_one_buffer(
    name: str, tmp_path: Path, mapped: _Counts
) -> None:
    fmt = registry.get(name)
    seeds = [s if isinstance(s, Seed) else Seed(s) for s in default_seeds(name)]
    rng = random.Random(7)
    for i in range(25):
        seed = seeds[rng.randrange(len(seeds))]
        data, _how = mutate(seed.data, rng)
        path = _written(fmt, data, tmp_path / f"m{i}")
        if path is None:
            continue
        try:
            whole = _outcome(path, fmt, seed.options, own=False)
        except OSError:
            continue  # a layout the file system refuses (a mutated name): no decode to compare
        _assert_same_outcome(whole, _outcome(path, fmt, seed.options, own=True))
    assert not mapped


def test_adjacent_arrays_share_reads_and_large_ones_are_split(
    tmp_path: Path, mapped: _Counts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mapped_load, "_CALL_BYTES", 4096)
    monkeypatch.setattr(mapped_load, "_PARALLEL_BYTES", 0)  # the threads, with small files
    rng = np.random.default_rng(0)
    tree = {
        "big": rng.standard_normal(10_000).astype(np.float32),  # 10 blocks
        "f64": rng.standard_normal((7, 3)),
        "small": {f"b{i}": rng.integers(0, 9, 5, dtype=np.int16) for i in range(40)},
        "empty": np.zeros((0, 3), np.float32),
    }
    calls: list[tuple[int, list[int]]] = []
    real = io.FileSource.read_scattered

    def spy(self: io.FileSource, offset: int, buffers: Any, field: str) -> None:
        calls.append((offset, [len(b) for b in buffers]))
        real(self, offset, buffers, field)

    monkeypatch.setattr(io.FileSource, "read_scattered", spy)
    for name in ("msgpack", "safetensors"):
        calls.clear()
        path = tmp_path / f"t.{name}"
        ptio.save(path, tree, format=name)
        out = ptio.load(path)
        assert_bits_equal(tree, out)
        assert not any(_mapped_base(a) for a in _arrays(out))
        assert all(sum(sizes) <= 4096 + (64 << 10) for _, sizes in calls)
        assert sum(1 for _, sizes in calls if sizes == [4096]) >= 9  # the blocks of "big"
        # the 40 small arrays (and the headers between them) took far fewer calls than 40
        assert len(calls) < 25
    assert not mapped


def test_byte_order_and_memory_order_are_kept(tmp_path: Path, mapped: _Counts) -> None:
    big = np.arange(12, dtype=">f4").reshape(3, 4)
    fortran = np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    path = tmp_path / "x.npz"
    np.savez(path, big=big, fortran=fortran)
    fmt = registry.get("netcl-params")
    whole = api._decode_path(path, fmt, False, {}, own_arrays=False)[1]
    # an npz without a netcl sidecar is read by netcl-params; its arrays are its own already
    own = api._decode_path(path, fmt, False, {}, own_arrays=True)[1]
    assert_bits_equal(whole, own)

    # through the mapped path proper: a format whose decode returns such views
    data = path.read_bytes()
    views = ptio.load(path, format="netcl-params", mmap=True)
    starts = {k: data.find(v.tobytes(order="A")) for k, v in views.items()}
    fmt = _view_format(lambda view: {k: _at(view, v, starts[k]) for k, v in views.items()})
    out = ptio.load(path, format=fmt)
    assert out["big"].dtype == np.dtype(">f4")
    assert out["fortran"].flags.f_contiguous and not out["fortran"].flags.c_contiguous
    assert_bits_equal(views, out)
    assert not any(_mapped_base(a) for a in _arrays(out))
    assert not mapped


def _at(view: memoryview, like: np.ndarray, start: int) -> np.ndarray:
    flat = np.frombuffer(view, like.dtype, like.size, start)
    return flat.reshape(like.shape, order="F" if like.flags.f_contiguous else "C")


def _view_format(decode: Any) -> Format:
    def decode_fn(buffer: Any) -> Decoded:
        return Decoded(decode(buffer), {})

    return Format(
        name="views",
        description="test format: arrays are views of the buffer",
        suffixes=(),
        layout=FILE,
        encode=lambda tree, *, meta=None: Encoded(chunks=(b"",)),
        decode=decode_fn,
        inspect=lambda source: Info("views", ()),
        sniff=lambda probe: 0.0,
    )


def test_same_array_twice_stays_one_array_and_strided_views_are_copied(
    tmp_path: Path, mapped: _Counts
) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(np.arange(64, dtype=np.int32).tobytes())

    def decode(view: memoryview) -> Any:
        a = np.frombuffer(view, np.int32)
        return {"a": a[:8], "again": None, "strided": a[::3], "list": [a[8:16]]}

    def with_repeat(view: memoryview) -> Any:
        tree = decode(view)
        tree["again"] = tree["a"]
        return tree

    out = ptio.load(path, format=_view_format(with_repeat))
    assert out["again"] is out["a"]
    assert out["strided"].tolist() == list(range(0, 64, 3))
    assert out["list"][0].tolist() == list(range(8, 16))
    assert not any(_mapped_base(a) for a in _arrays(out))
    assert not mapped


class _Holder:
    """A container the detacher does not know: its array stays a view of the mapping."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Holder) and self.array.tobytes() == other.array.tobytes()


def test_a_view_the_detacher_cannot_reach_falls_back_to_one_buffer(
    tmp_path: Path, mapped: _Counts
) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(np.arange(16, dtype=np.float32).tobytes())
    fmt = _view_format(lambda view: {"held": _Holder(np.frombuffer(view, np.float32))})
    out = ptio.load(path, format=fmt)
    assert mapped == [1]
    assert not _mapped_base(out["held"].array)
    assert out["held"].array.flags.writeable  # a whole buffer's view, as before
    assert out["held"].array.tolist() == list(range(16))


def test_small_files_are_still_read_into_one_buffer(tmp_path: Path) -> None:
    path = tmp_path / "x.msgpack"
    ptio.save(path, {"a": np.ones(1000, np.float32), "b": np.zeros(1000, np.float32)})
    out = ptio.load(path)
    assert out["a"].base is not None and out["b"].base is not None
    assert np.shares_memory(out["a"].base, out["b"].base) or out["a"].base is out["b"].base


def test_a_directorys_files_are_mapped_from_a_lower_size_than_single_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cl-waffe2 reads its tensor files on its own threads: from MAP_MIN_IN_SET bytes a
    directory's file is mapped (its arrays allocated by the calling thread); a single file
    of the same size is still read whole."""
    monkeypatch.setattr(mapped_load, "MAP_MIN_IN_SET", 4096)
    maps: list[str] = []
    real_mapping = io.FileSource.mapping

    def mapping(self: io.FileSource) -> mmap.mmap:
        maps.append(Path(self.name).name)
        return real_mapping(self)

    monkeypatch.setattr(io.FileSource, "mapping", mapping)
    rng = np.random.default_rng(3)
    weights = [rng.standard_normal((32, 64), dtype=np.float32) for _ in range(3)]
    native = {
        "param": {
            "linearlayer": {
                str(i): {"weights": w.ravel(), "bias": np.arange(32, dtype=np.float32) + i}
                for i, w in enumerate(weights)
            }
        }
    }
    ckpt = tmp_path / "m.wf2model"
    ptio.save(ckpt, native, format="waffe2")
    out = ptio.load(ckpt, format="waffe2")
    assert sorted(maps) == [f"param:linearlayer.{i}.weights.npy" for i in range(3)]
    for i, w in enumerate(weights):
        got = out["param"]["linearlayer"][str(i)]
        assert np.array_equal(got["weights"], w.ravel())
        assert got["weights"].flags.writeable and not _mapped_base(got["weights"])
        assert np.array_equal(got["bias"], np.arange(32, dtype=np.float32) + i)
    maps.clear()
    single = tmp_path / "one.safetensors"
    ptio.save(single, {"w": weights[0]})
    assert np.array_equal(ptio.load(single)["w"], weights[0])
    assert maps == []


def test_errors_name_the_file_and_failed_loads_leave_no_view_of_the_mapping(
    tmp_path: Path, mapped: _Counts, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "x.safetensors"
    ptio.save(path, {"a": np.ones(4, np.float32)})
    data = bytearray(path.read_bytes())
    data[8] = ord("[")  # the header is no longer a JSON object
    path.write_bytes(bytes(data))
    maps: list[mmap.mmap] = []
    real = io.FileSource.mapping

    def kept(self: io.FileSource) -> mmap.mmap:
        maps.append(real(self))
        return maps[-1]

    monkeypatch.setattr(io.FileSource, "mapping", kept)
    with pytest.raises(ptio.FormatError) as info:
        ptio.load(path)
    assert info.value.path == str(path)
    del info
    gc.collect()
    assert maps
    for m in maps:
        m.close()  # BufferError if a view of it outlived the failed load


@pytest.mark.parametrize("short", [False, True])
def test_scattered_reads_fill_every_buffer_past_iov_max_and_short_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short: bool
) -> None:
    data = np.random.default_rng(3).integers(0, 256, 40_000, dtype=np.uint8).tobytes()
    path = tmp_path / "x.bin"
    path.write_bytes(data)
    if short:  # every preadv stops halfway: the rest is read buffer by buffer
        real = io.os.preadv

        def halfway(fd: int, buffers: Any, offset: int) -> int:
            if len(buffers) == 1:
                return real(fd, buffers, offset)
            total = sum(len(b) for b in buffers)
            keep, got = [], 0
            for b in buffers:
                if got + len(b) > total // 2:
                    break
                keep.append(b)
                got += len(b)
            return real(fd, keep, offset) if keep else 0

        monkeypatch.setattr(io.os, "preadv", halfway)
    sizes = [1 + (i % 13) for i in range(io.IOV_MAX * 2 + 500)]  # more buffers than one call takes
    bufs = [memoryview(bytearray(n)) for n in sizes]
    with io.FileSource(path) as src:
        src.read_scattered(100, bufs, "x")
        assert src.bytes_read == sum(sizes)
        assert b"".join(bytes(b) for b in bufs) == data[100 : 100 + sum(sizes)]
        with pytest.raises(ptio.FormatError) as info:
            src.read_scattered(len(data) - 5, [memoryview(bytearray(6))], "tail")
        assert info.value.field == "tail" and info.value.offset == len(data) - 5
