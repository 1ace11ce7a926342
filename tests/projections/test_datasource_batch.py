"""Batch reads through the tideline Spark source, checked against the eventstore Consumer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from projections_util import consumer_rows, source, spark_rows
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from eventstore.cleaner import apply_retention
from eventstore.isolation import IsolationLevel
from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.producer import Producer
from eventstore.segment import list_segment_bases

FAST = FsyncPolicy(FsyncMode.NONE)
T0 = 1_700_000_000_000
CALLS = 30
PER_CALL = 50


@pytest.fixture(scope="module")
def orders_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Topic ``orders``: 3 partitions of many small segments; tombstones, headers, one timestamp per call.

    Call ``i`` writes its records with timestamp ``T0 + i * 1000``. Topic ``audit`` has one
    partition and a few records (for multi-topic reads).
    """
    path = tmp_path_factory.mktemp("orders") / "log"
    with Log(path, fsync=FAST) as log:
        log.create_topic("orders", partitions=3, overrides={"segment_bytes": "4096"})
        log.create_topic("audit", partitions=1)
        with Producer(log) as producer:
            for i in range(CALLS):
                keys = [f"order-{(i * 7 + j) % 120}".encode() for j in range(PER_CALL)]
                values = [None if j % 11 == 0 else f"v{i}.{j}:".encode() + b"x" * (j % 40) for j in range(PER_CALL)]
                headers = (
                    [[("source", f"call-{i}".encode()), ("empty", None)] for _ in range(PER_CALL)]
                    if i % 5 == 0
                    else None
                )
                producer.send_batch("orders", values, keys, timestamp=T0 + i * 1000, headers=headers)
            producer.send_batch("audit", [b"a1", b"a2", None], [b"x", b"y", b"x"], timestamp=T0)
    return path


def test_batch_read_equals_consumer(spark: SparkSession, orders_log: Path) -> None:
    expected = consumer_rows(orders_log, ["orders"])
    df = source(spark, orders_log, "orders")
    assert spark_rows(df) == expected
    assert len(expected) == CALLS * PER_CALL
    assert any(r[7] for r in expected) and any(r[6] for r in expected)  # tombstones and headers were read


def test_one_input_partition_per_segment(spark: SparkSession, orders_log: Path) -> None:
    segments = sum(len(list_segment_bases(orders_log / f"orders-{p}")) for p in range(3))
    assert segments > 6  # the small segment_bytes rolled several times per partition
    assert source(spark, orders_log, "orders").rdd.getNumPartitions() == segments
    split = source(spark, orders_log, "orders", maxOffsetsPerPartition=8)
    assert split.rdd.getNumPartitions() > segments
    assert spark_rows(split) == consumer_rows(orders_log, ["orders"])


def test_whole_partitions_reads_each_partition_in_one_task_in_offset_order(
    spark: SparkSession, orders_log: Path
) -> None:
    """``wholePartitions``: one Spark partition per log partition, across its many segments,
    in offset order (what a per-stream fold needs to run without a shuffle)."""
    whole = source(spark, orders_log, "orders", wholePartitions="true")
    assert whole.rdd.getNumPartitions() == 3
    assert spark_rows(whole) == consumer_rows(orders_log, ["orders"])
    tasks: dict[int, list[tuple[int, int]]] = {}
    for task, partition, offset in whole.select(F.spark_partition_id(), "partition", "offset").collect():
        tasks.setdefault(task, []).append((partition, offset))  # collect keeps each task's order
    assert len(tasks) == 3
    assert all(len({p for p, _ in read}) == 1 and read == sorted(read) for read in tasks.values())
    bounded = source(spark, orders_log, "orders", wholePartitions="true", endingOffsets='{"orders": {"1": 40}}')
    assert bounded.rdd.getNumPartitions() == 3
    assert max(r[2] for r in spark_rows(bounded) if r[1] == 1) == 39


