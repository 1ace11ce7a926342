"""Helpers for the compaction and retention tests: a reference model of what was produced,
workloads that fill it, and readers that check what a real log returns against it.

Everything here works on real log directories through the public API (Log, Producer,
Consumer) plus a raw scan of the segment files for the storage-level invariants.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.producer import Producer
from eventstore.segment import CLEANED_SUFFIX, SegmentReader, list_segment_bases

FAST = FsyncPolicy(FsyncMode.NONE)  # no fsync per append: kills keep the page cache anyway
BIG_MS = 10**15  # segment_ms that never triggers a time-based roll


@dataclass(frozen=True, slots=True)
class Rec:
    key: bytes | None
    value: bytes | None
    timestamp: int


@dataclass
class Model:
    """Every acknowledged record, per partition, by offset (from the producer's RecordMetadata)."""

    records: dict[int, dict[int, Rec]] = field(default_factory=dict)
    serial: int = 0

    def add(self, partition: int, offset: int, rec: Rec) -> None:
        part = self.records.setdefault(partition, {})
        assert offset not in part, f"offset {offset} of partition {partition} acknowledged twice"
        part[offset] = rec

    def part(self, partition: int) -> dict[int, Rec]:
        return self.records.get(partition, {})

    def next_value(self, rng: random.Random, pad: int) -> bytes:
        self.serial += 1
        return f"v{self.serial}:".encode() + b"x" * rng.randrange(pad + 1)


def final_by_key(records: dict[int, Rec]) -> dict[bytes | None, tuple[int, Rec]]:
    """Key -> (offset, record) of the last record written with that key."""
    out: dict[bytes | None, tuple[int, Rec]] = {}
    for off in sorted(records):
        out[records[off].key] = (off, records[off])
    return out


def expected_after_compaction(
    records: dict[int, Rec], clean_end: int, *, drop_tombstones: bool = False, start: int = 0
) -> dict[int, Rec]:
    """The exact record set after compacting every offset below ``clean_end``.

    Below ``clean_end``: the last record of each key within that range (keyless records
    stay); tombstones among them are gone when ``drop_tombstones``. From ``clean_end`` on:
    everything. Offsets below ``start`` (deleted by retention) are left out.
    """
    latest: dict[bytes, int] = {}
    for off in sorted(o for o in records if o < clean_end):
        key = records[off].key
        if key is not None:
            latest[key] = off
    keep = set(latest.values())
    out: dict[int, Rec] = {}
    for off, rec in records.items():
        if off < start:
            continue
        is_latest = off in keep and not (drop_tombstones and rec.value is None)
        if off >= clean_end or rec.key is None or is_latest:
            out[off] = rec
    return out


# ---------------------------------------------------------------------------- workloads


def produce(
    log: Log,
    topic: str,
    model: Model,
    rng: random.Random,
    n: int,
    *,
    n_keys: int,
    tombstone_rate: float = 0.1,
    max_batch: int = 12,
    roll_rate: float = 0.0,
    pad: int = 60,
    timestamp: int | None = None,
    key_prefix: str = "k",
) -> None:
    """Send ``n`` random keyed records (some tombstones) in random-sized batches.

    Each flush makes one batch per partition; after a flush, with probability
    ``roll_rate`` every partition is rolled (small closed segments: multi-segment groups).
    """
    partitions = log.topic(topic).partitions
    with Producer(log, linger_ms=3_600_000, batch_size=1 << 30) as producer:
        pending: list[tuple[bytes, bytes | None, object]] = []
        target = rng.randint(1, max_batch)

        def flush() -> None:
            producer.flush()
            for key, value, fut in pending:
                md = fut.result()  # type: ignore[attr-defined]
                model.add(md.partition, md.offset, Rec(key, value, md.timestamp))
            pending.clear()

        for _ in range(n):
            key = f"{key_prefix}{rng.randrange(n_keys):04d}".encode()
            value = None if rng.random() < tombstone_rate else model.next_value(rng, pad)
            pending.append((key, value, producer.send(topic, value, key=key, timestamp=timestamp)))
            if len(pending) >= target:
                flush()
                target = rng.randint(1, max_batch)
                if roll_rate and rng.random() < roll_rate:
                    for p in range(partitions):
                        log.partition(topic, p).roll()
        flush()


def send_one(log: Log, topic: str, model: Model, key: bytes, value: bytes | None, timestamp: int | None = None) -> int:
    with Producer(log, linger_ms=3_600_000) as producer:
        future = producer.send(topic, value, key=key, timestamp=timestamp)
        producer.flush()
        md = future.result()
    model.add(md.partition, md.offset, Rec(key, value, md.timestamp))
    return md.offset


# ---------------------------------------------------------------------------- reading


def consume_all(log: Log, topic: str, partition: int, *, start: int | None = 0) -> list[tuple[int, Rec]]:
    """Every record a consumer returns from ``start`` (default 0; None: the log start) to the end."""
    tp = TopicPartition(topic, partition)
    consumer = Consumer(log, auto_offset_reset="none", max_poll_bytes=64 << 10)
    consumer.assign([tp])
    if start is None:
        consumer.seek_to_beginning(tp)
    else:
        consumer.seek(tp, start)
    end = log.partition(topic, partition).log_end_offset()
    out: list[tuple[int, Rec]] = []
    stuck = 0
    while consumer.position(tp) < end:
        before = consumer.position(tp)
        for r in consumer.poll(0):
            out.append((r.offset, Rec(r.key, r.value, r.timestamp)))
        if consumer.position(tp) == before:
            stuck += 1
            assert stuck < 3, f"consumer stuck at offset {before} of {topic}-{partition} (end {end})"
    consumer.close()
    return out


def read_fresh(log_dir: Path, topic: str, partition: int, *, start: int | None = 0) -> list[tuple[int, Rec]]:
    """Read with a new Log object (no cached readers), as another process would."""
    with Log(log_dir, create=False, fsync=FAST) as log:
        return consume_all(log, topic, partition, start=start)


def check_view(
    view: list[tuple[int, Rec]],
    produced: dict[int, Rec],
    *,
    tombstones_may_be_gone: bool = False,
    what: str = "",
) -> None:
    """What every correct state shows a consumer reading from offset 0.

    Offsets strictly increase; each returned record is the one produced at that offset;
    the last record seen for every key is the key's final record (a final tombstone may
    instead be absent together with every earlier value when ``tombstones_may_be_gone``).
    """
    offsets = [o for o, _ in view]
    for a, b in itertools.pairwise(offsets):
        assert a < b, f"{what}: offsets not strictly increasing: {a} then {b}"
    for off, rec in view:
        assert off in produced, f"{what}: offset {off} returned but never acknowledged"
        want = produced[off]
        assert (rec.key, rec.value) == (want.key, want.value), (
            f"{what}: offset {off} returned {rec.key!r}={rec.value!r}, produced {want.key!r}={want.value!r}"
        )
    seen = final_by_key(dict(view))
    final = final_by_key(produced)
    for key, (off, rec) in final.items():
        got = seen.get(key)
        if got is None and rec.value is None and tombstones_may_be_gone:
            continue
        assert got is not None, f"{what}: key {key!r} (final offset {off}) is missing"
        assert got[0] == off, (
            f"{what}: last record of key {key!r} is at offset {got[0]} ({got[1].value!r}), "
            f"the final one is at {off} ({rec.value!r})"
        )
    assert set(seen) <= set(final), f"{what}: keys never produced: {set(seen) - set(final)}"


def check_exact(view: list[tuple[int, Rec]], expected: dict[int, Rec], *, what: str = "") -> None:
    got = {o: (r.key, r.value) for o, r in view}
    want = {o: (r.key, r.value) for o, r in expected.items()}
    assert len(got) == len(view), f"{what}: an offset was returned twice"
    if got != want:
        extra = sorted(set(got) - set(want))
        missing = sorted(set(want) - set(got))
        wrong = sorted(o for o in set(got) & set(want) if got[o] != want[o])
        raise AssertionError(
            f"{what}: {len(extra)} unexpected offsets {extra[:10]}, {len(missing)} missing {missing[:10]}, "
            f"{len(wrong)} with other content {wrong[:10]}"
        )


# ---------------------------------------------------------------------------- storage level


def segment_offsets(directory: Path, base: int) -> list[int]:
    """The offsets stored in one segment file (raw scan of every batch)."""
    reader = SegmentReader(directory, base)
    try:
        out: list[int] = []
        pos, size = 0, reader.size()
        while pos < size:
            batches = reader.read_batches(pos, 1 << 20)
            assert batches, f"undecodable data in {reader.path} at byte {pos}"
            for header, records in batches:
                offs = pc.add(records.column(0).cast(pa.int64()), pa.scalar(header.base_offset)).to_pylist()
                assert all(header.base_offset <= o <= header.last_offset for o in offs), reader.path
                out.extend(offs)
                pos += header.size
        return out
    finally:
        reader.close()


def check_segments(directory: Path, *, what: str = "") -> None:
    """Storage invariants: no compaction leftovers; every segment's offsets are increasing,
    not below its base, and above every offset of the previous segment (no offset stored twice)."""
    cleaned = [n for n in os.listdir(directory) if n.endswith(CLEANED_SUFFIX)]
    assert not cleaned, f"{what}: unsettled compaction files in {directory}: {cleaned}"
    prev_last = -1
    prev_base = -1
    for base in list_segment_bases(directory):
        offs = segment_offsets(directory, base)
        assert base > prev_last, (
            f"{what}: segment {base} of {directory.name} starts at or below offset {prev_last} "
            f"stored in the previous segment {prev_base}: offsets are stored twice"
        )
        for a, b in itertools.pairwise(offs):
            assert a < b, f"{what}: segment {base}: offsets {a}, {b} out of order"
        if offs:
            assert offs[0] >= base, f"{what}: segment {base} holds offset {offs[0]} below its base"
            prev_last = offs[-1]
        prev_base = base


def snapshot(directory: Path) -> dict[str, bytes]:
    """Contents of the segment and index files of a partition directory."""
    return {
        n: (directory / n).read_bytes()
        for n in os.listdir(directory)
        if n.endswith((".log", ".index", ".timeindex")) and not n.startswith(".")
    }


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def send_many(
    log: Log, topic: str, model: Model, items: list[tuple[bytes, bytes | None]], timestamp: int | None = None
) -> list[int]:
    """Send ``items`` as one batch per partition; return their offsets."""
    with Producer(log, linger_ms=3_600_000, batch_size=1 << 30) as producer:
        futures = [producer.send(topic, value, key=key, timestamp=timestamp) for key, value in items]
        producer.flush()
        offsets = []
        for (key, value), future in zip(items, futures, strict=True):
            md = future.result()
            model.add(md.partition, md.offset, Rec(key, value, md.timestamp))
            offsets.append(md.offset)
    return offsets
