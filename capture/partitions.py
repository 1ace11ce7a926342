"""Partitioned tables captured whole (``--publish-via-partition-root``): which partitions a root holds, kept exact.

With the option, a partitioned table is captured as one table: its topic holds its partitions' rows (the
snapshot reads the root) and their changes (pgoutput publishes them as the root's, ``publish_via_partition_root``;
wal2json names the partition, and capture.tables maps the name to its root). A partition attached or detached
changes which rows the root holds **without a row change in the WAL**, so the topic would drift from
``SELECT * FROM root``. This module keeps it exact, acting where the DDL is in the stream: the event triggers of
capture.schema_changes (installed with the option) write, in the DDL's own transaction, the leaf partitions of
a partitioned table a command altered (OID and partition constraint each) and the root of a partition a command
created or altered. The connector holds the leaves of each captured root as of its stored position (:class:`
PartitionMap`, kept in the key state's ``meta`` under :data:`META_NAME`, so a restart resumes with the map of
the position it resumes from) and compares each message with it:

* **attached** (``ATTACH PARTITION`` of a table with rows, at any depth): the partition's rows join the root's
  topic through an incremental snapshot of the root restricted to them (``tableoid = <OID>``,
  capture.incremental: the watermarks keep it exact against the partition's changes streamed meanwhile);
* **created** (``CREATE TABLE … PARTITION OF``): empty when created, every row it gets is streamed: recorded,
  not read;
* **detached or dropped** (``DETACH PARTITION``, ``DROP TABLE``, a partitioned partition's whole subtree):
  the rows leave the root. Their keys are the root topic's live keys (capture.keystate, as of this position)
  that satisfy the partition's constraint as recorded: each gets a ``d`` event and a tombstone, in the DDL's
  transaction. PostgreSQL evaluates the constraint, on the keys (a partitioned table's primary key holds its
  partition key columns), cast to the root's column types.

A ``TRUNCATE`` of one partition (wal2json names it; with pgoutput, PostgreSQL publishes no TRUNCATE of a
partition through its root, docs/capture.md) empties only that partition: the same deletes, for its keys.

Limits, each logged when met: Avro keys are not decoded back to values (capture.converters), so a detached
partition's rows stay in an Avro topic; without the event triggers (a role that may not create them) the map is
the catalog's at each start and attach/detach while capture runs are not followed.

Thread-safety: none; owned by the connector thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg
from psycopg import sql

from capture.schema_changes import DdlMessage
from capture.tables import Partition, TableCatalog, TableInfo

log = logging.getLogger("capture.connector")

META_NAME = "partition_map"
KEYS_PER_QUERY = 2000  # keys sent to PostgreSQL per constraint check

TableName = tuple[str, str]


@dataclass(slots=True)
class Change:
    """What one DDL message did to the partitions of captured roots."""

    attached: list[tuple[TableInfo, Partition]]  # rows to read into the root's topic
    removed: list[tuple[TableInfo, Partition]]  # rows to delete from the root's topic

    def __bool__(self) -> bool:
        return bool(self.attached or self.removed)


class PartitionMap:
    """Each captured root's leaf partitions, by OID, as of the connector's position."""

    def __init__(self, catalog: TableCatalog) -> None:
        self.catalog = catalog
        self.roots: dict[TableName, dict[int, Partition]] = {}
        self._by_name: dict[TableName, Partition] | None = None  # the leaves by name, derived from ``roots``
        # the event triggers write the DDL into the stream: the map follows it (False: it is the catalog's at start,
        # and a partition it does not know is looked up in the catalog as it is now)
        self.followed = True

    # ------------------------------------------------------------------ state

    def load(self, stored: str | None) -> None:
        """The map stored with the position (``meta``), else the catalog's as last loaded (logged)."""
        self._by_name = None
        if stored is not None:
            self.roots = {}
            for root, leaves in orjson.loads(stored).items():
                schema, _, name = root.partition(".")
                self.roots[(schema, name)] = {
                    int(oid): Partition(s, n, int(oid), (schema, name), c) for oid, (s, n, c) in leaves.items()
                }
            return
        self.roots = {}
        for part in self.catalog.partitions.values():
            self.roots.setdefault(part.root, {})[part.oid] = part
        if self.roots:
            log.info("capture: partitions of %s as the catalog has them now (no map stored with the position)",
                     ", ".join(f"{s}.{n}" for s, n in sorted(self.roots)))  # fmt: skip

    def dump(self) -> str:
        return orjson.dumps({
            f"{schema}.{name}": {str(oid): [p.schema, p.name, p.constraint] for oid, p in sorted(leaves.items())}
            for (schema, name), leaves in sorted(self.roots.items())
        }).decode()  # fmt: skip

    # ------------------------------------------------------------------ a DDL in the stream

    def on_ddl(self, ddl: DdlMessage) -> Change:
        """Apply a DDL message (capture.schema_changes) to the map; what changed for captured roots."""
        self._by_name = None
        change = Change([], [])
        name = (ddl.schema, ddl.table)
        if ddl.columns is None:  # dropped: a leaf leaves its root; a dropped root takes its topic's rows with it
            self.roots.pop(name, None)
            self._remove_named(change, name)
            return change
        if ddl.partitions is not None:  # a partitioned table: its leaves now
            now = {oid: Partition(s, n, oid, name, c) for s, n, oid, c in ddl.partitions}
            if ddl.partition_root is not None:  # a partitioned partition: its leaves belong to the root above
                root = ddl.partition_root[:2]
                now = {oid: Partition(p.schema, p.name, oid, root, p.constraint) for oid, p in now.items()}
                self._place(change, root, now, ddl.command_tag, replace_all=False)
            else:
                self._place(change, name, now, ddl.command_tag, replace_all=True)
            return change
        if ddl.partition_root is not None:  # a leaf partition created or altered (attached) under a root
            schema, table, oid, constraint = ddl.partition_root
            part = Partition(ddl.schema, ddl.table, oid, (schema, table), constraint)
            self._place(change, (schema, table), {oid: part}, ddl.command_tag, replace_all=False)
            return change
        self._remove_named(change, name)  # a table that is no partition (any more): detached, if it was
        return change

    def _remove_named(self, change: Change, name: TableName) -> None:
        """The leaf called ``name`` leaves the root it was under (if any)."""
        part = self.partition_of(*name)
        if part is not None:
            del self.roots[part.root][part.oid]
            self._by_name = None
            self._removed(change, part.root, part)

    def _place(self, change: Change, root: TableName, now: dict[int, Partition], command: str, *,
               replace_all: bool) -> None:  # fmt: skip
        """``now``: leaves of ``root`` (all of them when ``replace_all``, else some) after ``command``."""
        for other, leaves in self.roots.items():  # a leaf now under ``root`` is under no other root
            if other != root:
                for oid in set(leaves) & set(now):
                    self._removed(change, other, leaves.pop(oid))
        self._by_name = None
        leaves = self.roots.setdefault(root, {})
        if replace_all:
            for oid in set(leaves) - set(now):
                self._removed(change, root, leaves.pop(oid))
        for oid, part in now.items():
            if oid in leaves:
                leaves[oid] = part  # renamed, perhaps: the same partition
                continue
            leaves[oid] = part
            info = self.catalog.current(*root)
            if info is not None and command != "CREATE TABLE":  # created empty: its rows are all streamed
                change.attached.append((info, part))

    def regroup(self, change: Change) -> None:
        """After the catalog was read again: partitions ``change`` removed from their root that sit under another
        captured root now (a partitioned partition detached: its leaves are its own now) join that one."""
        for old, part in list(change.removed):
            now = self.catalog.partitions.get((part.schema, part.name))
            if now is None or now.root == (old.schema, old.name):
                continue
            if self.holds(now.oid):
                continue
            info = self.catalog.current(*now.root)
            if info is not None:
                self.roots.setdefault(now.root, {})[now.oid] = now
                self._by_name = None
                change.attached.append((info, now))

    def _removed(self, change: Change, root: TableName, part: Partition) -> None:
        info = self.catalog.current(*root)
        if info is not None:
            change.removed.append((info, part))

    # ------------------------------------------------------------------ the keys a partition held

    def partition_of(self, schema: str, table: str) -> Partition | None:
        """The leaf ``schema.table`` of a captured root, as of the position (None: none). Asked for every change
        (wal2json names partitions): a dict lookup, the index rebuilt after the map changed."""
        if self._by_name is None:
            self._by_name = {(p.schema, p.name): p for leaves in self.roots.values() for p in leaves.values()}
        return self._by_name.get((schema, table))

    def holds(self, oid: int) -> bool:
        """Whether partition ``oid`` is a leaf of some captured root."""
        return any(oid in leaves for leaves in self.roots.values())


