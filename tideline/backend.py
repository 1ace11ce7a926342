"""The log backend, chosen once: the embedded log in a directory, or an Apache Kafka cluster.

Every part of Tideline that touches the log takes it from one :class:`Backend` (``choose`` makes it from the
``--data-dir`` / ``--kafka`` options, their ``TIDELINE_*`` variables or the project file), by role:

=================  ===============================================  ==============================================
role               embedded (``EmbeddedBackend``)                    Kafka (``KafkaBackend``)
=================  ===============================================  ==============================================
``capture_log``    the log itself (the connector's default sink)    :class:`capture.sinks.kafka.KafkaLogSink`
``sink``           :class:`capture.sinks.embedded.EmbeddedLogSink`  :class:`capture.sinks.kafka.KafkaLogSink`
``source``         :class:`projections.embedded_source.             :class:`projections.kafka_source.KafkaSource`
                   EmbeddedSource`
``schema_store``   :class:`eventstore.schema_store.LogSchemaStore`  :class:`eventstore.kafka.schema_store.
                   (topic ``__schemas``)                            KafkaSchemaStore` (topic ``_schemas``)
``log`` commands   :class:`eventstore.log.Log` (segments, sizes,     :class:`eventstore.kafka.KafkaAdmin`,
                   file-based groups)                               librdkafka clients (:mod:`tideline.log_kafka`)
=================  ===============================================  ==============================================

The ``log`` commands' operations (create, list and describe topics, produce lines, tail, describe consumer
groups) are methods of the backend too, with the same output on both: ``tideline log`` asks the backend and never
which backend it is. Like the other reads they do not probe Kafka first: the caller does, once (:meth:`check`).

Each role is a contract with a test suite run against both backends (tests/capture/test_sinks.py for the sink,
tests/tideline/test_backend_contract.py for the reader and the schema store). The CLI, the console and the jobs
ask the backend for a role instead of testing which backend they run on.

Imports are lazy: choosing a backend loads neither Kafka's client nor the log's storage.
"""

from __future__ import annotations

import abc
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from typing import BinaryIO

    from capture.sinks import Sink
    from eventstore.log import Log
    from projections.sources import LogSource
    from schemas.registry import SchemaRegistry, SchemaStore
    from schemas.starts import SchemaStart
    from tideline.log_cli import ProduceSummary, TailOptions, TailRows


