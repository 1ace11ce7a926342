"""Planning a read: concrete offsets per partition, and the offset ranges Spark tasks read.

Everything here is derived from the log directory and the offsets passed in, never from
memory of an earlier call: Spark may run the planning callbacks of a streaming query in a
Python process of its own, restarted at any time.

Offsets per partition (:data:`PartitionOffsets`, ``{topic: {partition: offset}}``) are
the source's position; :func:`offsets_to_json` / :func:`offsets_from_json` convert them
to and from the JSON Spark checkpoints (``{"topic": {"0": 42}}``, Kafka's layout; the
offset is the *next* offset to read).

An :class:`OffsetRange` is half-open: ``start ≤ offset < end``. Invariants of a plan:
every range lies inside one segment (``base_i ≤ start < end ≤ base_{i+1}``), holds at
most ``max_offsets_per_partition`` offsets, and the ranges of a partition are disjoint
and cover ``[start, end)`` exactly. With ``wholePartitions`` the first two do not hold: one
range per partition, ``[start, end)`` itself, across its segments.

Thread-safety: functions only; :class:`LogPlanner` holds one ``Log`` and is as
thread-safe as it (``Log`` is).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from eventstore.errors import ConfigError, OffsetOutOfRangeError
from eventstore.isolation import IsolationLevel, end_offset, note_held_back
from eventstore.log import Log
from eventstore.segment import list_segment_bases
from projections.options import EARLIEST, LATEST, OffsetSpec, SourceOptions

PartitionOffsets = dict[str, dict[int, int]]


@dataclass(frozen=True, slots=True)
class OffsetRange:
    """Offsets ``[start, end)`` of one partition: what one Spark task reads."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def offsets_to_json(offsets: Mapping[str, Mapping[int, int]]) -> dict[str, Any]:
    """``{topic: {partition: offset}}`` → Spark's JSON-able form with string partition keys."""
    return {t: {str(p): o for p, o in sorted(per.items())} for t, per in sorted(offsets.items())}


def offsets_from_json(raw: Mapping[str, Any]) -> PartitionOffsets:
    """The inverse of :func:`offsets_to_json` (validated: a checkpoint may be edited by hand)."""
    out: PartitionOffsets = {}
    for topic, per in raw.items():
        if not isinstance(per, Mapping):
            raise ConfigError(f"source offset of topic {topic!r} must map partitions to offsets, not {per!r}")
        out[topic] = {int(p): int(o) for p, o in per.items()}
    return out


class LogPlanner:
    """The log as seen by planning: partitions, their bounds, their segments."""

    def __init__(self, options: SourceOptions, *, missing_ok: bool = False) -> None:
        """``missing_ok`` (streaming reads, like Kafka's ``subscribe``): a topic that does not
        exist yet has no partitions, and its partitions are read from their earliest offset
        once it appears; otherwise (batch reads) a missing topic is an error."""
        self.options = options
        self.missing_ok = missing_ok
        self.log = Log(options.path, create=False)

    def close(self) -> None:
        self.log.close()

    def __enter__(self) -> LogPlanner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def partitions(self) -> list[tuple[str, int]]:
        """Every ``(topic, partition)`` read, in order (UnknownTopicError for a missing topic,
        unless ``missing_ok``)."""
        topics = self.options.topics
        if self.missing_ok:
            existing = set(self.log.topics())
            topics = tuple(t for t in topics if t in existing)
        return [(t, p) for t in topics for p in range(self.log.topic(t).partitions)]

    def earliest(self, topic: str, partition: int) -> int:
        return self.log.partition(topic, partition).log_start_offset()

    def latest(self, topic: str, partition: int) -> int:
        """Where a reader stops: the last stable offset (read_committed) or the log end."""
        return end_offset(self.log.partition(topic, partition), self.options.isolation)

    def latest_offsets(self, *, note_open_transactions: bool = False) -> PartitionOffsets:
        """:meth:`latest` of every partition.

        ``note_open_transactions``: a read_committed stream held back by an open
        transaction reports it, so that a transaction abandoned by a dead producer is
        eventually aborted (as a held-back consumer does; eventstore.isolation).
        """
        out: PartitionOffsets = {}
        for topic, partition in self.partitions():
            out.setdefault(topic, {})[partition] = self.latest(topic, partition)
            if note_open_transactions and self.options.isolation is IsolationLevel.READ_COMMITTED:
                plog = self.log.partition(topic, partition)
                if plog.log_end_offset() > out[topic][partition]:
                    note_held_back(self.log, plog)
        return out

    def resolve(self, spec: OffsetSpec) -> PartitionOffsets:
        """Concrete offsets for a spec: sentinels become earliest / latest now."""
        out: PartitionOffsets = {}
        for topic, partition in self.partitions():
            offset = spec.for_partition(topic, partition)
            if offset == EARLIEST:
                offset = self.earliest(topic, partition)
            elif offset == LATEST:
                offset = self.latest(topic, partition)
            out.setdefault(topic, {})[partition] = offset
        return out

    def complete(self, offsets: PartitionOffsets) -> PartitionOffsets:
        """``offsets`` with every partition read: a missing one (a topic added to the
        subscription since the position was taken) at its earliest offset."""
        out: PartitionOffsets = {}
        for topic, partition in self.partitions():
            given = offsets.get(topic, {}).get(partition)
            out.setdefault(topic, {})[partition] = self.earliest(topic, partition) if given is None else given
        return out

    def checked_start(self, topic: str, partition: int, start: int) -> int:
        """``start``, or the log start when retention removed it and failOnDataLoss is false."""
        earliest = self.earliest(topic, partition)
        if start >= earliest:
            return start
        if self.options.fail_on_data_loss:
            raise OffsetOutOfRangeError(
                f"offsets {start} … {earliest - 1} of {topic}-{partition} were removed by retention; "
                "set option failOnDataLoss=false to skip them"
            )
        return earliest

    def plan(self, starts: PartitionOffsets, ends: PartitionOffsets) -> list[OffsetRange]:
        """The ranges to read between two positions, one or more per segment (one per
        partition with ``wholePartitions``: such a range may span segments).

        A partition missing from ``starts`` starts at its earliest offset (a topic
        created after the position was taken); ends are capped at :meth:`latest`.
        """
        ranges: list[OffsetRange] = []
        for topic, partition in self.partitions():
            latest = self.latest(topic, partition)
            wanted_end = ends.get(topic, {}).get(partition, LATEST)
            end = latest if wanted_end == LATEST else min(wanted_end, latest)
            start = starts.get(topic, {}).get(partition)
            start = self.earliest(topic, partition) if start is None else start
            if start >= end:
                continue
            start = self.checked_start(topic, partition, start)
            whole = OffsetRange(topic, partition, start, end)
            if self.options.whole_partitions:  # one task reads the partition in offset order (a fold's stream)
                ranges.append(whole)
                continue
            bases = list_segment_bases(self.log.partition(topic, partition).directory)
            ranges.extend(split_by_segments(whole, bases, self.options.max_offsets_per_partition))
        return split_for_parallelism(ranges, self.options.min_partitions)


