"""Evaluate an NNUE-style network from a bullet checkpoint: in float from raw.bin, in integers from quantised.bin.

    python examples/bullet_nnue.py [--dir DIR] [--positions N]

The network is bullet's classic shape with output buckets: 768 board features
-> 64 (one feature transformer for both perspectives) -> SCReLU -> 2*64 -> 1
output per bucket, 8 buckets chosen by the number of pieces.  It is saved with
``pytreeio`` as a bullet checkpoint (QA=255, QB=64, every entry i16 rounded,
the bucketed layer transposed so each bucket's weights are contiguous), then
read back the way an engine reads it: raw.bin and quantised.bin parsed with
plain numpy at the offsets the saved-format list implies.  The float and the
integer evaluation agree within the bound the quantisation errors (measured by
``check_quantised=True``) give, position by position.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import pytreeio as ptio
from pytreeio.formats.bullet import checkpoint as bullet

INPUTS, HIDDEN, BUCKETS = 768, 64, 8
QA, QB, SCALE = 255, 64, 400  # SCALE: output units -> centipawns
LAYOUT = bullet.output_bucket_layout([QA, QB])
SHAPES = {
    "l0w": (INPUTS, HIDDEN),
    "l0b": (HIDDEN,),
    "l1w": (2 * HIDDEN, BUCKETS),
    "l1b": (BUCKETS,),
}


def make_network(seed: int) -> dict[str, np.ndarray]:
    """Weights in bullet's (in, out) orientation; small enough that every value quantises."""
    rng = np.random.default_rng(seed)
    return {
        "l0w": rng.uniform(-0.15, 0.15, SHAPES["l0w"]).astype(np.float32),
        "l0b": rng.uniform(0.0, 0.5, SHAPES["l0b"]).astype(np.float32),
        "l1w": rng.uniform(-1.0, 1.0, SHAPES["l1w"]).astype(np.float32),
        "l1b": rng.uniform(-0.3, 0.3, SHAPES["l1b"]).astype(np.float32),
    }


