"""Tideline against Debezium into Kafka: changes/s and connector CPU-seconds on the same WAL (issue 16).

Setup: a private PostgreSQL 15 (``LocalPostgres``, fsync off), a private single-broker
Kafka (``LocalKafka``), and two Kafka Connect standalone workers running Debezium's
PostgreSQL connector (``tideline.connectharness.LocalConnect``, from the jar cache): one
**tuned** for throughput as Debezium's and Kafka's documentation recommend, one at
**stock** settings. The table and the workload are the capture bench's
(``bench.capture_bench``: ``changes`` row changes in 100-row transactions, half INSERTs
then half UPDATEs of the same rows, 6 columns), published by one publication
``bench_pub FOR TABLE bench`` that all read.

The WAL is written once, after a pgoutput slot ``src`` was created; every round copies
``src`` three times (``pg_copy_logical_replication_slot``: same start), so every connector
decodes the identical WAL from the same point to the same end:

* **Tideline**: ``tideline --kafka B capture run --plugin pgoutput --publication bench_pub
  --publication-autocreate disabled --snapshot never --exit-when-caught-up`` as a child
  process (default settings: one partition, exactly once: a transactional producer,
  acks=all, one Kafka transaction per log batch with the position; librdkafka's batches
  of up to 1 MB, linger 5 ms, lz4 as by default). Time: from the spawn to its exit (interpreter start,
  imports and connections included). CPU: the process's utime+stime and its children's,
  read from ``/proc/<pid>/stat`` when it has exited and before it is reaped (the kernel's
  final figures).
* **Debezium** 3.7 on Kafka Connect 4.3 (``COMPARABLE_SETTINGS`` with
  ``snapshot.mode=no_data`` (3.x's "never"), no transaction metadata; JSON converter,
  schemas off; the worker's producer: idempotent, acks=all, not transactional). Time:
  from adding the connector over REST to the topic's high watermark reaching ``changes``
  (polled every 50 ms). CPU: the worker JVM's utime+stime over the same interval, from
  ``/proc`` (each worker is started once; a first connector run on its own slot copy
  warms its JVM up and is not counted, as a long-running Connect worker is warm).

  - *tuned* (:data:`TUNED`, the row the targets are checked against): the producer's
    ``batch.size`` 1 MiB, ``linger.ms`` 20 and ``compression.type`` lz4 through
    ``producer.override.*`` (Kafka's producer configuration: larger batches, a linger and
    compression are its throughput settings, and lz4 is Tideline's default too;
    Kafka Connect applies per-connector overrides under
    ``connector.client.config.override.policy=All``, its default since Kafka 3.0,
    KIP-722, set explicitly here), Debezium's ``max.batch.size`` 20480 and
    ``max.queue.size`` 81920 (Debezium's PostgreSQL connector documentation: the batch
    of events per poll and the queue between the replication stream and Kafka, the
    queue always larger than the batch), and a 2 GiB heap (``-Xmx2g``: what Kafka's own
    ``connect-standalone.sh``/``connect-distributed.sh`` set in ``KAFKA_HEAP_OPTS``);
  - *stock*: Debezium's and the producer's defaults (``max.batch.size`` 2048,
    ``max.queue.size`` 8192, 16 KiB producer batches, ``linger.ms`` 5) and a 1 GiB heap:
    informational, beside the tuned row.

Rounds: Tideline and tuned Debezium back to back (which goes first alternates), then stock
Debezium; ``runs`` rounds. Changes/s = row changes / seconds; CPU = changes per connector
CPU-second. Each headline ratio is the median of the per-round ratios (values: the
medians of each side's runs; best run ÷ best run as an extra column). Targets
(docs/targets.md, issue 16): Tideline ≥ 1.5× tuned Debezium's changes/s, ≥ 2× its changes
per CPU-second, and ≥ 45k changes per connector CPU-second.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.capture_bench import CREATE_TABLE, TABLE, TXN_ROWS, count_kafka_records, execute, generate_changes, wal_lsn
from bench.report import Paired, Section, measured, measured_paired
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
class Setup:
    """One Debezium configuration: its Connect worker (heap, worker.properties) and connector settings."""

    name: str
    heap: str
    worker: dict[str, str]
    connector: dict[str, str]


# Debezium tuned for throughput as its and Kafka's documentation recommend (the module docstring says which
# document recommends each); the targets are checked against it.
TUNED = Setup(
    "tuned",
    heap="2g",  # Kafka's connect-standalone.sh / connect-distributed.sh: KAFKA_HEAP_OPTS="-Xms256M -Xmx2G"
    worker={"connector.client.config.override.policy": "All"},  # Kafka Connect: per-connector client overrides
    connector={
        "producer.override.batch.size": str(1 << 20),  # Kafka producer: bigger batches (default 16 KiB)
        "producer.override.linger.ms": "20",  # Kafka producer: wait to fill them (default 5 ms)
        "producer.override.compression.type": "lz4",  # Kafka producer: compressed batches (default none), as Tideline's
        "max.batch.size": "20480",  # Debezium: events per batch handed to Kafka Connect (default 2048)
        "max.queue.size": "81920",  # Debezium: the queue before Kafka, always larger than the batch (default 8192)
    },
)
STOCK = Setup("stock", heap="1g", worker={}, connector={})  # defaults; the harness's 1 GiB heap


@dataclass(frozen=True, slots=True)
class Sizes:
    changes: int
    runs: int


FULL = Sizes(changes=300_000, runs=5)
QUICK = Sizes(changes=30_000, runs=2)


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


def run_debezium(
    connect: LocalConnect, setup: Setup, dsn: str, kafka: str, slot: str, prefix: str, changes: int
) -> Run:
    """Debezium's connector on ``slot`` until its topic holds ``changes`` records; wall time and worker CPU."""
    config = debezium_postgres_config(dsn, slot=slot, publication=PUBLICATION, topic_prefix=prefix,
                                      overrides={"snapshot.mode": "no_data", **setup.connector})  # fmt: skip
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


