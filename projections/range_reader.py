"""Reading one offset range of one partition as Arrow record batches of the source's schema.

This is what a Spark task runs (in a Python worker on an executor). It never loops over
records in Python: stored batches are fetched whole (eventstore.isolation.read_visible
drops control batches, aborted transactions and, for read_committed, anything at or past
the last stable offset), their record columns are concatenated, offsets and timestamps
are computed with numpy from the batch headers, and the bounds (offset range,
timestamps) are applied as one vectorized mask.

Columns (the Spark schema :data:`SPARK_SCHEMA`; Arrow types from
``pyspark.sql.pandas.types.to_arrow_schema`` with time zone UTC, matched exactly):

    topic         string     not null
    partition     int        not null
    offset        bigint     not null
    timestamp     timestamp  not null   the record's timestamp (ms in the log), as Kafka's source
    key           binary     nullable
    value         binary     nullable   null = tombstone
    headers       array<struct<key: string, value: binary>>  nullable: null when the record has none (as Kafka's source)
    is_tombstone  boolean    not null   value is null

With option ``includeSchemaIds`` (:data:`SCHEMA_ID_FIELDS`), two more:

    keySchemaId   int        nullable   the schema id a Confluent-framed key names (null: not framed)
    valueSchemaId int        nullable   the same of the value: the version it was written under, with
                                        ``decodeAvro`` too (the id of the stored bytes, before decoding)

Thread-safety: functions only; each call opens its own ``Log``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from eventstore.errors import ConfigError, OffsetOutOfRangeError
from eventstore.isolation import IsolationLevel, read_visible
from eventstore.log import Log
from eventstore.partition_log import FetchedBatch
from eventstore.record_batch import HEADERS_TYPE
from projections.planning import OffsetRange

SPARK_SCHEMA = StructType(
    [
        StructField("topic", StringType(), nullable=False),
        StructField("partition", IntegerType(), nullable=False),
        StructField("offset", LongType(), nullable=False),
        StructField("timestamp", TimestampType(), nullable=False),
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField(
            "headers",
            ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())])),
        ),
        StructField("is_tombstone", BooleanType(), nullable=False),
    ]
)
SCHEMA_ID_FIELDS = (StructField("keySchemaId", IntegerType()), StructField("valueSchemaId", IntegerType()))
FETCH_BYTES = 8 << 20  # bytes asked of the log per fetch


def spark_schema(include_schema_ids: bool = False) -> StructType:
    """The source's Spark schema (a copy: StructType is mutable); with the schema id columns when asked."""
    schema = StructType.fromJson(SPARK_SCHEMA.jsonValue())
    for field in SCHEMA_ID_FIELDS if include_schema_ids else ():
        schema.add(StructField(field.name, field.dataType, field.nullable))
    return schema


@cache
def arrow_schema(include_schema_ids: bool = False) -> pa.Schema:
    """The exact Arrow schema Spark expects for :func:`spark_schema` (PySpark compares it with ``equals``)."""
    return to_arrow_schema(spark_schema(include_schema_ids), timezone="UTC")


def schema_ids(array: pa.Array) -> pa.Array:
    """The schema id each Confluent-framed value of a binary array names (magic byte 0, a 4-byte big-endian id);
    null for anything else (JSON, raw bytes, null)."""
    ids = [
        int.from_bytes(v[1:5], "big") if v is not None and len(v) >= 5 and v[0] == 0 else None
        for v in array.to_pylist()
    ]
    return pa.array(ids, pa.int32())


@dataclass(frozen=True, slots=True)
class ReadSettings:
    """What a task needs besides its range: picklable, so it travels with the plan."""

    path: str
    isolation: IsolationLevel
    starting_timestamp: int | None
    ending_timestamp: int | None
    fail_on_data_loss: bool
    batch_rows: int
    decode_avro: bool = False
    include_schema_ids: bool = False


def read_range(rng: OffsetRange, settings: ReadSettings) -> Iterator[pa.RecordBatch]:
    """The visible records of ``rng`` as record batches of :func:`arrow_schema`, in offset order.

    Raises OffsetOutOfRangeError when retention removed part of the range, unless
    ``fail_on_data_loss`` is false (the removed part is then skipped).
    """
    with Log(settings.path, create=False) as log:
        plog = log.partition(rng.topic, rng.partition)
        decoder = AvroDecoding(log) if settings.decode_avro else None
        pending: list[FetchedBatch] = []
        rows = 0
        position = rng.start
        while position < rng.end:
            try:
                visible = read_visible(plog, position, settings.isolation, max_bytes=FETCH_BYTES)
            except OffsetOutOfRangeError:
                if settings.fail_on_data_loss:
                    raise
                position = plog.log_start_offset()
                continue
            if visible.next_offset <= position:
                break  # nothing more stored below the end (it was capped at plan time)
            for fetched in visible.batches:
                if fetched.header.base_offset >= rng.end:
                    break
                if _may_hold_wanted_timestamps(fetched, settings):
                    pending.append(fetched)
                    rows += fetched.header.record_count
            position = visible.next_offset
            if rows >= settings.batch_rows:
                yield from _assembled(rng, pending, settings, decoder)
                pending, rows = [], 0
        if pending:
            yield from _assembled(rng, pending, settings, decoder)


