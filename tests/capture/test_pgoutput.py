"""capture.decoders.pgoutput against a real PostgreSQL 15, differentially against wal2json.

Every live test creates a pgoutput slot and a wal2json slot at the same WAL position
(``publication_names`` = a ``FOR ALL TABLES`` publication), makes its changes, reads both
slots with ``pg_logical_slot_get_binary_changes`` (the bytes START_REPLICATION would
carry, with the LSN the XLogData message would carry), decodes them and checks:

* field by field, against what the statements did;
* against wal2json's decoding of the same changes: the same kinds, schemas, tables,
  xids, commit times, LSNs and values in the same order, but for the documented
  differences (NaN/±Infinity: null in wal2json; Begin's ``next_lsn``; ``primary_key``;
  truncate options; wal2json's B/C of empty transactions and its NUL-cut message content);
* values against the snapshot's path (``convert_text`` of the uncast column), which
  pgoutput matches exactly, NaN and -0 included.

Each test drops its slots (slots hold WAL). Synthetic payloads at the bottom drive the
error paths and the streamed (protocol 2) messages that are awkward to provoke live.
"""

from __future__ import annotations

import doctest
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_wal2json import EVERY_TYPE_DDL, EVERY_TYPE_ROWS, NON_FINITE, assert_same, session_options, text_values

from capture.decoders import decoder_for
from capture.decoders.pgoutput import PgOutputDecoder, TypeResolver, builtin_type_name
from capture.decoders.pgoutput import decoder as pgoutput_decoder
from capture.decoders.pgoutput import types as pgoutput_types
from capture.decoders.pgoutput.streams import StreamedAbortAmbiguous
from capture.decoders.pgoutput.types import BUILTIN_ARRAYS, BUILTIN_TYPES
from capture.decoders.wal2json import Wal2JsonDecoder
from capture.messages import ChangeMessage, Column, DecodeError, DecoderSettings, Kind, Plugin
from capture.pgtypes import Interval, JsonText, NonFiniteFloat, dumps
from tideline.pgharness import LocalPostgres, require_wal2json

PUBLICATION = "cdc_all"


@pytest.fixture(scope="module")
def dsn(postgres: LocalPostgres) -> str:
    require_wal2json(postgres.binaries)
    dsn = postgres.create_database("capture_pgoutput")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"DROP PUBLICATION IF EXISTS {PUBLICATION};"
            f"CREATE PUBLICATION {PUBLICATION} FOR ALL TABLES WITH (publish = 'insert, update, delete, truncate')"
        )
    return dsn


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True, options=session_options()) as connection:
        yield connection


Payload = tuple[int, bytes]  # (LSN as the server reports it: the XLogData WAL start, payload)


def lsn_int(text: str) -> int:
    high, low = text.split("/")
    return int(high, 16) << 32 | int(low, 16)


@dataclass
class Slots:
    """A pgoutput and a wal2json slot created at the same point; each read consumes their changes."""

    conn: psycopg.Connection[Any]
    name: str

    def read(self, slot: str, options: dict[str, str], *, peek: bool = False) -> list[Payload]:
        function = "pg_logical_slot_peek_binary_changes" if peek else "pg_logical_slot_get_binary_changes"
        flat = [item for pair in options.items() for item in pair]
        rows = self.conn.execute(
            f"SELECT lsn::text, data FROM {function}(%s, NULL, NULL, VARIADIC %s::text[])",  # type: ignore[arg-type]
            (slot, flat),
        ).fetchall()
        return [(lsn_int(lsn), bytes(data)) for lsn, data in rows]

    def pgoutput(self, decoder: PgOutputDecoder | None = None, *, peek: bool = False) -> list[ChangeMessage]:
        """Decoded as the connector will: with a resolver asking the catalog's format_type."""
        decoder = decoder or PgOutputDecoder(PUBLICATION, type_resolver=format_type_resolver(self.conn))
        payloads = self.read(f"{self.name}_pgo", decoder.slot_options(), peek=peek)
        return [m for lsn, payload in payloads for m in decoder.decode(payload, lsn)]

    def wal2json(self) -> list[ChangeMessage]:
        decoder = Wal2JsonDecoder()
        payloads = self.read(f"{self.name}_w2j", decoder.slot_options())
        return [m for _, payload in payloads for m in decoder.decode(payload)]


def format_type_resolver(conn: psycopg.Connection[Any], asked: list[int] | None = None) -> TypeResolver:
    def resolve(type_oid: int, typmod: int) -> str:
        if asked is not None:
            asked.append(type_oid)
        found = conn.execute("SELECT format_type(%s, %s)", (type_oid, typmod)).fetchone()
        assert found is not None
        return str(found[0])

    return resolve


@contextmanager
def slots(conn: psycopg.Connection[Any], name: str) -> Iterator[Slots]:
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"{name}_pgo",))
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'wal2json')", (f"{name}_w2j",))
    try:
        yield Slots(conn, name)
    finally:
        for slot in (f"{name}_pgo", f"{name}_w2j"):
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def non_empty(messages: list[ChangeMessage]) -> list[ChangeMessage]:
    """Without the B/C pairs of transactions that changed nothing (wal2json sends them, pgoutput 15 does not)."""
    out: list[ChangeMessage] = []
    for m in messages:
        if m.kind is Kind.COMMIT and out and out[-1].kind is Kind.BEGIN:
            out.pop()
        else:
            out.append(m)
    return out


def is_non_finite(value: Any) -> bool:
    return (isinstance(value, Decimal) and not value.is_finite()) or isinstance(value, NonFiniteFloat)


def assert_columns_match(ours: list[Column], theirs: list[Column], where: str) -> None:
    """pgoutput's columns == wal2json's, but NaN/±Infinity, which wal2json turns into null.

    Type names are format_type's, as the snapshot's catalog gives them; wal2json differs
    for the one-byte ``"char"`` type alone, which it names ``char`` without the quotes.
    """
    names = [(c.name, c.type_name if c.type_name != '"char"' else "char", c.type_oid) for c in ours]
    assert names == [(c.name, c.type_name, c.type_oid) for c in theirs], where
    for mine, other in zip(ours, theirs, strict=True):
        if other.value is None and is_non_finite(mine.value):
            continue  # the documented difference: wal2json cannot tell NaN/±Infinity from NULL
        if isinstance(mine.value, float) and mine.value == other.value == 0.0:
            continue  # wal2json writes -0 of real/double as the JSON integer -0, read as 0.0 (pgtypes [8])
        assert_same(mine.value, other.value, f"{where} column {mine.name}")


