"""Publications for pgoutput: which tables the slot streams, kept in step with the captured tables.

pgoutput streams only the tables of the publications named in ``publication_names``.
``--publication-autocreate`` (Debezium's ``publication.autocreate.mode``) says who owns them:

* ``filtered`` (default): the captured tables (``--tables``/``--exclude-tables``, less the
  keyless tables ``--keyless-tables skip`` leaves out);
* ``all_tables``: every table a publication can hold (permanent, ordinary tables outside
  the system schemas), whatever the filter says (capture still writes only the captured ones);
* ``disabled``: an existing publication, used as it is (its row filters and column lists
  included); missing → :class:`~eventstore.errors.ConfigError`.

**Never making the source's writes fail.** PostgreSQL refuses UPDATE and DELETE on a
table without a replica identity once a publication that publishes updates or deletes
holds it ("cannot update table … because it does not have a replica identity and
publishes updates"). ``CREATE PUBLICATION … FOR ALL TABLES`` is the classic trap: every
keyless table of the database stops accepting UPDATE. So the managed modes never use
``FOR ALL TABLES``: they keep **two publications with explicit table lists**, split by
replica identity, and stream both:

* ``<name>`` ``WITH (publish = 'insert, update, delete, truncate')``: tables with a replica
  identity (``FULL``, ``USING INDEX``, or ``DEFAULT`` with a primary key);
* ``<name>_keyless`` ``WITH (publish = 'insert, truncate')``: tables without one (no primary
  key under ``DEFAULT``, or ``NOTHING``). Their inserts and truncates are streamed, exactly
  what wal2json gives of such a table, and the application's UPDATE and DELETE go on working.

:meth:`Publications.sync` creates both when missing and alters them to the wanted lists:
tables that appeared are added, tables that are gone or no longer captured dropped, and a
table that gained or lost its replica identity moves between the two. It runs at every
start (and reconnect), in one transaction, *before* the slot is created: PostgreSQL 15
decodes a change with the publications as they were when the change was written, so a
publication must exist before the slot's first change ("publication … does not exist"
otherwise), and **a table added to a publication later is streamed only from then on**:
its rows written before are not (the connector warns, naming the table). Partitioned
tables are published through their partitions (each has its own replica identity), as
wal2json reports their changes; with ``via_root`` (``--publish-via-partition-root``) the
managed publications hold the partitioned tables themselves and no partition, ``WITH
(publish_via_partition_root = true)``: each partition's changes come as its root's (capture.partitions).
A publication used as it is must say the same as the connector about that option (else a partitioned
table's changes would come under names capture does not capture). Table entries the managed publications
already hold keep their row filters and column lists.

Thread-safety: none needed (each call opens its own connection).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from eventstore.errors import ConfigError

KEYLESS_SUFFIX = "_keyless"
PUBLISH_ALL = ("insert", "update", "delete", "truncate")
PUBLISH_KEYLESS = ("insert", "truncate")  # nothing that needs a replica identity
MAX_NAME_BYTES = 63  # NAMEDATALEN - 1


class PublicationMode(enum.Enum):
    """``--publication-autocreate``: Debezium's ``publication.autocreate.mode`` values (module docstring)."""

    ALL_TABLES = "all_tables"
    FILTERED = "filtered"
    DISABLED = "disabled"

    @classmethod
    def parse(cls, text: str) -> PublicationMode:
        try:
            return cls(text)
        except ValueError:
            raise ConfigError(
                f"--publication-autocreate must be one of all_tables, filtered, disabled; not {text!r}"
            ) from None


TableName = tuple[str, str]  # (schema, table)


@dataclass(frozen=True, slots=True)
class PublishedTable:
    """One table as the slot's publications stream it (``pg_publication_tables``)."""

    schema: str
    name: str
    columns: tuple[str, ...]  # the column list, or every column when the publication has none
    row_filter: str | None  # the WHERE expression (PostgreSQL 15 row filter), as pg_get_expr prints it


