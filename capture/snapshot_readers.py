"""Snapshot reader processes: one big table read in ctid ranges by several connections sharing one snapshot.

With ``--snapshot-workers N`` (N > 1) the initial snapshot (capture.snapshot) starts N reader
**processes**: ``python -m capture.snapshot_readers``, each in a session of its own (a fresh
interpreter rather than a fork — the connector has threads — that imports only what a reader
needs, never the connector's main module; and out of reach of a Ctrl-C meant for the connector).
Each opens its own connection in ``REPEATABLE READ, READ ONLY`` and imports the slot's exported
snapshot (``SET TRANSACTION SNAPSHOT``): every reader sees the table as of the slot's
consistent point. The export stays valid while the replication connection that created the
slot sits idle in its transaction; the connector sends it nothing until the snapshot is done
(capture.replication, ``START_REPLICATION`` comes after).

**Ranges.** A table of at least ``2 × MIN_RANGE_BLOCKS`` heap blocks is split by block number
into up to ``RANGES_PER_WORKER × N`` equal ranges, read as PostgreSQL 14+ TID range scans
(``WHERE ctid >= '(b0,0)'::tid AND ctid < '(b1,0)'::tid``; the last range is open-ended, so
pages added after the size was taken are covered too — their rows are invisible to the
snapshot anyway). ctid rather than the primary key: it works for keyless tables, needs no
index or key statistics to split evenly, and reads the heap sequentially, block by block,
as COPY does. Ranges are handed out two at a time per reader, the next when one is done, so
a slow reader does not hold the others back.

**Work split.** A reader converts its rows into record keys and values (or their ``after`` images);
the connector only finishes and appends them, with the key state updates, to its one log transaction.
Batches arrive in whatever order the readers finish them: the snapshot reads each key once,
so per-key order needs no order between ranges (streamed changes follow the snapshot's
commit). What a batch cannot know is decided by the connector:

* ``source.event_index`` — numbered in the order the connector appends reads (unique and
  dense, 0…rows−1 as the single reader's); a reader sends each value cut where the index's
  digits go (``head``, ``tail``), the connector joins ``head + digits + tail``;
* ``source.snapshot`` markers — a batch's first and last rows come as rows (not encoded),
  so the connector builds them with their marker (first / first_in_data_collection /
  last_in_data_collection / last) as the single reader would; the rows between are never a
  table's first or last and carry ``"true"``.

**Native** (the usual case: ``ReaderSpec.native``, the extension built, no excluded or masked
columns, every column of a natively converted type — :func:`native_encoder`): the reader reads
its range with ``COPY (SELECT …) TO STDOUT``, and the compiled ``SnapshotEncoder``
(native/src/snapshot.rs) reads each batch's lines itself with libpq's ``PQgetCopyData`` on
psycopg's connection (:func:`read_copy`: no Python object per line, no GIL; the functions of the
libpq psycopg uses are found by :func:`libpq_copy_functions`, else the lines come through
psycopg's low-level copy calls, :func:`copy_lines`, one Python object each) and writes the
``after`` images and record keys of the rows between the first and the last as Arrow binary
buffers; rows it does not convert
(an unusual form of a value, a row big enough to be TOASTed) are encoded by the Python path
(:func:`copy_row_columns` → ``EventEncoder``) and put in their place. Such a batch is a
:class:`NativeBatch`; the connector joins each image into a whole envelope with its event index
in compiled code (``splice_reads``) and appends the buffers as Arrow arrays, and the keys go to
the key state in bulk (capture.keystate's key runs). Otherwise a reader takes the Python path:
a server-side cursor, ``result_rows`` and ``EventEncoder`` per row (:class:`RangeBatch`). Both
give the same bytes (tests/capture/test_native_snapshot.py). A reader process runs with the
cyclic garbage collector off (see :func:`_process_main`) and a pipe widened to hold a batch.

**Wire format** (the reader's stdin and stdout, as ``multiprocessing.connection.Connection``
messages: a 4-byte length, then a pickle, protocol 5 — bytes and lists of bytes, not an object
per value — or raw bytes)::

    connector → reader   ReaderSpec            first, once
                         TidRange              read this range next
                         None                  finish: end the transaction, exit 0
    reader → connector   ("batch", RangeBatch) up to SNAPSHOT_FETCH_ROWS rows of one range
                         ("native", NativeBatch, n)  up to NATIVE_BATCH_ROWS rows of one
                                               range, read natively (see "Native"), its
                                               buffers (afters, after_offsets, then keys and
                                               key_offsets unless keyless: n of them) left
                                               empty: each is sent next as a raw message
                         ("done", range, rows) the range is read
                         ("failed", kind, text) the reader stopped; kind "connection" (the
                                               server went away: retried like any connection
                                               loss), "lock" (see below) or "error"

**Locks.** The connector's own snapshot connection locks each table (ACCESS SHARE) and checks
that it was not rewritten since the consistent point before any reader touches it (capture.snapshot,
``REWRITTEN_SQL``). A reader's lock on the same table could then queue behind a TRUNCATE that
itself waits for the connector's lock — a wait no one would ever end — so readers take their
locks with ``lock_timeout`` (``READER_LOCK_TIMEOUT_MS``); a reader that times out reports
``lock`` and the snapshot is taken again (as for a rewritten table).

**Crash policy.** Everything a reader sends goes into the connector's open log transaction;
nothing is visible until the snapshot's one commit. A reader that dies (killed, out of
memory) closes its pipe: the connector raises :class:`SnapshotReaderDied`, ends the other
readers, aborts the transaction, and stops; the stored position still says "snapshot under
way", so the next start takes the snapshot again from a new slot. A connector that dies
leaves its readers with closed pipes: they exit on EOF. Ctrl-C reaches the connector, not
its readers (their own sessions): it stops them. A reader that dies while the connector is
asked to stop at the same time (a supervisor signalling every process of the service)
counts as that stop, not as a failure (capture.snapshot).

A native batch's buffers go raw (not pickled) and the connector reads each straight into memory of
Arrow's pool (:func:`recv_buffer`), where the Arrow arrays appended later point: one copy, the pipe's,
instead of four (a pickle's on each side, and ``Connection.recv_bytes``' chunks joined in a
``BytesIO``). With 5,000,000 bench rows, the connector thread's memory copies fell from 5.8 % to
0.7 % of the run's CPU samples (perf), about 0.45 s.

Thread-safety: :class:`SnapshotReaders` is used by the connector thread only.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import fcntl
import gc
import itertools
import logging
import os
import pickle
import re
import select
import struct
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq

from capture import libpq as pqlib
from capture.errors import CaptureError, is_connection_error
from capture.messages import Column
from capture.native import extension
from capture.pgtypes import SESSION_OPTIONS, dumps_values, text_converter
from capture.tables import TableFilter, TableInfo, qualified_name, result_rows, select_columns_sql

if TYPE_CHECKING:  # imported where used: see PythonPath
    from capture.events import EventEncoder, TxnContext

log = logging.getLogger("capture.connector")

Buffer = bytes | memoryview  # a native batch's buffers: bytes in the reader, memory of Arrow's pool once received

SNAPSHOT_FETCH_ROWS = 5_000  # rows per FETCH, and per batch sent to the connector (the Python path)
# Rows of a native batch at most (fewer when the connector's batch_events is: see ReaderSpec). The connector's work
# per batch (its first and last rows encoded by the Python path,
# the key state's run chunk, the append's hand-over) is spread over more rows: with 5,000,000 bench rows (2 readers,
# lz4) 5,000 gave 1.2M rows/s, 20,000 1.4M, 30,000 1.4-1.6M, 50,000 1.4-1.5M; 100,000 1.2-1.4M (a batch's values,
# about 50 MB, then come from fresh memory the kernel must zero).
NATIVE_BATCH_ROWS = 30_000
# ... and of COPY text (wide rows: a batch's envelopes stay a few tens of MB, far below an Arrow array's 2 GiB)
NATIVE_BATCH_BYTES = 8 << 20
# 32 MiB of heap: tables under twice that are read by the connector's own connection (a reader's start, ≈ 1 s,
# outweighs what it saves there: 300,000 bench rows took 0.7× as long with one reader as with two).
MIN_RANGE_BLOCKS = 4_096
RANGES_PER_WORKER = 4  # ranges per reader, for balance when readers run at different speeds
RANGES_IN_FLIGHT = 2  # ranges handed to a reader ahead, so it never waits for the next one
READER_LOCK_TIMEOUT_MS = 2_000  # see "Locks" above
PIPE_BYTES = 4 << 20  # a reader's pipe to the connector, at most (see _widen_pipe)
WAIT_S = 0.5  # the connector's longest wait for a reader's message (then it looks at its stop flag)
INDEX_FIELD = b'"event_index":'  # where a value's event index digits go (the last one in the value)


class SnapshotReaderDied(CaptureError):
    """A snapshot reader process ended without finishing its ranges; the snapshot is taken again on the next start."""

    def __init__(self, message: str, exitcode: int | None) -> None:
        super().__init__(message)
        self.exitcode = exitcode


class ReaderLockTimeout(CaptureError):
    """A reader's lock on a table queued behind a conflicting lock request (see "Locks" in the module docstring)."""


