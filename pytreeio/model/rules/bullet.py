"""bullet's AdamW update rule as an optax transformation.

bullet (the chess NNUE trainer) updates every weight element by element, in
float32, with no bias correction and no step counter::

    p *= 1 - decay*lr
    m  = b1*m + (1 - b1)*g
    v  = b2*v + ((1 - b2)*g)*g
    p -= lr*m / (sqrt(v) + 1e-8)
    p  = clamp(p, -clip, clip)

(bullet divides the gradient by the batch size before this; pass gradients
scaled the same way.)  Its optimiser state is exactly ``momentum.bin`` (``m``)
and ``velocity.bin`` (``v``), so a bullet run resumes in JAX under
`bullet_adamw` as bullet would continue it.

The state is ``(ScaleByAdamState(count, mu, nu), EmptyState(), EmptyState())``:
the very structure of ``optax.adamw``'s state.  So `pytreeio.model.optim` reads
it as an ``adamw`` state (``mu`` = momentum, ``nu`` = velocity, ``count`` =
the steps taken, kept for ``step.txt`` and never used by the update), and a
checkpoint restores into either optimizer.

Compilers contract ``a*b + c`` into a fused multiply-add (XLA's CPU
backend does), which rounds once instead of twice and so is not bullet's float32
rule.  Every product that feeds an addition therefore passes through
`_rounded`, an integer no-op on its bits that XLA cannot see through
(it is OR-ed with a zero known only at run time), so each operation rounds
exactly as written; the tests check the moments bit for bit against numpy.
(XLA's GPU backend did not contract at all when measured, jax 0.11 on an
H100; the barrier keeps the rule exact should it start to.)  The division
and square root go through `pytreeio.model.rules._ieee`, correctly rounded on
GPU too, where XLA's own float32 ``/`` and ``sqrt`` are approximations.

optax applies updates additively (``p + u``).  The update returned is
``p_new - p`` in float32, and ``p + (p_new - p)`` is ``p_new`` exactly
whenever the two are within a factor of two (Sterbenz); otherwise it can
differ from bullet's ``p_new`` by up to half an ulp of the difference (a
weight crossing zero).  jax and optax are
imported when the transformation is built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pytreeio.model.rules import _ieee

__all__ = ["bullet_adamw", "EPSILON"]

#: bullet's AdamW epsilon.
EPSILON = 1e-8

ScalarOrSchedule = float | Callable[[Any], Any]


def _rounded(x: Any, zero: Any) -> Any:
    """``x`` unchanged, behind an operation that stops multiply-add contraction.

    ``x``'s bits are OR-ed with ``zero`` (an int 0 the compiler cannot
    prove is 0), so the multiplication that produced ``x`` is rounded on its
    own before any addition uses it.
    """
    import jax.numpy as jnp
    from jax import lax

    bits = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize]
    as_int = lax.bitcast_convert_type(x, bits)
    return lax.bitcast_convert_type(as_int | zero.astype(bits), x.dtype)


def bullet_adamw(
    lr: ScalarOrSchedule,
    beta1: float = 0.9,
    beta2: float = 0.999,
    decay: float = 0.01,
    clip: float = 1.98,
) -> Any:
    """bullet's AdamW (see the module docstring) as an ``optax.GradientTransformation``.

    Args:
      lr: the learning rate, or a schedule ``count -> lr`` (optax style).
      beta1, beta2: the moment decay rates (``1 - beta`` is taken in float32).
      decay: the decoupled weight decay (``p *= 1 - decay*lr``).
      clip: weights are clamped to ``[-clip, clip]`` after each step.

    ``update`` needs ``params``.  All arithmetic is in each parameter's dtype
    (float32 for bullet's tensors).
    """
    import jax
    import jax.numpy as jnp
    import optax

    def init(params: Any) -> Any:
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        core = optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=zeros,
            nu=jax.tree_util.tree_map(jnp.zeros_like, params),
        )
        return (core, optax.EmptyState(), optax.EmptyState())

    def leaf(p: Any, g: Any, m: Any, v: Any, rate: Any, zero: Any) -> tuple[Any, Any, Any]:
        dt = p.dtype
        r = functools.partial(_rounded, zero=zero)
        lr_ = jnp.asarray(rate, dt)
        b1, b2 = jnp.asarray(beta1, dt), jnp.asarray(beta2, dt)
        one = jnp.asarray(1, dt)
        g = g.astype(dt)
        p_new = r(p * (one - r(jnp.asarray(decay, dt) * lr_)))
        m = r(b1 * m) + r((one - b1) * g)
        v = r(b2 * v) + r(((one - b2) * g) * g)
        p_new = p_new - _ieee.div(lr_ * m, _ieee.sqrt(v) + jnp.asarray(EPSILON, dt))
        p_new = jnp.clip(p_new, -jnp.asarray(clip, dt), jnp.asarray(clip, dt))
        return p_new - p, m, v

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("bullet_adamw needs params: call update(grads, state, params)")
        core = state[0]
        rate = lr(core.count) if callable(lr) else lr
        # Zero, but only known at run time: what keeps _rounded opaque.
        zero = (core.count < 0).astype(jnp.int32)
        treedef: Any = jax.tree_util.tree_structure(params)
        p_leaves = treedef.flatten_up_to(params)
        results = [
            leaf(p, g, m, v, rate, zero)
            for p, g, m, v in zip(
                p_leaves,
                treedef.flatten_up_to(updates),
                treedef.flatten_up_to(core.mu),
                treedef.flatten_up_to(core.nu),
                strict=True,
            )
        ]
        new_updates = treedef.unflatten([r[0] for r in results])
        mu = treedef.unflatten([r[1] for r in results])
        nu = treedef.unflatten([r[2] for r in results])
        count = optax.safe_int32_increment(core.count)
        return new_updates, (optax.ScaleByAdamState(count=count, mu=mu, nu=nu), *state[1:])

    return optax.GradientTransformation(init, update)
