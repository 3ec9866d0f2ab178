"""The commit protocol and ranged reads of checkpoints in object storage (`pytreeio.io.remote`).

Fast cases run on fsspec's ``memory://`` (and a byte-counting subclass of it); the crash and
concurrency cases run against the moto S3 server of ``tests/cloud_server.py``: a saver killed
by SIGKILL mid-save, and two savers racing on one destination, never leave a mix.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import pytreeio as ptio

fsspec = pytest.importorskip("fsspec")
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class CountingFS(MemoryFileSystem):
    """``memory://`` that records the byte ranges fetched (what ranged GETs would fetch)."""

    protocol = "countmem"
    fetched: ClassVar[list[tuple[str, int]]] = []

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path.replace("countmem://", "memory://", 1))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        data = super().cat_file(path, start=start, end=end, **kw)
        CountingFS.fetched.append((path, len(data)))
        return data


fsspec.register_implementation("countmem", CountingFS, clobber=True)


@pytest.fixture
def mem() -> Any:
    """A fresh ``memory://`` prefix (the memory file system is one store per process)."""
    root = f"/t{uuid.uuid4().hex[:12]}"
    yield f"memory://{root}"
    MemoryFileSystem().rm(root, recursive=True) if MemoryFileSystem().exists(root) else None


def _objects(url: str) -> list[str]:
    fs, key = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return sorted(k[len(key.rstrip("/")) + 1 :] for k in fs.find(key))


def _waffe2_tree(v: float, n: int = 3) -> dict[str, Any]:
    layers = {str(i): {"weights": np.full((2, 3), v, np.float32)} for i in range(n)}
    return {"param": {"linearlayer": layers}}


def _values(tree: Any) -> set[float]:
    import jax

    return {float(x) for leaf in jax.tree.leaves(tree) for x in np.unique(np.asarray(leaf))}


# --------------------------------------------------------------------------
# ranged reads
# --------------------------------------------------------------------------


def test_inspect_and_open_fetch_only_the_ranges_they_need(mem: str) -> None:
    url = "countmem://" + mem.removeprefix("memory://") + "/big.safetensors"
    tree = {f"t{i}": np.full((512, 1024), i, np.float32) for i in range(5)}  # 2 MiB each
    ptio.save(url, tree)
    size = sum(n for n in (a.nbytes for a in tree.values()))
    CountingFS.fetched.clear()
    info = ptio.inspect(url)
    assert sorted(e.name for e in info.entries) == sorted(tree)
    fetched = sum(n for _, n in CountingFS.fetched)
    # a 4 KiB sniff and one 64 KiB window holding the header: no tensor data
    assert fetched <= 4096 + (64 << 10), CountingFS.fetched

    CountingFS.fetched.clear()
    with ptio.open(url) as ck:
        CountingFS.fetched.clear()
        got = ck["t3"]
    assert np.array_equal(got, tree["t3"])
    assert sum(n for _, n in CountingFS.fetched) == tree["t3"].nbytes  # that tensor, no more
    assert sum(n for _, n in CountingFS.fetched) < size / 4


