"""Row images follow the schema at the change's position (issue 32, item 1), against the real Postgres.

An AFTER ROW trigger on the captured table is the oracle: for every row change it writes
``to_jsonb(NEW)``/``to_jsonb(OLD)`` and the table's columns and types at that moment
(``pg_attribute`` as the changing transaction sees it) into ``oracle.audit``, a table the
connector does not capture. A table-driven workload per DDL kind — ADD COLUMN with and
without DEFAULT, DROP COLUMN (of a TOASTed column), DROP and ADD again of the same name,
RENAME COLUMN (of a TOASTed column), ALTER COLUMN TYPE, SET/DROP NOT NULL, DDL and DML in one
transaction, each also under REPLICA IDENTITY FULL where it matters — runs between DML that
leaves a TOASTed value unchanged (the plugin omits it, capture fills it), and is captured

* ``continuous``: one connector streams while the DDL happens (its catalog is behind);
* ``ahead``: the connector takes its snapshot, stops, and starts again only after all the DDL
  (its catalog is ahead of every change it streams);
* ``rebuilt``: as ``ahead``, its key state deleted before the second start (what a kill -9 between the
  log's commit and the key state's leaves to catch up, at worst): rebuilt from the log.

Every change event (in commit order: ``source.commit_lsn``, ``source.event_index``) is compared
with the audit row at the same position: ``after`` must hold exactly the columns of
``to_jsonb(NEW)`` (no phantom, none missing), each with its value then (numeric as its digits,
as capture writes it), and the unchanged-TOAST placeholder only where the value was truly
unknown — here never: every big value was captured before it was left unchanged. ``before``:
the old row under REPLICA IDENTITY FULL, the old key otherwise.
JSON values; both plugins (the ``plugin`` fixture); the Python path alone (``--core python``) and with the
native core (every column of ``t`` is of a type it converts; each run it handles is checked against the
Python path, tests/conftest.py). Avro values (capture.avro): the same workloads, each event decoded with the
schema id it names and rendered by that schema's column types, so a field of a column added later, or a
value under a type it did not have then, is a difference.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from capture_util import ConnectorThread, capture, drop_slots, events, fresh_database, sql, stored_position
from readiness import patience, wait_until
from typer.testing import CliRunner

from capture.config import CoreChoice, ValueFormat
from capture.connector import CaptureConfig, Connector
from capture.events import UNAVAILABLE
from capture.messages import Plugin
from capture.native import extension
from capture.tables import TableFilter
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.schema_store import FramedDecoder, LogSchemaStore
from schemas.position import parse_lsn
from schemas.registry import CompatibilityLevel, SchemaRegistry
from tideline.backend import choose
from tideline.cli import app as cli_app
from tideline.pgharness import LocalPostgres

TOPIC = "cdc.public.t"
CAPTURED = TableFilter(include=["public.*"])

ORACLE = (
    "CREATE SCHEMA oracle",
    "CREATE TABLE oracle.audit (seq bigserial PRIMARY KEY, tbl text NOT NULL, op text NOT NULL, new jsonb, old jsonb, "
    "types jsonb NOT NULL)",
    """CREATE FUNCTION oracle.record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO oracle.audit (tbl, op, new, old, types) VALUES (
    TG_TABLE_NAME, TG_OP,
    CASE WHEN TG_OP <> 'DELETE' THEN to_jsonb(NEW) END,
    CASE WHEN TG_OP <> 'INSERT' THEN to_jsonb(OLD) END,
    (SELECT jsonb_object_agg(attname, format_type(atttypid, atttypmod)) FROM pg_attribute
     WHERE attrelid = TG_RELID AND attnum > 0 AND NOT attisdropped));
  RETURN NULL;
