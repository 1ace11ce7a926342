"""The native core checked against the Python reference while it runs (``TIDELINE_NATIVE_VERIFY=1``).

Issue 16 asks that every payload the test suite captures go through the native core and the
Python reference path alike, with identical results. With this switch on, after every run the
native core handles (capture.native.core), the same payloads go through the reference as well — the
decoder (the stream's own for pgoutput, whose Relation messages the core mirrors; a fresh one for
wal2json, whose payloads stand alone), then ``EventBuilder.change`` with a copy of the transaction
context, the same clock reading, and the table and topic the core used — and these must be equal:

* each topic's records, keys and values, in order (natively handled changes carry no headers);
* the key-state changes (each key's last put or delete) and the TOAST cache entries dropped;
* the transaction's counters (``total_order``, per table) and the next event index.

The reference's key-state and TOAST-cache calls are recorded, not applied (the core's results are
applied, as without the switch); a reference that would use them otherwise (a TOAST fill, a big
row) is a difference too. The first difference raises :class:`NativeMismatchError` naming the
topic, the record and both values; the connector stops there, before that run's events are added
to the batch. Partitions are not compared: the sink assigns them from the record keys
(eventstore.partitioner, like Kafka's murmur2), one function of the bytes compared here.

The test suite turns it on for every test (tests/conftest.py sets the variable; connectors the
tests start as processes inherit it), so every payload the suite's connectors hand the core is
checked. Off by default: it costs the Python path's time for every natively handled change.

Thread-safety: none; used by the connector thread with its NativeCore.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from capture.decoders.wal2json import Wal2JsonDecoder
from capture.errors import CaptureError
from capture.keystate import DELETE_MARKER, KeySet
from capture.messages import Kind
from capture.native.handle import binary_array, changed_keys
from capture.replication import XLOG_BODY, XLOG_HEADER

if TYPE_CHECKING:
    from capture.decoders.pgoutput import PgOutputDecoder
    from capture.events import EventBuilder, TxnContext
    from capture.tables import TableInfo

ENV = "TIDELINE_NATIVE_VERIFY"


def enabled() -> bool:
    """Whether ``TIDELINE_NATIVE_VERIFY`` asks for the check (set, and not ``0``)."""
    return os.environ.get(ENV, "").strip() not in ("", "0")


class NativeMismatchError(CaptureError):
    """The native core and the Python reference disagree about a run of payloads (a bug in one of them)."""


class _KeyStateCalls:
    """Stands in for the key state while the reference runs: records a key's last put or delete."""

    def __init__(self) -> None:
        self.changes: dict[tuple[str, bytes], Any] = {}

    def put(self, topic: str, key: bytes, toast: dict[str, Any] | None) -> None:
        if toast is not None:
            raise NativeMismatchError(f"{topic}: the reference kept TOAST values for key {key!r}, a row the native "
                                      "core must leave to the Python path")  # fmt: skip
        self.changes[(topic, key)] = None

    def delete(self, topic: str, key: bytes) -> None:
        self.changes[(topic, key)] = DELETE_MARKER

    def __getattr__(self, name: str) -> Any:
        raise NativeMismatchError(f"the reference used the key state's {name!r} for a change the native core "
                                  "handled (only the Python path may need it)")  # fmt: skip


class _ToastCalls:
    """Stands in for the TOAST cache while the reference runs: records the entries dropped."""

    def __init__(self) -> None:
        self.dropped: set[tuple[str, bytes]] = set()

    def drop(self, topic: str, key: bytes) -> None:
        self.dropped.add((topic, key))

    def __getattr__(self, name: str) -> Any:
        raise NativeMismatchError(f"the reference used the TOAST cache's {name!r} for a change the native core "
                                  "handled (only the Python path may need it)")  # fmt: skip


