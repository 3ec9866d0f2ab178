"""The ``pytreeio`` command: formats, inspect, verify, convert, demo.

``inspect`` and ``formats`` import neither jax, flax nor optax; ``demo``
needs the ``flax`` extra (``pip install 'pytreeio[flax]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import api
from .errors import PytreeioError


def _cmd_formats(args: argparse.Namespace) -> int:
    fmts = api.formats()
    if args.json:
        print(
            json.dumps(
                {
                    n: {
                        "layout": f.layout,
                        "suffixes": list(f.suffixes),
                        "description": f.description,
                        "stores_meta": f.stores_meta,
                    }
                    for n, f in fmts.items()
                },
                indent=2,
            )
        )
        return 0
    w = max(len(n) for n in fmts)
    for name, f in sorted(fmts.items()):
        suffixes = " ".join(f.suffixes) or "-"
        print(f"{name:<{w}}  {f.layout:<5}  {suffixes:<20}  {f.description}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    info = api.inspect(args.path, format=args.format)
    if args.json:
        print(json.dumps(info.to_json(), indent=2, default=str))
    else:
        print(info)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    info = api.verify(args.path, format=args.format)
    print(
        f"{args.path}: OK ({info.format}, {len(info.entries)} entries, {info.nbytes:,d} tensor bytes)"
    )
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    api.convert(args.src, args.dst, to=args.to, from_=args.from_, durable=not args.no_fsync)
    info = api.inspect(args.dst, format=args.to)
    print(
        f"{args.src} -> {args.dst} ({info.format}, {len(info.entries)} entries, {info.nbytes:,d} tensor bytes)"
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.dir, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pytreeio", description="Read, write, inspect and convert checkpoints as JAX pytrees."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("formats", help="list the registered formats")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_formats)

    p = sub.add_parser("inspect", help="show a checkpoint's entries and meta (reads headers only)")
    p.add_argument("path")
    p.add_argument("--format", help="format name (default: sniffed from the content)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="decode a whole checkpoint, checking every byte")
    p.add_argument("path")
    p.add_argument("--format", help="format name (default: sniffed from the content)")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("convert", help="re-encode a checkpoint in another format")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, help="target format name")
    p.add_argument("--from", dest="from_", help="source format (default: sniffed)")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (keeps the atomic rename)")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser(
        "demo", help="train a small Flax model, checkpoint it in every format, convert, resume"
    )
    p.add_argument(
        "--dir",
        default=None,
        help="where to write the checkpoints (default: a temporary directory)",
    )
    p.add_argument(
        "--steps", type=int, default=20, help="training steps before and after the checkpoint"
    )
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # output piped into `head` and friends
        sys.stderr.close()
        return 0
    except (PytreeioError, OSError) as exc:
        print(f"pytreeio: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
