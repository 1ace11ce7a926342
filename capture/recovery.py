"""Position and slot on start: do they agree; and a snapshot over a topic that has keys deletes the rows gone meanwhile.

**What is compared.** ``S`` = the stored position's ``confirm_lsn`` (schemas.position: the
end of the last wholly stored source transaction), ``C`` = the slot's
``confirmed_flush_lsn``, ``W`` = the server's ``pg_current_wal_lsn()``. The connector never
confirms the slot beyond what it stored (capture.streaming stores an idle position *before*
it confirms a keepalive's WAL end), so in a healthy pair ``C ≤ S ≤ W``:

* ``C < S`` is normal: the connector stored a batch and was stopped (or killed) before its
  next status update; the server resends from ``C`` and the stored position skips what the
  log holds already. Not a mismatch.
* ``C > S`` — **the slot is ahead**: someone else consumed or advanced the slot
  (``pg_recvlogical``, ``pg_replication_slot_advance``), it was dropped and created again
  under the same name, or the log was restored from an older copy. Transactions committed
  between ``S`` and ``C`` were confirmed to the server but are not in the log: streaming
  from the slot would silently lose them.
* ``S > W`` — **the server is behind the log**: the database was restored from a backup or
  failed over to a replica that had not received that WAL; the log holds changes this
  server's history does not have, and its new transactions may reuse those positions.

Strategies (``--offset-mismatch``, Debezium 3.4's ``offset.mismatch.strategy``):

* ``fail`` (default): stop with both positions, what the mismatch means, and the options.
* ``trust_slot``: the slot is right. The stored position is moved to ``C`` (a log
  transaction holding only the position) and streaming starts there: the changes between
  are accepted as lost (slot ahead), or streamed again in the server's new history (server
  behind). A warning names the range.
* ``trust_offset``: the stored position is right. Server behind: streaming starts at the
  slot and skips everything the stored position covers (so until the server's WAL passes
  ``S``). Slot ahead: the slot cannot go back to ``S``, so it is treated as lost — a new
  slot and snapshot, with the deletes below — whatever ``--snapshot`` says.

**A slot gone or invalidated** (``wal_status = 'lost'``: ``max_slot_wal_keep_size`` let the
server remove WAL it still needed) while a finished position is stored stops the connector
with :class:`~capture.errors.SlotLostError`, one line naming what happened and how to
recover, unless ``--snapshot when_needed`` (or ``always``) takes a new snapshot.

**Deletes after a new snapshot** (:class:`Reconciliation`). A snapshot reads what the tables
hold; a row deleted while no change could be streamed (the slot lost, dropped, or skipped)
is simply not read, and its key would stay live in the compacted topic forever. So every
snapshot of a table whose topic already has live keys (the key state, capture.keystate,
knows them without reading the topic) first sets those keys aside; the snapshot's reads
mark the keys they see live again; after the last read, every key still aside gets a ``d``
event and a tombstone, with ``source.snapshot = "recovery"``, inside the snapshot's own log
transaction. Then the latest value per key equals ``SELECT *`` of the snapshot, deletes
included. A first snapshot has no live keys: nothing is set aside, nothing deleted.

Crash safety: the deletes, the snapshot's reads and the position "snapshot done" commit in
one log transaction; the set-aside keys live in the key state's SQLite transaction, which
commits only after it. A kill -9 anywhere before the log commit aborts both: the stored
position still says "snapshot under way", so the next start takes the snapshot again and
finds the same keys live, and emits the same deletes. A kill between the two commits is
caught up from the log (the ``d`` events and tombstones delete the keys as they would any).

Thread-safety: none; used by the connector thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from capture.config import CaptureConfig, OffsetMismatch, SnapshotMode
from capture.errors import OffsetMismatchError, SlotLostError
from capture.events import TRUNCATE_KEY, Event, EventBuilder, TxnContext
from capture.keystate import KeyState
from capture.offsets import OffsetContext
from capture.slots import SlotState
from capture.tables import TableInfo
from capture.writer import LogWriter
from schemas.position import SourcePosition, format_lsn

log = logging.getLogger("capture.connector")

RECOVERY_MARKER = "recovery"  # ``source.snapshot`` of a delete a snapshot found (see the module docstring)

SLOT_AHEAD = "the slot is ahead of the stored position"
SERVER_BEHIND = "the server's WAL is behind the stored position"


@dataclass(frozen=True, slots=True)
class StartDecision:
    """What the start checks decided: move the stored position to the slot's, and/or take a new snapshot."""

    trust_slot_at: int | None = None  # store this as the position (the slot's confirmed_flush_lsn) first
    resnapshot: bool = False  # the slot cannot serve the stored position: new slot, new snapshot


