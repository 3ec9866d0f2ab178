"""A bounded slice of the mutation fuzzer (tests/fuzz.py) for every format, and the fuzzer's own checks.

About 200 inputs per format; ``nox -s fuzz`` (``python tests/fuzz.py -n 20000``)
runs the long version.  The per-format counts (inputs, outcomes by stage and
exception type) are printed and recorded as the ``fuzz`` test property.
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
    default_seeds,
    find_fields,
    fuzz_format,
    mutate,
    mutate_json,
)

from pytreeio.errors import FormatError
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
