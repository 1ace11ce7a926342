"""capture.decoders.wal2json against a real PostgreSQL 15 + wal2json 2.5, plus captured payloads.

Every live test reads real payloads with ``pg_logical_slot_get_binary_changes`` (the
bytes START_REPLICATION would carry), decodes them, and checks the values against what
the server stores: ``convert_text`` of ``SELECT col::text`` (the snapshot's path) and, for
some columns, psycopg's own Python values. Each test drops its slot (slots hold WAL).

The payloads in fixtures/ were captured from the same server (see fixtures/README.md);
they drive the fast tests of edge cases at the bottom.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from capture.decoders.wal2json import Wal2JsonDecoder
from capture.messages import ChangeMessage, Column, DecodeError, Kind, Plugin
from capture.pgtypes import (
    SESSION_SETTINGS,
    Interval,
    JsonNumber,
    JsonText,
    NonFiniteFloat,
    convert_text,
    dumps,
    json_value,
)
from tideline.pgharness import LocalPostgres, require_wal2json

FIXTURES = Path(__file__).parent / "fixtures"

# One table with every type of the mapping (and some it leaves as text).
EVERY_TYPE_DDL = """
CREATE EXTENSION IF NOT EXISTS citext;
DROP TABLE IF EXISTS every_type;
DROP TYPE IF EXISTS mood;
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE every_type (
    id int PRIMARY KEY,
    i2 smallint, i4 integer, i8 bigint, o oid,
    n numeric, n38 numeric(38,10), n122 numeric(12,2),
    r real, d double precision, b boolean,
    t text, vc varchar(20), ch char(3), nm name, c1 "char", ci citext,
    j json, jb jsonb, u uuid, ba bytea,
    dt date, ts timestamp, ts3 timestamp(3), tstz timestamptz, tstz3 timestamp(3) with time zone,
    tm time, ttz timetz, iv interval, ivym interval year to month, m mood,
    inet_ inet, cidr_ cidr, mac macaddr, money_ money, bits bit(3), vbits varbit, pt point, bx box,
    rng int4range, x xml, tsv tsvector, lsn_ pg_lsn,
    a_int int[], a_int2d int[], a_dec int[], a_text text[], a_num numeric(10,2)[], a_float float8[],
    a_bool bool[], a_jsonb jsonb[], a_bytea bytea[], a_uuid uuid[], a_date date[], a_tstz timestamptz[],
    a_iv interval[], a_vc varchar(5)[], a_mood mood[], a_box box[], a_ci citext[], a_n numeric[]
)
"""

EVERY_TYPE_ROWS = [
    # 1: ordinary values
    r"""INSERT INTO every_type VALUES (1,
        -32768, 2147483647, 9223372036854775807, 4294967295,
        12345.678, 1234567890123456789012345678.0123456789, 12.30,
        1.1, 0.1, true,
        'héllo "world" \ tab	end', 'x', 'ab', 'nm', 'c', 'MiXeD',
        '{"a": 1.10, "b": [1, 2]}', '{"big": 12345678901234567890.12345678901234567890, "neg": -1e-7}',
        'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '\x00ff27225c',
        '2024-03-31', '2024-03-31 01:30:00.123456', '2024-03-31 01:30:00.123', '2024-03-31 01:30:00.5+05:30',
        '2024-03-31 01:30:00.123456-03:30',
        '04:05:06.789', '04:05:06+05:30', '1 year 2 mons 3 days 04:05:06.789', '1 year 2 mons', 'happy',
        '10.0.0.1/8', '10.0.0.0/8', '08:00:2b:01:02:03', 12.34, B'101', B'1100', '(1,2)', '((1,1),(0,0))',
        '[1,5)', '<a>x</a>', 'a fat cat', '16/B374D848',
        '{1,2,NULL}', '{{1,2},{3,4}}', '[0:1]={7,8}', '{"a b","c,d","q\"x",NULL,"NULL","","back\\slash","{}"}',
        '{1.10,NaN,3}', '{1.5,NaN,Infinity,-Infinity,-0}', '{t,f,NULL}',
        ARRAY['{"a": 1.5}'::jsonb, '[1, "x"]', 'null'], ARRAY['\x00'::bytea, '\xff', ''],
        '{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}', '{2024-01-01,infinity,-infinity}',
        ARRAY['2024-01-01 00:00:00+00'::timestamptz, 'infinity'], '{"1 day","-00:00:01"}', '{x,"y z"}',
        '{sad,happy}', ARRAY['((1,1),(0,0))'::box, '((3,3),(2,2))'], '{A,b}', '{1e-20,-0}')""",
    # 2: edges: non-finite numbers, infinities, BC, extremes, empty arrays
    r"""INSERT INTO every_type (id, i2, n, n38, n122, r, d, b, t, j, jb, ba, dt, ts, ts3, tstz, tstz3,
        tm, ttz, iv, ivym, a_int, a_int2d, a_text, a_num, a_jsonb, a_n)
        VALUES (2, 0, 'NaN', -0.0000000001, -9999999999.99, 'NaN', '-Infinity', false, '', '[]', 'null', '',
        '0044-03-15 BC', '0044-03-15 12:00:00 BC', '294276-12-31 23:59:59.999', 'infinity',
        '4713-01-01 00:00:00+00 BC', '24:00:00', '24:00:00-15:59', '-1 years -2 mons +3 days -04:05:06.789',
        '-1 year', '{}', '{{{1},{2}},{{3},{4}}}', '{}', '{NaN,-1.5}', '{}', '{-Infinity,Infinity,NaN}')""",
    # 3: all NULL
    "INSERT INTO every_type (id) VALUES (3)",
    # 4: more edges
    r"""INSERT INTO every_type (id, n, r, d, jb, j, ba, dt, tstz, iv, a_text)
        VALUES (4, 'Infinity', 'Infinity', '-0', '{"huge": 2.5e400, "i": 123456789012345678901234567890}',
        '{"dup": 1, "dup": 2.000}', (SELECT string_agg(set_byte('\x00'::bytea, 0, b), ''::bytea
        ORDER BY b) FROM generate_series(0, 255) b), '-infinity', '1900-01-01 00:00:00+00', '-0.5 seconds',
        ARRAY[E'line\nbreak', E'ctl\x01', ' lead', 'trail ', '😀', 'NULL', 'null'])""",
    # 5: numeric with many digits on both sides, -Infinity numeric
    """INSERT INTO every_type (id, n, n38, d)
        VALUES (5, ('9' || repeat('0', 999) || '.' || repeat('1', 100))::numeric,
        -99999999999999999999999999.9999999999, 1.7976931348623157e308)""",
    """INSERT INTO every_type (id, n) VALUES (6, '-Infinity')""",
]

# (row, column) holding NaN/±Infinity of numeric, real or double: wal2json writes null.
NON_FINITE = {(2, "n"), (2, "r"), (2, "d"), (4, "n"), (4, "r"), (6, "n")}


def session_options(**overrides: str) -> str:
    settings = {**SESSION_SETTINGS, **overrides}
    return " ".join(f"-c {name}={value}" for name, value in settings.items())


@pytest.fixture(scope="module")
def dsn(postgres: LocalPostgres) -> str:
    require_wal2json(postgres.binaries)
    return postgres.create_database("capture_wal2json")


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True, options=session_options()) as connection:
        yield connection


Payload = tuple[int, int, bytes]  # (record LSN as the server reports it, xid, payload)


@contextmanager
def wal2json_slot(conn: psycopg.Connection[Any], name: str) -> Iterator[Callable[[], list[Payload]]]:
    """A wal2json slot; the callable consumes its changes (decoded in ``conn``'s session settings)."""
    options = [item for pair in Wal2JsonDecoder().slot_options().items() for item in pair]
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'wal2json')", (name,))

    def changes() -> list[Payload]:
        rows = conn.execute(
            "SELECT lsn::text, xid::text::bigint, data "
            "FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, VARIADIC %s::text[])",
            (name, options),
        ).fetchall()
        return [(lsn_int(lsn), xid, bytes(data)) for lsn, xid, data in rows]

    try:
        yield changes
    finally:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))


