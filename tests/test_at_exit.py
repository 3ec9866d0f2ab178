"""Saving and loading from an ``atexit`` handler, where no thread pool takes jobs any more.

Once the interpreter has begun to exit, ``concurrent.futures`` refuses new
jobs and its executor module cannot even be imported; pytreeio's pools then
run their jobs on the calling thread (``pytreeio.core.threads``), so a program that
saves its last checkpoint on the way out still gets it.  Each case runs in a
fresh interpreter whose first use of pytreeio's pools is in the handler.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pytreeio as ptio

SCRIPT = """
import atexit, sys
import numpy as np
import pytreeio as ptio

out, fmt = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
# large enough for every parallel path: background hashing, CRC pieces, bands, 4-thread reads
tree = {"params": {
    "Dense_0": {"kernel": rng.standard_normal((2304, 4608), np.float32),
                "bias": rng.standard_normal(4608, np.float32)},
    "Dense_1": {"kernel": rng.standard_normal((4608, 2304), np.float32),
                "bias": rng.standard_normal(2304, np.float32)},
}}
options = {"layers": ["Linear", "Linear"]} if fmt in ("waffe2", "netcl") else {}
meta = None
if fmt == "bullet":
    meta = {"saved_format": [
        {"id": f"l{i}{p}", "transforms": [], "type": "i16", "scale": 255, "round": True}
        for i in range(2) for p in "wb"
    ]}

def last_checkpoint():
    ptio.save(out, tree, format=fmt, meta=meta, **options)
    back = ptio.load(out, like=tree, format=fmt)
    same = all(
        np.array_equal(a, b) for a, b in zip(ptio.flatten(back).values(), ptio.flatten(tree).values())
    )
    ptio.save_async(out + ".async", tree, format=fmt, meta=meta, **options).result()
    print("ok" if same else "differs", flush=True)

atexit.register(last_checkpoint)
"""


@pytest.mark.parametrize(
    ("fmt", "name"),
    [
        ("safetensors", "ckpt.safetensors"),
        ("msgpack", "ckpt.msgpack"),
        ("netcl-params", "params.npz"),
        ("waffe2", "ckpt.wf2model"),
        ("bullet", "bullet"),
    ],
)
def test_a_last_checkpoint_saved_at_exit(tmp_path: Path, fmt: str, name: str) -> None:
    out = tmp_path / name
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out), fmt], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok", done.stderr[-3000:]
    for path in (out, Path(str(out) + ".async")):
        flat = ptio.flatten(ptio.load(path, format=fmt))
        assert sum(np.asarray(v).size for v in flat.values()) >= 2 * 2304 * 4608


def test_pools_run_jobs_on_the_caller_once_exiting(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from pytreeio.core import threads as pools

    monkeypatch.setattr(pools, "exiting", lambda: True)
    lazy = pools.LazyPool("pytreeio-test-exit")
    pool = lazy.get()
    caller = threading.get_ident()
    assert pool.submit(threading.get_ident).result() == caller
    assert list(pool.map(lambda x: x * 2, [1, 2, 3])) == [2, 4, 6]
    failed = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    assert lazy._pool is None  # nothing kept: a pool made before the exit is used as ever


def test_quantisation_blocks_run_on_the_caller_once_exiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python 3.12 starts no thread from an atexit handler: the caller computes every block
    from pytreeio.core import quant
    from pytreeio.core import threads as pools

    monkeypatch.setattr(quant, "BLOCK", 4096)
    x = np.random.default_rng(2).uniform(-100, 100, (300, 70)).astype(np.float32)
    want = quant.quantise(x, 255, "i16", round=True, transpose=True)
    monkeypatch.setattr(pools, "exiting", lambda: True)
    monkeypatch.setattr(pools, "_POOL", pools.LazyPool("pytreeio-test-exit"))
    got = quant.quantise(x, 255, "i16", round=True, transpose=True)
    assert got.tobytes() == want.tobytes()
    assert pools._POOL._pool is None  # no pool was made: every job ran on the caller
