"""The ``pytreeio`` command.

Commands: ``formats``, ``inspect``, ``verify``, ``checksum``, ``convert``,
``diff``, ``demo`` (``pytreeio COMMAND --help`` describes each).
``--quiet`` and ``--debug`` are also accepted after the command.

Exit status: 0 ok; 1 an error (or, for ``diff``, checkpoints that differ);
2 a usage error.  Errors (any exception, with ``--debug`` shown as a
traceback instead) are one line ``pytreeio: error: ...`` on stderr, and
warnings (what ``--lossy`` dropped, a bullet save without ``quantised.bin``)
one line ``pytreeio: warning: ...`` each, without Python's source line.

``convert``, ``verify`` and ``diff`` show a transient progress display on
stderr when it is a terminal and the checkpoints are over 100 MB
(`pytreeio.progress`).

``inspect`` and ``formats`` import neither jax, flax, optax nor rich;
``demo`` needs the ``flax`` extra (``pip install 'pytreeio[flax]'``).
"""

from __future__ import annotations

import argparse
import inspect as _inspect
import json
import math
import os
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from pytreeio import __version__, api, progress
from pytreeio.core import records
from pytreeio.core.errors import PytreeioError, PytreeioWarning, UnknownFormatError
from pytreeio.core.records import Format
from pytreeio.formats import registry

T = TypeVar("T")

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A command line that cannot be run as given (exit status 2)."""


# --- argument values ---


def _read_at_file(value: str, what: str) -> str:
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"{what}: cannot read {value[1:]!r}: {reason}") from None


def parse_opts(items: Sequence[str] | None) -> dict[str, Any]:
    """``--opt name=value`` items as keyword options.

    A value is parsed as JSON when it parses (``true``, ``3``, ``[...]``,
    ``{...}``, ``null``), else kept as a string; ``@path`` reads the value
    from a file (again JSON when it parses).
    """
    out: dict[str, Any] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise UsageError(f"--opt takes NAME=VALUE, got {item!r}")
        if name in out:
            raise UsageError(f"--opt {name} is given twice")
        if value.startswith("@"):
            value = _read_at_file(value, f"--opt {name}")
        try:
            out[name] = json.loads(value)
        except ValueError:
            out[name] = value
    return out


def parse_meta(text: str | None) -> dict[str, Any] | None:
    """``--meta`` as a JSON object (``@path`` reads it from a file)."""
    if text is None:
        return None
    if text.startswith("@"):
        text = _read_at_file(text, "--meta")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--meta is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError(f"--meta must be a JSON object, got {type(value).__name__}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    if not text.strip().lstrip("+").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer, at least 1, got {text!r}")
    return int(text)


def _json_default(x: Any) -> Any:
    tolist = getattr(x, "tolist", None)  # numpy and jax arrays and scalars
    return tolist() if callable(tolist) else str(x)


def _dumps(doc: Any) -> str:
    return json.dumps(doc, indent=2, default=_json_default)


# --- paths and options ---


def _sibling_stem(path: str, format: str | None) -> str | None:
    """The stem of a sibling-file checkpoint that the file ``path`` is one of (``ckpt.json`` -> ``ckpt``)."""
    p = Path(path)
    if not p.suffix or not p.is_file():
        return None
    stem = p.with_suffix("")
    try:
        candidates = [registry.get(format)] if format else list(registry.formats().values())
    except UnknownFormatError:
        return None
    for fmt in candidates:
        if not isinstance(fmt.layout, records.Siblings):
            continue
        try:
            located = fmt.layout.locate(stem)
        except Exception:
            continue
        if any(Path(q) == p for q in located.values()):
            return os.fspath(stem)
    return None


def resolve_path(path: str, format: str | None) -> str:
    """``path``, or the stem of the sibling-file checkpoint it is one file of.

    ``pytreeio inspect ckpt.json`` then reads the checkpoint ``ckpt``
    (``ckpt.npz`` + ``ckpt.json``) as ``pytreeio inspect ckpt`` would.
    """
    try:
        api.inspect(path, format=format)
        return path
    except (PytreeioError, OSError):
        # only now: looking for the sibling layouts lists every format, plug-ins included
        stem = _sibling_stem(path, format)
        if stem is None:
            return path
        try:
            api.inspect(stem, format=format)
        except (PytreeioError, OSError):
            return path  # neither reads: the error is about the path given
        return stem


def _with_options(fn: Callable[[], T], options: Mapping[str, Any]) -> T:
    """Run an API call given user options; an option no function takes is a usage error."""
    try:
        return fn()
    except TypeError as exc:
        if options and not isinstance(exc, PytreeioError) and "option" in str(exc):
            raise UsageError(f"{exc} (see `pytreeio formats`)") from exc
        raise


def _check_suffix(dst: str, target: Format, force: bool) -> None:
    """Refuse a destination whose suffix names another format than ``--to``."""
    name = dst.lower().rstrip("/\\")
    if any(name.endswith(s) for s in target.suffixes):
        return
    others = sorted(
        f.name
        for f in registry.formats().values()
        if f is not target and any(name.endswith(s) for s in f.suffixes)
    )
    if others and not force:
        raise UsageError(
            f"{dst}: the suffix names format {', '.join(map(repr, others))}, not "
            f"{target.name!r}; pass --force to write {target.name} there anyway"
        )


@contextmanager
def _activity(
    args: argparse.Namespace, description: str, *paths: str, counters: bool = True
) -> Iterator[None]:
    """The progress display for work on the checkpoints at ``paths`` (see `pytreeio.progress`)."""
    if args.quiet:
        yield
        return
    size = sum(progress.path_size(p) for p in paths)
    with progress.activity(description, size, counters=counters):
        yield


def _short(path: str) -> str:
    """A path's last component, for the one-line progress display."""
    return Path(path).name or path


