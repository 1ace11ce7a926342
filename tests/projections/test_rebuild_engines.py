"""``tideline project rebuild --engine auto|live|spark``: the records of a view's topics counted from
the offsets, the engine chosen both ways (and said), the live rebuild equal to the Spark rebuild —
the view, its states, checkpoints and run — for every kind of view, a follow job continuing from it
exactly once, and the swap keeping the table's own constraint and index names.

The views are the tests' own small application (tests/projections/userapp/), on tables of its own
with an alembic naming convention; its events are written straight into the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pyspark.sql import SparkSession
from userapp.views import VIEWS
from userapp_util import ACCOUNT_TOPIC, CDC_TOPIC, MIRROR, AppLog, bookkeeping, named_parts, user_database
from views_kafka_util import KafkaMirror

from projections import store
from projections.embedded_source import EmbeddedSource
from projections.follow import follow
from projections.kafka_source import KafkaSource
from projections.live import follow_live
from projections.live_rebuild import DEFAULT_LIVE_MAX_RECORDS, RebuildEngine, choose_engine, rebuild_live
from projections.rebuild import rebuild
from projections.reference import expected_rows, view_rows
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres

HERE = Path(__file__).parent
TIDELINE = str(Path(sys.executable).with_name("tideline"))
VIEW_NAMES = ["ua_accounts", "ua_deposits", "ua_snapshots", MIRROR]  # a fold on its own table, a count, a fold on
# the shared snapshots table, a mirror
NAMES = [  # what the app's migration named (userapp.views.DDL): a rebuild keeps them
    ("constraint c", "ck_ua_accounts_balance_nonnegative"),
    ("constraint p", "pk_ua_accounts"),
    ("constraint u", "uq_ua_accounts_handle"),
    ("index", "ix_ua_accounts_owner"),
    ("index", "pk_ua_accounts"),
    ("index", "uq_ua_accounts_handle"),
]


@pytest.fixture
def app_log(tmp_path: Path) -> AppLog:
    log = AppLog(tmp_path / "log")
    log.write(events=600, changes=90)
    return log


def test_records_are_counted_from_offsets_and_auto_chooses_both_ways(tmp_path: Path) -> None:
    log = AppLog(tmp_path / "log")
    view = VIEWS["ua_accounts"]
    with EmbeddedSource(tmp_path / "log", create=True) as source:
        assert source.record_count(view.topics) == 0  # no topic yet: nothing to read
        empty = choose_engine(RebuildEngine.AUTO, source, view, 0)
        assert empty.engine is RebuildEngine.LIVE and empty.records == 0
    log.write(events=40, changes=12)
    with EmbeddedSource(tmp_path / "log") as source:
        assert source.record_count([ACCOUNT_TOPIC]) == 40 and source.record_count([CDC_TOPIC]) == log.records - 40
        assert sum(len(per) for per in source.start_offsets([ACCOUNT_TOPIC]).values()) == 2
        live = choose_engine(RebuildEngine.AUTO, source, view, 40)
        assert live.engine is RebuildEngine.LIVE and live.records == 40
        assert live.reason == f"40 records in {ACCOUNT_TOPIC} ≤ 40 (--live-max-records)"
        spark = choose_engine(RebuildEngine.AUTO, source, view, 39)
        assert spark.engine is RebuildEngine.SPARK and spark.records == 40
        assert spark.reason == f"40 records in {ACCOUNT_TOPIC} > 39 (--live-max-records)"
        assert choose_engine(RebuildEngine.AUTO, source, view, master="local[1]").engine is RebuildEngine.SPARK
        assert choose_engine(RebuildEngine.SPARK, source, view, 10**9).engine is RebuildEngine.SPARK
        assert choose_engine(RebuildEngine.LIVE, source, view, 0).engine is RebuildEngine.LIVE
    assert RebuildEngine.parse(" Live ") is RebuildEngine.LIVE
    from tideline.project_cli import LIVE_MAX_RECORDS  # the CLI's default, kept there for start-up time

    assert LIVE_MAX_RECORDS == DEFAULT_LIVE_MAX_RECORDS


def test_live_rebuild_equals_spark_rebuild(spark: SparkSession, postgres: LocalPostgres, app_log: AppLog) -> None:
    """Every kind of view (folds on their own and on a shared table, count, mirror), rebuilt from the same log by each
    engine into a database of its own: the same rows (= the reference fold), the same states,
    checkpoints and run record; a second rebuild (over stored states) changes nothing."""
    spark_db, live_db = user_database(postgres, "spark"), user_database(postgres, "live")
    for name in VIEW_NAMES:
        view = VIEWS[name]
        by_spark = rebuild(spark, VIEWS, name, log_dir=app_log.path, dsn=spark_db)
        by_live = rebuild_live(VIEWS, name, log_dir=app_log.path, dsn=live_db)
        expected = expected_rows(view, app_log.path)
        assert expected, name
        assert view_rows(spark_db, view) == expected, name
        assert view_rows(live_db, view) == expected, name
        assert (by_live.events, by_live.rows, by_live.offsets) == (by_spark.events, by_spark.rows, by_spark.offsets)
        assert bookkeeping(live_db, name) == bookkeeping(spark_db, name), name
        again = rebuild_live(VIEWS, name, log_dir=app_log.path, dsn=live_db)
        assert (again.events, again.rows) == (by_live.events, by_live.rows)
        assert view_rows(live_db, view) == expected and bookkeeping(live_db, name) == bookkeeping(spark_db, name)
    for dsn in (spark_db, live_db):
        assert named_parts(dsn, "ua_accounts") == NAMES


def test_records_counted_and_rebuilt_live_on_kafka(kafka: LocalKafka, postgres: LocalPostgres, tmp_path: Path) -> None:
    """On Kafka the records are counted from ``ListOffsets`` too (a commit marker takes an offset: the
    count is an upper bound), and the live engine rebuilds every kind of view from Kafka's records."""
    log = AppLog(tmp_path / "log")
    log.write(events=500, changes=60)
    mirror = KafkaMirror(log.path, kafka.bootstrap_servers)
    try:
        mirror.copy([ACCOUNT_TOPIC, CDC_TOPIC])
    finally:
        mirror.close()
    db = user_database(postgres, "kafka")
    with KafkaSource(kafka.bootstrap_servers) as source:
        counted = source.record_count([ACCOUNT_TOPIC])
        assert 500 < counted <= 500 + 4  # 2 partitions, one commit marker per transaction of ≤ 400 records
        assert choose_engine(RebuildEngine.AUTO, source, VIEWS["ua_accounts"], counted).engine is RebuildEngine.LIVE
        over = choose_engine(RebuildEngine.AUTO, source, VIEWS["ua_accounts"], counted - 1)
        assert over.engine is RebuildEngine.SPARK and over.records == counted
        for name in VIEW_NAMES:
            result = rebuild_live(VIEWS, name, source=source, dsn=db)
            assert view_rows(db, VIEWS[name]) == expected_rows(VIEWS[name], log.path), name
            assert result.offsets == source.stable_offsets(VIEWS[name].topics)


