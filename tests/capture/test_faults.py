"""Faults around a running connector: Postgres crashes, cut connections, a dropped slot, a restarted Kafka.

Each test runs the connector (a thread) while a workload commits one change per
transaction, injects the fault, and then checks against the table: every row's insert
once in the log, the latest value per key equal to ``SELECT *`` (nothing lost, nothing
duplicated), or, for the dropped slot, a loud stop. Each records its figures for
RELIABILITY.md (``tideline.reliability``; ``make soak`` repeats the faults more often).

- ``pg_ctl restart -m immediate`` (a crash: WAL recovery at the next start) mid-stream;
- the replication connection cut by a TCP proxy the test controls (no FIN from Postgres:
  the proxy closes both sides);
- the slot dropped while streaming: the connector stops with SlotLostError;
- the whole Kafka cluster stopped and started again while capture writes to it;
- the embedded log's file system full (ENOSPC), then space back.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from backends import Backend, assert_each_change_once, stored_equal
from capture_util import run_connector, sql
from workload import soak

from capture.connector import CaptureConfig, Connector, SlotLostError
from capture.messages import Plugin
from capture.slots import current_wal_lsn
from schemas.position import format_lsn, parse_lsn
from tideline.faults import SmallFilesystem
from tideline.kafkaharness import LocalKafka
from tideline.pgharness import LocalPostgres
from tideline.reliability import record_fault_result

FAULTS = 6 if soak() else 2  # faults injected per test


@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A cluster of this module's own: these tests crash and restart it."""
    with LocalPostgres(tmp_path_factory.mktemp("faults") / "pg", fast=True) as cluster:
        yield cluster


@pytest.fixture
def db(pg: LocalPostgres, request: pytest.FixtureRequest) -> str:
    name = request.node.name  # one database per test and parameter
    dsn = pg.create_database(f"f_{name[:24].lower().replace('[', '_')}_{zlib.crc32(name.encode()):08x}")
    sql(dsn, "CREATE TABLE t (id int PRIMARY KEY, v int)")
    return dsn


