"""``--publish-via-partition-root``: a partitioned table captured as one table, exact through ATTACH, DETACH and
DROP of its partitions (capture.partitions), on each plugin and server.

The topic of the partitioned table must equal ``SELECT * FROM`` it after every step: rows of a partition attached
with rows in it join (read once, by an incremental snapshot of them), rows of a partition detached or dropped leave
(a ``d`` event and a tombstone each), and what is written into a detached partition afterwards is not the root's.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from capture_util import capture, drop_slots, events, fresh_database, latest_by_key, run_connector, sql
from sources import ON_BOTH_SERVERS, Source

from capture.config import CaptureConfig
from capture.connector import Connector
from capture.messages import Plugin
from capture.publications import PublicationMode
from eventstore.errors import ConfigError
from eventstore.log import Log
from tideline.pgharness import LocalPostgres

TOPIC = "cdc.public.m"
SCHEMA = (
    "CREATE TABLE m (id int, region text, v int, PRIMARY KEY (id, region)) PARTITION BY LIST (region)",
    "CREATE TABLE m_eu PARTITION OF m FOR VALUES IN ('eu')",
    # a partitioned partition: its leaves' rows are the root's too
    "CREATE TABLE m_us PARTITION OF m FOR VALUES IN ('us', 'ca') PARTITION BY LIST (region)",
    "CREATE TABLE m_us_us PARTITION OF m_us FOR VALUES IN ('us')",
    "CREATE TABLE m_us_ca PARTITION OF m_us FOR VALUES IN ('ca')",
    "INSERT INTO m SELECT i, (ARRAY['eu', 'us', 'ca'])[1 + i % 3], 0 FROM generate_series(1, 30) i",
)


def table_rows(dsn: str, table: str = "m") -> dict[bytes, Any]:
    """``SELECT *`` as the topic's latest images are keyed (canonical JSON of the key)."""
    with psycopg.connect(dsn) as c:
        rows = c.execute(f"SELECT id, region, v FROM {table}").fetchall()
    return {orjson.dumps({"id": i, "region": r}, option=orjson.OPT_SORT_KEYS): {"id": i, "region": r, "v": v}
            for i, r, v in rows}  # fmt: skip


def topics(log_dir: Path) -> list[str]:
    with Log(log_dir) as log:
        return sorted(t for t in log.topics() if t.startswith("cdc.public."))


def reads_per_key(log_dir: Path) -> dict[int, int]:
    """How many ``r`` events each id got (an attached partition's rows are read once)."""
    counts: dict[int, int] = {}
    for e in events(log_dir, TOPIC):
        if e["op"] == "r":
            counts[e["after"]["id"]] = counts.get(e["after"]["id"], 0) + 1
    return counts


@pytest.mark.parametrize("plugin", ON_BOTH_SERVERS, ids=str, indirect=True)
def test_the_root_topic_follows_attach_detach_and_drop(plugin: Plugin, server: LocalPostgres, tmp_path: Path) -> None:
    dsn = fresh_database(server, "proot")
    log_dir = tmp_path / "log"
    try:
        sql(dsn, *SCHEMA)
        capture(log_dir, dsn, plugin=plugin, publish_via_partition_root=True)
        assert topics(log_dir) == [TOPIC], "one topic: the partitioned table's, none per partition"
        assert latest_by_key(log_dir, TOPIC) == table_rows(dsn)
        assert set(reads_per_key(log_dir).values()) == {1} and len(reads_per_key(log_dir)) == 30

        sql(dsn,
            "UPDATE m SET v = 1 WHERE id <= 6",
            "UPDATE m SET region = 'ca' WHERE id = 3",  # eu → ca: a row moving between partitions (and subtrees)
            # created empty under the root: every row it gets is streamed, none read
            "CREATE TABLE m_asia PARTITION OF m FOR VALUES IN ('asia')",
            "INSERT INTO m VALUES (40, 'asia', 0), (41, 'asia', 0)",
            # a table with rows attached: they join the root's topic without a row change in the WAL
            "CREATE TABLE m_af (id int, region text, v int, PRIMARY KEY (id, region))",
            "INSERT INTO m_af SELECT i, 'af', 7 FROM generate_series(100, 119) i",
            "ALTER TABLE m ATTACH PARTITION m_af FOR VALUES IN ('af')",
            "UPDATE m SET v = 8 WHERE id = 101",
            # a subtree detached: its rows leave; what is written into it afterwards is not the root's
            "ALTER TABLE m DETACH PARTITION m_us",
            "UPDATE m_us SET v = 99",
            "INSERT INTO m_us VALUES (500, 'us', 0)",
            # an attached partition dropped: its rows leave too
            "DROP TABLE m_eu",
            "INSERT INTO m VALUES (42, 'asia', 0)")  # fmt: skip
        if plugin is Plugin.WAL2JSON:  # one partition emptied: its rows leave (pgoutput: PostgreSQL publishes none)
            sql(dsn, "TRUNCATE m_asia", "INSERT INTO m VALUES (43, 'asia', 0)")
        capture(log_dir, dsn, plugin=plugin, publish_via_partition_root=True)
        # m_us, detached, is a partitioned table of its own: its topic holds its rows (wal2json: read at the detach,
        # its changes streamed from there; pgoutput: read at this start, the first its publication holds it). m_af's
        # inserts, made while it was a table of its own, are not captured under its name: it is a partition now.
        assert topics(log_dir) == [TOPIC, "cdc.public.m_us"]
        assert latest_by_key(log_dir, "cdc.public.m_us") == table_rows(dsn, "m_us")
        stored, table = latest_by_key(log_dir, TOPIC), table_rows(dsn)
        missing, extra = sorted(set(table) - set(stored)), sorted(set(stored) - set(table))
        assert not missing and not extra, f"missing {missing[:5]}, extra {extra[:5]}"
        assert stored == table
        reads = reads_per_key(log_dir)
        assert all(reads.get(i) == 1 for i in range(100, 120)), f"the attached rows were read {reads}"
        assert not any(i in reads for i in (40, 41, 42, 43)), "a created partition's rows were read, not streamed"
    finally:
        drop_slots(dsn)


