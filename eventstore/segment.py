"""One segment of a partition: ``<base offset, 20 digits>.log`` and its two indexes.

A segment file is a plain concatenation of record batches (layout in
:mod:`eventstore.record_batch`). Its name is the base offset of the segment:

    base offset ≤ first offset stored in the segment, and
    base offset > every offset stored in the previous segment.

Compaction may leave a segment holding fewer offsets than its span (gaps), never
offsets outside it.

Crash policy (applied by :func:`scan_batches`, used by recovery and by writers that
find bytes appended by another process):

* a partial header, or a sound header whose batch runs past the end of the file, is a
  **torn tail**: the file is truncated at that batch;
* a broken header followed only by zero bytes (a file extended but not written before
  an OS crash) is a torn tail too;
* a complete batch whose checksum fails and that ends exactly at the end of the file is
  a torn tail (a last write that did not reach the disk whole);
* anything else that fails validation is **corruption**: :class:`CorruptLogError`
  names the file and byte position, and nothing is modified.

Thread-safety: :class:`SegmentReader` is safe for concurrent readers (it only uses
``pread``; its index cache is refreshed under its own lock). Writes to segments happen
in :mod:`eventstore.partition_log` under the partition lock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from eventstore.errors import CorruptLogError
from eventstore.index import OffsetIndex, TimeIndex
from eventstore.record_batch import (
    HEADER_SIZE,
    BatchHeader,
    crc_matches,
    decode_records,
    header_problem,
    unpack_header,
)

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
TIME_INDEX_SUFFIX = ".timeindex"
CLEANED_SUFFIX = ".cleaned"  # compaction output not yet swapped in: deleted on open
SCAN_CHUNK = 4 << 20


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}"


def log_path(directory: Path, base_offset: int) -> Path:
    return directory / (segment_name(base_offset) + LOG_SUFFIX)


def index_path(directory: Path, base_offset: int) -> Path:
    return directory / (segment_name(base_offset) + INDEX_SUFFIX)


def time_index_path(directory: Path, base_offset: int) -> Path:
    return directory / (segment_name(base_offset) + TIME_INDEX_SUFFIX)


def list_segment_bases(directory: Path) -> list[int]:
    """Base offsets of the ``.log`` files in ``directory``, ascending."""
    bases = []
    for name in os.listdir(directory):
        if name.endswith(LOG_SUFFIX) and len(name) == 20 + len(LOG_SUFFIX) and name[:20].isdigit():
            bases.append(int(name[:20]))
    bases.sort()
    return bases


@dataclass(frozen=True, slots=True)
class ScannedBatch:
    """A validated batch found by :func:`scan_batches`: its header and byte position."""

    position: int
    header: BatchHeader


@dataclass(slots=True)
class ScanResult:
    """Outcome of validating a segment from some position to its end."""

    batches: list[ScannedBatch]
    valid_end: int  # bytes [start, valid_end) are whole, valid batches
    file_size: int
    torn_reason: str | None  # why bytes from valid_end on are a torn tail, if any

    @property
    def torn(self) -> bool:
        return self.valid_end < self.file_size


def _all_zero(fd: int, start: int, end: int) -> bool:
    pos = start
    while pos < end:
        chunk = os.pread(fd, min(SCAN_CHUNK, end - pos), pos)
        if not chunk or chunk.count(0) != len(chunk):
            return False
        pos += len(chunk)
    return True


def scan_batches(fd: int, path: Path, start: int, *, min_base_offset: int = 0, verify_crc: bool = True) -> ScanResult:
    """Validate the batches of a segment from byte ``start`` to the end of the file.

    Raises :class:`CorruptLogError` for damage that is not a torn tail (see the module
    docstring); never modifies the file.
    """
    size = os.fstat(fd).st_size
    batches: list[ScannedBatch] = []
    pos = start
    expected_min = min_base_offset
    buf = b""
    buf_start = start
    while pos < size:
        if size - pos < HEADER_SIZE:
            return ScanResult(batches, pos, size, "partial batch header at end of file")
        if pos + HEADER_SIZE > buf_start + len(buf):
            buf = os.pread(fd, SCAN_CHUNK, pos)
            buf_start = pos
        header = unpack_header(buf, pos - buf_start)
        problem = header_problem(buf, pos - buf_start, header)
        if problem is not None:
            if _all_zero(fd, pos, size):
                return ScanResult(batches, pos, size, "zero-filled tail")
            raise CorruptLogError(path, pos, problem)
        end = pos + header.size
        if end > size:
            return ScanResult(batches, pos, size, "last batch runs past the end of the file")
        if header.base_offset < expected_min:
            raise CorruptLogError(path, pos, f"batch base offset {header.base_offset} < expected ≥ {expected_min}")
        if verify_crc:
            if end > buf_start + len(buf):
                buf = os.pread(fd, max(SCAN_CHUNK, header.size), pos)
                buf_start = pos
            if not crc_matches(buf, pos - buf_start, header):
                if end == size:
                    return ScanResult(batches, pos, size, "checksum mismatch in the last batch")
                raise CorruptLogError(path, pos, "checksum mismatch")
        batches.append(ScannedBatch(pos, header))
        expected_min = header.next_offset
        pos = end
    return ScanResult(batches, pos, size, None)


class SegmentReader:
    """Read access to one segment file, with its offset and time index as hints.

    Holds an open descriptor: if compaction replaces the file, this reader keeps
    reading the old (equally valid, merely uncompacted) data until it is dropped.
    """

    def __init__(self, directory: Path, base_offset: int) -> None:
        self.base_offset = base_offset
        self.path = log_path(directory, base_offset)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.inode = os.fstat(self.fd).st_ino
        self.offset_index = OffsetIndex(index_path(directory, base_offset))
        self.time_index = TimeIndex(time_index_path(directory, base_offset))
        self._index_loaded_at_size = -1
        self._lock = threading.Lock()
        self._tail_position = 0  # end_offset() resumes its header walk here
        self._tail_next_offset = base_offset

    def close(self) -> None:
        os.close(self.fd)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def _indexes(self) -> tuple[OffsetIndex, TimeIndex]:
        size = self.size()
        with self._lock:
            if size != self._index_loaded_at_size:
                self.offset_index.refresh()
                self.time_index.refresh()
                self._index_loaded_at_size = size
            return self.offset_index, self.time_index

    def header_at(self, position: int) -> BatchHeader | None:
        """The sound header at ``position``, or None (end of data, torn or not a header)."""
        raw = os.pread(self.fd, HEADER_SIZE, position)
        if len(raw) < HEADER_SIZE:
            return None
        header = unpack_header(raw)
        if header_problem(raw, 0, header) is not None:
            return None
        return header

    def end_offset(self) -> int:
        """The offset after the last whole batch of this segment (``base_offset`` when empty)."""
        with self._lock:
            pos, next_offset = self._tail_position, self._tail_next_offset
            while (header := self.header_at(pos)) is not None:
                if pos + header.size > self.size():
                    break
                pos += header.size
                next_offset = header.next_offset
            self._tail_position, self._tail_next_offset = pos, next_offset
            return next_offset

    def position_of(self, offset: int) -> int:
        """Byte position of the first batch whose last offset is ≥ ``offset`` (or the data end)."""
        offset_index, _ = self._indexes()
        pos = offset_index.lookup(offset - self.base_offset)
        if pos:
            hint = self.header_at(pos)
            if hint is None or hint.base_offset > offset:
                pos = 0  # a stale or wrong hint: indexes are never trusted over the data
        return self._walk(pos, lambda h: h.last_offset >= offset)

    def position_of_time(self, timestamp: int) -> int:
        """Byte position of the first batch whose max timestamp is ≥ ``timestamp``."""
        _, time_index = self._indexes()
        rel = time_index.lookup(timestamp)
        pos = self.position_of(self.base_offset + rel) if rel else 0
        return self._walk(pos, lambda h: h.max_timestamp >= timestamp)

    def _walk(self, pos: int, stop: Callable[[BatchHeader], bool]) -> int:
        while True:
            header = self.header_at(pos)
            if header is None or stop(header):
                return pos
            pos += header.size

    def read_batches(
        self, position: int, max_bytes: int, *, active: bool = True
    ) -> list[tuple[BatchHeader, pa.RecordBatch]]:
        """Decode whole, valid batches from ``position``: at least one if one is complete.

        Stops at the end of the data or, in the ``active`` (last) segment, at a batch still
        being written or torn by a crashed writer (the next writer truncates it). Damage
        anywhere else, including the end of a closed segment, raises
        :class:`CorruptLogError` naming the file and byte position.
        """
        try:
            return self._read_batches(position, max_bytes, active)
        except CorruptLogError:
            # A writer may have been truncating a torn tail under our read: look once more.
            return self._read_batches(position, max_bytes, active)

    def _read_batches(self, position: int, max_bytes: int, active: bool) -> list[tuple[BatchHeader, pa.RecordBatch]]:
        """See :meth:`read_batches`. Damage is raised only when it is the first batch of the
        read: the whole batches before it are returned first, so the data before any damage
        can always be read, and the next read (starting at the damage) raises."""
        raw = os.pread(self.fd, max(max_bytes, HEADER_SIZE), position)
        if len(raw) >= HEADER_SIZE:
            first = unpack_header(raw)
            if header_problem(raw, 0, first) is None and first.size > len(raw):
                raw = os.pread(self.fd, first.size, position)
        buf = pa.py_buffer(raw)
        out: list[tuple[BatchHeader, pa.RecordBatch]] = []
        pos = 0
        damage: str | None = None
        while pos + HEADER_SIZE <= len(raw):
            header = unpack_header(raw, pos)
            problem = header_problem(raw, pos, header)
            if problem is not None:
                if active and _all_zero(self.fd, position + pos, self.size()):
                    break  # a zero-filled tail: nothing written here yet
                damage = problem
                break
            end = pos + header.size
            if end > len(raw):
                if not active and position + end > self.size():
                    damage = "closed segment ends inside this batch (truncated)"
                break  # continues past this read (or is still being written)
            if not crc_matches(raw, pos, header):
                if active and position + end >= self.size():
                    break  # the last batch, torn by a crashed writer; recovery truncates it
                damage = "checksum mismatch"
                break
            out.append((header, decode_records(buf, pos, header)))
            pos = end
        else:
            if not active and pos < len(raw) and position + len(raw) >= self.size():
                damage = "closed segment ends inside a batch header (truncated)"  # fewer bytes left than a header
        if damage is not None and not out:
            raise CorruptLogError(self.path, position + pos, damage)
        return out
