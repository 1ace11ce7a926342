"""Commands benchmark: accepted commands/s with optimistic concurrency, three writers side by side.

All three run in the same run on one private PostgreSQL 15 cluster (``LocalPostgres``,
fsync **on**: a command is a durable commit, as in production), each in its own
database, against the same workload:

- **tideline**: ``commands.handler.CommandHandler`` with a ``Tally`` aggregate (command
  ``Add(amount)``, validated by ``decide``: amount > 0 and the total stays under a
  limit; one ``Added`` event per command), snapshots every 50 events, its state cache
  (10,000 streams) on.
- **eventsourcing**: the ``eventsourcing`` library's PostgreSQL recorder (an
  ``Application`` with an equivalent ``Tally`` aggregate: ``repository.get`` →
  ``add()`` → ``save``), snapshotting every 50 events, its aggregate cache (10,000,
  fast-forward) on; the worker processes start with table creation off
  (``CREATE_TABLE=n``), the tables being made once by the parent.
- **plain loop**: psycopg, ``SELECT max(version)`` then ``INSERT version + 1`` and
  commit, nothing else: the ceiling of an optimistic-concurrency append in Python.

A conflict (unique violation on ``(stream, version)``) is retried from a fresh read by
every writer, up to 10 attempts; a command counts when accepted. Scenarios: 1 and 8
worker processes × a pool of 1,000 aggregates and a hot pool of 10 (each command picks
an aggregate uniformly at random). The pools are created before timing; each run lasts a
fixed time, all workers of a run start together (after connecting), issue commands for a
warm-up period first (the steady state of a long-running writer: each worker reads every
aggregate of the pool once, filling its state cache, then issues uncounted commands) and
count only the commands that completed inside the window.
Latency is per accepted command, retries included.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import TYPE_CHECKING, Any, ClassVar

import psycopg
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate, event
from eventsourcing.persistence import IntegrityError

from bench.report import Paired, Section, measured, measured_paired
from commands.aggregate import AggregateType
from commands.errors import ConcurrencyError, DomainError
from commands.events import Event, EventRegistry
from commands.handler import CommandHandler, HandlerConfig
from tideline.pgharness import LocalPostgres

if TYPE_CHECKING:
    from bench.__main__ import Context

KEY = "commands"
TITLE = "Commands: validated appends with optimistic concurrency"

MAX_ATTEMPTS = 10
SNAPSHOT_EVERY = 50
LIMIT = 10**15
POOL = 1000
HOT_POOL = 10
WORKER_COUNTS = (1, 8)
ROUNDS = 5  # rounds of each 8-worker scenario (every contender once, back to back); ratios per round, median
WARMUP_SECONDS = 2.0  # each worker issues commands this long before the counted window
CACHE_SIZE = 10_000  # aggregate states each writer keeps (both libraries' default-sized caches)
CONTENDERS = ("plain loop", "eventsourcing", "tideline")


# -- the Tideline aggregate ----------------------------------------------------------------

registry = EventRegistry()


@dataclass(frozen=True, slots=True)
class Add:
    tally_id: str
    amount: int


@registry.register
@dataclass(frozen=True, slots=True)
class Added(Event):
    event_type: ClassVar[str] = "Added"
    amount: int


@dataclass(frozen=True, slots=True)
class Tally:
    total: int = 0
    count: int = 0


class AmountRefused(DomainError):
    """Add with a non-positive amount or past the limit."""


def apply_tally(state: Tally, event: Event) -> Tally:
    return Tally(state.total + event.amount, state.count + 1) if isinstance(event, Added) else state


def decide_tally(state: Tally, command: Add) -> Sequence[Event]:
    if command.amount <= 0 or state.total + command.amount > LIMIT:
        raise AmountRefused(f"cannot add {command.amount} to {state.total}")
    return [Added(command.amount)]


TALLY: AggregateType[Tally, Add] = AggregateType(
    name="tally",
    state_type=Tally,
    initial=Tally(),
    apply=apply_tally,
    decide=decide_tally,
    stream_id=lambda c: f"tally-{c.tally_id}",
    events=registry,
)


# -- writers: one "issue a command on aggregate i" callable per contender --------------------


@dataclass(frozen=True, slots=True)
class Target:
    dsn: str
    ids: tuple[str, ...]  # the pool's aggregate ids, per contender's own id scheme


Issue = Callable[[str], bool]  # issue a command on aggregate i; False: given up after MAX_ATTEMPTS
Prime = Callable[[Sequence[str]], None]  # read these aggregates once (fills a state cache)


def tideline_writer(dsn: str) -> tuple[Issue, Prime]:
    config = HandlerConfig(max_attempts=MAX_ATTEMPTS, snapshot_every=SNAPSHOT_EVERY, pool_size=1, cache_size=CACHE_SIZE)
    handler = CommandHandler(dsn, config)

    def prime(ids: Sequence[str]) -> None:
        for tally_id in ids:
            handler.load(TALLY, f"tally-{tally_id}")

    def issue(tally_id: str) -> bool:
        try:
            handler.handle(TALLY, Add(tally_id, random.randint(1, 100)))
        except ConcurrencyError:
            return False
        return True

    return issue, prime


def plain_writer(dsn: str) -> tuple[Issue, Prime]:
    conn = psycopg.connect(dsn)

    def issue(stream_id: str) -> bool:
        for _ in range(MAX_ATTEMPTS):
            try:
                row = conn.execute(
                    "SELECT max(version) FROM plain_events WHERE stream_id = %s", (stream_id,)
                ).fetchone()
                version = (row[0] if row and row[0] is not None else 0) + 1
                conn.execute(
                    "INSERT INTO plain_events (stream_id, version, payload) VALUES (%s, %s, %s)",
                    (stream_id, version, '{"amount": 1}'),
                )
                conn.commit()
                return True
            except psycopg.errors.UniqueViolation:
                conn.rollback()
        return False

    return issue, lambda ids: None  # nothing cached


def eventsourcing_env(dsn_parts: dict[str, str], create_table: bool) -> dict[str, str]:
    return {
        "PERSISTENCE_MODULE": "eventsourcing.postgres",
        "POSTGRES_DBNAME": dsn_parts["dbname"],
        "POSTGRES_HOST": dsn_parts["host"],
        "POSTGRES_PORT": dsn_parts["port"],
        "POSTGRES_USER": dsn_parts["user"],
        "POSTGRES_PASSWORD": "unused (trust)",
        "POSTGRES_POOL_SIZE": "1",
        "CREATE_TABLE": "y" if create_table else "n",
        # The same state cache as Tideline's handler (HandlerConfig.cache_size, default 10,000):
        # cached aggregates fast-forwarded from the events after their version.
        "AGGREGATE_CACHE_MAXSIZE": str(CACHE_SIZE),
        "AGGREGATE_CACHE_FASTFORWARD": "y",
    }


class EsTally(Aggregate):
    """The eventsourcing library's version of Tally: the same rule as ``decide_tally``."""

    @event("Created")
    def __init__(self) -> None:
        self.total = 0
        self.count = 0

    def add(self, amount: int) -> None:
        if amount <= 0 or self.total + amount > LIMIT:
            raise ValueError(f"cannot add {amount} to {self.total}")
        self._added(amount)

    @event("Added")
    def _added(self, amount: int) -> None:
        self.total += amount
        self.count += 1


