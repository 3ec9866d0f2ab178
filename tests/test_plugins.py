"""Plug-in formats: installed distributions add formats through the entry-point group
``pytreeio.formats``, seen by the API and the command line as the built-in ones are.

Each test installs its plug-ins as pip does - a module plus a ``<dist>-<version>.dist-info``
directory with ``entry_points.txt`` - into a directory on ``sys.path`` (``PYTHONPATH`` for the
command line), where ``importlib.metadata`` finds them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio.formats import registry

REPO = Path(__file__).resolve().parents[1]
MODULE = "pytreeio_toyfmt"
LATER = "pytreeio_toylater"  # a module written after its entry point

#: A tiny format: 8 magic bytes, the header's length, a JSON header, then each array's bytes.
TOY_SOURCE = '''
"""A toy plug-in format for pytreeio's tests."""

import json
import struct

import numpy as np

import pytreeio as ptio
from pytreeio.core.records import MAGIC

HEAD = b"PTIOTOY1"


def encode(tree, *, meta=None, note=""):
    arrays, chunks, offset = {}, [], 0
    for key, leaf in ptio.flatten(tree).items():
        a = np.asarray(leaf)
        arrays[key] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset}
        chunks.append(a.tobytes())
        offset += a.nbytes
    doc = {"meta": dict(meta or {}), "note": note, "arrays": arrays}
    header = json.dumps(doc).encode()
    return ptio.Encoded(chunks=(HEAD, struct.pack("<Q", len(header)), header, *chunks))


def _header(read, size, name):
    if size < 16 or bytes(read(0, 8, "magic")) != HEAD:
        raise ptio.FormatError("not a toy file", path=name, offset=0, field="magic")
    (n,) = struct.unpack("<Q", bytes(read(8, 8, "header length")))
    try:
        return json.loads(bytes(read(16, n, "header"))), 16 + n
    except ValueError as exc:
        raise ptio.FormatError(f"bad header: {exc}", path=name, offset=16, field="header")


def decode(source):
    data = bytes(source)
    doc, base = _header(lambda o, n, field: data[o : o + n], len(data), None)
    flat = {}
    for key, e in doc["arrays"].items():
        dtype, count = np.dtype(e["dtype"]), int(np.prod(e["shape"], dtype=np.int64))
        a = np.frombuffer(data, dtype, count, base + e["offset"])
        flat[key] = a.reshape(tuple(e["shape"])).copy()
    return ptio.Decoded(ptio.unflatten(flat), doc["meta"])


def inspect(source):
    doc, _ = _header(source.read, source.size, source.name)
    entries = tuple(
        ptio.Entry(k, tuple(e["shape"]), np.dtype(e["dtype"]).name,
                   int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(e["dtype"]).itemsize)
        for k, e in doc["arrays"].items()
    )
    return ptio.Info(format="toy", entries=entries, meta=doc["meta"])


def sniff(probe):
    return MAGIC if probe.is_file and probe.head[:8] == HEAD else 0.0


TOY = ptio.Format(
    name="toy",
    description="a toy plug-in format",
    suffixes=(".toy",),
    layout=ptio.FILE,
    encode=encode,
    decode=decode,
    inspect=inspect,
    sniff=sniff,
)


def make_toyf():
    return TOY._replace(name="toyf", suffixes=(".toyf",))


def make_toym():
    return TOY._replace(name="toym", suffixes=(".msgpack",))


def make_twin():
    return TOY._replace(name="twin")


def make_junk():
    return "not a format"


def make_bad():
    def encode_any(tree, **options):
        return encode(tree)

    return TOY._replace(name="bad", encode=encode_any)


def make_relist():
    assert "relist" not in ptio.list_formats()  # not itself: it is being loaded
    return TOY._replace(name="relist", suffixes=(".relist",))


