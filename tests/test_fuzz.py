"""A bounded slice of the mutation fuzzer (tests/fuzz.py) for every format, and the fuzzer's own checks.

About 200 inputs per format through every stage (sniff, decode, inspect,
verify, restore, to_model); ``nox -s fuzz`` (``python tests/fuzz.py -n 100000``)
runs the long version.  The per-format counts (inputs, outcomes by stage and
exception type, worst memory and time ratios) are printed and
recorded as the ``fuzz`` test property.  Escapes the fuzzer found are kept
below as explicit inputs, each naming the function that raised.
"""

from __future__ import annotations

import json
import struct
import time
from collections import Counter
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

from pytreeio.core import records
from pytreeio.core.errors import FormatError, MismatchError, PytreeioError
from pytreeio.core.records import FILE, Decoded, Encoded, Format, Info

N = 200


def _record(report: FuzzReport, capsys: pytest.CaptureFixture[str], record_property: Any) -> None:
    record_property("fuzz", report.summary())
    with capsys.disabled():
        print("\n" + report.summary())


def _format(name: str) -> Format:
    from pytreeio.formats import msgpack, safetensors, tinyllama

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
    assert report.outcomes["sniff:ok"] == N and 0 < report.worst_time_ratio <= 1


@pytest.mark.parametrize(
    ("name", "rng_seed"), [("netcl", 21), ("netcl-checkpoint", 22), ("netcl-params", 23)]
)
def test_fuzz_netcl_formats(name: str, rng_seed: int, capsys: Any, record_property: Any) -> None:
    if name == "netcl":
        from pytreeio.formats.netcl.model_file import MODEL as fmt
    else:
        from pytreeio.formats.netcl import checkpoint as nck

        fmt = nck.CHECKPOINT if name == "netcl-checkpoint" else nck.PARAMS
    report = fuzz_format(fmt, default_seeds(name), N, rng_seed)
    _record(report, capsys, record_property)
    assert not report.failures, report.summary()
    assert report.outcomes["sniff:ok"] == N and report.outcomes["to_model:ok"] > 0


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
    assert report.outcomes["sniff:ok"] == N and 0 < report.worst_time_ratio <= 1


# --------------------------------------------------------------------------
# escapes the fuzzer found, as explicit inputs (fixed in the format modules)
# --------------------------------------------------------------------------


def _all_stages_raise_pytreeio_errors(fmt: Format, data: Any, **options: Any) -> list[str]:
    """Run every stage on ``data`` as the fuzzer does (restore into a copy of the decoded
    tree); every exception must be a PytreeioError and sniffing must answer.  The
    outcomes after sniffing."""
    from fuzz import _host, _run_one

    try:
        like = _host(fmt.decode(data, **options)[0])
    except PytreeioError:
        like = None
    outcomes = []
    for stage, exc in _run_one(fmt, data, like, 10.0, options):
        assert exc is None or isinstance(exc, PytreeioError), f"{stage}: {exc!r}"
        outcomes.append(f"{stage}:{type(exc).__name__ if exc else 'ok'}")
    assert outcomes[0] == "sniff:ok", outcomes
    return outcomes[1:]


def test_bullet_old_variant_record_with_a_zero_and_a_huge_dimension() -> None:
    """rows x cols = 0 passed the size check, then numpy refused the (cols, rows) shape
    (ValueError: Maximum allowed dimension exceeded) in bullet._arrays."""
    from pytreeio.formats.bullet import checkpoint as bullet

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

    from pytreeio.formats.bullet import checkpoint as bullet

    seed = next(s for s in default_seeds("bullet") if isinstance(s, Seed))
    assert isinstance(seed.data, dict)
    files = dict(seed.data)
    files[bullet.STEP] = files[bullet.STEP].splitlines(keepends=True)[0] * 4_000_000
    size = sum(len(v) for v in files.values())
    with _PeakMemory() as memory:
        outcomes = _all_stages_raise_pytreeio_errors(bullet.FORMAT, files, **seed.options)
    assert outcomes[0] == "decode:FormatError"
    assert memory.growth <= size + MEMORY_ALLOWANCE, memory.growth