def test_whole_load_fetches_in_blocks(mem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytreeio.io import remote

    monkeypatch.setattr(remote, "_BLOCK", 1 << 20)
    url = "countmem://" + mem.removeprefix("memory://") + "/w.msgpack"
    tree = {"x": np.arange(3 << 20, dtype=np.uint8)}
    ptio.save(url, tree)
    CountingFS.fetched.clear()
    back = ptio.load(url, format="msgpack")
    assert np.array_equal(back["x"], tree["x"])
    blocks = [n for _, n in CountingFS.fetched]
    assert max(blocks) <= 1 << 20 and sum(blocks) >= tree["x"].nbytes and len(blocks) >= 4


def test_an_object_replaced_while_a_lazy_view_reads_it_is_changed_while_open(mem: str) -> None:
    url = mem + "/r.safetensors"
    n = 1 << 16  # tensors beyond the window that the header was read through
    ptio.save(url, {"a": np.zeros(n, np.float32), "b": np.zeros(n, np.float32)})
    with ptio.open(url) as ck:
        time.sleep(0.01)  # memory:// stamps objects by creation time
        ptio.save(url, {"a": np.ones(n, np.float32), "b": np.ones(n, np.float32)})
        with pytest.raises(ptio.ChangedWhileOpen, match="replaced while it was read"):
            ck["a"]
    assert np.array_equal(ptio.load(url)["a"], np.ones(n, np.float32))


# --------------------------------------------------------------------------
# versions and commits
# --------------------------------------------------------------------------


def test_a_directory_is_a_committed_version_and_the_one_it_replaced(mem: str) -> None:
    url = mem + "/ck"
    for v in (1.0, 2.0, 3.0):
        ptio.save(url, _waffe2_tree(v), format="waffe2")
    names = _objects(url)
    commit = [n for n in names if n == ".pytreeio-commit"]
    versions = {n.split("/")[0] for n in names if n != ".pytreeio-commit"}
    doc = json.loads(
        fsspec.filesystem("memory").cat_file(url.removeprefix("memory://") + "/" + commit[0])
    )
    # the first save's version is gone; the second's stays for readers still reading it
    assert versions == {".pytreeio-" + doc["version"], ".pytreeio-" + doc["previous"]}
    assert all(e["size"] > 0 and len(e["xxh3_64"]) == 16 for e in doc["files"].values())
    assert _values(ptio.load(url)) == {3.0}
    assert ptio.verify(url).format == "waffe2"


def test_an_uncommitted_version_is_never_read_and_the_next_save_removes_a_dead_one(
    mem: str,
) -> None:
    url = mem + "/ck"
    ptio.save(url, _waffe2_tree(1.0), format="waffe2")
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    from pytreeio.io.remote import _host

    host = _host()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead_pid = int(dead.stdout)
    stale = "20200101T000000.000000Z-elsewhere-1-0123abcd"
    dead_here = (
        f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.000000Z-{host}-{dead_pid}-89abcdef"
    )
    young_elsewhere = (
        f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.000000Z-elsewhere-1-00000000"
    )
    for v in (stale, dead_here, young_elsewhere):  # files of saves that never committed
        fs.pipe_file(f"{root}/.pytreeio-{v}/parameters.json", b"{broken")
    # the stale one was last written two days ago, by the store's clock (not its name's)
    old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=2)
    fs.store[f"{root}/.pytreeio-{stale}/parameters.json"].created = old
    assert _values(ptio.load(url)) == {1.0}
    ptio.save(url, _waffe2_tree(3.0), format="waffe2")
    left = {n.split("/")[0] for n in _objects(url)} - {".pytreeio-commit"}
    # the committed version, the one it replaced, and a young one of another host's saver
    assert len(left) == 3 and f".pytreeio-{young_elsewhere}" in left
    assert _values(ptio.load(url)) == {3.0}


def test_linked_siblings_commit_together(mem: str) -> None:
    url = mem + "/run/ck"
    tree = {
        "params": [np.ones((3, 2), np.float32)],
        "optim_state": {"t": 1, "moments": [[np.ones((3, 2), np.float32)] * 2]},
    }
    ptio.save(url, tree, format="netcl-checkpoint")
    names = _objects(mem + "/run")
    assert ".ck.npz.pytreeio-commit" in names
    assert ptio.inspect(url).format == "netcl-checkpoint"  # sniffed through the commit
    back = ptio.load(url, like=tree)
    assert np.array_equal(back["params"][0], tree["params"][0])


def test_a_plain_directory_uploaded_by_another_tool_loads(mem: str, tmp_path: Path) -> None:
    ptio.save(tmp_path / "ck", _waffe2_tree(4.0), format="waffe2")
    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "ck"), mem.removeprefix("memory://") + "/plain", recursive=True)
    assert _values(ptio.load(mem + "/plain")) == {4.0}


