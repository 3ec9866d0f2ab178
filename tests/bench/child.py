"""One measurement in a fresh process: ``python child.py SPEC_JSON`` prints one JSON line.

The parent (``bench_all.py``) starts one process per measurement, with
``PYTHONPATH`` naming the checkout whose ``pytreeio`` it measures.  Operations
(``spec["op"]``):

* ``load``: import numpy, jax and pytreeio (as a training script's restore
  does), then time one ``pytreeio.load`` of the file, no ``like``;
* ``peer``: the same with a peer library's load;
* ``raw``: import numpy only, then time one raw read of the same files;
* ``rawdir``: the same for a directory of one file per tensor;
* ``prepare``: save every checkpoint the loads read (untimed), and list their files;
* ``warmup``: compile a side's package and load small files once (untimed);
* ``saves``: one round of saves against raw writes of the same bytes (in-process,
  after a warm-up save of a tiny tree of every format).

With ``spec["drop"]`` a timed read starts with the page cache dropped
(``sync; echo 3 > /proc/sys/vm/drop_caches``, after the imports); the code the
load may still import (the pytreeio package, the cached bytecode)
is read back into the cache before the clock starts, so that only the
checkpoint's files are cold.  Memory is ``ru_maxrss`` after the load minus
``ru_maxrss`` just before it (after the imports).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import shutil
import sys
import sysconfig
import time
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _io() -> dict[str, int]:
    """``rchar`` (bytes read by read calls) and ``read_bytes`` (bytes read from storage)."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f)}
    except OSError:
        return {}


def _read_all(root: Path) -> None:
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    while f.read(1 << 20):
                        pass
            except OSError:
                pass


def drop_caches(code: list[Path]) -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    cached = Path(sys.pycache_prefix) if sys.pycache_prefix else stdlib / "__pycache__"
    for d in [*code, cached, stdlib / "lib-dynload"]:
        _read_all(d)


def timed(fn: Any, spec: dict[str, Any], code: list[Path]) -> dict[str, Any]:
    """Run ``fn`` once, timed; its time, memory added, reads and the arrays it returned."""
    if spec.get("drop"):
        drop_caches(code)
    gc.collect()
    base, io0 = _maxrss(), _io()
    t0 = time.perf_counter()
    out = fn()
    if "jax" in sys.modules:
        import jax

        out = jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    peak, io1 = _maxrss(), _io()
    leaves = _arrays(out)
    return {
        "seconds": seconds,
        "added": peak - base,
        "baseline": base,
        "leaves": len(leaves),
        "bytes": sum(int(a.nbytes) for a in leaves),
        **{k: io1[k] - io0[k] for k in ("rchar", "read_bytes") if k in io0 and k in io1},
    }


def _arrays(tree: Any) -> list[Any]:
    if "jax" in sys.modules:
        import jax

        return [a for a in jax.tree_util.tree_leaves(tree) if hasattr(a, "nbytes")]
    return [a for a in tree if hasattr(a, "nbytes")]


def _pytreeio() -> tuple[Any, list[Path]]:
    import jax  # noqa: F401  (a restore has jax imported)

    import pytreeio

    return pytreeio, [Path(pytreeio.__file__).parent]


def op_load(spec: dict[str, Any]) -> dict[str, Any]:
    ptio, code = _pytreeio()
    path, fmt, opts = Path(spec["path"]), spec["format"], spec.get("options", {})
    return {
        "module": ptio.__file__,
        **timed(lambda: ptio.load(path, format=fmt, **opts), spec, code),
    }


def op_peer(spec: dict[str, Any]) -> dict[str, Any]:
    import importlib

    import jax  # noqa: F401
    import peers

    peer = next(p for p in peers.PEERS if p.name == spec["peer"])
    mod = importlib.import_module(peer.module)
    code = [Path(mod.__file__).parent]
    return timed(lambda: peer.load(Path(spec["path"]), None), spec, code)


def op_raw(spec: dict[str, Any]) -> dict[str, Any]:
    import rawio

    read = rawio.READS[spec["read"]]
    files = [tuple(f) for f in spec["files"]]
    return timed(lambda: read(Path(spec["root"]), files), spec, [])


def op_rawdir(spec: dict[str, Any]) -> dict[str, Any]:
    import rawio

    return timed(lambda: rawio.read_dir_of_files(Path(spec["root"])), spec, [])


def _save(ptio: Any, case: Any, path: Path, trees: Any, configs: Any, durable: bool) -> None:
    import cases as C

    ptio.save(path, trees[case.tree], durable=durable, **C.save_kwargs(case, trees, configs))


