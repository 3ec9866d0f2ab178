"""Lazy views (``ptio.open``) and partial loads (``load(..., partial=True)``).

Every format with a ``slots`` function: each slot read equals ``load_with_meta``'s
native tree bit for bit; opening reads only headers and each access only its
tensor; hostile files raise only pytreeio errors; a save while a view is open
does not mix into it.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import io
from pytreeio.formats import registry
from tests.model_data import MLP_LAYERS, mlp_params
from tests.tinyllama_data import random_tree

CONFORMANCE_TINYLLAMA = Path("/work/shared/conformance/tinyllama/weights.bin")
MiB = 1 << 20
#: Headers and framing a view may read beyond the tensors asked for (msgpack
#: reads 64 KiB windows around array headers; npz slots read their member's
#: .npy header with the data).
OVERHEAD = 320 * 1024

SLOT_FORMATS = ["safetensors", "msgpack", "tinyllama", "netcl", "netcl-params", "netcl-checkpoint"]


def _tiny_cfg(d: int = 16, vocab: int = 32) -> dict[str, Any]:
    return {
        "d_model": d,
        "n_layers": 2,
        "n_heads": 4,
        "ffn_hidden_dim": 2 * d,
        "max_seq_len": 8,
        "vocab_size": vocab,
        "dropout": 0.1,
    }


def _big(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def write(fmt: str, tmp_path: Path, *, large: bool = False) -> Path:
    """A checkpoint in ``fmt`` written by our writers (a few 2 MiB tensors when ``large``)."""
    n = 512 if large else 4
    if fmt == "safetensors":
        tree = {
            "params": {"w": _big((n, 1024 if large else 3), 0), "b": np.arange(5, dtype=np.int16)},
            "other": [_big((n, 1024 if large else 2), 1), None, "text"],
            "step": 7,
            "lr": 0.5,
            "flag": True,
            "np": np.float16(1.5),
        }
        path = tmp_path / "c.safetensors"
        ptio.save(path, tree)
    elif fmt == "msgpack":
        tree = {
            "params": {"w": _big((n, 1024 if large else 3), 2), "b": np.arange(5, dtype=np.int64)},
            "chunked": _big((n, 1024 if large else 6), 3),
            "scalars": {"i": 3, "f": 0.25, "s": "x", "n": None, "c": 1 + 2j, "np": np.int8(-3)},
            "seq": [np.ones(2, np.uint8), 4],
        }
        path = tmp_path / "c.msgpack"
        ptio.save(path, tree, chunk_bytes=(MiB + 12345) if large else 40)
    elif fmt == "tinyllama":
        cfg = _tiny_cfg(256, 2048) if large else _tiny_cfg()
        path = tmp_path / "weights.bin"
        ptio.save(path, random_tree(cfg), format="tinyllama", meta={"config": cfg})
    elif fmt == "netcl":
        params = _mlp(large)
        path = tmp_path / "m.netcl"
        ptio.save(path, params, format="netcl", layers=MLP_LAYERS)
    elif fmt == "netcl-params":
        path = tmp_path / "p"
        ptio.save(path, list(_flat_arrays(large)), format="netcl-params")
        path = tmp_path / "p.npz"
    elif fmt == "netcl-checkpoint":
        path = tmp_path / "ck"
        ptio.save(path, {"params": list(_flat_arrays(large))}, format="netcl-checkpoint")
    else:
        raise AssertionError(fmt)
    return path


def _mlp(large: bool) -> dict[str, Any]:
    if not large:
        return mlp_params()
    return {
        "Dense_0": {"kernel": _big((512, 1024), 4), "bias": _big((1024,), 5)},
        "Dense_1": {"kernel": _big((1024, 512), 6), "bias": _big((512,), 7)},
    }


def _flat_arrays(large: bool) -> list[np.ndarray]:
    if large:
        return [_big((512, 1024), 8), _big((512, 1024), 9), _big((16,), 10)]
    return [_big((3, 4), 8), np.arange(6, dtype=np.int32).reshape(2, 3)]


def assert_same(a: Any, b: Any, where: str) -> None:
    """Bit for bit: same type, and for arrays the same dtype, shape and bytes."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    else:
        assert a == b, where


def assert_view_matches_load(path: Path, fmt: str | None = None) -> None:
    native, meta = ptio.load_with_meta(path, format=fmt)
    flat = ptio.flatten(native)
    with ptio.open(path, format=fmt) as ck:
        assert sorted(ck) == sorted(flat)
        for key, want in flat.items():
            assert_same(ck[key], want, key)
        assert ck.meta == meta
        whole = ptio.flatten(ck.load())
        assert sorted(whole) == sorted(flat)
        for key, want in flat.items():
            assert_same(whole[key], want, key)