@dataclass(frozen=True, slots=True)
class ReaderSpec:
    """What every reader process needs: where, which snapshot, and how reads are encoded."""

    dsn: str
    snapshot_name: str  # the slot's exported snapshot
    topic_prefix: str  # source.name
    db: str  # source.db
    table_filter: TableFilter  # excluded and masked columns
    consistent_point: int  # source.lsn and commit_lsn of every read
    ts_ms: int  # source.ts_ms of every read
    native: bool = False  # read with COPY and encode in compiled code where the table allows (see "Native")
    batch_rows: int = NATIVE_BATCH_ROWS  # a native batch's rows at most (the connector's batch_events, if fewer)
    batch_bytes: int = NATIVE_BATCH_BYTES  # ... and COPY text (its batch_bytes, if fewer)


@dataclass(frozen=True, slots=True)
class TidRange:
    """Heap blocks ``[first_block, end_block)`` of one table (``end_block`` None: to the table's end)."""

    table: TableInfo
    number: int  # 0-based, per table
    first_block: int
    end_block: int | None

    def where(self) -> str:
        lower = f"ctid >= '({self.first_block},0)'::tid"
        return lower if self.end_block is None else f"{lower} AND ctid < '({self.end_block},0)'::tid"


@dataclass(frozen=True, slots=True)
class RangeBatch:
    """Rows of one range, in ctid order: the first and last as rows, those between encoded."""

    range: int
    first: list[Column]
    keys: list[bytes | None]  # of the rows between first and last
    heads: list[bytes]  # their values up to the event index's digits
    tails: list[bytes]  # ... and after them
    big: dict[int, dict[str, Any]]  # position in keys → the TOAST-able values of a big row (capture.events)
    last: list[Column] | None  # None: a batch of one row
    nbytes: int  # bytes of keys, heads and tails (for the connector's batch sizing)

    @property
    def rows(self) -> int:
        return len(self.keys) + 1 + (self.last is not None)


