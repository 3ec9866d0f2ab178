"""DataCode's training records: ``training.stages`` entries written from a JAX run, and
a stage read back as a `pytreeio.model.optim.OptState`.

The update rules themselves are in `pytreeio.model.rules.datacode`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pytreeio.core.errors import MismatchError
from pytreeio.core.serde_json import widen_f32
from pytreeio.formats.datacode.nn import layer_names
from pytreeio.model import optim
from pytreeio.model.form import Model, model_of
from pytreeio.model.rules.datacode import (
    _VARIANTS,
    MAX_STAGES,
    OPTIMIZERS,
    check_loss,
    hyperparams,
    stage_of,
)

__all__ = ["optim_state", "stage_record", "with_stage"]

# --------------------------------------------------------------------------
# pytreeio.model.optim's vocabulary
# --------------------------------------------------------------------------


def optim_state(stage_or_meta: Mapping[str, Any], *, stage: int = -1) -> Any:
    """The stage as a `pytreeio.model.optim.OptState` (no slots: DataCode keeps no moments).

    Kind and optax hyperparameter names of the nearest stock optimizer
    (``pytreeio.model.optim.build(s.kind, s.hyperparams)``), equal to DataCode's rule
    in exact arithmetic: Momentum's EMA is ``trace`` with the learning rate
    scaled by ``1 - beta``; NAG's velocity is ``trace`` times ``lr``.
    """
    record, where = stage_of(stage_or_meta, stage)
    otype, p = hyperparams(record, where)
    lr = float(p["lr"])
    hp: dict[str, Any]
    if otype == "SGD":
        kind, hp = "sgd", {"learning_rate": lr}
    elif otype == "Momentum":
        kind, hp = (
            "momentum",
            {"learning_rate": float(p["lr"] * (1 - p["beta"])), "momentum": float(p["beta"])},
        )
    elif otype == "NAG":
        kind, hp = "momentum", {"learning_rate": lr, "momentum": float(p["beta"])}
    elif otype == "Adagrad":
        kind = "adagrad"
        hp = {"learning_rate": lr, "eps": float(p["epsilon"]), "initial_accumulator_value": 0.0}
    elif otype == "RMSprop":
        kind, hp = (
            "rmsprop",
            {"learning_rate": lr, "decay": float(p["gamma"]), "eps": float(p["epsilon"])},
        )
    else:
        kind = otype.lower()
        hp = {
            "learning_rate": lr,
            "b1": float(p["beta1"]),
            "b2": float(p["beta2"]),
            "eps": float(p["epsilon"]),
        }
        if otype == "AdamW":
            hp["weight_decay"] = float(p["weight_decay"])
    return optim.OptState(kind=kind, hyperparams=hp, count=None, slots={})


# --------------------------------------------------------------------------
# writing what was trained
# --------------------------------------------------------------------------


def _inject_states(node: Any) -> list[Any]:
    """The ``inject_hyperparams`` states inside an optimizer state (chains, tuples, NamedTuples)."""
    if type(node).__name__ in ("InjectHyperparamsState", "InjectStatefulHyperparamsState"):
        return [node]
    if isinstance(node, tuple):
        return [s for child in node for s in _inject_states(child)]
    if isinstance(node, Mapping):
        return [s for child in node.values() for s in _inject_states(child)]
    return []


def _state_names(node: Any) -> set[str]:
    names = {type(node).__name__}
    if isinstance(node, tuple):
        for child in node:
            names |= _state_names(child)
    return names


def _datacode_type(hp: Mapping[str, Any], inner: Any) -> str:
    """The DataCode type of a state built by `datacode_optimizer` (its parameter names)."""
    keys = set(hp)
    for otype, spec in OPTIMIZERS.items():
        if keys == set(spec) and otype not in ("Momentum", "NAG"):
            return otype
    if keys == {"lr", "beta"}:
        names = _state_names(inner)
        if "MomentumState" in names or "NAGState" in names:
            return "Momentum" if "MomentumState" in names else "NAG"
    raise MismatchError(
        "the injected hyperparameters match no DataCode optimizer",
        key_path="opt_state.hyperparams",
        found=sorted(keys),
    )


_FROM_OPTAX: dict[str, tuple[str, dict[str, str]]] = {
    "sgd": ("SGD", {"learning_rate": "lr"}),
    # optax momentum t = g + m*t, step lr*t: DataCode's NAG velocity is lr*t.
    "momentum": ("NAG", {"learning_rate": "lr", "momentum": "beta"}),
    "adagrad": ("Adagrad", {"learning_rate": "lr", "eps": "epsilon"}),
    "rmsprop": ("RMSprop", {"learning_rate": "lr", "decay": "gamma", "eps": "epsilon"}),
    "adam": ("Adam", {"learning_rate": "lr", "b1": "beta1", "b2": "beta2", "eps": "epsilon"}),
    "adamw": (
        "AdamW",
        {
            "learning_rate": "lr",
            "b1": "beta1",
            "b2": "beta2",
            "eps": "epsilon",
            "weight_decay": "weight_decay",
        },
    ),
}


def _from_stock(opt_state: Any, params: Any) -> tuple[str, dict[str, Any]]:
    """Type and parameters of a stock optax optimizer's state (via `pytreeio.model.optim.extract`)."""
    state = optim.extract(opt_state, params)
    if state.kind not in _FROM_OPTAX:
        raise MismatchError(
            f"DataCode has no optimizer like optax's {state.kind}",
            key_path="opt_state",
            expected=sorted(_FROM_OPTAX),
            found=state.kind,
        )
    otype, names = _FROM_OPTAX[state.kind]
    missing = sorted(k for k in names if k not in state.hyperparams)
    if missing:
        raise MismatchError(
            f"the state does not show {missing}: build the optimizer with optax.inject_hyperparams",
            key_path="opt_state.hyperparams",
            found=sorted(state.hyperparams),
        )
    return otype, {names[k]: state.hyperparams[k] for k in names}


