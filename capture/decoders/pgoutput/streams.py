"""In-progress transactions streamed by pgoutput (protocol ≥ 2), spilled to disk until their Stream Commit.

Between Stream Start and Stream Stop, pgoutput sends the changes of a transaction that
outgrew ``logical_decoding_work_mem`` before it commits, each carrying the xid of its
(sub)transaction; blocks of several transactions may interleave, and ordinary
transactions may come between the blocks. Nothing of such a transaction may reach the
log before its Stream Commit (it may still abort), and holding it in memory would make
memory O(transaction). So each payload is appended, **raw**, to a temporary file of its
top-level transaction, and decoded only at Stream Commit, in the order it came:

* file layout: records of ``subxid (uint32) | XLogData LSN (uint64) | length (uint32) |
  payload``, big-endian (:data:`RECORD`), appended in stream order (which is WAL order);
* Stream Abort of the whole transaction (subtransaction xid = xid) deletes its file:
  nothing of it is ever decoded;
* Stream Abort of a subtransaction (``ROLLBACK TO SAVEPOINT``; its aborted children come
  first, each with its own) discards **every record from the subtransaction's first one
  on**, as PostgreSQL's own subscriber truncates its spool file there: while a
  subtransaction is open nothing outside it writes, so everything after its first record
  is its own or its children's — including transactional logical messages, which
  pgoutput 15 tags with the *top-level* xid;
* Relation and Type messages are never discarded: they describe a table as the streamed
  transaction saw it (pgoutput sends each once per streamed transaction, so a later
  change may rely on one sent inside a rolled-back subtransaction), and apply to the
  decoder's cache only once the transaction commits, as in PostgreSQL's subscriber.

**The one case a stream cannot tell.** A transactional logical message that a
subtransaction emits *before its first row change* arrives tagged with the top-level xid
and is indistinguishable from one the parent emitted just before ``SAVEPOINT``. When such
a subtransaction aborts (messages sit between the last record of a known (sub)transaction
before the subtransaction's first record and that record, or after the last such record
when it has none), their fate is open; if an abort of an enclosing subtransaction
discards them too, it is settled, else :meth:`SpilledTransactions.commit` raises
:class:`StreamedAbortAmbiguous`: the connector then reconnects without streaming, so
that the server, which knows, spills and filters the transaction itself. Nothing of the
transaction was stored (it has not committed), so nothing is lost or duplicated.

Files are anonymous (``tempfile.TemporaryFile``: unlinked at once, gone with the process,
even after kill -9) in the directory given (the connector's state directory). Memory:
one buffer per open transaction (:data:`BUFFER_BYTES`) and a few integers per
subtransaction, whatever the transaction's size.

Crash policy: none needed. After a crash or reconnect the server streams every open
transaction again from its start (the slot is never confirmed past an uncommitted
transaction's commit), into a new decoder with new files.

Thread safety: none; owned by one decoder.
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from capture.messages import StreamingAmbiguous

RECORD = struct.Struct("!IQI")  # subtransaction xid, XLogData LSN, payload length
BUFFER_BYTES = 1 << 20  # per open transaction's file: its writes, then its replay's reads
_DESCRIPTIONS = frozenset(b"RY")  # Relation, Type: never discarded
_MESSAGE = ord("M")


class StreamedAbortAmbiguous(StreamingAmbiguous):
    """A rolled-back subtransaction of a streamed transaction may have emitted a logical message the stream
    cannot attribute (see the module docstring): stream this transaction again without ``streaming``."""


@dataclass(slots=True)
class _Spill:
    """One open streamed transaction: its file, and what its subtransactions' aborts need."""

    file: IO[bytes]
    records: int = 0
    bytes: int = 0
    first: dict[int, int] = field(default_factory=dict)  # subxid → index of its first record
    gap: dict[int, int] = field(default_factory=dict)  # subxid → unattributable messages just before its first
    messages_since_change: int = 0  # top-level-tagged messages since the last record of a known (sub)transaction
    discarded: list[tuple[int, int]] = field(default_factory=list)  # [start, end) record ranges of aborted ones
    open_questions: list[tuple[int, int, int]] = field(default_factory=list)  # [start, end) of messages, subxid


