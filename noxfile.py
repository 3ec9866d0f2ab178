"""Developer sessions: tests, lint, typecheck, docs, bench."""

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
    """ruff check + format check, and the layers contract (import-linter)."""
    session.install("ruff>=0.6", "import-linter>=2.1", "-e", ".")
    session.run("ruff", "check", "pytreeio", "tests", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "pytreeio", "tests", "examples", "noxfile.py")
    session.run("lint-imports")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over the package."""
    session.install("-e", ".[test]", "mypy>=1.10")
    session.run("mypy", "pytreeio")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site (MkDocs Material + mkdocstrings), built strictly into ``site/``:
    a broken link, a missing page or an API name that does not resolve fails the build.
    ``nox -s docs -- serve`` serves it locally instead."""
    session.install("-e", ".[docs]")
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
    else:
        session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark suite: cold loads, saves, first load per tensor, peak memory (not a test).

    Every load is the first in a fresh process, page cache warm and dropped, against raw
    reads of the same bytes; prints a markdown table with PASS/MISS per target and writes
    tests/bench/results/latest.json and latest.md. Arguments go to the suite
    (``nox -s bench -- --size 64 --only msgpack --old ../pytreeio-old``).

    Without arguments the object-storage benchmark follows (tests/bench/bench_cloud.py:
    saves, loads and lazy reads at s3:// URLs on a local moto server, against s3fs moving
    the same bytes); ``nox -s bench -- cloud --mb 16 --repeats 1`` runs only that one.
    """
    session.install("-e", ".[bench]")
    if session.posargs[:1] == ["cloud"]:
        session.run("python", "tests/bench/bench_cloud.py", *session.posargs[1:])
        return
    session.run("python", "tests/bench/bench_all.py", *session.posargs)
    if not session.posargs:
        session.run("python", "tests/bench/bench_cloud.py")


@nox.session(python=PYTHON)
def multiprocess(session: nox.Session) -> None:
    """Sharded arrays across devices and processes: the 8-device cases and the real
    two-process save and load (``jax.distributed`` on loopback, gloo collectives)."""
    session.install("-e", ".[test]")
    session.run(
        "python", "-m", "pytest", "-p", "no:xdist", "tests/test_sharding.py", *session.posargs
    )


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """The structure-aware fuzzer: 100,000 inputs per format (not part of the tests).

    Every input goes through sniffing, decode, inspect, verify, load(like=) and
    to_model; only pytreeio errors, no hang, memory <= input + 64 MiB and CPU
    time <= 0.25 s + 200 ns/B per input.  The formats run one after another
    on one core; ``nox -s fuzz -- msgpack -n 100000`` fuzzes one format.
    """
    session.install("-e", ".[test]")
    session.run("python", "tests/fuzz.py", *(session.posargs or ["-n", "100000"]))
