"""Postgres restarted (``pg_ctl restart -m immediate``: a crash and WAL recovery) under 8 command writers.

Eight processes handle commands (reservations with seat claims, seat changes on their
own and shared reservations, cancellations, user registrations with username claims)
against a private cluster. Each client retries a command with the *same command id*
after a connection error, as a real client would after an unknown outcome, until it is
acknowledged or refused by the domain. While they run, the cluster is restarted with
``-m immediate`` several times, each once the writers have made progress since the
last one (waits are for events, with generous timeouts).

Checked afterwards, against the acknowledgements the clients got:

* every acknowledged command is stored once (one ``commands`` row, its events exactly
  once at the versions it reported) — nothing acknowledged is lost or doubled;
* none is half-applied: every ``commands`` row has all its events, every event belongs
  to a recorded command, every claim to a recorded command; versions are dense;
* refused commands stored nothing.

2 restarts in ``make test``; 10 with ``TIDELINE_SOAK=1``.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from commands_util import rows
from readiness import patience

import migrations
from commands.errors import CommandsError, DomainError
from commands.handler import CommandHandler, HandlerConfig
from examples.reservations.domain import RESERVATION, USER, CancelReservation, ChangeSeat, RegisterUser, ReserveSeat
from tideline.pgharness import LocalPostgres
from tideline.reliability import record_fault_result

SOAK = os.environ.get("TIDELINE_SOAK") == "1"
WRITERS = 8
RESTARTS = 10 if SOAK else 2
COMMANDS_PER_WRITER = 500 if SOAK else 150
PROGRESS_BETWEEN_RESTARTS = 40  # acknowledged commands (all writers) before the next restart
WAIT_S = 180.0
SHOW = "hamlet"
SEATS = [f"S{n}" for n in range(WRITERS * COMMANDS_PER_WRITER // 2)]  # some claims collide, most not
CONNECTION_ERRORS = (psycopg.OperationalError, sqlalchemy.exc.OperationalError, sqlalchemy.exc.DBAPIError)


@pytest.fixture(scope="module")
def cluster(_no_ambient_postgres: None) -> Iterator[LocalPostgres]:
    """A private cluster this module may crash (the session's is shared by other tests)."""
    directory = Path(tempfile.mkdtemp(prefix="tideline-pg-restart-"))
    pg = LocalPostgres(directory / "cluster", fast=True)  # fast: fsync off is fine, the OS does not crash
    try:
        pg.start()
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(directory, ignore_errors=True)


def next_command(rng: random.Random, n: int, i: int, mine: list[str]) -> tuple[Any, Any]:
    roll = rng.random()
    if roll < 0.35 or not mine:
        return RESERVATION, ReserveSeat(f"w{n}-r{i}", SHOW, rng.choice(SEATS), f"cust{n}")
    if roll < 0.7:
        target = rng.choice([*mine[-3:], "shared"])
        return RESERVATION, ChangeSeat(target, rng.choice(SEATS))
    if roll < 0.85:
        return RESERVATION, CancelReservation(rng.choice(mine))
    return USER, RegisterUser(f"w{n}-u{i}", f"user{rng.randrange(60)}")


def writer(dsn: str, n: int, progress: Any, out: Any) -> None:
    """Handle COMMANDS_PER_WRITER commands, retrying each (same id) through connection errors."""
    rng = random.Random(n)
    outcomes = []
    connection_errors = 0
    mine: list[str] = []
    with CommandHandler(dsn, HandlerConfig(max_attempts=50, snapshot_every=4, pool_size=1)) as handler:
        for i in range(COMMANDS_PER_WRITER):
            aggregate, command = next_command(rng, n, i, mine)
            command_id = f"w{n}-c{i}"
            deadline = time.monotonic() + WAIT_S
            while True:
                try:
                    r = handler.handle(aggregate, command, command_id=command_id)
                    outcomes.append((command_id, "accepted", r.stream_id, r.version, list(r.events), r.replayed))
                    if isinstance(command, ReserveSeat):
                        mine.append(command.reservation_id)
                    break
                except (DomainError, CommandsError) as e:
                    outcomes.append((command_id, type(e).__name__, aggregate.stream_id(command), 0, [], False))
                    break
                except CONNECTION_ERRORS:
                    connection_errors += 1
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)  # the server is restarting: try the same command id again
            with progress.get_lock():
                progress.value += 1
    out.put((outcomes, connection_errors))