def lsn_int(text: str) -> int:
    high, low = text.split("/")
    return int(high, 16) << 32 | int(low, 16)


def decode_all(payloads: list[Payload]) -> list[ChangeMessage]:
    decoder = Wal2JsonDecoder()
    return [m for _, _, payload in payloads for m in decoder.decode(payload)]


def _shape(value: Any) -> Any:
    if isinstance(value, list):
        return ["list", [_shape(v) for v in value]]
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return type(value).__name__


def assert_same(actual: Any, expected: Any, where: str) -> None:
    """Same types (recursively) and same JSON bytes: every digit and every offset."""
    assert _shape(actual) == _shape(expected), where
    assert dumps(actual) == dumps(expected), where


def text_values(conn: psycopg.Connection[Any], table: str, columns: list[Column], key: int) -> dict[str, Any]:
    """The snapshot's view of a row: each column's text output through ``convert_text``.

    The text output is what a text-format result carries for an uncast column (the
    type's output function, as wal2json uses); ``col::text`` differs for some types
    (see test_cast_to_text_is_not_the_output_function).
    """
    names = ", ".join(f'"{c.name}"' for c in columns)
    with conn.cursor() as cursor:
        cursor.execute(f"SELECT {names} FROM {table} WHERE id = %s", (key,))  # type: ignore[arg-type]
        result = cursor.pgresult
        assert result is not None and result.ntuples == 1
        texts = [result.get_value(0, i) for i in range(len(columns))]
    return {
        c.name: convert_text(c.type_name, c.type_oid, None if text is None else bytes(text).decode())
        for c, text in zip(columns, texts, strict=True)
    }


