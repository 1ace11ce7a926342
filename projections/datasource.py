"""The ``tideline`` Spark data source: the log as a DataFrame, in batch and streaming.

>>> from projections.datasource import register                        # doctest: +SKIP
>>> register(spark)
>>> df = (spark.read.format("tideline").option("path", "/data/log")
...       .option("topic", "orders").load())
>>> stream = (spark.readStream.format("tideline").option("path", "/data/log")
...           .option("subscribe", "orders,payments").option("startingOffsets", "earliest").load())

Columns: see :mod:`projections.range_reader` (Kafka's source's columns, plus
``is_tombstone``). Options: :mod:`projections.options`; the reference table and the
isolation and offset semantics are in docs/projections.md.

Batch reads plan one Spark partition per segment of each log partition (more when a
segment holds over ``maxOffsetsPerPartition`` offsets or ``minPartitions`` asks for
more). Streaming reads keep their position as ``{topic: {partition: next offset}}`` in
Spark's checkpoint. Planning callbacks may run in a Python process the JVM owns, so
nothing is remembered between them except the target of a ``Trigger.AvailableNow`` run
(Spark asks for it once per run): every answer is derived from the log directory and
the offsets passed in.

Thread-safety: Spark calls each reader from one thread at a time; ``read`` is stateless.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from eventstore.errors import ConfigError
from projections.options import SourceOptions, includes_schema_ids
from projections.planning import (
    LogPlanner,
    OffsetRange,
    PartitionOffsets,
    cap_offsets,
    offsets_from_json,
    offsets_to_json,
)
from projections.range_reader import ReadSettings, read_range, spark_schema

SOURCE_NAME = "tideline"

__all__ = [
    "SOURCE_NAME",
    "RangePartition",
    "TidelineBatchReader",
    "TidelineDataSource",
    "TidelineStreamReader",
    "register",
]


def register(spark: SparkSession) -> None:
    """Make ``format("tideline")`` available in ``spark`` (batch and streaming)."""
    spark.dataSource.register(TidelineDataSource)


@dataclass(frozen=True)
class RangePartition(InputPartition):
    """One Spark input partition: an offset range of one log partition."""

    range: OffsetRange


class TidelineDataSource(DataSource):
    """The log directory (option ``path``) and its topics as a Spark source."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return spark_schema(includes_schema_ids(self.options))

    def reader(self, schema: StructType) -> TidelineBatchReader:
        return TidelineBatchReader(SourceOptions.parse(self.options), schema)

    def streamReader(self, schema: StructType) -> TidelineStreamReader:
        return TidelineStreamReader(SourceOptions.parse(self.options, streaming=True), schema)


def _check_schema(schema: StructType, options: SourceOptions) -> None:
    expected = spark_schema(options.include_schema_ids)
    if schema != expected:
        raise ConfigError(f"the tideline source has a fixed schema ({expected.simpleString()}); got {schema}")


def _settings(options: SourceOptions) -> ReadSettings:
    return ReadSettings(
        path=options.path,
        isolation=options.isolation,
        starting_timestamp=options.starting_timestamp,
        ending_timestamp=options.ending_timestamp,
        fail_on_data_loss=options.fail_on_data_loss,
        batch_rows=options.batch_rows,
        decode_avro=options.decode_avro,
        include_schema_ids=options.include_schema_ids,
    )


def _read(partition: InputPartition, settings: ReadSettings) -> Iterator[pa.RecordBatch]:
    """The records of one planned range. When the plan is empty, Spark still runs one task
    with a bare ``InputPartition(None)``: it reads nothing."""
    if not isinstance(partition, RangePartition):
        return iter(())
    return read_range(partition.range, settings)


class TidelineBatchReader(DataSourceReader):
    """A batch read: offsets resolved when Spark plans the query."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        _check_schema(schema, options)
        self.options = options
        self.settings = _settings(options)

    def partitions(self) -> Sequence[InputPartition]:
        with LogPlanner(self.options) as planner:
            starts = planner.resolve(self.options.starting_offsets)
            ends = planner.resolve(self.options.ending_offsets)
            return [RangePartition(r) for r in planner.plan(starts, ends)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition, self.settings)


class TidelineStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A streaming read: micro-batches between positions ``{topic: {"partition": next offset}}``.

    As Kafka's ``subscribe``: a topic that does not exist yet is read from its earliest
    offset once it appears (a view's aggregate may have no events yet)."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        _check_schema(schema, options)
        self.options = options
        self.settings = _settings(options)
        self._available_now_target: PartitionOffsets | None = None

    def initialOffset(self) -> dict[str, Any]:
        with LogPlanner(self.options, missing_ok=True) as planner:
            return offsets_to_json(planner.resolve(self.options.starting_offsets))

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_records_per_trigger
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the end of this ``availableNow`` run: what is readable now, nothing appended later."""
        with LogPlanner(self.options, missing_ok=True) as planner:
            self._available_now_target = planner.latest_offsets()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The end of the next micro-batch: readable offsets (never past the last stable
        offset under read_committed), capped by ``limit``; ``start`` itself when nothing is new."""
        with LogPlanner(self.options, missing_ok=True) as planner:
            starts = planner.complete(offsets_from_json(start))
            latest = self._available_now_target or planner.latest_offsets(note_open_transactions=True)
            ends = {t: {p: max(latest.get(t, {}).get(p, o), o) for p, o in per.items()} for t, per in starts.items()}
            if isinstance(limit, ReadMaxRows):
                ends = cap_offsets(starts, ends, limit.max_rows)
            return offsets_to_json(ends)

    def reportLatestOffset(self) -> dict[str, Any]:
        with LogPlanner(self.options, missing_ok=True) as planner:
            return offsets_to_json(planner.latest_offsets())

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        with LogPlanner(self.options, missing_ok=True) as planner:
            starts = planner.complete(offsets_from_json(start))
            return [RangePartition(r) for r in planner.plan(starts, offsets_from_json(end))]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition, self.settings)
