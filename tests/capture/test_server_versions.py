"""The suites' server choice itself (a test parametrized with a plugin on 18 gets its database on PostgreSQL 18), and
what differs little between servers: a partitioned table, on each plugin and server."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from capture_util import capture, drop_slots, fresh_database, records, sql
from sources import ON_BOTH_SERVERS, Source

from capture.messages import Plugin
from eventstore.log import Log
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


@pytest.mark.parametrize("plugin", ON_BOTH_SERVERS, ids=str, indirect=True)
def test_a_partitioned_table_is_captured_through_its_partitions(
    plugin: Plugin, server: LocalPostgres, tmp_path: Path
) -> None:
    """Snapshot and stream put each row in its partition's topic, once; the parent (no rows of its own, never
    named by the stream) has no topic. (wal2json's snapshot used to read the parent too: every row a second time,
    in a topic no change followed.)"""
    dsn = fresh_database(server, "parts")
    try:
        sql(dsn, "CREATE TABLE m (id int, day date, v text, PRIMARY KEY (id, day)) PARTITION BY RANGE (day)",
            "CREATE TABLE m_jan PARTITION OF m FOR VALUES FROM ('2024-01-01') TO ('2024-02-01')",
            "CREATE TABLE m_feb PARTITION OF m FOR VALUES FROM ('2024-02-01') TO ('2024-03-01')",
            "INSERT INTO m VALUES (1, '2024-01-05', 'a'), (2, '2024-02-05', 'b')")  # fmt: skip
        log_dir = tmp_path / "log"
        capture(log_dir, dsn, plugin=plugin)
        sql(dsn, "INSERT INTO m VALUES (3, '2024-01-09', 'c')", "UPDATE m SET v = 'B' WHERE id = 2")
        capture(log_dir, dsn, plugin=plugin)
        with Log(log_dir) as log:
            topics = sorted(t for t in log.topics() if t.startswith("cdc."))
        assert topics == ["cdc.public.m_feb", "cdc.public.m_jan"]
        ops = {t: [(v["op"], v["after"]["id"]) for _, v, _ in records(log_dir, t) if v is not None] for t in topics}
        assert ops == {"cdc.public.m_jan": [("r", 1), ("c", 3)], "cdc.public.m_feb": [("r", 2), ("u", 2)]}
    finally:
        drop_slots(dsn)
