"""Crash acceptance test: kill -9 the connector at random moments; the log equals an uninterrupted run's.

Run once per backend and plugin: the embedded log, and Kafka (three brokers, replication factor
3, min.insync.replicas 2; the reference always writes to an embedded log), each with wal2json and
with pgoutput (on the embedded log with fewer kills; PostgreSQL 15 for the embedded log's run,
PostgreSQL 18 for Kafka's), pgoutput's database set to
``logical_decoding_work_mem = 64kB`` so that the workload's bigger transactions are streamed
before they commit and kills also land while they are spilled or replayed.

Two connectors capture the same database, each into its own log directory with its own
slot (both slots exist before the workload starts):

* the **reference** runs twice, uninterrupted: once for its snapshot before the workload,
  once at the end (``exit_when_caught_up``);
* the **crashed** one is a separate process (``sys.executable -c``) killed with SIGKILL at
  random moments: first during its initial snapshot (a bulk table makes the snapshot last
  long enough), then while the random workload (tests/capture/workload.py, with logical
  messages) writes concurrently; each kill is followed by a restart; a final run catches up.

Runs that get killed use 32 KiB log batches, so that long Postgres transactions reach the log
in several pieces and kills land in the middle of them (the restart then resumes
mid-transaction); uninterrupted runs use the default 4 MiB.

Then, per topic (every table topic, ``cdc.transaction``, ``cdc.message``) and partition, the
read_committed sequences of (key, value) are identical, values compared with every number's
spelling, minus fields that are processing time or slot identity, not data:
the envelope's top-level ``ts_ms`` (capture time); for snapshot reads (``op=r``) ``source.ts_ms``,
``source.lsn`` and ``source.commit_lsn`` (the time and consistent point of each slot's own
snapshot); for non-transactional messages ``source.ts_ms`` (capture time: they have no commit).
Identical sequences per partition mean no event lost, none duplicated, and the same order
per key.

After every kill the slot must not have been confirmed past what the log stores: every
transaction of the reference run that committed before the slot's ``confirmed_flush_lsn``
must be covered by the position stored in the crashed log at that moment.

Size: ``TIDELINE_SOAK=1`` kills ~200 times (and a bigger snapshot); CI runs ~10 kills (pgoutput ~7).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from backends import CHILD_SINK, Backend
from capture_util import drop_slots, events, fresh_database, records, sql
from readiness import wait_for_text, wait_until
from workload import Workload, run_in_thread, soak

from capture.connector import OFFSETS_TOPIC, CaptureConfig, Connector, Position, slot_status
from capture.messages import Plugin
from capture.replication import parse_lsn
from eventstore.log import Log
from eventstore.partition_log import LOCK_FILE
from eventstore.topic import TopicConfig
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "cdc"
KILLED_BATCH_BYTES = 32 << 10  # runs that get killed: long transactions reach the log in pieces
FULL_BATCH_BYTES = 4 << 20  # uninterrupted runs (the connector's default)
PARTITIONS = 3
STARTED = "connector process started"  # the child's first log line, once its imports are done

CHILD = (
    CHILD_SINK
    + r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
from capture.connector import CaptureConfig, SnapshotMode
from capture.messages import Plugin
dsn, slot, prefix, until_caught_up, batch_bytes, partitions, snapshot, plugin = sys.argv[1:9]
config = CaptureConfig(dsn=dsn, slot=slot, topic_prefix=prefix, exit_when_caught_up=until_caught_up == "1",
                       batch_bytes=int(batch_bytes), partitions=int(partitions), snapshot=SnapshotMode(snapshot),
                       transaction_metadata=True, plugin=Plugin(plugin))
logging.getLogger("capture.test").info("connector process started")
stats = connector_for(config, *sys.argv[9:14]).run()
print("done", stats.events, stats.snapshot_rows, flush=True)
"""
)


@dataclass(frozen=True)
class Sizes:
    bulk_rows: int  # the snapshot's bulk table
    rows_per_table: int
    snapshot_kills: int
    stream_kills: int
    max_sleep_s: float  # between the start of streaming (snapshot kills: of the process) and a kill
    pause_s: float  # the workload's pause between transactions (keeps the connector within reach)


