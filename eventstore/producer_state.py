"""Per-partition producer state: sequence dedupe, epoch fencing and open transactions.

Everything here is *derived from the batches of the partition*: every batch header
carries ``producer_id``, ``producer_epoch``, ``base_sequence`` and the transactional and
control bits. The writer of a partition folds each batch it appends, and each batch it
finds appended by another process, into a :class:`ProducerStateTable`, and checks every
incoming batch of an idempotent producer against it (Kafka's ``ProducerStateManager``):

* same epoch, ``base_sequence`` = last sequence + 1: appended;
* same epoch, the same sequence range as one of the last :data:`DEDUPE_WINDOW` batches:
  a **duplicate** (a retry whose acknowledgement was lost) — not appended again, the
  original offsets are returned;
* same epoch, any other sequence: :class:`OutOfOrderSequenceError`;
* lower epoch: :class:`ProducerFencedError` (a newer instance of the same transactional
  producer exists); higher epoch: accepted only from sequence 0.

Transactions: the first transactional batch of a producer opens its transaction in this
partition at that batch's base offset; a control batch (commit or abort marker) closes
it. A marker of a newer epoch is stored even where that producer has nothing open: it
records the bump, so a fenced instance's append still in flight is refused here too
(Kafka writes its markers the same way). The **last stable offset** (LSO) is the first offset of the earliest open
transaction, or the log end when none is open; ``read_committed`` readers stop there.

Files in the partition directory (see also :mod:`eventstore.partition_log`)::

    producer-state   snapshot of the table, written at segment roll and clean close:
                     one JSON document + "\\n" + its CRC32C as 8 hex digits + "\\n";
                     "next_offset" says which offsets it covers. Missing or damaged:
                     the table is rebuilt by scanning the batch headers of the log.
    aborted-txns     append-only, 28-byte little-endian entries ``<qqqI``:
                     producer_id, first_offset, last_offset (offset of the abort
                     marker), CRC32C of the first 24 bytes. Written and fsynced *before*
                     the abort marker itself, so a reader that sees the marker always
                     finds the entry. A torn (partial) last entry is ignored (and cut by
                     the writer); an entry superseded by a later one for the same
                     transaction (same producer, same first offset) is harmless. Damage
                     is refused, never read around (the aborted data would read as
                     committed): a whole entry failing its CRC, or fewer entries than the
                     ``producer-state`` snapshot's ``aborted_entries``, raise
                     CorruptCheckpointError naming the file (and the entry's byte);
                     deleting both files with no writer running makes the next writer
                     rebuild them from the log.
    cleaner-checkpoint  12 bytes ``<qI``: compaction has cleaned (and dropped the
                     transaction markers of) every offset below this one; CRC32C. Every
                     transaction that started below it had ended (compaction stays below
                     the LSO), which is what a rebuild from scratch needs to know once the
                     markers are gone. Written durably before a cleaned segment is swapped in.
    lso              12 bytes ``<qI``: the first unstable offset (-1: none open) and its
                     CRC32C. Lowered and fsynced *before* the batch that opens a
                     transaction is written; raised after the marker that closes it. A
                     crash can leave it too low (readers wait until the next writer or
                     recovery rewrites it), never too high.

Memory: one entry per producer id seen in the partition, no expiry yet (a producer that
never comes back costs ~200 bytes).

Thread-safety: none; the partition's write lock guards the table.
"""

from __future__ import annotations

import enum
import json
import os
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import crc32c

from eventstore.errors import (
    CorruptCheckpointError,
    InvalidTxnStateError,
    OutOfOrderSequenceError,
    ProducerFencedError,
)
from eventstore.fileio import replace_durably
from eventstore.record_batch import NO_PRODUCER_ID, BatchHeader

PRODUCER_STATE_FILE = "producer-state"
ABORTED_TXNS_FILE = "aborted-txns"
LSO_FILE = "lso"
CLEANER_CHECKPOINT_FILE = "cleaner-checkpoint"
DEDUPE_WINDOW = 5
SEQUENCE_LIMIT = 1 << 31  # sequences wrap to 0 after 2**31 - 1, as in Kafka
ABORTED_ENTRY = struct.Struct("<qqqI")
LSO_ENTRY = struct.Struct("<qI")
SNAPSHOT_VERSION = 1


class ControlType(enum.IntEnum):
    """Record key of a control batch (Kafka's numbers): which way a transaction ended."""

    ABORT = 0
    COMMIT = 1


CONTROL_KEY = struct.Struct(">hh")  # version 0, type


def control_key(kind: ControlType) -> bytes:
    return CONTROL_KEY.pack(0, int(kind))


