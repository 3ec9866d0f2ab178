"""``jsonsafe.loads_rows``: long number lists parsed into arrays, the rest as ``jsonsafe.loads``.

Checked against Python's own :mod:`json` (values, bits, errors) and through
netcl-checkpoint sidecars, whose moments it reads.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.core import jsonsafe
from pytreeio.core.errors import FormatError


def both(raw: bytes, arrays: bool) -> Any:
    doc, rows = jsonsafe.loads_rows(raw, path="doc.json", field="json")
    return rows.resolve(doc, arrays=arrays)


DOCS = [
    {"a": [1, 2, 3], "b": [[0.5, -1e-05], [1e300, 5e-324]], "c": "x[1, 2]y", "d": []},
    {"s": 'he said "[1, 2]" \\ [', "n": [[[], [1]], [[2.5], [3, 4, 5]]], "e": [1.5e3, 2e-3, 0]},
    [[1, 2], {"k": [3]}, "[4]", [[[[-0.0]]]]],
    {"deep": [[[[[1]]]]], "t": 7, "x": None, "y": True, "z": [True, 1], "u": "\u00e9[1]"},
]


@pytest.mark.parametrize("doc", DOCS)
def test_lists_resolved_as_json_makes_them(doc: Any) -> None:
    raw = json.dumps(doc).encode()
    assert both(raw, arrays=False) == json.loads(raw)
    compact = json.dumps(doc, separators=(",", ":"), indent=None).encode()
    assert both(compact, arrays=False) == json.loads(compact)
    pretty = json.dumps(doc, indent=2).encode()
    assert both(pretty, arrays=False) == json.loads(pretty)


def test_rows_as_arrays_have_the_bits_json_gives() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32).astype(np.float64),
            rng.standard_normal(5000) * 10.0 ** rng.integers(-300, 300, 5000),
            [5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, -0.0, 0.1, 3.0],
        ]
    )
    matrix = values[:10000].reshape(100, 100)
    doc = {"m": matrix.tolist(), "v": values.tolist(), "ints": [1, 2, 9007199254740993]}
    got = both(json.dumps(doc).encode(), arrays=True)
    assert np.array_equal(np.array(got["m"]).view(np.uint64), matrix.view(np.uint64))
    assert np.array_equal(got["v"].view(np.uint64), values.view(np.uint64))
    assert got["ints"].dtype == np.float64
    assert got["ints"].tolist() == [float(x) for x in doc["ints"]]


def test_many_rows_across_parse_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonsafe, "_PARSE_BATCH", 7)
    rows = [[float(i) + j / 8 for j in range(i % 5)] for i in range(50)]
    got = both(json.dumps({"r": rows}).encode(), arrays=True)["r"]
    assert [r.tolist() for r in got] == rows


BAD = [
    (b'{"a": [1, 01]}', 11),
    (b'{"a": [1, 2, +3]}', 13),
    (b'{"a": [1,,2]}', 9),
    (b'{"a": [1 2]}', 9),
    (b'{"a": [.5]}', 7),
    (b'{"a": [1.]}', 8),
    (b'{"a": [-]}', 7),
    (b'{"a": [1e999]}', 6),
    (b'{"x": 1, "a": [2, 1e400000000]}', 14),
]


@pytest.mark.parametrize(("raw", "offset"), BAD)
def test_bad_numbers_in_rows(raw: bytes, offset: int) -> None:
    with pytest.raises(ValueError):
        json.loads(raw, parse_constant=lambda c: float("nan"), parse_float=_finite)
    with pytest.raises(FormatError) as whole:
        jsonsafe.loads(raw, path="doc.json", field="json")
    for arrays in (True, False):
        with pytest.raises(FormatError) as err:
            both(raw, arrays)
        assert err.value.offset == offset, (raw, err.value)
        if "overflows" not in str(err.value):  # loads names the token, rows their start
            assert err.value.offset == whole.value.offset
        assert err.value.path == "doc.json" and err.value.field == "json"


def _finite(text: str) -> float:
    v = float(text)
    if not np.isfinite(v):
        raise ValueError(text)
    return v


@pytest.mark.parametrize(
    ("raw", "offset"),
    [
        (b'{"a": [1, 2', 11),
        (b'{"b": 1, "a": [1,2] x}', 20),
        (b'{"a": [1, 2], "a": [3]}', 0),
        (b'{"a": [1, 2], "b": NaN}', None),
        (b'{"a": "[1, 2]', None),
        (b"[" * 200 + b"[1]" + b"]" * 200, None),
        (b'{"a": [1, 2], "b": "\xff"}', 20),
    ],
)
def test_the_rest_is_checked_as_loads_checks_it(raw: bytes, offset: int | None) -> None:
    with pytest.raises(FormatError) as want:
        jsonsafe.loads(raw, path="doc.json", field="json")
    with pytest.raises(FormatError) as got:
        both(raw, True)
    if offset is not None:
        assert got.value.offset == want.value.offset == offset


def test_value_limit_counts_the_numbers_of_rows() -> None:
    raw = json.dumps({"a": list(range(1000))}).encode()
    with pytest.raises(FormatError, match="values"):
        jsonsafe.loads_rows(raw, max_values=500)
    doc, rows = jsonsafe.loads_rows(raw, max_values=2000)
    assert rows.resolve(doc, arrays=False) == {"a": list(range(1000))}


def test_a_string_like_a_marker_stays_a_string() -> None:
    doc, rows = jsonsafe.loads_rows(b'{"a": [1], "b": "\\u0000deadbeefdeadbeef:0"}')
    out = rows.resolve(doc, arrays=False)
    assert out == {"a": [1], "b": "\x00deadbeefdeadbeef:0"}


# --------------------------------------------------------------------------
# netcl-checkpoint sidecars
# --------------------------------------------------------------------------


def adam_checkpoint(path: Path, n: int, layers: int) -> dict[str, Any]:
    import jax
    import optax

    rng = np.random.default_rng(5)
    params = {
        f"Dense_{i}": {
            "kernel": rng.standard_normal((n, n)).astype(np.float32),
            "bias": rng.standard_normal(n).astype(np.float32),
        }
        for i in range(layers)
    }
    opt = optax.adam(1e-3)
    state = opt.init(params)
    grads = jax.tree_util.tree_map(
        lambda a: rng.standard_normal(a.shape).astype(np.float32), params
    )
    _, state = opt.update(grads, state, params)
    tree = {"params": params, "opt_state": jax.tree_util.tree_map(np.asarray, state)}
    ptio.save(path, tree, format="netcl-checkpoint", meta={"config": {"lr": [0.001], "n": n}})
    return tree


def test_netcl_checkpoint_moments_as_the_stdlib_reads_them(tmp_path: Path) -> None:
    adam_checkpoint(tmp_path / "ckpt", 64, 3)
    doc = json.loads((tmp_path / "ckpt.json").read_bytes())
    native = ptio.load(tmp_path / "ckpt", format="netcl-checkpoint")
    for (m, v), (want_m, want_v) in zip(
        native["optim_state"]["moments"], doc["optim_state"]["moments"]
    ):
        assert m.dtype == np.float32 and m.tobytes() == np.array(want_m, np.float32).tobytes()
        assert v.dtype == np.float32 and v.tobytes() == np.array(want_v, np.float32).tobytes()
    assert native["config"] == {"lr": [0.001], "n": 64}  # JSON's lists, not arrays
    assert ptio.inspect(tmp_path / "ckpt").meta["config"] == {"lr": [0.001], "n": 64}
    # saved again: the same bytes
    ptio.save(tmp_path / "again", native, format="netcl-checkpoint")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "ckpt.json").read_bytes()


def test_netcl_checkpoint_moments_cost_no_python_float_each(tmp_path: Path) -> None:
    adam_checkpoint(tmp_path / "ckpt", 512, 4)  # 2.1M numbers of moments, 46 MB of JSON
    text = (tmp_path / "ckpt.json").stat().st_size
    ptio.load(tmp_path / "ckpt")
    tracemalloc.start()
    try:
        ptio.load(tmp_path / "ckpt")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # measured 2.96x the text (the text, float64 rows, their stacked copies, the arrays);
    # parsed into Python floats (~40 bytes a number) it was 4.5x
    assert peak < 3.5 * text, (peak, text)


def test_netcl_checkpoint_bad_moment_is_named(tmp_path: Path) -> None:
    adam_checkpoint(tmp_path / "ckpt", 8, 1)
    raw = (tmp_path / "ckpt.json").read_bytes()
    at = raw.index(b"]", raw.index(b"moments")) - 1
    (tmp_path / "ckpt.json").write_bytes(raw[:at] + b"x" + raw[at + 1 :])
    with pytest.raises(ptio.FormatError) as err:
        ptio.load(tmp_path / "ckpt")
    assert err.value.field == "json" and err.value.offset == at