def split_by_segments(rng: OffsetRange, bases: list[int], max_offsets: int) -> list[OffsetRange]:
    """``rng`` cut at segment boundaries, then into pieces of at most ``max_offsets`` offsets."""
    out: list[OffsetRange] = []
    first = max(bisect.bisect_right(bases, rng.start) - 1, 0)
    for i in range(first, max(len(bases), 1)):
        lo = max(rng.start, bases[i] if bases else rng.start)
        hi = min(rng.end, bases[i + 1]) if i + 1 < len(bases) else rng.end
        if lo >= rng.end:
            break
        out.extend(_chunks(OffsetRange(rng.topic, rng.partition, lo, hi), max_offsets))
    return out


def _chunks(rng: OffsetRange, max_offsets: int) -> Iterable[OffsetRange]:
    for lo in range(rng.start, rng.end, max_offsets):
        yield OffsetRange(rng.topic, rng.partition, lo, min(lo + max_offsets, rng.end))


def split_for_parallelism(ranges: list[OffsetRange], min_partitions: int | None) -> list[OffsetRange]:
    """Kafka's ``minPartitions``: split ranges in proportion to their size until there are enough."""
    if not min_partitions or len(ranges) >= min_partitions:
        return ranges
    total = sum(r.size for r in ranges)
    out: list[OffsetRange] = []
    for r in ranges:
        parts = max(1, math.ceil(r.size * min_partitions / total))
        out.extend(_chunks(r, math.ceil(r.size / parts)))
    return out


def cap_offsets(starts: PartitionOffsets, latest: PartitionOffsets, max_records: int) -> PartitionOffsets:
    """Ends that advance at most ``max_records`` offsets past ``starts`` (which holds every
    partition of ``latest``) in all, shared out in
    proportion to what each partition has available (Kafka's ``maxOffsetsPerTrigger``).

    Offsets count records plus the control and aborted records a reader skips, so a
    micro-batch holds at most ``max_records`` records.
    """
    available = {(t, p): max(0, end - starts[t][p]) for t, per in latest.items() for p, end in per.items()}
    total = sum(available.values())
    if total <= max_records:
        return {t: dict(per) for t, per in latest.items()}
    shares = {tp: n * max_records // total for tp, n in available.items()}
    leftover = max_records - sum(shares.values())
    for tp in sorted(available, key=lambda tp: (shares[tp] - available[tp], tp)):
        if leftover == 0:
            break
        if shares[tp] < available[tp]:
            shares[tp] += 1
            leftover -= 1
    out: PartitionOffsets = {}
    for (t, p), share in shares.items():
        out.setdefault(t, {})[p] = starts[t][p] + share
    return out
