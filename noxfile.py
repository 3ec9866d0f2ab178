"""Developer sessions: tests, lint, typecheck, bench."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.default_venv_backend = "venv"
PYTHON = "3.11"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite (CPU only; conformance files from ../shared/conformance)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-n", "2", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check + format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "pytreeio", "tests", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "pytreeio", "tests", "examples", "noxfile.py")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over the package."""
    session.install("-e", ".[test]", "mypy>=1.10")
    session.run("mypy", "pytreeio")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Throughput benchmarks against raw I/O and peer libraries (not a test; prints ratios)."""
    session.install("-e", ".[bench]")
    session.run("python", "tests/bench/bench_core.py", *session.posargs)
    session.run("python", "tests/bench/bench_tinyllama.py")
    session.run("python", "tests/bench/bench_quant.py")


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """The structure-aware fuzzer over every format's decoder and inspect (not part of the tests).

    ``nox -s fuzz -- msgpack -n 100000`` fuzzes one format; the default runs all of them.
    """
    session.install("-e", ".[test]")
    session.run("python", "tests/fuzz.py", *(session.posargs or ["-n", "100000"]))
