"""A progress display for long operations of the ``pytreeio`` command.

The API has no progress hooks, so nothing here pretends to know how far an
operation has got.  `activity` shows, on a terminal only and for work
over `THRESHOLD` bytes, a transient ``rich`` line with a spinner, an
indeterminate (pulsing) bar, what is being done and on how many bytes, and
the bytes this process has actually read and written so far (the kernel's
``rchar``/``wchar`` counters of ``/proc/self/io``, polled from a background
thread; left out where the platform has no such counters), the rate and the
elapsed time.  No percentage is shown: the size of the output of a conversion
is not known before it is written.

``rich`` is imported only when a display is shown, so importing this module
costs nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

__all__ = ["THRESHOLD", "activity", "path_size", "should_show", "io_counters", "human"]

#: Work on fewer bytes than this finishes too quickly to be worth a display.
THRESHOLD = 100 * 1000 * 1000

#: Seconds between two polls of the I/O counters.
POLL_S = 0.2


def human(n: float) -> str:
    """``1.2 GB``-style size (decimal units, as transfer rates are usually given)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def path_size(path: str | os.PathLike[str]) -> int:
    """Bytes of the checkpoint at ``path``: a file, a directory (recursively) or a sibling set.

    For a path that does not exist (a sibling-file stem such as netcl's
    ``ckpt`` for ``ckpt.npz`` + ``ckpt.json``) the files named ``<path>.*``
    are counted.  Errors count as 0: this only decides whether to show a display.
    """
    p = Path(path)
    try:
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            total = 0
            for root, _, files in os.walk(p):
                for name in files:
                    with suppress(OSError):
                        total += os.stat(os.path.join(root, name)).st_size
            return total
        parent = p.parent if str(p.parent) else Path(".")
        return sum(
            q.stat().st_size
            for q in parent.iterdir()
            if q.name.startswith(p.name + ".") and q.is_file()
        )
    except OSError:
        return 0


def should_show(nbytes: int, stream: IO[str] | None = None) -> bool:
    """Whether a display is worth showing for ``nbytes`` of work on ``stream`` (default stderr)."""
    stream = sys.stderr if stream is None else stream
    if stream is None or nbytes < THRESHOLD:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def io_counters() -> tuple[int, int] | None:
    """``(bytes read, bytes written)`` by this process so far, or None where unavailable."""
    try:
        with open("/proc/self/io", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if value.strip().isdigit():
            values[name.strip()] = int(value)
    if "rchar" not in values or "wchar" not in values:
        return None
    return values["rchar"], values["wchar"]


@contextmanager
def activity(
    description: str,
    nbytes: int,
    *,
    stream: IO[str] | None = None,
    show: bool | None = None,
    counters: bool = True,
) -> Iterator[None]:
    """Show a transient progress display while the body runs (see the module docstring).

    Args:
      description: what is being done (``"verifying ckpt.bin"``).
      nbytes: the size of the work in bytes (shown, and compared to `THRESHOLD`).
      stream: where to draw (default: ``sys.stderr`` at call time).
      show: force the display on or off (default: `should_show`).
      counters: show the bytes read and written; pass False for work that reads
        through memory maps, which the counters do not see.
    """
    stream = sys.stderr if stream is None else stream
    if not (should_show(nbytes, stream) if show is None else show):
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(file=stream, force_terminal=True)
    display = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        TextColumn("{task.fields[io]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        redirect_stdout=False,
    )
    start = io_counters() if counters else None
    t0 = time.monotonic()
    task = display.add_task(f"{description} ({human(nbytes)})", total=None, io="")
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            now = io_counters()
            if start is None or now is None:
                continue
            read, written = now[0] - start[0], now[1] - start[1]
            elapsed = max(time.monotonic() - t0, 1e-9)
            rate = (read + written) / elapsed
            fields: dict[str, Any] = {
                "io": f"read {human(read)}, written {human(written)}, {human(rate)}/s"
            }
            display.update(task, **fields)

    thread = threading.Thread(target=poll, name="pytreeio-progress", daemon=True)
    with display:
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
