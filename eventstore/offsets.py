"""Committed consumer-group offsets, stored in the internal compacted topic ``__consumer_offsets``.

As in Kafka, a commit is a keyed record in a compacted topic: compaction keeps the last
commit of every (group, topic, partition), so the topic stays small and replaying it
yields the current offsets. Every commit of one group goes to one partition of the
offsets topic, ``murmur2(group) % partitions`` (:func:`offsets_partition_for`), so one
group's commits are totally ordered and one batch carries a whole commit atomically.

Record layout (version 1; one place for it: :func:`encode_offset_key`,
:func:`encode_offset_value` and their decoders; a later issue turns these into Avro)::

    key    JSON, sorted keys, no spaces: {"g": <group>, "p": <partition>, "t": <topic>, "v": 1}
           (deterministic bytes: compaction compares keys byte for byte)
    value  JSON: {"v": 1, "offset": <next offset to read>, "metadata": <str>,
                  "commit_timestamp": <ms since the epoch>}
           null (tombstone): the group's offset for that partition was deleted

A key or value of an unknown version is skipped with a warning (a newer writer), never
guessed at.

A transactional producer may also commit offsets inside a transaction (Kafka's
``sendOffsetsToTransaction``, :func:`offset_commit_records`); they count once the
transaction commits, and never if it aborts. What a query returns (Kafka's group
coordinator semantics):

* **committed**: for each (group, partition), the value of the last record (by offset)
  that is either non-transactional or part of a committed transaction;
* **pending**: the partitions with a commit inside a still-open transaction. Their
  committed value is about to change: a consumer taking such a partition over waits
  until the transaction ends (Kafka's ``UNSTABLE_OFFSET_COMMIT``), or it would start
  from an offset the transaction is about to replace.

:class:`OffsetStore` replays each offsets partition in two parts. Below the last stable
offset every transaction is decided: that part is replayed once, incrementally
(:func:`eventstore.isolation.read_visible`, read_committed), keeping the state and the
offset it read up to; each query reads only the batches appended since. If that offset
fell below the log start (the partition was truncated), the partition is replayed from
its start. Compaction never changes what a replay yields (it keeps the last record of
every key, the transaction markers, and drops tombstones only after
``delete_retention_ms``). The unstable tail, from there to the log end (empty unless a
transaction is open), is scanned on every query: its non-transactional records and the
records of transactions whose commit marker is in it are laid over the state; records of
transactions without a marker yet are the pending ones.

Thread-safety: :class:`OffsetStore` is thread-safe (``_lock`` guards the replay cache);
several processes may commit to and read one log directory at once (appends are
serialized by the partition's lock, see eventstore.partition_log).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import orjson
import pyarrow as pa

from eventstore.errors import ConfigError, OffsetOutOfRangeError, TopicExistsError, UnknownTopicError
from eventstore.isolation import IsolationLevel, read_visible
from eventstore.log import Log
from eventstore.partition_log import PartitionLog
from eventstore.partitioner import partition_for_key
from eventstore.producer_state import ControlType, parse_control_key
from eventstore.record_batch import build_records, encode_batch
from eventstore.topic import CleanupPolicy, TopicConfig, TopicMetadata, metadata_path, now_ms

log = logging.getLogger(__name__)

OFFSETS_TOPIC = "__consumer_offsets"
OFFSETS_PARTITIONS = 8
OFFSETS_SEGMENT_BYTES = 16 << 20  # closed segments are what compaction cleans: keep them modest
OFFSET_KEY_VERSION = 1
OFFSET_VALUE_VERSION = 1
READ_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True, order=True)
class TopicPartition:
    """One partition of one topic."""

    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class OffsetAndMetadata:
    """A committed position.

    ``offset``: the next offset the group will read (one past the last processed record).
    ``metadata``: free text stored with it. ``commit_timestamp``: ms since the epoch, ``-1``
    until committed (the store fills it in).
    """

    offset: int
    metadata: str = ""
    commit_timestamp: int = -1


# ---------------------------------------------------------------------------- the topic


def offsets_topic_config() -> TopicConfig:
    return TopicConfig(cleanup_policy=CleanupPolicy.COMPACT, segment_bytes=OFFSETS_SEGMENT_BYTES)


def ensure_offsets_topic(log: Log) -> TopicMetadata:
    """The metadata of ``__consumer_offsets``, creating the topic if it is missing.

    Safe against another process creating it at the same moment: whoever loses the
    race reads the winner's metadata.
    """
    try:
        return log.topic(OFFSETS_TOPIC)
    except UnknownTopicError:
        pass
    try:
        return log.create_topic(OFFSETS_TOPIC, OFFSETS_PARTITIONS, offsets_topic_config())
    except TopicExistsError:
        return log.topic(OFFSETS_TOPIC)
    except ConfigError:
        if metadata_path(log.path, OFFSETS_TOPIC).exists():  # a concurrent creator already wrote its first data
            return log.topic(OFFSETS_TOPIC)
        raise


def offsets_partition_for(group: str, partitions: int) -> int:
    """The offsets-topic partition holding every commit of ``group``."""
    return partition_for_key(group.encode(), partitions)


# ---------------------------------------------------------------------------- encoding


def encode_offset_key(group: str, tp: TopicPartition) -> bytes:
    return orjson.dumps(
        {"g": group, "p": tp.partition, "t": tp.topic, "v": OFFSET_KEY_VERSION}, option=orjson.OPT_SORT_KEYS
    )


def decode_offset_key(key: bytes) -> tuple[str, TopicPartition] | None:
    """``(group, partition)`` of a key; None for a key this version does not know."""
    try:
        body = orjson.loads(key)
        if body.get("v") != OFFSET_KEY_VERSION:
            raise ValueError(f"key version {body.get('v')!r}")
        return str(body["g"]), TopicPartition(str(body["t"]), int(body["p"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("skipping unreadable %s key %r: %s", OFFSETS_TOPIC, key[:80], e)
        return None


def encode_offset_value(value: OffsetAndMetadata) -> bytes:
    return orjson.dumps(
        {
            "v": OFFSET_VALUE_VERSION,
            "offset": value.offset,
            "metadata": value.metadata,
            "commit_timestamp": value.commit_timestamp,
        }
    )


def decode_offset_value(value: bytes) -> OffsetAndMetadata | None:
    try:
        body = orjson.loads(value)
        if body.get("v") != OFFSET_VALUE_VERSION:
            raise ValueError(f"value version {body.get('v')!r}")
        return OffsetAndMetadata(int(body["offset"]), str(body["metadata"]), int(body["commit_timestamp"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("skipping unreadable %s value %r: %s", OFFSETS_TOPIC, value[:80], e)
        return None


def offset_commit_records(
    group: str,
    offsets: Mapping[TopicPartition, OffsetAndMetadata | None],
    *,
    partitions: int = OFFSETS_PARTITIONS,
) -> tuple[int, list[bytes], list[bytes | None]]:
    """``(offsets-topic partition, keys, values)`` of a commit; a None offset becomes a tombstone.

    For writers of their own batches (a transactional producer committing offsets
    inside its transaction); :meth:`OffsetStore.commit` uses it too.
    """
    for tp, om in offsets.items():
        if om is not None and om.offset < 0:
            raise ConfigError(f"cannot commit negative offset {om.offset} for {tp.topic}-{tp.partition}")
    ordered = sorted(offsets.items())
    keys = [encode_offset_key(group, tp) for tp, _ in ordered]
    values = [None if om is None else encode_offset_value(om) for _, om in ordered]
    return offsets_partition_for(group, partitions), keys, values


# ---------------------------------------------------------------------------- the store


GroupOffsets = dict[str, dict[TopicPartition, OffsetAndMetadata]]
_Entry = tuple[int, str, TopicPartition, OffsetAndMetadata | None]  # record offset, group, partition, value


def _entries(base_offset: int, records: pa.RecordBatch, start: int) -> list[_Entry]:
    """The offset commits of one batch at offsets ≥ ``start``; unreadable records are skipped."""
    deltas: list[int] = records.column(0).to_pylist()
    keys: list[bytes | None] = records.column(2).to_pylist()
    values: list[bytes | None] = records.column(3).to_pylist()
    out: list[_Entry] = []
    for delta, key, value in zip(deltas, keys, values, strict=True):
        if base_offset + delta < start or key is None:
            continue  # already applied (a batch straddling the start), or not an offset commit
        decoded = decode_offset_key(key)
        if decoded is None:
            continue
        om = None if value is None else decode_offset_value(value)
        if value is not None and om is None:
            continue
        out.append((base_offset + delta, decoded[0], decoded[1], om))
    return out


def _apply(offsets: GroupOffsets, entries: Iterable[_Entry]) -> None:
    for _, group, tp, om in entries:
        if om is None:
            offsets.get(group, {}).pop(tp, None)
        else:
            offsets.setdefault(group, {})[tp] = om


@dataclass(slots=True)
class _Replay:
    """The decided part of one offsets partition, replayed up to ``next_offset``."""

    next_offset: int = 0
    offsets: GroupOffsets = field(default_factory=dict)


@dataclass(slots=True)
class _View:
    """One offsets partition as a query sees it: committed values and pending partitions."""

    offsets: GroupOffsets
    pending: dict[str, set[TopicPartition]]


class OffsetStore:
    """Commit and read group offsets in ``__consumer_offsets`` of ``log``.

    >>> store = OffsetStore(log)                                             # doctest: +SKIP
    >>> store.commit("billing", {TopicPartition("orders", 0): OffsetAndMetadata(42)})
    >>> store.committed("billing", [TopicPartition("orders", 0)])
    {TopicPartition(topic='orders', partition=0): OffsetAndMetadata(offset=42, ...)}
    """

    def __init__(self, log: Log) -> None:
        self.log = log
        self._lock = threading.Lock()
        self._replays: dict[int, _Replay] = {}
        self._partitions: int | None = None

    def _topic_partitions(self, *, create: bool) -> int | None:
        """Partition count of the offsets topic; None if it does not exist (and not ``create``)."""
        if self._partitions is None:
            if create:
                self._partitions = ensure_offsets_topic(self.log).partitions
            else:
                try:
                    self._partitions = self.log.topic(OFFSETS_TOPIC).partitions
                except UnknownTopicError:
                    return None
        return self._partitions

    def commit(self, group: str, offsets: Mapping[TopicPartition, OffsetAndMetadata | None]) -> None:
        """Store ``offsets`` of ``group`` as one batch (atomic); returns once it is durable.

        A None value deletes the group's offset of that partition (a tombstone). A
        ``commit_timestamp`` of -1 becomes now.
        """
        if not offsets:
            return
        partitions = self._topic_partitions(create=True)
        assert partitions is not None
        now = now_ms()
        stamped = {
            tp: om if om is None or om.commit_timestamp >= 0 else OffsetAndMetadata(om.offset, om.metadata, now)
            for tp, om in offsets.items()
        }
        partition, keys, values = offset_commit_records(group, stamped, partitions=partitions)
        batch = encode_batch(build_records(keys, values), first_timestamp=now, max_timestamp=now)
        self.log.append(OFFSETS_TOPIC, partition, batch)

    def committed(
        self, group: str, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata | None]:
        """The last committed offset of ``group`` for each partition (None: never committed)."""
        current = self.group_offsets(group)
        return {tp: current.get(tp) for tp in partitions}

    def group_offsets(self, group: str) -> dict[TopicPartition, OffsetAndMetadata]:
        """Every committed offset of ``group``."""
        view = self._group_view(group)
        return dict(view.offsets.get(group, {})) if view is not None else {}

    def pending(self, group: str) -> set[TopicPartition]:
        """Partitions of ``group`` with an offset commit inside a still-open transaction."""
        view = self._group_view(group)
        return set(view.pending.get(group, set())) if view is not None else set()

    def partition_log_of(self, group: str) -> PartitionLog | None:
        """The offsets-topic partition holding ``group``'s commits (None: no offsets topic yet)."""
        count = self._topic_partitions(create=False)
        return self.log.partition(OFFSETS_TOPIC, offsets_partition_for(group, count)) if count is not None else None

    def groups(self) -> list[str]:
        """Every group with committed offsets, pending ones, or member directories, sorted."""
        from eventstore.group import group_names  # group.py imports this module

        names = set(group_names(self.log.path))
        count = self._topic_partitions(create=False)
        for p in range(count or 0):
            view = self._view(p)
            names.update(g for g, tps in view.offsets.items() if tps)
            names.update(view.pending)
        return sorted(names)

    def _group_view(self, group: str) -> _View | None:
        count = self._topic_partitions(create=False)
        return self._view(offsets_partition_for(group, count)) if count is not None else None

    def _view(self, partition: int) -> _View:
        plog = self.log.partition(OFFSETS_TOPIC, partition)
        with self._lock:
            replay = self._catch_up(partition, plog)
            offsets = {g: dict(tps) for g, tps in replay.offsets.items()}
            start = replay.next_offset
        visible, pending = self._scan_tail(plog, start)
        _apply(offsets, visible)
        by_group: dict[str, set[TopicPartition]] = {}
        for _, group, tp, _ in pending:
            by_group.setdefault(group, set()).add(tp)
        return _View(offsets, by_group)

    def _catch_up(self, partition: int, plog: PartitionLog) -> _Replay:
        """Apply the decided batches appended since the last call (caller holds the lock)."""
        replay = self._replays.setdefault(partition, _Replay())
        while True:
            try:
                read = read_visible(plog, replay.next_offset, IsolationLevel.READ_COMMITTED, max_bytes=READ_CHUNK_BYTES)
            except OffsetOutOfRangeError:
                log.warning("%s-%d: offset %d was removed; replaying from the log start",
                            OFFSETS_TOPIC, partition, replay.next_offset)  # fmt: skip
                replay = self._replays[partition] = _Replay(plog.log_start_offset())
                continue
            for fetched in read.batches:
                _apply(replay.offsets, _entries(fetched.header.base_offset, fetched.records, replay.next_offset))
            if read.next_offset == replay.next_offset:
                return replay
            replay.next_offset = read.next_offset

    @staticmethod
    def _scan_tail(plog: PartitionLog, start: int) -> tuple[list[_Entry], list[_Entry]]:
        """``(visible, pending)`` commits from ``start`` (the decided part's end) to the log end."""
        visible: list[_Entry] = []
        open_txns: dict[int, list[_Entry]] = {}  # producer id → its commits since its last marker
        position = start
        while batches := plog.read(position, max_bytes=READ_CHUNK_BYTES):
            for fetched in batches:
                header = fetched.header
                if header.is_control:
                    ended = open_txns.pop(header.producer_id, [])
                    if parse_control_key(fetched.records.column(2)[0].as_py()) is ControlType.COMMIT:
                        visible.extend(ended)
                elif header.is_transactional:
                    open_txns.setdefault(header.producer_id, []).extend(
                        _entries(header.base_offset, fetched.records, start)
                    )
                else:
                    visible.extend(_entries(header.base_offset, fetched.records, start))
                position = max(position, header.next_offset)
        visible.sort(key=lambda e: e[0])  # the last record by offset wins, as in the decided part
        return visible, [e for entries in open_txns.values() for e in entries]
