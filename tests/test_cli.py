"""The ``pytreeio`` command: one-line errors, exit codes, ``--debug``, ``formats``."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pytreeio import api, cli
from pytreeio.errors import FormatError, MismatchError, UnknownFormatError

REPO = Path(__file__).resolve().parents[1]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pytreeio: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _hostile_npz(tmp_path: Path) -> Path:
    """A ZIP local header followed by junk: every reader must fail cleanly."""
    path = tmp_path / "hostile.npz"
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4 + b"PK\x05\x06" + b"\xff" * 18)
    return path


# --------------------------------------------------------------------------
# error handling (independent of the formats: the API call is replaced)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (
            FormatError("bad magic", path="x.bin", field="header", offset=3),
            "x.bin, field 'header', offset 3: bad magic",
        ),
        (MismatchError("shape differs", key_path="a/b"), "at 'a/b': shape differs"),
        (
            UnknownFormatError("the content matches no registered format; pass format=", path="x"),
            "x: the content matches no registered format; pass --format",
        ),
        (
            FileNotFoundError(errno.ENOENT, "No such file or directory", "missing.msgpack"),
            "missing.msgpack: No such file or directory",
        ),
        (PermissionError(errno.EACCES, "Permission denied"), "[Errno 13] Permission denied"),
        (FormatError("line one\nline two", path="f"), "f: line one line two"),
    ],
)
def test_errors_print_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    exc: Exception,
    expected: str,
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(api, "verify", fail)
    code, out, err = _run(["verify", "whatever"], capsys)
    assert code == 1 and out == ""
    assert _one_error_line(err) == f"pytreeio: error: {expected}"


@pytest.mark.parametrize("argv", [["--debug", "verify", "x"], ["verify", "x", "--debug"]])
def test_debug_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise FormatError("bad", path="x")

    monkeypatch.setattr(api, "verify", fail)
    with pytest.raises(FormatError, match="bad"):
        cli.main(argv)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "argv", [[], ["bogus"], ["convert", "a", "b"], ["inspect"], ["verify", "x", "--nope"]]
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_unknown_format_error_keeps_its_path(capsys: pytest.CaptureFixture[str]) -> None:
    exc = UnknownFormatError("cannot tell the format from the suffix; pass format=", path="a.xyz")
    assert cli.error_line(exc) == "a.xyz: cannot tell the format from the suffix; pass --format"
    assert exc.path == "a.xyz"


# --------------------------------------------------------------------------
# through the API and the registered formats
# --------------------------------------------------------------------------


def test_formats_lists_layout_kinds_and_meta_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["formats"], capsys)
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert rows and all(r[1] in ("file", "siblings", "dir") for r in rows)
    code, out, _ = _run(["formats", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and "msgpack" in doc
    for entry in doc.values():
        assert entry["layout"] in ("file", "siblings", "dir")
        assert isinstance(entry["accepts_meta"], bool) and isinstance(entry["keeps_meta"], bool)
        assert "stores_meta" not in entry


def test_missing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["verify", str(tmp_path / "nope.msgpack")], capsys)
    assert code == 1
    line = _one_error_line(err)
    assert "nope.msgpack" in line and "No such file" in line


def test_hostile_npz_verify_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _hostile_npz(tmp_path)
    for argv in (["verify", str(path)], ["inspect", str(path)]):
        code, out, err = _run(argv, capsys)
        assert code == 1 and out == ""
        _one_error_line(err)


def test_unknown_format_names_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mystery.bin"
    path.write_bytes(b"\x00\x01 not any checkpoint format \xfe" * 10)
    code, _, err = _run(["inspect", str(path)], capsys)
    line = _one_error_line(err)
    assert code == 1 and "--format" in line and "format=" not in line
    code, _, err = _run(["inspect", str(path), "--format", "no-such-format"], capsys)
    line = _one_error_line(err)
    assert code == 1 and "no-such-format" in line


def test_a_sibling_format_at_a_path_of_another_kind_names_the_files_looked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.nn"
    np.savez(path, w=np.ones(2))  # writes x.nn.npz
    os.replace(str(path) + ".npz", path)
    code, _, err = _run(["inspect", str(path), "--format", "netcl-checkpoint"], capsys)
    line = _one_error_line(err)
    assert code == 1 and "looked for" in line and "x.nn" in line


def test_the_module_runs_as_a_command(tmp_path: Path) -> None:
    path = _hostile_npz(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "pytreeio.cli", "verify", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    _one_error_line(r.stderr)
    r = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "Traceback" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "pytreeio.cli", "frobnicate"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and "usage:" in r.stderr
