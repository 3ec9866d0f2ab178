"""After saves and loads in every layout, the destination holds only the checkpoint's files.

Saves lock the destination's directory itself (``flock`` on its descriptor) instead of a
lock file beside the checkpoint, and rename their temporaries into place: so after any mix
of saves, asynchronous saves, conversions into the destination, loads, lazy reads,
inspections and verifications, listing the directory shows the checkpoint and nothing else.
(Orbax item directories: ``tests/test_orbax.py``.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio


def _full(*shape: int, v: float = 1.0) -> np.ndarray:
    return np.full(shape, v, np.float32)


def _tree(fmt: str, v: float) -> tuple[Any, dict[str, Any] | None]:
    """A small native tree of ``fmt`` holding ``v`` everywhere, and the meta it needs."""
    if fmt in ("safetensors", "msgpack"):
        return {"a": _full(4, 3, v=v), "b": [_full(2, v=v)]}, None
    if fmt == "netcl-checkpoint":
        params = [_full(3, 2, v=v), _full(2, v=v)]
        moments = [[_full(3, 2, v=v), _full(3, 2, v=v)], [_full(2, v=v), _full(2, v=v)]]
        return {"params": params, "optim_state": {"t": 3, "moments": moments}}, None
    if fmt == "netcl-params":
        return {"p0": _full(3, 2, v=v), "p1": _full(2, v=v)}, None
    if fmt == "netcl":
        tree = [{"weight": _full(3, 2, v=v), "bias": _full(2, v=v)}, {}]
        return tree, {"config": ["Linear", "ReLU"]}
    if fmt == "datacode":
        tree = {"layer0": {"weight": _full(3, 2, v=v), "bias": _full(2, v=v)}}
        return tree, {"layers": ["Linear", "ReLU"]}
    if fmt == "tinyllama":
        d, f, vocab, seq = 4, 8, 6, 5
        layer = {"wq": _full(d, d, v=v), "wk": _full(d, d, v=v), "wv": _full(d, d, v=v),
                 "wo": _full(d, d, v=v), "w1": _full(d, f, v=v), "b1": _full(f, v=v),
                 "w2": _full(f, d, v=v), "b2": _full(d, v=v),
                 "ln1": {"scale": _full(d, v=v), "bias": _full(d, v=v)},
                 "ln2": {"scale": _full(d, v=v), "bias": _full(d, v=v)}}  # fmt: skip
        tree = {"tok_embedding": _full(vocab, d, v=v), "pos_embedding": _full(seq, d, v=v),
                "layers": [layer], "output": _full(d, vocab, v=v)}  # fmt: skip
        return tree, {"config": {"n_heads": 2, "dropout": 0.0}}
    if fmt == "waffe2":
        layers = {"0": {"weights": _full(2, 3, v=v), "bias": _full(2, v=v)}}
        return {"param": {"linearlayer": layers}}, None
    if fmt == "bullet":
        part = {"l0w": _full(768, 4, v=v / 128), "l0b": _full(4, v=v / 128),
                "l1w": _full(8, 1, v=v / 128), "l1b": _full(1, v=v / 128)}  # fmt: skip
        return {"weights": part, "momentum": part, "velocity": part}, None
    raise AssertionError(fmt)


DEST = {
    "safetensors": "ckpt.safetensors",
    "msgpack": "ckpt.msgpack",
    "tinyllama": "weights.bin",
    "datacode": "ckpt.nn",
    "netcl": "ckpt.netcl",
    "netcl-params": "ckpt.npz",
    "netcl-checkpoint": "ckpt",
    "waffe2": "ckpt.wf2model",
    "bullet": "ckpt",
}


def _listing(root: Path) -> list[str]:
    """Every name under ``root``, directories' contents included, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out += [os.path.normpath(os.path.join(rel, n)) for n in dirnames + filenames]
    return sorted(out)


def _own_files(fmt: str, dest: Path, tree: Any, meta: Any) -> list[str]:
    """What the checkpoint itself consists of, from its encoding (not from the disk)."""
    encoded = ptio.encode(tree, format=fmt, meta=meta, dest=dest)
    layout = ptio.list_formats()[fmt].layout
    if encoded.files is None:
        return [dest.name]
    if isinstance(layout, ptio.Siblings):  # roles -> the sibling files' names
        located = layout.locate(dest)
        return sorted(os.path.basename(located[role]) for role in encoded.files)
    inside = {os.path.join(dest.name, *Path(rel).parts) for rel in encoded.files}
    parents = {os.path.join(dest.name, *Path(rel).parts[:i])
               for rel in encoded.files for i in range(1, len(Path(rel).parts))}  # fmt: skip
    return sorted({dest.name} | inside | parents)


@pytest.mark.parametrize("fmt", sorted(DEST))
def test_only_the_checkpoints_files_after_saves_and_loads(fmt: str, tmp_path: Path) -> None:
    dest = tmp_path / "dst" / DEST[fmt]
    dest.parent.mkdir()
    tree, meta = _tree(fmt, 1.0)
    own = _own_files(fmt, dest, tree, meta)
    ptio.save(dest, tree, format=fmt, meta=meta)
    assert _listing(dest.parent) == own
    ptio.save(dest, _tree(fmt, 2.0)[0], format=fmt, meta=meta)  # over an existing one
    ptio.save_async(dest, _tree(fmt, 3.0)[0], format=fmt, meta=meta).result()
    back = ptio.load(dest, format=fmt)
    ptio.load(dest, format=fmt, like=back)
    ptio.load_with_meta(dest, format=fmt, mmap=True)
    ptio.inspect(dest, format=fmt)
    ptio.verify(dest, format=fmt)
    with ptio.open(dest, format=fmt) as ck:
        [ck[k] for k in ck]
    assert _listing(dest.parent) == own
    # a conversion into the destination, from a checkpoint elsewhere
    other = tmp_path / "src" / DEST[fmt]
    other.parent.mkdir()
    ptio.save(other, _tree(fmt, 4.0)[0], format=fmt, meta=meta)
    ptio.convert(other, dest, to=fmt, from_=fmt)
    assert _listing(dest.parent) == own
    got, want = (ptio.flatten(ptio.load(p, format=fmt)) for p in (dest, other))
    assert got.keys() == want.keys()
    assert all(np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes() for k in got)
