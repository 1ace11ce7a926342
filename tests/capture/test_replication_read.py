"""The replication stream's runs (capture.replication.XLogRun, ReplicationConnection.read_run): read by the
native extension with libpq's own calls, they hold the same messages, in the same order, as psycopg reads
them — against a real PostgreSQL's walsender."""

from __future__ import annotations

import array
import time
from collections.abc import Iterator

import psycopg
import pytest
from capture_util import drop_slots, fresh_database

from capture import libpq, replication
from capture.native import extension
from capture.replication import Keepalive, ReplicationConnection, XLogData, XLogRun
from schemas.position import parse_lsn
from tideline.pgharness import LocalPostgres

WAL2JSON = {"format-version": "2", "include-xids": "1"}


@pytest.fixture
def db(postgres: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(postgres, request.node.name[:16].lower().replace("[", "_").replace("]", ""))
    yield dsn
    drop_slots(dsn)


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        for s in statements:
            c.execute(s.encode())


def read_all(dsn: str, slot: str, end: int, limit: int) -> tuple[list[bytes], list[int]]:
    """Every XLogData message of ``slot`` up to ``end`` (raw, as it came), read in runs of up to ``limit``;
    and the length of each run."""
    repl = ReplicationConnection(dsn)
    messages: list[bytes] = []
    runs: list[int] = []
    try:
        repl.start(slot, 0, WAL2JSON)
        while True:
            msg = repl.read(5.0)
            assert msg is not None, f"no message for 5 s after {len(messages)} (end {end})"
            if isinstance(msg, Keepalive):
                if msg.wal_end >= end and messages:
                    break
                continue
            assert isinstance(msg, XLogData)
            if not runs:
                time.sleep(0.5)  # the walsender sends the rest meanwhile: the first run reads ahead to the limit
            run = repl.read_run(msg, limit)
            assert run[0] == msg  # the message it was given comes first
            runs.append(len(run))
            messages.extend(run.message(i) for i in range(len(run)))
            if run[-1].wal_end >= end and run[-1].data_start >= end:
                break
    finally:
        repl.close()
    return messages, runs


def without_send_time(raw: bytes) -> bytes:
    """A message without its send time (when the walsender sent it: each read's own; a run's first message,
    made again from its XLogData, has 0 there)."""
    return raw[:17] + raw[25:]


def through_last_commit(messages: list[bytes], inserts: int) -> list[bytes]:
    """The messages up to the COMMIT after the ``inserts``-th INSERT record: the workload's WAL, which both reads
    decode alike. What comes after it differs from read to read (each reads ahead to its own point), and may hold
    transactions of the server's own (an autovacuum's ANALYZE of the catalogs: a BEGIN and a COMMIT)."""
    seen = 0
    for i, m in enumerate(messages):
        payload = m[25:]
        if payload.startswith(b'{"action":"I"'):
            seen += 1
        elif seen == inserts and payload.startswith(b'{"action":"C"'):
            return messages[: i + 1]
    raise AssertionError(f"{seen} INSERT records and no COMMIT after the {inserts}th in {len(messages)} messages")


@pytest.mark.skipif(not extension.available(), reason="the native extension is not built (make native)")
def test_native_runs_hold_what_psycopg_reads(db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert libpq.functions(libpq.STREAM) is not None, "libpq's stream functions must be found for psycopg here"
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v text) WITH (autovacuum_enabled = false)")
    for slot in ("native", "psycopg"):
        sql(db, f"SELECT pg_create_logical_replication_slot('{slot}', 'wal2json')")
    for i in range(40):  # 40 transactions of 50 rows: BEGIN, 50 changes, COMMIT each (wal2json v2)
        sql(db, f"INSERT INTO t SELECT g, repeat('x', g % 300) FROM generate_series({i * 50}, {i * 50 + 49}) g")
    with psycopg.connect(db, autocommit=True) as c:
        row = c.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        end = parse_lsn(row[0])
    native, native_runs = read_all(db, "native", end, 64)
    monkeypatch.setattr(replication, "_read_xlog", None)  # the psycopg path
    through_psycopg, _ = read_all(db, "psycopg", end, 64)
    workload = through_last_commit(native, 2000)
    assert len(workload) >= 40 * 52  # 40 × (BEGIN, 50 INSERTs, COMMIT), and any server transaction in between
    assert [without_send_time(m) for m in workload] == [
        without_send_time(m) for m in through_last_commit(through_psycopg, 2000)
    ]
    assert native_runs[0] == 64, native_runs  # read ahead, up to the limit
    assert all(m[:1] == b"w" for m in native)


def test_run_of_messages() -> None:
    raws = [XLogData(16 + i, 32 + i, f"payload {i}".encode()).raw() for i in range(5)]
    run = XLogRun.of(raws)
    assert len(run) == 5
    assert [run.message(i) for i in range(5)] == raws
    assert run[3] == XLogData(19, 35, b"payload 3")
    assert run[-1] == XLogData(20, 36, b"payload 4")
    assert run[1:3] == [XLogData(17, 33, b"payload 1"), XLogData(18, 34, b"payload 2")]
    assert len(XLogRun.of([])) == 0
    with pytest.raises(IndexError, match="no message 5 of 5"):
        run.message(5)


def test_run_refuses_offsets_that_do_not_span_its_data() -> None:
    with pytest.raises(ValueError, match="do not span the 10 bytes"):
        XLogRun(b"w" * 10, array.array("I", [0, 4, 9]).tobytes())
    with pytest.raises(ValueError, match="do not span"):
        XLogRun(b"w" * 10, array.array("I", [1, 10]).tobytes())


@pytest.mark.skipif(not extension.available(), reason="the native extension is not built (make native)")
def test_read_xlog_refuses_null_addresses() -> None:
    assert extension.read_xlog is not None
    with pytest.raises(ValueError, match="null connection or function address"):
        extension.read_xlog(0, 1, 1, 1, None, 10, 1 << 20)
