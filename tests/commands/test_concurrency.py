"""Processes racing on the same aggregates and claims: no lost update, no duplicate claim,
every accepted command's events exactly once, retries bounded; concurrent repeats of one
command id append once."""

from __future__ import annotations

import multiprocessing
import random
from collections import Counter, defaultdict
from multiprocessing.synchronize import Barrier
from typing import Any

import pytest
from commands_util import rows
from readiness import patience

from commands.errors import CommandsError
from commands.handler import CommandHandler, HandlerConfig
from examples.reservations.domain import (
    RESERVATION,
    USER,
    CancelReservation,
    ChangeSeat,
    RegisterUser,
    ReservationCancelled,
    ReserveSeat,
    SeatChanged,
    SeatReserved,
    UserRegistered,
)

PROCESSES = 4
COMMANDS_PER_PROCESS = 40
MAX_ATTEMPTS = 20
SHOW = "hamlet"
SEATS = [f"A{n}" for n in range(1, 13)]
SHARED = ["r0", "r1", "r2"]  # reservations every process changes
USERNAMES = ["ann", "ben", "cat", "dan", "eve"]
HOT_BURST = 15  # each process's first commands all change SHARED[0]
ROUNDS_AT_MOST = 4  # the racing workload runs again until the races happened (see the test)


def worker(dsn: str, round_: int, n: int, barrier: Barrier, out: Any) -> None:
    rng = random.Random(n + 100 * round_)
    outcomes = []
    with CommandHandler(dsn, HandlerConfig(max_attempts=MAX_ATTEMPTS, snapshot_every=3, pool_size=1)) as handler:
        barrier.wait()
        mine: list[str] = []
        for i in range(COMMANDS_PER_PROCESS):
            command_id = f"p{n}-c{i}-{round_}"
            roll = rng.random()
            if i < HOT_BURST:  # all processes on one stream at once: version conflicts
                aggregate: Any = RESERVATION
                command: Any = ChangeSeat(SHARED[0], rng.choice(SEATS))
            elif roll < 0.45:
                aggregate = RESERVATION
                command = ChangeSeat(rng.choice(SHARED + mine[-2:]), rng.choice(SEATS))
            elif roll < 0.7:
                reservation = f"p{n}-r{i}-{round_}"
                aggregate, command = RESERVATION, ReserveSeat(reservation, SHOW, rng.choice(SEATS), f"cust{n}")
            elif roll < 0.85 and mine:
                aggregate, command = RESERVATION, CancelReservation(rng.choice(mine))
            else:
                aggregate, command = USER, RegisterUser(f"p{n}-u{i}-{round_}", rng.choice(USERNAMES))
            try:
                r = handler.handle(aggregate, command, command_id=command_id)
                outcomes.append((command_id, "accepted", r.stream_id, r.version, len(r.events), r.attempts))
                if isinstance(command, ReserveSeat):
                    mine.append(command.reservation_id)
            except CommandsError as e:
                outcomes.append((command_id, type(e).__name__, aggregate.stream_id(command), 0, 0, 0))
    out.put(outcomes)


def run_processes(target: Any, *args: Any) -> list[Any]:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(PROCESSES)
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, n, barrier, out)) for n in range(PROCESSES)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=patience(120)) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [x for r in results for x in r]


