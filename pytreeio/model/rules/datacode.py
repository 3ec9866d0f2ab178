"""DataCode's optimizers as optax transformations, and training-stage records.

A DataCode file keeps no optimizer moments, only each training stage's
``optimizer_type`` and ``optimizer_params`` (``training.stages[*]``).
`datacode_optimizer` builds, from a stage (or a whole document: its last
stage), an optax optimizer that updates exactly as DataCode does (f32
throughout; seed-document era):

========= ================================================ ==========================================
type      DataCode's step (defaults)                       rule (and the stock optax it equals)
========= ================================================ ==========================================
SGD       ``p - g*lr``                                     `sgd`: ``optax.sgd(lr)``
Momentum  ``v = b*v + (1-b)*g; p - v*lr`` (b 0.9)          `momentum`: ``chain(ema(b,
                                                           debias=False), scale(-lr))``
NAG       ``v = b*v + lr*g; p - v`` (b 0.9)                `nag`: ``chain(scale(lr), trace(b),
                                                           scale(-1))``
Adagrad   ``G = G + g*g`` from 0;                          `adagrad` (optax starts G at 0.1
          ``p - (lr/sqrt(G+eps))*g`` (eps 1e-8)            and uses rsqrt)
RMSprop   ``E = gam*E + (1-gam)*g*g`` from 0;              `rmsprop` (no optax equivalent)
          ``p - (lr/sqrt(E+eps))*g`` (gam 0.9, eps 1e-8)
Adam      t from 1, ``m^ = m/(1-b1^t)``, ``v^ = v/(1-b2^t)``; `adam` (``optax.adam`` groups
          ``p - (lr*m^)/(sqrt(v^)+eps)`` (0.9, 0.999, 1e-8) ``lr*(m^/(...))``)
AdamW     ``p - lr*(m^/(sqrt(v^)+eps) + wd*p)`` (wd 0.01)  `adamw`: ``optax.adamw(lr, b1, b2,
                                                           eps, weight_decay=wd)``
========= ================================================ ==========================================

XLA does not evaluate f32 arithmetic as written (it fuses multiply-adds and
replaces some divisions, see ``_Exact``), so the stock optax equivalents
equal DataCode bit for bit only when run op by op (Momentum, NAG), or not
even then (AdamW: XLA computes optax's ``m/(1-b1^t)`` as ``m*(1/(...))``).
The rules here (SGD is ``optax.sgd`` plus a rounding step) round every
operation as DataCode does, op by op and under ``jax.jit`` alike.

Every optimizer is wrapped in ``optax.inject_hyperparams`` with DataCode's
own parameter names (``lr``, ``beta``, ``gamma``, ``epsilon``, ``beta1``,
``beta2``, ``weight_decay``), so the state carries them and
`pytreeio.formats.datacode.training.stage_record` reads them back.  They are float32 arrays: ``1 - beta``
is then computed in f32 as DataCode does (a Python float would make it an
f64 difference rounded once more).

``variant="later"``: the later DataCode release (the conformance files)
trains with SGD and Adam only and first clips each tensor's gradient to L2
norm 1 (``g * (1/norm)`` when ``norm > 1``); a tensor whose gradient (or
whose updated value, when ``update`` gets ``params``) is not finite is left
alone that step (its moments too; Adam's step count still advances), and
its Adam step is grouped ``(m^/(sqrt(v^)+eps)) * -lr``.  The squared norm
is summed by XLA (pairwise) where DataCode sums sequentially, so for a
tensor being clipped the factor can differ in its last bits.

`pytreeio.formats.datacode.training` maps a stage to
`pytreeio.model.optim`'s vocabulary and writes stages into a document after
training in JAX.

jax and optax are imported when an optimizer is built, never at import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from pytreeio.core.errors import MismatchError
from pytreeio.model.rules import _ieee

__all__ = [
    "LOSSES",
    "OPTIMIZERS",
    "MAX_STAGES",
    "check_loss",
    "stage_of",
    "hyperparams",
    "datacode_optimizer",
    "sgd",
    "momentum",
    "nag",
    "adagrad",
    "rmsprop",
    "adam",
    "adamw",
    "later_sgd",
    "later_adam",
    "AccumulatorState",
    "MomentumState",
    "NAGState",
    "AdamState",
]

#: The loss names DataCode writes into a stage.
LOSSES = (
    "cross_entropy",
    "sparse_cross_entropy",
    "categorical_cross_entropy",
    "binary_cross_entropy",
    "mse",
)
#: Each optimizer type's parameters and defaults (None: required).
OPTIMIZERS: dict[str, dict[str, float | None]] = {
    "SGD": {"lr": None},
    "Momentum": {"lr": None, "beta": 0.9},
    "NAG": {"lr": None, "beta": 0.9},
    "Adagrad": {"lr": None, "epsilon": 1e-8},
    "RMSprop": {"lr": None, "gamma": 0.9, "epsilon": 1e-8},
    "Adam": {"lr": None, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    "AdamW": {"lr": None, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.01},
}
#: DataCode keeps the last this many stages when it saves.
MAX_STAGES = 10
_LATER_TYPES = ("SGD", "Adam")
_VARIANTS = ("seed", "later")


# --------------------------------------------------------------------------
# stages and their hyperparameters
# --------------------------------------------------------------------------


def check_loss(name: Any, where: str = "loss") -> str:
    """``name`` if it is one of `LOSSES`; else a `MismatchError` naming it."""
    if not isinstance(name, str) or name not in LOSSES:
        raise MismatchError(
            f"unknown DataCode loss {name!r}", key_path=where, expected=list(LOSSES), found=name
        )
    return name


def stage_of(stage_or_meta: Mapping[str, Any], index: int = -1) -> tuple[dict[str, Any], str]:
    """``(stage, its key path)``: the mapping itself if it is a stage, else ``training.stages[index]``."""
    if not isinstance(stage_or_meta, Mapping):
        raise MismatchError(
            "expected a DataCode document or one of its training stages",
            key_path="",
            found=type(stage_or_meta).__name__,
        )
    if "optimizer_type" in stage_or_meta:
        return dict(stage_or_meta), "stage"
    training = stage_or_meta.get("training")
    stages = training.get("stages") if isinstance(training, Mapping) else None
    if not isinstance(stages, list) or not stages:
        raise MismatchError(
            "the document records no training stage", key_path="training.stages", found=stages
        )
    if not -len(stages) <= index < len(stages):
        raise MismatchError(
            f"stage {index} of {len(stages)}", key_path="training.stages", found=len(stages)
        )
    i = index % len(stages)
    stage = stages[i]
    if not isinstance(stage, Mapping):
        raise MismatchError("a stage must be an object", key_path=f"training.stages[{i}]")
    return dict(stage), f"training.stages[{i}]"


def _f32(value: Any, where: str) -> np.ndarray:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise MismatchError("must be a number", key_path=where, found=value)
    with np.errstate(over="ignore"):  # an f64 beyond f32 is refused just below
        out = np.asarray(value, np.float32)
    if not np.isfinite(out):
        raise MismatchError("must be finite in f32", key_path=where, found=value)
    return out


def hyperparams(
    stage: Mapping[str, Any], where: str = "stage"
) -> tuple[str, dict[str, np.ndarray]]:
    """``(optimizer_type, {name: f32 0-d array})`` of a stage, defaults filled, unknowns refused."""
    otype = stage.get("optimizer_type")
    if not isinstance(otype, str) or otype not in OPTIMIZERS:
        raise MismatchError(
            f"unknown DataCode optimizer type {otype!r}",
            key_path=f"{where}.optimizer_type",
            expected=list(OPTIMIZERS),
            found=otype,
        )
    given = stage.get("optimizer_params")
    given = {} if given is None else given
    if not isinstance(given, Mapping):
        raise MismatchError(
            "optimizer_params must be an object", key_path=f"{where}.optimizer_params"
        )
    spec = OPTIMIZERS[otype]
    unknown = sorted(str(k) for k in given if k not in spec)
    if unknown:
        raise MismatchError(
            f"{otype} takes no parameter(s) {unknown}",
            key_path=f"{where}.optimizer_params",
            expected=list(spec),
            found=unknown,
        )
    out = {}
    for name, default in spec.items():
        value = given.get(name, default)
        if value is None:
            raise MismatchError(
                f"{otype} needs {name!r}",
                key_path=f"{where}.optimizer_params.{name}",
                found="nothing",
            )
        out[name] = _f32(value, f"{where}.optimizer_params.{name}")
    return otype, out


# --------------------------------------------------------------------------
# the update rules (each a complete optimizer: grouping decides the bits)
# --------------------------------------------------------------------------


class AccumulatorState(NamedTuple):
    """Adagrad's sum of squared gradients / RMSprop's running mean square, per parameter."""

    acc: Any


class MomentumState(NamedTuple):
    """DataCode Momentum's velocity (an undebiased EMA of the gradients), per parameter."""

    velocity: Any


