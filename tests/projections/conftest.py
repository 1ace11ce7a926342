"""One local SparkSession for every projections test (start-up costs 10–17 s), stopped at the end.

It has Spark's own Kafka source on ``spark.jars`` when ``make jars`` fetched it (the
projections-from-Kafka tests need it; without it they fail saying to run ``make jars``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from projections.datasource import register
from projections.spark_kafka import connector_dir, spark_jars_setting


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """``local[2]`` with small memory, no UI, UTC; the tideline source registered."""
    os.environ["PYSPARK_PYTHON"] = sys.executable  # Python workers get this venv (and the repo)
    builder = SparkSession.builder
    if connector_dir().is_dir():
        builder = builder.config("spark.jars", spark_jars_setting())
    session = (
        builder.master("local[2]")
        .appName("tideline-projections-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "1g")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    try:
        yield session
    finally:
        session.stop()
