"""Apache Kafka as capture's sink: transactional producers, the position in the same Kafka transaction.

What a Debezium user expects of a connector writing to Kafka, with Kafka's exactly-once
machinery instead of Kafka Connect's offsets topic:

- **One transaction per log batch.** A batch's events (many Postgres transactions, or a
  slice of a huge one) and the connector's position record (``__tideline_capture_offsets``,
  compacted, keyed by the connector) are produced by one transactional producer and
  committed together: ``read_committed`` consumers see both or neither. Batches alternate
  between two producers (``transactional.id`` = the connector's identity, and that plus
  ``#1``; :data:`PRODUCERS` says why), one transaction at a time, so offsets follow commit
  order. Appends do not wait; :meth:`KafkaLogSink.commit` flushes, and returns only after
  Kafka's commit returned (``acks=all``, idempotence, and the topics'
  ``min.insync.replicas``); only then does the connector confirm the flush LSN to Postgres.
- **Hanging transactions** (with transactions protocol v1 a batch committed around a
  coordinator restart can stay without its commit marker) are watched for: after an outage the
  sink waits for every committed batch's markers, and a producer whose batch hangs writes alone
  until its next write has ended it; the hang is logged (:class:`Unsettled`).
- **One writer.** :meth:`KafkaLogSink.open` runs ``init_transactions`` for both ids: a
  predecessor's open transaction is aborted and a zombie with the same identity is fenced —
  its next call raises :class:`~eventstore.errors.ProducerFencedError` ("another instance
  took over"), which stops it.
- **Placement**: Kafka's murmur2 of the key bytes, computed here
  (:func:`eventstore.partitioner.partitions_for_keys`) and passed explicitly, so a key
  lands where a Java client and the embedded log put it; keyless records of one batch go
  to one partition, the next in round-robin order from a random start.
- **Topics** are created on first sight with the embedded log's settings mapped to
  Kafka's (:func:`eventstore.kafka.config.topic_configs`: ``cleanup.policy``,
  ``delete.retention.ms``, ``min.compaction.lag.ms``, …, all explicit), plus
  ``replication_factor`` / ``min_insync_replicas`` when given; an existing topic whose
  cleanup policy contradicts what capture writes is refused (nothing is written).
- **Reads** (the position at start, the key state's catch-up) are ``read_committed``
  and bounded by the last stable offset; ``read_last`` on the positions topic reads its
  one compacted partition.

Local state (the key state: live keys, big rows for TOAST fill, outbox versions) lives in
``state_dir``; it is rebuilt from the Kafka topics when it is missing, damaged, or
belongs to an older incarnation of a topic (Kafka's topic id).

Thread-safety: none; used by the connector thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from capture.sinks import Headers, ReadBatch, RoundRobin, TopicRecords, TopicSpec, check_cleanup_policy
from eventstore.errors import ConfigError, TidelineError, TopicExistsError, UnknownTopicError
from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader
from eventstore.kafka.schema_store import KafkaSchemaStore
from eventstore.offsets import TopicPartition
from eventstore.partitioner import partitions_for_keys
from eventstore.record_batch import Codec
from eventstore.topic import TopicConfig, TopicMetadata
from schemas.registry import SchemaStore

log = logging.getLogger("capture.sink")

TRANSACTION_TIMEOUT_MS = 120_000  # a batch (and a snapshot chunk) commits well within it; broker cap: 15 min
LINGER_MS = 5
# Transactions alternate between this many transactional producers (ids ``ID`` and ``ID#1``). A
# producer's first write of a transaction registers its partitions with the coordinator
# (AddPartitionsToTxn: librdkafka speaks transactions v1); until the previous transaction's commit
# markers are written, the coordinator answers CONCURRENT_TRANSACTIONS and librdkafka retries after a
# fixed 20 ms. Back-to-back batches of one producer met that on 3-8 % of commits (commit p99 33 ms,
# commit → readable p99 63 ms at 10k changes/s); the other producer's previous transaction ended a
# whole batch earlier. Order is kept: a transaction's first record is sent after the previous commit
# returned, so offsets follow commit order, as with one producer (Flink's Kafka sink pools
# transactional ids the same way). The price is the guard of :class:`Unsettled` (below).
PRODUCERS = 2
# A commit (the flush of what the transaction sent, then EndTxn) that took longer than this met an
# unavailable broker or coordinator: the sink waits up to OUTAGE_SETTLE_S for every committed batch
# to settle (Unsettled). A healthy commit takes milliseconds: the appends were sent as they came.
SLOW_COMMIT_S = 1.0
OUTAGE_SETTLE_S = 3.0
# A committed batch whose partition's last stable offset has not passed it after this long hangs.
HANGING_AFTER_S = 5.0
# How often the sink asks the last stable offsets of the partitions with unsettled batches (one
# ListOffsets round inside a commit): while one producer writes alone, and otherwise (a hang is then
# seen 5-10 s after its commit; asking more often would only cost the capture loop more rounds).
CHECK_PINNED_S = 0.1
CHECK_EVERY_S = HANGING_AFTER_S

# A partition held this long by a transaction that is not one of this sink's batches (another
# connector's on the shared positions topic, or one of ours that was aborted) is reported: Kafka
# aborts a transaction after its timeout, so one open for twice ours is hanging.
FOREIGN_HANGING_AFTER_S = 2 * TRANSACTION_TIMEOUT_MS / 1000


@dataclass(frozen=True, slots=True)
class Batch:
    """The records one commit placed in one partition: offsets ``[first, end)``, written by producer
    number ``producer``; ``committed_s`` is ``time.monotonic()`` when the commit returned."""

    first: int
    end: int
    producer: int
    committed_s: float


@dataclass(frozen=True, slots=True)
class Held:
    """A partition whose last stable offset stays at ``offset``: the first record of a transaction
    that has no marker there. ``producer`` is the sink's producer that wrote it, or None when the
    records there are not one of this sink's committed batches."""

    topic: str
    partition: int
    offset: int
    producer: int | None
    for_s: float


