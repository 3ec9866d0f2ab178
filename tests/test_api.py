"""Dispatch: choosing formats, errors, inspect, convert, the import footprint."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import cli


def test_format_chosen_by_suffix_on_save_and_by_content_on_load(tmp_path: Path) -> None:
    tree = {"w": np.arange(4, dtype=np.float32)}
    ptio.save(tmp_path / "a.msgpack", tree)
    ptio.save(tmp_path / "b.safetensors", tree)
    # a misleading name does not matter on load: the content decides
    (tmp_path / "a.msgpack").rename(tmp_path / "a.weights")
    (tmp_path / "b.safetensors").rename(tmp_path / "b.weights")
    assert ptio.inspect(tmp_path / "a.weights").format == "msgpack"
    assert ptio.inspect(tmp_path / "b.weights").format == "safetensors"
    assert ptio.load(tmp_path / "b.weights")["w"].tolist() == [0, 1, 2, 3]


def test_unknown_and_ambiguous_formats(tmp_path: Path) -> None:
    with pytest.raises(ptio.UnknownFormatError, match="format="):
        ptio.save(tmp_path / "x.bin", {"a": np.ones(1)})
    with pytest.raises(ptio.UnknownFormatError, match="known formats"):
        ptio.save(tmp_path / "x.msgpack", {"a": np.ones(1)}, format="nope")
    (tmp_path / "junk").write_bytes(b"\x00\x01\x02 not a checkpoint")
    with pytest.raises(ptio.UnknownFormatError):
        ptio.load(tmp_path / "junk")
    with pytest.raises(FileNotFoundError):
        ptio.load(tmp_path / "missing.msgpack")


def test_list_formats_lists_the_builtins_and_the_subpackage_is_reachable() -> None:
    names = set(ptio.list_formats())
    assert {"msgpack", "safetensors"} <= names
    from pytreeio.formats import netcl  # format-specific errors live under their format

    assert ptio.formats.netcl is netcl and set(ptio.list_formats()) == names


def test_info_is_readable_and_json(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    ptio.save(path, {"params": {"w": np.ones((2, 3), np.float32)}}, meta={"epoch": 1})
    info = ptio.inspect(path)
    text = str(info)
    assert "safetensors" in text and "params/w" in text and "[2, 3]" in text and "float32" in text
    doc = info.to_json()
    assert doc["entries"] == [
        {"name": "params/w", "shape": [2, 3], "dtype": "float32", "nbytes": 24}
    ]
    assert doc["meta"] == {"epoch": 1} and doc["nbytes"] == 24


def test_convert_between_formats(tmp_path: Path) -> None:
    tree = {"a": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "n": 4}
    ptio.save(tmp_path / "src.msgpack", tree)
    ptio.convert(tmp_path / "src.msgpack", tmp_path / "dst.safetensors", to="safetensors")
    out = ptio.load(tmp_path / "dst.safetensors", like=tree)
    assert out["a"]["w"].tobytes() == tree["a"]["w"].tobytes() and out["n"] == 4
    ptio.save(tmp_path / "m.safetensors", tree, meta={"k": 1})
    # the target has no place for the source's meta: refused before anything is written ...
    with pytest.raises(ptio.ConversionError, match=r"meta \['k'\]") as e:
        ptio.convert(tmp_path / "m.safetensors", tmp_path / "back.msgpack", to="msgpack")
    assert e.value.what == ["meta.k"] and not (tmp_path / "back.msgpack").exists()
    # ... or dropped on request, with a warning that lists it
    with pytest.warns(ptio.PytreeioWarning, match=r"dropping the source's meta \['k'\]"):
        ptio.convert(
            tmp_path / "m.safetensors", tmp_path / "back.msgpack", to="msgpack", lossy=True
        )
    # meta given explicitly to a format that cannot store it: dropped with a warning
    with pytest.warns(ptio.PytreeioWarning, match="cannot store meta"):
        ptio.save(tmp_path / "n.msgpack", tree, meta={"k": 1})


def test_errors_pickle_and_carry_their_fields() -> None:
    e = ptio.FormatError("bad", path="f", offset=3, field="x")
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.path, e2.offset, e2.field, str(e2)) == ("f", 3, "x", str(e))
    m = pickle.loads(
        pickle.dumps(ptio.MismatchError("differs", key_path="a/b", expected=1, found=2))
    )
    assert m.key_path == "a/b" and "expected 1, found 2" in str(m)
    assert issubclass(ptio.FormatError, ValueError) and issubclass(
        ptio.QuantisationError, OverflowError
    )


def test_cli_formats_inspect_verify_convert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "a.msgpack"
    ptio.save(src, {"w": np.ones(3, np.float32)})
    assert cli.main(["formats"]) == 0
    assert "msgpack" in capsys.readouterr().out
    assert cli.main(["inspect", str(src), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"][0]["name"] == "w"
    assert cli.main(["verify", str(src)]) == 0
    assert "OK" in capsys.readouterr().out
    assert (
        cli.main(["convert", str(src), str(tmp_path / "b.safetensors"), "--to", "safetensors"]) == 0
    )
    assert ptio.load(tmp_path / "b.safetensors")["w"].tolist() == [1, 1, 1]
    (tmp_path / "bad.msgpack").write_bytes(src.read_bytes()[:-2])
    assert cli.main(["verify", str(tmp_path / "bad.msgpack")]) == 1
    err = capsys.readouterr().err
    assert "bad.msgpack" in err and "offset" in err


def test_import_and_inspect_do_not_import_jax_flax_optax(tmp_path: Path, conformance: Path) -> None:
    path = tmp_path / "a.safetensors"
    ptio.save(path, {"w": np.ones(3, np.float32)})
    ptio.save(tmp_path / "m.msgpack", {"w": np.ones(3, np.float32)})
    layers = [{"weight": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)}]
    ptio.save(tmp_path / "m.netcl", layers, meta={"config": ["Linear"]})
    ptio.save(tmp_path / "ck", {"params": [np.ones(2, np.float32)]}, format="netcl-checkpoint")
    ptio.save(tmp_path / "b", {"weights": {"l0b": np.ones(4, np.float32)}}, format="bullet")
    paths = [
        path,
        tmp_path / "m.msgpack",
        tmp_path / "m.netcl",
        tmp_path / "ck",
        tmp_path / "b",
        conformance / "tinyllama" / "weights.bin",
        conformance / "datacode" / "model_mnist.nn",
        conformance / "waffe2" / "tiny_adam3_opt.wf2model",
    ]
    code = (
        "import sys, pytreeio\n"
        "from pytreeio import cli\n"
        f"for p in {[str(p) for p in paths]!r}:\n"
        "    assert cli.main(['inspect', p]) == 0, p\n"
        "assert cli.main(['formats']) == 0\n"
        "heavy = sorted(m for m in ('jax', 'flax', 'optax', 'jaxlib') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_demo_runs_and_resumes_exactly(tmp_path: Path) -> None:
    from pytreeio.demo import run_demo

    assert run_demo(str(tmp_path), steps=3) == 0


def test_sniffing_does_not_depend_on_import_order(tmp_path: Path) -> None:
    # A safetensors header length whose low byte looks like a msgpack map header.
    tree = {"w": np.ones(2, np.float32)}
    for pad in range(64):
        blob = ptio.encode(
            {**tree, "k" * (pad + 1): np.ones(1, np.int8)}, format="safetensors"
        ).tobytes()
        if 0x80 <= blob[0] <= 0x8F:
            break
    else:
        pytest.fail("no header length in the msgpack map range found")
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    import pytreeio.formats.msgpack  # noqa: F401

    assert ptio.inspect(path).format == "safetensors"


def test_unknown_load_options_are_rejected_not_ignored(tmp_path: Path) -> None:
    path = tmp_path / "a.msgpack"
    ptio.save(path, {"w": np.ones(2, np.float32)})
    with pytest.raises(TypeError, match="verfy_crc"):
        ptio.load(path, verfy_crc=False)
    with pytest.raises(TypeError, match="accepted: none"):
        ptio.decode(path.read_bytes(), format="msgpack", strict=False)


def test_unknown_format_errors_carry_the_path(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\x01\x02 not a checkpoint")
    with pytest.raises(ptio.UnknownFormatError) as e:
        ptio.load(junk)
    assert e.value.path == str(junk) and str(junk) in str(e.value)
    with pytest.raises(ptio.UnknownFormatError) as e2:
        ptio.save(tmp_path / "x.unknownsuffix", {"a": np.zeros(2)})
    assert e2.value.path == str(tmp_path / "x.unknownsuffix")
    with pytest.raises(ptio.UnknownFormatError) as e3:
        ptio.load(junk, format="no-such-format")
    assert e3.value.path == str(junk)
    again = pickle.loads(pickle.dumps(e.value))
    assert again.path == e.value.path


@pytest.mark.parametrize(
    "fmt",
    [None, "msgpack", "netcl", "netcl-checkpoint", "netcl-params", "datacode", "waffe2", "bullet"],
)
def test_a_missing_checkpoint_is_file_not_found_everywhere(tmp_path: Path, fmt: str | None) -> None:
    missing = tmp_path / "nothing" / "here"
    for call in (
        lambda: ptio.load(missing, format=fmt),
        lambda: ptio.inspect(missing, format=fmt),
        lambda: ptio.verify(missing, format=fmt),
        lambda: ptio.load_with_meta(missing, format=fmt),
        lambda: ptio.convert(missing, tmp_path / "out.safetensors", to="safetensors", from_=fmt),
    ):
        with pytest.raises(FileNotFoundError):
            call()


def test_a_sibling_format_on_an_existing_other_file_names_what_it_looked_for(
    tmp_path: Path,
) -> None:
    nn = tmp_path / "model.nn"
    nn.write_bytes(b"DATACODE\x01\x00\x00\x00")
    with pytest.raises(FileNotFoundError) as e:
        ptio.load(nn, format="netcl-checkpoint")
    assert "model.nn.npz" in str(e.value) and "model.json" in str(e.value)
