"""Copy topics of the embedded log to Apache Kafka: record for record, same partitions, exactly once, resumable.

    with Log(data_dir, create=False) as log, LogMirror(log, "kafka:9092", name=str(data_dir)) as mirror:
        mirror.start(mirror.plan(default_topics(log)))  # plan checks both sides and writes nothing
        ends = mirror.end_offsets()
        while not mirror.caught_up(ends):
            mirror.step()                               # one Kafka transaction; a failed one closes the mirror

What is copied: every committed record (``read_committed``: aborted and open
transactions never) of each source partition, to the same partition of the Kafka topic
of the same name, in offset order, with its key, value (None stays a tombstone), headers
and timestamp. A missing Kafka topic is created with the source's partition count and
settings (``config.topic_configs``; ``segment_bytes`` is raised to Kafka's minimum,
:data:`KAFKA_MIN_SEGMENT_BYTES`); an existing one must have the same partition count
(a key must land where murmur2 puts it on Kafka too) and cleanup policy, else
:meth:`LogMirror.plan` raises ConfigError and nothing is written.

Offsets: the mapping is record for record, in order — not offset for offset (see
:mod:`eventstore.kafka.mirror_progress`).

Tideline's own topics (:mod:`eventstore.kafka.mirror_topics`): the
schema registry's ``__schemas`` goes to Kafka's ``_schemas`` (where ``tideline --kafka
schemas`` and capture into Kafka keep the registry), each record rewritten in Confluent's
field order (:func:`~eventstore.kafka.schema_store.confluent_record`), so schema ids in
framed values stay valid; the connector positions' ``__tideline_capture_offsets`` is
shared by every connector on a cluster, so it may already hold other connectors' keys —
not one of the source's.

Exactly once: a transactional producer (``transactional.id`` = ``tideline-mirror-<name>``)
writes each step's records *and* the new progress of every partition it advanced
(:class:`~eventstore.kafka.mirror_progress.MirrorProgress`) in one transaction. ``start``
first calls ``init_transactions`` (fencing a running predecessor and aborting what a
killed one left open), then reads the progress ``read_committed``: the records before each
stored source offset are on Kafka exactly once, the rest are not, whatever point a kill -9
hit. Refused at start (ConfigError, nothing written): progress older than the source's log
start (records were deleted before they were copied) or beyond its end (another log), a
Kafka topic shorter than the progress says (deleted or truncated since), or a non-empty
Kafka topic this mirror has no progress for (another writer, or another ``name``).

Order across topics: the connector's position (``__tideline_capture_offsets``) is stored
in the same atomic append as the events it covers, so a position must never be on Kafka
before those events. The mirror copies the partitions of such topics (mapped with
``copied_after_others``) in rounds: it notes their end offsets, then the other
partitions' end offsets, and copies the former up to the noted ends only once every
other partition is copied up to its noted end. With ``discover`` (the topics to mirror,
asked again at every round) a topic created on the source meanwhile is mirrored before
the positions that may cover it.

Memory: one source poll (``MAX_POLL_BYTES``, at most ``batch_records`` records) and a few
offsets per mirrored partition.

Thread safety: not thread-safe; one thread drives a ``LogMirror``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from eventstore.consumer import Consumer, ConsumerRecords, Headers
from eventstore.errors import ConfigError, ProducerFencedError, TidelineError
from eventstore.isolation import IsolationLevel
from eventstore.kafka.admin import KafkaAdmin
from eventstore.kafka.mirror_progress import (
    MIRROR_OFFSETS_TOPIC,
    MirrorProgress,
    mirror_offsets_topic_config,
    mirror_progress_key,
    read_mirror_progress,
)
from eventstore.kafka.mirror_topics import (
    INTERNAL_MAPPINGS,
    NOT_MIRRORABLE,
    MirrorTopic,
    RecordConverter,
    TopicMapping,
    kafka_topic_config,
)
from eventstore.kafka.producer import DEFAULT_TRANSACTION_TIMEOUT_MS, KafkaProducer
from eventstore.kafka.reader import KafkaReader
from eventstore.log import Log
from eventstore.offsets import TopicPartition
from eventstore.topic import CleanupPolicy, TopicConfig

TRANSACTIONAL_ID_PREFIX = "tideline-mirror-"
DEFAULT_BATCH_RECORDS = 20_000  # records per transaction, at most
MAX_POLL_BYTES = 8 << 20  # source bytes per transaction, at most
STABLE_WAIT_S = DEFAULT_TRANSACTION_TIMEOUT_MS / 1000 + 10  # another mirror's open transaction ends by then


@dataclass(slots=True)
class MirrorStats:
    """What a mirror copied since it started."""

    records: int = 0
    tombstones: int = 0
    transactions: int = 0
    per_topic: dict[str, int] = field(default_factory=dict)
    created_topics: list[str] = field(default_factory=list)


class LogMirror:
    """Copies topics of ``log`` to the Kafka cluster at ``bootstrap``; ``name`` identifies the mirror there.

    ``name`` keys the progress and derives the ``transactional.id``: run again with the same
    name to resume. ``replication_factor`` / ``min_insync_replicas`` apply to the topics it
    creates (None: the brokers' defaults). ``discover``: the topics to mirror, asked again
    at every round (new ones are planned and added). ``mappings``: source topics that go to
    Kafka otherwise than under their own name, as they are (default :data:`INTERNAL_MAPPINGS`).
    """

    def __init__(
        self,
        log: Log,
        bootstrap: str,
        *,
        name: str,
        batch_records: int = DEFAULT_BATCH_RECORDS,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        discover: Callable[[], Iterable[str]] | None = None,
        mappings: Mapping[str, TopicMapping] = INTERNAL_MAPPINGS,
        timeout_s: float = 30.0,
    ) -> None:
        if not name.strip():
            raise ConfigError("the mirror's name must not be empty")
        if batch_records < 1:
            raise ConfigError(f"records per transaction must be ≥ 1, got {batch_records}")
        self.log = log
        self.bootstrap = bootstrap
        self.name = name
        self.batch_records = batch_records
        self.replication_factor = replication_factor
        self.min_insync_replicas = min_insync_replicas
        self.discover = discover
        self.mappings = dict(mappings)
        self.timeout_s = timeout_s
        self.stats = MirrorStats()
        self._admin = KafkaAdmin(bootstrap, timeout_s=timeout_s)
        self._producer: KafkaProducer | None = None
        self._consumer = Consumer(log, isolation_level=IsolationLevel.READ_COMMITTED, enable_auto_commit=False,
                                  auto_offset_reset="none", max_poll_bytes=MAX_POLL_BYTES)  # fmt: skip
        self._stored: dict[TopicPartition, MirrorProgress] = {}  # committed progress of every partition known
        self._next: dict[TopicPartition, int] = {}  # per mirrored partition: the next source offset to copy
        self._topics: dict[str, MirrorTopic] = {}
        self._released: dict[TopicPartition, int] = {}  # held partition → offset it may be copied up to
        self._round: _Round | None = None

    @property
    def transactional_id(self) -> str:
        return TRANSACTIONAL_ID_PREFIX + self.name

    @property
    def topics(self) -> list[str]:
        return list(self._topics)

    # -- planning: reads only --------------------------------------------------

    def plan(self, names: Iterable[str]) -> list[MirrorTopic]:
        """Check that each topic can be mirrored (source exists; Kafka's, if any, agrees); write nothing."""
        source_topics = self.log.topics()
        on_kafka = set(self._admin.topics())
        out = []
        for name in dict.fromkeys(names):
            if name in NOT_MIRRORABLE:
                raise ConfigError(f"topic {name!r} cannot be mirrored: {NOT_MIRRORABLE[name]}")
            if name not in source_topics:
                known = ", ".join(source_topics) or "none"
                raise ConfigError(f"no topic {name!r} in the embedded log at {self.log.path} (its topics: {known})")
            meta = self.log.topic(name)
            mapping = self.mappings.get(name, TopicMapping())
            target = mapping.target or name
            if target in on_kafka:
                self._check_existing(name, target, meta.partitions, meta.config.cleanup_policy)
            config = kafka_topic_config(meta.config)
            out.append(MirrorTopic(name, meta.partitions, config, target in on_kafka, target, mapping))
        progress_topic = self._admin.topic(MIRROR_OFFSETS_TOPIC) if MIRROR_OFFSETS_TOPIC in on_kafka else None
        if progress_topic is not None and not progress_topic.config.cleanup_policy.compacts:
            raise ConfigError(
                f"Kafka topic {MIRROR_OFFSETS_TOPIC!r} is not compacted: the mirror's progress would "
                "expire; recreate it with cleanup.policy=compact"
            )
        return out

    def _check_existing(self, name: str, target: str, partitions: int, policy: CleanupPolicy) -> None:
        have = self._admin.topic(target)
        source = "the embedded log's" if target == name else f"the embedded log's {name!r}"
        if have.partitions != partitions:
            raise ConfigError(
                f"Kafka topic {target!r} has {have.partitions} partitions, {source} has {partitions}: "
                "records keep their partition, and keys must land where murmur2 puts them on Kafka too; "
                f"delete it or create it with {partitions} partitions"
            )
        if have.config.cleanup_policy is not policy:
            raise ConfigError(
                f"Kafka topic {target!r} has cleanup.policy={have.config.cleanup_policy.value}, {source} "
                f"is {policy.value}: the copy would not keep what the source keeps; delete it or change its policy"
            )

    # -- starting ------------------------------------------------------------

    def start(self, plan: Sequence[MirrorTopic]) -> None:
        """Fence a predecessor, read the committed progress, check it, create missing topics, position the reader."""
        self._producer = KafkaProducer(self.bootstrap, transactional_id=self.transactional_id, timeout_s=self.timeout_s)
        self._producer.init_transactions()
        if MIRROR_OFFSETS_TOPIC in self._admin.topics():
            self._wait_until_stable()
        self._stored = read_mirror_progress(self.bootstrap, self.name, timeout_s=self.timeout_s)
        self.add(plan)

    def add(self, plan: Sequence[MirrorTopic]) -> None:
        """Start mirroring more topics (after :meth:`start`): checked first, then created on Kafka if missing."""
        plan = [t for t in plan if t.name not in self._topics]
        starts: dict[TopicPartition, int] = {}
        for topic in plan:
            starts.update(self._check_resumable(topic))
        on_kafka = set(self._admin.topics())
        missing = [t for t in plan if not t.exists_on_kafka and t.target not in on_kafka]
        if MIRROR_OFFSETS_TOPIC not in on_kafka:
            self._create(MIRROR_OFFSETS_TOPIC, 1, mirror_offsets_topic_config())
        for topic in missing:
            self._create(topic.target, topic.partitions, topic.config)
            self.stats.created_topics.append(topic.target)
        self._next.update(starts)
        self._topics.update((t.name, t) for t in plan)

    def _create(self, name: str, partitions: int, config: TopicConfig) -> None:
        self._admin.ensure_topic(name, partitions, config, replication_factor=self.replication_factor,
                                 min_insync_replicas=self.min_insync_replicas)  # fmt: skip

    def _check_resumable(self, topic: MirrorTopic) -> dict[TopicPartition, int]:
        """Where each partition of ``topic`` resumes; ConfigError if the stored progress cannot be trusted."""
        starts = {}
        targets = {}
        if topic.exists_on_kafka:
            _, infos = self._admin.describe(topic.target)
            targets = {i.partition: i.high_watermark for i in infos}
        for tp in topic.partition_list():
            plog = self.log.partition(tp.topic, tp.partition)
            stored = self._stored.get(tp)
            if stored is None:
                starts[tp] = plog.log_start_offset()
                continue
            where = f"{tp.topic}-{tp.partition}"
            if stored.next_source_offset < plog.log_start_offset():
                raise ConfigError(
                    f"the embedded log's {where} starts at offset {plog.log_start_offset()} but mirror {self.name!r} "
                    f"copied only up to {stored.next_source_offset}: retention deleted records before they were copied"
                )
            if stored.next_source_offset > plog.log_end_offset():
                raise ConfigError(
                    f"mirror {self.name!r} copied {where} up to offset {stored.next_source_offset}, beyond the end of "
                    f"the embedded log at {self.log.path} ({plog.log_end_offset()}): it is not the log that was "
                    "mirrored; give another --name"
                )
            if targets.get(tp.partition, 0) < stored.next_target_offset:
                raise ConfigError(
                    f"Kafka's {topic.target}-{tp.partition} ends before the records mirror {self.name!r} copied there "
                    f"(offset "
                    f"{stored.next_target_offset}): the topic was deleted or truncated since; give another --name "
                    "to copy it again from the start"
                )
            starts[tp] = stored.next_source_offset
        if topic.exists_on_kafka and not any(tp in self._stored for tp in topic.partition_list()):
            if topic.mapping.shared:
                self._refuse_keys_on_kafka(topic)
            else:
                self._refuse_if_not_empty(topic)
        return starts

    def _refuse_if_not_empty(self, topic: MirrorTopic) -> None:
        with KafkaReader(self.bootstrap, timeout_s=self.timeout_s) as reader:
            for tp in topic.partition_list():
                chunks = reader.read_chunks_to_end(TopicPartition(topic.target, tp.partition))
                first = next(chunks, None)
                chunks.close()
                if first is not None:
                    raise ConfigError(
                        f"Kafka topic {topic.target!r} already has records and mirror {self.name!r} copied none of "
                        "them: another writer, or a mirror of another name; delete the topic or give that --name"
                    )

    def _refuse_keys_on_kafka(self, topic: MirrorTopic) -> None:
        """A shared topic (one small compacted partition per writer's keys): none of the source's keys on Kafka."""
        with KafkaReader(self.bootstrap, timeout_s=self.timeout_s) as reader:
            on_kafka = {key for tp in topic.partition_list() for chunk in reader.read_chunks_to_end(
                TopicPartition(topic.target, tp.partition)) for key in chunk.keys}  # fmt: skip
        with Consumer(self.log, enable_auto_commit=False) as source:
            source.assign(topic.partition_list())
            source.seek_to_beginning()
            while records := source.poll(0):
                for record in records:
                    if record.key in on_kafka:
                        raise ConfigError(
                            f"Kafka topic {topic.target!r} already holds key {record.key!r} of the embedded log's "
                            f"{topic.name!r}: its writer has run on Kafka already (capture with --kafka?), and a "
                            "copy would put older records after newer ones"
                        )

    def _wait_until_stable(self) -> None:
        """Wait until no transaction (another mirror's) holds back the progress read_committed readers see."""
        target, stable = self._progress_offsets()
        deadline = time.monotonic() + STABLE_WAIT_S
        while stable < target:
            if time.monotonic() > deadline:
                raise TidelineError(
                    f"Kafka topic {MIRROR_OFFSETS_TOPIC!r} has a transaction open for over {STABLE_WAIT_S:.0f}s "
                    f"(at offset {stable}): another mirror is stuck; stop it and retry"
                )
            time.sleep(0.1)
            stable = self._progress_offsets()[1]

    def _progress_offsets(self) -> tuple[int, int]:
        """(high watermark, last stable offset) of the progress partition."""
        _, infos = self._admin.describe(MIRROR_OFFSETS_TOPIC)
        return infos[0].high_watermark, infos[0].last_stable_offset

    # -- copying -------------------------------------------------------------

    def positions(self) -> dict[TopicPartition, int]:
        """Per mirrored partition, the next source offset to copy (everything before it is on Kafka)."""
        return dict(self._next)

    def end_offsets(self) -> dict[TopicPartition, int]:
        """Per mirrored partition, the source's last stable offset: where copying is caught up."""
        return self._consumer.end_offsets(self._next)

    def caught_up(self, end_offsets: dict[TopicPartition, int] | None = None) -> bool:
        """True when every mirrored partition is copied up to ``end_offsets`` (default: the current ends)."""
        ends = self.end_offsets() if end_offsets is None else end_offsets
        return all(self._next[tp] >= end for tp, end in ends.items() if tp in self._next)

    def step(self, timeout_ms: int = 0) -> int:
        """Copy one poll of the source (waiting up to ``timeout_ms`` for one) in one transaction; records copied."""
        producer = self._require_started()
        self._next_round()
        limits = self._assign_copyable()
        polled = self._consumer.poll(timeout_ms, max_records=self.batch_records)
        columns = _columns(polled, limits)
        for tp, limit in limits.items():  # read past what may be copied yet: read it again later
            if self._consumer.position(tp) > limit:
                self._consumer.seek(tp, limit)
        moved = {
            tp: pos for tp in self._consumer.assignment() if (pos := self._consumer.position(tp)) != self._next[tp]
        }
        if not moved:
            return 0
        producer.begin_transaction()
        try:
            progress = self._send(producer, columns, moved)
            producer.send_batch(
                MIRROR_OFFSETS_TOPIC,
                [p.to_json() for p in progress.values()],
                [mirror_progress_key(self.name, tp) for tp in progress],
                partition=0,
            )
            producer.commit_transaction()
        except BaseException:
            self._fail(producer)
            raise
        self._stored.update(progress)
        self._next.update(moved)
        self._count(columns)
        return sum(len(c.values) for c in columns.values())

    def _held(self) -> list[TopicPartition]:
        return [tp for tp in self._next if self._topics[tp.topic].mapping.copied_after_others]

    def _next_round(self) -> None:
        """Release the held partitions up to their noted ends once the others reached theirs (module docstring)."""
        if self._round is None:
            held_ends = self._consumer.end_offsets(self._held())  # first the held partitions' ends …
            if self.discover is not None:  # … then every topic that existed then, and its end
                new = [t for t in self.discover() if t not in self.topics]
                if new:
                    self.add(self.plan(new))
            others = [tp for tp in self._next if not self._topics[tp.topic].mapping.copied_after_others]
            self._round = _Round(held_ends, self._consumer.end_offsets(others))
        if all(self._next[tp] >= end for tp, end in self._round.others_ends.items()):
            self._released.update(self._round.held_ends)
            self._round = None

    def _assign_copyable(self) -> dict[TopicPartition, int]:
        """Read the partitions that have something to copy now; the held ones' limits."""
        limits = {tp: max(self._released.get(tp, 0), self._next[tp]) for tp in self._held()}
        wanted = [tp for tp in self._next if tp not in limits or limits[tp] > self._next[tp]]
        if set(wanted) != set(self._consumer.assignment()):
            self._consumer.assign(wanted)
            for tp in wanted:
                self._consumer.seek(tp, self._next[tp])
        return {tp: limit for tp, limit in limits.items() if tp in wanted}

    def _send(self, producer: KafkaProducer, columns: dict[TopicPartition, _Columns],
              moved: dict[TopicPartition, int]) -> dict[TopicPartition, MirrorProgress]:  # fmt: skip
        progress = {}
        for tp, next_source in moved.items():
            next_target = self._stored[tp].next_target_offset if tp in self._stored else 0
            cols = columns.get(tp)
            if cols is not None:
                topic = self._topics[tp.topic]
                if topic.mapping.convert is not None:
                    cols.convert(topic.mapping.convert)
                sent = producer.send_batch(topic.target, cols.values, cols.keys, partition=tp.partition,
                                           timestamps=cols.timestamps, headers=cols.headers)  # fmt: skip
                first, count = sent[tp.partition]
                next_target = first + count
            progress[tp] = MirrorProgress(next_source, next_target)
        return progress

    def _fail(self, producer: KafkaProducer) -> None:
        """After a failed step: abort its transaction if possible, and close.

        Closed, not rewound: a commit that timed out may have happened, and only the
        progress read by a new mirror's ``start`` says which.
        """
        with contextlib.suppress(TidelineError):  # fenced or unreachable: the successor's init_transactions aborts it
            producer.abort_transaction()
        self.close()

    def _count(self, columns: dict[TopicPartition, _Columns]) -> None:
        self.stats.transactions += 1
        for tp, cols in columns.items():
            self.stats.records += len(cols.values)
            self.stats.tombstones += cols.values.count(None)
            self.stats.per_topic[tp.topic] = self.stats.per_topic.get(tp.topic, 0) + len(cols.values)

    def _require_started(self) -> KafkaProducer:
        if self._producer is None:
            raise TidelineError("the mirror is not running: start it (a failed step closes it; a new one resumes)")
        return self._producer

    # -- closing -------------------------------------------------------------

    def close(self) -> None:
        self._consumer.close()
        if self._producer is not None:
            with contextlib.suppress(ProducerFencedError):
                self._producer.close()
            self._producer = None

    def __enter__(self) -> LogMirror:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class _Round:
    """End offsets noted for one round of the held partitions (see the module docstring)."""

    held_ends: dict[TopicPartition, int]
    others_ends: dict[TopicPartition, int]


@dataclass(slots=True)
class _Columns:
    """One partition's records of one step, column by column, in offset order."""

    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)
    timestamps: list[int] = field(default_factory=list)
    headers: list[Headers] = field(default_factory=list)

    def convert(self, converter: RecordConverter) -> None:
        for i, (key, value) in enumerate(zip(self.keys, self.values, strict=True)):
            if key is not None:
                self.keys[i], self.values[i] = converter(key, value)


def _columns(polled: ConsumerRecords, limits: dict[TopicPartition, int]) -> dict[TopicPartition, _Columns]:
    """The polled records per partition, without those at or past a held partition's limit."""
    out: dict[TopicPartition, _Columns] = {}
    for record in polled:
        tp = TopicPartition(record.topic, record.partition)
        if tp in limits and record.offset >= limits[tp]:
            continue
        cols = out.get(tp)
        if cols is None:
            cols = out[tp] = _Columns()
        cols.keys.append(record.key)
        cols.values.append(record.value)
        cols.timestamps.append(record.timestamp)
        cols.headers.append(record.headers)
    return out
