"""The suites' server choice itself: a test parametrized with a plugin on 18 gets its database on PostgreSQL 18."""

from __future__ import annotations

import psycopg
import pytest
from sources import ON_BOTH_SERVERS, Source

from capture.messages import Plugin
from tideline.pgharness import LocalPostgres


@pytest.mark.parametrize("plugin", ON_BOTH_SERVERS, ids=str, indirect=True)
def test_the_server_is_the_one_the_source_names(
    plugin: Plugin, server: LocalPostgres, request: pytest.FixtureRequest
) -> None:
    source = request.node.callspec.params["plugin"]
    assert isinstance(source, Source) and source.plugin is plugin
    with psycopg.connect(server.dsn) as c:
        assert c.info.server_version // 10000 == source.server_version


@pytest.mark.parametrize("server", [15, 18], indirect=True)
def test_an_indirect_server_parameter_is_that_version(server: LocalPostgres, request: pytest.FixtureRequest) -> None:
    with psycopg.connect(server.dsn) as c:
        assert c.info.server_version // 10000 == request.node.callspec.params["server"]
