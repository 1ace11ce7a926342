"""The parallel initial snapshot (capture.snapshot_readers): reader processes sharing the slot's snapshot.

Against the real Postgres: a parallel snapshot equals a single-reader one (same events per key, same
markers at each table's first and last read, dense event indexes), for a table with a primary key and
a keyless one; under concurrent writes the materialization equals ``SELECT *`` and every key's snapshot
read precedes its streamed changes; a reader killed mid-snapshot fails the connector with nothing
visible, and the next start takes the whole snapshot again. Tables are small; ``MIN_RANGE_BLOCKS`` is
lowered so that they still split into several ranges.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from capture_util import capture, drop_slots, events, fresh_database, latest_by_key, records, run_connector, sql
from sources import Source
from typer.testing import CliRunner

import capture.snapshot_readers as snapshot_readers
from capture.config import CaptureConfig, SnapshotMode, ValueFormat
from capture.connector import Connector
from capture.converters import JsonConverter
from capture.errors import PermanentCaptureError
from capture.events import EventEncoder, TxnContext
from capture.messages import Plugin
from capture.pgtypes import SESSION_OPTIONS
from capture.recovery import RECOVERY_MARKER
from capture.replication import ReplicationConnection
from capture.snapshot import BLOCKS_SQL
from capture.snapshot_readers import SnapshotReaderDied, tid_ranges
from capture.tables import KeylessPolicy, TableCatalog, TableFilter, result_rows, select_columns_sql
from eventstore.errors import ConfigError
from eventstore.log import Log
from tideline.cli import app
from tideline.pgharness import LocalPostgres

KEYED, KEYLESS, SMALL = "cdc.public.t", "cdc.public.loose", "cdc.public.small"
ROWS = 20_000


@pytest.fixture
def db(server: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(server, "psnap")
    yield dsn
    drop_slots(dsn)


@pytest.fixture(autouse=True)
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranges of 8 blocks (64 KiB): the test tables split into the most ranges the readers take."""
    monkeypatch.setattr(snapshot_readers, "MIN_RANGE_BLOCKS", 8)


def seed(dsn: str) -> None:
    """A keyed table (some rows big enough to be TOASTed), a keyless one, and a small one read by the connector."""
    sql(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v text, n numeric(12,2), doc jsonb, big text)",
        f"INSERT INTO t SELECT g, 'v' || g, g / 7.0, jsonb_build_object('g', g, 'half', g / 2.0), "
        f"CASE WHEN g % 500 = 0 THEN repeat(md5(g::text), 100) END FROM generate_series(1, {ROWS}) g",
        "CREATE TABLE loose (a int, b text)",
        f"INSERT INTO loose SELECT g % 1000, 'b' || g FROM generate_series(1, {ROWS // 2}) g",
        "CREATE TABLE small (id int PRIMARY KEY, v text)",
        "INSERT INTO small SELECT g, 'v' || g FROM generate_series(1, 3) g",
        "VACUUM ANALYZE t, loose, small",
    )


def table_rows(dsn: str) -> dict[bytes, Any]:
    with psycopg.connect(dsn) as c:
        rows = c.execute("SELECT id, v, n::text, doc::text, big FROM t").fetchall()
    return {
        orjson.dumps({"id": i}): {"id": i, "v": v, "n": n, "doc": None if d is None else orjson.loads(d), "big": b}
        for i, v, n, d, b in rows
    }


def normalized(after: dict[str, Any]) -> dict[str, Any]:
    """An ``after`` image comparable with table_rows: a streamed insert leaves n and doc null."""
    return {"n": None, "doc": None, "big": None, **after}