END $$""",
    # ≈ 6 KB of hex that compresses to about half: stored out of line (TOASTed), so an UPDATE that does not set
    # it leaves it unchanged (wal2json omits the column, pgoutput marks it 'u')
    "CREATE TABLE oracle.snapshot_taken (last_value bigint NOT NULL)",
    "CREATE FUNCTION big(seed text) RETURNS text IMMUTABLE LANGUAGE sql AS "
    "$$ SELECT string_agg(md5(seed || g), '') FROM generate_series(1, 200) g $$",
)

TABLE = (
    "CREATE TABLE t (id int PRIMARY KEY, n int, big text, tags jsonb, small text)",
    "CREATE TRIGGER audit AFTER INSERT OR UPDATE OR DELETE ON t FOR EACH ROW EXECUTE FUNCTION oracle.record()",
    """INSERT INTO t VALUES (1, 0, big('a'), '["a"]', 's1'), (2, 0, big('b'), '{"b": 2.50}', 's2'),
                          (3, 0, NULL, NULL, 's3')""",
)

Step = tuple[str, ...]  # the statements of one transaction

# Before the DDL: an UPDATE leaving row 1's TOASTed value unchanged, a new big row, an UPDATE of it leaving it
# unchanged too.
BEFORE: list[Step] = [
    ("UPDATE t SET n = n + 1 WHERE id = 1",),
    ("INSERT INTO t (id, n, big, small) VALUES (10, 1, big('c'), 'p')",),
    ("UPDATE t SET n = n + 1 WHERE id = 10",),
]
# After it: the same rows left unchanged again, a new row, a delete (these statements hold whatever the DDL did).
AFTER: list[Step] = [
    ("UPDATE t SET n = n + 1 WHERE id = 1",),
    ("UPDATE t SET n = n + 1 WHERE id = 10",),
    ("INSERT INTO t (id, n, small) VALUES (20, 5, 'z')",),
    ("UPDATE t SET n = n + 1 WHERE id = 1",),
    ("DELETE FROM t WHERE id = 3",),
]


@dataclass(frozen=True)
class Case:
    name: str
    steps: list[Step]  # between BEFORE and AFTER; a step with a DDL statement is the DDL
    full: bool = False  # REPLICA IDENTITY FULL
    setup: tuple[str, ...] = field(default=())


CASES = [
    Case("add_column", [("ALTER TABLE t ADD COLUMN note text",), ("UPDATE t SET note = big('n') WHERE id = 2",),
                        ("UPDATE t SET n = n + 1 WHERE id = 2",)]),
    Case("add_column_full", [("ALTER TABLE t ADD COLUMN note text",), ("UPDATE t SET note = 'x' WHERE id = 2",)],
         full=True),
    Case("add_column_default", [("ALTER TABLE t ADD COLUMN flag int DEFAULT 7",), ("UPDATE t SET n = 9 WHERE id = 2",),
                                ("ALTER TABLE t ADD COLUMN label text DEFAULT 'lbl'",),
                                ("UPDATE t SET flag = 8 WHERE id = 2",)]),
    Case("drop_column", [("ALTER TABLE t DROP COLUMN big",), ("UPDATE t SET n = n + 1 WHERE id = 2",)]),
    Case("drop_column_full", [("ALTER TABLE t DROP COLUMN big",), ("UPDATE t SET n = n + 1 WHERE id = 2",)],
         full=True),
    Case("drop_and_add_again", [("ALTER TABLE t DROP COLUMN big",), ("ALTER TABLE t ADD COLUMN big text",),
                                ("UPDATE t SET n = n + 1 WHERE id = 2",)]),
    Case("rename_column", [("ALTER TABLE t RENAME COLUMN big TO body",), ("UPDATE t SET n = n + 1 WHERE id = 2",)]),
    Case("rename_column_full", [("ALTER TABLE t RENAME COLUMN big TO body",),
                                ("UPDATE t SET n = n + 1 WHERE id = 2",)], full=True),
    Case("alter_type", [("ALTER TABLE t ALTER COLUMN n TYPE numeric(10,2)",), ("UPDATE t SET n = 2.5 WHERE id = 2",)]),
    Case("not_null", [("ALTER TABLE t ALTER COLUMN small SET NOT NULL",), ("UPDATE t SET n = n + 1 WHERE id = 2",),
                      ("ALTER TABLE t ALTER COLUMN small DROP NOT NULL",),
                      ("UPDATE t SET small = NULL WHERE id = 2",)]),
    Case("ddl_and_dml_in_one_transaction", [(
        "UPDATE t SET n = n + 1 WHERE id = 1",
        "ALTER TABLE t ADD COLUMN extra text",
        "UPDATE t SET n = n + 1, extra = 'e' WHERE id = 2",
        "UPDATE t SET n = n + 1 WHERE id = 1",
        "ALTER TABLE t DROP COLUMN tags",
        "UPDATE t SET n = n + 1 WHERE id = 10",
    )]),
]
MODES = ["continuous", "ahead", "rebuilt"]


@pytest.fixture
def db(postgres: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    dsn = fresh_database(postgres, "schema_evo")
    sql(dsn, *ORACLE)
    yield dsn
    drop_slots(dsn)


def run(dsn: str, steps: list[Step]) -> None:
    with psycopg.connect(dsn) as c:
        for step in steps:
            for statement in step:
                c.execute(statement.encode())
            c.commit()


def wal_end(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        return parse_lsn(row[0])


class Streaming(ConnectorThread):
    """A connector streaming in a thread while the workload runs (its catalog read before the DDL)."""

    def __init__(self, log_dir: Path, dsn: str, plugin: Plugin, core: CoreChoice,
                 value_format: ValueFormat = ValueFormat.JSON) -> None:  # fmt: skip
        super().__init__(log_dir, CaptureConfig(dsn=dsn, slot="t", topic_prefix="cdc", table_filter=CAPTURED,
                                                plugin=plugin, core=core, value_format=value_format))  # fmt: skip

    def wait(self, target: int, timeout: float = 60) -> None:
        """Until the connector has stored the WAL up to ``target`` (it stores an idle position too)."""
        timeout = patience(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert not self.errors, self.errors
            position = self.connector.read_position()
            if position is not None and position.confirm_lsn >= target:
                return
            time.sleep(0.05)
        raise AssertionError(f"the connector did not store the WAL up to {target:X} in {timeout} s")


def drop_key_state(log_dir: Path, dsn: str) -> None:
    """Delete the connector's key state (the next start rebuilds it from the log)."""
    with Log(log_dir) as log:
        path = Connector(CaptureConfig(dsn=dsn, slot="t", topic_prefix="cdc"), log).state_path()
    files = [Path(f"{path}{suffix}") for suffix in ("", "-wal", "-shm")]
    assert files[0].exists(), path
    for file in files:
        file.unlink(missing_ok=True)


