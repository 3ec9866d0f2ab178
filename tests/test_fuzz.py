"""A bounded slice of the mutation fuzzer (tests/fuzz.py) for every format, and the fuzzer's own checks.

About 200 inputs per format; ``nox -s fuzz`` (``python tests/fuzz.py -n 20000``)
runs the long version.  The per-format counts (inputs, outcomes by stage and
exception type, worst memory ratio and time per input) are printed and
recorded as the ``fuzz`` test property.  Escapes the fuzzer found are kept
below as explicit inputs, each naming the function that raised.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fuzz import (
    Field,
    FuzzReport,
    Seed,
    default_seeds,
    find_fields,
    fuzz_format,
    mutate,
    mutate_json,
)

from pytreeio.errors import FormatError, PytreeioError
from pytreeio.registry import FILE, Decoded, Encoded, Format, Info

N = 200


def _record(report: FuzzReport, capsys: pytest.CaptureFixture[str], record_property: Any) -> None:
    record_property("fuzz", report.summary())
    with capsys.disabled():
        print("\n" + report.summary())


def _format(name: str) -> Format:
    from pytreeio.fmt import msgpack, safetensors, tinyllama

    return {
        "msgpack": msgpack.FORMAT,
        "safetensors": safetensors.FORMAT,
        "tinyllama": tinyllama.FORMAT,
    }[name]


@pytest.mark.parametrize(
    ("name", "rng_seed"), [("msgpack", 11), ("safetensors", 12), ("tinyllama", 13)]
)
def test_fuzz_single_file_formats(
    name: str, rng_seed: int, conformance: Path, capsys: Any, record_property: Any
) -> None:
    seeds = default_seeds(name, conformance=conformance)
    if name == "tinyllama":  # the real file is among the seeds
        assert (conformance / "tinyllama" / "weights.bin").read_bytes() in seeds
    report = fuzz_format(_format(name), seeds, N, rng_seed)
    _record(report, capsys, record_property)
    assert report.inputs == N
    assert not report.failures, report.summary()


@pytest.mark.parametrize(
    ("name", "rng_seed"), [("netcl", 21), ("netcl-checkpoint", 22), ("netcl-params", 23)]
)
def test_fuzz_netcl_formats(name: str, rng_seed: int, capsys: Any, record_property: Any) -> None:
    if name == "netcl":
        from pytreeio.fmt.netcl import MODEL as fmt
    else:
        from pytreeio.fmt import netcl_checkpoint as nck

        fmt = nck.CHECKPOINT if name == "netcl-checkpoint" else nck.PARAMS
    report = fuzz_format(fmt, default_seeds(name), N, rng_seed)
    _record(report, capsys, record_property)
    assert not report.failures, report.summary()


@pytest.mark.parametrize(("name", "rng_seed"), [("datacode", 31), ("waffe2", 32), ("bullet", 33)])
def test_fuzz_newer_formats(
    name: str, rng_seed: int, conformance: Path, capsys: Any, record_property: Any
) -> None:
    seeds = default_seeds(name, conformance=conformance)
    data = [s.data if isinstance(s, Seed) else s for s in seeds]
    if name == "datacode":  # both real files, and our writer's two variants
        for path in sorted((conformance / "datacode").glob("*.nn")):
            assert path.read_bytes() in data
        assert all(isinstance(d, bytes) and d[:8] == b"DATACODE" for d in data)
    elif name == "waffe2":  # the seven real directories read into mappings, and ours
        real = sorted((conformance / "waffe2").glob("*.wf2model"))
        assert len(real) == 7
        for path in real:
            assert {p.name: p.read_bytes() for p in path.iterdir()} in data
        assert sum("pytreeio-waffe2.json" in d for d in data if isinstance(d, dict)) >= 2
    else:  # with and without quantised.bin, with saved_format= where decode takes it
        assert any(isinstance(s, Seed) and "saved_format" in s.options for s in seeds)
        assert any(isinstance(d, dict) and "quantised.bin" not in d for d in data)
    report = fuzz_format(name, seeds, N, rng_seed)
    _record(report, capsys, record_property)
    assert report.inputs == N
    assert not report.failures, report.summary()
    assert 0 < report.worst_memory_ratio <= 1


# --------------------------------------------------------------------------
# escapes the fuzzer found, as explicit inputs (fixed in the format modules)
# --------------------------------------------------------------------------


def _all_stages_raise_pytreeio_errors(fmt: Format, data: Any, **options: Any) -> list[str]:
    """Run decode, inspect, restore (into a copy of the decoded tree) and to_model on
    ``data`` as the fuzzer does; every exception must be a PytreeioError.  The outcomes."""
    from fuzz import _host, _run_one

    try:
        like = _host(fmt.decode(data, **options)[0])
    except PytreeioError:
        like = None
    outcomes = []
    for stage, exc in _run_one(fmt, data, like, 10.0, options):
        assert exc is None or isinstance(exc, PytreeioError), f"{stage}: {exc!r}"
        outcomes.append(f"{stage}:{type(exc).__name__ if exc else 'ok'}")
    return outcomes


def test_bullet_old_variant_record_with_a_zero_and_a_huge_dimension() -> None:
    """rows x cols = 0 passed the size check, then numpy refused the (cols, rows) shape
    (ValueError: Maximum allowed dimension exceeded) in bullet._arrays."""
    from pytreeio.fmt import bullet

    for rows, cols in ((0, 2**64 - 1), (2**63, 0), (0, 2**63)):
        weights = b"l0w\n" + struct.pack("<QQ", rows, cols) + b"l0b\n" + struct.pack("<QQ", 0, 1)
        outcomes = _all_stages_raise_pytreeio_errors(bullet.FORMAT, {bullet.WEIGHTS: weights})
        assert outcomes[0] == "decode:FormatError", outcomes
    ok = b"l0w\n" + struct.pack("<QQ", 0, 5)  # a zero dimension numpy can hold still reads
    native, _ = bullet.decode({bullet.WEIGHTS: ok})
    assert native["weights"]["l0w"].shape == (5, 0)


def test_bullet_step_txt_of_millions_of_lines_costs_its_size_only() -> None:
    """A 24 MB step.txt of 4M lines: _parse_steps split it into a list of 4M strings first
    (275 MB peak, seconds) though the second repeated line already fails."""
    from fuzz import MEMORY_ALLOWANCE, _PeakMemory

    from pytreeio.fmt import bullet

    seed = next(s for s in default_seeds("bullet") if isinstance(s, Seed))
    assert isinstance(seed.data, dict)
    files = dict(seed.data)
    files[bullet.STEP] = files[bullet.STEP].splitlines(keepends=True)[0] * 4_000_000
    size = sum(len(v) for v in files.values())
    with _PeakMemory() as memory:
        outcomes = _all_stages_raise_pytreeio_errors(bullet.FORMAT, files, **seed.options)
    assert outcomes[0] == "decode:FormatError"
    assert memory.growth <= size + MEMORY_ALLOWANCE, memory.growth


def _wf2_dir(entries: dict[str, Any]) -> dict[str, bytes]:
    """A directory of just parameters.json, its values given as JSON text."""
    body = "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in entries.items()) + "}"
    return {"parameters.json": body.encode()}


def test_waffe2_type_specifier_with_a_bound_of_too_many_digits() -> None:
    """int() of a 5000-digit bound in '(integer 0 999...)' raised ValueError
    (waffe2_keys.parse_type_specifier, from waffe2.decode and inspect)."""
    from pytreeio.fmt import waffe2

    for bound in ("9" * 5000, "-" + "9" * 5000):
        key = f"optimizer:linearlayer.0.weights.adam.(integer 0 {bound}).n"
        outcomes = _all_stages_raise_pytreeio_errors(waffe2.FORMAT, _wf2_dir({key: "3"}))
        assert outcomes == ["decode:FormatError", "inspect:FormatError"]


def test_waffe2_float_entry_holding_an_integer_beyond_any_float() -> None:
    """float(10**400) raised OverflowError in waffe2._check_number (decode and inspect)."""
    from pytreeio.fmt import waffe2

    key = "optimizer:linearlayer.0.weights.adam.single-float.lr"
    for value in ("1" + "0" * 400, "-" + "1" * 320):
        outcomes = _all_stages_raise_pytreeio_errors(waffe2.FORMAT, _wf2_dir({key: value}))
        assert outcomes == ["decode:FormatError", "inspect:FormatError"]
    native, _ = waffe2.decode(_wf2_dir({key: "1" + "0" * 300}))  # a big float is still a float
    assert native["optimizer"]["linearlayer"]["0"]["weights"]["adam"]["lr"] == 1e300


def test_waffe2_sidecar_convolution_with_zero_groups() -> None:
    """groups=0 in the sidecar's layer list: ZeroDivisionError in waffe2._flax_shapes (to_model)."""
    import hashlib

    from pytreeio import npy
    from pytreeio.fmt import waffe2

    params = _wf2_dir({"param:conv2d.0.weight": '"x/param:conv2d.0.weight.npy"'})["parameters.json"]
    for groups in (0, -1):
        args = {"in_channels": 2, "out_channels": 2, "kernel_size": 1, "groups": groups}
        sidecar = {
            "format": "pytreeio/waffe2",
            "version": 1,
            "parameters_sha256": hashlib.sha256(params).hexdigest(),
            "shapes": {},
            "layers": [{"type": "Conv2d", "args": {**args, "bias": False}}],
        }
        files = {
            "parameters.json": params,
            "param:conv2d.0.weight.npy": b"".join(npy.encode_npy(np.ones(4, np.float32))),
            "pytreeio-waffe2.json": json.dumps(sidecar).encode(),
        }
        outcomes = _all_stages_raise_pytreeio_errors(waffe2.FORMAT, files)
        assert outcomes[:2] == ["decode:ok", "inspect:ok"]
        assert outcomes[-1] == "to_model:MismatchError", outcomes