def reader_pids() -> list[int]:
    """This process's snapshot reader processes (``python -m capture.snapshot_readers`` children), alive or not
    yet reaped."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"capture.snapshot_readers" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def snapshot_reads(log_dir: Path, topic: str) -> list[dict[str, Any]]:
    return [v for _, v, _ in records(log_dir, topic) if v is not None and v["op"] == "r"]


def markers(reads: list[dict[str, Any]]) -> tuple[str, str, Counter[str]]:
    """The first read's marker, the last read's, and how many reads carry each marker."""
    marks = [r["source"]["snapshot"] for r in reads]
    return marks[0], marks[-1], Counter(marks)


def test_parallel_snapshot_equals_a_single_reader(db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="capture.connector")
    seed(db)
    single, parallel = tmp_path / "single", tmp_path / "parallel"
    one = capture(single, db, slot="one")
    many = capture(parallel, db, slot="many", snapshot_workers=3)
    assert one.snapshot_rows == many.snapshot_rows == ROWS + ROWS // 2 + 3
    indexes: dict[str, list[int]] = {}
    for topic in (KEYED, KEYLESS, SMALL):
        a, b = snapshot_reads(single, topic), snapshot_reads(parallel, topic)
        assert len(a) == len(b) > 0, topic
        if topic == KEYLESS:  # no key: the same multiset of rows
            assert Counter(orjson.dumps(r["after"]) for r in a) == Counter(orjson.dumps(r["after"]) for r in b)
        else:
            assert {orjson.dumps(r["after"]["id"]): r["after"] for r in a} == {
                orjson.dumps(r["after"]["id"]): r["after"] for r in b
            }
        assert markers(a) == markers(b), topic  # the same first / last markers, as many "true"s
        assert {r["source"]["lsn"] for r in b} == {r["source"]["commit_lsn"] for r in b}
        indexes[topic] = [r["source"]["event_index"] for r in b]
    # tables go in name order: loose (split into ranges), small (read by the connector), t (split)
    assert markers(snapshot_reads(parallel, KEYLESS))[:2] == ("first", "last_in_data_collection")
    assert markers(snapshot_reads(parallel, SMALL))[:2] == ("first_in_data_collection", "last_in_data_collection")
    assert markers(snapshot_reads(parallel, KEYED))[:2] == ("first_in_data_collection", "last")
    assert "3 snapshot reader processes started" in caplog.text
    every = sorted(i for found in indexes.values() for i in found)
    assert every == list(range(len(every)))  # unique and dense, as the single reader numbers them
    keyed = latest_by_key(parallel, KEYED)
    assert {k: normalized(v) for k, v in keyed.items()} == table_rows(db)
    big = [v for v in keyed.values() if v["big"] is not None]
    assert len(big) == ROWS // 500 and all(len(v["big"]) == 3200 for v in big)


def churn(dsn: str, stop: threading.Event, done: list[int]) -> None:
    """Updates, deletes and inserts of t until ``stop``; ``done``: how many transactions committed."""
    with psycopg.connect(dsn, autocommit=True) as c:
        i = 0
        while not stop.is_set() or i < 20:
            i += 1
            key = 1 + (i * 7919) % ROWS
            c.execute("UPDATE t SET v = 'churn' || %s WHERE id = %s", (i, key))
            c.execute("DELETE FROM t WHERE id = %s", (1 + (i * 104729) % ROWS,))
            c.execute("INSERT INTO t (id, v) VALUES (%s, 'new') ON CONFLICT (id) DO UPDATE SET v = 'again'",
                      (ROWS + i,))  # fmt: skip
            done[0] = i


@pytest.mark.parametrize("plugin", [Source(Plugin.WAL2JSON), Source(Plugin.PGOUTPUT, 18)], ids=str, indirect=True)
def test_parallel_snapshot_under_concurrent_writes(db: str, tmp_path: Path, plugin: Plugin) -> None:
    """Writes during the snapshot arrive by streaming after it; per key, the read comes first (wal2json on 15,
    pgoutput on 18)."""
    seed(db)
    stop, done = threading.Event(), [0]
    writer = threading.Thread(target=churn, args=(db, stop, done), daemon=True)
    writer.start()
    try:
        while done[0] < 5:
            time.sleep(0.01)
        stats = capture(tmp_path, db, slot="busy", snapshot_workers=2, plugin=plugin)
    finally:
        stop.set()
        writer.join()
    capture(tmp_path, db, slot="busy", snapshot_workers=2, plugin=plugin)  # streams what the writer did meanwhile
    assert stats.snapshot_rows > 0
    assert {k: normalized(v) for k, v in latest_by_key(tmp_path, KEYED).items()} == table_rows(db)
    streamed: set[bytes] = set()  # keys with a streamed change so far, in log order
    read: set[bytes] = set()
    for key, value, _ in records(tmp_path, KEYED):
        k = orjson.dumps(key)
        if value is not None and value["op"] == "r":
            assert k not in streamed, f"key {key}: a streamed change precedes its snapshot read"
            assert k not in read, f"key {key} read twice"
            read.add(k)
        elif value is not None:
            streamed.add(k)
    assert streamed and read


def test_a_reader_killed_mid_snapshot_fails_and_the_next_start_takes_it_again(db: str, tmp_path: Path) -> None:
    """Killed once rows are appended (small batches: appended, not committed); nothing visible; taken again."""
    seed(db)
    config = CaptureConfig(dsn=db, slot="killed", topic_prefix="cdc", exit_when_caught_up=True, snapshot_workers=2,
                           batch_events=1_000)  # fmt: skip
    failure: list[BaseException] = []
    with Log(tmp_path) as log:
        connector = Connector(config, log)
        thread = run_connector(connector, failure)
        killed = None
        readers: list[int] = []
        while thread.is_alive() and killed is None:
            readers = readers or reader_pids()  # found once: scanning /proc is slow on a loaded machine
            if readers and connector.stats.snapshot_rows >= 5_000:
                killed = readers[0]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.001)
        thread.join()
    assert killed is not None, "the snapshot ended before a reader could be killed in it"
    assert len(failure) == 1 and isinstance(failure[0], SnapshotReaderDied), failure
    assert str(killed) in str(failure[0])
    appended = sum(len(records(tmp_path, topic, "read_uncommitted")) for topic in (KEYED, KEYLESS, SMALL))
    assert appended >= 1_000  # the aborted snapshot's appended batches ...
    for topic in (KEYED, KEYLESS, SMALL):
        assert records(tmp_path, topic) == [], topic  # ... of which a read_committed reader sees nothing
    stats = capture(tmp_path, db, slot="killed", snapshot_workers=2)
    assert stats.snapshot_rows == ROWS + ROWS // 2 + 3
    reads = snapshot_reads(tmp_path, KEYED)
    assert len(reads) == ROWS == len({r["after"]["id"] for r in reads})
    assert {k: normalized(v) for k, v in latest_by_key(tmp_path, KEYED).items()} == table_rows(db)
    assert not reader_pids()


def test_stopped_mid_snapshot_ends_the_readers_and_the_next_start_takes_it_again(db: str, tmp_path: Path) -> None:
    seed(db)
    config = CaptureConfig(dsn=db, slot="stopped", topic_prefix="cdc", exit_when_caught_up=True, snapshot_workers=2,
                           batch_events=1_000)  # fmt: skip
    with Log(tmp_path) as log:
        connector = Connector(config, log)
        thread = threading.Thread(target=connector.run)
        thread.start()
        while thread.is_alive() and connector.stats.snapshot_rows < 5_000:
            time.sleep(0.002)
        stopped_at = connector.stats.snapshot_rows
        connector.stop()
        thread.join()
    assert stopped_at < ROWS + ROWS // 2 + 3, "the snapshot ended before it could be stopped"
    assert not reader_pids()
    for topic in (KEYED, KEYLESS, SMALL):
        assert records(tmp_path, topic) == [], topic
    stats = capture(tmp_path, db, slot="stopped", snapshot_workers=2)
    assert stats.snapshot_rows == ROWS + ROWS // 2 + 3
    assert {k: normalized(v) for k, v in latest_by_key(tmp_path, KEYED).items()} == table_rows(db)


def test_a_parallel_snapshot_taken_again_deletes_the_rows_gone_meanwhile(db: str, tmp_path: Path) -> None:
    """The key state written from the readers' batches serves capture.recovery as a single reader's does."""
    seed(db)
    capture(tmp_path, db, slot="again", snapshot_workers=2)
    drop_slots(db)  # the slot is lost: what follows is never streamed
    sql(db, "DELETE FROM t WHERE id % 3 = 0", "UPDATE t SET v = 'changed' WHERE id % 3 = 1")
    stats = capture(tmp_path, db, slot="again", snapshot=SnapshotMode.WHEN_NEEDED, snapshot_workers=2)
    assert stats.snapshot_rows == ROWS - ROWS // 3 + ROWS // 2 + 3
    recovered = [v for v in events(tmp_path, KEYED) if v["source"]["snapshot"] == RECOVERY_MARKER]
    assert len(recovered) == ROWS // 3 and all(v["op"] == "d" and v["before"]["id"] % 3 == 0 for v in recovered)
    assert {k: normalized(v) for k, v in latest_by_key(tmp_path, KEYED).items()} == table_rows(db)


def test_readers_started_before_the_slot_are_ended_when_no_table_needs_them(
    db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --snapshot-workers > 1 the reader processes start before the slot is created (their imports run
    meanwhile); a snapshot with no table big enough for them ends them unused, and so does a failure before
    any table is read (here: the slot cannot be created)."""
    caplog.set_level(logging.INFO, logger="capture.connector")
    sql(db, "CREATE TABLE tiny (id int PRIMARY KEY)", "INSERT INTO tiny VALUES (1), (2)")
    assert capture(tmp_path / "a", db, slot="tiny", snapshot_workers=2).snapshot_rows == 2
    assert "2 snapshot reader processes started" in caplog.text
    assert not reader_pids()
    drop_slots(db)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise psycopg.errors.ConfigurationLimitExceeded("all replication slots are in use")

    monkeypatch.setattr(ReplicationConnection, "create_slot", refused)
    with pytest.raises(PermanentCaptureError, match="replication slots are all in use"):
        capture(tmp_path / "b", db, slot="refused", snapshot_workers=2)
    assert not reader_pids()


