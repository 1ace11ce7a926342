"""Tables new to a restarted connector (capture.table_history): snapshotted only when the stream cannot give
their history, against a real PostgreSQL, with wal2json, pgoutput with its managed publications (table lists)
and pgoutput with a user's ``FOR TABLES IN SCHEMA`` publication (``--publication-autocreate disabled``).

* (a) a table created and filled while the connector was stopped (after its stored position): its whole
  history is in the WAL from the stored position on, so it is streamed, each row once with ``op=c``, never
  read again as ``op=r``; managed pgoutput publications get the table only at that start, so there it is
  read (``op=r``) once instead, since its changes before were never streamed;
* (b) a table that existed before the stored position and joins the include list is snapshotted; so is a
  table created during a run that left it out, and one renamed into the include list after its rows were
  written;
* (c) a table created while the connector streams continuously is streamed (with pgoutput's table lists:
  read at the next start), also when its first rows are written while the connector is stopped.

Every scenario also checks that the materialized topic equals the table.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from capture_util import ConnectorThread, capture, drop_slots, events, fresh_database, latest_by_key, sql
from readiness import wait_until

from capture.config import CaptureConfig
from capture.connector import PublicationMode
from capture.messages import Plugin
from capture.tables import TableFilter
from eventstore.log import Log
from tideline.pgharness import LocalPostgres

SLOT = "nt"


@dataclass(frozen=True)
class Source:
    """How the connector streams: the plugin and its publication."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    setup: tuple[str, ...] = ()  # run in the fresh database before the first start
    streams_new_tables: bool = True  # a table created later is streamed from its creation on


SOURCES = [
    Source("wal2json", {"plugin": Plugin.WAL2JSON}),
    Source("pgoutput", {"plugin": Plugin.PGOUTPUT}, streams_new_tables=False),  # managed table lists
    Source(  # a user's publication that streams every table of the schema from its creation
        "pgoutput-schema",
        {
            "plugin": Plugin.PGOUTPUT,
            "publication": "everything_public",
            "publication_autocreate": PublicationMode.DISABLED,
        },
        ("CREATE PUBLICATION everything_public FOR TABLES IN SCHEMA public",),
    ),
]


@pytest.fixture(params=SOURCES, ids=[s.name for s in SOURCES])
def source(request: pytest.FixtureRequest) -> Source:
    assert isinstance(request.param, Source)
    return request.param


@pytest.fixture
def db(postgres: LocalPostgres, source: Source) -> Iterator[str]:
    dsn = fresh_database(postgres, "newtables")
    sql(dsn, "CREATE TABLE base (id int PRIMARY KEY, v text)", "INSERT INTO base VALUES (1, 'one')", *source.setup)
    yield dsn
    drop_slots(dsn)


def run(log_dir: Path, dsn: str, source: Source, table_filter: TableFilter | None = None) -> None:
    """One start of the connector, until it has stored what the WAL held when it started."""
    capture(log_dir, dsn, slot=SLOT, table_filter=table_filter or TableFilter(exclude=["public.outside"]),
            **source.options)  # fmt: skip


class Running(ConnectorThread):
    """The connector streaming in a thread until the block ends."""

    def __init__(self, log_dir: Path, dsn: str, source: Source, table_filter: TableFilter | None = None) -> None:
        super().__init__(log_dir, CaptureConfig(dsn=dsn, slot=SLOT, topic_prefix="cdc", status_interval_s=0.05,
                                                table_filter=table_filter or TableFilter(exclude=["public.outside"]),
                                                **source.options))  # fmt: skip

    def wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        wait_until(ready, what, alive=self.thread, details=lambda: repr(self.errors))

    def streaming(self, dsn: str, log_dir: Path) -> None:
        """Wait until the connector streams (a row written now is stored): its start is behind it."""
        sql(dsn, "INSERT INTO base VALUES (100, 'marker')")
        self.wait_for("the connector streaming", lambda: has_row(log_dir, "base", 100))


def ops(log_dir: Path, table: str) -> Counter[str]:
    return Counter(e["op"] for e in events(log_dir, f"cdc.public.{table}"))


def has_row(log_dir: Path, table: str, row_id: int) -> bool:
    return any(e["after"] and e["after"]["id"] == row_id for e in events(log_dir, f"cdc.public.{table}"))


def assert_topic_equals_table(log_dir: Path, dsn: str, table: str) -> None:
    with psycopg.connect(dsn) as c:
        rows = {r[0]: r[1] for r in c.execute(f"SELECT id, v FROM {table}".encode()).fetchall()}
    state = latest_by_key(log_dir, f"cdc.public.{table}")
    expected = {orjson.dumps({"id": k}, option=orjson.OPT_SORT_KEYS): {"id": k, "v": v} for k, v in rows.items()}
    assert state == expected, f"{table}: the materialized topic differs from the table"