class Writer(threading.Thread):
    """Commits one change per transaction (inserts, each followed by an update of the row before it),
    reconnecting through faults; the table is the truth of what committed."""

    def __init__(self, dsn: str, rows: int, pause_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.dsn, self.rows, self.pause_s = dsn, rows, pause_s
        self.failures = 0
        self.done = threading.Event()

    def run(self) -> None:
        i = 1
        while i <= self.rows:
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as c:
                    while i <= self.rows:
                        c.execute("INSERT INTO t VALUES (%s, 0) ON CONFLICT (id) DO NOTHING", (i,))
                        if i > 1:
                            c.execute("UPDATE t SET v = v + 1 WHERE id = %s", (i - 1,))
                        i += 1
                        time.sleep(self.pause_s)
            except psycopg.Error:
                self.failures += 1  # the server went away: reconnect (a commit in flight may or may not be in)
                time.sleep(0.2)
        self.done.set()

    def wait_rows(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while count_rows(self.dsn) < n:
            assert time.monotonic() < deadline, f"the workload did not reach {n} rows"
            time.sleep(0.05)


def count_rows(dsn: str) -> int:
    with contextlib.suppress(psycopg.Error), psycopg.connect(dsn, connect_timeout=5) as c:
        row = c.execute("SELECT count(*) FROM t").fetchone()
        return int(row[0]) if row else 0
    return 0


def stack_of(thread: threading.Thread, connector: Connector | None = None, target: int = 0) -> str:
    """Where a connector thread that did not recover is, and how far it got (for the failure message)."""
    frame = sys._current_frames().get(thread.ident or 0)
    where = ""
    if connector is not None:
        where = (f" (confirmed {format_lsn(connector.offsets.confirm_lsn)}, waiting for {format_lsn(target)}; "
                 f"{connector.stats})")  # fmt: skip
    return f"capture did not recover{where}; connector thread at:\n" + "".join(traceback.format_stack(frame)[-12:])


def sentinel(dsn: str, k: int) -> int:
    """Commit row ``-k - 1`` (a change capture must store: the workload may be over) once the source
    answers, and return the WAL position after it."""
    deadline = time.monotonic() + 120
    while True:
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as c:
                c.execute("INSERT INTO t VALUES (%s, 0) ON CONFLICT (id) DO UPDATE SET v = t.v + 1", (-k - 1,))
            return current_wal_lsn(dsn)
        except psycopg.OperationalError:
            assert time.monotonic() < deadline, "the source did not come back"
            time.sleep(0.2)


def capture_through(
    dsn: str, backend: Backend, config: CaptureConfig, rows: int, inject: Callable[[int], float], faults: int = FAULTS
) -> tuple[list[float], Writer, int]:
    """Run the connector and the workload; ``inject(k)`` injects fault ``k`` once the workload is a
    fraction in and returns when it was injected (monotonic); returns, per fault, the seconds until
    capture had stored and confirmed the WAL written up to the moment the source answered again."""
    errors: list[BaseException] = []
    writer = Writer(dsn, rows)
    recovered: list[float] = []
    with backend.sink() as (log, sink):
        connector = Connector(config, log, sink=sink)
        thread = run_connector(connector, errors)
        try:
            deadline = time.monotonic() + 120
            while not connector.offsets.confirm_lsn:  # the snapshot is stored: the workload streams
                assert thread.is_alive() and time.monotonic() < deadline, errors or "capture did not start"
                time.sleep(0.05)
            writer.start()
            for k in range(faults):
                writer.wait_rows(rows * (k + 1) // (faults + 2))
                injected = inject(k)
                target = sentinel(dsn, k)  # a change committed once the source answers again
                deadline = time.monotonic() + 240  # generous: retries back off, a loaded machine is slow
                while connector.offsets.confirm_lsn < target:  # stored (and confirmed) past it
                    alive = thread.is_alive() and time.monotonic() < deadline
                    assert alive, errors or stack_of(thread, connector, target)
                    time.sleep(0.05)
                recovered.append(time.monotonic() - injected)
            assert writer.done.wait(300), "the workload did not finish"
            stored_equal(backend, dsn, thread, 180)
        finally:
            connector.stop()
            thread.join(120)
    assert not errors, errors
    return recovered, writer, connector.stats.reconnects


def test_postgres_crash_restart_mid_stream(pg: LocalPostgres, db: str, tmp_path: Path) -> None:
    """``pg_ctl restart -m immediate`` while capture streams and the workload commits: capture reconnects
    (transient after streaming started) and resumes from its stored position."""
    backend = Backend.embedded(tmp_path / "log")
    config = CaptureConfig(dsn=db, slot="crash", topic_prefix=backend.prefix, max_retry_time_s=120)

    def crash(k: int) -> float:
        at = time.monotonic()
        pg.restart("immediate")
        return at

    recovered, writer, reconnects = capture_through(db, backend, config, 600, crash)
    assert reconnects >= len(recovered)
    rows = assert_each_change_once(backend, db)
    record_fault_result("postgres", "pg_ctl restart -m immediate mid-stream", injected=len(recovered),
                        survived=len(recovered), records_lost=0, duplicates=0, recover_seconds=recovered,
                        detail=f"{rows} rows, {writer.failures} writer reconnects")  # fmt: skip


class Proxy:
    """A TCP proxy 127.0.0.1:<port> → Postgres that can cut every connection through it at once."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self.lock:
                self.pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> int:
        """Reset every open connection (RST to both ends); new ones are accepted as before.

        ``shutdown`` first: a plain ``close`` while a pump thread is blocked in ``recv`` on the socket
        releases it (and sends the RST) only when that ``recv`` returns, so one end might learn of the
        cut only at its next send, seconds or minutes later."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
        self.cuts += 1
        return len(pairs)

    def close(self) -> None:
        self.server.close()
        self.cut()


def test_replication_connection_cut_by_a_proxy(pg: LocalPostgres, db: str, tmp_path: Path) -> None:
    """The connector reaches Postgres through a proxy that resets every connection mid-stream."""
    port = int(psycopg.conninfo.conninfo_to_dict(db)["port"])
    proxy = Proxy(port)
    try:
        via_proxy = db.replace(f":{port}/", f":{proxy.port}/")
        assert via_proxy != db
        backend = Backend.embedded(tmp_path / "log")
        # slot_busy_wait_s: the server notices the cut walsender a little later
        config = CaptureConfig(dsn=via_proxy, slot="proxy", topic_prefix=backend.prefix, max_retry_time_s=120,
                               slot_busy_wait_s=60)  # fmt: skip

        def cut(k: int) -> float:
            at = time.monotonic()
            assert proxy.cut() >= 1, "no connection went through the proxy"
            return at

        recovered, _, reconnects = capture_through(db, backend, config, 600, cut)
        assert reconnects >= len(recovered)
    finally:
        proxy.close()
    rows = assert_each_change_once(backend, db)
    record_fault_result("postgres", "replication connection reset by a TCP proxy mid-stream",
                        injected=len(recovered), survived=len(recovered), records_lost=0, duplicates=0,
                        recover_seconds=recovered, detail=f"{rows} rows")  # fmt: skip


def test_slot_dropped_while_streaming_is_a_loud_stop(pg: LocalPostgres, db: str, tmp_path: Path) -> None:
    backend = Backend.embedded(tmp_path / "log")
    config = CaptureConfig(dsn=db, slot="doomed", topic_prefix=backend.prefix)
    errors: list[BaseException] = []
    with backend.sink() as (log, _):
        connector = Connector(config, log)
        thread = run_connector(connector, errors)
        try:
            sql(db, "INSERT INTO t VALUES (1, 0)")
            deadline = time.monotonic() + 60
            while connector.stats.events + connector.stats.snapshot_rows < 1 or not connector.offsets.confirm_lsn:
                assert thread.is_alive() and time.monotonic() < deadline, errors
                time.sleep(0.05)
            with psycopg.connect(db, autocommit=True) as c:
                while True:  # the walsender ends, and the slot goes before the connector reconnects (backoff)
                    c.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                              "WHERE slot_name = 'doomed' AND active_pid IS NOT NULL")  # fmt: skip
                    with contextlib.suppress(psycopg.errors.ObjectInUse):
                        c.execute("SELECT pg_drop_replication_slot('doomed')")
                        break
                    assert time.monotonic() < deadline, "the slot could not be dropped"
            sql(db, "INSERT INTO t VALUES (2, 0)")
            thread.join(120)
        finally:
            connector.stop()
            thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], SlotLostError), errors
    assert "doomed" in str(errors[0]) and "when_needed" in str(errors[0]), errors[0]
    assert [json_id(v) for _, _, v in backend.records(f"{backend.prefix}.public.t")] == [1]
    record_fault_result("postgres", "slot dropped while streaming (a loud stop expected)", injected=1, survived=1,
                        records_lost=0, duplicates=0, detail=f"stopped with: {str(errors[0])[:200]}")  # fmt: skip


