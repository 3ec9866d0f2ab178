"""cl-waffe2's Adam as an optax transformation, so a cl-waffe2 run continues in JAX.

cl-waffe2's ``Adam`` (``optimizers/adam.lisp``) differs from ``optax.adam`` in
where the bias correction goes: it folds both corrections into the step size
and adds ``eps`` to the *uncorrected* ``sqrt(v)``.  One step, in single-float::

    n    += 1                                   (n = 1 on the first step)
    lr_t  = lr * (sqrt(1 - beta2^n) / (1 - beta1^n))
    m    += (g - m) * (1 - beta1)
    v    += (1 - beta2) * (g*g - v)
    p    -= (m * lr_t) / (eps + sqrt(v))

The state is optax's ``ScaleByAdamState(count, mu, nu)`` (``count`` = n,
``mu`` = m, ``nu`` = v) under ``optax.inject_hyperparams`` with optax's
hyperparameter names (``learning_rate``, ``b1``, ``b2``, ``eps``), so
`pytreeio.model.optim` maps it to and from an ``adam`` ``OptState`` like any
optax Adam, hyperparameters included, and the ``waffe2`` format reads and
writes it as cl-waffe2's ``lr``, ``eps``, ``beta1``, ``beta2``, ``n``, ``m``, ``v``.

``beta^n`` is computed in double precision and rounded to single, as SBCL
does, and every division and square root is correctly rounded on CPU and GPU
alike (`pytreeio.model.rules._ieee`), so the step is cl-waffe2's bit for bit.
jax and optax are imported when a transformation is built.
"""

from __future__ import annotations

from typing import Any

from pytreeio.model.rules import _ieee

__all__ = ["waffe2_adam", "scale_by_waffe2_adam"]


def _rounded(x: Any) -> Any:
    """``x``, rounded to its dtype before any later addition.

    XLA's CPU backend contracts ``a * b + c`` into one fused multiply-add
    (its GPU backend did not when measured, but may), which rounds once where cl-waffe2 (a ``!mul`` node, then an
    in-place ``A+=B``) rounds twice; after cancellation the results differ by
    hundreds of ulps.  ``nextafter(x, x)`` is ``x`` exactly, and the compiler
    cannot look through it, so the product is rounded on its own.
    """
    from jax import lax

    return lax.nextafter(x, x)


def scale_by_waffe2_adam(learning_rate: Any, b1: Any, b2: Any, eps: Any) -> Any:
    """The cl-waffe2 Adam step (updates already scaled by ``-lr_t``), without injection.

    The hyperparameters may be floats or traced scalars (``inject_hyperparams``
    passes arrays); they are cast to each update's dtype, so float32 parameters
    compute in float32 throughout, as cl-waffe2's single-float does.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from optax import tree_utils as otu

    def init_fn(params: Any) -> Any:
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=otu.tree_zeros_like(params),
            nu=otu.tree_zeros_like(params),
        )

    def update_fn(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        count = optax.safe_increment(state.count)  # n is incremented before the step

        def cast(x: Any, like: Any) -> Any:
            return jnp.asarray(x, like.dtype)

        def moment_m(g: Any, m: Any) -> Any:
            return m + _rounded((g - m) * (1 - cast(b1, g)))

        def moment_v(g: Any, v: Any) -> Any:
            return v + _rounded((1 - cast(b2, g)) * (_rounded(g * g) - v))

        def delta(m: Any, v: Any) -> Any:
            n = count.astype(m.dtype)
            correction2 = 1 - _ieee.power(cast(b2, m), n)
            correction1 = 1 - _ieee.power(cast(b1, m), n)
            lr_t = cast(learning_rate, m) * _ieee.div(_ieee.sqrt(correction2), correction1)
            return -_ieee.div(m * lr_t, cast(eps, m) + _ieee.sqrt(v))

        mu = jax.tree_util.tree_map(moment_m, updates, state.mu)
        nu = jax.tree_util.tree_map(moment_v, updates, state.nu)
        new_updates = jax.tree_util.tree_map(delta, mu, nu)
        return new_updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def waffe2_adam(
    lr: float = 1e-3, eps: float = 1e-7, beta1: float = 0.9, beta2: float = 0.999
) -> Any:
    """cl-waffe2's ``(Adam param :lr lr :eps eps :beta1 beta1 :beta2 beta2)`` as an optax optimizer.

    Defaults are cl-waffe2's.  Use it like any optax optimizer; the state is
    ``InjectHyperparamsState(count, hyperparams={'learning_rate', 'b1', 'b2',
    'eps'}, inner_state=ScaleByAdamState(count, mu, nu))``.
    """
    import optax

    return optax.inject_hyperparams(scale_by_waffe2_adam)(
        learning_rate=lr, b1=beta1, b2=beta2, eps=eps
    )
