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
  Streaming runs that commit in the writer's committer thread while it decodes the next batch into
  memory (:attr:`KafkaLogSink.commits_behind`, capture.writer): the next transaction's first record
  is still sent only after it returned.
- **Starting.** Both producers' ``init_transactions`` run side by side, and the producers and the
  reader connect to every broker the metadata names at once (``enable.sparse.connections=false``):
  a restart reaches its first change in about 0.2 s (it took 0.8 s, most of it librdkafka's waits
  for on-demand connections).
- **Commit markers Kafka skipped.** Kafka's transaction coordinator skips the markers of a
  partition that has no leader when it writes them and completes the transaction anyway (a
  one-broker cluster restarted just after a commit; a partition's only replica lost): the batch
  stays open there, read_committed readers stop at it, and the same producer's next ABORT there
  would drop it. So a producer sends to a partition only once its earlier batches there have
  their markers, and the sink writes the COMMIT marker of a batch of ours still open after
  :data:`MARKER_GRACE_S` itself (:class:`Unsettled`, docs/capture.md "Kafka transactions and the
  double fault").
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

Thread-safety: none; used by one thread at a time: the connector thread, or the writer's committer thread for
one :meth:`KafkaLogSink.commit` while the connector thread leaves the sink alone (capture.writer).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from capture.native.kafka import NATIVE, NativeKafkaProducer, ProducerMode, choose, librdkafka_version
from capture.sinks import Headers, ReadBatch, RoundRobin, TopicRecords, TopicSpec, check_cleanup_policy
from eventstore.errors import ConfigError, ProducerFencedError, TidelineError, TopicExistsError, UnknownTopicError
from eventstore.kafka import KafkaAdmin, KafkaProducer, KafkaReader
from eventstore.kafka.schema_store import KafkaSchemaStore
from eventstore.kafka.txn_markers import StableOffsets, TxnMarkers
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
# transactional ids the same way). Either way a producer sends to a partition only once its earlier
# batches there have their commit markers (:class:`Unsettled`).
PRODUCERS = 2
# A commit (the flush of what the transaction sent, then EndTxn) that took longer than this met an
# unavailable broker or coordinator: the sink then waits up to OUTAGE_SETTLE_S for every committed
# batch's markers and writes the ones still missing. A healthy commit takes milliseconds.
SLOW_COMMIT_S = 1.0
OUTAGE_SETTLE_S = 3.0
# A batch of ours at whose first offset its partition's last stable offset (LSO) still stays this long
# after its commit lost its markers (the coordinator writes them within milliseconds, p99 22 ms and at
# most 56 ms in the probes of docs/capture.md): the sink writes its COMMIT marker. Writing one for a
# batch whose markers are merely late is harmless (the coordinator's own then finds nothing open).
MARKER_GRACE_S = 2.0
# How often the sink asks the LSOs of partitions with unsettled batches when nothing else asks (a
# partition that receives no further write gets a lost marker written within about this long).
CHECK_EVERY_S = 5.0
POLL_S = 0.02  # between asks while a producer waits for its own batch's markers
CHECK_TIMEOUT_S = 2.0  # what a check (after a commit, not in a producer's way) may spend on the partitions' leaders
PREFETCH_WAIT_S = 0.05  # how long the answer asked during the last commit is waited for before asking anew

# A partition held this long by a transaction that is not one of this sink's batches (another
# connector's on the shared positions topic, or a stranger's) is reported: Kafka aborts a transaction
# after its timeout, so one open for twice ours is hanging. It is not ours to end.
FOREIGN_HANGING_AFTER_S = 2 * TRANSACTION_TIMEOUT_MS / 1000

TP = tuple[str, int]
BATCHES_FILE_VERSION = 1
SAVE_IN_PLACE_BYTES = 4000  # the batches file's text written in place up to this (inside one page: _save)
ANY = -1  # the producer of merged batches (Unsettled.MAX_BATCHES): owed by every producer


class TransactionTimedOutError(ProducerFencedError):
    """Kafka's coordinator aborted the sink's open transaction because it outlived ``transaction.timeout.ms``
    (:data:`TRANSACTION_TIMEOUT_MS`), and fenced the producer: retrying the same transaction cannot help."""


def timed_out(e: ProducerFencedError, age_s: float) -> TransactionTimedOutError:
    """The fencing ``e``, met by a transaction open ``age_s`` seconds, said as what it is."""
    return TransactionTimedOutError(
        f"Kafka aborted this connector's transaction: it had been open {age_s:.0f} s, past its transaction.timeout.ms "
        f"({TRANSACTION_TIMEOUT_MS // 1000} s), so the coordinator ended it and fenced the producer ({e}). An "
        "initial snapshot into Kafka is one Kafka transaction (read_committed readers see all of it or none): a "
        "snapshot that takes longer cannot commit into Kafka. Start with --snapshot never --signal-table "
        "public.tideline_signal and snapshot the big tables incrementally (tideline capture snapshot --tables …): "
        "chunk by chunk, each committed with its position, resumed where a stop left it (docs/capture.md, "
        "\"Snapshots into Kafka\")"
    )


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
    """A partition whose last stable offset stays at ``offset`` because of an open transaction that is
    none of this sink's batches, for ``for_s`` seconds."""

    topic: str
    partition: int
    offset: int
    for_s: float


class Unsettled:
    """The batches this sink committed whose commit markers are not yet known to be written, per
    partition, and what the partitions' last stable offsets (LSO) say about them.

    Why it matters (docs/capture.md, "Kafka transactions and the double fault"): Kafka's transaction
    coordinator skips the markers of a partition that has no leader at the moment it writes them and
    completes the transaction anyway (a one-broker cluster stopped just after a commit; the only
    replica of a partition lost). The batch's records there stay open until the same producer's next
    marker in that partition — and if that producer's next transaction there **aborts**, its ABORT
    marker drops them with its own records, although their commit returned and their position is
    stored. So the sink keeps two rules (:class:`KafkaLogSink`):

    - a producer sends to a partition only once every batch it committed there has its marker
      (:meth:`owed` names the partitions where it has one not yet known to): its abort can then drop
      nothing but the transaction it aborts;
    - a batch of ours at whose first offset its partition's LSO stays past :data:`MARKER_GRACE_S`
      lost its markers: the sink writes its COMMIT marker itself
      (:class:`~eventstore.kafka.txn_markers.TxnMarkers`), which ends it as its coordinator decided.

    A batch is known to have its marker once the LSO passes it (:meth:`settle`), or once the
    partition's leader reports no transaction open at its first offset (:meth:`resolved`). A
    partition held before our batches by a transaction that is none of ours is reported once after
    ``foreign_after_s``: it is not this sink's to end.

    Pure bookkeeping, no Kafka call: the sink feeds it commits, last stable offsets and open
    transactions.
    """

    MAX_BATCHES = 10_000  # per partition; past it the newest merge

    def __init__(self, *, foreign_after_s: float = FOREIGN_HANGING_AFTER_S) -> None:
        self.foreign_after_s = foreign_after_s
        self._batches: dict[TP, deque[Batch]] = {}
        self._stable: dict[TP, int] = {}  # the last LSO seen of a partition with batches
        self._foreign: dict[TP, tuple[int, float]] = {}  # partition → (offset held at, first seen at)
        self._reported: set[tuple[str, int, int]] = set()

    def committed(self, producer: int, placed: Mapping[TP, tuple[int, int]], now: float) -> None:
        """Producer number ``producer``'s commit returned at ``now`` having placed ``placed``
        (``{(topic, partition): (first offset, count)}``)."""
        for tp, (first, count) in placed.items():
            if count <= 0:
                continue
            batches = self._batches.setdefault(tp, deque())
            if len(batches) >= self.MAX_BATCHES:  # merged: owed by every producer (ANY) until settled
                last = batches.pop()
                same = last.producer == producer
                batches.append(Batch(last.first, first + count, producer if same else ANY, last.committed_s))
            else:
                batches.append(Batch(first, first + count, producer, now))

    def partitions(self) -> list[TP]:
        """The partitions worth asking about: those with batches not known settled, and those held by
        a transaction that is none of ours."""
        return list(dict.fromkeys([*self._batches, *self._foreign]))

    def owed(self, producer: int, partitions: Iterable[TP]) -> list[TP]:
        """Of ``partitions``, those where producer number ``producer`` has a batch not known to have its
        commit marker: it must not send there yet."""
        return [tp for tp in partitions if any(b.producer in (producer, ANY) for b in self._batches.get(tp, ()))]

    def youngest(self, producer: int, partitions: Iterable[TP]) -> float:
        """When the newest batch producer number ``producer`` has in ``partitions`` was committed."""
        return max((b.committed_s for tp in partitions for b in self._batches.get(tp, ())
                    if b.producer in (producer, ANY)), default=0.0)  # fmt: skip

    def settle(self, stable: Mapping[TP, int], now: float) -> list[Held]:
        """Take the partitions' last stable offsets ``stable`` asked at ``now``: batches they passed
        are settled. Returns the foreign holds newly past ``foreign_after_s`` (each reported once)."""
        found: list[Held] = []
        for tp, lso in stable.items():
            held = self._foreign.get(tp)
            if held is not None and lso > held[0]:
                del self._foreign[tp]
            batches = self._batches.get(tp)
            if batches is not None:
                while batches and batches[0].end <= lso:
                    batches.popleft()
                if not batches:
                    del self._batches[tp]
                    self._stable.pop(tp, None)
                else:
                    self._stable[tp] = lso
            held = self._foreign.get(tp)
            if held is not None and now - held[1] >= self.foreign_after_s:
                key = (tp[0], tp[1], held[0])
                if key not in self._reported:
                    self._reported.add(key)
                    found.append(Held(tp[0], tp[1], held[0], now - held[1]))
        return found

    def lingering(self, now: float, grace_s: float) -> list[TP]:
        """Partitions whose LSO, last asked, stays before one of our batches committed over ``grace_s``
        ago: its markers (or the ones of what holds it) are lost or late; the leader says which."""
        return [
            tp for tp, batches in self._batches.items()
            if tp in self._stable and now - batches[0].committed_s >= grace_s
        ]  # fmt: skip

    def held_early(self, tp: TP) -> bool:
        """The partition's last LSO seen stays before our oldest batch there: whatever holds it, our
        batches' own markers cannot show in the LSO; the leader's open transactions must tell."""
        batches = self._batches.get(tp)
        return batches is not None and tp in self._stable and self._stable[tp] < batches[0].first

    def lost(self, tp: TP, open_at: Iterable[int], now: float, grace_s: float) -> list[int]:
        """The partition's leader reports transactions open at the offsets ``open_at``; returns those
        that begin inside our batches committed at least ``grace_s`` ago: their markers are lost. (One
        beginning inside a younger batch has its markers on the way.) An open transaction before our
        batches holds the partition: reported after ``foreign_after_s``."""
        starts = sorted(set(open_at))
        batches = self._batches.get(tp, deque())
        foreign = [o for o in starts if batches and o < batches[0].first]
        if foreign:
            offset, since = self._foreign.get(tp, (foreign[0], now))
            self._foreign[tp] = (foreign[0], since if offset == foreign[0] else now)
        return [o for o in starts if any(b.first <= o < b.end and now - b.committed_s >= grace_s for b in batches)]

    def marked(self, tp: TP, still_open: Iterable[int]) -> None:
        """Every batch of ours in the partition has its commit marker now but those from the first one a
        transaction still open begins in (``still_open``: their markers are on the way)."""
        batches = self._batches.get(tp)
        if batches is None:
            return
        starts = list(still_open)
        while batches and not any(batches[0].first <= o < batches[0].end for o in starts):
            batches.popleft()
        if not batches:
            del self._batches[tp]
            self._stable.pop(tp, None)

    def to_json(self) -> list[list[str | int]]:
        """The batches, ``[topic, partition, first, end, producer]`` each (what :meth:`restore` takes)."""
        return [[tp[0], tp[1], b.first, b.end, b.producer] for tp, batches in self._batches.items() for b in batches]

    def restore(self, entries: Iterable[Sequence[str | int]]) -> int:
        """Take the batches an earlier run left (:meth:`to_json`) as committed long ago; returns how many."""
        n = 0
        for topic, partition, first, end, producer in entries:
            self._batches.setdefault((str(topic), int(partition)), deque()).append(
                Batch(int(first), int(end), int(producer), 0.0)
            )
            n += 1
        return n

    def batch_at(self, tp: TP, offset: int) -> Batch | None:
        return next((b for b in self._batches.get(tp, ()) if b.first <= offset < b.end), None)


class KafkaLogSink:
    """Capture's sink over the Kafka cluster at ``bootstrap_servers``."""

    # a commit waits for the broker (the flush of the batch's last records, EndTxn: 10 ms and more under load): the
    # connector decodes the next batch meanwhile (capture.writer.LogWriter.commit_behind)
    commits_behind = True

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        state_dir: Path,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        timeout_s: float = 30.0,
        producer: ProducerMode | None = None,
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
        # the native producer (records as Arrow buffers, capture.native.kafka) or confluent-kafka's, and why
        self.producer_choice = choose(producer if producer is not None else ProducerMode.default())
        # PRODUCERS of them once open; transactions alternate
        self.producers: list[KafkaProducer | NativeKafkaProducer] = []
        self._turn = 0
        self.unsettled = Unsettled()
        self.check_every_s = CHECK_EVERY_S
        self._last_check = 0.0
        self._markers: TxnMarkers | None = None
        self._prefetched: StableOffsets | None = None  # the next producer's partitions, asked during a commit
        self._batches_file: Path | None = None  # the unsettled batches, for the next run (open)
        self._batches_fd: int | None = None  # that file, open for writes in place (_save)
        self._batches_len = 0  # its length
        self._reader: KafkaReader | None = None
        self._schemas: KafkaSchemaStore | None = None
        self._partitions: dict[str, int] = {}
        self._round_robin = RoundRobin()
        self._compression: str | None = None  # None: the producer's default (none)
        self._began = 0.0  # time.monotonic() when the open transaction began

    def describe(self) -> str:
        return f"Kafka at {self.bootstrap_servers}"

    def set_compression(self, codec: str | None) -> None:
        self._compression = None if codec is None else Codec.parse(codec).name.lower()  # librdkafka's names

    def open(self, transactional_id: str) -> None:
        """Become the writer with this identity: the producers of ``transactional_id`` and
        ``transactional_id#1`` (see :data:`PRODUCERS`), each ``init_transactions``: what a killed
        predecessor left open under either id is aborted, and a zombie holding either is fenced."""
        self._close_producers()
        choice = self.producer_choice
        if choice.reason is not None and not choice.chosen:
            log.warning("capture: Kafka producer: python (confluent-kafka, a Python call per record): %s",
                        choice.reason)  # fmt: skip
        else:
            log.info("capture: Kafka producer: %s%s", choice.path,
                     f" (librdkafka {librdkafka_version()})" if choice.path == NATIVE else f" ({choice.reason})")
        make = NativeKafkaProducer if choice.path == NATIVE else KafkaProducer
        for i in range(PRODUCERS):
            producer = make(
                self.bootstrap_servers,
                transactional_id=transactional_id if i == 0 else f"{transactional_id}#{i}",
                transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
                linger_ms=LINGER_MS,
                timeout_s=self.timeout_s,
                # connect to every broker the metadata names at once, not on demand: on demand, librdkafka's
                # transactional init waited for its next coordinator query (500 ms) in 10 of 22 inits here, when its
                # first query had gone out on the bootstrap connection that the named broker's replaced, and 50 ms
                # (its pause between on-demand connections) in the others; now 10-21 ms (one broker, both producers
                # side by side, 11 starts). A connector's producers write to most brokers anyway.
                enable_sparse_connections=False,
                **({"compression_type": self._compression} if self._compression is not None else {}),
            )
            self.producers.append(producer)
        # init_transactions aborts what a killed predecessor left open and fences zombies; the producers ask it side
        # by side (a few round trips each), not in turn.
        with ThreadPoolExecutor(max_workers=PRODUCERS, thread_name_prefix="capture-init-txn") as pool:
            inits = [pool.submit(producer.init_transactions) for producer in self.producers]
        for init in inits:
            init.result()  # the first failure raised, once both have returned
        self._turn = 0
        reopened = self._batches_file is not None
        self._close_batches_fd()
        self._batches_file = self.state_dir / f"{transactional_id}.batches.json"
        if not self.unsettled.partitions():
            self._restore()
        self._check(outage="the producers were opened again after a failure" if reopened
                    else "the last run left batches without known commit markers")  # fmt: skip

    def _producer(self) -> KafkaProducer | NativeKafkaProducer:
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
        self._began = time.monotonic()

    @contextmanager
    def _said_as_timeout(self) -> Iterator[None]:
        """A fencing met by the open transaction (appending, committing, aborting it): when the transaction had
        outlived its timeout, Kafka's coordinator aborted it, and :func:`timed_out` says so; otherwise another
        instance took over, as the fencing says."""
        try:
            yield
        except TransactionTimedOutError:
            raise
        except ProducerFencedError as e:
            age = time.monotonic() - self._began
            if age * 1000 >= TRANSACTION_TIMEOUT_MS:
                raise timed_out(e, age) from e
            raise

    def append(
        self, batch: Mapping[str, TopicRecords], *, also: Iterable[tuple[str, int]] = ()
    ) -> dict[tuple[str, int], int]:
        """Produce the batch inside the open transaction without waiting: the acknowledgements are
        taken at :meth:`commit` (``commit_transaction`` flushes, and fails if a record failed), so
        a batch costs one wait, not two. librdkafka adds the partitions to the transaction as it
        sends: ``also`` needs nothing. Returns ``{}``: the offsets come with the commit."""
        with self._said_as_timeout():
            return self._append(batch)

    def _append(self, batch: Mapping[str, TopicRecords]) -> dict[tuple[str, int], int]:
        producer = self._producer()
        if isinstance(producer, NativeKafkaProducer):
            self._append_arrays(producer, batch)
            return {}
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
            parts = self._placement(topic, pa.array(keys, pa.binary()), n)
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
            self._ensure_marked(self._turn, [(topic, partition) for topic, partition, *_ in plan])
            producer.send_many(plan, wait=False)
        return {}

    def _placement(self, topic: str, keys: pa.Array, n: int, keyless: int | None = None) -> npt.NDArray[np.int32]:
        """Each record's partition of a topic with ``n`` partitions: murmur2 of its key; the keyless ones of
        the batch all go to one partition, ``keyless`` or else the next in round-robin order."""
        if n == 1:
            return np.zeros(len(keys), np.int32)
        if keys.null_count == len(keys):
            return np.full(len(keys), self._round_robin.next(topic, n) if keyless is None else keyless, np.int32)
        parts = partitions_for_keys(keys, n)
        if (parts < 0).any():  # keyless records among keyed ones: one partition for them
            parts[parts < 0] = self._round_robin.next(topic, n) if keyless is None else keyless
        return parts

    def _append_arrays(self, producer: NativeKafkaProducer, batch: Mapping[str, TopicRecords]) -> None:
        """The native producer's append: each topic's records as Arrow arrays, chunk by chunk as the batch holds
        them (not concatenated first), and a partition per record: no Python object per record (the records of a
        partition keep their order; the keyless ones of a topic all go to one partition)."""
        planned: list[tuple[str, npt.NDArray[np.int32], pa.Array, pa.Array, Sequence[Headers | None] | None]] = []
        for topic, records in batch.items():
            if not len(records):
                continue
            n = self._partitions.get(topic) or self.ensure_known(topic)
            chunks = records.array_chunks()
            keyless = None
            if n > 1 and len(chunks) > 1 and any(k.null_count for k, _ in chunks):
                keyless = self._round_robin.next(topic, n)
            for keys, values in chunks:  # headers only ever come without chunks: one part then
                planned.append((topic, self._placement(topic, keys, n, keyless), keys, values, records.headers))
        if not planned:
            return
        touched = list(dict.fromkeys((t, int(p)) for t, parts, *_ in planned for p in np.unique(parts).tolist()))
        self._ensure_marked(self._turn, touched)
        for topic, parts, keys, values, headers in planned:
            producer.send_arrays(topic, parts, keys, values, headers)

    def ensure_known(self, topic: str) -> int:
        """The partition count of a topic capture did not create in this run (it exists: ensure_topic ran)."""
        n = self._partitions[topic] = self._topic(topic).partitions
        return n

    def commit(self, position_topic: str, key: bytes | None, value: bytes | None) -> dict[tuple[str, int], int]:
        with self._said_as_timeout():
            return self._commit(position_topic, key, value)

    def _commit(self, position_topic: str, key: bytes | None, value: bytes | None) -> dict[tuple[str, int], int]:
        producer = self._producer()
        if value is not None:
            self._ensure_marked(self._turn, [(position_topic, 0)])
        started = time.monotonic()  # the commit proper: the flush of what the transaction sent, then EndTxn
        if value is not None:
            producer.send_many([(position_topic, 0, [key], [value], None)], wait=False)
        following = (self._turn + 1) % len(self.producers)
        owed = self.unsettled.owed(following, self.unsettled.partitions())
        # asked now, answered while this commit flushes: the next producer finds its batches settled
        self._prefetched = self._markers_().ask_stable_offsets(owed) if owed else None
        producer.commit_transaction()  # returns once Kafka committed: only then is the LSN confirmed
        placed = producer.take_delivered()
        now = time.monotonic()
        self.unsettled.committed(self._turn, placed, now)
        self._save()
        self._turn = following
        if now - started > SLOW_COMMIT_S:
            took = now - started
            self._check(outage=f"a Kafka commit took {took:.1f} s (a broker or the coordinator was unavailable?)")
        elif now - self._last_check >= self.check_every_s:
            self._check()
        placed.pop((position_topic, 0), None)
        return {tp: first + count for tp, (first, count) in placed.items()}

    def _save(self) -> None:
        """Write the batches whose markers are not yet known to be written to ``state_dir``: a run that
        starts after this one died keeps the rules for them (:meth:`_restore`). Written after every
        commit, without fsync: it is for a connector killed (kill -9, a crash), not for a machine lost.

        File layout: one JSON object (``{"version": 1, "batches": [...]}``) padded with spaces to the
        length the file had. Crash policy: the usual text (up to :data:`SAVE_IN_PLACE_BYTES`, inside
        one page) is written in place by one ``pwrite`` at offset 0, which a killed process cannot tear
        (the kernel stops a write between pages only); the padding keeps a shorter text valid JSON. A
        longer text, or a file grown past twice its text, is written whole beside it and renamed over
        it. A commit at 1,000 a second paid 6 % of the connector's time for the open, rename and close."""
        path = self._batches_file
        if path is None:
            return
        data = json.dumps({"version": BATCHES_FILE_VERSION, "batches": self.unsettled.to_json()}).encode()
        try:
            if self._batches_fd is not None and len(data) <= SAVE_IN_PLACE_BYTES and (
                len(data) <= self._batches_len <= 2 * len(data) + 64
            ):
                os.pwrite(self._batches_fd, data.ljust(self._batches_len), 0)
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            self._close_batches_fd()
            if len(data) <= SAVE_IN_PLACE_BYTES:
                self._batches_fd = os.open(path, os.O_WRONLY)
                self._batches_len = len(data)
        except OSError as e:
            self._close_batches_fd()
            log.warning("capture: could not write %s (a restart would not know this run's unsettled batches): %s",
                        path, e)  # fmt: skip

    def _close_batches_fd(self) -> None:
        if self._batches_fd is not None:
            os.close(self._batches_fd)
            self._batches_fd = None

    def _restore(self) -> None:
        """Take the unsettled batches an earlier run of this connector left in ``state_dir``: a batch whose
        markers Kafka skipped stays owed by its producer, and gets its marker written, as in that run."""
        path = self._batches_file
        if path is None or not path.exists():
            return
        try:
            saved = json.loads(path.read_text())
            entries = saved["batches"] if saved.get("version") == BATCHES_FILE_VERSION else []
            existing = set(self.admin.topics())
            n = self.unsettled.restore(e for e in entries if e[0] in existing)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("capture: could not read %s (the last run's unsettled batches): %s", path, e)
            return
        if n:
            log.info("capture: %d batch(es) of the last run without known commit markers: checked first", n)

    def _markers_(self) -> TxnMarkers:
        if self._markers is None:
            self._markers = TxnMarkers(self.bootstrap_servers, timeout_s=self.timeout_s)
        return self._markers

    def _ensure_marked(self, number: int, partitions: Sequence[TP]) -> None:
        """Return once every batch producer ``number`` committed in ``partitions`` has its commit
        marker: only then may it send there (were its transaction aborted, its ABORT marker would end
        whatever that producer has open in the partition, a committed batch without its marker too).
        Asked from the partitions' last stable offsets (the answer asked during the last commit first),
        waited for up to :data:`MARKER_GRACE_S`; then the partitions' leaders say which transactions are
        open, and a batch of ours whose marker the coordinator skipped gets it written here."""
        owed = self.unsettled.owed(number, partitions)
        if not owed:
            return
        if self._prefetched is not None:  # a hint: not waited for past PREFETCH_WAIT_S
            self._feed(self._prefetched.result(PREFETCH_WAIT_S))
            self._prefetched = None
            owed = self.unsettled.owed(number, owed)
        deadline = self.unsettled.youngest(number, owed) + MARKER_GRACE_S  # every batch of it had the grace
        while owed:
            self._feed(self._stable_offsets(owed, max(deadline - time.monotonic(), PREFETCH_WAIT_S)))
            owed = self.unsettled.owed(number, owed)
            early = [tp for tp in owed if self.unsettled.held_early(tp)]  # the LSO cannot tell: the leader will
            if early or (owed and time.monotonic() >= deadline):
                self._write_lost_markers(early or owed)
                owed = self.unsettled.owed(number, owed)
            if owed:
                time.sleep(POLL_S)

    def _stable_offsets(self, partitions: Sequence[TP], wait_s: float) -> dict[TP, int]:
        """The partitions' last stable offsets; those whose leader does not answer within ``wait_s`` are
        left out."""
        return self._markers_().ask_stable_offsets(partitions).result(wait_s)

    def _feed(self, stable: Mapping[TP, int]) -> None:
        for held in self.unsettled.settle(stable, time.monotonic()):
            log.warning(
                "capture: Kafka topic %s partition %d has been held at offset %d for %.0f s by a transaction "
                "that is not one of this connector's commits: read_committed readers stop there. A hanging "
                "transaction? kafka-transactions.sh find-hanging names it",
                held.topic, held.partition, held.offset, held.for_s,
            )  # fmt: skip

    def _write_lost_markers(
        self, partitions: Sequence[TP], grace_s: float = MARKER_GRACE_S, timeout_s: float | None = None
    ) -> None:
        """Ask the partitions' leaders which transactions are open there; one that begins inside a batch
        this sink committed lost its COMMIT marker (its partition had no leader when the coordinator
        wrote them): write it. Raises if a leader cannot be asked or the marker not written: the batch
        is then still owed, and its producer must not send there."""
        markers = self._markers_()
        found = markers.producers(partitions, timeout_s=timeout_s)
        now = time.monotonic()
        for tp in partitions:
            states = {s.txn_start_offset: s for s in found.get(tp, []) if s.txn_start_offset >= 0}
            lost = self.unsettled.lost(tp, states, now, grace_s)
            for offset in lost:
                state = states[offset]
                markers.commit(tp[0], tp[1], state, timeout_s=timeout_s)
                owner = self.unsettled.batch_at(tp, offset)
                log.warning(
                    "capture: Kafka topic %s partition %d: the batch at offset %d, committed by producer %s %.1f s "
                    "ago, had no commit marker there (Kafka's coordinator skips a partition that has no leader "
                    "when it writes them); the sink wrote it (producer id %d, epoch %d): read_committed readers "
                    "go on past it",
                    tp[0], tp[1], offset, self._producer_id(owner.producer if owner else ANY),
                    now - owner.committed_s if owner else 0.0, state.producer_id, state.producer_epoch,
                )  # fmt: skip
            self.unsettled.marked(tp, [o for o in states if o not in lost])

    def _check(self, *, outage: str | None = None) -> None:
        """Ask the last stable offsets of the partitions with unsettled batches; write the markers of our
        batches whose partition stays held at them past :data:`MARKER_GRACE_S`. After an ``outage``
        (what showed it: a slow commit, a reopen), wait up to :data:`OUTAGE_SETTLE_S` for every batch
        first, then write whatever is still missing. A commit has already succeeded: a failure to ask is
        logged and asked again at the next check."""
        self._last_check = time.monotonic()
        if not self.unsettled.partitions():
            return
        if outage is not None:
            log.info(
                "capture: %s: waiting up to %.0f s for the commit markers of every committed batch",
                outage, OUTAGE_SETTLE_S,
            )  # fmt: skip
        deadline = time.monotonic() + (OUTAGE_SETTLE_S if outage is not None else 0.0)
        while True:
            self._feed(self._stable_offsets(self.unsettled.partitions(), max(deadline - time.monotonic(), 1.0)))
            last = time.monotonic() >= deadline
            if last or not self.unsettled.partitions():
                break
            time.sleep(POLL_S * 5)
        grace = OUTAGE_SETTLE_S if outage is not None else MARKER_GRACE_S  # after an outage: all but the newest
        lingering = self.unsettled.lingering(time.monotonic(), grace)
        if lingering:
            try:
                self._write_lost_markers(lingering, grace, CHECK_TIMEOUT_S)
            except TidelineError as e:
                log.warning("capture: could not write the lost commit markers of %s (tried again in %.0f s): %s",
                            ", ".join(f"{t}[{p}]" for t, p in lingering), self.check_every_s, e)  # fmt: skip

    def _producer_id(self, number: int) -> str:
        if 0 <= number < len(self.producers):
            return str(self.producers[number].transactional_id)
        return "(either)"

    def abort(self) -> None:
        with self._said_as_timeout():
            self._producer().abort_transaction()

    # ------------------------------------------------------------------ reading

    def _reader_(self) -> KafkaReader:
        if self._reader is None:
            # connected to every broker at once, as the producers (open): each start reads the position and
            # catches up the key state with it, and an on-demand connection to the leader cost 50 ms of it
            self._reader = KafkaReader(
                self.bootstrap_servers, timeout_s=self.timeout_s, enable_sparse_connections=False
            )
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
        deadline = time.monotonic() + self.timeout_s
        while True:
            found: bytes | None = None
            try:
                for chunk in self._reader_().read_chunks_to_end(TopicPartition(topic, partition)):
                    for k, v in zip(chunk.keys, chunk.values, strict=True):
                        if k == key:
                            found = v
                return found
            except UnknownTopicError:
                # a topic this sink just created may be unknown for a moment to the reader's metadata request (as
                # to the admin's: _topic), seen once under load (the positions topic, read just after its creation)
                if topic not in self._partitions or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

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
        self._close_batches_fd()