@pytest.mark.parametrize(
    "doc",
    [b"{not json", b'{"version": "x", "files": {}}', b"[1]",
     json.dumps({"version": "20260101T000000.000000Z-h-1-0123abcd",
                 "files": {"../../etc/passwd": {"size": 1, "xxh3_64": "0"}}}).encode()],
)  # fmt: skip
def test_a_hostile_commit_object_is_a_format_error_naming_it(mem: str, doc: bytes) -> None:
    url = mem + "/ck"
    ptio.save(url, _waffe2_tree(1.0), format="waffe2")
    fsspec.filesystem("memory").pipe_file(url.removeprefix("memory://") + "/.pytreeio-commit", doc)
    with pytest.raises(ptio.FormatError) as err:
        ptio.load(url, format="waffe2")
    assert err.value.path.endswith("/.pytreeio-commit") and err.value.field == "commit"


def test_verify_checks_the_commit_checksums(mem: str) -> None:
    url = mem + "/ck"
    ptio.save(url, _waffe2_tree(1.0), format="waffe2")
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    victim = next(k for k in fs.find(root) if k.endswith(".npy"))
    data = bytearray(fs.cat_file(victim))
    data[-1] ^= 0x40
    fs.pipe_file(victim, bytes(data))
    with pytest.raises(ptio.FormatError, match=r"checksum|changed"):
        ptio.verify(url)


def test_storage_options_are_for_urls(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="storage_options"):
        ptio.save(tmp_path / "a.msgpack", {"a": np.ones(2)}, storage_options={"key": "k"})
    ptio.save(f"file://{tmp_path}/b.msgpack", {"a": np.ones(2)})  # file:// is a local path
    assert (tmp_path / "b.msgpack").is_file()


def test_convert_streams_between_local_and_remote(mem: str, tmp_path: Path) -> None:
    tree = {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 2), np.int32)}
    ptio.save(tmp_path / "a.safetensors", tree)
    ptio.convert(tmp_path / "a.safetensors", mem + "/b.msgpack", to="msgpack")
    ptio.convert(mem + "/b.msgpack", tmp_path / "c.safetensors", to="safetensors")
    ptio.convert(tmp_path / "a.safetensors", tmp_path / "d.msgpack", to="msgpack")
    remote = fsspec.filesystem("memory").cat_file(mem.removeprefix("memory://") + "/b.msgpack")
    assert remote == (tmp_path / "d.msgpack").read_bytes()
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()


# --------------------------------------------------------------------------
# against the S3 server: SIGKILL and concurrent savers
# --------------------------------------------------------------------------

_SAVER = textwrap.dedent(
    """
    import sys, numpy as np, pytreeio as ptio
    url, value, rounds, endpoint = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    so = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    n = int(sys.argv[5])
    layers = {str(i): {"weights": np.full((64, 64), value, np.float32)} for i in range(n)}
    print("ready", flush=True)
    for _ in range(rounds):
        ptio.save(url, {"param": {"linearlayer": layers}}, format="waffe2", storage_options=so)
    print("done", flush=True)
    """
)


def _saver(url: str, value: float, rounds: int, endpoint: str, n: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", _SAVER, url, str(value), str(rounds), endpoint, str(n)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        bufsize=0,
    )