def test_cast_to_text_is_not_the_output_function(conn: psycopg.Connection[Any]) -> None:
    """Why the snapshot must read uncast columns: ``::text`` trims char(n) and rewrites inet."""
    row = conn.execute(
        "SELECT 'ab'::char(3)::text, '10.0.0.1/32'::inet::text, true::text, '{ab}'::char(3)[]::text"
    ).fetchone()
    assert row == ("ab", "10.0.0.1/32", "true", '{"ab "}')
    with conn.cursor() as cursor:
        cursor.execute("SELECT 'ab'::char(3), '10.0.0.1/32'::inet, true, '{ab}'::char(3)[]")
        result = cursor.pgresult
        assert result is not None
        assert [result.get_value(0, i) for i in range(4)] == [b"ab ", b"10.0.0.1", b"t", b'{"ab "}']


# -- every type: stream == snapshot text == psycopg ---------------------------------------


@pytest.fixture
def every_type(conn: psycopg.Connection[Any]) -> dict[int, ChangeMessage]:
    """The INSERT of each EVERY_TYPE_ROWS row, decoded from real payloads."""
    conn.execute(EVERY_TYPE_DDL)
    with wal2json_slot(conn, "every_type") as changes:
        for statement in EVERY_TYPE_ROWS:
            conn.execute(statement.encode())
        messages = decode_all(changes())
    inserts = {m.columns[0].value: m for m in messages if m.kind is Kind.INSERT}
    assert sorted(inserts) == [1, 2, 3, 4, 5, 6]
    return inserts


def test_every_type_streams_the_values_the_snapshot_reads(
    conn: psycopg.Connection[Any], every_type: dict[int, ChangeMessage]
) -> None:
    for key, insert in every_type.items():
        snapshot = text_values(conn, "every_type", insert.columns, key)
        for column in insert.columns:
            where = f"row {key} column {column.name} ({column.type_name})"
            if (key, column.name) in NON_FINITE:
                # wal2json writes null for NaN/±Infinity: only the snapshot can tell them from NULL.
                assert column.value is None, where
                assert dumps(snapshot[column.name]) in (b'"NaN"', b'"Infinity"', b'"-Infinity"'), where
            elif (key, column.name) == (4, "d"):
                # '-0' arrives as the JSON integer -0, read as 0: the sign of zero is lost in a change.
                assert (column.value, snapshot["d"]) == (0.0, -0.0)
                assert math.copysign(1, snapshot["d"]) == -1.0, where
            else:
                assert_same(column.value, snapshot[column.name], where)


