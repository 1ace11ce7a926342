"""Stored generated columns across servers and plugins, against real PostgreSQL 15 and 18.

* wal2json (15) sends them: snapshot and stream hold them.
* pgoutput on 15 does not: they are left out of the snapshot and the stream alike, and the connector names them
  in a warning and in its status (nothing left out silently).
* pgoutput on 18 sends what the publication publishes: the managed publications are created (or altered) with
  ``publish_generated_columns = stored``, so snapshot and stream hold them; a user's publication without the option
  leaves them out, with a warning that names the columns and the ALTER PUBLICATION that fixes it.
* Virtual generated columns (18) are in no row image: no plugin sends them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from capture_util import capture, drop_slots, events, fresh_database, sql

from capture.connector import PublicationMode
from capture.messages import Plugin
from tideline.pgharness import LocalPostgres

TOPIC = "cdc.public.gen"


@pytest.fixture
def db(server: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(server, "gen")
    yield dsn
    drop_slots(dsn)


def schema(dsn: str) -> None:
    virtual = ", thrice int GENERATED ALWAYS AS (a * 3) VIRTUAL" if version_num(dsn) >= 180000 else ""
    sql(dsn, f"CREATE TABLE gen (id int PRIMARY KEY, a int, twice int GENERATED ALWAYS AS (a * 2) STORED{virtual})",
        "INSERT INTO gen (id, a) SELECT g, g * 10 FROM generate_series(1, 3) g")  # fmt: skip


def workload(dsn: str) -> None:
    sql(dsn, "INSERT INTO gen (id, a) VALUES (4, 40)", "UPDATE gen SET a = 11 WHERE id = 1")


def version_num(dsn: str) -> int:
    with psycopg.connect(dsn) as c:
        return c.info.server_version


def images(log_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    return [(e["op"], e["after"]) for e in events(log_dir, TOPIC) if e["after"] is not None]


@pytest.mark.parametrize(
    ("server", "plugin"), [(15, Plugin.WAL2JSON), (18, Plugin.PGOUTPUT)], ids=["15-wal2json", "18-pgoutput"],
    indirect=["server"],
)  # fmt: skip
def test_stored_generated_columns_are_captured_where_the_server_sends_them(
    db: str, tmp_path: Path, plugin: Plugin, caplog: pytest.LogCaptureFixture
) -> None:
    schema(db)
    capture(tmp_path / "log", db, plugin=plugin)  # the slot exists from here: the workload is streamed
    workload(db)
    with caplog.at_level(logging.WARNING, logger="capture"):
        stats = capture(tmp_path / "log", db, plugin=plugin)
    got = images(tmp_path / "log")
    assert got == [
        ("r", {"id": 1, "a": 10, "twice": 20}),
        ("r", {"id": 2, "a": 20, "twice": 40}),
        ("r", {"id": 3, "a": 30, "twice": 60}),
        ("c", {"id": 4, "a": 40, "twice": 80}),
        ("u", {"id": 1, "a": 11, "twice": 22}),
    ]  # and never the virtual column
    assert stats.generated_columns_left_out == [] and "generated column" not in caplog.text
    if plugin is Plugin.PGOUTPUT:
        with psycopg.connect(db) as c:
            assert c.execute("SELECT pubgencols FROM pg_publication WHERE pubname = 't'").fetchone() == ("s",)


def test_pgoutput_on_15_leaves_them_out_and_says_so(
    postgres: LocalPostgres, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dsn = fresh_database(postgres, "gen15")
    try:
        schema(dsn)
        with caplog.at_level(logging.WARNING, logger="capture"):
            capture(tmp_path / "log", dsn, plugin=Plugin.PGOUTPUT)
            workload(dsn)
            stats = capture(tmp_path / "log", dsn, plugin=Plugin.PGOUTPUT)
        assert [after for _, after in images(tmp_path / "log")] == [
            {"id": 1, "a": 10}, {"id": 2, "a": 20}, {"id": 3, "a": 30}, {"id": 4, "a": 40}, {"id": 1, "a": 11}
        ]  # fmt: skip
        assert stats.generated_columns_left_out == ["public.gen.twice"]
        warned = [r.getMessage() for r in caplog.records if "generated column" in r.getMessage()]
        assert warned and "public.gen.twice not captured: pgoutput sends them from PostgreSQL 18" in warned[0]
    finally:
        drop_slots(dsn)


def test_a_user_publication_without_the_option_leaves_them_out_with_the_fix(
    postgres18: LocalPostgres, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dsn = fresh_database(postgres18, "genpub")
    try:
        schema(dsn)
        sql(dsn, "CREATE PUBLICATION mine FOR TABLE gen")  # publish_generated_columns defaults to none
        options: dict[str, Any] = {"plugin": Plugin.PGOUTPUT, "publication": "mine",
                                   "publication_autocreate": PublicationMode.DISABLED}  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="capture"):
            stats = capture(tmp_path / "log", dsn, **options)
        assert [after for _, after in images(tmp_path / "log")] == [{"id": i, "a": i * 10} for i in (1, 2, 3)]
        assert stats.generated_columns_left_out == ["public.gen.twice"]
        warned = [r.getMessage() for r in caplog.records if "generated column" in r.getMessage()]
        assert warned and "ALTER PUBLICATION mine SET (publish_generated_columns = stored)" in warned[0], warned

        sql(dsn, "ALTER PUBLICATION mine SET (publish_generated_columns = stored)")  # the fix: from now on
        workload(dsn)
        stats = capture(tmp_path / "log", dsn, **options)
        assert [after for _, after in images(tmp_path / "log")][3:] == [
            {"id": 4, "a": 40, "twice": 80}, {"id": 1, "a": 11, "twice": 22}
        ]  # fmt: skip
        assert stats.generated_columns_left_out == []
    finally:
        drop_slots(dsn)