def test_verify_of_a_msgpack_map_with_keys_that_form_no_key_path(tmp_path: Path) -> None:
    """A map key None or 1.5 (flax's reader keeps such keys): ptio.verify's NaN/inf count
    raised TypeError from tree.flatten (integrity.nonfinite_counts); now such keys are
    named by str()."""
    import msgpack as msgpack_lib
    from fuzz import _run_one

    import pytreeio as ptio
    from pytreeio.formats import msgpack

    blob = msgpack_lib.packb({None: float("nan"), "None": float("inf"), 1.5: 2.0, "a": 1.0})
    like = {"None": 0.0, "a": 0.0}  # the fuzzer's like: a seed's tree
    outcomes = dict(_run_one(msgpack.FORMAT, blob, like, 10.0))
    assert outcomes["verify"] is None and outcomes["decode"] is None, outcomes
    assert isinstance(outcomes["restore"], MismatchError), outcomes
    path = tmp_path / "odd.msgpack"
    path.write_bytes(blob)
    info = ptio.verify(path)
    assert info.meta["nonfinite"] == {"None": {"nan": 0, "inf": 1}, "None#0": {"nan": 1, "inf": 0}}


def _wf2_dir(entries: dict[str, Any]) -> dict[str, bytes]:
    """A directory of just parameters.json, its values given as JSON text."""
    body = "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in entries.items()) + "}"
    return {"parameters.json": body.encode()}


def test_waffe2_type_specifier_with_a_bound_of_too_many_digits() -> None:
    """int() of a 5000-digit bound in '(integer 0 999...)' raised ValueError
    (waffe2_keys.parse_type_specifier, from waffe2.decode and inspect)."""
    from pytreeio.formats.waffe2 import state_dict as waffe2

    for bound in ("9" * 5000, "-" + "9" * 5000):
        key = f"optimizer:linearlayer.0.weights.adam.(integer 0 {bound}).n"
        outcomes = _all_stages_raise_pytreeio_errors(waffe2.FORMAT, _wf2_dir({key: "3"}))
        assert outcomes == ["decode:FormatError", "inspect:FormatError", "slots:FormatError"]


def test_waffe2_float_entry_holding_an_integer_beyond_any_float() -> None:
    """float(10**400) raised OverflowError in waffe2._check_number (decode and inspect)."""
    from pytreeio.formats.waffe2 import state_dict as waffe2

    key = "optimizer:linearlayer.0.weights.adam.single-float.lr"
    for value in ("1" + "0" * 400, "-" + "1" * 320):
        outcomes = _all_stages_raise_pytreeio_errors(waffe2.FORMAT, _wf2_dir({key: value}))
        assert outcomes == ["decode:FormatError", "inspect:FormatError", "slots:FormatError"]
    native, _ = waffe2.decode(_wf2_dir({key: "1" + "0" * 300}))  # a big float is still a float
    assert native["optimizer"]["linearlayer"]["0"]["weights"]["adam"]["lr"] == 1e300


def test_waffe2_sidecar_convolution_with_zero_groups() -> None:
    """groups=0 in the sidecar's layer list: ZeroDivisionError in waffe2._flax_shapes (to_model)."""
    import hashlib

    from pytreeio.containers import npy
    from pytreeio.formats.waffe2 import state_dict as waffe2

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


