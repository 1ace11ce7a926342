"""``tideline log``: create, inspect, write, read and clean the topics of a log directory; show consumer groups.

The commands take the log from the backend chosen once (:mod:`tideline.backend`: the embedded log at
``--data-dir``, or an Apache Kafka cluster with ``--kafka`` / ``TIDELINE_KAFKA_BOOTSTRAP``, or the project file),
with the same output on both; ``compact`` and ``cleaner`` run where the backend has a log to clean.

The functions behind the commands (:func:`list_topics`, :func:`describe_topics`,
:func:`produce_lines`, :func:`compact_topic`, :func:`json_lines`, :func:`text_lines`,
:func:`describe_groups`) are public so that the demo, the operations console and tests
drive the same code path as the command line, without a subprocess.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import functools
import math
import operator
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO, Protocol

import orjson
import typer

from tideline.cli_common import Lazy, LazyGroup, fail, one_line_errors

# The log's modules (pyarrow, numpy), Kafka's client and rich are imported by the commands that use them,
# not at start-up: every `tideline` command imports this module (tests/tideline/test_cli_startup.py).
if TYPE_CHECKING:
    from rich.console import Console
    from typer import _click as click  # typer's own copy of click
    from typer.core import MarkupMode

    from eventstore.cleaner import CleanStats
    from eventstore.consumer import Consumer, Headers, PolledBatch
    from eventstore.isolation import IsolationLevel
    from eventstore.log import Log
    from eventstore.log_cleaner import CleanedPartition, LogCleaner
    from eventstore.offsets import TopicPartition
    from eventstore.schema_store import FramedDecoder
    from schemas.registry import SchemaRegistry
    from tideline.backend import Backend


class LogGroup(LazyGroup):
    """The ``log`` group, whose ``mirror`` command (:mod:`tideline.log_mirror`: Kafka's client, Avro) is built from
    its module only when it is used; ``tideline log --help`` lists it by :data:`MIRROR_HELP`."""

    def lazy_commands(self) -> dict[str, Lazy]:
        return {"mirror": Lazy(functools.partial(_mirror_command, self.rich_markup_mode), MIRROR_HELP)}


def _mirror_command(rich_markup_mode: MarkupMode) -> click.Command:
    """The ``mirror`` command as ``app.command("mirror")(mirror)`` would have made it."""
    from typer.main import get_command_from_info

    from tideline.log_mirror import mirror  # a module of its own: this one is long enough

    registered = typer.Typer()
    registered.command("mirror")(mirror)
    info = registered.registered_commands[0]
    return get_command_from_info(info, pretty_exceptions_short=True, rich_markup_mode=rich_markup_mode)  # the root's


# The first paragraph of tideline.log_mirror.mirror's docstring: what `tideline log --help` shows of it (a test
# checks they are the same).
MIRROR_HELP = (
    "Copy topics to Kafka record for record (keys, values, headers, timestamps, tombstones, same\n"
    "partitions), exactly once and resumable, so a deployment moves to Kafka without a new snapshot."
)

app = typer.Typer(
    cls=LogGroup,
    help="Inspect and operate the log: topics, partitions, records, compaction, the log cleaner service.",
    no_args_is_help=True,
)

TOMBSTONE = b"\\N"  # as in Postgres COPY text format: the NULL marker
PRODUCE_CHUNK_BYTES = 4 << 20  # stdin bytes gathered into one send_batch call, at most
PRODUCE_LINGER_S = 0.01  # a pause in the input this long sends what was read
PRODUCE_MAX_WAIT_S = 0.2  # ... and so does reading for this long
POLL_TIMEOUT_MS = 500  # --follow: how long one poll waits at the head of the log
GROUP_POLL_TIMEOUT_MS = 100  # --group without --follow: one poll's wait while partitions change hands

BINARY_MARKER_HELP = (
    'Keys, values and header values are JSON strings when they are valid UTF-8, otherwise {"base64": "…"} '
    "objects; null means no key, or a tombstone for the value."
)

TopicArg = Annotated[str, typer.Argument(help="Topic name.", show_default=False)]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


def _data_dir() -> Path:
    from tideline.cli import State  # imported late: tideline.cli imports this module

    return State.data_dir


def _backend() -> Backend:
    """The backend chosen once (checked reachable, in one line)."""
    from tideline.cli import State

    backend = State.backend()
    with one_line_errors():
        backend.check()
    return backend


def _log_to_clean() -> Log:
    """The log that ``compact`` / ``cleaner`` clean; one line where the backend cleans its own."""
    backend = _backend()
    if not backend.log_cleaner_applies:
        raise fail(f"the log cleaner of {backend.description} compacts (cleanup.policy=compact): there is nothing "
                   "to run here")  # fmt: skip
    return _open_log()


def _open_log(*, create: bool = False) -> Log:
    """The log at ``--data-dir``; only ``create`` may make a new log directory."""
    from eventstore.log import Log

    return Log(_data_dir(), create=create)


# ---------------------------------------------------------------------------- create


def parse_config_options(options: list[str], *, compact: bool = False) -> dict[str, str]:
    """``KEY=VALUE`` strings (``--config``) → overrides, checked against :class:`TopicConfig`.

    ``compact`` adds ``cleanup_policy=compact`` unless the options choose a policy that
    compacts (a policy that does not is a contradiction and raises).
    """
    from eventstore.errors import ConfigError
    from eventstore.topic import CleanupPolicy, TopicConfig

    overrides: dict[str, str] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--config expects KEY=VALUE, got {option!r}")
        overrides[key.strip()] = value.strip()
    policy_keys = [k for k in overrides if k.replace("-", "_").replace(".", "_") == "cleanup_policy"]
    if compact:
        if not policy_keys:
            overrides["cleanup_policy"] = CleanupPolicy.COMPACT.value
        elif not CleanupPolicy.parse(overrides[policy_keys[-1]]).compacts:
            raise ConfigError(f"--compact contradicts --config {policy_keys[-1]}={overrides[policy_keys[-1]]}")
    TopicConfig().with_overrides(overrides)  # raises ConfigError naming a bad key or value
    return overrides


@app.command()
def create(
    topic: TopicArg,
    partitions: Annotated[int, typer.Option("--partitions", "-p", help="Number of partitions (≥ 1).")] = 1,
    compact: Annotated[bool, typer.Option("--compact", help="Compacted topic (cleanup_policy=compact).")] = False,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            "-c",
            metavar="KEY=VALUE",
            help="A topic setting, repeatable: cleanup_policy, retention_ms, retention_bytes, segment_bytes, "
            "segment_ms, delete_retention_ms, min_compaction_lag_ms, min_cleanable_dirty_ratio, "
            "compression (none, gzip, lz4, zstd), index_interval_bytes, max_batch_bytes. "
            "Kafka's dotted names (segment.bytes) work too.",
            show_default=False,
        ),
    ] = None,
    replication_factor: Annotated[
        int | None,
        typer.Option("--replication-factor", help="Kafka only: replicas per partition (default: the broker's)."),
    ] = None,
    min_insync_replicas: Annotated[
        int | None,
        typer.Option("--min-insync-replicas", help="Kafka only: min.insync.replicas (default: the broker's)."),
    ] = None,
) -> None:
    """Create a topic (creates the log directory if needed)."""
    from eventstore.errors import ConfigError
    from eventstore.log import MAX_PARTITIONS
    from eventstore.topic import validate_topic_name

    with one_line_errors():
        validate_topic_name(topic)
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ConfigError(f"--partitions must be within 1 … {MAX_PARTITIONS}, got {partitions}")
        overrides = parse_config_options(config or [], compact=compact)
        created = _backend().create_topic(topic, partitions, overrides, replication_factor=replication_factor,
                                          min_insync_replicas=min_insync_replicas)  # fmt: skip
    typer.echo(created)


# ---------------------------------------------------------------------------- topics / describe


@app.command()
def topics(json_output: JsonOption = False) -> None:
    """List the topics of the log (with --json: name, partitions, cleanup policy)."""
    backend = _backend()
    with one_line_errors():
        listed = backend.list_topics()
    if json_output:
        typer.echo(orjson.dumps(listed).decode())
        return
    for row in listed:
        typer.echo(row["topic"])


def list_topics(log: Log) -> list[dict[str, Any]]:
    """The log's topics (``log topics --json``): name, partitions, cleanup policy."""
    out = []
    for name in log.topics():
        meta = log.topic(name)
        out.append({"topic": name, "partitions": meta.partitions, "cleanup_policy": meta.config.cleanup_policy.value})
    return out


def describe_topics(log: Log) -> list[dict[str, Any]]:
    """``log describe --json`` of every topic of the log (partitions with offsets, sizes, segments)."""
    return [log.describe_json(name) for name in log.topics()]


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# The columns of `log describe`'s partition table, in order: each shown when the backend's description has it
# (the embedded log knows sizes and segments, Kafka leaders, replicas and the last stable offset).
_PARTITION_COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("partition", "partition", str),
    ("leader", "leader", str),
    ("replicas", "replicas", lambda ids: ",".join(map(str, ids))),
    ("in sync", "in_sync_replicas", lambda ids: ",".join(map(str, ids))),
    ("start offset", "log_start_offset", str),
    ("end offset", "log_end_offset", str),
    ("last stable", "last_stable_offset", str),
    ("size", "size_bytes", _human_bytes),
    ("segments", "segments", str),
)
# summed over partitions in an "all" row:
_TOTALLED: dict[str, Callable[[int], str]] = {"size_bytes": _human_bytes, "segments": str}