# --------------------------------------------------------------------------
# the fuzzer itself
# --------------------------------------------------------------------------


def _toy(decode: Any) -> Format:
    return Format(
        name="toy",
        description="test format",
        suffixes=(),
        layout=FILE,
        encode=lambda tree, *, meta=None: Encoded(chunks=(bytes(tree),)),
        decode=decode,
        inspect=lambda source: Info("toy", ()),
        sniff=lambda probe: 0.0,
    )


def test_fuzzer_reports_foreign_exceptions_with_the_saved_input(tmp_path: Path) -> None:
    def decode(buffer: Any) -> Decoded:
        data = bytes(buffer)
        if len(data) != 8:
            return Decoded({"n": np.frombuffer(data[:8].ljust(8, b"\0"), np.uint8)}, {})
        return Decoded({"n": np.zeros(8, np.uint8)}, {}) if data[0] == 0 else [][1]

    report = fuzz_format(_toy(decode), [bytes(8)], 100, 0, save_dir=tmp_path)
    assert report.failures and report.outcomes["decode:IndexError"] == len(report.failures)
    failure = report.failures[0]
    assert failure.stage == "decode" and "IndexError" in failure.error
    assert failure.saved is not None and failure.saved.read_bytes()[0] != 0
    assert "mutations" in str(failure) and "IndexError" in report.summary()


