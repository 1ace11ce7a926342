"""The native capture core against the Python reference path: identical events, key state, or the same error.

Differential: the same wal2json payloads go through the streaming source twice, once with
``core=python`` (every payload through capture.decoders.wal2json → capture.events) and once
with ``core=native`` (runs of payloads through the extension, the rest through the Python
path), cut into read-ahead batches at random places. Compared after the stream: every
record of every topic in the open batch (keys, values, headers, in order), the key state's
buffered changes, the TOAST cache, the transaction context (counters) and event index, the
position the batch would store, the event count; or the error (class and message) either
path raised. The clock is pinned (``now_ms``): envelopes carry the capture time.

Inputs: generated transactions (hypothesis) over three tables — every natively converted
type plus some that are not (arrays, interval, an extension type), NULLs, values in the
forms PostgreSQL prints and in unusual ones (``-0``, exponents, upper-case hex, offsets
with seconds, BC dates, ``24:00:00`` …), inserts, updates (key changes, a left-out TOAST
column, rows over the TOAST threshold), deletes, truncates, messages, a table not captured;
the same payloads mutated (bytes flipped, spans cut, JSON members dropped or retyped); and
the real payloads under ``fixtures/`` (as captured, and with their not-native columns left
out so that the core handles them). The end-to-end check against a real server is
``test_native_core_end_to_end``.

``TIDELINE_SOAK=1``: many more examples.
"""

from __future__ import annotations

import json
import pickle
import random
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import pytest
from capture_util import capture as capture_into
from capture_util import fresh_database, records, sql
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workload import soak

import capture.native.core
import capture.streaming
from capture.config import CaptureConfig, CoreChoice, NativeUnavailableError, SnapshotMode
from capture.converters import JsonConverter
from capture.decoders.pgoutput import PgOutputDecoder
from capture.decoders.wal2json import Wal2JsonDecoder
from capture.events import EventBuilder, ToastCache
from capture.incremental import IncrementalSnapshot
from capture.keystate import KeyState
from capture.messages import Decoder, Plugin
from capture.native import extension
from capture.native.core import NativeCore, native_core_for
from capture.offsets import OffsetContext
from capture.replication import ReplicationConnection, XLogData, XLogRun
from capture.sinks.embedded import EmbeddedLogSink
from capture.status import Stats, StatusReporter
from capture.streaming import StreamingSource
from capture.tables import TableCatalog, TableColumn, TableFilter, TableInfo
from capture.topics import TopicRouter
from capture.writer import LogWriter
from eventstore.log import Log
from tideline.pgharness import LocalPostgres

pytestmark = pytest.mark.skipif(not extension.available(), reason="tideline_native is not built (make native)")

EXAMPLES = 1_000 if soak() else 60
TIMEOUT_S = 3_600 if soak() else 600  # the suite's 600 s limit is shorter than the soak's examples under load
NOW_MS = 1_764_000_000_123
FIXTURES = Path(__file__).parent / "fixtures"


# ---------------------------------------------------------------------------- the two paths


class StaticCatalog(TableCatalog):
    """The catalog with its tables given: reading it again finds the same tables (a new generation)."""

    def __init__(self, tables: list[TableInfo], table_filter: TableFilter) -> None:
        super().__init__("postgresql://unused", table_filter)
        self._given = tables
        self.load()

    def load(self, conn: Any = None) -> list[TableInfo]:
        self._tables = {(t.schema, t.name): t for t in self._given}
        self.generation += 1
        return list(self._given)


@dataclass
class Outcome:
    error: tuple[str, str] | None
    topics: dict[str, tuple[list[bytes | None], list[bytes | None], Any]]
    keystate: dict[tuple[str, bytes], Any]
    toast: list[tuple[tuple[str, bytes], Any]]
    txn: Any
    index: int
    position: Any
    events: int
    unavailable_filled: int
    native_changes: int


