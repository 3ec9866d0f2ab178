"""``pytreeio demo``: train, checkpoint in every format, convert, resume exactly.

A small Flax MLP is trained with optax AdamW on synthetic data for ``steps``
steps.  The training state is checkpointed in each format that can hold it
(msgpack, safetensors, netcl-checkpoint), converted between formats, loaded
back with ``like=`` and trained ``steps`` more; the result must equal
``2 * steps`` uninterrupted steps bit for bit.  The params alone go to a
netcl model file, and a small Tiny Llama goes through its weight file and
must generate the same tokens afterwards.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import api


@dataclass
class Row:
    format: str
    path: str
    nbytes: int
    save_ms: float
    load_ms: float
    exact: bool | None
    note: str = ""


def _leaves_equal(a: Any, b: Any) -> bool:
    import jax

    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if str(ta) != str(tb):
        return False
    return all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).shape == np.asarray(y).shape
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


class _Trainer:
    def __init__(self) -> None:
        import flax.linen as nn
        import jax
        import jax.numpy as jnp
        import optax

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x: Any) -> Any:
                x = nn.relu(nn.Dense(32)(x))
                x = nn.relu(nn.Dense(32)(x))
                return nn.Dense(1)(x)

        self.jax = jax
        key_x, key_init = jax.random.split(jax.random.PRNGKey(0))
        self.x = jax.random.normal(key_x, (256, 8), jnp.float32)
        self.y = jnp.sin(self.x.sum(axis=1, keepdims=True))
        self.model = MLP()
        self.tx = optax.adamw(3e-3, weight_decay=1e-4)
        params = self.model.init(key_init, self.x)
        self.initial = {"params": params, "opt_state": self.tx.init(params), "step": 0}

        def loss_fn(params: Any) -> Any:
            pred: Any = self.model.apply(params, self.x)
            return jnp.mean((pred - self.y) ** 2)

        @jax.jit
        def step(params: Any, opt_state: Any) -> tuple[Any, Any, Any]:
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._step = step

    def train(self, state: dict[str, Any], n: int) -> tuple[dict[str, Any], float]:
        params, opt_state = state["params"], state["opt_state"]
        loss = float("nan")
        for _ in range(n):
            params, opt_state, loss_arr = self._step(params, opt_state)
            loss = float(loss_arr)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + n}, loss


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def _generic_section(fmt: str, suffix: str) -> Callable[..., list[Row]]:
    def section(
        trainer: _Trainer, mid: dict[str, Any], final: dict[str, Any], out: Path, steps: int
    ) -> list[Row]:
        path = out / f"state{suffix}"
        _, save_ms = _timed(lambda: api.save(path, mid, format=fmt))
        restored, load_ms = _timed(lambda: api.load(path, like=trainer.initial))
        resumed, _ = trainer.train(restored, steps)
        return [Row(fmt, str(path), _size(path), save_ms, load_ms, _leaves_equal(resumed, final))]

    return section


def _convert_section(
    trainer: _Trainer, mid: dict[str, Any], final: dict[str, Any], out: Path, steps: int
) -> list[Row]:
    src = out / "state.msgpack"
    dst = out / "converted.safetensors"
    _, ms = _timed(lambda: api.convert(src, dst, to="safetensors"))
    restored = api.load(dst, like=trainer.initial)
    resumed, _ = trainer.train(restored, steps)
    return [
        Row(
            "msgpack->safetensors",
            str(dst),
            _size(dst),
            ms,
            0.0,
            _leaves_equal(resumed, final),
            "convert",
        )
    ]


_MLP_LAYERS = [{"type": t} for t in ("Linear", "ReLU", "Linear", "ReLU", "Linear")]


def _netcl_section(
    trainer: _Trainer, mid: dict[str, Any], final: dict[str, Any], out: Path, steps: int
) -> list[Row]:
    rows = []
    # netcl model file: the Flax params as a netcl Sequential (layer config given, sizes inferred)
    model = out / "model.netcl"
    _, save_ms = _timed(
        lambda: api.save(model, mid["params"], format="netcl", meta={"config": _MLP_LAYERS})
    )
    params, load_ms = _timed(lambda: api.load(model, like=trainer.initial["params"]))
    same = _leaves_equal(params, mid["params"])
    rows.append(Row("netcl", str(model), _size(model), save_ms, load_ms, same, "params round trip"))
    # netcl training checkpoint: the train state as is; AdamW's moments become netcl's
    # optim_state JSON and its count netcl's t, through the common model form
    ckpt = out / "train_ckpt"
    _, save_ms = _timed(lambda: api.save(ckpt, mid, format="netcl-checkpoint"))
    state, load_ms = _timed(lambda: api.load(ckpt, like=trainer.initial, format="netcl-checkpoint"))
    resumed, _ = trainer.train(state, steps)
    files = [out / "train_ckpt.npz", out / "train_ckpt.json"]
    size = sum(f.stat().st_size for f in files)
    rows.append(
        Row(
            "netcl-checkpoint", str(files[0]), size, save_ms, load_ms, _leaves_equal(resumed, final)
        )
    )
    return rows


def _tinyllama_section(
    trainer: _Trainer, mid: dict[str, Any], final: dict[str, Any], out: Path, steps: int
) -> list[Row]:
    from .models import tinyllama as tl

    config = tl.TinyLlamaConfig(
        d_model=32, n_layers=2, n_heads=4, ffn_hidden_dim=64, max_seq_len=16, vocab_size=50
    )
    variables = tl.init_params(config, seed=1)
    before = tl.generate_greedy(variables, config, [1, 2, 3], 5)
    path = out / "weights.bin"
    _, save_ms = _timed(
        lambda: api.save(path, variables, format="tinyllama", meta=config.to_meta())
    )
    like = tl.abstract_params(config)
    loaded, load_ms = _timed(lambda: api.load(path, like=like))
    after = tl.generate_greedy(loaded, config, [1, 2, 3], 5)
    note = f"greedy {after[3:]} {'matches' if after == before else 'DIFFERS'}"
    return [Row("tinyllama", str(path), _size(path), save_ms, load_ms, after == before, note)]


SECTIONS: list[tuple[str, Callable[..., list[Row]]]] = [
    ("msgpack", _generic_section("msgpack", ".msgpack")),
    ("safetensors", _generic_section("safetensors", ".safetensors")),
    ("msgpack", _convert_section),
    ("netcl-checkpoint", _netcl_section),
    ("tinyllama", _tinyllama_section),
]


def run_demo(directory: str | None = None, *, steps: int = 20) -> int:
    """Run the demo; returns a process exit code (0 when every resume is exact)."""
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="pytreeio-demo-") as tmp:
            return _run(Path(tmp), steps)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    return _run(out, steps)


def _run(out: Path, steps: int) -> int:
    print(
        f"pytreeio demo: training a Flax MLP with optax AdamW ({steps} + {steps} steps), checkpoints in {out}"
    )
    trainer = _Trainer()
    mid, loss_mid = trainer.train(trainer.initial, steps)
    final, loss_final = trainer.train(mid, steps)
    print(f"  loss after {steps} steps: {loss_mid:.6f}; after {2 * steps}: {loss_final:.6f}")
    available = set(api.formats())
    rows: list[Row] = []
    for needed, section in SECTIONS:
        if needed in available:
            rows.extend(section(trainer, mid, final, out, steps))
    w = max(len(r.format) for r in rows)
    print(f"\n  {'format':<{w}}  {'bytes':>10}  {'save ms':>8}  {'load ms':>8}  result")
    for r in rows:
        verdict = {True: "bit-exact", False: "DIFFERS", None: "-"}[r.exact]
        print(
            f"  {r.format:<{w}}  {r.nbytes:>10,d}  {r.save_ms:>8.2f}  {r.load_ms:>8.2f}  {verdict}  {r.note}"
        )
    bad = [r.format for r in rows if r.exact is False]
    if bad:
        print(f"\nFAILED: not bit-exact for {', '.join(bad)}")
        return 1
    print(f"\nOK: {len(rows)} checkpoints written, loaded, converted and resumed bit-exactly.")
    return 0