def check_start(
    config: CaptureConfig, slot: SlotState | None, stored: SourcePosition | None, server_lsn: int
) -> StartDecision:
    """Compare the stored position with the slot (module docstring); raise when the connector must stop."""
    if stored is None or not stored.snapshot_done:
        return StartDecision()  # nothing stored yet, or a snapshot under way: capture.snapshot decides
    name, mode = config.slot, config.snapshot
    recover = mode in (SnapshotMode.WHEN_NEEDED, SnapshotMode.ALWAYS)
    if slot is None or slot.lost:
        if recover:
            return StartDecision()  # capture.snapshot takes the new snapshot
        what, advice = (
            ("does not exist (dropped, or the server was replaced)", "")
            if slot is None
            else (
                "was invalidated by the server (wal_status = lost: it fell behind by more than "
                "max_slot_wal_keep_size, and the WAL it needed is removed)",
                ", and consider raising max_slot_wal_keep_size",
            )
        )
        raise SlotLostError(
            f"slot {name} {what}; the log's stored position is {format_lsn(stored.confirm_lsn)}, and the changes "
            "since then cannot be streamed any more: restart with --snapshot when_needed (a new slot and snapshot; "
            f"rows deleted meanwhile are deleted from the topics too){advice}"
        )
    confirmed, kept = slot.confirmed_flush, stored.confirm_lsn
    if confirmed is None or kept == 0 or mode is SnapshotMode.ALWAYS:
        return StartDecision()
    if confirmed > kept:
        what = SLOT_AHEAD
    elif kept > server_lsn:
        what = SERVER_BEHIND
    else:
        return StartDecision()  # C ≤ S ≤ W: the usual gap of a stop before the last status update
    values = (
        f"slot {name} confirmed_flush_lsn {format_lsn(confirmed)}, stored position {format_lsn(kept)}, "
        f"server WAL {format_lsn(server_lsn)}"
    )
    strategy = config.offset_mismatch
    if strategy is OffsetMismatch.FAIL:
        meaning = (
            "changes committed between the two were confirmed to the server but are not in the log"
            if what == SLOT_AHEAD
            else "the log holds changes this server's WAL does not have (restored from a backup, or failed over?)"
        )
        raise OffsetMismatchError(
            f"{what} ({values}): {meaning}. Restart with --offset-mismatch trust_slot (continue from the slot's "
            "position), trust_offset (keep the stored position; a slot ahead of it means a new snapshot), or "
            "drop the slot and restart with --snapshot when_needed (docs/capture.md, 'Position and slot')"
        )
    if strategy is OffsetMismatch.TRUST_SLOT:
        log.warning(
            "capture: %s (%s): --offset-mismatch trust_slot: the stored position moves to %s; %s", what, values,
            format_lsn(confirmed), "changes between are not in the log" if what == SLOT_AHEAD
            else "changes after it are streamed again from this server's WAL",
        )  # fmt: skip
        return StartDecision(trust_slot_at=confirmed)
    if what == SERVER_BEHIND:
        log.warning("capture: %s (%s): --offset-mismatch trust_offset: changes up to %s are skipped",
                    what, values, format_lsn(kept))  # fmt: skip
        return StartDecision()
    log.warning("capture: %s (%s): --offset-mismatch trust_offset: the slot cannot go back; taking a new snapshot",
                what, values)  # fmt: skip
    return StartDecision(resnapshot=True)


def move_position(writer: LogWriter, offsets: OffsetContext, confirmed_flush: int) -> None:
    """``trust_slot``: store "everything before the slot's position is in the log", alone in a log transaction."""
    writer.begin()
    offsets.slot_trusted(confirmed_flush)
    position = offsets.take_pending()
    writer.commit(position)
    offsets.committed(position)


class Reconciliation:
    """The deletes of one snapshot: keys live in a table's topic before it that its reads did not see again."""

    def __init__(self, builder: EventBuilder, keystate: KeyState) -> None:
        self.builder = builder
        self.keystate = keystate
        self._tables: list[tuple[TableInfo, str]] = []
        self.deleted = 0

    def table_started(self, table: TableInfo, topic: str) -> None:
        """Before the table's first read (its topic is tracked): set its live keys aside."""
        if table.keyless:
            return
        if self.keystate.set_aside(topic):
            self._tables.append((table, topic))

    def deletes(self, consistent_point: int, first_index: int, ts_ms: int, now_ms: int) -> Iterator[list[Event]]:
        """After the last read: a ``d`` event and a tombstone per key gone, in chunks; marked ``recovery``."""
        ctx = TxnContext(None, consistent_point, ts_ms, snapshot=RECOVERY_MARKER)
        index = first_index
        for table, topic in self._tables:
            gone = 0
            for keys in self.keystate.gone_keys(topic):
                chunk: list[Event] = []
                for key in keys:
                    if key == TRUNCATE_KEY:
                        continue
                    chunk.extend(self.builder.recovered_delete(table, key, ctx, index, now_ms))
                    index += 1
                gone += len(chunk) // 2
                yield chunk
            self.keystate.forget_set_aside(topic)
            if gone:
                log.warning("capture: %s: %d rows present in topic %s are gone from the table: deleted (%s)",
                            table.qualified, gone, topic, RECOVERY_MARKER)  # fmt: skip
            self.deleted += gone