def test_every_type_has_the_documented_python_types(every_type: dict[int, ChangeMessage]) -> None:
    row = {c.name: c.value for c in every_type[1].columns}
    expected_types = {
        "i2": int, "i4": int, "i8": int, "o": int, "n": Decimal, "n38": Decimal, "n122": Decimal,
        "r": float, "d": float, "b": bool, "t": str, "vc": str, "ch": str, "nm": str, "c1": str, "ci": str,
        "j": JsonText, "jb": JsonText, "u": uuid.UUID, "ba": bytes, "dt": date, "ts": datetime, "ts3": datetime,
        "tstz": datetime, "tstz3": datetime, "iv": Interval, "ivym": Interval, "m": str, "inet_": str,
        "money_": str, "bits": str, "pt": str, "rng": str, "x": str, "tsv": str, "lsn_": str, "a_int": list,
    }  # fmt: skip
    assert {name: type(row[name]) for name in expected_types} == expected_types
    assert row["n38"] == Decimal("1234567890123456789012345678.0123456789")
    assert str(row["n122"]) == "12.30"
    assert row["r"] == 1.1 and row["d"] == 0.1
    assert row["ch"] == "ab "  # blank-padded
    j, jb = json_value(row["j"]), json_value(row["jb"])  # json/jsonb travel as their text, parsed on demand
    assert j == {"a": Decimal("1.10"), "b": [1, 2]} and str(j["a"]) == "1.10"
    assert row["j"].text == '{"a": 1.10, "b": [1, 2]}'  # json keeps its exact text
    assert jb == {"big": Decimal("12345678901234567890.12345678901234567890"), "neg": Decimal("-1e-7")}
    assert isinstance(jb["big"], JsonNumber)
    assert row["ba"] == b"\x00\xff'\"\\"
    assert row["ts"] == datetime(2024, 3, 31, 1, 30, 0, 123456) and row["ts"].tzinfo is None
    assert row["tstz"] == datetime(2024, 3, 30, 20, 0, 0, 500000, tzinfo=UTC)  # rendered in UTC
    assert row["tstz3"].utcoffset() == timedelta(0)
    assert row["ttz"].utcoffset() == timedelta(hours=5, minutes=30)  # timetz keeps its own offset
    assert row["iv"] == Interval(14, 3, 14_706_789_000) and row["ivym"] == Interval(14, 0, 0)
    assert row["a_int"] == [1, 2, None] and row["a_int2d"] == [[1, 2], [3, 4]] and row["a_dec"] == [7, 8]
    assert row["a_text"] == ["a b", "c,d", 'q"x', None, "NULL", "", "back\\slash", "{}"]
    assert [str(x) for x in row["a_num"]] == ["1.10", "NaN", "3.00"]  # arrays keep NaN
    assert [type(x) for x in row["a_float"]] == [float, NonFiniteFloat, NonFiniteFloat, NonFiniteFloat, float]
    assert [json_value(v) for v in row["a_jsonb"]] == [{"a": Decimal("1.5")}, [1, "x"], None]  # JSON null last
    assert row["a_bytea"] == [b"\x00", b"\xff", b""]
    assert row["a_date"] == [date(2024, 1, 1), "infinity", "-infinity"]
    assert row["a_iv"] == [Interval(0, 1, 0), Interval(0, 0, -1_000_000)]
    assert row["a_mood"] == ["sad", "happy"] and row["a_box"] == ["(1,1),(0,0)", "(3,3),(2,2)"]
    assert row["a_ci"] == ["A", "b"]

    edges = {c.name: c.value for c in every_type[2].columns}
    assert edges["n38"] == Decimal("-0.0000000001") and str(edges["n122"]) == "-9999999999.99"
    assert edges["dt"] == "0044-03-15 BC" and edges["ts"] == "0044-03-15 12:00:00 BC"
    assert edges["ts3"] == "294276-12-31 23:59:59.999" and edges["tstz"] == "infinity"
    assert edges["tm"] == "24:00:00" and edges["ttz"] == "24:00:00-15:59"
    assert edges["iv"] == Interval(-14, 3, -14_706_789_000) and edges["iv"].to_iso8601() == "P-1Y-2M3DT-4H-5M-6.789S"
    assert edges["jb"] == JsonText("null")  # jsonb 'null' stays distinct from SQL NULL (travels as its text)
    assert (edges["a_int"], edges["a_int2d"], edges["a_text"]) == ([], [[[1], [2]], [[3], [4]]], [])
    assert [str(x) for x in edges["a_num"]] == ["NaN", "-1.50"]
    assert [str(x) for x in edges["a_n"]] == ["-Infinity", "Infinity", "NaN"]  # arrays keep them

    assert all(c.value is None for c in every_type[3].columns[1:])

    more = {c.name: c.value for c in every_type[4].columns}
    assert more["ba"] == bytes(range(256))
    jb = json_value(more["jb"])
    assert jb["huge"] == Decimal("2.5e400") and jb["i"] == 123456789012345678901234567890
    assert b'"huge": 25' + b"0" * 399 + b"}" in dumps(more["jb"])  # jsonb printed 2.5e400 in full, written as is
    assert json_value(more["j"]) == {"dup": Decimal("2.000")}  # parsed, the last duplicate wins
    assert more["j"].text.count('"dup"') == 2  # json keeps its exact text: both duplicates travel
    assert more["iv"] == Interval(0, 0, -500_000) and more["iv"].to_iso8601() == "PT-0.5S"
    assert more["a_text"] == ["line\nbreak", "ctl\x01", " lead", "trail ", "😀", "NULL", "null"]

    big = {c.name: c.value for c in every_type[5].columns}
    assert str(big["n"]) == "9" + "0" * 999 + "." + "1" * 100
    assert big["d"] == 1.7976931348623157e308


PSYCOPG_COLUMNS = {
    1: ["i8", "n", "n38", "n122", "r", "d", "b", "u", "ba", "dt", "ts", "ts3", "tstz", "tstz3", "tm", "a_int", "a_dec",
        "a_text", "a_bool", "a_uuid"],
    2: ["n", "n38", "n122", "r", "d", "b", "ba", "a_int", "a_text"],
    4: ["n", "r", "d", "ba", "tstz", "a_text"],
    5: ["n", "n38", "d"],
}  # fmt: skip


