"""The process-wide thread pools work in a forked child that inherited them in use."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from pytreeio import io
from pytreeio.core import threads as pools
from pytreeio.core import transpose


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pools_used_before_a_fork_work_in_the_child(tmp_path) -> None:
    x = np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024)
    out = np.empty((1024, 2048), np.float32)
    transpose.copy_transposed(x.T, out)  # starts the shared pool
    assert pools._POOL._pool is not None
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(range(256)) * ((io.reads._PARALLEL_MIN // 256) + 1))
    assert bytes(io.read_file(big)[:4]) == b"\x00\x01\x02\x03"  # starts the read pool
    pid = os.fork()
    if pid == 0:  # the child: both pools again, with a watchdog against a hang
        import signal

        signal.alarm(60)
        ok = False
        try:
            again = np.empty_like(out)
            transpose.copy_transposed(x.T, again)
            ok = again.tobytes() == x.T.copy().tobytes()
            ok = ok and bytes(io.read_file(big)[-2:]) == b"\xfe\xff"
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    sys.stdout.flush()