def test_slot_dropped_between_the_start_checks_and_streaming_is_the_same_loud_stop(
    pg: LocalPostgres, db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race a loaded machine showed: the reconnect's start checks see the slot, then it is dropped before
    START_REPLICATION (the server answers 'replication slot does not exist'). Made deterministic here: the slot is
    dropped right after the checks of the second connection. The connector checks again and stops with the same
    SlotLostError as when the checks see the slot gone, not with the server's raw error."""
    import capture.connector as connector_module

    checks: list[int] = []
    real_check = connector_module.check_start

    def check_then_drop(*args: object, **kwargs: object) -> object:
        decision = real_check(*args, **kwargs)  # type: ignore[arg-type]
        checks.append(1)
        if len(checks) == 2:  # the reconnect after the walsender was ended: the slot goes now
            with psycopg.connect(db, autocommit=True) as c:
                c.execute("SELECT pg_drop_replication_slot('racy')")
        return decision

    monkeypatch.setattr(connector_module, "check_start", check_then_drop)
    backend = Backend.embedded(tmp_path / "log")
    config = CaptureConfig(dsn=db, slot="racy", topic_prefix=backend.prefix)
    errors: list[BaseException] = []
    with backend.sink() as (log, _):
        connector = Connector(config, log)
        thread = run_connector(connector, errors)
        try:
            sql(db, "INSERT INTO t VALUES (1, 0)")
            deadline = time.monotonic() + 60
            while connector.stats.events + connector.stats.snapshot_rows < 1 or not connector.offsets.confirm_lsn:
                assert thread.is_alive() and time.monotonic() < deadline, errors
                time.sleep(0.05)
            with psycopg.connect(db, autocommit=True) as c:  # end the walsender: the connector reconnects
                c.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                          "WHERE slot_name = 'racy' AND active_pid IS NOT NULL")  # fmt: skip
            thread.join(120)
        finally:
            connector.stop()
            thread.join(60)
    # the drop happened after the reconnect's checks (once, under a full -n 2 run, the reconnect's checks never
    # came: the connector's errors and counters say why, next time)
    assert len(checks) >= 2, (checks, errors, connector.stats.reconnects, connector.stats.events)
    assert len(errors) == 1 and isinstance(errors[0], SlotLostError), errors
    assert "racy" in str(errors[0]) and "when_needed" in str(errors[0]), errors[0]


