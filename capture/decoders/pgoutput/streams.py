"""In-progress transactions streamed by pgoutput (protocol ≥ 2), spilled to disk until their Stream Commit.

Between Stream Start and Stream Stop, pgoutput sends the changes of a transaction that
outgrew ``logical_decoding_work_mem`` before it commits, each carrying the xid of its
(sub)transaction; blocks of several transactions may interleave, and ordinary
transactions may come between the blocks. Nothing of such a transaction may reach the
log before its Stream Commit (it may still abort), and holding it in memory would make
memory O(transaction). So each payload is appended, **raw**, to a temporary file of its
top-level transaction, and decoded only at Stream Commit, in the order it came:

* file layout: records of ``subxid (uint32) | XLogData LSN (uint64) | length (uint32) |
  payload``, big-endian (:data:`RECORD`), appended in stream order;
* Stream Abort of the whole transaction (subtransaction xid = xid) deletes its file:
  nothing of it is ever decoded; Stream Abort of a subtransaction (``ROLLBACK TO
  SAVEPOINT``, one abort per aborted subtransaction) marks its xid, and the replay skips
  its records;
* Relation and Type messages inside a stream are spilled and replayed with the changes,
  as PostgreSQL's own subscriber does: they describe the table as the streamed
  transaction saw it, and apply to the decoder's cache only once it commits (pgoutput
  then counts that description as sent).

Files are anonymous (``tempfile.TemporaryFile``: unlinked at once, gone with the process,
even after kill -9) in the directory given (the connector's state directory). Memory:
one buffer per open transaction (:data:`BUFFER_BYTES`), whatever the transaction's size.

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

RECORD = struct.Struct("!IQI")  # subtransaction xid, XLogData LSN, payload length
BUFFER_BYTES = 1 << 20  # per open transaction's file: its writes, then its replay's reads


@dataclass(slots=True)
class _Spill:
    file: IO[bytes]
    records: int = 0
    bytes: int = 0
    aborted: set[int] = field(default_factory=set)  # subtransactions rolled back


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
        spill.file.write(RECORD.pack(subxid, lsn, len(payload)))
        spill.file.write(payload)
        spill.records += 1
        spill.bytes += RECORD.size + len(payload)
        self.spilled_bytes += RECORD.size + len(payload)

    def abort(self, xid: int, subxid: int) -> None:
        """The whole transaction (``subxid == xid``: its file goes) or one subtransaction (skipped on replay)."""
        if subxid == xid:
            spill = self._open.pop(xid, None)
            if spill is not None:
                spill.file.close()
        elif xid in self._open:
            self._open[xid].aborted.add(subxid)

    def commit(self, xid: int) -> Iterator[tuple[int, bytes]]:
        """``(lsn, payload)`` of the transaction in stream order, aborted subtransactions left out; the
        file is closed when the iterator is exhausted or closed. Nothing spilled: nothing given."""
        spill = self._open.pop(xid, None)
        if spill is None:
            return iter(())
        self.replayed_transactions += 1
        return self._replay(spill)

    @staticmethod
    def _replay(spill: _Spill) -> Iterator[tuple[int, bytes]]:
        file = spill.file
        try:
            file.seek(0)  # flushes what is buffered; the same buffer then serves the reads
            for _ in range(spill.records):
                subxid, lsn, length = RECORD.unpack(file.read(RECORD.size))
                payload = file.read(length)
                if subxid not in spill.aborted:
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
