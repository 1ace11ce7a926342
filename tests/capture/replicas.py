"""A primary and its hot standby (tideline.pgharness) for the failover and standby-decoding tests, a workload
that writes through a two-host DSN, and what those tests compare."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import psycopg
from capture_util import latest_by_key, records

from tideline.pgharness import LocalPostgres

TABLE = "CREATE TABLE acct (id int PRIMARY KEY, balance bigint NOT NULL, touched int NOT NULL DEFAULT 0)"
TOPIC = "cdc.public.acct"  # its topic, with the tests' prefix


@dataclass
class Pair:
    primary: LocalPostgres
    standby: LocalPostgres
    db: str

    def dsn(self) -> str:
        """Both hosts; libpq takes the one that accepts writes."""
        ports = [self.primary.status().port, self.standby.status().port]
        hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
        return f"postgresql://postgres@{hosts}/{self.db}?target_session_attrs=read-write&connect_timeout=2"


@dataclass
class Writer:
    """Inserts and updates through the two-host DSN until stopped; a failed statement is retried on a new
    connection (the primary died: the next one that accepts writes takes it)."""

    dsn: str
    stop: threading.Event = field(default_factory=threading.Event)
    next_id: int = 1
    failures: int = 0
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn: psycopg.Connection[object] | None = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, autocommit=True)
                i = self.next_id
                with conn.transaction():
                    conn.execute("INSERT INTO acct (id, balance) VALUES (%s, %s) ON CONFLICT (id) DO NOTHING", (i, i))
                    conn.execute("UPDATE acct SET balance = balance + 1, touched = touched + 1 WHERE id = %s",
                                 (max(1, i // 2),))  # fmt: skip
                self.next_id += 1
                time.sleep(0.01)
            except psycopg.OperationalError:
                self.failures += 1
                conn = None
                time.sleep(0.1)

    def finish(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(60)


def synced_slot_ready(standby: LocalPostgres, db: str, slot: str) -> bool:
    """The standby holds a persistent synchronized copy of the slot (a temporary one is dropped at promotion)."""
    with psycopg.connect(standby.dsn_for(db)) as c:
        row = c.execute("SELECT synced, temporary FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return row is not None and bool(row[0]) and not row[1]


def table_rows(dsn: str) -> dict[int, dict[str, int]]:
    with psycopg.connect(dsn) as c:
        return {r[0]: {"id": r[0], "balance": r[1], "touched": r[2]} for r in c.execute("SELECT * FROM acct")}


def assert_log_is_table(log_dir: Path, dsn: str) -> int:
    """The log's latest value per key of ``acct`` equals ``SELECT *`` at ``dsn``, and every row was created (read
    or inserted) once, deleted ones included: nothing lost, nothing twice. Returns the row count."""
    expected = table_rows(dsn)
    logged = {orjson.loads(key)["id"]: after for key, after in latest_by_key(log_dir, TOPIC).items()}
    assert logged == expected
    creates: dict[int, int] = {}
    for key, value, _ in records(log_dir, TOPIC):
        if value is not None and value["op"] in ("c", "r"):
            creates[key["id"]] = creates.get(key["id"], 0) + 1
    assert set(expected) <= set(creates) and set(creates.values()) == {1}, creates  # deleted rows were created too
    return len(expected)