@dataclass(frozen=True, slots=True)
class PublishableTable:
    """A table a publication can hold, with what decides which of the two it goes into."""

    schema: str
    name: str
    has_replica_identity: bool  # UPDATE/DELETE work while it is published for them
    keyed: bool  # a primary key, or REPLICA IDENTITY FULL / USING INDEX: capture.tables gives it a key


@dataclass(slots=True)
class SyncResult:
    """What :meth:`Publications.sync` changed: publication → tables added / dropped."""

    created: list[str] = field(default_factory=list)
    added: dict[str, list[TableName]] = field(default_factory=dict)
    dropped: dict[str, list[TableName]] = field(default_factory=dict)

    def newly_published(self) -> list[TableName]:
        """Tables in no publication before and in one now (a move between the two is not new)."""
        added = {t for tables in self.added.values() for t in tables}
        dropped = {t for tables in self.dropped.values() for t in tables}
        return sorted(added - dropped)

    @property
    def changed(self) -> bool:
        return bool(self.created or any(self.added.values()) or any(self.dropped.values()))


_PUBLISHABLE_SQL = """
SELECT n.nspname, c.relname,
       c.relreplident = 'f' OR (c.relreplident = 'd' AND pk.indexrelid IS NOT NULL)
           OR (c.relreplident = 'i' AND EXISTS (
               SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident)),
       pk.indexrelid IS NOT NULL OR c.relreplident IN ('f', 'i')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_index pk ON pk.indrelid = c.oid AND pk.indisprimary
WHERE {which} AND c.relpersistence = 'p' AND c.oid >= 16384
  AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
ORDER BY 1, 2
"""
_LEAVES = "c.relkind = 'r'"
_ROOTS = "c.relkind IN ('r', 'p') AND NOT c.relispartition"
_PUBLICATIONS_SQL = """
SELECT pubname, puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, {gencols}, pubviaroot
FROM pg_publication WHERE pubname = ANY(%s)
"""
GENERATED_COLUMNS_SINCE = 180000  # server_version_num: pg_publication.pubgencols, publish_generated_columns


def _publications_sql(c: psycopg.Connection[Any]) -> bytes:
    """The publications' rows; the last column is ``pubgencols`` ('s': stored generated columns are published,
    'n': not) from PostgreSQL 18, NULL before (nothing publishes them)."""
    gencols = "pubgencols::text" if c.info.server_version >= GENERATED_COLUMNS_SINCE else "NULL::text"
    return _PUBLICATIONS_SQL.format(gencols=gencols).encode()
_MEMBERS_SQL = """
SELECT p.pubname, n.nspname, c.relname
FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE p.pubname = ANY(%s)
"""
_PUBLISHED_SQL = """
SELECT schemaname, tablename, attnames, rowfilter FROM pg_publication_tables WHERE pubname = ANY(%s)
"""


