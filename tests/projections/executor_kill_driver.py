"""A Spark driver for the executor-kill tests (test_executor_kill.py), run as its own process
against a standalone cluster: the test SIGKILLs the cluster's executor while a job of this
driver runs, and Spark must relaunch an executor and re-run the lost tasks.

Usage:

- ``python executor_kill_driver.py MASTER LOG_DIR DSN rebuild FLAG_DIR VIEW…`` — rebuilds
  each view (the Nth: token ``FLAG_DIR/token-N``, created here) with the first attempt of
  partition 0 of its write job holding right after it committed its staged rows
  (:data:`projections.attempts.FAULT_PROPERTY` ``hold``) until the test removes
  ``token-N.held``: the window in which the test kills the executor. One JSON line per
  view: events, rows, staged rows discarded (written by attempts Spark did not keep), tasks
  and failed task attempts of the view's jobs.
- ``python executor_kill_driver.py MASTER LOG_DIR DSN follow FLAG_DIR CHECKPOINT_DIR
  MAX_RECORDS KILLS VIEW…`` — follows each view until caught up (``once``), at most
  MAX_RECORDS records per micro-batch, the batches' read tasks passing through
  :func:`stalling`: before each view, KILLS tokens are put in FLAG_DIR; a read task's first
  attempt past its partition's first batch takes one, holds its records (read) and shows
  ``FLAG_DIR/stalled-…``: the test kills the executor then, in the middle of a batch, and
  removes that file. One JSON line per view: batches, events, and the failed task attempts
  and removed executors of the whole application so far (Spark's REST API).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from examples.reservations.views import VIEWS
from projections.attempts import FAULT_PROPERTY
from projections.datasource import register
from projections.embedded_source import EmbeddedSource
from projections.follow import follow
from projections.rebuild import rebuild
from projections.store import Offsets

REPO_ROOT = Path(__file__).resolve().parents[2]


def session(master: str) -> SparkSession:
    builder = (
        SparkSession.builder.master(master)
        .appName("tideline-executor-kill-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.memory", "512m")
        .config("spark.executor.memory", "512m")
        .config("spark.ui.port", "0")  # the REST API on a free port (sparkContext.uiWebUrl)
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.adaptive.coalescePartitions.enabled", "false")  # two write tasks, not one
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.executorEnv.PYTHONPATH", str(REPO_ROOT))
        # a lost executor's tasks count as failed attempts of their tasks: room for the retries
        .config("spark.task.maxFailures", "8")
        .config("spark.stage.maxConsecutiveAttempts", "8")  # a lost executor's shuffle output re-run
        .config("spark.speculation", "false")
    )
    return builder.getOrCreate()


def rest(spark: SparkSession, path: str) -> Any:
    context = spark.sparkContext
    url = f"{context.uiWebUrl}/api/v1/applications/{context.applicationId}/{path}"
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def app_figures(spark: SparkSession) -> dict[str, int]:
    """Failed task attempts of every stage, and the executors removed, so far."""
    stages = rest(spark, "stages")
    removed = [e for e in rest(spark, "allexecutors") if e["id"] != "driver" and not e["isActive"]]
    return {"failed": sum(int(s["numFailedTasks"]) for s in stages), "executors_lost": len(removed)}


def group_figures(spark: SparkSession, group: str) -> dict[str, int]:
    """Tasks and failed task attempts of the jobs of job group ``group``, every stage attempt
    counted (the status tracker shows a stage's last attempt only)."""
    ids = {s for j in rest(spark, "jobs") if j.get("jobGroup") == group for s in j["stageIds"]}
    stages = [s for s in rest(spark, "stages") if s["stageId"] in ids]
    return {"tasks": sum(int(s["numTasks"]) for s in stages), "failed": sum(int(s["numFailedTasks"]) for s in stages)}


def run_rebuilds(spark: SparkSession, log_dir: Path, dsn: str, flag_dir: str, views: Iterable[str]) -> None:
    context = spark.sparkContext
    for n, name in enumerate(views):
        token = Path(flag_dir) / f"token-{n}"
        token.touch()
        context.setLocalProperty(FAULT_PROPERTY, f"hold:{token}:0")
        context.setJobGroup(name, f"rebuild {name}")
        result = rebuild(spark, VIEWS, name, log_dir=log_dir, dsn=dsn)
        out = {"view": name, "events": result.events, "rows": result.rows, "discarded": result.discarded}
        print(json.dumps(out | group_figures(spark, name)), flush=True)


def stalling(flag_dir: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` pass-through: the first attempt of a task that read records past its
    partition's first batch (something of that partition is committed) takes a token
    ``FLAG_DIR/token-*`` if one is left — renaming it to ``FLAG_DIR/stalled-<pid>-<attempt>``
    — and holds its records until that file is removed."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.compute as pc
        from pyspark import TaskContext

        held = list(batches)  # the task's records, read
        context = TaskContext.get()
        first = min((pc.min(b.column("offset")).as_py() for b in held if b.num_rows), default=0)
        if context is None or context.attemptNumber() != 0 or first <= 0:
            yield from held
            return
        for token in sorted(Path(flag_dir).glob("token-*")):
            stalled = Path(flag_dir) / f"stalled-{os.getpid()}-{context.taskAttemptId()}"
            try:
                token.rename(stalled)  # one task gets each token
            except FileNotFoundError:
                continue
            deadline = time.monotonic() + 300  # a safety net only: the test removes the file
            while stalled.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            break
        yield from held

    return run


class StallingSource(EmbeddedSource):
    """The embedded log, its streaming reads passed through :func:`stalling`."""

    def __init__(self, log_dir: Path, flag_dir: str) -> None:
        super().__init__(log_dir)
        self.flag_dir = flag_dir

    def stream_frame(
        self, spark: SparkSession, topics: Iterable[str], starting: Offsets, max_records: int | None
    ) -> DataFrame:
        frame = super().stream_frame(spark, topics, starting, max_records)
        return frame.mapInArrow(stalling(self.flag_dir), frame.schema)


def run_follows(
    spark: SparkSession,
    log_dir: Path,
    dsn: str,
    flag_dir: str,
    checkpoints: str,
    max_records: str,
    kills: str,
    views: list[str],
) -> None:
    for n, name in enumerate(views):
        for i in range(int(kills)):  # this view's stalls: the test kills the executor under each
            (Path(flag_dir) / f"token-{n:03}-{i:03}").touch()
        source = StallingSource(log_dir, flag_dir)
        try:
            stats = follow(
                spark,
                VIEWS,
                name,
                dsn=dsn,
                source=source,
                checkpoint_dir=Path(checkpoints),
                once=True,
                max_records_per_trigger=int(max_records),
                trigger_seconds=0.1,
            )
        finally:
            source.close()
        out = {"view": name, "batches": stats.batches, "events": stats.events, **app_figures(spark)}
        print(json.dumps(out), flush=True)


def main(master: str, log_dir: str, dsn: str, mode: str, *rest_args: str) -> None:
    spark = session(master)
    try:
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        if mode == "rebuild":
            run_rebuilds(spark, Path(log_dir), dsn, rest_args[0], rest_args[1:])
        elif mode == "follow":
            run_follows(spark, Path(log_dir), dsn, *rest_args[:4], list(rest_args[4:]))
        else:
            raise SystemExit(f"mode must be rebuild or follow, not {mode!r}")
    finally:
        spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
