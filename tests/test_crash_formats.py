"""Crash safety through the public API (``ptio.save``/``ptio.load``) for every layout.

A child process saves a checkpoint over and over with :func:`pytreeio.save`
in its format's native tree; every leaf of version ``v`` holds ``v`` (and
netcl's ``t`` is ``v``), so a torn file or a mix of two saves shows at once.
The parent SIGKILLs it at random moments and then loads the destination with
:func:`pytreeio.load`: it must be the complete previous or the complete new
version, never a mix and never unloadable (a first save was made before any
kill).  Temporaries left by a kill must be gone after the next save.  The
layouts: every single-file format (safetensors and msgpack ~30 MB, Tiny
Llama ~21 MB, DataCode ``.nn`` and the netcl model ``.npz`` ~24 MB,
netcl-params ~16 MB), the netcl-checkpoint sibling pair (``.npz`` +
``.json``), and the waffe2 and bullet directories.  Two
savers racing on one destination (with the parent loading meanwhile) must
also always leave, and show, one complete version.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from saver_process import SaverProcess

import pytreeio as ptio
from pytreeio.core.records import Siblings

ROUNDS = 6

CHILD = r"""
import os, sys, time
import numpy as np
import pytreeio as ptio
from pytreeio.core.records import Siblings
from pytreeio.io import atomic

dest, fmt, mode, base = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def tree(v):
    def full(*shape, value=None):
        return np.full(shape, v if value is None else value, np.float32)
    if fmt in ("safetensors", "msgpack"):
        return {"a": full(1024, 6144), "b": full(1024, 1536)}
    if fmt == "netcl-checkpoint":
        # netcl keeps the moments in the JSON sidecar: big params, small moments' share
        params = [full(512, 512), full(512)]
        moments = [[full(512, 512), full(512, 512)], [full(512), full(512)]]
        return {"params": params, "optim_state": {"t": int(v), "moments": moments}}
    if fmt == "waffe2":
        layers = {"0": {"weights": full(2048, 2048), "bias": full(2048)},
                  "1": {"weights": full(1024, 2048), "bias": full(1024)}}
        return {"param": {"linearlayer": layers}}
    if fmt == "tinyllama":  # ~21 MB
        d, f, vocab, seq = 256, 1024, 4096, 256
        layer = {"wq": full(d, d), "wk": full(d, d), "wv": full(d, d), "wo": full(d, d),
                 "w1": full(d, f), "b1": full(f), "w2": full(f, d), "b2": full(d),
                 "ln1": {"scale": full(d), "bias": full(d)},
                 "ln2": {"scale": full(d), "bias": full(d)}}
        return {"tok_embedding": full(vocab, d), "pos_embedding": full(seq, d),
                "layers": [layer] * 4, "output": full(d, vocab)}
    if fmt == "datacode":
        return {"layer0": {"weight": full(2048, 2048), "bias": full(2048)},
                "layer2": {"weight": full(2048, 1024), "bias": full(1024)}}
    if fmt == "netcl":  # the model file (.npz)
        return [{"weight": full(2048, 2048), "bias": full(2048)}, {},
                {"weight": full(2048, 1024), "bias": full(1024)}]
    if fmt == "netcl-params":
        return {"p0": full(2048, 2048), "p1": full(2048)}
    if fmt == "bullet":
        def part(value):
            return {"l0w": full(768, 2048, value=value), "l0b": full(2048, value=value),
                    "l1w": full(4096, 1, value=value), "l1b": full(1, value=value)}
        return {"weights": part(v / 128), "momentum": part(v), "velocity": part(v + 0.5)}
    raise SystemExit(f"unknown format {fmt}")

# what the model formats cannot infer from the arrays
META = {"tinyllama": {"config": {"n_heads": 4, "dropout": 0.0}},
        "datacode": {"layers": ["Linear", "ReLU", "Linear"]},
        "netcl": {"config": ["Linear", "ReLU", "Linear"]}}