@contextmanager
def pipeline(
    tmp: Path, core: CoreChoice, tables: list[TableInfo], plugin: Plugin = Plugin.WAL2JSON
) -> Iterator[StreamingSource]:
    """A streaming source over a real embedded log and key state that never commits (the batch is compared)."""
    config = CaptureConfig(dsn="postgresql://unused", slot="t", topic_prefix="d", core=core, plugin=plugin,
                           batch_bytes=1 << 40, batch_events=1 << 40, linger_ms=10**9, max_linger_ms=10**9)  # fmt: skip
    decoder: Decoder = (Wal2JsonDecoder() if plugin is Plugin.WAL2JSON
                        else PgOutputDecoder("pub", proto_version=2, streaming=True, spill_dir=tmp))  # fmt: skip
    table_filter = TableFilter(include=[t.qualified for t in tables if t.name != "not_captured"])
    with Log(tmp / f"log-{core.value}") as log:
        keystate = KeyState(tmp / f"ks-{core.value}.sqlite")
        try:
            catalog = StaticCatalog([t for t in tables if t.name != "not_captured"], table_filter)
            converter = JsonConverter()
            builder = EventBuilder("d", "db", table_filter, TopicRouter("d"), converter, ToastCache(1 << 20), keystate)
            sink = EmbeddedLogSink(log)
            sink.open("capture.diff")
            writer = LogWriter(config, sink, keystate, converter)
            stats = Stats()
            native = native_core_for(config, catalog, builder, writer, stats, decoder)
            assert (native is not None) == (core is CoreChoice.NATIVE)
            status = StatusReporter(config.dsn, config.slot, stats, 3600.0, 1 << 40)  # never ticked: nothing commits
            offsets = OffsetContext(None)
            incremental = IncrementalSnapshot(config, catalog, builder, writer, offsets, stats)  # never started
            yield StreamingSource(config, catalog, decoder, builder, writer, offsets, stats,
                                  status, threading.Event(), incremental, ("public", "tideline_signal"),
                                  native)  # fmt: skip
            writer.abort()
            sink.close()
        finally:
            keystate.close()
            decoder.close()


def run(core: CoreChoice, tables: list[TableInfo], payloads: list[bytes], cuts: list[int],
        plugin: Plugin = Plugin.WAL2JSON, lsns: list[int] | None = None) -> Outcome:  # fmt: skip
    """The payloads through one path, handed over in batches ending at ``cuts``; what it left behind.
    ``lsns``: each payload's XLogData WAL start (default: 16, 17, …)."""
    with (
        tempfile.TemporaryDirectory(prefix="native-diff-") as tmp,
        pipeline(Path(tmp), core, tables, plugin) as source,
    ):
        starts = lsns if lsns is not None else [16 + i for i in range(len(payloads))]
        stream = [XLogData(lsn, lsn, p) for lsn, p in zip(starts, payloads, strict=True)]
        # The batch never commits or confirms, so the replication connection is never spoken to.
        repl = cast(ReplicationConnection, None)
        error = None
        try:
            start = 0
            for end in [*sorted(set(cuts)), len(stream)]:
                if end > start:  # as the streaming source hands them over when the core is there
                    source._handle(XLogRun.of([m.raw() for m in stream[start:end]]), repl, None)
                    start = end
        except Exception as e:
            error = (type(e).__name__, str(e))
        writer, keystate = source.writer, source.writer.keystate
        names = {tid: topic for topic, tid in keystate._ids.items()}
        ctx = source._ctx
        return Outcome(
            error,
            {t: (*r.lists(), r.headers) for t, r in writer._records.items()},
            key_state(keystate, names),
            [(k, repr(v[0])) for k, v in source.builder.toast._entries.items()],
            None if ctx is None else (ctx.xid, ctx.commit_lsn, ctx.ts_ms, ctx.total_order, ctx.per_table),
            source._index,
            source.offsets.pending,
            source.stats.events,
            source.builder.unavailable_filled,
            source.native.changes if isinstance(source.native, NativeCore) else 0,
        )


def key_state(keystate: KeyState, names: dict[int, str]) -> dict[tuple[str, bytes], str]:
    """The live keys of the open (never committed) SQLite transaction, the buffered changes written into it
    first: (topic, key) → repr of its TOAST values (the Python values, NaN included: Decimal('NaN') != itself)."""
    keystate.flush()
    rows = keystate.db.execute("SELECT topic_id, key, toast FROM keys").fetchall()
    return {(names[tid], key): repr(None if toast is None else pickle.loads(toast)) for tid, key, toast in rows}


TALLY = {"runs": 0, "errors": 0, "native_changes": 0}  # over a test's examples: the checks must not be vacuous