def audit(dsn: str) -> list[dict[str, Any]]:
    """The oracle's rows in change order (those the snapshot read excepted): op, new, old (parsed exactly: numbers
    as Decimal), types."""
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute("SELECT op, new::text, old::text, types::text FROM oracle.audit WHERE seq > "
                         "(SELECT last_value FROM oracle.snapshot_taken) ORDER BY seq").fetchall()  # fmt: skip
    return [
        {
            "op": {"INSERT": "c", "UPDATE": "u", "DELETE": "d"}[op],
            "new": None if new is None else json.loads(new, parse_float=Decimal),
            "old": None if old is None else json.loads(old, parse_float=Decimal),
            "types": json.loads(types),
        }
        for op, new, old, types in rows
    ]


def expected_value(value: Any, type_name: str) -> Any:
    """What capture writes in JSON for an oracle value (to_jsonb's) of a column of ``type_name``."""
    if value is not None and type_name.startswith("numeric"):
        return str(value)  # numeric: its digits as a string (to_jsonb keeps the scale: 2.50 → Decimal('2.50'))
    return value


def image_problems(where: str, got: dict[str, Any], want: dict[str, Any], types: dict[str, str], *,
                   subset: bool = False) -> list[str]:  # fmt: skip
    """How an event's image differs from the oracle's row image (``subset``: an old key, some columns only)."""
    problems = []
    for name in sorted(got.keys() - want.keys()):
        kind = "phantom column with the placeholder" if got[name] == UNAVAILABLE else "phantom column"
        problems.append(f"{where}: {kind} {name}={_short(got[name])}")
    if not subset:
        problems += [f"{where}: missing column {name}" for name in sorted(want.keys() - got.keys())]
    for name in sorted(got.keys() & want.keys()):
        expected = expected_value(want[name], types.get(name, ""))
        if got[name] == expected:
            continue
        if got[name] == UNAVAILABLE:
            problems.append(f"{where}: the placeholder for the real value of {name}")
        else:
            problems.append(f"{where}: {name}={_short(got[name])}, the row had {_short(expected)} ({types.get(name)})")
    return problems


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "…"


def avro_events(log_dir: Path, topic: str) -> list[dict[str, Any]]:
    """The change events of an Avro topic, each decoded with the schema it names and rendered as capture's JSON
    (by the Postgres types of that schema's fields: a column as it was when the event was written)."""
    return [event for _, event in decoded_events(log_dir, topic)]