def _describe_title(info: dict[str, Any]) -> str:
    facts = [f"{info['partitions']} partitions"]
    if "replication_factor" in info:
        facts.append(f"replication factor {info['replication_factor']}")
    if "min_insync_replicas" in info:
        facts.append(f"min.insync.replicas {info['min_insync_replicas']}")
    if "config_version" in info:
        facts.append(f"config v{info['config_version']}")
    return f"topic {info['topic']}  ({', '.join(facts)})"


@app.command()
def describe(topic: TopicArg, json_output: JsonOption = False) -> None:
    """Partitions (start/end offsets, and sizes and segments, or leaders and replicas) and configuration of a topic."""
    backend = _backend()
    with one_line_errors():
        info = backend.describe_topic(topic)
    if json_output:
        typer.echo(orjson.dumps(info).decode())
        return
    from rich.console import Console
    from rich.table import Table

    rows = info["partition_info"]
    columns = [(header, key, show) for header, key, show in _PARTITION_COLUMNS if rows and key in rows[0]]
    parts = Table(title=_describe_title(info))
    for header, _, _ in columns:
        parts.add_column(header, justify="right")
    for p in rows:
        parts.add_row(*(show(p[key]) for _, key, show in columns))
    if any(key in _TOTALLED for _, key, _ in columns):
        parts.add_section()
        parts.add_row(*(
            "all" if key == "partition" else _TOTALLED[key](sum(p[key] for p in rows)) if key in _TOTALLED else ""
            for _, key, _ in columns
        ))  # fmt: skip
    console = Console(highlight=False)
    console.print(parts)
    defaults = backend.topic_config_defaults()
    settings = Table(title="config")
    settings.add_column("setting")
    settings.add_column("value", justify="right")
    if defaults is not None:
        settings.add_column("default", justify="right")
    for key, value in info["config"].items():
        shown = [key, str(value)]
        if defaults is not None:
            shown.append("" if defaults.get(key) == value else str(defaults.get(key)))
        settings.add_row(*shown)
    console.print(settings)


