"""Checkpoints at object-storage URLs (fsspec), black box: what a URL load returns is what the
same save returns from a local path.

Every format is saved to a real S3 server (moto in a subprocess, ``tests/cloud_server.py``)
and to ``memory://``, saved over, and loaded back bit for bit against the same saves on the
local disk; ``file://`` URLs are the local paths.  ``inspect``, ``verify`` and ``open`` on S3
agree with local ones, and a view fetches a tensor with ranged GETs, not the whole object;
``convert`` between the disk and S3 writes the bytes a local conversion writes; objects that
another tool put load; fsspec's own configuration (``FSSPEC_S3_*``) is honoured.  Object names
of sibling and directory formats are not looked at: only what loads back.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cloud_server import options_for
from conftest import assert_bits_equal
from test_nothing_beside import DEST, _tree

import pytreeio as ptio
from pytreeio.formats.registry import BUILTIN

pytest.importorskip("fsspec")

FORMATS = sorted(DEST)
REPO = Path(__file__).resolve().parents[1]


def _varied(tree: Any, seed: int) -> Any:
    """``tree`` with every float array filled with distinct values of the same magnitude (a
    read from the wrong offset shows), other leaves as they are."""
    rng = np.random.default_rng(seed)

    def vary(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: vary(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(vary(v) for v in x)
        if isinstance(x, np.ndarray) and x.dtype.kind == "f" and x.size:
            scale = float(np.abs(x).max())
            return (rng.uniform(-1, 1, x.shape) * scale).astype(x.dtype)
        return x

    return vary(tree)


def _case(fmt: str, seed: int) -> tuple[Any, dict[str, Any] | None]:
    """A small native tree of ``fmt`` (values depend on ``seed``) and the meta it needs."""
    tree, meta = _tree(fmt, 1.0)
    return _varied(tree, seed), meta


def _local(tmp_path: Path, fmt: str, tree: Any, meta: Any, name: str = "local") -> Path:
    """``tree`` saved on the local disk, as the reference for a URL's load."""
    dest = tmp_path / name / DEST[fmt]
    dest.parent.mkdir(parents=True, exist_ok=True)
    ptio.save(dest, tree, format=fmt, meta=meta)
    return dest


def _assert_loads_as(url: str, local: Path, **kw: Any) -> None:
    """``load_with_meta(url, **kw)`` returns what the local checkpoint's load returns."""
    fmt = kw.get("format")
    want, want_meta = ptio.load_with_meta(local, format=fmt)
    got, got_meta = ptio.load_with_meta(url, **kw)
    assert_bits_equal(want, got)
    assert got_meta == want_meta


def _save_load_overwrite(root: str, fmt: str, options: Any, tmp_path: Path) -> None:
    """Save, load, save over it, load (the second without ``format``: sniffed from the URL)."""
    url = f"{root}/run/{DEST[fmt]}"
    first, meta = _case(fmt, 1)
    second, _ = _case(fmt, 2)
    ptio.save(url, first, format=fmt, meta=meta, storage_options=options)
    _assert_loads_as(url, _local(tmp_path, fmt, first, meta, "first"), format=fmt,
                     storage_options=options)  # fmt: skip
    ptio.save(url, second, format=fmt, meta=meta, storage_options=options)
    _assert_loads_as(url, _local(tmp_path, fmt, second, meta, "second"), storage_options=options)


@contextlib.contextmanager
def _object_reads() -> Iterator[list[tuple[str, int]]]:
    """Every ``get_object`` s3fs makes within the block: (key, bytes in its response)."""
    import s3fs

    reads: list[tuple[str, int]] = []
    original = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await original(self, method, *args, **kwargs)
        if method == "get_object":
            reads.append((kwargs.get("Key", ""), int(out.get("ContentLength", 0))))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(s3fs.S3FileSystem, "_call_s3", counted)
        yield reads


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh root in fsspec's process-wide memory file system, removed afterwards."""
    import fsspec

    root = f"memory://ptio-{uuid.uuid4().hex[:12]}"
    yield root
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(root, recursive=True)