def test_fuzzer_checks_slots_against_decode(tmp_path: Path) -> None:
    """A slots function that reads other bytes than decode returns fails the ``slots`` stage."""
    from pytreeio.core.binary import Slot, Slots

    def decode(buffer: Any) -> Decoded:
        return Decoded({"n": np.frombuffer(bytes(buffer), np.uint8).copy()}, {})

    def slots(source: Any, *, off_by_one: bool) -> Slots:
        n = source.size
        if off_by_one and n > 1 and source.read(0, 1, "first")[0] == 0xFF:
            n -= 1  # the bug: a lying slot on inputs that start with 0xFF
        return Slots({"n": Slot("n", 0, n, (n,), np.uint8)}, {})

    good = _toy(decode)._replace(slots=lambda source: slots(source, off_by_one=False))
    report = fuzz_format(good, [bytes(8)], 60, 0, save_dir=tmp_path)
    assert not report.failures, report.summary()
    assert report.outcomes["slots:ok"] == 60
    bad = _toy(decode)._replace(slots=lambda source: slots(source, off_by_one=True))
    report = fuzz_format(bad, [bytes(8)], 300, 0, save_dir=tmp_path)
    failures = [f for f in report.failures if f.stage == "slots"]
    assert failures and all("AssertionError" in f.error for f in failures)
    assert all(f.saved is not None and f.saved.read_bytes()[0] == 0xFF for f in failures)


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


def test_fuzzer_fails_sniffers_that_raise(tmp_path: Path) -> None:
    """best_match would swallow the error; the sniff stage calls each sniffer itself."""

    def sniff(probe: Any) -> float:
        if probe.head != bytes(8):
            raise ValueError("sniffer choked")
        return 0.0

    toy = _toy(lambda buffer: Decoded({}, {}))._replace(sniff=sniff)
    report = fuzz_format(toy, [bytes(8)], 20, 0, save_dir=tmp_path)
    assert report.outcomes["sniff:ValueError"] >= 1 and report.outcomes["sniff:ok"] >= 1
    failure = next(f for f in report.failures if f.stage == "sniff")
    assert "sniffer choked" in failure.error and failure.saved is not None


