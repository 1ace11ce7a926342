"""``tideline capture``: run the CDC connector, and report where it stands."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tideline.cli_common import fail, one_line_errors

if TYPE_CHECKING:
    from capture.sinks import Sink
    from eventstore.log import Log

app = typer.Typer(
    help="Capture Postgres changes (logical replication: wal2json or pgoutput) into the log.", no_args_is_help=True
)

DsnOption = Annotated[
    str, typer.Option("--dsn", envvar="TIDELINE_DSN", help="libpq connection string or URL of the source database.")
]
SlotOption = Annotated[str, typer.Option("--slot", help="Replication slot name (created if missing).")]
PrefixOption = Annotated[str, typer.Option("--topic-prefix", help="Topics are <prefix>.<schema>.<table>.")]
PublicationOption = Annotated[
    str | None,
    typer.Option(
        "--publication",
        help="pgoutput: the publication to stream (default: the slot's name); managed ones also have "
        "<name>_keyless for tables without a replica identity.",
    ),
]


DEFAULT_SIGNAL_TABLE = "public.tideline_signal"  # capture.signals.DEFAULT_SIGNAL_TABLE (not imported at start-up)
SignalTableOption = Annotated[
    str,
    typer.Option(
        "--signal-table",
        help="schema.table whose inserted rows are signals to the connector (`capture run --signal-table` creates it).",
    ),
]


def _split(values: list[str] | None) -> list[str]:
    return [p.strip() for v in values or [] for p in v.split(",") if p.strip()]


def _table_topics(values: list[str] | None) -> dict[str, str]:
    """``schema.table=topic`` items (split at the last ``=``: topic names cannot hold one)."""
    out: dict[str, str] = {}
    for v in values or []:
        table, sep, topic = v.rpartition("=")
        if not sep or not table.strip() or not topic.strip() or "." not in table:
            raise fail(f"--table-topic expects schema.table=topic, not {v!r}")
        out[table.strip()] = topic.strip()
    return out


KeylessOption = Annotated[
    str,
    typer.Option(
        "--keyless-tables",
        help="Tables without a primary key or replica identity: keyless (capture inserts with a null key, "
        "Debezium's behaviour), skip, or fail.",
    ),
]

RetainedWalWarnOption = Annotated[
    int | None,
    typer.Option(
        "--retained-wal-warn",
        min=0,
        metavar="BYTES",
        help="Warn when the slot retains more WAL than this (default: the connector's threshold, 1 GiB).",
        show_default=False,
    ),
]


def _key_columns(values: list[str] | None) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for v in values or []:
        table, sep, cols = v.partition(":")
        if not sep or not cols or "." not in table:
            raise fail(f"--key-columns expects schema.table:col1,col2, not {v!r}")
        out[table.strip()] = [c.strip() for c in cols.split(",") if c.strip()]
    return out


@contextmanager
def _log_and_sink(
    state_dir: Path | None,
    *,
    create: bool = True,
    replication_factor: int | None = None,
    min_insync_replicas: int | None = None,
    kafka_producer: str | None = None,
) -> Iterator[tuple[Log | None, Sink | None]]:
    """What the connector writes to: :meth:`tideline.backend.Backend.capture_log` of the backend chosen."""
    from tideline.cli import State

    with State.backend().capture_log(
        state_dir, create=create, replication_factor=replication_factor, min_insync_replicas=min_insync_replicas,
        kafka_producer=kafka_producer,
    ) as opened:
        yield opened


@app.command()
def run(
    dsn: DsnOption,
    slot: SlotOption = "tideline",
    tables: Annotated[list[str] | None, typer.Option("--tables", help="schema.table patterns to capture.")] = None,
    exclude_tables: Annotated[list[str] | None, typer.Option("--exclude-tables", help="Patterns to skip.")] = None,
    exclude_columns: Annotated[
        list[str] | None, typer.Option("--exclude-columns", help="schema.table.column patterns to drop.")
    ] = None,
    mask_columns: Annotated[
        list[str] | None, typer.Option("--mask-columns", help="schema.table.column patterns to hash (sha256).")
    ] = None,
    mask_salt: Annotated[str, typer.Option("--mask-salt", envvar="TIDELINE_MASK_SALT", help="Salt for masking.")] = "",
    key_columns: Annotated[
        list[str] | None,
        typer.Option("--key-columns", help="schema.table:col1,col2 — key for a table without a primary key."),
    ] = None,
    snapshot: Annotated[str, typer.Option("--snapshot", help="initial | always | never | when_needed.")] = "initial",
    offset_mismatch: Annotated[
        str,
        typer.Option(
            "--offset-mismatch",
            help="fail | trust_slot | trust_offset: when the stored position and the slot disagree "
            "(docs/capture.md, 'Position and slot').",
        ),
    ] = "fail",
    keyless_tables: KeylessOption = "keyless",
    table_topic: Annotated[
        list[str] | None,
        typer.Option("--table-topic", help="schema.table=topic: a table gets this topic instead of the default."),
    ] = None,
    max_retry_time: Annotated[
        float,
        typer.Option(
            "--max-retry-time",
            min=0,
            help="Seconds to keep reconnecting after a transient failure before giving up (0: forever).",
        ),
    ] = 600.0,
    retry_on_start: Annotated[
        bool,
        typer.Option("--retry-on-start", help="Retry a first connection that fails instead of reporting it."),
    ] = False,
    slot_busy_wait: Annotated[
        float,
        typer.Option(
            "--slot-busy-wait",
            min=0,
            help="Seconds to wait for a slot another process holds (an instance this one took over, a "
            "walsender not yet gone) before calling it a permanent error.",
        ),
    ] = 60.0,
    state_dir: Annotated[
        Path | None,
        typer.Option("--state-dir", help="Directory of the connector's key state (default: <data dir>/_capture)."),
    ] = None,
    topic_prefix: PrefixOption = "tideline",
    partitions: Annotated[int, typer.Option("--partitions", min=1, help="Partitions of new table topics.")] = 1,
    plugin: Annotated[
        str, typer.Option("--plugin", help="Logical decoding plugin: wal2json (default) or pgoutput.")
    ] = "wal2json",
    publication: PublicationOption = None,
    publication_autocreate: Annotated[
        str | None,
        typer.Option(
            "--publication-autocreate",
            help="pgoutput: filtered (default: the captured tables), all_tables (every table), or disabled "
            "(use an existing publication as it is).",
        ),
    ] = None,
    heartbeat_query: Annotated[
        str | None, typer.Option("--heartbeat-query", help="SQL run every --heartbeat-interval on the source.")
    ] = None,
    heartbeat_interval: Annotated[float, typer.Option("--heartbeat-interval", min=0.1, help="Seconds.")] = 10.0,
    exit_when_caught_up: Annotated[
        bool, typer.Option("--exit-when-caught-up", help="Exit 0 once the WAL present at start is stored.")
    ] = False,
    transaction_metadata: Annotated[
        bool,
        typer.Option(
            "--transaction-metadata",
            help="Also write BEGIN/END records with per-table event counts to <prefix>.transaction.",
        ),
    ] = False,
    schema_changes: Annotated[
        bool,
        typer.Option(
            "--schema-changes",
            help="Also write each DDL on a captured table (CREATE, ALTER, DROP TABLE) as an event on "
            "<prefix>.schema_changes at its WAL position, before the first row of the new shape: the statement, the "
            "table's columns and key after it. Installs an event trigger in the source database (a superuser's "
            "right; `tideline capture schema-changes-sql` prints it for a DBA).",
        ),
    ] = False,
    publish_via_partition_root: Annotated[
        bool,
        typer.Option(
            "--publish-via-partition-root",
            help="Capture a partitioned table as one table: its partitions' rows and changes in its own topic "
            "(PostgreSQL's and Debezium's publish_via_partition_root; default: a topic per partition). Partitions "
            "attached, detached or dropped while capture runs are followed (it installs the event triggers of "
            "--schema-changes).",
        ),
    ] = False,
    core: Annotated[
        str | None,
        typer.Option(
            "--core",
            help="The per-change core: auto (default: the native extension tideline_native when it is built, "
            "either plugin, JSON or Avro values), python (the reference path, several times slower), native (refuse "
            "to start when the extension is not built). A table whose columns the native core does not convert "
            "(arrays, interval, enums, domains, …), the outbox table, and every table under --exclude-columns "
            "or --mask-columns take the Python path. The core in use, per table, and the reason for each "
            "fallback are in the start log lines (a warning unless --core python chose it), `capture status`, the "
            "metrics (tideline_capture_core_info, tideline_capture_table_core_info) and the console. Default "
            "from TIDELINE_CAPTURE_CORE.",
        ),
    ] = None,
    kafka_producer: Annotated[
        str | None,
        typer.Option(
            "--kafka-producer",
            help="Into Kafka (--kafka): auto (default: librdkafka driven by the native extension, a batch's records "
            "handed over as Arrow buffers), python (confluent-kafka, a Python call and callback per record: the "
            "reference), native (refuse to start without the extension). Which one runs, and why python, is in "
            "the start log lines, `capture status`, the metrics (tideline_capture_kafka_producer_info) and the "
            "console. Default from TIDELINE_KAFKA_PRODUCER.",
        ),
    ] = None,
    value_format: Annotated[
        str,
        typer.Option(
            "--value-format",
            help="json (default) or avro: Confluent-framed Avro keys and values of table topics, schemas "
            "registered in the log's __schemas topic.",
        ),
    ] = "json",
    outbox_table: Annotated[
        str | None,
        typer.Option(
            "--outbox-table",
            help="schema.table of an event outbox (the commands' public.events): its inserted rows are routed "
            "to <outbox-topic-prefix>.<stream_type>, key stream_id, header event_type.",
        ),
    ] = None,
    outbox_topic_prefix: Annotated[
        str, typer.Option("--outbox-topic-prefix", help="Topic prefix of routed outbox events.")
    ] = "events",
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", min=0, max=65535, help="Serve Prometheus metrics on this port (/metrics)."),
    ] = None,
    metrics_host: Annotated[str, typer.Option("--metrics-host", help="Address the metrics endpoint binds.")] = (
        "127.0.0.1"
    ),
    replication_factor: Annotated[
        int | None,
        typer.Option("--replication-factor", min=1, help="With --kafka: replication factor of new topics."),
    ] = None,
    min_insync_replicas: Annotated[
        int | None,
        typer.Option("--min-insync-replicas", min=1, help="With --kafka: min.insync.replicas of new topics."),
    ] = None,
    signal_table: Annotated[
        str | None,
        typer.Option(
            "--signal-table",
            help="schema.table whose inserted rows are signals to the connector, created if missing (e.g. "
            f"{DEFAULT_SIGNAL_TABLE}; what `capture snapshot` writes to). Default: no signal table.",
        ),
    ] = None,
    incremental_chunk_size: Annotated[
        int,
        typer.Option(
            "--incremental-chunk-size",
            min=1,
            help="Rows per chunk of incremental snapshots (a signal's chunk-size overrides it).",
        ),
    ] = 1024,
    snapshot_workers: Annotated[
        int,
        typer.Option(
            "--snapshot-workers",
            help="Reader processes of the initial snapshot (Debezium's snapshot.max.threads): 1 reads every table "
            "in one connection; N > 1 reads big tables in ctid ranges over N connections sharing the snapshot "
            "(JSON values only; docs/capture.md).",
        ),
    ] = 1,
    compression: Annotated[
        str | None,
        typer.Option(
            "--compression",
            help="Compression of the record batches written (Kafka's compression.type): none, gzip, lz4 or zstd. "
            "Default lz4: about 6× fewer bytes stored, a big snapshot about twice as fast (docs/capture.md).",
        ),
    ] = None,
    log_cleaner: Annotated[
        bool,
        typer.Option(
            "--log-cleaner",
            help="Also run the log cleaner (compaction by dirty ratio, retention) on the embedded log while "
            "capturing, as `tideline log cleaner` does; Kafka's brokers clean their own.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the final summary as JSON.")] = False,
) -> None:
    """Run the connector until SIGINT/SIGTERM (or caught up): snapshot, then stream, exactly once.

    With ``tideline --kafka HOST:PORT capture run …`` the log is that Kafka cluster (one Kafka
    transaction per batch, the position in ``__tideline_capture_offsets``); the key state stays
    local (``--state-dir``, default ``<data dir>/_capture``)."""
    from capture.config import DEFAULT_COMPRESSION, CoreChoice, OffsetMismatch
    from capture.connector import CaptureConfig, Connector, KeylessPolicy, PublicationMode, SnapshotMode, ValueFormat
    from capture.messages import Plugin
    from capture.tables import TableFilter
    from tideline.cli import State

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    with one_line_errors():
        try:
            plugin_ = Plugin(plugin)
        except ValueError:
            raise fail(f"--plugin must be wal2json or pgoutput, not {plugin!r}") from None
        config = CaptureConfig(
            dsn=dsn,
            slot=slot,
            topic_prefix=topic_prefix,
            plugin=plugin_,
            publication=publication,
            publication_autocreate=None if publication_autocreate is None else PublicationMode.parse(
                publication_autocreate
            ),
            snapshot=SnapshotMode.parse(snapshot),
            offset_mismatch=OffsetMismatch.parse(offset_mismatch),
            keyless_tables=KeylessPolicy.parse(keyless_tables),
            table_topics=_table_topics(table_topic),
            max_retry_time_s=max_retry_time,
            retry_on_start=retry_on_start,
            slot_busy_wait_s=slot_busy_wait,
            state_dir=state_dir,
            table_filter=TableFilter(
                include=_split(tables),
                exclude=_split(exclude_tables),
                exclude_columns=_split(exclude_columns),
                mask_columns=_split(mask_columns),
                mask_salt=mask_salt,
                key_columns=_key_columns(key_columns),
            ),
            partitions=partitions,
            heartbeat_query=heartbeat_query,
            heartbeat_interval_s=heartbeat_interval,
            exit_when_caught_up=exit_when_caught_up,
            transaction_metadata=transaction_metadata,
            schema_changes=schema_changes,
            publish_via_partition_root=publish_via_partition_root,
            value_format=ValueFormat.parse(value_format),
            core=CoreChoice.default() if core is None else CoreChoice.parse(core),
            outbox_table=outbox_table,
            outbox_topic_prefix=outbox_topic_prefix,
            signal_table=signal_table,
            incremental_chunk_size=incremental_chunk_size,
            snapshot_workers=snapshot_workers,
            compression=DEFAULT_COMPRESSION if compression is None else compression,
        )
        config.validate()  # before the log is opened: --core native without the extension is one line, nothing made
        backend = State.backend()
        if (replication_factor is not None or min_insync_replicas is not None) and not backend.topic_settings_apply:
            raise fail("--replication-factor and --min-insync-replicas are Kafka topic settings: give --kafka")
        if log_cleaner and not backend.log_cleaner_applies:
            raise fail("--log-cleaner cleans the embedded log; with --kafka the brokers' log cleaner compacts")
        if kafka_producer is not None and not backend.topic_settings_apply:
            raise fail("--kafka-producer chooses how capture writes to Kafka: give --kafka")
        with _log_and_sink(
            state_dir, replication_factor=replication_factor, min_insync_replicas=min_insync_replicas,
            kafka_producer=kafka_producer,
        ) as (log, sink):
            connector = Connector(config, log, sink=sink)
            if threading.current_thread() is threading.main_thread():

                def _stop(signum: int, frame: FrameType | None) -> None:
                    connector.stop()

                signal.signal(signal.SIGINT, _stop)
                signal.signal(signal.SIGTERM, _stop)
            metrics = None
            if metrics_port is not None:
                from capture.metrics import CaptureCollector
                from eventstore.metrics import serve_metrics

                metrics = serve_metrics(CaptureCollector(connector), metrics_port, metrics_host)
                logging.getLogger("capture.connector").info(
                    "capture: metrics on http://%s:%d/metrics", metrics_host, metrics.port
                )
            cleaner = None
            if log_cleaner and log is not None:
                from eventstore.log_cleaner import LogCleaner

                cleaner = LogCleaner(log)
                cleaner.start()
                logging.getLogger("capture.connector").info("capture: log cleaner running on %s", log.path)
            try:
                stats = connector.run()
            finally:
                if cleaner is not None:
                    cleaner.stop()
                if metrics is not None:
                    metrics.stop()
    summary = stats.to_json()
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(
            f"captured {summary['snapshot_rows']} snapshot rows and {summary['events']} change events "
            f"({summary['transactions']} transactions) in {summary['batches']} log transactions; "
            f"stored up to {summary['last_stored_lsn']}"
        )


@app.command()
def status(
    dsn: DsnOption,
    slot: SlotOption = "tideline",
    topic_prefix: PrefixOption = "tideline",
    tables: Annotated[list[str] | None, typer.Option("--tables", help="schema.table patterns captured.")] = None,
    exclude_tables: Annotated[list[str] | None, typer.Option("--exclude-tables", help="Patterns skipped.")] = None,
    keyless_tables: KeylessOption = "keyless",
    publication: PublicationOption = None,
    retained_wal_warn: RetainedWalWarnOption = None,
    state_dir: Annotated[
        Path | None,
        typer.Option("--state-dir", help="The connector's --state-dir, where it reports its core (default: "
                     "<data dir>/_capture).", show_default=False),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The slot (confirmed LSN, retained WAL), the last stored position, the lag, the publications (pgoutput),
    the core the connector runs (per table, with the reason for each table on the Python path), and tables
    needing attention (the figures of capture.report.capture_status, as the console shows them)."""
    from capture.connector import KeylessPolicy
    from capture.report import capture_status
    from capture.tables import TableFilter

    with one_line_errors():
        policy = KeylessPolicy.parse(keyless_tables)
        table_filter = TableFilter(include=_split(tables), exclude=_split(exclude_tables))
        with _log_and_sink(state_dir, create=False) as (log, sink):
            out = capture_status(dsn, slot=slot, topic_prefix=topic_prefix, log=log, sink=sink,
                                 table_filter=table_filter, keyless=policy, publication=publication,
                                 retained_wal_warn_bytes=retained_wal_warn, state_dir=state_dir)  # fmt: skip
    info, publications, warnings = out["slot"], out["publications"], out["warnings"]
    position = out["stored_position"]
    if as_json:
        typer.echo(json.dumps(out))
        return
    if info is None:
        typer.echo(f"slot {slot}: missing")
    else:
        typer.echo(
            f"slot {slot}: plugin {info['plugin']}, active {info['active']}, confirmed {info['confirmed_flush_lsn']}, "
            f"retained WAL {info['retained_wal_bytes']:,} bytes, wal_status {info['wal_status']}"
        )
    for pub in publications:
        if not pub["exists"]:
            typer.echo(f"publication {pub['name']}: missing")
            continue
        count = len(pub["tables"])
        what = "all tables" if pub["all_tables"] else f"{count} table{'' if count == 1 else 's'}"
        filters = f", row filters on {', '.join(pub['row_filters'])}" if pub["row_filters"] else ""
        typer.echo(f"publication {pub['name']}: {what} ({', '.join(pub['publish'])}){filters}")
    if position is None:
        typer.echo("no position stored in the log")
    else:
        typer.echo(
            f"stored up to commit {position['commit_lsn_text']} event {position['event_index']}"
            + (f"; lag {out['lag_bytes']:,} bytes" if "lag_bytes" in out else "")
        )
    if out["core"] is None:
        typer.echo(f"core: {out['core_reason']}")
    else:
        python = {n: t["reason"] for n, t in out["core_tables"].items() if t["core"] == "python"}
        native = len(out["core_tables"]) - len(python)
        what = out["core_reason"] or f"{native} of {len(out['core_tables'])} tables"
        typer.echo(f"core {out['core']} (--core {out['core_requested']}): {what}")
        if "kafka_producer" in out:
            why = f": {out['kafka_producer_reason']}" if out["kafka_producer_reason"] else ""
            typer.echo(f"Kafka producer {out['kafka_producer']} (--kafka-producer "
                       f"{out['kafka_producer_requested']}){why}")  # fmt: skip
        if out["core_reason"] is None:
            for name, reason in sorted(python.items()):
                typer.echo(f"  table {name}: python ({reason})")
    progress = out["incremental_snapshot"]
    if progress is not None:
        typer.echo(
            f"incremental snapshot {progress['id']}{' (paused)' if progress['paused'] else ''}: "
            f"table {progress['table']} ({progress['tables_left']} left, {progress['tables_done']} done), "
            f"{progress['rows']:,} rows, ~{progress['percent']}%, {progress['rows_per_s']:,} rows/s"
        )
    for warning in warnings:
        typer.echo(f"warning: {warning}")


