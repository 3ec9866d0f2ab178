"""pytreeio.forget_layouts drops every layout kept from earlier saves and loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import pytreeio as ptio
from pytreeio import model, model_plans, npz_plans, serde_json
from pytreeio.fmt import bullet, datacode, msgpack_plans, netcl
from pytreeio.fmt import safetensors as st


def _tree() -> dict:
    return {
        "params": {
            f"Dense_{i}": {
                "kernel": np.full((2, 2), i, np.float32),
                "bias": np.zeros(2, np.float32),
            }
            for i in range(40)
        }
    }


def test_forget_layouts_drops_every_kind_and_loads_still_agree(tmp_path: Path) -> None:
    tree = _tree()
    formats = {
        "netcl": "m.npz",
        "datacode": "m.nn",
        "bullet": "b",
        "safetensors": "m.safetensors",
        "msgpack": "m.msgpack",
    }
    loaded = {}
    for fmt, dest in formats.items():
        for _ in range(3):  # kept from the second time on
            ptio.save(tmp_path / dest, tree, format=fmt)
            loaded[fmt] = ptio.load(tmp_path / dest, like=tree)
    kept = {
        "npz reads": npz_plans._PLANS.plans,
        "npz writes": npz_plans._WRITE_PLANS,
        "msgpack": msgpack_plans._PLANS.plans,
        "datacode": datacode._PLANS.plans,
        "datacode layers": datacode._CHECKED_DOCS,
        "bullet": bullet._RECORD_PLANS.plans,
        "bullet shapes": bullet._SHAPES,
        "safetensors": st._KNOWN_HEADERS,
        "netcl": netcl._LAYOUTS,
        "model": model._LAYOUTS,
        "documents": serde_json._WRITTEN,
        "restores": model_plans._RESTORES,
        "saves": model_plans._SAVES,
    }
    assert all(kept.values()), [k for k, v in kept.items() if not v]
    ptio.forget_layouts()
    gone = [
        npz_plans._PLANS.plans, npz_plans._WRITE_PLANS, msgpack_plans._PLANS.plans,
        datacode._PLANS.plans, datacode._CHECKED_DOCS, bullet._RECORD_PLANS.plans,
        st._KNOWN_HEADERS, netcl._LAYOUTS, model._LAYOUTS, serde_json._WRITTEN,
        model_plans._RESTORES, model_plans._SAVES, bullet._SHAPES, bullet._SPECS,
    ]  # fmt: skip
    assert not any(gone)
    for fmt, dest in formats.items():  # worked out again, to the same result
        again = ptio.load(tmp_path / dest, like=tree)
        for name, module in again["params"].items():
            for k, a in module.items():
                assert np.array_equal(a, loaded[fmt]["params"][name][k])