def test_every_built_in_format_is_covered() -> None:
    assert set(BUILTIN) <= set(FORMATS)


# --------------------------------------------------------------------------
# every format: S3, memory://, file://
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_s3_save_load_and_save_over(
    fmt: str, s3_root: str, s3_options: dict[str, Any], s3_endpoint: str, tmp_path: Path
) -> None:
    _save_load_overwrite(s3_root, fmt, s3_options, tmp_path)
    assert s3_options == options_for(s3_endpoint), "the caller's storage_options were changed"


@pytest.mark.parametrize("fmt", FORMATS)
def test_memory_save_load_and_save_over(fmt: str, memory_root: str, tmp_path: Path) -> None:
    _save_load_overwrite(memory_root, fmt, None, tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_file_url_is_its_local_path(fmt: str, tmp_path: Path) -> None:
    tree, meta = _case(fmt, 3)
    path = tmp_path / "url" / DEST[fmt]
    path.parent.mkdir()
    ptio.save(path.as_uri(), tree, format=fmt, meta=meta)
    _assert_loads_as(os.fspath(path), _local(tmp_path, fmt, tree, meta), format=fmt)
    other, _ = _case(fmt, 4)
    ptio.save(path, other, format=fmt, meta=meta)
    _assert_loads_as(path.as_uri(), _local(tmp_path, fmt, other, meta, "other"), format=fmt)


# --------------------------------------------------------------------------
# inspect, verify, open, save_async
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "msgpack", "waffe2", "netcl-checkpoint"])
def test_inspect_verify_and_open_on_s3_agree_with_local(
    fmt: str, s3_root: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    tree, meta = _case(fmt, 5)
    url = f"{s3_root}/ck/{DEST[fmt]}"
    ptio.save(url, tree, format=fmt, meta=meta, storage_options=s3_options)
    local = _local(tmp_path, fmt, tree, meta)

    want, got = ptio.inspect(local), ptio.inspect(url, storage_options=s3_options)
    assert (got.format, got.entries, got.meta) == (want.format, want.entries, want.meta)
    want, got = ptio.verify(local), ptio.verify(url, storage_options=s3_options)
    assert (got.format, got.entries, got.meta) == (want.format, want.entries, want.meta)

    with ptio.open(local) as lk, ptio.open(url, storage_options=s3_options) as rk:
        assert list(rk) == list(lk)
        for key in reversed(list(lk)):  # out of file order too
            assert_bits_equal(lk[key], rk[key], key)


@pytest.mark.parametrize("fmt", ["safetensors", "msgpack"])
def test_open_fetches_one_tensor_without_the_rest(
    fmt: str, s3_root: str, s3_options: dict[str, Any]
) -> None:
    rng = np.random.default_rng(6)
    big = rng.standard_normal(4 << 20, dtype=np.float32)  # 16 MiB
    small = rng.standard_normal((64, 64), dtype=np.float32)
    url = f"{s3_root}/big/ck.{fmt}"
    ptio.save(url, {"a_big": big, "b_small": small, "c_big": big[::-1].copy()}, format=fmt,
              storage_options=s3_options)  # fmt: skip
    with _object_reads() as reads, ptio.open(url, storage_options=s3_options) as ck:
        got = ck["b_small"]
    assert_bits_equal(small, got)
    fetched = sum(n for _, n in reads)
    assert reads, "no get_object seen: the count below would mean nothing"
    assert fetched < 4 << 20, f"{fetched} bytes fetched for one 16 KiB tensor: {reads}"


def test_save_async_and_load_with_meta_on_s3(s3_root: str, s3_options: dict[str, Any]) -> None:
    tree, meta = _case("tinyllama", 7)
    url = f"{s3_root}/async/weights.bin"
    ptio.save_async(url, tree, format="tinyllama", meta=meta, storage_options=s3_options).result()
    back, got_meta = ptio.load_with_meta(url, format="tinyllama", storage_options=s3_options)
    assert_bits_equal(tree, back)
    assert got_meta["config"]["n_heads"] == 2
    like = ptio.load(url, like=tree, storage_options=s3_options)
    assert_bits_equal(tree, like)


def test_a_missing_object_is_named(s3_root: str, s3_options: dict[str, Any]) -> None:
    url = f"{s3_root}/nothing/here.safetensors"
    with pytest.raises((FileNotFoundError, ptio.PytreeioError)) as info:
        ptio.load(url, storage_options=s3_options)
    assert "nothing/here.safetensors" in str(info.value)


# --------------------------------------------------------------------------
# convert, objects from other tools, fsspec's configuration
# --------------------------------------------------------------------------


def test_convert_between_disk_and_s3_writes_the_local_bytes(
    s3_root: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    import fsspec

    tree, _ = _case("msgpack", 8)
    src = _local(tmp_path, "msgpack", tree, None)
    want = tmp_path / "want.safetensors"
    ptio.convert(src, want, to="safetensors")
    fs = fsspec.filesystem("s3", **s3_options)

    ptio.convert(src, f"{s3_root}/up.safetensors", to="safetensors", storage_options=s3_options)
    assert fs.cat_file(f"{s3_root}/up.safetensors") == want.read_bytes()

    remote_src = f"{s3_root}/src.msgpack"
    ptio.save(remote_src, tree, format="msgpack", storage_options=s3_options)
    down = tmp_path / "down.safetensors"
    ptio.convert(remote_src, down, to="safetensors", storage_options=s3_options)
    assert down.read_bytes() == want.read_bytes()

    ptio.convert(remote_src, f"{s3_root}/s3.safetensors", to="safetensors",
                 storage_options=s3_options)  # fmt: skip
    assert fs.cat_file(f"{s3_root}/s3.safetensors") == want.read_bytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_files_uploaded_by_another_tool_load(
    fmt: str, s3_root: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """A local checkpoint's files copied as they are, one object each (no commit object)."""
    import fsspec

    tree, meta = _case(fmt, 9)
    local = _local(tmp_path, fmt, tree, meta)
    files = {
        f"{s3_root}/theirs/{p.relative_to(local.parent).as_posix()}": p.read_bytes()
        for p in sorted(local.parent.rglob("*"))
        if p.is_file()
    }
    fsspec.filesystem("s3", **s3_options).pipe(files)
    url = f"{s3_root}/theirs/{DEST[fmt]}"
    _assert_loads_as(url, local, format=fmt, storage_options=s3_options)
    with ptio.open(url, storage_options=s3_options) as ck, ptio.open(local) as lk:
        key = sorted(lk)[-1]
        assert_bits_equal(lk[key], ck[key], key)


_FSSPEC_ENV_CHILD = """
import sys
import numpy as np
import pytreeio as ptio
url = sys.argv[1]
tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
ptio.save(url, tree, format="safetensors")
back = ptio.load(url)
assert back["w"].tobytes() == tree["w"].tobytes(), back
print("ok")
"""


def test_fsspec_s3_environment_configuration_is_honoured(
    s3_root: str, s3_endpoint: str, s3_options: dict[str, Any]
) -> None:
    """``FSSPEC_S3_ENDPOINT_URL`` (read by fsspec at import): no ``storage_options`` needed."""
    url = f"{s3_root}/env/ck.safetensors"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSSPEC_")}
    env.update(FSSPEC_S3_ENDPOINT_URL=s3_endpoint, FSSPEC_S3_KEY="testing",
               FSSPEC_S3_SECRET="testing", PYTHONPATH=str(REPO))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", _FSSPEC_ENV_CHILD, url],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    back = ptio.load(url, storage_options=s3_options)
    assert back["w"].tobytes() == np.arange(12, dtype=np.float32).tobytes()