def test_fuzzer_times_out_hanging_decoders(tmp_path: Path) -> None:
    def decode(buffer: Any) -> Decoded:
        if bytes(buffer) != bytes(8):
            while True:
                pass
        return Decoded({}, {})

    report = fuzz_format(_toy(decode), [bytes(8)], 3, 0, timeout=0.05, save_dir=tmp_path)
    assert report.outcomes["decode:_Timeout"] >= 1 and report.failures


def test_fuzzer_accepts_only_pytreeio_errors() -> None:
    def decode(buffer: Any) -> Decoded:
        if bytes(buffer) != bytes(8):
            raise FormatError("bad", field="x", offset=0)
        return Decoded({}, {})

    report = fuzz_format(_toy(decode), [bytes(8)], 50, 0)
    assert not report.failures and report.outcomes["decode:FormatError"] >= 40


def test_fields_found_in_each_container() -> None:
    from fuzz import _msgpack_fields

    from pytreeio import npy
    from pytreeio.fmt import msgpack, safetensors

    tl_seed = default_seeds("tinyllama")[0]
    assert isinstance(tl_seed, bytes)
    fields, _ = find_fields(tl_seed)
    assert Field(12, 4, label="header@12") in fields  # n_layers
    assert any("dim" in f.label for f in fields)
    st = safetensors.encode({"a": np.ones(2)}, meta={"k": 1}).tobytes()
    fields, docs = find_fields(st)
    assert fields[0].offset == 0 and docs and docs[0].start == 8
    z = b"".join(bytes(c) for c in npy.encode_npz([("a", np.ones(2))]))
    labels = {f.label for f in find_fields(z)[0]}
    assert "npy header length" in labels and any("end@" in x for x in labels)
    mp = msgpack.encode({"a": np.ones(300), "b": "x" * 40}).tobytes()
    assert len(_msgpack_fields(mp)) >= 4
    framed = b"DATACODE" + struct.pack("<II", 1, 7) + b'{"a":1}' + b"\0" * 4
    fields, docs = find_fields(framed)
    assert docs and docs[0].start == 16 and docs[0].length == Field(12, 4, label="json length")