def test_text_path_agrees_with_psycopg(conn: psycopg.Connection[Any], every_type: dict[int, ChangeMessage]) -> None:
    """psycopg's own loaders (binary-safe, independent of ours) read the same values."""
    for key, names in PSYCOPG_COLUMNS.items():
        native = conn.execute(f"SELECT {', '.join(names)} FROM every_type WHERE id = %s", (key,)).fetchone()  # type: ignore[arg-type]
        assert native is not None
        snapshot = text_values(conn, "every_type", [c for c in every_type[key].columns if c.name in names], key)
        for name, expected in zip(names, native, strict=True):
            value, where = snapshot[name], f"row {key} column {name}"
            if isinstance(expected, Decimal) and not expected.is_finite():
                assert isinstance(value, Decimal) and str(value) == str(expected), where
            elif isinstance(expected, float):
                assert isinstance(value, float), where
                assert value == expected or (math.isnan(value) and math.isnan(expected)), where
                assert math.copysign(1, value) == math.copysign(1, expected), where
            else:
                assert (value, type(value)) == (expected, type(expected)), where


def test_timestamptz_keeps_the_session_zone_offset(dsn: str) -> None:
    values = [
        "2024-03-31 01:30:00+00",
        "2024-07-01 12:00:00.25+00",
        "1900-01-01 00:00:00+00",
        "0044-03-15 12:00:00+00 BC",
    ]
    for zone, offsets in [
        ("Asia/Kolkata", ["+05:30", "+05:30", "+05:21:10", "+05:53:28"]),
        ("America/St_Johns", ["-02:30", "-02:30", "-03:30:52", "-03:30:52"]),
    ]:
        with psycopg.connect(dsn, autocommit=True, options=session_options(TimeZone=zone)) as conn:
            conn.execute(
                "DROP TABLE IF EXISTS zoned; CREATE TABLE zoned (id int PRIMARY KEY, at timestamptz, ats timestamptz[])"
            )
            with wal2json_slot(conn, "zoned") as changes:
                for i, value in enumerate(values):
                    conn.execute("INSERT INTO zoned VALUES (%s, %s, ARRAY[%s::timestamptz])", (i, value, value))
                inserts = [m for m in decode_all(changes()) if m.kind is Kind.INSERT]
            for i, insert in enumerate(inserts):
                at = insert.columns[1].value
                snapshot = text_values(conn, "zoned", insert.columns, i)
                assert_same(at, snapshot["at"], f"{zone} {values[i]}")
                assert_same(insert.columns[2].value, snapshot["ats"], f"{zone} {values[i]}[]")
                rendered = at if isinstance(at, str) else at.isoformat()
                assert offsets[i] in rendered, (zone, values[i], rendered)
                if isinstance(at, datetime):  # the same instant whatever the zone
                    assert at == datetime.fromisoformat(values[i])


# -- row changes, truncate, messages ------------------------------------------------------------


