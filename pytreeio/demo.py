"""``pytreeio demo``: train, checkpoint in every format, convert along a chain, resume.

A small Flax MLP (8 -> 32 -> 32 -> 1, ReLU) is trained with optax AdamW on
synthetic data for ``steps`` steps.  Then:

1. **Every format.**  The training state is saved in each format and loaded
   back with ``like=``.  msgpack, safetensors, netcl-checkpoint and bullet hold
   the whole state (parameters, Adam moments, step count): training resumes
   from the loaded state for ``steps`` more steps and must equal ``2 * steps``
   uninterrupted steps bit for bit.  netcl, netcl-params, DataCode and
   cl-waffe2 files hold the parameters (DataCode also the optimizer's
   hyperparameters, as a training stage): they must come back bit for bit.
   A small Tiny Llama goes through its weight file and must generate the
   same tokens.  Every time in the table is measured.
2. **A conversion chain** netcl -> DataCode -> cl-waffe2 -> bullet -> msgpack,
   each file compared with the first by `pytreeio.diff.diff` through
   the common model form: every parameter must be identical.
3. **Resuming from a foreign checkpoint**: training continues from the
   bullet checkpoint with optax and the loss keeps falling.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pytreeio import api

#: The MLP's layer list (activations included), for formats that store one.
LAYERS = ["Linear", "ReLU", "Linear", "ReLU", "Linear"]


@dataclass
class Row:
    format: str
    files: int
    nbytes: int
    save_ms: float
    load_ms: float
    ok: bool
    result: str


def _same(a: Any, b: Any) -> bool:
    """The same tree structure and bit-identical leaves."""
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


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return [p for p in path.rglob("*") if p.is_file()]
    siblings = [path.with_name(path.name + s) for s in (".npz",)] + [path.with_suffix(".json")]
    return [path] if path.is_file() else [p for p in siblings if p.is_file()]


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


class _Trainer:
    """The MLP, its data and a jitted AdamW step."""

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

        key_x, key_init = jax.random.split(jax.random.PRNGKey(0))
        self.x = jax.random.normal(key_x, (256, 8), jnp.float32)
        self.y = jnp.sin(self.x.sum(axis=1, keepdims=True))
        self.model = MLP()
        self.hyperparams = {"learning_rate": 3e-3, "weight_decay": 1e-4}
        self.tx = optax.adamw(**self.hyperparams)
        params = self.model.init(key_init, self.x)["params"]
        self.initial = {"params": params, "opt_state": self.tx.init(params), "step": 0}

        def loss_fn(params: Any) -> Any:
            pred: Any = self.model.apply({"params": params}, self.x)
            return jnp.mean((pred - self.y) ** 2)

        @jax.jit
        def step(params: Any, opt_state: Any) -> tuple[Any, Any, Any]:
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._step = step
        self.abstract = jax.eval_shape(lambda: self.initial)

    def train(self, state: dict[str, Any], n: int) -> tuple[dict[str, Any], list[float]]:
        params, opt_state = state["params"], state["opt_state"]
        losses = []
        for _ in range(n):
            params, opt_state, loss = self._step(params, opt_state)
            losses.append(float(loss))
        return {"params": params, "opt_state": opt_state, "step": int(state["step"]) + n}, losses


# --------------------------------------------------------------------------
# 1. every format
# --------------------------------------------------------------------------


def _state_row(fmt: str, path: Path, t: _Trainer, mid: Any, final: Any, steps: int) -> Row:
    """Save the whole training state, load it into the abstract state, train on: bit-exact?"""
    _, save_ms = _timed(lambda: api.save(path, mid, format=fmt))
    loaded, load_ms = _timed(lambda: api.load(path, like=t.abstract, format=fmt))
    resumed, _ = t.train(loaded, steps)
    ok = _same(resumed, final)
    files = _files(path)
    result = "resume bit-exact" if ok else "resume DIFFERS"
    return Row(fmt, len(files), sum(f.stat().st_size for f in files), save_ms, load_ms, ok, result)


def _params_row(
    fmt: str, path: Path, t: _Trainer, mid: Any, *, note: str = "", **options: Any
) -> Row:
    """Save the parameters (with the layer list where the format stores it), load them back."""
    _, save_ms = _timed(lambda: api.save(path, mid["params"], format=fmt, **options))
    like = t.abstract["params"]
    load_opts: dict[str, Any] = {"layers": LAYERS} if fmt in ("netcl-params", "waffe2") else {}
    loaded, load_ms = _timed(lambda: api.load(path, like=like, format=fmt, **load_opts))
    ok = _same(loaded, mid["params"])
    files = _files(path)
    result = ("params bit-exact" if ok else "params DIFFER") + (f"; {note}" if note else "")
    return Row(fmt, len(files), sum(f.stat().st_size for f in files), save_ms, load_ms, ok, result)


def _datacode_row(path: Path, t: _Trainer, mid: Any, steps: int) -> Row:
    import optax

    from pytreeio.formats.datacode import training as dc

    # DataCode records the optimizer's type and hyperparameters, read off an
    # inject_hyperparams state of the same optimizer
    described = optax.inject_hyperparams(optax.adamw)(**t.hyperparams).init(mid["params"])
    stage = dc.stage_record(described, mid["params"], epochs=steps, loss="mse", layers=LAYERS)
    meta = dc.with_stage({}, stage)
    row = _params_row("datacode", path, t, mid, layers=LAYERS, meta=meta)
    _, back = api.load_with_meta(path, format="datacode")
    lr = back["training"]["stages"][-1]["optimizer_params"]["lr"]
    row.result += f"; AdamW stage kept (lr {lr:g})"
    return row


def _tinyllama_row(out: Path) -> Row:
    from pytreeio.models import tinyllama as tl

    config = tl.TinyLlamaConfig(
        d_model=32, n_layers=2, n_heads=4, ffn_hidden_dim=64, max_seq_len=16, vocab_size=50
    )
    variables = tl.init_params(config, seed=0)
    before = tl.generate_greedy(variables, config, [1, 2, 3], 5)
    path = out / "tinyllama.bin"
    _, save_ms = _timed(
        lambda: api.save(path, variables, format="tinyllama", meta=config.to_meta())
    )
    loaded, load_ms = _timed(lambda: api.load(path, like=tl.abstract_params(config)))
    after = tl.generate_greedy(loaded, config, [1, 2, 3], 5)
    ok = after == before
    result = f"greedy tokens {after[3:]} {'match' if ok else 'DIFFER'}"
    return Row("tinyllama", 1, path.stat().st_size, save_ms, load_ms, ok, result)


def _every_format(out: Path, t: _Trainer, mid: Any, final: Any, steps: int) -> list[Row]:
    rows = [
        _state_row("msgpack", out / "state.msgpack", t, mid, final, steps),
        _state_row("safetensors", out / "state.safetensors", t, mid, final, steps),
        _state_row("netcl-checkpoint", out / "train_ckpt", t, mid, final, steps),
        _state_row("bullet", out / "bullet-ckpt", t, mid, final, steps),
        _params_row("netcl", out / "model.netcl", t, mid, layers=LAYERS),
        _params_row("netcl-params", out / "params.npz", t, mid),
        _datacode_row(out / "model.nn", t, mid, steps),
        _params_row("waffe2", out / "model.wf2model", t, mid),
        _tinyllama_row(out),
    ]
    return rows


# --------------------------------------------------------------------------
# 2. the conversion chain, 3. resuming from a foreign checkpoint
# --------------------------------------------------------------------------

CHAIN = [
    ("netcl", "chain-0.netcl"),
    ("datacode", "chain-1.nn"),
    ("waffe2", "chain-2.wf2model"),
    ("bullet", "chain-3-bullet"),
    ("msgpack", "chain-4.msgpack"),
]


def _chain(out: Path, t: _Trainer, mid: Any) -> list[tuple[str, float, str, bool]]:
    from pytreeio.diff import diff

    first = out / CHAIN[0][1]
    api.save(first, mid["params"], format=CHAIN[0][0], layers=LAYERS)
    rows = []
    for (src_fmt, src), (dst_fmt, dst) in itertools.pairwise(CHAIN):
        t0 = time.perf_counter()
        api.convert(out / src, out / dst, to=dst_fmt, from_=src_fmt)
        ms = (time.perf_counter() - t0) * 1e3
        report = diff(first, out / dst, format_a=CHAIN[0][0], format_b=dst_fmt, through_model=True)
        rows.append((f"{src_fmt} -> {dst_fmt}", ms, report.verdict, report.ok))
    back = api.load(out / CHAIN[-1][1], like={"params": t.abstract["params"]})
    rows.append(
        (
            "msgpack -> Flax params",
            0.0,
            "identical" if _same(back["params"], mid["params"]) else "different",
            _same(back["params"], mid["params"]),
        )
    )
    return rows


def _resume_foreign(out: Path, t: _Trainer, mid: Any, mid_losses: list[float], steps: int) -> bool:
    loaded = api.load(out / "bullet-ckpt", like=t.abstract, format="bullet")
    _, losses = t.train(loaded, steps)
    print(f"\n3. Resuming from the bullet checkpoint (step {mid['step']}) with optax AdamW:")
    shown = sorted({*range(0, steps, max(1, steps // 4)), steps - 1})
    trail = " -> ".join(f"{losses[i]:.6f} (step {mid['step'] + i + 1})" for i in shown)
    print(f"   loss {mid_losses[-1]:.6f} (step {mid['step']}) -> {trail}")
    return losses[-1] < mid_losses[-1]


def run_demo(directory: str | None = None, *, steps: int = 3) -> int:
    """Run the demo; returns a process exit code (0 when every check holds).

    With ``directory`` the files stay there; otherwise they go to a temporary
    directory that is removed at the end.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="pytreeio-demo-") as tmp:
            return _run(Path(tmp), steps, keep=False)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    return _run(out, steps, keep=True)


