"""The benchmark suite: cold loads, saves, first-load cost per tensor and peak memory.

Run with ``nox -s bench`` or ``python tests/bench/bench_all.py [--size MB]
[--rounds R] [--leaves N] [--only REGEX] [--old DIR] [--out DIR] [--dir DIR]
[--quick]``.  Not a test: it prints a markdown table with PASS/MISS per target
and writes ``latest.json`` and ``latest.md`` into ``--out``.

Every load is the first load of a file in a fresh process (``child.py``:
numpy, jax and pytreeio imported, bytecode cached, then one ``pytreeio.load``
timed), with the file in the page cache and with the page cache dropped,
against raw reads of the same bytes into fresh numpy arrays, also each in a
fresh process.  ``--old DIR`` names a checkout of another version (today's
code): its side runs with ``PYTHONPATH=DIR``, the new side with this working
tree, and each row shows both.  Rounds are interleaved (raw reads, old, new,
the next case, ...); best and median of the rounds are reported.

Sections: cold loads of every format (a tree of ``--size`` MB: 32 layers of a
square float32 kernel and a bias; Tiny Llama a model of about the same bytes)
and of the peers (safetensors.numpy, flax.serialization, orbax where
installed); saves against a raw write of the same files; the first load of a
tree of ``--leaves`` small tensors, in µs per tensor, against
safetensors.numpy's (cl-waffe2 against reading a file per tensor); the peak
memory of the loads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402
import peers as P  # noqa: E402
import rawio  # noqa: E402
import report  # noqa: E402

DEFAULT_OUT = HERE / "results"
#: Formats whose durable (default) saves are also timed, against write + fsync.
DURABLE = ("msgpack", "safetensors")
#: Formats whose first load per tensor must be no slower than safetensors.numpy's.
FAST_PER_TENSOR = ("msgpack", "safetensors", "tinyllama")
TARGETS = {
    "file": 0.85,  # x best raw read: single-file loads
    "multi": 0.75,  # directories and sibling files
    "npz": 0.6,  # npz formats, members' CRC-32 checked
    "save": 0.9,  # x raw write of the same files
    "memory_slack": 64 << 20,  # peak added <= tree + 64 MB
    "per_tensor": 3.0,  # x safetensors.numpy (FAST_PER_TENSOR: 1.0; waffe2: x raw floor)
}


def load_target(case: C.FormatCase) -> float:
    t = TARGETS["file"] if case.layout == "file" else TARGETS["multi"]
    return min(t, TARGETS["npz"]) if case.npz else t


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.only = re.compile(args.only) if args.only else None
        self.sides = ([("old", Path(args.old).resolve())] if args.old else []) + [("new", REPO)]
        self.work = Path(tempfile.mkdtemp(prefix="pytreeio-bench-", dir=args.dir))
        self.cases = [c for c in C.format_cases(args.layers) if self.wanted(c.name)]
        self.peers = [p for p in P.available() if self.wanted(p.name)]
        if args.quick:
            self.peers = [p for p in self.peers if p.name == "safetensors.numpy"]
        self.errors: list[str] = []
        self.t0 = time.monotonic()

    def wanted(self, name: str) -> bool:
        return self.only is None or bool(self.only.search(name))

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    def child(self, spec: dict[str, Any], side: Path | None = None) -> dict[str, Any]:
        """``child.py`` in a fresh interpreter (``side``: its checkout on ``PYTHONPATH``)."""
        # bytecode cached outside the checkouts (a .pyc is checked against its source's mtime)
        drop = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tempfile.gettempdir()) / "pytreeio-bench-pycache")
        if side is not None:
            env["PYTHONPATH"] = str(side)
        try:
            proc = subprocess.run(
                [sys.executable, str(HERE / "child.py"), json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=self.args.timeout,
                cwd=HERE,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {self.args.timeout} s"}
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"error": f"exit {proc.returncode}: {tail[0][:300]}"}
        out: dict[str, Any] = json.loads(lines[-1])
        return out

    def error(self, where: str, result: dict[str, Any]) -> bool:
        if "error" in result:
            self.errors.append(f"{where}: {result['error']}")
            self.log(f"  {where}: {result['error']}")
            return True
        return False

    def warm(self, kind: str) -> None:
        """Every file of ``work/kind`` read once: in the page cache for the warm rounds."""
        for p in (self.work / kind).rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    while f.read(16 << 20):
                        pass


def can_drop() -> str | None:
    """None if the page cache can be dropped here, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def prepare(b: Bench) -> dict[str, Any]:
    """Save every checkpoint the loads read (the new side; a case it fails, the old side)."""
    spec = {
        "op": "prepare",
        "work": str(b.work),
        "size": b.args.size_bytes,
        "layers": b.args.layers,
        "leaves": b.args.leaves,
        "cases": [c.name for c in b.cases],
        "peers": [p.name for p in b.peers],
    }
    files = b.child(spec, REPO)
    if b.error("prepare (new)", files):
        files = {"load": {}, "leaves": {}}
    failed = [n for kind in files.values() for n, e in kind.items() if "error" in e]
    failed = sorted(set(failed) | {c.name for c in b.cases if c.name not in files["load"]})
    if failed:
        b.errors += [
            f"{k} {n}: new side could not save: {e['error']}"
            for k, kind in files.items()
            for n, e in kind.items()
            if "error" in e
        ]
        old = next((d for s, d in b.sides if s == "old"), None)
        if old is not None:
            again = b.child({**spec, "cases": failed, "with_peers": False}, old)
            if not b.error("prepare (old)", again):
                for kind in files:
                    files[kind] |= {n: e for n, e in again[kind].items() if "error" not in e}
    for kind in files.values():
        for n in [n for n, e in kind.items() if "error" in e]:
            del kind[n]
    return files