def without_generated(messages: list[ChangeMessage], generated: set[str]) -> list[ChangeMessage]:
    """wal2json's messages without the stored generated columns, which pgoutput 15 does not send."""
    for m in messages:
        m.columns = [c for c in m.columns if c.name not in generated]
        m.identity = [c for c in m.identity if c.name not in generated]
    return messages


def assert_matches_wal2json(ours: list[ChangeMessage], theirs: list[ChangeMessage]) -> None:
    """The same stream, message by message, but for the differences the module docstring documents."""
    theirs = non_empty(theirs)
    assert [m.kind for m in ours] == [m.kind for m in theirs]
    for i, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        where = f"message {i} ({mine.kind.name} {mine.schema}.{mine.table})"
        assert (mine.lsn, mine.xid, mine.timestamp_ms, mine.schema, mine.table) == (
            other.lsn, other.xid, other.timestamp_ms, other.schema, other.table), where  # fmt: skip
        if mine.kind is Kind.BEGIN:
            assert mine.next_lsn is None and other.next_lsn is not None, where  # pgoutput's Begin has no end LSN
        else:
            assert mine.next_lsn == other.next_lsn, where
        assert_columns_match(mine.columns, other.columns, f"{where} columns")
        assert_columns_match(mine.identity, other.identity, f"{where} identity")
        assert mine.primary_key == [], where  # pgoutput does not name the primary key
        if mine.kind is Kind.MESSAGE:
            assert (mine.transactional, mine.prefix) == (other.transactional, other.prefix), where
            assert other.content == (mine.content or b"").split(b"\0")[0], where  # wal2json cuts at NUL


# -- every type: pgoutput == snapshot text == wal2json (but NaN) ---------------------------------------


def test_every_type_matches_the_snapshot_and_wal2json(conn: psycopg.Connection[Any]) -> None:
    conn.execute(EVERY_TYPE_DDL)
    with slots(conn, "every_type") as both:
        for statement in EVERY_TYPE_ROWS:
            conn.execute(statement.encode())
        ours, theirs = both.pgoutput(), both.wal2json()
    assert_matches_wal2json(ours, theirs)
    inserts = {m.columns[0].value: m for m in ours if m.kind is Kind.INSERT}
    assert sorted(inserts) == [1, 2, 3, 4, 5, 6]
    for key, insert in inserts.items():
        snapshot = text_values(conn, "every_type", insert.columns, key)
        for column in insert.columns:
            # pgoutput carries the text output: NaN, ±Infinity and -0 exactly as the snapshot reads them.
            assert_same(column.value, snapshot[column.name], f"row {key} column {column.name} ({column.type_name})")
    for key, name in NON_FINITE:
        value = next(c.value for c in inserts[key].columns if c.name == name)
        assert is_non_finite(value) and dumps(value) in (b'"NaN"', b'"Infinity"', b'"-Infinity"'), (key, name)
    row = {c.name: c for c in inserts[1].columns}
    assert (row["m"].type_name, row["a_mood"].type_name) == ("mood", "mood[]")  # from the Type messages
    assert (row["n122"].type_name, row["a_vc"].type_name, row["ivym"].type_name) == (
        "numeric(12,2)", "character varying(5)[]", "interval year to month")  # fmt: skip
    assert row["a_mood"].value == ["sad", "happy"] and row["m"].value == "happy"


# -- every operation ----------------------------------------------------------------------------------


WORKLOAD_DDL = """
DROP TABLE IF EXISTS account, ledger, parent, child, counter, doc, measure CASCADE;
DROP DOMAIN IF EXISTS positive;
DROP TYPE IF EXISTS state;
CREATE TYPE state AS ENUM ('open', 'closed');
CREATE DOMAIN positive AS int CHECK (VALUE > 0);
CREATE TABLE account (id int PRIMARY KEY, owner text, balance numeric(12,2), st state, p positive,
                      tags state[], doc jsonb, raw bytea, at timestamptz, span interval);
CREATE TABLE ledger (a int, b text, n numeric, f float8);
ALTER TABLE ledger REPLICA IDENTITY FULL;
CREATE TABLE parent (id int PRIMARY KEY);
CREATE TABLE child (id serial PRIMARY KEY, parent_id int REFERENCES parent);
CREATE TABLE counter (id serial PRIMARY KEY, v int);
CREATE TABLE doc (id int PRIMARY KEY, body text, n int);
ALTER TABLE doc ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE TABLE measure (id int PRIMARY KEY, n numeric, r real, d double precision)
"""


