"""The offset context: where capture stands in the source, in one place (Debezium's OffsetContext).

The stored record is :class:`schemas.position.SourcePosition` (defined in schemas/ so that
projections read the same definition). This module keeps the connector's view of it:

* ``stored`` — the position of the last committed log transaction (read at start);
* ``pending`` — the position the open batch will store when it commits: after the last
  event added to it, ``complete`` once its source transaction's COMMIT was seen;
* ``committing`` — the position of a batch whose commit is in flight (capture.writer commits
  behind while the next batch is decoded): the open batch's position starts afresh from it
  (:meth:`OffsetContext.committing`), and it becomes ``stored`` once that commit returned
  (:meth:`OffsetContext.settled`);
* what the replication slot may be confirmed up to: the ``confirm_lsn`` of ``stored``,
  always a commit *end* of a wholly stored transaction (confirming inside a transaction
  would make the server resend all of it anyway, FIELD-NOTES).

An event ``(commit_lsn, event_index)`` that ``stored`` covers is skipped on restart: the
server may resend a whole transaction, never less.

The progress of an incremental snapshot (capture.incremental) is part of the position:
``incremental`` is its current value, carried into every position stored from then on, so
that the progress commits atomically with the ``op=r`` events it accounts for (and with
the signal that changed it).

Every position stored after :meth:`OffsetContext.run_started` carries the connection's
``run`` (capture.table_history: the tables that connection started with are recorded
under that name, so that the next start knows which tables its stream holds whole).

Thread-safety: none; owned by the connector thread.
"""

from __future__ import annotations

from schemas.position import IncrementalProgress, SourcePosition

__all__ = ["IncrementalProgress", "OffsetContext", "SourcePosition"]


