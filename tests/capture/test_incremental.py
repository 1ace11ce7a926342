"""Incremental snapshots while streaming (capture.incremental, capture.signals) against a real Postgres.

A concurrent workload updates, deletes, re-keys and inserts rows of the snapshotted
tables while they are read chunk by chunk. Every write sets ``ver`` from one sequence, so
each key's history is a strictly increasing run of versions, and the log must tell it in
that order (:func:`follows`): a delete removes exactly the latest version logged (else an
update was lost or an ``r`` was stale), only an insert follows a delete (no ``r``
resurrecting a deleted row), and an ``r`` never carries a version older than one already
logged. At the end the
materialized topic (latest ``after`` per key) must equal ``SELECT *``.

Scenarios: the signal table path with a kill -9 of the connector process mid-snapshot and a
resume (both plugins); pause, resume and stop (signals through the CLI); ``--where``; a table
added to the include list of a connector that was already streaming (both plugins); commits
streamed before they are visible (the connector as its own synchronous standby).

Size: ``TIDELINE_SOAK=1`` reads ~10x more rows.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from capture_util import ConnectorThread, drop_slots, fresh_database, records, sql
from readiness import patience, wait_until
from sources import ON_BOTH_SERVERS
from typer.testing import CliRunner
from workload import soak

from capture.connector import CaptureConfig, Connector, SnapshotMode, Stats
from capture.incremental import ReadSnapshot
from capture.messages import ChangeMessage, Column, Kind, Plugin
from capture.signals import DEFAULT_SIGNAL_TABLE, SignalError, SignalType, send_signal, signal_from_insert
from capture.sinks.embedded import EmbeddedLogSink
from capture.tables import TableFilter
from eventstore.log import Log
from schemas.position import POSITIONS_TOPIC, SourcePosition, connector_key
from tideline.cli import app
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
ROWS = 30_000 if soak() else 3_000
CHUNK = 100
KILLED_CHUNK = 20  # the killed run's chunks: small, so that the kill lands well inside the snapshot
SLOT = "inc"

CHILD = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
from capture.connector import CaptureConfig, Connector, SnapshotMode
from capture.messages import Plugin
from capture.tables import TableFilter
from eventstore.log import Log
dsn, log_dir, plugin, chunk, snapshot = sys.argv[1:6]
config = CaptureConfig(dsn=dsn, slot="inc", topic_prefix="cdc", plugin=Plugin(plugin), status_interval_s=0.05,
                       snapshot=SnapshotMode(snapshot), signal_table="public.tideline_signal",
                       incremental_chunk_size=int(chunk), table_filter=TableFilter(include=["public.inc_*"]))
with Log(log_dir) as log:
    Connector(config, log).run()
"""

SCHEMA = [
    "CREATE SEQUENCE inc_ver",
    "CREATE TABLE inc_items (id bigint PRIMARY KEY, ver bigint NOT NULL DEFAULT nextval('inc_ver'), v integer, "
    "note text)",
    "CREATE TABLE inc_pairs (tenant text, seq integer, ver bigint NOT NULL DEFAULT nextval('inc_ver'), "
    "amount numeric, PRIMARY KEY (tenant, seq))",
    "ALTER TABLE inc_items REPLICA IDENTITY FULL",  # deletes carry the deleted version (the order check uses it)
    "ALTER TABLE inc_pairs REPLICA IDENTITY FULL",
]
TENANTS = ("acme", "o'brien", "ünï", "a,b")