def json_id(value: bytes | None) -> int:
    assert value is not None
    return int(json.loads(value)["after"]["id"])


def test_whole_kafka_cluster_restarted_mid_capture(db: str, kafka: LocalKafka, tmp_path: Path, plugin: Plugin) -> None:
    """Every broker stopped (controlled) and started again while capture writes to Kafka: the connector
    aborts, reopens its producer once the cluster is back, and resumes; every change once (each plugin)."""
    backend = Backend.kafka(kafka.bootstrap_servers, tmp_path / "state")
    config = CaptureConfig(dsn=db, slot=f"kafkarestart_{plugin.value}", topic_prefix=backend.prefix,
                           max_retry_time_s=180, plugin=plugin)  # fmt: skip

    def restart(k: int) -> float:
        at = time.monotonic()
        kafka.stop()
        kafka.start()
        assert kafka.bootstrap_servers == backend.bootstrap, "the cluster came back on other ports"
        return at

    recovered, _, _ = capture_through(db, backend, config, 400, restart, faults=FAULTS if soak() else 1)
    rows = assert_each_change_once(backend, db)
    suffix = "" if plugin is Plugin.WAL2JSON else f" ({plugin.value})"
    record_fault_result("kafka", f"whole Kafka cluster (1 broker) stopped and started mid-capture{suffix}",
                        injected=len(recovered), survived=len(recovered), records_lost=0, duplicates=0,
                        recover_seconds=recovered, detail=f"{rows} rows")  # fmt: skip


def test_disk_full_under_the_log_then_space_returns(db: str, small_disk: SmallFilesystem) -> None:
    """The embedded log (and the key state beside it) on a small file system that fills up while capture
    streams: appends fail with ENOSPC, the batch is aborted and retried with backoff (nothing confirmed
    to Postgres meanwhile); once space is back capture resumes; every change once."""
    backend = Backend.embedded(small_disk.path / "log")
    config = CaptureConfig(dsn=db, slot="diskfull", topic_prefix=backend.prefix, max_retry_time_s=300)
    full_for: list[float] = []

    def fill_then_free(k: int) -> float:
        at = time.monotonic()
        small_disk.fill(leave_bytes=16 << 10)
        before = current_wal_lsn(db)
        time.sleep(2.0)  # the workload goes on; capture's appends fail meanwhile
        sentinel(db, 100 + k)
        assert count_rows(db) > 0
        full_for.append(time.monotonic() - at)
        with psycopg.connect(db) as c:  # nothing confirmed to Postgres beyond what the log holds
            row = c.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'diskfull'")
            confirmed = parse_lsn((row.fetchone() or ("0/0",))[0])
        assert confirmed <= max(before, stored_confirm(backend, db)), (confirmed, before)
        small_disk.free()
        return time.monotonic()

    recovered, _, reconnects = capture_through(db, backend, config, 300, fill_then_free, faults=1)
    assert reconnects >= 1, "the disk never filled up under capture"
    rows = assert_each_change_once(backend, db)
    full = ", ".join(f"{s:.1f}" for s in full_for)
    record_fault_result("disk full", "ENOSPC under the embedded log while capture streams; space returns",
                        injected=len(recovered), survived=len(recovered), records_lost=0, duplicates=0,
                        recover_seconds=recovered, detail=f"{rows} rows; full for {full} s")  # fmt: skip


def stored_confirm(backend: Backend, dsn: str) -> int:
    position = backend.position(dsn, "diskfull")
    return position.confirm_lsn if position is not None else 0