def differential(tables: list[TableInfo], payloads: list[bytes], cuts: list[int],
                 plugin: Plugin = Plugin.WAL2JSON, lsns: list[int] | None = None) -> Outcome:  # fmt: skip
    """Both paths; their outcomes must be equal (the native path's own counter aside)."""
    reference = run(CoreChoice.PYTHON, tables, payloads, cuts, plugin, lsns)
    native = run(CoreChoice.NATIVE, tables, payloads, cuts, plugin, lsns)
    TALLY["runs"] += 1
    TALLY["errors"] += native.error is not None
    TALLY["native_changes"] += native.native_changes
    assert native.error == reference.error
    assert native.topics.keys() == reference.topics.keys()
    for topic, (keys, values, headers) in reference.topics.items():
        n_keys, n_values, n_headers = native.topics[topic]
        for i, (a, b) in enumerate(zip(n_values, values, strict=True)):
            assert a == b, f"{topic} record {i}: native {a!r} != python {b!r}"
        assert n_keys == keys, topic
        assert n_headers == headers, topic
    assert native.keystate == reference.keystate
    assert native.toast == reference.toast
    assert native.txn == reference.txn
    assert native.index == reference.index
    assert native.position == reference.position
    assert native.events == reference.events
    assert native.unavailable_filled == reference.unavailable_filled
    return native


@pytest.fixture(autouse=True)
def pinned_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capture.streaming, "now_ms", lambda: NOW_MS)
    monkeypatch.setattr(capture.native.core, "now_ms", lambda: NOW_MS)


# ---------------------------------------------------------------------------- tables and values

# (column, type name, type OID, TOAST-able): one of every natively converted type, and some that are not
COLUMNS = [
    ("i2", "smallint", 21), ("i4", "integer", 23), ("i8", "bigint", 20), ("o", "oid", 26),
    ("n", "numeric(12,2)", 1700), ("r", "real", 700), ("d", "double precision", 701), ("b", "boolean", 16),
    ("t", "text", 25), ("vc", "character varying(20)", 1043), ("ch", "character(3)", 1042), ("nm", "name", 19),
    ("c1", '"char"', 18), ("bx", "box", 603), ("j", "json", 114), ("jb", "jsonb", 3802), ("u", "uuid", 2950),
    ("by", "bytea", 17), ("dt", "date", 1082), ("ts", "timestamp without time zone", 1114),
    ("tz", "timestamp with time zone", 1184), ("tm", "time without time zone", 1083),
    ("tt", "time with time zone", 1266), ("iv", "interval", 1186), ("ar", "integer[]", 1007),
    ("ci", "citext", 16566),
]  # fmt: skip
NATIVE_OIDS = {21, 23, 20, 26, 1700, 700, 701, 16, 25, 1043, 1042, 19, 18, 603, 114, 3802, 2950, 17, 1082, 1114,
               1184, 1083, 1266}  # fmt: skip


def table(name: str, columns: list[tuple[str, str, int]], key: tuple[str, ...], ident: str = "d") -> TableInfo:
    cols = tuple(TableColumn(n, t, o) for n, t, o in columns)
    return TableInfo.make("public", name, cols, key, "primary key" if key else "none", ident)


WIDE = table("wide", [("id", "integer", 23), *COLUMNS], ("id",))
FULL = table("full", [("a", "text", 25), ("b", "bigint", 20), ("v", "text", 25), ("n", "numeric", 1700)], ("a", "b"),
             "f")  # fmt: skip
NOKEY = table("nokey", [("v", "text", 25), ("x", "integer", 23)], ())
OTHER = table("not_captured", [("id", "integer", 23)], ("id",))
TABLES = [WIDE, FULL, NOKEY, OTHER]


