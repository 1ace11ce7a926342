"""The transaction coordinator: producer ids, epochs, and atomic commit across partitions.

Kafka's design without a broker: the coordinator is this module, run inside whichever
process needs it, and its state lives in files of the log directory, serialized by
flocks. Directory ``<log>/_transactions/``::

    producer-ids           next producer id to hand out: ``<qI`` (int64, CRC32C), rewritten
                           in place and fsynced under ``producer-ids.lock``
    producer-ids.lock      flock for the allocation above
    <tid>.state            the transaction log of transactional id <tid>: append-only
                           records ``<II`` (length, CRC32C of the body) + a JSON body; the
                           last whole record is the state. Rewritten (durably) down to its
                           last record once it passes 16 KiB. A torn last record is ignored
                           and cut by the next writer.
    <tid>.lock             flock held for every state transition of <tid>, including the
                           whole commit/abort (marker writing) sequence
    <tid>.<epoch>.owner    flock held by the live producer instance of that epoch for its
                           lifetime: the kernel drops it when the process dies (kill -9
                           included), which is how others tell a dead owner from a slow one

States (:class:`TxnState`): ``Empty`` → ``Ongoing`` (first partition added) →
``PrepareCommit`` | ``PrepareAbort`` (fsynced: the decision) → markers written to every
partition of the transaction → ``CompleteCommit`` | ``CompleteAbort`` (not fsynced: if
lost, recovery redoes the markers, which partitions ignore when the transaction is no
longer open there).

A decided state whose markers could not all be written (a full disk) stays ``Prepare*``; the
producer's retry of the same call completes it. An abort that bumped the epoch (a producer's
abort after a failed send) records the epoch it replaced (``last_epoch`` in the JSON body; absent
in older files, read as -1), so that retry, still under the old epoch, is recognized.

Fencing: ``init_producer`` bumps the epoch of a transactional id (aborting or completing
whatever the previous instance left), so the previous instance's next coordinator call
or append fails with :class:`ProducerFencedError` (partitions refuse lower epochs once a
batch or marker of the new epoch reached them; the coordinator refuses them at once).

Recovery (:meth:`TransactionCoordinator.recover`): an ``Ongoing`` transaction whose owner
is dead (its owner flock is free) or older than its timeout is aborted with a bumped
epoch; a ``Prepare*`` state found under the lock (its completer died) is completed.
``init_producer`` recovers its own id; read_committed consumers stuck behind an open
transaction and the log cleaner call ``recover`` for all ids.

Thread-safety: thread-safe; every transition holds the ``<tid>.lock`` flock, which also
excludes threads of the same process (each call opens its own descriptor).
"""

from __future__ import annotations

import enum
import fcntl
import json
import logging
import os
import re
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import crc32c

from eventstore.errors import ConfigError, InvalidTxnStateError, LogStorageError, ProducerFencedError
from eventstore.fileio import fsync_dir, pwrite_all, replace_durably
from eventstore.producer_state import ControlType, control_key
from eventstore.record_batch import EncodedBatch, build_records, encode_batch
from eventstore.topic import now_ms

if TYPE_CHECKING:
    from eventstore.log import Log

TRANSACTIONS_DIR = "_transactions"
PRODUCER_IDS_FILE = "producer-ids"
STATE_RECORD = struct.Struct("<II")
COUNTER = struct.Struct("<qI")
STATE_FILE_LIMIT = 16 << 10
MAX_EPOCH = (1 << 15) - 2  # int16 in batch headers; the last value is kept for fencing
DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000
_LEGAL_ID = re.compile(r"^[A-Za-z0-9._-]{1,200}$")

log = logging.getLogger(__name__)


class TxnState(enum.Enum):
    EMPTY = "Empty"
    ONGOING = "Ongoing"
    PREPARE_COMMIT = "PrepareCommit"
    PREPARE_ABORT = "PrepareAbort"
    COMPLETE_COMMIT = "CompleteCommit"
    COMPLETE_ABORT = "CompleteAbort"

    @property
    def is_open(self) -> bool:
        return self in (TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT)