class Backend(abc.ABC):
    """Where the log is. Immutable; opening a role opens what that role needs, and closing it closes that."""

    kind: ClassVar[str]
    # Capabilities, asked instead of "is it Kafka":
    topic_settings_apply: ClassVar[bool]  # --replication-factor / --min-insync-replicas mean something
    log_cleaner_applies: ClassVar[bool]  # capture run --log-cleaner has a log to clean (Kafka's brokers compact)
    spark_needs_kafka_source: ClassVar[bool]  # a Spark job reading it needs Spark's Kafka source on its class path

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """For messages: ``the log at DIR`` / ``Kafka at HOST:PORT``."""

    @abc.abstractmethod
    def registry_location(self) -> str:
        """Where the schema registry lives, for messages."""

    def exists(self) -> bool:
        """Whether there is a log to read (an embedded log's directory may not be created yet)."""
        return True

    @abc.abstractmethod
    def check(self) -> None:
        """Fail early, in one line, when the backend cannot be reached (Kafka: nobody listens)."""

    @abc.abstractmethod
    @contextmanager
    def capture_log(
        self,
        state_dir: Path | None = None,
        *,
        create: bool = True,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        kafka_producer: str | None = None,
    ) -> Iterator[tuple[Log | None, Sink | None]]:
        """What the connector writes to: the embedded log (its default sink), or Kafka's sink (key state under
        ``state_dir``, default ``<data dir>/_capture``; ``kafka_producer``: auto, native or python, None for
        ``TIDELINE_KAFKA_PRODUCER`` or auto)."""

    @abc.abstractmethod
    @contextmanager
    def sink(self, state_dir: Path | None = None, *, create: bool = False) -> Iterator[Sink]:
        """The capture sink of this backend (reads of capture's own topics: positions, schema starts)."""

    @abc.abstractmethod
    def source(self, *, create: bool = False) -> LogSource:
        """The projections' reader of this backend (the caller closes it; ``create``: an embedded log that does
        not exist yet is created, as a follow job does)."""

    @abc.abstractmethod
    @contextmanager
    def schema_store(self) -> Iterator[SchemaStore]:
        """Where the schema registry keeps its records."""

    @abc.abstractmethod
    def describe_topics(self) -> list[dict[str, Any]]:
        """Every topic with its partitions' offsets (``log topics --json``; sizes and segments on the embedded
        log)."""

    @abc.abstractmethod
    def describe_groups(self) -> list[dict[str, Any]]:
        """Consumer groups: members, committed offsets, lag per partition (``log groups --json``)."""

    def create_topic(
        self,
        topic: str,
        partitions: int,
        overrides: dict[str, str],
        *,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
    ) -> str:
        """Create ``topic`` (``overrides``: checked topic settings); returns the line ``log create`` prints.
        ``replication_factor`` / ``min_insync_replicas`` are refused where :attr:`topic_settings_apply` is false."""
        if not self.topic_settings_apply and (replication_factor is not None or min_insync_replicas is not None):
            from eventstore.errors import ConfigError

            raise ConfigError("--replication-factor and --min-insync-replicas apply to Kafka only (give --kafka)")
        return self._create_topic(topic, partitions, overrides, replication_factor, min_insync_replicas)

    @abc.abstractmethod
    def _create_topic(
        self, topic: str, partitions: int, overrides: dict[str, str], replication_factor: int | None,
        min_insync_replicas: int | None,
    ) -> str: ...  # fmt: skip

    @abc.abstractmethod
    def list_topics(self) -> list[dict[str, Any]]:
        """``log topics --json``: each topic's name, partitions and cleanup policy."""

    @abc.abstractmethod
    def describe_topic(self, topic: str) -> dict[str, Any]:
        """``log describe --json``: partitions with offsets (and what else the backend knows), config."""

    def topic_config_defaults(self) -> dict[str, Any] | None:
        """The default of each topic setting, for ``log describe`` (None: the brokers' defaults, not known here)."""
        return None

    @abc.abstractmethod
    def produce_lines(self, topic: str, stream: BinaryIO, *, partition: int | None = None) -> ProduceSummary:
        """``log produce``: ``KEY<TAB>VALUE`` lines of ``stream`` appended to ``topic``."""

    @abc.abstractmethod
    @contextmanager
    def tail(self, topic: str, options: TailOptions) -> Iterator[Iterator[list[TailRows]]]:
        """``log tail``: the rows of each poll (as stored; ``log tail`` decodes Avro through :meth:`registry`)."""

    @contextmanager
    def registry(self) -> Iterator[SchemaRegistry]:
        """The schema registry of this backend."""
        from schemas.registry import SchemaRegistry

        self.check()
        with self.schema_store() as store:
            yield SchemaRegistry(store)

    def schema_starts(self) -> dict[tuple[str, int], SchemaStart]:
        """Where each value schema version started (``__tideline_schema_starts``; empty when none was written)."""
        from capture.writer import read_schema_starts

        self.check()
        with tempfile.TemporaryDirectory(prefix="tideline-starts-") as state, self.sink(Path(state)) as sink:
            return read_schema_starts(sink)


