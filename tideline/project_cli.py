"""``tideline project``: rebuild read views (live or on Spark), follow them (live or on Spark), show their status.

::

    tideline project rebuild users --dsn "$DSN"                  # replay, then swap in (--engine auto|live|spark)
    tideline project follow seats --dsn "$DSN" [--once]           # batches, exactly once (--engine live|spark)
    tideline project status [--json] [--stall-after 60]           # offsets, lag, reached LSN, stalled, last run
    tideline --kafka HOST:PORT project rebuild users --dsn "$DSN" # the same, reading Apache Kafka

Views come from the application's catalog module (``--views``, ``$TIDELINE_VIEWS`` or the project file's ``views``);
``mirror:<topic>`` mirrors any CDC topic. The log is the global ``--data-dir``, or Kafka
with the global ``--kafka`` / ``TIDELINE_KAFKA_BOOTSTRAP`` (Spark's own Kafka source and a
librdkafka consumer: docs/kafka.md, "Projections from Kafka").
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tideline.cli_common import fail, one_line_errors

if TYPE_CHECKING:
    from rich.console import Console

    from tideline.backend import Backend

DSN_ENV = "TIDELINE_DSN"
NON_TTY_WIDTH = 100_000  # `project status` not on a terminal: wide enough that no cell is cut
VIEWS_ENV = "TIDELINE_VIEWS"

app = typer.Typer(help="Read views: rebuild (live or Spark), follow (live or Spark), status.", no_args_is_help=True)
STARTED = time.monotonic()  # when this module was imported (see _wall_seconds)
PROCESS_START_SLACK_S = 30.0  # imported this soon after the process started: the process is the command


@functools.cache
def _console() -> Console:
    """stderr, for progress and notes (rich is imported when a command runs: start-up time)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _wall_seconds(entered: float) -> float:
    """The command's whole wall time, what ``time tideline …`` shows: since the process started
    (Linux: /proc/self/stat's start time against /proc/uptime) when this module was imported as the
    process began (a ``tideline`` process: its imports count too); else (a long-lived process that
    runs the command, e.g. a test's CliRunner) since ``entered``, the command's own start."""
    since_entered = time.monotonic() - entered
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return since_entered
    age = max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    imported_after = age - (time.monotonic() - STARTED)  # seconds from the process's start to this import
    return age if imported_after < PROCESS_START_SLACK_S else since_entered


DsnOption = Annotated[
    str | None,
    typer.Option("--dsn", envvar=DSN_ENV, help=f"Views database (or ${DSN_ENV}).", show_default=False),
]
ViewsOption = Annotated[
    str | None,
    typer.Option(
        "--views",
        envvar=VIEWS_ENV,
        help=f"Your module with the ViewCatalog VIEWS (or ${VIEWS_ENV}, or views in the project file).",
        show_default=False,
    ),
]


def _dsn(dsn: str | None) -> str:
    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise fail(f"no database: pass --dsn or set {DSN_ENV}")
    return dsn


def _log_dir() -> Path:
    from tideline.cli import State

    return State.data_dir


def _backend() -> Backend:
    """The log backend the options chose (checked reachable, in one line)."""
    from tideline.cli import State

    backend = State.backend()
    backend.check()
    return backend


def _catalog(module: str | None) -> Any:
    from projections.views import load_catalog

    if not module:
        raise fail(f"no views module: pass --views MODULE, set {VIEWS_ENV}, or name views in the project file")
    return load_catalog(module)


SPARK_LOG_LEVELS = ("OFF", "FATAL", "ERROR", "WARN", "INFO", "DEBUG", "TRACE", "ALL")
DEFAULT_SPARK_LOG_LEVEL = "ERROR"
DEFAULT_LOG_INTERVAL = 10.0
SparkLogLevelOption = Annotated[
    str, typer.Option("--spark-log-level", help=f"Spark's console log level ({', '.join(SPARK_LOG_LEVELS)}).")
]
LOG4J2_PROPERTIES = """\
# Written by tideline project: Spark's console at one level (--spark-log-level), on stderr.
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = stderr
# PySpark's JVM starts as an interpreter: its console takes this logger's level (else WARN, announced)
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = {level}
appender.console.type = Console
appender.console.name = stderr
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n%ex
"""


def _spark_log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in SPARK_LOG_LEVELS:
        raise fail(f"--spark-log-level must be one of {', '.join(SPARK_LOG_LEVELS)}, not {text!r}")
    return level


