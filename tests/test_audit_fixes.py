"""Audit findings: a string among JSON moments, files shrinking under a lazy view, symlink
loops, and DataCode's seed-variant bias shape."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.core.binary import BufferSource
from pytreeio.core.errors import FormatError, PytreeioError
from pytreeio.formats.datacode import nn as dc

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------
# 1. netcl-checkpoint: a long string among the moments
# --------------------------------------------------------------------------

_N = 20_000  # moments per slot; with a 200 KB string numpy's '<U' array would be ~16 GB

# Loads the crafted pair under an address-space limit (2 GiB above what the warmed-up process
# maps), then reports what it raised and how far its peak RSS grew.
_CHILD = r"""
import json, resource, sys
import pytreeio as ptio
from pytreeio.core.binary import BufferSource
from pytreeio.core.errors import FormatError

good, bad = sys.argv[1:3]
ptio.load(good, format="netcl-checkpoint")  # every module a load imports, imported now
with ptio.open(good, format="netcl-checkpoint") as ck:
    ck.load()


def mapped() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


_, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (mapped() + (2 << 30), hard))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = {}
for how in ("load", "open"):
    try:
        if how == "load":
            ptio.load(bad, format="netcl-checkpoint")
        else:
            with ptio.open(bad, format="netcl-checkpoint") as ck:
                ck.load()
        out[how] = ["no error"]
    except FormatError as exc:
        out[how] = ["FormatError", exc.path, exc.field, str(exc)]
    except BaseException as exc:
        out[how] = [type(exc).__name__, str(exc)[:200]]
