"""Crash safety under real SIGKILLs and concurrent processes (io's module docstring).

A child process (``python -c``) saves version after version of a checkpoint
through :func:`pytreeio.io.write_atomic`; every byte of every file of version
``v`` is ``v``, so a torn file or a mixed set is visible at once.  The parent
kills it with SIGKILL at random moments (and once exactly between the two
renames of a sibling pair), then reads through :func:`pytreeio.io.open_source`
and checks that it sees one complete version: the last one the child
reported finished, or the one it was writing.  The next save must leave no
temporary behind.  Two savers racing on one destination while the parent
keeps reading must never produce or show a mix either.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
from saver_process import SaverProcess

from pytreeio import io
from pytreeio.core.records import DIRECTORY, FILE, Encoded, Siblings

SIZE = 24 << 20  # the big file of each version; the second one is a quarter of it


def _pair(p: Path) -> dict[str, Path]:
    return {"npz": p.with_name(p.name + ".npz"), "json": p.with_name(p.name + ".json")}


SIB = Siblings(locate=_pair, roles=("npz", "json"), linked=("npz", "json"))
LAYOUTS = {"siblings": SIB, "dir": DIRECTORY, "file": FILE}

CHILD = r"""
import os, sys, time
from pathlib import Path
import numpy as np
from pytreeio import io
from pytreeio.io import atomic
from pytreeio.core.records import DIRECTORY
from pytreeio.core.records import FILE
from pytreeio.core.records import Encoded
from pytreeio.core.records import Siblings

dest, layout, size, mode, base = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
durable = os.environ.get("CRASH_DURABLE") == "1"

def pair(p):
    return {"npz": p.with_name(p.name + ".npz"), "json": p.with_name(p.name + ".json")}

SIB = Siblings(locate=pair, roles=("npz", "json"), linked=("npz", "json"))

