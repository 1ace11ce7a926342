"""``tideline console``: the operations page, served until Ctrl-C (or SIGTERM).

::

    tideline console --port 8090 --dsn "$DSN" --topic-prefix shop [--capture-metrics http://127.0.0.1:9187/metrics]

The page (:mod:`tideline.console`) shows the log's topics, consumer-group and projection
lag, capture's slot, lag and core, schema subjects, warnings, and capture's throughput and
latency over time; it reads what ``log describe``, ``log groups``, ``capture status``,
``project status`` and ``schemas list`` read, on the embedded log (``--data-dir``) or on
Kafka (``--kafka``).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from tideline.cli_common import fail, graceful_server, listen, one_line_errors

log = logging.getLogger("tideline.console")

DEFAULT_PORT = 8090


def console_command(
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="TCP port to listen on (0: any free port).")
    ] = DEFAULT_PORT,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    dsn: Annotated[
        str | None,
        typer.Option("--dsn", envvar="TIDELINE_DSN", help="Capture's source database (the slot, keyless tables).",
                     show_default=False),
    ] = None,
    views_dsn: Annotated[
        str | None,
        typer.Option("--views-dsn", help="The projections' database (default: --dsn).", show_default=False),
    ] = None,
    slot: Annotated[str, typer.Option("--slot", help="The connector's replication slot.")] = "tideline",
    topic_prefix: Annotated[str, typer.Option("--topic-prefix", help="The connector's topic prefix.")] = "tideline",
    tables: Annotated[list[str] | None, typer.Option("--tables", help="schema.table patterns captured.")] = None,
    exclude_tables: Annotated[list[str] | None, typer.Option("--exclude-tables", help="Patterns skipped.")] = None,
    capture_metrics: Annotated[
        str | None,
        typer.Option(
            "--capture-metrics",
            metavar="URL",
            help="The connector's Prometheus endpoint (capture run --metrics-port): the throughput and "
            "commit→log latency charts read it (without it: throughput from the topics' end offsets, no latency).",
            show_default=False,
        ),
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option("--state-dir", help="The connector's --state-dir, where it reports its core (default: "
                     "<data dir>/_capture).", show_default=False),
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", min=0.1, help="Seconds between refreshes (and chart points).")
    ] = 1.0,
    stall_after: Annotated[
        float,
        typer.Option("--stall-after", min=0, help="Seconds of lag > 0 without progress that make a view stalled."),
    ] = 60.0,
    retained_wal_warn: Annotated[
        int | None,
        typer.Option("--retained-wal-warn", min=0, metavar="BYTES",
                     help="Warn when the slot retains more WAL than this (default: the connector's, 1 GiB).",
                     show_default=False),
    ] = None,
) -> None:
    """Serve the operations page: topics, lag, capture, projections, schemas, warnings, live charts."""
    from tideline.cli import State
    from tideline.console.app import create_app
    from tideline.console.panels import ConsoleSettings
    from tideline.console.state import ConsoleState, Sampler

    with one_line_errors():
        backend = State.backend()
        backend.check()
        if not backend.exists():
            raise fail(f"no log at {State.data_dir}: give --data-dir (or TIDELINE_DATA_DIR) of an existing log, "
                       "or --kafka")  # fmt: skip
    settings = ConsoleSettings(
        data_dir=State.data_dir,
        kafka=State.kafka,
        dsn=dsn,
        views_dsn=views_dsn,
        slot=slot,
        topic_prefix=topic_prefix,
        tables=tuple(p.strip() for v in tables or [] for p in v.split(",") if p.strip()),
        exclude_tables=tuple(p.strip() for v in exclude_tables or [] for p in v.split(",") if p.strip()),
        capture_metrics=capture_metrics,
        state_dir=state_dir,
        stall_after_s=stall_after,
        retained_wal_warn_bytes=retained_wal_warn,
        interval_s=interval,
    )
    listener = listen(host, port)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    state = ConsoleState(settings)
    state.refresh()  # the first page load has figures
    sampler = Sampler(state)
    sampler.start()
    bound_host, bound_port = listener.getsockname()[:2]
    log.info("console listening=http://%s:%d/ log=%r slot=%s topic_prefix=%s", bound_host, bound_port,
             settings.where, slot, topic_prefix)  # fmt: skip
    server = graceful_server(create_app(state))
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()
        sampler.stop()
    stopped_by = signal.Signals(server.stopped_by).name if server.stopped_by else "shutdown"
    log.info("console stopped by=%s", stopped_by)