def test_ranges_cover_the_table_and_are_tid_range_scans(db: str) -> None:
    """Ranges split the table's blocks without gap or overlap (the last open-ended), each one a TID range scan."""
    seed(db)
    table = next(t for t in TableCatalog(db, TableFilter(), KeylessPolicy.KEYLESS).load() if t.name == "loose")
    with psycopg.connect(db) as c:
        row = c.execute(BLOCKS_SQL, ("public.loose",)).fetchone()
        assert row is not None
        blocks = int(row[0])
        ranges = tid_ranges(table, blocks, 3)
        assert len(ranges) > 3 and ranges[0].first_block == 0 and ranges[-1].end_block is None
        assert all(a.end_block == b.first_block for a, b in itertools.pairwise(ranges))
        counts = [c.execute(f"SELECT count(*) FROM loose WHERE {r.where()}".encode()).fetchone() for r in ranges]
        assert sum(n[0] for n in counts if n is not None) == ROWS // 2
        plan = c.execute(f"EXPLAIN {select_columns_sql(table, ranges[1].where())}".encode()).fetchall()
        assert plan[0][0].startswith("Tid Range Scan on loose"), plan
    assert tid_ranges(table, 2 * 8 - 1, 3) == []  # below 2 × MIN_RANGE_BLOCKS: read by the connector
    assert tid_ranges(table, blocks, 1) == []


