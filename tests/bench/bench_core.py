"""Throughput of pytreeio's msgpack and safetensors formats against raw I/O and peers.

Run with ``nox -s bench`` or ``python tests/bench/bench_core.py``.  Everything is
measured in one run on the same file system, and reported as GB/s and as the
ratio to raw I/O of the same bytes (the only numbers that mean much on a
shared machine):

* durable save vs ``write`` + ``fsync``; ``durable=False`` vs plain ``write``;
* load vs ``readinto`` of the same page-cached file into a preallocated buffer;
* flax.serialization (``to_bytes`` + write, read + ``msgpack_restore``), orbax
  ``StandardCheckpointer`` and the ``safetensors`` package on the same tree;
* per-leaf overhead on a tree of many small leaves;
* peak resident memory added while saving (``VmHWM`` reset through
  ``/proc/self/clear_refs``), against the tree size.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import pytreeio as ptio

Row = tuple[str, str, float, float | None]  # case, operation, seconds, ratio to raw


def make_tree(total_bytes: int, leaves: int, seed: int = 0) -> dict[str, Any]:
    per = total_bytes // leaves // 4
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(per, dtype=np.float32)
    return {"params": {f"layer_{i:04d}": {"w": base + np.float32(i)} for i in range(leaves)}}


def tree_nbytes(tree: Any) -> int:
    return sum(np.asarray(v).nbytes for v in ptio.flatten(tree).values())


def best_of(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def fresh(path: Path) -> Callable[[], None]:
    """Setup for a timed write: no destination, no dirty pages from earlier writes."""

    def setup() -> None:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        os.sync()

    return setup


def raw_write(path: Path, buffers: list[np.ndarray], durable: bool) -> None:
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
        view = memoryview(into).cast("B")
        pos = 0
        while pos < len(view):
            pos += f.readinto(view[pos:])


def peak_rss_added(fn: Callable[[], Any]) -> int | None:
    """Peak RSS growth while ``fn`` runs (Linux only)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None

    def rss(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    before = rss("VmRSS:")
    fn()
    return rss("VmHWM:") - before


def bench_big(out: Path, tree: dict[str, Any], repeat: int) -> list[Row]:
    rows: list[Row] = []
    nbytes = tree_nbytes(tree)
    buffers = list(ptio.flatten(tree).values())
    raw = out / "raw.bin"
    raw_w_durable = best_of(lambda: raw_write(raw, buffers, True), repeat, fresh(raw))
    raw_w = best_of(lambda: raw_write(raw, buffers, False), repeat, fresh(raw))
    into = np.empty(nbytes, np.uint8)
    raw_readinto(raw, into)
    raw_r = best_of(lambda: raw_readinto(raw, into), repeat)
    rows += [
        ("raw", "write+fsync", raw_w_durable, 1.0),
        ("raw", "write", raw_w, 1.0),
        ("raw", "readinto", raw_r, 1.0),
    ]

    for fmt, suffix in (("msgpack", ".msgpack"), ("safetensors", ".safetensors")):
        path = out / f"tree{suffix}"
        t = best_of(lambda p=path: ptio.save(p, tree), repeat, fresh(path))
        rows.append((f"pytreeio {fmt}", "save (durable)", t, raw_w_durable / t))
        t = best_of(lambda p=path: ptio.save(p, tree, durable=False), repeat, fresh(path))
        rows.append((f"pytreeio {fmt}", "save (durable=False)", t, raw_w / t))
        ptio.load(path)
        t = best_of(lambda p=path: ptio.load(p), repeat)
        rows.append((f"pytreeio {fmt}", "load", t, raw_r / t))
        t = best_of(lambda p=path: ptio.load(p, like=tree), repeat)
        rows.append((f"pytreeio {fmt}", "load (like=numpy)", t, raw_r / t))

    try:
        import flax.serialization as fser

        path = out / "flax.msgpack"

        def flax_save() -> None:
            data = fser.to_bytes(tree)
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

        def flax_load() -> None:
            fser.msgpack_restore(path.read_bytes())

        t = best_of(flax_save, repeat, fresh(path))
        rows.append(("flax.serialization", "save (fsync)", t, raw_w_durable / t))
        t = best_of(flax_load, repeat)
        rows.append(("flax.serialization", "load", t, raw_r / t))
    except ImportError as exc:
        print(f"flax.serialization skipped: {exc}")

    try:
        import safetensors.numpy as stn

        flat = {k: np.asarray(v) for k, v in ptio.flatten(tree).items()}
        path = out / "peer.safetensors"
        t = best_of(lambda: stn.save_file(flat, str(path)), repeat, fresh(path))
        rows.append(("safetensors pkg", "save (no fsync)", t, raw_w / t))
        t = best_of(lambda: stn.load_file(str(path)), repeat)
        rows.append(("safetensors pkg", "load", t, raw_r / t))
    except ImportError as exc:
        print(f"safetensors skipped: {exc}")

    try:
        import jax
        import orbax.checkpoint as ocp

        jtree = jax.tree_util.tree_map(jax.numpy.asarray, tree)
        ckptr = ocp.StandardCheckpointer()
        target = out / "orbax"

        def orbax_save() -> None:
            ckptr.save(target, jtree, force=True)
            ckptr.wait_until_finished()

        abstract = jax.eval_shape(lambda: jtree)

        def orbax_load() -> None:
            restored = ckptr.restore(target, abstract)
            jax.block_until_ready(restored)

        t = best_of(orbax_save, repeat, fresh(target))
        rows.append(("orbax Standard", "save", t, raw_w_durable / t))
        t = best_of(orbax_load, repeat)
        rows.append(("orbax Standard", "load", t, raw_r / t))
        ckptr.close()
    except ImportError as exc:
        print(f"orbax skipped: {exc}")
    return rows


def bench_leaves(out: Path, leaves: int, repeat: int) -> list[tuple[str, str, float]]:
    tree = {"params": {f"m{i:05d}": {"w": np.full(64, i, np.float32)} for i in range(leaves)}}
    results = []
    for fmt, suffix in (("msgpack", ".msgpack"), ("safetensors", ".safetensors")):
        path = out / f"leaves{suffix}"
        t_save = best_of(lambda p=path: ptio.save(p, tree, durable=False), repeat)
        t_load = best_of(lambda p=path: ptio.load(p), repeat)
        t_like = best_of(lambda p=path: ptio.load(p, like=tree), repeat)
        results += [
            (fmt, "save (durable=False)", t_save / leaves),
            (fmt, "load", t_load / leaves),
            (fmt, "load (like=numpy)", t_like / leaves),
        ]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--small-leaves", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="directory on the file system to measure (default: a temp dir)"
    )
    args = parser.parse_args()

    out = Path(tempfile.mkdtemp(prefix="pytreeio-bench-", dir=args.dir))
    try:
        tree = make_tree(args.size_mb << 20, args.leaves)
        nbytes = tree_nbytes(tree)
        print(f"tree: {args.leaves} float32 leaves, {nbytes / 1e6:.0f} MB; files in {out}")
        rows = bench_big(out, tree, args.repeat)
        print(f"\n{'case':<20} {'operation':<22} {'GB/s':>7} {'ratio to raw':>13}")
        for case, op, secs, ratio in rows:
            r = f"{ratio:.2f}x" if ratio is not None else "-"
            print(f"{case:<20} {op:<22} {nbytes / secs / 1e9:>7.2f} {r:>13}")

        for fmt in ("msgpack", "safetensors"):
            path = out / f"mem.{fmt}"
            added = peak_rss_added(lambda f=fmt, p=path: ptio.save(p, tree, format=f))
            if added is not None:
                print(
                    f"\npeak RSS added while saving ({fmt}): {added / 1e6:.1f} MB "
                    f"(tree {nbytes / 1e6:.0f} MB; budget: tree + 64 MB)"
                )

        print(f"\nper-leaf overhead, {args.small_leaves} leaves of 64 float32:")
        per_leaf = bench_leaves(out, args.small_leaves, max(args.repeat, 5))
        for fmt, op, secs in per_leaf:
            print(f"  {fmt:<12} {op:<22} {secs * 1e6:7.2f} us/leaf")
        summary = statistics.median(s for _, _, s in per_leaf) * 1e6
        print(f"  median {summary:.2f} us/leaf (target <= 20)")
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
