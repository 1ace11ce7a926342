"""Options parsing and read planning, without Spark: model-based checks of the split and cap rules."""

from __future__ import annotations

import random

import pytest

from eventstore.errors import ConfigError
from eventstore.isolation import IsolationLevel
from projections.options import EARLIEST, LATEST, OffsetSpec, SourceOptions
from projections.planning import (
    OffsetRange,
    cap_offsets,
    offsets_from_json,
    offsets_to_json,
    split_by_segments,
    split_for_parallelism,
)


def _covered(ranges: list[OffsetRange]) -> list[int]:
    return [o for r in ranges for o in range(r.start, r.end)]


@pytest.mark.parametrize("seed", range(40))
def test_split_by_segments_covers_the_range_inside_segments(seed: int) -> None:
    rng = random.Random(seed)
    bases = sorted({0, *rng.sample(range(1, 500), rng.randrange(0, 8))})
    start = rng.randrange(0, 520)
    whole = OffsetRange("t", 0, start, start + rng.randrange(0, 300))
    max_offsets = rng.choice([1, 7, 50, 1 << 20])
    pieces = split_by_segments(whole, bases, max_offsets)
    assert _covered(pieces) == list(range(whole.start, whole.end))  # disjoint, in order, exact
    for piece in pieces:
        assert 0 < piece.size <= max_offsets
        i = max(j for j, b in enumerate(bases) if b <= piece.start)
        assert piece.end <= (bases[i + 1] if i + 1 < len(bases) else whole.end)  # inside one segment


def test_split_for_parallelism_reaches_min_partitions() -> None:
    ranges = [OffsetRange("t", 0, 0, 1000), OffsetRange("t", 1, 10, 30)]
    split = split_for_parallelism(ranges, 8)
    assert len(split) >= 8
    assert _covered(split) == _covered(ranges)
    assert split_for_parallelism(ranges, None) == ranges


@pytest.mark.parametrize("seed", range(40))
def test_cap_offsets_never_exceeds_the_limit_and_makes_progress(seed: int) -> None:
    rng = random.Random(seed)
    starts = {"a": {p: rng.randrange(0, 100) for p in range(rng.randrange(1, 5))}, "b": {0: rng.randrange(0, 50)}}
    latest = {
        t: {p: s + rng.choice([0, 0, 1, rng.randrange(0, 400)]) for p, s in per.items()} for t, per in starts.items()
    }
    limit = rng.randrange(1, 300)
    ends = cap_offsets(starts, latest, limit)
    advance = sum(ends[t][p] - starts[t][p] for t in starts for p in starts[t])
    available = sum(latest[t][p] - starts[t][p] for t in starts for p in starts[t])
    assert advance == min(limit, available)
    assert all(starts[t][p] <= ends[t][p] <= latest[t][p] for t in starts for p in starts[t])


def test_offsets_json_round_trip() -> None:
    offsets = {"orders": {0: 5, 1: 0, 10: 7}, "audit": {0: 3}}
    raw = offsets_to_json(offsets)
    assert raw == {"audit": {"0": 3}, "orders": {"0": 5, "1": 0, "10": 7}}
    assert offsets_from_json(raw) == offsets


def test_options_defaults_and_case() -> None:
    batch = SourceOptions.parse({"PATH": "/x", "Topic": "a, b,a"})
    assert batch.topics == ("a", "b")
    assert batch.starting_offsets == OffsetSpec(EARLIEST) and batch.ending_offsets == OffsetSpec(LATEST)
    assert batch.isolation is IsolationLevel.READ_COMMITTED and batch.fail_on_data_loss
    stream = SourceOptions.parse({"path": "/x", "subscribe": "a", "maxRecordsPerTrigger": "10"}, streaming=True)
    assert stream.starting_offsets == OffsetSpec(LATEST) and stream.max_records_per_trigger == 10
    spec = SourceOptions.parse({"path": "/x", "topic": "a", "startingOffsets": '{"a": {"0": 23, "1": -2}}'})
    assert spec.starting_offsets.for_partition("a", 0) == 23
    assert spec.starting_offsets.for_partition("a", 1) == EARLIEST
    assert spec.starting_offsets.for_partition("a", 2) == EARLIEST  # not named: the default


@pytest.mark.parametrize(
    ("options", "streaming", "message"),
    [
        ({"path": "/x", "topic": "a", "startingOffset": "earliest"}, False, "unknown tideline source option"),
        ({"topic": "a"}, False, "needs option path"),
        ({"path": "/x"}, False, "exactly one of options topic or subscribe"),
        ({"path": "/x", "topic": "a", "subscribe": "b"}, False, "exactly one of options topic or subscribe"),
        ({"path": "/x", "topic": "a", "endingOffsets": "earliest"}, False, "cannot be earliest"),
        ({"path": "/x", "topic": "a", "endingOffsets": '{"a": {"0": -2}}'}, False, "cannot be earliest"),
        ({"path": "/x", "topic": "a", "endingOffsets": "latest"}, True, "batch reads only"),
        ({"path": "/x", "topic": "a", "maxRecordsPerTrigger": "5"}, False, "streaming reads only"),
        ({"path": "/x", "topic": "a", "startingOffsets": '{"b": {"0": 1}}'}, False, "topic(s) not read: b"),
        ({"path": "/x", "topic": "a", "startingOffsets": "{nope"}, False, "earliest, latest or JSON"),
        ({"path": "/x", "topic": "a", "startingOffsets": '{"a": {"0": -3}}'}, False, "integer ≥ -2"),
        ({"path": "/x", "topic": "a", "isolation": "serializable"}, False, "read_committed or read_uncommitted"),
        ({"path": "/x", "topic": "a", "minPartitions": "0"}, False, "must be ≥ 1"),
        ({"path": "/x", "topic": "a", "failOnDataLoss": "maybe"}, False, "true or false"),
        ({"path": "/x", "topic": "a", "wholePartitions": "true", "minPartitions": "4"}, False, "cannot be combined"),
        ({"path": "/x", "topic": "a", "wholePartitions": "yes"}, False, "true or false"),
    ],
)
def test_bad_options_are_refused(options: dict[str, str], streaming: bool, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SourceOptions.parse(options, streaming=streaming)