# ---------------------------------------------------------------------------- produce


@dataclass(slots=True)
class ProduceSummary:
    """What :func:`produce_lines` wrote."""

    topic: str
    records: int = 0
    keyless: int = 0
    tombstones: int = 0
    per_partition: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        rate = self.records / self.seconds if self.seconds > 0 else 0.0
        parts = " ".join(f"{p}:{n}" for p, n in sorted(self.per_partition.items())) or "none"
        return (
            f"produced {self.records} records to {self.topic} ({self.keyless} keyless, {self.tombstones} tombstones) "
            f"in {self.seconds:.2f} s ({rate:,.0f}/s); records per partition: {parts}"
        )


def parse_line(line: bytes) -> tuple[bytes | None, bytes | None]:
    """``KEY<TAB>VALUE`` → (key, value). No tab: a keyless value. ``\\N`` as value: tombstone;
    ``\\N`` as key: no key. Only the first tab separates (values may contain tabs)."""
    key, tab, value = line.partition(b"\t")
    if not tab:
        return None, None if line == TOMBSTONE else line
    return (None if key == TOMBSTONE else key), (None if value == TOMBSTONE else value)


def _more_ready(stream: BinaryIO, timeout: float) -> bool:
    """True if reading ``stream`` would not block, waiting up to ``timeout`` s (in-memory streams never block)."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _read_available(stream: BinaryIO, target: int) -> bytes:
    """Up to ``target`` bytes: what arrives without a pause of ``PRODUCE_LINGER_S`` (b"" at EOF).

    A pipe is read in big chunks (few appends, few fsyncs), while interactive input is
    sent as typed; a slow trickle is sent at least every ``PRODUCE_MAX_WAIT_S``.
    """
    read: Callable[[int], bytes] = getattr(stream, "read1", stream.read)
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + PRODUCE_MAX_WAIT_S
    while size < target:
        data = read(target - size)
        if not data:
            break
        chunks.append(data)
        size += len(data)
        if time.monotonic() >= deadline or not _more_ready(stream, PRODUCE_LINGER_S):
            break
    return b"".join(chunks)


def iter_line_chunks(stream: BinaryIO, target_bytes: int = PRODUCE_CHUNK_BYTES) -> Iterator[list[bytes]]:
    """The lines of ``stream`` (``\\n`` or ``\\r\\n`` ends one, the last may lack it), in chunks of
    about ``target_bytes``; empty lines are kept so that callers can count lines."""
    pending = b""
    while True:
        data = _read_available(stream, target_bytes)
        if not data:
            break
        data = pending + data
        cut = data.rfind(b"\n")
        if cut < 0:
            pending = data
            continue
        pending = data[cut + 1 :]
        yield [ln[:-1] if ln.endswith(b"\r") else ln for ln in data[:cut].split(b"\n")]
    if pending:
        yield [pending[:-1] if pending.endswith(b"\r") else pending]


def produce_lines(
    log: Log,
    topic: str,
    stream: BinaryIO,
    *,
    partition: int | None = None,
    chunk_bytes: int = PRODUCE_CHUNK_BYTES,
) -> ProduceSummary:
    """Append the ``KEY<TAB>VALUE`` lines of ``stream`` to ``topic`` (see :func:`parse_line`).

    Lines are grouped into chunks, each appended with one ``send_batch`` (records in one
    chunk share a timestamp), so order per partition is input order and 100k lines cost a
    handful of appends. Empty lines are skipped. Records of chunks before an error stay
    produced; the chunk holding a bad line is not.
    """
    from eventstore.producer import Producer

    compacted = log.topic(topic).config.cleanup_policy.compacts
    if partition is not None:
        log.partition(topic, partition)  # raises ConfigError naming the valid range
    with Producer(log) as producer:
        return send_lines(producer, topic, stream, compacted=compacted, partition=partition, chunk_bytes=chunk_bytes)


class BatchSender(Protocol):
    """What :func:`send_lines` needs of a producer: the embedded log's and Kafka's both have it."""

    def send_batch(
        self, topic: str, values: list[bytes | None], keys: list[bytes | None] | None = None, *, partition: int | None
    ) -> Mapping[int, tuple[int, int]]: ...


def send_lines(
    producer: BatchSender,
    topic: str,
    stream: BinaryIO,
    *,
    compacted: bool,
    partition: int | None = None,
    chunk_bytes: int = PRODUCE_CHUNK_BYTES,
) -> ProduceSummary:
    """The chunked ``KEY<TAB>VALUE`` produce loop of :func:`produce_lines`, for any producer."""
    from eventstore.errors import InvalidRecordError

    summary = ProduceSummary(topic)
    started = time.monotonic()
    line_number = 0
    for lines in iter_line_chunks(stream, chunk_bytes):
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        for line in lines:
            line_number += 1
            if not line:
                continue
            key, value = parse_line(line)
            if key is None and compacted:
                raise InvalidRecordError(
                    f"line {line_number} has no key but topic {topic!r} is compacted (write KEY<TAB>VALUE); "
                    f"{summary.records} records before it were produced"
                )
            keys.append(key)
            values.append(value)
        if not values:
            continue
        keyless = keys.count(None)
        sent = producer.send_batch(topic, values, None if keyless == len(keys) else keys, partition=partition)
        for p, (_, count) in sent.items():
            summary.per_partition[p] = summary.per_partition.get(p, 0) + count
        summary.records += len(values)
        summary.keyless += keyless
        summary.tombstones += values.count(None)
    summary.seconds = time.monotonic() - started
    return summary


@app.command()
def produce(
    topic: TopicArg,
    partition: Annotated[
        int | None,
        typer.Option("--partition", help="Write every record to this partition (default: by key, murmur2)."),
    ] = None,
) -> None:
    """Append records read from stdin, one per line: KEY<TAB>VALUE.

    A line without a tab is a keyless value; the value \\N is a tombstone (null), as in
    Postgres COPY; a \\N key means no key. Keys and values are the line's bytes (UTF-8).
    Empty lines are skipped; a trailing \\r is dropped. A summary goes to stderr.
    """
    backend = _backend()
    with one_line_errors():
        summary = backend.produce_lines(topic, sys.stdin.buffer, partition=partition)
    typer.echo(summary.line(), err=True)


# ---------------------------------------------------------------------------- tail


@dataclass(frozen=True, slots=True)
class TailRows:
    """The records of one polled batch, column by column (no object per record)."""

    partition: int
    offsets: list[int]
    timestamps: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    headers: list[Headers] | None  # None: the batch has no headers
    # set by FramedDisplay: the schema id each Avro key / value was decoded with (None: shown as stored)
    key_schema_ids: list[int | None] | None = None
    value_schema_ids: list[int | None] | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    @classmethod
    def of(cls, polled: PolledBatch, stop: int | None = None) -> TailRows:
        """The rows of ``polled`` with offsets below ``stop`` (all when None)."""
        from eventstore.consumer import ConsumerRecords

        offsets = ConsumerRecords.offsets_of(polled)
        n = len(offsets) if stop is None else bisect.bisect_left(offsets, stop)
        records = polled.records.slice(0, n)
        headers: list[Headers] | None = None
        if polled.batch.header.has_headers:
            headers = [[(h["key"], h["value"]) for h in hs] if hs else [] for hs in records.column(4).to_pylist()]
        return cls(
            polled.batch.partition,
            offsets[:n],
            polled.timestamps().slice(0, n).to_pylist(),
            records.column(2).to_pylist(),
            records.column(3).to_pylist(),
            headers,
        )


def _json_bytes(data: bytes | None) -> str | dict[str, str] | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def json_lines(rows: TailRows) -> bytes:
    """``tail --json`` output: one JSON object per record and line (see ``BINARY_MARKER_HELP``).

    A key or value shown decoded from Avro adds ``key_schema_id`` / ``value_schema_id``."""
    dumps, newline = orjson.dumps, orjson.OPT_APPEND_NEWLINE
    p, timestamps, keys, values, headers = rows.partition, rows.timestamps, rows.keys, rows.values, rows.headers
    key_ids, value_ids = rows.key_schema_ids, rows.value_schema_ids
    lines = []
    for i, offset in enumerate(rows.offsets):
        record = {
            "partition": p,
            "offset": offset,
            "timestamp": timestamps[i],
            "key": _json_bytes(keys[i]),
            "value": _json_bytes(values[i]),
            "headers": [[k, _json_bytes(v)] for k, v in headers[i]] if headers else [],
        }
        if key_ids is not None and key_ids[i] is not None:
            record["key_schema_id"] = key_ids[i]
        if value_ids is not None and value_ids[i] is not None:
            record["value_schema_id"] = value_ids[i]
        lines.append(dumps(record, option=newline))
    return b"".join(lines)


_first_byte = operator.itemgetter(0)


def _may_be_framed(column: list[bytes | None]) -> bool:
    """Does some key / value start with Confluent framing's magic byte 0? (C-level loop: ~30 ns a record)"""
    return 0 in map(_first_byte, filter(None, column))


