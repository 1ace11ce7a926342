"""Failover: the primary is killed (kill -9) and its standby promoted while capture streams a steady workload.

PostgreSQL 18 (failover slots, 17+): capture's slot is created with ``FAILOVER``; the physical standby synchronizes
it (``sync_replication_slots = on``) and the primary holds logical decoding back until the standby has the WAL
(``synchronized_standby_slots``). Capture's DSN names both hosts (``target_session_attrs=read-write``): after the
promotion it reconnects to the new primary and streams on from its stored position through the synchronized slot.
The log then equals ``SELECT *`` on the new primary: nothing lost, nothing twice. The time from the kill to the
first change captured from the new primary is printed (no assertion on it: the suite asserts no timings).

PostgreSQL 15 (no failover slots): the promoted standby has no slot, and capture stops with one line that names
the slot and the recovery (``--snapshot when_needed``).
"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest
from capture_util import ConnectorThread, records, stored_position
from readiness import patience, wait_until
from replicas import TOPIC, Pair, Writer, assert_log_is_table, synced_slot_ready

from capture.config import CaptureConfig
from capture.errors import SlotLostError
from capture.messages import Plugin
from capture.slots import current_wal_lsn, slot_status


@pytest.mark.parametrize("pair", [18], ids=["pg18"], indirect=True)
def test_capture_follows_a_promoted_standby_through_its_failover_slot(pair: Pair, tmp_path: Path) -> None:
    log_dir, slot = tmp_path / "log", "fo"
    config = CaptureConfig(dsn=pair.dsn(), slot=slot, topic_prefix="cdc", plugin=Plugin.PGOUTPUT,
                           max_retry_time_s=120)  # fmt: skip
    writer = Writer(pair.dsn())
    with ConnectorThread(log_dir, config) as running:
        writer.start()
        wait_until(lambda: stored_position(log_dir, pair.dsn(), slot) is not None and writer.next_id > 50,
                   "capture to store the workload's first changes", alive=running.thread)  # fmt: skip
        with psycopg.connect(pair.primary.dsn_for(pair.db), autocommit=True) as c:
            c.execute("SELECT pg_log_standby_snapshot()")  # a running-xacts record: the synced slot can persist
        wait_until(lambda: synced_slot_ready(pair.standby, pair.db, slot), "the standby to hold the slot",
                   alive=running.thread)  # fmt: skip
        status = slot_status(pair.dsn(), slot)
        assert status is not None and status["failover"] is True  # what `capture status` shows
        time.sleep(0.5)  # the readiness signals above passed: the kill lands while capture streams
        killed_at = time.monotonic()
        pair.primary.kill()
        pair.standby.promote()
        promoted = pair.standby.dsn_for(pair.db)
        with psycopg.connect(promoted, autocommit=True) as c:
            c.execute("INSERT INTO acct (id, balance) VALUES (-1, 0)")  # the first change of the new primary
        wait_until(lambda: any(k == {"id": -1} for k, _, _ in records(log_dir, TOPIC)),
                   "capture to stream from the new primary", alive=running.thread)  # fmt: skip
        resumed_s = time.monotonic() - killed_at
        before = writer.next_id
        wait_until(lambda: writer.next_id > before + 50, "the workload to go on", alive=running.thread)
        writer.finish()
        end = current_wal_lsn(promoted)
        wait_until(lambda: (p := stored_position(log_dir, promoted, slot)) is not None and p.confirm_lsn >= end,
                   "capture to catch up", alive=running.thread)  # fmt: skip
    print(f"\nfailover: kill -9 of the primary to the first change captured from the promoted standby: "
          f"{resumed_s:.2f} s ({writer.failures} writes retried)")
    assert assert_log_is_table(log_dir, promoted) > 100


@pytest.mark.parametrize("pair", [15], ids=["pg15"], indirect=True)
def test_without_failover_slots_capture_stops_naming_the_lost_slot(pair: Pair, tmp_path: Path) -> None:
    log_dir, slot = tmp_path / "log", "fo"
    config = CaptureConfig(dsn=pair.dsn(), slot=slot, topic_prefix="cdc", plugin=Plugin.PGOUTPUT,
                           max_retry_time_s=120)  # fmt: skip
    running = ConnectorThread(log_dir, config)
    running.thread.start()
    try:
        with psycopg.connect(pair.primary.dsn_for(pair.db), autocommit=True) as c:
            c.execute("INSERT INTO acct (id, balance) VALUES (1, 1)")
        wait_until(lambda: len(records(log_dir, TOPIC)) == 1, "capture to store a change",
                   alive=running.thread)  # fmt: skip
        status = slot_status(pair.dsn(), slot)
        assert status is not None and status["failover"] is None  # the server has no failover slots
        pair.primary.kill()
        pair.standby.promote()
        running.thread.join(patience(120))
        assert not running.thread.is_alive(), "capture went on without its slot"
    finally:
        running.connector.stop()
        running.thread.join(60)
        running.log.close()
    assert len(running.errors) == 1 and isinstance(running.errors[0], SlotLostError), running.errors
    message = str(running.errors[0])
    assert f"slot {slot} does not exist" in message and "--snapshot when_needed" in message, message