def q(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def offset_text(seconds: int) -> str:
    sign = "-" if seconds < 0 else "+"
    h, rest = divmod(abs(seconds), 3600)
    m, s = divmod(rest, 60)
    return f"{sign}{h:02d}" + (f":{m:02d}" if m or s else "") + (f":{s:02d}" if s else "")


def fraction(micros: int) -> str:
    return f".{micros:06d}".rstrip("0") if micros else ""


def stamp(d: datetime) -> str:
    """A timestamp as PostgreSQL prints it (DateStyle ISO): the year in 4 digits, the fraction trimmed."""
    return f"{d.year:04d}-{d.month:02d}-{d.day:02d} {d:%H:%M:%S}{fraction(d.microsecond)}"


offsets = st.integers(-15 * 3600, 15 * 3600).map(offset_text) | st.sampled_from(["+00", "-00", "+05:30", "+05:53:28"])
floats = st.floats(allow_nan=False, allow_infinity=False)
float_tokens = floats.map(repr) | st.sampled_from(["-0", "0", "5", "-0.0", "1e+20", "1.5e-05", "1E400", '"1.5"'])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | floats | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
times = st.times().map(lambda t: f"{t:%H:%M:%S}{fraction(t.microsecond)}")


def canonical_tokens(oid: int) -> st.SearchStrategy[str]:
    """wal2json's JSON token for a value of the type as PostgreSQL prints it."""
    if oid in (21, 23, 20, 26):
        return st.integers(-(2**63), 2**63 - 1).map(str)
    if oid == 1700:
        return st.decimals(allow_nan=False, allow_infinity=False, places=3).map(lambda d: format(d, "f"))
    if oid in (700, 701):
        return floats.map(repr)
    if oid == 16:
        return st.sampled_from(["true", "false"])
    if oid in (25, 1043, 1042, 19, 18, 603):
        return st.text(max_size=20).map(q)
    if oid in (114, 3802):
        return json_values.map(lambda v: q(json.dumps(v)))
    if oid == 2950:
        return st.uuids().map(lambda u: q(str(u)))
    if oid == 17:
        return st.binary(max_size=12).map(lambda b: q(b.hex()))
    if oid == 1082:
        return st.dates().map(lambda d: q(d.isoformat()))
    if oid == 1114:
        return st.datetimes().map(lambda d: q(stamp(d)))
    if oid == 1184:
        return st.builds(lambda d, o: q(stamp(d) + o), st.datetimes(), offsets)
    if oid == 1083:
        return times.map(q)
    if oid == 1266:
        return st.builds(lambda t, o: q(t + o), times, offsets)
    if oid == 1186:
        return st.sampled_from([q("1 day 02:03:04"), q("-1 years -2 mons +3 days -04:05:06.789"), q("00:00:00")])
    if oid == 1007:
        return st.sampled_from([q("{1,2,NULL}"), q("{}"), q("{{1,2},{3,4}}")])
    return st.text(max_size=10).map(q)


UNUSUAL: dict[tuple[int, ...], list[str]] = {
    (21, 23, 20, 26): ["-0", "1.0", '"12"', "true", "1e3", "123456789012345678901", "18446744073709551615",
                       "18446744073709551616", "-9223372036854775809"],
    (1700,): ["-0", "-0.00", "0", "1e5", "12345678901234567890.123456789", '"1.5"', "1E-2"],
    (700, 701): ["-0", "0", "5", "-0.0", "1e+20", "1.5e-05", "1E400", '"1.5"', "123456789012345678901234567890"],
    (16,): ['"t"', "1"],
    (25, 1043, 1042, 19, 18, 603): ['"__debezium_unavailable_value"', "1", '"\\ud800"', '"\\u0000\\u001f\\u007f"'],
    (114, 3802): [q('{"a": 1.10}'), q("1e400"), q("NaN"), q(" [1 , 2] "), q("{"), "{}", q('{"a":1,"a":2}')],
    (2950,): [q("A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11"), q("{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}"),
              q("a0eebc999c0b4ef8bb6d6bb9bd380a11"), q("x")],
    (17,): [q("\\x00ff"), q("ABCD"), q("abc"), q("00 ff"), q("zz")],
    (1082,): [q("infinity"), q("0044-03-15 BC"), q("20240101"), q("2024-02-30"), q("12024-01-01")],
    (1114,): [q("infinity"), q("2024-01-01 00:00:00.1234567"), q("2024-01-01 24:00:00"), q("2024-01-01 00:00:00+00"),
              q("0001-01-01 00:00:00"), q("2024-01-01T00:00:00")],
    (1184,): [q("-infinity"), q("2024-01-01 00:00:00"), q("0044-03-15 12:00:00+00 BC"), q("2024-01-01 00:00:00Z"),
              q("2024-01-01 00:00:00+0530")],
    (1083,): [q("24:00:00"), q("04:05"), q("04:05:06+02"), q("04:05:06.0000001")],
    (1266,): [q("04:05:06"), q("24:00:00+00"), q("04:05:06+24")],
}  # fmt: skip


def value_tokens(oid: int) -> st.SearchStrategy[str]:
    """Mostly as PostgreSQL prints it; NULL now and then, an unusual form rarely (types the core does not
    convert: mostly NULL, which it does handle)."""
    unusual = next((v for oids, v in UNUSUAL.items() if oid in oids), None)

    def pick(k: int) -> st.SearchStrategy[str]:
        if oid not in NATIVE_OIDS:
            return canonical_tokens(oid) if k == 0 else st.just("null")
        if k < 2:
            return st.just("null")
        if k == 2 and unusual:
            return st.sampled_from(unusual)
        return canonical_tokens(oid)

    return st.integers(0, 29).flatmap(pick)


def column_values(tbl: TableInfo, key_values: dict[str, str]) -> st.SearchStrategy[dict[str, str]]:
    """Tokens for every column of a row, the key columns as given."""
    return st.fixed_dictionaries(
        {c.name: st.just(key_values[c.name]) if c.name in key_values else value_tokens(c.type_oid) for c in tbl.columns}
    )


# ---------------------------------------------------------------------------- wal2json records


def lsn_text(n: int) -> str:
    return f"{n >> 32:X}/{n & 0xFFFFFFFF:X}"


def columns_json(tbl: TableInfo, values: dict[str, str]) -> str:
    types = {c.name: c for c in tbl.columns}
    return "[" + ",".join(
        f'{{"name":{q(n)},"type":{q(types[n].type_name)},"typeoid":{types[n].type_oid},"value":{v}}}'
        for n, v in values.items()
    ) + "]"  # fmt: skip


def row_record(action: str, xid: int, ts: str, lsn: int, tbl: TableInfo, columns: dict[str, str] | None,
               identity: dict[str, str] | None) -> bytes:  # fmt: skip
    out = f'{{"action":"{action}","xid":{xid},"timestamp":"{ts}","lsn":"{lsn_text(lsn)}","schema":"public",'
    out += f'"table":{q(tbl.name)}'
    if columns is not None:
        out += f',"columns":{columns_json(tbl, columns)}'
    if identity is not None:
        out += f',"identity":{columns_json(tbl, identity)}'
    types = {c.name: c for c in tbl.columns}
    pk = ",".join(f'{{"name":{q(k)},"type":{q(types[k].type_name)},"typeoid":{types[k].type_oid}}}' for k in tbl.key)
    return (out + f',"pk":[{pk}]}}').encode()


@st.composite
def transactions(draw: st.DrawFn) -> list[bytes]:
    """A stream of wal2json transactions over TABLES (payload per record, B and C included)."""
    payloads: list[bytes] = []
    live: dict[str, dict[tuple[str, ...], dict[str, str]]] = {t.name: {} for t in TABLES}
    lsn = 0x1000000
    for xid in range(700, 700 + draw(st.integers(1, 3))):
        ts = draw(st.sampled_from(["2026-11-22 10:12:46.7871+00", "2026-11-22 10:12:47+00", "2026-11-22 12:00:00+02"]))
        commit = lsn + 100_000
        payloads.append(f'{{"action":"B","xid":{xid},"timestamp":"{ts}","lsn":"{lsn_text(commit)}",'
                        f'"nextlsn":"{lsn_text(commit + 48)}"}}'.encode())  # fmt: skip
        for _ in range(draw(st.integers(0, 16))):
            lsn += 64
            tbl = draw(st.sampled_from(TABLES))
            rows = live[tbl.name]
            op = draw(st.sampled_from(["I", "I", "U", "U", "D", "T", "M"] if tbl.key else ["I", "I", "T"]))
            key_values = {}
            if tbl is WIDE or tbl is OTHER:
                key_values = {"id": str(draw(st.integers(1, 6)))}
            elif tbl is FULL:
                key_values = {"a": q(draw(st.sampled_from(["x", "y", "é\"z"]))), "b": str(draw(st.integers(0, 2)))}
            if op in ("U", "D") and rows and draw(st.booleans()):
                old_key = draw(st.sampled_from(sorted(rows)))
                key_values = dict(zip(tbl.key, old_key, strict=True))
            if tbl is OTHER:
                key_values = {"id": str(draw(st.integers(1, 6)))}
                values = {"id": key_values["id"]}
            else:
                values = draw(column_values(tbl, key_values))
            if tbl is WIDE and draw(st.integers(0, 9)) == 0:
                values["t"] = q("big " * 300)  # over the TOAST threshold: the TOAST cache keeps it
            key = tuple(values[k] for k in tbl.key)
            if op == "I":
                payloads.append(row_record("I", xid, ts, lsn, tbl, values, None))
                rows[key] = values
            elif op == "U":
                old = key
                if draw(st.integers(0, 5)) == 0 and tbl is WIDE:  # a key change
                    values["id"] = str(draw(st.integers(1, 6)))
                    key = (values["id"],)
                after = dict(values)
                if draw(st.integers(0, 5)) == 0 and tbl is not OTHER:  # an unchanged TOAST column left out
                    after.pop("t" if tbl is WIDE else "v", None)
                identity = ({k: v for k, v in zip(tbl.key, old, strict=True)} if tbl.replica_identity != "f"
                            else rows.get(old, values))  # fmt: skip
                payloads.append(row_record("U", xid, ts, lsn, tbl, after, identity if draw(st.booleans()) or old != key
                                           else None))  # fmt: skip
                rows.pop(old, None)
                rows[key] = values
            elif op == "D":
                full = tbl.replica_identity == "f"
                identity = rows.get(key, values) if full else dict(zip(tbl.key, key, strict=True))
                payloads.append(row_record("D", xid, ts, lsn, tbl, None, identity))
                rows.pop(key, None)
            elif op == "T":
                payloads.append(f'{{"action":"T","xid":{xid},"timestamp":"{ts}","lsn":"{lsn_text(lsn)}",'
                                f'"schema":"public","table":{q(tbl.name)}}}'.encode())  # fmt: skip
                rows.clear()
            else:
                payloads.append(f'{{"action":"M","xid":{xid},"timestamp":"{ts}","lsn":"{lsn_text(lsn)}",'
                                '"transactional":true,"prefix":"p","content":"hi"}'.encode())  # fmt: skip
        payloads.append(f'{{"action":"C","xid":{xid},"timestamp":"{ts}","lsn":"{lsn_text(commit)}",'
                        f'"nextlsn":"{lsn_text(commit + 48)}"}}'.encode())  # fmt: skip
        lsn = commit + 1000
    return payloads


def cut_points(n: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, max(n, 0)), max_size=6)


