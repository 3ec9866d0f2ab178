"""Integrity: per-tensor safetensors checksums, manifests for every layout, NaN/inf reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from model_data import MLP_LAYERS, mlp_params

import pytreeio as ptio
from pytreeio import cli, integrity
from pytreeio.core.errors import FormatError

LAYERS = MLP_LAYERS


_params = mlp_params


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------
# safetensors: per-tensor checksums
# --------------------------------------------------------------------------


def _tree() -> dict[str, np.ndarray]:
    return {
        "a": np.arange(1000, dtype=np.float32),
        "b": np.arange(300, dtype=np.int64).reshape(10, 30),
        "c": np.ones(7, np.float16),
    }


def test_safetensors_checksums_recorded_and_clean_files_verify(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    ptio.save(path, _tree())
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    sums = json.loads(header["__metadata__"]["pytreeio.xxh3_64"])
    assert set(sums) == {"a", "b", "c"} and all(len(v) == 16 for v in sums.values())
    info = ptio.verify(path)
    assert "nonfinite" not in info.meta
    got = ptio.load(path, verify=True)
    np.testing.assert_array_equal(got["b"], _tree()["b"])


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_corrupted_tensor_is_named(tmp_path: Path, name: str) -> None:
    path = tmp_path / "x.safetensors"
    ptio.save(path, _tree())
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    begin, end = header[name]["data_offsets"]
    _flip(path, 8 + n + (begin + end) // 2)
    ptio.load(path)  # the default load does not hash
    for call in (lambda: ptio.verify(path), lambda: ptio.load(path, verify=True)):
        with pytest.raises(FormatError) as e:
            call()
        assert e.value.field == name
        assert e.value.offset == 8 + n + begin
        assert e.value.path == str(path)
        assert "corrupted" in str(e.value)


def test_checksum_option_off(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    ptio.save(path, _tree(), checksum=False)
    assert b"pytreeio.xxh3_64" not in path.read_bytes()
    _flip(path, path.stat().st_size - 1)
    ptio.verify(path)  # nothing recorded, nothing to check


def test_malformed_checksum_document(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    ptio.save(path, _tree())
    data = path.read_bytes()
    # the same length: a checksum now names a tensor the file lacks
    bad = data.replace(b'{\\"a\\":', b'{\\"z\\":', 1)
    assert bad != data
    path.write_bytes(bad)
    with pytest.raises(FormatError, match="lacks"):
        ptio.verify(path)


def test_safetensors_package_files_load_and_verify(tmp_path: Path) -> None:
    path = tmp_path / "hf.safetensors"
    safetensors.numpy.save_file(
        {"w": np.array([1.0, np.nan, np.inf, -np.inf], np.float32), "i": np.arange(3)},
        str(path),
        metadata={"source": "hf"},
    )
    info = ptio.verify(path)
    assert info.meta["nonfinite"] == {"w": {"nan": 1, "inf": 2}}
    assert info.meta["source"] == "hf"
    got = ptio.load(path, verify=True)
    assert set(got) == {"w", "i"}


# --------------------------------------------------------------------------
# NaN / inf
# --------------------------------------------------------------------------


def test_nonfinite_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ml_dtypes

    monkeypatch.setattr(integrity, "CHUNK_ELEMENTS", 3)  # several chunks per tensor
    x = np.zeros(10, np.float32)
    x[[1, 5, 9]] = [np.nan, np.inf, -np.inf]
    bf = np.array([np.nan, 1, np.nan], ml_dtypes.bfloat16)
    tree = {"x": x, "bf": bf, "ok": np.ones(4), "i": np.arange(4), "s": float("nan")}
    path = tmp_path / "x.safetensors"
    ptio.save(path, tree)
    info = ptio.verify(path)
    assert info.meta["nonfinite"] == {
        "x": {"nan": 1, "inf": 2},
        "bf": {"nan": 2, "inf": 0},
        "s": {"nan": 1, "inf": 0},
    }
    assert integrity.nonfinite_counts({"a": [1.0, 2]}) == {}


def test_nonfinite_report_other_formats(tmp_path: Path) -> None:
    params = _params()
    params["Dense_1"]["bias"][0] = np.nan
    path = tmp_path / "m.nn"
    ptio.save(path, {"params": params}, format="datacode", layers=LAYERS)
    info = ptio.verify(path, format="datacode")
    (entry,) = info.meta["nonfinite"]
    assert info.meta["nonfinite"][entry] == {"nan": 1, "inf": 0}


# --------------------------------------------------------------------------
# manifests
# --------------------------------------------------------------------------


def test_manifest_single_file(tmp_path: Path, conformance: Path) -> None:
    path = tmp_path / "weights.bin"
    shutil.copy(conformance / "tinyllama" / "weights.bin", path)
    assert not integrity.check_manifest(path, "tinyllama")  # none yet
    where = integrity.write_manifest(path, format="tinyllama")
    assert where == tmp_path / "weights.bin.pytreeio-sum.json"
    doc = json.loads(where.read_text())
    assert doc["format"] == "tinyllama"
    assert doc["files"]["weights.bin"]["size"] == path.stat().st_size
    assert integrity.check_manifest(path)
    ptio.verify(path, format="tinyllama")
    ptio.load(path, format="tinyllama", verify=True)
    # the original system's file is untouched; the sidecar is a sibling
    assert (conformance / "tinyllama" / "weights.bin").read_bytes() == path.read_bytes()

    # corrupted in place: same size, different bytes
    _flip(path, path.stat().st_size // 2)
    ptio.load(path, format="tinyllama")  # not checked unless asked
    with pytest.raises(FormatError, match="changed since") as e:
        ptio.verify(path, format="tinyllama")
    assert e.value.path == str(path.resolve()) and e.value.field == "weights.bin"
    with pytest.raises(FormatError, match="changed since"):
        ptio.load(path, format="tinyllama", verify=True)


def test_manifest_stale_after_resave(tmp_path: Path, conformance: Path) -> None:
    src = conformance / "tinyllama" / "weights.bin"
    path = tmp_path / "weights.bin"
    shutil.copy(src, path)
    integrity.write_manifest(path)
    # a re-save of different content leaves the sidecar stale
    native, meta = ptio.load_with_meta(path, format="tinyllama")
    native["output"] = np.asarray(native["output"]) + 1
    ptio.save(path, native, format="tinyllama", meta=meta)
    with pytest.raises(FormatError, match="changed since"):
        ptio.verify(path, format="tinyllama")
    integrity.write_manifest(path)  # rewritten: clean again
    ptio.verify(path, format="tinyllama")


def test_manifest_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    ptio.save(path, _tree(), checksum=False)
    integrity.write_manifest(path)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(FormatError):
        ptio.verify(path)
    with pytest.raises(FormatError, match="recorded"):
        integrity.check_manifest(path, "safetensors")


def test_manifest_follows_symlink(tmp_path: Path) -> None:
    real = tmp_path / "ckpt_1.safetensors"
    ptio.save(real, _tree())
    link = tmp_path / "latest.safetensors"
    link.symlink_to(real.name)
    where = integrity.write_manifest(link)
    assert where == tmp_path / "ckpt_1.safetensors.pytreeio-sum.json"
    assert integrity.check_manifest(real)


@pytest.mark.parametrize("fmt", ["waffe2", "bullet"])
def test_manifest_directory(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / ("w.wf2model" if fmt == "waffe2" else "b")
    ptio.save(path, {"params": _params()}, format=fmt, layers=LAYERS)
    where = integrity.write_manifest(path)
    assert where == path / "pytreeio-sum.json"
    info = ptio.verify(path)  # the format still reads its directory with the sidecar in it
    assert info.format == fmt
    ptio.load(path, verify=True)
    members = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and p.name != "pytreeio-sum.json" and ".pytreeio-" not in p.name
    )
    assert members
    doc = json.loads(where.read_text())
    assert set(doc["files"]) == {p.relative_to(path).as_posix() for p in members}

    # a corrupted member is named (path and field)
    victim = max(members, key=lambda p: p.stat().st_size)
    _flip(victim, victim.stat().st_size - 2)
    with pytest.raises(FormatError) as e:
        integrity.check_manifest(path)
    assert e.value.path == str(victim.resolve())
    assert e.value.field == victim.relative_to(path).as_posix()
    with pytest.raises(FormatError, match=victim.name):
        ptio.verify(path)

    # an added member and a removed one
    integrity.write_manifest(path)
    extra = path / "notes.txt"
    extra.write_text("x")
    with pytest.raises(FormatError, match="not recorded") as e:
        integrity.check_manifest(path)
    assert e.value.field == "notes.txt"
    extra.unlink()
    integrity.check_manifest(path)

    # the next save swaps the whole directory in: the sidecar goes with the old checkpoint
    ptio.save(path, {"params": _params()}, format=fmt, layers=LAYERS)
    assert not where.exists()
    assert not integrity.check_manifest(path)
    ptio.verify(path)


def test_verify_during_a_save_verifies_one_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save between verify's decode and its manifest check pairs one version's manifest
    with the other's files: verify sees the checkpoint changed and checks it again, where a
    corruption of an unchanged checkpoint is reported at once."""
    path = tmp_path / "w.wf2model"
    ptio.save(path, {"params": _params()}, format="waffe2", layers=LAYERS)
    integrity.write_manifest(path)
    real = integrity.check_manifest
    calls: list[int] = []

    def saved_meanwhile(p: Any, fmt: Any = None) -> bool:
        calls.append(1)
        if len(calls) == 1:  # what a read of the old manifest beside the new files finds
            ptio.save(path, {"params": _params()}, format="waffe2", layers=LAYERS)
            integrity.write_manifest(path)
            raise FormatError("changed since its manifest was written", path=str(p))
        return real(p, fmt)

    monkeypatch.setattr(integrity, "check_manifest", saved_meanwhile)
    assert ptio.verify(path).format == "waffe2"
    assert len(calls) == 2

    calls.clear()
    monkeypatch.setattr(integrity, "check_manifest", real)
    victim = max((p for p in path.iterdir() if p.suffix == ".npy"), key=lambda p: p.stat().st_size)
    _flip(victim, victim.stat().st_size - 2)
    with pytest.raises(FormatError, match=victim.name):
        ptio.verify(path)  # unchanged during the check: the verdict stands