if mode == "parallel":  # every directory written one file per thread, however small
    atomic._PARALLEL_DIR_MIN = atomic._PARALLEL_FILE_MIN = 0

if mode == "pause":  # stop right between the two commit renames of a sibling pair
    real, calls = atomic._rename, []
    def hook(src, dst):
        real(src, dst)
        calls.append(dst)
        if len(calls) == 1:
            print("between", flush=True)
            time.sleep(3600)
    atomic._rename = hook

print("ready", flush=True)
k = 0
while True:
    v = base + k % 100 + 1
    t = tree(v)
    print("start", v, flush=True)
    ptio.save(dest, t, format=fmt, meta=META.get(fmt), durable=False)
    print("done", v, flush=True)
    k += 1
"""


def _child_names(fmt: str) -> dict[str, Any]:
    """The child's ``tree`` and ``META`` (run from CHILD's own text, so they stay in step)."""
    ns: dict[str, Any] = {"np": np}
    src = CHILD.split("def tree(v):", 1)[1].split("\nif mode", 1)[0]
    exec("def tree(v, fmt=fmt):" + src, {**ns, "fmt": fmt}, ns)
    return ns


def _tree(fmt: str, v: int) -> Any:
    """The parent's copy of the child's ``tree(v)``."""
    return _child_names(fmt)["tree"](v)


def _save(dest: Path, fmt: str, v: int) -> None:
    ptio.save(
        dest, _tree(fmt, v), format=fmt, meta=_child_names(fmt)["META"].get(fmt), durable=False
    )


class Child(SaverProcess):
    """A saver of one format through ``ptio.save`` (see CHILD)."""

    def __init__(self, dest: Path, fmt: str, mode: str = "loop", base: int = 0) -> None:
        super().__init__(CHILD, [str(dest), fmt, mode, str(base)], env={"JAX_PLATFORMS": "cpu"})


def _version(dest: Path, fmt: str) -> int:
    """The one version the checkpoint at ``dest`` holds, checking every leaf of it."""
    native = ptio.load(dest, format=fmt)
    if fmt == "netcl-checkpoint":
        v = native["optim_state"]["t"]
        assert isinstance(v, int)
    elif fmt == "bullet":
        v = int(np.asarray(native["momentum"]["l0w"]).flat[0])
    else:
        leaf = native
        while isinstance(leaf, dict | list):
            leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
        v = int(np.asarray(leaf).flat[0])
    _assert_is(native, _tree(fmt, v), fmt, v)
    return v


def _assert_is(got: Any, want: Any, fmt: str, v: int, path: str = "") -> None:
    if fmt == "netcl-checkpoint" and not path:
        # netcl names the parameters p0, p1, ... and adds its config
        got = {"params": list(got["params"].values()), "optim_state": got["optim_state"]}
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, sorted(got), sorted(want))
        for k in want:
            _assert_is(got[k], want[k], fmt, v, f"{path}/{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_is(g, w, fmt, v, f"{path}[{i}]")
    elif isinstance(want, int):
        assert got == want, f"{path}: {got} != {want} (a mix of versions)"
    else:
        g = np.asarray(got)
        assert g.shape == want.shape, f"{path}: shape {g.shape} != {want.shape}"
        assert np.array_equal(g.astype(np.float32), want), f"{path}: not all {v} (torn or mixed)"


def _temporaries(directory: Path) -> set[str]:
    return {n for n in os.listdir(directory) if ".pytreeio-tmp-" in n or n.endswith("-journal")}


def _dest(tmp_path: Path, fmt: str) -> Path:
    names = {
        "safetensors": "ckpt.safetensors",
        "msgpack": "ckpt.msgpack",
        "tinyllama": "ckpt.bin",
        "datacode": "ckpt.nn",
        "netcl": "ckpt.npz",
    }
    return tmp_path / names.get(fmt, "ckpt")


FORMATS = [
    "safetensors",
    "msgpack",
    "tinyllama",
    "datacode",
    "netcl",
    "netcl-params",
    "netcl-checkpoint",
    "waffe2",
    "bullet",
]


@pytest.mark.parametrize(
    ("fmt", "mode"),
    [(fmt, "loop") for fmt in FORMATS] + [("waffe2", "parallel"), ("bullet", "parallel")],
)
def test_sigkill_during_save_leaves_old_or_new(tmp_path: Path, fmt: str, mode: str) -> None:
    """``parallel``: the directory's files written by several threads at once (the path of
    directories of 64 MiB and more), killed mid-way as well."""
    dest = _dest(tmp_path, fmt)
    t0 = time.monotonic()
    _save(dest, fmt, 1000)
    save_s = max(time.monotonic() - t0, 0.05)
    assert _version(dest, fmt) == 1000
    rng = random.Random(f"crash-{fmt}")
    current: int | None = 1000
    stale: set[str] = set()
    for i in range(ROUNDS):
        child = Child(dest, fmt, mode=mode, base=10 * (i + 1))
        child.wait_for("ready")
        if stale and i % 2:
            # the first save of this child must remove what the last kill left
            child.wait_for("done")
            assert not (stale & _temporaries(tmp_path)), stale & _temporaries(tmp_path)
        # anywhere in the next two or three saves: mid-write, mid-rename, between saves
        time.sleep(rng.uniform(0, 2.5 * save_s))
        child.kill()
        v = _version(dest, fmt)
        assert v in child.possible_versions(current), (v, current, child.lines[-4:])
        current = v
        stale = _temporaries(tmp_path)
        assert len(stale) <= 3, stale  # at most what the interrupted save had made
    _save(dest, fmt, 7)
    assert _temporaries(tmp_path) == set()
    assert _version(dest, fmt) == 7


def test_sigkill_between_the_renames_of_a_pair_rolls_forward(tmp_path: Path) -> None:
    fmt = "netcl-checkpoint"
    dest = _dest(tmp_path, fmt)
    _save(dest, fmt, 1000)
    child = Child(dest, fmt, mode="pause", base=50)
    child.wait_for("between")
    child.kill()
    assert any(n.endswith("-journal") for n in os.listdir(tmp_path))
    assert _version(dest, fmt) == 51  # the load finished the dead save's renames
    _save(dest, fmt, 7)
    assert _temporaries(tmp_path) == set()


@pytest.mark.parametrize(
    ("fmt", "mode"), [("netcl-checkpoint", "loop"), ("waffe2", "loop"), ("waffe2", "parallel")]
)
def test_two_concurrent_savers_always_leave_one_version(
    tmp_path: Path, fmt: str, mode: str
) -> None:
    dest = _dest(tmp_path, fmt)
    seen: set[int] = set()
    for rep in range(2):
        savers = [Child(dest, fmt, mode=mode, base=0), Child(dest, fmt, mode=mode, base=100)]
        for s in savers:
            s.wait_for("done")
        deadline = time.monotonic() + 1.5 + rep
        while time.monotonic() < deadline:
            seen.add(_version(dest, fmt))  # a reader meanwhile never sees a mix either
        for s in savers:
            s.kill()
        v = _version(dest, fmt)
        allowed = savers[0].possible_versions(None) | savers[1].possible_versions(None)
        assert v in allowed, (v, allowed)
    assert seen
    _save(dest, fmt, 7)
    assert _temporaries(tmp_path) == set()


@pytest.mark.parametrize("fmt", FORMATS)
def test_saves_and_loads_leave_only_the_checkpoints_files(tmp_path: Path, fmt: str) -> None:
    """No lock file, temporary or journal stays beside a checkpoint of any layout."""
    dest = _dest(tmp_path, fmt)
    layout = ptio.list_formats()[fmt].layout
    own = {dest.name}
    if isinstance(layout, Siblings):
        own |= {Path(p).name for p in layout.locate(dest).values()}
    for v in (1, 2):
        _save(dest, fmt, v)
        assert _version(dest, fmt) == v
        names = set(os.listdir(tmp_path))
        assert names and names <= own, names