class FramedDisplay:
    """Shows Confluent-framed Avro keys and values (first byte 0, a schema id of the backend's
    registry) as their JSON form; everything else is left as stored.

    Values that look framed but cannot be decoded (unknown id, bad payload) are shown as
    stored, with a note on stderr once per schema id. The registry is opened (``open_registry``)
    on the first key or value starting with a 0 byte; other topics pay one byte test per record."""

    def __init__(self, open_registry: Callable[[], SchemaRegistry]) -> None:
        self.open_registry = open_registry
        self._decoder: FramedDecoder | None = None

    def rows(self, rows: TailRows) -> TailRows:
        if not _may_be_framed(rows.values) and not _may_be_framed(rows.keys):
            return rows
        if self._decoder is None:
            from eventstore.schema_store import FramedDecoder  # Avro, numpy: only when needed

            self._decoder = FramedDecoder(self.open_registry(), lambda message: typer.echo(message, err=True))
        self._decoder.forget_missing()
        keys, key_ids = self._decode(rows.keys)
        values, value_ids = self._decode(rows.values)
        return replace(rows, keys=keys, values=values, key_schema_ids=key_ids, value_schema_ids=value_ids)

    def _decode(self, column: list[bytes | None]) -> tuple[list[bytes | None], list[int | None] | None]:
        assert self._decoder is not None
        decoded = [self._decoder.decode(data) for data in column]
        ids = [schema_id for _, schema_id in decoded]
        return [data for data, _ in decoded], (None if ids.count(None) == len(ids) else ids)