@pytest.fixture
def db(server: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(server, "incremental")
    sql(dsn, *SCHEMA)
    yield dsn
    drop_slots(dsn)


def populate(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO inc_items (id, v, note) SELECT g, g %% 97, 'row ' || g FROM generate_series(1, %s) g",
                  (rows,))  # fmt: skip
        c.execute("INSERT INTO inc_pairs (tenant, seq, amount) SELECT (ARRAY['acme', 'o''brien', 'ünï', 'a,b'])"
                  "[1 + g %% 4], g, g * 1.5 FROM generate_series(1, %s) g", (rows // 2,))  # fmt: skip


class Churn:
    """Updates, deletes, key changes and inserts in small transactions, in a thread, until stopped."""

    def __init__(self, dsn: str, rows: int, seed: int) -> None:
        self.dsn, self.rows, self.rng = dsn, rows, random.Random(seed)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.transactions = 0
        self.thread = threading.Thread(target=self._run, name="churn", daemon=True)

    def __enter__(self) -> Churn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        assert not self.errors, self.errors

    def _run(self) -> None:
        try:
            with psycopg.connect(self.dsn) as c:
                while not self.stop.is_set():
                    for _ in range(self.rng.randint(1, 6)):
                        self._statement(c)
                    c.commit()
                    self.transactions += 1
                    time.sleep(self.rng.uniform(0, 0.004))
        except BaseException as e:
            self.errors.append(e)

    def _statement(self, c: psycopg.Connection[Any]) -> None:
        r = self.rng
        key = r.randint(1, self.rows + self.rows // 10)
        roll = r.random()
        if r.random() < 0.6:
            if roll < 0.5:
                c.execute("UPDATE inc_items SET v = %s, ver = nextval('inc_ver') WHERE id = %s",
                          (r.randint(0, 99), key))  # fmt: skip
            elif roll < 0.7:
                c.execute("DELETE FROM inc_items WHERE id = %s", (key,))
            elif roll < 0.8:  # a key change: delete of the old key, create of the new one
                c.execute("UPDATE inc_items SET id = id + %s, ver = nextval('inc_ver') WHERE id = %s "
                          "AND NOT EXISTS (SELECT 1 FROM inc_items WHERE id = %s)",
                          (self.rows, key, key + self.rows))  # fmt: skip
            else:
                c.execute("INSERT INTO inc_items (id, v, note) VALUES (%s, 1, 'new') ON CONFLICT DO NOTHING", (key,))
        else:
            tenant, seq = r.choice(TENANTS), key // 2
            if roll < 0.6:
                c.execute("UPDATE inc_pairs SET amount = %s, ver = nextval('inc_ver') WHERE tenant = %s AND seq = %s",
                          (r.randint(0, 10**6) / 100, tenant, seq))  # fmt: skip
            elif roll < 0.8:
                c.execute("DELETE FROM inc_pairs WHERE tenant = %s AND seq = %s", (tenant, seq))
            else:
                c.execute("INSERT INTO inc_pairs (tenant, seq, amount) VALUES (%s, %s, 0) ON CONFLICT DO NOTHING",
                          (tenant, seq))  # fmt: skip


def config(dsn: str, plugin: Plugin = Plugin.WAL2JSON, **kw: Any) -> CaptureConfig:
    kw.setdefault("table_filter", TableFilter(include=["public.inc_*"]))
    kw.setdefault("signal_table", DEFAULT_SIGNAL_TABLE)
    return CaptureConfig(dsn=dsn, slot=SLOT, topic_prefix="cdc", plugin=plugin, incremental_chunk_size=CHUNK, **kw)


def run_until_caught_up(log_dir: Path, cfg: CaptureConfig) -> Stats:
    """Stream until the WAL present at start is stored and no incremental snapshot is left."""
    cfg.exit_when_caught_up = True
    with Log(log_dir) as log:
        return Connector(cfg, log).run()


class Running(ConnectorThread):
    """A connector streaming in a thread until stopped (its stats readable meanwhile)."""

    def wait(self, what: str, cond: Callable[[Stats], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + patience(timeout)
        while not cond(self.connector.stats):
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.connector.stats.to_json()}"
            time.sleep(0.02)


def stored_position(log_dir: Path) -> SourcePosition | None:
    """The connector's stored position (read when no connector runs on the log)."""
    with Log(log_dir) as log:
        raw = EmbeddedLogSink(log).read_last(POSITIONS_TOPIC, 0, connector_key("cdc", SLOT))
    return None if raw is None else SourcePosition.from_json(raw)


def current_lsn(dsn: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()
        assert row is not None
        return int(row[0])


# ---------------------------------------------------------------------------- checks


def table_rows(dsn: str, table: str, key: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """key (JSON of the key columns, sorted) → row, as JSON-comparable values."""
    with psycopg.connect(dsn) as c:
        cur = c.execute(f"SELECT row_to_json(t)::text FROM {table} t".encode())
        out = {}
        for (text,) in cur.fetchall():
            row = json.loads(text)
            out[json.dumps({k: row[k] for k in key}, sort_keys=True)] = row
    return out


def follows(prev_op: str, prev_ver: int, op: str, ver: int) -> bool:
    """Whether an event may follow the key's previous one (versions from one sequence; d carries the deleted one).

    A delete removes exactly the latest version (else a change was lost, or an ``r`` was stale); after
    it only an insert may come (an ``r`` or ``u`` would resurrect the row); inserts and updates write
    new versions; an ``r`` re-reads the latest version or a newer one, never an older one."""
    if prev_op == "d":
        return op == "c" and ver > prev_ver
    if op == "d":
        return ver == prev_ver
    if op == "r":
        return ver >= prev_ver
    return op == "u" and ver > prev_ver


def assert_topic_equals_table(log_dir: Path, dsn: str, table: str, key: tuple[str, ...]) -> dict[str, int]:
    """Materialized topic == SELECT *, and every key's events respect its version history; returns op counts."""
    state: dict[str, dict[str, Any]] = {}
    last: dict[str, tuple[int, str]] = {}  # key → (version, op) of its previous event
    ops: dict[str, int] = {}
    for k, value, _ in records(log_dir, f"cdc.public.{table}"):
        key_text = json.dumps(k, sort_keys=True)
        if value is None:
            continue  # tombstone (after its delete)
        op = value["op"]
        ops[op] = ops.get(op, 0) + 1
        image = value["before"] if op == "d" else value["after"]
        ver = int(image["ver"])
        if key_text in last:
            prev_ver, prev_op = last[key_text]
            assert follows(prev_op, prev_ver, op, ver), (
                f"{table} key {key_text}: {op} of version {ver} after {prev_op} of version {prev_ver}"
            )
        last[key_text] = (ver, op)
        if op == "d":
            state.pop(key_text, None)
        else:
            state[key_text] = value["after"]
    expected = table_rows(dsn, table, key)
    normalize = {k: {c: (float(v) if c == "amount" and v is not None else v) for c, v in row.items()}
                 for k, row in state.items()}  # fmt: skip
    expected = {k: {c: (float(v) if c == "amount" and v is not None else v) for c, v in row.items()}
                for k, row in expected.items()}  # fmt: skip
    missing, extra = expected.keys() - normalize.keys(), normalize.keys() - expected.keys()
    assert not missing and not extra, f"{table}: only in the table {sorted(missing)[:5]}, only in the log " \
                                      f"{sorted(extra)[:5]}"  # fmt: skip
    wrong = [k for k in expected if expected[k] != normalize[k]]
    assert not wrong, f"{table}: {len(wrong)} rows differ, e.g. {wrong[0]}: {expected[wrong[0]]} vs " \
                      f"{normalize[wrong[0]]}"  # fmt: skip
    return ops


def execute_snapshot(dsn: str, *tables: str, **data: Any) -> str:
    return send_signal(dsn, DEFAULT_SIGNAL_TABLE, SignalType.EXECUTE_SNAPSHOT,
                       {"data-collections": list(tables), "type": "incremental", **data})  # fmt: skip


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


# ---------------------------------------------------------------------------- scenarios


@pytest.mark.parametrize("plugin", ON_BOTH_SERVERS, ids=str, indirect=True)
def test_killed_mid_snapshot_resumes_in_order(db: str, tmp_path: Path, plugin: Plugin) -> None:
    """Signal table → incremental snapshot of two tables under churn; kill -9 mid-snapshot; resume; compare."""
    log_dir = tmp_path / "log"
    populate(db, ROWS)
    # A slot created after the rows were written, no initial snapshot: the rows reach the log only
    # through the incremental snapshot (or as the churn changes them).
    run_until_caught_up(log_dir, config(db, plugin, snapshot=SnapshotMode.NEVER))
    with Churn(db, ROWS, seed=18) as churn:
        execute_snapshot(db, "public.inc_items", "public.inc_pairs")
        err = tmp_path / "child.stderr"
        with open(err, "wb") as stderr:
            argv = [sys.executable, "-c", CHILD, db, str(log_dir), plugin.value, str(KILLED_CHUNK), "never"]
            child = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=stderr)
        try:
            # The status line counts the rows of the open batch; the kill must land after a stored one (the
            # stored position is what a resume starts from), inside the first table, far from its end.
            wait_until(lambda: snapshot_rows_logged(err) >= ROWS // 4, "a quarter of the rows read by the "
                       "incremental snapshot", every=0.02, alive=child, details=lambda: err.read_text()[-3000:])
            wait_until(lambda: stored_snapshot_rows(log_dir) > 0, "a chunk of the incremental snapshot stored",
                       every=0.05, alive=child, details=lambda: err.read_text()[-3000:])  # fmt: skip
        finally:
            child.kill()  # SIGKILL, by PID
            child.wait()
        position = stored_position(log_dir)
        assert position is not None and position.incremental is not None, (
            f"the kill did not land inside the snapshot: {position}"
        )
        assert position.incremental.rows > 0 and position.incremental.last_key is not None, position
        # Progress is visible from the stored position.
        asked = time.time()
        status = json.loads(cli("--data-dir", str(log_dir), "capture", "status", "--dsn", db, "--slot", SLOT,
                                "--topic-prefix", "cdc", "--json"))  # fmt: skip
        answered = time.time()
        shown = status["incremental_snapshot"]
        assert shown["rows"] == position.incremental.rows and 0 < shown["percent"] < 100, shown
        started = position.incremental.started_ms / 1000  # the rate: rows over the time since the snapshot began
        rows = position.incremental.rows
        assert rows / (answered - started) - 0.1 <= shown["rows_per_s"] <= rows / (asked - started) + 0.1, shown
        # Resume (the churn goes on), then let it stop and catch up.
        with Running(log_dir, config(db, plugin, snapshot=SnapshotMode.NEVER)) as running:
            running.wait("the snapshot to finish", lambda s: s.incremental is None and s.snapshot_rows > 0)
    run_until_caught_up(log_dir, config(db, plugin, snapshot=SnapshotMode.NEVER))
    assert churn.transactions > 0
    assert stored_position(log_dir).incremental is None  # type: ignore[union-attr]
    items = assert_topic_equals_table(log_dir, db, "inc_items", ("id",))
    pairs = assert_topic_equals_table(log_dir, db, "inc_pairs", ("tenant", "seq"))
    assert items.get("r") and items.get("u") and items.get("d"), items
    assert pairs.get("r"), pairs
    print(f"churn: {churn.transactions} transactions; inc_items ops {items}; inc_pairs ops {pairs}")


def stored_snapshot_rows(log_dir: Path) -> int:
    """The incremental snapshot's rows in the stored position (0: none stored yet)."""
    position = stored_position(log_dir)
    return 0 if position is None or position.incremental is None else position.incremental.rows


def snapshot_rows_logged(stderr: Path) -> int:
    """The incremental snapshot's rows in the child's latest status line (0: none yet)."""
    rows = 0
    for line in stderr.read_text(errors="replace").splitlines():
        if "capture status " in line:
            try:
                status = json.loads(line.split("capture status ", 1)[1])
            except ValueError:
                continue  # the line being written
            incremental = status.get("incremental_snapshot")
            if incremental is not None:
                rows = incremental["rows"]
    return rows


def test_pause_resume_stop_and_where(db: str, tmp_path: Path) -> None:
    """Signals through the CLI: pause holds the snapshot, resume finishes it, stop ends another one; --where."""
    log_dir = tmp_path / "log"
    run_until_caught_up(log_dir, config(db))
    populate(db, ROWS)
    # A malformed signal is logged and ignored: capture goes on.
    sql(db, f"INSERT INTO {DEFAULT_SIGNAL_TABLE} VALUES ('typo', 'execute-snapshot', '{{not json')")
    with Running(log_dir, config(db)) as running:
        out = cli("capture", "snapshot", "--dsn", db, "--tables", "public.inc_items", "--where", "v < 50",
                  "--chunk-size", "50")  # fmt: skip
        assert "execute-snapshot" in out
        running.wait("rows", lambda s: s.incremental is not None and s.incremental["rows"] > 0)
        cli("capture", "pause-snapshot", "--dsn", db)
        running.wait("the pause", lambda s: s.incremental is not None and s.incremental["paused"])
        # A chunk read before the pause was seen completes (its high watermark committed before this insert).
        lsn = current_lsn(db)
        sql(db, "INSERT INTO inc_pairs (tenant, seq, amount) VALUES ('acme', -1, 1)")
        running.wait("the insert to be stored", lambda s: s.last_stored_lsn >= lsn)
        paused_at = running.connector.stats.snapshot_rows
        lsn = current_lsn(db)
        sql(db, "INSERT INTO inc_pairs (tenant, seq, amount) VALUES ('acme', -2, 1)")  # the stream goes on
        running.wait("the second insert to be stored", lambda s: s.last_stored_lsn >= lsn)
        assert running.connector.stats.snapshot_rows == paused_at, "rows were read while paused"
        cli("capture", "resume-snapshot", "--dsn", db)
        running.wait("the end of the snapshot", lambda s: s.incremental is None)
        # A second snapshot, stopped: paused at once, then stopped.
        execute_snapshot(db, "public.inc_pairs", **{"chunk-size": 10})
        cli("capture", "pause-snapshot", "--dsn", db)
        running.wait("the second one to pause", lambda s: s.incremental is not None and s.incremental["paused"])
        cli("capture", "stop-snapshot", "--dsn", db)
        running.wait("the stop", lambda s: s.incremental is None)
    assert stored_position(log_dir).incremental is None  # type: ignore[union-attr]
    state = {json.dumps(k, sort_keys=True): v for k, v, _ in records(log_dir, "cdc.public.inc_items")}
    reads = [v for v in state.values() if v is not None and v["op"] == "r"]
    with psycopg.connect(db) as c:
        matching = c.execute("SELECT count(*) FROM inc_items WHERE v < 50").fetchone()
    assert matching is not None and len(reads) == matching[0], (len(reads), matching)
    assert all(v["after"]["v"] < 50 for v in reads)
    assert all(v["source"]["snapshot"] == "incremental" for v in reads)
    pairs_reads = [v for _, v, _ in records(log_dir, "cdc.public.inc_pairs") if v is not None and v["op"] == "r"]
    assert len(pairs_reads) < ROWS // 2, "the stopped snapshot read every row"


def test_table_added_to_the_include_list(db: str, tmp_path: Path, plugin: Plugin) -> None:
    """A connector streaming inc_pairs is restarted with inc_items included too: inc_items alone is
    snapshotted incrementally (under churn), and its topic then equals the table. No signal table is
    configured (the default): none is needed for this, and none is created in the source database."""
    log_dir = tmp_path / "log"
    populate(db, ROWS // 3)
    only_pairs = TableFilter(include=["public.inc_pairs"])
    run_until_caught_up(log_dir, config(db, plugin, table_filter=only_pairs, signal_table=None))
    with Log(log_dir) as log:
        assert "cdc.public.inc_items" not in log.topics()
        pairs_before = len(records(log_dir, "cdc.public.inc_pairs"))
    with Churn(db, ROWS // 3, seed=7), Running(log_dir, config(db, plugin, signal_table=None)) as running:
        running.wait("the new table's snapshot", lambda s: s.snapshot_rows > 0 and s.incremental is None)
    run_until_caught_up(log_dir, config(db, plugin, signal_table=None))
    with psycopg.connect(db) as c:
        assert c.execute("SELECT to_regclass('public.tideline_signal')").fetchone() == (None,)
    items = assert_topic_equals_table(log_dir, db, "inc_items", ("id",))
    assert items.get("r"), items
    pairs_reads = [v for _, v, _ in records(log_dir, "cdc.public.inc_pairs")[pairs_before:] if v and v["op"] == "r"]
    assert not pairs_reads, "the table already captured was snapshotted again"
    assert_topic_equals_table(log_dir, db, "inc_pairs", ("tenant", "seq"))


# ---------------------------------------------------------------------------- pieces


def test_read_snapshot_visibility_with_32_bit_stream_xids() -> None:
    """The stream's xids are 32 bits, pg_current_snapshot()'s 64: the nearest to xmax is meant."""
    snap = ReadSnapshot.parse("4294967290:4294967300:4294967295")  # across an epoch boundary
    assert snap.sees(4294967289)  # below xmin: committed before the read
    assert not snap.sees(4294967295)  # in progress at the read
    assert snap.sees(4294967294)  # committed between xmin and xmax
    assert not snap.sees(4)  # 4294967300 = epoch 1, xid 4: xmax itself, started after the read
    assert not snap.sees(10)  # later still
    assert snap.sees(None)
    assert ReadSnapshot.parse("100:105:").xip == frozenset()


def _insert(type_: str, data: str | None) -> ChangeMessage:
    cols = [Column("id", "text", 25, "s1"), Column("type", "text", 25, type_), Column("data", "text", 25, data)]
    return ChangeMessage(Kind.INSERT, 0, columns=cols)


def test_signal_rows_parse_or_name_what_is_wrong() -> None:
    signal = signal_from_insert(
        _insert(
            "execute-snapshot",
            '{"data-collections": ["public.a"], "chunk-size": 7, '
            '"additional-conditions": [{"data-collection": "public.a", "filter": "x"}]}',
        )
    )
    assert signal.type is SignalType.EXECUTE_SNAPSHOT and signal.tables == ["public.a"]
    assert signal.filters == {"public.a": "x"} and signal.chunk_size == 7
    assert signal_from_insert(_insert("pause-snapshot", None)).data == {}
    with pytest.raises(SignalError, match="unknown type 'snapshot-please'"):
        signal_from_insert(_insert("snapshot-please", None))
    with pytest.raises(SignalError, match="data is not JSON"):
        signal_from_insert(_insert("execute-snapshot", "{oops"))
    with pytest.raises(SignalError, match=r"data-collections must be a list of schema\.table"):
        _ = signal_from_insert(_insert("execute-snapshot", '{"data-collections": "public.a"}')).tables
    with pytest.raises(SignalError, match="chunk-size must be a positive integer"):
        _ = signal_from_insert(_insert("execute-snapshot", '{"chunk-size": 0}')).chunk_size


def test_snapshot_command_refuses_bad_input(db: str) -> None:
    """One line naming what is wrong, before any signal is written."""
    sql(db, "CREATE TABLE inc_loose (v text)", "CREATE TABLE public.tideline_signal (id text PRIMARY KEY, "
        "type text NOT NULL, data text)")  # fmt: skip
    cases = [
        (["--tables", "public.nope"], "table public.nope does not exist"),
        (["--tables", "public.inc_loose"], "table public.inc_loose has no primary key"),
        (
            ["--tables", "public.inc_items", "--where", "no_such_column = 1"],
            "--where 'no_such_column = 1' does not work",
        ),
        (["--tables", "inc_items"], "write it as schema.table"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(app, ["capture", "snapshot", "--dsn", db, *args])
        assert result.exit_code != 0 and message in result.output, (args, result.output)
    with psycopg.connect(db) as c:
        assert c.execute("SELECT count(*) FROM public.tideline_signal").fetchone() == (0,)
    missing = CliRunner().invoke(app, ["capture", "pause-snapshot", "--dsn", db, "--signal-table", "public.nope"])
    assert missing.exit_code != 0 and "signal table public.nope does not exist" in missing.output, missing.output


def test_a_commit_streamed_before_it_is_visible_is_not_overwritten(db: str, tmp_path: Path) -> None:
    """Under synchronous replication a commit stays invisible until the standby answers, while logical
    decoding already streams it. Here the connector itself is the synchronous standby (its walsender's
    application_name), so every churn commit is streamed, then becomes visible only once the connector
    confirms it: chunk reads meet transactions the stream has passed but their snapshot has not seen.
    Such a read is taken again (else its older rows would follow the newer changes: the order check fails)."""
    log_dir = tmp_path / "log"
    populate(db, ROWS // 3)
    run_until_caught_up(log_dir, config(db, snapshot=SnapshotMode.NEVER))
    standby = f"inc_sync_{os.getpid()}"
    dsn = f"{db}{'&' if '?' in db else '?'}application_name={standby}"
    with Running(log_dir, config(dsn, snapshot=SnapshotMode.NEVER)) as running:
        running.wait("streaming", lambda s: s.batches > 0 or s.server_wal_end > 0)
        sql(db, f"ALTER SYSTEM SET synchronous_standby_names = '{standby}'", "SELECT pg_reload_conf()")
        try:
            with Churn(db, ROWS // 3, seed=3):
                execute_snapshot(db, "public.inc_items", **{"chunk-size": 20})
                running.wait("the snapshot", lambda s: s.snapshot_rows > 0 and s.incremental is None)
        finally:
            sql(db, "ALTER SYSTEM RESET synchronous_standby_names", "SELECT pg_reload_conf()")
        rereads = running.connector.stats.incremental_rereads
    run_until_caught_up(log_dir, config(db, snapshot=SnapshotMode.NEVER))
    assert_topic_equals_table(log_dir, db, "inc_items", ("id",))
    assert rereads > 0, "no chunk read met a streamed but invisible commit: the scenario did not happen"
