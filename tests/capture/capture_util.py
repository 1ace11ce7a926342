"""Helpers for capture tests: a fresh database per test, running the connector, reading topics."""

from __future__ import annotations

import itertools
import threading
import uuid
from pathlib import Path
from typing import Any, Self

import orjson
import psycopg

from capture.connector import CaptureConfig, Connector, SnapshotMode, SourcePosition, Stats
from capture.tables import TableFilter
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from tideline.pgharness import LocalPostgres

_counter = itertools.count()


class ConnectorThread:
    """A connector running in a thread (what it raises kept in ``errors``) for the length of a ``with`` block: the
    block's end stops it, waits for it and fails on its errors."""

    def __init__(self, log_dir: Path, config: CaptureConfig) -> None:
        self.config = config
        self.log = Log(log_dir)
        self.connector = Connector(config, self.log)
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="connector", daemon=True)

    def _run(self) -> None:
        try:
            self.connector.run()
        except BaseException as e:  # reported by __exit__ (and by the subclasses' waits)
            self.errors.append(e)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.connector.stop()
        self.thread.join(120)
        self.log.close()
        assert not self.thread.is_alive(), "the connector did not stop"
        assert not self.errors, self.errors


def fresh_database(postgres: LocalPostgres, tag: str) -> str:
    """A new database (slots are per database) and its DSN."""
    return postgres.create_database(f"cap_{tag}_{next(_counter)}_{uuid.uuid4().hex[:6]}")


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        for s in statements:
            c.execute(s.encode())


def drop_slots(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = current_database()"
        )


def capture(
    log_dir: Path,
    dsn: str,
    *,
    slot: str = "t",
    snapshot: SnapshotMode = SnapshotMode.INITIAL,
    table_filter: TableFilter | None = None,
    **kw: Any,
) -> Stats:
    """Run the connector until it has stored everything present in the WAL when it started."""
    config = CaptureConfig(
        dsn=dsn,
        slot=slot,
        topic_prefix="cdc",
        snapshot=snapshot,
        table_filter=table_filter or TableFilter(),
        exit_when_caught_up=True,
        **kw,
    )
    with Log(log_dir) as log:
        return Connector(config, log).run()


def run_connector(connector: Connector, errors: list[BaseException]) -> threading.Thread:
    """``connector.run()`` in a daemon thread (started); what it raises goes into ``errors``."""

    def target() -> None:
        try:
            connector.run()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def stored_position(log_dir: Path, dsn: str, slot: str = "t") -> SourcePosition | None:
    """The position the connector of ``slot`` (prefix ``cdc``) stored in the embedded log at ``log_dir``, as
    its restart finds it (read_committed); also while it runs: a test's sign that it has done real work."""
    with Log(log_dir) as log:
        return Connector(CaptureConfig(dsn=dsn, slot=slot, topic_prefix="cdc"), log).read_position()


def records(log_dir: Path, topic: str, isolation: str = "read_committed") -> list[tuple[Any, Any, dict[str, bytes]]]:
    """Every (key, value, headers) of a topic as parsed JSON (value None = tombstone), partition by partition."""
    out: list[tuple[Any, Any, dict[str, bytes]]] = []
    with Log(log_dir) as log:
        if topic not in log.topics():
            return out
        n = log.topic(topic).partitions
        with Consumer(log, isolation_level=isolation, enable_auto_commit=False) as consumer:
            consumer.assign([TopicPartition(topic, p) for p in range(n)])
            consumer.seek_to_beginning()
            while batch := consumer.poll(timeout_ms=0):
                for r in batch:
                    key = orjson.loads(r.key) if r.key is not None else None
                    value = orjson.loads(r.value) if r.value is not None else None
                    out.append((key, value, {k: v for k, v in r.headers if v is not None}))
    return out


def events(log_dir: Path, topic: str) -> list[dict[str, Any]]:
    """The change events (no tombstones) of a topic, in order."""
    return [v for _, v, _ in records(log_dir, topic) if v is not None]


def latest_by_key(log_dir: Path, topic: str) -> dict[bytes, Any]:
    """key (canonical JSON) → latest ``after`` image, tombstones and deletes removing the key."""
    state: dict[bytes, Any] = {}
    for key, value, _ in records(log_dir, topic):
        k = orjson.dumps(key, option=orjson.OPT_SORT_KEYS)
        if value is None or value.get("op") in ("d", "t"):
            state.pop(k, None)
        else:
            state[k] = value["after"]
    return state
