"""Convert checkpoints between formats, checking that nothing changed on the way.

    python examples/convert_pipeline.py SRC [--to safetensors] [--out DIR]

Reads SRC in whatever format it is (sniffed), writes it in the target format,
reads that back and compares every tensor bit for bit.  With no SRC, a
generated Flax-style checkpoint is used.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import pytreeio as ptio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?")
    parser.add_argument("--to", default="safetensors")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="pytreeio-convert-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.src is None:
        rng = np.random.default_rng(0)
        src = out / "generated.msgpack"
        ptio.save(
            src,
            {
                "params": {
                    f"Dense_{i}": {
                        "kernel": rng.standard_normal((32, 32), np.float32),
                        "bias": np.zeros(32, np.float32),
                    }
                    for i in range(3)
                }
            },
        )
    else:
        src = Path(args.src)

    info = ptio.inspect(src)
    print(info)
    dst = out / f"{src.stem}.{args.to}"
    ptio.convert(src, dst, to=args.to)
    before = ptio.flatten(ptio.load(src))
    after = ptio.flatten(ptio.load(dst, format=args.to))
    changed = [
        k
        for k in before
        if k not in after or np.asarray(before[k]).tobytes() != np.asarray(after[k]).tobytes()
    ]
    print(
        f"{src} ({info.format}) -> {dst} ({args.to}): {len(before)} entries, {len(changed)} changed"
    )
    if changed:
        raise SystemExit(f"changed: {changed[:10]}")


if __name__ == "__main__":
    main()
