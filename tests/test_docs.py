"""Every Python code block of README.md and docs/ runs, in order, one namespace per page.

Blocks fenced as ``python`` run (sybil's Markdown parser); ``<!-- invisible-code-block:
python -->`` comments run as set-up the reader does not see, and ``<!-- skip: next -->``
skips the next block (for what needs a GPU, a network or a foreign program).  Each page
runs in an empty temporary directory, so the files its examples write are its own.  The
API page (mkdocstrings) documents exactly ``pytreeio.__all__``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

import pytreeio

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_code_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    document = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()]).parse(page)
    for example in document:
        example.evaluate()


def test_the_api_page_lists_exactly_the_public_names() -> None:
    text = (REPO / "docs" / "api.md").read_text()
    listed = re.findall(r"^::: pytreeio\.(\w+)\s*$", text, flags=re.M)
    assert len(listed) == len(set(listed)), "a name is listed twice"
    assert set(listed) == set(pytreeio.__all__)


def test_every_page_is_in_the_site_navigation() -> None:
    nav = set(
        re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    )
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert nav == pages, (
        f"not in the nav: {sorted(pages - nav)}; no such page: {sorted(nav - pages)}"
    )
    assert len(pages) >= 10


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (``nox -s docs``): a broken link or an API name that does not
    resolve fails the build."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()
