"""The native capture core for pgoutput against the Python reference path: identical events, key state, or the
same error (the harness and the comparison are test_native_core's; see its docstring).

Inputs: generated pgoutput streams (hypothesis) over test_native_core's tables — Relation messages (sent
again now and then, sometimes with a column's type changed, which the core must notice), Begin/Commit,
Inserts, Updates (no old tuple, a 'K' old key, a key change, an 'O' old row under REPLICA IDENTITY FULL, an
unchanged-TOAST 'u' column, rows over the TOAST threshold), Deletes ('K' and 'O'), Truncates, logical
messages, a table not captured, and streamed transactions (protocol 2: Stream Start/Stop/Commit with the
xid prefix, replayed by the Python decoder) — with values in the text forms PostgreSQL prints (NaN and
±Infinity of numeric and real/double included) and in unusual ones; the same streams mutated (bytes
flipped, spans cut or duplicated); and real payloads read from a server's pgoutput slot. The end-to-end
check runs the connector with ``--plugin pgoutput`` on both cores against a real server.

``TIDELINE_SOAK=1``: many more examples.
"""

from __future__ import annotations

import json
import random
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from capture_util import capture as capture_into
from capture_util import drop_slots, fresh_database, records, sql
from hypothesis import given
from hypothesis import strategies as st
from test_native_core import (  # noqa: F401 (pinned_clock: an autouse fixture, used here too)
    FULL,
    NATIVE_OIDS,
    NOKEY,
    OTHER,
    SETTINGS,
    TABLES,
    TALLY,
    TIMEOUT_S,
    WIDE,
    assert_not_vacuous,
    differential,
    floats,
    fraction,
    json_values,
    offsets,
    pinned_clock,
    stamp,
    times,
)

from capture.config import CaptureConfig, CoreChoice, SnapshotMode, ValueFormat
from capture.messages import Plugin
from capture.native import extension
from capture.native.core import NativeCore
from capture.pgtypes import SESSION_SETTINGS
from capture.publications import PublicationMode
from capture.tables import TableCatalog, TableFilter, TableInfo
from tideline.pgharness import LocalPostgres

pytestmark = pytest.mark.skipif(not extension.available(), reason="tideline_native is not built (make native)")

PG_EPOCH_US = 946_684_800_000_000
UNCHANGED = object()  # an unchanged TOAST value ('u')
OIDS = {WIDE.name: 16400, FULL.name: 16401, NOKEY.name: 16402, OTHER.name: 16403}

# ---------------------------------------------------------------------------- messages


def cstring(text: str) -> bytes:
    return text.encode() + b"\0"


def relation_message(tbl: TableInfo, types: dict[str, int] | None = None) -> bytes:
    """The Relation message of a test table (key flags: the key's columns, every column under FULL)."""
    full = tbl.replica_identity == "f"
    body = b"R" + struct.pack("!I", OIDS[tbl.name]) + cstring(tbl.schema) + cstring(tbl.name)
    body += tbl.replica_identity.encode() + struct.pack("!H", len(tbl.columns))
    for c in tbl.columns:
        flags = 1 if full or c.name in tbl.key else 0
        oid = (types or {}).get(c.name, c.type_oid)
        mod = typmod(c.type_name) if oid == c.type_oid else -1
        body += bytes([flags]) + cstring(c.name) + struct.pack("!Ii", oid, mod)
    return body


def typmod(type_name: str) -> int:
    """The atttypmod PostgreSQL keeps for a type name (numeric(p,s), varchar(n), char(n)); -1: none."""
    match = re.fullmatch(r"(numeric|character varying|character)\((\d+)(?:,(\d+))?\)", type_name)
    if match is None:
        return -1
    if match[1] == "numeric":
        return ((int(match[2]) << 16) | int(match[3] or 0)) + 4
    return int(match[2]) + 4


