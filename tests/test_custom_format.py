"""The user-defined-format recipe (examples/custom_format.py): registered, it works everywhere."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.formats import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_format.py"


@pytest.fixture(scope="module")
def recipe() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("custom_format_recipe", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers "jsonarrays"
    yield module
    registry.unregister(module.NAME)


def tree() -> dict:
    rng = np.random.default_rng(0)
    return {
        "params": {"Dense_0": {"kernel": rng.standard_normal((3, 2)).astype(np.float32)}},
        "ints": np.arange(4, dtype=np.int64),
        "step": 3,
        "lr": 0.5,
    }


def test_registered_and_listed(recipe: ModuleType) -> None:
    fmt = ptio.list_formats()["jsonarrays"]
    assert fmt is recipe.FORMAT and fmt.save_options == {"indent"} and fmt.load_options == set()


def test_save_load_inspect_verify(recipe: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "w.arrays.json"
    ptio.save(path, tree(), meta={"run": "a"}, indent=2)  # the suffix picks the format
    back, meta = ptio.load_with_meta(path)  # sniffed from the content
    assert meta == {"run": "a"}
    np.testing.assert_array_equal(
        back["params"]["Dense_0"]["kernel"], tree()["params"]["Dense_0"]["kernel"]
    )
    assert back["step"] == 3 and back["lr"] == 0.5 and back["ints"].dtype == np.int64
    like = {
        "params": {"Dense_0": {"kernel": np.zeros((3, 2), np.float32)}},
        "ints": np.zeros(4, np.int64),
        "step": 0,
        "lr": 0.0,
    }
    restored = ptio.load(path, like=like)
    assert restored["params"]["Dense_0"]["kernel"].shape == (3, 2)
    info = ptio.inspect(path)
    assert info.format == "jsonarrays" and {e.name for e in info.entries} >= {
        "params/Dense_0/kernel",
        "ints",
    }
    assert ptio.verify(path).format == "jsonarrays"
    with pytest.raises(TypeError, match="indent"):
        ptio.save(path, tree(), indnet=2)


def test_convert_both_ways(
    recipe: ModuleType, tmp_path: Path, conformance: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "w.arrays.json"
    ptio.save(src, tree())
    ptio.convert(src, tmp_path / "w.msgpack", to="msgpack")
    ptio.convert(tmp_path / "w.msgpack", tmp_path / "x.arrays.json", to="jsonarrays")
    again = ptio.load(tmp_path / "x.arrays.json")
    np.testing.assert_array_equal(
        again["params"]["Dense_0"]["kernel"], tree()["params"]["Dense_0"]["kernel"]
    )
    # cl-waffe2 -> the new format -> cl-waffe2 reproduces cl-waffe2's bytes
    original = conformance / "waffe2" / "tiny_adam1_opt.wf2model"
    monkeypatch.chdir(tmp_path)
    ptio.convert(original, "t.arrays.json", to="jsonarrays")
    ptio.convert("t.arrays.json", original.name, to="waffe2")
    for f in original.iterdir():
        assert (tmp_path / original.name / f.name).read_bytes() == f.read_bytes()


def test_malformed_input_is_a_format_error(recipe: ModuleType) -> None:
    for data in (
        b"",
        b"[1]",
        b'{"format":"jsonarrays","arrays":{"a":{"dtype":"float32","shape":[3],"data":[1]}}}',
        b'{"format":"jsonarrays","arrays":{"a":{"dtype":"object","shape":[],"data":1}}}',
        b"[" * 100000,
    ):
        with pytest.raises(ptio.FormatError):
            ptio.decode(data, format="jsonarrays")
    with pytest.raises(ptio.EncodeError):
        ptio.encode({"a": np.array(["text"])}, format="jsonarrays")


def test_command_line(recipe: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "w.arrays.json"
    ptio.save(path, tree())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(EXAMPLE), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    done = cli("inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert "format jsonarrays" in done.stdout and "params/Dense_0/kernel" in done.stdout
    done = cli("convert", str(path), str(tmp_path / "w.safetensors"), "--to", "safetensors")
    assert done.returncode == 0, done.stderr
    assert "jsonarrays" in cli("formats").stdout
    done = cli("walkthrough", "--out", str(tmp_path / "walk"))
    assert done.returncode == 0 and done.stdout.count("equal = True") == 2, (
        done.stdout + done.stderr
    )
