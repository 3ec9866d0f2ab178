"""Conversions between formats keep every byte and the meta (checked against real files)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import cli


def test_real_tinyllama_file_round_trips_through_safetensors(
    conformance: Path, tmp_path: Path
) -> None:
    original = conformance / "tinyllama" / "weights.bin"
    ptio.convert(original, tmp_path / "w.safetensors", to="safetensors")
    assert ptio.inspect(tmp_path / "w.safetensors").meta == ptio.inspect(original).meta
    ptio.convert(tmp_path / "w.safetensors", tmp_path / "w.bin", to="tinyllama")
    assert (tmp_path / "w.bin").read_bytes() == original.read_bytes()


def test_real_tinyllama_file_round_trips_through_msgpack(conformance: Path, tmp_path: Path) -> None:
    original = conformance / "tinyllama" / "weights.bin"
    # msgpack has no room for the config: refused unless lossy, and supplied on the way back
    with pytest.raises(ptio.ConversionError, match="config"):
        ptio.convert(original, tmp_path / "w.msgpack", to="msgpack")
    with pytest.warns(ptio.PytreeioWarning, match="config"):
        ptio.convert(original, tmp_path / "w.msgpack", to="msgpack", lossy=True)
    ptio.convert(
        tmp_path / "w.msgpack", tmp_path / "w.bin", to="tinyllama", meta=ptio.inspect(original).meta
    )
    assert (tmp_path / "w.bin").read_bytes() == original.read_bytes()


def test_cli_convert_reports_and_fails_cleanly(
    conformance: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "w.safetensors"
    assert (
        cli.main(
            [
                "convert",
                str(conformance / "tinyllama" / "weights.bin"),
                str(dst),
                "--to",
                "safetensors",
            ]
        )
        == 0
    )
    assert "27 entries" in capsys.readouterr().out
    # a target that cannot take the tree: a clean error, and nothing written
    bad = tmp_path / "w.bin"
    ptio.save(tmp_path / "x.msgpack", {"a": np.ones(3, np.float32)})
    assert cli.main(["convert", str(tmp_path / "x.msgpack"), str(bad), "--to", "tinyllama"]) == 1
    assert "pytreeio: error" in capsys.readouterr().err and not bad.exists()