class TallyApp(Application[uuid.UUID]):
    snapshotting_intervals: ClassVar[dict[type[Any], int]] = {EsTally: SNAPSHOT_EVERY}


def eventsourcing_app(dsn: str, create_table: bool) -> TallyApp:
    parts = psycopg.conninfo.conninfo_to_dict(dsn)
    return TallyApp(env=eventsourcing_env({k: str(v) for k, v in parts.items()}, create_table))


def eventsourcing_writer(dsn: str) -> tuple[Issue, Prime]:
    app = eventsourcing_app(dsn, create_table=False)

    def prime(ids: Sequence[str]) -> None:
        for tally_id in ids:
            app.repository.get(uuid.UUID(tally_id))

    def issue(tally_id: str) -> bool:
        for _ in range(MAX_ATTEMPTS):
            tally: EsTally = app.repository.get(uuid.UUID(tally_id))
            tally.add(random.randint(1, 100))
            try:
                app.save(tally)
                return True
            except IntegrityError:
                continue
        return False

    return issue, prime


WRITERS: dict[str, Callable[[str], tuple[Issue, Prime]]] = {
    "tideline": tideline_writer,
    "eventsourcing": eventsourcing_writer,
    "plain loop": plain_writer,
}


# -- setup -----------------------------------------------------------------------------------


def setup_tideline(dsn: str, n: int) -> tuple[str, ...]:
    import migrations

    migrations.upgrade(dsn)
    ids = tuple(f"t{i}" for i in range(n))
    with CommandHandler(dsn, HandlerConfig(snapshot_every=SNAPSHOT_EVERY)) as handler:
        for tally_id in ids:
            handler.handle(TALLY, Add(tally_id, 1))
    return ids


def setup_plain(dsn: str, n: int) -> tuple[str, ...]:
    ids = tuple(f"p{i}" for i in range(n))
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE plain_events (stream_id text, version int, payload jsonb, PRIMARY KEY (stream_id, version))"
        )
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO plain_events VALUES (%s, 1, '{\"amount\": 1}')", [(i,) for i in ids])
    return ids


