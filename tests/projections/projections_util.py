"""Helpers for the data source tests: logs with known contents, and the two ways of reading them
(the eventstore Consumer as the reference, the Spark source under test) in one comparable form."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from eventstore.consumer import Consumer, TopicPartition
from eventstore.isolation import IsolationLevel
from eventstore.log import Log

# (topic, partition, offset, timestamp ms, key, value, headers, is_tombstone)
Row = tuple[str, int, int, int, bytes | None, bytes | None, tuple[tuple[str, bytes | None], ...], bool]

SELECT = [
    "topic",
    "partition",
    "offset",
    "unix_millis(timestamp) AS timestamp_ms",
    "key",
    "value",
    "headers",
    "is_tombstone",
]


def consumer_rows(
    log_dir: Path, topics: Iterable[str], isolation: IsolationLevel = IsolationLevel.READ_COMMITTED
) -> list[Row]:
    """Everything a Consumer at ``isolation`` reads from the beginning of ``topics``, sorted."""
    out: list[Row] = []
    with Log(log_dir, create=False) as log:
        consumer = Consumer(log, isolation_level=isolation)
        consumer.assign([TopicPartition(t, p) for t in topics for p in range(log.topic(t).partitions)])
        consumer.seek_to_beginning()
        while records := consumer.poll(timeout_ms=50):
            for r in records:
                headers = tuple((k, v) for k, v in r.headers)
                out.append((r.topic, r.partition, r.offset, r.timestamp, r.key, r.value, headers, r.value is None))
        consumer.close()
    return sorted(out, key=_order)


def source(spark: SparkSession, log_dir: Path, topic: str, **options: Any) -> DataFrame:
    reader = spark.read.format("tideline").option("path", str(log_dir)).option("topic", topic)
    for name, value in options.items():
        reader = reader.option(name, str(value))
    return reader.load()


def spark_rows(df: DataFrame) -> list[Row]:
    """The rows of a tideline DataFrame in the form of :func:`consumer_rows`, sorted."""
    out: list[Row] = []
    for r in df.selectExpr(*SELECT).collect():
        headers = tuple((h["key"], _bytes(h["value"])) for h in r["headers"] or ())
        out.append(
            (
                r["topic"],
                r["partition"],
                r["offset"],
                r["timestamp_ms"],
                _bytes(r["key"]),
                _bytes(r["value"]),
                headers,
                r["is_tombstone"],
            )
        )
    return sorted(out, key=_order)


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


def _order(row: Row) -> tuple[str, int, int]:
    return row[0], row[1], row[2]