class Unsettled:
    """The committed batches whose partition's last stable offset (LSO) has not passed them yet,
    and the guard of the two producers against a **hanging transaction**.

    Around a restart of the transaction coordinator, a transaction with librdkafka (it speaks
    Kafka's transactions protocol v1) can end committed without its commit marker in one of its
    partitions (docs/capture.md: the whole-cluster restart test, about 1 run in 10 with two
    producers; the batch was committed just before the broker stopped). That batch stays open, and
    so does the LSO at its first offset: ``read_committed`` readers stall there until the same
    producer writes that partition again (its next marker there ends whatever it has open). With
    one producer the backlog after a restart does that at once; with two, the other producer may
    take the backlog. So the sink (:meth:`KafkaLogSink._after_outage`):

    - after a commit that spanned an outage (slower than :data:`SLOW_COMMIT_S`), or a reopen
      after a failure, waits up to
      :data:`OUTAGE_SETTLE_S` for every committed batch to settle; a batch of ours at whose first
      offset its partition's LSO still stays is **hanging**: its producer is **pinned** (writes
      every transaction alone, so the backlog is its next write) until every batch unsettled at
      that moment is settled, and the hang is reported (the sink logs a warning naming topic,
      partition and offset);
    - otherwise, a batch unsettled for ``hanging_after_s`` (:data:`HANGING_AFTER_S`) is hanging
      the same way (the sink asks every :data:`CHECK_EVERY_S`);
    - a partition held for ``foreign_after_s`` (:data:`FOREIGN_HANGING_AFTER_S`) at an offset
      that is none of this sink's batches is reported once too; it is not this sink's to heal.

    A pinned producer heals a partition only by writing to it again: one that never receives
    another change stays held (with one producer too), and the warning is what is left; Kafka's
    ``kafka-transactions.sh find-hanging`` lists the same, and its ``abort`` would drop the records.

    Pure bookkeeping, no Kafka call: the sink feeds it commits and last stable offsets.
    """

    MAX_BATCHES = 10_000  # per partition; past it the newest merge (only the oldest's producer matters)

    def __init__(
        self, *, hanging_after_s: float = HANGING_AFTER_S, foreign_after_s: float = FOREIGN_HANGING_AFTER_S
    ) -> None:
        self.hanging_after_s = hanging_after_s
        self.foreign_after_s = foreign_after_s
        self._batches: dict[tuple[str, int], deque[Batch]] = {}
        self._held_since: dict[tuple[str, int], tuple[int, float]] = {}  # tp → (LSO, first seen at)
        self._reported: set[tuple[str, int, int]] = set()
        self._pinned_until: dict[tuple[str, int], int] = {}
        self.pinned: int | None = None

    def committed(self, producer: int, placed: Mapping[tuple[str, int], tuple[int, int]], now: float) -> None:
        """Producer number ``producer``'s commit returned at ``now`` having placed ``placed``
        (``{(topic, partition): (first offset, count)}``)."""
        for tp, (first, count) in placed.items():
            if count <= 0:
                continue
            batches = self._batches.setdefault(tp, deque())
            if len(batches) >= self.MAX_BATCHES:
                last = batches.pop()
                batches.append(Batch(last.first, first + count, last.producer, last.committed_s))
            else:
                batches.append(Batch(first, first + count, producer, now))

    def pin(self, producer: int) -> None:
        """Producer number ``producer`` writes alone until every batch unsettled now is settled."""
        self.pinned = producer
        for tp, batches in self._batches.items():
            if batches:
                self._pinned_until[tp] = max(self._pinned_until.get(tp, 0), batches[-1].end)

    def partitions(self) -> list[tuple[str, int]]:
        """The partitions whose LSO the sink should ask for: those with unsettled batches (a pin's
        partitions among them: it ends once their batches of its moment are settled)."""
        return list(self._batches)

    def next_turn(self, turn: int, producers: int) -> int:
        return self.pinned if self.pinned is not None else (turn + 1) % producers

    def settle(
        self, stable: Mapping[tuple[str, int], int], now: float, *, hanging_after_s: float | None = None
    ) -> list[Held]:
        """Take the partitions' last stable offsets ``stable`` asked at ``now``: batches they passed
        are settled; returns what is newly found held (each partition and offset once).
        ``hanging_after_s``: instead of the instance's (0 after an outage: whatever has not
        settled by now hangs)."""
        hanging_after = self.hanging_after_s if hanging_after_s is None else hanging_after_s
        found: list[Held] = []
        for tp, lso in stable.items():
            until = self._pinned_until.get(tp)
            if until is not None and lso >= until:
                del self._pinned_until[tp]
            batches = self._batches.get(tp)
            if batches is None:
                continue
            while batches and batches[0].end <= lso:
                batches.popleft()
            if not batches:
                del self._batches[tp]
                self._held_since.pop(tp, None)
                continue
            oldest = batches[0]
            if oldest.first <= lso:  # our batch is the one with no marker
                held = Held(tp[0], tp[1], lso, oldest.producer, now - oldest.committed_s)
                if held.for_s < hanging_after:
                    continue
                if self.pinned != oldest.producer:
                    self.pin(oldest.producer)
            else:  # held before our oldest batch, by records that are not one of our commits
                offset, since = self._held_since.get(tp, (lso, now))
                if offset != lso:  # moved on since: held again, from now
                    since = now
                self._held_since[tp] = (lso, since)
                held = Held(tp[0], tp[1], lso, None, now - since)
                if held.for_s < self.foreign_after_s:
                    continue
            if (held.topic, held.partition, held.offset) not in self._reported:
                self._reported.add((held.topic, held.partition, held.offset))
                found.append(held)
        if self.pinned is not None and not self._pinned_until:
            self.pinned = None
        return found