RETYPED = ['null', '1', '"x"', '[]', '{}', 'true', '1.5', '-0', '"0/1"']  # fmt: skip


def mutate(payload: bytes, rnd: random.Random) -> bytes:
    """One byte-level or JSON-level edit of a payload."""
    kind = rnd.randrange(7)
    if kind == 0 and payload:  # flip a byte
        i = rnd.randrange(len(payload))
        return payload[:i] + bytes([payload[i] ^ (1 << rnd.randrange(8))]) + payload[i + 1 :]
    if kind == 1 and payload:  # cut a span
        i = rnd.randrange(len(payload))
        return payload[:i] + payload[i + rnd.randrange(1, 8) :]
    if kind == 2:  # duplicate a span
        i = rnd.randrange(len(payload) + 1)
        return payload[:i] + payload[max(0, i - 12) : i] + payload[i:]
    try:
        record = json.loads(payload)
    except ValueError:
        return payload[: len(payload) // 2]
    if kind == 6 and isinstance(record, dict) and isinstance(record.get("columns"), list) and record["columns"]:
        # an identity where the reference reads one too (an INSERT's is converted and checked as well)
        column = dict(rnd.choice(record["columns"]))
        column["value"] = json.loads(rnd.choice(RETYPED))
        record["identity"] = [column]
        return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    target: Any = record
    if isinstance(record, dict) and record.get("columns") and rnd.random() < 0.7:
        target = rnd.choice(record["columns"])
    if not isinstance(target, dict) or not target:
        return payload
    field = rnd.choice(sorted(target))
    if kind == 3:
        del target[field]
    else:
        target[field] = json.loads(rnd.choice(RETYPED))
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------- the tests

SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                    HealthCheck.data_too_large])  # fmt: skip


