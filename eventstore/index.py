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

Invariants (checked as entries are loaded, see ``_SparseIndex``): in both files both
fields strictly increase. A position may point past the data or at a batch rewritten
since: lookups validate the header they land on.

Crash policy: indexes are *derived* data. They are written without fsync (except at
segment roll), are never trusted over the log (a lookup validates the batch header it
lands on, falling back to a scan from the segment start), and the active segment's are
rebuilt from the log whenever recovery scans it. A torn last entry (file size not a
multiple of the entry size) is ignored.

Writers (eventstore.partition_log) append entries with ``O_APPEND`` writes under the
partition lock and cut them with ``truncate_index_files``; the classes here are the read
side, loaded by each :class:`~eventstore.segment.SegmentReader`.

Thread-safety: none; the owning reader guards them with its lock.
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass
from pathlib import Path

OFFSET_ENTRY = struct.Struct("<iI")
TIME_ENTRY = struct.Struct("<qi")


class _SparseIndex:
    """Entries ``(key, value)`` read from an index file, both strictly increasing.

    ``refresh`` reads only what was appended since the last call (the active segment's
    index grows while it is read); a file that shrank or whose new entries do not
    continue the order was rewritten by a recovering writer and is read again whole.
    Entries that break the invariants are dropped: the index is only a hint.
    """

    ENTRY: struct.Struct

    def __init__(self, path: Path) -> None:
        self.path = path
        self._keys: list[int] = []
        self._values: list[int] = []
        self._loaded_bytes = 0

    def __len__(self) -> int:
        return len(self._keys)

    def refresh(self) -> None:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._loaded_bytes:
                    self._clear()
                f.seek(self._loaded_bytes)
                data = f.read(size - self._loaded_bytes)
        except FileNotFoundError:
            self._clear()
            return
        usable = len(data) - len(data) % self.ENTRY.size
        if not self._extend(data[:usable]) and self._loaded_bytes:
            self._clear()  # rewritten under us: read it again whole, once
            self.refresh()
            return
        self._loaded_bytes += usable

    def _clear(self) -> None:
        self._keys, self._values, self._loaded_bytes = [], [], 0

    def _extend(self, data: bytes) -> bool:
        """Append entries while they keep both orders; False if one does not."""
        keys, values = self._keys, self._values
        for key, value in self.ENTRY.iter_unpack(data):
            if keys and (key <= keys[-1] or value <= values[-1]):
                return False
            keys.append(key)
            values.append(value)
        return True

    def _value_of_last_key_before(self, key: int, *, inclusive: bool) -> int:
        i = (bisect.bisect_right if inclusive else bisect.bisect_left)(self._keys, key)
        return 0 if i == 0 else self._values[i - 1]


class OffsetIndex(_SparseIndex):
    """Maps relative offsets to byte positions for one segment."""

    ENTRY = OFFSET_ENTRY

    def lookup(self, relative_offset: int) -> int:
        """Byte position of the last indexed batch whose base is ≤ ``relative_offset`` (or 0)."""
        return self._value_of_last_key_before(relative_offset, inclusive=True)


class TimeIndex(_SparseIndex):
    """Maps timestamps to relative offsets for one segment (max timestamp so far)."""

    ENTRY = TIME_ENTRY

    def lookup(self, timestamp: int) -> int:
        """Relative offset of a batch from which a scan finds the first record at ≥ ``timestamp``."""
        return self._value_of_last_key_before(timestamp, inclusive=False)


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