def _run(out: Path, steps: int, *, keep: bool) -> int:
    print(f"pytreeio demo: a Flax MLP trained with optax AdamW for {steps} steps")
    t = _Trainer()
    mid, mid_losses = t.train(t.initial, steps)
    final, _ = t.train(mid, steps)
    print(f"  loss {mid_losses[0]:.6f} -> {mid_losses[-1]:.6f} (step {steps})")

    rows = _every_format(out, t, mid, final, steps)
    print(
        f"\n1. Every format (resume: {steps} more steps == {2 * steps} uninterrupted, bit for bit)"
    )
    w = max(len(r.format) for r in rows)
    print(f"   {'format':<{w}}  {'files':>5}  {'bytes':>9}  {'save ms':>8}  {'load ms':>8}  result")
    for r in rows:
        print(
            f"   {r.format:<{w}}  {r.files:>5}  {r.nbytes:>9,d}  {r.save_ms:>8.1f}  "
            f"{r.load_ms:>8.1f}  {r.result}"
        )

    chain = _chain(out, t, mid)
    print("\n2. Conversion chain, each file compared with the netcl original (pytreeio diff)")
    for step, ms, verdict, _ok in chain:
        timing = f"{ms:8.1f} ms" if ms else " " * 11
        print(f"   {step:<24} {timing}  {verdict}")

    continued = _resume_foreign(out, t, mid, mid_losses, steps)

    failed = [r.format for r in rows if not r.ok] + [s for s, _, _, ok in chain if not ok]
    if not continued:
        failed.append("resume from bullet (loss did not fall)")
    if keep:
        print(f"\nFiles kept in {out}")
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
        return 1
    print(
        f"\nOK: {len(rows)} formats written and read back, {len(chain)} conversions identical, "
        "training resumed from a foreign checkpoint."
    )
    return 0
