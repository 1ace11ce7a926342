"""Capture from a hot standby (logical decoding on a standby: PostgreSQL 16+), against real servers.

On 18: the publication is the primary's (a standby is read only: replicated to it), the slot is the standby's own.
Snapshot and stream read the standby; the log equals ``SELECT *`` on the primary once the standby replayed it.
Then the standby is promoted: its slot stays, and capture streams on from the new primary, exactly.
Managed publications that do not exist yet are one line naming what to do (they cannot be created on a standby).
On 15: one line saying that 15 cannot decode on a standby.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from capture_util import capture
from readiness import wait_until
from replicas import Pair, assert_log_is_table, table_rows

from capture.config import CaptureConfig
from capture.connector import Connector, PublicationMode
from capture.errors import PermanentCaptureError
from capture.messages import Plugin
from capture.slots import current_wal_lsn
from eventstore.errors import ConfigError
from eventstore.log import Log


@contextmanager
def standby_snapshots(pair: Pair) -> Iterator[None]:
    """The primary logs a running-transactions record every 200 ms (PostgreSQL does every 15 s): a slot made on
    a standby waits for one (``pg_log_standby_snapshot``, the documented way to hurry it)."""
    stop = threading.Event()

    def kick() -> None:
        while not stop.wait(0.2):
            try:
                with psycopg.connect(pair.primary.dsn_for(pair.db), autocommit=True) as c:
                    c.execute("SELECT pg_log_standby_snapshot()")
            except psycopg.OperationalError:
                return  # the primary is gone (promotion below)

    thread = threading.Thread(target=kick, name="standby-snapshots", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def write(dsn: str, first: int, count: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        for i in range(first, first + count):
            c.execute("INSERT INTO acct (id, balance) VALUES (%s, %s)", (i, i))
        c.execute("UPDATE acct SET balance = balance * 2, touched = touched + 1 WHERE id % 3 = 0")
        c.execute("DELETE FROM acct WHERE id % 7 = 0")


def replayed(pair: Pair) -> None:
    """Until the standby replayed everything the primary wrote so far."""
    end = current_wal_lsn(pair.primary.dsn_for(pair.db))
    wait_until(lambda: current_wal_lsn(pair.standby.dsn_for(pair.db)) >= end, "the standby to replay the primary")


@pytest.mark.parametrize("pair", [18], ids=["pg18"], indirect=True)
def test_capture_on_a_standby_is_exact_and_survives_its_promotion(pair: Pair, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    write(pair.primary.dsn_for(pair.db), 1, 30)
    standby = pair.standby.dsn_for(pair.db)
    replayed(pair)
    refused = CaptureConfig(dsn=standby, slot="sb", topic_prefix="cdc", plugin=Plugin.PGOUTPUT,
                            exit_when_caught_up=True)  # fmt: skip
    with Log(tmp_path / "refused") as log, pytest.raises((ConfigError, PermanentCaptureError)) as managed:
        Connector(refused, log).run()
    assert "the server is a standby" in str(managed.value) and "against the primary" in str(managed.value)

    with psycopg.connect(pair.primary.dsn_for(pair.db), autocommit=True) as c:
        c.execute("CREATE PUBLICATION app FOR TABLE acct")
    options = {"plugin": Plugin.PGOUTPUT, "publication": "app", "publication_autocreate": PublicationMode.DISABLED}
    replayed(pair)
    with standby_snapshots(pair):
        first = capture(log_dir, standby, slot="sb", **options)  # snapshot on the standby
        assert first.snapshot_rows == len(table_rows(pair.primary.dsn_for(pair.db))) > 0
        write(pair.primary.dsn_for(pair.db), 100, 30)
        replayed(pair)
        capture(log_dir, standby, slot="sb", **options)  # streamed from the standby
        assert_log_is_table(log_dir, pair.primary.dsn_for(pair.db))

    pair.primary.stop()
    promoted = pair.standby.promote()
    assert promoted
    write(standby, 200, 30)  # the standby is the primary now: its own slot goes on
    capture(log_dir, standby, slot="sb", **options)
    assert_log_is_table(log_dir, standby)


@pytest.mark.parametrize("pair", [15], ids=["pg15"], indirect=True)
def test_postgresql_15_cannot_decode_on_a_standby_in_one_line(pair: Pair, tmp_path: Path) -> None:
    config = CaptureConfig(dsn=pair.standby.dsn_for(pair.db), slot="sb", topic_prefix="cdc",
                           exit_when_caught_up=True)  # fmt: skip
    with Log(tmp_path / "log") as log, pytest.raises(PermanentCaptureError) as refused:
        Connector(config, log).run()
    message = str(refused.value)
    assert "PostgreSQL 15 cannot decode on one (16 and later can)" in message and "--dsn" in message, message