def _session(master: str, log_level: str = DEFAULT_SPARK_LOG_LEVEL, *, kafka: bool = False) -> Any:
    """A SparkSession whose console logs at ``log_level`` from the JVM's start: a log4j2
    configuration passed to the driver (Spark's own default prints its profile and WARN lines
    before any ``setLogLevel`` can run). A ``PYSPARK_SUBMIT_ARGS`` set by the user is kept.
    ``kafka``: with Spark's Kafka source on the class path."""
    from projections.engine import make_session

    fd, name = tempfile.mkstemp(prefix="tideline-log4j2-", suffix=".properties")
    config = Path(name)
    previous = os.environ.get("PYSPARK_SUBMIT_ARGS")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(LOG4J2_PROPERTIES.format(level=log_level))
        if previous is None:
            os.environ["PYSPARK_SUBMIT_ARGS"] = (
                f"--driver-java-options {shlex.quote(f'-Dlog4j2.configurationFile={config.as_uri()}')} pyspark-shell"
            )
        with _console().status(f"starting Spark ({master})"):
            session = make_session(master, kafka=kafka)
        session.sparkContext.setLogLevel(log_level)
        return session
    finally:
        if previous is None:
            os.environ.pop("PYSPARK_SUBMIT_ARGS", None)
        config.unlink(missing_ok=True)  # read once, when the JVM started


LIVE_MAX_RECORDS = 500_000  # = projections.live_rebuild.DEFAULT_LIVE_MAX_RECORDS (not imported here: start-up time)


@app.command()
def rebuild(
    view: Annotated[str, typer.Argument(help="Projection name (or mirror:<topic>).")],
    dsn: DsnOption = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="auto: live when the view's topics hold at most --live-max-records records, else spark; "
            "live: in this process, no Spark; spark: on Spark (--master).",
        ),
    ] = "auto",
    live_max_records: Annotated[
        int,
        typer.Option(
            "--live-max-records", min=0, help="--engine auto: the most records (counted from offsets) rebuilt live."
        ),
    ] = LIVE_MAX_RECORDS,
    master: Annotated[
        str | None,
        typer.Option(
            "--master", help="Spark master (spark://host:port for a cluster; default local[*]); implies --engine spark."
        ),
    ] = None,
    views: ViewsOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    spark_log_level: SparkLogLevelOption = DEFAULT_SPARK_LOG_LEVEL,
) -> None:
    """Replay VIEW's topics from the beginning into a shadow table, then swap it in atomically (live or on Spark)."""
    entered = time.monotonic()
    import logging

    from projections.consistency import format_lsn
    from projections.live_rebuild import RebuildEngine, choose_engine, rebuild_live

    target = _dsn(dsn)
    with one_line_errors():
        level = _spark_log_level(spark_log_level)
        requested = RebuildEngine.parse(engine)
        if master is not None and requested is RebuildEngine.LIVE:
            raise fail("--master is for the Spark engine (--engine live rebuilds in this process)")
        catalog = _catalog(views)
        projection = catalog[view]
        backend = _backend()
        with backend.source() as source:
            choice = choose_engine(requested, source, projection, live_max_records, master=master)
            note = f"engine: {choice.engine.value} ({choice.reason})"
            logging.getLogger("projections.rebuild").info("projection=%s %s", projection.name, note)
            _console().print(note, markup=False, soft_wrap=True)  # stderr: --json's stdout stays one object
            if choice.engine is RebuildEngine.LIVE:
                with _console().status("rebuilding (live)") as status:
                    result = rebuild_live(
                        catalog, view, source=source, dsn=target, stage=lambda s: status.update(f"{view}: {s}")
                    )
            else:
                from projections.rebuild import rebuild as run_rebuild

                spark = _session(master or "local[*]", level, kafka=backend.spark_needs_kafka_source)
                try:
                    with _console().status("rebuilding") as status:
                        result = run_rebuild(
                            spark, catalog, view, source=source, dsn=target,
                            stage=lambda s: status.update(f"{view}: {s}"),
                        )  # fmt: skip
                finally:
                    spark.stop()
    seconds = _wall_seconds(entered)
    rate = result.events / seconds if seconds else 0.0
    summary = {
        "projection": result.projection,
        "engine": choice.engine.value,
        "engine_reason": choice.reason,
        "records_counted": choice.records,
        "events": result.events,
        "rows": result.rows,
        "seconds": round(seconds, 2),
        "rebuild_seconds": round(result.seconds, 2),
        "events_per_s": round(rate),
        "offsets": result.offsets,
        "reached_lsn": format_lsn(result.reached_lsn),
    }
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(
            f"rebuilt {view} ({choice.engine.value}): {result.events:,} events → {result.rows:,} rows in "
            f"{seconds:.1f} s ({rate:,.0f} events/s; the command's whole wall time), "
            f"reached {format_lsn(result.reached_lsn)}"
        )


