"""A real S3 server for the tests: moto in server mode, in a subprocess on a free loopback port.

Fixtures (registered for every test file by ``tests/conftest.py``):

* ``s3_endpoint`` (session): the server's URL, ``http://127.0.0.1:PORT``;
* ``s3_options``: the ``storage_options`` for s3fs against it (a fresh dict per test);
* ``s3_root``: a fresh, empty bucket, as ``"s3://<bucket>"``; the server's state is reset
  after the test.

Everything skips when moto, s3fs or boto3 is not installed.  While ``s3_root`` is in use, the
AWS environment holds dummy credentials, no shared config or credentials files, no instance
metadata lookups, and ``AWS_ENDPOINT_URL`` points at a closed loopback port: a client that
is not given the endpoint fails at once instead of reaching real AWS.

`MotoServer` is used by ``tests/bench/bench_cloud.py`` too, which runs without pytest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from processes import free_port

try:
    import pytest
except ModuleNotFoundError:  # the benchmark imports MotoServer without the test extra
    pytest = None  # type: ignore[assignment]

#: Credentials moto accepts (it checks none); never real ones.
DUMMY_KEY = "testing"
#: Loopback port 9 (discard): nothing listens, so a connection there is refused at once.
DEAD_ENDPOINT = "http://127.0.0.1:9"
START_TIMEOUT_S = 60.0

# Without a proxy: the server is on loopback, and an HTTP(S)_PROXY from the environment
# must not see the requests.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (any status counts)."""
    try:
        with _DIRECT.open(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 and a free port, as a context manager.

    Waits until the server answers (``START_TIMEOUT_S`` at most, retrying on another port
    if the process exits first: the port may have been taken meanwhile); on exit
    terminates it, then kills it if it has not stopped within 5 s.
    """

    def __init__(self, attempts: int = 3) -> None:
        self.attempts = attempts
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = ""
        self._logdir = Path(tempfile.mkdtemp(prefix="pytreeio-moto-"))
        self.log = self._logdir / "moto.log"

    def __enter__(self) -> MotoServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        env = dict(os.environ)
        env.update(AWS_ACCESS_KEY_ID=DUMMY_KEY, AWS_SECRET_ACCESS_KEY=DUMMY_KEY)
        env.update(AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
        failures = []
        for _ in range(self.attempts):
            port = free_port()
            self.endpoint = f"http://127.0.0.1:{port}"
            # The request log goes to a file: a pipe nobody reads would fill up and stall it.
            with self.log.open("ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if _answers(self.endpoint + "/moto-api/"):
                    return
                time.sleep(0.1)
            code = self.proc.poll()
            self._end_process()
            if code is None:
                raise RuntimeError(
                    f"moto server at {self.endpoint} did not answer within {START_TIMEOUT_S:g} s;"
                    f" log: {self.log_tail()}"
                )
            failures.append(f"port {port}: exit {code}")
        raise RuntimeError(f"moto server did not start ({failures}); log: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def reset(self) -> None:
        """Every bucket and object dropped (moto's own reset call)."""
        req = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        with _DIRECT.open(req, timeout=10):
            pass

    def _end_process(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def stop(self) -> None:
        self._end_process()
        shutil.rmtree(self._logdir, ignore_errors=True)


def options_for(endpoint: str) -> dict[str, Any]:
    """The ``storage_options`` of s3fs for the server at ``endpoint``."""
    return {"endpoint_url": endpoint, "key": DUMMY_KEY, "secret": DUMMY_KEY}


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=DUMMY_KEY,
        aws_secret_access_key=DUMMY_KEY,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    client.close()


def isolate_aws_env(set_env: Any, del_env: Any, home: Path) -> None:
    """Dummy credentials and no way to real AWS, through ``set_env(name, value)`` and
    ``del_env(name)`` (a monkeypatch's, so the test's end restores the environment)."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        del_env(name)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        del_env(name)
    set_env("AWS_ACCESS_KEY_ID", DUMMY_KEY)
    set_env("AWS_SECRET_ACCESS_KEY", DUMMY_KEY)
    set_env("AWS_DEFAULT_REGION", "us-east-1")
    set_env("AWS_EC2_METADATA_DISABLED", "true")
    set_env("AWS_CONFIG_FILE", str(home / "no-aws-config"))
    set_env("AWS_SHARED_CREDENTIALS_FILE", str(home / "no-aws-credentials"))
    set_env("AWS_ENDPOINT_URL", DEAD_ENDPOINT)
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    set_env("NO_PROXY", no_proxy)
    set_env("no_proxy", no_proxy)


if pytest is not None:

    @pytest.fixture(scope="session")
    def _moto_server() -> Iterator[MotoServer]:
        pytest.importorskip("moto.server", reason="moto[server] is not installed")
        pytest.importorskip("boto3", reason="boto3 is not installed")
        with MotoServer() as server:
            yield server

    @pytest.fixture(scope="session")
    def s3_endpoint(_moto_server: MotoServer) -> str:
        """The URL of the session's moto S3 server (``http://127.0.0.1:PORT``)."""
        return _moto_server.endpoint

    @pytest.fixture
    def s3_options(s3_endpoint: str) -> dict[str, Any]:
        """``storage_options`` for s3fs against the test server (a fresh dict per test)."""
        pytest.importorskip("s3fs", reason="s3fs is not installed")
        return options_for(s3_endpoint)

    @pytest.fixture
    def s3_root(
        _moto_server: MotoServer,
        s3_options: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[str]:
        """A fresh empty bucket on the test server, ``"s3://<bucket>"``."""
        isolate_aws_env(
            monkeypatch.setenv,
            lambda name: monkeypatch.delenv(name, raising=False),
            tmp_path_factory.mktemp("aws-home"),
        )
        bucket = f"ptio-{uuid.uuid4().hex[:16]}"
        create_bucket(_moto_server.endpoint, bucket)
        try:
            yield f"s3://{bucket}"
        finally:
            # s3fs keeps listings per filesystem instance; the next test's bucket is another
            with contextlib.suppress(OSError):
                _moto_server.reset()
