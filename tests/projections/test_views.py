"""Read views: rebuild == follow == the pure-Python reference, for every shipped view, on random
workloads through the real capture (commands via outbox routing; a plain table with deletes,
tombstones, primary-key changes and truncates as a CDC topic); read-your-writes."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import orjson
import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient
from pyspark.sql import SparkSession
from views_util import (
    ACCOUNTS_TOPIC,
    HEARTBEAT,
    capture,
    capture_config,
    change_accounts,
    drop_slots,
    issue_commands,
    migrated_database,
    poisoned_log,
    soak,
)

from capture.connector import Connector, ValueFormat
from commands.db import make_engine
from commands.handler import CommandHandler, HandlerConfig
from commands.schema import metadata as write_model
from eventstore.log import Log
from eventstore.schema_store import LogSchemaStore
from examples.reservations.api import create_app
from examples.reservations.domain import USER, RegisterUser
from examples.reservations.models import metadata as example_tables
from examples.reservations.views import VIEWS
from projections.consistency import parse_lsn, wait_for
from projections.follow import Follower, follow
from projections.models import metadata as read_side
from projections.progress import FoldFailed
from projections.rebuild import rebuild
from projections.reference import expected_rows, records, view_rows
from projections.schema_versions import value_schema_versions
from schemas.registry import SchemaRegistry
from tideline.pgharness import LocalPostgres

SHIPPED = ["users", "seats", "show_occupancy", "snapshots", f"mirror:{ACCOUNTS_TOPIC}"]
ROUNDS = 4 if soak() else 2
COMMANDS = 600 if soak() else 150
CHANGES = 400 if soak() else 120


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = migrated_database(postgres, "eq")
    yield dsn
    drop_slots(dsn)


def assert_schema_intact(dsn: str) -> None:
    engine = make_engine(dsn)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), [write_model, read_side, example_tables])
    finally:
        engine.dispose()
    assert [d for d in diff if not (d[0] == "remove_table" and d[1].name == "accounts")] == []  # accounts: the test's


def test_rebuild_equals_follow_equals_reference(spark: SparkSession, db: str, tmp_path: Path) -> None:
    log_dir, checkpoints = tmp_path / "log", tmp_path / "checkpoints"
    rng = random.Random(7)
    capture(log_dir, db)  # the slot exists before the workload: every change streams (no snapshot reads)
    for round_ in range(ROUNDS):
        assert issue_commands(db, COMMANDS, rng, tag=f"u{round_}-") > 0
        change_accounts(db, CHANGES, rng)
        capture(log_dir, db)
        for name in SHIPPED:  # incremental: each round's follow continues from the last one's checkpoints
            stats = follow(spark, VIEWS, name, log_dir=log_dir, dsn=db, checkpoint_dir=checkpoints, once=True)
            assert stats.events > 0, name
            assert view_rows(db, VIEWS[name]) == expected_rows(VIEWS[name], log_dir), f"follow {name}, round {round_}"
    followed = {name: view_rows(db, VIEWS[name]) for name in SHIPPED}
    assert all(followed.values()), {n: len(r) for n, r in followed.items()}
    for name in SHIPPED:
        result = rebuild(spark, VIEWS, name, log_dir=log_dir, dsn=db)
        assert result.events > 0
        assert view_rows(db, VIEWS[name]) == followed[name] == expected_rows(VIEWS[name], log_dir), f"rebuild {name}"
    assert_schema_intact(db)  # the swaps kept the canonical constraint and index names
    # After a rebuild, follow continues from the rebuild's checkpoints: new events only.
    issue_commands(db, 40, rng, tag="late-")
    capture(log_dir, db)
    for name in ("users", "seats"):
        follow(spark, VIEWS, name, log_dir=log_dir, dsn=db, checkpoint_dir=checkpoints, once=True)
        assert view_rows(db, VIEWS[name]) == expected_rows(VIEWS[name], log_dir), f"follow after rebuild {name}"


def test_cdc_topic_has_tombstones_key_changes_and_truncates(db: str, tmp_path: Path) -> None:
    """The mirror's workload really contains what the equivalence test claims to cover."""
    log_dir = tmp_path / "log"
    capture(log_dir, db)
    change_accounts(db, CHANGES, random.Random(7))
    with psycopg.connect(db, autocommit=True) as c:
        c.execute("INSERT INTO accounts VALUES (1000, 'x', 1)")
        c.execute("UPDATE accounts SET id = 1001 WHERE id = 1000")
        c.execute("TRUNCATE accounts")
    capture(log_dir, db)
    values = [(k, v) for _, _, (k, v) in records(log_dir, (ACCOUNTS_TOPIC,))]
    ops = {orjson.loads(v)["op"] for _, v in values if v is not None}
    assert {"c", "u", "d", "t"} <= ops
    assert any(v is None for _, v in values)
    assert expected_rows(VIEWS[f"mirror:{ACCOUNTS_TOPIC}"], log_dir) == []  # truncated last


