"""Topic configuration and durable, versioned topic metadata.

File naming: ``<log dir>/_topics/<topic>.json``; a topic's partitions are the
directories ``<log dir>/<topic>-<n>/`` for ``n`` in ``0 … partitions-1``.

File layout (JSON, UTF-8)::

    {"format_version": 1,            # layout of this file
     "name": "orders", "partitions": 3, "created_ms": 1700000000000,
     "config_version": 1,            # +1 on every config change
     "config": {"cleanup_policy": "compact", "retention_ms": 604800000, …},
     "crc32c": 123456789}            # CRC32C of the canonical JSON of every other field

Crash policy: the file is written to ``<name>.json.tmp``, fsynced, then published with
``link`` (creation: fails if the topic exists, so two processes cannot both create it)
or ``rename`` (config change), and the directory is fsynced. A torn or edited file
fails its checksum and raises :class:`CorruptCheckpointError` naming it: topic
metadata cannot be rebuilt from the data, so nothing guesses.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from eventstore.errors import (
    ConfigError,
    CorruptCheckpointError,
    TopicExistsError,
    UnknownTopicError,
)
from eventstore.fileio import fsync_dir, replace_durably, tmp_path_for, write_fsynced
from eventstore.record_batch import Codec

METADATA_FORMAT_VERSION = 1
TOPICS_DIR = "_topics"
_LEGAL_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")

DAY_MS = 24 * 3600 * 1000
_FLOAT_SETTINGS = frozenset({"min_cleanable_dirty_ratio"})


class CleanupPolicy(enum.Enum):
    """What happens to old data: deleted by age/size, compacted by key, or both."""

    DELETE = "delete"
    COMPACT = "compact"
    COMPACT_DELETE = "compact,delete"

    @classmethod
    def parse(cls, text: str) -> CleanupPolicy:
        normal = ",".join(sorted(p.strip() for p in re.split(r"[,+]", text.lower()) if p.strip()))
        for member in cls:
            if member.value == normal:
                return member
        raise ConfigError(f"unknown cleanup_policy {text!r} (choose delete, compact or compact+delete)")

    @property
    def compacts(self) -> bool:
        return self is not CleanupPolicy.DELETE

    @property
    def deletes(self) -> bool:
        return self is not CleanupPolicy.COMPACT


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """Per-topic settings (Kafka's names, with underscores). ``-1`` means unlimited."""

    cleanup_policy: CleanupPolicy = CleanupPolicy.DELETE
    retention_ms: int = 7 * DAY_MS  # delete policy: closed segments older than this go
    retention_bytes: int = -1  # delete policy: oldest closed segments go while above this
    segment_bytes: int = 1 << 30  # roll the active segment when it would exceed this
    segment_ms: int = 7 * DAY_MS  # ... or when its first record is older than this
    delete_retention_ms: int = DAY_MS  # tombstone grace once in the cleaned part
    min_compaction_lag_ms: int = 0  # records younger than this are not compacted
    min_cleanable_dirty_ratio: float = 0.5  # the cleaner compacts once dirty / (clean + dirty) bytes reach this
    compression: Codec = Codec.NONE
    index_interval_bytes: int = 4096  # one index entry per this many bytes of log, at most
    max_batch_bytes: int = 64 << 20  # a larger produced batch is refused

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, CleanupPolicy) else (v.name.lower() if isinstance(v, Codec) else v)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TopicConfig:
        return cls().with_overrides({k: str(v) for k, v in data.items()})

    def with_overrides(self, overrides: dict[str, str]) -> TopicConfig:
        """A copy with ``KEY=VALUE`` settings applied; unknown keys and bad values raise."""
        names = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for raw_key, value in overrides.items():
            key = raw_key.strip().replace(".", "_").replace("-", "_")
            if key == "compression_type":
                key = "compression"
            if key not in names:
                raise ConfigError(f"unknown topic setting {raw_key!r} (known: {', '.join(sorted(names))})")
            if key == "cleanup_policy":
                changes[key] = CleanupPolicy.parse(value)
            elif key == "compression":
                changes[key] = Codec.parse(value)
            elif key in _FLOAT_SETTINGS:
                try:
                    changes[key] = float(value)
                except ValueError:
                    raise ConfigError(f"topic setting {key} must be a number, got {value!r}") from None
            else:
                try:
                    changes[key] = int(value)
                except ValueError:
                    raise ConfigError(f"topic setting {key} must be an integer, got {value!r}") from None
        updated = dataclasses.replace(self, **changes)
        updated.validate()
        return updated

    def validate(self) -> None:
        if self.segment_bytes < 1024:
            raise ConfigError(f"segment_bytes must be ≥ 1024, got {self.segment_bytes}")
        for name in ("segment_ms", "delete_retention_ms", "min_compaction_lag_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be ≥ 0, got {getattr(self, name)}")
        for name in ("retention_ms", "retention_bytes"):
            if getattr(self, name) < -1:
                raise ConfigError(f"{name} must be ≥ 0 or -1 (unlimited), got {getattr(self, name)}")
        if not 0.0 <= self.min_cleanable_dirty_ratio <= 1.0:
            raise ConfigError(f"min_cleanable_dirty_ratio must be within 0 … 1, got {self.min_cleanable_dirty_ratio}")
        if self.index_interval_bytes < 1:
            raise ConfigError(f"index_interval_bytes must be ≥ 1, got {self.index_interval_bytes}")
        if not 1024 <= self.max_batch_bytes <= 1 << 30:
            raise ConfigError(f"max_batch_bytes must be within 1 KiB … 1 GiB, got {self.max_batch_bytes}")


