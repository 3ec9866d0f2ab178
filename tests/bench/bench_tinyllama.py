"""Benchmark: Tiny Llama save/load against raw I/O of the same bytes.

Builds the 512/6/8/2048/1024/32000 model (208,778,164 bytes on disk) and, in
one run on one file system, compares

* ``save`` (durable) with a raw ``write`` + ``fsync`` of the same bytes,
* ``save(durable=False)`` with a raw ``write``,
* ``load`` with ``readinto`` of the same page-cached file into a preallocated buffer,

reporting GB/s and ratios (ours / raw throughput; the goal is >= 0.9), and the
bytes ``inspect`` reads.  Run: ``python tests/bench/bench_tinyllama.py [--dir D] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rawio import raw_write, read_readinto

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared test data
from tinyllama_data import random_tree

import pytreeio as ptio
from pytreeio.fmt import tinyllama as tl
from pytreeio.io import FileSource

CONFIG = {
    "d_model": 512,
    "n_layers": 6,
    "n_heads": 8,
    "ffn_hidden_dim": 2048,
    "max_seq_len": 1024,
    "vocab_size": 32000,
    "dropout": 0.1,
}
EXPECTED_SIZE = 208_778_164


def best_of(repeat: int, fn: Callable[[], Any], before: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def readinto_buffer(path: Path, buf: np.ndarray) -> None:
    """``readinto`` the whole file into an already-touched buffer (the warm baseline)."""
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf).cast("B")
        pos = 0
        while pos < len(view):
            n = f.readinto(view[pos:])
            if not n:
                raise OSError(f"{path} is shorter than the buffer")
            pos += n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the files")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    tree = random_tree(CONFIG)
    meta = {"config": {"n_heads": CONFIG["n_heads"], "dropout": CONFIG["dropout"]}}
    encoded = tl.encode(tree, meta=meta)
    size = encoded.nbytes
    assert size == EXPECTED_SIZE == tl.file_size(CONFIG), size
    data = encoded.tobytes()  # the same bytes, contiguous, for the raw baselines
    gb = size / 1e9

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ours = Path(tmp) / "ours.bin"
        raw = Path(tmp) / "raw.bin"

        def unlink(p: Path) -> Callable[[], None]:
            return lambda: p.unlink(missing_ok=True)

        rows = []
        files = [(raw.name, size)]
        for durable in (True, False):
            write = partial(raw_write, raw.parent, files, [data], durable)
            t_raw = best_of(args.repeat, write, unlink(raw))
            save = partial(ptio.save, ours, tree, format="tinyllama", meta=meta, durable=durable)
            t_ours = best_of(args.repeat, save, unlink(ours))
            label = "save durable" if durable else "save durable=False"
            rows.append((label, t_ours, "write+fsync" if durable else "write", t_raw))
        assert ours.read_bytes() == data

        buf = np.empty(size, np.uint8)
        read_readinto(raw, files)  # warm the page cache for both files
        ptio.load(ours)
        t_raw = best_of(args.repeat, lambda: readinto_buffer(ours, buf))
        t_ours = best_of(args.repeat, lambda: ptio.load(ours, format="tinyllama"))
        rows.append(("load", t_ours, "readinto", t_raw))
        t_sniff = best_of(args.repeat, lambda: ptio.load(ours))
        rows.append(("load (sniffed)", t_sniff, "readinto", t_raw))
        # The same readinto into freshly allocated memory, as a load must: the gap
        # between the two baselines is the cost of faulting in new pages.
        t_fresh = best_of(args.repeat, lambda: read_readinto(ours, [(ours.name, size)]))
        rows.append(("load", t_ours, "readinto new", t_fresh))
        t_decode = best_of(args.repeat, lambda: tl.decode(buf))

        def load_mmap_touch() -> None:
            loaded = ptio.load(ours, format="tinyllama", mmap=True)
            for leaf in ptio.flatten(loaded).values():
                np.add.reduce(leaf, axis=None)  # fault every page in

        t_mmap = best_of(args.repeat, load_mmap_touch)
        rows.append(("load mmap + touch", t_mmap, "readinto", t_raw))

        with FileSource(ours) as source:
            info = tl.inspect(source)
            inspect_bytes = source.bytes_read
        t_inspect = best_of(args.repeat, lambda: ptio.inspect(ours))

    print(f"Tiny Llama 512/6/8/2048/1024/32000: {size:,} B, {len(info.entries)} entries")
    print(f"{'operation':<20} {'ours GB/s':>10} {'baseline':<12} {'raw GB/s':>9} {'ratio':>6}")
    for label, t_ours, base, t_raw in rows:
        print(
            f"{label:<20} {gb / t_ours:>10.2f} {base:<12} {gb / t_raw:>9.2f} {t_raw / t_ours:>6.2f}"
        )
    print(f"decode of an in-memory buffer (parsing only): {t_decode * 1e6:.0f} us")
    print(f"inspect: {inspect_bytes} bytes read, {t_inspect * 1e3:.2f} ms")
    assert inspect_bytes < 1024


if __name__ == "__main__":
    main()
