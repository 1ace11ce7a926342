"""Position and slot on start (capture.recovery), and a lost slot recovered with the deletes made meanwhile.

Every scenario ends with the same check: the latest value per key of the table's topic (tombstones
and ``d`` events removing keys) equals ``SELECT *`` of the table, deletes included.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from backends import Backend
from capture_util import capture, drop_slots, fresh_database, latest_by_key, records, sql
from readiness import wait_for_text
from sources import ON_BOTH_SERVERS

from capture.config import OffsetMismatch, SnapshotMode, ValueFormat
from capture.connector import CaptureConfig, Connector, SlotLostError, slot_status
from capture.errors import OffsetMismatchError
from capture.messages import Plugin
from capture.recovery import RECOVERY_MARKER
from capture.sinks.embedded import EmbeddedLogSink
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.partition_log import LOCK_FILE
from eventstore.schema_store import LogSchemaStore
from schemas.position import POSITIONS_TOPIC, SourcePosition, connector_key, format_lsn, parse_lsn
from schemas.registry import SchemaRegistry
from schemas.wire import AvroWire
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
TOPIC = "cdc.public.t"


@pytest.fixture
def db(server: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(server, request.node.name[:16].lower().replace("[", "_").replace("]", ""))
    yield dsn
    drop_slots(dsn)


def table_rows(dsn: str, table: str = "t") -> dict[bytes, Any]:
    """``SELECT *`` keyed as latest_by_key keys the topic (canonical JSON of the key)."""
    with psycopg.connect(dsn) as c:
        rows = c.execute(f"SELECT id, v FROM {table}").fetchall()
    return {orjson.dumps({"id": i}, option=orjson.OPT_SORT_KEYS): {"id": i, "v": v} for i, v in rows}


def seed(dsn: str, rows: int = 50) -> None:
    sql(dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
        f"INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, {rows}) g")  # fmt: skip


def while_unstreamed(dsn: str) -> None:
    """Changes no slot will ever stream: deletes (what a plain re-snapshot never learns), updates, inserts."""
    sql(
        dsn,
        "DELETE FROM t WHERE id <= 10",
        "UPDATE t SET v = 'changed' WHERE id BETWEEN 11 AND 20",
        "INSERT INTO t SELECT g, 'new' || g FROM generate_series(51, 55) g",
    )


def recovered_deletes(log_dir: Path) -> list[tuple[Any, Any]]:
    """(key, value) of the recovery's ``d`` events and the record after each (its tombstone)."""
    recs = records(log_dir, TOPIC)
    out = []
    for i, (key, value, _) in enumerate(recs):
        if value is not None and value["source"]["snapshot"] == RECOVERY_MARKER:
            out.append((key, value))
            assert recs[i + 1][0] == key and recs[i + 1][1] is None, "a recovered delete without its tombstone"
    return out


# ---------------------------------------------------------------------------- a slot gone


@pytest.mark.parametrize("plugin", ON_BOTH_SERVERS, ids=str, indirect=True)
def test_dropped_slot_stops_loudly_then_when_needed_recovers_the_deletes(db: str, tmp_path: Path,
                                                                         plugin: Plugin) -> None:  # fmt: skip
    log_dir = tmp_path / "log"
    seed(db)
    capture(log_dir, db, plugin=plugin)
    sql(db, "UPDATE t SET v = 'streamed' WHERE id IN (1, 30)")
    capture(log_dir, db, plugin=plugin)
    drop_slots(db)
    while_unstreamed(db)
    with pytest.raises(SlotLostError, match=r"slot t does not exist .*--snapshot when_needed"):
        capture(log_dir, db, plugin=plugin)
    capture(log_dir, db, plugin=plugin, snapshot=SnapshotMode.WHEN_NEEDED)
    assert latest_by_key(log_dir, TOPIC) == table_rows(db)
    deletes = recovered_deletes(log_dir)
    assert sorted(k["id"] for k, _ in deletes) == list(range(1, 11))
    assert all(v["op"] == "d" and v["after"] is None and v["before"] == k for k, v in deletes)
    # streaming goes on from the new slot, and a plain start agrees with it (no mismatch)
    sql(db, "DELETE FROM t WHERE id = 55", "INSERT INTO t VALUES (100, 'after')")
    capture(log_dir, db, plugin=plugin)
    assert latest_by_key(log_dir, TOPIC) == table_rows(db)
    assert len(recovered_deletes(log_dir)) == 10


