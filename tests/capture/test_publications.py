"""pgoutput's publications (capture/publications.py): the three modes, upkeep, and the source's own writes.

Checked against a real PostgreSQL 15: what ``pg_publication_tables`` holds after each start
(``filtered``: the captured tables; ``all_tables``: every table; split by replica identity
into ``<name>`` and ``<name>_keyless``), that the application's UPDATE and DELETE of a
keyless table keep working while it is captured (and that a ``FOR ALL TABLES`` or ``FOR TABLES IN
SCHEMA`` publication would break them: the trap the split avoids), that the publications follow tables created,
dropped, keyed or excluded between starts, that ``disabled`` with a missing publication is
one line and stores nothing, and that a user's publication with a PostgreSQL 15 row filter
and column list is what the log holds, snapshot included.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from capture_util import capture, drop_slots, events, fresh_database, latest_by_key, sql

from capture.connector import PublicationMode
from capture.errors import PermanentCaptureError
from capture.messages import Plugin
from capture.publications import Publications
from capture.tables import TableFilter
from eventstore.errors import ConfigError
from eventstore.log import Log
from eventstore.record_batch import Codec, unpack_header
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
TIDELINE = str(Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "tideline")
SIGNALS = "public.tideline_signal"  # the signal table (capture.signals): its inserts must be streamed
PGOUTPUT: dict[str, Any] = {"plugin": Plugin.PGOUTPUT, "signal_table": SIGNALS}


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "pub")
    yield dsn
    drop_slots(dsn)



def published(dsn: str) -> dict[str, set[str]]:
    """publication → its tables ("schema.table"), for every publication of the database."""
    out: dict[str, set[str]] = {}
    with psycopg.connect(dsn) as c:
        for pub in c.execute("SELECT pubname FROM pg_publication").fetchall():
            out[pub[0]] = set()
        for pub, schema, table in c.execute("SELECT pubname, schemaname, tablename FROM pg_publication_tables"):
            out[pub].add(f"{schema}.{table}")
    return out


def publishes(dsn: str, name: str) -> tuple[bool, bool, bool, bool, bool]:
    """(all tables, insert, update, delete, truncate) of a publication."""
    with psycopg.connect(dsn) as c:
        row = c.execute(
            "SELECT puballtables, pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = %s",
            (name,),
        ).fetchone()
    assert row is not None, name
    return row


TABLES = (
    "CREATE TABLE orders (id int PRIMARY KEY, status text, twice int GENERATED ALWAYS AS (id * 2) STORED)",
    "CREATE TABLE audit (at timestamptz DEFAULT now(), actor text)",  # no key, no replica identity
    "CREATE TABLE wide (a int, b text)",
    "ALTER TABLE wide REPLICA IDENTITY FULL",  # no key, but a replica identity: UPDATEs are published
    "CREATE TABLE quiet (id int PRIMARY KEY)",  # excluded by the filter below
    "INSERT INTO orders VALUES (1, 'new')",
    "INSERT INTO audit (actor) VALUES ('ann')",
)


def test_filtered_publications_split_by_replica_identity_and_keyless_updates_still_work(
    db: str, tmp_path: Path
) -> None:
    sql(db, *TABLES)
    tf = TableFilter(exclude=["public.quiet"])
    capture(tmp_path / "log", db, table_filter=tf, **PGOUTPUT)
    assert published(db) == {"t": {"public.orders", "public.wide", SIGNALS}, "t_keyless": {"public.audit"}}
    assert publishes(db, "t") == (False, True, True, True, True)
    assert publishes(db, "t_keyless") == (False, True, False, False, True)  # nothing that needs an identity

    # The application's writes to the keyless table go on working while it is captured …
    sql(db, "UPDATE audit SET actor = 'bob'", "DELETE FROM audit WHERE actor = 'nobody'",
        "INSERT INTO audit (actor) VALUES ('cy')", "UPDATE orders SET status = 'paid'",
        "UPDATE wide SET b = 'x'")  # fmt: skip
    capture(tmp_path / "log", db, table_filter=tf, **PGOUTPUT)
    assert [e["after"]["actor"] for e in events(tmp_path / "log", "cdc.public.audit")] == ["ann", "cy"]
    orders = events(tmp_path / "log", "cdc.public.orders")
    # pgoutput 15 sends no stored generated column: the snapshot leaves it out too
    assert [(e["op"], e["after"]) for e in orders] == [
        ("r", {"id": 1, "status": "new"}), ("u", {"id": 1, "status": "paid"})]  # fmt: skip

    # … which a FOR ALL TABLES publication (Debezium's all_tables) would have broken, and so would one FOR
    # TABLES IN SCHEMA (what a publication following CREATE TABLE would need: docs/capture.md, Publications):
    for scope in ("ALL TABLES", "TABLES IN SCHEMA public"):
        sql(db, f"CREATE PUBLICATION trap FOR {scope}")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="does not have a replica identity"):
            sql(db, "UPDATE audit SET actor = 'dee'")
        sql(db, "DROP PUBLICATION trap")


def test_publications_follow_the_tables_between_starts(
    db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sql(db, *TABLES)
    capture(tmp_path / "log", db, **PGOUTPUT)
    assert published(db) == {"t": {"public.orders", "public.wide", "public.quiet", SIGNALS},
                             "t_keyless": {"public.audit"}}  # fmt: skip
    sql(
        db,
        "CREATE TABLE later (id int PRIMARY KEY, v text)",
        "INSERT INTO later VALUES (1, 'before it was published')",
        "ALTER TABLE audit ADD COLUMN id serial PRIMARY KEY",  # gains a replica identity: moves
        "ALTER TABLE orders REPLICA IDENTITY NOTHING",  # loses it: moves, so its UPDATEs keep working
        "DROP TABLE wide",
    )
    with caplog.at_level(logging.WARNING, logger="capture.connector"):
        capture(tmp_path / "log", db, table_filter=TableFilter(exclude=["public.quiet"]), **PGOUTPUT)
    assert published(db) == {"t": {"public.audit", "public.later", SIGNALS}, "t_keyless": {"public.orders"}}
    joined = [r.getMessage() for r in caplog.records if "joined publication" in r.getMessage()]
    assert len(joined) == 1 and "public.later" in joined[0] and "snapshotted incrementally" in joined[0]
    # PostgreSQL decodes with the publication as it was: the row written before the table joined is not
    # streamed; the table is new to the connector (no topic yet), so an incremental snapshot reads it
    # (capture.incremental). Rows written since are streamed.
    sql(db, "UPDATE orders SET status = 'still works'", "INSERT INTO later VALUES (2, 'after')")
    capture(tmp_path / "log", db, table_filter=TableFilter(exclude=["public.quiet"]), **PGOUTPUT)
    later = events(tmp_path / "log", "cdc.public.later")
    assert [(e["op"], e["after"]["id"]) for e in later] == [("r", 1), ("c", 2)]
    assert later[0]["source"]["snapshot"] == "incremental"


def test_all_tables_publishes_every_table_but_never_the_trap(db: str, tmp_path: Path) -> None:
    sql(db, *TABLES, "CREATE SCHEMA other", "CREATE TABLE other.loose (v text)",
        "CREATE UNLOGGED TABLE scratch (id int PRIMARY KEY)")  # fmt: skip
    tf = TableFilter(include=["public.orders"])
    capture(tmp_path / "log", db, table_filter=tf, publication="everything",
            publication_autocreate=PublicationMode.ALL_TABLES, **PGOUTPUT)  # fmt: skip
    assert published(db) == {  # every table a publication can hold (an unlogged one cannot), split
        "everything": {"public.orders", "public.wide", "public.quiet", SIGNALS},
        "everything_keyless": {"public.audit", "other.loose"},
    }
    assert not publishes(db, "everything")[0]  # a table list, not FOR ALL TABLES
    sql(db, "UPDATE audit SET actor = 'x'", "UPDATE other.loose SET v = 'y'", "DELETE FROM other.loose")
    with Log(tmp_path / "log") as log:
        assert sorted(t for t in log.topics() if t.startswith("cdc.")) == ["cdc.public.orders"]  # the filter's


def test_disabled_mode_missing_publication_is_one_line_and_stores_nothing(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE orders (id int PRIMARY KEY)")
    with pytest.raises(ConfigError) as refused:
        capture(tmp_path / "log", db, publication="theirs", publication_autocreate=PublicationMode.DISABLED,
                **PGOUTPUT)  # fmt: skip
    message = str(refused.value)
    assert message.startswith("publication theirs does not exist (--publication-autocreate disabled)"), message
    assert "\n" not in message
    with psycopg.connect(db) as c:
        assert c.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()").fetchone() \
            == (0,)  # fmt: skip
        assert c.execute("SELECT count(*) FROM pg_publication").fetchone() == (0,)  # none created either
    with Log(tmp_path / "log") as log:
        assert [t for t in log.topics() if not t.startswith("_")] == []
    # a managed publication that is FOR ALL TABLES is refused, not altered
    sql(db, "CREATE PUBLICATION t FOR ALL TABLES")
    with pytest.raises(ConfigError, match="publication t is FOR ALL TABLES"):
        capture(tmp_path / "log", db, **PGOUTPUT)


def test_user_publication_row_filter_and_column_list_are_what_the_log_holds(db: str, tmp_path: Path) -> None:
    """PostgreSQL 15: ``FOR TABLE t (columns) WHERE (…)``. The snapshot reads what the stream would send; an
    UPDATE that moves a row into the filter arrives as an INSERT, out of it as a DELETE."""
    sql(
        db,
        "CREATE TABLE orders (id int PRIMARY KEY, status text, secret text)",
        "INSERT INTO orders SELECT g, 'new', 'pin ' || g FROM generate_series(1, 5) g",
        "INSERT INTO orders SELECT g, 'new', 'pin ' || g FROM generate_series(101, 105) g",
        "CREATE PUBLICATION big_orders FOR TABLE orders (id, status) WHERE (id > 100)",
    )
    mine: dict[str, Any] = {"publication": "big_orders", "publication_autocreate": PublicationMode.DISABLED}
    capture(tmp_path / "log", db, **mine, **PGOUTPUT)
    snapshot = events(tmp_path / "log", "cdc.public.orders")
    assert sorted(e["after"]["id"] for e in snapshot) == [101, 102, 103, 104, 105]
    assert all(set(e["after"]) == {"id", "status"} for e in snapshot)
    sql(
        db,
        "INSERT INTO orders VALUES (6, 'small', 'x'), (106, 'big', 'y')",
        "UPDATE orders SET status = 'paid' WHERE id = 101",
        "UPDATE orders SET id = 150 WHERE id = 3",  # into the filter: an INSERT
        "UPDATE orders SET id = 40 WHERE id = 104",  # out of it: a DELETE
        "UPDATE orders SET secret = 'changed' WHERE id = 103",
        "DELETE FROM orders WHERE id IN (1, 105)",
    )
    capture(tmp_path / "log", db, **mine, **PGOUTPUT)
    streamed = events(tmp_path / "log", "cdc.public.orders")[len(snapshot) :]
    assert [(e["op"], (e["after"] or e["before"])["id"]) for e in streamed] == [
        ("c", 106), ("u", 101), ("c", 150), ("d", 104), ("u", 103), ("d", 105)]  # fmt: skip
    assert all("secret" not in (e["after"] or {}) for e in streamed)
    with psycopg.connect(db) as c:
        rows = c.execute("SELECT id, status FROM orders WHERE id > 100").fetchall()
    expected = {json.dumps({"id": i}, separators=(",", ":")).encode(): {"id": i, "status": s} for i, s in rows}
    assert latest_by_key(tmp_path / "log", "cdc.public.orders") == expected


def test_key_outside_the_column_list_is_refused(db: str, tmp_path: Path) -> None:
    sql(db, "CREATE TABLE notes (id int PRIMARY KEY, body text)",
        "CREATE PUBLICATION bodies FOR TABLE notes (body) WITH (publish = 'insert')")  # fmt: skip
    with pytest.raises(ConfigError, match=r"column list of public\.notes leaves out its key column\(s\) \['id'\]"):
        capture(tmp_path / "log", db, publication="bodies", publication_autocreate=PublicationMode.DISABLED,
                **PGOUTPUT)  # fmt: skip


def test_wal2json_takes_no_publication_and_names_are_checked(db: str) -> None:
    from capture.config import CaptureConfig

    with pytest.raises(ConfigError, match="--publication and --publication-autocreate are for --plugin pgoutput"):
        CaptureConfig(dsn=db, publication="p").validate()
    with pytest.raises(ConfigError, match="give 1 to 55 bytes"):
        CaptureConfig(dsn=db, plugin=Plugin.PGOUTPUT, publication="p" * 56).validate()
    CaptureConfig(dsn=db, plugin=Plugin.PGOUTPUT, publication="p" * 63,
                  publication_autocreate=PublicationMode.DISABLED).validate()  # fmt: skip
    with pytest.raises(ConfigError, match="must be one of all_tables, filtered, disabled; not 'some'"):
        PublicationMode.parse("some")
    assert Publications(db, "tideline", PublicationMode.FILTERED).names == ("tideline", "tideline_keyless")
    config = CaptureConfig(dsn=db, slot="s1", plugin=Plugin.PGOUTPUT)
    assert config.publications().names == ("s1", "s1_keyless")  # named like the slot unless --publication


def test_a_role_that_cannot_manage_the_publication_gets_one_line_saying_what_to_do(
    db: str, tmp_path: Path, postgres: LocalPostgres
) -> None:
    sql(db, "CREATE TABLE orders (id int PRIMARY KEY)")
    sql(postgres.dsn, "DO $$ BEGIN CREATE ROLE cdc_reader LOGIN REPLICATION; "
                      "EXCEPTION WHEN duplicate_object THEN NULL; END $$")  # fmt: skip
    sql(db, "GRANT SELECT ON ALL TABLES IN SCHEMA public TO cdc_reader")
    reader = db.replace("postgres@", "cdc_reader@", 1)
    with pytest.raises(PermanentCaptureError) as no_create:  # no CREATE on the database
        capture(tmp_path / "log", reader, **PGOUTPUT)
    assert str(no_create.value).startswith("creating a publication needs CREATE on the database")
    sql(db, f"GRANT CREATE ON DATABASE {db.rsplit('/', 1)[1]} TO cdc_reader")
    with pytest.raises(PermanentCaptureError) as not_owner:  # the tables belong to someone else
        capture(tmp_path / "log", reader, **PGOUTPUT)
    assert str(not_owner.value).startswith("only the owner of a table can add it to a publication")
    assert "--publication-autocreate disabled" in str(not_owner.value) and "\n" not in str(not_owner.value)


def cli(*args: str, data_dir: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TIDELINE, "--data-dir", str(data_dir), *args], capture_output=True, text=True, check=check, timeout=120
    )


def test_cli_runs_pgoutput_and_status_shows_the_publications(db: str, tmp_path: Path) -> None:
    data = tmp_path / "log"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v numeric)", "INSERT INTO t VALUES (1, 'NaN'), (2, NULL)",
        "CREATE TABLE k (v text)")  # fmt: skip
    out = cli("capture", "run", "--dsn", db, "--slot", "clip", "--plugin", "pgoutput", "--exit-when-caught-up",
              "--signal-table", SIGNALS, "--compression", "zstd", "--json", data_dir=data)  # fmt: skip
    assert json.loads(out.stdout)["snapshot_rows"] == 2
    segment = next((data / "tideline.public.t-0").glob("*.log")).read_bytes()  # --compression reached the sink
    assert unpack_header(segment).codec is Codec.ZSTD
    status = json.loads(cli("capture", "status", "--dsn", db, "--slot", "clip", "--json", data_dir=data).stdout)
    assert status["slot"]["plugin"] == "pgoutput"
    assert [(p["name"], p["tables"], p["publish"]) for p in status["publications"]] == [
        ("clip", ["public.t", SIGNALS], ["insert", "update", "delete", "truncate"]),
        ("clip_keyless", ["public.k"], ["insert", "truncate"]),
    ]
    missing = cli("capture", "run", "--dsn", db, "--slot", "other", "--plugin", "pgoutput", "--publication", "nope",
                  "--publication-autocreate", "disabled", data_dir=data, check=False)  # fmt: skip
    assert missing.returncode == 1 and missing.stderr.startswith("error: publication nope does not exist")
    assert len(missing.stderr.strip().splitlines()) == 1


def test_cli_compresses_with_lz4_unless_told_otherwise(db: str, tmp_path: Path) -> None:
    """`capture run` without --compression stores lz4 batches (the default); --compression none, plain ones."""
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 50) g")  # fmt: skip
    for slot, extra, codec in (("lz", (), Codec.LZ4), ("plain", ("--compression", "none"), Codec.NONE)):
        data = tmp_path / slot
        cli("capture", "run", "--dsn", db, "--slot", slot, "--exit-when-caught-up", *extra, data_dir=data)
        segment = next((data / "tideline.public.t-0").glob("*.log")).read_bytes()
        assert unpack_header(segment).codec is codec, slot