def decoded_events(log_dir: Path, topic: str) -> list[tuple[int, dict[str, Any]]]:
    """(the schema id it names, the event decoded with it) of each change event of an Avro topic, partition by
    partition."""
    notes: list[str] = []
    out = []
    with Log(log_dir) as log, Consumer(log, enable_auto_commit=False) as consumer:
        decoder = FramedDecoder(log, notes.append)
        consumer.assign([TopicPartition(topic, p) for p in range(log.topic(topic).partitions)])
        consumer.seek_to_beginning()
        while batch := consumer.poll(timeout_ms=0):
            for r in batch:
                if r.value is not None:
                    text, schema_id = decoder.decode(r.value)
                    assert schema_id is not None and text is not None, notes
                    out.append((schema_id, json.loads(text, parse_float=Decimal)))
    return out


def compare(dsn: str, log_dir: Path, *, full: bool, value_format: ValueFormat = ValueFormat.JSON) -> list[str]:
    """Every change event of ``t`` in the log at ``log_dir`` against the oracle's row image at the same position."""
    stored = avro_events(log_dir, TOPIC) if value_format is ValueFormat.AVRO else events(log_dir, TOPIC)
    return compare_events(dsn, stored, full=full, value_format=value_format)


def compare_events(dsn: str, stored: list[dict[str, Any]], *, full: bool, value_format: ValueFormat) -> list[str]:
    """Every change event of ``stored`` (``t``'s, decoded, in any order) against the oracle's row image at the same
    position."""
    changes = [e for e in stored if e["op"] != "r"]
    changes.sort(key=lambda e: (e["source"]["commit_lsn"], e["source"]["event_index"]))
    oracle = audit(dsn)
    problems = []
    if len(changes) != len(oracle):
        problems.append(f"{len(changes)} change events for {len(oracle)} row changes")
    for i, (event, row) in enumerate(zip(changes, oracle, strict=False)):
        where = f"change {i} ({row['op']} id={(row['new'] or row['old'])['id']})"
        if event["op"] != row["op"]:
            problems.append(f"{where}: op {event['op']}")
            continue
        if row["op"] in ("c", "u"):
            problems += image_problems(f"{where} after", event["after"] or {}, row["new"], row["types"])
        if row["op"] == "d" or (row["op"] == "u" and full):
            before = event["before"] or {}
            if value_format is ValueFormat.AVRO and not full:  # the old key: Avro's record has the others null
                before = {k: v for k, v in before.items() if v is not None or k in ("id",)}
            problems += image_problems(f"{where} before", before, row["old"], row["types"], subset=not full)
    return problems


def report(problems: list[str]) -> str:
    kinds: dict[str, int] = {}
    for p in problems:
        kind = " ".join(p.split(": ", 1)[-1].split(" ")[:2])
        kinds[kind] = kinds.get(kind, 0) + 1
    return f"{len(problems)} differences ({kinds}):\n" + "\n".join(problems[:30])