_ESCAPE = re.compile(rb"[\\\t\n\r]")
_ESCAPED = {b"\\": b"\\\\", b"\t": b"\\t", b"\n": b"\\n", b"\r": b"\\r"}


def _text_field(data: bytes | None) -> bytes:
    """COPY-style text: ``\\N`` for null, backslash escapes, invalid UTF-8 as ``\\xNN``."""
    if data is None:
        return TOMBSTONE
    if _ESCAPE.search(data) is not None:
        data = _ESCAPE.sub(lambda m: _ESCAPED[m.group()], data)
    if data.isascii():
        return data
    try:
        data.decode("utf-8")
        return data
    except UnicodeDecodeError:
        return data.decode("utf-8", "backslashreplace").encode("utf-8")


@functools.lru_cache(maxsize=4096)
def _iso_time(timestamp_ms: int) -> bytes:
    when = datetime.fromtimestamp(timestamp_ms / 1000, UTC).isoformat(timespec="milliseconds")
    return when.replace("+00:00", "Z").encode()


def text_lines(rows: TailRows) -> bytes:
    """Plain ``tail`` output: ``PARTITION:OFFSET<TAB>TIME<TAB>KEY<TAB>VALUE[<TAB>HEADERS]`` per record."""
    p, timestamps, keys, values, headers = rows.partition, rows.timestamps, rows.keys, rows.values, rows.headers
    lines = []
    for i, offset in enumerate(rows.offsets):
        line = b"%d:%d\t%s\t%s\t%s\n" % (
            p,
            offset,
            _iso_time(timestamps[i]),
            _text_field(keys[i]),
            _text_field(values[i]),
        )
        if headers and headers[i]:
            shown = b",".join(_text_field(k.encode()) + b"=" + _text_field(v) for k, v in headers[i])
            line = line[:-1] + b"\t" + shown + b"\n"
        lines.append(line)
    return b"".join(lines)


def _stdout_binary() -> BinaryIO:
    sys.stdout.flush()  # anything echoed as text goes first
    return sys.stdout.buffer


@dataclass(frozen=True, slots=True)
class _TailPlan:
    partitions: list[TopicPartition]
    stop_at: dict[TopicPartition, int] | None  # None: --follow


def _tail_start(consumer: Consumer, plan: _TailPlan, *, from_beginning: bool, offset: int | None, follow: bool) -> None:
    if offset is not None:
        for tp in plan.partitions:
            consumer.seek(tp, offset)
    elif from_beginning or not follow:
        consumer.seek_to_beginning()
    else:
        consumer.seek_to_end()


def _tail_rows(consumer: Consumer, plan: _TailPlan) -> Iterator[TailRows]:
    """Polled records, cut at ``plan.stop_at`` (then ends) or forever (--follow)."""
    from eventstore.offsets import TopicPartition

    stop_at = plan.stop_at
    while True:
        if stop_at is not None:
            active = [tp for tp in consumer.assignment() if consumer.position(tp) < stop_at[tp]]
            if not active:
                return
            if active != consumer.assignment():
                consumer.assign(active)  # positions are kept
        records = consumer.poll(0 if stop_at is not None else POLL_TIMEOUT_MS)
        if not records:
            if stop_at is not None:
                return  # nothing more is readable below the end offsets (a compaction gap at the end)
            continue
        for polled in records.batches:
            stop = None if stop_at is None else stop_at[TopicPartition(polled.topic, polled.batch.partition)]
            yield TailRows.of(polled, stop)


def _group_tail_polls(consumer: Consumer, stop_at: dict[TopicPartition, int] | None) -> Iterator[list[TailRows]]:
    """The rows of each poll of a group member, cut at ``stop_at`` (then ends once the member's
    partitions are all read that far and none is still changing hands) or forever (--follow).

    After each poll's rows are printed (when the caller asks for the next ones), the
    member's progress is committed."""
    from eventstore.offsets import TopicPartition

    progress = _GroupProgress(consumer, stop_at)
    while True:
        records = consumer.poll(POLL_TIMEOUT_MS if stop_at is None else GROUP_POLL_TIMEOUT_MS)
        rows = []
        for polled in records.batches:
            tp = TopicPartition(polled.topic, polled.batch.partition)
            cut = TailRows.of(polled, None if stop_at is None else stop_at[tp])
            if len(cut):
                rows.append(cut)
        if rows:
            yield rows
        progress.commit()
        if (
            not rows
            and stop_at is not None
            and not consumer.rebalancing
            and all(consumer.position(tp) >= stop_at[tp] for tp in consumer.assignment())
        ):
            return