def run_workload(conn: psycopg.Connection[Any]) -> None:
    with conn.transaction():
        conn.execute(
            """INSERT INTO account VALUES
            (1, 'ada', 10.50, 'open', 5, '{open,closed}', '{"big": 12345678901234567890.123456789, "a": [1, null]}',
             '\\x00ff5c', '2024-03-31 01:30:00.5+05:30', '1 year 2 mons 3 days 04:05:06.789'),
            (2, 'bob', 0.01, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"""
        )
        conn.execute("SELECT pg_logical_emit_message(true, 'tx', 'in the transaction')")
        conn.execute("SELECT pg_logical_emit_message(false, 'nontx', 'at once')")
    conn.execute("UPDATE account SET balance = balance + 1, owner = NULL WHERE id = 1")
    conn.execute("UPDATE account SET id = 20 WHERE id = 2")  # key change: 'K' old key
    conn.execute("DELETE FROM account WHERE id = 1")
    conn.execute("INSERT INTO ledger VALUES (1, 'a', 'NaN', '-Infinity'); UPDATE ledger SET b = 'b', n = 'Infinity'")
    conn.execute("DELETE FROM ledger")
    conn.execute(
        "INSERT INTO measure VALUES (1, 'NaN', 'Infinity', '-Infinity'), (2, '-Infinity', 'NaN', '-0'),"
        "(3, NULL, NULL, NULL), (4, ('9' || repeat('0', 999) || '.' || repeat('1', 100))::numeric, 1.5, 1e308)"
    )
    conn.execute("UPDATE measure SET n = 'Infinity' WHERE id = 3; DELETE FROM measure WHERE id = 2")
    # unchanged TOAST: 'u' under DEFAULT; under FULL the old row carries the value
    conn.execute("INSERT INTO doc SELECT 1, string_agg(md5(i::text), ''), 0 FROM generate_series(1, 2048) i")
    conn.execute("UPDATE doc SET n = 1")
    conn.execute("ALTER TABLE doc REPLICA IDENTITY FULL")
    conn.execute("UPDATE doc SET n = 2")
    conn.execute(
        "INSERT INTO parent VALUES (1); INSERT INTO child (parent_id) VALUES (1); INSERT INTO counter (v) VALUES (1)"
    )
    conn.execute("TRUNCATE parent CASCADE")
    conn.execute("TRUNCATE counter RESTART IDENTITY")
    conn.execute("TRUNCATE account, ledger")
    conn.execute(r"SELECT pg_logical_emit_message(true, 'bin', '\x61ff62c3a90a0d22275c'::bytea)")
    # not last: a non-transactional message is flushed (and readable) only with a later commit
    conn.execute(r"SELECT pg_logical_emit_message(false, 'nontx-nul', '\x00'::bytea)")
    conn.execute(r"SELECT pg_logical_emit_message(true, 'nul', '\x610062'::bytea)")


def test_every_operation_field_by_field_and_against_wal2json(conn: psycopg.Connection[Any]) -> None:
    conn.execute(WORKLOAD_DDL)
    with slots(conn, "ops") as both:
        run_workload(conn)
        ours, theirs = both.pgoutput(), both.wal2json()
    assert_matches_wal2json(ours, theirs)
    body = conn.execute("SELECT body FROM doc").fetchone()[0]  # type: ignore[index]

    kinds = "".join(m.kind.value for m in ours)
    assert kinds == "MBIIMCBUCBUCBDCBIUCBDCBIIIICBUDCBICBUCBUCBIIICBTTCBTCBTTCBMCMBMC"

    def of(kind: Kind, table: str | None = None) -> list[ChangeMessage]:
        return [m for m in ours if m.kind is kind and (table is None or m.table == table)]

    def row(m: ChangeMessage, image: str = "columns") -> dict[str, Any]:
        return {c.name: c.value for c in getattr(m, image)}

    for m in ours:  # every change carries its transaction's xid and commit time, as the B and C do
        if m.kind is not Kind.MESSAGE or m.transactional:
            assert m.xid is not None and m.timestamp_ms is not None, m
    begins, commits = of(Kind.BEGIN), of(Kind.COMMIT)
    assert [(b.lsn, b.xid, b.timestamp_ms) for b in begins] == [(c.lsn, c.xid, c.timestamp_ms) for c in commits]
    assert all(c.next_lsn is not None and c.next_lsn > c.lsn for c in commits)

    ada, bob = of(Kind.INSERT, "account")
    assert (ada.schema, ada.identity, ada.primary_key) == ("public", [], [])
    assert row(ada) == {
        "id": 1, "owner": "ada", "balance": Decimal("10.50"), "st": "open", "p": "5", "tags": ["open", "closed"],
        "doc": JsonText('{"a": [1, null], "big": 12345678901234567890.123456789}'), "raw": b"\x00\xff\\",
        "at": row(ada)["at"], "span": Interval(14, 3, 14_706_789_000),
    }  # fmt: skip
    assert row(ada)["at"].isoformat() == "2024-03-30T20:00:00.500000+00:00"  # rendered in the session's UTC
    types = {c.name: (c.type_name, c.type_oid) for c in ada.columns}
    assert types["balance"] == ("numeric(12,2)", 1700) and types["st"][0] == "state" and types["p"][0] == "positive"
    assert types["tags"][0] == "state[]" and types["at"] == ("timestamp with time zone", 1184)
    assert row(bob) == {"id": 2, "owner": "bob", "balance": Decimal("0.01"), "st": None, "p": None, "tags": None,
                        "doc": None, "raw": None, "at": None, "span": None}  # fmt: skip

    update, key_change = of(Kind.UPDATE, "account")
    assert row(update)["owner"] is None and row(update)["balance"] == Decimal("11.50")
    assert row(update, "identity") == {"id": 1}  # no old tuple sent: the new row's key, as wal2json
    assert row(key_change)["id"] == 20 and row(key_change, "identity") == {"id": 2}  # 'K': the key columns only
    [delete] = of(Kind.DELETE, "account")
    assert (delete.columns, row(delete, "identity")) == ([], {"id": 1})

    [ledger_update] = of(Kind.UPDATE, "ledger")
    old, new = row(ledger_update, "identity"), row(ledger_update)
    assert (old["b"], str(old["n"]), repr(old["f"])) == ("a", "NaN", "-inf")  # 'O': the old row, NaN kept
    assert (new["b"], str(new["n"])) == ("b", "Infinity")
    [ledger_delete] = of(Kind.DELETE, "ledger")
    assert str(row(ledger_delete, "identity")["n"]) == "Infinity"

    measures = {row(m)["id"]: row(m) for m in of(Kind.INSERT, "measure")}
    assert [str(v) for v in measures[1].values()] == ["1", "NaN", "inf", "-inf"]
    assert str(measures[2]["n"]) == "-Infinity" and str(measures[2]["d"]) == "-0.0"
    assert measures[3] == {"id": 3, "n": None, "r": None, "d": None}  # NULL stays distinct from NaN
    assert str(measures[4]["n"]) == "9" + "0" * 999 + "." + "1" * 100
    assert isinstance(measures[1]["r"], NonFiniteFloat) and isinstance(measures[1]["n"], Decimal)

    doc_insert = of(Kind.INSERT, "doc")[0]
    default_update, full_update = of(Kind.UPDATE, "doc")
    assert row(doc_insert) == {"id": 1, "body": body, "n": 0}
    assert [c.name for c in default_update.columns] == ["id", "n"]  # body unchanged and TOASTed: 'u', left out
    assert [c.name for c in full_update.columns] == ["id", "n"]
    assert row(full_update, "identity") == {"id": 1, "body": body, "n": 1}

    truncates = [(t.table, t.truncate_cascade, t.truncate_restart_identity) for t in of(Kind.TRUNCATE)]
    assert truncates == [
        ("parent", True, False), ("child", True, False), ("counter", False, True),
        ("account", False, False), ("ledger", False, False),
    ]  # fmt: skip
    parent, child = of(Kind.TRUNCATE)[:2]
    assert (parent.lsn, parent.xid) == (child.lsn, child.xid)

    nontx, tx, binary, nontx_nul, nul = of(Kind.MESSAGE)
    assert (nontx.transactional, nontx.prefix, nontx.content, nontx.xid, nontx.timestamp_ms) == (
        False, "nontx", b"at once", None, None)  # fmt: skip
    assert (tx.transactional, tx.prefix, tx.content, tx.xid) == (True, "tx", b"in the transaction", ada.xid)
    assert binary.content == b"a\xffb\xc3\xa9\n\r\"'\\"
    assert nul.content == b"a\x00b" and nontx_nul.content == b"\x00"  # exact: NUL bytes included


