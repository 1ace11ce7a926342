"""The log a capture test writes to: the embedded log in a directory, or a real Kafka cluster.

The acceptance suites (materialization, kill -9) run once per backend with the same checks:
a :class:`Backend` makes the connector's sink and reads topics back ``read_committed`` (or
``read_uncommitted``, to count records of aborted transactions). On Kafka each backend
instance has a topic prefix of its own (tests share a session cluster); the embedded log
has a directory of its own.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from confluent_kafka import Consumer as KafkaConsumer
from confluent_kafka import KafkaError
from confluent_kafka import TopicPartition as KafkaTopicPartition

from capture.connector import CaptureConfig, Connector, Stats
from capture.sinks import Sink
from capture.sinks.kafka import KafkaLogSink
from eventstore.consumer import Consumer, TopicPartition
from eventstore.kafka import KafkaAdmin, client_config
from eventstore.log import Log
from schemas.position import SourcePosition

Record = tuple[int, bytes | None, bytes | None]  # partition, key, value
_prefixes = itertools.count()


@dataclass
class Backend:
    """Where a connector writes: ``kind`` "embedded" (``path`` is the log) or "kafka" (``bootstrap``)."""

    kind: str
    path: Path  # the embedded log, or (Kafka) the connector's local key state
    prefix: str  # the connector's topic prefix
    bootstrap: str | None = None
    replication_factor: int | None = None
    min_insync_replicas: int | None = None

    @classmethod
    def embedded(cls, path: Path, prefix: str = "cdc") -> Backend:
        return cls("embedded", path, prefix)

    @classmethod
    def kafka(cls, bootstrap: str, path: Path, *, brokers: int = 1) -> Backend:
        replicated = brokers >= 3
        return cls("kafka", path, f"k{next(_prefixes)}x{abs(hash(path)) % 10**6}", bootstrap,
                   3 if replicated else None, 2 if replicated else None)  # fmt: skip

    def elsewhere(self, path: Path) -> Backend:
        """A backend of the same kind (and Kafka cluster) that shares nothing with this one: the embedded
        log at ``path``; Kafka under a new topic prefix, its key state at ``path``."""
        if self.bootstrap is None:
            return Backend.embedded(path, self.prefix)
        return Backend.kafka(self.bootstrap, path, brokers=3 if self.replication_factor else 1)

    # ------------------------------------------------------------------ writing

    @contextmanager
    def sink(self) -> Iterator[tuple[Log | None, Sink | None]]:
        """What a Connector takes: ``(log, None)`` for the embedded log, ``(None, sink)`` for Kafka."""
        if self.bootstrap is None:
            with Log(self.path) as log:
                yield log, None
            return
        sink = KafkaLogSink(self.bootstrap, state_dir=self.path, replication_factor=self.replication_factor,
                            min_insync_replicas=self.min_insync_replicas)  # fmt: skip
        try:
            yield None, sink
        finally:
            sink.close()

    def run(self, config: CaptureConfig) -> Stats:
        with self.sink() as (log, sink):
            return Connector(config, log, sink=sink).run()

    def position(self, dsn: str, slot: str, *, take_over: bool = False) -> SourcePosition | None:
        """The stored position, read_committed. ``take_over`` (Kafka; for a connector that was killed): as
        a restarted connector finds it, after what the restart does first, ``init_transactions`` under the
        connector's transactional id, which aborts the transaction a killed run left open and waits for
        the markers of its last commit; until then a read_committed read stops at the last stable offset,
        before the position a restart would find. It fences a running connector: not while one runs."""
        with self.sink() as (log, sink):
            config = CaptureConfig(dsn=dsn, slot=slot, topic_prefix=self.prefix)
            if sink is not None and take_over:
                sink.open(f"capture.{config.connector_id}")
            return Connector(config, log, sink=sink).read_position()

    def held_open(self) -> int:
        """Partitions of the connector's topics whose last stable offset is below their end: an open
        transaction holds records there that no read_committed reader sees (right after a kill: records
        the restart aborts). Ask before anything takes the dead connector's place (``position(take_over)``)."""
        if self.bootstrap is None:
            with Log(self.path) as log:
                return sum(log.partition(t, p).last_stable_offset() < log.partition(t, p).log_end_offset()
                           for t in self.topics() for p in range(log.topic(t).partitions))  # fmt: skip
        admin = KafkaAdmin(self.bootstrap)
        return sum(i.last_stable_offset < i.high_watermark for t in self.topics() for i in admin.describe(t)[1])

    def argv(self) -> list[str]:
        """The backend for a child process (see ``connector_for`` below)."""
        return [self.kind, str(self.path), self.bootstrap or "", str(self.replication_factor or ""),
                str(self.min_insync_replicas or "")]  # fmt: skip

    # ------------------------------------------------------------------ reading

    def topics(self) -> list[str]:
        """The connector's topics (internal ones left out)."""
        if self.bootstrap is None:
            with Log(self.path) as log:
                return sorted(t for t in log.topics() if not t.startswith("_"))
        return sorted(t for t in KafkaAdmin(self.bootstrap).topics() if t.startswith(self.prefix + "."))

    def partitions(self, topic: str) -> int:
        if self.bootstrap is None:
            with Log(self.path) as log:
                return log.topic(topic).partitions if topic in log.topics() else 0
        admin = KafkaAdmin(self.bootstrap)
        return admin.topic(topic).partitions if topic in admin.topics() else 0

    def records(self, topic: str, isolation: str = "read_committed") -> list[Record]:
        """(partition, key, value) of every record of ``topic``, partition by partition, in offset order."""
        out: list[Record] = []
        for p in range(self.partitions(topic)):
            out += [(p, k, v) for k, v in self.partition_records(topic, p, isolation)]
        return out

    def partition_records(self, topic: str, partition: int, isolation: str) -> list[tuple[bytes | None, bytes | None]]:
        if self.bootstrap is None:
            rows: list[tuple[bytes | None, bytes | None]] = []
            with Log(self.path) as log, Consumer(log, isolation_level=isolation, enable_auto_commit=False) as c:
                c.assign([TopicPartition(topic, partition)])
                c.seek_to_beginning()
                while batch := c.poll(timeout_ms=0):
                    rows += [(r.key, r.value) for r in batch]
            return rows
        return kafka_partition(self.bootstrap, topic, partition, isolation)


