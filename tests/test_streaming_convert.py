"""Streaming convert: tensor by tensor, the same bytes as an in-memory convert, bounded memory.

The byte-identity tests compare ``ptio.convert`` (which streams where the
formats allow) with ``ptio.convert_encoded`` (which never does) on small
checkpoints.  The memory test converts a 1 GiB bullet checkpoint into
safetensors in a subprocess and checks that its peak RSS grew by far less
than the checkpoint (the whole file in memory would be 1 GiB).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import io
from pytreeio.core.binary import Deferred, Streamed
from pytreeio.core.digest import array_checksum
from pytreeio.core.records import Siblings
from pytreeio.engine import conversion

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def files_of(path: Path, fmt: str | None = None) -> Any:
    layout = ptio.list_formats()[fmt].layout if fmt else None
    if isinstance(layout, Siblings):
        return {r: p.read_bytes() for r, p in layout.locate(path).items() if p.exists()}
    if path.is_dir():
        return {name: (path / name).read_bytes() for name in io.walk(path)}
    return path.read_bytes()


def streams(src: Path, from_: str, to: str, **options: Any) -> bool:
    """Whether ``ptio.convert`` would stream this conversion."""
    container, target = ptio.list_formats()[from_], ptio.list_formats()[to]
    load_options = conversion.decode_options(container, target, options)
    found = conversion.open_streamed(src, container, target, load_options)
    if found is None:
        return False
    native, _, source = found
    source.close()
    leaves = [native]
    while leaves:  # at least one array is read only when written
        x = leaves.pop()
        if isinstance(x, Streamed):
            return True
        if isinstance(x, dict):
            leaves.extend(x.values())
        if isinstance(x, list | tuple):
            leaves.extend(x)
    return False


def check_identical(src: Path, dst: Path, from_: str, to: str, **options: Any) -> None:
    """The streamed convert's bytes equal the in-memory convert's; checksums verify."""
    assert streams(src, from_, to, **options)
    ptio.convert(src, dst, to=to, **options)
    want = ptio.convert_encoded(files_of(src, from_), from_=from_, to=to, dest=dst, **options)
    assert dst.read_bytes() == want.tobytes()
    ptio.verify(dst)


def big(n: int, k: int) -> np.ndarray:
    """A float32 array with different values per ``k`` (cheap to make again)."""
    return np.arange(n, dtype=np.float32) + np.float32(k)


# --------------------------------------------------------------------------
# byte identity
# --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["seed", "later"])
def test_datacode_to_safetensors(tmp_path: Path, variant: str) -> None:
    rng = np.random.default_rng(0)
    params = {
        "layer0": {
            "weight": rng.normal(size=(300, 200)).astype(np.float32),
            "bias": rng.normal(size=200).astype(np.float32),
        },
        "layer2": {
            "weight": rng.normal(size=(200, 100)).astype(np.float32),
            "bias": rng.normal(size=100).astype(np.float32),
        },
    }
    src = tmp_path / "m.nn"
    meta = {"layers": ["Linear", "ReLU", "Linear"]}
    ptio.save(src, params, format="datacode", meta=meta, variant=variant)
    check_identical(src, tmp_path / "m.safetensors", "datacode", "safetensors")
    back = ptio.load(tmp_path / "m.safetensors")
    assert back["layer0"]["weight"].tobytes() == params["layer0"]["weight"].tobytes()
    # and onward: the safetensors file carries DataCode's tree; back to DataCode in memory
    ptio.convert(tmp_path / "m.safetensors", tmp_path / "back.nn", to="datacode")
    assert (tmp_path / "back.nn").read_bytes() == src.read_bytes()


def test_bullet_to_safetensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w = {
        "l0w": rng.normal(size=(256, 128)).astype(np.float32),
        "l0b": rng.normal(size=128).astype(np.float32),
        "l1w": rng.normal(size=(128, 1)).astype(np.float32),
        "l1b": rng.normal(size=1).astype(np.float32),
    }
    tree = {"weights": w, "momentum": {k: v * 2 for k, v in w.items()}}
    tree["velocity"] = {k: v * 3 for k, v in w.items()}
    src = tmp_path / "ckpt"
    ptio.save(src, tree, format="bullet", meta={"steps": {k: 4 for k in w}, "log": "1,1,0.5\n"})
    check_identical(src, tmp_path / "b.safetensors", "bullet", "safetensors")


def test_waffe2_conformance_to_safetensors(
    conformance: Path, tmp_path: Path, every_slot_streams: Any
) -> None:
    for d in sorted((conformance / "waffe2").iterdir()):
        if d.is_dir():
            check_identical(d, tmp_path / f"{d.stem}.safetensors", "waffe2", "safetensors")


def test_without_checksums_and_safetensors_onward(tmp_path: Path) -> None:
    src = tmp_path / "m.nn"
    params = {"layer0": {"weight": big(256 * 128, 0).reshape(256, 128), "bias": big(128, 1)}}
    ptio.save(src, params, format="datacode")
    check_identical(src, tmp_path / "a.safetensors", "datacode", "safetensors", checksum=False)
    assert "pytreeio.xxh3_64" not in ptio.inspect(tmp_path / "a.safetensors").meta
    if (
        ptio.list_formats()["safetensors"].slots is not None
    ):  # safetensors -> safetensors streams too
        check_identical(
            tmp_path / "a.safetensors", tmp_path / "b.safetensors", "safetensors", "safetensors"
        )


@pytest.mark.parametrize("fmt", ["msgpack", "safetensors", "netcl-params", "netcl-checkpoint"])
def test_generic_and_netcl_to_safetensors(
    tmp_path: Path, fmt: str, every_slot_streams: Any
) -> None:
    rng = np.random.default_rng(2)
    params = {
        "Dense_0": {
            "kernel": rng.normal(size=(30, 20)).astype(np.float32),
            "bias": rng.normal(size=20).astype(np.float32),
        },
        "Dense_1": {"kernel": rng.normal(size=(20, 5)).astype(np.float32)},
    }
    tree: Any = params
    if fmt in ("msgpack", "safetensors"):  # any pytree: scalars, strings, lists, float16
        tree = {"params": params, "step": 3, "name": "x", "xs": [np.arange(5), None, 1.5]}
        tree["half"] = np.ones(7, np.float16)
    src = tmp_path / f"src.{fmt}"
    ptio.save(src, tree, format=fmt)
    check_identical(src, tmp_path / "out.safetensors", fmt, "safetensors")


def test_tinyllama_conformance_to_safetensors(
    conformance: Path, tmp_path: Path, every_slot_streams: Any
) -> None:
    for src in sorted((conformance / "tinyllama").iterdir()):
        check_identical(src, tmp_path / "t.safetensors", "tinyllama", "safetensors")


def test_tinyllama_into_msgpack_and_back(
    conformance: Path, tmp_path: Path, every_slot_streams: Any
) -> None:
    for src in sorted((conformance / "tinyllama").iterdir()):
        flax = tmp_path / "t.msgpack"
        with pytest.warns(ptio.PytreeioWarning, match="config"):  # msgpack has no place for it
            check_identical(src, flax, "tinyllama", "msgpack", lossy=True)
        config = ptio.inspect(src).meta
        back = tmp_path / "back.bin"
        check_identical(flax, back, "msgpack", "tinyllama", meta=config)
        assert back.read_bytes() == src.read_bytes()  # the original system's bytes again
        via = tmp_path / "t.safetensors"
        ptio.convert(src, via, to="safetensors")
        check_identical(via, back, "safetensors", "tinyllama")  # the config rides in its meta
        assert back.read_bytes() == src.read_bytes()


def test_streamed_cast_into_tinyllama(tmp_path: Path, every_slot_streams: Any) -> None:
    d, f, v, s = 8, 16, 12, 4
    rng = np.random.default_rng(3)

    def m(*shape: int) -> np.ndarray:
        return rng.normal(size=shape).astype(np.float16)

    layer = {"wq": m(d, d), "wk": m(d, d), "wv": m(d, d), "wo": m(d, d), "w1": m(d, f)}
    layer |= {"b1": m(f), "w2": m(f, d), "b2": m(d)}
    layer |= {"ln1": {"scale": m(d), "bias": m(d)}, "ln2": {"scale": m(d), "bias": m(d)}}
    tree = {
        "tok_embedding": m(v, d),
        "pos_embedding": m(s, d),
        "layers": [layer],
        "output": m(d, v),
    }
    src = tmp_path / "half.safetensors"
    ptio.save(src, tree)
    config = {"config": {"n_heads": 2, "dropout": 0.0}}
    dst = tmp_path / "w.bin"
    with pytest.raises(ptio.ConversionError, match="cast=True"):
        ptio.convert(src, dst, to="tinyllama", meta=config)
    assert not dst.exists()
    check_identical(src, dst, "safetensors", "tinyllama", meta=config, cast=True)
    got = ptio.load(dst, format="tinyllama")
    assert np.array_equal(got["layers"][0]["w2"], layer["w2"].astype(np.float32))


def test_generic_trees_into_msgpack(
    tmp_path: Path, every_slot_streams: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(4)
    tree = {
        "params": {"w": rng.normal(size=(40, 30)).astype(np.float32), "b": np.arange(30)},
        "step": 3,
        "xs": [np.ones(7, np.float16), None, 1.5, "s"],
        "flags": np.array([True, False]),
    }
    st, mp = tmp_path / "a.safetensors", tmp_path / "a.msgpack"
    ptio.save(st, tree, checksum=False)
    check_identical(st, mp, "safetensors", "msgpack")
    # flax's chunked layout: pieces of one array share a single read of it
    chunked = tmp_path / "chunked.msgpack"
    reads = count_reads(monkeypatch)
    check_identical(mp, chunked, "msgpack", "msgpack", chunk_bytes=1000)
    assert max(reads.values()) == 1, reads  # once per array, never once per piece
    assert (tmp_path / "chunked.msgpack").stat().st_size > mp.stat().st_size
    check_identical(chunked, tmp_path / "again.msgpack", "msgpack", "msgpack")
    assert (tmp_path / "again.msgpack").read_bytes() == mp.read_bytes()


def count_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Reads of each streamed array (by slot key), from now on."""
    counts: dict[str, int] = {}
    original = Streamed.read

    def read(self: Streamed) -> Any:
        counts[self.slot.key] = counts.get(self.slot.key, 0) + 1
        return original(self)

    monkeypatch.setattr(Streamed, "read", read)
    return counts


