"""The log directory: topics, their partitions, and the front door to both.

Layout of a log directory::

    tideline-log.json        marker: {"format_version": 1}; a directory without it is refused
    _topics/<topic>.json     topic metadata (eventstore.topic)
    <topic>-<n>/             partition n of <topic> (eventstore.partition_log)
    _transactions/           producer ids and transaction state (eventstore.transactions)
    _groups/<group>/         consumer group members and partition owners (eventstore.group);
                             committed offsets live in the topic __consumer_offsets (eventstore.offsets)

Crash policy: topic creation makes the partition directories first and publishes the
metadata last (atomically), so a crash leaves either no topic or a whole one; empty
partition directories left behind are reused by the next creation of that name.

Thread-safety: thread-safe; ``_lock`` guards the caches of metadata and partitions.
Several processes may open the same directory (see eventstore.partition_log).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from eventstore.errors import ConfigError, TopicExistsError
from eventstore.fileio import replace_durably
from eventstore.partition_log import AppendResult, FetchedBatch, FsyncPolicy, PartitionLog
from eventstore.record_batch import EncodedBatch
from eventstore.segment import list_segment_bases, log_path
from eventstore.topic import (
    TopicConfig,
    TopicMetadata,
    list_topic_names,
    metadata_path,
    now_ms,
    publish_new,
    publish_update,
    read_metadata,
    validate_topic_name,
)

LOG_MARKER = "tideline-log.json"
LOG_FORMAT_VERSION = 1
MAX_PARTITIONS = 10_000
METADATA_MAX_AGE_S = 1.0


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """What ``describe`` reports about one partition."""

    partition: int
    log_start_offset: int
    log_end_offset: int
    size_bytes: int
    segments: int


class Log:
    """A directory of topics. Open it, create topics, append and read partitions.

    >>> with Log(path) as log:                                   # doctest: +SKIP
    ...     log.create_topic("orders", partitions=3)
    """

    def __init__(self, path: Path | str, *, fsync: FsyncPolicy | None = None, create: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync or FsyncPolicy()
        self._lock = threading.Lock()
        self._meta: dict[str, tuple[float, TopicMetadata]] = {}
        self._meta_checked: dict[str, float] = {}
        self._partitions: dict[tuple[str, int], PartitionLog] = {}
        self._check_marker(create)

    def _check_marker(self, create: bool) -> None:
        marker = self.path / LOG_MARKER
        if marker.exists():
            try:
                version = json.loads(marker.read_text())["format_version"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{marker} is unreadable: not a Tideline log marker") from None
            if version != LOG_FORMAT_VERSION:
                raise ConfigError(f"{self.path} has log format {version}; this Tideline reads {LOG_FORMAT_VERSION}")
            return
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise ConfigError(f"{self.path} is not a Tideline log directory (no {LOG_MARKER})")
        if not create:
            raise ConfigError(f"no Tideline log at {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)
        replace_durably(marker, (json.dumps({"format_version": LOG_FORMAT_VERSION}) + "\n").encode())

    def __enter__(self) -> Log:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ topics

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        config: TopicConfig | None = None,
        *,
        overrides: dict[str, str] | None = None,
    ) -> TopicMetadata:
        """Create a topic with ``partitions`` partitions; raises if the name is taken."""
        validate_topic_name(name)
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ConfigError(f"partitions must be within 1 … {MAX_PARTITIONS}, got {partitions}")
        cfg = config or TopicConfig()
        if overrides:
            cfg = cfg.with_overrides(overrides)
        cfg.validate()
        meta = TopicMetadata(name, partitions, cfg, created_ms=now_ms())
        if metadata_path(self.path, name).exists():
            raise TopicExistsError(name)
        for n in range(partitions):
            pdir = meta.partition_dir(self.path, n)
            if pdir.exists() and any(log_path(pdir, b).stat().st_size for b in list_segment_bases(pdir)):
                raise ConfigError(f"{pdir} already holds data but topic {name!r} has no metadata")
            PartitionLog.create(pdir)
        publish_new(self.path, meta)
        return meta

    def alter_topic_config(self, name: str, overrides: dict[str, str]) -> TopicMetadata:
        """Change topic settings (partition count is fixed); bumps ``config_version``."""
        current = self.topic(name)
        meta = TopicMetadata(
            name,
            current.partitions,
            current.config.with_overrides(overrides),
            current.config_version + 1,
            current.created_ms,
        )
        publish_update(self.path, meta)
        with self._lock:
            self._meta.pop(name, None)
            for (topic, _), plog in self._partitions.items():
                if topic == name:
                    plog.config = meta.config
        return meta

    def topics(self) -> list[str]:
        return list_topic_names(self.path)

    def topic(self, name: str) -> TopicMetadata:
        """Metadata of ``name``; UnknownTopicError if absent.

        Cached, and checked against the file at most every ``METADATA_MAX_AGE_S`` seconds
        (like Kafka's ``metadata.max.age.ms``): a config change made by another process is
        seen within that time; one made through this object at once.
        """
        with self._lock:
            cached = self._meta.get(name)
            if cached is not None and time.monotonic() - self._meta_checked.get(name, 0.0) < METADATA_MAX_AGE_S:
                return cached[1]
        path = metadata_path(self.path, name)
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            mtime = -1.0
        with self._lock:
            cached = self._meta.get(name)
            if cached is not None and cached[0] == mtime:
                self._meta_checked[name] = time.monotonic()
                return cached[1]
        meta = read_metadata(self.path, name)
        with self._lock:
            self._meta[name] = (mtime, meta)
            self._meta_checked[name] = time.monotonic()
            for (topic, _), plog in self._partitions.items():
                if topic == name:
                    plog.config = meta.config
        return meta

    def partition(self, topic: str, partition: int) -> PartitionLog:
        key = (topic, partition)
        with self._lock:
            plog = self._partitions.get(key)
        if plog is not None:
            return plog
        meta = self.topic(topic)
        if not 0 <= partition < meta.partitions:
            raise ConfigError(f"topic {topic!r} has partitions 0 … {meta.partitions - 1}, not {partition}")
        with self._lock:
            plog = self._partitions.get(key)
            if plog is None:
                plog = PartitionLog(meta.partition_dir(self.path, partition), topic, partition, meta.config, self.fsync)
                self._partitions[key] = plog
            return plog

    # ------------------------------------------------------------------ data

    def append(self, topic: str, partition: int, batch: EncodedBatch | bytearray) -> AppendResult:
        return self.partition(topic, partition).append(batch)

    def read(self, topic: str, partition: int, offset: int, *, max_bytes: int = 1 << 20) -> list[FetchedBatch]:
        return self.partition(topic, partition).read(offset, max_bytes=max_bytes)

    def describe(self, topic: str) -> tuple[TopicMetadata, list[PartitionInfo]]:
        meta = self.topic(topic)
        infos = []
        for n in range(meta.partitions):
            plog = self.partition(topic, n)
            infos.append(
                PartitionInfo(
                    n,
                    plog.log_start_offset(),
                    plog.log_end_offset(),
                    plog.size_bytes(),
                    len(list_segment_bases(plog.directory)),
                )
            )
        return meta, infos

    def describe_json(self, topic: str) -> dict[str, Any]:
        meta, infos = self.describe(topic)
        return {
            "topic": meta.name,
            "partitions": meta.partitions,
            "config_version": meta.config_version,
            "created_ms": meta.created_ms,
            "config": meta.config.to_json(),
            "partition_info": [
                {
                    "partition": i.partition,
                    "log_start_offset": i.log_start_offset,
                    "log_end_offset": i.log_end_offset,
                    "size_bytes": i.size_bytes,
                    "segments": i.segments,
                }
                for i in infos
            ],
        }

    def flush(self) -> None:
        with self._lock:
            plogs = list(self._partitions.values())
        for plog in plogs:
            plog.flush()

    def close(self) -> None:
        with self._lock:
            plogs = list(self._partitions.values())
            self._partitions.clear()
        for plog in plogs:
            plog.close()
