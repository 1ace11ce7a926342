"""Isolation levels: which stored batches a reader may see.

One function, :func:`read_visible`, decides it for every reader of user data and of
``__consumer_offsets`` (the consumer and :class:`~eventstore.offsets.OffsetStore`):

* **Control batches** (transaction commit/abort markers, attribute bit 5) are never
  delivered, whatever the isolation level.
* ``read_uncommitted``: every other batch, up to the log end.
* ``read_committed``: only batches below the partition's *last stable offset* (LSO: the
  first offset of the earliest open transaction, or the log end when none is open; it is
  always a batch boundary), minus the batches of aborted transactions. A batch is
  aborted iff it is transactional and some ``AbortedTransaction`` ``a`` of
  ``PartitionLog.aborted_transactions`` has ``a.producer_id == header.producer_id`` and
  ``a.first_offset <= header.base_offset <= a.last_offset``.

Skipped batches still advance the reader: :attr:`VisibleRead.next_offset` is where the
next read continues, past every batch examined (delivered or not).

A reader held back by an open transaction (:attr:`VisibleRead.held_back`) reports it
to :func:`note_held_back`: a transaction whose producer died (or timed out) stays open
until someone asks the coordinator to abort it, and readers are who notice. When the
readers of this process have seen a partition's last stable offset hold them back at
the same value for ``HELD_BACK_RECOVERY_S``, the coordinator's ``recover`` runs (at most
once per ``RECOVERY_INTERVAL_S`` per log directory): it aborts transactions whose
producer is dead or past its timeout and leaves live ones alone. The memory is per
process, not per reader, so a series of short-lived readers triggers it as surely as one
long poll.

Thread-safety: stateless; safe from any thread.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eventstore.errors import ConfigError
from eventstore.partition_log import AbortedTransaction, FetchedBatch, PartitionLog
from eventstore.record_batch import BatchHeader
from eventstore.transactions import TRANSACTIONS_DIR, TransactionCoordinator

if TYPE_CHECKING:
    from eventstore.log import Log

HELD_BACK_RECOVERY_S = 1.0
RECOVERY_INTERVAL_S = 1.0
_recovery_lock = threading.Lock()
_last_recovery: dict[Path, float] = {}  # log directory → when recover last ran
_held_back: dict[Path, tuple[int, float]] = {}  # partition directory → (LSO, first seen holding readers back)


class IsolationLevel(enum.Enum):
    """Kafka's ``isolation.level``."""

    READ_UNCOMMITTED = "read_uncommitted"
    READ_COMMITTED = "read_committed"

    @classmethod
    def parse(cls, text: str | IsolationLevel) -> IsolationLevel:
        if isinstance(text, IsolationLevel):
            return text
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ConfigError(f"isolation level must be read_committed or read_uncommitted, not {text!r}") from None


@dataclass(frozen=True, slots=True)
class VisibleRead:
    """What one read returned to a reader at one isolation level.

    ``batches``: the deliverable batches, in offset order (the first may start before
    the offset asked for, as with ``PartitionLog.read``). ``next_offset``: the offset
    after the last batch examined, delivered or skipped (the offset asked for when
    nothing was examined). ``held_back``: read_committed stopped at the last stable
    offset while the log goes on (an open transaction holds the reader back).
    """

    batches: list[FetchedBatch]
    next_offset: int
    held_back: bool = False


def end_offset(plog: PartitionLog, isolation: IsolationLevel) -> int:
    """Where a reader at ``isolation`` stops: the LSO (read_committed) or the log end."""
    if isolation is IsolationLevel.READ_COMMITTED:
        return plog.last_stable_offset()
    return plog.log_end_offset()


def is_aborted(header: BatchHeader, aborted: list[AbortedTransaction]) -> bool:
    if not header.is_transactional:
        return False
    return any(
        a.producer_id == header.producer_id and a.first_offset <= header.base_offset <= a.last_offset for a in aborted
    )


def read_visible(
    plog: PartitionLog, offset: int, isolation: IsolationLevel, *, max_bytes: int = 1 << 20
) -> VisibleRead:
    """Read whole batches from ``offset`` and keep those visible at ``isolation``.

    Raises :class:`~eventstore.errors.OffsetOutOfRangeError` below the log start, like
    ``PartitionLog.read``.
    """
    committed_only = isolation is IsolationLevel.READ_COMMITTED
    stable = plog.last_stable_offset() if committed_only else -1  # taken before reading: never ahead of the data
    if committed_only and offset >= stable:
        end = plog.log_end_offset()
        if offset >= end:
            # At the end of the sound data: read on, as a read_uncommitted reader would, so that
            # damage right after it (a broken batch header) is reported, not taken for the end.
            plog.read(offset, max_bytes=1)
        return VisibleRead([], offset, held_back=end > stable)
    fetched = plog.read(offset, max_bytes=max_bytes)
    held_back = False
    if committed_only:
        stable_part = [f for f in fetched if f.header.base_offset < stable]
        held_back, fetched = len(stable_part) < len(fetched), stable_part
    if not fetched:
        return VisibleRead([], offset, held_back)
    aborted: list[AbortedTransaction] = []
    if committed_only and any(f.header.is_transactional for f in fetched):
        aborted = plog.aborted_transactions(offset, fetched[-1].header.next_offset)
    visible = [f for f in fetched if not f.header.is_control and not is_aborted(f.header, aborted)]
    return VisibleRead(visible, max(offset, fetched[-1].header.next_offset), held_back)


def note_held_back(log: Log, plog: PartitionLog) -> None:
    """A reader of ``plog`` is waiting at its last stable offset: recover abandoned transactions if it lasts."""
    stable = plog.last_stable_offset()
    now = time.monotonic()
    with _recovery_lock:
        seen = _held_back.get(plog.directory)
        if seen is None or seen[0] != stable:
            _held_back[plog.directory] = (stable, now)
            return
        if now - seen[1] < HELD_BACK_RECOVERY_S:
            return
        if now - _last_recovery.get(log.path, float("-inf")) < RECOVERY_INTERVAL_S:
            return
        _last_recovery[log.path] = now
    recover_abandoned_transactions(log)


def recover_abandoned_transactions(log: Log) -> None:
    """Abort the open transactions of dead or timed-out producers, complete decided ones.

    Nothing to do without a ``_transactions`` directory. A transaction whose producer is
    alive and within its timeout is left alone.
    """
    if (log.path / TRANSACTIONS_DIR).is_dir():
        TransactionCoordinator(log).recover()