def test_model_form_conversions_stream(tmp_path: Path) -> None:
    src = tmp_path / "m.nn"
    params = {"layer0": {"weight": big(256 * 128, 0).reshape(256, 128), "bias": big(128, 1)}}
    ptio.save(src, params, format="datacode")
    assert streams(src, "datacode", "waffe2")  # through the model form, transposed when read
    assert streams(src, "datacode", "datacode")
    dst = tmp_path / "m.wf2model"
    ptio.convert(src, dst, to="waffe2", hyperparams={"learning_rate": 0.1})
    want = ptio.convert_encoded(
        src.read_bytes(),
        from_="datacode",
        to="waffe2",
        dest=dst,
        hyperparams={"learning_rate": 0.1},
    )
    assert files_of(dst) == {k: v.tobytes() for k, v in want.files.items()}


def test_deferred_chunks_written_in_place(tmp_path: Path) -> None:
    produced: list[str] = []

    def make(tag: str, data: bytes) -> Deferred:
        def produce() -> bytes:
            produced.append(tag)
            return data

        return Deferred(len(data), produce, late=tag == "head")

    enc = ptio.Encoded(chunks=(make("head", b"HEAD"), b"--", make("a", b"aaa"), make("b", b"")))
    io.write_file_atomic(tmp_path / "f", enc)
    assert (tmp_path / "f").read_bytes() == b"HEAD--aaa"
    assert produced == ["a", "b", "head"]  # the late header after the data
    assert enc.nbytes == 9 and enc.tobytes() == b"HEAD--aaa"
    bad = ptio.Encoded(chunks=(Deferred(5, lambda: b"abc"),))
    with pytest.raises(ptio.EncodeError):
        io.write_file_atomic(tmp_path / "g", bad)
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize(
    "to", ["safetensors", "netcl", "netcl-params", "datacode", "waffe2", "bullet"]
)
def test_a_source_changed_underneath_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str
) -> None:
    """A tensor that cannot be read when its turn comes fails the save; nothing is left behind."""
    src = tmp_path / "m.nn"
    params = {"layer0": {"weight": big(256 * 128, 0).reshape(256, 128), "bias": big(128, 1)}}
    ptio.save(src, params, format="datacode")
    target = ptio.list_formats()[to]
    native, meta, source = conversion.open_streamed(
        src, ptio.list_formats()["datacode"], target, {}
    ) or (None, None, None)
    assert source is not None
    out = tmp_path / "out"
    try:
        enc = conversion.convert_decoded(
            ptio.list_formats()["datacode"], target, native, meta, options={}, dest=str(out)
        )
        with open(src, "r+b") as f:  # a tensor's bytes shorter than its slot now
            f.truncate(200)
        source.size = 200  # the source checks ranges against the size it knows
        with pytest.raises(ptio.FormatError):
            io.write_atomic(out, enc, target.layout)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == ["m.nn"]  # no output, no temporary file or directory
    finally:
        source.close()


