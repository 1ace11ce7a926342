"""Read-your-writes: how far a view has come in *source* terms, and waiting for it.

A command returns ``commit_lsn`` (:class:`commands.handler.CommandResult`): a WAL position
read right after its COMMIT, so its transaction's commit record starts before it. A view
has **reached** LSN ``R`` when every source transaction whose commit record starts before
``R`` has been applied to it. ``wait_for(dsn, projection, lsn)`` returns once the view's
reached LSN is ≥ ``lsn`` — then the command's events are in the view.

How ``R`` is established (never from the events' own LSNs alone: partitions are read
side by side, so the largest LSN applied says nothing about a partition read a moment
earlier):

1. Take a **sample**: first the capture connector's stored position ``P`` (the
   ``__tideline_capture_offsets`` topic, read_committed: the log holds every transaction
   up to ``P``; ``P.confirm_lsn`` is the end of the last wholly stored transaction, so
   every transaction whose commit starts before it is in the log), *then* the **log end
   offsets** ``E`` of the view's source partitions (read_uncommitted). Capture appends a
   transaction's records to every partition before it commits, so whatever ``P`` covers
   lies below ``E``. Not the last stable offsets: a log transaction's commit markers are
   written one partition after the other, so ``P`` can be visible (its marker in the
   offsets topic written) while a view partition's marker is not yet, and that
   partition's last stable offset still excludes ``P``'s records (measured: a
   read-your-writes test saw a command's user missing after ``wait_for`` said yes).
2. Once the view's checkpoints (next offsets, committed with the view rows) are ≥ ``E``
   on every partition, the view has everything up to ``P``: ``R = P.confirm_lsn``. (A
   read_committed reader gets past records of an open transaction only once it ended,
   so such a checkpoint implies ``P``'s records were read.)

``follow`` samples after every micro-batch and every half second while idle (the live
engine: before every batch, and whenever capture stores a position), and promotes the
samples its checkpoints cover (so ``R`` advances under load, one batch behind, and
immediately when caught up). Capture's position is read incrementally
(:class:`CapturePositions`; on Kafka :class:`projections.kafka_source.KafkaCapturePositions`,
the same topic read with ``read_committed``, and ``E`` the partitions' high watermarks: a
transaction's records are acknowledged, so below the high watermark, before it commits).
``rebuild`` takes its sample before it fixes the offsets it reads to. ``R`` only grows.
Both backends are asked through :class:`projections.sources.LogSource`.

Liveness: ``R`` is a commit *end*, and the handler's ``commit_lsn`` is the insert position
after its commit — equal when nothing else was written to the WAL in between, larger
when something was (another database's writes, a checkpoint). Then ``R`` passes it with
the next captured transaction or heartbeat message: on a quiet database run capture with
a heartbeat (``--heartbeat-query``: a write to a table of its own, or a non-transactional
``pg_logical_emit_message``, whose position capture stores and confirms) so that there is one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from eventstore.consumer import Consumer, TopicPartition
from eventstore.isolation import IsolationLevel, end_offset
from eventstore.log import Log
from projections import store
from schemas.position import POSITIONS_TOPIC, SourcePosition, format_lsn, parse_lsn

if TYPE_CHECKING:
    from projections.sources import CapturePositionReader, LogSource

__all__ = [
    "ReachedTracker",
    "Sample",
    "captured_lsn",
    "format_lsn",
    "parse_lsn",
    "stable_offsets",
    "take_sample",
    "wait_for",
]


def captured_lsn(log: Log, connector: bytes | None = None) -> int:
    """The end of the last wholly stored source transaction (``confirm_lsn`` of capture's stored
    position; the largest over connectors unless ``connector`` names one key); 0 if none."""
    if POSITIONS_TOPIC not in log.topics():
        return 0
    latest: dict[bytes, int] = {}
    with Consumer(log, enable_auto_commit=False, isolation_level=IsolationLevel.READ_COMMITTED) as consumer:
        consumer.assign([TopicPartition(POSITIONS_TOPIC, 0)])
        consumer.seek_to_beginning()
        while records := consumer.poll(timeout_ms=0):
            for r in records:
                if r.key is None or r.value is None or (connector is not None and r.key != connector):
                    continue
                latest[r.key] = SourcePosition.from_json(r.value).confirm_lsn
    return max(latest.values(), default=0)


def stable_offsets(log: Log, topics: Iterable[str]) -> store.Offsets:
    """The last stable offset of every partition of ``topics`` that exist."""
    out: store.Offsets = {}
    existing = set(log.topics())
    for topic in topics:
        if topic not in existing:
            continue
        for p in range(log.topic(topic).partitions):
            out.setdefault(topic, {})[p] = end_offset(log.partition(topic, p), IsolationLevel.READ_COMMITTED)
    return out


@dataclass(frozen=True, slots=True)
class Sample:
    """A capture position and the log offsets that hold everything up to it."""

    lsn: int
    offsets: store.Offsets

    def covered_by(self, applied: store.Offsets) -> bool:
        return all(applied.get(t, {}).get(p, 0) >= o for t, per in self.offsets.items() for p, o in per.items())


def appended_offsets(log: Log, topics: Iterable[str]) -> store.Offsets:
    """The log end offset (read_uncommitted) of every partition of ``topics`` that exist."""
    out: store.Offsets = {}
    existing = set(log.topics())
    for topic in topics:
        if topic in existing:
            for p in range(log.topic(topic).partitions):
                out.setdefault(topic, {})[p] = end_offset(log.partition(topic, p), IsolationLevel.READ_UNCOMMITTED)
    return out


def take_sample(source: LogSource, topics: Iterable[str]) -> Sample:
    """Capture's stored position, *then* the log end offsets of ``topics`` (see the module docstring)."""
    positions = source.capture_positions()
    try:
        lsn = positions.lsn()
    finally:
        positions.close()
    return Sample(lsn, source.appended_offsets(topics))


