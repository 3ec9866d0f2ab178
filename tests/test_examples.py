"""The scripts in examples/ run and report success."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFORMANCE

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    ("script", "args", "expect"),
    [
        ("train_and_resume.py", ["--format", "safetensors"], "bit-exact = True"),
        ("convert_pipeline.py", [], "0 changed"),
        ("tinyllama_generate.py", [str(CONFORMANCE / "tinyllama" / "weights.bin")], "generated ["),
        ("load_foreign.py", ["--conformance", str(CONFORMANCE)], "all 5 systems loaded"),
        ("orbax_manager.py", ["--format", "netcl-checkpoint"], "bit-exact = True"),
    ],
)
def test_example_runs(script: str, args: list[str], expect: str, tmp_path: Path) -> None:
    if script in ("train_and_resume.py", "convert_pipeline.py", "orbax_manager.py"):
        args = [*args, "--out" if script == "convert_pipeline.py" else "--dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert expect in done.stdout
