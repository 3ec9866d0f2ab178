"""Compare two checkpoints, of the same format or of any two formats.

`diff` loads both checkpoints and compares them entry by entry (one
pair of arrays at a time, in chunks: nothing is concatenated), reporting per
entry whether it is missing on either side, whether shapes or dtypes differ,
how many elements differ, and the largest absolute and relative difference.

**What is compared.**  Checkpoints of one format, or where one is generic
(``msgpack``, ``safetensors``), are compared as native trees keyed by their
flattened key paths (between two formats, ``[0]`` and ``'0'`` are one key:
msgpack stores lists as ``'0', '1'`` maps).  Checkpoints of two different
*model* formats name and orient their arrays differently, so they are
compared through the common model form (DESIGN.md "Models"): the layers'
arrays (Flax orientation) as ``layers[0].kernel``, the optimizer slots as
``opt.mu[0]`` (by parameter position), the step count as ``opt.count``.  A
generic checkpoint holding a Flax tree compares with a model format the same
way (with the other side's layer list), and a safetensors file carrying a
model format's native tree (what `pytreeio.convert` writes) compares as
that format.  ``through_model=True``/``False`` forces either way.

Activations are not stored by every format (bullet and netcl-checkpoint keep
none), so when the layer lists differ only there, the arrays are paired by
parameter layer.  That, and differing optimizer kinds, hyperparameters and
meta, are notes: notes do not change the verdict.

**Verdict.**  ``identical``: every entry on both sides, same shape, same
dtype, same bytes (NaN payloads and signed zeros included).  ``equal within
tolerance``: a tolerance was given (``atol``/``rtol`` > 0), and every entry
has the same shape and dtype and every element satisfies
``|a - b| <= atol + rtol * max(|a|, |b|)`` (symmetric), NaN matching NaN.
``different``: anything else.  With the default zero tolerances the
comparison is of bits: an entry that differs only in a NaN payload or the
sign of a zero is *different* (its maximum difference is 0 and the report
says why).

Differences are computed in float64 (complex128 for complex entries), so for
integers beyond 2**53 they are approximate; which elements differ is always
decided on the bytes.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from itertools import zip_longest
from typing import Any

import numpy as np

from pytreeio import api, io
from pytreeio.core.calls import keywords_explained
from pytreeio.core.errors import MismatchError, PytreeioError
from pytreeio.core.records import Format
from pytreeio.core.tree import iter_leaves, key_string
from pytreeio.engine.dispatch import carried
from pytreeio.formats import registry
from pytreeio.model.form import Model, is_flax_tree, layer_list

__all__ = ["diff", "diff_trees", "compare_leaves", "DiffReport", "EntryDiff", "STATUSES"]

PathLike = str | os.PathLike[str]

#: Entry statuses, in the order reports count them.
STATUSES = (
    "identical",
    "within tolerance",
    "values differ",
    "dtype differs",
    "shape differs",
    "only in A",
    "only in B",
)

#: Elements compared at a time (bounds the temporaries of one comparison).
CHUNK = 1 << 20


# --- the report ---


@dataclass(frozen=True)
class EntryDiff:
    """How one entry (array or scalar) compares.

    Attributes:
      key: the entry's key (a flattened key path, or ``layers[0].kernel``-style).
      status: one of `STATUSES`.
      shape_a, shape_b, dtype_a, dtype_b: each side's (None when absent).
      size: elements compared (0 when shapes differ or a side is missing).
      n_different: elements whose bytes differ (between dtypes: whose values differ).
      n_exceeding: elements outside the tolerance (with zero tolerance: whose values differ).
      max_abs, max_rel: largest ``|a - b|`` and ``|a - b| / max(|a|, |b|)`` (None:
        nothing numeric compared).
      nan_payloads, nan_mismatches, signed_zeros: elements NaN on both sides with
        different bytes, NaN on one side only, ``0.0`` against ``-0.0``.
    """

    key: str
    status: str
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    size: int = 0
    n_different: int = 0
    n_exceeding: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    nan_payloads: int = 0
    nan_mismatches: int = 0
    signed_zeros: int = 0

    @property
    def identical(self) -> bool:
        return self.status == "identical"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for k in ("shape_a", "shape_b"):
            out[k] = list(out[k]) if out[k] is not None else None
        out["max_abs"], out["max_rel"] = _json_float(self.max_abs), _json_float(self.max_rel)
        return out

    def line(self) -> str:
        """One line describing the entry (for the command's output)."""
        a = _describe(self.dtype_a, self.shape_a)
        b = _describe(self.dtype_b, self.shape_b)
        if self.status in ("only in A", "only in B"):
            return f"{self.key}: {self.status} ({a if self.status == 'only in A' else b})"
        both = f"{a} vs {b}" if self.status in ("shape differs", "dtype differs") else a
        parts = [f"{self.key}: {self.status} ({both})"]
        if self.status not in ("identical", "shape differs"):
            parts.append(f"{self.n_different:,d} of {self.size:,d} elements differ")
            if self.max_abs is not None:
                parts.append(f"max abs {_fmt(self.max_abs)}, max rel {_fmt(self.max_rel)}")
            why = [
                f"{n:,d} {what}"
                for n, what in (
                    (self.nan_payloads, "NaN payloads"),
                    (self.nan_mismatches, "NaN vs number"),
                    (self.signed_zeros, "signed zeros"),
                )
                if n
            ]
            if why:
                parts.append(", ".join(why))
        return "; ".join(parts)


@dataclass(frozen=True)
class DiffReport:
    """The result of `diff`.

    Attributes:
      a, b: the checkpoints compared (paths, or labels for `diff_trees`).
      format_a, format_b: their formats.
      mode: ``"native"`` (native trees by key path) or ``"model"`` (the common model form).
      atol, rtol: the tolerances.
      entries: every entry, A's order first, then the entries only B has.
      notes: differences that are not arrays (layer lists, optimizer kinds,
        hyperparameters, meta) and what could not be compared; they do not
        change the verdict.
    """

    a: str
    b: str
    format_a: str
    format_b: str
    mode: str
    atol: float
    rtol: float
    entries: tuple[EntryDiff, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def counts(self) -> dict[str, int]:
        """Entries per status (every status present, zeros included)."""
        return dict.fromkeys(STATUSES, 0) | Counter(e.status for e in self.entries)

    @property
    def verdict(self) -> str:
        """``identical``, ``equal within tolerance`` or ``different``."""
        counts = self.counts
        if counts["identical"] == len(self.entries):
            return "identical"
        if counts["identical"] + counts["within tolerance"] == len(self.entries):
            return "equal within tolerance"
        return "different"

    @property
    def ok(self) -> bool:
        """True when identical, or equal within the tolerance given (the command's exit 0)."""
        return self.verdict != "different"

    def summary(self) -> str:
        """The one-line verdict with counts."""
        counts = self.counts
        n = len(self.entries)
        verdict = self.verdict
        if verdict == "identical":
            return f"identical: {n:,d} {'entry' if n == 1 else 'entries'}"
        if verdict == "equal within tolerance":
            return (
                f"equal within tolerance (atol={self.atol:g}, rtol={self.rtol:g}): "
                f"{counts['within tolerance']:,d} of {n:,d} entries differ within it"
            )
        bad = n - counts["identical"] - counts["within tolerance"]
        detail = ", ".join(
            f"{counts[s]:,d} {s}"
            for s in STATUSES
            if s not in ("identical", "within tolerance") and counts[s]
        )
        return f"different: {bad:,d} of {n:,d} entries ({detail})"

    def to_json(self) -> dict[str, Any]:
        head = ("a", "b", "format_a", "format_b", "mode", "atol", "rtol")
        return {
            **{k: getattr(self, k) for k in head},
            "verdict": self.verdict,
            "ok": self.ok,
            "summary": self.summary(),
            "counts": self.counts,
            "entries": [e.to_json() for e in self.entries],
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        return self.text()

    def text(self, *, every_entry: bool = False) -> str:
        """The report as the command prints it (identical entries only ``every_entry``)."""
        lines = [f"A: {self.a} ({self.format_a})", f"B: {self.b} ({self.format_b})"]
        lines += [f"  {e.line()}" for e in self.entries if every_entry or not e.identical]
        lines += [f"note: {n}" for n in self.notes]
        lines.append(self.summary())
        return "\n".join(lines)


def _json_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _describe(dtype: str | None, shape: tuple[int, ...] | None) -> str:
    return "absent" if dtype is None else f"{dtype}{list(shape) if shape is not None else ''}"


# --- comparing one pair of leaves ---


def _as_array(leaf: Any) -> np.ndarray | None:
    """The leaf as a numpy array (None for leaves that are not numbers or arrays)."""
    if isinstance(leaf, str | bytes) or not (
        hasattr(leaf, "__array__") or isinstance(leaf, int | float | complex | np.generic)
    ):
        return None
    try:
        return np.asarray(leaf)
    except Exception:
        return None


def _leaf_desc(leaf: Any) -> tuple[tuple[int, ...] | None, str]:
    arr = _as_array(leaf)
    if arr is None:
        return None, type(leaf).__name__
    return tuple(int(d) for d in arr.shape), arr.dtype.name


def _chunks(a: np.ndarray, b: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Matching flat chunks of two same-shape arrays, without copying either as a whole."""
    if a.flags.c_contiguous and b.flags.c_contiguous:
        a, b = a.reshape(-1), b.reshape(-1)
    row = math.prod(a.shape[1:])
    if row > CHUNK:  # one row is itself large: a level down
        for i in range(a.shape[0]):
            yield from _chunks(a[i], b[i])
        return
    step = CHUNK // max(row, 1)
    for s in range(0, a.shape[0], step):
        yield (
            np.ascontiguousarray(a[s : s + step]).reshape(-1),
            np.ascontiguousarray(b[s : s + step]).reshape(-1),
        )


def _bits_differ(ca: np.ndarray, cb: np.ndarray) -> np.ndarray:
    """Per element: whether the bytes of ``ca`` and ``cb`` (same dtype, flat) differ."""
    size = ca.dtype.itemsize
    if ca.dtype.kind == "O":
        return np.array([x is not y and not bool(x == y) for x, y in zip(ca, cb)], dtype=bool)
    if size in (1, 2, 4, 8):
        view = np.dtype(f"u{size}")
        return np.asarray(ca.view(view) != cb.view(view))
    ua = ca.view(np.uint8).reshape(ca.size, size)
    ub = cb.view(np.uint8).reshape(cb.size, size)
    return np.asarray((ua != ub).any(axis=1))


def _numeric(dtype: np.dtype[Any]) -> bool:
    """Numbers whose differences mean something (ml_dtypes' bfloat16, float8, int4 included)."""
    if dtype.kind in "biufc":
        return True
    if dtype.kind != "V" or dtype.fields is not None:
        return False
    try:
        np.zeros(1, dtype).astype(np.float64)
    except (TypeError, ValueError):
        return False
    return True


class _Stats:
    def __init__(self) -> None:
        self.n_different = 0
        self.n_unequal = 0
        self.n_exceeding = 0
        self.max_abs: float | None = None
        self.max_rel: float | None = None
        self.nan_payloads = 0
        self.nan_mismatches = 0
        self.signed_zeros = 0

    def add(
        self, x: np.ndarray, y: np.ndarray, atol: float, rtol: float, check_zeros: bool
    ) -> None:
        """Fold in elements ``x``/``y`` (already known to differ in bytes, or across dtypes)."""
        wide = np.complex128 if (x.dtype.kind == "c" or y.dtype.kind == "c") else np.float64
        fx, fy = x.astype(wide), y.astype(wide)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            nx, ny = np.isnan(fx), np.isnan(fy)
            both = nx & ny
            one = nx ^ ny
            equal = (fx == fy) | both
            d = np.where(equal, 0.0, np.abs(fx - fy))
            d = np.where(one, np.inf, d)
            d = np.where(np.isnan(d), np.inf, d)  # inf - inf of opposite signs
            denom = np.maximum(np.abs(fx), np.abs(fy))
            rel = np.where(d == 0, 0.0, d / np.where(denom == 0, 1.0, denom))
            rel = np.where(np.isnan(rel) | one, np.inf, rel)
            within = d <= atol + rtol * np.where(np.isnan(denom), 0.0, denom)
        self.n_unequal += int(np.count_nonzero(~equal))
        self.nan_payloads += int(np.count_nonzero(both))
        self.nan_mismatches += int(np.count_nonzero(one))
        if check_zeros:
            self.signed_zeros += int(np.count_nonzero((fx == 0) & (fy == 0)))
        self.n_exceeding += int(np.count_nonzero(~within))
        if d.size:
            m, r = float(d.max()), float(rel.max())
            self.max_abs = m if self.max_abs is None else max(self.max_abs, m)
            self.max_rel = r if self.max_rel is None else max(self.max_rel, r)


def compare_leaves(key: str, a: Any, b: Any, *, atol: float = 0.0, rtol: float = 0.0) -> EntryDiff:
    """Compare two leaves (arrays, scalars or other values); ``None`` marks a missing side."""
    if a is None or b is None:
        if a is None and b is None:
            raise ValueError(f"{key}: both sides missing")
        shape, dtype = _leaf_desc(b if a is None else a)
        if a is None:
            return EntryDiff(key, "only in B", shape_b=shape, dtype_b=dtype)
        return EntryDiff(key, "only in A", shape_a=shape, dtype_a=dtype)
    xa, xb = _as_array(a), _as_array(b)
    sa, da = _leaf_desc(a)
    sb, db = _leaf_desc(b)
    base = EntryDiff(key, "identical", shape_a=sa, shape_b=sb, dtype_a=da, dtype_b=db)
    if xa is None or xb is None:  # strings and other values: equal or not
        same = type(a) is type(b) and bool(a == b)
        return replace(
            base,
            status="identical" if same else ("values differ" if da == db else "dtype differs"),
            size=1,
            n_different=0 if same else 1,
            n_exceeding=0 if same else 1,
        )
    if xa.shape != xb.shape:
        return replace(base, status="shape differs")
    same_dtype = xa.dtype == xb.dtype
    numeric = _numeric(xa.dtype) and _numeric(xb.dtype)
    stats = _Stats()
    floating = xa.dtype.kind in "fcV"
    for ca, cb in _chunks(xa, xb):
        if not same_dtype:  # by value (or not at all)
            if numeric:
                stats.add(ca, cb, atol, rtol, check_zeros=False)
            else:
                stats.n_unequal += ca.size
                stats.n_exceeding += ca.size
            continue
        mask = _bits_differ(ca, cb)
        n = int(np.count_nonzero(mask))
        if not n:
            continue
        stats.n_different += n
        if numeric:
            stats.add(ca[mask], cb[mask], atol, rtol, check_zeros=floating)
        else:
            stats.n_exceeding += n
    if not same_dtype:
        stats.n_different = stats.n_unequal
        status = "dtype differs"
    elif stats.n_different == 0:
        status = "identical"
    elif (atol > 0 or rtol > 0) and numeric and stats.n_exceeding == 0:
        status = "within tolerance"
    else:
        status = "values differ"
    counts = {k: v for k, v in vars(stats).items() if k != "n_unequal"}  # EntryDiff's fields
    return replace(base, status=status, size=int(xa.size), **counts)


# --- native trees ---


def _as_key(c: Any) -> Any:
    return str(c[1]) if isinstance(c, tuple) else str(c) if isinstance(c, int) else c


def _flat(tree: Any, normalise: bool) -> dict[str, Any] | None:
    """Leaves by key string (``None`` leaves dropped); with ``normalise``, ``[i]`` and ``#i``
    become ``'i'``, and None is returned when keys then collide."""
    out: dict[str, Any] = {}
    for path, leaf in iter_leaves(tree):
        k = key_string([_as_key(c) for c in path] if normalise else path)
        if k in out:
            return None
        out[k] = leaf
    return out


def _meta_notes(meta_a: Mapping[str, Any], meta_b: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(meta_a) | set(meta_b), key=str)
    differ = [
        k for k in keys if k not in meta_a or k not in meta_b or not _same(meta_a[k], meta_b[k])
    ]
    return [f"meta differs at {', '.join(map(str, differ))}"] if differ else []


def _same(x: Any, y: Any) -> bool:
    try:
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            return bool(np.array_equal(np.asarray(x), np.asarray(y)))
        return bool(x == y)
    except Exception:
        return False


def _native_entries(
    tree_a: Any, tree_b: Any, atol: float, rtol: float, normalise: bool
) -> list[EntryDiff]:
    fa, fb = _flat(tree_a, normalise), _flat(tree_b, normalise)
    if fa is None or fb is None:  # keys collide once normalised: compare as they are
        fa, fb = _flat(tree_a, False) or {}, _flat(tree_b, False) or {}
    out = [compare_leaves(k, v, fb.get(k), atol=atol, rtol=rtol) for k, v in fa.items()]
    return out + [
        compare_leaves(k, None, v, atol=atol, rtol=rtol) for k, v in fb.items() if k not in fa
    ]


# --- the common model form ---


def _model_of(fmt: Format, native: Any, meta: Mapping[str, Any], hint: Any = None) -> Any:
    """The `pytreeio.model.form.Model` of a checkpoint (generic formats: of its Flax tree)."""
    if fmt.to_model is not None:
        return fmt.to_model(native, meta)
    params = _flax_params(native)
    if params is None:
        raise MismatchError(
            f"a {fmt.name} checkpoint that holds no Flax tree has no model form", key_path=""
        )
    first: Exception | None = None
    given = layer_list(meta)
    tries = [x for x in (given, hint) if x is not None] + [None]
    for layers in tries:
        try:
            return Model.from_flax(params, layers)
        except PytreeioError as exc:
            first = first or exc
    assert first is not None
    raise first


def _flax_params(native: Any) -> Any:
    """The Flax tree a generic checkpoint holds (itself, or its ``params`` entry), else None."""
    if is_flax_tree(native):
        return native
    if isinstance(native, Mapping) and "params" in native and is_flax_tree(native["params"]):
        return native["params"]
    return None


def _has_model_form(fmt: Format, native: Any) -> bool:
    return fmt.to_model is not None or _flax_params(native) is not None


def _types(model: Any) -> list[str]:
    return [layer.type for layer in model.layers]


def _model_entries(ma: Any, mb: Any, atol: float, rtol: float) -> tuple[list[EntryDiff], list[str]]:
    def cmp(key: str, x: Any, y: Any) -> EntryDiff:
        return compare_leaves(key, x, y, atol=atol, rtol=rtol)

    notes: list[str] = []
    la, lb = list(ma.layers), list(mb.layers)
    if _types(ma) == _types(mb):
        pairs: list[tuple[int | None, int | None]] = [(i, i) for i in range(len(la))]
    else:
        pa = [i for i, layer in enumerate(la) if layer.arrays]
        pb = [i for i, layer in enumerate(lb) if layer.arrays]
        pairs = list(zip(pa, pb))
        pairs += [(i, None) for i in pa[len(pb) :]] + [(None, i) for i in pb[len(pa) :]]
        notes.append(
            f"the layer lists differ (A: {', '.join(_types(ma)) or 'none'}; "
            f"B: {', '.join(_types(mb)) or 'none'}): arrays are paired by parameter layer "
            "and keyed by A's layer index"
        )
    entries: list[EntryDiff] = []
    seen: set[str] = set()
    for ia, ib in pairs:
        layer_a = la[ia] if ia is not None else None
        layer_b = lb[ib] if ib is not None else None
        index = ia if ia is not None else ib
        prefix = f"layers[{index}]"
        if prefix in seen:
            prefix = f"B.layers[{ib}]"
        seen.add(prefix)
        if layer_a is not None and layer_b is not None:
            if layer_a.type != layer_b.type:
                notes.append(f"{prefix} is a {layer_a.type} in A and a {layer_b.type} in B")
            elif not _same(dict(layer_a.args), dict(layer_b.args)):
                notes.append(
                    f"{prefix} ({layer_a.type}) args differ: {dict(layer_a.args)} vs {dict(layer_b.args)}"
                )
        arrays_a = layer_a.arrays if layer_a is not None else {}
        arrays_b = layer_b.arrays if layer_b is not None else {}
        for name in {**arrays_a, **arrays_b}:
            entries.append(cmp(f"{prefix}.{name}", arrays_a.get(name), arrays_b.get(name)))
    if ma.step is not None and mb.step is not None:
        entries.append(cmp("step", int(ma.step), int(mb.step)))
    oa, ob = ma.opt_state, mb.opt_state
    if oa is None or ob is None:
        if oa is not None or ob is not None:
            side = "A" if oa is not None else "B"
            notes.append(f"only {side} holds an optimizer state; it is not compared")
        return entries, notes
    if oa.kind != ob.kind:
        notes.append(f"optimizer kinds differ: {oa.kind} in A, {ob.kind} in B")
    hyper = sorted(
        k
        for k in set(oa.hyperparams) | set(ob.hyperparams)
        if not _same(oa.hyperparams.get(k), ob.hyperparams.get(k))
    )
    if hyper:
        notes.append(
            "optimizer hyperparameters differ: "
            + ", ".join(
                f"{k} {oa.hyperparams.get(k)!r} vs {ob.hyperparams.get(k)!r}" for k in hyper
            )
        )
    if oa.count is not None and ob.count is not None:
        entries.append(cmp("opt.count", int(oa.count), int(ob.count)))
    elif oa.count is not None or ob.count is not None:
        notes.append(f"only {'A' if oa.count is not None else 'B'} holds a step count")
    for slot in {**oa.slots, **ob.slots}:
        pairs_ = zip_longest(oa.slots.get(slot) or [], ob.slots.get(slot) or [])
        for j, (x, y) in enumerate(pairs_):
            if x is not None or y is not None:  # None on both sides: masked out
                entries.append(cmp(f"opt.{slot}[{j}]", x, y))
    return entries, notes


def _model_diff(
    fa: Format,
    fb: Format,
    native_a: Any,
    native_b: Any,
    meta_a: Mapping[str, Any],
    meta_b: Mapping[str, Any],
    atol: float,
    rtol: float,
) -> tuple[list[EntryDiff], list[str]]:
    # A generic side's Flax tree is read with the other side's layer list.
    if fa.to_model is not None or fb.to_model is None:
        ma = _model_of(fa, native_a, meta_a)
        mb = _model_of(fb, native_b, meta_b, hint=ma.config())
    else:
        mb = _model_of(fb, native_b, meta_b)
        ma = _model_of(fa, native_a, meta_a, hint=mb.config())
    entries, notes = _model_entries(ma, mb, atol, rtol)
    for side, fmt, native in (("A", fa, native_a), ("B", fb, native_b)):
        if fmt.to_model is None and isinstance(native, Mapping) and set(native) - {"params"}:
            extra = sorted(str(k) for k in native if k != "params")
            notes.append(f"{side}'s entries {extra} are outside the model form; not compared")
    return entries, notes


# --- public functions ---


def _format_of(path: PathLike, format: str | Format | None) -> Format:
    return registry.get(format if format is not None else api.inspect(path).format, path=path)


@keywords_explained
def diff(
    a: PathLike,
    b: PathLike,
    *,
    format_a: str | Format | None = None,
    format_b: str | Format | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    through_model: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> DiffReport:
    """Compare the checkpoints at ``a`` and ``b`` (see the module docstring).

    Args:
      a, b: checkpoint paths (files, directories or sibling-file stems).
      format_a, format_b: their formats (default: sniffed from the content).
      atol, rtol: tolerances (``|a - b| <= atol + rtol * max(|a|, |b|)``);
        with both 0 (the default) entries must be bit-identical.
      through_model: compare through the common model form (True), as native
        trees (False), or decide from the formats (None, the default).
      storage_options: the file system options of ``a`` and ``b`` where they are URLs.

    Returns:
      a `DiffReport`; ``report.ok`` is what the command's exit status says.

    Raises:
      PytreeioError: a checkpoint cannot be read, or has no model form when
        ``through_model=True``.  Differences are never raised: they are reported.
    """
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise ValueError(f"tolerances must be non-negative numbers, got atol={atol}, rtol={rtol}")
    a, b = (io.location(p, storage_options if io.is_url(p) else None) for p in (a, b))
    fa, fb = _format_of(a, format_a), _format_of(b, format_b)
    native_a, meta_a = api.load_with_meta(a, format=fa, mmap=True)
    native_b, meta_b = api.load_with_meta(b, format=fb, mmap=True)
    return diff_trees(
        native_a,
        native_b,
        fa,
        fb,
        meta_a=meta_a,
        meta_b=meta_b,
        atol=atol,
        rtol=rtol,
        through_model=through_model,
        label_a=os.fspath(a),
        label_b=os.fspath(b),
    )


def diff_trees(
    native_a: Any,
    native_b: Any,
    format_a: str | Format,
    format_b: str | Format,
    *,
    meta_a: Mapping[str, Any] | None = None,
    meta_b: Mapping[str, Any] | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    through_model: bool | None = None,
    label_a: str = "A",
    label_b: str = "B",
) -> DiffReport:
    """`diff` of two native trees already in memory (e.g. from `pytreeio.decode`)."""
    container_a, container_b = registry.get(format_a), registry.get(format_b)
    notes: list[str] = []
    # a generic file carrying a model format's native tree (a netcl file converted to
    # safetensors) compares as that format
    fa, inner_a = carried(container_a, dict(meta_a or {}))
    fb, inner_b = carried(container_b, dict(meta_b or {}))
    meta_a, meta_b = dict(inner_a or {}), dict(inner_b or {})
    for side, container, fmt in (("A", container_a, fa), ("B", container_b, fb)):
        if fmt is not container:
            notes.append(f"{side} is a {container.name} file carrying a {fmt.name} checkpoint")
    use_model = through_model
    if use_model is None:
        use_model = (
            fa is not fb
            and (fa.is_model_format or fb.is_model_format)
            and _has_model_form(fa, native_a)
            and _has_model_form(fb, native_b)
        )
    entries: list[EntryDiff] = []
    if use_model:
        try:
            entries, model_notes = _model_diff(
                fa, fb, native_a, native_b, meta_a, meta_b, atol, rtol
            )
            notes += model_notes
        except PytreeioError as exc:
            if through_model:
                raise
            notes.append(f"not compared through the model form ({exc}): native trees compared")
            use_model = False
    if not use_model:
        normalise = container_a is not container_b
        entries = _native_entries(native_a, native_b, atol, rtol, normalise=normalise)
        if fa is fb:
            notes += _meta_notes(meta_a, meta_b)
    return DiffReport(
        a=label_a,
        b=label_b,
        format_a=container_a.name,
        format_b=container_b.name,
        mode="model" if use_model else "native",
        atol=float(atol),
        rtol=float(rtol),
        entries=tuple(entries),
        notes=tuple(notes),
    )