def test_sigkill_during_a_directory_save_to_s3_leaves_the_previous_checkpoint(
    s3_root: str, s3_options: dict[str, Any], s3_endpoint: str
) -> None:
    url = s3_root + "/run/ck"
    ptio.save(url, _waffe2_tree(1.0, n=40), format="waffe2", storage_options=s3_options)
    fs, key = fsspec.core.url_to_fs(url, **s3_options)
    proc = _saver(url, 2.0, 1, s3_endpoint, 40)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # some of the new version's objects are written
            fs.invalidate_cache()
            versions = [p for p in fs.ls(key) if ".pytreeio-2" in p]
            if len(versions) > 1 and len(fs.find(sorted(versions)[-1])) >= 3:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert _values(ptio.load(url, storage_options=s3_options)) == {1.0}
    fs.invalidate_cache()
    assert len([p for p in fs.ls(key) if ".pytreeio-2" in p]) == 2  # the dead save's files
    ptio.save(url, _waffe2_tree(3.0, n=40), format="waffe2", storage_options=s3_options)
    fs.invalidate_cache()
    # the dead save's files are removed by the next save; the replaced version stays
    assert len([p for p in fs.ls(key) if ".pytreeio-2" in p]) == 2
    doc = json.loads(fs.cat_file(key + "/.pytreeio-commit"))
    assert {p.split("/.pytreeio-")[-1] for p in fs.ls(key) if ".pytreeio-2" in p} == {
        doc["version"],
        doc["previous"],
    }
    assert _values(ptio.load(url, storage_options=s3_options)) == {3.0}


def test_two_concurrent_savers_to_s3_never_leave_a_mix(
    s3_root: str, s3_options: dict[str, Any], s3_endpoint: str
) -> None:
    url = s3_root + "/run/ck"
    ptio.save(url, _waffe2_tree(1.0, n=8), format="waffe2", storage_options=s3_options)
    savers = [_saver(url, v, 4, s3_endpoint, 8) for v in (2.0, 3.0)]
    seen: set[float] = set()
    try:
        while any(p.poll() is None for p in savers):  # every load sees one whole save
            try:
                values = _values(ptio.load(url, storage_options=s3_options))
            except ptio.ChangedWhileOpen:
                continue  # two saves landed during each of its tries: never a mix
            assert len(values) == 1, values
            seen |= values
    finally:
        for p in savers:
            p.wait(timeout=120)
    assert all(p.returncode == 0 for p in savers)
    final = _values(ptio.load(url, storage_options=s3_options))
    assert final in ({2.0}, {3.0})
    # once both savers are gone, the next save leaves one version: nothing of the race is left
    ptio.save(url, _waffe2_tree(4.0, n=8), format="waffe2", storage_options=s3_options)
    fs, key = fsspec.core.url_to_fs(url, **s3_options)
    fs.invalidate_cache()
    assert (
        len([p for p in fs.ls(key) if ".pytreeio-2" in p]) == 2
    )  # that save's, and the one before