def random_position(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """Active features from both sides' perspectives, and the output bucket."""
    n = int(rng.integers(2, 33))
    squares = rng.choice(64, size=n, replace=False)
    colours = rng.integers(0, 2, size=n)
    pieces = rng.integers(0, 6, size=n)
    us = colours * 384 + pieces * 64 + squares
    them = (1 - colours) * 384 + pieces * 64 + (squares ^ 56)  # the board seen from the other side
    return us, them, (n - 2) // 4


# --------------------------------------------------------------------------
# reading the files as an engine does
# --------------------------------------------------------------------------


def entry_offsets() -> dict[str, tuple[int, int]]:
    """(first element, element count) of every entry, in saved-format order."""
    out, pos = {}, 0
    for entry in LAYOUT:
        n = math.prod(SHAPES[entry["id"]])
        out[entry["id"]] = (pos, n)
        pos += n
    return out


def read_raw(path: Path) -> dict[str, np.ndarray]:
    values = np.fromfile(path / "raw.bin", dtype="<f4")
    return {k: values[a : a + n].reshape(SHAPES[k]) for k, (a, n) in entry_offsets().items()}


def read_quantised(path: Path) -> dict[str, np.ndarray]:
    values = np.fromfile(path / "quantised.bin", dtype="<i2")  # every entry is i16; padding after
    out = {k: values[a : a + n] for k, (a, n) in entry_offsets().items()}
    return {
        "l0w": out["l0w"].reshape(INPUTS, HIDDEN),  # column-major 64x768: feature rows contiguous
        "l0b": out["l0b"],
        "l1w": out["l1w"].reshape(BUCKETS, 2 * HIDDEN),  # transposed: bucket b's weights contiguous
        "l1b": out["l1b"],
    }


# --------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------


def screlu(x: np.ndarray) -> np.ndarray:
    return np.clip(x, 0.0, 1.0) ** 2


def eval_float(net: dict[str, np.ndarray], us: np.ndarray, them: np.ndarray, bucket: int) -> float:
    acc_us = net["l0b"].astype(np.float64) + net["l0w"][us].astype(np.float64).sum(0)
    acc_them = net["l0b"].astype(np.float64) + net["l0w"][them].astype(np.float64).sum(0)
    hidden = np.concatenate([screlu(acc_us), screlu(acc_them)])
    return float(hidden @ net["l1w"][:, bucket].astype(np.float64) + net["l1b"][bucket])


def eval_int(q: dict[str, np.ndarray], us: np.ndarray, them: np.ndarray, bucket: int) -> int:
    """The integer pipeline: accumulators in units of QA, SCReLU in QA^2, output in QA*QB."""
    acc_us = q["l0b"].astype(np.int32) + q["l0w"][us].astype(np.int32).sum(0)
    acc_them = q["l0b"].astype(np.int32) + q["l0w"][them].astype(np.int32).sum(0)
    act = np.concatenate([np.clip(acc_us, 0, QA), np.clip(acc_them, 0, QA)]).astype(np.int64)
    out = int((act * act * q["l1w"][bucket].astype(np.int64)).sum())  # QA^2 * QB
    out = out // QA if out >= 0 else -(-out // QA)  # division truncating towards zero, as in C/Rust
    return out + int(q["l1b"][bucket])  # QA * QB


def error_bound(
    raw: dict[str, np.ndarray],
    q: dict[str, np.ndarray],
    errors: dict[str, float],
    us: np.ndarray,
    them: np.ndarray,
    bucket: int,
) -> float:
    """How far the float result may lie from the integer one, from the per-tensor errors alone.

    Each float accumulator lies within e(l0b) + k*e(l0w) of the integer one
    (k active features), so its SCReLU lies in an interval around the integer
    activation; the output adds |w| times that spread, the activations times
    e(l1w), e(l1b), and one unit of the truncating division by QA.
    """
    spread = []
    for features in (us, them):
        acc = (q["l0b"].astype(np.int32) + q["l0w"][features].astype(np.int32).sum(0)) / QA
        d = errors["l0b"] + len(features) * errors["l0w"]
        h = screlu(acc)
        spread.append(np.maximum(screlu(acc + d) - h, h - screlu(acc - d)))
        spread.append(h)
    d_hidden = np.concatenate(spread[0::2])
    hidden_q = np.concatenate(spread[1::2])
    weights = np.abs(raw["l1w"][:, bucket].astype(np.float64))
    return float(
        d_hidden @ weights + hidden_q.sum() * errors["l1w"] + errors["l1b"] + 1 / (QA * QB)
    )


def run(directory: Path, positions: int, seed: int = 0) -> dict[str, Any]:
    checkpoint = directory / "nnue-10"
    ptio.save(
        checkpoint, {"weights": make_network(seed)}, format="bullet", meta={"saved_format": LAYOUT}
    )
    files = sorted(
        p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()
    )
    _, meta = ptio.load_with_meta(
        checkpoint, format="bullet", saved_format=LAYOUT, check_quantised=True
    )
    errors = meta["quantisation_error"]
    raw, q = read_raw(checkpoint), read_quantised(checkpoint)
    rng = np.random.default_rng(seed + 1)
    worst_diff = worst_bound = 0.0
    agree = True
    for _ in range(positions):
        us, them, bucket = random_position(rng)
        f = eval_float(raw, us, them, bucket)
        i = eval_int(q, us, them, bucket) / (QA * QB)
        bound = error_bound(raw, q, errors, us, them, bucket)
        agree &= abs(f - i) <= bound
        worst_diff = max(worst_diff, abs(f - i))
        worst_bound = max(worst_bound, bound)
    return {
        "files": files,
        "quantisation_error": errors,
        "max_diff_cp": worst_diff * SCALE,
        "max_bound_cp": worst_bound * SCALE,
        "agree": bool(agree),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", default=None, help="where to write the checkpoint (default: a temporary directory)"
    )
    parser.add_argument("--positions", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(args.dir or tmp), args.positions)
    print("checkpoint files:", ", ".join(result["files"]))
    for k, e in result["quantisation_error"].items():
        print(f"  {k}: largest quantisation error {e:.3g}")
    print(
        f"float (raw.bin) vs integer (quantised.bin) over {args.positions} positions: "
        f"max |diff| = {result['max_diff_cp']:.3f} cp, bound {result['max_bound_cp']:.3f} cp"
    )
    print(f"agree within quantisation error = {result['agree']}")


if __name__ == "__main__":
    main()