def test_offset_bounds(spark: SparkSession, orders_log: Path) -> None:
    starting = {"orders": {"0": 23, "1": -2}}  # partition 2: earliest (not named)
    ending = {"orders": {"0": 140, "2": 77}}  # partition 1: latest (not named)
    df = source(spark, orders_log, "orders", startingOffsets=json.dumps(starting), endingOffsets=json.dumps(ending))
    rows = spark_rows(df)
    bounds = {0: (23, 140), 1: (0, 1 << 62), 2: (0, 77)}
    expected = [r for r in consumer_rows(orders_log, ["orders"]) if bounds[r[1]][0] <= r[2] < bounds[r[1]][1]]
    assert rows == expected
    assert {r[1] for r in rows} == {0, 1, 2}
    assert min(r[2] for r in rows if r[1] == 0) == 23 and max(r[2] for r in rows if r[1] == 0) == 139


def test_earliest_and_latest_words(spark: SparkSession, orders_log: Path) -> None:
    assert source(spark, orders_log, "orders", startingOffsets="latest").count() == 0
    assert source(spark, orders_log, "orders", startingOffsets="earliest", endingOffsets="latest").count() == (
        CALLS * PER_CALL
    )


def test_timestamp_bounds(spark: SparkSession, orders_log: Path) -> None:
    lo, hi = T0 + 10 * 1000, T0 + 20 * 1000
    rows = spark_rows(source(spark, orders_log, "orders", startingTimestamp=lo, endingTimestamp=hi))
    expected = [r for r in consumer_rows(orders_log, ["orders"]) if lo <= r[3] < hi]
    assert rows == expected
    assert len(rows) == 10 * PER_CALL


def test_several_topics(spark: SparkSession, orders_log: Path) -> None:
    df = spark.read.format("tideline").option("path", str(orders_log)).option("subscribe", "orders, audit").load()
    assert spark_rows(df) == consumer_rows(orders_log, ["audit", "orders"])
    assert df.filter("topic = 'audit'").count() == 3


def test_bad_options_fail_the_read(spark: SparkSession, orders_log: Path) -> None:
    with pytest.raises(PySparkException, match="unknown tideline source option"):
        source(spark, orders_log, "orders", startingOffset="earliest").count()
    with pytest.raises(PySparkException, match="unknown topic"):
        source(spark, orders_log, "nope").count()


def _transactional_log(path: Path) -> tuple[Producer, dict[str, int]]:
    """Topic ``txn`` (2 partitions): plain records, an aborted and a committed transaction,
    then an open transaction followed by more plain records. Returns the producer that holds
    the open transaction and the first offset of that transaction in partition 0.
    """
    log = Log(path, fsync=FAST)
    log.create_topic("txn", partitions=2)
    with Producer(log) as plain:
        plain.send_batch("txn", [b"plain-1", b"plain-2"], partition=0)
        txp = Producer(log, transactional_id="t1")
        txp.init_transactions()
        txp.begin_transaction()
        txp.send_batch("txn", [b"aborted-1", b"aborted-2"], partition=0)
        txp.send_batch("txn", [b"aborted-3"], partition=1)
        txp.abort_transaction()
        txp.begin_transaction()
        txp.send_batch("txn", [b"committed-1"], partition=0)
        txp.send_batch("txn", [b"committed-2"], partition=1)
        txp.commit_transaction()
        txp.begin_transaction()
        first_open = txp.send_batch("txn", [b"open-1"], partition=0)[0][0]
        plain.send_batch("txn", [b"after-open"], partition=0)
        plain.send_batch("txn", [b"p1-after"], partition=1)
    return txp, {"open": first_open}