def test_immediate_restarts_under_8_writers_lose_and_double_nothing(cluster: LocalPostgres) -> None:
    dsn = cluster.create_database("restart_commands")
    migrations.upgrade(dsn)
    with CommandHandler(dsn) as setup:
        setup.handle(RESERVATION, ReserveSeat("shared", SHOW, "Z1", "setup"), command_id="setup")
    ctx = multiprocessing.get_context("fork")
    progress = ctx.Value("i", 0)
    out = ctx.Queue()
    procs = [ctx.Process(target=writer, args=(dsn, n, progress, out)) for n in range(WRITERS)]
    for p in procs:
        p.start()
    recoveries: list[float] = []
    restarts = 0
    try:
        for _ in range(RESTARTS):
            target = progress.value + PROGRESS_BETWEEN_RESTARTS
            wait_until(lambda target=target: progress.value >= target, "the writers to make progress")
            if progress.value >= WRITERS * COMMANDS_PER_WRITER - PROGRESS_BETWEEN_RESTARTS:
                break  # too close to the end for the restart to land among the writers
            before = progress.value
            started = time.monotonic()
            assert cluster.restart("immediate") == dsn.rsplit("/", 1)[0] + "/postgres", "the port changed"
            restarts += 1
            wait_until(lambda before=before: progress.value > before, "a command acknowledged after the restart")
            recoveries.append(time.monotonic() - started)
        results = [out.get(timeout=WAIT_S * 2) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert restarts >= 1, "no restart landed among the writers: raise COMMANDS_PER_WRITER"
    outcomes = [o for r, _ in results for o in r]
    connection_errors = sum(e for _, e in results)
    assert connection_errors > 0, "the restarts did not reach the writers"
    lost, doubled = check_stored(dsn, outcomes)
    kinds = Counter(kind for _, kind, *_ in outcomes)
    assert kinds["accepted"] > len(outcomes) // 3, kinds
    print(f"\n{restarts} restarts, {connection_errors} connection errors retried, outcomes {dict(kinds)}")
    record_fault_result(
        "commands: Postgres restart",
        f"pg_ctl restart -m immediate under {WRITERS} concurrent command writers (clients retry with the same "
        "command id)",
        injected=restarts,
        survived=restarts,
        records_lost=lost,
        duplicates=doubled,
        recover_seconds=recoveries,
        detail=f"{kinds['accepted']} commands acknowledged, {connection_errors} connection errors retried; "
        "recovery = restart begun → next command acknowledged",
    )


def wait_until(condition: Any, what: str) -> None:
    limit = patience(WAIT_S)
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {limit:.0f} s waiting for {what}"
        time.sleep(0.02)


def check_stored(dsn: str, outcomes: list[tuple[Any, ...]]) -> tuple[int, int]:
    """The checks of the module docstring; returns (acknowledged commands lost, stored twice) — both 0."""
    events: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for command_id, stream_id, version, event_type in rows(
        dsn, "SELECT metadata->>'command_id', stream_id, version, event_type FROM events ORDER BY id"
    ):
        events[command_id].append((stream_id, version, event_type))
    commands = {
        cid: (sid, result) for cid, sid, result in rows(dsn, "SELECT command_id, stream_id, result FROM commands")
    }
    lost = doubled = 0
    for command_id, kind, stream_id, version, event_types, _ in outcomes:
        stored = events.get(command_id, [])
        if kind != "accepted":
            assert not stored and command_id not in commands, f"refused command {command_id} ({kind}) stored {stored}"
            continue
        want = [
            (stream_id, v, t)
            for v, t in zip(range(version - len(event_types) + 1, version + 1), event_types, strict=True)
        ]
        lost += command_id not in commands or len(stored) < len(want)
        doubled += len(stored) > len(want)
        assert stored == want, f"acknowledged command {command_id}: stored {stored}, acknowledged {want}"
        assert commands[command_id][0] == stream_id
    # none half-applied: rows and events agree both ways; claims belong to recorded commands
    for command_id, (_, result) in commands.items():
        got = [t for _, _, t in events.get(command_id, [])]
        assert got == result["events"], f"command {command_id} recorded {result['events']}, events {got}"
    assert set(events) <= set(commands), f"events without a command row: {sorted(set(events) - set(commands))[:5]}"
    claims = rows(dsn, "SELECT command_id FROM claims")
    assert all(cid in commands for (cid,) in claims), "a claim of an unrecorded command"
    versions: dict[str, list[int]] = defaultdict(list)
    for stream_id, version in rows(dsn, "SELECT stream_id, version FROM events ORDER BY stream_id, version"):
        versions[stream_id].append(version)
    for stream_id, vs in versions.items():
        assert vs == list(range(1, len(vs) + 1)), f"{stream_id}: versions {vs} are not dense"
    return lost, doubled