def parse_control_key(key: bytes | None) -> ControlType:
    if key is None or len(key) != CONTROL_KEY.size:
        raise InvalidTxnStateError(f"control record key {key!r} is not a transaction marker")
    _, kind = CONTROL_KEY.unpack(key)
    return ControlType(kind)


def next_sequence(sequence: int, count: int) -> int:
    return (sequence + count) % SEQUENCE_LIMIT


@dataclass(slots=True)
class _BatchSpan:
    first_sequence: int
    last_sequence: int
    base_offset: int
    last_offset: int


@dataclass(slots=True)
class ProducerEntry:
    """What the partition knows about one producer id."""

    epoch: int
    last_sequence: int = -1  # -1: no data batch seen in this epoch
    recent: deque[_BatchSpan] = field(default_factory=lambda: deque(maxlen=DEDUPE_WINDOW))
    txn_first_offset: int = -1  # -1: no open transaction in this partition
    last_timestamp: int = -1


class Verdict(enum.Enum):
    APPEND = "append"
    DUPLICATE = "duplicate"  # a retry of a stored batch: return its offsets
    NOOP = "noop"  # a marker for a transaction that is not open here: nothing to write


@dataclass(frozen=True, slots=True)
class Check:
    verdict: Verdict
    base_offset: int = -1
    last_offset: int = -1
    opens_transaction: bool = False


