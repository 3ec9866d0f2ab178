"""Run a Tiny Llama weight file with the Flax model and generate greedily.

    python examples/tinyllama_generate.py [WEIGHTS] [--prompt 1 5 7] [--new 8]

WEIGHTS defaults to the conformance file written by the original C++ code.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytreeio as ptio
from pytreeio.models import tinyllama as tl

DEFAULT = (
    Path(__file__).resolve().parents[2] / "shared" / "conformance" / "tinyllama" / "weights.bin"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", nargs="?", default=str(DEFAULT))
    parser.add_argument("--prompt", type=int, nargs="+", default=[1, 5, 7, 42, 99])
    parser.add_argument("--new", type=int, default=8)
    args = parser.parse_args()

    info = ptio.inspect(args.weights)  # header only
    config = tl.TinyLlamaConfig.from_meta(info.meta)
    print(f"{args.weights}: {config}")
    params = ptio.load(args.weights, like=tl.abstract_params(config))
    tokens = tl.generate_greedy(params, config, args.prompt, args.new)
    print(f"prompt {args.prompt} -> generated {tokens[len(args.prompt) :]}")


if __name__ == "__main__":
    main()