def test_follow_continues_from_a_live_rebuild_exactly_once(postgres: LocalPostgres, app_log: AppLog) -> None:
    db = user_database(postgres, "follow")
    for name in VIEW_NAMES:
        rebuild_live(VIEWS, name, log_dir=app_log.path, dsn=db)
    before = app_log.records
    app_log.write(events=150, changes=30)
    for name in VIEW_NAMES:
        view = VIEWS[name]
        stats = follow_live(VIEWS, name, log_dir=app_log.path, dsn=db, once=True)
        new = 150 if name != MIRROR else app_log.records - before - 150  # the mirror reads the CDC topic
        assert stats.events == new, name  # only what came after the rebuild: nothing applied twice
        assert view_rows(db, view) == expected_rows(view, app_log.path), name
        with EmbeddedSource(app_log.path) as source:
            ends = source.stable_offsets(view.topics)
        with psycopg.connect(db) as conn:
            assert store.offsets_of(store.read_checkpoints(conn, name)) == ends


def test_spark_follow_continues_from_a_live_rebuild_exactly_once(
    spark: SparkSession, postgres: LocalPostgres, app_log: AppLog, tmp_path: Path
) -> None:
    db = user_database(postgres, "follow_spark")
    rebuild_live(VIEWS, "ua_accounts", log_dir=app_log.path, dsn=db)
    app_log.write(events=120)
    stats = follow(spark, VIEWS, "ua_accounts", log_dir=app_log.path, dsn=db, checkpoint_dir=tmp_path / "cp", once=True)
    assert stats.events == 120  # only what came after the rebuild
    assert view_rows(db, VIEWS["ua_accounts"]) == expected_rows(VIEWS["ua_accounts"], app_log.path)


def test_swap_keeps_the_tables_own_names(postgres: LocalPostgres) -> None:
    """A user's naming convention (and Postgres's defaults) survive the shadow and the swap: a primary
    key, a unique constraint, a check, an exclusion constraint, a plain, a partial and an expression
    index, and two indexes of one definition."""
    dsn = postgres.create_database("swap_names")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            """
            CREATE TABLE named (id int, handle text, owner text, n int, during int4range,
                CONSTRAINT pk_named PRIMARY KEY (id), CONSTRAINT uq_named_handle UNIQUE (handle),
                CONSTRAINT ck_named_n CHECK (n >= 0),
                CONSTRAINT ex_named_during EXCLUDE USING gist (during WITH &&));
            CREATE INDEX ix_named_owner ON named (owner);
            CREATE INDEX ix_named_owner_again ON named (owner);
            CREATE INDEX ix_named_big ON named (n) WHERE n > 100;
            CREATE UNIQUE INDEX ix_named_lower_handle ON named (lower(handle));
            CREATE TABLE plain (id int PRIMARY KEY, handle text UNIQUE, n int CHECK (n > 0));
            CREATE INDEX ON plain (n);
            """
        )
    for table in ("named", "plain"):
        before = named_parts(dsn, table)
        assert any(name.startswith("pk_") for _, name in before) == (table == "named")
        with psycopg.connect(dsn) as conn, conn.transaction():
            shadow = store.create_shadow(conn, table)
            conn.execute(f"INSERT INTO {shadow} (id, handle, n) VALUES (1, 'a', 5)")
            store.swap_in(conn, table, shadow)
        assert named_parts(dsn, table) == before, table
        with psycopg.connect(dsn) as conn:
            assert conn.execute(f"SELECT id, handle, n FROM {table}").fetchall() == [(1, "a", 5)]


