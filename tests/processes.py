"""What tests that start other processes share: a free loopback port, and whether this jax
has the CPU collectives (gloo) that two ``jax.distributed`` processes need."""

from __future__ import annotations

import socket


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
