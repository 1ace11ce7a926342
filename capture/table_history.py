"""Which new tables the stream holds whole: what each connection starts with, kept for the next start.

At start, a captured table with a key and no topic in the log yet is new to the connector
(capture.incremental). Such a table used to be snapshotted incrementally whatever its history, so
one created after the stored position — its ``CREATE TABLE`` and every row in the WAL the slot
still holds — arrived twice: streamed (``op=c``…) and read (``op=r``). Now a new table is read only
when the stream cannot give its whole history.

**The record.** Each connection of the connector, once its stream's start is fixed (the slot
exists, an initial snapshot is taken) and before it stores any position, records a new ``run``
name — every position it stores from then on carries it (schemas.position) — with the stored
position it starts from, the plugin, the selection (``--tables``, ``--exclude-tables``,
``--keyless-tables``), the OIDs of every table of the database (ordinary and partitioned), and
what of the slot's publications streams tables created later (pgoutput: ``FOR ALL TABLES``,
``FOR TABLES IN SCHEMA``). It is the file ``<state dir>/<connector id>.tables.json``, replaced
whole (temporary file, fsync, rename, directory fsync).

**The rule.** A new table is streamed, not read, when all of these hold; otherwise it is read.
When in doubt it is read: a needless read costs duplicate ``op=r`` events, a missed one costs rows.

1. The record belongs to the stored position: that position was stored by the recorded run, or
   it is the position the run started from (the run stored nothing).
2. The table's OID is not in the record: it did not exist when that run started, so its creation
   and every change of it come after the run's stream start. What of it lies before the stored
   position went through that run; what lies after it, the stream from there gives.
3. It has had its name since its creation: its row type's catalog row is the one ``CREATE TABLE``
   wrote (same transaction and command as the table's own attribute rows) and its schema's row is
   no newer than that. After a ``RENAME`` or ``SET SCHEMA`` (of the table or its schema) its earlier
   changes were streamed under another name.
4. When the run stored positions past its start: the run's selection captured the table by that
   name, and with ``--keyless-tables skip`` the table had its primary key from its creation. Else
   the changes that run streamed were left out.
5. pgoutput: one publication of the slot streamed it from before its creation until now: ``FOR ALL
   TABLES``, or ``FOR TABLES IN SCHEMA`` of its schema, the same catalog rows (publication, schema
   entry) when the run started as now, publishing inserts, updates and deletes. The managed
   publications (capture.publications) hold table lists, never these: a table created after a
   start joins them only at the next start, its changes before that were never streamed, and it is
   read — as every table of ``--publication-autocreate filtered`` or ``all_tables`` created since.

A missing, unreadable or foreign record (a wiped or copied state directory, the log of another
connector instance) leaves every new table to be read. The transaction ids compared in 3 and 4
come from the catalog's rows (``xmin``, ``cmin``); a row's 32-bit ``xmin`` is placed in the
current epoch, which can only misplace a row more than 2^32 transactions old: one never
renamed since, on which the rule draws no wrong conclusion.

Thread-safety: none; used by the connector thread at start.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg

from capture.config import CaptureConfig
from capture.publications import Publications
from capture.tables import KeylessPolicy, TableFilter, TableInfo
from eventstore.fileio import replace_durably
from schemas.position import SourcePosition

log = logging.getLogger("capture.connector")

RECORD_VERSION = 1
XID_SPACE = 1 << 32
FIRST_NORMAL_XID = 3  # 0 invalid, 1 bootstrap, 2 frozen

_ALL_TABLES_SQL = """
SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema')
"""
# Per table: its OID and its schema's; the row written by CREATE TABLE and never updated (the ctid
# attribute), the row type's row (rewritten by RENAME, SET SCHEMA, OWNER TO), the schema's row
# (RENAME, OWNER TO, GRANT), the primary key's pg_index row; and the next transaction id.
_NEW_TABLES_SQL = """
SELECT n.nspname, c.relname, c.oid, n.oid, a.xmin::text, a.cmin::text, t.xmin::text, t.cmin::text,
       n.xmin::text, n.cmin::text,
       (SELECT i.xmin::text FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
       pg_snapshot_xmax(pg_current_snapshot())::text
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = -1
LEFT JOIN pg_type t ON t.oid = c.reltype
WHERE c.relkind IN ('r', 'p') AND (n.nspname, c.relname) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
"""
_COVERAGE_SQL = """
SELECT p.oid, p.xmin::text, p.puballtables, p.pubinsert AND p.pubupdate AND p.pubdelete, {schemas}
FROM pg_publication p WHERE p.pubname = ANY(%s)
"""
_SCHEMAS_15 = """COALESCE((SELECT json_object_agg(pn.pnnspid::text, pn.oid)
                           FROM pg_publication_namespace pn WHERE pn.pnpubid = p.oid), '{}')"""


@dataclass(frozen=True, slots=True)
class PublicationCoverage:
    """What of one publication streams tables created after it (pgoutput): the catalog rows that say so."""

    oid: int
    row_xmin: str  # pg_publication's row: ALTER PUBLICATION (publish, rename, owner) writes a new one
    all_tables: bool
    publishes_changes: bool  # inserts, updates and deletes
    schemas: dict[int, int] = field(default_factory=dict)  # schema OID → its pg_publication_namespace row

    def covers(self, schema_oid: int) -> bool:
        return self.publishes_changes and (self.all_tables or schema_oid in self.schemas)

    def to_json(self) -> dict[str, Any]:
        return {"oid": self.oid, "row_xmin": self.row_xmin, "all_tables": self.all_tables,
                "publishes_changes": self.publishes_changes,
                "schemas": {str(k): v for k, v in self.schemas.items()}}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PublicationCoverage:
        return cls(int(d["oid"]), str(d["row_xmin"]), bool(d["all_tables"]), bool(d["publishes_changes"]),
                   {int(k): int(v) for k, v in d["schemas"].items()})  # fmt: skip


@dataclass(frozen=True, slots=True)
class StartRecord:
    """What one connection of the connector started with (the module docstring, "The record")."""

    run: str
    started_from: SourcePosition | None  # the stored position when the run started
    plugin: str
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    keyless: str
    tables: frozenset[int]  # every table of the database when the run started
    publications: tuple[PublicationCoverage, ...] = ()  # pgoutput: the slot's publications

    def to_json(self) -> bytes:
        return orjson.dumps({
            "version": RECORD_VERSION,
            "run": self.run,
            "started_from": None if self.started_from is None else orjson.loads(self.started_from.to_json()),
            "plugin": self.plugin,
            "include": list(self.include),
            "exclude": list(self.exclude),
            "keyless": self.keyless,
            "tables": sorted(self.tables),
            "publications": [p.to_json() for p in self.publications],
        })  # fmt: skip

    @classmethod
    def from_json(cls, raw: bytes) -> StartRecord:
        """Parse a record; raises ValueError naming what is wrong."""
        try:
            d = orjson.loads(raw)
            if int(d["version"]) != RECORD_VERSION:
                raise ValueError(f"version {d['version']}, not {RECORD_VERSION}")
            started = d["started_from"]
            return cls(
                str(d["run"]),
                None if started is None else SourcePosition.from_json(orjson.dumps(started)),
                str(d["plugin"]),
                tuple(str(p) for p in d["include"]),
                tuple(str(p) for p in d["exclude"]),
                str(d["keyless"]),
                frozenset(int(t) for t in d["tables"]),
                tuple(PublicationCoverage.from_json(p) for p in d["publications"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a start record ({e})") from None

    def belongs_to(self, stored: SourcePosition) -> bool:
        """Rule 1: the stored position was stored by this run, or is the one it started from."""
        return stored.run == self.run or stored == self.started_from


@dataclass(slots=True)
class NewTables:
    """The decision for the tables new to the connector at one start."""

    streamed: list[str] = field(default_factory=list)  # their whole history is in the stream: not read
    read: dict[str, str] = field(default_factory=dict)  # "schema.table" → why it is read


class TableHistory:
    """The start record of one connector (``path``) and the rule that reads it (the module docstring)."""

    def __init__(self, config: CaptureConfig, publications: Publications | None, path: Path) -> None:
        self.config = config
        self.publications = publications
        self.path = path

    def read(self) -> StartRecord | None:
        """The last run's record (None: none, or one that cannot be read: every new table is then read)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("capture: cannot read %s (%s): tables new to the connector are snapshotted", self.path, e)
            return None
        try:
            return StartRecord.from_json(raw)
        except ValueError as e:
            log.warning("capture: %s: %s: tables new to the connector are snapshotted", self.path, e)
            return None

    def record(self, started_from: SourcePosition | None) -> str | None:
        """Record this run's start (after the stream's start is fixed, before any position is stored); return
        its name for the positions it stores (None: it could not be written, its positions name no run)."""
        run = uuid.uuid4().hex[:16]
        config = self.config
        with psycopg.connect(config.dsn, autocommit=True) as c:
            tables = frozenset(int(r[0]) for r in c.execute(_ALL_TABLES_SQL).fetchall())
            coverage = self._coverage(c)
        record = StartRecord(
            run,
            started_from,
            config.plugin.value,
            tuple(config.table_filter.include),
            tuple(config.table_filter.exclude),
            config.keyless_tables.value,
            tables,
            coverage,
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_durably(self.path, record.to_json())
        except OSError as e:
            log.warning("capture: cannot record the tables this run starts with in %s (%s): at the next start, "
                        "tables new to the connector are snapshotted", self.path, e)  # fmt: skip
            with contextlib.suppress(OSError):  # left, an older record still never matches this run's positions
                self.path.unlink(missing_ok=True)
            return None
        return run

    def _coverage(self, c: psycopg.Connection[Any]) -> tuple[PublicationCoverage, ...]:
        if self.publications is None:
            return ()
        schemas = _SCHEMAS_15 if c.info.server_version >= 150000 else "'{}'::json"
        rows = c.execute(_COVERAGE_SQL.format(schemas=schemas).encode(), (list(self.publications.names),)).fetchall()
        out = []
        for oid, xmin, all_tables, changes, entries in rows:
            schema_rows = {int(k): int(v) for k, v in (entries or {}).items()}
            out.append(PublicationCoverage(int(oid), str(xmin), bool(all_tables), bool(changes), schema_rows))
        return tuple(out)

    def decide(self, previous: StartRecord | None, stored: SourcePosition, new: list[TableInfo]) -> NewTables:
        """Which of these tables (captured, keyed, no topic yet) the stream from ``stored`` holds whole."""
        out = NewTables()
        if not new:
            return out
        why_not = self._record_unusable(previous, stored)
        if why_not is not None:
            out.read = {t.qualified: why_not for t in new}
            return out
        assert previous is not None
        with psycopg.connect(self.config.dsn, autocommit=True) as c:
            rows = c.execute(_NEW_TABLES_SQL, ([t.schema for t in new], [t.name for t in new])).fetchall()
            coverage = {p.oid: p for p in self._coverage(c)}
        found = {(r[0], r[1]): r for r in rows}
        for table in new:
            row = found.get((table.schema, table.name))
            reason = "it is gone" if row is None else self._why_read(previous, stored, table, row, coverage)
            if reason is None:
                out.streamed.append(table.qualified)
            else:
                out.read[table.qualified] = reason
        return out

    def _record_unusable(self, previous: StartRecord | None, stored: SourcePosition) -> str | None:
        if previous is None:
            return "no record of the tables the last run started with"
        if not previous.belongs_to(stored):
            return "the stored position is not from the run whose start is recorded"
        if previous.plugin != self.config.plugin.value:
            return f"the last run streamed with {previous.plugin}"
        return None

    def _why_read(
        self,
        previous: StartRecord,
        stored: SourcePosition,
        table: TableInfo,
        row: tuple[Any, ...],
        coverage: dict[int, PublicationCoverage],
    ) -> str | None:
        """Rules 2 to 5 for one table (None: streamed whole)."""
        _, _, oid, schema_oid, made_xmin, made_cmin, type_xmin, type_cmin, nsp_xmin, nsp_cmin, pk_xmin, next_xid = row
        if int(oid) in previous.tables:
            return "it existed when the last run started"
        if made_xmin is None or (type_xmin, type_cmin) != (made_xmin, made_cmin):
            return "it was renamed or moved since its creation"
        nxt = int(next_xid)
        if (_xid64(nsp_xmin, nxt), int(nsp_cmin)) > (_xid64(made_xmin, nxt), int(made_cmin)):
            return "its schema changed since the table's creation"
        if stored != previous.started_from:  # the run streamed past its start: it had to capture the table
            selection = TableFilter(include=list(previous.include), exclude=list(previous.exclude))
            if not selection.captures(table.schema, table.name):
                return "the last run's --tables/--exclude-tables left it out"
            if previous.keyless == KeylessPolicy.SKIP.value and pk_xmin != made_xmin:
                return "the last run skipped keyless tables and it got its primary key after its creation"
        if self.publications is not None:
            then = [p for p in previous.publications if p.covers(int(schema_oid))]
            if not any(_still_covers(p, coverage.get(p.oid), int(schema_oid)) for p in then):
                return "no publication streamed it from its creation on"
        return None


def _still_covers(then: PublicationCoverage, now: PublicationCoverage | None, schema_oid: int) -> bool:
    """The same catalog rows cover the schema now as when the run started (none dropped and made again)."""
    if now is None or now.row_xmin != then.row_xmin or not now.covers(schema_oid):
        return False
    return then.all_tables or now.schemas.get(schema_oid) == then.schemas.get(schema_oid)


def _xid64(xid: str, next_xid: int) -> int:
    """A catalog row's 32-bit ``xmin`` as the 64-bit transaction id of the last 2^32 (``next_xid``: the next one
    to be assigned); bootstrap and frozen ids are the oldest (0)."""
    x = int(xid)
    if x < FIRST_NORMAL_XID:
        return 0
    return next_xid - ((next_xid - x) % XID_SPACE)
