"""Tideline against Debezium into Kafka: changes/s and connector CPU-seconds on the same WAL (issue 16).

Setup: a private PostgreSQL 15 (``LocalPostgres``, fsync off), a private single-broker
Kafka (``LocalKafka``), and one Kafka Connect standalone worker running Debezium's
PostgreSQL connector (``tideline.connectharness.LocalConnect``, from the jar cache). The
table and the workload are the capture bench's (``bench.capture_bench``: ``changes`` row
changes in 100-row transactions, half INSERTs then half UPDATEs of the same rows, 6
columns), published by one publication ``bench_pub FOR TABLE bench`` that both read.

The WAL is written once, after a pgoutput slot ``src`` was created; every run copies
``src`` twice (``pg_copy_logical_replication_slot``: same start), so both connectors decode
the identical WAL from the same point to the same end:

* **Tideline**: ``tideline --kafka B capture run --plugin pgoutput --publication bench_pub
  --publication-autocreate disabled --snapshot never --exit-when-caught-up`` as a child
  process (default settings: one partition, exactly once: a transactional producer,
  acks=all, one Kafka transaction per log batch with the position). Time: from the
  spawn to its exit (interpreter start, imports and connections included). CPU: the
  process's utime+stime and its children's, read from ``/proc/<pid>/stat`` when it has
  exited and before it is reaped (the kernel's final figures).
* **Debezium** 3.7 on Kafka Connect 4.3 (``COMPARABLE_SETTINGS`` with ``snapshot.mode=no_data`` (3.x's "never"),
  no transaction metadata: its defaults otherwise; JSON converter, schemas off; the
  worker's producer defaults: idempotent, acks=all, not transactional). Time: from adding
  the connector over REST to the topic's high watermark reaching ``changes`` (polled every
  50 ms). CPU: the worker JVM's utime+stime over the same interval, from ``/proc`` (the
  worker is started once; a first connector run on its own slot copy warms the JVM up and
  is not counted, as a long-running Connect worker is warm).

Changes/s = row changes / seconds; CPU = changes per connector CPU-second; best of ``runs``
for each, runs interleaved. Targets (issue 16): Tideline ≥ 1.5× Debezium's changes/s,
≥ 2× its changes per CPU-second, and ≥ 45k changes per connector CPU-second.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.capture_bench import CREATE_TABLE, TABLE, TXN_ROWS, count_kafka_records, execute, generate_changes, wal_lsn
from bench.report import Section, measured
from eventstore.kafka import KafkaAdmin
from tideline.connectharness import (
    LocalConnect,
    copy_slot,
    debezium_postgres_config,
    debezium_version,
    process_tree_cpu_seconds,
)
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

if TYPE_CHECKING:
    from bench.__main__ import Context

KEY = "debezium"
TITLE = "Capture into Kafka: Tideline vs Debezium on the same WAL"

PUBLICATION = "bench_pub"
TIDELINE = str(Path(sys.executable).parent / "tideline")
ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Sizes:
    changes: int
    runs: int


FULL = Sizes(changes=300_000, runs=3)
QUICK = Sizes(changes=30_000, runs=1)


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    cpu_seconds: float


def run_tideline(ctx: Context, dsn: str, kafka: str, slot: str, prefix: str, changes: int) -> Run:
    """The CLI as a child process until it has caught up; its wall time and its process tree's CPU."""
    argv = [TIDELINE, "--data-dir", str(ctx.workdir / f"data-{slot}"), "--kafka", kafka, "capture", "run",
            "--dsn", dsn, "--slot", slot, "--topic-prefix", prefix, "--plugin", "pgoutput",
            "--publication", PUBLICATION, "--publication-autocreate", "disabled", "--snapshot", "never",
            "--state-dir", str(ctx.workdir / f"state-{slot}"), "--exit-when-caught-up"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    err_path = ctx.workdir / f"{slot}.stderr"
    start = time.perf_counter()
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: /proc holds its final times
    seconds = time.perf_counter() - start
    cpu = process_tree_cpu_seconds(proc.pid)
    if proc.wait() != 0:
        raise RuntimeError(f"tideline capture run failed ({proc.returncode}): {err_path.read_text()[-2000:]}")
    stored = count_kafka_records(kafka, f"{prefix}.public.{TABLE}")
    if stored != changes:
        raise AssertionError(f"Tideline stored {stored} change events in Kafka, expected {changes}")
    return Run(seconds, cpu)


def run_debezium(connect: LocalConnect, dsn: str, kafka: str, slot: str, prefix: str, changes: int) -> Run:
    """Debezium's connector on ``slot`` until its topic holds ``changes`` records; wall time and worker CPU."""
    config = debezium_postgres_config(dsn, slot=slot, publication=PUBLICATION, topic_prefix=prefix,
                                      overrides={"snapshot.mode": "no_data"})  # fmt: skip
    topic = f"{prefix}.public.{TABLE}"
    admin = KafkaAdmin(kafka)
    cpu_before = connect.cpu_seconds()
    start = time.perf_counter()
    connect.add_connector(slot, config)
    deadline = time.monotonic() + 600
    while True:
        if topic in admin.topics() and sum(i.high_watermark for i in admin.describe(topic)[1]) >= changes:
            break
        status = connect.status(slot)
        failed = status is not None and any(t["state"] == "FAILED" for t in status.get("tasks", []))
        if failed or not connect.running or time.monotonic() > deadline:
            raise RuntimeError(f"Debezium did not write {changes} records to {topic}: {status}")
        time.sleep(POLL_S)
    seconds = time.perf_counter() - start
    cpu = connect.cpu_seconds() - cpu_before
    connect.delete_connector(slot)
    written = sum(i.high_watermark for i in admin.describe(topic)[1])
    if written != changes:  # more: duplicates (at least once), which a fair count must not include
        raise AssertionError(f"Debezium wrote {written} records to {topic}, expected {changes}")
    return Run(seconds, cpu)


def wait_slot_released(dsn: str, slot: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while execute(dsn, "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"slot {slot} still active {timeout:.0f} s after its connector was deleted")
        time.sleep(0.1)


def bench(ctx: Context, section: Section, sizes: Sizes, dsn: str, kafka: str) -> None:
    n = sizes.changes
    execute(dsn, CREATE_TABLE)
    execute(dsn, f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {TABLE}")
    execute(dsn, "SELECT pg_create_logical_replication_slot('src', 'pgoutput')")
    started = time.perf_counter()
    generate_changes(dsn, n)
    ctx.say(f"generated {n:,} changes in {time.perf_counter() - started:.1f} s (WAL up to {wal_lsn(dsn)})")

    tl: list[Run] = []
    dbz: list[Run] = []
    with LocalConnect(ctx.workdir / "connect", kafka) as connect:
        copy_slot(dsn, "src", "dbz_warmup")
        warm = run_debezium(connect, dsn, kafka, "dbz_warmup", "dbzw", n)
        ctx.say(f"Debezium warm-up run (not counted): {n / warm.seconds:,.0f} changes/s, {warm.cpu_seconds:.1f} CPU-s")
        wait_slot_released(dsn, "dbz_warmup")
        execute(dsn, "SELECT pg_drop_replication_slot('dbz_warmup')")
        for i in range(sizes.runs):
            copy_slot(dsn, "src", f"tl_{i}")
            copy_slot(dsn, "src", f"dbz_{i}")
            tl.append(run_tideline(ctx, dsn, kafka, f"tl_{i}", f"tl{i}", n))
            dbz.append(run_debezium(connect, dsn, kafka, f"dbz_{i}", f"dbz{i}", n))
            wait_slot_released(dsn, f"dbz_{i}")
            for slot in (f"tl_{i}", f"dbz_{i}"):
                execute(dsn, "SELECT pg_drop_replication_slot(%s)", (slot,))
            ctx.say(
                f"run {i + 1}: Tideline {n / tl[-1].seconds:,.0f} changes/s, {tl[-1].cpu_seconds:.2f} CPU-s "
                f"({n / tl[-1].cpu_seconds:,.0f} changes/CPU-s); Debezium {n / dbz[-1].seconds:,.0f} changes/s, "
                f"{dbz[-1].cpu_seconds:.2f} CPU-s ({n / dbz[-1].cpu_seconds:,.0f} changes/CPU-s)"
            )
    execute(dsn, "SELECT pg_drop_replication_slot('src')")

    def runs(xs: list[Run], cpu: bool) -> str:
        return ", ".join(f"{n / (r.cpu_seconds if cpu else r.seconds):,.0f}" for r in xs)

    tl_rate, dbz_rate = n / min(r.seconds for r in tl), n / min(r.seconds for r in dbz)
    tl_eff, dbz_eff = n / min(r.cpu_seconds for r in tl), n / min(r.cpu_seconds for r in dbz)
    workload = f"{n:,} row changes ({n // 2:,} INSERTs then {n - n // 2:,} UPDATEs) in {TXN_ROWS}-row transactions"
    section.results += [
        measured(
            "Tideline → Kafka (pgoutput), changes/s",
            tl_rate,
            "changes/s",
            baseline_name="Debezium → Kafka, same WAL",
            baseline_value=dbz_rate,
            min_ratio=1.5,
            note=f"{workload}; best of {sizes.runs}; Tideline runs {runs(tl, False)}, Debezium {runs(dbz, False)}",
        ),
        measured(
            "Tideline changes per connector CPU-second",
            tl_eff,
            "changes/CPU-s",
            baseline_name="Debezium (Connect worker JVM)",
            baseline_value=dbz_eff,
            min_ratio=2.0,
            note=f"Tideline runs {runs(tl, True)}, Debezium {runs(dbz, True)} changes per CPU-second "
            f"(Tideline: the whole process, interpreter start included; Debezium: the worker from adding the "
            f"connector to its last record)",
        ),
        measured("Tideline changes per connector CPU-second (absolute)", tl_eff, "changes/CPU-s", min_value=45_000),
        measured(
            "Debezium → Kafka, changes/s",
            dbz_rate,
            "changes/s",
            note=f"{dbz_eff:,.0f} changes per CPU-second; published figure ≈ 30k changes per connector core",
        ),
    ]


def run(ctx: Context, section: Section) -> None:
    sizes = QUICK if ctx.quick else FULL
    section.notes += [
        f"Debezium {debezium_version()} (PostgreSQL connector) on Kafka Connect standalone "
        "(`tideline.connectharness`, JVM flags as Kafka's start scripts: G1, 1 GiB heap) vs "
        "`tideline capture run --plugin pgoutput` as a child process; both into one private single-broker Kafka "
        "(KRaft, `tideline.kafkaharness`), both from copies of one pgoutput slot "
        "(`pg_copy_logical_replication_slot`) through one publication, so both decode the identical WAL from the "
        "same start; the method is in `bench/debezium_bench.py`'s docstring.",
        "Delivery differs: Tideline writes exactly once (a Kafka transaction per batch, with its position, into "
        "compacted topics); Debezium at least once (idempotent producer, offsets flushed by the worker).",
        f"{sizes.changes:,} changes in {TXN_ROWS}-row transactions on the capture bench's table; a Debezium "
        "warm-up run on its own slot copy is not counted; Tideline's interpreter start is counted.",
    ]
    pg = LocalPostgres(ctx.workdir / "pg", fast=True)
    load_before = os.getloadavg()
    try:
        pg.start()
        dsn = pg.create_database("debezium_bench")
        with LocalKafka(ctx.workdir / "kafka", brokers=1) as kafka:
            bench(ctx, section, sizes, dsn, kafka.bootstrap_servers)
    finally:
        pg.stop()
        # changes/s depend on what else runs (both connectors wait on Kafka and Postgres); CPU-seconds much less
        section.notes.append(
            f"Load average (1 min) {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
            f"{os.cpu_count()} CPUs: above the CPU count, changes/s measure the machine's contention as much as "
            "the connectors; changes per CPU-second are the steadier figure."
        )