def encoded(v):
    a = np.full(size, v, np.uint8)
    b = np.full(size // 4, v, np.uint8)
    if layout == "siblings":
        return SIB, Encoded(files={"npz": Encoded((a,)), "json": Encoded((b,))})
    if layout == "dir":
        return DIRECTORY, Encoded(files={"a.bin": Encoded((a,)), "sub/b.bin": Encoded((b,))})
    return FILE, Encoded((a, b))

def pause_after_first(real):
    calls = []
    def hook(*args):
        real(*args)
        calls.append(args)
        if len(calls) == 1:
            print("between", flush=True)
            time.sleep(3600)
    return hook

if mode == "pause":  # stop between the two commit renames of a sibling pair
    atomic._rename = pause_after_first(atomic._rename)
elif mode == "fallback-pause":  # directory swap without renameat2, stopped between its renames
    atomic._exchange = lambda a, b: False
    os.rename = pause_after_first(os.rename)

k = 0
while True:
    v = base + k % 100 + 1
    lay, enc = encoded(v)
    print("start", v, flush=True)
    io.write_atomic(dest, enc, lay, durable=durable)
    print("done", v, flush=True)
    k += 1
"""


class Child(SaverProcess):
    """A saver of one io layout (see CHILD)."""

    def __init__(
        self, dest: Path, layout: str, mode: str = "loop", base: int = 0, durable: bool = False
    ) -> None:
        args = [str(dest), layout, str(SIZE), mode, str(base)]
        super().__init__(CHILD, args, env={"CRASH_DURABLE": "1" if durable else "0"})


def _version(dest: Path, layout: str) -> int:
    """The one version the checkpoint at ``dest`` holds, checking every byte of every file."""
    source = io.open_source(dest, LAYOUTS[layout])
    try:
        if layout == "file":
            arrays = {"file": np.frombuffer(source, np.uint8)}
            sizes = {"file": SIZE + SIZE // 4}
        else:
            arrays = {k: np.frombuffer(source[k], np.uint8) for k in source}
            big = "npz" if layout == "siblings" else "a.bin"
            small = "json" if layout == "siblings" else "sub/b.bin"
            sizes = {big: SIZE, small: SIZE // 4}
    finally:
        if hasattr(source, "close"):
            source.close()
    assert {k: len(a) for k, a in arrays.items()} == sizes, "missing or truncated files"
    versions = {int(a[0]) for a in arrays.values()}
    assert len(versions) == 1, f"a mix of versions {versions}"
    v = versions.pop()
    for name, a in arrays.items():
        assert (a == v).all(), f"{name} is torn"
    return v


def _leftovers(directory: Path) -> list[str]:
    return sorted(
        n for n in os.listdir(directory) if ".pytreeio-tmp-" in n or n.endswith("-journal")
    )


def _final_save_cleans_up(dest: Path, layout: str, directory: Path) -> None:
    lay = LAYOUTS[layout]
    a, b = np.full(10, 7, np.uint8), np.full(2, 7, np.uint8)
    if layout == "siblings":
        enc = Encoded(files={"npz": Encoded((a,)), "json": Encoded((b,))})
    elif layout == "dir":
        enc = Encoded(files={"a.bin": Encoded((a,)), "sub/b.bin": Encoded((b,))})
    else:
        enc = Encoded((a, b))
    io.write_atomic(dest, enc, lay, durable=False)
    assert _leftovers(directory) == []


@pytest.mark.parametrize(("layout", "rounds"), [("siblings", 15), ("dir", 5), ("file", 5)])
def test_sigkill_at_random_moments_leaves_old_or_new(
    tmp_path: Path, layout: str, rounds: int
) -> None:
    dest = tmp_path / "ckpt"
    rng = random.Random(1234)
    for i in range(rounds):
        # each round saves its own versions (base + 1, base + 2, ...) so rounds cannot be confused
        child = Child(dest, layout, base=10 * i, durable=i == 1)
        child.wait_for("done")  # started up and saved once: now kill it somewhere
        # somewhere in the next two to three saves, however fast this machine is now
        time.sleep(rng.uniform(0, 2.5 * child.save_seconds))
        child.kill()
        v = _version(dest, layout)
        assert v in child.possible_versions(), (v, child.lines[-4:])
        # a kill leaves at most the temporaries of the one save it interrupted
        assert len(_leftovers(tmp_path)) <= 3, _leftovers(tmp_path)
    _final_save_cleans_up(dest, layout, tmp_path)


@pytest.mark.parametrize(("layout", "mode"), [("siblings", "pause"), ("dir", "fallback-pause")])
def test_sigkill_between_the_renames_rolls_forward(tmp_path: Path, layout: str, mode: str) -> None:
    dest = tmp_path / "ckpt"
    child = Child(dest, layout)
    child.wait_for("done")
    child.kill()
    first = _version(dest, layout)
    assert first in child.possible_versions()
    child = Child(dest, layout, mode=mode, base=50)
    child.wait_for("between")
    child.kill()
    assert any(n.endswith("-journal") for n in os.listdir(tmp_path))
    if layout == "dir":
        assert not dest.exists()  # moved aside, the new tree not yet in place
    else:  # the new .npz with the old .json on disk: a load must not see that
        assert (tmp_path / "ckpt.npz").read_bytes()[:1] != (tmp_path / "ckpt.json").read_bytes()[:1]
    v = _version(dest, layout)
    assert v == 51  # rolled forward to the complete new version
    _final_save_cleans_up(dest, layout, tmp_path)


def test_concurrent_savers_and_a_reader_never_mix(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    reads = 0
    seen: set[int] = set()
    for _rep in range(2):
        savers = [Child(dest, "siblings", base=0), Child(dest, "siblings", base=100)]
        for s in savers:
            s.wait_for("done")
        # read for 1.5 s, longer on a loaded machine until both savers' versions were seen
        start = time.monotonic()
        while time.monotonic() < start + 1.5 or (
            time.monotonic() < start + 20
            and not (any(v <= 100 for v in seen) and any(v > 100 for v in seen))
        ):
            seen.add(_version(dest, "siblings"))
            reads += 1
        for s in savers:
            s.kill()
        v = _version(dest, "siblings")
        assert v in savers[0].possible_versions() | savers[1].possible_versions()
    assert reads > 5
    assert any(v <= 100 for v in seen) and any(v > 100 for v in seen), seen
    _final_save_cleans_up(dest, "siblings", tmp_path)
