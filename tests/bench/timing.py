"""Round-robin timing: every case once per round, R rounds, best and median of each.

Interleaving gives every case the same machine conditions (page cache,
writeback, the neighbours' load), which on a shared machine matter more than
anything measured; a case run R times in a row would see other conditions
than the case after it.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Case:
    """One timed operation; ``setup`` runs untimed before every run of it, ``teardown`` after."""

    name: str
    fn: Callable[[], Any]
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None
    times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def best(self) -> float:
        return min(self.times) if self.times else float("nan")

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def race(cases: list[Case], repeat: int, log: Callable[[str], None] | None = None) -> None:
    """Run every case once per round for ``repeat`` rounds, recording each time.

    A case that raises is reported (``error``) and left out of later rounds,
    so one broken format does not stop the suite.
    """
    for r in range(repeat):
        for case in cases:
            if case.error is not None:
                continue
            try:
                if case.setup is not None:
                    case.setup()
                gc.collect()
                t0 = time.perf_counter()
                result = case.fn()
                case.times.append(time.perf_counter() - t0)
                del result
            except Exception as exc:  # a benchmark reports failures, it does not stop on them
                case.error = f"{type(exc).__name__}: {exc}"[:300]
                if log is not None:
                    log(f"  {case.name}: {case.error}")
            finally:
                if case.teardown is not None:
                    case.teardown()
        if log is not None:
            log(f"  round {r + 1}/{repeat} done")


def removed(path: Path) -> Callable[[], None]:
    """Teardown of a timed write: its output goes, and with it the page cache it holds.

    Without it every case's output of every round stays cached, and on a
    machine whose memory the suite's files nearly fill, later writes pay the
    reclaim of earlier ones (cases writing most paid most: ±0.3 between runs).
    """

    def teardown() -> None:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    return teardown


def fresh(path: Path) -> Callable[[], None]:
    """Setup for a timed write: no destination, and no dirty pages left by earlier writes."""

    remove = removed(path)

    def setup() -> None:
        remove()
        os.sync()

    return setup
