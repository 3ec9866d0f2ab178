"""``pytreeio.diff`` and ``pytreeio diff``: bit-exact comparison, tolerances, NaN payloads,
missing/shape/dtype entries, cross-format comparison through the common model form."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from model_data import mlp_params

import pytreeio as ptio
from pytreeio import cli
from pytreeio import diff as D

LAYERS = ["Linear", "ReLU", "Linear"]


_params = mlp_params


def _flip_bit(a: np.ndarray, index: int, bit: int = 0) -> np.ndarray:
    out = a.copy()
    out.reshape(-1).view(np.uint32)[index] ^= np.uint32(1 << bit)
    return out


def _nan(payload: int) -> np.float32:
    return np.array([0x7FC00000 | payload], np.uint32).view(np.float32)[0]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------
# one pair of leaves
# --------------------------------------------------------------------------


def test_identical_leaves() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    e = D.compare_leaves("w", a, a.copy())
    assert e.status == "identical" and e.n_different == 0 and e.size == 12
    assert e.max_abs is None  # nothing differed, nothing measured


def test_one_flipped_bit() -> None:
    a = np.linspace(1, 2, 64, dtype=np.float32)
    b = _flip_bit(a, 10)
    e = D.compare_leaves("w", a, b)
    assert e.status == "values differ" and e.n_different == 1 and e.n_exceeding == 1
    assert e.max_abs == pytest.approx(abs(float(a[10]) - float(b[10])))
    assert e.max_abs is not None and 0 < e.max_abs < 1e-6
    assert e.max_rel == pytest.approx(e.max_abs / max(abs(float(a[10])), abs(float(b[10]))))
    # a tolerance that covers it
    assert D.compare_leaves("w", a, b, atol=1e-6).status == "within tolerance"
    assert D.compare_leaves("w", a, b, rtol=1e-6).status == "within tolerance"
    assert D.compare_leaves("w", a, b, atol=1e-9).status == "values differ"


def test_nan_payloads_and_signed_zeros_differ_in_bits_only() -> None:
    a = np.array([1.0, _nan(1), 0.0, 2.0], np.float32)
    b = np.array([1.0, _nan(2), -0.0, 2.0], np.float32)
    e = D.compare_leaves("w", a, b)
    assert e.status == "values differ"  # bit comparison without a tolerance
    assert (e.n_different, e.nan_payloads, e.signed_zeros, e.max_abs) == (2, 1, 1, 0.0)
    assert "NaN payloads" in e.line() and "signed zeros" in e.line()
    assert D.compare_leaves("w", a, b, atol=1e-30).status == "within tolerance"
    same_nan = np.array([_nan(3)], np.float32)
    assert D.compare_leaves("w", same_nan, same_nan.copy()).status == "identical"


def test_nan_against_a_number_is_never_within_tolerance() -> None:
    a = np.array([1.0, np.nan], np.float32)
    b = np.array([1.0, 5.0], np.float32)
    e = D.compare_leaves("w", a, b, atol=1e30)
    assert e.status == "values differ" and e.nan_mismatches == 1 and e.max_abs == math.inf
    assert e.to_json()["max_abs"] == "inf"
    json.dumps(e.to_json(), allow_nan=False)  # strict JSON


def test_infinities() -> None:
    a = np.array([np.inf, -np.inf, np.inf], np.float32)
    assert D.compare_leaves("w", a, a.copy()).status == "identical"
    e = D.compare_leaves("w", a, np.array([np.inf, np.inf, 1.0], np.float32), atol=1.0)
    assert e.status == "values differ" and e.n_exceeding == 2 and e.max_abs == math.inf


def test_dtype_shape_and_missing() -> None:
    a = np.ones((2, 3), np.float32)
    e = D.compare_leaves("w", a, a.astype(np.float64), atol=1.0)
    assert e.status == "dtype differs" and e.max_abs == 0.0 and e.n_different == 0
    assert (e.dtype_a, e.dtype_b) == ("float32", "float64")
    e = D.compare_leaves("w", a, np.ones((3, 2), np.float32))
    assert e.status == "shape differs" and (e.shape_a, e.shape_b) == ((2, 3), (3, 2))
    assert "[2, 3] vs" in e.line()
    assert D.compare_leaves("w", a, None).status == "only in A"
    assert D.compare_leaves("w", None, a).status == "only in B"


def test_bfloat16_integers_bools_strings_and_scalars() -> None:
    a = np.array([1.0, 2.0, 3.0], ml_dtypes.bfloat16)
    b = a.copy()
    b[1] = ml_dtypes.bfloat16(2.015625)
    e = D.compare_leaves("w", a, b)
    assert e.status == "values differ" and e.max_abs == pytest.approx(0.015625)
    e = D.compare_leaves("i", np.array([1, 5], np.int64), np.array([1, 7], np.int64), atol=2)
    assert e.status == "within tolerance" and e.max_abs == 2.0
    assert D.compare_leaves("b", np.array([True]), np.array([False])).status == "values differ"
    assert D.compare_leaves("s", "adam", "adam").status == "identical"
    assert D.compare_leaves("s", "adam", "sgd").status == "values differ"
    assert D.compare_leaves("n", 3, 3).status == "identical"
    assert D.compare_leaves("n", 0.5, 0.25).max_abs == 0.25


def test_chunks_and_non_contiguous_views(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "CHUNK", 7)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((9, 11, 5)).astype(np.float32)
    b = a.copy()
    b[8, 10, 4] += 1
    b[0, 3, 1] = np.float32(-3.5) if a[0, 3, 1] != -3.5 else 0
    for x, y in ((a, b), (a.transpose(2, 0, 1), b.transpose(2, 0, 1)), (a[:, ::2], b[:, ::2])):
        e = D.compare_leaves("w", x, y)
        expect = int(np.count_nonzero(x != y))
        assert e.n_different == expect and e.size == x.size
        assert e.max_abs == pytest.approx(float(np.abs(x - y).max()))
    e = D.compare_leaves("w", a[:0], b[:0])
    assert e.status == "identical" and e.size == 0


def test_relative_difference_is_symmetric() -> None:
    a, b = np.array([1.0, 100.0]), np.array([2.0, 100.0])
    ab, ba = D.compare_leaves("w", a, b), D.compare_leaves("w", b, a)
    assert ab.max_rel == ba.max_rel == 0.5
    assert D.compare_leaves("w", a, b, rtol=0.5).status == "within tolerance"
    assert D.compare_leaves("w", a, b, rtol=0.49).status == "values differ"


# --------------------------------------------------------------------------
# whole checkpoints
# --------------------------------------------------------------------------


def test_same_format_identical_and_different(tmp_path: Path) -> None:
    tree = {"params": _params(), "step": np.int32(7)}
    ptio.save(tmp_path / "a.safetensors", tree)
    shutil.copy(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    r = D.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert (r.verdict, r.ok, r.mode) == ("identical", True, "native")
    assert r.summary() == "identical: 5 entries"
    changed = _params()
    changed["Dense_1"]["kernel"] = _flip_bit(changed["Dense_1"]["kernel"], 3)
    del changed["Dense_0"]["bias"]
    changed["Dense_1"]["extra"] = np.zeros(2, np.float32)
    ptio.save(tmp_path / "c.safetensors", {"params": changed, "step": np.int64(7)})
    r = D.diff(tmp_path / "a.safetensors", tmp_path / "c.safetensors")
    by_key = {e.key: e.status for e in r.entries}
    assert by_key == {
        "params/Dense_0/bias": "only in A",
        "params/Dense_0/kernel": "identical",
        "params/Dense_1/bias": "identical",
        "params/Dense_1/kernel": "values differ",
        "params/Dense_1/extra": "only in B",
        "step": "dtype differs",
    }
    assert r.verdict == "different" and not r.ok
    assert r.summary() == (
        "different: 4 of 6 entries (1 values differ, 1 dtype differs, 1 only in A, 1 only in B)"
    )
    assert r.counts["identical"] == 2
    assert json.loads(json.dumps(r.to_json()))["verdict"] == "different"


def test_meta_differences_are_notes(tmp_path: Path) -> None:
    ptio.save(tmp_path / "a.safetensors", _params(), meta={"run": "1"})
    ptio.save(tmp_path / "b.safetensors", _params(), meta={"run": "2"})
    r = D.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert r.verdict == "identical" and any("meta differs" in n for n in r.notes)


def test_tolerance_verdict(tmp_path: Path) -> None:
    p = _params()
    q = _params()
    q["Dense_0"]["kernel"] = p["Dense_0"]["kernel"] + np.float32(1e-3)
    ptio.save(tmp_path / "a.msgpack", p)
    ptio.save(tmp_path / "b.msgpack", q)
    assert D.diff(tmp_path / "a.msgpack", tmp_path / "b.msgpack").verdict == "different"
    r = D.diff(tmp_path / "a.msgpack", tmp_path / "b.msgpack", atol=2e-3)
    assert (r.verdict, r.ok) == ("equal within tolerance", True)
    assert r.summary().startswith("equal within tolerance (atol=0.002, rtol=0): 1 of 4")
    with pytest.raises(ValueError, match="non-negative"):
        D.diff(tmp_path / "a.msgpack", tmp_path / "b.msgpack", atol=-1)


def test_generic_formats_compare_by_key_across_list_encodings(tmp_path: Path) -> None:
    tree = {"layers": [np.ones(2, np.float32), np.zeros(3, np.float32)], "w": np.eye(2)}
    ptio.save(tmp_path / "a.msgpack", tree)  # lists become '0', '1' maps
    ptio.save(tmp_path / "a.safetensors", tree)  # lists stay lists
    r = D.diff(tmp_path / "a.msgpack", tmp_path / "a.safetensors")
    assert (r.mode, r.verdict) == ("native", "identical") and len(r.entries) == 3


def test_netcl_and_datacode_through_the_model_form(tmp_path: Path) -> None:
    import jax
    from flax import linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = nn.relu(nn.Dense(8)(x))
            return nn.Dense(3)(x)

    variables = MLP().init(jax.random.PRNGKey(0), np.ones((1, 4), np.float32))
    params = jax.tree.map(np.asarray, variables["params"])
    ptio.save(tmp_path / "m.netcl", {"params": params}, meta={"config": LAYERS})
    ptio.save(tmp_path / "m.nn", {"params": params}, format="datacode", meta={"layers": LAYERS})
    r = D.diff(tmp_path / "m.netcl", tmp_path / "m.nn")
    assert (r.mode, r.verdict, r.format_a, r.format_b) == (
        "model",
        "identical",
        "netcl",
        "datacode",
    )
    assert [e.key for e in r.entries] == [
        "layers[0].kernel",
        "layers[0].bias",
        "layers[2].kernel",
        "layers[2].bias",
    ]
    # the native trees share no key: forced native comparison finds nothing in common
    native = D.diff(tmp_path / "m.netcl", tmp_path / "m.nn", through_model=False)
    assert native.mode == "native" and native.counts["identical"] == 0
    # one weight changed in the DataCode file
    changed = jax.tree.map(np.copy, params)
    changed["Dense_1"]["kernel"][2, 1] += 0.5
    ptio.save(tmp_path / "c.nn", {"params": changed}, format="datacode", meta={"layers": LAYERS})
    r = D.diff(tmp_path / "m.netcl", tmp_path / "c.nn")
    bad = [e for e in r.entries if not e.identical]
    assert [(e.key, e.n_different) for e in bad] == [("layers[2].kernel", 1)]
    assert bad[0].max_abs == pytest.approx(0.5)
    # a Flax tree in a generic format compares with a model format too
    ptio.save(tmp_path / "m.msgpack", {"params": params})
    r = D.diff(tmp_path / "m.msgpack", tmp_path / "m.nn")
    assert (r.mode, r.verdict) == ("model", "identical")
    assert [e.key for e in r.entries][2] == "layers[2].kernel"  # read with the other's layers


def test_a_conversion_chain_is_proved_unchanged(tmp_path: Path) -> None:
    ptio.save(tmp_path / "m.netcl", {"params": _params()}, meta={"config": LAYERS})
    chain = [("m.netcl", None), ("m.nn", "datacode"), ("m.wf2model", "waffe2"), ("b", "bullet")]
    chain += [("m.safetensors", "safetensors"), ("m.msgpack", "msgpack")]
    for (src, _), (dst, fmt) in itertools.pairwise(chain):
        ptio.convert(tmp_path / src, tmp_path / dst, to=fmt)
        r = D.diff(tmp_path / src, tmp_path / dst)
        assert r.ok and r.verdict == "identical", str(r)
        assert r.counts["identical"] == 4, str(r)
        first = D.diff(tmp_path / "m.netcl", tmp_path / dst)
        assert first.verdict == "identical", str(first)


def test_a_generic_file_carrying_a_model_checkpoint(tmp_path: Path) -> None:
    ptio.save(tmp_path / "m.netcl", {"params": _params()}, meta={"config": LAYERS})
    ptio.save(tmp_path / "m.nn", {"params": _params()}, format="datacode", meta={"layers": LAYERS})
    ptio.convert(tmp_path / "m.netcl", tmp_path / "m.safetensors", to="safetensors")
    r = D.diff(tmp_path / "m.safetensors", tmp_path / "m.nn")
    assert (r.mode, r.verdict, r.format_a) == ("model", "identical", "safetensors")
    assert any("carrying a netcl checkpoint" in n for n in r.notes)
    r = D.diff(tmp_path / "m.safetensors", tmp_path / "m.netcl")
    assert (r.mode, r.verdict) == ("native", "identical")


def test_optimizer_slots_and_count_through_the_model_form(tmp_path: Path) -> None:
    import optax

    params = _params()
    state = optax.adamw(1e-3).init(params)
    grads = {k: {n: np.full_like(v, 0.1) for n, v in m.items()} for k, m in params.items()}
    _, state = optax.adamw(1e-3).update(grads, state, params)
    tree = {"params": params, "opt_state": state}
    ptio.save(tmp_path / "ck", tree, format="netcl-checkpoint", layers=LAYERS)
    ptio.save(tmp_path / "b", tree, format="bullet")
    r = D.diff(tmp_path / "ck", tmp_path / "b")
    keys = [e.key for e in r.entries]
    assert r.mode == "model" and r.verdict == "identical", str(r)
    assert "opt.count" in keys and "opt.mu[0]" in keys and "opt.nu[3]" in keys
    # a fresh optimizer state: every moment and the count differ (and the step kept beside them)
    state2 = optax.adamw(1e-3).init(params)
    ptio.save(tmp_path / "b2", {"params": params, "opt_state": state2}, format="bullet")
    r = D.diff(tmp_path / "ck", tmp_path / "b2")
    assert {e.key for e in r.entries if not e.identical} == {
        "step",
        "opt.count",
        *(f"opt.{s}[{j}]" for s in ("mu", "nu") for j in range(4)),
    }
    # only one side with an optimizer state: a note, the parameters still compared
    ptio.save(tmp_path / "m.netcl", {"params": params}, meta={"config": LAYERS})
    r = D.diff(tmp_path / "m.netcl", tmp_path / "b")
    assert r.verdict == "identical" and any("only B holds an optimizer" in n for n in r.notes)
    # bullet keeps no activation layers: arrays paired by parameter layer, keyed by A's index
    assert [e.key for e in r.entries][2] == "layers[2].kernel"
    assert any("layer lists differ" in n for n in r.notes)


def test_diff_trees_in_memory() -> None:
    a = ptio.encode(_params(), format="safetensors")
    b = ptio.encode(_params(1), format="safetensors")
    r = D.diff_trees(
        ptio.decode(a, format="safetensors"),
        ptio.decode(b, format="safetensors"),
        "safetensors",
        "safetensors",
    )
    assert r.verdict == "different" and r.counts["values differ"] == 4


# --------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------


def test_cli_exit_codes_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c = tmp_path / "a.msgpack", tmp_path / "b.msgpack", tmp_path / "c.msgpack"
    ptio.save(a, _params())
    ptio.save(b, _params())
    q = _params()
    q["Dense_0"]["bias"] = q["Dense_0"]["bias"] + np.float32(1e-4)
    ptio.save(c, q)
    code, out, err = _run(["diff", str(a), str(b)], capsys)
    assert (code, err) == (0, "") and out.splitlines()[-1] == "identical: 4 entries"
    code, out, _ = _run(["diff", str(a), str(c)], capsys)
    lines = out.splitlines()
    assert code == 1 and lines[-1] == "different: 1 of 4 entries (1 values differ)"
    assert any(line.strip().startswith("Dense_0/bias: values differ") for line in lines)
    assert not any("Dense_0/kernel" in line for line in lines)  # identical entries not listed
    code, out, _ = _run(["diff", str(a), str(c), "--all"], capsys)
    assert code == 1 and any("Dense_0/kernel: identical" in line for line in out.splitlines())
    code, out, _ = _run(["diff", str(a), str(c), "--atol", "1e-3"], capsys)
    assert code == 0 and out.splitlines()[-1].startswith("equal within tolerance")
    code, out, _ = _run(["diff", str(a), str(c), "--rtol", "1e-9"], capsys)
    assert code == 1
    code, out, err = _run(["diff", str(a), str(c), "-q"], capsys)
    assert (code, out, err) == (1, "", "")


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    ptio.save(a, {"w": np.array([1.0, np.nan], np.float32)})
    ptio.save(b, {"w": np.array([1.0, 2.0], np.float32), "v": np.zeros(1, np.int8)})
    code, out, _ = _run(["diff", str(a), str(b), "--json"], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["verdict"] == "different" and doc["ok"] is False
    assert doc["format_a"] == doc["format_b"] == "safetensors" and doc["mode"] == "native"
    entries = {e["key"]: e for e in doc["entries"]}
    assert entries["w"]["nan_mismatches"] == 1 and entries["w"]["max_abs"] == "inf"
    assert entries["v"]["status"] == "only in B" and entries["v"]["dtype_b"] == "int8"
    assert doc["counts"]["only in B"] == 1
    code, out, _ = _run(["diff", str(a), str(a), "--json"], capsys)
    assert code == 0 and json.loads(out)["verdict"] == "identical"


def test_cli_cross_format_and_formats_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params = _params()
    ptio.save(tmp_path / "m.netcl", {"params": params}, meta={"config": LAYERS})
    ptio.save(tmp_path / "w", {"params": params}, format="waffe2", layers=LAYERS)
    code, out, _ = _run(["diff", str(tmp_path / "m.netcl"), str(tmp_path / "w")], capsys)
    assert code == 0 and "(waffe2)" in out and out.splitlines()[-1] == "identical: 4 entries"
    code, out, _ = _run(
        ["diff", str(tmp_path / "m.netcl"), str(tmp_path / "w"), "--native", "--json"], capsys
    )
    assert code == 1 and json.loads(out)["mode"] == "native"
    argv = ["diff", str(tmp_path / "m.netcl"), str(tmp_path / "w"), "--format-b", "waffe2"]
    assert _run(argv, capsys)[0] == 0


@pytest.mark.parametrize(
    "extra",
    [["--atol", "-1"], ["--atol", "x"], ["--rtol", "nan"], ["--model", "--native"], ["--bogus"]],
)
def test_cli_usage_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["diff", "a", "b", *extra])
    assert e.value.code == 2 and "usage:" in capsys.readouterr().err


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ptio.save(tmp_path / "a.msgpack", _params())
    code, out, err = _run(["diff", str(tmp_path / "a.msgpack"), str(tmp_path / "nope")], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("pytreeio: error: ") and "nope" in err
    (tmp_path / "bad.msgpack").write_bytes((tmp_path / "a.msgpack").read_bytes()[:-3])
    code, _, err = _run(
        ["diff", str(tmp_path / "a.msgpack"), str(tmp_path / "bad.msgpack")], capsys
    )
    assert code == 1 and err.count("\n") == 1 and "bad.msgpack" in err