CI = Sizes(bulk_rows=40_000, rows_per_table=200, snapshot_kills=3, stream_kills=8, max_sleep_s=3.0, pause_s=0.3)
KAFKA_CI = Sizes(bulk_rows=20_000, rows_per_table=200, snapshot_kills=2, stream_kills=4, max_sleep_s=3.0, pause_s=0.3)
PGOUTPUT_CI = Sizes(bulk_rows=20_000, rows_per_table=200, snapshot_kills=2, stream_kills=5, max_sleep_s=3.0,
                    pause_s=0.3)  # fmt: skip
SOAK = Sizes(
    bulk_rows=300_000, rows_per_table=2_000, snapshot_kills=20, stream_kills=200, max_sleep_s=4.0, pause_s=0.03
)


# ---------------------------------------------------------------------------- processes


_LIVE: list[Run] = []  # every Run started, so that a failing test leaves no connector process behind


def reap_runs() -> None:
    """SIGKILL (by PID) every connector process this module started that is still running."""
    while _LIVE:
        run = _LIVE.pop()
        if run.proc.poll() is None:
            run.proc.kill()
        run.proc.wait()
        if run.proc.stdout is not None:
            run.proc.stdout.close()


@pytest.fixture(autouse=True)
def _reaper() -> Iterator[None]:
    yield
    reap_runs()


class Run:
    """One connector process (its stderr goes to a file, read when it is over)."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        backend: Backend | Path,
        dsn: str,
        slot: str,
        *,
        caught_up: bool,
        partitions: int = PARTITIONS,
        snapshot: str = "initial",
        plugin: Plugin = Plugin.WAL2JSON,
    ) -> None:
        self.stderr_path = tmp / f"{name}.stderr"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        batch_bytes = FULL_BATCH_BYTES if caught_up else KILLED_BATCH_BYTES
        backend = backend if isinstance(backend, Backend) else Backend.embedded(backend, PREFIX)
        argv = [sys.executable, "-c", CHILD, dsn, slot, backend.prefix, "1" if caught_up else "0", str(batch_bytes),
                str(partitions), snapshot, plugin.value, *backend.argv()]  # fmt: skip
        self.started = time.monotonic()
        self.wall_started = time.time()
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err)
        _LIVE.append(self)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def seconds_to(self, text: str) -> float | None:
        """Seconds from the process start to the first log line containing ``text`` (None: no such line)."""
        for line in self.stderr().splitlines():
            if text in line:
                try:
                    at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    continue
                return at - self.wall_started
        return None

    def kill(self) -> None:
        """SIGKILL by PID; fails the test if the process had already died by itself."""
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(f"connector exited by itself ({code}) before its kill:\n{self.stderr()[-3000:]}")
        self.proc.kill()
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()

    def finish(self, timeout: float = 300) -> float:
        """Wait for an ``exit_when_caught_up`` run; returns its duration in seconds."""
        out, _ = self.proc.communicate(timeout=timeout)
        if self.proc.returncode != 0 or not out.startswith(b"done"):
            raise AssertionError(f"connector failed ({self.proc.returncode}):\n{self.stderr()[-3000:]}")
        return time.monotonic() - self.started


# ---------------------------------------------------------------------------- log reading


def stored_position(where: Backend | Path, dsn: str, slot: str) -> Position | None:
    """The crashed (or stopped) connector's stored position, as its restart finds it (opens only the
    offsets topic's partition)."""
    if isinstance(where, Backend):
        return where.position(dsn, slot, take_over=True)
    with Log(where) as log:
        return Connector(CaptureConfig(dsn=dsn, slot=slot, topic_prefix=PREFIX), log).read_position()


def exact_json(raw: bytes) -> Any:
    return json.loads(raw, parse_float=lambda text: ("num", text))


def normalize(value: bytes | None) -> Any:
    """The value minus processing time and slot identity (see the module docstring)."""
    if value is None:
        return None
    v = exact_json(value)
    if not isinstance(v, dict):
        return v
    if "op" in v:
        v.pop("ts_ms")  # capture time (BEGIN/END records have no "op"; their ts_ms is the commit time: kept)
    source: dict[str, Any] = v.get("source") or {}
    if v.get("op") == "r":
        for k in ("ts_ms", "lsn", "commit_lsn"):
            source.pop(k)
    elif v.get("op") == "m" and v.get("transaction") is None:
        source.pop("ts_ms")
    return v


