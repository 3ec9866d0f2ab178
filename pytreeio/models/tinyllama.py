"""Tiny Llama in Flax, with the semantics of the C++ model whose weights files
the ``tinyllama`` format reads.

The forward pass, for tokens ``t[0..T)``::

    h = tok_embedding[t] + pos_embedding[0..T)
    for each layer:
        a = LN1(h);  q, k, v = a @ Wq, a @ Wk, a @ Wv       # no biases
        heads are contiguous column slices of width D/H
        h = h + softmax(q k^T / sqrt(D/H) + causal mask) v @ Wo
        h = h + GELU_tanh(LN2(h) @ W1 + b1) @ W2 + b2
    logits = h @ output                                     # no final LayerNorm

LayerNorm uses eps 1e-5 and the biased variance.  Dropout is stored in the
file but the model never applies it.

The parameter tree mirrors the format's native tree, except that Flax names
the list of blocks ``layers_0``, ``layers_1``, ...::

    {'params': {'tok_embedding', 'pos_embedding', 'layers_0': {'wq', ..., 'ln1': {'scale',
     'bias'}, 'ln2': {...}}, ..., 'output'}}

so ``pytreeio.load(path, like=model_params)`` and ``pytreeio.save(path,
model_params, format="tinyllama", meta=config.to_meta())`` need no renaming.

jax and flax are imported here, never by ``import pytreeio``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "TinyLlama",
    "TinyLlamaConfig",
    "abstract_params",
    "forward",
    "generate_greedy",
    "init_params",
]

# Matmuls at full float32 precision: accelerators would otherwise use reduced
# precision (TF32) and the forward would no longer match the C++ model to 1e-5.
_PRECISION = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class TinyLlamaConfig:
    """The model's hyperparameters, as stored in a weights file's header."""

    d_model: int = 512
    n_layers: int = 6
    n_heads: int = 8
    ffn_hidden_dim: int = 2048
    max_seq_len: int = 1024
    vocab_size: int = 32000
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> TinyLlamaConfig:
        """The config of a ``tinyllama`` meta document (``pytreeio.inspect(path).meta``)."""
        return cls(**meta["config"])

    def to_meta(self) -> dict[str, Any]:
        """The meta document ``pytreeio.save(..., format="tinyllama", meta=...)`` takes."""
        return {"config": asdict(self)}


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, w, precision=_PRECISION)


class Block(nn.Module):
    """One pre-LayerNorm transformer block (attention without biases, GELU FFN)."""

    config: TinyLlamaConfig

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        cfg = self.config
        d, f, n_heads, hd = cfg.d_model, cfg.ffn_hidden_dim, cfg.n_heads, cfg.head_dim
        init = nn.initializers.normal(0.02)
        wq = self.param("wq", init, (d, d))
        wk = self.param("wk", init, (d, d))
        wv = self.param("wv", init, (d, d))
        wo = self.param("wo", init, (d, d))
        w1 = self.param("w1", init, (d, f))
        b1 = self.param("b1", nn.initializers.zeros, (f,))
        w2 = self.param("w2", init, (f, d))
        b2 = self.param("b2", nn.initializers.zeros, (d,))

        a = nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name="ln1")(h)
        *batch, t, _ = a.shape
        # Reshaping [.., T, D] to [.., T, H, hd] makes head i the columns i*hd..(i+1)*hd.
        q = _dot(a, wq).reshape(*batch, t, n_heads, hd)
        k = _dot(a, wk).reshape(*batch, t, n_heads, hd)
        v = _dot(a, wv).reshape(*batch, t, n_heads, hd)
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=_PRECISION) / np.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        ctx = jnp.einsum("...hqk,...khd->...qhd", probs, v, precision=_PRECISION)
        h = h + _dot(ctx.reshape(*batch, t, d), wo)

        m = nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name="ln2")(h)
        m = jax.nn.gelu(_dot(m, w1) + b1, approximate=True)
        return h + _dot(m, w2) + b2


class TinyLlama(nn.Module):
    """``TinyLlama(config).apply(params, tokens) -> logits``; tokens ``[T]`` or ``[B, T]``."""

    config: TinyLlamaConfig

    def setup(self) -> None:
        cfg = self.config
        init = nn.initializers.normal(0.02)
        self.tok_embedding = self.param("tok_embedding", init, (cfg.vocab_size, cfg.d_model))
        self.pos_embedding = self.param("pos_embedding", init, (cfg.max_seq_len, cfg.d_model))
        self.layers = [Block(cfg) for _ in range(cfg.n_layers)]
        self.output = self.param("output", init, (cfg.d_model, cfg.vocab_size))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[-1]
        if t > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {t} tokens exceeds max_seq_len {self.config.max_seq_len}"
            )
        h = jnp.take(self.tok_embedding, tokens, axis=0) + self.pos_embedding[:t]
        for block in self.layers:
            h = block(h)
        return _dot(h, self.output)


def init_params(config: TinyLlamaConfig, seed: int = 0) -> dict[str, Any]:
    """Freshly initialised variables ``{'params': ...}`` (N(0, 0.02) matrices, zero biases)."""
    return _jitted(config)[0](jax.random.PRNGKey(seed))


@lru_cache(maxsize=16)
def _jitted(config: TinyLlamaConfig) -> tuple[Any, Any]:
    # Compiled once per config: op-by-op dispatch would compile every small op separately.
    net = TinyLlama(config)
    tokens = jnp.zeros((1,), dtype=jnp.int32)
    return jax.jit(lambda key: dict(net.init(key, tokens))), jax.jit(net.apply)


def forward(variables: Any, config: TinyLlamaConfig, tokens: Any) -> jax.Array:
    """Logits ``[..., T, vocab]`` for tokens ``[T]`` or ``[B, T]`` (jit-compiled per config)."""
    logits: jax.Array = _jitted(config)[1](variables, jnp.asarray(tokens, dtype=jnp.int32))
    return logits


def abstract_params(config: TinyLlamaConfig) -> Any:
    """The variables' structure as ``jax.ShapeDtypeStruct`` leaves: a ``like`` for loading."""
    net = TinyLlama(config)
    tokens = jax.ShapeDtypeStruct((1,), jnp.int32)
    return jax.eval_shape(lambda key, t: dict(net.init(key, t)), jax.random.PRNGKey(0), tokens)


def generate_greedy(
    variables: Any, config: TinyLlamaConfig, prompt: Sequence[int], n_new: int
) -> list[int]:
    """``prompt`` followed by ``n_new`` greedily chosen tokens (argmax, lowest id on ties).

    The sequence is padded to its final length so that one compiled forward
    serves every step; causal attention keeps the padding from influencing
    earlier positions.
    """
    total = len(prompt) + n_new
    if not prompt or total > config.max_seq_len:
        raise ValueError(f"need 1 <= len(prompt) and len(prompt) + n_new <= {config.max_seq_len}")
    model = TinyLlama(config)

    @jax.jit
    def next_token(variables: Any, tokens: jax.Array, pos: jax.Array) -> jax.Array:
        logits: jax.Array = model.apply(variables, tokens)  # type: ignore[assignment]
        return jnp.argmax(logits[pos - 1]).astype(jnp.int32)

    tokens = np.zeros(total, dtype=np.int32)
    tokens[: len(prompt)] = prompt
    for pos in range(len(prompt), total):
        tokens[pos] = int(next_token(variables, jnp.asarray(tokens), jnp.int32(pos)))
    return [int(x) for x in tokens]
