"""``tideline project``: rebuild and follow read views on Spark, and show their status.

::

    tideline project rebuild users --dsn "$DSN"                  # replay, then swap in
    tideline project follow seats --dsn "$DSN" [--once]           # micro-batches, exactly once
    tideline project status [--json]                              # offsets, lag, reached LSN, last run

Views come from a catalog module (``--views``, default the reservations example's);
``mirror:<topic>`` mirrors any CDC topic. The log is the global ``--data-dir``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tideline.cli_common import fail, one_line_errors

DSN_ENV = "TIDELINE_DSN"
DEFAULT_VIEWS = "examples.reservations.views"

app = typer.Typer(help="Read views on Spark: rebuild, follow, status.", no_args_is_help=True)
console = Console(stderr=True, highlight=False)

DsnOption = Annotated[
    str | None,
    typer.Option("--dsn", envvar=DSN_ENV, help=f"Views database (or ${DSN_ENV}).", show_default=False),
]
ViewsOption = Annotated[str, typer.Option("--views", help="Module with the ViewCatalog VIEWS.")]
MasterOption = Annotated[str, typer.Option("--master", help="Spark master (spark://host:port for a cluster).")]


def _dsn(dsn: str | None) -> str:
    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise fail(f"no database: pass --dsn or set {DSN_ENV}")
    return dsn


def _log_dir() -> Path:
    from tideline.cli import State

    return State.data_dir


def _catalog(module: str) -> Any:
    from projections.views import load_catalog

    return load_catalog(module)


def _session(master: str) -> Any:
    from projections.engine import make_session

    with console.status(f"starting Spark ({master})"):
        return make_session(master)


@app.command()
def rebuild(
    view: Annotated[str, typer.Argument(help="Projection name (or mirror:<topic>).")],
    dsn: DsnOption = None,
    master: MasterOption = "local[*]",
    views: ViewsOption = DEFAULT_VIEWS,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Replay VIEW's topics from the beginning into a shadow table, then swap it in atomically."""
    from projections.consistency import format_lsn
    from projections.rebuild import rebuild as run_rebuild

    target = _dsn(dsn)
    with one_line_errors():
        catalog = _catalog(views)
        catalog[view]
        spark = _session(master)
        try:
            with console.status("rebuilding") as status:
                result = run_rebuild(
                    spark, catalog, view, log_dir=_log_dir(), dsn=target, stage=lambda s: status.update(f"{view}: {s}")
                )
        finally:
            spark.stop()
    rate = result.events / result.seconds if result.seconds else 0.0
    summary = {
        "projection": result.projection,
        "events": result.events,
        "rows": result.rows,
        "seconds": round(result.seconds, 2),
        "events_per_s": round(rate),
        "offsets": result.offsets,
        "reached_lsn": format_lsn(result.reached_lsn),
    }
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(
            f"rebuilt {view}: {result.events:,} events → {result.rows:,} rows in {result.seconds:.1f} s "
            f"({rate:,.0f} events/s), reached {format_lsn(result.reached_lsn)}"
        )


@app.command()
def follow(
    view: Annotated[str, typer.Argument(help="Projection name (or mirror:<topic>).")],
    dsn: DsnOption = None,
    master: MasterOption = "local[*]",
    views: ViewsOption = DEFAULT_VIEWS,
    once: Annotated[bool, typer.Option("--once", help="Apply what is readable now, then exit.")] = False,
    checkpoint_dir: Annotated[
        Path | None, typer.Option("--checkpoint-dir", help="Spark checkpoints (default <data-dir>/_projections).")
    ] = None,
    trigger_seconds: Annotated[float, typer.Option("--trigger-seconds", help="Micro-batch interval.")] = 1.0,
    max_records: Annotated[
        int | None, typer.Option("--max-records-per-trigger", help="Cap on records per batch.")
    ] = None,
    metrics_host: Annotated[str, typer.Option("--metrics-host", help="Address the metrics endpoint binds.")] = (
        "127.0.0.1"
    ),
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", min=0, max=65535, help="Serve Prometheus metrics on this port (/metrics)."),
    ] = None,
) -> None:
    """Keep VIEW up to date: micro-batches whose rows and offsets commit in one transaction."""
    from projections.consistency import format_lsn
    from projections.follow import Follower, FollowStats

    target = _dsn(dsn)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log_dir = _log_dir()
    began = time.monotonic()
    with one_line_errors():
        catalog = _catalog(views)
        catalog[view]
        spark = _session(master)
        server = None
        try:
            status = console.status(f"{view}: waiting for the first batch")

            def report(stats: FollowStats) -> None:
                status.update(
                    f"{view}: {stats.batches} batches, {stats.events:,} events, "
                    f"last batch {stats.last_batch_seconds * 1000:.0f} ms, reached {format_lsn(stats.reached_lsn)}"
                )

            follower = Follower(
                spark,
                catalog,
                view,
                log_dir=log_dir,
                dsn=target,
                checkpoint_dir=checkpoint_dir or log_dir / "_projections",
                trigger_seconds=trigger_seconds,
                max_records_per_trigger=max_records,
                on_batch=report,
            )
            if metrics_port is not None:
                from eventstore.metrics import serve_metrics
                from projections.metrics import FollowCollector

                server = serve_metrics(FollowCollector(follower), metrics_port, metrics_host)
                console.print(f"metrics on http://{metrics_host}:{server.port}/metrics")
            with status:
                stats = follower.run(once=once, stop=stop)
        finally:
            if server is not None:
                server.stop()
            spark.stop()
    typer.echo(
        f"followed {view}: {stats.batches} batches, {stats.events:,} events in {time.monotonic() - began:.1f} s, "
        f"reached {format_lsn(stats.reached_lsn)}"
    )


@app.command()
def status(
    dsn: DsnOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Per projection: checkpoint offsets, lag (log end − checkpoint), reached LSN, last run."""
    from projections.status import projection_status

    with one_line_errors():
        rows = projection_status(_dsn(dsn), _log_dir())
    if as_json:
        typer.echo(json.dumps(rows, default=str))
        return
    table = Table("projection", "mode", "status", "events", "reached", "partition", "offset", "lag", "last run")
    for r in rows:
        first = True
        for part in r["partitions"] or [{"topic": "-", "partition": "", "next_offset": "", "lag": ""}]:
            table.add_row(
                r["projection"] if first else "",
                r["mode"] if first else "",
                r["status"] if first else "",
                f"{r['events']:,}" if first else "",
                r["reached_lsn"] if first else "",
                f"{part['topic']}[{part['partition']}]",
                str(part["next_offset"]),
                str(part["lag"]),
                (r["finished_at"] or "running") if first else "",
            )
            first = False
    Console(highlight=False).print(table)
