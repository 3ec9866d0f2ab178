"""Device <-> host <-> file paths on an accelerator (run on a GPU machine; not a test).

``python tests/bench/bench_device.py [--mb 1024]`` measures, in one run, on the
default JAX device:

* ``device->host``: ``np.asarray`` of a device-resident tree (the transfer alone);
* ``save``: ``ptio.save`` of the device-resident tree (safetensors and msgpack,
  ``durable=False``) against transfer + raw ``write`` of the same bytes;
* ``save_async``: the time the caller is blocked, against the full save;
* ``load to device``: ``ptio.load`` with ``jax.ShapeDtypeStruct`` leaves that carry
  the device's sharding, against raw read + ``jax.device_put``;
* ``quantise``: bullet's quantisation kernel on a device-resident array
  (:func:`pytreeio.quant.quantise` given a device-resident array: the kernel
  runs on the device, the i16 result comes to the host) and from a host array.

Best of ``--repeats`` runs, cases interleaved.  Ratios are ours / raw path.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pytreeio as ptio


def best_of(cases: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(cases, float("inf"))
    for fn in cases.values():
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024, help="tree size in MB")
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    device = jax.devices()[0]
    per = args.mb * (1 << 20) // args.leaves // 4
    key = jax.random.key(0)
    tree = {
        f"w{i:03d}": jax.random.normal(jax.random.fold_in(key, i), (per,), jnp.float32)
        for i in range(args.leaves)
    }
    jax.block_until_ready(tree)
    nbytes = sum(v.nbytes for v in tree.values())
    out = Path(tempfile.mkdtemp(prefix="pytreeio-device-"))
    raw_path = out / "raw.bin"

    def to_host() -> list[np.ndarray]:
        return [np.asarray(v) for v in jax.device_get(list(tree.values()))]

    def raw_save() -> None:
        arrays = to_host()
        fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for a in arrays:
                os.write(fd, memoryview(a).cast("B"))
        finally:
            os.close(fd)

    def raw_load() -> None:
        fd = os.open(raw_path, os.O_RDONLY)
        try:
            for v in tree.values():
                buf = np.empty(v.shape, v.dtype)
                os.readv(fd, [memoryview(buf).cast("B")])
                jax.device_put(buf, device).block_until_ready()
        finally:
            os.close(fd)

    sharding = jax.sharding.SingleDeviceSharding(device)
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in tree.items()}
    cases: dict[str, Callable[[], Any]] = {
        "device->host": to_host,
        "transfer + raw write": raw_save,
        "raw read + device_put": raw_load,
    }
    for fmt, suffix in (("safetensors", ".safetensors"), ("msgpack", ".msgpack")):
        path = out / f"tree{suffix}"
        cases[f"save {fmt}"] = lambda p=path: ptio.save(p, tree, durable=False)
        cases[f"load {fmt} to device"] = lambda p=path: jax.block_until_ready(
            ptio.load(p, like=like)
        )
    if hasattr(ptio, "save_async"):
        async_path = out / "async.safetensors"

        def blocking() -> None:
            fut = ptio.save_async(async_path, tree, durable=False)
            blocking.last = fut  # type: ignore[attr-defined]

        def full_async() -> None:
            ptio.save_async(async_path, tree, durable=False).result()

        cases["save_async blocking (safetensors)"] = blocking
        cases["save_async total (safetensors)"] = full_async

    from pytreeio import quant

    x = tree["w000"].reshape(-1, 256)
    host_x = np.asarray(x)
    kernel = getattr(quant, "quantise", None)
    if kernel is not None:
        cases["quantise (device-resident input)"] = lambda: jax.block_until_ready(
            kernel(x, 255, "i16", round=True)
        )
        cases["quantise + transpose (device-resident input)"] = lambda: jax.block_until_ready(
            kernel(x, 255, "i16", round=True, transpose=True)
        )
        cases["quantise (host input)"] = lambda: kernel(host_x, 255, "i16", round=True)

    try:
        best = best_of(cases, args.repeats)
    finally:
        if hasattr(ptio, "wait_saves"):
            ptio.wait_saves()
    print(f"device: {device.device_kind} ({jax.default_backend()}); tree {nbytes / 1e6:.0f} MB")
    raw = {"save": best["transfer + raw write"], "load": best["raw read + device_put"]}
    for name, seconds in best.items():
        size = x.nbytes if name.startswith("quantise") else nbytes
        ratio = ""
        if name.startswith("save") and "blocking" not in name:
            ratio = f"  {raw['save'] / seconds:5.2f}x of transfer + raw write"
        elif name.startswith("load"):
            ratio = f"  {raw['load'] / seconds:5.2f}x of raw read + device_put"
        print(f"  {name:<36} {seconds * 1e3:9.1f} ms  {size / seconds / 1e9:6.2f} GB/s{ratio}")


if __name__ == "__main__":
    main()