def tuple_data(tbl: TableInfo, values: dict[str, Any]) -> bytes:
    """TupleData of a row: every column of the table, NULL where the row has none."""
    out = struct.pack("!H", len(tbl.columns))
    for c in tbl.columns:
        v = values.get(c.name)
        if v is None:
            out += b"n"
        elif v is UNCHANGED:
            out += b"u"
        else:
            raw = v if isinstance(v, bytes) else str(v).encode()
            out += b"t" + struct.pack("!I", len(raw)) + raw
    return out


def begin(final_lsn: int, ts_us: int, xid: int) -> bytes:
    return b"B" + struct.pack("!QqI", final_lsn, ts_us, xid)


def commit(lsn: int, end: int, ts_us: int) -> bytes:
    return b"C" + struct.pack("!BQQq", 0, lsn, end, ts_us)


def row_message(tag: bytes, tbl: TableInfo, new: dict[str, Any] | None, old: tuple[bytes, dict[str, Any]] | None,
                xid: int | None = None) -> bytes:  # fmt: skip
    out = tag + (b"" if xid is None else struct.pack("!I", xid)) + struct.pack("!I", OIDS[tbl.name])
    if old is not None:
        out += old[0] + tuple_data(tbl, old[1])
    if new is not None:
        out += b"N" + tuple_data(tbl, new)
    return out


# ---------------------------------------------------------------------------- values (the types' text output)


def text_values(oid: int) -> st.SearchStrategy[str]:
    """A value of the type as PostgreSQL's output function prints it under SESSION_SETTINGS."""
    if oid in (21, 23, 20, 26):
        return st.integers(-(2**63), 2**63 - 1).map(str)
    if oid == 1700:
        decimals = st.decimals(allow_nan=False, allow_infinity=False, places=3).map(lambda d: format(d, "f"))
        return decimals | st.sampled_from(["NaN", "Infinity", "-Infinity", "0", "0.000"])
    if oid in (700, 701):
        return floats.map(repr).map(lambda r: r.removesuffix(".0")) | st.sampled_from(
            ["NaN", "Infinity", "-Infinity", "-0", "1e+20", "1.5e-05"]
        )
    if oid == 16:
        return st.sampled_from(["t", "f"])
    if oid in (114, 3802):
        return json_values.map(json.dumps)
    if oid == 2950:
        return st.uuids().map(str)
    if oid == 17:
        return st.binary(max_size=12).map(lambda b: "\\x" + b.hex())
    if oid == 1082:
        return st.dates().map(lambda d: d.isoformat())
    if oid == 1114:
        return st.datetimes().map(stamp)
    if oid == 1184:
        return st.builds(lambda d, o: stamp(d) + o, st.datetimes(), offsets)
    if oid == 1083:
        return times
    if oid == 1266:
        return st.builds(lambda t, o: t + o, times, offsets)
    if oid == 1186:
        return st.sampled_from(["1 day 02:03:04", "-1 years -2 mons +3 days -04:05:06.789", "00:00:00"])
    if oid == 1007:
        return st.sampled_from(["{1,2,NULL}", "{}", "{{1,2},{3,4}}"])
    return st.text(max_size=20)  # text types, box, citext


