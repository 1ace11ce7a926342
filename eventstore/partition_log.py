"""One partition: an ordered list of segments, appended to at the end, read anywhere.

Directory ``<log dir>/<topic>-<n>/``::

    00000000000000000000.log        segments (see eventstore.segment), named by base offset
    00000000000000000000.index      sparse offset index  (eventstore.index)
    00000000000000000000.timeindex  sparse time index
    recovery-point                  where validated data ends (below)
    .lock                           flock: held by a writer for the length of one append
    .clean.lock                     flock: held by compaction and retention (one cleaner at a time)

``recovery-point`` layout (little-endian, 40 bytes)::

    0  version       uint16  = 1
    2  reserved      uint16  = 0
    4  segment_base  int64   the active segment when written
   12  position      int64   bytes [0, position) of that segment are whole, valid batches
   20  next_offset   int64   the offset after the last batch before ``position``
   28  created_ms    int64   wall-clock creation time of that segment (drives ``segment_ms``)
   36  crc32c        uint32  of bytes [0, 36)

``segment_ms`` counts wall-clock time since the segment was created, not record
timestamps (records with old timestamps would otherwise roll a segment per batch); a
segment whose creation time is unknown (no checkpoint for it) counts from when this
process first saw it.

Written at segment roll and on close. A clean close records the end of the data, so
the next open scans nothing (that is the clean-shutdown marker). A missing, torn or
foreign checkpoint is not an error: recovery falls back to scanning the whole active
segment.

Recovery (on the first write-side use in a process, under the lock): validate batches of
the active segment from the checkpoint to the end of the file; truncate a torn tail
(see the crash policy in eventstore.segment); rebuild the active segment's indexes when
it was scanned from byte 0; delete leftovers of interrupted compaction.

Several processes may append to one partition. Each append takes the ``.lock`` flock,
then *refreshes the tail*: if the active segment grew since this process last wrote,
the new bytes were appended by another process, and are validated like recovery would
(a torn tail left by a crashed writer is truncated: the lock proves nobody is writing
it); if a segment named after the next offset exists, another process rolled, and the
writer moves to it. Readers take no lock and never block writers: they read whole,
checksummed batches up to the end of the file.

Durability: with the ``every_batch`` fsync policy (the default) ``append`` returns only
after ``fdatasync`` of the segment. Indexes are not fsynced except at roll (they are
rebuildable). A new segment file is made durable (directory fsync) before use.

Write failures (disk full, I/O errors): an append whose write or fsync fails cuts
whatever part of the batch reached the segment and raises
:class:`~eventstore.errors.LogStorageError` (the batch was not stored; appends work again
once space is back); a failure before the batch is written (roll, transaction files)
raises it too. An index entry that cannot be written is left out (indexes are hints).

Thread-safety: thread-safe. ``_write_lock`` (a ``threading.Lock``) plus the ``.lock``
flock guard the write side; ``_read_lock`` guards the reader's segment list.
"""

from __future__ import annotations

import bisect
import enum
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import crc32c
import pyarrow as pa

from eventstore.errors import (
    CorruptCheckpointError,
    InvalidRecordError,
    LogStorageError,
    OffsetOutOfRangeError,
)
from eventstore.fileio import fsync_dir, pwrite_all, replace_durably
from eventstore.index import OFFSET_ENTRY, TIME_ENTRY, truncate_index_files
from eventstore.producer_state import (
    ABORTED_TXNS_FILE,
    LSO_FILE,
    AbortedIndexReader,
    Check,
    ControlType,
    ProducerStateTable,
    Verdict,
    decode_aborted,
    encode_aborted,
    encode_lso,
    parse_control_key,
    read_cleaner_checkpoint,
    read_lso_file,
    read_snapshot,
    recorded_aborted_entries,
    write_snapshot,
)
from eventstore.producer_state import (
    AbortedTransaction as AbortedTransaction,  # re-exported: readers use it from here
)
from eventstore.record_batch import BatchHeader, EncodedBatch, decode_records, set_base_offset, unpack_header
from eventstore.segment import (
    SegmentReader,
    index_path,
    list_segment_bases,
    log_path,
    scan_batches,
    segment_name,
    time_index_path,
)
from eventstore.topic import TopicConfig