def test_json_mutations_cover_each_class() -> None:
    import random

    doc = json.dumps({"a": [1, 2, {"b": "c"}], "t": json.dumps({"leaf": "x"})}).encode()
    rng = random.Random(5)
    kinds = set()
    for _ in range(400):
        _out, how = mutate_json(doc, rng)
        kinds.add(how.split(" at ")[0].split(" ")[0])
    assert {"wrong", "odd", "nested", "bad", "duplicate", "drop", "huge", "inner"} <= kinds


def test_multi_file_mutations_keep_the_mapping_shape() -> None:
    import random

    rng = random.Random(3)
    seen = set()
    for _ in range(300):
        out, how = mutate({"npz": b"PK\x03\x04" + bytes(40), "json": b'{"a": 1}'}, rng)
        assert isinstance(out, dict)
        seen.add(how[0].split(" ")[0])
    assert {"drop", "empty", "swap", "add", "npz:", "json:"} <= seen


def test_fuzzer_fails_inputs_that_use_too_much_memory(tmp_path: Path) -> None:
    def decode(buffer: Any) -> Decoded:
        if bytes(buffer) != bytes(8):
            np.ones(80 * 2**20, np.uint8)  # 80 MiB for an 8-byte input: over input + 64 MiB
        return Decoded({}, {})

    report = fuzz_format(_toy(decode), [bytes(8)], 5, 0, save_dir=tmp_path)
    assert report.outcomes["memory:over"] >= 1 and report.worst_memory_ratio > 1
    failure = next(f for f in report.failures if f.stage == "memory")
    assert "peak growth" in failure.error and failure.saved is not None
    assert "worst memory" in report.summary()


def test_fuzzer_passes_seed_options_to_decode() -> None:
    seen = []

    def decode(buffer: Any, *, flag: bool = False) -> Decoded:
        seen.append(flag)
        return Decoded({"n": np.zeros(1, np.uint8)}, {})

    report = fuzz_format(_toy(decode), [Seed(bytes(8), {"flag": True})], 20, 0)
    assert not report.failures and all(seen) and len(seen) >= 20
    assert 0 <= report.worst_memory_ratio < 1 and report.worst_seconds < 2


def test_fields_found_in_the_newer_containers() -> None:
    from fuzz import find_records

    from pytreeio import npy

    datacode = default_seeds("datacode")[0]
    assert isinstance(datacode, bytes)
    fields, docs = find_fields(datacode)
    labels = {f.label for f in fields}
    assert {"version", "json length", "tensor count", "tensor 3 name length"} <= labels
    assert {"tensor 0 ndim", "tensor 0 dim 1", "tensor 3 dim 0"} <= labels
    assert docs and docs[0].start == 16 and docs[0].length == Field(12, 4, label="json length")
    one = b"".join(npy.encode_npy(np.ones(3, np.float32)))
    assert find_fields(one)[0] == [Field(8, 2, label="npy header length")]
    bullet = [s for s in default_seeds("bullet") if not isinstance(s, Seed)]
    plain, old = bullet[0], bullet[1]
    assert isinstance(plain, dict) and isinstance(old, dict)
    weights = plain["optimiser_state/weights.bin"]
    records = find_records(weights)
    assert len(records) == 4 and records[-1].end == len(weights) and not records[0].old
    assert [f.label.split()[-1] for f in find_fields(weights)[0]] == ["count"] * 4
    old_records = find_records(old["optimiser_state/weights.bin"])
    assert len(old_records) == 4 and all(r.old for r in old_records)
    assert find_records(b"l0w,3\n") == [] and find_records(datacode) == []


