"""Peak memory of one save, load or convert, measured in a fresh process.

``python peakmem.py SPEC_JSON`` builds what the operation needs, runs it once
on a small tree first (lazy imports, jit compilation and thread pools are not
what is measured), resets the RSS high-water mark (``/proc/self/clear_refs``),
runs the operation and prints one JSON line: the peak RSS added over the
resident size just before it (``VmHWM - VmRSS``), and its wall time.  A fresh
process per case keeps one case's freed-but-kept heap from hiding the next
one's allocations.  Linux only.

:func:`measure` is the parent's side: it runs the child and parses its line.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _trim() -> None:
    """Give freed heap memory back to the system, so that reusing it counts as growth again."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _op(spec: dict[str, Any], size: int, root: Path, src_root: Path) -> Any:
    """A callable doing the operation of ``spec`` on a tree of ``size`` bytes."""
    import cases
    import peers

    import pytreeio as ptio

    kind, name = spec["op"], spec["case"]
    if name.startswith("peer:"):
        peer = next(p for p in peers.PEERS if p.name == name[5:])
        tree = cases.mlp_tree(size, spec["layers"])
        root.mkdir(parents=True, exist_ok=True)
        if kind == "save":
            return lambda: peer.save(root / peer.dest, tree)
        if src_root == root:  # the warm-up writes its own file to read back
            peer.save(root / peer.dest, tree)
        return lambda: peer.load(src_root / peer.dest, tree)
    case = next(c for c in cases.format_cases(spec["layers"]) if c.name == name)
    root.mkdir(parents=True, exist_ok=True)
    if kind == "save" or src_root == root:  # a load or convert of the real file needs no tree
        trees, configs = cases.build_trees(size, spec["layers"])
        tree, kwargs = trees[case.tree], cases.save_kwargs(case, trees, configs)
        del trees
        if kind == "save":
            return lambda: ptio.save(root / case.dest, tree, durable=False, **kwargs)
        ptio.save(root / case.dest, tree, durable=False, **kwargs)
        del tree
    src = src_root / case.dest
    if kind == "load":
        return lambda: ptio.load(src, format=case.format, **case.load_options)
    if kind == "convert":
        dst = root / spec["dest"]
        return lambda: ptio.convert(src, dst, to=spec["to"], from_=case.format)
    raise ValueError(f"unknown operation {kind!r}")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from pytreeio import copy_crc, kernels

    with tempfile.TemporaryDirectory(prefix="pytreeio-peakmem-", dir=spec["scratch"]) as tmp:
        warm = Path(tmp) / "warm"
        _op(spec, 1 << 16, warm, warm)()  # warm up on a 64 KiB tree
        # numba's import and code generator are a one-time cost of the process, like imports
        # (a 64 KiB tree is too small to load them: pytreeio.kernels.MIN_BYTES)
        kernels.ready()
        copy_crc.ready()  # the same for the npz reads' copy + CRC-32 kernel (llvmlite)
        shutil.rmtree(warm)
        fn = _op(spec, spec["size"], Path(tmp) / "run", Path(spec["dir"]))
        gc.collect()
        _trim()
        _reset_peak()
        before = _status("VmRSS:")
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        peak = _status("VmHWM:")
        del result
    return {"added": peak - before, "before": before, "peak": peak, "seconds": seconds}


def measure(spec: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter; its result, or ``{"error": ...}``."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0][:300]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    print(json.dumps(child(json.loads(sys.argv[1]))))
