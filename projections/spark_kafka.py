"""Spark's own Kafka source (``spark-sql-kafka-0-10``) for projections over Kafka: its jars.

The connector is not in the pyspark wheel and must be of *exactly* the installed Spark's
version (it uses Spark's internal APIs). ``make jars`` (``jvm/fetch-jars.sh``) fetches it
and the runtime dependencies the wheel lacks (``kafka-clients``, ``commons-pool2``,
``spark-token-provider-kafka-0-10``) from Maven Central into
``.cache/jars/spark-sql-kafka-<V>/`` (``$TIDELINE_JAR_CACHE`` instead of ``.cache/jars``);
a session that reads Kafka gets them on ``spark.jars`` (which also ships them to a
cluster's executors). Nothing is downloaded at run time.

Why PySpark is pinned (pyproject.toml): PyPI had 4.3.0 and 4.2.1 while Maven Central's
newest connector was 4.2.0, so the pin is the newest Spark whose connector exists.
"""

from __future__ import annotations

import os
from pathlib import Path

from eventstore.errors import ConfigError

JAR_CACHE_ENV = "TIDELINE_JAR_CACHE"  # the same cache directory tideline.kafkaharness reads Kafka's broker from
DEFAULT_JAR_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "jars"
COMPLETE_MARKER = "COMPLETE"  # written last by jvm/fetch-jars.sh: its line is the version fetched
CONNECTOR_ARTIFACT = "org.apache.spark:spark-sql-kafka-0-10_2.13"


def spark_version() -> str:
    import pyspark

    return str(pyspark.__version__)


def connector_dir(version: str | None = None) -> Path:
    """Where ``make jars`` puts the connector of ``version`` (default: the installed PySpark's)."""
    env = os.environ.get(JAR_CACHE_ENV)
    return (Path(env) if env else DEFAULT_JAR_CACHE) / f"spark-sql-kafka-{version or spark_version()}"


def connector_jars(version: str | None = None) -> list[Path]:
    """The jars for ``spark.jars``; a one-line ConfigError saying what to run when they are missing."""
    version = version or spark_version()
    directory = connector_dir(version)
    marker = directory / COMPLETE_MARKER
    if not marker.is_file() or marker.read_text().strip() != version:
        raise ConfigError(
            f"Spark's Kafka source ({CONNECTOR_ARTIFACT}:{version}, the installed PySpark's version) is not in "
            f"{directory}: run `make jars`"
        )
    jars = sorted(directory.glob("*.jar"))
    if not any(j.name.startswith("spark-sql-kafka-0-10") for j in jars):
        raise ConfigError(f"{directory} holds no spark-sql-kafka-0-10 jar: remove it and run `make jars`")
    return jars


def spark_jars_setting(version: str | None = None) -> str:
    """The value of ``spark.jars`` that puts the connector on a session's class path."""
    return ",".join(str(j) for j in connector_jars(version))
