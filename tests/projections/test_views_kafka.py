"""Projections from Apache Kafka: rebuild (Spark's own Kafka source) == follow on both engines ==
the reference fold, for every shipped view; and the follow job SIGKILLed at random points stays
exactly once on both engines.

The records: the real capture of a random workload (commands through the outbox, plain SQL with
deletes, tombstones, key changes and truncates on a CDC table) into the embedded log, copied
partition for partition into the session's Kafka (:class:`views_kafka_util.KafkaMirror`: keys, values,
headers, same partitions, in Kafka transactions), capture's position topic last. The reference
reads Kafka itself (``KafkaReader``, read_committed) and must agree with the embedded log's.
The Kafka topics are the views' own names (``events.user`` …): one data set per session, built
once by this module and only read by its tests (each writes its views into a database of its own).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from crash_util import checkpoints, kill_repeatedly
from pyspark.sql import SparkSession
from typer.testing import CliRunner
from views_kafka_util import KafkaMirror
from views_util import ACCOUNTS_TOPIC, capture, change_accounts, drop_slots, issue_commands, migrated_database, soak

from eventstore.log import Log
from examples.reservations.views import VIEWS
from projections.consistency import captured_lsn
from projections.follow import follow
from projections.kafka_source import KafkaSource
from projections.live import follow_live
from projections.rebuild import rebuild
from projections.reference import expected_rows, view_rows
from schemas.position import POSITIONS_TOPIC
from tideline.cli import app
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

SHIPPED = ["users", "seats", "show_occupancy", "snapshots", f"mirror:{ACCOUNTS_TOPIC}"]
COMMANDS = 700 if soak() else 250
CHANGES = 240 if soak() else 80
# Each Spark kill starts a JVM (tens of seconds here): the short run kills it once (test_views_crash.py kills the
# Spark engine three times on the embedded log: the same follow job); the soak, as often as the live engine.
SPARK_KILLS = 8 if soak() else 1
LIVE_KILLS = 8 if soak() else 4


@dataclass(frozen=True)
class KafkaViews:
    """The data set: the embedded log capture wrote, and the same records on Kafka."""

    log_dir: Path
    bootstrap_servers: str
    captured_lsn: int

    def source(self) -> KafkaSource:
        return KafkaSource(self.bootstrap_servers)


@pytest.fixture(scope="module")
def own_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A cluster of this module's own: views read capture's position topic, which capture tests on the
    session's cluster fill with positions of other connectors (and other databases' LSNs)."""
    with LocalKafka(tmp_path_factory.mktemp("views-kafka") / "cluster", brokers=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def kafka_views(postgres: LocalPostgres, own_kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> KafkaViews:
    kafka = own_kafka
    log_dir = tmp_path_factory.mktemp("kafka-views") / "log"
    source_db = migrated_database(postgres, "kafka_src")
    rng = random.Random(31)
    try:
        capture(log_dir, source_db)  # the slot first: every change streams
        assert issue_commands(source_db, COMMANDS, rng, tag="kv") > 0
        change_accounts(source_db, CHANGES, rng)
        capture(log_dir, source_db)
    finally:
        drop_slots(source_db)
    topics = sorted({t for name in SHIPPED for t in VIEWS[name].topics})
    mirror = KafkaMirror(log_dir, kafka.bootstrap_servers)
    try:
        assert mirror.copy(topics) > 0
        assert mirror.copy([POSITIONS_TOPIC]) > 0  # last: a stored position never precedes its records
    finally:
        mirror.close()
    with Log(log_dir, create=False) as log:
        lsn = captured_lsn(log)
    return KafkaViews(log_dir, kafka.bootstrap_servers, lsn)


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    yield migrated_database(postgres, "kafka")


def test_kafka_rebuild_equals_follow_on_both_engines_equals_reference(
    spark: SparkSession, kafka_views: KafkaViews, postgres: LocalPostgres, tmp_path: Path
) -> None:
    spark_db, live_db, rebuilt_db = (migrated_database(postgres, f"kafka_{e}") for e in ("spark", "live", "rebuild"))
    with kafka_views.source() as source:
        for name in SHIPPED:
            view = VIEWS[name]
            expected = expected_rows(view, source)
            assert expected, name
            assert expected == expected_rows(view, kafka_views.log_dir), f"Kafka holds other records: {name}"
            # Spark: one micro-batch (many, continuing from the checkpoints, in the kill test); live: small
            # batches, each continuing from the last one's checkpoints
            stats = follow(spark, VIEWS, name, source=source, dsn=spark_db, checkpoint_dir=tmp_path / "ck", once=True)
            assert stats.events > 0, name
            assert view_rows(spark_db, view) == expected, f"follow --engine spark {name}"
            live = follow_live(VIEWS, name, source=source, dsn=live_db, once=True, max_records_per_batch=25)
            assert live.batches > 1 and live.events > 0, name
            assert view_rows(live_db, view) == expected, f"follow --engine live {name}"
            result = rebuild(spark, VIEWS, name, source=source, dsn=rebuilt_db)
            assert result.offsets == source.stable_offsets(view.topics), name
            assert result.reached_lsn == kafka_views.captured_lsn > 0, name  # read-your-writes sample from Kafka
            assert view_rows(rebuilt_db, view) == expected, f"rebuild {name}"


@pytest.mark.parametrize(("engine", "kills"), [("spark", SPARK_KILLS), ("live", LIVE_KILLS)])
def test_kafka_follow_killed_at_random_points_is_exactly_once(
    request: pytest.FixtureRequest, kafka_views: KafkaViews, db: str, tmp_path: Path, engine: str, kills: int
) -> None:
    view = VIEWS["show_occupancy"]  # additive upserts: a batch applied twice would double counts
    checkpoint_dir = tmp_path / "checkpoints"
    with kafka_views.source() as source:
        kills_mid_run = kill_repeatedly(
            source,
            ["--kafka", kafka_views.bootstrap_servers],
            db,
            view,
            engine,
            kills=kills,
            rng=random.Random(13),
            checkpoint_dir=checkpoint_dir,
            stderr=tmp_path / "follow.err",
            max_delay=0.5 if kills == 1 else None,  # a single kill must land before the job catches up
        )
        assert kills_mid_run > 0
        stable, applied = source.stable_offsets(view.topics), checkpoints(db, view.name)
        behind = status_row(kafka_views.bootstrap_servers, db, view.name)  # lag against Kafka, where the kills left it
        assert behind["lag"] == sum(o - applied[t][p] for t, per in stable.items() for p, o in per.items())
        assert (behind["waiting_since"] is not None) == (behind["lag"] > 0)  # the oldest unapplied record's timestamp
        if engine == "live":
            follow_live(VIEWS, view.name, source=source, dsn=db, once=True)
        else:
            spark: SparkSession = request.getfixturevalue("spark")
            follow(spark, VIEWS, view.name, source=source, dsn=db, checkpoint_dir=checkpoint_dir, once=True)
        assert view_rows(db, view) == expected_rows(view, source)
    row = status_row(kafka_views.bootstrap_servers, db, view.name)
    assert row["status"] == "done" and row["lag"] == 0 and not row["stalled"] and row["waiting_since"] is None
    logged = {(p["topic"], p["partition"]): (p["next_offset"], p["log_end"]) for p in row["partitions"]}
    assert logged == {(t, p): (o, o) for t, per in stable.items() for p, o in per.items()}


def status_row(bootstrap_servers: str, dsn: str, projection: str) -> dict[str, Any]:
    """``tideline --kafka B project status --json``'s row of ``projection``."""
    done = CliRunner().invoke(app, ["--kafka", bootstrap_servers, "project", "status", "--dsn", dsn, "--json"])
    assert done.exit_code == 0, done.output
    (row,) = [p for p in json.loads(done.output) if p["projection"] == projection]
    return row  # type: ignore[no-any-return]


def test_kafka_unreachable_is_a_one_line_error(db: str) -> None:
    for command in (["status"], ["rebuild", "users"], ["follow", "users", "--once"]):
        done = CliRunner().invoke(app, ["--kafka", "127.0.0.1:9", "project", *command, "--dsn", db])
        assert done.exit_code == 1, done.output
        assert done.output.startswith("error: cannot reach Kafka at 127.0.0.1:9") and done.output.count("\n") == 1