@dataclass(slots=True)
class ProducerStateTable:
    """The producers of one partition, folded from its batches up to ``next_offset``."""

    next_offset: int = 0
    producers: dict[int, ProducerEntry] = field(default_factory=dict)

    # ------------------------------------------------------------------ checks

    def check(self, header: BatchHeader, control_type: ControlType | None, topic_partition: str) -> Check:
        """Decide what to do with a batch about to be appended by this process."""
        pid = header.producer_id
        if pid == NO_PRODUCER_ID:
            return Check(Verdict.APPEND)
        entry = self.producers.get(pid)
        if entry is not None and header.producer_epoch < entry.epoch:
            raise ProducerFencedError(
                f"producer {pid} epoch {header.producer_epoch} is fenced by epoch {entry.epoch} in {topic_partition}"
            )
        if header.is_control:
            open_here = entry is not None and entry.txn_first_offset >= 0
            # A marker of a newer epoch is stored even with nothing open here: it is what fences the older
            # epoch in this partition. Without it, a fenced instance's append still in flight when its
            # transaction was aborted would land after the abort, open a transaction under the shared
            # producer id, and the new instance's next commit marker would commit it.
            fences = entry is None or header.producer_epoch > entry.epoch
            return Check(Verdict.APPEND if open_here or fences else Verdict.NOOP)
        if entry is not None and header.producer_epoch == entry.epoch:
            last_seq = next_sequence(header.base_sequence, header.record_count - 1)
            for span in entry.recent:
                if span.first_sequence == header.base_sequence and span.last_sequence == last_seq:
                    return Check(Verdict.DUPLICATE, span.base_offset, span.last_offset)
            expected = next_sequence(entry.last_sequence, 1)
            if header.base_sequence != expected:
                raise OutOfOrderSequenceError(
                    f"producer {pid} epoch {header.producer_epoch} sent sequence {header.base_sequence} to "
                    f"{topic_partition}, expected {expected}"
                )
        elif entry is not None and header.base_sequence != 0:
            raise OutOfOrderSequenceError(
                f"producer {pid} epoch {header.producer_epoch} is new in {topic_partition} and must start at "
                f"sequence 0, not {header.base_sequence}"
            )
        txn_open = entry is not None and entry.txn_first_offset >= 0 and entry.epoch == header.producer_epoch
        if not header.is_transactional and entry is not None and entry.txn_first_offset >= 0:
            raise InvalidTxnStateError(
                f"producer {pid} sent a non-transactional batch to {topic_partition} inside an open transaction"
            )
        return Check(Verdict.APPEND, opens_transaction=header.is_transactional and not txn_open)

    # ------------------------------------------------------------------ folding

    def apply(self, header: BatchHeader, control_type: ControlType | None) -> tuple[int, int] | None:
        """Fold a stored batch in. Returns ``(producer_id, first_offset)`` when it aborts a transaction."""
        if header.base_offset < self.next_offset:
            return None  # already folded (a snapshot covers it)
        self.next_offset = header.next_offset
        pid = header.producer_id
        if pid == NO_PRODUCER_ID:
            return None
        entry = self.producers.get(pid)
        if entry is None:
            entry = self.producers[pid] = ProducerEntry(header.producer_epoch)
        if header.producer_epoch > entry.epoch:
            entry.epoch = header.producer_epoch
            entry.last_sequence = -1
            entry.recent.clear()
        entry.last_timestamp = max(entry.last_timestamp, header.max_timestamp)
        if header.is_control:
            aborted = None
            if control_type is ControlType.ABORT and entry.txn_first_offset >= 0:
                aborted = (pid, entry.txn_first_offset)
            entry.txn_first_offset = -1
            return aborted
        if header.base_sequence >= 0:
            last_seq = next_sequence(header.base_sequence, header.record_count - 1)
            entry.last_sequence = last_seq
            entry.recent.append(_BatchSpan(header.base_sequence, last_seq, header.base_offset, header.last_offset))
        if header.is_transactional and entry.txn_first_offset < 0:
            entry.txn_first_offset = header.base_offset
        return None

    def first_unstable_offset(self) -> int:
        """First offset of the earliest open transaction, -1 when none is open."""
        firsts = [e.txn_first_offset for e in self.producers.values() if e.txn_first_offset >= 0]
        return min(firsts) if firsts else -1

    def open_transaction_first_offset(self, producer_id: int) -> int:
        entry = self.producers.get(producer_id)
        return entry.txn_first_offset if entry is not None else -1

    # ------------------------------------------------------------------ snapshot

    def to_json(self) -> dict[str, object]:
        return {
            "version": SNAPSHOT_VERSION,
            "next_offset": self.next_offset,
            "producers": {
                str(pid): {
                    "epoch": e.epoch,
                    "last_sequence": e.last_sequence,
                    "recent": [[s.first_sequence, s.last_sequence, s.base_offset, s.last_offset] for s in e.recent],
                    "txn_first_offset": e.txn_first_offset,
                    "last_timestamp": e.last_timestamp,
                }
                for pid, e in sorted(self.producers.items())
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> ProducerStateTable:
        producers: dict[int, ProducerEntry] = {}
        raw = data["producers"]
        assert isinstance(raw, dict)
        for pid, e in raw.items():
            entry = ProducerEntry(int(e["epoch"]), int(e["last_sequence"]))
            for s in e["recent"]:
                entry.recent.append(_BatchSpan(int(s[0]), int(s[1]), int(s[2]), int(s[3])))
            entry.txn_first_offset = int(e["txn_first_offset"])
            entry.last_timestamp = int(e["last_timestamp"])
            producers[int(pid)] = entry
        next_offset = data["next_offset"]
        assert isinstance(next_offset, int)
        return cls(next_offset, producers)


def write_snapshot(directory: Path, table: ProducerStateTable, *, aborted_entries: int = 0) -> None:
    """``aborted_entries``: how many entries ``aborted-txns`` holds now (readers check the file never has fewer)."""
    data = table.to_json()
    data["aborted_entries"] = aborted_entries
    body = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    replace_durably(directory / PRODUCER_STATE_FILE, body + b"\n" + b"%08x\n" % crc32c.crc32c(body))


def read_snapshot(directory: Path) -> ProducerStateTable | None:
    """The snapshot, or None when missing or damaged (the caller rebuilds from the log)."""
    try:
        raw = (directory / PRODUCER_STATE_FILE).read_bytes()
    except FileNotFoundError:
        return None
    try:
        body, crc_line, _ = raw.split(b"\n")
        if int(crc_line, 16) != crc32c.crc32c(body):
            return None
        data = json.loads(body)
        if data.get("version") != SNAPSHOT_VERSION:
            return None
        return ProducerStateTable.from_json(data)
    except (ValueError, KeyError, TypeError, AssertionError):
        return None


# ---------------------------------------------------------------------- aborted-txns


@dataclass(frozen=True, slots=True)
class AbortedTransaction:
    """An aborted transaction in one partition: its producer and offset range.

    ``last_offset`` is the offset of the abort marker (a control batch). A transactional
    batch of ``producer_id`` with ``first_offset <= base_offset <= last_offset`` is aborted.
    """

    producer_id: int
    first_offset: int
    last_offset: int


def encode_aborted(entry: AbortedTransaction) -> bytes:
    body = ABORTED_ENTRY.pack(entry.producer_id, entry.first_offset, entry.last_offset, 0)[:-4]
    return body + struct.pack("<I", crc32c.crc32c(body))


def decode_aborted(raw: bytes, path: Path | None = None, base: int = 0) -> tuple[list[AbortedTransaction], int]:
    """Entries of an ``aborted-txns`` file (bytes from ``base`` on) and the length of its valid prefix.

    A trailing partial entry is a torn write (ignored). A *whole* entry that fails its
    checksum is damage: :class:`CorruptCheckpointError` names ``path`` and the entry's
    byte position (entries after it would be lost, and their aborted data read as
    committed). Without ``path`` (a writer checking its own tail) it just ends the prefix.
    """
    out = []
    size = ABORTED_ENTRY.size
    valid = 0
    for pos in range(0, len(raw) - size + 1, size):
        pid, first, last, crc = ABORTED_ENTRY.unpack_from(raw, pos)
        if crc != crc32c.crc32c(raw[pos : pos + size - 4]):
            if path is not None:
                raise CorruptCheckpointError(
                    path,
                    f"a valid entry at byte {base + pos} (delete {ABORTED_TXNS_FILE} and {PRODUCER_STATE_FILE} "
                    "with no writer running: the next writer rebuilds both from the log)",
                    f"crc32c mismatch at byte {base + pos}",
                )
            break
        out.append(AbortedTransaction(pid, first, last))
        valid = pos + size
    return out, valid


def recorded_aborted_entries(directory: Path) -> int:
    """How many ``aborted-txns`` entries existed when the producer-state snapshot was written (0: unknown)."""
    try:
        raw = (directory / PRODUCER_STATE_FILE).read_bytes()
        body, crc_line, _ = raw.split(b"\n")
        if int(crc_line, 16) != crc32c.crc32c(body):
            return 0
        return int(json.loads(body).get("aborted_entries", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


class AbortedIndexReader:
    """Reads ``aborted-txns`` incrementally (it only grows, except for a torn tail).

    Damage is refused, never read around (:func:`decode_aborted`): a whole entry with a
    bad checksum, or fewer entries than the producer-state snapshot recorded (the file
    was cut), raise :class:`CorruptCheckpointError` naming the file.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / ABORTED_TXNS_FILE
        self._entries: list[AbortedTransaction] = []
        self._valid = 0
        self._snapshot_identity: tuple[int, int] = (-1, -1)
        self._recorded = 0

    def _check_count(self) -> None:
        try:
            st = os.stat(self.directory / PRODUCER_STATE_FILE)
            identity = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            identity = (0, 0)
        if identity != self._snapshot_identity:
            self._snapshot_identity = identity
            self._recorded = recorded_aborted_entries(self.directory) if identity != (0, 0) else 0
        if len(self._entries) < self._recorded:
            raise CorruptCheckpointError(
                self.path,
                f"at least {self._recorded} entries (recorded in {PRODUCER_STATE_FILE}; delete both files with no "
                "writer running to rebuild them from the log)",
                f"{len(self._entries)} entries ({self._valid} bytes)",
            )

    def entries(self) -> list[AbortedTransaction]:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = 0
        if size < self._valid:  # cut by a writer (torn tail): read it again from the start
            self._entries, self._valid = [], 0
        if size - self._valid >= ABORTED_ENTRY.size:
            for attempt in range(2):
                with open(self.path, "rb") as f:
                    f.seek(self._valid)
                    raw = f.read(size - self._valid)
                try:
                    new, valid = decode_aborted(raw, self.path, self._valid)
                    break
                except CorruptCheckpointError:
                    if attempt:
                        raise
                    time.sleep(0.001)  # perhaps an entry being written as we read: look once more
            self._entries.extend(new)
            self._valid += valid
        self._check_count()
        return self._entries


def read_lso_file(directory: Path) -> int:
    """First unstable offset recorded in ``lso`` (-1: no open transaction or no file)."""
    try:
        with open(directory / LSO_FILE, "rb") as f:
            raw = f.read(LSO_ENTRY.size)
    except FileNotFoundError:
        return -1
    for _ in range(2):
        if len(raw) == LSO_ENTRY.size:
            value, crc = LSO_ENTRY.unpack(raw)
            if crc == crc32c.crc32c(raw[:8]):
                return int(value)
        with open(directory / LSO_FILE, "rb") as f:  # raced with a rewrite: once more
            raw = f.read(LSO_ENTRY.size)
    return 0  # unreadable: the safest answer is "nothing is stable" until a writer rewrites it


def encode_lso(first_unstable: int) -> bytes:
    body = struct.pack("<q", first_unstable)
    return body + struct.pack("<I", crc32c.crc32c(body))


def read_cleaner_checkpoint(directory: Path) -> int:
    """Offset below which compaction has dropped transaction markers (0: none, or unreadable)."""
    try:
        raw = (directory / CLEANER_CHECKPOINT_FILE).read_bytes()
    except FileNotFoundError:
        return 0
    if len(raw) != LSO_ENTRY.size:
        return 0
    value, crc = LSO_ENTRY.unpack(raw)
    return int(value) if crc == crc32c.crc32c(raw[:8]) else 0


def write_cleaner_checkpoint(directory: Path, offset: int) -> None:
    if offset > read_cleaner_checkpoint(directory):
        body = struct.pack("<q", offset)
        replace_durably(directory / CLEANER_CHECKPOINT_FILE, body + struct.pack("<I", crc32c.crc32c(body)))