@app.command()
def follow(
    view: Annotated[str, typer.Argument(help="Projection name (or mirror:<topic>).")],
    dsn: DsnOption = None,
    engine: Annotated[
        str, typer.Option("--engine", help="live: no Spark, milliseconds behind capture; spark: micro-batches.")
    ] = "live",
    master: Annotated[str | None, typer.Option("--master", help="Spark master (--engine spark).")] = None,
    views: ViewsOption = None,
    once: Annotated[bool, typer.Option("--once", help="Apply what is readable now, then exit.")] = False,
    checkpoint_dir: Annotated[
        Path | None, typer.Option("--checkpoint-dir", help="Spark checkpoints (default <data-dir>/_projections).")
    ] = None,
    trigger_seconds: Annotated[
        float | None, typer.Option("--trigger-seconds", help="Micro-batch interval (--engine spark; default 1).")
    ] = None,
    max_records: Annotated[
        int | None,
        typer.Option("--max-records-per-batch", "--max-records-per-trigger", min=1, help="Cap on records per batch."),
    ] = None,
    log_interval: Annotated[
        float, typer.Option("--log-interval", min=0, help="Seconds between progress lines on stderr (0: none).")
    ] = DEFAULT_LOG_INTERVAL,
    spark_log_level: SparkLogLevelOption = DEFAULT_SPARK_LOG_LEVEL,
    metrics_host: Annotated[str, typer.Option("--metrics-host", help="Address the metrics endpoint binds.")] = (
        "127.0.0.1"
    ),
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", min=0, max=65535, help="Serve Prometheus metrics on this port (/metrics)."),
    ] = None,
) -> None:
    """Keep VIEW up to date: batches whose rows and offsets commit in one transaction, exactly once."""
    from projections.consistency import format_lsn
    from projections.engines import FollowEngine, FollowSettings

    target = _dsn(dsn)
    stop = threading.Event()
    log_dir = _log_dir()
    began = time.monotonic()
    with one_line_errors(), ExitStack() as resources:
        chosen = FollowEngine.parse(engine)
        level = _spark_log_level(spark_log_level)
        if master is not None and not chosen.needs_spark:
            raise fail("--master is for --engine spark (the live engine runs in this process)")
        catalog = _catalog(views)
        catalog[view]
        backend = _backend()
        settings = FollowSettings(
            source=resources.enter_context(backend.source(create=True)),
            dsn=target,
            checkpoint_dir=checkpoint_dir or log_dir / "_projections",
            max_records_per_batch=max_records,
            trigger_seconds=trigger_seconds,
        )
        job = None if chosen.needs_spark else chosen.job(catalog, view, settings)
        with_kafka = backend.spark_needs_kafka_source
        spark = _session(master or "local[*]", level, kafka=with_kafka) if chosen.needs_spark else None
        server = None
        try:
            job = job or chosen.job(catalog, view, settings, spark)

            def on_signal(signum: int, frame: FrameType | None) -> None:
                stop.set()
                wakeup = getattr(job, "wakeup", None)
                if wakeup is not None:
                    wakeup()

            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
            if metrics_port is not None:
                from eventstore.metrics import serve_metrics
                from projections.metrics import FollowCollector

                server = serve_metrics(FollowCollector(job), metrics_port, metrics_host)
                _console().print(f"metrics on http://{metrics_host}:{server.port}/metrics")
            with _progress(job, chosen.value, log_interval):
                stats = job.run(once=once, stop=stop)
        finally:
            if server is not None:
                server.stop()
            if spark is not None:
                spark.stop()
    typer.echo(
        f"followed {view} ({chosen.value}): {stats.batches} batches, {stats.events:,} events in "
        f"{time.monotonic() - began:.1f} s, reached {format_lsn(stats.reached_lsn)}"
    )


def _progress(job: Any, engine: str, interval: float) -> AbstractContextManager[Any]:
    """One structured progress line per ``interval`` on stderr (none for 0)."""
    from projections.progress import ProgressReporter

    if interval <= 0:
        return nullcontext()
    return ProgressReporter(job, engine, interval, lambda line: _console().print(line, markup=False, soft_wrap=True))


@app.command()
def status(
    dsn: DsnOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    stall_after: Annotated[
        float,
        typer.Option("--stall-after", min=0, help="Seconds of lag > 0 without progress that make a view stalled."),
    ] = 60.0,
) -> None:
    """Per projection: checkpoint offsets, lag (log end − checkpoint; with --kafka, Kafka's), reached LSN, stalled
    or ok, last run."""
    from projections.status import projection_status

    with one_line_errors(), _backend().source() as source:
        rows = projection_status(_dsn(dsn), source, stall_after=stall_after)
    if as_json:
        typer.echo(json.dumps(rows, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "projection", "mode", "status", "health", "events", "reached", "partition", "offset", "lag", "last run"
    )
    for r in rows:
        first = True
        for part in r["partitions"] or [{"topic": "-", "partition": "", "next_offset": "", "lag": ""}]:
            health = "[red]stalled[/red]" if r["stalled"] else ("behind" if r["lag"] else "ok")
            table.add_row(
                r["projection"] if first else "",
                r["mode"] if first else "",
                r["status"] if first else "",
                health if first else "",
                f"{r['events']:,}" if first else "",
                r["reached_lsn"] if first else "",
                f"{part['topic']}[{part['partition']}]",
                str(part["next_offset"]),
                str(part["lag"]),
                (r["finished_at"] or "running") if first else "",
            )
            first = False
    # a terminal gets the table at its width; piped or redirected output every value whole (rich would
    # take COLUMNS, or 80, and cut each cell to fit)
    wide = None if sys.stdout.isatty() else NON_TTY_WIDTH
    Console(highlight=False, width=wide).print(table)