def test_a_table_created_while_stopped_is_streamed_not_snapshotted(
    db: str, tmp_path: Path, source: Source, caplog: pytest.LogCaptureFixture
) -> None:
    """(a): created, filled, updated and trimmed after the stored position, while the connector was stopped."""
    log_dir = tmp_path / "log"
    run(log_dir, db, source)
    sql(
        db,
        "CREATE TABLE fresh (id int PRIMARY KEY, v text)",
        "INSERT INTO fresh SELECT g, 'v' || g FROM generate_series(1, 40) g",
        "UPDATE fresh SET v = 'changed' WHERE id <= 5",
        "DELETE FROM fresh WHERE id = 40",
        "CREATE TABLE outside (id int PRIMARY KEY, v text)",  # not in the include list
        "INSERT INTO outside VALUES (1, 'never captured')",
        "INSERT INTO base VALUES (2, 'two')",
    )
    with caplog.at_level(logging.INFO, logger="capture.connector"):
        run(log_dir, db, source)
    if source.streams_new_tables:
        assert ops(log_dir, "fresh") == {"c": 40, "u": 5, "d": 1}, "each change once, streamed; no op=r read"
    else:  # the table joined the managed publication at this start: its rows were never streamed, read once
        assert "no publication streamed it from its creation on" in read_because(caplog, "fresh")
        assert ops(log_dir, "fresh") == {"r": 39}
        assert all(e["source"]["snapshot"] == "incremental" for e in events(log_dir, "cdc.public.fresh"))
    assert_topic_equals_table(log_dir, db, "fresh")
    assert ops(log_dir, "base") == {"r": 1, "c": 1}
    with Log(log_dir) as log:
        assert "cdc.public.outside" not in log.topics()
    # and the next start leaves it alone
    sql(db, "INSERT INTO fresh VALUES (41, 'later')")
    run(log_dir, db, source)
    assert ops(log_dir, "fresh")["c"] == (41 if source.streams_new_tables else 1)
    assert_topic_equals_table(log_dir, db, "fresh")


def read_because(caplog: pytest.LogCaptureFixture, table: str) -> str:
    """The reason the connector logged for reading ``table`` (the last start that read it)."""
    said = [r.getMessage() for r in caplog.records if "tables new to the include list" in r.getMessage()]
    for message in reversed(said):
        for part in message.split("include list: ", 1)[1].split("; "):
            if part.startswith(f"public.{table} ("):
                return part
    raise AssertionError(f"no start read {table}: {said}")


def test_b_a_table_older_than_the_position_joining_the_include_list_is_snapshotted(
    db: str, tmp_path: Path, source: Source, caplog: pytest.LogCaptureFixture
) -> None:
    """(b): existed before the stored position, outside the include list; then included."""
    log_dir = tmp_path / "log"
    sql(db, "CREATE TABLE older (id int PRIMARY KEY, v text)",
        "INSERT INTO older SELECT g, 'v' || g FROM generate_series(1, 30) g")  # fmt: skip
    run(log_dir, db, source, TableFilter(include=["public.base"]))
    sql(db, "UPDATE older SET v = 'after the position' WHERE id = 1", "INSERT INTO base VALUES (2, 'two')")
    run(log_dir, db, source, TableFilter(include=["public.base"]))
    with Log(log_dir) as log:
        assert "cdc.public.older" not in log.topics()
    with caplog.at_level(logging.INFO, logger="capture.connector"):
        run(log_dir, db, source)
    assert "existed when the last run started" in read_because(caplog, "older")
    reads = [e for e in events(log_dir, "cdc.public.older") if e["op"] == "r"]
    assert len(reads) == 30 and all(e["source"]["snapshot"] == "incremental" for e in reads)
    assert_topic_equals_table(log_dir, db, "older")


def test_b_a_table_created_during_a_run_that_left_it_out_is_snapshotted(
    db: str, tmp_path: Path, source: Source, caplog: pytest.LogCaptureFixture
) -> None:
    """(b): created after that run started (so after its start's table list) and filled while it streamed past
    it with an include list that left it out: its rows are behind the stored position, only a read has them."""
    log_dir = tmp_path / "log"
    run(log_dir, db, source, TableFilter(include=["public.base"]))
    with Running(log_dir, db, source, TableFilter(include=["public.base"])) as running:
        running.streaming(db, log_dir)
        sql(db, "CREATE TABLE late (id int PRIMARY KEY, v text)",
            "INSERT INTO late SELECT g, 'v' || g FROM generate_series(1, 25) g",
            "INSERT INTO base VALUES (2, 'after late')")  # fmt: skip
        running.wait_for("the stored position past late's rows", lambda: has_row(log_dir, "base", 2))
    with caplog.at_level(logging.INFO, logger="capture.connector"):
        run(log_dir, db, source, TableFilter(include=["public.base", "public.late"]))
    assert "--tables/--exclude-tables left it out" in read_because(caplog, "late")
    assert ops(log_dir, "late") == {"r": 25}
    assert_topic_equals_table(log_dir, db, "late")