class CapturePositions:
    """Capture's stored position, read incrementally: a consumer kept at the end of
    ``__tideline_capture_offsets`` (read_committed) and the latest ``confirm_lsn`` per connector
    (bounded by the number of connectors). What :func:`captured_lsn` gives, without re-reading
    the topic from its start at every sample. Not thread-safe."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.latest: dict[bytes, int] = {}
        self._consumer: Consumer | None = None

    def lsn(self) -> int:
        """The end of the last wholly stored source transaction (0: capture stored none yet)."""
        if self._consumer is None:
            if POSITIONS_TOPIC not in self.log.topics():
                return 0
            self._consumer = Consumer(self.log, enable_auto_commit=False, isolation_level=IsolationLevel.READ_COMMITTED)
            self._consumer.assign([TopicPartition(POSITIONS_TOPIC, 0)])
            self._consumer.seek_to_beginning()
        while records := self._consumer.poll(timeout_ms=0):
            for r in records:
                if r.key is not None and r.value is not None:
                    self.latest[r.key] = SourcePosition.from_json(r.value).confirm_lsn
        return max(self.latest.values(), default=0)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


class ReachedTracker:
    """Samples waiting to be covered by a view's checkpoints (driver side; not thread-safe).

    Keeps capture's position reader open (the position read incrementally) until :meth:`close`."""

    def __init__(self, source: LogSource, topics: Iterable[str], keep: int = 64) -> None:
        self.source = source
        self.topics = list(topics)
        self.keep = keep
        self.pending: list[Sample] = []
        self._positions: CapturePositionReader | None = None

    def sample(self) -> Sample:
        """Take a sample (capture's position first, then the log end offsets) and keep it
        if it is new; return it."""
        if self._positions is None:
            self._positions = self.source.capture_positions()
        lsn = self._positions.lsn()  # first the position, then the offsets: see the module docstring
        s = Sample(lsn, self.source.appended_offsets(self.topics))
        if s.lsn and (not self.pending or s.lsn > self.pending[-1].lsn or s.offsets != self.pending[-1].offsets):
            self.pending.append(s)
            del self.pending[: -self.keep]
        return s

    def promote(self, applied: store.Offsets) -> int:
        """The largest LSN of the samples ``applied`` covers (0: none); those samples are dropped."""
        reached = 0
        keep: list[Sample] = []
        for s in self.pending:
            if s.covered_by(applied):
                reached = max(reached, s.lsn)
            else:
                keep.append(s)
        self.pending = keep
        return reached

    def close(self) -> None:
        if self._positions is not None:
            self._positions.close()
        self._positions = None


def wait_for(dsn: str, projection: str, lsn: int | str, timeout: float = 10.0, poll: float = 0.25) -> bool:
    """Wait until ``projection`` has reached ``lsn`` (a command's ``commit_lsn``, int or ``"X/Y"``);
    True when it has, False after ``timeout`` seconds.

    Woken by the notification a follow job sends when the reached LSN rises
    (``LISTEN tideline_reached``, :func:`projections.store.advance_reached`), so it returns
    within a millisecond or so of the view's commit; it also re-reads every ``poll`` seconds."""
    target = parse_lsn(lsn) if isinstance(lsn, str) else lsn
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(store.REACHED_CHANNEL)))
        while True:
            if store.reached_lsn(conn, projection) >= target:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for note in conn.notifies(timeout=min(poll, remaining)):
                if note.payload == projection:
                    break  # re-read; other projections' notifications are drained meanwhile