@pytest.fixture
def tally() -> Iterator[dict[str, int]]:
    TALLY.update(runs=0, errors=0, native_changes=0)
    yield TALLY


@pytest.mark.timeout(TIMEOUT_S)
def test_generated_streams_are_identical(tally: dict[str, int]) -> None:
    generated_streams()
    assert_not_vacuous(tally)


def assert_not_vacuous(tally: dict[str, int]) -> None:
    """Most generated streams decoded, and the core handled many of their changes."""
    assert tally["errors"] < tally["runs"] * 0.8, tally
    assert tally["native_changes"] > tally["runs"] // 2, tally  # 52 to 249 in 60 runs seen: random examples


@SETTINGS
@given(data=st.data())
def generated_streams(data: st.DataObject) -> None:
    payloads = data.draw(transactions())
    differential(TABLES, payloads, data.draw(cut_points(len(payloads))))


@pytest.mark.timeout(TIMEOUT_S)
def test_mutated_streams_are_identical(tally: dict[str, int]) -> None:
    mutated_streams()
    assert tally["native_changes"] > 0, tally


@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def mutated_streams(data: st.DataObject, seed: int) -> None:
    payloads = data.draw(transactions())
    rnd = random.Random(seed)
    for _ in range(rnd.randrange(1, 4)):
        i = rnd.randrange(len(payloads))
        payloads[i] = mutate(payloads[i], rnd)
    differential(TABLES, payloads, data.draw(cut_points(len(payloads))))


