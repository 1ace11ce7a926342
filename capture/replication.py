"""The replication connection: slots, the exported snapshot, and the copy-both stream.

Why psycopg 3 driven through ``conn.pgconn``: it is the driver we already use for SQL
(one dependency, not two), and measured here it streams as fast as psycopg2's
``LogicalReplicationConnection`` (≈ 134k messages/s for a bare loop). psycopg 3 has no
replication API, so the protocol is spoken directly: ``START_REPLICATION`` is sent with
``execute`` (``cursor.copy()`` refuses COPY_BOTH), then libpq's ``get_copy_data`` /
``put_copy_data`` carry the messages:

    'w' XLogData:   type(1) data_start(8) wal_end(8) send_time(8) payload
    'k' keepalive:  type(1) wal_end(8) send_time(8) reply_requested(1)
    'r' status:     type(1) written(8) flushed(8) applied(8) client_time(8) reply(1)   (we send)

Times are microseconds since 2000-01-01. The connection sets capture.pgtypes'
``SESSION_OPTIONS`` (TimeZone=UTC, DateStyle=ISO, …) so that values arrive in the formats
the type converters parse, whatever the server's defaults are.

We only ever report ``flushed`` = a commit end whose transaction is durable in the log
(see capture.connector); ``written``/``applied`` report the same value.

Thread-safety: none; one connection belongs to one connector thread.
"""

from __future__ import annotations

import array
import itertools
import select
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import psycopg
from psycopg.pq.abc import PGconn

from capture import libpq as pqlib
from capture.messages import Plugin
from capture.native.extension import read_xlog as _read_xlog  # None (not built): messages come through psycopg
from capture.pgtypes import SESSION_OPTIONS
from capture.slots import FAILOVER_SLOTS_SINCE
from schemas.position import format_lsn, parse_lsn

__all__ = ["CreatedSlot", "Keepalive", "ReplicationConnection", "XLogData", "XLogRun", "format_lsn", "parse_lsn"]

PG_EPOCH_OFFSET_US = 946_684_800_000_000  # 2000-01-01 in Unix microseconds
XLOG_HEADER = struct.Struct("!QQQ")  # after the 'w': data start, WAL end, send time
XLOG_BODY = 1 + XLOG_HEADER.size  # where an XLogData message's payload starts
KEEPALIVE = struct.Struct("!QQB")
RUN_BYTES = 8 << 20  # a run read ahead for the native core holds at most about this much (and one message)
STATUS = struct.Struct("!cQQQqB")


def replication_dsn(dsn: str) -> str:
    """``dsn`` with ``replication=database`` (URL or key=value form)."""
    if "://" in dsn:
        sep = "&" if "?" in dsn else "?"
        return f"{dsn}{sep}replication=database"
    return f"{dsn} replication=database"


@dataclass(frozen=True, slots=True)
class XLogData:
    data_start: int
    wal_end: int
    payload: bytes

    def raw(self) -> bytes:
        """The CopyData message it came in (the send time, which nothing reads, as 0)."""
        return b"w" + XLOG_HEADER.pack(self.data_start, self.wal_end, 0) + self.payload


class XLogRun(Sequence[XLogData]):
    """XLogData messages as they came off the wire ('w', header, payload), in one buffer: ``data``, and where
    each starts in it and the last ends, ``offsets`` (native-endian u32, one more than the messages). A message
    is decoded into an :class:`XLogData` only when asked for: the native core reads the buffer itself
    (capture.native.core), so no Python object is made per message it handles."""

    __slots__ = ("_at", "data", "offsets")

    def __init__(self, data: bytes, offsets: bytes) -> None:
        self.data = data
        self.offsets = offsets
        self._at = memoryview(offsets).cast("I")
        if len(self._at) < 1 or self._at[0] != 0 or self._at[-1] != len(data):
            raise ValueError(f"XLogRun: offsets {list(self._at[:3])}… do not span the {len(data)} bytes of data")

    @classmethod
    def of(cls, messages: Sequence[bytes]) -> XLogRun:
        """A run of these raw messages (each b"w" + XLOG_HEADER + payload)."""
        return cls(b"".join(messages), array.array("I", [0, *itertools.accumulate(map(len, messages))]).tobytes())

    def __len__(self) -> int:
        return len(self._at) - 1

    def message(self, i: int) -> bytes:
        """The ``i``-th message as it came."""
        if not 0 <= i < len(self._at) - 1:
            raise IndexError(f"XLogRun: no message {i} of {len(self._at) - 1}")
        return self.data[self._at[i] : self._at[i + 1]]

    @overload
    def __getitem__(self, i: int) -> XLogData: ...
    @overload
    def __getitem__(self, i: slice) -> list[XLogData]: ...
    def __getitem__(self, i: int | slice) -> XLogData | list[XLogData]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        raw = self.message(i if i >= 0 else len(self) + i)
        start, end, _ = XLOG_HEADER.unpack_from(raw, 1)
        return XLogData(start, end, raw[XLOG_BODY:])