def test_the_command_reads_s3_with_fsspec_environment_configuration(
    s3_root: str, s3_options: dict[str, Any], s3_endpoint: str, tmp_path: Path
) -> None:
    url = s3_root + "/c/a.safetensors"
    ptio.save(url, {"w": np.arange(4, dtype=np.float32)}, storage_options=s3_options)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FSSPEC_S3_ENDPOINT_URL": s3_endpoint,  # fsspec's own configuration: no options passed
        "FSSPEC_S3_KEY": "testing",
        "FSSPEC_S3_SECRET": "testing",
    }
    run = [sys.executable, "-m", "pytreeio.cli"]
    out = subprocess.run([*run, "inspect", url], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "w" in out.stdout and "float32" in out.stdout
    dst = tmp_path / "a.msgpack"
    out = subprocess.run(
        [*run, "convert", url, str(dst), "--to", "msgpack"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert np.array_equal(ptio.load(dst)["w"], np.arange(4, dtype=np.float32))


def test_diff_compares_a_remote_and_a_local_checkpoint(mem: str, tmp_path: Path) -> None:
    from pytreeio.diff import diff
    from pytreeio.integrity import write_manifest

    tree = {"a": np.arange(6, dtype=np.float32)}
    ptio.save(mem + "/a.safetensors", tree)
    ptio.save(tmp_path / "a.msgpack", tree)
    assert diff(mem + "/a.safetensors", tmp_path / "a.msgpack").ok
    ptio.save(tmp_path / "b.msgpack", {"a": tree["a"] + 1})
    assert not diff(mem + "/a.safetensors", tmp_path / "b.msgpack").ok
    with pytest.raises(TypeError, match="commit object"):
        write_manifest(mem + "/a.safetensors")


def test_a_save_in_parts_to_a_url_is_one_object(mem: str, tmp_path: Path) -> None:
    from thread_group import run_threads

    from pytreeio import multihost

    tree = {"w": np.arange(4096, dtype=np.float32), "b": np.ones(3, np.int32)}
    ptio.save(tmp_path / "want.safetensors", tree)
    url = mem + "/parts.safetensors"
    run_threads(2, lambda coord: multihost.save_in_parts(url, tree, coordinator=coord))
    assert _objects(mem) == ["parts.safetensors"]  # the parts prefix is gone
    fs = fsspec.filesystem("memory")
    assert (
        fs.cat_file(url.removeprefix("memory://")) == (tmp_path / "want.safetensors").read_bytes()
    )


# --------------------------------------------------------------------------
# what a review found: each case once failed
# --------------------------------------------------------------------------


def test_a_commit_that_lands_but_raises_keeps_its_version(
    mem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = mem + "/ck"
    ptio.save(url, _waffe2_tree(1.0), format="waffe2")
    real = MemoryFileSystem.pipe_file

    def lands_then_times_out(self: Any, path: str, value: bytes, **kw: Any) -> None:
        real(self, path, value, **kw)
        if path.endswith(".pytreeio-commit"):
            raise TimeoutError("read timeout after the store took it")

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", lands_then_times_out)
    with pytest.raises(OSError, match="timeout"):
        ptio.save(url, _waffe2_tree(2.0), format="waffe2")
    monkeypatch.undo()
    assert _values(ptio.load(url)) == {2.0}  # committed, and its files are all there


def test_a_failed_window_read_is_not_served_later(
    mem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "countmem://" + mem.removeprefix("memory://") + "/w.safetensors"
    tree = {"a": np.arange(16, dtype=np.float32), "b": np.arange(16, dtype=np.int32)}
    ptio.save(url, tree)
    with ptio.open(url) as ck:
        real = CountingFS.cat_file
        monkeypatch.setattr(
            CountingFS, "cat_file", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "flaky"))
        )
        src = ck._source
        src._window = memoryview(b"")  # the next small read fetches a window
        with pytest.raises(OSError):
            src.read(8, 16, "a")
        monkeypatch.setattr(CountingFS, "cat_file", real)
        assert bytes(src.read(0, 8, "head")) == bytes(
            ptio.encode(tree, format="safetensors").tobytes()[:8]
        )


def test_an_empty_tensor_at_the_end_of_an_s3_object_reads(
    s3_root: str, s3_options: dict[str, Any]
) -> None:
    url = s3_root + "/e.safetensors"
    tree = {"a": np.arange(4, dtype=np.float32), "z": np.zeros((0,), np.float32)}
    ptio.save(url, tree, storage_options=s3_options)
    with ptio.open(url, storage_options=s3_options) as ck:
        assert ck["z"].shape == (0,) and np.array_equal(ck["a"], tree["a"])


@pytest.mark.parametrize("size", [True, 10**12, 2**63, -1])
def test_a_commit_recording_an_odd_size_is_a_format_error(mem: str, size: Any) -> None:
    url = mem + "/ck"
    ptio.save(url, _waffe2_tree(1.0), format="waffe2")
    fs = fsspec.filesystem("memory")
    key = url.removeprefix("memory://") + "/.pytreeio-commit"
    doc = json.loads(fs.cat_file(key))
    doc["files"]["parameters.json"]["size"] = size
    fs.pipe_file(key, json.dumps(doc).encode())
    with pytest.raises(ptio.FormatError) as err:
        ptio.load(url, format="waffe2")
    assert "commit" in str(err.value.path) or "parameters.json" in str(err.value.path)


def test_caching_wrappers_are_refused() -> None:
    with pytest.raises(ValueError, match="simplecache"):
        ptio.load("simplecache::memory://x/a.msgpack")


def test_an_odd_entry_beside_the_versions_does_not_break_saves(mem: str) -> None:
    url = mem + "/ck"
    ptio.save(url, _waffe2_tree(1.0), format="waffe2")
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    for odd in (
        "99999999T999999.000000Z-h-1-0123abcd",
        "20200101T000000.000000Z-h-99999999999-0123abcd",
    ):
        fs.pipe_file(f"{root}/.pytreeio-{odd}/x", b"x")
    ptio.save(url, _waffe2_tree(2.0), format="waffe2")
    assert _values(ptio.load(url)) == {2.0}


@pytest.mark.parametrize("dst", ["netcl", "bullet"])
def test_convert_from_a_url_holds_a_few_tensors(mem: str, tmp_path: Path, dst: str) -> None:
    """The streaming bound of `tests/test_streaming_memory.py`, reading ranges of an object:
    a few tensors (each fetched as bytes, then copied into its own memory), not the tree."""
    from test_streaming_convert import files_of
    from test_streaming_memory import BOUND, IN, OUT, TENSOR, traced_peak

    rng = np.random.default_rng(7)
    layers = 24  # 9 MiB: nearly four times the bound
    shapes = [(IN, OUT) if i % 2 == 0 else (OUT, IN) for i in range(layers)]
    params = {
        f"Dense_{i}": {
            "kernel": rng.standard_normal(shape).astype(np.float32),
            "bias": rng.standard_normal(shape[1]).astype(np.float32),
        }
        for i, shape in enumerate(shapes)
    }
    src = mem + "/flax.safetensors"
    ptio.save(src, {"params": params})
    (tmp_path / "remote").mkdir()
    out = tmp_path / "remote" / "out"
    peak = traced_peak(lambda: ptio.convert(src, out, to=dst, durable=False))
    bound = BOUND + 2 * TENSOR
    assert peak < bound < layers * TENSOR / 3, f"peak {peak / 2**20:.1f} MiB"
    (tmp_path / "local").mkdir()
    ptio.save(tmp_path / "flax.safetensors", {"params": params})
    ptio.convert(tmp_path / "flax.safetensors", tmp_path / "local" / "out", to=dst)
    assert files_of(out, dst) == files_of(tmp_path / "local" / "out", dst)


# --------------------------------------------------------------------------
# files the original systems wrote
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rel", "fmt"),
    [("tinyllama/weights.bin", "tinyllama"), ("datacode/model_mnist.nn", "datacode"),
     ("datacode/model_mnist_sh.nn", "datacode")],
)  # fmt: skip
def test_an_original_file_through_object_storage_comes_back_byte_for_byte(
    mem: str, conformance: Path, rel: str, fmt: str
) -> None:
    """Uploaded as it is, read by ranges, and written back: the original system's bytes."""
    from conftest import assert_bits_equal

    original = conformance / rel
    fs = fsspec.filesystem("memory")
    root = mem.removeprefix("memory://")
    fs.put_file(str(original), f"{root}/in/{original.name}")
    tree, meta = ptio.load_with_meta(f"{mem}/in/{original.name}")
    assert_bits_equal(tree, ptio.load(original))
    ptio.save(f"{mem}/out/{original.name}", tree, format=fmt, meta=meta)
    assert fs.cat_file(f"{root}/out/{original.name}") == original.read_bytes()


def test_an_original_directory_uploaded_by_another_tool_loads(mem: str, conformance: Path) -> None:
    """cl-waffe2's own save, copied object by object (no commit object): read as it is."""
    from conftest import assert_bits_equal

    original = conformance / "waffe2" / "tiny_adam3_opt.wf2model"
    fs = fsspec.filesystem("memory")
    fs.put(str(original), mem.removeprefix("memory://") + "/wf", recursive=True)
    assert_bits_equal(ptio.load(mem + "/wf", format="waffe2"), ptio.load(original, format="waffe2"))
    assert ptio.inspect(mem + "/wf").format == "waffe2"
