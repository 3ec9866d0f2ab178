"""Sharded arrays (:mod:`pytreeio.multihost`): geometry, saves in parts, 8-device and 2-process runs.

The test processes run jax with one CPU device, so the checks that need 8
devices run in a fresh interpreter (``tests/sharding_cases.py``, one case per
subprocess, with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``), and
the two-process save and load runs two ``jax.distributed`` processes on
loopback (``tests/multiprocess_worker.py``; also ``nox -s multiprocess``).
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
from conftest import assert_bits_equal
from hypothesis import given
from hypothesis import strategies as st
from processes import communicate, free_port, gloo_missing, skip_without_gloo
from thread_group import run_threads

import pytreeio as ptio
from pytreeio import multihost
from pytreeio.core import shards
from pytreeio.core.errors import PytreeioError

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CASES = [
    "save_bytes_identical",
    "save_streams_shard_buffers",
    "load_reads_own_slices",
    "load_round_trip_all_layouts",
    "load_mismatch_names_key",
    "threads_save_in_parts",
    "save_async_snapshots_shards",
]
#: A hard limit for each subprocess (jax starts in seconds; a hang must not stall the suite).
TIMEOUT = 240


# --------------------------------------------------------------------------
# geometry: a block's byte runs in C order
# --------------------------------------------------------------------------


@st.composite
def blocks(draw: Any) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    region = []
    for n in shape:
        a = draw(st.integers(0, n))
        region.append((a, draw(st.integers(a, n))))
    return shape, tuple(region)


@given(blocks(), st.sampled_from([1, 2, 4, 8]))
def test_c_runs_cover_exactly_the_block(block: Any, itemsize: int) -> None:
    shape, region = block
    arr = np.arange(int(np.prod(shape)) * itemsize, dtype=np.uint64).astype(np.uint8)
    flat = arr.reshape(-1)
    offsets, run = shards.c_runs(shape, itemsize, region)
    got = b"".join(flat[o : o + run].tobytes() for o in offsets.tolist())
    elements = flat.view(np.uint8).reshape(*shape, itemsize) if shape else flat
    want = elements[tuple(slice(a, b) for a, b in region)].tobytes() if shape else flat.tobytes()
    assert got == want
    assert list(offsets) == sorted(offsets)  # in the block's own C order


def test_c_runs_leading_axis_is_one_run() -> None:
    offsets, run = shards.c_runs((8, 3, 4), 4, ((2, 4), (0, 3), (0, 4)))
    assert offsets.tolist() == [2 * 48] and run == 2 * 48
    offsets, run = shards.c_runs((8, 3, 4), 4, ((2, 4), (1, 2), (0, 4)))
    assert offsets.tolist() == [2 * 48 + 16, 3 * 48 + 16] and run == 16


def test_region_of_jax_style_index() -> None:
    assert shards.region_of((slice(None), slice(2, 4)), (6, 8)) == ((0, 6), (2, 4))
    assert shards.region_of((), (3,)) == ((0, 3),)
    with pytest.raises(ValueError):
        shards.region_of((slice(0, 6, 2),), (6,))


# --------------------------------------------------------------------------
# saves in parts, processes simulated by threads (one device: no sharded leaves)
# --------------------------------------------------------------------------


def test_thread_group_exchanges_messages() -> None:
    seen: list[list[str]] = [[], [], []]

    def fn(coord: Any) -> None:
        for round in range(3):
            seen[coord.process_index].extend(
                coord.exchange(f"r{round}", f"{coord.process_index}:{round}")
            )

    assert run_threads(3, fn) == [None, None, None]
    want = [f"{i}:{r}" for r in range(3) for i in range(3)]
    assert seen == [want, want, want]


@pytest.mark.parametrize("fmt", ["safetensors", "msgpack"])
def test_save_in_parts_of_host_arrays_equals_save(tmp_path: Path, fmt: str) -> None:
    """Nothing sharded: the primary writes everything, the file is what ``save`` writes."""
    tree: dict[str, Any] = {"a": np.arange(12.0).reshape(3, 4), "b": {"0": np.arange(3), "1": 2.5}}
    dest = tmp_path / f"ckpt.{fmt}"
    results = run_threads(
        3, lambda c: multihost.save_in_parts(dest, tree, format=fmt, coordinator=c)
    )
    assert results == [None, None, None]
    ptio.save(tmp_path / f"plain.{fmt}", tree, format=fmt)
    assert dest.read_bytes() == (tmp_path / f"plain.{fmt}").read_bytes()
    assert not [p for p in tmp_path.iterdir() if "pytreeio-tmp" in p.name]


def test_save_in_parts_of_a_sibling_format_is_written_by_the_primary(tmp_path: Path) -> None:
    """A format that is not one file (netcl-checkpoint: .npz + .json) is saved whole by process 0."""
    tree = {"params": [np.ones(2, np.float32)]}
    dest = tmp_path / "ck"
    results = run_threads(
        2, lambda c: multihost.save_in_parts(dest, tree, format="netcl-checkpoint", coordinator=c)
    )
    assert results == [None, None]
    ptio.save(tmp_path / "plain", tree, format="netcl-checkpoint")
    assert_bits_equal(
        ptio.load(dest, format="netcl-checkpoint"),
        ptio.load(tmp_path / "plain", format="netcl-checkpoint"),
    )
    assert not [p for p in tmp_path.iterdir() if "pytreeio-tmp" in p.name]


def test_save_in_parts_failure_keeps_old_checkpoint(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt.safetensors"
    ptio.save(dest, {"a": np.zeros(3)})
    before = dest.read_bytes()
    good = {"a": np.ones(3)}
    bad = {"a": np.ones(3), "x": object()}
    results = run_threads(
        2,
        lambda c: multihost.save_in_parts(
            dest, bad if c.process_index == 1 else good, coordinator=c
        ),
    )
    for r in results:
        assert isinstance(r, multihost.PartsError) and isinstance(r, PytreeioError)
        assert "process 1" in str(r) and "EncodeError" in str(r)
        assert r.path == os.fspath(dest)
    assert dest.read_bytes() == before


def test_save_in_parts_primary_failure_reaches_everyone(tmp_path: Path) -> None:
    """The primary cannot create the temporary (no such directory): every process raises."""
    dest = tmp_path / "missing" / "ckpt.safetensors"
    results = run_threads(
        2, lambda c: multihost.save_in_parts(dest, {"a": np.ones(3)}, coordinator=c)
    )
    for r in results:
        assert isinstance(r, multihost.PartsError), r
        assert "process 0" in str(r) and "create" in str(r)


def test_load_with_unsharded_like_is_unchanged(tmp_path: Path) -> None:
    """One device: ``like`` leaves with a single-device sharding take the ordinary path."""
    import jax

    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    ptio.save(tmp_path / "a.safetensors", {"w": value})
    like = {"w": jax.ShapeDtypeStruct((3, 4), np.float32, sharding=_one_device())}
    assert not shards.wants_slices(like)
    out = ptio.load(tmp_path / "a.safetensors", like=like)
    assert isinstance(out["w"], jax.Array) and np.array_equal(np.asarray(out["w"]), value)


def _one_device() -> Any:
    import jax

    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


# --------------------------------------------------------------------------
# 8 devices (subprocess)
# --------------------------------------------------------------------------


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


@pytest.mark.parametrize("case", CASES)
def test_eight_devices(case: str) -> None:
    """See ``tests/sharding_cases.py`` for what each case checks."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / "sharding_cases.py"), case],
        env=_env(8),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0 and f"PASS {case}" in proc.stdout, proc.stdout + proc.stderr


