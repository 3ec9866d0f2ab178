"""Interoperability with the real netcl 0.4.4 (needs pyopencl and an OpenCL device).

These tests must run in CI: a missing netcl or OpenCL device is a failure, not
a skip.  Set PYTREEIO_ALLOW_NO_OPENCL=1 to skip them on a machine without one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pytreeio as ptio

if os.environ.get("PYTREEIO_ALLOW_NO_OPENCL") == "1":
    netcl = pytest.importorskip("netcl")
else:
    import netcl  # noqa: F401  (fails loudly when missing)


@pytest.fixture(scope="module")
def queue():  # type: ignore[no-untyped-def]
    from netcl.core.device import manager

    dev = manager.default()
    if dev is None:
        if os.environ.get("PYTREEIO_ALLOW_NO_OPENCL") == "1":
            pytest.skip("no OpenCL device")
        raise RuntimeError(
            "no OpenCL device: install pocl-binary-distribution (pip) or pocl-opencl-icd (apt)"
        )
    return dev.queue


def _netcl_model(queue):  # type: ignore[no-untyped-def]
    from netcl.nn.batchnorm import BatchNorm2dModule
    from netcl.nn.layers import (
        Conv2d,
        Dropout,
        Flatten,
        LeakyReLU,
        Linear,
        MaxPool2d,
        ReLU,
        Sequential,
        Sigmoid,
        Tanh,
    )

    return Sequential(
        Conv2d(queue, 3, 4, 3, pad=1), BatchNorm2dModule(queue, 4), ReLU(), MaxPool2d(), LeakyReLU(0.2),
        Flatten(), Dropout(0.3, seed=1), Linear(queue, 16, 5), Sigmoid(), Linear(queue, 5, 3, bias=False), Tanh(),
    )  # fmt: skip


def _state(model) -> list[dict[str, np.ndarray]]:  # type: ignore[no-untyped-def]
    return [
        {k: v for k, v in layer.state_dict().items() if isinstance(v, np.ndarray)}
        for layer in model.layers
    ]


def test_netcl_save_model_loads_in_pytreeio_and_saves_back_identically(
    queue, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from netcl.io import save_model

    model = _netcl_model(queue)
    p = tmp_path / "m.netcl"
    save_model(model, str(p))
    native, meta = ptio.load_with_meta(p)
    assert meta["format"] == "netcl.single-file" and meta["version"] == 2
    for ours, theirs in zip(native, _state(model)):
        assert list(ours) == list(theirs)
        for k in ours:
            np.testing.assert_array_equal(ours[k], theirs[k])
    q = tmp_path / "again.netcl"
    ptio.save(q, native, meta=meta)
    assert q.read_bytes() == p.read_bytes()


def test_pytreeio_model_file_loads_in_netcl(queue, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from netcl.io import load_model

    rng = np.random.default_rng(0)
    layers = [
        {"weight": rng.standard_normal((4, 3, 3, 3), np.float32), "bias": rng.standard_normal(4, np.float32)},
        {k: rng.standard_normal(4, np.float32) for k in ("gamma", "beta", "running_mean", "running_var")},
        {}, {}, {}, {}, {}, {}, {},
        {"weight": rng.standard_normal((16, 5), np.float32), "bias": rng.standard_normal(5, np.float32)},
    ]  # fmt: skip
    config = [
        {"type": "Conv2d", "args": {"pad": 1}}, "BatchNorm2d", "ReLU", "MaxPool2d",
        {"type": "LeakyReLU", "args": {"negative_slope": 0.2}}, "Sigmoid", "Tanh", "Flatten", "Dropout", "Linear",
    ]  # fmt: skip
    p = tmp_path / "ours.netcl"
    ptio.save(p, layers, meta={"config": config})
    model = load_model(str(p), queue=queue)
    assert [type(m).__name__ for m in model.layers] == [
        "Conv2d", "BatchNorm2dModule", "ReLU", "MaxPool2d", "LeakyReLU", "Sigmoid", "Tanh", "Flatten", "Dropout", "Linear",
    ]  # fmt: skip
    assert model.layers[4].negative_slope == 0.2
    for ours, theirs in zip(layers, _state(model)):
        assert list(ours) == list(theirs)
        for k in ours:
            np.testing.assert_array_equal(ours[k], theirs[k])


def test_flax_model_loads_in_netcl(queue, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from netcl.io import load_model

    rng = np.random.default_rng(1)
    params = {"Dense_0": {"kernel": rng.standard_normal((4, 8), np.float32), "bias": np.zeros(8, np.float32)},
              "Dense_1": {"kernel": rng.standard_normal((8, 3), np.float32), "bias": np.ones(3, np.float32)}}  # fmt: skip
    p = tmp_path / "flax.netcl"
    ptio.save(p, params, meta={"config": ["Linear", "ReLU", "Linear"]})
    model = load_model(str(p), queue=queue)
    np.testing.assert_array_equal(model.layers[2].weight.to_host(), params["Dense_1"]["kernel"])
    back = ptio.load(p, like=params)
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_netcl_legacy_pair_loads_in_both(queue, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # netcl 0.4.4 no longer writes the pair; build it from netcl's own export helpers.
    from netcl.io import load_model, serialization

    model = _netcl_model(queue)
    stem = tmp_path / "legacy"
    meta = {"type": "Sequential", "config": serialization._sequential_config(model), "version": 1}
    Path(str(stem) + ".json").write_text(json.dumps(meta))
    np.savez(str(stem) + ".npz", **serialization._model_weights(model))
    theirs = _state(load_model(str(stem), queue=queue))
    ours = ptio.load(stem)
    for a, b in zip(ours, theirs):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_checkpoints_both_ways(queue, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from netcl.io.checkpoint import load_checkpoint, save_checkpoint
    from netcl.optim.adamw import AdamW

    model = _netcl_model(queue)
    params = model.parameters()
    p = tmp_path / "ck" / "iter_1"
    save_checkpoint(params, str(p), optim_state={"t": 0}, config={"lr": 0.1})
    native = ptio.load(p, format="netcl-checkpoint")
    assert list(native["params"]) == [f"p{i}" for i in range(len(params))]
    for i, t in enumerate(params):
        np.testing.assert_array_equal(native["params"][f"p{i}"], t.to_host())
    assert native["config"] == {"lr": 0.1}

    # a pytreeio checkpoint from an optax AdamW state, accepted by netcl's AdamW
    jparams = [jnp.asarray(t.to_host()) for t in params]
    opt = optax.adamw(1e-3)
    state = opt.init(jparams)
    grads = [jnp.full_like(x, 0.25) for x in jparams]
    for _ in range(3):
        updates, state = opt.update(grads, state, jparams)
        jparams = optax.apply_updates(jparams, updates)
    q = tmp_path / "ours" / "iter_3"
    q.parent.mkdir()
    ptio.save(
        q,
        {"params": jparams, "optim_state": state, "config": {"step": 3}},
        format="netcl-checkpoint",
    )
    meta = load_checkpoint(queue, params, str(q))
    for t, x in zip(params, jparams):
        np.testing.assert_array_equal(t.to_host(), np.asarray(x))
    adamw = AdamW(params)
    assert adamw.load_state_dict(meta["optim_state"]) == len(params)
    st = adamw.state_dict()
    assert st["t"] == 3
    for (m, v), mu, nu in zip(st["moments"], state[0].mu, state[0].nu):
        np.testing.assert_array_equal(m, np.asarray(mu))
        np.testing.assert_array_equal(v, np.asarray(nu))