def test_row_changes_transactions_truncate_and_messages(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "DROP TABLE IF EXISTS account, ledger, nokey;"
        "CREATE TABLE account (id int PRIMARY KEY, owner text, balance numeric(12,2));"
        "CREATE TABLE ledger (a int, b text); ALTER TABLE ledger REPLICA IDENTITY FULL;"
        "CREATE TABLE nokey (a int)"
    )
    started_ms = int(time.time() * 1000)
    with wal2json_slot(conn, "changes") as changes:
        with conn.transaction():
            conn.execute("INSERT INTO account VALUES (1, 'ada', 10.50), (2, 'bob', 0.01)")
            conn.execute("SELECT pg_logical_emit_message(true, 'tx', 'in the transaction')")
            conn.execute("SELECT pg_logical_emit_message(false, 'nontx', 'at once')")
        conn.execute("UPDATE account SET balance = balance + 1 WHERE id = 1")
        conn.execute("UPDATE account SET id = 20 WHERE id = 2")  # primary key change
        conn.execute("DELETE FROM account WHERE id = 1")
        conn.execute("INSERT INTO ledger VALUES (1, 'a'); UPDATE ledger SET b = 'b'; DELETE FROM ledger")
        conn.execute("INSERT INTO nokey VALUES (1); UPDATE nokey SET a = 2; DELETE FROM nokey")
        conn.execute("TRUNCATE account, ledger")
        conn.execute(r"SELECT pg_logical_emit_message(true, 'bin', '\x61ff62c3a90a0d22275c'::bytea)")
        conn.execute(r"SELECT pg_logical_emit_message(true, 'nul', '\x610062'::bytea)")
        payloads = changes()
    finished_ms = int(time.time() * 1000)
    messages = decode_all(payloads)
    # an empty transaction (BEGIN then COMMIT) is the server's own (autovacuum's analyze of the new tables,
    # writing only catalogs): none of the test's transactions is empty, so it is left out of the comparison
    empty = {i + d for i in range(len(messages) - 1) for d in (0, 1)
             if messages[i].kind is Kind.BEGIN and messages[i + 1].kind is Kind.COMMIT}  # fmt: skip
    payloads = [p for i, p in enumerate(payloads) if i not in empty]
    messages = [m for i, m in enumerate(messages) if i not in empty]

    kinds = "".join(m.kind.value for m in messages)
    # the non-transactional message comes before its transaction's BEGIN; nokey's U and D are skipped
    assert kinds == "MBIIMCBUCBUCBDCBIUDCBICBTTCBMCBMC"
    for (lsn, xid, _), m in zip(payloads, messages, strict=True):
        if m.kind is Kind.COMMIT:
            assert m.next_lsn == lsn  # the server reports a commit at its end
        elif m.kind is not Kind.BEGIN:
            assert m.lsn == lsn
        assert m.xid == (None if m.kind is Kind.MESSAGE and not m.transactional else xid)
        if m.timestamp_ms is not None:
            assert started_ms - 1000 <= m.timestamp_ms <= finished_ms + 1000
    begin: ChangeMessage | None = None
    for m in messages:
        if m.kind is Kind.BEGIN:
            begin = m
        elif m.kind is Kind.COMMIT:
            assert begin is not None and m.next_lsn is not None
            assert (begin.lsn, begin.next_lsn, begin.xid, begin.timestamp_ms) == (
                m.lsn,
                m.next_lsn,
                m.xid,
                m.timestamp_ms,
            )
            assert m.lsn < m.next_lsn
            begin = None

    def row(m: ChangeMessage, image: str = "columns") -> dict[str, Any]:
        return {c.name: c.value for c in getattr(m, image)}

    def of(kind: Kind) -> list[ChangeMessage]:
        return [m for m in messages if m.kind is kind]

    nontx, tx_message, binary, nul = of(Kind.MESSAGE)
    assert (nontx.transactional, nontx.prefix, nontx.content, nontx.xid, nontx.timestamp_ms) == (
        False, "nontx", b"at once", None, None)  # fmt: skip
    assert (tx_message.transactional, tx_message.prefix, tx_message.content) == (True, "tx", b"in the transaction")
    assert binary.content == b"a\xffb\xc3\xa9\n\r\"'\\"  # raw non-UTF-8 bytes come back exactly
    assert nul.content == b"a"  # wal2json cuts content at the first NUL byte

    ins1, ins2, ledger_insert, nokey_insert = of(Kind.INSERT)
    assert (ins1.schema, ins1.table, ins1.identity) == ("public", "account", [])
    assert ins1.primary_key == []  # include-pk is not asked for (SLOT_OPTIONS): the catalog keys the table
    assert row(ins1) == {"id": 1, "owner": "ada", "balance": Decimal("10.50")}
    assert str(row(ins2)["balance"]) == "0.01"
    assert (ledger_insert.table, row(nokey_insert)) == ("ledger", {"a": 1})

    update, pk_update, ledger_update = of(Kind.UPDATE)  # nokey's update is not there
    assert row(update) == {"id": 1, "owner": "ada", "balance": Decimal("11.50")}
    assert row(update, "identity") == {"id": 1}  # the key, even though it did not change
    assert row(pk_update) == {"id": 20, "owner": "bob", "balance": Decimal("0.01")}
    assert row(pk_update, "identity") == {"id": 2}
    assert (row(ledger_update), row(ledger_update, "identity")) == ({"a": 1, "b": "b"}, {"a": 1, "b": "a"})

    delete, ledger_delete = of(Kind.DELETE)  # nokey's delete is not there either
    assert (delete.columns, row(delete, "identity")) == ([], {"id": 1})
    assert (ledger_delete.columns, row(ledger_delete, "identity")) == ([], {"a": 1, "b": "b"})

    truncates = of(Kind.TRUNCATE)
    assert [(t.schema, t.table) for t in truncates] == [("public", "account"), ("public", "ledger")]
    assert truncates[0].lsn == truncates[1].lsn and truncates[0].xid == truncates[1].xid


def test_unchanged_toast_is_omitted_and_full_identity_carries_it(conn: psycopg.Connection[Any]) -> None:
    conn.execute("DROP TABLE IF EXISTS doc; CREATE TABLE doc (id int PRIMARY KEY, body text, n int)")
    with wal2json_slot(conn, "toast") as changes:
        conn.execute("INSERT INTO doc SELECT 1, string_agg(md5(i::text), ''), 0 FROM generate_series(1, 32768) i")
        conn.execute("UPDATE doc SET n = 1")
        conn.execute("ALTER TABLE doc REPLICA IDENTITY FULL")
        conn.execute("UPDATE doc SET n = 2")
        messages = [m for m in decode_all(changes()) if m.kind in (Kind.INSERT, Kind.UPDATE)]
    body = conn.execute("SELECT body FROM doc").fetchone()[0]  # type: ignore[index]
    assert len(body) == 1024 * 1024
    insert, default_update, full_update = messages
    assert {c.name: c.value for c in insert.columns} == {"id": 1, "body": body, "n": 0}
    assert [c.name for c in default_update.columns] == ["id", "n"]  # body unchanged and TOASTed: absent
    assert [c.name for c in full_update.columns] == ["id", "n"]
    assert {c.name: c.value for c in full_update.identity} == {"id": 1, "body": body, "n": 1}