@pytest.fixture
def cli_env() -> Iterator[dict[str, str]]:
    """The environment a ``tideline`` process of these tests runs in: the app importable (as a user's
    installed package would be), Spark's workers this interpreter."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(HERE)}
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    yield env


def cli_rebuild(log: AppLog, dsn: str, env: dict[str, str], *options: str) -> subprocess.CompletedProcess[str]:
    argv = [TIDELINE, "--data-dir", str(log.path), "project", "rebuild", "ua_accounts", "--dsn", dsn]
    argv += ["--views", "userapp.views", "--json", *options]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


def test_cli_rebuild_auto_says_which_engine_and_why(
    postgres: LocalPostgres, app_log: AppLog, cli_env: dict[str, str]
) -> None:
    """600 records: ``auto`` rebuilds live under the default threshold (no Spark: nothing of it on
    stderr), on Spark under ``--live-max-records 599``; both say so, on stderr and in the summary,
    whose ``seconds`` is the whole command's."""
    db = user_database(postgres, "cli")
    view = VIEWS["ua_accounts"]
    live = cli_rebuild(app_log, db, cli_env)
    assert live.returncode == 0, live.stderr[-3000:]
    summary = json.loads(live.stdout.strip().splitlines()[-1])
    reason = f"600 records in {ACCOUNT_TOPIC} ≤ {DEFAULT_LIVE_MAX_RECORDS:,} (--live-max-records)"
    assert summary["engine"] == "live" and summary["engine_reason"] == reason and summary["records_counted"] == 600
    assert f"engine: live ({reason})" in live.stderr
    assert "spark" not in live.stderr.lower().replace(f"engine: live ({reason})", ""), live.stderr
    assert summary["events"] == 600 and summary["rows"] == len(expected_rows(view, app_log.path))
    assert summary["seconds"] >= summary["rebuild_seconds"] > 0
    assert view_rows(db, view) == expected_rows(view, app_log.path)
    assert named_parts(db, "ua_accounts") == NAMES

    on_spark = cli_rebuild(app_log, db, cli_env, "--live-max-records", "599", "--spark-log-level", "WARN")
    assert on_spark.returncode == 0, on_spark.stderr[-3000:]
    summary = json.loads(on_spark.stdout.strip().splitlines()[-1])
    reason = f"600 records in {ACCOUNT_TOPIC} > 599 (--live-max-records)"
    assert summary["engine"] == "spark" and summary["engine_reason"] == reason
    assert f"engine: spark ({reason})" in on_spark.stderr
    assert summary["seconds"] >= summary["rebuild_seconds"] > 0
    assert view_rows(db, view) == expected_rows(view, app_log.path)
    assert named_parts(db, "ua_accounts") == NAMES

    wrong = cli_rebuild(app_log, db, cli_env, "--engine", "live", "--master", "local[1]")
    assert wrong.returncode == 1 and "--master is for the Spark engine" in wrong.stderr
    unknown = cli_rebuild(app_log, db, cli_env, "--engine", "flink")
    assert unknown.returncode == 1 and "unknown rebuild engine 'flink'" in unknown.stderr


def test_status_prints_whole_values_when_not_a_terminal(
    postgres: LocalPostgres, app_log: AppLog, cli_env: dict[str, str]
) -> None:
    """``project status`` piped, in an 80-column shell: every cell whole, none cut to fit."""
    db = user_database(postgres, "status")
    rebuild_live(VIEWS, MIRROR, log_dir=app_log.path, dsn=db)
    argv = [TIDELINE, "--data-dir", str(app_log.path), "project", "status", "--dsn", db]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**cli_env, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "…" not in done.stdout, done.stdout
    for whole in (MIRROR, f"{CDC_TOPIC}[0]", f"{CDC_TOPIC}[1]", "rebuild"):
        assert whole in done.stdout, done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) > 80  # wider than the terminal would be


def test_project_cli_imports_nothing_heavy() -> None:
    """``tideline.project_cli`` at import: stdlib, typer and the CLI's own plumbing only (Spark,
    projections, the database driver and rich's tables load when a command runs)."""
    probe = (
        "import sys, tideline.project_cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pyspark', 'projections', 'psycopg', 'pyarrow', 'pandas', 'eventstore') or m == 'rich.table'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout
