"""A load's path: numpy templates with jax loaded, and each file probed once per sniff."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import io
from pytreeio.core import records
from pytreeio.engine import dispatch
from pytreeio.formats import registry


def test_loads_into_numpy_templates_are_unchanged_with_jax_loaded(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    tree = {"p": {f"m{i}": {"w": np.full(3, i, np.float32)} for i in range(5)}}
    for fmt in ("safetensors", "msgpack"):
        path = tmp_path / f"t.{fmt}"
        ptio.save(path, tree)
        back = ptio.load(path, like=tree)
        assert list(back["p"]) == list(tree["p"])
        assert all(back["p"][k]["w"].tobytes() == v["w"].tobytes() for k, v in tree["p"].items())


# --------------------------------------------------------------------------
# io.probe(made=): one probe of the file for every layout, the same probes
# --------------------------------------------------------------------------


def _layouts() -> list[records.Layout]:
    out: list[records.Layout] = []
    for fmt in registry.iter_formats():
        if fmt.layout not in out:
            out.append(fmt.layout)
    return out


@pytest.mark.parametrize("what", ["file", "dir", "missing", "npz"])
def test_shared_probes_equal_fresh_ones(what: str, tmp_path: Path) -> None:
    tree = {"w": np.arange(4, dtype=np.float32)}
    if what == "file":
        path = tmp_path / "t.safetensors"
        ptio.save(path, tree)
    elif what == "dir":
        path = tmp_path / "d"
        path.mkdir()
        (path / "a.json").write_text("{}")
    elif what == "npz":
        path = tmp_path / "ckpt.npz"
        np.savez(path, w=tree["w"])
        (tmp_path / "ckpt.json").write_text("{}")
    else:
        path = tmp_path / "nope"
    made: dict[Path, records.Probe] = {}
    for layout in _layouts():
        assert io.probe(path, layout, made=made) == io.probe(path, layout)
    assert all(p.kind in {"file", "missing", "dir"} for p in made.values())


def test_sniffing_probes_the_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.safetensors"
    ptio.save(path, {"w": np.zeros(2, np.float32)})
    calls: list[Path] = []
    real = io.probes._probe_file

    def counted(p: Path) -> records.Probe:
        calls.append(p)
        return real(p)

    monkeypatch.setattr(io.probes, "_probe_file", counted)
    assert dispatch.format_for_load(path, None).name == "safetensors"
    assert calls.count(Path(path)) == 1