def test_odd_names_index_identity_partitions_dropped_and_generated_columns(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        'DROP SCHEMA IF EXISTS "Odd schema" CASCADE; CREATE SCHEMA "Odd schema";'
        'CREATE TABLE "Odd schema"."Tbl ü" ("Mixed Col" int PRIMARY KEY, "a""b" text, gone int, "c,d" text);'
        'ALTER TABLE "Odd schema"."Tbl ü" DROP COLUMN gone;'
        'CREATE TABLE "Odd schema".ident (id int PRIMARY KEY, code text NOT NULL UNIQUE, v int,'
        " twice int GENERATED ALWAYS AS (v * 2) STORED);"
        'ALTER TABLE "Odd schema".ident REPLICA IDENTITY USING INDEX ident_code_key;'
        'CREATE TABLE "Odd schema".part (id int PRIMARY KEY, v text) PARTITION BY RANGE (id);'
        'CREATE TABLE "Odd schema".part_low PARTITION OF "Odd schema".part FOR VALUES FROM (0) TO (100)'
    )
    with slots(conn, "odd") as both:
        conn.execute('INSERT INTO "Odd schema"."Tbl ü" VALUES (1, \'x"y\', \'\')')
        conn.execute('UPDATE "Odd schema"."Tbl ü" SET "Mixed Col" = 2')
        conn.execute("INSERT INTO \"Odd schema\".ident (id, code, v) VALUES (1, 'a', 1)")
        conn.execute('UPDATE "Odd schema".ident SET v = 2; UPDATE "Odd schema".ident SET code = \'b\'')
        conn.execute('DELETE FROM "Odd schema".ident')
        conn.execute("INSERT INTO \"Odd schema\".part VALUES (5, 'low'); UPDATE \"Odd schema\".part SET v = 'lower'")
        ours, theirs = both.pgoutput(), both.wal2json()
    ident_by_wal2json = next(m for m in theirs if m.kind is Kind.INSERT and m.table == "ident")
    assert [c.name for c in ident_by_wal2json.columns] == ["id", "code", "v", "twice"]  # wal2json sends generated ones
    assert_matches_wal2json(ours, without_generated(theirs, {"twice"}))
    changes = [m for m in ours if m.kind not in (Kind.BEGIN, Kind.COMMIT)]
    assert [(m.kind.value, m.schema, m.table) for m in changes] == [
        ("I", "Odd schema", "Tbl ü"), ("U", "Odd schema", "Tbl ü"),
        ("I", "Odd schema", "ident"), ("U", "Odd schema", "ident"), ("U", "Odd schema", "ident"),
        ("D", "Odd schema", "ident"),
        ("I", "Odd schema", "part_low"), ("U", "Odd schema", "part_low"),  # the leaf partition, as wal2json
    ]  # fmt: skip
    odd_insert, odd_key_change, ident_insert, ident_update, ident_key_change, ident_delete = changes[:6]
    assert [(c.name, c.value) for c in odd_insert.columns] == [("Mixed Col", 1), ('a"b', 'x"y'), ("c,d", "")]
    assert [(c.name, c.value) for c in odd_key_change.identity] == [("Mixed Col", 1)]
    # the generated column is not sent (pgoutput 15 leaves generated columns out)
    assert [c.name for c in ident_insert.columns] == ["id", "code", "v"]
    assert [(c.name, c.value) for c in ident_update.identity] == [("code", "a")]  # USING INDEX: the index's columns
    assert [(c.name, c.value) for c in ident_key_change.identity] == [("code", "a")]
    assert [(c.name, c.value) for c in ident_delete.identity] == [("code", "b")]
    conn.execute('DROP SCHEMA "Odd schema" CASCADE')