def test_read_your_writes(spark: SparkSession, db: str, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    capture(log_dir, db)  # creates the slot (and the offsets topic) before the commands
    with CommandHandler(db, HandlerConfig(snapshot_every=None)) as handler:
        handler.handle(USER, RegisterUser("first", "first_user"))
    capture(log_dir, db)
    with Log(log_dir) as log:
        connector = Connector(capture_config(db, **HEARTBEAT), log)
        capturing = threading.Thread(target=connector.run, daemon=True)
        capturing.start()
        stop = threading.Event()
        follower = Follower(
            spark, VIEWS, "users", log_dir=log_dir, dsn=db, checkpoint_dir=tmp_path / "ck", trigger_seconds=0.2
        )
        following = threading.Thread(target=follower.run, kwargs={"stop": stop}, daemon=True)
        following.start()
        try:
            with CommandHandler(db, HandlerConfig(snapshot_every=None)) as handler:
                result = handler.handle(USER, RegisterUser("u-ryw", "ryw_user"))
            assert wait_for(db, "users", result.commit_lsn, timeout=60)
            assert ("u-ryw", "ryw_user") in {(r[0], r[1]) for r in view_rows(db, VIEWS["users"])}
            # The HTTP API's ?consistent=true: the view has the user when the answer comes.
            client = TestClient(create_app(db, consistency_timeout=60))
            answer = client.post("/users?consistent=true", json={"username": "api_user", "user_id": "u-api"})
            assert answer.status_code == 201, answer.text
            seen = client.get("/views/users/u-api")
            assert seen.status_code == 200 and seen.json()["username"] == "api_user"
            assert not wait_for(db, "users", parse_lsn("FF/0"), timeout=0.3)  # a position nobody has reached
        finally:
            stop.set()
            following.join(timeout=120)
            connector.stop()
            capturing.join(timeout=60)
    assert not following.is_alive() and not capturing.is_alive()
    # Nothing follows or captures now: the view cannot reach a new command's position → 504.
    late = TestClient(create_app(db, consistency_timeout=0.5)).post(
        "/users?consistent=true", json={"username": "late_user", "user_id": "u-late"}
    )
    assert late.status_code == 504, late.text
    assert "u-late" not in {r[0] for r in view_rows(db, VIEWS["users"])}


def test_views_of_avro_capture_equal_those_of_json_capture(spark: SparkSession, db: str, tmp_path: Path) -> None:
    """capture --value-format avro (Avro-framed keys and values through the registry): the
    source's ``decodeAvro`` turns them back into capture's JSON, so the mirror and fold views
    rebuilt from the Avro log equal the reference computed from a JSON capture of the same WAL.

    The table gains a column and loses it again while the views follow (three shapes in one topic, each event
    under its own schema version): the followed mirror takes the new column for the rows changed after the
    ADD, stops writing it for those changed after the DROP, without a rebuild; the rebuild agrees."""
    json_log, avro_log = tmp_path / "json", tmp_path / "avro"
    json_config = replace(capture_config(db, exit_when_caught_up=True), slot="views_json")
    avro_config = replace(
        capture_config(db, exit_when_caught_up=True, value_format=ValueFormat.AVRO), slot="views_avro"
    )

    def capture_both() -> None:
        for log_dir, config in ((json_log, json_config), (avro_log, avro_config)):
            with Log(log_dir) as log:
                Connector(config, log).run()

    capture_both()  # both slots exist before the changes: the same WAL streamed to both (same positions)
    issue_commands(db, COMMANDS // 2, random.Random(23), "av")
    change_accounts(db, CHANGES // 2, random.Random(29))
    capture_both()
    mirror = f"mirror:{ACCOUNTS_TOPIC}"
    rng = random.Random(31)
    for ddl in ("ALTER TABLE accounts ADD COLUMN tier text DEFAULT 'std'", "ALTER TABLE accounts DROP COLUMN tier"):
        with psycopg.connect(db, autocommit=True) as c:
            c.execute(ddl.encode())
            [(at,)] = c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchall()
            for k in range(40):  # every key changed (or created) under the new shape, but a few deleted after
                c.execute("INSERT INTO accounts (id, owner, balance) VALUES (%s, %s, 1) "
                          "ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + 1", (k, f"o{k}"))  # fmt: skip
        change_accounts(db, CHANGES // 4, rng)
        capture_both()
        follow(spark, VIEWS, mirror, log_dir=avro_log, dsn=db, checkpoint_dir=tmp_path / "ck", once=True)
        followed = view_rows(db, VIEWS[mirror])
        assert followed == expected_rows(VIEWS[mirror], json_log), ddl
        newer = [row for _, _, row, commit_lsn, _ in followed if commit_lsn > parse_lsn(at)]  # changed since the DDL
        assert newer and all(("tier" in row) == ("ADD" in ddl) for row in newer), (ddl, newer)
    with Log(avro_log) as log:
        assert SchemaRegistry(LogSchemaStore(log)).versions(f"{ACCOUNTS_TOPIC}-value") == [1, 2]  # v1 found again
    framed = [v for _, _, (_, v) in records_raw(avro_log, (ACCOUNTS_TOPIC,)) if v is not None]
    assert framed and all(v[:1] == b"\x00" for v in framed)  # the topic really is Avro
    assert_read_per_version(spark, avro_log, ACCOUNTS_TOPIC)
    for name in (mirror, "seats"):
        view = VIEWS[name]
        expected = expected_rows(view, json_log)
        assert expected, name
        rebuild(spark, VIEWS, name, log_dir=avro_log, dsn=db)
        assert view_rows(db, view) == expected, name


def assert_read_per_version(spark: SparkSession, log_dir: Path, topic: str) -> None:
    """A topic written under several value schema versions reads whole through the source: with ``decodeAvro`` and
    ``includeSchemaIds`` each row is the JSON of the columns of the version it names (``valueSchemaId``), which
    :func:`value_schema_versions` describes, with where each version started."""
    versions = {v.schema_id: v for v in value_schema_versions(log_dir, topic)}
    assert len(versions) == 2 and all(v.started is not None for v in versions.values()), versions
    rows = (spark.read.format("tideline").option("path", str(log_dir)).option("topic", topic)
            .option("decodeAvro", "true").option("includeSchemaIds", "true").load()
            .where("NOT is_tombstone").select("value", "valueSchemaId", "keySchemaId").collect())  # fmt: skip
    seen: dict[int, int] = {}
    for row in rows:
        event = orjson.loads(bytes(row.value))
        if event["op"] == "t":  # a TRUNCATE: no row image, its key the JSON {}
            assert row.keySchemaId is None and row.valueSchemaId in versions
            continue
        image = event["after"] if event["after"] is not None else event["before"]
        version = versions[row.valueSchemaId]
        assert list(image) == [name for name, _ in version.columns], (image, version)
        assert row.keySchemaId is not None and row.keySchemaId not in versions
        seen[row.valueSchemaId] = seen.get(row.valueSchemaId, 0) + 1
        source = event["source"]
        started = version.started
        assert started is not None and (source["commit_lsn"], source["event_index"]) >= (
            started.commit_lsn, started.event_index)  # fmt: skip
    assert set(seen) == set(versions), seen  # both versions' events are there
    plain = spark.read.format("tideline").option("path", str(log_dir)).option("topic", topic).load()
    assert "valueSchemaId" not in plain.columns  # only when asked


def records_raw(log_dir: Path, topics: tuple[str, ...]) -> Iterator[tuple[str, int, tuple[bytes | None, bytes | None]]]:
    """The stored bytes, not decoded (what :func:`records` would decode)."""
    from eventstore.consumer import Consumer, TopicPartition

    with Log(log_dir, create=False) as log:
        for topic in topics:
            for p in range(log.topic(topic).partitions):
                with Consumer(log, enable_auto_commit=False) as c:
                    c.assign([TopicPartition(topic, p)])
                    c.seek_to_beginning()
                    while batch := c.poll(timeout_ms=0):
                        for r in batch:
                            yield topic, p, (r.key, r.value)


def test_follow_reads_topics_that_appear_later(spark: SparkSession, db: str, tmp_path: Path) -> None:
    """As Kafka's subscribe: a view over topics that do not exist yet (no events of its
    aggregates so far) follows from the start; a topic that appears while it runs is read
    from its earliest offset. ``snapshots`` reads events.user and events.reservation."""
    log_dir, checkpoints = tmp_path / "log", tmp_path / "checkpoints"
    capture(log_dir, db)  # nothing to capture yet: no events.* topic exists
    view = VIEWS["snapshots"]
    stats = follow(spark, VIEWS, "snapshots", log_dir=log_dir, dsn=db, checkpoint_dir=checkpoints, once=True)
    assert stats.events == 0 and view_rows(db, view) == []
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            follow(spark, VIEWS, "snapshots", log_dir=log_dir, dsn=db, checkpoint_dir=checkpoints, stop=stop)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    job = threading.Thread(target=run)
    job.start()
    try:
        with CommandHandler(db, HandlerConfig(snapshot_every=None)) as handler:
            handler.handle(USER, RegisterUser("u1", "first_user"))
        capture(log_dir, db)  # events.user appears while the job runs
        wait_until(lambda: view_rows(db, view) == expected_rows(view, log_dir) != [], errors)
        issue_commands(db, 60, random.Random(3), tag="later-")  # events.reservation appears too
        capture(log_dir, db)
        with Log(log_dir) as log:
            assert {"events.user", "events.reservation"} <= set(log.topics())
        expected = expected_rows(view, log_dir)
        assert {row[1] for row in expected} == {"user", "reservation"}
        wait_until(lambda: view_rows(db, view) == expected, errors)
    finally:
        stop.set()
        job.join(timeout=120)
    assert not job.is_alive() and not errors, errors


def wait_until(condition: Callable[[], bool], errors: list[BaseException], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert not errors, errors
        assert time.monotonic() < deadline, "the follow job did not catch up in time"
        time.sleep(0.5)


def test_rebuild_refuses_an_outbox_record_keyed_by_another_stream(spark: SparkSession, db: str, tmp_path: Path) -> None:
    """A fold rebuild groups streams by record key: a record whose key is not its stream id
    would fold into another stream, so the rebuild fails naming it (and swaps nothing in)."""
    from eventstore.producer import Producer

    log_dir = tmp_path / "log"
    value = (
        b'{"stream_id":"reservation-r1","stream_type":"reservation","version":1,"event_type":"SeatReserved",'
        b'"schema_version":1,"payload":{"reservation_id":"r1","show_id":"s","seat":"A1","customer_id":"c"},'
        b'"recorded_at":"2026-01-01T00:00:00+00:00","source":{"commit_lsn":100,"event_index":0}}'
    )
    with Log(log_dir) as log:
        log.create_topic("events.reservation", partitions=1)
        with Producer(log) as producer:
            producer.send_batch("events.reservation", [value], [b"reservation-r2"])
    with pytest.raises(Exception, match="has key b'reservation-r2', not its stream id"):
        rebuild(spark, VIEWS, "seats", log_dir=log_dir, dsn=db)
    assert view_rows(db, VIEWS["seats"]) == []
    with psycopg.connect(db) as conn:  # the failed rebuild left no staging (or shadow) table
        left = conn.execute(
            r"SELECT relname FROM pg_class WHERE relname LIKE '%\_\_staging' OR relname LIKE '%\_\_shadow'"
        ).fetchall()
    assert left == []


def reservation_event(r: int, version: int, event_type: str, fields: str) -> bytes:
    """An outbox record of reservation ``r`` (stream ``reservation-r<r>``) at ``version``."""
    return (
        f'{{"stream_id":"reservation-r{r}","stream_type":"reservation","version":{version},'
        f'"event_type":"{event_type}","schema_version":1,"payload":{{"reservation_id":"r{r}","show_id":"s",'
        f'{fields}}},"recorded_at":"2026-01-01T00:00:00+00:00","source":{{"commit_lsn":{100 * r + version},'
        f'"event_index":0}}}}'
    ).encode()


def reservations_log(log_dir: Path, streams: dict[int, int]) -> None:
    """A one-partition ``events.reservation`` log: reservation ``r`` reserved seat A<r>, then moved
    ``streams[r] - 1`` times (seat B<r>, C<r>…)."""
    from eventstore.producer import Producer

    with Log(log_dir) as log:
        log.create_topic("events.reservation", partitions=1)
        with Producer(log) as producer:
            for r, versions in streams.items():
                seats = [f"{chr(ord('A') + v)}{r}" for v in range(versions)]
                values = [reservation_event(r, 1, "SeatReserved", f'"seat":"{seats[0]}","customer_id":"c"')]
                values += [
                    reservation_event(r, v + 1, "SeatChanged", f'"from_seat":"{seats[v - 1]}","to_seat":"{seats[v]}"')
                    for v in range(1, versions)
                ]
                producer.send_batch("events.reservation", values, [f"reservation-r{r}".encode()] * len(values))


def test_rebuild_replaces_states_rewriting_only_what_changed(spark: SparkSession, db: str, tmp_path: Path) -> None:
    """A rebuild makes the stored states those of its fold: a stream no longer in the log loses its
    state, a changed one is updated, a new one inserted, and an unchanged one is not rewritten (its
    row version, xmin, stays: a rebuild of an unchanged log leaves no dead rows behind)."""

    def states() -> dict[str, tuple[int, str]]:
        with psycopg.connect(db) as c:
            rows = c.execute(
                "SELECT stream_id, version, xmin::text FROM projection_state WHERE projection = 'seats'"
            ).fetchall()
        return {stream: (version, xmin) for stream, version, xmin in rows}

    first, second = tmp_path / "first", tmp_path / "second"
    reservations_log(first, {1: 1, 2: 1, 3: 2, 4: 1})
    reservations_log(second, {1: 1, 2: 3, 4: 1, 5: 2})  # r2 moved twice more, r3 gone, r5 new
    rebuild(spark, VIEWS, "seats", log_dir=first, dsn=db)
    before = states()
    assert {s: v for s, (v, _) in before.items()} == {
        f"reservation-r{r}": v for r, v in ((1, 1), (2, 1), (3, 2), (4, 1))
    }
    rebuild(spark, VIEWS, "seats", log_dir=first, dsn=db)  # the same log again: nothing rewritten
    assert states() == before
    rebuild(spark, VIEWS, "seats", log_dir=second, dsn=db)
    after = states()
    assert {s: v for s, (v, _) in after.items()} == {
        f"reservation-r{r}": v for r, v in ((1, 1), (2, 3), (4, 1), (5, 2))
    }
    assert after["reservation-r1"] == before["reservation-r1"] and after["reservation-r4"] == before["reservation-r4"]
    assert after["reservation-r2"][1] != before["reservation-r2"][1]
    assert view_rows(db, VIEWS["seats"]) == expected_rows(VIEWS["seats"], second)


def test_rebuild_folds_a_stream_split_over_two_partitions(spark: SparkSession, db: str, tmp_path: Path) -> None:
    """A fold rebuild reads one task per log partition, trusting that a stream lives in one
    partition; a topic whose partition count grew breaks that (older events of a stream in
    another partition). The rebuild notices a stream folded by two tasks and folds again by
    key: the view still equals the reference fold, on a first rebuild and on one over stored states."""
    from eventstore.producer import Producer

    event = reservation_event
    log_dir = tmp_path / "log"
    with Log(log_dir) as log:
        log.create_topic("events.reservation", partitions=2)
        with Producer(log) as producer:
            for r in range(1, 7):
                first = event(r, 1, "SeatReserved", f'"seat":"A{r}","customer_id":"c"')
                then = event(r, 2, "SeatChanged", f'"from_seat":"A{r}","to_seat":"B{r}"')
                key = f"reservation-r{r}".encode()
                producer.send_batch("events.reservation", [first], [key], partition=0)
                producer.send_batch("events.reservation", [then], [key], partition=1 if r % 2 else 0)
    expected = expected_rows(VIEWS["seats"], log_dir)
    assert {row[1] for row in expected} == {f"B{r}" for r in range(1, 7)}  # every stream's second event applies
    rebuild(spark, VIEWS, "seats", log_dir=log_dir, dsn=db)
    assert view_rows(db, VIEWS["seats"]) == expected
    rebuild(spark, VIEWS, "seats", log_dir=log_dir, dsn=db)  # again, over stored states (the upsert path)
    assert view_rows(db, VIEWS["seats"]) == expected


def test_rebuild_folds_interleaved_streams_in_offset_order_or_sorted_past_the_limit(
    spark: SparkSession, db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fold task reads its log partition in offset order, where streams interleave, and holds one
    state per stream; past ``spark.tideline.fold.maxOpenStreams`` streams it stops and the rebuild
    folds sorted by stream instead. Both give the reference fold."""
    from eventstore.producer import Producer
    from projections.engine import MAX_OPEN_STREAMS_CONF

    log_dir = tmp_path / "log"
    with Log(log_dir) as log:
        log.create_topic("events.reservation", partitions=1)
        with Producer(log) as producer:
            for version in (1, 2, 3):  # r1 v1, r2 v1, …, r6 v1, r1 v2, …: every stream open until the end
                for r in range(1, 7):
                    seat, before = f"{chr(ord('A') + version - 1)}{r}", f"{chr(ord('A') + version - 2)}{r}"
                    if version == 1:
                        value = reservation_event(r, 1, "SeatReserved", f'"seat":"{seat}","customer_id":"c"')
                    else:
                        moved = f'"from_seat":"{before}","to_seat":"{seat}"'
                        value = reservation_event(r, version, "SeatChanged", moved)
                    producer.send_batch("events.reservation", [value], [f"reservation-r{r}".encode()], partition=0)
    expected = expected_rows(VIEWS["seats"], log_dir)
    assert {row[1] for row in expected} == {f"C{r}" for r in range(1, 7)}
    with caplog.at_level(logging.WARNING, logger="projections.rebuild"):
        rebuild(spark, VIEWS, "seats", log_dir=log_dir, dsn=db)
        assert view_rows(db, VIEWS["seats"]) == expected
        assert "folding sorted" not in caplog.text
        spark.conf.set(MAX_OPEN_STREAMS_CONF, "4")
        try:
            result = rebuild(spark, VIEWS, "seats", log_dir=log_dir, dsn=db)
        finally:
            spark.conf.unset(MAX_OPEN_STREAMS_CONF)
    assert "more streams in one log partition than 4; folding sorted by stream instead" in caplog.text, caplog.text
    assert result.events == 18
    assert view_rows(db, VIEWS["seats"]) == expected
    with psycopg.connect(db) as c:
        states = c.execute("SELECT stream_id, version FROM projection_state WHERE projection = 'seats'").fetchall()
    assert sorted(states) == [(f"reservation-r{r}", 3) for r in range(1, 7)]


def test_spark_follow_stops_when_a_fold_raises(spark: SparkSession, db: str, tmp_path: Path) -> None:
    """The Spark engine: a fold that raises on an event fails the job with an error naming the view,
    topic, partition, offset and the fold's error (not Spark's wrapping), and commits nothing of
    that micro-batch (two good events precede the bad one in it)."""
    log_dir = tmp_path / "log"
    poisoned_log(log_dir, good=2)
    with pytest.raises(FoldFailed) as failed:
        follow(spark, VIEWS, "users", log_dir=log_dir, dsn=db, checkpoint_dir=tmp_path / "ck", once=True)
    assert str(failed.value).startswith("view users: the fold raised on events.user[0] offset 2: ")
    assert "username" in failed.value.error
    assert view_rows(db, VIEWS["users"]) == []
    with psycopg.connect(db) as c:
        assert c.execute("SELECT count(*) FROM projection_checkpoints WHERE projection = 'users'").fetchone() == (0,)
        status = c.execute("SELECT status, error FROM projection_runs WHERE projection = 'users'").fetchone()
    assert status[0] == "failed" and "offset 2" in status[1]
