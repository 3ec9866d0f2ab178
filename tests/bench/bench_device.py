"""Device <-> host <-> file paths on an accelerator (run on a GPU machine; not a test).

``python tests/bench/bench_device.py [--mb 1024]`` measures, in one run, cases
interleaved, on the default JAX device, with device-resident trees:

* the raw paths: ``device->host`` (``jax.device_get`` of the tree, the
  transfer alone), ``transfer + raw write`` (the transfer, then one ``write``
  per leaf) and ``raw read + device_put`` (one ``readv`` per leaf, then
  ``jax.device_put``);
* every format of the CPU benchmark (``cases.format_cases``: msgpack,
  safetensors, Tiny Llama, the netcl formats, DataCode, cl-waffe2, bullet):
  ``ptio.save`` of the device-resident tree (``durable=False``)
  against transfer + raw write, and ``ptio.load`` into ``like`` leaves of
  ``jax.ShapeDtypeStruct`` carrying the device's sharding against raw read +
  ``device_put``;
* the peers on the same device-resident tree: flax.serialization, orbax
  (``StandardCheckpointer``, restored with the device's sharding) and
  safetensors.numpy (which needs host arrays: the transfer is counted);
* ``save_async``: the time the caller is blocked against the whole save;
* bullet's quantised save from a device-resident tree (the quantisation
  runs on the device, the integers come to the host) and from the same tree
  on the host.

Every timed call gets device arrays made just before it (a device-side copy,
not timed): a jax array keeps its host copy once fetched, so reusing one tree
would time the transfer only once.  Best of ``--repeats`` rounds after a
warm-up round; ratios are the raw path's time over ours (above 1 is faster
than the raw path).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases as C
import peers as P

import pytreeio as ptio

#: A case takes the device-resident trees by kind ("mlp", "tinyllama"), fresh for each call.
Case = Callable[[dict[str, Any]], Any]

#: Where each save or load case writes or reads (a file or directory; for a load, the files
#: it reads when it reads fewer than all): its raw baseline moves as many bytes.
WRITTEN: dict[str, tuple[Path, list[str] | None]] = {}


def _bytes_at(path: Path, files: list[str] | None = None) -> int:
    if files is not None:
        return sum((path / f).stat().st_size for f in files)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return sum(f.stat().st_size for f in path.parent.glob(path.name + "*") if f.is_file())


def best_of(
    cases: dict[str, Case], fresh: Callable[[], dict[str, Any]], repeats: int
) -> dict[str, float]:
    """Best wall time of each case over ``repeats`` interleaved rounds (after one warm-up round)."""
    best = dict.fromkeys(cases, float("inf"))
    for fn in cases.values():
        fn(fresh())
        ptio.wait_saves()
    for _ in range(repeats):
        for name, fn in cases.items():
            ptio.wait_saves()  # a save_async case's write would run into the next case
            trees = fresh()
            t0 = time.perf_counter()
            fn(trees)
            best[name] = min(best[name], time.perf_counter() - t0)
            del trees
    return best


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


def raw_cases(tree: Any, path: Path, device: Any) -> dict[str, Case]:
    """The transfer alone, transfer + raw write, raw read + device_put, for the MLP's bytes."""
    leaves = _leaves(tree)

    def to_host(trees: dict[str, Any]) -> list[np.ndarray]:
        return [np.asarray(v) for v in jax.device_get(_leaves(trees["mlp"]))]

    def raw_save(trees: dict[str, Any]) -> None:
        arrays = to_host(trees)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for a in arrays:
                os.write(fd, memoryview(a).cast("B"))
        finally:
            os.close(fd)

    def raw_load(trees: dict[str, Any]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            bufs = [np.empty(v.shape, v.dtype) for v in leaves]
            for buf in bufs:
                os.readv(fd, [memoryview(buf).cast("B")])
            jax.block_until_ready(jax.device_put(bufs, device))
        finally:
            os.close(fd)

    return {
        "device->host": to_host,
        "transfer + raw write": raw_save,
        "raw read + device_put": raw_load,
    }


def format_cases(
    host_trees: dict[str, Any],
    configs: dict[str, Any],
    likes: dict[str, Any],
    out: Path,
    layers: int,
) -> dict[str, Case]:
    """``save <name>`` and ``load <name> to device`` for every format of the CPU benchmark."""
    cases: dict[str, Case] = {}
    for case in C.format_cases(layers):
        if case.load_options:  # the CRC-free npz read is a CPU-side variant
            continue
        kwargs = C.save_kwargs(case, host_trees, configs)
        where = out / case.name.replace(" ", "-")
        where.mkdir()
        dest = where / case.dest

        def save(
            trees: dict[str, Any], d: Path = dest, c: C.FormatCase = case, kw: Any = kwargs
        ) -> None:
            ptio.save(d, trees[c.tree], durable=False, **kw)

        def load(trees: dict[str, Any], d: Path = dest, c: C.FormatCase = case) -> Any:
            return jax.block_until_ready(ptio.load(d, like=likes[c.tree], format=c.format))

        cases[f"save {case.name}"] = save
        cases[f"load {case.name} to device"] = load
        WRITTEN[f"save {case.name}"] = (where, None)
        WRITTEN[f"load {case.name} to device"] = (
            (dest, case.load_files) if case.load_files else (where, None)
        )
    return cases


def peer_cases(like: Any, out: Path) -> dict[str, Case]:
    """flax.serialization, orbax and safetensors.numpy on the device-resident tree."""
    cases: dict[str, Case] = {}
    names = {p.name for p in P.available()}
    if "flax.serialization" in names:
        flax_path = out / "peer.msgpack"
        cases["save flax.serialization"] = lambda t: P.flax_save(flax_path, t["mlp"])
        cases["load flax.serialization to device"] = lambda t: jax.block_until_ready(
            jax.device_put(P.flax_load(flax_path, like))
        )
    if "orbax" in names:
        orbax_path = out / "peer-orbax"

        def orbax_load(trees: dict[str, Any]) -> Any:
            return jax.block_until_ready(P._checkpointer().restore(orbax_path.absolute(), like))

        cases["save orbax"] = lambda t: P.orbax_save(orbax_path, t["mlp"])
        cases["load orbax to device"] = orbax_load
    if "safetensors.numpy" in names:
        st_path = out / "peer.safetensors"
        cases["save safetensors.numpy"] = lambda t: P.safetensors_save(st_path, t["mlp"])
        cases["load safetensors.numpy to device"] = lambda t: jax.block_until_ready(
            jax.device_put(P.safetensors_load(st_path, like))
        )
    return cases


def async_cases(out: Path) -> dict[str, Case]:
    """``save_async``: the caller's blocking time and the whole save, safetensors and msgpack."""
    cases: dict[str, Case] = {}
    for fmt, suffix in (("safetensors", ".safetensors"), ("msgpack", ".msgpack")):
        path, whole_path = out / f"async{suffix}", out / f"async-whole{suffix}"

        def blocking(trees: dict[str, Any], p: Path = path) -> None:
            ptio.save_async(p, trees["mlp"], durable=False)

        def whole(trees: dict[str, Any], p: Path = whole_path) -> None:
            ptio.save_async(p, trees["mlp"], durable=False).result()

        cases[f"save_async blocking ({fmt})"] = blocking
        cases[f"save_async whole ({fmt})"] = whole
    return cases


def quant_cases(mlp_host: Any, out: Path) -> dict[str, Case]:
    """bullet's quantised save (the quantisation runs where the tree is) from the device and host."""
    layout = {"saved_format": C.quantised_layout(mlp_host)}
    device_dir, host_dir = out / "bullet-q-device", out / "bullet-q-host"
    WRITTEN["bullet quantised save (device tree)"] = (device_dir, None)
    WRITTEN["bullet quantised save (host tree)"] = (host_dir, None)
    return {
        "bullet quantised save (device tree)": lambda t: ptio.save(
            device_dir, t["mlp"], format="bullet", meta=layout, durable=False
        ),
        "bullet quantised save (host tree)": lambda t: ptio.save(
            host_dir, mlp_host, format="bullet", meta=layout, durable=False
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024, help="tree size in MB")
    parser.add_argument("--layers", type=int, default=C.REFERENCE_LAYERS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--only", default="", help="run only the cases matching this regex")
    args = parser.parse_args()

    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    host_trees, configs = C.build_trees(args.mb << 20, args.layers)
    trees = {k: jax.block_until_ready(jax.device_put(t, device)) for k, t in host_trees.items()}
    copy = jax.jit(lambda t: jax.tree_util.tree_map(lambda a: a * 1, t))

    def fresh() -> dict[str, Any]:
        return jax.block_until_ready(copy(trees))

    likes = {
        k: jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), t
        )
        for k, t in trees.items()
    }
    mlp = trees["mlp"]
    nbytes = C.tree_nbytes(host_trees["mlp"])
    out = Path(tempfile.mkdtemp(prefix="pytreeio-device-"))
    try:
        cases = raw_cases(mlp, out / "raw.bin", device)
        cases |= format_cases(host_trees, configs, likes, out, args.layers)
        if not args.no_peers:
            cases |= peer_cases(likes["mlp"], out)
        cases |= async_cases(out)
        cases |= quant_cases(host_trees["mlp"], out)
        if args.only:
            cases = {k: v for k, v in cases.items() if re.search(args.only, k)}
        try:
            best = best_of(cases, fresh, args.repeats)
        finally:
            ptio.wait_saves()
        moved = {name: _bytes_at(*WRITTEN[name]) for name in best if name in WRITTEN}
        report(best, device, nbytes, moved)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def report(best: dict[str, float], device: Any, nbytes: int, moved: dict[str, int]) -> None:
    """One line per case; a save or load is compared with the raw path moving as many bytes."""
    print(
        f"device: {device.device_kind} ({jax.default_backend()}, jax {jax.__version__}); "
        f"tree {nbytes / 1e6:.0f} MB"
    )
    save_raw, load_raw = best["transfer + raw write"], best["raw read + device_put"]
    for name, seconds in best.items():
        size = moved.get(name, nbytes)
        ratio = ""
        if name.startswith("save ") or name.startswith("bullet quantised save"):
            ratio = f"  {save_raw * size / nbytes / seconds:5.2f}x of transfer + raw write"
        elif name.startswith("load "):
            ratio = f"  {load_raw * size / nbytes / seconds:5.2f}x of raw read + device_put"
        print(f"  {name:<46} {seconds * 1e3:9.1f} ms  {size / seconds / 1e9:6.2f} GB/s{ratio}")


if __name__ == "__main__":
    main()
