"""Loads depend only on their arguments and the file's bytes: earlier loads in the same process
change neither the result nor the code that reads it (issue 36).

Every check compares a load in this process, after loads of other files, with the same load in a
fresh process (``python -c``), bit for bit.
"""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio

_FRESH = """
import pickle, sys
import pytreeio as ptio
sys.path.insert(0, {tests!r})
from test_stateless_b import _flat
path, kw = pickle.load(open({args!r}, "rb"))
report = kw.pop("report", None)
try:
    out = ptio.load(path, **kw, **({{}} if report is None else {{"report": report}}))
except ptio.PytreeioError as exc:
    out = (type(exc).__name__, str(exc))
sys.stdout.buffer.write(pickle.dumps((_flat(out), report)))
"""


def _flat(tree: Any, path: str = "") -> Any:
    """Every leaf with its key path, container kinds, type, dtype, shape and bytes."""
    if isinstance(tree, dict):
        return [("dict", path, list(map(str, tree)))] + [
            x for k, v in tree.items() for x in _flat(v, f"{path}/{k}")
        ]
    if isinstance(tree, list | tuple):
        head = [(type(tree).__name__, path, len(tree))]
        return head + [x for i, v in enumerate(tree) for x in _flat(v, f"{path}[{i}]")]
    if hasattr(tree, "dtype") and hasattr(tree, "shape"):
        a = np.asarray(tree)
        return [(type(tree).__name__, path, a.dtype.str, a.shape, a.tobytes())]
    return [(type(tree).__name__, path, repr(tree))]


def _here(path: Path, **kw: Any) -> Any:
    report = kw.pop("report", None)
    extra = {} if report is None else {"report": report}
    try:
        out = ptio.load(path, **kw, **extra)
    except ptio.PytreeioError as exc:
        out = (type(exc).__name__, str(exc))
    return _flat(out), report


def _fresh(tmp_path: Path, path: Path, **kw: Any) -> Any:
    args = tmp_path / "fresh-args.pkl"
    args.write_bytes(pickle.dumps((path, kw)))
    code = _FRESH.format(tests=str(Path(__file__).parent), args=str(args))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return pickle.loads(done.stdout)


# --------------------------------------------------------------------------
# the two reproducers of issue 36
# --------------------------------------------------------------------------


def _params(seed: int, n: int = 6) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        f"Dense_{i}": {
            "kernel": rng.standard_normal((3, 4) if i % 2 == 0 else (4, 3), dtype=np.float32),
            "bias": rng.standard_normal(4 if i % 2 == 0 else 3, dtype=np.float32),
        }
        for i in range(n)
    }


def test_waffe2_fills_the_report_on_every_load(tmp_path: Path) -> None:
    params = _params(0)
    path = tmp_path / "w"
    ptio.save(path, params, format="waffe2")
    want = _fresh(tmp_path, path, like=params, format="waffe2", report={})
    assert want[1] == {"missing": [], "extra": []}
    for _ in range(5):
        assert _here(path, like=params, format="waffe2", report={}) == want


def _old_records(ids: list[str], values: np.ndarray) -> bytes:
    """Old-variant records: id, newline, rows=2 and cols=4 (u64), eight f32 values each."""
    return b"".join(
        rid.encode() + b"\n" + struct.pack("<QQ", 2, 4) + values[i].astype("<f4").tobytes()
        for i, rid in enumerate(ids)
    )


def test_bullet_records_read_as_the_file_says(tmp_path: Path) -> None:
    ids = [f"a{i:02d}" for i in range(32)]
    rng = np.random.default_rng(1)
    a = tmp_path / "a"
    (a / "optimiser_state").mkdir(parents=True)
    (a / "optimiser_state" / "weights.bin").write_bytes(
        _old_records(ids, rng.standard_normal((32, 8)))
    )
    # B: the same ids, rows and cols; its values spell current-variant records `zNN\n`, count 5
    # and five f32 each, so that the whole file reads as 64 current-variant records.
    b = tmp_path / "b"
    (b / "optimiser_state").mkdir(parents=True)
    data = bytearray()
    for i, rid in enumerate(ids):
        # read as the current variant, `aNN\n` and rows (u64 2) are a record of 2 values (the
        # bytes of cols), and the 32 value bytes the record `zNN\n`, count 5, five f32
        data += rid.encode() + b"\n" + struct.pack("<QQ", 2, 4)
        data += f"z{i:02d}\n".encode() + struct.pack("<Q", 5) + np.full(5, i, "<f4").tobytes()
    (b / "optimiser_state" / "weights.bin").write_bytes(bytes(data))
    fresh = _fresh(tmp_path, b, format="bullet")
    assert sum(x[0] == "ndarray" for x in fresh[0]) == 64
    for _ in range(2):
        ptio.load(a, format="bullet")
    assert _here(b, format="bullet") == fresh


# --------------------------------------------------------------------------
# every model format: five loads, then a same-length file with other values
# --------------------------------------------------------------------------

MODEL_FORMATS = {
    "datacode": "m.nn",
    "bullet": "b",
    "netcl": "m.npz",
    "netcl-checkpoint": "ck",
    "netcl-params": "p.npz",
    "waffe2": "w",
}


@pytest.mark.parametrize("fmt", MODEL_FORMATS)
def test_a_file_after_five_loads_reads_as_in_a_fresh_process(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / MODEL_FORMATS[fmt]
    first, other = _params(2), _params(3)
    ptio.save(path, first, format=fmt)
    for _ in range(5):
        ptio.load(path, format=fmt)
        ptio.load(path, format=fmt, like=first)
    size = sum(p.stat().st_size for p in [path, *path.rglob("*")] if p.is_file())
    ptio.save(path, other, format=fmt)
    assert sum(p.stat().st_size for p in [path, *path.rglob("*")] if p.is_file()) == size
    for kw in ({}, {"like": first}):
        got = _here(path, format=fmt, **kw)
        assert got == _fresh(tmp_path, path, format=fmt, **kw)
        leaves = [x[-1] for x in got[0] if x[0] == "ndarray"]
        assert leaves  # the other values, not the first file's
    back = ptio.load(path, format=fmt, like=first)
    for name, module in other.items():
        for k, v in module.items():
            assert back[name][k].tobytes() == v.tobytes(), (name, k)
