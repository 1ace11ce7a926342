"""A seeded random SQL workload for the capture acceptance tests (materialization, crash).

Three captured tables, between them every value shape the connector must carry exactly::

  wl_items   id bigint PK; int, bigint, numeric(20,6), unconstrained numeric (40+ digits),
             double precision, text, char(4), text[], int[] (NULL elements, 2-D), jsonb
             (nested, integers beyond 64 bits, exact fractions), timestamptz, timestamp,
             date, uuid, bytea, boolean, interval, an enum, an enum array, a domain, and
             ``doc`` text STORAGE EXTERNAL (values of 2.5-9 KB are TOASTed out of line,
             so UPDATEs that leave it alone make wal2json omit it)
  wl_pairs   (tenant text, seq bigint) composite PK; numeric, jsonb STORAGE EXTERNAL
             (sometimes big: unchanged TOAST again), int[], timestamptz, interval, enum
  wl_events  id uuid PK; text, bytea, numeric, boolean, date, jsonb
  "wl Odd Näme"  id bigint PK; text, integer — a name outside [A-Za-z0-9._-]: its topic is
             cdc.public.wl_Odd_N_me (capture.topics maps it)
  wl_audit   no key and no replica identity (a keyless table): inserts only, captured with
             null keys onto a delete-policy topic (``KEYLESS``; not in TABLES: compared as a
             multiset of rows: tests/capture/test_materialize.py)

Transactions (1 to a few hundred statements; ~8 % rolled back, some with a savepoint
rolled back inside a committed transaction): single and multi-row INSERTs, UPDATEs of
non-key columns (set values, or expressions like ``n = n + 0.000001``, ``j = j || …``),
multi-row UPDATEs, primary-key UPDATEs (to fresh keys and to keys deleted before),
single and multi-row DELETEs, occasional TRUNCATE (of one or two tables) and, when asked,
logical messages (transactional and not).

Deliberately left out (documented limitations of wal2json, capture/pgtypes.py notes
[1] and [8]): numeric/float NaN and ±Infinity, whose stream value is null, and float -0.

The generator keeps a model of which keys exist (with an undo journal for rollbacks) so
that every statement succeeds; the tests never trust the model for expected values: they
read the tables back with SELECT.

Sizes scale with ``TIDELINE_SOAK=1`` (see :func:`soak`).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import psycopg

ODD = "wl Odd Näme"
TABLES = ("wl_items", "wl_pairs", "wl_events", ODD)
KEYLESS = "wl_audit"
TENANTS = ("acme", "o'brien", "ünïcødé", "a,b {c}", '"quoted"', "", "NULL", "x\\y")
MOODS = ("sad", "ok", "happy", "so so", 'it\'s "fine"')

SCHEMA = [
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy', 'so so', 'it''s \"fine\"')",
    "CREATE DOMAIN posint AS integer CHECK (VALUE > 0)",
    """CREATE TABLE wl_items (
        id bigint PRIMARY KEY,
        i integer, b bigint, n numeric(20,6), nu numeric, f double precision,
        t text, code char(4), ta text[], ia integer[], j jsonb,
        tstz timestamptz, ts timestamp, d date, u uuid, by bytea, bo boolean,
        iv interval, e mood, es mood[], p posint, doc text)""",
    "ALTER TABLE wl_items ALTER COLUMN doc SET STORAGE EXTERNAL",
    """CREATE TABLE wl_pairs (
        tenant text, seq bigint, amount numeric, meta jsonb, ia integer[], at timestamptz,
        iv interval, e mood, note text,
        PRIMARY KEY (tenant, seq))""",
    "ALTER TABLE wl_pairs ALTER COLUMN meta SET STORAGE EXTERNAL",
    """CREATE TABLE wl_events (
        id uuid PRIMARY KEY, kind text, payload bytea, amount numeric(30,10), ok boolean,
        day date, attrs jsonb)""",
    f'CREATE TABLE "{ODD}" (id bigint PRIMARY KEY, label text, n integer)',
    f"CREATE TABLE {KEYLESS} (at timestamptz NOT NULL DEFAULT now(), actor text, amount numeric, detail jsonb)",
]


def q(table: str) -> str:
    """A table name as SQL (quoted: one of them needs it)."""
    return '"' + table.replace('"', '""') + '"'


def soak() -> bool:
    return os.environ.get("TIDELINE_SOAK") == "1"


# ---------------------------------------------------------------------------- keys


class KeyPool:
    """The keys of one table: O(1) add, remove, random choice, and an undo journal."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._index: dict[Any, int] = {}
        self.dead: list[Any] = []  # keys deleted at some point (reused to exercise key reuse)
        self.journal: list[tuple[str, Any]] = []

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Any) -> bool:
        return key in self._index

    def add(self, key: Any) -> None:
        assert key not in self._index, key
        self._index[key] = len(self._items)
        self._items.append(key)
        self.journal.append(("add", key))

    def remove(self, key: Any) -> None:
        i = self._index.pop(key)
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._index[last] = i
        self.dead.append(key)
        self.journal.append(("remove", key))

    def clear(self) -> None:
        for key in list(self._items):
            self.remove(key)

    def choice(self, rng: random.Random) -> Any:
        return self._items[rng.randrange(len(self._items))]

    def sample(self, rng: random.Random, k: int) -> list[Any]:
        return rng.sample(self._items, min(k, len(self._items)))

    def mark(self) -> int:
        return len(self.journal)

    def undo_to(self, mark: int) -> None:
        while len(self.journal) > mark:
            op, key = self.journal.pop()
            if op == "add":
                i = self._index.pop(key)
                last = self._items.pop()
                if i < len(self._items):
                    self._items[i] = last
                    self._index[last] = i
            else:
                self._index[key] = len(self._items)
                self._items.append(key)
        # journal entries before the mark are kept: an outer rollback may still need them

    def forget_journal(self) -> None:
        self.journal.clear()