def test_the_core_handles_the_common_case() -> None:
    """Inserts, updates and deletes of ordinary rows take the native core (not only the fallback)."""
    key = {"id": "1"}
    insert = {c.name: "null" for c in WIDE.columns} | key | {"t": q("a"), "n": "12.30", "ts": q("2024-01-01 00:00:00")}
    rows = [
        row_record("I", 700, "2026-11-22 10:12:47+00", 0x1000040 + i, WIDE, insert | {"id": str(i)}, None)
        for i in range(1, 6)
    ]
    rows += [row_record("U", 700, "2026-11-22 10:12:47+00", 0x1000100, WIDE, insert | {"b": "true"}, key),
             row_record("D", 700, "2026-11-22 10:12:47+00", 0x1000140, WIDE, None, key)]  # fmt: skip
    begin = b'{"action":"B","xid":700,"timestamp":"2026-11-22 10:12:47+00","lsn":"0/1100000","nextlsn":"0/1100030"}'
    commit = b'{"action":"C","xid":700,"timestamp":"2026-11-22 10:12:47+00","lsn":"0/1100000","nextlsn":"0/1100030"}'
    # the first change of a table takes the Python path (which registers the table); the rest are native
    outcome = differential(TABLES, [begin, *rows, commit], [])
    assert outcome.error is None
    assert outcome.native_changes == len(rows) - 1
    values = outcome.topics["d.public.wide"][1]
    assert len(values) == len(rows) + 1  # the DELETE's tombstone
    assert values[-1] is None


def fixture_payloads() -> list[bytes]:
    return [p.read_bytes().rstrip(b"\n") for p in sorted(FIXTURES.glob("*.json"))]


def fixture_tables(payloads: list[bytes]) -> list[TableInfo]:
    """The tables of the captured fixtures, as their payloads describe them (key: "id")."""
    found: dict[str, list[tuple[str, str, int]]] = {}
    for payload in payloads:
        try:
            record = json.loads(payload, parse_float=Decimal)
        except ValueError:
            continue  # the binary message: not JSON text
        for col in record.get("columns") or []:
            cols = found.setdefault(record["table"], [])
            if col["name"] not in [c[0] for c in cols]:
                cols.append((col["name"], col["type"], col["typeoid"]))
    return [table(name, cols, ("id",)) for name, cols in found.items()]


class Token(str):
    """A JSON number token, kept as written."""