@dataclass(frozen=True, slots=True)
class NativeBatch:
    """Rows of one range read natively (see "Native"): the first and last as rows, the ``between`` rows
    between as their ``after`` images and keys in Arrow binary buffers (u32 little-endian offsets)."""

    range: int
    first: list[Column]
    between: int
    afters: Buffer  # the `after` images' JSON, concatenated
    after_offsets: Buffer  # between + 1 offsets into afters
    keys: Buffer | None  # the record keys' JSON, concatenated (None: a keyless table)
    key_offsets: Buffer | None
    big: dict[int, dict[str, Any]]  # position among the rows between → the TOAST-able values of a big row
    last: list[Column] | None  # None: a batch of one row

    @property
    def rows(self) -> int:
        return self.between + 1 + (self.last is not None)

    @property
    def nbytes(self) -> int:
        return len(self.afters) + (len(self.keys) if self.keys is not None else 0)

    def buffers(self) -> list[Buffer]:
        """The buffers sent raw after the batch (see "Wire format")."""
        return [self.afters, self.after_offsets, *(() if self.keys is None or self.key_offsets is None
                                                    else (self.keys, self.key_offsets))]  # fmt: skip

    def without_buffers(self) -> NativeBatch:
        """The batch with its buffers left empty, pickled ahead of them."""
        keys = None if self.keys is None else b""
        return dataclasses.replace(self, afters=b"", after_offsets=b"", keys=keys, key_offsets=keys)

    def with_buffers(self, buffers: list[Buffer]) -> NativeBatch:
        """The batch :meth:`without_buffers` made, with the buffers that came after it."""
        keyed = self.keys is not None
        if len(buffers) != (4 if keyed else 2):
            raise CaptureError(f"a native snapshot batch came with {len(buffers)} buffers, not {4 if keyed else 2}")
        afters, after_offsets, *keys = buffers
        return dataclasses.replace(self, afters=afters, after_offsets=after_offsets,
                                   keys=keys[0] if keyed else None, key_offsets=keys[1] if keyed else None)  # fmt: skip


class PythonPath:
    """A reader's Python path (capture.events' ``EventEncoder`` and the reads' ``TxnContext``), made on first use:
    a reader whose rows all go the native way never imports the modules behind it (the storage engine, Avro,
    numpy, pyarrow). A reader's start (interpreter and imports) went from 0.37 s to 0.16 s with this, and
    the connector's first batch came 0.2 s sooner (from the readers' spec: 280 → 80 ms)."""

    def __init__(self, spec: ReaderSpec | None, made: tuple[EventEncoder, TxnContext] | None = None) -> None:
        self._spec = spec
        self._made = made

    @classmethod
    def of(cls, encoder: EventEncoder, ctx: TxnContext) -> PythonPath:
        """The path with its encoder and context given."""
        return cls(None, (encoder, ctx))

    def get(self) -> tuple[EventEncoder, TxnContext]:
        if self._made is None:
            from capture.converters import JsonConverter
            from capture.events import EventEncoder, TxnContext

            spec = self._spec
            assert spec is not None
            self._made = (EventEncoder(spec.topic_prefix, spec.db, spec.table_filter, JsonConverter()),
                          TxnContext(None, spec.consistent_point, spec.ts_ms, snapshot="true"))  # fmt: skip
        return self._made


