"""The benchmark suite runs end to end at a tiny size and writes valid results.

No timing is asserted (the numbers of a 1 MB run mean nothing); what is
checked is that every section the filter selects ran, produced numbers where
numbers belong, rendered its table, and wrote JSON that parses back.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "bench"


@pytest.fixture(scope="module")
def bench_all():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH))
    try:
        import bench_all

        yield bench_all
    finally:
        sys.path.remove(str(BENCH))


def test_tiny_run_writes_json_and_markdown(bench_all, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "results"
    results = bench_all.main(
        [
            "--size", "1",
            "--repeat", "1",
            "--leaves", "50",
            "--inspect-size", "2",
            "--only", "msgpack|bullet quantised",
            "--out", str(out),
            "--dir", str(tmp_path),
        ]
    )  # fmt: skip
    data = json.loads((out / "latest.json").read_text())
    assert data["machine"]["cores"] >= 1 and data["machine"]["date"]
    assert data["config"]["leaves"] == 64

    rows = {r["name"]: r for r in data["throughput"]["rows"]}
    assert {"pytreeio msgpack", "pytreeio bullet quantised"} <= set(rows)
    assert not any(name.startswith("pytreeio safetensors") for name in rows)  # filtered out
    for name in ("pytreeio msgpack", "pytreeio bullet quantised"):
        row = rows[name]
        assert row["bytes"] > 1 << 20
        for key in ("save", "load", "load_like"):
            assert math.isfinite(row[key]["best"]) and row[key]["best"] > 0, (name, key)
        assert row["verdict"] == "PASS" or row["verdict"].startswith("MISS")
    # bullet's load reads only the tagged records: the raw baseline reads the same bytes
    bq = rows["pytreeio bullet quantised"]
    assert bq["bytes_load_reads"] < bq["bytes"]

    durable = {r["name"] for r in data["durable"]}
    assert "pytreeio msgpack" in durable

    per_leaf = {r["name"]: r for r in data["per_leaf"]["rows"]}
    assert per_leaf["pytreeio msgpack"]["save"] > 0 and per_leaf["pytreeio msgpack"]["load"] > 0

    memory = [r for r in data["memory"] if r["name"] == "pytreeio msgpack"]
    assert {r["op"] for r in memory} >= {"save", "load", "convert to safetensors"}
    for r in memory:
        assert "error" not in r, r
        assert r["added"] >= 0
        assert r["verdict"] == "PASS" or r["verdict"].startswith("MISS")

    inspected = [r for r in data["misc"] if r["name"].startswith("inspect ")]
    assert {r["name"].split(" (")[0] for r in inspected} == {
        "inspect msgpack",
        "inspect bullet quantised",
    }
    assert all(r["seconds"] > 0 for r in inspected)
    md = (out / "latest.md").read_text()
    assert "| pytreeio msgpack | file |" in md and "### Peak memory" in md
    assert results["config"] == data["config"]
    assert not data["errors"], data["errors"]
    assert not any(tmp_path.glob("pytreeio-bench-*")), "the work directory was left behind"