# --------------------------------------------------------------------------
# bounded memory
# --------------------------------------------------------------------------

#: 16 weights of 64 MiB: a 1 GiB checkpoint; peak RSS growth must stay far below it.
N_TENSORS = 16
ROWS, COLS = 4096, 4096
LIMIT_MB = 320

CHILD = textwrap.dedent(
    """
    import json, sys
    import pytreeio as ptio

    ptio.list_formats()  # every format module imported before the baseline

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024  # kB -> MiB
        raise KeyError(key)

    base = status("VmRSS")
    to, options = sys.argv[3], json.loads(sys.argv[4])
    ptio.convert(sys.argv[1], sys.argv[2], to=to, durable=False, **options)
    print(json.dumps({"base_mb": base, "peak_mb": status("VmHWM")}))
    """
)


#: Weights written with values; the others are left as holes of a sparse file (zeros that
#: cost no disk time to make, but are read and written like any other bytes).
FILLED = (0, N_TENSORS - 1)


def expected(k: int) -> np.ndarray:
    return big(ROWS * COLS, k) if k in FILLED else np.zeros(ROWS * COLS, np.float32)


def write_big_bullet(root: Path) -> None:
    """optimiser_state/weights.bin of N_TENSORS (ROWS, COLS) weights plus biases."""
    (root / "optimiser_state").mkdir(parents=True)
    with open(root / "optimiser_state" / "weights.bin", "wb") as f:
        for k in range(N_TENSORS):
            f.write(f"l{k}b\n".encode() + struct.pack("<Q", COLS) + big(COLS, k).tobytes())
            f.write(f"l{k}w\n".encode() + struct.pack("<Q", ROWS * COLS))
            if k in FILLED:
                f.write(expected(k).tobytes())
            else:
                f.seek(4 * ROWS * COLS, 1)
        f.truncate()


