"""The log cleaner's bookkeeping: which compacted partition is dirtiest (Kafka's ``LogCleanerManager``).

A compacted partition is divided, as in Kafka, into::

    [log start ........ first dirty) [first dirty ........ first uncleanable) [.... log end)
          clean: compacted before           dirty: cleanable, never compacted      not cleanable

* **first dirty offset** = the ``cleaner-checkpoint`` (eventstore.producer_state): every
  offset below it has been through a compaction pass;
* **first uncleanable offset** = the end of the cleanable prefix of the closed segments,
  exactly as :func:`eventstore.cleaner.compact_partition` chooses it: the active segment
  is never cleanable, nor a segment holding a record younger than
  ``min_compaction_lag_ms``, nor one reaching past the last stable offset (an open
  transaction), nor anything after such a segment.

Sizes are counted per segment file: a cleanable segment whose end offset is at or below
the first dirty offset is clean, any later cleanable segment is dirty. The **dirty
ratio** is dirty bytes / (clean + dirty bytes). A partition is due when

* its dirty ratio is ≥ the topic's ``min_cleanable_dirty_ratio`` and it has dirty bytes, or
* a cleanable segment holds tombstones whose delete horizon (set by an earlier pass,
  ``delete_retention_ms`` after it) has passed: only a pass can drop them.

A partition that a pass left exactly as it was (same segment files) is not due again
until its files change or one of its delete horizons passes, so a condition the
algorithm cannot act on never makes the cleaner spin.

Nothing here is persisted: the per-segment summaries (size, end offset, largest
timestamp, earliest delete horizon, from one walk over the batch headers) are a cache
keyed by file identity, rebuilt on demand.

Thread-safety: not thread-safe; owned by the cleaner's one worker thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eventstore.producer_state import read_cleaner_checkpoint
from eventstore.segment import SegmentReader, list_segment_bases, log_path

if TYPE_CHECKING:
    from eventstore.partition_log import PartitionLog

Fingerprint = tuple[tuple[int, int, int], ...]  # (base offset, inode, size) of every segment file


@dataclass(frozen=True, slots=True)
class SegmentSummary:
    """What the scheduler needs to know about one segment file (from its batch headers)."""

    base_offset: int
    size: int
    end_offset: int  # the offset after its last whole batch
    max_timestamp: int  # the largest record timestamp, -1 when empty
    min_delete_horizon: int  # the earliest delete horizon of a batch holding tombstones, -1 when none


@dataclass(frozen=True, slots=True)
class LogToClean:
    """One compacted partition as the scheduler sees it now (Kafka's ``LogToClean``)."""

    topic: str
    partition: int
    first_dirty_offset: int
    first_uncleanable_offset: int
    clean_bytes: int
    dirty_bytes: int
    min_delete_horizon: int  # earliest delete horizon in the cleanable segments, -1 when none
    fingerprint: Fingerprint

    @property
    def name(self) -> str:
        return f"{self.topic}-{self.partition}"

    @property
    def dirty_ratio(self) -> float:
        total = self.clean_bytes + self.dirty_bytes
        return self.dirty_bytes / total if total else 0.0


def summarize_segment(directory: Path, base: int) -> SegmentSummary:
    """Walk the batch headers of one segment (no payload is read)."""
    reader = SegmentReader(directory, base)
    try:
        size = reader.size()
        pos, end, max_ts, horizon = 0, base, -1, -1
        while (header := reader.header_at(pos)) is not None and pos + header.size <= size:
            max_ts = max(max_ts, header.max_timestamp)
            if header.delete_horizon_ms >= 0:
                horizon = header.delete_horizon_ms if horizon < 0 else min(horizon, header.delete_horizon_ms)
            end = header.next_offset
            pos += header.size
        return SegmentSummary(base, size, end, max_ts, horizon)
    finally:
        reader.close()


class CleanerManager:
    """Computes :class:`LogToClean` for partitions and picks the dirtiest due one."""

    def __init__(self) -> None:
        self._summaries: dict[Path, tuple[tuple[int, int], SegmentSummary]] = {}
        self._last_pass: dict[str, tuple[Fingerprint, int]] = {}  # partition → (files after its pass, pass time)

    def _summary(self, directory: Path, base: int) -> SegmentSummary | None:
        path = log_path(directory, base)
        try:
            st = os.stat(path)
            identity = (st.st_ino, st.st_size)
            cached = self._summaries.get(path)
            if cached is not None and cached[0] == identity:
                return cached[1]
            summary = summarize_segment(directory, base)
        except FileNotFoundError:  # deleted by retention or a compaction swap meanwhile
            self._summaries.pop(path, None)
            return None
        self._summaries[path] = (identity, summary)
        return summary

    def _fingerprint(self, directory: Path, bases: list[int]) -> Fingerprint:
        out = []
        for base in bases:
            try:
                st = os.stat(log_path(directory, base))
            except FileNotFoundError:
                continue
            out.append((base, st.st_ino, st.st_size))
        return tuple(out)

    def log_to_clean(self, plog: PartitionLog, now: int) -> LogToClean:
        """The clean / dirty / uncleanable split of ``plog`` now (see the module docstring)."""
        directory = plog.directory
        config = plog.config
        bases = list_segment_bases(directory)
        first_dirty = max(read_cleaner_checkpoint(directory), bases[0] if bases else 0)
        stable = plog.last_stable_offset()
        clean = dirty = 0
        horizon = -1
        uncleanable = bases[-1] if bases else 0
        for base in bases[:-1]:
            summary = self._summary(directory, base)
            if summary is None:
                continue
            too_young = config.min_compaction_lag_ms and summary.max_timestamp > now - config.min_compaction_lag_ms
            if too_young or summary.end_offset > stable:
                uncleanable = base
                break
            if summary.end_offset <= first_dirty:
                clean += summary.size
            else:
                dirty += summary.size
            if summary.min_delete_horizon >= 0:
                horizon = summary.min_delete_horizon if horizon < 0 else min(horizon, summary.min_delete_horizon)
        live = {log_path(directory, b) for b in bases}
        for path in [p for p in self._summaries if p.parent == directory and p not in live]:
            del self._summaries[path]
        return LogToClean(
            plog.topic,
            plog.partition,
            first_dirty,
            uncleanable,
            clean,
            dirty,
            horizon,
            self._fingerprint(directory, bases),
        )

    def is_due(self, ltc: LogToClean, min_ratio: float, now: int) -> bool:
        """Whether a compaction pass over ``ltc`` would do something (see the module docstring)."""
        last = self._last_pass.get(ltc.name)
        horizon_due = 0 <= ltc.min_delete_horizon <= now
        if last is not None and last[0] == ltc.fingerprint:
            # unchanged since our last pass: only a delete horizon passed since then is new work
            return horizon_due and ltc.min_delete_horizon >= last[1]
        return (ltc.dirty_bytes > 0 and ltc.dirty_ratio >= min_ratio) or horizon_due

    def record_pass(self, plog: PartitionLog, now: int) -> None:
        """Remember the files a pass left (started at ``now``), so an unchanged partition is not redone."""
        directory = plog.directory
        self._last_pass[f"{plog.topic}-{plog.partition}"] = (
            self._fingerprint(directory, list_segment_bases(directory)),
            now,
        )

    def grab_filthiest(self, plogs: list[PartitionLog], now: int) -> LogToClean | None:
        """The due compacted partition with the highest dirty ratio, or None."""
        best: LogToClean | None = None
        for plog in plogs:
            if not plog.config.cleanup_policy.compacts:
                continue
            ltc = self.log_to_clean(plog, now)
            if not self.is_due(ltc, plog.config.min_cleanable_dirty_ratio, now):
                continue
            if best is None or ltc.dirty_ratio > best.dirty_ratio:
                best = ltc
        return best
