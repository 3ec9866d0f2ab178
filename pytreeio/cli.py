"""The ``pytreeio`` command: formats, inspect, verify, convert, demo.

``inspect`` and ``formats`` import neither jax, flax nor optax; ``demo``
needs the ``flax`` extra (``pip install 'pytreeio[flax]'``).

Errors (any :class:`~pytreeio.errors.PytreeioError`, missing files and other
``OSError`` exceptions) are printed as one line ``pytreeio: error: ...`` on stderr
with exit status 1; ``--debug`` shows the traceback instead.  Usage errors
exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from . import api
from .errors import PytreeioError, UnknownFormatError


def _cmd_formats(args: argparse.Namespace) -> int:
    fmts = api.formats()
    if args.json:
        print(
            json.dumps(
                {
                    n: {
                        "layout": f.layout.kind,
                        "suffixes": list(f.suffixes),
                        "description": f.description,
                        "accepts_meta": f.accepts_meta,
                        "keeps_meta": f.keeps_meta,
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
        print(f"{name:<{w}}  {f.layout.kind:<8}  {suffixes:<20}  {f.description}")
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
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error instead of one line"
    )
    # --debug is also accepted after the command (`pytreeio verify x --debug`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="as above")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    p = add("formats", help="list the registered formats")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_formats)

    p = add("inspect", help="show a checkpoint's entries and meta (reads headers only)")
    p.add_argument("path")
    p.add_argument("--format", help="format name (default: sniffed from the content)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_inspect)

    p = add("verify", help="decode a whole checkpoint, checking every byte")
    p.add_argument("path")
    p.add_argument("--format", help="format name (default: sniffed from the content)")
    p.set_defaults(func=_cmd_verify)

    p = add("convert", help="re-encode a checkpoint in another format")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, help="target format name")
    p.add_argument("--from", dest="from_", help="source format (default: sniffed)")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (keeps the atomic rename)")
    p.set_defaults(func=_cmd_convert)

    p = add("demo", help="train a small Flax model, checkpoint it in every format, convert, resume")
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


def _name(filename: object) -> str:
    return os.fsdecode(filename) if isinstance(filename, bytes) else str(filename)


def error_line(exc: BaseException) -> str:
    """The one-line message the command prints for ``exc`` (without the ``pytreeio: error:``)."""
    if isinstance(exc, UnknownFormatError):
        # The API tells callers to "pass format="; here that is the --format option.
        msg = str(exc).replace("format=", "--format")
    elif isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        msg = f"{_name(exc.filename)}: {exc.strerror}"
        if exc.filename2 is not None:
            msg += f" (-> {_name(exc.filename2)})"
    else:
        msg = str(exc) or type(exc).__name__
    return " ".join(msg.split()) if "\n" in msg or "\r" in msg else msg


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # output piped into `head` and friends
        sys.stderr.close()
        return 0
    except (PytreeioError, OSError) as exc:
        if args.debug:
            raise
        print(f"pytreeio: error: {error_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
