"""Topics on a Kafka cluster in the embedded log's vocabulary (``topics``/``topic``/``create_topic``/``describe``).

    admin = KafkaAdmin("127.0.0.1:9092")
    admin.create_topic("shop.public.orders", 3, TopicConfig(cleanup_policy=CleanupPolicy.COMPACT),
                       replication_factor=3, min_insync_replicas=2)
    admin.topic("shop.public.orders").config.cleanup_policy   # CleanupPolicy.COMPACT, read back from Kafka

Every :class:`~eventstore.topic.TopicConfig` setting is written explicitly
(``config.topic_configs``), so a topic means the same on any broker whatever its
defaults. Replication factor and ``min.insync.replicas`` are Kafka's own: None
leaves them to the broker's ``default.replication.factor`` / ``min.insync.replicas``.

Thread safety: a ``KafkaAdmin`` may be shared by threads (librdkafka's handle is
thread-safe; this class keeps no state of its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import IsolationLevel, KafkaError, KafkaException, TopicCollection
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import ConfigResource
from confluent_kafka.admin._listoffsets import OffsetSpec
from confluent_kafka.cimpl import NewTopic

from eventstore.errors import ConfigError, KafkaUnavailableError, TopicExistsError, UnknownTopicError
from eventstore.kafka.config import (
    MIN_INSYNC_REPLICAS,
    client_config,
    topic_config_from_kafka,
    topic_configs,
    translate,
    while_leadership_moves,
)
from eventstore.log import MAX_PARTITIONS
from eventstore.topic import TopicConfig, TopicMetadata, now_ms, validate_topic_name

# Kafka's own internal topics: the brokers manage them, ``topics()`` does not list them.
KAFKA_INTERNAL_TOPICS = frozenset({"__consumer_offsets", "__transaction_state", "__share_group_state"})
DEFAULT_TIMEOUT_S = 10.0
RETRY_BACKOFF_S = 0.1
# A topic this admin created or saw that a broker's metadata answers as unknown: that broker's metadata cache lags
# the controller (KRaft brokers follow the metadata log asynchronously; Kafka's clients take it as retriable). Asked
# again for up to this long before it counts as gone (so a topic deleted meanwhile is reported unknown after it).
PROPAGATION_S = 10.0
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class KafkaPartitionInfo:
    """What ``describe`` reports about one partition of a Kafka topic."""

    partition: int
    leader: int  # broker id, -1 while no leader is elected
    replicas: tuple[int, ...]
    in_sync_replicas: tuple[int, ...]
    log_start_offset: int
    high_watermark: int  # one past the last replicated offset (what read_uncommitted consumers can reach)
    last_stable_offset: int  # first offset of the oldest open transaction, else the high watermark


class KafkaAdmin:
    """Create, list and describe topics of the Kafka cluster at ``bootstrap_servers``."""

    def __init__(self, bootstrap_servers: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.timeout_s = timeout_s
        try:
            self._admin = AdminClient(client_config(bootstrap_servers))
        except KafkaException as e:
            translate(e, what="creating an admin client", bootstrap=bootstrap_servers)
        self._seen: set[str] = set()  # topics created or found here: "unknown" later is a lagging broker first

    # -- topics --------------------------------------------------------------

    def topics(self) -> list[str]:
        """Names of the cluster's topics, Kafka's internal ones left out, sorted."""
        metadata = self._metadata(None, what="listing topics")
        return sorted(name for name in metadata.topics if name not in KAFKA_INTERNAL_TOPICS)

    def topic(self, name: str) -> TopicMetadata:
        """Partition count and settings of ``name`` as Kafka has them; UnknownTopicError if absent."""
        partitions = len(self._topic_metadata(name).partitions)
        return TopicMetadata(name, partitions, topic_config_from_kafka(self.topic_configs(name)))

    def topic_configs(self, name: str) -> dict[str, str | None]:
        """Every Kafka config of topic ``name`` (defaults included), as Kafka reports them."""
        self._topic_metadata(name)  # UnknownTopicError for a topic the cluster does not have
        resource = ConfigResource(ConfigResource.Type.TOPIC, name)

        def describe_once() -> dict[str, str | None]:
            (future,) = self._admin.describe_configs([resource], request_timeout=self.timeout_s).values()
            return {key: entry.value for key, entry in future.result(timeout=self.timeout_s + 5).items()}

        # The metadata has the topic, so "unknown" here is a broker that has not caught up with it yet.
        return self._retrying(describe_once, what=f"describing topic {name!r}", topic=name,
                              also=frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART}))  # fmt: skip

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        config: TopicConfig | None = None,
        *,
        overrides: dict[str, str] | None = None,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
    ) -> TopicMetadata:
        """Create ``name`` with the embedded log's settings mapped to Kafka's; TopicExistsError if taken."""
        validate_topic_name(name)
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ConfigError(f"partitions must be within 1 … {MAX_PARTITIONS}, got {partitions}")
        if replication_factor is not None and replication_factor < 1:
            raise ConfigError(f"replication factor must be ≥ 1, got {replication_factor}")
        cfg = (config or TopicConfig()).with_overrides(overrides or {})
        if min_insync_replicas is not None:
            replicas = replication_factor or self._default_replication_factor()
            source = "" if replication_factor else " (the brokers' default.replication.factor)"
            if min_insync_replicas > replicas:
                raise ConfigError(
                    f"min.insync.replicas {min_insync_replicas} exceeds replication factor {replicas}{source}: "
                    "no write with acks=all could ever succeed"
                )
        new_topic = NewTopic(
            name,
            partitions,
            replication_factor if replication_factor is not None else -1,  # -1: the broker's default
            config=topic_configs(cfg, min_insync_replicas=min_insync_replicas),
        )
        try:
            self._admin.create_topics([new_topic], request_timeout=self.timeout_s)[name].result(
                timeout=self.timeout_s + 5
            )
        except KafkaException as e:
            self._raise_create_error(e, name)
        self._wait_for_leaders(name, partitions)
        self._seen.add(name)
        return TopicMetadata(name, partitions, cfg, created_ms=now_ms())

    def ensure_topic(
        self,
        name: str,
        partitions: int = 1,
        config: TopicConfig | None = None,
        *,
        overrides: dict[str, str] | None = None,
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
    ) -> TopicMetadata:
        """Create ``name`` if missing (topics are created on first sight); if it exists, check that it agrees.

        Agreeing means the same partition count (it decides where a key goes), the same
        cleanup policy, and the same value for every setting named in ``overrides``; a
        contradiction raises ConfigError naming each difference, and nothing is changed.
        """
        wanted = (config or TopicConfig()).with_overrides(overrides or {})
        if name not in self.topics():
            try:
                return self.create_topic(name, partitions, wanted, replication_factor=replication_factor,
                                         min_insync_replicas=min_insync_replicas)  # fmt: skip
            except TopicExistsError:
                pass  # created meanwhile by another process: check it like any existing topic
        existing = self.topic(name)
        checked = {"cleanup_policy"} | {k.strip().replace(".", "_").replace("-", "_") for k in overrides or {}}
        checked = {"compression" if key == "compression_type" else key for key in checked}
        have, want = existing.config.to_json(), wanted.to_json()
        differences = [f"{key}={have[key]} (asked: {want[key]})" for key in sorted(checked) if have[key] != want[key]]
        if existing.partitions != partitions:
            differences.insert(0, f"partitions={existing.partitions} (asked: {partitions})")
        if differences:
            raise ConfigError(f"topic {name!r} exists on Kafka with other settings: {', '.join(differences)}")
        return existing

    def partition_counts(self, names: Iterable[str]) -> dict[str, int]:
        """Partitions of each of ``names`` that exists (one metadata request; absent topics left out)."""
        wanted = set(names)
        metadata = self._metadata(None, what="listing topics")
        return {
            name: len(meta.partitions)
            for name, meta in metadata.topics.items()
            if name in wanted and meta.error is None and meta.partitions
        }

    def end_offsets(self, partitions: Iterable[tuple[str, int]], *, read_committed: bool) -> dict[tuple[str, int], int]:
        """Where a reader of each ``(topic, partition)`` stops now: the last stable offset
        (``read_committed``: below the oldest open transaction) or the high watermark."""
        isolation = IsolationLevel.READ_COMMITTED if read_committed else IsolationLevel.READ_UNCOMMITTED
        return self._offsets(partitions, OffsetSpec.latest(), isolation)  # type: ignore[no-untyped-call]

    def start_offsets(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The log start offset of each ``(topic, partition)`` (retention may have removed the ones before)."""
        return self._offsets(partitions, OffsetSpec.earliest(), IsolationLevel.READ_UNCOMMITTED)  # type: ignore[no-untyped-call]

    def describe(self, name: str) -> tuple[TopicMetadata, list[KafkaPartitionInfo]]:
        """Settings, leaders, replicas and offsets of every partition of ``name``."""
        topic_meta = self._topic_metadata(name)
        meta = TopicMetadata(name, len(topic_meta.partitions), topic_config_from_kafka(self.topic_configs(name)))
        tps = [KafkaTopicPartition(name, p) for p in sorted(topic_meta.partitions)]
        earliest, latest = OffsetSpec.earliest(), OffsetSpec.latest()  # type: ignore[no-untyped-call]
        start = self._list_offsets(tps, earliest, IsolationLevel.READ_UNCOMMITTED)
        high = self._list_offsets(tps, latest, IsolationLevel.READ_UNCOMMITTED)
        stable = self._list_offsets(tps, latest, IsolationLevel.READ_COMMITTED)
        infos = []
        for p in sorted(topic_meta.partitions):
            part = topic_meta.partitions[p]
            infos.append(KafkaPartitionInfo(p, part.leader, tuple(part.replicas), tuple(part.isrs),
                                            start[p], high[p], stable[p]))  # fmt: skip
        return meta, infos

    def describe_json(self, name: str) -> dict[str, Any]:
        meta, infos = self.describe(name)
        configs = self.topic_configs(name)
        return {
            "topic": meta.name,
            "partitions": meta.partitions,
            "replication_factor": len(infos[0].replicas) if infos else 0,
            "min_insync_replicas": int(configs.get(MIN_INSYNC_REPLICAS) or 1),
            "config": meta.config.to_json(),
            "partition_info": [
                {
                    "partition": i.partition,
                    "leader": i.leader,
                    "replicas": list(i.replicas),
                    "in_sync_replicas": list(i.in_sync_replicas),
                    "log_start_offset": i.log_start_offset,
                    "log_end_offset": i.high_watermark,
                    "last_stable_offset": i.last_stable_offset,
                }
                for i in infos
            ],
        }

    def stable_offsets(self, name: str) -> dict[int, int]:
        """Per partition of ``name``, where ``read_committed`` reading ends now: the last stable offset."""
        topic_meta = self._topic_metadata(name)
        tps = [KafkaTopicPartition(name, p) for p in sorted(topic_meta.partitions)]
        return self._list_offsets(tps, OffsetSpec.latest(), IsolationLevel.READ_COMMITTED)  # type: ignore[no-untyped-call]

    def high_watermarks(self, name: str) -> dict[int, int]:
        """Per partition of ``name``, the high watermark (where ``read_uncommitted`` reading ends now)."""
        topic_meta = self._topic_metadata(name)
        tps = [KafkaTopicPartition(name, p) for p in sorted(topic_meta.partitions)]
        return self._list_offsets(tps, OffsetSpec.latest(), IsolationLevel.READ_UNCOMMITTED)  # type: ignore[no-untyped-call]

    def topic_id(self, name: str) -> str | None:
        """Kafka's id of topic ``name`` (a new one when the topic is deleted and created again); None if absent."""
        if name not in self.topics():
            return None

        def describe_once() -> str:
            (future,) = self._admin.describe_topics(TopicCollection([name]), request_timeout=self.timeout_s).values()
            return str(future.result(timeout=self.timeout_s + 5).topic_id)

        return self._retrying(describe_once, what=f"describing topic {name!r}", topic=name,
                              also=frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART}))  # fmt: skip

    # -- internals -----------------------------------------------------------

    def _default_replication_factor(self) -> int:
        """The brokers' ``default.replication.factor``: what a topic created without one gets."""
        brokers = sorted(self._metadata(None, what="listing brokers").brokers)
        if not brokers:
            raise KafkaUnavailableError(f"Kafka at {self.bootstrap_servers} reports no broker")
        resource = ConfigResource(ConfigResource.Type.BROKER, str(brokers[0]))

        def describe_once() -> int:
            (future,) = self._admin.describe_configs([resource], request_timeout=self.timeout_s).values()
            entry = future.result(timeout=self.timeout_s + 5).get("default.replication.factor")
            return int(entry.value) if entry is not None and entry.value is not None else 1

        return self._retrying(describe_once, what="reading the brokers' default replication factor", topic=None)

    def _metadata(self, topic: str | None, *, what: str) -> Any:
        try:
            return self._admin.list_topics(topic, timeout=self.timeout_s)
        except KafkaException as e:
            translate(e, what=what, bootstrap=self.bootstrap_servers, topic=topic)

    def _topic_metadata(self, name: str) -> Any:
        """``name``'s metadata; UnknownTopicError if the cluster does not have it. A topic created or seen here
        that a broker answers as unknown is asked again for up to PROPAGATION_S (that broker's metadata lags)."""
        deadline = time.monotonic() + (PROPAGATION_S if name in self._seen else 0.0)
        while True:
            metadata = self._metadata(name, what=f"reading metadata of topic {name!r}")
            topic_meta = metadata.topics.get(name)
            if topic_meta is not None and topic_meta.error is None:
                self._seen.add(name)
                return topic_meta
            if topic_meta is not None and topic_meta.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                translate(topic_meta.error, what=f"reading metadata of topic {name!r}",
                          bootstrap=self.bootstrap_servers, topic=name)  # fmt: skip
            if time.monotonic() >= deadline:
                raise UnknownTopicError(name)
            time.sleep(RETRY_BACKOFF_S)

    def _list_offsets(
        self, tps: list[KafkaTopicPartition], spec: OffsetSpec, isolation: IsolationLevel
    ) -> dict[int, int]:
        offsets = self._offsets([(tp.topic, tp.partition) for tp in tps], spec, isolation)
        return {partition: offset for (_, partition), offset in offsets.items()}

    def _offsets(
        self, partitions: Iterable[tuple[str, int]], spec: OffsetSpec, isolation: IsolationLevel
    ) -> dict[tuple[str, int], int]:
        """One ListOffsets round per broker for every partition (of any topics)."""
        tps = [KafkaTopicPartition(topic, partition) for topic, partition in partitions]
        if not tps:
            return {}

        def list_once() -> dict[tuple[str, int], int]:
            futures = self._admin.list_offsets({tp: spec for tp in tps}, isolation_level=isolation,
                                               request_timeout=self.timeout_s)  # fmt: skip
            return {
                (tp.topic, tp.partition): future.result(timeout=self.timeout_s + 5).offset
                for tp, future in futures.items()
            }

        return self._retrying(
            list_once, what="listing offsets", topic=tps[0].topic, also=frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART})
        )  # callers checked it exists

    def _wait_for_leaders(self, name: str, partitions: int) -> None:
        """Return once every partition of a new topic has a leader (CreateTopics answers before that)."""

        def leaders() -> None:
            found = self._admin.list_topics(name, timeout=self.timeout_s).topics.get(name)
            if found is None or found.error is not None or len(found.partitions) < partitions:
                raise KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE, f"topic {name!r} not propagated yet"))
            if any(p.leader < 0 for p in found.partitions.values()):
                raise KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE, f"topic {name!r} has no leader yet"))

        self._retrying(leaders, what=f"waiting for the leaders of new topic {name!r}", topic=name)

    def _retrying(
        self, action: Callable[[], T], *, what: str, topic: str | None, also: frozenset[int] = frozenset()
    ) -> T:
        """Run ``action``, again while it fails only because leadership is moving (or with ``also``),
        up to ``timeout_s``; a failure translated."""
        try:
            return while_leadership_moves(action, timeout_s=self.timeout_s, also=also)
        except KafkaException as e:
            translate(e, what=what, bootstrap=self.bootstrap_servers, topic=topic)

    def _raise_create_error(self, error: KafkaException, name: str) -> None:
        err = error.args[0]
        code = err.code() if isinstance(err, KafkaError) else None
        if code == KafkaError.TOPIC_ALREADY_EXISTS:
            raise TopicExistsError(name) from None
        if code in (KafkaError.INVALID_REPLICATION_FACTOR, KafkaError.INVALID_CONFIG, KafkaError.POLICY_VIOLATION,
                    KafkaError.INVALID_PARTITIONS):  # fmt: skip
            raise ConfigError(f"Kafka refused topic {name!r}: {err.str()}") from None
        translate(error, what=f"creating topic {name!r}", bootstrap=self.bootstrap_servers, topic=name)