def test_shaped_mutations_cover_each_class() -> None:
    import random

    from fuzz import (
        _mutate_datacode,
        _mutate_layer_list,
        _mutate_npy,
        _mutate_records,
        _mutate_steps,
        _mutate_wf2,
        _shaped,
    )

    from pytreeio import npy

    rng = random.Random(7)
    datacode = default_seeds("datacode")[0]
    waffe2 = default_seeds("waffe2")
    bullet = default_seeds("bullet")[0]
    assert isinstance(datacode, bytes) and isinstance(bullet, Seed)
    tensor = b"".join(npy.encode_npy(np.ones(6, np.float32)))
    params = next(d for d in waffe2 if isinstance(d, dict) and "optimizer" in str(d))
    sidecar = next(
        d
        for d in waffe2
        if isinstance(d, dict) and b'"layers"' in d.get("pytreeio-waffe2.json", b"")
    )
    files = bullet.data
    assert isinstance(files, dict) and isinstance(params, dict) and isinstance(sidecar, dict)
    cases = [
        (_mutate_datacode, datacode, {"rename", "swap", "duplicate", "drop", "tensor", "truncate",
                                      "architecture"}),
        (_mutate_npy, tensor, {"npy"}),
        (_mutate_records, files["optimiser_state/weights.bin"],
         {"record", "truncate", "records", "rows/cols"}),
        (_mutate_steps, files["optimiser_state/step.txt"], {"line", "CRLF"}),
        (_mutate_wf2, params["parameters.json"], {"path", "key", "value", "entry", "entries"}),
        (_mutate_layer_list, sidecar["pytreeio-waffe2.json"], {"layers", "layers:", "shapes", "step", "count"}),
    ]  # fmt: skip
    for mutator, buf, want in cases:
        assert _shaped(buf) == [mutator]
        seen: set[str] = set()
        for _ in range(300):
            out, how = mutator(buf, rng)
            assert isinstance(out, bytes) and how
            seen.add(how.split(" ")[0].split("[")[0].split(".")[0])
        assert want <= seen, (mutator.__name__, seen)
    # the escapes' input classes are among what the mutators write
    texts = [_mutate_wf2(params["parameters.json"], rng)[1] for _ in range(3000)]
    assert any("(integer -999" in t or "(integer 0 999" in t for t in texts)
    texts = [_mutate_records(files["optimiser_state/weights.bin"], rng)[1] for _ in range(2000)]
    assert any("rows/cols" in t and "18446744073709551615" in t for t in texts)


def test_mapping_mutations_change_one_member_per_input() -> None:
    import random

    rng = random.Random(4)
    seed = {"a.npy": b"\x93NUMPY" + bytes(60), "b.json": b'{"a": 1}', "c.bin": bytes(16)}
    for _ in range(300):
        out, how = mutate(seed, rng)
        assert isinstance(out, dict)
        changed = {k for k in seed.keys() | out.keys() if seed.get(k) != out.get(k)}
        if how[0].split(" ")[0] in ("swap", "rename"):
            continue
        assert len(changed) <= 1, how
        assert len({h.split(":")[0] for h in how}) == 1


def test_command_line_fuzzes_every_registered_format(capsys: Any) -> None:
    from fuzz import main

    from pytreeio import registry

    assert main(["-n", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    for name in registry.formats():
        assert f"\n{name}: 2 inputs, 0 failures" in "\n" + out
    assert len(list(registry.formats())) >= 9
