"""``tideline log mirror --to-kafka B``: copy the embedded log's topics to Kafka (:mod:`eventstore.kafka.mirror`).

Reads the log at ``--data-dir`` / ``TIDELINE_DATA_DIR``; ``--to-kafka`` defaults to
``--kafka`` / ``TIDELINE_KAFKA_BOOTSTRAP``. Without ``--follow`` it copies up to the
source's last stable offsets seen when it started and exits; with ``--follow`` it keeps
copying (and, without ``--topics``, picks up new topics) until Ctrl-C or SIGTERM, which end it between two
transactions. A progress bar on stderr, a summary on stdout (``--json``: one object).
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer

from tideline.cli_common import fail, one_line_errors

# Kafka's client, the log and rich are imported when the command runs: building the command (a project file's
# [log] section is checked against its options) costs no more than the options.
if TYPE_CHECKING:
    from eventstore.kafka.mirror import LogMirror

# eventstore.kafka.mirror.DEFAULT_BATCH_RECORDS, which imports Kafka's client (a test checks they are the same).
DEFAULT_BATCH_RECORDS = 20_000

POLL_TIMEOUT_MS = 500  # one step's wait for new source records (--follow); Ctrl-C is seen within this


def mirror(
    to_kafka: Annotated[
        str | None,
        typer.Option(
            "--to-kafka",
            metavar="HOST:PORT[,…]",
            show_default=False,
            help="The Kafka cluster to copy to (default: --kafka / TIDELINE_KAFKA_BOOTSTRAP).",
        ),
    ] = None,
    topics: Annotated[
        str | None,
        typer.Option(
            "--topics",
            metavar="T,…",
            show_default=False,
            help="Topics to copy (default: all but internal ones, yet with the capture positions, and the "
            "schema registry's __schemas into Kafka's _schemas; __consumer_offsets never).",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            show_default=False,
            help="The mirror's identity on Kafka (progress, transactional.id); run again with the same "
            "name to resume (default: the log directory's absolute path).",
        ),
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", help="Keep copying new records until Ctrl-C.")] = False,
    batch_records: Annotated[
        int, typer.Option("--batch-records", help="Records per Kafka transaction, at most.")
    ] = DEFAULT_BATCH_RECORDS,
    replication_factor: Annotated[
        int | None,
        typer.Option(
            "--replication-factor",
            show_default=False,
            help="Replicas per partition of the topics it creates (default: the broker's).",
        ),
    ] = None,
    min_insync_replicas: Annotated[
        int | None,
        typer.Option(
            "--min-insync-replicas",
            show_default=False,
            help="min.insync.replicas of the topics it creates (default: the broker's).",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
) -> None:
    """Copy topics to Kafka record for record (keys, values, headers, timestamps, tombstones, same
    partitions), exactly once and resumable, so a deployment moves to Kafka without a new snapshot.

    Only committed records are copied; Kafka's offsets differ from the log's (compaction gaps,
    commit markers): the mapping is record for record, in order. Missing Kafka topics are
    created with the log's settings; an existing one must have the same partition count and
    cleanup policy.
    """
    from tideline.cli import State  # imported late: tideline.cli imports the log commands

    bootstrap = to_kafka or State.kafka
    if bootstrap is None:
        raise fail("give the Kafka cluster to copy to: --to-kafka HOST:PORT[,…] (or --kafka)")
    named = [t.strip() for t in topics.split(",") if t.strip()] if topics is not None else None
    began = time.monotonic()
    with one_line_errors():
        from eventstore.errors import ConfigError
        from eventstore.kafka.config import probe_bootstrap
        from eventstore.kafka.mirror import LogMirror
        from eventstore.kafka.mirror_topics import default_topics
        from eventstore.log import Log

        if named == []:
            raise ConfigError("--topics is empty: name at least one topic, or leave it out to copy all")
        if replication_factor is not None and replication_factor < 1:
            raise ConfigError(f"--replication-factor must be ≥ 1, got {replication_factor}")
        if min_insync_replicas is not None and min_insync_replicas < 1:
            raise ConfigError(f"--min-insync-replicas must be ≥ 1, got {min_insync_replicas}")
        probe_bootstrap(bootstrap)
        with Log(State.data_dir, create=False) as log, LogMirror(
            log, bootstrap, name=name or str(State.data_dir.resolve()), batch_records=batch_records,
            replication_factor=replication_factor, min_insync_replicas=min_insync_replicas,
            discover=functools.partial(default_topics, log) if follow and named is None else None,
        ) as engine:  # fmt: skip
            engine.start(engine.plan(named if named is not None else default_topics(log)))
            with _stop_on_signals() as stop:
                interrupted = _run(engine, stop, follow=follow)
            summary = _summary(engine, bootstrap, time.monotonic() - began, interrupted)
    typer.echo(orjson.dumps(summary).decode() if json_output else _summary_line(summary))
    if interrupted and not follow:
        raise typer.Exit(130)


def _run(engine: LogMirror, stop: threading.Event, *, follow: bool) -> bool:
    """Copy until caught up (or, with ``follow``, until ``stop``); True if stopped before caught up."""
    ends = None if follow else engine.end_offsets()
    with _progress_bar(engine) as update:
        while not stop.is_set():
            if ends is not None and engine.caught_up(ends):
                return False
            engine.step(POLL_TIMEOUT_MS)
            update()
    return not follow


@contextmanager
def _progress_bar(engine: LogMirror) -> Iterator[Callable[[], None]]:
    """A bar of source offsets (copied / copied + still to copy) with the records copied, on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    started = engine.positions()
    console = Console(stderr=True, highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[records]:,} records"),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"mirroring {len(engine.topics)} topics", total=None, records=0)

        def update() -> None:
            positions = engine.positions()
            done = sum(pos - started.get(tp, pos) for tp, pos in positions.items())
            left = sum(max(0, end - positions.get(tp, end)) for tp, end in engine.end_offsets().items())
            progress.update(task, completed=done, total=done + left, records=engine.stats.records,
                            description=f"mirroring {len(engine.topics)} topics")  # fmt: skip

        update()
        yield update


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """SIGINT (Ctrl-C) and SIGTERM set the event: the copy stops between two transactions."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _summary(engine: LogMirror, bootstrap: str, seconds: float, interrupted: bool) -> dict[str, Any]:
    stats = engine.stats
    return {
        "mirror": engine.name,
        "source": str(engine.log.path),
        "kafka": bootstrap,
        "records": stats.records,
        "tombstones": stats.tombstones,
        "transactions": stats.transactions,
        "topics": {t: stats.per_topic.get(t, 0) for t in engine.topics},
        "created_topics": stats.created_topics,
        "seconds": round(seconds, 3),
        "caught_up": not interrupted,
    }


def _summary_line(s: dict[str, Any]) -> str:
    rate = s["records"] / s["seconds"] if s["seconds"] > 0 else 0.0
    created = f"; created {', '.join(s['created_topics'])}" if s["created_topics"] else ""
    ending = "" if s["caught_up"] else " — interrupted: run it again to resume"
    topics = f"{len(s['topics'])} topic{'' if len(s['topics']) == 1 else 's'}"
    return (
        f"mirrored {s['records']:,} records ({s['tombstones']:,} tombstones) of {topics} from {s['source']} to "
        f"Kafka at {s['kafka']} in {s['seconds']:.2f} s ({rate:,.0f}/s, {s['transactions']} transactions)"
        f"{created}{ending}"
    )