def test_decoder_meets_the_protocol() -> None:
    decoder = Wal2JsonDecoder()
    assert decoder.plugin is Plugin.WAL2JSON
    options = decoder.slot_options()
    assert options["format-version"] == "2" and options["include-type-oids"] == "1"
    options["format-version"] = "1"
    assert decoder.slot_options()["format-version"] == "2"  # a copy


# -- captured payloads: numeric exactness, parse paths, errors -----------------------------------


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes().rstrip(b"\n")


def test_fixture_insert_every_type() -> None:
    [insert] = Wal2JsonDecoder().decode(fixture("insert_every_type.json"))
    row = {c.name: c.value for c in insert.columns}
    assert (insert.kind, insert.schema, insert.table, insert.primary_key) == (
        Kind.INSERT,
        "public",
        "every_type",
        ["id"],
    )
    assert str(row["n38"]) == "1234567890123456789012345678.0123456789"
    assert str(row["n122"]) == "12.30" and str(row["n"]) == "12345.678"
    assert row["a_text"] == ["a b", "c,d", 'q"x', None, "NULL", "", "back\\slash", "{}"]
    assert row["tstz"] == datetime(2024, 3, 30, 20, 0, 0, 500000, tzinfo=UTC)
    types = {c.name: (c.type_name, c.type_oid) for c in insert.columns}
    assert types["vc"] == ("character varying(20)", 1043)
    assert types["a_num"] == ("numeric(10,2)[]", 1231)
    assert types["tstz3"] == ("timestamp(3) with time zone", 1184)


def test_fixture_edges_non_finite_numerics_are_null() -> None:
    [insert] = Wal2JsonDecoder().decode(fixture("insert_edges.json"))
    row = {c.name: c.value for c in insert.columns}
    assert (row["n"], row["r"], row["d"]) == (None, None, None)  # NaN, NaN, -Infinity in the table
    assert row["n38"] == Decimal("-0.0000000001") and str(row["n38"]) == "-1E-10"


def test_fixture_big_numeric_parses_exactly_on_every_path() -> None:
    payload = fixture("insert_big_numeric.json")
    expected = "9" + "0" * 999 + "." + "1" * 100
    [fast] = Wal2JsonDecoder().decode(payload)
    assert str(values(fast)["n"]) == expected
    # Without type OIDs there is no quoting: orjson's float must be caught and the payload re-parsed.
    [fallback] = Wal2JsonDecoder().decode(payload.replace(b'"typeoid":1700,', b""))
    assert str(values(fallback)["n"]) == expected
    assert str(values(fallback)["n38"]) == "-99999999999999999999999999.9999999999"
    assert values(fallback)["d"] == values(fast)["d"] == 1.7976931348623157e308


def values(message: ChangeMessage) -> dict[str, Any]:
    return {c.name: c.value for c in message.columns}


def test_numeric_integer_beyond_64_bits_without_type_oids() -> None:
    payload = (
        b'{"action":"I","xid":1,"timestamp":"2024-01-01 00:00:00+00","lsn":"0/1","schema":"s","table":"t",'
        b'"columns":[{"name":"n","type":"numeric","value":123456789012345678901234567890}],"pk":[]}'
    )
    [m] = Wal2JsonDecoder().decode(payload)
    assert m.columns[0] == Column("n", "numeric", 0, Decimal("123456789012345678901234567890"))


def test_fixture_transaction_boundaries() -> None:
    decoder = Wal2JsonDecoder()
    [begin] = decoder.decode(fixture("begin.json"))
    [commit] = decoder.decode(fixture("commit.json"))
    assert begin.kind is Kind.BEGIN and commit.kind is Kind.COMMIT
    assert (begin.lsn, begin.next_lsn, begin.xid) == (commit.lsn, commit.next_lsn, commit.xid)
    assert begin.next_lsn is not None and begin.next_lsn > begin.lsn
    assert begin.timestamp_ms == commit.timestamp_ms and begin.timestamp_ms is not None


def test_fixture_binary_message_content_is_exact() -> None:
    payload = fixture("message_binary.json")
    with pytest.raises(UnicodeDecodeError):
        payload.decode()  # wal2json passes the content's raw bytes through
    [m] = Wal2JsonDecoder().decode(payload)
    assert (m.kind, m.prefix, m.transactional, m.content) == (Kind.MESSAGE, "bin", True, b"a\xffb\xc3\xa9\n\r\"'\\")


