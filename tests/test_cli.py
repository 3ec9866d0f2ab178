"""The ``pytreeio`` command: one-line errors, exit codes, ``--debug``, ``formats``."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from model_data import MLP_LAYERS, mlp_params

from pytreeio import api, cli
from pytreeio.core.errors import FormatError, MismatchError, UnknownFormatError

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


def test_formats_lists_layout_kinds_meta_flags_and_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(["formats"], capsys)
    assert code == 0
    rows = [line.split() for line in out.splitlines() if not line.startswith(" ")]
    assert rows and all(r[1] in ("file", "siblings", "dir") for r in rows)
    names = [r[0] for r in rows]
    assert names == sorted(api.list_formats())
    # two indented lines per format: its save and its load options, with defaults
    options = [line.strip() for line in out.splitlines() if line.startswith(" ")]
    assert len(options) == 2 * len(names)
    assert all(o.startswith(("save options: ", "load options: ")) for o in options)
    block = out[out.index("\nbullet ") if "\nbullet " in out else out.index("bullet ") :]
    assert "saved_format=None" in block.split("\n", 3)[2]
    code, out, _ = _run(["formats", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and "msgpack" in doc
    for name, entry in doc.items():
        assert entry["layout"] in ("file", "siblings", "dir")
        assert isinstance(entry["accepts_meta"], bool) and isinstance(entry["keeps_meta"], bool)
        assert "stores_meta" not in entry
        fmt = api.list_formats()[name]
        assert entry["save_options"] == sorted(fmt.save_options)
        assert entry["load_options"] == sorted(fmt.load_options)
    assert "saved_format" in doc["bullet"]["load_options"]


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


# --------------------------------------------------------------------------
# global flags, help, warnings
# --------------------------------------------------------------------------

LAYERS = MLP_LAYERS


_params = mlp_params


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import pytreeio

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"pytreeio {pytreeio.__version__}\n"


@pytest.mark.parametrize("command", [[], ["convert"], ["inspect"], ["verify"], ["diff"]])
def test_help_lists_the_formats_and_describes_each_argument(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for name, fmt in api.list_formats().items():
        assert name in out and fmt.description in out
    if command == ["convert"]:
        for flag in ("--to", "--from", "--meta", "--opt", "--lossy", "--force", "--no-fsync"):
            assert flag in out
        assert "JSON" in out and "@FILE" in out
    if command == ["diff"]:
        for flag in ("--atol", "--rtol", "--json", "--model", "--native", "--all"):
            assert flag in out
    if not command:
        for sub in ("formats", "inspect", "verify", "convert", "diff", "demo"):
            assert sub in out
        assert "--quiet" in out and "--version" in out and "exit status" in out


def test_warnings_are_one_line_without_source(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    from pytreeio.core.errors import PytreeioWarning

    def warn(*args: object, **kwargs: object) -> object:
        warnings.warn("dropping\nthe thing", PytreeioWarning, stacklevel=2)
        warnings.warn("dropping\nthe thing", PytreeioWarning, stacklevel=2)  # once only
        warnings.warn("odd", RuntimeWarning, stacklevel=2)
        return api.Info("msgpack", ())

    monkeypatch.setattr(api, "verify", warn)
    code, out, err = _run(["verify", "x"], capsys)
    assert code == 0 and "OK" in out
    assert err.splitlines() == [
        "pytreeio: warning: dropping the thing",
        "pytreeio: warning: odd (RuntimeWarning)",
    ]
    code, out, err = _run(["verify", "x", "--quiet"], capsys)
    assert (code, out, err) == (0, "", "")


@pytest.mark.parametrize(
    ("exc", "code", "expected"),
    [
        (RuntimeError("boom\nbang"), 1, "pytreeio: error: RuntimeError: boom bang (--debug"),
        (ValueError("bad value"), 1, "pytreeio: error: bad value"),
        (KeyboardInterrupt(), 130, "pytreeio: error: interrupted"),
    ],
)
def test_any_exception_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    exc: BaseException,
    code: int,
    expected: str,
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(api, "inspect", fail)
    got, out, err = _run(["inspect", "x"], capsys)
    assert got == code and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(expected)


def test_demo_rejects_steps_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--steps", "0"])
    assert e.value.code == 2 and "at least 1" in capsys.readouterr().err


# --------------------------------------------------------------------------
# convert: --meta, --opt, --lossy, --force, --quiet
# --------------------------------------------------------------------------


def test_convert_meta_json_and_at_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "a.msgpack"
    api.save(src, {"w": np.ones(3, np.float32)})
    dst = tmp_path / "b.safetensors"
    code, out, err = _run(
        ["convert", str(src), str(dst), "--to", "safetensors", "--meta", '{"run": 7}'], capsys
    )
    assert code == 0 and err == "" and "b.safetensors (safetensors, 1 entries" in out
    assert api.inspect(dst).meta["run"] == 7
    (tmp_path / "meta.json").write_text('{"run": "from a file"}')
    argv = [
        "convert",
        str(src),
        str(dst),
        "--to",
        "safetensors",
        "--meta",
        f"@{tmp_path}/meta.json",
    ]
    assert _run(argv, capsys)[0] == 0
    assert api.inspect(dst).meta["run"] == "from a file"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--meta", "{not json"], "--meta is not valid JSON"),
        (["--meta", "[1, 2]"], "--meta must be a JSON object"),
        (["--meta", "@/no/such/meta.json"], "cannot read"),
        (["--opt", "novalue"], "NAME=VALUE"),
        (["--opt", "a=1", "--opt", "a=2"], "given twice"),
        (["--opt", "frobnicate=1"], "frobnicate"),
    ],
)
def test_convert_usage_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    src = tmp_path / "a.msgpack"
    api.save(src, {"w": np.ones(3, np.float32)})
    dst = tmp_path / "b.safetensors"
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", str(src), str(dst), "--to", "safetensors", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err and message in err
    assert not dst.exists()


def test_convert_options_are_parsed_as_json_or_strings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "m.netcl"
    api.save(src, {"params": _params()}, meta={"config": LAYERS})
    dst = tmp_path / "m.nn"
    argv = ["convert", str(src), str(dst), "--to", "datacode", "--opt", "variant=later"]
    assert _run(argv, capsys)[0] == 0  # a string
    assert api.inspect(dst).meta["_datacode_file"]["variant"] == "later"
    argv = ["convert", str(src), str(tmp_path / "m.msgpack"), "--to", "msgpack"]
    assert _run([*argv, "--opt", "chunk_bytes=4096"], capsys)[0] == 0  # a number
    # a value of the wrong kind is the format's error: one line, exit 1
    code, _, err = _run([*argv, "--opt", "verify_crc=[1]", "--opt", "chunk_bytes=-5"], capsys)
    assert code == 1
    _one_error_line(err)


def test_convert_lossy_lists_what_was_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "a.safetensors"
    api.save(src, {"w": np.ones(3, np.float32)}, meta={"run": "7", "owner": "me"})
    dst = tmp_path / "b.msgpack"  # msgpack has no place for meta
    code, out, err = _run(["convert", str(src), str(dst), "--to", "msgpack"], capsys)
    assert code == 1 and out == "" and "lossy" in _one_error_line(err) and not dst.exists()
    code, out, err = _run(["convert", str(src), str(dst), "--to", "msgpack", "--lossy"], capsys)
    assert code == 0 and "(msgpack, 1 entries" in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pytreeio: warning: ")
    assert "'owner'" in lines[0] and "'run'" in lines[0]
    assert ".py" not in err and "Warning" not in err
    dst.unlink()
    code, out, err = _run(
        ["convert", str(src), str(dst), "--to", "msgpack", "--lossy", "-q"], capsys
    )
    assert (code, out, err) == (0, "", "") and dst.exists()


def test_convert_refuses_a_suffix_of_another_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "a.msgpack"
    api.save(src, {"w": np.ones(3, np.float32)})
    dst = tmp_path / "x.msgpack"
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", str(src), str(dst), "--to", "safetensors"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'msgpack'" in err and "--force" in err and not dst.exists()
    assert _run(["convert", str(src), str(dst), "--to", "safetensors", "--force"], capsys)[0] == 0
    assert api.inspect(dst).format == "safetensors"
    # a suffix no format claims, or the target's own, is fine
    for name in ("x.bin", "x.safetensors"):
        assert (
            _run(["convert", str(src), str(tmp_path / name), "--to", "safetensors"], capsys)[0] == 0
        )


def test_quiet_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "a.msgpack"
    api.save(src, {"w": np.ones(3, np.float32)})
    for argv in (
        ["-q", "inspect", str(src)],
        ["verify", str(src), "--quiet"],
        ["--quiet", "convert", str(src), str(tmp_path / "b.safetensors"), "--to", "safetensors"],
        ["formats", "-q"],
    ):
        assert _run(argv, capsys) == (0, "", "")
    code, out, err = _run(["-q", "verify", str(tmp_path / "nope")], capsys)
    assert code == 1 and out == "" and "nope" in _one_error_line(err)


# --------------------------------------------------------------------------
# verify --json, verify --opt
# --------------------------------------------------------------------------


def test_verify_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "a.safetensors"
    api.save(src, {"w": np.ones((2, 3), np.float32)}, meta={"run": "x"})
    code, out, _ = _run(["verify", str(src), "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and doc["format"] == "safetensors"
    assert doc["entries"] == [{"name": "w", "shape": [2, 3], "dtype": "float32", "nbytes": 24}]
    assert doc["meta"]["run"] == "x" and doc["path"] == str(src)
    (tmp_path / "bad.safetensors").write_bytes(src.read_bytes()[:-4])
    code, out, err = _run(["verify", str(tmp_path / "bad.safetensors"), "--json"], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and "bad.safetensors" in doc["error"]
    assert _one_error_line(err).endswith(doc["error"])


def test_verify_bullet_quantisation_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytreeio.formats.bullet import checkpoint as bullet

    rng = np.random.default_rng(1)
    weights = {
        "l0w": (rng.standard_normal((6, 4)) * 0.1).astype(np.float32),
        "l0b": (rng.standard_normal(4) * 0.1).astype(np.float32),
        "l1w": (rng.standard_normal((4, 1)) * 0.1).astype(np.float32),
        "l1b": (rng.standard_normal(1) * 0.1).astype(np.float32),
    }
    layout = bullet.classic_layout([255, 64])
    ck = tmp_path / "net"
    api.save(ck, {"weights": weights}, format="bullet", meta={"saved_format": layout})
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    argv = ["verify", str(ck), "--opt", f"saved_format=@{tmp_path / 'layout.json'}"]
    code, out, _ = _run([*argv, "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True
    assert set(doc["meta"]["quantisation_error"]) == {"l0w", "l0b", "l1w", "l1b"}
    code, out, _ = _run(argv, capsys)
    assert code == 0 and "quantisation error: largest" in out
    code, out, _ = _run(["verify", str(ck), "--opt", f"saved_format={json.dumps(layout)}"], capsys)
    assert code == 0 and "quantisation error" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", str(ck), "--opt", "nonsense=1"])
    assert e.value.code == 2 and "nonsense" in capsys.readouterr().err


# --------------------------------------------------------------------------
# inspect of directories and sibling pairs
# --------------------------------------------------------------------------


def _entries(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("  ") and "meta" not in line]


def test_inspect_directories_and_sibling_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params = _params()
    api.save(tmp_path / "w.wf2model", {"params": params}, format="waffe2", layers=LAYERS)
    api.save(tmp_path / "b", {"params": params}, format="bullet")
    api.save(tmp_path / "ck", {"params": params}, format="netcl-checkpoint", layers=LAYERS)
    for path, fmt in (("w.wf2model", "waffe2"), ("b", "bullet"), ("b/", "bullet")):
        code, out, err = _run(["inspect", str(tmp_path / path)], capsys)
        assert code == 0 and err == "" and f"format {fmt}, 4 entries" in out
        code, out, _ = _run(["inspect", str(tmp_path / path), "--json"], capsys)
        assert code == 0 and len(json.loads(out)["entries"]) == 4
        assert _run(["verify", str(tmp_path / path)], capsys)[0] == 0
    code, stem_out, _ = _run(["inspect", str(tmp_path / "ck")], capsys)
    assert code == 0 and "format netcl-checkpoint, 4 entries" in stem_out
    for member in ("ck.npz", "ck.json"):
        for extra in ([], ["--format", "netcl-checkpoint"]):
            code, out, err = _run(["inspect", str(tmp_path / member), *extra], capsys)
            assert code == 0 and err == "", err
            assert "format netcl-checkpoint, 4 entries" in out
            assert _entries(out) == _entries(stem_out)
        code, out, _ = _run(["verify", str(tmp_path / member), "--json"], capsys)
        assert code == 0 and json.loads(out)["format"] == "netcl-checkpoint"
    code, out, _ = _run(
        [
            "convert",
            str(tmp_path / "ck.json"),
            str(tmp_path / "x.safetensors"),
            "--to",
            "safetensors",
        ],
        capsys,
    )
    assert code == 0


# --------------------------------------------------------------------------
# progress display
# --------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytreeio import progress

    src = tmp_path / "a.msgpack"
    api.save(src, {"w": np.ones(1000, np.float32)})
    size = src.stat().st_size
    monkeypatch.setattr(progress, "POLL_S", 0.01)
    # under the threshold, or not a terminal: nothing
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert _run(["verify", str(src)], capsys)[0] == 0 and term.getvalue() == ""
    assert not progress.should_show(10**9, io.StringIO())
    assert progress.should_show(10**9, _Terminal()) and not progress.should_show(size, _Terminal())
    # forced terminal mode with a threshold below the file's size
    monkeypatch.setattr(progress, "THRESHOLD", size)
    code, out, _ = _run(["verify", str(src)], capsys)
    shown = term.getvalue()
    assert code == 0 and "OK" in out and "OK" not in shown
    assert "verifying a.msgpack" in shown and "\x1b[" in shown  # drawn with terminal controls
    term.seek(0)
    term.truncate()
    dst = tmp_path / "b.safetensors"
    code, out, _ = _run(["convert", str(src), str(dst), "--to", "safetensors"], capsys)
    assert code == 0 and "converting" in term.getvalue() and "safetensors" in out
    term.seek(0)
    term.truncate()
    code, out, _ = _run(["diff", str(src), str(src)], capsys)
    assert code == 0 and "comparing a.msgpack and a.msgpack" in term.getvalue()
    term.seek(0)
    term.truncate()
    assert _run(["verify", str(src), "-q"], capsys)[0] == 0 and term.getvalue() == ""


def test_progress_counts_real_io(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import time

    from pytreeio import progress

    if progress.io_counters() is None:
        pytest.skip("no /proc/self/io here")
    path = tmp_path / "blob"
    path.write_bytes(b"\0" * 3_000_000)
    monkeypatch.setattr(progress, "POLL_S", 0.01)
    term = _Terminal()
    with progress.activity("reading blob", 3_000_000, stream=term, show=True):
        path.read_bytes()
        time.sleep(0.2)
    text = term.getvalue()
    assert "reading blob (3.0 MB)" in text and "read 3.0 MB" in text
    assert "%" not in text  # no percentage: nothing here knows one
    term = _Terminal()
    with progress.activity("mapping blob", 3_000_000, stream=term, show=True, counters=False):
        path.read_bytes()
        time.sleep(0.1)
    assert "mapping blob" in term.getvalue() and "read" not in term.getvalue()


def test_path_size(tmp_path: Path) -> None:
    from pytreeio.progress import human, path_size

    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a").write_bytes(b"x" * 10)
    (tmp_path / "d" / "sub" / "b").write_bytes(b"x" * 5)
    (tmp_path / "ck.npz").write_bytes(b"x" * 7)
    (tmp_path / "ck.json").write_bytes(b"x" * 3)
    assert path_size(tmp_path / "d") == 15
    assert path_size(tmp_path / "d" / "a") == 10
    assert path_size(tmp_path / "ck") == 10
    assert path_size(tmp_path / "nothing") == 0
    assert human(999) == "999 B" and human(1_500_000) == "1.5 MB"


def test_inspect_formats_and_verify_do_not_import_rich(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    api.save(path, {"w": np.ones(3, np.float32)})
    code = (
        "import sys\n"
        "from pytreeio import cli\n"
        f"assert cli.main(['inspect', {str(path)!r}]) == 0\n"
        f"assert cli.main(['verify', {str(path)!r}]) == 0\n"
        "assert cli.main(['formats']) == 0\n"
        "heavy = sorted(m for m in ('rich', 'jax', 'flax', 'optax') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
