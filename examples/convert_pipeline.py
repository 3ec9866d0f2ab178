"""Convert a checkpoint along a chain of formats, proving with ``pytreeio diff`` that nothing changed.

    python examples/convert_pipeline.py [SRC] [--to netcl,datacode,waffe2,bullet,msgpack] [--out DIR]

Reads SRC in whatever format it is (sniffed), converts it to each format of
the chain in turn, and compares every result with SRC through
:func:`pytreeio.diff.diff` (through the common model form when the formats
name their arrays differently).  A conversion the next format cannot hold
fails before anything is written (``ConversionError``).  With no SRC, a
generated Flax MLP is used.  Exit status 0 only when every step is identical.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import pytreeio as ptio
from pytreeio.diff import diff

SUFFIX = {
    "msgpack": ".msgpack",
    "safetensors": ".safetensors",
    "netcl": ".netcl",
    "datacode": ".nn",
}


def generated_mlp(out: Path) -> Path:
    """A small Flax-style MLP (Dense_0 -> ReLU -> Dense_1 -> ReLU -> Dense_2) as a netcl file."""
    rng = np.random.default_rng(0)
    sizes = [8, 32, 32, 4]
    params = {
        f"Dense_{i}": {
            "kernel": rng.standard_normal((sizes[i], sizes[i + 1])).astype(np.float32),
            "bias": rng.standard_normal(sizes[i + 1]).astype(np.float32),
        }
        for i in range(3)
    }
    src = out / "generated.netcl"
    ptio.save(src, params, layers=["Linear", "ReLU", "Linear", "ReLU", "Linear"])
    return src


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?")
    parser.add_argument("--to", default="datacode,waffe2,bullet,msgpack,safetensors")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="pytreeio-convert-"))
    out.mkdir(parents=True, exist_ok=True)
    src = Path(args.src) if args.src else generated_mlp(out)
    print(ptio.inspect(src))

    current, changed = src, 0
    for i, fmt in enumerate(args.to.split(",")):
        dst = out / f"step{i}-{fmt}{SUFFIX.get(fmt, '')}"
        ptio.convert(current, dst, to=fmt)
        report = diff(src, dst, format_b=fmt)
        print(f"{current.name} -> {dst.name} ({fmt}): {report.summary()}")
        changed += not report.ok
        current = dst
    print(f"{changed} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