def test_conflicting_commands_from_processes(dsn: str) -> None:
    with CommandHandler(dsn) as setup:
        for k, reservation_id in enumerate(SHARED):
            setup.handle(RESERVATION, ReserveSeat(reservation_id, SHOW, SEATS[k], "setup"))
    # The races must be real (on claims, and on versions: a retried attempt) for the checks below to mean
    # anything; whether they happen is up to the scheduler, so the workload runs again (new ids) until they did.
    outcomes: list[Any] = []
    for round_ in range(1, ROUNDS_AT_MOST + 1):
        outcomes += run_processes(worker, dsn, round_)
        kinds = Counter(kind for _, kind, *_ in outcomes)
        if kinds["DuplicateClaimError"] > 0 and any(attempts > 1 for *_, attempts in outcomes):
            break
    assert kinds["accepted"] >= round_ * PROCESSES * COMMANDS_PER_PROCESS // 4, kinds
    assert kinds["DuplicateClaimError"] > 0, kinds  # the races were real: on claims …
    assert any(attempts > 1 for *_, attempts in outcomes), f"no version conflict in {round_} rounds"  # … versions
    assert set(kinds) <= {
        "accepted", "DuplicateClaimError", "ValidationError", "ReservationNotActive", "ConcurrencyError"
    }, kinds  # fmt: skip

    # Every accepted command's events are stored exactly once, at the versions it reported;
    # refused commands stored nothing.
    stored = defaultdict(list)
    for command_id, stream_id, version in rows(
        dsn, "SELECT metadata->>'command_id', stream_id, version FROM events ORDER BY id"
    ):
        stored[command_id].append((stream_id, version))
    for command_id, kind, stream_id, version, n_events, attempts in outcomes:
        if kind == "accepted":
            assert stored[command_id] == [(stream_id, v) for v in range(version - n_events + 1, version + 1)]
            assert 1 <= attempts <= MAX_ATTEMPTS
        else:
            assert stored[command_id] == [], (command_id, kind)

    # Versions are dense per stream, and each decision was made on the state it extended
    # (a lost update would show as a SeatChanged whose from_seat is not the seat held then).
    streams: dict[str, list[Any]] = defaultdict(list)
    for stream_id, version, event_type, schema_version, payload in rows(
        dsn, "SELECT stream_id, version, event_type, schema_version, payload FROM events ORDER BY stream_id, version"
    ):
        streams[stream_id].append((version, RESERVATION.events.decode(event_type, schema_version, payload)))
    held: dict[str, str] = {}
    usernames: dict[str, str] = {}
    for stream_id, events in streams.items():
        assert [v for v, _ in events] == list(range(1, len(events) + 1)), stream_id
        seat = None
        for _, event in events:
            if isinstance(event, SeatReserved):
                assert seat is None
                seat = event.seat
            elif isinstance(event, SeatChanged):
                assert event.from_seat == seat, f"lost update in {stream_id}: {event} after seat {seat}"
                seat = event.to_seat
            elif isinstance(event, ReservationCancelled):
                assert event.seat == seat
                seat = None
            elif isinstance(event, UserRegistered):
                assert len(events) == 1
                assert event.username not in usernames, f"username {event.username} registered twice"
                usernames[event.username] = stream_id
        if seat is not None:
            assert f"{SHOW}/{seat}" not in held, f"seat {seat} held by {held[f'{SHOW}/{seat}']} and {stream_id}"
            held[f"{SHOW}/{seat}"] = stream_id
    assert dict(rows(dsn, "SELECT value, stream_id FROM claims WHERE claim_type = 'seat'")) == held
    assert dict(rows(dsn, "SELECT value, stream_id FROM claims WHERE claim_type = 'username'")) == usernames
    with CommandHandler(dsn, HandlerConfig(use_snapshots=False)) as full, CommandHandler(dsn) as snap:
        for stream_id in SHARED:
            assert full.load(RESERVATION, f"reservation-{stream_id}") == snap.load(
                RESERVATION, f"reservation-{stream_id}"
            )


def repeat_worker(dsn: str, command: Any, n: int, barrier: Barrier, out: Any) -> None:
    with CommandHandler(dsn, HandlerConfig(snapshot_every=None, pool_size=1)) as handler:
        barrier.wait()
        results = []
        for _ in range(3):
            r = handler.handle(RESERVATION, command, command_id="the-one")
            results.append((r.stream_id, r.version, r.events, r.replayed))
    out.put(results)


@pytest.mark.parametrize("setup", [False, True], ids=["reserve", "change-seat"])
def test_same_command_id_sent_concurrently_appends_once(dsn: str, setup: bool) -> None:
    if setup:
        with CommandHandler(dsn) as h:
            h.handle(RESERVATION, ReserveSeat("r1", SHOW, "A1", "alice"))
        command: Any = ChangeSeat("r1", "B2")  # each fresh decide would append another SeatChanged
    else:
        command = ReserveSeat("r1", SHOW, "A1", "alice")
    results = run_processes(repeat_worker, dsn, command)
    expected_version = 2 if setup else 1
    assert {(s, v, e) for s, v, e, _ in results} == {("reservation-r1", expected_version, (type(command).__name__,
        ) and ("SeatChanged",) if setup else ("SeatReserved",))}  # fmt: skip
    assert sum(1 for *_, replayed in results if not replayed) == 1
    assert rows(dsn, "SELECT count(*) FROM events WHERE metadata->>'command_id' = 'the-one'") == [(1,)]
    assert rows(dsn, "SELECT count(*) FROM commands") == [(2 if setup else 1,)]