class Publications:
    """The publication(s) one connector streams: their names, their upkeep, what they publish.

    >>> Publications("postgresql:///x", "cdc", PublicationMode.FILTERED).names
    ('cdc', 'cdc_keyless')
    >>> Publications("postgresql:///x", "mine", PublicationMode.DISABLED).names
    ('mine',)
    """

    def __init__(self, dsn: str, name: str, mode: PublicationMode, *, via_root: bool = False) -> None:
        limit = MAX_NAME_BYTES - (0 if mode is PublicationMode.DISABLED else len(KEYLESS_SUFFIX))
        if not name or len(name.encode()) > limit:
            raise ConfigError(
                f"publication name {name!r}: give 1 to {limit} bytes"
                + ("" if mode is PublicationMode.DISABLED else f" (the keyless one is named {name}{KEYLESS_SUFFIX})")
            )
        self.dsn, self.name, self.mode = dsn, name, mode
        self.via_root = via_root  # publish_via_partition_root (module docstring)

    @property
    def keyless_name(self) -> str:
        return self.name + KEYLESS_SUFFIX

    @property
    def names(self) -> tuple[str, ...]:
        """``publication_names`` of the slot: both managed publications, or the user's one."""
        return (self.name,) if self.mode is PublicationMode.DISABLED else (self.name, self.keyless_name)

    def sync(self, wanted: Callable[[PublishableTable], bool]) -> SyncResult:
        """Create and alter the managed publications to hold the wanted tables (``disabled``: check it exists).

        ``wanted`` decides for ``filtered`` (the captured tables); ``all_tables`` takes every one.
        One transaction: a connector that dies in the middle leaves the publications as they were.
        """
        try:
            return self._sync(wanted)
        except psycopg.errors.ReadOnlySqlTransaction:
            raise ConfigError(
                f"the server is a standby: capture cannot create or alter publication {self.name} on it (read "
                "only). Run the same capture command against the primary once (the publications it makes "
                "replicate here), or create one there and give --publication NAME --publication-autocreate disabled"
            ) from None

    def _sync(self, wanted: Callable[[PublishableTable], bool]) -> SyncResult:
        with psycopg.connect(self.dsn) as c:
            existing = {row[0]: row for row in c.execute(_publications_sql(c), (list(self.names),)).fetchall()}
            if self.mode is PublicationMode.DISABLED:
                if self.name not in existing:
                    raise ConfigError(
                        f"publication {self.name} does not exist (--publication-autocreate disabled): create it "
                        f"(CREATE PUBLICATION {_sql_name(self.name)} FOR TABLE …) or let capture manage it "
                        "(--publication-autocreate filtered)"
                    )
                self._check_via_root(existing[self.name])
                return SyncResult()
            result = SyncResult()
            want = {self.name: PUBLISH_ALL, self.keyless_name: PUBLISH_KEYLESS}
            for name, publish in want.items():
                self._ensure(c, name, publish, existing.get(name), result)
            members: dict[str, set[TableName]] = {name: set() for name in want}
            for pubname, schema, table in c.execute(_MEMBERS_SQL, (list(want),)).fetchall():
                members[pubname].add((schema, table))
            target: dict[str, set[TableName]] = {name: set() for name in want}
            which = _ROOTS if self.via_root else _LEAVES
            for row in c.execute(_PUBLISHABLE_SQL.format(which=which).encode()).fetchall():
                table = PublishableTable(row[0], row[1], bool(row[2]), bool(row[3]))
                if self.mode is PublicationMode.ALL_TABLES or wanted(table):
                    into = self.name if table.has_replica_identity else self.keyless_name
                    target[into].add((table.schema, table.name))
            for name in want:  # drops first: a table moving between the two never sits in both
                gone = sorted(members[name] - target[name])
                if gone:
                    c.execute(sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(sql.Identifier(name), _tables(gone)))
                    result.dropped[name] = gone
            for name in want:
                new = sorted(target[name] - members[name])
                if new:
                    c.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(sql.Identifier(name), _tables(new)))
                    result.added[name] = new
            return result

    def _ensure(
        self, c: psycopg.Connection[Any], name: str, publish: tuple[str, ...], row: Any, result: SyncResult
    ) -> None:
        """The publication exists, is not FOR ALL TABLES, publishes exactly ``publish``, and from PostgreSQL 18
        publishes stored generated columns too (``publish_generated_columns = stored``: Debezium's and wal2json's
        row images hold them)."""
        generated = c.info.server_version >= GENERATED_COLUMNS_SINCE
        options = sql.SQL("(publish = {}, publish_via_partition_root = {}{})").format(
            sql.Literal(", ".join(publish)),
            sql.SQL("true" if self.via_root else "false"),
            sql.SQL(", publish_generated_columns = stored" if generated else ""),
        )
        if row is None:
            c.execute(sql.SQL("CREATE PUBLICATION {} WITH ").format(sql.Identifier(name)) + options)
            result.created.append(name)
            return
        if row[1]:
            raise ConfigError(
                f"publication {name} is FOR ALL TABLES, which makes UPDATE and DELETE of tables without a replica "
                "identity fail: drop it (capture re-creates it with a table list), choose another --publication, "
                "or use it as it is (--publication-autocreate disabled)"
            )
        ops = tuple(op for op, on in zip(PUBLISH_ALL, row[2:6], strict=True) if on)
        if ops != publish or (generated and row[6] != "s") or bool(row[7]) != self.via_root:
            c.execute(sql.SQL("ALTER PUBLICATION {} SET ").format(sql.Identifier(name)) + options)

    def _check_via_root(self, row: Any) -> None:
        """A publication used as it is publishes partitions as the connector captures them (module docstring)."""
        if bool(row[7]) == self.via_root:
            return
        if self.via_root:
            raise ConfigError(
                f"publication {self.name} publishes each partition under its own name (publish_via_partition_root "
                f"is false), and --publish-via-partition-root captures partitioned tables whole: ALTER PUBLICATION "
                f"{_sql_name(self.name)} SET (publish_via_partition_root = true), or capture without the option"
            )
        raise ConfigError(
            f"publication {self.name} publishes partitions' changes as their partitioned table's "
            f"(publish_via_partition_root is true), which capture reads only with --publish-via-partition-root: "
            f"pass it, or ALTER PUBLICATION {_sql_name(self.name)} SET (publish_via_partition_root = false)"
        )

    def published(self, conn: psycopg.Connection[Any] | None = None) -> dict[TableName, PublishedTable]:
        """Every table the publications stream, with its column list and row filter."""
        own = conn is None
        c = conn or psycopg.connect(self.dsn, autocommit=True)
        try:
            out: dict[TableName, PublishedTable] = {}
            for schema, table, columns, row_filter in c.execute(_PUBLISHED_SQL, (list(self.names),)).fetchall():
                out[(schema, table)] = PublishedTable(schema, table, tuple(columns or ()), row_filter)
            return out
        finally:
            if own:
                c.close()

    def describe(self) -> list[dict[str, Any]]:
        """For ``capture status``: each of the publications that exists, what it publishes and how many tables."""
        with psycopg.connect(self.dsn, autocommit=True) as c:
            rows = c.execute(_publications_sql(c), (list(self.names),)).fetchall()
            published = self.published(c)
            per_pub: dict[str, list[str]] = {}
            for pubname, schema, table in c.execute(_MEMBERS_SQL, (list(self.names),)).fetchall():
                per_pub.setdefault(pubname, []).append(f"{schema}.{table}")
        out = []
        for name in self.names:
            row = next((r for r in rows if r[0] == name), None)
            if row is None:
                out.append({"name": name, "exists": False})
                continue
            tables = sorted(per_pub.get(name, []))
            out.append({
                "name": name,
                "exists": True,
                "all_tables": bool(row[1]),
                "publish": [op for op, on in zip(PUBLISH_ALL, row[2:6], strict=True) if on],
                "generated_columns": {"s": "stored", "n": "none"}.get(row[6]),  # None: before PostgreSQL 18
                "via_partition_root": bool(row[7]),
                "tables": tables,
                "row_filters": sorted(f"{t.schema}.{t.name}" for t in published.values()
                                      if t.row_filter and f"{t.schema}.{t.name}" in tables),
            })  # fmt: skip
        return out


def _tables(names: list[TableName]) -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(schema, table) for schema, table in names)


def _sql_name(name: str) -> str:
    """The name as SQL would need it (for messages)."""
    plain = name.replace("_", "a").isalnum() and name.islower() and name.isascii() and not name[0].isdigit()
    return name if plain else '"' + name.replace('"', '""') + '"'