@dataclass(frozen=True)
class EmbeddedBackend(Backend):
    """The embedded log in ``data_dir``."""

    data_dir: Path
    kind: ClassVar[str] = "embedded"
    topic_settings_apply: ClassVar[bool] = False
    log_cleaner_applies: ClassVar[bool] = True
    spark_needs_kafka_source: ClassVar[bool] = False

    @property
    def description(self) -> str:
        return f"the log at {self.data_dir}"

    def registry_location(self) -> str:
        return str(self.data_dir)

    def exists(self) -> bool:
        return self.data_dir.is_dir()

    def check(self) -> None:
        return None

    @contextmanager
    def capture_log(
        self,
        state_dir: Path | None = None,
        *,
        create: bool = True,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        kafka_producer: str | None = None,
    ) -> Iterator[tuple[Log | None, Sink | None]]:
        from eventstore.log import Log

        with Log(self.data_dir, create=create) as log:
            yield log, None

    @contextmanager
    def sink(self, state_dir: Path | None = None, *, create: bool = False) -> Iterator[Sink]:
        from capture.sinks.embedded import EmbeddedLogSink
        from eventstore.log import Log

        with Log(self.data_dir, create=create) as log:
            sink = EmbeddedLogSink(log)
            try:
                yield sink
            finally:
                sink.close()

    def describe_topics(self) -> list[dict[str, Any]]:
        from eventstore.log import Log
        from tideline.log_cli import describe_topics

        with Log(self.data_dir, create=False) as log:
            return describe_topics(log)

    def describe_groups(self) -> list[dict[str, Any]]:
        from eventstore.log import Log
        from tideline.log_cli import describe_groups

        with Log(self.data_dir, create=False) as log:
            return describe_groups(log)

    def _create_topic(
        self, topic: str, partitions: int, overrides: dict[str, str], replication_factor: int | None,
        min_insync_replicas: int | None,
    ) -> str:  # fmt: skip
        from eventstore.log import Log

        with Log(self.data_dir, create=True) as log:
            meta = log.create_topic(topic, partitions, overrides=overrides)
        plural = "s" if meta.partitions != 1 else ""
        return (f"created topic {meta.name} with {meta.partitions} partition{plural} "
                f"({meta.config.cleanup_policy.value}) in {self.data_dir}")  # fmt: skip

    def list_topics(self) -> list[dict[str, Any]]:
        from eventstore.log import Log
        from tideline.log_cli import list_topics

        with Log(self.data_dir, create=False) as log:
            return list_topics(log)

    def describe_topic(self, topic: str) -> dict[str, Any]:
        from eventstore.log import Log

        with Log(self.data_dir, create=False) as log:
            return log.describe_json(topic)

    def topic_config_defaults(self) -> dict[str, Any] | None:
        from eventstore.topic import TopicConfig

        return TopicConfig().to_json()

    def produce_lines(self, topic: str, stream: BinaryIO, *, partition: int | None = None) -> ProduceSummary:
        from eventstore.log import Log
        from tideline.log_cli import produce_lines

        with Log(self.data_dir, create=False) as log:
            return produce_lines(log, topic, stream, partition=partition)

    @contextmanager
    def tail(self, topic: str, options: TailOptions) -> Iterator[Iterator[list[TailRows]]]:
        from eventstore.log import Log
        from tideline.log_cli import tail_consumer, tail_polls

        with Log(self.data_dir, create=False) as log, tail_consumer(log, options) as consumer:
            yield tail_polls(log, consumer, topic, options)

    def source(self, *, create: bool = False) -> LogSource:
        from projections.embedded_source import EmbeddedSource

        return EmbeddedSource(self.data_dir, create=create)

    @contextmanager
    def schema_store(self) -> Iterator[SchemaStore]:
        from eventstore.log import Log
        from eventstore.schema_store import LogSchemaStore

        with Log(self.data_dir, create=False) as log:
            yield LogSchemaStore(log)