class _GroupProgress:
    """Commits what a group member of ``tail`` printed: per partition its position, cut at
    ``stop_at`` (a poll may read past it, and those records are not printed); only changes."""

    def __init__(self, consumer: Consumer, stop_at: dict[TopicPartition, int] | None) -> None:
        self.consumer = consumer
        self.stop_at = stop_at
        self.committed: dict[TopicPartition, int] = {}

    def commit(self) -> None:
        stop_at = self.stop_at
        done = {}
        for tp in self.consumer.assignment():
            position = self.consumer.position(tp)
            done[tp] = position if stop_at is None else min(position, stop_at[tp])
        changed = {tp: offset for tp, offset in done.items() if self.committed.get(tp) != offset}
        if changed:
            self.consumer.commit(changed)
            self.committed.update(changed)


@app.command()
def tail(
    topic: TopicArg,
    from_beginning: Annotated[
        bool, typer.Option("--from-beginning", help="Start at the log start offset of each partition.")
    ] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep waiting for new records until Ctrl-C.")] = False,
    partition: Annotated[int | None, typer.Option("--partition", help="Read only this partition.")] = None,
    offset: Annotated[
        int | None,
        typer.Option("--offset", help="Start at this offset (in each partition read; a removed offset → log start)."),
    ] = None,
    group: Annotated[
        str | None,
        typer.Option(
            "--group",
            "-g",
            help="Consume as a member of this consumer group: share the partitions with its other members, "
            "start at the group's committed offsets, commit after printing each poll's records.",
            show_default=False,
        ),
    ] = None,
    isolation: Annotated[
        str,
        typer.Option(
            "--isolation",
            metavar="read_committed|read_uncommitted",
            help="read_committed: only committed transactions, up to the last stable offset; "
            "read_uncommitted: everything up to the log end. Transaction markers are never shown.",
        ),
    ] = "read_committed",  # IsolationLevel.READ_COMMITTED.value (eventstore.isolation: not imported at start-up)
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON object per record: partition, offset, timestamp (ms), key, value, headers. "
            + BINARY_MARKER_HELP,
        ),
    ] = False,
) -> None:
    """Print the records of a topic, in offset order per partition.

    Where it starts: --offset, or --from-beginning, or else the end of each partition
    with --follow (new records only, like kafka-console-consumer) and the beginning
    without it. Without --follow it stops at the end offsets seen when it started.

    With --group: the group's committed offset of each partition it is given, and where
    there is none, the place above. It reads only the partitions the group assigns it.

    Plain lines are PARTITION:OFFSET<TAB>TIME<TAB>KEY<TAB>VALUE (COPY text style:
    \\N is null, tabs/newlines/backslashes are escaped, invalid UTF-8 shows as \\xNN).
    """
    from eventstore.errors import ConfigError
    from eventstore.group import validate_group_id
    from eventstore.isolation import IsolationLevel

    with one_line_errors():
        if offset is not None and from_beginning:
            raise ConfigError("--offset and --from-beginning are mutually exclusive")
        if offset is not None and offset < 0:
            raise ConfigError(f"--offset must be ≥ 0, got {offset}")
        level = IsolationLevel.parse(isolation)
        if group is not None:
            validate_group_id(group)
            for name, value in (("--partition", partition), ("--offset", offset)):
                if value is not None:
                    raise ConfigError(f"{name} cannot be used with --group (the group assigns partitions and offsets)")
        options = TailOptions(from_beginning, follow, partition, offset, json_output, group, level)
        count = _run_tail(topic, options)
    if follow:
        typer.echo(f"processed {count} records", err=True)


@dataclass(frozen=True, slots=True)
class TailOptions:
    from_beginning: bool
    follow: bool
    partition: int | None
    offset: int | None
    json_output: bool
    group: str | None
    isolation: IsolationLevel


def tail_consumer(log: Log, options: TailOptions) -> Consumer:
    from eventstore.consumer import Consumer

    starts_at_end = options.follow and not options.from_beginning
    return Consumer(
        log,
        group_id=options.group,
        isolation_level=options.isolation,
        enable_auto_commit=False,  # tail commits exactly what it printed
        auto_offset_reset="latest" if options.group is not None and starts_at_end else "earliest",
    )


def tail_polls(log: Log, consumer: Consumer, topic: str, options: TailOptions) -> Iterator[list[TailRows]]:
    from eventstore.offsets import TopicPartition

    meta = log.topic(topic)
    tps = [TopicPartition(topic, p) for p in range(meta.partitions)]
    if options.group is not None:
        stop_at = None if options.follow else consumer.end_offsets(tps)
        consumer.subscribe([topic])
        return _group_tail_polls(consumer, stop_at)
    if options.partition is not None:
        tps = [TopicPartition(topic, options.partition)]
    consumer.assign(tps)  # raises ConfigError for a partition out of range
    plan = _TailPlan(tps, None if options.follow else consumer.end_offsets(tps))
    _tail_start(consumer, plan, from_beginning=options.from_beginning, offset=options.offset, follow=options.follow)
    return ([rows] for rows in _tail_rows(consumer, plan))


def _run_tail(topic: str, options: TailOptions) -> int:
    backend = _backend()
    out = _stdout_binary()
    count = 0
    with contextlib.ExitStack() as registry, backend.tail(topic, options) as polls:
        display = FramedDisplay(lambda: registry.enter_context(backend.registry()))
        try:
            for printed in polls:
                for rows in map(display.rows, printed):
                    out.write(json_lines(rows) if options.json_output else text_lines(rows))
                    count += len(rows)
                out.flush()
        except KeyboardInterrupt:  # the way to stop --follow
            pass
        except BrokenPipeError:  # `tideline log tail … | head`: the reader left, which is fine
            with suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
    return count


# ---------------------------------------------------------------------------- groups