def warm_up(b: Bench, files: dict[str, Any]) -> None:
    """Per side, untimed: compile its package and load every small file once (bytecode cached)."""
    loads = [
        (str(b.work / "leaves" / c.name / c.dest), c.format, c.load_options)
        for c in b.cases
        if c.name in files["leaves"]
    ]
    peers = []
    for p in b.peers:
        small, full = (b.work / kind / f"peer {p.name}" / p.dest for kind in ("leaves", "load"))
        peers += [(p.name, str(small if small.exists() else full))]
    for side, d in b.sides:
        b.log(f"warm-up: {side}")
        b.error(f"warm-up {side}", b.child({"op": "warmup", "loads": loads, "peers": peers}, d))


def cold_loads(b: Bench, files: dict[str, Any], conds: list[str]) -> dict[str, Any]:
    """{case: {cond: {who: [run, ...]}}}: raw reads, then each side's (or the peer's) load."""
    data: dict[str, Any] = {}
    items: list[tuple[str, Any]] = [(c.name, c) for c in b.cases if c.name in files["load"]]
    items += [(f"peer {p.name}", p) for p in b.peers if f"peer {p.name}" in files["load"]]
    for r in range(b.args.rounds):
        for cond in conds:
            if cond == "warm":
                b.warm("load")
            b.log(f"cold loads: round {r + 1}/{b.args.rounds}, page cache {cond}")
            drop = cond == "dropped"
            for name, item in items:
                root = b.work / "load" / name
                runs = data.setdefault(name, {}).setdefault(cond, {})
                for read in rawio.READS:
                    spec = {"op": "raw", "read": read, "root": str(root), "drop": drop}
                    res = b.child({**spec, "files": files["load"][name]["read_files"]})
                    if not b.error(f"{name} {read} ({cond})", res):
                        runs.setdefault(read, []).append(res)
                if isinstance(item, P.Peer):
                    spec = {"op": "peer", "peer": item.name, "path": str(root / item.dest)}
                    who = [("peer", None)]
                else:
                    spec = {"op": "load", "format": item.format, "options": item.load_options}
                    spec["path"] = str(root / item.dest)
                    who = b.sides
                for side, d in who:
                    res = b.child({**spec, "drop": drop}, d)
                    if not b.error(f"{name} load {side} ({cond})", res):
                        runs.setdefault(side, []).append(res)
    return data


def per_tensor(b: Bench, files: dict[str, Any]) -> dict[str, Any]:
    """{case: {who: [run, ...]}}: the first load of the many-tensor tree, page cache warm."""
    data: dict[str, Any] = {}
    names = [c for c in b.cases if c.name in files["leaves"]]
    for r in range(b.args.rounds):
        b.warm("leaves")
        b.log(f"first load per tensor: round {r + 1}/{b.args.rounds}")
        for case in names:
            path = b.work / "leaves" / case.name / case.dest
            spec = {"op": "load", "format": case.format, "options": case.load_options}
            for side, d in b.sides:
                res = b.child({**spec, "path": str(path)}, d)
                if not b.error(f"{case.name} first load {side}", res):
                    data.setdefault(case.name, {}).setdefault(side, []).append(res)
        ref = "peer safetensors.numpy"
        if ref in files["leaves"]:
            path = b.work / "leaves" / ref / "tree.safetensors"
            res = b.child({"op": "peer", "peer": "safetensors.numpy", "path": str(path)})
            if not b.error(f"{ref} first load", res):
                data.setdefault(ref, {}).setdefault("peer", []).append(res)
        floor = b.work / "leaves" / "raw file per tensor"
        if floor.exists() and any(c.name == "waffe2" for c in names):
            res = b.child({"op": "rawdir", "root": str(floor)})
            if not b.error("raw file per tensor", res):
                data.setdefault("raw file per tensor", {}).setdefault("raw", []).append(res)
    return data