def test_fuzzer_verify_stage_decodes_with_verify(tmp_path: Path) -> None:
    calls = []

    def decode(buffer: Any, *, verify: bool = False) -> Decoded:
        calls.append(verify)
        if verify and bytes(buffer) != bytes(8):
            raise KeyError("checksum table")
        return Decoded({"x": np.array([np.nan], np.float32)}, {})

    report = fuzz_format(_toy(decode), [bytes(8)], 20, 0, save_dir=tmp_path)
    assert {f.stage for f in report.failures} == {"verify"}
    assert report.outcomes["decode:ok"] == 20 and calls.count(True) >= 20


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_fuzzer_fails_inputs_over_the_time_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU time above TIME_BASE + size x TIME_PER_BYTE in every one of three runs fails."""
    import fuzz

    monkeypatch.setattr(fuzz, "TIME_BASE", 0.002)
    monkeypatch.setattr(fuzz, "TIME_PER_BYTE", 0.0)
    runs = Counter[bytes]()

    def decode(buffer: Any) -> Decoded:
        data = bytes(buffer)
        runs[data] += 1
        if data != bytes(8):
            _spin(0.02)
        return Decoded({}, {})

    report = fuzz_format(_toy(decode), [bytes(8)], 10, 0, save_dir=tmp_path)
    over = [f for f in report.failures if f.stage == "time"]
    assert over and report.outcomes["time:over"] == len(over)
    assert "in each of 3 runs" in over[0].error and report.worst_time_ratio > 5
    slow = [d for d in runs if d != bytes(8)]
    assert slow and all(runs[d] >= 3 for d in slow)  # the traced run and two more
    assert "of the bound" in report.summary()


def test_time_bound_is_linear_in_the_size() -> None:
    from fuzz import TIME_BASE, TIME_PER_BYTE, time_bound

    assert time_bound(0) == TIME_BASE
    assert time_bound(10**6) == pytest.approx(TIME_BASE + 10**6 * TIME_PER_BYTE)
    assert time_bound(2 * 10**6) - time_bound(10**6) == pytest.approx(10**6 * TIME_PER_BYTE)


def _disk_files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_probe_buffer_gives_the_probe_io_reads_from_disk(tmp_path: Path) -> None:
    """The sniff stage's probes (io.probe_buffer over the bytes) equal io.probe of the
    same files on disk, for every layout and every registered format's sibling roles."""
    import pytreeio as ptio
    from pytreeio import io
    from pytreeio.formats import registry

    (tmp_path / "st").mkdir()
    ptio.save(tmp_path / "st" / "a.safetensors", {"w": np.ones((2, 3), np.float32)})
    (tmp_path / "pair").mkdir()
    params = {"p0": np.ones((4, 8), np.float32), "p1": np.ones(8, np.float32)}
    state = {"t": 3, "moments": [[np.zeros((4, 8), np.float32)] * 2, [np.zeros(8, np.float32)] * 2]}
    ckpt = {"params": params, "optim_state": state, "config": {"step": 3}}
    ptio.save(tmp_path / "pair" / "ckpt", ckpt, format="netcl-checkpoint")
    seed = next(s for s in default_seeds("waffe2") if isinstance(s, dict))
    for rel, blob in seed.items():
        (tmp_path / "dir.wf2model" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dir.wf2model" / rel).write_bytes(blob)
    files = _disk_files(tmp_path)
    layouts = {f.layout for f in registry.iter_formats()}
    paths = [
        tmp_path / "st" / "a.safetensors",
        tmp_path / "pair" / "ckpt",
        tmp_path / "pair" / "ckpt.npz",
        tmp_path / "pair" / "ckpt.json",
        tmp_path / "dir.wf2model",
        tmp_path / "missing",
        tmp_path,
    ]
    checked = 0
    for path in paths:
        for layout in layouts:
            assert io.probe_buffer(path, files, layout) == io.probe(path, layout), (path, layout)
            checked += 1
    on_disk = io.probe(tmp_path / "pair" / "ckpt.npz", records.FILE)
    assert on_disk.members and on_disk.size > 0  # the comparison saw a real ZIP
    assert io.probe(tmp_path / "dir.wf2model", records.DIRECTORY).heads
    assert checked >= 7 * 4


def test_verify_stage_checks_a_directory_manifest_like_verify_on_disk(tmp_path: Path) -> None:
    """The seeds' manifest is the one ``pytreeio checksum`` writes, and the buffer check
    raises where ``ptio.verify`` of the same files on disk raises."""
    from fuzz import _run_one, _with_manifest

    import pytreeio as ptio
    from pytreeio import integrity
    from pytreeio.formats import registry

    fmt = registry.get("waffe2")
    seed = next(s for s in default_seeds("waffe2") if isinstance(s, dict))
    dest = tmp_path / "m.wf2model"
    for rel, blob in seed.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(blob)
    integrity.write_manifest(dest, "waffe2")
    on_disk = json.loads((dest / integrity.MANIFEST_NAME).read_bytes())
    ours = json.loads(_with_manifest("waffe2", seed)[integrity.MANIFEST_NAME])
    assert on_disk["files"] == ours["files"] and len(ours["files"]) == len(seed)

    with_manifest = _with_manifest("waffe2", seed)
    like = fmt.decode(seed)[0]
    assert dict(_run_one(fmt, with_manifest, like, 10.0))["verify"] is None
    name = "parameters.json"
    changed = {**with_manifest, name: with_manifest[name].replace(b"{", b"{ ", 1)}
    outcome = dict(_run_one(fmt, changed, like, 10.0))
    assert outcome["decode"] is None  # the decoder reads it fine: only the manifest knows
    assert isinstance(outcome["verify"], FormatError) and outcome["verify"].field == name
    (dest / name).write_bytes(changed[name])
    with pytest.raises(FormatError) as on_disk_error:
        ptio.verify(dest, format="waffe2")
    assert on_disk_error.value.field == name
    with pytest.raises(FormatError, match="malformed manifest"):
        integrity.check_manifest_buffers(b'{"pytreeio-sum": 1, "files": []}', {})


@pytest.mark.parametrize("name", ["safetensors", "netcl-checkpoint", "waffe2", "bullet"])
def test_sniff_stage_recognises_every_seed_as_its_format(name: str, conformance: Path) -> None:
    """Unmutated, every seed laid out as on disk is sniffed as its own format, as
    ``ptio.load(path)`` without format= would."""
    from fuzz import _sniff_all

    from pytreeio.formats import registry

    fmt = registry.get(name)
    for seed in default_seeds(name, conformance=conformance):
        data = seed.data if isinstance(seed, Seed) else seed
        found = _sniff_all(fmt, data)
        assert found is not None and found.name == name


def test_model_formats_restore_into_the_seed_model_as_flax_variables() -> None:
    """The to_model stage of a model format is load(like=flax variables): to_model,
    then restore_model; a layer whose shape changed is a MismatchError."""
    from fuzz import _host, _model_like, _run_one

    from pytreeio.formats import registry
    from pytreeio.formats.netcl import checkpoint as nck

    fmt = registry.get("netcl-params")
    seed = default_seeds("netcl-params")[0]
    assert isinstance(seed, dict)
    native, meta = fmt.decode(seed)
    model_like = _model_like(fmt, native, meta, {})
    assert model_like is not None and "params" in model_like
    outcomes = dict(_run_one(fmt, seed, _host(native), 10.0, {}, model_like))
    assert outcomes["to_model"] is None and outcomes["restore"] is None
    other = {"p0": np.ones((3, 8), np.float32), "p1": np.ones(8, np.float32)}
    changed = {k: v.tobytes() for k, v in nck.PARAMS.encode(other).files.items()}  # type: ignore[union-attr]
    outcomes = dict(_run_one(fmt, changed, _host(native), 10.0, {}, model_like))
    assert isinstance(outcomes["to_model"], MismatchError), outcomes


def test_fields_found_in_each_container() -> None:
    from fuzz import _msgpack_fields

    from pytreeio.containers import npy
    from pytreeio.formats import msgpack, safetensors

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


def _can_reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _can_reset_peak_rss(), reason="needs Linux /proc/self/clear_refs")
def test_fuzzer_fails_inputs_whose_resident_memory_grows_too_much(tmp_path: Path) -> None:
    """Memory tracemalloc cannot see (an anonymous map, as a C library would allocate)
    still counts: the peak RSS may also grow by at most the input's size + 64 MiB."""
    import mmap

    def decode(buffer: Any) -> Decoded:
        if bytes(buffer) != bytes(8):
            block = mmap.mmap(-1, 80 << 20)
            np.frombuffer(block, np.uint8).fill(1)  # 80 MiB resident, untraced
            block.close()
        return Decoded({}, {})

    report = fuzz_format(_toy(decode), [bytes(8)], 4, 0, save_dir=tmp_path)
    assert report.outcomes["rss:over"] >= 1 and report.outcomes["memory:over"] == 0
    assert report.worst_rss_ratio > 1 and report.worst_memory_ratio < 0.1
    failure = next(f for f in report.failures if f.stage == "rss")
    assert "peak RSS growth" in failure.error and "worst peak RSS" in report.summary()


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

    from pytreeio.containers import npy

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

    from pytreeio.containers import npy

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

    from pytreeio.formats import registry

    assert main(["-n", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    for name in registry.formats():
        assert f"\n{name}: 2 inputs, 0 failures" in "\n" + out
    assert len(list(registry.formats())) >= 9


def test_lazy_view_of_a_msgpack_map_with_keys_that_form_no_key_path(tmp_path: Path) -> None:
    """An array under a map key None: msgpack's slots raised AttributeError building its
    key string, and the lazy view's flatten a TypeError; such keys are named by str()."""
    import msgpack as msgpack_lib

    import pytreeio as ptio
    from pytreeio.formats import msgpack

    arr = np.arange(6, dtype=np.float32)
    blob = msgpack.encode({"x": {"w": arr}}).tobytes().replace(b"\xa1x", b"\xc0", 1)  # key nil
    assert msgpack_lib.unpackb(blob, strict_map_key=False, ext_hook=lambda c, d: d).keys() == {None}
    path = tmp_path / "odd.msgpack"
    path.write_bytes(blob)
    with ptio.open(path) as view:
        assert list(view) == ["None/w"]
        assert np.array_equal(view["None/w"], arr)
        whole = view.load()  # the slot tree walked with its None key kept (was a TypeError)
        assert list(whole) == [None] and np.array_equal(whole[None]["w"], arr)
    assert np.array_equal(ptio.load(path)[None]["w"], arr)