@dataclass(frozen=True, slots=True)
class TopicMetadata:
    """What a topic is: its name, partition count and configuration."""

    name: str
    partitions: int
    config: TopicConfig
    config_version: int = 1
    created_ms: int = 0

    def partition_dir(self, log_dir: Path, partition: int) -> Path:
        return log_dir / f"{self.name}-{partition}"


def validate_topic_name(name: str) -> None:
    if not _LEGAL_NAME.match(name) or name in (".", ".."):
        raise ConfigError(f"illegal topic name {name!r}: use 1-249 characters from [A-Za-z0-9._-]")


def metadata_path(log_dir: Path, name: str) -> Path:
    return log_dir / TOPICS_DIR / f"{name}.json"


def _encode(meta: TopicMetadata) -> bytes:
    body = {
        "format_version": METADATA_FORMAT_VERSION,
        "name": meta.name,
        "partitions": meta.partitions,
        "created_ms": meta.created_ms,
        "config_version": meta.config_version,
        "config": meta.config.to_json(),
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["crc32c"] = crc32c.crc32c(canonical)
    return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"


def read_metadata(log_dir: Path, name: str) -> TopicMetadata:
    path = metadata_path(log_dir, name)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UnknownTopicError(name) from None
    try:
        body = json.loads(raw)
        stored_crc = body.pop("crc32c")
    except (ValueError, KeyError, AttributeError):
        raise CorruptCheckpointError(path, "JSON with a crc32c field", raw[:40]) from None
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if crc32c.crc32c(canonical) != stored_crc:
        raise CorruptCheckpointError(path, f"crc32c {crc32c.crc32c(canonical)}", stored_crc)
    if body.get("format_version") != METADATA_FORMAT_VERSION:
        raise CorruptCheckpointError(path, f"format_version {METADATA_FORMAT_VERSION}", body.get("format_version"))
    return TopicMetadata(
        name=body["name"],
        partitions=int(body["partitions"]),
        config=TopicConfig.from_json(body["config"]),
        config_version=int(body["config_version"]),
        created_ms=int(body["created_ms"]),
    )


def publish_new(log_dir: Path, meta: TopicMetadata) -> None:
    """Durably create the metadata file; :class:`TopicExistsError` if it is already there."""
    path = metadata_path(log_dir, meta.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    write_fsynced(tmp, [_encode(meta)])
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise TopicExistsError(meta.name) from None
    finally:
        tmp.unlink()
    fsync_dir(path.parent)


def publish_update(log_dir: Path, meta: TopicMetadata) -> None:
    """Durably replace the metadata file (config change)."""
    replace_durably(metadata_path(log_dir, meta.name), _encode(meta))


def list_topic_names(log_dir: Path) -> list[str]:
    d = log_dir / TOPICS_DIR
    if not d.is_dir():
        return []
    return sorted(n[: -len(".json")] for n in os.listdir(d) if n.endswith(".json"))


def now_ms() -> int:
    return time.time_ns() // 1_000_000
