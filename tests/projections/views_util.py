"""Helpers for the read-view tests: a migrated database, random workloads (commands of the
reservations example and plain SQL on a CDC-captured table), and running the real capture."""

from __future__ import annotations

import itertools
import os
import random
import uuid
from pathlib import Path
from typing import Any

import psycopg

from capture.connector import CaptureConfig, Connector, Stats
from capture.tables import TableFilter
from commands.errors import DomainError, DuplicateClaimError
from commands.handler import CommandHandler, HandlerConfig
from eventstore.log import Log
from eventstore.producer import Producer
from examples.reservations import models as example
from examples.reservations.domain import RESERVATION, USER, CancelReservation, ChangeSeat, RegisterUser, ReserveSeat
from tideline.pgharness import LocalPostgres

_counter = itertools.count()
ACCOUNTS_TOPIC = "cdc.public.accounts"
CAPTURED = TableFilter(include=["public.events", "public.accounts"])


def soak() -> bool:
    return os.environ.get("TIDELINE_SOAK") == "1"


def migrated_database(postgres: LocalPostgres, tag: str) -> str:
    dsn = postgres.create_database(f"views_{tag}_{next(_counter)}_{uuid.uuid4().hex[:6]}")
    example.upgrade(dsn)  # Tideline's branch and the example's (its view tables)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE accounts (id int PRIMARY KEY, owner text NOT NULL, balance numeric NOT NULL)")
    return dsn


def leftovers(dsn: str) -> list[str]:
    """Staging and shadow tables still in the database."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            r"SELECT relname FROM pg_class WHERE relkind = 'r' AND (relname LIKE '%\_\_staging' "
            r"OR relname LIKE '%\_\_shadow')"
        ).fetchall()
    return sorted(r[0] for r in rows)


def drop_slots(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database()"
        )


# A command's commit_lsn is the WAL insert position read after its COMMIT; when other WAL (a
# checkpoint, a running-xacts record) lands in between, the captured position passes it only with
# the next captured transaction. A running capture in a test emits one every half second, as
# docs/operations.md tells operators of quiet sources (see projections.consistency, "Liveness").
HEARTBEAT: dict[str, Any] = {
    "heartbeat_query": "SELECT pg_logical_emit_message(false, 'tideline-heartbeat', now()::text)",
    "heartbeat_interval_s": 0.5,
}


def capture_config(dsn: str, **kw: Any) -> CaptureConfig:
    return CaptureConfig(
        dsn=dsn,
        slot="views",
        topic_prefix="cdc",
        table_filter=CAPTURED,
        outbox_table="public.events",
        partitions=2,
        **kw,
    )


def capture(log_dir: Path, dsn: str) -> Stats:
    """Run the connector until everything in the WAL when it started is in the log."""
    with Log(log_dir) as log:
        return Connector(capture_config(dsn, exit_when_caught_up=True), log).run()


def issue_commands(dsn: str, n: int, rng: random.Random, tag: str) -> int:
    """Registrations (some duplicate usernames: refused), reservations, seat changes and
    cancellations over few shows and seats (many refused: taken); the number accepted."""
    accepted = 0
    with CommandHandler(dsn, HandlerConfig(snapshot_every=None)) as handler:
        for i in range(n):
            r = f"r{rng.randrange(max(3, n // 3))}"
            seat = f"A{rng.randrange(1, 16)}"
            show = f"show{rng.randrange(3)}"
            command: Any
            aggregate: Any = RESERVATION
            choice = rng.random()
            if choice < 0.25:
                aggregate, command = USER, RegisterUser(f"{tag}{i}", f"user_{rng.randrange(2 * n)}")
            elif choice < 0.6:
                command = ReserveSeat(r, show, seat, f"c{rng.randrange(9)}")
            elif choice < 0.8:
                command = ChangeSeat(r, seat)
            else:
                command = CancelReservation(r)
            try:
                handler.handle(aggregate, command)
                accepted += 1
            except (DomainError, DuplicateClaimError):
                continue
    return accepted


def change_accounts(dsn: str, n: int, rng: random.Random) -> None:
    """Inserts, updates, deletes, primary-key changes and (rarely) a truncate on ``accounts``."""
    with psycopg.connect(dsn, autocommit=True) as c:
        for _ in range(n):
            k = rng.randrange(40)
            choice = rng.random()
            if choice < 0.4:
                c.execute(
                    "INSERT INTO accounts VALUES (%s, %s, %s) "
                    "ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance",
                    (k, f"o{k}", rng.randrange(10**6) / 100),
                )
            elif choice < 0.65:
                c.execute("UPDATE accounts SET balance = balance + 1.25 WHERE id = %s", (k,))
            elif choice < 0.85:
                c.execute("DELETE FROM accounts WHERE id = %s", (k,))
            elif choice < 0.98:
                c.execute(
                    "UPDATE accounts SET id = %s WHERE id = %s AND NOT EXISTS (SELECT 1 FROM accounts WHERE id = %s)",
                    (k + 100, k, k + 100),
                )
            else:
                c.execute("TRUNCATE accounts")


GOOD = (
    b'{"stream_id":"user-%d","stream_type":"user","version":1,"event_type":"UserRegistered","schema_version":2,'
    b'"payload":{"user_id":"%d","username":"name%d","display_name":"N"},"recorded_at":"2026-01-01T00:00:00+00:00",'
    b'"source":{"commit_lsn":%d,"event_index":0}}'
)
POISON = (  # a UserRegistered without its username: the aggregate's registry cannot decode it
    b'{"stream_id":"user-9","stream_type":"user","version":1,"event_type":"UserRegistered","schema_version":2,'
    b'"payload":{"user_id":"9"},"recorded_at":"2026-01-01T00:00:00+00:00","source":{"commit_lsn":900,"event_index":0}}'
)


def poisoned_log(log_dir: Path, good: int) -> None:
    """``good`` valid registrations, then one event the fold cannot take, in events.user[0]."""
    with Log(log_dir) as log:
        log.create_topic("events.user", partitions=1)
        with Producer(log) as producer:
            values = [GOOD % (i, i, i, 100 + i) for i in range(good)]
            producer.send_batch("events.user", values, [f"user-{i}".encode() for i in range(good)])
            producer.send_batch("events.user", [POISON], [b"user-9"])