def test_type_resolver_or_type_messages_name_the_types(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "DROP SCHEMA IF EXISTS elsewhere CASCADE; CREATE SCHEMA elsewhere;"
        "CREATE TYPE elsewhere.color AS ENUM ('red', 'blue');"
        "CREATE DOMAIN elsewhere.positive AS int CHECK (VALUE > 0);"
        "CREATE DOMAIN elsewhere.hue AS elsewhere.color;"
        "CREATE TABLE elsewhere.paint (id int PRIMARY KEY, c elsewhere.color, cs elsewhere.color[], n numeric(5,-2),"
        "p elsewhere.positive, h elsewhere.hue)"
    )
    asked: list[int] = []
    with slots(conn, "resolver") as both:
        conn.execute("INSERT INTO elsewhere.paint VALUES (1, 'red', '{blue,red}', 12345, 7, 'blue')")
        resolved = both.pgoutput(
            PgOutputDecoder(PUBLICATION, type_resolver=format_type_resolver(conn, asked)), peek=True
        )
        fallback = both.pgoutput(PgOutputDecoder(PUBLICATION))  # no resolver: the Type messages name them
        theirs = both.wal2json()
    assert_matches_wal2json(resolved, theirs)
    [insert] = [m for m in resolved if m.kind is Kind.INSERT]
    assert [(c.type_name, c.value) for c in insert.columns] == [
        ("integer", 1), ("elsewhere.color", "red"), ("elsewhere.color[]", ["blue", "red"]),
        ("numeric(5,-2)", Decimal("12300")), ("elsewhere.positive", "7"), ("elsewhere.hue", "blue"),
    ]  # fmt: skip
    assert len(asked) == 4  # built-in types never reach the resolver
    [without] = [m for m in fallback if m.kind is Kind.INSERT]
    # The same values; a Type message names a domain by its base type (see capture.decoders.pgoutput.types).
    assert [(c.type_name, c.value) for c in without.columns] == [
        ("integer", 1), ("elsewhere.color", "red"), ("elsewhere.color[]", ["blue", "red"]),
        ("numeric(5,-2)", Decimal("12300")), ("domain over int4", "7"), ("elsewhere.color", "blue"),
    ]  # fmt: skip
    conn.execute("DROP SCHEMA elsewhere CASCADE")


def test_streamed_transactions_decode_as_the_unstreamed_ones(conn: psycopg.Connection[Any]) -> None:
    """Protocols 2 and 3 with streaming on: big transactions arrive in Stream Start/Stop blocks before their
    commit, and decode as protocol 1 (no streaming) gives them, from a real server (3 without ``two_phase``:
    what PostgreSQL 15 sends then is protocol 2's set of messages)."""
    conn.execute("DROP TABLE IF EXISTS bulk; CREATE TABLE bulk (id int PRIMARY KEY, pad text)")
    conn.execute("SET logical_decoding_work_mem = '64kB'")  # the smallest: stream after a few hundred rows
    with slots(conn, "streamed") as both:
        with conn.transaction():
            conn.execute("INSERT INTO bulk SELECT i, repeat('x', 200) FROM generate_series(1, 2000) i")
            with pytest.raises(psycopg.errors.UniqueViolation), conn.transaction():  # an aborted subtransaction
                conn.execute("INSERT INTO bulk SELECT i, 'sub' FROM generate_series(2001, 3000) i")
                conn.execute("INSERT INTO bulk VALUES (1, 'duplicate')")
            conn.execute("SELECT pg_logical_emit_message(true, 'tx', 'streamed')")
            conn.execute("UPDATE bulk SET pad = 'y' WHERE id <= 1000")
        with pytest.raises(psycopg.errors.UniqueViolation), conn.transaction():  # a streamed, aborted transaction
            conn.execute("INSERT INTO bulk SELECT i, repeat('z', 200) FROM generate_series(3001, 6000) i")
            conn.execute("INSERT INTO bulk VALUES (1, 'duplicate')")
        conn.execute("INSERT INTO bulk VALUES (0, 'after')")
        unstreamed = both.pgoutput(peek=True)  # protocol 1
        raws = {version: both.read("streamed_pgo", PgOutputDecoder(PUBLICATION, proto_version=version,
                                                                   streaming=True).slot_options(), peek=True)
                for version in (2, 3)}  # fmt: skip
        theirs = both.wal2json()
    assert_matches_wal2json(unstreamed, theirs)
    assert "".join(m.kind.value for m in unstreamed) == "B" + "I" * 2000 + "M" + "U" * 1000 + "CBIC"
    for version, raw in raws.items():
        tags = {payload[:1] for _, payload in raw}
        assert {b"S", b"E", b"c", b"A"} <= tags, version  # it did stream, commit and abort
        decoder = PgOutputDecoder(PUBLICATION, proto_version=version, streaming=True)
        streamed = [m for lsn, payload in raw for m in decoder.decode(payload, lsn)]
        assert [(m.kind, m.lsn, m.xid, m.timestamp_ms, m.next_lsn) for m in streamed] == [
            (m.kind, m.lsn, m.xid, m.timestamp_ms, m.next_lsn) for m in unstreamed
        ], version
        assert [(m.columns, m.identity, m.content) for m in streamed] == [
            (m.columns, m.identity, m.content) for m in unstreamed
        ], version


def test_docstring_examples_run() -> None:
    assert doctest.testmod(pgoutput_decoder).failed == 0
    assert doctest.testmod(pgoutput_types).failed == 0


def test_decoder_meets_the_protocol(tmp_path: Path) -> None:
    decoder = decoder_for(Plugin.PGOUTPUT)
    assert isinstance(decoder, PgOutputDecoder) and decoder.plugin is Plugin.PGOUTPUT
    assert Plugin.PGOUTPUT.implemented and Plugin.PGOUTPUT.capabilities.numeric_nan_distinct
    # the connector's default: protocol 2, in-progress transactions streamed (and spilled)
    assert decoder.slot_options() == {
        "proto_version": "2", "publication_names": "tideline", "messages": "true", "streaming": "on"}  # fmt: skip
    assert PgOutputDecoder("p").slot_options() == {"proto_version": "1", "publication_names": "p", "messages": "true"}
    options = PgOutputDecoder("My Pub", proto_version=2, streaming=True).slot_options()
    assert options == {"proto_version": "2", "publication_names": '"My Pub"', "messages": "true", "streaming": "on"}
    decoder.slot_options()["proto_version"] = "1"
    assert decoder.slot_options()["proto_version"] == "2"  # a copy
    assert PgOutputDecoder("a,b").slot_options()["publication_names"] == '"a,b"'
    # the connector's two publications, and what it says in DecoderSettings
    settings = DecoderSettings(publications=("cdc", "cdc_keyless"), proto_version=3, spill_dir=tmp_path / "spill")
    configured = decoder_for(Plugin.PGOUTPUT, settings)
    assert isinstance(configured, PgOutputDecoder) and configured.spilled.directory == tmp_path / "spill"
    assert configured.slot_options() == {
        "proto_version": "3", "publication_names": "cdc,cdc_keyless", "messages": "true", "streaming": "on",
    }  # fmt: skip
    one = decoder_for(Plugin.PGOUTPUT, DecoderSettings(publications=("p",), proto_version=1))
    assert "streaming" not in one.slot_options()  # protocol 1 cannot stream: the server spills instead
    with pytest.raises(ValueError, match="proto_version 2 or 3"):
        PgOutputDecoder("p", streaming=True)
    with pytest.raises(ValueError, match="1, 2 or 3"):
        PgOutputDecoder("p", proto_version=4)
    with pytest.raises(ValueError, match="at least one publication"):
        PgOutputDecoder(())


