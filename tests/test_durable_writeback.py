"""Durable saves start the write-out of their pages while writing (sync_file_range hints)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pytreeio as ptio
from pytreeio import io as pio


def _tree() -> dict[str, Any]:
    return {f"l{i}": np.arange(i * 7, i * 7 + 50_000, dtype=np.float32) for i in range(8)}


@pytest.mark.parametrize("fmt", ["msgpack", "safetensors"])
def test_durable_save_hints_write_out_every_few_bytes(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(pio, "_WRITEBACK_EVERY", 1 << 16)
    monkeypatch.setattr(pio, "_SYNC_FILE_RANGE", [lambda *a: calls.append(a) or 0])
    tree = _tree()
    path = tmp_path / f"t.{fmt}"
    ptio.save(path, tree)
    nbytes = sum(a.nbytes for a in tree.values())
    assert len(calls) >= nbytes // (1 << 16) - 1
    assert all(c[1:] == (0, 0, pio._SYNC_FILE_RANGE_WRITE) for c in calls)
    back = ptio.load(path, like=tree)
    assert all(back[k].tobytes() == v.tobytes() for k, v in tree.items())
    calls.clear()
    ptio.save(path, tree, durable=False)
    assert calls == []


def test_real_sync_file_range_or_none_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pio, "_SYNC_FILE_RANGE", [])
    monkeypatch.setattr(pio, "_WRITEBACK_EVERY", 1 << 16)
    fn = pio._sync_file_range()
    assert (fn is not None) == sys.platform.startswith("linux")
    tree = _tree()
    ptio.save(tmp_path / "t.safetensors", tree)
    back = ptio.load(tmp_path / "t.safetensors")
    assert all(back[k].tobytes() == v.tobytes() for k, v in tree.items())
