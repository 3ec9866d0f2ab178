"""A file truncated in place by another program while a default load reads it.

The load must end in the whole original value or a pytreeio error naming the
file: never SIGBUS (a mapped read of a page that is gone), never a raw OSError.
The loads run in a child process (a SIGBUS would kill the test runner); the
test process truncates the file at a random moment of each.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pytreeio as ptio

_COUNT = 16
_SHAPE = (1024, 1024)  # 4 MiB each: 64 MiB in all

_CHILD = f"""
import sys, numpy as np, pytreeio as ptio
path, fmt = sys.argv[1], sys.argv[2]
ptio.list_formats()[fmt]  # imported before the race: the load's own work is what is raced
want = {{f"p{{i:02d}}": np.full({_SHAPE!r}, i, np.float32) for i in range({_COUNT})}}
print("ready", flush=True)
for _ in sys.stdin:
    try:
        tree = ptio.load(path, format=fmt)
    except ptio.PytreeioError as exc:
        print("error", str(exc).replace("\\n", " "), flush=True)
        continue
    except BaseException as exc:
        print("raw", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    same = tree.keys() == want.keys() and all(np.array_equal(tree[k], want[k]) for k in want)
    print("loaded" if same else "wrong", flush=True)
"""


@pytest.mark.parametrize(("fmt", "name"), [("netcl-params", "big.npz"), ("safetensors", "big.st")])
def test_truncated_during_a_default_load(tmp_path: Path, fmt: str, name: str) -> None:
    path = tmp_path / name
    tree = {f"p{i:02d}": np.full(_SHAPE, i, np.float32) for i in range(_COUNT)}
    ptio.save(path, tree, format=fmt, durable=False)
    whole = path.read_bytes()
    assert len(whole) > 64 << 20
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), fmt],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(ptio.__file__).parents[1])},
    )
    assert child.stdin is not None and child.stdout is not None
    rng = random.Random(fmt)
    outcomes = []
    try:
        assert child.stdout.readline().strip() == "ready"
        for _ in range(10):
            with open(path, "r+b") as f:  # in place: the same inode the child opens
                f.write(whole)
            child.stdin.write("go\n")
            child.stdin.flush()
            time.sleep(rng.uniform(0, 0.08))
            os.truncate(path, rng.choice([0, 100, len(whole) // 3, len(whole) - 1]))
            line = child.stdout.readline()
            assert line.split()[:1] in (["loaded"], ["error"]), line
            assert line.startswith("loaded") or str(path) in line, line  # the error names the file
            outcomes.append(line.split()[0])
    finally:
        child.stdin.close()
        err = child.stderr.read() if child.stderr else ""
        child.wait(timeout=60)
    assert child.returncode == 0, (child.returncode, err[-2000:])  # -7: SIGBUS
    assert "error" in outcomes  # some truncations landed during a load