def test_fixture_non_transactional_message() -> None:
    [m] = Wal2JsonDecoder().decode(fixture("message_non_transactional.json"))
    assert (m.transactional, m.xid, m.timestamp_ms, m.prefix, m.content) == (False, None, None, "nontx", b"at once")


def test_fixture_pk_update_and_truncate() -> None:
    [update] = Wal2JsonDecoder().decode(fixture("update_pk_change.json"))
    assert {c.name: c.value for c in update.identity} == {"id": 2}
    assert {c.name: c.value for c in update.columns}["id"] == 20
    [truncate] = Wal2JsonDecoder().decode(fixture("truncate.json"))
    assert (truncate.kind, truncate.schema, truncate.table, truncate.columns) == (
        Kind.TRUNCATE,
        "public",
        "account",
        [],
    )


def test_timestamps_and_lsns() -> None:
    decoder = Wal2JsonDecoder()
    for text, expected_ms in [
        ("2024-03-31 01:30:00.123456+00", 1711848600123),
        ("2024-03-31 07:00:00.5+05:30", 1711848600500),
        ("1969-12-31 23:59:59.9995+00", -1),  # floor, like Postgres' own epoch arithmetic
        ("2024-03-31 01:30:00+00", 1711848600000),
    ]:
        [m] = decoder.decode(
            f'{{"action":"B","xid":1,"timestamp":"{text}","lsn":"16/B374D848","nextlsn":"FFFFFFFF/FFFFFFFF"}}'.encode()
        )
        assert m.timestamp_ms == expected_ms, text
        assert (m.lsn, m.next_lsn) == (0x16B374D848, 2**64 - 1)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "malformed JSON"),
        (b'{"action":"I",', "malformed JSON"),
        (b"\xff\xfe", "malformed JSON"),
        (b"[1,2]", "not a JSON object"),
        (b'{"action":"X","xid":1}', "unknown action 'X'"),
        (b'{"change":[]}', "unknown action None"),
        (
            b'{"action":"B","xid":1,"timestamp":"2024-01-01 00:00:00+00","lsn":"0/1"}',
            "B record without field 'nextlsn'",
        ),
        (b'{"action":"I","xid":1,"timestamp":null,"lsn":"0/1","schema":"s","table":"t"}', "without field 'columns'"),
        (b'{"action":"D","xid":1,"timestamp":null,"lsn":"0/1","schema":"s","table":"t"}', "without field 'identity'"),
        (b'{"action":"B","xid":1,"timestamp":"2024-01-01 00:00:00+00","lsn":"01","nextlsn":"0/2"}', "not an LSN"),
        (b'{"action":"B","xid":"1","timestamp":null,"lsn":"0/1","nextlsn":"0/2"}', "xid must be an integer"),
        (b'{"action":"B","xid":1,"timestamp":"yesterday","lsn":"0/1","nextlsn":"0/2"}', "yesterday"),
        (
            b'{"action":"B","xid":1,"timestamp":"2024-01-01 00:00:00","lsn":"0/1","nextlsn":"0/2"}',
            "without a time zone",
        ),
        (
            b'{"action":"I","xid":1,"timestamp":null,"lsn":"0/1","schema":"s","table":"t","columns":'
            b'[{"name":"d","type":"date","typeoid":1082,"value":"2024-02-30"}]}',
            "column s.t.d (date)",
        ),
        (
            b'{"action":"I","xid":1,"timestamp":null,"lsn":"0/1","schema":"s","table":"t","columns":'
            b'[{"name":"c","type":"text","typeoid":25,"value":5}]}',
            "column s.t.c (text): not a string",
        ),
        (
            b'{"action":"M","xid":null,"timestamp":null,"lsn":"0/1","transactional":"no","prefix":"p","content":""}',
            "boolean",
        ),
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes, message: str) -> None:
    with pytest.raises(DecodeError, match=re.escape(message)) as raised:
        Wal2JsonDecoder().decode(payload)
    assert f"({len(payload)} bytes)" in str(raised.value)  # names the payload with an excerpt


def test_error_excerpt_is_short() -> None:
    payload = b'{"action":"Z","filler":"' + b"x" * 10_000 + b'"}'
    with pytest.raises(DecodeError) as raised:
        Wal2JsonDecoder().decode(payload)
    assert len(str(raised.value)) < 400 and "…" in str(raised.value)


def test_timezone_offsets_for_fixture_zones_parse() -> None:
    # Historic offsets with seconds, as Postgres prints them in a non-UTC session.
    tz = timezone(timedelta(hours=-3, minutes=-30, seconds=-52))
    assert convert_text("timestamp with time zone", 1184, "1900-01-01 20:29:08-03:30:52") == datetime(
        1900, 1, 1, 20, 29, 8, tzinfo=tz
    )
