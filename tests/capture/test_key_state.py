"""The key state (capture.keystate): consistent with the log after crashes, rebuilt when it cannot be trusted,
and bounded: the connector's memory does not grow with the number of keys (10k vs 500k keys on a real Postgres;
1M under TIDELINE_SOAK=1).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from capture_util import drop_slots, events, fresh_database, latest_by_key, sql
from workload import soak

from capture.converters import JsonConverter
from capture.events import EventBuilder, ToastCache
from capture.keystate import TABLE_TOPIC, KeySet, KeyState, _run_chunks
from capture.sinks import TopicRecords, TopicSpec
from capture.sinks.embedded import EmbeddedLogSink
from capture.tables import TableColumn, TableFilter, TableInfo
from capture.topics import TopicRouter
from eventstore.log import Log
from tideline.pgharness import LocalPostgres

ROOT = Path(__file__).resolve().parents[2]
TOPIC = "cdc.public.t"


def interpret(topic: str, key: bytes | None, value: bytes | None) -> tuple[str, Any] | None:
    """Test records: value None → gone, b"big:<text>" → live with TOAST values, anything else → live."""
    if value is None:
        return ("delete", None)
    if value.startswith(b"big:"):
        return ("put", {"doc": value[4:].decode()})
    return ("put", None)


def write(
    sink: EmbeddedLogSink, state: KeyState, puts: dict[bytes, bytes | None], *, commit_state: bool = True
) -> None:
    """One log transaction of records, mirrored into the key state as the connector does."""
    sink.begin()
    state.begin()
    for key, value in puts.items():
        change = interpret(TOPIC, key, value)
        assert change is not None
        if change[0] == "put":
            state.put(TOPIC, key, change[1])
        else:
            state.delete(TOPIC, key)
    written = sink.append({TOPIC: TopicRecords(list(puts), list(puts.values()))})
    written |= sink.commit("__positions", None, None)  # the offsets not known at the append (the sink contract)
    if commit_state:
        state.commit(written)
    else:
        state.abort()  # as a crash between the log's commit and the key state's would leave it


def live(state: KeyState, topic: str = TOPIC) -> set[bytes]:
    """The topic's live keys as the key state holds them, ``keys`` ∪ (its runs' keys − ``dead``) (the module
    docstring), read from its SQLite tables and committed run files; this transaction's buffered changes are
    flushed into its SQLite transaction first, as every lookup does."""
    state.flush()
    row = state.db.execute("SELECT id FROM topics WHERE name = ?", (topic,)).fetchone()
    assert row is not None, f"{topic} is not tracked"
    tid = row[0]
    keys = {r[0] for r in state.db.execute("SELECT key FROM keys WHERE topic_id = ?", (tid,))}
    dead = {r[0] for r in state.db.execute("SELECT key FROM dead WHERE topic_id = ?", (tid,))}
    for (run_id,) in state.db.execute("SELECT id FROM runs WHERE topic_id = ?", (tid,)).fetchall():
        for offsets, data in _run_chunks(state.runs_dir / f"{run_id}.keys"):
            keys.update(k for a, b in pairwise(offsets.tolist()) if (k := data[a:b]) not in dead)
    return keys


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[EmbeddedLogSink]:
    with Log(tmp_path / "log") as log:
        s = EmbeddedLogSink(log)
        s.open("capture.test")
        s.ensure_topic(TOPIC, TopicSpec(compact=True, partitions=3))
        s.ensure_topic("__positions", TopicSpec(compact=True, partitions=1))
        yield s
        s.close()


def test_live_keys_toast_and_truncate(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    state = KeyState(tmp_path / "ks.sqlite")
    state.track(TOPIC, TABLE_TOPIC, sink.topic_incarnation(TOPIC))
    write(sink, state, {b"a": b"small", b"b": b"big:" + b"x" * 2000, b"c": b"small"})
    write(sink, state, {b"a": None})
    assert live(state) == {b"b", b"c"}
    assert state.toast(TOPIC, b"b") == {"doc": "x" * 2000} and state.toast(TOPIC, b"c") is None
    state.begin()
    state.put(TOPIC, b"d", None)  # seen by lookups before it is flushed or committed
    assert live(state) == {b"b", b"c", b"d"}
    state.truncate(TOPIC)
    assert live(state) == set()
    state.abort()  # the log transaction did not commit: the truncate never happened
    assert live(state) == {b"b", b"c"}
    state.close()


def test_crash_between_log_commit_and_state_commit_is_caught_up(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    state = KeyState(tmp_path / "ks.sqlite")
    state.track(TOPIC, TABLE_TOPIC, sink.topic_incarnation(TOPIC))
    write(sink, state, {b"a": b"small", b"b": b"small"})
    write(sink, state, {b"a": None, b"z": b"big:" + b"y" * 3000}, commit_state=False)  # lost with the crash
    state.close()
    reopened = KeyState(tmp_path / "ks.sqlite")
    reopened.track(TOPIC, TABLE_TOPIC, sink.topic_incarnation(TOPIC))
    assert live(reopened) == {b"a", b"b"}  # behind the log
    read = reopened.catch_up(sink, TOPIC, interpret)
    assert read == 2  # only what was appended after the checkpoints, not the whole topic
    assert live(reopened) == {b"b", b"z"} and reopened.toast(TOPIC, b"z") == {"doc": "y" * 3000}
    assert reopened.catch_up(sink, TOPIC, interpret) == 0  # idempotent
    reopened.close()


def test_aborted_log_transactions_never_count(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    state = KeyState(tmp_path / "ks.sqlite")
    state.track(TOPIC, TABLE_TOPIC, sink.topic_incarnation(TOPIC))
    sink.begin()
    sink.append({TOPIC: TopicRecords([b"ghost"], [b"small"])})
    sink.abort()
    write(sink, state, {b"real": b"small"}, commit_state=False)
    assert state.catch_up(sink, TOPIC, interpret) >= 1
    assert live(state) == {b"real"}
    state.close()


def test_unusable_or_foreign_state_is_rebuilt(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    path = tmp_path / "ks.sqlite"
    state = KeyState(path)
    state.track(TOPIC, TABLE_TOPIC, sink.topic_incarnation(TOPIC))
    write(sink, state, {b"a": b"small", b"b": b"small"})
    state.close()
    path.write_bytes(b"this is not an SQLite database" * 100)  # damaged
    rebuilt = KeyState(path)
    rebuilt.track(TOPIC, TABLE_TOPIC, sink.topic_incarnation(TOPIC))
    assert rebuilt.catch_up(sink, TOPIC, interpret) == 2 and live(rebuilt) == {b"a", b"b"}
    # the topic was deleted and created again (another incarnation): its old keys are forgotten
    rebuilt.track(TOPIC, TABLE_TOPIC, "another incarnation")
    assert live(rebuilt) == set()
    rebuilt.close()


def test_state_ahead_of_the_log_is_rebuilt(tmp_path: Path) -> None:
    """A key state whose checkpoints lie beyond the log's end belongs to another log: rebuilt from this one."""
    state = KeyState(tmp_path / "ks.sqlite")
    with Log(tmp_path / "big") as log:
        big = EmbeddedLogSink(log)
        big.open("capture.test")
        big.ensure_topic(TOPIC, TopicSpec(compact=True, partitions=1))
        big.ensure_topic("__positions", TopicSpec(compact=True, partitions=1))
        state.track(TOPIC, TABLE_TOPIC, big.topic_incarnation(TOPIC))
        for i in range(5):
            write(big, state, {b"k%d" % i: b"small"})
        big.close()
    with Log(tmp_path / "small") as log:
        small = EmbeddedLogSink(log)
        small.open("capture.test")
        small.ensure_topic(TOPIC, TopicSpec(compact=True, partitions=1))
        small.begin()
        small.append({TOPIC: TopicRecords([b"only"], [b"small"])})
        small.commit("__positions", None, None)
        state.track(TOPIC, TABLE_TOPIC, big.topic_incarnation(TOPIC))  # same incarnation text, other log
        state.catch_up(small, TOPIC, interpret)
        assert live(state) == {b"only"}
        small.close()
    state.close()