out["grown"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_string_among_the_moments_is_refused_before_any_array_is_built(tmp_path: Path) -> None:
    tree = {
        "params": [np.zeros(_N, np.float32)],
        "optim_state": {"t": 1, "moments": [[np.zeros(_N), np.zeros(_N)]]},
    }
    good = tmp_path / "good"
    bad = tmp_path / "bad"
    for p in (good, bad):
        ptio.save(p, tree, format="netcl-checkpoint")
    js = tmp_path / "bad.json"
    doc = json.loads(js.read_text())
    doc["optim_state"]["moments"][0][1][5] = "x" * 200_000
    js.write_text(json.dumps(doc))
    size = js.stat().st_size
    assert size < 500_000
    env = dict(os.environ, PYTHONPATH=str(REPO), MALLOC_ARENA_MAX="2")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(good), str(bad)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for how in ("load", "open"):
        assert out[how][0] == "FormatError", out[how]
        _, path, field, text = out[how]
        assert path == str(js) and str(js) in text
        assert field == "optim_state.moments.v[0]"
        assert "str" in text
    assert out["grown"] <= size + (64 << 20)


@pytest.mark.parametrize(
    "value, why",
    [
        ([1.0, 2.0, "3"], "expected numbers, found str"),
        ([1.0, True, 2.0], "expected numbers, found bool"),
        ([[1.0, 2.0], 3.0], "lists and numbers mixed"),
        ([[1.0, 2.0], [3.0]], "not a rectangular"),
        ([np.zeros(2), np.zeros(3)], "not a rectangular"),
        ([np.array(["a", "b"]), np.zeros(2)], "expected numbers"),
        ([1.0, None, 2.0], "expected numbers, found None"),
    ],
)
def test_moment_values_are_checked_before_an_array_is_built(value: Any, why: str) -> None:
    from pytreeio.model.optim import nested_to_array

    n = len(value)
    shape = (n,) if not isinstance(value[0], list | np.ndarray) else (n, 2)
    with pytest.raises(FormatError, match=why) as info:
        nested_to_array(value, shape, "optim_state.moments.m[0]")
    assert info.value.field == "optim_state.moments.m[0]"


def test_moments_as_rows_and_lists_still_read() -> None:
    from pytreeio.model.optim import nested_to_array

    rows = [np.arange(3.0), np.arange(3.0, 6.0)]
    assert nested_to_array(rows, (2, 3), "m").tolist() == [[0, 1, 2], [3, 4, 5]]
    assert nested_to_array([[1, 2.5]], (1, 2), "m").dtype == np.float64
    assert nested_to_array([], (0,), "m").shape == (0,)
    assert nested_to_array(1.5, (), "m").tolist() == 1.5


# --------------------------------------------------------------------------
# 2. a file shortened under a lazy view
# --------------------------------------------------------------------------

_BIG = {"a": np.arange(3000, dtype=np.float32), "b": np.arange(6000, dtype=np.float32)}


def _saved(tmp_path: Path, fmt: str) -> tuple[Path, Path, str]:
    """(path to open, the file that holds the arrays, the key of the last array)."""
    if fmt == "safetensors":
        p = tmp_path / "m.safetensors"
        ptio.save(p, _BIG, format=fmt)
        return p, p, "b"
    if fmt == "netcl-params":
        p = tmp_path / "p.npz"
        ptio.save(p, _BIG, format=fmt)
        return p, p, "b"
    p = tmp_path / "ck"
    ptio.save(p, {"params": [_BIG["a"], _BIG["b"]]}, format="netcl-checkpoint")
    return p, tmp_path / "ck.npz", "params/p1"


@pytest.mark.parametrize("fmt", ["safetensors", "netcl-params", "netcl-checkpoint"])
@pytest.mark.parametrize("how", ["getitem", "load"])
def test_a_file_shortened_under_a_lazy_view_is_a_format_error(
    tmp_path: Path, fmt: str, how: str
) -> None:
    path, data, key = _saved(tmp_path, fmt)
    with ptio.open(path, format=fmt) as ck:
        assert key in ck
        os.truncate(data, data.stat().st_size // 2)  # another program, after the open
        with pytest.raises(PytreeioError) as info:
            if how == "getitem":
                ck[key]
            else:
                ck.load()
    err = info.value
    assert isinstance(err, FormatError)
    assert err.path == str(data) and str(data) in str(err)
    assert "truncated" in err.reason
    # the tensor being read, not a generic 'data'
    name = key.rsplit("/", 1)[-1]
    assert err.field == (name if fmt == "safetensors" else f"zip.member[{name}.npy]")


# --------------------------------------------------------------------------
# 3. symlink loops
# --------------------------------------------------------------------------


def _loop(tmp_path: Path, kind: str) -> Path:
    if kind == "self":
        os.symlink("x.safetensors", tmp_path / "x.safetensors")
        return tmp_path / "x.safetensors"
    if kind == "pair":
        os.symlink("b.safetensors", tmp_path / "a.safetensors")
        os.symlink("a.safetensors", tmp_path / "b.safetensors")
        return tmp_path / "a.safetensors"
    if kind == "siblings":
        os.symlink("ck.npz", tmp_path / "ck.npz")
        os.symlink("ck.json", tmp_path / "ck.json")
        return tmp_path / "ck"
    os.symlink("w.wf2model", tmp_path / "w.wf2model")  # a directory format's path
    return tmp_path / "w.wf2model"


_LOOPS = [
    ("self", "safetensors"),
    ("pair", "safetensors"),
    ("pair", "msgpack"),
    ("self", None),
    ("siblings", "netcl-checkpoint"),
    ("siblings", "netcl-params"),
    ("siblings", "netcl"),
    ("siblings", None),
    ("dir", "waffe2"),
    ("dir", "bullet"),
    ("dir", None),
]


@pytest.mark.parametrize("kind, fmt", _LOOPS)
@pytest.mark.parametrize("call", ["load", "inspect", "open", "verify"])
def test_a_symlink_loop_is_not_found_naming_the_path(
    tmp_path: Path, kind: str, fmt: str | None, call: str
) -> None:
    path = _loop(tmp_path, kind)
    kw = {} if fmt is None else {"format": fmt}
    with pytest.raises((PytreeioError, FileNotFoundError)) as info:
        got = getattr(ptio, call)(path, **kw)
        if call == "open":
            got.close()
    err = info.value
    text = f"{err} {getattr(err, 'filename', '')}"
    assert os.fspath(path) in text, text


# --------------------------------------------------------------------------
# 4. DataCode seed variant: biases [1, out], as DataCode 2.1.0 writes them
# --------------------------------------------------------------------------

_W0 = np.arange(12, dtype=np.float32).reshape(3, 4) / 8
_B0 = np.arange(4, dtype=np.float32) - 1.5
_W1 = np.arange(8, dtype=np.float32).reshape(4, 2) / 4
_B1 = np.array([0.25, -0.5], np.float32)
_FLAX = {"Dense_0": {"kernel": _W0, "bias": _B0}, "Dense_1": {"kernel": _W1, "bias": _B1}}
_LAYERS = {"layers": ["Linear", "ReLU", "Linear"]}


def _tensor(name: str, arr: np.ndarray) -> bytes:
    raw = name.encode()
    dims = struct.pack(f"<{arr.ndim}I", *arr.shape)
    return struct.pack("<I", len(raw)) + raw + struct.pack("<I", arr.ndim) + dims + arr.tobytes()


def _as_datacode_writes(data: bytes, bias_dims: str) -> bytes:
    """``data``'s header and JSON, then the tensors built by hand (seed names and orientation)."""
    (json_len,) = struct.unpack_from("<I", data, 12)
    head = data[: 16 + json_len]
    b0, b1 = (_B0.reshape(1, 4), _B1.reshape(1, 2)) if bias_dims == "[1, out]" else (_B0, _B1)
    tensors = [("layer0.weight", _W0), ("layer0.bias", b0)]
    tensors += [("layer2.weight", _W1), ("layer2.bias", b1)]
    return head + struct.pack("<I", 4) + b"".join(_tensor(n, a) for n, a in tensors)


def test_a_flax_model_saves_as_datacode_2_1_0_writes_it(tmp_path: Path) -> None:
    p = tmp_path / "m.nn"
    ptio.save(p, _FLAX, format="datacode", meta=_LAYERS)
    data = p.read_bytes()
    assert data == _as_datacode_writes(data, "[1, out]")
    shapes = {e.name: e.shape for e in ptio.inspect(p, format="datacode").entries}
    assert shapes["layer0.bias"] == (1, 4) and shapes["layer2.bias"] == (1, 2)
    # a native tree with no record of its file: the seed writer's shape too
    native = {"layer0": {"weight": _W0, "bias": _B0}, "layer2": {"weight": _W1, "bias": _B1}}
    assert dc.encode(native, meta=_LAYERS).tobytes() == data
    # what was read is written back byte for byte
    tree, meta = ptio.load_with_meta(p, format="datacode")
    assert meta[dc.FILE_KEY] == {"variant": "seed", "bias_2d": ["layer0", "layer2"]}
    assert dc.encode(tree, meta=meta).tobytes() == data
    # the later variant keeps [out]
    later = dc.encode(native, meta=_LAYERS, variant="later").tobytes()
    assert dc.decode(memoryview(later)).meta[dc.FILE_KEY] == {"variant": "later", "bias_2d": []}


def test_meta_asking_for_1d_biases_still_gets_them(tmp_path: Path) -> None:
    meta = {**_LAYERS, dc.FILE_KEY: {"variant": "seed", "bias_2d": []}}
    p = tmp_path / "m.nn"
    ptio.save(p, _FLAX, format="datacode", meta=meta)
    data = p.read_bytes()
    assert data == _as_datacode_writes(data, "[out]")
    # one layer each way, as a file read back records it
    native = {"layer0": {"weight": _W0, "bias": _B0}, "layer2": {"weight": _W1, "bias": _B1}}
    mixed = dc.encode(native, meta={**_LAYERS, dc.FILE_KEY: {"bias_2d": ["layer2"]}})
    shapes = {e.name: e.shape for e in dc.inspect(BufferSource(mixed.tobytes())).entries}
    assert shapes["layer0.bias"] == (4,) and shapes["layer2.bias"] == (1, 2)


def test_a_later_file_saved_in_the_seed_variant_gets_seed_biases(conformance: Path) -> None:
    data = (conformance / "datacode/model_mnist.nn").read_bytes()
    native, meta = dc.decode(memoryview(data))
    assert meta[dc.FILE_KEY] == {"variant": "later", "bias_2d": []}
    seed = dc.encode(native, meta=meta, variant="seed").tobytes()
    native2, meta2 = dc.decode(memoryview(seed))
    assert meta2[dc.FILE_KEY] == {"variant": "seed", "bias_2d": ["layer0", "layer2"]}
    assert dc.encode(native2, meta=meta2).tobytes() == seed
    assert dc.encode(native2, meta=meta2, variant="later").tobytes() == data
