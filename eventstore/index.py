"""Sparse offset and time indexes of one segment.

File naming: ``<base offset, 20 digits>.index`` and ``<base offset, 20 digits>.timeindex``
beside the segment's ``.log``.

Byte layout (little-endian, no header; the file is a plain array of entries)::

    .index      entry = relative_offset int32 | position uint32            (ENTRY_SIZE = 8)
    .timeindex  entry = timestamp int64       | relative_offset int32      (ENTRY_SIZE = 12)

An offset-index entry ``(r, p)`` says: the batch starting at byte ``p`` of the segment
has base offset ``base + r``. A time-index entry ``(t, r)`` says: the largest timestamp
in the segment up to and including the batch with base offset ``base + r`` is ``t``; so
no record before the batch of the first entry with ``t ≥ T`` has a timestamp ≥ ``T``,
and a search for the first record at or after time ``T`` may start at the batch of the
last entry with ``t < T``.
Entries are added at most once per ``index_interval_bytes`` of log data (one per batch
at most), so both files stay small.

Invariants (checked by :meth:`OffsetIndex.sanity_check`): relative offsets strictly
increase; positions strictly increase and stay below the segment size; timestamps of
the time index never decrease.

Crash policy: indexes are *derived* data. They are written without fsync (except at
segment roll), are never trusted over the log (a lookup validates the batch header it
lands on), and are rebuilt from the log whenever recovery scans a segment or a sanity
check fails. A torn last entry (file size not a multiple of the entry size) is dropped.

Writers (eventstore.partition_log) append entries with ``O_APPEND`` writes under the
partition lock and cut them with ``truncate_index_files``; the classes here are the read
side, loaded by each :class:`~eventstore.segment.SegmentReader`.

Thread-safety: none; the owning reader guards them with its lock.
"""

from __future__ import annotations

import bisect
import os
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path

OFFSET_ENTRY = struct.Struct("<iI")
TIME_ENTRY = struct.Struct("<qi")


class OffsetIndex:
    """Maps relative offsets to byte positions for one segment."""

    ENTRY_SIZE = OFFSET_ENTRY.size

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offsets = array("i")
        self._positions = array("I")

    def __len__(self) -> int:
        return len(self._offsets)

    def load(self) -> None:
        """Read the entries from disk; a torn trailing entry is ignored."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        usable = len(data) - len(data) % self.ENTRY_SIZE
        flat = array("I")
        flat.frombytes(data[:usable])
        if _BIG_ENDIAN:
            flat.byteswap()
        self._offsets = array("i", flat[0::2].tobytes())
        self._positions = flat[1::2]

    def lookup(self, relative_offset: int) -> int:
        """Byte position of the last indexed batch whose base is ≤ ``relative_offset`` (or 0)."""
        i = bisect.bisect_right(self._offsets, relative_offset)
        return 0 if i == 0 else int(self._positions[i - 1])

    def last_position(self) -> int:
        return int(self._positions[-1]) if self._positions else 0

    def sanity_check(self, segment_size: int) -> str | None:
        """Why this index cannot be used with a log of ``segment_size`` bytes, or None."""
        for i in range(1, len(self._offsets)):
            if self._offsets[i] <= self._offsets[i - 1] or self._positions[i] <= self._positions[i - 1]:
                return f"{self.path}: entry {i} is not increasing"
        if self._positions and self._positions[-1] >= segment_size:
            return f"{self.path}: last entry points past the log ({self._positions[-1]} ≥ {segment_size})"
        return None


class TimeIndex:
    """Maps timestamps to relative offsets for one segment (max timestamp so far)."""

    ENTRY_SIZE = TIME_ENTRY.size

    def __init__(self, path: Path) -> None:
        self.path = path
        self._timestamps: list[int] = []
        self._offsets: list[int] = []

    def __len__(self) -> int:
        return len(self._timestamps)

    def load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        usable = len(data) - len(data) % self.ENTRY_SIZE
        self._timestamps = []
        self._offsets = []
        for ts, rel in TIME_ENTRY.iter_unpack(data[:usable]):
            self._timestamps.append(ts)
            self._offsets.append(rel)

    @property
    def max_timestamp(self) -> int:
        return self._timestamps[-1] if self._timestamps else -1

    def lookup(self, timestamp: int) -> int:
        """Relative offset of a batch from which a scan finds the first record at ≥ ``timestamp``."""
        i = bisect.bisect_left(self._timestamps, timestamp)
        return 0 if i == 0 else self._offsets[i - 1]

    def sanity_check(self) -> str | None:
        for i in range(1, len(self._timestamps)):
            if self._timestamps[i] < self._timestamps[i - 1] or self._offsets[i] <= self._offsets[i - 1]:
                return f"{self.path}: entry {i} is not increasing"
        return None


_BIG_ENDIAN = struct.pack("=I", 1) == struct.pack(">I", 1)


@dataclass(frozen=True, slots=True)
class IndexTail:
    """The last entries kept by :func:`truncate_index_files` (-1 when none)."""

    last_position: int
    last_timestamp: int


def truncate_index_files(index_fd: int, time_index_fd: int, position: int) -> IndexTail:
    """Cut both index files in place so no entry points at or past byte ``position``.

    In place (``ftruncate``), because other processes may hold ``O_APPEND`` descriptors
    of the same files. Torn trailing entries are cut as well.
    """
    raw = _read_all(index_fd)
    entries = list(OFFSET_ENTRY.iter_unpack(raw[: len(raw) - len(raw) % OFFSET_ENTRY.size]))
    keep = [e for e in entries if e[1] < position]
    if len(keep) != len(entries) or len(raw) % OFFSET_ENTRY.size:
        os.ftruncate(index_fd, len(keep) * OFFSET_ENTRY.size)
    last_rel = keep[-1][0] if keep else -1
    raw = _read_all(time_index_fd)
    tentries = list(TIME_ENTRY.iter_unpack(raw[: len(raw) - len(raw) % TIME_ENTRY.size]))
    tkeep = [e for e in tentries if e[1] <= last_rel]
    if len(tkeep) != len(tentries) or len(raw) % TIME_ENTRY.size:
        os.ftruncate(time_index_fd, len(tkeep) * TIME_ENTRY.size)
    return IndexTail(keep[-1][1] if keep else -1, tkeep[-1][0] if tkeep else -1)


def _read_all(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)