def test_b_a_table_renamed_into_the_include_list_is_snapshotted(
    db: str, tmp_path: Path, source: Source, caplog: pytest.LogCaptureFixture
) -> None:
    """(b): created and filled after the stored position under another name, then renamed: the stream gives
    its rows under the old name, so the new one is read."""
    log_dir = tmp_path / "log"
    run(log_dir, db, source, TableFilter(include=["public.base", "public.final"]))
    sql(db, "CREATE TABLE staging (id int PRIMARY KEY, v text)",
        "INSERT INTO staging SELECT g, 'v' || g FROM generate_series(1, 20) g",
        "ALTER TABLE staging RENAME TO final", "INSERT INTO final VALUES (21, 'renamed')")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="capture.connector"):
        run(log_dir, db, source, TableFilter(include=["public.base", "public.final"]))
    assert "renamed or moved since its creation" in read_because(caplog, "final")
    assert ops(log_dir, "final")["r"] == 21
    assert_topic_equals_table(log_dir, db, "final")


def test_c_a_table_created_while_streaming_is_streamed(db: str, tmp_path: Path, source: Source) -> None:
    """(c): created while the connector streams; one filled meanwhile, one only after the connector stopped."""
    log_dir = tmp_path / "log"
    run(log_dir, db, source)
    with Running(log_dir, db, source) as running:
        running.streaming(db, log_dir)
        sql(db, "CREATE TABLE live (id int PRIMARY KEY, v text)", "CREATE TABLE quiet (id int PRIMARY KEY, v text)",
            "INSERT INTO live SELECT g, 'v' || g FROM generate_series(1, 15) g",
            "UPDATE live SET v = 'changed' WHERE id = 3", "INSERT INTO base VALUES (2, 'after live')")  # fmt: skip
        running.wait_for("base's row after live's", lambda: has_row(log_dir, "base", 2))
    sql(db, "INSERT INTO quiet SELECT g, 'v' || g FROM generate_series(1, 10) g")
    run(log_dir, db, source)
    if source.streams_new_tables:
        assert ops(log_dir, "live") == {"c": 15, "u": 1}
        assert ops(log_dir, "quiet") == {"c": 10}, "rows written while stopped: streamed once, not read as well"
    else:  # published from this start on: read once each
        assert ops(log_dir, "live") == {"r": 15}
        assert ops(log_dir, "quiet") == {"r": 10}
    for table in ("live", "quiet", "base"):
        assert_topic_equals_table(log_dir, db, table)
    assert ops(log_dir, "base") == {"r": 1, "c": 2}


def test_without_the_record_of_the_last_start_every_new_table_is_read(
    db: str, tmp_path: Path, source: Source, caplog: pytest.LogCaptureFixture
) -> None:
    """A wiped state directory (or a first start with this version): no record, so a new table is read."""
    log_dir = tmp_path / "log"
    run(log_dir, db, source)
    records = list(log_dir.glob("**/cdc.nt.tables.json"))
    assert len(records) == 1, records
    records[0].unlink()
    sql(db, "CREATE TABLE fresh (id int PRIMARY KEY, v text)", "INSERT INTO fresh VALUES (1, 'one'), (2, 'two')")
    with caplog.at_level(logging.INFO, logger="capture.connector"):
        run(log_dir, db, source)
    assert "no record of the tables the last run started with" in read_because(caplog, "fresh")
    assert ops(log_dir, "fresh")["r"] == 2
    assert_topic_equals_table(log_dir, db, "fresh")


@pytest.mark.parametrize("source", [s for s in SOURCES if s.name == "pgoutput-schema"], ids=lambda s: s.name)
def test_a_table_created_while_its_schema_was_out_of_the_publication_is_read(
    db: str, tmp_path: Path, source: Source, caplog: pytest.LogCaptureFixture
) -> None:
    """pgoutput, a user's FOR TABLES IN SCHEMA publication: the schema left the publication and came back while
    the connector was stopped, and a table was created and filled in between: those rows were never streamed."""
    log_dir = tmp_path / "log"
    run(log_dir, db, source)
    sql(db, "ALTER PUBLICATION everything_public DROP TABLES IN SCHEMA public",
        "CREATE TABLE fresh (id int PRIMARY KEY, v text)",
        "INSERT INTO fresh SELECT g, 'v' || g FROM generate_series(1, 10) g",
        "ALTER PUBLICATION everything_public ADD TABLES IN SCHEMA public",
        "INSERT INTO fresh VALUES (11, 'streamed')")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="capture.connector"):
        run(log_dir, db, source)
    assert "no publication streamed it from its creation on" in read_because(caplog, "fresh")
    assert ops(log_dir, "fresh")["r"] == 11
    assert_topic_equals_table(log_dir, db, "fresh")