UNUSUAL: dict[tuple[int, ...], list[str | bytes]] = {
    (21, 23, 20, 26): ["-0", "007", "+5", " 5", "1_000", "1.0", "99999999999999999999999", "18446744073709551615",
                       "x", ""],
    (1700,): ["-0", "-0.00", "007.5", "1e5", "nan", "+1", ".5", "1.", "12345678901234567890.123456789", "inf"],
    (700, 701): ["inf", "-inf", "nan", "1_0", " 1", "1e400", "+1.5", ".5", "5.", "-0.0", "infinity", "1E5", ""],
    (16,): ["true", "false", "yes", "1", "T"],
    (25, 1043, 1042, 19, 18, 603): ["__debezium_unavailable_value", b"\xff\xfe", "\x00\x1f\x7f", "😀"],
    (114, 3802): ['{"a": 1.10}', "1e400", "NaN", " [1 , 2] ", "{", '{"a":1,"a":2}', '"\\ud800"'],
    (2950,): ["A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11", "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
              "a0eebc999c0b4ef8bb6d6bb9bd380a11", "x"],
    (17,): ["\\x00 ff", "ABCD", "\\xABcd", "\\xabc", "\\x", "00ff"],
    (1082,): ["infinity", "0044-03-15 BC", "20240101", "2024-02-30", "12024-01-01"],
    (1114,): ["infinity", "2024-01-01 00:00:00.1234567", "2024-01-01 24:00:00", "2024-01-01 00:00:00+00",
              "2024-01-01T00:00:00"],
    (1184,): ["-infinity", "2024-01-01 00:00:00", "0044-03-15 12:00:00+00 BC", "2024-01-01 00:00:00+0530"],
    (1083,): ["24:00:00", "04:05", "04:05:06+02", "04:05:06.0000001"],
    (1266,): ["04:05:06", "24:00:00+00", "04:05:06+24"],
}  # fmt: skip


def value_of(oid: int) -> st.SearchStrategy[str | bytes | None]:
    """Mostly as printed; NULL now and then; an unusual form rarely (not-native types: mostly NULL)."""
    unusual = next((v for oids, v in UNUSUAL.items() if oid in oids), None)

    def pick(k: int) -> st.SearchStrategy[str | bytes | None]:
        if oid not in NATIVE_OIDS:
            return text_values(oid) if k == 0 else st.none()
        if k < 3:
            return st.none()
        if k == 3 and unusual:
            return st.sampled_from(unusual)
        return text_values(oid)

    return st.integers(0, 49).flatmap(pick)