# --- commands ---


def _options_line(fmt: Format, direction: str) -> str:
    """``fmt``'s options in ``direction``, with the defaults of the functions that take them."""
    save = direction == "save"
    funcs = (fmt.encode, fmt.from_model) if save else (fmt.decode, fmt.restore, fmt.to_model)
    signatures = [_inspect.signature(fn).parameters for fn in funcs if fn is not None]
    parts = []
    for name in sorted(fmt.save_options if save else fmt.load_options):
        found = [sig[name].default for sig in signatures if name in sig]
        text = repr(found[0]) if found else ""
        empty = not found or found[0] is _inspect.Parameter.empty or len(text) > 30
        parts.append(name if empty else f"{name}={text}")
    return ", ".join(parts) or "none"


def _cmd_formats(args: argparse.Namespace) -> int:
    fmts = api.list_formats()
    if args.json:
        doc = {
            n: {
                "layout": f.layout.kind,
                "suffixes": list(f.suffixes),
                "description": f.description,
                "accepts_meta": f.accepts_meta,
                "keeps_meta": f.keeps_meta,
                "model_format": f.is_model_format,
                "save_options": sorted(f.save_options),
                "load_options": sorted(f.load_options),
            }
            for n, f in fmts.items()
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    if args.quiet:
        return EXIT_OK
    w = max(len(n) for n in fmts)
    for name, f in sorted(fmts.items()):
        suffixes = " ".join(f.suffixes) or "-"
        print(f"{name:<{w}}  {f.layout.kind:<8}  {suffixes:<20}  {f.description}")
        print(f"{'':<{w}}  save options: {_options_line(f, 'save')}")
        print(f"{'':<{w}}  load options: {_options_line(f, 'load')}")
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = resolve_path(args.path, args.format)
    info = api.inspect(path, format=args.format)
    if args.json:
        print(_dumps(info.to_json()))
    elif not args.quiet:
        print(info)
    return EXIT_OK


def _quantisation_summary(report: Any) -> str | None:
    if not isinstance(report, Mapping) or not report:
        return None
    try:
        worst = max(report, key=lambda k: float(report[k]))
        return f"quantisation error: largest {float(report[worst]):.6g} ({worst})"
    except (TypeError, ValueError):
        return f"quantisation error: {json.dumps(report, default=_json_default)}"


def _cmd_verify(args: argparse.Namespace) -> int:
    opts = parse_opts(args.opt)
    try:
        path = resolve_path(args.path, args.format)
        with _activity(args, f"verifying {_short(path)}", path):
            info = _with_options(lambda: api.verify(path, format=args.format, **opts), opts)
    except (PytreeioError, OSError) as exc:
        if args.json:  # still a document on stdout for pipelines; the error line goes to stderr
            print(_dumps({"ok": False, "path": args.path, "error": error_line(exc)}))
        raise
    if args.json:
        print(_dumps({"ok": True, **info.to_json()}))
    elif not args.quiet:
        print(
            f"{info.path}: OK ({info.format}, {len(info.entries)} entries, "
            f"{info.nbytes:,d} tensor bytes)"
        )
        summary = _quantisation_summary(info.meta.get("quantisation_error"))
        if summary:
            print(f"  {summary}")
        nonfinite = info.meta.get("nonfinite")
        if isinstance(nonfinite, Mapping):
            for entry, counts in nonfinite.items():
                print(
                    f"  non-finite: {entry}: {counts.get('nan', 0)} NaN, {counts.get('inf', 0)} inf"
                )
    return EXIT_OK


def _cmd_checksum(args: argparse.Namespace) -> int:
    from pytreeio import integrity

    path = resolve_path(args.path, args.format)
    where = integrity.write_manifest(path, format=args.format)
    if not args.quiet:
        print(f"{where}: written")
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    target = registry.get(args.to, path=args.dst)
    _check_suffix(args.dst, target, args.force)
    meta = parse_meta(args.meta)
    opts = parse_opts(args.opt)
    src = resolve_path(args.src, args.from_)
    with _activity(args, f"converting {_short(src)} to {target.name}", src):
        _with_options(
            lambda: api.convert(
                src,
                args.dst,
                to=target,
                from_=args.from_,
                meta=meta,
                lossy=args.lossy,
                durable=not args.no_fsync,
                **opts,
            ),
            opts,
        )
    if not args.quiet:
        info = api.inspect(args.dst, format=target)
        print(
            f"{src} -> {args.dst} ({info.format}, {len(info.entries)} entries, "
            f"{info.nbytes:,d} tensor bytes)"
        )
    return EXIT_OK


def _cmd_diff(args: argparse.Namespace) -> int:
    from pytreeio.diff import diff

    fmt_a = args.format_a or args.format
    fmt_b = args.format_b or args.format
    a, b = resolve_path(args.a, fmt_a), resolve_path(args.b, fmt_b)
    # diff maps the files: the read counters would not see those bytes
    with _activity(args, f"comparing {_short(a)} and {_short(b)}", a, b, counters=False):
        report = diff(
            a,
            b,
            format_a=fmt_a,
            format_b=fmt_b,
            atol=args.atol,
            rtol=args.rtol,
            through_model=args.through_model,
        )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    elif not args.quiet:
        print(report.text(every_entry=args.all))
    return EXIT_OK if report.ok else EXIT_ERROR


def _cmd_demo(args: argparse.Namespace) -> int:
    from pytreeio.demo import run_demo

    return run_demo(args.dir, steps=args.steps)


# --- the parser ---


def _format_list() -> str:
    fmts = registry.formats()
    w = max((len(n) for n in fmts), default=0)
    lines = [f"  {name:<{w}}  {f.description}" for name, f in sorted(fmts.items())]
    return "formats (`pytreeio formats` lists their suffixes and options):\n" + "\n".join(lines)


_EXIT = "exit status: 0 ok, 1 error (diff: the checkpoints differ), 2 usage error"
_OPT_HELP = (
    "(repeatable); VALUE is parsed as JSON when it parses, else taken as a string; @FILE "
    "reads it from a file. `pytreeio formats` lists each format's options"
)


def _para(text: str) -> str:
    """``text`` wrapped for a help screen (descriptions are printed as given)."""
    return textwrap.fill(" ".join(text.split()), width=79)


class _Parser(argparse.ArgumentParser):
    """A parser whose help ends with the formats, listed when the help is shown, then
    ``after_formats``: listing reads the installed plug-ins, which a command need not."""

    def __init__(self, *args: Any, after_formats: str = _EXIT, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.after_formats = after_formats

    def format_help(self) -> str:
        self.epilog = f"{_format_list()}\n\n{self.after_formats}"
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    names = "`pytreeio formats` lists them"
    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="pytreeio",
        description=_para(
            "Read, write, inspect, verify, convert and compare checkpoints as JAX pytrees."
        ),
        formatter_class=raw,
    )
    parser.add_argument("--version", action="version", version=f"pytreeio {__version__}")
    # --debug and --quiet are also accepted after the command (`pytreeio verify x --debug`).
    common = _Parser(add_help=False)
    for where, default in ((parser, False), (common, argparse.SUPPRESS)):
        where.add_argument(
            "--debug",
            action="store_true",
            default=default,
            help="show the traceback of an error instead of one line",
        )
        where.add_argument(
            "-q",
            "--quiet",
            action="store_true",
            default=default,
            help="print nothing but errors (and --json output)",
        )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str,
        func: Callable[[argparse.Namespace], int],
        summary: str,
        description: str,
        *,
        path: bool = False,
        after_formats: str = _EXIT,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            parents=[common],
            formatter_class=raw,
            help=summary,
            description=_para(description),
            after_formats=after_formats,
        )
        p.set_defaults(func=func, parser=p)
        if path:
            p.add_argument("path", metavar="PATH", help="the checkpoint: file, directory or stem")
            p.add_argument(
                "--format",
                metavar="NAME",
                help=f"its format (default: sniffed from the content): {names}",
            )
        return p

    def add_opt(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument(
            "--opt", action="append", metavar="NAME=VALUE", default=[], help=what + _OPT_HELP
        )

    p = add(
        "formats",
        _cmd_formats,
        "list the registered formats with their save and load options",
        "List the registered formats: layout, suffixes, description, and the options `--opt` "
        "passes when saving (convert's target) and loading (verify, convert's source).",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = add(
        "inspect",
        _cmd_inspect,
        "show a checkpoint's entries and meta (reads headers only)",
        "Show a checkpoint's entries (name, shape, dtype, bytes) and meta, reading headers only. "
        "PATH is a file, a directory (waffe2, bullet) or a sibling-file stem (netcl-checkpoint's "
        "`ckpt` for ckpt.npz + ckpt.json; either file works too).",
        path=True,
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = add(
        "verify",
        _cmd_verify,
        "decode a whole checkpoint, checking every byte",
        "Decode a whole checkpoint, checking every byte, and report its entries. Checksums are "
        "checked (pytreeio's per-tensor safetensors checksums, and the manifest `pytreeio "
        "checksum` writes, when present); NaNs and infinities of floating entries are reported. "
        "Formats that can check derived data report it (bullet with --opt saved_format=[...]: "
        "the largest quantisation error per tensor).",
        path=True,
    )
    add_opt(p, "a load option of the checkpoint's format ")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the checkpoint's info as JSON with \"ok\" (and the format's report)",
    )

    add(
        "checksum",
        _cmd_checksum,
        "write a checksum manifest that `verify` checks",
        "Record the size and xxh3_64 checksum of every file of the checkpoint in a sidecar "
        "manifest the original systems ignore: <file>.pytreeio-sum.json next to a single file, "
        "pytreeio-sum.json inside a directory (the next save of a directory checkpoint drops "
        "it). `pytreeio verify` and load(..., verify=True) check it and name the file that "
        "changed.",
        path=True,
    )

    p = add(
        "convert",
        _cmd_convert,
        "re-encode a checkpoint in another format",
        "Re-encode the checkpoint SRC as format --to at DST (written atomically). Between model "
        "formats it goes through the common model form; what the target cannot hold is an "
        "error unless --lossy.",
    )
    p.add_argument("src", metavar="SRC", help="the checkpoint to read: file, directory or stem")
    p.add_argument("dst", metavar="DST", help="where to write (a file, directory or stem)")
    p.add_argument("--to", required=True, metavar="NAME", help=f"the target format: {names}")
    p.add_argument(
        "--from",
        dest="from_",
        metavar="NAME",
        help="the source format (default: sniffed from the content)",
    )
    p.add_argument(
        "--meta",
        metavar="JSON|@FILE",
        help="the target's meta as a JSON object (or @FILE holding one), instead of the source's",
    )
    add_opt(p, "a load option of the source's format or a save option of the target's; ")
    p.add_argument(
        "--lossy",
        action="store_true",
        help="drop what the target cannot hold (printed as warnings) instead of failing",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write even when DST's suffix names another format than --to",
    )
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (keeps the atomic rename)")

    p = add(
        "diff",
        _cmd_diff,
        "compare two checkpoints (any formats), entry by entry",
        "Compare two checkpoints entry by entry: entries missing on either side, shape and "
        "dtype differences, elements that differ, largest absolute and relative difference, "
        "and a one-line verdict (identical / equal within tolerance / different). Checkpoints "
        "of two different model formats are compared through the common model form (keys "
        "layers[0].kernel, opt.mu[0], opt.count); others by flattened key path. With no "
        "tolerance, entries must be bit-identical (NaN payloads included).",
        after_formats="exit status: 0 identical (or equal within the tolerance "
        "given), 1 different or an error, 2 usage error",
    )
    p.add_argument("a", metavar="A", help="the first checkpoint: file, directory or stem")
    p.add_argument("b", metavar="B", help="the second checkpoint")
    p.add_argument("--format", metavar="NAME", help="the format of both (default: sniffed)")
    p.add_argument("--format-a", metavar="NAME", help="the format of A (default: --format)")
    p.add_argument("--format-b", metavar="NAME", help="the format of B (default: --format)")
    p.add_argument(
        "--atol",
        type=_tolerance,
        default=0.0,
        metavar="X",
        help="absolute tolerance: |a-b| <= atol + rtol*max(|a|,|b|) passes (default 0)",
    )
    p.add_argument(
        "--rtol", type=_tolerance, default=0.0, metavar="X", help="relative tolerance (default 0)"
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--model",
        dest="through_model",
        action="store_const",
        const=True,
        default=None,
        help="compare through the common model form (default: for two different model formats)",
    )
    how.add_argument(
        "--native",
        dest="through_model",
        action="store_const",
        const=False,
        help="compare the native trees by key path",
    )
    p.add_argument("--all", action="store_true", help="list identical entries too")
    p.add_argument("--json", action="store_true", help="machine-readable report")

    p = add(
        "demo",
        _cmd_demo,
        "train a small Flax model, checkpoint it in every format, convert, resume",
        "Train a small Flax MLP with optax, checkpoint it in every format, convert it along a "
        "chain of formats and resume training from a foreign checkpoint.",
    )
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=20,
        help="training steps before and after the checkpoint (at least 1)",
    )
    return parser


