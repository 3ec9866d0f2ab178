"""bullet checkpoints as models: ``l{k}w``/``l{k}b`` are Linear layer ``k``'s kernel and bias.

An optax ``adam``/``adamw`` state maps ``mu`` to ``momentum.bin`` and ``nu`` to
``velocity.bin`` by id, its ``count`` to every line of ``step.txt``.  The
files hold no architecture: ``layers=`` supplies it on loading.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pytreeio.core.errors import ConversionError, MismatchError, PytreeioWarning
from pytreeio.formats.bullet.layout import LAYER_ID, is_int
from pytreeio.model.form import Layer, Model

FORMAT_NAME = "bullet"


def _layer_count(weights: Mapping[str, Any]) -> int:
    """The number of affine layers ``l0..l{n-1}``; every id must belong to one."""
    ks = set()
    for rid in weights:
        m = LAYER_ID.match(rid)
        if m is None:
            why = f"tensor {rid!r} is not an affine layer's l{{k}}w/l{{k}}b, so the checkpoint is not an MLP"
            raise MismatchError(why, key_path=f"weights/{rid}", expected="l{k}w, l{k}b", found=rid)
        ks.add(int(m.group(1)))
    n = max(ks) + 1 if ks else 0
    for k in range(n):
        if f"l{k}w" not in weights:
            why = f"layer {k} has no weight l{k}w"
            raise MismatchError(why, key_path=f"weights/l{k}w", found="nothing")
    return n


def _model_step(meta: Mapping[str, Any], ids: Sequence[str], step: int | None) -> int | None:
    """The one step count of step.txt (every tensor listed, all equal), or ``step``."""
    steps = meta.get("steps")
    if not steps or not ids:
        return step
    first = ids[0]
    for rid in ids:
        if rid not in steps:
            why = f"step.txt has no line for tensor {rid!r}"
            raise MismatchError(why, key_path=f"steps/{rid}", found="nothing")
        if steps[rid] != steps[first]:
            why = f"step.txt gives tensor {rid!r} step {steps[rid]}, {first!r} step {steps[first]}"
            raise MismatchError(
                f"{why}: an optax state has one step count",
                key_path=f"steps/{rid}",
                expected=steps[first],
                found=steps[rid],
            )
    found = steps[first]
    if step is not None and step != found:
        why = f"step={step} contradicts step.txt ({found})"
        raise MismatchError(why, key_path="step", expected=found, found=step)
    return int(found)


def to_model(
    native: Any, meta: Mapping[str, Any], *, step: int | None = None, layers: Any = None
) -> Model:
    """An MLP of Linear layers (``l{k}w`` kernel ``(in, out)``, ``l{k}b`` bias) with its AdamW state.

    The ``adamw`` count comes from step.txt (one step for every tensor) or, as
    bullet's AdamW writes none, ``step=``.  Ranger's ``slow`` weights are an
    error.  ``layers=[...]`` gives the layer list (activations included) the
    Linear layers sit in.  ``log`` and ``saved_format`` go to ``model.extras['bullet']``.
    """
    from pytreeio.model.optim import OptState

    if not isinstance(native, Mapping) or not isinstance(native.get("weights"), Mapping):
        found = type(native).__name__
        raise MismatchError("a bullet native tree has 'weights'", key_path="weights", found=found)
    if native.get("slow"):
        why = "the checkpoint holds Ranger's lookahead weights (slow.bin), which an optax state"
        why += " has no place for; load the native tree instead"
        raise MismatchError(why, key_path="slow")
    weights = native["weights"]
    linear = []
    order: list[str] = []
    for k in range(_layer_count(weights)):
        kernel, bias = weights[f"l{k}w"], weights.get(f"l{k}b")
        if np.ndim(kernel) != 2:
            why = f"l{k}w holds {np.size(kernel)} values but its shape is unknown (no l{k}b to tell"
            why += f" the output size); pass shapes={{'l{k}w': (in, out)}}"
            raise MismatchError(why, key_path=f"weights/l{k}w", found=tuple(np.shape(kernel)))
        n_in, n_out = (int(d) for d in kernel.shape)
        if bias is not None and (got := tuple(np.shape(bias))) != (n_out,):
            why = f"l{k}b has shape {got}, l{k}w has {n_out} outputs"
            raise MismatchError(why, key_path=f"weights/l{k}b", expected=(n_out,), found=got)
        arrays = {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}
        args = {"in_features": n_in, "out_features": n_out, "bias": bias is not None}
        linear.append(Layer("Linear", args, arrays))
        order += [f"l{k}w"] + ([f"l{k}b"] if bias is not None else [])
    if step is not None and (not is_int(step) or step < 0):
        raise MismatchError("step must be a non-negative integer", key_path="step", found=step)
    count = _model_step(meta, order, step)
    opt = None
    if native.get("momentum") is not None:
        moments = {}
        for slot, part in (("mu", "momentum"), ("nu", "velocity")):
            group = native.get(part) or {}
            missing = [rid for rid in order if rid not in group]
            if missing:
                why = f"{part} has no tensor {missing[0]!r}"
                raise MismatchError(why, key_path=f"{part}/{missing[0]}")
            moments[slot] = [group[rid] for rid in order]
        opt = OptState("adamw", {}, count, moments)
    if layers is not None:
        linear = list(Model.from_params([weights[rid] for rid in order], layers).layers)
    extras = {k: meta[k] for k in ("saved_format", "log") if meta.get(k)}
    return Model(
        tuple(linear), opt_state=opt, step=count, extras={FORMAT_NAME: extras} if extras else {}
    )


def from_model(
    model: Model, meta: Mapping[str, Any] | None = None, *, lossy: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The native tree of an MLP: Linear layer ``k`` -> ``l{k}w`` (kernel) and ``l{k}b`` (bias).

    An ``sgd`` state holds nothing; parameter-free layers are architecture, which
    the files never hold.  Other layers with arrays, frozen layers, other
    optimizers and masked slots raise `ConversionError` unless ``lossy``
    (dropped with a warning).  ``saved_format`` and ``log``: ``meta``, else
    ``model.extras['bullet']``.
    """
    dropped = []
    weights: dict[str, Any] = {}
    param_ids: list[str | None] = []  # per parameter of the model: its id, None when dropped
    k = 0
    for i, layer in enumerate(model.layers):
        if not layer.arrays and not layer.spec.arrays:
            continue  # a parameter-free layer: architecture, which bullet's files never hold
        if layer.type != "Linear" or not layer.trainable:
            what = layer.type if layer.type != "Linear" else "frozen Linear"
            dropped.append(f"layer {i} ({what})")
            param_ids += [None] * len(layer.params)
            continue
        for name, array in layer.params:
            rid = f"l{k}{'w' if name == 'kernel' else 'b'}"
            weights[rid] = array
            param_ids.append(rid)
        k += 1
    tree: dict[str, Any] = {"weights": weights}
    kept = {**model.extras.get(FORMAT_NAME, {}), **(meta or {})}
    out_meta: dict[str, Any] = {key: kept[key] for key in ("saved_format", "log") if key in kept}
    opt = model.opt_state
    count = None
    if opt is not None:
        slots = opt.slots
        moments = all(n in slots and all(s is not None for s in slots[n]) for n in ("mu", "nu"))
        if opt.kind in ("adam", "adamw") and moments:
            for part, name in (("momentum", "mu"), ("velocity", "nu")):
                tree[part] = {rid: m for rid, m in zip(param_ids, slots[name]) if rid is not None}
            count = opt.count
        elif opt.kind == "sgd":
            count = opt.count
        else:
            what = "masked" if opt.kind in ("adam", "adamw") else opt.kind
            dropped.append(f"optimizer state ({what})")
    if model.step is not None and count is not None and model.step != count:
        dropped.append(f"step {model.step} (the optimizer's count is {count})")
    if dropped and not lossy:
        raise ConversionError(f"format 'bullet' cannot hold: {', '.join(dropped)}", what=dropped)
    if dropped:
        warnings.warn(f"bullet: dropping {', '.join(dropped)}", PytreeioWarning, stacklevel=3)
    step = count if count is not None else model.step
    if step is not None:
        out_meta["steps"] = {rid: int(step) for rid in weights}
    return tree, out_meta
