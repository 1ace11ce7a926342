"""Options of the ``tideline`` Spark data source, parsed once into a frozen :class:`SourceOptions`.

Spark passes options as a case-insensitive ``str → str`` mapping; every name below is
matched without regard to case. Names and offset JSON follow Spark's Kafka source
where a Kafka option exists (``subscribe``, ``startingOffsets``, ``endingOffsets``,
``failOnDataLoss``, ``minPartitions``, ``startingTimestamp``, ``endingTimestamp``),
so a job written against Kafka reads the same here.

Offset specs: ``"earliest"``, ``"latest"`` or JSON ``{"topic": {"partition": offset}}``
where ``-2`` means earliest and ``-1`` latest. Partitions a JSON spec leaves out start at
the earliest offset and end at the latest.

Thread-safety: immutable; safe to pickle to executors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from eventstore.errors import ConfigError
from eventstore.isolation import IsolationLevel

EARLIEST = -2  # Kafka's sentinel in offset JSON
LATEST = -1
DEFAULT_MAX_OFFSETS_PER_PARTITION = 1 << 20
DEFAULT_BATCH_ROWS = 1 << 16  # rows per Arrow batch handed to Spark

OPTION_PATH = "path"
OPTION_TOPIC = "topic"
OPTION_SUBSCRIBE = "subscribe"
OPTION_STARTING_OFFSETS = "startingoffsets"
OPTION_ENDING_OFFSETS = "endingoffsets"
OPTION_STARTING_TIMESTAMP = "startingtimestamp"
OPTION_ENDING_TIMESTAMP = "endingtimestamp"
OPTION_ISOLATION = "isolation"
OPTION_FAIL_ON_DATA_LOSS = "failondataloss"
OPTION_MIN_PARTITIONS = "minpartitions"
OPTION_MAX_OFFSETS_PER_PARTITION = "maxoffsetsperpartition"
OPTION_MAX_RECORDS_PER_TRIGGER = "maxrecordspertrigger"
OPTION_BATCH_ROWS = "batchrows"
OPTION_DECODE_AVRO = "decodeavro"
OPTION_WHOLE_PARTITIONS = "wholepartitions"
OPTION_INCLUDE_SCHEMA_IDS = "includeschemaids"

KNOWN_OPTIONS = frozenset(
    {
        OPTION_PATH,
        OPTION_TOPIC,
        OPTION_SUBSCRIBE,
        OPTION_STARTING_OFFSETS,
        OPTION_ENDING_OFFSETS,
        OPTION_STARTING_TIMESTAMP,
        OPTION_ENDING_TIMESTAMP,
        OPTION_ISOLATION,
        OPTION_FAIL_ON_DATA_LOSS,
        OPTION_MIN_PARTITIONS,
        OPTION_MAX_OFFSETS_PER_PARTITION,
        OPTION_MAX_RECORDS_PER_TRIGGER,
        OPTION_BATCH_ROWS,
        OPTION_INCLUDE_SCHEMA_IDS,
        OPTION_DECODE_AVRO,
        OPTION_WHOLE_PARTITIONS,
    }
)


@dataclass(frozen=True, slots=True)
class OffsetSpec:
    """Where a read starts or ends: one sentinel for every partition, or offsets per partition.

    ``default``: :data:`EARLIEST` or :data:`LATEST`, used for partitions not in ``offsets``.
    ``offsets``: ``{topic: {partition: offset or sentinel}}``.
    """

    default: int
    offsets: Mapping[str, Mapping[int, int]] = field(default_factory=dict)

    def for_partition(self, topic: str, partition: int) -> int:
        return self.offsets.get(topic, {}).get(partition, self.default)

    @classmethod
    def parse(cls, text: str, *, default: int, option: str) -> OffsetSpec:
        """``earliest`` | ``latest`` | ``{"topic": {"0": 23, "1": -2}}``."""
        word = text.strip().lower()
        if word == "earliest":
            return cls(EARLIEST)
        if word == "latest":
            return cls(LATEST)
        try:
            raw = json.loads(text)
        except ValueError:
            raise ConfigError(
                f'{option} must be earliest, latest or JSON like {{"t":{{"0":5}}}}, not {text!r}'
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{option} JSON must be an object of topics, not {text!r}")
        offsets: dict[str, dict[int, int]] = {}
        for topic, parts in raw.items():
            if not isinstance(parts, dict):
                raise ConfigError(f"{option}: topic {topic!r} must map partitions to offsets, not {parts!r}")
            per: dict[int, int] = {}
            for p, offset in parts.items():
                try:
                    partition = int(p)
                except ValueError:
                    raise ConfigError(f"{option}: partition {p!r} of topic {topic!r} is not a number") from None
                if not isinstance(offset, int) or isinstance(offset, bool) or offset < EARLIEST:
                    raise ConfigError(f"{option}: offset of {topic}-{p} must be an integer ≥ -2, not {offset!r}")
                per[partition] = offset
            offsets[topic] = per
        return cls(default, offsets)


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """Every option of one read, validated. See docs/projections.md for the reference table."""

    path: str
    topics: tuple[str, ...]
    isolation: IsolationLevel = IsolationLevel.READ_COMMITTED
    starting_offsets: OffsetSpec = OffsetSpec(EARLIEST)
    ending_offsets: OffsetSpec = OffsetSpec(LATEST)
    starting_timestamp: int | None = None  # ms, inclusive: records with timestamp ≥ this
    ending_timestamp: int | None = None  # ms, exclusive: records with timestamp < this
    fail_on_data_loss: bool = True
    min_partitions: int | None = None
    max_offsets_per_partition: int = DEFAULT_MAX_OFFSETS_PER_PARTITION
    max_records_per_trigger: int | None = None
    batch_rows: int = DEFAULT_BATCH_ROWS
    decode_avro: bool = False  # Confluent-framed Avro keys/values → capture's JSON, through the log's registry
    whole_partitions: bool = False  # one Spark partition per log partition, all of its range, in offset order
    # columns keySchemaId / valueSchemaId: the registry schema id a Confluent-framed key / value names (null: not
    # framed), so that a topic whose values were written under several versions can be read per version
    include_schema_ids: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool = False) -> SourceOptions:
        """Validate Spark's options. Streaming reads start at ``latest`` unless told otherwise (as Kafka's)."""
        opts = {k.lower(): v for k, v in options.items()}
        unknown = sorted(set(opts) - KNOWN_OPTIONS)
        if unknown:
            raise ConfigError(f"unknown tideline source option(s): {', '.join(unknown)}")
        path = opts.get(OPTION_PATH)
        if not path:
            raise ConfigError("the tideline source needs option path (the log directory)")
        topics = _topics(opts)
        ending_text = opts.get(OPTION_ENDING_OFFSETS)
        if streaming and ending_text is not None:
            raise ConfigError("endingOffsets is for batch reads only (a stream has no end)")
        ending = (
            OffsetSpec.parse(ending_text, default=LATEST, option="endingOffsets") if ending_text else OffsetSpec(LATEST)
        )
        if ending.default == EARLIEST or any(o == EARLIEST for per in ending.offsets.values() for o in per.values()):
            raise ConfigError("endingOffsets cannot be earliest (-2)")
        start_default = LATEST if streaming else EARLIEST
        starting_text = opts.get(OPTION_STARTING_OFFSETS)
        starting = (
            OffsetSpec.parse(starting_text, default=EARLIEST, option="startingOffsets")
            if starting_text
            else OffsetSpec(start_default)
        )
        for spec in (starting, ending):
            stray = sorted(set(spec.offsets) - set(topics))
            if stray:
                raise ConfigError(f"offsets given for topic(s) not read: {', '.join(stray)}")
        whole = _bool(opts, OPTION_WHOLE_PARTITIONS, default=False)
        if whole and (OPTION_MIN_PARTITIONS in opts or OPTION_MAX_OFFSETS_PER_PARTITION in opts):
            raise ConfigError(
                "wholePartitions reads each log partition as one Spark partition: "
                "it cannot be combined with minPartitions or maxOffsetsPerPartition"
            )
        max_per_trigger = _positive_int(opts, OPTION_MAX_RECORDS_PER_TRIGGER)
        if max_per_trigger is not None and not streaming:
            raise ConfigError("maxRecordsPerTrigger is for streaming reads only")
        return cls(
            path=path,
            topics=topics,
            isolation=IsolationLevel.parse(opts.get(OPTION_ISOLATION, IsolationLevel.READ_COMMITTED.value)),
            starting_offsets=starting,
            ending_offsets=ending,
            starting_timestamp=_int(opts, OPTION_STARTING_TIMESTAMP),
            ending_timestamp=_int(opts, OPTION_ENDING_TIMESTAMP),
            fail_on_data_loss=_bool(opts, OPTION_FAIL_ON_DATA_LOSS, default=True),
            min_partitions=_positive_int(opts, OPTION_MIN_PARTITIONS),
            max_offsets_per_partition=_positive_int(opts, OPTION_MAX_OFFSETS_PER_PARTITION)
            or DEFAULT_MAX_OFFSETS_PER_PARTITION,
            max_records_per_trigger=max_per_trigger,
            batch_rows=_positive_int(opts, OPTION_BATCH_ROWS) or DEFAULT_BATCH_ROWS,
            decode_avro=_bool(opts, OPTION_DECODE_AVRO, default=False),
            whole_partitions=whole,
            include_schema_ids=_bool(opts, OPTION_INCLUDE_SCHEMA_IDS, default=False),
        )


def includes_schema_ids(options: Mapping[str, str]) -> bool:
    """Option ``includeSchemaIds`` alone (what the source's schema depends on, asked before a read is planned,
    batch or streaming)."""
    return _bool({k.lower(): v for k, v in options.items()}, OPTION_INCLUDE_SCHEMA_IDS, default=False)


def _topics(opts: Mapping[str, str]) -> tuple[str, ...]:
    given = [opts[name] for name in (OPTION_TOPIC, OPTION_SUBSCRIBE) if opts.get(name)]
    if len(given) != 1:
        raise ConfigError("the tideline source needs exactly one of options topic or subscribe (comma-separated)")
    topics = tuple(dict.fromkeys(t.strip() for t in given[0].split(",") if t.strip()))
    if not topics:
        raise ConfigError(f"no topic named in {given[0]!r}")
    return topics


def _int(opts: Mapping[str, str], name: str) -> int | None:
    text = opts.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"option {name} must be an integer, not {text!r}") from None


def _positive_int(opts: Mapping[str, str], name: str) -> int | None:
    value = _int(opts, name)
    if value is not None and value < 1:
        raise ConfigError(f"option {name} must be ≥ 1, not {value}")
    return value


def _bool(opts: Mapping[str, str], name: str, *, default: bool) -> bool:
    text = opts.get(name)
    if text is None:
        return default
    word = text.strip().lower()
    if word not in ("true", "false"):
        raise ConfigError(f"option {name} must be true or false, not {text!r}")
    return word == "true"
