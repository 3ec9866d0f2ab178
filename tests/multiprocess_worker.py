"""One process of the two-process sharded save and load (``jax.distributed`` on loopback, gloo).

Run by :mod:`tests.test_sharding` (and ``nox -s multiprocess``) as::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python tests/multiprocess_worker.py PROCESS_ID PORT DIRECTORY FORMAT[,FORMAT...]

Both processes build the same global arrays over a 2 x 2 mesh (processes x
local devices) with ``jax.make_array_from_callback``, save them into one file
with :func:`pytreeio.multihost.save_in_parts`, and load them back with sharded
``like`` leaves.  Each process prints one JSON line per format starting with ``RESULT``: the
bytes it read from the file (``read``), the bytes of the distinct slices it
holds (``held``) and the header's size (``header``, safetensors).  Process 0
also checks that the file is byte-identical to a single-process save of the
same values as numpy arrays.  Any failure exits non-zero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402


def values() -> dict[str, np.ndarray]:
    """The global arrays, as numpy (what every process holds slices of)."""
    return {
        # split over processes (axis 0) and local devices (axis 1): runs of 4 KiB
        "rows": np.arange(32 * 2048, dtype=np.float32).reshape(32, 2048),
        # split over processes along axis 1 (runs of 4 KiB: a page each)
        "cols": np.arange(32 * 2048, dtype=np.int32).reshape(32, 2048) * 3,
        "repl": np.arange(16 * 2048, dtype=np.uint16).reshape(16, 2048),
    }


def held_bytes(out: dict[str, Any], host: dict[str, np.ndarray]) -> int:
    """The bytes of the distinct blocks this process holds of ``out``'s arrays, each checked
    against the global value in ``host``."""
    held = 0
    for k in host:
        blocks = set()
        for shard in out[k].addressable_shards:
            assert np.asarray(shard.data).tobytes() == host[k][shard.index].tobytes(), k
            key = tuple((s.start, s.stop) for s in shard.index)
            if key not in blocks:
                blocks.add(key)
                held += np.asarray(shard.data).nbytes
    return held


def main() -> None:
    process_id, port, directory, formats = (
        int(sys.argv[1]),
        sys.argv[2],
        Path(sys.argv[3]),
        sys.argv[4].split(","),
    )
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=30,
    )
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices()).reshape(2, 2)
    assert [d.process_index for d in devices[:, 0]] == [0, 1], devices
    mesh = Mesh(devices, ("proc", "dev"))
    specs = {
        "rows": P("proc", "dev"),
        "cols": P(None, "proc"),  # replicated over local devices: replica 0 writes
        "repl": P("dev"),  # the same blocks in both processes: process 0 writes them
    }
    host = values()
    tree: dict[str, object] = {
        k: jax.make_array_from_callback(
            host[k].shape, NamedSharding(mesh, specs[k]), lambda idx, k=k: host[k][idx]
        )
        for k in host
    }
    tree["step"] = 7
    tree["bias"] = np.arange(5, dtype=np.float32)
    for fmt in formats:
        check(fmt, tree, host, specs, mesh, directory, process_id)
    jax.distributed.shutdown()


def check(
    fmt: str,
    tree: dict[str, object],
    host: dict[str, np.ndarray],
    specs: dict[str, object],
    mesh: object,
    directory: Path,
    process_id: int,
) -> None:
    """Save ``tree`` in parts as ``fmt``, compare with a whole save, load back sharded."""
    import jax
    from jax.sharding import NamedSharding

    import pytreeio as ptio
    from pytreeio import io, multihost

    dest = directory / f"ckpt.{fmt}"
    multihost.save_in_parts(dest, tree, format=fmt, coordinator=multihost.JaxCoordinator())

    if process_id == 0:
        whole = {**host, "step": 7, "bias": tree["bias"]}
        ptio.save(directory / f"whole.{fmt}", whole, format=fmt)
        same = (directory / f"whole.{fmt}").read_bytes() == dest.read_bytes()
        assert same, "the file written in parts differs from a single-process save"

    read: list[int] = []
    original = io.FileSource.read_into

    def counted(self: io.FileSource, offset: int, out: memoryview, field: str) -> None:
        read.append(len(out))
        original(self, offset, out, field)

    original_read = io.FileSource._read

    def counted_read(self: io.FileSource, offset: int, n: int) -> memoryview:
        read.append(n)
        return original_read(self, offset, n)

    io.FileSource.read_into = counted  # type: ignore[method-assign]
    io.FileSource._read = counted_read  # type: ignore[method-assign]
    like = {
        k: jax.ShapeDtypeStruct(
            host[k].shape, host[k].dtype, sharding=NamedSharding(mesh, specs[k])
        )
        for k in host
    }
    like["step"] = 0
    like["bias"] = np.zeros(5, dtype=np.float32)
    out = ptio.load(dest, like=like, format=fmt)
    io.FileSource.read_into = original  # type: ignore[method-assign]
    io.FileSource._read = original_read  # type: ignore[method-assign]
    held = held_bytes(out, host)
    assert out["step"] == 7 and np.array_equal(out["bias"], tree["bias"])
    header = 8 + int.from_bytes(dest.read_bytes()[:8], "little") if fmt == "safetensors" else 0
    report = {"format": fmt, "process": process_id, "read": sum(read), "held": held}
    print("RESULT " + json.dumps({**report, "header": header}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