class NAGState(NamedTuple):
    """DataCode NAG's velocity (``lr`` times optax's trace), per parameter."""

    velocity: Any


class AdamState(NamedTuple):
    """DataCode Adam: steps taken, first and second moments."""

    count: Any
    mu: Any
    nu: Any


def _zeros(params: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.zeros_like, params)


# XLA does not evaluate f32 arithmetic as written: it contracts a*b + c into a
# fused multiply-add (one rounding instead of two, on CPU and GPU) and
# rewrites x / s (scalar s) as x * (1/s), a / sqrt(b) as a * rsqrt(b) and
# (a / b) / c as a / (b * c).  DataCode rounds every operation as written.  So
# the custom rules below pass every intermediate result through ``_Exact.r``,
# which adds a runtime -0.0: x + -0.0 == x for every x, but the compiler can
# neither drop an addition of an unknown value nor see through it, so each
# operation is rounded on its own.  The -0.0 is ``lr * -0.0``:
# inject_hyperparams passes lr as a traced array, so it is not a compile-time
# constant even under jax.jit.  A scalar divisor becomes the array
# ``s + x*(-0.0)`` (equal to s), which XLA must really divide by.  Division,
# square root and ``beta**t`` go through ``_ieee``: XLA's GPU backend
# approximates all three in f32, so there they run in f64 and round once.


