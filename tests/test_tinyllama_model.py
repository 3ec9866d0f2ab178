"""The Flax Tiny Llama: its forward against plain numpy, generation, load via ``like``, save back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CONFORMANCE

pytest.importorskip("flax")

import jax

import pytreeio as ptio
from pytreeio.formats import tinyllama as tl
from pytreeio.models import tinyllama as model

WEIGHTS = CONFORMANCE / "tinyllama" / "weights.bin"
PROMPT = [1, 5, 7, 42, 99]


@pytest.fixture(scope="module")
def weights() -> bytes:
    if not WEIGHTS.exists():
        pytest.skip(f"conformance file missing: {WEIGHTS}")
    return WEIGHTS.read_bytes()


@pytest.fixture(scope="module")
def loaded(weights: bytes) -> tuple[dict[str, Any], model.TinyLlamaConfig, Any]:
    native, meta = tl.decode(weights)
    config = model.TinyLlamaConfig.from_meta(meta)
    variables = tl.restore(native, meta, model.abstract_params(config))
    return native, config, variables


def numpy_forward(native: dict[str, Any], n_heads: int, tokens: list[int]) -> np.ndarray:
    """The model's equations, written out in float64 numpy, position by position."""
    p = {k: v for k, v in native.items()}

    def f64(a: Any) -> np.ndarray:
        return np.asarray(a, dtype=np.float64)

    def layer_norm(x: np.ndarray, ln: dict[str, Any]) -> np.ndarray:
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * f64(ln["scale"]) + f64(ln["bias"])

    def gelu(x: np.ndarray) -> np.ndarray:
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    t = len(tokens)
    h = f64(p["tok_embedding"])[tokens] + f64(p["pos_embedding"])[:t]
    d = h.shape[1]
    hd = d // n_heads
    for layer in p["layers"]:
        a = layer_norm(h, layer["ln1"])
        q, k, v = a @ f64(layer["wq"]), a @ f64(layer["wk"]), a @ f64(layer["wv"])
        ctx = np.zeros_like(h)
        for head in range(n_heads):
            cols = slice(head * hd, (head + 1) * hd)
            for i in range(t):
                scores = np.array([q[i, cols] @ k[j, cols] for j in range(i + 1)]) / np.sqrt(hd)
                w = np.exp(scores - scores.max())
                w /= w.sum()
                ctx[i, cols] = sum(w[j] * v[j, cols] for j in range(i + 1))
        h = h + ctx @ f64(layer["wo"])
        m = layer_norm(h, layer["ln2"])
        h = h + gelu(m @ f64(layer["w1"]) + f64(layer["b1"])) @ f64(layer["w2"]) + f64(layer["b2"])
    return h @ f64(p["output"])


def test_forward_matches_numpy(loaded: tuple[Any, model.TinyLlamaConfig, Any]) -> None:
    native, config, variables = loaded
    want = numpy_forward(native, config.n_heads, PROMPT)
    got = model.forward(variables, config, PROMPT)
    assert got.shape == (len(PROMPT), config.vocab_size)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=1e-5)
    # batched input gives the same rows
    got_b = np.asarray(model.forward(variables, config, [PROMPT, PROMPT[::-1]]), np.float64)
    np.testing.assert_allclose(got_b[0], want, rtol=0, atol=1e-5)
    want_rev = numpy_forward(native, config.n_heads, PROMPT[::-1])
    np.testing.assert_allclose(got_b[1], want_rev, rtol=0, atol=1e-5)


def test_greedy_generation_is_deterministic(loaded: tuple[Any, model.TinyLlamaConfig, Any]) -> None:
    native, config, variables = loaded
    first = model.generate_greedy(variables, config, PROMPT, 6)
    assert first[: len(PROMPT)] == PROMPT and len(first) == len(PROMPT) + 6
    assert all(0 <= tok < config.vocab_size for tok in first)
    assert model.generate_greedy(variables, config, PROMPT, 6) == first
    # the same tokens as argmax over the numpy forward, step by step
    seq = list(PROMPT)
    for _ in range(3):
        seq.append(int(np.argmax(numpy_forward(native, config.n_heads, seq)[-1])))
    assert first[: len(seq)] == seq


def test_params_load_via_like_and_save_back(weights: bytes, tmp_path: Path) -> None:
    meta = ptio.inspect(WEIGHTS).meta
    config = model.TinyLlamaConfig.from_meta(meta)
    assert config.d_model == 64 and config.n_heads == 2
    like = model.abstract_params(config)
    variables = ptio.load(WEIGHTS, like=like)
    assert set(variables) == {"params"}
    assert isinstance(variables["params"]["layers_1"]["wq"], jax.Array)
    out = tmp_path / "params.bin"
    ptio.save(out, variables, format="tinyllama", meta=config.to_meta())
    assert out.read_bytes() == weights
    # a concrete (not abstract) like works too
    concrete = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), like)
    again = ptio.load(out, like=concrete)
    assert isinstance(again["params"]["output"], np.ndarray)
    np.testing.assert_array_equal(again["params"]["output"], variables["params"]["output"])


def test_like_with_wrong_config_is_a_mismatch() -> None:
    config = model.TinyLlamaConfig(64, 2, 2, 128, 128, 101, 0.1)  # vocabulary differs
    with pytest.raises(ptio.MismatchError) as exc:
        ptio.load(WEIGHTS, like=model.abstract_params(config))
    assert exc.value.key_path in ("params/tok_embedding", "params/output")


def test_fresh_model_round_trips() -> None:
    config = model.TinyLlamaConfig(8, 1, 4, 16, 6, 11, 0.0)
    variables = model.init_params(config, seed=1)
    data = tl.encode(variables, meta=config.to_meta()).tobytes()
    native, meta = tl.decode(data)
    assert model.TinyLlamaConfig.from_meta(meta) == config
    back = tl.restore(native, meta, model.abstract_params(config))
    for (ka, a), (kb, b) in zip(
        sorted(ptio.flatten(variables).items()), sorted(ptio.flatten(back).items()), strict=True
    ):
        assert ka == kb
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