# --- errors and warnings ---


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
    elif isinstance(exc, PytreeioError | OSError | ValueError | TypeError):
        msg = str(exc) or type(exc).__name__
    else:
        msg = f"{type(exc).__name__}: {exc} (--debug shows the traceback)"
    return " ".join(msg.split()) if "\n" in msg or "\r" in msg else msg


@contextmanager
def _warnings_as_lines(quiet: bool) -> Iterator[None]:
    """Print each warning once as ``pytreeio: warning: ...`` (nothing under ``--quiet``)."""
    seen: set[str] = set()

    def show(message: Warning | str, category: type[Warning], *where: Any, **_: Any) -> None:
        if quiet or issubclass(category, DeprecationWarning | PendingDeprecationWarning):
            return
        text = " ".join(str(message).split())
        if not issubclass(category, PytreeioWarning):
            text += f" ({category.__name__})"
        if text in seen:
            return
        seen.add(text)
        print(f"pytreeio: warning: {text}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always", PytreeioWarning)
        warnings.showwarning = show
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (argparse usage errors exit with 2)."""
    parser = build_parser()
    with _warnings_as_lines(False):  # --help lists the formats: a broken plug-in warns
        args = parser.parse_args(argv)
    with _warnings_as_lines(args.quiet):
        try:
            return int(args.func(args))
        except BrokenPipeError:  # output piped into `head` and friends
            sys.stderr.close()
            return EXIT_OK
        except UsageError as exc:
            command: argparse.ArgumentParser = getattr(args, "parser", parser)
            command.error(str(exc))  # exits with status 2
        except KeyboardInterrupt:
            if args.debug:
                raise
            print("pytreeio: error: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:
            if args.debug:
                raise
            print(f"pytreeio: error: {error_line(exc)}", file=sys.stderr)
            return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
