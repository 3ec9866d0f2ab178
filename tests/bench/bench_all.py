"""The benchmark suite: every format and the peer libraries against raw I/O, in one run.

Run with ``nox -s bench`` or ``python tests/bench/bench_all.py [--size MB]
[--repeat R] [--only PATTERN] [--out DIR] [--dir DIR]``.  Not a test: it
prints a markdown table with a PASS/MISS verdict per target and writes
``latest.json`` and ``latest.md`` into ``--out``.

What one run measures, all cases interleaved round-robin for R rounds (best
and median reported):

* **throughput** of save (``durable=False``) and load (with and without
  ``like``) for every format (msgpack, safetensors, tinyllama, netcl,
  netcl-checkpoint, netcl-params, datacode, waffe2, bullet raw and
  quantised) and every installed peer (flax.serialization, orbax,
  safetensors.numpy, ``np.savez``, equinox), each as a ratio to raw I/O of
  *its own files* (same bytes, same layout, same file system): raw ``write``
  for saves, the best of three raw reads into fresh arrays for loads;
* **durable saves** of msgpack and safetensors (and flax's bytes written
  with fsync) against raw ``write`` + ``fsync``;
* **per-leaf cost** on a tree of many small leaves;
* **peak memory** added by save, load and convert (a fresh process per case);
* ``inspect`` of a 1 GB file, the time ``import pytreeio`` adds over
  ``import numpy``, and, where the API exists, a partial load through
  ``ptio.open`` and the blocking time of ``ptio.save_async``.

Loads read page-cached files: every file is read once before the timed
rounds, so the comparison is of CPU and memory work, not of the disk.
``--only`` is a regular expression searched in ``section:case`` names
(``throughput:msgpack``, ``memory:netcl save``, ``per-leaf:flax``, ``misc:import``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402
import numpy as np  # noqa: E402
import peakmem  # noqa: E402
import peers as P  # noqa: E402
import rawio  # noqa: E402
import report  # noqa: E402
from timing import Case, fresh, race, removed  # noqa: E402

import pytreeio as ptio  # noqa: E402
from pytreeio import copy_crc  # noqa: E402

DEFAULT_OUT = HERE / "results"
#: The generic formats whose durable saves are measured (the others write the same way).
DURABLE = ("msgpack", "safetensors")
#: (source format case, target format) pairs whose conversion's peak memory is measured.
CONVERSIONS = [("msgpack", "safetensors"), ("netcl", "waffe2"), ("tinyllama", "safetensors")]


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


class Run:
    """One benchmark run: options, scratch directory, trees, and the results so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.size = int(args.size * (1 << 20))
        self.repeat = max(1, args.repeat)
        self.only = re.compile(args.only) if args.only else None
        self.work = Path(tempfile.mkdtemp(prefix="pytreeio-bench-", dir=args.dir))
        self.trees, self.configs = C.build_trees(self.size, args.layers)
        self.results: dict[str, Any] = {"errors": []}
        mlp = self.leaves_of("mlp")
        rawio.ARRAY_BYTES = max(1, C.tree_nbytes(self.trees["mlp"]) // len(mlp))  # tensor-sized

    def wanted(self, section: str, case: str) -> bool:
        return self.only is None or bool(self.only.search(f"{section}:{case}"))

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def leaves_of(self, kind: str) -> list[Any]:
        return [np.asarray(v) for v in ptio.flatten(self.trees[kind]).values()]


# --------------------------------------------------------------------------
# throughput
# --------------------------------------------------------------------------


def _stats(case: Case | None) -> tuple[float, float] | None:
    if case is None or case.error is not None or not case.times:
        return None
    return case.best, case.median


def _ratio(raw: Sequence[Case], ours: Case | None) -> dict[str, Any] | None:
    """Raw time / our time, best and median (several raw cases: the fastest of them)."""
    if ours is None:
        return None
    if ours.error is not None:
        return {"error": ours.error}
    raws = [s for s in (_stats(c) for c in raw) if s is not None]
    mine = _stats(ours)
    if not raws or mine is None:
        return None
    best_raw = min(s[0] for s in raws)
    median_raw = min(s[1] for s in raws)
    return {"best": best_raw / mine[0], "median": median_raw / mine[1]}


def _gbps(nbytes: int, case: Case | None) -> str:
    s = _stats(case)
    return "" if s is None else f"{nbytes / s[0] / 1e9:.2f}"


def _rchar() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Subject:
    """A format case or a peer inside the throughput race: its files and its timed cases."""

    def __init__(
        self,
        run: Run,
        name: str,
        layout: str,
        dest: str,
        tree_kind: str,
        save: Callable[[Path], None],
        load: Callable[[Path], Any],
        load_like: Callable[[Path], Any] | None,
        load_files: list[str] | None,
        is_peer: bool,
    ) -> None:
        self.run, self.name, self.layout, self.is_peer = run, name, layout, is_peer
        self.dir = run.work / "cases" / slug(name)
        self.raw_dir = run.work / "raw" / slug(name)
        self.path = self.dir / dest
        self.tree_kind = tree_kind
        self._save, self._load, self._load_like = save, load, load_like
        self.load_files = load_files
        self.error: str | None = None
        self.files: rawio.FileSet = []
        self.read_files: rawio.FileSet = []
        self.cases: dict[str, Case] = {}

    def prepare(self) -> bool:
        """Save once untimed (the file set the raw baselines copy), load once (warm)."""
        try:
            self._save_fresh()
            self.list_files()
            before = _rchar()
            self._load(self.path)
            after = _rchar()
            if before is not None and after is not None:
                self.bytes_read = after - before
            return True
        except Exception as exc:  # a broken format is reported, the others still run
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            self.run.results["errors"].append(f"{self.name}: prepare: {self.error}")
            self.run.log(f"  {self.name}: {self.error}")
            return False

    def _save_fresh(self) -> None:
        """One untimed save into an empty case directory."""
        fresh(self.dir)()
        self.dir.mkdir(parents=True)
        self._save(self.path)

    def save_again(self) -> None:
        """The checkpoint the loads read (untimed; the timed saves' outputs are removed)."""
        if self.error is not None:
            return
        try:
            self._save_fresh()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            self.run.results["errors"].append(f"{self.name}: save: {self.error}")

    def list_files(self) -> None:
        """The checkpoint's files now (orbax names its files anew on every save)."""
        self.files = rawio.file_set(self.dir)
        self.read_files = (
            rawio.file_set(self.dir, [f"{self.path.name}/{f}" for f in self.load_files])
            if self.load_files
            else self.files
        )

    @property
    def nbytes(self) -> int:
        return sum(s for _, s in self.files)

    def save_cases(self) -> list[Case]:
        sources = self.run.leaves_of(self.tree_kind)

        def setup_save() -> None:
            fresh(self.dir)()
            self.dir.mkdir(parents=True)

        def setup_raw() -> None:
            fresh(self.raw_dir)()
            self.raw_dir.mkdir(parents=True)

        self.cases["save"] = Case(
            f"save {self.name}", lambda: self._save(self.path), setup_save, removed(self.dir)
        )
        self.cases["raw write"] = Case(
            f"raw write {self.name}",
            lambda: rawio.raw_write(self.raw_dir, self.files, sources, False),
            setup_raw,
            removed(self.raw_dir),
        )
        return [self.cases["save"], self.cases["raw write"]]

    def read_cases(self) -> list[Case]:
        out = []
        for label, fn in rawio.RAW_READS.items():
            if fn is rawio.read_pread_arrays:
                # into arrays of the sizes of this tree's tensors (Tiny Llama's differ from
                # the MLP's), the sizes pytreeio's load gives each tensor
                sizes = [leaf.nbytes for leaf in self.run.leaves_of(self.tree_kind)]
                fn = functools.partial(fn, sizes=sizes)
            out.append(Case(f"{label} {self.name}", lambda fn=fn: fn(self.dir, self.read_files)))
            self.cases[label] = out[-1]
        self.cases["load"] = Case(f"load {self.name}", lambda: self._load(self.path))
        out.append(self.cases["load"])
        if self._load_like is not None:
            like = self._load_like
            self.cases["load like"] = Case(f"load like {self.name}", lambda: like(self.path))
            out.append(self.cases["load like"])
        return out

    def row(self) -> dict[str, Any]:
        raw_reads = [self.cases[k] for k in rawio.RAW_READS if k in self.cases]
        read_bytes = sum(s for _, s in self.read_files)
        row: dict[str, Any] = {
            "name": ("peer " if self.is_peer else "pytreeio ") + self.name,
            "layout": self.layout,
            "bytes": self.nbytes,
            "bytes_load_reads": read_bytes,
            "bytes_read_measured": getattr(self, "bytes_read", None),
            "files": len(self.files),
            "save": _ratio([self.cases["raw write"]], self.cases.get("save")),
            "load": _ratio(raw_reads, self.cases.get("load")),
            "load_like": _ratio(raw_reads, self.cases.get("load like")),
            "save_gbps": _gbps(self.nbytes, self.cases.get("save")),
            "load_gbps": _gbps(read_bytes, self.cases.get("load")),
            "times": {
                k: {"best": c.best, "median": c.median, "runs": c.times, "error": c.error}
                for k, c in self.cases.items()
            },
        }
        checks: list[tuple[str, bool]] = []
        if not self.is_peer:
            need = report.TARGETS["load_file" if self.layout == "file" else "load_multi"]
            for key, label in (("save", "save"), ("load", "load"), ("load_like", "load like")):
                entry = row[key]
                if entry is None:
                    continue
                target = report.TARGETS["save"] if key == "save" else need
                ok = "error" not in entry and entry["best"] >= target
                checks.append((f"{label} < {target}x" if "error" not in entry else label, ok))
        row["verdict"] = report.verdict(checks) if not self.error else f"error: {self.error}"
        return row


def format_subjects(run: Run) -> list[Subject]:
    out = []
    for case in C.format_cases(run.args.layers):
        if not run.wanted("throughput", case.name):
            continue
        tree = run.trees[case.tree]
        kwargs = C.save_kwargs(case, run.trees, run.configs)
        out.append(
            Subject(
                run,
                case.name,
                case.layout,
                case.dest,
                case.tree,
                save=lambda p, t=tree, kw=kwargs: ptio.save(p, t, durable=False, **kw),
                load=lambda p, c=case: ptio.load(p, format=c.format, **c.load_options),
                load_like=lambda p, c=case, t=tree: ptio.load(
                    p, like=t, format=c.format, **c.load_options
                ),
                load_files=case.load_files,
                is_peer=False,
            )
        )
    return out


def peer_subjects(run: Run) -> list[Subject]:
    tree = run.trees["mlp"]
    out = []
    for peer in P.available():
        if not run.wanted("throughput", peer.name):
            continue
        out.append(
            Subject(
                run,
                peer.name,
                "directory" if peer.name == "orbax" else "file",
                peer.dest,
                "mlp",
                save=lambda p, pe=peer: pe.save(p, tree),
                load=lambda p, pe=peer: pe.load(p, tree),
                load_like=None,
                load_files=None,
                is_peer=True,
            )
        )
    return out


def durable_cases(run: Run) -> list[tuple[str, Case, Case, Path]]:
    """(name, ours, raw write+fsync, dir) for the durable saves."""
    tree = run.trees["mlp"]
    sources = run.leaves_of("mlp")
    out = []
    specs: list[tuple[str, str, Callable[[Path], None]]] = [
        (f"pytreeio {fmt}", f"tree.{fmt}", lambda p, f=fmt: ptio.save(p, tree, format=f))
        for fmt in DURABLE
        if run.wanted("durable", fmt)
    ]
    if run.wanted("durable", "flax") and any(p.name == "flax.serialization" for p in P.available()):
        specs.append(
            ("peer flax.serialization", "tree.msgpack", lambda p: P.flax_save(p, tree, True))
        )
    for name, dest, save in specs:
        d = run.work / "durable" / slug(name)
        raw = run.work / "durable-raw" / slug(name)
        d.mkdir(parents=True)
        save(d / dest)  # once, for the file set
        files = rawio.file_set(d)

        def setup(d: Path = d) -> None:
            fresh(d)()
            d.mkdir(parents=True)

        def setup_raw(raw: Path = raw) -> None:
            fresh(raw)()
            raw.mkdir(parents=True)

        ours = Case(f"durable save {name}", lambda s=save, p=d / dest: s(p), setup)
        base = Case(
            f"raw write+fsync {name}",
            lambda raw=raw, files=files: rawio.raw_write(raw, files, sources, True),
            setup_raw,
            removed(raw),
        )
        out.append((name, ours, base, d))
    return out


def bench_throughput(run: Run) -> None:
    subjects = format_subjects(run) + peer_subjects(run)
    durable = durable_cases(run)
    if not subjects and not durable:
        return
    run.log(f"throughput: preparing {len(subjects)} cases")
    # compiled kernels are a one-time cost of the process, like imports: built before timing
    copy_crc.ready()
    subjects = [s for s in subjects if s.prepare()]
    saves = [c for s in subjects for c in s.save_cases()]
    saves += [c for _, ours, base, _ in durable for c in (ours, base)]
    run.log(f"throughput: {len(saves)} save cases x {run.repeat} rounds")
    race(saves, run.repeat, run.log)
    shutil.rmtree(run.work / "raw", ignore_errors=True)  # the raw copies are not read back
    shutil.rmtree(run.work / "durable-raw", ignore_errors=True)
    for s in subjects:  # each save's output went after its timing: what the loads read, again
        s.save_again()
    os.sync()
    for s in subjects:  # every file the loads read is in the page cache before timing
        s.list_files()
        if s.files:
            rawio.read_readinto(s.dir, s.files)
    reads = [c for s in subjects for c in s.read_cases()]
    run.log(f"throughput: {len(reads)} read cases x {run.repeat} rounds")
    race(reads, run.repeat, run.log)
    rows = [s.row() for s in subjects]
    raw_limits = {}
    generic = next((s for s in subjects if s.name == "msgpack"), None)
    if generic is not None:
        for label in ("raw write", *rawio.RAW_READS):
            st = _stats(generic.cases.get(label))
            if st is not None:
                raw_limits[label] = generic.nbytes / st[0] / 1e9
    run.results["throughput"] = {"rows": rows, "raw_limits": raw_limits}
    drows = []
    for name, ours, base, d in durable:
        nbytes = sum(s for _, s in rawio.file_set(d))
        ratio = _ratio([base], ours)
        ok = (
            ratio is not None
            and "error" not in ratio
            and ratio["best"] >= report.TARGETS["save_durable"]
        )
        is_peer = name.startswith("peer")
        drows.append(
            {
                "name": name,
                "gbps": _gbps(nbytes, ours),
                "ratio": ratio,
                "raw_gbps": _gbps(nbytes, base),
                "verdict": "-"
                if is_peer
                else report.verdict([(f"< {report.TARGETS['save_durable']}x", ok)]),
                "times": {"ours": ours.times, "raw": base.times},
            }
        )
    if drows:
        run.results["durable"] = drows
    shutil.rmtree(run.work / "durable", ignore_errors=True)


# --------------------------------------------------------------------------
# per-leaf cost
# --------------------------------------------------------------------------


@dataclass
class PerLeafLib:
    """One library (or format) in the per-leaf race: its file and how it saves and loads it."""

    name: str
    leaves: int
    path: Path
    save: Callable[[Path], Any]
    load: Callable[[Path], Any] | None
    like: Callable[[Path], Any] | None
    #: pytreeio keeps layouts from earlier saves and loads (pytreeio.layouts): each operation
    #: is timed again after ``forget_layouts``, as the first of its layout
    keeps_layouts: bool = False


def _first(op: Callable[[Path], Any], path: Path) -> Any:
    """``op(path)`` as the first operation of its layout: nothing kept from earlier ones."""
    ptio.forget_layouts()
    return op(path)


#: The per-leaf race's raw baseline of a file per tensor (see rawio.replace_dir_of_files).
RAW_FILES = "raw: a file per tensor"


def bench_per_leaf(run: Run) -> None:
    """Per-leaf cost: every format and the peers on a tree of ``--leaves`` small leaves.

    The tree is a layered model (:func:`cases.many_leaves_tree`), so every
    format saves it; Tiny Llama, whose records are fixed by its config, saves
    a model of as many leaves.  Cost is the best round's time / leaves.
    """
    n = run.args.leaves
    tree = C.many_leaves_tree(n)
    llama, llama_cfg = C.many_leaves_tinyllama(n)
    trees, configs = {"mlp": tree, "tinyllama": llama}, {"tinyllama": llama_cfg}
    leaves = {k: len(ptio.flatten(t)) for k, t in trees.items()}
    d = run.work / "leaves"
    d.mkdir(parents=True, exist_ok=True)
    libs: list[PerLeafLib] = []
    for case in C.format_cases(len(tree["params"])):
        if case.load_options:
            continue  # the same file as another case
        t = trees[case.tree]
        kwargs = C.save_kwargs(case, trees, configs)
        like = t if case.tree == "mlp" else None  # a native Tiny Llama tree restores as itself
        libs.append(
            PerLeafLib(
                f"pytreeio {case.name}",
                leaves[case.tree],
                d / slug(case.name) / case.dest,
                lambda p, t=t, kw=kwargs: ptio.save(p, t, durable=False, **kw),
                lambda p, f=case.format: ptio.load(p, format=f),
                None
                if like is None
                else lambda p, f=case.format: ptio.load(p, format=f, like=tree),
                keeps_layouts=True,
            )
        )
    names = {p.name for p in P.available()}
    if "safetensors.numpy" in names:
        libs.append(
            PerLeafLib(
                "safetensors.numpy",
                leaves["mlp"],
                d / "peer" / "peer.safetensors",
                lambda p: P.safetensors_save(p, tree),
                lambda p: P.safetensors_load(p, tree),
                None,
            )
        )
    if "flax.serialization" in names:
        libs.append(
            PerLeafLib(
                "flax.serialization",
                leaves["mlp"],
                d / "peer" / "flax.msgpack",
                lambda p: P.flax_save(p, tree),
                None,
                lambda p: P.flax_load(p, tree),
            )
        )
    if "np.savez" in names:
        libs.append(
            PerLeafLib(
                "np.savez",
                leaves["mlp"],
                d / "peer" / "np.npz",
                lambda p: P.savez_save(p, tree),
                lambda p: P.savez_load(p, tree),
                None,
            )
        )
    # the floor of a format that stores a file per tensor (cl-waffe2): raw file system calls
    arrays = [np.ascontiguousarray(a) for a in ptio.flatten(tree).values()]
    libs.append(
        PerLeafLib(
            RAW_FILES,
            len(arrays),
            d / "raw" / "files",
            lambda p: rawio.replace_dir_of_files(p, arrays),
            rawio.read_dir_of_files,
            None,
        )
    )
    libs = [lib for lib in libs if run.wanted("per-leaf", lib.name)]
    if not libs:
        return
    cases: dict[tuple[str, str], Case] = {}
    for lib in libs:
        lib.path.parent.mkdir(parents=True, exist_ok=True)
        lib.save(lib.path)
        for op, fn in (("save", lib.save), ("load", lib.load), ("load_like", lib.like)):
            if fn is None:
                continue
            label = f"{lib.name} {op.replace('_', ' ')}"
            cases[(lib.name, op)] = Case(label, lambda f=fn, p=lib.path: f(p))
            if lib.keeps_layouts:
                cases[(lib.name, f"{op}_first")] = Case(
                    f"{label}, first of its layout", lambda f=fn, p=lib.path: _first(f, p)
                )
    run.log(f"per-leaf: {len(cases)} cases x {max(run.repeat, 5)} rounds")
    # The first-of-a-layout cases forget what the others keep: a race of their own, after.
    for first in (False, True):
        race([c for k, c in cases.items() if k[1].endswith("_first") == first], max(run.repeat, 5))
    count = {lib.name: lib.leaves for lib in libs}

    def us(name: str, op: str) -> float | None:
        c = cases.get((name, op))
        return None if c is None or c.error or not c.times else c.best / count[name] * 1e6

    ref = "safetensors.numpy"
    rows = []
    for name in count:
        row = {
            "name": name,
            "save": us(name, "save"),
            "load": us(name, "load"),
            "load_like": us(name, "load_like"),
            "save_first": us(name, "save_first"),
            "load_first": us(name, "load_first"),
            "load_like_first": us(name, "load_like_first"),
        }
        checks = []
        if name.startswith("pytreeio") and any(k[0] == ref for k in cases):
            ref_save, ref_load = us(ref, "save"), us(ref, "load")
            if row["save"] is not None and ref_save is not None:
                checks.append((f"save > {ref_save:.1f}", row["save"] <= ref_save))
            for op in ("load", "load_like"):
                if row[op] is not None and ref_load is not None:
                    checks.append((f"{op} > {ref_load:.1f}", row[op] <= ref_load))
        row["verdict"] = report.verdict(checks)
        rows.append(row)
    run.results["per_leaf"] = {"leaves": n, "rows": rows}
    for name, c in cases.items():
        if c.error is not None:
            run.results["errors"].append(f"per-leaf {name[0]} {name[1]}: {c.error}")
    shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------
# peak memory
# --------------------------------------------------------------------------


def bench_memory(run: Run) -> None:
    specs: list[tuple[str, str, dict[str, Any], int]] = []  # name, op, spec, tree bytes
    base = {"size": run.size, "layers": run.args.layers, "scratch": str(run.work)}
    tree_bytes = {k: C.tree_nbytes(t) for k, t in run.trees.items()}
    case_by_name = {c.name: c for c in C.format_cases(run.args.layers)}
    src_dirs: dict[str, Path] = {}

    def source_dir(name: str) -> Path | None:
        """A directory holding ``name``'s checkpoint (the throughput run's, else a new one)."""
        if name in src_dirs:
            return src_dirs[name]
        d = run.work / "cases" / slug(name)
        if not d.exists():
            case = case_by_name[name]
            d = run.work / "memsrc" / slug(name)
            d.mkdir(parents=True, exist_ok=True)
            try:
                ptio.save(
                    d / case.dest,
                    run.trees[case.tree],
                    durable=False,
                    **C.save_kwargs(case, run.trees, run.configs),
                )
            except Exception as exc:
                run.results["errors"].append(f"memory {name}: {type(exc).__name__}: {exc}"[:300])
                return None
        src_dirs[name] = d
        return d

    for case in C.format_cases(run.args.layers):
        for op in ("save", "load"):
            if run.wanted("memory", f"{case.name} {op}"):
                d = source_dir(case.name) if op == "load" else run.work
                if d is not None:
                    specs.append(
                        (
                            case.name,
                            op,
                            {**base, "op": op, "case": case.name, "dir": str(d)},
                            tree_bytes[case.tree],
                        )
                    )
    for src, to in CONVERSIONS:
        label = f"{src} convert to {to}"
        if run.wanted("memory", label) and (d := source_dir(src)) is not None:
            spec = {
                **base,
                "op": "convert",
                "case": src,
                "dir": str(d),
                "to": to,
                "dest": f"converted.{to}",
            }
            specs.append((src, f"convert to {to}", spec, tree_bytes[case_by_name[src].tree]))
    for peer in P.available():
        for op in ("save", "load"):
            if not run.wanted("memory", f"{peer.name} {op}"):
                continue
            d = run.work / "memsrc" / slug(peer.name)
            if op == "load" and not (d / peer.dest).exists():
                d.mkdir(parents=True, exist_ok=True)
                peer.save(d / peer.dest, run.trees["mlp"])
            spec = {**base, "op": op, "case": f"peer:{peer.name}", "dir": str(d)}
            specs.append((f"peer {peer.name}", op, spec, tree_bytes["mlp"]))
    if not specs:
        return
    run.log(f"memory: {len(specs)} cases, one process each")
    rows = []
    for name, op, spec, tb in specs:
        res = peakmem.measure(spec)
        row: dict[str, Any] = {
            "name": name if name.startswith("peer") else f"pytreeio {name}",
            "op": op,
            "tree": tb,
            **res,
        }
        if "error" not in res:
            limit = tb + report.TARGETS["memory_slack"]
            is_peer = name.startswith("peer")
            row["verdict"] = (
                "-"
                if is_peer
                else report.verdict([(f"> {limit / 1e6:.0f} MB", res["added"] <= limit)])
            )
        else:
            run.log(f"  memory {name} {op}: {res['error']}")
        rows.append(row)
    run.results["memory"] = rows
    shutil.rmtree(run.work / "memsrc", ignore_errors=True)


# --------------------------------------------------------------------------
# inspect, import, lazy and async
# --------------------------------------------------------------------------


def _best(fn: Callable[[], Any], repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_inspect(run: Run) -> list[dict[str, Any]]:
    """``inspect`` of every format's checkpoint of ``--inspect-size`` MB (the target: < 50 ms).

    Each format saves a tree of that size of its own kind (the MLP, or a Tiny
    Llama model), one at a time so that only one such tree is held; the best
    of several ``inspect`` calls counts (the first one warms the page cache).
    """
    target = int(run.args.inspect_size * (1 << 20))
    rows = []
    built: dict[str, Any] = {}
    for case in C.format_cases(run.args.layers):
        if case.load_options or not run.wanted("misc", f"inspect {case.name}"):
            continue  # a load option is no different file to inspect
        if case.tree not in built:
            built.clear()  # one big tree at a time
            built.update(zip(("trees", "configs"), C.build_trees(target, run.args.layers)))
        trees, configs = built["trees"], built["configs"]
        path = run.work / "inspect" / slug(case.name) / case.dest
        path.parent.mkdir(parents=True)
        try:
            ptio.save(path, trees[case.tree], durable=False, **C.save_kwargs(case, trees, configs))
            size = sum(p.stat().st_size for p in path.parent.rglob("*") if p.is_file())
            tensors = len(ptio.inspect(path).entries)
            t = _best(lambda p=path: ptio.inspect(p), max(run.repeat, 5))
        except Exception as exc:  # a benchmark reports and goes on
            run.results["errors"].append(f"inspect {case.name}: {exc!r}")
            continue
        finally:
            shutil.rmtree(path.parent, ignore_errors=True)
        ok = t < report.TARGETS["inspect_s"]
        rows.append(
            {
                "name": f"inspect {case.name} ({size / 1e9:.2f} GB, {tensors} entries)",
                "seconds": t,
                "result": f"{t * 1e3:.2f} ms",
                "verdict": report.verdict([(f">= {report.TARGETS['inspect_s'] * 1e3:.0f} ms", ok)])
                if size >= 1 << 30
                else "- (file < 1 GiB)",
            }
        )
    return rows


_IMPORT_PROBE = (
    "import sys, time; t0 = time.perf_counter(); import numpy; t1 = time.perf_counter(); "
    "import pytreeio; t2 = time.perf_counter(); "
    "print(t1 - t0, t2 - t1, int(any(m in sys.modules for m in ('jax', 'flax', 'optax', 'orbax'))))"
)


def _import_env(cache: Path) -> dict[str, str]:
    """A fresh process's environment as users have it: bytecode cached, not recompiled.

    This environment may set ``PYTHONDONTWRITEBYTECODE=1``, which makes every
    fresh process compile pytreeio from source; users import from ``.pyc``
    files.  The probe runs with that variable removed and
    ``PYTHONPYCACHEPREFIX`` pointing at a cache directory warmed first.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(cache)
    return env


def bench_import(run: Run) -> list[dict[str, Any]]:
    if not run.wanted("misc", "import"):
        return []
    env = _import_env(run.work / "pycache")
    probe = [sys.executable, "-c", _IMPORT_PROBE]
    subprocess.run(probe, capture_output=True, text=True, check=True, env=env)  # warms the cache
    numpy_t, added, heavy = math.inf, math.inf, 0
    for _ in range(max(run.repeat, 7)):
        out = subprocess.run(probe, capture_output=True, text=True, check=True, env=env).stdout
        numpy_s, added_s, heavy_s = out.split()
        numpy_t, added = min(numpy_t, float(numpy_s)), min(added, float(added_s))
        heavy = max(heavy, int(heavy_s))
    ok = added <= report.TARGETS["import_s"]
    note = "; jax/flax/optax/orbax imported!" if heavy else "; no jax/flax/optax/orbax imported"
    return [
        {
            "name": "`import pytreeio` after `import numpy` (fresh process, warm bytecode cache, "
            "best)",
            "seconds": added,
            "numpy_seconds": numpy_t,
            "heavy_imports": bool(heavy),
            "result": f"+{added * 1e3:.1f} ms (numpy itself {numpy_t * 1e3:.1f} ms){note}; "
            "PYTHONDONTWRITEBYTECODE unset, PYTHONPYCACHEPREFIX on a cache warmed by one "
            "process first",
            "verdict": report.verdict(
                [(f"> {report.TARGETS['import_s'] * 1e3:.0f} ms", ok and not heavy)]
            ),
        }
    ]


def bench_lazy(run: Run) -> list[dict[str, Any]]:
    """A partial load (one tensor of the tree) through ``ptio.open``, when the API exists."""
    if not hasattr(ptio, "open"):
        return [
            {
                "name": "partial load (`ptio.open`)",
                "result": "skipped: no ptio.open",
                "verdict": "-",
            }
        ]
    rows = []
    tree = run.trees["mlp"]
    key = "params/Dense_0/kernel"
    nbytes = tree["params"]["Dense_0"]["kernel"].nbytes
    open_fn: Callable[..., Any] = ptio.open  # type: ignore[attr-defined]
    for fmt in ("msgpack", "safetensors"):
        if not run.wanted("misc", f"partial {fmt}"):
            continue
        path = run.work / "cases" / fmt / f"tree.{fmt}"
        if not path.exists():
            path = run.work / f"lazy.{fmt}"
            ptio.save(path, tree, durable=False)

        def one(p: Path = path) -> Any:
            with open_fn(p) as view:
                return np.asarray(view[key])

        try:
            got = one()
            if not np.array_equal(got, tree["params"]["Dense_0"]["kernel"]):
                raise AssertionError("the partial load returned other values")
            t_one = _best(one, max(run.repeat, 3))
            t_full = _best(lambda p=path: ptio.load(p), max(run.repeat, 3))
            rows.append(
                {
                    "name": f"partial load, {fmt}: 1 tensor ({nbytes / 1e6:.0f} MB) via `ptio.open`",
                    "seconds": t_one,
                    "full_seconds": t_full,
                    "result": f"{t_one * 1e3:.1f} ms vs full load {t_full * 1e3:.1f} ms "
                    f"({nbytes / max(t_one, 1e-9) / 1e9:.2f} GB/s)",
                    "verdict": "-",
                }
            )
        except Exception as exc:
            rows.append(
                {
                    "name": f"partial load, {fmt}",
                    "result": f"error: {type(exc).__name__}: {exc}"[:200],
                    "verdict": "-",
                }
            )
    return rows


def bench_async(run: Run) -> list[dict[str, Any]]:
    """Blocking time of ``ptio.save_async`` against the whole durable save, when it exists."""
    if not hasattr(ptio, "save_async"):
        return [
            {
                "name": "`ptio.save_async` blocking time",
                "result": "skipped: no ptio.save_async",
                "verdict": "-",
            }
        ]
    if not run.wanted("misc", "async"):
        return []
    tree = run.trees["mlp"]
    save_async: Callable[..., Any] = ptio.save_async  # type: ignore[attr-defined]
    d = run.work / "async"
    d.mkdir(exist_ok=True)
    blocking, full, sync = math.inf, math.inf, math.inf
    try:
        for i in range(run.repeat):
            fresh(d / "a.safetensors")()
            t0 = time.perf_counter()
            fut = save_async(d / "a.safetensors", tree)
            t1 = time.perf_counter()
            fut.result()
            t2 = time.perf_counter()
            blocking, full = min(blocking, t1 - t0), min(full, t2 - t0)
            fresh(d / "s.safetensors")()
            sync = min(sync, _best(lambda: ptio.save(d / "s.safetensors", tree), 1))
            del i
    except Exception as exc:
        return [
            {
                "name": "`ptio.save_async`",
                "result": f"error: {type(exc).__name__}: {exc}"[:200],
                "verdict": "-",
            }
        ]
    shutil.rmtree(d, ignore_errors=True)
    return [
        {
            "name": f"`ptio.save_async` (safetensors, durable, {C.tree_nbytes(tree) / 1e6:.0f} MB)",
            "seconds": blocking,
            "result": f"blocks {blocking * 1e3:.1f} ms; done after {full * 1e3:.0f} ms; "
            f"`ptio.save` {sync * 1e3:.0f} ms",
            "verdict": "-",
        }
    ]


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=512, help="tree size in MiB (default 512)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--only", default=None, help="regex searched in 'section:case' names")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where latest.json/.md go")
    parser.add_argument("--dir", default=None, help="file system to measure (default: temp dir)")
    parser.add_argument("--layers", type=int, default=C.REFERENCE_LAYERS, help="MLP layers")
    parser.add_argument("--leaves", type=int, default=2000, help="leaves of the per-leaf tree")
    parser.add_argument("--inspect-size", type=float, default=1024, help="inspect file MiB")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory section")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    run = Run(args)
    try:
        from report import machine

        run.results["machine"] = machine(run.work)
        run.results["config"] = {
            "size_mib": args.size,
            "tree_mb": C.tree_nbytes(run.trees["mlp"]) / 1e6,
            "leaves": len(ptio.flatten(run.trees["mlp"])),
            "tinyllama_config": run.configs["tinyllama"],
            "repeat": run.repeat,
            "only": args.only,
            "page_cache": "loads read page-cached files (each read once before the timed rounds)",
        }
        run.log(f"work dir {run.work}; tree {run.results['config']['tree_mb']:.0f} MB")
        bench_throughput(run)
        bench_per_leaf(run)
        if not args.no_memory:
            bench_memory(run)
        misc = bench_inspect(run) + bench_import(run) + bench_lazy(run) + bench_async(run)
        if misc:
            run.results["misc"] = misc
        run.results["machine"]["loadavg_end"] = report._loadavg()
        run.results["seconds"] = time.perf_counter() - t_start
    finally:
        shutil.rmtree(run.work, ignore_errors=True)
    md = report.markdown(run.results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(run.results, indent=1, default=str) + "\n")
    (args.out / "latest.md").write_text(md + "\n")
    print(md)
    print(f"\n({run.results['seconds']:.0f} s; results in {args.out}/latest.json and latest.md)")
    return run.results


if __name__ == "__main__":
    main()
