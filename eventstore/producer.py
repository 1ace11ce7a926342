"""The producer: records in, durable batches out.

``send`` queues one record and returns a future of its :class:`RecordMetadata`; records
for the same partition are gathered into one batch until it reaches ``batch_size`` bytes
or is ``linger_ms`` old, then appended as one batch (one write, one fsync). ``send_batch``
appends many records at once from columns, with no per-record Python work at all.

Partitioning is Kafka's: a keyed record goes to ``murmur2(key) & 0x7fffffff % n``;
keyless records stick to one partition per batch and move round-robin to the next
partition when that batch is sent (Kafka's sticky partitioner). Compacted topics refuse
keyless records, as Kafka does.

A future completes only once its batch is durable under the log's fsync policy.

**Idempotence** (on by default, like Kafka ≥ 3.0): the producer gets a producer id from
the log's coordinator (:mod:`eventstore.transactions`) and numbers the records it sends
to each partition; a batch retried after a :class:`RetriableError` (its outcome unknown)
is stored once — the partition recognises the sequence range and returns the original
offsets (:mod:`eventstore.producer_state`). When retries run out the outcome stays
unknown, so the producer takes a new producer id (or, in a transaction, requires an
abort, which bumps the epoch).

**Transactions** (with ``transactional_id``): ``init_transactions`` (fences any previous
instance with the same id and finishes its transaction), then ``begin_transaction``,
``send``/``send_batch`` to any topics and partitions, ``send_offsets_to_transaction``
(consumer offsets committed atomically with the output), and ``commit_transaction`` or
``abort_transaction``. Each partition is registered with the coordinator (durably)
before the first batch of the transaction reaches it; commit writes the decision, then a
commit marker to every partition. ``read_committed`` consumers see all of it or none.

**Queued appends** (:meth:`Producer.send_batch_queued`, transactional producers): a batch of records is
encoded in the caller's thread and queued to a writer thread, which appends (writes and syncs) the
queued batches in order while the caller encodes the next; a future reports where they went. Nothing
of a transaction is visible before its commit anyway, so the caller need not wait for each append:
``flush``, ``commit_transaction`` and ``abort_transaction`` wait for the queue, as Kafka's do for its
sender. A queued append that fails fails the transaction (it must be aborted, with a new epoch, as
any send's failure); the batches queued after it are not written, and every call of the transaction
but the abort raises that error as the log raised it (a full disk stays a ``LogStorageError``).

Thread-safety: thread-safe. ``_lock`` guards the accumulator; appends happen outside it
under a per-partition send lock (which also orders sequence numbers). ``_txn_lock``
guards the transaction state. A background thread sends batches whose linger expired;
another (started on the first queued append) writes queued batches. A synchronous append
waits until the queue is empty, so appends reach each partition in the order they were sent.
A queued send is queued whole (its encoded batches as one item) or not at all, and a call that
raises once its sequence numbers are given out (an interrupt, Ctrl-C, while it waits for room)
fails the transaction. Futures are resolved with no lock held, by the writer thread: as in
Kafka, a done-callback should be short; it may send (a queued send from it never waits for
room; a synchronous send, flush, commit or abort there first appends what is queued, in that
thread), but close() from it is refused, and a callback must not make a synchronous send to a
partition another thread is sending to at that moment (that thread may be waiting for the
writer while holding the partition's send lock).
Transaction calls (begin/commit/abort) are meant for one thread at a time, as in Kafka.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eventstore.errors import (
    ConfigError,
    InvalidRecordError,
    InvalidTxnStateError,
    LogStorageError,
    OutOfOrderSequenceError,
    ProducerFencedError,
    RetriableError,
    TidelineError,
    TransactionAbortedError,
)
from eventstore.log import Log
from eventstore.partition_log import AppendResult
from eventstore.partitioner import partition_for_key, partitions_for_keys
from eventstore.producer_state import next_sequence
from eventstore.record_batch import (
    Codec,
    EncodedBatch,
    build_records,
    encode_batch,
    headers_array,
    timestamp_deltas_for,
)
from eventstore.topic import now_ms
from eventstore.transactions import DEFAULT_TRANSACTION_TIMEOUT_MS, OwnerLock, TransactionCoordinator

if TYPE_CHECKING:
    from eventstore.offsets import OffsetAndMetadata, TopicPartition

log = logging.getLogger(__name__)

Headers = list[tuple[str, bytes | None]]
RECORD_OVERHEAD = 24  # rough per-record bytes beyond key and value, for batch sizing
QUEUED_BATCHES = 4  # encoded batches waiting for the writer thread at most (send_batch_queued waits beyond)


@dataclass(frozen=True, slots=True)
class RecordMetadata:
    """Where an acknowledged record was stored."""

    topic: str
    partition: int
    offset: int
    timestamp: int


class _TxnState(enum.Enum):
    UNINITIALIZED = "uninitialized"  # transactional producer before init_transactions
    READY = "ready"  # no transaction open
    IN_TRANSACTION = "in_transaction"
    ABORTABLE = "abortable"  # a send of this transaction failed: only abort is allowed
    FATAL = "fatal"  # fenced: this producer instance can do nothing more


@dataclass(slots=True)
class _PendingBatch:
    topic: str
    partition: int
    created: float
    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)
    timestamps: list[int] = field(default_factory=list)
    headers: list[Headers | None] = field(default_factory=list)
    futures: list[Future[RecordMetadata]] = field(default_factory=list)
    size: int = 0
    has_headers: bool = False


@dataclass(slots=True)
class _QueuedSend:
    """One :meth:`Producer.send_batch_queued` call: ``count`` records to one partition, queued as one item."""

    topic: str
    partition: int
    count: int
    future: Future[tuple[int, int]] = field(default_factory=Future)
    first: int = -1  # the first batch's base offset, once appended
    error: BaseException | None = None
    taken: bool = False  # the writer thread took it off the queue (set under the producer's _lock)


class Producer:
    """Sends records to a :class:`~eventstore.log.Log`.

    >>> with Producer(log) as producer:                          # doctest: +SKIP
    ...     producer.send("orders", b'{"total": 3}', key=b"order-1").result()
    """

    def __init__(
        self,
        log: Log,
        *,
        linger_ms: int = 5,
        batch_size: int = 1 << 20,
        compression: Codec | None = None,
        enable_idempotence: bool = True,
        transactional_id: str | None = None,
        transaction_timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS,
        retries: int = 5,
        retry_backoff_ms: int = 10,
    ) -> None:
        if transactional_id is not None and not enable_idempotence:
            raise ConfigError("a transactional producer must be idempotent (enable_idempotence=True)")
        if retries < 0 or retry_backoff_ms < 0 or transaction_timeout_ms <= 0:
            raise ConfigError("retries and retry_backoff_ms must be ≥ 0 and transaction_timeout_ms > 0")
        self.log = log
        self.linger_ms = linger_ms
        self.batch_size = batch_size
        self.compression = compression
        self.enable_idempotence = enable_idempotence
        self.transactional_id = transactional_id
        self.transaction_timeout_ms = transaction_timeout_ms
        self.retries = retries
        self.retry_backoff_ms = retry_backoff_ms
        self._coordinator: TransactionCoordinator | None = None
        self._producer_id = -1
        self._epoch = -1
        self._owner: OwnerLock | None = None
        self._sequences: dict[tuple[str, int], int] = {}  # next sequence per partition
        self._txn_lock = threading.RLock()
        self._txn_state = _TxnState.UNINITIALIZED if transactional_id else _TxnState.READY
        self._txn_partitions: set[tuple[str, int]] = set()
        self._txn_error: BaseException | None = None
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], _PendingBatch] = {}
        self._sticky: dict[str, int] = {}
        self._closed = False
        self._in_flight: set[Future[Any]] = set()  # taken batches (and queued sends) not yet durable
        # queued appends (send_batch_queued): the writer thread; its queue of sends, each with its encoded batches,
        # and the send it is appending (both guarded by _lock; _queue_changed is notified whenever either changes);
        # the first failure of the open transaction
        self._writer: threading.Thread | None = None
        self._queue: deque[tuple[_QueuedSend, list[EncodedBatch]]] = deque()
        self._current: _QueuedSend | None = None
        self._queue_changed = threading.Condition(self._lock)
        self._queue_error: BaseException | None = None
        self._send_locks: dict[tuple[str, int], threading.RLock] = {}  # per partition: order of appends
        self._wake = threading.Condition(self._lock)
        self._sender = threading.Thread(target=self._linger_loop, name="tideline-producer", daemon=True)
        self._sender.start()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ send

    def send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
        timestamp: int | None = None,
    ) -> Future[RecordMetadata]:
        """Queue one record; the future resolves once it is durable. ``value=None`` is a tombstone."""
        if self._closed:
            raise TidelineError("producer is closed")
        self._check_can_send()
        meta = self.log.topic(topic)
        if key is None and meta.config.cleanup_policy.compacts:
            raise InvalidRecordError(f"compacted topic {topic!r} cannot accept a record without a key")
        if partition is None:
            partition = partition_for_key(key, meta.partitions) if key is not None else self._sticky_partition(topic)
        elif not 0 <= partition < meta.partitions:
            raise InvalidRecordError(f"topic {topic!r} has partitions 0 … {meta.partitions - 1}, not {partition}")
        future: Future[RecordMetadata] = Future()
        size = RECORD_OVERHEAD + (len(key) if key else 0) + (len(value) if value else 0)
        limit = self._batch_target(meta.config.max_batch_bytes)
        while True:
            with self._lock:
                batch = self._pending.get((topic, partition))
                if batch is None:
                    batch = self._pending[(topic, partition)] = _PendingBatch(topic, partition, time.monotonic())
                elif batch.size + size > limit:
                    batch = None  # the pending batch goes first: with this record it could pass the topic's limit
                if batch is not None:
                    batch.keys.append(key)
                    batch.values.append(value)
                    batch.timestamps.append(now_ms() if timestamp is None else timestamp)
                    batch.headers.append(headers)
                    batch.has_headers = batch.has_headers or headers is not None
                    batch.futures.append(future)
                    batch.size += size
                    full = batch.size >= limit or self.linger_ms == 0  # linger 0: send at once
                    break
            self._drain((topic, partition))
        if full:
            self._drain((topic, partition))
        return future

    def _drain(self, tp: tuple[str, int], *, older_than_ms: float | None = None) -> None:
        """Take the pending batch of ``tp`` and append it, holding ``tp``'s send lock.

        The send lock makes take-and-append atomic per partition, so batches reach the log
        in the order their records were sent, whichever thread sends them.
        """
        with self._send_lock(tp):
            with self._lock:
                batch = self._pending.get(tp)
                if batch is None:
                    return
                if older_than_ms is not None and (time.monotonic() - batch.created) * 1000 < older_than_ms:
                    return
                self._take(*tp)
            self._send_pending(batch)

    def _send_lock(self, tp: tuple[str, int]) -> threading.RLock:
        with self._lock:
            return self._send_locks.setdefault(tp, threading.RLock())

    def _sticky_partition(self, topic: str) -> int:
        with self._lock:
            return self._sticky.setdefault(topic, 0)

    def _take(self, topic: str, partition: int) -> _PendingBatch:
        """Remove a pending batch (caller holds the lock); move a sticky partition on."""
        batch = self._pending.pop((topic, partition))
        self._in_flight.update(batch.futures)
        if self._sticky.get(topic) == partition:
            self._sticky[topic] = (partition + 1) % self.log.topic(topic).partitions
        return batch

    def _send_pending(self, batch: _PendingBatch) -> None:
        try:
            first, max_ts, deltas = timestamp_deltas_for(batch.timestamps)
            records = build_records(batch.keys, batch.values, deltas, batch.headers if batch.has_headers else None)
            result = self._append(batch.topic, batch.partition, records, first, max_ts)
        except BaseException as e:
            if self.transactional_id is not None:
                with self._txn_lock:
                    self._txn_error = self._txn_error or e
            for f in batch.futures:
                f.set_exception(e)
            self._settled(batch)
            if not isinstance(e, Exception):
                raise
            return
        for i, f in enumerate(batch.futures):
            f.set_result(RecordMetadata(batch.topic, batch.partition, result + i, batch.timestamps[i]))
        self._settled(batch)

    def _settled(self, batch: _PendingBatch) -> None:
        with self._lock:
            self._in_flight.difference_update(batch.futures)

    def _append(self, topic: str, partition: int, records: pa.RecordBatch, first_ts: int, max_ts: int) -> int:
        """Encode and append one batch with this producer's id, epoch and next sequence."""
        tp = (topic, partition)
        codec = self.compression if self.compression is not None else self.log.topic(topic).config.compression
        with self._send_lock(tp):  # sequence numbers follow append order per partition
            self._wait_queue()  # queued batches (their sequence numbers given out already) go first
            pid, epoch, transactional = self._identity_for(tp)
            sequence = self._sequences.get(tp, 0) if pid >= 0 else -1
            encoded = encode_batch(
                records,
                first_timestamp=first_ts,
                max_timestamp=max_ts,
                codec=codec,
                producer_id=pid,
                producer_epoch=epoch,
                base_sequence=sequence,
                transactional=transactional,
            )
            result = self._append_with_retries(topic, partition, encoded)
            if pid >= 0:
                self._sequences[tp] = next_sequence(sequence, records.num_rows)
            return result.base_offset

    def _append_with_retries(self, topic: str, partition: int, encoded: EncodedBatch) -> AppendResult:
        """Append, retrying a transient failure with the *same* batch (same sequence)."""
        attempt = 0
        while True:
            try:
                result = self.log.append(topic, partition, encoded)
                if result.duplicate:
                    log.info(
                        "%s-%d: retried batch was already stored at offset %d", topic, partition, result.base_offset
                    )
                return result
            except (RetriableError, TimeoutError) as e:
                if attempt >= self.retries:
                    self._outcome_unknown(e)
                    raise
                attempt += 1
                time.sleep(self.retry_backoff_ms / 1000 * attempt)
            except ProducerFencedError:
                with self._txn_lock:
                    self._txn_state = _TxnState.FATAL
                raise
            except (OutOfOrderSequenceError, LogStorageError) as e:
                # LogStorageError: the partition cut the failed write, but if even that failed the
                # batch may be stored: never reuse its sequence numbers for other records
                self._outcome_unknown(e)
                raise

    def _outcome_unknown(self, error: BaseException) -> None:
        """A batch may or may not be stored: sequences can no longer be trusted."""
        with self._txn_lock:
            if self.transactional_id is not None:
                if self._txn_state is _TxnState.IN_TRANSACTION:
                    self._txn_state = _TxnState.ABORTABLE
                self._txn_error = self._txn_error or error
                if threading.current_thread() is self._writer:  # a queued append: with the state, atomically
                    self._queue_error = self._queue_error or error
            elif self.enable_idempotence:
                log.warning(
                    "producer %d: outcome of a batch unknown (%s); taking a new producer id", self._producer_id, error
                )
                self._producer_id = -1  # a fresh id (epoch 0, sequences from 0) on the next append
                self._sequences.clear()

    # ------------------------------------------------------------------ identity & transactions

    def _coord(self) -> TransactionCoordinator:
        if self._coordinator is None:
            self._coordinator = TransactionCoordinator(self.log)
        return self._coordinator

    def _identity_for(self, tp: tuple[str, int]) -> tuple[int, int, bool]:
        """``(producer_id, epoch, transactional)`` for a batch to ``tp``; registers ``tp`` with the transaction."""
        with self._txn_lock:
            if self.transactional_id is not None:
                self._check_can_send()
                if tp not in self._txn_partitions:
                    self._add_partitions([tp])
                return self._producer_id, self._epoch, True
            if not self.enable_idempotence:
                return -1, -1, False
            if self._producer_id < 0:
                self._producer_id, self._epoch = self._coord().allocate_producer_id(), 0
                self._sequences.clear()
            return self._producer_id, self._epoch, False

    def _add_partitions(self, tps: Iterable[tuple[str, int]]) -> None:
        new = set(tps) - self._txn_partitions
        if not new:
            return
        assert self.transactional_id is not None
        try:
            self._coord().add_partitions(self.transactional_id, self._producer_id, self._epoch, new)
        except ProducerFencedError:
            self._txn_state = _TxnState.FATAL
            raise
        self._txn_partitions |= new

    def _check_can_send(self) -> None:
        if self.transactional_id is None:
            return
        with self._txn_lock:
            state, queue_error = self._txn_state, self._queue_error
        if state is _TxnState.IN_TRANSACTION:
            return
        if state is _TxnState.ABORTABLE and queue_error is not None:
            raise queue_error  # a queued append failed: its error, as the log raised it (the sync path's way)
        if state is _TxnState.ABORTABLE:
            raise InvalidTxnStateError(
                f"transaction of {self.transactional_id!r} failed ({self._txn_error}); call abort_transaction()"
            )
        if state is _TxnState.FATAL:
            raise ProducerFencedError(f"producer {self.transactional_id!r} was fenced by a newer instance")
        raise InvalidTxnStateError(
            f"transactional producer {self.transactional_id!r} can only send inside begin_transaction()"
        )

    def add_partitions_to_transaction(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Register partitions with the open transaction in one coordinator write.

        Optional (every send registers its partition): a caller about to write to many
        partitions saves one durable coordinator write per partition.
        """
        self._check_can_send()
        with self._txn_lock:
            self._add_partitions(partitions)

    def init_transactions(self) -> None:
        """Register with the coordinator: fence older instances and finish their transaction."""
        if self.transactional_id is None:
            raise InvalidTxnStateError("init_transactions needs a transactional_id")
        self._wait_queue()  # a former session's queued batches are written (or fail) under its own epoch
        with self._txn_lock:
            if self._owner is not None:
                self._owner.release()
            pid, epoch, owner = self._coord().init_producer(
                self.transactional_id, timeout_ms=self.transaction_timeout_ms
            )
            self._producer_id, self._epoch, self._owner = pid, epoch, owner
            self._sequences.clear()
            self._txn_state = _TxnState.READY
            self._queue_error = None

    def begin_transaction(self) -> None:
        with self._txn_lock:
            if self._txn_state is _TxnState.FATAL:
                raise ProducerFencedError(f"producer {self.transactional_id!r} was fenced by a newer instance")
            if self._txn_state is not _TxnState.READY:
                raise InvalidTxnStateError(
                    f"cannot begin a transaction in state {self._txn_state.value}"
                    + (" (call init_transactions() first)" if self._txn_state is _TxnState.UNINITIALIZED else "")
                )
            self._txn_state = _TxnState.IN_TRANSACTION
            self._txn_partitions = set()
            self._txn_error = None
            self._queue_error = None

    def send_offsets_to_transaction(
        self, offsets: Mapping[TopicPartition, int | OffsetAndMetadata], group_id: str
    ) -> None:
        """Commit consumer offsets of ``group_id`` as part of this transaction (exactly-once pipelines)."""
        from eventstore.offsets import (
            OFFSETS_TOPIC,
            OffsetAndMetadata,
            ensure_offsets_topic,
            offset_commit_records,
        )

        self._check_can_send()
        normalized = {
            tp: o if isinstance(o, OffsetAndMetadata) else OffsetAndMetadata(o, "", now_ms())
            for tp, o in offsets.items()
        }
        if not normalized:
            return
        topic = ensure_offsets_topic(self.log)
        partition, keys, values = offset_commit_records(group_id, normalized, partitions=topic.partitions)
        ts = now_ms()
        self._append(OFFSETS_TOPIC, partition, build_records(keys, values), ts, ts)

    def commit_transaction(self) -> None:
        """Flush, then commit atomically everything sent since ``begin_transaction``."""
        with self._txn_lock:
            if self._txn_state is not _TxnState.IN_TRANSACTION:
                self._check_can_send()
        self.flush()
        with self._txn_lock:
            if self._txn_error is not None:
                self._txn_state = _TxnState.ABORTABLE
                self._raise_queue_error()  # a queued append failed: its error, as the log raised it
                raise InvalidTxnStateError(
                    f"transaction of {self.transactional_id!r} cannot commit: a send failed ({self._txn_error}); "
                    "call abort_transaction()"
                )
            self._end(commit=True)

    def abort_transaction(self) -> None:
        """Drop unsent records and abort everything sent since ``begin_transaction``."""
        with self._txn_lock:
            if self._txn_state not in (_TxnState.IN_TRANSACTION, _TxnState.ABORTABLE):
                self._check_can_send()
        with self._lock:
            dropped = list(self._pending.values())
            self._pending.clear()
            waiting = list(self._in_flight)
        for batch in dropped:
            for f in batch.futures:
                f.set_exception(TransactionAbortedError(f"transaction of {self.transactional_id!r} was aborted"))
        self._wait_queue()  # (in the writer thread, a future's callback: appends the queue there and then)
        wait(waiting)
        with self._txn_lock:
            # after the wait: a queued append that failed meanwhile made it abortable (sequences given out unused)
            self._end(commit=False, bump=self._txn_state is _TxnState.ABORTABLE)

    def _end(self, *, commit: bool, bump: bool = False) -> None:
        assert self.transactional_id is not None
        try:
            meta = self._coord().end_transaction(
                self.transactional_id, self._producer_id, self._epoch, commit=commit, bump_epoch=bump
            )
        except ProducerFencedError:
            self._txn_state = _TxnState.FATAL
            raise
        if meta.epoch != self._epoch:  # bumped: sequences restart at 0 under the new epoch
            self._epoch = meta.epoch
            self._sequences.clear()
        self._txn_state = _TxnState.READY
        self._txn_partitions = set()
        self._txn_error = None
        self._queue_error = None

    @property
    def producer_id(self) -> int:
        return self._producer_id

    @property
    def epoch(self) -> int:
        return self._epoch

    def send_batch(
        self,
        topic: str,
        values: Any,
        keys: Any = None,
        *,
        partition: int | None = None,
        timestamp: int | None = None,
        headers: Any = None,
    ) -> dict[int, tuple[int, int]]:
        """Append many records at once, synchronously, without a per-record Python loop.

        ``values``/``keys``: lists of ``bytes | None`` or Arrow binary arrays. Keys choose
        partitions (murmur2); keyless records go to ``partition`` or, if None, all to one
        partition (the next round-robin one). Returns ``{partition: (first offset, count)}``.
        All records get ``timestamp`` (default: now). ``headers``: None, or per record a
        list of ``(str, bytes | None)`` pairs or None (an Arrow array of the record
        batch's headers type also works). Durable on return.
        """
        self._check_can_send()
        meta = self.log.topic(topic)
        value_arr = values if isinstance(values, pa.Array) else pa.array(values, pa.binary())
        n = len(value_arr)
        if n == 0:
            return {}
        hdr_arr = headers_array(headers) if headers is not None else None
        if hdr_arr is not None and len(hdr_arr) != n:
            raise ValueError(f"{len(hdr_arr)} headers for {n} values")
        ts = now_ms() if timestamp is None else timestamp
        if keys is None:
            if meta.config.cleanup_policy.compacts:
                raise InvalidRecordError(f"compacted topic {topic!r} cannot accept records without keys")
            key_arr = pa.nulls(n, pa.binary())
            target = partition if partition is not None else self._next_round_robin(topic)
            return {target: (self._append_split(topic, target, key_arr, value_arr, ts, hdr_arr), n)}
        key_arr = keys if isinstance(keys, pa.Array) else pa.array(keys, pa.binary())
        if key_arr.null_count and meta.config.cleanup_policy.compacts:
            raise InvalidRecordError(f"compacted topic {topic!r} cannot accept records without keys")
        if partition is not None:
            return {partition: (self._append_split(topic, partition, key_arr, value_arr, ts, hdr_arr), n)}
        parts = partitions_for_keys(key_arr, meta.partitions)
        if key_arr.null_count:
            parts[parts < 0] = self._next_round_robin(topic)
        first_part = int(parts[0])
        if (parts == first_part).all():  # one partition: no reordering copy at all
            return {first_part: (self._append_split(topic, first_part, key_arr, value_arr, ts, hdr_arr), n)}
        # One stable reorder by partition (a single copy), then zero-copy slices per partition.
        order = np.argsort(parts, kind="stable")
        sorted_parts = parts[order]
        key_arr, value_arr = key_arr.take(order), value_arr.take(order)
        if hdr_arr is not None:
            hdr_arr = hdr_arr.take(order)
        uniques, starts = np.unique(sorted_parts, return_index=True)
        if self.transactional_id is not None:  # register every partition with one coordinator write
            with self._txn_lock:
                self._add_partitions((topic, p) for p in uniques.tolist())
        ends = [*starts[1:].tolist(), n]
        out: dict[int, tuple[int, int]] = {}
        for p, start, end in zip(uniques.tolist(), starts.tolist(), ends, strict=True):
            k, v = key_arr.slice(start, end - start), value_arr.slice(start, end - start)
            h = hdr_arr.slice(start, end - start) if hdr_arr is not None else None
            out[p] = (self._append_split(topic, p, k, v, ts, h), end - start)
        return out

    def send_batch_queued(
        self,
        topic: str,
        values: Any,
        keys: Any = None,
        *,
        partition: int,
        timestamp: int | None = None,
        headers: Any = None,
    ) -> Future[tuple[int, int]]:
        """:meth:`send_batch` to one partition inside a transaction, without waiting for the appends: the records
        are encoded now, in batches of about ``batch_size`` bytes, and queued to the writer thread (waiting while
        ``QUEUED_BATCHES`` are queued); the future gives ``(first offset, count)`` once all are durable, or the
        append's error. See "Queued appends" in the module docstring. Raises the error of an earlier queued
        append of this transaction that failed, as it was raised.
        """
        if self.transactional_id is None:
            raise InvalidTxnStateError("send_batch_queued needs a transactional producer")
        self._raise_queue_error()
        try:
            self._check_can_send()
        except InvalidTxnStateError:
            self._raise_queue_error()  # failed meanwhile
            raise
        meta = self.log.topic(topic)
        if not 0 <= partition < meta.partitions:
            raise InvalidRecordError(f"topic {topic!r} has partitions 0 … {meta.partitions - 1}, not {partition}")
        value_arr = values if isinstance(values, pa.Array) else pa.array(values, pa.binary())
        n = len(value_arr)
        key_arr = pa.nulls(n, pa.binary()) if keys is None else keys if isinstance(keys, pa.Array) else pa.array(
            keys, pa.binary())  # fmt: skip
        if key_arr.null_count and meta.config.cleanup_policy.compacts:
            raise InvalidRecordError(f"compacted topic {topic!r} cannot accept records without keys")
        hdr_arr = headers_array(headers) if headers is not None else None
        if hdr_arr is not None and len(hdr_arr) != n:
            raise ValueError(f"{len(hdr_arr)} headers for {n} values")
        ts = now_ms() if timestamp is None else timestamp
        tp = (topic, partition)
        codec = self.compression if self.compression is not None else meta.config.compression
        starts = self._batch_starts(meta.config.max_batch_bytes, key_arr, value_arr)
        send = _QueuedSend(topic, partition, n)
        send.future.set_running_or_notify_cancel()  # running: a caller's cancel() cannot strand the writer
        if n == 0:
            send.future.set_result((-1, 0))
            return send.future
        self._start_writer()
        with self._send_lock(tp):  # sequence numbers follow queue order per partition
            try:
                pid, epoch, transactional = self._identity_for(tp)  # registers tp with the transaction first
            except InvalidTxnStateError:
                self._raise_queue_error()
                raise
            sequence = self._sequences.get(tp, 0)
            encoded: list[EncodedBatch] = []
            for start, end in zip(starts, [*starts[1:], n], strict=True):  # all encoded before any is queued
                hdr = hdr_arr.slice(start, end - start) if hdr_arr is not None else None
                records = build_records(key_arr.slice(start, end - start), value_arr.slice(start, end - start), None,
                                        hdr)  # fmt: skip
                encoded.append(encode_batch(records, first_timestamp=ts, max_timestamp=ts, codec=codec,
                                            producer_id=pid, producer_epoch=epoch, base_sequence=sequence,
                                            transactional=transactional))  # fmt: skip
                sequence = next_sequence(sequence, records.num_rows)
            try:
                self._sequences[tp] = sequence  # given out: the writer appends in queue order, or fails the txn
                self._put(send, encoded)
            except BaseException as e:  # interrupted (a KeyboardInterrupt while waiting for room, or closed)
                self._not_queued(send, e)
                raise
        return send.future

    def _put(self, send: _QueuedSend, encoded: list[EncodedBatch]) -> None:
        """Queue ``send`` with its batches as one item (one ``deque.append``: queued whole or not at all), waiting
        while the queue holds more than ``QUEUED_BATCHES`` batches with it (an empty queue takes a send of any
        size; a send from a future's callback, in the writer thread itself, never waits)."""
        in_writer = threading.current_thread() is self._writer
        with self._lock:
            while (self._queue and not in_writer and not self._closed
                   and sum(len(b) for _, b in self._queue) + len(encoded) > QUEUED_BATCHES):  # fmt: skip
                self._queue_changed.wait()
            if self._closed:
                raise TidelineError("producer is closed")
            self._in_flight.add(send.future)
            self._queue.append((send, encoded))
            self._queue_changed.notify_all()

    def _not_queued(self, send: _QueuedSend, error: BaseException) -> None:
        """``send_batch_queued`` raised ``error`` once ``send``'s sequence numbers were given out: the transaction
        must abort (with a new epoch) and every later call of it raises ``error``. Unless the send got into the
        queue all the same (an interrupt after its append: the writer resolves it), its future fails too."""
        self._fail_queued(error)
        with self._lock:
            if send.taken or any(queued is send for queued, _ in self._queue):
                return
            self._in_flight.discard(send.future)
        send.future.set_exception(error)

    def _fail_queued(self, error: BaseException) -> None:
        """A queued send failed, or one's sequence numbers were given out unused: the transaction must abort (with
        a new epoch: sequences restart), the rest of its queue is not written, and its calls raise ``error``."""
        with self._txn_lock:
            self._queue_error = self._queue_error or error
            self._txn_error = self._txn_error or error
            if self._txn_state is _TxnState.IN_TRANSACTION:
                self._txn_state = _TxnState.ABORTABLE

    def _raise_queue_error(self) -> None:
        """A queued append of the open transaction failed: its error, as the log raised it."""
        error = self._queue_error
        if error is not None:
            raise error

    def _start_writer(self) -> None:
        with self._lock:
            if self._closed:
                raise TidelineError("producer is closed")
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, name="tideline-producer-writer",
                                                daemon=True)  # fmt: skip
                self._writer.start()

    def _write_queued(self) -> None:
        """The writer thread: append queued sends in order; after a failure, fail the rest of the transaction's."""
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._queue_changed.wait()
                if not self._queue:
                    return  # closed, nothing left
            self._write_next()

    def _write_next(self) -> None:
        """(In the writer thread.) Append the first queued send's batches, then resolve its future with no lock
        held: a done-callback may call the producer (a synchronous send it makes drains the queue first, here)."""
        with self._lock:
            send, batches = self._queue.popleft()
            send.taken = True
            self._current = send
            self._queue_changed.notify_all()  # room for the next send
        for batch in batches:
            try:
                if self._queue_error is not None:  # an earlier one failed: the sequence numbers would not follow
                    raise self._queue_error
                result = self._append_with_retries(send.topic, send.partition, batch)
                if send.first < 0:
                    send.first = result.base_offset
            except BaseException as e:
                send.error = send.error or e
                self._fail_queued(e)
        with self._lock:
            self._current = None
            self._in_flight.discard(send.future)
            self._queue_changed.notify_all()
        if send.error is not None:
            send.future.set_exception(send.error)
        else:
            send.future.set_result((send.first, send.count))

    def _wait_queue(self) -> None:
        """Until the writer thread has appended (or failed) every queued batch. (Its futures may resolve later.)
        Called by the writer thread itself (a future's callback that sends synchronously): it appends what is
        queued there and then, so the synchronous append still comes after them."""
        if threading.current_thread() is self._writer:
            while True:
                with self._lock:
                    if not self._queue:
                        return
                self._write_next()
        with self._lock:
            while self._queue or self._current is not None:
                self._queue_changed.wait()

    def _next_round_robin(self, topic: str) -> int:
        with self._lock:
            p = self._sticky.setdefault(topic, 0)
            self._sticky[topic] = (p + 1) % self.log.topic(topic).partitions
            return p

    def _batch_target(self, max_batch_bytes: int) -> int:
        """Bytes of a batch at most: ``batch_size``, and half the topic's ``max_batch_bytes`` (see _batch_starts)."""
        return min(self.batch_size, max_batch_bytes // 2)

    def _batch_starts(self, max_batch_bytes: int, keys: pa.Array, values: pa.Array) -> list[int]:
        """Where each batch of these records starts: batches of about ``batch_size`` bytes of keys, values and
        RECORD_OVERHEAD each, cut by the records' own sizes and never above half the topic's ``max_batch_bytes``,
        so a producer's batch size above a topic's limit splits its batches rather than having them refused
        (Kafka's producer splits a batch the broker refuses as too large); a record alone over the limit still is.
        (Headers are not counted: the half is their room.)"""
        n = len(values)
        target = self._batch_target(max_batch_bytes)
        if values.nbytes + keys.nbytes + RECORD_OVERHEAD * n <= target:
            return [0] if n else []
        sizes = (pc.binary_length(values).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                 + pc.binary_length(keys).fill_null(0).to_numpy(zero_copy_only=False) + RECORD_OVERHEAD)  # fmt: skip
        ends = np.cumsum(sizes)
        starts, start = [], 0
        while start < n:
            starts.append(start)
            before = int(ends[start - 1]) if start else 0
            start = max(start + 1, int(np.searchsorted(ends, before + target, side="right")))
        return starts

    def _append_split(
        self, topic: str, partition: int, keys: pa.Array, values: pa.Array, ts: int, headers: pa.Array | None = None
    ) -> int:
        """Append as batches of about ``batch_size`` bytes; return the first offset."""
        n = len(values)
        starts = self._batch_starts(self.log.topic(topic).config.max_batch_bytes, keys, values)
        first = -1
        for start, end in zip(starts, [*starts[1:], n], strict=True):
            hdr = headers.slice(start, end - start) if headers is not None else None
            records = build_records(keys.slice(start, end - start), values.slice(start, end - start), None, hdr)
            base = self._append(topic, partition, records, ts, ts)
            if first < 0:
                first = base
        return first

    # ------------------------------------------------------------------ lifecycle

    def _linger_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                # linger_ms=0 sends from send() itself: nothing to wait for (no busy loop)
                self._wake.wait(self.linger_ms / 1000 if self.linger_ms > 0 else None)
                if self._closed:
                    return
                now = time.monotonic()
                due = [tp for tp, b in self._pending.items() if (now - b.created) * 1000 >= self.linger_ms]
            for tp in due:
                self._drain(tp, older_than_ms=self.linger_ms)

    def flush(self) -> None:
        """Send every queued record now and wait until all are durable (or failed)."""
        with self._lock:
            tps = list(self._pending)
            waiting = list(self._in_flight)
        for tp in tps:
            self._drain(tp)
        self._wait_queue()  # (in the writer thread, a future's callback: appends the queue there and then)
        wait(waiting)

    def close(self) -> None:
        """Flush, abort a transaction left open, stop the sender thread, release the producer id.

        Closes even when the abort or the flush fails (and then raises that error): the transaction
        left open is the next instance's to abort (``init_transactions``), or recovery's once the
        released owner lock shows this instance gone.
        """
        if self._closed:
            return
        if threading.current_thread() is self._writer:  # Kafka's producer refuses to wait for itself there too
            raise InvalidTxnStateError("close() cannot be called from a queued send's callback (the producer's "
                                       "writer thread runs it): close the producer from another thread")  # fmt: skip
        with self._txn_lock:
            open_txn = self._txn_state in (_TxnState.IN_TRANSACTION, _TxnState.ABORTABLE)
        try:
            if open_txn:
                log.warning("producer %r closed inside a transaction: aborting it", self.transactional_id)
                self.abort_transaction()
            self.flush()
        finally:
            with self._lock:
                self._closed = True
                self._wake.notify_all()
                self._queue_changed.notify_all()  # the writer ends once the queue is empty
                writer = self._writer
            self._sender.join()
            if writer is not None:
                writer.join()
            if self._owner is not None:
                self._owner.release()
                self._owner = None
