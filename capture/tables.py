"""Captured tables: which ones, their columns, their keys, and what to hide.

Selection: ``--tables``/``--exclude-tables`` are ``schema.table`` patterns (fnmatch:
``public.*``, ``sales.order_*``); system schemas are never captured. Columns:
``exclude_columns`` (``schema.table.column`` patterns) are dropped from every image;
``mask_columns`` are replaced by ``sha256(salt ‖ text)`` in hex, so equal values still
compare equal downstream without revealing them.

Keys (the record key of every change event, JSON ``{column: value}`` in key order):

1. the primary key, else
2. columns configured for the table (``key_columns``, Debezium's ``message.key.columns``), else
3. the replica identity index (``REPLICA IDENTITY USING INDEX``), else
4. every column, when the table has ``REPLICA IDENTITY FULL``;

5. none: a **keyless** table. What happens to it is the :class:`KeylessPolicy`
   (``--keyless-tables``): ``keyless`` (default, Debezium's behaviour) captures it with a
   null record key onto a delete-policy topic — wal2json sends no UPDATE or DELETE for
   such a table, so only its inserts (and truncates) are seen until it gets a replica
   identity; ``skip`` leaves it out; ``fail`` refuses to start, naming the fixes.
   :attr:`TableCatalog.keyless` lists the keyless tables captured, :attr:`TableCatalog.skipped`
   those left out.

With pgoutput the catalog also follows the slot's publications (capture.publications): a
table they do not hold is not captured (:attr:`TableCatalog.unpublished`), a column list
restricts the columns (it must cover the key), a row filter is kept
(:attr:`TableInfo.row_filter`) for the snapshot to apply. Stored generated columns are
left out on PostgreSQL 15 to 17 (pgoutput does not send them); from 18 they are captured
where the publication publishes them (``publish_generated_columns = stored``, or a column list
naming them: ``pg_publication_tables.attnames`` says which). Virtual generated columns (18) are
never in a row image: no plugin sends them.

Thread-safety: :class:`TableCatalog` is used by the connector thread only.
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.pq.abc import PGresult

from capture.messages import Column
from capture.pgtypes import parse_array, text_converter
from capture.publications import GENERATED_COLUMNS_SINCE, Publications, PublishedTable
from capture.slots import WAL_END
from eventstore.errors import ConfigError
from schemas.position import parse_lsn

SYSTEM_SCHEMAS = ("pg_catalog", "information_schema", "pg_toast")
# varlena types whose values can be TOASTed (and then omitted from an UPDATE by wal2json)
TOASTABLE_TYPES = ("text", "bytea", "json", "jsonb", "character varying", "xml", "tsvector", "numeric")


class TableRefusedError(ConfigError):
    """A table cannot be captured as configured (no usable key)."""


class KeylessPolicy(enum.Enum):
    """What to do with a table that has no primary key and no replica identity to key its events by.

    ``keyless`` is Debezium's behaviour: its inserts are captured with a null record key
    onto a topic with ``cleanup_policy=delete`` (a compacted topic cannot hold keyless
    records), partitioned round-robin; the plugin sends no UPDATE or DELETE for such a
    table, so those stay invisible until the table gets a replica identity.
    """

    KEYLESS = "keyless"
    SKIP = "skip"  # not captured; listed in the start-up warning and in `capture status`
    FAIL = "fail"  # refuse to start

    @classmethod
    def parse(cls, text: str) -> KeylessPolicy:
        try:
            return cls(text)
        except ValueError:
            raise ConfigError(f"--keyless-tables must be keyless, skip or fail; not {text!r}") from None


KEYLESS_WARNING = (
    "has no primary key and no replica identity: its inserts are captured with a null key, but its updates and "
    "deletes are invisible (the server does not decode them) until it gets one — ALTER TABLE … REPLICA IDENTITY "
    "FULL, or add a primary key"
)


@dataclass(frozen=True, slots=True)
class TableColumn:
    name: str
    type_name: str  # format_type(): "numeric(12,2)", "text[]", …
    type_oid: int
    # After ADD COLUMN … DEFAULT without a rewrite, the value rows written before read as
    # (pg_attribute.attmissingval, as the type's text output); None when there is none.
    missing_value: str | None = None
    attnum: int = 0  # pg_attribute.attnum: a column's identity across RENAME (0: not known)

    @property
    def toastable(self) -> bool:
        return toastable_type(self.type_name)


def toastable_type(type_name: str) -> bool:
    """Whether values of the type (format_type's name) may be TOASTed: capture keeps them for a TOAST fill."""
    return type_name.endswith("[]") or type_name.split("(")[0] in TOASTABLE_TYPES


@dataclass(frozen=True, slots=True)
class Partition:
    """A leaf partition of a partitioned table captured whole (--publish-via-partition-root)."""

    schema: str
    name: str
    oid: int
    root: tuple[str, str]  # (schema, table) of the partitioned table at the top of its tree
    constraint: str  # pg_get_partition_constraintdef: which rows it holds, bounds of the partitions above included


@dataclass(frozen=True, slots=True)
class TableInfo:
    schema: str
    name: str
    columns: tuple[TableColumn, ...]
    key: tuple[str, ...]
    key_source: str  # "primary key" | "configured" | "replica identity index" | "replica identity full" | "none"
    replica_identity: str  # d(efault) n(othing) f(ull) i(ndex)
    toastable_columns: tuple[str, ...] = ()  # non-key columns whose values may be TOASTed
    column_names: frozenset[str] = frozenset()
    column_types: frozenset[tuple[str, int]] = frozenset()  # (name, type OID): what a change must match
    qualified: str = ""  # "schema.table" (set from schema and name; a field: read for every change)
    row_filter: str | None = None  # the publication's WHERE (pgoutput): the snapshot reads only these rows
    # captured as one partitioned table (--publish-via-partition-root): its rows are its partitions'
    partitioned: bool = False

    def __post_init__(self) -> None:
        if not self.qualified:
            object.__setattr__(self, "qualified", f"{self.schema}.{self.name}")

    @classmethod
    def make(
        cls,
        schema: str,
        name: str,
        columns: tuple[TableColumn, ...],
        key: tuple[str, ...],
        source: str,
        ident: str,
        row_filter: str | None = None,
        partitioned: bool = False,
    ) -> TableInfo:
        toastable = tuple(c.name for c in columns if c.toastable and c.name not in key)
        return cls(
            schema,
            name,
            columns,
            key,
            source,
            ident,
            toastable,
            frozenset(c.name for c in columns),
            frozenset((c.name, c.type_oid) for c in columns),
            row_filter=row_filter,
            partitioned=partitioned,
        )

    def as_published(self, published: PublishedTable) -> TableInfo:
        """This table as a publication streams it: its column list (which must hold the key), its row filter."""
        listed = set(published.columns)
        columns = tuple(c for c in self.columns if c.name in listed)
        key = tuple(c.name for c in columns) if self.key_source == "replica identity full" else self.key
        missing = [k for k in key if k not in listed]
        if missing:
            raise TableRefusedError(
                f"the publication's column list of {self.qualified} leaves out its key column(s) {missing}: "
                f"add them to the list (ALTER PUBLICATION … SET TABLE {self.qualified} (…)) or exclude the table"
            )
        return TableInfo.make(self.schema, self.name, columns, key, self.key_source, self.replica_identity,
                              published.row_filter, self.partitioned)  # fmt: skip

    @property
    def keyless(self) -> bool:
        """Captured without a record key (see :class:`KeylessPolicy`)."""
        return not self.key


@dataclass(slots=True)
class TableFilter:
    include: list[str] = field(default_factory=list)  # empty: every table
    exclude: list[str] = field(default_factory=list)
    exclude_columns: list[str] = field(default_factory=list)
    mask_columns: list[str] = field(default_factory=list)
    mask_salt: str = ""
    key_columns: dict[str, list[str]] = field(default_factory=dict)
    _actions: dict[tuple[str, str, str], str] = field(default_factory=dict, repr=False, compare=False)

    def captures(self, schema: str, table: str) -> bool:
        if schema in SYSTEM_SCHEMAS:
            return False
        name = f"{schema}.{table}"
        if self.include and not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)

    def column_action(self, schema: str, table: str, column: str) -> str:
        """``keep``, ``drop`` or ``mask`` for one column (memoized: called for every value)."""
        key = (schema, table, column)
        action = self._actions.get(key)
        if action is None:
            action = self._actions[key] = self._column_action(schema, table, column)
        return action

    def _column_action(self, schema: str, table: str, column: str) -> str:
        name = f"{schema}.{table}.{column}"
        if any(fnmatch.fnmatchcase(name, p) for p in self.exclude_columns):
            return "drop"
        if any(fnmatch.fnmatchcase(name, p) for p in self.mask_columns):
            return "mask"
        return "keep"

    def mask(self, value: Any) -> str | None:
        if value is None:
            return None
        text = value if isinstance(value, str) else str(value)
        return hashlib.sha256(self.mask_salt.encode() + text.encode()).hexdigest()