def setup_eventsourcing(dsn: str, n: int) -> tuple[str, ...]:
    app = eventsourcing_app(dsn, create_table=True)
    ids = []
    for _ in range(n):
        tally = EsTally()
        tally.add(1)
        app.save(tally)
        ids.append(str(tally.id))
    app.close()
    return tuple(ids)


SETUPS: dict[str, Callable[[str, int], tuple[str, ...]]] = {
    "tideline": setup_tideline,
    "eventsourcing": setup_eventsourcing,
    "plain loop": setup_plain,
}


# -- running ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerReport:
    accepted: int
    gave_up: int  # commands that lost the race MAX_ATTEMPTS times
    latencies: list[float]  # seconds, accepted commands only


READY = "ready"


def worker_main(pipe: Pipe, contender: str, dsn: str, ids: tuple[str, ...], warmup: float, seconds: float) -> None:
    """Connect and read the pool (untimed), say READY, get the start time, warm up, then count
    the commands of the window; send a WorkerReport (or the exception)."""
    try:
        issue, prime = WRITERS[contender](dsn)
        prime(ids)  # the steady state of a long-running writer: its cache holds the pool
        pipe.send(READY)
        warm_at: float = pipe.recv()
        start_at, stop_at = warm_at + warmup, warm_at + warmup + seconds
        rng = random.Random(os.getpid())
        accepted = gave_up = 0
        latencies: list[float] = []
        while time.time() < warm_at:
            time.sleep(0.001)
        while time.time() < start_at:  # warm-up: statements prepared, caches current; not counted
            issue(rng.choice(ids))
        while True:
            t0 = time.perf_counter()
            ok = issue(rng.choice(ids))
            t1 = time.perf_counter()
            if time.time() > stop_at:
                break
            if ok:
                accepted += 1
                latencies.append(t1 - t0)
            else:
                gave_up += 1
        pipe.send(WorkerReport(accepted, gave_up, latencies))
    except BaseException as e:
        pipe.send(e)
        raise


@dataclass(frozen=True, slots=True)
class RunResult:
    contender: str
    workers: int
    pool: int
    per_second: float
    p50_ms: float
    p99_ms: float
    gave_up: int


def run_once(contender: str, target: Target, workers: int, seconds: float, pool: int, warmup: float) -> RunResult:
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for _ in range(workers):
        parent, child = ctx.Pipe(duplex=True)
        p = ctx.Process(target=worker_main, args=(child, contender, target.dsn, target.ids, warmup, seconds))
        p.start()
        pipes.append(parent)
        procs.append(p)

    def receive(pipe: Pipe) -> Any:
        message = pipe.recv()
        if isinstance(message, BaseException):
            raise RuntimeError(f"{contender} worker failed: {message!r}") from message
        return message

    reports = []
    try:
        for pipe in pipes:
            assert receive(pipe) == READY
        warm_at = time.time() + 0.2  # every worker has connected and read the pool: start together
        for pipe in pipes:
            pipe.send(warm_at)
        reports = [receive(pipe) for pipe in pipes]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, 9)
    latencies = sorted(x for r in reports for x in r.latencies)
    accepted = sum(r.accepted for r in reports)
    return RunResult(
        contender,
        workers,
        pool,
        accepted / seconds,
        percentile(latencies, 0.50) * 1e3,
        percentile(latencies, 0.99) * 1e3,
        sum(r.gave_up for r in reports),
    )


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run(ctx: Context, section: Section) -> None:
    seconds = 1.5 if ctx.quick else 5.0
    warmup = 0.5 if ctx.quick else WARMUP_SECONDS
    pg = LocalPostgres(ctx.workdir / "pg", fast=False)
    section.notes += [
        "Server: a private PostgreSQL 15 cluster (`tideline.pgharness.LocalPostgres`, fsync on, "
        "synchronous_commit on), one database per writer.",
        f"Workload: aggregates created before timing; each command adds to one aggregate picked at random from "
        f"the pool (a pool of {POOL:,} and a hot pool of {HOT_POOL}); conflicts retried from a fresh read up to "
        f"{MAX_ATTEMPTS} attempts. Each worker process connects and reads every aggregate of the pool once "
        "(Tideline `handler.load`, eventsourcing `repository.get`: both fill their state caches; the plain loop "
        "has none) — the steady state of a long-running writer whose cache holds its working set —; when all are "
        f"ready they start together: a {warmup:g} s warm-up of uncounted commands, then {seconds:g} s counted. "
        f"The 8-worker scenarios run in {ROUNDS} rounds, each contender once per round, back to back (the order "
        "rotated each round): commands/s are the medians of each contender's runs, a ratio the median of the "
        "per-round ratios (best run ÷ best run beside it). The 1-worker scenarios (informational) run once.",
        f"Snapshots every {SNAPSHOT_EVERY} events for Tideline and eventsourcing (`snapshotting_intervals`); "
        f"eventsourcing workers run with `CREATE_TABLE=n`. Both keep a cache of {CACHE_SIZE:,} aggregate states "
        "(Tideline's `HandlerConfig.cache_size` default; eventsourcing's `AGGREGATE_CACHE_MAXSIZE`, fast-forward on).",
    ]
    load_before = os.getloadavg()[0]
    pg.start()
    try:
        targets: dict[tuple[str, int], Target] = {}
        for contender in CONTENDERS:
            for pool in (POOL, HOT_POOL):
                dsn = pg.create_database(f"bench_{contender.replace(' ', '_')}_{pool}")
                ctx.say(f"creating {pool} aggregates for {contender}")
                targets[(contender, pool)] = Target(dsn, SETUPS[contender](dsn, pool))
        results: dict[tuple[str, int, int], list[RunResult]] = {}
        for workers in WORKER_COUNTS:
            rounds = 1 if ctx.quick or workers < max(WORKER_COUNTS) else ROUNDS
            for pool in (POOL, HOT_POOL):
                for n in range(rounds):
                    for contender in CONTENDERS[n % 3 :] + CONTENDERS[: n % 3]:  # order rotated each round
                        r = run_once(contender, targets[(contender, pool)], workers, seconds, pool, warmup)
                        results.setdefault((contender, workers, pool), []).append(r)
                        ctx.say(
                            f"{contender:>13}: {workers} worker(s), pool {pool:>5}: {r.per_second:7,.0f} commands/s, "
                            f"p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms, gave up {r.gave_up}"
                        )
        report(section, results)
        section.notes.append(
            f"Machine load (1-minute average) {load_before:.2f} before and {os.getloadavg()[0]:.2f} after the runs "
            "(other processes on the machine share its CPUs and move every figure)."
        )
    finally:
        pg.stop()