# --------------------------------------------------------------------------
# every slot equals decode
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", SLOT_FORMATS)
def test_every_format_lists_slots(fmt: str) -> None:
    assert registry.get(fmt).slots is not None


@pytest.mark.parametrize("fmt", SLOT_FORMATS)
def test_slots_read_equals_decode(fmt: str, tmp_path: Path) -> None:
    path = write(fmt, tmp_path)
    assert_view_matches_load(path)
    with ptio.open(path) as ck:
        assert ck.format == fmt
        assert ck.info == ptio.inspect(path)


def test_conformance_tinyllama_slots_equal_decode() -> None:
    if not CONFORMANCE_TINYLLAMA.exists():
        pytest.skip("no conformance file")
    assert_view_matches_load(CONFORMANCE_TINYLLAMA, "tinyllama")


def test_fortran_and_big_endian_npz_members(tmp_path: Path) -> None:
    """Foreign np.savez archives: Fortran-order and big-endian members read as decode reads them."""
    path = tmp_path / "f.npz"
    a = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    b = np.arange(6, dtype=">i4").reshape(2, 3)
    np.savez(path, p0=a, p1=b)
    assert_view_matches_load(path, "netcl-params")
    compressed = tmp_path / "z.npz"
    np.savez_compressed(compressed, p0=a, p1=b)
    assert_view_matches_load(compressed, "netcl-params")


def test_slots_without_crc_are_plain_ranges(tmp_path: Path) -> None:
    path = write("netcl-params", tmp_path)
    with ptio.open(path, verify_crc=False) as ck:
        src = ck._source["npz"] if "npz" in ck._source else ck._source["path"]
        found = registry.get("netcl-params").slots({"npz": src}, verify_crc=False).tree
        assert all(s.reader is None for s in found.values())
        assert_same(ck["p0"], ptio.load(path)["p0"], "p0")


# --------------------------------------------------------------------------
# only the requested bytes are read
# --------------------------------------------------------------------------

BIG_KEY = {
    "safetensors": "params/w",
    "msgpack": "chunked",
    "tinyllama": "tok_embedding",
    "netcl": "[0]/weight",
    "netcl-params": "p1",
    "netcl-checkpoint": "params/p1",
}


@pytest.mark.parametrize("fmt", SLOT_FORMATS)
def test_only_requested_bytes_are_read(fmt: str, tmp_path: Path) -> None:
    path = write(fmt, tmp_path, large=True)
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert size > 4 * MiB
    key = BIG_KEY[fmt]
    with ptio.open(path) as ck:
        opened = ck.bytes_read
        assert opened < OVERHEAD, opened
        arr = ck[key]
        assert arr.nbytes == 2 * MiB
        assert ck.bytes_read - opened <= arr.nbytes + OVERHEAD
        assert ck.bytes_read <= arr.nbytes + OVERHEAD  # the other large tensors: never read
        assert_same(arr, ptio.flatten(ptio.load(path))[key], key)


def test_partial_load_reads_only_the_subtree(tmp_path: Path, monkeypatch: Any) -> None:
    path = write("safetensors", tmp_path, large=True)
    read: list[int] = []
    original = io.FileSource._read

    def counting(self: io.FileSource, offset: int, n: int) -> memoryview:
        read.append(n)
        return original(self, offset, n)

    monkeypatch.setattr(io.FileSource, "_read", counting)
    like = {"params": {"b": np.zeros(5, np.int16)}}
    got = ptio.load(path, like=like, partial=True)
    assert_same(got["params"]["b"], np.arange(5, dtype=np.int16), "params/b")
    assert sum(read) < OVERHEAD  # the two 2 MiB tensors were never read


# --------------------------------------------------------------------------
# errors as load raises them
# --------------------------------------------------------------------------


def _error_of(fn: Any) -> type[BaseException]:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value)


def test_open_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ptio.open(tmp_path / "nothing.safetensors")
    with pytest.raises(FileNotFoundError):
        ptio.open(tmp_path / "nothing", format="netcl-checkpoint")


def test_open_wrong_format_and_unknown_content(tmp_path: Path) -> None:
    path = write("safetensors", tmp_path)
    with pytest.raises(ptio.FormatError):
        ptio.open(path, format="tinyllama")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x01\x02 nothing known")
    assert _error_of(lambda: ptio.open(junk)) is _error_of(lambda: ptio.load(junk))
    with pytest.raises(TypeError, match="no load option"):
        ptio.open(path, nonsense=1)


