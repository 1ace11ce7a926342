"""A transaction's BEGIN record is stored once, even when the log transaction that holds it ends right after it.

Streaming checks the open log transaction's bound (``batch_bytes`` / ``batch_events``) after every XLogData
message. Both plugins send a source transaction's BEGIN as a payload of its own, and with
``transaction_metadata`` the BEGIN is an event (``<prefix>.transaction``): when it is the one that fills the
log transaction, that commits at once, with the BEGIN in it but before any change of its transaction. The
position stored with it must say that the BEGIN is stored (``(commit_lsn, -1)``, covered on restart): a
connector killed before its next commit then resumes with the transaction's first change, not with a second
BEGIN (seen once in test_crash.py under load: ``cdc.transaction`` held one BEGIN twice).

Deterministic here: batches bounded by event count (and no commit for age), a 3-row transaction then a
20-row one, so that the BEGIN of the second is the sixth event of the batch; the connector (a process of its
own) dies as a kill -9 would before its next commit, the first to store a change of that transaction, and a
restart catches up. Both plugins, both cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from capture_util import capture, drop_slots, events, fresh_database, sql, stored_position

from capture.config import CoreChoice
from capture.messages import Plugin
from capture.native.extension import available as native_available
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
FIRST_ROWS, SECOND_ROWS = 3, 20
BATCH_EVENTS = FIRST_ROWS + 3  # BEGIN, the rows and END of the first transaction, then the second's BEGIN

KILLED_CHILD = r"""
import os, sys
from pathlib import Path
from capture import writer
from capture.config import CoreChoice
from capture.connector import CaptureConfig, Connector, SnapshotMode
from capture.messages import Plugin
from eventstore.log import Log

log_dir, dsn, plugin, core, batch_events = sys.argv[1:6]
commit = writer.LogWriter.commit

def dying_commit(self, position):
    # the first log transaction that stores a change of a transaction not yet complete dies before its
    # commit, as a kill -9 would
    if position is not None and not position.complete and position.event_index >= 0:
        os._exit(17)
    return commit(self, position)

writer.LogWriter.commit = dying_commit
config = CaptureConfig(dsn=dsn, slot="t", topic_prefix="cdc", plugin=Plugin(plugin), core=CoreChoice(core),
                       snapshot=SnapshotMode.NEVER, exit_when_caught_up=True, transaction_metadata=True,
                       batch_events=int(batch_events), linger_ms=60_000, max_linger_ms=60_000)
with Log(Path(log_dir)) as log:
    Connector(config, log).run()
"""


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "txnmeta")
    yield dsn
    drop_slots(dsn)


def transactions(log_dir: Path) -> list[tuple[str, str]]:
    """(id, status) of every committed record of ``cdc.transaction``, in order (one partition)."""
    return [(t["id"], t["status"]) for t in events(log_dir, "cdc.transaction")]


NATIVE = pytest.param(
    CoreChoice.NATIVE,
    marks=pytest.mark.skipif(not native_available(), reason="tideline_native is not built (make native)"),
)


@pytest.mark.parametrize("core", [CoreChoice.PYTHON, NATIVE], ids=lambda c: c.value)
def test_begin_that_fills_a_batch_is_stored_once(db: str, tmp_path: Path, plugin: Plugin, core: CoreChoice) -> None:
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    log_dir = tmp_path / "log"
    capture(log_dir, db, plugin=plugin, core=core, transaction_metadata=True)  # the slot, the (empty) snapshot
    before = len(transactions(log_dir))
    last = FIRST_ROWS + SECOND_ROWS
    sql(db, f"INSERT INTO t SELECT g, 'first' FROM generate_series(1, {FIRST_ROWS}) g",
        f"INSERT INTO t SELECT g, 'second' FROM generate_series({FIRST_ROWS + 1}, {last}) g")  # fmt: skip

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", KILLED_CHILD, str(log_dir), db, plugin.value, core.value, str(BATCH_EVENTS)]
    killed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 17, killed.stderr[-3000:]
    # where the kill landed: the second transaction's BEGIN committed, none of its changes
    after_kill, at_kill = transactions(log_dir)[before:], stored_position(log_dir, db)
    assert [s for _, s in after_kill] == ["BEGIN", "END", "BEGIN"], (after_kill, at_kill)
    assert [e["after"]["v"] for e in events(log_dir, "cdc.public.t")] == ["first"] * FIRST_ROWS

    capture(log_dir, db, plugin=plugin, core=core, transaction_metadata=True)
    stored = transactions(log_dir)[before:]
    twice = [record for record, n in Counter(stored).items() if n > 1]
    assert not twice, f"stored twice: {twice} (position at the kill: {at_kill})"
    [(first, _), _, (second, _), _] = stored
    assert stored == [(first, "BEGIN"), (first, "END"), (second, "BEGIN"), (second, "END")]
    rows = [(e["after"]["id"], e["transaction"]["id"]) for e in events(log_dir, "cdc.public.t")]
    assert rows == [(i, first if i <= FIRST_ROWS else second) for i in range(1, last + 1)]
    ends = [t for t in events(log_dir, "cdc.transaction")[before:] if t["status"] == "END"]
    assert [e["event_count"] for e in ends] == [FIRST_ROWS, SECOND_ROWS]
