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
from rawio import raw_readinto, raw_write

import pytreeio as ptio

Row = tuple[str, str, float, float | None]  # case, operation, seconds, ratio to raw


def make_tree(total_bytes: int, leaves: int, seed: int = 0) -> dict[str, Any]:
    per = total_bytes // leaves // 4
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(per, dtype=np.float32)
    return {"params": {f"layer_{i:04d}": {"w": base + np.float32(i)} for i in range(leaves)}}


def tree_nbytes(tree: Any) -> int:
    return sum(np.asarray(v).nbytes for v in ptio.flatten(tree).values())


def fresh(path: Path) -> Callable[[], None]:
    """Setup for a timed write: no destination, no dirty pages from earlier writes."""

    def setup() -> None:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        os.sync()

    return setup


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


def race(
    cases: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]], repeat: int
) -> dict[str, float]:
    """Best time of each case over ``repeat`` rounds, the cases interleaved in every round.

    Interleaving gives every case the same machine conditions (page cache,
    writeback, neighbours' load), which matter more than anything measured.
    """
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


def _peer_cases(
    out: Path, tree: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(durable writes, plain writes, reads) of the peer libraries that are installed."""
    durable: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    reads: dict[str, Any] = {}
    try:
        import flax.serialization as fser

        fpath = out / "flax.msgpack"

        def flax_save() -> None:
            data = fser.to_bytes(tree)
            with open(fpath, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

        durable["flax.serialization save (fsync)"] = (flax_save, fresh(fpath))
        reads["flax.serialization load"] = (lambda: fser.msgpack_restore(fpath.read_bytes()), None)
    except ImportError as exc:
        print(f"flax.serialization skipped: {exc}")
    try:
        import safetensors.numpy as stn

        flat = {k: np.asarray(v) for k, v in ptio.flatten(tree).items()}
        spath = out / "peer.safetensors"
        plain["safetensors pkg save (no fsync)"] = (
            lambda: stn.save_file(flat, str(spath)),
            fresh(spath),
        )
        reads["safetensors pkg load"] = (lambda: stn.load_file(str(spath)), None)
    except ImportError as exc:
        print(f"safetensors skipped: {exc}")
    try:
        import jax
        import orbax.checkpoint as ocp

        jtree = jax.tree_util.tree_map(jax.numpy.asarray, tree)
        ckptr = ocp.StandardCheckpointer()
        target = out / "orbax"
        abstract = jax.eval_shape(lambda: jtree)

        def orbax_save() -> None:
            ckptr.save(target, jtree, force=True)
            ckptr.wait_until_finished()

        def orbax_load() -> None:
            jax.block_until_ready(ckptr.restore(target, abstract))

        durable["orbax Standard save"] = (orbax_save, fresh(target))
        reads["orbax Standard load"] = (orbax_load, None)
    except ImportError as exc:
        print(f"orbax skipped: {exc}")
    return durable, plain, reads


def bench_big(out: Path, tree: dict[str, Any], repeat: int) -> list[Row]:
    buffers = list(ptio.flatten(tree).values())
    raw = out / "raw.bin"
    paths = {fmt: out / f"tree.{fmt}" for fmt in ("msgpack", "safetensors")}
    peers_durable, peers_plain, peers_read = _peer_cases(out, tree)

    durable: dict[str, Any] = {
        "raw write+fsync": (lambda: raw_write(raw, buffers, True), fresh(raw))
    }
    plain: dict[str, Any] = {"raw write": (lambda: raw_write(raw, buffers, False), fresh(raw))}
    for fmt, p in paths.items():
        durable[f"pytreeio {fmt} save (durable)"] = (lambda p=p: ptio.save(p, tree), fresh(p))
        plain[f"pytreeio {fmt} save (durable=False)"] = (
            lambda p=p: ptio.save(p, tree, durable=False),
            fresh(p),
        )
    durable.update(peers_durable)
    plain.update(peers_plain)

    rows: list[Row] = []
    for group, base in ((durable, "raw write+fsync"), (plain, "raw write")):
        times = race(group, repeat)
        rows += [(name, "", t, times[base] / t) for name, t in times.items()]

    # reads: every file exists now (the last round of writes left them)
    into = np.empty(tree_nbytes(tree), np.uint8)
    reads: dict[str, Any] = {"raw readinto": (lambda: raw_readinto(raw, into), None)}
    for fmt, p in paths.items():
        reads[f"pytreeio {fmt} load"] = (lambda p=p: ptio.load(p), None)
        reads[f"pytreeio {fmt} load (like=numpy)"] = (lambda p=p: ptio.load(p, like=tree), None)
        # like-with-like for readers that map the file (the safetensors package does)
        reads[f"pytreeio {fmt} load (mmap=True)"] = (lambda p=p: ptio.load(p, mmap=True), None)
    reads.update(peers_read)
    times = race(reads, repeat)
    rows += [(name, "", t, times["raw readinto"] / t) for name, t in times.items()]
    return rows


def bench_leaves(out: Path, leaves: int, repeat: int) -> list[tuple[str, str, float]]:
    tree = {"params": {f"m{i:05d}": {"w": np.full(64, i, np.float32)} for i in range(leaves)}}
    results = []
    for fmt, suffix in (("msgpack", ".msgpack"), ("safetensors", ".safetensors")):
        path = out / f"leaves{suffix}"
        ptio.save(path, tree, durable=False)
        times = race(
            {
                "save (durable=False)": (lambda p=path: ptio.save(p, tree, durable=False), None),
                "load": (lambda p=path: ptio.load(p), None),
                "load (like=numpy)": (lambda p=path: ptio.load(p, like=tree), None),
            },
            repeat,
        )
        results += [(fmt, op, t / leaves) for op, t in times.items()]
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
        print(f"\n{'case':<44} {'GB/s':>7} {'ratio to raw':>13}")
        for case, _, secs, ratio in rows:
            r = f"{ratio:.2f}x" if ratio is not None else "-"
            print(f"{case:<44} {nbytes / secs / 1e9:>7.2f} {r:>13}")

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