# ---------------------------------------------------------------------------- values


_WORDS = ["alpha", "beta", "gamma", "NULL", "null", "", " ", "a,b", "{x}", '"q"', "back\\slash", "o'neil",
          "tab\there", "new\nline", "été", "日本語", "🦊", "ç,{\"}\\", "  padded  ", "\\x41"]  # fmt: skip
_DOC_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?-_'\"{}[]\\é日"


class Values:
    """Random values per SQL type, as SQL parameters (cast in the statement text)."""

    def __init__(
        self, rng: random.Random, *, big_values: bool, toast_json_numbers: bool = True, huge_json_numbers: bool = True
    ) -> None:
        self.rng = rng
        self.big_values = big_values
        self.toast_json_numbers = toast_json_numbers  # fractions and > 64-bit integers inside TOASTed jsonb
        self.huge_json_numbers = huge_json_numbers  # 1e400 (jsonb prints 401 digits) in any jsonb

    def maybe_null(self, p: float = 0.08) -> bool:
        return self.rng.random() < p

    def text(self) -> str:
        r = self.rng
        return "".join(r.choice(_WORDS) + r.choice(["", " ", ",", "-"]) for _ in range(r.randint(0, 4)))

    def doc(self) -> str | None:
        r = self.rng
        if self.maybe_null(0.1):
            return None
        if self.big_values and r.random() < 0.5:
            n = r.randint(2_500, 9_000)  # TOASTed out of line (STORAGE EXTERNAL)
            return r.choice(_WORDS) + r.randbytes(n // 2).hex() + "".join(r.choices(_DOC_ALPHABET, k=40))
        return self.text()

    def int4(self) -> int:
        return self.rng.choice([0, 1, -1, 2**31 - 1, -(2**31), self.rng.randint(-1000, 1000)])

    def int8(self) -> int:
        return self.rng.choice([2**63 - 1, -(2**63), self.rng.randint(-(2**62), 2**62), 0])

    def numeric_20_6(self) -> str:
        r = self.rng
        whole = r.randint(0, 10**14 - 1)
        frac = r.randint(0, 10**7 - 1)  # 7 digits: the 7th rounds away
        return f"{r.choice(['', '-'])}{whole}.{frac:07d}"

    def numeric_any(self) -> str:
        r = self.rng
        kind = r.random()
        if kind < 0.2:
            return f"{r.choice(['', '-'])}{r.randint(0, 10**45)}"  # a 45-digit integer
        if kind < 0.4:
            return f"0.{'0' * r.randint(0, 30)}{r.randint(1, 10**12)}"  # tiny
        if kind < 0.5:
            return r.choice(["0", "-0.000", "1.10", "100.00000000000000000000"])  # scales kept
        return f"{r.choice(['', '-'])}{r.randint(0, 10**40)}.{r.randint(0, 10**30):030d}"

    def float8(self) -> float:
        r = self.rng
        v = r.choice([0.1, 1e308, 2.2250738585072014e-308, 5e-324, 1 / 3, -123.456, r.uniform(-1e6, 1e6)])
        return v if v != 0 else 1.5

    def text_array(self) -> list[str | None]:
        return [None if self.maybe_null(0.15) else self.text() for _ in range(self.rng.randint(0, 5))]

    def int_array(self) -> list[Any]:
        r = self.rng
        if r.random() < 0.2:  # 2-D, rectangular
            cols = r.randint(1, 3)
            return [[None if self.maybe_null(0.2) else r.randint(-(2**31), 2**31 - 1) for _ in range(cols)]
                    for _ in range(r.randint(1, 3))]  # fmt: skip
        return [None if self.maybe_null(0.2) else r.randint(-(2**31), 2**31 - 1) for _ in range(r.randint(0, 6))]

    def json_value(self, depth: int = 0) -> str:
        """JSON text (numbers written as we like: big integers, exact fractions)."""
        r = self.rng
        kind = r.randint(0, 9 if depth < 3 else 5)
        if kind == 0:
            return r.choice(["null", "true", "false"])
        if kind == 1:
            return str(r.choice([0, -1, 2**53 + 1, 2**64 + 7, -(2**70), 10**30, r.randint(-1000, 1000)]))
        if kind == 2:
            huge = ["1e400", "-123456789012345678901234567890e300"] if self.huge_json_numbers else []
            return r.choice(["1.10", "-0.5", "3.14159265358979323846264338327950288", "1e-7", "2.50E+3", *huge])
        if kind in (3, 4, 5):
            return json.dumps(self.text(), ensure_ascii=r.random() < 0.5)
        if kind in (6, 7):
            return "[" + ",".join(self.json_value(depth + 1) for _ in range(r.randint(0, 4))) + "]"
        items = [(json.dumps(r.choice(["a", "b", "key", "ü", "", "NULL", "a b"]) + str(r.randint(0, 3))),
                  self.json_value(depth + 1)) for _ in range(r.randint(0, 4))]  # fmt: skip
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"

    def jsonb(self, *, big: bool = False) -> str | None:
        if self.maybe_null():
            return None
        if big and self.big_values and self.rng.random() < 0.4:
            value = self.json_value if self.toast_json_numbers else lambda _depth: json.dumps(self.text())
            rows = [f'{{"n":{i},"s":"{self.rng.randbytes(60).hex()}","v":{value(2)}}}'
                    for i in range(self.rng.randint(20, 60))]  # fmt: skip
            return "[" + ",".join(rows) + "]"  # several KB: TOASTed (STORAGE EXTERNAL)
        return self.json_value()

    def timestamptz(self) -> str:
        r = self.rng
        if r.random() < 0.03:
            return r.choice(["infinity", "-infinity"])
        offset = r.choice(["+00", "+05:30", "-08", "+14", "-03:30", "+01:00:00"])
        return f"{self.timestamp()}{offset}"

    def timestamp(self) -> str:
        r = self.rng
        return (
            f"{r.randint(1900, 2099):04d}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d} "
            f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}"
            + r.choice(["", f".{r.randint(0, 999_999):06d}", ".5", ".000001"])
        )

    def date(self) -> str:
        r = self.rng
        if r.random() < 0.03:
            return r.choice(["infinity", "-infinity", "0044-03-15 BC"])
        return f"{r.randint(1, 9999):04d}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"

    def uuid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128)))

    def bytea(self) -> bytes:
        r = self.rng
        return r.randbytes(r.randint(0, 40))

    def interval(self) -> str:
        r = self.rng
        parts = []
        if r.random() < 0.5:
            parts.append(f"{r.randint(-20, 20)} years {r.randint(-11, 11)} mons")
        if r.random() < 0.6:
            parts.append(f"{r.randint(-400, 400)} days")
        if r.random() < 0.7 or not parts:
            sign = r.choice(["", "-"])
            parts.append(
                f"{sign}{r.randint(0, 99)}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}.{r.randint(0, 999999)}"
            )
        return " ".join(parts)

    def mood(self) -> str:
        return self.rng.choice(MOODS)

    def moods(self) -> list[str | None]:
        return [None if self.maybe_null(0.2) else self.mood() for _ in range(self.rng.randint(0, 3))]