def _signal(dsn: str, signal_table: str, type_name: str, data: dict[str, Any] | None, as_json: bool) -> None:
    from capture.signals import SignalType, send_signal

    with one_line_errors():
        signal_id = send_signal(dsn, signal_table, SignalType(type_name), data)
    if as_json:
        typer.echo(json.dumps({"id": signal_id, "type": type_name, "data": data}))
    else:
        typer.echo(f"{type_name} signal {signal_id} written to {signal_table}: the connector acts on it when its "
                   "stream reaches it")  # fmt: skip


JsonOption = Annotated[bool, typer.Option("--json", help="Print the signal as JSON.")]


@app.command()
def snapshot(
    dsn: DsnOption,
    tables: Annotated[
        list[str], typer.Option("--tables", help="schema.table[,…] to snapshot incrementally while streaming.")
    ],
    where: Annotated[
        str | None,
        typer.Option("--where", help="SQL condition: only rows matching it are read (every table listed)."),
    ] = None,
    chunk_size: Annotated[
        int | None, typer.Option("--chunk-size", min=1, help="Rows per chunk (default: the connector's, 1024).")
    ] = None,
    signal_table: SignalTableOption = DEFAULT_SIGNAL_TABLE,
    as_json: JsonOption = False,
) -> None:
    """Snapshot tables incrementally while the connector streams: writes an ``execute-snapshot`` signal.

    The connector (running, or the next to start on the slot) reads the tables in primary-key chunks
    between low and high watermarks and emits their rows as ``op=r`` events; see docs/capture.md."""
    from capture.signals import split_table_name
    from capture.tables import TableCatalog, TableFilter

    names = _split(tables)
    if not names:
        raise fail("--tables names no table")
    with one_line_errors():
        for name in names:
            split_table_name(name)
        catalog = TableCatalog(dsn, TableFilter(include=names))
        known = {t.qualified: t for t in catalog.load()}
        for name in names:
            table = known.get(name)
            if table is None:
                raise fail(f"table {name} does not exist in this database")
            if table.key_source not in ("primary key", "replica identity index"):
                raise fail(f"table {name} has no primary key to read it in chunks by: add one")
            if where is not None:
                _check_condition(dsn, name, where)
    data: dict[str, Any] = {"data-collections": names, "type": "incremental"}
    if where is not None:
        data["additional-conditions"] = [{"data-collection": n, "filter": where} for n in names]
    if chunk_size is not None:
        data["chunk-size"] = chunk_size
    _signal(dsn, signal_table, "execute-snapshot", data, as_json)