def tid_ranges(table: TableInfo, blocks: int, workers: int) -> list[TidRange]:
    """The ranges of a table of ``blocks`` heap blocks; [] when it is too small to be worth splitting."""
    if workers < 2 or blocks < 2 * MIN_RANGE_BLOCKS:
        return []
    count = min(workers * RANGES_PER_WORKER, blocks // MIN_RANGE_BLOCKS)
    bounds = [blocks * i // count for i in range(count)]
    return [
        TidRange(table, i, bounds[i], bounds[i + 1] if i + 1 < count else None) for i in range(count)
    ]


# ---------------------------------------------------------------------------- the reader process


def reader_main(spec: ReaderSpec, tasks: Connection, pipe: Connection) -> None:
    """A reader process: import the snapshot, then read the ranges the connector sends until it sends None."""
    try:
        with psycopg.connect(spec.dsn, options=SESSION_OPTIONS) as db:
            db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            db.execute(f"SET TRANSACTION SNAPSHOT '{spec.snapshot_name}'".encode())
            db.execute(f"SET LOCAL lock_timeout = {READER_LOCK_TIMEOUT_MS}".encode())
            python = PythonPath(spec)
            locked: set[str] = set()
            natives: dict[str, Any] = {}  # table → its compiled encoder (None: the Python path)
            while True:
                task = pickle.loads(tasks.recv_bytes())
                if task is None:
                    break
                name = task.table.qualified
                if name not in natives:
                    natives[name] = native_encoder(spec, task.table)
                _read_range(db, pipe, python, task, locked, natives[name], spec)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the connector is gone: nothing to report to
    except BaseException as e:
        kind = "lock" if isinstance(e, psycopg.errors.LockNotAvailable) else (
            "connection" if is_connection_error(e) else "error")  # fmt: skip
        with contextlib.suppress(OSError):  # the connector may be gone too
            pipe.send_bytes(pickle.dumps(("failed", kind, f"{type(e).__name__}: {e}".strip())))
        raise SystemExit(1) from None


def _process_main() -> None:
    """``python -m capture.snapshot_readers``: tasks on stdin, results on stdout (moved off fd 1 first, so that
    nothing printed can mix into them), the :class:`ReaderSpec` as the first message.

    The cyclic garbage collector is off: a reader makes one object per row read (psycopg's line) and no
    reference cycles, yet each young-generation collection those objects trigger walked the imported
    modules' objects as well — 0.9 µs per row, more than reading and encoding it (measured with 5,000,000
    rows: 1.31 µs of CPU per line read with it, 0.32 without). Memory is still freed by reference counting."""
    gc.disable()
    tasks = Connection(os.dup(0), writable=False)
    results = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    try:
        spec = pickle.loads(tasks.recv_bytes())  # started early, it may wait here a while (SnapshotReaders)
    except (EOFError, OSError):
        return  # the connector is gone
    if spec is None:
        return  # not needed after all
    reader_main(spec, tasks, results)
    # Done, its connection closed: exit without the interpreter's teardown (freeing every module's objects took
    # 40 ms, which the connector waits for before its commit). Nothing is buffered: results go unbuffered.
    sys.stderr.flush()
    os._exit(0)


def _read_range(
    db: psycopg.Connection[Any], pipe: Connection, python: PythonPath, task: TidRange, locked: set[str],
    native: Any | None, spec: ReaderSpec,
) -> None:  # fmt: skip
    table = task.table
    name = qualified_name(table)
    if name not in locked:
        db.execute(f"LOCK TABLE {name} IN ACCESS SHARE MODE".encode())  # under lock_timeout: see "Locks"
        locked.add(name)
    if native is not None:
        _read_range_native(db, pipe, python, native, task, spec)
        return
    encoder, ctx = python.get()
    cursor = f"tideline_range_{task.number}"
    db.execute(f"DECLARE {cursor} NO SCROLL CURSOR FOR {select_columns_sql(table, task.where())}".encode())
    rows = 0
    while True:
        res = db.execute(f"FETCH {SNAPSHOT_FETCH_ROWS} FROM {cursor}".encode()).pgresult
        if res is None or res.ntuples == 0:
            break
        batch = encode_batch(encoder, table, list(result_rows(res, table)), ctx, task.number)
        rows += batch.rows
        pipe.send_bytes(pickle.dumps(("batch", batch), protocol=5))
    db.execute(f"CLOSE {cursor}".encode())
    pipe.send_bytes(pickle.dumps(("done", task.number, rows), protocol=5))


def native_encoder(spec: ReaderSpec, table: TableInfo) -> Any | None:
    """The compiled encoder of ``table``'s rows (None: they take the Python path): the extension is built and
    wanted (``spec.native``), no column is excluded or masked, and every column's type is converted natively."""
    encoder = extension.SnapshotEncoder  # None: not built
    if not spec.native or encoder is None or not table.columns:
        return None
    if spec.table_filter.exclude_columns or spec.table_filter.mask_columns:
        return None
    if not all(extension.converts(c.type_oid) for c in table.columns):
        return None
    return encoder([c.name for c in table.columns], [c.type_oid for c in table.columns], list(table.key),
                   list(table.toastable_columns))  # fmt: skip


def _read_range_native(
    db: psycopg.Connection[Any], pipe: Connection, python: PythonPath, native: Any, task: TidRange, spec: ReaderSpec
) -> None:  # fmt: skip
    rows = 0
    select = select_columns_sql(task.table, task.where())
    for batch in copy_batches(db, python, native, task.table, select, task.number, spec.batch_rows,
                              spec.batch_bytes):  # fmt: skip
        rows += batch.rows
        buffers = batch.buffers()
        pipe.send_bytes(pickle.dumps(("native", batch.without_buffers(), len(buffers)), protocol=5))
        for buffer in buffers:
            pipe.send_bytes(buffer)
    pipe.send_bytes(pickle.dumps(("done", task.number, rows), protocol=5))


def copy_batches(db: psycopg.Connection[Any], python: PythonPath, native: Any, table: TableInfo, select: str,
                 number: int, rows: int, max_bytes: int) -> Iterator[NativeBatch]:  # fmt: skip
    """The rows of ``select`` (a :func:`capture.tables.select_columns_sql` of ``table``) read with ``COPY … TO STDOUT``
    and encoded by the compiled encoder ``native``, ``rows`` at a time (fewer once they hold ``max_bytes`` of COPY
    text), as :class:`NativeBatch` es numbered ``number`` (a reader's range; the connector's own reads: 0)."""
    convs = [text_converter(c.type_name, c.type_oid) for c in table.columns]
    sql = f"COPY ({select}) TO STDOUT"
    libpq = libpq_copy_functions()
    if libpq is None:  # libpq's functions not found: the lines through psycopg, encoded in compiled code
        for lines in copy_lines(db, sql, rows, max_bytes):
            yield encode_native_batch(python, native, table, convs, lines, number)
        return
    for read in read_copy(db, native, libpq, sql, rows, max_bytes):
        yield native_batch(python, table, convs, number, *read)


def libpq_copy_functions() -> tuple[int, int] | None:
    """The addresses of ``PQgetCopyData`` and ``PQfreemem`` in the libpq psycopg uses in this process, for
    :func:`read_copy` (capture.libpq); None where they cannot be told for sure (then the lines go through
    psycopg)."""
    found = pqlib.functions(pqlib.COPY)
    return None if found is None else (found[0], found[1])


NativeRead = tuple[bytes, bytes | None, int, tuple[Any, ...], list[bytes]]


def read_copy(db: psycopg.Connection[Any], native: Any, libpq: tuple[int, int], sql: str, size: int,
              max_bytes: int = 1 << 62) -> Iterator[NativeRead]:  # fmt: skip
    """:func:`copy_lines`'s batches, read and encoded by the compiled encoder (``SnapshotEncoder.read_copy``:
    libpq's copy calls, no Python object per line): per batch ``(first line, last line or None, rows between,
    their encoding as SnapshotEncoder.encode gives it, the fallback rows' lines)`` for :func:`native_batch`.
    Errors as :func:`copy_lines` raises them. ``db`` is this thread's alone while the COPY runs (its libpq
    connection is used without psycopg knowing)."""
    if size < 1 or max_bytes < 1:  # a call that may read nothing would say "more to come" forever
        raise ValueError(f"read_copy: max_rows ({size}) and max_bytes ({max_bytes}) must be at least 1")
    pgconn = _start_copy(db, sql)
    get, free = libpq
    address: int = pgconn.pgconn_ptr  # every implementation of psycopg's PGconn has it (its stub not)
    while True:
        status, first, last, encoded, fallback_lines = native.read_copy(address, get, free, size, max_bytes)
        if first is not None:
            between = (len(encoded[1]) // 4 - 1) if last is not None else 0
            yield first, last, between, encoded, fallback_lines
        if status != 1:
            break
    _end_copy(pgconn, sql, ended=status == 0)


def copy_lines(db: psycopg.Connection[Any], sql: str, size: int, max_bytes: int = 1 << 62) -> Iterator[list[Any]]:
    """The lines of ``sql`` (a ``COPY … TO STDOUT`` in text format), ``size`` at a time (fewer once they hold
    ``max_bytes``), read with libpq's copy calls directly: psycopg's ``Copy`` object costs about 0.4 µs more per
    row, a third of a reader's budget. The connection is idle (in its transaction) again afterwards; a server
    error is raised as psycopg raises it, a lost connection as :class:`psycopg.OperationalError`."""
    pgconn = _start_copy(db, sql)
    get = pgconn.get_copy_data
    lines: list[Any] = []  # memoryviews (psycopg's bindings give each line as one)
    held = 0
    while True:
        n, data = get(1)  # one line per call; 0: none buffered, wait on the socket (see _next_result)
        if n == 0:
            _wait_readable(pgconn)
            continue
        if n < 0:
            break
        lines.append(data)
        held += n
        if len(lines) >= size or held >= max_bytes:
            yield lines
            lines = []
            held = 0
    _end_copy(pgconn, sql, ended=n == -1)
    if lines:
        yield lines


def _start_copy(db: psycopg.Connection[Any], sql: str) -> Any:
    """Send ``sql`` (a ``COPY … TO STDOUT``) on ``db``'s libpq connection; that connection, once in COPY OUT."""
    pgconn = db.pgconn
    pgconn.send_query(sql.encode())
    while pgconn.flush() != 0:  # a non-blocking connection: what send_query left unsent
        select.select([], [pgconn.socket], [])
    started = _next_result(pgconn)
    if started is None or started.status != pq.ExecStatus.COPY_OUT:
        error = _drain_results(pgconn, started)
        raise error if error is not None else psycopg.OperationalError(f"{sql}: no COPY data came")
    return pgconn


def _end_copy(pgconn: Any, sql: str, *, ended: bool) -> None:
    """After the COPY's data (``ended``: libpq said it ended, not that it failed): read its results, raise its
    error."""
    error = _drain_results(pgconn, None)
    if error is not None or not ended:
        raise error if error is not None else psycopg.OperationalError(
            f"{sql}: reading COPY data failed: {pgconn.get_error_message()}")  # fmt: skip


def _next_result(pgconn: Any) -> Any:
    """``pgconn``'s next result, once it has arrived: waited for on the socket (``select``, the GIL released), not
    inside libpq's ``PQgetResult``, which psycopg's binding calls holding the GIL. The connector's own connection
    reads a table this way too, and a thread blocked there would stop every other thread of the process (its
    append thread; in the tests, an in-process TCP proxy, which deadlocked on it). A lost connection raises
    :class:`psycopg.OperationalError` (from ``consume_input``)."""
    pgconn.consume_input()
    while pgconn.is_busy():
        _wait_readable(pgconn)
    return pgconn.get_result()


def _wait_readable(pgconn: Any) -> None:
    """Until the server sent more (the GIL released meanwhile), then read it into libpq's buffer."""
    select.select([pgconn.socket], [], [])
    pgconn.consume_input()


def _drain_results(pgconn: Any, first: Any) -> Exception | None:
    """Read the command's remaining results; the first error among them (and ``first``) as psycopg's exception —
    :class:`psycopg.OperationalError` when the connection is gone (libpq's own result then has no SQLSTATE)."""
    error: Exception | None = None
    result = first
    while True:
        if result is not None and result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.COPY_OUT):
            error = error or psycopg.errors.error_from_result(result, encoding="utf-8")
        result = _next_result(pgconn)
        if result is None:
            break
    if pgconn.status != pq.ConnStatus.OK:
        return psycopg.OperationalError(f"the connection was lost during COPY: {pgconn.get_error_message()}")
    return error


def copy_row_columns(table: TableInfo, convs: list[Any], line: bytes | memoryview) -> list[Column]:
    """One ``COPY … TO STDOUT`` text line of :func:`capture.tables.select_columns_sql` → its row, as
    :func:`capture.tables.result_rows` gives it (both carry each type's output text; COPY escapes it)."""
    line = bytes(line)  # psycopg gives a memoryview
    if not line.endswith(b"\n"):
        raise CaptureError(f"a COPY line of {table.qualified} does not end with a newline")
    fields = line[:-1].split(b"\t")
    if len(fields) != len(table.columns):
        raise CaptureError(f"a COPY line of {table.qualified} has {len(fields)} fields, not {len(table.columns)}")
    return [
        Column(c.name, c.type_name, c.type_oid, None if f == b"\\N" else convs[j](copy_unescape(f)))
        for j, (c, f) in enumerate(zip(table.columns, fields, strict=True))
    ]


_COPY_ESCAPE = re.compile(rb"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{1,2})|(.))", re.DOTALL)
_COPY_CHARS = {b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t", b"v": b"\v"}


def _copy_char(m: re.Match[bytes]) -> bytes:
    octal, hexa, char = m.groups()
    if octal is not None:
        return bytes([int(octal, 8) & 0xFF])  # PostgreSQL keeps the low byte
    if hexa is not None:
        return bytes([int(hexa, 16)])
    return _COPY_CHARS.get(char, char)


def copy_unescape(field: bytes) -> str:
    """A COPY text field's value (backslash escapes: ``\\\\``, ``\\b`` ``\\f`` ``\\n`` ``\\r`` ``\\t`` ``\\v``, octal
    ``\\ooo``, hex ``\\xhh``; another character after a backslash stands for itself)."""
    if b"\\" not in field:
        return field.decode()
    if field.endswith(b"\\") and (len(field) - len(field.rstrip(b"\\"))) % 2:
        raise CaptureError(f"a COPY field ends with a lone backslash: {field[-40:]!r}")
    return _COPY_ESCAPE.sub(_copy_char, field).decode()


def encode_native_batch(
    python: PythonPath, native: Any, table: TableInfo, convs: list[Any], lines: list[Any], number: int
) -> NativeBatch:
    """COPY lines of one range (≥ 1) → a :class:`NativeBatch`: the rows between the first and the last encoded by the
    compiled encoder; those it leaves (a form of value it does not convert, a big row) by the Python path."""
    between = lines[1:-1]
    encoded = native.encode(between)
    return native_batch(python, table, convs, number, lines[0], lines[-1] if len(lines) > 1 else None,
                        len(between), encoded, [between[i] for i in encoded[4]])  # fmt: skip


def native_batch(
    python: PythonPath, table: TableInfo, convs: list[Any], number: int, first_line: Any, last_line: Any | None,
    between: int, encoded: tuple[Any, ...], fallback_lines: list[Any],
) -> NativeBatch:  # fmt: skip
    """A :class:`NativeBatch` of one range's lines: the first and the last as rows, the ``between`` rows between
    as ``SnapshotEncoder`` encoded them (``encoded``), those it left (``fallback_lines``, in the order of their
    positions) encoded by the Python path and put in their place."""
    first = copy_row_columns(table, convs, first_line)
    last = copy_row_columns(table, convs, last_line) if last_line is not None else None
    afters, after_offsets, keys, key_offsets, fallback = encoded
    big: dict[int, dict[str, Any]] = {}
    if fallback:
        from eventstore.topic import now_ms  # with the Python path's modules (see PythonPath)

        encoder, ctx = python.get()
        after_list = _split(afters, after_offsets)
        key_list = _split(keys, key_offsets) if keys is not None and key_offsets is not None else None
        now = now_ms()
        for i, line in zip(fallback, fallback_lines, strict=True):
            key, value, after = encoder.read_record(table, copy_row_columns(table, convs, line), ctx, 0, now)
            after_list[i] = dumps_values(after)
            if key_list is not None and key is not None:
                key_list[i] = key
                values = encoder.toast_values(table, after, len(value))
                if values is not None:
                    big[i] = values
        afters, after_offsets = _join(after_list)
        if key_list is not None:
            keys, key_offsets = _join(key_list)
    return NativeBatch(number, first, between, afters, after_offsets, keys, key_offsets, big, last)


def _split(data: bytes, offsets: bytes) -> list[bytes]:
    o = array.array("I", offsets)  # Arrow's offsets are little-endian
    if sys.byteorder == "big":
        o.byteswap()
    return [data[a:b] for a, b in itertools.pairwise(o)]


def _join(items: list[bytes]) -> tuple[bytes, bytes]:
    ends = list(itertools.accumulate(map(len, items), initial=0))
    if ends[-1] >= 1 << 31:
        raise CaptureError("a snapshot batch's data exceeds 2 GiB, the most one Arrow binary array holds")
    offsets = array.array("i", ends)
    if sys.byteorder == "big":
        offsets.byteswap()
    return b"".join(items), offsets.tobytes()


def encode_batch(
    encoder: EventEncoder, table: TableInfo, rows: list[list[Column]], ctx: TxnContext, number: int
) -> RangeBatch:
    """Rows of one FETCH → a :class:`RangeBatch` (rows ≥ 1): the middle ones encoded, their values cut at the index."""
    from eventstore.topic import now_ms  # with the Python path's modules (see PythonPath)

    now = now_ms()
    keys: list[bytes | None] = []
    heads: list[bytes] = []
    tails: list[bytes] = []
    big: dict[int, dict[str, Any]] = {}
    cut_after = len(INDEX_FIELD)
    for i, columns in enumerate(rows[1:-1]):
        key, value, after = encoder.read_record(table, columns, ctx, 0, now)
        cut = value.rfind(INDEX_FIELD) + cut_after  # source is the envelope's last object with this field
        if not value.startswith(b"0}", cut):
            raise AssertionError(f"no event index where expected in a value of {table.qualified}")
        keys.append(key)
        heads.append(value[:cut])
        tails.append(value[cut + 1 :])
        if key is not None:
            values = encoder.toast_values(table, after, len(value))
            if values is not None:
                big[i] = values
    nbytes = sum(map(len, heads)) + sum(map(len, tails)) + sum(len(k) for k in keys if k is not None)
    return RangeBatch(number, rows[0], keys, heads, tails, big, rows[-1] if len(rows) > 1 else None, nbytes)


# ---------------------------------------------------------------------------- the connector's side


@dataclass(slots=True)
class _Reader:
    process: subprocess.Popen[bytes]
    tasks: Connection  # to its stdin
    pipe: Connection  # from its stdout
    in_flight: int = 0


def recv_buffer(fd: int) -> memoryview:
    """One message ``Connection.send_bytes`` wrote to the pipe ``fd``, read straight into memory of Arrow's pool
    (a writable view of it, which keeps it alive). EOFError when the pipe ends first."""
    (size,) = struct.unpack("!i", _read_exactly(fd, 4))
    if size == -1:  # Connection's form for 2 GiB and more
        (size,) = struct.unpack("!Q", _read_exactly(fd, 8))
    import pyarrow as pa  # the connector's side only (readers never import it; it has, as eventstore does)

    view = memoryview(pa.allocate_buffer(size)).cast("B")
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError(f"a snapshot reader's pipe ended {size - got} bytes into a {size}-byte message")
        got += n
    return view


def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("a snapshot reader's pipe ended")
        data += chunk
    return data


def _widen_pipe(fd: int) -> None:
    """Let a reader's pipe hold a whole batch or more (Linux: up to ``/proc/sys/fs/pipe-max-size``, 1 MiB by
    default, instead of 64 KiB): the reader reads on while the connector appends and syncs, instead of
    waiting at its first 64 KiB. Elsewhere, or when refused, the pipe stays as it is."""
    try:
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(limit, PIPE_BYTES))
    except (OSError, ValueError, AttributeError):
        return


class SnapshotReaders:
    """The reader processes of one snapshot: started once, reused for every big table, closed at its end.

    Started before the slot exists (the connector knows a snapshot is due: their imports, about 0.4 s, run
    while it creates the slot), they wait for their :class:`ReaderSpec` (:meth:`begin`); or given it at once.
    """

    def __init__(self, workers: int, spec: ReaderSpec | None = None) -> None:
        self._readers: list[_Reader] = []
        self._begun = False
        # this process's modules; one BLAS thread (a reader does no linear algebra: idle BLAS threads only spin)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OPENBLAS_NUM_THREADS": "1"}
        try:
            for _ in range(workers):
                process = subprocess.Popen([sys.executable, "-m", "capture.snapshot_readers"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, env=env, start_new_session=True)  # fmt: skip
                assert process.stdin is not None and process.stdout is not None
                _widen_pipe(process.stdout.fileno())
                reader = _Reader(process, Connection(os.dup(process.stdin.fileno()), readable=False),
                                 Connection(os.dup(process.stdout.fileno()), writable=False))  # fmt: skip
                process.stdin.close()
                process.stdout.close()
                self._readers.append(reader)
            if spec is not None:
                self.begin(spec)
        except BaseException:
            self.close(wait_s=0)
            raise
        log.info("capture: %d snapshot reader processes started (pids %s)", workers,
                 ", ".join(str(r.process.pid) for r in self._readers))  # fmt: skip

    @property
    def begun(self) -> bool:
        return self._begun

    def begin(self, spec: ReaderSpec) -> None:
        """Give every reader the snapshot to read (once)."""
        if self._begun:
            raise AssertionError("the snapshot readers have their spec already")
        for reader in self._readers:
            try:
                reader.tasks.send_bytes(pickle.dumps(spec, protocol=5))
            except OSError:  # BrokenPipeError: it died while waiting
                raise self._died(reader) from None
        self._begun = True

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self._readers]

    def read(self, ranges: list[TidRange]) -> Iterator[RangeBatch | NativeBatch | None]:
        """Every range's batches, in arrival order; None after ``WAIT_S`` without one (the caller's stop check)."""
        pending = deque(ranges)
        for reader in self._readers:
            while pending and reader.in_flight < RANGES_IN_FLIGHT:
                self._send(reader, pending.popleft())
        by_pipe = {id(r.pipe): r for r in self._readers}
        while any(r.in_flight for r in self._readers):
            ready = wait([r.pipe for r in self._readers if r.in_flight], timeout=WAIT_S)
            if not ready:
                yield None
            for pipe in ready:
                assert isinstance(pipe, Connection)
                reader = by_pipe[id(pipe)]
                message = self._receive(reader)
                if message[0] == "batch":
                    yield message[1]
                elif message[0] == "done":
                    reader.in_flight -= 1
                    if pending:
                        self._send(reader, pending.popleft())
                else:
                    self._failed(reader, message[1], message[2])

    def _send(self, reader: _Reader, task: TidRange) -> None:
        try:
            reader.tasks.send_bytes(pickle.dumps(task, protocol=5))
        except OSError:  # BrokenPipeError, ConnectionResetError: its end is closed
            raise self._died(reader) from None
        reader.in_flight += 1

    def _receive(self, reader: _Reader) -> tuple[Any, ...]:
        try:
            message = pickle.loads(reader.pipe.recv_bytes())
            assert isinstance(message, tuple)
            if message[0] == "native":  # see "Wire format": its buffers follow
                fd = reader.pipe.fileno()
                return ("batch", message[1].with_buffers([recv_buffer(fd) for _ in range(message[2])]))
        except (EOFError, OSError):
            raise self._died(reader) from None
        return message

    @staticmethod
    def _died(reader: _Reader) -> SnapshotReaderDied:
        with contextlib.suppress(subprocess.TimeoutExpired):
            reader.process.wait(timeout=5)
        return SnapshotReaderDied(
            f"snapshot reader process {reader.process.pid} ended (exit code {reader.process.returncode}) before "
            "its ranges were read: the snapshot is aborted and taken again on the next start",
            reader.process.returncode,
        )

    def _failed(self, reader: _Reader, kind: str, text: str) -> None:
        what = f"snapshot reader process {reader.process.pid}: {text}"
        if kind == "connection":
            raise psycopg.OperationalError(what)  # the server went away: a connection loss, retried as such
        if kind == "lock":
            raise ReaderLockTimeout(what)
        raise CaptureError(what)

    def close(self, *, wait_s: float = 5.0) -> None:
        """Tell every reader to finish, then kill those still running after ``wait_s`` (their transactions are
        read-only and end with their connections)."""
        for reader in self._readers:
            with contextlib.suppress(OSError):  # dead already
                reader.tasks.send_bytes(pickle.dumps(None))
        for reader in self._readers:
            try:
                reader.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                reader.process.kill()
                reader.process.wait(timeout=5)
            reader.tasks.close()
            reader.pipe.close()
        self._readers = []


if __name__ == "__main__":  # a reader process (SnapshotReaders): the module's own names, not __main__'s
    from capture.snapshot_readers import _process_main

    _process_main()
