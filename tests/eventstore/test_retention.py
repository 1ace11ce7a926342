"""Retention: whole closed segments go by age (``retention_ms``) or by size (``retention_bytes``).

Timestamps are explicit on send and ``now=`` is explicit in ``apply_retention``, so what
must be deleted is known exactly. Checked: only a prefix of the closed segments goes (the
active one never, however old), the log start offset moves, the remaining data is intact,
and consumers below the new log start are reset (``earliest``) or get OffsetOutOfRangeError
(``none``). ``compact,delete`` topics get both compaction and retention.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from logutil import (
    BIG_MS,
    FAST,
    Model,
    check_exact,
    check_segments,
    consume_all,
    expected_after_compaction,
    produce,
    read_fresh,
    send_many,
    send_one,
    snapshot,
)

from eventstore.cleaner import apply_retention, compact_partition
from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import OffsetOutOfRangeError
from eventstore.log import Log
from eventstore.log_cleaner import LogCleaner
from eventstore.partition_log import READER_REFRESH_SECONDS
from eventstore.segment import list_segment_bases, log_path
from eventstore.topic import DAY_MS, CleanupPolicy, TopicConfig, now_ms

HOUR_MS = 3600 * 1000
TP = TopicPartition("t", 0)


def delete_config(**kw: int) -> TopicConfig:
    kw.setdefault("segment_bytes", 1 << 20)
    return TopicConfig(cleanup_policy=CleanupPolicy.DELETE, segment_ms=BIG_MS, **kw)


def _segments_by_age(log: Log, model: Model, now: int, ages_h: list[float], *, active_age_h: float) -> list[int]:
    """One closed segment per age (its records stamped about that long before ``now``), then an
    active segment stamped ``active_age_h`` ago. Returns the segment bases (active last)."""
    rng = random.Random(len(ages_h))
    plog = log.partition("t", 0)
    for age in ages_h:
        stamp = now - int(age * HOUR_MS)
        for j in range(rng.randint(3, 6)):  # several batches, timestamps rising inside the segment
            produce(log, "t", model, rng, rng.randint(1, 8), n_keys=50, tombstone_rate=0, timestamp=stamp + j)
        plog.roll()
    produce(log, "t", model, rng, 10, n_keys=50, tombstone_rate=0, timestamp=now - int(active_age_h * HOUR_MS))
    bases = list_segment_bases(plog.directory)
    assert len(bases) == len(ages_h) + 1
    return bases


def _records_from(model: Model, start: int) -> dict[int, object]:
    return {o: r for o, r in model.part(0).items() if o >= start}


def test_retention_ms_deletes_old_closed_segments_never_the_active_one(tmp_path: Path) -> None:
    path = tmp_path / "log"
    model = Model()
    now = now_ms()
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, delete_config(retention_ms=10 * HOUR_MS))
        plog = log.partition("t", 0)
        # the active segment is the oldest of all: it must survive anyway
        bases = _segments_by_age(log, model, now, [30, 25, 12, 8, 2], active_age_h=40)
        assert plog.log_start_offset() == 0
        before = snapshot(plog.directory)

        assert apply_retention(plog, now=now) == 3
        assert list_segment_bases(plog.directory) == bases[3:]
        after = snapshot(plog.directory)
        for name, data in after.items():
            assert before[name] == data, f"{name} was modified (retention deletes whole segments only)"
        with Log(path, create=False) as other:
            assert other.partition("t", 0).log_start_offset() == bases[3], "the log start offset did not move"
        check_exact(read_fresh(path, "t", 0, start=None), _records_from(model, bases[3]), what="after 10 h")

        assert apply_retention(plog, now=now) == 0, "a second pass at the same time deleted more"

        # far in the future every closed segment has expired; the active one stays, untouched
        assert apply_retention(plog, now=now + 1000 * DAY_MS) == 2
        assert list_segment_bases(plog.directory) == [bases[-1]]
        name = log_path(plog.directory, bases[-1]).name
        assert snapshot(plog.directory)[name] == before[name]
        check_exact(read_fresh(path, "t", 0, start=None), _records_from(model, bases[-1]), what="all expired")
        check_segments(plog.directory)


def test_retention_ms_only_removes_a_prefix(tmp_path: Path) -> None:
    """An expired segment after a recent one stays: the log never gets a hole."""
    path = tmp_path / "log"
    model = Model()
    now = now_ms()
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, delete_config(retention_ms=10 * HOUR_MS))
        plog = log.partition("t", 0)
        bases = _segments_by_age(log, model, now, [30, 2, 30], active_age_h=0)
        assert apply_retention(plog, now=now) == 1
        assert list_segment_bases(plog.directory) == bases[1:]
        check_exact(read_fresh(path, "t", 0, start=None), _records_from(model, bases[1]), what="prefix")


def _retention_bytes_case(tmp_path: Path, pick_limit: str) -> None:
    path = tmp_path / "log"
    model = Model()
    now = now_ms()
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, delete_config(retention_ms=-1))
        plog = log.partition("t", 0)
        bases = _segments_by_age(log, model, now, [5, 4, 3, 2, 1], active_age_h=0)
        sizes = {b: log_path(plog.directory, b).stat().st_size for b in bases}
        total = sum(sizes.values())
        assert plog.size_bytes() == total
        limit = {
            "zero": 0,
            "total": total,
            "one_below_total": total - 1,
            "half": total // 2,
            "active_only": sizes[bases[-1]],
        }[pick_limit]
        log.alter_topic_config("t", {"retention_bytes": str(limit)})

        deleted = apply_retention(plog, now=now)
        remaining = list_segment_bases(plog.directory)
        assert remaining == bases[deleted:], "retention must delete the oldest segments first"
        assert bases[-1] in remaining, "the active segment was deleted"
        left = sum(sizes[b] for b in remaining)
        assert left <= limit or remaining == [bases[-1]], f"{left} bytes left above retention_bytes={limit}"
        if deleted:
            assert left + sizes[bases[deleted - 1]] > limit, "deleted a segment that was not needed"
        else:
            assert total <= limit
        assert plog.size_bytes() == left
        assert plog.log_start_offset() == remaining[0]
        check_exact(read_fresh(path, "t", 0, start=None), _records_from(model, remaining[0]), what=pick_limit)


@pytest.mark.parametrize("pick_limit", ["zero", "total", "one_below_total", "half", "active_only"])
def test_retention_bytes_deletes_oldest_closed_segments_while_above_the_limit(tmp_path: Path, pick_limit: str) -> None:
    _retention_bytes_case(tmp_path, pick_limit)


@pytest.mark.parametrize("same_log", [True, False], ids=["reader-in-the-same-Log", "reader-in-another-Log"])
def test_consumers_below_the_new_log_start(tmp_path: Path, same_log: bool) -> None:
    """A consumer whose position was deleted is reset to the log start (earliest) or fails (none).

    The consumers have already read from the segments that retention deletes (so their Log
    holds open readers of those files and a cached segment list), as any live consumer has.
    Through the Log that ran retention this must hold at once; another Log (another
    process) learns of the deletion within ``READER_REFRESH_SECONDS``.
    """
    path = tmp_path / "log"
    model = Model()
    now = now_ms()
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, delete_config(retention_ms=10 * HOUR_MS))
        bases = _segments_by_age(log, model, now, [30, 25, 20, 2], active_age_h=0)
        reader_log = log if same_log else Log(path, create=False)
        try:
            earliest = Consumer(reader_log, auto_offset_reset="earliest", max_poll_bytes=1)
            strict = Consumer(reader_log, auto_offset_reset="none", max_poll_bytes=1)
            for consumer in (earliest, strict):
                consumer.assign([TP])
                consumer.seek(TP, 0)
                assert consumer.poll(0), "nothing read before retention"
                assert 0 < consumer.position(TP) < bases[1], "the consumer should sit inside segment 0"
            assert reader_log.partition("t", 0).log_start_offset() == 0

            assert apply_retention(log.partition("t", 0), now=now) == 3
            start = bases[3]
            if not same_log:
                time.sleep(READER_REFRESH_SECONDS + 0.05)

            got = earliest.poll(0)
            assert got, "the reset consumer returned nothing"
            first = next(iter(got)).offset
            assert first == start, f"a consumer below the log start got offset {first}, not the new start {start}"
            assert earliest.position(TP) > start
            with pytest.raises(OffsetOutOfRangeError):
                strict.poll(0)

            fresh = Consumer(reader_log, auto_offset_reset="none")
            fresh.assign([TP])
            fresh.seek_to_beginning()
            assert fresh.position(TP) == start, "seek_to_beginning went below the log start"
            assert reader_log.partition("t", 0).log_start_offset() == start, "stale log start offset"
            check_exact(consume_all(reader_log, "t", 0, start=start), _records_from(model, start), what="from start")
        finally:
            if reader_log is not log:
                reader_log.close()


# ---------------------------------------------------------------------------- compact,delete


def test_compact_delete_does_both(tmp_path: Path) -> None:
    """The cleaner compacts the closed segments, then deletes the expired ones."""
    path = tmp_path / "log"
    model = Model()
    now = now_ms()
    cfg = TopicConfig(
        cleanup_policy=CleanupPolicy.COMPACT_DELETE,
        segment_bytes=6144,
        segment_ms=BIG_MS,
        retention_ms=7 * DAY_MS,
        delete_retention_ms=DAY_MS,
    )
    keys = [b"k%d" % i for i in range(8)]
    pad = b"." * 150
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, cfg)
        plog = log.partition("t", 0)
        for i in range(3):  # old: 10 days, every key written in every batch
            send_many(log, "t", model, [(k, b"old-%d-" % i + pad) for k in keys], timestamp=now - 10 * DAY_MS + i)
        plog.roll()
        for i in range(3):  # recent: an hour old, half the keys rewritten, one of them deleted
            items = [(k, b"new-%d-" % i + pad) for k in keys[:4]]
            if i == 2:
                items[3] = (keys[3], None)
            send_many(log, "t", model, items, timestamp=now - HOUR_MS + i)
        plog.roll()
        send_one(log, "t", model, b"k0", b"active", timestamp=now)
        old_base, mid_base, active_base = list_segment_bases(plog.directory)
        sizes = [log_path(plog.directory, b).stat().st_size for b in (old_base, mid_base)]
        assert sum(sizes) > cfg.segment_bytes, f"precondition: the two closed segments must not be merged {sizes}"

        stats = LogCleaner(log).run_once()
        assert stats["t-0"].segments_cleaned == 2

        assert list_segment_bases(plog.directory) == [mid_base, active_base], "the expired segment was not deleted"
        assert plog.log_start_offset() == mid_base
        expected = expected_after_compaction(model.part(0), active_base, start=mid_base)
        view = read_fresh(path, "t", 0, start=None)
        check_exact(view, expected, what="compact,delete")
        assert any(r.value is None for _, r in view), "the recent tombstone must stay (delete_retention_ms)"
        assert len(view) < len(_records_from(model, mid_base)), "nothing was compacted"
        check_segments(plog.directory)


def test_policies_apply_only_what_they_name(tmp_path: Path) -> None:
    """``compact`` never deletes by age; ``delete`` never compacts."""
    now = now_ms()
    for policy in (CleanupPolicy.COMPACT, CleanupPolicy.DELETE):
        path = tmp_path / policy.name / "log"
        model = Model()
        with Log(path, fsync=FAST) as log:
            log.create_topic(
                "t",
                1,
                TopicConfig(cleanup_policy=policy, segment_ms=BIG_MS, retention_ms=HOUR_MS, retention_bytes=1),
            )
            plog = log.partition("t", 0)
            for i in range(3):
                for k in range(4):
                    send_one(log, "t", model, b"k%d" % k, b"v%d" % i, timestamp=now - DAY_MS)
                plog.roll()
            before = snapshot(plog.directory)
            if policy is CleanupPolicy.COMPACT:
                assert apply_retention(plog, now=now) == 0
                assert snapshot(plog.directory) == before
                assert compact_partition(plog, now=now).segments_cleaned == 3
            else:
                assert compact_partition(plog, now=now).segments_cleaned == 0
                assert snapshot(plog.directory) == before
                assert apply_retention(plog, now=now) == 3
