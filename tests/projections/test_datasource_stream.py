"""Streaming reads through the tideline Spark source: availableNow runs on one checkpoint,
read limits, and the last stable offset as the end of what a read_committed stream sees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from projections_util import Row, consumer_rows, spark_rows
from pyspark.sql import DataFrame, SparkSession

from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.producer import Producer

FAST = FsyncPolicy(FsyncMode.NONE)


def run_available_now(spark: SparkSession, log_dir: Path, checkpoint: Path, **options: Any) -> list[list[Row]]:
    """One ``Trigger.AvailableNow`` run of a stream on ``checkpoint``; the rows of each non-empty micro-batch."""
    batches: list[list[Row]] = []

    def collect(df: DataFrame, batch_id: int) -> None:
        rows = spark_rows(df)
        if rows:
            batches.append(rows)

    reader = spark.readStream.format("tideline").option("path", str(log_dir))
    for name, value in options.items():
        reader = reader.option(name, str(value))
    query = (
        reader.load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120), "the availableNow run did not finish"
    assert query.exception() is None
    return batches


def produce(log_dir: Path, topic: str, first: int, count: int, *, partitions: int = 3) -> None:
    with Log(log_dir, fsync=FAST) as log:
        if topic not in log.topics():
            log.create_topic(topic, partitions=partitions, overrides={"segment_bytes": "4096"})
        with Producer(log) as producer:
            for start in range(first, first + count, 40):
                n = min(40, first + count - start)
                keys = [f"key-{i % 17}".encode() for i in range(start, start + n)]
                producer.send_batch(topic, [f"event-{i}".encode() for i in range(start, start + n)], keys)


def flat(batches: list[list[Row]]) -> list[Row]:
    return sorted((r for b in batches for r in b), key=lambda r: (r[0], r[1], r[2]))


def test_available_now_resumes_from_its_checkpoint(spark: SparkSession, tmp_path: Path) -> None:
    log_dir, checkpoint = tmp_path / "log", tmp_path / "checkpoint"
    produce(log_dir, "s", 0, 200)
    first = flat(run_available_now(spark, log_dir, checkpoint, topic="s", startingOffsets="earliest"))
    assert first == consumer_rows(log_dir, ["s"])
    assert len(first) == 200

    produce(log_dir, "s", 200, 120)
    second = flat(run_available_now(spark, log_dir, checkpoint, topic="s", startingOffsets="earliest"))
    everything = consumer_rows(log_dir, ["s"])
    assert second == [r for r in everything if r not in set(first)]
    assert sorted(r[5] or b"" for r in second) == sorted(f"event-{i}".encode() for i in range(200, 320))

    assert run_available_now(spark, log_dir, checkpoint, topic="s") == []  # nothing new: nothing read


def test_stream_starts_at_latest_by_default(spark: SparkSession, tmp_path: Path) -> None:
    log_dir, checkpoint = tmp_path / "log", tmp_path / "checkpoint"
    produce(log_dir, "s", 0, 50)
    assert run_available_now(spark, log_dir, checkpoint, topic="s") == []
    produce(log_dir, "s", 50, 30)
    rows = flat(run_available_now(spark, log_dir, checkpoint, topic="s"))
    assert sorted(r[5] or b"" for r in rows) == sorted(f"event-{i}".encode() for i in range(50, 80))


def test_max_records_per_trigger_splits_micro_batches(spark: SparkSession, tmp_path: Path) -> None:
    log_dir, checkpoint = tmp_path / "log", tmp_path / "checkpoint"
    produce(log_dir, "s", 0, 300)
    batches = run_available_now(
        spark, log_dir, checkpoint, topic="s", startingOffsets="earliest", maxRecordsPerTrigger=70
    )
    assert len(batches) >= 5
    assert all(len(b) <= 70 for b in batches)
    assert flat(batches) == consumer_rows(log_dir, ["s"])  # every record once, none twice


def test_read_committed_stream_stops_at_the_last_stable_offset(spark: SparkSession, tmp_path: Path) -> None:
    log_dir, checkpoint = tmp_path / "log", tmp_path / "checkpoint"
    produce(log_dir, "s", 0, 30, partitions=1)
    log = Log(log_dir, fsync=FAST)
    txp = Producer(log, transactional_id="stream-writer")
    try:
        txp.init_transactions()
        txp.begin_transaction()
        txp.send_batch("s", [b"aborted"], partition=0)
        txp.abort_transaction()
        txp.begin_transaction()
        txp.send_batch("s", [b"in-open-txn"], partition=0)
        produce(log_dir, "s", 30, 5, partitions=1)  # after the open transaction: held back with it
        options = {"topic": "s", "startingOffsets": "earliest"}
        before = flat(run_available_now(spark, log_dir, checkpoint, **options))
        assert sorted(r[5] or b"" for r in before) == sorted(f"event-{i}".encode() for i in range(30))

        txp.commit_transaction()
        after = flat(run_available_now(spark, log_dir, checkpoint, **options))
        values = sorted(r[5] or b"" for r in after)
        assert values == sorted([b"in-open-txn", *(f"event-{i}".encode() for i in range(30, 35))])
        assert flat([before, after]) == consumer_rows(log_dir, ["s"])
    finally:
        txp.close()
        log.close()
