"""Projections benchmark: a rebuild-style fold on Spark, from the log vs from Parquet.

The events: ``n`` records (2,000,000 in a full run) over 100,000 keys ``acct-%06d`` in a
4-partition topic (segment_bytes 32 MiB), values ~70-byte JSON, every 50th a tombstone,
written with ``Producer.send_batch`` (fsync policy none). The same records, as the
``tideline`` source delivers them (same columns and types), are read once with the
Consumer and written with pyarrow to 8 Parquet files (snappy, Spark's default).

The fold (what a projection rebuild does: "latest value per key"): per key, the number
of events, the value of the record with the largest offset, and whether that record is
a tombstone; keys whose latest record is a tombstone are dropped. The result is written
to Spark's ``noop`` sink (everything computed, nothing stored). Both folds must give
the same number of keys, event total and value checksum, or the run fails.

Target (DESIGN.md §3): the fold from the log ≥ 0.5× the events/s of the same fold from
Parquet, same run. Spark ``local[2]``, driver memory 1.5 GiB; a warm-up run of each,
then ``runs`` runs interleaved; events/s from the best run, the paired ratio in a note.
Informational: a plain scan (``noop`` write of the source DataFrame) of each.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from bench.report import Section, measured
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.producer import Producer
from projections.datasource import register
from projections.range_reader import arrow_schema

if TYPE_CHECKING:
    from bench.__main__ import Context

KEY = "projections"
TITLE = "Projections: Spark fold (latest value per key) from the log vs from Parquet"

FULL_EVENTS = 2_000_000
QUICK_EVENTS = 100_000
KEYS = 100_000
PARTITIONS = 4
SEGMENT_BYTES = 32 << 20
PARQUET_FILES = 8
SEND_BATCH = 50_000
TOMBSTONE_EVERY = 50
RUNS = 4
TOPIC = "accounts"


def make_log(path: Path, n: int) -> None:
    """``n`` events over :data:`KEYS` keys, appended with ``send_batch`` in calls of :data:`SEND_BATCH`."""
    rng = np.random.default_rng(7)
    with Log(path, fsync=FsyncPolicy(FsyncMode.NONE)) as log:
        log.create_topic(TOPIC, partitions=PARTITIONS, overrides={"segment_bytes": str(SEGMENT_BYTES)})
        with Producer(log) as producer:
            for start in range(0, n, SEND_BATCH):
                ids = rng.integers(0, KEYS, min(SEND_BATCH, n - start))
                keys = pa.array([b"acct-%06d" % i for i in ids.tolist()], pa.binary())
                values = pa.array(
                    [
                        None
                        if (start + j) % TOMBSTONE_EVERY == 0
                        else b'{"account":"acct-%06d","amount":%d,"seq":%d,"kind":"deposit"}' % (i, j % 997, start + j)
                        for j, i in enumerate(ids.tolist())
                    ],
                    pa.binary(),
                )
                producer.send_batch(TOPIC, values, keys, timestamp=1_700_000_000_000 + start)


def write_parquet(log_dir: Path, out: Path) -> int:
    """The topic's records, in the source's columns and types, as :data:`PARQUET_FILES` Parquet files."""
    out.mkdir()
    tables = []
    with Log(log_dir, create=False) as log:
        consumer = Consumer(log, max_poll_bytes=64 << 20)
        consumer.assign([TopicPartition(TOPIC, p) for p in range(PARTITIONS)])
        consumer.seek_to_beginning()
        while records := consumer.poll(timeout_ms=0):
            tables.append(records.to_table())
        consumer.close()
    table = pa.concat_tables(tables)
    schema = arrow_schema()
    n: int = table.num_rows
    columns = [
        table.column("topic"),
        table.column("partition"),
        table.column("offset"),
        pc.multiply(table.column("timestamp"), 1000).cast(schema.field("timestamp").type),
        table.column("key"),
        table.column("value"),
        pa.nulls(n, schema.field("headers").type),
        pc.is_null(table.column("value")),
    ]
    events = pa.Table.from_arrays(columns, schema=schema)
    per_file = -(-n // PARQUET_FILES)
    for i in range(PARQUET_FILES):
        pq.write_table(events.slice(i * per_file, per_file), out / f"part-{i:02d}.parquet")
    return n


def fold(events: DataFrame) -> DataFrame:
    """Latest value per key, with the count of events; keys ending in a tombstone dropped."""
    latest = F.max_by(F.struct("value", "is_tombstone"), "offset")
    folded = events.groupBy("key").agg(F.count(F.lit(1)).alias("events"), latest.alias("latest"))
    return folded.filter(~F.col("latest.is_tombstone")).select("key", "events", F.col("latest.value").alias("value"))


def summary(folded: DataFrame) -> tuple[int, int, int]:
    """(keys, events, checksum of values) of a fold: what both sources must agree on."""
    row = folded.agg(F.count(F.lit(1)), F.sum("events"), F.bit_xor(F.xxhash64("key", "value"))).first()
    assert row is not None
    return int(row[0]), int(row[1] or 0), int(row[2] or 0)


def timed(action: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0


def noop(df: DataFrame) -> Callable[[], None]:
    return lambda: df.write.format("noop").mode("overwrite").save()


def start_spark() -> SparkSession:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("tideline-projections-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "1536m")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def run(ctx: Context, section: Section) -> None:
    n = QUICK_EVENTS if ctx.quick else FULL_EVENTS
    log_dir, parquet_dir = ctx.workdir / "log", ctx.workdir / "parquet"
    t0 = time.perf_counter()
    make_log(log_dir, n)
    ctx.say(f"{n:,} events into the log in {time.perf_counter() - t0:.1f} s")
    written = write_parquet(log_dir, parquet_dir)
    assert written == n, f"the Consumer read {written:,} of {n:,} events"
    parquet_mib = sum(f.stat().st_size for f in parquet_dir.iterdir()) >> 20
    ctx.say(f"same events as {PARQUET_FILES} Parquet files ({parquet_mib} MiB)")
    spark = start_spark()
    try:
        from_log = spark.read.format("tideline").option("path", str(log_dir)).option("topic", TOPIC).load()
        from_parquet = spark.read.parquet(str(parquet_dir))
        log_summary, parquet_summary = summary(fold(from_log)), summary(fold(from_parquet))  # also the warm-up
        if log_summary != parquet_summary:
            raise AssertionError(f"the folds disagree: log {log_summary} vs Parquet {parquet_summary}")
        ctx.say(f"folds agree: {log_summary[0]:,} live keys over {log_summary[1]:,} events")
        log_s, parquet_s = [], []
        for i in range(RUNS):
            log_s.append(timed(noop(fold(from_log))))
            parquet_s.append(timed(noop(fold(from_parquet))))
            ctx.say(f"run {i + 1}: log {n / log_s[-1]:,.0f} events/s, Parquet {n / parquet_s[-1]:,.0f} events/s")
        scan_log, scan_parquet = timed(noop(from_log)), timed(noop(from_parquet))
        tasks = from_log.rdd.getNumPartitions()
    finally:
        spark.stop()
    paired = statistics.median(p / q for q, p in zip(log_s, parquet_s, strict=True))
    section.notes += [
        f"Events: {n:,} over {KEYS:,} keys (`acct-%06d`), ~70-byte JSON values, every {TOMBSTONE_EVERY}th a "
        f"tombstone; {PARTITIONS} partitions, segment_bytes {SEGMENT_BYTES >> 20} MiB ({tasks} Spark input "
        f"partitions); Parquet: the same records in the source's columns, {PARQUET_FILES} files, snappy.",
        "Fold: `groupBy(key).agg(count, max_by(struct(value, is_tombstone), offset))`, tombstoned keys dropped, "
        "written to the `noop` sink; both folds checked equal (keys, events, XOR of xxhash64(key, value)).",
        f"Spark local[2], driver memory 1.5 GiB, shuffle partitions 4; one warm-up fold each, then {RUNS} runs "
        f"interleaved, best run reported; median of paired run ratios (log ÷ Parquet events/s) {paired:.2f}×.",
    ]
    section.results += [
        measured(
            "Spark fold from the log (tideline source)",
            n / min(log_s),
            "events/s",
            baseline_name="same fold from Parquet",
            baseline_value=n / min(parquet_s),
            min_ratio=0.5,
        ),
        measured(
            "Spark scan of the log (noop write)",
            n / scan_log,
            "events/s",
            baseline_name="scan of Parquet",
            baseline_value=n / scan_parquet,
            note="informational: one run each, after the folds",
        ),
    ]