class KafkaLogSink:
    """Capture's sink over the Kafka cluster at ``bootstrap_servers``."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        state_dir: Path,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if replication_factor is not None and replication_factor < 1:
            raise ConfigError(f"--replication-factor must be ≥ 1, not {replication_factor}")
        if min_insync_replicas is not None and min_insync_replicas > (replication_factor or min_insync_replicas):
            raise ConfigError(
                f"--min-insync-replicas {min_insync_replicas} exceeds --replication-factor {replication_factor}: "
                "no write with acks=all could ever succeed"
            )
        self.bootstrap_servers = bootstrap_servers
        self.state_dir = state_dir
        self.replication_factor = replication_factor
        self.min_insync_replicas = min_insync_replicas
        self.timeout_s = timeout_s
        self.admin = KafkaAdmin(bootstrap_servers, timeout_s=timeout_s)
        self.producers: list[KafkaProducer] = []  # PRODUCERS of them once open; transactions alternate
        self._turn = 0
        self.unsettled = Unsettled()
        self._next_check = 0.0
        self._reader: KafkaReader | None = None
        self._schemas: KafkaSchemaStore | None = None
        self._partitions: dict[str, int] = {}
        self._round_robin = RoundRobin()
        self._compression: str | None = None  # None: the producer's default (none)

    def describe(self) -> str:
        return f"Kafka at {self.bootstrap_servers}"

    def set_compression(self, codec: str | None) -> None:
        self._compression = None if codec is None else Codec.parse(codec).name.lower()  # librdkafka's names

    def open(self, transactional_id: str) -> None:
        """Become the writer with this identity: the producers of ``transactional_id`` and
        ``transactional_id#1`` (see :data:`PRODUCERS`), each ``init_transactions``: what a killed
        predecessor left open under either id is aborted, and a zombie holding either is fenced."""
        self._close_producers()
        for i in range(PRODUCERS):
            producer = KafkaProducer(
                self.bootstrap_servers,
                transactional_id=transactional_id if i == 0 else f"{transactional_id}#{i}",
                transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
                linger_ms=LINGER_MS,
                timeout_s=self.timeout_s,
                **({"compression_type": self._compression} if self._compression is not None else {}),
            )
            self.producers.append(producer)
            producer.init_transactions()  # aborts what a killed predecessor left open, fences zombies
        self._after_outage("the producers were opened again after a failure")
        self._turn = self.unsettled.pinned or 0

    def _producer(self) -> KafkaProducer:
        """The producer whose turn it is: the open transaction's, or the next one's."""
        if not self.producers:
            raise RuntimeError("sink not opened")
        return self.producers[self._turn]

    def _close_producers(self) -> None:
        for producer in self.producers:
            producer.close()
        self.producers = []

    # ------------------------------------------------------------------ topics

    def ensure_topic(self, topic: str, spec: TopicSpec) -> int:
        n = self._partitions.get(topic)
        if n is not None:
            return n
        overrides = {**({"cleanup_policy": "compact"} if spec.compact else {}), **spec.overrides}
        if topic not in self.admin.topics():
            try:
                self.admin.create_topic(
                    topic,
                    spec.partitions,
                    TopicConfig(),
                    overrides=dict(overrides),
                    replication_factor=self.replication_factor,
                    min_insync_replicas=self.min_insync_replicas,
                )
                log.info("capture: created Kafka topic %s (%d partitions, %s)", topic, spec.partitions, overrides)
            except TopicExistsError:
                pass  # created meanwhile by another process: checked below like any other
        meta = self._topic(topic)
        check_cleanup_policy(topic, spec, meta.config.cleanup_policy, what="Kafka topic", setting="cleanup.policy")
        self._partitions[topic] = meta.partitions
        return meta.partitions

    def _topic(self, topic: str) -> TopicMetadata:
        """The topic's metadata; a topic just created may be unknown to the broker asked for a moment
        (metadata reaches each broker of a cluster on its own time): asked again until ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self.admin.topic(topic)
            except UnknownTopicError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def topic_incarnation(self, topic: str) -> str | None:
        """Kafka's topic id. A topic this sink ensured exists: asked again while the broker asked does
        not know it yet (a None here would read as "another incarnation" on the next start)."""
        deadline = time.monotonic() + self.timeout_s
        while (found := self.admin.topic_id(topic)) is None and topic in self._partitions:
            if time.monotonic() >= deadline:
                raise UnknownTopicError(topic)
            time.sleep(0.1)
        return found

    # ------------------------------------------------------------------ writing

    def begin(self) -> None:
        self._producer().begin_transaction()

    def append(
        self, batch: Mapping[str, TopicRecords], *, also: Iterable[tuple[str, int]] = ()
    ) -> dict[tuple[str, int], int]:
        """Produce the batch inside the open transaction without waiting: the acknowledgements are
        taken at :meth:`commit` (``commit_transaction`` flushes, and fails if a record failed), so
        a batch costs one wait, not two. librdkafka adds the partitions to the transaction as it
        sends: ``also`` needs nothing. Returns ``{}``: the offsets come with the commit."""
        plan: list[tuple[str, int, Sequence[bytes | None], Sequence[bytes | None], Sequence[Headers | None] | None]]
        plan = []
        for topic, records in batch.items():
            if not len(records):
                continue
            n = self._partitions.get(topic) or self.ensure_known(topic)
            (keys, values), headers = records.lists(), records.headers
            if n == 1 or all(k is None for k in keys):
                target = 0 if n == 1 else self._round_robin.next(topic, n)
                plan.append((topic, target, keys, values, headers))
                continue
            parts = partitions_for_keys(pa.array(keys, pa.binary()), n)
            if (parts < 0).any():  # keyless records among keyed ones: one partition for them
                parts[parts < 0] = self._round_robin.next(topic, n)
            for p in np.unique(parts).tolist():
                idx = np.flatnonzero(parts == p).tolist()
                plan.append((
                    topic,
                    int(p),
                    [keys[i] for i in idx],
                    [values[i] for i in idx],
                    [headers[i] for i in idx] if headers is not None else None,
                ))
        if plan:
            self._producer().send_many(plan, wait=False)
        return {}

    def ensure_known(self, topic: str) -> int:
        """The partition count of a topic capture did not create in this run (it exists: ensure_topic ran)."""
        n = self._partitions[topic] = self._topic(topic).partitions
        return n

    def commit(self, position_topic: str, key: bytes | None, value: bytes | None) -> dict[tuple[str, int], int]:
        producer = self._producer()
        started = time.monotonic()
        if value is not None:
            producer.send_many([(position_topic, 0, [key], [value], None)], wait=False)
        producer.commit_transaction()  # returns once Kafka committed: only then is the LSN confirmed
        placed = producer.take_delivered()
        now = time.monotonic()
        self.unsettled.committed(self._turn, placed, now)
        if now - started > SLOW_COMMIT_S:
            self._after_outage(f"a Kafka commit took {now - started:.1f} s")
        elif now >= self._next_check:
            self._ask_settled()
        self._turn = self.unsettled.next_turn(self._turn, len(self.producers))
        placed.pop((position_topic, 0), None)
        return {tp: first + count for tp, (first, count) in placed.items()}

    def _after_outage(self, what: str) -> None:
        """After a broker or the coordinator was unavailable (``what`` says how it showed): wait up
        to :data:`OUTAGE_SETTLE_S` for every committed batch to settle; one that does not is
        hanging, and its producer writes the next transactions alone (the backlog after the
        outage is its next write, which ends the hang)."""
        if not self.unsettled.partitions():
            return
        log.info(
            "capture: %s (a broker or the coordinator was unavailable?): waiting up to %.0f s for the commit "
            "markers of every committed batch", what, OUTAGE_SETTLE_S,
        )  # fmt: skip
        deadline = time.monotonic() + OUTAGE_SETTLE_S
        while self.unsettled.partitions():
            time.sleep(CHECK_PINNED_S)
            last = time.monotonic() >= deadline
            self._ask_settled(hanging_after_s=0.0 if last else None)  # the last ask: what is left hangs
            if last:
                return

    def _ask_settled(self, *, hanging_after_s: float | None = None) -> None:
        """Ask the last stable offsets of the partitions with unsettled batches and feed them to
        :class:`Unsettled`; the next ask is due in :data:`CHECK_EVERY_S` (:data:`CHECK_PINNED_S`
        while one producer writes alone). A commit has already succeeded: a failure to ask is
        logged and asked again later."""
        pinned = self.unsettled.pinned
        partitions = self.unsettled.partitions()
        stable: Mapping[tuple[str, int], int] = {}
        if partitions:
            try:
                stable = self.admin.end_offsets(partitions, read_committed=True)
            except TidelineError as e:
                log.warning("capture: could not ask Kafka's last stable offsets (asked again later): %s", e)
        for held in self.unsettled.settle(stable, time.monotonic(), hanging_after_s=hanging_after_s):
            if held.producer is None:
                log.warning(
                    "capture: Kafka topic %s partition %d has been held at offset %d for %.0f s by a transaction "
                    "that is not one of this connector's commits: read_committed readers stop there. A hanging "
                    "transaction? kafka-transactions.sh find-hanging names it",
                    held.topic, held.partition, held.offset, held.for_s,
                )  # fmt: skip
            else:
                log.warning(
                    "capture: a hanging Kafka transaction: topic %s partition %d holds at offset %d, a batch "
                    "producer %s committed %.1f s ago without a commit marker there (transactions protocol v1 "
                    "after a coordinator restart); that producer now writes alone: its next write to the "
                    "partition ends it. read_committed readers stop there until then",
                    held.topic, held.partition, held.offset, self._producer_id(held.producer), held.for_s,
                )  # fmt: skip
        if pinned is not None and self.unsettled.pinned is None:
            log.info("capture: every batch settled; Kafka transactions alternate between the producers again")
        interval = CHECK_PINNED_S if self.unsettled.pinned is not None else CHECK_EVERY_S  # after a new pin too
        self._next_check = time.monotonic() + interval

    def _producer_id(self, number: int) -> str:
        if number < len(self.producers):
            return str(self.producers[number].transactional_id)
        return f"#{number}"

    def abort(self) -> None:
        self._producer().abort_transaction()

    # ------------------------------------------------------------------ reading

    def _reader_(self) -> KafkaReader:
        if self._reader is None:
            self._reader = KafkaReader(self.bootstrap_servers, timeout_s=self.timeout_s)
        return self._reader

    def end_offsets(self, topic: str) -> dict[int, int]:
        """The last stable offsets, once no transaction is open on the topic's partitions (up to
        ``timeout_s``): a commit's markers land just after it returned, and the key state catching
        up must read a batch whole. Only this connector writes these topics, and it calls this
        before it writes to a topic in its own open transaction (a predecessor's was aborted by
        ``open``), so the wait is short."""
        if topic not in self._partitions and topic not in self.admin.topics():
            return {}
        deadline = time.monotonic() + self.timeout_s
        while True:
            stable = self.admin.stable_offsets(topic)
            if stable == self.admin.high_watermarks(topic) or time.monotonic() >= deadline:
                return stable
            time.sleep(0.05)

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[ReadBatch]:
        if start >= end:
            return
        reader = self._reader_()
        tp = TopicPartition(topic, partition)
        low, _ = reader.end_offsets(tp)
        for chunk in reader.read_chunks_to_end(tp, max(start, low)):
            n = len(chunk.offsets)
            stop = n
            while stop and chunk.offsets[stop - 1] >= end:
                stop -= 1
            if stop:
                yield ReadBatch(chunk.offsets[:stop], chunk.keys[:stop], chunk.values[:stop])
            if stop < n or (n and chunk.offsets[-1] >= end - 1):
                return

    def read_last(self, topic: str, partition: int, key: bytes) -> bytes | None:
        if topic not in self.admin.topics():
            return None
        found: bytes | None = None
        for chunk in self._reader_().read_chunks_to_end(TopicPartition(topic, partition)):
            for k, v in zip(chunk.keys, chunk.values, strict=True):
                if k == key:
                    found = v
        return found

    def schema_store(self) -> SchemaStore:
        """The cluster's ``_schemas`` topic (Confluent's layout: ``tideline schemas serve --kafka`` serves it)."""
        if self._schemas is None:
            self._schemas = KafkaSchemaStore(self.bootstrap_servers, timeout_s=self.timeout_s)
        return self._schemas

    def default_state_dir(self) -> Path:
        return self.state_dir

    def close(self) -> None:
        if self._schemas is not None:
            self._schemas.close()
            self._schemas = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._close_producers()