class ReferenceCheck:
    """Runs a native run's payloads through the reference path and compares (see the module docstring)."""

    def __init__(self, builder: EventBuilder, pgoutput: PgOutputDecoder | None) -> None:
        self.builder = builder
        self.pgoutput = pgoutput
        self._wal2json = Wal2JsonDecoder() if pgoutput is None else None
        self.checked = 0  # changes compared (tests: the check is not vacuous)

    def check(
        self,
        messages: Sequence[bytes],
        ctx: TxnContext,
        index: int,
        now: int,
        table_of: dict[tuple[str, str], tuple[TableInfo, str]],
        result: tuple[int, int, list[tuple[str, int]], list[tuple[Any, ...]]],
        topic_of: dict[int, str],
    ) -> None:
        """``messages``: the XLogData messages the core handled (b"w", header, payload), from event ``index``
        of ``ctx`` (as it was before the run) at clock ``now``; ``table_of``: (schema, name) → the table and topic
        the core registered; ``result``: the core's ``(next index, total_order, per-table counts, outputs)``;
        ``topic_of``: the core's table ids → topics. Raises :class:`NativeMismatchError` at the first difference."""
        next_index, total_order, counts, outputs = result
        builder = self.builder
        keystate, toast = _KeyStateCalls(), _ToastCalls()
        saved = builder.keystate, builder.toast
        mine = dataclasses.replace(ctx, per_table=dict(ctx.per_table or {}), source_prefix=dict(ctx.source_prefix))
        expected: dict[str, tuple[list[bytes | None], list[bytes | None]]] = {}
        builder.keystate, builder.toast = keystate, toast  # type: ignore[assignment]  # recorders, see above
        try:
            for raw in messages:
                start, _, _ = XLOG_HEADER.unpack_from(raw, 1)
                payload = raw[XLOG_BODY:]
                decoder: Any = self.pgoutput if self.pgoutput is not None else self._wal2json
                for m in decoder.decode(payload, start):
                    if m.kind not in (Kind.INSERT, Kind.UPDATE, Kind.DELETE) or m.schema is None or m.table is None:
                        raise NativeMismatchError(f"the native core handled a {m.kind.name} message at WAL "
                                                  f"{start}: only row changes are its")  # fmt: skip
                    found = table_of.get((m.schema, m.table))
                    if found is None:
                        raise NativeMismatchError(f"the native core handled a change of {m.schema}.{m.table}, "
                                                  "a table it has no registration for")  # fmt: skip
                    table, topic = found
                    keys, values = expected.setdefault(topic, ([], []))
                    for event in builder.change(m, table, mine, index, now, topic):
                        if event.headers is not None:
                            raise NativeMismatchError(f"{topic}: the reference wrote headers for a change the "
                                                      "native core handled")  # fmt: skip
                        keys.append(event.key)
                        values.append(event.value)
                    index += 1
        finally:
            builder.keystate, builder.toast = saved
        got: dict[str, tuple[list[bytes | None], list[bytes | None]]] = {}
        changes: dict[tuple[str, bytes], Any] = {}
        dropped: set[tuple[str, bytes]] = set()
        for tid, _n, key_buffers, value_buffers, _nbytes, puts, deletes in outputs:
            topic = topic_of[tid]
            keys = binary_array(key_buffers)
            got_keys, got_values = got.setdefault(topic, ([], []))
            got_keys.extend(keys.to_pylist())
            got_values.extend(binary_array(value_buffers).to_pylist())
            for keys_of, marker in ((puts, None), (deletes, DELETE_MARKER)):  # each key's last change
                changes.update(((topic, k), marker) for k in (KeySet(*keys_of).keys() if keys_of else ()))
            dropped.update((topic, k) for k in changed_keys(keys))  # each change drops its key (its row is small)
        self._compare_records(expected, got)
        if changes != keystate.changes:
            raise NativeMismatchError(f"key-state changes differ: native {_brief(changes)} != python "
                                      f"{_brief(keystate.changes)}")  # fmt: skip
        if dropped != toast.dropped:
            raise NativeMismatchError(f"TOAST cache drops differ: native {sorted(dropped)[:5]} != python "
                                      f"{sorted(toast.dropped)[:5]}")  # fmt: skip
        per_table = dict(ctx.per_table or {})
        per_table.update(counts)
        if (next_index, total_order, per_table) != (index, mine.total_order, mine.per_table):
            raise NativeMismatchError(
                f"transaction counters differ: native (next index {next_index}, total_order {total_order}, "
                f"{per_table}) != python ({index}, {mine.total_order}, {mine.per_table})"
            )
        self.checked += len(messages)

    @staticmethod
    def _compare_records(
        expected: dict[str, tuple[list[bytes | None], list[bytes | None]]],
        got: dict[str, tuple[list[bytes | None], list[bytes | None]]],
    ) -> None:
        if sorted(got) != sorted(expected):
            raise NativeMismatchError(f"topics differ: native {sorted(got)} != python {sorted(expected)}")
        for topic, (keys, values) in expected.items():
            got_keys, got_values = got[topic]
            if len(got_values) != len(values):
                raise NativeMismatchError(f"{topic}: native wrote {len(got_values)} records, python {len(values)}")
            for i, (a, b, ka, kb) in enumerate(zip(got_values, values, got_keys, keys, strict=True)):
                if ka != kb:
                    raise NativeMismatchError(f"{topic} record {i} of the run: key native {ka!r} != python {kb!r}")
                if a != b:
                    raise NativeMismatchError(f"{topic} record {i} of the run: value native {a!r} != python {b!r}")


def _brief(changes: dict[tuple[str, bytes], Any]) -> str:
    shown = sorted(changes.items(), key=lambda kv: kv[0])[:5]
    return repr([(k, "DELETE" if v is DELETE_MARKER else v) for k, v in shown]) + ("…" if len(changes) > 5 else "")