def test_read_committed_and_uncommitted(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "log"
    txp, where = _transactional_log(path)
    try:
        committed = spark_rows(source(spark, path, "txn"))
        assert committed == consumer_rows(path, ["txn"], IsolationLevel.READ_COMMITTED)
        values = sorted(r[5] or b"" for r in committed)
        assert values == [b"committed-1", b"committed-2", b"p1-after", b"plain-1", b"plain-2"]
        assert max(r[2] for r in committed if r[1] == 0) < where["open"]  # stopped at the LSO

        uncommitted = spark_rows(source(spark, path, "txn", isolation="read_uncommitted"))
        assert uncommitted == consumer_rows(path, ["txn"], IsolationLevel.READ_UNCOMMITTED)
        assert {b"aborted-1", b"aborted-3", b"open-1", b"after-open"} <= {r[5] for r in uncommitted}
        markers = 2 + 2  # abort and commit markers in both partitions take offsets, never rows
        with Log(path, create=False) as log:
            ends = sum(log.partition("txn", p).log_end_offset() for p in range(2))
        assert len(uncommitted) == ends - markers

        txp.commit_transaction()
        after = {r[5] for r in spark_rows(source(spark, path, "txn"))}
        assert {b"open-1", b"after-open"} <= after and b"aborted-1" not in after
    finally:
        txp.close()


def test_offsets_removed_by_retention(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "log"
    with Log(path, fsync=FAST) as log:
        log.create_topic("r", partitions=1, overrides={"segment_bytes": "2048", "retention_bytes": "4096"})
        with Producer(log) as producer:
            for i in range(20):
                producer.send_batch("r", [f"r{i}.{j}".encode() + b"y" * 30 for j in range(10)], partition=0)
        assert apply_retention(log.partition("r", 0)) > 0
        log_start = log.partition("r", 0).log_start_offset()
    assert log_start > 0
    from_zero = json.dumps({"r": {"0": 0}})
    with pytest.raises(PySparkException, match="removed by retention"):
        source(spark, path, "r", startingOffsets=from_zero).count()
    rows = spark_rows(source(spark, path, "r", startingOffsets=from_zero, failOnDataLoss="false"))
    assert rows == consumer_rows(path, ["r"])
    assert rows[0][2] == log_start and rows[-1][2] == 199
    assert source(spark, path, "r").count() == 200 - log_start  # earliest is the log start


def test_decode_avro_passes_json_through_and_refuses_unknown_schema_ids(spark: SparkSession, tmp_path: Path) -> None:
    """``decodeAvro``: a value framed as Confluent Avro with a schema id the log's registry
    lacks fails the read, naming where; JSON and tombstones pass untouched; without the
    option the stored bytes come back as they are."""
    log_dir = tmp_path / "log"
    framed = b"\x00" + (999).to_bytes(4, "big") + b"\x02x"
    with Log(log_dir, fsync=FsyncPolicy(FsyncMode.NONE)) as log:
        log.create_topic("plain", partitions=1)
        log.create_topic("mixed", partitions=1)
        with Producer(log) as producer:
            producer.send_batch("plain", [b'{"a": 1}', None], [b"k1", b"k2"])
            producer.send_batch("mixed", [b'{"a": 1}', framed], [b"k1", b"k2"])
    plain = source(spark, log_dir, "plain", decodeAvro="true").select("key", "value").collect()
    assert [(bytes(r.key), None if r.value is None else bytes(r.value)) for r in plain] == [
        (b"k1", b'{"a": 1}'),
        (b"k2", None),
    ]
    raw = source(spark, log_dir, "mixed").select("value").collect()
    assert bytes(raw[1].value) == framed
    with pytest.raises(PySparkException, match=r"mixed\[0\] offset 1: the value is framed Avro but schema id 999"):
        source(spark, log_dir, "mixed", decodeAvro="true").count()
    with pytest.raises(PySparkException, match="option decodeavro must be true or false"):
        source(spark, log_dir, "plain", decodeAvro="yes").count()
    # includeSchemaIds: the id each framed key / value names, null for anything else (here undecoded)
    ids = source(spark, log_dir, "mixed", includeSchemaIds="true")
    assert ids.columns[-2:] == ["keySchemaId", "valueSchemaId"]
    assert [(r.keySchemaId, r.valueSchemaId) for r in ids.collect()] == [(None, None), (None, 999)]
    assert source(spark, log_dir, "mixed").columns[-1] == "is_tombstone"