def _offsets_row(
    log: Log, tp: TopicPartition, committed: int | None, owner: str | None, pending: bool
) -> dict[str, Any]:
    from eventstore.errors import TidelineError

    try:
        plog = log.partition(tp.topic, tp.partition)
        log_end: int | None = plog.log_end_offset()
        stable: int | None = plog.last_stable_offset()
    except TidelineError:  # the topic is gone or shrank: the commit outlived it
        log_end = stable = None
    lag = None if committed is None or log_end is None else max(0, log_end - committed)
    return {
        "topic": tp.topic,
        "partition": tp.partition,
        "committed_offset": committed,
        "log_end_offset": log_end,
        "last_stable_offset": stable,
        "lag": lag,
        "member_id": owner,
        "pending_transaction": pending,
    }


def describe_groups(log: Log) -> list[dict[str, Any]]:
    """Every consumer group: its live members and, per partition it committed or owns, the
    committed offset, log end, last stable offset and lag (log end − committed, as Kafka's
    kafka-consumer-groups shows it), and whether an open transaction holds a new commit of
    it (``pending_transaction``). Removes the member files of dead members on the way."""
    from eventstore.group import live_members
    from eventstore.offsets import OffsetStore

    store = OffsetStore(log)
    out = []
    for group in store.groups():
        members = live_members(log.path, group)
        offsets = store.group_offsets(group)
        owners = {tp: m.member_id for m in members for tp in m.assignment}
        pending = store.pending(group)
        rows = [
            _offsets_row(log, tp, offsets[tp].offset if tp in offsets else None, owners.get(tp), tp in pending)
            for tp in sorted(set(offsets) | set(owners) | pending)
        ]
        out.append(
            {
                "group": group,
                "members": [
                    {
                        "member_id": m.member_id,
                        "client_id": m.client_id,
                        "pid": m.pid,
                        "host": m.host,
                        "topics": list(m.topics),
                        "assignment": [{"topic": tp.topic, "partition": tp.partition} for tp in m.assignment],
                        "joined_ms": m.joined_ms,
                        "heartbeat_ms": m.heartbeat_ms,
                    }
                    for m in members
                ],
                "partitions": rows,
            }
        )
    return out


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _print_group(console: Console, info: dict[str, Any]) -> None:
    from rich.table import Table

    members = info["members"]
    title = f"group {info['group']}  ({len(members)} member{'' if len(members) == 1 else 's'})"
    offsets = Table(title=title)
    offsets.add_column("topic")
    for column in ("partition", "committed", "log end", "last stable", "lag"):
        offsets.add_column(column, justify="right")
    offsets.add_column("member")
    for r in info["partitions"]:
        offsets.add_row(
            r["topic"],
            str(r["partition"]),
            _dash(r["committed_offset"]) + (" (txn open)" if r["pending_transaction"] else ""),
            _dash(r["log_end_offset"]),
            _dash(r["last_stable_offset"]),
            _dash(r["lag"]),
            _dash(r["member_id"]),
        )
    console.print(offsets)
    if not members:
        return
    table = Table(title=f"members of {info['group']}")
    for column in ("member", "client", "pid", "host", "partitions"):
        table.add_column(column, justify="right" if column == "pid" else "left")
    for m in members:
        owned = ", ".join(f"{a['topic']}-{a['partition']}" for a in m["assignment"]) or "-"
        table.add_row(m["member_id"], m["client_id"], _dash(m["pid"]), m["host"], owned)
    console.print(table)


@app.command()
def groups(json_output: JsonOption = False) -> None:
    """Consumer groups: live members, and per partition the committed offset, log end, last stable offset and lag.

    Lag is log end − committed offset (as kafka-consumer-groups shows it); a
    read_committed member can read up to the last stable offset.
    """
    backend = _backend()
    with one_line_errors():
        infos = backend.describe_groups()
    if json_output:
        typer.echo(orjson.dumps(infos).decode())
        return
    if not infos:
        typer.echo("no consumer groups")
        return
    from rich.console import Console

    console = Console(highlight=False)
    for info in infos:
        _print_group(console, info)


# ---------------------------------------------------------------------------- compact


@dataclass(frozen=True, slots=True)
class PartitionCleaning:
    """One partition's compaction stats and how many segments retention deleted."""

    partition: int
    compaction: CleanStats
    segments_deleted: int


def compact_topic(log: Log, topic: str) -> list[PartitionCleaning]:
    """One compaction pass then one retention pass over every partition of ``topic``.

    Only closed segments are cleaned: the active (last) segment of a partition never is.
    """
    from eventstore.cleaner import apply_retention, compact_partition

    meta = log.topic(topic)
    out = []
    for n in range(meta.partitions):
        plog = log.partition(topic, n)
        stats = compact_partition(plog)
        deleted = apply_retention(plog)
        out.append(PartitionCleaning(n, stats, deleted))
    return out


def _cleaning_json(c: PartitionCleaning) -> dict[str, int]:
    s = c.compaction
    return {
        "partition": c.partition,
        "segments_cleaned": s.segments_cleaned,
        "records_read": s.records_read,
        "records_kept": s.records_kept,
        "tombstones_dropped": s.tombstones_dropped,
        "bytes_read": s.bytes_read,
        "bytes_written": s.bytes_written,
        "segments_deleted": c.segments_deleted,
    }