def row_values(tbl: TableInfo, key: dict[str, str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({c.name: st.just(key[c.name]) if c.name in key else value_of(c.type_oid)
                                  for c in tbl.columns})  # fmt: skip


# ---------------------------------------------------------------------------- streams


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    """A pgoutput stream over TABLES: (payloads, XLogData WAL start of each)."""
    payloads: list[bytes] = []
    lsns: list[int] = []
    lsn = 0x1000000

    def emit(payload: bytes) -> None:
        payloads.append(payload)
        lsns.append(lsn)

    for tbl in TABLES:
        emit(relation_message(tbl))
    live: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {t.name: {} for t in TABLES}
    for xid in range(700, 700 + draw(st.integers(1, 3))):
        ts_us = draw(st.sampled_from([817_000_000_123_456, 817_000_001_000_000, 817_007_200_000_000]))
        commit_lsn = lsn + 100_000
        streamed = draw(st.integers(0, 5)) == 0  # protocol 2: sent before its commit, replayed by the decoder
        prefix = xid if streamed else None
        if streamed:
            emit(b"S" + struct.pack("!IB", xid, 1))
        else:
            emit(begin(commit_lsn, ts_us, xid))
        for _ in range(draw(st.integers(0, 16))):
            lsn += 64
            if draw(st.integers(0, 14)) == 0:  # a Relation message again: the same, or a column's type changed
                tbl = draw(st.sampled_from([WIDE, FULL]))
                changed = {"n": 25} if draw(st.booleans()) else {}
                emit(relation_message(tbl, changed)[:1] + (struct.pack("!I", xid) if streamed else b"")
                     + relation_message(tbl, changed)[1:])  # fmt: skip
                continue
            tbl = draw(st.sampled_from(TABLES))
            change(draw, tbl, live[tbl.name], prefix, emit)
        if streamed:
            emit(b"E")
            emit(b"c" + struct.pack("!I", xid) + struct.pack("!BQQq", 0, commit_lsn, commit_lsn + 48, ts_us))
        else:
            emit(commit(commit_lsn, commit_lsn + 48, ts_us))
        lsn = commit_lsn + 1000
    return payloads, lsns


def change(draw: st.DrawFn, tbl: TableInfo, rows: dict[tuple[Any, ...], dict[str, Any]], xid: int | None,
           emit: Callable[[bytes], None]) -> None:  # fmt: skip
    """One row change (or truncate or message) of ``tbl``."""
    prefix = b"" if xid is None else struct.pack("!I", xid)
    op = draw(st.sampled_from(["I", "I", "U", "U", "D", "T", "M"] if tbl.key else ["I", "I", "T"]))
    key: dict[str, str] = {}
    if tbl is WIDE or tbl is OTHER:
        key = {"id": str(draw(st.integers(1, 6)))}
    elif tbl is FULL:
        key = {"a": draw(st.sampled_from(["x", "y", 'é"z'])), "b": str(draw(st.integers(0, 2)))}
    if op in ("U", "D") and len(rows) > 0 and draw(st.booleans()):
        key = dict(zip(tbl.key, draw(st.sampled_from(sorted(rows))), strict=True))
    values = {"id": key["id"]} if tbl is OTHER else draw(row_values(tbl, key))
    if tbl is WIDE and draw(st.integers(0, 9)) == 0:
        values["t"] = "big " * 300  # over the TOAST threshold: the TOAST cache keeps it
    row_key = tuple(values[k] for k in tbl.key)
    if op == "I":
        emit(row_message(b"I", tbl, values, None, xid))
        rows[row_key] = values
    elif op == "U":
        old_key = row_key
        if tbl is WIDE and draw(st.integers(0, 5)) == 0:  # a key change
            values["id"] = str(draw(st.integers(1, 6)))
            row_key = (values["id"],)
        new = dict(values)
        if tbl is not OTHER and draw(st.integers(0, 5)) == 0:  # an unchanged TOAST column
            new["t" if tbl is WIDE else "v"] = UNCHANGED
        old: tuple[bytes, dict[str, Any]] | None = None
        if tbl.replica_identity == "f":
            old = (b"O", rows.get(old_key, values))
        elif old_key != row_key or draw(st.integers(0, 3)) == 0:
            old = (b"K", dict(zip(tbl.key, old_key, strict=True)))
        emit(row_message(b"U", tbl, new, old, xid))
        rows.pop(old_key, None)
        rows[row_key] = values
    elif op == "D":
        old = (b"O", rows.get(row_key, values)) if tbl.replica_identity == "f" else (b"K", key or values)
        emit(row_message(b"D", tbl, None, old, xid))
        rows.pop(row_key, None)
    elif op == "T":
        emit(b"T" + prefix + struct.pack("!IBI", 1, draw(st.integers(0, 3)), OIDS[tbl.name]))
        rows.clear()
    else:
        content = b"hi"
        emit(b"M" + prefix + struct.pack("!BQ", 1, 0x1000000) + cstring("p") + struct.pack("!I", 2) + content)


def mutate(payload: bytes, rnd: random.Random) -> bytes:
    """One byte-level edit: a flipped bit, a cut span, a duplicated span, a changed column kind."""
    kind = rnd.randrange(4)
    if kind == 0 and payload:
        i = rnd.randrange(len(payload))
        return payload[:i] + bytes([payload[i] ^ (1 << rnd.randrange(8))]) + payload[i + 1 :]
    if kind == 1 and payload:
        i = rnd.randrange(len(payload))
        return payload[:i] + payload[i + rnd.randrange(1, 8) :]
    if kind == 2:
        i = rnd.randrange(len(payload) + 1)
        return payload[:i] + payload[max(0, i - 12) : i] + payload[i:]
    spots = [i for i, b in enumerate(payload) if b in b"tnu"]
    if not spots:
        return payload
    i = rnd.choice(spots)
    return payload[:i] + rnd.choice([b"b", b"x", b"u", b"n"]) + payload[i + 1 :]


def cuts(n: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, max(n, 0)), max_size=6)


# ---------------------------------------------------------------------------- the tests


@pytest.fixture
def tally() -> Iterator[dict[str, int]]:
    TALLY.update(runs=0, errors=0, native_changes=0)
    yield TALLY


@pytest.mark.timeout(TIMEOUT_S)
def test_generated_pgoutput_streams_are_identical(tally: dict[str, int]) -> None:
    generated()
    assert_not_vacuous(tally)


@SETTINGS
@given(data=st.data())
def generated(data: st.DataObject) -> None:
    payloads, lsns = data.draw(streams())
    differential(TABLES, payloads, data.draw(cuts(len(payloads))), Plugin.PGOUTPUT, lsns)


@pytest.mark.timeout(TIMEOUT_S)
def test_mutated_pgoutput_streams_are_identical(tally: dict[str, int]) -> None:
    mutated()
    assert tally["native_changes"] > 0, tally


@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def mutated(data: st.DataObject, seed: int) -> None:
    payloads, lsns = data.draw(streams())
    rnd = random.Random(seed)
    for _ in range(rnd.randrange(1, 4)):
        i = rnd.randrange(len(payloads) // 2, len(payloads))  # as in test_native_core_avro: the core gets changes
        payloads[i] = mutate(payloads[i], rnd)
    differential(TABLES, payloads, data.draw(cuts(len(payloads))), Plugin.PGOUTPUT, lsns)


def test_the_core_handles_pgoutput_rows() -> None:
    """Inserts, updates and deletes of ordinary rows take the core; a Relation message read again sends the
    next change through the Python path (which registers the new one), then the core resumes."""
    row = {"id": "1", "t": "a", "n": "NaN", "r": "-Infinity", "d": "-0", "ts": "2024-01-01 00:00:00", "b": "t"}
    lsn = 0x1000040
    stream = [relation_message(WIDE), begin(0x1100000, 817_000_000_000_000, 700)]
    stream += [row_message(b"I", WIDE, row | {"id": str(i)}, None) for i in range(1, 6)]
    stream += [row_message(b"U", WIDE, row | {"b": "f"}, None), relation_message(WIDE, {"n": 25}),
               row_message(b"U", WIDE, row | {"n": "12.30"}, None), row_message(b"D", WIDE, None, (b"K", {"id": "1"})),
               commit(0x1100000, 0x1100030, 817_000_000_000_000)]  # fmt: skip
    lsns = [lsn + 64 * i for i in range(len(stream))]
    outcome = differential(TABLES, stream, [], Plugin.PGOUTPUT, lsns)
    assert outcome.error is None
    # the first change of the table and the first after the Relation message take the Python path
    assert outcome.native_changes == 8 - 2
    values = outcome.topics["d.public.wide"][1]
    assert values[0] is not None and b'"n":"NaN","r":"-Infinity","d":-0.0' in values[0]
    assert values[-1] is None  # the DELETE's tombstone


def test_core_native_accepts_pgoutput_and_avro() -> None:
    CaptureConfig(dsn="postgresql://x", core=CoreChoice.NATIVE, plugin=Plugin.PGOUTPUT).validate()
    CaptureConfig(dsn="postgresql://x", core=CoreChoice.NATIVE, plugin=Plugin.PGOUTPUT,
                  value_format=ValueFormat.AVRO).validate()  # fmt: skip (Avro: test_native_core_avro)


# ---------------------------------------------------------------------------- against a real server

NATIVE_TYPES_DDL = """
CREATE TABLE native_types (
    id int PRIMARY KEY, i2 smallint, i4 integer, i8 bigint, o oid, n numeric, n122 numeric(12,2), r real,
    d double precision, b boolean, t text, vc varchar(20), ch char(3), nm name, c1 "char", bx box, j json,
    jb jsonb, u uuid, ba bytea, dt date, ts timestamp, tstz timestamptz, tm time, ttz timetz
);
CREATE TABLE full_ident (a text, b bigint, v text, n numeric, PRIMARY KEY (a, b));
ALTER TABLE full_ident REPLICA IDENTITY FULL;
"""
NATIVE_TYPES_ROWS = [
    r"""INSERT INTO native_types VALUES (1, -32768, 2147483647, 9223372036854775807, 4294967295, 12345.678, 12.30,
        1.1, 0.1, true, 'héllo "world" \ tab	end', 'x', 'ab', 'nm', 'c', '((1,1),(0,0))',
        '{"a": 1.10, "b": [1, 2]}', '{"big": 12345678901234567890.12345678901234567890, "neg": -1e-7}',
        'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '\x00ff27225c', '2024-03-31', '2024-03-31 01:30:00.123456',
        '2024-03-31 01:30:00.5+05:30', '04:05:06.789', '04:05:06+05:30')""",
    r"""INSERT INTO native_types (id, i2, n, n122, r, d, b, t, j, jb, ba, dt, ts, tstz, tm, ttz)
        VALUES (2, 0, 'NaN', -9999999999.99, 'NaN', '-Infinity', false, '', '[]', 'null', '', '0044-03-15 BC',
        '0044-03-15 12:00:00 BC', 'infinity', '24:00:00', '24:00:00-15:59')""",
    "INSERT INTO native_types (id) VALUES (3)",
    r"""INSERT INTO native_types (id, n, r, d, jb, ba, tstz)
        VALUES (4, 'Infinity', 'Infinity', '-0', '{"i": 123456789012345678901234567890}',
        (SELECT string_agg(set_byte('\x00'::bytea, 0, b), ''::bytea ORDER BY b) FROM generate_series(0, 255) b),
        '1900-01-01 00:00:00+00')""",
    "INSERT INTO native_types SELECT id + 10, i2, i4, i8, o, n, n122, r, d, b, t, vc, ch, nm, c1, bx, j, jb, u, ba, "
    "dt, ts, tstz, tm, ttz FROM native_types",
    "UPDATE native_types SET t = t || '!', r = -r WHERE id > 10",
    "UPDATE native_types SET id = id + 100 WHERE id = 13",
    "UPDATE native_types SET t = repeat('x', 3000) WHERE id = 11",
    "UPDATE native_types SET b = NOT b WHERE id = 11",
    "DELETE FROM native_types WHERE id = 12",
    "INSERT INTO full_ident VALUES ('x', 1, 'v', 1.5), ('y', 2, NULL, 'NaN')",
    "UPDATE full_ident SET v = 'w' WHERE a = 'x'",
    "DELETE FROM full_ident WHERE a = 'y'",
    "TRUNCATE full_ident",
]


def test_real_pgoutput_payloads_are_identical(postgres: LocalPostgres) -> None:
    """A server's pgoutput payloads (every natively converted type, NaN/±Infinity/-0, BC and infinite
    dates, a key change, unchanged TOAST, REPLICA IDENTITY FULL), as a slot returns them, through both paths."""
    db = fresh_database(postgres, "native_pgo_payloads")
    sql(db, NATIVE_TYPES_DDL, "CREATE PUBLICATION pub FOR ALL TABLES")
    sql(db, "SELECT pg_create_logical_replication_slot('pgo_payloads', 'pgoutput')")
    sql(db, *NATIVE_TYPES_ROWS)
    options = "-c " + " -c ".join(f"{k}={v}" for k, v in SESSION_SETTINGS.items())
    with psycopg.connect(db, autocommit=True, options=options) as conn:
        rows = conn.execute(
            "SELECT lsn::text, data FROM pg_logical_slot_get_binary_changes('pgo_payloads', NULL, NULL, "
            "'proto_version', '2', 'publication_names', 'pub', 'messages', 'true')"
        ).fetchall()
        sql(db, "SELECT pg_drop_replication_slot('pgo_payloads')")
    lsns = [int(h, 16) << 32 | int(lo, 16) for h, lo in (r[0].split("/") for r in rows)]
    payloads = [bytes(r[1]) for r in rows]
    catalog = TableCatalog(db, TableFilter(include=["public.native_types", "public.full_ident"]))
    tables = catalog.load()
    assert {t.name for t in tables} == {"native_types", "full_ident"}
    for cut in ([], [3], [7, 20]):
        outcome = differential(tables, payloads, cut, Plugin.PGOUTPUT, lsns)
        assert outcome.error is None
    assert outcome.native_changes >= 10, outcome.native_changes


def test_native_core_end_to_end_pgoutput(postgres: LocalPostgres, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A real server's pgoutput stream captured by both cores into two logs: the same records (but the capture
    time), most changes handled by the native core."""
    handled: list[int] = []
    run = NativeCore.run

    def counted(self: NativeCore, *args: Any) -> tuple[int, int]:
        n, index = run(self, *args)
        handled.append(n)
        return n, index

    monkeypatch.setattr(NativeCore, "run", counted)
    db = fresh_database(postgres, "native_pgo_e2e")
    sql(db, "CREATE TABLE acct (id bigint PRIMARY KEY, owner text, balance numeric(12,2), seen timestamptz, "
            "tags text[], doc jsonb, raw bytea, ok boolean, r real)")  # fmt: skip
    sql(db, "CREATE PUBLICATION e2e FOR ALL TABLES")
    # slots are the cluster's, not the database's: names of this test's own (dropped at the end)
    sql(db, "SELECT pg_create_logical_replication_slot('pgo_py', 'pgoutput')")
    sql(db, "SELECT pg_copy_logical_replication_slot('pgo_py', 'pgo_nat')")
    sql(db, "INSERT INTO acct SELECT g, 'owner ' || g, g / 7.0, '2024-03-31 01:30:00.5+00'::timestamptz + g * "
            "interval '1 hour', CASE WHEN g % 10 = 0 THEN ARRAY['a', g::text] END, "  # arrays: the Python path
            "jsonb_build_object('g', g, 'f', g / 3.0), decode(md5(g::text), 'hex'), g % 2 = 0, g / 3.0 "
            "FROM generate_series(1, 300) g")  # fmt: skip
    sql(db, "UPDATE acct SET balance = 'NaN', r = 'Infinity', tags = NULL WHERE id % 3 = 0")
    sql(db, "UPDATE acct SET owner = repeat('x', 3000) WHERE id = 5")  # big: the TOAST cache keeps it
    sql(db, "UPDATE acct SET ok = NOT ok WHERE id = 5")  # owner unchanged TOAST ('u'): filled
    # (no ALTER TABLE: the catalog is read when capture starts, after every statement here, so the rows
    # written before it would all differ from the catalog and take the Python path)
    sql(db, "UPDATE acct SET owner = 'o' || id WHERE id % 4 = 0")
    sql(db, "UPDATE acct SET id = 1000 WHERE id = 7")  # a key change
    sql(db, "DELETE FROM acct WHERE id % 5 = 0")
    sql(db, "TRUNCATE acct")
    sql(db, "INSERT INTO acct (id, owner) VALUES (1, 'after truncate')")
    logs = {}
    try:
        for slot, core in (("pgo_py", CoreChoice.PYTHON), ("pgo_nat", CoreChoice.NATIVE)):
            logs[core] = tmp_path / slot
            stats = capture_into(logs[core], db, slot=slot, snapshot=SnapshotMode.NEVER, core=core,
                                 plugin=Plugin.PGOUTPUT, publication="e2e",
                                 publication_autocreate=PublicationMode.DISABLED)  # fmt: skip
            assert stats.events > 600
    finally:
        drop_slots(db)
    topic = "cdc.public.acct"
    python, native = records(logs[CoreChoice.PYTHON], topic), records(logs[CoreChoice.NATIVE], topic)
    for stored in (python, native):
        for _, value, _ in stored:
            if value is not None:
                value.pop("ts_ms")  # the capture time
    assert native == python
    assert len(native) > 600
    assert sum(handled) > 400, sum(handled)
    assert any(v is not None and v["after"] and v["after"]["balance"] == "NaN" for _, v, _ in native)