@dataclass(frozen=True, slots=True)
class Keepalive:
    wal_end: int
    reply_requested: bool


@dataclass(frozen=True, slots=True)
class CreatedSlot:
    name: str
    consistent_point: int
    snapshot_name: str | None


class ReplicationConnection:
    """One ``replication=database`` connection: create a slot (with a snapshot), then stream it."""

    def __init__(self, dsn: str, *, connect_timeout: int = 10) -> None:
        self.conn = psycopg.connect(
            replication_dsn(dsn), autocommit=True, connect_timeout=connect_timeout, options=SESSION_OPTIONS
        )
        self._streaming = False
        self._ahead: XLogData | Keepalive | None = None  # read by pending(), returned by the next read()
        # whether the server is a standby (capture decodes on one from PostgreSQL 16); asked now, as any command
        # after CREATE_REPLICATION_SLOT would end the snapshot it exported
        row = self.conn.execute("SELECT pg_is_in_recovery()").fetchone()
        self.in_recovery = bool(row and row[0])

    @property
    def supports_failover_slots(self) -> bool:
        """PostgreSQL 17+ on a primary: a slot created with ``FAILOVER`` is synchronized to standbys that ask for
        it (``sync_replication_slots``), so it survives the promotion of one. (A standby's own slot cannot be one.)"""
        return self.conn.info.server_version >= FAILOVER_SLOTS_SINCE and not self.in_recovery

    def create_slot(self, name: str, plugin: Plugin, *, export_snapshot: bool) -> CreatedSlot:
        """``CREATE_REPLICATION_SLOT``; with ``export_snapshot`` the snapshot stays valid until the next command.
        From PostgreSQL 17 the slot is a failover slot (``FAILOVER``)."""
        mode = "export" if export_snapshot else "nothing"
        failover = ", FAILOVER true" if self.supports_failover_slots else ""
        cur = self.conn.execute(
            f"CREATE_REPLICATION_SLOT {_ident(name)} LOGICAL {plugin.value} (SNAPSHOT '{mode}'{failover})"
        )
        row = cur.fetchone()
        assert row is not None
        return CreatedSlot(row[0], parse_lsn(row[1]), row[2])

    def start(self, slot: str, start_lsn: int, options: dict[str, str]) -> None:
        """``START_REPLICATION``: the server resumes at max(``start_lsn``, the slot's confirmed position)."""
        opts = ", ".join(f"\"{k}\" '{v}'" for k, v in options.items())
        self.conn.execute(f"START_REPLICATION SLOT {_ident(slot)} LOGICAL {format_lsn(start_lsn)} ({opts})")
        self._streaming = True

    def pending(self) -> bool:
        """Whether a message is ready without waiting (already received): the stream is behind."""
        if self._ahead is None:
            self._ahead = self.read(0.0)
        return self._ahead is not None

    def read_run(self, first: XLogData, limit: int) -> XLogRun:
        """``first`` and the XLogData messages that have arrived after it already (no waiting), up to ``limit``
        in all, as one :class:`XLogRun`; a keepalive met on the way stops it and is the next :meth:`read`'s.
        The native core's read-ahead: read by the extension with libpq's own calls (``read_xlog``: one buffer,
        no Python object per message), or, where libpq's functions are not found (capture.libpq) or the
        extension is not built, through psycopg (what libpq has buffered first; the socket is looked at only
        when that runs out)."""
        if self._ahead is not None:  # read by pending(): it comes right after ``first``
            if not isinstance(self._ahead, XLogData):
                return XLogRun.of([first.raw()])  # the keepalive stays the next read()'s
            second, self._ahead = self._ahead, None
            return XLogRun.of([first.raw(), second.raw(), *self._read_ready(limit - 2)])
        functions = None if _read_xlog is None else pqlib.functions(pqlib.STREAM)
        if functions is None or _read_xlog is None:  # (mypy: both tested)
            return XLogRun.of([first.raw(), *self._read_ready(limit - 1)])
        pg = self.conn.pgconn
        get, free, consume = functions
        address: int = pg.pgconn_ptr  # type: ignore[attr-defined]  # every implementation has it (its stub not)
        status, data, offsets, ahead = _read_xlog(address, get, free, consume, first.raw(), limit, RUN_BYTES)
        datas, offset_parts = [data], [offsets]
        count, size = len(offsets) // 4 - 1, len(data)
        # read_xlog reads the socket once, and libpq takes at most its input buffer's room from it (16 KiB: 80
        # wal2json changes); while whole reads keep coming the walsender is ahead: read again, up to the limit
        while status >= 0 and ahead is None and count < limit and size < RUN_BYTES and len(offsets) > 4:
            status, data, offsets, ahead = _read_xlog(address, get, free, consume, None, limit - count,
                                                      RUN_BYTES - size)  # fmt: skip
            if len(offsets) > 4:
                datas.append(data)
                offset_parts.append(offsets)
                count, size = count + len(offsets) // 4 - 1, size + len(data)
        if status < 0:
            raise psycopg.OperationalError(f"replication stream ended: {_end_reason(pg)}")
        if ahead is not None:
            self._ahead = _message(ahead)
        if len(datas) == 1:
            return XLogRun(datas[0], offset_parts[0])
        return XLogRun(b"".join(datas), _joined_offsets(offset_parts, datas))

    def _read_ready(self, limit: int) -> list[bytes]:
        """Up to ``limit`` XLogData messages that have arrived already, through psycopg (see :meth:`read_run`)."""
        out: list[bytes] = []
        if self._ahead is not None:
            return out
        pg = self.conn.pgconn
        get = pg.get_copy_data
        while len(out) < limit:
            n, data = get(1)
            if n == 0:
                if not select.select([pg.socket], [], [], 0)[0]:
                    break
                pg.consume_input()
                n, data = get(1)
                if n == 0:
                    break
            if n < 0:
                raise psycopg.OperationalError(f"replication stream ended: {_end_reason(pg)}")
            raw = bytes(data)
            if raw[:1] == b"w" and len(raw) >= XLOG_BODY:
                out.append(raw)
                continue
            self._ahead = _message(raw)  # a keepalive (or a malformed message): the next read()'s
            break
        return out

    def read(self, timeout_s: float) -> XLogData | Keepalive | None:
        """The next message, or None after ``timeout_s`` without one."""
        if self._ahead is not None:
            msg, self._ahead = self._ahead, None
            return msg
        pg = self.conn.pgconn
        deadline = time.monotonic() + timeout_s
        while True:
            n, data = pg.get_copy_data(1)
            if n == 0:
                remaining = deadline - time.monotonic()
                readable, _, _ = select.select([pg.socket], [], [], max(0.0, remaining))
                if readable:
                    pg.consume_input()  # also with timeout 0: what has arrived is read
                    n, data = pg.get_copy_data(1)
                if n == 0:
                    if remaining <= 0:
                        return None
                    continue
            if n < 0:
                raise psycopg.OperationalError(f"replication stream ended: {_end_reason(pg)}")
            return _message(bytes(data))

    def send_status(self, flushed: int, *, reply: bool = False) -> None:
        """Standby status update: everything up to ``flushed`` is durable downstream."""
        now = time.time_ns() // 1000 - PG_EPOCH_OFFSET_US
        self.conn.pgconn.put_copy_data(STATUS.pack(b"r", flushed, flushed, flushed, now, 1 if reply else 0))
        self.conn.pgconn.flush()

    def close(self) -> None:
        """End the stream politely if it is running, then close the connection."""
        if self._streaming and not self.conn.closed:
            pg = self.conn.pgconn
            try:
                pg.put_copy_end(None)
                pg.flush()
                deadline = time.monotonic() + 2
                while time.monotonic() < deadline:
                    n, _ = pg.get_copy_data(1)
                    if n == -1:
                        break
                    if n == 0:
                        select.select([pg.socket], [], [], 0.1)
                        pg.consume_input()
            except psycopg.Error:
                pass
        self._streaming = False
        self.conn.close()