def scratch_dir() -> str | None:
    """A memory file system when one has room (file pages there are not the process's RSS)."""
    import os
    import shutil

    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 3 << 30:
        return shm
    return None


def convert_in_child(src: Path, dst: Path, to: str, **options: Any) -> int:
    """Peak RSS growth (MiB) of a fresh process converting ``src`` to ``dst``."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(dst), to, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    mem = json.loads(out.stdout.strip().splitlines()[-1])
    return int(mem["peak_mb"] - mem["base_mb"])


def test_large_checkpoint_streams_in_bounded_memory() -> None:
    with tempfile.TemporaryDirectory(dir=scratch_dir()) as tmp:
        src, dst = Path(tmp) / "ckpt", Path(tmp) / "out.safetensors"
        write_big_bullet(src)
        size = (src / "optimiser_state" / "weights.bin").stat().st_size
        assert size > 1 << 30
        growth = convert_in_child(src, dst, "safetensors")
        assert growth < LIMIT_MB, growth  # the whole checkpoint would be 1024 MiB
        print(f"peak RSS growth {growth} MiB converting {size >> 20} MiB")
        # the output: every tensor where its header says, with its checksum
        assert len(ptio.inspect(dst).entries) == 2 * N_TENSORS
        with io.FileSource(dst) as f:
            (n,) = struct.unpack("<Q", bytes(f.read(0, 8, "n")))
            header = json.loads(bytes(f.read(8, n, "header")))
            sums = json.loads(header["__metadata__"]["pytreeio.xxh3_64"])
            assert len(sums) == 2 * N_TENSORS
            for k in (0, 1, N_TENSORS - 1):
                name = f"weights/l{k}w"
                begin, end = header[name]["data_offsets"]
                assert header[name]["shape"] == [ROWS, COLS]
                want = expected(k)
                assert sums[name] == array_checksum(want)
                got = np.frombuffer(f.read(8 + n + begin, end - begin, name), np.float32)
                assert np.array_equal(got, want)


def test_large_checkpoint_streams_into_an_npz_in_bounded_memory() -> None:
    """A model format's encoder streams too: zip members written as read, headers last."""
    import zipfile

    with tempfile.TemporaryDirectory(dir=scratch_dir()) as tmp:
        src, dst = Path(tmp) / "ckpt", Path(tmp) / "params.npz"
        write_big_bullet(src)
        growth = convert_in_child(src, dst, "netcl-params")
        assert growth < LIMIT_MB, growth  # the whole checkpoint would be 1024 MiB
        print(f"peak RSS growth {growth} MiB converting into netcl-params")
        with zipfile.ZipFile(dst) as z:  # Python's zip reader checks each member's CRC-32
            names = z.namelist()
            assert names == [f"p{i}.npy" for i in range(2 * N_TENSORS)]
            for k in (0, 1, N_TENSORS - 1):  # layer k: weight p{2k}, bias p{2k+1}
                with z.open(f"p{2 * k}.npy") as member:
                    weight = np.lib.format.read_array(member)
                assert weight.shape == (ROWS, COLS)
                assert np.array_equal(weight.reshape(-1), expected(k))
                with z.open(f"p{2 * k + 1}.npy") as member:
                    assert np.array_equal(np.lib.format.read_array(member), big(COLS, k))