def check_producer_overrides(connect: LocalConnect, setup: Setup) -> None:
    """The connector's producer runs with the setup's ``producer.override.*`` values (its ProducerConfig
    values in the worker's log): a refused or ignored override would make the tuned run a stock one."""
    text = connect.log_path.read_text(errors="replace")
    prefix = "producer.override."
    for key, value in setup.connector.items():
        setting = key.removeprefix(prefix)
        if setting != key and not re.search(rf"^\s+{re.escape(setting)} = {re.escape(value)}$", text, re.MULTILINE):
            raise RuntimeError(f"Debezium ({setup.name}): its producer did not take {key}={value}: {connect.log_path}")


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

    def rate(r: Run) -> str:
        return f"{n / r.seconds:,.0f} changes/s, {r.cpu_seconds:.2f} CPU-s ({n / r.cpu_seconds:,.0f} changes/CPU-s)"

    tl: list[Run] = []
    dbz: dict[str, list[Run]] = {TUNED.name: [], STOCK.name: []}
    with (
        LocalConnect(ctx.workdir / "connect-tuned", kafka, heap=TUNED.heap, worker_settings=TUNED.worker) as tuned,
        LocalConnect(ctx.workdir / "connect-stock", kafka, heap=STOCK.heap, worker_settings=STOCK.worker) as stock,
    ):
        workers = {TUNED.name: (tuned, TUNED), STOCK.name: (stock, STOCK)}
        for name, (connect, setup) in workers.items():
            slot = f"dbz_{name}_warmup"
            copy_slot(dsn, "src", slot)
            warm = run_debezium(connect, setup, dsn, kafka, slot, f"w{name}", n)
            check_producer_overrides(connect, setup)
            ctx.say(f"Debezium ({name}) warm-up run (not counted): {rate(warm)}")
            wait_slot_released(dsn, slot)
            execute(dsn, "SELECT pg_drop_replication_slot(%s)", (slot,))
        for i in range(sizes.runs):
            slots = {"tl": f"tl_{i}", TUNED.name: f"dbz_tuned_{i}", STOCK.name: f"dbz_stock_{i}"}
            for slot in slots.values():
                copy_slot(dsn, "src", slot)

            # Tideline and tuned Debezium back to back, the first of the two alternating; stock after them
            pair = ["tl", TUNED.name] if i % 2 == 0 else [TUNED.name, "tl"]
            for who in [*pair, STOCK.name]:
                if who == "tl":
                    tl.append(run_tideline(ctx, dsn, kafka, slots["tl"], f"tl{i}", n))
                else:
                    connect, setup = workers[who]
                    dbz[who].append(run_debezium(connect, setup, dsn, kafka, slots[who], f"dbz{who}{i}", n))
                    wait_slot_released(dsn, slots[who])
            for slot in slots.values():
                execute(dsn, "SELECT pg_drop_replication_slot(%s)", (slot,))
            ctx.say(
                f"round {i + 1}: Tideline {rate(tl[-1])}; Debezium tuned {rate(dbz[TUNED.name][-1])}; "
                f"Debezium stock {rate(dbz[STOCK.name][-1])}"
            )
    execute(dsn, "SELECT pg_drop_replication_slot('src')")

    def per_s(runs: list[Run]) -> list[float]:
        return [n / r.seconds for r in runs]

    def per_cpu(runs: list[Run]) -> list[float]:
        return [n / r.cpu_seconds for r in runs]

    speed = {name: Paired(per_s(tl), per_s(runs)) for name, runs in dbz.items()}
    cpu = {name: Paired(per_cpu(tl), per_cpu(runs)) for name, runs in dbz.items()}
    tuning = Paired(per_s(dbz[TUNED.name]), per_s(dbz[STOCK.name]))
    tuning_cpu = Paired(per_cpu(dbz[TUNED.name]), per_cpu(dbz[STOCK.name]))
    workload = f"{n:,} row changes ({n // 2:,} INSERTs then {n - n // 2:,} UPDATEs) in {TXN_ROWS}-row transactions"
    cpu_what = ("Tideline: the whole process, interpreter start included; Debezium: the worker from adding the "
                "connector to its last record")  # fmt: skip
    section.results += [
        measured_paired(
            "Tideline → Kafka (pgoutput), changes/s",
            speed[TUNED.name],
            "changes/s",
            baseline_name="Debezium tuned → Kafka, same WAL",
            min_ratio=1.5,
            note=f"{workload}; changes/s {speed[TUNED.name].spread()}",
        ),
        measured_paired(
            "Tideline changes per connector CPU-second",
            cpu[TUNED.name],
            "changes/CPU-s",
            baseline_name="Debezium tuned (Connect worker JVM)",
            min_ratio=2.0,
            note=f"changes per CPU-second {cpu[TUNED.name].spread()} ({cpu_what})",
        ),
        measured(
            "Tideline changes per connector CPU-second (absolute)",
            cpu[TUNED.name].value,
            "changes/CPU-s",
            min_value=45_000,
            note="the median of Tideline's runs",
        ),
        measured_paired(
            "Tideline → Kafka (pgoutput), changes/s, against stock Debezium",
            speed[STOCK.name],
            "changes/s",
            baseline_name="Debezium stock → Kafka, same WAL",
            note=f"informational; changes/s {speed[STOCK.name].spread()}",
        ),
        measured_paired(
            "Tideline changes per connector CPU-second, against stock Debezium",
            cpu[STOCK.name],
            "changes/CPU-s",
            baseline_name="Debezium stock (Connect worker JVM)",
            note=f"informational; changes per CPU-second {cpu[STOCK.name].spread()}",
        ),
        measured_paired(
            "Debezium tuned → Kafka, changes/s",
            tuning,
            "changes/s",
            baseline_name="Debezium stock, same WAL",
            note=f"what the tuning buys; changes/s {tuning.spread()}; changes per CPU-second tuned "
            f"{tuning_cpu.value:,.0f}, stock {tuning_cpu.peer:,.0f} (medians; published figure ≈ 30k changes per "
            "connector core)",
        ),
    ]