# Ordinary tables only: a partitioned table ('p') holds no rows of its own, and both plugins report each change
# under its partition's name, so its rows are captured through its partitions (each with its own topic). Reading
# the parent too put every row in a second topic, once, that no change ever followed. Partition roots instead
# (--publish-via-partition-root): the tables that are no partition, partitioned ones among them, each read whole.
_TABLES_SQL = """
SELECT n.nspname, c.relname, c.relreplident, c.oid, c.relkind = 'p'
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE {which} AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
  AND n.nspname NOT LIKE 'pg_temp%%'
ORDER BY 1, 2
"""
_LEAVES = "c.relkind = 'r'"
_ROOTS = "c.relkind IN ('r', 'p') AND NOT c.relispartition"
# Every leaf partition with its root and its partition constraint (the whole chain of bounds above it).
_PARTITIONS_SQL = """
SELECT n.nspname, c.relname, c.oid::bigint, rn.nspname, r.relname, pg_get_partition_constraintdef(c.oid)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_class r ON r.oid = pg_partition_root(c.oid) JOIN pg_namespace rn ON rn.oid = r.relnamespace
WHERE c.relispartition AND c.relkind = 'r'
"""
_COLUMNS_SQL = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.atttypid,
       CASE WHEN a.atthasmissing THEN a.attmissingval::text END, a.attnum
