"""The machine a run came from, and the markdown rendering of a run's results.

The results are plain data (what ``latest.json`` holds); :func:`markdown`
turns them into the tables the README shows, each row with its verdict
against the targets (PASS, MISS, or ``-`` where no target applies).
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

#: The targets the tables make checkable (ratios within one run).
TARGETS = {
    "load_file": 0.9,  # x best raw read, single-file formats, with and without like
    "load_multi": 0.8,  # x best raw read, sibling and directory formats
    "save": 0.95,  # x raw write of the same files
    "save_durable": 0.95,  # x raw write + fsync
    "memory_slack": 64 << 20,  # peak added <= tree + 64 MB
    "inspect_s": 0.050,  # inspect of a 1 GB file
    "import_s": 0.050,  # import pytreeio over import numpy
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _file_system(path: Path) -> str:
    """The file system type of ``path`` (the longest mount point containing it)."""
    try:
        real = os.path.realpath(path)
        best, kind, dev = "", "?", "?"
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind, dev = mount, parts[2], parts[0]
        return f"{kind} ({dev} on {best})"
    except OSError:
        return "?"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine(work_dir: Path) -> dict[str, Any]:
    """What the numbers depend on: CPU, memory, file system, versions, load, date."""
    try:
        kernel = subprocess.run(["uname", "-r"], capture_output=True, text=True).stdout.strip()
    except OSError:
        kernel = platform.release()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "file_system": _file_system(work_dir),
        "kernel": kernel,
        "python": sys.version.split()[0],
        "numpy": _version("numpy"),
        "jax": _version("jax"),
        "pytreeio": _version("pytreeio"),
        "flax": _version("flax"),
        "orbax-checkpoint": _version("orbax-checkpoint"),
        "safetensors": _version("safetensors"),
        "equinox": _version("equinox"),
        "loadavg_start": _loadavg(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


# --------------------------------------------------------------------------
# markdown
# --------------------------------------------------------------------------


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}x"


def _ratio(entry: dict[str, Any] | None) -> str:
    """``best (median)`` of a ratio entry."""
    if not entry:
        return ""
    if entry.get("error"):
        return "error"
    return f"{entry['best']:.2f}x ({entry['median']:.2f}x)"


def _verdict(checks: list[tuple[str, bool]]) -> str:
    if not checks:
        return "-"
    missed = [what for what, ok in checks if not ok]
    return "PASS" if not missed else "MISS: " + ", ".join(missed)


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f}"


def throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| case | layout | MB | save GB/s | save / raw write | load GB/s | load / best raw read "
        "| load (like) / best raw read | targets |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        save, load, like = r.get("save"), r.get("load"), r.get("load_like")
        out.append(
            f"| {r['name']} | {r['layout']} | {_mb(r['bytes'])} "
            f"| {r.get('save_gbps', '')} | {_ratio(save)} | {r.get('load_gbps', '')} "
            f"| {_ratio(load)} | {_ratio(like)} | {r['verdict']} |"
        )
    return out


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    mem = m["memory_bytes"]
    cfg = results["config"]
    lines = [
        f"Run of {m['date']} on {m['cpu']}, {m['cores']} cores, {mem / 2**30:.0f} GiB RAM;"
        if mem
        else f"Run of {m['date']} on {m['cpu']}",
        f"{m['file_system']}; Python {m['python']}, numpy {m['numpy']}, jax {m['jax']}; "
        f"load average {m['loadavg_start']} at the start, {m.get('loadavg_end')} at the end.",
        "",
        f"Tree: {cfg['tree_mb']:.0f} MB float32, {cfg['leaves']} leaves; {cfg['repeat']} rounds, "
        "cases interleaved round-robin; ratios are best (median) of the round times, "
        "ours / raw on the same files in the same run (higher is better). Saves are "
        "`durable=False` against raw `write`; loads read page-cached files (each read once "
        "before timing) into fresh arrays, against the best raw read of the same files "
        "(fastest of 1-thread `readinto`, 2-thread `pread` into one array per file and into "
        "arrays of the sizes of the tree's tensors, `mmap` + copy).",
        "",
    ]
    t = results.get("throughput")
    if t:
        lines += ["### Throughput", ""]
        lines += throughput_table(t["rows"])
        raw = t.get("raw_limits")
        if raw:
            lines += [
                "",
                "Raw limits on the msgpack tree's bytes (GB/s, best): "
                + ", ".join(f"{k} {v:.2f}" for k, v in raw.items())
                + ".",
            ]
        lines.append("")
    d = results.get("durable")
    if d:
        lines += [
            "### Durable saves (vs raw `write` + `fsync` of the same files)",
            "",
            "| case | GB/s | save / raw write+fsync | targets |",
            "|---|---:|---:|---|",
        ]
        for r in d:
            lines.append(f"| {r['name']} | {r['gbps']} | {_ratio(r['ratio'])} | {r['verdict']} |")
        lines.append("")
    pl = results.get("per_leaf")
    if pl:
        lines += [
            f"### Per-leaf cost ({pl['leaves']} leaves: Linear layers of an 8x8 kernel and 8 "
            "biases, float32; Tiny Llama: a model of as many leaves; µs per leaf, best)",
            "",
            "Repeated saves and loads of one layout (what a training run does); then the",
            "first of a layout, after `pytreeio.forget_layouts()` (what a one-off load pays).",
            "",
            "| library | save | load | load (like) | first: save | load | load (like) "
            "| targets (<= safetensors.numpy) |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        keys = ("save", "load", "load_like", "save_first", "load_first", "load_like_first")
        for r in pl["rows"]:
            cells = [f"{r[k]:.1f}" if r.get(k) is not None else "" for k in keys]
            lines.append(f"| {r['name']} | {' | '.join(cells)} | {r['verdict']} |")
        lines.append("")
        lines += _file_per_tensor(pl["rows"])
    mm = results.get("memory")
    if mm:
        lines += [
            "### Peak memory (RSS high-water mark added by one operation, fresh process each)",
            "",
            "| case | operation | tree MB | added MB | seconds | targets (<= tree + 64 MB) |",
            "|---|---|---:|---:|---:|---|",
        ]
        for r in mm:
            if "error" in r:
                lines.append(
                    f"| {r['name']} | {r['op']} | {_mb(r['tree'])} | error | | {r['error'][:80]} |"
                )
                continue
            lines.append(
                f"| {r['name']} | {r['op']} | {_mb(r['tree'])} | {_mb(r['added'])} "
                f"| {r['seconds']:.2f} | {r['verdict']} |"
            )
        lines.append("")
    misc = results.get("misc")
    if misc:
        lines += ["### Other checks", "", "| check | result | targets |", "|---|---|---|"]
        for r in misc:
            lines.append(f"| {r['name']} | {r['result']} | {r['verdict']} |")
        lines.append("")
    if results.get("errors"):
        lines += ["Errors:", ""] + [f"- {e}" for e in results["errors"]] + [""]
    return "\n".join(lines)


def verdict(checks: list[tuple[str, bool]]) -> str:
    return _verdict(checks)


def _file_per_tensor(rows: list[dict[str, Any]]) -> list[str]:
    """cl-waffe2 (a file per tensor, by its format) against the raw floor of one."""
    by_name = {r["name"]: r for r in rows}
    raw, ours = by_name.get("raw: a file per tensor"), by_name.get("pytreeio waffe2")
    if raw is None or ours is None:
        return []
    parts = []
    for op, label in (("save", "save"), ("load", "load"), ("load_like", "load with `like`")):
        floor = raw["load" if op == "load_like" else op]
        if ours.get(op) is not None and floor:
            parts.append(
                f"{label} {ours[op]:.1f} µs a tensor, {ours[op] / floor:.2f}x the raw {floor:.1f}"
            )
    return [
        "A file per tensor (cl-waffe2's layout), raw: `open`/`write`/`close` of each tensor's "
        "bytes into a new directory swapped in by two renames, the old one's files unlinked; "
        "`open`/`read`/`close` of each back. cl-waffe2: " + "; ".join(parts) + ".",
        "",
    ]