def run(ctx: Context, section: Section) -> None:
    sizes = QUICK if ctx.quick else FULL
    tuned = ", ".join(f"`{k}={v}`" for k, v in TUNED.connector.items())
    section.notes += [
        f"Debezium {debezium_version()} (PostgreSQL connector) on Kafka Connect standalone "
        "(`tideline.connectharness`, JVM flags as Kafka's start scripts: G1) vs `tideline capture run --plugin "
        "pgoutput` as a child process; all into one private single-broker Kafka (KRaft, `tideline.kafkaharness`), "
        "all from copies of one pgoutput slot (`pg_copy_logical_replication_slot`) through one publication, so "
        "every connector decodes the identical WAL from the same start; the method is in "
        "`bench/debezium_bench.py`'s docstring.",
        f"Debezium tuned (the targets' peer): {tuned}, a {TUNED.heap.upper()}iB heap, and "
        "`connector.client.config.override.policy=All` on its worker: the producer's `batch.size`/`linger.ms` "
        "as Kafka's producer documentation gives them for throughput, `max.batch.size`/`max.queue.size` from "
        "Debezium's PostgreSQL connector documentation (the queue always larger than the batch), the heap of "
        "Kafka's own Connect start scripts (`-Xmx2G`). Debezium stock: its and the producer's defaults "
        f"(`max.batch.size` 2048, `max.queue.size` 8192, 16 KiB producer batches), a {STOCK.heap.upper()}iB heap; "
        "informational.",
        "Delivery differs: Tideline writes exactly once (a Kafka transaction per batch, with its position, into "
        "compacted topics); Debezium at least once (idempotent producer, offsets flushed by the worker).",
        f"{sizes.changes:,} changes in {TXN_ROWS}-row transactions on the capture bench's table; {sizes.runs} "
        "rounds: Tideline and tuned Debezium back to back (the first of the two alternating), then stock Debezium; "
        "values are the medians of each side's runs, ratios the medians of the per-round ratios. Each worker's "
        "warm-up run on its own slot copy is not counted; Tideline's interpreter start is counted. Both workers "
        "stay up through the rounds (the idle one's JVM shares the machine).",
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
        # changes/s depend on what else runs (the connectors wait on Kafka and Postgres); CPU-seconds much less
        section.notes.append(
            f"Load average (1 min) {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
            f"{os.cpu_count()} CPUs: above the CPU count, changes/s measure the machine's contention as much as "
            "the connectors; changes per CPU-second are the steadier figure."
        )