def test_publication_name_is_quoted_for_the_server(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "DROP TABLE IF EXISTS only_this, not_this; CREATE TABLE only_this (id int PRIMARY KEY);"
        'CREATE TABLE not_this (id int PRIMARY KEY); DROP PUBLICATION IF EXISTS "My Pub";'
        'CREATE PUBLICATION "My Pub" FOR TABLE only_this'
    )
    decoder = PgOutputDecoder("My Pub")
    with slots(conn, "quoted") as both:
        conn.execute("INSERT INTO only_this VALUES (1); INSERT INTO not_this VALUES (1)")
        messages = both.pgoutput(decoder)
    assert [(m.kind, m.table) for m in messages if m.kind is not Kind.BEGIN and m.kind is not Kind.COMMIT] == [
        (Kind.INSERT, "only_this")  # not_this is not in "My Pub"
    ]
    conn.execute('DROP PUBLICATION "My Pub"')


def test_builtin_type_names_are_format_type(conn: psycopg.Connection[Any]) -> None:
    """The built-in table and typmod rendering against the server's own format_type."""
    rows = conn.execute("SELECT oid::int, format_type(oid, -1) FROM pg_type WHERE oid < 10000").fetchall()
    known = set(BUILTIN_TYPES) | set(BUILTIN_ARRAYS)
    checked = [(oid, name) for oid, name in rows if oid in known]
    assert len(checked) == len(known)
    assert [(oid, builtin_type_name(oid, -1)) for oid, _ in checked] == checked
    conn.execute(
        "DROP TABLE IF EXISTS typmods; CREATE TABLE typmods (a char(3), b varchar(20), c numeric(38,10),"
        "d numeric(5,-2), e numeric(3), f bit(3), g varbit(8), h time(3), i timetz(0), j timestamp(6),"
        "k timestamptz(3), l interval, m interval year to month, n interval day to second(3), o interval(2),"
        "p interval minute, q char(3)[], r numeric(10,2)[], s timestamptz(3)[], t bpchar, u interval hour to minute)"
    )
    columns = conn.execute(
        "SELECT atttypid::int, atttypmod, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = 'typmods'::regclass AND attnum > 0 ORDER BY attnum"
    ).fetchall()
    assert [(oid, typmod, builtin_type_name(oid, typmod)) for oid, typmod, _ in columns] == columns
    assert builtin_type_name(16384, -1) is None


# -- synthetic payloads: the layout, errors, streaming ------------------------------------------------

_RELATION_OID = 16385


def relation_message(*columns: tuple[int, str, int, int], xid: int | None = None, oid: int = _RELATION_OID) -> bytes:
    body = b"".join(
        struct.pack("!B", flags) + name.encode() + b"\0" + struct.pack("!Ii", type_oid, typmod)
        for flags, name, type_oid, typmod in columns
    )
    head = b"R" + (b"" if xid is None else struct.pack("!I", xid))
    return head + struct.pack("!I", oid) + b"public\0t\0d" + struct.pack("!H", len(columns)) + body