def _check_condition(dsn: str, table: str, condition: str) -> None:
    import psycopg
    from psycopg import sql

    schema, name = table.split(".", 1)
    with psycopg.connect(dsn, autocommit=True) as c:
        try:
            c.execute(sql.SQL("EXPLAIN SELECT 1 FROM {} WHERE ({})").format(sql.Identifier(schema, name),
                                                                            sql.SQL(condition)))  # fmt: skip
        except psycopg.DatabaseError as e:
            raise fail(f"--where {condition!r} does not work on {table}: {' '.join(str(e).split())}") from None


@app.command("pause-snapshot")
def pause_snapshot(dsn: DsnOption, signal_table: SignalTableOption = DEFAULT_SIGNAL_TABLE,
                   as_json: JsonOption = False) -> None:  # fmt: skip
    """Pause the incremental snapshot under way (a chunk being read completes); streaming goes on."""
    _signal(dsn, signal_table, "pause-snapshot", None, as_json)


@app.command("resume-snapshot")
def resume_snapshot(dsn: DsnOption, signal_table: SignalTableOption = DEFAULT_SIGNAL_TABLE,
                    as_json: JsonOption = False) -> None:  # fmt: skip
    """Resume a paused incremental snapshot where it stopped."""
    _signal(dsn, signal_table, "resume-snapshot", None, as_json)


@app.command("stop-snapshot")
def stop_snapshot(
    dsn: DsnOption,
    tables: Annotated[
        list[str] | None, typer.Option("--tables", help="Stop only these tables (default: the whole snapshot).")
    ] = None,
    signal_table: SignalTableOption = DEFAULT_SIGNAL_TABLE,
    as_json: JsonOption = False,
) -> None:
    """Stop the incremental snapshot (or some of its tables); rows already emitted stay in the log."""
    names = _split(tables)
    _signal(dsn, signal_table, "stop-snapshot", {"data-collections": names} if names else None, as_json)


@app.command("schema-changes-sql")
def schema_changes_sql() -> None:
    """Print the SQL that installs the event triggers of --schema-changes (for a DBA to run as a superuser, where
    the connector's role may not create event triggers); idempotent."""
    from capture.schema_changes import install_sql

    for statement in install_sql():
        typer.echo(statement.rstrip(";") + ";")