NOT_A_FORMAT = 42
'''


def install(site: Path, dist: str, *entry_points: str, version: str = "0.1") -> Path:
    """Install distribution ``dist`` into ``site`` as pip does: its dist-info directory."""
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[pytreeio.formats]\n" + "\n".join(entry_points) + "\n")
    importlib.invalidate_caches()  # what a process must do to see files added while it runs
    return info


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path holding the toy module (no distribution installed yet)."""
    root = tmp_path / "site"
    root.mkdir()
    (root / f"{MODULE}.py").write_text(TOY_SOURCE)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(registry, "_PLUGINS", {})  # the plug-ins loaded here stay here
    yield root
    for module in (MODULE, LATER):  # the next test's modules are other files
        sys.modules.pop(module, None)


def toy_site(site: Path) -> Path:
    install(site, MODULE, f"toy = {MODULE}:TOY")
    return site


def tree() -> dict[str, Any]:
    nan_with_payload = np.array([0x7FC01234, 0xFF800001], np.uint32).view(np.float32)
    return {
        "params": {
            "Dense_0": {
                "kernel": np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32),
                "nans": nan_with_payload,
            }
        },
        "step": np.array(7, np.int64),
        "mask": np.array([1, 0, 255], np.uint8),
    }


def assert_bits(a: Any, b: Any) -> None:
    fa, fb = ptio.flatten(a), ptio.flatten(b)
    assert list(fa) == list(fb)
    for key in fa:
        x, y = np.asarray(fa[key]), np.asarray(fb[key])
        assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), key


def cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-m", "pytreeio.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


# --------------------------------------------------------------------------
# a working plug-in
# --------------------------------------------------------------------------


def test_a_plugin_is_listed_after_the_builtins_and_round_trips_bit_for_bit(site: Path) -> None:
    toy_site(site)
    formats = ptio.list_formats()
    toy = sys.modules[MODULE].TOY
    assert formats["toy"] is toy and registry.get("toy") is toy
    assert list(formats)[: len(registry.BUILTIN)] == list(registry.BUILTIN)

    path = site / "w.toy"
    ptio.save(path, tree(), meta={"run": "a"}, note="hi")  # the suffix picks the plug-in
    assert path.read_bytes()[:8] == b"PTIOTOY1"
    assert path.read_bytes() == bytes(
        ptio.encode(tree(), format="toy", meta={"run": "a"}, note="hi")
    )
    back, meta = ptio.load_with_meta(path)  # sniffed from the content
    assert_bits(back, tree())
    assert meta == {"run": "a"}
    assert_bits(ptio.load(path, format="toy"), tree())
    elsewhere = site / "w.bin"  # no suffix of any format: the content alone tells
    elsewhere.write_bytes(path.read_bytes())
    assert_bits(ptio.load(elsewhere), tree())

    info = ptio.inspect(path)
    assert info.format == "toy" and info.meta == {"run": "a"}
    assert {e.name: e.shape for e in info.entries}["params/Dense_0/kernel"] == (3, 2)
    with pytest.raises(TypeError, match="note"):
        ptio.load(path, note="x")  # the plug-in's options are checked as a built-in's are


def test_an_entry_point_may_name_a_function_that_returns_the_format(site: Path) -> None:
    install(site, MODULE, f"toyf = {MODULE}:make_toyf")
    toyf = registry.get("toyf")
    assert toyf.name == "toyf" and registry.get("toyf") is toyf is ptio.list_formats()["toyf"]
    assert registry.for_suffix("x.TOYF") is toyf
    path = site / "w.toyf"
    ptio.save(path, tree())
    assert_bits(ptio.load(path, format="toyf"), tree())


def test_the_command_line_lists_inspects_verifies_and_converts_a_plugin(site: Path) -> None:
    toy_site(site)
    path = site / "w.toy"
    ptio.save(path, tree(), meta={"run": "a"})

    done = cli(site, "formats")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("toy "))
    assert ".toy" in line and "a toy plug-in format" in line
    assert "note" in done.stdout  # its save option
    listed = json.loads(cli(site, "formats", "--json").stdout)
    assert listed["toy"]["suffixes"] == [".toy"] and listed["toy"]["save_options"] == ["note"]
    assert "toy" in cli(site, "--help").stdout

    done = cli(site, "inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert "format toy" in done.stdout and "params/Dense_0/kernel" in done.stdout
    assert cli(site, "verify", str(path)).returncode == 0

    done = cli(site, "convert", str(path), str(site / "w.safetensors"), "--to", "safetensors")
    assert done.returncode == 0, done.stderr
    done = cli(site, "convert", str(site / "w.safetensors"), str(site / "x.toy"), "--to", "toy")
    assert done.returncode == 0, done.stderr
    assert_bits(ptio.load(site / "x.toy", format="toy"), tree())


def test_a_plugin_whose_function_lists_the_formats_loads_without_warnings(site: Path) -> None:
    install(site, MODULE, f"relist = {MODULE}:make_relist")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relist = ptio.list_formats()["relist"]
    assert relist is registry.get("relist") and registry.for_suffix("a.relist") is relist


# --------------------------------------------------------------------------
# plug-ins that cannot be used
# --------------------------------------------------------------------------


def test_a_broken_plugin_breaks_nothing_else_and_says_why_when_asked_for(site: Path) -> None:
    toy_site(site)
    install(site, "pytreeio_broken", "broken = pytreeio_no_such_module:FORMAT")
    with pytest.warns(ptio.PytreeioWarning, match="'broken'.*No module named") as seen:
        formats = ptio.list_formats()
    assert "broken" not in formats and "toy" in formats and set(registry.BUILTIN) <= set(formats)
    assert "pytreeio_broken 0.1" in str(seen[0].message)

    mp = site / "a.msgpack"
    ptio.save(mp, tree())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a built-in's file: the plug-ins are not even asked
        assert_bits(ptio.load(mp), tree())
    junk = site / "junk.bin"
    junk.write_bytes(bytes(64))
    no_format = pytest.raises(ptio.UnknownFormatError, match="matches no registered format")
    with pytest.warns(ptio.PytreeioWarning, match="'broken'"), no_format:  # sniffing skips it
        ptio.load(junk)
    assert_bits(ptio.load(mp, format="msgpack"), tree())

    with pytest.raises(ptio.UnknownFormatError) as raised:
        ptio.load(mp, format="broken")
    message = str(raised.value)
    for part in (str(mp), "'broken'", "pytreeio_no_such_module:FORMAT", "pytreeio_broken 0.1"):
        assert part in message
    assert "ModuleNotFoundError" in message
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)
    with pytest.raises(ptio.UnknownFormatError, match=r"'broken'.*failed to load"):
        ptio.save(site / "b.msgpack", tree(), format="broken")

    done = cli(site, "formats")
    assert done.returncode == 0 and "\ntoy " in "\n" + done.stdout
    warned = done.stderr.splitlines()
    assert len(warned) == 1 and warned[0].startswith("pytreeio: warning: plug-in format 'broken'")
    assert cli(site, "formats", "--quiet").stderr == ""
    done = cli(site, "inspect", str(mp), "--format", "broken")
    assert done.returncode == 1
    assert "pytreeio: error: " in done.stderr and "No module named" in done.stderr
    done = cli(site, "inspect", str(mp))
    assert done.returncode == 0 and "format msgpack" in done.stdout
    assert done.stderr == ""  # a built-in's file: the CLI did not even read the plug-ins
    done = cli(site, "--help")
    assert "broken" in done.stderr and "\n  toy " in done.stdout  # help lists them


@pytest.mark.parametrize(
    ("lines", "name", "why"),
    [
        ([f"wrong = {MODULE}:TOY"], "wrong", "is a Format named 'toy': the two names must"),
        ([f"junk = {MODULE}:NOT_A_FORMAT"], "junk", "names an object of type int: an entry point"),
        ([f"junkf = {MODULE}:make_junk"], "junkf", "returned an object of type str: an entry"),
        ([f"bad = {MODULE}:make_bad"], "bad", "is not a valid format: .*takes \\*\\*options"),
        ([f"gone = {MODULE}:NO_SUCH_NAME"], "gone", "failed to load: AttributeError"),
    ],
)
def test_a_plugin_that_is_no_format_is_refused_by_name(
    site: Path, lines: list[str], name: str, why: str
) -> None:
    install(site, MODULE, *lines)
    with pytest.raises(ptio.UnknownFormatError, match=f"plug-in format '{name}' .*{why}"):
        registry.get(name)
    with pytest.warns(ptio.PytreeioWarning, match=f"'{name}' .*{why}.*left out"):
        assert name not in ptio.list_formats()


def test_two_distributions_claiming_one_name_are_both_refused(site: Path) -> None:
    install(site, MODULE, f"twin = {MODULE}:make_twin")
    install(site, "pytreeio_other", f"twin = {MODULE}:TOY")
    with pytest.raises(ptio.UnknownFormatError, match="'twin' is provided by 2 entry points") as e:
        registry.get("twin")
    assert f"{MODULE} 0.1" in str(e.value) and "pytreeio_other 0.1" in str(e.value)


# --------------------------------------------------------------------------
# plug-ins extend the built-in and registered formats, never override them
# --------------------------------------------------------------------------


def test_a_plugin_named_like_a_builtin_is_never_used(site: Path) -> None:
    install(site, MODULE, f"msgpack = {MODULE}:TOY")
    builtin = registry.get("msgpack")
    assert builtin is not None and builtin.suffixes == (".msgpack", ".flax")
    with pytest.warns(ptio.PytreeioWarning, match="'msgpack' .*a built-in format has that name"):
        assert ptio.list_formats()["msgpack"] is builtin
    assert MODULE not in sys.modules  # not even imported


def test_a_plugin_cannot_take_a_builtin_suffix(site: Path) -> None:
    install(site, MODULE, f"toym = {MODULE}:make_toym")
    assert registry.for_suffix("a.msgpack") is registry.get("msgpack")
    ptio.save(site / "a.msgpack", tree())
    assert ptio.inspect(site / "a.msgpack").format == "msgpack"
    assert registry.get("toym").suffixes == (".msgpack",)  # by name it is there


def test_a_registered_format_takes_precedence_over_a_plugin_of_its_name(site: Path) -> None:
    toy_site(site)
    plugin = registry.get("toy")
    mine = registry.register(plugin._replace(description="mine", suffixes=(".mine",)))
    try:
        assert registry.get("toy") is mine and ptio.list_formats()["toy"] is mine
        assert registry.for_suffix("a.mine") is mine and registry.for_suffix("a.toy") is None
    finally:
        registry.unregister("toy")
    assert registry.get("toy") is plugin


# --------------------------------------------------------------------------
# when entry points are read
# --------------------------------------------------------------------------


def test_entry_points_are_read_only_when_what_is_loaded_does_not_answer(site: Path) -> None:
    toy_site(site)
    install(site, "pytreeio_broken", "broken = pytreeio_no_such_module:FORMAT")
    toy = site / "w.bin"  # a toy file whose suffix names no format: the content alone tells
    header = b'{"meta": {}, "arrays": {}}'
    toy.write_bytes(b"PTIOTOY1" + len(header).to_bytes(8, "little") + header)
    code = textwrap.dedent(
        f"""
        import importlib.metadata, sys
        reads = []
        real = importlib.metadata.entry_points
        def counted(**kw):
            reads.extend([kw] if kw.get("group") == "pytreeio.formats" else [])
            return real(**kw)
        importlib.metadata.entry_points = counted
        import numpy as np
        import pytreeio as ptio
        print(len(reads), {MODULE!r} in sys.modules)
        path = {str(site / "w.msgpack")!r}
        ptio.save(path, {{"a": np.ones(3)}})  # a built-in's suffix
        ptio.load(path, format="msgpack")  # a built-in's name
        ptio.load(path)  # a built-in's file, sniffed
        print(len(reads), {MODULE!r} in sys.modules)
        ptio.list_formats()  # a listing reads them, and loads the toy plug-in
        print(len(reads), {MODULE!r} in sys.modules)
        ptio.load({str(toy)!r})  # sniffed by the loaded plug-in
        ptio.load({str(toy)!r}, format="toy")
        print(len(reads), {MODULE!r} in sys.modules)
        ptio.list_formats()  # every listing reads them again
        print(len(reads))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")[:5]
    assert lines == ["0 False", "0 False", "1 True", "1 True", "2"]
    assert done.stderr.count("PytreeioWarning") == 1  # the broken one, once (the same line)


def test_a_plugin_installed_or_fixed_after_a_miss_is_found_and_once_loaded_stays(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[object] = []
    real = importlib.metadata.entry_points

    def counted(**kw: Any) -> Any:
        reads.extend([kw] if kw.get("group") == "pytreeio.formats" else [])
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", counted)
    with pytest.raises(ptio.UnknownFormatError, match="unknown format 'toy'"):
        registry.get("toy")
    assert registry.for_suffix("w.toy") is None and "toy" not in ptio.list_formats()

    info = install(site, MODULE, f"toy = {MODULE}:TOY")  # installed after those misses
    toy = registry.get("toy")
    assert toy is sys.modules[MODULE].TOY
    path = site / "w.toy"
    ptio.save(path, tree())
    (site / "w.bin").write_bytes(path.read_bytes())

    for f in info.iterdir():  # uninstalled, and its directory off sys.path
        f.unlink()
    info.rmdir()
    sys.path.remove(str(site))
    importlib.invalidate_caches()
    seen = len(reads)
    assert registry.get("toy") is toy and registry.for_suffix("x.TOY") is toy
    assert_bits(ptio.load(site / "w.bin"), tree())  # sniffed
    assert len(reads) == seen  # loaded, it is remembered as a registered format is
    assert ptio.list_formats()["toy"] is toy
    sys.path.insert(0, str(site))

    install(site, "pytreeio_later", f"later = {LATER}:FORMAT")  # its module not there yet
    with pytest.raises(ptio.UnknownFormatError, match=r"'later'.*No module named"):
        registry.get("later")
    with pytest.warns(ptio.PytreeioWarning, match=r"'later'.*left out"):
        assert registry.for_suffix("x.later") is None
    (site / f"{LATER}.py").write_text(
        f"from {MODULE} import TOY\nFORMAT = TOY._replace(name='later', suffixes=('.later',))\n"
    )
    importlib.invalidate_caches()
    later = registry.for_suffix("x.later")  # a broken plug-in is not remembered: tried again
    assert later is not None and later is registry.get("later") is sys.modules[LATER].FORMAT
