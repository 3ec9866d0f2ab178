"""Arrays that span processes inside orbax's CheckpointManager (``pytreeio.orbax``).

Two ``jax.distributed`` processes on loopback (gloo, 2 CPU devices each) run
``tests/orbax_multihost_worker.py``: a ``CheckpointManager`` with ``max_to_keep=2`` saves
safetensors and msgpack items that every process writes in parts, with a step that fails to
encode and one that fails to write in process 1 only, then restores onto sharded
``ShapeDtypeStruct`` leaves.  In-process: the coordinator over orbax's signalling, and the
snapshot a save in parts takes for orbax's background commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from processes import communicate, free_port, gloo_missing, skip_without_gloo
from thread_group import run_threads

ocp = pytest.importorskip("orbax.checkpoint")

import pytreeio as ptio  # noqa: E402
from pytreeio import multihost  # noqa: E402
from pytreeio.orbax import OrbaxCoordinator  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
#: A hard limit for each worker (the pair runs in seconds; a hang must not stall the suite).
TIMEOUT = 240
FORMATS = ("safetensors", "msgpack")


# --------------------------------------------------------------------------
# two processes
# --------------------------------------------------------------------------


def _run_pair(root: str, scratch: Path, env: dict[str, str] | None = None) -> str:
    """Run the two workers on ``root`` (the managers' directory: a local path, or a remote
    root whose storage options ``env`` carries); returns their stdout, process 0's first."""
    environ = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", **(env or {}))
    environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    port = str(free_port())
    script = str(TESTS / "orbax_multihost_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(i), port, root, str(scratch)],
            env=environ,
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # apart: log lines from other threads never split a result
            text=True,
        )
        for i in range(2)
    ]
    outputs = communicate(procs, TIMEOUT)
    text, log = "\n".join(o for o, _ in outputs), "\n".join(e for _, e in outputs)
    skip_without_gloo(log)
    assert all(p.returncode == 0 for p in procs), text[-2000:] + log[-6000:]
    return text


def _lines(text: str, tag: str) -> list[dict[str, Any]]:
    return [json.loads(line[len(tag) + 1 :]) for line in text.splitlines() if line.startswith(tag)]


def test_two_processes_save_in_parts_and_restore_their_slices(tmp_path: Path) -> None:
    why = gloo_missing()
    if why:
        pytest.skip(why)
    root, scratch = tmp_path / "ckpts", tmp_path / "scratch"
    root.mkdir()
    scratch.mkdir()
    text = _run_pair(str(root), scratch)

    # a failure in one process (encoding at step 3, writing at step 4) raises in both
    raised = _lines(text, "RAISED")
    assert sorted((r["process"], r["step"]) for r in raised) == [(0, 3), (0, 4), (1, 3), (1, 4)]
    for r in raised:
        assert r["error"] == "PartsError" and "process 1" in r["message"], r
        assert ("EncodeError" if r["step"] == 3 else "No space left") in r["message"], r
    committed = sorted(p.name for p in root.iterdir() if p.name.isdigit())
    assert "3" not in committed and "4" not in committed and {"2", "5"} <= set(committed)

    for fmt in FORMATS:
        item = root / "5" / fmt
        # the file both processes wrote is byte for byte a single-process save
        assert (item / f"checkpoint.{fmt}").read_bytes() == (scratch / f"whole.{fmt}").read_bytes()
        assert ptio.inspect(item / f"checkpoint.{fmt}").format == fmt

    results = _lines(text, "RESULT")
    assert sorted((r["format"], r["process"]) for r in results) == sorted(
        (fmt, i) for fmt in FORMATS for i in range(2)
    )
    data = (root / "5" / "safetensors" / "checkpoint.safetensors").read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    for r in results:
        # each process holds half of "rows" and "cols" and all of "repl": 96 KiB of 160 KiB
        assert r["held"] == 96 << 10, r
        if r["format"] == "safetensors":
            # only its own slices beyond the header (and the 2 small leaves)
            assert r["held"] <= r["read"] <= r["held"] + header + 64, r


def test_two_processes_save_in_parts_to_s3(
    tmp_path: Path, s3_root: str, s3_options: dict[str, Any], s3_endpoint: str
) -> None:
    """The same pair with the managers' directory in a bucket: each process uploads its
    ranges, process 0 merges them and uploads the file as one object."""
    why = gloo_missing()
    if why:
        pytest.skip(why)
    fsspec = pytest.importorskip("fsspec")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    root = s3_root + "/ckpts"
    env = {  # fsspec's configuration: what orbax's paths (etils.epath) and pytreeio both read
        "FSSPEC_S3_ENDPOINT_URL": s3_endpoint,
        "FSSPEC_S3_KEY": "testing",
        "FSSPEC_S3_SECRET": "testing",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    text = _run_pair(root, scratch, env)
    raised = _lines(text, "RAISED")
    assert sorted((r["process"], r["step"]) for r in raised) == [(0, 3), (0, 4), (1, 3), (1, 4)]
    fs, key = fsspec.core.url_to_fs(root, **s3_options)
    fs.invalidate_cache()
    objects = fs.find(key)
    committed = {p.split("/")[2] for p in objects if p.endswith("/commit_success.txt")}
    assert not {"3", "4"} & committed and {"2", "5"} <= committed, sorted(committed)
    assert not [p for p in objects if ".pytreeio-parts-" in p], "parts were left behind"
    for fmt in FORMATS:
        written = fs.cat_file(f"{key}/5/{fmt}/checkpoint.{fmt}")
        assert written == (scratch / f"whole.{fmt}").read_bytes()
    results = _lines(text, "RESULT")
    assert len(results) == 2 * len(FORMATS)
    for r in results:
        assert r["held"] == 96 << 10, r
        if r["format"] == "safetensors":
            assert r["held"] <= r["read"] <= r["held"] + (64 << 10), r


# --------------------------------------------------------------------------
# in one process
# --------------------------------------------------------------------------


def test_orbax_coordinator_in_one_process_carries_any_message() -> None:
    coord = OrbaxCoordinator("pytreeio_test_coordinator")
    assert (coord.process_index, coord.process_count) == (0, 1)
    odd = "/tmp/caf\udce9/x"  # a path's bytes that are not UTF-8 (surrogateescape)
    assert coord.exchange("a", odd) == [odd]
    assert coord.exchange("b", "ok") == ["ok"]  # each exchange's key is its own


def test_snapshot_in_parts_is_what_the_tree_was(tmp_path: Path) -> None:
    """``snapshot=True``: the tree may change between prepare_in_parts and write."""
    w = np.arange(2048, dtype=np.float32)
    tree = {"w": w, "b": np.ones(3, np.int32)}
    ptio.save(tmp_path / "want.safetensors", tree)
    dest = tmp_path / "parts.safetensors"

    def save(coord: Any) -> None:
        parts = multihost.prepare_in_parts(dest, tree, coordinator=coord, snapshot=True)
        if coord.process_index == 0:
            w[:] = -1.0  # the training loop moves on before the background write
        coord.exchange("changed", "")
        parts.write()

    assert run_threads(2, save) == [None, None]
    assert dest.read_bytes() == (tmp_path / "want.safetensors").read_bytes()
    with pytest.raises(multihost.PartsError, match="written whole"):
        multihost.prepare_in_parts(
            tmp_path / "ck", {"params": [w]}, format="netcl-checkpoint", snapshot=True
        )
