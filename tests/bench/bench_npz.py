"""Save and load of the npz-based formats (netcl, netcl-params, netcl-checkpoint) against raw I/O.

Run with ``python tests/bench/bench_npz.py [--mb 512] [--leaves 64] [--repeats 3]``.
Not a test.  Each format's save (``durable=False``) and load (native tree,
fresh arrays) is timed round-robin with its raw baselines on the same files,
and reported as the ratio of speeds (higher is better, 1.0 = raw speed):

* save vs ``write`` of the tree's arrays into a new file, no encoding at all;
* load vs the best raw read of the same page-cached file into fresh memory:
  the fastest of one-thread ``readinto``, two-thread ``pread`` and
  ``mmap`` + copy;
* peak RSS above the tree while saving and loading, measured in a fresh
  subprocess per operation (``VmHWM``), against the 64 MB allowance.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import pytreeio as ptio

FORMATS = ("netcl-params", "netcl", "netcl-checkpoint")


def make_tree(fmt: str, total_bytes: int, leaves: int) -> Any:
    """A native tree of ``leaves`` float32 arrays adding up to about ``total_bytes``."""
    rng = np.random.default_rng(0)
    if fmt == "netcl":  # Linear layers: a (in, out) weight and an (out,) bias each
        out = 256
        n_in = max(1, total_bytes // (leaves // 2) // 4 // out)
        return [
            {
                "weight": rng.standard_normal((n_in, out), dtype=np.float32),
                "bias": rng.standard_normal(out, dtype=np.float32),
            }
            for _ in range(leaves // 2)
        ]
    per = total_bytes // leaves // 4
    params = [rng.standard_normal(per, dtype=np.float32) for _ in range(leaves)]
    if fmt == "netcl-params":
        return params
    return {"params": {f"p{i}": a for i, a in enumerate(params)}, "optim_state": {}, "config": {}}


def leaves_of(tree: Any) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [a for v in tree.values() for a in leaves_of(v)]
    if isinstance(tree, list):
        return [a for v in tree for a in leaves_of(v)]
    return [tree] if isinstance(tree, np.ndarray) else []


def files_of(fmt: str, path: Path) -> list[Path]:
    return [Path(f"{path}.npz"), path.with_suffix(".json")] if fmt == "netcl-checkpoint" else [path]


def raw_write(path: Path, buffers: list[np.ndarray]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for b in buffers:
            view = memoryview(b).cast("B")
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos : pos + (1 << 30)])
    finally:
        os.close(fd)


def read_1thread(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            view = memoryview(np.empty(os.path.getsize(p), np.uint8))
            pos = 0
            while pos < len(view):
                n = f.readinto(view[pos:])
                if not n:
                    raise OSError(f"{p} shrank")
                pos += n


def read_pread2(paths: list[Path]) -> None:
    for p in paths:
        size = os.path.getsize(p)
        buf = np.empty(size, np.uint8)
        view = memoryview(buf)
        fd = os.open(p, os.O_RDONLY)

        def part(lo: int, hi: int, fd: int = fd, view: memoryview = view) -> None:
            while lo < hi:
                n = os.preadv(fd, [view[lo:hi]], lo)
                if n <= 0:
                    raise OSError("short read")
                lo += n

        try:
            half = size // 2
            t = threading.Thread(target=part, args=(0, half))
            t.start()
            part(half, size)
            t.join()
        finally:
            os.close(fd)


def read_mmap_copy(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            src = np.frombuffer(m, np.uint8)
            dst = np.empty_like(src)
            np.copyto(dst, src)
            del src


def timed(fn: Callable[[], Any], setup: Callable[[], None] | None = None) -> float:
    if setup is not None:
        setup()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def remove(paths: list[Path]) -> Callable[[], None]:
    def setup() -> None:
        for p in paths:
            if p.exists():
                p.unlink()
        os.sync()  # no dirty pages of an earlier write are flushed while this one is timed

    return setup


# --------------------------------------------------------------------------
# peak memory, in a subprocess per operation
# --------------------------------------------------------------------------

_CHILD = r"""
import os, sys
sys.path.insert(0, {bench!r})
from bench_npz import make_tree, leaves_of
import numpy as np, pytreeio as ptio
op, fmt, path, total, leaves = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
tree = make_tree(fmt, total, leaves) if op == "save" else None
nbytes = sum(a.nbytes for a in leaves_of(tree)) if tree is not None else 0
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
if op == "save":
    ptio.save(path, tree, format=fmt, durable=False)
else:
    out = ptio.load(path, format=fmt)
    nbytes = sum(a.nbytes for a in leaves_of(out))
print(status("VmHWM:") - before - (0 if op == "save" else nbytes), nbytes)
"""


def peak_over_tree(op: str, fmt: str, path: Path, total: int, leaves: int) -> int:
    """RSS high-water mark of a save/load beyond the tree itself, in a fresh process."""
    code = _CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code, op, fmt, str(path), str(total), str(leaves)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return int(out[0])


def bench_format(fmt: str, tmp: Path, total: int, leaves: int, repeats: int, memory: bool) -> None:
    """Time one format's save and load against its raw baselines; print the ratios."""
    tree = make_tree(fmt, total, leaves)
    bufs = leaves_of(tree)
    path = tmp / ("ckpt.npz" if fmt != "netcl-checkpoint" else "ckpt")
    files = files_of(fmt, path)
    raw_path = tmp / "raw.bin"
    cases: dict[str, tuple[Callable[[], Any], Callable[[], None] | None]] = {
        "save": (lambda: ptio.save(path, tree, format=fmt, durable=False), remove(files)),
        "write": (lambda: raw_write(raw_path, bufs), remove([raw_path])),
    }
    best = dict.fromkeys([*cases, "load", "readinto", "pread x2", "mmap+copy"], 1e9)
    for _ in range(repeats):
        for name, (fn, setup) in cases.items():
            best[name] = min(best[name], timed(fn, setup))
    ptio.save(path, tree, format=fmt, durable=False)
    reads: dict[str, Callable[[], Any]] = {
        "load": lambda: ptio.load(path, format=fmt),
        "readinto": lambda: read_1thread(files),
        "pread x2": lambda: read_pread2(files),
        "mmap+copy": lambda: read_mmap_copy(files),
    }
    for fn in reads.values():
        fn()  # page the files in
    for _ in range(repeats):
        for name, fn in reads.items():
            best[name] = min(best[name], timed(fn))
    raw_read = min(("readinto", "pread x2", "mmap+copy"), key=lambda k: best[k])
    for op, base in (("save", "write"), ("load", raw_read)):
        print(
            f"{fmt:<18} {op:<5} {best[op]:7.3f} {best[base]:7.3f} "
            f"{best[base] / best[op]:6.2f}  {base}"
        )
    if memory:
        for op in ("save", "load"):
            extra = peak_over_tree(op, fmt, path, total, leaves)
            print(f"{fmt:<18} {op:<5} peak RSS above the tree: {extra / 1e6:7.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="tree size in MB (default 512)")
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_npz_"))
    try:
        print(f"{'format':<18} {'op':<5} {'s':>7} {'raw s':>7} {'ratio':>6}  baseline")
        for fmt in args.formats.split(","):
            bench_format(
                fmt, tmp, args.mb * 1_000_000, args.leaves, args.repeats, not args.no_memory
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