# --------------------------------------------------------------------------
# two processes (jax.distributed on loopback, gloo)
# --------------------------------------------------------------------------


def test_two_processes_save_and_load_in_parts(tmp_path: Path) -> None:
    """Two jax processes (2 devices each) write one checkpoint in parts and each reads its slices."""
    why = gloo_missing()
    if why:
        pytest.skip(why)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(TESTS / "multiprocess_worker.py"),
                str(i),
                port,
                str(tmp_path),
                "safetensors,msgpack",
            ],
            env=_env(2),
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    text = "\n".join(out for out, _ in communicate(procs, TIMEOUT))
    skip_without_gloo(text)
    assert all(p.returncode == 0 for p in procs), text[-4000:]
    results = [
        json.loads(line[len("RESULT ") :])
        for line in text.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(results) == 4, text[-2000:]
    from multiprocess_worker import values

    total = sum(v.nbytes for v in values().values())
    for r in results:
        # each process holds half of "rows" and "cols" and all of "repl": 320 KiB of 576 KiB
        assert r["held"] == 320 << 10 and total == 576 << 10, r
        if r["format"] == "safetensors":
            # only its own slices beyond the header (and the 2 small leaves)
            assert r["held"] <= r["read"] <= r["held"] + r["header"] + 64, r
    assert (tmp_path / "ckpt.safetensors").read_bytes() == (
        tmp_path / "whole.safetensors"
    ).read_bytes()
