"""Recipe: add your own checkpoint format to pytreeio (cl-waffe2's ``define-model-format``).

A format is a record of pure functions registered by name.  This file defines
``jsonarrays`` - every array of a pytree as JSON numbers in one text file -
and registers it; from then on ``ptio.save``/``load``/``inspect``/``verify``/
``convert`` and the ``pytreeio`` command handle it like the built-in formats:

    import custom_format                      # registers "jsonarrays"
    ptio.save("w.arrays.json", tree)          # the suffix picks the format
    tree = ptio.load("w.arrays.json")         # sniffed from the content
    ptio.convert("w.arrays.json", "w.safetensors", to="safetensors")

Run this file with pytreeio's command line, the format included:

    python examples/custom_format.py inspect w.arrays.json
    python examples/custom_format.py convert ckpt.wf2model out.arrays.json --to jsonarrays
    python examples/custom_format.py walkthrough [--out DIR]   # the recipe, end to end

On disk: ``{"format":"jsonarrays","meta":{...},"arrays":{"<key>":{"dtype":
"float32","shape":[2,3],"data":[...]} | {"scalar": 1.5}}}`` with pytreeio's
canonical key strings (``params/Dense_0/kernel``).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import pytreeio as ptio
from pytreeio.core.records import STRUCTURE

NAME = "jsonarrays"
_HEAD = re.compile(rb'^\s*\{\s*"format"\s*:\s*"jsonarrays"')


def encode(
    tree: Any, *, meta: dict[str, Any] | None = None, indent: int | None = None
) -> ptio.Encoded:
    """Tree -> bytes.  Pure: no file access.  ``indent`` is a save option (declared by name)."""
    arrays: dict[str, Any] = {}
    for key, leaf in ptio.flatten(tree).items():
        if isinstance(leaf, bool | int | float):
            arrays[key] = {"scalar": leaf}
            continue
        a = np.asarray(leaf)
        if a.dtype.kind not in "biuf" or a.dtype.name not in np.sctypeDict:
            raise ptio.EncodeError(f"{a.dtype} is not a JSON number type", key_path=key)
        arrays[key] = {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.ravel().tolist()}
    doc = {"format": NAME, "meta": dict(meta or {}), "arrays": arrays}
    text = json.dumps(doc, indent=indent, separators=None if indent else (",", ":"))
    return ptio.Encoded(chunks=(text.encode(),))


def _document(data: Any, name: str | None = None) -> dict[str, Any]:
    """Parse and check the JSON: every problem becomes a FormatError (never a bare ValueError)."""
    try:
        doc = json.loads(bytes(data))
    except (ValueError, RecursionError) as exc:
        raise ptio.FormatError(f"not JSON: {exc}", path=name) from None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != NAME
        or not isinstance(doc.get("arrays"), dict)
        or not isinstance(doc.get("meta", {}), dict)
    ):
        raise ptio.FormatError("not a jsonarrays document", path=name, field="format")
    return doc


def _array(key: str, entry: Any) -> Any:
    try:
        if set(entry) == {"scalar"}:
            if not isinstance(entry["scalar"], bool | int | float):
                raise ValueError("a scalar must be a number")
            return entry["scalar"]
        dtype = np.dtype(entry["dtype"])
        if dtype.kind not in "biuf":  # never object arrays from a file
            raise ValueError(f"dtype {dtype} is not a number type")
        return np.array(entry["data"], dtype=dtype).reshape(entry["shape"])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ptio.FormatError(f"bad array entry: {exc}", field=key) from None


def decode(source: Any) -> ptio.Decoded:
    """Bytes -> (native tree, meta).  The native tree is nested dicts/lists of the keys."""
    doc = _document(source)
    flat = {key: _array(key, entry) for key, entry in doc["arrays"].items()}
    return ptio.Decoded(ptio.unflatten(flat), doc.get("meta") or {})


def inspect(source: Any) -> ptio.Info:
    """Entries and meta.  (This text format has no separate header, so it reads everything.)"""
    doc = _document(source.read(0, source.size, "document"), source.name)
    entries = []
    for key, entry in doc["arrays"].items():
        value = np.asarray(_array(key, entry))
        entries.append(ptio.Entry(key, value.shape, value.dtype.name, value.nbytes))
    return ptio.Info(format=NAME, entries=tuple(entries), meta=doc.get("meta") or {})


def sniff(probe: ptio.Probe) -> float:
    """How sure we are that ``probe`` (the first 4 KiB of a file) is ours; 0 = not ours."""
    return STRUCTURE if probe.is_file and _HEAD.match(probe.head) else 0.0


FORMAT = ptio.register(
    ptio.Format(
        name=NAME,
        description="every array as JSON numbers in one text file (the custom-format recipe)",
        suffixes=(".arrays.json",),
        layout=ptio.FILE,
        encode=encode,
        decode=decode,
        inspect=inspect,
        sniff=sniff,
    )
)


def walkthrough(out: Path) -> None:
    """Save, load, inspect and convert with the new format; print what happened."""
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((3, 2)).astype(np.float32)
    tree: dict[str, Any] = {
        "params": {
            "Dense_0": {
                "kernel": kernel,
                "bias": np.zeros(2, np.float32),
            }
        },
        "step": 7,
    }
    path = out / "weights.arrays.json"
    ptio.save(path, tree, meta={"note": "hello"}, indent=1)
    back = ptio.load(path)
    same = np.array_equal(back["params"]["Dense_0"]["kernel"], kernel)
    print(f"saved and loaded {path.name}: equal = {same and back['step'] == 7}")
    print(ptio.inspect(path))
    ptio.convert(path, out / "weights.safetensors", to="safetensors")
    ptio.convert(out / "weights.safetensors", out / "again.arrays.json", to=NAME)
    again = ptio.load(out / "again.arrays.json")
    same = np.array_equal(again["params"]["Dense_0"]["kernel"], kernel)
    print(f"round trip through safetensors: equal = {same}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["walkthrough"]:
        out = (
            Path(argv[2]) if argv[1:2] == ["--out"] and len(argv) > 2 else Path(tempfile.mkdtemp())
        )
        out.mkdir(parents=True, exist_ok=True)
        walkthrough(out)
        return 0
    from pytreeio.cli import main as cli_main

    return cli_main(argv)  # the pytreeio command, with "jsonarrays" registered


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