@dataclass(frozen=True)
class KafkaBackend(Backend):
    """An Apache Kafka cluster at ``bootstrap`` servers; ``data_dir`` holds capture's key state by default."""

    bootstrap: str
    data_dir: Path
    kind: ClassVar[str] = "kafka"
    topic_settings_apply: ClassVar[bool] = True
    log_cleaner_applies: ClassVar[bool] = False
    spark_needs_kafka_source: ClassVar[bool] = True

    @property
    def description(self) -> str:
        return f"Kafka at {self.bootstrap}"

    def registry_location(self) -> str:
        from eventstore.kafka.schema_store import SCHEMAS_TOPIC

        return f"{SCHEMAS_TOPIC} on Kafka at {self.bootstrap}"

    def check(self) -> None:
        from eventstore.kafka.config import probe_bootstrap

        probe_bootstrap(self.bootstrap)  # one line at once for an address nobody listens on

    @contextmanager
    def capture_log(
        self,
        state_dir: Path | None = None,
        *,
        create: bool = True,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
        kafka_producer: str | None = None,
    ) -> Iterator[tuple[Log | None, Sink | None]]:
        from capture.native.kafka import ProducerMode
        from capture.sinks.kafka import KafkaLogSink

        self.check()
        sink = KafkaLogSink(
            self.bootstrap,
            state_dir=state_dir or self.data_dir / "_capture",
            replication_factor=replication_factor,
            min_insync_replicas=min_insync_replicas,
            producer=None if kafka_producer is None else ProducerMode.parse(kafka_producer),
        )
        try:
            yield None, sink
        finally:
            sink.close()

    @contextmanager
    def sink(self, state_dir: Path | None = None, *, create: bool = False) -> Iterator[Sink]:
        with self.capture_log(state_dir, create=create) as (_, sink):
            assert sink is not None
            yield sink

    def describe_topics(self) -> list[dict[str, Any]]:
        from tideline import log_kafka

        return log_kafka.describe_topics(self.bootstrap)

    def describe_groups(self) -> list[dict[str, Any]]:
        from tideline import log_kafka

        return log_kafka.describe_groups(self.bootstrap)

    def _create_topic(
        self, topic: str, partitions: int, overrides: dict[str, str], replication_factor: int | None,
        min_insync_replicas: int | None,
    ) -> str:  # fmt: skip
        from tideline import log_kafka

        return log_kafka.create_topic(self.bootstrap, topic, partitions, overrides,
                                      replication_factor=replication_factor,
                                      min_insync_replicas=min_insync_replicas)  # fmt: skip

    def list_topics(self) -> list[dict[str, Any]]:
        from tideline import log_kafka

        return log_kafka.topics(self.bootstrap)

    def describe_topic(self, topic: str) -> dict[str, Any]:
        from eventstore.kafka import KafkaAdmin

        return KafkaAdmin(self.bootstrap).describe_json(topic)

    def produce_lines(self, topic: str, stream: BinaryIO, *, partition: int | None = None) -> ProduceSummary:
        from tideline import log_kafka

        return log_kafka.produce_lines(self.bootstrap, topic, stream, partition=partition)

    @contextmanager
    def tail(self, topic: str, options: TailOptions) -> Iterator[Iterator[list[TailRows]]]:
        from tideline import log_kafka

        polls = log_kafka.tail_polls(
            self.bootstrap, topic, from_beginning=options.from_beginning, follow=options.follow,
            partition=options.partition, offset=options.offset, group=options.group,
            isolation=options.isolation.value,
        )  # fmt: skip
        try:
            yield polls
        finally:
            polls.close()

    def source(self, *, create: bool = False) -> LogSource:
        from projections.kafka_source import KafkaSource

        self.check()
        return KafkaSource(self.bootstrap)

    @contextmanager
    def schema_store(self) -> Iterator[SchemaStore]:
        from eventstore.kafka.schema_store import KafkaSchemaStore

        with KafkaSchemaStore(self.bootstrap) as store:
            yield store


def choose(data_dir: Path, kafka: str | None) -> Backend:
    """Kafka when bootstrap servers are given, else the embedded log at ``data_dir``."""
    return KafkaBackend(kafka, data_dir) if kafka else EmbeddedBackend(data_dir)
