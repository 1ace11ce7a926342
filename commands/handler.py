"""Command handling: load, decide, append with optimistic concurrency, retry on conflict.

::

    handler = CommandHandler(dsn, HandlerConfig(snapshot_every=100))
    result = handler.handle(RESERVATION, ReserveSeat(...), command_id="c-42")
    result.version, result.commit_lsn

One attempt: load the stream's latest snapshot + later events and the command id's
record (one statement; for a stream whose state the handler has cached, only the events
after the cached version); if the command id was seen, return its stored result; else fold,
``decide``, and append the events at ``expected version + 1 …`` with the command record
and the claims, in one transaction. A version conflict (another writer took the next
version first) starts a new attempt from a fresh load, after a short random pause, up to
``max_attempts``; then :class:`ConcurrencyError`. ``decide``'s :class:`DomainError` and
:class:`DuplicateClaimError` end the command at once: nothing was written.

**State cache.** The handler keeps the latest states it folded or produced (``cache_size``
streams, least recently used out), as the ``eventsourcing`` library's aggregate cache
with fast-forward does: a cached state at version v is the fold of events 1…v, which
never change (the table is append-only), so it stays valid for ever; a command on a
cached stream reads only the events after v (none, unless another writer appended) and
folds them on. States must be immutable values (``apply`` returns new ones, as the fold
contract says): the cache hands the same object to every command.

Thread safety: a handler may be shared by threads (each thread keeps one connection of
the engine's pool; the cache has a lock). After ``fork()``, make a new handler in the child.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from psycopg import Connection
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection as SqlConnection
from sqlalchemy import Engine

from commands import store
from commands.aggregate import AggregateType, claim_changes
from commands.codec import from_json, to_json
from commands.db import make_engine
from commands.errors import CommandIdReusedError, ConcurrencyError, WrongExpectedVersionError
from commands.events import Event

log = logging.getLogger(__name__)

S = TypeVar("S")
C = TypeVar("C")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HandlerConfig:
    """How commands are handled.

    ``max_attempts``: loads + decides per command before ConcurrencyError (≥ 1).
    ``snapshot_every``: store a snapshot when a stream's version crosses a multiple of
    it (None: never). ``use_snapshots``: start folds from the latest snapshot.
    ``retry_pause_seconds``: before attempt n+1, sleep a random time up to n × this
    (spreads writers that collided so they do not collide again).
    ``pool_size``: connections the handler's engine keeps. ``pin_connections``: each
    thread keeps one connection checked out between commands (fastest; right for a few
    long-lived threads); off, every call checks one out of the pool (right for a web
    server's many short-lived threads). ``cache_size``: streams whose latest state the
    handler keeps in memory (0: none; see the module docstring).
    """

    max_attempts: int = 10
    snapshot_every: int | None = 100
    use_snapshots: bool = True
    retry_pause_seconds: float = 0.001
    pool_size: int = 5
    pin_connections: bool = True
    cache_size: int = 10_000

    def __post_init__(self) -> None:
        if self.cache_size < 0:
            raise ValueError(f"cache_size must be ≥ 0, not {self.cache_size}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be ≥ 1, not {self.max_attempts}")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be ≥ 1 or None, not {self.snapshot_every}")


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What an accepted command did."""

    command_id: str
    stream_id: str
    stream_type: str
    version: int  # the stream's version after the command (its last event's version)
    events: tuple[str, ...]  # event types appended, in order (empty: accepted, nothing to record)
    commit_lsn: str  # a WAL position past the commit: the read side has these events once it has applied it
    replayed: bool = False  # True: the command id was seen before; this is the stored result, nothing appended
    attempts: int = 1  # loads + decides it took (1 = no conflict)

    def to_json(self) -> dict[str, Any]:
        result = to_json(self)
        assert isinstance(result, dict)
        return result


@dataclass(frozen=True, slots=True)
class Loaded(Generic[T]):
    """An aggregate's state at ``version``."""

    state: T
    version: int


def new_command_id() -> str:
    """A fresh command id: a time-ordered UUID (version 7, RFC 9562: 48 bits of Unix
    milliseconds, then random bits), so the ``commands`` primary key grows at its right
    edge instead of touching a random index page per command as a random UUID does."""
    millis = time.time_ns() // 1_000_000
    value = (millis & (2**48 - 1)) << 80 | int.from_bytes(os.urandom(10)) & (2**80 - 1)
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # variant 10
    return str(uuid.UUID(int=value))


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """How the state cache did: loads that started from a cached state, loads that did not."""

    hits: int
    misses: int
    size: int
    max_size: int


class StateCache:
    """The latest known state of up to ``max_size`` streams, least recently used out (thread-safe)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._states: OrderedDict[tuple[str, int, str], Loaded[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: tuple[str, int, str]) -> Loaded[Any] | None:
        with self._lock:
            found = self._states.get(key)
            if found is None:
                self.misses += 1
                return None
            self._states.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: tuple[str, int, str], loaded: Loaded[Any]) -> None:
        """Keep ``loaded`` unless the cache holds a later version of the stream."""
        if self.max_size == 0:
            return
        with self._lock:
            held = self._states.get(key)
            if held is not None and held.version > loaded.version:
                return
            self._states[key] = loaded
            self._states.move_to_end(key)
            while len(self._states) > self.max_size:
                self._states.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._states.clear()

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self.hits, self.misses, len(self._states), self.max_size)


class CommandHandler:
    """Handles commands for any aggregate type against one database (see module docstring)."""

    def __init__(self, dsn_or_engine: str | Engine, config: HandlerConfig | None = None) -> None:
        self.config = config or HandlerConfig()
        if isinstance(dsn_or_engine, str):
            self.engine = make_engine(dsn_or_engine, isolation_level="AUTOCOMMIT", pool_size=self.config.pool_size)
            self._owns_engine = True
        else:
            self.engine = dsn_or_engine.execution_options(isolation_level="AUTOCOMMIT")
            self._owns_engine = False

        self._local = threading.local()
        self._lock = threading.Lock()
        self._pinned: list[SqlConnection] = []
        self.cache = StateCache(self.config.cache_size)

    @contextmanager
    def _connection(self) -> Iterator[Connection[Any]]:
        """This thread's psycopg connection (autocommit, orjson for jsonb), under a pooled SQLAlchemy one.

        Each thread keeps its connection checked out between commands (a pool checkout
        and return cost about as much as a statement); one that fails or is left inside a
        transaction is invalidated, and the next call checks out a fresh one.
        """
        if not self.config.pin_connections:
            with self.engine.connect() as pooled:
                driver = pooled.connection.driver_connection
                assert isinstance(driver, Connection)
                if not pooled.connection.info.get("tideline.prepared"):
                    store.prepare(driver)
                    pooled.connection.info["tideline.prepared"] = True
                yield driver
            return
        sa_conn: SqlConnection | None = getattr(self._local, "conn", None)
        if sa_conn is None:
            sa_conn = self.engine.connect()
            driver = sa_conn.connection.driver_connection
            assert isinstance(driver, Connection)
            store.prepare(driver)
            self._local.conn = sa_conn
            with self._lock:
                self._pinned.append(sa_conn)
        conn = sa_conn.connection.driver_connection
        assert isinstance(conn, Connection)
        healthy = False
        try:
            yield conn
            healthy = True
        finally:
            if not healthy and (conn.closed or conn.info.transaction_status != TransactionStatus.IDLE):
                self._local.conn = None
                with self._lock:
                    self._pinned.remove(sa_conn)
                sa_conn.invalidate()
                sa_conn.close()

    def close(self) -> None:
        """Return every thread's connection (call when no thread is handling a command)."""
        with self._lock:
            pinned, self._pinned = self._pinned, []
        for sa_conn in pinned:
            sa_conn.close()
        self._local = threading.local()
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> CommandHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads -----------------------------------------------------------------

    def load(self, aggregate: AggregateType[S, C], stream_id: str) -> Loaded[S]:
        """The aggregate's current state and version (version 0: no events yet)."""
        with self._connection() as conn:
            current, _ = self._load(conn, aggregate, stream_id, None)
        return current

    def cache_info(self) -> CacheInfo:
        return self.cache.info()

    def _load(
        self, conn: Connection[Any], aggregate: AggregateType[S, C], stream_id: str, command_id: str | None
    ) -> tuple[Loaded[S], store.RecordedCommand | None]:
        """The stream's current state (from the cache when it holds one) and the command id's
        record (None: a fresh id, nothing to look up)."""
        key = (aggregate.name, aggregate.state_version, stream_id)
        cached: Loaded[S] | None = self.cache.get(key) if self.config.cache_size else None
        loaded = store.load_stream(
            conn,
            stream_id,
            state_version=aggregate.state_version,
            use_snapshot=self.config.use_snapshots,
            command_id=command_id,
            after_version=None if cached is None else cached.version,
        )
        current = self._fold(aggregate, loaded, cached)
        if loaded.recorded is None and (cached is None or current.version != cached.version):
            self.cache.put(key, current)
        return current, loaded.recorded

    def _fold(self, aggregate: AggregateType[S, C], loaded: store.LoadedStream, cached: Loaded[S] | None) -> Loaded[S]:
        if loaded.snapshot is not None:
            state = from_json(aggregate.state_type, loaded.snapshot.state)
        elif cached is not None and loaded.after_version == cached.version:
            state = cached.state
        else:
            state = aggregate.initial
        decode = aggregate.events.decode
        for e in loaded.events:
            state = aggregate.apply(state, decode(e.event_type, e.schema_version, e.payload))
        return Loaded(state, loaded.version)

    # -- commands --------------------------------------------------------------

    def handle(
        self,
        aggregate: AggregateType[S, C],
        command: C,
        *,
        command_id: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        expected_version: int | None = None,
    ) -> CommandResult:
        """Decide ``command`` against the current state and store its events.

        ``command_id`` makes the command idempotent (default: a fresh UUID, i.e. no
        protection against a client's retry). ``expected_version``: the stream version
        the caller saw (KurrentDB's expected revision; 0: the stream must not exist yet);
        if the stream is elsewhere when the command is decided or appended, it is not
        retried: :class:`WrongExpectedVersionError`. Raises the aggregate's DomainError,
        DuplicateClaimError, CommandIdReusedError, ConcurrencyError or WrongExpectedVersionError.
        """
        given = command_id
        command_id = command_id or new_command_id()
        stream_id = aggregate.stream_id(command)
        metadata = {
            "command_id": command_id,
            "command_type": type(command).__name__,
            "correlation_id": correlation_id or command_id,
            "causation_id": causation_id or command_id,
        }
        expected = 0
        with self._connection() as conn:
            for attempt in range(1, self.config.max_attempts + 1):
                current, recorded = self._load(conn, aggregate, stream_id, given)
                if recorded is not None:
                    return self._replay(conn, recorded, command_id, stream_id, attempt)
                expected = current.version
                if expected_version is not None and expected != expected_version:
                    raise WrongExpectedVersionError(stream_id, expected_version, expected)
                events = list(aggregate.decide(current.state, command))
                decision = self._decision(aggregate, command, command_id, stream_id, expected, events, metadata)
                try:
                    lsn = store.append(conn, decision)
                    if lsn is None:
                        recorded = store.recorded_command(conn, command_id)
                        assert recorded is not None, "command row vanished"  # rows are never deleted
                        return self._replay(conn, recorded, command_id, stream_id, attempt)
                except (store.VersionConflict, store.ClaimReleased) as e:
                    if expected_version is not None and isinstance(e, store.VersionConflict):
                        raise WrongExpectedVersionError(stream_id, expected_version, None) from None
                    log.debug("attempt %d of command %s on %s: %s", attempt, command_id, stream_id, e)
                    self._pause(attempt)
                    continue
                after = Loaded(aggregate.fold(events, current.state), expected + len(events)) if events else current
                if events:
                    self.cache.put((aggregate.name, aggregate.state_version, stream_id), after)
                self._maybe_snapshot(conn, aggregate, stream_id, current, after)
                return CommandResult(
                    command_id=command_id,
                    stream_id=stream_id,
                    stream_type=aggregate.name,
                    version=expected + len(events),
                    events=tuple(type(e).event_type for e in events),
                    commit_lsn=lsn,
                    attempts=attempt,
                )
        raise ConcurrencyError(stream_id, expected, self.config.max_attempts)

    def _decision(
        self,
        aggregate: AggregateType[S, C],
        command: C,
        command_id: str,
        stream_id: str,
        expected: int,
        events: list[Event],
        metadata: dict[str, Any],
    ) -> store.Append:
        claims = claim_changes(aggregate, events)
        result = {
            "stream_id": stream_id,
            "stream_type": aggregate.name,
            "version": expected + len(events),
            "events": [type(e).event_type for e in events],
        }
        return store.Append(
            command_id=command_id,
            command_type=type(command).__name__,
            stream_id=stream_id,
            stream_type=aggregate.name,
            expected_version=expected,
            events=[aggregate.events.encode(e) for e in events],
            metadata=metadata,
            result=result,
            acquire=claims.acquire,
            release=claims.release,
        )

    def _replay(
        self, conn: Connection[Any], recorded: store.RecordedCommand, command_id: str, stream_id: str, attempt: int
    ) -> CommandResult:
        if recorded.stream_id != stream_id:
            raise CommandIdReusedError(command_id, stream_id, recorded.stream_id)
        r = recorded.result
        return CommandResult(
            command_id=command_id,
            stream_id=r["stream_id"],
            stream_type=r["stream_type"],
            version=r["version"],
            events=tuple(r["events"]),
            commit_lsn=store.wal_insert_lsn(conn),  # past the original commit, which is visible to us
            replayed=True,
            attempts=attempt,
        )

    def _pause(self, attempt: int) -> None:
        if attempt < self.config.max_attempts and self.config.retry_pause_seconds > 0:
            time.sleep(random.uniform(0, attempt * self.config.retry_pause_seconds))

    def _maybe_snapshot(
        self,
        conn: Connection[Any],
        aggregate: AggregateType[S, C],
        stream_id: str,
        before: Loaded[S],
        after: Loaded[S],
    ) -> None:
        every = self.config.snapshot_every
        if every is None or after.version == before.version or after.version // every == before.version // every:
            return
        try:
            store.save_snapshot(
                conn,
                stream_id=stream_id,
                stream_type=aggregate.name,
                version=after.version,
                schema_version=aggregate.state_version,
                state=to_json(after.state),
            )
        except Exception:  # a snapshot is a cache: the command is already committed
            log.warning("could not store the snapshot of %s at version %d", stream_id, after.version, exc_info=True)
