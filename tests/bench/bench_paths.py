"""The core read/write paths against raw I/O, in one run: async saves, loads, per-leaf cost.

Run with ``python tests/bench/bench_paths.py [--size-mb 512] [--only NAME]``.
Sections (``--only`` picks one): ``async`` (how long ``save_async`` blocks
against a full save), ``load`` (single-file loads, with and without ``like``,
against the best raw read of this machine: one-thread ``readinto``,
two-thread ``pread`` and ``mmap`` + copy into fresh memory), ``save``
(against raw ``write`` and ``write`` + ``fsync``), ``leaves`` (per-leaf cost
on a 2,000-leaf tree against safetensors.numpy and flax), ``inspect`` (a
1 GB file per single-file format) and ``import`` (``import pytreeio`` over
``import numpy``).  Times are best of ``--repeat`` rounds with the cases
interleaved; ratios within one run are what to compare on a shared machine.
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
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

Case = tuple[Callable[[], Any], Callable[[], Any] | None]


def make_tree(total_bytes: int, leaves: int) -> dict[str, Any]:
    per = total_bytes // leaves // 4
    rng = np.random.default_rng(0)
    base = rng.standard_normal(per, dtype=np.float32)
    return {"params": {f"layer_{i:04d}": {"w": base + np.float32(i)} for i in range(leaves)}}


def race(cases: dict[str, Case], repeat: int) -> dict[str, float]:
    """Best wall time of each case, the cases interleaved in every round."""
    best = {name: float("inf") for name in cases}
    for _ in range(repeat):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            gc.collect()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def fresh(path: Path) -> Callable[[], None]:
    def setup() -> None:
        if path.exists():
            path.unlink()
        os.sync()

    return setup


def raw_write(path: Path, buffers: list[Any], durable: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for b in buffers:
            view = memoryview(b).cast("B")
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos : pos + (1 << 30)])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def raw_readinto(path: Path, into: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = into.data.cast("B")
        pos = 0
        while pos < len(view):
            pos += f.readinto(view[pos:]) or 0


def pread_threads(path: Path, size: int, threads: int = 2) -> np.ndarray:
    out = np.empty(size, np.uint8)
    view = out.data
    fd = os.open(path, os.O_RDONLY)
    try:
        step = -(-size // threads)

        def part(start: int) -> None:
            pos, stop = start, min(start + step, size)
            while pos < stop:
                pos += os.preadv(fd, [view[pos:stop]], pos)

        ts = [threading.Thread(target=part, args=(s,)) for s in range(0, size, step)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        os.close(fd)
    return out


def mmap_copy(path: Path) -> np.ndarray:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return np.frombuffer(m, np.uint8).copy()


def show(rows: dict[str, float], base: str, nbytes: int | None = None) -> None:
    for name, t in rows.items():
        rate = f"{nbytes / t / 1e9:6.2f} GB/s" if nbytes else ""
        print(f"  {name:<44} {t * 1e3:9.1f} ms {rate} {rows[base] / t:6.2f}x")


def bench_async(out: Path, tree: Any, repeat: int) -> None:
    nbytes = sum(v.nbytes for v in ptio.flatten(tree).values())
    print(f"\nasync save, {nbytes / 1e6:.0f} MB (blocking = until save_async returns)")
    for durable in (True, False):
        for fmt in ("msgpack", "safetensors"):
            p = out / f"async.{fmt}"
            blocking, full, sync = [], [], []
            for _ in range(repeat):
                fresh(p)()
                t0 = time.perf_counter()
                fut = ptio.save_async(p, tree, durable=durable)
                t1 = time.perf_counter()
                fut.result()
                t2 = time.perf_counter()
                blocking.append(t1 - t0)
                full.append(t2 - t0)
                fresh(p)()
                t0 = time.perf_counter()
                ptio.save(p, tree, durable=durable)
                sync.append(time.perf_counter() - t0)
            print(
                f"  {fmt:<12} durable={durable!s:<5} blocking {min(blocking) * 1e3:7.1f} ms, "
                f"async total {min(full) * 1e3:7.1f} ms, sync save {min(sync) * 1e3:7.1f} ms "
                f"(blocking/sync {min(blocking) / min(sync):.2f})"
            )


def bench_load(out: Path, tree: Any, repeat: int) -> None:
    flat = ptio.flatten(tree)
    nbytes = sum(v.nbytes for v in flat.values())
    raw = out / "raw.bin"
    raw_write(raw, list(flat.values()), False)
    into = np.empty(nbytes, np.uint8)
    paths = {}
    for fmt in ("msgpack", "safetensors"):
        paths[fmt] = out / f"load.{fmt}"
        ptio.save(paths[fmt], tree, durable=False)
    cases: dict[str, Case] = {
        "raw readinto (1 thread, fresh memory)": (
            lambda: raw_readinto(raw, np.empty(nbytes, np.uint8)),
            None,
        ),
        "raw readinto (touched memory)": (lambda: raw_readinto(raw, into), None),
        "raw pread (2 threads)": (lambda: pread_threads(raw, nbytes), None),
        "raw mmap + copy": (lambda: mmap_copy(raw), None),
    }
    for fmt, p in paths.items():
        cases[f"pytreeio {fmt} load"] = (lambda p=p: ptio.load(p), None)
        cases[f"pytreeio {fmt} load like"] = (lambda p=p: ptio.load(p, like=tree), None)
    try:
        import safetensors.numpy as stn

        cases["safetensors.numpy load"] = (lambda: stn.load_file(str(paths["safetensors"])), None)
    except ImportError:
        pass
    times = race(cases, repeat)
    best_raw = min(t for n, t in times.items() if n.startswith("raw") and "touched" not in n)
    times["best raw read"] = best_raw
    print(f"\nloads, {nbytes / 1e6:.0f} MB, ratio to the best raw read into fresh memory")
    show(times, "best raw read", nbytes)


def bench_save(out: Path, tree: Any, repeat: int) -> None:
    flat = ptio.flatten(tree)
    nbytes = sum(v.nbytes for v in flat.values())
    raw = out / "raw.bin"
    for durable in (False, True):
        cases: dict[str, Case] = {
            "raw write": (lambda d=durable: raw_write(raw, list(flat.values()), d), fresh(raw))
        }
        for fmt in ("msgpack", "safetensors"):
            p = out / f"save.{fmt}"
            cases[f"pytreeio {fmt} save"] = (
                lambda p=p, d=durable: ptio.save(p, tree, durable=d),
                fresh(p),
            )
        times = race(cases, repeat)
        print(f"\nsaves, durable={durable}, ratio to raw write{' + fsync' if durable else ''}")
        show(times, "raw write", nbytes)


def bench_leaves(out: Path, leaves: int, repeat: int) -> None:
    tree = {"params": {f"m{i:05d}": {"w": np.full(64, i, np.float32)} for i in range(leaves)}}
    flat = ptio.flatten(tree)
    cases: dict[str, Case] = {}
    try:
        import safetensors.numpy as stn

        sp = str(out / "peer.safetensors")
        cases["safetensors.numpy save"] = (lambda: stn.save_file(flat, sp), None)
        cases["safetensors.numpy load"] = (lambda: stn.load_file(sp), None)
    except ImportError:
        pass
    try:
        import flax.serialization as fser

        fp = out / "peer.flax"
        cases["flax save"] = (lambda: fp.write_bytes(fser.to_bytes(tree)), None)
        cases["flax load"] = (lambda: fser.msgpack_restore(fp.read_bytes()), None)
    except ImportError:
        pass
    for fmt in ("msgpack", "safetensors"):
        p = out / f"leaves.{fmt}"
        cases[f"pytreeio {fmt} save"] = (lambda p=p: ptio.save(p, tree, durable=False), None)
        cases[f"pytreeio {fmt} load"] = (lambda p=p: ptio.load(p), None)
        cases[f"pytreeio {fmt} load like"] = (lambda p=p: ptio.load(p, like=tree), None)
    for name, (fn, _) in cases.items():  # every file exists before the loads are timed
        if "save" in name:
            fn()
    times = race(cases, repeat)
    print(f"\nper-leaf cost, {leaves} leaves of 64 float32 (non-durable saves)")
    for name, t in times.items():
        print(f"  {name:<44} {t / leaves * 1e6:7.2f} us/leaf")


def bench_inspect(out: Path) -> None:
    tree = make_tree(1 << 30, 256)
    print("\ninspect of a 1 GB file")
    for fmt in ("msgpack", "safetensors"):
        p = out / f"inspect.{fmt}"
        ptio.save(p, tree, durable=False)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            ptio.inspect(p)
            best = min(best, time.perf_counter() - t0)
        print(f"  {fmt:<12} {best * 1e3:7.2f} ms")
        p.unlink()


def bench_import(repeat: int = 7) -> None:
    def best(code: str) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - t0)
        return min(times)

    base = best("import numpy")
    ours = best("import numpy, pytreeio")
    print(f"\nimport pytreeio over import numpy: {(ours - base) * 1e3:.1f} ms (fresh processes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--small-leaves", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default=None)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="pytreeio-paths-", dir=args.dir))

    def want(section: str) -> bool:
        return args.only in (None, section)

    try:
        if want("leaves"):
            bench_leaves(out, args.small_leaves, max(args.repeat, 5))
        if want("import"):
            bench_import()
        if want("inspect"):
            bench_inspect(out)
        if want("async") or want("load") or want("save"):
            tree = make_tree(args.size_mb << 20, args.leaves)
            if want("load"):
                bench_load(out, tree, args.repeat)
            if want("save"):
                bench_save(out, tree, args.repeat)
            if want("async"):
                bench_async(out, tree, args.repeat)
    finally:
        for p in out.iterdir():
            p.unlink()
        out.rmdir()


if __name__ == "__main__":
    main()
