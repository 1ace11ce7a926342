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
) -> Iterator[tuple[Log | None, Sink | None]]:
    """The embedded log under ``--data-dir`` (sink: None, the connector's default), or with
    ``--kafka`` no embedded log and the Kafka sink."""
    from capture.sinks.kafka import KafkaLogSink
    from eventstore.kafka import probe_bootstrap
    from eventstore.log import Log
    from tideline.cli import State

    if State.kafka is None:
        with Log(State.data_dir, create=create) as log:
            yield log, None
        return
    probe_bootstrap(State.kafka)
    sink = KafkaLogSink(
        State.kafka,
        state_dir=state_dir or State.data_dir / "_capture",
        replication_factor=replication_factor,
        min_insync_replicas=min_insync_replicas,
    )
    try:
        yield None, sink
    finally:
        sink.close()


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
    core: Annotated[
        str | None,
        typer.Option(
            "--core",
            help="The per-change core: auto (default: the native extension when built and it covers the "
            "configuration, wal2json with JSON values), python (the reference path), native (fail if not built). "
            "Default from TIDELINE_CAPTURE_CORE.",
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
    from capture.config import CoreChoice
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
            value_format=ValueFormat.parse(value_format),
            core=CoreChoice.default() if core is None else CoreChoice.parse(core),
            outbox_table=outbox_table,
            outbox_topic_prefix=outbox_topic_prefix,
        )
        if (replication_factor is not None or min_insync_replicas is not None) and State.kafka is None:
            raise fail("--replication-factor and --min-insync-replicas are Kafka topic settings: give --kafka")
        if log_cleaner and State.kafka is not None:
            raise fail("--log-cleaner cleans the embedded log; with --kafka the brokers' log cleaner compacts")
        with _log_and_sink(
            state_dir, replication_factor=replication_factor, min_insync_replicas=min_insync_replicas
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
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The slot (confirmed LSN, retained WAL), the last stored position, the lag, the publications (pgoutput),
    and tables needing attention."""
    from capture.connector import CaptureConfig, Connector, KeylessPolicy, slot_status
    from capture.publications import PublicationMode, Publications
    from capture.tables import KEYLESS_WARNING, TableCatalog, TableFilter
    from schemas.position import parse_lsn

    with one_line_errors():
        info = slot_status(dsn, slot)
        publications = []
        if publication is not None or (info is not None and info["plugin"] == "pgoutput"):
            publications = Publications(dsn, publication or slot, PublicationMode.FILTERED).describe()
            publications = [p for p in publications if p["exists"] or not p["name"].endswith("_keyless")]
        policy = KeylessPolicy.parse(keyless_tables)
        catalog = TableCatalog(dsn, TableFilter(include=_split(tables), exclude=_split(exclude_tables)), policy)
        catalog.load()
        with _log_and_sink(None, create=False) as (log, sink):
            config = CaptureConfig(dsn=dsn, slot=slot, topic_prefix=topic_prefix)
            position = Connector(config, log, sink=sink).read_position()
    warnings = [f"table {name} {KEYLESS_WARNING}" for name in catalog.keyless]
    warnings += [f"table {name} has no primary key and no replica identity: not captured" for name in catalog.skipped]
    out: dict[str, Any] = {
        "slot": info,
        "stored_position": None if position is None else json.loads(position.to_json()),
        "keyless_tables": catalog.keyless,
        "skipped_tables": catalog.skipped,
        "publications": publications,
        "warnings": warnings,
    }
    if info is not None and position is not None:
        out["lag_bytes"] = max(0, parse_lsn(info["current_wal_lsn"]) - position.confirm_lsn)
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
            f"stored up to commit {json.loads(position.to_json())['commit_lsn_text']} event {position.event_index}"
            + (f"; lag {out['lag_bytes']:,} bytes" if "lag_bytes" in out else "")
        )
    for warning in warnings:
        typer.echo(f"warning: {warning}")
