"""The connector's configuration: one dataclass, its enums, and the checks that run before anything starts.

Names follow Debezium's PostgreSQL connector where there is an equivalent
(``snapshot.mode``, ``message.key.columns``, ``provide.transaction.metadata``,
``errors.max.retries``/``retriable.restart.connector.wait.ms`` → ``max_retry_time_s``,
``publication.name``, ``publication.autocreate.mode``).

Among the checks, ``--core native`` against this process (:meth:`CaptureConfig.native_refusal`): the
extension must be importable (capture.native.extension, which imports nothing of capture) and must decode
the plugin and write the value format (their capabilities). The native core itself (capture.native.core)
imports this module, never the reverse.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from capture.messages import DecoderSettings, Plugin
from capture.native import extension
from capture.publications import PublicationMode, Publications
from capture.signals import split_table_name
from capture.tables import KeylessPolicy, TableFilter
from eventstore.errors import ConfigError
from eventstore.record_batch import Codec
from eventstore.topic import validate_topic_name

__all__ = [
    "CaptureConfig",
    "KeylessPolicy",
    "NativeUnavailableError",
    "OffsetMismatch",
    "PublicationMode",
    "SnapshotMode",
    "ValueFormat",
]


E = TypeVar("E", bound=enum.Enum)


def parse_choice(cls: type[E], text: str, what: str) -> E:
    """The member of ``cls`` whose value is ``text``; else a one-line error naming ``what`` and the choices."""
    try:
        return cls(text)
    except ValueError:
        choices = ", ".join(str(m.value) for m in cls)
        raise ConfigError(f"{what} must be one of {choices}; not {text!r}") from None


class SnapshotMode(enum.Enum):
    INITIAL = "initial"
    ALWAYS = "always"
    NEVER = "never"
    WHEN_NEEDED = "when_needed"

    @classmethod
    def parse(cls, text: str) -> SnapshotMode:
        return parse_choice(cls, text, "--snapshot")


class OffsetMismatch(enum.Enum):
    """What a start does when the stored position and the slot disagree (capture.recovery; Debezium 3.4's
    ``offset.mismatch.strategy``)."""

    FAIL = "fail"
    TRUST_SLOT = "trust_slot"
    TRUST_OFFSET = "trust_offset"

    @classmethod
    def parse(cls, text: str) -> OffsetMismatch:
        return parse_choice(cls, text, "--offset-mismatch")


class ValueFormat(enum.Enum):
    """The format of table topics' keys and values (capture.converters.converter_for), with what the compiled
    code writes of it."""

    JSON = "json"
    AVRO = "avro"  # through the schema registry (capture.avro)

    @classmethod
    def parse(cls, text: str) -> ValueFormat:
        return parse_choice(cls, text, "--value-format")

    @property
    def capabilities(self) -> FormatCapabilities:
        return _FORMAT_CAPABILITIES[self]


@dataclass(frozen=True, slots=True)
class FormatCapabilities:
    """What the native code writes of a value format (drives the choice of path, capture.native)."""

    # The native core writes a change's key and envelope in it (capture.native.core; Avro: native/src/avro.rs),
    # and capture.native.handle maps the member to the extension's tideline_native.ValueFormat
    native_changes: bool
    # The compiled snapshot encoder writes a read's after image and key in it (native/src/snapshot.rs; the
    # connector's own connection and the reader processes, capture.snapshot_readers)
    native_snapshot_reads: bool


_FORMAT_CAPABILITIES = {
    ValueFormat.JSON: FormatCapabilities(native_changes=True, native_snapshot_reads=True),
    ValueFormat.AVRO: FormatCapabilities(native_changes=True, native_snapshot_reads=False),
}


DEFAULT_COMPRESSION = "lz4"  # of the record batches capture writes (CaptureConfig.compression)
MAX_SNAPSHOT_WORKERS = 64  # reader processes of one snapshot, each with its own database connection

# A slot holding back more WAL than this is warned about (connector log, capture status, console).
RETAINED_WAL_WARN_BYTES = 1 << 30


ENV = "TIDELINE_CAPTURE_CORE"  # the default of CaptureConfig.core (capture.native.core)


class NativeUnavailableError(ConfigError):
    """``--core native`` was asked for, but this process cannot run the native core for the configuration: the
    extension is not built, or does not cover the plugin, the value format or the value converter."""


class CoreChoice(enum.Enum):
    AUTO = "auto"
    PYTHON = "python"
    NATIVE = "native"

    @classmethod
    def parse(cls, text: str) -> CoreChoice:
        return parse_choice(cls, text, "--core")

    @classmethod
    def default(cls) -> CoreChoice:
        """``TIDELINE_CAPTURE_CORE`` when set, else auto."""
        text = os.environ.get(ENV)
        return parse_choice(cls, text, ENV) if text else cls.AUTO


@dataclass(slots=True)
class CaptureConfig:
    dsn: str
    slot: str = "tideline"
    topic_prefix: str = "tideline"
    plugin: Plugin = Plugin.WAL2JSON
    snapshot: SnapshotMode = SnapshotMode.INITIAL
    offset_mismatch: OffsetMismatch = OffsetMismatch.FAIL  # stored position vs slot (capture.recovery)
    table_filter: TableFilter = field(default_factory=TableFilter)
    keyless_tables: KeylessPolicy = KeylessPolicy.KEYLESS
    # "schema.table" → topic: overrides the <prefix>.<schema>.<table> rule (capture.topics)
    table_topics: dict[str, str] = field(default_factory=dict)
    partitions: int = 1
    batch_bytes: int = 4 << 20
    # ... or this many events, whichever comes first: tiny records (a TRUNCATE's tombstones)
    # cost far more memory as Python objects than their bytes say.
    batch_events: int = 20_000
    linger_ms: int = 10  # caught up: commit a batch this old at the first gap in the stream
    max_linger_ms: int = 50  # messages waiting (behind): let the batch grow this long
    status_interval_s: float = 1.0
    heartbeat_query: str | None = None
    heartbeat_interval_s: float = 10.0
    retained_wal_warn_bytes: int = RETAINED_WAL_WARN_BYTES
    toast_cache_bytes: int = 64 << 20
    # The key state (capture.keystate): its directory (None: the sink's default, next to
    # the log) and the bound of its page cache in memory.
    state_dir: Path | None = None
    key_state_cache_bytes: int = 16 << 20
    exit_when_caught_up: bool = False
    # Failures (capture.errors): transient ones are retried with a backoff that resets after
    # success, for at most this long in a row (0: forever). A first connection that fails
    # is reported at once unless retry_on_start.
    max_retry_time_s: float = 600.0
    retry_on_start: bool = False
    # A slot held by another walsender is retried this long (our own dead connection's walsender
    # may not have noticed yet) before it counts as used by another process.
    slot_busy_wait_s: float = 60.0  # Debezium: slot.max.retries 6 × slot.retry.delay.ms 10 s
    # BEGIN/END records on <prefix>.transaction (Debezium's provide.transaction.metadata, off
    # by default there too): one more partition in every log transaction, two events per
    # Postgres transaction. Events carry their ``transaction`` block either way.
    transaction_metadata: bool = False
    # Schema change events (capture.schema_changes): each DDL on a captured table as an event on
    # <prefix>.schema_changes at its WAL position; installs an event trigger in the source database.
    schema_changes: bool = False
    # Partitioned tables (capture.partitions): False, each partition is a captured table with its own topic (its
    # changes come under its name); True (Debezium's and PostgreSQL's publish_via_partition_root), a partitioned
    # table is captured as one table, its partitions' changes and rows in its topic, followed through ATTACH,
    # DETACH and DROP of partitions (the event triggers of capture.schema_changes say when).
    publish_via_partition_root: bool = False
    value_format: ValueFormat = ValueFormat.JSON  # avro: table topics through the schema registry (capture.avro)
    # Outbox routing (capture.events): rows inserted into this table ("schema.table", e.g. the
    # commands' "public.events") become records on <outbox_topic_prefix>.<stream_type>.
    outbox_table: str | None = None
    outbox_topic_prefix: str = "events"
    # pgoutput (capture.publications): the publication (None: named like the slot, so that two
    # connectors with their own slots never alter each other's) and who manages it (None: filtered).
    publication: str | None = None
    publication_autocreate: PublicationMode | None = None
    # pgoutput's protocol: 2 (and 3) stream transactions bigger than the server's
    # logical_decoding_work_mem before they commit; they wait in spill_dir (None: the key
    # state's directory) until then, so memory stays bounded. 1: the server spills them itself.
    pgoutput_proto_version: int = 2
    pgoutput_streaming: bool = True
    spill_dir: Path | None = None
    # Incremental snapshots (capture.incremental) and the signal table that starts them (capture.signals;
    # Debezium's signal.data.collection and incremental.snapshot.chunk.size).
    # None (default): no signal table, as Debezium without signal.data.collection; the incremental
    # snapshots of tables new to the include list still run. capture.signals.DEFAULT_SIGNAL_TABLE: the usual name.
    signal_table: str | None = None
    incremental_chunk_size: int = 1024
    # Reader processes of the initial snapshot (capture.snapshot_readers; Debezium's snapshot.max.threads):
    # 1 (default) reads every table in the connector's own connection; N > 1 splits big tables into ctid ranges.
    snapshot_workers: int = 1
    # Compression of the record batches capture writes to its topics, not the schema registry's (Kafka's producer
    # compression.type, which Debezium users set with producer.override.compression.type): none, gzip, lz4 or
    # zstd (level 3, Kafka's default). Default lz4: Debezium's envelopes are mostly field names, lz4 stores them in
    # about 6× fewer bytes, and a big snapshot, bound by writing and syncing the log, reads about twice as fast
    # (0.73× COPY against 0.39× uncompressed, single reader); streaming costs within ±7 % (docs/capture.md,
    # Performance). "none" stores uncompressed batches; None (API only): the sink's own setting (the embedded
    # log's topic compression; Kafka's producer default, none).
    compression: str | None = DEFAULT_COMPRESSION

    # The per-change core (capture.native.core): auto (the native extension when built and applicable), python, native.
    core: CoreChoice = field(default_factory=CoreChoice.default)

    def validate(self) -> None:
        validate_topic_name(f"{self.topic_prefix}.transaction")
        if not self.slot.replace("_", "").isalnum() or self.slot.lower() != self.slot or not self.slot.isascii():
            raise ConfigError(f"slot name {self.slot!r}: use lower-case letters, digits and _")
        if not self.plugin.implemented:
            raise ConfigError(f"plugin {self.plugin.value} is not implemented yet (wal2json is)")
        if self.core is CoreChoice.NATIVE:
            refusal = self.native_refusal()
            if refusal is not None:
                raise NativeUnavailableError(refusal)
        if self.plugin.capabilities.needs_publication:
            self.publications()  # checks the name
            if self.pgoutput_proto_version not in (1, 2, 3):
                raise ConfigError(f"pgoutput protocol version must be 1, 2 or 3, not {self.pgoutput_proto_version}")
        elif self.publication is not None or self.publication_autocreate is not None:
            raise ConfigError(
                f"--publication and --publication-autocreate are for --plugin pgoutput ({self.plugin.value} "
                "streams every table)"
            )
        if self.partitions < 1 or self.batch_bytes < 1 or self.batch_events < 1 or self.linger_ms < 0:
            raise ConfigError("partitions, batch_bytes and batch_events must be ≥ 1, linger_ms ≥ 0")
        if self.outbox_table is not None:
            validate_topic_name(f"{self.outbox_topic_prefix}.x")
            if self.outbox_table.count(".") != 1:
                raise ConfigError(f"outbox table {self.outbox_table!r}: write it as schema.table (e.g. public.events)")
        if self.max_linger_ms < self.linger_ms:
            raise ConfigError(f"max_linger_ms ({self.max_linger_ms}) must be ≥ linger_ms ({self.linger_ms})")
        if self.max_retry_time_s < 0:
            raise ConfigError(f"--max-retry-time must be ≥ 0 seconds (0: retry forever), not {self.max_retry_time_s}")
        if self.key_state_cache_bytes < 1 << 20:
            raise ConfigError(f"key state cache must be at least 1 MiB, not {self.key_state_cache_bytes} bytes")
        if self.signal_table is not None:
            split_table_name(self.signal_table)
        if self.compression is not None:
            Codec.parse(self.compression)  # what both sinks store (the embedded log's codecs, Kafka's names)
        if not 1 <= self.snapshot_workers <= MAX_SNAPSHOT_WORKERS:
            raise ConfigError(f"--snapshot-workers must be 1 to {MAX_SNAPSHOT_WORKERS}, not {self.snapshot_workers}")
        if self.snapshot_workers > 1 and self.value_format is not ValueFormat.JSON:
            raise ConfigError("--snapshot-workers > 1 needs --value-format json (Avro schemas are registered by "
                              "the connector itself): use --snapshot-workers 1 with avro")  # fmt: skip
        if self.incremental_chunk_size < 1:
            raise ConfigError(f"--incremental-chunk-size must be ≥ 1, not {self.incremental_chunk_size}")
        for table, topic in self.table_topics.items():
            if table.count(".") < 1:
                raise ConfigError(f"topic override for {table!r}: write the table as schema.table")
            validate_topic_name(topic)

    def native_refusal(self) -> str | None:
        """Why ``--core native`` cannot run with this configuration in this process, as its one-line error (None:
        it can): the extension not built (capture.native.extension), or a plugin or value format the native core
        does not handle (their capabilities)."""
        if not extension.available():
            reason = extension.unavailable_reason()
            return (
                "--core native: the extension tideline_native is not built; run `make native` (cargo and maturin) "
                f"or use --core auto or python (or unset {ENV}) [{reason}]"
            )
        unsupported = self.native_unsupported()
        if unsupported is not None:
            return f"--core native: {unsupported}; use --core auto or python (or unset {ENV})"
        return None

    def native_unsupported(self) -> str | None:
        """Why the native core does not apply to this plugin and value format, whatever is built (None: it does)."""
        if not self.plugin.capabilities.native_core:
            return f"the native core does not decode plugin {self.plugin.value}"
        if not self.value_format.capabilities.native_changes:
            return f"the native core does not write --value-format {self.value_format.value}"
        return None

    def publications(self) -> Publications:
        """The publications the slot streams (pgoutput; see capture.publications)."""
        return Publications(self.dsn, self.publication or self.slot,
                            self.publication_autocreate or PublicationMode.FILTERED,
                            via_root=self.publish_via_partition_root)  # fmt: skip

    def decoder_settings(self, default_spill_dir: Path) -> DecoderSettings:
        """What the plugin's decoder needs from this configuration."""
        needs = self.plugin.capabilities.needs_publication
        return DecoderSettings(
            dsn=self.dsn,
            publications=self.publications().names if needs else (),
            proto_version=self.pgoutput_proto_version,
            streaming=self.pgoutput_streaming,
            spill_dir=self.spill_dir or default_spill_dir,
        )

    @property
    def connector_id(self) -> str:
        """The connector's identity: its transactional id, position key and key state name derive from it."""
        return f"{self.topic_prefix}.{self.slot}"
