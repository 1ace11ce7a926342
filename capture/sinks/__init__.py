"""The sink seam: where the connector hands a finished batch of events plus its position, atomically.

A :class:`Sink` is one log backend seen from capture. The connector (capture.connector)
and its sources only ever call these methods, so a backend is added by writing one
class — the embedded log (:class:`capture.sinks.embedded.EmbeddedLogSink`) and Apache Kafka
(:class:`capture.sinks.kafka.KafkaLogSink`) — and running the sink contract tests
(tests/capture/test_sinks.py) against it.

Contract (every implementation keeps it):

* **Atomic, durable commit.** Records appended between :meth:`Sink.begin` and
  :meth:`Sink.commit` become visible to ``read_committed`` readers together with the
  position record passed to ``commit``, or not at all; ``commit`` returns only once the
  backend says they are durable. :meth:`Sink.abort` discards them.
* **One writer.** :meth:`Sink.open` takes the connector's identity (its transactional
  id): a predecessor's open transaction is aborted, and a zombie with the same identity
  is fenced (its next commit fails).
* **Partitioning** is the backend's Kafka-compatible murmur2 of the key bytes; records
  without a key (keyless tables) go to one partition per batch, round-robin.
* **Reads** (:meth:`Sink.read`, :meth:`Sink.read_last`) see committed data only. With Kafka a
  commit's markers are written just after ``commit`` returns, so other readers see the batch
  moments later (never a part of it); a writer's own ``open`` waits for what its predecessor
  left to be completed.

Thread-safety: a sink is used by the connector thread only.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from eventstore.errors import ConfigError
from eventstore.topic import CleanupPolicy
from schemas.registry import SchemaStore

Headers = list[tuple[str, bytes | None]]


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """How a topic the connector writes is created on first sight."""

    compact: bool  # cleanup_policy=compact (table topics with keys, the positions topic)
    partitions: int
    keyless: bool = False  # records without keys go there (a keyless table): it must not compact
    overrides: Mapping[str, str] = field(default_factory=dict)  # other settings, the embedded log's names


@dataclass(slots=True)
class TopicRecords:
    """Records of one topic in one batch, in order: ``chunks`` (Arrow binary arrays of keys and values, no
    headers: snapshot reads encoded in bulk), then the parallel lists (headers: None when no record has any).

    Sinks take them with :meth:`arrays` (the embedded log: no Python object per record) or :meth:`lists`.
    """

    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)
    headers: list[Headers | None] | None = None
    chunks: list[tuple[pa.Array, pa.Array]] = field(default_factory=list)  # (keys, values), before the lists

    def __len__(self) -> int:
        return len(self.values) + sum(len(v) for _, v in self.chunks)

    def add_arrays(self, keys: pa.Array, values: pa.Array) -> None:
        """Records as Arrow binary arrays (keys may be all null), after those already here."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        if self.headers is not None:  # records with headers before: one list keeps them aligned
            self.keys.extend(keys.to_pylist())
            self.values.extend(values.to_pylist())
            self.headers.extend([None] * len(values))
            return
        if self.values:
            self.chunks.append((pa.array(self.keys, pa.binary()), pa.array(self.values, pa.binary())))
            self.keys, self.values = [], []
        self.chunks.append((keys, values))

    def lift_chunks(self) -> None:
        """Turn the chunks into list entries (before a record with headers joins the lists)."""
        if self.chunks:
            keys, values = self.lists()
            self.keys, self.values, self.chunks = keys, values, []

    def arrays(self) -> tuple[pa.Array, pa.Array]:
        """Every key and value, in order, as two Arrow binary arrays."""
        parts = self.array_chunks()
        if len(parts) == 1:
            return parts[0]
        return pa.concat_arrays([k for k, _ in parts]), pa.concat_arrays([v for _, v in parts])

    def array_chunks(self) -> list[tuple[pa.Array, pa.Array]]:
        """Every key and value, in order, as Arrow binary arrays in chunks (the chunks, then the lists as one):
        for a sink that takes them chunk by chunk, without concatenating them first."""
        parts = list(self.chunks)
        if self.values or not self.chunks:
            parts.append((pa.array(self.keys, pa.binary()), pa.array(self.values, pa.binary())))
        return parts

    def lists(self) -> tuple[list[bytes | None], list[bytes | None]]:
        """Every key and value, in order, as two lists."""
        if not self.chunks:
            return self.keys, self.values
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        for k, v in self.chunks:
            keys.extend(k.to_pylist())
            values.extend(v.to_pylist())
        return keys + self.keys, values + self.values


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """Committed records of one partition, in offset order."""

    offsets: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]