class _Exact:
    """Elementwise f32 operations each rounded as written (see above)."""

    def __init__(self, lr: Any) -> None:
        self.nz = lr * -0.0

    def r(self, x: Any) -> Any:
        return x + self.nz

    def mul(self, a: Any, b: Any) -> Any:
        return self.r(a * b)

    def add(self, a: Any, b: Any) -> Any:
        return self.r(a + b)

    def div(self, a: Any, b: Any) -> Any:
        return self.r(_ieee.div(a, b))

    def div_scalar(self, x: Any, s: Any) -> Any:
        return self.r(_ieee.div(x, s + x * self.nz))

    def sqrt(self, x: Any) -> Any:
        return self.r(_ieee.sqrt(x))

    def neg(self, x: Any) -> Any:
        return self.r(-x)

    def moment(self, x: Any, old: Any, beta: Any) -> Any:
        """``beta*old + (1-beta)*x``."""
        return self.add(self.mul(beta, old), self.mul(1 - beta, x))


def _rounded_steps(lr: Any) -> Any:
    """A stateless last step that rounds each update on its own, so that under jit
    ``apply_updates``' ``p + u`` is not fused with the multiply that made ``u``."""
    import jax
    import optax

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        nz = lr * -0.0
        return jax.tree.map(lambda u: u + nz, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def sgd(lr: Any) -> Any:
    """``p - g*lr``: stock ``optax.sgd``."""
    import optax

    return optax.chain(optax.sgd(lr), _rounded_steps(lr))


def _velocity(state_type: Any, lr: Any, new_velocity: Any, step: Any) -> Any:
    """A one-slot rule: ``v = new_velocity(x, g, v)``, update ``step(x, v)``."""
    import jax
    import optax

    def init(params: Any) -> Any:
        return state_type(_zeros(params))

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        x = _Exact(lr)
        v = jax.tree.map(lambda g, old: new_velocity(x, g, old), updates, state.velocity)
        return jax.tree.map(lambda vel: step(x, vel), v), state_type(v)

    return optax.GradientTransformation(init, update)


def momentum(lr: Any, beta: Any) -> Any:
    """``v = beta*v + (1-beta)*g; p - v*lr``.

    Bit for bit ``chain(optax.ema(beta, debias=False), optax.scale(-lr))``
    when run op by op; under jit XLA fuses optax's multiply-adds, so this
    rule rounds each operation itself.
    """
    return _velocity(
        MomentumState, lr, lambda x, g, v: x.moment(g, v, beta), lambda x, v: x.neg(x.mul(v, lr))
    )


def nag(lr: Any, beta: Any) -> Any:
    """``v = beta*v + lr*g; p - v``: heavy ball with the learning rate inside the velocity.

    Bit for bit ``chain(optax.scale(lr), optax.trace(beta), optax.scale(-1))``
    when run op by op (rounded per operation here for jit, as `momentum`).
    """
    return _velocity(
        NAGState, lr, lambda x, g, v: x.add(x.mul(beta, v), x.mul(lr, g)), lambda x, v: x.neg(v)
    )


def _accumulating(lr: Any, decay: Any, epsilon: Any) -> Any:
    """Adagrad (``decay`` None: ``G + g*g``) or RMSprop (``decay*E + (1-decay)*g*g``), then ``-(lr/sqrt(.+eps))*g``."""
    import jax
    import optax

    def init(params: Any) -> AccumulatorState:
        return AccumulatorState(_zeros(params))

    def update(updates: Any, state: AccumulatorState, params: Any = None) -> Any:
        del params
        x = _Exact(lr)
        if decay is None:
            acc = jax.tree.map(lambda g, a: x.add(a, x.mul(g, g)), updates, state.acc)
        else:
            acc = jax.tree.map(lambda g, a: x.moment(x.mul(g, g), a, decay), updates, state.acc)

        def step(g: Any, a: Any) -> Any:
            return x.neg(x.mul(x.div(lr, x.sqrt(x.add(a, epsilon))), g))

        return jax.tree.map(step, updates, acc), AccumulatorState(acc)

    return optax.GradientTransformation(init, update)


def adagrad(lr: Any, epsilon: Any) -> Any:
    """``G = G + g*g`` from 0; ``p - (lr/sqrt(G+eps))*g``."""
    return _accumulating(lr, None, epsilon)


def rmsprop(lr: Any, gamma: Any, epsilon: Any) -> Any:
    """``E = gamma*E + (1-gamma)*g*g`` from 0; ``p - (lr/sqrt(E+eps))*g``."""
    return _accumulating(lr, gamma, epsilon)


def _corrections(count: Any, beta1: Any, beta2: Any) -> tuple[Any, Any]:
    import jax.numpy as jnp

    t = count.astype(jnp.float32)  # DataCode: beta.powf(step_count as f32)
    return 1 - _ieee.libm_powf(beta1, t), 1 - _ieee.libm_powf(beta2, t)


def _adam_like(lr: Any, beta1: Any, beta2: Any, epsilon: Any, weight_decay: Any) -> Any:
    """Seed-era Adam (``weight_decay`` None) and AdamW."""
    import jax
    import jax.numpy as jnp
    import optax

    def init(params: Any) -> AdamState:
        return AdamState(jnp.zeros([], jnp.int32), _zeros(params), _zeros(params))

    def update(updates: Any, state: AdamState, params: Any = None) -> Any:
        if weight_decay is not None and params is None:
            raise ValueError("AdamW's update needs params (the weight decay term)")
        x = _Exact(lr)
        count = state.count + 1
        bc1, bc2 = _corrections(count, beta1, beta2)
        mu = jax.tree.map(lambda g, m: x.moment(g, m, beta1), updates, state.mu)
        nu = jax.tree.map(lambda g, v: x.moment(x.mul(g, g), v, beta2), updates, state.nu)

        def ratio_parts(m: Any, v: Any) -> tuple[Any, Any]:
            return x.div_scalar(m, bc1), x.add(x.sqrt(x.div_scalar(v, bc2)), epsilon)

        def adam_step(m: Any, v: Any) -> Any:
            m_hat, den = ratio_parts(m, v)
            return x.neg(x.div(x.mul(lr, m_hat), den))

        def adamw_step(m: Any, v: Any, p: Any) -> Any:
            m_hat, den = ratio_parts(m, v)
            return x.neg(x.mul(lr, x.add(x.div(m_hat, den), x.mul(weight_decay, p))))

        if weight_decay is None:
            steps = jax.tree.map(adam_step, mu, nu)
        else:
            steps = jax.tree.map(adamw_step, mu, nu, params)
        return steps, AdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def adam(lr: Any, beta1: Any, beta2: Any, epsilon: Any) -> Any:
    """t from 1; ``p - (lr*m^)/(sqrt(v^)+eps)`` with ``m^ = m/(1-b1^t)``, ``v^ = v/(1-b2^t)``."""
    return _adam_like(lr, beta1, beta2, epsilon, None)


def adamw(lr: Any, beta1: Any, beta2: Any, epsilon: Any, weight_decay: Any) -> Any:
    """``p - lr*(m^/(sqrt(v^)+eps) + wd*p)`` (``update`` needs ``params``).

    ``optax.adamw`` computes the same expression, but XLA turns its ``m/(1-b1^t)``
    into a multiplication by the reciprocal (a few ulp apart), hence this rule.
    """
    return _adam_like(lr, beta1, beta2, epsilon, weight_decay)


# -- the later release: per-tensor clip, non-finite tensors skipped ---------------


def _clipped(g: Any, x: _Exact) -> tuple[Any, Any]:
    """``(g clipped to L2 norm 1, whether g is finite)`` as DataCode's later release does per tensor."""
    import jax.numpy as jnp

    finite = jnp.all(jnp.isfinite(g))
    norm = _ieee.sqrt(jnp.sum(g * g))
    return jnp.where(norm > 1, x.mul(g, _ieee.div(1, norm)), g), finite


def _keep(step: Any, finite: Any, param: Any) -> Any:
    """Whether to apply ``step``: a finite gradient and (when the parameter is known) a finite result."""
    import jax.numpy as jnp

    if param is None:
        return finite
    return finite & jnp.all(jnp.isfinite(param + step))


def _skip_or(step: Any, keep: Any) -> Any:
    import jax.numpy as jnp

    # p + (-0.0) == p bit for bit (p = -0.0 included), so a skipped tensor stays as it was.
    return jnp.where(keep, step, jnp.full_like(step, -0.0))


def _per_tensor(fn: Any, params: Any, *trees: Any) -> Any:
    """``fn(*leaves, param)`` over the trees, ``param`` None when ``update`` got no params."""
    import jax

    if params is None:
        return jax.tree.map(lambda *leaves: fn(*leaves, None), *trees)
    return jax.tree.map(fn, *trees, params)


def later_sgd(lr: Any) -> Any:
    """The later release's SGD: per-tensor clip, ``p + g*(-lr)``, non-finite tensors skipped."""
    import optax

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        x = _Exact(lr)

        def one(g: Any, p: Any) -> Any:
            gc, finite = _clipped(g, x)
            step = x.mul(gc, -lr)
            return _skip_or(step, _keep(step, finite, p))

        return _per_tensor(one, params, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def later_adam(lr: Any, beta1: Any, beta2: Any, epsilon: Any) -> Any:
    """The later release's Adam: per-tensor clip, ``(m^/(sqrt(v^)+eps))*(-lr)``, skipped tensors keep their moments."""
    import jax
    import jax.numpy as jnp
    import optax

    def init(params: Any) -> AdamState:
        return AdamState(jnp.zeros([], jnp.int32), _zeros(params), _zeros(params))

    def update(updates: Any, state: AdamState, params: Any = None) -> Any:
        x = _Exact(lr)
        count = state.count + 1
        bc1, bc2 = _corrections(count, beta1, beta2)

        def one(g: Any, m: Any, v: Any, p: Any) -> tuple[Any, Any, Any]:
            gc, finite = _clipped(g, x)
            m_new, v_new = x.moment(gc, m, beta1), x.moment(x.mul(gc, gc), v, beta2)
            den = x.add(x.sqrt(x.div_scalar(v_new, bc2)), epsilon)
            step = x.mul(x.div(x.div_scalar(m_new, bc1), den), -lr)
            keep = _keep(step, finite, p)
            return _skip_or(step, keep), jnp.where(keep, m_new, m), jnp.where(keep, v_new, v)

        out = _per_tensor(one, params, updates, state.mu, state.nu)
        pick = [jax.tree.map(lambda g, o, i=i: o[i], updates, out) for i in range(3)]
        return pick[0], AdamState(count, pick[1], pick[2])

    return optax.GradientTransformation(init, update)


_SEED_RULES = {
    "SGD": sgd,
    "Momentum": momentum,
    "NAG": nag,
    "Adagrad": adagrad,
    "RMSprop": rmsprop,
    "Adam": adam,
    "AdamW": adamw,
}
_LATER_RULES = {"SGD": later_sgd, "Adam": later_adam}


def datacode_optimizer(
    stage_or_meta: Mapping[str, Any], *, stage: int = -1, variant: str = "seed"
) -> Any:
    """The optax optimizer that continues a DataCode training stage under DataCode's own rule.

    Args:
      stage_or_meta: a stage record, or a whole DataCode document (its
        ``training.stages[stage]`` is used).
      stage: which stage of a document (default the last).
      variant: ``"seed"`` (the rules of the table above) or ``"later"`` (per-tensor
        clip and non-finite skip; SGD and Adam only).

    Returns ``optax.inject_hyperparams(rule)(**params)`` with DataCode's
    parameter names as float32 arrays.  The stage's loss name is checked too.
    Raises `MismatchError` naming an unknown optimizer type, loss,
    parameter, or a missing ``lr``.
    """
    import optax

    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, not {variant!r}")
    record, where = stage_of(stage_or_meta, stage)
    check_loss(record.get("loss"), f"{where}.loss")
    otype, params = hyperparams(record, where)
    rules = _SEED_RULES if variant == "seed" else _LATER_RULES
    if otype not in rules:
        raise MismatchError(
            f"the later DataCode release trains only with {list(_LATER_TYPES)}, not {otype}",
            key_path=f"{where}.optimizer_type",
            expected=list(_LATER_TYPES),
            found=otype,
        )
    return optax.inject_hyperparams(rules[otype])(**params)