@app.command()
def compact(topic: TopicArg, json_output: JsonOption = False) -> None:
    """Run one compaction pass and one retention pass on every partition now, and print stats.

    Compaction applies to compacted topics, retention to delete-policy topics; the active
    (last) segment of a partition is never cleaned.
    """
    from rich.console import Console
    from rich.table import Table

    with one_line_errors(), _log_to_clean() as log:
        policy = log.topic(topic).config.cleanup_policy
        results = compact_topic(log, topic)
    rows = [_cleaning_json(c) for c in results]
    if json_output:
        typer.echo(orjson.dumps({"topic": topic, "cleanup_policy": policy.value, "partitions": rows}).decode())
        return
    table = Table(title=f"cleaning {topic} (cleanup_policy={policy.value})")
    for column in ("partition", "segments cleaned", "records read → kept", "bytes read → written"):
        table.add_column(column, justify="right")
    table.add_column("tombstones dropped", justify="right")
    table.add_column("segments deleted", justify="right")
    for r in rows:
        table.add_row(
            str(r["partition"]),
            str(r["segments_cleaned"]),
            f"{r['records_read']} → {r['records_kept']}",
            f"{_human_bytes(r['bytes_read'])} → {_human_bytes(r['bytes_written'])}",
            str(r["tombstones_dropped"]),
            str(r["segments_deleted"]),
        )
    Console(highlight=False).print(table)


# ---------------------------------------------------------------------------- cleaner


def _cleaned_json(done: CleanedPartition) -> dict[str, Any]:
    before, s = done.before, done.stats
    return {
        "partition": before.name,
        "dirty_ratio": round(before.dirty_ratio, 4),
        "first_dirty_offset": before.first_dirty_offset,
        "first_uncleanable_offset": before.first_uncleanable_offset,
        "segments_cleaned": s.segments_cleaned,
        "records_read": s.records_read,
        "records_kept": s.records_kept,
        "tombstones_dropped": s.tombstones_dropped,
        "bytes_read": s.bytes_read,
        "bytes_written": s.bytes_written,
        "seconds": round(done.seconds, 3),
    }


def _print_cleaned(done: CleanedPartition, *, json_output: bool) -> None:
    row = _cleaned_json(done)
    if json_output:
        typer.echo(orjson.dumps(row).decode())
        return
    typer.echo(
        f"cleaned {row['partition']} (dirty ratio {row['dirty_ratio']:.2f}): {row['segments_cleaned']} segments, "
        f"{row['records_read']} → {row['records_kept']} records, "
        f"{_human_bytes(row['bytes_read'])} → {_human_bytes(row['bytes_written'])} in {row['seconds']:.2f} s"
    )


@app.command()
def cleaner(
    backoff_ms: Annotated[
        int, typer.Option("--backoff-ms", help="Sleep this long when no partition is due (log.cleaner.backoff.ms).")
    ] = 15_000,
    io_max_bytes_per_second: Annotated[
        float,
        typer.Option(
            "--io-max-bytes-per-second",
            help="Cap on compaction reads + writes, bytes/s (log.cleaner.io.max.bytes.per.second); 0: no cap.",
        ),
    ] = 0,
    retention_check_interval_ms: Annotated[
        int,
        typer.Option(
            "--retention-check-interval-ms",
            help="How often retention and abandoned-transaction recovery run (log.retention.check.interval.ms).",
        ),
    ] = 300_000,
    once: Annotated[
        bool, typer.Option("--once", help="Clean every due partition and apply retention once, then exit.")
    ] = False,
    json_output: JsonOption = False,
) -> None:
    """Run the log cleaner service: compaction by dirty ratio, retention, transaction recovery.

    It compacts the partition with the highest dirty ratio whenever one reaches its topic's
    min_cleanable_dirty_ratio (or holds tombstones whose delete_retention_ms passed),
    honours min_compaction_lag_ms and open transactions, applies retention every
    --retention-check-interval-ms, and never blocks producers or consumers. One line per
    compaction pass; stops on Ctrl-C or SIGTERM (an interrupted pass leaves nothing half-done).
    """
    from eventstore.errors import ConfigError
    from eventstore.log_cleaner import CleanerConfig, LogCleaner

    with one_line_errors():
        if io_max_bytes_per_second < 0:
            raise ConfigError(f"--io-max-bytes-per-second must be ≥ 0, got {io_max_bytes_per_second}")
        config = CleanerConfig(
            backoff_ms=backoff_ms,
            io_max_bytes_per_second=io_max_bytes_per_second or math.inf,
            retention_check_interval_ms=retention_check_interval_ms,
        )
        config.validate()
        with _log_to_clean() as log:
            service = LogCleaner(log, config, on_pass=functools.partial(_print_cleaned, json_output=json_output))
            if once:
                service.check_retention()
                while service.clean_filthiest() is not None:
                    pass
            else:
                _run_until_signalled(service)
            status = service.status()
    summary = (
        f"log cleaner: {status.passes} compaction passes, {_human_bytes(status.bytes_read)} read, "
        f"{_human_bytes(status.bytes_written)} written, {status.segments_deleted} segments deleted by retention"
    )
    if status.uncleanable:
        summary += f"; uncleanable: {', '.join(f'{k} ({v})' for k, v in status.uncleanable.items())}"
    typer.echo(summary, err=True)


def _run_until_signalled(service: LogCleaner) -> None:
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    service.start()
    try:
        while not stop.wait(0.5) and service.running:
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.stop()


# ---------------------------------------------------------------------------- mirror
#
# `tideline log mirror` is tideline.log_mirror.mirror, built when it runs (LogGroup above).