FROM pg_attribute a WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped {generated} ORDER BY a.attnum
"""
_STORED_GENERATED_SQL = """
SELECT n.nspname, c.relname, array_agg(a.attname::text ORDER BY a.attnum)
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE a.attgenerated = 's' AND a.attnum > 0 AND NOT a.attisdropped AND c.relkind IN ('r', 'p')
GROUP BY 1, 2
"""
_STORED_GENERATED = "AND a.attgenerated IN ('', 's')"  # 's' stored, 'v' virtual (18), '' not generated
_NOT_GENERATED = "AND a.attgenerated = ''"
_INDEX_KEY_SQL = """
SELECT a.attname FROM pg_index i
JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) ON true
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = %s AND {which} ORDER BY k.ord
"""


class TableCatalog:
    """Table metadata read from the source database, refreshed when the stream shows something new."""

    def __init__(
        self,
        dsn: str,
        table_filter: TableFilter,
        keyless: KeylessPolicy = KeylessPolicy.KEYLESS,
        *,
        publications: Publications | None = None,
        generated_columns: bool = True,
        partition_root: bool = False,
    ) -> None:
        self.dsn = dsn
        # partitioned tables captured whole, partitions through them (--publish-via-partition-root)
        self.partition_root = partition_root
        # (root mode) each leaf partition → (its root, OID, partition constraint), as of the last load
        self.partitions: dict[tuple[str, str], Partition] = {}
        self._not_partitions: set[tuple[str, str]] = set()  # (root mode) names seen in the stream: no partition
        self.filter = table_filter
        self.keyless_policy = keyless
        self.publications = publications  # pgoutput: only what they publish is captured
        self.generated_columns = generated_columns  # the plugin sends stored generated columns (wal2json)
        self._tables: dict[tuple[str, str], TableInfo] = {}
        self.generation = 0  # counts load(): table infos may have changed (the native core registers them again)
        # the server's WAL position when the catalog was last read: every DDL committed before it is in it
        self.read_lsn = 0
        self.keyless: list[str] = []  # captured without a key (policy keyless), "schema.table"
        self.skipped: list[str] = []  # keyless and left out (policy skip)
        self.unpublished: list[str] = []  # captured by the filter, but in none of the publications (pgoutput)
        # stored generated columns of captured tables that no row image holds ("schema.table.column"): pgoutput
        # before 18, or a publication without publish_generated_columns
        self.generated_left_out: list[str] = []
        self.server_version = 0  # server_version_num at the last load

    def load(self, conn: psycopg.Connection[Any] | None = None) -> list[TableInfo]:
        """Every captured table (keyless ones as the policy says; with publications, as they publish it)."""
        own = conn is None
        c = conn or psycopg.connect(self.dsn, autocommit=True)
        try:
            tables, skipped, unpublished = [], [], []
            row = c.execute(f"SELECT {WAL_END}::text").fetchone()
            read_lsn = parse_lsn(row[0]) if row is not None else 0
            published = None if self.publications is None else self.publications.published(c)
            which = _ROOTS if self.partition_root else _LEAVES
            for schema, name, ident, oid, partitioned in c.execute(_TABLES_SQL.format(which=which).encode()).fetchall():
                if self.filter.captures(schema, name):
                    table = self._describe(c, schema, name, ident, oid, partitioned=bool(partitioned))
                    if table.keyless and self.keyless_policy is KeylessPolicy.SKIP:
                        skipped.append(table.qualified)
                    elif published is None:
                        tables.append(table)
                    elif (schema, name) in published:
                        tables.append(table.as_published(published[(schema, name)]))
                    else:
                        unpublished.append(table.qualified)
            self._tables = {(t.schema, t.name): t for t in tables}
            if self.partition_root:
                self.partitions = {
                    (schema, name): Partition(schema, name, int(oid), (root_schema, root), constraint)
                    for schema, name, oid, root_schema, root, constraint in c.execute(_PARTITIONS_SQL).fetchall()
                }
                self._not_partitions = set()
            stored = {(schema, name): columns for schema, name, columns in c.execute(_STORED_GENERATED_SQL).fetchall()}
            self.generated_left_out = [
                f"{t.qualified}.{column}"
                for t in tables
                for column in set(stored.get((t.schema, t.name), ())).difference(col.name for col in t.columns)
            ]
            self.server_version = c.info.server_version
            self.generation += 1
            self.read_lsn = read_lsn
            self.keyless = [t.qualified for t in tables if t.keyless]
            self.skipped = skipped
            self.unpublished = unpublished
            return tables
        finally:
            if own:
                c.close()

    def get(self, schema: str, table: str, *, partitions: bool = True) -> TableInfo | None:
        """Metadata of a table seen in the stream (None: not captured); reloads on first sight. With partition
        roots, a partition's name (wal2json's changes carry it) stands for its root's table, as the catalog has
        it now (``partitions``; False: the caller knows the partitions as of the change, capture.partitions)."""
        info = self._tables.get((schema, table))
        if info is None and self.partition_root and partitions:
            return self._partition_root(schema, table)
        if info is None and self.filter.captures(schema, table):
            self.load()
            info = self._tables.get((schema, table))
        return info

    def _partition_root(self, schema: str, table: str) -> TableInfo | None:
        """The captured root of a partition (root mode); a name not known yet reads the catalog once."""
        name = (schema, table)
        part = self.partitions.get(name)
        if part is None and name not in self._not_partitions:
            self.load()  # a partition created or attached since, or a captured table new to the stream
            info = self._tables.get(name)
            if info is not None:
                return info
            part = self.partitions.get(name)
            if part is None:
                self._not_partitions.add(name)
        return None if part is None else self._tables.get(part.root)

    def root_of(self, schema: str, table: str) -> Partition | None:
        """(Root mode) the partition ``schema.table`` as last loaded (None: not a known partition)."""
        return self.partitions.get((schema, table))

    def current(self, schema: str, table: str) -> TableInfo | None:
        """The table's info as last loaded (None: not loaded, or not captured); never reads the catalog."""
        return self._tables.get((schema, table))

    def refresh(self, schema: str, table: str) -> TableInfo | None:
        """Read one table's metadata again (a column appeared or vanished)."""
        self.load()
        return self._tables.get((schema, table))

    def _columns_sql(self, c: psycopg.Connection[Any]) -> bytes:
        """The columns a row image holds: stored generated ones where the plugin sends them (wal2json), or where
        the publications may (pgoutput on 18+, whose published column names then decide); never virtual ones."""
        stored = self.generated_columns or (
            self.publications is not None and c.info.server_version >= GENERATED_COLUMNS_SINCE
        )
        return _COLUMNS_SQL.format(generated=_STORED_GENERATED if stored else _NOT_GENERATED).encode()

    def _describe(
        self, c: psycopg.Connection[Any], schema: str, name: str, ident: str, oid: int, *, partitioned: bool = False
    ) -> TableInfo:
        columns = tuple(
            TableColumn(n, t, int(o), None if m is None else parse_array(m)[0], int(a))
            for n, t, o, m, a in c.execute(self._columns_sql(c), (oid,)).fetchall()
        )
        qualified = f"{schema}.{name}"
        names = {col.name for col in columns}
        pk = [r[0] for r in c.execute(_INDEX_KEY_SQL.format(which="i.indisprimary"), (oid,)).fetchall()]
        if pk:
            return TableInfo.make(schema, name, columns, tuple(pk), "primary key", ident, partitioned=partitioned)
        configured = self.filter.key_columns.get(qualified)
        if configured:
            missing = [k for k in configured if k not in names]
            if missing:
                raise TableRefusedError(f"key columns {missing} configured for {qualified} do not exist")
            if ident != "f":
                raise TableRefusedError(
                    f"{qualified} has no primary key: configured key columns need REPLICA IDENTITY FULL "
                    f"(ALTER TABLE {qualified} REPLICA IDENTITY FULL) so deletes carry them"
                )
            return TableInfo.make(
                schema, name, columns, tuple(configured), "configured", ident, partitioned=partitioned
            )
        if ident == "i":
            idx = [r[0] for r in c.execute(_INDEX_KEY_SQL.format(which="i.indisreplident"), (oid,)).fetchall()]
            return TableInfo.make(
                schema, name, columns, tuple(idx), "replica identity index", ident, partitioned=partitioned
            )
        if ident == "f":
            return TableInfo.make(
                schema,
                name,
                columns,
                tuple(col.name for col in columns),
                "replica identity full",
                ident,
                partitioned=partitioned,
            )
        if self.keyless_policy is KeylessPolicy.FAIL:
            raise TableRefusedError(
                f"table {qualified} has no primary key and no replica identity to key its events by: add a primary "
                f"key, set REPLICA IDENTITY FULL or USING INDEX, configure key columns for it, exclude it "
                f"(--exclude-tables {qualified}), or capture it keyless (--keyless-tables keyless)"
            )
        return TableInfo.make(schema, name, columns, (), "none", ident, partitioned=partitioned)


