"""Killing ``tideline project follow`` (SIGKILL) at random points, and the oracle a view is held
to after each kill: exactly the records below its stored checkpoints (all of a batch or none).
Shared by the embedded-log and the Kafka crash tests; ``log`` is the embedded log's directory or
a :class:`~projections.sources.LogSource`."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psycopg
from readiness import wait_until

from projections import store
from projections.reference import expected_rows, records, view_rows
from projections.sources import LogSource, as_source
from projections.views import FoldView, Row, StoredEvent, Stream, View, columns_of, key_columns

TIDELINE = str(Path(sys.executable).parent / "tideline")
ENGINE_ARGS = {  # small batches: many commits for the kills to fall between and inside
    "spark": [
        "--engine",
        "spark",
        "--master",
        "local[1]",
        "--max-records-per-trigger",
        "15",
        "--trigger-seconds",
        "0.1",
    ],
    "live": ["--engine", "live", "--max-records-per-batch", "1"],
}
KILL_DELAY_S = {"spark": 1.0, "live": 0.25}  # after the first committed batch: at most this much later
Log = Path | LogSource


def batches(dsn: str, projection: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT batches FROM projection_runs WHERE projection = %s", (projection,)).fetchone()
    return int(row[0]) if row else 0


def checkpoints(dsn: str, projection: str) -> store.Offsets:
    with psycopg.connect(dsn) as c:
        return store.offsets_of(store.read_checkpoints(c, projection))


def log_end_offsets(log: Log, topics: tuple[str, ...]) -> store.Offsets:
    """The last stable offsets of ``topics``: where a follow job that caught up has its checkpoints."""
    source = as_source(log)
    try:
        return source.stable_offsets(topics)
    finally:
        if source is not log:
            source.close()


def start_follow(
    log_args: list[str], dsn: str, view: str, checkpoint_dir: Path, stderr: Path, engine: str = "spark"
) -> subprocess.Popen[bytes]:
    """``tideline LOG_ARGS project follow VIEW`` in a process group of its own; ``log_args``:
    ``["--data-dir", DIR]`` or ``["--kafka", BOOTSTRAP]``."""
    argv = [TIDELINE, *log_args, "project", "follow", view, "--dsn", dsn,
            *ENGINE_ARGS[engine], "--checkpoint-dir", str(checkpoint_dir)]  # fmt: skip
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    with stderr.open("ab") as err:  # a file, not a pipe: Spark's start-up logging would fill a pipe and block
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the follow job and the JVM it started (its own process group, by the child's PID)."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def kill_repeatedly(
    log: Log,
    log_args: list[str],
    dsn: str,
    view: View,
    engine: str,
    *,
    kills: int,
    rng: random.Random,
    checkpoint_dir: Path,
    stderr: Path,
    max_delay: float | None = None,
) -> int:
    """Start the follow job ``kills`` times, each killed (SIGKILL) at a random point up to ``max_delay``
    seconds (default :data:`KILL_DELAY_S`) after its first committed batch; after every kill the view
    must hold exactly the records below its checkpoints. Returns how many kills landed before the job
    had caught up."""
    kills_mid_run = 0
    log_end = log_end_offsets(log, view.topics)
    for _ in range(kills):
        before = checkpoints(dsn, view.name)
        process = start_follow(log_args, dsn, view.name, checkpoint_dir, stderr, engine)
        try:
            # The moment counts from a committed batch (or nothing left to do): a loaded machine starts the
            # job (a JVM for Spark) slowly. A job that exits first is judged by its exit status below.
            def started(process: subprocess.Popen[bytes] = process, before: store.Offsets = before) -> bool:
                if process.poll() is not None:
                    return True
                now = checkpoints(dsn, view.name)
                return now != before or now == log_end  # a batch committed (or nothing is left to do)

            wait_until(started, "the follow job's first committed batch", timeout=180,
                       details=lambda: stderr.read_text(errors="replace")[-2000:])  # fmt: skip
            time.sleep(rng.uniform(0, KILL_DELAY_S[engine] if max_delay is None else max_delay))
            finished = process.poll() is not None
        finally:
            if process.poll() is None:
                kill_group(process)
        assert process.returncode in (0, -signal.SIGKILL), stderr.read_text()[-2000:]
        applied = checkpoints(dsn, view.name)
        kills_mid_run += not finished and applied != log_end
        assert_view_at_cut(dsn, view, log, applied)
    return kills_mid_run


def assert_view_at_cut(dsn: str, view: View, log: Log, applied: store.Offsets) -> None:
    """The view holds exactly the records below its checkpoints ``applied`` (all of a batch or none).

    Most views have one answer at a cut: the reference of the records below it. A fold view
    whose rows of one key can come from several streams (``seats``: a seat held by one
    reservation after another, the streams spread over partitions) has no single answer at a
    cut that falls at different points of different partitions: a key taken over by a row with
    a larger ``commit_lsn`` (a later holder, read early from a partition that is ahead) is
    empty again once that holder moves on, even if an earlier holder, in a partition that is
    behind, still has it below the cut. So for those, exactly: every stream's applied version
    (``projection_state``) is the reference's at the cut; every row of the view is a row some
    stream holds at the cut; and a key shows the holder with the largest ``commit_lsn`` unless
    a row with a larger one held it at some version below the cut and has moved on since.
    """
    rows = view_rows(dsn, view)
    if not isinstance(view, FoldView) or view.snapshots or "commit_lsn" not in columns_of(view):
        assert rows == expected_rows(view, log, applied), f"after a kill at {applied}"
        return
    versions, current, history = fold_at_cut(view, log, applied)
    with psycopg.connect(dsn) as conn:
        query = "SELECT stream_id, version FROM projection_state WHERE projection = %s"
        stored: dict[str, int] = dict(conn.execute(query, (view.name,)).fetchall())
    assert stored == versions, f"after a kill at {applied}: streams applied other than once"
    columns = columns_of(view)
    keys, lsn = [columns.index(c) for c in key_columns(view.table)], columns.index("commit_lsn")
    assert not set(rows) - set(current), f"after a kill at {applied}: rows no stream holds at the cut"
    shown = {tuple(r[i] for i in keys): r for r in rows}
    winners: dict[tuple[object, ...], Row] = {}
    for r in current:
        k = tuple(r[i] for i in keys)
        if k not in winners or winners[k][lsn] < r[lsn]:
            winners[k] = r
    for k, winner in winners.items():
        if shown.get(k) != winner:
            moved_on = [h for h in history if tuple(h[i] for i in keys) == k and h[lsn] > winner[lsn]]
            assert moved_on, f"after a kill at {applied}: {k} shows {shown.get(k)}, not {winner}"


def fold_at_cut(view: FoldView, log: Log, until: store.Offsets) -> tuple[dict[str, int], set[Row], set[Row]]:
    """Per stream its version below the cut; the rows the streams hold there; every row any of them
    held at any version below it."""
    streams: dict[str, list[StoredEvent]] = defaultdict(list)
    for _, _, (_, value) in records(log, view.topics, until):
        if value is not None:
            e = StoredEvent.from_value(value)
            streams[e.stream_id].append(e)
    versions: dict[str, int] = {}
    current: set[Row] = set()
    history: set[Row] = set()
    for sid, events in streams.items():
        events.sort(key=lambda e: e.version)
        aggregate, state = view.aggregate(events[0].stream_type), None
        rows: list[Row] = []
        for e in events:
            state = view.fold(e.stream_type, [e], state)
            rows = [tuple(r) for r in view.rows(Stream(aggregate, sid, e.version, e.commit_lsn, state))]
            history.update(rows)
        versions[sid] = events[-1].version
        current.update(rows)
    return versions, current, history