def saves(b: Bench) -> dict[str, Any]:
    """{case: {side: [{save, raw, bytes}, ...]}}: one child per side and round, sides alternating."""
    data: dict[str, Any] = {}
    spec = {
        "op": "saves",
        "work": str(b.work / "saves"),
        "size": b.args.size_bytes,
        "layers": b.args.layers,
        "cases": [c.name for c in b.cases],
        "durable": [n for n in DURABLE if b.wanted(n)],
    }
    for r in range(b.args.rounds):
        b.log(f"saves: round {r + 1}/{b.args.rounds}")
        for side, d in b.sides:
            res = b.child(spec, d)
            if b.error(f"saves {side}", res):
                continue
            for name, run in res.items():
                if not b.error(f"save {name} {side}", run):
                    data.setdefault(name, {}).setdefault(side, []).append(run)
    shutil.rmtree(b.work / "saves", ignore_errors=True)
    return data


# --------------------------------------------------------------------------
# summaries: best and median of the rounds, ratios, verdicts
# --------------------------------------------------------------------------


def _best(runs: list[dict[str, Any]], key: str = "seconds") -> float | None:
    return min(r[key] for r in runs) if runs else None


def _median(runs: list[dict[str, Any]], key: str = "seconds") -> float | None:
    return statistics.median(r[key] for r in runs) if runs else None


def _verdict(ok: bool | None, miss: str) -> str:
    return "-" if ok is None else "PASS" if ok else f"MISS ({miss})"