# ---------------------------------------------------------------------------- statements


@dataclass(frozen=True, slots=True)
class ColumnSpec:
    name: str
    cast: str
    gen: Callable[[], Any]


@dataclass(slots=True)
class WorkloadStats:
    committed: int = 0
    rolled_back: int = 0
    savepoint_rollbacks: int = 0
    statements: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.statements.items()))
        return (
            f"{self.committed} committed / {self.rolled_back} rolled-back transactions "
            f"({self.savepoint_rollbacks} savepoint rollbacks), {self.seconds:.1f} s spent in them; statements: {kinds}"
        )


class Workload:
    """Creates the tables and runs random transactions against ``dsn`` (one connection, not thread-safe)."""

    def __init__(
        self,
        dsn: str,
        seed: int,
        *,
        big_values: bool = True,
        toast_json_numbers: bool = True,
        huge_json_numbers: bool = True,
        messages: bool = False,
    ) -> None:
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.v = Values(
            self.rng, big_values=big_values, toast_json_numbers=toast_json_numbers, huge_json_numbers=huge_json_numbers
        )
        self.messages = messages
        self.keys = {t: KeyPool() for t in TABLES}
        self.next_id = 1
        self.stats = WorkloadStats()
        v = self.v
        self.columns: dict[str, list[ColumnSpec]] = {
            "wl_items": [
                ColumnSpec("i", "integer", v.int4),
                ColumnSpec("b", "bigint", v.int8),
                ColumnSpec("n", "numeric", v.numeric_20_6),
                ColumnSpec("nu", "numeric", v.numeric_any),
                ColumnSpec("f", "double precision", v.float8),
                ColumnSpec("t", "text", v.text),
                ColumnSpec("code", "text", lambda: v.text()[:4]),
                ColumnSpec("ta", "text[]", v.text_array),
                ColumnSpec("ia", "integer[]", v.int_array),
                ColumnSpec("j", "jsonb", v.jsonb),
                ColumnSpec("tstz", "timestamptz", v.timestamptz),
                ColumnSpec("ts", "timestamp", v.timestamp),
                ColumnSpec("d", "date", v.date),
                ColumnSpec("u", "uuid", v.uuid),
                ColumnSpec("by", "bytea", v.bytea),
                ColumnSpec("bo", "boolean", lambda: self.rng.random() < 0.5),
                ColumnSpec("iv", "interval", v.interval),
                ColumnSpec("e", "mood", v.mood),
                ColumnSpec("es", "mood[]", v.moods),
                ColumnSpec("p", "posint", lambda: self.rng.randint(1, 10**6)),
                ColumnSpec("doc", "text", v.doc),
            ],
            "wl_pairs": [
                ColumnSpec("amount", "numeric", v.numeric_any),
                ColumnSpec("meta", "jsonb", lambda: v.jsonb(big=True)),
                ColumnSpec("ia", "integer[]", v.int_array),
                ColumnSpec("at", "timestamptz", v.timestamptz),
                ColumnSpec("iv", "interval", v.interval),
                ColumnSpec("e", "mood", v.mood),
                ColumnSpec("note", "text", v.text),
            ],
            "wl_events": [
                ColumnSpec("kind", "text", v.text),
                ColumnSpec("payload", "bytea", v.bytea),
                ColumnSpec("amount", "numeric", v.numeric_20_6),
                ColumnSpec("ok", "boolean", lambda: self.rng.random() < 0.5),
                ColumnSpec("day", "date", v.date),
                ColumnSpec("attrs", "jsonb", v.jsonb),
            ],
            ODD: [
                ColumnSpec("label", "text", v.text),
                ColumnSpec("n", "integer", v.int4),
            ],
        }
        self.key_columns = {"wl_items": ("id",), "wl_pairs": ("tenant", "seq"), "wl_events": ("id",), ODD: ("id",)}
        self.key_casts = {"wl_items": ("bigint",), "wl_pairs": ("text", "bigint"), "wl_events": ("uuid",),
                          ODD: ("bigint",)}  # fmt: skip

    # ------------------------------------------------------------------ setup

    def create_schema(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            for statement in SCHEMA:
                c.execute(statement.encode())

    def populate(self, rows_per_table: int) -> None:
        """Initial rows (before any capture: what a snapshot reads), in transactions of 200."""
        with psycopg.connect(self.dsn) as c:
            for table in TABLES:
                for start in range(0, rows_per_table, 200):
                    for _ in range(min(200, rows_per_table - start)):
                        self._insert(c, table, 1)
                    c.commit()
            for _ in range(max(1, rows_per_table // 20)):
                self._audit(c)
            c.commit()
        for pool in self.keys.values():
            pool.forget_journal()

    # ------------------------------------------------------------------ keys and rows

    def _new_key(self, table: str) -> tuple[Any, ...]:
        pool = self.keys[table]
        r = self.rng
        if pool.dead and r.random() < 0.25:
            key = pool.dead[r.randrange(len(pool.dead))]
            if key not in pool:
                return key  # type: ignore[no-any-return]
        if table in ("wl_items", ODD):
            self.next_id += r.randint(1, 3)
            return (self.next_id,)
        if table == "wl_pairs":
            while True:
                key = (r.choice(TENANTS), r.randint(-(2**40), 2**40))
                if key not in pool:
                    return key
        return (self.v.uuid(),)

    def _where(self, table: str) -> str:
        return " AND ".join(
            f'"{k}" = %s::{c}' for k, c in zip(self.key_columns[table], self.key_casts[table], strict=True)
        )

    def _row_values(self, table: str, cols: list[ColumnSpec]) -> list[Any]:
        return [None if self.v.maybe_null() else c.gen() for c in cols]

    def _insert(self, c: psycopg.Connection[Any], table: str, rows: int) -> None:
        cols = self.columns[table]
        names = [*self.key_columns[table], *(col.name for col in cols)]
        casts = [*self.key_casts[table], *(col.cast for col in cols)]
        one = "(" + ", ".join(f"%s::{cast}" for cast in casts) + ")"
        params: list[Any] = []
        for _ in range(rows):
            key = self._new_key(table)
            self.keys[table].add(key)
            params += [*key, *self._row_values(table, cols)]
        column_list = ", ".join(f'"{n}"' for n in names)
        c.execute(f"INSERT INTO {q(table)} ({column_list}) VALUES {', '.join([one] * rows)}".encode(), params)
        self.stats.statements["insert" if rows == 1 else "insert multi-row"] += 1

    # ------------------------------------------------------------------ statements

    def _update_values(self, c: psycopg.Connection[Any], table: str) -> None:
        key = self.keys[table].choice(self.rng)
        cols = self.rng.sample(self.columns[table], min(len(self.columns[table]), self.rng.randint(1, 3)))
        if self.rng.random() < 0.8:  # leave the big (TOASTed) columns alone, mostly
            cols = [col for col in cols if col.name not in ("doc", "meta")] or cols
        sets = ", ".join(f'"{col.name}" = %s::{col.cast}' for col in cols)
        c.execute(
            f"UPDATE {q(table)} SET {sets} WHERE {self._where(table)}".encode(), [*self._row_values(table, cols), *key]
        )
        self.stats.statements["update"] += 1

    _EXPRESSIONS: ClassVar[dict[str, list[str]]] = {
        "wl_items": [
            "n = n + 0.000001", "nu = nu * 3", "i = i / 2", "ta = array_append(ta, 'x,y')",
            "j = j || '{\"added\": [1.50, 18446744073709551617]}'", "bo = NOT bo", "iv = iv + interval '1 mon 1 us'",
            "tstz = tstz + interval '1 day'", "e = 'ok'",
            "ia = CASE WHEN array_ndims(ia) = 1 THEN ia || ARRAY[NULL::int] ELSE ia END",
        ],
        "wl_pairs": ["amount = amount + 1", "meta = meta || '[\"tail\"]'", "note = note || '!'"],
        "wl_events": ["ok = NOT ok", "amount = -amount", "attrs = attrs || '{\"z\": null}'"],
        ODD: ["n = n / 2", "label = label || ' ünï'"],
    }  # fmt: skip

    def _update_expression(self, c: psycopg.Connection[Any], table: str) -> None:
        pool = self.keys[table]
        expression = self.rng.choice(self._EXPRESSIONS[table])
        if self.rng.random() < 0.3 and table == "wl_items":  # a multi-row statement (rows share one LSN)
            ids = [k[0] for k in pool.sample(self.rng, self.rng.randint(2, 20))]
            c.execute(f"UPDATE wl_items SET {expression} WHERE id = ANY(%s::bigint[])".encode(), [ids])
            self.stats.statements["update multi-row"] += 1
            return
        key = list(pool.choice(self.rng))
        c.execute(f"UPDATE {q(table)} SET {expression} WHERE {self._where(table)}".encode(), key)
        self.stats.statements["update expression"] += 1

    def _update_key(self, c: psycopg.Connection[Any], table: str) -> None:
        pool = self.keys[table]
        old = pool.choice(self.rng)
        new = self._new_key(table)
        sets = ", ".join(
            f'"{k}" = %s::{cast}' for k, cast in zip(self.key_columns[table], self.key_casts[table], strict=True)
        )
        extra = ""
        if table == "wl_items" and self.rng.random() < 0.5:
            extra = ", i = i / 2"  # key and a value at once
        c.execute(f"UPDATE {q(table)} SET {sets}{extra} WHERE {self._where(table)}".encode(), [*new, *old])
        pool.remove(old)
        pool.add(new)
        self.stats.statements["update key"] += 1

    def _delete(self, c: psycopg.Connection[Any], table: str) -> None:
        pool = self.keys[table]
        if table == "wl_items" and self.rng.random() < 0.3:
            keys = pool.sample(self.rng, self.rng.randint(2, 10))
            c.execute(b"DELETE FROM wl_items WHERE id = ANY(%s::bigint[])", [[k[0] for k in keys]])
            for k in keys:
                pool.remove(k)
            self.stats.statements["delete multi-row"] += 1
            return
        key = pool.choice(self.rng)
        c.execute(f"DELETE FROM {q(table)} WHERE {self._where(table)}".encode(), list(key))
        pool.remove(key)
        self.stats.statements["delete"] += 1

    def _truncate(self, c: psycopg.Connection[Any]) -> None:
        tables = self.rng.sample(TABLES, self.rng.choice([1, 1, 2]))
        c.execute(f"TRUNCATE {', '.join(q(t) for t in tables)}".encode())
        for t in tables:
            self.keys[t].clear()
        self.stats.statements["truncate"] += 1

    def _message(self, c: psycopg.Connection[Any]) -> None:
        transactional = self.rng.random() < 0.7
        content = self.v.text().encode() + bytes([self.rng.randrange(1, 256)])
        c.execute(b"SELECT pg_logical_emit_message(%s, 'wl', %s::bytea)", [transactional, content])
        self.stats.statements["message" if transactional else "message non-transactional"] += 1

    def _audit(self, c: psycopg.Connection[Any]) -> None:
        """An insert into the keyless table (its updates and deletes are not decoded by the server: none are made)."""
        rows = self.rng.randint(1, 3)
        params: list[Any] = []
        for _ in range(rows):
            params += [self.v.text(), self.v.numeric_any(), self.v.jsonb()]
        values = ", ".join(["(%s, %s::numeric, %s::jsonb)"] * rows)
        c.execute(f"INSERT INTO {KEYLESS} (actor, amount, detail) VALUES {values}".encode(), params)
        self.stats.statements["insert keyless"] += 1

    def statement(self, c: psycopg.Connection[Any], *, truncate_p: float) -> None:
        r = self.rng
        table = r.choices(TABLES, weights=(5, 3, 2, 1))[0]
        if r.random() < 0.04:
            self._audit(c)
            return
        if r.random() < truncate_p:
            self._truncate(c)
            return
        if self.messages and r.random() < 0.03:
            self._message(c)
            return
        size = len(self.keys[table])
        roll = r.random()
        if size < 20 or roll < 0.3:
            self._insert(c, table, 1 if r.random() < 0.8 else r.randint(2, 8))
        elif roll < 0.55:
            self._update_values(c, table)
        elif roll < 0.7:
            self._update_expression(c, table)
        elif roll < 0.8:
            self._update_key(c, table)
        else:
            self._delete(c, table)

    def transaction_size(self) -> int:
        r = self.rng.random()
        if r < 0.6:
            return self.rng.randint(1, 5)
        if r < 0.92:
            return self.rng.randint(5, 50)
        return self.rng.randint(50, 300)

    # ------------------------------------------------------------------ driving

    def transactions(
        self, count: int | None = None, *, stop: threading.Event | None = None, truncate_p: float = 0.001,
        pause_s: float = 0.0,
    ) -> Iterator[int]:  # fmt: skip
        """Run ``count`` transactions (or until ``stop`` is set); yields after each one."""
        done = 0
        with psycopg.connect(self.dsn) as c:
            while (count is None or done < count) and not (stop is not None and stop.is_set()):
                started = time.monotonic()
                marks = {t: p.mark() for t, p in self.keys.items()}
                size = self.transaction_size()
                savepoint_at = self.rng.randrange(size) if size > 3 and self.rng.random() < 0.1 else -1
                inner: dict[str, int] | None = None
                for i in range(size):
                    if i == savepoint_at:
                        c.execute(b"SAVEPOINT sp")
                        inner = {t: p.mark() for t, p in self.keys.items()}
                    self.statement(c, truncate_p=truncate_p)
                    if inner is not None and i == savepoint_at + 2:
                        c.execute(b"ROLLBACK TO SAVEPOINT sp")
                        for t, p in self.keys.items():
                            p.undo_to(inner[t])
                        inner = None
                        self.stats.savepoint_rollbacks += 1
                if self.rng.random() < 0.08:
                    c.rollback()
                    for t, p in self.keys.items():
                        p.undo_to(marks[t])
                    self.stats.rolled_back += 1
                else:
                    c.commit()
                    self.stats.committed += 1
                for p in self.keys.values():
                    p.forget_journal()
                done += 1
                self.stats.seconds += time.monotonic() - started  # time in transactions (pauses excluded)
                if pause_s:
                    time.sleep(self.rng.uniform(0, pause_s))
                yield done

    def run(self, count: int, **kw: Any) -> WorkloadStats:
        for _ in self.transactions(count, **kw):
            pass
        return self.stats


def run_in_thread(workload: Workload, stop: threading.Event, **kw: Any) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``workload.transactions(stop=stop)`` in a daemon thread; errors land in the returned list."""
    errors: list[BaseException] = []

    def go() -> None:
        try:
            for _ in workload.transactions(stop=stop, **kw):
                pass
        except BaseException as e:  # reported by the test
            errors.append(e)

    thread = threading.Thread(target=go, name="workload", daemon=True)
    thread.start()
    return thread, errors
