"""The connector position record (schemas.position): versions, the incremental snapshot's progress, bad records."""

from __future__ import annotations

import orjson
import pytest

from schemas.position import POSITION_VERSION, IncrementalProgress, SourcePosition


def test_a_version_1_record_reads_as_a_position_without_incremental_snapshot() -> None:
    raw = b'{"commit_lsn": 100, "event_index": 3, "complete": false, "confirm_lsn": 90, "snapshot_done": true}'
    position = SourcePosition.from_json(raw)
    assert position == SourcePosition(100, 3, False, 90, True, None)
    assert orjson.loads(position.to_json())["version"] == POSITION_VERSION == 2


def test_progress_round_trips_with_the_position() -> None:
    progress = IncrementalProgress(
        "sig-1", ("public.a", "s.b"), ("7", None, "o'brien"), {"public.a": "v < 5"}, 50, True, 120, 70, 200, 1, 1234
    )
    position = SourcePosition(200, -1, True, 210, True, progress)
    again = SourcePosition.from_json(position.to_json())
    assert again == position and again.incremental == progress
    assert "incremental" not in orjson.loads(SourcePosition(1, 0, True, 2).to_json())  # none: no field


def test_the_run_that_stored_a_position_round_trips_and_is_absent_when_unknown() -> None:
    position = SourcePosition(300, 2, True, 310, True, None, "3f2a9c01d4e5b6a7")
    assert SourcePosition.from_json(position.to_json()) == position
    assert orjson.loads(position.to_json())["run"] == "3f2a9c01d4e5b6a7"
    assert "run" not in orjson.loads(SourcePosition(1, 0, True, 2).to_json())
    assert SourcePosition.from_json(SourcePosition(1, 0, True, 2).to_json()).run is None


def test_percent_counts_tables_done_and_the_current_tables_rows() -> None:
    p = IncrementalProgress("x", ("a", "b"), table_rows=50, table_estimate=100, tables_done=2)
    assert p.percent == 62.5  # (2 done + 0.5 of a) of 4 tables
    assert IncrementalProgress("x", ("a",), table_rows=500, table_estimate=100).percent == 99.0  # never 100 early


def test_a_newer_version_is_refused_naming_both() -> None:
    raw = orjson.dumps({"version": 3, "commit_lsn": 1, "event_index": 0, "complete": True, "confirm_lsn": 1})
    with pytest.raises(ValueError, match="version 3 is newer than this Tideline reads \\(2\\)"):
        SourcePosition.from_json(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'{"commit_lsn": 1, "event_index": 0, "complete": true, "confirm_lsn": 1, "incremental": {"tables": []}}',
        b'{"commit_lsn": 1, "event_index": 0, "complete": true, "confirm_lsn": 1, '
        b'"incremental": {"id": "x", "tables": [], "filters": [1]}}',
    ],
)
def test_malformed_records_name_what_is_wrong(raw: bytes) -> None:
    with pytest.raises(ValueError, match="not a connector position record"):
        SourcePosition.from_json(raw)
