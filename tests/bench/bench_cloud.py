"""Saves and loads at ``s3://`` URLs against s3fs moving the same bytes (not a test).

``python tests/bench/bench_cloud.py [--mb 512] [--repeats 3] [--formats LIST] [--dir DIR]
[--json PATH]`` (or ``nox -s bench -- cloud --mb 16 --repeats 1``, a smoke run) starts a moto
S3 server in a subprocess on 127.0.0.1 (``tests/cloud_server.py``) and measures in this
process, after a warm-up round, ``--repeats`` rounds interleaved (format after format, and in
each the raw transfer and pytreeio alternate which goes first):

* save: ``ptio.save(url, tree, storage_options=...)`` of a tree of ``--mb`` MB (8 layers of a
  square float32 kernel and a bias, ``cases.mlp_tree``), over the previous round's
  checkpoint, against s3fs ``pipe`` of the files a local save of the same format writes,
  each file one object;
* load: ``ptio.load(url, format=..., storage_options=...)`` against s3fs ``cat`` of those
  objects;
* one tensor through ``ptio.open`` (open, read the tensor, close): the largest and the
  smallest tensor, from the local file and from its S3 object: time, and the bytes moved
  (local: ``rchar`` of read calls; S3: the bytes of s3fs's ``get_object`` responses).

Ratios are raw time / pytreeio time: 1.00x is as fast as s3fs alone moving the same bytes.
moto is a Python server on loopback, so absolute throughput says little about a real
object store; the ratios say what pytreeio adds to the transfer.  Prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests/: the S3 server

import cases as C  # noqa: E402
import rawio  # noqa: E402
import report  # noqa: E402
from cloud_server import MotoServer, create_bucket, options_for  # noqa: E402

import pytreeio as ptio  # noqa: E402

LAYERS = 8
BUCKET = "pytreeio-bench"
DEFAULT_FORMATS = "safetensors,msgpack,waffe2"
#: The formats whose lazy views read one tensor's bytes (``slots``) and that are one file.
OPEN_FORMATS = ("safetensors", "msgpack")
#: One tensor: from the local file, from the S3 object, and a raw ranged GET of its size.
SIDES = ("local", "s3", "raw")


def _log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def s3_requests() -> Iterator[list[tuple[str, int]]]:
    """Every request s3fs makes within the block: (method, bytes of a ``get_object`` body)."""
    import s3fs

    calls: list[tuple[str, int]] = []
    original = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await original(self, method, *args, **kwargs)
        n = int(out.get("ContentLength", 0)) if method == "get_object" else 0
        calls.append((method, n))
        return out

    s3fs.S3FileSystem._call_s3 = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        s3fs.S3FileSystem._call_s3 = original  # type: ignore[method-assign]


def rchar() -> int:
    """Bytes this process has read with read calls (``/proc/self/io``), or 0 elsewhere."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Run:
    """The server, the file system, the cases and the timings of one run."""

    def __init__(self, args: argparse.Namespace, endpoint: str, work: Path) -> None:
        import fsspec

        self.args = args
        self.options = options_for(endpoint)
        self.fs = fsspec.filesystem("s3", **self.options)
        self.work = work
        self.t0 = time.monotonic()
        wanted = args.formats.split(",")
        self.cases = [c for c in C.format_cases(LAYERS) if c.format in wanted]
        unknown = set(wanted) - {c.format for c in self.cases}
        if unknown:
            raise SystemExit(f"unknown --formats: {sorted(unknown)}")
        self.tree = C.mlp_tree(args.mb << 20, LAYERS)
        self.nbytes = C.tree_nbytes(self.tree)
        self.times: dict[tuple[str, str, str], list[float]] = {}
        self.errors: dict[str, str] = {}
        self.files: dict[str, rawio.FileSet] = {}

    def url(self, case: C.FormatCase, side: str, rel: str | None = None) -> str:
        return f"s3://{BUCKET}/{side}/{case.name}/{rel if rel is not None else case.dest}"

    def local(self, case: C.FormatCase) -> Path:
        return self.work / case.name / case.dest

    def save_kwargs(self, case: C.FormatCase) -> dict[str, Any]:
        return C.save_kwargs(case, {"mlp": self.tree}, {})

    def prepare(self) -> None:
        """Each format saved locally once: the file set the raw transfers move."""
        for case in self.cases:
            dest = self.local(case)
            dest.parent.mkdir(parents=True)
            ptio.save(dest, self.tree, durable=False, **self.save_kwargs(case))
            self.files[case.name] = rawio.file_set(dest.parent)

    def payload(self, case: C.FormatCase) -> dict[str, bytes]:
        root = self.work / case.name
        return {
            self.url(case, "raw", rel): (root / rel).read_bytes()
            for rel, _ in self.files[case.name]
        }

    # -- the timed calls ------------------------------------------------------
    def timed(self, key: tuple[str, str, str], fn: Callable[[], Any], record: bool) -> None:
        where = " ".join(key)
        if where in self.errors:
            return
        try:
            t0 = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t0
            del out
        except Exception as exc:
            self.errors[where] = f"{type(exc).__name__}: {str(exc)[:300]}"
            _log(self.t0, f"  {where}: {self.errors[where]}")
            return
        if record:
            self.times.setdefault(key, []).append(seconds)

    def save(self, url: str, kw: dict[str, Any]) -> None:
        ptio.save(url, self.tree, storage_options=self.options, **kw)

    def load(self, url: str, fmt: str) -> Any:
        return ptio.load(url, format=fmt, storage_options=self.options)

    def round(self, number: int, record: bool) -> None:
        for case in self.cases:
            kw = self.save_kwargs(case)
            url = self.url(case, "ptio")
            data = self.payload(case)  # read before the clock starts
            sides: list[tuple[str, Callable[[], Any]]] = [
                ("raw", partial(self.fs.pipe, data)),
                ("pytreeio", partial(self.save, url, kw)),
            ]
            for side, fn in sides if number % 2 == 0 else sides[::-1]:
                self.timed((case.name, "save", side), fn, record)
            del data, sides, fn  # the payload is not held through the loads
            raw_urls = [self.url(case, "raw", rel) for rel, _ in self.files[case.name]]
            loads: list[tuple[str, Callable[[], Any]]] = [
                ("raw", partial(self.fs.cat, raw_urls)),
                ("pytreeio", partial(self.load, url, case.format)),
            ]
            for side, fn in loads if number % 2 == 0 else loads[::-1]:
                self.timed((case.name, "load", side), fn, record)

    def opens(self) -> list[dict[str, Any]]:
        """One tensor (the largest, the smallest) through ``ptio.open``, local and on S3."""
        rows = []
        for case in self.cases:
            if case.format not in OPEN_FORMATS or f"{case.name} save pytreeio" in self.errors:
                continue
            local, url = self.local(case), self.url(case, "ptio")
            entries = sorted(ptio.inspect(local).entries, key=lambda e: e.nbytes)
            for entry in (entries[-1], entries[0]):
                row: dict[str, Any] = {
                    "case": case.name,
                    "format": case.format,
                    "tensor": entry.name,
                    "nbytes": entry.nbytes,
                }
                for side in SIDES:
                    row[side] = {"seconds": [], "moved": 0, "gets": 0, "requests": 0}
                for number in range(self.args.repeats + 1):  # the first: a warm-up
                    for side in SIDES if number % 2 == 0 else SIDES[::-1]:
                        if "error" in row[side]:
                            continue
                        where = local if side == "local" else url
                        try:
                            self.open_one(row, side, where, record=number > 0)
                        except Exception as exc:
                            row[side]["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(row)
        return rows

    def open_one(self, row: dict[str, Any], side: str, where: Any, record: bool) -> None:
        """``ptio.open(where)[tensor]``; ``raw``: one ranged GET of as many bytes instead."""
        kw = {} if side == "local" else {"storage_options": self.options}
        before = rchar()
        with s3_requests() as calls:
            t0 = time.perf_counter()
            if side == "raw":
                got = len(self.fs.cat_file(where, start=0, end=row["nbytes"]))
            else:
                with ptio.open(where, format=row["format"], **kw) as ck:
                    got = ck[row["tensor"]].nbytes
            seconds = time.perf_counter() - t0
        assert got == row["nbytes"], (got, row)
        if record:
            row[side]["seconds"].append(seconds)
            row[side]["moved"] = rchar() - before if side == "local" else sum(n for _, n in calls)
            row[side]["gets"] = sum(method == "get_object" for method, _ in calls)
            row[side]["requests"] = len(calls)

    def stored(self, case: C.FormatCase) -> tuple[int, int]:
        """(objects, bytes) under the format's pytreeio prefix."""
        self.fs.invalidate_cache()
        found = self.fs.find(f"s3://{BUCKET}/ptio/{case.name}", detail=True)
        return len(found), sum(int(v.get("size", 0)) for v in found.values())


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _ms(values: list[float]) -> str:
    if not values:
        return "error"
    return f"{min(values) * 1e3:.0f} ({statistics.median(values) * 1e3:.0f})"


def _ratio(raw: list[float], ours: list[float]) -> str:
    if not raw or not ours:
        return ""
    return f"{min(raw) / min(ours):.2f}x ({statistics.median(raw) / statistics.median(ours):.2f}x)"


def markdown(run: Run, results: dict[str, Any]) -> str:
    m = results["machine"]
    versions = ", ".join(f"{d} {v}" for d, v in results["versions"].items())
    lines = [
        f"Run of {m['date']}: {m['cpu']}, nproc {m['nproc']}; Python {m['python']}, "
        f"numpy {m['numpy']}, jax {m['jax']}; {versions}; load average {m['loadavg_start']} "
        f"at the start, {m.get('loadavg_end')} at the end; {results['seconds'] / 60:.1f} minutes.",
        "",
        f"Conditions: a moto S3 server (`python -m moto.server`, one subprocess) on 127.0.0.1, "
        f"s3fs with its default options; tree {run.nbytes / 1e6:.0f} MB float32 ({LAYERS} layers "
        f"of a square kernel and a bias); one process; a warm-up round, then "
        f"{run.args.repeats} rounds interleaved (format after format; raw and pytreeio "
        "alternate which goes first); times are best (median) in ms; ratios are raw time / "
        "pytreeio time (higher is better). **Raw save**: s3fs `pipe` of the files a local save "
        "of the format writes, one object each, from bytes in memory; **raw load**: s3fs `cat` "
        "of those objects into bytes. pytreeio saves over the previous round's checkpoint "
        "(default `durable=True`) and loads without `like`; its objects (directory formats: "
        "a version and a commit object) are counted after the last round.",
        "",
        "### Saves and loads at s3:// URLs",
        "",
        "| case | op | MB | raw objects | pytreeio objects (MB) | raw ms | pytreeio ms "
        "| raw / pytreeio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["transfers"]:
        lines.append(
            f"| {r['case']} | {r['op']} | {r['bytes'] / 1e6:.0f} | {r['raw_objects']} | "
            f"{r['objects']} ({r['stored'] / 1e6:.0f}) | {_ms(r['raw'])} | {_ms(r['pytreeio'])} | "
            f"{_ratio(r['raw'], r['pytreeio'])} |"
        )
    lines += [
        "",
        "### One tensor through `ptio.open` (open, read the tensor, close)",
        "",
        "Moved: local, bytes of read calls (`rchar`; a mapped read counts 0); S3, bytes of "
        "the `get_object` responses (requests: GETs / all S3 calls). **Raw GET**: one ranged GET of as many "
        "bytes from the same object (s3fs `cat_file`); raw / S3 is its time over the S3 view's.",
        "",
        "| case | tensor | size | local ms | local moved | S3 ms | S3 requests | S3 moved "
        "| raw GET ms | raw / S3 | S3 / local time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["opens"]:
        loc, s3, raw = r["local"], r["s3"], r["raw"]
        slower = (
            f"{min(s3['seconds']) / min(loc['seconds']):.0f}x"
            if s3["seconds"] and loc["seconds"]
            else ""
        )
        lines.append(
            f"| {r['case']} | `{r['tensor']}` | {_size(r['nbytes'])} | {_ms(loc['seconds'])} | "
            f"{_size(loc['moved'])} | {_ms(s3['seconds'])} | {s3['gets']} / {s3['requests']} | "
            f"{_size(s3['moved'])} | {_ms(raw['seconds'])} | "
            f"{_ratio(raw['seconds'], s3['seconds'])} | {slower} |"
        )
    errors = list(results["errors"].items()) + [
        (f"{r['case']} open {r['tensor']} {side}", r[side]["error"])
        for r in results["opens"]
        for side in SIDES
        if "error" in r[side]
    ]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {where}: {msg}" for where, msg in errors]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=512, help="tree size in MB (default 512)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument(
        "--formats", default=DEFAULT_FORMATS, help=f"comma-separated (default {DEFAULT_FORMATS})"
    )
    p.add_argument("--dir", help="scratch directory (default: the system's temporary one)")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    work = Path(tempfile.mkdtemp(prefix="pytreeio-bench-cloud-", dir=args.dir))
    try:
        with MotoServer() as server:
            create_bucket(server.endpoint, BUCKET)
            run = Run(args, server.endpoint, work)
            results: dict[str, Any] = {
                "machine": report.machine(work),
                "versions": {d: _version(d) for d in ("s3fs", "fsspec", "aiobotocore", "moto")},
                "config": {"mb": args.mb, "repeats": args.repeats, "formats": args.formats},
            }
            _log(run.t0, f"server {server.endpoint}; tree {run.nbytes / 1e6:.0f} MB; {work}")
            run.prepare()
            for number in range(args.repeats + 1):
                _log(run.t0, "warm-up round" if number == 0 else f"round {number}")
                run.round(number, record=number > 0)
            transfers = []
            for case in run.cases:
                objects, stored = run.stored(case)
                for op in ("save", "load"):
                    transfers.append(
                        {
                            "case": case.name,
                            "op": op,
                            "bytes": sum(size for _, size in run.files[case.name]),
                            "raw_objects": len(run.files[case.name]),
                            "objects": objects,
                            "stored": stored,
                            "raw": run.times.get((case.name, op, "raw"), []),
                            "pytreeio": run.times.get((case.name, op, "pytreeio"), []),
                        }
                    )
            _log(run.t0, "one tensor through ptio.open")
            results |= {
                "transfers": transfers,
                "opens": run.opens(),
                "errors": run.errors,
                "seconds": time.monotonic() - run.t0,
            }
            results["machine"]["loadavg_end"] = report.loadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    md = markdown(run, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(md)
    results["markdown"] = md
    return results


if __name__ == "__main__":
    out = main()
    failed = out["errors"] or any("error" in r[s] for r in out["opens"] for s in SIDES)
    sys.exit(1 if failed else 0)