def keys_in(conn: psycopg.Connection[Any], table: TableInfo, part: Partition, keys: list[bytes]) -> list[bytes]:
    """Those of ``keys`` (JSON record keys of ``table``'s topic) whose row would be in ``part``: its constraint,
    evaluated by PostgreSQL on the key columns cast to the table's types (a NULL constraint: every row)."""
    if not keys:
        return []
    if not part.constraint:
        return list(keys)
    types = {c.name: c.type_name for c in table.columns}
    columns = sql.SQL(", ").join(
        sql.SQL("({} ->> {})::{} AS {}").format(
            sql.Identifier("_tideline_key"), sql.Literal(k), sql.SQL(types[k]), sql.Identifier(k)
        )
        for k in table.key
    )
    query = sql.SQL(
        "SELECT _tideline_i FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS _k(_tideline_key, _tideline_i) "
        "CROSS JOIN LATERAL (SELECT {}) AS _row WHERE {}"
    ).format(columns, sql.SQL(part.constraint))  # the server's own text of the constraint
    document = b"[" + b",".join(keys) + b"]"
    rows = conn.execute(query, (document.decode(),)).fetchall()
    return [keys[int(i) - 1] for (i,) in rows]


def chunks_in(conn: psycopg.Connection[Any], table: TableInfo, part: Partition,
              live: Iterator[list[bytes]]) -> Iterator[list[bytes]]:  # fmt: skip
    """The live keys (chunks, key order) that were the partition's rows."""
    for chunk in live:
        for start in range(0, len(chunk), KEYS_PER_QUERY):
            found = keys_in(conn, table, part, chunk[start : start + KEYS_PER_QUERY])
            if found:
                yield found
