"""Model-based tests of offset and time lookups: the log against a sorted dict.

Random batches (sizes, timestamps going back and forth), tiny index intervals and
segments so that indexes, rolls and lookups are exercised; every lookup is compared
with the model, before and after reopening, and after the indexes are thrown away.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.producer import Producer
from eventstore.record_batch import build_records, encode_batch, timestamp_deltas_for

TP = TopicPartition("m", 0)


def _fill(log: Log, rng: random.Random, batches: int) -> dict[int, tuple[bytes, int]]:
    """Append random batches; return the model: offset -> (value, timestamp)."""
    model: dict[int, tuple[bytes, int]] = {}
    ts = 1_000_000
    for _ in range(batches):
        n = rng.choice([1, 1, 2, 5, 30, 200])
        stamps = []
        for _ in range(n):
            ts += rng.randint(-50, 100)  # timestamps are not monotonic, as in Kafka
            stamps.append(ts)
        values = [rng.randbytes(rng.randint(0, 300)) for _ in range(n)]
        first, max_ts, deltas = timestamp_deltas_for(stamps)
        records = build_records([None] * n, values, deltas)
        result = log.append("m", 0, encode_batch(records, first_timestamp=first, max_timestamp=max_ts))
        for i in range(n):
            model[result.base_offset + i] = (values[i], stamps[i])
    return model


def _read_from(log: Log, offset: int, limit: int) -> list[tuple[int, bytes, int]]:
    consumer = Consumer(log)
    consumer.assign([TP])
    consumer.seek(TP, offset)
    out: list[tuple[int, bytes, int]] = []
    while len(out) < limit:
        polled = consumer.poll(max_records=limit - len(out))
        if not polled:
            break
        out.extend((r.offset, r.value or b"", r.timestamp) for r in polled)
    return out


def _first_at_or_after(model: dict[int, tuple[bytes, int]], ts: int) -> int | None:
    return next((o for o in sorted(model) if model[o][1] >= ts), None)


def _check(log: Log, model: dict[int, tuple[bytes, int]], rng: random.Random) -> None:
    offsets = sorted(model)
    assert offsets == list(range(len(offsets)))  # dense: nothing was compacted
    plog = log.partition("m", 0)
    assert plog.log_end_offset() == len(offsets)
    for offset in [*rng.sample(offsets, 40), 0, offsets[-1]]:
        got = _read_from(log, offset, 7)
        want = [(o, model[o][0], model[o][1]) for o in offsets[offset : offset + 7]]
        assert got == want, offset
    consumer = Consumer(log)
    consumer.assign([TP])
    stamps = [t for _, t in model.values()]
    probes = [*rng.sample(stamps, 30), min(stamps) - 1, max(stamps), max(stamps) + 1]
    for ts in probes:
        assert consumer.offsets_for_times({TP: ts})[TP] == _first_at_or_after(model, ts), ts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lookups_match_model_across_rolls_reopen_and_lost_indexes(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    interval = rng.choice([1, 100, 1000, 4096])
    with Log(tmp_path) as log:
        log.create_topic("m", 1, overrides={"segment_bytes": str(rng.choice([4096, 20000])),
                                            "index_interval_bytes": str(interval)})
        model = _fill(log, rng, 150)
        _check(log, model, rng)
    assert len(list((tmp_path / "m-0").glob("*.log"))) > 3  # rolls happened
    with Log(tmp_path) as log:  # clean reopen
        _check(log, model, rng)
        model.update(_fill(log, rng, 20))
        _check(log, model, rng)
    for idx in (tmp_path / "m-0").glob("*index"):
        idx.write_bytes(b"\x07" * 13)  # garbage: lookups must not trust it
    with Log(tmp_path) as log:
        _check(log, model, rng)
    for idx in (tmp_path / "m-0").glob("*index"):
        idx.unlink()
    (tmp_path / "m-0" / "recovery-point").unlink()
    with Log(tmp_path) as log:
        model.update(_fill(log, rng, 5))  # the writer rebuilds the active segment's indexes
        _check(log, model, rng)


def test_seek_to_time_and_keyless_round_robin(tmp_path: Path) -> None:
    with Log(tmp_path) as log:
        log.create_topic("rr", 3)
        with Producer(log, linger_ms=1000) as producer:
            partitions = []
            for _ in range(3):
                futures = [producer.send("rr", b"x", timestamp=5000 + i) for i in range(4)]
                producer.flush()
                partitions.append({f.result().partition for f in futures})
        # keyless records stick to one partition per batch, then move on
        assert [len(p) for p in partitions] == [1, 1, 1]
        assert set().union(*partitions) == {0, 1, 2}
        tp = TopicPartition("rr", partitions[1].pop())
        consumer = Consumer(log)
        consumer.assign([tp])
        consumer.seek_to_time(tp, 5002)
        assert [r.timestamp for r in consumer.poll()] == [5002, 5003]
        consumer.seek_to_time(tp, 9999)
        assert consumer.position(tp) == 4 and not consumer.poll()