def op_prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Save the loads' checkpoints (``work/load/CASE``, ``work/leaves/CASE``); list their files."""
    import cases as C
    import peers as P
    import rawio

    ptio, _ = _pytreeio()
    work = Path(spec["work"])
    peers = [p for p in P.PEERS if p.name in spec["peers"]]
    out: dict[str, Any] = {"load": {}, "leaves": {}}
    for kind, layers, trees, configs in _trees(spec):
        wanted = [c for c in C.format_cases(layers) if c.name in spec["cases"]]
        for case in wanted:
            d = work / kind / case.name
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            try:
                _save(ptio, case, d / case.dest, trees, configs, durable=False)
            except Exception as exc:  # reported; the other side may save it
                out[kind][case.name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            only = [f"{case.dest}/{f}" for f in case.load_files] if case.load_files else None
            out[kind][case.name] = {
                "files": rawio.file_set(d),
                "read_files": rawio.file_set(d, only),
                "tree_bytes": C.tree_nbytes(trees[case.tree]),
                "leaves": len(C.flat(trees[case.tree])),
            }
        if not spec.get("with_peers", True):
            continue
        reference = [p for p in P.available() if p.name == "safetensors.numpy"]
        for peer in peers if kind == "load" else reference:  # the per-tensor reference
            d = work / kind / f"peer {peer.name}"
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            peer.save(d / peer.dest, trees["mlp"])
            files = rawio.file_set(d)
            out[kind][f"peer {peer.name}"] = {
                "files": files,
                "read_files": files,
                "tree_bytes": C.tree_nbytes(trees["mlp"]),
                "leaves": len(C.flat(trees["mlp"])),
            }
        if kind == "leaves":  # the raw floor of a file per tensor
            d = work / kind / "raw file per tensor"
            shutil.rmtree(d, ignore_errors=True)
            rawio.write_dir_of_files(d, list(C.flat(trees["mlp"]).values()))
    return out


def _trees(spec: dict[str, Any]) -> Any:
    """(kind, layers, trees, configs): "load" of the throughput size, "leaves" of many tensors."""
    import cases as C

    yield ("load", spec["layers"], *C.build_trees(spec["size"], spec["layers"]))
    mlp = C.many_leaves_tree(spec["leaves"])
    tl_tree, tl_cfg = C.many_leaves_tinyllama(spec["leaves"])
    yield "leaves", len(mlp["params"]), {"mlp": mlp, "tinyllama": tl_tree}, {"tinyllama": tl_cfg}


def op_saves(spec: dict[str, Any]) -> dict[str, Any]:
    """One round: every case's save (``durable=False``) then a raw write of the same files;
    then the durable saves (default ``durable=True``) against raw write + fsync."""
    import cases as C
    import rawio

    ptio, _ = _pytreeio()
    work, layers = Path(spec["work"]), spec["layers"]
    wanted = [c for c in C.format_cases(layers) if c.name in spec["cases"]]
    tiny, tiny_cfg = C.build_trees(1 << 16, layers)
    for case in wanted:  # first saves import and compile: a one-time cost, as imports are
        with contextlib.suppress(Exception):  # a broken save is reported when timed
            _save(ptio, case, work / "warm" / case.name / case.dest, tiny, tiny_cfg, durable=False)
    shutil.rmtree(work / "warm", ignore_errors=True)
    trees, configs = C.build_trees(spec["size"], layers)
    out: dict[str, Any] = {}

    def clock(fn: Any, dest: Path) -> float:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        os.sync()  # no dirty pages of earlier writes
        gc.collect()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    runs = [(c, False) for c in wanted] + [(c, True) for c in wanted if c.name in spec["durable"]]
    for case, durable in runs:
        key = f"{case.name} (durable)" if durable else case.name
        d, raw = work / "save" / case.name, work / "save-raw" / case.name
        sources = list(C.flat(trees[case.tree]).values())
        try:
            t = clock(partial(_save, ptio, case, d / case.dest, trees, configs, durable), d)
            files = rawio.file_set(d)
            t_raw = clock(partial(rawio.raw_write, raw, files, sources, durable), raw)
            out[key] = {"save": t, "raw": t_raw, "bytes": sum(s for _, s in files)}
        except Exception as exc:
            out[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(raw, ignore_errors=True)
    return out


def op_warmup(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile the side's package and load each given file once, all untimed."""
    import compileall

    import peers as P

    ptio, code = _pytreeio()
    compileall.compile_dir(str(code[0]), quiet=2)
    for path, fmt, opts in spec["loads"]:
        with contextlib.suppress(Exception):  # a broken load is reported when timed
            ptio.load(path, format=fmt, **opts)
    for name, path in spec["peers"]:
        with contextlib.suppress(Exception):
            next(p for p in P.PEERS if p.name == name).load(Path(path), None)
    return {}


OPS = {
    "warmup": op_warmup,
    "load": op_load,
    "peer": op_peer,
    "raw": op_raw,
    "rawdir": op_rawdir,
    "prepare": op_prepare,
    "saves": op_saves,
}

if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    spec = json.loads(sys.argv[1])
    print(json.dumps(OPS[spec["op"]](spec)))