Visible = dict[tuple[str, int], list[tuple[bytes | None, Any]]]


def visible(backend: Backend, isolation: str = "read_committed") -> Visible:
    """(topic, partition) → [(key, normalized value)] of every non-internal topic, in offset order.

    A keyless table's topic (null keys) places each batch on a partition round-robin from a
    random start, so its partitions differ between runs by design: its records are compared
    as one sorted list under partition -1 (each event is unique by its source position, so
    equal sorted lists still mean nothing lost and nothing twice).
    """
    out: dict[tuple[str, int], list[tuple[bytes | None, Any]]] = {}
    for topic in backend.topics():
        per_partition: dict[tuple[str, int], list[tuple[bytes | None, Any]]] = {}
        for p in range(backend.partitions(topic)):
            per_partition[(topic, p)] = [(k, normalize(v)) for k, v in backend.partition_records(topic, p, isolation)]
        everything = [row for rows in per_partition.values() for row in rows]
        if everything and all(key is None for key, _ in everything):  # a keyless table's topic
            out[(topic, -1)] = sorted(everything, key=lambda row: json.dumps(row[1], sort_keys=True))
        else:
            out.update(per_partition)
    return out


def count(backend: Backend, isolation: str) -> int:
    """Records of every non-internal topic visible under ``isolation``."""
    return sum(len(backend.records(topic, isolation)) for topic in backend.topics())


def reference_commits(backend: Backend) -> list[int]:
    """Commit LSNs of every transaction (END event) of the reference run."""
    commits = []
    for _, _, value in backend.records(f"{backend.prefix}.transaction"):
        assert value is not None
        v = json.loads(value)
        if v["status"] == "END":
            commits.append(int(v["id"].split(":")[1]))
    return commits


