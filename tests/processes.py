"""What tests that start other processes share: a free loopback port, and whether this jax
has the CPU collectives (gloo) that two ``jax.distributed`` processes need."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now: take it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_missing() -> str | None:
    """Why two CPU processes cannot run collectives here, or None when they can."""
    import jax

    try:
        jax.config.jax_cpu_collectives_implementation  # noqa: B018
    except AttributeError:
        return "this jax has no CPU collectives option (gloo)"
    return None


def communicate(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    """``(stdout, stderr)`` of each process, waiting at most ``timeout`` seconds for each; any
    still running afterwards (a hang, or a failure that raised first) is killed."""
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outputs.append((out or "", err or ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def skip_without_gloo(log: str) -> None:
    """Skip the test when the processes' log says gloo collectives are not built in."""
    import pytest

    low = log.lower()
    if "gloo" in low and "not" in low and "unimplemented" in low:
        pytest.skip(f"gloo collectives are unavailable here: {log[-500:]}")