#: A Tiny Llama of ~490 MiB in 16 MiB matrices: d_model 1024, ffn 4096, 10 layers.
LLAMA = {
    "d_model": 1024,
    "n_layers": 10,
    "n_heads": 8,
    "ffn_hidden_dim": 4096,
    "max_seq_len": 16,
    "vocab_size": 1024,
    "dropout": 0.0,
}
LLAMA_LIMIT_MB = 160


def write_big_tinyllama(path: Path) -> dict[str, np.ndarray]:
    """A sparse Tiny Llama file: the first and last matrices filled, the rest holes (zeros).

    Returns the filled matrices by key path.
    """
    from pytreeio.formats import tinyllama

    records = list(tinyllama._records(LLAMA))
    filled = {0: records[0], len(records) - 1: records[-1]}
    with open(path, "wb") as f:
        f.write(struct.pack("<II6i", tinyllama.MAGIC, tinyllama.VERSION, *list(LLAMA.values())[:6]))
        f.write(struct.pack("<f", LLAMA["dropout"]))
        for k, rec in enumerate(records):
            f.seek(rec.offset)
            f.write(struct.pack(f"<{len(rec.dims)}Q", *rec.dims))
            if k in filled:
                f.write(big(rec.nbytes // 4, k).tobytes())
        f.truncate(records[-1].end)
    return {
        "/".join(map(str, rec.path)): big(rec.nbytes // 4, k).reshape(rec.dims)
        for k, rec in filled.items()
    }


def files_equal(a: Path, b: Path, block: int = 16 << 20) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


def test_large_tinyllama_streams_into_msgpack_and_back_in_bounded_memory() -> None:
    with tempfile.TemporaryDirectory(dir=scratch_dir()) as tmp:
        src, flax, back = Path(tmp) / "w.bin", Path(tmp) / "w.msgpack", Path(tmp) / "back.bin"
        filled = write_big_tinyllama(src)
        size = src.stat().st_size
        assert size > 480 << 20
        grew = convert_in_child(src, flax, "msgpack", lossy=True)
        assert grew < LLAMA_LIMIT_MB, grew  # the whole checkpoint would be 490 MiB
        with ptio.open(flax) as view:  # the filled matrices where msgpack put them
            for key, want in filled.items():
                assert np.array_equal(view[key], want)
            assert not view["layers/3/w1"].any()
        grew_back = convert_in_child(flax, back, "tinyllama", meta={"config": LLAMA})
        assert grew_back < LLAMA_LIMIT_MB, grew_back
        print(f"peak RSS growth {grew} and {grew_back} MiB converting {size >> 20} MiB both ways")
        assert files_equal(src, back)
