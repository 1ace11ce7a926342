"""What the console tests watch: a migrated database with a keyed and a keyless table, captured for real."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass

import psycopg

from capture.connector import CaptureConfig, Connector, Stats
from capture.sinks import Sink
from capture.tables import TableFilter
from eventstore.log import Log
from examples.reservations import models as example
from tideline.pgharness import LocalPostgres

PREFIX = "cdc"
TABLES = ("public.orders", "public.notes")
ORDERS_TOPIC = f"{PREFIX}.public.orders"
_databases = itertools.count()


@dataclass(frozen=True)
class Watched:
    """A source database and its connector's slot (slots are cluster-wide: one name per database)."""

    dsn: str
    slot: str

    def capture_config(self, **kw: object) -> CaptureConfig:
        return CaptureConfig(dsn=self.dsn, slot=self.slot, topic_prefix=PREFIX,
                             table_filter=TableFilter(include=list(TABLES)), **kw)  # type: ignore[arg-type]  # fmt: skip

    def capture_once(self, *, log: Log | None = None, sink: Sink | None = None) -> Stats:
        """Run the connector until everything in the WAL when it started is stored."""
        return Connector(self.capture_config(exit_when_caught_up=True), log, sink=sink).run()

    def insert_orders(self, first: int, n: int) -> None:
        """Orders ``first … first + n − 1`` in one transaction."""
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("INSERT INTO orders SELECT g, g * 1.25 FROM generate_series(%s::int, %s::int) g",
                      (first, first + n - 1))  # fmt: skip

    def drop_slot(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                      (self.slot,))  # fmt: skip

    def tideline_args(self) -> list[str]:
        """The options that name this connector, for ``capture status`` and ``console``."""
        return ["--dsn", self.dsn, "--slot", self.slot, "--topic-prefix", PREFIX, "--tables", ",".join(TABLES)]


def watched_database(postgres: LocalPostgres, *, orders: int = 50) -> Watched:
    """A fresh database with Tideline's tables (projections' checkpoints), ``orders`` (keyed, ``orders``
    rows) and ``notes`` (no key: a keyless-table warning)."""
    name = f"console_{next(_databases)}_{uuid.uuid4().hex[:6]}"
    dsn = postgres.create_database(name)
    example.upgrade(dsn)  # Tideline's branch and the example's (its view tables)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id int PRIMARY KEY, total numeric(12,2) NOT NULL)")
        c.execute("CREATE TABLE notes (body text)")
        c.execute("INSERT INTO notes VALUES ('no key here')")
    watched = Watched(dsn, name)
    watched.insert_orders(0, orders)
    return watched