def _joined_offsets(parts: list[bytes], datas: list[bytes]) -> bytes:
    """The offsets of the runs ``datas`` (each run's ``parts``, native-endian u32 from 0) once they are joined."""
    out = [np.frombuffer(parts[0], np.uint32)]
    base = len(datas[0])
    for offsets, data in zip(parts[1:], datas[1:], strict=True):
        out.append(np.frombuffer(offsets, np.uint32)[1:] + np.uint32(base))
        base += len(data)
    return np.concatenate(out).tobytes()


def _message(raw: bytes) -> XLogData | Keepalive:
    """One CopyData message of the stream: 'w' XLogData or 'k' keepalive (layouts in the module docstring)."""
    kind = raw[:1]
    if kind == b"w":
        start, end, _ = XLOG_HEADER.unpack_from(raw, 1)
        return XLogData(start, end, raw[XLOG_BODY:])
    if kind == b"k":
        end, _, reply = KEEPALIVE.unpack_from(raw, 1)
        return Keepalive(end, bool(reply))
    raise psycopg.OperationalError(f"unexpected replication message type {kind!r}")


def _end_reason(pg: PGconn) -> str:
    """Why the copy-both stream ended: the server's ERROR (e.g. pgoutput's "publication … does not exist",
    which decides whether the failure is permanent), else libpq's message."""
    reason = pg.error_message.decode(errors="replace").strip()
    result = pg.get_result()  # the stream's outcome: an ErrorResponse lands here
    if result is not None and result.error_message:
        reason = result.error_message.decode(errors="replace").strip()
    return " ".join(reason.split()) or "copy done"


def _ident(name: str) -> str:
    """Slot names are [a-z0-9_] (the server enforces it); quote anyway."""
    return '"' + name.replace('"', '""') + '"'