def median_run(runs: list[RunResult]) -> RunResult:
    """The run with the median throughput (of an odd number of runs; the lower middle of an even one)."""
    ordered = sorted(runs, key=lambda r: r.per_second)
    return ordered[(len(ordered) - 1) // 2]


def report(section: Section, results: dict[tuple[str, int, int], list[RunResult]]) -> None:
    for workers in WORKER_COUNTS:
        for pool in (POOL, HOT_POOL):
            runs = {c: results[(c, workers, pool)] for c in CONTENDERS}  # run i of each: round i
            ours, es, plain = (median_run(runs[c]) for c in ("tideline", "eventsourcing", "plain loop"))
            rates = {c: [r.per_second for r in rs] for c, rs in runs.items()}
            vs_es = Paired(rates["tideline"], rates["eventsourcing"])
            vs_plain = Paired(rates["tideline"], rates["plain loop"])
            scenario = f"{workers} worker{'s' if workers > 1 else ''}, pool of {pool:,}"
            targeted = workers == max(WORKER_COUNTS)
            latency_note = (
                f"p50/p99 latency: tideline {ours.p50_ms:.2f}/{ours.p99_ms:.2f} ms, eventsourcing "
                f"{es.p50_ms:.2f}/{es.p99_ms:.2f} ms, plain loop {plain.p50_ms:.2f}/{plain.p99_ms:.2f} ms; "
                f"commands given up after {MAX_ATTEMPTS} attempts: tideline {ours.gave_up}, "
                f"eventsourcing {es.gave_up}, plain loop {plain.gave_up}"
            )
            section.results.append(
                measured_paired(
                    f"accepted commands/s, {scenario}",
                    vs_es,
                    "commands/s",
                    baseline_name="eventsourcing (PostgreSQL recorder)",
                    min_ratio=3.0 if targeted else None,
                    note=latency_note + (f"; rounds: {vs_es.spread()}" if len(vs_es.values) > 1 else ""),
                )
            )
            section.results.append(
                measured_paired(
                    f"accepted commands/s, {scenario}",
                    vs_plain,
                    "commands/s",
                    baseline_name="plain psycopg max(version)+1 loop",
                    min_ratio=0.6 if targeted else None,
                    note=f"rounds: {vs_plain.spread()}" if len(vs_plain.values) > 1 else "",
                )
            )
            section.results.append(measured(f"p99 latency per accepted command, {scenario}", ours.p99_ms, "ms"))
