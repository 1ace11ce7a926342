"""The embedded log (eventstore/) as capture's sink: one transactional producer, partitions computed once.

A batch's records are placed by murmur2 of their key bytes **once**, here (Arrow +
numpy, no per-record Python); every partition the batch touches, plus partition 0 of
the positions topic, is registered with the transaction coordinator in one write; then
each partition's slice is appended with its partition given, so the producer does not
compute the placement again. Keyless records (keyless tables) of one batch go to one
partition, the next in round-robin order.

Durability: appends are queued (:meth:`eventstore.producer.Producer.send_batch_queued`: encoded
here, written and synced by the producer's writer thread while the next batch is prepared), as
Kafka's producer queues them; :meth:`EmbeddedLogSink.commit` first waits for every queued append of
the transaction (raising a failed one's error as the log raised it), then appends the position and
commits, and ``commit_transaction`` returns once the commit markers are durable under the log's
fsync policy (default: fsync per produced batch / per transaction). So ``commit`` returning means
the events and the position are stored, and offsets are reported then.

Local state lives in ``<log dir>/_capture/`` (the log ignores directories that are not
``<topic>-<n>`` partitions of a known topic).

Thread-safety: none; used by the connector thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture.sinks import ReadBatch, RoundRobin, TopicRecords, TopicSpec, check_cleanup_policy
from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import TopicExistsError
from eventstore.isolation import IsolationLevel, end_offset
from eventstore.log import Log
from eventstore.partitioner import partitions_for_keys
from eventstore.producer import Producer
from eventstore.record_batch import Codec
from eventstore.schema_store import LogSchemaStore
from eventstore.topic import TopicConfig
from schemas.registry import SchemaStore

STATE_DIR = "_capture"
# Record batches of up to 2 MiB, rather than the producer's 1 MiB: the log syncs each one, and a big transaction
# (the initial snapshot: gigabytes in one) spends most of its append time in those syncs. The bench's
# 5,000,000-row snapshot (2.4 GB of events, 3 runs each, queued appends): 1,520 syncs and 815–873k rows/s,
# against 2,520 syncs and 743–836k with 1 MiB; 4 MiB did worse (626–754k: fewer syncs, but its writes into
# the page cache took twice as long). Streaming's small transactions write smaller batches than either.
RECORD_BATCH_BYTES = 2 << 20

log = logging.getLogger("capture.sink")


class EmbeddedLogSink:
    """Capture's sink over an open :class:`eventstore.log.Log`."""

    commits_behind = False  # committed in line (its producer's writer thread writes and syncs the appends meanwhile)

    def __init__(self, log: Log) -> None:
        self.log = log
        self.producer: Producer | None = None
        self._partitions: dict[str, int] = {}
        self._round_robin = RoundRobin()
        self._registered: set[tuple[str, int]] = set()  # partitions already in the open transaction
        self._queued: list[tuple[tuple[str, int], Future[tuple[int, int]]]] = []  # the transaction's appends
        self._compression: Codec | None = None  # None: each topic's own compression setting

    def describe(self) -> str:
        return f"embedded log {self.log.path}"

    def set_compression(self, codec: str | None) -> None:
        self._compression = None if codec is None else Codec.parse(codec)

    def open(self, transactional_id: str) -> None:
        if self.producer is not None:
            self.producer.close()
        self._queued.clear()
        self.producer = Producer(self.log, transactional_id=transactional_id, linger_ms=0,
                                 batch_size=RECORD_BATCH_BYTES, compression=self._compression)  # fmt: skip
        self.producer.init_transactions()  # aborts what a killed predecessor left open, fences zombies

    def _producer(self) -> Producer:
        if self.producer is None:
            raise RuntimeError("sink not opened")
        return self.producer

    # ------------------------------------------------------------------ topics

    def ensure_topic(self, topic: str, spec: TopicSpec) -> int:
        n = self._partitions.get(topic)
        if n is not None:
            return n
        if topic not in self.log.topics():
            overrides = {**({"cleanup_policy": "compact"} if spec.compact else {}), **spec.overrides}
            try:
                self.log.create_topic(topic, spec.partitions, TopicConfig(), overrides=overrides)
                log.info("capture: created topic %s (%d partitions, %s)", topic, spec.partitions, overrides)
            except TopicExistsError:
                pass  # another process created it between the check and here: checked below like any other
        meta = self.log.topic(topic)
        check_cleanup_policy(topic, spec, meta.config.cleanup_policy, what="topic", setting="cleanup_policy")
        self._partitions[topic] = meta.partitions
        return meta.partitions

    def topic_incarnation(self, topic: str) -> str | None:
        if topic not in self.log.topics():
            return None
        return str(self.log.topic(topic).created_ms)

    # ------------------------------------------------------------------ writing

    def begin(self) -> None:
        self._producer().begin_transaction()
        self._registered.clear()
        self._queued.clear()

    def append(
        self, batch: Mapping[str, TopicRecords], *, also: Iterable[tuple[str, int]] = ()
    ) -> dict[tuple[str, int], int]:
        producer = self._producer()
        plan: list[tuple[str, int, pa.Array, pa.Array, pa.Array | None]] = []
        for topic, records in batch.items():
            if not len(records):
                continue
            n = self._partitions.get(topic) or self.log.topic(topic).partitions
            keys, values = records.arrays()
            headers = records.headers
            if n == 1 or keys.null_count == len(keys):
                target = 0 if n == 1 else self._round_robin.next(topic, n)
                plan.append((topic, target, keys, values, headers))
                continue
            parts = partitions_for_keys(keys, n)
            if keys.null_count:  # keyless records among keyed ones: one partition for them
                parts[parts < 0] = self._round_robin.next(topic, n)
            order = np.argsort(parts, kind="stable")
            sorted_parts = parts[order]
            uniques, starts = np.unique(sorted_parts, return_index=True)
            ends = [*starts[1:].tolist(), len(parts)]
            take = pa.array(order)
            keys, values = keys.take(take), values.take(take)
            ordered_headers = [headers[i] for i in order.tolist()] if headers is not None else None
            for p, start, end in zip(uniques.tolist(), starts.tolist(), ends, strict=True):
                h = ordered_headers[start:end] if ordered_headers is not None else None
                plan.append((topic, p, keys.slice(start, end - start), values.slice(start, end - start), h))
        new = ({(topic, p) for topic, p, *_ in plan} | set(also)) - self._registered
        if new:
            producer.add_partitions_to_transaction(new)  # one coordinator write for all of them
            self._registered |= new
        for topic, p, keys, values, headers in plan:
            self._queued.append(((topic, p), producer.send_batch_queued(topic, values, keys, partition=p,
                                                                         headers=headers)))  # fmt: skip
        return {}  # the offsets come with the commit (the appends are queued)

    def _appended(self) -> dict[tuple[str, int], int]:
        """Wait for the transaction's queued appends: the next offset per partition they wrote. A failed one's
        error is raised as the log raised it (a full disk stays a LogStorageError, and is retried as one)."""
        written: dict[tuple[str, int], int] = {}
        for tp, future in self._queued:
            first, count = future.result()
            if count:
                written[tp] = max(written.get(tp, 0), first + count)
        return written

    def commit(self, position_topic: str, key: bytes | None, value: bytes | None) -> dict[tuple[str, int], int]:
        producer = self._producer()
        written = self._appended()
        if value is not None:
            if (position_topic, 0) not in self._registered:
                producer.add_partitions_to_transaction([(position_topic, 0)])
            producer.send_batch(position_topic, [value], [key], partition=0)
        producer.commit_transaction()
        self._registered.clear()
        self._queued.clear()
        return written

    def abort(self) -> None:
        self._queued.clear()  # abort_transaction waits for them (what is appended is aborted)
        self._producer().abort_transaction()
        self._registered.clear()

    # ------------------------------------------------------------------ reading

    def end_offsets(self, topic: str) -> dict[int, int]:
        if topic not in self.log.topics():
            return {}
        n = self.log.topic(topic).partitions
        return {p: end_offset(self.log.partition(topic, p), IsolationLevel.READ_COMMITTED) for p in range(n)}

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[ReadBatch]:
        if start >= end:
            return
        tp = TopicPartition(topic, partition)
        with Consumer(self.log, enable_auto_commit=False, isolation_level=IsolationLevel.READ_COMMITTED) as consumer:
            consumer.assign([tp])
            consumer.seek(tp, max(start, consumer.beginning_offsets([tp])[tp]))
            while consumer.position(tp) < end and (records := consumer.poll(timeout_ms=0)):
                for b in records.batches:
                    offsets = b.offsets()
                    mask = pc.and_(pc.greater_equal(offsets, start), pc.less(offsets, end))
                    if not pc.all(mask).as_py():
                        offsets = offsets.filter(mask)
                        keys, values = b.records.column(2).filter(mask), b.records.column(3).filter(mask)
                    else:
                        keys, values = b.records.column(2), b.records.column(3)
                    if len(offsets):
                        yield ReadBatch(offsets.to_pylist(), keys.to_pylist(), values.to_pylist())

    def read_last(self, topic: str, partition: int, key: bytes) -> bytes | None:
        if topic not in self.log.topics():
            return None
        found: bytes | None = None
        wanted = pa.scalar(key, pa.binary())
        end = self.end_offsets(topic).get(partition, 0)
        tp = TopicPartition(topic, partition)
        with Consumer(self.log, enable_auto_commit=False, isolation_level=IsolationLevel.READ_COMMITTED) as consumer:
            consumer.assign([tp])
            consumer.seek_to_beginning()
            while consumer.position(tp) < end and (records := consumer.poll(timeout_ms=0)):
                for b in records.batches:
                    hits = b.records.column(3).filter(pc.equal(b.records.column(2), wanted))
                    if len(hits):
                        found = hits[len(hits) - 1].as_py()
        return found

    def schema_store(self) -> SchemaStore:
        return LogSchemaStore(self.log)  # the log's __schemas topic

    def default_state_dir(self) -> Path:
        return self.log.path / STATE_DIR

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
