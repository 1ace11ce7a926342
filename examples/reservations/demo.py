"""``python -m examples.reservations.demo`` (``make demo``): the main job end to end — capture, commands, Spark
projections — verified, on the reservations example (an application of Tideline, not part of it).

1. A private PostgreSQL 15 with wal2json (``<demo dir>/postgres``, fsync off: throwaway),
   migrated (``events``, ``commands``, ``claims``, ``snapshots``, read views).
2. A plain table ``shop.orders`` with rows, then the capture connector's snapshot: the
   table to ``demo.shop.orders``, the write side's ``events`` table routed to
   ``events.<stream_type>`` (outbox).
3. The reservations app's commands (examples.reservations.demo_commands: some refused on purpose —
   taken usernames and seats, stale versions) and an ordinary SQL workload on
   ``shop.orders`` (inserts, updates, key changes, deletes), captured (stream).
4. Spark: every read view of the reservations example is *rebuilt* from the log
   (users, seats, show_occupancy, snapshots, and the orders mirror); then more commands
   and SQL, captured, and every view *follows* them (one micro-batch run).
5. Checks (✓/✗): the log's latest value per key = ``SELECT * FROM shop.orders``; the
   ``events.*`` topics hold every stored event exactly once; every view = the pure-Python
   fold of the log (projections.reference); seats and users = the write model's claims;
   the orders mirror = the table. A summary table, then everything started is stopped
   (Spark, Postgres by PID). Exit 1 if any check fails; the data stays in the directory.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tideline.cli_common import one_line_errors

# Postgres, the log, the commands (SQLAlchemy), Spark and rich are imported when the demo runs, not at start-up:
# every `tideline` command imports this module (tests/tideline/test_cli_startup.py).
if TYPE_CHECKING:
    from rich.console import Console

    from eventstore.log import Log
    from examples.reservations.demo_capture import SqlWorkload
    from examples.reservations.demo_commands import CommandsResult

SLOT = "tideline_demo"
VIEWS_MODULE = "examples.reservations.views"
EXAMPLE_MIGRATIONS = "examples.reservations.migrations"  # the example's own tables (its alembic branch)


@dataclass(slots=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(slots=True)
class DemoResult:
    directory: Path
    checks: list[Check] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    capture_events: int = 0
    capture_seconds: float = 0.0
    capture_lag_ms: int = 0
    retained_wal_bytes: int = 0
    commands: list[CommandsResult] = field(default_factory=list)
    orders: SqlWorkload | None = None
    view_rows: dict[str, int] = field(default_factory=dict)
    rebuild_events: dict[str, int] = field(default_factory=dict)
    follow_events: dict[str, int] = field(default_factory=dict)
    topics: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)


# ---------------------------------------------------------------------------- phases


def _prepare_directory(directory: Path | None) -> Path:
    """A fresh, empty directory; by default ``<data dir>/demo-<timestamp>``."""
    from eventstore.errors import ConfigError
    from eventstore.log import Log

    if directory is not None:
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise ConfigError(f"{directory} is not empty: the demo needs a fresh directory")
        return directory
    from tideline.cli import State  # imported late: tideline.cli imports this module

    parent = State.data_dir
    if not parent.exists() or (parent.is_dir() and not any(parent.iterdir())):
        Log(parent, create=True).close()  # keep the data dir a usable log, not a bare folder
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate = parent / f"demo-{stamp}"
    n = 1
    while candidate.exists():
        n += 1
        candidate = parent / f"demo-{stamp}-{n}"
    return candidate


def _capture(dsn: str, log: Log, result: DemoResult) -> None:
    from capture.connector import CaptureConfig, Connector
    from capture.tables import TableFilter

    # The plain table and the outbox only: the read views and the write model's other tables
    # live in the same database, and capturing them would feed the projections' output back in.
    tables = TableFilter(include=["shop.orders", "public.events"])
    config = CaptureConfig(
        dsn=dsn, slot=SLOT, topic_prefix="demo", table_filter=tables, outbox_table="public.events",
        exit_when_caught_up=True,
    )  # fmt: skip
    started = time.monotonic()
    stats = Connector(config, log).run()
    result.capture_seconds += time.monotonic() - started
    result.capture_events += stats.events + stats.snapshot_rows
    result.capture_lag_ms = stats.lag_ms()


def run_demo(
    directory: Path, *, console: Console, master: str, orders: int, transactions: int, users: int, reservations: int
) -> DemoResult:
    """Every phase of the module docstring; Spark and Postgres are stopped before this returns or raises."""
    import psycopg
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import migrations
    from capture.connector import slot_status
    from eventstore.log import Log
    from examples.reservations.demo_capture import SCHEMA, SqlWorkload, _row, _workload
    from examples.reservations.demo_commands import run_commands
    from projections.engine import make_session
    from projections.follow import follow
    from projections.rebuild import rebuild
    from projections.views import load_catalog
    from tideline.pgharness import LocalPostgres

    result = DemoResult(directory)
    log_dir, checkpoints = directory / "log", directory / "spark-checkpoints"
    rng = random.Random(7)
    columns = (
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    pg = LocalPostgres(directory / "postgres", fast=True)
    spark: Any = None
    with Progress(*columns, console=console, transient=False) as progress:
        try:
            step = progress.add_task("postgres: start + migrate", total=2)
            pg.start()
            dsn = pg.create_database("tideline")
            migrations.upgrade(dsn, apps=migrations.locations([EXAMPLE_MIGRATIONS]))  # + the example's views
            progress.update(step, completed=2)

            step = progress.add_task("postgres: shop.orders rows", total=orders)
            sql_work = result.orders = SqlWorkload(next_id=orders + 1)
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute(SCHEMA.encode())
                with c.cursor().copy("COPY shop.orders (id, customer, total, items, tags, note) FROM STDIN") as copy:
                    for i in range(1, orders + 1):
                        copy.write_row(_row(i, rng))
            progress.update(step, completed=orders)

            with Log(log_dir, create=True) as log:
                step = progress.add_task("capture: snapshot", total=1)
                _capture(dsn, log, result)
                progress.update(step, completed=1)

                def round_of_work(label: str, seed: int, scale: float) -> None:
                    n_users, n_res, n_txn = int(users * scale), int(reservations * scale), int(transactions * scale)
                    cmd = progress.add_task(f"commands ({label})", total=n_users + n_res)
                    tick = lambda: progress.advance(cmd)  # noqa: E731
                    done = run_commands(dsn, users=n_users, reservations=n_res, seed=seed, on_command=tick)
                    result.commands.append(done)
                    progress.update(cmd, completed=n_users + n_res)
                    sql = progress.add_task(f"postgres: SQL workload ({label})", total=n_txn)
                    _workload(dsn, rng, n_txn, sql_work, lambda: progress.advance(sql))
                    stream = progress.add_task(f"capture: stream ({label})", total=1)
                    _capture(dsn, log, result)
                    progress.update(stream, completed=1)

                round_of_work("round 1", seed=1, scale=1.0)

                step = progress.add_task("spark: start", total=1)
                started = time.monotonic()
                spark = make_session(master, "tideline-demo")
                result.seconds["spark start"] = time.monotonic() - started
                progress.update(step, completed=1)
                catalog = load_catalog(VIEWS_MODULE)
                names = list(catalog.views)

                step = progress.add_task("spark: rebuild views", total=len(names))
                started = time.monotonic()
                for name in names:
                    rebuilt = rebuild(spark, catalog, name, log_dir=log_dir, dsn=dsn)
                    result.rebuild_events[name] = rebuilt.events
                    progress.advance(step)
                result.seconds["rebuild"] = time.monotonic() - started

                round_of_work("round 2", seed=2, scale=0.3)

                step = progress.add_task("spark: follow views (one run)", total=len(names))
                started = time.monotonic()
                for name in names:
                    stats = follow(
                        spark, catalog, name, log_dir=log_dir, dsn=dsn, checkpoint_dir=checkpoints, once=True
                    )
                    result.follow_events[name] = stats.events
                    progress.advance(step)
                result.seconds["follow"] = time.monotonic() - started

                step = progress.add_task("verify", total=1)
                _verify(result, log, dsn, catalog)
                info = slot_status(dsn, SLOT)
                result.retained_wal_bytes = int(info["retained_wal_bytes"]) if info else -1
                result.topics = {t: _records_in(log, t) for t in sorted(log.topics()) if not t.startswith("__")}
                progress.update(step, completed=1)
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
        finally:
            if spark is not None:
                spark.stop()
            pg.stop()
    return result


# ---------------------------------------------------------------------------- checks


def _records_in(log: Log, topic: str) -> int:
    meta = log.topic(topic)
    return sum(log.partition(topic, p).log_end_offset() for p in range(meta.partitions))


def _verify(result: DemoResult, log: Log, dsn: str, catalog: Any) -> None:
    import orjson
    import psycopg

    from eventstore.consumer import Consumer, TopicPartition
    from examples.reservations.demo_capture import _log_state, _table_state
    from projections.reference import expected_rows, view_rows

    state, events, duplicates = _log_state(log)
    table = _table_state(dsn)
    differing = sum(1 for k in set(state) | set(table) if state.get(k) != table.get(k))
    result.checks.append(Check("capture: latest value per key = SELECT * FROM shop.orders", differing == 0 and
                               bool(table), f"{len(table):,} rows, {differing} differing keys"))  # fmt: skip
    result.checks.append(Check("capture: no change event stored twice", duplicates == 0, f"{events:,} change events"))

    with psycopg.connect(dsn) as c:
        stored = {int(i): (s, int(v)) for i, s, v in c.execute("SELECT id, stream_id, version FROM events")}
        claims = Counter((t, v, s) for t, v, s in c.execute("SELECT claim_type, value, stream_id FROM claims"))
        mirror = {
            orjson.dumps(orjson.loads(k)): orjson.loads(r)
            for k, r in c.execute("SELECT key::text, row::text FROM cdc_mirror WHERE projection = 'orders'")
        }
    routed: list[int] = []
    with Consumer(log, enable_auto_commit=False) as consumer:
        topics = [t for t in log.topics() if t.startswith("events.")]
        consumer.assign([TopicPartition(t, p) for t in topics for p in range(log.topic(t).partitions)])
        consumer.seek_to_beginning()
        while records := consumer.poll(timeout_ms=0):
            routed += [int(orjson.loads(r.value)["id"]) for r in records if r.value is not None]
    result.checks.append(Check("outbox: every stored event once in events.*", sorted(routed) == sorted(stored),
                               f"{len(routed):,} routed, {len(stored):,} in the events table"))  # fmt: skip

    for name, view in catalog.views.items():
        actual, expected = view_rows(dsn, view), expected_rows(view, log.path)
        result.view_rows[name] = len(actual)
        result.checks.append(Check(f"view {name} = reference fold of the log", actual == expected,
                                   f"{len(actual):,} rows, {len(expected):,} expected"))  # fmt: skip

    with psycopg.connect(dsn) as c:
        seats = {(f"{show}/{seat}", f"reservation-{rid}") for show, seat, rid in
                 c.execute("SELECT show_id, seat, reservation_id FROM seats")}  # fmt: skip
        usernames = {(u, f"user-{uid}") for uid, u in c.execute("SELECT user_id, username FROM users")}
    seat_claims = {(v, s) for (t, v, s) in claims if t == "seat"}
    name_claims = {(v, s) for (t, v, s) in claims if t == "username"}
    result.checks.append(Check("view seats = seat claims of the write model", seats == seat_claims,
                               f"{len(seats):,} seats held"))  # fmt: skip
    result.checks.append(Check("view users = username claims of the write model", usernames == name_claims,
                               f"{len(usernames):,} users"))  # fmt: skip
    result.checks.append(Check("view orders (mirror) = SELECT * FROM shop.orders", mirror == table,
                               f"{len(mirror):,} rows"))  # fmt: skip


# ---------------------------------------------------------------------------- report


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}/s" if seconds > 0 else "-"


def _print_report(console: Console, result: DemoResult, elapsed: float) -> None:
    from rich.table import Table

    for check in result.checks:
        mark = "[green]✓[/green]" if check.ok else "[red]✗[/red]"
        console.print(f"{mark} {check.name}: {check.detail}", soft_wrap=True)
    table = Table(title="the reservations demo", show_header=False)
    table.add_column("what")
    table.add_column("value")
    accepted = sum((c.accepted for c in result.commands), Counter())
    refused = sum((c.refused for c in result.commands), Counter())
    table.add_row("commands accepted", ", ".join(f"{k} {v:,}" for k, v in sorted(accepted.items())))
    table.add_row("commands refused", ", ".join(f"{k} {v:,}" for k, v in sorted(refused.items())))
    table.add_row(
        "events captured",
        f"{result.capture_events:,} in {result.capture_seconds:.1f} s "
        f"({_rate(result.capture_events, result.capture_seconds)})",
    )
    table.add_row(
        "capture lag",
        f"the connector runs after each round here (until caught up): last change stored "
        f"{result.capture_lag_ms:,} ms after its commit; slot retains {result.retained_wal_bytes:,} B of WAL",
    )
    table.add_row("topics", ", ".join(f"{t} ({n:,})" for t, n in result.topics.items()))
    table.add_row("views (rows)", ", ".join(f"{v} {n:,}" for v, n in result.view_rows.items()))
    table.add_row(
        "spark",
        f"start {result.seconds.get('spark start', 0):.1f} s; rebuild {sum(result.rebuild_events.values()):,} events "
        f"in {result.seconds.get('rebuild', 0):.1f} s; follow {sum(result.follow_events.values()):,} events in "
        f"{result.seconds.get('follow', 0):.1f} s",
    )
    table.add_row("data", f"{result.directory.resolve()} (log: log/, Postgres: postgres/, stopped)")
    table.add_row("took", f"{elapsed:.0f} s")
    console.print(table)
    hint = f"inspect it: tideline --data-dir {result.directory / 'log'} log topics"
    console.print(hint, markup=False, soft_wrap=True)
    verdict = "[green]all checks passed[/green]" if result.ok else "[red]some checks failed[/red]"
    console.print(verdict)


def demo_command(
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Fresh directory for the demo (default: <data dir>/demo-<timestamp>).",
                     show_default=False),
    ] = None,
    master: Annotated[str, typer.Option("--master", help="Spark master URL.")] = "local[*]",
    orders: Annotated[int, typer.Option("--orders", min=1, help="Rows in shop.orders before the snapshot.")] = 5_000,
    transactions: Annotated[int, typer.Option("--transactions", min=1, help="SQL workload transactions.")] = 300,
    users: Annotated[int, typer.Option("--users", min=1, help="RegisterUser commands (round 1).")] = 200,
    reservations: Annotated[
        int, typer.Option("--reservations", min=1, help="Reservation commands (round 1).")
    ] = 1_500,
) -> None:
    """Capture, commands and Spark projections end to end; ✓/✗ per check and a summary.

    Exits 1 if a check fails. The data stays in the directory it names.
    """
    from rich.console import Console

    console = Console(highlight=False)
    started = time.monotonic()
    with one_line_errors():
        target = _prepare_directory(directory)
        result = run_demo(target, console=console, master=master, orders=orders, transactions=transactions,
                          users=users, reservations=reservations)  # fmt: skip
    _print_report(console, result, time.monotonic() - started)
    if not result.ok:
        raise typer.Exit(1)


def main() -> None:
    """``python -m examples.reservations.demo [--dir …] […]``."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(help="Run the main job end to end on the embedded defaults.")(demo_command)
    app()


if __name__ == "__main__":
    main()