class SpilledTransactions:
    """Raw payloads of streamed transactions, one temporary file per top-level xid (module docstring)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self._open: dict[int, _Spill] = {}
        self.spilled_bytes = 0  # over the decoder's life, for logs and tests
        self.replayed_transactions = 0

    def append(self, xid: int, subxid: int, lsn: int, payload: bytes) -> None:
        spill = self._open.get(xid)
        if spill is None:
            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
            file = tempfile.TemporaryFile(prefix=f"pgoutput-xid{xid}-", dir=self.directory,  # noqa: SIM115
                                          buffering=BUFFER_BYTES)  # fmt: skip
            spill = self._open[xid] = _Spill(file)
        if payload[0] == _MESSAGE and subxid == xid:
            spill.messages_since_change += 1  # whose? the parent's, or a subtransaction's not yet seen
        else:  # a record of a known (sub)transaction: it was open here
            if subxid != xid and subxid not in spill.first:
                spill.first[subxid] = spill.records
                spill.gap[subxid] = spill.messages_since_change
            spill.messages_since_change = 0
        spill.file.write(RECORD.pack(subxid, lsn, len(payload)))
        spill.file.write(payload)
        spill.records += 1
        spill.bytes += RECORD.size + len(payload)
        self.spilled_bytes += RECORD.size + len(payload)

    def abort(self, xid: int, subxid: int) -> None:
        """The whole transaction (``subxid == xid``: its file goes) or one subtransaction (module docstring)."""
        spill = self._open.get(xid)
        if spill is None:
            return
        if subxid == xid:
            del self._open[xid]
            spill.file.close()
            return
        start = spill.first.pop(subxid, None)
        if start is None:  # no record of its own: the trailing messages could be its own, or not
            end, count = spill.records, spill.messages_since_change
        else:
            end, count = start, spill.gap.pop(subxid)
            spill.discarded.append((start, spill.records))
            for child in [s for s, first in spill.first.items() if first > start]:  # inside it: gone with it
                del spill.first[child], spill.gap[child]
            spill.messages_since_change = 0
        if count:  # the messages just before it (none but messages sit there): settled only if discarded anyway
            spill.open_questions.append((end - count, end, subxid))

    def commit(self, xid: int) -> Iterator[tuple[int, bytes]]:
        """``(lsn, payload)`` of the transaction in stream order, aborted subtransactions left out; the
        file is closed when the iterator is exhausted or closed. Nothing spilled: nothing given.

        Raises :class:`StreamedAbortAmbiguous` (before anything is given) when a message's fate is open.
        """
        spill = self._open.pop(xid, None)
        if spill is None:
            return iter(())
        for start, end, subxid in spill.open_questions:
            if not any(lo <= start and end <= hi for lo, hi in spill.discarded):
                spill.file.close()
                raise StreamedAbortAmbiguous(
                    f"streamed transaction {xid} rolled back subtransaction {subxid}, and {end - start} "
                    "transactional logical message(s) streamed just before its first change may be its own "
                    "or its parent's"
                )
        self.replayed_transactions += 1
        return self._replay(spill)

    @staticmethod
    def _replay(spill: _Spill) -> Iterator[tuple[int, bytes]]:
        ranges = sorted(spill.discarded)
        file = spill.file
        try:
            file.seek(0)  # flushes what is buffered; the same buffer then serves the reads
            r = 0
            for index in range(spill.records):
                _subxid, lsn, length = RECORD.unpack(file.read(RECORD.size))
                payload = file.read(length)
                while r < len(ranges) and ranges[r][1] <= index:
                    r += 1
                if r < len(ranges) and ranges[r][0] <= index and payload[0] not in _DESCRIPTIONS:
                    continue  # a rolled-back subtransaction's
                yield lsn, payload
        finally:
            file.close()

    def size_of(self, xid: int) -> int:
        """Bytes spilled so far for an open transaction (0: none)."""
        spill = self._open.get(xid)
        return 0 if spill is None else spill.bytes

    def held_bytes(self) -> int:
        """Bytes spilled for transactions still open (not yet committed or aborted)."""
        return sum(spill.bytes for spill in self._open.values())

    def __len__(self) -> int:
        """How many payloads are held for open transactions."""
        return sum(spill.records for spill in self._open.values())

    def close(self) -> None:
        """Drop every open transaction's file."""
        for spill in self._open.values():
            spill.file.close()
        self._open.clear()
