"""Fixtures of the capture tests: the decoding plugin the acceptance suites run with, and on which server.

``plugin`` runs a test once per plugin on PostgreSQL 15 (Debian's, the one with wal2json). A suite that must also
run on PostgreSQL 18 asks for it with ``@pytest.mark.parametrize("plugin", ON_BOTH_SERVERS, indirect=True)``: then
its ``server`` fixture (tests/conftest.py) is the version of the plugin's :class:`Source` (18 has pgoutput only).
A source on 18 refuses to run a test that does not take its database from ``server``, so no test claims 18 while
running on 15.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from replicas import TABLE, Pair
from sources import PLUGINS, Source

from capture.messages import Plugin
from tideline.pgharness import LocalPostgres


@pytest.fixture(params=PLUGINS, ids=str)
def plugin(request: pytest.FixtureRequest) -> Plugin:
    """The logical decoding plugin the connector streams with (pgoutput: publications managed, ``filtered``)."""
    source = request.param
    assert isinstance(source, Source)
    if source.server_version != 15 and "server" not in request.fixturenames:
        raise pytest.UsageError(f"{request.node.nodeid}: runs on PostgreSQL {source.server_version} but takes no "
                                "'server' fixture: its database would be on 15")  # fmt: skip
    return source.plugin


@pytest.fixture
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pair]:
    """A running primary (``indirect`` parameter: its version) with the table ``acct``, and its running hot
    standby (tests/capture/replicas.py)."""
    version = request.param
    primary = LocalPostgres(tmp_path / "primary", fast=True, version=version)
    standby: LocalPostgres | None = None
    try:
        primary.start()
        db = f"failover{version}"
        primary.create_database(db)
        with psycopg.connect(primary.dsn_for(db), autocommit=True) as c:
            c.execute(TABLE)
        standby = primary.standby(tmp_path / "standby")
        standby.start()
        yield Pair(primary, standby, db)
    finally:
        for cluster in (standby, primary):
            if cluster is not None:
                cluster.stop()