# ---------------------------------------------------------------------------- bounded memory, real Postgres

MEMORY_CHILD = r"""
import json, sys
from capture.connector import CaptureConfig, Connector
from eventstore.log import Log
with Log(sys.argv[1]) as log:
    config = CaptureConfig(dsn=sys.argv[2], slot="mem", topic_prefix="cdc", exit_when_caught_up=True,
                           batch_bytes=1 << 20, batch_events=5_000, key_state_cache_bytes=4 << 20)
    stats = Connector(config, log).run()
# VmHWM: this process's own peak. ru_maxrss is not: Linux carries the parent's peak RSS over fork/exec into it.
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"maxrss_kb": hwm, **stats.to_json()}))
"""
BIG_DOCS = 50


def run_child(log_dir: Path, dsn: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(log_dir), dsn], env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def key_workload(postgres: LocalPostgres, tmp_path: Path, keys: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``keys`` small rows + 50 TOASTed ones, snapshotted; then, with a cold cache, updates that leave the TOASTed
    column alone and a TRUNCATE (a tombstone per key). Returns both runs' peak RSS and stats."""
    dsn = fresh_database(postgres, f"keys{keys}")
    try:
        sql(dsn, "CREATE TABLE kv (id int PRIMARY KEY, n int, doc text)",
            "ALTER TABLE kv ALTER COLUMN doc SET STORAGE EXTERNAL",
            f"INSERT INTO kv SELECT g, 0, NULL FROM generate_series(1, {keys}) g",
            f"UPDATE kv SET doc = repeat(md5(id::text), 100) WHERE id <= {BIG_DOCS}")  # fmt: skip
        first = run_child(tmp_path / f"log{keys}", dsn)  # snapshot: every key into the key state
        sql(dsn, f"UPDATE kv SET n = n + 1 WHERE id <= {BIG_DOCS}", "TRUNCATE kv")
        second = run_child(tmp_path / f"log{keys}", dsn)  # a new process: its TOAST cache is empty
        updates = [e for e in events(tmp_path / f"log{keys}", "cdc.public.kv") if e["op"] == "u"]
        assert len(updates) == BIG_DOCS
        for e in updates:  # the docs are a function of the id (the table itself is truncated by now)
            expected = hashlib.md5(str(e["after"]["id"]).encode()).hexdigest() * 100
            assert e["after"]["doc"] == expected, "an unchanged TOAST value was not filled from the key state"
        assert latest_by_key(tmp_path / f"log{keys}", "cdc.public.kv") == {}  # the TRUNCATE removed every key
        return first, second
    finally:
        drop_slots(dsn)


BIG_KEYS = 1_000_000 if soak() else 500_000


def test_memory_does_not_grow_with_the_key_count(postgres: LocalPostgres, tmp_path: Path) -> None:
    small_first, small_second = key_workload(postgres, tmp_path, 10_000)
    big_first, big_second = key_workload(postgres, tmp_path, BIG_KEYS)
    assert big_second["events"] >= BIG_KEYS  # the TRUNCATE's tombstones went through this process
    # a restart finds the key state current: nothing is read back from the log
    assert small_second["key_state_caught_up"] == 0 and big_second["key_state_caught_up"] == 0
    # 50× (soak: 100×) the keys, with small configured bounds (1 MiB / 5,000-event batches, a 4 MiB key state
    # cache): peak RSS may differ by those and allocator noise, not by O(keys) (a Python set of 500k keys alone is
    # ~50 MB, of 1M ~100 MB)
    peaks = {name: run["maxrss_kb"] // 1024 for name, run in
             (("10k snapshot", small_first), (f"{BIG_KEYS:,} snapshot", big_first), ("10k restart", small_second),
              (f"{BIG_KEYS:,} restart", big_second))}  # fmt: skip
    print(f"peak RSS (MB): {peaks}")
    for small, big in ((small_first, big_first), (small_second, big_second)):
        grown_mb = (big["maxrss_kb"] - small["maxrss_kb"]) / 1024
        assert grown_mb < 40, f"peak RSS grew by {grown_mb:.0f} MB from 10k to {BIG_KEYS:,} keys: {peaks}"


# ---------------------------------------------------------------------------- key runs (bulk snapshot keys)


def write_run(sink: EmbeddedLogSink, state: KeyState, keys: list[bytes], *, commit_state: bool = True) -> None:
    """One log transaction of snapshot reads whose keys go to the key state in bulk, as native batches do."""
    sink.begin()
    state.begin()
    for start in range(0, len(keys), 1000):  # a chunk per batch
        state.put_run(TOPIC, pa.array(keys[start : start + 1000], pa.binary()))
    written = sink.append({TOPIC: TopicRecords(list(keys), [b"small"] * len(keys))})
    written |= sink.commit("__positions", None, None)
    if commit_state:
        state.commit(written)
    else:
        state.abort()


def run_files(path: Path) -> list[Path]:
    return sorted(Path(f"{path}.runs").glob("*.keys"))


def opened(path: Path, sink: EmbeddedLogSink) -> KeyState:
    state = KeyState(path)
    state.track(TOPIC, TABLE_TOPIC, sink.topic_incarnation(TOPIC))
    return state


def test_run_keys_are_live_until_deleted_and_a_truncate_ends_the_run(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    path = tmp_path / "ks.sqlite"
    state = opened(path, sink)
    keys = [b"k%05d" % i for i in range(2500)]
    write_run(sink, state, keys)
    assert len(run_files(path)) == 1 and state.db.execute("SELECT count(*) FROM keys").fetchone() == (0,)
    assert live(state) == set(keys)
    write(sink, state, {b"k00001": None, b"k00002": None, b"new": b"small"})
    write(sink, state, {b"k00002": b"big:" + b"z" * 2000})  # deleted, then back (with TOAST values)
    expected = (set(keys) - {b"k00001"}) | {b"new"}
    assert live(state) == expected
    assert state.toast(TOPIC, b"k00002") == {"doc": "z" * 2000}
    state.close()
    reopened = opened(path, sink)  # the run and its deletes survive a restart
    assert live(reopened) == expected
    reopened.begin()
    reopened.truncate(TOPIC)
    assert live(reopened) == set() and len(run_files(path)) == 1  # the file goes with the commit, not before
    reopened.abort()
    assert live(reopened) == expected
    reopened.begin()
    reopened.truncate(TOPIC)
    reopened.commit({})
    assert live(reopened) == set() and run_files(path) == []
    assert reopened.db.execute("SELECT count(*) FROM dead").fetchone() == (0,)
    reopened.close()


def test_an_aborted_or_crashed_run_leaves_nothing(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    path = tmp_path / "ks.sqlite"
    state = opened(path, sink)
    write_run(sink, state, [b"a", b"b"], commit_state=False)  # aborted: its file goes at once
    assert run_files(path) == [] and state.db.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    # a crash while a run is written: the file is there, SQLite never committed its row
    state.begin()
    state.put_run(TOPIC, pa.array([b"c", b"d"], pa.binary()))
    assert len(run_files(path)) == 1
    state.db.close()
    reopened = opened(path, sink)
    assert run_files(path) == [] and live(reopened) == set()  # the orphan was removed on open
    assert reopened.catch_up(sink, TOPIC, interpret) == 2  # the log's committed records (a, b) are what counts
    assert live(reopened) == {b"a", b"b"}
    reopened.close()


@pytest.mark.parametrize("damage", ["flip", "cut", "remove"])
def test_a_damaged_run_rebuilds_its_topic_from_the_log(
    sink: EmbeddedLogSink, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    path = tmp_path / "ks.sqlite"
    state = opened(path, sink)
    keys = [b"r%04d" % i for i in range(3000)]
    write_run(sink, state, keys)
    write(sink, state, {b"r0000": None})
    state.close()
    (run,) = run_files(path)
    raw = bytearray(run.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x40
        run.write_bytes(bytes(raw))
    elif damage == "cut":
        run.write_bytes(bytes(raw[:-3]))
    else:
        run.unlink()
    rebuilt = opened(path, sink)
    assert "rebuilding its topic's key state from the log" in caplog.text
    assert rebuilt.checkpoints(TOPIC) == {} and run_files(path) == []
    assert rebuilt.catch_up(sink, TOPIC, interpret) == 3001  # the whole topic, once
    assert live(rebuilt) == set(keys) - {b"r0000"}
    rebuilt.close()


def test_a_snapshot_taken_again_sets_the_run_keys_aside(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    """capture.recovery: keys live before a new snapshot that it does not read again are gone (runs included)."""
    path = tmp_path / "ks.sqlite"
    state = opened(path, sink)
    write_run(sink, state, [b"a", b"b", b"c", b"d"])
    write(sink, state, {b"d": None, b"e": b"small"})
    sink.begin()
    state.begin()
    assert state.set_aside(TOPIC) == 4  # a, b, c from the run, e from keys; d is dead
    assert run_files(path) != [] and live(state) == set()
    state.put_run(TOPIC, pa.array([b"a", b"c"], pa.binary()))  # the new snapshot reads a and c
    assert state.db.execute("SELECT count(*) FROM runs").fetchone() == (0,)  # compared in SQLite, not in a run
    assert sorted(k for c in state.gone_keys(TOPIC) for k in c) == [b"b", b"e"]
    state.forget_set_aside(TOPIC)
    written = sink.append({TOPIC: TopicRecords([b"a", b"c"], [b"small", b"small"])})
    sink.commit("__positions", None, None)
    state.commit(written)
    assert live(state) == {b"a", b"c"} and run_files(path) == []
    state.close()


def test_a_run_ended_in_a_transaction_never_lends_its_file_to_a_new_one(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    """Run ids are never given twice: ending the newest run and starting another in the same transaction (a
    TRUNCATE, or a snapshot taken again that reads a new table) leaves the new run's file in place, and an abort
    leaves the ended run's."""
    path = tmp_path / "ks.sqlite"
    state = opened(path, sink)
    other = "cdc.public.other"
    sink.ensure_topic(other, TopicSpec(compact=True, partitions=1))
    state.track(other, TABLE_TOPIC, sink.topic_incarnation(other))
    write_run(sink, state, [b"a1", b"a2"])
    for attempt in ("abort", "commit"):
        state.begin()
        state.truncate(TOPIC)  # ends the newest run...
        state.put_run(other, pa.array([b"o1", b"o2"], pa.binary()))  # ...and a new one starts
        if attempt == "abort":
            state.abort()
            assert live(state) == {b"a1", b"a2"}  # the ended run's file is still there
            assert len(run_files(path)) == 1
        else:
            state.commit({})
    assert live(state) == set() and live(state, other) == {b"o1", b"o2"}
    assert len(run_files(path)) == 1
    state.close()
    reopened = opened(path, sink)
    reopened.track(other, TABLE_TOPIC, sink.topic_incarnation(other))
    assert live(reopened, other) == {b"o1", b"o2"}
    # a run begun and ended in one transaction leaves no file, whatever its end
    reopened.begin()
    reopened.put_run(TOPIC, pa.array([b"x"], pa.binary()))
    reopened.truncate(TOPIC)
    reopened.abort()
    assert len(run_files(path)) == 1
    reopened.close()


def test_keys_of_a_table_whose_key_may_repeat_are_kept_once_each(tmp_path: Path) -> None:
    """Only a primary key or a unique replica identity index makes a run: a configured key (or a REPLICA IDENTITY
    FULL table's every column) may repeat, and SQLite keeps such keys once."""
    state = KeyState(tmp_path / "ks.sqlite")
    state.track(TOPIC, TABLE_TOPIC, None)
    builder = EventBuilder("cdc", "db", TableFilter(), TopicRouter("cdc"), JsonConverter(), ToastCache(1 << 20), state)
    columns = (TableColumn("id", "integer", 23),)
    state.begin()
    for source, keys in (("configured", [b"c", b"c"]), ("replica identity full", [b"f", b"f"]),
                         ("primary key", [b"p1", b"p2"])):  # fmt: skip
        table = TableInfo.make("public", "t", columns, ("id",), source, "d")
        builder.remember_read_keys(table, TOPIC, pa.array(keys, pa.binary()), {})
    state.commit({})
    assert live(state) == {b"c", b"f", b"p1", b"p2"}
    assert len(run_files(tmp_path / "ks.sqlite")) == 1  # the primary key's reads only
    state.close()


def key_set(keys: list[bytes]) -> KeySet:
    """A key set as the native core makes it (the keys back to back, ``start << 32 | length``, 1-based)."""
    spans, at = [], 1
    for k in keys:
        spans.append(at << 32 | len(k))
        at += len(k)
    return KeySet(b"".join(keys), json.dumps(spans))


def test_key_sets_apply_in_order_with_buffered_changes(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    """The native core's key sets (KeyState.put_sets): written by SQLite a set at a time, after the buffered
    changes (older), before later ones; kept in the log transaction's SQLite transaction (aborted with it,
    committed with it, read back after a reopen); deletes of a run's keys mark them dead."""
    path = tmp_path / "ks.sqlite"
    state = opened(path, sink)
    write_run(sink, state, [b"r1", b"r2", b"r3"])
    write(sink, state, {b"a": b"big:" + b"x" * 2000, b"b": b"small"})
    assert key_set([b"r1", b'{"id":7}']).keys() == [b"r1", b'{"id":7}']
    offsets = np.array([0, 2, 10], "<u4")  # the runs' chunks give their keys so (Arrow offsets)
    made, expected_set = KeySet.of_offsets(offsets, b'r1{"id":7}'), key_set([b"r1", b'{"id":7}'])
    assert made.data == expected_set.data and json.loads(made.spans) == json.loads(expected_set.spans)
    # a buffered put with TOAST values, then the key put small by a set: the set's (later) put wins
    state.begin()
    state.put(TOPIC, b"c", {"doc": "y" * 2000})
    state.put_sets(TOPIC, key_set([b"c", b"d", b"\x00\xff binary"]), key_set([b"a", b"r2", b"never there"]))
    assert state.toast(TOPIC, b"c") is None and state.toast(TOPIC, b"a") is None
    state.put(TOPIC, b"d", {"doc": "z" * 2000})  # a later buffered change wins over the set
    assert state.toast(TOPIC, b"d") == {"doc": "z" * 2000}
    expected = {b"b", b"c", b"d", b"\x00\xff binary", b"r1", b"r3"}
    assert live(state) == expected
    state.abort()  # the log transaction did not commit: neither did the sets
    assert live(state) == {b"a", b"b", b"r1", b"r2", b"r3"} and state.toast(TOPIC, b"a") == {"doc": "x" * 2000}
    state.begin()
    state.put_sets(TOPIC, key_set([b"c", b"d", b"\x00\xff binary"]), key_set([b"a", b"r2"]))
    state.put_sets(TOPIC, None, key_set([b"c"]))
    state.commit({})
    state.close()
    reopened = opened(path, sink)
    assert live(reopened) == {b"b", b"d", b"\x00\xff binary", b"r1", b"r3"}
    # every deleted key of a topic with runs is marked dead, as the buffered deletes are (r2 is a run's)
    assert reopened.db.execute("SELECT key FROM dead ORDER BY key").fetchall() == [(b"a",), (b"c",), (b"r2",)]
    reopened.close()


def test_a_truncate_lists_keys_in_key_order_whatever_holds_them(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    """A TRUNCATE's keys (KeyState.truncated_keys) come in key order, the same whether they were kept as runs
    (a snapshot's bulk reads, in read order) or as rows (the same keys caught up from the log after a crash):
    its tombstones are the same records either way. The runs are folded into rows inside the transaction."""
    keys = [b"k%05d" % ((i * 7919) % 3000) for i in range(3000)]  # read order is not key order
    path = tmp_path / "runs.sqlite"
    state = opened(path, sink)
    write_run(sink, state, keys[:1500])
    write_run(sink, state, keys[1500:])  # as rows (a topic with an earlier transaction's run): runs and rows mixed
    write(sink, state, {b"k00007": None, b"k00008": b"big:" + b"t" * 2000, b"zz": b"small"})
    expected = sorted((set(keys) - {b"k00007"}) | {b"zz"})
    state.begin()
    listed = [k for c in state.truncated_keys(TOPIC) for k in c]
    assert listed == expected
    assert state.toast(TOPIC, b"k00008") == {"doc": "t" * 2000}  # a row's TOAST values survive the fold
    state.abort()  # the fold is undone with the transaction: the runs are back
    assert len(run_files(path)) == 1 and live(state) == set(expected)
    state.begin()
    assert [k for c in state.truncated_keys(TOPIC) for k in c] == expected
    state.truncate(TOPIC)
    state.commit({})
    assert run_files(path) == [] and live(state) == set()
    state.close()
    rows = KeyState(tmp_path / "rows.sqlite")  # the same keys as rows: as catch_up rebuilds them
    rows.track(TOPIC, TABLE_TOPIC, sink.topic_incarnation(TOPIC))
    rows.begin()
    rows.put_many(TOPIC, keys, [None] * len(keys))
    rows.delete(TOPIC, b"k00007")
    rows.put(TOPIC, b"zz", None)
    assert [k for c in rows.truncated_keys(TOPIC) for k in c] == expected
    rows.abort()
    rows.close()


def committed_keys(path: Path) -> set[bytes]:
    """The keys of ``keys`` another connection sees: what the key state's SQLite has committed."""
    with sqlite3.connect(path) as other:
        return {r[0] for r in other.execute("SELECT key FROM keys")}


def test_a_held_transaction_keeps_the_next_batchs_key_sets_apart(sink: EmbeddedLogSink, tmp_path: Path) -> None:
    """KeyState.hold (the log's commit running behind while the next batch is decoded, capture.writer): the next
    batch's key sets are staged, not written into the SQLite transaction that waits for the log's commit;
    commit_held commits that transaction alone, then writes the staged sets into the next one; a lookup while
    held settles the commit first (the callback) and sees the staged sets; changes keep their order across the
    hold; an abort while held forgets both transactions."""
    path = tmp_path / "ks.sqlite"
    state = opened(path, sink)
    write(sink, state, {b"a": b"small", b"b": b"big:" + b"x" * 2000})
    settles: list[int] = []

    def settle() -> None:  # what LogWriter.settle does once the log's commit returned
        settles.append(1)
        state.commit_held({})

    # batch N puts c and deletes a, then commits behind; batch N+1 (decoded meanwhile) puts d and deletes c
    state.begin()
    state.put_sets(TOPIC, key_set([b"c"]), key_set([b"a"]))
    state.hold(settle)
    state.put_sets(TOPIC, key_set([b"d"]), key_set([b"c"]))
    assert settles == [] and committed_keys(path) == {b"a", b"b"}  # nothing waited, nothing committed
    state.commit_held({})  # N's log commit returned: N alone is committed
    assert committed_keys(path) == {b"b", b"c"}
    assert live(state) == {b"b", b"d"}  # N+1's sets are in the open transaction, after N's
    state.abort()  # N+1's log transaction failed
    assert live(state) == {b"b", b"c"} and committed_keys(path) == {b"b", b"c"}

    # a lookup while held settles first, then sees the staged sets
    state.begin()
    state.put_sets(TOPIC, key_set([b"e"]), None)
    state.hold(settle)
    state.put_sets(TOPIC, None, key_set([b"e"]))  # staged
    state.put_sets(TOPIC, key_set([b"f"]), None)  # staged
    state.put(TOPIC, b"f", {"doc": "later"})  # buffered: newer than the staged sets
    assert settles == []
    assert state.toast(TOPIC, b"b") == {"doc": "x" * 2000}
    assert settles == [1] and committed_keys(path) == {b"b", b"c", b"e"}
    assert state.toast(TOPIC, b"f") == {"doc": "later"}  # the buffered (later) put wins over the staged set
    state.commit({})
    assert committed_keys(path) == {b"b", b"c", b"f"}

    # a buffered change before a key set while held: the set waits for the commit (the change is older)
    state.begin()
    state.put_sets(TOPIC, key_set([b"g"]), None)
    state.hold(settle)
    state.put(TOPIC, b"h", {"doc": "big"})
    state.put_sets(TOPIC, key_set([b"h"]), None)  # later than the buffered put: wins, after settling
    assert settles == [1, 1] and state.toast(TOPIC, b"h") is None
    state.commit({})
    assert committed_keys(path) == {b"b", b"c", b"f", b"g", b"h"}

    # an abort while held (the log's commit failed): the held transaction and the staged sets are gone
    state.begin()
    state.put_sets(TOPIC, key_set([b"i"]), None)
    state.hold(settle)
    state.put_sets(TOPIC, key_set([b"j"]), None)
    state.abort()
    assert settles == [1, 1] and live(state) == {b"b", b"c", b"f", b"g", b"h"}
    state.close()
    reopened = opened(path, sink)
    assert live(reopened) == {b"b", b"c", b"f", b"g", b"h"}
    reopened.close()