def tuple_data(*values: bytes | str | None) -> bytes:
    """'u' for unchanged TOAST, None for NULL, bytes for text."""
    out = struct.pack("!H", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif isinstance(value, str):
            out += value.encode()
        else:
            out += b"t" + struct.pack("!I", len(value)) + value
    return out


KEY_AND_VALUE = relation_message((1, "id", 23, -1), (0, "v", 1700, -1))


def insert(*values: bytes | str | None, xid: int | None = None) -> bytes:
    return (
        b"I"
        + (b"" if xid is None else struct.pack("!I", xid))
        + struct.pack("!I", _RELATION_OID)
        + b"N"
        + tuple_data(*values)
    )


def test_synthetic_begin_commit_and_timestamps() -> None:
    decoder = PgOutputDecoder()
    commit_time = 765_163_800_123_456  # 2024-03-31 01:30:00.123456 UTC in microseconds since 2000
    [begin] = decoder.decode(b"B" + struct.pack("!QqI", 0x16B374D848, commit_time, 77), 0x16B374D000)
    [commit] = decoder.decode(b"C" + struct.pack("!BQQq", 0, 0x16B374D848, 0x16B374D900, commit_time), 0x16B374D900)
    assert (begin.kind, begin.lsn, begin.xid, begin.timestamp_ms, begin.next_lsn) == (
        Kind.BEGIN, 0x16B374D848, 77, 1711848600123, None)  # fmt: skip
    assert (commit.kind, commit.lsn, commit.xid, commit.timestamp_ms, commit.next_lsn) == (
        Kind.COMMIT, 0x16B374D848, 77, 1711848600123, 0x16B374D900)  # fmt: skip
    [before_2000] = decoder.decode(b"B" + struct.pack("!QqI", 1, -500, 1))
    assert before_2000.timestamp_ms == 946684799999  # floor, like the wal2json decoder
    assert decoder.decode(b"O" + struct.pack("!Q", 5) + b"origin\0") == []


def test_synthetic_unchanged_toast_null_and_key_tuples() -> None:
    decoder = PgOutputDecoder()
    decoder.decode(KEY_AND_VALUE)
    [m] = decoder.decode(
        b"U" + struct.pack("!I", _RELATION_OID) + b"K" + tuple_data(b"1", None) + b"N" + tuple_data(b"2", "u"), 9
    )
    assert (m.kind, m.lsn, m.columns, m.identity) == (
        Kind.UPDATE, 9, [Column("id", "integer", 23, 2)], [Column("id", "integer", 23, 1)])  # fmt: skip
    [d] = decoder.decode(b"D" + struct.pack("!I", _RELATION_OID) + b"O" + tuple_data(b"3", b"NaN"))
    assert [str(c.value) for c in d.identity] == ["3", "NaN"] and isinstance(d.identity[1].value, Decimal)
    [i] = decoder.decode(insert(b"4", None))
    assert [c.value for c in i.columns] == [4, None]


def test_synthetic_streaming_with_subtransaction_abort(tmp_path: Path) -> None:
    """Streamed payloads go to disk raw and are decoded only at Stream Commit; an aborted transaction's never
    are (its malformed insert would raise), an aborted subtransaction's are skipped."""
    decoder = PgOutputDecoder(proto_version=2, streaming=True, spill_dir=tmp_path)
    assert list(decoder.decode(b"S" + struct.pack("!IB", 100, 1))) == []
    assert list(decoder.decode(relation_message((1, "id", 23, -1), (0, "v", 1700, -1), xid=100), 0x400)) == []
    assert list(decoder.decode(insert(b"1", b"1.5", xid=100), 0x410)) == []
    assert list(decoder.decode(insert(b"2", b"2.5", xid=101), 0x420)) == []  # in subtransaction 101
    assert list(decoder.decode(b"E")) == []
    assert list(decoder.decode(b"A" + struct.pack("!II", 100, 101))) == []  # ROLLBACK TO SAVEPOINT
    assert list(decoder.decode(b"S" + struct.pack("!IB", 200, 1))) == []
    assert list(decoder.decode(insert(b"9", b"not a number", xid=200))) == []  # never decoded: 200 aborts
    assert list(decoder.decode(b"E")) == []
    assert len(decoder.spilled) == 4 and decoder.spilled.held_bytes() > 0  # on disk, not decoded
    assert list(decoder.decode(b"A" + struct.pack("!II", 200, 200))) == []  # the whole transaction
    assert len(decoder.spilled) == 3
    replay = decoder.decode(b"c" + struct.pack("!IBQQq", 100, 0, 0x500, 0x600, 0))
    assert not isinstance(replay, list)  # an iterator: decoded as it is consumed
    messages = list(replay)
    start_2000 = 946684800000
    assert [(m.kind, m.xid, m.timestamp_ms, m.lsn) for m in messages] == [
        (Kind.BEGIN, 100, start_2000, 0x500), (Kind.INSERT, 100, start_2000, 0x410),
        (Kind.COMMIT, 100, start_2000, 0x500)]  # fmt: skip
    assert messages[2].next_lsn == 0x600
    assert [c.value for c in messages[1].columns] == [1, Decimal("1.5")]
    assert list(decoder.decode(b"c" + struct.pack("!IBQQq", 200, 0, 0x700, 0x800, 0)))[1:] == [  # nothing of 200
        ChangeMessage(Kind.COMMIT, 0x700, xid=200, timestamp_ms=946684800000, next_lsn=0x800)
    ]
    assert len(decoder.spilled) == 0 and decoder.spilled.replayed_transactions == 1
    # the Relation message streamed with xid 100 described the table only once 100 committed
    [after] = decoder.decode(insert(b"3", None), 0x900)
    assert [c.name for c in after.columns] == ["id", "v"]


def test_synthetic_streamed_relation_applies_at_commit_only(tmp_path: Path) -> None:
    """A Relation message inside a stream (the table altered by the streamed transaction) must not describe
    the rows of transactions that commit before it: pgoutput re-describes the table only after it commits."""
    decoder = PgOutputDecoder(proto_version=2, streaming=True, spill_dir=tmp_path)
    decoder.decode(KEY_AND_VALUE)
    decoder.decode(b"S" + struct.pack("!IB", 300, 1))
    wider = relation_message((1, "id", 23, -1), (0, "v", 1700, -1), (0, "w", 25, -1), xid=300)
    decoder.decode(wider)
    decoder.decode(insert(b"5", None, b"new", xid=300))
    decoder.decode(b"E")
    decoder.decode(b"B" + struct.pack("!QqI", 0x100, 0, 7))  # an ordinary transaction commits first
    [first] = decoder.decode(insert(b"4", b"4.5"))
    decoder.decode(b"C" + struct.pack("!BQQq", 0, 0x100, 0x110, 0))
    assert [c.name for c in first.columns] == ["id", "v"]  # the table as this transaction wrote it
    streamed = list(decoder.decode(b"c" + struct.pack("!IBQQq", 300, 0, 0x200, 0x210, 0)))
    assert [c.name for c in streamed[1].columns] == ["id", "v", "w"]


def message(prefix: str, *, xid: int, transactional: bool = True) -> bytes:
    """A streamed logical message (pgoutput 15 tags a transactional one with the top-level xid)."""
    return (b"M" + struct.pack("!I", xid) + struct.pack("!BQ", int(transactional), 0x300) + prefix.encode() + b"\0"
            + struct.pack("!I", 1) + b"x")  # fmt: skip


def stream(decoder: PgOutputDecoder, xid: int, *payloads: bytes) -> None:
    """One Stream Start … Stop block of ``xid`` holding ``payloads`` (decoded to nothing: spilled)."""
    assert list(decoder.decode(b"S" + struct.pack("!IB", xid, 1))) == []
    for i, payload in enumerate(payloads):
        assert list(decoder.decode(payload, 0x1000 + i)) == []
    assert list(decoder.decode(b"E")) == []


def test_synthetic_subtransaction_abort_discards_from_its_first_record_but_keeps_descriptions(tmp_path: Path) -> None:
    """As PostgreSQL's subscriber truncates its spool: everything after the subtransaction's first record is its
    own (messages tagged with the top-level xid included); the Relation message it carried stays (pgoutput
    describes a table once per streamed transaction: a later change relies on it)."""
    decoder = PgOutputDecoder(proto_version=2, streaming=True, spill_dir=tmp_path)
    mood = b"Y" + struct.pack("!II", 100, 16400) + b"public\0mood\0"  # a record of the parent: it was open there
    stream(decoder, 100, message("top", xid=100), mood)
    stream(decoder, 100, relation_message((1, "id", 23, -1), (0, "v", 1700, -1), xid=101),
           insert(b"2", None, xid=101), message("in-sub", xid=100), insert(b"3", None, xid=102))  # fmt: skip
    assert list(decoder.decode(b"A" + struct.pack("!II", 100, 102))) == []  # a child first, then its parent
    assert list(decoder.decode(b"A" + struct.pack("!II", 100, 101))) == []
    stream(decoder, 100, insert(b"4", b"4.5", xid=100), message("after", xid=100))
    messages = list(decoder.decode(b"c" + struct.pack("!IBQQq", 100, 0, 0x500, 0x600, 0)))
    kept = [(m.kind, m.prefix or (m.columns[0].value if m.columns else None)) for m in messages[1:-1]]
    assert kept == [(Kind.MESSAGE, "top"), (Kind.INSERT, 4), (Kind.MESSAGE, "after")]


@pytest.mark.parametrize(
    "payloads",
    [
        pytest.param([message("whose?", xid=100), insert(b"2", None, xid=101)], id="message-before-first-change"),
        pytest.param([insert(b"1", None, xid=100), message("whose?", xid=100)], id="message-only-subtransaction"),
    ],
)
def test_synthetic_unattributable_message_of_a_rolled_back_subtransaction_is_refused(
    payloads: list[bytes], tmp_path: Path
) -> None:
    """pgoutput 15 tags a transactional message with the top-level xid: one just before a rolled-back
    subtransaction's first change may be the parent's or the subtransaction's. The decoder says so at
    the commit (the connector then streams without ``streaming``) instead of guessing."""
    decoder = PgOutputDecoder(proto_version=2, streaming=True, spill_dir=tmp_path)
    decoder.decode(KEY_AND_VALUE)
    stream(decoder, 100, *payloads)
    assert list(decoder.decode(b"A" + struct.pack("!II", 100, 101))) == []
    with pytest.raises(StreamedAbortAmbiguous, match=r"subtransaction 101, and 1 transactional logical message"):
        decoder.decode(b"c" + struct.pack("!IBQQq", 100, 0, 0x500, 0x600, 0))  # refused before anything is given
    # a change of the parent between the message and the subtransaction settles it: the parent's
    clear = PgOutputDecoder(proto_version=2, streaming=True, spill_dir=tmp_path)
    clear.decode(KEY_AND_VALUE)
    stream(clear, 100, message("parent's", xid=100), insert(b"1", None, xid=100), insert(b"2", None, xid=101))
    assert list(clear.decode(b"A" + struct.pack("!II", 100, 101))) == []
    replayed = list(clear.decode(b"c" + struct.pack("!IBQQq", 100, 0, 0x500, 0x600, 0)))
    assert [m.kind for m in replayed] == [Kind.BEGIN, Kind.MESSAGE, Kind.INSERT, Kind.COMMIT]


def _truncated_insert() -> bytes:
    return insert(b"1", b"12.5")[:-2]


@pytest.mark.parametrize(
    ("payloads", "message"),
    [
        ([b""], "at byte 0 of 0 (payload at LSN 0/2A): truncated: message type missing"),
        ([b"X\0\0"], "at byte 0 of 3 (payload at LSN 0/2A): unknown message type 'X' (0x58)"),
        ([b"P\0"], "two_phase is not supported"),
        (
            [insert(b"1", None)],
            "Insert message ('I') at byte 1 of 15 (payload at LSN 0/2A): relation OID 16385 was not",
        ),
        (
            [KEY_AND_VALUE, _truncated_insert()],
            "Insert message ('I') at byte 19 of 21 (payload at LSN 0/2A): truncated: column 'v' value of 4 bytes",
        ),
        (
            [KEY_AND_VALUE, insert(b"1")],
            "Insert message ('I') at byte 6 of 14 (payload at LSN 0/2A): tuple has 1 columns",
        ),
        ([KEY_AND_VALUE, insert(b"1", None) + b"!"], "at byte 15 of 16 (payload at LSN 0/2A): 1 bytes left over"),
        ([KEY_AND_VALUE, insert(b"1", "b\0\0\0\1x")], "column 'v': binary mode not supported"),
        ([KEY_AND_VALUE, insert(b"1", "?")], "column 'v': unknown tuple column kind '?'"),
        ([KEY_AND_VALUE, insert(b"x", None)], "column public.t.id (integer): invalid literal"),
        ([KEY_AND_VALUE, insert(b"\xff", None)], "column 'id' is not UTF-8"),
        (
            [KEY_AND_VALUE, b"D" + struct.pack("!I", _RELATION_OID) + b"N" + tuple_data(b"1", None)],
            "expected tuple marker 'K' or 'O'",
        ),
        ([b"B" + b"\0" * 19], "Begin message ('B') at byte 1 of 20 (payload at LSN 0/2A): truncated: final LSN"),
        ([b"M\1" + b"\0" * 8 + b"p\0" + b"\0\0\0\5ab"], "truncated: content of 5 bytes"),
        ([b"R" + struct.pack("!I", 1) + b"public"], "truncated: namespace has no terminating NUL"),
        ([b"E"], "Stream Stop without Stream Start"),
    ],
)
def test_malformed_payloads_raise_decode_error(payloads: list[bytes], message: str) -> None:
    decoder = PgOutputDecoder()
    *setup, bad = payloads
    for payload in setup:
        decoder.decode(payload, 0x2A)
    with pytest.raises(DecodeError, match=re.escape(message)) as raised:
        decoder.decode(bad, 0x2A)
    assert "pgoutput" in str(raised.value) and "payload " in str(raised.value)


def test_error_excerpt_is_short() -> None:
    payload = b"Z" + b"x" * 10_000
    with pytest.raises(DecodeError) as raised:
        PgOutputDecoder().decode(payload)
    assert len(str(raised.value)) < 300 and "…" in str(raised.value)
