"""The consumer: pull records by offset from assigned partitions, alone or in a group.

Kafka's vocabulary: ``assign`` partitions by hand or ``subscribe`` to topics as a member
of a consumer group, ``seek`` (to an offset, the beginning, the end, or a time through
the time index), ``poll`` whole batches, ``position``, ``commit``/``committed``, ``lag``.
Records come back as :class:`ConsumerRecords`: column-wise (``to_table()``: one Arrow
table, no per-record Python work) or, for convenience, iterated as
:class:`ConsumerRecord` objects.

Groups: committed offsets live in ``__consumer_offsets`` (eventstore.offsets); membership
and partition ownership are flock'ed files in the log directory (eventstore.group). A
subscribed consumer refreshes its membership in ``poll`` every ``heartbeat_interval_ms``
(default 500 ms: the longest a killed member's partitions wait), and at once when the
members directory changed (a join, a clean leave, a heartbeat). It releases partitions
the group's assignment gave to others (committing their positions first when
auto-commit is on) and takes newly assigned ones once their previous owner let go,
starting each at the group's committed offset (else ``auto_offset_reset``). With
auto-commit, positions are also committed every ``auto_commit_interval_ms`` (at the
start of a ``poll``, so what earlier polls returned counts as processed, as in Kafka)
and on ``close``/``unsubscribe``. Delivery is at-least-once: a member killed between
processing records and committing them has them processed again by the member that
takes its partitions over.

Isolation (eventstore.isolation): ``read_committed`` (the default, as the DESIGN asks)
reads up to the last stable offset and skips aborted transactions;
``read_uncommitted`` reads to the log end. Control batches are never returned. A
read_committed consumer held back by an open transaction reports it, and if it lasts,
the transaction coordinator aborts transactions whose producer died or timed out
(eventstore.isolation.note_held_back); nothing else would end them.

Positions of a group's partitions come from its committed offsets. A partition whose
committed offset is part of a still-open transaction (a transactional producer's
``send_offsets_to_transaction``) is not read until that transaction ends, and
``position`` waits for it (up to ``default_api_timeout_ms``), as Kafka does.

Long-poll: ``poll(timeout_ms)`` with nothing to return sleeps in an inotify wait on the
directories of its partitions (eventstore.notify), so an append by any process wakes it
within milliseconds and an idle consumer costs no CPU; it wakes at least every
``heartbeat_interval_ms`` as a group member (membership; joins and leaves wake it at
once), and every second otherwise (a
transaction held open by a dead producer is noticed). Without inotify it polls every
5 ms.

Thread-safety: not thread-safe (like Kafka's consumer): one thread per consumer, except
:meth:`Consumer.wakeup`, which any thread may call to end a blocking ``poll``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass
from types import TracebackType

import pyarrow as pa
import pyarrow.compute as pc

from eventstore.errors import (
    CommitFailedError,
    OffsetOutOfRangeError,
    TidelineError,
    UnknownTopicError,
    WakeupError,
)
from eventstore.group import MEMBERS_DIR, GroupMember, group_dir, validate_group_id
from eventstore.isolation import IsolationLevel, end_offset, note_held_back, read_visible
from eventstore.log import Log
from eventstore.notify import ChangeWaiter
from eventstore.offsets import OffsetAndMetadata, OffsetStore, TopicPartition
from eventstore.partition_log import FetchedBatch

Headers = list[tuple[str, bytes | None]]
IDLE_POLL_SECONDS = 0.005
MAX_IDLE_WAIT_SECONDS = 1.0  # a waiting poll re-checks at least this often (held-back transactions)
RebalanceCallback = Callable[[list[TopicPartition]], None]

__all__ = [
    "TABLE_SCHEMA",
    "CommitFailedError",
    "Consumer",
    "ConsumerRecord",
    "ConsumerRecords",
    "Headers",
    "OffsetAndMetadata",
    "PolledBatch",
    "TopicPartition",
]


@dataclass(frozen=True, slots=True)
class ConsumerRecord:
    """One record as delivered. ``value is None`` means a tombstone."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: Headers


TABLE_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("timestamp", pa.int64(), nullable=False),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
    ]
)