def write(value: Any) -> str:
    """JSON text as wal2json writes it (numbers as they were, no spaces)."""
    if isinstance(value, Token):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{q(k)}:{write(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(write(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def without_foreign_columns(payload: bytes) -> bytes:
    """The payload with its columns of types the core does not convert left out (so that it handles it)."""
    record = json.loads(payload, parse_float=Token, parse_int=Token)
    for part in ("columns", "identity"):
        if part in record:
            record[part] = [c for c in record[part] if int(c["typeoid"]) in NATIVE_OIDS]
    return write(record).encode()


def test_captured_fixtures_are_identical() -> None:
    payloads = fixture_payloads()
    begin = next(p for p in payloads if b'"action":"B"' in p)
    commit = next(p for p in payloads if b'"action":"C"' in p)
    rows = [p for p in payloads if b'"action":"I"' in p or b'"action":"U"' in p]
    native_rows = [without_foreign_columns(p) for p in rows]
    tables = fixture_tables(native_rows)
    # every row twice: the first of a table registers it, the second takes the native core (when it can)
    for stream in ([begin, *rows, *rows, commit], [begin, *native_rows, *native_rows, commit], payloads):
        differential(tables, stream, [3])
    outcome = differential(tables, [begin, *native_rows, *native_rows, commit], [])
    assert outcome.native_changes >= 2


def test_core_native_without_the_extension_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extension, "BUILT", False)
    with pytest.raises(NativeUnavailableError, match="not built; run `make native`"):
        CaptureConfig(dsn="postgresql://x", core=CoreChoice.NATIVE).validate()
    config = CaptureConfig(dsn="postgresql://x", core=CoreChoice.AUTO)
    config.validate()  # auto: the Python path


def test_core_choice_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDELINE_CAPTURE_CORE", "python")
    assert CaptureConfig(dsn="postgresql://x").core is CoreChoice.PYTHON
    monkeypatch.setenv("TIDELINE_CAPTURE_CORE", "fast")
    with pytest.raises(Exception, match="TIDELINE_CAPTURE_CORE must be one of auto, python, native"):
        CaptureConfig(dsn="postgresql://x")


# ---------------------------------------------------------------------------- end to end


def test_native_core_end_to_end(postgres: LocalPostgres, tmp_path: Path) -> None:
    """A real server's stream captured by both cores into two logs: the same records (but the capture time)."""
    db = fresh_database(postgres, "native_e2e")
    sql(db, "CREATE TABLE acct (id bigint PRIMARY KEY, owner text, balance numeric(12,2), seen timestamptz, "
            "tags text[], doc jsonb, raw bytea, ok boolean, r real)")  # fmt: skip
    sql(db, "SELECT pg_create_logical_replication_slot('py', 'wal2json')")
    sql(db, "SELECT pg_copy_logical_replication_slot('py', 'nat')")
    sql(db, "INSERT INTO acct SELECT g, 'owner ' || g, g / 7.0, '2024-03-31 01:30:00.5+00'::timestamptz + g * "
            "interval '1 hour', ARRAY['a', g::text], jsonb_build_object('g', g, 'f', g / 3.0), "
            "decode(md5(g::text), 'hex'), g % 2 = 0, g / 3.0 FROM generate_series(1, 300) g")  # fmt: skip
    sql(db, "UPDATE acct SET balance = balance + 1, tags = NULL WHERE id % 3 = 0")
    sql(db, "UPDATE acct SET owner = repeat('x', 3000) WHERE id = 5")  # big: the TOAST cache keeps it
    sql(db, "UPDATE acct SET ok = NOT ok WHERE id = 5")  # owner left out (unchanged TOAST): filled
    sql(db, "UPDATE acct SET id = 1000 WHERE id = 7")  # a key change
    sql(db, "DELETE FROM acct WHERE id % 5 = 0")
    sql(db, "TRUNCATE acct")
    sql(db, "INSERT INTO acct (id, owner) VALUES (1, 'after truncate')")
    logs = {}
    for slot, core in (("py", CoreChoice.PYTHON), ("nat", CoreChoice.NATIVE)):
        logs[core] = tmp_path / slot
        stats = capture_into(logs[core], db, slot=slot, snapshot=SnapshotMode.NEVER, core=core)
        assert stats.events > 600
    topic = "cdc.public.acct"
    python, native = records(logs[CoreChoice.PYTHON], topic), records(logs[CoreChoice.NATIVE], topic)
    for stored in (python, native):
        for _, value, _ in stored:
            if value is not None:
                value.pop("ts_ms")  # the capture time
    assert native == python
    assert len(native) > 600