@pytest.mark.parametrize("core", [CoreChoice.PYTHON, CoreChoice.AUTO], ids=["python", "native"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_row_images_follow_the_schema_at_the_change(db: str, tmp_path: Path, plugin: Plugin, case: Case,
                                                    mode: str, core: CoreChoice) -> None:  # fmt: skip
    """Every event's columns and values are the row image its table had at the change, catalog behind or ahead."""
    if core is CoreChoice.AUTO and not extension.available():
        pytest.skip(extension.unavailable_reason())
    sql(db, *TABLE, *case.setup, *(["ALTER TABLE t REPLICA IDENTITY FULL"] if case.full else []))
    sql(db, "INSERT INTO oracle.snapshot_taken SELECT coalesce(max(seq), 0) FROM oracle.audit")
    workload = BEFORE + case.steps + AFTER
    log_dir = tmp_path / "log"
    if mode == "continuous":
        with Streaming(log_dir, db, plugin, core) as streaming:
            streaming.wait(wal_end(db))  # the snapshot is stored: what follows is streamed
            run(db, workload)
            streaming.wait(wal_end(db))
    else:
        capture(log_dir, db, plugin=plugin, table_filter=CAPTURED, core=core)  # the snapshot
        run(db, workload)
        if mode == "rebuilt":
            drop_key_state(log_dir, db)
        capture(log_dir, db, plugin=plugin, table_filter=CAPTURED, core=core)  # every change behind the catalog
    problems = compare(db, log_dir, full=case.full)
    assert not problems, report(problems)


AVRO_MODES = ["continuous", "ahead", "rebuilt"]


@pytest.mark.parametrize("core", [CoreChoice.PYTHON, CoreChoice.AUTO], ids=["python", "native"])
@pytest.mark.parametrize("mode", AVRO_MODES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_avro_events_are_written_under_the_schema_at_the_change(db: str, tmp_path: Path, plugin: Plugin, case: Case,
                                                                mode: str, core: CoreChoice) -> None:  # fmt: skip
    """Avro: each event is written under the schema of its table's columns at the change (a new version registered
    by the first change of a new shape), so that decoded with the schema it names, it is the row image then: no
    field of a column added later, ``n`` an integer before ``ALTER COLUMN n TYPE numeric``; the key state rebuilt
    from the log reads each record with its own schema. The subject's compatibility is NONE here (``ALTER COLUMN
    TYPE`` is refused under BACKWARD: test_avro.py)."""
    if core is CoreChoice.AUTO and not extension.available():
        pytest.skip(extension.unavailable_reason())
    sql(db, *TABLE, *case.setup, *(["ALTER TABLE t REPLICA IDENTITY FULL"] if case.full else []))
    sql(db, "INSERT INTO oracle.snapshot_taken SELECT coalesce(max(seq), 0) FROM oracle.audit")
    log_dir = tmp_path / "log"
    with Log(log_dir) as log:
        SchemaRegistry(LogSchemaStore(log)).set_compatibility(f"{TOPIC}-value", CompatibilityLevel.NONE)
    workload = BEFORE + case.steps + AFTER
    avro = ValueFormat.AVRO
    if mode == "continuous":
        with Streaming(log_dir, db, plugin, core, avro) as streaming:
            streaming.wait(wal_end(db))
            run(db, workload)
            streaming.wait(wal_end(db))
    else:
        capture(log_dir, db, plugin=plugin, table_filter=CAPTURED, value_format=avro, core=core)
        run(db, workload)
        if mode == "rebuilt":
            drop_key_state(log_dir, db)
        capture(log_dir, db, plugin=plugin, table_filter=CAPTURED, value_format=avro, core=core)
    problems = compare(db, log_dir, full=case.full, value_format=avro)
    assert not problems, report(problems)
    assert_starts_exact(log_dir, TOPIC)


def assert_starts_exact(log_dir: Path, topic: str) -> None:
    """Every value schema version the topic's events were written under has its start recorded (schemas.starts), at
    its first event's source position, and no other version has one; ``tideline schemas versions`` prints them."""
    first: dict[int, tuple[int, int, bool]] = {}
    for schema_id, event in decoded_events(log_dir, topic):
        source = event["source"]
        position = (source["commit_lsn"], source["event_index"], source["snapshot"] not in (None, "false"))
        if schema_id not in first or position[:2] < first[schema_id][:2]:
            first[schema_id] = position
    starts = {s.schema_id: s for s in choose(log_dir, None).schema_starts().values() if s.topic == topic}
    assert set(starts) == set(first), (sorted(starts), sorted(first))
    for schema_id, (commit_lsn, index, snapshot) in first.items():
        start = starts[schema_id]
        assert (start.commit_lsn, start.event_index, start.snapshot) == (commit_lsn, index, snapshot), (start, first)
    shown = CliRunner().invoke(cli_app, ["--data-dir", str(log_dir), "schemas", "versions", f"{topic}-value", "--json"])
    assert shown.exit_code == 0, shown.output
    rows = {r["id"]: r["started"] for r in json.loads(shown.output)}
    assert {i for i, started in rows.items() if started is not None} == set(first)
    for schema_id, (commit_lsn, index, _) in first.items():
        assert (rows[schema_id]["commit_lsn"], rows[schema_id]["event_index"]) == (commit_lsn, index)


def test_placeholder_never_for_a_column_that_did_not_exist(db: str, tmp_path: Path, plugin: Plugin) -> None:
    """The issue's reproduction: an UPDATE committed before ``ADD COLUMN note`` has no ``note``, not the
    unchanged-TOAST placeholder in it (the connector's catalog, read after the ALTER, is ahead of the change)."""
    sql(db, "CREATE TABLE orders (id int PRIMARY KEY, total numeric(12,2), tags text[])",
        "INSERT INTO orders VALUES (1, 9.99, '{a}'), (2, 120.00, NULL)")  # fmt: skip
    capture(tmp_path / "log", db, plugin=plugin, table_filter=CAPTURED)  # snapshot done
    sql(db, "UPDATE orders SET total = 10 WHERE id = 1", "ALTER TABLE orders ADD COLUMN note text",
        "INSERT INTO orders (id, total, note) VALUES (3, 1, 'x')")  # fmt: skip
    capture(tmp_path / "log", db, plugin=plugin, table_filter=CAPTURED)
    update, insert = [e for e in events(tmp_path / "log", "cdc.public.orders") if e["op"] != "r"]
    assert update["after"] == {"id": 1, "total": "10.00", "tags": ["a"]}
    assert insert["after"] == {"id": 3, "total": "1.00", "tags": None, "note": "x"}


# ---------------------------------------------------------------------------- random DDL under kill -9

CHILD = """
import sys
from pathlib import Path
from capture.config import CoreChoice, ValueFormat
from capture.connector import CaptureConfig, Connector
from capture.messages import Plugin
from capture.tables import TableFilter
from eventstore.log import Log
dsn, log_dir, plugin, value_format, caught_up, schema_changes = sys.argv[1:7]
config = CaptureConfig(dsn=dsn, slot="t", topic_prefix="cdc", plugin=Plugin(plugin), table_filter=TableFilter(
    include=["public.*"]), value_format=ValueFormat(value_format), core=CoreChoice.AUTO, batch_bytes=32768,
    exit_when_caught_up=caught_up == "1", schema_changes=schema_changes == "1")
with Log(Path(log_dir)) as log:
    Connector(config, log).run()
print("done")
"""


class RandomDdl:
    """A random interleaving of DDL (ADD COLUMN with and without DEFAULT, DROP, DROP of ``big``, RENAME, ALTER TYPE,
    SET/DROP NOT NULL, DDL and DML in one transaction) and DML on ``t`` that stays valid: it tracks the columns."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.extra: dict[str, str] = {}  # added column → its type
        self.serial = 0
        self.next_id = 100
        self.big = True

    def ddl(self) -> str:
        rng = self.rng
        choice = rng.randrange(7)
        if choice == 0 or not self.extra:
            self.serial += 1
            name, kind = f"c{self.serial}", rng.choice(["text", "int", "numeric(10,2)"])
            self.extra[name] = kind
            default = rng.choice(["", " DEFAULT 7" if kind != "text" else " DEFAULT 'dft'"])
            return f"ALTER TABLE t ADD COLUMN {name} {kind}{default}"
        name = rng.choice(sorted(self.extra))
        if choice == 1:
            del self.extra[name]
            return f"ALTER TABLE t DROP COLUMN {name}"
        if choice == 2:
            self.serial += 1
            new = f"c{self.serial}"
            self.extra[new] = self.extra.pop(name)
            return f"ALTER TABLE t RENAME COLUMN {name} TO {new}"
        if choice == 3 and self.extra[name] == "int":
            self.extra[name] = "bigint"
            return f"ALTER TABLE t ALTER COLUMN {name} TYPE bigint"
        if choice == 4 and self.big:
            self.big = False
            return "ALTER TABLE t DROP COLUMN big"
        if choice == 5 and not self.big:
            self.big = True
            return "ALTER TABLE t ADD COLUMN big text"
        return f"ALTER TABLE t ALTER COLUMN small {rng.choice(['SET', 'DROP'])} NOT NULL"

    def value(self, kind: str) -> str:
        return {"text": "'v'", "int": "3", "bigint": "4", "numeric(10,2)": "1.25"}[kind]

    def dml(self) -> str:
        rng = self.rng
        choice = rng.random()
        if choice < 0.3:
            self.next_id += 1
            cols = ["id", "n", "small"] + (["big"] if self.big and rng.random() < 0.5 else [])
            vals = [str(self.next_id), "1", "'s'"] + (["big('i')"] if "big" in cols else [])
            for name, kind in self.extra.items():
                if rng.random() < 0.5:
                    cols.append(name)
                    vals.append(self.value(kind))
            return f"INSERT INTO t ({', '.join(cols)}) VALUES ({', '.join(vals)})"
        target = rng.choice([1, 2, 10, self.next_id])
        if choice < 0.85:  # most UPDATEs leave the TOASTed value unchanged
            sets = ["n = n + 1"]
            if self.extra and rng.random() < 0.3:
                name = rng.choice(sorted(self.extra))
                sets.append(f"{name} = {self.value(self.extra[name])}")
            if self.big and rng.random() < 0.1:
                sets.append("big = big('u')")
            return f"UPDATE t SET {', '.join(sets)} WHERE id = {target}"
        if target in (1, 2, 10):
            return f"UPDATE t SET small = 's' WHERE id = {target}"
        return f"DELETE FROM t WHERE id = {target}"

    def transactions(self, count: int) -> list[Step]:
        out: list[Step] = []
        for _ in range(count):
            r = self.rng.random()
            if r < 0.08:
                out.append((self.ddl(),))
            elif r < 0.12:  # DDL and DML in one transaction
                out.append((self.dml(), self.ddl(), self.dml()))
            else:
                out.append(tuple(self.dml() for _ in range(self.rng.randint(1, 3))))
        return out


def run_tolerant(dsn: str, steps: list[Step]) -> None:
    """Each transaction; one a DDL refuses (SET NOT NULL over a NULL, …) rolls back and the next goes on."""
    with psycopg.connect(dsn) as c:
        for step in steps:
            try:
                for statement in step:
                    c.execute(statement.encode())
                c.commit()
            except psycopg.Error:
                c.rollback()


@pytest.mark.parametrize("value_format", [ValueFormat.JSON, ValueFormat.AVRO], ids=["json", "avro"])
def test_random_ddl_under_kill9_every_event_is_the_row_image_then(db: str, tmp_path: Path, plugin: Plugin,
                                                                  value_format: ValueFormat) -> None:  # fmt: skip
    """The issue's independent check, smaller: random DDL between DML, the connector killed with SIGKILL at
    random moments (each after it stored a new position) while the workload runs and while it catches up a
    backlog, then a last run: every event equals the oracle's row image at its position.

    wal2json with ``--schema-changes`` (the event triggers' DDL messages keep each table's shape exact; without
    them a drop and an add of the same type pass for a rename when the catalog is far ahead: docs/capture.md);
    pgoutput without (its Relation messages are exact)."""
    rng = random.Random(1000 + (value_format is ValueFormat.AVRO) * 10 + (plugin is Plugin.PGOUTPUT))
    sql(db, *TABLE)
    sql(db, "INSERT INTO oracle.snapshot_taken SELECT coalesce(max(seq), 0) FROM oracle.audit")
    log_dir = tmp_path / "log"
    if value_format is ValueFormat.AVRO:
        with Log(log_dir) as log:
            SchemaRegistry(LogSchemaStore(log)).set_compatibility(f"{TOPIC}-value", CompatibilityLevel.NONE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def start(name: str, caught_up: bool) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", CHILD, db, str(log_dir), plugin.value, value_format.value,
                "1" if caught_up else "0", "1" if plugin is Plugin.WAL2JSON else "0"]  # fmt: skip
        with (tmp_path / f"{name}.err").open("wb") as err:
            return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)

    first = start("first", True)  # the snapshot, before the workload
    assert first.wait(timeout=patience(300)) == 0, (tmp_path / "first.err").read_text()[-2000:]
    workload = RandomDdl(rng).transactions(400)
    writer = threading.Thread(target=run_tolerant, args=(db, workload), name="workload")
    writer.start()
    kills = 0
    try:
        for k in range(4):
            before = stored_position(log_dir, db)
            if not writer.is_alive() and before is not None and before.confirm_lsn >= wal_end(db):
                break  # all stored already: no backlog left to kill in
            proc = start(f"killed{k}", False)
            try:
                wait_until(lambda b=before: (p := stored_position(log_dir, db)) is not None and p != b,
                           "a new stored position", every=0.02, alive=proc,
                           details=lambda k=k: (tmp_path / f"killed{k}.err").read_text()[-2000:])  # fmt: skip
                time.sleep(rng.uniform(0, 0.4))
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)  # by PID
                    kills += 1
                proc.wait()
            if k == 1:
                writer.join()  # the last kills land while a backlog is caught up (the catalog ahead)
    finally:
        writer.join()
    assert kills >= 2, "the connector ended by itself before its kills"
    last = start("last", True)
    assert last.wait(timeout=patience(300)) == 0, (tmp_path / "last.err").read_text()[-2000:]
    problems = compare(db, log_dir, full=False, value_format=value_format)
    assert not problems, report(problems)
    if value_format is ValueFormat.AVRO:
        assert_starts_exact(log_dir, TOPIC)  # each version's start, in the transaction of its first event