def test_open_hostile_header_names_the_file(tmp_path: Path) -> None:
    path = write("safetensors", tmp_path)
    data = bytearray(path.read_bytes())
    data[0:8] = (len(data) * 2).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ptio.FormatError) as info:
        ptio.open(path, format="safetensors")
    assert info.value.path == str(path)
    assert info.value.field == "header length"


def test_missing_key_lists_near_names(tmp_path: Path) -> None:
    with ptio.open(write("safetensors", tmp_path)) as ck:
        with pytest.raises(KeyError, match="params/w"):
            ck["params/ww"]
        with pytest.raises(KeyError):
            ck.load(prefix="nope")
    with pytest.raises(ValueError, match="closed"):
        ck["params/w"]


def test_format_without_slots_decodes_once(tmp_path: Path) -> None:
    path = write("safetensors", tmp_path)
    plain = registry.get("safetensors")._replace(name="safetensors-noslots", slots=None)
    with ptio.open(path, format=plain) as ck:
        assert ck.bytes_read < 1024  # nothing decoded yet
        assert_same(ck["params/w"], ptio.load(path)["params"]["w"], "params/w")
        assert ck.bytes_read == path.stat().st_size


# --------------------------------------------------------------------------
# partial loads
# --------------------------------------------------------------------------


def _train_state() -> Any:
    optax = pytest.importorskip("optax")
    params = mlp_params()
    return {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": 3}


@pytest.mark.parametrize("fmt", ["msgpack", "safetensors"])
def test_partial_load_of_subtrees_is_bit_exact(fmt: str, tmp_path: Path) -> None:
    state = _train_state()
    path = tmp_path / f"state.{fmt}"
    ptio.save(path, state)
    full = ptio.load(path, like=state)
    subtrees = [
        {"params": {"Dense_1": state["params"]["Dense_1"]}},
        {"opt_state": state["opt_state"]},
        {"params": state["params"], "step": 0},
    ]
    for like in subtrees:
        before = copy.deepcopy(like)
        got = ptio.load(path, like=like, partial=True)
        assert ptio.flatten(got).keys() == ptio.flatten(like).keys()
        for key, value in ptio.flatten(got).items():
            want = ptio.flatten(full)[key]
            assert np.asarray(value).tobytes() == np.asarray(want).tobytes(), key
            assert np.asarray(value).dtype == np.asarray(want).dtype, key
        _assert_unchanged(like, before)
        with pytest.raises(ptio.MismatchError):
            ptio.load(path, like=like)  # not partial: the extra entries are refused
    with ptio.open(path) as ck:
        got = ck.load(like={"Dense_0": state["params"]["Dense_0"]}, prefix="params")
        assert_same(got["Dense_0"]["kernel"], state["params"]["Dense_0"]["kernel"], "kernel")


def _assert_unchanged(like: Any, before: Any) -> None:
    after, was = ptio.flatten(like), ptio.flatten(before)
    assert after.keys() == was.keys()
    for key in after:
        assert np.asarray(after[key]).tobytes() == np.asarray(was[key]).tobytes(), key


def test_partial_load_of_a_flax_train_state(tmp_path: Path) -> None:
    pytest.importorskip("flax")
    optax = pytest.importorskip("optax")
    from flax.training import train_state

    params = mlp_params()
    state = train_state.TrainState.create(
        apply_fn=lambda *a: None, params=params, tx=optax.sgd(0.1)
    )
    for suffix in ("msgpack", "safetensors"):
        path = tmp_path / f"ts.{suffix}"
        ptio.save(path, state)
        got = ptio.load(path, like={"params": {"Dense_0": params["Dense_0"]}}, partial=True)
        for k in ("kernel", "bias"):
            assert_same(got["params"]["Dense_0"][k], params["Dense_0"][k], k)


def test_partial_load_missing_key_is_a_mismatch(tmp_path: Path) -> None:
    path = write("safetensors", tmp_path)
    with pytest.raises(ptio.MismatchError) as info:
        ptio.load(path, like={"params": {"zz": np.zeros(3)}}, partial=True)
    assert info.value.key_path == "params/zz"
    with pytest.raises(TypeError, match="like"):
        ptio.load(path, partial=True)


def test_partial_load_through_a_model_format(tmp_path: Path) -> None:
    """netcl model files restore a Flax subtree through to_model (decoded mapped)."""
    params = mlp_params()
    path = tmp_path / "m.netcl"
    ptio.save(path, params, format="netcl", layers=MLP_LAYERS)
    got = ptio.load(path, like={"Dense_1": params["Dense_1"]}, partial=True)
    for k in ("kernel", "bias"):
        assert_same(got["Dense_1"][k], params["Dense_1"][k], k)
        assert got["Dense_1"][k].flags.writeable
    with pytest.raises(ptio.MismatchError):
        ptio.load(path, like={"Dense_1": params["Dense_1"]})


def test_decode_partial(tmp_path: Path) -> None:
    data = ptio.encode({"a": np.ones(2), "b": np.zeros(3)}, format="safetensors")
    got = ptio.decode(data, format="safetensors", like={"b": np.ones(3)}, partial=True)
    assert_same(got["b"], np.zeros(3), "b")


# --------------------------------------------------------------------------
# a save while a view is open
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "netcl-checkpoint"])
def test_concurrent_save_does_not_mix(fmt: str, tmp_path: Path) -> None:
    old = {"params": [np.full(3, 1.0, np.float32), np.full(2, 1.0, np.float32)]}
    new = {"params": [np.full(3, 2.0, np.float32), np.full(2, 2.0, np.float32)]}
    if fmt == "safetensors":
        path = tmp_path / "c.safetensors"
        keys = ["params/[0]", "params/[1]"]
    else:
        path = tmp_path / "ck"
        keys = ["params/p0", "params/p1"]
    ptio.save(path, old, format=fmt)
    with ptio.open(path, format=fmt) as ck:
        first = ck[keys[0]]
        ptio.save(path, new, format=fmt)
        second = ck[keys[1]]
        assert first[0] == 1.0 and second[0] == 1.0  # all of the old checkpoint
    with ptio.open(path, format=fmt) as ck:
        assert ck[keys[0]][0] == 2.0 and ck[keys[1]][0] == 2.0