def qualified_name(table: TableInfo) -> str:
    """``"schema"."table"``, quoted for SQL."""
    return f"{_quote(table.schema)}.{_quote(table.name)}"


def select_columns_sql(table: TableInfo, where: str | None = None) -> str:
    """``SELECT`` of every column, uncast: a text-format result then holds each type's output text.

    Rows of a publication's row filter only (pgoutput): the snapshot holds what the stream would;
    ``where``: a further condition (a snapshot reader's ctid range).
    """
    cols = ", ".join(_quote(col.name) for col in table.columns)
    select = f"SELECT {cols} FROM {qualified_name(table)}"
    conditions = [f"({c})" for c in (table.row_filter, where) if c is not None]
    return select if not conditions else f"{select} WHERE {' AND '.join(conditions)}"


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def result_rows(res: PGresult, table: TableInfo) -> Iterator[list[Column]]:
    """The rows of a text-format result of :func:`select_columns_sql`, converted as the stream's values are.

    Uncast text is the type's output function, exactly what wal2json prints (``::text``
    differs for char(n) and inet), so snapshot and stream agree value for value.
    """
    convs = [text_converter(col.type_name, col.type_oid) for col in table.columns]
    for r in range(res.ntuples):
        row = []
        for j, col in enumerate(table.columns):
            raw = res.get_value(r, j)
            row.append(Column(col.name, col.type_name, col.type_oid, None if raw is None else convs[j](raw.decode())))
        yield row