def _params_tree(params: Any) -> Any:
    """The Flax params tree the optimizer state is shaped like."""
    if isinstance(params, Model):
        raise MismatchError(
            "a stock optax state is read against the Flax params tree; pass that, not a Model",
            key_path="params",
        )
    if isinstance(params, Mapping) and isinstance(params.get("params"), Mapping):
        return params["params"]
    return params


def _param_value(name: str, value: Any) -> float:
    """A hyperparameter as DataCode writes it: ``lr`` is an f32 widened to f64 (``0.0010000000474974513``),
    the others the shortest decimal of their f32 value (``0.9``, ``1e-8``)."""
    f = np.float32(np.asarray(value))
    return widen_f32(f) if name == "lr" else float(str(f))


def _history(values: Any, where: str, optional: bool) -> list[float] | None:
    if values is None:
        if optional:
            return None
        raise MismatchError("a history list is required", key_path=where, found=None)
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    return [widen_f32(v) for v in arr]


def _counts(params: Any, layers: Any) -> tuple[int, int, list[int], list[str]]:
    """``(trainable, frozen, frozen layer positions, layer types)`` of a model-shaped tree or Model."""
    model = params if isinstance(params, Model) else model_of(params, layers=layers)
    trainable = frozen = 0
    frozen_at = []
    for i, layer in enumerate(model.layers):
        size = sum(int(np.prod(a.shape)) for _, a in layer.params)
        if layer.trainable:
            trainable += size
        else:
            frozen += size
            frozen_at.append(i)
    return trainable, frozen, frozen_at, [la.type for la in model.layers]


def stage_record(
    opt_state: Any,
    params: Any,
    *,
    epochs: int,
    loss: str,
    layers: Any = None,
    loss_history: Sequence[float] = (),
    accuracy_history: Sequence[float] = (),
    val_loss_history: Sequence[float] | None = None,
    val_accuracy_history: Sequence[float] | None = None,
    lr_history: Sequence[float] | None = None,
    variant: str = "seed",
) -> dict[str, Any]:
    """A ``training.stages`` entry describing training done in JAX.

    Args:
      opt_state: the state of an optimizer built with ``optax.inject_hyperparams``:
        one from `datacode_optimizer` (type and parameters read from it;
        Momentum and NAG told apart by their state), or a stock optax one
        (``sgd``, ``sgd(momentum=)`` -> NAG, ``adagrad``, ``rmsprop``,
        ``adam``, ``adamw``; read with `pytreeio.model.optim.extract`).
      params: the model's Flax params tree (or a `pytreeio.model.form.Model`):
        trainable/frozen parameter counts and frozen layer names come from it.
      epochs, loss: the stage's epoch count and loss name (one of `LOSSES`).
      layers: the layer list of a Flax tree (activations, ``trainable`` flags).
      *_history: per-epoch values, stored as f32 (the validation ones and
        ``lr_history`` may be None).
      variant: ``"later"`` adds ``lr_history`` and names frozen Linear layers
        by the Linear-only count.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, not {variant!r}")
    check_loss(loss)
    if type(epochs) is not int or epochs < 0:
        raise MismatchError(
            "epochs must be a non-negative integer", key_path="epochs", found=epochs
        )
    injected = _inject_states(opt_state)
    if len(injected) == 1 and "lr" in injected[0].hyperparams:
        hp = dict(injected[0].hyperparams)
        otype = _datacode_type(hp, injected[0].inner_state)
    else:
        otype, hp = _from_stock(opt_state, _params_tree(params))
    trainable, frozen, frozen_at, types = _counts(params, layers)
    names = layer_names(types, variant)
    record: dict[str, Any] = {
        "epochs": epochs,
        "loss": loss,
        "optimizer_type": otype,
        "optimizer_params": {k: _param_value(k, v) for k, v in hp.items()},
        "frozen_layers": [names[i] for i in frozen_at],
        "trainable_params": trainable,
        "frozen_params": frozen,
        "loss_history": _history(loss_history, "loss_history", False),
        "accuracy_history": _history(accuracy_history, "accuracy_history", False),
        "val_loss_history": _history(val_loss_history, "val_loss_history", True),
        "val_accuracy_history": _history(val_accuracy_history, "val_accuracy_history", True),
    }
    if variant == "later":
        record["lr_history"] = _history(lr_history, "lr_history", True)
    elif lr_history is not None:
        raise MismatchError("seed-variant stages have no lr_history", key_path="lr_history")
    return record


def with_stage(meta: Mapping[str, Any], stage: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a DataCode document with ``stage`` appended (the last `MAX_STAGES` kept)
    and the legacy ``training`` fields set from it, as DataCode's ``train`` leaves them."""
    check_loss(stage.get("loss"), "stage.loss")
    doc = dict(meta)
    training = dict(doc.get("training") or {})
    stages = [*list(training.get("stages") or []), dict(stage)][-MAX_STAGES:]
    training.update(
        stages=stages,
        epochs=stage.get("epochs"),
        loss=stage.get("loss"),
        optimizer=stage.get("optimizer_type"),
        loss_history=stage.get("loss_history"),
        accuracy_history=stage.get("accuracy_history"),
        val_loss_history=stage.get("val_loss_history"),
        val_accuracy_history=stage.get("val_accuracy_history"),
    )
    doc["training"] = training
    return doc
