"""The machine a run came from, and the markdown rendering of a run's results.

The results are plain data (what ``latest.json`` holds); :func:`markdown`
turns the summaries into tables, each row with its verdict (PASS, MISS, or
``-`` where no target applies) for each side.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def _first(path: str, prefix: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _file_system(path: Path) -> str:
    """The file system type of ``path`` (the longest mount point containing it)."""
    real, best, found = os.path.realpath(path), "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mount, kind = line.split()[:3]
                mount = mount.replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(
                    mount
                ) >= len(best):
                    best, found = mount, f"{kind} ({dev} on {mount})"
    except OSError:
        pass
    return found


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine(work_dir: Path) -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, memory, file system, versions, load, date."""
    mem = _first("/proc/meminfo", "MemTotal")
    return {
        "cpu": _first("/proc/cpuinfo", "model name") or platform.machine(),
        "nproc": os.cpu_count(),
        "memory_bytes": int(mem.split()[0]) * 1024 if mem else None,
        "file_system": _file_system(work_dir),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        **{d: _version(d) for d in ("numpy", "jax", "flax", "orbax-checkpoint", "safetensors")},
        "loadavg_start": loadavg(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def checkout(path: Path) -> dict[str, Any]:
    """Which code a side ran: its directory, commit, and whether its tree had changes."""

    def git(*args: str) -> str:
        try:
            proc = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True)
            return proc.stdout.strip()
        except OSError:
            return ""

    changed = git("status", "--porcelain", "--", "pytreeio")
    return {
        "dir": str(path),
        "commit": git("rev-parse", "--short", "HEAD") or "?",
        "changed_files": len(changed.splitlines()),
    }


# --------------------------------------------------------------------------
# markdown
# --------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "" if v is None else f"{v * 1e3:.0f}"


def _mb(n: float | None) -> str:
    return "" if n is None else f"{n / 1e6:.0f}"


def _time_ratio(entry: dict[str, Any] | None) -> list[str]:
    """``best (median)`` ms and ratio cells of one side."""
    if not entry:
        return ["", ""]
    ratio = f"{entry['ratio']:.2f}x" if entry.get("ratio") else ""
    if ratio and entry.get("ratio_median"):
        ratio += f" ({entry['ratio_median']:.2f}x)"
    return [f"{_ms(entry['best'])} ({_ms(entry['median'])})", ratio]


def _verdicts(row: dict[str, Any], sides: list[str]) -> str:
    return " / ".join(f"{s}: {row[s]['verdict']}" for s in sides if row.get(s))


def markdown(results: dict[str, Any]) -> str:
    m, cfg, sides_info = results["machine"], results["config"], results["sides"]
    sides = list(sides_info)
    mem = m.get("memory_bytes")
    lines = [
        f"Run of {m['date']}: {m['cpu']}, nproc {m['nproc']}"
        + (f", {mem / 2**30:.0f} GiB RAM" if mem else "")
        + f"; {m['file_system']}; Python {m['python']}, numpy {m['numpy']}, jax {m['jax']}; "
        f"load average {m['loadavg_start']} at the start, {m.get('loadavg_end')} at the end; "
        f"{results.get('seconds', 0) / 60:.1f} minutes.",
        "",
        "Code: "
        + "; ".join(
            f"**{s}** = `{i['dir']}` at {i['commit']}"
            + (
                f" + uncommitted changes in {i['changed_files']} files"
                if i["changed_files"]
                else ""
            )
            for s, i in sides_info.items()
        )
        + ".",
        "",
        f"Conditions: tree {cfg['size_mb']:g} MB float32 (32 layers of a square kernel and a "
        "bias; Tiny Llama: a model of about the same bytes); "
        f"{cfg['rounds']} rounds, interleaved (raw reads, then each side's load, case after case); "
        "times are best (median) in ms; ratios are raw time / load time (higher is better). "
        "Every load is the **first load in a fresh process** (numpy, jax and pytreeio imported "
        "and bytecode cached, every format loaded once by a warm-up process per side, before the "
        "clock starts; no `like`), and every raw read is a fresh "
        "process too (numpy only): one-thread `readinto`, or two-thread `pread` of 16 MiB "
        "blocks, into a **fresh numpy array per file**, of the files the load needs; the faster "
        "is the baseline. Page cache **warm**: every file read just before the round; "
        "**dropped**: `sync; echo 3 > /proc/sys/vm/drop_caches` in the process after its "
        "imports, the pytreeio package and the cached bytecode read back, so only "
        "the checkpoint is cold"
        + (f" (not run: {cfg['no_drop_reason']})" if cfg.get("no_drop_reason") else "")
        + ". **Memory**: fresh process, `ru_maxrss` after the load minus `ru_maxrss` after "
        "the imports, the largest of the rounds.",
        "",
        "### Cold loads",
        "",
    ]
    head = "| case | layout | cache | MB read | raw best |"
    rule = "|---|---|---|---:|---:|"
    for s in sides:
        head += f" {s} ms | {s} / raw |"
        rule += "---:|---:|"
    lines += [head + " target | verdict |", rule + "---:|---|"]
    for r in results["loads"]:
        who = sides if "peer" not in r else ["peer"]
        cells = [r["case"], r["layout"], r["cache"], _mb(r["bytes_read"]), _ms(r["raw_best"])]
        for s in sides:
            cells += _time_ratio(r.get("peer") if who == ["peer"] and s == sides[-1] else r.get(s))
        target = f">= {r['target']}x" if r["target"] else "-"
        lines.append("| " + " | ".join([*cells, target, _verdicts(r, sides) or "-"]) + " |")
    if len(sides) > 1:
        lines += ["", f"(peer rows: the peer's load in the {sides[-1]} columns)"]
    lines += [
        "",
        "### Peak memory of the loads, and bytes read (`rchar`: read calls; mapped reads not counted)",
        "",
        "| case | tree MB | "
        + " | ".join(f"{s} added MB | {s} read MB" for s in sides)
        + " | target | verdict |",
        "|---|---:|" + "---:|---:|" * len(sides) + "---|---|",
    ]
    reads = {
        (r["case"], s): r[s].get("rchar")
        for r in results["loads"]
        for s in [*sides, "peer"]
        if r.get(s) and r["cache"] == "warm"
    }
    for r in results["memory"]:
        cells = [r["case"], _mb(r.get("tree"))]
        for s in sides:
            e = r.get(s) or (r.get("peer") if s == sides[-1] else None)
            rd = reads.get((r["case"], s)) or reads.get((r["case"], "peer"))
            cells += [_mb(e["added"]) if e else "", _mb(rd) if e else ""]
        lines.append(
            "| " + " | ".join([*cells, "<= tree + 64 MB", _verdicts(r, sides) or "-"]) + " |"
        )
    lines += [
        "",
        "### Saves (in-process, after a warm-up save of every format; destination removed and "
        "`os.sync()` before each)",
        "",
        "`durable=False` against plain `write` of the same files' sizes from the tree's arrays; "
        "`(durable)`: the default save (files and directory fsynced) against `write` + `fsync` of "
        "each file and its directory. Raw: best of all rounds of both sides.",
        "",
        "| case | MB | raw ms |"
        + "".join(f" {s} ms | {s} / raw |" for s in sides)
        + " target | verdict |",
        "|---|---:|---:|" + "---:|---:|" * len(sides) + "---:|---|",
    ]
    for r in results["saves"]:
        cells = [r["case"], _mb(r["bytes"]), _ms(r["raw_best"])]
        for s in sides:
            cells += _time_ratio(r.get(s))
        lines.append("| " + " | ".join([*cells, ">= 0.9x", _verdicts(r, sides)]) + " |")
    lines += [
        "",
        "### First load per tensor (fresh process, page cache warm; µs per tensor, best of rounds)",
        "",
        f"A tree of {cfg['leaves']} small float32 tensors (Linear layers of an 8x8 kernel and 8 "
        "biases; Tiny Llama: a model of about as many). Reference: safetensors.numpy's first load "
        "of the same tree (<= 1x for msgpack, safetensors, tinyllama; <= 3x elsewhere); "
        "cl-waffe2 stores a file per tensor: against `open`/`pread`/`close` of a file per tensor "
        "(<= 3x).",
        "",
        "| case | tensors | reference µs |"
        + "".join(f" {s} µs |" for s in sides)
        + " limit µs | verdict |",
        "|---|---:|---:|" + "---:|" * len(sides) + "---:|---|",
    ]
    for r in results["per_tensor"]:
        if r["reference"] == "reference":
            us = "" if r["us"] is None else f"{r['us']:.1f}"
            lines.append(f"| {r['case']} (reference) | | {us} |" + " |" * len(sides) + " | |")
            continue
        ref = "" if r["reference_us"] is None else f"{r['reference_us']:.1f} ({r['reference']})"
        cells = [r["case"], str(r["tensors"]), ref]
        cells += [f"{r[s]['us']:.1f}" if r.get(s) else "" for s in sides]
        limit = "" if r["limit_us"] is None else f"{r['limit_us']:.1f}"
        lines.append("| " + " | ".join([*cells, limit, _verdicts(r, sides) or "-"]) + " |")
    if results.get("errors"):
        lines += ["", "Errors:", ""] + [f"- {e}" for e in results["errors"]]
    return "\n".join(lines) + "\n"