def test_a_table_emptied_while_the_slot_was_gone(db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    seed(db, rows=20)
    capture(log_dir, db)
    drop_slots(db)
    sql(db, "DELETE FROM t")
    capture(log_dir, db, snapshot=SnapshotMode.WHEN_NEEDED)
    assert latest_by_key(log_dir, TOPIC) == {} == table_rows(db)
    assert len(recovered_deletes(log_dir)) == 20


@pytest.fixture(scope="module")
def small_wal_keep() -> Iterator[LocalPostgres]:
    """A private cluster whose slots lose their WAL past 1 MB of lag (max_slot_wal_keep_size)."""
    directory = Path(tempfile.mkdtemp(prefix="tideline-pg-walkeep-"))
    cluster = LocalPostgres(directory / "cluster", fast=True)
    try:
        cluster.start()
        sql(cluster.dsn, "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'", "SELECT pg_reload_conf()")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


def invalidate(dsn: str, slot: str, elsewhere: str) -> None:
    """Push the WAL past max_slot_wal_keep_size until the server invalidates the (inactive) slot; the
    writes go to another database (``elsewhere``) of the cluster: the WAL is the cluster's."""
    deadline = time.monotonic() + 120
    sql(elsewhere, "CREATE TABLE IF NOT EXISTS filler (id bigserial PRIMARY KEY, pad text)")
    while (slot_status(dsn, slot) or {}).get("wal_status") != "lost":
        assert time.monotonic() < deadline, f"slot {slot} never lost its WAL: {slot_status(dsn, slot)}"
        sql(elsewhere, "INSERT INTO filler (pad) SELECT repeat('x', 500) FROM generate_series(1, 2000)",
            "SELECT pg_switch_wal()", "CHECKPOINT")  # fmt: skip


def test_slot_invalidated_by_max_slot_wal_keep_size(small_wal_keep: LocalPostgres, tmp_path: Path) -> None:
    dsn = fresh_database(small_wal_keep, "walkeep")
    log_dir = tmp_path / "log"
    seed(dsn)
    capture(log_dir, dsn)
    while_unstreamed(dsn)
    invalidate(dsn, "t", small_wal_keep.dsn)
    with pytest.raises(SlotLostError, match=r"slot t was invalidated .*wal_status = lost.*--snapshot when_needed"):
        capture(log_dir, dsn)
    capture(log_dir, dsn, snapshot=SnapshotMode.WHEN_NEEDED)
    assert latest_by_key(log_dir, TOPIC) == table_rows(dsn)
    assert sorted(k["id"] for k, _ in recovered_deletes(log_dir)) == list(range(1, 11))
    assert (slot_status(dsn, "t") or {}).get("wal_status") != "lost"
    drop_slots(dsn)


# ---------------------------------------------------------------------------- kill -9 during the recovery

CHILD = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
from capture.connector import CaptureConfig, Connector, SnapshotMode
from eventstore.log import Log
with Log(sys.argv[1]) as log:
    Connector(CaptureConfig(dsn=sys.argv[2], slot="t", topic_prefix="cdc", snapshot=SnapshotMode.WHEN_NEEDED,
                            exit_when_caught_up=True), log).run()
print("done", flush=True)
"""


def test_kill_during_the_recovery_still_deletes(db: str, tmp_path: Path) -> None:
    """The recovery's snapshot and deletes are built, the process waits to append them (the table
    partition's append lock is held here), and is killed: the restart deletes the same rows."""
    import fcntl

    log_dir = tmp_path / "log"
    seed(db)
    capture(log_dir, db)
    drop_slots(db)
    while_unstreamed(db)
    fd = os.open(log_dir / f"{TOPIC}-0" / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    stderr = tmp_path / "killed.stderr"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with open(stderr, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-c", CHILD, str(log_dir), db], env=env, stderr=err)
        try:
            wait_for_text(stderr, "gone from the table: deleted", "the recovery to build its deletes", alive=proc)
            assert proc.poll() is None
        finally:
            proc.kill()
            proc.wait()
    finally:
        os.close(fd)
    assert recovered_deletes(log_dir) == []  # nothing of the killed recovery is visible
    with Log(log_dir) as log:
        position = Connector(CaptureConfig(dsn=db, slot="t", topic_prefix="cdc"), log).read_position()
    assert position is not None and not position.snapshot_done  # "snapshot under way": the restart takes it again
    capture(log_dir, db, snapshot=SnapshotMode.WHEN_NEEDED)
    assert latest_by_key(log_dir, TOPIC) == table_rows(db)
    assert sorted(k["id"] for k, _ in recovered_deletes(log_dir)) == list(range(1, 11))


# ---------------------------------------------------------------------------- position vs slot


def slot_lsn(dsn: str) -> int:
    info = slot_status(dsn, "t")
    assert info is not None and info["confirmed_flush_lsn"]
    return parse_lsn(info["confirmed_flush_lsn"])


def stored(log_dir: Path, dsn: str) -> SourcePosition:
    with Log(log_dir) as log:
        position = Connector(CaptureConfig(dsn=dsn, slot="t", topic_prefix="cdc"), log).read_position()
    assert position is not None
    return position


def test_an_idle_connector_never_confirms_the_slot_past_its_stored_position(
    postgres: LocalPostgres, db: str, tmp_path: Path
) -> None:
    """WAL of another database moves the keepalives' WAL end past the stored position: the connector
    stores that position before it confirms it. (Confirming first made every idle stop look like a
    slot moved by someone else.)"""
    log_dir = tmp_path / "log"
    seed(db, rows=5)
    capture(log_dir, db)
    before = slot_lsn(db)
    other = fresh_database(postgres, "idle_other")
    sql(other, "CREATE TABLE busy (id int PRIMARY KEY)", "INSERT INTO busy SELECT generate_series(1, 1000)")
    capture(log_dir, db)
    assert before < slot_lsn(db) <= stored(log_dir, db).confirm_lsn
    capture(log_dir, db)  # and the next start finds them in agreement


@pytest.mark.parametrize("strategy", list(OffsetMismatch), ids=[s.value for s in OffsetMismatch])
def test_slot_ahead_of_the_stored_position(db: str, tmp_path: Path, strategy: OffsetMismatch) -> None:
    """Someone else advanced the slot past changes the log never got (pg_replication_slot_advance)."""
    log_dir = tmp_path / "log"
    seed(db)
    capture(log_dir, db)
    kept = stored(log_dir, db).confirm_lsn
    sql(db, "DELETE FROM t WHERE id <= 5", "INSERT INTO t VALUES (60, 'skipped')")
    sql(db, "SELECT pg_replication_slot_advance('t', pg_current_wal_lsn())")
    ahead = slot_lsn(db)
    assert ahead > kept
    if strategy is OffsetMismatch.FAIL:
        with pytest.raises(OffsetMismatchError) as failed:
            capture(log_dir, db, offset_mismatch=strategy)
        message = str(failed.value)
        assert "slot is ahead" in message and format_lsn(ahead) in message and format_lsn(kept) in message
        assert "trust_slot" in message and "trust_offset" in message and "\n" not in message
        assert stored(log_dir, db).confirm_lsn == kept  # nothing was written
        return
    sql(db, "INSERT INTO t VALUES (61, 'after')")
    capture(log_dir, db, offset_mismatch=strategy)
    state = latest_by_key(log_dir, TOPIC)
    if strategy is OffsetMismatch.TRUST_SLOT:  # the skipped changes stay lost; what follows is streamed
        assert b'{"id":60}' not in state and b'{"id":1}' in state and b'{"id":61}' in state
        assert recovered_deletes(log_dir) == []
    else:  # trust_offset: a new slot and snapshot bring the log back to the table, deletes included
        assert state == table_rows(db)
        assert sorted(k["id"] for k, _ in recovered_deletes(log_dir)) == [1, 2, 3, 4, 5]
    capture(log_dir, db)  # agreement now: the default (fail) starts
    assert slot_lsn(db) <= stored(log_dir, db).confirm_lsn


@pytest.mark.parametrize("strategy", list(OffsetMismatch), ids=[s.value for s in OffsetMismatch])
def test_server_behind_the_stored_position(db: str, tmp_path: Path, strategy: OffsetMismatch) -> None:
    """A log that holds a position this server's WAL has not reached (as after a restore of the database
    from an older backup): written here as the connector writes its position, in a log transaction."""
    log_dir = tmp_path / "log"
    seed(db)
    capture(log_dir, db)
    here = stored(log_dir, db)
    beyond = here.confirm_lsn + (1 << 32)  # 4 GB of WAL this server never wrote
    with Log(log_dir) as log:
        sink = EmbeddedLogSink(log)
        sink.open("capture.cdc.t")
        sink.begin()
        sink.commit(POSITIONS_TOPIC, connector_key("cdc", "t"), SourcePosition(beyond - 1, -1, True, beyond).to_json())
        sink.close()
    sql(db, "INSERT INTO t VALUES (70, 'new history')")
    if strategy is OffsetMismatch.FAIL:
        with pytest.raises(OffsetMismatchError, match="server's WAL is behind the stored position"):
            capture(log_dir, db, offset_mismatch=strategy)
        return
    capture(log_dir, db, offset_mismatch=strategy)
    state = latest_by_key(log_dir, TOPIC)
    if strategy is OffsetMismatch.TRUST_SLOT:  # streamed from the slot: the server's history is the truth
        assert state == table_rows(db)
        assert stored(log_dir, db).confirm_lsn < beyond
    else:  # trust_offset: everything up to the stored position is skipped
        assert b'{"id":70}' not in state
        assert stored(log_dir, db).confirm_lsn == beyond


# ---------------------------------------------------------------------------- Kafka


def test_dropped_slot_recovered_into_kafka(db: str, kafka: LocalKafka, tmp_path: Path) -> None:
    """The same recovery with Kafka as the log: the key state (local) knows the topic's keys."""
    backend = Backend.kafka(kafka.bootstrap_servers, tmp_path / "state")
    config = CaptureConfig(dsn=db, slot="t", topic_prefix=backend.prefix, exit_when_caught_up=True)
    seed(db)
    backend.run(config)
    drop_slots(db)
    while_unstreamed(db)
    with pytest.raises(SlotLostError, match="when_needed"):
        backend.run(config)
    backend.run(dataclasses.replace(config, snapshot=SnapshotMode.WHEN_NEEDED))
    state: dict[bytes, Any] = {}
    recovered = []
    for _, key, value in backend.records(f"{backend.prefix}.public.t"):
        assert key is not None
        k = orjson.dumps(orjson.loads(key), option=orjson.OPT_SORT_KEYS)
        envelope = None if value is None else orjson.loads(value)
        if envelope is None or envelope["op"] == "d":
            state.pop(k, None)
            if envelope is not None and envelope["source"]["snapshot"] == RECOVERY_MARKER:
                recovered.append(envelope["before"]["id"])
        else:
            state[k] = envelope["after"]
    assert state == table_rows(db)
    assert sorted(recovered) == list(range(1, 11))


def test_recovery_with_avro_values(db: str, tmp_path: Path) -> None:
    """Avro envelopes: the recovered deletes decode under the table's schema (``before`` null: Avro keys
    are not decoded back into row values) and each is followed by its tombstone."""
    log_dir = tmp_path / "log"
    seed(db, rows=20)
    capture(log_dir, db, value_format=ValueFormat.AVRO)
    drop_slots(db)
    sql(db, "DELETE FROM t WHERE id IN (3, 7)")
    capture(log_dir, db, value_format=ValueFormat.AVRO, snapshot=SnapshotMode.WHEN_NEEDED)
    with Log(log_dir) as log, Consumer(log, enable_auto_commit=False) as consumer:
        wire = AvroWire(SchemaRegistry(LogSchemaStore(log)).schema_by_id, logical_types=False)
        consumer.assign([TopicPartition(TOPIC, 0)])
        consumer.seek_to_beginning()
        recs = []
        while batch := consumer.poll(timeout_ms=0):
            recs += [(wire.decode(r.key), None if r.value is None else wire.decode(r.value)) for r in batch]
    state: dict[int, Any] = {}
    recovered = []
    for i, (key, value) in enumerate(recs):
        if value is None or value["op"] == "d":
            state.pop(key["id"], None)
        else:
            state[key["id"]] = value["after"]["v"]
        if value is not None and value["source"]["snapshot"] == RECOVERY_MARKER:
            assert value["op"] == "d" and value["before"] is None and recs[i + 1] == (key, None)
            recovered.append(key["id"])
    assert sorted(recovered) == [3, 7]
    assert {orjson.dumps({"id": k}, option=orjson.OPT_SORT_KEYS): {"id": k, "v": v} for k, v in state.items()} == (
        table_rows(db)
    )