class Sink(Protocol):
    """One log backend, as capture uses it (see the module docstring for the contract)."""

    # True: :meth:`commit` may run in a worker thread while the connector thread decodes the next batch into memory
    # (capture.writer.LogWriter.commit_behind); no other method is called until it returned.
    commits_behind: bool

    def describe(self) -> str:
        """For log lines: which log this is (a directory, a bootstrap list)."""
        ...

    def set_compression(self, codec: str | None) -> None:
        """Compress the record batches written from the next :meth:`open` on with ``codec`` (none, gzip, lz4, zstd;
        None: the backend's own default)."""
        ...

    def open(self, transactional_id: str) -> None:
        """Become the one writer with this identity: abort what a predecessor left open, fence zombies."""
        ...

    def ensure_topic(self, topic: str, spec: TopicSpec) -> int:
        """Create the topic if missing (raising if an existing one contradicts ``spec``); its partition count."""
        ...

    def topic_incarnation(self, topic: str) -> str | None:
        """Something that changes when the topic is deleted and created again (None: it does not exist)."""
        ...

    def begin(self) -> None:
        """Open a transaction."""
        ...

    def append(
        self, batch: Mapping[str, TopicRecords], *, also: Iterable[tuple[str, int]] = ()
    ) -> dict[tuple[str, int], int]:
        """Append records inside the open transaction (not visible yet); the next offset per partition
        written, for the records whose offsets are known by now (the rest come with :meth:`commit`).

        ``also``: partitions the transaction will write next (the position record's), registered
        with the batch's in one step where the backend has such a step.
        """
        ...

    def commit(self, position_topic: str, key: bytes | None, value: bytes | None) -> dict[tuple[str, int], int]:
        """Append the position record (when ``value`` is not None) and commit the transaction, durably;
        the next offset per partition written by appends that did not report it (not the position's)."""
        ...

    def abort(self) -> None:
        """Abort the open transaction (nothing of it becomes visible)."""
        ...

    def read_last(self, topic: str, partition: int, key: bytes) -> bytes | None:
        """The value of the last committed record with ``key`` in one partition (None: none, or a tombstone)."""
        ...

    def end_offsets(self, topic: str) -> dict[int, int]:
        """The end of committed data per partition (read_committed readers stop there)."""
        ...

    def read(self, topic: str, partition: int, start: int, end: int) -> Iterator[ReadBatch]:
        """Committed records of one partition with offsets in ``[start, end)``, in batches."""
        ...

    def schema_store(self) -> SchemaStore:
        """Where ``--value-format avro`` registers its schemas: the backend's own registry topic."""
        ...

    def default_state_dir(self) -> Path:
        """Where the connector keeps local state (the key state) unless configured otherwise."""
        ...

    def close(self) -> None:
        """Release the producer and files (an open transaction is left for the next ``open`` to abort)."""
        ...


def check_cleanup_policy(topic: str, spec: TopicSpec, policy: CleanupPolicy, *, what: str, setting: str) -> None:
    """Refuse an existing topic whose cleanup policy contradicts what capture writes there.

    ``what``: how the topic is named ("topic", "Kafka topic"); ``setting``: the backend's name of the
    setting (``cleanup_policy``, ``cleanup.policy``).
    """
    if spec.compact and not policy.compacts:
        raise ConfigError(
            f"{what} {topic} exists with {setting}={policy.value}, but capture writes keyed change events there "
            f"and needs compaction: set {setting}=compact on it, or capture under another --topic-prefix"
        )
    if spec.keyless and policy.compacts:
        raise ConfigError(
            f"{what} {topic} exists with {setting}={policy.value}, but capture writes records without keys there "
            f"(a keyless table): set {setting}=delete on it, or capture under another --topic-prefix"
        )


class RoundRobin:
    """Keyless batches rotate over a topic's partitions, from a random one (as Kafka's sticky partitioner)."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def next(self, topic: str, partitions: int) -> int:
        p = self._next.get(topic, random.randrange(partitions)) + 1
        self._next[topic] = p % partitions
        return p % partitions