@dataclass(frozen=True, slots=True)
class TransactionMetadata:
    """The state of one transactional id (one record of ``<tid>.state``)."""

    transactional_id: str
    producer_id: int
    epoch: int
    state: TxnState
    partitions: tuple[tuple[str, int], ...] = ()
    txn_start_ms: int = -1
    timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS
    updated_ms: int = field(default_factory=now_ms)
    # The epoch before a bump the producer itself asked for (an abort after a failed send), else -1:
    # its retry of that abort, still under the old epoch, is a retry and not a zombie (Kafka's
    # lastProducerEpoch). Bumps by init_producer and recovery leave it -1, so they fence.
    last_epoch: int = -1

    def to_json(self) -> dict[str, Any]:
        return {
            "transactional_id": self.transactional_id,
            "producer_id": self.producer_id,
            "epoch": self.epoch,
            "state": self.state.value,
            "partitions": [list(tp) for tp in self.partitions],
            "txn_start_ms": self.txn_start_ms,
            "timeout_ms": self.timeout_ms,
            "updated_ms": self.updated_ms,
            "last_epoch": self.last_epoch,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TransactionMetadata:
        return cls(
            d["transactional_id"],
            int(d["producer_id"]),
            int(d["epoch"]),
            TxnState(d["state"]),
            tuple((str(t), int(p)) for t, p in d["partitions"]),
            int(d["txn_start_ms"]),
            int(d["timeout_ms"]),
            int(d["updated_ms"]),
            int(d.get("last_epoch", -1)),  # absent in state files written before it existed
        )


def validate_transactional_id(tid: str) -> None:
    if not _LEGAL_ID.match(tid) or tid in (".", ".."):
        raise ConfigError(f"illegal transactional id {tid!r}: use 1-200 characters from [A-Za-z0-9._-]")


def control_batch(kind: ControlType, producer_id: int, epoch: int) -> EncodedBatch:
    """A commit or abort marker: one record whose key is the marker type (Kafka's layout)."""
    records = build_records([control_key(kind)], [b""])
    ts = now_ms()
    return encode_batch(
        records,
        first_timestamp=ts,
        max_timestamp=ts,
        producer_id=producer_id,
        producer_epoch=epoch,
        transactional=True,
        control=True,
    )


class OwnerLock:
    """The flock a live producer instance holds on ``<tid>.<epoch>.owner``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise InvalidTxnStateError(f"{path} is held by another live producer instance") from None

    def release(self) -> None:
        if self._fd is not None:
            with suppress(FileNotFoundError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = None


class TransactionCoordinator:
    """Producer ids and transaction state of one log directory."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.directory = log.path / TRANSACTIONS_DIR
        self.directory.mkdir(exist_ok=True)

    # ------------------------------------------------------------------ files

    @contextmanager
    def _flock(self, name: str) -> Iterator[None]:
        fd = os.open(self.directory / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def allocate_producer_id(self) -> int:
        """A producer id never handed out before in this log directory (durable)."""
        with self._flock(PRODUCER_IDS_FILE + ".lock"):
            path = self.directory / PRODUCER_IDS_FILE
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                raw = os.pread(fd, COUNTER.size, 0)
                next_id = 0
                if len(raw) == COUNTER.size:
                    value, crc = COUNTER.unpack(raw)
                    if crc != crc32c.crc32c(raw[:8]):
                        raise InvalidTxnStateError(f"{path} is damaged: cannot hand out producer ids safely")
                    next_id = value
                elif raw:
                    raise InvalidTxnStateError(f"{path} is damaged: cannot hand out producer ids safely")
                body = struct.pack("<q", next_id + 1)
                pwrite_all(fd, body + struct.pack("<I", crc32c.crc32c(body)), 0)
                os.fdatasync(fd)
            except OSError as e:  # the id is not handed out: a full disk is retried like an append
                raise LogStorageError(path, e, what="no producer id was handed out") from e
            finally:
                os.close(fd)
            return next_id

    def _state_path(self, tid: str) -> Path:
        return self.directory / f"{tid}.state"

    def read_state(self, tid: str) -> TransactionMetadata | None:
        try:
            raw = self._state_path(tid).read_bytes()
        except FileNotFoundError:
            return None
        last, _ = _last_record(raw)
        return last

    def _write_state(self, meta: TransactionMetadata, *, durable: bool = True) -> None:
        path = self._state_path(meta.transactional_id)
        body = json.dumps(meta.to_json(), sort_keys=True).encode()
        record = STATE_RECORD.pack(len(body), crc32c.crc32c(body)) + body
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raw = b""
        _, valid = _last_record(raw)
        try:
            if valid + len(record) > STATE_FILE_LIMIT:
                replace_durably(path, record)
                return
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if valid != len(raw):
                    os.ftruncate(fd, valid)  # a torn record of a crashed writer (we hold the lock)
                # whole or raising: a short write on a full disk left the record torn (so the state unchanged)
                # while the caller went on, e.g. writing commit markers for a decision that was not stored
                pwrite_all(fd, record, valid)
                if durable:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            if not raw:
                fsync_dir(self.directory)
        except OSError as e:  # the state is the last whole record, as before the call
            raise LogStorageError(path, e, what=f"transaction state {meta.state.value} not stored") from e

    def _owner_path(self, tid: str, epoch: int) -> Path:
        return self.directory / f"{tid}.{epoch}.owner"

    def owner_alive(self, tid: str, epoch: int) -> bool:
        """Whether a live process holds the owner lock of ``tid`` at ``epoch``."""
        path = self._owner_path(tid, epoch)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def transactional_ids(self) -> list[str]:
        return sorted(n[: -len(".state")] for n in os.listdir(self.directory) if n.endswith(".state"))

    # ------------------------------------------------------------------ protocol

    def init_producer(
        self, tid: str, *, timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS
    ) -> tuple[int, int, OwnerLock]:
        """Register a (new instance of a) transactional producer: ``(producer_id, epoch, owner lock)``.

        Bumps the epoch, which fences any previous instance; finishes whatever that
        instance left: an open transaction is aborted, a decided one completed.
        """
        validate_transactional_id(tid)
        with self._flock(f"{tid}.lock"):
            meta = self.read_state(tid)
            if meta is None:
                pid, epoch = self.allocate_producer_id(), 0
            else:
                if meta.state is TxnState.ONGOING:
                    meta = self._end(meta, commit=False, bump=True)
                elif meta.state in (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT):
                    meta = self._end(meta, commit=meta.state is TxnState.PREPARE_COMMIT, bump=False)
                pid, epoch = meta.producer_id, meta.epoch + 1
                if epoch > MAX_EPOCH:  # epoch space exhausted: a fresh id (the old one stays fenced)
                    pid, epoch = self.allocate_producer_id(), 0
            self._write_state(TransactionMetadata(tid, pid, epoch, TxnState.EMPTY, timeout_ms=timeout_ms))
            for name in os.listdir(self.directory):
                if name.startswith(f"{tid}.") and name.endswith(".owner"):
                    with suppress(FileNotFoundError):
                        (self.directory / name).unlink()
            return pid, epoch, OwnerLock(self._owner_path(tid, epoch))

    def _checked(
        self, tid: str, producer_id: int, epoch: int, meta: TransactionMetadata | None = None
    ) -> TransactionMetadata:
        """The state of ``tid`` (``meta`` when the caller read it already) if ``producer_id`` and ``epoch``
        are current; else :class:`ProducerFencedError`."""
        meta = self.read_state(tid) if meta is None else meta
        if meta is None or meta.producer_id != producer_id or meta.epoch != epoch:
            now = "no state" if meta is None else f"producer {meta.producer_id} epoch {meta.epoch}"
            raise ProducerFencedError(
                f"transactional id {tid!r}: producer {producer_id} epoch {epoch} is fenced (coordinator has {now})"
            )
        return meta

    def add_partitions(self, tid: str, producer_id: int, epoch: int, partitions: Iterable[tuple[str, int]]) -> None:
        """Durably record that the open transaction writes to ``partitions`` (before it does)."""
        with self._flock(f"{tid}.lock"):
            meta = self._checked(tid, producer_id, epoch)
            wanted = set(partitions)
            if meta.state is TxnState.ONGOING:
                if wanted <= set(meta.partitions):
                    return
                merged = tuple(sorted(set(meta.partitions) | wanted))
                meta = TransactionMetadata(
                    tid, producer_id, epoch, TxnState.ONGOING, merged, meta.txn_start_ms, meta.timeout_ms
                )
            elif meta.state in (TxnState.EMPTY, TxnState.COMPLETE_COMMIT, TxnState.COMPLETE_ABORT):
                meta = TransactionMetadata(
                    tid, producer_id, epoch, TxnState.ONGOING, tuple(sorted(wanted)), now_ms(), meta.timeout_ms
                )
            else:
                raise InvalidTxnStateError(f"transactional id {tid!r} is {meta.state.value}: cannot add partitions")
            self._write_state(meta)

    def end_transaction(
        self, tid: str, producer_id: int, epoch: int, *, commit: bool, bump_epoch: bool = False
    ) -> TransactionMetadata:
        """Commit or abort the open transaction (no-op when none is open). Returns the new state.

        A retry of a call that failed after its decision was stored (the markers could not all be
        written: a full disk) completes the decided outcome, also under the epoch it had before the
        bump it asked for. Asked to abort what is already decided as a commit (or the other way
        round), it completes the decision, which stands, and says so in a warning.
        """
        with self._flock(f"{tid}.lock"):
            meta = self.read_state(tid)
            if meta is not None and _retries_bumped_abort(meta, producer_id, epoch, commit=commit):
                return self._end(meta, commit=False, bump=False) if meta.state.is_open else meta
            meta = self._checked(tid, producer_id, epoch, meta)  # the state read above: one read per call
            if meta.state in (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT):
                decided = meta.state is TxnState.PREPARE_COMMIT
                if decided != commit:
                    asked, decision = ("commit" if commit else "abort"), ("commit" if decided else "abort")
                    log.warning(
                        "transactional id %r: asked to %s a transaction already decided to %s: completing the %s",
                        tid, asked, decision, decision,
                    )  # fmt: skip
                return self._end(meta, commit=decided, bump=False)
            if meta.state is not TxnState.ONGOING:
                if bump_epoch:
                    meta = self._bumped(meta, TxnState.COMPLETE_ABORT, remember=True)
                    self._write_state(meta)
                return meta
            return self._end(meta, commit=commit, bump=bump_epoch, remember=True)

    def _bumped(self, meta: TransactionMetadata, state: TxnState, *, remember: bool = False) -> TransactionMetadata:
        """``meta`` under the next epoch; ``remember``: the producer asked for it (its retry is not fenced)."""
        epoch = min(meta.epoch + 1, MAX_EPOCH + 1)
        return TransactionMetadata(
            meta.transactional_id,
            meta.producer_id,
            epoch,
            state,
            meta.partitions,
            meta.txn_start_ms,
            meta.timeout_ms,
            last_epoch=meta.epoch if remember else -1,
        )

    def _end(
        self, meta: TransactionMetadata, *, commit: bool, bump: bool, remember: bool = False
    ) -> TransactionMetadata:
        """Decide (durably), write the markers, complete. Caller holds ``<tid>.lock``."""
        prepare = TxnState.PREPARE_COMMIT if commit else TxnState.PREPARE_ABORT
        if meta.state is TxnState.ONGOING:
            decided = self._bumped(meta, prepare, remember=remember) if bump else _with_state(meta, prepare)
            self._write_state(decided)  # the commit point
        else:
            decided = meta
        kind = ControlType.COMMIT if decided.state is TxnState.PREPARE_COMMIT else ControlType.ABORT
        for topic, partition in decided.partitions:
            self.log.append(topic, partition, control_batch(kind, decided.producer_id, decided.epoch))
        done = TxnState.COMPLETE_COMMIT if kind is ControlType.COMMIT else TxnState.COMPLETE_ABORT
        complete = _with_state(decided, done)
        self._write_state(complete, durable=False)
        return complete

    # ------------------------------------------------------------------ recovery

    def recover(self, *, now: int | None = None) -> list[TransactionMetadata]:
        """Abort transactions of dead or timed-out producers; complete decided ones.

        Returns the transactions it ended.
        """
        ended = []
        now = now_ms() if now is None else now
        for tid in self.transactional_ids():
            meta = self.read_state(tid)
            if meta is None or not meta.state.is_open:
                continue
            if meta.state is TxnState.ONGOING and (
                self.owner_alive(tid, meta.epoch) and now - meta.txn_start_ms < meta.timeout_ms
            ):
                continue
            with self._flock(f"{tid}.lock"):
                meta = self.read_state(tid)  # again, under the lock
                if meta is None or not meta.state.is_open:
                    continue
                if meta.state is TxnState.ONGOING:
                    if self.owner_alive(tid, meta.epoch) and now - meta.txn_start_ms < meta.timeout_ms:
                        continue
                    ended.append(self._end(meta, commit=False, bump=True))
                else:
                    ended.append(self._end(meta, commit=meta.state is TxnState.PREPARE_COMMIT, bump=False))
        return ended

    def describe(self) -> list[TransactionMetadata]:
        out = []
        for tid in self.transactional_ids():
            meta = self.read_state(tid)
            if meta is not None:
                out.append(meta)
        return out


def _with_state(meta: TransactionMetadata, state: TxnState) -> TransactionMetadata:
    return TransactionMetadata(
        meta.transactional_id,
        meta.producer_id,
        meta.epoch,
        state,
        meta.partitions,
        meta.txn_start_ms,
        meta.timeout_ms,
        last_epoch=meta.last_epoch,
    )


def _retries_bumped_abort(meta: TransactionMetadata, producer_id: int, epoch: int, *, commit: bool) -> bool:
    """Whether an end call is the producer's retry of its own abort that bumped the epoch (its first
    attempt stored the decision, then failed): same producer, the epoch before that bump, an abort."""
    return (
        not commit
        and meta.producer_id == producer_id
        and meta.last_epoch == epoch
        and meta.epoch == epoch + 1
        and meta.state in (TxnState.PREPARE_ABORT, TxnState.COMPLETE_ABORT)
    )


def _last_record(raw: bytes) -> tuple[TransactionMetadata | None, int]:
    """The last whole record of a state file and the length of the valid prefix.

    Walks the framing (length + CRC32C) of every record but decodes only the last one.
    """
    pos = 0
    last: tuple[int, int] | None = None
    while pos + STATE_RECORD.size <= len(raw):
        length, crc = STATE_RECORD.unpack_from(raw, pos)
        start = pos + STATE_RECORD.size
        if start + length > len(raw) or crc32c.crc32c(raw[start : start + length]) != crc:
            break
        last = (start, length)
        pos = start + length
    if last is None:
        return None, 0
    try:
        return TransactionMetadata.from_json(json.loads(raw[last[0] : last[0] + last[1]])), pos
    except (ValueError, KeyError, TypeError):
        return None, last[0] - STATE_RECORD.size  # checksummed but unreadable: treat as torn


__all__ = [
    "DEFAULT_TRANSACTION_TIMEOUT_MS",
    "OwnerLock",
    "TransactionCoordinator",
    "TransactionMetadata",
    "TxnState",
    "control_batch",
]