@dataclass(frozen=True, slots=True)
class PolledBatch:
    """A stored batch cut to the records at or after the consumer's position."""

    topic: str
    batch: FetchedBatch
    records: pa.RecordBatch

    def offsets(self) -> pa.Array:
        return pc.add(self.records.column(0).cast(pa.int64()), pa.scalar(self.batch.header.base_offset, pa.int64()))

    def timestamps(self) -> pa.Array:
        return pc.add(self.records.column(1), pa.scalar(self.batch.header.first_timestamp, pa.int64()))

    def to_table(self) -> pa.Table:
        n = self.records.num_rows
        return pa.table(
            [
                pa.repeat(pa.scalar(self.topic, pa.string()), n),
                pa.repeat(pa.scalar(self.batch.partition, pa.int32()), n),
                self.offsets(),
                self.timestamps(),
                self.records.column(2),
                self.records.column(3),
            ],
            schema=TABLE_SCHEMA,
        )


class ConsumerRecords:
    """The result of one ``poll``: batches per partition, in offset order."""

    def __init__(self, batches: list[PolledBatch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return sum(b.records.num_rows for b in self.batches)

    def __bool__(self) -> bool:
        return bool(self.batches)

    def __iter__(self) -> Iterator[ConsumerRecord]:
        for b in self.batches:
            offsets = self.offsets_of(b)
            timestamps = b.timestamps().to_pylist()
            keys = b.records.column(2).to_pylist()
            values = b.records.column(3).to_pylist()
            if b.batch.header.has_headers:
                raw_headers = b.records.column(4).to_pylist()
                headers: list[Headers] = [[(h["key"], h["value"]) for h in hs] if hs else [] for hs in raw_headers]
            else:
                headers = [[] for _ in offsets]
            for i, offset in enumerate(offsets):
                yield ConsumerRecord(b.topic, b.batch.partition, offset, timestamps[i], keys[i], values[i], headers[i])

    @staticmethod
    def offsets_of(b: PolledBatch) -> list[int]:
        base = b.batch.header.base_offset
        return [base + d for d in b.records.column(0).to_pylist()]

    def to_table(self) -> pa.Table:
        """All records as one Arrow table (topic, partition, offset, timestamp, key, value)."""
        if not self.batches:
            return TABLE_SCHEMA.empty_table()
        return pa.concat_tables([b.to_table() for b in self.batches])


class Consumer:
    """Reads assigned partitions from positions it keeps in memory.

    >>> consumer = Consumer(log)                                   # doctest: +SKIP
    >>> consumer.assign([TopicPartition("orders", 0)])
    >>> consumer.seek_to_beginning()
    >>> for record in consumer.poll(timeout_ms=100): ...

    As a group member (partitions shared with the group's other members, in this
    process or others; positions resume from the group's committed offsets):

    >>> with Consumer(log, group_id="billing") as consumer:        # doctest: +SKIP
    ...     consumer.subscribe(["orders"])
    ...     while True:
    ...         for record in consumer.poll(timeout_ms=500): ...
    """

    def __init__(
        self,
        log: Log,
        *,
        max_poll_bytes: int = 4 << 20,
        auto_offset_reset: str = "earliest",
        group_id: str | None = None,
        isolation_level: str | IsolationLevel = IsolationLevel.READ_COMMITTED,
        enable_auto_commit: bool = True,
        auto_commit_interval_ms: int = 5000,
        heartbeat_interval_ms: int = 500,
        client_id: str = "tideline",
        default_api_timeout_ms: int = 60_000,
    ) -> None:
        if auto_offset_reset not in ("earliest", "latest", "none"):
            raise TidelineError(f"auto_offset_reset must be earliest, latest or none, not {auto_offset_reset!r}")
        if group_id is not None:
            validate_group_id(group_id)
        if auto_commit_interval_ms < 0 or heartbeat_interval_ms < 0:
            raise TidelineError("auto_commit_interval_ms and heartbeat_interval_ms must be ≥ 0")
        self.log = log
        self.max_poll_bytes = max_poll_bytes
        self.auto_offset_reset = auto_offset_reset
        self.group_id = group_id
        self.isolation_level = IsolationLevel.parse(isolation_level)
        self.enable_auto_commit = enable_auto_commit
        self.auto_commit_interval_ms = auto_commit_interval_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.client_id = client_id
        self.default_api_timeout_ms = default_api_timeout_ms
        self._positions: dict[TopicPartition, int | None] = {}
        self._next = 0
        self._offsets: OffsetStore | None = None
        self._member: GroupMember | None = None
        self._on_assign: RebalanceCallback | None = None
        self._on_revoke: RebalanceCallback | None = None
        self._refreshed = float("-inf")
        self._auto_committed = time.monotonic()
        self._target: set[TopicPartition] = set()
        self._members_seen_ns = 0
        self._waiter: ChangeWaiter | None = None  # created by the first poll that has to wait
        self._woken = False

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ assignment

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions (replacing any previous assignment).

        Manual assignment takes no part in group membership; with a ``group_id`` it may
        still ``commit`` and read ``committed`` offsets, and starts from them.
        """
        if self._member is not None:
            raise TidelineError("assign() is not allowed while subscribed: unsubscribe() first")
        wanted = list(partitions)
        for tp in wanted:
            self.log.partition(tp.topic, tp.partition)  # validates topic and partition
        self._positions = {tp: self._positions.get(tp) for tp in wanted}

    def assignment(self) -> list[TopicPartition]:
        return sorted(self._positions)

    def subscribe(
        self,
        topics: Iterable[str],
        group: str | None = None,
        *,
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> None:
        """Join ``group`` (default: ``group_id``) and share the partitions of ``topics`` with its members.

        Partitions arrive in later ``poll`` calls. ``on_assign``/``on_revoke`` (Kafka's
        rebalance listener) are called from ``poll``/``close`` with the partitions
        gained, and with those about to be given up (after their auto-commit).
        Subscribing again replaces the topic list; another group means leaving this one.
        """
        wanted = sorted(set(topics))
        if not wanted:
            raise TidelineError("subscribe() needs at least one topic")
        group = group if group is not None else self.group_id
        if group is None:
            raise TidelineError("subscribe() needs a group: pass group= or create the Consumer with group_id=")
        validate_group_id(group)
        if self._member is None and self._positions:
            raise TidelineError("subscribe() is not allowed with a manual assignment: assign([]) first")
        if self._member is not None and self._member.group != group:
            self.unsubscribe()
        self.group_id = group
        self._on_assign, self._on_revoke = on_assign, on_revoke
        if self._member is None:
            self._member = GroupMember(self.log.path, group, client_id=self.client_id, topics=wanted)
        else:
            self._member.subscribe(wanted)
        self._refreshed = float("-inf")  # rebalance at the next poll

    def subscription(self) -> list[str]:
        return list(self._member.topics) if self._member is not None else []

    def unsubscribe(self) -> None:
        """Leave the group: commit (auto-commit), give up every partition, delete the member files."""
        member = self._member
        if member is None:
            return
        try:
            self._revoke(set(self._positions))
        finally:
            member.leave()
            self._member = None
            self._positions.clear()
            self._target = set()

    @property
    def member_id(self) -> str | None:
        """This consumer's id in its group (None when not subscribed)."""
        return self._member.member_id if self._member is not None else None

    @property
    def rebalancing(self) -> bool:
        """True while the group gave this member partitions that their previous owner still holds."""
        return self._member is not None and bool(self._target - set(self._positions))

    def _check(self, tp: TopicPartition) -> None:
        if tp not in self._positions:
            raise TidelineError(f"{tp.topic}-{tp.partition} is not assigned to this consumer")

    # ------------------------------------------------------------------ positions

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._check(tp)
        if offset < 0:
            raise TidelineError(f"cannot seek {tp.topic}-{tp.partition} to negative offset {offset}")
        self._positions[tp] = offset

    def seek_to_beginning(self, *partitions: TopicPartition) -> None:
        for tp in partitions or tuple(self._positions):
            self.seek(tp, self.log.partition(tp.topic, tp.partition).log_start_offset())

    def seek_to_end(self, *partitions: TopicPartition) -> None:
        """Seek to the end: the last stable offset under read_committed, else the log end."""
        for tp in partitions or tuple(self._positions):
            self.seek(tp, self._end_offset(tp))

    def _end_offset(self, tp: TopicPartition) -> int:
        return end_offset(self.log.partition(tp.topic, tp.partition), self.isolation_level)

    def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.log.partition(tp.topic, tp.partition).log_start_offset() for tp in partitions}

    def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Per partition, where reading ends: the last stable offset (read_committed) or the log end."""
        return {tp: self._end_offset(tp) for tp in partitions}

    def offsets_for_times(self, timestamps: dict[TopicPartition, int]) -> dict[TopicPartition, int | None]:
        """Per partition, the earliest offset whose timestamp is ≥ the given one (None: none)."""
        out: dict[TopicPartition, int | None] = {}
        for tp, ts in timestamps.items():
            plog = self.log.partition(tp.topic, tp.partition)
            base = plog.offset_for_time(ts)
            if base is None:
                out[tp] = None
                continue
            out[tp] = None
            for fetched in plog.read(base, max_bytes=1 << 20):
                stamps = pc.add(fetched.records.column(1), pa.scalar(fetched.header.first_timestamp, pa.int64()))
                hits = pc.indices_nonzero(pc.greater_equal(stamps, pa.scalar(ts, pa.int64()))).to_pylist()
                if hits:
                    out[tp] = fetched.header.base_offset + fetched.records.column(0)[hits[0]].as_py()
                    break
        return out

    def seek_to_time(self, tp: TopicPartition, timestamp: int) -> None:
        """Seek to the first record at or after ``timestamp`` (or the end if none)."""
        offset = self.offsets_for_times({tp: timestamp})[tp]
        self.seek(tp, offset if offset is not None else self._end_offset(tp))

    def position(self, tp: TopicPartition) -> int:
        """The offset of the next record this consumer will return for ``tp``.

        Without a position yet: the group's committed offset (with a group), else
        ``auto_offset_reset``. While the committed offset is part of an open transaction,
        waits for it to end (at most ``default_api_timeout_ms``).
        """
        self._check(tp)
        pos = self._positions[tp]
        if pos is not None:
            return pos
        if self.group_id is not None:
            deadline = time.monotonic() + self.default_api_timeout_ms / 1000
            while self._pending_commits([tp]):
                if time.monotonic() >= deadline:
                    raise TidelineError(
                        f"the committed offset of {tp.topic}-{tp.partition} for group {self.group_id} is part of a "
                        f"transaction still open after {self.default_api_timeout_ms} ms (its producer is alive "
                        "and has not committed or aborted)"
                    )
                self._note_pending_commits()
                time.sleep(IDLE_POLL_SECONDS)
        return self._initialize(tp)

    def _initialize(self, tp: TopicPartition) -> int:
        committed = self.committed([tp])[tp] if self.group_id is not None else None
        pos = self._positions[tp] = committed.offset if committed is not None else self._reset(tp)
        return pos

    def _pending_commits(self, partitions: Iterable[TopicPartition]) -> set[TopicPartition]:
        """Those of ``partitions`` whose committed offset is part of an open transaction."""
        if self.group_id is None:
            return set()
        pending = self._store().pending(self.group_id)
        return pending.intersection(partitions) if pending else set()

    def _reset(self, tp: TopicPartition) -> int:
        plog = self.log.partition(tp.topic, tp.partition)
        if self.auto_offset_reset == "none":
            raise OffsetOutOfRangeError(f"no position for {tp.topic}-{tp.partition} and auto_offset_reset=none")
        pos = plog.log_start_offset() if self.auto_offset_reset == "earliest" else self._end_offset(tp)
        self._positions[tp] = pos
        return pos

    def lag(self) -> dict[TopicPartition, int]:
        """Per assigned partition: records between the position and the end (see ``end_offsets``).

        Partitions whose starting offset waits for an open transaction are left out.
        """
        waiting = self._pending_commits(tp for tp, pos in self._positions.items() if pos is None)
        return {tp: max(0, self._end_offset(tp) - self.position(tp)) for tp in self.assignment() if tp not in waiting}

    # ------------------------------------------------------------------ offsets

    def _store(self) -> OffsetStore:
        if self._offsets is None:
            self._offsets = OffsetStore(self.log)
        return self._offsets

    def _require_group(self, what: str) -> str:
        if self.group_id is None:
            raise TidelineError(f"{what} needs a group: create the Consumer with group_id= or subscribe(group=)")
        return self.group_id

    def commit(self, offsets: Mapping[TopicPartition, int | OffsetAndMetadata] | None = None) -> None:
        """Commit ``offsets`` (default: the position of every assigned partition) for the group.

        Synchronous: durable on return. An offset is the next one to read (one past the
        last processed record). A subscribed member may commit only partitions it owns
        (:class:`CommitFailedError` otherwise: the group rebalanced them away).
        """
        group = self._require_group("commit()")
        if offsets is None:
            chosen: dict[TopicPartition, OffsetAndMetadata | None] = {
                tp: OffsetAndMetadata(pos) for tp, pos in self._positions.items() if pos is not None
            }
        else:
            if self._member is not None:
                foreign = sorted(tp for tp in offsets if tp not in self._positions)
                if foreign:
                    names = ", ".join(f"{tp.topic}-{tp.partition}" for tp in foreign)
                    raise CommitFailedError(f"cannot commit {names}: not owned by member {self.member_id} of {group}")
            chosen = {
                tp: om if isinstance(om, OffsetAndMetadata) else OffsetAndMetadata(om) for tp, om in offsets.items()
            }
        self._store().commit(group, chosen)
        self._auto_committed = time.monotonic()

    def committed(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata | None]:
        """The group's last committed offset of each partition (None: never committed)."""
        return self._store().committed(self._require_group("committed()"), partitions)

    def _maybe_auto_commit(self) -> None:
        if not self.enable_auto_commit or self.group_id is None:
            return
        if (time.monotonic() - self._auto_committed) * 1000 >= self.auto_commit_interval_ms:
            self.commit()

    # ------------------------------------------------------------------ group membership

    def _partition_count(self, topic: str) -> int | None:
        try:
            return self.log.topic(topic).partitions
        except UnknownTopicError:
            return None

    def _maybe_rebalance(self) -> None:
        """Refresh membership (at most every ``heartbeat_interval_ms``): release, acquire, heartbeat."""
        member = self._member
        if member is None:
            return
        members_changed = self._members_mtime_ns() != self._members_seen_ns
        if not members_changed and (time.monotonic() - self._refreshed) * 1000 < self.heartbeat_interval_ms:
            return
        self._refreshed = time.monotonic()
        self._members_seen_ns = self._members_mtime_ns()
        self._target = member.target(self._partition_count)
        self._revoke(set(self._positions) - self._target)
        acquired = member.try_acquire(self._target - set(self._positions))
        if acquired:
            for tp in acquired:
                self._positions[tp] = None  # from the committed offset, read now that we hold the lock
            if self._on_assign is not None:
                self._on_assign(acquired)
        member.heartbeat()

    def _members_mtime_ns(self) -> int:
        """The members directory's mtime: it changes when a member joins, leaves or heartbeats."""
        if self.group_id is None:
            return 0
        try:
            return os.stat(group_dir(self.log.path, self.group_id) / MEMBERS_DIR).st_mtime_ns
        except FileNotFoundError:
            return 0

    def _revoke(self, partitions: set[TopicPartition]) -> None:
        """Give up ``partitions``: auto-commit their positions, tell the listener, release the locks."""
        if not partitions or self._member is None:
            return
        revoked = sorted(partitions)
        try:
            if self.enable_auto_commit:
                self.commit({tp: pos for tp in revoked if (pos := self._positions[tp]) is not None})
            if self._on_revoke is not None:
                self._on_revoke(revoked)
        finally:
            self._member.release(revoked)
            for tp in revoked:
                del self._positions[tp]
            self._member.heartbeat()

    # ------------------------------------------------------------------ poll

    def poll(self, timeout_ms: int = 0, *, max_records: int | None = None) -> ConsumerRecords:
        """Return whole batches from the assigned partitions, waiting up to ``timeout_ms``.

        A group member also rebalances and auto-commits here (see the module docstring).
        """
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            self._check_wakeup()
            self._maybe_rebalance()
            self._maybe_auto_commit()
            if self._waiter is not None:  # watch first, then read: no append can fall in between
                self._watch()
            before = dict(self._positions)
            out = self._fetch_once(max_records)
            if not out and self._positions != before:
                continue  # only record-less or skipped batches (compaction, aborted data): keep reading
            if out or time.monotonic() >= deadline:
                return ConsumerRecords(out)
            self._wait_for_data(deadline - time.monotonic())

    def _wait_for_data(self, remaining_s: float) -> None:
        """Wait until the assigned partitions may have changed, at most ``remaining_s`` seconds."""
        if self._waiter is None:
            self._waiter = ChangeWaiter()
            self._watch()
            return  # read once more now that changes are watched, then wait
        cap = self.heartbeat_interval_ms / 1000 if self._member is not None else MAX_IDLE_WAIT_SECONDS
        self._waiter.wait(max(0.0, min(remaining_s, cap)))

    def _watch(self) -> None:
        assert self._waiter is not None
        dirs = [self.log.partition(tp.topic, tp.partition).directory for tp in self._positions]
        if self._member is not None and self.group_id is not None:
            dirs.append(group_dir(self.log.path, self.group_id) / MEMBERS_DIR)  # joins and clean leaves
        with suppress(OSError):  # a directory vanished (e.g. a group reaped): the next poll watches again
            self._waiter.set_watched(dirs)

    def wakeup(self) -> None:
        """Make the current (or next) ``poll`` raise :class:`WakeupError` at once; any thread may call it."""
        self._woken = True
        if self._waiter is not None:
            self._waiter.wakeup()

    def _check_wakeup(self) -> None:
        if self._woken:
            self._woken = False
            raise WakeupError("consumer woken up")

    def _note_pending_commits(self) -> None:
        """This member waits for offsets committed in an open transaction (see ``note_held_back``)."""
        if self.group_id is not None and (plog := self._store().partition_log_of(self.group_id)) is not None:
            note_held_back(self.log, plog)

    def _fetch_once(self, max_records: int | None) -> list[PolledBatch]:
        tps = list(self._positions)
        if not tps:
            return []
        waiting = self._pending_commits(tp for tp, pos in self._positions.items() if pos is None)
        if waiting:
            self._note_pending_commits()
        out: list[PolledBatch] = []
        budget = self.max_poll_bytes
        count = 0
        # Round-robin start so that one busy partition cannot starve the others.
        for k in range(len(tps)):
            tp = tps[(self._next + k) % len(tps)]
            if tp in waiting:
                continue  # its committed offset is about to change: wait for the transaction to end
            pos = self._positions[tp]
            if pos is None:
                pos = self._initialize(tp)
            plog = self.log.partition(tp.topic, tp.partition)
            try:
                read = read_visible(plog, pos, self.isolation_level, max_bytes=budget)
            except OffsetOutOfRangeError:
                if self.auto_offset_reset == "none":
                    raise
                pos = self._reset(tp)
                read = read_visible(plog, pos, self.isolation_level, max_bytes=budget)
            if read.held_back and not read.batches:
                note_held_back(self.log, plog)
            stopped = False
            for f in read.batches:
                records = f.records
                if f.header.base_offset < pos:
                    below = pc.less(records.column(0), pa.scalar(pos - f.header.base_offset, pa.int32()))
                    records = records.slice(pc.sum(below).as_py() or 0)
                truncated = False
                if max_records is not None and count + records.num_rows >= max_records:
                    truncated = count + records.num_rows > max_records
                    records = records.slice(0, max_records - count)
                if records.num_rows:
                    out.append(PolledBatch(tp.topic, f, records))
                    count += records.num_rows
                if truncated:
                    pos = f.header.base_offset + records.column(0)[records.num_rows - 1].as_py() + 1
                    stopped = True
                    break
                # whole batch delivered: skip any offsets compaction removed at its end
                pos = max(pos, f.header.next_offset)
                budget -= f.header.size
                if max_records is not None and count >= max_records:
                    stopped = True
                    break
            if not stopped:
                pos = max(pos, read.next_offset)  # past skipped batches (control, aborted) too
            self._positions[tp] = pos
            if budget <= 0 or (max_records is not None and count >= max_records):
                break
        self._next = (self._next + 1) % len(tps)
        return out

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Leave the group (committing first with auto-commit) and forget every position."""
        try:
            if self._member is not None:
                self.unsubscribe()
            elif self.group_id is not None and self.enable_auto_commit and self._positions:
                self.commit()
        finally:
            self._positions.clear()
            if self._waiter is not None:
                self._waiter.close()
                self._waiter = None
