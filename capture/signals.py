"""Signals: commands to a running connector, written as rows of a table it watches through the WAL.

This is Debezium's source signaling channel (``signal.data.collection``): a row inserted
into the **signal table** reaches the connector through the replication stream, at its
place among the other changes, and the connector acts on it there. It works while the
connector runs and while it is down (the slot keeps the row's WAL until it is read).

Table (created by the connector at start when missing; name ``--signal-table``, default
:data:`DEFAULT_SIGNAL_TABLE`)::

    CREATE TABLE public.tideline_signal (id text PRIMARY KEY, type text NOT NULL, data text)

Only INSERTs are signals (updates and deletes of the table are ignored, as Debezium does).
``type`` and ``data`` (JSON, Debezium's format; null or ``{}`` where nothing is needed):

* ``execute-snapshot`` — ``{"data-collections": ["schema.table", …], "type": "incremental",
  "additional-conditions": [{"data-collection": "schema.table", "filter": "<SQL condition>"}],
  "chunk-size": N}``; ``chunk-size`` is a Tideline extension (default: the connector's
  ``--incremental-chunk-size``, 1024 like Debezium's ``incremental.snapshot.chunk.size``);
* ``pause-snapshot``, ``resume-snapshot`` — no data;
* ``stop-snapshot`` — ``{"data-collections": [...]}`` (optional: without it, the whole snapshot stops).

The signal table itself is never captured as a table (its rows are commands, not data).

Crash policy: what a signal changes (capture.incremental) is stored with the position of
the transaction that inserted it, atomically; a restart that re-reads the transaction from
the slot skips it as stored, so each signal is acted on once. A malformed signal is logged
(naming its id and what is wrong) and ignored: a typo must not stop capture.

Thread-safety: the functions open their own connections; nothing is shared.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
from psycopg import sql

from capture.messages import ChangeMessage
from eventstore.errors import ConfigError

DEFAULT_SIGNAL_TABLE = "public.tideline_signal"


class SignalType(enum.Enum):
    EXECUTE_SNAPSHOT = "execute-snapshot"
    PAUSE_SNAPSHOT = "pause-snapshot"
    RESUME_SNAPSHOT = "resume-snapshot"
    STOP_SNAPSHOT = "stop-snapshot"


class SignalError(ValueError):
    """A signal row that cannot be acted on (the connector logs it and goes on)."""


@dataclass(frozen=True, slots=True)
class Signal:
    """One signal, as its row says."""

    id: str
    type: SignalType
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def tables(self) -> list[str]:
        """``data-collections``: the tables the signal is about (empty: none named)."""
        names = self.data.get("data-collections") or []
        if not isinstance(names, list) or not all(isinstance(n, str) and n.count(".") == 1 for n in names):
            raise SignalError(f"signal {self.id}: data-collections must be a list of schema.table, not {names!r}")
        return names

    @property
    def filters(self) -> dict[str, str]:
        """``additional-conditions``: table → SQL condition."""
        out: dict[str, str] = {}
        for item in self.data.get("additional-conditions") or []:
            if (
                not isinstance(item, dict)
                or not isinstance(item.get("data-collection"), str)
                or not isinstance(item.get("filter"), str)
            ):
                raise SignalError(
                    f"signal {self.id}: additional-conditions items are "
                    f'{{"data-collection": "schema.table", "filter": "SQL"}}, not {item!r}'
                )
            out[item["data-collection"]] = item["filter"]
        return out

    @property
    def chunk_size(self) -> int | None:
        size = self.data.get("chunk-size")
        if size is None:
            return None
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise SignalError(f"signal {self.id}: chunk-size must be a positive integer, not {size!r}")
        return size


def split_table_name(name: str) -> tuple[str, str]:
    """``schema.table`` → (schema, table); anything else raises ConfigError naming it."""
    schema, dot, table = name.partition(".")
    if not dot or not schema or not table or "." in table:
        raise ConfigError(f"signal table {name!r}: write it as schema.table (e.g. {DEFAULT_SIGNAL_TABLE})")
    return schema, table


def ensure_signal_table(dsn: str, name: str) -> bool:
    """Create the signal table when it is missing; True when it was created."""
    schema, table = split_table_name(name)
    ident = sql.Identifier(schema, table)
    with psycopg.connect(dsn, autocommit=True) as c:
        if c.execute("SELECT to_regclass(%s)", (str(ident.as_string(c)),)).fetchone() not in (None, (None,)):
            return False
        try:
            c.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (id text PRIMARY KEY, type text NOT NULL, data text)")
                      .format(ident))  # fmt: skip
        except psycopg.errors.InvalidSchemaName:
            raise ConfigError(
                f"signal table {name}: schema {schema} does not exist; create it or choose another --signal-table"
            ) from None
        return True


def send_signal(dsn: str, name: str, signal_type: SignalType, data: dict[str, Any] | None = None) -> str:
    """Insert one signal row; returns its id. The table must exist (the connector creates it)."""
    schema, table = split_table_name(name)
    ident = sql.Identifier(schema, table)
    signal_id = uuid.uuid4().hex
    with psycopg.connect(dsn, autocommit=True) as c:
        if c.execute("SELECT to_regclass(%s)", (str(ident.as_string(c)),)).fetchone() in (None, (None,)):
            raise ConfigError(
                f"signal table {name} does not exist in this database: start the connector once (it creates it), "
                "with the same --signal-table"
            )
        c.execute(sql.SQL("INSERT INTO {} (id, type, data) VALUES (%s, %s, %s)").format(ident),
                  (signal_id, signal_type.value, None if data is None else orjson.dumps(data).decode()))  # fmt: skip
    return signal_id


def signal_from_insert(m: ChangeMessage) -> Signal:
    """The signal an INSERT into the signal table carries; raises SignalError naming what is wrong."""
    row = {c.name: c.value for c in m.columns}
    signal_id = row.get("id")
    if not isinstance(signal_id, str):
        raise SignalError(f"signal row without a text id: {row!r}")
    try:
        signal_type = SignalType(row.get("type"))
    except ValueError:
        known = ", ".join(t.value for t in SignalType)
        raise SignalError(f"signal {signal_id}: unknown type {row.get('type')!r} (known: {known})") from None
    raw = row.get("data")
    if raw is None or raw == "":
        return Signal(signal_id, signal_type, {})
    try:
        data = orjson.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except orjson.JSONDecodeError as e:
        raise SignalError(f"signal {signal_id}: data is not JSON ({e}): {str(raw)[:200]!r}") from None
    if not isinstance(data, dict):
        raise SignalError(f"signal {signal_id}: data must be a JSON object, not {str(raw)[:200]!r}")
    return Signal(signal_id, signal_type, data)
