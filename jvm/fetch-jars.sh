#!/usr/bin/env bash
# Fill the jar cache from Maven Central, once: `make jars` runs this.
#
#   jvm/fetch-jars.sh CACHE_DIR PYTHON
#
# CACHE_DIR/kafka/             Apache Kafka's broker (jvm/kafka-server/pom.xml) for tideline/kafkaharness.py
# CACHE_DIR/spark-sql-kafka-V/ Spark's Kafka source of exactly the installed PySpark's version V
#                              (jvm/spark-kafka/pom.xml), for spark.jars (projections/spark_kafka.py)
# CACHE_DIR/debezium/          Kafka Connect (standalone worker, JSON converter) and Debezium's PostgreSQL
#                              connector (jvm/debezium/pom.xml), for tideline/connectharness.py: the
#                              envelope comparison test and `python -m bench debezium`
#
# Each directory is complete iff it holds COMPLETE, whose one line is the version
# it was fetched for; a directory for another version is fetched again. A fetch
# goes to DIR.tmp and is renamed into place, so an interrupted run leaves nothing
# half-done behind. Nothing here runs at test time: the harness only reads.
set -euo pipefail

mkdir -p "${1:?usage: fetch-jars.sh CACHE_DIR PYTHON}"
cache=$(cd "$1" && pwd)  # absolute: mvn resolves a relative outputDirectory against the pom
python=${2:?usage: fetch-jars.sh CACHE_DIR PYTHON}
here=$(cd "$(dirname "$0")" && pwd)
mvn_flags=(-q -B -Dstyle.color=never)

pom_property() {  # pom_property POM NAME -> the value of <NAME>…</NAME>
    sed -n "s:.*<$2>\(.*\)</$2>.*:\1:p" "$1" | head -n 1
}

# fetch NAME VERSION POM [extra mvn args…]: copy POM's runtime dependencies into CACHE_DIR/NAME
fetch() {
    local name=$1 version=$2 pom=$3
    shift 3
    local target="$cache/$name"
    if [[ -f "$target/COMPLETE" && "$(cat "$target/COMPLETE")" == "$version" ]]; then
        return 0
    fi
    echo "fetching $name $version into $target (mvn dependency:copy-dependencies)"
    rm -rf "$target.tmp"
    mkdir -p "$target.tmp"
    if ! mvn "${mvn_flags[@]}" -f "$pom" "$@" dependency:copy-dependencies \
            -DincludeScope=runtime -DoutputDirectory="$target.tmp" >"$cache/$name.mvn.log" 2>&1; then
        rm -rf "$target.tmp"
        return 1
    fi
    rm -f "$cache/$name.mvn.log"
    echo "$version" >"$target.tmp/COMPLETE"
    rm -rf "$target"
    mv "$target.tmp" "$target"
}

kafka_version=$(pom_property "$here/kafka-server/pom.xml" kafka.version)
if ! fetch kafka "$kafka_version" "$here/kafka-server/pom.xml"; then
    echo "error: could not fetch Apache Kafka $kafka_version from Maven Central: see $cache/kafka.mvn.log" >&2
    exit 1
fi

spark_version=$("$python" -c 'import pyspark; print(pyspark.__version__)')
if ! fetch "spark-sql-kafka-$spark_version" "$spark_version" "$here/spark-kafka/pom.xml" -Dspark.version="$spark_version"; then
    # Fatal: projections read Kafka with this connector, and only the one of Spark's exact version works.
    echo "error: org.apache.spark:spark-sql-kafka-0-10_2.13:$spark_version (the installed PySpark's version)" \
         "could not be fetched from Maven Central (see $cache/spark-sql-kafka-$spark_version.mvn.log):" \
         "pin pyspark in pyproject.toml to a version whose connector Maven Central has, then run make venv jars" >&2
    exit 1
fi

debezium_version=$(pom_property "$here/debezium/pom.xml" debezium.version)
connect_version=$(pom_property "$here/debezium/pom.xml" connect.version)
if ! fetch debezium "$debezium_version/$connect_version" "$here/debezium/pom.xml"; then
    # Fatal, like the two above: `make test` runs tests/capture/test_debezium_envelope.py, which needs
    # these jars (a test that silently skipped without them would stop comparing anything).
    echo "error: could not fetch Debezium $debezium_version / Kafka Connect $connect_version from Maven Central:" \
         "see $cache/debezium.mvn.log" >&2
    exit 1
fi