Pair = tuple[bytes | None, bytes | None]  # key, value


def kafka_partition(bootstrap: str, topic: str, partition: int, isolation: str) -> list[Pair]:
    """Every record of one Kafka partition under ``isolation``, to its end (the LSO for read_committed)."""
    if isolation == "read_committed":
        settled(bootstrap, topic, partition)
    consumer = KafkaConsumer(client_config(bootstrap, group_id="capture-tests", enable_auto_commit=False,
                                           isolation_level=isolation, enable_partition_eof=True,
                                           auto_offset_reset="earliest"))  # fmt: skip
    rows: list[Pair] = []
    try:
        consumer.assign([KafkaTopicPartition(topic, partition, 0)])
        while True:
            msg = consumer.poll(30)
            if msg is None:
                raise AssertionError(f"no end of {topic}[{partition}] from Kafka within 30 s")
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return rows
                raise AssertionError(f"reading {topic}[{partition}]: {err}")
            rows.append((msg.key(), msg.value()))
    finally:
        consumer.close()


def settled(bootstrap: str, topic: str, partition: int, timeout_s: float = 30.0) -> None:
    """Wait until no transaction is open on the partition (last stable offset = high watermark): Kafka
    writes a commit's markers just after the commit returns, so a reader right after a connector
    finished could otherwise miss its last batch. A partition held open longer fails the test."""
    admin = KafkaAdmin(bootstrap)
    deadline = time.monotonic() + timeout_s
    while True:
        info = admin.describe(topic)[1][partition]
        if info.last_stable_offset >= info.high_watermark:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{topic}[{partition}]: a transaction stayed open for {timeout_s:.0f} s: {info}")
        time.sleep(0.05)


# The fault tests' table: ``t (id int PRIMARY KEY, v int)``, one transaction per change.


def insert_rows(dsn: str, first: int, count: int, pause_s: float = 0.0) -> None:
    """One transaction per row: an insert, then an update of the row before it."""
    with psycopg.connect(dsn, autocommit=True) as c:
        for i in range(first, first + count):
            c.execute("INSERT INTO t VALUES (%s, 0)", (i,))
            if i > first:
                c.execute("UPDATE t SET v = v + 1 WHERE id = %s", (i - 1,))
            if pause_s:
                time.sleep(pause_s)


def assert_each_change_once(backend: Backend, dsn: str) -> int:
    """Every row's insert exactly once in the topic, and the latest value per key equals the table."""
    topic = f"{backend.prefix}.public.t"
    inserts: dict[int, int] = {}
    latest: dict[int, dict[str, int]] = {}
    for _, key, value in backend.records(topic):
        assert key is not None
        k = json.loads(key)["id"]
        if value is None:
            continue
        change = json.loads(value)
        if change["op"] in ("c", "r"):
            inserts[k] = inserts.get(k, 0) + 1
        latest[k] = change["after"]
    with psycopg.connect(dsn) as c:
        table = {row[0]: {"id": row[0], "v": row[1]} for row in c.execute("SELECT id, v FROM t")}
    twice = {k: n for k, n in inserts.items() if n > 1}
    assert not twice, f"inserts stored more than once: {list(twice.items())[:5]}"
    assert latest == table, f"{len(set(table) - set(latest))} rows missing, {len(set(latest) - set(table))} extra"
    return len(table)


def stored_equal(backend: Backend, dsn: str, alive: subprocess.Popen[bytes] | threading.Thread, timeout: float) -> None:
    """Wait until the topic holds the table (latest value per key), while ``alive`` captures."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert_each_change_once(backend, dsn)
            return
        except AssertionError as e:
            running = alive.poll() is None if isinstance(alive, subprocess.Popen) else alive.is_alive()
            if not running or time.monotonic() > deadline:
                raise AssertionError(f"capture stopped or did not catch up: {e}") from e
            time.sleep(0.5)


CHILD_SINK = r"""
def connector_for(config, kind, path, bootstrap, rf, isr):
    from capture.connector import Connector
    if kind == "embedded":
        from eventstore.log import Log
        log = Log(path)
        return Connector(config, log)
    from pathlib import Path
    from capture.sinks.kafka import KafkaLogSink
    sink = KafkaLogSink(bootstrap, state_dir=Path(path), replication_factor=int(rf) if rf else None,
                        min_insync_replicas=int(isr) if isr else None)
    return Connector(config, sink=sink)
"""
