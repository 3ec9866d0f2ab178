"""The test suite itself: a missing conformance directory stops the run once, loudly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_missing_conformance_files_fail_the_run_once_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-conformance"
    env = {**os.environ, "PYTREEIO_CONFORMANCE": str(missing)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         "tests/test_suite_setup.py", "-k", "nothing_matches_this"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert str(missing) in out
    assert "conformance files not found" in out
    assert " passed" not in out and " skipped" not in out and " error" not in out, out
