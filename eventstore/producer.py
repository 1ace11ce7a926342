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

Thread-safety: thread-safe. ``_lock`` guards the accumulator; appends happen outside it
(the partition has its own lock). A background thread sends batches whose linger expired.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa

from eventstore.errors import InvalidRecordError, TidelineError
from eventstore.log import Log
from eventstore.partitioner import partition_for_key, partitions_for_keys
from eventstore.record_batch import Codec, build_records, encode_batch, timestamp_deltas_for
from eventstore.topic import now_ms

Headers = list[tuple[str, bytes | None]]
RECORD_OVERHEAD = 24  # rough per-record bytes beyond key and value, for batch sizing


@dataclass(frozen=True, slots=True)
class RecordMetadata:
    """Where an acknowledged record was stored."""

    topic: str
    partition: int
    offset: int
    timestamp: int


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
    ) -> None:
        self.log = log
        self.linger_ms = linger_ms
        self.batch_size = batch_size
        self.compression = compression
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], _PendingBatch] = {}
        self._sticky: dict[str, int] = {}
        self._closed = False
        self._in_flight: set[Future[RecordMetadata]] = set()  # taken batches not yet durable
        self._send_locks: dict[tuple[str, int], threading.Lock] = {}  # per partition: order of appends
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
        meta = self.log.topic(topic)
        if key is None and meta.config.cleanup_policy.compacts:
            raise InvalidRecordError(f"compacted topic {topic!r} cannot accept a record without a key")
        if partition is None:
            partition = partition_for_key(key, meta.partitions) if key is not None else self._sticky_partition(topic)
        elif not 0 <= partition < meta.partitions:
            raise InvalidRecordError(f"topic {topic!r} has partitions 0 … {meta.partitions - 1}, not {partition}")
        future: Future[RecordMetadata] = Future()
        full = False
        with self._lock:
            batch = self._pending.get((topic, partition))
            if batch is None:
                batch = self._pending[(topic, partition)] = _PendingBatch(topic, partition, time.monotonic())
            batch.keys.append(key)
            batch.values.append(value)
            batch.timestamps.append(now_ms() if timestamp is None else timestamp)
            batch.headers.append(headers)
            batch.has_headers = batch.has_headers or headers is not None
            batch.futures.append(future)
            batch.size += RECORD_OVERHEAD + (len(key) if key else 0) + (len(value) if value else 0)
            full = batch.size >= self.batch_size
        if full:
            self._drain((topic, partition))
        return future

    def _drain(self, tp: tuple[str, int], *, older_than_ms: float | None = None) -> None:
        """Take the pending batch of ``tp`` and append it, holding ``tp``'s send lock.

        The send lock makes take-and-append atomic per partition, so batches reach the log
        in the order their records were sent, whichever thread sends them.
        """
        with self._lock:
            send_lock = self._send_locks.setdefault(tp, threading.Lock())
        with send_lock:
            with self._lock:
                batch = self._pending.get(tp)
                if batch is None:
                    return
                if older_than_ms is not None and (time.monotonic() - batch.created) * 1000 < older_than_ms:
                    return
                self._take(*tp)
            self._send_pending(batch)

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
        codec = self.compression if self.compression is not None else self.log.topic(topic).config.compression
        encoded = encode_batch(records, first_timestamp=first_ts, max_timestamp=max_ts, codec=codec)
        return self.log.append(topic, partition, encoded).base_offset

    def send_batch(
        self,
        topic: str,
        values: Any,
        keys: Any = None,
        *,
        partition: int | None = None,
        timestamp: int | None = None,
    ) -> dict[int, tuple[int, int]]:
        """Append many records at once, synchronously, without a per-record Python loop.

        ``values``/``keys``: lists of ``bytes | None`` or Arrow binary arrays. Keys choose
        partitions (murmur2); keyless records go to ``partition`` or, if None, all to one
        partition (the next round-robin one). Returns ``{partition: (first offset, count)}``.
        All records get ``timestamp`` (default: now). Durable on return.
        """
        meta = self.log.topic(topic)
        value_arr = values if isinstance(values, pa.Array) else pa.array(values, pa.binary())
        n = len(value_arr)
        if n == 0:
            return {}
        ts = now_ms() if timestamp is None else timestamp
        if keys is None:
            if meta.config.cleanup_policy.compacts:
                raise InvalidRecordError(f"compacted topic {topic!r} cannot accept records without keys")
            key_arr = pa.nulls(n, pa.binary())
            target = partition if partition is not None else self._next_round_robin(topic)
            return {target: (self._append_split(topic, target, key_arr, value_arr, ts), n)}
        key_arr = keys if isinstance(keys, pa.Array) else pa.array(keys, pa.binary())
        if key_arr.null_count and meta.config.cleanup_policy.compacts:
            raise InvalidRecordError(f"compacted topic {topic!r} cannot accept records without keys")
        if partition is not None:
            return {partition: (self._append_split(topic, partition, key_arr, value_arr, ts), n)}
        parts = partitions_for_keys(key_arr, meta.partitions)
        if key_arr.null_count:
            parts[parts < 0] = self._next_round_robin(topic)
        first_part = int(parts[0])
        if (parts == first_part).all():  # one partition: no reordering copy at all
            return {first_part: (self._append_split(topic, first_part, key_arr, value_arr, ts), n)}
        # One stable reorder by partition (a single copy), then zero-copy slices per partition.
        order = np.argsort(parts, kind="stable")
        sorted_parts = parts[order]
        key_arr, value_arr = key_arr.take(order), value_arr.take(order)
        uniques, starts = np.unique(sorted_parts, return_index=True)
        ends = [*starts[1:].tolist(), n]
        out: dict[int, tuple[int, int]] = {}
        for p, start, end in zip(uniques.tolist(), starts.tolist(), ends, strict=True):
            k, v = key_arr.slice(start, end - start), value_arr.slice(start, end - start)
            out[p] = (self._append_split(topic, p, k, v, ts), end - start)
        return out

    def _next_round_robin(self, topic: str) -> int:
        with self._lock:
            p = self._sticky.setdefault(topic, 0)
            self._sticky[topic] = (p + 1) % self.log.topic(topic).partitions
            return p

    def _append_split(self, topic: str, partition: int, keys: pa.Array, values: pa.Array, ts: int) -> int:
        """Append as batches of about ``batch_size`` bytes; return the first offset."""
        n = len(values)
        total = values.nbytes + keys.nbytes + RECORD_OVERHEAD * n
        per_batch = max(1, int(n * self.batch_size / max(total, 1)))
        first = -1
        for start in range(0, n, per_batch):
            records = build_records(keys.slice(start, per_batch), values.slice(start, per_batch))
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
                self._wake.wait(self.linger_ms / 1000)
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
        wait(waiting)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._sender.join()