# --------------------------------------------------------------------------
# hostile files: slots and Slot.read raise only pytreeio errors
# --------------------------------------------------------------------------


def _mutations(data: bytes, rng: random.Random) -> list[bytes]:
    out = [data[:n] for n in sorted({0, 1, 7, 8, 9, 36, len(data) // 2, len(data) - 1})]
    for _ in range(30):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out.append(bytes(b))
    for _ in range(10):  # lying lengths: a large number written over 4 or 8 bytes
        b = bytearray(data)
        at = rng.randrange(max(1, len(b) - 8))
        width = rng.choice((4, 8))
        b[at : at + width] = rng.choice((2**31 - 1, 2**32 - 1, 2**63)).to_bytes(8, "little")[:width]
        out.append(bytes(b))
    return out


def _target(fmt: str, path: Path) -> Path:
    """The file of the checkpoint the mutations go to (the .npz of a sibling set)."""
    if fmt == "netcl-checkpoint":
        return path.with_suffix(".npz") if path.suffix != ".npz" else path
    return path


@pytest.mark.parametrize("fmt", SLOT_FORMATS)
def test_hostile_files_raise_only_pytreeio_errors(fmt: str, tmp_path: Path) -> None:
    path = write(fmt, tmp_path)
    target = tmp_path / "ck.npz" if fmt == "netcl-checkpoint" else _target(fmt, path)
    original = target.read_bytes()
    rng = random.Random(f"lazy-{fmt}")
    for mutated in _mutations(original, rng):
        target.write_bytes(mutated)
        try:
            with ptio.open(path, format=fmt) as ck:
                for key in ck:
                    ck[key]
        except ptio.PytreeioError:
            pass
        # anything else fails the test with its traceback
    target.write_bytes(original)
    assert_view_matches_load(path, fmt)


def test_msgpack_framing_walk_is_bounded(tmp_path: Path) -> None:
    """Deep nesting and lying container counts: a FormatError, never a hang or a crash."""
    for data in (b"\x91" * 100_000, b"\xdf\xff\xff\xff\xff", b"\x81\xa1a\xc9\xff\xff\xff\xff\x01"):
        path = tmp_path / "h.msgpack"
        path.write_bytes(data)
        with pytest.raises(ptio.FormatError):
            ptio.open(path, format="msgpack")


@pytest.mark.parametrize("suffix", ["msgpack", "safetensors"])
def test_typed_prng_keys_read_as_keys(suffix: str, tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    path = tmp_path / f"k.{suffix}"
    ptio.save(path, {"rng": jax.random.key(3), "w": np.ones(2, np.float32)})
    want = ptio.load(path)["rng"]
    with ptio.open(path) as ck:
        got = ck["rng"]
    assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(got), jax.random.key_data(want))
