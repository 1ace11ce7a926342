"""Helpers for the tests of the ``userapp`` views (tests/projections/userapp/): a database with
Tideline's tables and the app's own, and a log of the app's events and of a CDC topic, written
straight into the embedded log (what capture would write: outbox events, Debezium envelopes)."""

from __future__ import annotations

import itertools
import random
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import psycopg
from userapp.views import DDL

import migrations
from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.producer import Producer
from tideline.pgharness import LocalPostgres

ACCOUNT_TOPIC = "events.ua_account"
CDC_TOPIC = "ua.cdc.public.things"
MIRROR = f"mirror:{CDC_TOPIC}"
_counter = itertools.count()


def user_database(postgres: LocalPostgres, tag: str) -> str:
    """A fresh database with Tideline's tables (``migrations.upgrade``) and the app's (:data:`DDL`)."""
    dsn = postgres.create_database(f"ua_{tag}_{next(_counter)}_{uuid.uuid4().hex[:6]}")
    migrations.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
    return dsn


@dataclass
class AppLog:
    """Writes the app's events (random opens, deposits, withdrawals) and CDC changes of a ``things``
    table (inserts, updates, deletes with their tombstones) into the embedded log at ``path``;
    each :meth:`write` continues the streams and the LSNs of the last."""

    path: Path
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    versions: dict[str, int] = field(default_factory=dict)  # account id → last version
    balances: dict[str, int] = field(default_factory=dict)
    opened: list[str] = field(default_factory=list)  # the accounts of ``balances``, in the order opened
    things: set[int] = field(default_factory=set)
    lsn: int = 1000
    records: int = 0  # written so far (events, changes and tombstones)

    def write(self, events: int, changes: int = 0) -> None:
        with Log(self.path, fsync=FsyncPolicy(FsyncMode.NONE)) as log:
            existing = set(log.topics())
            for topic in (ACCOUNT_TOPIC, CDC_TOPIC):
                if topic not in existing:
                    log.create_topic(topic, partitions=2)
            with Producer(log) as producer:
                keys, values = self._events(events)
                for start in range(0, len(values), 500):
                    producer.send_batch(ACCOUNT_TOPIC, values[start : start + 500], keys[start : start + 500])
                keys, changed = self._changes(changes)
                if changed:
                    producer.send_batch(CDC_TOPIC, changed, keys)
        self.records += events + len(changed)

    def _event(self, account: str, event_type: str, payload: dict[str, object]) -> tuple[bytes, bytes]:
        version = self.versions.get(account, 0) + 1
        self.versions[account] = version
        self.lsn += self.rng.randrange(1, 50)
        stream = f"ua_account-{account}"
        value = {
            "stream_id": stream,
            "stream_type": "ua_account",
            "version": version,
            "event_type": event_type,
            "schema_version": 1,
            "payload": payload,
            "recorded_at": (datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=self.lsn)).isoformat(),
            "source": {"commit_lsn": self.lsn, "event_index": 0},
        }
        return stream.encode(), orjson.dumps(value)

    def _events(self, n: int) -> tuple[list[bytes], list[bytes | None]]:
        keys: list[bytes] = []
        values: list[bytes | None] = []
        for _ in range(n):
            if not self.opened or self.rng.random() < 0.15:
                account = f"a{len(self.versions)}"
                key, value = self._event(
                    account, "AccountOpened", {"account_id": account, "owner": f"o{self.rng.randrange(7)}",
                                               "handle": f"h_{account}"})  # fmt: skip
                self.balances[account] = 0
                self.opened.append(account)
            else:
                account = self.rng.choice(self.opened)
                amount = self.rng.randrange(1, 500)
                if self.rng.random() < 0.7 or self.balances[account] < amount:
                    key, value = self._event(account, "Deposited", {"account_id": account, "amount": amount})
                    self.balances[account] += amount
                else:
                    key, value = self._event(account, "Withdrawn", {"account_id": account, "amount": amount})
                    self.balances[account] -= amount
            keys.append(key)
            values.append(value)
        return keys, values

    def _changes(self, n: int) -> tuple[list[bytes], list[bytes | None]]:
        keys: list[bytes] = []
        values: list[bytes | None] = []
        for _ in range(n):
            thing = self.rng.randrange(30)
            key = orjson.dumps({"id": thing})
            self.lsn += self.rng.randrange(1, 50)
            source = {"commit_lsn": self.lsn, "event_index": 0}
            if thing in self.things and self.rng.random() < 0.3:
                before = {"id": thing}
                keys += [key, key]
                values += [orjson.dumps({"op": "d", "before": before, "after": None, "source": source}), None]
                self.things.discard(thing)
                continue
            op = "u" if thing in self.things else "c"
            after = {"id": thing, "name": f"n{self.rng.randrange(100)}", "price": "12345678901234567890.123456789"}
            keys.append(key)
            values.append(orjson.dumps({"op": op, "before": None, "after": after, "source": source}))
            self.things.add(thing)
        return keys, values


def named_parts(dsn: str, table: str) -> list[tuple[str, str]]:
    """``table``'s constraints and indexes as ``(kind, name)``, sorted."""
    with psycopg.connect(dsn) as conn:
        constraints = conn.execute(
            "SELECT 'constraint ' || CAST(contype AS text), conname FROM pg_constraint "
            "WHERE conrelid = CAST(%s AS regclass)",
            (table,),
        ).fetchall()
        indexes = conn.execute("SELECT 'index', indexname FROM pg_indexes WHERE tablename = %s", (table,)).fetchall()
    return sorted((str(k), str(n)) for k, n in [*constraints, *indexes])


def bookkeeping(dsn: str, projection: str) -> dict[str, object]:
    """What a rebuild records besides the view's rows: checkpoints, states, the run."""
    with psycopg.connect(dsn) as conn:
        checkpoints = conn.execute(
            "SELECT topic, partition, next_offset, commit_lsn FROM projection_checkpoints WHERE projection = %s "
            "ORDER BY topic, partition",
            (projection,),
        ).fetchall()
        states = conn.execute(
            "SELECT stream_id, version, commit_lsn, state FROM projection_state WHERE projection = %s "
            "ORDER BY stream_id",
            (projection,),
        ).fetchall()
        run = conn.execute(
            "SELECT mode, status, events, batches, reached_lsn, error FROM projection_runs WHERE projection = %s",
            (projection,),
        ).fetchone()
    return {"checkpoints": checkpoints, "states": states, "run": run}
