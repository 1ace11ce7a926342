"""In-progress transactions streamed by pgoutput protocol 2, held until their Stream Commit.

Between Stream Start and Stream Stop, pgoutput sends the changes of a transaction that
outgrew ``logical_decoding_work_mem`` before it commits, each carrying the xid of its
(sub)transaction; blocks of several transactions may interleave. At Stream Commit the
transaction's changes are given out in order; Stream Abort drops the whole transaction
(subtransaction xid = xid) or one subtransaction's changes (ROLLBACK TO SAVEPOINT).

Bound: O(changes of the open streamed transactions), held in memory. That is why the
decoder asks for streaming only when told to; spilling to disk is the TODO that would
make streaming worth turning on by default.

Thread safety: none; owned by one decoder.
"""

from __future__ import annotations

from capture.messages import ChangeMessage


class StreamedTransactions:
    """Changes of streamed transactions by top-level xid, each tagged with its subtransaction xid."""

    def __init__(self) -> None:
        self._held: dict[int, list[tuple[int, ChangeMessage]]] = {}

    def hold(self, xid: int, subxid: int, message: ChangeMessage) -> None:
        self._held.setdefault(xid, []).append((subxid, message))

    def commit(self, xid: int) -> list[ChangeMessage]:
        """The transaction's changes in stream order (none if nothing was held), forgotten here."""
        return [message for _, message in self._held.pop(xid, [])]

    def abort(self, xid: int, subxid: int) -> None:
        if subxid == xid:
            self._held.pop(xid, None)
        elif xid in self._held:
            self._held[xid] = [(sub, m) for sub, m in self._held[xid] if sub != subxid]

    def __len__(self) -> int:
        """How many changes are held (for tests and metrics)."""
        return sum(len(changes) for changes in self._held.values())
