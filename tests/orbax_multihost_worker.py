"""One process of the two-process orbax run (``jax.distributed`` on loopback, gloo).

Run by :mod:`tests.test_orbax_multihost` as::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python tests/orbax_multihost_worker.py PROCESS_ID PORT ROOT SCRATCH

``ROOT`` is the ``CheckpointManager``'s directory, reached through ``etils.epath`` only
(a local directory today; an ``s3://`` root, with its storage options, is meant to plug in
here), ``SCRATCH`` a local directory for the single-process reference saves.

Both processes build the same global arrays over a 2 x 2 mesh (processes x local devices)
and save them with a ``CheckpointManager`` (``max_to_keep=2``, async) as two items, one
safetensors and one msgpack, written in parts by both processes, plus a small item of host
arrays that process 0 writes alone.  Each save's arrays are deleted, and its numpy leaf
overwritten, as soon as ``save`` returns.  Steps 0-2 are saved; step 3 fails to encode in
process 1 only and step 4 fails to write in process 1 only (both processes must raise, and
neither step be committed); step 5 is saved (and again by a synchronous manager under
``ROOT/sync``), compared byte for byte (process 0) with a single-process save of the
gathered arrays, and restored by a fresh manager onto ``ShapeDtypeStruct`` leaves with
shardings.  Lines starting with ``RAISED`` (each failed
step) and ``RESULT`` (each restored item: the bytes read from its file, ``read``, and the
bytes of the distinct slices this process holds, ``held``) are JSON.  Any failure exits
non-zero.
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from multiprocess_worker import held_bytes  # noqa: E402

FORMATS = ("safetensors", "msgpack")


def values(step: int) -> dict[str, np.ndarray]:
    """The global arrays of ``step``, as numpy (what every process holds slices of)."""
    return {
        # split over processes (axis 0) and local devices (axis 1): runs of 4 KiB, a page
        "rows": np.arange(8 * 2048, dtype=np.float32).reshape(8, 2048) + step,
        # split over processes along axis 1, replicated over local devices
        "cols": np.arange(8 * 2048, dtype=np.int32).reshape(8, 2048) * 3 + step,
        # the same blocks in both processes
        "repl": np.arange(8 * 2048, dtype=np.uint16).reshape(8, 2048) + step,
    }


def main() -> None:
    process_id, port, root_arg, scratch = (
        int(sys.argv[1]),
        sys.argv[2],
        sys.argv[3],
        Path(sys.argv[4]),
    )
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=30
    )
    import orbax.checkpoint as ocp
    from etils import epath
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pytreeio as ptio
    from pytreeio import io
    from pytreeio.orbax import PytreeioSave

    devices = np.array(jax.devices()).reshape(2, 2)
    assert [d.process_index for d in devices[:, 0]] == [0, 1], devices
    mesh = Mesh(devices, ("proc", "dev"))
    shardings = {
        k: NamedSharding(mesh, spec)
        for k, spec in {"rows": P("proc", "dev"), "cols": P(None, "proc"), "repl": P("dev")}.items()
    }
    root = epath.Path(root_arg)

    def tree(step: int) -> dict[str, Any]:
        host = values(step)
        out: dict[str, Any] = {
            k: jax.make_array_from_callback(
                host[k].shape, shardings[k], lambda idx, k=k: host[k][idx]
            )
            for k in host
        }
        return {**out, "step": step, "bias": np.arange(5, dtype=np.float32) + step}

    def save(mngr: Any, step: int, item: dict[str, Any]) -> None:
        args = {fmt: PytreeioSave(item, format=fmt) for fmt in FORMATS}
        small = PytreeioSave({"bias": np.full(3, step, np.float32)}, format="msgpack")
        mngr.save(step, args=ocp.args.Composite(small=small, **args))
        # the training loop donates its arrays and reuses its buffers: the save has its own copy
        for leaf in item.values():
            if isinstance(leaf, jax.Array):
                leaf.delete()
        item["bias"][:] = -1.0

    def failing(mngr: Any, step: int, item: dict[str, Any]) -> None:
        try:
            save(mngr, step, item)
            mngr.wait_until_finished()
        except Exception as exc:
            message = {"process": process_id, "step": step, "error": type(exc).__name__}
            say("RAISED", {**message, "message": str(exc)})
            return
        raise AssertionError(f"step {step} did not raise in process {process_id}")

    # object storage has no rename: orbax marks a finished step with a commit file there
    commit_file = ocp.path.atomicity.CommitFileTemporaryPath
    remote = {"temporary_path_class": commit_file} if "://" in root_arg else {}
    options = ocp.CheckpointManagerOptions(max_to_keep=2, **remote)
    with ocp.CheckpointManager(root, options=options) as mngr:
        for step in range(3):
            save(mngr, step, tree(step))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2], mngr.all_steps()
        assert process_id != 0 or steps(root) == ["1", "2"], steps(root)

        # step 3: process 1 cannot encode its tree
        bad = {**tree(3), **({"oops": object()} if process_id == 1 else {})}
        failing(mngr, 3, bad)

        # step 4: process 1 cannot write its shards (a full disk, say)
        writers = (io.PartWriter, io.remote.PartWriter)
        originals = [w.write_at for w in writers]

        def full(self: Any, offset: int, data: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", root_arg)

        if process_id == 1:
            for w in writers:
                w.write_at = full  # type: ignore[method-assign]
        failing(mngr, 4, tree(4))
        for w, original in zip(writers, originals, strict=True):
            w.write_at = original  # type: ignore[method-assign]

        save(mngr, 5, tree(5))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 5], mngr.all_steps()

    # the same save through orbax's synchronous checkpointer
    sync = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, **remote)
    with ocp.CheckpointManager(root / "sync", options=sync) as mngr:
        save(mngr, 5, tree(5))
        assert mngr.all_steps() == [5], mngr.all_steps()

    if process_id == 0:
        # Neither failed step is committed.  (Step 1 is still there: orbax forgets the
        # step a failed save was to delete, with any handler.)
        assert "3" not in steps(root) and "4" not in steps(root), steps(root)
        for fmt in FORMATS:
            item = root / "5" / fmt
            record = json.loads((item / "pytreeio.json").read_text())
            assert record == {
                "version": 1,
                "format": fmt,
                "layout": "single",
                "path": f"checkpoint.{fmt}",
            }, record
            whole = {**values(5), "step": 5, "bias": np.arange(5, dtype=np.float32) + 5}
            ptio.save(scratch / f"whole.{fmt}", whole, format=fmt)
            want = (scratch / f"whole.{fmt}").read_bytes()
            for written in (item, root / "sync" / "5" / fmt):
                same = (written / f"checkpoint.{fmt}").read_bytes() == want
                assert same, f"{written}: written in parts, differs from a single-process save"

    fresh = ocp.CheckpointManagerOptions(**remote)
    with ocp.CheckpointManager(root, options=fresh) as mngr:  # as a restarted job has
        assert {2, 5} <= set(mngr.all_steps()) and mngr.latest_step() == 5, mngr.all_steps()
        assert not {3, 4} & set(mngr.all_steps()), mngr.all_steps()
        for fmt in FORMATS:
            restore(mngr, fmt, shardings, process_id)
    jax.distributed.shutdown()


def say(tag: str, doc: dict[str, Any]) -> None:
    """One line of JSON on stdout, in one write."""
    sys.stdout.write(f"{tag} {json.dumps(doc)}\n")
    sys.stdout.flush()


def steps(root: Any) -> list[str]:
    """The committed step directories under ``root``: locally, orbax's temporaries are named
    otherwise; in object storage a step is written in place and committed by a marker file."""
    remote = "://" in str(root)
    return sorted(
        p.name
        for p in root.iterdir()
        if p.name.isdigit() and (not remote or (p / "commit_success.txt").exists())
    )


def restore(mngr: Any, fmt: str, shardings: dict[str, Any], process_id: int) -> None:
    """Restore step 5's ``fmt`` item onto sharded ``like`` leaves, counting the bytes read."""
    import jax
    import orbax.checkpoint as ocp

    from pytreeio import io
    from pytreeio.orbax import PytreeioRestore

    host = values(5)
    like: dict[str, Any] = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in host.items()
    }
    like["step"] = 0
    like["bias"] = np.zeros(5, dtype=np.float32)

    # every file or object source opened, to sum the bytes each read (pread, ranged GETs)
    sources: list[Any] = []
    kinds = (io.FileSource, io.remote.RemoteSource)
    originals = [k.__init__ for k in kinds]

    def tracking(original: Any) -> Any:
        def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            sources.append(self)

        return tracked

    for kind, original in zip(kinds, originals, strict=True):
        kind.__init__ = tracking(original)  # type: ignore[method-assign]
    try:
        args = ocp.args.Composite(**{fmt: PytreeioRestore(like=like)})
        out = mngr.restore(5, args=args)[fmt]
    finally:
        for kind, original in zip(kinds, originals, strict=True):
            kind.__init__ = original  # type: ignore[method-assign]
    assert sources, "the restore opened no file"
    for k in host:
        assert out[k].sharding == shardings[k], (k, out[k].sharding)
    held = held_bytes(out, host)
    assert out["step"] == 5 and np.array_equal(out["bias"], np.arange(5, dtype=np.float32) + 5)
    read = sum(src.bytes_read for src in sources)
    report = {"format": fmt, "process": process_id, "read": read, "held": held}
    say("RESULT", report)


if __name__ == "__main__":
    main()