log = logging.getLogger(__name__)

RECOVERY_POINT_FILE = "recovery-point"
LOCK_FILE = ".lock"
CLEAN_LOCK_FILE = ".clean.lock"
RECOVERY_POINT = struct.Struct("<HHqqqqI")
RECOVERY_POINT_VERSION = 1
READER_REFRESH_SECONDS = 1.0


class FsyncMode(enum.Enum):
    EVERY_BATCH = "every_batch"
    INTERVAL = "interval_ms"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class FsyncPolicy:
    """When appended data is made durable (and so when ``append`` may return).

    ``every_batch``: fdatasync before each append returns (default).
    ``interval_ms``: fdatasync when the last one is older than ``interval_ms`` (checked on
    append), and on ``flush``/``close``: an OS crash may lose that much acknowledged data.
    ``none``: only on ``flush``/``close`` and segment roll.
    """

    mode: FsyncMode = FsyncMode.EVERY_BATCH
    interval_ms: int = 0


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Where a batch was stored.

    ``duplicate``: the batch was a retry of one already stored (idempotent producer); the
    offsets are those of the original. A transaction marker for a transaction that is not
    open in this partition is not written: ``base_offset`` is then -1.
    """

    base_offset: int
    last_offset: int
    log_append_time_ms: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class FetchedBatch:
    """One stored batch as read: its header and its record columns (Arrow)."""

    partition: int
    header: BatchHeader
    records: pa.RecordBatch


@dataclass(slots=True)
class _ActiveSegment:
    """The writer's view of the segment it appends to."""

    base_offset: int
    fd: int
    size: int
    next_offset: int
    created_ms: int  # wall-clock creation time (segment_ms counts from here)
    last_index_position: int  # position of the last offset-index entry, -1 if none
    last_index_timestamp: int  # timestamp of the last time-index entry, -1 if none
    index_fd: int
    time_index_fd: int

    def close(self) -> None:
        for fd in (self.fd, self.index_fd, self.time_index_fd):
            os.close(fd)