class OffsetContext:
    """The stored position, the open batch's position, and the confirm floor.

    The open batch's position changes with every event; it is kept as plain fields and made
    a :class:`SourcePosition` only when a batch commits (one object per batch, not per event).
    """

    def __init__(self, stored: SourcePosition | None) -> None:
        self.stored = stored
        self._has_pending = False
        self._commit_lsn = 0
        self._index = 0
        self._complete = False
        self._confirm = 0
        self._snapshot_done = True
        self._incremental = stored.incremental if stored is not None else None
        self._run: str | None = None  # the connection's run, once its start is recorded (capture.table_history)
        self._committing: SourcePosition | None = None  # the position of the batch whose commit is in flight

    @property
    def _latest(self) -> SourcePosition | None:
        """The last position given to a commit: the one in flight, or else the stored one."""
        return self._committing if self._committing is not None else self.stored

    @property
    def pending(self) -> SourcePosition | None:
        """The position the open batch will store (None: nothing new since the last commit)."""
        if not self._has_pending:
            return None
        return SourcePosition(self._commit_lsn, self._index, self._complete, self._confirm, self._snapshot_done,
                              self._incremental, self._run)  # fmt: skip

    def run_started(self, run: str | None) -> None:
        """Positions stored from now on name this run (None: the run's start could not be recorded)."""
        self._run = run

    @property
    def incremental(self) -> IncrementalProgress | None:
        """The incremental snapshot under way as of the open batch (None: none)."""
        return self._incremental

    def incremental_changed(self, progress: IncrementalProgress | None) -> None:
        """The open batch stores this progress (its events, if any, are in the batch already)."""
        self._incremental = progress
        if not self._has_pending:  # nothing else changed since the last commit: the stored position, new progress
            s = self._latest or SourcePosition(0, -1, False, 0)
            self._set(s.commit_lsn, s.event_index, s.complete, s.confirm_lsn, s.snapshot_done)

    @property
    def snapshot_interrupted(self) -> bool:
        return self.stored is not None and not self.stored.snapshot_done

    def covers(self, commit_lsn: int, index: int) -> bool:
        """Whether the event is stored already (a snapshot under way stores no stream position)."""
        return self.stored is not None and self.stored.snapshot_done and self.stored.covers(commit_lsn, index)

    def confirm_floor(self) -> int:
        """The confirm position of positions inside a transaction: the last complete one."""
        if self._has_pending:
            return self._confirm
        latest = self._latest
        return latest.confirm_lsn if latest is not None else 0

    def _set(self, commit_lsn: int, index: int, complete: bool, confirm: int, snapshot_done: bool = True) -> None:
        self._commit_lsn, self._index, self._complete, self._confirm = commit_lsn, index, complete, confirm
        self._snapshot_done = snapshot_done
        self._has_pending = True

    def event_stored(self, commit_lsn: int, index: int) -> None:
        """The open batch now reaches event ``index`` of the transaction committed at ``commit_lsn`` (-1: its
        BEGIN record, transaction metadata's, and none of its changes yet)."""
        self._set(commit_lsn, index, False, self.confirm_floor())

    def transaction_stored(self, commit_lsn: int, last_index: int, commit_end: int) -> None:
        """The open batch now holds the whole transaction; its commit end may be confirmed once stored."""
        self._set(commit_lsn, last_index, True, commit_end)

    def message_stored(self, lsn: int, *, between_transactions: bool) -> None:
        """A non-transactional logical message at ``lsn`` is in the open batch.

        Between transactions it also confirms up to ``lsn``: the server sends transactions in
        commit order and the message at its WAL position, so every transaction whose commit
        record starts before ``lsn`` was sent (and stored) before it; a restart from ``lsn``
        resends the message (its own position covers it) and nothing older. This is what makes
        a message heartbeat (``--heartbeat-query "SELECT pg_logical_emit_message(false, …)"``)
        advance the slot and the read-your-writes position of an otherwise idle source.
        """
        confirm = self.confirm_floor()
        self._set(lsn, 0, True, max(confirm, lsn) if between_transactions else confirm)

    def snapshot_started(self) -> None:
        self._incremental = None  # a full snapshot reads every table: an incremental one under way is moot
        self._set(0, -1, False, 0, snapshot_done=False)

    def snapshot_done(self, consistent_point: int) -> None:
        """Transactions committing at or after the consistent point are streamed, not in the snapshot."""
        self._set(consistent_point - 1, -1, True, consistent_point)

    def idle_at(self, wal_end: int) -> bool:
        """The server sent everything up to ``wal_end`` and nothing of it is left to store (a keepalive
        between transactions): once stored, the slot may be confirmed up to there. Like a snapshot's
        consistent point, transactions committing at or after ``wal_end`` are not covered. False: the
        open position is there already."""
        floor = self.pending or self._latest
        if floor is not None and (floor.commit_lsn >= wal_end - 1 or not floor.complete or not floor.snapshot_done):
            return False
        self._set(wal_end - 1, -1, True, max(wal_end, self.confirm_floor()))
        return True

    def slot_trusted(self, confirmed_flush: int) -> None:
        """``--offset-mismatch trust_slot``: the log is taken to hold everything before the slot's position."""
        self._set(confirmed_flush - 1, -1, True, confirmed_flush)

    def take_pending(self) -> SourcePosition | None:
        """The position to store with the batch being committed."""
        return self.pending

    def committed(self, position: SourcePosition | None) -> None:
        """The batch carrying ``position`` is durable."""
        if position is not None:
            self.stored = position
        self._has_pending = False

    def committing(self, position: SourcePosition | None) -> None:
        """The batch carrying ``position`` (:meth:`take_pending`'s) is committing behind: the next batch's
        position starts from it; :meth:`settled` once it is durable."""
        self._committing = position
        self._has_pending = False

    def settled(self, position: SourcePosition | None) -> None:
        """The batch given to :meth:`committing` is durable (the next batch's position is left as it is)."""
        if position is not None:
            self.stored = position
        if self._committing is position:
            self._committing = None

    @property
    def confirm_lsn(self) -> int:
        """What the slot may be confirmed up to: the end of the last wholly stored transaction."""
        return self.stored.confirm_lsn if self.stored is not None else 0
