"""A child process that saves in a loop and reports on stdout, for the SIGKILL tests.

The child prints ``ready``, then ``start V`` / ``done V`` around each save of
version V (and whatever else its script prints); the parent waits for words,
kills it with SIGKILL at a moment of its choosing and asks which versions the
destination may hold afterwards.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class SaverProcess:
    """A saver child running ``script`` with ``args``, and the lines it printed."""

    def __init__(self, script: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdout=subprocess.PIPE,
            # unbuffered: a buffered reader's readline can pull the next lines into its
            # buffer, where neither select() nor communicate() (which reads the raw fd)
            # sees them, and a kill's verdict would miss a "start" the child did print
            bufsize=0,
            env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
            cwd=str(REPO),
        )
        self.lines: list[str] = []
        self.times: list[float] = []

    @property
    def save_seconds(self) -> float:
        """How long the first save took (from its "start" to its "done" line)."""
        return self.times[1] - self.times[0] if len(self.times) > 1 else 0.1

    def wait_for(self, word: str, timeout: float = 60.0) -> None:
        """Read lines until one starts with ``word`` (failing the test after ``timeout`` s)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while not any(line.startswith(word) for line in self.lines):
            left = deadline - time.monotonic()
            assert left > 0, f"child never printed {word!r}: {self.lines}"
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline().decode()
                assert line, f"child exited ({self.proc.poll()}) before {word!r}: {self.lines}"
                self.lines.append(line.strip())
                self.times.append(time.monotonic())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        out, _ = self.proc.communicate(timeout=30)
        self.lines += [line for line in out.decode().split("\n") if line]
        assert self.proc.returncode == -signal.SIGKILL, self.proc.returncode

    def possible_versions(self, previous: int | None = None) -> set[int]:
        """The version on disk before the last save it started, and that save's version."""
        # A kill can cut a line short (an unbuffered stdout writes print's parts one by
        # one): "done" without its number says no more than the "start" before it.
        done = [int(p[1]) for p in map(str.split, self.lines) if p[:1] == ["done"] and len(p) > 1]
        started = [
            int(p[1]) for p in map(str.split, self.lines) if p[:1] == ["start"] and len(p) > 1
        ]
        out = {started[-1]} if started else set()
        if done:
            out.add(done[-1])
        elif previous is not None:
            out.add(previous)
        return out