class PartitionLog:
    """The segments of one partition, with append, read, roll, retention and recovery."""

    def __init__(
        self,
        directory: Path,
        topic: str,
        partition: int,
        config: TopicConfig,
        fsync: FsyncPolicy | None = None,
    ) -> None:
        self.directory = directory
        self.topic = topic
        self.partition = partition
        self.config = config
        self.fsync = fsync or FsyncPolicy()
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._lock_fd: int | None = None
        self._active: _ActiveSegment | None = None
        self._last_fsync = time.monotonic()
        self._dirty = False
        self._readers: dict[int, SegmentReader] = {}
        self._reader_bases: list[int] = []
        self._reader_refreshed = 0.0
        self._producers: ProducerStateTable | None = None  # loaded with the active segment
        self._aborted_reader = AbortedIndexReader(directory)
        self._aborted_lock = threading.Lock()

    # ------------------------------------------------------------------ creation

    @classmethod
    def create(cls, directory: Path) -> None:
        """Make an empty partition directory with its first segment (offset 0)."""
        directory.mkdir(parents=True, exist_ok=True)
        if not list_segment_bases(directory):
            fd = os.open(log_path(directory, 0), os.O_WRONLY | os.O_CREAT, 0o644)
            os.fsync(fd)
            os.close(fd)
        fsync_dir(directory)
        fsync_dir(directory.parent)

    # ------------------------------------------------------------------ locking

    @contextmanager
    def locked(self) -> Iterator[_ActiveSegment]:
        """Hold the write lock (thread + flock) with a fresh view of the tail."""
        with self._write_lock:
            if self._lock_fd is None:
                self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield self._refresh_tail()
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    @contextmanager
    def cleaning(self) -> Iterator[None]:
        """Hold the cleaner lock: one compaction or retention pass at a time, across processes."""
        fd = os.open(self.directory / CLEAN_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ recovery

    def _read_recovery_point(self) -> tuple[int, int, int, int] | None:
        path = self.directory / RECOVERY_POINT_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            if len(raw) != RECOVERY_POINT.size:
                raise CorruptCheckpointError(path, f"{RECOVERY_POINT.size} bytes", len(raw))
            version, _, base, position, next_offset, created_ms, crc = RECOVERY_POINT.unpack(raw)
            if crc != crc32c.crc32c(raw[:-4]):
                raise CorruptCheckpointError(path, f"crc32c {crc32c.crc32c(raw[:-4])}", crc)
            if version != RECOVERY_POINT_VERSION:
                raise CorruptCheckpointError(path, f"version {RECOVERY_POINT_VERSION}", version)
        except CorruptCheckpointError as e:
            log.warning("%s; recovering by scanning the whole active segment", e)
            return None
        return base, position, next_offset, created_ms

    def _write_recovery_point(self, active: _ActiveSegment) -> None:
        body = RECOVERY_POINT.pack(
            RECOVERY_POINT_VERSION, 0, active.base_offset, active.size, active.next_offset, active.created_ms, 0
        )[:-4]
        raw = body + struct.pack("<I", crc32c.crc32c(body))
        replace_durably(self.directory / RECOVERY_POINT_FILE, raw)

    def _remove_leftovers(self) -> None:
        """Delete temporary files of interrupted checkpoint writes; settle compaction leftovers.

        Compaction leftovers are settled only when no cleaner is running (a running one
        owns its ``.cleaned`` files and settles them itself at the start of its pass).
        """
        from eventstore.cleaner import resolve_overlaps

        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):
                with suppress(FileNotFoundError):
                    (self.directory / name).unlink()
        fd = os.open(self.directory / CLEAN_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            resolve_overlaps(self.directory)
        finally:
            os.close(fd)

    def _open_active(self, base: int) -> _ActiveSegment:
        fd = os.open(log_path(self.directory, base), os.O_RDWR | os.O_CREAT, 0o644)
        index_fd = os.open(index_path(self.directory, base), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        time_fd = os.open(time_index_path(self.directory, base), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        created = time.time_ns() // 1_000_000
        checkpoint = self._read_recovery_point()
        if checkpoint is not None and checkpoint[0] == base:
            created = checkpoint[3]
        return _ActiveSegment(base, fd, 0, base, created, -1, -1, index_fd, time_fd)

    def _load_active(self) -> _ActiveSegment:
        """First write-side use in this process: find the active segment and recover it."""
        self._producers = None
        active = self._recover_active()
        self._producers = self._load_producer_state(active)
        self._sync_transaction_files()
        return active

    def _recover_active(self) -> _ActiveSegment:
        self._remove_leftovers()
        bases = list_segment_bases(self.directory)
        if not bases:
            PartitionLog.create(self.directory)
            bases = [0]
        active = self._open_active(bases[-1])
        checkpoint = self._read_recovery_point()
        if checkpoint is not None and checkpoint[0] == active.base_offset:
            _, position, next_offset, _ = checkpoint
            if position <= os.fstat(active.fd).st_size:
                active.size = position
                active.next_offset = next_offset if position else active.base_offset
                self._truncate_indexes(active, active.size)  # drop entries past the data; remember the last
                self._absorb_tail(active)
                return active
        self._absorb_tail(active, rebuild_indexes=True)
        return active

    def _truncate_indexes(self, active: _ActiveSegment, position: int) -> None:
        tail = truncate_index_files(active.index_fd, active.time_index_fd, position)
        active.last_index_position = tail.last_position
        active.last_index_timestamp = tail.last_timestamp

    def _absorb_tail(self, active: _ActiveSegment, *, rebuild_indexes: bool = False) -> None:
        """Validate bytes past ``active.size`` (another process's appends, or a torn tail)."""
        path = log_path(self.directory, active.base_offset)
        start, min_base = (0, active.base_offset) if rebuild_indexes else (active.size, active.next_offset)
        result = scan_batches(active.fd, path, start, min_base_offset=min_base)  # raises before any change
        if rebuild_indexes:
            active.size = 0
            active.next_offset = active.base_offset
            active.last_index_position = -1
            active.last_index_timestamp = -1
            os.ftruncate(active.index_fd, 0)
            os.ftruncate(active.time_index_fd, 0)
        for batch in result.batches:
            self._note_batch(active, batch.position, batch.header)
        if result.torn:
            log.warning(
                "truncating torn tail of %s at byte %d (%d bytes): %s",
                path,
                result.valid_end,
                result.file_size - result.valid_end,
                result.torn_reason,
            )
            os.ftruncate(active.fd, result.valid_end)
            os.fsync(active.fd)
            self._truncate_indexes(active, result.valid_end)

    # ------------------------------------------------------------------ producer state

    def _control_type(self, fd: int, position: int, header: BatchHeader) -> ControlType | None:
        """The marker type of a control batch stored at ``position`` (None for data batches)."""
        if not header.is_control:
            return None
        raw = os.pread(fd, header.size, position)
        records = decode_records(pa.py_buffer(raw), 0, header)
        return parse_control_key(records.column(2)[0].as_py())

    def _fold(self, fd: int, position: int, header: BatchHeader) -> None:
        """Fold a stored batch into the producer state; repair the abort index if needed."""
        table = self._producers
        if table is None or header.base_offset < table.next_offset:
            return
        aborted = table.apply(header, self._control_type(fd, position, header))
        if aborted is not None:
            entry = AbortedTransaction(aborted[0], aborted[1], header.base_offset)
            if entry not in self._aborted_entries():
                # the writer of this marker died before (or while) indexing it
                self._append_aborted(entry)

    def _load_producer_state(self, active: _ActiveSegment) -> ProducerStateTable:
        """The snapshot, caught up with every batch after it (a header scan of the log)."""
        table = read_snapshot(self.directory)
        bases = list_segment_bases(self.directory)
        start = bases[0] if bases else 0
        rebuilt = table is None or table.next_offset > active.next_offset
        if rebuilt:
            if table is not None:
                log.warning("%s-%d: producer-state snapshot ahead of the log; rebuilding", self.topic, self.partition)
            table = ProducerStateTable(start)
        assert table is not None
        table.next_offset = max(table.next_offset, start)
        self._producers = table
        if table.next_offset == active.next_offset:
            return table
        for i, base in enumerate(bases):
            end = bases[i + 1] if i + 1 < len(bases) else None
            if end is not None and end <= table.next_offset:
                continue
            path = log_path(self.directory, base)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                for batch in scan_batches(fd, path, 0, verify_crc=False).batches:
                    self._fold(fd, batch.position, batch.header)
            finally:
                os.close(fd)
        table.next_offset = active.next_offset
        if rebuilt:
            # Compaction dropped the markers below its checkpoint, and every transaction that
            # started there had ended (it only cleans below the LSO): close them.
            cleaned = read_cleaner_checkpoint(self.directory)
            for entry in table.producers.values():
                if 0 <= entry.txn_first_offset < cleaned:
                    entry.txn_first_offset = -1
        return table

    def _append_aborted(self, entry: AbortedTransaction) -> None:
        """Durably index an aborted transaction (before its marker is written)."""
        path = self.directory / ABORTED_TXNS_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            raw = os.pread(fd, size, 0) if size else b""
            _, valid = decode_aborted(raw, path)  # damage before the tail raises: never cut valid entries
            if valid != size:
                os.ftruncate(fd, valid)  # a torn entry of a crashed writer (we hold the lock)
            pwrite_all(fd, encode_aborted(entry), valid)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _write_lso(self, first_unstable: int) -> None:
        """Rewrite the ``lso`` file if it differs; fsync when lowering it (see producer_state)."""
        current = read_lso_file(self.directory)
        if current == first_unstable and (self.directory / LSO_FILE).exists():
            return
        lowering = first_unstable >= 0 and (current < 0 or first_unstable < current)
        fd = os.open(self.directory / LSO_FILE, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            pwrite_all(fd, encode_lso(first_unstable), 0)
            if lowering:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _sync_transaction_files(self) -> None:
        table = self._producers
        if table is None:
            return
        first = table.first_unstable_offset()
        if first >= 0 or (self.directory / LSO_FILE).exists():
            self._write_lso(first)

    def _note_batch(self, active: _ActiveSegment, position: int, header: BatchHeader) -> None:
        """Advance the writer's view past a batch at ``position`` and index it if due."""
        self._fold(active.fd, position, header)
        interval = self.config.index_interval_bytes
        if active.last_index_position < 0 or position - active.last_index_position >= interval:
            rel = header.base_offset - active.base_offset
            if self._write_index_entry(active.index_fd, OFFSET_ENTRY.pack(rel, position)):
                active.last_index_position = position
            if header.max_timestamp > active.last_index_timestamp and self._write_index_entry(
                active.time_index_fd, TIME_ENTRY.pack(header.max_timestamp, rel)
            ):
                active.last_index_timestamp = header.max_timestamp
        active.size = position + header.size
        active.next_offset = header.next_offset

    def _write_index_entry(self, fd: int, entry: bytes) -> bool:
        """Append an index entry; on failure (disk full) cut any part of it and go on without it.

        The batch it points to is already stored: indexes are hints, a missing entry only
        makes lookups start earlier.
        """
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, entry) == len(entry):
                return True
        except OSError as e:
            log.warning("%s-%d: index entry not written (%s); lookups scan further", self.topic, self.partition, e)
        with suppress(OSError):
            os.ftruncate(fd, size)
        return False

    def _refresh_tail(self) -> _ActiveSegment:
        active = self._active
        if active is None:
            active = self._active = self._load_active()
        while True:
            if os.fstat(active.fd).st_size != active.size:
                self._absorb_tail(active)
                self._sync_transaction_files()
            successor = log_path(self.directory, active.next_offset)
            if active.next_offset == active.base_offset or not successor.exists():
                return active
            # another process rolled: continue in the segment it created
            active.close()
            active = self._active = self._open_active(active.next_offset)
            self._absorb_tail(active, rebuild_indexes=True)
            self._sync_transaction_files()

    # ------------------------------------------------------------------ append

    def append(self, batch: EncodedBatch | bytearray) -> AppendResult:
        """Append one encoded batch (its base offset is assigned here) and make it durable.

        Returns once the batch is durable under the fsync policy.
        """
        if len(batch) > self.config.max_batch_bytes:
            raise InvalidRecordError(
                f"batch of {len(batch)} bytes exceeds max_batch_bytes={self.config.max_batch_bytes} "
                f"of topic {self.topic!r}"
            )
        incoming = unpack_header(batch)
        control_type = None
        if incoming.is_control:
            control_type = parse_control_key(decode_records(pa.py_buffer(batch), 0, incoming).column(2)[0].as_py())
        with self.locked() as active:
            now = time.time_ns() // 1_000_000
            assert self._producers is not None
            check = self._producers.check(incoming, control_type, f"{self.topic}-{self.partition}")
            if check.verdict is Verdict.DUPLICATE:
                return AppendResult(check.base_offset, check.last_offset, now, duplicate=True)
            if check.verdict is Verdict.NOOP:
                return AppendResult(-1, -1, now)
            try:
                if self._should_roll(active, len(batch), now):
                    active = self._roll(active)
                self._before_write(active, incoming, control_type, check)
            except OSError as e:  # nothing of the batch was written
                raise LogStorageError(self.directory, e) from e
            set_base_offset(batch, active.next_offset)
            position = active.size
            try:
                self._write_batch(active, batch, position)
            except OSError as e:
                self._cut_partial_write(active, position)
                raise LogStorageError(log_path(self.directory, active.base_offset), e) from e
            stored = unpack_header(batch)
            self._note_batch(active, position, stored)
            if stored.is_control:
                try:
                    self._sync_transaction_files()  # the transaction closed: the LSO may move up
                except OSError as e:  # a retry of the marker finds the transaction closed here and moves on
                    what = "the marker is stored, the last stable offset not yet"
                    raise LogStorageError(self.directory / LSO_FILE, e, what=what) from e
            return AppendResult(stored.base_offset, stored.last_offset, now)

    def _write_batch(self, active: _ActiveSegment, batch: EncodedBatch | bytearray, position: int) -> None:
        pwrite_all(active.fd, batch, position)
        self._dirty = True
        self._maybe_fsync(active)

    def _cut_partial_write(self, active: _ActiveSegment, position: int) -> None:
        """A write or fsync failed (e.g. ENOSPC): remove what part of the batch reached the file.

        The batch was not acknowledged; cutting it keeps the segment whole (and frees the
        space it took). If even that fails, the next append's tail refresh validates the
        bytes like any other writer's: a torn batch is truncated, a whole one kept (the
        producer, told the outcome is unknown, then uses a new producer id).
        """
        try:
            os.ftruncate(active.fd, position)
            os.fdatasync(active.fd)
        except OSError as e:
            log.error("could not cut a failed append from %s: %s", log_path(self.directory, active.base_offset), e)

    def _before_write(
        self, active: _ActiveSegment, header: BatchHeader, control_type: ControlType | None, check: Check
    ) -> None:
        """Make transaction bookkeeping durable before the batch that needs it is written.

        A batch opening a transaction lowers the ``lso`` file first (readers must never
        see it as stable); an abort marker is indexed in ``aborted-txns`` first (readers
        that see the marker must find the entry). Both are fsynced whatever the policy.
        """
        assert self._producers is not None
        if check.opens_transaction:
            current = self._producers.first_unstable_offset()
            self._write_lso(active.next_offset if current < 0 else min(current, active.next_offset))
        if control_type is ControlType.ABORT:
            first = self._producers.open_transaction_first_offset(header.producer_id)
            if first >= 0:  # a fencing marker where nothing is open aborts nothing: no range to index
                self._append_aborted(AbortedTransaction(header.producer_id, first, active.next_offset))

    def _maybe_fsync(self, active: _ActiveSegment) -> None:
        mode = self.fsync.mode
        if mode is FsyncMode.EVERY_BATCH or (
            mode is FsyncMode.INTERVAL and (time.monotonic() - self._last_fsync) * 1000 >= self.fsync.interval_ms
        ):
            os.fdatasync(active.fd)
            self._last_fsync = time.monotonic()
            self._dirty = False

    def _should_roll(self, active: _ActiveSegment, incoming: int, now_ms: int) -> bool:
        if active.size == 0:
            return False
        if active.size + incoming > self.config.segment_bytes:
            return True
        return now_ms - active.created_ms >= self.config.segment_ms

    def _roll(self, active: _ActiveSegment) -> _ActiveSegment:
        """Close the active segment durably and start a new one at the next offset."""
        os.fdatasync(active.fd)
        os.fsync(active.index_fd)
        os.fsync(active.time_index_fd)
        new_base = active.next_offset
        fd = os.open(log_path(self.directory, new_base), os.O_RDWR | os.O_CREAT, 0o644)
        os.close(fd)
        fsync_dir(self.directory)
        active.close()
        new_active = self._active = self._open_active(new_base)
        new_active.created_ms = time.time_ns() // 1_000_000
        self.invalidate_readers()  # readers in this process: list segments again
        if self._producers is not None:
            write_snapshot(self.directory, self._producers, aborted_entries=self._aborted_count())
        self._write_recovery_point(new_active)
        log.debug("rolled %s-%d to segment %s", self.topic, self.partition, segment_name(new_base))
        return new_active

    def roll(self) -> None:
        """Force a roll (e.g. before compaction in tests), if the active segment has data."""
        with self.locked() as active:
            if active.size:
                self._roll(active)

    def flush(self) -> None:
        """fdatasync the active segment now (whatever the policy)."""
        with self._write_lock:
            active = self._active
            if active is not None and self._dirty:
                os.fdatasync(active.fd)
                self._dirty = False
                self._last_fsync = time.monotonic()

    def close(self) -> None:
        """Flush, record the clean end of data (recovery point) and release files."""
        if self._active is not None:
            with self.locked() as active:
                os.fdatasync(active.fd)
                if self._producers is not None:
                    write_snapshot(self.directory, self._producers, aborted_entries=self._aborted_count())
                self._write_recovery_point(active)
                active.close()
                self._active = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        with self._read_lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()
            self._reader_bases = []

    # ------------------------------------------------------------------ read

    def _refresh_readers(self) -> None:
        bases = list_segment_bases(self.directory)
        for base, reader in list(self._readers.items()):
            try:
                replaced = os.stat(reader.path).st_ino != reader.inode
            except FileNotFoundError:
                replaced = True
            if base not in bases or replaced:
                reader.close()
                del self._readers[base]
        self._reader_bases = bases
        self._reader_refreshed = time.monotonic()

    def invalidate_readers(self) -> None:
        """Segments were deleted or replaced (retention, compaction): list them again on next read."""
        with self._read_lock:
            self._reader_refreshed = 0.0

    def _segments(self, *, refresh: bool = False) -> list[int]:
        with self._read_lock:
            if refresh or time.monotonic() - self._reader_refreshed > READER_REFRESH_SECONDS:
                self._refresh_readers()
            return list(self._reader_bases)

    def _reader(self, base: int) -> SegmentReader | None:
        with self._read_lock:
            reader = self._readers.get(base)
            if reader is None:
                try:
                    reader = SegmentReader(self.directory, base)
                except FileNotFoundError:
                    return None
                self._readers[base] = reader
            return reader

    def log_start_offset(self) -> int:
        bases = self._segments()
        if not bases:
            bases = self._segments(refresh=True)
        return bases[0] if bases else 0

    def log_end_offset(self) -> int:
        """The offset the next appended record will get (as far as the data on disk shows)."""
        refresh = False
        while True:
            bases = self._segments(refresh=refresh)
            reader = self._reader(bases[-1]) if bases else None
            if reader is None:
                if refresh:
                    return 0
                refresh = True
                continue
            end = reader.end_offset()
            if end == reader.base_offset or not log_path(self.directory, end).exists():
                return end
            refresh = True  # a writer rolled to a segment named after our end offset

    def last_stable_offset(self) -> int:
        """The offset below which no transaction is open (read_committed consumers stop here).

        Equals :meth:`log_end_offset` when no transaction is open in this partition.
        """
        # Order matters: the end first, then the lso file. A writer lowers the lso file
        # before writing a batch that opens a transaction, so an end that includes such a
        # batch is always read together with an lso value at or below it.
        end = self.log_end_offset()
        first_unstable = read_lso_file(self.directory)
        return end if first_unstable < 0 else min(first_unstable, end)

    def aborted_transactions(self, start_offset: int, end_offset: int) -> list[AbortedTransaction]:
        """Aborted transactions whose range overlaps ``[start_offset, end_offset)``.

        A transactional batch of producer ``producer_id`` with
        ``first_offset <= base_offset <= last_offset`` belongs to an aborted transaction.
        """
        return [a for a in self._aborted_entries() if a.first_offset < end_offset and a.last_offset >= start_offset]

    def _aborted_count(self) -> int:
        """Entries in ``aborted-txns`` now, for the snapshot; a damaged file keeps the count recorded before
        (so readers go on refusing it), and never stops a roll or a close."""
        try:
            return len(self._aborted_entries())
        except CorruptCheckpointError:
            return recorded_aborted_entries(self.directory)

    def _aborted_entries(self) -> list[AbortedTransaction]:
        with self._aborted_lock:
            return list(self._aborted_reader.entries())

    def read(self, offset: int, *, max_bytes: int = 1 << 20) -> list[FetchedBatch]:
        """Whole batches holding offsets ≥ ``offset`` (the first may start before it).

        Returns ``[]`` at the end of the log. Raises :class:`OffsetOutOfRangeError` below
        the log start offset (removed by retention).
        """
        for refresh in (False, True):
            bases = self._segments(refresh=refresh)
            if not bases or offset < bases[0]:
                continue
            vanished = False
            for base in bases[bisect.bisect_right(bases, offset) - 1 :]:
                reader = self._reader(base)
                if reader is None:
                    vanished = True  # removed by retention or compaction: list again
                    break
                position = reader.position_of(max(offset, base))
                batches = reader.read_batches(position, max_bytes, active=base == bases[-1])
                if batches:
                    return [FetchedBatch(self.partition, h, r) for h, r in batches]
            if refresh and not vanished:
                return []
        start = self.log_start_offset()
        if offset < start:
            raise OffsetOutOfRangeError(
                f"offset {offset} of {self.topic}-{self.partition} is below the log start offset {start}"
            )
        return []

    def offset_for_time(self, timestamp: int) -> int | None:
        """Base offset of the first batch with a record at or after ``timestamp``, or None."""
        for base in self._segments(refresh=True):
            reader = self._reader(base)
            if reader is None:
                continue
            pos = reader.position_of_time(timestamp)
            header = reader.header_at(pos)
            if header is not None:
                return header.base_offset
        return None

    def size_bytes(self) -> int:
        total = 0
        for base in self._segments(refresh=True):
            with suppress(FileNotFoundError):
                total += log_path(self.directory, base).stat().st_size
        return total
