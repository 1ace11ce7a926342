"""The schema registry's store in the log: the compacted topic ``__schemas``.

:class:`LogSchemaStore` implements :class:`schemas.registry.SchemaStore` on a
:class:`~eventstore.log.Log` (the registry itself lives in ``schemas/``, below the log
in the layering, and knows only the protocol). The record layout is documented in
:mod:`schemas.registry`.

The topic: ``__schemas``, 1 partition (one total order of registrations),
``cleanup_policy=compact`` (the registry's state is the last value per key), created on
first use; a creation race with another process is resolved by reading the winner's
metadata, as for ``__consumer_offsets``.

Durability: ``append`` writes one single-record batch and fsyncs it (the partition's
``flush``) before returning, whatever fsync policy the log was opened with — a
registration a caller has seen is never lost.

Concurrency: :meth:`locked` takes an exclusive ``fcntl.flock`` on ``<log>/__schemas.lock``
(and a thread lock, since flock is per open file, not per thread); the registry holds it
around refresh + check + append so registrations in several processes are serialized.
Readers take no lock.

:class:`FramedDecoder` turns Confluent-framed Avro keys and values of any topic back into
JSON through this registry, or any other (what ``tideline log tail`` shows, and what any
consumer can use: ``json_bytes, schema_id = FramedDecoder(log, print).decode(record.value)``;
on Kafka: ``FramedDecoder(SchemaRegistry(KafkaSchemaStore(bootstrap)), print)``).

Thread-safety: LogSchemaStore is thread-safe; a FramedDecoder belongs to one reader.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from eventstore.errors import ConfigError, OffsetOutOfRangeError, TopicExistsError, UnknownTopicError
from eventstore.log import Log
from eventstore.partition_log import PartitionLog
from eventstore.record_batch import build_records, encode_batch
from eventstore.topic import CleanupPolicy, TopicConfig, TopicMetadata, metadata_path, now_ms
from schemas.errors import SchemaError, UnknownSchemaError
from schemas.jsonform import JsonForm, framed_schema_id
from schemas.registry import SchemaRegistry
from schemas.wire import AvroWire

SCHEMAS_TOPIC = "__schemas"
SCHEMAS_LOCK_FILE = "__schemas.lock"
SCHEMAS_SEGMENT_BYTES = 16 << 20
READ_CHUNK_BYTES = 1 << 20


def schemas_topic_config() -> TopicConfig:
    return TopicConfig(cleanup_policy=CleanupPolicy.COMPACT, segment_bytes=SCHEMAS_SEGMENT_BYTES)


def ensure_schemas_topic(log: Log) -> TopicMetadata:
    """The metadata of ``__schemas``, creating the topic if it is missing (race-safe)."""
    try:
        return log.topic(SCHEMAS_TOPIC)
    except UnknownTopicError:
        pass
    try:
        return log.create_topic(SCHEMAS_TOPIC, 1, schemas_topic_config())
    except TopicExistsError:
        return log.topic(SCHEMAS_TOPIC)
    except ConfigError:
        if metadata_path(log.path, SCHEMAS_TOPIC).exists():  # a concurrent creator already wrote its first record
            return log.topic(SCHEMAS_TOPIC)
        raise


class LogSchemaStore:
    """The registry's records in ``__schemas`` of ``log``.

    >>> registry = SchemaRegistry(LogSchemaStore(log))           # doctest: +SKIP
    """

    def __init__(self, log: Log) -> None:
        self.log = log
        self._thread_lock = threading.Lock()
        self._partition: PartitionLog | None = None

    def _plog(self) -> PartitionLog:
        if self._partition is None:
            ensure_schemas_topic(self.log)
            self._partition = self.log.partition(SCHEMAS_TOPIC, 0)
        return self._partition

    def append(self, key: bytes, value: bytes | None) -> None:
        """Append one record and return once it is durable."""
        plog = self._plog()
        now = now_ms()
        plog.append(encode_batch(build_records([key], [value]), first_timestamp=now, max_timestamp=now))
        plog.flush()

    def read_from(self, position: int) -> tuple[list[tuple[bytes, bytes | None]], int]:
        """Records at offsets ≥ ``position`` in offset order, and the offset after the last one."""
        if self._partition is None and SCHEMAS_TOPIC not in self.log.topics():
            return [], position
        plog = self._plog()
        out: list[tuple[bytes, bytes | None]] = []
        if position < (start := plog.log_start_offset()):
            position = start  # compaction keeps every live key above the start; nothing is lost
        while True:
            try:
                batches = plog.read(position, max_bytes=READ_CHUNK_BYTES)
            except OffsetOutOfRangeError:
                position = plog.log_start_offset()
                continue
            if not batches:
                return out, position
            for fetched in batches:
                header = fetched.header
                if not header.is_control:
                    deltas: list[int] = fetched.records.column(0).to_pylist()
                    keys: list[bytes | None] = fetched.records.column(2).to_pylist()
                    values: list[bytes | None] = fetched.records.column(3).to_pylist()
                    for delta, key, value in zip(deltas, keys, values, strict=True):
                        if header.base_offset + delta >= position and key is not None:
                            out.append((key, value))
                position = max(position, header.next_offset)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive across processes (flock on ``<log>/__schemas.lock``) and threads."""
        with self._thread_lock:
            fd = os.open(self.log.path / SCHEMAS_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock


class FramedDecoder:
    """Confluent-framed Avro values → JSON text, through the schema registry of ``log`` (or ``registry``).

    :meth:`decode` returns ``(json_bytes, schema_id)`` for a value it decoded and
    ``(data, None)`` — the value untouched — for anything else: not framed, an id the
    registry lacks, a payload the schema cannot decode. The two last cases call ``note``
    once per schema id with an explanation. Not thread-safe (one per reader).
    """

    def __init__(self, source: Log | SchemaRegistry, note: Callable[[str], None]) -> None:
        self.registry = source if isinstance(source, SchemaRegistry) else SchemaRegistry(LogSchemaStore(source))
        self.wire = AvroWire(self.registry.schema_by_id, logical_types=False)
        self.note = note
        self._forms: dict[int, JsonForm] = {}
        self._missing: set[int] = set()  # ids found unknown since the last forget_missing()
        self._noted: set[int] = set()

    def forget_missing(self) -> None:
        """Look unknown ids up again (call between polls: another process may have registered them)."""
        self._missing.clear()

    def decode(self, data: bytes | None) -> tuple[bytes | None, int | None]:
        schema_id = framed_schema_id(data)
        if schema_id is None or schema_id in self._missing:
            return data, None
        assert data is not None
        try:
            form = self._form(schema_id)
            return orjson.dumps(form.convert(self.wire.decode(data))), schema_id
        except UnknownSchemaError:
            self._missing.add(schema_id)
            self._note_once(schema_id, f"schema id {schema_id} is not in the registry of {self.registry_location}")
        except (SchemaError, ValueError, TypeError, KeyError, AttributeError) as e:
            self._note_once(schema_id, f"a value framed with schema id {schema_id} does not decode ({e})")
        return data, None

    @property
    def registry_path(self) -> Path:
        """The log directory of the registry (``?`` for a registry kept elsewhere)."""
        store = self.registry.store
        return store.log.path if isinstance(store, LogSchemaStore) else Path("?")

    @property
    def registry_location(self) -> str:
        """Where the registry lives, for notes: the log directory, or the store's description."""
        store = self.registry.store
        if isinstance(store, LogSchemaStore):
            return str(store.log.path)
        bootstrap, topic = getattr(store, "bootstrap_servers", None), getattr(store, "topic", None)
        return f"{topic} on Kafka at {bootstrap}" if bootstrap and topic else type(store).__name__

    def _form(self, schema_id: int) -> JsonForm:
        form = self._forms.get(schema_id)
        if form is None:
            form = self._forms[schema_id] = JsonForm(self.registry.schema_by_id(schema_id))
        return form

    def _note_once(self, schema_id: int, message: str) -> None:
        if schema_id not in self._noted:
            self._noted.add(schema_id)
            self.note(f"note: {message}: such values are shown as stored")