def test_the_small_row_shortcut_never_misses_a_big_row(db: str) -> None:
    """EventEncoder.toast_values given the value's length answers as it does from the values, rows of every
    variable-length kind from tiny to past the TOAST threshold (the shortcut's bound, checked)."""
    sql(
        db,
        "CREATE TABLE kinds (id int PRIMARY KEY, s text, b bytea, j jsonb, ts timestamptz[], n numeric, i int[])",
        "INSERT INTO kinds SELECT g, repeat('é', g), decode(repeat('ab', g), 'hex'), "
        "jsonb_build_object('k', repeat('x', g)), array_fill('2024-03-31 01:30:00.123456+02'::timestamptz, "
        "ARRAY[g / 16]), repeat('9', 1 + g % 900)::numeric, array_fill(7, ARRAY[g / 2]) "
        "FROM generate_series(0, 1400, 7) g",
    )
    table = next(t for t in TableCatalog(db, TableFilter(), KeylessPolicy.KEYLESS).load() if t.name == "kinds")
    encoder = EventEncoder("cdc", "db", TableFilter(), JsonConverter())
    ctx = TxnContext(None, 1, 1, snapshot="true")
    with psycopg.connect(db, options=SESSION_OPTIONS) as c:
        res = c.execute(select_columns_sql(table).encode()).pgresult
        assert res is not None
        rows = list(result_rows(res, table))
    outcomes: Counter[str] = Counter()
    for columns in rows:
        _, value, after = encoder.read_record(table, columns, ctx, 0, 0)
        exact = encoder.toast_values(table, after)
        assert encoder.toast_values(table, after, len(value)) == exact
        outcomes["big" if exact is not None else "small"] += 1
    assert outcomes["big"] > 10 and outcomes["small"] > 10, outcomes


def test_bad_snapshot_workers_are_refused(db: str) -> None:
    for workers, message in ((0, "--snapshot-workers must be 1 to 64, not 0"), (65, "not 65")):
        with pytest.raises(ConfigError, match=message):
            CaptureConfig(dsn=db, snapshot_workers=workers).validate()
    with pytest.raises(ConfigError, match="needs --value-format json"):
        CaptureConfig(dsn=db, snapshot_workers=2, value_format=ValueFormat.AVRO).validate()
    result = CliRunner().invoke(app, ["capture", "run", "--dsn", db, "--snapshot-workers", "-3"])
    assert result.exit_code != 0 and "--snapshot-workers must be 1 to 64, not -3" in result.output, result.output
    result = CliRunner().invoke(app, ["capture", "run", "--dsn", db, "--snapshot-workers", "two"])
    assert result.exit_code != 0 and "--snapshot-workers" in result.output, result.output
