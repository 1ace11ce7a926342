"""Compaction and retention of closed segments.

Split as in Kafka: :class:`eventstore.log_cleaner.LogCleaner` schedules (a background
thread over every topic), :mod:`eventstore.cleaner_manager` keeps the books (which
partition is dirtiest), :func:`compact_partition` is the algorithm,
:func:`apply_retention` deletes old segments, and :func:`resolve_overlaps` finishes or
undoes what a crash interrupted.

**Guarantee** (Kafka's, stated for us): compaction keeps, for every key, at least the
last record written with that key in the closed segments, at its original offset; a
consumer that reads a partition from offset 0 therefore sees the final value of every
key (or, for a deleted key, its tombstone until ``delete_retention_ms`` has passed,
after which neither the tombstone nor earlier values are returned). Offsets never
change; compacted-away offsets become gaps. The active segment is never touched.

Algorithm (one pass over a partition, under its ``.clean.lock``):

1. The cleanable segments are the closed ones (all but the last) whose records are all
   older than ``min_compaction_lag_ms`` (a prefix of the closed segments).
2. Offset map (pass 1): the largest offset of every key in the cleanable segments, built
   with an Arrow hash aggregation (no per-record Python); held as a sorted array, so the
   "is this record the latest of its key" test is a vectorized binary search.
   Record (K, O) is obsolete iff some (K, O') with O < O' exists in the cleanable part.
3. Pass 2: cleanable segments are grouped (consecutive, total size ≤ ``segment_bytes``);
   each group is re-read one segment at a time and rewritten into one file named after
   the group's first base offset, keeping per batch the records that are not obsolete.
   A batch keeps its base offset, offset span, timestamps and producer fields; an
   emptied batch is dropped.
4. Tombstones: a kept tombstone marks its output batch with a *delete horizon* (now +
   ``delete_retention_ms``) the first time it is cleaned; a later pass after the
   horizon drops it. Records without a key (from before the topic was compacted) and
   control batches are kept as they are.
5. Transactions: only segments wholly below the last stable offset are cleanable (an
   open transaction's outcome decides which record of a key is the latest). Batches of
   aborted transactions never count as the latest of their keys and are dropped.
   Commit and abort markers are dropped (readers never need them: they use the LSO and
   the aborted-transaction index); the ``cleaner-checkpoint`` file records how far that
   happened, for a producer-state rebuild after a lost snapshot (eventstore.producer_state).

Swap and crash policy (the ``.cleaned`` / ``.swap`` suffixes)::

    <base>.log.cleaned, <base>.index.cleaned, <base>.timeindex.cleaned   written, fsynced
    rename <base>.log.cleaned  -> <base>.log         ← the commit point of the group
    rename <base>.*index.cleaned -> <base>.*index
    delete the group's other segments (log first, then their indexes)

A pass that fails before the commit point (e.g. the disk is full) deletes its own
``.cleaned`` files. On the next open or cleaning pass: a ``<base>.log.cleaned`` means the group was not
committed (all its ``.cleaned`` files are deleted: the old set stays); an index
``.cleaned`` without its log means the commit happened (the rename is completed); a
segment wholly covered by the previous one (its end offset ≤ the previous end offset)
is a leftover of a committed group and is deleted. So a crash leaves each group either
old or new, never a mix, and readers never see an offset twice (they skip offsets below
their position) nor miss one (the covering segment holds every kept record).

Thread-safety: the functions are safe to call from any thread or process; the
partition's ``.clean.lock`` serializes cleaning passes and retention.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eventstore.fileio import fsync_dir, write_fsynced
from eventstore.index import OFFSET_ENTRY, TIME_ENTRY
from eventstore.isolation import is_aborted
from eventstore.producer_state import AbortedTransaction, write_cleaner_checkpoint
from eventstore.record_batch import BatchHeader, EncodedBatch, encode_batch, set_base_offset, unpack_header
from eventstore.segment import (
    CLEANED_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    TIME_INDEX_SUFFIX,
    SegmentReader,
    index_path,
    list_segment_bases,
    log_path,
    scan_batches,
    segment_name,
    time_index_path,
)
from eventstore.topic import now_ms

if TYPE_CHECKING:
    from eventstore.partition_log import PartitionLog

log = logging.getLogger(__name__)
READ_CHUNK = 1 << 20  # 1 MiB reads: larger fresh buffers cost page faults (measured 2x)


@dataclass(frozen=True, slots=True)
class CleanStats:
    """What one compaction pass did to one partition."""

    segments_cleaned: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    records_read: int = 0
    records_kept: int = 0
    tombstones_dropped: int = 0


# ---------------------------------------------------------------------------- crash recovery


def _delete_segment_files(directory: Path, base: int) -> None:
    for path in (log_path(directory, base), index_path(directory, base), time_index_path(directory, base)):
        with suppress(FileNotFoundError):
            path.unlink()


def _end_offset(directory: Path, base: int) -> int:
    reader = SegmentReader(directory, base)
    try:
        return reader.end_offset()
    finally:
        reader.close()


def resolve_overlaps(directory: Path) -> None:
    """Finish or undo an interrupted compaction swap (see the module docstring)."""
    names = os.listdir(directory)
    uncommitted = {n[:20] for n in names if n.endswith(LOG_SUFFIX + CLEANED_SUFFIX)}
    for name in names:
        if not name.endswith(CLEANED_SUFFIX):
            continue
        path = directory / name
        if name[:20] in uncommitted:
            with suppress(FileNotFoundError):
                path.unlink()
        else:  # the log was swapped in: complete the index renames
            with suppress(FileNotFoundError):
                os.replace(path, directory / name[: -len(CLEANED_SUFFIX)])
    bases = list_segment_bases(directory)
    prev_end = -1
    for base in bases[:-1]:  # the last segment is active: never a leftover
        end = _end_offset(directory, base)
        if prev_end >= 0 and base < prev_end and end <= prev_end:
            log.warning("deleting %s: covered by the previous, compacted segment", log_path(directory, base))
            _delete_segment_files(directory, base)
            continue
        prev_end = max(prev_end, end)


# ---------------------------------------------------------------------------- compaction


def _read_all_batches(reader: SegmentReader) -> list[tuple[BatchHeader, pa.RecordBatch]]:
    out: list[tuple[BatchHeader, pa.RecordBatch]] = []
    pos, size = 0, reader.size()
    while pos < size:
        batches = reader.read_batches(pos, READ_CHUNK, active=False)
        if not batches:
            break
        out.extend(batches)
        pos += sum(h.size for h, _ in batches)
    return out


def _segment_max_timestamp(reader: SegmentReader) -> int:
    result = -1
    pos = 0
    while (header := reader.header_at(pos)) is not None:
        result = max(result, header.max_timestamp)
        pos += header.size
    return result


def _group(bases: list[int], sizes: dict[int, int], limit: int) -> list[list[int]]:
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for base in bases:
        if current and total + sizes[base] > limit:
            groups.append(current)
            current, total = [], 0
        current.append(base)
        total += sizes[base]
    if current:
        groups.append(current)
    return groups


class _IndexBuilder:
    """Sparse index entries for a segment being written from scratch."""

    def __init__(self, base: int, interval: int) -> None:
        self.base = base
        self.interval = interval
        self.offset_entries = bytearray()
        self.time_entries = bytearray()
        self._last_pos = -1
        self._last_ts = -1

    def add(self, position: int, header: BatchHeader) -> None:
        if self._last_pos < 0 or position - self._last_pos >= self.interval:
            rel = header.base_offset - self.base
            self.offset_entries += OFFSET_ENTRY.pack(rel, position)
            self._last_pos = position
            if header.max_timestamp > self._last_ts:
                self.time_entries += TIME_ENTRY.pack(header.max_timestamp, rel)
                self._last_ts = header.max_timestamp


Throttle = Callable[[int], None]
"""Called with the bytes just read (or about to be written); may sleep to cap the I/O rate."""


def _no_throttle(_: int) -> None:
    return None


def compact_partition(plog: PartitionLog, *, now: int | None = None, throttle: Throttle | None = None) -> CleanStats:
    """One compaction pass over the closed segments of ``plog`` (see the module docstring).

    ``throttle`` is called after each segment read and before each write with the byte
    count (the log cleaner's I/O cap); it may raise to abandon the pass, which leaves
    every group either committed or untouched.
    """
    throttle = throttle or _no_throttle
    config = plog.config
    if not config.cleanup_policy.compacts:
        return CleanStats()
    now = now_ms() if now is None else now
    directory = plog.directory
    with plog.cleaning():
        resolve_overlaps(directory)
        stable = plog.last_stable_offset()
        bases = list_segment_bases(directory)[:-1]
        readers = {b: SegmentReader(directory, b) for b in bases}
        try:
            cleanable: list[int] = []
            for b in bases:
                if (
                    config.min_compaction_lag_ms
                    and _segment_max_timestamp(readers[b]) > now - config.min_compaction_lag_ms
                ):
                    break
                if readers[b].end_offset() > stable:
                    break  # an open transaction starts in this segment
                cleanable.append(b)
            if not cleanable:
                return CleanStats()
            aborted = plog.aborted_transactions(cleanable[0], readers[cleanable[-1]].end_offset())
            keep_offsets = _latest_offsets(readers, cleanable, aborted, throttle)
            stats = CleanStats(segments_cleaned=len(cleanable))
            sizes = {b: readers[b].size() for b in cleanable}
            try:
                for group in _group(cleanable, sizes, config.segment_bytes):
                    stats = _clean_group(
                        directory,
                        group,
                        readers,
                        keep_offsets,
                        aborted,
                        now,
                        config.delete_retention_ms,
                        config.index_interval_bytes,
                        sizes,
                        stats,
                        throttle,
                    )
            finally:  # also when the throttle abandons the pass: groups committed so far are durable
                fsync_dir(directory)
                plog.invalidate_readers()
            return stats
        finally:
            for r in readers.values():
                r.close()


def _record_offsets(header: BatchHeader, records: pa.RecordBatch) -> pa.Array:
    return pc.add(records.column(0).cast(pa.int64()), pa.scalar(header.base_offset, pa.int64()))


def _latest_offsets(
    readers: dict[int, SegmentReader], cleanable: list[int], aborted: list[AbortedTransaction], throttle: Throttle
) -> np.ndarray[Any, Any]:
    """Pass 1: the largest offset of every key in the cleanable segments, sorted.

    Memory: O(distinct keys + one segment's keys): keys are copied out of each segment's
    read buffers (``concat_arrays`` copies), so values are never held beyond one segment.
    """
    keys: list[pa.Array] = []
    offsets: list[pa.Array] = []
    for base in cleanable:
        seg_keys, seg_offsets = [], []
        for header, records in _read_all_batches(readers[base]):
            if not header.is_control and not is_aborted(header, aborted):
                seg_keys.append(records.column(2))
                seg_offsets.append(_record_offsets(header, records))
        throttle(readers[base].size())
        if seg_keys:
            keys.append(pa.concat_arrays(seg_keys))
            offsets.append(pa.concat_arrays(seg_offsets))
    if not keys:
        return np.empty(0, np.int64)
    table = pa.table({"key": pa.chunked_array(keys), "offset": pa.chunked_array(offsets)})
    table = table.filter(pc.is_valid(table["key"]))
    latest = table.group_by("key").aggregate([("offset", "max")])["offset_max"].to_numpy()
    return np.sort(latest)


def _latest_mask(batches: list[tuple[BatchHeader, pa.RecordBatch]], keep_sorted: np.ndarray[Any, Any]) -> pa.Array:
    """For every record of a segment, whether it is the latest of its key (binary search)."""
    total = sum(r.num_rows for _, r in batches)
    if total == 0 or len(keep_sorted) == 0:
        return pa.array(np.zeros(total, dtype=bool))
    offsets = np.concatenate([_record_offsets(h, r).to_numpy() for h, r in batches])
    idx = np.minimum(np.searchsorted(keep_sorted, offsets), len(keep_sorted) - 1)
    return pa.array(keep_sorted[idx] == offsets)


def _clean_group(
    directory: Path,
    group: list[int],
    readers: dict[int, SegmentReader],
    keep_offsets: np.ndarray[Any, Any],
    aborted: list[AbortedTransaction],
    now: int,
    delete_retention_ms: int,
    index_interval: int,
    sizes: dict[int, int],
    stats: CleanStats,
    throttle: Throttle,
) -> CleanStats:
    first = group[0]
    index = _IndexBuilder(first, index_interval)
    chunks: list[bytes | bytearray | EncodedBatch] = []
    position = 0
    read = kept = dropped_tombstones = 0
    group_next = first
    for base in group:
        batches = _read_all_batches(readers[base])  # pass 2: one segment in memory at a time
        throttle(sizes[base])
        latest_all = _latest_mask(batches, keep_offsets)
        row = 0
        for i, (header, records) in enumerate(batches):
            group_end = base == group[-1] and i == len(batches) - 1
            group_next = max(group_next, header.next_offset)
            read += records.num_rows
            latest_slice = latest_all.slice(row, records.num_rows)
            row += records.num_rows
            if header.is_control:
                if not group_end:
                    continue  # a marker of a transaction that ended below the LSO: no longer needed
                out = _reencode(header, records, header.delete_horizon_ms)
            elif is_aborted(header, aborted):
                if not group_end:
                    continue  # aborted data is never read (read_committed) nor the latest of a key
                records = records.slice(0, 0)
                out = _reencode(header, records, -1)
            else:
                key_col, value_col = records.column(2), records.column(3)
                latest = pc.or_(latest_slice, pc.is_null(key_col))
                tombstone = pc.and_(pc.is_null(value_col), pc.is_valid(key_col))
                horizon_passed = 0 <= header.delete_horizon_ms <= now
                if horizon_passed:
                    drop_tomb = pc.and_(latest, tombstone)
                    dropped_tombstones += pc.sum(drop_tomb.cast(pa.int64())).as_py() or 0
                    mask = pc.and_(latest, pc.invert(tombstone))
                else:
                    mask = latest
                filtered = records.filter(mask)
                if filtered.num_rows == 0 and not group_end:
                    continue  # an emptied batch is dropped, except the group's last: it keeps the
                    # new segment's end equal to the group's end, which crash recovery relies on
                has_tombstones = bool(pc.any(pc.is_null(filtered.column(3))).as_py())
                horizon = -1
                if has_tombstones:
                    horizon = header.delete_horizon_ms if header.delete_horizon_ms >= 0 else now + delete_retention_ms
                out = _reencode(header, filtered, horizon)
                records = filtered
            kept += records.num_rows
            out_header = unpack_header(out)
            index.add(position, out_header)
            chunks.append(out)
            position += len(out)
    throttle(position)  # before anything is written: an abandoned pass leaves no .cleaned file
    tmp_log = directory / (segment_name(first) + LOG_SUFFIX + CLEANED_SUFFIX)
    tmp_index = directory / (segment_name(first) + INDEX_SUFFIX + CLEANED_SUFFIX)
    tmp_time = directory / (segment_name(first) + TIME_INDEX_SUFFIX + CLEANED_SUFFIX)
    try:
        written = write_fsynced(tmp_log, chunks)
        write_fsynced(tmp_index, [index.offset_entries])
        write_fsynced(tmp_time, [index.time_entries])
        _verify_cleaned(tmp_log, first)
        write_cleaner_checkpoint(directory, group_next)  # before any marker disappears (producer_state)
    except OSError:  # e.g. disk full: the old segments stay; free the space the output took
        for tmp in (tmp_log, tmp_index, tmp_time):
            with suppress(FileNotFoundError):
                tmp.unlink()
        raise
    os.replace(tmp_log, log_path(directory, first))  # commit point
    os.replace(tmp_index, index_path(directory, first))
    os.replace(tmp_time, time_index_path(directory, first))
    for base in group[1:]:
        _delete_segment_files(directory, base)
    return CleanStats(
        segments_cleaned=stats.segments_cleaned,
        bytes_read=stats.bytes_read + sum(sizes[b] for b in group),
        bytes_written=stats.bytes_written + written,
        records_read=stats.records_read + read,
        records_kept=stats.records_kept + kept,
        tombstones_dropped=stats.tombstones_dropped + dropped_tombstones,
    )


def _reencode(header: BatchHeader, records: pa.RecordBatch, delete_horizon_ms: int) -> EncodedBatch:
    out = encode_batch(
        records,
        first_timestamp=header.first_timestamp,
        max_timestamp=header.max_timestamp,
        codec=header.codec,
        last_offset_delta=header.last_offset_delta,
        producer_id=header.producer_id,
        producer_epoch=header.producer_epoch,
        base_sequence=header.base_sequence,
        transactional=header.is_transactional,
        control=header.is_control,
        delete_horizon_ms=delete_horizon_ms,
    )
    set_base_offset(out, header.base_offset)
    return out


def _verify_cleaned(path: Path, base: int) -> None:
    """Re-validate the cleaned file before it replaces anything (never swap in bad data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        result = scan_batches(fd, path, 0, min_base_offset=base)
        if result.torn:
            raise OSError(f"cleaned segment {path} failed validation: {result.torn_reason}")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- retention


def apply_retention(plog: PartitionLog, *, now: int | None = None) -> int:
    """Delete closed segments past ``retention_ms`` or beyond ``retention_bytes``; return how many."""
    config = plog.config
    if not config.cleanup_policy.deletes:
        return 0
    now = now_ms() if now is None else now
    directory = plog.directory
    deleted = 0
    with plog.cleaning():
        bases = list_segment_bases(directory)
        sizes = {b: log_path(directory, b).stat().st_size for b in bases}
        total = sum(sizes.values())
        for base in bases[:-1]:
            too_old = False
            if config.retention_ms >= 0:
                reader = SegmentReader(directory, base)
                try:
                    too_old = _segment_max_timestamp(reader) < now - config.retention_ms
                finally:
                    reader.close()
            too_big = config.retention_bytes >= 0 and total > config.retention_bytes
            if not (too_old or too_big):
                break
            _delete_segment_files(directory, base)
            total -= sizes[base]
            deleted += 1
        if deleted:
            fsync_dir(directory)
            plog.invalidate_readers()
    return deleted