def summarise_loads(b: Bench, data: dict[str, Any], files: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    by_name = {c.name: c for c in b.cases}
    for name, conds in data.items():
        case = by_name.get(name)
        target = load_target(case) if case else None
        for cond, runs in conds.items():
            raws = [(k, runs[k]) for k in rawio.READS if runs.get(k)]
            raw = min(raws, key=lambda kv: _best(kv[1]) or 0.0) if raws else None
            row: dict[str, Any] = {
                "case": name,
                "layout": case.layout if case else ("directory" if "orbax" in name else "file"),
                "cache": cond,
                "bytes_read": sum(s for _, s in files["load"][name]["read_files"]),
                "target": target,
                "raw": {k: {"best": _best(v), "median": _median(v)} for k, v in raws},
                "raw_best": _best(raw[1]) if raw else None,
                "raw_median": min(_median(v) or 0.0 for _, v in raws) if raws else None,
            }
            for side in [s for s, _ in b.sides] + ["peer"]:
                if not runs.get(side):
                    continue
                best, med = _best(runs[side]), _median(runs[side])
                assert best is not None and med is not None
                ratio = row["raw_best"] / best if row["raw_best"] else None
                ok = None if target is None or ratio is None else ratio >= target
                row[side] = {
                    "best": best,
                    "median": med,
                    "ratio": ratio,
                    "ratio_median": row["raw_median"] / med if row["raw_median"] else None,
                    "rchar": _median(runs[side], "rchar") if "rchar" in runs[side][0] else None,
                    "verdict": _verdict(ok, f"< {target}x"),
                }
            rows.append(row)
    return rows


def summarise_memory(b: Bench, data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, conds in data.items():
        row: dict[str, Any] = {"case": name}
        for side in [s for s, _ in b.sides] + ["peer"]:
            runs = [r for c in conds.values() for r in c.get(side, [])]
            if not runs:
                continue
            tree = max(r["bytes"] for r in runs)
            added = max(r["added"] for r in runs)
            ok = None if side == "peer" else added <= tree + TARGETS["memory_slack"]
            row["tree"] = tree
            row[side] = {"added": added, "verdict": _verdict(ok, "> tree + 64 MB")}
        rows.append(row)
    return rows


def summarise_per_tensor(
    b: Bench, data: dict[str, Any], files: dict[str, Any]
) -> list[dict[str, Any]]:
    def us(name: str, who: str) -> float | None:
        runs = data.get(name, {}).get(who, [])
        best = _best(runs)
        return None if best is None else best / runs[0]["leaves"] * 1e6

    ref = us("peer safetensors.numpy", "peer")
    floor = us("raw file per tensor", "raw")
    rows = []
    for name in data:
        if name in ("peer safetensors.numpy", "raw file per tensor"):
            kind = "reference"
            rows.append(
                {
                    "case": name,
                    "reference": kind,
                    "us": us(name, "peer" if "peer" in name else "raw"),
                }
            )
            continue
        fast = name in FAST_PER_TENSOR
        base, base_name = (
            (floor, "raw file per tensor") if name == "waffe2" else (ref, "safetensors.numpy")
        )
        factor = 1.0 if fast else TARGETS["per_tensor"]
        limit = None if base is None else base * factor
        row: dict[str, Any] = {
            "case": name,
            "tensors": files["leaves"][name]["leaves"],
            "reference": base_name,
            "reference_us": base,
            "limit_us": limit,
            "factor": factor,
        }
        for side, _ in b.sides:
            v = us(name, side)
            if v is None:
                continue
            ok = None if limit is None else v <= limit
            row[side] = {"us": v, "verdict": _verdict(ok, f"> {factor:g}x {base_name}")}
        rows.append(row)
    return rows


def summarise_saves(b: Bench, data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, sides in data.items():
        all_runs = [r for runs in sides.values() for r in runs]
        raw = _best(all_runs, "raw")
        row: dict[str, Any] = {
            "case": name,
            "bytes": all_runs[0]["bytes"],
            "raw_best": raw,
            "raw_median": _median(all_runs, "raw"),
            "durable": name.endswith("(durable)"),
        }
        for side, runs in sides.items():
            best, med = _best(runs, "save"), _median(runs, "save")
            assert best is not None and med is not None and raw is not None
            ratio = raw / best
            row[side] = {
                "best": best,
                "median": med,
                "ratio": ratio,
                "ratio_median": (row["raw_median"] or 0.0) / med,
                "verdict": _verdict(ratio >= TARGETS["save"], f"< {TARGETS['save']}x"),
            }
        rows.append(row)
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=384, help="tree size in MB (default 384)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--leaves", type=int, default=2000, help="tensors of the per-tensor tree")
    p.add_argument("--layers", type=int, default=C.REFERENCE_LAYERS, help=argparse.SUPPRESS)
    p.add_argument("--only", help="regular expression: the formats and peers to run")
    p.add_argument("--old", help="a checkout of the code to compare with (today's code)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="where latest.json/.md go")
    p.add_argument("--dir", help="scratch directory (default: the system's temporary one)")
    p.add_argument("--no-drop", action="store_true", help="skip the dropped page cache loads")
    p.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 MB, 1 round, 100 tensors")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.rounds, args.leaves, args.no_drop = 1, 1, min(args.leaves, 100), True
    args.size_bytes = int(args.size * (1 << 20))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    b = Bench(args)
    try:
        no_drop = "--no-drop or --quick" if args.no_drop else can_drop()
        conds = ["warm"] if no_drop else ["warm", "dropped"]
        results: dict[str, Any] = {
            "machine": report.machine(b.work),
            "sides": {s: report.checkout(d) for s, d in b.sides},
            "config": {
                "size_mb": args.size,
                "rounds": args.rounds,
                "leaves": args.leaves,
                "quick": args.quick,
                "cases": [c.name for c in b.cases],
                "peers": [p.name for p in b.peers],
                "page_cache": conds,
                "no_drop_reason": no_drop,
            },
            "targets": TARGETS,
        }
        b.log(f"preparing {len(b.cases)} formats and {len(b.peers)} peers in {b.work}")
        files = prepare(b)
        warm_up(b, files)
        loads = cold_loads(b, files, conds)
        leaves = per_tensor(b, files)
        saved = saves(b)
        results |= {
            "loads": summarise_loads(b, loads, files),
            "memory": summarise_memory(b, loads),
            "per_tensor": summarise_per_tensor(b, leaves, files),
            "saves": summarise_saves(b, saved),
            "raw": {"loads": loads, "per_tensor": leaves, "saves": saved, "files": files},
            "errors": b.errors,
            "seconds": time.monotonic() - b.t0,
        }
        results["machine"]["loadavg_end"] = report.loadavg()
    finally:
        shutil.rmtree(b.work, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = report.markdown(results)
    (out / "latest.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "latest.md").write_text(md)
    print(md)
    return results


if __name__ == "__main__":
    main()
