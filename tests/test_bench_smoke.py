"""The benchmark suite runs end to end (``--quick``) and writes valid results.

No timing is asserted (the numbers of a 1 MB run mean nothing); what is
checked is that every section ran in fresh processes for both sides (this
working tree given as ``--old`` too), produced numbers where numbers belong,
rendered its tables, and wrote JSON that parses back.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "bench"
REPO = BENCH.parents[1]


@pytest.fixture(scope="module")
def bench_all():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH))
    try:
        import bench_all

        yield bench_all
    finally:
        sys.path.remove(str(BENCH))


def test_quick_run_writes_json_and_markdown(bench_all, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "results"
    argv = ["--quick", "--only", "^msgpack$|safetensors.numpy", "--old", str(REPO)]
    results = bench_all.main([*argv, "--out", str(out), "--dir", str(tmp_path)])
    data = json.loads((out / "latest.json").read_text())
    assert not data["errors"], data["errors"]
    assert data["machine"]["nproc"] >= 1 and data["machine"]["cpu"]
    assert set(data["sides"]) == {"old", "new"}
    assert data["config"]["cases"] == ["msgpack"] and data["config"]["page_cache"] == ["warm"]

    loads = {r["case"]: r for r in data["loads"]}
    assert set(loads) == {"msgpack", "peer safetensors.numpy"}
    for side in ("old", "new"):
        entry = loads["msgpack"][side]
        assert math.isfinite(entry["best"]) and entry["best"] > 0
        assert entry["ratio"] > 0 and entry["verdict"].startswith(("PASS", "MISS"))
    assert loads["msgpack"]["raw_best"] > 0 and loads["msgpack"]["bytes_read"] > 1 << 19
    assert loads["peer safetensors.numpy"]["peer"]["best"] > 0

    memory = {r["case"]: r for r in data["memory"]}
    assert memory["msgpack"]["tree"] > 1 << 19
    assert all(memory["msgpack"][s]["added"] >= 0 for s in ("old", "new"))

    saves = {r["case"]: r for r in data["saves"]}
    assert set(saves) == {"msgpack", "msgpack (durable)"}
    for row in saves.values():
        assert row["raw_best"] > 0 and row["old"]["best"] > 0 and row["new"]["best"] > 0

    per_tensor = {r["case"]: r for r in data["per_tensor"]}
    assert per_tensor["msgpack"]["tensors"] == 100
    assert per_tensor["msgpack"]["reference_us"] > 0 and per_tensor["msgpack"]["new"]["us"] > 0

    md = (out / "latest.md").read_text()
    for heading in ("### Cold loads", "### Peak memory", "### Saves", "### First load per tensor"):
        assert heading in md
    assert "| msgpack | file | warm |" in md
    assert results["config"] == data["config"]
    assert not any(tmp_path.glob("pytreeio-bench-*")), "the work directory was left behind"


def test_cloud_smoke_run(tmp_path: Path) -> None:
    """bench_cloud.py on a 2 MB tree: every format saved and loaded at s3:// URLs on its own
    moto server, against s3fs, and one tensor read through ``ptio.open``."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    sys.path.insert(0, str(BENCH))
    try:
        import bench_cloud
    finally:
        sys.path.remove(str(BENCH))
    out = bench_cloud.main(["--mb", "2", "--repeats", "1", "--dir", str(tmp_path)])
    assert not out["errors"], out["errors"]
    assert {(r["case"], r["op"]) for r in out["transfers"]} == {
        (f, op) for f in ("safetensors", "msgpack", "waffe2") for op in ("save", "load")
    }
    for row in out["transfers"]:
        assert row["raw"] and row["pytreeio"] and row["objects"] >= row["raw_objects"]
    assert {r["case"] for r in out["opens"]} == {"safetensors", "msgpack"}
    for row in out["opens"]:
        assert all("error" not in row[s] and row[s]["seconds"] for s in ("local", "s3", "raw"))
        assert row["s3"]["gets"] >= 1 and row["s3"]["moved"] >= row["nbytes"]
    for heading in ("### Saves and loads at s3:// URLs", "### One tensor through `ptio.open`"):
        assert heading in out["markdown"]
    assert not any(tmp_path.glob("pytreeio-bench-cloud-*")), "the work directory was left behind"
