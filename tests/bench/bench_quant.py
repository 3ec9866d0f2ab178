"""Throughput of pytreeio's jit quantisation against memcpy and a numpy float64 implementation.

Run with ``python tests/bench/bench_quant.py [--elements N] [--repeats R]`` (``--elements
67108864`` for the 256 MB inputs the target speaks of: >= 0.5x memcpy bandwidth on CPU).
Not a test.  Cases are interleaved round-robin in one run and the best time of
each is reported as GB/s of float32 input and as ratios to the baselines of
the same run (absolute numbers drift on shared machines; ratios mean more):

* ``memcpy``: ``np.copyto`` of the float32 input into a preallocated buffer
  (host), ``x.copy()`` (host, into fresh pages, as every new array is), and a
  jit-compiled copy of a device-resident array (device);
* ``numpy``: float64 scale, trunc or round half away from zero, range check,
  cast (and ``.T`` copy), as a straightforward numpy implementation does it;
* ``pytreeio``: :func:`pytreeio.quant.quantise` from a numpy array to a fresh
  numpy array (on CPU: :mod:`pytreeio.quant_host`, numpy in cache-sized blocks
  on every core, float32 where exact, range check in the same pass; elsewhere
  the jit kernel, transfers included);
* ``pytreeio numpy`` / ``pytreeio numba``: the host path forced onto numpy's
  blocks (``PYTREEIO_NO_NUMBA=1``) or onto the compiled kernels
  (:mod:`pytreeio.kernels`; skipped when numba is not installed), and the
  same for a bare transpose copy (``copy_transposed``) of the input;
* ``pytreeio + transpose (into buf)``: the fused transposing kernel
  (:func:`pytreeio.kernels.quantise_transposed`) on every core into a preallocated,
  cache-line aligned result, as memcpy's destination is (a new array's pages
  are faulted in and zeroed by the kernel first, as ``np.copy (fresh buffer)`` shows);
* ``pytreeio range check``: :func:`pytreeio.quant.check_quantisable` alone (the pass a
  streaming writer makes before writing anything); ``pytreeio bands``: the same quantisation
  streamed in bands (:func:`pytreeio.quant.quantise_bands`: a producer thread, the taker
  computing too when a band is not ready), every band taken in order;
* ``jit from numpy``: the jit kernel from the same numpy array to a numpy
  array (what ``quantise`` ran on CPU before the host path), and the jit kernels
  on a device-resident array (the transpose is a second kernel on the result, as in
  ``quant.quantise``).

Every case quantises to i16 at scale 255 with rounding (``trunc``: truncating), from
values that fit.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pytreeio import kernels, quant, quant_host, transpose


def numpy_quantise(x: np.ndarray, scale: int, transpose: bool) -> np.ndarray:
    v = x.astype(np.float64) * scale
    t = np.trunc(v)
    t += np.where(np.abs(v - t) >= 0.5, np.sign(v), 0.0)
    if not (np.all(t >= -32768) and np.all(t <= 32767)):
        raise OverflowError("does not fit")
    q = t.astype(np.int16)
    return np.ascontiguousarray(q.T) if transpose else q


def best_of(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """The fastest time of each function, the functions run round-robin."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():  # warm up: compile, fault pages in
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--elements", type=int, default=1 << 24, help="float32 elements (default 16M)"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--host-only", action="store_true", help="skip the device-kernel cases")
    args = parser.parse_args()

    rows = 1 << 12
    cols = max(1, args.elements // rows)
    rng = np.random.default_rng(0)
    x = rng.uniform(-100.0, 100.0, (rows, cols)).astype(np.float32)
    nbytes = x.nbytes
    copy_dst = np.empty_like(x)
    x_dev = jax.device_put(x)
    dev_copy = jax.jit(lambda a: a.copy())
    scale64 = np.float64(255)

    def on_device(transpose: bool) -> Callable[[], Any]:
        """What quantise runs, on a device-resident array, without the transfers."""
        kernel = quant._quantise_kernel("i16", True)

        def run() -> Any:
            with jax.enable_x64(True):
                q, ok = kernel(x_dev, scale64)
            if transpose:
                q = quant.transpose_to_device(q, (1, 0))
            return jax.block_until_ready((q, ok))

        return run

    def jit_from_numpy(transpose: bool) -> Any:
        with jax.enable_x64(True):
            q, ok = quant._quantise_kernel("i16", True)(x, scale64)
        if transpose:
            q = quant.transpose_to_device(q, (1, 0))
        return np.asarray(q), bool(ok)

    cases: dict[str, Callable[[], Any]] = {
        "memcpy (host)": lambda: np.copyto(copy_dst, x),
        "np.copy (fresh buffer)": lambda: x.copy(),
        "copy (device)": lambda: dev_copy(x_dev).block_until_ready(),
        "numpy": lambda: numpy_quantise(x, 255, False),
        "numpy + transpose": lambda: numpy_quantise(x, 255, True),
        "pytreeio": lambda: quant.quantise(x, 255, "i16", round=True),
        "pytreeio + transpose": lambda: quant.quantise(x, 255, "i16", round=True, transpose=True),
        "pytreeio trunc": lambda: quant.quantise(x, 255, "i16"),
        "jit from numpy": lambda: jit_from_numpy(False),
        "jit from numpy + transpose": lambda: jit_from_numpy(True),
        "kernel (device)": on_device(False),
        "kernel + transpose (device)": on_device(True),
    }

    def backend(numba: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            if numba:
                os.environ.pop("PYTREEIO_NO_NUMBA", None)
            else:
                os.environ["PYTREEIO_NO_NUMBA"] = "1"
            try:
                return fn()
            finally:
                os.environ.pop("PYTREEIO_NO_NUMBA", None)

        return run

    def bands(transpose_: bool) -> Callable[[], Any]:
        """Every band of a streamed quantisation taken in order (a producer thread, the taker helping)."""

        def run() -> None:
            stream = quant.quantise_bands([(x, 255, "i16", True, transpose_)])
            assert stream is not None
            for b in stream.of_job[0]:
                stream.take(b)

        return run

    if quant.on_cpu():
        cases["pytreeio range check"] = lambda: quant.check_quantisable(x, 255, "i16", round=True)
        cases["pytreeio bands"] = bands(False)
        cases["pytreeio bands + transpose"] = bands(True)
    t_out = np.empty(x.shape[::-1], x.dtype)
    for label, numba in (("numpy", False), ("numba", True)):
        if numba and not kernels.available():
            continue
        cases[f"pytreeio {label}"] = backend(
            numba, lambda: quant.quantise(x, 255, "i16", round=True)
        )
        cases[f"pytreeio {label} trunc"] = backend(numba, lambda: quant.quantise(x, 255, "i16"))
        cases[f"pytreeio {label} + transpose"] = backend(
            numba, lambda: quant.quantise(x, 255, "i16", round=True, transpose=True)
        )
        cases[f"copy_transposed f32 {label}"] = backend(
            numba, lambda: transpose.copy_transposed(x.T, t_out)
        )
    if kernels.available():
        q_out = quant_host.aligned_empty(x.size * 2).view(np.int16).reshape(x.shape[::-1])
        cases["pytreeio + transpose (into buf)"] = lambda: quant_host._compiled_transposed(
            x, 255, np.dtype(np.int16), True, out=q_out
        )
    if args.host_only:
        cases = {k: v for k, v in cases.items() if "device" not in k}
    # the implementations agree before anything is timed
    assert np.array_equal(
        numpy_quantise(x, 255, True), quant.quantise(x, 255, "i16", round=True, transpose=True)
    )
    # Device cases are timed in a group of their own, after the host ones: round-robin with
    # them, a sub-millisecond device kernel ran after 100+ ms of host work and read 7-15x
    # slower on an H100 than back to back (most likely the GPU's clocks dropping while it
    # idles between calls); grouped, each reads what the kernel does under steady load.
    host = {k: v for k, v in cases.items() if "device" not in k}
    best = best_of(host, args.repeats)
    device = {k: v for k, v in cases.items() if "device" in k}
    if device:
        time.sleep(1.0)
        best |= best_of(device, args.repeats)

    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), {nbytes / 1e6:.0f} MB float32 in, i16 out"
    )
    print(f"{'case':<30} {'GB/s':>8} {'x memcpy':>9} {'vs numpy':>9}")
    for name, t in best.items():
        base = best["copy (device)"] if "device" in name else best["memcpy (host)"]
        if "device" in name and "copy (device)" not in best:
            continue
        numpy_t = best["numpy + transpose" if "transpose" in name else "numpy"]
        vs_numpy = f"{numpy_t / t:8.2f}x" if name.startswith(("pytreeio", "kernel", "jit")) else ""
        if name.startswith("copy_transposed"):
            vs_numpy = ""
        print(f"{name:<30} {nbytes / t / 1e9:8.2f} {base / t:8.2f}x {vs_numpy:>9}")
    print(
        "(x memcpy: bandwidth as a fraction of the memcpy of the same input, higher is better, "
        "target >= 0.5 for pytreeio on host; vs numpy: speed-up)"
    )


if __name__ == "__main__":
    main()
