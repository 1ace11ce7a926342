"""The connector's key state: per captured topic, which keys are live and what a TOAST fill needs.

Three things need to know about keys already in the log, and none of them may read a
whole topic to find out (memory must stay O(batch), not O(topic) or O(keys)):

* an UPDATE whose unchanged TOASTed columns were omitted (wal2json) is filled from the
  key's latest row when the in-memory TOAST cache has forgotten it;
* a TRUNCATE is followed by a tombstone for every live key of the table's topic;
* a snapshot taken again (``always``, ``when_needed``) must not route outbox events that
  are already in the events topics (they are never compacted: a copy would stay);
* a snapshot taken over a topic that has live keys already (after a lost slot) deletes
  the keys whose rows are gone from the table (capture.recovery).

The key state is a **derived** store: everything in it can be rebuilt from the log, and
it is rebuilt idempotently (below). It is an SQLite database (Python's standard
library; a well-kept B-tree store with its own crash safety), so memory is bounded by
its page cache (``cache_bytes``) and a bounded write buffer, never by the key count.

File: ``<state dir>/<connector id>.keystate.sqlite`` (plus SQLite's ``-wal``/``-shm``
files; journal_mode WAL, synchronous NORMAL). Tables::

    meta(name TEXT PRIMARY KEY, value TEXT)          format_version = 1
    topics(id INTEGER PRIMARY KEY, name TEXT UNIQUE, kind TEXT, incarnation TEXT)
    checkpoints(topic_id, partition, next_offset)    every record of the partition below
                                                     next_offset is applied
    keys(topic_id, key BLOB, toast BLOB) WITHOUT ROWID
        a live key of a table topic; toast: the TOAST-able column values of its latest row
        when that row was big enough to be TOASTed (≥ 1 KiB of such values), else NULL.
        Stored as pickle (protocol 5) of a dict of capture's Python values, so that a
        value comes back exactly as the decoder produced it (Decimal digits, bytes, zones)
    streams(topic_id, stream_id BLOB, version INTEGER) WITHOUT ROWID
        outbox topics: the highest event version routed per stream
    runs(id INTEGER PRIMARY KEY AUTOINCREMENT, topic_id, keys INTEGER, bytes INTEGER)
        a **key run**: keys a snapshot read in bulk (native reader batches), live unless in
        ``dead``; stored in the file ``<state file>.runs/<id>.keys`` (below) — a SQLite row per
        key would cost 2.6 µs each, more than reading, encoding and appending the row together
    dead(topic_id, key BLOB) WITHOUT ROWID
        a key of one of the topic's runs that was deleted since (a later put of it goes to
        ``keys`` as usual, which wins); only written for topics with runs
    shapes(topic_id INTEGER PRIMARY KEY, shape TEXT)
        the table's columns at the stored position as capture.shapes tracks them (JSON, its
        format); meta's ``shape_sign`` is the last position where the stream showed that a table
        may have changed unseen (added without a format change: older files get the empty table;
        a topic caught up from the log gets the shape of its latest whole row image there:
        capture.writer)
    set_aside(topic_id, key BLOB) WITHOUT ROWID
        only inside the SQLite transaction of a snapshot: the topic's live keys from before
        the snapshot (moved out of ``keys``, which the snapshot's reads fill again). Those
        left in ``set_aside`` but not back in ``keys`` are gone from the table; emptied in
        the same transaction, so a committed file never holds rows here (a crash rolls it
        back with the rest; added without a format change: older files get the empty table)

A topic's live keys are ``keys`` ∪ (its runs' keys − ``dead``). A TRUNCATE lists them in key order, after
folding the runs into ``keys`` in its transaction, so its tombstones' order never depends on whether keys were
kept as runs or as rows (:meth:`KeyState.truncated_keys`). Run file byte layout
(little-endian): the 8-byte magic ``TLKRUN01``, then one chunk per batch::

    u32 count | u32 data_bytes | (count + 1) × u32 offsets (the first 0) | data | u32 CRC32C

(the CRC covers the chunk from ``count`` to the end of ``data``; the offsets are Arrow's, so a
chunk reads back without a Python object per key). File naming: ``<id>.keys``, ``id`` the
``runs`` row's (AUTOINCREMENT: an id is never given twice, so a file is never reused while an
ended run's is still to be deleted). Crash policy: a run's file is written while its log transaction is open and
fsynced (with its directory) before the SQLite commit that records its size; on open, a file
with no ``runs`` row is an orphan of a transaction that never committed and is deleted, and a
run whose file is missing, of another size, or fails a checksum makes its topic rebuilt from
the log (below). Runs end only with their topic's keys (TRUNCATE, a snapshot taken again,
a rebuild): their rows go in that transaction, their files after its commit.

Writes: the Python path's changes are buffered (:meth:`KeyState.put`, :meth:`KeyState.delete`,
deduplicated per key) and written a row per key (``executemany``: about 4 µs a key here, more than the
native core's whole path for the change); the native core's come as key sets
(:meth:`KeyState.put_sets`: the keys back to back and a JSON array of their spans), which SQLite
writes itself, a statement per set (``json_each`` and ``substr``: about 1.7 µs a key, no Python object
per key), after the buffered changes, which are older. Same tables, same transactions.

Consistency with the log: one SQLite transaction spans each log transaction. It begins
with the log's, receives the changes while events are built (buffered, deduplicated per
key, flushed in chunks — big snapshots stay O(chunk) in memory), and commits *after*
the log transaction committed, together with the new checkpoints (the next offsets the
sink reported per partition written). A crash in between rolls the SQLite transaction
back: the checkpoints then lie below the log's end, and :meth:`KeyState.catch_up` applies
the committed records from the checkpoint on (read_committed, so aborted records never
count). An aborted log transaction rolls the SQLite one back with it. When the log's commit runs in the
background while the next batch is decoded (capture.writer, Kafka), :meth:`KeyState.hold` keeps the next
batch's changes out of the SQLite transaction still waiting for it: the native core's key sets are staged in
memory and written after that commit, anything else that needs SQLite first waits for the log's commit.

Rebuild: a topic whose incarnation in the log differs from the stored one (deleted and
created again), a checkpoint beyond the log's end (the log was replaced), a file of
another format version, or a file SQLite cannot read → that topic (or the whole file)
is dropped and caught up from offset 0 — O(topic) once, never per event.

Thread-safety: none; owned by the connector thread (SQLite connection in that thread).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import sqlite3
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise, repeat
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import crc32c
import numpy as np
import pyarrow as pa

from capture.sinks import ReadBatch, Sink
from eventstore.fileio import fsync_dir

log = logging.getLogger("capture.keystate")

FORMAT_VERSION = "1"
WRITE_BUFFER_ENTRIES = 10_000  # buffered key changes before a flush into the open SQLite transaction
TRUNCATE_CHUNK = 5_000  # live keys handed out per chunk for a TRUNCATE's tombstones

TABLE_TOPIC = "table"
OUTBOX_TOPIC = "outbox"

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value TEXT)",
    "CREATE TABLE IF NOT EXISTS topics(id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, kind TEXT NOT NULL, "
    "incarnation TEXT)",
    "CREATE TABLE IF NOT EXISTS checkpoints(topic_id INTEGER NOT NULL, partition INTEGER NOT NULL, "
    "next_offset INTEGER NOT NULL, PRIMARY KEY(topic_id, partition)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS keys(topic_id INTEGER NOT NULL, key BLOB NOT NULL, toast BLOB, "
    "PRIMARY KEY(topic_id, key)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS streams(topic_id INTEGER NOT NULL, stream_id BLOB NOT NULL, version INTEGER NOT NULL, "
    "PRIMARY KEY(topic_id, stream_id)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS set_aside(topic_id INTEGER NOT NULL, key BLOB NOT NULL, "
    "PRIMARY KEY(topic_id, key)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS runs(id INTEGER PRIMARY KEY AUTOINCREMENT, topic_id INTEGER NOT NULL, "
    "keys INTEGER NOT NULL, bytes INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS dead(topic_id INTEGER NOT NULL, key BLOB NOT NULL, "
    "PRIMARY KEY(topic_id, key)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS shapes(topic_id INTEGER PRIMARY KEY, shape TEXT NOT NULL)",
)

RUN_MAGIC = b"TLKRUN01"
_CHUNK_HEAD = struct.Struct("<II")  # count, data_bytes
_CRC = struct.Struct("<I")

class KeySet(NamedTuple):
    """Keys as :meth:`KeyState.put_sets` writes them in one statement: ``data``, the keys back to back, and
    ``spans``, a JSON array with one integer per key, ``start << 32 | length`` (``start`` 1-based: SQLite's
    ``substr`` of a blob counts bytes from 1). The native core makes them (capture.native)."""

    data: bytes
    spans: str

    @classmethod
    def of_offsets(cls, offsets: np.ndarray[Any, Any], data: bytes) -> KeySet:
        """The keys of Arrow-style ``offsets`` (``count + 1`` ascending, the first 0) into ``data``."""
        starts = offsets[:-1].astype(np.int64)
        spans = ((starts + 1) << 32) | (offsets[1:].astype(np.int64) - starts)
        return cls(data, "[" + ",".join(map(str, spans.tolist())) + "]")

    def keys(self) -> list[bytes]:
        """The keys, one Python object each (checks and tests)."""
        return [self.data[(v >> 32) - 1 : (v >> 32) - 1 + (v & 0xFFFFFFFF)] for v in json.loads(self.spans)]


# a key set's keys, for SQL: ?2 the data, ?3 the spans
_SET_KEYS = "SELECT substr(?2, value >> 32, value & 4294967295) AS k FROM json_each(?3)"
# A put of a key that is live already: its row is rewritten only when what it keeps changes. An UPDATE's key
# (the usual put) is then a B-tree lookup, where INSERT OR REPLACE deleted and inserted the row: 0.34 µs a key
# against 0.67 (100,000 live keys put again; new keys cost the same, 0.5 µs).
_PUT_CONFLICT = "ON CONFLICT(topic_id, key) DO UPDATE SET toast = excluded.toast WHERE toast IS NOT excluded.toast"

_DELETE = object()  # buffered "this key is gone"
DELETE_MARKER = _DELETE  # what put_many takes for a deleted key (the native core passes it back)

# What catch-up learns from one record: ("put", toast values or None), ("delete", None),
# ("route", version) for outbox records, or None (nothing to record).
Change = tuple[str, Any] | None
Interpreter = Callable[[str, bytes | None, bytes | None], Change]


class KeyStateError(Exception):
    """The key state file cannot be used (it is then rebuilt from the log)."""


class KeyState:
    """Live keys, TOAST values of big rows, and routed outbox versions, per captured topic."""

    def __init__(self, path: Path, *, cache_bytes: int = 16 << 20) -> None:
        self.path = path
        self.runs_dir = Path(f"{path}.runs")
        self.cache_bytes = cache_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        self._held: Callable[[], object] | None = None  # hold(): settles the log commit in flight
        self._staged: list[tuple[int, KeySet | None, KeySet | None]] = []  # key sets given while held, in order
        try:
            self._db = self._open()
        except (sqlite3.DatabaseError, KeyStateError) as e:
            log.warning("capture: key state %s is unusable (%s): rebuilding it from the log", path, e)
            self._remove_files()
            self._db = self._open()
        self._ids: dict[str, int] = {row[1]: row[0] for row in self.db.execute("SELECT id, name FROM topics")}
        self._keys: dict[tuple[int, bytes], Any] = {}  # buffered: toast bytes | None | _DELETE
        self._streams: dict[tuple[int, bytes], int] = {}
        self._shapes: dict[int, str] = {}  # buffered: topic id → its shape (capture.shapes)
        self._meta: dict[str, str] = {}  # buffered meta values
        self._in_txn = False
        self._open_runs: dict[int, _OpenRun] = {}  # topic id → its run being written in this transaction
        self._doomed: list[int] = []  # runs ended in this transaction: their files go after its commit
        self._aside: set[int] = set()  # topics with keys set aside in this transaction (no runs: see put_run)
        self._run_topics = self._topics_with_runs()  # topics with committed runs (those in this transaction too)
        self._check_runs()
        self.records_caught_up = 0  # records read back from the log by catch_up (0 when the state was current)

    @property
    def db(self) -> sqlite3.Connection:
        """The SQLite connection; while :meth:`hold` is in force, the log commit in flight is settled first (a
        read or a write of this transaction needs the SQLite transaction before it committed)."""
        if self._held is not None:
            self._held()
        return self._db

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # rebuildable: a lost last transaction is caught up again
            # checkpoint the WAL every ~40 MB instead of ~4 MB: each checkpoint fsyncs, on the capture thread
            db.execute("PRAGMA wal_autocheckpoint=10000")
            db.execute(f"PRAGMA cache_size={-max(1024, self.cache_bytes // 1024)}")  # KiB when negative
            db.execute("PRAGMA temp_store=FILE")
            for statement in _SCHEMA:
                db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE name = 'format_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('format_version', ?)", (FORMAT_VERSION,))
            elif row[0] != FORMAT_VERSION:
                raise KeyStateError(f"format version {row[0]}, expected {FORMAT_VERSION}")
        except BaseException:
            db.close()
            raise
        return db

    def _remove_files(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                Path(f"{self.path}{suffix}").unlink()
        for file in self.runs_dir.glob("*.keys") if self.runs_dir.is_dir() else ():
            file.unlink()

    # ------------------------------------------------------------------ key runs (see the module docstring)

    def _run_file(self, run_id: int) -> Path:
        return self.runs_dir / f"{run_id}.keys"

    def _topics_with_runs(self) -> set[int]:
        return {int(row[0]) for row in self.db.execute("SELECT DISTINCT topic_id FROM runs")}

    def _check_runs(self) -> None:
        """On open: delete orphan run files; a run that is missing, of another size or damaged → its topic is
        rebuilt from the log (its state dropped: catch_up starts from offset 0)."""
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        rows = {int(r[0]): (int(r[1]), int(r[2])) for r in self.db.execute("SELECT id, topic_id, bytes FROM runs")}
        for file in self.runs_dir.glob("*.keys"):
            if not file.stem.isdigit() or int(file.stem) not in rows:
                log.info("capture: key state: removing %s (a key run no committed transaction recorded)", file)
                file.unlink()
        broken: set[int] = set()
        for run_id, (tid, size) in rows.items():
            problem = _run_problem(self._run_file(run_id), size)
            if problem is not None:
                log.warning("capture: key state: %s: rebuilding its topic's key state from the log", problem)
                broken.add(tid)
        for tid in broken:
            self._drop(tid)

    def _end_runs(self, tid: int) -> None:
        """The topic's runs end (their keys are gone or moved), inside the open transaction: rows now, committed
        files after the commit; a run begun in this transaction (no commit ever refers to it) at once."""
        assert self.db.in_transaction
        open_run = self._open_runs.pop(tid, None)
        if open_run is not None:
            open_run.file.close()
            self._unlink_runs([open_run.id])
        ids = [int(r[0]) for r in self.db.execute("SELECT id FROM runs WHERE topic_id = ?", (tid,))]
        self.db.execute("DELETE FROM runs WHERE topic_id = ?", (tid,))
        self.db.execute("DELETE FROM dead WHERE topic_id = ?", (tid,))
        self._run_topics.discard(tid)
        self._doomed.extend(i for i in ids if open_run is None or i != open_run.id)

    def _unlink_runs(self, ids: list[int]) -> None:
        for run_id in ids:
            with contextlib.suppress(FileNotFoundError):
                self._run_file(run_id).unlink()

    def _run_chunk_buffers(self, tid: int) -> Iterator[tuple[np.ndarray[Any, Any], bytes]]:
        """The chunks of the topic's runs as ``(offsets, data)``, in the order they were written."""
        open_run = self._open_runs.get(tid)
        if open_run is not None:
            open_run.file.flush()  # what this transaction wrote of it so far is read back too
        for (run_id,) in self.db.execute("SELECT id FROM runs WHERE topic_id = ? ORDER BY id", (tid,)).fetchall():
            yield from _run_chunks(self._run_file(int(run_id)))

    def _run_keys(self, tid: int) -> Iterator[list[bytes]]:
        """The keys of the topic's runs, a chunk (one snapshot batch) at a time, in the order they were read."""
        for offsets, data in self._run_chunk_buffers(tid):
            o = offsets.tolist()
            yield [data[a:b] for a, b in pairwise(o)]

    def _fold_runs(self, tid: int) -> None:
        """The topic's live run keys become rows of ``keys`` (a row there already wins: a later change, perhaps
        with TOAST values) and its runs end, inside the open transaction (rolled back with it): SQLite writes
        each chunk's keys itself (a key set's statement, the spans made from the chunk's offsets)."""
        for offsets, data in self._run_chunk_buffers(tid):
            if len(offsets) < 2:
                continue
            self.db.execute(f"INSERT OR IGNORE INTO keys SELECT ?1, k, NULL FROM ({_SET_KEYS}) "
                            "WHERE k NOT IN (SELECT key FROM dead WHERE topic_id = ?1)",
                            (tid, *KeySet.of_offsets(offsets, data)))  # fmt: skip
        self._end_runs(tid)

    def close(self) -> None:
        self._held = None
        if self._in_txn:
            self.abort()
        self._db.close()

    # ------------------------------------------------------------------ topics

    def track(self, topic: str, kind: str, incarnation: str | None) -> int:
        """Register a topic; one whose incarnation changed (deleted and created again) starts empty."""
        row = self.db.execute("SELECT id, kind, incarnation FROM topics WHERE name = ?", (topic,)).fetchone()
        if row is not None and (row[1] != kind or row[2] != incarnation):
            log.info("capture: key state of %s is from another incarnation of the topic: rebuilding it", topic)
            self._drop(row[0])
            row = None
        if row is None:
            cur = self.db.execute(
                "INSERT INTO topics(name, kind, incarnation) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET kind = excluded.kind, incarnation = excluded.incarnation "
                "RETURNING id",
                (topic, kind, incarnation),
            )
            self._ids[topic] = int(cur.fetchone()[0])
        else:
            self._ids[topic] = int(row[0])
        return self._ids[topic]

    def tracked(self) -> dict[str, str]:
        """Every tracked topic and its kind."""
        return {name: kind for name, kind in self.db.execute("SELECT name, kind FROM topics")}

    def _drop(self, topic_id: int) -> None:
        """Forget everything of a topic (it is caught up from offset 0 next): in the open transaction, or in one
        of its own (on open, or when ``track`` finds another incarnation)."""
        own = not self.db.in_transaction
        if own:
            self.db.execute("BEGIN")
        try:
            for table in ("checkpoints", "keys", "streams", "set_aside", "shapes"):
                self.db.execute(f"DELETE FROM {table} WHERE topic_id = ?", (topic_id,))
            self._end_runs(topic_id)
            if own:
                self.db.execute("COMMIT")
        except BaseException:
            if own and self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise
        if own:
            self._unlink_runs(self._doomed)
            self._doomed.clear()

    def is_tracked(self, topic: str) -> bool:
        return topic in self._ids

    def _id(self, topic: str) -> int:
        found = self._ids.get(topic)
        if found is None:
            raise KeyError(f"key state: topic {topic} is not tracked")
        return found

    def checkpoints(self, topic: str) -> dict[int, int]:
        return {
            p: o
            for p, o in self.db.execute(
                "SELECT partition, next_offset FROM checkpoints WHERE topic_id = ?", (self._id(topic),)
            )
        }

    # ------------------------------------------------------------------ one transaction

    def begin(self) -> None:
        db = self.db  # first: settling a held commit may begin the next transaction (commit_held)
        if not self._in_txn:
            db.execute("BEGIN")
            self._in_txn = True

    def put(self, topic: str, key: bytes, toast: dict[str, Any] | None) -> None:
        """The key is live; ``toast``: its big row's TOAST-able values (None: small row, nothing to keep)."""
        self._keys[(self._id(topic), key)] = None if toast is None else pickle.dumps(toast, protocol=5)
        if len(self._keys) >= WRITE_BUFFER_ENTRIES:
            self.flush()

    def delete(self, topic: str, key: bytes) -> None:
        self._keys[(self._id(topic), key)] = _DELETE
        if len(self._keys) >= WRITE_BUFFER_ENTRIES:
            self.flush()

    def put_many(self, topic: str, keys: list[bytes], values: list[Any]) -> None:
        """:meth:`put` (``None``: a small row) or :meth:`delete` (``DELETE_MARKER``) of many keys, in order."""
        tid = self._id(topic)
        self._keys.update(zip(zip(repeat(tid), keys), values, strict=True))
        if len(self._keys) >= WRITE_BUFFER_ENTRIES:
            self.flush()

    def put_sets(self, topic: str, puts: KeySet | None, deletes: KeySet | None) -> None:
        """:meth:`put` (small rows: nothing to keep) of the keys in ``puts`` and :meth:`delete` of those in
        ``deletes``, written into the open SQLite transaction by SQLite itself, a statement per set: no Python
        object and no bound row per key (the native core's changes, capture.native: a row each would cost
        more than the change's whole native path). Each key in at most one of the two sets (the last change
        of each key); the buffered changes are older, and go first."""
        tid = self._id(topic)
        if self._held is not None and not self._keys:  # nothing buffered is older: staged, no wait (hold)
            self._staged.append((tid, puts, deletes))
            return
        self.flush()  # (begins the SQLite transaction)
        self._write_sets(tid, puts, deletes)

    def _write_sets(self, tid: int, puts: KeySet | None, deletes: KeySet | None) -> None:
        if deletes is not None:
            self.db.execute(f"DELETE FROM keys WHERE topic_id = ?1 AND key IN ({_SET_KEYS})", (tid, *deletes))
            if tid in self._run_topics:
                self.db.execute(f"INSERT OR IGNORE INTO dead SELECT ?1, k FROM ({_SET_KEYS})", (tid, *deletes))
        if puts is not None:  # a key already live with nothing kept is left as it is: no row rewritten
            self.db.execute(f"INSERT INTO keys SELECT ?1, k, NULL FROM ({_SET_KEYS}) WHERE true {_PUT_CONFLICT}",
                            (tid, *puts))  # fmt: skip

    def put_run(self, topic: str, keys: pa.Array) -> None:
        """Keys a snapshot read, live now (small rows: nothing to keep for a TOAST fill), in bulk: appended to
        the topic's key run of this transaction (the module docstring), not a SQLite row per key.

        For the keys of one snapshot's reads of a table whose key is unique (a primary key or a unique replica
        identity index: a run keeps no key twice), each read once, nothing else of them in the same transaction.
        A topic with keys set aside (a snapshot taken again: capture.recovery compares them in SQLite) or
        with runs of earlier transactions takes them as :meth:`put_many` does."""
        tid = self._id(topic)
        parts = _arrow_binary(keys)
        if parts is None or tid in self._aside or (tid in self._run_topics and tid not in self._open_runs):
            self.put_many(topic, keys.to_pylist(), [None] * len(keys))
            return
        self.begin()
        run = self._open_runs.get(tid)
        if run is None:
            run_id = int(self.db.execute("INSERT INTO runs(topic_id, keys, bytes) VALUES (?, 0, 0) RETURNING id",
                                         (tid,)).fetchone()[0])  # fmt: skip
            file = open(self._run_file(run_id), "wb")  # noqa: SIM115 - closed at commit or abort
            file.write(RUN_MAGIC)
            run = self._open_runs[tid] = _OpenRun(run_id, file, 0, len(RUN_MAGIC))
            self._run_topics.add(tid)
        offsets, data = parts
        head = _CHUNK_HEAD.pack(len(keys), len(data))
        crc = crc32c.crc32c(data, crc32c.crc32c(offsets, crc32c.crc32c(head)))
        run.file.write(head)
        run.file.write(offsets)
        run.file.write(data)
        run.file.write(_CRC.pack(crc))
        run.keys += len(keys)
        run.bytes += len(head) + len(offsets) + len(data) + _CRC.size

    def route(self, topic: str, stream_id: bytes, version: int) -> None:
        k = (self._id(topic), stream_id)
        if version > self._streams.get(k, -1):
            self._streams[k] = version
        if len(self._streams) >= WRITE_BUFFER_ENTRIES:
            self.flush()

    def put_shape(self, topic: str, shape: str) -> None:
        """The table's shape (capture.shapes, as text) at the position this transaction stores."""
        self._shapes[self._id(topic)] = shape

    def put_meta(self, name: str, value: str) -> None:
        """A value of ``meta`` as of the position this transaction stores."""
        self._meta[name] = value

    def shape(self, topic: str) -> str | None:
        """The topic's stored shape (this transaction's included); None: none, or the topic is not tracked."""
        tid = self._ids.get(topic)
        if tid is None:
            return None
        if tid in self._shapes:
            return self._shapes[tid]
        row = self.db.execute("SELECT shape FROM shapes WHERE topic_id = ?", (tid,)).fetchone()
        return None if row is None else str(row[0])

    def meta(self, name: str) -> str | None:
        """A value of ``meta`` (this transaction's included)."""
        if name in self._meta:
            return self._meta[name]
        row = self.db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else str(row[0])

    def flush(self) -> None:
        """Write the buffered changes into the open SQLite transaction (seen by this connection's reads)."""
        self.begin()
        if self._keys:
            puts = [(t, k, v) for (t, k), v in self._keys.items() if v is not _DELETE]
            deletes = [(t, k) for (t, k), v in self._keys.items() if v is _DELETE]
            self._keys.clear()
            if puts:
                self.db.executemany(f"INSERT INTO keys VALUES (?, ?, ?) {_PUT_CONFLICT}", puts)
            if deletes:
                self.db.executemany("DELETE FROM keys WHERE topic_id = ? AND key = ?", deletes)
                in_runs = [d for d in deletes if d[0] in self._run_topics]
                if in_runs:
                    self.db.executemany("INSERT OR IGNORE INTO dead VALUES (?, ?)", in_runs)
        if self._streams:
            self.db.executemany(
                "INSERT INTO streams VALUES (?, ?, ?) ON CONFLICT(topic_id, stream_id) "
                "DO UPDATE SET version = max(version, excluded.version)",
                [(t, s, v) for (t, s), v in self._streams.items()],
            )
            self._streams.clear()
        if self._shapes:
            self.db.executemany("INSERT OR REPLACE INTO shapes VALUES (?, ?)", list(self._shapes.items()))
            self._shapes.clear()
        if self._meta:
            self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", list(self._meta.items()))
            self._meta.clear()

    def hold(self, settle: Callable[[], object]) -> None:
        """The open transaction's changes are all given (and flushed) and its log transaction is committing in the
        background: until :meth:`commit_held` (or :meth:`abort`), the next transaction's changes are kept apart.
        Key sets (:meth:`put_sets`, the native core's) are staged in memory; the other writes are buffered as
        always and flushed into the next SQLite transaction. Anything that needs SQLite meanwhile (a lookup, a
        flush) calls ``settle`` first, which waits for the log's commit and calls :meth:`commit_held`."""
        self.flush()
        self._held = settle

    def commit_held(self, written: dict[tuple[str, int], int]) -> None:
        """After the held transaction's log transaction committed: :meth:`commit` of what :meth:`hold` kept, then
        the staged key sets (older than anything buffered since) begin the next SQLite transaction."""
        self._held = None
        self.begin()
        self._commit(written)
        staged, self._staged = self._staged, []
        if staged:
            self.begin()
            for tid, puts, deletes in staged:
                self._write_sets(tid, puts, deletes)

    def commit(self, written: dict[tuple[str, int], int]) -> None:
        """After the log transaction committed: its changes and the new checkpoints, in one SQLite commit."""
        self.flush()
        self._commit(written)

    def _commit(self, written: dict[tuple[str, int], int]) -> None:
        rows = [(self._ids[t], p, o) for (t, p), o in written.items() if t in self._ids]
        if rows:
            self.db.executemany(
                "INSERT INTO checkpoints VALUES (?, ?, ?) ON CONFLICT(topic_id, partition) "
                "DO UPDATE SET next_offset = max(next_offset, excluded.next_offset)",
                rows,
            )
        for run in self._open_runs.values():  # durable before the commit that records them
            run.file.flush()
            os.fsync(run.file.fileno())
            run.file.close()
            self.db.execute("UPDATE runs SET keys = ?, bytes = ? WHERE id = ?", (run.keys, run.bytes, run.id))
        if self._open_runs:
            fsync_dir(self.runs_dir)
        self._open_runs.clear()
        self.db.execute("COMMIT")
        self._in_txn = False
        self._aside.clear()
        self._unlink_runs(self._doomed)
        self._doomed.clear()

    def abort(self) -> None:
        """The log transaction was aborted (or its outcome is unknown): forget its changes (and, when held, the
        next transaction's)."""
        self._held = None
        self._staged.clear()
        self._keys.clear()
        self._streams.clear()
        self._shapes.clear()
        self._meta.clear()
        for run in self._open_runs.values():
            run.file.close()
        self._unlink_runs([run.id for run in self._open_runs.values()])
        self._open_runs.clear()
        self._doomed.clear()
        self._aside.clear()
        if self._in_txn:
            if self.db.in_transaction:  # SQLite rolls back by itself after some errors (a full disk)
                self.db.execute("ROLLBACK")
            self._in_txn = False
            # a topic first tracked inside the transaction is not tracked any more
            self._ids = {row[1]: row[0] for row in self.db.execute("SELECT id, name FROM topics")}
        self._run_topics = self._topics_with_runs()

    # ------------------------------------------------------------------ lookups (see buffered writes)

    def toast(self, topic: str, key: bytes) -> dict[str, Any] | None:
        """The TOAST-able values of the key's latest row, if it was big; None when unknown."""
        tid = self._id(topic)
        buffered = self._keys.get((tid, key), _DELETE)
        if buffered is not _DELETE:
            return None if buffered is None else _unpickle(buffered)
        if (tid, key) in self._keys:
            return None  # deleted in this transaction
        row = self.db.execute("SELECT toast FROM keys WHERE topic_id = ? AND key = ?", (tid, key)).fetchone()
        return None if row is None or row[0] is None else _unpickle(row[0])

    def truncated_keys(self, topic: str) -> Iterator[list[bytes]]:
        """For a TRUNCATE's tombstones: the topic's live keys in key order (bytewise), in chunks, this
        transaction's changes included; :meth:`truncate` follows.

        The order is the keys' own, whatever holds them: the tombstones come out in the same order whether the
        keys were kept as runs (a snapshot's bulk reads) or as rows (the same reads caught up from the log after
        a crash). So the topic's runs are folded into rows first, ending them, inside the open transaction
        (:meth:`_fold_runs`)."""
        self.flush()
        tid = self._id(topic)
        if tid in self._run_topics:
            self._fold_runs(tid)
        yield from self._key_chunks("SELECT key FROM keys WHERE topic_id = ? AND key > ? ORDER BY key LIMIT ?", tid)

    def _key_chunks(self, query: str, tid: int) -> Iterator[list[bytes]]:
        """``query``'s keys (parameters: topic id, the last key seen, a chunk size), chunk after chunk."""
        after = b""
        while True:
            chunk = [r[0] for r in self.db.execute(query, (tid, after, TRUNCATE_CHUNK))]
            if not chunk:
                return
            yield chunk
            after = chunk[-1]

    def truncate(self, topic: str) -> None:
        """Every key of the topic is gone (after the TRUNCATE's tombstones were built)."""
        self.flush()
        tid = self._id(topic)
        self.db.execute("DELETE FROM keys WHERE topic_id = ?", (tid,))
        self._end_runs(tid)

    # ------------------------------------------------------------------ a snapshot over live keys

    def set_aside(self, topic: str) -> int:
        """Before a snapshot reads the topic's table: move its live keys aside (see the module docstring);
        the number moved. Inside the snapshot's transaction."""
        self.flush()
        tid = self._id(topic)
        self.db.execute("DELETE FROM set_aside WHERE topic_id = ?", (tid,))
        if tid in self._run_topics:  # the runs' live keys join them (compared in SQLite: see put_run)
            for chunk in self._run_keys(tid):
                self.db.executemany("INSERT OR IGNORE INTO set_aside VALUES (?, ?)", zip(repeat(tid), chunk))
            self.db.execute("DELETE FROM set_aside WHERE topic_id = ? AND key IN (SELECT key FROM dead WHERE "
                            "topic_id = ?)", (tid, tid))  # fmt: skip
            self._end_runs(tid)
        self.db.execute("INSERT OR IGNORE INTO set_aside SELECT topic_id, key FROM keys WHERE topic_id = ?", (tid,))
        self.db.execute("DELETE FROM keys WHERE topic_id = ?", (tid,))
        moved = int(self.db.execute("SELECT count(*) FROM set_aside WHERE topic_id = ?", (tid,)).fetchone()[0])
        if moved:
            self._aside.add(tid)
        return moved

    def gone_keys(self, topic: str) -> Iterator[list[bytes]]:
        """After the snapshot's reads: the set-aside keys the snapshot did not read again, in chunks (key order)."""
        self.flush()
        yield from self._key_chunks(
            "SELECT s.key FROM set_aside s WHERE s.topic_id = ? AND s.key > ? AND NOT EXISTS "
            "(SELECT 1 FROM keys k WHERE k.topic_id = s.topic_id AND k.key = s.key) ORDER BY s.key LIMIT ?",
            self._id(topic),
        )

    def forget_set_aside(self, topic: str) -> None:
        """The snapshot's deletes are built: nothing stays aside."""
        self.db.execute("DELETE FROM set_aside WHERE topic_id = ?", (self._id(topic),))

    def routed_version(self, topic: str, stream_id: bytes) -> int | None:
        """The highest version of ``stream_id`` routed to ``topic`` (None: none)."""
        tid = self._id(topic)
        buffered = self._streams.get((tid, stream_id))
        row = self.db.execute(
            "SELECT version FROM streams WHERE topic_id = ? AND stream_id = ?", (tid, stream_id)
        ).fetchone()
        stored = None if row is None else int(row[0])
        if buffered is None:
            return stored
        return buffered if stored is None else max(stored, buffered)

    # ------------------------------------------------------------------ rebuilding from the log

    def catch_up(self, sink: Sink, topic: str, interpret: Interpreter) -> int:
        """Apply the topic's committed records after the stored checkpoints; the number of records read.

        Outside a transaction it commits per partition; inside one (a topic first seen while
        a log transaction is open) its changes and checkpoints join that transaction.
        """
        own = not self._in_txn
        self.begin()
        ends = sink.end_offsets(topic)
        checkpoints = self.checkpoints(topic)
        if any(checkpoints.get(p, 0) > end for p, end in ends.items()) or set(checkpoints) - set(ends):
            log.warning("capture: key state of %s is ahead of the log (was the log replaced?): rebuilding it", topic)
            self._drop(self._id(topic))
            checkpoints = {}
        read = 0
        tid = self._id(topic)
        for partition, end in sorted(ends.items()):
            start = checkpoints.get(partition, 0)
            if start >= end:
                continue
            for batch in sink.read(topic, partition, start, end):
                read += len(batch.offsets)
                self._apply(topic, batch, interpret)
            self.flush()
            self.db.execute(
                "INSERT INTO checkpoints VALUES (?, ?, ?) ON CONFLICT(topic_id, partition) "
                "DO UPDATE SET next_offset = excluded.next_offset",
                (tid, partition, end),
            )
        if own:
            self.commit({})
        self.records_caught_up += read
        if read:
            log.info("capture: key state of %s caught up over %d records", topic, read)
        return read

    def _apply(self, topic: str, batch: ReadBatch, interpret: Interpreter) -> None:
        for key, value in zip(batch.keys, batch.values, strict=True):
            if key is None:
                continue
            change = interpret(topic, key, value)
            if change is None:
                continue
            what, arg = change
            if what == "put":
                self.put(topic, key, arg)
            elif what == "delete":
                self.delete(topic, key)
            elif what == "route":
                self.route(topic, key, int(arg))