def test_manifest_conformance_waffe2_directory(tmp_path: Path, conformance: Path) -> None:
    path = tmp_path / "t.wf2model"
    shutil.copytree(conformance / "waffe2" / "tiny_adam3_opt.wf2model", path)
    integrity.write_manifest(path)
    ptio.verify(path)
    victim = path / "parameters.json"
    victim.write_bytes(victim.read_bytes() + b" ")
    with pytest.raises(FormatError, match=r"parameters\.json") as e:
        ptio.verify(path)
    assert e.value.field == "parameters.json"


def test_manifest_sibling_pair(tmp_path: Path) -> None:
    stem = tmp_path / "ck"
    ptio.save(stem, {"params": _params()}, format="netcl-checkpoint", layers=LAYERS)
    where = integrity.write_manifest(stem, format="netcl-checkpoint")
    doc = json.loads(where.read_text())
    assert len(doc["files"]) == 2
    ptio.verify(stem, format="netcl-checkpoint")
    json_file = next(tmp_path.glob("ck*.json"))
    if json_file == where:
        json_file = next(p for p in tmp_path.glob("ck*.json") if p != where)
    json_file.write_bytes(json_file.read_bytes() + b" ")
    with pytest.raises(FormatError, match="changed since"):
        ptio.verify(stem, format="netcl-checkpoint")


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"pytreeio-sum": 2, "algorithm": "xxh3_64", "files": {}}',
        '{"pytreeio-sum": 1, "algorithm": "md5", "files": {}}',
        '{"pytreeio-sum": 1, "algorithm": "xxh3_64", "files": []}',
        '{"pytreeio-sum": 1, "algorithm": "xxh3_64", "files": {"x": {"size": -1, "xxh3_64": ""}}}',
        '{"pytreeio-sum": 1, "algorithm": "xxh3_64", "files": {"../x": {"size": 1, "xxh3_64": ""}}}',
        '{"pytreeio-sum": 1, "algorithm": "xxh3_64", "files": {"x": {"size": true, "xxh3_64": ""}}}',
        "[" * 10000,
    ],
)
def test_malformed_manifest(tmp_path: Path, text: str) -> None:
    path = tmp_path / "x.safetensors"
    ptio.save(path, _tree())
    (tmp_path / "x.safetensors.pytreeio-sum.json").write_text(text)
    with pytest.raises(FormatError) as e:
        ptio.verify(path)
    assert e.value.path == str(tmp_path / "x.safetensors.pytreeio-sum.json")


# --------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------


def test_cli_checksum_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.nn"
    params = _params()
    params["Dense_0"]["bias"][:2] = np.inf
    ptio.save(path, {"params": params}, format="datacode", layers=LAYERS)
    assert cli.main(["checksum", str(path), "--format", "datacode"]) == 0
    out = capsys.readouterr().out
    assert "m.nn.pytreeio-sum.json" in out
    assert cli.main(["verify", str(path), "--format", "datacode"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "non-finite" in out and "2 inf" in out
    assert cli.main(["verify", str(path), "--format", "datacode", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and list(doc["meta"]["nonfinite"].values()) == [{"nan": 0, "inf": 2}]
    _flip(path, path.stat().st_size - 1)
    assert cli.main(["verify", str(path), "--format", "datacode"]) == 1
    err = capsys.readouterr().err
    assert "m.nn" in err and "changed since" in err