class AvroDecoding:
    """Option ``decodeAvro``: keys and values framed as Confluent Avro (capture's
    ``--value-format avro``) become the JSON capture writes in JSON mode, through the
    schema registry stored in the same log (``__schemas``); everything else passes
    untouched. A framed value whose schema id the registry lacks fails the read: a
    projection must not mistake undecoded bytes for data."""

    def __init__(self, log: Log) -> None:
        from eventstore.schema_store import FramedDecoder

        self.decoder = FramedDecoder(log, lambda note: None)  # a value it cannot decode fails the read below

    def column(self, array: pa.Array, what: str, rng: OffsetRange, offsets: np.ndarray) -> pa.Array:
        if not len(array):
            return array
        framed = pc.equal(pc.binary_slice(array, 0, 1), pa.scalar(b"\x00", pa.binary()))
        if not pc.any(framed).as_py():
            return array  # JSON (or raw) throughout: stays vectorized
        out: list[bytes | None] = []
        for i, data in enumerate(array.to_pylist()):
            decoded, schema_id = self.decoder.decode(data)
            if schema_id is None and data is not None and data[:1] == b"\x00":
                raise ConfigError(f"{rng.topic}[{rng.partition}] offset {int(offsets[i])}: {self._why(what, data)}")
            out.append(decoded)
        return pa.array(out, pa.binary())

    def _why(self, what: str, data: bytes) -> str:
        from schemas.errors import UnknownSchemaError
        from schemas.jsonform import framed_schema_id

        schema_id = framed_schema_id(data)
        try:
            self.decoder.registry.schema_by_id(schema_id or 0)
        except UnknownSchemaError:
            return (
                f"the {what} is framed Avro but schema id {schema_id} is not in the registry of "
                f"{self.decoder.registry_path} (topic __schemas)"
            )
        return f"the {what} is framed Avro but does not decode with schema id {schema_id}"


def _may_hold_wanted_timestamps(fetched: FetchedBatch, settings: ReadSettings) -> bool:
    """Header-level pruning: a batch whose largest timestamp is below the start holds nothing wanted."""
    lo = settings.starting_timestamp
    return lo is None or fetched.header.max_timestamp >= lo


def _assembled(
    rng: OffsetRange, fetched: list[FetchedBatch], settings: ReadSettings, decoder: AvroDecoding | None
) -> Iterator[pa.RecordBatch]:
    batch = assemble(rng, fetched, settings, decoder)
    if batch.num_rows:
        yield batch


def assemble(
    rng: OffsetRange, fetched: list[FetchedBatch], settings: ReadSettings, decoder: AvroDecoding | None = None
) -> pa.RecordBatch:
    """One record batch of :func:`arrow_schema` from stored batches, cut to the range and time bounds."""
    counts = np.fromiter((f.records.num_rows for f in fetched), np.int64, len(fetched))
    bases = np.fromiter((f.header.base_offset for f in fetched), np.int64, len(fetched))
    firsts = np.fromiter((f.header.first_timestamp for f in fetched), np.int64, len(fetched))
    offset_deltas = _concat([f.records.column(0) for f in fetched]).to_numpy()
    timestamp_deltas = _concat([f.records.column(1) for f in fetched]).to_numpy()
    offsets = np.repeat(bases, counts) + offset_deltas
    timestamps_ms = np.repeat(firsts, counts) + timestamp_deltas
    keys = _concat([f.records.column(2) for f in fetched])
    values = _concat([f.records.column(3) for f in fetched])
    headers = _concat(
        [f.records.column(4) if f.header.has_headers else pa.nulls(f.records.num_rows, HEADERS_TYPE) for f in fetched]
    )
    keep = _wanted(rng, offsets, timestamps_ms, settings)
    if keep is not None:
        offsets, timestamps_ms = offsets[keep], timestamps_ms[keep]
        mask = pa.array(keep)
        keys, values, headers = keys.filter(mask), values.filter(mask), headers.filter(mask)
    ids = [schema_ids(keys), schema_ids(values)] if settings.include_schema_ids else []
    if decoder is not None:
        keys = decoder.column(keys, "key", rng, offsets)
        values = decoder.column(values, "value", rng, offsets)
    n = len(offsets)
    schema = arrow_schema(settings.include_schema_ids)
    columns = [
        pa.repeat(pa.scalar(rng.topic, pa.string()), n),
        pa.repeat(pa.scalar(rng.partition, pa.int32()), n),
        pa.array(offsets, pa.int64()),
        pa.array(timestamps_ms * 1000, pa.int64()).cast(schema.field("timestamp").type),
        keys,
        values,
        headers.cast(schema.field("headers").type),
        pc.is_null(values),
        *ids,
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _concat(arrays: list[pa.Array]) -> pa.Array:
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


def _wanted(
    rng: OffsetRange, offsets: np.ndarray, timestamps_ms: np.ndarray, settings: ReadSettings
) -> np.ndarray | None:
    """Boolean mask of the records inside the bounds, or None when all are."""
    keep: np.ndarray | None = None
    if not len(offsets):
        return None
    if offsets[0] < rng.start or offsets[-1] >= rng.end:
        keep = (offsets >= rng.start) & (offsets < rng.end)
    if settings.starting_timestamp is not None:
        after = timestamps_ms >= settings.starting_timestamp
        keep = after if keep is None else keep & after
    if settings.ending_timestamp is not None:
        before = timestamps_ms < settings.ending_timestamp
        keep = before if keep is None else keep & before
    if keep is not None and keep.all():
        return None
    return keep