@dataclass(slots=True)
class _OpenRun:
    id: int
    file: BinaryIO
    keys: int
    bytes: int


def _arrow_binary(keys: pa.Array) -> tuple[bytes, memoryview] | None:
    """A binary array without nulls as a run chunk's ``(offsets, data)``, the data not copied (None: it has nulls)."""
    if keys.null_count or not pa.types.is_binary(keys.type):
        return None
    _, offsets_buf, data_buf = keys.buffers()
    offsets = np.frombuffer(offsets_buf, "<i4", count=len(keys) + 1, offset=4 * keys.offset)
    first, end = int(offsets[0]), int(offsets[-1])
    data = memoryview(b"") if data_buf is None else memoryview(data_buf)[first:end]
    return (offsets - first).astype("<u4").tobytes(), data


def _run_chunks(path: Path) -> Iterator[tuple[np.ndarray[Any, Any], bytes]]:
    """A run file's chunks as ``(offsets, data)``; :class:`KeyStateError` when it is damaged."""
    with open(path, "rb") as f:
        if f.read(len(RUN_MAGIC)) != RUN_MAGIC:
            raise KeyStateError(f"key run {path}: not a key run (bad magic)")
        while head := f.read(_CHUNK_HEAD.size):
            if len(head) < _CHUNK_HEAD.size:
                raise KeyStateError(f"key run {path}: cut short in a chunk header")
            count, size = _CHUNK_HEAD.unpack(head)
            offsets_raw = f.read(4 * (count + 1))
            data = f.read(size)
            crc = f.read(_CRC.size)
            if len(offsets_raw) != 4 * (count + 1) or len(data) != size or len(crc) != _CRC.size:
                raise KeyStateError(f"key run {path}: cut short in a chunk")
            if crc32c.crc32c(data, crc32c.crc32c(offsets_raw, crc32c.crc32c(head))) != _CRC.unpack(crc)[0]:
                raise KeyStateError(f"key run {path}: a chunk fails its checksum")
            offsets = np.frombuffer(offsets_raw, "<u4")
            if offsets[0] != 0 or offsets[-1] != size or (np.diff(offsets.astype(np.int64)) < 0).any():
                raise KeyStateError(f"key run {path}: a chunk's offsets do not fit its data")
            yield offsets, data


def _run_problem(path: Path, size: int) -> str | None:
    """What is wrong with a committed run's file (None: nothing)."""
    try:
        actual = path.stat().st_size
        if actual != size:
            return f"key run {path} is {actual} bytes, its commit recorded {size}"
        for _ in _run_chunks(path):
            pass
    except FileNotFoundError:
        return f"key run {path} is missing"
    except KeyStateError as e:
        return str(e)
    return None


def _unpickle(raw: bytes) -> dict[str, Any]:
    values = pickle.loads(raw)  # written by this module only (the file is the connector's own state)
    if not isinstance(values, dict):
        raise KeyStateError(f"a stored TOAST entry is a {type(values).__name__}, not a dict")
    return values