@pytest.mark.parametrize("plugin", [Source(Plugin.WAL2JSON), Source(Plugin.PGOUTPUT, 18)], ids=str, indirect=True)
def test_attach_while_the_partition_is_written_and_capture_streams(
    plugin: Plugin, server: LocalPostgres, tmp_path: Path
) -> None:
    """The attach's incremental snapshot races the partition's own changes, streamed as the root's: the topic
    ends equal to the table (the watermarks drop a read row a streamed change superseded)."""
    dsn = fresh_database(server, "prootrace")
    log_dir = tmp_path / "log"
    stop = threading.Event()
    written = [0]

    def write() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            while not stop.is_set():
                c.execute("UPDATE m_af SET v = v + 1 WHERE id = 100 + (random() * 49)::int")
                written[0] += 1

    try:
        sql(dsn, *SCHEMA,
            "CREATE TABLE m_af (id int, region text, v int, PRIMARY KEY (id, region))",
            "INSERT INTO m_af SELECT i, 'af', 0 FROM generate_series(100, 149) i")  # fmt: skip
        config = CaptureConfig(dsn=dsn, slot="t", topic_prefix="cdc", plugin=plugin, publish_via_partition_root=True,
                               incremental_chunk_size=7)  # fmt: skip
        errors: list[BaseException] = []
        with Log(log_dir) as log:
            connector = Connector(config, log)
            thread = run_connector(connector, errors)
            deadline = time.monotonic() + 120
            while not connector.offsets.confirm_lsn:  # the snapshot is stored: streaming
                assert thread.is_alive() and time.monotonic() < deadline, errors or "capture did not start"
                time.sleep(0.05)
            writer = threading.Thread(target=write, daemon=True)  # before, during and after the attach
            writer.start()
            while written[0] < 20:
                assert time.monotonic() < deadline, "the writer does not write"
                time.sleep(0.01)
            sql(dsn, "ALTER TABLE m ATTACH PARTITION m_af FOR VALUES IN ('af')")
            attached = written[0]
            seen_by = time.monotonic() + 30
            while connector.stats.incremental is None and time.monotonic() < seen_by:  # the attach is seen
                time.sleep(0.01)
            while connector.stats.incremental is not None and time.monotonic() < deadline:  # its rows are read
                time.sleep(0.01)
            during = written[0] - attached  # updates of the partition while its rows were read
            stop.set()
            writer.join()
            with psycopg.connect(dsn) as c:
                end = c.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()
            assert end is not None
            while connector.offsets.confirm_lsn < int(end[0]):
                assert thread.is_alive() and time.monotonic() < deadline, errors or "capture did not catch up"
                time.sleep(0.05)
            connector.stop()
            thread.join(60)
        assert not errors, errors
        assert during > 0, "no update raced the attach's snapshot"
        assert latest_by_key(log_dir, TOPIC) == table_rows(dsn)
        assert all(n == 1 for n in reads_per_key(log_dir).values())
    finally:
        stop.set()
        drop_slots(dsn)


def test_a_publication_used_as_it_is_must_say_the_same_about_partition_roots(postgres: LocalPostgres,
                                                                            tmp_path: Path) -> None:  # fmt: skip
    """A user's publication that publishes partitions one way and capture reading them the other would lose a
    partitioned table's changes: one line naming the fix, both ways."""
    dsn = fresh_database(postgres, "prootpub")
    try:
        sql(dsn, SCHEMA[0], SCHEMA[1], "CREATE PUBLICATION leafwise FOR TABLE m",
            "CREATE PUBLICATION rootwise FOR TABLE m WITH (publish_via_partition_root = true)")  # fmt: skip
        for publication, via_root, fix in (("leafwise", True, "publish_via_partition_root = true"),
                                           ("rootwise", False, "--publish-via-partition-root")):  # fmt: skip
            with pytest.raises(ConfigError, match=fix):
                capture(tmp_path / publication, dsn, plugin=Plugin.PGOUTPUT, publication=publication,
                        publication_autocreate=PublicationMode.DISABLED,
                        publish_via_partition_root=via_root)  # fmt: skip
        capture(tmp_path / "ok", dsn, slot="ok", plugin=Plugin.PGOUTPUT, publication="rootwise",
                publication_autocreate=PublicationMode.DISABLED, publish_via_partition_root=True)  # fmt: skip
        assert topics(tmp_path / "ok") == [TOPIC]
    finally:
        drop_slots(dsn)
