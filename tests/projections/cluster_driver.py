"""A Spark driver for the standalone-cluster test, run as its own process (one SparkContext
per process: the test session already has a local one).

Usage: ``python cluster_driver.py MASTER_URL LOG_DIR TOPIC REPO_ROOT``. Prints one JSON
object: the master, the rows read (as the test compares them), and the working
directories of the Python workers that read them (under the Spark worker's work dir
when the read really ran on the cluster's executor).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from pyspark.sql import SparkSession

sys.path.insert(0, str(Path(__file__).parent))
from projections_util import source, spark_rows

from projections.datasource import register


def _worker_dirs(rows: Iterable[object]) -> Iterator[str]:
    yield os.getcwd()


def main(master: str, log_dir: str, topic: str, repo_root: str) -> None:
    spark = (
        SparkSession.builder.master(master)
        .appName("tideline-cluster-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.memory", "512m")
        .config("spark.executor.memory", "512m")
        .config("spark.cores.max", "1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.executorEnv.PYTHONPATH", repo_root)
        .getOrCreate()
    )
    try:
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        df = source(spark, Path(log_dir), topic)
        rows = spark_rows(df)
        dirs = sorted(set(df.rdd.mapPartitions(_worker_dirs).collect()))
        out = {
            "master": spark.sparkContext.master,
            "rows": [[r[0], r[1], r[2], r[3], _hex(r[4]), _hex(r[5]), r[7]] for r in rows],
            "worker_dirs": dirs,
        }
        print(json.dumps(out))
    finally:
        spark.stop()


def _hex(value: bytes | None) -> str | None:
    return None if value is None else value.hex()


if __name__ == "__main__":
    main(*sys.argv[1:5])
