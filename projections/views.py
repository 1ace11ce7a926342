"""Projections declared in Python: what a read view reads, how it is keyed, how it is computed.

Three kinds, each built by ``rebuild`` (:mod:`projections.rebuild`) and kept up to date by
``follow`` (:mod:`projections.follow`) from the same declaration:

:class:`FoldView`
    The aggregate's own fold from commands/: the events of each stream (topic
    ``events.<aggregate>``, key = stream id), decoded with the aggregate's
    :class:`~commands.events.EventRegistry` (so upcasters apply) and folded with
    ``AggregateType.apply`` in version order; ``rows(stream)`` turns the stream's state into
    the view's rows. ``snapshots=True`` makes it the aggregate-snapshot projection: one row
    per stream in the commands' ``snapshots`` table (shared with the command handler,
    upserted, never swapped).
:class:`CountView`
    The DataFrame fast path for additive aggregates over events: ``frame(events)`` is a
    Spark transformation to ``(key columns…, count columns…)`` (e.g. counts per show and
    hourly window of ``recorded_at``), ``contributions(event)`` the same thing for one
    event in plain Python (the reference, and the check that both agree).
:class:`MirrorView`
    The latest row per key of a CDC topic (Debezium envelopes, JSON values) in
    ``cdc_mirror``: deletes, tombstones, primary-key changes (d + tombstone + c) and
    truncates (t with key ``{}`` + tombstones) remove keys.

A :class:`ViewCatalog` names the views of an application; jobs find it by module path
(``--views examples.reservations.views``) so that Spark's Python workers import the
very same functions (everything a view calls must be a module-level function).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Union

import orjson
from pyspark.sql import DataFrame
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType, TimestampType
from sqlalchemy import Table

from commands.aggregate import AggregateType
from commands.events import Event
from eventstore.errors import ConfigError
from projections import models

EVENTS_TOPIC_PREFIX = "events"
MIRROR_PREFIX = "mirror:"

# The JSON value capture's outbox routing writes (docs/capture.md, "Outbox routing"), as
# parsed by Spark's from_json. ``payload`` stays JSON text (decoded by the registry).
OUTBOX_VALUE_SCHEMA = StructType(
    [
        StructField("stream_id", StringType()),
        StructField("stream_type", StringType()),
        StructField("version", IntegerType()),
        StructField("event_type", StringType()),
        StructField("schema_version", IntegerType()),
        StructField("payload", StringType()),
        StructField("recorded_at", TimestampType()),
        StructField(
            "source", StructType([StructField("commit_lsn", LongType()), StructField("event_index", LongType())])
        ),
    ]
)

# A Debezium change event's value: op, the after image kept as JSON text, the position.
CDC_VALUE_SCHEMA = StructType(
    [
        StructField("op", StringType()),
        StructField("after", StringType()),
        StructField(
            "source", StructType([StructField("commit_lsn", LongType()), StructField("event_index", LongType())])
        ),
    ]
)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One outbox record as a projection sees it (the reference and ``follow`` build these)."""

    stream_id: str
    stream_type: str
    version: int
    event_type: str
    schema_version: int
    payload: dict[str, Any]  # as stored: not upcast
    recorded_at: datetime  # aware (UTC)
    commit_lsn: int
    event_index: int

    @classmethod
    def from_value(cls, value: bytes) -> StoredEvent:
        """An outbox record's value (capture's JSON, docs/capture.md "Outbox routing")."""
        try:
            v = orjson.loads(value)
            source = v["source"]
            return cls(
                v["stream_id"],
                v["stream_type"],
                int(v["version"]),
                v["event_type"],
                int(v.get("schema_version", 1)),
                v["payload"],
                datetime.fromisoformat(v["recorded_at"]),
                int(source["commit_lsn"]),
                int(source["event_index"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            head = bytes(value[:60])
            raise ConfigError(
                f"not an outbox event value ({type(e).__name__}: {e}); fold views read the JSON values of capture's "
                f"outbox routing, got {head!r}…"
            ) from None


@dataclass(frozen=True, slots=True)
class Stream:
    """A stream's fold result: what ``FoldView.rows`` turns into view rows."""

    aggregate: AggregateType[Any, Any]
    stream_id: str
    version: int  # the last version folded
    commit_lsn: int  # the commit LSN of that version's event
    state: Any


Row = tuple[Any, ...]


@dataclass(frozen=True)
class FoldView:
    """A view folded per stream with the aggregates' own ``apply``.

    ``rows(stream) -> [row]``: the view's rows for a stream's state, as tuples in the
    order of ``table``'s columns. When the state changes, the stream's previous rows are
    deleted (matched on every column, so a row another stream holds by now stays) and the
    new ones inserted; a key held by another stream is taken over only by a row with a
    larger ``commit_lsn`` (rows of a table shared by several streams, like ``seats``, carry
    one): partitions are read side by side, so a later claim can arrive before an earlier
    release.
    """

    name: str
    aggregates: tuple[AggregateType[Any, Any], ...]
    table: Table
    rows: Callable[[Stream], Sequence[Row]]
    snapshots: bool = False

    @property
    def topics(self) -> tuple[str, ...]:
        return tuple(f"{EVENTS_TOPIC_PREFIX}.{a.name}" for a in self.aggregates)

    def aggregate(self, stream_type: str) -> AggregateType[Any, Any]:
        for a in self.aggregates:
            if a.name == stream_type:
                return a
        raise ConfigError(f"view {self.name}: no aggregate for stream type {stream_type!r}")

    def fold(self, stream_type: str, events: Iterable[StoredEvent], state: Any = None) -> Any:
        """The state after ``events`` (upcast and decoded by the aggregate's registry)."""
        aggregate = self.aggregate(stream_type)
        return aggregate.fold(decode(aggregate, events), state)


def decode(aggregate: AggregateType[Any, Any], events: Iterable[StoredEvent]) -> Iterator[Event]:
    for e in events:
        yield aggregate.events.decode(e.event_type, e.schema_version, e.payload)


@dataclass(frozen=True)
class CountView:
    """Additive counts per key, computed by a Spark transformation of the parsed events.

    ``frame(events)`` gets the events as columns ``stream_id, stream_type, version,
    event_type, schema_version, payload (JSON text, not upcast), recorded_at (timestamp),
    commit_lsn, event_index`` and returns ``key_columns + count_columns`` (any other columns
    of ``table`` must be derivable: ``extra(key)``). ``contributions(event)`` is the same
    computation for one event in Python: ``[(key, counts)]``.
    """

    name: str
    source_topics: tuple[str, ...]
    table: Table
    key_columns: tuple[str, ...]
    count_columns: tuple[str, ...]
    frame: Callable[[DataFrame], DataFrame]
    contributions: Callable[[StoredEvent], Sequence[tuple[Row, Row]]]
    extra_columns: tuple[str, ...] = ()
    extra: Callable[[Row], Row] = field(default=lambda key: ())

    @property
    def topics(self) -> tuple[str, ...]:
        return self.source_topics


@dataclass(frozen=True)
class MirrorView:
    """The latest row per key of one CDC topic, in ``cdc_mirror`` under ``projection = name``."""

    name: str
    topic: str
    table: Table = models.cdc_mirror

    @property
    def topics(self) -> tuple[str, ...]:
        return (self.topic,)


View = Union[FoldView, CountView, MirrorView]  # noqa: UP007 (a runtime alias for isinstance users)


@dataclass(frozen=True)
class ViewCatalog:
    """The projections of an application, by name. ``module`` is where it is defined (a module
    attribute ``VIEWS``), so that Spark workers can import it."""

    module: str
    views: Mapping[str, View]

    def __getitem__(self, name: str) -> View:
        """The view named ``name``; ``mirror:<topic>`` is a :class:`MirrorView` of any CDC topic."""
        if name.startswith(MIRROR_PREFIX) and name not in self.views:
            return MirrorView(name, name.removeprefix(MIRROR_PREFIX))
        try:
            return self.views[name]
        except KeyError:
            known = ", ".join(sorted(self.views))
            raise ConfigError(f"unknown projection {name!r} (known: {known})") from None

    def names(self) -> list[str]:
        return sorted(self.views)


def load_catalog(module: str) -> ViewCatalog:
    """The ``VIEWS`` catalog of ``module`` (e.g. ``examples.reservations.views``)."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"cannot import the views module {module!r}: {e}") from None
    catalog = getattr(mod, "VIEWS", None)
    if not isinstance(catalog, ViewCatalog):
        raise ConfigError(f"module {module!r} has no ViewCatalog named VIEWS")
    return catalog


def owned_table(view: View) -> bool:
    """Whether the view alone writes its table (rebuild swaps it) or shares it (rebuild merges)."""
    return not (isinstance(view, MirrorView) or (isinstance(view, FoldView) and view.snapshots))


def key_columns(table: Table) -> tuple[str, ...]:
    return tuple(c.name for c in table.primary_key.columns)


def columns_of(view: View) -> tuple[str, ...]:
    """The table columns a view writes, in order (server defaults such as recorded_at left out)."""
    if isinstance(view, FoldView) and view.snapshots:
        return ("stream_id", "stream_type", "version", "schema_version", "state")
    if isinstance(view, CountView):
        return view.key_columns + view.extra_columns + view.count_columns
    return tuple(c.name for c in view.table.columns)


def snapshot_rows(stream: Stream) -> Sequence[Row]:
    """The aggregate-snapshot projection's row: the commands' ``snapshots`` columns."""
    from commands.codec import to_json

    a = stream.aggregate
    return [(stream.stream_id, a.name, stream.version, a.state_version, to_json(stream.state))]
