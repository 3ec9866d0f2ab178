"""Slots of DataCode, bullet and cl-waffe2 checkpoints: where each array lies, read lazily.

Every slot read gives decode's array bit for bit (on files pytreeio writes and
on the conformance files), reading one tensor reads only its bytes, and
hostile bytes make ``slots`` and ``Slot.read`` raise only pytreeio errors --
exactly when ``decode`` raises.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import io
from pytreeio.core.binary import BufferSource, ByteSource, Slot, Slots
from pytreeio.core.errors import PytreeioError
from pytreeio.formats.bullet import checkpoint as B
from pytreeio.formats.datacode import nn as D
from pytreeio.formats.waffe2 import state_dict as W

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def file_sources(path: Path) -> Any:
    """FileSources of a checkpoint (one for a file, relative path -> one for a directory)."""
    if path.is_dir():
        return {name: io.FileSource(path / name) for name in io.walk(path)}
    return io.FileSource(path)


def buffer_sources(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: BufferSource(v, name=k) for k, v in data.items()}
    return BufferSource(data)


def all_sources(source: Any) -> list[ByteSource]:
    return list(source.values()) if isinstance(source, Mapping) else [source]


def bytes_read(source: Any) -> int:
    return sum(s.bytes_read for s in all_sources(source))


def reset(source: Any) -> None:
    for s in all_sources(source):
        s.bytes_read = 0


def slot_list(tree: Any) -> list[Slot]:
    if isinstance(tree, Slot):
        return [tree]
    if isinstance(tree, Mapping):
        return [s for v in tree.values() for s in slot_list(v)]
    return []


def fill(tree: Any, source: Any) -> Any:
    """The tree with every slot read."""
    if isinstance(tree, Slot):
        return tree.read(source)
    if isinstance(tree, Mapping):
        return {k: fill(v, source) for k, v in tree.items()}
    return tree


def assert_same(decoded: Any, filled: Any, where: str = "") -> None:
    """Same structure, scalars and arrays (shape, dtype up to byte order, bits)."""
    if isinstance(decoded, Mapping):
        assert isinstance(filled, dict), where
        assert list(decoded) == list(filled), where
        for k in decoded:
            assert_same(decoded[k], filled[k], f"{where}/{k}")
        return
    if isinstance(decoded, np.ndarray):
        assert isinstance(filled, np.ndarray), where
        want = decoded.astype(decoded.dtype.newbyteorder("="))
        assert filled.dtype == want.dtype and filled.shape == want.shape, where
        assert filled.flags.c_contiguous and filled.flags.writeable, where
        assert np.ascontiguousarray(want).tobytes() == filled.tobytes(), where
        return
    assert type(decoded) is type(filled) and decoded == filled, where


def check_path(path: Path, slots_fn: Callable[..., Slots], **options: Any) -> None:
    """Slots of a file on disk against ``ptio.load_with_meta``; one tensor reads only its bytes."""
    native, meta = ptio.load_with_meta(path, **options)
    source = file_sources(path)
    try:
        found = slots_fn(source, **options)
        assert found.meta == meta
        header_bytes = bytes_read(source)
        total = sum(s.size for s in all_sources(source))
        slots = slot_list(found.tree)
        assert slots
        data = sum({(s.role, s.offset): s.nbytes for s in slots}.values())
        assert header_bytes <= total - data + 128 * len(slots)  # headers, hardly any data
        assert_same(native, fill(found.tree, source))
        for slot in slots:
            reset(source)
            slot.read(source)
            touched = [s for s in all_sources(source) if s.bytes_read]
            assert bytes_read(source) == slot.nbytes, slot.key
            if slot.nbytes:
                assert touched == [slot.source_of(source)], slot.key
    finally:
        for s in all_sources(source):
            s.close()


def agree(decode: Callable[[Any], Any], slots_fn: Callable[[Any], Slots], data: Any) -> None:
    """On hostile bytes: slots (and reading them) fail exactly when decode does, with pytreeio errors."""
    try:
        native, meta = decode(data)
    except PytreeioError:
        native = None
    try:
        source = buffer_sources(data)
        found = slots_fn(source)
        filled = fill(found.tree, source)
    except PytreeioError:
        assert native is None, "slots failed where decode succeeded"
        return
    assert native is not None, "slots succeeded where decode failed"
    assert found.meta == meta
    assert_same(native, filled)


# --------------------------------------------------------------------------
# DataCode
# --------------------------------------------------------------------------

DC_LAYERS = ["Linear", "ReLU", "Linear", "Linear"]


def dc_params(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    sizes = {0: (5, 4), 2: (4, 3), 3: (3, 2)}
    return {
        f"layer{p}": {
            "weight": rng.normal(size=(i, o)).astype(np.float32),
            "bias": rng.normal(size=o).astype(np.float32),
        }
        for p, (i, o) in sizes.items()
    }


@pytest.fixture(params=["seed", "later", "bias_2d"])
def dc_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / "m.nn"
    params = dc_params()
    variant = "later" if request.param == "later" else "seed"
    if request.param == "bias_2d":
        params["layer2"]["bias"] = params["layer2"]["bias"].reshape(1, -1)
    ptio.save(path, params, format="datacode", meta={"layers": DC_LAYERS}, variant=variant)
    return path


def test_datacode_written(dc_file: Path) -> None:
    check_path(dc_file, D.slots)
    later = D.slots(io.FileSource(dc_file)).meta[D.FILE_KEY]["variant"] == "later"
    weight = D.slots(io.FileSource(dc_file)).tree["layer0"]["weight"]
    assert weight.shape == (5, 4) and weight.fortran == later


@pytest.mark.parametrize("name", ["model_mnist.nn", "model_mnist_sh.nn"])
def test_datacode_conformance(conformance: Path, name: str) -> None:
    check_path(conformance / "datacode" / name, D.slots)


def test_datacode_variant_option(tmp_path: Path) -> None:
    path = tmp_path / "sq.nn"
    params = {"layer0": {"weight": np.eye(3, dtype=np.float32), "bias": np.zeros(3, np.float32)}}
    ptio.save(path, params, format="datacode", variant="later")
    check_path(path, D.slots, variant="later")
    assert D.slots(io.FileSource(path), variant="later").tree["layer0"]["weight"].fortran


def dc_bytes() -> bytes:
    return ptio.encode(dc_params(), format="datacode", meta={"layers": DC_LAYERS}).tobytes()


def test_datacode_hostile() -> None:
    good = dc_bytes()
    for n in range(0, len(good), 3):  # truncations
        agree(D.decode, D.slots, good[:n])
    rng = random.Random(0)
    for _ in range(300):  # flips
        bad = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        agree(D.decode, D.slots, bytes(bad))
    json_len = struct.unpack_from("<I", good, 12)[0]
    count_at = 16 + json_len
    for at, value in [(12, 2**32 - 1), (count_at, 2**32 - 1), (count_at + 4, 2**31)]:
        bad = bytearray(good)  # lying lengths and counts
        struct.pack_into("<I", bad, at, value)
        with pytest.raises(PytreeioError):
            D.slots(BufferSource(bytes(bad)))


# --------------------------------------------------------------------------
# bullet
# --------------------------------------------------------------------------


def bullet_net(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for k, (n_in, n_out) in enumerate([(6, 4), (4, 1)]):
        out[f"l{k}w"] = rng.uniform(-0.9, 0.9, (n_in, n_out)).astype(np.float32)
        out[f"l{k}b"] = rng.uniform(-0.9, 0.9, n_out).astype(np.float32)
    return out


def bullet_tree(seed: int = 0) -> dict[str, Any]:
    w = bullet_net(seed)
    rng = np.random.default_rng(seed + 1)
    state = {
        part: {k: rng.normal(size=v.shape).astype(np.float32) for k, v in w.items()}
        for part in ("momentum", "velocity")
    }
    return {"weights": w, **state, "slow": dict(w)}


LAYOUT = B.classic_layout([255, 64])


def bullet_files(with_layout: bool = True) -> dict[str, bytes]:
    tree = bullet_tree()
    meta: dict[str, Any] = {"steps": {k: 3 for k in tree["weights"]}, "log": "1,1,0.5\n"}
    if with_layout:
        meta["saved_format"] = LAYOUT
    return {k: v.tobytes() for k, v in ptio.encode(tree, format="bullet", meta=meta).files.items()}


def write_dir(root: Path, files: Mapping[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.mark.parametrize(
    "options",
    [{}, {"saved_format": LAYOUT}, {"saved_format": LAYOUT, "check_quantised": True}],
    ids=["plain", "layout", "check"],
)
def test_bullet_written(tmp_path: Path, options: dict[str, Any]) -> None:
    root = write_dir(tmp_path / "ckpt", bullet_files())
    if options.get("check_quantised"):  # reads raw.bin and quantised.bin whole: compare only
        native, meta = ptio.load_with_meta(root, **options)
        source = file_sources(root)
        found = B.slots(source, **options)
        assert found.meta == meta and "quantisation_error" in meta
        assert_same(native, fill(found.tree, source))
        return
    check_path(root, B.slots, **options)
    weight = B.slots(file_sources(root)).tree["weights"]["l0w"]
    assert weight.shape == (6, 4) and weight.role == B.WEIGHTS


def test_bullet_raw_only_and_old_records(tmp_path: Path) -> None:
    files = bullet_files()
    w = bullet_tree()["weights"]
    raw_only = {k: v for k, v in files.items() if k in (B.RAW, B.QUANTISED)}
    root = write_dir(tmp_path / "raw", raw_only)
    shapes = {k: v.shape for k, v in w.items()}
    check_path(root, B.slots, saved_format=LAYOUT, shapes=shapes)
    assert (
        B.slots(file_sources(root), saved_format=LAYOUT, shapes=shapes).tree["weights"]["l1b"].role
        == B.RAW
    )
    old = b"".join(
        rid.encode() + b"\n" + struct.pack("<QQ", v.shape[-1], v.size // v.shape[-1]) + v.tobytes()
        for rid, v in w.items()
    )
    root = write_dir(tmp_path / "old", {B.WEIGHTS: old})
    check_path(root, B.slots)


@pytest.mark.filterwarnings("ignore:quantised.bin is empty")  # asserted in test_bullet.py
def test_bullet_hostile() -> None:
    good = bullet_files()
    rng = random.Random(1)

    def dec(data: Any) -> Any:
        return B.decode(data, saved_format=LAYOUT)

    def slo(source: Any) -> Slots:
        return B.slots(source, saved_format=LAYOUT)

    for file in sorted(good):
        for n in range(0, len(good[file]), max(1, len(good[file]) // 60)):
            agree(dec, slo, {**good, file: good[file][:n]})
        for _ in range(40):
            bad = bytearray(good[file])
            if not bad:
                continue
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
            agree(dec, slo, {**good, file: bytes(bad)})
    for count in (2**64 - 1, 2**40, 10**9):  # lying counts
        body = b"l0w\n" + struct.pack("<Q", count) + bytes(16)
        with pytest.raises(PytreeioError):
            B.slots({B.WEIGHTS: BufferSource(body)})


# --------------------------------------------------------------------------
# cl-waffe2
# --------------------------------------------------------------------------

WAFFE2 = [
    "tiny_adam1_opt",
    "tiny_adam3_noopt",
    "tiny_adam3_opt",
    "mid_nobias_sgd2_opt",
]


def waffe2_dirs(conformance: Path) -> list[Path]:
    return sorted(p for p in (conformance / "waffe2").iterdir() if p.is_dir())


def test_waffe2_conformance(conformance: Path) -> None:
    dirs = waffe2_dirs(conformance)
    assert {d.stem for d in dirs} >= set(WAFFE2)
    for d in dirs:
        check_path(d, W.slots)


def test_waffe2_written_with_sidecar(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    params = {
        "Dense_0": {
            "kernel": rng.normal(size=(4, 3)).astype(np.float32),
            "bias": rng.normal(size=3).astype(np.float32),
        },
        "Dense_1": {"kernel": rng.normal(size=(3, 2)).astype(np.float32)},
    }
    root = tmp_path / "m.wf2model"
    ptio.save(root, params, format="waffe2")
    assert (root / W.SIDECAR).exists()
    check_path(root, W.slots)
    shapes = {s.key: s.shape for s in slot_list(W.slots(file_sources(root)).tree)}
    assert any(len(shape) == 2 for shape in shapes.values())


def test_waffe2_big_endian_and_shared_file(conformance: Path, tmp_path: Path) -> None:
    src = conformance / "waffe2" / "tiny_adam3_noopt.wf2model"
    files = {name: (src / name).read_bytes() for name in io.walk(src)}
    name = next(n for n in files if n.endswith(".npy"))
    arr = np.load(src / name)
    import io as _io

    buf = _io.BytesIO()
    np.save(buf, arr.astype(arr.dtype.newbyteorder(">")))
    files[name] = buf.getvalue()
    root = write_dir(tmp_path / "be.wf2model", files)
    check_path(root, W.slots)


def waffe2_files(conformance: Path) -> dict[str, bytes]:
    src = conformance / "waffe2" / "tiny_adam1_opt.wf2model"
    return {name: (src / name).read_bytes() for name in io.walk(src)}


def test_waffe2_hostile(conformance: Path) -> None:
    good = waffe2_files(conformance)
    rng = random.Random(2)
    for file in sorted(good):
        data = good[file]
        for n in range(0, len(data), max(1, len(data) // 40)):
            agree(W.decode, W.slots, {**good, file: data[:n]})
        for _ in range(25):
            bad = bytearray(data)
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
            agree(W.decode, W.slots, {**good, file: bytes(bad)})
    npy_name = next(n for n in good if n.endswith(".npy"))
    lying = bytearray(good[npy_name])  # a shape far beyond the file
    text = bytes(lying[10:]).split(b"\n")[0]
    big = text.replace(b"'shape': (", b"'shape': (99999999999, ", 1)[: len(text)]
    lying[10 : 10 + len(big)] = big
    with pytest.raises(PytreeioError):
        W.slots(buffer_sources({**good, npy_name: bytes(lying)}))
