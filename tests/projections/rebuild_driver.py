"""A Spark driver for the task-retry and speculation tests, run as its own process: retries
need ``spark.task.maxFailures`` > 1 and speculation needs its settings when the
SparkContext starts (the test session already has a plain local one).

Usage: ``python rebuild_driver.py MASTER LOG_DIR DSN FAULT VIEW…`` — FAULT is a value of
:data:`projections.attempts.FAULT_PROPERTY` (``fail:0``, ``straggle:20:0``). Rebuilds each
view with the fault injected into its jobs and prints one JSON object per view: its name,
the rows after the rebuild, the tasks of the view's jobs and how many attempts failed, and
the staged rows the rebuild discarded as written by attempts Spark did not keep (proof
that a second attempt really wrote).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from examples.reservations.views import VIEWS
from projections.attempts import FAULT_PROPERTY
from projections.datasource import register
from projections.rebuild import rebuild


def session(master: str) -> SparkSession:
    builder = (
        SparkSession.builder.master(master)
        .appName("tideline-rebuild-attempts-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.memory", "512m")
        .config("spark.executor.memory", "512m")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.adaptive.coalescePartitions.enabled", "false")  # two write tasks, not one
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.executorEnv.PYTHONPATH", str(Path(__file__).resolve().parents[2]))
        .config("spark.task.maxFailures", "4")  # a cluster's retries (local mode: local[N,maxFailures])
        # speculation (takes effect on a cluster with two hosts: a copy never runs where the task runs)
        .config("spark.speculation", "true")
        .config("spark.speculation.interval", "100ms")
        .config("spark.speculation.quantile", "0.5")
        .config("spark.speculation.multiplier", "1.5")
        .config("spark.speculation.minTaskRuntime", "100ms")
    )
    return builder.getOrCreate()


def main(master: str, log_dir: str, dsn: str, fault: str, *views: str) -> None:
    spark = session(master)
    try:
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        context = spark.sparkContext
        context.setLocalProperty(FAULT_PROPERTY, fault)
        tracker = context.statusTracker()
        for name in views:
            context.setJobGroup(name, f"rebuild {name}")
            result = rebuild(spark, VIEWS, name, log_dir=Path(log_dir), dsn=dsn)
            stages = [s for j in tracker.getJobIdsForGroup(name) for s in (tracker.getJobInfo(j) or ()).stageIds]
            infos = [tracker.getStageInfo(s) for s in stages]
            tasks = sum(i.numTasks for i in infos if i is not None)
            failed = sum(i.numFailedTasks for i in infos if i is not None)
            out = {"view": name, "events": result.events, "rows": result.rows, "discarded": result.discarded}
            out |= {"tasks": tasks, "failed": failed}
            print(json.dumps(out), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:5], *sys.argv[5:])