def first_difference(a: list[Any], b: list[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return (f"first difference at visible record {i} ({'; '.join(differing_paths(x, y))}):\n"
                    f"  crashed   {x!r:.1500}\n  reference {y!r:.1500}")  # fmt: skip
    return f"lengths differ: crashed {len(a)}, reference {len(b)}"


def differing_paths(x: Any, y: Any, path: str = "") -> list[str]:
    """Where two records differ: ``path: crashed != reference`` for each differing leaf (a few at most)."""
    if isinstance(x, dict) and isinstance(y, dict):
        keys = sorted(set(x) | set(y))
        return [d for k in keys for d in differing_paths(x.get(k, "<absent>"), y.get(k, "<absent>"), f"{path}.{k}")][:5]
    if isinstance(x, list | tuple) and isinstance(y, list | tuple) and len(x) == len(y):
        return [d for i, (u, v) in enumerate(zip(x, y, strict=True)) for d in differing_paths(u, v, f"{path}[{i}]")][:5]
    return [] if x == y else [f"{path or 'record'}: {x!r:.200} != {y!r:.200}"]


# ---------------------------------------------------------------------------- the scenario


@dataclass
class Kill:
    phase: str  # "snapshot" | "stream"
    after_s: float
    landed: str  # where, judged from the stored position and the process's own log
    confirmed: int  # slot confirmed_flush_lsn after the kill
    position: Position | None
    held_open: int  # partitions an open transaction of the killed run held records in (aborted by the restart)


def classify(phase: str, stderr: str, position: Position | None) -> str:
    if phase == "snapshot":
        if position is None:
            return "before the snapshot began (startup, slot creation)"
        if not position.snapshot_done:
            return "during the snapshot"
        return "after the snapshot (streaming, idle)"
    if "streaming slot" not in stderr:
        return "startup (before streaming)"
    if position is not None and not position.complete:
        return "streaming, stored position mid-transaction"
    return "streaming, stored position at a transaction end"


@dataclass
class Outcome:
    crashed: dict[tuple[str, int], list[tuple[bytes | None, Any]]]
    reference: dict[tuple[str, int], list[tuple[bytes | None, Any]]]
    hidden: int  # records of aborted log transactions in the crashed log
    kills: list[Kill]
    commits: list[int]  # commit LSNs of the reference run's transactions
    summary: str
    prefix: str  # the topic prefix of both runs
    sizes: Sizes


def crash_scenario(dsn: str, tmp: Path, sizes: Sizes, crashed_dir: Backend, plugin: Plugin) -> Outcome:
    """``crashed_dir``: where the crashed connector writes (the embedded log, or Kafka); the reference
    always writes to an embedded log, under the same topic prefix. Both connectors use ``plugin``."""
    rng = random.Random(99)
    ref_dir = Backend.embedded(tmp / "reference", crashed_dir.prefix)
    runs = tmp / "runs"
    runs.mkdir()
    timings: dict[str, float] = {}
    clock = time.monotonic()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.monotonic()
        timings[name] = now - clock
        clock = now

    workload = Workload(dsn, seed=7, messages=True)
    workload.create_schema()
    # No autovacuum/autoanalyze: their transactions (empty to wal2json: a BEGIN/END pair in the transaction
    # topic) could commit after the crashed connector's final catch-up and before the reference's.
    sql(dsn, *[f"ALTER TABLE {t} SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)"
               for t in ('wl_items', 'wl_pairs', 'wl_events', '"wl Odd Näme"', "wl_audit")])  # fmt: skip
    workload.populate(sizes.rows_per_table)
    sql(
        dsn,
        "CREATE TABLE wl_bulk (id int PRIMARY KEY, payload text, n numeric) WITH (autovacuum_enabled = false)",
        "INSERT INTO wl_bulk SELECT g, md5(g::text) || md5((g + 1)::text), g / 7.0 "
        f"FROM generate_series(1, {sizes.bulk_rows}) g",
    )
    lap("setup")

    def reference_snapshot() -> tuple[float, float]:
        """The reference slot and snapshot, uninterrupted; when, in a connector's life, its snapshot runs:
        from the first table topic it creates to streaming, in seconds after its process was up (the
        interpreter's start, seconds on a loaded machine, is left out: kills count from the same line)."""
        ref = Run(runs, f"ref-snapshot-{pairs}", ref_dir, dsn, "ref", caught_up=True, plugin=plugin)
        snapshot_s = ref.finish()
        up = ref.seconds_to(STARTED) or 0.0
        began = ref.seconds_to(f"created topic {ref_dir.prefix}.public.") or up + 0.4 * (snapshot_s - up)
        ended = ref.seconds_to("streaming slot") or snapshot_s
        return max(0.0, began - up), max(0.0, ended - up)

    pairs = 0
    began, ended = reference_snapshot()
    lap("reference snapshot")
    kills: list[Kill] = []

    def kill_after(phase: str, delay: float) -> None:
        run = Run(runs, f"{phase}-{len(kills)}", crashed_dir, dsn, "crashed", caught_up=False, plugin=plugin)
        # The delay counts from a line of the process's own log (a loaded machine starts slowly): the start
        # of streaming; for the snapshot, the end of its imports, the point the reference's timing counts from.
        ready = "streaming slot" if phase == "stream" else STARTED
        wait_for_text(run.stderr_path, ready, f"{ready!r} from the connector", alive=run.proc)
        time.sleep(delay)
        run.kill()
        held_open = crashed_dir.held_open()  # before stored_position: on Kafka, it aborts the open transaction
        info = slot_status(dsn, "crashed")  # the slot first: the stored position can only grow after it
        confirmed = parse_lsn(info["confirmed_flush_lsn"]) if info and info["confirmed_flush_lsn"] else 0
        position = stored_position(crashed_dir, dsn, "crashed")
        kills.append(Kill(phase, delay, classify(phase, run.stderr(), position), confirmed, position, held_open))

    # Kills during the crashed connector's initial snapshot (no writes yet: both snapshots see the same rows).
    # The window comes from the reference run's timing, which a loaded machine stretches: a kill that
    # lands before or after the snapshot narrows the window, and a few extra kills are allowed until
    # at least one lands inside it.
    # A kill that lands after the snapshot ends the crashed connector's snapshot for good: if none landed
    # inside it yet, both connectors start over, with new slots and logs (no writes have happened yet).
    lo, hi = began, ended
    for attempt in range(sizes.snapshot_kills + 6):
        inside = sum(k.landed == "during the snapshot" for k in kills)
        if attempt >= sizes.snapshot_kills and inside:
            break
        delay = rng.uniform(lo, hi)
        kill_after("snapshot", delay)
        if kills[-1].landed.startswith("before"):
            lo = delay
            # this run starts slower than the reference did (the reference is always on the embedded log; a Kafka
            # run also initializes its transactional producers): look later, doubling, so that a start several
            # times the reference's is reached within the extra kills
            hi = max(hi, lo * 2.0)
        elif kills[-1].landed.startswith("after"):
            hi = delay
            lo = min(lo, hi * 0.5)  # ... or faster: look earlier too
            if not inside:
                pairs += 1
                wait_until(lambda: not any((slot_status(dsn, s) or {}).get("active") for s in ("ref", "crashed")),
                           "the killed run's walsender to let go of its slot", timeout=60, every=0.1)  # fmt: skip
                sql(dsn, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                         "WHERE slot_name IN ('ref', 'crashed')")  # fmt: skip
                crashed_dir = crashed_dir.elsewhere(tmp / f"crashed-{pairs}")
                ref_dir = Backend.embedded(tmp / f"reference-{pairs}", crashed_dir.prefix)
                reference_snapshot()  # the window found so far stays
    Run(runs, "snapshot-final", crashed_dir, dsn, "crashed", caught_up=True, plugin=plugin).finish()
    position = stored_position(crashed_dir, dsn, "crashed")
    assert position is not None and position.snapshot_done
    lap("snapshot kills")

    # Kills while the workload writes.
    stop = threading.Event()
    writer, errors = run_in_thread(workload, stop, pause_s=sizes.pause_s, truncate_p=0.004)
    try:
        for _ in range(sizes.stream_kills):
            kill_after("stream", rng.uniform(0.0, sizes.max_sleep_s))
            assert not errors, errors
        # At least one kill must leave a log transaction open (its records then stay hidden, aborted): where
        # it depends on timing (a loaded machine), a few extra kills are allowed until one does.
        for _ in range(6):
            if any(k.held_open for k in kills if k.phase == "stream"):
                break
            kill_after("stream", rng.uniform(0.0, sizes.max_sleep_s))
            assert not errors, errors
    finally:
        stop.set()
        writer.join()
    assert not errors, errors
    lap("stream kills")
    Run(runs, "final", crashed_dir, dsn, "crashed", caught_up=True, plugin=plugin).finish()
    lap("crashed catch-up")
    Run(runs, "ref-final", ref_dir, dsn, "ref", caught_up=True, plugin=plugin).finish()
    # A transaction can still commit after the workload: autovacuum/autoanalyze of a system catalog (an
    # empty transaction to the plugin: a BEGIN/END pair in the transaction topic). If one committed between
    # the two catch-ups, the one behind catches up again, until both stored the same last transaction.
    for again in range(5):
        last = {name: stored_position(where, dsn, name) for name, where in (("crashed", crashed_dir), ("ref", ref_dir))}
        behind = [
            n for n, p in last.items() if p is not None and p.commit_lsn < max(q.commit_lsn for q in last.values() if q)
        ]
        if not behind:
            break
        where = crashed_dir if behind[0] == "crashed" else ref_dir
        Run(runs, f"{behind[0]}-final-{again}", where, dsn, behind[0], caught_up=True, plugin=plugin).finish()
    lap("reference catch-up")

    crashed, reference = visible(crashed_dir), visible(ref_dir)
    hidden = count(crashed_dir, "read_uncommitted") - sum(len(v) for v in crashed.values())
    commits = reference_commits(ref_dir)
    lap("read logs")
    landed = Counter(k.landed for k in kills)
    summary = (
        f"{len(kills)} kills: " + "; ".join(f"{c}× {where}" for where, c in landed.most_common())
        + f" ({sum(k.held_open > 0 for k in kills)} left a log transaction open)"
        + f". {sum(len(v) for v in reference.values())} visible records per log, {hidden} records of aborted "
        f"log transactions hidden in the crashed log. Snapshot kills aimed at {began:.1f}-{ended:.1f} s after "
        f"the process was up. Workload: {workload.stats.summary()}. Seconds: "
        + ", ".join(f"{k} {v:.1f}" for k, v in timings.items())
    )  # fmt: skip
    print(summary)
    return Outcome(crashed, reference, hidden, kills, commits, summary, crashed_dir.prefix, sizes)


@pytest.fixture(scope="module", params=["embedded", "kafka", "embedded-pgoutput", "kafka-pgoutput-pg18"])
def outcome(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    """The scenario once per backend and plugin: the embedded log, and Kafka on three brokers (replication factor
    3, min.insync.replicas 2), with wal2json; then both with pgoutput, streaming big transactions: the embedded
    log's on PostgreSQL 15, Kafka's on 18 (pgoutput is killed on both servers, each backend once)."""
    server: LocalPostgres = request.getfixturevalue("postgres18" if request.param.endswith("-pg18") else "postgres")
    dsn = fresh_database(server, "crash")
    tmp = tmp_path_factory.mktemp("crash")
    plugin = Plugin.WAL2JSON
    if request.param == "kafka":
        cluster: LocalKafka = request.getfixturevalue("kafka3")
        crashed = Backend.kafka(cluster.bootstrap_servers, tmp / "crashed-state", brokers=3)
        sizes = SOAK if soak() else KAFKA_CI
    elif request.param == "kafka-pgoutput-pg18":
        cluster = request.getfixturevalue("kafka3")
        plugin, crashed = Plugin.PGOUTPUT, Backend.kafka(cluster.bootstrap_servers, tmp / "crashed-state", brokers=3)
        sizes = SOAK if soak() else KAFKA_CI
        sql(dsn, f"ALTER DATABASE {dsn.rsplit('/', 1)[1]} SET logical_decoding_work_mem = '64kB'")  # as below
    elif request.param == "embedded-pgoutput":
        plugin, crashed = Plugin.PGOUTPUT, Backend.embedded(tmp / "crashed", PREFIX)
        sizes = SOAK if soak() else PGOUTPUT_CI
        # the walsenders of this database stream every transaction over 64 kB before its commit
        sql(dsn, f"ALTER DATABASE {dsn.rsplit('/', 1)[1]} SET logical_decoding_work_mem = '64kB'")
    else:
        crashed, sizes = Backend.embedded(tmp / "crashed", PREFIX), SOAK if soak() else CI
    try:
        try:
            result = crash_scenario(dsn, tmp, sizes, crashed, plugin)
        finally:
            reap_runs()
        yield result
    finally:
        drop_slots(dsn)


# ---------------------------------------------------------------------------- the tests


def without_transaction_metadata(rows: list[tuple[bytes | None, Any]]) -> list[tuple[bytes | None, Any]]:
    out = []
    for key, value in rows:
        if isinstance(value, dict):
            value = dict(value)
            if isinstance(value.get("transaction"), dict):
                value["transaction"] = {"id": value["transaction"]["id"]}
            if value.get("status") == "END":
                value.pop("event_count")
                value.pop("data_collections")
        out.append((key, value))
    return out


def test_kill9_loses_nothing_duplicates_nothing_keeps_order(outcome: Outcome) -> None:
    """Every event, once, in the reference's order per partition (transaction counters aside: next test)."""
    crashed, reference = outcome.crashed, outcome.reference
    assert sorted(crashed) == sorted(reference), f"topics/partitions differ: {sorted(crashed)} vs {sorted(reference)}"
    for tp in reference:
        a, b = without_transaction_metadata(crashed[tp]), without_transaction_metadata(reference[tp])
        assert a == b, f"{tp}: " + first_difference(a, b)
    assert sum(len(v) for v in reference.values()) > 0


def test_kill9_keeps_transaction_metadata(outcome: Outcome) -> None:
    """The same, exactly: total_order, data_collection_order, END event counts included."""
    for tp in outcome.reference:
        assert outcome.crashed[tp] == outcome.reference[tp], f"{tp}: " + first_difference(
            outcome.crashed[tp], outcome.reference[tp]
        )


def test_kill9_covers_keyless_mapped_names_and_key_change_images(outcome: Outcome) -> None:
    """The database has a keyless table and a table whose name needs mapping; key changes' deletes carry the
    old image (at least the key columns), in the crashed log as in the reference."""
    crashed = outcome.crashed
    keyless = crashed.get((f"{outcome.prefix}.public.wl_audit", -1), [])
    assert keyless and all(key is None for key, _ in keyless), "the keyless table's topic is missing or keyed"
    odd = [r for (topic, _), rows in crashed.items() if topic == f"{outcome.prefix}.public.wl_Odd_N_me" for r in rows]
    assert odd, f"no topic for the table named 'wl Odd Näme': {sorted(t for t, _ in crashed)}"
    deletes = 0
    for (topic, _), rows in crashed.items():
        for key, value in rows:
            if key is None or not isinstance(value, dict) or value.get("op") != "d":
                continue
            key_columns = json.loads(key)
            before = value["before"]
            assert before is not None and {k: before.get(k) for k in key_columns} == key_columns, (topic, value)
            deletes += 1
    assert deletes > 0


def test_slot_never_confirmed_past_the_log(outcome: Outcome) -> None:
    checked = 0
    for k in outcome.kills:
        if k.position is None or not k.position.snapshot_done:
            continue
        ahead = [lsn for lsn in outcome.commits if lsn < k.confirmed and not k.position.covers(lsn, 1 << 62)]
        assert not ahead, f"slot confirmed {k.confirmed:X} past stored {k.position}: unstored commits {ahead[:3]}"
        checked += 1
    # every kill while streaming has a stored position to check (kills aimed at the snapshot may land before it)
    assert checked >= sum(k.phase == "stream" for k in outcome.kills), outcome.summary


def test_kills_landed_in_the_snapshot_and_mid_stream(outcome: Outcome) -> None:
    """The scenario did what it claims (timing-dependent, so only loosely)."""
    landed = Counter(k.landed for k in outcome.kills)
    sizes = outcome.sizes
    assert landed["during the snapshot"] >= 1, outcome.summary
    assert sum(c for where, c in landed.items() if where.startswith("streaming")) >= sizes.stream_kills // 4, (
        outcome.summary
    )
    assert outcome.hidden > 0, outcome.summary


def test_restart_mid_transaction_keeps_transaction_metadata(postgres: LocalPostgres, tmp_path: Path) -> None:
    """Deterministic: kill -9 once the stored position is inside a 50,000-row transaction, past its
    1,000 primary-key changes (each a delete and a create: counted twice), restart."""
    rows, moved = 50_000, 1_000
    dsn = fresh_database(postgres, "midtxn")
    log_dir = tmp_path / "log"
    try:
        sql(dsn, "CREATE TABLE t (id int PRIMARY KEY, payload text)")
        Run(tmp_path, "first", log_dir, dsn, "s", caught_up=True, partitions=1).finish()
        fill = "INSERT INTO t SELECT g, repeat('x', 200) FROM generate_series({}, {}) g"
        move = f"UPDATE t SET id = id + {rows}"
        sql(dsn, f"BEGIN; {fill.format(1, moved)}; {move}; {fill.format(moved + 1, rows)}; COMMIT")
        run = Run(tmp_path, "killed", log_dir, dsn, "s", caught_up=False, partitions=1)
        wait_until(lambda: (p := stored_position(log_dir, dsn, "s")) and p.commit_lsn and not p.complete
                   and p.event_index >= 2 * moved, "a stored position inside the transaction, past its key changes",
                   every=0.01, alive=run.proc, details=lambda: run.stderr()[-2000:])  # fmt: skip
        run.kill()
        position = stored_position(log_dir, dsn, "s")
        assert position is not None and not position.complete and position.event_index < rows + moved - 1, position
        Run(tmp_path, "restart", log_dir, dsn, "s", caught_up=True, partitions=1).finish()
    finally:
        reap_runs()
        drop_slots(dsn)
    changes = events(log_dir, "cdc.public.t")
    moves = [(e["op"], (e["before"] if e["op"] == "d" else e["after"])["id"]) for e in changes[moved : 3 * moved]]
    assert moves == [x for i in range(1, moved + 1) for x in (("d", i), ("c", i + rows))]
    assert [e["after"]["id"] for e in changes[3 * moved :]] == list(range(moved + 1, rows + 1))  # none lost or repeated
    indexes = [*range(moved), *(i for i in range(moved, 2 * moved) for _ in "dc"), *range(2 * moved, rows + moved)]
    assert [e["source"]["event_index"] for e in changes] == indexes
    total = rows + 2 * moved
    assert [e["transaction"]["total_order"] for e in changes] == list(range(1, total + 1))
    assert [e["transaction"]["data_collection_order"] for e in changes] == list(range(1, total + 1))
    [end] = [t for t in events(log_dir, "cdc.transaction") if t["status"] == "END" and t["event_count"]]
    assert end["event_count"] == total
    assert end["data_collections"] == [{"data_collection": "public.t", "event_count": total}]


# The connector commits its "snapshot under way" position *before* it creates the slot
# (capture.snapshot.SnapshotSource.prepare), so a kill -9 around slot creation never leaves a slot the next
# start cannot account for. The test holds the offsets partition's append lock (as another
# process appending there would), checks that no slot appears while the position waits,
# kills the connector, and restarts it.


@pytest.mark.parametrize("case", ["first start", "slot lost, when_needed"])
def test_kill_between_slot_creation_and_its_position(postgres: LocalPostgres, tmp_path: Path, case: str) -> None:
    dsn = fresh_database(postgres, "slotwindow")
    log_dir = tmp_path / "log"
    mode = "initial" if case == "first start" else "when_needed"
    try:
        sql(
            dsn,
            "CREATE TABLE t (id int PRIMARY KEY, v text)",
            "INSERT INTO t SELECT g, 'v' FROM generate_series(1, 100) g",
        )
        with Log(log_dir) as log:  # the offsets topic, exactly as the connector creates it
            log.create_topic(OFFSETS_TOPIC, 1, TopicConfig(), overrides={"cleanup_policy": "compact"})
        if mode == "when_needed":
            Run(tmp_path, "first", log_dir, dsn, "s", caught_up=True, partitions=1).finish()
            drop_slots(dsn)  # the slot is lost; these rows can only come from a new snapshot:
            sql(dsn, "INSERT INTO t SELECT g, 'while the slot was gone' FROM generate_series(101, 110) g")
        before = stored_position(log_dir, dsn, "s")
        fd = os.open(log_dir / f"{OFFSETS_TOPIC}-0" / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the connector's next position append waits for it
            run = Run(tmp_path, "killed", log_dir, dsn, "s", caught_up=False, partitions=1, snapshot=mode)
            # Wait for the event itself: the connector says it is storing "snapshot under way" (its
            # append then blocks on the lock). Slot creation comes after that store, so no slot may exist.
            wait_for_text(run.stderr_path, "storing 'snapshot under way'", "the connector storing its position",
                          alive=run.proc)  # fmt: skip
            assert run.proc.poll() is None, run.stderr()[-2000:]
            assert slot_status(dsn, "s") is None, "the slot was created before its position was stored"
            run.kill()
        finally:
            os.close(fd)
        assert stored_position(log_dir, dsn, "s") == before
        Run(tmp_path, "restart", log_dir, dsn, "s", caught_up=True, partitions=1, snapshot=mode).finish()
    finally:
        reap_runs()
        drop_slots(dsn)
    rows = 100 if mode == "initial" else 110
    assert sorted(latest(log_dir, "cdc.public.t")) == list(range(1, rows + 1))


def latest(log_dir: Path, topic: str) -> dict[int, Any]:
    """id → latest image, for a table keyed by ``id``."""
    state: dict[int, Any] = {}
    for key, value in ((k, v) for k, v, _ in records(log_dir, topic)):
        if value is None or value["op"] in ("d", "t"):
            state.pop(key.get("id"), None)
        else:
            state[key["id"]] = value["after"]
    return state
